//! One long-context run of `builtin:tiny-v4` (bf16) for counting what the
//! default capture costs the runtime's thread per decode step: a prompt of
//! CONTEXT tokens, a few decode steps, then STEPS counted decode steps, without capture (`none`) or with
//! the default capture (`default`, a real trace in the temporary
//! directory, removed). The decode steps run inside `decode_steps` (never
//! inlined), so that callgrind counts exactly their instructions, per thread:
//!
//! ```sh
//! cargo build --release -p moeconf-bench --example decode_cost
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='decode_cost::decode_steps' \
//!     --separate-threads=yes target/release/examples/decode_cost 4096 64 default
//! ```
//!
//! (docs/performance.md, "Long context"). Without valgrind it prints the
//! decode phase's seconds.

use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Algorithm;
use moeconf_reference_runtime::capture::{CaptureSink, NullSink};
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_runner::{parse_capture, TraceSink};
use moeconf_schema::{Header, TraceWriter};
use std::time::Instant;

type Failure = Box<dyn std::error::Error>;

/// Decode steps run before the counted ones.
const WARM_UP: u32 = 8;

fn main() {
    if let Err(e) = run() {
        eprintln!("decode_cost: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let context: u32 = args.next().map_or(Ok(4096), |a| a.parse())?;
    let steps: u32 = args.next().map_or(Ok(64), |a| a.parse())?;
    let capture = args.next().unwrap_or_else(|| "default".into());
    let dir = moeconf_fixtures::ensure_builtin("builtin:tiny-v4")?;
    let model = Model::load(&dir)?;
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..context).map(|i| (i.wrapping_mul(37) + 5) % vocab).collect();
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let scratch = tempfile::tempdir()?;
    let mut trace = None;
    let mut none = NullSink;
    let sink: &mut dyn CaptureSink = match capture.as_str() {
        "none" => &mut none,
        "default" => {
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = steps + WARM_UP + 1;
            let w = TraceWriter::create(&scratch.path().join("t.bin"), Algorithm::Blake3, header)?;
            trace.insert(TraceSink::new(w, parse_capture("default")?).for_model(&model))
        }
        other => return Err(format!("capture is none or default, not {other}").into()),
    };
    let mut state = model.new_state();
    let mut next = model.step(&mut state, &prompt, &opts, sink)?.next_token;
    // The first decode steps also wait for the writer to finish the prefill
    // step's blocks (a cost of the prefill): they run before the count.
    for _ in 0..WARM_UP {
        next = model.step(&mut state, &[next], &opts, sink)?.next_token;
    }
    let before = schedstat();
    let threads_before = thread_times();
    let t = Instant::now();
    decode_steps(&mut || {
        for _ in 0..steps {
            next = model.step(&mut state, &[next], &opts, sink)?.next_token;
        }
        Ok(())
    })?;
    let seconds = t.elapsed().as_secs_f64();
    let after = schedstat();
    let threads_after = thread_times();
    if let Some(s) = trace {
        s.finish()?;
    }
    println!("context {context}: {steps} decode steps in {seconds:.3} s ({capture} capture)");
    if let (Some(a), Some(b)) = (before, after) {
        let (cpu, queued) = ((b[0] - a[0]) as f64 * 1e-9, (b[1] - a[1]) as f64 * 1e-9);
        println!(
            "  runtime thread: {cpu:.3} s on a core, {queued:.3} s waiting for one, {:.3} s blocked",
            seconds - cpu - queued
        );
    }
    for (name, ns, q) in &threads_after {
        let (was, wq) = threads_before
            .iter()
            .find(|(n, _, _)| n == name)
            .map_or((0, 0), |(_, v, w)| (*v, *w));
        println!(
            "  thread {name}: {:.3} s on a core, {:.3} s waiting for one",
            (ns - was) as f64 * 1e-9,
            (q - wq) as f64 * 1e-9
        );
    }
    Ok(())
}

/// Every thread of the process: its name and nanoseconds on a core.
fn thread_times() -> Vec<(String, u64, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let name = std::fs::read_to_string(e.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(e.path().join("schedstat")).ok()?;
            let mut f = stat.split_whitespace();
            let ns: u64 = f.next()?.parse().ok()?;
            let q: u64 = f.next()?.parse().ok()?;
            Some((
                format!("{} ({})", name.trim(), e.file_name().to_string_lossy()),
                ns,
                q,
            ))
        })
        .collect()
}

/// This thread's nanoseconds on a core and waiting in the run queue
/// (Linux's /proc/thread-self/schedstat), when the system has them.
fn schedstat() -> Option<[u64; 2]> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some([f.next()??, f.next()??])
}

/// The decode steps, in a function of their own for callgrind's toggle.
#[inline(never)]
fn decode_steps(run: &mut dyn FnMut() -> Result<(), Failure>) -> Result<(), Failure> {
    run()
}
