//! The real-width decode benchmark (`moeconf bench runtime --real-width`):
//! decode tokens/s on a generated checkpoint of DeepSeek-V4-Flash's
//! per-layer dimensions against the memory bandwidth bound (the weight
//! bytes one decode step reads, streamed at the read bandwidth measured in
//! the same run), without and with the default capture as in
//! `crate::runtime`.

use std::path::Path;

use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::weights::Mat;
use moeconf_runner::RunError;

use crate::measure::{anon_rss_bytes, read_bandwidth};
use crate::runtime::{generate, BenchCapture};

/// Wraps an error as [`RunError::Context`], saying what was being done
/// (what `moeconf-runner`'s own errors carry).
fn context<E: std::error::Error + Send + Sync + 'static>(c: impl Into<String>) -> impl FnOnce(E) -> RunError {
    let context = c.into();
    move |e| RunError::Context {
        context,
        source: Box::new(e),
    }
}

/// Weight bytes one decode step reads, by where they are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepBytes {
    /// Every matrix of every decoder layer except the routed experts
    /// (attention, compressors, indexer, mHC, router, shared expert).
    pub layers_dense: u64,
    /// The `k` routed experts a token selects per layer (codes and scales).
    pub routed_experts: u64,
    /// The head (mHC head collapse and LM head) and one embedding row.
    pub head_and_embedding: u64,
    /// Bytes of all routed experts of the checkpoint (what stays in the memory map).
    pub all_routed_experts: u64,
}

impl StepBytes {
    /// Total weight bytes one decode step reads.
    pub fn total(&self) -> u64 {
        self.layers_dense + self.routed_experts + self.head_and_embedding
    }
}

/// The weight bytes a decode step of `model` must read: every matrix it
/// multiplies by (codes plus scales for quantized ones), with `k` routed
/// experts per layer (all experts of a layer have the same size) and one
/// embedding row, counted through the model's weight accessors
/// ([`Model::layer_weights`], [`Model::head_weights`],
/// [`Model::embedding_matrix`]). MTP blocks are not run and not counted;
/// state (caches) is not weights and not counted.
pub fn decode_step_bytes(model: &Model) -> StepBytes {
    let cfg = model.config();
    let bytes = |m: &Mat| (m.body_bytes() + m.scale_bytes()) as u64;
    let mut s = StepBytes::default();
    for i in 0..cfg.num_layers() {
        let Some(l) = model.layer_weights(i) else {
            continue;
        };
        let mut all = 0u64;
        l.for_each_mat(&mut |m| all += bytes(m));
        let experts: Vec<u64> = l
            .moe
            .experts
            .iter()
            .map(|e| bytes(&e.w1) + bytes(&e.w3) + bytes(&e.w2))
            .collect();
        let routed: u64 = experts.iter().sum();
        let per_expert = experts.iter().copied().max().unwrap_or(0);
        s.layers_dense += all - routed;
        s.routed_experts += cfg.experts_per_tok as u64 * per_expert;
        s.all_routed_experts += routed;
    }
    let h = model.head_weights();
    let embed = model.embedding_matrix();
    s.head_and_embedding = bytes(&h.hc.fn_) + bytes(&h.lm_head) + embed.dtype().row_len(embed.cols()) as u64;
    s
}

/// Optional reductions of the real-width checkpoint for quicker runs: fewer
/// routed experts per layer (a decode step still reads k of them, each of
/// the real size) and a smaller vocabulary (a smaller head). `None` keeps
/// V4-Flash's 256 experts and 129280 tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealWidthShrink {
    /// Routed experts per layer.
    pub experts: Option<usize>,
    /// Vocabulary size.
    pub vocab: Option<usize>,
}

