//! Human-readable rendering of a [`DiffReport`]: a verdict line first, one
//! compact section per level (each opened by one line of plain explanation),
//! and the summary line last.

use crate::explanation::CombineExplanation;
use crate::numeric::{IdComparison, NumericSummary, ValueComparison};
use crate::report::*;
use crate::textdiff::{describe_summary, render_inline};
use moeconf_fingerprint::Component;
use moeconf_output::escape::{multiline, text};
use std::fmt::Write;

struct Style {
    color: bool,
}

impl Style {
    fn paint(&self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn bold(&self, s: &str) -> String {
        self.paint("1", s)
    }
    fn red(&self, s: &str) -> String {
        self.paint("1;31", s)
    }
    fn green(&self, s: &str) -> String {
        self.paint("1;32", s)
    }
    fn dim(&self, s: &str) -> String {
        self.paint("2", s)
    }
    fn status(&self, st: LevelStatus) -> String {
        match st {
            LevelStatus::Match => self.green("match"),
            LevelStatus::Differ => self.red("DIFFER"),
            LevelStatus::NotCompared => self.dim("not compared"),
        }
    }
    fn inline(&self, ops: &[TextOp]) -> String {
        if !self.color {
            return render_inline(ops);
        }
        ops.iter()
            .map(|op| match op.tag.as_str() {
                "delete" => self.paint("31", &format!("[-{}-]", multiline(&op.text))),
                "insert" => self.paint("32", &format!("{{+{}+}}", multiline(&op.text))),
                _ => multiline(&op.text).into_owned(),
            })
            .collect()
    }
}

fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.6e}")
    } else {
        format!("{v}")
    }
}

/// A value of a record of `dtype` in the shortest form that reads back as
/// the same value of that dtype (two different values never print alike).
fn value(v: f64, dtype: &str) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    match dtype {
        // Exact in f32 (bf16 values are f32 values too).
        "f32" | "bf16" => format!("{:e}", v as f32),
        _ => format!("{v:e}"),
    }
}

fn opt_num(v: Option<f64>) -> String {
    v.map(num).unwrap_or_else(|| "?".into())
}

