//! Reports prefill and decode tokens/s of the reference runtime on the tiny
//! fixture (and optionally the larger generated configuration), without
//! capture and with every record digested but nothing written: the runtime
//! and the fingerprint cost alone, without the trace writer of
//! `moeconf bench runtime`.
//! `cargo run --release -p moeconf-bench --example bench_runtime [-- large]`.
use moeconf_bench::measure::anon_rss_bytes;
use moeconf_bench::runtime::{bench_generate, GenerateTiming};
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::{record_digest, Algorithm, CanonPolicy, Coord, Level, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink, NullSink};
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;

/// Fingerprints every record (like the default trace capture), keeps nothing.
struct DigestSink(u64);

impl CaptureSink for DigestSink {
    fn wants(&self, _level: Level) -> bool {
        true
    }
    fn record(&mut self, coord: Coord, level: Level, t: TensorView<'_>) -> Result<(), CaptureError> {
        let d = record_digest(Algorithm::Blake3, CanonPolicy::default(), &coord, level, t)
            .map_err(|e| CaptureError::new(e.to_string()))?;
        self.0 ^= u64::from(d.0[0]);
        Ok(())
    }
}

fn main() {
    let large = std::env::args().any(|a| a == "large");
    let dir = std::env::temp_dir().join(if large {
        "moeconf-bench-large"
    } else {
        "moeconf-bench-tiny"
    });
    let spec = if large {
        moeconf_fixtures::checkpoint::V4Spec::bench_large()
    } else {
        moeconf_fixtures::checkpoint::V4Spec::tiny()
    };
    moeconf_fixtures::checkpoint::write_v4(&dir, &spec).expect("write checkpoint");
    let model = Model::load(&dir).expect("load");
    let prompt: Vec<u32> = (0..64).map(|i| (i * 37 + 5) % 1024).collect();
    // Best of 5 runs (the machine is shared; the minimum time is the least disturbed).
    let best = |f: &mut dyn FnMut() -> GenerateTiming| {
        let runs: Vec<_> = (0..5).map(|_| f()).collect();
        let p = runs
            .iter()
            .map(|r| r.prefill_tokens_per_second())
            .fold(0.0, f64::max);
        let d = runs
            .iter()
            .map(|r| r.decode_tokens_per_second())
            .fold(0.0, f64::max);
        (p, d)
    };
    for precision in [Precision::Bf16, Precision::F32] {
        let opts = StepOptions {
            precision,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        let (p, d) = best(&mut || bench_generate(&model, &prompt, 200, &opts, &mut NullSink).expect("run"));
        println!(
            "{} no capture:     prefill {p:8.1} tok/s   decode {d:8.1} tok/s",
            precision.name()
        );
        let (p, d) =
            best(&mut || bench_generate(&model, &prompt, 200, &opts, &mut DigestSink(0)).expect("run"));
        println!(
            "{} digest all:     prefill {p:8.1} tok/s   decode {d:8.1} tok/s",
            precision.name()
        );
    }
    let anon = anon_rss_bytes().unwrap_or(0);
    println!(
        "anonymous RSS after the runs: {:.1} MiB",
        anon as f64 / (1024.0 * 1024.0)
    );
}
