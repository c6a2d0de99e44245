//! The divergences of two traces in the catalogue's execution order
//! (`moeconf_fingerprint::catalogue::ExecKey`), across every compared level:
//! the first differing record is the headline; each divergence is a
//! differing record whose inputs all match (its operator computed something
//! different from the same inputs), classified as *propagating* (a later
//! checkpoint differs) or *absorbed* (none does: rounding erased it before
//! the next checkpoint). Both follow causality
//! (`moeconf_fingerprint::catalogue::reaches`): a divergence propagates only
//! to a checkpoint it can reach (never an earlier position of the forward).
//! After an absorbed divergence the walk goes on to the next one; after a
//! propagating one it goes on through the records that the divergence cannot
//! reach, where a divergence is independent of it: earlier positions of later
//! layers in its own step and, in later steps fed the same tokens, the layers
//! before its own (a later step sees it only through the persistent state it
//! changed, [`reaches_fed_equal`]). The walk stops at the first later step
//! fed a differing token (or whose fed token is not compared), since
//! everything from there on can follow from it.
//!
//! The walk enters only steps, levels and layer groups whose digests differ
//! (`Sides::differing_records`), and reads no payload.

use crate::ctx::Ctx;
use crate::error::BisectError;
use crate::layerkind;
use crate::operators::is_checkpoint;
use crate::operators::{describe_input, producer};
use crate::quantization::status_differs;
use crate::report::{Absorption, DivergenceKind, InputCheck};
use crate::storage::Rounding;
use crate::walk::Pair;
use moeconf_fingerprint::catalogue::{reaches, ExecGroup, ExecKey};
use moeconf_fingerprint::{Component, Level};
use std::collections::HashSet;

/// The status of an input that only captures record ([`observational`])
/// and that differs: reported, not counted as a differing input.
pub(crate) const OBSERVED_DIFFERS: &str = "observed_differs";

/// Whether `path` is a record only captures hold (`Presence::CaptureOnly`,
/// e.g. `moe.routed`): an observation of a backend's intermediate value.
/// It is compared and reported, but neither ends the walk nor keeps the
/// operator that consumes it from being localized.
pub(crate) fn observational(path: &str) -> bool {
    producer(path).is_some_and(|c| c.spec().presence == moeconf_fingerprint::catalogue::Presence::CaptureOnly)
}

/// The status of a combine input that differs but whose difference both
/// sides' contracts absorb (`crate::counterfactual`): counts as matching.
pub(crate) const ABSORBED_BY_CONTRACTS: &str = "absorbed_by_contracts";

/// A divergence's kind, the record that decides it and, when absorbed, where.
type Classified = (Option<DivergenceKind>, Option<Pair>, Option<Absorption>);

/// At most this many divergences are listed.
pub const MAX_DIVERGENCES: usize = 16;
/// At most this many differing records are examined while looking for the
/// next divergence after an absorbed one.
const MAX_EXAMINED: usize = 100_000;

/// One divergence, before rendering into the report.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    /// The record.
    pub pair: Pair,
    /// Propagating or absorbed (`None`: the deciding checkpoints are not compared).
    pub kind: Option<DivergenceKind>,
    /// The first later checkpoint that differs (propagating), or the next
    /// checkpoint, which matches (absorbed).
    pub checkpoint: Option<Pair>,
    /// Absorbed: where.
    pub absorbed_at: Option<Absorption>,
    pub inputs: Vec<InputCheck>,
    /// Whether every captured input matches.
    pub inputs_match: bool,
}

/// What lies after the listed divergences (`DiffReport::rest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rest {
    /// Every other differing record follows from a listed divergence
    /// without reaching a checkpoint.
    None,
    /// The last divergence reaches later checkpoints.
    Propagates,
    /// The checkpoints that would classify the last divergence are not compared.
    Unclassified,
    /// More divergences than [`MAX_DIVERGENCES`] (or records than the walk examines).
    Limit,
}

impl Rest {
    /// The report's word.
    pub fn name(self) -> &'static str {
        match self {
            Rest::None => "none",
            Rest::Propagates => "propagates",
            Rest::Unclassified => "unclassified",
            Rest::Limit => "limit",
        }
    }
}

