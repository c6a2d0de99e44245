//! What a trace is a trace *of*: the binding (hashed into the root) and the
//! provenance (recorded, not hashed).
//!
//! The binding holds everything that decides whether two traces are
//! comparable (model, tokenizer, prompt, decoding) and everything that
//! describes the execution semantics under test (precision profile,
//! aggregation contract and schedule, capture spec, canonicalization policy).
//! It contains no timestamps and no paths, so the same execution always
//! yields the same bytes. The provenance (runtime name, version, thread
//! count) is stored beside it but kept out of the root digest: a
//! deterministic runtime produces the same root with 1 or 16 threads.

use crate::recomputed::{Recomputed, RECOMPUTED_NOTE};
use moeconf_fingerprint::wire::{Decoder, Encoder, WireError};
use moeconf_fingerprint::{CanonPolicy, Digest, Level, LevelSet};
use serde_json::{json, Value};

/// Longest string field accepted in a header (prompt text included).
pub const MAX_STRING: u64 = 1 << 20;
/// Most weight tensors a model identity may list.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most prompt token ids.
pub const MAX_PROMPT_IDS: u64 = 1 << 24;
/// Most free-form key/value pairs.
pub const MAX_EXTRA: u64 = 4096;

/// Digest of one weight tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDigest {
    /// Tensor name in the checkpoint (DeepSeek's original naming).
    pub name: String,
    /// Its dtype as stored (`bf16`, `f32`, `i64`, ...).
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Digest of its raw little-endian bytes.
    pub digest: Digest,
}

/// Identity of the model weights and configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelIdentity {
    /// Display name (e.g. `builtin:tiny-v4`); informative, but part of the binding.
    pub name: String,
    /// Digest of the config.json bytes.
    pub config_digest: Digest,
    /// Digest over the sorted tensor list (name, dtype, shape, digest).
    pub weights_digest: Digest,
    /// Every weight tensor, sorted by name.
    pub tensors: Vec<TensorDigest>,
}

