//! The fingerprint hash tree: records → layer groups → levels → steps → root.
//!
//! The tree lets a comparison descend only into subtrees whose digests
//! differ: two traces with equal roots are equivalent everywhere; otherwise
//! the first differing step, then level, then layer group, then record is
//! found by comparing a handful of 32-byte digests.
//!
//! Node preimages (wire encoding, see [`crate::wire`]):
//!
//! ```text
//! group = ("moeconf.group.v1", step u32, level u32, layer Option<u32>, Vec<[u8;32]> records)
//! level = ("moeconf.level.v1", step u32, level u32, Vec<[u8;32]> groups)
//! step  = ("moeconf.step.v1",  step u32, Vec<(level u32, [u8;32])> levels)
//! root  = ("moeconf.root.v1",  algorithm u32, binding [u8;32], Vec<(step u32, [u8;32])> steps)
//! binding digest = H("moeconf.binding.v1", Vec<u8> encoded binding)
//! ```
//!
//! Children are in canonical order: steps and levels ascending, groups by
//! layer (`None` first, then ascending), records by (position, phase, path).
//! The order in which a backend happened to emit records therefore does not
//! change any digest.

use crate::algorithm::{Algorithm, Digest, StreamHasher};
use crate::coord::{Coord, Level};
use crate::record::FingerprintError;
use crate::wire::Encoder;

/// Domain tag of layer-group nodes.
pub const DOMAIN_GROUP: &str = "moeconf.group.v1";
/// Domain tag of level nodes.
pub const DOMAIN_LEVEL: &str = "moeconf.level.v1";
/// Domain tag of step nodes.
pub const DOMAIN_STEP: &str = "moeconf.step.v1";
/// Domain tag of the root.
pub const DOMAIN_ROOT: &str = "moeconf.root.v1";
/// Domain tag of the binding digest.
pub const DOMAIN_BINDING: &str = "moeconf.binding.v1";

/// One record as the tree sees it.
#[derive(Debug, Clone, Copy)]
pub struct Leaf<'a> {
    pub coord: &'a Coord,
    pub level: Level,
    pub digest: Digest,
}

/// A layer group: the records of one (step, level, layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupNode {
    /// The layer, or `None` for model-global records.
    pub layer: Option<u32>,
    pub digest: Digest,
    /// Indices into the leaf slice given to [`HashTree::build`], in canonical order.
    pub records: Vec<usize>,
}

/// The records of one (step, level).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelNode {
    pub level: Level,
    pub digest: Digest,
    /// Its layer groups, `None` first then by layer.
    pub groups: Vec<GroupNode>,
}

/// The records of one forward step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepNode {
    pub step: u32,
    pub digest: Digest,
    /// Its levels, ascending.
    pub levels: Vec<LevelNode>,
}

/// The whole tree of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashTree {
    /// The root digest, which binds the binding digest and every record.
    pub root: Digest,
    /// The steps, ascending.
    pub steps: Vec<StepNode>,
}

/// Digest of an encoded binding.
pub fn binding_digest(alg: Algorithm, encoded_binding: &[u8]) -> Digest {
    let mut e = Encoder::new();
    e.str(DOMAIN_BINDING).bytes(encoded_binding);
    alg.hash(e.as_bytes())
}

fn hash_list(
    alg: Algorithm,
    e: &mut Encoder,
    items: impl ExactSizeIterator<Item = (Option<u32>, Digest)>,
) -> Digest {
    e.len(items.len());
    for (tag, d) in items {
        if let Some(t) = tag {
            e.u32(t);
        }
        e.raw(&d.0);
    }
    alg.hash(e.as_bytes())
}

