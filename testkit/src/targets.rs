//! The bodies of the consumer fuzz targets (`fuzz/fuzz_targets/*.rs`), also
//! run on deterministic seeds by the default test suite
//! (`testkit/tests/consumers.rs`). Each draws its inputs from `data`, runs
//! one consumer, and asserts the oracles of docs/performance.md ("Fuzzing
//! the consumers"); a failed oracle panics, which libFuzzer reports as a
//! crash. `dir` is a scratch directory the body may overwrite.

use crate::gen::{GenOptions, TraceSpec};
use crate::metamorphic;
use crate::mutate::{
    all_records, flip_bit_in, flip_payload_bit, held_levels, mutate, read_ranges, record_keys,
    record_keys_at, unread_payloads,
};
use arbitrary::{Result, Unstructured};
use moeconf_bisect::{diff, open_pair, open_pair_with, DiffOptions, DiffReport, Verdict};
use moeconf_fingerprint::{Component, Level, LevelSet};
use moeconf_gate::baseline::Baseline;
use moeconf_gate::policy::{resolve, Mode, Profile};
use moeconf_gate::{against_baseline, against_reference, against_reference_with, GateError, GateReport};
use moeconf_schema::{Trace, Verification};
use std::path::{Path, PathBuf};

/// What one execution of a target body reached (bits), so that the
/// seeded tests can check that the oracles are exercised, not skipped.
pub type Seen = u32;
/// A verdict (or report) was produced for the candidate.
pub const VERDICT: Seen = 1;
/// The candidate held the same records as the reference and the oracle ran.
pub const SAME: Seen = 2;
/// The candidate held different records and the oracle ran.
pub const DIFFERENT: Seen = 4;
/// A flipped payload bit was checked.
pub const FLIP: Seen = 8;
/// A passing (or equivalent, or certified, or imported) result was seen.
pub const PASSED: Seen = 16;
/// A failing (divergent) result or an error was seen.
pub const REFUSED: Seen = 32;
/// A flipped byte of a tree node (root, step or group block) the command
/// read was checked (format version 2): an error.
pub const NODE: Seen = 64;
/// A flipped byte of a payload the command did not read was checked
/// (format version 2): the same answer.
pub const UNREAD: Seen = 128;

/// Writes `spec` to `dir/name`; `None` when the writer refuses it.
fn write(spec: &TraceSpec, dir: &Path, name: &str) -> Option<PathBuf> {
    let p = dir.join(name);
    spec.write(&p).ok().map(|_| p)
}

/// Writes a generated (never mutated) spec: the writer must accept it and
/// its reader must accept what it wrote, payloads included.
fn write_valid(spec: &TraceSpec, dir: &Path, name: &str) -> (PathBuf, Trace) {
    let p = dir.join(name);
    if let Err(e) = spec.write(&p) {
        panic!("the writer refused a generated trace: {e}");
    }
    match Trace::open_verified(&p) {
        Ok(t) => (p, t),
        Err(e) => panic!("the reader refused what the writer wrote: {e}"),
    }
}

/// The trace at `path` with one payload bit flipped, written to
/// `dir/flipped.bin`; `None` when it keeps no payload byte.
fn flipped(u: &mut Unstructured<'_>, path: &Path, dir: &Path) -> Result<Option<(PathBuf, Trace, usize)>> {
    let (Ok(mut bytes), Ok(t)) = (std::fs::read(path), Trace::open(path)) else {
        return Ok(None);
    };
    let Some(i) = flip_payload_bit(u, &t, &mut bytes)? else {
        return Ok(None);
    };
    let out = dir.join("flipped.bin");
    if std::fs::write(&out, &bytes).is_err() {
        return Ok(None);
    }
    let Ok(ft) = Trace::from_bytes(&out, bytes) else {
        panic!("a flipped payload bit made the index or trailer invalid: payloads must only be covered by their digests")
    };
    Ok(Some((out, ft, i)))
}

