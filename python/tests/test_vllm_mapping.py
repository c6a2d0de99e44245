"""The vLLM capture expressed as a moeconf.torch mapping (moeconf.vllm_mapping) writes the same trace
as moeconf.vllm, byte for byte, on builtin:tiny-v4-vllm (MXFP4 experts) and builtin:tiny-v4-vllm-bf16
under several capture sets: each capture runs vLLM in a fresh subprocess of the vLLM environment's
Python (``python3 -m moeconf vllm`` and ``... --mapping``, OMP_NUM_THREADS=2, bound to CPUs 0-1).
Opt-in like test_vllm_live.py: marked ``vllm``, skipped unless ``MOECONF_VLLM_TESTS=1`` and
``$MOECONF_VLLM_PYTHON`` (default /root/.cache/moeconf/venv-vllm/bin/python) imports vllm. The
refusals of the serving knobs the mapping does not express run in the default suite (no vLLM)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from moeconf.trace import read_trace
from moeconf.vllm import VllmCaptureError, cpu_refusal
from moeconf.vllm_mapping import capture

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
VPY = os.environ.get("MOECONF_VLLM_PYTHON", "/root/.cache/moeconf/venv-vllm/bin/python")
PROMPT = "why the sheep"


@pytest.mark.parametrize("kw,what", [
    ({"max_num_batched_tokens": 2}, "max_num_batched_tokens=2"),
    ({"enable_prefix_caching": True}, "prefix caching"),
    ({"enable_prefix_caching": True, "warmup": ["why the"]}, "warmup requests"),
    ({"batch_with": ["a cat"]}, "batch_with"),
])
def test_the_mapping_refuses_the_serving_knobs_it_does_not_express(tmp_path, kw, what):
    with pytest.raises(VllmCaptureError, match=f"default serving configuration.*{what}.*use moeconf.vllm"):
        capture(tmp_path / "model", PROMPT, 2, tmp_path / "x.bin", **kw)
    assert not os.listdir(tmp_path)


def _torch_python():
    """A Python that imports torch: this one, else the vLLM environment's (or skip)."""
    for py in (sys.executable, VPY):
        if os.path.exists(py) and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    pytest.skip(f"no Python with torch (this one, {VPY}): set MOECONF_VLLM_PYTHON")


def test_the_mapping_writes_the_vllm_capture_byte_for_byte_on_a_stand_in(tmp_path):
    """Both captures on vllm_fake.py's stand-in for vLLM's engine and model (vLLM's names and call
    structure, a paged fp8_ds_mla window cache, one-slot MoE calls), under four capture sets: where
    vLLM itself cannot run (its DeepSeek-V4 CPU path needs AVX-512), this proves the mapping's rules,
    steps, manual records, state and provenance against moeconf.vllm's writer."""
    py = _torch_python()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PYTHON_DIR, HERE]), OMP_NUM_THREADS="2")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    p = subprocess.run(["nice", "-n", "10", py, "-c", "import sys, vllm_fake; vllm_fake.main(sys.argv[1])", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(report) == {"all", "replay", "L0,L1,L3 no terms", "fingerprints"}
    for name, r in report.items():
        assert r["same_coords"] and r["same_notes"] and r["same_result"] and r["same_bytes"], (name, r)
    full = report["all"]
    assert {"attn.window_read", "attn.kv_fp8", "state.window_kv", "moe.term.1", "router.margin", "embed.output",
            "layer.post_attn_mhc", "ffn.hc_comb"} <= set(full["paths"])
    assert full["moe_events"] == full["reproduced"] > 0
    assert "moe.term.0" not in report["L0,L1,L3 no terms"]["paths"]


def _live():
    if os.environ.get("MOECONF_VLLM_TESTS") != "1":
        pytest.skip("vLLM tests are opt-in: MOECONF_VLLM_TESTS=1 (and the vllm-cpu 0.32.0 environment)")
    if not os.path.exists(VPY) or subprocess.run([VPY, "-c", "import vllm"], capture_output=True).returncode:
        pytest.skip(f"{VPY} cannot import vllm (set MOECONF_VLLM_PYTHON)")




def _vllm(args):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    p = subprocess.run(["nice", "-n", "10", VPY, "-m", "moeconf", "vllm", *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=1800)
    if p.returncode != 0 and "--mapping" not in args and cpu_refusal(p.stderr):
        # moeconf.vllm itself cannot run here (the CPU lacks what vLLM names): nothing to compare with
        pytest.skip(f"vLLM cannot run this fixture on this CPU (it says {cpu_refusal(p.stderr)!r}: "
                    f"{p.stderr.strip()[-300:]})")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index('{\n  "file"'):])  # vLLM logs to stdout too


@pytest.fixture(scope="module")
def models(moeconf_bin, tmp_path_factory):
    """The two fixtures' checkpoints, materialized by a one-token run into a private cache."""
    _live()
    d = tmp_path_factory.mktemp("vllm-mapping")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(d / "cache"), NO_COLOR="1")
    out = {}
    for model in ("tiny-v4-vllm", "tiny-v4-vllm-bf16"):
        subprocess.run([moeconf_bin, "run", "--model", f"builtin:{model}", "--prompt", PROMPT, "--max-new-tokens", "1",
                        "--capture", "L0", "-o", str(d / f"{model}.bin")], check=True, env=env, capture_output=True)
        out[model] = [p for p in glob.glob(str(d / "cache" / f"{model}-[0-9]*")) if os.path.isdir(p)][0]
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("model,steps,extra", [
    ("tiny-v4-vllm", 4, []),
    ("tiny-v4-vllm-bf16", 4, []),
    ("tiny-v4-vllm", 3, ["--payload-levels", "L0,L1,L2,L3"]),  # the replay set
    ("tiny-v4-vllm-bf16", 3, ["--levels", "L0,L1,L3", "--payload-levels", "L1", "--no-terms"]),
])
def test_the_mapping_writes_the_vllm_capture_byte_for_byte(models, tmp_path, model, steps, extra):
    a, b = tmp_path / "vllm.bin", tmp_path / "mapping.bin"
    base = [models[model], "--prompt", PROMPT, "--max-new-tokens", steps, "--name", f"builtin:{model}", *extra]
    ra = _vllm(base + ["-o", a])
    rb = _vllm(base + ["-o", b, "--mapping"])
    ta, tb = read_trace(str(a)), read_trace(str(b))
    assert [r.coord for r in ta.records] == [r.coord for r in tb.records]  # the same records in the same order
    assert ta.provenance.notes == tb.provenance.notes
    assert a.read_bytes() == b.read_bytes()
    ra.pop("file"), rb.pop("file")
    assert ra == rb  # tokens, forwards, threads, MoE events and their reproduction by the terms
    assert len(ta.records) > 100 and ra["forwards"] == steps
