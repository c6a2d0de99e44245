//! `moeconf bench scale`: what diffing costs as traces grow to real-model
//! size (10⁴ … 10⁷ records), against a byte comparison of the same files in
//! the same run, and what writing costs in memory.
//!
//! For each size, two fingerprint-only traces shaped like a real capture
//! (43 layers of 232 records per step, plus the step's tokens and logits)
//! that differ in one record (one `moe.combine` digest in the middle step)
//! are written by a child process (`moeconf bench scale-write`, so that its
//! peak RSS is the writer's), read once to warm the page cache, compared
//! byte by byte to the end by `cmp -l` in a child process and by an
//! in-process memcmp loop (best of `repeat`), and diffed by `moeconf diff`
//! in a child process (best of `repeat`; its peak RSS from `wait4`). The
//! child's report must localize the changed record. Then `moeconf run` is
//! measured the same way at a few token counts: its peak RSS must not grow
//! with the number of steps. Files are removed after each size.

use crate::{scratch, step, BenchError, BenchReport};
use moeconf_fingerprint::{Algorithm, Component, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Decoding, Header, TraceError, TraceWriter, WriteSummary};
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// Layers per step of the synthetic traces (DeepSeek-V4's 43).
pub const SCALE_LAYERS: u32 = 43;
/// Records per layer and step.
pub const SCALE_PER_LAYER: u32 = 232;
/// Model-global records per step.
const GLOBALS: [(Component, Level, DType, u64, bool); 4] = [
    (Component::TokenOutput, Level::L0, DType::I32, 1, true),
    (Component::LmLogits, Level::L1, DType::F32, 4, false),
    (Component::LmTopkIds, Level::L1, DType::I32, 8, false),
    (Component::LmMargin, Level::L1, DType::F32, 1, true),
];
/// The named records of each layer (the rest are `op.NNN` operator records).
const NAMED: [(Component, Level); 4] = [
    (Component::LayerPostAttnMhc, Level::L3),
    (Component::RouterTopk, Level::L3),
    (Component::MoeCombine, Level::L4),
    (Component::LayerPostFfnMhc, Level::L3),
];
/// The layer whose `moe.combine` differs in the candidate.
pub const SCALE_CHANGED_LAYER: u32 = 21;

/// Records per step of the synthetic traces.
pub fn records_per_step() -> u64 {
    u64::from(SCALE_LAYERS * SCALE_PER_LAYER) + GLOBALS.len() as u64
}

/// Steps of a synthetic trace of about `records` records (the nearest
/// whole number of steps, at least 1).
pub fn steps_for(records: u64) -> u32 {
    let per = records_per_step();
    ((records + per / 2) / per).max(1) as u32
}

/// The step whose record differs: the middle one.
pub fn changed_step(records: u64) -> u32 {
    steps_for(records) / 2
}

