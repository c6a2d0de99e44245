//! The recipes of docs/scale.md run: each recipe's shard commands are read
//! from the document (the blocks after `<!-- test: RECIPE shard|merge|unsharded -->`),
//! run locally with the variables its scheduler sets (Slurm's
//! `SLURM_ARRAY_TASK_ID` / `SLURM_ARRAY_TASK_COUNT` for every index of
//! `--array`, Kubernetes' `JOB_COMPLETION_INDEX` for every index below
//! `completions`, every value of the GitHub Actions matrix substituted for
//! `${{ matrix.shard }}`), then its merge command; every file the unsharded
//! command writes, and its stdout, must be the same bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

/// The fenced code blocks of docs/scale.md, by the name of the marker before them.
fn blocks() -> BTreeMap<String, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scale.md");
    let doc = std::fs::read_to_string(&path).expect("docs/scale.md");
    let mut out = BTreeMap::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        let Some(name) = l
            .trim()
            .strip_prefix("<!-- test: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "the marker {name:?} is not followed by a code block"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        out.insert(name.to_string(), body.join("\n") + "\n");
    }
    out
}

/// Runs `script` with bash in `dir`, the built `moeconf` first on PATH, with `env`.
fn bash(dir: &Path, script: &str, env: &[(&str, String)]) {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = Command::new("bash");
    c.arg("-c").arg(script).current_dir(dir).env("PATH", path);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().expect("bash");
    assert!(
        o.status.success(),
        "{script}\nwith {env:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every file under `dir` except partial results (relative path → bytes).
fn outputs(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_none_or(|x| x != "part") {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Runs the unsharded block in one directory and checks that the merged
/// directory holds the same outputs, byte for byte, and at least `want`.
fn same_outputs(whole: &Path, merged: &Path, want: &[&str]) {
    let (w, m) = (outputs(whole), outputs(merged));
    for f in want {
        assert!(
            w.contains_key(*f),
            "the unsharded run wrote no {f}: {:?}",
            w.keys()
        );
    }
    assert_eq!(m.keys().collect::<Vec<_>>(), w.keys().collect::<Vec<_>>());
    for (k, v) in &w {
        assert!(m[k] == *v, "{k} differs between the merged and the unsharded run");
    }
}

/// The first number after `key` in `text`.
fn number_after(text: &str, key: &str) -> u32 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("{key} not in the recipe"))
        + key.len();
    let digits: String = text[at..].chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().unwrap()
}

/// The `moeconf` commands of a YAML block (list items and `run:` steps).
fn yaml_commands(yaml: &str) -> Vec<String> {
    yaml.lines()
        .map(|l| l.trim().trim_start_matches("- ").trim_start_matches("run: "))
        .filter(|l| l.starts_with("moeconf "))
        .map(String::from)
        .collect()
}

fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let (w, m) = (t.path().join("whole"), t.path().join("sharded"));
    std::fs::create_dir(&w).unwrap();
    std::fs::create_dir(&m).unwrap();
    (t, w, m)
}

#[test]
fn slurm_job_array_recipe() {
    let b = blocks();
    let shard = &b["slurm shard"];
    let last = number_after(shard, "#SBATCH --array=0-");
    let n = last + 1;
    assert!(n >= 2);
    let (_t, whole, sharded) = dirs();
    for i in 0..n {
        let env = [
            ("SLURM_ARRAY_TASK_ID", i.to_string()),
            ("SLURM_ARRAY_TASK_COUNT", n.to_string()),
        ];
        bash(&sharded, shard, &env);
    }
    assert_eq!(
        std::fs::read_dir(sharded.join("parts")).unwrap().count(),
        n as usize
    );
    bash(&sharded, &b["slurm merge"], &[]);
    bash(&whole, &b["slurm unsharded"], &[]);
    same_outputs(&whole, &sharded, &["sweep.json", "sweep.txt"]);
}

#[test]
fn kubernetes_indexed_job_recipe() {
    let b = blocks();
    let job = &b["k8s shard"];
    assert!(job.contains("completionMode: Indexed"));
    let n = number_after(job, "completions: ");
    let shard = yaml_commands(job);
    let merge = yaml_commands(&b["k8s merge"]);
    assert_eq!((shard.len(), merge.len()), (1, 1), "one command per container");
    let (_t, whole, sharded) = dirs();
    for i in 0..n {
        bash(&sharded, &shard[0], &[("JOB_COMPLETION_INDEX", i.to_string())]);
    }
    bash(&sharded, &merge[0], &[]);
    bash(&whole, &b["k8s unsharded"], &[]);
    same_outputs(
        &whole,
        &sharded,
        &["cal.txt", "cal/calibration.json", "cal/basin_counts.tsv"],
    );
}

#[test]
fn github_actions_matrix_recipe() {
    let b = blocks();
    let workflow = &b["github"];
    let (shard_job, merge_job) = workflow.split_once("\n  merge:\n").expect("a merge job");
    let line = shard_job
        .lines()
        .find_map(|l| l.trim().strip_prefix("shard: ["))
        .expect("matrix.shard");
    let values: Vec<&str> = line.trim_end_matches(']').split(',').map(str::trim).collect();
    assert!(values.len() >= 2);
    let shard = yaml_commands(shard_job);
    let merge = yaml_commands(merge_job);
    assert_eq!((shard.len(), merge.len()), (1, 1));
    let (_t, whole, sharded) = dirs();
    for v in &values {
        bash(&sharded, &shard[0].replace("${{ matrix.shard }}", v), &[]);
    }
    bash(&sharded, &merge[0], &[]);
    bash(&whole, &b["github unsharded"], &[]);
    same_outputs(&whole, &sharded, &["sweep.json", "sweep.html", "sweep.txt"]);
}
