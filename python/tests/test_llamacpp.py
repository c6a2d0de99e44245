"""``moeconf.llamacpp`` without llama.cpp: the ggml_tensor struct layout, node-name parsing, the
mapping from observed ggml nodes to moeconf records (per-token slicing, the hc_pre/hc_post/hc_comb
occurrences of the two halves, compressor entries only where a window closes, the indexer's
masked entries), the persistent-state rings, the GGUF checks (another architecture, a missing
tensor, an unsupported compress ratio, a non-GGUF file: exit 2 from ``python3 -m moeconf llamacpp``),
the build checks (a libllama without ``deepseek4``, llama.cpp's own load failure, no llama-cpp-python:
with a stand-in ``llama_cpp`` module), and — with the Rust binary — the
exported GGUF read back by the ``gguf`` package: its own reader and dequantizers give exactly
the checkpoint's values (FP8 and MXFP4 decoded here independently), and its MXFP4 blocks have
ggml's layout.

The opt-in run against a real llama.cpp is ``python/run_llamacpp.sh``.
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from moeconf import llamacpp as lc

gguf = pytest.importorskip("gguf")
if not hasattr(gguf, "GGUFWriter"):
    # Run from the repository root, `import gguf` finds the Rust crate's folder gguf/ as a
    # namespace package, not the PyPI package.
    pytest.skip("the gguf package is not installed (found a folder named gguf instead)", allow_module_level=True)


# --------------------------------------------------------------------------- struct and names

def test_ggml_tensor_struct_matches_ggml_h():
    # ggml/include/ggml.h (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)
    offsets = {f: getattr(lc.GgmlTensor, f).offset for f, _ in lc.GgmlTensor._fields_}
    assert offsets["type"] == 0 and offsets["buffer"] == 8 and offsets["ne"] == 16 and offsets["nb"] == 48
    assert offsets["op"] == 80 and offsets["op_params"] == 84 and offsets["flags"] == 148
    assert offsets["src"] == 152 and offsets["view_src"] == 232 and offsets["data"] == 248
    assert offsets["name"] == 256 and offsets["extra"] == 320
    assert ctypes.sizeof(lc.GgmlTensor) == 336
    lc.check_tensor_struct(336 + lc.GGML_OBJECT_SIZE)          # ggml_tensor_overhead() of this ggml
    with pytest.raises(lc.LlamaCppError, match="ggml_tensor_overhead"):
        lc.check_tensor_struct(400)


def test_node_names_split_into_base_and_layer():
    assert lc.split_name("hc_pre-3") == ("hc_pre", 3)
    assert lc.split_name("ffn_moe_weights_scaled-12") == ("ffn_moe_weights_scaled", 12)
    assert lc.split_name("result_output") == ("result_output", None)
    assert lc.split_name("q-0 (view)") == ("q-0 (view)", None)    # views are not rule nodes


def test_the_rule_table_names_every_record_once_per_half():
    paths = [r[3] for r in lc.NODE_RULES]
    for p in ("attn.hc_pre_weights", "ffn.hc_pre_weights", "attn.hc_comb", "ffn.hc_comb", "router.topk",
              "moe.term.*", "moe.routed", "moe.combine", "layer.post_attn_mhc", "layer.post_ffn_mhc"):
        assert p in paths, p
    occ = {(r[0], r[3]): r[2] for r in lc.NODE_RULES}
    assert occ[("hc_pre", "attn.hc_pre_weights")] == 0 and occ[("hc_pre", "ffn.hc_pre_weights")] == 1
    assert not set(lc.RECOMPUTED) & set(lc.NOT_CAPTURED)
    assert all(p not in paths for p in lc.NOT_CAPTURED)


# --------------------------------------------------------------------------- mapping

def _cfg(**kw):
    base = dict(path="m.gguf", n_layer=4, hidden=8, hc_mult=4, n_head=2, head_dim=4, n_expert=8, k=2, n_vocab=16,
                ratios=[0, 4, 128, 0], n_hash=1, index_head_dim=4, index_topk=2, window=3, export_type="bf16",
                source_weights_digest=None, source_config_digest=None, source_tokenizer_digest=None)
    base.update(kw)
    return lc.GgufModel(**base)


def _fill(nodes, layer, base, op, shape, start):
    """A node of numpy shape ``shape`` (ggml ne reversed) with distinct values."""
    a = (np.arange(int(np.prod(shape)), dtype=np.float32) + start).reshape(shape)
    nodes.add(layer, base, op, a)
    return a


def _layer_nodes(cfg, layer, nt, n_blocks=1):
    n = lc.StepNodes()
    d, hc, h, hd, e, k = cfg.hidden, cfg.hc_mult, cfg.n_head, cfg.head_dim, cfg.n_expert, cfg.k
    v = 1000.0
    for occ in (0, 1):  # attention half, then FFN half, in graph order
        _fill(n, layer, "hc_pre", "SCALE", (nt, hc), v + occ * 100)
        _fill(n, layer, "hc_post", "SCALE", (nt, hc), v + 10 + occ * 100)
        _fill(n, layer, "hc_comb", "DSV4_HC_COMB", (nt, hc, hc), v + 20 + occ * 100)
    _fill(n, layer, "hc_attn_pre", "DSV4_HC_PRE", (nt, d), 1)
    _fill(n, layer, "attn_norm", "MUL", (nt, d), 2)
    _fill(n, layer, "q", "ROPE", (nt, h, hd), 3)
    _fill(n, layer, "kv", "ROPE", (nt, 1, hd), 4)
    ratio = cfg.ratios[layer]
    if ratio:
        tag = "csa" if ratio == 4 else "hca"
        _fill(n, layer, f"{tag}_state_compress", "ROPE", (n_blocks, 1, hd), 5)
        core = "attn_csa_lid" if ratio == 4 else "attn_hca"
    else:
        core = "attn_raw"
    if ratio == 4:
        _fill(n, layer, "lid_state_compress", "ROPE", (n_blocks, 1, cfg.index_head_dim), 6)
    _fill(n, layer, core, "CONT", (nt, h * hd), 7)
    _fill(n, layer, "attn_out", "MUL_MAT", (nt, d), 8)
    _fill(n, layer, "hc_attn_post", "DSV4_HC_POST", (nt, hc, d), 9)
    _fill(n, layer, "hc_ffn_pre", "DSV4_HC_PRE", (nt, d), 10)
    _fill(n, layer, "ffn_norm", "MUL", (nt, d), 11)
    _fill(n, layer, "ffn_moe_probs", "SQRT", (nt, 1, e), 12)
    n.add(layer, "ffn_moe_topk", "VIEW", np.array([[3, 5]] * nt, dtype=np.int32))
    _fill(n, layer, "ffn_moe_weights_scaled", "SCALE", (nt, k, 1), 13)
    if layer >= cfg.n_hash:
        n.add(layer, "ffn_moe_probs_biased", "ADD", np.tile(np.array([0.1, 0.9, 0.5, 0.7, 0.2, 0.6, 0.3, 0.4],
                                                                     np.float32), (nt, 1)))
    _fill(n, layer, "ffn_moe_weighted", "MUL", (nt, k, d), 14)
    _fill(n, layer, "ffn_moe_out", "ADD", (nt, d), 15)
    _fill(n, layer, "ffn_shexp", "MUL_MAT", (nt, d), 16)
    _fill(n, layer, "ffn_out", "ADD", (nt, d), 17)
    _fill(n, layer, "l_last", "DSV4_HC_POST", (nt, hc, d), 18)
    return n


def test_a_prefill_maps_every_token_in_the_reference_order():
    cfg = _cfg()
    nodes = _layer_nodes(cfg, 0, nt=3)
    recs = lc.assemble_layer(nodes, cfg, 0, [0, 1, 2])
    paths = [p for _, p, _ in recs[1]]
    assert paths[:7] == ["attn.hc_pre_weights", "attn.hc_post_weights", "attn.hc_comb", "attn.hc_pre", "attn.norm",
                         "attn.q", "attn.kv"]
    assert paths[-5:] == ["moe.term.1", "moe.routed", "moe.shared", "moe.combine", "layer.post_ffn_mhc"]
    assert "router.margin" not in paths                      # layer 0 is hash-routed
    got = {p: a for _, p, a in recs[1]}
    # Token 1's rows; the FFN half's weights are the second occurrence of the same node names.
    assert got["attn.hc_pre_weights"].tolist() == [1004.0, 1005.0, 1006.0, 1007.0]
    assert got["ffn.hc_pre_weights"].tolist() == [1104.0, 1105.0, 1106.0, 1107.0]
    assert got["attn.hc_comb"].shape == (4, 4) and got["attn.q"].shape == (2, 4)
    assert got["attn.kv"].shape == (4,) and got["layer.post_attn_mhc"].shape == (4, 8)
    assert got["router.topk"].dtype == np.int32 and got["router.topk"].tolist() == [3, 5]
    assert got["moe.term.0"].tolist() == (np.arange(16, 24, dtype=np.float32) + 14).tolist()
    assert got["attn.core"].shape == (2, 4)


def test_compressor_entries_exist_only_where_a_window_closes_and_padding_blocks_are_dropped():
    cfg = _cfg()
    # CSA layer 1, a prefill of positions 0..5: one window closes (position 3); the graph
    # computed two blocks (the second is llama.cpp's padding block).
    nodes = _layer_nodes(cfg, 1, nt=6, n_blocks=2)
    n = lc.StepNodes()
    n.nodes.update(nodes.nodes)
    scores = np.full((6, 256), -np.inf, np.float32)
    scores[3:, 0] = 2.0
    n.add(1, "lid_score_masked", "LIGHTNING_INDEXER", scores)
    n.add(1, "lid_top_k", "CONT", np.array([[1, 0]] * 6, dtype=np.int32))
    recs = lc.assemble_layer(n, cfg, 1, list(range(6)))
    at = {p: {path: a for _, path, a in recs[p]} for p in range(6)}
    assert [p for p in range(6) if "attn.compressed" in at[p]] == [3]
    assert at[3]["attn.compressed"].shape == (1, 4) and at[3]["attn.compressed"][0, 0] == 5.0
    assert at[3]["attn.indexer_compressed"].shape == (1, 4)
    # One entry visible from position 3 on: index 1 (masked) is dropped, the score is observed.
    assert at[2]["attn.indexer_topk"].tolist() == [] and at[2]["attn.indexer_scores"].shape == (0,)
    assert at[5]["attn.indexer_topk"].tolist() == [0] and at[5]["attn.indexer_scores"].tolist() == [2.0]
    # Score-routed: the margin is rank k minus rank k+1 of the selection scores (0.7 - 0.6).
    assert at[0]["router.margin"].tolist() == [np.float32(0.7) - np.float32(0.6)]


def test_a_graph_without_a_mapped_node_is_an_error_naming_it():
    cfg = _cfg()
    nodes = _layer_nodes(cfg, 0, nt=1)
    del nodes.nodes[(0, "attn_out", "MUL_MAT")]
    with pytest.raises(lc.LlamaCppError, match=r"attn_out-0 \(MUL_MAT"):
        lc.assemble_layer(nodes, cfg, 0, [0])
    nodes = _layer_nodes(cfg, 0, nt=2)
    with pytest.raises(lc.LlamaCppError, match="expected 3 rows"):
        lc.assemble_layer(nodes, cfg, 0, [0, 1, 2])


def test_state_rings_give_the_open_window_the_overlap_and_the_stored_entries():
    cfg = _cfg()
    n = lc.StepNodes()
    # CSA layer 1 after c = 6 tokens: ring of 8 rows (position p at row p % 8) of width 2 * 4.
    kv = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    score = kv + 1000
    n.add(None, "dsv4_csa_state_kv_l1", "SET_ROWS", kv)
    n.add(None, "dsv4_csa_state_score_l1", "SET_ROWS", score)
    n.add(None, "dsv4_lid_state_kv_l1", "SET_ROWS", kv)
    n.add(None, "dsv4_lid_state_score_l1", "SET_ROWS", score)
    cache = np.arange(256 * 4, dtype=np.float16).reshape(256, 4)
    n.add(None, "compressed_cache_l1", "SET_ROWS", cache)
    window = (np.arange(16 * 4, dtype=np.float16) / 4).reshape(16, 4)
    for layer in (0, 1):
        n.add(None, f"raw_cache_l{layer}", "SET_ROWS", window)
    cells = {p: 10 - p for p in range(6)}          # any cell of the window cache, as the write indices say
    recs = dict(lc.layer_state_records(n, cfg, 1, 6, cells))
    assert recs["state.cumulative_length"].tolist() == [6]
    # The last window - 1 = 2 kv vectors, oldest first, read from their cells (F16 storage).
    assert recs["state.window_kv"].tolist() == window[[6, 5]].astype(np.float32).tolist()
    assert recs["state.compressor.buffer_kv"].tolist() == kv[4:6].tolist()       # positions 4, 5
    assert recs["state.compressor.entry_count"].tolist() == [1]
    assert recs["state.compressor.compressed_kv"].tolist() == cache[:1].astype(np.float32).tolist()
    assert recs["state.compressor.overlap_kv"].tolist() == kv[0:4, :4].tolist()  # window 0, Ca half
    assert recs["state.compressor.overlap_gate"].tolist() == score[0:4, :4].tolist()
    assert "state.indexer.compressed_kv" not in recs and "state.compressor.buffer_gate" not in recs
    # A sliding layer has the counter and the window; an unknown cell is an error.
    assert [p for p, _ in lc.layer_state_records(n, cfg, 0, 6, cells)] == ["state.cumulative_length", "state.window_kv"]
    with pytest.raises(lc.LlamaCppError, match="position 5"):
        lc.layer_state_records(n, cfg, 0, 6, {4: 0})


# --------------------------------------------------------------------------- GGUF checks

def _write_gguf(path, arch="deepseek4", ratios=(0, 4), drop=(), n_hash=1, as_string=()):
    w = gguf.GGUFWriter(str(path), arch)
    n = len(ratios)
    if arch == "deepseek4":
        for key, val in (("block_count", n), ("embedding_length", 8), ("hyper_connection.count", 4),
                         ("attention.head_count", 2), ("attention.key_length", 4), ("expert_count", 8),
                         ("expert_used_count", 2), ("hash_layer_count", n_hash), ("attention.indexer.key_length", 64),
                         ("attention.indexer.top_k", 2), ("attention.sliding_window", 8)):
            if key in as_string:
                w.add_string(f"deepseek4.{key}", str(val))
            else:
                w.add_uint32(f"deepseek4.{key}", val)
        w.add_array("deepseek4.attention.compress_ratios", list(ratios))
    w.add_token_list(["a", "b", "c"])
    names = ["token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
             "output_hc_base.weight", "output_hc_scale.weight"]
    for il, r in enumerate(ratios):
        names += lc._layer_tensors(il, r, il < n_hash)
    for name in names:
        if name not in drop:
            w.add_tensor(name, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_check_gguf_accepts_a_complete_deepseek4_file(tmp_path):
    m = lc.check_gguf(_write_gguf(tmp_path / "ok.gguf"))
    assert (m.n_layer, m.ratios, m.n_hash, m.index_head_dim) == (2, [0, 4], 1, 64)


def test_check_gguf_refuses_another_architecture_a_missing_tensor_and_a_bad_ratio(tmp_path):
    with pytest.raises(lc.LlamaCppError, match=r"general.architecture is 'llama', not 'deepseek4'"):
        lc.check_gguf(_write_gguf(tmp_path / "llama.gguf", arch="llama"))
    with pytest.raises(lc.LlamaCppError, match=r"tensor blk.1.indexer.proj.weight is missing"):
        lc.check_gguf(_write_gguf(tmp_path / "miss.gguf", drop=("blk.1.indexer.proj.weight",)))
    with pytest.raises(lc.LlamaCppError, match=r"compress ratios \[16\].*0, 4 and 128"):
        lc.check_gguf(_write_gguf(tmp_path / "r16.gguf", ratios=(0, 16)))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(lc.LlamaCppError, match="not a readable GGUF"):
        lc.check_gguf(tmp_path / "junk.gguf")


def test_a_llama_cpp_build_without_deepseek4_is_recognized(tmp_path):
    (tmp_path / "libllama.so").write_bytes(b"\x7fELF...llama\0qwen3\0")
    assert not lc.llama_supports_deepseek4(str(tmp_path))
    (tmp_path / "libllama.so").write_bytes(b"\x7fELF...deepseek4\0qwen3\0")
    assert lc.llama_supports_deepseek4(str(tmp_path))
    with pytest.raises(lc.LlamaCppError, match="no libllama"):
        lc.llama_supports_deepseek4(str(tmp_path / "nowhere"))


def _py_capture(gguf_path, tmp_path, *extra):
    """``python3 -m moeconf llamacpp GGUF ...`` as a user runs it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-m", "moeconf", "llamacpp", str(gguf_path), "--model-dir", str(model_dir),
                           "--prompt", "hi", "--max-new-tokens", "1", "-o", str(tmp_path / "out.bin"), *extra],
                          capture_output=True, text=True, env=env)