/// Writes a synthetic fingerprint-only trace of about `records` records
/// (whole steps) in container format `version`; with `changed`, the
/// `moe.combine` of layer [`SCALE_CHANGED_LAYER`] in the middle step
/// differs. Deterministic: the same arguments give the same file.
pub fn write_synthetic(
    path: &Path,
    records: u64,
    changed: bool,
    version: u32,
) -> Result<WriteSummary, TraceError> {
    let steps = steps_for(records);
    let binding = Binding {
        model: moeconf_schema::ModelIdentity {
            name: "bench-scale".into(),
            ..Default::default()
        },
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::EMPTY,
        },
        decoding: Decoding {
            strategy: "greedy".into(),
            max_new_tokens: steps,
        },
        prompt: moeconf_schema::PromptBinding {
            text: "why the sheep".into(),
            ids: vec![1, 2, 3],
        },
        ..Binding::default()
    };
    let header = Header {
        binding,
        ..Header::default()
    };
    let out = moeconf_output::check_output(path, &moeconf_output::Inputs::new())?;
    let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header, version)?;
    w.set_parallel_hashing(false);
    let ops: Vec<String> = (0..SCALE_PER_LAYER as usize - NAMED.len())
        .map(|k| format!("op.{k:03}"))
        .collect();
    let target = changed_step(records);
    let mut bytes = [0u8; 32];
    // Small integers, exact as f32 and as i32 bit patterns.
    fn fill(bytes: &mut [u8; 32], seed: u64, n: usize) -> &[u8] {
        for (i, c) in bytes[..n * 4].chunks_exact_mut(4).enumerate() {
            let v = ((seed.wrapping_mul(0x9e37_79b9) + i as u64) % 1000) as u32;
            c.copy_from_slice(&(v as f32).to_bits().to_le_bytes());
        }
        &bytes[..n * 4]
    }
    for step in 0..steps {
        let position = 2 + step;
        let phase = if step == 0 { Phase::Prefill } else { Phase::Decode };
        let coord = |layer: Option<u32>, path: &str| Coord {
            step,
            position,
            phase,
            layer,
            path: path.into(),
        };
        for layer in 0..SCALE_LAYERS {
            let named = NAMED.iter().map(|&(c, l)| (c.path(), l));
            let rest = ops.iter().map(|p| (p.as_str(), Level::L4));
            for (k, (path, level)) in named.chain(rest).enumerate() {
                let mut seed = u64::from(step) << 32 | u64::from(layer) << 16 | k as u64;
                if changed
                    && step == target
                    && layer == SCALE_CHANGED_LAYER
                    && path == Component::MoeCombine.path()
                {
                    seed ^= 1 << 60;
                }
                let view = TensorView {
                    dtype: DType::F32,
                    shape: &[4],
                    bytes: fill(&mut bytes, seed, 4),
                };
                w.append(coord(Some(layer), path), level, view, false)?;
            }
        }
        for (k, &(c, level, dtype, n, keep)) in GLOBALS.iter().enumerate() {
            let view = TensorView {
                dtype,
                shape: &[n],
                bytes: fill(&mut bytes, u64::from(step) << 8 | k as u64, n as usize),
            };
            w.append(coord(None, c.path()), level, view, keep)?;
        }
    }
    w.finish()
}

/// What a child process did: its exit code, standard output, wall time and
/// peak resident set size.
pub(crate) struct Child {
    pub(crate) code: i32,
    pub(crate) stdout: Vec<u8>,
    pub(crate) seconds: f64,
    /// User + system CPU time (what the child computed, whatever the load).
    cpu_seconds: Option<f64>,
    peak_rss: Option<u64>,
}

/// Runs `cmd` to completion and reads its peak RSS from `wait4`.
pub(crate) fn measure(cmd: &mut Command, what: &str) -> Result<Child, BenchError> {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(step(what))?;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_end(&mut stdout).map_err(step(what))?;
    }
    if let Some(mut e) = child.stderr.take() {
        e.read_to_end(&mut stderr).map_err(step(what))?;
    }
    let (code, peak_rss, cpu_seconds) = wait_rusage(&mut child).map_err(step(what))?;
    let seconds = start.elapsed().as_secs_f64();
    if code != 0 && code != 1 {
        return Err(BenchError::Invalid(format!(
            "{what}: exit code {code}: {}",
            String::from_utf8_lossy(&stderr)
        )));
    }
    Ok(Child {
        code,
        stdout,
        seconds,
        cpu_seconds,
        peak_rss,
    })
}

/// Seconds of a `timeval`.
#[cfg(unix)]
fn secs(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 * 1e-6
}

/// This process's user + system CPU time so far.
#[cfg(unix)]
fn self_cpu() -> Option<f64> {
    // SAFETY: as in `wait_rusage`: a zeroed plain C struct, written by the call.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0)
        .then(|| secs(ru.ru_utime) + secs(ru.ru_stime))
}

#[cfg(not(unix))]
fn self_cpu() -> Option<f64> {
    None
}

