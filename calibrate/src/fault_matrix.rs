//! Protocol 10, the fault-injection localization matrix: the bisector's own
//! calibration, in both precision profiles. A native reference trace of
//! "why the sheep" is written once per profile; each case of the matrix (a
//! fault plan: a different operator, cache access, carried state or
//! contract, at a step and layer computed from the model's configuration and
//! the prompt length) gives a candidate trace from the same runtime; the
//! diff engine compares each pair, and its headline must name exactly the
//! expected step, layer and record: the first record that differs in
//! execution order over every level ([`FaultKind::component`]). The matrix
//! also records that ground truth (the first differing record of the two
//! traces, in index order), so a wrong headline can be told from a wrong
//! expectation.
//!
//! The long-context faults (issue 35 item 4: an indexer selection off by
//! one entry, a window-ring read off by one after the second wrap, compressed
//! entries rotated one position early from the second window on) change no
//! bit on "why the sheep"; their cases run on a second, long prompt (the
//! built-in [`LONG_PASSAGE`], as many words of it as make the prompt reach
//! every such kind's onset on the model, [`long_prompt`]) with their own
//! reference trace per profile, each fault active at every step and position
//! of one layer, so that only the context length makes it act.
//!
//! Reported as N/N over the effective cases per profile: a case whose
//! candidate trace is bitwise identical to the reference (same root digest)
//! changed no bit anywhere and cannot be localized by any tool; such silent
//! cases are listed separately and the diff must call them equivalent (no
//! false positive). Reordering sums of BF16-valued operands in an FP32
//! accumulator is typically silent in the bf16 profile: those sums are
//! exact, which is also why the C contract is order-invariant.

use std::path::{Path, PathBuf};

use moeconf_bisect::{diff, DiffOptions, Verdict};
use moeconf_contract::{b_class_count, AggregationContract, NativeCombine, Order};
use moeconf_fingerprint::catalogue::ExecGroup;
use moeconf_fingerprint::{Component, Half, Level};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::config::{AttentionKind, MlpKind};
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;
use moeconf_schema::Trace;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::jobs::{decode, JobOut, Jobs, Params};
use crate::{frac, CalibrateError, Claim, Ctx, Result, Section, Table, TraceRequest};

const PROMPT: &str = "why the sheep";

/// The text of the long-context cases' prompt: the first words of this
/// passage (repeated if a model needs more), as many as [`long_prompt`] needs.
pub use moeconf_fixtures::prompts::LONG_PASSAGE;

/// Which prompt a case runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MatrixPrompt {
    /// "why the sheep" (every case but the long-context ones).
    Short,
    /// The long prompt ([`long_prompt`]).
    Long,
}

impl MatrixPrompt {
    fn name(self) -> &'static str {
        match self {
            MatrixPrompt::Short => "short",
            MatrixPrompt::Long => "long",
        }
    }
}

/// The long-context kinds of the matrix.
pub fn long_context_kinds() -> [FaultKind; 3] {
    [
        FaultKind::WindowRingReadOffByOne,
        FaultKind::IndexerTopkTakesNextEntry,
        FaultKind::CompressedPositionOffByOne,
    ]
}

/// The latest position at which a long-context kind first acts on any
/// layer of `cfg` ([`FaultKind::long_context_onset`]; `None`: none acts).
pub fn latest_onset(cfg: &moeconf_reference_runtime::config::ModelConfig) -> Option<u32> {
    long_context_kinds()
        .iter()
        .flat_map(|k| {
            cfg.layer_types
                .iter()
                .filter_map(|&t| k.long_context_onset(cfg, t))
        })
        .max()
}

/// The long prompt of the model: the fewest words of [`LONG_PASSAGE`]
/// (cycled) whose ids reach one position past the latest onset of a
/// long-context kind on any layer ([`FaultKind::long_context_onset`]), so
/// that every long-context case acts inside its prefill. Its text and ids.
pub fn long_prompt(ctx: &Ctx) -> Result<(String, Vec<u32>)> {
    let need = latest_onset(ctx.m.model.config()).map_or(1, |o| o as usize + 1);
    let unreachable = || CalibrateError::Invalid(format!("no prompt of the passage reaches {need} tokens"));
    let (text, _) =
        moeconf_fixtures::prompts::fewest_passage_words(need, |t| ctx.encode(t).map(|ids| ids.len()))?
            .ok_or_else(unreachable)?;
    let ids = ctx.encode(&text)?;
    Ok((text, ids))
}

/// Both profiles, in report order.
const PROFILES: [Precision; 2] = [Precision::Bf16, Precision::F32];

/// Where a case's first divergence must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// Forward step.
    pub step: u32,
    /// Decoder layer (`None` for model-global records).
    pub layer: Option<u32>,
    /// The record (any member, for the family `moe.term.J`).
    pub component: Component,
}

/// One row of the matrix: a fault plan and where it must be localized.
#[derive(Debug, Clone)]
pub struct Case {
    /// The faults of the plan (one, except the two-event nudge case).
    pub faults: Vec<Fault>,
    /// Where the first divergence must be.
    pub expect: Expect,
    /// What the case shows (empty for a single fault at its own step and layer).
    pub note: &'static str,
    /// Words the diff's reading of the localized operator must contain: the
    /// uncaptured steps it names inside the operator, or the candidate
    /// combine's fitted scales (`None`: no reading is required).
    pub reading: Option<&'static str>,
    /// The prompt the case (and its reference) runs on.
    pub prompt: MatrixPrompt,
}