/// What `moeconf bench runtime --real-width` measured.
#[derive(Debug, Clone)]
pub struct RealWidthReport {
    /// Decoder layers of the generated checkpoint.
    pub layers: usize,
    /// Their attention kinds (`sliding_attention`, ...).
    pub layer_kinds: Vec<String>,
    /// Bytes of the checkpoint's safetensors files.
    pub checkpoint_bytes: u64,
    /// Seconds spent generating the checkpoint.
    pub generate_seconds: f64,
    /// Weight bytes one decode step reads.
    pub step: StepBytes,
    /// Routed experts per token (k).
    pub experts_per_tok: usize,
    /// Routed experts per layer.
    pub n_routed_experts: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Read bandwidth, 1 thread (bytes/s).
    pub bandwidth_1thread: f64,
    /// Read bandwidth with the decode's thread count (bytes/s).
    pub bandwidth_threads: f64,
    /// Threads of the decode (rayon).
    pub threads: usize,
    /// Decode tokens/s without capture.
    pub decode_none: f64,
    /// Decode tokens/s with the default capture.
    pub decode_default: f64,
    /// Decode steps per measurement.
    pub decode_tokens: usize,
    /// Anonymous RSS after loading the model, and after the measured runs.
    pub anon_rss: [Option<u64>; 2],
}

impl RealWidthReport {
    /// Bytes per second the default-capture decode moved through the weights.
    pub fn achieved_bytes_per_second(&self) -> f64 {
        self.step.total() as f64 * self.decode_default
    }

    /// Achieved over measured bandwidth (same thread count): the fraction of
    /// the bandwidth bound.
    pub fn fraction_of_bound(&self) -> f64 {
        self.achieved_bytes_per_second() / self.bandwidth_threads.max(1.0)
    }

    /// The bound itself: decode tokens/s if every step only streamed its weights at the
    /// measured bandwidth.
    pub fn bound_tokens_per_second(&self) -> f64 {
        self.bandwidth_threads / (self.step.total().max(1) as f64)
    }
}

/// Bytes of the buffer the bandwidth is measured on: far above the caches
/// (the machine reports a 480 MiB last-level cache).
pub const BANDWIDTH_BUFFER_BYTES: usize = 2 << 30;

/// Reads every file of `dir` once (so the measured decode reads weights
/// from memory, not from disk); returns the bytes read.
fn warm_page_cache(dir: &Path) -> Result<u64, RunError> {
    use std::io::Read;
    let mut total = 0u64;
    let mut buf = vec![0u8; 16 << 20];
    let entries = std::fs::read_dir(dir).map_err(context(format!("listing {}", dir.display())))?;
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("safetensors") {
            continue;
        }
        let mut f = moeconf_output::input::open_input(&path, "model file")
            .map_err(moeconf_schema::InputError::from)?;
        loop {
            let n = f
                .read(&mut buf)
                .map_err(context(format!("reading {}", path.display())))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok(total)
}

/// `moeconf bench runtime --real-width`: generates a checkpoint of
/// DeepSeek-V4-Flash's per-layer dimensions with `layers` decoder layers
/// (FP8 dense projections, MXFP4 routed experts, [`V4Spec::flash_width`])
/// in `dir`, then measures in one run: the weight bytes of one decode step,
/// the memory read bandwidth (1 thread and the decode's thread count), and
/// decode tokens/s without and with the default capture (best of `repeat`).
///
/// [`V4Spec::flash_width`]: moeconf_fixtures::checkpoint::V4Spec::flash_width
pub fn bench_real_width(
    layers: usize,
    shrink: RealWidthShrink,
    decode_tokens: u32,
    repeat: u32,
    dir: &Path,
    scratch: &Path,
) -> Result<RealWidthReport, RunError> {
    use moeconf_fixtures::checkpoint::{write_v4, V4Spec};
    let mut spec = V4Spec::flash_width(layers);
    if let Some(e) = shrink.experts {
        spec.n_routed_experts = e.max(spec.experts_per_tok);
    }
    if let Some(v) = shrink.vocab {
        spec.vocab_size = v.max(16);
    }
    let layer_kinds = spec
        .layer_types
        .iter()
        .map(|k| k.config_name().to_string())
        .collect();
    eprintln!(
        "generating {} layers at V4-Flash width in {} ...",
        spec.layer_types.len(),
        dir.display()
    );
    let t = std::time::Instant::now();
    write_v4(dir, &spec).map_err(context("generating the real-width checkpoint"))?;
    let generate_seconds = t.elapsed().as_secs_f64();
    let checkpoint_bytes = warm_page_cache(dir)?;
    let model = Model::load(dir)?;
    let rss_loaded = anon_rss_bytes();
    let step = decode_step_bytes(&model);
    let threads = rayon::current_num_threads();
    eprintln!("measuring the memory read bandwidth ...");
    let bandwidth_1thread = read_bandwidth(BANDWIDTH_BUFFER_BYTES, 1, 3);
    let bandwidth_threads = if threads > 1 {
        read_bandwidth(BANDWIDTH_BUFFER_BYTES, threads, 3)
    } else {
        bandwidth_1thread
    };
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..4u32).map(|i| (i * 7919 + 11) % vocab).collect();
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let (mut decode_none, mut decode_default) = (0.0f64, 0.0f64);
    for _ in 0..repeat.max(1) {
        for capture in [BenchCapture::None, BenchCapture::Default] {
            eprintln!("decoding {decode_tokens} tokens, capture {} ...", capture.name());
            let r = generate(&model, &prompt, decode_tokens as usize, &opts, capture, scratch)?;
            let v = r.decode_tokens_per_second();
            match capture {
                BenchCapture::None => decode_none = decode_none.max(v),
                BenchCapture::Default => decode_default = decode_default.max(v),
            }
        }
    }
    Ok(RealWidthReport {
        layers: spec.layer_types.len(),
        layer_kinds,
        checkpoint_bytes,
        generate_seconds,
        step,
        experts_per_tok: model.config().experts_per_tok,
        n_routed_experts: model.config().n_routed_experts,
        vocab_size: model.config().vocab_size,
        bandwidth_1thread,
        bandwidth_threads,
        threads,
        decode_none,
        decode_default,
        decode_tokens: decode_tokens as usize,
        anon_rss: [rss_loaded, anon_rss_bytes()],
    })
}

