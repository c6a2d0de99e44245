//! The kind of a decoder layer (attention: sliding window, CSA or HCA; MLP:
//! score-routed or hash-routed), inferred from which catalogue records the
//! traces hold at that layer: a record that exists rules out the kinds that
//! lack it, and a record that is emitted at every position
//! ([`Presence::Always`]) of a compared level and is absent rules out the
//! kinds that have it. Traces do not bind the model's configuration, so
//! this is how the report tells "not applicable on this layer kind" from
//! "not captured", and names hash-routed layers.

use crate::report::LayerKind;
use crate::walk::Sides;
use moeconf_fingerprint::catalogue::{AttentionKind, FfnKind, Presence};
use moeconf_fingerprint::{Component, Level, LevelSet};
use std::collections::HashSet;

const ATTENTION: [AttentionKind; 3] = [AttentionKind::Sliding, AttentionKind::Csa, AttentionKind::Hca];
const FFN: [FfnKind; 2] = [FfnKind::Moe, FfnKind::HashMoe];

/// The layer kinds consistent with what the traces hold at one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kinds {
    possible: Vec<(AttentionKind, FfnKind)>,
}

impl Kinds {
    /// Whether `component` exists on this layer: `Some(false)` when no
    /// consistent kind has it, `Some(true)` when every one does, `None`
    /// when the kinds disagree or nothing is consistent.
    pub fn has(&self, component: Component) -> Option<bool> {
        if self.possible.is_empty() {
            return None;
        }
        let layers = component.spec().layers;
        let n = self
            .possible
            .iter()
            .filter(|&&(a, f)| layers.contains(a, f))
            .count();
        match n {
            0 => Some(false),
            n if n == self.possible.len() => Some(true),
            _ => None,
        }
    }

    /// Whether the layer is hash-routed, when the records tell.
    pub fn hash_routed(&self) -> Option<bool> {
        self.ffn().map(|f| f == FfnKind::HashMoe)
    }

    fn attention(&self) -> Option<AttentionKind> {
        let first = self.possible.first()?.0;
        self.possible.iter().all(|p| p.0 == first).then_some(first)
    }

    fn ffn(&self) -> Option<FfnKind> {
        let first = self.possible.first()?.1;
        self.possible.iter().all(|p| p.1 == first).then_some(first)
    }

    /// The report's form (`None` when neither half is known).
    pub fn report(&self) -> Option<LayerKind> {
        let attention = self.attention().map(|a| {
            match a {
                AttentionKind::Sliding => "sliding",
                AttentionKind::Csa => "csa",
                AttentionKind::Hca => "hca",
            }
            .to_string()
        });
        let ffn = self.ffn().map(|f| {
            match f {
                FfnKind::Moe => "score_routed",
                FfnKind::HashMoe => "hash_routed",
            }
            .to_string()
        });
        (attention.is_some() || ffn.is_some()).then_some(LayerKind { attention, ffn })
    }
}

/// The group of `layer` at `level` of a step node.
fn group_of(
    n: Option<&moeconf_schema::StepNode>,
    level: Level,
    layer: u32,
) -> Option<&moeconf_schema::GroupNode> {
    n.and_then(|n| n.level(level)).and_then(|l| l.group(Some(layer)))
}

/// The kinds of `layer` consistent with the records both traces hold at
/// `step` (levels in `compared` only).
pub(crate) fn infer(s: &Sides<'_>, step: u32, layer: u32, compared: LevelSet) -> Kinds {
    let mut present: HashSet<Component> = HashSet::new();
    let mut add = |path: &str| {
        if let Some((c, _)) = Component::parse(path) {
            present.insert(c);
        }
    };
    let (rn, cn) = (s.step_node(s.r, step), s.step_node(s.c, step));
    for level in [Level::L2, Level::L3, Level::L4] {
        if !compared.contains(level) {
            continue;
        }
        let (rg, cg) = (group_of(rn, level, layer), group_of(cn, level, layer));
        // Which paths the groups hold, from the records at each group's
        // first position: a record present at every position of its layer
        // kind ([`Presence::Always`]) is there, and those alone tell the
        // kinds apart (`always_records_alone_tell_every_kind`), so the read
        // does not grow with the group (a paged group reads its first page
        // or two). The candidate's group is read only where it can hold
        // another path: nowhere when the digests are equal; its records in
        // the pages that differ when both are paged alike (read by the walk
        // anyway); else at its own first position.
        if let Some(g) = rg {
            for p in s.group_first_position_paths(s.r, g) {
                add(&p);
            }
        }
        match (rg, cg) {
            (Some(a), Some(b)) if a.digest == b.digest => {}
            // Paged alike: the candidate's records outside the differing
            // pages are the reference's, at the same places, so its first
            // position holds no path that is not at the reference's or in
            // those pages.
            (a, Some(b)) => match a.and_then(|a| s.differing_page_records(a, b)) {
                Some(records) => {
                    for (_, e) in records {
                        add(&e.coord.path);
                    }
                }
                None => {
                    for p in s.group_first_position_paths(s.c, b) {
                        add(&p);
                    }
                }
            },
            _ => {}
        }
    }
    kinds_of(&present)
}

