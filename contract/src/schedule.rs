//! Schedules: which permutation each MoE combine event uses (paper section
//! 2.4.5 and the extensions), and the single-layer fork (section 2.4.1).
//!
//! # Deterministic permutation draw
//!
//! A schedule derives a 64-bit seed from a domain tag and a list of words
//! with [`derive_seed`]: `h = domain; for w in words { h = splitmix64(h ^ w) }`,
//! where [`splitmix64`] is one step of Steele, Lea and Flood's SplitMix64
//! generator from state `x` (`z = x + 0x9e3779b97f4a7c15`, then the
//! `(z ^ z>>30)·0xbf58476d1ce4e5b9`, `(z ^ z>>27)·0x94d049bb133111eb`,
//! `z ^ z>>31` finalizer, all wrapping). The permutation index is then drawn
//! uniformly in `0..k!` by [`draw_index`]: a SplitMix64 stream seeded with `h`
//! (state += golden gamma, output the finalizer) is read until a value `r`
//! falls below the largest multiple of k! that fits in 64 bits, and the index
//! is `r mod k!` (rejection sampling, so no modulo bias). The permutation is
//! [`super::permutation_from_index`] of that index (lexicographic order).
//!
//! * layer-static: words `[experiment_seed, request_seed, prompt_hash, layer]`,
//!   domain [`DOMAIN_LAYER_STATIC`]: one permutation per MoE layer, reused at
//!   every position and step of the request;
//! * token-dynamic: words `[experiment_seed, request_seed, prompt_hash, layer,
//!   position]`, domain [`DOMAIN_TOKEN_DYNAMIC`]: a fresh permutation per layer
//!   and token position.
//!
//! `prompt_hash` is [`prompt_hash`] of the prompt text (64-bit FNV-1a of its
//! UTF-8 bytes) or any caller-chosen prompt id.

use std::fmt;

use super::error::ContractError;
use super::order::{factorial, permutation_from_index, MAX_INDEXED_K};
use super::spec::{AggregationContract, Order};
use super::{CombineEvent, MoeCombine, NativeCombine};

/// The experiment seed the paper's breadth and persistent scripts use (section 2.4.7).
pub const DEFAULT_EXPERIMENT_SEED: u64 = 20_260_722;

/// Domain tag of layer-static seeds (ASCII "lyrstatc").
pub const DOMAIN_LAYER_STATIC: u64 = 0x6c79_7273_7461_7463;

/// Domain tag of token-dynamic seeds (ASCII "tokdynam").
pub const DOMAIN_TOKEN_DYNAMIC: u64 = 0x746f_6b64_796e_616d;

/// SplitMix64's state increment (the golden gamma, 2^64 / φ rounded to odd).
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// One SplitMix64 output from state `x` (the state advanced by the golden
/// gamma, then finalized).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds `words` into a seed under a domain tag (see the module docs).
pub fn derive_seed(domain: u64, words: &[u64]) -> u64 {
    words.iter().fold(domain, |h, &w| splitmix64(h ^ w))
}

/// 64-bit FNV-1a of `bytes` (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`): the one string hash of moeconf's seeds (prompt identity
/// in schedule seeds, tensor names in the fixture generator).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// 64-bit FNV-1a of the prompt's UTF-8 bytes: the prompt identity in schedule seeds.
pub fn prompt_hash(prompt: &str) -> u64 {
    fnv1a64(prompt.as_bytes())
}

/// A uniform index in `0..n` (n ≥ 1) drawn from the SplitMix64 stream seeded
/// with `seed`, by rejection sampling (see the module docs).
pub fn draw_index(seed: u64, n: u64) -> u64 {
    let n = n.max(1);
    let limit = (u64::MAX / n) * n;
    let mut state = seed;
    loop {
        let r = splitmix64(state);
        state = state.wrapping_add(GOLDEN_GAMMA);
        if r < limit {
            return r % n;
        }
    }
}

/// How the permutation of each combine event is chosen.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// The contract's own order at every event (the identity for presets).
    Identity,
    /// One permutation per MoE layer, reused at every position (paper section 2.4.5).
    LayerStatic {
        /// Experiment-level seed (the paper's is [`DEFAULT_EXPERIMENT_SEED`]).
        experiment_seed: u64,
        /// Per-request seed.
        request_seed: u64,
    },
    /// A fresh permutation per layer and position (an extension the paper lists as untested).
    TokenDynamic {
        /// Experiment-level seed.
        experiment_seed: u64,
        /// Per-request seed.
        request_seed: u64,
    },
}

