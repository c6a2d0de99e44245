"""The transformers capture is one path: ``moeconf.capture.capture`` runs the moeconf.torch engine under
``moeconf.capture_mapping.transformers_mapping``. Its traces are byte for byte those of the hook path it
replaced (kept as the oracle in transformers_hooks_reference.py, run in the same process on the same CPU,
so no float result of one CPU is pinned), on the built-in tiny DeepSeek-V4 fixture exported as a
transformers checkpoint (sliding, CSA and HCA layers, score- and hash-routed MoE): alone and beside one or
two other prompts (shorter: the traced row has no pad slot; longer: it has pad slots, and the records of
PADDED_NOT_CAPTURED are left out), left and right padding, capture sets fingerprints / default / replay /
all, f32 and bf16. Opt-in like test_capture.py: marked ``transformers``, skipped unless torch and
transformers import and ``MOECONF_TRANSFORMERS_TESTS=1`` (python/run_interop.sh)."""

import glob
import os
import subprocess

import pytest

pytestmark = pytest.mark.transformers

from conftest import require_transformers  # noqa: E402

torch, transformers = require_transformers()

import moeconf  # noqa: E402
from moeconf import read_trace  # noqa: E402
from moeconf.catalogue import CAPTURE_SETS, NOT_CAPTURED_NOTE  # noqa: E402
from transformers_hooks_reference import reference_capture  # noqa: E402

PROMPT = "why the sheep"  # 5 tokens
SHORTER = "hello"  # 3 tokens
LONGER = "the quick brown fox"  # 10 tokens: the traced row gets 5 pad slots
STEPS = 4
BATCHES = [("alone", [], "left")] + [(f"{name}-{side}", others, side) for side in ("left", "right")
                                     for name, others in (("shorter", [SHORTER]), ("longer", [LONGER]),
                                                          ("both", [SHORTER, LONGER]))]


@pytest.fixture(scope="module")
def model_dir(moeconf_bin, tmp_path_factory):
    """The built-in fixture's checkpoint, materialized by a one-token run into a private cache."""
    root = tmp_path_factory.mktemp("mapping")
    env = dict(os.environ, MOECONF_CACHE_DIR=str(root / "cache"), NO_COLOR="1")
    subprocess.run([moeconf_bin, "run", "--model", "builtin:tiny-v4", "--prompt", PROMPT, "--max-new-tokens", "1",
                    "--capture", "L0", "-o", str(root / "l0.bin")], check=True, env=env, capture_output=True)
    dirs = glob.glob(str(root / "cache" / "*" / "config.json"))
    assert len(dirs) == 1, dirs
    return os.path.dirname(dirs[0])


_MODELS = {}


def _model(model_dir, dtype):
    """The fixture in ``f32`` or ``bf16``, loaded once. In bf16 every parameter is cast to bf16:
    transformers 5.19 loads the norm weights in f32 (``_keep_in_fp32_modules_strict``) and its bf16
    forward then fails on them; the comparison needs a bf16 model, not that loading setting."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    if dtype not in _MODELS:
        torch.set_num_threads(1)
        m = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, {"f32": "float32",
                                                                                  "bf16": "bfloat16"}[dtype]))
        m = m.eval() if dtype == "f32" else m.to(torch.bfloat16).eval()
        _MODELS[dtype] = (m, Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")))
    return _MODELS[dtype]


@pytest.mark.parametrize("batch", BATCHES, ids=[b[0] for b in BATCHES])
@pytest.mark.parametrize("capture_set", list(CAPTURE_SETS))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_mapping_path_writes_the_hook_paths_trace_byte_for_byte(model_dir, tmp_path, dtype, capture_set,
                                                                    batch):
    _, others, side = batch
    model, tok = _model(model_dir, dtype)
    levels, payload = CAPTURE_SETS[capture_set]
    kw = dict(model_name="builtin:tiny-v4", levels=levels, payload_levels=payload, batch_with=others,
              padding_side=side)
    a, b = tmp_path / "hooks.bin", tmp_path / "mapping.bin"
    ra = reference_capture(model, tok, PROMPT, STEPS, a, **kw)
    rb = moeconf.capture(model, tok, PROMPT, STEPS, b, **kw)  # the public entry point: the mapping
    ta, tb = read_trace(str(a)), read_trace(str(b))
    assert [r.coord for r in ta.records] == [r.coord for r in tb.records]  # the same records in the same order
    assert a.read_bytes() == b.read_bytes()
    assert ra.generated == rb.generated and ra.summary.root == rb.summary.root
    assert (ra.moe_events, ra.moe_routed_reproduced, ra.moe_terms_unexplained) == \
           (rb.moe_events, rb.moe_routed_reproduced, rb.moe_terms_unexplained)
    # what the comparison covers: a batch's notes, and a padded row's omissions
    notes = dict(tb.provenance.notes)
    assert ("batch_sequences" in notes) == bool(others)
    assert (NOT_CAPTURED_NOTE in notes) == (LONGER in others)
    # the MoE diagnostics count the traced row's (position, layer) events only, not the other rows'
    assert rb.moe_events == (5 + STEPS - 1) * model.config.num_hidden_layers
