//! What llama.cpp's `deepseek4` architecture expects in a GGUF, and how each of its tensors
//! is made from the checkpoint (llama-cpp-python 0.3.36's vendored llama.cpp:
//! `src/models/deepseek4.cpp` `load_arch_hparams` / `load_arch_tensors`, names from
//! `src/llama-arch.cpp` `LLM_TENSOR_NAMES` and `LLM_KV_NAMES`; the converter's mapping in
//! `conversion/deepseek.py` `DeepseekV4Model`). docs/interop-llamacpp.md §2 has the table.
//!
//! Every GGUF tensor is one checkpoint tensor with its dimensions reversed (ggml's `ne` is
//! innermost first, so the row-major bytes are unchanged), except the routed experts, whose
//! `E` per-expert matrices `w1` / `w3` / `w2` are stacked into `ffn_gate_exps` /
//! `ffn_up_exps` / `ffn_down_exps` of `ne = [cols, rows, E]`, and `tid2eid`, converted from
//! I64 to I32. Loader constraints checked here, before writing: compress ratios 0, 4 and 128
//! only; `hc_mult` 4 (`build_hc_pre` asserts it); `index_head_dim` a multiple of 64 on models
//! with CSA layers (the indexer's Hadamard rotation); every routed and shared expert of width
//! `moe_intermediate_size` (`n_ff_exp · n_expert_shared`).

use std::path::Path;

use moeconf_reference_runtime::config::{AttentionKind, MlpKind, ModelConfig};
use moeconf_reference_runtime::weights::LinearFormat;

use crate::ggml::GgmlType;
use crate::source::Checkpoint;
use crate::value::Value;
use crate::write::TensorInfo;
use crate::GgufError;

/// The architecture name (`general.architecture`).
pub const ARCH: &str = "deepseek4";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS`.
pub const GATING_SQRT_SOFTPLUS: u32 = 4;

/// The compress ratios llama.cpp's loader accepts (`DSV4_CSA_RATIO`, `DSV4_HCA_RATIO`).
pub const LLAMA_CSA_RATIO: usize = 4;
/// See [`LLAMA_CSA_RATIO`].
pub const LLAMA_HCA_RATIO: usize = 128;

/// The element types of an export (`moeconf export gguf --type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportType {
    /// Every real tensor F32.
    F32,
    /// Matrices BF16, vectors and F32-stored tensors F32. Every value must be exactly
    /// representable in BF16 (BF16, FP8 and MXFP4 checkpoints are).
    Bf16,
    /// As `Bf16`, except routed experts stored as MXFP4 in the checkpoint, which stay MXFP4
    /// (their blocks repacked bit for bit).
    Native,
}

impl ExportType {
    /// Parses `f32`, `bf16` or `native`.
    pub fn parse(s: &str) -> Option<ExportType> {
        match s {
            "f32" => Some(ExportType::F32),
            "bf16" => Some(ExportType::Bf16),
            "native" => Some(ExportType::Native),
            _ => None,
        }
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            ExportType::F32 => "f32",
            ExportType::Bf16 => "bf16",
            ExportType::Native => "native",
        }
    }
}

/// How the reference runtime reads a checkpoint tensor (and so how the export reads its values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// A small BF16/F32 tensor copied out (`WeightLoader::vec_f32`): norms, biases, sinks,
    /// mHC bases and scales, position biases.
    Vector,
    /// A matrix in the given format (`WeightLoader::linear`; `LinearFormat::Plain` for the
    /// matrices the runtime always reads as BF16/F32: embedding, head, router, mHC, compressors,
    /// indexer weights projection).
    Matrix(LinearFormat),
}

