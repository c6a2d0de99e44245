//! Protocol 1, native replay (paper section 3.1): every replay prompt runs
//! twice natively into full traces (`capture all`); routes, token ids, text
//! and every fingerprint (the trace root) must be identical, and the diff
//! engine must call the pair equivalent.

use std::path::Path;

use moeconf_bisect::{diff, DiffOptions, Verdict};
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Component;
use moeconf_fixtures::Prompt;
use moeconf_schema::Trace;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::jobs::{decode, JobOut, Jobs, Params};
use crate::{frac, CalibrateError, Claim, Ctx, Result, Section, Table, TraceRequest};

/// One replayed prompt: the result of one job.
#[derive(Serialize, Deserialize)]
struct Row {
    id: String,
    tokens: usize,
    records: usize,
    root_equal: bool,
    tokens_equal: bool,
    text_equal: bool,
    routes_equal: bool,
    verdict_equivalent: bool,
}

fn routes(t: &Trace) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for (i, r) in t.records()?.iter().enumerate() {
        if Component::RouterTopk.matches(&r.coord.path) {
            out.push(t.payload_verified(i)?.map(|p| p.to_vec()).unwrap_or_default());
        }
    }
    Ok(out)
}

fn open(path: &Path) -> Result<Trace> {
    Trace::open_verified(path).map_err(|source| CalibrateError::Open {
        path: path.to_path_buf(),
        source,
    })
}

fn one(ctx: &Ctx, id: &str, text: &str) -> Result<Row> {
    let ids = ctx.encode(text)?;
    let dir = ctx.out.join("traces");
    let paths = [
        dir.join(format!("replay-{id}-a.bin")),
        dir.join(format!("replay-{id}-b.bin")),
    ];
    let mut states = Vec::new();
    for p in &paths {
        states.push(ctx.write_trace(TraceRequest {
            prompt: text,
            prompt_ids: &ids,
            tokens: ctx.sizes.tokens,
            combine: &NativeCombine,
            faults: None,
            notes: vec![],
            path: p,
        })?);
    }
    let (a, b) = (open(&paths[0])?, open(&paths[1])?);
    let report = diff(&a, &b, &DiffOptions::default())?;
    let (ta, tb) = (
        ctx.decode(&states[0].generated)?,
        ctx.decode(&states[1].generated)?,
    );
    let row = Row {
        id: id.to_string(),
        tokens: states[0].generated.len(),
        records: a.record_count() as usize,
        root_equal: a.root() == b.root(),
        tokens_equal: states[0].generated == states[1].generated,
        text_equal: ta == tb,
        routes_equal: routes(&a)? == routes(&b)?,
        verdict_equivalent: report.verdict == Verdict::Equivalent,
    };
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    Ok(row)
}

/// Protocol 1's jobs: one per replay prompt.
struct Replay {
    prompts: Vec<Prompt>,
}

impl Jobs for Replay {
    fn count(&self) -> usize {
        self.prompts.len()
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut> {
        let p = &self.prompts[job];
        JobOut::of(&one(ctx, &p.id, &p.text)?)
    }
}

/// Plans protocol 1.
pub fn plan(ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    let prompts: Vec<_> = moeconf_fixtures::replay_prompts()
        .into_iter()
        .take(ctx.sizes.replay_prompts)
        .collect();
    ctx.note(&format!("[1] native replay: {} prompts × 2 runs", prompts.len()));
    Ok(Box::new(Replay { prompts }))
}

/// Assembles protocol 1 from its job results.
pub fn assemble(_params: &Params, results: &[Value]) -> Result<Vec<Section>> {
    let rows: Vec<Row> = decode("replay", results)?;
    let mut t = Table::new(
        "replay",
        "Native-reference replay (section 3.1): each prompt run twice",
        &[
            "Prompt",
            "Tokens",
            "Records",
            "Routes",
            "Token ids",
            "Text",
            "All fingerprints (root)",
            "Diff",
        ],
    );
    let yes = |b: bool| if b { "identical" } else { "DIFFER" }.to_string();
    for r in &rows {
        t.row(vec![
            r.id.clone(),
            r.tokens.to_string(),
            r.records.to_string(),
            yes(r.routes_equal),
            yes(r.tokens_equal),
            yes(r.text_equal),
            yes(r.root_equal),
            if r.verdict_equivalent {
                "equivalent"
            } else {
                "DIVERGENT"
            }
            .into(),
        ]);
    }
    let ok = rows
        .iter()
        .filter(|r| r.root_equal && r.tokens_equal && r.text_equal && r.routes_equal && r.verdict_equivalent)
        .count();
    let json = json!({
        "prompts": rows.len(),
        "identical": ok,
        "rows": rows.iter().map(|r| json!({
            "id": r.id, "tokens": r.tokens, "records": r.records, "root_equal": r.root_equal,
            "tokens_equal": r.tokens_equal, "text_equal": r.text_equal, "routes_equal": r.routes_equal,
            "diff_equivalent": r.verdict_equivalent,
        })).collect::<Vec<_>>(),
    });
    Ok(vec![Section {
        key: "replay".into(),
        tables: vec![t],
        json,
        claims: vec![Claim::new(
            "native_replay_identical",
            ok == rows.len() && !rows.is_empty(),
            format!("{} prompts replayed bitwise identically", frac(ok, rows.len())),
        )],
    }])
}
