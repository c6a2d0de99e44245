//! The diff report: one serializable document (docs/diff.md is its schema).

use crate::comparability::Comparability;
use crate::explanation::CombineExplanation;
use crate::numeric::{NumericSummary, ValueComparison};
use moeconf_fingerprint::{Coord, Half, Level};
use serde::Serialize;

/// Version of the JSON document; bumped on any incompatible change.
pub const DIFF_SCHEMA_VERSION: u32 = 5;

/// Overall verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every level captured by both traces matches bitwise.
    Equivalent,
    /// At least one compared level differs.
    Divergent,
}

/// Status of one level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LevelStatus {
    /// Every record of the level matches.
    Match,
    /// At least one record differs (or exists on one side only).
    Differ,
    /// The level was not captured by both traces.
    NotCompared,
}

/// Where a record sits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RecordRef {
    /// Level of the record (`L0`…`L4`).
    pub level: String,
    /// Forward step (0 = prefill).
    pub step: u32,
    /// Absolute token position.
    pub position: u32,
    /// `prefill` or `decode`.
    pub phase: String,
    /// Decoder layer (`null` for model-global records).
    pub layer: Option<u32>,
    /// Component / operator path.
    pub path: String,
    /// Which side holds the record: `both`, `reference` or `candidate`.
    pub present_in: String,
}

impl RecordRef {
    /// The record of `level` at `c`; `present_in` is `both`, `reference` or `candidate`.
    pub fn new(level: Level, c: &Coord, present_in: &str) -> RecordRef {
        RecordRef {
            level: level.name().to_string(),
            step: c.step,
            position: c.position,
            phase: c.phase.name().to_string(),
            layer: c.layer,
            path: c.path.to_string(),
            present_in: present_in.to_string(),
        }
    }

    /// `step 3 pos 12 (decode) layer 5 moe.combine [only in candidate]`.
    pub fn describe(&self) -> String {
        let mut s = self.describe_location();
        if self.present_in != "both" {
            s.push_str(&format!(" [only in {}]", self.present_in));
        }
        s
    }

    /// `step 3 pos 12 (decode) layer 5 moe.combine`: where the record sits,
    /// without saying which side holds it.
    pub fn describe_location(&self) -> String {
        let mut s = format!("step {} pos {} ({})", self.step, self.position, self.phase);
        if let Some(l) = self.layer {
            s.push_str(&format!(" layer {l}"));
        }
        s.push(' ');
        s.push_str(&self.path);
        s
    }
}

/// How a divergence continues after the record where it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DivergenceKind {
    /// A later checkpoint differs: of the same step for a record inside a
    /// step (the post-mHC layer states, then the step's token), of a later
    /// step for persistent state carried out of a step.
    Propagating,
    /// No later checkpoint differs: rounding (or the argmax) erased the
    /// difference before the next checkpoint.
    Absorbed,
}

/// Where an absorbed divergence ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Absorption {
    /// The next checkpoint matches and no later checkpoint it can reach differs.
    Checkpoint,
    /// Its only consumer at its own position (the combine, for a routed term,
    /// the routed sum or the shared output) matches: the difference cannot
    /// travel further, whatever differs later.
    Consumer,
    /// Each side's combine contract gives its own output from the other
    /// side's inputs too (`crate::counterfactual`): what differs at the
    /// combine is the contract.
    Contracts,
}

impl DivergenceKind {
    /// `propagating` / `absorbed`.
    pub fn name(self) -> &'static str {
        match self {
            DivergenceKind::Propagating => "propagating",
            DivergenceKind::Absorbed => "absorbed",
        }
    }
}

