//! The metamorphic oracle of [`crate::lies`]: for a trace F and a lie F′ of
//! it, every command gives F′ the answer it gives F (same verdict, same
//! report) or an error. Never another answer, never a panic.
//!
//! Each command family runs at library level, as the `moeconf` command
//! does (the same entry points and verification), once with F and once
//! with F′ written to the same file name, so that the reports need no
//! normalizing of names; [`compare`] lists every answer of F′ that is
//! neither F's nor an error. (`moeconf merge` takes shard partials, not
//! traces: the traces a calibration partial attaches are copied byte for
//! byte under the partial's own digests and never opened, so no fact of a
//! trace reaches its output; it has no place here. `replay` needs the reference runtime and
//! is driven on the binary by `tests/lies_cli.rs`.)

use crate::gen::{GenOptions, TraceSpec};
use crate::lies::{lie, Lie, LieClass, Model};
use arbitrary::Unstructured;
use moeconf_bisect::{diff, DiffOptions};
use moeconf_fingerprint::{Component, Level, LevelSet};
use moeconf_gate::baseline::Baseline;
use moeconf_gate::policy::{Mode, Profile, Requirement};
use moeconf_gate::{against_baseline_with, against_reference_with};
use moeconf_schema::{Trace, Verification};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// What one command gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A report (verdict included), rendered as text and JSON.
    Report(String),
    /// An error (exit 2), with its message.
    Error(String),
    /// The command panicked: always a bug.
    Panic(String),
}

/// One command's outcome, labelled (e.g. `gate near-tie: F as reference`).
pub type Answer = (String, Outcome);

/// The command families of the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `moeconf inspect` (verified in full), text and JSON.
    Inspect,
    /// `moeconf diff` F vs G, G vs F, F vs F; on use and `--verify-all`.
    Diff,
    /// `moeconf gate` under strict, tolerance, near-tie and coverage
    /// policies, F as reference, as candidate and against itself, on use
    /// and `--verify-all`; `--bless` (the baseline file) and gating against
    /// baselines ([`cross_baselines`]: F against F′'s and F′ against F's).
    Gate,
    /// `moeconf explain` (verified in full).
    Explain,
    /// `moeconf certify` with the `c` and `b` families (verified in full).
    Certify,
    /// `moeconf convert` to versions 1, 2 and 3 (the output's records).
    Convert,
}

impl Family {
    pub const ALL: [Family; 6] = [
        Family::Inspect,
        Family::Diff,
        Family::Gate,
        Family::Explain,
        Family::Certify,
        Family::Convert,
    ];
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Runs `f`, catching a panic as [`Outcome::Panic`].
fn run(f: impl FnOnce() -> Result<String, String>) -> Outcome {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => Outcome::Report(r),
        Ok(Err(e)) => Outcome::Error(e),
        Err(p) => Outcome::Panic(panic_text(p)),
    }
}

/// The profiles the gate family judges under.
pub fn profiles() -> Vec<(&'static str, Profile)> {
    let strict = Profile::builtin("strict");
    let mut tolerance = Profile::builtin("default");
    tolerance.levels = [Mode::Tolerance; 5];
    // The near-tie policy of the measured verdict flip: L0 tolerance, L1
    // info, argmax and route near-ties accepted below their margins.
    let mut near_tie = Profile::builtin("default");
    near_tie.levels = [
        Mode::Tolerance,
        Mode::Info,
        Mode::Bitwise,
        Mode::Tolerance,
        Mode::Info,
    ];
    near_tie.argmax_near_tie_margin = 0.5;
    near_tie.route_near_tie_margin = 0.5;
    // `--required L0,L1,L2`.
    let mut required = Profile::builtin("default");
    required.required = vec![
        Requirement::Level(Level::L0),
        Requirement::Level(Level::L1),
        Requirement::Level(Level::L2),
    ];
    vec![
        ("strict", strict),
        ("tolerance", tolerance),
        ("near-tie", near_tie),
        ("required L0,L1,L2", required),
    ]
}

fn gate_text(r: Result<moeconf_gate::GateReport, moeconf_gate::GateError>) -> Result<String, String> {
    r.map(|rep| format!("{}\n{:#}", rep.render_text(), rep.to_json()))
        .map_err(|e| e.to_string())
}