fn numeric_lines(out: &mut String, n: &NumericSummary) {
    let signs = match n.sign_changes {
        0 => String::new(),
        k if k == n.differing => format!(" (all {k} change sign)"),
        k => format!(" ({k} change sign)"),
    };
    let ulps = if n.sign_changes == n.differing {
        String::new()
    } else if n.sign_changes > 0 {
        format!(", max {} ulp among those that keep their sign", n.max_ulp)
    } else {
        format!(", max {} ulp", n.max_ulp)
    };
    let _ = writeln!(
        out,
        "      {} of {} values differ{signs}; max |Δ| {}{ulps}; would pass with atol ≥ {} (rtol 0) or rtol ≥ {} (atol 0)",
        n.differing,
        n.elements,
        num(n.max_abs_delta),
        num(n.min_atol),
        num(n.min_rtol)
    );
    if n.nan_mismatches > 0 {
        let _ = writeln!(out, "      {} values are NaN on one side only", n.nan_mismatches);
    }
    if let Some(w) = &n.worst {
        let sign = if w.reference != 0.0
            && w.candidate != 0.0
            && w.reference.is_sign_negative() != w.candidate.is_sign_negative()
        {
            " (sign change)"
        } else {
            ""
        };
        let apart = match w.ulps {
            Some(u) => format!(" ({u} ulp apart)"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "      worst element {:?}: reference {} vs candidate {}{apart}{sign}",
            w.index,
            value(w.reference, &n.dtype),
            value(w.candidate, &n.dtype)
        );
    }
}

/// [`numeric_lines`], for the tests of [`crate::numeric`].
#[cfg(test)]
pub(crate) fn numeric_lines_for_test(out: &mut String, n: &NumericSummary) {
    numeric_lines(out, n)
}

/// `[1, 2, 3]`, or `[1, 2, …] (40 ids)` when the list was cut.
fn id_list(v: &[i64], len: u64) -> String {
    let body = v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
    if (v.len() as u64) < len {
        format!("[{body}, …] ({len} ids)")
    } else {
        format!("[{body}]")
    }
}

fn ids_line(out: &mut String, c: &IdComparison) {
    let seq = format!(
        "{} -> {}",
        id_list(&c.reference, c.reference_len),
        id_list(&c.candidate, c.candidate_len)
    );
    if c.reordered {
        let _ = writeln!(
            out,
            "      the same {} ids in another order: {seq}",
            c.reference_len
        );
        return;
    }
    let set = |v: &[i64], n: u64| if n == 0 { "none".to_string() } else { id_list(v, n) };
    let _ = writeln!(
        out,
        "      ids {seq}: entering {}, leaving {}",
        set(&c.entering, c.entering_count),
        set(&c.leaving, c.leaving_count)
    );
}

/// How one record's two payloads compare, worded by what the values mean.
fn comparison_lines(out: &mut String, c: &ValueComparison) {
    match c {
        ValueComparison::Float(n) => numeric_lines(out, n),
        ValueComparison::Ids(i) => ids_line(out, i),
        ValueComparison::Counts { reference, candidate } => {
            let _ = match (reference.as_slice(), candidate.as_slice()) {
                ([r], [c]) => writeln!(out, "      value {r} -> {c}"),
                _ => writeln!(out, "      values {reference:?} -> {candidate:?}"),
            };
        }
        ValueComparison::Text {
            reference_bytes,
            candidate_bytes,
            first_difference,
        } => {
            let at = first_difference
                .map(|b| format!(", first difference at byte {b}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "      text of {reference_bytes} vs {candidate_bytes} bytes{at}"
            );
        }
    }
}

/// An input's status in words.
fn input_status(status: &str) -> &str {
    match status {
        "not_captured" => "not captured",
        "not_applicable" => "not applicable on this layer kind",
        "not_emitted" => "none emitted at this position",
        "storage_precision" => "match up to storage precision",
        "observed_differs" => "differs (a value only captures record, inside this operator's own arithmetic)",
        "absorbed_by_contracts" => {
            "differs, but each side's contract gives its own output from the other side's values too (absorbed by both contracts)"
        }
        "one_side" => "held by one side only (not compared)",
        "quantized_one_side" => {
            "quantized by one side only (the other side's precision profile has no quantization sites)"
        }
        s => s,
    }
}

/// One input in words, with who recomputed it.
fn input_words(i: &InputCheck) -> String {
    let mut s = format!("{} {}", i.input, input_status(&i.status));
    if let Some(side) = &i.recomputed {
        let by = if side == "both" {
            "both sides".to_string()
        } else {
            format!("the {side}")
        };
        s.push_str(&format!(" (recomputed by the capture on {by})"));
    }
    s
}

/// `sliding-window attention, hash-routed MoE`.
fn layer_kind_words(k: &LayerKind) -> String {
    let a = k.attention.as_deref().map(|a| match a {
        "sliding" => "sliding-window attention",
        "csa" => "compressed sparse attention (CSA)",
        "hca" => "heavily compressed attention (HCA)",
        other => other,
    });
    let f = k.ffn.as_deref().map(|f| match f {
        "score_routed" => "score-routed MoE",
        "hash_routed" => {
            "hash-routed MoE (experts are the token id's row of a fixed table: no selection margin)"
        }
        other => other,
    });
    [a, f].into_iter().flatten().collect::<Vec<_>>().join(", ")
}

fn header(out: &mut String, st: &Style, name: &str, what: &str, status: LevelStatus, explains: &str) {
    let _ = writeln!(out);
    let _ = writeln!(out, "{} {:<46} {}", st.bold(name), what, st.status(status));
    let _ = writeln!(out, "   {}", st.dim(explains));
}

impl DiffReport {
    /// Renders the report for a terminal; `color` adds ANSI colors (callers
    /// decide: only on a TTY and when `NO_COLOR` is unset).
    pub fn render_text(&self, color: bool) -> String {
        let st = Style { color };
        let mut o = String::new();
        self.render_verdict(&mut o, &st);
        self.render_incomplete(&mut o, &st);
        self.render_traces(&mut o, &st);
        self.render_divergences(&mut o, &st);
        self.render_passed(&mut o, &st);
        let l = &self.levels;
        render_l0(&mut o, &st, &l.l0);
        render_l1(&mut o, &st, &l.l1);
        render_l2(&mut o, &st, &l.l2);
        render_l3(&mut o, &st, &l.l3);
        render_l4(&mut o, &st, &l.l4);
        let _ = writeln!(o);
        let _ = writeln!(o, "{}", st.bold(&self.summary));
        o
    }

    /// The verdict line.
    fn render_verdict(&self, o: &mut String, st: &Style) {
        match (self.verdict, &self.first_divergence) {
            (Verdict::Equivalent, _) => {
                let _ = writeln!(
                    o,
                    "{} the candidate executes the same way as the reference at every compared level ({})",
                    st.green("EQUIVALENT:"),
                    self.compared_levels.join(", ")
                );
            }
            (Verdict::Divergent, Some(f)) => {
                let mut at = format!("step {} position {}", f.step, f.position);
                if let Some(l) = f.layer {
                    at.push_str(&format!(" layer {l}"));
                }
                let only = if f.present_in == "both" {
                    String::new()
                } else if crate::quantization::is_site(&f.operator) {
                    format!(", {}", self.quantized_only_words(&f.present_in))
                } else {
                    format!(", held only by the {}", f.present_in)
                };
                let how = match self.divergences.first().and_then(|d| d.absorbed_at) {
                    Some(Absorption::Contracts) => ", absorbed by both sides' contracts at the combine",
                    Some(Absorption::Consumer) => ", absorbed by the combine, which matches",
                    Some(Absorption::Checkpoint) => ", absorbed before the next checkpoint",
                    None => "",
                };
                let _ = writeln!(
                    o,
                    "{} the candidate departs from the reference at {at}, in {} ({}){only}{how}",
                    st.red("DIVERGENT:"),
                    f.operator,
                    f.level
                );
            }
            (Verdict::Divergent, None) => {
                let coverage = !self.uncompared_levels.is_empty() || !self.unmatched_steps.is_empty();
                let what = match (self.uncompared_levels.is_empty(), self.unmatched_steps.is_empty()) {
                    _ if !coverage && !self.one_side_only.is_empty() => "records",
                    _ if !coverage => "",
                    (false, false) => "levels and steps",
                    (false, true) => "levels",
                    _ => "steps",
                };
                let mut line = String::new();
                if !what.is_empty() {
                    line.push_str(&format!("the traces cover different {what}"));
                }
                if !self.storage_precision.is_empty() {
                    line.push_str(if line.is_empty() {
                        "the traces differ only by storage precision (one side stored coarser values): no difference in execution for the walk to localize"
                    } else {
                        "; every other difference is storage precision (one side stored coarser values), not a difference in execution that the walk could localize"
                    });
                }
                let _ = writeln!(o, "{} {line}", st.red("DIVERGENT:"));
            }
        }
    }

    /// Under the verdict, one line per side that lacks steps of its run:
    /// the verdict covers only the steps present.
    fn render_incomplete(&self, o: &mut String, st: &Style) {
        for i in &self.incomplete {
            let path = match i.side.as_str() {
                "reference" => &self.reference.path,
                _ => &self.candidate.path,
            };
            let _ = writeln!(
                o,
                "{} {} {}: {}; only the steps present were compared (--allow-incomplete)",
                st.red("INCOMPLETE:"),
                i.side,
                text(path),
                i.note
            );
        }
    }

    /// The two traces, their binding differences and unmatched steps. File
    /// names and binding strings are written in the visible form of
    /// [`moeconf_output::escape::text`] (no raw newline or bidi control).
    fn render_traces(&self, o: &mut String, st: &Style) {
        for (label, t) in [("reference", &self.reference), ("candidate", &self.candidate)] {
            let _ = writeln!(
                o,
                "  {label}  {}  (runtime {}, precision {}, contract {}, schedule {}; {} steps)",
                text(&t.path),
                text(&t.runtime),
                text(&t.precision),
                text(&t.contract),
                text(&t.schedule),
                t.steps
            );
        }
        if self.reference.precision != self.candidate.precision {
            let _ = writeln!(
                o,
                "  {} the reference ran precision profile {}, the candidate {}: their numerics differ by design (docs/operators.md §1), so the traces part where the two profiles first compute differently",
                st.bold("different precision profiles:"),
                text(&self.reference.precision),
                text(&self.candidate.precision)
            );
        }
        for d in &self.comparability.expected_differences {
            let _ = writeln!(
                o,
                "  expected difference  {}: {} -> {}",
                d.field,
                text(&d.reference),
                text(&d.candidate)
            );
        }
        for d in &self.comparability.forced_over {
            let _ = writeln!(
                o,
                "  {} {}: {} -> {}",
                st.red("FORCED over a binding difference"),
                d.field,
                text(&d.reference),
                text(&d.candidate)
            );
        }
        if !self.unmatched_steps.is_empty() {
            let _ = writeln!(o, "  steps present in one trace only: {:?}", self.unmatched_steps);
        }
        for u in &self.uncompared_levels {
            let _ = writeln!(
                o,
                "  level {} captured only by the {} (not compared)",
                u.level, u.present_in
            );
        }
    }
}

impl DiffReport {
    /// What the walk passed: storage precision and one-sided records.
    fn render_passed(&self, o: &mut String, st: &Style) {
        if !self.storage_precision.is_empty() {
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "{}: {} group(s) of records differ only because one side stored coarser values",
                st.bold("Storage precision"),
                self.storage_precision.len()
            );
            let _ = writeln!(
                o,
                "   {}",
                st.dim("Their consumers count them as matching inputs (\"inputs match up to storage precision\"); the traces are still not equivalent.")
            );
            for g in &self.storage_precision {
                let finer = if g.coarser == "candidate" {
                    "reference"
                } else {
                    "candidate"
                };
                let _ = writeln!(
                    o,
                    "   {}: the {} stores {}; its values are {} of the {}'s in {} of {} values ({} changed by the rounding), {} records, first {}",
                    st.bold(&g.component),
                    g.coarser,
                    g.coarse_storage,
                    g.rounding,
                    finer,
                    g.values,
                    g.values,
                    g.rounded_values,
                    g.records,
                    g.first.describe()
                );
            }
        }
        if !self.quantization_one_side.is_empty() {
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "{}: {} component(s) (reference precision {}, candidate precision {}; the side without them computes the identity there)",
                st.bold("Quantization sites held by one side only"),
                self.quantization_one_side.len(),
                self.reference.precision,
                self.candidate.precision
            );
            for g in &self.quantization_one_side {
                let _ = writeln!(
                    o,
                    "   {} only in the {}: {} records, first {}",
                    st.bold(&g.component),
                    g.present_in,
                    g.records,
                    g.first.describe()
                );
            }
        }
        if !self.one_side_only.is_empty() {
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "{}: {} component(s) (a coverage difference; not compared, not counted as divergences)",
                st.bold("Held by one side only"),
                self.one_side_only.len()
            );
            for g in &self.one_side_only {
                let _ = writeln!(
                    o,
                    "   {} only in the {}: {} records, first {}",
                    st.bold(&g.component),
                    g.present_in,
                    g.records,
                    g.first.describe()
                );
            }
        }
    }
}