/// Waits for `child` and returns its exit code, peak RSS in bytes
/// (`wait4`'s `ru_maxrss`, KiB on Linux) and user + system CPU seconds.
#[cfg(unix)]
fn wait_rusage(child: &mut std::process::Child) -> std::io::Result<(i32, Option<u64>, Option<f64>)> {
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value of the plain C struct,
    // and wait4 only writes into the two locals passed by pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    let cpu = secs(ru.ru_utime) + secs(ru.ru_stime);
    Ok((
        code,
        u64::try_from(ru.ru_maxrss).ok().map(|kb| kb * 1024),
        Some(cpu),
    ))
}

#[cfg(not(unix))]
fn wait_rusage(child: &mut std::process::Child) -> std::io::Result<(i32, Option<u64>, Option<f64>)> {
    Ok((child.wait()?.code().unwrap_or(-1), None, None))
}

/// Reads a file to the end (to warm the page cache).
fn read_all(p: &Path) -> Result<(), BenchError> {
    let mut f = std::fs::File::open(p).map_err(step("reading a trace"))?;
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf).map_err(step("reading a trace"))? > 0 {}
    Ok(())
}

/// Compares two files byte by byte to the end (what `cmp -l` reads; `cmp`
/// alone stops at the first difference). Returns the differing bytes.
fn compare(a: &Path, b: &Path) -> Result<u64, BenchError> {
    let open = |p: &Path| std::fs::File::open(p).map_err(step("opening for byte comparison"));
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut differing = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba)?;
        let nb = read_full(&mut fb, &mut bb)?;
        let n = na.min(nb);
        if ba[..n] != bb[..n] {
            differing += ba[..n].iter().zip(&bb[..n]).filter(|(x, y)| x != y).count() as u64;
        }
        differing += (na.max(nb) - n) as u64;
        if na == 0 && nb == 0 {
            return Ok(differing);
        }
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> Result<usize, BenchError> {
    let mut n = 0;
    while n < buf.len() {
        match f
            .read(&mut buf[n..])
            .map_err(step("reading for byte comparison"))?
        {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The machine's 1-minute load average (Linux).
fn load() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct ScaleOptions {
    /// Record counts 10^e for each exponent (4..=7).
    pub exponents: Vec<u32>,
    /// Repetitions of the byte comparison and of the diff (best reported).
    pub repeat: u32,
    /// Directory for the traces (a fresh scratch directory when `None`).
    pub dir: Option<PathBuf>,
    /// Token counts of the `moeconf run` memory measurement (none: skipped).
    pub run_tokens: Vec<u32>,
    /// The `moeconf` binary to run as the child processes.
    pub exe: PathBuf,
}

/// One size's measurements.
struct Row {
    records: u64,
    steps: u32,
    file_bytes: u64,
    write_seconds: f64,
    /// User + system CPU seconds of the slower of the two writers.
    write_cpu_seconds: Option<f64>,
    write_peak_rss: Option<u64>,
    compare_seconds: f64,
    compare_cpu_seconds: Option<f64>,
    /// `cmp -l` as a child process (wall, cpu), when `cmp` runs here.
    cmp: Option<(f64, Option<f64>)>,
    differing_bytes: u64,
    diff_seconds: f64,
    diff_cpu_seconds: Option<f64>,
    diff_peak_rss: Option<u64>,
    /// `moeconf gate` of the same pair as a child process (wall, cpu, peak RSS).
    gate: (f64, Option<f64>, Option<u64>),
    /// Opening both traces and running the diff inside this process (the
    /// library call, no process start): wall, cpu.
    in_process: (f64, Option<f64>),
}

/// The smaller of two optional values.
fn min_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) | (None, x) => x,
    }
}

/// The larger of two optional values.
fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) | (None, x) => x,
    }
}

/// One `moeconf run` measurement.
struct Run {
    tokens: u32,
    child: Child,
    bytes: u64,
    records: u64,
}

/// The file names `bench scale` writes into its directory (and removes).
pub const SCALE_TRACE_NAMES: [&str; 3] = ["scale-ref.bin", "scale-cand.bin", "scale-run.bin"];