def test_the_capture_command_refuses_bad_gguf_files_with_exit_2_naming_the_file(tmp_path):
    # Checked with the gguf package before llama.cpp is touched, so the same errors come with or
    # without llama-cpp-python installed.
    cases = [
        (_write_gguf(tmp_path / "llama.gguf", arch="llama"), "general.architecture is 'llama', not 'deepseek4'"),
        (_write_gguf(tmp_path / "miss.gguf", drop=("blk.0.ffn_down_exps.weight",)),
         "tensor blk.0.ffn_down_exps.weight is missing"),
        (_write_gguf(tmp_path / "r16.gguf", ratios=(0, 16)), "only 0, 4 and 128"),
        (_write_gguf(tmp_path / "str.gguf", as_string=("block_count",)),
         "metadata key deepseek4.block_count is '2' (str), not an integer"),
        (_write_gguf(tmp_path / "strk.gguf", as_string=("expert_used_count",)),
         "metadata key deepseek4.expert_used_count is '2' (str), not an integer"),
    ]
    st = tmp_path / "model.safetensors"
    st.write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    cases.append((st, "not a readable GGUF file"))
    cases.append((tmp_path / "absent.gguf", "not a readable GGUF file"))
    for path, why in cases:
        r = _py_capture(path, tmp_path)
        assert r.returncode == 2, (path, r.returncode, r.stderr)
        assert str(path) in r.stderr and why in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "out.bin").exists()


