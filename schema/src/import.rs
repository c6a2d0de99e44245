//! `moeconf import DIR -o TRACE`: a canonical trace from a backend's tensor
//! dumps, for backends that write safetensors files instead of calling a
//! trace writer (C++ runtimes, serving stacks with debug dumps).
//!
//! `DIR` holds `manifest.json` (the binding facts the tensors cannot carry:
//! model and tokenizer identity, prompt, decoding, precision, contract,
//! schedule, runtime) and any number of `*.safetensors` files whose tensor
//! names follow the convention of docs/import.md:
//!
//! ```text
//! step.{t}.pos.{p}.{component}            model-global tensors (tokens, logits)
//! step.{t}.pos.{p}.layer.{i}.{component}  per-layer tensors (states, routes, operators, caches)
//! ```
//!
//! The level comes from the component path (docs/format.md §6: `token.`/`text.`
//! L0, `lm.` L1, `state.` L2, `layer.`/`router.` L3, `attn.`/`ffn.`/`moe.` L4;
//! the manifest may map further prefixes), the phase from the step (0 prefill).
//! Element types follow the catalogue convention: bf16 and f16 are widened
//! exactly to f32, f32/f64/u8/u32 are kept, and integer tensors of catalogue
//! components are converted to the catalogue's integer type (ids i32,
//! counters i64) with a range check. Records are written in the reference
//! runtime's execution order (see [`exec_key`]); the order never affects a digest.

use crate::error::InputError;
use crate::identity::model_identity;
use crate::TraceError;
use crate::{
    Binding, CaptureSpec, Decoding, Header, ModelIdentity, PromptBinding, Provenance, TokenizerIdentity,
    TraceWriter, WriteSummary, SMALL_RECORD_BYTES,
};
use moeconf_fingerprint::catalogue::{exec_rank, level_of_path, ExecGroup, ValueKind};
use moeconf_fingerprint::{
    bf16_to_f32, f16_to_f32, Algorithm, CanonPolicy, Component, Coord, DType, Digest, Level, LevelSet, Phase,
    TensorView, MAX_RANK,
};
use moeconf_output::input::{check_input, read_input, InputFileError};
use moeconf_output::{check_output, Inputs};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

/// Largest manifest accepted (a manifest is a few hundred bytes plus the prompt).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// What `moeconf import` was asked to do.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Dump directory: `manifest.json` and `*.safetensors` files.
    pub input: PathBuf,
    /// Output trace file (written atomically).
    pub output: PathBuf,
    /// Manifest file (default: `input/manifest.json`).
    pub manifest: Option<PathBuf>,
    /// Digest algorithm of the trace.
    pub algorithm: Algorithm,
    /// Canonicalization policy (recorded in the binding).
    pub canon: CanonPolicy,
    /// Levels whose records keep their tensor bytes (records of at most
    /// [`SMALL_RECORD_BYTES`] always keep theirs).
    pub payload_levels: LevelSet,
}

/// `manifest.json`: everything the binding needs that tensor names cannot say.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    model: ModelSpec,
    tokenizer: TokenizerSpec,
    prompt: PromptSpec,
    max_new_tokens: u32,
    #[serde(default = "default_decoding")]
    decoding: String,
    precision: String,
    contract: String,
    schedule: String,
    runtime: RuntimeSpec,
    #[serde(default)]
    extra: BTreeMap<String, String>,
    #[serde(default)]
    component_levels: BTreeMap<String, String>,
}

fn default_decoding() -> String {
    "greedy".into()
}

fn default_tokenizer_name() -> String {
    "tokenizer.json".into()
}

/// The model: a directory to digest like `moeconf run` does, or given digests.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSpec {
    name: String,
    dir: Option<PathBuf>,
    config_digest: Option<String>,
    weights_digest: Option<String>,
}

/// The tokenizer: a file to digest, or a given digest.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizerSpec {
    #[serde(default = "default_tokenizer_name")]
    name: String,
    file: Option<PathBuf>,
    digest: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptSpec {
    text: String,
    ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuntimeSpec {
    name: String,
    version: String,
    #[serde(default)]
    threads: Option<u32>,
    #[serde(default)]
    notes: BTreeMap<String, String>,
}

/// One tensor name decoded by the naming convention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpName {
    /// Forward step (0 = prefill).
    pub step: u32,
    /// Absolute token position.
    pub position: u32,
    /// Decoder layer, or None for model-global tensors.
    pub layer: Option<u32>,
    /// Component path (docs/format.md §3.1 charset).
    pub component: String,
}

