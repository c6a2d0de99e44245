//! The calibration suite (`moeconf calibrate`): the paper's experiments
//! (section 2.4) reproduced on the reference runtime, plus the bisector's own
//! fault-injection localization matrix. Each protocol lives in its own
//! module and returns a [`Section`]: tables in the paper's layout, a JSON
//! object, and the structural [`Claim`]s that must hold on any model.
//!
//! Every count is computed from runs; nothing is typed in. Runs are
//! independent and use rayon only over whole runs, so the results do not
//! depend on the thread count.

pub mod breadth;
pub mod fault_matrix;
pub mod fork_sweep;
pub mod persistent;
pub mod propagation;
pub mod replay;
pub mod substitution;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use moeconf_contract::MoeCombine;
use moeconf_fingerprint::{Algorithm, CanonPolicy, Coord, Level, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink};
use moeconf_reference_runtime::faults::FaultPlan;
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;
use moeconf_reference_runtime::tokenizer::Detokenize;
use moeconf_schema::{
    Binding, CaptureSpec, Decoding, Header, ModelIdentity, PromptBinding, TokenizerIdentity, TraceWriter,
};
use serde_json::Value;

use moeconf_runner::{model_identity, LoadedModel, TraceSink};

/// Sizes of one calibration run (full or `--quick`).
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Replay prompts used (protocol 1); `usize::MAX` = all.
    pub replay_prompts: usize,
    /// Generated tokens of replay, persistent, canonical, C-check and fault runs.
    pub tokens: usize,
    /// Generated tokens per fork branch (protocol 2; paper: 8).
    pub fork_tokens: usize,
    /// Branches per scheme in the fork sweep; `usize::MAX` = all.
    pub fork_branches: usize,
    /// Request seeds per prompt and scheme (protocols 3–5; paper: 64).
    pub seeds: u64,
    /// Driver tokens of the substitution controls (paper: 9).
    pub control_tokens: usize,
    /// Breadth prompts used (protocol 9); `usize::MAX` = all 50.
    pub breadth_prompts: usize,
    /// Breadth horizons (paper: 8, 16, 32).
    pub horizons: [usize; 3],
}

impl Sizes {
    /// The paper's sizes.
    pub const FULL: Sizes = Sizes {
        replay_prompts: usize::MAX,
        tokens: 8,
        fork_tokens: 8,
        fork_branches: usize::MAX,
        seeds: 64,
        control_tokens: 9,
        breadth_prompts: usize::MAX,
        horizons: [8, 16, 32],
    };

    /// Reduced sizes for `--quick` (every protocol, fewer runs and tokens).
    pub const QUICK: Sizes = Sizes {
        replay_prompts: 3,
        tokens: 6,
        fork_tokens: 4,
        fork_branches: 48,
        seeds: 6,
        control_tokens: 6,
        breadth_prompts: 8,
        horizons: [4, 8, 12],
    };
}

/// Everything the protocols share.
pub struct Ctx {
    /// The model under calibration.
    pub m: LoadedModel,
    /// Model identity for trace bindings (computed once).
    pub identity: ModelIdentity,
    /// Digest of tokenizer.json.
    pub tokenizer_digest: moeconf_fingerprint::Digest,
    /// Precision profile.
    pub precision: Precision,
    /// Layer of the single-layer fork (paper: 5).
    pub fork_layer: u32,
    /// Run sizes.
    pub sizes: Sizes,
    /// Output directory.
    pub out: PathBuf,
    /// Progress on stderr.
    pub progress: bool,
}

/// Digest algorithm of every trace and digest the suite writes.
pub const ALGORITHM: Algorithm = Algorithm::Blake3;

impl Ctx {
    /// Builds the context (hashes the model once for trace bindings).
    pub fn new(
        m: LoadedModel,
        precision: Precision,
        fork_layer: u32,
        sizes: Sizes,
        out: PathBuf,
        progress: bool,
    ) -> anyhow::Result<Ctx> {
        let layers = m.model.config().num_layers();
        if fork_layer as usize >= layers {
            bail!(
                "--fork-layer {fork_layer}: the model has {layers} layers (0..{})",
                layers - 1
            );
        }
        let identity = model_identity(&m.name, &m.dir, ALGORITHM)?;
        let tok_path = m.dir.join("tokenizer.json");
        let tok = std::fs::read(&tok_path).with_context(|| format!("reading {}", tok_path.display()))?;
        let tokenizer_digest = ALGORITHM.hash(&tok);
        Ok(Ctx {
            m,
            identity,
            tokenizer_digest,
            precision,
            fork_layer,
            sizes,
            out,
            progress,
        })
    }