def _fake_llama_cpp(monkeypatch, tmp_path, lib_bytes, load_log=None):
    """Installs a stand-in ``llama_cpp`` package (no llama.cpp): its lib directory holds a
    ``libllama.so`` of ``lib_bytes``; model loading fails after logging ``load_log``, as
    llama.cpp's loader does for an architecture it does not know."""
    pkg = tmp_path / "fake_llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / "libllama.so").write_bytes(lib_bytes)
    mod = types.ModuleType("llama_cpp")
    mod.__file__ = str(pkg / "__init__.py")
    mod.__version__ = "0.0.0-fake"
    ll = types.ModuleType("llama_cpp.llama_cpp")
    logger = []
    ll.llama_log_callback = lambda f: f
    ll.llama_log_set = lambda cb, ud: logger.append(cb)
    ll.llama_backend_init = lambda: None
    ll.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)

    def load(path, params):
        assert params.use_extra_bufts is False
        for cb in logger:
            cb(2, (load_log or "").encode(), None)
        return None

    ll.llama_model_load_from_file = load
    mod.llama_cpp = ll
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", ll)

    class NoGgml:
        def __init__(self, lib_dir):
            pass

    monkeypatch.setattr(lc, "_Ggml", NoGgml)
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return model_dir


def test_capture_refuses_a_llama_cpp_build_without_deepseek4_before_loading(monkeypatch, tmp_path):
    g = _write_gguf(tmp_path / "ok.gguf")
    model_dir = _fake_llama_cpp(monkeypatch, tmp_path, b"\x7fELF...llama\0qwen3\0deepseek2\0")
    with pytest.raises(lc.LlamaCppError, match=r"0.0.0-fake .*no 'deepseek4' architecture .*0.3.36"):
        lc.capture(g, "hi", 1, tmp_path / "out.bin", model_dir=model_dir, check_identity=False)
    assert not (tmp_path / "out.bin").exists()