/// The headline: the first differing record in the catalogue's execution
/// order, whatever its level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FirstDivergence {
    pub level: String,
    /// Forward step.
    pub step: u32,
    /// Absolute token position.
    pub position: u32,
    /// Decoder layer (`null` for model-global records).
    pub layer: Option<u32>,
    /// The operator (record path) whose output first differs.
    pub operator: String,
    /// The candidate's inferred aggregation contract, when the operator is
    /// `moe.combine` and payloads allowed inference.
    pub contract: Option<String>,
    /// Propagating or absorbed (`null` when the checkpoints that decide it
    /// are not compared).
    pub kind: Option<DivergenceKind>,
    /// Which side holds the record: `both`, `reference` or `candidate`.
    pub present_in: String,
}

/// The kind of a decoder layer as the traces show it (inferred from which
/// catalogue records exist there: `router.margin` only on score-routed
/// layers, `attn.compressed_read` only with a compressor, the indexer's
/// records only on CSA layers). `null` where the records do not tell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerKind {
    /// `sliding`, `csa` or `hca`.
    pub attention: Option<String>,
    /// `score_routed` or `hash_routed`.
    pub ffn: Option<String>,
}

/// One divergence: a differing record whose inputs all match (its operator
/// computed something different from the same inputs), and how it continues.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// The record.
    pub at: RecordRef,
    /// Propagating or absorbed (`null` when the checkpoints that decide it
    /// are not compared).
    pub kind: Option<DivergenceKind>,
    /// Propagating: the first later checkpoint that differs. Absorbed: the
    /// next checkpoint, which matches, or the consumer or combine that
    /// absorbs it (`absorbed_at`; `null` when there is none).
    pub checkpoint: Option<RecordRef>,
    /// Absorbed: where (`null` when propagating or not classified).
    pub absorbed_at: Option<Absorption>,
    /// Its inputs and whether they match.
    pub inputs: Vec<InputCheck>,
    /// Whether every captured input matches.
    pub inputs_match: bool,
    /// What "inputs match" rests on besides bitwise equality: inputs that
    /// match only up to storage precision, that a capture recomputed, or
    /// that one trace alone holds (`null`: plain bitwise match).
    pub inputs_note: Option<String>,
    /// The layer's kind, for a layer record.
    pub layer_kind: Option<LayerKind>,
    /// How the two records compare, worded by what their values mean.
    pub comparison: Option<ValueComparison>,
    /// Which side's capture recomputed this record itself (`reference`,
    /// `candidate`, `both`; `null`: observed on both sides).
    pub recomputed: Option<String>,
    /// When one side holds only bf16 values and the other does not: how
    /// many values still differ after rounding the finer side with R_BF16
    /// (the part of the difference storage precision does not explain).
    pub beyond_storage_precision: Option<BeyondStorage>,
    /// When one trace did not capture some of its inputs: localization ends
    /// here, and these records would be needed to go further (`null`: both
    /// traces hold every input).
    pub coverage: Option<CoverageLimit>,
}

/// Where localization ends because one trace did not capture some inputs of
/// the localized record (a backend that computes them inside a fused kernel,
/// a capture that cannot observe them): the record's operator cannot be
/// separated from those inputs (docs/diff.md "Partial coverage").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CoverageLimit {
    /// The record's level (`L4`, `L3`): the finest level both traces captured at this site.
    pub finest_level: String,
    /// The records that would be needed to localize further.
    pub needed: Vec<NeededRecord>,
}

/// One record a trace lacks that localization needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NeededRecord {
    /// The input, e.g. `attn.window_read (layer 0)`.
    pub record: String,
    /// `candidate` or `reference`: the trace that lacks it.
    pub missing_in: String,
    /// How many of its records the other trace holds here.
    pub held_by_other: u64,
    /// Why the lacking trace's capture did not record it (its
    /// `moeconf.not_captured` provenance note), if it says.
    pub reason: Option<String>,
}

/// The part of a difference that storage precision does not explain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BeyondStorage {
    /// `reference` or `candidate`: the side holding only bf16 values.
    pub coarser: String,
    /// Values that differ after R_BF16 of the finer side.
    pub differing_values: u64,
    /// Values compared.
    pub values: u64,
}

/// One inline text-diff segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TextOp {
    /// `equal`, `delete` (only in the reference) or `insert` (only in the candidate).
    pub tag: String,
    pub text: String,
}

