"""Opt-in: what the transformers invariance matrix found, configuration by configuration, and the
first divergent operators recomputed both ways (docs/invariance.md section 5.2).

    python3 python/invariance_transformers.py --out DIR --model MODEL_DIR [--moeconf BIN]

DIR is the output of ``moeconf invariance python/invariance/transformers.toml --model MODEL_DIR
--out DIR``. For every configuration it prints the tokens against the base's and every divergence
``moeconf diff --format json base.bin cNN.bin`` lists (kind, step, position, layer, record, values
that differ); then, for each divergence at ``attn.kv`` or ``moe.term.J`` whose inputs match, it
recomputes that operator from the base trace's inputs with its GEMMs run on one row and on two rows
and says which trace holds which result bit for bit (the batch-size dependence of torch's bf16
matmul on this CPU); for ``state.window_kv`` it prints both sides' row counts; last, the oneDNN
implementation torch runs for a one-row and a two-row bf16 matmul (``ONEDNN_VERBOSE=1``), and
whether a bf16 linear and an fp32 mean larger than the fixture's give the same bits on 1 and 2 threads.

Every result of the recomputation is a number of one CPU (which kernel oneDNN picks depends on its
instruction set): docs/invariance.md names the CPU. Needs torch and transformers; not part of the
default CI run (python/run_interop.sh runs it after the matrix).
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

#: A one-row and a two-row bf16 matmul, run with ONEDNN_VERBOSE=1 to name oneDNN's implementation.
ONEDNN_PROBE = """
import torch
torch.set_num_threads(1)
w = torch.ones(64, 256, dtype=torch.bfloat16)
for rows in (1, 2):
    print("rows", rows, flush=True)
    torch.nn.functional.linear(torch.ones(rows, 256, dtype=torch.bfloat16), w)
"""


def onednn_implementations(python=sys.executable):
    """{rows: oneDNN implementation name} of a bf16 ``F.linear`` [rows, 256] x [256, 64] on this CPU."""
    p = subprocess.run([python, "-c", ONEDNN_PROBE], capture_output=True, text=True,
                       env=dict(os.environ, ONEDNN_VERBOSE="1"))
    out, rows = {}, None
    for line in (p.stdout + p.stderr).splitlines():
        if line.startswith("rows "):
            rows = int(line.split()[1])
        elif ",exec,cpu,matmul," in line and rows is not None:
            out.setdefault(rows, line.split(",")[6])
    return out


def thread_probe():
    """Kernels of the model's kinds at sizes beyond the fixture's, run with 1 and with 2 threads: a bf16
    linear (oneDNN) and an fp32 mean over the last dimension (ATen's reduction, as the RMS norms):
    {what: bitwise equal?}. A thread-count dependence the fixture is too small to reach would show here."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    cases = [(f"bf16 linear {m}x{k}x{n}", torch.randn(m, k, generator=g).to(torch.bfloat16),
              torch.randn(n, k, generator=g).to(torch.bfloat16)) for m, k, n in ((1, 4096, 4096), (16, 7168, 2048))]
    for name, x, w in cases:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(torch.nn.functional.linear(x, w))
        out[name] = torch.equal(*got)
    for shape in ((8, 16384), (1, 131072)):
        x = torch.randn(*shape, generator=g)
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(x.square().mean(-1, keepdim=True))
        out[f"fp32 mean over {shape}"] = torch.equal(*got)
    torch.set_num_threads(1)
    return out


class Records:
    """Records of one trace by (step, position, layer, path)."""

    def __init__(self, path):
        from moeconf import read_trace

        self.t = read_trace(path)
        self.at = {(r.coord.step, r.coord.position, r.coord.layer, r.coord.path): i
                   for i, r in enumerate(self.t.records)}

    def get(self, step, pos, layer, path):
        i = self.at.get((step, pos, layer, path))
        return None if i is None else self.t.array(i)

    def tokens(self):
        return [int(self.t.array(i)[0]) for i, r in enumerate(self.t.records) if r.coord.path == "token.output"]

    def note(self, key):
        return dict(self.t.provenance.notes).get(key)


