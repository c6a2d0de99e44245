//! Built-in matrices (`moeconf invariance --preset NAME`).

use crate::error::InvarianceError;
use crate::matrix::{build, Backend, KnobValue, Knobs, Matrix, ReferenceRun, RunOverrides};
use std::collections::BTreeMap;

/// The other prompts of a batched configuration: of other lengths than the
/// traced one, so a batch mixes sequence lengths as a server's does.
pub const COMPANION_PROMPTS: [&str; 2] = [
    "the quick brown fox",
    "a third sequence, longer than the traced prompt, decoded in the same batch",
];

/// The other backends' presets: the matrix files of python/invariance/
/// (each a command matrix over that backend's capture; `--model` names
/// what its capture loads, see the file's comment). Name, file text.
pub const BACKEND_PRESETS: [(&str, &str); 4] = [
    (
        "transformers",
        include_str!("../../python/invariance/transformers.toml"),
    ),
    ("llamacpp", include_str!("../../python/invariance/llamacpp.toml")),
    (
        "llamacpp-fa-off",
        include_str!("../../python/invariance/llamacpp-fa-off.toml"),
    ),
    ("vllm", include_str!("../../python/invariance/vllm.toml")),
];

/// The preset `name` of another backend, with `o` over its `[run]` values.
pub fn backend_preset(name: &str, o: &RunOverrides) -> Option<Result<Matrix, InvarianceError>> {
    BACKEND_PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(n, text)| crate::matrix::parse(text, &format!("preset {n} (python/invariance/{n}.toml)"), o))
}

/// Every preset of the reference runtime: name and what it holds.
pub const PRESETS: [(&str, &str); 2] = [
    (
        "reference",
        "the reference runtime: 1/2 threads × a batch of 1/3 sequences × prefill chunks of 1/2/all tokens (11 configurations against 1 thread, alone, unchunked), every knob bitwise",
    ),
    (
        "reference-knobs",
        "the reference runtime, one knob at a time: 2 threads, batches of 2 and 3 sequences, prefill chunks of 1, 2 and 3 tokens (6 configurations)",
    ),
];

/// The preset `name` for the reference request `r`.
pub fn preset(name: &str, r: ReferenceRun) -> Result<Matrix, InvarianceError> {
    let batch =
        |n: usize| KnobValue::List(COMPANION_PROMPTS[..n - 1].iter().map(|s| s.to_string()).collect());
    let knobs = |pairs: Vec<(&str, KnobValue)>| -> Knobs {
        pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    };
    let configs: Vec<(Option<String>, Knobs)> = match name {
        "reference" => {
            let mut v = Vec::new();
            for threads in [1, 2] {
                for seqs in [1usize, 3] {
                    for chunk in [Some(1), Some(2), None] {
                        if threads == 1 && seqs == 1 && chunk.is_none() {
                            continue;
                        }
                        let chunk_value = chunk
                            .map(KnobValue::Int)
                            .unwrap_or_else(|| KnobValue::Text("all".into()));
                        let label = format!(
                            "threads={threads} batch={seqs} chunk={}",
                            chunk.map(|c| c.to_string()).unwrap_or_else(|| "all".into())
                        );
                        v.push((
                            Some(label),
                            knobs(vec![
                                ("threads", KnobValue::Int(threads)),
                                ("batch_with", batch(seqs)),
                                ("prefill_chunk", chunk_value),
                            ]),
                        ));
                    }
                }
            }
            v
        }
        "reference-knobs" => vec![
            (
                Some("threads=2".into()),
                knobs(vec![("threads", KnobValue::Int(2))]),
            ),
            (Some("batch=2".into()), knobs(vec![("batch_with", batch(2))])),
            (Some("batch=3".into()), knobs(vec![("batch_with", batch(3))])),
            (
                Some("chunk=1".into()),
                knobs(vec![("prefill_chunk", KnobValue::Int(1))]),
            ),
            (
                Some("chunk=2".into()),
                knobs(vec![("prefill_chunk", KnobValue::Int(2))]),
            ),
            (
                Some("chunk=3".into()),
                knobs(vec![("prefill_chunk", KnobValue::Int(3))]),
            ),
        ],
        _ => {
            return Err(InvarianceError::NoPreset {
                name: name.into(),
                known: PRESETS
                    .iter()
                    .map(|(n, _)| *n)
                    .chain(BACKEND_PRESETS.iter().map(|(n, _)| *n))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    build(
        Backend::Reference(r),
        Knobs::new(),
        configs,
        false,
        BTreeMap::new(),
        &format!("preset {name}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ReferenceRun {
        ReferenceRun {
            model: "builtin:tiny-v4".into(),
            prompt: "why the sheep".into(),
            max_new_tokens: 2,
            precision: "bf16".into(),
            capture: "all".into(),
        }
    }

    #[test]
    fn the_reference_preset_is_the_full_two_by_two_by_three_matrix() {
        let m = preset("reference", req()).unwrap();
        assert_eq!(m.configs.len(), 11);
        let mut seen: Vec<Knobs> = m.configs.iter().map(|c| c.knobs.clone()).collect();
        seen.push(m.base.knobs.clone());
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 12, "12 distinct combinations including the base");
        assert_eq!(preset("reference-knobs", req()).unwrap().configs.len(), 6);
        let err = preset("gpu", req()).unwrap_err().to_string();
        assert!(
            err.contains("reference-knobs") && err.contains("transformers"),
            "{err}"
        );
    }

    #[test]
    fn every_backend_preset_is_a_valid_command_matrix() {
        let o = RunOverrides {
            model: Some("/models/x".into()),
            ..RunOverrides::default()
        };
        for (name, _) in BACKEND_PRESETS {
            let m = backend_preset(name, &o).expect("known").expect("valid");
            assert!(matches!(m.backend, Backend::Command(_)), "{name}");
            assert!(m.configs.len() >= 3, "{name}");
        }
        assert!(backend_preset("nope", &o).is_none());
    }
}