/// A decimal u32 without sign or leading zeros.
fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

/// Decodes `step.{t}.pos.{p}.{component}` or `step.{t}.pos.{p}.layer.{i}.{component}`.
pub fn parse_dump_name(name: &str) -> Result<DumpName, String> {
    let expected = "expected step.{t}.pos.{p}.{component} or step.{t}.pos.{p}.layer.{i}.{component} \
                    (decimal indices without leading zeros)";
    let mut it = name.splitn(5, '.');
    let (Some("step"), Some(t), Some("pos"), Some(p), Some(rest)) =
        (it.next(), it.next(), it.next(), it.next(), it.next())
    else {
        return Err(format!(
            "tensor name {name:?} does not follow the convention: {expected}"
        ));
    };
    let (Some(step), Some(position)) = (parse_index(t), parse_index(p)) else {
        return Err(format!(
            "tensor name {name:?}: step or position is not a decimal u32: {expected}"
        ));
    };
    // `layer.L.` (the dump convention's layer segment, not a component namespace).
    let in_layer = rest
        .split_once('.')
        .filter(|(segment, _)| *segment == "layer")
        .and_then(|(_, r)| r.split_once('.'));
    let (layer, component) = match in_layer {
        Some((i, comp)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => {
            let Some(l) = parse_index(i) else {
                return Err(format!(
                    "tensor name {name:?}: layer {i:?} is not a decimal u32: {expected}"
                ));
            };
            (Some(l), comp)
        }
        _ => (None, rest),
    };
    Coord::validate_path(component).map_err(|m| format!("tensor name {name:?}: {m}"))?;
    Ok(DumpName {
        step,
        position,
        layer,
        component: component.to_string(),
    })
}

/// The level the manifest's mapping gives a component: the longest matching
/// prefix of its `component_levels`, else the catalogue prefix table's. The
/// caller refuses a result that moves a catalogue component away from its
/// catalogue level (`component_levels` is for components outside it).
fn level_of(component: &str, overrides: &[(String, Level)]) -> Option<Level> {
    overrides
        .iter()
        .filter(|(p, _)| component.starts_with(p.as_str()))
        .max_by_key(|(p, _)| p.len())
        .map(|(_, l)| *l)
        .or_else(|| level_of_path(component))
}

/// The integer type the catalogue gives a component, if it is an integer component.
fn catalogue_int(component: &str) -> Option<DType> {
    match Component::parse(component)?.0.kind() {
        ValueKind::Ids => Some(DType::I32),
        ValueKind::Count => Some(DType::I64),
        ValueKind::Float | ValueKind::Text => None,
    }
}

/// A tensor converted to its trace element type.
#[derive(Debug)]
struct Converted {
    dtype: DType,
    bytes: Vec<u8>,
}

/// Converts a dumped tensor to the trace's element type (see the module documentation).
fn convert(dtype: Dtype, data: &[u8], component: &str) -> Result<Converted, String> {
    let wide = |src: usize, f: &dyn Fn(&[u8]) -> [u8; 4]| -> Vec<u8> {
        data.chunks_exact(src).flat_map(f).collect()
    };
    let want = catalogue_int(component);
    Ok(match dtype {
        Dtype::BF16 => Converted {
            dtype: DType::F32,
            bytes: wide(2, &|c| {
                bf16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes()
            }),
        },
        Dtype::F16 => Converted {
            dtype: DType::F32,
            bytes: wide(2, &|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_le_bytes()),
        },
        Dtype::F32 => Converted {
            dtype: DType::F32,
            bytes: data.to_vec(),
        },
        Dtype::F64 => Converted {
            dtype: DType::F64,
            bytes: data.to_vec(),
        },
        Dtype::U8 => Converted {
            dtype: DType::U8,
            bytes: data.to_vec(),
        },
        Dtype::U32 => Converted {
            dtype: DType::U32,
            bytes: data.to_vec(),
        },
        Dtype::I32 if want == Some(DType::I64) => Converted {
            dtype: DType::I64,
            bytes: data
                .chunks_exact(4)
                .flat_map(|c| (i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).to_le_bytes())
                .collect(),
        },
        Dtype::I32 => Converted {
            dtype: DType::I32,
            bytes: data.to_vec(),
        },
        Dtype::I64 if want == Some(DType::I32) => {
            let mut bytes = Vec::with_capacity(data.len() / 2);
            for (i, c) in data.chunks_exact(8).enumerate() {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                let v = i64::from_le_bytes(b);
                let v = i32::try_from(v).map_err(|_| {
                    format!("element {i} = {v} does not fit the catalogue's i32 for {component}")
                })?;
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            Converted {
                dtype: DType::I32,
                bytes,
            }
        }
        Dtype::I64 => Converted {
            dtype: DType::I64,
            bytes: data.to_vec(),
        },
        other => {
            return Err(format!(
                "unsupported dtype {other:?} (supported: BF16, F16, F32, F64, I32, I64, U8, U32)"
            ))
        }
    })
}

/// Sort key giving the reference runtime's execution order within a step:
/// `token.input` first, then the layers (layer-major, then position, then
/// operator order), then the model-global outputs, then the persistent state
/// at the decode boundary (layer-major); ties by path bytes. Orders come
/// from the catalogue ([`exec_rank`]); components outside it sort last.
pub fn exec_key(n: &DumpName, level: Level) -> (u32, ExecGroup, u32, u32, (u16, u64), String) {
    let group = match Component::parse(&n.component) {
        Some((c, _)) if level == c.level() => c.exec_group(),
        _ if level == Level::L2 => ExecGroup::State,
        _ if n.layer.is_some() => ExecGroup::Layer,
        _ => ExecGroup::StepOutput,
    };
    (
        n.step,
        group,
        n.layer.unwrap_or(0),
        n.position,
        exec_rank(&n.component),
        n.component.clone(),
    )
}

fn parse_digest(hex: &str, what: &str, manifest: &Path) -> Result<Digest, InputError> {
    Digest::from_hex(hex).ok_or_else(|| {
        invalid(format!(
            "{}: {what}: {hex:?} is not 64 hex digits",
            manifest.display()
        ))
    })
}

fn read_manifest(path: &Path) -> Result<Manifest, InputError> {
    let meta = check_input(path, "manifest").map_err(io_or_file(format!(
        "{}: cannot read the manifest (every dump directory needs a manifest.json, see docs/import.md)",
        path.display()
    )))?;
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(invalid(format!(
            "{}: {} bytes, larger than the 64.0 MiB a manifest may have",
            path.display(),
            meta.len(),
        )));
    }
    let bytes = read_input(path, "manifest")?;
    serde_json::from_slice(&bytes).map_err(|e| invalid(format!("{}: invalid manifest: {e}", path.display())))
}

/// An I/O failure reported in the caller's words (`context` names the file),
/// a file of the wrong kind (FIFO, directory, device) as it is.
fn io_or_file(context: String) -> impl FnOnce(InputFileError) -> InputError {
    move |e| match e.into_io() {
        Ok(source) => InputError::Io { context, source },
        Err(e) => InputError::File(e),
    }
}

/// Resolves a path from the manifest against the manifest's directory.
fn resolve(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// The binding from the manifest (model and tokenizer digested when given as files).
fn binding_from(
    m: &Manifest,
    manifest: &Path,
    alg: Algorithm,
    capture: CaptureSpec,
    canon: CanonPolicy,
) -> Result<Binding, InputError> {
    let base = manifest.parent().unwrap_or(Path::new("."));
    let model = match (&m.model.dir, &m.model.config_digest, &m.model.weights_digest) {
        (Some(dir), None, None) => model_identity(&m.model.name, &resolve(base, dir), alg).map_err(|e| {
            invalid(format!(
                "{}: model.dir: {}",
                manifest.display(),
                moeconf_output::error_chain(&e)
            ))
        })?,
        (None, Some(c), Some(w)) => ModelIdentity {
            name: m.model.name.clone(),
            config_digest: parse_digest(c, "model.config_digest", manifest)?,
            weights_digest: parse_digest(w, "model.weights_digest", manifest)?,
            tensors: vec![],
        },
        _ => {
            return Err(invalid(format!(
                "{}: model needs either \"dir\" (a model directory to digest) or both \"config_digest\" and \
                 \"weights_digest\" (hex; 64 zeros if unknown)",
                manifest.display()
            )))
        }
    };
    let tokenizer_digest = match (&m.tokenizer.file, &m.tokenizer.digest) {
        (Some(f), None) => {
            let p = resolve(base, f);
            let bytes = read_input(&p, "tokenizer file").map_err(io_or_file(format!(
                "{}: tokenizer.file {}",
                manifest.display(),
                p.display()
            )))?;
            alg.hash(&bytes)
        }
        (None, Some(d)) => parse_digest(d, "tokenizer.digest", manifest)?,
        _ => {
            return Err(invalid(format!(
                "{}: tokenizer needs either \"file\" or \"digest\" (hex; 64 zeros if unknown)",
                manifest.display()
            )))
        }
    };
    Ok(Binding {
        model,
        tokenizer: TokenizerIdentity {
            name: m.tokenizer.name.clone(),
            digest: tokenizer_digest,
        },
        prompt: PromptBinding {
            text: m.prompt.text.clone(),
            ids: m.prompt.ids.clone(),
        },
        decoding: Decoding {
            strategy: m.decoding.clone(),
            max_new_tokens: m.max_new_tokens,
        },
        precision: m.precision.clone(),
        contract: m.contract.clone(),
        schedule: m.schedule.clone(),
        capture,
        canon,
        extra: m.extra.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    })
}

/// Parses `--payloads`: `all`, `none` or a list of levels; returns a level bit mask.
pub fn parse_payloads(s: &str) -> Result<LevelSet, String> {
    match s {
        "all" => Ok(LevelSet::ALL),
        "none" => Ok(LevelSet::EMPTY),
        list => {
            list.split(',')
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .try_fold(LevelSet::EMPTY, |acc, item| {
                    let l = Level::from_name(item)
                        .ok_or_else(|| format!("{item:?} is not a level (all, none or L0,L1,...)"))?;
                    Ok(acc.with(l))
                })
        }
    }
}

/// One tensor of the dump, converted and placed.
struct Item {
    name: DumpName,
    level: Level,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
}

/// Reads every `*.safetensors` file of `dir` (sorted by name) into converted
/// records. Each must be a regular file (symbolic links followed): an entry
/// of that name that is a directory, FIFO, socket or device, or a link to one
/// or to nothing, is an error, never skipped (a trace with fewer records
/// would pass for the whole dump).
fn read_dump(
    dir: &Path,
    overrides: &[(String, Level)],
    max_new_tokens: u32,
) -> Result<Vec<Item>, InputError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(InputError::io(format!(
            "{}: cannot list the dump directory",
            dir.display()
        )))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(invalid(format!(
            "{}: no *.safetensors files to import",
            dir.display()
        )));
    }
    let mut items = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for f in &files {
        let bytes = read_input(f, "dump file")?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| invalid(format!("{}: not a valid safetensors file: {e}", f.display())))?;
        let mut names = st.names();
        names.sort();
        for tname in names {
            let fail = |m: String| invalid(format!("{}: tensor {tname:?}: {m}", f.display()));
            let view = st.tensor(tname).map_err(|e| fail(e.to_string()))?;
            if !seen.insert(tname.to_string()) {
                return Err(fail("appears in more than one file".into()));
            }
            let name = parse_dump_name(tname).map_err(|m| invalid(format!("{}: {m}", f.display())))?;
            if name.step >= max_new_tokens {
                return Err(fail(format!(
                    "step {} but the manifest says max_new_tokens = {max_new_tokens} (steps 0..{})",
                    name.step,
                    max_new_tokens.saturating_sub(1)
                )));
            }
            let level = level_of(&name.component, overrides).ok_or_else(|| {
                fail(format!(
                    "no level for component {:?}: use a catalogue prefix (token., text., lm., state., layer., \
                     router., attn., ffn., moe.) or map it in the manifest's component_levels",
                    name.component
                ))
            })?;
            if let Some((component, _)) = Component::parse(&name.component) {
                if component.level() != level {
                    return Err(fail(format!(
                        "the manifest's component_levels put {:?} at {level}, but it is a catalogue \
                         component of level {} (docs/format.md §6): a catalogue component's level is \
                         fixed; component_levels is for components outside the catalogue",
                        name.component,
                        component.level()
                    )));
                }
            }
            // Refused here, naming this file: the writer would name only the output.
            if view.shape().len() > MAX_RANK {
                return Err(fail(format!(
                    "rank {} (shape {:?}): a trace record has at most {MAX_RANK} dimensions",
                    view.shape().len(),
                    view.shape()
                )));
            }
            let c = convert(view.dtype(), view.data(), &name.component).map_err(fail)?;
            items.push(Item {
                name,
                level,
                dtype: c.dtype,
                shape: view.shape().iter().map(|&d| d as u64).collect(),
                bytes: c.bytes,
            });
        }
    }
    items.sort_by_cached_key(|it| exec_key(&it.name, it.level));
    Ok(items)
}