/// The divergences found, and the localized operator of the first one.
pub(crate) struct Divergences {
    /// In execution order; the first is the first differing record that
    /// neither storage precision nor coverage explains.
    pub events: Vec<Event>,
    /// Records the walk passed because they differ only by storage
    /// precision ([`crate::storage`]), in execution order, with the rounding.
    pub storage: Vec<(Pair, Rounding)>,
    /// What lies after them.
    pub rest: Rest,
    /// The first differing record of the first divergent step whose inputs
    /// all match (normally the first event's record), with its inputs.
    pub localized: Option<(Pair, Vec<InputCheck>, bool)>,
}

/// What the walk has seen differ so far, for records whose relation to
/// earlier records the catalogue does not list (persistent state, the
/// step's outputs, the step's input ids, paths outside the catalogue).
#[derive(Default)]
struct Seen {
    /// Layers with a differing record in the current step.
    layers: HashSet<u32>,
    /// (layer, position) with a differing record in the current step.
    sites: HashSet<(u32, u32)>,
    /// Layers whose persistent state differs at the previous / this boundary.
    state_before: HashSet<u32>,
    state_now: HashSet<u32>,
    /// A step-output record (logits, top-k, token, text) differs in this step.
    output: bool,
    /// The token (`token.output`) of the previous / this step differs.
    token_before: bool,
    token_now: bool,
    /// The continuation text of the previous / this step differs.
    text_before: bool,
    text_now: bool,
}

impl Seen {
    /// Moves on to the next step (`contiguous`: it directly follows the last one walked).
    fn next_step(&mut self, contiguous: bool) {
        self.layers.clear();
        self.sites.clear();
        self.state_before = if contiguous {
            std::mem::take(&mut self.state_now)
        } else {
            HashSet::new()
        };
        self.state_now.clear();
        self.output = false;
        self.token_before = contiguous && self.token_now;
        self.text_before = contiguous && self.text_now;
        self.token_now = false;
        self.text_now = false;
    }

    fn note(&mut self, key: &ExecKey, component: Option<Component>) {
        match key.group {
            ExecGroup::Layer => {
                self.layers.insert(key.layer);
                self.sites.insert((key.layer, key.position));
            }
            ExecGroup::State => {
                self.state_now.insert(key.layer);
            }
            ExecGroup::StepOutput => self.output = true,
            ExecGroup::StepInput => {}
        }
        match component {
            Some(Component::TokenOutput) => self.token_now = true,
            Some(Component::TextContinuation) => self.text_now = true,
            _ => {}
        }
    }

    /// Whether a record without catalogue inputs follows from what differed
    /// before it.
    fn explains(&self, key: &ExecKey, component: Option<Component>) -> bool {
        match (key.group, component) {
            (ExecGroup::State, _) => {
                self.layers.contains(&key.layer) || self.state_before.contains(&key.layer)
            }
            (ExecGroup::StepInput, Some(Component::TokenInput)) => self.token_before,
            (ExecGroup::StepOutput, Some(Component::TextContinuation)) => self.output || self.text_before,
            (ExecGroup::StepOutput, _) => self.output,
            (ExecGroup::Layer, None) => self.sites.contains(&(key.layer, key.position)),
            _ => false,
        }
    }
}

/// Whether a divergence at `from` can reach `to` when every token fed to
/// the steps after `from`'s matches on both sides: inside `from`'s step as
/// the catalogue says ([`reaches`]); at a later step only through the
/// persistent state it changed, which the later forward reads in the same
/// layer and feeds to the layers after it. So a later step's records of
/// `from`'s layer and later ones, their state and the step's outputs are
/// reachable; its input (the token and its embedding) and the layers before
/// `from`'s are not. A step output (logits) reaches later steps only through
/// the token. Errs towards "reaches" (a divergence in the attention half and
/// one in the FFN half of a layer are given the same floor, the layer).
pub(crate) fn reaches_fed_equal(from: &moeconf_fingerprint::Coord, to: &moeconf_fingerprint::Coord) -> bool {
    if to.step <= from.step {
        return reaches(from, to);
    }
    let b = ExecKey::of(to);
    match (later_floor(from), b.group) {
        (None, _) | (_, ExecGroup::StepInput) => false,
        (Some(_), ExecGroup::StepOutput) => true,
        (Some(floor), ExecGroup::Layer | ExecGroup::State) => b.layer >= floor,
    }
}