/// Where two texts first differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TextPosition {
    /// Byte offset into the UTF-8 text (the same in both: the prefix before it is shared).
    pub byte_offset: u64,
    /// Character (Unicode scalar value) offset.
    pub char_offset: u64,
    /// 1-based line.
    pub line: u64,
    /// 1-based column, in characters.
    pub column: u64,
}

/// What is reported instead of an inline diff when the differing part of
/// the continuations is too long to diff within the bound (docs/diff.md,
/// "Bounded work"): where they first differ, their lengths and a
/// positional count of differing characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TextSummary {
    /// Why no inline diff is given.
    pub reason: String,
    /// The first differing character.
    pub first_difference: TextPosition,
    /// Characters of the reference text.
    pub reference_chars: u64,
    /// Characters of the candidate text.
    pub candidate_chars: u64,
    /// Positions (up to the shorter length) whose characters differ, plus
    /// the difference of the lengths: a positional count, without alignment.
    pub differing_chars: u64,
}

/// L0: generated tokens and text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct L0Report {
    pub status: LevelStatus,
    /// One line of plain explanation.
    pub explains: String,
    /// Steps whose L0 records differ.
    pub differing_steps: u64,
    /// The first differing L0 record in execution order.
    pub first: Option<RecordRef>,
    /// First differing generated ordinal n (g_n is predicted by step n−1).
    pub ordinal: Option<u32>,
    /// The reference's token id there.
    pub reference_token: Option<i64>,
    /// The candidate's token id there.
    pub candidate_token: Option<i64>,
    /// The reference token's text (the growth of the continuation at that step).
    pub reference_token_text: Option<String>,
    /// The candidate token's text.
    pub candidate_token_text: Option<String>,
    /// The reference's final continuation.
    pub reference_text: Option<String>,
    /// The candidate's final continuation.
    pub candidate_text: Option<String>,
    /// Inline diff of the two final continuations (words, or characters for
    /// text without spaces such as Chinese).
    pub text_diff: Vec<TextOp>,
    /// Instead of `text_diff` when the differing middle of the
    /// continuations exceeds the inline-diff bound (`null` otherwise).
    pub text_summary: Option<TextSummary>,
}

/// L1: logits at each step's last position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct L1Report {
    pub status: LevelStatus,
    /// One line of plain explanation.
    pub explains: String,
    /// Steps whose L1 records differ.
    pub differing_steps: u64,
    /// The first differing L1 record.
    pub first: Option<RecordRef>,
    /// Paths of the L1 records that differ at that step.
    pub differing_paths: Vec<String>,
    /// Whether the top-1 token changed.
    pub argmax_changed: Option<bool>,
    /// Reference rank-1 and rank-2 ids.
    pub reference_top2: Option<[i64; 2]>,
    /// Candidate rank-1 and rank-2 ids.
    pub candidate_top2: Option<[i64; 2]>,
    /// Reference rank-1 minus rank-2 logit.
    pub reference_margin: Option<f64>,
    /// Candidate rank-1 minus rank-2 logit.
    pub candidate_margin: Option<f64>,
    /// Element-wise comparison of `lm.logits` (payloads on both sides).
    pub logits: Option<NumericSummary>,
}

/// One differing persistent-state component.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateComponent {
    /// Component path (`state.window_kv`, …).
    pub path: String,
    /// Differing values (payloads on both sides, same shape).
    pub differing_values: Option<u64>,
    /// Values in the component.
    pub values: Option<u64>,
    /// Which side holds it: `both`, `reference` or `candidate`.
    pub present_in: String,
}

/// The differing components of one layer's persistent state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateLayer {
    /// Decoder layer.
    pub layer: Option<u32>,
    /// Differing components, in emission order.
    pub components: Vec<StateComponent>,
}

