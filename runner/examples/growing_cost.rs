//! What the growing-state digests cost the runtime's thread per decode step,
//! on records sized like `builtin:tiny-v4`'s at a context of N tokens: the
//! 15 records of at least 32 KiB that grow (per CSA layer the compressor's
//! and the indexer's compressed caches and the indexer's read, per HCA layer
//! the compressed cache and the attention's read of it), one entry appended
//! every 4 (CSA) or 16 (HCA) tokens.
//!
//! ```sh
//! cargo run --release -p moeconf-runner --example growing_cost -- 4096 2000
//! ```
//!
//! Prints microseconds per step (wall clock: noisy on a shared machine).
//! Instruction counts do not depend on the machine's load: the per-step
//! difference of two step counts under `valgrind --tool=callgrind`
//! (docs/performance.md, "Long context").

use moeconf_fingerprint::catalogue::Component;
use moeconf_fingerprint::{Algorithm, CanonPolicy, Coord, DType, Level, Phase, TensorView};
use moeconf_runner::growing::GrowingDigests;
use std::time::Instant;

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (context, steps) = (arg(1, 4096), arg(2, 2000).max(3) as u32);
    // (layer, path, tokens per entry, floats per entry)
    let mut records = Vec::new();
    for layer in [2u32, 4, 6] {
        records.push((layer, "state.compressor.compressed_kv", 4usize, 64usize));
        records.push((layer, "state.indexer.compressed_kv", 4, 32));
        records.push((layer, "attn.indexer_read", 4, 32));
    }
    for layer in [3u32, 5, 7] {
        records.push((layer, "state.compressor.compressed_kv", 16, 64));
        records.push((layer, "attn.compressed_read", 16, 64));
    }
    let tokens = context + steps as usize + 1;
    let buffers: Vec<Vec<u8>> = records
        .iter()
        .map(|&(_, _, rate, floats)| {
            (0..tokens / rate * floats)
                .flat_map(|i| (i as f32 * 0.37).sin().to_le_bytes())
                .collect()
        })
        .collect();
    let mut digests = GrowingDigests::new(Algorithm::Blake3, CanonPolicy::default(), steps);
    if let Some((read, _)) = Component::parse("attn.compressed_read") {
        digests.grow_on_layers(read, [3, 5, 7]);
    }
    let mut seconds = 0.0;
    for step in 0..=steps {
        let t = Instant::now();
        for (k, &(layer, path, rate, floats)) in records.iter().enumerate() {
            let entries = (context + step as usize) / rate;
            let shape = [entries as u64, floats as u64];
            let coord = Coord {
                step,
                position: (context + step as usize) as u32,
                phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                layer: Some(layer),
                path: path.into(),
            };
            let tensor = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &buffers[k][..entries * floats * 4],
            };
            if let Err(e) = digests.digest(&coord, Level::L2, tensor) {
                eprintln!("{}", e.message);
                std::process::exit(2);
            }
        }
        // The prefill's first digests and the last step's full verification
        // are not decode steps.
        if step > 0 && step < steps {
            seconds += t.elapsed().as_secs_f64();
        }
    }
    println!(
        "context {context}: {:.1} us per decode step, {} records digested incrementally",
        seconds / f64::from(steps - 1) * 1e6,
        digests.records()
    );
}
