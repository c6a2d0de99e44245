//! `moeconf certify`: the exactness certificate of every captured MoE event
//! (the computation and its reports are `moeconf_bisect::certify`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use moeconf_bisect::certify::{
    certify_within, CertifyLimits, Family, DEFAULT_MAX_EVENT_WORK, DEFAULT_MAX_TOTAL_WORK,
};
use moeconf_contract::{AggregationContract, Order};
use moeconf_schema::Trace;

use crate::args::Format;
use crate::output::{print_json, print_text};

const CERTIFY_EXAMPLES: &str = "Examples:
  moeconf run --prompt \"why the sheep\" --capture all -o full.bin
  moeconf certify full.bin
  moeconf certify full.bin --contract c,a,b
  moeconf certify full.bin --contract c,b --format json > cert.json

Contracts are families (native, p32, c, a, b, exact, tree, f64, exact-fused, ...); their own
order is ignored: every one of the k! orders (k <= 8) is evaluated. The work of an event is
k! x D order-values (D values per term); before anything is evaluated, each event must stay
within --max-event-work and all events and families together within --max-work, else certify
stops with an error (never a partial certificate).

Exit codes: 0 every MoE event certified, 1 the report covers only the events that keep
payloads (the others are counted as skipped), 2 error. `distinct` is the number of
bitwise-distinct MoE outputs over all orders (1 = order-invariant on this event); a proof says
why invariance holds for any order (exact accumulator, or every partial sum exactly
representable).";

/// Arguments of `moeconf certify`.
#[derive(Debug, clap::Args)]
#[command(after_help = CERTIFY_EXAMPLES)]
pub struct CertifyArgs {
    /// The trace (written with `moeconf run --capture all`, or any trace with L4 payloads of
    /// moe.term.* and moe.shared).
    pub trace: PathBuf,
    /// Contract families to certify, comma-separated (e.g. c,a,b).
    #[arg(long, value_delimiter = ',', default_value = "c")]
    pub contract: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Print only the summary (text format).
    #[arg(long)]
    pub summary_only: bool,
    /// Largest k! x D of one event (its distinct outputs are held in memory, up to 4 bytes each).
    #[arg(long, value_name = "ORDER_VALUES", default_value_t = DEFAULT_MAX_EVENT_WORK)]
    pub max_event_work: u64,
    /// Largest k! x D summed over every event and contract family.
    #[arg(long, value_name = "ORDER_VALUES", default_value_t = DEFAULT_MAX_TOTAL_WORK)]
    pub max_work: u64,
}

/// Runs `moeconf certify`.
pub fn run(a: &CertifyArgs) -> anyhow::Result<ExitCode> {
    let mut families = Vec::new();
    for name in a.contract.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let c = AggregationContract::parse(name).map_err(|e| anyhow::anyhow!("--contract {name:?}: {e}"))?;
        if c.operand == moeconf_contract::OperandPrecision::Fma {
            bail!(
                "--contract {name:?}: operand=fma multiplies each expert's output by its gate inside the sum;                  a trace records the gate-weighted terms, not those outputs, so it cannot be certified from one"
            );
        }
        families.push(Family {
            name: name.to_string(),
            contract: c.with_order(Order::Identity),
        });
    }
    if families.is_empty() {
        bail!("--contract: give at least one contract family (e.g. c,a,b)");
    }
    // Every payload is re-hashed: a certificate is never computed from a
    // corrupted term. The error names the file (no context to add).
    let trace = Trace::open_verified(&a.trace)?;
    let limits = CertifyLimits {
        max_event_work: a.max_event_work,
        max_total_work: a.max_work,
    };
    let report = certify_within(&trace, &families, limits)?;
    match a.format {
        Format::Json => print_json(&report.to_json())?,
        Format::Text => print_text(&report.render_text(a.summary_only))?,
    }
    // A certificate of part of the events is reported, never a success.
    if report.without_payload > 0 {
        eprintln!(
            "moeconf: {}: incomplete: {} of {} MoE events keep no payloads and were not certified (exit 1); \
             re-run with --capture all",
            a.trace.display(),
            report.without_payload,
            report.without_payload + report.rows.len()
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