    /// Routed experts per token (k).
    pub fn k(&self) -> usize {
        self.m.model.config().experts_per_tok
    }

    /// Tokenizes a prompt (must give at least one token).
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let ids = self.m.tokenizer.encode(text)?;
        if ids.is_empty() {
            bail!("the prompt {text:?} tokenizes to no tokens");
        }
        Ok(ids)
    }

    /// Decodes generated ids.
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        Ok(self.m.tokenizer.decode(ids)?)
    }

    /// A progress line on stderr (when enabled).
    pub fn note(&self, msg: &str) {
        if self.progress {
            eprintln!("calibrate: {msg}");
        }
    }

    /// Step options with `combine`.
    pub fn step_opts<'a>(&'a self, combine: &'a dyn MoeCombine) -> StepOptions<'a> {
        StepOptions {
            precision: self.precision,
            combine,
            detokenizer: Some(&self.m.tokenizer),
        }
    }

    /// Runs forward steps from `state` until `n` tokens are generated, with
    /// `combine` and the optional fault plan; records go to `sink`.
    pub fn advance(
        &self,
        state: &mut DecodeState,
        prompt: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> anyhow::Result<()> {
        let opts = self.step_opts(combine);
        while (state.step as usize) < n {
            let ids: Vec<u32> = if state.step == 0 {
                prompt.to_vec()
            } else {
                vec![state.pending.context("the decode state has no pending token")?]
            };
            self.m.model.step_with_faults(state, &ids, &opts, faults, sink)?;
        }
        Ok(())
    }

    /// A greedy run of `n` tokens from scratch; returns the final state.
    pub fn generate(
        &self,
        prompt: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        sink: &mut dyn CaptureSink,
    ) -> anyhow::Result<DecodeState> {
        let mut state = self.m.model.new_state();
        self.advance(&mut state, prompt, n, combine, faults, sink)?;
        Ok(state)
    }

    /// Runs greedily into a trace file with every level and payload
    /// (`capture all`); `notes` go into the provenance.
    #[allow(clippy::too_many_arguments)]
    pub fn write_trace(
        &self,
        prompt: &str,
        prompt_ids: &[u32],
        n: usize,
        combine: &dyn MoeCombine,
        faults: Option<&FaultPlan>,
        notes: Vec<(String, String)>,
        path: &Path,
    ) -> anyhow::Result<DecodeState> {
        let capture = CaptureSpec {
            levels: 0b11111,
            payload_levels: 0b11111,
        };
        let binding = Binding {
            model: self.identity.clone(),
            tokenizer: TokenizerIdentity {
                name: "tokenizer.json".into(),
                digest: self.tokenizer_digest,
            },
            prompt: PromptBinding {
                text: prompt.to_string(),
                ids: prompt_ids.to_vec(),
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: n as u32,
            },
            precision: self.precision.name().to_string(),
            contract: "native".into(),
            schedule: "identity".into(),
            capture,
            canon: CanonPolicy::default(),
            extra: vec![],
        };
        let header = Header {
            binding,
            provenance: moeconf_runner::reference_provenance(1, notes),
        };
        let writer = TraceWriter::create(path, ALGORITHM, header)?;
        let mut sink = TraceSink::new(writer, capture);
        let state = self.generate(prompt_ids, n, combine, faults, &mut sink)?;
        sink.finish()?;
        Ok(state)
    }
}

/// One captured record kept by a [`Collect`] sink.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    /// Coordinate.
    pub coord: Coord,
    /// Element bytes (little-endian).
    pub bytes: Vec<u8>,
}