impl Case {
    /// One fault at its step and layer, localized there by its kind's record.
    pub fn at(step: u32, layer: u32, kind: FaultKind) -> Case {
        let component = kind.component();
        let layer = if kind.is_global() { None } else { Some(layer) };
        Case {
            expect: Expect {
                step,
                layer,
                component,
            },
            faults: vec![Fault::at(step, layer.unwrap_or(0), kind)],
            note: "",
            reading: None,
            prompt: MatrixPrompt::Short,
        }
    }

    /// The case with the words its reading must contain.
    fn reads(mut self, words: &'static str) -> Case {
        self.reading = Some(words);
        self
    }

    /// The case with a note saying what it shows.
    fn note(mut self, note: &'static str) -> Case {
        self.note = note;
        self
    }

    /// The case's name for reports: its first fault's kind, marked when the
    /// plan has more events.
    pub fn name(&self) -> String {
        let first = self.faults.first().map(|f| f.kind.name()).unwrap_or_default();
        match self.faults.len() {
            0 | 1 => first,
            n => format!("{first} (+{} more event{})", n - 1, if n > 2 { "s" } else { "" }),
        }
    }
}

/// The model's layers by kind, and the steps of the run the matrix uses.
struct Plan {
    layers: u32,
    csa: Vec<u32>,
    compressed: Vec<u32>,
    sliding: Vec<u32>,
    routed: Vec<u32>,
    hashed: Vec<u32>,
    /// The last step of the run.
    last: u32,
    /// The first decode step whose token closes a CSA (else compressed) window.
    closing: u32,
    /// The first decode step whose token closes no such window.
    open: u32,
}

impl Plan {
    fn new(ctx: &Ctx, prompt_len: usize, tokens: usize) -> Plan {
        let cfg = ctx.m.model.config();
        let layers = cfg.num_layers() as u32;
        let of = |f: &dyn Fn(usize) -> bool| (0..layers).filter(|&i| f(i as usize)).collect::<Vec<u32>>();
        let csa = of(&|i| cfg.layer_types[i] == AttentionKind::Csa);
        let rate = if csa.is_empty() {
            cfg.hca_rate
        } else {
            cfg.csa_rate
        }
        .max(1);
        let last = tokens.saturating_sub(1) as u32;
        let closes = |st: u32| (prompt_len + st as usize).is_multiple_of(rate);
        Plan {
            layers,
            compressed: of(&|i| cfg.layer_types[i] != AttentionKind::Sliding),
            sliding: of(&|i| cfg.layer_types[i] == AttentionKind::Sliding),
            routed: of(&|i| cfg.mlp_layer_types[i] == MlpKind::Moe),
            hashed: of(&|i| cfg.mlp_layer_types[i] == MlpKind::HashMoe),
            csa,
            last,
            closing: (1..=last).find(|&st| closes(st)).unwrap_or(0),
            open: (1..=last).find(|&st| !closes(st)).unwrap_or(0),
        }
    }

    /// Step `x`, or the last step of a shorter run.
    fn s(&self, x: u32) -> u32 {
        x.min(self.last)
    }