impl Schedule {
    /// Parses `identity`, `layer-static:SEED[:EXPERIMENT_SEED]` or
    /// `token-dynamic:SEED[:EXPERIMENT_SEED]` (case-insensitive). SEED is the
    /// request seed; the experiment seed defaults to [`DEFAULT_EXPERIMENT_SEED`].
    pub fn parse(s: &str) -> Result<Schedule, ContractError> {
        let err = |reason: &str| ContractError::InvalidSchedule {
            given: s.to_string(),
            reason: reason.to_string(),
        };
        let t = s.trim().to_ascii_lowercase();
        if t == "identity" {
            return Ok(Schedule::Identity);
        }
        let (kind, rest) = t.split_once(':').ok_or_else(|| {
            err("expected identity, layer-static:SEED[:EXPERIMENT_SEED] or token-dynamic:SEED[:EXPERIMENT_SEED]")
        })?;
        let mut nums = rest.split(':').map(|x| x.trim().parse::<u64>());
        let request_seed = match nums.next() {
            Some(Ok(v)) => v,
            _ => return Err(err("SEED must be a non-negative 64-bit integer")),
        };
        let experiment_seed = match nums.next() {
            None => DEFAULT_EXPERIMENT_SEED,
            Some(Ok(v)) => v,
            Some(Err(_)) => return Err(err("EXPERIMENT_SEED must be a non-negative 64-bit integer")),
        };
        if nums.next().is_some() {
            return Err(err("too many ':'-separated fields"));
        }
        match kind {
            "layer-static" => Ok(Schedule::LayerStatic {
                experiment_seed,
                request_seed,
            }),
            "token-dynamic" => Ok(Schedule::TokenDynamic {
                experiment_seed,
                request_seed,
            }),
            _ => Err(err(
                "unknown schedule kind (identity, layer-static, token-dynamic)",
            )),
        }
    }

    /// The permutation index this schedule assigns to an event with k terms,
    /// or `None` for [`Schedule::Identity`] (the contract's own order applies).
    pub fn permutation_index(&self, prompt_hash: u64, layer: u32, position: u32, k: usize) -> Option<u64> {
        let n = factorial(k.min(MAX_INDEXED_K)).unwrap_or(1);
        let seed = match *self {
            Schedule::Identity => return None,
            Schedule::LayerStatic {
                experiment_seed,
                request_seed,
            } => derive_seed(
                DOMAIN_LAYER_STATIC,
                &[experiment_seed, request_seed, prompt_hash, u64::from(layer)],
            ),
            Schedule::TokenDynamic {
                experiment_seed,
                request_seed,
            } => derive_seed(
                DOMAIN_TOKEN_DYNAMIC,
                &[
                    experiment_seed,
                    request_seed,
                    prompt_hash,
                    u64::from(layer),
                    u64::from(position),
                ],
            ),
        };
        Some(draw_index(seed, n))
    }
}

impl std::str::FromStr for Schedule {
    type Err = ContractError;

    /// [`Schedule::parse`].
    fn from_str(s: &str) -> Result<Schedule, ContractError> {
        Schedule::parse(s)
    }
}

impl fmt::Display for Schedule {
    /// The form accepted by [`Schedule::parse`] (experiment seed always spelled out).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Identity => write!(f, "identity"),
            Schedule::LayerStatic {
                experiment_seed,
                request_seed,
            } => {
                write!(f, "layer-static:{request_seed}:{experiment_seed}")
            }
            Schedule::TokenDynamic {
                experiment_seed,
                request_seed,
            } => {
                write!(f, "token-dynamic:{request_seed}:{experiment_seed}")
            }
        }
    }
}

/// A contract family (operand, accumulator, shape, output) applied with a
/// [`Schedule`]'s per-event permutation to one request.
#[derive(Debug, Clone)]
pub struct ScheduledCombine {
    contract: AggregationContract,
    schedule: Schedule,
    prompt_hash: u64,
}

impl ScheduledCombine {
    /// `contract` under `schedule` for the request whose prompt hashes to
    /// `prompt_hash` (see [`prompt_hash`]). For a non-identity schedule the
    /// contract's own order is replaced at every event.
    pub fn new(contract: AggregationContract, schedule: Schedule, prompt_hash: u64) -> Self {
        ScheduledCombine {
            contract,
            schedule,
            prompt_hash,
        }
    }

    /// Checks that k terms can be scheduled (k ≤ 20 and the contract's order fits k).
    pub fn validate_for_k(&self, k: usize) -> Result<(), ContractError> {
        if k > MAX_INDEXED_K {
            return Err(ContractError::TooManyTerms {
                k,
                what: "scheduled permutations",
                max: MAX_INDEXED_K,
            });
        }
        self.contract.validate_for_k(k)
    }

