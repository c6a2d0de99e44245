"""transformers capture (moeconf.capture) on the built-in tiny DeepSeek-V4 fixture,
against the Rust reference runtime (docs/interop.md).

Marked ``transformers`` and skipped unless torch and transformers import AND
``MOECONF_TRANSFORMERS_TESTS=1`` (torch + transformers are a ~5.6 GB install, so the
default CI run skips these). One command installs and runs them:
``python/run_interop.sh``.
"""

import glob
import os
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.transformers

if os.environ.get("MOECONF_TRANSFORMERS_TESTS") != "1":
    pytest.skip("transformers tests are opt-in: MOECONF_TRANSFORMERS_TESTS=1 (python/run_interop.sh)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moeconf  # noqa: E402
from moeconf import read_trace  # noqa: E402
from moeconf.capture import original_name, save_original  # noqa: E402

PROMPT = "why the sheep"
STEPS = 8


def _key(r):
    return (r.coord.step, r.level, r.coord.layer, r.coord.position, r.coord.phase, r.coord.path)


@pytest.fixture(scope="module")
def env(moeconf_bin, tmp_path_factory):
    """The materialized built-in fixture, Rust traces of it (f32, bf16, --capture all) and a
    helper to run the binary, all in a private cache directory."""
    root = tmp_path_factory.mktemp("interop")
    run_env = dict(os.environ, MOECONF_CACHE_DIR=str(root / "cache"), NO_COLOR="1")

    def run(*args, check=True):
        p = subprocess.run([moeconf_bin, *map(str, args)], capture_output=True, text=True, env=run_env)
        if check and p.returncode != 0:
            raise AssertionError(f"moeconf {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr}")
        return p

    traces = {}
    for prec in ("f32", "bf16"):
        traces[prec] = root / f"ref_{prec}.bin"
        run("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", STEPS,
            "--precision", prec, "--capture", "all", "-o", traces[prec])
    dirs = glob.glob(str(root / "cache" / "*" / "config.json"))
    assert len(dirs) == 1, dirs
    return {"root": root, "run": run, "model": os.path.dirname(dirs[0]), "ref": traces}


def _load(model_dir, dtype):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _capture(env, prec):
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    model = _load(env["model"], {"f32": torch.float32, "bf16": torch.bfloat16}[prec])
    tok = Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json"))
    out = env["root"] / f"hf_{prec}.bin"
    res = moeconf.capture(model, tok, PROMPT, STEPS, out, model_name="builtin:tiny-v4")  # the callable module
    return out, res


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_capture_has_every_record_of_the_reference_with_its_shape(env, prec):
    out, res = _capture(env, prec)
    hf, ref = read_trace(out), read_trace(env["ref"][prec])
    # binding: same model, tokenizer, prompt ids and decoding as `moeconf run` (diff refuses otherwise)
    for f in ("config_digest", "weights_digest", "tokenizer_digest", "prompt_ids", "prompt_text",
              "max_new_tokens", "decoding_strategy"):
        assert getattr(hf.binding, f) == getattr(ref.binding, f), f
    assert hf.binding.precision == f"hf-{prec}" and hf.binding.contract == "hf-native"
    # coverage and canonical layout: the same coordinates, each with the same dtype and shape
    # (router.topk shapes included; L2 state in the docs/operators.md layout)
    a = {_key(r): (r.dtype, r.shape) for r in ref.records}
    b = {_key(r): (r.dtype, r.shape) for r in hf.records}
    assert set(a) == set(b), (sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5])
    bad = [k for k in a if a[k] != b[k] and k[5] != "text.continuation"]  # text length follows the tokens
    assert not bad, [(k, a[k], b[k]) for k in bad[:5]]
    assert len(res.generated) == STEPS
    # the binary reads the Python capture and compares it (exit 1 = divergent, comparable; 2 = error)
    p = env["run"]("diff", env["ref"][prec], out, check=False)
    assert p.returncode == 1, p.stdout + p.stderr


def test_f32_tokens_match_and_state_is_close(env):
    out, _ = _capture(env, "f32")
    hf, ref = read_trace(out), read_trace(env["ref"]["f32"])
    ih = {_key(r): i for i, r in enumerate(hf.records)}
    toks = [(int(ref.array(i)[0]), int(hf.array(ih[_key(r)])[0]))
            for i, r in enumerate(ref.records) if r.coord.path == "token.output"]
    assert all(a == b for a, b in toks), toks
    # layer 0, prefill position 0: everything before the MoE combine agrees to f32 rounding
    # (reduction order), the combine itself by the reference's BF16 output rounding
    for i, r in enumerate(ref.records):
        c = r.coord
        if c.step == 0 and c.position == 0 and c.layer == 0 and r.level in (3, 4):
            x, y = ref.array(i).astype(np.float64), hf.array(ih[_key(r)]).astype(np.float64)
            tol = 1e-2 * max(1.0, float(np.abs(x).max())) if c.path in ("moe.combine", "layer.post_ffn_mhc") \
                else 1e-5 * max(1.0, float(np.abs(x).max()))
            assert np.abs(x - y).max() <= tol, (c.path, float(np.abs(x - y).max()))