/// Writes `bytes` to `path`; an error is an error of the harness.
fn put(path: &Path, bytes: &[u8]) {
    if let Err(e) = std::fs::write(path, bytes) {
        panic!("cannot write {}: {e}", path.display());
    }
}

/// Every answer of `family` with `f` (F or F′) as the trace under test and
/// `g` as the other trace, in the scratch directory `dir` (F is always
/// written to `dir/f.bin`, G to `dir/g.bin`; `inspect` and `diff` open
/// them from memory under those names, as the files would open).
pub fn answers(family: Family, f: &[u8], g: &[u8], dir: &Path) -> Vec<Answer> {
    answers_under(family, f, g, dir, &profiles())
}

/// [`answers`] with the gate family judging under `profiles` only.
pub fn answers_under(
    family: Family,
    f: &[u8],
    g: &[u8],
    dir: &Path,
    profiles: &[(&str, Profile)],
) -> Vec<Answer> {
    answers_picked(family, f, g, dir, profiles, Pick::All)
}

/// Which of a family's answers [`answers_picked`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    All,
    /// None: only count them ([`case_count`]).
    Count,
    /// The one with this index (in the order [`answers_under`] lists them).
    One(usize),
}

/// The answers of a family, collected one case at a time: a case not
/// picked is never run.
struct Cases {
    out: Vec<Answer>,
    next: usize,
    pick: Pick,
}

impl Cases {
    fn add(&mut self, name: String, f: impl FnOnce() -> Result<String, String>) {
        let i = self.next;
        self.next += 1;
        match self.pick {
            Pick::All => self.out.push((name, run(f))),
            Pick::One(k) if k == i => self.out.push((name, run(f))),
            _ => {}
        }
    }
}

/// How many answers [`answers_under`] gives for `family` under `profiles`.
pub fn case_count(family: Family, dir: &Path, profiles: &[(&str, Profile)]) -> usize {
    let mut n = 0;
    answers_counted(family, &[], &[], dir, profiles, Pick::Count, &mut n);
    n
}

/// [`answers_under`] with only the picked case(s) run: what a fuzz
/// execution uses (one case each; over many executions, every case).
pub fn answers_picked(
    family: Family,
    f: &[u8],
    g: &[u8],
    dir: &Path,
    profiles: &[(&str, Profile)],
    pick: Pick,
) -> Vec<Answer> {
    let mut n = 0;
    answers_counted(family, f, g, dir, profiles, pick, &mut n)
}