/// L2: the full persistent state at decode boundaries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct L2Report {
    pub status: LevelStatus,
    /// One line of plain explanation.
    pub explains: String,
    /// Boundaries whose state differs.
    pub differing_steps: u64,
    /// The first differing state record.
    pub first: Option<RecordRef>,
    /// The boundary: after this step.
    pub step: Option<u32>,
    /// Layers whose state differs at that boundary, with components.
    pub layers: Vec<StateLayer>,
    /// Layers whose state is identical at that boundary.
    pub identical_layers: Vec<u32>,
}

/// The first change of routed experts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteDivergence {
    /// Where (`router.topk`).
    pub at: RecordRef,
    /// Reference experts in selection order.
    pub reference_experts: Vec<i64>,
    /// Candidate experts in selection order.
    pub candidate_experts: Vec<i64>,
    /// Experts the candidate selects that the reference does not.
    pub entering: Vec<i64>,
    /// Experts the reference selects that the candidate does not.
    pub leaving: Vec<i64>,
    /// The same experts in another (combine) order.
    pub reordered: bool,
    /// The layer is hash-routed (experts are the token id's row of a fixed
    /// table, so there is no selection margin); `null` when the records do
    /// not tell.
    pub hash_routed: Option<bool>,
    /// Reference rank-k minus rank-(k+1) selection score.
    pub reference_margin: Option<f64>,
    pub candidate_margin: Option<f64>,
}

/// The checkpoints of a step before its first differing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EarlierCheckpoints {
    /// The reference holds no checkpoint of the step before it.
    None,
    /// All match; `last_matched_checkpoint` names the last one.
    Match,
    /// All match (if any precede it), but the last one is not where
    /// execution order puts it (the records of the position before it, or
    /// of the last position of the layer before, hold no checkpoint: a
    /// partial or malformed trace), and the report reads no further than
    /// those pages, so it names none.
    Unlocated,
}

/// L3: post-mHC layer state and routes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct L3Report {
    pub status: LevelStatus,
    /// One line of plain explanation.
    pub explains: String,
    /// Steps with a differing L3 record.
    pub differing_steps: u64,
    /// The first differing post-mHC checkpoint in execution order.
    pub first: Option<RecordRef>,
    /// The half that checkpoint closes.
    pub half: Option<Half>,
    /// What precedes it in its step (`None` when no checkpoint differs).
    /// Every earlier checkpoint of the step matches: the walk lists every
    /// differing record, and the first differing checkpoint is the first
    /// in execution order among them. How many there are is not reported:
    /// no digest commits to how many records of a path a group holds, and
    /// counting them would read the step's groups whole.
    pub earlier_checkpoints: Option<EarlierCheckpoints>,
    /// The last matching checkpoint before it (the divergence lies after
    /// it), found at the coordinates execution order puts it at (the
    /// pages of one or two positions); `None` when it is the first of its
    /// step or was not located there.
    pub last_matched_checkpoint: Option<RecordRef>,
    /// Element-wise comparison of the first differing checkpoint.
    pub numeric: Option<NumericSummary>,
    /// The first differing L3 record of any kind (routes included).
    pub first_record: Option<RecordRef>,
    /// The first route change.
    pub route: Option<RouteDivergence>,
}

/// Whether one operator input matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InputCheck {
    /// The input, e.g. `moe.term.* (layer 5)`.
    pub input: String,
    /// `match`, `differ`, `not_captured` (its level is not compared, or the
    /// trace lacks it), `not_applicable` (the layer's kind has no such
    /// record, e.g. `attn.compressed_read` on a sliding-window layer) or
    /// `not_emitted` (an operator that emits only at some positions, e.g. a
    /// compressor entry, emitted nothing here) or `observed_differs` (a
    /// value only captures record, e.g. `moe.routed`, inside the operator's
    /// own arithmetic, differs; counts as matching).
    pub status: String,
    /// Records compared.
    pub records: u64,
    /// Which side's capture recomputed this input rather than observing
    /// the backend's value (`reference`, `candidate` or `both`; `null`:
    /// observed on both sides). A match of recomputed inputs says nothing
    /// about the backend, and the report says so.
    pub recomputed: Option<String>,
}

