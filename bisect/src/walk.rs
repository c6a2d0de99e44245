//! Descent of the two hash trees: only subtrees whose digests differ are
//! entered, so an unchanged step costs one 32-byte comparison and no record,
//! payload or tensor byte is touched.

use moeconf_fingerprint::catalogue::ExecKey;
use moeconf_fingerprint::{Component, Level, LevelNode, StepNode};
use moeconf_schema::{IndexEntry, Trace};
use std::cmp::Ordering;

/// One record position in the comparison: the index of the record in the
/// reference and in the candidate (`None` when that side lacks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Pair {
    /// Index into the reference's records.
    pub r: Option<usize>,
    /// Index into the candidate's records.
    pub c: Option<usize>,
}

impl Pair {
    /// Write-order key: the reference's record index (its write order),
    /// records only the candidate has last, in the candidate's order.
    pub fn order_key(&self) -> (usize, usize) {
        (self.r.unwrap_or(usize::MAX), self.c.unwrap_or(usize::MAX))
    }
}

/// Both traces, side by side.
pub(crate) struct Sides<'a> {
    pub r: &'a Trace,
    pub c: &'a Trace,
}

fn tree_key(e: &IndexEntry) -> (u32, moeconf_fingerprint::Phase, &str) {
    (e.coord.position, e.coord.phase, e.coord.path.as_str())
}

