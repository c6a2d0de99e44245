//! Model configuration, deserialized straight from the transformers 5.23.0
//! `deepseek_v4` keys of `config.json` (`configuration_deepseek_v4.py`; see
//! docs/deepseek-v4-architecture.md §1) and validated into [`ModelConfig`].
//!
//! Legacy keys (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
//! `rope_scaling`) are accepted as in HF. Every validation error names the file
//! and the key.

use moeconf_fingerprint::catalogue;
use std::path::Path;

use serde::Deserialize;

use crate::error::RuntimeError;
use crate::files::{read_capped, MAX_CONFIG_BYTES};
use crate::weights::LinearFormat;

/// On-disk formats of the linears a release may quantize, as config.json declares them.
///
/// `quantization_config` (`quant_method: fp8`, `fmt: e4m3`, `scale_fmt: ue8m0`,
/// `weight_block_size: [128, 128]`, `activation_scheme: dynamic`) makes the dense
/// projections (attention `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the indexer's `wq_b`,
/// the shared expert, the MTP `e_proj`/`h_proj`) FP8 block-scaled; `expert_dtype`
/// (top level or inside `quantization_config`) chooses the routed experts' format:
/// `"fp4"` for MXFP4, `"fp8"` (the default under a `quantization_config`, as in
/// DeepSeek's inference code) for FP8 block-scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WeightScheme {
    /// Dense projections.
    pub dense: LinearFormat,
    /// Routed experts.
    pub experts: LinearFormat,
}

impl WeightScheme {
    /// Whether any class is quantized.
    pub fn is_quantized(&self) -> bool {
        *self != WeightScheme::default()
    }

    /// `dense <format>, experts <format>` for reports and bindings, e.g.
    /// `dense fp8-e4m3-b128, experts mxfp4` or `bf16/f32`.
    pub fn describe(&self) -> String {
        if !self.is_quantized() {
            return LinearFormat::Plain.name().to_string();
        }
        format!("dense {}, experts {}", self.dense.name(), self.experts.name())
    }
}

/// Attention kind of a decoder layer (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// `sliding_attention`: sliding window only, "main" rope.
    Sliding,
    /// `compressed_sparse_attention` (CSA): overlapping compressor + lightning indexer, "compress" rope.
    Csa,
    /// `heavily_compressed_attention` (HCA): non-overlapping compressor, "compress" rope.
    Hca,
}

/// MoE routing kind of a decoder layer (`mlp_layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// `hash_moe`: experts from `tid2eid[token]`.
    HashMoe,
    /// `moe`: sqrt-softplus top-k with the correction bias for selection.
    Moe,
}

/// YaRN parameters of the "compress" rope.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Scaling factor s.
    pub factor: f64,
    /// original_max_position_embeddings L0.
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// The validated architecture (notation of the notes §0).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// vocab_size V.
    pub vocab_size: usize,
    /// hidden_size D.
    pub hidden_size: usize,
    /// moe_intermediate_size I (routed and shared expert width).
    pub moe_intermediate_size: usize,
    /// num_attention_heads H.
    pub num_heads: usize,
    /// head_dim d.
    pub head_dim: usize,
    pub q_lora_rank: usize,
    /// r = int(head_dim · partial_rotary_factor): rotated trailing channels.
    pub rope_dim: usize,
    /// num_experts_per_tok k.
    pub experts_per_tok: usize,
    /// n_routed_experts E.
    pub n_routed_experts: usize,
    pub routed_scaling_factor: f32,
    /// rope_theta (main rope, sliding layers).
    pub rope_theta: f32,
    /// compress_rope_theta (compress rope, CSA/HCA layers).
    pub compress_rope_theta: f32,
    /// YaRN of the compress rope, if any.
    pub yarn: Option<Yarn>,
    /// Attention kind per layer.
    pub layer_types: Vec<AttentionKind>,
    /// Routing kind per layer.
    pub mlp_layer_types: Vec<MlpKind>,
    /// CSA compress rate m.
    pub csa_rate: usize,
    /// HCA compress rate m'.
    pub hca_rate: usize,
    /// hc_mult N.
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    /// swiglu_limit L.
    pub swiglu_limit: f32,
    /// sliding_window w.
    pub sliding_window: usize,
    /// o_groups G.
    pub o_groups: usize,
    /// o_lora_rank R.
    pub o_lora_rank: usize,
    /// index_n_heads H_I.
    pub index_n_heads: usize,
    /// index_head_dim d_I.
    pub index_head_dim: usize,
    /// index_topk K_I.
    pub index_topk: usize,
    /// rms_norm_eps ε.
    pub rms_norm_eps: f32,
    /// On-disk formats of the quantizable linears.
    pub weights: WeightScheme,
    /// Attention kind of each multi-token-prediction block `mtp.{j}`
    /// (`num_nextn_predict_layers` entries; from `compress_ratios[num_hidden_layers + j]`,
    /// sliding when the config has no such entry). MTP blocks are loaded and
    /// shape-checked, never run (the reference does no speculative decoding).
    pub mtp_layer_types: Vec<AttentionKind>,
}

#[derive(Debug, Deserialize)]
struct RawRope {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    /// Per-rope-type form written by transformers 5.x `save_pretrained`: `{main: {..}, compress: {..}}`.
    rope_theta: Option<f64>,
    main: Option<Box<RawRope>>,
    compress: Option<Box<RawRope>>,
}

