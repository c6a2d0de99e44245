//! Operator input/output relations of the component catalogue
//! (docs/format.md §6, notes on the reference runtime's execution order).
//!
//! A record is the output of one operator; [`inputs_of`] lists the records
//! that operator reads at the same step, position and layer (or the layer
//! before / the previous decode boundary). The localized operator of a
//! divergence is the first differing record, in execution order, whose
//! inputs all match: the operator itself computed something different from
//! the same inputs.
//!
//! Same-position relations only: attention also reads the keys and values of
//! earlier positions of the same step (prefill), which the relation covers
//! only through those positions' own records; the persistent state carried
//! in from the previous decode boundary is listed as an input of the
//! attention operators that read it.

use moeconf_fingerprint::Level;

/// The two halves of a decoder layer (each ends in an mHC `hc_post`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Half {
    /// mHC pre → attention → mHC post (`attn.*`, `layer.post_attn_mhc`).
    Attention,
    /// mHC pre → router, experts, combine → mHC post (`ffn.*`, `router.*`,
    /// `moe.*`, `layer.post_ffn_mhc`).
    Ffn,
}

impl Half {
    /// `attention` / `ffn`.
    pub fn name(self) -> &'static str {
        match self {
            Half::Attention => "attention",
            Half::Ffn => "ffn",
        }
    }
}

/// The half a layer record belongs to (`None` for model-global and L2 records).
pub fn half_of(path: &str) -> Option<Half> {
    if path.starts_with("attn.") || path == "layer.post_attn_mhc" {
        Some(Half::Attention)
    } else if path.starts_with("ffn.")
        || path.starts_with("router.")
        || path.starts_with("moe.")
        || path == "layer.post_ffn_mhc"
    {
        Some(Half::Ffn)
    } else {
        None
    }
}

/// Whether `path` is one of the two post-mHC layer-state checkpoints.
pub fn is_checkpoint(path: &str) -> bool {
    path == "layer.post_attn_mhc" || path == "layer.post_ffn_mhc"
}

/// One input of an operator, relative to the operator's own coordinate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputSpec {
    /// Level of the input record.
    pub level: Level,
    /// Steps back from the operator's step (0 or 1).
    pub steps_back: u32,
    /// Layer of the input (`None`: model-global).
    pub layer: Option<u32>,
    /// Whether the input has the operator's position (otherwise any position
    /// of that step, layer and path).
    pub same_position: bool,
    /// Path, or path prefix when `prefix`.
    pub path: String,
    /// Match every path starting with `path` (e.g. `moe.term.` or `state.`).
    pub prefix: bool,
}

fn same(level: Level, layer: u32, path: &str) -> InputSpec {
    InputSpec {
        level,
        steps_back: 0,
        layer: Some(layer),
        same_position: true,
        path: path.to_string(),
        prefix: false,
    }
}

/// The residual streams entering layer `layer`: the previous layer's
/// post-FFN state, or the step's input ids for layer 0.
fn layer_input(layer: u32) -> InputSpec {
    match layer.checked_sub(1) {
        Some(prev) => same(Level::L3, prev, "layer.post_ffn_mhc"),
        None => InputSpec {
            level: Level::L0,
            steps_back: 0,
            layer: None,
            same_position: false,
            path: "token.input".into(),
            prefix: false,
        },
    }
}

/// The persistent state of `layer` at the previous decode boundary.
fn carried_state(layer: u32) -> InputSpec {
    InputSpec {
        level: Level::L2,
        steps_back: 1,
        layer: Some(layer),
        same_position: false,
        path: "state.".into(),
        prefix: true,
    }
}

/// The inputs of the operator that produces `path` at layer `layer`, or an
/// empty list for paths without a known relation (then the record counts as
/// localized when it is the first to differ).
pub fn inputs_of(path: &str, layer: u32) -> Vec<InputSpec> {
    use Level::{L3, L4};
    let s = |lv: Level, p: &str| same(lv, layer, p);
    match path {
        "attn.hc_pre" => vec![layer_input(layer)],
        "attn.norm" => vec![s(L4, "attn.hc_pre")],
        "attn.q" | "attn.kv" | "attn.compressed" | "attn.indexer_compressed" => vec![s(L4, "attn.norm")],
        "attn.indexer_topk" => vec![
            s(L4, "attn.norm"),
            s(L4, "attn.indexer_compressed"),
            carried_state(layer),
        ],
        "attn.core" => vec![
            s(L4, "attn.q"),
            s(L4, "attn.kv"),
            s(L4, "attn.compressed"),
            s(L4, "attn.indexer_topk"),
            carried_state(layer),
        ],
        "attn.output" => vec![s(L4, "attn.core")],
        "layer.post_attn_mhc" => vec![layer_input(layer), s(L4, "attn.output")],
        "ffn.hc_pre" => vec![s(L3, "layer.post_attn_mhc")],
        "ffn.norm" => vec![s(L4, "ffn.hc_pre")],
        "router.scores" => vec![s(L4, "ffn.norm")],
        "router.topk" | "router.margin" => vec![s(L3, "router.scores")],
        "router.gates" => vec![s(L3, "router.scores"), s(L3, "router.topk")],
        "moe.shared" => vec![s(L4, "ffn.norm")],
        "moe.combine" => vec![
            InputSpec {
                prefix: true,
                ..s(L4, "moe.term.")
            },
            s(L4, "moe.shared"),
        ],
        "layer.post_ffn_mhc" => vec![s(L3, "layer.post_attn_mhc"), s(L4, "moe.combine")],
        p if p.starts_with("moe.term.") => {
            vec![s(L4, "ffn.norm"), s(L3, "router.topk"), s(L3, "router.gates")]
        }
        _ => Vec::new(),
    }
}

/// Human name of the input spec, e.g. `moe.term.* (L4, layer 5)`.
pub fn describe_input(spec: &InputSpec) -> String {
    let path = if spec.prefix {
        format!("{}*", spec.path)
    } else {
        spec.path.clone()
    };
    let mut s = path;
    if let Some(l) = spec.layer {
        s.push_str(&format!(" (layer {l}"));
        if spec.steps_back > 0 {
            s.push_str(", previous decode boundary");
        }
        s.push(')');
    }
    s
}