/// Records that differ only because one side stored a coarser precision
/// (its values are the other side's rounded), grouped by component and
/// coarser side. The walk counts them as matching inputs of their
/// consumers and goes on; the traces are still not equivalent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoragePrecision {
    /// The component, e.g. `moe.term.*`.
    pub component: String,
    /// `reference` or `candidate`: the side that stored the coarser values.
    pub coarser: String,
    /// How the coarser side stores them: `bf16` (dtype) or `bf16 values in f32`.
    pub coarse_storage: String,
    /// The rounding that maps the finer side onto the coarser:
    /// `R_BF16 (round to nearest, ties to even)`.
    pub rounding: String,
    /// Records of this group.
    pub records: u64,
    /// Values compared.
    pub values: u64,
    /// Values the rounding changed (the others are already bf16 values on both sides).
    pub rounded_values: u64,
    /// The first record, in execution order.
    pub first: RecordRef,
}

/// Records of one component held by one trace only, at steps both traces hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OneSided {
    /// The component, e.g. `attn.window_read` or `moe.term.*`.
    pub component: String,
    /// `reference` or `candidate`: the trace that holds them.
    pub present_in: String,
    /// How many records.
    pub records: u64,
    /// The first, in execution order.
    pub first: RecordRef,
}

/// The localized operator.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Localized {
    /// The operator's output record.
    pub at: RecordRef,
    /// Its half of the layer.
    pub half: Option<Half>,
    /// Its inputs and whether they match.
    pub inputs: Vec<InputCheck>,
    /// Whether every captured input matches (the operator itself departs).
    pub inputs_match: bool,
    /// What "inputs match" rests on besides bitwise equality (see
    /// [`Divergence::inputs_note`]).
    pub inputs_note: Option<String>,
    pub layer_kind: Option<LayerKind>,
    /// How the output compares, worded by what its values mean.
    pub comparison: Option<ValueComparison>,
    /// When one trace did not capture some of its inputs: localization ends
    /// at this record (the finest level both captured) and these records
    /// would be needed to go further (`null`: both traces hold every input).
    pub coverage: Option<CoverageLimit>,
    /// The steps of the operator that no record captures: where the
    /// difference can have arisen inside it (`null`: none, or the
    /// operator is one step).
    pub uncaptured_steps: Option<String>,
}

/// Contract inference at the localized `moe.combine`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContractReport {
    /// The combine event.
    pub at: RecordRef,
    /// The candidate's simplest reproducing grammar member in the contract
    /// notation (docs/contracts.md), e.g. `b+order=class:135`.
    pub candidate: Option<String>,
    /// The candidate's explanation: the reproducing set (simplest member,
    /// equivalents with reasons, explicit permutations) or, when nothing
    /// reproduces it, the closest members.
    pub candidate_explanation: Option<CombineExplanation>,
    /// Why the candidate was not explained (missing records or payloads).
    pub candidate_note: Option<String>,
    /// The reference's simplest reproducing member.
    pub reference: Option<String>,
    pub reference_explanation: Option<CombineExplanation>,
    /// Why the reference was not explained.
    pub reference_note: Option<String>,
    /// Whether the native contract (`c`, router slot order) is among the
    /// members reproducing the reference's output.
    pub reference_is_native: Option<bool>,
}

/// L4: operator intermediates.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct L4Report {
    pub status: LevelStatus,
    /// One line of plain explanation.
    pub explains: String,
    /// Steps with a differing L4 record.
    pub differing_steps: u64,
    /// The first differing L4 record in execution order.
    pub first: Option<RecordRef>,
    /// The localized operator: the first differing record (of the step of
    /// the first divergence, in execution order) whose inputs all match,
    /// when it is a layer operator or the embedding.
    pub localized: Option<Localized>,
    /// Contract inference, when the localized operator is `moe.combine`.
    pub contract: Option<ContractReport>,
}