/// Builds a canonical trace from a dump directory (docs/import.md) and
/// writes it atomically to `a.output`.
pub fn import(a: &ImportOptions) -> Result<WriteSummary, InputError> {
    let alg = a.algorithm;
    let payload_levels = a.payload_levels;
    if !a.input.is_dir() {
        return Err(invalid(format!(
            "{}: not a directory (expected a dump directory with manifest.json)",
            a.input.display()
        )));
    }
    let manifest_path = a
        .manifest
        .clone()
        .unwrap_or_else(|| a.input.join("manifest.json"));
    let m = read_manifest(&manifest_path)?;
    let mut overrides = Vec::new();
    for (prefix, level) in &m.component_levels {
        let l = Level::from_name(level).ok_or_else(|| {
            invalid(format!(
                "{}: component_levels.{prefix}: {level:?} is not L0..L4",
                manifest_path.display()
            ))
        })?;
        overrides.push((prefix.clone(), l));
    }
    let out = check_output(&a.output, &import_inputs(a, &m, &manifest_path)).map_err(TraceError::from)?;
    let canon = a.canon;
    let mut header = Header {
        binding: binding_from(&m, &manifest_path, alg, CaptureSpec::default(), canon)?,
        provenance: Provenance {
            runtime: m.runtime.name.clone(),
            version: m.runtime.version.clone(),
            threads: m.runtime.threads.unwrap_or(0),
            notes: m
                .runtime
                .notes
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        },
    };
    // A manifest whose facts a reader would refuse (a string over its cap,
    // too many extras, ...) is an error before the dumps are read.
    header
        .to_checked_bytes()
        .map_err(|m| invalid(format!("{}: {m}", manifest_path.display())))?;
    let items = read_dump(&a.input, &overrides, m.max_new_tokens)?;
    let levels = items.iter().fold(LevelSet::EMPTY, |acc, it| acc.with(it.level));
    let capture = CaptureSpec {
        levels,
        payload_levels: payload_levels.intersection(levels),
    };
    header.binding.capture = capture;
    let mut w = TraceWriter::create_checked(&out, alg, header)?;
    for it in &items {
        let coord = Coord {
            step: it.name.step,
            position: it.name.position,
            phase: if it.name.step == 0 {
                Phase::Prefill
            } else {
                Phase::Decode
            },
            layer: it.name.layer,
            path: it.name.component.as_str().into(),
        };
        let view = TensorView {
            dtype: it.dtype,
            shape: &it.shape,
            bytes: &it.bytes,
        };
        let keep = capture.keeps_payload(it.level) || it.bytes.len() <= SMALL_RECORD_BYTES;
        w.append(coord, it.level, view, keep)?;
    }
    Ok(w.finish()?)
}