/// `diff`: the candidate is the reference's content, mutated 0–3 times.
/// Oracles: both files open verified; the same records are equivalent
/// (an error only when a refusing binding field differs and no `--force`);
/// different records are never equivalent; a trace against itself is
/// equivalent; one flipped payload bit of either side is an error of
/// [`open_pair`]. Read on use (what `moeconf diff` does): the answer is the
/// fully verified one; a flipped bit of a payload or tree node the diff
/// read is an error; a flipped bit of a payload it did not read of a
/// version 2 trace leaves the answer as it was (version 1 is verified in
/// full, so any flip is an error).
pub fn diff_case(data: &[u8], dir: &Path) -> Seen {
    let mut seen = 0;
    let _ = diff_body(&mut Unstructured::new(data), dir, &mut seen);
    seen
}

/// A diff's answer, comparable: the report's JSON (with the traces' paths
/// left out; JSON, because a NaN value is not equal to itself) or the
/// error's text.
fn answer(
    r: std::result::Result<DiffReport, moeconf_bisect::BisectError>,
) -> std::result::Result<serde_json::Value, String> {
    r.map(|mut d| {
        d.reference.path.clear();
        d.candidate.path.clear();
        d.to_json()
    })
    .map_err(|e| e.to_string())
}

/// The answer of diffing the files at `r` and `c`, both opened on use.
fn diff_on_use(r: &Path, c: &Path, opts: &DiffOptions) -> std::result::Result<serde_json::Value, String> {
    let (rt, ct) = open_pair_with(r, c, Verification::OnUse).map_err(|e| e.to_string())?;
    answer(diff(&rt, &ct, opts))
}

fn diff_body(u: &mut Unstructured<'_>, dir: &Path, seen: &mut Seen) -> Result<()> {
    let r = TraceSpec::generate(u, GenOptions::default())?;
    let c = mutate(u, &r)?;
    let (rp, rt) = write_valid(&r, dir, "ref.bin");
    let Some(cp) = write(&c, dir, "cand.bin") else {
        return Ok(());
    };
    let (rt2, ct) = match open_pair(&rp, &cp) {
        Ok(p) => p,
        Err(e) => panic!("open_pair refused what the writer wrote: {e}"),
    };
    let opts = DiffOptions {
        force: u.arbitrary()?,
        contract_inference: u.arbitrary()?,
    };
    if !rt.is_empty() {
        let own = diff(&rt, &rt2, &opts).map(|d| d.verdict);
        assert!(
            matches!(own, Ok(Verdict::Equivalent)),
            "a trace against itself: {own:?}"
        );
    }
    let same = record_keys(&rt) == record_keys(&ct);
    let full = diff(&rt, &ct, &opts);
    let full_answer = match &full {
        Ok(d) => answer(Ok(d.clone())),
        Err(e) => Err(e.to_string()),
    };
    match full {
        Ok(rep) => {
            *seen |= VERDICT | if same { SAME | PASSED } else { DIFFERENT | REFUSED };
            let _ = (rep.to_json(), rep.render_text(false), rep.render_text(true));
            check_incomplete(&rep, &rt, &ct);
            assert_eq!(
                rep.verdict == Verdict::Equivalent,
                same,
                "verdict {:?} but the traces hold {} records\n{}",
                rep.verdict,
                if same { "the same" } else { "different" },
                rep.render_text(true)
            );
        }
        Err(e) => {
            *seen |= REFUSED;
            let refusing = r.header.binding.prompt != c.header.binding.prompt && !opts.force;
            assert!(
                !same || refusing || rt.is_empty(),
                "the same records, no refusing difference, yet an error: {e}"
            );
        }
    }
    // Read on use: the same answer, from what it read.
    let (lr, lc) = match open_pair_with(&rp, &cp, Verification::OnUse) {
        Ok(p) => p,
        Err(e) => panic!("opening on use refused what the writer wrote: {e}"),
    };
    let lazy = answer(diff(&lr, &lc, &opts));
    assert_eq!(lazy, full_answer, "reading on use changed the answer");
    if u.arbitrary()? {
        if let Some((fp, _, _)) = flipped(u, &rp, dir)? {
            assert!(open_pair(&fp, &cp).is_err(), "flipped reference payload accepted");
            *seen |= FLIP;
        }
    } else if let Some((fp, _, _)) = flipped(u, &cp, dir)? {
        assert!(open_pair(&rp, &fp).is_err(), "flipped candidate payload accepted");
        *seen |= FLIP;
    }
    // One flipped bit where the diff read (a payload or a node) or, of a
    // version 2 trace, in a payload it did not read.
    let reference_side = u.arbitrary::<bool>()?;
    let (path, t, full_t) = if reference_side {
        (&rp, &lr, &rt)
    } else {
        (&cp, &lc, &ct)
    };
    let (blocks, payloads) = read_ranges(t);
    let Ok(mut bytes) = std::fs::read(path) else {
        return Ok(());
    };
    let kind = u.int_in_range(0..=2u8)?;
    let ranges = match kind {
        0 => payloads.clone(),
        1 => blocks,
        _ => unread_payloads(all_records(full_t), &payloads),
    };
    let Some(at) = flip_bit_in(u, &mut bytes, &ranges)? else {
        return Ok(());
    };
    let bad = dir.join("flipped-on-use.bin");
    if std::fs::write(&bad, &bytes).is_err() {
        return Ok(());
    }
    let (a, b) = if reference_side { (&bad, &cp) } else { (&rp, &bad) };
    let got = diff_on_use(a, b, &opts);
    if kind < 2 || t.format_version() == 1 {
        assert!(
            got.is_err(),
            "a flipped bit at byte {at} of a {} the diff read was accepted (version {})",
            if kind == 0 { "payload" } else { "tree node" },
            t.format_version()
        );
        if kind == 1 {
            *seen |= NODE;
        }
    } else {
        assert_eq!(
            got, lazy,
            "a flipped bit at byte {at} of a payload the diff did not read changed its answer"
        );
        *seen |= UNREAD;
    }
    Ok(())
}

