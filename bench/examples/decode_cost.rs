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
//!
//! `decode_cost CONTEXT SEGMENTS ab` runs both in one process instead: two
//! runs of the prompt, one uncaptured and one with the default capture,
//! advanced in turn by segments of 50 decode steps, and prints the median
//! of the segments' wall-clock ratios and the ratio of the runtime thread's
//! whole time on a core with and without. Both
//! runs then share whatever the process drew (where its memory sits, the
//! machine's state at that moment), so comparing builds or switched-off
//! parts of the capture this way is less noisy than the bench's pairs of
//! processes; the bench stays the measure of the target.

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
    if capture == "ab" {
        return alternate(&model, &prompt, &opts, steps, &scratch);
    }
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
        other => return Err(format!("the mode is none, default or ab, not {other}").into()),
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

/// Segments of `ALTERNATE_STEPS` decode steps of one run without capture
/// and one with the default capture, in turn, `segments` of each.
const ALTERNATE_STEPS: u32 = 50;

/// The `ab` mode: two runs of the same prompt in this one process, one
/// without capture and one with the default capture, advanced in turn a
/// segment at a time; prints the runtime thread's time on a core per
/// segment pair and the median ratio. Both runs share the process's
/// weights and heap, so what one process draws (where its memory sits)
/// weighs on both alike.
fn alternate(
    model: &Model,
    prompt: &[u32],
    opts: &StepOptions<'_>,
    segments: u32,
    scratch: &tempfile::TempDir,
) -> Result<(), Failure> {
    let mut header = Header::default();
    header.binding.decoding.max_new_tokens = segments * ALTERNATE_STEPS + WARM_UP + 1;
    let w = TraceWriter::create(&scratch.path().join("t.bin"), Algorithm::Blake3, header)?;
    let mut sink = TraceSink::new(w, parse_capture("default")?).for_model(model);
    let mut none = NullSink;
    let (mut plain, mut captured) = (model.new_state(), model.new_state());
    let mut next_plain = model.step(&mut plain, prompt, opts, &mut none)?.next_token;
    let mut next_captured = model.step(&mut captured, prompt, opts, &mut sink)?.next_token;
    for _ in 0..WARM_UP {
        next_plain = model.step(&mut plain, &[next_plain], opts, &mut none)?.next_token;
        next_captured = model
            .step(&mut captured, &[next_captured], opts, &mut sink)?
            .next_token;
    }
    let on_core = || schedstat().map_or(0.0, |s| s[0] as f64 * 1e-9);
    // Per segment the wall clock: a running thread's time on a core is read
    // as of the scheduler's last tick (milliseconds stale), too coarse for
    // segments of tens of milliseconds. Summed over the run it is exact
    // enough, and counts only the runtime thread's own time.
    let mut ratios = Vec::new();
    let (mut core_plain, mut core_captured) = (0.0, 0.0);
    for _ in 0..segments {
        let (c, t) = (on_core(), Instant::now());
        for _ in 0..ALTERNATE_STEPS {
            next_plain = model.step(&mut plain, &[next_plain], opts, &mut none)?.next_token;
        }
        let a = t.elapsed().as_secs_f64();
        core_plain += on_core() - c;
        let (c, t) = (on_core(), Instant::now());
        for _ in 0..ALTERNATE_STEPS {
            next_captured = model
                .step(&mut captured, &[next_captured], opts, &mut sink)?
                .next_token;
        }
        let b = t.elapsed().as_secs_f64();
        core_captured += on_core() - c;
        ratios.push(b / a);
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "context {}: {segments} segments of {ALTERNATE_STEPS} steps each way; median segment ratio (wall) {median:.4}; runtime thread on a core {core_plain:.3} s without, {core_captured:.3} s with: {:.4}",
        prompt.len(),
        core_captured / core_plain
    );
    sink.finish()?;
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
