//! Text renderings of replay reports: the origin map (steps × layers) and
//! the list of origins for a layer replay, the per-step table and the
//! llama-perplexity-style summary for teacher forcing. The candidate's file
//! name and binding strings are written in the visible form of
//! [`moeconf_output::escape::text`].

use std::fmt::Write;

use moeconf_output::escape::text;

use crate::report::{LayerReport, Status, UnitResult};
use crate::teacher::TeacherReport;
use crate::units::Part;

/// One character per unit in the origin map.
fn mark(u: &UnitResult) -> char {
    match (u.status, u.propagates()) {
        (Status::Origin, _) if u.absorbed => 'o',
        (Status::Origin, _) => 'O',
        (Status::NotReplayable, _) => '?',
        (Status::Reproduced, true) => 'p',
        (Status::Reproduced, false) => '.',
    }
}

fn origin_line(u: &UnitResult) -> String {
    let mut s = format!("  {}", u.unit);
    if let Some(d) = &u.first_difference {
        let what = if d.output { "output" } else { "operator" };
        let _ = write!(s, ": parts at position {} in {} ({what})", d.position, d.record);
    }
    if u.absorbed {
        s.push_str(", absorbed: every output matches");
    }
    if let Some(m) = u.max_abs_diff {
        let _ = write!(s, ", output max |Δ| = {m:e}");
    }
    if let Some(c) = &u.reproduced_under {
        let _ = write!(s, ", reproduced under {c}");
    }
    s
}

/// The origin map: one row per step; `E` column the embedding, one column
/// of two characters (attention, FFN) per layer, `H` the head.
fn origin_map(r: &LayerReport, out: &mut String) {
    let mut steps: Vec<u32> = r.units.iter().map(|u| u.unit.step).collect();
    steps.dedup();
    let _ = write!(out, "\norigin map (O origin, o origin absorbed inside the unit, . reproduced, p reproduced, propagating an earlier difference, ? not replayable;\n            per layer: attention, ffn)\n  step  E ");
    for l in 0..r.layers {
        let _ = write!(out, " L{l:<2}");
    }
    out.push_str("  H\n");
    for s in steps {
        let row: Vec<&UnitResult> = r.units.iter().filter(|u| u.unit.step == s).collect();
        let cell = |part: Part, layer: Option<u32>| {
            row.iter()
                .find(|u| u.unit.part == part && u.unit.layer == layer)
                .map_or(' ', |u| mark(u))
        };
        let _ = write!(out, "  {s:>4}  {} ", cell(Part::Embed, None));
        for l in 0..r.layers {
            let _ = write!(
                out,
                " {}{} ",
                cell(Part::Attention, Some(l)),
                cell(Part::Ffn, Some(l))
            );
        }
        let _ = writeln!(out, "  {}", cell(Part::Head, None));
    }
}

impl LayerReport {
    pub fn render_text(&self, allow_incomplete: bool) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "moeconf replay: {} on {} (precision {}, contract {}, schedule {})",
            text(&self.candidate),
            text(&self.model),
            text(&self.precision),
            text(&self.contract),
            text(&self.schedule)
        );
        if let Some(f) = &self.fork_ignored {
            let _ = writeln!(out, "  the binding's fork is not part of the reference: {f}");
        }
        let _ = writeln!(
            out,
            "{} units replayed: {} reproduced ({} propagating an earlier difference, {}), {} origins, {} not replayable",
            self.units.len(),
            self.count(Status::Reproduced),
            self.propagated(),
            if self.measured_propagation {
                "measured against a clean teacher-forced reference"
            } else {
                "by data flow from an origin"
            },
            self.count(Status::Origin),
            self.count(Status::NotReplayable),
        );
        origin_map(self, &mut out);
        if self.count(Status::Origin) > 0 {
            out.push_str("\norigins (the candidate computes these differently on identical inputs):\n");
            for u in self.origins() {
                out.push_str(&origin_line(u));
                out.push('\n');
            }
        }
        let missing = self.missing_summary();
        if !missing.is_empty() {
            out.push_str("\nnot replayable, the trace lacks:\n");
            for (rec, payload, steps) in missing {
                let what = if payload { "payload of " } else { "" };
                let list: Vec<String> = steps.iter().map(u32::to_string).collect();
                let _ = writeln!(out, "  {what}{rec} at steps {}", list.join(","));
            }
            out.push_str("  (capture with `moeconf run --capture replay`; docs/replay.md §3)\n");
        }
        if let Some(c) = &self.incomplete {
            let _ = writeln!(
                out,
                "\nINCOMPLETE: {}: {c}; only the steps present were replayed",
                self.candidate
            );
        }
        let verdict = match self.exit_code(allow_incomplete) {
            0 if self.count(Status::NotReplayable) > 0 || self.incomplete.is_some() => {
                "REPRODUCED where replayable (incomplete, accepted with --allow-incomplete)"
            }
            0 => "REPRODUCED: every half-layer of the candidate is the reference's, bitwise",
            1 => "ORIGINS FOUND",
            _ if self.incomplete.is_some() && self.count(Status::NotReplayable) == 0 => {
                "INCOMPLETE: the candidate lacks steps of its run (exit 2; --allow-incomplete accepts)"
            }
            _ => "INCOMPLETE: some units could not be replayed (exit 2; --allow-incomplete accepts)",
        };
        let _ = writeln!(out, "\n{verdict}");
        out
    }
}