/// Whether `t` holds a record at every step 0..max_new_tokens, from the
/// records' own coordinates (not the root's step list, which the report's
/// completeness uses): the two must agree.
fn complete_by_records(t: &Trace) -> bool {
    let n = t.binding().decoding.max_new_tokens;
    let held: std::collections::BTreeSet<u32> = all_records(t).iter().map(|e| e.coord.step).collect();
    n > 0 && (0..n).all(|s| held.contains(&s))
}

/// The diff report lists exactly the sides that lack a step of their run.
fn check_incomplete(rep: &DiffReport, reference: &Trace, candidate: &Trace) {
    for (side, t) in [("reference", reference), ("candidate", candidate)] {
        assert_eq!(
            rep.incomplete.iter().any(|i| i.side == side),
            !complete_by_records(t),
            "{side} listed as incomplete or not against its records' steps: {:?}",
            rep.incomplete
        );
    }
}

/// Whether a gate result passes.
fn passes(r: &std::result::Result<GateReport, GateError>) -> bool {
    r.as_ref().is_ok_and(|rep| rep.verdict.passes())
}

/// Renders every report format (none may panic).
fn render(r: &std::result::Result<GateReport, GateError>) {
    match r {
        Ok(rep) => {
            let _ = (
                rep.to_json(),
                rep.render_text(),
                moeconf_gate::report_junit::render(rep),
                moeconf_gate::report_md::render(rep),
            );
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// The expectation of a gate of a trace (or its baseline) against itself
/// under `p`: it passes exactly when the trace holds records and every
/// level the profile requires.
fn check_self(name: &str, t: &Trace, p: &Profile, got: &std::result::Result<GateReport, GateError>) {
    let held = held_levels(t);
    let required = p.required_levels(held);
    let should_pass = !held.is_empty() && required.intersection(held) == required;
    assert_eq!(
        passes(got),
        should_pass,
        "{name} against itself under {p:?}: {:?}",
        got.as_ref().map(|r| r.render_text())
    );
}

/// `gate`: a drawn policy, the reference against itself (trace and blessed
/// baseline), the mutated candidate against both, and flipped payload bits.
/// Oracles: against itself (and a candidate with the same generated
/// content, in another file) the gate passes exactly when the trace is
/// non-empty and holds every required level; when every level the
/// reference holds is judged bitwise (trace) or not `info` (baseline), a
/// candidate whose records at those levels differ never passes; one flipped
/// payload bit of either side is an error.
pub fn gate_case(data: &[u8], dir: &Path) -> Seen {
    let mut seen = 0;
    let _ = gate_body(&mut Unstructured::new(data), dir, &mut seen);
    seen
}

fn gate_body(u: &mut Unstructured<'_>, dir: &Path, seen: &mut Seen) -> Result<()> {
    let r = TraceSpec::generate(u, GenOptions::default())?;
    let c = mutate(u, &r)?;
    let (rp, rt) = write_valid(&r, dir, "ref.bin");
    let o = crate::policy::overrides(u, dir)?;
    let Ok((p, _)) = resolve(&o, dir) else {
        return Ok(());
    };
    let own = against_reference(&rp, &rt, &p, false);
    render(&own);
    check_self("trace", &rt, &p, &own);
    *seen |= SAME | if passes(&own) { PASSED } else { REFUSED };
    let bp = dir.join("baseline.json");
    let blessed = !rt.is_empty() && Baseline::of(&rt).and_then(|b| b.write(&bp)).is_ok();
    if blessed {
        let own = against_baseline(&bp, &rt, &p, false);
        render(&own);
        check_self("baseline", &rt, &p, &own);
    }
    let Some(cp) = write(&c, dir, "cand.bin") else {
        return Ok(());
    };
    let ct = match Trace::open(&cp) {
        Ok(t) => t,
        Err(e) => panic!("the reader refused what the writer wrote: {e}"),
    };
    let force = u.arbitrary()?;
    let held = held_levels(&rt);
    let differs = record_keys_at(&rt, held) != record_keys_at(&ct, held);
    let got = against_reference(&rp, &ct, &p, force);
    render(&got);
    if let Ok(rep) = &got {
        for (side, t) in [("reference", &rt), ("candidate", &ct)] {
            assert_eq!(
                rep.incomplete.iter().any(|i| i.side == side),
                !complete_by_records(t),
                "gate: {side} listed as incomplete or not against its records' steps: {:?}",
                rep.incomplete
            );
        }
    }
    if c == r {
        // The same generated content in another file: judged as the trace itself.
        check_self("an identical candidate", &rt, &p, &got);
    }
    let all = |ok: &dyn Fn(Mode) -> bool| held.iter().all(|l| ok(p.levels[l.code() as usize]));
    if differs && all(&|m| m == Mode::Bitwise) {
        assert!(!passes(&got), "a differing candidate passed a bitwise gate");
        *seen |= DIFFERENT;
    }
    *seen |= VERDICT;
    if blessed {
        let got = against_baseline(&bp, &ct, &p, force);
        render(&got);
        if c == r {
            check_self("an identical candidate against the baseline", &rt, &p, &got);
        }
        if differs && all(&|m| m != Mode::Info) {
            assert!(!passes(&got), "a differing candidate passed a baseline gate");
        }
    }
    // Read on use (what `moeconf gate` does): the same report; a flipped bit
    // of a candidate payload or node the gate read is an error.
    let lazy_c = match Trace::open(&cp) {
        Ok(t) => t,
        Err(e) => panic!("the reader refused what the writer wrote: {e}"),
    };
    let lazy = against_reference_with(&rp, &lazy_c, &p, force, Verification::OnUse);
    let text = |r: &std::result::Result<GateReport, GateError>| match r {
        Ok(rep) => Ok(rep.to_json()),
        Err(e) => Err(e.to_string()),
    };
    assert_eq!(
        text(&lazy),
        text(&got),
        "reading on use changed the gate's answer"
    );
    let (blocks, payloads) = read_ranges(&lazy_c);
    let node = u.arbitrary::<bool>()?;
    if let Ok(mut bytes) = std::fs::read(&cp) {
        if let Some(at) = flip_bit_in(u, &mut bytes, if node { &blocks } else { &payloads })? {
            let bad = dir.join("flipped-on-use.bin");
            if std::fs::write(&bad, &bytes).is_ok() {
                let r = Trace::open(&bad)
                    .map_err(GateError::Candidate)
                    .and_then(|t| against_reference_with(&rp, &t, &p, force, Verification::OnUse));
                assert!(
                    r.is_err(),
                    "a flipped bit at byte {at} of a candidate {} the gate read was accepted",
                    if node { "tree node" } else { "payload" }
                );
                if node {
                    *seen |= NODE;
                }
            }
        }
    }
    if u.arbitrary()? {
        if let Some((fp, _, _)) = flipped(u, &rp, dir)? {
            assert!(
                against_reference(&fp, &ct, &p, force).is_err(),
                "flipped reference payload accepted"
            );
            *seen |= FLIP;
        }
    } else if let Some((_, ft, _)) = flipped(u, &cp, dir)? {
        assert!(
            against_reference(&rp, &ft, &p, force).is_err(),
            "flipped candidate payload accepted"
        );
        *seen |= FLIP;
        if blessed {
            assert!(
                against_baseline(&bp, &ft, &p, force).is_err(),
                "flipped candidate accepted by a baseline"
            );
        }
    }
    Ok(())
}

/// `certify`: a trace that always captures L4 with payloads, 1–3 drawn
/// contract families and small work limits. Oracles: every event is
/// certified or counted as skipped; one flipped payload bit is an error of
/// the verified open, and of `certify` itself when it lies in a routed
/// term or shared output of an event that keeps all its payloads.
pub fn certify_case(data: &[u8], dir: &Path) -> Seen {
    let mut seen = 0;
    let _ = certify_body(&mut Unstructured::new(data), dir, &mut seen);
    seen
}

const FAMILIES: [&str; 8] = [
    "c",
    "a",
    "b",
    "p32",
    "native",
    "c+shape=tree",
    "exact+operand=f32",
    "b+order=class:1",
];

fn certify_body(u: &mut Unstructured<'_>, dir: &Path, seen: &mut Seen) -> Result<()> {
    use moeconf_bisect::{certify_within, CertifyLimits, Family};
    let spec = TraceSpec::generate(
        u,
        GenOptions {
            levels: LevelSet::EMPTY.with(Level::L4),
            ..GenOptions::default()
        },
    )?;
    let spec = if u.ratio(1, 4)? { mutate(u, &spec)? } else { spec };
    let Some(path) = write(&spec, dir, "full.bin") else {
        return Ok(());
    };
    let t = match Trace::open_verified(&path) {
        Ok(t) => t,
        Err(e) => panic!("the reader refused what the writer wrote: {e}"),
    };
    let mut families = Vec::new();
    for _ in 0..u.int_in_range(1..=3)? {
        let name = *u.choose(&FAMILIES)?;
        if let Ok(contract) = moeconf_contract::AggregationContract::parse(name) {
            families.push(Family {
                name: name.into(),
                contract,
            });
        }
    }
    let limits = CertifyLimits {
        max_event_work: *u.choose(&[1 << 6, 1 << 10, 1 << 14])?,
        max_total_work: *u.choose(&[1 << 8, 1 << 12, 1 << 16])?,
    };
    let events = moe_events(&t);
    match certify_within(&t, &families, limits) {
        Ok(rep) => {
            let _ = (rep.to_json(), rep.render_text(false), rep.render_text(true));
            assert_eq!(rep.rows.len() + rep.without_payload, events.len(), "events lost");
            *seen |= VERDICT | PASSED;
        }
        Err(e) => {
            let _ = e.to_string();
            *seen |= REFUSED;
        }
    }
    if let Some((_, ft, i)) = flipped(u, &path, dir)? {
        assert!(ft.verify_payloads().is_err(), "flipped payload verified");
        let Ok(Some(e)) = ft.load_record(i) else {
            panic!("record {i} of a trace with a flipped payload bit is unreadable")
        };
        let key = (e.coord.step, e.coord.position, e.coord.layer);
        let in_event = Component::parse(&e.coord.path)
            .is_some_and(|(c, _)| matches!(c, Component::MoeTerm | Component::MoeShared));
        let complete = events.iter().any(|(k, all)| *k == key && *all);
        if in_event && complete {
            assert!(
                certify_within(&ft, &families, limits).is_err(),
                "certify used a flipped payload"
            );
            *seen |= FLIP;
        }
    }
    Ok(())
}

/// A MoE event's (step, position, layer).
type EventKey = (u32, u32, Option<u32>);

/// The MoE events of a trace (step, position, layer) and whether every
/// routed term and shared output of each keeps its payload.
fn moe_events(t: &Trace) -> Vec<(EventKey, bool)> {
    let mut out: Vec<(EventKey, bool)> = Vec::new();
    for e in all_records(t) {
        let Some((c, _)) = Component::parse(&e.coord.path) else {
            continue;
        };
        if !matches!(c, Component::MoeTerm | Component::MoeShared) || e.coord.layer.is_none() {
            continue;
        }
        let key = (e.coord.step, e.coord.position, e.coord.layer);
        let has = e.payload.is_some();
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, all)) => *all &= has,
            None => out.push((key, has)),
        }
    }
    out
}

