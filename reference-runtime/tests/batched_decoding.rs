//! Batched decoding (`Model::step_batch`) is invariant by construction: each
//! sequence of a batch — prefilling together, decoding together, or joining
//! while others decode (continuous batching) — gets exactly the records, in
//! the same order, that it gets run alone. A bad input anywhere in the batch
//! is refused before any sequence advances.

mod common;

use common::{digests, fixture_model, prompt};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::model::{BatchEntry, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;

const STEPS: u32 = 4;

fn opts(precision: Precision) -> StepOptions<'static> {
    StepOptions {
        precision,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    }
}

/// The prompt alone for `STEPS` steps: its record digests in emission order.
fn alone(ids: &[u32], precision: Precision) -> Vec<String> {
    let m = fixture_model();
    let mut sink = MemorySink::all();
    let mut st = m.new_state();
    while st.step < STEPS {
        let input = match st.pending {
            Some(t) if st.step > 0 => vec![t],
            _ => ids.to_vec(),
        };
        m.step(&mut st, &input, &opts(precision), &mut sink)
            .expect("step");
    }
    digests(&sink)
}

/// The tokens a sequence consumes at its next step.
fn next_ids(st: &DecodeState, prompt: &[u32]) -> Vec<u32> {
    match st.pending {
        Some(t) if st.step > 0 => vec![t],
        _ => prompt.to_vec(),
    }
}

/// The prompts batched, sequence `i` joining at batch step `join[i]`, until
/// each has run `STEPS` steps: each sequence's record digests.
fn batched(prompts: &[Vec<u32>], join: &[u32], precision: Precision) -> Vec<Vec<String>> {
    let m = fixture_model();
    let n = prompts.len();
    let mut states: Vec<DecodeState> = (0..n).map(|_| m.new_state()).collect();
    let mut sinks: Vec<MemorySink> = (0..n).map(|_| MemorySink::all()).collect();
    let mut t = 0u32;
    while states.iter().any(|s| s.step < STEPS) {
        let active: Vec<usize> = (0..n)
            .filter(|&i| join[i] <= t && states[i].step < STEPS)
            .collect();
        let inputs: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| next_ids(&states[i], &prompts[i]))
            .collect();
        let mut batch: Vec<BatchEntry<'_>> = Vec::new();
        for ((i, st), sink) in states.iter_mut().enumerate().zip(sinks.iter_mut()) {
            if let Some(k) = active.iter().position(|&a| a == i) {
                batch.push(BatchEntry {
                    state: st,
                    ids: &inputs[k],
                    sink,
                    chunk: None,
                });
            }
        }
        if !batch.is_empty() {
            m.step_batch(&mut batch, &opts(precision)).expect("batched step");
        }
        t += 1;
    }
    sinks.iter().map(digests).collect()
}

#[test]
fn each_sequence_of_a_batch_gets_its_solo_records() {
    let prompts = vec![prompt(1, 5), prompt(2, 7), prompt(3, 19)];
    for precision in [Precision::Bf16, Precision::F32] {
        let solo: Vec<Vec<String>> = prompts.iter().map(|p| alone(p, precision)).collect();
        // Prefill together, then decode together.
        assert_eq!(batched(&prompts, &[0, 0, 0], precision), solo, "{precision:?}");
        // Continuous batching: the second joins (prefills) while the first decodes, the third later.
        assert_eq!(
            batched(&prompts, &[0, 1, 3], precision),
            solo,
            "{precision:?}, staggered"
        );
    }
    // A batch of one is the plain step.
    assert_eq!(
        batched(&prompts[..1], &[0], Precision::Bf16),
        vec![alone(&prompts[0], Precision::Bf16)]
    );
}

#[test]
fn a_bad_input_refuses_the_whole_batch_before_anything_runs() {
    let m = fixture_model();
    let (mut a, mut b) = (m.new_state(), m.new_state());
    let (mut sa, mut sb) = (MemorySink::all(), MemorySink::all());
    let good = prompt(1, 5);
    let bad = vec![3, 1_000_000];
    let mut batch = vec![
        BatchEntry {
            state: &mut a,
            ids: &good,
            sink: &mut sa,
            chunk: None,
        },
        BatchEntry {
            state: &mut b,
            ids: &bad,
            sink: &mut sb,
            chunk: None,
        },
    ];
    let err = m.step_batch(&mut batch, &opts(Precision::Bf16)).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert_eq!((a.step, b.step), (0, 0));
    assert!(sa.records.is_empty() && sb.records.is_empty());
}