fn answers_counted(
    family: Family,
    f: &[u8],
    g: &[u8],
    dir: &Path,
    profiles: &[(&str, Profile)],
    pick: Pick,
    count: &mut usize,
) -> Vec<Answer> {
    let fp = dir.join("f.bin");
    let gp = dir.join("g.bin");
    if pick != Pick::Count {
        put(&fp, f);
        put(&gp, g);
    }
    let mut cases = Cases {
        out: Vec::new(),
        next: 0,
        pick,
    };
    match family {
        Family::Inspect => {
            cases.add("inspect".into(), || {
                let t = Trace::from_bytes(&fp, f.to_vec()).map_err(|e| e.to_string())?;
                t.verify_payloads().map_err(|e| e.to_string())?;
                let opts = moeconf_schema::inspect::InspectOptions {
                    verify_payloads: true,
                    list_tensors: false,
                };
                let i = moeconf_schema::inspect::Inspection::new(&t, opts).map_err(|e| e.to_string())?;
                let mut json = Vec::new();
                i.write_json(&mut json).map_err(|e| e.to_string())?;
                Ok(format!("{}\n{}", i.render_text(), String::from_utf8_lossy(&json)))
            });
        }
        Family::Diff => {
            for (v, vname) in [
                (Verification::OnUse, "on use"),
                (Verification::Full, "--verify-all"),
            ] {
                // In memory (what `open_pair_with` does with the files:
                // open, then verify as asked), for speed.
                let open = |p: &Path, bytes: &[u8]| -> Result<Trace, String> {
                    let t = Trace::from_bytes(p, bytes.to_vec()).map_err(|e| e.to_string())?;
                    t.ensure(v).map_err(|e| e.to_string())?;
                    Ok(t)
                };
                for ((a, ab), (b, bb), name) in [
                    ((&fp, f), (&gp, g), "F vs G"),
                    ((&gp, g), (&fp, f), "G vs F"),
                    ((&fp, f), (&fp, f), "F vs F"),
                ] {
                    cases.add(format!("diff {name} ({vname})"), || {
                        let (at, bt) = (open(a, ab)?, open(b, bb)?);
                        let opts = DiffOptions::default();
                        let d = diff(&at, &bt, &opts).map_err(|e| e.to_string())?;
                        Ok(format!("{}\n{:#}", d.render_text(false), d.to_json()))
                    });
                }
            }
        }
        Family::Gate => {
            for (pname, p) in profiles {
                for (v, vname) in [
                    (Verification::OnUse, "on use"),
                    (Verification::Full, "--verify-all"),
                ] {
                    for (r, c, name) in [
                        (&fp, &gp, "F as reference"),
                        (&gp, &fp, "F as candidate"),
                        (&fp, &fp, "F against itself"),
                    ] {
                        cases.add(format!("gate {pname}: {name} ({vname})"), || {
                            let ct = Trace::open(c).map_err(|e| e.to_string())?;
                            gate_text(against_reference_with(r, &ct, p, false, v))
                        });
                    }
                }
                // Blessed baselines: F blessed, G and F against it; G blessed, F against it.
                for (blessed, c, name) in [
                    (&fp, &gp, "G against blessed F"),
                    (&fp, &fp, "F against blessed F"),
                    (&gp, &fp, "F against blessed G"),
                ] {
                    let bp = dir.join("blessed.json");
                    cases.add(format!("gate {pname}: {name}"), || {
                        let _ = std::fs::remove_file(&bp);
                        let bt = Trace::open_verified(blessed).map_err(|e| e.to_string())?;
                        Baseline::of(&bt)
                            .and_then(|b| b.write(&bp))
                            .map_err(|e| format!("bless: {e}"))?;
                        let ct = Trace::open(c).map_err(|e| e.to_string())?;
                        gate_text(against_baseline_with(&bp, &ct, p, false, Verification::OnUse))
                    });
                }
            }
            cases.add("gate --bless F (the baseline file)".into(), || {
                let bp = dir.join("bless-out.json");
                let t = Trace::open_verified(&fp).map_err(|e| e.to_string())?;
                Baseline::of(&t)
                    .and_then(|b| b.write(&bp))
                    .map_err(|e| e.to_string())?;
                std::fs::read_to_string(&bp).map_err(|e| e.to_string())
            });
        }
        Family::Explain => {
            cases.add("explain".into(), || {
                let t = Trace::open_verified(&fp).map_err(|e| e.to_string())?;
                let r = moeconf_bisect::explain_trace(&t, "f.bin").map_err(|e| e.to_string())?;
                Ok(format!("{}\n{:#}", r.render_text(), r.to_json()))
            });
        }
        Family::Certify => {
            cases.add("certify c,b".into(), || {
                let t = Trace::open_verified(&fp).map_err(|e| e.to_string())?;
                let families: Vec<moeconf_bisect::Family> = ["c", "b"]
                    .iter()
                    .filter_map(|n| {
                        moeconf_contract::AggregationContract::parse(n)
                            .ok()
                            .map(|contract| moeconf_bisect::Family {
                                name: n.to_string(),
                                contract,
                            })
                    })
                    .collect();
                let r = moeconf_bisect::certify(&t, &families).map_err(|e| e.to_string())?;
                Ok(format!("{}\n{:#}", r.render_text(false), r.to_json()))
            });
        }
        Family::Convert => {
            for version in [1u32, 2, 3] {
                cases.add(format!("convert --to {version}"), || {
                    let op = dir.join(format!("converted-{version}.bin"));
                    let _ = std::fs::remove_file(&op);
                    let checked = moeconf_output::check_output(&op, &moeconf_output::Inputs::new())
                        .map_err(|e| e.to_string())?;
                    let s = moeconf_schema::convert::convert(&fp, &checked, version)
                        .map_err(|e| e.to_string())?;
                    // The records (coordinates, levels, digests, payload
                    // presence) in canonical order: the output's committed
                    // content. Not its bytes or write order: a conversion
                    // is lossless, so it carries the input's write order
                    // and layout, which the root does not commit to and a
                    // lie may choose (docs/format.md §11.7).
                    let t = Trace::open_verified(&op).map_err(|e| format!("the converted file: {e}"))?;
                    let mut content = Vec::new();
                    t.for_each_record(|_, e| {
                        content.push(format!(
                            "{} {} {} {}",
                            e.coord,
                            e.level.name(),
                            e.digest.to_hex(),
                            e.payload.is_some()
                        ))
                    })
                    .map_err(|e| e.to_string())?;
                    content.sort();
                    Ok(format!(
                        "from {} to {} root {} records {} payloads {}\nbytes {}\ncontent {}",
                        s.from,
                        s.to,
                        s.root.to_hex(),
                        s.written.records,
                        s.written.payloads,
                        s.written.bytes,
                        blake3_hex(content.join("\n").as_bytes())
                    ))
                });
            }
        }
    }
    *count = cases.next;
    cases.out
}