/// `import`: the generated records dumped as safetensors files by the
/// naming convention of docs/import.md, with a manifest, sometimes with one
/// drawn byte of a dump file or the manifest changed. Oracles: an unchanged
/// dump imports, and the imported trace holds exactly the records (same
/// coordinates, levels and digests) the writer wrote directly; whatever
/// `import` accepts, the reader accepts with every payload verified.
pub fn import_case(data: &[u8], dir: &Path) -> Seen {
    let mut seen = 0;
    let _ = import_body(&mut Unstructured::new(data), dir, &mut seen);
    seen
}

fn import_body(u: &mut Unstructured<'_>, dir: &Path, seen: &mut Seen) -> Result<()> {
    let spec = TraceSpec::generate(u, GenOptions::default())?;
    let (_, direct) = write_valid(&spec, dir, "direct.bin");
    let dump = dir.join("dump");
    let _ = std::fs::remove_dir_all(&dump);
    if std::fs::create_dir_all(&dump).is_err() {
        return Ok(());
    }
    crate::dump::write_dump(u, &spec, &dump)?;
    let changed = u.ratio(1, 3)? && crate::dump::corrupt(u, &dump)?;
    let out = dir.join("imported.bin");
    let opts = moeconf_schema::import::ImportOptions {
        input: dump,
        output: out.clone(),
        manifest: None,
        algorithm: spec.alg,
        canon: spec.header.binding.canon,
        payload_levels: LevelSet::of_mask(u.int_in_range(0..=31)?),
    };
    match moeconf_schema::import::import(&opts) {
        Ok(_) => {
            let t = match Trace::open_verified(&out) {
                Ok(t) => t,
                Err(e) => panic!("import wrote a trace its reader refuses: {e}"),
            };
            *seen |= VERDICT | PASSED;
            if !changed {
                assert_eq!(
                    record_keys(&t),
                    record_keys(&direct),
                    "import changed the records"
                );
                *seen |= SAME;
            }
            if let Some((_, ft, _)) = flipped(u, &out, dir)? {
                assert!(ft.verify_payloads().is_err(), "flipped imported payload verified");
                *seen |= FLIP;
            }
        }
        Err(e) => {
            assert!(changed, "an unchanged dump was refused: {e}");
            *seen |= REFUSED;
        }
    }
    Ok(())
}