impl DiffReport {
    /// `quantized by the reference only (the candidate's precision profile
    /// bf16 has no quantization sites)`: a headline at a quantization site
    /// one side alone holds.
    pub(crate) fn quantized_only_words(&self, present_in: &str) -> String {
        let (other, precision) = if present_in == "reference" {
            ("candidate", &self.candidate.precision)
        } else {
            ("reference", &self.reference.precision)
        };
        format!("quantized by the {present_in} only (the {other}'s precision profile {precision} has no quantization sites)")
    }

    /// Every divergence in execution order, each with its kind and the
    /// checkpoint that decides it.
    fn render_divergences(&self, o: &mut String, st: &Style) {
        if self.divergences.is_empty() {
            return;
        }
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{} in execution order: {}",
            st.bold("Divergences"),
            self.divergences.len()
        );
        let _ = writeln!(
            o,
            "   {}",
            st.dim("Each is a record that differs while its inputs match. Propagating: a later checkpoint it can reach (post-mHC layer state at its position or a later one, the step's token, or for persistent state a later step's layer state) differs. Absorbed: rounding erased it before the next checkpoint.")
        );
        for (i, d) in self.divergences.iter().enumerate() {
            // After a propagating divergence, the checkpoints it reaches may
            // differ by its doing: an absorbed one says only that none of
            // the others does.
            let after_propagating = self.divergences[..i]
                .iter()
                .any(|e| e.kind == Some(DivergenceKind::Propagating));
            let how = match (d.kind, &d.checkpoint) {
                (Some(DivergenceKind::Propagating), Some(c)) if c.path == d.at.path && c.step == d.at.step => {
                    "propagating: it is a checkpoint".to_string()
                }
                (Some(DivergenceKind::Propagating), Some(c)) => {
                    format!("propagating: the first later checkpoint that differs is {}", c.describe())
                }
                (Some(DivergenceKind::Propagating), None) => "propagating".to_string(),
                (Some(DivergenceKind::Absorbed), Some(c)) if d.absorbed_at == Some(Absorption::Contracts) => format!(
                    "absorbed by both contracts at {}: each side's combine rule gives its own output from the other side's inputs too; what differs there is the contract",
                    c.describe_location()
                ),
                (Some(DivergenceKind::Absorbed), Some(c)) if d.absorbed_at == Some(Absorption::Consumer) => format!(
                    "absorbed: its only consumer, {}, matches (whatever differs later does not come from it)",
                    c.describe_location()
                ),
                (Some(DivergenceKind::Absorbed), Some(c)) if after_propagating => format!(
                    "absorbed: the next checkpoint, {}, matches, and no later one differs but those a divergence above can reach",
                    c.describe_location()
                ),
                (Some(DivergenceKind::Absorbed), Some(c)) => format!(
                    "absorbed: the next checkpoint, {}, matches, and no later one differs",
                    c.describe_location()
                ),
                (Some(DivergenceKind::Absorbed), None) if d.at.level == "L2" => {
                    "absorbed: no layer checkpoint of a later traced step differs (the state may still be read later)"
                        .to_string()
                }
                (Some(DivergenceKind::Absorbed), None) => "absorbed: no later checkpoint differs".to_string(),
                (None, _) if after_propagating => "not classified (the layer-state checkpoints are not compared, or the one that would show it differs where a divergence above reaches)".to_string(),
                (None, _) => "not classified (the layer-state checkpoints are not compared)".to_string(),
            };
            let _ = writeln!(
                o,
                "   {}. {} ({}): {}",
                i + 1,
                st.bold(&d.at.describe()),
                d.at.level,
                how
            );
            if let Some(c) = &d.coverage {
                let _ = writeln!(
                    o,
                    "      localization ends at this record ({}, the finest level both traces captured here): {}; its operator cannot be separated from these inputs",
                    c.finest_level,
                    crate::coverage::needed_words(c)
                );
            } else if !d.inputs_match {
                let _ = writeln!(o, "      (some of its inputs differ too)");
            } else if let Some(n) = &d.inputs_note {
                let _ = writeln!(o, "      inputs match ({n})");
            }
            if let Some(side) = &d.recomputed {
                let _ = writeln!(
                    o,
                    "      this record was recomputed by the capture on the {side} side(s), not observed from the backend"
                );
            }
            if let Some(b) = &d.beyond_storage_precision {
                let finer = if b.coarser == "candidate" {
                    "reference"
                } else {
                    "candidate"
                };
                let _ = writeln!(
                    o,
                    "      beyond storage precision: the {} holds bf16 values; after R_BF16 of the {}'s, {} of {} values still differ",
                    b.coarser, finer, b.differing_values, b.values
                );
            }
            let in_l4 = self.levels.l4.localized.as_ref().is_some_and(|l| l.at == d.at);
            match &d.comparison {
                Some(_) if in_l4 => {
                    let _ = writeln!(o, "      (its values: see L4 below)");
                }
                Some(c) => comparison_lines(o, c),
                None => {}
            }
            if d.layer_kind
                .as_ref()
                .is_some_and(|k| k.ffn.as_deref() == Some("hash_routed"))
                && !in_l4
                && moeconf_fingerprint::Component::RouterTopk.matches(&d.at.path)
            {
                let _ = writeln!(
                    o,
                    "      hash-routed layer: the experts are the token id's row of a fixed table (no selection margin)"
                );
            }
        }
        let rest = match self.rest.as_str() {
            "none" if self.divergences.len() == 1 => {
                "   it is the only divergence: every other differing record follows from it without reaching a checkpoint"
            }
            "none" => "   every other differing record follows from these without reaching a checkpoint",
            "propagates" if self.divergences.last().is_some_and(|d| d.kind == Some(DivergenceKind::Absorbed)) => {
                "   later differences reach a checkpoint through the persistent state carried from these; they are not separated further"
            }
            "propagates" => "   every later difference can follow from a propagating one above (what it can reach: its position and later ones, later layers; in later steps its own and later layers, and everything once a fed token differs); they are not separated further",
            "limit" => "   more divergences follow than the report lists",
            _ => "",
        };
        if !rest.is_empty() {
            let _ = writeln!(o, "{rest}");
        }
    }
}