/// The lowest layer a divergence at `from` reaches in a later step fed the
/// same tokens ([`reaches_fed_equal`]): its own for a layer or state record,
/// 0 for the step's input (the embedding feeds every layer's state), none
/// for a step output (it reaches later steps only through the token).
fn later_floor(from: &moeconf_fingerprint::Coord) -> Option<u32> {
    let a = ExecKey::of(from);
    match a.group {
        ExecGroup::Layer | ExecGroup::State => Some(a.layer),
        ExecGroup::StepInput => Some(0),
        ExecGroup::StepOutput => None,
    }
}

impl Ctx<'_> {
    /// Whether the token fed to `step` may differ between the two traces: the
    /// previous step's `token.output` or this step's `token.input` differs,
    /// or either is not compared on both sides (then nothing later is known
    /// to be out of reach).
    fn fed_token_may_differ(&self, step: u32) -> bool {
        if !self.compared.contains(Level::L0) {
            return true;
        }
        let differs = |pairs: Vec<Pair>| match pairs.as_slice() {
            [p] => p.r.is_none() || p.c.is_none() || !self.s.pair_equal(*p),
            _ => true,
        };
        let fed = match step.checked_sub(1) {
            Some(prev) => differs(self.s.lookup_component(prev, None, None, Component::TokenOutput)),
            None => true,
        };
        let input = self.s.lookup_component(step, None, None, Component::TokenInput);
        fed || (!input.is_empty() && differs(input))
    }

    /// The inputs of the operator that produces `path` at (`step`,
    /// `layer`, `position`) and whether each matches. A missing input is
    /// `not_captured` when its level is not compared or the trace lacks it,
    /// `not_applicable` when the layer's kind (inferred from the records,
    /// [`layerkind`]) has no such record, and `not_emitted` when its
    /// operator emits only at some positions.
    pub(crate) fn check_inputs(
        &self,
        step: u32,
        layer: Option<u32>,
        position: u32,
        path: &str,
    ) -> Vec<InputCheck> {
        let mut out = Vec::new();
        let mut kinds: Option<layerkind::Kinds> = None;
        for (spec, s, pairs) in self.input_pairs(step, layer, position, path) {
            let status = if !pairs.is_empty() {
                match self.pairs_status(&pairs) {
                    // A value only captures record, which the backend
                    // materializes inside this operator's own arithmetic
                    // (the routed sum inside a combine): part of the
                    // operator, not an input computed elsewhere.
                    "differ" if observational(&spec.path) => OBSERVED_DIFFERS,
                    // Inputs of a combine whose differences both sides'
                    // contracts absorb (crate::counterfactual).
                    "differ"
                        if Component::MoeCombine.matches(path)
                            && layer.is_some_and(|l| self.known_absorbed_by_contracts(step, l, position)) =>
                    {
                        ABSORBED_BY_CONTRACTS
                    }
                    s => s,
                }
            } else if crate::quantization::is_site(&spec.path)
                && (self.both_profiles_known() || !self.holds_sites(s, spec.layer))
            {
                // A quantization site neither execution has (both profiles
                // are known, or neither trace holds any quantization site at
                // this step and layer): not an input of this operator here.
                continue;
            } else if !self.compared.contains(spec.level) {
                "not_captured"
            } else {
                let component = producer(&spec.path);
                let applies = match (component, spec.layer) {
                    (Some(c), Some(l)) => kinds.get_or_insert_with(|| self.layer_kinds(s, l)).has(c),
                    _ => None,
                };
                match (applies, component.map(|c| c.spec().presence)) {
                    (Some(false), _) => "not_applicable",
                    (_, Some(p)) if p.is_on_emit() => "not_emitted",
                    _ => "not_captured",
                }
            };
            out.push(InputCheck {
                input: describe_input(&spec),
                status: status.into(),
                records: pairs.len() as u64,
                recomputed: self.recomputed_side(&pairs),
            });
        }
        out
    }
    /// Every differing record of `step` at the compared levels, in
    /// execution order; with `below`, only the model-global records and
    /// those of layers before it ([`crate::walk::Sides::differing_records_below`]).
    fn step_differences(&self, step: u32, below: Option<u32>) -> Vec<Pair> {
        let mut out = Vec::new();
        for level in self.compared.iter() {
            if self.s.level_differs(step, level) {
                match below {
                    None => out.extend(self.s.differing_records(step, level)),
                    Some(b) => out.extend(self.s.differing_records_below(step, level, b)),
                }
            }
        }
        out.sort_by_cached_key(|&p| self.s.exec_key(p));
        out
    }

    /// The inputs of the record `p` and whether they all match; records
    /// without catalogue inputs match unless `seen` explains them.
    fn origin(&self, p: Pair, seen: &Seen) -> Option<(Vec<InputCheck>, bool, ExecKey, Option<Component>)> {
        let e = self.s.entry(p)?;
        let key = ExecKey::of(&e.coord);
        let component = Component::parse(&e.coord.path).map(|(c, _)| c);
        let catalogue_inputs = component.is_some_and(|c| !c.spec().inputs.is_empty());
        let (inputs, ok) = match (catalogue_inputs, e.coord.layer) {
            (true, layer) => {
                let checks = self.check_inputs(e.coord.step, layer, e.coord.position, &e.coord.path);
                let ok = !checks.iter().any(|c| status_differs(&c.status));
                (checks, ok)
            }
            (false, _) => (Vec::new(), !seen.explains(&key, component)),
        };
        Some((inputs, ok, key, component))
    }

    /// Whether `recs[i]` (one of the differing records of its step) propagates
    /// or is absorbed, the record that decides it, and where it is absorbed:
    /// by both contracts at the combine, at its consumer, or by the
    /// checkpoints it can reach ([`Ctx::classify_kind`]).
    fn classify(
        &self,
        recs: &[Pair],
        i: usize,
        key: &ExecKey,
        earlier: &[moeconf_fingerprint::Coord],
    ) -> Result<Classified, BisectError> {
        let Some(e) = self.s.entry(recs[i]) else {
            return Ok((None, None, None));
        };
        if let Some(cp) = self.combine_absorbing(e)? {
            // Each side's contract gives its own combine output from the
            // other side's terms: the difference ends at the combine.
            return Ok((
                Some(DivergenceKind::Absorbed),
                Some(cp),
                Some(Absorption::Contracts),
            ));
        }
        if let Some(cp) = self.consumer_absorbing(e) {
            return Ok((
                Some(DivergenceKind::Absorbed),
                Some(cp),
                Some(Absorption::Consumer),
            ));
        }
        let (kind, cp) = self.classify_kind(recs, i, key, earlier)?;
        let at = (kind == Some(DivergenceKind::Absorbed)).then_some(Absorption::Checkpoint);
        Ok((kind, cp, at))
    }

    /// By the checkpoints the record can reach: the first reachable checkpoint
    /// at or after position `i` of `recs` for a record inside the step, the
    /// step's token for a step output, a checkpoint of a later step for
    /// persistent state. Returns the kind and the checkpoint that decides it.
    /// A differing checkpoint that an `earlier` propagating divergence can
    /// reach does not decide: it may be that one's consequence. When such a
    /// checkpoint is the only one that could show the record's own effect,
    /// the kind stays unknown.
    fn classify_kind(
        &self,
        recs: &[Pair],
        i: usize,
        key: &ExecKey,
        earlier: &[moeconf_fingerprint::Coord],
    ) -> Result<(Option<DivergenceKind>, Option<Pair>), BisectError> {
        let p = recs[i];
        let Some(e) = self.s.entry(p) else {
            return Ok((None, None));
        };
        let own = |q: Pair| {
            self.s
                .entry(q)
                .is_some_and(|f| !earlier.iter().any(|from| reaches_fed_equal(from, &f.coord)))
        };
        let step = e.coord.step;
        match key.group {
            ExecGroup::Layer | ExecGroup::StepInput => {
                if !self.compared.contains(Level::L3) {
                    return Ok((None, None));
                }
                // The first later checkpoint that differs and that the
                // record can reach (`reaches`: never an earlier position of
                // the forward).
                if let Some(&cp) = recs[i..].iter().find(|&&q| {
                    own(q)
                        && self
                            .s
                            .entry(q)
                            .is_some_and(|f| is_checkpoint(&f.coord.path) && reaches(&e.coord, &f.coord))
                }) {
                    return Ok((Some(DivergenceKind::Propagating), Some(cp)));
                }
                // Absorbed only when the checkpoint that would show it is
                // there and matches: without it, or when it differs by an
                // earlier divergence's reach, nothing is known.
                match self.next_checkpoint(e) {
                    Some(cp) if cp.r.is_none() || cp.c.is_none() || self.s.pair_equal(cp) => {
                        Ok((Some(DivergenceKind::Absorbed), Some(cp)))
                    }
                    _ => Ok((None, None)),
                }
            }
            ExecGroup::StepOutput => {
                if !self.compared.contains(Level::L0) {
                    return Ok((None, None));
                }
                let token = self
                    .s
                    .lookup_component(step, None, None, Component::TokenOutput)
                    .first()
                    .copied();
                let visible = Component::TextContinuation.matches(&e.coord.path);
                match token {
                    Some(t) if visible || !self.s.pair_equal(t) => {
                        Ok((Some(DivergenceKind::Propagating), Some(t)))
                    }
                    Some(t) => Ok((Some(DivergenceKind::Absorbed), Some(t))),
                    None if visible => Ok((Some(DivergenceKind::Propagating), None)),
                    None => Ok((None, None)),
                }
            }
            ExecGroup::State => {
                if !self.compared.contains(Level::L3) {
                    return Ok((None, None));
                }
                for later in self.s.steps().into_iter().filter(|&s| s > step) {
                    if !self.s.level_differs(later, Level::L3) {
                        continue;
                    }
                    if let Some(&cp) =
                        self.s.differing_records(later, Level::L3).iter().find(|&&q| {
                            own(q) && self.s.entry(q).is_some_and(|e| is_checkpoint(&e.coord.path))
                        })
                    {
                        return Ok((Some(DivergenceKind::Propagating), Some(cp)));
                    }
                }
                Ok((Some(DivergenceKind::Absorbed), None))
            }
        }
    }

    /// For a combine input (`moe.term.J`, `moe.shared`) whose difference both
    /// sides' contracts absorb at its combine: that combine's record.
    /// The combine at the position of a routed term, the routed sum or the
    /// shared output, when both traces hold it and it matches bitwise: the
    /// combine is the only consumer of these records (docs/operators.md), so
    /// their difference ends there whatever differs later.
    fn consumer_absorbing(&self, e: &moeconf_schema::IndexEntry) -> Option<Pair> {
        let c = &e.coord;
        let input = [Component::MoeTerm, Component::MoeShared, Component::MoeRouted]
            .iter()
            .any(|x| x.matches(&c.path));
        if !input {
            return None;
        }
        self.s
            .lookup_component(c.step, Some(c.layer?), Some(c.position), Component::MoeCombine)
            .first()
            .copied()
            .filter(|&cp| cp.r.is_some() && cp.c.is_some() && self.s.pair_equal(cp))
    }

    fn combine_absorbing(&self, e: &moeconf_schema::IndexEntry) -> Result<Option<Pair>, BisectError> {
        let c = &e.coord;
        let input = Component::MoeTerm.matches(&c.path) || Component::MoeShared.matches(&c.path);
        let Some(layer) = c.layer else {
            return Ok(None);
        };
        if !input {
            return Ok(None);
        }
        // Only where the combine's outputs differ: a combine that matches
        // absorbed the difference the ordinary way, whatever the contracts.
        let Some(cp) = self
            .s
            .lookup_component(c.step, Some(layer), Some(c.position), Component::MoeCombine)
            .first()
            .copied()
            .filter(|&cp| !self.s.pair_equal(cp))
        else {
            return Ok(None);
        };
        Ok(self
            .absorbed_by_contracts(c.step, layer, c.position)?
            .then_some(cp))
    }

    /// The checkpoint that closes the half-layer of a layer record (for the
    /// embedding: layer 0's first), which matches when the record is absorbed.
    fn next_checkpoint(&self, e: &moeconf_schema::IndexEntry) -> Option<Pair> {
        let c = &e.coord;
        let (layer, component) = match (c.layer, crate::operators::half_of(&c.path)) {
            (Some(l), Some(moeconf_fingerprint::Half::Attention)) => (l, Component::LayerPostAttnMhc),
            (Some(l), Some(moeconf_fingerprint::Half::Ffn)) => (l, Component::LayerPostFfnMhc),
            (None, _) => (0, Component::LayerPostAttnMhc),
            (Some(_), None) => return None,
        };
        self.s
            .lookup_component(c.step, Some(layer), Some(c.position), component)
            .first()
            .copied()
    }

    /// The divergences of the two traces ([`Divergences`]).
    pub(crate) fn divergences(&self) -> Result<Divergences, BisectError> {
        let mut out = Divergences {
            events: Vec::new(),
            storage: Vec::new(),
            rest: Rest::None,
            localized: None,
        };
        let mut seen = Seen::default();
        let mut examined = 0usize;
        // The records of the propagating divergences found so far: what
        // they can reach may be their consequence and is not an origin.
        let mut propagating: Vec<moeconf_fingerprint::Coord> = Vec::new();
        let mut last_step: Option<u32> = None;
        for (step, a, b) in self.s.paired_steps() {
            // Whether anything differs at the step: the step digests
            // differ, or only one trace holds it (from the summaries the
            // merge already holds, no search).
            let differs = match (a, b) {
                (Some(a), Some(b)) => a.digest != b.digest,
                _ => true,
            };
            if !differs {
                continue;
            }
            if !propagating.is_empty() && self.fed_token_may_differ(step) {
                // A differing token was fed (or its equality is unknown):
                // every record from here on can follow from a propagating
                // divergence.
                out.rest = Rest::Propagates;
                return Ok(out);
            }
            seen.next_step(last_step.is_some_and(|l| l + 1 == step));
            last_step = Some(step);
            // At a later step fed the same tokens the propagating divergences
            // reach their own layers and later ones ([`reaches_fed_equal`]):
            // only the groups before the lowest of them are read.
            let below = propagating
                .iter()
                .filter(|c| c.step < step)
                .filter_map(later_floor)
                .min();
            let recs = self.step_differences(step, below);
            if out.localized.is_none() {
                out.localized = self.localize(&recs)?;
            }
            for (i, &p) in recs.iter().enumerate() {
                if !propagating.is_empty()
                    && self
                        .s
                        .entry(p)
                        .is_none_or(|e| propagating.iter().any(|from| reaches_fed_equal(from, &e.coord)))
                {
                    // A possible consequence of a propagating divergence.
                    continue;
                }
                examined += 1;
                if examined > MAX_EXAMINED || out.events.len() >= MAX_DIVERGENCES {
                    out.rest = Rest::Limit;
                    return Ok(out);
                }
                if (p.r.is_none() || p.c.is_none()) && self.quantized_by(p).is_none() {
                    // Held by one side only: a coverage difference, listed
                    // in the report's `one_side_only`, not a divergence
                    // (unless it is a quantization site the other side's
                    // profile does not have: `crate::quantization`).
                    continue;
                }
                if let Some(r) = self.storage_checked(p)? {
                    // Differs only by storage precision: its consumers
                    // count it as matching (and say so).
                    out.storage.push((p, r));
                    continue;
                }
                let Some((inputs, inputs_match, key, component)) = self.origin(p, &seen) else {
                    continue;
                };
                seen.note(&key, component);
                // The first differing record is the headline whatever its inputs.
                if !inputs_match && !out.events.is_empty() {
                    if component.is_some_and(|c| c.is_checkpoint()) {
                        // A consequence of an earlier divergence reached the
                        // residual stream (through the carried state).
                        out.rest = Rest::Propagates;
                        return Ok(out);
                    }
                    continue;
                }
                if self.same_operator(out.events.last(), p, component) {
                    // Another member of a family (`moe.term.J`) at the same
                    // site: the same operator, one divergence.
                    continue;
                }
                let (kind, checkpoint, absorbed_at) = self.classify(&recs, i, &key, &propagating)?;
                out.events.push(Event {
                    pair: p,
                    kind,
                    checkpoint,
                    absorbed_at,
                    inputs,
                    inputs_match,
                });
                match kind {
                    Some(DivergenceKind::Absorbed) => {}
                    Some(DivergenceKind::Propagating)
                        if component.is_some_and(|c| observational(c.spec().path)) =>
                    {
                        // An observation (`moe.routed`): the walk goes on to
                        // the operator that consumes it.
                        out.rest = Rest::Propagates;
                    }
                    Some(DivergenceKind::Propagating) => {
                        // Records of the step it cannot reach (earlier
                        // positions of later layers) are still walked: a
                        // divergence among them is independent of it.
                        if let Some(e) = self.s.entry(p) {
                            propagating.push(e.coord.clone());
                        }
                        out.rest = Rest::Propagates;
                    }
                    None => {
                        out.rest = Rest::Unclassified;
                        return Ok(out);
                    }
                }
            }
        }
        if !propagating.is_empty() {
            out.rest = Rest::Propagates;
        }
        Ok(out)
    }

    /// Whether `p` is another member of the family of `last`'s record at
    /// the same step, layer and position.
    fn same_operator(&self, last: Option<&Event>, p: Pair, component: Option<Component>) -> bool {
        let (Some(last), Some(c)) = (last, component) else {
            return false;
        };
        let (Some(a), Some(b)) = (self.s.entry(last.pair), self.s.entry(p)) else {
            return false;
        };
        c.is_family()
            && c.matches(&a.coord.path)
            && (a.coord.step, a.coord.layer, a.coord.position)
                == (b.coord.step, b.coord.layer, b.coord.position)
    }

    /// The first record of `recs` (one step's differing records, held by
    /// both sides and not explained by storage precision) whose inputs all
    /// match, else the first such record.
    #[allow(clippy::type_complexity)]
    fn localize(&self, recs: &[Pair]) -> Result<Option<(Pair, Vec<InputCheck>, bool)>, BisectError> {
        let mut first = None;
        let mut observed = None;
        for &p in recs {
            let one_sided = p.r.is_none() || p.c.is_none();
            if (one_sided && self.quantized_by(p).is_none()) || self.storage_checked(p)?.is_some() {
                continue;
            }
            let Some(e) = self.s.entry(p) else { continue };
            if observational(&e.coord.path) || self.combine_absorbing(e)?.is_some() {
                // Localized only when no operator is: the operator that
                // consumes an observation, or the combine whose contracts
                // absorb this input's difference, is where the executions part.
                observed.get_or_insert(p);
                continue;
            }
            let checks = self.check_inputs(e.coord.step, e.coord.layer, e.coord.position, &e.coord.path);
            let ok = !checks.iter().any(|c| status_differs(&c.status));
            if ok {
                return Ok(Some((p, checks, true)));
            }
            first.get_or_insert((p, checks, false));
        }
        if first.is_none() {
            if let Some(p) = observed {
                if let Some(e) = self.s.entry(p) {
                    let checks =
                        self.check_inputs(e.coord.step, e.coord.layer, e.coord.position, &e.coord.path);
                    let ok = !checks.iter().any(|c| status_differs(&c.status));
                    return Ok(Some((p, checks, ok)));
                }
            }
        }
        Ok(first)
    }
}