/// `lies`: a generated trace F (format version 2), a candidate G mutated
/// from it, 1–3 drawn [`Lie`](crate::lies::Lie)s of the classes in
/// `classes` rewritten into F (every block digest, reference and checksum
/// recomputed: F′ is internally consistent), and one drawn command family
/// ([`metamorphic::Family`]) run on F and on F′. Oracle
/// ([`metamorphic::check`]): every answer F′ gets is F's answer or an
/// error, never another report, never a panic. The rewriter must accept
/// every trace the writer wrote.
pub fn lies_case(data: &[u8], dir: &Path) -> Seen {
    lies_case_of(data, dir, &crate::lies::LieClass::ALL)
}

/// [`lies_case`] with lies drawn only from `classes`.
pub fn lies_case_of(data: &[u8], dir: &Path, classes: &[crate::lies::LieClass]) -> Seen {
    let mut seen = 0;
    let _ = lies_body(&mut Unstructured::new(data), dir, classes, &mut seen);
    seen
}

/// The `lies` target's body: an odd first byte runs [`lies_paged_case`] on
/// the rest, anything else [`lies_case`] on the whole input (so inputs of
/// the small case found before the paged one keep their meaning when they
/// start with an even byte).
pub fn lies_target(data: &[u8], dir: &Path) -> Seen {
    match data.split_first() {
        Some((b, rest)) if b & 1 == 1 => lies_paged_case(rest, dir),
        _ => lies_case(data, dir),
    }
}