/// L0: the first different generated token and the text diff.
fn render_l0(o: &mut String, st: &Style, l0: &L0Report) {
    header(o, st, "L0", "tokens / text", l0.status, &l0.explains);
    if l0.status != LevelStatus::Differ {
        return;
    }
    if let Some(n) = l0.ordinal {
        let tok = |id: Option<i64>, text: &Option<String>| {
            format!(
                "{}{}",
                id.map(|v| v.to_string()).unwrap_or_else(|| "?".into()),
                text.as_ref().map(|t| format!(" {t:?}")).unwrap_or_default()
            )
        };
        let _ = writeln!(
            o,
            "   first different generated token: #{n} (predicted by step {}): reference {} vs candidate {}",
            n - 1,
            tok(l0.reference_token, &l0.reference_token_text),
            tok(l0.candidate_token, &l0.candidate_token_text)
        );
    } else if let Some(f) = &l0.first {
        let _ = writeln!(o, "   first differing record: {}", f.describe());
    }
    if !l0.text_diff.is_empty() {
        let _ = writeln!(
            o,
            "   text ([-reference only-] {{+candidate only+}}): {}",
            st.inline(&l0.text_diff)
        );
    }
    if let Some(s) = &l0.text_summary {
        let _ = writeln!(o, "   text: no inline diff: {}", describe_summary(s));
    }
}

