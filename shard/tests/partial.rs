//! Partial result files and their merge, on hand-made runs: a round trip
//! keeps every result and attached byte; every corrupted byte, truncation
//! or foreign file is refused naming the file; merges of different runs,
//! duplicate or missing shards and doubly attached files are refused with
//! the reason.

use std::path::{Path, PathBuf};

use moeconf_output::{check_output, Inputs};
use moeconf_shard::{write_partial, Attachment, JobGroup, JobResult, Merged, Partial, RunIdentity, Shard};
use serde_json::json;

fn run() -> RunIdentity {
    RunIdentity {
        moeconf_version: "0.1.0".into(),
        command: "calibrate".into(),
        arguments: json!({"model": "builtin:tiny-v4", "sizes": {"seeds": 2}}),
        inputs: json!({"model": {"weights_digest": "ab"}}),
        jobs: vec![
            JobGroup {
                name: "replay".into(),
                jobs: 3,
            },
            JobGroup {
                name: "fault_matrix".into(),
                jobs: 4,
            },
        ],
    }
}

/// The result of job `j`: a value with a float that must round-trip exactly.
fn result(j: usize) -> serde_json::Value {
    json!({"job": j, "linf": 0.1 + j as f64 / 3.0, "tiny": 5e-324, "text": "朋友"})
}

/// Writes shard `s` of `run` into `dir`, with one attached file per fault-matrix job.
fn write(dir: &Path, run: &RunIdentity, s: Shard) -> PathBuf {
    let results: Vec<JobResult> = s
        .jobs(run.total_jobs())
        .map(|j| JobResult {
            job: j,
            result: result(j),
        })
        .collect();
    let mut files = Vec::new();
    for j in s.jobs(run.total_jobs()).filter(|&j| j >= 3) {
        let src = dir.join(format!("src-{}-{j}", s.index()));
        std::fs::write(&src, vec![j as u8; 1000 + j]).unwrap();
        files.push(Attachment {
            name: format!("traces/fault-{j:02}.bin"),
            job: j,
            source: src,
        });
    }
    let path = dir.join(format!("part-{}-of-{}.part", s.index(), s.count()));
    write_partial(
        &check_output(&path, &Inputs::new()).unwrap(),
        run,
        s,
        results,
        &files,
    )
    .unwrap();
    path
}

fn shards(dir: &Path, run: &RunIdentity, n: u32) -> Vec<PathBuf> {
    (0..n)
        .map(|i| write(dir, run, Shard::new(i, n).unwrap()))
        .collect()
}

fn merge(paths: &[PathBuf]) -> Result<Merged, moeconf_shard::ShardError> {
    let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
    Merged::open(&refs)
}

#[test]
fn round_trip_keeps_every_result_and_attached_byte_for_any_shard_count() {
    let dir = tempfile::tempdir().unwrap();
    for n in [1u32, 2, 3, 9] {
        let mut paths = shards(dir.path(), &run(), n);
        paths.reverse();
        let m = merge(&paths).unwrap();
        assert_eq!(m.run(), &run());
        assert_eq!(m.shard_count(), n);
        let want: Vec<serde_json::Value> = (0..7).map(result).collect();
        assert_eq!(m.results(), want.as_slice(), "n = {n}");
        assert_eq!(m.group("fault_matrix"), &want[3..]);
        let files = m.files();
        let names: Vec<&str> = files.iter().map(|f| f.name).collect();
        assert_eq!(
            names,
            [
                "traces/fault-03.bin",
                "traces/fault-04.bin",
                "traces/fault-05.bin",
                "traces/fault-06.bin"
            ]
        );
        for f in &files {
            let mut bytes = Vec::new();
            m.copy_file(f, &mut bytes).unwrap();
            assert_eq!(bytes, vec![f.job as u8; 1000 + f.job]);
        }
    }
}

#[test]
fn every_corrupted_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), &run(), Shard::new(1, 2).unwrap());
    let bytes = std::fs::read(&path).unwrap();
    let bad = dir.path().join("bad.part");
    // Every byte of the header and trailer, and a stride through the manifest and attached bytes.
    let n = bytes.len();
    let positions: Vec<usize> = (0..24).chain((24..n - 32).step_by(97)).chain(n - 32..n).collect();
    for &i in &positions {
        let mut b = bytes.clone();
        b[i] ^= 0x20;
        std::fs::write(&bad, &b).unwrap();
        let e = Partial::open(&bad)
            .expect_err(&format!("byte {i} flipped was accepted"))
            .to_string();
        assert!(e.contains("bad.part"), "byte {i}: {e}");
        assert!(
            e.contains("corrupted") || e.contains("not a moeconf partial"),
            "byte {i}: {e}"
        );
    }
    for cut in [0, 10, 24, 100, n / 2, n - 33, n - 1] {
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        assert!(Partial::open(&bad).is_err(), "truncated to {cut} bytes");
    }
    let mut longer = bytes.clone();
    longer.push(0);
    std::fs::write(&bad, &longer).unwrap();
    assert!(Partial::open(&bad).unwrap_err().to_string().contains("corrupted"));
    // A manifest length beyond the file is refused before anything is allocated.
    let mut huge = bytes.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&bad, &huge).unwrap();
    let e = Partial::open(&bad).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
    std::fs::write(&bad, b"{\"kind\": \"moeconf.sweep\"}").unwrap();
    assert!(Partial::open(&bad)
        .unwrap_err()
        .to_string()
        .contains("not a moeconf partial"));
    let e = Partial::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
}