/// The five levels.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Levels {
    /// Tokens and text.
    #[serde(rename = "L0")]
    pub l0: L0Report,
    /// Logits and margins.
    #[serde(rename = "L1")]
    pub l1: L1Report,
    /// Full persistent state.
    #[serde(rename = "L2")]
    pub l2: L2Report,
    /// Layer state and routes.
    #[serde(rename = "L3")]
    pub l3: L3Report,
    /// Operator intermediates.
    #[serde(rename = "L4")]
    pub l4: L4Report,
}

/// What one trace is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceSummary {
    pub path: String,
    /// Root digest (hex).
    pub root: String,
    /// Runtime that produced it.
    pub runtime: String,
    pub precision: String,
    pub contract: String,
    pub schedule: String,
    /// Steps (committed by the root digest). The number of records is not
    /// reported: a diff reads only the divergent path, and no digest it
    /// compares commits to a count (docs/format.md §11.5).
    pub steps: u64,
}

/// The whole report of `moeconf diff`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    /// [`DIFF_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `moeconf.diff`.
    pub kind: String,
    /// Equivalent or divergent.
    pub verdict: Verdict,
    pub reference: TraceSummary,
    pub candidate: TraceSummary,
    /// Binding differences.
    pub comparability: Comparability,
    /// Levels compared (captured by both).
    pub compared_levels: Vec<String>,
    /// Steps present in only one trace.
    pub unmatched_steps: Vec<u32>,
    /// Levels held by one trace only and therefore not compared (the other
    /// neither captured nor holds them): the traces are not equivalent.
    pub uncompared_levels: Vec<UncomparedLevel>,
    /// Sides that lack steps of their run (empty when both are complete;
    /// `moeconf diff` compares them only with `--allow-incomplete`).
    pub incomplete: Vec<crate::Incomplete>,
    /// The headline: the first differing record in execution order (`null`
    /// when equivalent or when the traces differ only in coverage).
    pub first_divergence: Option<FirstDivergence>,
    /// Every divergence in execution order, each a differing record whose
    /// inputs match, until the first that propagates (what follows it is
    /// not separated into further divergences).
    pub divergences: Vec<Divergence>,
    /// What lies after the listed divergences: `none` (every other
    /// differing record follows from them without reaching a checkpoint),
    /// `propagates` (the last one reaches later checkpoints: the
    /// differences after it are not separated), `unclassified` (the
    /// checkpoints that would tell are not compared) or `limit` (more
    /// divergences than the report lists).
    pub rest: String,
    /// Records the walk passed because they differ only by storage
    /// precision, grouped by component (empty when none).
    pub storage_precision: Vec<StoragePrecision>,
    /// Records held by one trace only at steps both hold, by component
    /// (a coverage difference: the traces are not equivalent; the walk does
    /// not count them as divergences).
    pub one_side_only: Vec<OneSided>,
    /// Activation-quantization sites held by one trace only whose other
    /// trace's precision profile has no quantization sites, by component: a
    /// difference of execution (the other side computes the identity there),
    /// localized to the first such site whose inputs match; not listed in
    /// `one_side_only`.
    pub quantization_one_side: Vec<OneSided>,
    /// One object per level.
    pub levels: Levels,
    /// The one-line summary printed last.
    pub summary: String,
}

/// A level one trace holds records of and the other neither declares nor holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UncomparedLevel {
    /// `L0`…`L4`.
    pub level: String,
    /// `reference` or `candidate`: the trace that holds it.
    pub present_in: String,
}

impl DiffReport {
    /// The report as a JSON value (documented in docs/diff.md).
    pub fn to_json(&self) -> serde_json::Value {
        // Serialization of these plain structs cannot fail (no maps with
        // non-string keys, non-finite floats are written as strings).
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// The process exit code of `moeconf diff` for this report: 0 equivalent, 1 divergent.
    pub fn exit_code(&self) -> u8 {
        match self.verdict {
            Verdict::Equivalent => 0,
            Verdict::Divergent => 1,
        }
    }
}