    /// Element `i` of `v` (its last for a shorter list), else `fallback`.
    fn pick(&self, v: &[u32], i: usize, fallback: u32) -> u32 {
        v.get(i.min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or(fallback)
    }

    fn mid(&self) -> u32 {
        self.layers / 2
    }

    /// The layer where the combine faults sit (the second-to-last routed layer).
    fn merge_layer(&self) -> u32 {
        self.pick(&self.routed, self.routed.len().saturating_sub(2), self.mid())
    }
}

/// The mHC mixing of both halves: pre weights, Sinkhorn, post weights, the
/// collapse and the post's mixing sum.
fn mhc_cases(pl: &Plan) -> Vec<Case> {
    use FaultKind as K;
    let (att, ffn) = (Half::Attention, Half::Ffn);
    let l = |i: usize| pl.pick(&(0..pl.layers).collect::<Vec<_>>(), i, 0);
    vec![
        Case::at(pl.s(1), l(1), K::MhcPreWeightsWithoutEpsilon(att)),
        Case::at(pl.s(1), l(3), K::MhcPostWeightsTruncated(att)),
        Case::at(pl.s(2), l(2), K::MhcSinkhornWithoutEpsilon(att)),
        Case::at(pl.s(1), l(4), K::MhcCollapseBf16Weights(att)),
        Case::at(pl.s(2), l(5), K::MhcPostMixBf16Accumulator(att)),
        Case::at(pl.s(2), l(6), K::MhcPreWeightsWithoutEpsilon(ffn)),
        Case::at(pl.s(1), l(7), K::MhcPostWeightsTruncated(ffn)),
        Case::at(pl.s(3), l(5), K::MhcSinkhornWithoutEpsilon(ffn)),
        Case::at(pl.s(2), l(0), K::MhcCollapseBf16Weights(ffn)),
        Case::at(pl.s(1), l(8), K::MhcPostMixBf16Accumulator(ffn)),
    ]
}

/// The embedding, the attention operators and the head.
fn attention_cases(pl: &Plan) -> Vec<Case> {
    use FaultKind as K;
    let attn_layer = pl.pick(&pl.compressed, 0, 0);
    let split_k = Case {
        faults: vec![Fault {
            step: None,
            layer: Some(attn_layer),
            position: None,
            kind: K::AttentionSplitKDecode,
        }],
        expect: Expect {
            step: pl.s(1),
            layer: Some(attn_layer),
            component: Component::AttnCore,
        },
        note: "active at every step; a decode kernel, so the first decode step",
        reading: None,
        prompt: MatrixPrompt::Short,
    };
    vec![
        Case::at(pl.s(2), 0, K::EmbeddingWrongRow),
        Case::at(pl.s(1), pl.mid(), K::AttnNormEpsilon(1e-2)),
        Case::at(pl.s(2), attn_layer, K::QueryRopePositionOffByOne),
        Case::at(pl.s(3), attn_layer, K::AttentionSoftmaxReversed),
        Case::at(pl.s(3), attn_layer, K::AttentionSoftmaxBf16Accumulator),
        split_k,
        Case::at(pl.s(2), pl.pick(&pl.csa, 2, attn_layer), K::DerotationSkipped),
        Case::at(pl.s(2), 1.min(pl.layers - 1), K::AttentionOutputTruncate),
        Case::at(pl.s(3), pl.layers - 1, K::KvLowPrecision { mantissa_bits: 3 }),
        Case::at(pl.s(2), pl.mid(), K::KvProjectionTruncate)
            .note("uncaptured step: the KV projection inside attn.kv")
            .reads("the KV projection (W_kv)"),
        Case::at(pl.s(1), 2.min(pl.layers - 1), K::OutputGroupTruncate { group: 1 })
            .note("uncaptured step: one head group's W_oa inside attn.output")
            .reads("the grouped projections W_oa"),
        // Model-global: the layer is ignored.
        Case::at(pl.s(2), 0, K::HeadNormEpsilon(1e-2)),
    ]
}

/// Cache storage versus cache reads, the compressors, their carried state
/// and the lightning indexer.
fn cache_cases(pl: &Plan) -> Vec<Case> {
    use FaultKind as K;
    let csa = |i: usize| pl.pick(&pl.csa, i, pl.pick(&pl.compressed, 0, 0));
    let bits = 3;
    vec![
        Case::at(pl.s(2), pl.pick(&pl.sliding, 0, 0), K::WindowStoreLowPrecision { mantissa_bits: bits })
            .note("cache storage: attn.kv is right, the stored row is not"),
        Case::at(pl.s(3), pl.pick(&pl.sliding, 1, 0), K::WindowReadDropsOldest)
            .note("cache read: the stored window is right, the read is not"),
        Case::at(pl.closing, csa(1), K::CompressorPoolingReversed),
        Case::at(pl.closing, csa(1), K::CompressorPoolingBf16Accumulator),
        Case::at(pl.closing, csa(0), K::CompressorIgnoresOverlap),
        Case::at(pl.closing, csa(2), K::CompressorNormEpsilon(1e-2))
            .note("uncaptured step: the compressor's norm inside attn.compressed")
            .reads("its norm"),
        Case::at(pl.closing, csa(2), K::CompressorOverlapGateWithoutBias)
            .note("carried state: only the next window's entry reads it, so the L2 record at the boundary comes first"),
        Case::at(pl.closing, csa(2), K::CompressedStoreLowPrecision { mantissa_bits: bits }),
        Case::at(pl.open, csa(1), K::IndexerBufferLowPrecision { mantissa_bits: bits })
            .note("carried buffer: read when the window closes, steps later; the L2 record at the boundary comes first"),
        Case::at(pl.closing, csa(0), K::IndexerCompressorPoolingBf16Accumulator),
        Case::at(pl.closing, csa(1), K::IndexerStoreLowPrecision { mantissa_bits: bits }),
        Case::at(pl.s(2), csa(0), K::IndexerScoreScaleAfterSum)
            .note("absorbed when the selection keeps its set (attention reads the selection in entry order)"),
        Case::at(pl.s(2), csa(2), K::IndexerTopkDropsLast),
    ]
}

/// The FFN norm, router, experts and combine.
fn ffn_cases(ctx: &Ctx, pl: &Plan) -> Result<Vec<Case>> {
    use FaultKind as K;
    let r = |i: usize| pl.pick(&pl.routed, i, pl.mid());
    let merge = pl.merge_layer();
    let classes = b_class_count(ctx.k())?;
    let b135 = AggregationContract::b().with_order(Order::BClass(135.min(classes - 1)));
    Ok(vec![
        Case::at(pl.s(1), pl.mid(), K::FfnNormEpsilon(1e-2)),
        Case::at(pl.s(1), r(1), K::RouterSoftplusBf16Exp),
        Case::at(pl.s(2), r(pl.routed.len() / 2), K::RouterNearTieFlip),
        Case::at(
            pl.s(1),
            pl.pick(&pl.hashed, pl.hashed.len().saturating_sub(1), 0),
            K::HashRouteNextRow,
        ),
        Case::at(pl.s(2), r(0), K::RouterGateScaleBeforeDivide),
        Case::at(pl.s(1), r(2), K::RoutedExpertSwigluLimit(0.25)),
        Case::at(pl.s(3), 1.min(pl.layers - 1), K::SharedExpertSwigluLimit(0.25)),
        Case::at(pl.s(1), merge, K::RoutedTermRounded)
            .note("absorbed: the native combine rounds every term the same way"),
        Case::at(pl.s(1), merge, K::SharedExpertFirst),
        Case::at(pl.s(1), merge, K::RoundedRoutedMerge),
        Case::at(pl.s(2), merge, K::SharedExpertScaled(1.5))
            .note("a scaling bug no grammar member names: the fit reads the scale")
            .reads("shared expert × 1.5"),
        Case::at(pl.s(1), r(1), K::RoutedScalingAppliedTwice)
            .note("the routed scaling factor applied again in the combine: the fit reads it")
            .reads("routed terms × 1.5"),
        Case::at(pl.s(2), r(2), K::GateOnUnroundedProduct)
            .note("the gate applied to the unrounded down projection (silent in f32, which does not round there)")
            .reads("W2, and the gate multiply"),
        Case::at(pl.s(2), ctx.fork_layer, K::CombineContract(b135)),
        Case::at(0, r(0), K::CombineContract(AggregationContract::p32())),
    ])
}

/// The matrix of one profile: every case above, and the two one-ulp combine
/// nudges of issue 13's gap 1 (their elements searched on the runtime, see
/// `nudge_elements`).
pub fn matrix(ctx: &Ctx, precision: Precision, ids: &[u32], tokens: usize) -> Result<Vec<Case>> {
    let pl = Plan::new(ctx, ids.len(), tokens);
    let mut cases = attention_cases(&pl);
    cases.extend(mhc_cases(&pl));
    cases.extend(cache_cases(&pl));
    cases.extend(ffn_cases(ctx, &pl)?);
    cases.extend(nudge_cases(ctx, precision, ids, &pl)?);
    Ok(cases)
}

/// The long-context cases, on the long prompt of `prompt_len` ids and
/// `tokens` tokens: each kind active at every step and position of one
/// layer (the window ring on the last sliding layer, the indexer on the
/// second CSA layer, the compressor on the first HCA layer, else the first
/// CSA layer), expected at the step holding its onset on that layer (the
/// prefill when the prompt reaches it). A kind with no onset on the model
/// (no such layer) or past the run has no case.
pub fn long_context_matrix(ctx: &Ctx, prompt_len: usize, tokens: usize) -> Vec<Case> {
    use FaultKind as K;
    let cfg = ctx.m.model.config();
    let pl = Plan::new(ctx, prompt_len, tokens);
    let hca: Vec<u32> = (0..pl.layers)
        .filter(|&i| cfg.layer_types[i as usize] == AttentionKind::Hca)
        .collect();
    let csa_or = |v: &[u32], i: usize| v.get(i).copied();
    let cases = [
        (
            K::WindowRingReadOffByOne,
            pl.sliding.last().copied().or(Some(0)),
            "long context, every step and position: a no-op until the window ring has wrapped twice (t >= 2w)",
        ),
        (
            K::IndexerTopkTakesNextEntry,
            csa_or(&pl.csa, 1).or(pl.csa.first().copied()),
            "long context, every step and position: a no-op until there are more compressed entries than index_topk",
        ),
        (
            K::CompressedPositionOffByOne,
            hca.first().copied().or(pl.csa.first().copied()),
            "long context, every step and position: a no-op until the second compression window closes",
        ),
    ];
    cases
        .into_iter()
        .filter_map(|(kind, layer, note)| {
            let layer = layer?;
            let onset = kind.long_context_onset(cfg, *cfg.layer_types.get(layer as usize)?)? as usize;
            // The step holding the onset position: the prefill, or decode step onset − len + 1.
            let step = match onset < prompt_len {
                true => 0,
                false => u32::try_from(onset + 1 - prompt_len).ok()?,
            };
            (step <= pl.last).then(|| Case {
                expect: Expect {
                    step,
                    layer: Some(layer),
                    component: kind.component(),
                },
                faults: vec![Fault {
                    step: None,
                    layer: Some(layer),
                    position: None,
                    kind,
                }],
                note,
                reading: None,
                prompt: MatrixPrompt::Long,
            })
        })
        .collect()
}

/// A combine nudge at one event.
fn nudge(step: u32, layer: u32, element: usize) -> Fault {
    Fault::at(step, layer, FaultKind::CombineElementNudge { element })
}

/// Gap 1 of issue 13: exactly one `moe.combine` value moved by one ulp at
/// the first decode step, where the FFN hc_post absorbs it (nothing else
/// differs), alone and followed by a nudge two steps later that propagates.
/// Both must be localized at the absorbed event.
fn nudge_cases(ctx: &Ctx, precision: Precision, ids: &[u32], pl: &Plan) -> Result<Vec<Case>> {
    let (layer, first, later) = (pl.merge_layer(), pl.s(1), pl.s(3));
    if first == 0 || later <= first {
        return Ok(Vec::new());
    }
    let (Some(absorbed), _) = nudge_elements(ctx, precision, ids, first, layer)? else {
        return Ok(Vec::new());
    };
    let (_, Some(propagating)) = nudge_elements(ctx, precision, ids, later, layer)? else {
        return Ok(Vec::new());
    };
    let expect = Expect {
        step: first,
        layer: Some(layer),
        component: Component::MoeCombine,
    };
    Ok(vec![
        Case {
            faults: vec![nudge(first, layer, absorbed)],
            expect,
            note: "one combine value changed, absorbed by the FFN hc_post (nothing else differs)",
            reading: None,
            prompt: MatrixPrompt::Short,
        },
        Case {
            faults: vec![nudge(first, layer, absorbed), nudge(later, layer, propagating)],
            expect,
            note: "the absorbed nudge, then a nudge two steps later that propagates (issue 13 gap 1)",
            reading: None,
            prompt: MatrixPrompt::Short,
        },
    ])
}

/// The first element whose one-ulp nudge of `moe.combine` at (`step`,
/// `layer`) leaves that layer's `layer.post_ffn_mhc` unchanged (absorbed),
/// and the first whose nudge changes it (propagating): each candidate runs
/// the one decode step from the native state before it. A rule, not a
/// choice: the lowest such elements.
fn nudge_elements(
    ctx: &Ctx,
    precision: Precision,
    ids: &[u32],
    step: u32,
    layer: u32,
) -> Result<(Option<usize>, Option<usize>)> {
    let mut before = ctx.m.model.new_state();
    let mut null = moeconf_reference_runtime::capture::NullSink;
    ctx.advance_in(
        &mut before,
        ids,
        step as usize,
        &NativeCombine,
        None,
        &mut null,
        precision,
    )?;
    let post = |plan: Option<&FaultPlan>| -> Result<Vec<u8>> {
        let mut st: DecodeState = before.clone();
        let mut sink = MemorySink::with_levels(&[Level::L3]);
        ctx.advance_in(
            &mut st,
            ids,
            step as usize + 1,
            &NativeCombine,
            plan,
            &mut sink,
            precision,
        )?;
        let rec = sink
            .records
            .iter()
            .find(|r| r.coord.layer == Some(layer) && Component::LayerPostFfnMhc.matches(&r.coord.path));
        rec.map(|r| r.bytes.clone()).ok_or_else(|| {
            CalibrateError::Invalid(format!("no layer.post_ffn_mhc at step {step} layer {layer}"))
        })
    };
    let native = post(None)?;
    let (mut absorbed, mut propagating) = (None, None);
    for e in 0..ctx.m.model.config().hidden_size {
        if absorbed.is_some() && propagating.is_some() {
            break;
        }
        let same = post(Some(&FaultPlan::new(vec![nudge(step, layer, e)])))? == native;
        match same {
            true => absorbed = absorbed.or(Some(e)),
            false => propagating = propagating.or(Some(e)),
        }
    }
    Ok((absorbed, propagating))
}

/// A record location: step, layer, path, position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Found {
    step: u32,
    layer: Option<u32>,
    operator: String,
    position: u32,
}