#[derive(Debug, Deserialize)]
struct RawCompressRates {
    compressed_sparse_attention: Option<usize>,
    heavily_compressed_attention: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    moe_intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    head_dim: Option<usize>,
    q_lora_rank: Option<usize>,
    partial_rotary_factor: Option<f64>,
    qk_rope_head_dim: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    scoring_func: Option<String>,
    routed_scaling_factor: Option<f64>,
    rope_theta: Option<f64>,
    compress_rope_theta: Option<f64>,
    rope_parameters: Option<RawRope>,
    rope_scaling: Option<RawRope>,
    layer_types: Option<Vec<String>>,
    compress_ratios: Option<Vec<usize>>,
    compress_rates: Option<RawCompressRates>,
    mlp_layer_types: Option<Vec<String>>,
    num_hash_layers: Option<usize>,
    hc_mult: Option<usize>,
    hc_sinkhorn_iters: Option<usize>,
    hc_eps: Option<f64>,
    swiglu_limit: Option<f64>,
    sliding_window: Option<usize>,
    o_groups: Option<usize>,
    o_lora_rank: Option<usize>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    quantization_config: Option<serde_json::Value>,
    expert_dtype: Option<serde_json::Value>,
    num_nextn_predict_layers: Option<usize>,
    model_type: Option<String>,
    tie_word_embeddings: Option<bool>,
    mlp_bias: Option<bool>,
}

/// Upper bound on any single dimension, so a hostile config cannot make the
/// runtime allocate absurd buffers before the weight shapes are checked.
pub const MAX_DIM: usize = 1 << 24;

/// Upper bound on `num_hidden_layers` (DeepSeek-V4 has 61).
pub const MAX_LAYERS: usize = 1024;

/// Upper bound on `hc_mult`, the number of residual streams (DeepSeek-V4: 4).
pub const MAX_HC_MULT: usize = 64;

/// Upper bound on `hc_sinkhorn_iters` (DeepSeek-V4: 20): each iteration is
/// O(hc_mult²) work at every mHC site of every token.
pub const MAX_SINKHORN_ITERS: usize = 1000;

/// A config number as written in messages: plain decimal, or scientific
/// notation when that would be very long.
fn show(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e16).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// The allowed values of a floating-point key: finite, above (or at) `lo`,
/// at most `hi`.
#[derive(Debug, Clone, Copy)]
struct Range {
    lo: f64,
    lo_open: bool,
    hi: f64,
}

impl Range {
    /// Finite and > `lo` (and representable as a finite f32).
    const fn above(lo: f64) -> Range {
        Range {
            lo,
            lo_open: true,
            hi: f32::MAX as f64,
        }
    }

    /// Finite and ≥ `lo` (and representable as a finite f32).
    const fn at_least(lo: f64) -> Range {
        Range {
            lo,
            lo_open: false,
            hi: f32::MAX as f64,
        }
    }

    /// In (0, 1] (epsilons).
    const EPSILON: Range = Range {
        lo: 0.0,
        lo_open: true,
        hi: 1.0,
    };

    fn contains(self, x: f64) -> bool {
        let above = if self.lo_open { x > self.lo } else { x >= self.lo };
        x.is_finite() && above && x <= self.hi
    }

    fn describe(self) -> String {
        let op = if self.lo_open { ">" } else { ">=" };
        if self.hi == f32::MAX as f64 {
            format!("a finite number {op} {}", self.lo)
        } else {
            let open = if self.lo_open { "(" } else { "[" };
            format!("a number in {open}{}, {}]", self.lo, self.hi)
        }
    }
}

/// The dimensions read first (all required except the rotary width).
struct Dims {
    vocab_size: usize,
    hidden_size: usize,
    moe_intermediate_size: usize,
    num_layers: usize,
    num_heads: usize,
    head_dim: usize,
    q_lora_rank: usize,
    rope_dim: usize,
    experts_per_tok: usize,
    n_routed_experts: usize,
}

/// The rope sections of a config: the per-rope-type sub-dicts (if the
/// config has that form) and the compress rope's YaRN.
struct RopeKeys<'r> {
    main: Option<&'r RawRope>,
    compress: Option<&'r RawRope>,
    yarn: Option<Yarn>,
}

/// Reads and validates the keys of one `config.json`; every error names the
/// file and the key.
struct Keys<'p> {
    path: &'p Path,
}