impl TeacherReport {
    pub fn render_text(&self, allow_incomplete: bool) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "moeconf replay --teacher-force: {} on {} (precision {}, contract {}, schedule {})",
            text(&self.candidate),
            text(&self.model),
            text(&self.precision),
            text(&self.contract),
            text(&self.schedule)
        );
        let _ = writeln!(
            out,
            "KL(P_reference || P_candidate) in nats; top-{} overlap; argmax reference/candidate\n",
            self.top_k
        );
        let _ = writeln!(
            out,
            "  step   pos  {:>12}  top-{}  argmax        same",
            "KL", self.top_k
        );
        for s in &self.steps {
            let kl =
                s.kl.map_or_else(|| "undefined".to_string(), |k| format!("{k:.6e}"));
            let _ = writeln!(
                out,
                "  {:>4}  {:>4}  {kl:>12}  {:>3}/{}  {:>6}/{:<6}  {}",
                s.step,
                s.position,
                s.topk_overlap,
                self.top_k,
                s.argmax_reference,
                s.argmax_candidate,
                if s.identical { "bitwise" } else { "" }
            );
        }
        if self.l3 {
            l3_table(self, &mut out);
        }
        let n = self.steps.len();
        let _ = writeln!(out, "\n====== KL divergence statistics ======");
        match self.mean_kl() {
            Some(m) => {
                let _ = writeln!(out, "Mean    KLD: {m:.6e}");
            }
            None => out.push_str("Mean    KLD: undefined\n"),
        }
        if let Some((k, s)) = self.max_kl() {
            let _ = writeln!(out, "Maximum KLD: {k:.6e} (step {s})");
        }
        let pct = if n == 0 {
            0.0
        } else {
            100.0 * self.argmax_agree() as f64 / n as f64
        };
        let _ = writeln!(out, "Same top-1 : {pct:.2}% ({}/{n})", self.argmax_agree());
        if self.undefined() > 0 {
            let _ = writeln!(
                out,
                "Undefined KL (non-finite logits): {} steps",
                self.undefined()
            );
        }
        let _ = writeln!(
            out,
            "\n{}",
            match self.exit_code(allow_incomplete) {
                0 if self.incomplete.is_some() => {
                    "IDENTICAL at every step present (incomplete, accepted with --allow-incomplete)"
                }
                0 => "IDENTICAL: the logits are bitwise the reference's at every step",
                1 => "DIFFERENT: the logits differ from the teacher-forced reference",
                _ => "INCOMPLETE: the candidate lacks steps of its run (exit 2; --allow-incomplete accepts)",
            }
        );
        if let Some(c) = &self.incomplete {
            let _ = writeln!(
                out,
                "INCOMPLETE: {}: {c}; only the steps present were compared",
                self.candidate
            );
        }
        out
    }
}

/// The L3 table of teacher forcing: per step, one character per layer
/// (`.` bitwise equal, `x` different) and the largest |Δ| over the layers.
fn l3_table(r: &TeacherReport, out: &mut String) {
    out.push_str(
        "\nL3 (layer.post_ffn_mhc) against the teacher-forced reference: . identical, x different\n",
    );
    for s in &r.steps {
        let marks: String = s
            .layers
            .iter()
            .map(|l| if l.identical { '.' } else { 'x' })
            .collect();
        let worst = s
            .layers
            .iter()
            .map(|l| l.max_abs_diff)
            .try_fold(0f64, |m, d| d.map(|d| if d > m || d.is_nan() { d } else { m }));
        let worst = worst.map_or_else(|| "n/a (no payload)".to_string(), |w| format!("{w:e}"));
        let _ = writeln!(out, "  step {:>4}  {marks}  max |Δ| {worst}", s.step);
    }
}