/// A short content digest of output bytes (for comparing converted files).
fn blake3_hex(bytes: &[u8]) -> String {
    moeconf_fingerprint::Algorithm::Blake3.hash(bytes).to_hex()
}

/// Every way the answers `lied` (of F′) break the oracle against `truth`
/// (of F): an answer that is neither F's nor an error, a panic, or an
/// error of F that F′ turned into a report.
pub fn compare(truth: &[Answer], lied: &[Answer]) -> Vec<String> {
    let mut bad = Vec::new();
    for ((name, t), (_, l)) in truth.iter().zip(lied) {
        match (t, l) {
            (_, Outcome::Panic(p)) => bad.push(format!("{name}: panic: {p}")),
            (Outcome::Panic(p), _) => bad.push(format!("{name}: panic on the true trace: {p}")),
            (_, Outcome::Error(_)) => {}
            (Outcome::Report(a), Outcome::Report(b)) if a == b => {}
            (Outcome::Report(a), Outcome::Report(b)) => {
                bad.push(format!("{name}: report differs:\n{}", first_difference(a, b)))
            }
            (Outcome::Error(e), Outcome::Report(b)) => bad.push(format!(
                "{name}: the true trace is an error ({e}) but the lie gives a report:\n{}",
                b.lines().take(6).collect::<Vec<_>>().join("\n")
            )),
        }
    }
    bad
}

/// The first differing line of two reports, both sides.
pub fn first_difference(a: &str, b: &str) -> String {
    for (i, (x, y)) in a.lines().zip(b.lines()).enumerate() {
        if x != y {
            let cut = |s: &str| s.chars().take(400).collect::<String>();
            return format!("  line {i}: F : {}\n  line {i}: F′: {}", cut(x), cut(y));
        }
    }
    format!("  F has {} lines, F′ {}", a.lines().count(), b.lines().count())
}

/// What comparing F′'s answers with F's found.
#[derive(Debug, Default)]
pub struct Checked {
    /// Every oracle failure (empty: the oracle holds).
    pub failures: Vec<String>,
    /// Answers of F′ that were reports equal to F's (not errors): the lie
    /// was read and did not change the answer.
    pub answered: usize,
    /// Answers of F′ that were errors where F's was a report: the lie was
    /// refused.
    pub refused: usize,
}

/// Runs `family` on F and on F′ (= `lied`) against G and compares. With
/// `provenance` (F′ has another provenance than F), reports are compared
/// [`without_provenance`].
pub fn check(family: Family, f: &[u8], lied: &[u8], g: &[u8], dir: &Path, provenance: bool) -> Checked {
    let truth = answers(family, f, g, dir);
    check_against(&truth, family, lied, g, dir, provenance, &profiles())
}

/// [`check`] with F's answers already known (`truth`, from
/// [`answers_under`] with the same `profiles`).
pub fn check_against(
    truth: &[Answer],
    family: Family,
    lied: &[u8],
    g: &[u8],
    dir: &Path,
    provenance: bool,
    profiles: &[(&str, Profile)],
) -> Checked {
    check_picked(truth, family, lied, g, dir, provenance, profiles, Pick::All)
}