impl Found {
    fn json(&self) -> Value {
        json!({"step": self.step, "layer": self.layer, "operator": self.operator, "position": self.position})
    }

    /// Whether this is the expected step, layer and record.
    fn is(&self, e: &Expect) -> bool {
        self.step == e.step && self.layer == e.layer && e.component.matches(&self.operator)
    }
}

/// Where a case had to be localized, in its reported form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Expected {
    step: u32,
    layer: Option<u32>,
    /// The record (`moe.term.*` for the family).
    operator: String,
}

/// What the diff made of one case in one profile: the result of one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Outcome {
    /// The profile's name.
    profile: String,
    /// The prompt the case ran on.
    prompt: MatrixPrompt,
    /// Its length in ids.
    prompt_tokens: usize,
    /// Its text.
    prompt_text: String,
    /// The case's name ([`Case::name`]).
    fault: String,
    note: String,
    /// The plan's faults, as reported.
    faults: Value,
    expected: Expected,
    /// The candidate trace differs from the reference (root digests differ).
    effective: bool,
    /// The diff called the pair equivalent.
    equivalent: bool,
    /// The diff's headline.
    found: Option<Found>,
    /// The first differing record of the two traces in execution order.
    truth: Option<Found>,
    /// Whether the truth is the expected step, layer and record.
    truth_is_expected: Option<bool>,
    /// Whether a layer checkpoint of the truth's step differs after it.
    divergence: Option<String>,
    /// How many records differ (by digest, records at the same index).
    differing_records: usize,
    contract: Option<String>,
    /// The headline is exactly the expected step, layer and record.
    localized: bool,
    /// What the diff says inside the localized operator: the uncaptured
    /// steps it names, then the candidate combine's fitted reading.
    reading: Option<String>,
    /// The words the case requires of that reading.
    expected_reading: Option<String>,
    summary: String,
}