/// Digest of a layer group: the records of one (step, level, layer), given
/// as their record digests in canonical order. The one definition of the
/// group preimage ([`group_prefix`], then the digests): [`HashTree::build`]
/// and the readers of persisted nodes (trace format version 2) both use it,
/// and format version 4's pages cut the same preimage
/// ([`crate::group_pages`]).
pub fn group_digest(
    alg: Algorithm,
    step: u32,
    level: Level,
    layer: Option<u32>,
    records: impl ExactSizeIterator<Item = Digest>,
) -> Digest {
    let mut e = Encoder::with_capacity(64 + 32 * records.len());
    e.raw(&group_prefix(step, level, layer, records.len() as u64));
    for d in records {
        e.raw(&d.0);
    }
    alg.hash(e.as_bytes())
}

/// The bytes of a layer group's preimage before its record digests: the
/// domain tag, step, level, layer and the number of records (the length of
/// the digest list).
pub fn group_prefix(step: u32, level: Level, layer: Option<u32>, records: u64) -> Vec<u8> {
    let mut e = Encoder::with_capacity(48);
    e.str(DOMAIN_GROUP)
        .u32(step)
        .u32(level.code())
        .opt_u32(layer)
        .u64(records);
    e.into_bytes()
}

/// Digest of a level node: its group digests in canonical order (layer
/// `None` first, then ascending).
pub fn level_digest(
    alg: Algorithm,
    step: u32,
    level: Level,
    groups: impl ExactSizeIterator<Item = Digest>,
) -> Digest {
    let mut e = Encoder::with_capacity(64 + 32 * groups.len());
    e.str(DOMAIN_LEVEL).u32(step).u32(level.code());
    hash_list(alg, &mut e, groups.map(|d| (None, d)))
}

/// Digest of a step node: its levels (ascending) with their digests.
pub fn step_digest(
    alg: Algorithm,
    step: u32,
    levels: impl ExactSizeIterator<Item = (Level, Digest)>,
) -> Digest {
    let mut e = Encoder::with_capacity(64 + 36 * levels.len());
    e.str(DOMAIN_STEP).u32(step);
    hash_list(alg, &mut e, levels.map(|(l, d)| (Some(l.code()), d)))
}

/// The root: the algorithm, the binding digest and the steps (ascending)
/// with their digests.
pub fn root_digest(
    alg: Algorithm,
    binding: Digest,
    steps: impl ExactSizeIterator<Item = (u32, Digest)>,
) -> Digest {
    let mut h = RootHasher::new(alg, binding, steps.len() as u64);
    for (step, digest) in steps {
        h.push(step, digest);
    }
    h.finish()
}

/// [`root_digest`] fed one step at a time, for a writer that does not keep
/// every step's digest in memory. The caller says the number of steps up
/// front (it is part of the preimage) and pushes exactly that many. The
/// preimage goes to the hash in pieces of whole 1 KiB chunks (so BLAKE3
/// hashes them in parallel, as it does a one-shot input), at most
/// [`RootHasher::PIECE`] bytes held at a time.
pub struct RootHasher {
    h: StreamHasher,
    buf: Vec<u8>,
}

impl RootHasher {
    /// Bytes of preimage held before they are hashed.
    pub const PIECE: usize = 64 * 1024;

    /// Starts the root of `steps` steps under `binding`.
    pub fn new(alg: Algorithm, binding: Digest, steps: u64) -> RootHasher {
        let mut e = Encoder::with_capacity(96);
        e.str(DOMAIN_ROOT).u32(alg.code()).raw(&binding.0).u64(steps);
        let mut buf = Vec::with_capacity(Self::PIECE + 36);
        buf.extend_from_slice(e.as_bytes());
        RootHasher { h: alg.hasher(), buf }
    }

    /// The next step (ascending) and its digest.
    pub fn push(&mut self, step: u32, digest: Digest) {
        self.buf.extend_from_slice(&step.to_le_bytes());
        self.buf.extend_from_slice(&digest.0);
        if self.buf.len() >= Self::PIECE {
            let whole = self.buf.len() / 1024 * 1024;
            self.h.update(&self.buf[..whole]);
            self.buf.drain(..whole);
        }
    }

