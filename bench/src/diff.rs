//! The `diff` speed benchmark: two large traces (with payloads) that differ
//! in exactly one record, timed against a plain byte comparison of the two
//! files in the same run. Localization must touch only the divergent path:
//! the target is a diff time under 1% of the byte comparison.
//!
//! Both measurements run on a warm page cache (each file is read once before
//! timing, and the best of `repeat` runs is kept), which is the comparison
//! least favourable to `diff`: from a cold cache the byte comparison also
//! pays for reading every byte from disk, `diff` only for the index and one
//! payload.

use moeconf_bisect::{diff, open_pair_with, BisectError, DiffOptions, FirstDivergence};
use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Decoding, Header, TraceError, TraceWriter};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What [`bench_diff`] measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DiffBench {
    /// Size of each trace file in bytes.
    pub file_bytes: u64,
    /// Records per trace.
    pub records: u64,
    /// Payload bytes per record.
    pub record_bytes: u64,
    /// Best time of a full byte comparison of the two files (seconds).
    pub byte_compare_seconds: f64,
    /// Bytes that differ between the two files (the comparison reads all of both).
    pub differing_bytes: u64,
    /// Best time of opening both traces and running [`diff`] (seconds).
    pub diff_seconds: f64,
    /// Of `diff_seconds`: opening and validating both traces (index, checksum, tree).
    pub open_seconds: f64,
    /// Best time of verifying every byte of both opened traces
    /// ([`moeconf_schema::Trace::verify_payloads`]), which `moeconf diff
    /// --verify-all` (and a diff of version 1 traces) adds to `diff_seconds`
    /// (not part of `ratio`, which measures the localization; a version 2
    /// diff verifies the nodes and payloads it reads as it reads them).
    pub verify_seconds: f64,
    /// Best time of the walk alone ([`diff`] on two opened traces): the part
    /// that descends the trees and reads the divergent payloads.
    pub walk_seconds: f64,
    /// `diff_seconds / byte_compare_seconds`.
    pub ratio: f64,
    /// The localization `diff` reported (must be the injected record).
    pub localized: Option<FirstDivergence>,
}

impl DiffBench {
    /// The text report of `moeconf bench diff`: the localization against
    /// the byte comparison measured in the same run.
    pub fn render_text(&self) -> String {
        let mut t = format!(
            "diff of two {:.2} GiB traces ({} records of {} bytes each), differing in one record\n\
             \x20 byte comparison of the files   {:>9.4} s\n\
             \x20 localization (open + walk)     {:>9.4} s   ratio {:.3}%  (target < 1%)\n\
             \x20   of which opening both traces {:>9.4} s\n\
             \x20   of which the walk            {:>9.4} s   ({:.3}% of the byte comparison)\n\
             \x20 payload verification (both)    {:>9.4} s   (moeconf diff --verify-all adds it; a version 2 \
             diff verifies what it reads)\n",
            self.file_bytes as f64 / (1u64 << 30) as f64,
            self.records,
            self.record_bytes,
            self.byte_compare_seconds,
            self.diff_seconds,
            100.0 * self.ratio,
            self.open_seconds,
            self.walk_seconds,
            100.0 * self.walk_seconds / self.byte_compare_seconds,
            self.verify_seconds
        );
        if let Some(f) = &self.localized {
            t.push_str(&format!(
                "  localized: step {} layer {:?} {}\n",
                f.step, f.layer, f.operator
            ));
        }
        t
    }
}

/// The components of one synthetic layer, in execution order.
const COMPONENTS: [Component; 4] = [
    Component::AttnOutput,
    Component::LayerPostAttnMhc,
    Component::MoeCombine,
    Component::LayerPostFfnMhc,
];

/// Layers per step of the synthetic traces.
pub const BENCH_LAYERS: u32 = 8;

fn write_trace(
    path: &Path,
    steps: u32,
    record_bytes: usize,
    changed: Option<(u32, u32)>,
) -> Result<(), TraceError> {
    let binding = Binding {
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        // Steps 0..steps-1 (the writer refuses steps beyond max_new_tokens).
        decoding: Decoding {
            strategy: "greedy".into(),
            max_new_tokens: steps,
        },
        ..Binding::default()
    };
    let header = Header {
        binding,
        ..Header::default()
    };
    let mut w = TraceWriter::create(path, Algorithm::Blake3, header)?;
    let n = record_bytes / 4;
    let mut buf = vec![0u8; n * 4];
    for step in 0..steps {
        for layer in 0..BENCH_LAYERS {
            for (k, &component) in COMPONENTS.iter().enumerate() {
                // Cheap distinct finite values: small integers as f32.
                let base = (step * 131 + layer * 17 + k as u32 * 7) as usize;
                for (i, c) in buf.chunks_exact_mut(4).enumerate() {
                    let mut v = ((base + i) % 4096) as f32;
                    if changed == Some((step, layer)) && component == Component::MoeCombine && i == n / 2 {
                        v += 0.5;
                    }
                    c.copy_from_slice(&v.to_le_bytes());
                }
                let coord = Coord {
                    step,
                    position: step,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: Some(layer),
                    path: component.path().into(),
                };
                let shape = [n as u64];
                w.append(
                    coord,
                    component.level(),
                    TensorView {
                        dtype: DType::F32,
                        shape: &shape,
                        bytes: &buf,
                    },
                    true,
                )?;
            }
        }
    }
    w.finish()?;
    Ok(())
}

fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> BisectError {
    let path = path.to_path_buf();
    move |source| BisectError::Io { path, what, source }
}

fn compare_files(a: &Path, b: &Path) -> Result<u64, BisectError> {
    let open = |p: &Path| std::fs::File::open(p).map_err(io(p, "opening for byte comparison"));
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut differing = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(io(a, "reading"))?;
        let nb = read_full(&mut fb, &mut bb).map_err(io(b, "reading"))?;
        let n = na.min(nb);
        // memcmp first (the fast path of `cmp`); count bytes only in unequal chunks.
        if ba[..n] != bb[..n] {
            differing += ba[..n].iter().zip(&bb[..n]).filter(|(x, y)| x != y).count() as u64;
        }
        differing += (na.max(nb) - n) as u64;
        if na == 0 && nb == 0 {
            return Ok(differing);
        }
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The file names [`bench_diff`] writes into its directory (and removes afterwards).
pub const BENCH_TRACE_NAMES: [&str; 2] = ["bench-ref.bin", "bench-cand.bin"];

/// Writes two traces of about `total_bytes` each into `dir` (records of
/// `record_bytes` payload bytes, [`BENCH_LAYERS`] layers × 4 components per
/// step) that differ in one `moe.combine` value in the second-to-last
/// step, then times `repeat` byte comparisons and `repeat` diffs (opening
/// both traces, then [`diff`]), and separately the payload verification
/// that [`open_pair`](moeconf_bisect::open_pair) adds. The files are removed
/// afterwards unless `MOECONF_BENCH_KEEP` is set (for profiling).
pub fn bench_diff(
    dir: &Path,
    total_bytes: u64,
    record_bytes: u64,
    repeat: u32,
) -> Result<DiffBench, BisectError> {
    let record_bytes = record_bytes.clamp(64, 1 << 30) & !3;
    let per_step = record_bytes * u64::from(BENCH_LAYERS) * COMPONENTS.len() as u64;
    let steps = u32::try_from(total_bytes.div_ceil(per_step).max(2)).unwrap_or(u32::MAX);
    let changed = (steps - 2, BENCH_LAYERS / 2);
    let [ra, rb] = BENCH_TRACE_NAMES;
    let (a, b): (PathBuf, PathBuf) = (dir.join(ra), dir.join(rb));
    let result = (|| {
        write_trace(&a, steps, record_bytes as usize, None)?;
        write_trace(&b, steps, record_bytes as usize, Some(changed))?;
        // Warm the page cache for both measurements.
        compare_files(&a, &b)?;
        let mut best_cmp = f64::INFINITY;
        let mut differing = 0;
        for _ in 0..repeat.max(1) {
            let t = Instant::now();
            differing = compare_files(&a, &b)?;
            best_cmp = best_cmp.min(t.elapsed().as_secs_f64());
        }
        let mut best_diff = f64::INFINITY;
        let mut best_open = f64::INFINITY;
        let mut best_walk = f64::INFINITY;
        let mut best_verify = f64::INFINITY;
        let mut localized = None;
        let mut file_bytes = 0;
        let mut records = 0;
        for _ in 0..repeat.max(1) {
            let t = Instant::now();
            let (ra, rb) = open_pair_with(&a, &b, moeconf_schema::Verification::OnUse)?;
            best_open = best_open.min(t.elapsed().as_secs_f64());
            let w = Instant::now();
            let report = diff(&ra, &rb, &DiffOptions::default())?;
            best_walk = best_walk.min(w.elapsed().as_secs_f64());
            best_diff = best_diff.min(t.elapsed().as_secs_f64());
            let v = Instant::now();
            ra.verify_payloads()?;
            rb.verify_payloads()?;
            best_verify = best_verify.min(v.elapsed().as_secs_f64());
            localized = report.first_divergence;
            file_bytes = ra.file_len();
            records = ra.record_count();
        }
        Ok(DiffBench {
            file_bytes,
            records,
            record_bytes,
            byte_compare_seconds: best_cmp,
            differing_bytes: differing,
            diff_seconds: best_diff,
            open_seconds: best_open,
            verify_seconds: best_verify,
            walk_seconds: best_walk,
            ratio: best_diff / best_cmp,
            localized,
        })
    })();
    if std::env::var_os("MOECONF_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_file(&a);
        let _ = std::fs::remove_file(&b);
    }
    result
}