/// [`check_against`] of the picked case(s) only (`truth` from
/// [`answers_picked`] with the same `pick`).
#[allow(clippy::too_many_arguments)]
pub fn check_picked(
    truth: &[Answer],
    family: Family,
    lied: &[u8],
    g: &[u8],
    dir: &Path,
    provenance: bool,
    profiles: &[(&str, Profile)],
    pick: Pick,
) -> Checked {
    let mut truth = truth.to_vec();
    let mut l = answers_picked(family, lied, g, dir, profiles, pick);
    if provenance {
        for (_, o) in truth.iter_mut().chain(l.iter_mut()) {
            if let Outcome::Report(r) = o {
                *r = without_provenance(r);
            }
        }
    }
    Checked {
        failures: compare(&truth, &l),
        answered: truth
            .iter()
            .zip(&l)
            .filter(|((_, t), (_, x))| matches!(x, Outcome::Report(_)) && t == x)
            .count(),
        refused: truth
            .iter()
            .zip(&l)
            .filter(|((_, t), (_, x))| matches!(t, Outcome::Report(_)) && matches!(x, Outcome::Error(_)))
            .count(),
    }
}

/// The cross baselines of the gate family: with F blessed, F′ gated
/// against F's baseline, and with F′ blessed, F gated against F′'s; each
/// must give what F against its own baseline gives, or an error (with
/// `provenance`, compared [`without_provenance`]). Returns the failures.
pub fn cross_baselines(
    f: &[u8],
    lied: &[u8],
    dir: &Path,
    profiles: &[(&str, Profile)],
    provenance: bool,
) -> Vec<String> {
    let fp = dir.join("f.bin");
    let bp = dir.join("blessed.json");
    // Blesses `blessed` into `bp`, then gates `gated` against it (both as `f.bin`).
    let run = |blessed: &[u8], gated: &[u8], p: &Profile| -> Outcome {
        let _ = std::fs::remove_file(&bp);
        put(&fp, blessed);
        let blessing = run(|| {
            let t = Trace::open_verified(&fp).map_err(|e| e.to_string())?;
            Baseline::of(&t)
                .and_then(|b| b.write(&bp))
                .map(|_| String::new())
                .map_err(|e| e.to_string())
        });
        if !matches!(blessing, Outcome::Report(_)) {
            return blessing;
        }
        put(&fp, gated);
        run(|| {
            let ct = Trace::open(&fp).map_err(|e| e.to_string())?;
            gate_text(against_baseline_with(&bp, &ct, p, false, Verification::OnUse))
        })
    };
    let mut truth = Vec::new();
    let mut lies = Vec::new();
    for (name, p) in profiles {
        let t = run(f, f, p);
        for (what, o) in [
            ("F′ against blessed F", run(f, lied, p)),
            ("F against blessed F′", run(lied, f, p)),
        ] {
            truth.push((format!("gate {name}: {what}"), t.clone()));
            lies.push((format!("gate {name}: {what}"), o));
        }
    }
    if provenance {
        for (_, o) in truth.iter_mut().chain(lies.iter_mut()) {
            if let Outcome::Report(r) = o {
                *r = without_provenance(r);
            }
        }
    }
    compare(&truth, &lies)
}

/// A trace F and another trace G to compare it with (both version 2, or
/// both 3).
#[derive(Debug, Clone)]
pub struct Fixture {
    /// What it is for.
    pub name: &'static str,
    /// The trace under test.
    pub f: Vec<u8>,
    /// The other side of diffs and gates.
    pub g: Vec<u8>,
}

/// Sets the f32 value(s) of every record with `path` (all steps).
fn set_f32(spec: &mut TraceSpec, path: &str, v: f32) {
    for r in spec.records.iter_mut().filter(|r| &*r.coord.path == path) {
        r.bytes = v.to_le_bytes().repeat(r.bytes.len() / 4);
    }
}

/// Writes `spec` with the project's writer and returns its bytes.
pub fn written(spec: &TraceSpec, dir: &Path, name: &str) -> Vec<u8> {
    let p = dir.join(name);
    if let Err(e) = spec.write(&p) {
        panic!("the writer refused a fixture: {e}");
    }
    match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) => panic!("cannot read {}: {e}", p.display()),
    }
}