impl<'a> Sides<'a> {
    /// The union of step numbers of both trees, ascending.
    pub fn steps(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .r
            .tree()
            .steps
            .iter()
            .chain(&self.c.tree().steps)
            .map(|s| s.step)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn step_nodes(&self, step: u32) -> (Option<&'a StepNode>, Option<&'a StepNode>) {
        (self.r.tree().step(step), self.c.tree().step(step))
    }

    fn level_nodes(&self, step: u32, level: Level) -> (Option<&'a LevelNode>, Option<&'a LevelNode>) {
        let (rs, cs) = self.step_nodes(step);
        (rs.and_then(|s| s.level(level)), cs.and_then(|s| s.level(level)))
    }

    /// Whether anything differs at `step`: the step digests differ, or only
    /// one trace holds the step.
    pub fn step_differs(&self, step: u32) -> bool {
        match self.step_nodes(step) {
            (Some(a), Some(b)) => a.digest != b.digest,
            (None, None) => false,
            _ => true,
        }
    }

    /// Whether `level` differs at `step` (a level present on one side only differs).
    pub fn level_differs(&self, step: u32, level: Level) -> bool {
        let (rs, cs) = self.step_nodes(step);
        if let (Some(a), Some(b)) = (rs, cs) {
            if a.digest == b.digest {
                return false;
            }
        }
        match self.level_nodes(step, level) {
            (None, None) => false,
            (Some(a), Some(b)) => a.digest != b.digest,
            _ => true,
        }
    }

    /// Steps (ascending) at which `level` differs.
    pub fn differing_steps(&self, level: Level) -> Vec<u32> {
        self.steps()
            .into_iter()
            .filter(|&s| self.level_differs(s, level))
            .collect()
    }

    /// The catalogue's execution-order key of a pair ([`ExecKey`], from the
    /// side that holds the record), then its write order.
    pub fn exec_key(&self, p: Pair) -> (Option<ExecKey>, (usize, usize)) {
        (self.entry(p).map(|e| ExecKey::of(&e.coord)), p.order_key())
    }

    /// The differing records of `level` at `step`, in the catalogue's
    /// execution order ([`Sides::exec_key`]). Descends only into layer
    /// groups whose digests differ.
    pub fn differing_records(&self, step: u32, level: Level) -> Vec<Pair> {
        let (rl, cl) = self.level_nodes(step, level);
        let rg = rl.map(|l| l.groups.as_slice()).unwrap_or(&[]);
        let cg = cl.map(|l| l.groups.as_slice()).unwrap_or(&[]);
        let mut out = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < rg.len() || j < cg.len() {
            let ord = match (rg.get(i), cg.get(j)) {
                (Some(a), Some(b)) => a.layer.cmp(&b.layer),
                (Some(_), None) => Ordering::Less,
                _ => Ordering::Greater,
            };
            match ord {
                Ordering::Less => {
                    out.extend(rg[i].records.iter().map(|&r| Pair { r: Some(r), c: None }));
                    i += 1;
                }
                Ordering::Greater => {
                    out.extend(cg[j].records.iter().map(|&c| Pair { r: None, c: Some(c) }));
                    j += 1;
                }
                Ordering::Equal => {
                    if rg[i].digest != cg[j].digest {
                        self.merge_records(&rg[i].records, &cg[j].records, &mut out);
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        out.sort_by_cached_key(|&p| self.exec_key(p));
        out
    }

    fn merge_records(&self, ra: &[usize], ca: &[usize], out: &mut Vec<Pair>) {
        let (re, ce) = (self.r.records(), self.c.records());
        self.merge_join(ra, ca, out, |a, b| {
            re[a].digest != ce[b].digest || re[a].dtype != ce[b].dtype || re[a].shape != ce[b].shape
        });
    }

    /// Merge-joins two record lists sorted in tree order: records present on
    /// one side only are always emitted; records on both sides are emitted
    /// when `keep_pair` says so.
    fn merge_join(
        &self,
        ra: &[usize],
        ca: &[usize],
        out: &mut Vec<Pair>,
        keep_pair: impl Fn(usize, usize) -> bool,
    ) {
        let (re, ce) = (self.r.records(), self.c.records());
        let (mut i, mut j) = (0, 0);
        while i < ra.len() || j < ca.len() {
            let ord = match (ra.get(i), ca.get(j)) {
                (Some(&a), Some(&b)) => tree_key(&re[a]).cmp(&tree_key(&ce[b])),
                (Some(_), None) => Ordering::Less,
                _ => Ordering::Greater,
            };
            match ord {
                Ordering::Less => {
                    out.push(Pair {
                        r: Some(ra[i]),
                        c: None,
                    });
                    i += 1;
                }
                Ordering::Greater => {
                    out.push(Pair {
                        r: None,
                        c: Some(ca[j]),
                    });
                    j += 1;
                }
                Ordering::Equal => {
                    let (a, b) = (ra[i], ca[j]);
                    if keep_pair(a, b) {
                        out.push(Pair {
                            r: Some(a),
                            c: Some(b),
                        });
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
    }

    /// The coordinate-matched records of both traces: records of `level` at
    /// `step` in `layer` with this `path` (or path prefix), optionally at one
    /// position, paired by (position, phase, path).
    pub fn lookup(
        &self,
        step: u32,
        level: Level,
        layer: Option<u32>,
        position: Option<u32>,
        path: &str,
        prefix: bool,
    ) -> Vec<Pair> {
        let pick = |t: &'a Trace| -> Vec<usize> {
            let Some(g) = t
                .tree()
                .step(step)
                .and_then(|s| s.level(level))
                .and_then(|l| l.group(layer))
            else {
                return Vec::new();
            };
            g.records
                .iter()
                .copied()
                .filter(|&i| {
                    let e = &t.records()[i];
                    position.is_none_or(|p| e.coord.position == p)
                        && if prefix {
                            e.coord.path.starts_with(path)
                        } else {
                            e.coord.path == path
                        }
                })
                .collect()
        };
        let (ra, ca) = (pick(self.r), pick(self.c));
        let mut out = Vec::new();
        self.merge_join(&ra, &ca, &mut out, |_, _| true);
        out
    }

    /// [`Sides::lookup`] of a catalogue component: its records (every member
    /// of a family) at the catalogue's level.
    pub fn lookup_component(
        &self,
        step: u32,
        layer: Option<u32>,
        position: Option<u32>,
        component: Component,
    ) -> Vec<Pair> {
        self.lookup(
            step,
            component.level(),
            layer,
            position,
            component.path(),
            component.is_family(),
        )
    }

    /// Whether both sides hold the record and their digests are equal.
    pub fn pair_equal(&self, p: Pair) -> bool {
        match (p.r, p.c) {
            (Some(a), Some(b)) => self.r.records()[a].digest == self.c.records()[b].digest,
            _ => false,
        }
    }

    /// The entry of a pair on whichever side has it (reference first).
    pub fn entry(&self, p: Pair) -> Option<&'a IndexEntry> {
        p.r.map(|i| &self.r.records()[i])
            .or_else(|| p.c.map(|i| &self.c.records()[i]))
    }
}
