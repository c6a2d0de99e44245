"""``moeconf.vllm`` without vLLM: the checks that refuse a run before anything is loaded or
written (vLLM's multiprocess mode, a missing or invalid thread pin, a vLLM other than 0.32.0 or
none, a model of another architecture), each a clear error naming the cause, exit code 2 from the
command line and no output file. The live capture is in test_vllm_live.py (opt-in)."""

import json
import os
import re

import pytest

from moeconf import __main__ as cli
from moeconf import vllm as mv


def test_multiprocess_mode_refused():
    with pytest.raises(mv.VllmCaptureError, match="multiprocess mode"):
        mv.check_environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "2"})


@pytest.mark.parametrize("env,match", [({}, "OMP_NUM_THREADS is not set"),
                                       ({"OMP_NUM_THREADS": ""}, "OMP_NUM_THREADS is not set"),
                                       ({"OMP_NUM_THREADS": "two"}, "not a positive integer"),
                                       ({"OMP_NUM_THREADS": "0"}, "not a positive integer")])
def test_thread_pin_required(env, match):
    with pytest.raises(mv.VllmCaptureError, match=match):
        mv.check_environment(env)


def test_pinned_environment_accepted():
    assert mv.check_environment({"OMP_NUM_THREADS": "2"}) == 2
    assert mv.check_environment({"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) == 1


@pytest.mark.parametrize("version", ["0.31.0", "0.32.1", "0.33.0+cpu"])
def test_other_vllm_versions_refused(version):
    with pytest.raises(mv.VllmCaptureError, match=re.escape(f"vLLM {version} is installed, but the capture "
                                                            f"supports only vLLM {mv.PINNED_VLLM}")):
        mv.check_version(version)


def test_pinned_version_accepted():
    assert mv.check_version("0.32.0") == "0.32.0"
    assert mv.check_version("0.32.0+cpu") == "0.32.0"
    with pytest.raises(mv.VllmCaptureError, match="not installed"):
        mv.check_version(None)


def test_model_of_another_architecture_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(mv.VllmCaptureError, match="model_type is 'llama', not 'deepseek_v4'"):
        mv.check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    with pytest.raises(mv.VllmCaptureError, match="config key 'compress_ratios' is missing"):
        mv.check_model_dir(tmp_path)
    with pytest.raises(mv.VllmCaptureError, match="cannot read the model config"):
        mv.check_model_dir(tmp_path / "nowhere")


def _released_config(**over):
    cfg = {"model_type": "deepseek_v4", "compress_ratios": [0, 4, 128], "num_hash_layers": 2, "hc_mult": 4,
           "n_routed_experts": 64, "num_experts_per_tok": 6, "num_hidden_layers": 3, "hidden_size": 256,
           "num_attention_heads": 4, "head_dim": 512, "index_head_dim": 128, "index_topk": 512}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("key,value,constraint", [
    ("head_dim", 192, "fused quant+cache"),
    ("index_head_dim", 64, "indexer's compressor"),
    ("n_routed_experts", 32, "hash_topk_cpu"),
    ("index_topk", 256, "top-k transform"),
])
def test_a_fixture_vllm_refuses_is_refused_naming_the_constraint(tmp_path, key, value, constraint):
    (tmp_path / "config.json").write_text(json.dumps(_released_config(**{key: value})))
    with pytest.raises(mv.VllmCaptureError) as e:
        mv.check_model_dir(tmp_path)
    msg = str(e.value)
    assert f"{key} = {value}" in msg and constraint in msg and "vllm/" in msg, msg
    # The accepted sizes pass.
    (tmp_path / "config.json").write_text(json.dumps(_released_config()))
    assert mv.check_model_dir(tmp_path)["head_dim"] == 512


def test_vllm_errors_are_quoted_with_their_constraint():
    # The messages vLLM 0.32.0 raises (../shared/docs/vllm-notes.md), as the capture wraps them.
    e = ValueError("Unsupported head_dim for fused quant+cache: 192")
    text = mv.explain_vllm_error(e)
    assert "'ValueError: Unsupported head_dim for fused quant+cache: 192'" in text
    assert "head_dim / index_head_dim must be 512 or 128" in text
    text = mv.explain_vllm_error(RuntimeError("hash_topk_cpu: unsupported num_experts 32"))
    assert "n_routed_experts must be 64 or 128 or 256 or 384" in text
    text = mv.explain_vllm_error(AssertionError("topk_transform_512_cpu only supports index_topk == 512."))
    assert "index_topk must be 512" in text
    # Anything else is quoted as it is, without a guessed constraint.
    assert mv.explain_vllm_error(KeyError("c1a")) == "vLLM says \"KeyError: 'c1a'\""


def test_notes_name_what_they_are():
    assert "workaround, not a supported setup" in mv.WORKAROUND_NOTE
    assert "c1a" in mv.PATCH_NOTE and "0.32.0" in mv.PATCH_NOTE
    assert set(mv.RECOMPUTED) <= {"router.scores", "router.margin", "moe.term.*", "attn.hc_pre_weights",
                                  "ffn.hc_pre_weights"}
    assert not set(mv.RECOMPUTED) & set(mv.NOT_CAPTURED)


def test_moe_experts_note_names_the_fused_experts_class():
    """The provenance note ``moeconf explain`` selects vLLM's known combine by (contract/src/backends.rs)."""
    from types import SimpleNamespace as NS

    def model(*classes):
        def layer(c):
            kernel = None if c is None else NS(fused_experts=type(c, (), {})())
            return NS(ffn=NS(experts=NS(routed_experts=NS(quant_method=NS(moe_kernel=kernel)))))
        return NS(model=NS(layers=[layer(c) for c in classes]))

    assert mv.MOE_EXPERTS_NOTE == "vllm.moe_experts"
    assert mv.moe_experts_kernel(model("CPUExpertsMxfp4", "CPUExpertsMxfp4")) == "CPUExpertsMxfp4"
    assert mv.moe_experts_kernel(model("X86CPUUnquantizedExperts")) == "X86CPUUnquantizedExperts"
    # layers that differ, or a layout the capture does not know, select no single form
    assert mv.moe_experts_kernel(model("CPUExpertsMxfp4", "X86CPUUnquantizedExperts")) == \
        "CPUExpertsMxfp4,X86CPUUnquantizedExperts"
    assert mv.moe_experts_kernel(model(None)) == "unknown"


@pytest.mark.parametrize("env,match", [({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "2"},
                                        "multiprocess mode"),
                                       ({"OMP_NUM_THREADS": None}, "OMP_NUM_THREADS is not set")])
def test_cli_refuses_without_writing(tmp_path, monkeypatch, capsys, env, match):
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    out = tmp_path / "v.bin"
    rc = cli.main(["vllm", str(tmp_path), "--prompt", "why the sheep", "--max-new-tokens", "2", "-o", str(out)])
    assert rc == 2
    assert match in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_cli_refuses_other_or_missing_vllm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(mv, "installed_vllm_version", lambda: "0.31.1")
    out = tmp_path / "v.bin"
    rc = cli.main(["vllm", str(tmp_path), "--prompt", "x", "--max-new-tokens", "1", "-o", str(out)])
    assert rc == 2
    assert "vLLM 0.31.1 is installed, but the capture supports only vLLM 0.32.0" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_decode_fp8_ds_mla():
    """One entry of vLLM's fp8_ds_mla window-cache block, built by hand: 448 E4M3 codes with 7 UE8M0
    scales (one per 64 values), then 64 BF16 values; the scales of all tokens after the token data."""
    import numpy as np

    bs, off = 4, 2
    block = np.zeros(bs * 576 + bs * 8 + 16, np.uint8)  # trailing padding as in a shared page
    codes = np.zeros(448, np.uint8)
    codes[0] = 0x38  # e=7, m=0: 1.0
    codes[1] = 0xB9  # sign, e=7, m=1: -1.125
    codes[64] = 0x01  # subnormal: 2^-9
    codes[447] = 0x7E  # e=15, m=6: 448
    rope = np.array([1.5, -2.0] + [0.0] * 62, np.float32)
    block[off * 576:off * 576 + 448] = codes
    block[off * 576 + 448:off * 576 + 576] = (rope.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    scales = np.array([127, 128, 126, 127, 127, 127, 120], np.uint8)
    block[bs * 576 + off * 8:bs * 576 + off * 8 + 7] = scales
    v = mv.decode_fp8_ds_mla(block, off, bs)
    assert v.dtype == np.float32 and v.shape == (512,)
    assert v[0] == 1.0 and v[1] == -1.125 and v[64] == 2.0 ** -9 * 2 and v[447] == 448 * 2.0 ** -7
    assert v[448] == 1.5 and v[449] == -2.0 and not v[2:64].any()
    block[off * 576 + 5] = 0x7F  # NaN code
    with pytest.raises(mv.VllmCaptureError, match="NaN"):
        mv.decode_fp8_ds_mla(block, off, bs)


def test_routed_from_terms():
    import numpy as np

    terms = [np.array([1.0, 2.0 ** -8], np.float32), np.array([2.0 ** -9, 2.0 ** -9], np.float32)]
    # 1 + 2^-9 rounds to 1 in BF16 (ties to even); 2^-8 + 2^-9 is exact
    assert mv.routed_from_terms(terms).tolist() == [1.0, 2.0 ** -8 + 2.0 ** -9]