/// A partial whose bytes are intact (trailer recomputed) but whose manifest breaks a rule.
fn forged(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let path = write(dir, &run(), Shard::new(0, 2).unwrap());
    let bytes = std::fs::read(&path).unwrap();
    let mlen = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut manifest: serde_json::Value = serde_json::from_slice(&bytes[24..24 + mlen]).unwrap();
    edit(&mut manifest);
    let m = serde_json::to_vec(&manifest).unwrap();
    let mut out = bytes[..16].to_vec();
    out.extend((m.len() as u64).to_le_bytes());
    out.extend(&m);
    out.extend(&bytes[24 + mlen..bytes.len() - 32]);
    let digest = blake3::hash(&out);
    out.extend(digest.as_bytes());
    let f = dir.join("forged.part");
    std::fs::write(&f, out).unwrap();
    f
}

/// An edit of a manifest.
type Edit = Box<dyn Fn(&mut serde_json::Value)>;

/// Recomputes the manifest's run digest after an edit of its run.
fn redigest(m: &mut serde_json::Value) {
    let run: RunIdentity = serde_json::from_value(m["run"].clone()).unwrap();
    m["run_digest"] = json!(run.digest());
}

#[test]
fn intact_bytes_with_a_broken_manifest_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Edit)> = vec![
        (
            "run digest",
            Box::new(|m| m["run"]["arguments"]["model"] = json!("other")),
        ),
        (
            "must hold the results of jobs",
            Box::new(|m| {
                m["results"].as_array_mut().unwrap().pop();
            }),
        ),
        ("format version", Box::new(|m| m["format_version"] = json!(2))),
        (
            "shard 5/2 is not a shard",
            Box::new(|m| m["shard"]["index"] = json!(5)),
        ),
        (
            "invalid or repeated",
            Box::new(|m| m["files"][0]["name"] = json!("../escape.bin")),
        ),
        ("attached files", Box::new(|m| m["files"][0]["bytes"] = json!(1))),
        ("manifest", Box::new(|m| m["extra"] = json!(1))),
        // A job list that overflows, with a matching run digest: no shard's results match it.
        (
            "must hold the results of jobs",
            Box::new(|m| {
                m["run"]["jobs"][0]["jobs"] = json!(u64::MAX);
                redigest(m);
            }),
        ),
        (
            "names job 6, not one of shard 0/2",
            Box::new(|m| {
                m["run"]["jobs"][1]["jobs"] = json!(2);
                m["results"].as_array_mut().unwrap().truncate(3);
                redigest(m);
            }),
        ),
    ];
    for (needle, edit) in cases {
        let f = forged(dir.path(), edit);
        let e = Partial::open(&f).expect_err(needle).to_string();
        assert!(e.contains(needle) && e.contains("forged.part"), "{needle}: {e}");
    }
}

#[test]
fn merges_of_anything_but_every_shard_of_one_run_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let three = shards(dir.path(), &run(), 3);
    let e = merge(&three[..2]).unwrap_err().to_string();
    assert_eq!(e, "missing shard 2/3 of 3: every shard 0..2 of the run is needed");
    let e = merge(&[three[1].clone()]).unwrap_err().to_string();
    assert!(e.starts_with("missing shards 0/3, 2/3 of 3"), "{e}");
    let e = merge(&[
        three[0].clone(),
        three[1].clone(),
        three[1].clone(),
        three[2].clone(),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("shard 1/3 is given twice"), "{e}");
    assert!(matches!(merge(&[]), Err(moeconf_shard::ShardError::NoPartials)));

    let other = tempfile::tempdir().unwrap();
    let mut r = run();
    r.arguments["sizes"]["seeds"] = json!(3);
    let e = merge(&[
        three[0].clone(),
        write(other.path(), &r, Shard::new(1, 3).unwrap()),
        three[2].clone(),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("different runs: arguments.sizes.seeds: 2 vs 3"), "{e}");
    let mut r = run();
    r.moeconf_version = "0.2.0".into();
    let e = merge(&[
        three[0].clone(),
        write(other.path(), &r, Shard::new(1, 3).unwrap()),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("moeconf version 0.1.0 vs 0.2.0"), "{e}");
    let mut r = run();
    r.inputs["model"]["weights_digest"] = json!("cd");
    let e = merge(&[
        three[0].clone(),
        write(other.path(), &r, Shard::new(1, 3).unwrap()),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("inputs.model.weights_digest: \"ab\" vs \"cd\""), "{e}");
    let two = shards(other.path(), &run(), 2);
    let e = merge(&[three[0].clone(), two[1].clone()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cut into 3 vs 2 shards"), "{e}");
}

#[test]
fn writer_refuses_results_that_are_not_the_shards_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let s = Shard::new(0, 2).unwrap();
    let out = check_output(&dir.path().join("p.part"), &Inputs::new()).unwrap();
    let results = vec![JobResult {
        job: 1,
        result: json!(null),
    }];
    assert!(write_partial(&out, &run(), s, results, &[]).is_err());
    assert!(!dir.path().join("p.part").exists());
    let results: Vec<JobResult> = s
        .jobs(7)
        .map(|j| JobResult {
            job: j,
            result: json!(null),
        })
        .collect();
    let src = dir.path().join("x");
    std::fs::write(&src, b"x").unwrap();
    let bad = Attachment {
        name: "/abs.bin".into(),
        job: 0,
        source: src,
    };
    assert!(write_partial(&out, &run(), s, results, &[bad]).is_err());
}