fn mib(b: Option<u64>) -> Value {
    b.map_or(Value::Null, |b| {
        json!((b as f64 / f64::from(1 << 20) * 10.0).round() / 10.0)
    })
}

fn mib_text(b: Option<u64>) -> String {
    b.map_or("-".into(), |b| format!("{:.1}", b as f64 / f64::from(1 << 20)))
}

/// Runs the scale benchmark.
pub fn scale(o: &ScaleOptions) -> Result<BenchReport, BenchError> {
    if o.exponents.iter().any(|&e| !(4..=7).contains(&e)) {
        return Err(BenchError::Invalid("sizes are 10^4 … 10^7 records".into()));
    }
    let tmp;
    let dir = match &o.dir {
        Some(d) => {
            if !std::fs::metadata(d).is_ok_and(|m| m.is_dir()) {
                return Err(BenchError::Invalid(format!(
                    "--dir {}: not a directory",
                    d.display()
                )));
            }
            for name in SCALE_TRACE_NAMES {
                if std::fs::symlink_metadata(d.join(name)).is_ok() {
                    return Err(BenchError::Invalid(format!(
                        "--dir {}: {name} already exists; bench scale writes and then removes its own traces \
                         there, so it refuses to take over an existing file",
                        d.display()
                    )));
                }
            }
            d.clone()
        }
        None => {
            tmp = scratch("moeconf-bench-scale")?;
            tmp.path().to_path_buf()
        }
    };
    let [rp, cp, runp] = SCALE_TRACE_NAMES.map(|n| dir.join(n));
    let load_before = load();
    // What starting the binary costs, whatever it then does.
    let mut startup: Option<(f64, Option<f64>)> = None;
    for _ in 0..o.repeat.max(1) * 3 {
        let k = measure(Command::new(&o.exe).arg("--version"), "moeconf --version")?;
        startup = Some(match startup {
            Some((w, c)) => (w.min(k.seconds), min_opt(c, k.cpu_seconds)),
            None => (k.seconds, k.cpu_seconds),
        });
    }
    let mut rows = Vec::new();
    let result = (|| -> Result<Vec<Run>, BenchError> {
        for &e in &o.exponents {
            let records = 10u64.pow(e);
            let steps = steps_for(records);
            eprintln!(
                "moeconf bench scale: 10^{e} records ({steps} steps of {}; two traces of about {} MiB in {}) ...",
                records_per_step(),
                (records_per_step() * u64::from(steps) * 85) >> 20,
                dir.display()
            );
            let mut write_seconds = 0.0f64;
            let mut write_cpu_seconds: Option<f64> = None;
            let mut write_peak_rss = None;
            for (p, changed) in [(&rp, false), (&cp, true)] {
                let mut cmd = Command::new(&o.exe);
                cmd.args(["bench", "scale-write", "--records", &records.to_string(), "--out"])
                    .arg(p);
                if changed {
                    cmd.arg("--changed");
                }
                let c = measure(&mut cmd, "writing a synthetic trace")?;
                write_seconds = write_seconds.max(c.seconds);
                write_cpu_seconds = max_opt(write_cpu_seconds, c.cpu_seconds);
                write_peak_rss = write_peak_rss.max(c.peak_rss);
            }
            let file_bytes = std::fs::metadata(&rp)
                .map_err(step("reading a trace's size"))?
                .len();
            read_all(&rp)?;
            read_all(&cp)?;
            let (mut compare_seconds, mut differing_bytes) = (f64::INFINITY, 0);
            let (mut diff_seconds, mut diff_peak_rss) = (f64::INFINITY, None);
            let mut gate: (f64, Option<f64>, Option<u64>) = (f64::INFINITY, None, None);
            let (mut compare_cpu_seconds, mut diff_cpu_seconds) = (None, None);
            let mut cmp: Option<(f64, Option<f64>)> = None;
            let mut in_process = (f64::INFINITY, None);
            for _ in 0..o.repeat.max(1) {
                let mut c = Command::new("cmp");
                c.arg("-l").arg(&rp).arg(&cp);
                if let Ok(k) = measure(&mut c, "cmp -l") {
                    cmp = Some(match cmp {
                        Some((w, u)) => (w.min(k.seconds), min_opt(u, k.cpu_seconds)),
                        None => (k.seconds, k.cpu_seconds),
                    });
                }
                let (t, cpu) = (Instant::now(), self_cpu());
                differing_bytes = compare(&rp, &cp)?;
                compare_seconds = compare_seconds.min(t.elapsed().as_secs_f64());
                let used = cpu.zip(self_cpu()).map(|(a, b)| b - a);
                compare_cpu_seconds = min_opt(compare_cpu_seconds, used);
                let mut cmd = Command::new(&o.exe);
                cmd.args(["diff", "--format", "json"]).arg(&rp).arg(&cp);
                let c = measure(&mut cmd, "moeconf diff")?;
                let report: Value =
                    serde_json::from_slice(&c.stdout).map_err(step("reading the diff's report"))?;
                let fd = &report["first_divergence"];
                let want = (
                    Some(u64::from(changed_step(records))),
                    Some(u64::from(SCALE_CHANGED_LAYER)),
                    Some(Component::MoeCombine.path()),
                );
                let got = (fd["step"].as_u64(), fd["layer"].as_u64(), fd["operator"].as_str());
                if c.code != 1 || got != want {
                    return Err(BenchError::Invalid(format!(
                        "moeconf diff did not localize the changed record (exit {}, first divergence {fd})",
                        c.code
                    )));
                }
                diff_seconds = diff_seconds.min(c.seconds);
                diff_cpu_seconds = min_opt(diff_cpu_seconds, c.cpu_seconds);
                diff_peak_rss = diff_peak_rss.max(c.peak_rss);
                // The gate of the same pair: every level's coverage (which
                // levels each step holds, committed in the root block of
                // version 3) and the failing record.
                let mut cmd = Command::new(&o.exe);
                cmd.args(["gate", "--format", "json"]).arg(&rp).arg(&cp);
                let c = measure(&mut cmd, "moeconf gate")?;
                let report: Value =
                    serde_json::from_slice(&c.stdout).map_err(step("reading the gate's report"))?;
                let at = report["levels"]
                    .as_array()
                    .and_then(|l| l.iter().find(|x| x["level"] == "L4"))
                    .map(|x| x["first_failure"]["at"].clone())
                    .unwrap_or(Value::Null);
                let got = (at["step"].as_u64(), at["layer"].as_u64(), at["path"].as_str());
                if c.code != 1 || got != want {
                    return Err(BenchError::Invalid(format!(
                        "moeconf gate did not fail at the changed record (exit {}, first L4 failure {at})",
                        c.code
                    )));
                }
                gate = (
                    gate.0.min(c.seconds),
                    min_opt(gate.1, c.cpu_seconds),
                    gate.2.max(c.peak_rss),
                );
                let (t, cpu) = (Instant::now(), self_cpu());
                let (a, b) = moeconf_bisect::open_pair_with(&rp, &cp, moeconf_schema::Verification::OnUse)
                    .map_err(step("opening the traces"))?;
                let d = moeconf_bisect::diff(&a, &b, &moeconf_bisect::DiffOptions::default())
                    .map_err(step("diff"))?;
                let wall = t.elapsed().as_secs_f64();
                let used = cpu.zip(self_cpu()).map(|(x, y)| y - x);
                if d.first_divergence.is_none() {
                    return Err(BenchError::Invalid(
                        "the in-process diff found no divergence".into(),
                    ));
                }
                in_process = (in_process.0.min(wall), min_opt(in_process.1, used));
            }
            for p in [&rp, &cp] {
                std::fs::remove_file(p).map_err(step("removing a trace"))?;
            }
            rows.push(Row {
                records: records_per_step() * u64::from(steps),
                steps,
                file_bytes,
                write_seconds,
                write_cpu_seconds,
                write_peak_rss,
                compare_seconds,
                compare_cpu_seconds,
                cmp,
                differing_bytes,
                diff_seconds,
                diff_cpu_seconds,
                diff_peak_rss,
                gate,
                in_process,
            });
        }
        let mut runs = Vec::new();
        for &tokens in &o.run_tokens {
            eprintln!("moeconf bench scale: moeconf run, {tokens} tokens ...");
            let mut cmd = Command::new(&o.exe);
            cmd.args([
                "run",
                "--model",
                "builtin:tiny-v4",
                "--prompt",
                "why the sheep",
                "--max-new-tokens",
                &tokens.to_string(),
                "--capture",
                "fingerprints",
                "-o",
            ])
            .arg(&runp);
            let c = measure(&mut cmd, "moeconf run")?;
            let bytes = std::fs::metadata(&runp)
                .map_err(step("reading the run's trace"))?
                .len();
            let records = moeconf_schema::Trace::open(&runp)
                .map_err(step("opening the run's trace"))?
                .record_count();
            std::fs::remove_file(&runp).map_err(step("removing the run's trace"))?;
            runs.push(Run {
                tokens,
                child: c,
                bytes,
                records,
            });
        }
        Ok(runs)
    })();
    for p in [&rp, &cp, &runp] {
        let _ = std::fs::remove_file(p);
    }
    let runs = result?;
    let load_after = load();
    Ok(report(&rows, &runs, o.repeat, (load_before, load_after), startup))
}