impl Keys<'_> {
    fn err(&self, message: String) -> RuntimeError {
        RuntimeError::Config {
            path: self.path.to_path_buf(),
            message,
        }
    }

    /// A required integer in `1..=max`.
    fn need_at_most(&self, v: Option<usize>, key: &str, max: usize) -> Result<usize, RuntimeError> {
        match v {
            None => Err(self.err(format!("missing key `{key}`"))),
            Some(x) if x == 0 || x > max => Err(self.err(format!(
                "key `{key}` = {x} is out of range: expected an integer in 1..={max}"
            ))),
            Some(x) => Ok(x),
        }
    }

    /// A required dimension in `1..=`[`MAX_DIM`].
    fn need(&self, v: Option<usize>, key: &str) -> Result<usize, RuntimeError> {
        self.need_at_most(v, key, MAX_DIM)
    }

    /// An optional dimension with a default, validated like [`Keys::need`].
    fn or(&self, v: Option<usize>, default: usize, key: &str) -> Result<usize, RuntimeError> {
        self.need(Some(v.unwrap_or(default)), key)
    }

    /// An optional integer in `1..=max` with a default.
    fn or_at_most(
        &self,
        v: Option<usize>,
        default: usize,
        key: &str,
        max: usize,
    ) -> Result<usize, RuntimeError> {
        self.need_at_most(Some(v.unwrap_or(default)), key, max)
    }

    /// A real number in `range`.
    fn real(&self, x: f64, key: &str, range: Range) -> Result<f64, RuntimeError> {
        if !range.contains(x) {
            return Err(self.err(format!(
                "key `{key}` = {} is out of range: expected {}",
                show(x),
                range.describe()
            )));
        }
        Ok(x)
    }

    /// An optional scalar in `range` with a default, as f32.
    fn float(&self, v: Option<f64>, default: f64, key: &str, range: Range) -> Result<f32, RuntimeError> {
        Ok(self.real(v.unwrap_or(default), key, range)? as f32)
    }

    fn dims(&self, raw: &RawConfig) -> Result<Dims, RuntimeError> {
        let vocab_size = self.need(raw.vocab_size, "vocab_size")?;
        let hidden_size = self.need(raw.hidden_size, "hidden_size")?;
        let moe_intermediate_size = self.need(raw.moe_intermediate_size, "moe_intermediate_size")?;
        let num_layers = self.need_at_most(raw.num_hidden_layers, "num_hidden_layers", MAX_LAYERS)?;
        let num_heads = self.need(raw.num_attention_heads, "num_attention_heads")?;
        let head_dim = self.need(raw.head_dim, "head_dim")?;
        let q_lora_rank = self.need(raw.q_lora_rank, "q_lora_rank")?;
        let rope_dim = match (raw.partial_rotary_factor, raw.qk_rope_head_dim) {
            (Some(f), _) => {
                self.real(f, "partial_rotary_factor", Range::EPSILON)?;
                (head_dim as f64 * f) as usize
            }
            (None, Some(r)) => r,
            (None, None) => head_dim / 8,
        };
        Ok(Dims {
            vocab_size,
            hidden_size,
            moe_intermediate_size,
            num_layers,
            num_heads,
            head_dim,
            q_lora_rank,
            rope_dim,
            experts_per_tok: self.need(raw.num_experts_per_tok, "num_experts_per_tok")?,
            n_routed_experts: self.need(raw.n_routed_experts, "n_routed_experts")?,
        })
    }

    /// Refuses what the runtime does not implement: another model type, a
    /// head tied to the embedding, shared-expert biases, more than one
    /// shared expert, other scoring functions and activations. Keys that
    /// transformers' DeepSeek-V4 itself ignores (`num_key_value_heads`,
    /// `norm_topk_prob`, `attention_bias`, docs/deepseek-v4-architecture.md
    /// §1) are ignored here too; a key transformers would act on is refused
    /// rather than silently run differently.
    fn check_supported(&self, raw: &RawConfig) -> Result<(), RuntimeError> {
        if let Some(t) = raw.model_type.as_deref() {
            if t != "deepseek_v4" {
                return Err(self.err(format!(
                    "key `model_type` = {t:?} is unsupported (only \"deepseek_v4\")"
                )));
            }
        }
        if raw.tie_word_embeddings == Some(true) {
            return Err(self.err(
                "key `tie_word_embeddings` = true is unsupported: DeepSeek-V4 has a separate LM head \
                 (`head.weight`), which this runtime always uses, where transformers would replace it \
                 with the embedding"
                    .to_string(),
            ));
        }
        if raw.mlp_bias == Some(true) {
            return Err(self.err(
                "key `mlp_bias` = true is unsupported: DeepSeek-V4's shared expert has no biases \
                 (transformers would add them)"
                    .to_string(),
            ));
        }
        if let Some(s) = raw.n_shared_experts {
            if s != 1 {
                return Err(self.err(format!(
                    "key `n_shared_experts` = {s}: DeepSeek-V4 has exactly one shared expert"
                )));
            }
        }
        match raw.scoring_func.as_deref() {
            None | Some("sqrtsoftplus") => {}
            Some(other) => {
                return Err(self.err(format!(
                    "key `scoring_func` = {other:?} is unsupported (only \"sqrtsoftplus\")"
                )))
            }
        }
        match raw.hidden_act.as_deref() {
            None | Some("silu") => {}
            Some(other) => {
                return Err(self.err(format!(
                    "key `hidden_act` = {other:?} is unsupported (only \"silu\")"
                )))
            }
        }
        Ok(())
    }

    /// The weight formats declared by `quantization_config` and `expert_dtype`;
    /// anything but the released FP8 scheme is refused naming the key.
    fn weight_scheme(&self, raw: &RawConfig) -> Result<WeightScheme, RuntimeError> {
        let q = match &raw.quantization_config {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Object(m)) => Some(m),
            Some(other) => {
                return Err(self.err(format!("key `quantization_config` = {other} is not an object")))
            }
        };
        let text = |m: &serde_json::Map<String, serde_json::Value>,
                    key: &str|
         -> Result<Option<String>, RuntimeError> {
            match m.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(v)) => Ok(Some(v.clone())),
                Some(other) => Err(self.err(format!(
                    "key `quantization_config.{key}` = {other} is not a string"
                ))),
            }
        };
        let expert_key = |v: &serde_json::Value, key: &str| -> Result<LinearFormat, RuntimeError> {
            match v.as_str() {
                Some("fp4") => Ok(LinearFormat::Mxfp4),
                Some("fp8") => Ok(LinearFormat::Fp8Block128),
                _ => Err(self.err(format!(
                    "key `{key}` = {v} is unsupported (only \"fp4\" for MXFP4 experts or \"fp8\")"
                ))),
            }
        };
        let mut experts = None;
        if let Some(v) = raw.expert_dtype.as_ref().filter(|v| !v.is_null()) {
            experts = Some(expert_key(v, "expert_dtype")?);
        }
        let Some(m) = q else {
            return Ok(WeightScheme {
                dense: LinearFormat::Plain,
                experts: match experts {
                    Some(LinearFormat::Fp8Block128) => {
                        return Err(self.err(
                            "key `expert_dtype` = \"fp8\" needs a `quantization_config` (FP8 block size and scale format)".into(),
                        ))
                    }
                    Some(f) => f,
                    None => LinearFormat::Plain,
                },
            });
        };
        match text(m, "quant_method")?.as_deref() {
            Some("fp8") => {}
            Some(other) => {
                return Err(self.err(format!(
                    "key `quantization_config.quant_method` = {other:?} is unsupported (only \"fp8\", the released DeepSeek-V4 scheme)"
                )))
            }
            None => return Err(self.err("key `quantization_config.quant_method` missing (expected \"fp8\")".into())),
        }
        match text(m, "fmt")?.as_deref() {
            None | Some("e4m3") => {}
            Some(other) => {
                return Err(self.err(format!(
                    "key `quantization_config.fmt` = {other:?} is unsupported (only \"e4m3\")"
                )))
            }
        }
        match text(m, "scale_fmt")?.as_deref() {
            Some("ue8m0") => {}
            Some(other) => {
                return Err(self.err(format!(
                    "key `quantization_config.scale_fmt` = {other:?} is unsupported (only \"ue8m0\": power-of-two scales in `<name>.scale`)"
                )))
            }
            None => {
                return Err(self.err(
                    "key `quantization_config.scale_fmt` missing: only \"ue8m0\" block scales (`<name>.scale`) are supported".into(),
                ))
            }
        }
        match m.get("weight_block_size") {
            Some(v)
                if v.as_array()
                    .is_some_and(|a| a.len() == 2 && a.iter().all(|x| x.as_u64() == Some(128))) => {}
            Some(v) => {
                return Err(self.err(format!(
                    "key `quantization_config.weight_block_size` = {v} is unsupported (only [128, 128])"
                )))
            }
            None => {
                return Err(self
                    .err("key `quantization_config.weight_block_size` missing (expected [128, 128])".into()))
            }
        }
        match text(m, "activation_scheme")?.as_deref() {
            None | Some("dynamic") => {}
            Some(other) => {
                return Err(self.err(format!(
                "key `quantization_config.activation_scheme` = {other:?} is unsupported (only \"dynamic\")"
            )))
            }
        }
        if let Some(v) = m.get("expert_dtype").filter(|v| !v.is_null()) {
            let inner = expert_key(v, "quantization_config.expert_dtype")?;
            if experts.is_some_and(|top| top != inner) {
                return Err(self.err(format!(
                    "key `quantization_config.expert_dtype` = {v} contradicts the top-level `expert_dtype`"
                )));
            }
            experts = Some(inner);
        }
        Ok(WeightScheme {
            dense: LinearFormat::Fp8Block128,
            experts: experts.unwrap_or(LinearFormat::Fp8Block128),
        })
    }

    /// Attention kinds of the `num_nextn_predict_layers` MTP blocks.
    fn mtp_layer_types(
        &self,
        raw: &RawConfig,
        num_layers: usize,
    ) -> Result<Vec<AttentionKind>, RuntimeError> {
        let n = raw.num_nextn_predict_layers.unwrap_or(0);
        if n > MAX_LAYERS {
            return Err(self.err(format!(
                "key `num_nextn_predict_layers` = {n} is out of range: expected an integer in 0..={MAX_LAYERS}"
            )));
        }
        (0..n)
            .map(|j| {
                let i = num_layers + j;
                match raw.compress_ratios.as_ref().and_then(|cr| cr.get(i)) {
                    None | Some(0) => Ok(AttentionKind::Sliding),
                    Some(4) => Ok(AttentionKind::Csa),
                    Some(128) => Ok(AttentionKind::Hca),
                    Some(other) => Err(self.err(format!(
                        "key `compress_ratios[{i}]` = {other} (only 0, 4, 128 map to a layer type)"
                    ))),
                }
            })
            .collect()
    }

    fn rope<'r>(&self, raw: &'r RawConfig) -> Result<RopeKeys<'r>, RuntimeError> {
        let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
        // transformers 5.x saves the per-rope-type form {main: {..}, compress: {..}}: YaRN (if any)
        // lives in `compress`, and each sub-dict carries its own rope_theta, which HF uses.
        let (main, compress) = match rope {
            Some(r) if r.main.is_some() || r.compress.is_some() => (r.main.as_deref(), r.compress.as_deref()),
            _ => (None, None),
        };
        if let Some(t) = main
            .and_then(|m| m.rope_type.as_deref())
            .filter(|t| *t != "default")
        {
            return Err(self.err(format!(
                "key `rope_parameters.main.rope_type` = {t:?} is unsupported (only the compress rope may scale)"
            )));
        }
        let section = if raw.rope_parameters.is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let (scaled, prefix) = if main.is_some() || compress.is_some() {
            (compress, format!("{section}.compress"))
        } else {
            (rope, section.to_string())
        };
        let yarn = match scaled {
            None => None,
            Some(r) => self.yarn(r, &prefix)?,
        };
        Ok(RopeKeys { main, compress, yarn })
    }

    /// The YaRN parameters of the scaled rope (keys under `prefix`), `None`
    /// for an unscaled one. As in HF, factor ≥ 1; the correction range
    /// takes logarithms of `original_max_position_embeddings / (2π·β)`, so
    /// both are positive.
    fn yarn(&self, r: &RawRope, prefix: &str) -> Result<Option<Yarn>, RuntimeError> {
        let key = |k: &str| format!("{prefix}.{k}");
        let required =
            |v: Option<f64>, k: &str| v.ok_or_else(|| self.err(format!("key `{}` missing for yarn", key(k))));
        match r.rope_type.as_deref() {
            None | Some("default") => Ok(None),
            Some("yarn") => Ok(Some(Yarn {
                factor: self.real(
                    required(r.factor, "factor")?,
                    &key("factor"),
                    Range::at_least(1.0),
                )?,
                original_max_position_embeddings: self.real(
                    required(
                        r.original_max_position_embeddings,
                        "original_max_position_embeddings",
                    )?,
                    &key("original_max_position_embeddings"),
                    Range::at_least(1.0),
                )?,
                beta_fast: self.real(r.beta_fast.unwrap_or(32.0), &key("beta_fast"), Range::above(0.0))?,
                beta_slow: self.real(r.beta_slow.unwrap_or(1.0), &key("beta_slow"), Range::above(0.0))?,
            })),
            Some(other) => Err(self.err(format!("key `{}` = {other:?} is unsupported", key("rope_type")))),
        }
    }

    fn compress_rates(&self, raw: &RawConfig) -> Result<(usize, usize), RuntimeError> {
        Ok(match &raw.compress_rates {
            Some(c) => (
                self.or(
                    c.compressed_sparse_attention,
                    4,
                    "compress_rates.compressed_sparse_attention",
                )?,
                self.or(
                    c.heavily_compressed_attention,
                    128,
                    "compress_rates.heavily_compressed_attention",
                )?,
            ),
            None => (4, 128),
        })
    }

    /// `layer_types`, or the legacy `compress_ratios`; one per layer.
    fn layer_types(&self, raw: &RawConfig, num_layers: usize) -> Result<Vec<AttentionKind>, RuntimeError> {
        let layer_types = match (&raw.layer_types, &raw.compress_ratios) {
            (Some(lt), _) => lt
                .iter()
                .enumerate()
                .map(|(i, s)| match s.as_str() {
                    "sliding_attention" => Ok(AttentionKind::Sliding),
                    "compressed_sparse_attention" => Ok(AttentionKind::Csa),
                    "heavily_compressed_attention" => Ok(AttentionKind::Hca),
                    other => Err(self.err(format!(
                        "key `layer_types[{i}]` = {other:?} is not a DeepSeek-V4 layer type"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            (None, Some(cr)) => cr
                .iter()
                .take(num_layers)
                .enumerate()
                .map(|(i, r)| match r {
                    0 => Ok(AttentionKind::Sliding),
                    4 => Ok(AttentionKind::Csa),
                    128 => Ok(AttentionKind::Hca),
                    other => Err(self.err(format!(
                        "key `compress_ratios[{i}]` = {other} (only 0, 4, 128 map to a layer type)"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            (None, None) => return Err(self.err("missing key `layer_types`".into())),
        };
        if layer_types.len() != num_layers {
            return Err(self.err(format!(
                "key `layer_types` has {} entries, expected num_hidden_layers = {num_layers}",
                layer_types.len()
            )));
        }
        Ok(layer_types)
    }

    /// `mlp_layer_types`, or the legacy `num_hash_layers` (default 3); one per layer.
    fn mlp_layer_types(&self, raw: &RawConfig, num_layers: usize) -> Result<Vec<MlpKind>, RuntimeError> {
        let mlp_layer_types = match &raw.mlp_layer_types {
            Some(m) => m
                .iter()
                .enumerate()
                .map(|(i, s)| match s.as_str() {
                    "hash_moe" => Ok(MlpKind::HashMoe),
                    "moe" => Ok(MlpKind::Moe),
                    other => Err(self.err(format!(
                        "key `mlp_layer_types[{i}]` = {other:?} (expected \"hash_moe\" or \"moe\")"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let h = raw.num_hash_layers.unwrap_or(3);
                (0..num_layers)
                    .map(|i| if i < h { MlpKind::HashMoe } else { MlpKind::Moe })
                    .collect()
            }
        };
        if mlp_layer_types.len() != num_layers {
            return Err(self.err(format!(
                "key `mlp_layer_types` has {} entries, expected num_hidden_layers = {num_layers}",
                mlp_layer_types.len()
            )));
        }
        Ok(mlp_layer_types)
    }

    /// Relations between keys (rotary width, experts, groups, epsilons).
    fn check_consistency(&self, cfg: &ModelConfig) -> Result<(), RuntimeError> {
        if cfg.rope_dim == 0 || !cfg.rope_dim.is_multiple_of(2) || cfg.rope_dim > cfg.head_dim {
            return Err(self.err(format!(
                "key `partial_rotary_factor`: rotary width {} must be even, positive and at most head_dim {}",
                cfg.rope_dim, cfg.head_dim
            )));
        }
        if cfg.rope_dim > cfg.index_head_dim {
            return Err(self.err(format!(
                "key `index_head_dim` = {} is smaller than the rotary width {}",
                cfg.index_head_dim, cfg.rope_dim
            )));
        }
        if cfg.experts_per_tok > cfg.n_routed_experts {
            return Err(self.err(format!(
                "key `num_experts_per_tok` = {} exceeds n_routed_experts = {}",
                cfg.experts_per_tok, cfg.n_routed_experts
            )));
        }
        if !cfg.num_heads.is_multiple_of(cfg.o_groups) {
            return Err(self.err(format!(
                "key `o_groups` = {} does not divide num_attention_heads = {}",
                cfg.o_groups, cfg.num_heads
            )));
        }
        Ok(())
    }
}

impl ModelConfig {
    /// Reads and validates `path` (a `config.json`).
    /// The file must be a regular file of at most
    /// [`crate::files::MAX_CONFIG_BYTES`].
    pub fn from_file(path: &Path) -> Result<ModelConfig, RuntimeError> {
        let bytes = read_capped(path, "config.json", MAX_CONFIG_BYTES)?;
        let text = String::from_utf8(bytes).map_err(|e| RuntimeError::Config {
            path: path.to_path_buf(),
            message: format!(
                "not UTF-8 (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        })?;
        ModelConfig::from_json(path, &text)
    }

    /// Parses and validates config text; `path` is only used in messages.
    /// Keys are checked in a fixed order (dimensions, supported features,
    /// rope, layer kinds, scalars, then their consistency), so the first
    /// error reported does not depend on the JSON's key order.
    pub fn from_json(path: &Path, text: &str) -> Result<ModelConfig, RuntimeError> {
        let k = Keys { path };
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| k.err(format!("invalid JSON: {e}")))?;
        let dims = k.dims(&raw)?;
        k.check_supported(&raw)?;
        let weights = k.weight_scheme(&raw)?;
        let rope = k.rope(&raw)?;
        let (csa_rate, hca_rate) = k.compress_rates(&raw)?;
        let layer_types = k.layer_types(&raw, dims.num_layers)?;
        let mlp_layer_types = k.mlp_layer_types(&raw, dims.num_layers)?;
        let mtp_layer_types = k.mtp_layer_types(&raw, dims.num_layers)?;
        let cfg = ModelConfig {
            vocab_size: dims.vocab_size,
            hidden_size: dims.hidden_size,
            moe_intermediate_size: dims.moe_intermediate_size,
            num_heads: dims.num_heads,
            head_dim: dims.head_dim,
            q_lora_rank: dims.q_lora_rank,
            rope_dim: dims.rope_dim,
            experts_per_tok: dims.experts_per_tok,
            n_routed_experts: dims.n_routed_experts,
            routed_scaling_factor: k.float(
                raw.routed_scaling_factor,
                1.5,
                "routed_scaling_factor",
                Range::above(0.0),
            )?,
            rope_theta: k.float(
                rope.main.and_then(|m| m.rope_theta).or(raw.rope_theta),
                10000.0,
                "rope_theta",
                Range::above(1.0),
            )?,
            compress_rope_theta: k.float(
                rope.compress
                    .and_then(|c| c.rope_theta)
                    .or(raw.compress_rope_theta),
                160000.0,
                "compress_rope_theta",
                Range::above(1.0),
            )?,
            yarn: rope.yarn,
            layer_types,
            mlp_layer_types,
            csa_rate,
            hca_rate,
            hc_mult: k.or_at_most(raw.hc_mult, 4, "hc_mult", MAX_HC_MULT)?,
            hc_sinkhorn_iters: k.or_at_most(
                raw.hc_sinkhorn_iters,
                20,
                "hc_sinkhorn_iters",
                MAX_SINKHORN_ITERS,
            )?,
            hc_eps: k.float(raw.hc_eps, 1e-6, "hc_eps", Range::EPSILON)?,
            swiglu_limit: k.float(raw.swiglu_limit, 10.0, "swiglu_limit", Range::above(0.0))?,
            sliding_window: k.or(raw.sliding_window, 128, "sliding_window")?,
            o_groups: k.or(raw.o_groups, 8, "o_groups")?,
            o_lora_rank: k.or(raw.o_lora_rank, 1024, "o_lora_rank")?,
            index_n_heads: k.or(raw.index_n_heads, 64, "index_n_heads")?,
            index_head_dim: k.or(raw.index_head_dim, 128, "index_head_dim")?,
            index_topk: k.or(raw.index_topk, 512, "index_topk")?,
            rms_norm_eps: k.float(raw.rms_norm_eps, 1e-6, "rms_norm_eps", Range::EPSILON)?,
            weights,
            mtp_layer_types,
        };
        k.check_consistency(&cfg)?;
        Ok(cfg)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Compress rate of a layer kind (0 for sliding layers).
    pub fn compress_rate(&self, kind: AttentionKind) -> usize {
        match kind {
            AttentionKind::Sliding => 0,
            AttentionKind::Csa => self.csa_rate,
            AttentionKind::Hca => self.hca_rate,
        }
    }

    /// The catalogue's layer kinds of decoder layer `layer` (which records it
    /// has, `moeconf_fingerprint::catalogue::LayerKinds`), or `None` past the
    /// last layer.
    pub fn catalogue_kinds(&self, layer: usize) -> Option<(catalogue::AttentionKind, catalogue::FfnKind)> {
        let attention = match self.layer_types.get(layer)? {
            AttentionKind::Sliding => catalogue::AttentionKind::Sliding,
            AttentionKind::Csa => catalogue::AttentionKind::Csa,
            AttentionKind::Hca => catalogue::AttentionKind::Hca,
        };
        let ffn = match self.mlp_layer_types.get(layer)? {
            MlpKind::Moe => catalogue::FfnKind::Moe,
            MlpKind::HashMoe => catalogue::FfnKind::HashMoe,
        };
        Some((attention, ffn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 8, "head_dim": 64, "q_lora_rank": 64, "num_experts_per_tok": 6,
            "n_routed_experts": 32, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 4,
            "index_head_dim": 32, "index_topk": 4, "sliding_window": 8
        })
    }

    #[test]
    fn legacy_keys_map_like_hf() {
        // compress_ratios 0/4/128 → sliding/CSA/HCA; qk_rope_head_dim → r; num_hash_layers → mlp types;
        // legacy rope_scaling {type: yarn} → YaRN on the compress rope.
        let mut v = base();
        v["compress_ratios"] = serde_json::json!([0, 4, 128, 0]);
        v["qk_rope_head_dim"] = serde_json::json!(16);
        v["num_hash_layers"] = serde_json::json!(1);
        v["rope_scaling"] =
            serde_json::json!({"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536});
        let c = ModelConfig::from_json(Path::new("config.json"), &v.to_string()).unwrap();
        assert_eq!(
            c.layer_types,
            vec![AttentionKind::Sliding, AttentionKind::Csa, AttentionKind::Hca]
        );
        assert_eq!(
            c.mlp_layer_types,
            vec![MlpKind::HashMoe, MlpKind::Moe, MlpKind::Moe]
        );
        assert_eq!(c.rope_dim, 16);
        assert_eq!((c.csa_rate, c.hca_rate), (4, 128));
        assert_eq!(c.yarn.map(|y| y.factor), Some(16.0));
    }

    #[test]
    fn nested_rope_parameters_as_saved_by_transformers() {
        // transformers 5.23 `save_pretrained` writes {main: {..}, compress: {..}}; YaRN is on `compress`.
        let mut v = base();
        v["layer_types"] = serde_json::json!([
            "sliding_attention",
            "compressed_sparse_attention",
            "sliding_attention"
        ]);
        v["rope_parameters"] = serde_json::json!({
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 65536, "attention_factor": 1.0}
        });
        let c = ModelConfig::from_json(Path::new("config.json"), &v.to_string()).unwrap();
        assert_eq!(
            c.yarn.map(|y| (y.factor, y.original_max_position_embeddings)),
            Some((16.0, 65536.0))
        );
        assert_eq!((c.rope_theta, c.compress_rope_theta), (10000.0, 160000.0));
        v["rope_parameters"]["main"]["rope_type"] = serde_json::json!("yarn");
        let e = ModelConfig::from_json(Path::new("config.json"), &v.to_string()).unwrap_err();
        assert!(e.to_string().contains("rope_parameters.main.rope_type"), "{e}");
    }

    fn released_quantization() -> serde_json::Value {
        serde_json::json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    }

    #[test]
    fn released_quantization_config_selects_fp8_dense_and_the_expert_format() {
        let mut v = base();
        v["compress_ratios"] = serde_json::json!([0, 4, 128, 0]);
        v["num_nextn_predict_layers"] = serde_json::json!(1);
        let plain = ModelConfig::from_json(Path::new("c.json"), &v.to_string()).unwrap();
        assert_eq!(plain.weights, WeightScheme::default());
        assert_eq!(plain.weights.describe(), "bf16/f32");
        assert_eq!(plain.mtp_layer_types, vec![AttentionKind::Sliding]);
        v["quantization_config"] = released_quantization();
        let fp8 = ModelConfig::from_json(Path::new("c.json"), &v.to_string()).unwrap();
        assert_eq!(
            fp8.weights,
            WeightScheme {
                dense: LinearFormat::Fp8Block128,
                experts: LinearFormat::Fp8Block128
            }
        );
        v["expert_dtype"] = serde_json::json!("fp4");
        let fp4 = ModelConfig::from_json(Path::new("c.json"), &v.to_string()).unwrap();
        assert_eq!(fp4.weights.experts, LinearFormat::Mxfp4);
        assert_eq!(fp4.weights.describe(), "dense fp8-e4m3-b128, experts mxfp4");
        // transformers folds expert_dtype into quantization_config: same meaning.
        let mut folded = v.clone();
        folded.as_object_mut().unwrap().remove("expert_dtype");
        folded["quantization_config"]["expert_dtype"] = serde_json::json!("fp4");
        let f = ModelConfig::from_json(Path::new("c.json"), &folded.to_string()).unwrap();
        assert_eq!(f.weights, fp4.weights);
        // The MTP block's kind comes from compress_ratios[num_hidden_layers].
        v["compress_ratios"] = serde_json::json!([0, 4, 128, 4]);
        let c = ModelConfig::from_json(Path::new("c.json"), &v.to_string()).unwrap();
        assert_eq!(c.mtp_layer_types, vec![AttentionKind::Csa]);
    }

    #[test]
    fn unsupported_quantization_keys_are_refused_by_name() {
        type Edit = fn(&mut serde_json::Value);
        let cases: [(Edit, &str); 9] = [
            (
                |v| v["quantization_config"]["quant_method"] = "awq".into(),
                "key `quantization_config.quant_method` = \"awq\" is unsupported",
            ),
            (
                |v| v["quantization_config"]["fmt"] = "e5m2".into(),
                "key `quantization_config.fmt` = \"e5m2\" is unsupported",
            ),
            (
                |v| v["quantization_config"]["scale_fmt"] = "fp32".into(),
                "key `quantization_config.scale_fmt` = \"fp32\" is unsupported",
            ),
            (
                |v| {
                    v["quantization_config"]
                        .as_object_mut()
                        .unwrap()
                        .remove("scale_fmt");
                },
                "key `quantization_config.scale_fmt` missing",
            ),
            (
                |v| v["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64]),
                "key `quantization_config.weight_block_size` = [64,64] is unsupported (only [128, 128])",
            ),
            (
                |v| v["quantization_config"]["activation_scheme"] = "static".into(),
                "key `quantization_config.activation_scheme` = \"static\" is unsupported",
            ),
            (
                |v| v["expert_dtype"] = "int4".into(),
                "key `expert_dtype` = \"int4\" is unsupported",
            ),
            (
                |v| {
                    v["expert_dtype"] = "fp4".into();
                    v["quantization_config"]["expert_dtype"] = "fp8".into();
                },
                "contradicts the top-level `expert_dtype`",
            ),
            (
                |v| v["quantization_config"] = serde_json::json!("fp8"),
                "key `quantization_config` = \"fp8\" is not an object",
            ),
        ];
        for (edit, want) in cases {
            let mut v = base();
            v["layer_types"] =
                serde_json::json!(["sliding_attention", "sliding_attention", "sliding_attention"]);
            v["quantization_config"] = released_quantization();
            edit(&mut v);
            let e = ModelConfig::from_json(Path::new("x/config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("x/config.json: key `"), "{e}");
            assert!(e.contains(want), "{e}\nwanted: {want}");
        }
    }

    #[test]
    fn zero_and_huge_dimensions_are_refused() {
        for (key, val) in [("hidden_size", 0u64), ("vocab_size", 1 << 40)] {
            let mut v = base();
            v["layer_types"] =
                serde_json::json!(["sliding_attention", "sliding_attention", "sliding_attention"]);
            v[key] = serde_json::json!(val);
            let e = ModelConfig::from_json(Path::new("config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn values_out_of_range_name_key_value_and_range() {
        let sliding = serde_json::json!(["sliding_attention", "sliding_attention", "sliding_attention"]);
        let yarn = serde_json::json!({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536});
        type Edit = fn(&mut serde_json::Value);
        let cases: [(Edit, &str); 16] = [
            (
                |v| v["rope_theta"] = 0.0.into(),
                "key `rope_theta` = 0 is out of range: expected a finite number > 1",
            ),
            (
                |v| v["compress_rope_theta"] = 1.0.into(),
                "key `compress_rope_theta` = 1 is out of range",
            ),
            (
                |v| v["rope_theta"] = 1e300.into(),
                "key `rope_theta` = 1e300 is out of range",
            ),
            (
                |v| v["rope_parameters"]["factor"] = 0.5.into(),
                "key `rope_parameters.factor` = 0.5 is out of range: expected a finite number >= 1",
            ),
            (
                |v| v["rope_parameters"]["original_max_position_embeddings"] = 0.into(),
                "`rope_parameters.original_max_position_embeddings` = 0",
            ),
            (
                |v| v["rope_parameters"]["beta_fast"] = 0.0.into(),
                "`rope_parameters.beta_fast` = 0 is out of range: expected a finite number > 0",
            ),
            (
                |v| v["rope_parameters"]["beta_slow"] = (-1.0).into(),
                "`rope_parameters.beta_slow` = -1",
            ),
            (
                |v| v["hc_sinkhorn_iters"] = (1u64 << 24).into(),
                "key `hc_sinkhorn_iters` = 16777216 is out of range: expected an integer in 1..=1000",
            ),
            (
                |v| v["hc_mult"] = 65.into(),
                "key `hc_mult` = 65 is out of range: expected an integer in 1..=64",
            ),
            (
                |v| v["num_hidden_layers"] = 1025.into(),
                "key `num_hidden_layers` = 1025 is out of range: expected an integer in 1..=1024",
            ),
            (
                |v| v["hc_eps"] = 0.0.into(),
                "key `hc_eps` = 0 is out of range: expected a number in (0, 1]",
            ),
            (
                |v| v["rms_norm_eps"] = 2.0.into(),
                "key `rms_norm_eps` = 2 is out of range",
            ),
            (
                |v| v["swiglu_limit"] = 0.0.into(),
                "key `swiglu_limit` = 0 is out of range: expected a finite number > 0",
            ),
            (
                |v| v["routed_scaling_factor"] = 0.0.into(),
                "key `routed_scaling_factor` = 0 is out of range",
            ),
            (
                |v| v["partial_rotary_factor"] = 0.0.into(),
                "key `partial_rotary_factor` = 0 is out of range: expected a number in (0, 1]",
            ),
            (
                |v| v["sliding_window"] = 0.into(),
                "key `sliding_window` = 0 is out of range: expected an integer in 1..=16777216",
            ),
        ];
        for (edit, want) in cases {
            let mut v = base();
            v["layer_types"] = sliding.clone();
            v["rope_parameters"] = yarn.clone();
            edit(&mut v);
            let e = ModelConfig::from_json(Path::new("m/config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("m/config.json: "), "{e}");
            assert!(e.contains(want), "{e}\nwanted: {want}");
        }
        // The nested transformers form names the nested key.
        let mut v = base();
        v["layer_types"] = sliding;
        v["rope_parameters"] = serde_json::json!({"main": {"rope_type": "default"},
            "compress": {"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 65536}});
        let e = ModelConfig::from_json(Path::new("config.json"), &v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`rope_parameters.compress.factor` = 0"), "{e}");
    }
}