def recompute_kv(model, base, cand, step, pos, layer):
    """``attn.kv`` at (step, pos, layer) from the base's ``attn.norm`` row: ``kv_proj`` on that row
    alone and with a second row, then ``kv_norm`` and the rotation at ``pos`` (modeling
    ``DeepseekV4Attention.forward``). Returns a line saying which trace matches which."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

    att = model.model.layers[layer].self_attn
    x = torch.tensor(base.get(step, pos, layer, "attn.norm")).to(torch.bfloat16)
    same_in = bool((base.get(step, pos, layer, "attn.norm") == cand.get(step, pos, layer, "attn.norm")).all())
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x[None, None], position_ids=torch.tensor([[pos]]),
                                          layer_type=att.rope_layer_type)

        def kv(rows):
            h = att.kv_norm(att.kv_proj(rows[:, None, :])).view(rows.shape[0], 1, -1, att.head_dim).transpose(1, 2)
            n = rows.shape[0]
            return mdv4.apply_rotary_pos_emb(h, cos.expand(n, -1, -1), sin.expand(n, -1, -1))[0, 0, 0].float()

        one, two = kv(x[None]), kv(torch.stack([x, x]))
    return _verdict("attn.kv (kv_proj on 1 row / on 2 rows)", one, two, base.get(step, pos, layer, "attn.kv"),
                    cand.get(step, pos, layer, "attn.kv"), same_in)


def recompute_term(model, base, cand, step, pos, layer, slot):
    """``moe.term.SLOT`` at (step, pos, layer) from the base's ``ffn.norm`` row, routed expert and gate:
    the expert's gate_up and down GEMMs (``DeepseekV4Experts`` weights, its ``_apply_gate``) on that
    row alone and with a second row, times the gate (integrations/moe.py ``grouped_mm_experts_forward``
    / ``batched_mm_experts_forward``)."""
    import torch

    ex = model.model.layers[layer].mlp.experts
    paths = ("ffn.norm", "router.topk", "router.gates")
    same_in = all(bool((base.get(step, pos, layer, p) == cand.get(step, pos, layer, p)).all()) for p in paths)
    x = torch.tensor(base.get(step, pos, layer, "ffn.norm")).to(torch.bfloat16)
    e = int(base.get(step, pos, layer, "router.topk")[slot])
    g = torch.tensor(base.get(step, pos, layer, "router.gates")[slot]).to(torch.bfloat16)
    with torch.no_grad():
        def term(rows):
            h = ex._apply_gate(rows @ ex.gate_up_proj[e].T)
            return ((h @ ex.down_proj[e].T)[0] * g).float()

        one, two = term(x[None]), term(torch.stack([x, x]))
    return _verdict(f"moe.term.{slot} (expert {e}: its GEMMs on 1 row / on 2 rows)", one, two,
                    base.get(step, pos, layer, f"moe.term.{slot}"), cand.get(step, pos, layer, f"moe.term.{slot}"),
                    same_in)


def pad_entries(model, model_dir, cand, layer, pos):
    """For a left-padded traced sequence whose attention core first differs at ``pos`` of a compressed
    layer: the compressed entries that query may see (index < (pos + 1) // compress_rate,
    ``DeepseekV4CSACompressor.forward``'s causal threshold), computed in the configuration's batch for
    the traced prompt and for the same prompt reversed (same length, other tokens). Equal entries
    hold nothing of the traced prompt: they pool its pad slots only."""
    import torch
    from tokenizers import Tokenizer
    from transformers.cache_utils import DynamicCache

    from moeconf.capture import _Batch

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    others = [tok.encode(p, add_special_tokens=False).ids for p in json.loads(cand.note("batch_with"))]
    prompt = list(cand.t.binding.prompt_ids)
    side = cand.note("padding_side")
    rate = model.model.layers[layer].self_attn.compressor.compress_rate
    got = []
    for ids in (prompt, prompt[::-1]):
        batch = _Batch([ids] + others, side, int(cand.note("pad_token_id")))
        rows, mask = batch.rows()
        am = torch.tensor(mask)
        pos_ids = (am.cumsum(-1) - 1).masked_fill(am == 0, 0)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor(rows), attention_mask=am, position_ids=pos_ids, past_key_values=cache,
                  use_cache=True)
        got.append(cache.layers[layer].compressed_kv["compressor"][0])
    visible = (pos + 1) // rate
    same = [int(i) for i in range(visible) if torch.equal(got[0][i], got[1][i])]
    return (f"compressed entries position {pos} may see at layer {layer}: {visible}; equal for the traced prompt and "
            f"its reverse in this batch (pooled from pad slots only): {same}")


def _verdict(what, one, two, base_rec, cand_rec, same_inputs):
    import torch

    def holds(rec):
        r = torch.tensor(rec)
        return "1 row" if torch.equal(r, one) else "2 rows" if torch.equal(r, two) else "neither"

    return (f"recomputed {what}: {int((one != two).sum())} of {one.numel()} values differ between the two; "
            f"base holds the {holds(base_rec)} result, the configuration the {holds(cand_rec)} result "
            f"(inputs equal in both traces: {same_inputs})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the output directory of moeconf invariance")
    ap.add_argument("--model", required=True, help="the checkpoint directory the matrix ran")
    ap.add_argument("--moeconf", default=os.environ.get("MOECONF_BIN") or
                    os.path.join(REPO, "target", "release", "moeconf"))
    args = ap.parse_args()

    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    with open(os.path.join(args.out, "invariance.json"), encoding="utf-8") as f:
        report = json.load(f)
    base_path = os.path.join(args.out, "base.bin")
    base = Records(base_path)
    base_tokens = base.tokens()
    print(f"base: tokens {base_tokens}")
    for n, c in enumerate(report["configurations"], 1):
        path = os.path.join(args.out, f"c{n:02d}.bin")
        print(f"\n== {c['name']} ({', '.join(c['changed']) or 'nothing changed'}): {c['status']}")
        if not os.path.isfile(path):
            print("   no trace")
            continue
        cand = Records(path)
        toks = cand.tokens()
        same = sum(a == b for a, b in zip(base_tokens, toks))
        print(f"   tokens {toks}: {same}/{len(base_tokens)} equal to the base's; threads {cand.t.provenance.threads}; "
              f"experts {cand.note('experts_implementation')}; batch: {cand.note('batch_sequences') or 'alone'}, "
              f"{cand.note('batch_pad_slots') or '-'}, padding {cand.note('padding_side') or '-'}")
        p = subprocess.run([args.moeconf, "diff", "--format", "json", base_path, path], capture_output=True, text=True)
        if p.returncode not in (0, 1):
            print(f"   moeconf diff exited {p.returncode}: {p.stderr.strip()}")
            continue
        j = json.loads(p.stdout)
        print(f"   {j['summary']}")
        for d in j["divergences"]:
            a, cmp_ = d["at"], d.get("comparison") or {}
            vals = f"{cmp_['differing']}/{cmp_['elements']} values, max |d| {cmp_['max_abs_delta']}" \
                if cmp_.get("kind") == "float" else ""
            print(f"   - {d['kind']}: step {a['step']} pos {a['position']} layer {a['layer']} {a['path']} {vals}")
            at = (a["step"], a["position"], a["layer"])
            if a["path"] == "attn.kv":
                print("     " + recompute_kv(model, base, cand, *at))
            elif a["path"].startswith("moe.term."):
                print("     " + recompute_term(model, base, cand, *at, int(a["path"].rsplit(".", 1)[1])))
            elif (a["path"] == "attn.core" and d["kind"] == "propagating" and cand.note("padding_side") == "left"
                  and cand.note("batch_with") and model.model.layers[a["layer"]].self_attn.compressor is not None):
                print("     " + pad_entries(model, args.model, cand, a["layer"], a["position"]))
            elif a["path"] == "state.window_kv":
                print(f"     rows in the window: base {base.get(*at, 'state.window_kv').shape[0]}, "
                      f"configuration {cand.get(*at, 'state.window_kv').shape[0]}")
        c4 = j["levels"]["L4"].get("contract")
        if c4:
            names = [(e or {}).get("simplest") for e in (c4.get("reference_explanation"), c4.get("candidate_explanation"))]
            print(f"   combine contracts at {c4['at']['path']} (base / configuration): {names[0]} / {names[1]}")
    print(f"\noneDNN implementation of a bf16 matmul on this CPU, by rows: {onednn_implementations()}")
    print(f"1 vs 2 threads, bitwise equal: {thread_probe()}")


if __name__ == "__main__":
    main()