    /// The root digest.
    pub fn finish(mut self) -> Digest {
        self.h.update(&self.buf);
        self.h.finalize()
    }
}

impl HashTree {
    /// Builds the tree over `leaves`. Fails on two records with the same
    /// level and coordinate.
    pub fn build(alg: Algorithm, binding: Digest, leaves: &[Leaf<'_>]) -> Result<HashTree, FingerprintError> {
        HashTree::build_with(alg, binding, leaves.len(), |i| leaves[i])
    }

    /// Builds the tree over the `n` leaves `leaf(0)`, …, `leaf(n - 1)`
    /// without collecting them (a reader builds them from its index
    /// entries). The same tree as [`HashTree::build`] of the collected
    /// leaves.
    pub fn build_with<'a>(
        alg: Algorithm,
        binding: Digest,
        n: usize,
        leaf: impl Fn(usize) -> Leaf<'a>,
    ) -> Result<HashTree, FingerprintError> {
        // Sort by (step, level, layer, position, phase) packed into one
        // integer, comparing paths only on ties: opening a trace builds this
        // tree, so it is on the hot path of every diff.
        let packed = |l: &Leaf<'_>| -> u128 {
            let layer = l.coord.layer.map_or(0u128, |x| u128::from(x) + 1);
            (u128::from(l.coord.step) << 96)
                | (u128::from(l.level.code()) << 88)
                | (layer << 48)
                | (u128::from(l.coord.position) << 8)
                | l.coord.phase as u128
        };
        let keys: Vec<u128> = (0..n).map(|i| packed(&leaf(i))).collect();
        let cmp = |a: &usize, b: &usize| {
            keys[*a]
                .cmp(&keys[*b])
                .then_with(|| leaf(*a).coord.path.cmp(&leaf(*b).coord.path))
        };
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by(cmp);
        for w in order.windows(2) {
            if cmp(&w[0], &w[1]) == std::cmp::Ordering::Equal {
                let l = leaf(w[1]);
                return Err(FingerprintError::DuplicateRecord {
                    coord: l.coord.to_string(),
                    level: l.level,
                });
            }
        }
        let mut steps: Vec<StepNode> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let step = leaf(order[i]).coord.step;
            let mut levels = Vec::new();
            while i < order.len() && leaf(order[i]).coord.step == step {
                let level = leaf(order[i]).level;
                let mut groups = Vec::new();
                while i < order.len() && leaf(order[i]).coord.step == step && leaf(order[i]).level == level {
                    let layer = leaf(order[i]).coord.layer;
                    let start = i;
                    while i < order.len()
                        && leaf(order[i]).coord.step == step
                        && leaf(order[i]).level == level
                        && leaf(order[i]).coord.layer == layer
                    {
                        i += 1;
                    }
                    // Exactly sized: one index per record, no growth slack.
                    let records = order[start..i].to_vec();
                    let digest =
                        group_digest(alg, step, level, layer, records.iter().map(|&r| leaf(r).digest));
                    groups.push(GroupNode {
                        layer,
                        digest,
                        records,
                    });
                }
                let digest = level_digest(alg, step, level, groups.iter().map(|g| g.digest));
                levels.push(LevelNode {
                    level,
                    digest,
                    groups,
                });
            }
            let digest = step_digest(alg, step, levels.iter().map(|l| (l.level, l.digest)));
            steps.push(StepNode { step, digest, levels });
        }
        let root = root_digest(alg, binding, steps.iter().map(|s| (s.step, s.digest)));
        Ok(HashTree { root, steps })
    }

    /// The step node with index `step`, if present.
    pub fn step(&self, step: u32) -> Option<&StepNode> {
        self.steps
            .binary_search_by_key(&step, |s| s.step)
            .ok()
            .map(|i| &self.steps[i])
    }
}

