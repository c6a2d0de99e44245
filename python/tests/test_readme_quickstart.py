"""The README's Python quick start runs as written against a tiny random Mixtral of transformers
(opt-in: MOECONF_TRANSFORMERS_TESTS=1, python/run_interop.sh): the snippet's mapping matches the
model's modules, its loop captures, and `moeconf diff` of the trace against itself exits 0."""

import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.transformers

from conftest import require_transformers  # noqa: E402

torch, transformers = require_transformers()

from conftest import REPO  # noqa: E402


def readme_snippet():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    [snippet] = [b for b in blocks if "moeconf.torch" in b]
    return snippet


def test_the_readme_snippet_captures_a_mixtral(tmp_path, moeconf_bin, monkeypatch):
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet(), "README.md", "exec"), {"model": model, "ids": [3, 1, 4, 1, 5]})
    assert os.path.isfile(tmp_path / "cand.bin")
    p = subprocess.run([moeconf_bin, "diff", "cand.bin", "cand.bin"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