impl ModelIdentity {
    /// The weight formats of the checkpoint, read from its tensor list, for reports:
    /// `dense <format>, experts <format>` where the dense format is that of the attention's
    /// `wq_a` and the expert format that of a routed expert's `w1` (DeepSeek's original
    /// names), e.g. `dense fp8-e4m3 (UE8M0 128x128 scales), experts mxfp4 (E2M1, UE8M0 per 32)`
    /// for the released checkpoints and `dense bf16, experts bf16` for a bf16 one; for other
    /// names, the distinct dtypes (`bf16, f32, i64`); `unknown` without a tensor list.
    pub fn weight_formats(&self) -> String {
        fn format_of(dtype: &str) -> String {
            match dtype {
                "f8_e4m3" => "fp8-e4m3 (UE8M0 128x128 scales)".into(),
                "i8" | "u8" | "f4" => "mxfp4 (E2M1, UE8M0 per 32)".into(),
                other => other.to_string(),
            }
        }
        let find = |pred: &dyn Fn(&str) -> bool| {
            self.tensors
                .iter()
                .find(|t| pred(&t.name))
                .map(|t| format_of(&t.dtype))
        };
        let dense = find(&|n| n.starts_with("layers.") && n.ends_with(".attn.wq_a.weight"));
        let experts =
            find(&|n| n.starts_with("layers.") && n.contains(".ffn.experts.") && n.ends_with(".w1.weight"));
        match (dense, experts) {
            (Some(d), Some(e)) => format!("dense {d}, experts {e}"),
            _ if self.tensors.is_empty() => "unknown".into(),
            _ => {
                let mut dtypes: Vec<&str> = self.tensors.iter().map(|t| t.dtype.as_str()).collect();
                dtypes.sort_unstable();
                dtypes.dedup();
                dtypes.join(", ")
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenizerIdentity {
    /// Display name.
    pub name: String,
    /// Digest of the tokenizer file's bytes.
    pub digest: Digest,
}

/// The prompt: its text and the token ids the runtime fed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptBinding {
    /// Raw UTF-8 prompt text.
    pub text: String,
    /// Token ids of the prompt (no special tokens unless the text has them).
    pub ids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoding {
    /// Decoding strategy; only `greedy` exists today.
    pub strategy: String,
    pub max_new_tokens: u32,
}

impl Default for Decoding {
    fn default() -> Self {
        Decoding {
            strategy: "greedy".into(),
            max_new_tokens: 0,
        }
    }
}

/// Which levels were captured and which kept their tensor bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CaptureSpec {
    /// The levels fingerprinted (wire encoding: bit `i` is `Li`).
    pub levels: LevelSet,
    /// The levels whose records carry payloads (small records such as
    /// token ids and margins always do).
    pub payload_levels: LevelSet,
}

impl CaptureSpec {
    /// Fingerprints for every level, payloads for none.
    pub const FINGERPRINTS_ONLY: CaptureSpec = CaptureSpec {
        levels: LevelSet::ALL,
        payload_levels: LevelSet::EMPTY,
    };

    /// The capture `moeconf replay` needs (docs/replay.md): fingerprints of
    /// every level, payloads of L0 (tokens), L1 (logits, for teacher
    /// forcing), L2 (persistent state, the replay's carried inputs) and L3
    /// (the post-mHC checkpoints, its layer inputs and outputs). L4
    /// fingerprints name the operator where a half-layer parts, and the
    /// `embed.output` fingerprint certifies the layer-0 input.
    pub const REPLAY: CaptureSpec = CaptureSpec {
        levels: LevelSet::ALL,
        payload_levels: LevelSet::of_mask(0b01111),
    };

    /// Whether `level` is captured.
    pub fn captures(&self, level: Level) -> bool {
        self.levels.contains(level)
    }

    /// Whether `level` keeps payloads.
    pub fn keeps_payload(&self, level: Level) -> bool {
        self.payload_levels.contains(level)
    }

    /// Parses a capture spec: `default` (fingerprints for every level,
    /// payloads for L1 and L3), `all` (every level with payloads),
    /// `fingerprints` (no payloads beyond small records), `replay` (the
    /// minimal capture of `moeconf replay`, docs/replay.md: every level,
    /// payloads for L0–L3, L4 as fingerprints), or a list like
    /// `L0,L1+payload,L3+payload`. The error says what is wrong, for the
    /// caller to prefix with the option's name.
    pub fn parse(s: &str) -> Result<CaptureSpec, String> {
        match s {
            "default" => Ok(CaptureSpec {
                levels: LevelSet::ALL,
                payload_levels: LevelSet::of_mask(0b01010),
            }),
            "all" => Ok(CaptureSpec {
                levels: LevelSet::ALL,
                payload_levels: LevelSet::ALL,
            }),
            "fingerprints" => Ok(CaptureSpec::FINGERPRINTS_ONLY),
            "replay" => Ok(CaptureSpec::REPLAY),
            list => {
                let mut spec = CaptureSpec::default();
                for item in list.split(',').map(str::trim).filter(|x| !x.is_empty()) {
                    let (lv, payload) = match item.strip_suffix("+payload") {
                        Some(l) => (l, true),
                        None => (item, false),
                    };
                    let level = Level::from_name(lv).ok_or_else(|| {
                        format!("{item:?} is not a level (use L0..L4, optionally with +payload)")
                    })?;
                    spec.levels.insert(level);
                    if payload {
                        spec.payload_levels.insert(level);
                    }
                }
                if spec.levels.is_empty() {
                    return Err(format!(
                        "{s:?} selects no level (try default, all, fingerprints or L0,L1+payload,...)"
                    ));
                }
                Ok(spec)
            }
        }
    }

    /// `L0-L4` style summary, payload levels marked with `+`.
    pub fn describe(&self) -> String {
        Level::ALL
            .iter()
            .filter(|l| self.captures(**l))
            .map(|l| {
                if self.keeps_payload(*l) {
                    format!("{l}+payload")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The hashed binding of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Binding {
    pub model: ModelIdentity,
    pub tokenizer: TokenizerIdentity,
    /// Prompt text and ids.
    pub prompt: PromptBinding,
    pub decoding: Decoding,
    /// Precision profile (`bf16`, `f32`, or a backend's own name).
    pub precision: String,
    /// MoE aggregation contract (`native`, `b`, ...).
    pub contract: String,
    /// Aggregation schedule (`identity`, `layer-static:7`, `fork:layer=5,...`).
    pub schedule: String,
    /// Captured levels.
    pub capture: CaptureSpec,
    /// Canonicalization policy used for every digest.
    pub canon: CanonPolicy,
    /// Further key/value facts that bind the execution (sorted by key).
    pub extra: Vec<(String, String)>,
}

/// Recorded facts about the producer, not part of the root digest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Provenance {
    /// Runtime name (e.g. `moeconf-reference-runtime`).
    pub runtime: String,
    /// Runtime version.
    pub version: String,
    /// Worker threads used.
    pub threads: u32,
    /// Further key/value notes.
    pub notes: Vec<(String, String)>,
}

fn enc_pairs(e: &mut Encoder, pairs: &[(String, String)]) {
    e.len(pairs.len());
    for (k, v) in pairs {
        e.str(k).str(v);
    }
}

fn dec_pairs(d: &mut Decoder<'_>, what: &str) -> Result<Vec<(String, String)>, WireError> {
    let n = d.len(what, 16, MAX_EXTRA)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let k = d.str(what, MAX_STRING)?.to_string();
        let val = d.str(what, MAX_STRING)?.to_string();
        v.push((k, val));
    }
    Ok(v)
}

fn dec_digest(d: &mut Decoder<'_>, what: &str) -> Result<Digest, WireError> {
    Ok(Digest(d.array32(what)?))
}

impl Binding {
    /// Appends the wire encoding (field order as declared).
    pub fn encode(&self, e: &mut Encoder) {
        let m = &self.model;
        e.str(&m.name).raw(&m.config_digest.0).raw(&m.weights_digest.0);
        e.len(m.tensors.len());
        for t in &m.tensors {
            e.str(&t.name).str(&t.dtype).len(t.shape.len());
            for &s in &t.shape {
                e.u64(s);
            }
            e.raw(&t.digest.0);
        }
        e.str(&self.tokenizer.name).raw(&self.tokenizer.digest.0);
        e.str(&self.prompt.text).len(self.prompt.ids.len());
        for &id in &self.prompt.ids {
            e.u32(id);
        }
        e.str(&self.decoding.strategy).u32(self.decoding.max_new_tokens);
        e.str(&self.precision).str(&self.contract).str(&self.schedule);
        e.u32(self.capture.levels.bits())
            .u32(self.capture.payload_levels.bits());
        e.bool(self.canon.fold_negative_zero);
        enc_pairs(e, &self.extra);
    }

    /// The wire encoding alone.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        self.encode(&mut e);
        e.into_bytes()
    }

    pub fn decode(d: &mut Decoder<'_>) -> Result<Binding, WireError> {
        let name = d.str("model name", MAX_STRING)?.to_string();
        let config_digest = dec_digest(d, "model config digest")?;
        let weights_digest = dec_digest(d, "model weights digest")?;
        let n = d.len("model tensor list", 8 + 8 + 8 + 32, MAX_TENSORS)?;
        let mut tensors = Vec::with_capacity(n);
        for _ in 0..n {
            let tname = d.str("tensor name", MAX_STRING)?.to_string();
            let dtype = d.str("tensor dtype", 64)?.to_string();
            let rank = d.len("tensor shape", 8, moeconf_fingerprint::MAX_RANK as u64)?;
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(d.u64("tensor dimension")?);
            }
            let digest = dec_digest(d, "tensor digest")?;
            tensors.push(TensorDigest {
                name: tname,
                dtype,
                shape,
                digest,
            });
        }
        let tokenizer = TokenizerIdentity {
            name: d.str("tokenizer name", MAX_STRING)?.to_string(),
            digest: dec_digest(d, "tokenizer digest")?,
        };
        let text = d.str("prompt text", MAX_STRING)?.to_string();
        let n = d.len("prompt ids", 4, MAX_PROMPT_IDS)?;
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(d.u32("prompt id")?);
        }
        let decoding = Decoding {
            strategy: d.str("decoding strategy", 64)?.to_string(),
            max_new_tokens: d.u32("max new tokens")?,
        };
        let precision = d.str("precision", MAX_STRING)?.to_string();
        let contract = d.str("contract", MAX_STRING)?.to_string();
        let schedule = d.str("schedule", MAX_STRING)?.to_string();
        let at = d.offset();
        let (levels, payload_levels) = (d.u32("capture levels")?, d.u32("capture payload levels")?);
        let (Some(levels), Some(payload_levels)) =
            (LevelSet::from_bits(levels), LevelSet::from_bits(payload_levels))
        else {
            return Err(d.error_at(at, "capture spec names a level above L4"));
        };
        let capture = CaptureSpec {
            levels,
            payload_levels,
        };
        let canon = CanonPolicy {
            fold_negative_zero: d.bool("fold negative zero flag")?,
        };
        let extra = dec_pairs(d, "binding extras")?;
        Ok(Binding {
            model: ModelIdentity {
                name,
                config_digest,
                weights_digest,
                tensors,
            },
            tokenizer,
            prompt: PromptBinding { text, ids },
            decoding,
            precision,
            contract,
            schedule,
            capture,
            canon,
            extra,
        })
    }

    /// JSON form for `inspect --format json` and reports.
    pub fn to_json(&self, with_tensors: bool) -> Value {
        let mut model = json!({
            "name": self.model.name,
            "config_digest": self.model.config_digest.to_hex(),
            "weights_digest": self.model.weights_digest.to_hex(),
            "tensor_count": self.model.tensors.len(),
        });
        if with_tensors {
            model["tensors"] = Value::Array(
                self.model
                    .tensors
                    .iter()
                    .map(|t| json!({"name": t.name, "dtype": t.dtype, "shape": t.shape, "digest": t.digest.to_hex()}))
                    .collect(),
            );
        }
        json!({
            "model": model,
            "tokenizer": {"name": self.tokenizer.name, "digest": self.tokenizer.digest.to_hex()},
            "prompt": {"text": self.prompt.text, "ids": self.prompt.ids},
            "decoding": {"strategy": self.decoding.strategy, "max_new_tokens": self.decoding.max_new_tokens},
            "precision": self.precision,
            "contract": self.contract,
            "schedule": self.schedule,
            "capture": {
                "levels": Level::ALL.iter().filter(|l| self.capture.captures(**l)).map(|l| l.name()).collect::<Vec<_>>(),
                "payload_levels": Level::ALL.iter().filter(|l| self.capture.keeps_payload(**l)).map(|l| l.name()).collect::<Vec<_>>(),
            },
            "canonicalization": {"nan": "canonical quiet NaN per dtype", "fold_negative_zero": self.canon.fold_negative_zero},
            "extra": self.extra.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        })
    }
}

impl Provenance {
    /// Appends the wire encoding.
    pub fn encode(&self, e: &mut Encoder) {
        e.str(&self.runtime).str(&self.version).u32(self.threads);
        enc_pairs(e, &self.notes);
    }

    /// Decodes a provenance block, refusing a malformed or repeated
    /// [`RECOMPUTED_NOTE`] (which would otherwise pass recomputed records
    /// off as observed).
    pub fn decode(d: &mut Decoder<'_>) -> Result<Provenance, WireError> {
        let runtime = d.str("runtime name", MAX_STRING)?.to_string();
        let version = d.str("runtime version", MAX_STRING)?.to_string();
        let threads = d.u32("thread count")?;
        let at = d.offset();
        let notes = dec_pairs(d, "provenance notes")?;
        let marks = notes.iter().filter(|(k, _)| k == RECOMPUTED_NOTE);
        if marks.clone().count() > 1 {
            return Err(WireError {
                offset: at,
                what: format!("provenance notes: {RECOMPUTED_NOTE} is given more than once"),
            });
        }
        for (_, v) in marks {
            Recomputed::parse(v).map_err(|what| WireError { offset: at, what })?;
        }
        Ok(Provenance {
            runtime,
            version,
            threads,
            notes,
        })
    }

    /// The records the capture recomputed (the [`RECOMPUTED_NOTE`];
    /// docs/format.md §5.2.1). A trace without the note recomputed nothing.
    pub fn recomputed(&self) -> Recomputed {
        self.notes
            .iter()
            .find(|(k, _)| k == RECOMPUTED_NOTE)
            .and_then(|(_, v)| Recomputed::parse(v).ok())
            .unwrap_or_default()
    }

    /// Marks the records `r` covers as recomputed by the capture (replacing
    /// any earlier mark; an empty `r` removes it).
    pub fn set_recomputed(&mut self, r: &Recomputed) {
        self.notes.retain(|(k, _)| k != RECOMPUTED_NOTE);
        if let Some(v) = r.to_note() {
            self.notes.push((RECOMPUTED_NOTE.to_string(), v));
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "runtime": self.runtime,
            "version": self.version,
            "threads": self.threads,
            "notes": self.notes.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
            "recomputed": self.recomputed().patterns(),
        })
    }
}

/// Digest over a sorted tensor list, as stored in [`ModelIdentity::weights_digest`]:
/// H("moeconf.weights.v1", Vec<(name, dtype, shape, digest)>).
pub fn weights_digest(alg: moeconf_fingerprint::Algorithm, tensors: &[TensorDigest]) -> Digest {
    let mut e = Encoder::new();
    e.str("moeconf.weights.v1").len(tensors.len());
    for t in tensors {
        e.str(&t.name).str(&t.dtype).len(t.shape.len());
        for &s in &t.shape {
            e.u64(s);
        }
        e.raw(&t.digest.0);
    }
    alg.hash(e.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::Algorithm;

    #[test]
    fn the_replay_capture_set_is_payloads_for_l0_to_l3_and_l4_fingerprints() {
        let r = CaptureSpec::parse("replay").unwrap();
        assert_eq!(r, CaptureSpec::REPLAY);
        assert_eq!(
            r,
            CaptureSpec::parse("L0+payload,L1+payload,L2+payload,L3+payload,L4").unwrap()
        );
        assert_eq!(r.describe(), "L0+payload,L1+payload,L2+payload,L3+payload,L4");
    }

    pub(crate) fn sample() -> Binding {
        let tensors = vec![TensorDigest {
            name: "embed.weight".into(),
            dtype: "bf16".into(),
            shape: vec![1024, 256],
            digest: Algorithm::Blake3.hash(b"w"),
        }];
        Binding {
            model: ModelIdentity {
                name: "builtin:tiny-v4".into(),
                config_digest: Algorithm::Blake3.hash(b"c"),
                weights_digest: weights_digest(Algorithm::Blake3, &tensors),
                tensors,
            },
            tokenizer: TokenizerIdentity {
                name: "tokenizer.json".into(),
                digest: Algorithm::Blake3.hash(b"t"),
            },
            prompt: PromptBinding {
                text: "why the sheep".into(),
                ids: vec![5, 9, 200],
            },
            decoding: Decoding {
                strategy: "greedy".into(),
                max_new_tokens: 8,
            },
            precision: "bf16".into(),
            contract: "native".into(),
            schedule: "identity".into(),
            capture: CaptureSpec {
                levels: LevelSet::ALL,
                payload_levels: LevelSet::of_mask(0b01010),
            },
            canon: CanonPolicy::default(),
            extra: vec![("seed".into(), "7".into())],
        }
    }

    #[test]
    fn binding_round_trips() {
        let b = sample();
        let bytes = b.to_bytes();
        let mut d = Decoder::new(&bytes, 0);
        assert_eq!(Binding::decode(&mut d).unwrap(), b);
        d.finish("binding").unwrap();
        assert_eq!(b.capture.describe(), "L0,L1+payload,L2,L3+payload,L4");
    }

    #[test]
    fn weight_formats_name_fp8_and_mxfp4_from_the_tensor_list() {
        let t = |name: &str, dtype: &str| TensorDigest {
            name: name.into(),
            dtype: dtype.into(),
            shape: vec![1],
            digest: Algorithm::Blake3.hash(name.as_bytes()),
        };
        let q = ModelIdentity {
            tensors: vec![
                t("layers.0.attn.wq_a.weight", "f8_e4m3"),
                t("layers.0.attn.wq_a.scale", "f8_e8m0"),
                t("layers.0.ffn.experts.0.w1.weight", "i8"),
            ],
            ..ModelIdentity::default()
        };
        assert_eq!(
            q.weight_formats(),
            "dense fp8-e4m3 (UE8M0 128x128 scales), experts mxfp4 (E2M1, UE8M0 per 32)"
        );
        let b = ModelIdentity {
            tensors: vec![
                t("layers.0.attn.wq_a.weight", "bf16"),
                t("layers.0.ffn.experts.0.w1.weight", "bf16"),
            ],
            ..ModelIdentity::default()
        };
        assert_eq!(b.weight_formats(), "dense bf16, experts bf16");
        let hf = ModelIdentity {
            tensors: vec![
                t("model.embed_tokens.weight", "bf16"),
                t("x", "f32"),
                t("y", "bf16"),
            ],
            ..ModelIdentity::default()
        };
        assert_eq!(hf.weight_formats(), "bf16, f32");
        assert_eq!(ModelIdentity::default().weight_formats(), "unknown");
    }
}