fn report(
    rows: &[Row],
    runs: &[Run],
    repeat: u32,
    load: (Option<f64>, Option<f64>),
    startup: Option<(f64, Option<f64>)>,
) -> BenchReport {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut text = format!(
        "diff of two fingerprint-only traces differing in one record, against byte comparisons of the two \
         files read to the end (`cmp -l` as a child process, and an in-process memcmp loop), warm page cache, \
         best of {repeat}; moeconf diff and the writer run as child processes (peak RSS from wait4); {threads} \
         CPUs, load average {} before, {} after\n\
         wall: elapsed seconds; cpu: user + system seconds (what the scheduler gave, whatever the load); \
         starting the binary (`moeconf --version`) takes {} s wall / {} s cpu of every `moeconf diff`\n\n\
         \x20   records  steps  file MiB  write wall/cpu s  write RSS MiB   memcmp wall/cpu s     cmp -l wall/cpu s       \
         diff wall/cpu s   diff/cmp wall/cpu   diff RSS MiB   gate wall/cpu s   gate/cmp wall/cpu   gate RSS MiB   \
         in-process diff wall/cpu s  /cmp wall/cpu\n",
        load.0.map_or("-".into(), |l| format!("{l:.2}")),
        load.1.map_or("-".into(), |l| format!("{l:.2}")),
        startup.map_or("-".into(), |s| format!("{:.4}", s.0)),
        startup.and_then(|s| s.1).map_or("-".into(), |c| format!("{c:.4}")),
    );
    let pct = |a: Option<f64>, b: Option<f64>| {
        a.zip(b)
            .map_or("-".into(), |(a, b)| format!("{:.2}%", 100.0 * a / b))
    };
    let sec = |a: Option<f64>| a.map_or("-".into(), |a| format!("{a:.4}"));
    for r in rows {
        let (cw, cc) = (r.cmp.map(|c| c.0), r.cmp.and_then(|c| c.1));
        text.push_str(&format!(
            "{:>11} {:>6} {:>9.1} {:>8.2} / {:<6} {:>14} {:>9.4} / {:<8} {:>9} / {:<8} {:>9.4} / {:<8} {:>8} / {:<7} {:>12} \
             {:>9.4} / {:<8} {:>8} / {:<7} {:>12}   {:>9.4} / {:<8}  {:>7} / {:<7}\n",
            r.records,
            r.steps,
            r.file_bytes as f64 / f64::from(1 << 20),
            r.write_seconds,
            r.write_cpu_seconds.map_or("-".into(), |c| format!("{c:.2}")),
            mib_text(r.write_peak_rss),
            r.compare_seconds,
            sec(r.compare_cpu_seconds),
            sec(cw),
            sec(cc),
            r.diff_seconds,
            sec(r.diff_cpu_seconds),
            pct(Some(r.diff_seconds), cw),
            pct(r.diff_cpu_seconds, cc),
            mib_text(r.diff_peak_rss),
            r.gate.0,
            sec(r.gate.1),
            pct(Some(r.gate.0), cw),
            pct(r.gate.1, cc),
            mib_text(r.gate.2),
            r.in_process.0,
            sec(r.in_process.1),
            pct(Some(r.in_process.0), cw),
            pct(r.in_process.1, cc),
        ));
    }
    text.push_str(
        "  (target at 10^7 records: diff and gate <= 2% of the byte comparison and <= 64 MiB RSS)\n",
    );
    if !runs.is_empty() {
        text.push_str(
            "\nmoeconf run --capture fingerprints (builtin:tiny-v4): peak RSS against the number of steps\n",
        );
        text.push_str("   tokens    records   file MiB    run s   peak RSS MiB\n");
        for r in runs {
            text.push_str(&format!(
                "{:>9} {:>10} {:>10.1} {:>8.2} {:>14}\n",
                r.tokens,
                r.records,
                r.bytes as f64 / f64::from(1 << 20),
                r.child.seconds,
                mib_text(r.child.peak_rss)
            ));
        }
    }
    let json = json!({
        "schema_version": 1,
        "kind": "moeconf.bench.scale",
        "threads": threads,
        "repeat": repeat,
        "load_average_before": load.0,
        "load_average_after": load.1,
        "startup_seconds": startup.map(|s| s.0),
        "startup_cpu_seconds": startup.and_then(|s| s.1),
        "rows": rows.iter().map(|r| json!({
            "records": r.records,
            "steps": r.steps,
            "file_bytes": r.file_bytes,
            "write_seconds": r.write_seconds,
            "write_cpu_seconds": r.write_cpu_seconds,
            "write_peak_rss_mib": mib(r.write_peak_rss),
            "byte_compare_seconds": r.compare_seconds,
            "byte_compare_cpu_seconds": r.compare_cpu_seconds,
            "cmp_seconds": r.cmp.map(|c| c.0),
            "cmp_cpu_seconds": r.cmp.and_then(|c| c.1),
            "differing_bytes": r.differing_bytes,
            "diff_seconds": r.diff_seconds,
            "diff_cpu_seconds": r.diff_cpu_seconds,
            "ratio_memcmp": r.diff_seconds / r.compare_seconds,
            "ratio_cmp": r.cmp.map(|c| r.diff_seconds / c.0),
            "ratio_cmp_cpu": r.diff_cpu_seconds.zip(r.cmp.and_then(|c| c.1)).map(|(a, b)| a / b),
            "diff_peak_rss_mib": mib(r.diff_peak_rss),
            "gate_seconds": r.gate.0,
            "gate_cpu_seconds": r.gate.1,
            "gate_ratio_cmp": r.cmp.map(|c| r.gate.0 / c.0),
            "gate_ratio_cmp_cpu": r.gate.1.zip(r.cmp.and_then(|c| c.1)).map(|(a, b)| a / b),
            "gate_peak_rss_mib": mib(r.gate.2),
            "in_process_diff_seconds": r.in_process.0,
            "in_process_diff_cpu_seconds": r.in_process.1,
        })).collect::<Vec<_>>(),
        "runs": runs.iter().map(|r| json!({
            "tokens": r.tokens,
            "records": r.records,
            "file_bytes": r.bytes,
            "seconds": r.child.seconds,
            "peak_rss_mib": mib(r.child.peak_rss),
        })).collect::<Vec<_>>(),
    });
    BenchReport { text, json }
}