/// The text report of `moeconf bench runtime --real-width`.
pub fn render_real_width_text(r: &RealWidthReport) -> String {
    let gb = |b: f64| b / 1e9;
    let mib = |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
    let s = &r.step;
    format!(
        "real-width decode (V4-Flash per-layer dimensions, {} layers: {}; FP8 dense, {} MXFP4 experts per layer; vocabulary {}; {} threads)\n\
         \x20 checkpoint: {:.2} GB, generated in {:.1} s\n\
         \x20 weights read per decode step: {:.3} GB (layers without routed experts {:.3}, {} routed experts per layer {:.3}, head + embedding row {:.3})\n\
         \x20 memory read bandwidth: {:.2} GB/s (1 thread), {:.2} GB/s ({} threads)\n\
         \x20 decode: {:.3} tok/s without capture, {:.3} tok/s with the default capture ({} steps, best of runs)\n\
         \x20 bandwidth bound: {:.3} tok/s; achieved {:.2} GB/s = {:.1}% of the bound (default capture)\n\
         \x20 anonymous RSS: {} after loading, {} after decoding ({:.2} GB of routed experts stay in the memory map)\n",
        r.layers,
        r.layer_kinds.join(", "),
        r.n_routed_experts,
        r.vocab_size,
        r.threads,
        gb(r.checkpoint_bytes as f64),
        r.generate_seconds,
        gb(s.total() as f64),
        gb(s.layers_dense as f64),
        r.experts_per_tok,
        gb(s.routed_experts as f64),
        gb(s.head_and_embedding as f64),
        gb(r.bandwidth_1thread),
        gb(r.bandwidth_threads),
        r.threads,
        r.decode_none,
        r.decode_default,
        r.decode_tokens,
        r.bound_tokens_per_second(),
        gb(r.achieved_bytes_per_second()),
        100.0 * r.fraction_of_bound(),
        mib(r.anon_rss[0]),
        mib(r.anon_rss[1]),
        gb(s.all_routed_experts as f64),
    )
}