impl Outcome {
    fn result(&self) -> &'static str {
        match (self.effective, self.localized, self.equivalent) {
            (true, true, _) => "exact",
            (true, false, _) => "WRONG",
            (false, _, true) => "silent (bitwise identical run; diff: equivalent)",
            (false, _, false) => "FALSE POSITIVE",
        }
    }

    fn json(&self) -> Value {
        let e = &self.expected;
        json!({
            "profile": self.profile, "fault": self.fault, "note": self.note,
            "prompt": self.prompt.name(), "prompt_tokens": self.prompt_tokens,
            "faults": self.faults,
            "expected": {"step": e.step, "layer": e.layer, "operator": e.operator},
            "found": self.found.as_ref().map(Found::json),
            "first_differing_record": self.truth.as_ref().map(Found::json),
            "first_differing_record_is_expected": self.truth_is_expected,
            "divergence": self.divergence, "differing_records": self.differing_records,
            "inferred_contract": self.contract, "effective": self.effective, "localized": self.localized,
            "diff_equivalent": self.equivalent, "diff_summary": self.summary, "result": self.result(),
            "reading": self.reading, "expected_reading": self.expected_reading,
            "worded": self.worded(),
        })
    }

    /// Whether the reading holds the required words (`None` when none are
    /// required or the case changed nothing).
    fn worded(&self) -> Option<bool> {
        let words = self.expected_reading.as_deref().filter(|_| self.effective)?;
        Some(self.reading.as_deref().is_some_and(|r| r.contains(words)))
    }
}