/// Every file `import` reads, which its output must not be: the dump
/// directory's files, the manifest, and the model directory's files and the
/// tokenizer file the manifest names.
fn import_inputs(a: &ImportOptions, m: &Manifest, manifest: &Path) -> Inputs {
    let base = manifest.parent().unwrap_or(Path::new("."));
    let mut inputs = Inputs::new();
    inputs.dir_files(&a.input, "dump file").file(manifest, "manifest");
    if let Some(dir) = &m.model.dir {
        inputs.dir_files(&resolve(base, dir), "model file");
    }
    if let Some(f) = &m.tokenizer.file {
        inputs.file(&resolve(base, f), "tokenizer file");
    }
    inputs
}

/// An invalid-input error.
fn invalid(message: String) -> InputError {
    InputError::Invalid(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_convention() {
        assert_eq!(
            parse_dump_name("step.0.pos.4.layer.12.moe.term.3"),
            Ok(DumpName {
                step: 0,
                position: 4,
                layer: Some(12),
                component: "moe.term.3".into()
            })
        );
        assert_eq!(
            parse_dump_name("step.2.pos.7.lm.logits").map(|n| (n.layer, n.component)),
            Ok((None, "lm.logits".into()))
        );
        // A per-layer component whose path starts with `layer.` keeps it.
        assert_eq!(
            parse_dump_name("step.0.pos.0.layer.1.layer.post_ffn_mhc").map(|n| (n.layer, n.component)),
            Ok((Some(1), "layer.post_ffn_mhc".into()))
        );
        for bad in [
            "lm.logits",
            "step.0.lm.logits",
            "step.01.pos.0.lm.logits",
            "step.0.pos.-1.lm.logits",
            "step.4294967296.pos.0.lm.logits",
            "step.0.pos.0.layer.007.attn.q",
            "step.0.pos.0.",
            "step.0.pos.0.lm logits",
        ] {
            assert!(parse_dump_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn levels_from_the_catalogue_and_overrides() {
        let none: Vec<(String, Level)> = vec![];
        assert_eq!(level_of("token.output", &none), Some(Level::L0));
        assert_eq!(level_of("lm.margin", &none), Some(Level::L1));
        assert_eq!(level_of("state.window_kv", &none), Some(Level::L2));
        assert_eq!(level_of("router.topk", &none), Some(Level::L3));
        assert_eq!(level_of("moe.term.5", &none), Some(Level::L4));
        assert_eq!(level_of("custom.x", &none), None);
        let o = vec![
            ("custom.".to_string(), Level::L4),
            ("moe.".to_string(), Level::L3),
        ];
        assert_eq!(level_of("custom.x", &o), Some(Level::L4));
        assert_eq!(level_of("moe.combine", &o), Some(Level::L3));
    }

    #[test]
    fn integer_components_take_the_catalogue_type() {
        let ids: Vec<u8> = [5i64, 70000].iter().flat_map(|x| x.to_le_bytes()).collect();
        let c = convert(Dtype::I64, &ids, "token.input").unwrap();
        assert_eq!(c.dtype, DType::I32);
        assert_eq!(
            c.bytes,
            [5i32, 70000]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>()
        );
        let big: Vec<u8> = (1i64 << 40).to_le_bytes().to_vec();
        assert!(convert(Dtype::I64, &big, "router.topk")
            .unwrap_err()
            .contains("does not fit"));
        let c = convert(Dtype::I32, &7i32.to_le_bytes(), "state.cumulative_length").unwrap();
        assert_eq!((c.dtype, c.bytes), (DType::I64, 7i64.to_le_bytes().to_vec()));
        // Non-catalogue integers keep their type.
        let c = convert(Dtype::I64, &big, "custom.counter").unwrap();
        assert_eq!(c.dtype, DType::I64);
        // bf16 widens by a 16-bit shift.
        let c = convert(Dtype::BF16, &[0xc0, 0x3f], "attn.q").unwrap();
        assert_eq!((c.dtype, c.bytes), (DType::F32, 1.5f32.to_le_bytes().to_vec()));
        assert!(convert(Dtype::BOOL, &[1], "attn.q")
            .unwrap_err()
            .contains("unsupported dtype BOOL"));
    }

    #[test]
    fn execution_order_matches_the_reference() {
        let n = |s: &str| parse_dump_name(s).unwrap();
        let mut v = vec![
            (n("step.0.pos.1.layer.0.state.window_kv"), Level::L2),
            (n("step.0.pos.1.token.output"), Level::L0),
            (n("step.0.pos.1.lm.logits"), Level::L1),
            (n("step.0.pos.1.layer.1.attn.q"), Level::L4),
            (n("step.0.pos.1.layer.0.moe.term.10"), Level::L4),
            (n("step.0.pos.1.layer.0.moe.term.2"), Level::L4),
            (n("step.0.pos.0.layer.1.attn.q"), Level::L4),
            (n("step.0.pos.0.layer.0.layer.post_ffn_mhc"), Level::L3),
            (n("step.0.pos.0.token.input"), Level::L0),
            (n("step.0.pos.1.layer.0.state.cumulative_length"), Level::L2),
        ];
        v.sort_by_key(|(n, l)| exec_key(n, *l));
        let got: Vec<String> = v
            .iter()
            .map(|(n, _)| format!("{}:{:?}:{}", n.position, n.layer, n.component))
            .collect();
        assert_eq!(
            got,
            [
                "0:None:token.input",
                "0:Some(0):layer.post_ffn_mhc",
                "1:Some(0):moe.term.2",
                "1:Some(0):moe.term.10",
                "0:Some(1):attn.q",
                "1:Some(1):attn.q",
                "1:None:lm.logits",
                "1:None:token.output",
                "1:Some(0):state.cumulative_length",
                "1:Some(0):state.window_kv",
            ]
        );
    }
}
