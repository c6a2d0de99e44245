//! `moeconf --version`, `moeconf completions` and `moeconf man`: what a
//! packager and a script rely on.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moeconf");

fn moeconf(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("spawn moeconf")
}

#[test]
fn long_version_names_the_release_commit_and_formats() {
    let o = moeconf(&["--version"]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("moeconf {}", env!("CARGO_PKG_VERSION")));
    let keys: Vec<&str> = lines[1..].iter().map(|l| l.split(": ").next().unwrap()).collect();
    assert_eq!(
        keys,
        [
            "commit",
            "trace formats read",
            "trace formats written",
            "baseline schema"
        ]
    );
    // -V is the release alone, for scripts that only compare releases.
    let short = moeconf(&["-V"]);
    assert_eq!(
        String::from_utf8(short.stdout).unwrap().trim_end(),
        format!("moeconf {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn completions_cover_every_subcommand_and_option_for_each_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let o = moeconf(&["completions", shell]);
        assert_eq!(o.status.code(), Some(0), "{shell}");
        let script = String::from_utf8(o.stdout).unwrap();
        // Option names without their dashes: fish writes `-l bless`.
        for word in [
            "gate",
            "diff",
            "invariance",
            "bless",
            "allow-incomplete",
            "prompt-tokens",
        ] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
    let o = moeconf(&["completions", "tcsh"]);
    assert_eq!(o.status.code(), Some(2), "an unknown shell is a usage error");
}

#[test]
fn bash_completion_script_is_valid_bash() {
    let o = moeconf(&["completions", "bash"]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moeconf.bash");
    std::fs::write(&path, &o.stdout).unwrap();
    let check = Command::new("bash").arg("-n").arg(&path).output().expect("bash");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

#[test]
fn man_writes_one_page_per_command_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let o = moeconf(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    for page in [
        "moeconf.1",
        "moeconf-gate.1",
        "moeconf-diff.1",
        "moeconf-export-gguf.1",
        "moeconf-bench-runtime.1",
    ] {
        assert!(names.iter().any(|n| n == page), "{page} missing from {names:?}");
    }
    assert!(
        names.iter().all(|n| n.ends_with(".1")),
        "only pages, no temporaries: {names:?}"
    );
    let gate = std::fs::read_to_string(dir.path().join("moeconf-gate.1")).unwrap();
    assert!(gate.starts_with(".ie") || gate.contains(".TH"), "roff page");
    assert!(gate.contains("bless"), "the gate page documents --bless");
}

#[test]
fn man_refuses_a_missing_directory_and_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let o = moeconf(&["man", "--dir", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let o = moeconf(&["man", "--dir", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a directory"));
}