def test_capture_reports_llama_cpps_own_load_failure_naming_the_file(monkeypatch, tmp_path):
    # A build that names deepseek4 but cannot load this file (another llama.cpp's graph, a
    # tensor of the wrong shape): llama.cpp's own log lines are the reason given.
    g = _write_gguf(tmp_path / "ok.gguf")
    model_dir = _fake_llama_cpp(monkeypatch, tmp_path, b"\x7fELF...deepseek4\0",
                                load_log="llama_model_load: error loading model: check_tensor_dims: tensor "
                                         "'blk.0.attn_q_a.weight' has wrong shape\n")
    with pytest.raises(lc.LlamaCppError) as e:
        lc.capture(g, "hi", 1, tmp_path / "out.bin", model_dir=model_dir, check_identity=False)
    msg = str(e.value)
    assert str(g) in msg and "llama.cpp could not load the model" in msg and "has wrong shape" in msg, msg
    assert not (tmp_path / "out.bin").exists()


def test_capture_without_llama_cpp_installed_says_how_to_get_it(monkeypatch, tmp_path):
    g = _write_gguf(tmp_path / "ok.gguf")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)     # import llama_cpp raises ImportError
    with pytest.raises(lc.LlamaCppError, match=r"llama-cpp-python is not importable .*run_llamacpp.sh"):
        lc.capture(g, "hi", 1, tmp_path / "out.bin", model_dir=tmp_path, check_identity=False)


