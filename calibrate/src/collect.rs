//! An in-memory capture sink that keeps the records of chosen catalogue
//! components, and the comparisons the protocols make on them.

use moeconf_fingerprint::{Component, Coord, Level, LevelSet, TensorView};
use moeconf_reference_runtime::capture::{CaptureError, CaptureSink};

/// One captured record kept by a [`Collect`] sink.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    pub coord: Coord,
    /// Element bytes (little-endian).
    pub bytes: Vec<u8>,
}

impl Kept {
    /// The elements as FP32.
    pub fn f32s(&self) -> Vec<f32> {
        self.bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The elements as I32.
    pub fn i32s(&self) -> Vec<i32> {
        self.bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Whether `other` is at the same step, position and layer (any component).
    pub fn same_site(&self, other: &Kept) -> bool {
        self.coord.step == other.coord.step
            && self.coord.position == other.coord.position
            && self.coord.layer == other.coord.layer
    }
}

/// A capture sink that keeps the records of a list of catalogue components
/// (every member of a family such as `moe.term.J`), in emission order.
pub struct Collect {
    keep: Vec<Component>,
    levels: LevelSet,
    /// The kept records, in emission order.
    pub kept: Vec<Kept>,
}

impl Collect {
    /// Keeps the records of `components`; captures L0–L3 always and L4 only
    /// when a kept component is L4 (L4 records cost the most to build).
    pub fn new(components: &[Component]) -> Collect {
        let mut levels: LevelSet = [Level::L0, Level::L1, Level::L2, Level::L3].into_iter().collect();
        if components.iter().any(|c| c.level() == Level::L4) {
            levels.insert(Level::L4);
        }
        Collect {
            keep: components.to_vec(),
            levels,
            kept: Vec::new(),
        }
    }

    /// Keeps every component of `level` (e.g. the whole persistent state, L2)
    /// besides `components`.
    pub fn with_level(components: &[Component], level: Level) -> Collect {
        let mut all = components.to_vec();
        all.extend(Component::of_level(level));
        Collect::new(&all)
    }

    fn keeps(&self, path: &str) -> bool {
        self.keep.iter().any(|c| c.matches(path))
    }

    /// Kept records of `component` (every member of a family), in order.
    pub fn of(&self, component: Component) -> impl Iterator<Item = &Kept> + '_ {
        self.kept.iter().filter(move |k| component.matches(&k.coord.path))
    }

    /// The one kept record of `component` at (step, layer), the last position if several.
    pub fn at(&self, component: Component, step: u32, layer: Option<u32>) -> Option<&Kept> {
        self.at_path(component.path(), step, layer)
    }

    /// The one kept record of family member `component.index` at (step,
    /// layer), the last position if several.
    pub fn at_member(
        &self,
        component: Component,
        index: u32,
        step: u32,
        layer: Option<u32>,
    ) -> Option<&Kept> {
        self.at_path(&component.indexed_path(index), step, layer)
    }

    fn at_path(&self, path: &str, step: u32, layer: Option<u32>) -> Option<&Kept> {
        self.kept
            .iter()
            .rev()
            .find(|k| k.coord.path == path && k.coord.step == step && k.coord.layer == layer)
    }

    /// The kept record of `component` at the step, position and layer of `site`.
    pub fn at_site(&self, component: Component, site: &Kept) -> Option<&Kept> {
        self.of(component).find(|x| x.same_site(site))
    }
}

impl CaptureSink for Collect {
    fn wants(&self, level: Level) -> bool {
        self.levels.contains(level)
    }

    fn record(&mut self, coord: Coord, _level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        if self.keeps(&coord.path) {
            self.kept.push(Kept {
                coord,
                bytes: tensor.bytes.to_vec(),
            });
        }
        Ok(())
    }
}

/// How many of a set of paired records (or other items) are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    /// Items that compare equal.
    pub equal: usize,
    /// Items compared (a record missing on one side counts as unequal).
    pub total: usize,
}

impl Tally {
    /// Whether every compared item is equal.
    pub fn all(self) -> bool {
        self.equal == self.total
    }

    /// `equal/total`.
    pub fn frac(self) -> String {
        crate::report::frac(self.equal, self.total)
    }
}

/// Pairs the records of `component` in two runs in emission order (only
/// those `select` keeps) and counts the pairs equal in coordinate and bytes.
pub fn compare_records(
    a: &Collect,
    b: &Collect,
    component: Component,
    select: impl Fn(&Kept) -> bool,
) -> Tally {
    let pick = |c: &Collect| -> Vec<Kept> { c.of(component).filter(|k| select(k)).cloned().collect() };
    let (x, y) = (pick(a), pick(b));
    let equal = x
        .iter()
        .zip(&y)
        .filter(|(p, q)| p.coord == q.coord && p.bytes == q.bytes)
        .count();
    Tally {
        equal,
        total: x.len().max(y.len()),
    }
}

/// Largest |a − b| over two FP32 vectors (NaN-free inputs; lengths must match,
/// otherwise +∞).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

/// Whether two FP32 slices are bitwise identical.
pub fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::{DType, Phase};

    fn record(c: &mut Collect, path: &str, level: Level, step: u32, value: f32) {
        let coord = Coord {
            step,
            position: step,
            phase: Phase::Decode,
            layer: Some(0),
            path: path.into(),
        };
        let bytes = value.to_le_bytes();
        let t = TensorView {
            dtype: DType::F32,
            shape: &[1],
            bytes: &bytes,
        };
        c.record(coord, level, t).unwrap();
    }

    #[test]
    fn keeps_chosen_components_and_family_members() {
        let mut c = Collect::with_level(&[Component::MoeTerm], Level::L2);
        assert!(c.wants(Level::L4) && c.wants(Level::L2));
        record(&mut c, "moe.term.3", Level::L4, 1, 1.0);
        record(&mut c, "moe.shared", Level::L4, 1, 2.0);
        record(&mut c, "state.window_kv", Level::L2, 1, 3.0);
        record(&mut c, "state.indexer.overlap_gate", Level::L2, 1, 4.0);
        assert_eq!(c.kept.len(), 3);
        assert_eq!(c.of(Component::MoeTerm).count(), 1);
        let t = c.at_member(Component::MoeTerm, 3, 1, Some(0)).unwrap();
        assert_eq!(t.f32s(), vec![1.0]);
        assert!(c.at_member(Component::MoeTerm, 2, 1, Some(0)).is_none());
        assert!(!Collect::new(&[Component::RouterTopk]).wants(Level::L4));
    }

    #[test]
    fn compare_records_counts_missing_as_unequal() {
        let (mut a, mut b) = (
            Collect::new(&[Component::RouterScores]),
            Collect::new(&[Component::RouterScores]),
        );
        for step in 0..3 {
            record(&mut a, "router.scores", Level::L3, step, step as f32);
        }
        record(&mut b, "router.scores", Level::L3, 0, 0.0);
        record(&mut b, "router.scores", Level::L3, 1, 9.0);
        let t = compare_records(&a, &b, Component::RouterScores, |_| true);
        assert_eq!(t, Tally { equal: 1, total: 3 });
        assert!(!t.all());
        assert_eq!(t.frac(), "1/3");
        let later = compare_records(&a, &b, Component::RouterScores, |k| k.coord.step >= 2);
        assert_eq!(later, Tally { equal: 0, total: 1 });
    }

    #[test]
    fn max_abs_diff_and_bitwise_eq() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]), 0.5);
        assert_eq!(max_abs_diff(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert!(bitwise_eq(&[0.0], &[0.0]));
        assert!(!bitwise_eq(&[0.0], &[-0.0]));
    }
}
