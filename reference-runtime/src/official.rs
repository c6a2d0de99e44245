//! The `official` precision profile's activation-quantization sites
//! (docs/operators.md §9.6, §10): where DeepSeek's inference code quantizes an
//! activation, this profile quantizes it the same way (crate::actquant) and
//! records the dequantized values as the site's L4 record, so a backend that
//! skips or moves a site is localized to it.
//!
//! - GEMM inputs (Q1, Q2, Q7–Q10): FP8 E4M3 in 1×128 blocks with UE8M0
//!   scales ([`gemm_input`]), read by the block-scaled GEMM
//!   [`crate::weights::Mat::linear_official`]; only where the GEMM's weight is
//!   FP8 or FP4 ([`crate::weights::Mat::quantizes_input`]).
//! - KV entries (Q3, Q4): FP8 fake quantization of the non-rope channels in
//!   1×64 blocks ([`kv_fake_quant`]).
//! - Indexer keys and queries (Q5, Q6): the Hadamard rotation, the BF16
//!   rounding of its output, then FP4 fake quantization in 1×32 blocks
//!   ([`rotate_fake_quant_fp4`]).
//!
//! A calibration fault ([`crate::faults::FaultKind::QuantizationSiteSkipped`])
//! skips one site's quantize-dequantize (the rotation of Q5/Q6 stays): the
//! site's record then holds the unquantized values and its consumers read them.

use moeconf_fingerprint::Component;

use crate::actquant::{
    fp4_quantize_blocks, fp8_quantize_blocks, hadamard_rotate, FP4_BLOCK, GEMM_INPUT_BLOCK, KV_BLOCK,
};
use crate::config::{AttentionKind, ModelConfig};
use crate::error::RuntimeError;
use crate::precision::Precision;
use crate::weights::Mat;
use moeconf_contract::bf16::r_bf16;

/// The quantization sites, Q1..Q10 in execution order (catalogue presence
/// `Quantized`/`QuantizedOnEmit`).
pub const SITES: [Component; 10] = [
    Component::AttnNormFp8,
    Component::AttnQLatFp8,
    Component::AttnKvFp8,
    Component::AttnCompressedFp8,
    Component::AttnIndexerCompressedFp4,
    Component::AttnIndexerQFp4,
    Component::AttnOLatFp8,
    Component::FfnNormFp8,
    Component::MoeTermHFp8,
    Component::MoeSharedHFp8,
];

/// A set of quantization sites (one bit per entry of [`SITES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SiteSet(u16);

impl SiteSet {
    /// Adds `site`; `false` if it is not a quantization site.
    pub fn insert(&mut self, site: Component) -> bool {
        match SITES.iter().position(|&s| s == site) {
            Some(i) => {
                self.0 |= 1 << i;
                true
            }
            None => false,
        }
    }

    #[inline]
    pub fn contains(self, site: Component) -> bool {
        SITES
            .iter()
            .position(|&s| s == site)
            .is_some_and(|i| self.0 & (1 << i) != 0)
    }
}

/// Site Q1/Q2/Q7–Q10: the FP8 quantization of a GEMM input in 1×128 blocks
/// (`act_quant(x, 128, "ue8m0")`), dequantized; `x` unchanged when `skip`.
pub(crate) fn gemm_input(x: &[f32], skip: bool) -> Vec<f32> {
    let mut v = x.to_vec();
    if !skip {
        fp8_quantize_blocks(&mut v, GEMM_INPUT_BLOCK);
    }
    v
}

/// Sites Q3/Q4: the FP8 fake quantization of a KV entry's first
/// `x.len() − rope` (non-rope) channels in 1×64 blocks, in place; the rope
/// channels are untouched (M L506, L372).
pub(crate) fn kv_fake_quant(x: &mut [f32], rope: usize, skip: bool) {
    let nope = x.len().saturating_sub(rope);
    if !skip {
        fp8_quantize_blocks(&mut x[..nope], KV_BLOCK);
    }
}

/// Sites Q5/Q6: each `width`-wide row of `x` (one indexer key, or one head
/// of the indexer queries) rotated by the Hadamard matrix, rounded to BF16
/// (the rotation's output dtype), then FP4 fake-quantized in 1×32 blocks
/// (M L368–370, L414–416); the rotation alone when `skip`.
pub(crate) fn rotate_fake_quant_fp4(x: &mut [f32], width: usize, skip: bool) {
    for row in x.chunks_mut(width.max(1)) {
        hadamard_rotate(row);
        for v in row.iter_mut() {
            *v = r_bf16(*v);
        }
        if !skip {
            fp4_quantize_blocks(row, FP4_BLOCK);
        }
    }
}

