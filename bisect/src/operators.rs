//! Operator input/output relations, read from the component catalogue
//! (`moeconf_fingerprint::catalogue`, docs/format.md §6).
//!
//! A record is the output of one operator; [`inputs_of`] lists the records
//! that operator reads at the same step, position and layer (or the layer
//! before / the previous decode boundary), as the catalogue's
//! [`ComponentSpec::inputs`](moeconf_fingerprint::catalogue::ComponentSpec)
//! say. The localized operator of a divergence is the first differing
//! record, in execution order, whose inputs all match: the operator itself
//! computed something different from the same inputs.
//!
//! Same-position relations only: attention also reads the keys and values of
//! earlier positions of the same step (prefill), which the relation covers
//! only through those positions' own records; the persistent state carried
//! in from the previous decode boundary is listed as an input of the
//! attention operators that read it.

use moeconf_fingerprint::catalogue::{half_of_path, Input, InputSource, STATE_PREFIX};
use moeconf_fingerprint::{Component, Half, Level};

/// The half a layer record belongs to (`None` for model-global and L2
/// records): the catalogue's half, else by namespace.
pub fn half_of(path: &str) -> Option<Half> {
    half_of_path(path)
}

/// Whether `path` is one of the two post-mHC layer-state checkpoints.
pub fn is_checkpoint(path: &str) -> bool {
    Component::parse(path).is_some_and(|(c, _)| c.is_checkpoint())
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

/// The records of `component` at the operator's own step, position and `layer`.
fn same(component: Component, layer: u32) -> InputSpec {
    InputSpec {
        level: component.level(),
        steps_back: 0,
        layer: Some(layer),
        same_position: true,
        path: component.path().to_string(),
        prefix: component.is_family(),
    }
}

/// The residual streams entering layer `layer`: the previous layer's
/// post-FFN state, or for layer 0 the embedding of the same position.
fn layer_input(input: &Input, layer: u32) -> InputSpec {
    match layer.checked_sub(1) {
        Some(prev) => same(input.component, prev),
        None => InputSpec {
            level: Component::EmbedOutput.level(),
            steps_back: 0,
            layer: None,
            same_position: true,
            path: Component::EmbedOutput.path().to_string(),
            prefix: false,
        },
    }
}

/// The step's input ids (model-global, any position of the step).
fn step_input() -> InputSpec {
    InputSpec {
        level: Component::TokenInput.level(),
        steps_back: 0,
        layer: None,
        same_position: false,
        path: Component::TokenInput.path().to_string(),
        prefix: false,
    }
}

/// The persistent state of `layer` at the previous decode boundary.
fn carried_state(layer: u32) -> InputSpec {
    InputSpec {
        level: Level::L2,
        steps_back: 1,
        layer: Some(layer),
        same_position: false,
        path: STATE_PREFIX.to_string(),
        prefix: true,
    }
}

/// The catalogue component whose operator produces `path`: a catalogue
/// path, or any path under a family's prefix (`moe.term.*`).
pub(crate) fn producer(path: &str) -> Option<Component> {
    Component::parse(path).map(|(c, _)| c).or_else(|| {
        Component::ALL
            .iter()
            .copied()
            .find(|c| c.is_family() && path.starts_with(c.path()))
    })
}

/// The inputs of the operator that produces `path` at layer `layer`, or an
/// empty list for paths without a known relation (then the record counts as
/// localized when it is the first to differ).
pub fn inputs_of(path: &str, layer: u32) -> Vec<InputSpec> {
    let Some(component) = producer(path) else {
        return Vec::new();
    };
    component
        .spec()
        .inputs
        .iter()
        .map(|input| match input.source {
            InputSource::SameLayer => same(input.component, layer),
            InputSource::LayerInput => layer_input(input, layer),
            InputSource::CarriedState => carried_state(layer),
            InputSource::StepInput => step_input(),
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The relation spelled out: the catalogue must produce exactly these
    /// lists (the mHC mixing, the cache read views and the carried state
    /// are inputs since issue 13).
    #[test]
    fn catalogue_inputs_match_the_table() {
        let s = |lv: Level, p: &str, layer: u32| InputSpec {
            level: lv,
            steps_back: 0,
            layer: Some(layer),
            same_position: true,
            path: p.into(),
            prefix: p.ends_with('.'),
        };
        let carried = |layer: u32| InputSpec {
            level: Level::L2,
            steps_back: 1,
            layer: Some(layer),
            same_position: false,
            path: "state.".into(),
            prefix: true,
        };
        let token_input = InputSpec {
            level: Level::L0,
            steps_back: 0,
            layer: None,
            same_position: false,
            path: "token.input".into(),
            prefix: false,
        };
        use Level::{L3, L4};
        let embed0 = InputSpec {
            level: L4,
            steps_back: 0,
            layer: None,
            same_position: true,
            path: "embed.output".into(),
            prefix: false,
        };
        assert_eq!(inputs_of("embed.output", 0), vec![token_input]);
        for p in ["attn.hc_pre_weights", "attn.hc_post_weights", "attn.hc_comb"] {
            assert_eq!(inputs_of(p, 0), vec![embed0.clone()], "{p}");
            assert_eq!(inputs_of(p, 3), vec![s(L3, "layer.post_ffn_mhc", 2)], "{p}");
        }
        assert_eq!(
            inputs_of("attn.hc_pre", 3),
            vec![s(L3, "layer.post_ffn_mhc", 2), s(L4, "attn.hc_pre_weights", 3)]
        );
        assert_eq!(
            inputs_of("layer.post_attn_mhc", 0),
            vec![
                embed0,
                s(L4, "attn.output", 0),
                s(L4, "attn.hc_post_weights", 0),
                s(L4, "attn.hc_comb", 0)
            ]
        );
        assert_eq!(
            inputs_of("attn.q", 4),
            vec![
                s(L4, "attn.norm", 4),
                s(L4, "attn.norm_fp8", 4),
                s(L4, "attn.q_lat_fp8", 4)
            ]
        );
        assert_eq!(
            inputs_of("attn.kv", 4),
            vec![s(L4, "attn.norm", 4), s(L4, "attn.norm_fp8", 4)]
        );
        // The quantization sites read the tensor they quantize.
        assert_eq!(inputs_of("attn.norm_fp8", 4), vec![s(L4, "attn.norm", 4)]);
        assert_eq!(inputs_of("attn.kv_fp8", 4), vec![s(L4, "attn.kv", 4)]);
        assert_eq!(inputs_of("attn.o_lat_fp8", 4), vec![s(L4, "attn.core", 4)]);
        assert_eq!(inputs_of("ffn.norm_fp8", 4), vec![s(L4, "ffn.norm", 4)]);
        assert_eq!(
            inputs_of("moe.shared_h_fp8", 4),
            vec![s(L4, "ffn.norm", 4), s(L4, "ffn.norm_fp8", 4)]
        );
        for p in ["attn.compressed", "attn.indexer_compressed"] {
            assert_eq!(inputs_of(p, 4), vec![s(L4, "attn.norm", 4), carried(4)], "{p}");
        }
        assert_eq!(
            inputs_of("attn.indexer_read", 2),
            vec![
                s(L4, "attn.indexer_compressed", 2),
                s(L4, "attn.indexer_compressed_fp4", 2),
                carried(2)
            ]
        );
        assert_eq!(
            inputs_of("attn.indexer_scores", 2),
            vec![
                s(L4, "attn.norm", 2),
                s(L4, "attn.indexer_read", 2),
                s(L4, "attn.indexer_q_fp4", 2)
            ]
        );
        assert_eq!(
            inputs_of("attn.indexer_topk", 2),
            vec![s(L4, "attn.indexer_scores", 2)]
        );
        assert_eq!(
            inputs_of("attn.window_read", 2),
            vec![s(L4, "attn.kv", 2), s(L4, "attn.kv_fp8", 2), carried(2)]
        );
        assert_eq!(
            inputs_of("attn.compressed_read", 2),
            vec![
                s(L4, "attn.compressed", 2),
                s(L4, "attn.compressed_fp8", 2),
                s(L4, "attn.indexer_topk", 2),
                carried(2)
            ]
        );
        assert_eq!(
            inputs_of("attn.core", 2),
            vec![
                s(L4, "attn.q", 2),
                s(L4, "attn.window_read", 2),
                s(L4, "attn.compressed_read", 2),
            ]
        );
        for p in ["ffn.hc_pre_weights", "ffn.hc_post_weights", "ffn.hc_comb"] {
            assert_eq!(inputs_of(p, 1), vec![s(L3, "layer.post_attn_mhc", 1)], "{p}");
        }
        assert_eq!(
            inputs_of("ffn.hc_pre", 1),
            vec![s(L3, "layer.post_attn_mhc", 1), s(L4, "ffn.hc_pre_weights", 1)]
        );
        assert_eq!(inputs_of("router.margin", 1), vec![s(L3, "router.scores", 1)]);
        assert_eq!(
            inputs_of("router.gates", 1),
            vec![s(L3, "router.scores", 1), s(L3, "router.topk", 1)]
        );
        assert_eq!(
            inputs_of("moe.combine", 5),
            vec![
                s(L4, "moe.term.", 5),
                s(L4, "moe.routed", 5),
                s(L4, "moe.shared", 5)
            ]
        );
        assert_eq!(inputs_of("moe.routed", 5), vec![s(L4, "moe.term.", 5)]);
        assert_eq!(
            inputs_of("moe.term.3", 5),
            vec![
                s(L4, "ffn.norm", 5),
                s(L4, "ffn.norm_fp8", 5),
                s(L3, "router.topk", 5),
                s(L3, "router.gates", 5),
                s(L4, "moe.term_h_fp8.", 5)
            ]
        );
        assert_eq!(
            inputs_of("layer.post_ffn_mhc", 5),
            vec![
                s(L3, "layer.post_attn_mhc", 5),
                s(L4, "moe.combine", 5),
                s(L4, "ffn.hc_post_weights", 5),
                s(L4, "ffn.hc_comb", 5)
            ]
        );
        assert!(inputs_of("lm.logits", 0).is_empty());
        assert!(inputs_of("state.window_kv", 0).is_empty());
        assert!(inputs_of("attn.custom", 0).is_empty());
        assert_eq!(inputs_of("moe.term.x", 1).len(), 5);
        assert_eq!(
            describe_input(&carried(4)),
            "state.* (layer 4, previous decode boundary)"
        );
        assert_eq!(half_of("layer.post_attn_mhc"), Some(Half::Attention));
        assert_eq!(half_of("moe.anything"), Some(Half::Ffn));
        assert_eq!(half_of("state.window_kv"), None);
        assert!(is_checkpoint("layer.post_ffn_mhc") && !is_checkpoint("router.topk"));
    }
}