/// The base content of the fixtures: a generated run of 3 steps, version 2, BLAKE3, capturing L0, L1, L3
/// and L4 (no L2, so that a lie can claim it), payloads at L0, L1 and L3
/// (L4 fingerprint-only except its small records).
pub fn base_spec() -> TraceSpec {
    for data in crate::seeds::inputs(0x11e5, 1000) {
        let mut u = Unstructured::new(&data);
        let Ok(mut s) = TraceSpec::generate(
            &mut u,
            GenOptions {
                levels: LevelSet::of_mask(0b11011),
                ..GenOptions::default()
            },
        ) else {
            continue;
        };
        s.version = 2;
        s.alg = moeconf_fingerprint::Algorithm::Blake3;
        s.header.binding.capture = moeconf_schema::CaptureSpec {
            levels: LevelSet::of_mask(0b11011),
            payload_levels: LevelSet::of_mask(0b01011),
        };
        s.records.retain(|r| r.level != Level::L2);
        let steps = s.records.iter().map(|r| r.coord.step).max().unwrap_or(0) + 1;
        let vocab_ok = s
            .records
            .iter()
            .any(|r| &*r.coord.path == Component::LmLogits.path() && r.shape == [4]);
        if steps == 3 && vocab_ok {
            return s;
        }
    }
    panic!("no seed gives the fixture's shape")
}

/// The fixtures: `near-tie` (F's `lm.margin` is 0.01 at every step, G's
/// step-0 token differs: a near-tie under the near-tie policy, a failure
/// under strict) and `far` (F's margin is 3: the same flip fails every
/// policy), plus `same` (G holds F's records: equivalent, pass).
pub fn fixtures(dir: &Path) -> Vec<Fixture> {
    let mut out = Vec::new();
    // Version 2 (levels read from step blocks) and 3 (committed in the
    // root block): the same records, so the same answers.
    for (version, names) in [
        (2, ["near-tie", "far", "same"]),
        (3, ["near-tie v3", "far v3", "same v3"]),
    ] {
        let mut base = base_spec();
        base.version = version;
        for (name, margin) in [(names[0], 0.01f32), (names[1], 3.0)] {
            let mut f = base.clone();
            set_f32(&mut f, Component::LmMargin.path(), margin);
            let mut g = f.clone();
            for r in g
                .records
                .iter_mut()
                .filter(|r| &*r.coord.path == Component::TokenOutput.path() && r.coord.step == 0)
            {
                let id = i32::from_le_bytes([r.bytes[0], r.bytes[1], r.bytes[2], r.bytes[3]]);
                r.bytes = ((id + 1) % 4).to_le_bytes().to_vec();
            }
            out.push(Fixture {
                name,
                f: written(&f, dir, "fixture-f.bin"),
                g: written(&g, dir, "fixture-g.bin"),
            });
        }
        let f = written(&base, dir, "fixture-f.bin");
        out.push(Fixture {
            name: names[2],
            g: f.clone(),
            f,
        });
    }
    out
}