impl Kept {
    /// The elements as FP32.
    pub fn f32s(&self) -> Vec<f32> {
        self.bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The elements as I32.
    pub fn i32s(&self) -> Vec<i32> {
        self.bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// A capture sink that keeps the records whose path matches one of a list
/// (exact, or prefix when the entry ends in `.` or `*`), in emission order.
pub struct Collect {
    keep: Vec<String>,
    levels: [bool; 5],
    /// The kept records, in emission order.
    pub kept: Vec<Kept>,
}

impl Collect {
    /// Keeps `paths` (e.g. `router.topk`, `moe.term.*`, `state.`); captures
    /// the levels those records need (L4 only when a kept path is L4).
    pub fn new(paths: &[&str]) -> Collect {
        let mut levels = [true, true, true, true, false];
        let l4 = ["attn.", "ffn.", "moe."];
        if paths.iter().any(|p| l4.iter().any(|x| p.starts_with(x))) {
            levels[4] = true;
        }
        Collect {
            keep: paths.iter().map(|s| s.to_string()).collect(),
            levels,
            kept: Vec::new(),
        }
    }

    fn keeps(&self, path: &str) -> bool {
        self.keep.iter().any(|k| {
            if let Some(prefix) = k.strip_suffix('*') {
                path.starts_with(prefix)
            } else if k.ends_with('.') {
                path.starts_with(k.as_str())
            } else {
                path == k
            }
        })
    }

    /// Kept records with this path, in order.
    pub fn path<'a>(&'a self, path: &'a str) -> impl Iterator<Item = &'a Kept> + 'a {
        self.kept.iter().filter(move |k| k.coord.path == path)
    }

    /// The one kept record at (path, step, layer), the last position if several.
    pub fn at(&self, path: &str, step: u32, layer: Option<u32>) -> Option<&Kept> {
        self.kept
            .iter()
            .rev()
            .find(|k| k.coord.path == path && k.coord.step == step && k.coord.layer == layer)
    }
}

impl CaptureSink for Collect {
    fn wants(&self, level: Level) -> bool {
        self.levels.get(level.code() as usize).copied().unwrap_or(false)
    }

    fn record(&mut self, coord: Coord, _level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        if self.keeps(&coord.path) {
            self.kept.push(Kept {
                coord,
                bytes: tensor.bytes.to_vec(),
            });
        }
        Ok(())
    }
}

/// Largest |a − b| over two FP32 vectors (NaN-free inputs; lengths must match,
/// otherwise +∞).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

/// Whether two FP32 slices are bitwise identical.
pub fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A table in the paper's layout.
#[derive(Debug, Clone)]
pub struct Table {
    /// File stem of the TSV (e.g. `basin_counts`).
    pub name: String,
    /// Title printed above the table.
    pub title: String,
    /// Column headers.
    pub columns: Vec<String>,
    /// Rows of cells.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table.
    pub fn new(name: &str, title: &str, columns: &[&str]) -> Table {
        Table {
            name: name.into(),
            title: title.into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Aligned text (column widths in characters).
    pub fn render(&self) -> String {
        // Display width: East Asian wide characters take two columns.
        let w = |s: &str| {
            s.chars()
                .map(|c| {
                    let u = c as u32;
                    let wide = (0x1100..=0x115f).contains(&u)
                        || (0x2e80..=0xa4cf).contains(&u)
                        || (0xac00..=0xd7a3).contains(&u)
                        || (0xf900..=0xfaff).contains(&u)
                        || (0xfe30..=0xfe4f).contains(&u)
                        || (0xff00..=0xff60).contains(&u)
                        || (0xffe0..=0xffe6).contains(&u);
                    if wide {
                        2
                    } else {
                        1
                    }
                })
                .sum::<usize>()
        };
        let mut widths: Vec<usize> = self.columns.iter().map(|c| w(c)).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if let Some(x) = widths.get_mut(i) {
                    *x = (*x).max(w(c));
                }
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = widths.get(i).copied().unwrap_or(0).saturating_sub(w(c));
                s.push_str(c);
                if i + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad + 2));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.columns));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    /// Tab-separated values with a header line (tabs and newlines in cells become spaces).
    pub fn tsv(&self) -> String {
        let clean = |s: &String| s.replace(['\t', '\n', '\r'], " ");
        let mut out = self.columns.iter().map(clean).collect::<Vec<_>>().join("\t");
        out.push('\n');
        for r in &self.rows {
            out.push_str(&r.iter().map(clean).collect::<Vec<_>>().join("\t"));
            out.push('\n');
        }
        out
    }
}

/// A structural claim: must hold on any model, or the suite exits 1.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Claim {
    /// Stable identifier (e.g. `b_720_to_360`).
    pub id: String,
    /// What is claimed, with the measured numbers.
    pub detail: String,
    /// Whether it holds.
    pub holds: bool,
}

impl Claim {
    /// A claim.
    pub fn new(id: &str, holds: bool, detail: String) -> Claim {
        Claim {
            id: id.into(),
            detail,
            holds,
        }
    }
}

/// What one protocol produced.
#[derive(Debug, Clone)]
pub struct Section {
    /// Protocol key (e.g. `fork_sweep`).
    pub key: String,
    /// Printed tables.
    pub tables: Vec<Table>,
    /// The protocol's JSON object.
    pub json: Value,
    /// Structural claims checked.
    pub claims: Vec<Claim>,
}

/// Writes `bytes` to `path` atomically (temp file in the same directory + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp =
        tempfile::NamedTempFile::new_in(dir).with_context(|| format!("writing {}", path.display()))?;
    tmp.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.persist(path)
        .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.error))?;
    Ok(())
}

/// `n/d` formatting of a count.
pub fn frac(n: usize, d: usize) -> String {
    format!("{n}/{d}")
}
