"""The transformers capture re-expressed as a moeconf.torch mapping (moeconf.capture_mapping) writes
the same trace as moeconf.capture, byte for byte, on the built-in tiny DeepSeek-V4 fixture (its
sliding, CSA and HCA layers, score- and hash-routed MoE), in f32 and bf16, under several capture
sets. Opt-in like test_capture.py: marked ``transformers``, skipped unless torch and transformers
import and ``MOECONF_TRANSFORMERS_TESTS=1`` (python/run_interop.sh)."""

import glob
import os
import subprocess

import pytest

pytestmark = pytest.mark.transformers

from conftest import require_transformers  # noqa: E402

torch, transformers = require_transformers()

import moeconf  # noqa: E402
from moeconf import capture_mapping, read_trace  # noqa: E402
from moeconf.catalogue import REPLAY_PAYLOAD_LEVELS  # noqa: E402

PROMPT = "why the sheep"


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


def _both(model_dir, tmp_path, dtype, steps, **kw):
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    a, b = tmp_path / "capture.bin", tmp_path / "mapping.bin"
    ra = moeconf.capture(model, tok, PROMPT, steps, a, model_name="builtin:tiny-v4", **kw)
    rb = capture_mapping.capture(model, tok, PROMPT, steps, b, model_name="builtin:tiny-v4", **kw)
    return a, b, ra, rb


@pytest.mark.parametrize("dtype,steps,kw", [
    ("f32", 8, {}),
    ("bf16", 8, {}),
    ("bf16", 4, {"payload_levels": REPLAY_PAYLOAD_LEVELS}),
    ("f32", 3, {"levels": ["L0", "L1", "L3"], "payload_levels": ["L1"]}),
    ("f32", 3, {"payload_levels": []}),
])
def test_mapping_writes_the_capture_byte_for_byte(model_dir, tmp_path, dtype, steps, kw):
    a, b, ra, rb = _both(model_dir, tmp_path, {"f32": torch.float32, "bf16": torch.bfloat16}[dtype], steps, **kw)
    ta, tb = read_trace(str(a)), read_trace(str(b))
    assert [r.coord for r in ta.records] == [r.coord for r in tb.records]  # the same records in the same order
    assert a.read_bytes() == b.read_bytes()
    assert ra.generated == rb.generated and ra.summary.root == rb.summary.root
    assert (ra.moe_events, ra.moe_routed_reproduced, ra.moe_terms_unexplained) == \
           (rb.moe_events, rb.moe_routed_reproduced, rb.moe_terms_unexplained)


def test_mapping_refuses_a_batch(tmp_path):
    with pytest.raises(ValueError, match="batch of one"):
        capture_mapping.capture(None, [1, 2], "", 1, tmp_path / "x.bin", batch_with=["a"])
