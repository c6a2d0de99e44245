"""docs/capture.md's toy example, run as it is written (the Python block after the
``toy-example`` marker), with real torch: skipped when torch is not installed. It checks the two
traces it leaves with the reader and, when the Rust binary is there, with ``moeconf inspect`` and
``moeconf diff``; and the engine on real ``nn.Module`` hooks where they differ from the duck-typed
ones of test_torch_capture.py (keyword arguments, bf16 tensors)."""

import json
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeconf import read_trace  # noqa: E402
from moeconf.torch import CaptureError, Mapping, Rule, capture  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "capture.md")


def _example():
    text = open(DOC, encoding="utf-8").read()
    m = re.search(r"<!-- toy-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert m, "docs/capture.md has no toy-example block"
    return m.group(1)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Runs the documented example in a fresh directory; returns (directory, its namespace)."""
    d = tmp_path_factory.mktemp("toy")
    cwd = os.getcwd()
    os.chdir(d)
    try:
        ns = {"__name__": "toy"}
        exec(compile(_example(), "docs/capture.md:toy-example", "exec"), ns)
    finally:
        os.chdir(cwd)
    return d, ns


def test_example_writes_two_comparable_traces(toy):
    d, ns = toy
    ref, cand = read_trace(str(d / "ref.bin")), read_trace(str(d / "cand.bin"))
    assert ref.binding.to_bytes() == cand.binding.to_bytes()
    assert ref.root != cand.root
    assert ref.provenance.recomputed() == ["router.scores", "moe.term.*"]
    notes = dict(ref.provenance.notes)
    assert notes["moeconf.not_captured"].startswith("attn.*: the toy model has no attention; state.*: ")
    assert "moe.shared: no rule" in notes["moeconf.not_captured"]
    tokens = [int(ref.array(i)[0]) for i, r in enumerate(ref.records) if r.coord.path == "token.output"]
    tokens2 = [int(cand.array(i)[0]) for i, r in enumerate(cand.records) if r.coord.path == "token.output"]
    assert tokens == tokens2 and len(tokens) == 6  # identical tokens ...
    by = {(r.coord.step, r.coord.layer, r.coord.position, r.coord.path): r.digest for r in ref.records}
    differ = [(r.coord.step, r.coord.layer, r.coord.position, r.coord.path) for r in cand.records  # write order
              if by[(r.coord.step, r.coord.layer, r.coord.position, r.coord.path)] != r.digest]
    assert differ, "the BF16 routed sum changed no record"
    # ... and the first record that differs is layer 1's routed sum (layers 0 agree bit for bit)
    first = differ[0]
    assert first[1] == 1 and first[3] == "moe.routed", differ[:5]
    assert all(k[1] is None or k[1] >= 1 for k in differ)


def test_example_with_the_rust_binary(toy, run_moeconf):
    d, _ = toy
    j = json.loads(run_moeconf("inspect", d / "ref.bin", "--format", "json").stdout)
    assert j["provenance"]["recomputed"] == ["router.scores", "moe.term.*"]
    assert run_moeconf("diff", d / "ref.bin", d / "ref.bin", check=False).returncode == 0
    p = run_moeconf("diff", d / "ref.bin", d / "cand.bin", check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("first divergence: L4 step 0 position 0 layer 1 operator moe.combine"), p.stdout
    assert "differs: moe.routed (layer 1)" in last and "tokens and text identical" in last, p.stdout


class _Scaled(torch.nn.Module):
    def forward(self, x, *, scale):
        return x * scale


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Scaled() for _ in range(2)])
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.embed = torch.nn.Embedding(8, 4)

    def forward(self, ids):
        x = self.embed(ids).to(torch.bfloat16)
        for layer in self.layers:
            x = layer(x, scale=torch.tensor(0.5, dtype=torch.bfloat16))
        return self.head(x.float())


def test_keyword_inputs_and_bf16_on_real_modules(tmp_path):
    torch.manual_seed(1)
    net = _Net()
    cfg = {"hidden_size": 4, "vocab_size": 8, "num_hidden_layers": 2}
    mp = Mapping([Rule("layers.{layer}", "ffn.norm", input=0),
                  Rule("layers.{layer}", "layer.post_ffn_mhc")])
    out = tmp_path / "t.bin"
    with torch.no_grad(), capture(net, mp, out, prompt_ids=[1, 2], max_new_tokens=2, config=cfg) as cap:
        gen = cap.generate(lambda ids: net(torch.tensor(ids))[-1])
    assert len(gen) == 2
    t = read_trace(str(out))
    i = [r.coord.path for r in t.records].index("layer.post_ffn_mhc")
    assert t.array(i).dtype == np.float32
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0
    # a keyword argument the module is not called with
    mp = Mapping([Rule("layers.{layer}", "ffn.norm", input="x")])
    with pytest.raises(CaptureError, match="without keyword argument 'x' \\(keywords: scale\\)"):
        with torch.no_grad(), capture(net, mp, tmp_path / "u.bin", prompt_ids=[1, 2], max_new_tokens=1,
                                      config=cfg) as cap:
            cap.generate(lambda ids: net(torch.tensor(ids))[-1])
    assert not (tmp_path / "u.bin").exists()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0
    mp = Mapping([Rule("layers.{layer}", "ffn.norm", input="scale", transform=lambda s: s.expand(1, 1, 4),
                       recomputed=False)])
    # the scale is a scalar: expanded to one position's [D] by the transform; two positions need two
    with pytest.raises(CaptureError, match=r"shape \[1, 1, 4\], expected 2 position"):
        with torch.no_grad(), capture(net, mp, tmp_path / "v.bin", prompt_ids=[1, 2], max_new_tokens=1,
                                      config=cfg) as cap:
            cap.generate(lambda ids: net(torch.tensor(ids))[-1])


def test_bf16_ids_and_heads_first_layouts_are_refused(tmp_path):
    """Ids in a float dtype are refused (bf16 holds 257, 301, 1001 as 256, 300, 1000); a heads-first
    [1, H, n, d] value is refused, and taken once a transform puts the positions first."""
    from moeconf.torch import _ids

    with pytest.raises(CaptureError, match="bfloat16 values: ids must be integers"):
        _ids(torch.tensor([257, 301, 1001]).bfloat16(), "ids")
    assert _ids(torch.tensor([[257, 301, 1001]], dtype=torch.int16), "ids") == [257, 301, 1001]
    net = _Net()
    cfg = {"hidden_size": 4, "vocab_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 2}
    heads_first = lambda x: x.reshape(1, x.shape[0], 2, 2).transpose(1, 2)  # noqa: E731  [1, H, n, d]
    for prompt in ([1, 2, 3], [1, 2]):  # n != H: refused at the prefill; n == H: at the first decode step
        mp = Mapping([Rule("layers.{layer}", "attn.q", transform=heads_first, recomputed=False)])
        with pytest.raises(CaptureError, match=r"another layout.*transform="):
            with torch.no_grad(), capture(net, mp, tmp_path / "q.bin", prompt_ids=prompt, max_new_tokens=2,
                                          config=cfg) as cap:
                cap.generate(lambda ids: net(torch.tensor(ids))[-1])
        assert not (tmp_path / "q.bin").exists()
    mp = Mapping([Rule("layers.{layer}", "attn.q", transform=lambda x: heads_first(x).transpose(1, 2),
                       recomputed=False)])
    with torch.no_grad(), capture(net, mp, tmp_path / "q.bin", prompt_ids=[1, 2], max_new_tokens=2,
                                  config=cfg, capture="all") as cap:
        cap.generate(lambda ids: net(torch.tensor(ids))[-1])
    t = read_trace(str(tmp_path / "q.bin"))
    i = [r.coord.path for r in t.records].index("attn.q")
    assert t.array(i).shape == (2, 2)