/// How one GGUF tensor is made from the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recipe {
    /// One real tensor of row-major (logical) `shape`.
    Single {
        /// Checkpoint name.
        src: String,
        /// Row-major logical shape (unpacked for MXFP4).
        shape: Vec<usize>,
        /// How the runtime reads it.
        class: Class,
    },
    /// Per-expert `[rows, cols]` matrices stacked into `[E, rows, cols]`.
    Stack {
        /// Checkpoint names, expert 0 first.
        srcs: Vec<String>,
        /// Rows and columns of one expert.
        rows: usize,
        /// See `rows`.
        cols: usize,
        format: LinearFormat,
    },
    /// An index tensor of row-major `shape`, converted to I32, values below `bound`.
    Ids {
        /// Checkpoint name.
        src: String,
        /// Row-major shape.
        shape: Vec<usize>,
        /// Exclusive upper bound of the values.
        bound: usize,
    },
}

fn scale_of(name: &str) -> String {
    format!("{}.scale", name.strip_suffix(".weight").unwrap_or(name))
}

impl Recipe {
    /// The checkpoint tensors the recipe reads (quantized weights with their `.scale`).
    pub fn sources(&self) -> Vec<String> {
        let quantized = |f: LinearFormat| f != LinearFormat::Plain;
        match self {
            Recipe::Single {
                src,
                class: Class::Matrix(f),
                ..
            } if quantized(*f) => vec![src.clone(), scale_of(src)],
            Recipe::Single { src, .. } | Recipe::Ids { src, .. } => vec![src.clone()],
            Recipe::Stack { srcs, format, .. } => {
                let mut v = Vec::new();
                for s in srcs {
                    v.push(s.clone());
                    if quantized(*format) {
                        v.push(scale_of(s));
                    }
                }
                v
            }
        }
    }
}

/// One tensor of the export plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    /// Name, dimensions and type in the GGUF.
    pub info: TensorInfo,
    pub recipe: Recipe,
}

/// The metadata and tensors of the export of one checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Model metadata (`general.*`, `deepseek4.*`; the tokenizer's is added by the export).
    pub metadata: Vec<(String, Value)>,
    /// Tensors in file order.
    pub tensors: Vec<PlannedTensor>,
}

fn key(k: &str) -> String {
    format!("{ARCH}.{k}")
}

/// Checks the loader constraints of llama.cpp's `deepseek4` on `cfg`.
pub fn check_constraints(cfg: &ModelConfig, config_path: &Path) -> Result<(), GgufError> {
    let bad = |m: String| {
        Err(GgufError::Unsupported(format!(
            "{}: {m} (llama.cpp's deepseek4 loader)",
            config_path.display()
        )))
    };
    let has_csa = cfg.layer_types.contains(&AttentionKind::Csa);
    let has_hca = cfg.layer_types.contains(&AttentionKind::Hca);
    if has_csa && cfg.csa_rate != LLAMA_CSA_RATIO {
        return bad(format!(
            "the CSA compress rate is {}, only {LLAMA_CSA_RATIO} is supported",
            cfg.csa_rate
        ));
    }
    if has_hca && cfg.hca_rate != LLAMA_HCA_RATIO {
        return bad(format!(
            "the HCA compress rate is {}, only {LLAMA_HCA_RATIO} is supported (compress ratios must be 0, 4 or 128)",
            cfg.hca_rate
        ));
    }
    if cfg.hc_mult != 4 {
        return bad(format!("hc_mult is {}, only 4 is supported", cfg.hc_mult));
    }
    if has_csa && !cfg.index_head_dim.is_multiple_of(64) {
        return bad(format!(
            "index_head_dim is {}, it must be a multiple of 64 (the indexer cache's Hadamard rotation)",
            cfg.index_head_dim
        ));
    }
    if cfg.head_dim < cfg.rope_dim {
        return bad(format!(
            "head_dim {} is smaller than the rotary width {}",
            cfg.head_dim, cfg.rope_dim
        ));
    }
    Ok(())
}