/// The concrete lies the default suite applies to a fixture, per class
/// (each a list applied together). Indices are the fixtures' (3 steps of
/// 17 records at L0, L1, L3, L4; no L2).
pub fn lies_of(class: LieClass, f: &[u8]) -> Vec<Vec<Lie>> {
    let chunks = Model::decode(f).map(|m| m.chunks()).unwrap_or(1);
    let share = |step: usize, a: Component, b: Component| Lie::ShareOrdinalOf {
        step,
        a: a.path().into(),
        b: b.path().into(),
    };
    let level = |step: usize, level: Level, count: u64, groups: bool, trailer: bool| Lie::LevelRecords {
        step,
        level,
        count,
        groups,
        trailer,
    };
    match class {
        LieClass::Ordinals => vec![
            vec![share(0, Component::LmMargin, Component::TokenOutput)],
            vec![share(0, Component::TokenOutput, Component::LmMargin)],
            vec![share(1, Component::TokenOutput, Component::LmMargin)],
            vec![share(0, Component::TokenInput, Component::LayerPostFfnMhc)],
            vec![Lie::ShareOrdinal { step: 1, a: 0, b: 10 }],
            vec![Lie::ShareOrdinal { step: 2, a: 16, b: 3 }],
            vec![Lie::PermuteOrdinals { step: 0, by: 1 }],
            vec![Lie::PermuteOrdinals { step: 1, by: 7 }],
            vec![Lie::PermuteOrdinals { step: 2, by: 16 }],
            vec![Lie::SwapAcrossGroups { step: 0, a: 0, b: 1 }],
            vec![Lie::SwapAcrossGroups { step: 1, a: 0, b: 3 }],
            vec![Lie::SwapAcrossGroups { step: 2, a: 1, b: 2 }],
        ],
        LieClass::Counts => vec![
            // Claim L2 records that do not exist (step 0; every step).
            vec![level(0, Level::L2, 5, true, true)],
            (0..3).map(|s| level(s, Level::L2, 9, true, true)).collect(),
            vec![level(0, Level::L2, 5, false, false)],
            // Drop a level that exists.
            vec![level(0, Level::L1, 0, true, true)],
            vec![level(1, Level::L1, 0, false, true)],
            vec![level(2, Level::L4, 0, true, true)],
            (0..3).map(|s| level(s, Level::L3, 0, true, true)).collect(),
            // Change a count.
            vec![level(1, Level::L0, 4, true, true)],
            vec![level(1, Level::L0, 2, false, true)],
            vec![level(2, Level::L3, 9, true, false)],
            vec![level(0, Level::L0, 30, true, true)],
            // A group's count alone.
            vec![Lie::GroupRecords {
                step: 0,
                group: 0,
                count: 7,
            }],
            vec![Lie::GroupRecords {
                step: 2,
                group: 3,
                count: 1,
            }],
            // Version 3: a level digest of the root block taken from
            // another step, made up where the step holds none (claiming
            // L2), or zeroed (dropping L1); the counts follow. No-ops in
            // version 2.
            vec![Lie::LevelDigest {
                step: 0,
                level: Level::L3,
                from: 1,
            }],
            vec![Lie::LevelDigest {
                step: 1,
                level: Level::L2,
                from: 1,
            }],
            (0..3)
                .map(|s| Lie::LevelDigest {
                    step: s,
                    level: Level::L2,
                    from: s,
                })
                .collect(),
            vec![
                Lie::LevelDigest {
                    step: 2,
                    level: Level::L1,
                    from: 2,
                },
                Lie::LevelDigest {
                    step: 2,
                    level: Level::L1,
                    from: 2,
                },
            ],
            vec![Lie::LevelDigest {
                step: 2,
                level: Level::L4,
                from: 0,
            }],
        ],
        LieClass::Layout => vec![
            vec![Lie::Pad { chunk: 0, blocks: 1 }],
            vec![Lie::Pad { chunk: 3, blocks: 2 }],
            vec![Lie::Pad { chunk: 20, blocks: 1 }],
            vec![Lie::Pad {
                chunk: chunks / 2,
                blocks: 4,
            }],
            vec![Lie::Pad {
                chunk: chunks.saturating_sub(1),
                blocks: 1,
            }],
            vec![Lie::ReorderPayloads { step: 0, by: 1 }],
            vec![Lie::ReorderPayloads { step: 1, by: 5 }],
            vec![Lie::ReorderPayloads { step: 2, by: 16 }],
            vec![
                Lie::ReorderPayloads { step: 0, by: 2 },
                Lie::Pad { chunk: 7, blocks: 3 },
            ],
        ],
        LieClass::Trailer => vec![
            vec![Lie::RecordCount { count: 0 }],
            vec![Lie::RecordCount { count: 50 }],
            vec![Lie::RecordCount { count: 52 }],
            vec![Lie::RecordCount { count: 80 }],
        ],
        LieClass::Provenance => vec![
            vec![Lie::Provenance {
                runtime: LIAR.into(),
                threads: LIAR_THREADS,
            }],
            vec![Lie::Provenance {
                runtime: LIAR.repeat(9),
                threads: LIAR_THREADS,
            }],
        ],
        // No-ops on the fixtures (too small to be paged); the paged lies
        // run on `crate::paged`'s traces.
        LieClass::Pages => vec![
            vec![Lie::Page {
                step: 0,
                group: 0,
                lie: crate::lies::PageLie::Cv(0),
            }],
            vec![Lie::Page {
                step: 0,
                group: 0,
                lie: crate::lies::PageLie::Missing,
            }],
        ],
    }
}

/// The runtime name of the provenance lies.
pub const LIAR: &str = "liar-runtime";
/// The thread count of the provenance lies.
pub const LIAR_THREADS: u32 = 77;