/// A lie of [`crate::lies::LieClass::Pages`] applied ([`lies_paged_case`]).
pub const PAGE_LIE: Seen = 256;
/// A lie of [`crate::lies::LieClass::Pages`] applied, and some answer of
/// the lie was F's report (the falsified page was not one the command
/// read, or the command read none).
pub const PAGE_LIE_ANSWERED: Seen = 512;

/// `lies` on paged traces (format version 4, docs/format.md §11.9): F is
/// one of the [`crate::paged`] bases (step 0's per-layer groups stored as
/// 2–3 pages), G one of its candidates (differing inside a page, at a
/// record two pages share, in every page, by a record fewer, or outside
/// the paged groups), both written once per process; 1–3 lies drawn from
/// [`crate::lies::LieClass::PAGED`] (the first a page lie one time in two:
/// a falsified page table entry, chaining value, page content, page
/// number, page order, or a record omitted, repeated or changed across a
/// page boundary) rewritten into F; one drawn case of one command family
/// on F and F′. Oracle as [`lies_case`].
pub fn lies_paged_case(data: &[u8], dir: &Path) -> Seen {
    lies_paged_case_of(data, dir, &crate::lies::LieClass::PAGED)
}

/// [`lies_paged_case`] with lies drawn only from `classes`.
pub fn lies_paged_case_of(data: &[u8], dir: &Path, classes: &[crate::lies::LieClass]) -> Seen {
    let mut seen = 0;
    let _ = lies_paged_body(&mut Unstructured::new(data), dir, classes, &mut seen);
    seen
}