# --------------------------------------------------------------------------- the exported GGUF

def _e4m3(c):
    sign = -1.0 if c & 0x80 else 1.0
    exp, man = (c >> 3) & 15, c & 7
    if exp == 15 and man == 7:
        return np.nan
    return sign * (2.0 ** (exp - 7) * (1 + man / 8) if exp else 2.0 ** -6 * man / 8)


E4M3 = np.array([_e4m3(c) for c in range(256)], np.float64)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)

    def get(name):
        h = header[name]
        a, b = h["data_offsets"]
        return h["dtype"], h["shape"], data[a:b]
    return get


def _decode(get, name, rows, cols):
    """The checkpoint's values of a weight, decoded here from the format's field definitions."""
    dtype, shape, raw = get(name)
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    _, sshape, sraw = get(name[:-len(".weight")] + ".scale")
    scale = 2.0 ** (np.frombuffer(sraw, np.uint8).astype(np.float64) - 127)
    if dtype == "F8_E4M3":
        codes = np.frombuffer(raw, np.uint8).reshape(rows, cols)
        s = np.repeat(np.repeat(scale.reshape(sshape), 128, 0), 128, 1)[:rows, :cols]
        return (E4M3[codes] * s).astype(np.float32)
    packed = np.frombuffer(raw, np.uint8).reshape(rows, cols // 2)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, cols)
    return (E2M1[codes] * np.repeat(scale.reshape(rows, cols // 32), 32, 1)).astype(np.float32)


def test_the_exported_gguf_reads_back_through_the_gguf_package_as_the_checkpoints_values(run_moeconf, tmp_path):
    out = tmp_path / "native.gguf"
    r = run_moeconf("export", "gguf", "--model", "builtin:tiny-v4-fp8", "--type", "native", "-o", out)
    assert "bit-identical" in r.stdout
    m = lc.check_gguf(out)
    assert (m.n_layer, m.ratios[:4], m.export_type) == (9, [0, 0, 4, 128], "native")
    model_dir = next((tmp_path / "cache").glob("tiny-v4-fp8-[0-9]*"))
    get = _safetensors(model_dir / "model.safetensors")
    reader = gguf.GGUFReader(str(out))
    t = {x.name: x for x in reader.tensors}
    # MXFP4 experts: ggml's block layout (1 scale byte + 16 code bytes per 32 values), dequantized
    # by the gguf package's own MXFP4 dequantizer, equal the E2M1 x UE8M0 values of the checkpoint.
    exps = t["blk.4.ffn_down_exps.weight"]
    assert exps.tensor_type == gguf.GGMLQuantizationType.MXFP4
    raw = np.asarray(exps.data).reshape(-1)
    assert raw.size == 32 * 256 * (128 // 32) * 17
    deq = gguf.quants.dequantize(np.asarray(exps.data), gguf.GGMLQuantizationType.MXFP4).reshape(32, 256, 128)
    for e in (0, 7, 31):
        want = _decode(get, f"layers.4.ffn.experts.{e}.w2.weight", 256, 128)
        assert np.array_equal(deq[e], want), e          # values equal (ggml's +0 for the -0 code)
    # Block layout by hand: scale byte, then element j in the low nibble, j + 16 in the high nibble.
    blk = raw[:17]
    _, _, packed = get("layers.4.ffn.experts.0.w2.weight")
    _, _, sc = get("layers.4.ffn.experts.0.w2.scale")
    codes = np.stack([np.frombuffer(packed, np.uint8)[:16] & 15, np.frombuffer(packed, np.uint8)[:16] >> 4], -1).reshape(32)
    assert blk[0] == sc[0] and (blk[1:] & 15).tolist() == codes[:16].tolist() and (blk[1:] >> 4).tolist() == codes[16:].tolist()
    # gguf's own MXFP4 quantizer, on the dequantized values of the whole tensor, gives back the
    # exported blocks byte for byte wherever it picks the checkpoint's scale (it derives the
    # scale from the block maximum: floor(log2 amax) - 2, so blocks whose largest code is 4 or 6),
    # up to the one code it never emits: E2M1 -0 (0b1000), which it writes as +0 (0b0000).
    ours = raw.reshape(-1, 17)
    requant = gguf.quants.quantize(deq.reshape(-1, 32), gguf.GGMLQuantizationType.MXFP4).reshape(-1, 17)
    assert requant.shape == ours.shape
    same_scale = requant[:, 0] == ours[:, 0]
    lo, hi = ours[:, 1:] & 15, ours[:, 1:] >> 4
    plus_zero = np.concatenate([ours[:, :1], np.where(lo == 8, 0, lo) | (np.where(hi == 8, 0, hi) << 4)], axis=1)
    assert same_scale.sum() > ours.shape[0] // 2, (same_scale.sum(), ours.shape[0])
    assert np.array_equal(requant[same_scale], plus_zero[same_scale].astype(np.uint8))
    assert ((lo == 8) | (hi == 8))[same_scale].any()          # the -0 code does occur: the mapping is exercised
    # Where it picks another scale, the block is one the checkpoint scaled more coarsely than
    # needed (its largest code below 4): gguf's scale is smaller, never larger.
    assert (requant[~same_scale, 0] < ours[~same_scale, 0]).all()
    # FP8 dense projections are their exact values in BF16 (this ggml has no block-scaled FP8).
    q = t["blk.2.attn_q_b.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    got = gguf.quants.dequantize(np.asarray(q.data), gguf.GGMLQuantizationType.BF16).reshape(1536, 128)
    assert np.array_equal(got, _decode(get, "layers.2.attn.wq_b.weight", 1536, 128))


# --------------------------------------------------------------------------- llama.cpp's settings (knobs)

def test_knobs_default_to_the_captures_settings_and_bad_values_are_refused_naming_the_setting():
    k = lc.check_knobs()
    assert (k.n_threads, k.n_threads_batch, k.n_batch, k.n_ubatch, k.batch_with, k.kv_unified, k.flash_attn,
            k.kv_type) == (1, 1, None, None, (), False, "auto", "f16")
    assert lc.check_knobs(n_threads=3).n_threads_batch == 3          # n_threads_batch follows n_threads
    assert lc.check_knobs(n_threads=3, n_threads_batch=1).n_threads_batch == 1
    bad = [
        (dict(n_threads=0), "n_threads 0: must be at least 1"),
        (dict(n_threads_batch=-2), "n_threads_batch -2"),
        (dict(n_batch=0), "n_batch 0"),
        (dict(n_ubatch=2.5), "n_ubatch 2.5"),
        (dict(n_ubatch=True), "n_ubatch True"),
        (dict(n_batch=8, n_ubatch=64), "n_ubatch 64 is larger than n_batch 8"),
        (dict(n_ctx=300), "n_ctx 300: not a multiple of 256"),
        (dict(batch_with="one prompt"), "a list of prompts"),
        (dict(batch_with=["ok", ""]), "batch_with prompt 2 is empty"),
        (dict(batch_with=["ok", 3]), "batch_with prompt 2 is 3, not a string"),
        (dict(batch_with=["x"] * 256), "at most 256 sequences"),
        (dict(kv_unified="yes"), "kv_unified 'yes'"),
        (dict(flash_attn="maybe"), "flash_attn 'maybe'"),
        (dict(kv_type="q8_0"), "kv_type 'q8_0'"),
    ]
    for kw, why in bad:
        with pytest.raises(ValueError, match=re.escape(why)):
            lc.check_knobs(**kw)


def test_batch_with_json_is_one_argument_holding_a_list_of_prompts():
    assert lc.parse_batch_with_json("[]") == []
    assert lc.parse_batch_with_json('["a b", "c, d"]') == ["a b", "c, d"]
    for text, why in (("a b", "not JSON"), ('"a"', "not a JSON array of strings"), ("[1]", "not a JSON array")):
        with pytest.raises(ValueError, match=why):
            lc.parse_batch_with_json(text)


def test_every_sequence_gets_the_solo_context_and_n_batch_n_ubatch_default_to_n_ctx():
    k = lc.check_knobs()
    # One sequence: the capture's setting before these knobs (n_batch = n_ubatch = n_ctx).
    assert lc.context_sizes(k, [124], 8) == lc.ContextSizes(512, 512, 512, 512, 1)
    assert lc.context_sizes(k, [500], 40) == lc.ContextSizes(768, 768, 768, 768, 1)
    # Three sequences: each its own 512 positions (llama.cpp divides n_ctx by n_seq_max unless unified).
    assert lc.context_sizes(lc.check_knobs(batch_with=["a", "b"]), [124, 10, 600], 8) == \
        lc.ContextSizes(768 * 3, 768, 768 * 3, 768 * 3, 3)
    assert lc.context_sizes(lc.check_knobs(batch_with=["a"], kv_unified=True), [124, 10], 8).n_ctx == 512
    assert lc.context_sizes(lc.check_knobs(n_batch=64), [124], 8)[2:4] == (64, 64)
    assert lc.context_sizes(lc.check_knobs(n_ubatch=2), [124], 8)[2:4] == (512, 2)
    with pytest.raises(ValueError, match="n_batch 1024 is larger than n_ctx 512"):
        lc.context_sizes(lc.check_knobs(n_batch=1024), [124], 8)
    with pytest.raises(ValueError, match="n_ubatch 1024 is larger than n_batch 512"):
        lc.context_sizes(lc.check_knobs(n_ubatch=1024), [124], 8)
    # The longest sequence decides (an other sequence's prompt of 300 tokens + 8 steps).
    with pytest.raises(ValueError, match="n_ctx 256 is smaller than the 308 positions"):
        lc.context_sizes(lc.check_knobs(n_ctx=256, batch_with=["a"]), [10, 300], 8)


def test_ubatch_split_follows_llama_cpps_split_simple_and_split_equal():
    # One sequence per context: split_simple, the next n_ubatch entries.
    assert lc.split_ubatches([0] * 5, 2, per_seq=False) == [[0, 1], [2, 3], [4]]
    assert lc.split_ubatches([0] * 5, 512, per_seq=False) == [[0, 1, 2, 3, 4]]
    # Several: split_equal(sequential) takes the same number of entries of each consecutive
    # sequence, concatenated sequence by sequence; a shorter sequence cuts the others' run.
    seqs = [0] * 5 + [1] * 3
    assert lc.split_ubatches(seqs, 512, per_seq=True) == [[0, 1, 2, 5, 6, 7], [3, 4]]
    assert lc.split_ubatches(seqs, 4, per_seq=True) == [[0, 1, 5, 6], [2, 7], [3, 4]]
    # A decode step: one entry per sequence, all in one ubatch.
    assert lc.split_ubatches([0, 1, 2], 512, per_seq=True) == [[0, 1, 2]]
    # n_ubatch smaller than the number of sequences: llama.cpp's loop admits n_ubatch + 1 sequences
    # before it stops (src/llama-batch.cpp split_equal), the port does the same.
    assert lc.split_ubatches([0, 1, 2], 1, per_seq=True) == [[0, 1], [2]]
    # Every entry exactly once, whatever the sizes.
    for n_ubatch in (1, 2, 3, 7, 64):
        seqs = [0] * 11 + [1] * 4 + [2] * 9
        got = lc.split_ubatches(seqs, n_ubatch, per_seq=True)
        assert sorted(j for ub in got for j in ub) == list(range(len(seqs)))
        assert all([seqs[j] for j in ub] == sorted(seqs[j] for j in ub) for ub in got)


def test_the_batch_composition_is_described_per_step_with_its_llama_decode_calls_and_ubatches():
    sizes = lc.ContextSizes(1024, 512, 1024, 1024, 2)
    d = lc.describe_composition([124, 20], 8, sizes)
    assert d == ("step 0: llama_decode(seq 0: 124, seq 1: 20) = (seq 0: 20, seq 1: 20) + (seq 0: 104); "
                 "steps 1-7: llama_decode(seq 0: 1, seq 1: 1) = (seq 0: 1, seq 1: 1)"), d
    d = lc.describe_composition([124], 3, lc.ContextSizes(512, 512, 64, 2, 1))
    assert d == ("step 0: llama_decode(seq 0: 64) = 32 × (seq 0: 2) then llama_decode(seq 0: 60) = 30 × (seq 0: 2); "
                 "steps 1-2: llama_decode(seq 0: 1) = (seq 0: 1)"), d
    assert lc.describe_composition([5], 1, lc.ContextSizes(512, 512, 512, 512, 1)) == \
        "step 0: llama_decode(seq 0: 5) = (seq 0: 5)"


def test_the_provenance_names_every_setting_and_the_batch():
    k = lc.check_knobs(n_threads=2, n_threads_batch=1, n_ubatch=2, batch_with=["other one", "two"])
    sizes = lc.ContextSizes(1536, 512, 1536, 2, 3)
    notes = dict(lc.knob_notes(k, sizes, [[5, 6], [7]], "Flash Attention enabled", "step 0: ..."))
    assert {k: notes[k] for k in ("n_threads", "n_threads_batch", "n_batch", "n_ubatch", "n_seq_max", "n_ctx_seq",
                                  "kv_unified")} == {
        "n_threads": "2", "n_threads_batch": "1", "n_batch": "1536", "n_ubatch": "2", "n_seq_max": "3",
        "n_ctx_seq": "512", "kv_unified": "false"}
    assert notes["flash_attn.resolved"] == "Flash Attention enabled"
    assert notes["batch.sequences"].startswith("3: the traced sequence (seq_id 0, the only one recorded)")
    assert json.loads(notes["batch.with"]) == ["other one", "two"]
    assert notes["batch.with_prompt_ids"] == "seq 1: 5,6; seq 2: 7"
    assert notes["batch.composition"] == "step 0: ..."
    alone = dict(lc.knob_notes(lc.check_knobs(), lc.ContextSizes(512, 512, 512, 512, 1)))
    assert alone["batch.sequences"] == "1: the traced sequence (seq_id 0) alone"
    assert "batch.with" not in alone and "flash_attn.resolved" not in alone


def test_a_graph_of_several_sequences_gives_the_traced_rows_only():
    # A ubatch of two sequences as split_equal lays it out: seq 0 positions 2..5, then seq 1
    # positions 0..3. The traced records are exactly what a graph of seq 0's rows alone gives.
    cfg = _cfg()
    layout = [(0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1), (1, 2), (1, 3)]
    mixed = _layer_nodes(cfg, 1, nt=8, n_blocks=3)       # CSA layer: closings at seq 0 pos 3, seq 1 pos 3, a pad
    n = lc.StepNodes()
    n.nodes.update(mixed.nodes)
    scores = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    n.add(1, "lid_score_masked", "LIGHTNING_INDEXER", scores)
    n.add(1, "lid_top_k", "CONT", np.array([[1, 0]] * 8, dtype=np.int32))
    recs = lc.assemble_layer(n, cfg, 1, [2, 3, 4, 5], layout=layout)
    assert sorted(recs) == [2, 3, 4, 5]
    got = {p: {path: a for _, path, a in recs[p]} for p in recs}
    q = n.get(1, "q", "ROPE")
    for j, p in enumerate([2, 3, 4, 5]):
        assert got[p]["attn.q"].tolist() == q[j].tolist()        # rows 0..3: seq 0's
    # The block of seq 0's closing row (pos 3) is block 0; seq 1's (its pos 3, row 7) is block 1.
    comp = n.get(1, "csa_state_compress", "ROPE").reshape(3, -1)
    assert [p for p in got if "attn.compressed" in got[p]] == [3]
    assert got[3]["attn.compressed"].tolist() == comp[0:1].tolist()
    assert got[5]["attn.indexer_scores"].tolist() == scores[3, :1].tolist()
    # Seq 1 first in the graph (a ubatch that starts with another sequence): rows 4..7 are seq 0's.
    layout2 = [(1, 0), (1, 1), (1, 2), (1, 3), (0, 4), (0, 5), (0, 6), (0, 7)]
    recs2 = lc.assemble_layer(n, cfg, 1, [4, 5, 6, 7], layout=layout2)
    got2 = {p: {path: a for _, path, a in recs2[p]} for p in recs2}
    assert got2[4]["attn.q"].tolist() == q[4].tolist()
    assert got2[7]["attn.compressed"].tolist() == comp[1:2].tolist()   # seq 1's pos 3 is block 0
    with pytest.raises(lc.LlamaCppError, match="traced rows of the graph hold positions"):
        lc.assemble_layer(n, cfg, 1, [2, 3], layout=layout)


def test_the_capture_command_refuses_bad_settings_with_exit_2_before_llama_cpp(tmp_path):
    g = _write_gguf(tmp_path / "ok.gguf")
    cases = [
        (("--n-ubatch", "0"), "n_ubatch 0: must be at least 1"),
        (("--n-batch", "8", "--n-ubatch", "64"), "n_ubatch 64 is larger than n_batch 8"),
        (("--threads-batch", "0"), "n_threads_batch 0"),
        (("--batch-with", "a", "--batch-with-json", '["b"]'), "not both"),
        (("--batch-with-json", "[1, 2]"), "not a JSON array of strings"),
        (("--batch-with", ""), "batch_with prompt 1 is empty"),
    ]
    for extra, why in cases:
        r = _py_capture(g, tmp_path, *extra)
        assert r.returncode == 2, (extra, r.returncode, r.stderr)
        assert why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "out.bin").exists()
