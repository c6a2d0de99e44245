//! Errors of contract, order and schedule construction and parsing.

use thiserror::Error;

/// Why a contract, order or schedule could not be built, parsed or applied.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ContractError {
    /// A contract string is neither a preset name nor a valid `key=value` override.
    #[error("unknown contract {given:?}: expected one of native, p32, c, a, b, exact, tree, f64, exact-fused (optionally followed by +key=value overrides)")]
    UnknownContract {
        /// The string that was given.
        given: String,
    },
    /// A `key=value` override names an unknown key or an invalid value.
    #[error("invalid contract override {given:?}: {reason}")]
    InvalidOverride {
        /// The override token that was given.
        given: String,
        reason: String,
    },
    /// An order string could not be parsed.
    #[error("invalid order {given:?}: {reason}")]
    InvalidOrder {
        /// The string that was given.
        given: String,
        reason: String,
    },
    /// A schedule string could not be parsed.
    #[error("invalid schedule {given:?}: {reason}")]
    InvalidSchedule {
        /// The string that was given.
        given: String,
        reason: String,
    },
    /// An explicit permutation is not a permutation of `0..k`.
    #[error("{perm:?} is not a permutation of 0..{k}")]
    NotAPermutation {
        /// The number of routed terms.
        k: usize,
        /// The offending sequence.
        perm: Vec<usize>,
    },
    /// A permutation index is not below k!.
    #[error("permutation index {index} is out of range for k = {k} (must be below {count})")]
    IndexOutOfRange {
        /// The number of routed terms.
        k: usize,
        /// The offending index.
        index: u64,
        /// k!, the number of permutations.
        count: u64,
    },
    /// A B structural class id is not below the class count.
    #[error("B class {class} is out of range for k = {k} (must be below {count})")]
    ClassOutOfRange {
        /// The number of routed terms.
        k: usize,
        /// The offending class id.
        class: u64,
        /// The number of B classes, k!/2 (1 for k < 2).
        count: u64,
    },
    /// k is too large for the requested enumeration (k! would not fit or would take too long).
    #[error("k = {k} is too large for {what} (at most {max})")]
    TooManyTerms {
        /// The number of routed terms.
        k: usize,
        /// What was being enumerated.
        what: &'static str,
        /// The largest supported k.
        max: usize,
    },
    /// An order determined by the event (expert ids, gates) was resolved
    /// without the event's router choice.
    #[error("order {order} is determined by the event's expert ids or gates, which were not given")]
    NeedsEventContext {
        /// The order.
        order: String,
    },
    /// The event's expert ids or gates do not cover its k routed terms.
    #[error("order {order} needs {k} {what}, the event has {got}")]
    ContextMismatch {
        order: String,
        /// `expert ids` or `gate weights`.
        what: &'static str,
        /// How many the event has.
        got: usize,
        /// The number of routed terms.
        k: usize,
    },
    /// An `operand=fma` contract was asked to combine without the experts'
    /// unweighted outputs and gates (a trace's recorded terms, or a
    /// runtime profile that never forms them).
    #[error("contract {contract} multiplies each expert's unweighted output by its gate inside the accumulation (operand=fma): it needs those outputs and the gates, which were not given (recorded terms cannot stand in for them)")]
    NeedsUnits {
        /// The contract's notation.
        contract: String,
    },
    /// The term, shared or output slices do not have the same length.
    #[error("length mismatch: {what} has length {got}, expected {expected}")]
    LengthMismatch {
        /// Which slice is wrong.
        what: String,
        /// The length it has.
        got: usize,
        /// The length it must have (the output length D).
        expected: usize,
    },
}