/// L1: the first differing step, top-1 change, margins and logits.
fn render_l1(o: &mut String, st: &Style, l1: &L1Report) {
    header(o, st, "L1", "logits / top-k margins", l1.status, &l1.explains);
    let Some(f) = &l1.first else {
        return;
    };
    let _ = writeln!(
        o,
        "   first differing step: {} (position {}; differing: {}); {} of the steps differ",
        f.step,
        f.position,
        l1.differing_paths.join(", "),
        l1.differing_steps
    );
    let top = |t: Option<[i64; 2]>| {
        t.map(|t| format!("{} > {}", t[0], t[1]))
            .unwrap_or_else(|| "?".into())
    };
    let _ = writeln!(
        o,
        "   top-1 token {}; reference {} (margin {}), candidate {} (margin {})",
        match l1.argmax_changed {
            Some(true) => "CHANGED",
            Some(false) => "unchanged",
            None => "unknown",
        },
        top(l1.reference_top2),
        opt_num(l1.reference_margin),
        top(l1.candidate_top2),
        opt_num(l1.candidate_margin)
    );
    if let Some(n) = &l1.logits {
        let _ = writeln!(o, "   {}:", Component::LmLogits.path());
        numeric_lines(o, n);
    }
}

/// L2: the first differing decode boundary, per layer.
fn render_l2(o: &mut String, st: &Style, l2: &L2Report) {
    header(o, st, "L2", "full persistent state", l2.status, &l2.explains);
    let Some(s) = l2.step else {
        return;
    };
    let _ = writeln!(
        o,
        "   first differing decode boundary: after step {s}; {} of the boundaries differ",
        l2.differing_steps
    );
    for layer in &l2.layers {
        let comps: Vec<String> = layer
            .components
            .iter()
            .map(|c| match (c.differing_values, c.values) {
                (Some(d), Some(n)) => format!("{} ({d}/{n} values)", c.path),
                _ if c.present_in != "both" => format!("{} (only in {})", c.path, c.present_in),
                _ => c.path.clone(),
            })
            .collect();
        let name = layer
            .layer
            .map(|l| format!("layer {l}"))
            .unwrap_or_else(|| "global".into());
        let _ = writeln!(o, "   {name}: {}", comps.join(", "));
    }
    if !l2.identical_layers.is_empty() {
        let _ = writeln!(o, "   identical layers: {}", ranges(&l2.identical_layers));
    }
}