/// Makes reports of traces that differ only in provenance (runtime name,
/// thread count, hence header and file length) comparable: the provenance
/// is not under the root and `inspect` prints it, so it is the one thing a
/// report may show differently.
pub fn without_provenance(report: &str) -> String {
    // The JSON part of a report starts at its first line that is `{`.
    let (text, json) = if report.starts_with("{\n") {
        ("", Some(report))
    } else {
        match report.find("\n{\n") {
            Some(i) => (&report[..i + 1], Some(&report[i + 1..])),
            None => (report, None),
        }
    };
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("bytes ")
            || t.starts_with("file ")
            || t.starts_with("output ")
            || line.contains("provenance.")
        {
            // convert: the output's length and bytes (`output `: as the
            // binary's test prints them), which hold the provenance; diff:
            // a noted provenance difference.
            continue;
        }
        let line = if t.starts_with("trace ") {
            // inspect's first line: the file's size.
            "trace _".to_string()
        } else {
            normalize_runtime(line)
        };
        out.push_str(&line);
        out.push('\n');
    }
    if let Some(json) = json {
        match serde_json::from_str::<serde_json::Value>(json) {
            Ok(mut v) => {
                strip_provenance(&mut v);
                out.push_str(&format!("{v:#}"));
            }
            Err(_) => out.push_str(&normalize_runtime(json)),
        }
    }
    out
}

fn normalize_runtime(s: &str) -> String {
    // Most strings name neither: no copy per pattern (this ran for every
    // line and JSON string of every report, half of a fuzz execution).
    if !(s.contains(LIAR) || s.contains("moeconf-testkit") || s.contains(" threads")) {
        return s.to_string();
    }
    let mut s = s.to_string();
    for n in (1..=9).rev() {
        s = s.replace(&LIAR.repeat(n), "_");
    }
    s.replace("moeconf-testkit", "_")
        .replace("moeconf-testkit", "_")
        .replace(&format!(" {LIAR_THREADS} threads"), " _ threads")
        .replace(" 0 threads", " _ threads")
}

/// Removes from a report's JSON what the provenance decides: the file's
/// length, the runtime and thread count, and every listed difference of a
/// `provenance.*` field.
fn strip_provenance(v: &mut serde_json::Value) {
    use serde_json::Value;
    let mentions = |x: &Value| match x {
        Value::Object(o) => o
            .values()
            .any(|y| y.as_str().is_some_and(|s| s.starts_with("provenance."))),
        Value::String(s) => s.starts_with("provenance."),
        _ => false,
    };
    match v {
        Value::Object(o) => {
            for k in ["file_bytes", "runtime", "threads"] {
                if o.contains_key(k) {
                    o.insert(k.into(), Value::Null);
                }
            }
            o.values_mut().for_each(strip_provenance);
        }
        Value::Array(a) => {
            a.retain(|x| !mentions(x));
            a.iter_mut().for_each(strip_provenance);
        }
        Value::String(s) => *s = normalize_runtime(s),
        _ => {}
    }
}

/// What one check of a class against a family found.
#[derive(Debug, Default)]
pub struct Findings {
    /// Lies that rewrote something, over every fixture.
    pub applied: usize,
    /// Lies for which every answer held.
    pub held: usize,
    /// Answers of lies that were F's report (not an error), over every lie.
    pub answered: usize,
    /// Every oracle failure, naming the fixture, the lie and the command.
    pub failures: Vec<String>,
}

/// Applies every lie of `class` ([`lies_of`]) to every fixture's F and
/// runs `family` on F and F′.
pub fn check_class(class: LieClass, family: Family, dir: &Path) -> Findings {
    let mut found = Findings::default();
    let all = profiles();
    for fx in fixtures(dir) {
        // Only diff and gate read G; the fixtures' F differ in one L1
        // value, so the single-trace commands need only the first.
        if !matches!(family, Family::Diff | Family::Gate) && fx.name != "near-tie" {
            continue;
        }
        let truth = answers_under(family, &fx.f, &fx.g, dir, &all);
        for lies in lies_of(class, &fx.f) {
            let lied = match lie(&fx.f, &lies) {
                Ok(Some(b)) => b,
                Ok(None) => continue,
                Err(e) => panic!("the rewriter failed on fixture {}: {e}", fx.name),
            };
            found.applied += 1;
            let bad = check_against(
                &truth,
                family,
                &lied,
                &fx.g,
                dir,
                class == LieClass::Provenance,
                &all,
            );
            let mut bad = bad;
            if family == Family::Gate {
                let provenance = class == LieClass::Provenance;
                bad.failures
                    .extend(cross_baselines(&fx.f, &lied, dir, &all, provenance));
            }
            found.held += usize::from(bad.failures.is_empty());
            found.answered += bad.answered;
            for b in bad.failures {
                found.failures.push(format!("[{}] {:?}: {b}", fx.name, lies));
            }
        }
    }
    found
}