def test_l2_state_invariants_in_the_capture(env):
    out, _ = _capture(env, "f32")
    hf = read_trace(out)
    cfg = transformers.AutoConfig.from_pretrained(env["model"])
    state = {}
    for i, r in enumerate(hf.records):
        if r.level == 2:
            state[(r.coord.step, r.coord.layer, r.coord.path)] = hf.array(i)
    for (step, layer, path), arr in state.items():
        if path != "state.cumulative_length":
            continue
        c = int(arr[0])
        kind = cfg.layer_types[layer]
        assert state[(step, layer, "state.window_kv")].shape[0] == min(c, cfg.sliding_window - 1)
        if kind == "sliding_attention":
            continue
        rate = cfg.compress_rates[kind]
        assert state[(step, layer, "state.compressor.buffer_kv")].shape[0] == c % rate
        assert int(state[(step, layer, "state.compressor.entry_count")][0]) == c // rate
        if kind == "compressed_sparse_attention":
            assert (state[(step, layer, "state.compressor.overlap_kv")].shape[0] == 0) == (c < rate)


def test_original_name_mapping():
    assert original_name("model.embed_tokens.weight") == "embed.weight"
    assert original_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert original_name("model.layers.3.attn.norm.weight") == "layers.3.attn.kv_norm.weight"
    assert original_name("model.layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    assert original_name("model.layers.0.ffn.experts.7.w2.weight") == "layers.0.ffn.experts.7.w2.weight"
    assert original_name("head.weight") == "head.weight"
    assert original_name("layers.3.attn.kv_norm.weight") == "layers.3.attn.kv_norm.weight"


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_transformers_saved_original_checkpoint_runs_identically_in_rust(env, prec):
    saved = env["root"] / "hf_saved_b"
    if not (saved / "model.safetensors").exists():
        save_original(_load(env["model"], torch.bfloat16), saved,
                      tokenizer_json=os.path.join(env["model"], "tokenizer.json"))
    out = env["root"] / f"ref_saved_{prec}.bin"
    env["run"]("run", "--model", saved, "--prompt", PROMPT, "--max-new-tokens", STEPS, "--precision", prec,
               "--capture", "all", "-o", out)
    # weights/config bytes differ (HF keeps norms in f32, writes its own config.json), values do not:
    # every record of the run is bit-identical to the run on the fixture
    p = env["run"]("diff", "--force", env["ref"][prec], out, check=False)
    assert p.returncode == 0, p.stdout
    # and transformers reloads its scheme-B output to the same logits
    ids = torch.tensor([[88, 73, 90, 263, 550]])
    with torch.no_grad():
        a = _load(env["model"], torch.float32)(input_ids=ids).logits
        b = _load(str(saved), torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)


def test_every_feature_is_captured_over_40_tokens(env):
    # 44 positions: window wrap (w = 8), HCA entries (rate 16), sparse indexer selections (T > 4)
    from tokenizers import Tokenizer

    steps = 40
    ref_path = env["root"] / "ref_f32_40.bin"
    env["run"]("run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", steps,
               "--precision", "f32", "--capture", "all", "-o", ref_path)
    torch.set_num_threads(1)
    model = _load(env["model"], torch.float32)
    out = env["root"] / "hf_f32_40.bin"
    moeconf.capture(model, Tokenizer.from_file(os.path.join(env["model"], "tokenizer.json")), PROMPT, steps, out,
                    model_name="builtin:tiny-v4")
    hf, ref = read_trace(out), read_trace(ref_path)
    assert {_key(r) for r in hf.records} == {_key(r) for r in ref.records}
    cfg = model.config
    hca = [i for i, t in enumerate(cfg.layer_types) if t == "heavily_compressed_attention"]
    entries = [r for r in hf.records if r.coord.path == "attn.compressed" and r.coord.layer in hca]
    assert len(entries) == len(hca) * (44 // cfg.compress_rates["heavily_compressed_attention"])
    assert all(r.coord.position % 16 == 15 and r.shape == [1, cfg.head_dim] for r in entries)
    sparse = [r for r in hf.records if r.coord.path == "attn.indexer_topk" and r.shape == [cfg.index_topk]
              and (r.coord.position + 1) // 4 > cfg.index_topk]
    assert sparse, "no sparse indexer selection captured"
    ih = {_key(r): i for i, r in enumerate(hf.records)}
    ids = [(ref.array(i).tolist(), hf.array(ih[_key(r)]).tolist())
           for i, r in enumerate(ref.records) if r.coord.path == "attn.indexer_topk" and r.coord.step < 8]
    assert all(a == b for a, b in ids)  # identical selections while the tokens agree