fn lies_paged_body(
    u: &mut Unstructured<'_>,
    dir: &Path,
    classes: &[crate::lies::LieClass],
    seen: &mut Seen,
) -> Result<()> {
    use crate::lies::{Lie, LieClass};
    let b = u.choose_index(crate::paged::BASES)?;
    let c = u.choose_index(crate::paged::CANDIDATES)?;
    let f = crate::paged::base(b, dir);
    let g = crate::paged::candidate(b, c, dir);
    let mut lies = Vec::new();
    for i in 0..u.int_in_range(1..=3)? {
        let class = if i == 0 && classes.contains(&LieClass::Pages) && u.arbitrary()? {
            LieClass::Pages
        } else {
            *u.choose(classes)?
        };
        lies.push(Lie::draw_of(u, class)?);
    }
    judge(u, &f, &g, &lies, dir, Some((b, c)), seen)
}

/// F's answers of the paged case, by (scratch directory, base, candidate,
/// family, profile, case): F and G are the same bytes for the whole
/// process, so their answers are computed once (they are half the cost of
/// an execution).
type Truths = std::sync::Mutex<
    std::collections::HashMap<(PathBuf, usize, usize, String, String, usize), Vec<metamorphic::Answer>>,
>;

fn truth_of(
    key: Option<(usize, usize)>,
    family: metamorphic::Family,
    f_bytes: &[u8],
    g_bytes: &[u8],
    dir: &Path,
    profiles: &[(&str, Profile)],
    k: usize,
) -> Vec<metamorphic::Answer> {
    static TRUTHS: std::sync::OnceLock<Truths> = std::sync::OnceLock::new();
    let pick = metamorphic::Pick::One(k);
    let Some((b, c)) = key else {
        return metamorphic::answers_picked(family, f_bytes, g_bytes, dir, profiles, pick);
    };
    let profile = profiles.first().map(|p| p.0.to_string()).unwrap_or_default();
    let key = (dir.to_path_buf(), b, c, format!("{family:?}"), profile, k);
    let truths = TRUTHS.get_or_init(Default::default);
    if let Some(t) = truths.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return t;
    }
    let t = metamorphic::answers_picked(family, f_bytes, g_bytes, dir, profiles, pick);
    if let Ok(mut m) = truths.lock() {
        m.insert(key, t.clone());
    }
    t
}

