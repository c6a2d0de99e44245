//! `moeconf completions SHELL` and `moeconf man --dir DIR`: shell completion
//! scripts and man pages generated from the same clap definitions that parse
//! the command line (clap_complete, clap_mangen), so neither can drift from
//! the options.

use crate::cli::Cli;
use crate::output::check_outputs;
use clap::CommandFactory;
use moeconf_output::{write_all_checked, CheckedOutput, Inputs};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moeconf completions`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  moeconf completions bash > moeconf.bash   # source it, or copy it to ~/.local/share/bash-completion/completions/moeconf\n  moeconf completions zsh > _moeconf        # into a directory of $fpath\n  moeconf completions fish > moeconf.fish   # into ~/.config/fish/completions/"
)]
pub struct CompletionsArgs {
    /// The shell to write a completion script for (to standard output).
    pub shell: clap_complete::Shell,
}

/// Arguments of `moeconf man`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Writes moeconf.1 and one page per subcommand (moeconf-diff.1, moeconf-export-gguf.1, ...).\n\nExamples:\n  moeconf man --dir .   # then `man ./moeconf-gate.1`; to install: --dir ~/.local/share/man/man1"
)]
pub struct ManArgs {
    /// Directory to write the pages into (must exist). Every page is written atomically, and
    /// none is renamed into place until all are written.
    #[arg(long)]
    pub dir: PathBuf,
}

/// Runs `moeconf completions`.
pub fn run_completions(a: &CompletionsArgs) -> anyhow::Result<ExitCode> {
    let mut script = Vec::new();
    clap_complete::generate(a.shell, &mut Cli::command(), "moeconf", &mut script);
    std::io::stdout().lock().write_all(&script)?;
    Ok(ExitCode::SUCCESS)
}

/// Every man page of the grammar: `(file name, roff)`, the top level first.
pub fn man_pages() -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    let mut pages = Vec::new();
    collect(cmd, &mut pages)?;
    Ok(pages)
}

fn collect(cmd: clap::Command, pages: &mut Vec<(String, Vec<u8>)>) -> anyhow::Result<()> {
    let subs: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let man = clap_mangen::Man::new(cmd);
    let mut roff = Vec::new();
    man.render(&mut roff)?;
    pages.push((man.get_filename(), roff));
    for sub in subs {
        collect(sub, pages)?;
    }
    Ok(())
}

/// Runs `moeconf man`.
pub fn run_man(a: &ManArgs) -> anyhow::Result<ExitCode> {
    let meta = std::fs::metadata(&a.dir)
        .map_err(|e| anyhow::anyhow!("{}: cannot write man pages there: {e}", a.dir.display()))?;
    if !meta.is_dir() {
        anyhow::bail!(
            "{}: not a directory (--dir takes the directory to write the pages into)",
            a.dir.display()
        );
    }
    let pages = man_pages()?;
    let paths: Vec<PathBuf> = pages.iter().map(|(name, _)| a.dir.join(name)).collect();
    let refs: Vec<&std::path::Path> = paths.iter().map(PathBuf::as_path).collect();
    let outs = check_outputs(&refs, &Inputs::new())?;
    let writes: Vec<(&CheckedOutput, &[u8])> = outs
        .iter()
        .zip(&pages)
        .map(|(o, (_, b))| (o, b.as_slice()))
        .collect();
    write_all_checked(&writes)?;
    eprintln!("wrote {} man pages to {}", pages.len(), a.dir.display());
    Ok(ExitCode::SUCCESS)
}
