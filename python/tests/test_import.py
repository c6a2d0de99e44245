"""``moeconf import`` (the Rust writer) against the Python writer on the same
tensors: a dump written from Python (safetensors by hand, names by the
convention of docs/import.md) and a Python trace of the same records must
have the same root, which ``moeconf inspect`` reports for both files. The
model is a small directory whose identity Rust and Python both compute."""

import json

import numpy as np

from moeconf import Binding, Coord, Provenance, TraceWriter, model_identity, read_trace, tokenizer_digest
from moeconf.dump import dump_name, write_safetensors


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "deepseek_v4", "hidden_size": 8}')
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    write_safetensors(d / "model-00002.safetensors", {
        "layers.0.ffn.gate.weight": np.arange(32, dtype=np.float32).reshape(4, 8),
        "embed.weight": ("BF16", [2, 4], bytes(range(16))),
    })
    write_safetensors(d / "model-00001.safetensors", {"norm.weight": np.ones(8, np.float32)})
    return d


def test_import_and_python_writer_agree(run_moeconf, tmp_path):
    model = _model_dir(tmp_path)
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(12).astype(np.float32)
    f16 = np.array([1.0, -2.5, 65504.0, 2.0**-24, -0.0, np.inf], np.float16)
    bf16_bits = np.array([0x3FC0, 0xFF80, 0x0001, 0x8000], np.uint16)   # 1.5, -inf, subnormal, -0
    # (step, position, layer, component, level, dumped value, value as the trace records it)
    records = [
        (0, 0, None, "token.input", "L0", np.array([11, 12], np.int64), np.array([11, 12], np.int32)),
        (0, 1, None, "token.output", "L0", np.array([5], np.int64), np.array([5], np.int32)),
        (0, 1, None, "lm.logits", "L1", logits, logits),
        (0, 1, 0, "attn.output", "L4", f16, f16.astype(np.float32)),
        (0, 1, 0, "layer.post_ffn_mhc", "L3", ("BF16", [2, 2], bf16_bits.tobytes()),
         (bf16_bits.astype(np.uint32) << 16).view(np.float32).reshape(2, 2)),
        (0, 1, 1, "state.cumulative_length", "L2", np.array([2], np.int32), np.array([2], np.int64)),
        (1, 2, None, "token.input", "L0", np.array([5], np.int32), np.array([5], np.int32)),
        (1, 2, 1, "moe.combine", "L4", rng.standard_normal(8), None),   # f64 stays f64
        (1, 2, None, "text.continuation", "L0", np.frombuffer(b"ok", np.uint8), np.frombuffer(b"ok", np.uint8)),
    ]
    dump = tmp_path / "dump"
    dump.mkdir()
    write_safetensors(dump / "step0.safetensors",
                      {dump_name(s, p, l, c): v for s, p, l, c, _, v, _ in records if s == 0})
    write_safetensors(dump / "step1.safetensors",
                      {dump_name(s, p, l, c): v for s, p, l, c, _, v, _ in records if s == 1})
    manifest = {
        "model": {"name": "py-model", "dir": "../model"},
        "tokenizer": {"file": "../model/tokenizer.json"},
        "prompt": {"text": "why the sheep", "ids": [11, 12]},
        "max_new_tokens": 2,
        "precision": "bf16",
        "contract": "native",
        "schedule": "identity",
        "runtime": {"name": "py-dump", "version": "0"},
        "extra": {"backend": "numpy"},
    }
    (dump / "manifest.json").write_text(json.dumps(manifest))
    rust = tmp_path / "rust.bin"
    run_moeconf("import", dump, "-o", rust, "--payloads", "L0,L1,L3")

    ident = model_identity("py-model", model)
    assert [t.name for t in ident.tensors] == ["embed.weight", "layers.0.ffn.gate.weight", "norm.weight"]
    binding = Binding(model_name="py-model", config_digest=ident.config_digest,
                      weights_digest=ident.weights_digest, tensors=ident.tensors,
                      tokenizer_name="tokenizer.json",
                      tokenizer_digest=tokenizer_digest(model / "tokenizer.json"),
                      prompt_text="why the sheep", prompt_ids=[11, 12], max_new_tokens=2, precision="bf16",
                      capture_levels=0b11111, capture_payload_levels=0b01011, extra=[("backend", "numpy")])
    py = tmp_path / "py.bin"
    w = TraceWriter(py, binding, Provenance("pytest", "1", 1))
    for s, p, l, c, lv, dumped, recorded in records:
        value = dumped if recorded is None else recorded
        w.append(Coord.make(s, p, "prefill" if s == 0 else "decode", l, c), lv, value, keep_payload=True)
    summary = w.finish()

    t = read_trace(rust)
    assert t.binding.tensors == ident.tensors            # Rust and Python model identity agree
    assert t.binding == binding
    assert t.root == summary.root
    for path in (rust, py):
        doc = json.loads(run_moeconf("inspect", path, "--format", "json").stdout)
        assert doc["root"] == summary.root.hex()
        assert doc["records"]["total"] == len(records)
    assert run_moeconf("diff", rust, py, check=False).returncode == 0
    # The conversions, read back from the Rust-written trace.
    arrays = {r.coord.path + str(r.coord.step): t.array(i) for i, r in enumerate(t.records)}
    assert arrays["attn.output0"].tolist()[:4] == [1.0, -2.5, 65504.0, 2.0**-24]
    assert np.signbit(arrays["attn.output0"][4]) and np.isinf(arrays["attn.output0"][5])
    assert arrays["token.input0"].dtype == np.dtype("<i4")
    assert arrays["state.cumulative_length0"].dtype == np.dtype("<i8")