/// L3: the first differing post-mHC checkpoint and the first route change.
fn render_l3(o: &mut String, st: &Style, l3: &L3Report) {
    header(
        o,
        st,
        "L3",
        "layer state (post-mHC) and routes",
        l3.status,
        &l3.explains,
    );
    if let Some(f) = &l3.first {
        let _ = writeln!(
            o,
            "   first differing checkpoint: {} ({} half)",
            f.describe(),
            l3.half.map(|h| h.name()).unwrap_or("?")
        );
        match (&l3.last_matched_checkpoint, l3.earlier_checkpoints) {
            (Some(m), _) => {
                let _ = writeln!(
                    o,
                    "   every earlier checkpoint of step {} matches; last match: {}",
                    f.step,
                    m.describe()
                );
            }
            (None, Some(EarlierCheckpoints::None)) => {
                let _ = writeln!(o, "   it is the first checkpoint of step {}", f.step);
            }
            (None, _) => {
                let _ = writeln!(
                    o,
                    "   every earlier checkpoint of step {} matches; the last one is not where execution order puts it",
                    f.step
                );
            }
        }
        if let Some(n) = &l3.numeric {
            numeric_lines(o, n);
        }
    } else if let Some(f) = &l3.first_record {
        let _ = writeln!(
            o,
            "   first differing record: {} (no post-mHC checkpoint differs)",
            f.describe()
        );
    }
    if l3.status != LevelStatus::Differ {
        return;
    }
    match &l3.route {
        Some(r) => render_route(o, r),
        None => {
            let _ = writeln!(o, "   routes: identical everywhere");
        }
    }
}