/// The `deepseek4.*` and `general.*` metadata of `cfg`. `context_length` is the checkpoint's
/// `max_position_embeddings`; `name` becomes `general.name`.
pub fn metadata(cfg: &ModelConfig, context_length: u32, name: &str, ty: ExportType) -> Vec<(String, Value)> {
    let u = |v: usize| Value::U32(v as u32);
    let n = cfg.num_layers();
    let ratios = cfg.layer_types.iter().map(|&k| cfg.compress_rate(k) as u32);
    let n_hash = cfg
        .mlp_layer_types
        .iter()
        .take_while(|&&k| k == MlpKind::HashMoe)
        .count();
    let file_type = match ty {
        ExportType::F32 => 0,
        ExportType::Bf16 => 32,
        ExportType::Native => 38,
    };
    let mut md = vec![
        ("general.architecture".to_string(), Value::Str(ARCH.into())),
        ("general.name".to_string(), Value::Str(name.into())),
        ("general.file_type".to_string(), Value::U32(file_type)),
        ("general.quantization_version".to_string(), Value::U32(2)),
        (key("vocab_size"), u(cfg.vocab_size)),
        (key("context_length"), Value::U32(context_length)),
        (key("embedding_length"), u(cfg.hidden_size)),
        (key("embedding_length_out"), u(cfg.hidden_size * cfg.hc_mult)),
        (key("block_count"), u(n)),
        (key("expert_count"), u(cfg.n_routed_experts)),
        (key("expert_used_count"), u(cfg.experts_per_tok)),
        (key("expert_shared_count"), Value::U32(1)),
        (key("expert_feed_forward_length"), u(cfg.moe_intermediate_size)),
        (key("expert_weights_scale"), Value::F32(cfg.routed_scaling_factor)),
        (key("expert_weights_norm"), Value::Bool(true)),
        (key("expert_gating_func"), Value::U32(GATING_SQRT_SOFTPLUS)),
        (
            key("swiglu_clamp_exp"),
            Value::f32s(std::iter::repeat_n(cfg.swiglu_limit, n)),
        ),
        (
            key("swiglu_clamp_shexp"),
            Value::f32s(std::iter::repeat_n(cfg.swiglu_limit, n)),
        ),
        (key("attention.head_count"), u(cfg.num_heads)),
        (key("attention.head_count_kv"), Value::U32(1)),
        (key("attention.key_length"), u(cfg.head_dim)),
        (key("attention.value_length"), u(cfg.head_dim)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps),
        ),
        (key("attention.q_lora_rank"), u(cfg.q_lora_rank)),
        (key("attention.sliding_window"), u(cfg.sliding_window)),
        (key("attention.output_group_count"), u(cfg.o_groups)),
        (key("attention.output_lora_rank"), u(cfg.o_lora_rank)),
        (key("attention.indexer.head_count"), u(cfg.index_n_heads)),
        (key("attention.indexer.key_length"), u(cfg.index_head_dim)),
        (key("attention.indexer.top_k"), u(cfg.index_topk)),
        (key("attention.compress_ratios"), Value::u32s(ratios)),
        (
            key("attention.compress_rope_freq_base"),
            Value::F32(cfg.compress_rope_theta),
        ),
        (key("hyper_connection.count"), u(cfg.hc_mult)),
        (
            key("hyper_connection.sinkhorn_iterations"),
            u(cfg.hc_sinkhorn_iters),
        ),
        (key("hyper_connection.epsilon"), Value::F32(cfg.hc_eps)),
        (key("hash_layer_count"), u(n_hash)),
        (key("rope.dimension_count"), u(cfg.rope_dim)),
        (key("rope.freq_base"), Value::F32(cfg.rope_theta)),
    ];
    if let Some(y) = &cfg.yarn {
        // llama.cpp applies the YaRN of these keys to the compress rope of CSA/HCA layers only
        // (deepseek4.cpp build_attention_impl: sliding layers use freq_scale 1, ext_factor 0);
        // beta_fast / beta_slow are not read from the GGUF (hparams defaults 32 / 1).
        md.push((key("rope.scaling.type"), Value::Str("yarn".into())));
        md.push((key("rope.scaling.factor"), Value::F32(y.factor as f32)));
        md.push((
            key("rope.scaling.original_context_length"),
            Value::U32(y.original_max_position_embeddings as u32),
        ));
    }
    md
}