/// The first record whose digest differs between the two traces, in index
/// (execution) order, or the first record only one of them has; and what
/// kind of divergence it is: *propagating* (a layer checkpoint of the same
/// step differs after it, or it is one), *absorbed* (none does: rounding
/// erased it before the next checkpoint), *state* (the first difference is
/// persistent state at a decode boundary) or *output* (the step's logits or
/// token, after every layer).
fn first_differing_record(r: &Trace, c: &Trace) -> Result<(Option<Found>, Option<&'static str>)> {
    let at = |e: &moeconf_schema::IndexEntry| Found {
        step: e.coord.step,
        layer: e.coord.layer,
        operator: e.coord.path.to_string(),
        position: e.coord.position,
    };
    let (rr, cr) = (r.records()?, c.records()?);
    let differs = |(a, b): &(&moeconf_schema::IndexEntry, &moeconf_schema::IndexEntry)| {
        a.digest != b.digest || a.coord != b.coord
    };
    let Some(i) = rr.iter().zip(cr).position(|p| differs(&p)) else {
        let only = match rr.len().cmp(&cr.len()) {
            std::cmp::Ordering::Less => cr.get(rr.len()).map(at),
            std::cmp::Ordering::Greater => rr.get(cr.len()).map(at),
            std::cmp::Ordering::Equal => None,
        };
        return Ok((only, None));
    };
    let step = rr[i].coord.step;
    let propagates = rr[i..].iter().zip(&cr[i..]).any(|p| {
        p.0.coord.step == step
            && Component::parse(&p.0.coord.path).is_some_and(|(c, _)| c.is_checkpoint())
            && differs(&p)
    });
    let kind = match Component::parse(&rr[i].coord.path).map(|(c, _)| c.exec_group()) {
        Some(ExecGroup::State) => "state",
        Some(ExecGroup::StepOutput) => "output",
        _ if propagates => "propagating",
        _ => "absorbed",
    };
    Ok((Some(at(&rr[i])), Some(kind)))
}

/// The name of a trace of one profile, relative to the output directory.
fn trace_name(precision: Precision, name: &str) -> String {
    format!("traces/fault-{}-{name}.bin", precision.name())
}

/// The trace paths of one profile.
fn trace_path(ctx: &Ctx, precision: Precision, name: &str) -> PathBuf {
    ctx.out.join(trace_name(precision, name))
}

/// Writes the candidate trace of case `i` and diffs it against the reference.
fn run_case(
    ctx: &Ctx,
    precision: Precision,
    (text, ids): (&str, &[u32]),
    ref_path: &Path,
    i: usize,
    case: &Case,
) -> Result<Outcome> {
    let path = trace_path(ctx, precision, &format!("{:02}", i + 1));
    let plan = FaultPlan::new(case.faults.clone());
    ctx.write_trace_in(
        TraceRequest {
            prompt: text,
            prompt_ids: ids,
            tokens: ctx.sizes.tokens,
            combine: &NativeCombine,
            faults: Some(&plan),
            notes: vec![("fault".to_string(), case.name())],
            path: &path,
        },
        precision,
    )?;
    let (r, c) = (Trace::open_verified(ref_path)?, Trace::open_verified(&path)?);
    let report = diff(&r, &c, &DiffOptions::default())?;
    let first = report.first_divergence.as_ref();
    let found = first.map(|d| Found {
        step: d.step,
        layer: d.layer,
        operator: d.operator.clone(),
        position: d.position,
    });
    let localized = found.as_ref().is_some_and(|d| d.is(&case.expect));
    let (truth, divergence) = first_differing_record(&r, &c)?;
    let differing_records = r
        .records()?
        .iter()
        .zip(c.records()?)
        .filter(|(a, b)| a.digest != b.digest)
        .count();
    let e = &case.expect;
    let l4 = &report.levels.l4;
    let fit = l4
        .contract
        .as_ref()
        .and_then(|c| c.candidate_explanation.as_ref())
        .and_then(|x| x.fit.as_ref())
        .map(|f| f.summary.clone());
    let inside = l4.localized.as_ref().and_then(|l| l.uncaptured_steps.clone());
    let reading = match (inside, fit) {
        (Some(a), Some(b)) => Some(format!("{a}; {b}")),
        (a, b) => a.or(b),
    };
    Ok(Outcome {
        profile: precision.name().into(),
        prompt: case.prompt,
        prompt_tokens: ids.len(),
        prompt_text: text.into(),
        fault: case.name(),
        note: case.note.into(),
        faults: case
            .faults
            .iter()
            .map(|f| json!({"kind": f.kind.name(), "step": f.step, "layer": f.layer, "position": f.position}))
            .collect(),
        expected: Expected {
            step: e.step,
            layer: e.layer,
            operator: e.component.to_string(),
        },
        effective: r.root() != c.root(),
        equivalent: report.verdict == Verdict::Equivalent,
        contract: first.and_then(|d| d.contract.clone()),
        truth_is_expected: truth.as_ref().map(|t| t.is(e)),
        truth,
        divergence: divergence.map(String::from),
        differing_records,
        found,
        localized,
        reading,
        expected_reading: case.reading.map(String::from),
        summary: report.summary.clone(),
    })
}

/// The reference trace's name of one prompt.
fn reference_name(prompt: MatrixPrompt) -> &'static str {
    match prompt {
        MatrixPrompt::Short => "reference",
        MatrixPrompt::Long => "long-reference",
    }
}

/// Writes the native reference trace of one profile and prompt.
fn write_reference(
    ctx: &Ctx,
    precision: Precision,
    prompt: MatrixPrompt,
    (text, ids): (&str, &[u32]),
) -> Result<()> {
    let ref_path = trace_path(ctx, precision, reference_name(prompt));
    if let Some(dir) = ref_path.parent() {
        std::fs::create_dir_all(dir).map_err(CalibrateError::io(format!("creating {}", dir.display())))?;
    }
    ctx.write_trace_in(
        TraceRequest {
            prompt: text,
            prompt_ids: ids,
            tokens: ctx.sizes.tokens,
            combine: &NativeCombine,
            faults: None,
            notes: vec![],
            path: &ref_path,
        },
        precision,
    )?;
    Ok(())
}