/// The first route difference: experts entering and leaving (or the same
/// experts reordered), with the selection margins of a score-routed layer.
fn render_route(o: &mut String, r: &RouteDivergence) {
    let margins = match r.hash_routed {
        Some(true) => {
            "hash-routed layer: the experts are the token id's row of a fixed table, no selection margin"
                .to_string()
        }
        _ => format!(
            "margins {} vs {}",
            opt_num(r.reference_margin),
            opt_num(r.candidate_margin)
        ),
    };
    if r.reordered {
        let _ = writeln!(
            o,
            "   first route difference: {}: the same experts in another order {:?} -> {:?} ({margins})",
            r.at.describe(),
            r.reference_experts,
            r.candidate_experts
        );
    } else {
        let _ = writeln!(
            o,
            "   first route change: {}: experts {:?} -> {:?} (entering {:?}, leaving {:?}; {margins})",
            r.at.describe(),
            r.reference_experts,
            r.candidate_experts,
            r.entering,
            r.leaving
        );
    }
}

/// L4: the localized operator, its inputs, and contract inference.
fn render_l4(o: &mut String, st: &Style, l4: &L4Report) {
    header(o, st, "L4", "operator intermediates", l4.status, &l4.explains);
    if let Some(loc) = &l4.localized {
        let _ = writeln!(
            o,
            "   localized operator: {} — {}",
            st.bold(&loc.at.describe()),
            match (&loc.coverage, loc.inputs_match, &loc.inputs_note) {
                (Some(c), true, _) => format!(
                    "localization ends here, at {} (the finest level both traces captured): its output differs, the inputs both traces hold match, and {}",
                    c.finest_level,
                    crate::coverage::needed_words(c)
                ),
                (None, true, None) => "its output differs while its inputs match".to_string(),
                (None, true, Some(n)) => format!("its output differs while its inputs match ({n})"),
                (_, false, _) => "first differing operator (some inputs differ too)".to_string(),
            }
        );
        let ins: Vec<String> = loc.inputs.iter().map(input_words).collect();
        if !ins.is_empty() {
            let _ = writeln!(o, "   inputs: {}", ins.join("; "));
        }
        if let (Some(inside), true) = (&loc.uncaptured_steps, loc.inputs_match) {
            let _ = writeln!(
                o,
                "   inside it, not captured: {inside}; the cause is one of them or the operator's own arithmetic"
            );
        }
        if let Some(c) = &loc.coverage {
            for n in &c.needed {
                let why = n
                    .reason
                    .as_deref()
                    .map(|r| format!(" (its capture says: {r})"))
                    .unwrap_or_default();
                let _ = writeln!(
                    o,
                    "   to localize further, the {} must capture {} ({} record(s) on the other side){why}",
                    n.missing_in, n.record, n.held_by_other
                );
            }
        }
        if let Some(k) = &loc.layer_kind {
            let _ = writeln!(o, "   layer kind: {}", layer_kind_words(k));
        }
        if let Some(c) = &loc.comparison {
            comparison_lines(o, c);
        }
    } else if let Some(f) = &l4.first {
        let _ = writeln!(o, "   first differing record: {}", f.describe());
    }
    if let Some(c) = &l4.contract {
        render_contract(o, st, c);
    }
}