/// The kinds consistent with the components `present` at a layer: each
/// holds every present one, and every record it would hold at every
/// position, at a level some present record is at, is present.
fn kinds_of(present: &HashSet<Component>) -> Kinds {
    if present.is_empty() {
        return Kinds { possible: Vec::new() };
    }
    let levels_seen: HashSet<Level> = present.iter().map(|c| c.level()).collect();
    let mut possible = Vec::new();
    for a in ATTENTION {
        for f in FFN {
            let holds_every_present = present.iter().all(|c| c.spec().layers.contains(a, f));
            // Every record this kind would hold at every position, at a level
            // the traces hold here, is present.
            let lacks_none = Component::ALL.iter().all(|c| {
                let spec = c.spec();
                spec.half.is_none() && spec.level != Level::L2
                    || spec.presence != Presence::Always
                    || !levels_seen.contains(&spec.level)
                    || !spec.layers.contains(a, f)
                    || present.contains(c)
            });
            if holds_every_present && lacks_none {
                possible.push((a, f));
            }
        }
    }
    Kinds { possible }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_records_rule_kinds_out_and_present_ones_rule_kinds_in() {
        let k = Kinds {
            possible: vec![(AttentionKind::Sliding, FfnKind::HashMoe)],
        };
        assert_eq!(k.has(Component::AttnCompressedRead), Some(false));
        assert_eq!(k.has(Component::AttnWindowRead), Some(true));
        assert_eq!(k.has(Component::RouterMargin), Some(false));
        assert_eq!(k.hash_routed(), Some(true));
        let both = Kinds {
            possible: vec![
                (AttentionKind::Csa, FfnKind::Moe),
                (AttentionKind::Hca, FfnKind::Moe),
            ],
        };
        assert_eq!(both.has(Component::AttnIndexerTopk), None);
        assert_eq!(both.has(Component::AttnCompressedRead), Some(true));
        let r = both.report().unwrap();
        assert_eq!((r.attention, r.ffn.as_deref()), (None, Some("score_routed")));
        assert_eq!(Kinds { possible: vec![] }.has(Component::AttnQ), None);
    }

    /// What `infer` relies on to read only a group's first position: the
    /// records every position holds ([`Presence::Always`]) give the same
    /// kinds as those plus the records only some positions hold (a
    /// compressor's entries, [`Presence::OnEmit`]), for every kind and every
    /// set of compared levels, with or without the records present at every
    /// coordinate when at all (capture-only values, quantization sites).
    #[test]
    fn always_records_alone_tell_every_kind() {
        let levels = [Level::L2, Level::L3, Level::L4];
        let mut checked = 0;
        for a in ATTENTION {
            for f in FFN {
                for mask in 1u8..8 {
                    let at = |c: &Component| {
                        let spec = c.spec();
                        spec.layers.contains(a, f)
                            && levels
                                .iter()
                                .enumerate()
                                .any(|(i, &l)| mask & (1 << i) != 0 && spec.level == l)
                    };
                    let with = |ps: &[Presence]| -> HashSet<Component> {
                        Component::ALL
                            .iter()
                            .copied()
                            .filter(|c| at(c) && ps.contains(&c.spec().presence))
                            .collect()
                    };
                    for extra in [&[][..], &[Presence::CaptureOnly, Presence::Quantized][..]] {
                        let first: Vec<Presence> = [Presence::Always].iter().chain(extra).copied().collect();
                        let every: Vec<Presence> = first
                            .iter()
                            .chain(&[Presence::OnEmit, Presence::QuantizedOnEmit])
                            .copied()
                            .collect();
                        let (k1, k2) = (kinds_of(&with(&first)), kinds_of(&with(&every)));
                        assert_eq!(k1, k2, "{a:?} {f:?} levels {mask:03b} {extra:?}");
                        // The kind itself is among them (nothing rules it out).
                        assert!(
                            k1.possible.is_empty() || k1.possible.contains(&(a, f)),
                            "{a:?} {f:?} levels {mask:03b}: {k1:?}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 6 * 7 * 2);
        // The OnEmit rows are really there (the check compares something).
        assert!(Component::ALL
            .iter()
            .any(|c| c.spec().presence.is_on_emit()
                && c.spec().layers.contains(AttentionKind::Hca, FfnKind::Moe)));
    }
}
