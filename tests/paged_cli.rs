//! Format version 4's paged groups on the built `moeconf` binary
//! (docs/format.md §11.9): `moeconf run` of a 450-token prompt writes layer
//! groups longer than a page as pages; `diff` and `gate` of a candidate
//! forked inside the prefill answer exactly what they answer for the same
//! traces converted to version 3; a falsified page table or page that the
//! comparison reads makes them exit 2; and lies about what the digests do
//! not commit to (page offsets, record counts) give the same answer or 2.
//!
//! The binary is `$MOECONF_BIN`, else `moeconf` next to this test's build
//! directory (build it first: `cargo build --release -p moeconf`).

use moeconf_fingerprint::group_pages::{GroupPages, PAGE_BYTES};
use moeconf_fingerprint::{group_prefix, Level};
use moeconf_schema::Trace;
use moeconf_testkit::lies::{lie1, Lie, Model, PageLie};
use moeconf_workspace_tests::binary;
use std::path::Path;
use std::process::Command;

/// `moeconf ARGS` in `dir` without `MOECONF_*` settings: exit code, stdout, stderr.
fn moeconf(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(binary());
    c.args(args).current_dir(dir);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("MOECONF_") {
            c.env_remove(k);
        }
    }
    let o = c.output().expect("running moeconf");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 test path")
}

/// The fork of the candidate: layer 5 at prompt position 225.
const FORK: u32 = 225;

fn run(dir: &Path, out: &Path, fork: bool) {
    let mut args = vec![
        "run",
        "--model",
        "builtin:tiny-v4",
        "--prompt-tokens",
        "450",
        "--max-new-tokens",
        "2",
        "-o",
        s(out),
    ];
    let pos = FORK.to_string();
    if fork {
        args.extend(["--fork-step", "0", "--fork-position", &pos, "--fork-layer", "5"]);
    }
    let (code, _, err) = moeconf(dir, &args);
    assert_eq!(code, 0, "{err}");
}

/// The commands compared, with the pair's two file names appended.
const COMMANDS: [&[&str]; 4] = [
    &["diff"],
    &["diff", "--format", "json"],
    &["gate"],
    &["gate", "--format", "json"],
];

/// Every command's (exit code, stdout) on `r` and `c`, copied to the fixed
/// names `ref.bin` and `cand.bin` in `dir` so that outputs compare as text.
fn answers(dir: &Path, r: &[u8], c: &[u8], commands: &[&[&str]]) -> Vec<(i32, String)> {
    std::fs::write(dir.join("ref.bin"), r).unwrap();
    std::fs::write(dir.join("cand.bin"), c).unwrap();
    commands
        .iter()
        .map(|a| {
            let mut args = a.to_vec();
            args.extend(["ref.bin", "cand.bin"]);
            let (code, out, err) = moeconf(dir, &args);
            assert!(code == 1 || code == 2, "{args:?} exited {code}: {err}");
            (code, out)
        })
        .collect()
}

#[test]
fn paged_traces_answer_as_version_3_and_falsified_pages_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (r4, c4) = (d.join("r4.bin"), d.join("c4.bin"));
    run(d, &r4, false);
    run(d, &c4, true);
    let (r3, c3) = (d.join("r3.bin"), d.join("c3.bin"));
    for (from, to) in [(&r4, &r3), (&c4, &c3)] {
        let (code, _, err) = moeconf(d, &["convert", s(from), "-o", s(to), "--to", "3"]);
        assert_eq!(code, 0, "{err}");
    }
    // Converting back gives `run`'s paged file byte for byte.
    let back = d.join("back4.bin");
    let (code, _, err) = moeconf(d, &["convert", s(&c3), "-o", s(&back), "--to", "4"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        std::fs::read(&back).unwrap() == std::fs::read(&c4).unwrap(),
        "3 -> 4 is run's file"
    );
    let t4 = Trace::open_verified(&c4).unwrap();
    assert_eq!(t4.format_version(), 4);
    assert_eq!(t4.root(), Trace::open(&c3).unwrap().root());
    let (b4r, b4c) = (std::fs::read(&r4).unwrap(), std::fs::read(&c4).unwrap());
    let (b3r, b3c) = (std::fs::read(&r3).unwrap(), std::fs::read(&c3).unwrap());
    let want = answers(d, &b3r, &b3c, &COMMANDS);
    assert!(want.iter().all(|(code, _)| *code == 1), "{want:?}");
    assert!(
        want[0].1.contains(&format!("position {FORK} layer 5")),
        "{}",
        want[0].1
    );
    assert_eq!(
        answers(d, &b4r, &b4c, &COMMANDS),
        want,
        "version 4 answers as version 3"
    );

    // The candidate's L4 group of layer 5 at step 0 is paged, and the
    // fork's position lies in page `j`.
    let model = Model::decode(&b4c).unwrap();
    let (li, gi) = model.steps[0]
        .levels
        .iter()
        .enumerate()
        .find(|(_, l)| l.level == Level::L4)
        .and_then(|(li, l)| {
            l.groups
                .iter()
                .position(|g| g.layer == Some(5))
                .map(|gi| (li, gi))
        })
        .expect("an L4 group of layer 5");
    let g = &model.steps[0].levels[li].groups[gi];
    let prefix = group_prefix(0, Level::L4, Some(5), g.entries.len() as u64).len() as u64;
    let layout = GroupPages::new(prefix, g.entries.len() as u64).unwrap();
    assert!(
        layout.count() >= 3,
        "{} records: {} pages",
        g.entries.len(),
        layout.count()
    );
    let first = g
        .entries
        .iter()
        .position(|e| e.entry.coord.position == FORK)
        .unwrap() as u64;
    let j = ((prefix + 32 * first) / PAGE_BYTES) as usize;
    assert!(j > 0, "the fork's records lie in page {j}");
    for l in [
        PageLie::Cv(0),
        PageLie::Cv(j),
        PageLie::Shift(j),
        PageLie::Boundary(j),
        PageLie::Digest(j),
        PageLie::Missing,
        PageLie::Truncated(j),
    ] {
        let mut m = model.clone();
        m.steps[0].levels[li].groups[gi].page_lie = Some(l);
        let bad = m.encode().unwrap();
        // The JSON reports (the text ones read the same nodes).
        let json = [COMMANDS[1], COMMANDS[3]];
        for (k, (code, out)) in answers(d, &b4r, &bad, &json).into_iter().enumerate() {
            assert_eq!(code, 2, "{l:?}: {:?} answered: {out}", json[k]);
        }
    }
    // Lies about what no digest commits to: every page chunk of the group
    // moved, the group's record count (and its level's and the trailer's)
    // changed. The same answer, or 2.
    let chunks_before = model.steps[0].payload_order.len()
        + model.steps[0].levels[..li]
            .iter()
            .map(|l| l.groups.len())
            .sum::<usize>();
    for lie in [
        Lie::Pad {
            chunk: chunks_before + 1,
            blocks: 2,
        },
        Lie::LevelRecords {
            step: 0,
            level: Level::L4,
            count: model.steps[0].level_records[4] + 1,
            groups: true,
            trailer: true,
        },
    ] {
        let Some(bad) = lie1(&b4c, &lie).unwrap() else {
            panic!("{lie:?} did not apply");
        };
        for (k, (code, out)) in answers(d, &b4r, &bad, &COMMANDS).into_iter().enumerate() {
            assert!(
                code == 2 || (code, &out) == (want[k].0, &want[k].1),
                "{lie:?}: {:?}",
                COMMANDS[k]
            );
        }
    }
}
