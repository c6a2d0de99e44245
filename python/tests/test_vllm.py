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
    codes[64] = 0x01  # subnormal 2^-9, which vLLM's attention reads through EXT as (1 + 1/8) 2^-7
    codes[65] = 0x80  # -0, read as -2^-7
    codes[128] = 0x38  # 1.0 under a scale byte 0, read as 0
    codes[447] = 0x7E  # e=15, m=6: 448
    rope = np.array([1.5, -2.0] + [0.0] * 62, np.float32)
    block[off * 576:off * 576 + 448] = codes
    block[off * 576 + 448:off * 576 + 576] = (rope.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    scales = np.array([127, 128, 0, 127, 127, 127, 120], np.uint8)
    block[bs * 576 + off * 8:bs * 576 + off * 8 + 7] = scales
    v = mv.decode_fp8_ds_mla(block, off, bs)
    assert v.dtype == np.float32 and v.shape == (512,)
    assert v[0] == 1.0 and v[1] == -1.125 and v[447] == 448 * 2.0 ** -7
    # EXT (the sparse attention's decode): the exponent-0 codes as normal numbers, zero included
    assert v[64] == 1.125 * 2.0 ** -7 * 2 and v[65] == -(2.0 ** -7) * 2 and v[66] == 2.0 ** -7 * 2
    assert v[128] == 0.0
    assert v[448] == 1.5 and v[449] == -2.0 and (v[2:64] == 2.0 ** -7).all()
    block[off * 576 + 5] = 0x7F  # NaN code
    with pytest.raises(mv.VllmCaptureError, match="NaN"):
        mv.decode_fp8_ds_mla(block, off, bs)


def test_routed_from_terms():
    import numpy as np

    terms = [np.array([1.0, 2.0 ** -8], np.float32), np.array([2.0 ** -9, 2.0 ** -9], np.float32)]
    # 1 + 2^-9 rounds to 1 in BF16 (ties to even); 2^-8 + 2^-9 is exact
    assert mv.routed_from_terms(terms).tolist() == [1.0, 2.0 ** -8 + 2.0 ** -9]


# --- the serving configuration (issue 34): options validated before vLLM starts, recorded in the
# provenance, and the traced request's rows of a batch ------------------------------------------

ENV2 = {"OMP_NUM_THREADS": "2"}


def test_cpu_lists_are_read_as_vllm_reads_them():
    assert mv.parse_cpu_list("0-2,4") == (0, 1, 2, 4)
    assert mv.parse_cpu_list("1,0") == (0, 1)  # sorted and unique, as cpu_resource_utils.parse_id_list
    for bad in ("2-1", "a", "0,,1", "-1"):
        with pytest.raises(ValueError):
            mv.parse_cpu_list(bad)


def test_thread_binding_is_checked_against_the_thread_count_and_the_allowed_cpus():
    k = mv.check_knobs(ENV2, threads_bind="0-1", allowed_cpus=[0, 1])
    assert (k.threads, k.threads_bind, k.bind_cpus) == (2, "0,1", (0, 1))
    assert mv.check_knobs(ENV2, threads_bind="nobind", allowed_cpus=[0, 1]).bind_cpus == ()
    # The default: the first OMP_NUM_THREADS CPUs this process may use; the variable when set.
    assert mv.check_knobs(ENV2, allowed_cpus=[3, 5, 7]).threads_bind == "3,5"
    assert mv.check_knobs({**ENV2, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}, allowed_cpus=[0]).threads_bind == "nobind"
    with pytest.raises(mv.VllmCaptureError, match="names 3 CPUs but OMP_NUM_THREADS=2"):
        mv.check_knobs(ENV2, threads_bind="0-2", allowed_cpus=[0, 1, 2])
    with pytest.raises(mv.VllmCaptureError, match="CPU 9 is not one this process may run on"):
        mv.check_knobs(ENV2, threads_bind="0,9", allowed_cpus=[0, 1])
    with pytest.raises(mv.VllmCaptureError, match="multiprocess engine"):
        mv.check_knobs(ENV2, threads_bind="auto", allowed_cpus=[0, 1])
    with pytest.raises(mv.VllmCaptureError, match="one CPU list per rank"):
        mv.check_knobs(ENV2, threads_bind="0|1", allowed_cpus=[0, 1])
    with pytest.raises(mv.VllmCaptureError, match="not 'nobind' or a CPU list"):
        mv.check_knobs(ENV2, threads_bind="zero", allowed_cpus=[0, 1])


def test_binding_environment_is_the_one_vllm_gives_its_worker():
    k = mv.check_knobs(ENV2, threads_bind="0-1", allowed_cpus=[0, 1])
    assert mv.knob_env(k) == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_BATCH_INVARIANT": "0",
                              "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    e = mv.knob_env(mv.check_knobs(ENV2, threads_bind="nobind", allowed_cpus=[0, 1]))
    assert "OMP_PLACES" not in e and "OMP_PROC_BIND" not in e and e["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize("value", [0, -4, True, 2.0, "64"])
def test_token_budget_must_be_a_positive_integer(value):
    with pytest.raises(mv.VllmCaptureError, match="max_num_batched_tokens"):
        mv.check_knobs(ENV2, max_num_batched_tokens=value, allowed_cpus=[0, 1])


def test_token_budget_caps_the_sequences_per_step():
    # vLLM refuses fewer batched tokens than sequences (config/scheduler.py verify_max_model_len).
    assert mv.check_knobs(ENV2, max_num_batched_tokens=64, allowed_cpus=[0, 1]).max_num_seqs == 64
    k = mv.check_knobs(ENV2, max_num_batched_tokens=8192, allowed_cpus=[0, 1])
    assert k.max_num_seqs == mv.DEFAULT_MAX_NUM_SEQS and k.max_num_batched_tokens == 8192
    assert mv.check_knobs(ENV2, allowed_cpus=[0, 1]).max_num_batched_tokens is None


def test_empty_prompts_add_no_request_and_others_are_refused():
    k = mv.check_knobs(ENV2, warmup=["", "w"], batch_with=["", "a", ""], allowed_cpus=[0, 1])
    assert k.warmup == ("w",) and k.batch_with == ("a",)
    with pytest.raises(mv.VllmCaptureError, match="batch_with must be a list"):
        mv.check_knobs(ENV2, batch_with="abc", allowed_cpus=[0, 1])


def test_batch_invariant_mode_follows_vllms_reading_of_the_variable():
    assert mv.check_knobs({**ENV2, "VLLM_BATCH_INVARIANT": "1"}, allowed_cpus=[0, 1]).batch_invariant
    assert not mv.check_knobs({**ENV2, "VLLM_BATCH_INVARIANT": "0"}, allowed_cpus=[0, 1]).batch_invariant
    assert mv.check_knobs(ENV2, batch_invariant=True, allowed_cpus=[0, 1]).batch_invariant
    with pytest.raises(mv.VllmCaptureError, match="reads it as an integer"):
        mv.check_knobs({**ENV2, "VLLM_BATCH_INVARIANT": "yes"}, allowed_cpus=[0, 1])
    # Why vLLM-CPU refuses it, with the source that does.
    assert "modular_kernel.py" in mv.BATCH_INVARIANT_REFUSAL and "cpu_moe.py" in mv.BATCH_INVARIANT_REFUSAL


def test_every_knob_is_in_the_provenance():
    k = mv.check_knobs(ENV2, threads_bind="0-1", max_num_batched_tokens=64, enable_prefix_caching=True,
                       warmup=["w x"], batch_with=["a", "b c"], allowed_cpus=[0, 1])
    notes = dict(mv.knob_notes(k, prompt_tokens=272, batch_tokens=[1, 2], warmup_tokens=[2], cached_tokens=256))
    assert notes["vllm.max_num_batched_tokens"] == "64" and notes["vllm.max_num_seqs"] == "64"
    assert notes["vllm.enable_prefix_caching"] == "true" and notes["VLLM_BATCH_INVARIANT"] == "0"
    assert notes["thread_binding"].startswith("CPUs 0,1") and "OMP_PLACES={0,1}" in notes["thread_binding"]
    assert notes["batch_sequences"].startswith("3 (the traced request first")
    assert json.loads(notes["vllm.batch_with"]) == [{"prompt": "a", "tokens": 1}, {"prompt": "b c", "tokens": 2}]
    assert notes["vllm.warmup"].startswith('[{"prompt": "w x", "tokens": 2}]')
    assert notes["vllm.prefix_cache_hit"] == ("256 of 272 prompt tokens served from the prefix cache (positions 0-255 "
                                              "of step 0 not computed in this run)")
    alone = dict(mv.knob_notes(mv.check_knobs(ENV2, allowed_cpus=[0, 1])))
    assert alone["batch_sequences"] == "1 (the traced request alone)" and "vllm.batch_with" not in alone
    assert alone["vllm.max_num_batched_tokens"] == "4096 (vLLM's CPU default)"
    assert alone["vllm.enable_prefix_caching"] == "false"


def test_environment_already_loaded_with_other_values_is_refused(monkeypatch):
    monkeypatch.setitem(mv.sys.modules, "torch", object())
    monkeypatch.setenv("OMP_PLACES", "{0}")
    with pytest.raises(mv.VllmCaptureError, match="fresh process"):
        mv._apply_env({"OMP_PLACES": "{0,1}"})
    mv._apply_env({"OMP_PLACES": "{0}"})  # the same values: nothing to change


class _Batch:
    """What the capture reads of vLLM's model runner V2 InputBatch."""

    def __init__(self, req_ids, tokens, input_ids, positions):
        import numpy as np

        self.req_ids = req_ids
        self.query_start_loc_np = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        self.cu_num_logits_np = np.arange(len(req_ids) + 1, dtype=np.int32)
        self.num_tokens = int(sum(tokens))
        self.input_ids = np.array(input_ids)
        self.positions = np.array(positions)


def test_the_traced_request_is_found_by_its_id_and_cut_to_its_rows():
    # A prefill of three requests, the traced one (id "7") second: rows 1..5, logits row 1.
    b = _Batch(["12-aa", "7-0123abcd", "13-bb"], [1, 5, 3], [9, 88, 73, 90, 263, 550, 1, 2, 3],
               [4, 0, 1, 2, 3, 4, 0, 1, 2])
    v = mv._traced_view(b, "7")
    assert v["index"] == 1 and v["rows"] == (1, 6) and v["logits_row"] == 1 and v["num_reqs"] == 3
    assert v["input_ids"] == [88, 73, 90, 263, 550] and v["positions"] == [0, 1, 2, 3, 4]
    assert v["tokens_per_req"] == [1, 5, 3]
    assert mv._traced_view(b, "1") is None  # "12-aa" and "13-bb" are not request 1
    s = mv._Step(None, v)

    class T:  # a per-token tensor of the whole batch
        def __init__(self, a):
            self.a, self.shape = a, a.shape

        def __getitem__(self, k):
            import torch

            return torch.from_numpy(self.a[k])

    pytest.importorskip("torch")
    import numpy as np

    rows = s.sel(T(np.arange(9 * 2, dtype=np.float32).reshape(9, 2)))
    assert rows.tolist() == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    with pytest.raises(mv.VllmCaptureError, match="fewer rows"):
        s.sel(T(np.zeros((4, 2), np.float32)))
    with pytest.raises(mv.VllmCaptureError, match="2 requests of this batch"):
        mv._traced_view(_Batch(["7-a", "7-b"], [1, 1], [0, 0], [0, 0]), "7")


def _fwd(positions, value, logits=None):
    import numpy as np

    s = mv._Step(list(positions), {"rows": (0, len(positions))})
    s.n = len(positions)
    s.embed = np.full((len(positions), 2), value, np.float32)
    s.logits = logits
    s.layer[0] = {"attn.norm": np.full((len(positions), 2), value, np.float32),
                  "attn.window_read": [np.full((1, 2), value, np.float32)] * len(positions),
                  "state.window_kv": np.full((1, 2), value, np.float32)}
    return s


def test_a_chunked_prefill_is_one_step():
    fw = [_fwd([0, 1], 1, "a"), _fwd([2, 3], 2, "b"), _fwd([4], 3, "c"), _fwd([5], 4, "d"), _fwd([6], 5, "e")]
    steps, per = mv.group_forwards(fw, prompt_len=5, max_new_tokens=3)
    assert per == [3, 1, 1] and [s.positions for s in steps] == [[0, 1, 2, 3, 4], [5], [6]]
    s0 = steps[0]
    assert s0.n == 5 and s0.logits == "c"  # the last chunk's logits and state
    assert s0.embed[:, 0].tolist() == [1, 1, 2, 2, 3]
    assert s0.layer[0]["attn.norm"][:, 0].tolist() == [1, 1, 2, 2, 3]
    assert len(s0.layer[0]["attn.window_read"]) == 5 and s0.layer[0]["state.window_kv"][0, 0] == 3
    # Only the steps asked for.
    assert len(mv.group_forwards(fw, 5, 2)[0]) == 2


def test_a_prefix_cache_hit_starts_the_prefill_past_zero():
    steps, per = mv.group_forwards([_fwd(range(256, 272), 1), _fwd([272], 2)], 272, 2)
    assert steps[0].positions[0] == 256 and per == [1, 1]


@pytest.mark.parametrize("positions,match", [
    ([[0, 1], [3, 4], [5]], "skip from position 2 to 3"),
    ([[0, 1, 2], [3, 4, 5, 6]], "prompt and generated"),
    ([[0, 2, 3]], "not contiguous"),
    ([[0, 1], [2, 3]], "did not reach the last prompt position"),
])
def test_forwards_that_are_not_one_run_are_refused(positions, match):
    with pytest.raises(mv.VllmCaptureError, match=match):
        mv.group_forwards([_fwd(p, 0) for p in positions], prompt_len=5, max_new_tokens=2)


@pytest.mark.parametrize("args,match", [
    (["--max-num-batched-tokens", "0"], "not a positive integer"),
    (["--threads-bind", "auto"], "multiprocess engine"),
    (["--threads-bind", "0-3"], "names 4 CPUs but OMP_NUM_THREADS=2"),
])
def test_cli_refuses_bad_knobs_before_vllm_starts(tmp_path, monkeypatch, capsys, args, match):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(mv.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    out = tmp_path / "v.bin"
    rc = cli.main(["vllm", str(tmp_path), "--prompt", "x", "--max-new-tokens", "1", "-o", str(out), *args])
    assert rc == 2
    assert match in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_cpu_features_read_the_flags_that_pick_vllms_kernels(tmp_path):
    from moeconf.vllm import CPU_REFUSALS, cpu_features, cpu_note, cpu_refusal

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: amx_tile\n")
    name, feats = cpu_features(str(info))
    assert (name, feats) == ("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}))  # the first CPU's
    assert cpu_note(name, feats) == "AMD EPYC (avx512f: yes, avx512_bf16: yes, amx_tile: no)"
    assert cpu_features(str(tmp_path / "missing")) == ("unknown", frozenset())
    amx_refusal = f"vLLM says 'CPUFp8BlockScaledMMKernel {CPU_REFUSALS[0]} (Sapphire Rapids or newer)'"
    # a refusal is the machine's limit only where the CPU lacks what vLLM names
    assert cpu_refusal(amx_refusal, feats) == CPU_REFUSALS[0]
    assert cpu_refusal(amx_refusal, feats | {"amx_tile"}) is None
    assert cpu_refusal(f"'_C' object {CPU_REFUSALS[1]}", frozenset({"avx512f"})) == CPU_REFUSALS[1]
    assert cpu_refusal(f"'_C' object {CPU_REFUSALS[1]}", feats) is None
    assert cpu_refusal("some other error", frozenset()) is None