/// Checks what llama.cpp takes from defaults rather than from the GGUF.
pub fn check_defaults(cfg: &ModelConfig, config_path: &Path) -> Result<(), GgufError> {
    if let Some(y) = &cfg.yarn {
        if y.beta_fast != 32.0 || y.beta_slow != 1.0 {
            return Err(GgufError::Unsupported(format!(
                "{}: YaRN beta_fast {} / beta_slow {}: llama.cpp's deepseek4 uses its defaults 32 / 1 (they are not GGUF keys)",
                config_path.display(),
                y.beta_fast,
                y.beta_slow
            )));
        }
    }
    Ok(())
}

/// Chooses the GGUF type of a real tensor: F32-stored and one-dimensional tensors stay F32;
/// matrices follow `ty`; routed experts stored as MXFP4 stay MXFP4 under `Native`.
fn float_type(ty: ExportType, stored_f32: bool, ndim: usize, mxfp4_source: bool) -> GgmlType {
    if stored_f32 || ndim < 2 {
        return GgmlType::F32;
    }
    match ty {
        ExportType::F32 => GgmlType::F32,
        ExportType::Bf16 => GgmlType::Bf16,
        ExportType::Native if mxfp4_source => GgmlType::Mxfp4,
        ExportType::Native => GgmlType::Bf16,
    }
}

fn reversed(shape: &[usize]) -> Vec<u64> {
    shape.iter().rev().map(|&d| d as u64).collect()
}

