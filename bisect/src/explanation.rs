//! The report form of an equivalence-aware contract explanation of one MoE
//! combine event ([`moeconf_contract::explain_event`]): the simplest grammar
//! member that reproduces the output bitwise, the indistinguishable others
//! with the reasons, the explicit permutations that reproduce it, or, when
//! nothing does, the closest members and how many values they get wrong.
//! `moeconf diff` reports one per side at the localized `moe.combine`,
//! `moeconf explain` one per event of a trace (docs/contracts.md, "Inference").

use moeconf_contract::{AggregationContract, EventExplanation, Fit, Order, Reason};
use serde::Serialize;

/// Most equivalents listed per explanation (the count is always complete).
pub const MAX_LISTED_EQUIVALENTS: usize = 64;

/// Why a member cannot be told apart from the simplest one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ReasonReport {
    /// Stable identifier (`terms_bf16_valued`, `first_pair_commutes`, …).
    pub code: String,
    /// Whether it holds on every input (`true`) or only on this data.
    pub structural: bool,
    /// The reason in words.
    pub text: String,
}

impl ReasonReport {
    /// The report form of a [`Reason`].
    pub fn of(r: &Reason) -> ReasonReport {
        ReasonReport {
            code: r.code().to_string(),
            structural: r.is_structural(),
            text: r.text(),
        }
    }
}

/// Another member that reproduces the output, and why it is indistinguishable.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct EquivalentReport {
    /// The member in the contract notation.
    pub contract: String,
    /// Why it gives the same bits as the simplest member on this data.
    pub reasons: Vec<ReasonReport>,
}

/// The explicit permutations of one sequential variant that reproduce the output.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct PermutationReport {
    /// The variant (order `identity`) in the notation.
    pub family: String,
    /// How many of the k! permutations reproduce it.
    pub matching: u64,
    /// k!.
    pub tried: u64,
    /// The first reproducing orders in the notation (`index:N`, or
    /// `class:N` for a B-like family), at most 16 permutations' worth.
    pub listed: Vec<String>,
}

/// A member that does not reproduce the output.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct NearMissReport {
    /// The member in the notation.
    pub contract: String,
    /// Output values whose bits differ.
    pub differing: usize,
    /// Output values compared.
    pub elements: usize,
    /// The largest distance of a differing value, in ulps of the output
    /// format (`None` when a NaN is involved).
    pub max_ulps: Option<u64>,
}

impl NearMissReport {
    /// `c (256 of 256 values differ, up to 37 ulp)`.
    pub fn words(&self) -> String {
        let ulps = match self.max_ulps {
            Some(u) if self.differing > 0 => format!(", up to {u} ulp"),
            None if self.differing > 0 => ", NaN involved".to_string(),
            _ => String::new(),
        };
        format!(
            "{} ({} of {} values differ{ulps})",
            self.contract, self.differing, self.elements
        )
    }
}

/// One fitted coefficient of a [`FitReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CoefficientReport {
    /// The least-squares value (`null` when the data cannot determine it).
    pub fitted: Option<f64>,
    /// The value the bitwise check used (snapped to a multiple of 1/64 when close).
    pub used: f32,
}

/// The report form of a [`Fit`]: an unexplained combine read as scaled
/// routed terms and shared output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FitReport {
    /// What differs from an unscaled combine (`shared expert × 1.5`, `term 2 dropped (× 0)`).
    pub changes: Vec<String>,
    /// Routed coefficients in slot order.
    pub terms: Vec<CoefficientReport>,
    pub shared: CoefficientReport,
    /// Where the routed coefficients sit relative to the term's rounding, in words.
    pub placement: String,
    /// The output format the check rounded to (`bf16` or `f32`).
    pub output: String,
    /// Values the reading does not reproduce bitwise.
    pub differing: usize,
    pub elements: usize,
    /// The largest distance of a value not reproduced, in ulps of the output format.
    pub max_ulps: Option<u64>,
    /// The one-line reading.
    pub summary: String,
}

impl FitReport {
    /// The report form of `f`.
    pub fn of(f: &Fit) -> FitReport {
        let c = |x: &moeconf_contract::Coefficient| CoefficientReport {
            fitted: x.fitted,
            used: x.used,
        };
        FitReport {
            changes: f.changes(),
            terms: f.terms.iter().map(c).collect(),
            shared: c(&f.shared),
            placement: f.placement.words().to_string(),
            output: if f.output_bf16 { "bf16" } else { "f32" }.to_string(),
            differing: f.differing,
            elements: f.elements,
            max_ulps: f.max_ulps,
            summary: f.summary(),
        }
    }
}

