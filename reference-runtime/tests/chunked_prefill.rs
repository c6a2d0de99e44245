//! Chunked prefill (`Model::step_chunked`) is invariant by construction: a
//! prompt processed in chunks of 1, 2, 3, 7 tokens gives the same records as
//! the unchunked prefill — every record, at every level, including the
//! compressor windows that close inside the prompt and the persistent state —
//! and the decode steps after it are the same too. Only the order in which
//! the records are emitted differs (chunk-major), never their bytes.

mod common;

use common::{digests, fixture_model, prompt};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::model::StepOptions;
use moeconf_reference_runtime::precision::Precision;

/// A 19-token prompt: longer than the fixture's window (8) and its HCA rate
/// (16), so windows roll and compressed entries are emitted mid-prompt.
const PROMPT: u32 = 19;
const STEPS: u32 = 3;

/// Every record of the prefill (in `chunk`s; `None`: unchunked) and two
/// decode steps, as sorted (coordinate, digest) pairs, and the emission order.
fn run(chunk: Option<usize>, precision: Precision) -> (Vec<(String, String)>, Vec<String>) {
    let m = fixture_model();
    let ids = prompt(3, PROMPT);
    let opts = StepOptions {
        precision,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut sink = MemorySink::all();
    let mut st = m.new_state();
    while st.step < STEPS {
        match (st.step, chunk) {
            (0, Some(c)) => m.step_chunked(&mut st, &ids, &opts, c, &mut sink),
            (0, None) => m.step(&mut st, &ids, &opts, &mut sink),
            _ => {
                let next = vec![st.pending.expect("a pending token")];
                m.step(&mut st, &next, &opts, &mut sink)
            }
        }
        .expect("step");
    }
    let order: Vec<String> = sink.records.iter().map(|r| r.coord.to_string()).collect();
    let mut keyed: Vec<(String, String)> = order.iter().cloned().zip(digests(&sink)).collect();
    keyed.sort();
    (keyed, order)
}

#[test]
fn a_chunked_prefill_gives_the_unchunked_records() {
    for precision in [Precision::Bf16, Precision::F32] {
        let (whole, whole_order) = run(None, precision);
        assert!(whole.len() > 1000, "{} records", whole.len());
        for chunk in [1, 2, 3, 7, PROMPT as usize, 64] {
            let (chunked, order) = run(Some(chunk), precision);
            assert_eq!(chunked, whole, "{precision:?}, chunks of {chunk}");
            if chunk < PROMPT as usize {
                // Emitted chunk-major: the same records in another order.
                assert_ne!(order, whole_order, "{precision:?}, chunks of {chunk}");
            }
        }
    }
}

#[test]
fn a_zero_chunk_is_refused() {
    let m = fixture_model();
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut st = m.new_state();
    let err = m
        .step_chunked(&mut st, &prompt(1, 4), &opts, 0, &mut MemorySink::all())
        .unwrap_err();
    assert!(err.to_string().contains("chunk"), "{err}");
    assert_eq!(st.step, 0, "the state is untouched");
}