/// One job of the matrix: a profile's reference trace of one prompt, or one case.
#[derive(Clone, Copy)]
enum MatrixJob {
    Reference { profile: usize, prompt: MatrixPrompt },
    Case { profile: usize, case: usize },
}

/// Protocol 10's jobs: per profile, the reference traces (the long one
/// when there are long-context cases), then every case (its candidate
/// trace and the diff against its prompt's reference).
struct Matrix {
    ids: Vec<u32>,
    /// The long prompt's text and ids.
    long: (String, Vec<u32>),
    cases: Vec<Vec<Case>>,
    jobs: Vec<MatrixJob>,
}

impl Matrix {
    /// The profile and prompt whose reference a job needs.
    fn reference_of(&self, job: MatrixJob) -> (usize, MatrixPrompt) {
        match job {
            MatrixJob::Reference { profile, prompt } => (profile, prompt),
            MatrixJob::Case { profile, case } => (profile, self.cases[profile][case].prompt),
        }
    }

    /// A prompt's text and ids.
    fn prompt(&self, prompt: MatrixPrompt) -> (&str, &[u32]) {
        match prompt {
            MatrixPrompt::Short => (PROMPT, &self.ids),
            MatrixPrompt::Long => (&self.long.0, &self.long.1),
        }
    }
}

impl Jobs for Matrix {
    fn count(&self) -> usize {
        self.jobs.len()
    }

    /// Writes the reference trace of every profile an owned job needs (it is
    /// an output only of the job that owns it).
    fn prepare(&mut self, ctx: &Ctx, owned: &[usize]) -> Result<()> {
        let mut need: Vec<(usize, MatrixPrompt)> = Vec::new();
        for &j in owned {
            let r = self.reference_of(self.jobs[j]);
            if !need.contains(&r) {
                need.push(r);
            }
        }
        need.par_iter()
            .map(|&(p, prompt)| write_reference(ctx, PROFILES[p], prompt, self.prompt(prompt)))
            .collect::<Result<Vec<()>>>()?;
        Ok(())
    }

    fn run(&self, ctx: &Ctx, job: usize) -> Result<JobOut> {
        match self.jobs[job] {
            MatrixJob::Reference { profile, prompt } => Ok(JobOut {
                result: Value::Null,
                files: vec![trace_name(PROFILES[profile], reference_name(prompt))],
            }),
            MatrixJob::Case { profile, case } => {
                let precision = PROFILES[profile];
                let c = &self.cases[profile][case];
                let ref_path = trace_path(ctx, precision, reference_name(c.prompt));
                let outcome = run_case(ctx, precision, self.prompt(c.prompt), &ref_path, case, c)?;
                Ok(JobOut {
                    result: serde_json::to_value(&outcome)?,
                    files: vec![trace_name(precision, &format!("{:02}", case + 1))],
                })
            }
        }
    }
}

/// Plans protocol 10: the matrix of each profile (its nudge elements are
/// searched on the runtime here, in every shard: the job list depends on them).
pub fn plan(ctx: &Ctx) -> Result<Box<dyn Jobs + '_>> {
    let ids = ctx.encode(PROMPT)?;
    let long = long_prompt(ctx)?;
    let n = ctx.sizes.tokens;
    let mut cases = Vec::new();
    let mut jobs = Vec::new();
    for (p, &precision) in PROFILES.iter().enumerate() {
        let mut m = matrix(ctx, precision, &ids, n)?;
        let long_cases = long_context_matrix(ctx, long.1.len(), n);
        ctx.note(&format!(
            "[10] fault-injection localization matrix ({}): {} cases, {n} tokens; {} long-context cases on a {}-token prompt",
            precision.name(),
            m.len(),
            long_cases.len(),
            long.1.len()
        ));
        jobs.push(MatrixJob::Reference {
            profile: p,
            prompt: MatrixPrompt::Short,
        });
        if !long_cases.is_empty() {
            jobs.push(MatrixJob::Reference {
                profile: p,
                prompt: MatrixPrompt::Long,
            });
        }
        m.extend(long_cases);
        jobs.extend((0..m.len()).map(|case| MatrixJob::Case { profile: p, case }));
        cases.push(m);
    }
    Ok(Box::new(Matrix {
        ids,
        long,
        cases,
        jobs,
    }))
}

/// Counts of one profile (or of both).
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    cases: usize,
    effective: usize,
    localized: usize,
    silent: usize,
    silent_ok: usize,
    /// Effective cases that require a reading, and those worded so.
    readings: usize,
    worded: usize,
}

impl Counts {
    fn of<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Counts {
        let mut c = Counts::default();
        for o in outcomes {
            c.cases += 1;
            c.effective += o.effective as usize;
            c.localized += (o.effective && o.localized) as usize;
            c.silent += !o.effective as usize;
            c.silent_ok += (!o.effective && o.equivalent) as usize;
            c.readings += o.worded().is_some() as usize;
            c.worded += (o.worded() == Some(true)) as usize;
        }
        c
    }

    fn json(&self) -> Value {
        json!({
            "faults": self.cases, "effective": self.effective, "localized": self.localized,
            "silent": self.silent, "silent_reported_equivalent": self.silent_ok,
            "readings": self.readings, "readings_worded": self.worded,
        })
    }
}

