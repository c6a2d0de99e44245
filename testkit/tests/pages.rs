//! Format version 4's paged groups (docs/format.md §11.9): a group whose
//! digest preimage is longer than one page is stored as page blocks under
//! a page table; a comparison reads only the pages whose chaining values
//! differ, and every falsified page, table or count is refused.

use moeconf_fingerprint::group_pages::{GroupPages, PAGE_BYTES};
use moeconf_fingerprint::{group_prefix, Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_output::{check_output, Inputs};
use moeconf_schema::v2::{FORMAT_V3, FORMAT_V4};
use moeconf_schema::{Header, Trace, TraceWriter};
use moeconf_testkit::lies::{lie1, Lie, Model, PageLie};
use std::path::Path;

/// Records in the large group (L4, layer 1, step 0): about 2.4 pages.
const BIG: u32 = 10_000;

fn header() -> Header {
    let mut h = Header::default();
    h.binding.decoding.max_new_tokens = 2;
    h.binding.capture.levels = moeconf_fingerprint::LevelSet::ALL;
    h
}

/// A token at steps 0 and 1, at positions `first` and `first + 1`.
fn append_tokens(w: &mut TraceWriter, first: u32) {
    for step in 0..2u32 {
        let tok = (7 + step as i32).to_le_bytes();
        let t = TensorView {
            dtype: DType::I32,
            shape: &[1],
            bytes: &tok,
        };
        w.append(
            coord(step, first + step, None, "token.output"),
            Level::L0,
            t,
            true,
        )
        .unwrap();
    }
}

/// A coordinate of step `step` (prefill at step 0, decode after).
fn coord(step: u32, position: u32, layer: Option<u32>, path: &str) -> Coord {
    Coord {
        step,
        position,
        phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
        layer,
        path: path.into(),
    }
}

/// A trace of `version` and `alg`: step 0 holds `BIG` L4 records of layer 1
/// (fingerprints), 50 L3 records with payloads and a token; step 1 a
/// token. With `fork`, the L4 record at that position differs.
fn write(path: &Path, version: u32, alg: Algorithm, fork: Option<u32>, big: u32) -> Vec<u8> {
    let out = check_output(path, &Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, alg, header(), version).unwrap();
    let c = coord;
    for p in 0..big {
        let v = (p as f32) * 0.5 + if fork == Some(p) { 1.0 } else { 0.0 };
        let b: Vec<u8> = [v, -v].iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = TensorView {
            dtype: DType::F32,
            shape: &[2],
            bytes: &b,
        };
        w.append(c(0, p, Some(1), "moe.combine"), Level::L4, t, false)
            .unwrap();
        if p % 200 == 0 {
            w.append(c(0, p, Some(1), "layer.post_ffn_mhc"), Level::L3, t, true)
                .unwrap();
        }
    }
    append_tokens(&mut w, big);
    w.finish().unwrap();
    std::fs::read(path).unwrap()
}

fn big_group(t: &Trace) -> &moeconf_schema::GroupNode {
    t.step(0)
        .unwrap()
        .unwrap()
        .level(Level::L4)
        .unwrap()
        .group(Some(1))
        .unwrap()
}

/// Opens `bytes` and uses it the way a comparison does: the big group's
/// page table, then every page one at a time (each read with the
/// neighbours its straddling records need). The first error, if any.
fn use_pages(bytes: Vec<u8>) -> Result<(), String> {
    let t = Trace::from_bytes(Path::new("lie.bin"), bytes).map_err(|e| e.to_string())?;
    t.step(0).map_err(|e| e.to_string())?;
    let g = big_group(&t);
    let Some(cvs) = t.group_pages(g).map_err(|e| e.to_string())? else {
        // Not paged for the record count the step block gives: a comparison
        // reads the group whole.
        t.group_records(g).map_err(|e| e.to_string())?;
        return Ok(());
    };
    for j in 0..cvs.len() as u64 {
        t.group_page_entries(g, &[j]).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// [`use_pages`], then every byte (full verification).
fn use_all(bytes: Vec<u8>) -> Result<(), String> {
    use_pages(bytes.clone())?;
    let t = Trace::from_bytes(Path::new("lie.bin"), bytes).map_err(|e| e.to_string())?;
    t.verify_payloads().map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn a_large_group_is_paged_in_version_4_with_the_root_of_version_3() {
    let dir = tempfile::tempdir().unwrap();
    let (p3, p4) = (dir.path().join("v3.bin"), dir.path().join("v4.bin"));
    let b3 = write(&p3, FORMAT_V3, Algorithm::Blake3, None, BIG);
    let b4 = write(&p4, FORMAT_V4, Algorithm::Blake3, None, BIG);
    let (t3, t4) = (Trace::open(&p3).unwrap(), Trace::open(&p4).unwrap());
    assert_eq!(t3.root(), t4.root());
    assert_eq!(t4.format_version(), 4);
    let layout = GroupPages::new(
        group_prefix(0, Level::L4, Some(1), BIG as u64).len() as u64,
        BIG as u64,
    )
    .unwrap();
    assert!(layout.is_paged() && layout.count() == 3, "{layout:?}");
    assert_eq!(t3.group_pages(big_group(&t3)).unwrap(), None);
    assert_eq!(t4.group_pages(big_group(&t4)).unwrap().map(|c| c.len()), Some(3));
    // Groups of at most one page stay as in version 3.
    let small = t4
        .step(0)
        .unwrap()
        .unwrap()
        .level(Level::L3)
        .unwrap()
        .group(Some(1))
        .unwrap();
    assert_eq!(t4.group_pages(small).unwrap(), None);
    // Every record reads the same; full verification accepts it.
    let (r3, r4) = (
        t3.group_entries(big_group(&t3)).unwrap(),
        t4.group_entries(big_group(&t4)).unwrap(),
    );
    assert_eq!(r3.len(), BIG as usize);
    for ((i3, e3), (i4, e4)) in r3.iter().zip(r4.iter()) {
        assert_eq!((i3, &e3.coord, e3.digest), (i4, &e4.coord, e4.digest));
    }
    t4.verify_payloads().unwrap();
    assert!(use_all(b4.clone()).is_ok());
    // The rewriter of the lies reads and writes version 4 byte for byte.
    assert_eq!(Model::decode(&b4).unwrap().encode().unwrap(), b4);
    assert_eq!(Model::decode(&b3).unwrap().encode().unwrap(), b3);
    // SHA-256 traces are never paged.
    let ps = dir.path().join("sha.bin");
    write(&ps, FORMAT_V4, Algorithm::Sha256, None, BIG);
    let ts = Trace::open_verified(&ps).unwrap();
    assert_eq!(ts.group_pages(big_group(&ts)).unwrap(), None);
}

#[test]
fn without_a_paged_group_version_4_is_version_3_but_for_the_version() {
    let dir = tempfile::tempdir().unwrap();
    let (p3, p4) = (dir.path().join("v3.bin"), dir.path().join("v4.bin"));
    let b3 = write(&p3, FORMAT_V3, Algorithm::Blake3, None, 3000);
    let b4 = write(&p4, FORMAT_V4, Algorithm::Blake3, None, 3000);
    assert_eq!(b3.len(), b4.len());
    let n = b3.len();
    let differing: Vec<usize> = (0..n).filter(|&i| b3[i] != b4[i]).collect();
    // The preamble's version, and the checksum (which covers the preamble).
    assert!(
        differing
            .iter()
            .all(|&i| (8..12).contains(&i) || (n - 40..n - 8).contains(&i)),
        "{differing:?}"
    );
    assert_eq!(b3[8], 3);
    assert_eq!(b4[8], 4);
    Trace::open_verified(&p4).unwrap();
}

#[test]
fn a_comparison_reads_only_the_pages_whose_values_differ() {
    let dir = tempfile::tempdir().unwrap();
    let (pr, pc) = (dir.path().join("r.bin"), dir.path().join("c.bin"));
    // Position 5000 lies inside page 1 (records about 4095..8190).
    write(&pr, FORMAT_V4, Algorithm::Blake3, None, BIG);
    write(&pc, FORMAT_V4, Algorithm::Blake3, Some(5000), BIG);
    let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
    let (gr, gc) = (big_group(&r), big_group(&c));
    assert_ne!(gr.digest, gc.digest);
    let (vr, vc) = (
        r.group_pages(gr).unwrap().unwrap(),
        c.group_pages(gc).unwrap().unwrap(),
    );
    let differ: Vec<u64> = (0..vr.len())
        .filter(|&j| vr[j] != vc[j])
        .map(|j| j as u64)
        .collect();
    assert_eq!(differ, vec![1]);
    let (er, ec) = (
        r.group_page_entries(gr, &differ).unwrap(),
        c.group_page_entries(gc, &differ).unwrap(),
    );
    assert_eq!(er.len(), ec.len());
    let found: Vec<u32> = er
        .iter()
        .zip(&ec)
        .filter(|(a, b)| a.1.digest != b.1.digest)
        .map(|(a, _)| a.1.coord.position)
        .collect();
    assert_eq!(found, vec![5000]);
    // Page 1 and its two neighbours (each shares a straddling record with
    // it), never the whole group.
    assert_eq!(r.pages_read(), 3);
    assert_eq!(c.pages_read(), 3);
    // The records are reachable by id.
    let (id, e) = er.iter().find(|(_, e)| e.coord.position == 5000).unwrap();
    assert_eq!(r.record(*id).coord, e.coord);
    // The whole group afterwards reads every page once more, consistent.
    assert_eq!(r.group_entries(gr).unwrap().len(), BIG as usize);
    r.verify_payloads().unwrap();
}

#[test]
fn every_falsified_page_table_page_or_count_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("v4.bin");
    let honest = write(&p, FORMAT_V4, Algorithm::Blake3, None, BIG);
    let with = |l: PageLie| {
        let mut m = Model::decode(&honest).unwrap();
        let s = &mut m.steps[0];
        let level = s.levels.iter_mut().find(|x| x.level == Level::L4).unwrap();
        level.groups[0].page_lie = Some(l);
        m.encode().unwrap()
    };
    // Each page lie is refused, by the comparison's path and by full
    // verification alike.
    for l in [
        PageLie::Cv(1),
        PageLie::Shift(1),
        PageLie::Boundary(1),
        PageLie::Boundary(2),
        PageLie::Digest(0),
        PageLie::Digest(1),
        PageLie::Missing,
        PageLie::Truncated(0),
        PageLie::Truncated(2),
    ] {
        let bytes = with(l);
        let e = use_pages(bytes.clone()).expect_err(&format!("{l:?} accepted by the page reads"));
        eprintln!("{l:?}: {e}");
        let t = Trace::from_bytes(Path::new("lie.bin"), bytes).unwrap();
        assert!(
            t.verify_payloads().is_err(),
            "{l:?}: full verification accepted it"
        );
    }
    // A lying record count (GroupRef.records of the big group, the first
    // of L4, with the root block's and the trailer's counts made to agree)
    // moves the layout: the page values no longer merge to the group
    // digest, or the table has the wrong size, or the group is not paged.
    for count in [BIG as u64 - 1, BIG as u64 + 1, BIG as u64 + 5000, 100] {
        let l = Lie::LevelRecords {
            step: 0,
            level: Level::L4,
            count,
            groups: true,
            trailer: true,
        };
        let bytes = lie1(&honest, &l).unwrap().expect("the lie applies");
        let e = use_pages(bytes).expect_err(&format!("count {count} accepted"));
        eprintln!("records {count}: {e}");
    }
    // The honest bytes, re-encoded, still pass (the lies are what fails).
    assert!(use_all(Model::decode(&honest).unwrap().encode().unwrap()).is_ok());
    assert!(PAGE_BYTES.is_power_of_two());
}

#[test]
fn diff_of_paged_traces_finds_what_version_3_finds_reading_a_few_pages() {
    use moeconf_bisect::{diff, DiffOptions};
    let dir = tempfile::tempdir().unwrap();
    let big = 40_000u32; // 10 pages
    let report = |version: u32| {
        let (pr, pc) = (
            dir.path().join(format!("r{version}.bin")),
            dir.path().join(format!("c{version}.bin")),
        );
        write(&pr, version, Algorithm::Blake3, None, big);
        write(&pc, version, Algorithm::Blake3, Some(23_456), big);
        let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
        let d = diff(&r, &c, &DiffOptions::default()).unwrap();
        let json = serde_json::to_value(&d).unwrap();
        (
            json["verdict"].clone(),
            json["first_divergence"].clone(),
            json["divergences"].clone(),
            json["levels"].clone(),
            r.pages_read(),
            c.pages_read(),
        )
    };
    let v3 = report(FORMAT_V3);
    let v4 = report(FORMAT_V4);
    assert_eq!(v4.1["position"], 23_456, "{}", v4.1);
    assert_eq!((&v3.0, &v3.1, &v3.2, &v3.3), (&v4.0, &v4.1, &v4.2, &v4.3));
    assert_eq!((v3.4, v3.5), (0, 0));
    // Each side: the differing page and its neighbours (the look-ups of
    // the divergence's position find them read); the reference also, for
    // the layer-kind inference of the report, the records at the group's
    // first position (page 0 and page 1, which shares a record with it).
    assert!(v4.5 >= 1 && v4.5 <= 5, "candidate read {} pages", v4.5);
    assert!(v4.4 <= 5, "reference read {} pages", v4.4);
}

#[test]
fn the_differing_records_of_paged_traces_cost_the_differing_pages() {
    use moeconf_bisect::differing_pairs;
    let dir = tempfile::tempdir().unwrap();
    let big = 40_000u32; // 10 pages
    let pairs = |version: u32| {
        let (pr, pc) = (
            dir.path().join(format!("r{version}.bin")),
            dir.path().join(format!("c{version}.bin")),
        );
        write(&pr, version, Algorithm::Blake3, None, big);
        write(&pc, version, Algorithm::Blake3, Some(23_456), big);
        let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
        let p: Vec<String> = differing_pairs(&r, &c)
            .unwrap()
            .iter()
            .map(|p| format!("{:?}", p.reference.map(|i| r.record(i).coord.clone())))
            .collect();
        (p, r.pages_read(), c.pages_read())
    };
    let (p3, _, _) = pairs(FORMAT_V3);
    let (p4, r4, c4) = pairs(FORMAT_V4);
    assert_eq!(p3, p4);
    assert!(p4.iter().any(|p| p.contains("position: 23456")), "{p4:?}");
    // Page 5 and its two neighbours on each side, of 10.
    assert_eq!((r4, c4), (3, 3));
}

/// The pages the report of a one-record fork reads, counted (never timed):
/// the same for a group of 10 pages and one of 40, the reports equal to
/// version 3's. The walk reads the differing page and its two neighbours
/// on each side; the report's layer-kind inference reads the records at
/// the group's first position (page 0 and the page it shares a record
/// with) on each side, never the whole group; the gate adds nothing.
#[test]
fn a_one_record_forks_report_reads_pages_independent_of_the_groups_size() {
    use moeconf_bisect::{diff, DiffOptions};
    use moeconf_gate::policy::Profile;
    use moeconf_schema::Verification;
    let dir = tempfile::tempdir().unwrap();
    let run = |version: u32, big: u32| {
        let (pr, pc) = (
            dir.path().join(format!("r{version}-{big}.bin")),
            dir.path().join(format!("c{version}-{big}.bin")),
        );
        let fork = big / 10 * 6 + 123;
        write(&pr, version, Algorithm::Blake3, None, big);
        write(&pc, version, Algorithm::Blake3, Some(fork), big);
        let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
        let d = diff(&r, &c, &DiffOptions::default()).unwrap();
        assert_eq!(d.first_divergence.as_ref().map(|f| f.position), Some(fork));
        let diff_json = serde_json::to_string(&d).unwrap();
        let diff_pages = (r.pages_read(), c.pages_read());
        let c = Trace::open(&pc).unwrap();
        let g = moeconf_gate::against_reference_run(
            &pr,
            &c,
            &Profile::builtin("strict"),
            false,
            Verification::OnUse,
        )
        .unwrap();
        let gate_json = g.report.to_json().to_string();
        let gate_pages = (g.reference.pages_read(), c.pages_read());
        (diff_json, gate_json, diff_pages, gate_pages)
    };
    let mut seen = Vec::new();
    for big in [40_000u32, 160_000] {
        let layout = GroupPages::new(
            group_prefix(0, Level::L4, Some(1), big as u64).len() as u64,
            big as u64,
        )
        .unwrap();
        let v3 = run(FORMAT_V3, big);
        let v4 = run(FORMAT_V4, big);
        // The same reports whatever the storage (paths differ: r3/r4).
        let same = |a: &str, b: &str| a.replace("r3-", "r4-").replace("c3-", "c4-") == b;
        assert!(same(&v3.0, &v4.0), "diff reports differ:\n{}\n{}", v3.0, v4.0);
        assert!(same(&v3.1, &v4.1), "gate reports differ:\n{}\n{}", v3.1, v4.1);
        assert_eq!((v3.2, v3.3), ((0, 0), (0, 0)));
        eprintln!(
            "{big} records, {} pages: diff {:?}, gate {:?}",
            layout.count(),
            v4.2,
            v4.3
        );
        // The differing page with its neighbours on each side, and on the
        // reference page 0 with page 1: 5 and 3, whatever the group's size.
        assert_eq!(v4.2, (5, 3), "diff at {big} records ({} pages)", layout.count());
        assert_eq!(v4.3, (5, 3), "gate at {big} records ({} pages)", layout.count());
        seen.push((layout.count(), v4.2, v4.3));
    }
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), vec![10, 40]);
}

/// Not a check: the pages `diff` and `gate` read for two traces named by
/// `MOECONF_PAGES_REF` and `MOECONF_PAGES_CAND` (docs/performance.md, the
/// prefill forks). Prints one line per command.
#[test]
#[ignore]
fn pages_read_by_diff_and_gate_of_given_traces() {
    use moeconf_bisect::{diff, DiffOptions};
    use moeconf_gate::policy::Profile;
    use moeconf_schema::Verification;
    let (Ok(pr), Ok(pc)) = (
        std::env::var("MOECONF_PAGES_REF"),
        std::env::var("MOECONF_PAGES_CAND"),
    ) else {
        eprintln!("set MOECONF_PAGES_REF and MOECONF_PAGES_CAND");
        return;
    };
    let (r, c) = (
        Trace::open(Path::new(&pr)).unwrap(),
        Trace::open(Path::new(&pc)).unwrap(),
    );
    diff(&r, &c, &DiffOptions::default()).unwrap();
    println!(
        "diff: reference {} pages, candidate {} pages",
        r.pages_read(),
        c.pages_read()
    );
    let c = Trace::open(Path::new(&pc)).unwrap();
    let g = moeconf_gate::against_reference_run(
        Path::new(&pr),
        &c,
        &Profile::builtin("strict"),
        false,
        Verification::OnUse,
    )
    .unwrap();
    println!(
        "gate: reference {} pages, candidate {} pages",
        g.reference.pages_read(),
        c.pages_read()
    );
}

/// Layers and positions of [`write_checkpoints`]' traces: about 2.9 pages
/// of L3 records per layer.
const CK_LAYERS: u32 = 4;
const CK_POSITIONS: u32 = 6_000;
/// The first position of the prefill (as after a cached prefix).
const CK_START: u32 = 100;

/// A version 4 trace whose step 0 (a prefill of positions `CK_START..`)
/// holds both post-mHC checkpoints of every layer at every position
/// (fingerprints), and a token at steps 0 and 1. With `fork` (layer,
/// position, FFN half), that checkpoint differs; `omit` (layer, position)
/// holds no checkpoint there (a partial trace).
fn write_checkpoints(path: &Path, fork: Option<(u32, u32, bool)>, omit: Option<(u32, u32)>) {
    let out = check_output(path, &Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header(), FORMAT_V4).unwrap();
    let c = coord;
    for layer in 0..CK_LAYERS {
        for p in CK_START..CK_START + CK_POSITIONS {
            if omit == Some((layer, p)) {
                continue;
            }
            for (ffn, path) in [(false, "layer.post_attn_mhc"), (true, "layer.post_ffn_mhc")] {
                let forked = fork == Some((layer, p, ffn));
                let v =
                    (p * 2 + u32::from(ffn)) as f32 + layer as f32 * 0.25 + if forked { 1.0 } else { 0.0 };
                let b: Vec<u8> = [v, -v].iter().flat_map(|x| x.to_le_bytes()).collect();
                let t = TensorView {
                    dtype: DType::F32,
                    shape: &[2],
                    bytes: &b,
                };
                w.append(c(0, p, Some(layer), path), Level::L3, t, false).unwrap();
            }
        }
    }
    append_tokens(&mut w, CK_START + CK_POSITIONS);
    w.finish().unwrap();
}

/// What the report named before it looked the last match up: the last
/// checkpoint of step 0 before `bound` in execution order, from every L3
/// group of the step read whole (the oracle).
fn last_checkpoint_read_whole(t: &Trace, bound: &Coord) -> Option<(Option<u32>, u32, String)> {
    use moeconf_fingerprint::catalogue::ExecKey;
    let key = |c: &Coord| (ExecKey::of(c), c.phase, c.path.to_string());
    let level = t.step(bound.step).unwrap().unwrap().level(Level::L3).unwrap();
    level
        .groups
        .iter()
        .flat_map(|g| t.read_group(g).unwrap())
        .map(|h| h.entry().coord.clone())
        .filter(|c| c.path.ends_with("_mhc") && key(c) < key(bound))
        .max_by_key(key)
        .map(|c| (c.layer, c.position, c.path.to_string()))
}

/// The L3 line's last match is the checkpoint just before the first
/// differing one in execution order (the one every L3 group read whole
/// names), found by reading the pages of one or two positions: the
/// reference reads a few pages more than the candidate, however many
/// pages of checkpoints precede the divergence (about 9 at layer 3 here).
#[test]
fn the_last_matched_checkpoint_costs_the_pages_of_its_position() {
    use moeconf_bisect::{diff, DiffOptions, EarlierCheckpoints};
    let dir = tempfile::tempdir().unwrap();
    let pr = dir.path().join("ref.bin");
    write_checkpoints(&pr, None, None);
    let layout = GroupPages::new(
        group_prefix(0, Level::L3, Some(0), 2 * CK_POSITIONS as u64).len() as u64,
        2 * CK_POSITIONS as u64,
    )
    .unwrap();
    assert!(layout.count() >= 3, "{layout:?}");
    let s = CK_START;
    // (layer, position, FFN half) of the fork.
    for fork in [
        (0, s, false),         // the first checkpoint of the step: no last match
        (0, s, true),          // its attention half
        (1, s + 2_500, false), // the position before, same layer
        (3, s + 4_100, false),
        (2, s, false), // opens its layer: the last position of layer 1
        (3, s + CK_POSITIONS - 1, true),
    ] {
        let pc = dir.path().join(format!("c-{}-{}-{}.bin", fork.0, fork.1, fork.2));
        write_checkpoints(&pc, Some(fork), None);
        let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
        let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
        let l3 = &rep.levels.l3;
        let first = l3.first.as_ref().expect("a differing checkpoint");
        let path = if fork.2 {
            "layer.post_ffn_mhc"
        } else {
            "layer.post_attn_mhc"
        };
        assert_eq!(
            (first.layer, first.position, first.path.as_str()),
            (Some(fork.0), fork.1, path)
        );
        let bound = Coord {
            step: 0,
            position: fork.1,
            phase: Phase::Prefill,
            layer: Some(fork.0),
            path: path.into(),
        };
        let whole = Trace::open(&pr).unwrap();
        let oracle = last_checkpoint_read_whole(&whole, &bound);
        let named = l3
            .last_matched_checkpoint
            .as_ref()
            .map(|m| (m.layer, m.position, m.path.clone()));
        assert_eq!(named, oracle, "fork {fork:?}");
        assert_eq!(
            l3.earlier_checkpoints,
            Some(if oracle.is_some() {
                EarlierCheckpoints::Match
            } else {
                EarlierCheckpoints::None
            })
        );
        let text = rep.render_text(false);
        match &oracle {
            Some((l, p, path)) => assert!(
                text.contains(&format!(
                    "   every earlier checkpoint of step 0 matches; last match: step 0 pos {p} (prefill) layer {} {path}\n",
                    l.unwrap()
                )),
                "{text}"
            ),
            None => assert!(text.contains("   it is the first checkpoint of step 0\n"), "{text}"),
        }
        let (rp, cp) = (r.pages_read(), c.pages_read());
        eprintln!("fork {fork:?}: reference {rp} pages, candidate {cp}");
        assert!(
            rp <= cp + 4,
            "fork {fork:?}: reference {rp} pages, candidate {cp}"
        );
        // Reading the groups up to the fork's layer whole (what counting the
        // earlier checkpoints did) is more than this test allows.
        if fork.0 == 3 {
            let w = whole.pages_read();
            assert!(
                w >= u64::from(CK_LAYERS) * layout.count() && w > cp + 4,
                "{w} pages"
            );
        }
    }
}

/// A partial trace without the checkpoints of the position before the
/// first differing one: the report names no last match (rather than one
/// found by reading further back) and says so.
#[test]
fn a_last_match_not_where_execution_order_puts_it_is_not_named() {
    use moeconf_bisect::{diff, DiffOptions, EarlierCheckpoints};
    let dir = tempfile::tempdir().unwrap();
    let (pr, pc) = (dir.path().join("ref.bin"), dir.path().join("cand.bin"));
    let gap = (1, CK_START + 2_000);
    write_checkpoints(&pr, None, Some(gap));
    write_checkpoints(&pc, Some((1, gap.1 + 1, false)), Some(gap));
    let (r, c) = (Trace::open(&pr).unwrap(), Trace::open(&pc).unwrap());
    let rep = diff(&r, &c, &DiffOptions::default()).unwrap();
    let l3 = &rep.levels.l3;
    assert_eq!(l3.first.as_ref().map(|f| f.position), Some(gap.1 + 1));
    assert_eq!(l3.last_matched_checkpoint, None);
    assert_eq!(l3.earlier_checkpoints, Some(EarlierCheckpoints::Unlocated));
    let text = rep.render_text(false);
    assert!(
        text.contains(
            "   every earlier checkpoint of step 0 matches; the last one is not where execution order puts it\n"
        ),
        "{text}"
    );
    assert!(r.pages_read() <= c.pages_read() + 4);
}