/// The export plan of `cfg` on checkpoint `ckpt`: every tensor llama.cpp's loader creates,
/// in its order, with the checkpoint tensor(s) it is made of and how the reference runtime
/// reads them. Every tensor is checked as the runtime's loader checks it (shape, dtype, the
/// format config.json declares, NaN codes, scale ranges). Fails if one is missing or bad, or if
/// the checkpoint holds a tensor llama.cpp has no place for (the GGUF would then not run the
/// weights the reference runs; `mtp.*` blocks excepted, which neither runs).
pub fn plan(cfg: &ModelConfig, ckpt: &Checkpoint, ty: ExportType) -> Result<Vec<PlannedTensor>, GgufError> {
    let (d, hc, v) = (cfg.hidden_size, cfg.hc_mult, cfg.vocab_size);
    let dense = cfg.weights.dense;
    let plain = Class::Matrix(LinearFormat::Plain);
    let mut out: Vec<PlannedTensor> = Vec::new();
    let single = |out: &mut Vec<PlannedTensor>,
                  gguf: String,
                  src: String,
                  shape: Vec<usize>,
                  class: Class|
     -> Result<(), GgufError> {
        match class {
            Class::Vector => {
                ckpt.vector_values(&src, &shape)?;
            }
            Class::Matrix(f) => {
                ckpt.matrix(&src, shape[0], shape[1], f)?;
            }
        }
        let stored_f32 = class == Class::Vector && ckpt.is_f32(&src) || class == plain && ckpt.is_f32(&src);
        let t = float_type(ty, stored_f32, shape.len(), false);
        out.push(PlannedTensor {
            info: TensorInfo {
                name: gguf,
                ne: reversed(&shape),
                ty: t,
            },
            recipe: Recipe::Single { src, shape, class },
        });
        Ok(())
    };
    let vec1 = Class::Vector;
    single(
        &mut out,
        "token_embd.weight".into(),
        "embed.weight".into(),
        vec![v, d],
        plain,
    )?;
    single(
        &mut out,
        "output_norm.weight".into(),
        "norm.weight".into(),
        vec![d],
        vec1,
    )?;
    single(
        &mut out,
        "output.weight".into(),
        "head.weight".into(),
        vec![v, d],
        plain,
    )?;
    single(
        &mut out,
        "output_hc_fn.weight".into(),
        "hc_head_fn".into(),
        vec![hc, hc * d],
        plain,
    )?;
    single(
        &mut out,
        "output_hc_base.weight".into(),
        "hc_head_base".into(),
        vec![hc],
        vec1,
    )?;
    single(
        &mut out,
        "output_hc_scale.weight".into(),
        "hc_head_scale".into(),
        vec![1],
        vec1,
    )?;
    let (h, hd, q, i_w, e, k) = (
        cfg.num_heads,
        cfg.head_dim,
        cfg.q_lora_rank,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        cfg.experts_per_tok,
    );
    let hc_rows = (2 + hc) * hc;
    let dm = Class::Matrix(dense);
    for (il, (&kind, &mlp)) in cfg.layer_types.iter().zip(&cfg.mlp_layer_types).enumerate() {
        let b = |s: &str| format!("blk.{il}.{s}");
        let l = |s: &str| format!("layers.{il}.{s}");
        single(
            &mut out,
            b("attn_norm.weight"),
            l("attn_norm.weight"),
            vec![d],
            vec1,
        )?;
        single(
            &mut out,
            b("attn_sinks.weight"),
            l("attn.attn_sink"),
            vec![h],
            vec1,
        )?;
        single(
            &mut out,
            b("attn_q_a.weight"),
            l("attn.wq_a.weight"),
            vec![q, d],
            dm,
        )?;
        single(
            &mut out,
            b("attn_q_a_norm.weight"),
            l("attn.q_norm.weight"),
            vec![q],
            vec1,
        )?;
        single(
            &mut out,
            b("attn_q_b.weight"),
            l("attn.wq_b.weight"),
            vec![h * hd, q],
            dm,
        )?;
        single(
            &mut out,
            b("attn_kv.weight"),
            l("attn.wkv.weight"),
            vec![hd, d],
            dm,
        )?;
        single(
            &mut out,
            b("attn_kv_a_norm.weight"),
            l("attn.kv_norm.weight"),
            vec![hd],
            vec1,
        )?;
        single(
            &mut out,
            b("attn_output_a.weight"),
            l("attn.wo_a.weight"),
            vec![cfg.o_groups * cfg.o_lora_rank, h * hd / cfg.o_groups],
            dm,
        )?;
        single(
            &mut out,
            b("attn_output_b.weight"),
            l("attn.wo_b.weight"),
            vec![d, cfg.o_groups * cfg.o_lora_rank],
            dm,
        )?;
        for site in ["attn", "ffn"] {
            single(
                &mut out,
                b(&format!("hc_{site}_fn.weight")),
                l(&format!("hc_{site}_fn")),
                vec![hc_rows, hc * d],
                plain,
            )?;
            single(
                &mut out,
                b(&format!("hc_{site}_base.weight")),
                l(&format!("hc_{site}_base")),
                vec![hc_rows],
                vec1,
            )?;
            single(
                &mut out,
                b(&format!("hc_{site}_scale.weight")),
                l(&format!("hc_{site}_scale")),
                vec![3],
                vec1,
            )?;
        }
        let rate = cfg.compress_rate(kind);
        if rate != 0 {
            let width = if kind == AttentionKind::Csa { 2 * hd } else { hd };
            single(
                &mut out,
                b("attn_compressor_kv.weight"),
                l("attn.compressor.wkv.weight"),
                vec![width, d],
                plain,
            )?;
            single(
                &mut out,
                b("attn_compressor_gate.weight"),
                l("attn.compressor.wgate.weight"),
                vec![width, d],
                plain,
            )?;
            single(
                &mut out,
                b("attn_compressor_ape.weight"),
                l("attn.compressor.ape"),
                vec![rate, width],
                vec1,
            )?;
            single(
                &mut out,
                b("attn_compressor_norm.weight"),
                l("attn.compressor.norm.weight"),
                vec![hd],
                vec1,
            )?;
            if kind == AttentionKind::Csa {
                let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
                single(
                    &mut out,
                    b("indexer.proj.weight"),
                    l("attn.indexer.weights_proj.weight"),
                    vec![hi, d],
                    plain,
                )?;
                single(
                    &mut out,
                    b("indexer.attn_q_b.weight"),
                    l("attn.indexer.wq_b.weight"),
                    vec![hi * di, q],
                    dm,
                )?;
                let c = "attn.indexer.compressor.";
                single(
                    &mut out,
                    b("indexer_compressor_kv.weight"),
                    l(&format!("{c}wkv.weight")),
                    vec![2 * di, d],
                    plain,
                )?;
                single(
                    &mut out,
                    b("indexer_compressor_gate.weight"),
                    l(&format!("{c}wgate.weight")),
                    vec![2 * di, d],
                    plain,
                )?;
                single(
                    &mut out,
                    b("indexer_compressor_ape.weight"),
                    l(&format!("{c}ape")),
                    vec![rate, 2 * di],
                    vec1,
                )?;
                single(
                    &mut out,
                    b("indexer_compressor_norm.weight"),
                    l(&format!("{c}norm.weight")),
                    vec![di],
                    vec1,
                )?;
            }
        }
        single(
            &mut out,
            b("ffn_gate_inp.weight"),
            l("ffn.gate.weight"),
            vec![e, d],
            plain,
        )?;
        match mlp {
            MlpKind::HashMoe => {
                let src = l("ffn.gate.tid2eid");
                ckpt.ids(&src, &[v, k], e)?;
                out.push(PlannedTensor {
                    info: TensorInfo {
                        name: b("ffn_gate_tid2eid.weight"),
                        ne: vec![k as u64, v as u64],
                        ty: GgmlType::I32,
                    },
                    recipe: Recipe::Ids {
                        src,
                        shape: vec![v, k],
                        bound: e,
                    },
                });
            }
            MlpKind::Moe => single(&mut out, b("exp_probs_b.bias"), l("ffn.gate.bias"), vec![e], vec1)?,
        }
        single(
            &mut out,
            b("ffn_norm.weight"),
            l("ffn_norm.weight"),
            vec![d],
            vec1,
        )?;
        let xf = cfg.weights.experts;
        for (gguf, w, rows, cols) in [
            ("ffn_gate_exps.weight", "w1", i_w, d),
            ("ffn_down_exps.weight", "w2", d, i_w),
            ("ffn_up_exps.weight", "w3", i_w, d),
        ] {
            let srcs: Vec<String> = (0..e)
                .map(|x| l(&format!("ffn.experts.{x}.{w}.weight")))
                .collect();
            let mut f32_stored = false;
            for s in &srcs {
                ckpt.matrix(s, rows, cols, xf)?;
                f32_stored |= xf == LinearFormat::Plain && ckpt.is_f32(s);
            }
            out.push(PlannedTensor {
                info: TensorInfo {
                    name: b(gguf),
                    ne: vec![cols as u64, rows as u64, e as u64],
                    ty: float_type(ty, f32_stored, 2, xf == LinearFormat::Mxfp4),
                },
                recipe: Recipe::Stack {
                    srcs,
                    rows,
                    cols,
                    format: xf,
                },
            });
        }
        single(
            &mut out,
            b("ffn_gate_shexp.weight"),
            l("ffn.shared_experts.w1.weight"),
            vec![i_w, d],
            dm,
        )?;
        single(
            &mut out,
            b("ffn_down_shexp.weight"),
            l("ffn.shared_experts.w2.weight"),
            vec![d, i_w],
            dm,
        )?;
        single(
            &mut out,
            b("ffn_up_shexp.weight"),
            l("ffn.shared_experts.w3.weight"),
            vec![i_w, d],
            dm,
        )?;
    }
    // Every checkpoint tensor must have a place: the GGUF then holds all the weights the
    // reference runs (multi-token-prediction `mtp.*` blocks excepted: neither runs them).
    let used: std::collections::BTreeSet<String> = out.iter().flat_map(|p| p.recipe.sources()).collect();
    if let Some(extra) = ckpt
        .names()
        .into_iter()
        .find(|n| !used.contains(*n) && !n.starts_with("mtp."))
    {
        return Err(GgufError::Tensor {
            path: ckpt.dir().to_path_buf(),
            tensor: extra.to_string(),
            message: "llama.cpp's deepseek4 has no tensor for it (the export would drop weights the reference runs)".into(),
        });
    }
    Ok(out)
}