/// Assembles protocol 10 from its job results (the reference jobs' results
/// are empty; every other is an `Outcome`).
pub fn assemble(params: &Params, results: &[Value]) -> Result<Vec<Section>> {
    let n = params.sizes.tokens;
    let cases: Vec<Value> = results.iter().filter(|v| !v.is_null()).cloned().collect();
    let outcomes: Vec<Outcome> = decode("fault_matrix", &cases)?;
    let all = Counts::of(outcomes.iter());
    let per: Vec<(Precision, Counts)> = PROFILES
        .iter()
        .map(|&p| (p, Counts::of(outcomes.iter().filter(|o| o.profile == p.name()))))
        .collect();
    let each_enough = per.iter().all(|(_, c)| c.effective >= 8);
    // The long-context cases: each must act (on the long prompt) and be localized.
    let long: Vec<(Precision, Counts)> = PROFILES
        .iter()
        .map(|&p| {
            let of = |o: &&Outcome| o.profile == p.name() && o.prompt == MatrixPrompt::Long;
            (p, Counts::of(outcomes.iter().filter(of)))
        })
        .collect();
    let long_all = Counts::of(outcomes.iter().filter(|o| o.prompt == MatrixPrompt::Long));
    let long_ok = long
        .iter()
        .all(|(_, c)| c.cases > 0 && c.effective == c.cases && c.localized == c.cases);
    let long_detail = long
        .iter()
        .map(|(p, c)| format!("{} {}", p.name(), frac(c.localized, c.cases)))
        .collect::<Vec<_>>()
        .join(", ");
    let long_prompt = outcomes.iter().find(|o| o.prompt == MatrixPrompt::Long);
    let detail = per
        .iter()
        .map(|(p, c)| format!("{} {}", p.name(), frac(c.localized, c.effective)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut json = all.json();
    let obj = json
        .as_object_mut()
        .ok_or_else(|| CalibrateError::Invalid("the matrix counts are not a JSON object".into()))?;
    obj.insert("prompt".into(), json!(PROMPT));
    obj.insert("tokens".into(), json!(n));
    obj.insert(
        "long_prompt".into(),
        json!(long_prompt.map(|o| o.prompt_text.clone())),
    );
    obj.insert(
        "long_prompt_tokens".into(),
        json!(long_prompt.map(|o| o.prompt_tokens)),
    );
    obj.insert("long_context".into(), long_all.json());
    obj.insert(
        "profiles".into(),
        per.iter()
            .map(|(p, c)| {
                let mut v = c.json();
                v["precision"] = json!(p.name());
                v
            })
            .collect(),
    );
    obj.insert("rows".into(), outcomes.iter().map(Outcome::json).collect());
    Ok(vec![Section {
        key: "fault_matrix".into(),
        tables: vec![table(n, long_prompt.map(|o| o.prompt_tokens), &outcomes)],
        json,
        claims: vec![
            Claim::new(
                "localization_exact",
                all.localized == all.effective && each_enough,
                format!(
                    "{} effective injected faults localized to exactly their step, layer and operator ({detail}; at least 8 per profile needed)",
                    frac(all.localized, all.effective)
                ),
            ),
            Claim::new(
                "long_context_localized",
                long_ok,
                format!(
                    "{} long-context faults (run on a {}-token prompt) changed bits and were localized to exactly their step, layer and operator ({long_detail}; at least one per profile needed)",
                    frac(long_all.localized, long_all.cases),
                    long_prompt.map_or(0, |o| o.prompt_tokens),
                ),
            ),
            Claim::new(
                "readings_named",
                all.worded == all.readings && all.readings > 0,
                format!(
                    "{} faults in uncaptured sub-operators and scaling faults worded with the steps or scales that hold them",
                    frac(all.worded, all.readings)
                ),
            ),
            Claim::new(
                "silent_faults_equivalent",
                all.silent_ok == all.silent,
                format!(
                    "{} silent faults (no bit changed) reported equivalent",
                    frac(all.silent_ok, all.silent)
                ),
            ),
        ],
    }])
}

fn table(n: usize, long: Option<usize>, outcomes: &[Outcome]) -> Table {
    let long = long.map_or(String::new(), |l| {
        format!(" (the long-context cases: a built-in passage of {l} prompt tokens)")
    });
    let mut t = Table::new(
        "fault_localization",
        &format!(
            "Fault-injection localization matrix: \"{PROMPT}\"{long}, {n} tokens, diff against the native trace of each profile and prompt"
        ),
        &[
            "Profile",
            "#",
            "Fault",
            "Expected step",
            "Expected layer",
            "Expected record",
            "Localized step",
            "Localized layer",
            "Localized record",
            "Divergence",
            "Result",
            "Reading",
            "Prompt tokens",
        ],
    );
    let opt = |x: Option<u32>| x.map_or("-".to_string(), |v| v.to_string());
    let mut index = 0;
    let mut profile: Option<&str> = None;
    for o in outcomes {
        if profile != Some(o.profile.as_str()) {
            profile = Some(o.profile.as_str());
            index = 0;
        }
        index += 1;
        let (fs, fl, fo) = match &o.found {
            Some(f) => (f.step.to_string(), opt(f.layer), f.operator.clone()),
            None => ("-".into(), "-".into(), "(equivalent)".into()),
        };
        let e = &o.expected;
        t.row(vec![
            o.profile.clone(),
            index.to_string(),
            o.fault.clone(),
            e.step.to_string(),
            opt(e.layer),
            e.operator.clone(),
            fs,
            fl,
            fo,
            o.divergence.clone().unwrap_or_else(|| "-".into()),
            o.result().into(),
            match o.worded() {
                Some(true) => "named".into(),
                Some(false) => "NOT NAMED".into(),
                None => "-".into(),
            },
            o.prompt_tokens.to_string(),
        ]);
    }
    t
}