/// A linear layer as the profile runs it: in the official profile with a
/// quantized weight, the block-scaled GEMM of the site's quantized input
/// `xq` ([`Mat::linear_official`]); otherwise the plain linear of `x` at the
/// profile's rounding point (a BF16/F32 weight takes no activation
/// quantization in DeepSeek's code either).
pub(crate) fn linear(m: &Mat, x: &[f32], xq: Option<&[f32]>, p: Precision) -> Vec<f32> {
    match (p.quantizes() && m.quantizes_input(), xq) {
        (true, Some(q)) => m.linear_official(q),
        (true, None) => m.linear_official(x),
        (false, _) => m.linear(x, p),
    }
}

/// Whether any of `mats` quantizes its input (the site feeding them exists).
pub(crate) fn any_quantized<'a>(mats: impl IntoIterator<Item = &'a Mat>) -> bool {
    mats.into_iter().any(Mat::quantizes_input)
}

/// The dimensions DeepSeek's quantization kernels require, checked before a
/// run in the official profile (they assert them, K L112, L191): the
/// non-rope KV channels a multiple of 64, the indexer head width a power of
/// two and a multiple of 32 (on CSA layers), and the input width of every
/// quantized GEMM a multiple of 128. `quantized_inputs` lists
/// `(site, width)` of the GEMM-input sites the checkpoint has.
pub(crate) fn check_dimensions(
    cfg: &ModelConfig,
    config_path: &std::path::Path,
    quantized_inputs: &[(Component, usize)],
) -> Result<(), RuntimeError> {
    let bad = |key: &str, message: String| RuntimeError::Config {
        path: config_path.to_path_buf(),
        message: format!("precision official: key `{key}`: {message}"),
    };
    let nope = cfg.head_dim - cfg.rope_dim;
    if nope == 0 || !nope.is_multiple_of(KV_BLOCK) {
        return Err(bad(
            "head_dim",
            format!(
                "the non-rope KV channels head_dim − rotary width = {} − {} = {nope} must be a positive multiple of {KV_BLOCK} (DeepSeek's FP8 KV blocks)",
                cfg.head_dim, cfg.rope_dim
            ),
        ));
    }
    let has_csa = cfg.layer_types.contains(&AttentionKind::Csa);
    let di = cfg.index_head_dim;
    if has_csa && (!di.is_power_of_two() || !di.is_multiple_of(FP4_BLOCK)) {
        return Err(bad(
            "index_head_dim",
            format!("{di} must be a power of two and a multiple of {FP4_BLOCK} (the indexer's Hadamard rotation and FP4 blocks)"),
        ));
    }
    for &(site, width) in quantized_inputs {
        if width == 0 || !width.is_multiple_of(GEMM_INPUT_BLOCK) {
            return Err(bad(
                width_key(site),
                format!(
                    "{width} must be a multiple of {GEMM_INPUT_BLOCK}: it is the input width of a quantized GEMM (site {site}, FP8 1×128 blocks)"
                ),
            ));
        }
    }
    Ok(())
}

/// The config key that sets a GEMM-input site's width.
fn width_key(site: Component) -> &'static str {
    match site {
        Component::AttnQLatFp8 => "q_lora_rank",
        Component::AttnOLatFp8 => "o_lora_rank",
        Component::MoeTermHFp8 | Component::MoeSharedHFp8 => "moe_intermediate_size",
        _ => "hidden_size",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn site_set_holds_exactly_the_sites() {
        let mut s = SiteSet::default();
        assert!(s.insert(Component::AttnKvFp8));
        assert!(!s.insert(Component::AttnKv));
        assert!(s.contains(Component::AttnKvFp8));
        assert!(!s.contains(Component::AttnNormFp8));
        for c in SITES {
            assert!(c.spec().presence.is_quantized(), "{c}");
        }
        let all = Component::ALL
            .iter()
            .filter(|c| c.spec().presence.is_quantized())
            .count();
        assert_eq!(all, SITES.len());
    }

    #[test]
    fn kv_fake_quant_leaves_the_rope_channels() {
        let mut x: Vec<f32> = (0..192).map(|i| r_bf16(0.01 * i as f32 + 0.003)).collect();
        let rope = x[128..].to_vec();
        kv_fake_quant(&mut x, 64, false);
        assert_eq!(&x[128..], &rope[..]);
        let mut y = x.clone();
        kv_fake_quant(&mut y, 64, false);
        assert_eq!(x, y, "idempotent");
        let mut z: Vec<f32> = (0..192).map(|i| r_bf16(0.01 * i as f32 + 0.003)).collect();
        let orig = z.clone();
        kv_fake_quant(&mut z, 64, true);
        assert_eq!(z, orig, "skipped");
    }
}