    /// The permutation applied at `event` with k terms.
    pub fn permutation(&self, event: &CombineEvent<'_>, k: usize) -> Result<Vec<usize>, ContractError> {
        match self
            .schedule
            .permutation_index(self.prompt_hash, event.layer, event.position, k)
        {
            None => self.contract.order.resolve_in(k, Some(&event.context())),
            Some(i) => permutation_from_index(k, i),
        }
    }
}

impl MoeCombine for ScheduledCombine {
    /// # Panics
    ///
    /// If [`ScheduledCombine::validate_for_k`] would fail or the slice lengths differ.
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        let result = self.permutation(event, terms.len()).and_then(|p| {
            self.contract
                .try_combine_event_with_permutation(&p, event, terms, shared, out)
        });
        if let Err(e) = result {
            panic!("MoE combine with {}: {e}", self.describe());
        }
    }

    fn describe(&self) -> String {
        match self.schedule {
            Schedule::Identity => self.contract.describe(),
            _ => format!(
                "{} schedule={} prompt_hash={:#018x}",
                self.contract.describe(),
                self.schedule,
                self.prompt_hash
            ),
        }
    }
}

/// Where a single-layer fork applies: one layer at one forward step, and
/// optionally one position (all positions of that step otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ForkPoint {
    /// Decoder layer index of the forked MoE aggregation.
    pub layer: u32,
    /// Forward step ([`CombineEvent::step`]: 0 = prefill, s ≥ 1 = decode forward consuming token s).
    pub step: u32,
    /// Restricts the fork to one absolute position (useful for prefill forks).
    pub position: Option<u32>,
}

impl ForkPoint {
    /// The paper's default (FORK_TOKEN=−1): the first eligible decode-only
    /// event, i.e. the forward that consumes the first emitted token (step 1).
    pub fn first_decode(layer: u32) -> Self {
        ForkPoint {
            layer,
            step: 1,
            position: None,
        }
    }

    /// Whether `event` is the forked event.
    pub fn matches(&self, event: &CombineEvent<'_>) -> bool {
        event.layer == self.layer
            && event.step == self.step
            && self.position.is_none_or(|p| p == event.position)
    }
}

/// Single-layer fork (paper section 2.4.1): the combine at the [`ForkPoint`]
/// uses `contract` (with its order); every other event uses `base` (native by
/// default).
#[derive(Debug, Clone)]
pub struct ForkCombine<B = NativeCombine> {
    base: B,
    point: ForkPoint,
    contract: AggregationContract,
}

impl ForkCombine<NativeCombine> {
    /// A fork over the native combine.
    pub fn new(point: ForkPoint, contract: AggregationContract) -> Self {
        ForkCombine {
            base: NativeCombine,
            point,
            contract,
        }
    }
}

impl<B: MoeCombine> ForkCombine<B> {
    /// A fork over another base combine.
    pub fn with_base(base: B, point: ForkPoint, contract: AggregationContract) -> Self {
        ForkCombine {
            base,
            point,
            contract,
        }
    }

    pub fn point(&self) -> ForkPoint {
        self.point
    }

    /// The contract applied at the fork point.
    pub fn contract(&self) -> &AggregationContract {
        &self.contract
    }
}

impl<B: MoeCombine> MoeCombine for ForkCombine<B> {
    /// # Panics
    ///
    /// At the fork point, if the contract's order does not fit k or the slice
    /// lengths differ (see [`AggregationContract::validate_for_k`]).
    fn combine(&self, event: &CombineEvent<'_>, terms: &[&[f32]], shared: &[f32], out: &mut [f32]) {
        if self.point.matches(event) {
            self.contract.combine(event, terms, shared, out)
        } else {
            self.base.combine(event, terms, shared, out)
        }
    }

    fn describe(&self) -> String {
        let at = match self.point.position {
            Some(p) => format!("layer={} step={} position={p}", self.point.layer, self.point.step),
            None => format!("layer={} step={}", self.point.layer, self.point.step),
        };
        format!(
            "{} fork({at} contract={})",
            self.base.describe(),
            self.contract.describe()
        )
    }
}

/// Parses the order of a fork (`--fork-order`) for `contract`: a bare integer
/// is a B class for a B-like contract and a permutation index otherwise (see
/// [`Order::parse`]).
pub fn parse_fork_order(s: &str, contract: &AggregationContract) -> Result<Order, ContractError> {
    Order::parse(s, contract.is_b_like())
}
