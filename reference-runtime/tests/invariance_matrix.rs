//! The reference runtime's invariance matrix (issue 34): the traced sequence
//! of a 19-token prompt, decoded for 3 steps under every combination of
//! 1 or 2 worker threads × a batch of 1 or 3 sequences × prefill chunks of
//! 1, 2 or all tokens, has the same records at every level — the same trace
//! root — as the plain run. Each knob is invariant by construction (threads
//! only over independent outputs, per-row reductions in a fixed order, each
//! sequence reading only its own rows and earlier cache rows); this checks
//! the twelve combinations, not each knob alone.

mod common;

use common::{digests, fixture_model, prompt};
use moeconf_contract::NativeCombine;
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::model::{BatchEntry, StepOptions};
use moeconf_reference_runtime::precision::Precision;
use moeconf_reference_runtime::state::DecodeState;

const STEPS: u32 = 3;

/// The traced sequence's (coordinate, digest) pairs, sorted (a chunked
/// prefill emits the same records in another order).
fn traced(batch: usize, chunk: Option<usize>) -> Vec<(String, String)> {
    let m = fixture_model();
    let opts = StepOptions {
        precision: Precision::Bf16,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let prompts: Vec<Vec<u32>> = [(3, 19), (4, 6), (5, 11)]
        .iter()
        .take(batch)
        .map(|&(seed, len)| prompt(seed, len))
        .collect();
    let mut states: Vec<DecodeState> = prompts.iter().map(|_| m.new_state()).collect();
    let mut sinks: Vec<MemorySink> = prompts.iter().map(|_| MemorySink::all()).collect();
    for step in 0..STEPS {
        let inputs: Vec<Vec<u32>> = states
            .iter()
            .zip(&prompts)
            .map(|(st, p)| match st.pending {
                Some(t) if step > 0 => vec![t],
                _ => p.clone(),
            })
            .collect();
        let mut entries: Vec<BatchEntry<'_>> = states
            .iter_mut()
            .zip(&inputs)
            .zip(sinks.iter_mut())
            .map(|((state, ids), sink)| BatchEntry {
                state,
                ids,
                sink,
                chunk: if step == 0 { chunk } else { None },
            })
            .collect();
        m.step_batch(&mut entries, &opts).expect("batched step");
    }
    let order: Vec<String> = sinks[0].records.iter().map(|r| r.coord.to_string()).collect();
    let mut keyed: Vec<(String, String)> = order.into_iter().zip(digests(&sinks[0])).collect();
    keyed.sort();
    keyed
}

#[test]
fn threads_batch_and_prefill_chunks_change_no_record() {
    let plain = traced(1, None);
    assert!(plain.len() > 1000, "{} records", plain.len());
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        for batch in [1, 3] {
            for chunk in [Some(1), Some(2), None] {
                let got = pool.install(|| traced(batch, chunk));
                assert_eq!(
                    got, plain,
                    "{threads} threads, batch of {batch}, prefill chunk {chunk:?}"
                );
            }
        }
    }
}