/// Whether the grammar explains an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExplanationStatus {
    /// Some grammar member reproduces the output bitwise.
    Explained,
    /// No grammar member does (see `closest`).
    Unexplained,
}

/// The report form of one event's [`EventExplanation`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CombineExplanation {
    pub status: ExplanationStatus,
    /// Routed terms k.
    pub k: usize,
    /// Output values D.
    pub elements: usize,
    /// The simplest reproducing member in the notation (e.g. `b+order=asc-id`).
    pub simplest: Option<String>,
    /// What determines its order, in words (`ascending expert id`, `B class 135`).
    pub order: Option<String>,
    /// How many other members reproduce the output (listed up to
    /// [`MAX_LISTED_EQUIVALENTS`] in `equivalents`).
    pub equivalent_count: usize,
    /// The other reproducing members with the reasons.
    pub equivalents: Vec<EquivalentReport>,
    /// Sequential variants with explicit reproducing permutations.
    pub permutations: Vec<PermutationReport>,
    /// When unexplained: the closest named-order members.
    pub closest: Vec<NearMissReport>,
    /// When unexplained: the output read as scaled routed terms and shared
    /// output, checked bitwise (absent when that reading changes nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fit: Option<FitReport>,
    /// (variant, order) candidates evaluated.
    pub candidates: u64,
}

/// What determines an order, in words; explicit orders as `B class N` / `permutation index N`.
pub fn order_words(o: &Order) -> String {
    match o {
        Order::BClass(c) => format!("B class {c}"),
        Order::PermutationIndex(i) => format!("permutation index {i}"),
        other => other.name(),
    }
}

impl CombineExplanation {
    /// The report form of `e`.
    pub fn of(e: &EventExplanation) -> CombineExplanation {
        let simplest: Option<AggregationContract> = e.simplest();
        let all = e.equivalents();
        let equivalents = all
            .iter()
            .take(MAX_LISTED_EQUIVALENTS)
            .map(|q| EquivalentReport {
                contract: q.contract.describe(),
                reasons: q.reasons.iter().map(ReasonReport::of).collect(),
            })
            .collect();
        let permutations = e
            .matches
            .iter()
            .filter_map(|m| {
                let p = m.permutations.as_ref()?;
                Some(PermutationReport {
                    family: m.family.describe(),
                    matching: p.matching,
                    tried: p.tried,
                    listed: m.listed_orders().iter().map(|o| o.to_string()).collect(),
                })
            })
            .collect();
        CombineExplanation {
            status: if e.explained() {
                ExplanationStatus::Explained
            } else {
                ExplanationStatus::Unexplained
            },
            k: e.k,
            elements: e.elements,
            order: simplest.as_ref().map(|c| order_words(&c.order)),
            simplest: simplest.as_ref().map(|c| c.describe()),
            equivalent_count: all.len(),
            equivalents,
            permutations,
            closest: e
                .closest
                .iter()
                .map(|n| NearMissReport {
                    contract: n.contract.describe(),
                    differing: n.differing,
                    elements: e.elements,
                    max_ulps: n.max_ulps,
                })
                .collect(),
            fit: e.fit.as_ref().filter(|f| !f.is_identity()).map(FitReport::of),
            candidates: e.candidates,
        }
    }

    /// One line: `b+order=class:135 (B class 135; 3 equivalent members)`, or
    /// `no grammar member reproduces it; read as shared expert × 1.5 (…): 256
    /// of 256 values reproduced bitwise; closest members: c (12 of 256 values
    /// differ, up to 3 ulp), …`.
    pub fn summary(&self) -> String {
        match &self.simplest {
            Some(s) => {
                let eq = match self.equivalent_count {
                    0 => String::new(),
                    1 => "; 1 equivalent member".to_string(),
                    n => format!("; {n} equivalent members"),
                };
                format!("{s} ({}{eq})", self.order.clone().unwrap_or_default())
            }
            None => {
                let near: Vec<String> = self.closest.iter().take(3).map(NearMissReport::words).collect();
                let fit = match &self.fit {
                    Some(f) => format!("; read as {}", f.summary),
                    None => String::new(),
                };
                if near.is_empty() {
                    format!("no grammar member reproduces it{fit}")
                } else {
                    format!(
                        "no grammar member reproduces it{fit}; closest members: {}",
                        near.join(", ")
                    )
                }
            }
        }
    }
}