fn lies_body(
    u: &mut Unstructured<'_>,
    dir: &Path,
    classes: &[crate::lies::LieClass],
    seen: &mut Seen,
) -> Result<()> {
    use crate::lies::Lie;
    let mut f = TraceSpec::generate(u, GenOptions::default())?;
    // Version 2 (levels read from step blocks) or 3 (committed in the root
    // block).
    f.version = if u.arbitrary()? { 3 } else { 2 };
    let mut g = mutate(u, &f)?;
    g.version = f.version;
    let (fp, _) = write_valid(&f, dir, "lies-f.bin");
    let f_bytes = match std::fs::read(&fp) {
        Ok(b) => b,
        Err(e) => panic!("cannot read {}: {e}", fp.display()),
    };
    let g_bytes = match write(&g, dir, "lies-g.bin").map(std::fs::read) {
        Some(Ok(b)) => b,
        _ => f_bytes.clone(),
    };
    let mut lies = Vec::new();
    for _ in 0..u.int_in_range(1..=3)? {
        let class = *u.choose(classes)?;
        lies.push(Lie::draw_of(u, class)?);
    }
    judge(u, &f_bytes, &g_bytes, &lies, dir, None, seen)
}

/// Rewrites `lies` into F (`f_bytes`), draws one command family and one
/// case of it, and asserts the oracle on F and F′ against G (`g_bytes`).
/// `paged`: the paged base and candidate F and G are (F's answers are
/// cached, and `explain` is not drawn: on a 1,024-position prefill it
/// takes seconds).
#[allow(clippy::too_many_arguments)]
fn judge(
    u: &mut Unstructured<'_>,
    f_bytes: &[u8],
    g_bytes: &[u8],
    lies: &[crate::lies::Lie],
    dir: &Path,
    paged: Option<(usize, usize)>,
    seen: &mut Seen,
) -> Result<()> {
    use crate::lies::{lie, LieClass};
    let lied = match lie(f_bytes, lies) {
        Ok(Some(b)) => b,
        Ok(None) => return Ok(()),
        Err(e) => panic!("the rewriter refused a trace the writer wrote: {e}"),
    };
    // `explain` costs ~100 times what one picked case of the others does
    // (it was a third of the time at one execution in 64): one in 512.
    let family = if paged.is_none() && u.ratio(1, 512)? {
        metamorphic::Family::Explain
    } else {
        *u.choose(&[
            metamorphic::Family::Inspect,
            metamorphic::Family::Diff,
            metamorphic::Family::Gate,
            metamorphic::Family::Certify,
            metamorphic::Family::Convert,
        ])?
    };
    let provenance = lies.iter().any(|l| l.class() == LieClass::Provenance);
    // One drawn gate profile and one drawn case of the family per
    // execution (the suite runs them all; over many executions, so does
    // the fuzzer): the gate family's cross baselines are one more case.
    let mut profiles = metamorphic::profiles();
    let one = profiles.swap_remove(u.choose_index(profiles.len())?);
    let profiles = [one];
    let cases = metamorphic::case_count(family, dir, &profiles);
    let extra = usize::from(family == metamorphic::Family::Gate);
    let k = u.choose_index(cases + extra)?;
    let (mut bad, answered, refused) = if k < cases {
        let pick = metamorphic::Pick::One(k);
        let truth = truth_of(paged, family, f_bytes, g_bytes, dir, &profiles, k);
        let c = metamorphic::check_picked(&truth, family, &lied, g_bytes, dir, provenance, &profiles, pick);
        (c.failures, c.answered, c.refused)
    } else {
        (Vec::new(), 0, 0)
    };
    if k >= cases {
        bad.extend(metamorphic::cross_baselines(
            f_bytes, &lied, dir, &profiles, provenance,
        ));
    }
    assert!(
        bad.is_empty(),
        "{lies:?} under {family:?}: {} answers of the lie are neither the trace's nor an error:\n{}",
        bad.len(),
        bad.join("\n")
    );
    *seen |= VERDICT | SAME;
    if answered > 0 {
        *seen |= PASSED;
    }
    if refused > 0 {
        *seen |= REFUSED;
    }
    if lies.iter().any(|l| l.class() == LieClass::Pages) {
        *seen |= PAGE_LIE;
        if answered > 0 {
            *seen |= PAGE_LIE_ANSWERED;
        }
    }
    Ok(())
}