impl StepNode {
    /// The level node for `level`, if present.
    pub fn level(&self, level: Level) -> Option<&LevelNode> {
        self.levels.iter().find(|l| l.level == level)
    }
}

impl LevelNode {
    /// The group for `layer`, if present.
    pub fn group(&self, layer: Option<u32>) -> Option<&GroupNode> {
        self.groups.iter().find(|g| g.layer == layer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coord::Phase;

    fn c(step: u32, layer: Option<u32>, path: &str) -> Coord {
        Coord {
            step,
            position: step,
            phase: Phase::Decode,
            layer,
            path: path.into(),
        }
    }

    #[test]
    fn the_root_fed_step_by_step_is_the_spec_preimage_hashed() {
        // docs/format.md §4.3: H(str("moeconf.root.v1") ‖ alg ‖ binding ‖ len ‖ (step ‖ digest)*),
        // written out here byte by byte rather than through the encoder.
        for alg in [Algorithm::Blake3, Algorithm::Sha256] {
            for n in [0u32, 1, 3, 1000, 5000] {
                let binding = Digest([7; 32]);
                let steps: Vec<(u32, Digest)> = (0..n).map(|s| (2 * s + 1, Digest([s as u8; 32]))).collect();
                let mut pre = Vec::new();
                pre.extend_from_slice(&(DOMAIN_ROOT.len() as u64).to_le_bytes());
                pre.extend_from_slice(DOMAIN_ROOT.as_bytes());
                pre.extend_from_slice(&alg.code().to_le_bytes());
                pre.extend_from_slice(&binding.0);
                pre.extend_from_slice(&u64::from(n).to_le_bytes());
                for (s, d) in &steps {
                    pre.extend_from_slice(&s.to_le_bytes());
                    pre.extend_from_slice(&d.0);
                }
                let want = alg.hash(&pre);
                assert_eq!(root_digest(alg, binding, steps.iter().copied()), want);
                let mut h = RootHasher::new(alg, binding, u64::from(n));
                steps.iter().for_each(|&(s, d)| h.push(s, d));
                assert_eq!(h.finish(), want);
            }
        }
    }

    #[test]
    fn emission_order_does_not_matter_and_content_does() {
        let coords = [
            c(0, None, "token"),
            c(0, Some(1), "x"),
            c(1, Some(0), "x"),
            c(0, Some(0), "x"),
        ];
        let alg = Algorithm::Blake3;
        let leaves: Vec<Leaf> = coords
            .iter()
            .enumerate()
            .map(|(i, co)| Leaf {
                coord: co,
                level: Level::L3,
                digest: alg.hash(&[i as u8]),
            })
            .collect();
        let b = binding_digest(alg, b"binding");
        let t1 = HashTree::build(alg, b, &leaves).unwrap();
        let mut rev = leaves.clone();
        rev.reverse();
        let t2 = HashTree::build(alg, b, &rev).unwrap();
        assert_eq!(t1.root, t2.root);
        assert_eq!(t1.steps.len(), 2);
        assert_eq!(t1.steps[0].levels[0].groups.len(), 3);
        assert_eq!(t1.steps[0].levels[0].groups[0].layer, None);

        let mut changed = leaves.clone();
        changed[2].digest = alg.hash(b"other");
        let t3 = HashTree::build(alg, b, &changed).unwrap();
        assert_ne!(t3.root, t1.root);
        assert_eq!(
            t3.steps[0].digest, t1.steps[0].digest,
            "untouched step keeps its digest"
        );
        assert_ne!(t3.steps[1].digest, t1.steps[1].digest);

        let t4 = HashTree::build(alg, binding_digest(alg, b"other"), &leaves).unwrap();
        assert_ne!(t4.root, t1.root, "root binds the binding");

        let mut dup = leaves.clone();
        dup.push(leaves[0]);
        assert!(HashTree::build(alg, b, &dup).is_err());
    }
}