/// Which grammar members reproduce the candidate's and the reference's combine.
fn render_contract(o: &mut String, st: &Style, c: &ContractReport) {
    let combine = Component::MoeCombine.path();
    let place = format!(
        "{combine} at layer {} step {}",
        c.at.layer.map(|l| l.to_string()).unwrap_or_default(),
        c.at.step
    );
    for (label, e, note) in [
        ("candidate", &c.candidate_explanation, &c.candidate_note),
        ("reference", &c.reference_explanation, &c.reference_note),
    ] {
        match e {
            Some(e) if e.simplest.is_some() => {
                let simplest = e.simplest.clone().unwrap_or_default();
                let _ = writeln!(
                    o,
                    "   contract: {label}'s {place} equals {} ({})",
                    st.bold(&simplest),
                    e.order.clone().unwrap_or_default()
                );
                equivalent_lines(o, e);
            }
            Some(e) => {
                let _ = writeln!(o, "   contract: {label}'s {place}: {}", e.summary());
            }
            None => {
                let _ = writeln!(
                    o,
                    "   contract: {label}'s {place} not explained: {}",
                    note.clone().unwrap_or_default()
                );
            }
        }
    }
    if c.reference_is_native == Some(false) {
        let _ = writeln!(o, "   (the reference is not the native contract c at this event)");
    }
}

/// Equivalent members rendered per side in the text report (JSON lists up
/// to `MAX_LISTED_EQUIVALENTS`).
const RENDERED_EQUIVALENTS: usize = 4;

/// The indistinguishable members of one explanation, with their reasons.
fn equivalent_lines(o: &mut String, e: &CombineExplanation) {
    for q in e.equivalents.iter().take(RENDERED_EQUIVALENTS) {
        let why: Vec<&str> = q.reasons.iter().map(|r| r.text.as_str()).collect();
        let _ = writeln!(o, "     indistinguishable: {} — {}", q.contract, why.join("; "));
    }
    if e.equivalent_count > RENDERED_EQUIVALENTS {
        let _ = writeln!(
            o,
            "     … and {} more equivalent members (--format json lists them)",
            e.equivalent_count - RENDERED_EQUIVALENTS
        );
    }
    for p in &e.permutations {
        if p.matching > 1 && p.matching < p.tried {
            let _ = writeln!(
                o,
                "     {}: {} of {} permutations reproduce it ({})",
                p.family,
                p.matching,
                p.tried,
                p.listed.join(", ")
            );
        }
    }
}

/// `0-4, 7, 9-10`.
fn ranges(v: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}
