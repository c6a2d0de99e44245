//! Tensor identity: where in an execution a recorded tensor belongs.

use crate::wire::{Decoder, Encoder, WireError};
use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Longest component path accepted, in bytes.
pub const MAX_PATH_LEN: usize = 128;

/// Whether a forward processes the prompt or one generated token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u32)]
pub enum Phase {
    /// The prompt forward (step 0).
    Prefill = 0,
    /// A token-by-token decode forward (steps 1, 2, ...).
    Decode = 1,
}

impl Phase {
    /// Lowercase name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// The L0–L4 conformance hierarchy of the paper (section 4.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[repr(u32)]
pub enum Level {
    /// Tokens and text: visible behavioural divergence.
    L0 = 0,
    /// Logits and top-k margins: pre-token decision divergence.
    L1 = 1,
    /// Full persistent state at a decode boundary: cross-token divergence.
    L2 = 2,
    /// Layer-indexed post-attention / post-mHC state and routes.
    L3 = 3,
    /// Operator intermediates: the divergent operator or contract.
    L4 = 4,
}

impl Level {
    /// Every level, in order.
    pub const ALL: [Level; 5] = [Level::L0, Level::L1, Level::L2, Level::L3, Level::L4];

    /// The stable wire code (0–4).
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The level with the given code, if any.
    pub fn from_code(code: u32) -> Option<Level> {
        Level::ALL.get(code as usize).copied()
    }

    /// `L0` … `L4`.
    pub fn name(self) -> &'static str {
        ["L0", "L1", "L2", "L3", "L4"][self as usize]
    }

    /// What the level compares, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            Level::L0 => "tokens / text",
            Level::L1 => "logits / top-k margins",
            Level::L2 => "full persistent state",
            Level::L3 => "layer state (post-attention / post-mHC) and routes",
            Level::L4 => "operator intermediates",
        }
    }

    /// Parses `L0`…`L4` (case-insensitive) or `0`…`4`: exactly one digit,
    /// with at most one leading `L`.
    pub fn from_name(s: &str) -> Option<Level> {
        let t = s.strip_prefix(['L', 'l']).unwrap_or(s);
        match t.as_bytes() {
            [d @ b'0'..=b'4'] => Level::from_code(u32::from(d - b'0')),
            _ => None,
        }
    }
}

/// A set of levels (the capture spec's level masks, the gate's required
/// levels): bit `i` is level `Li`. The bit layout is the wire encoding of
/// capture specs (docs/format.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LevelSet(u8);

impl LevelSet {
    pub const EMPTY: LevelSet = LevelSet(0);
    /// L0 through L4.
    pub const ALL: LevelSet = LevelSet(0b11111);

    /// The set with bit mask `bits`, for constants (`0b01010` is L1 and
    /// L3); a bit above L4 is a programming error and fails to compile in
    /// a `const`.
    pub const fn of_mask(bits: u8) -> LevelSet {
        assert!(bits <= 0b11111, "a level set names L0-L4 only");
        LevelSet(bits)
    }

    /// The set with bit mask `bits`, if it names only L0–L4.
    pub fn from_bits(bits: u32) -> Option<LevelSet> {
        (bits <= 0b11111).then_some(LevelSet(bits as u8))
    }

    /// The bit mask.
    pub fn bits(self) -> u32 {
        u32::from(self.0)
    }

    pub fn contains(self, level: Level) -> bool {
        self.0 & (1 << level.code()) != 0
    }

    /// The set with `level` added.
    #[must_use]
    pub fn with(self, level: Level) -> LevelSet {
        LevelSet(self.0 | (1 << level.code()))
    }

    pub fn insert(&mut self, level: Level) {
        *self = self.with(level);
    }

    #[must_use]
    pub fn intersection(self, other: LevelSet) -> LevelSet {
        LevelSet(self.0 & other.0)
    }

    #[must_use]
    pub fn union(self, other: LevelSet) -> LevelSet {
        LevelSet(self.0 | other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The levels in the set, in order.
    pub fn iter(self) -> impl Iterator<Item = Level> {
        Level::ALL.into_iter().filter(move |l| self.contains(*l))
    }
}

/// A level set is written as the list of its levels, in order (`["L3", "L4"]`).
impl serde::Serialize for LevelSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl FromIterator<Level> for LevelSet {
    fn from_iter<I: IntoIterator<Item = Level>>(iter: I) -> LevelSet {
        iter.into_iter().fold(LevelSet::EMPTY, LevelSet::with)
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// The coordinate of one recorded tensor.
///
/// Steps number forwards: step 0 is the prefill forward over the prompt,
/// step `s ≥ 1` is the decode forward that consumes the `s`-th generated
/// token. `position` is the absolute token position the tensor belongs to;
/// L2 records use the position of the last token processed before the decode
/// boundary. `layer` is `None` for model-global tensors (tokens, logits).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Coord {
    /// Forward index (0 = prefill).
    pub step: u32,
    /// Absolute token position.
    pub position: u32,
    pub phase: Phase,
    /// Decoder layer, or `None` for model-global tensors.
    pub layer: Option<u32>,
    /// Component / operator path such as `layer.post_ffn_mhc` or `moe.combine`.
    pub path: RecordPath,
}

/// A component / operator path (`moe.combine`, `layer.post_ffn_mhc`): an
/// immutable string, either reference-counted or `'static`. A trace has few
/// distinct paths and up to millions of records, so readers and writers
/// give every record with the same path one shared allocation
/// ([`Interner`]); cloning is a reference-count increment. A runtime that
/// emits the same few dozen paths for every step uses `'static` paths
/// ([`RecordPath::from_static`]): cloning and dropping them touch no
/// shared counter, so the forward thread executes no locked instruction
/// per record (docs/performance.md, "Capture overhead"). Either way it
/// compares, hashes, orders, prints and dereferences like the `str` it
/// holds.
#[derive(Clone)]
pub struct RecordPath(Text);

/// Where a [`RecordPath`]'s text lives. The `'static` text is held through
/// a thin reference so that the whole path stays two words, as a shared
/// one is (a trace's index holds one per record; `schema/tests/memory.rs`).
#[derive(Clone)]
enum Text {
    Shared(Arc<str>),
    Static(&'static &'static str),
}

const _: () = assert!(std::mem::size_of::<RecordPath>() == 2 * std::mem::size_of::<usize>());

impl RecordPath {
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Text::Shared(s) => s,
            Text::Static(s) => s,
        }
    }

    /// A path whose text lives for the whole program: cloned and dropped
    /// without touching a reference count. (A reference to the `&str`, so
    /// that a path stays two words: `RecordPath::from_static(&"moe.combine")`.)
    pub const fn from_static(s: &'static &'static str) -> RecordPath {
        RecordPath(Text::Static(s))
    }

    /// The address of a `'static` path's text reference: it names the
    /// literal, not its text (two literals of one text have two), so a
    /// lookup keyed by it must fall back to the text once per address; it
    /// spares hashing the text for every record of a run.
    pub fn static_addr(&self) -> Option<usize> {
        match &self.0 {
            Text::Static(s) => Some(*s as *const &'static str as usize),
            Text::Shared(_) => None,
        }
    }
}

impl Default for RecordPath {
    fn default() -> RecordPath {
        RecordPath::from_static(&"")
    }
}

impl PartialEq for RecordPath {
    fn eq(&self, other: &RecordPath) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for RecordPath {}

impl PartialOrd for RecordPath {
    fn partial_cmp(&self, other: &RecordPath) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RecordPath {
    fn cmp(&self, other: &RecordPath) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for RecordPath {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As the `str` does: `Borrow<str>` lookups in hash sets rely on it.
        self.as_str().hash(state)
    }
}

impl Deref for RecordPath {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for RecordPath {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for RecordPath {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for RecordPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, not `write_str`: widths and alignment (`{:<36}` in text
        // reports) apply to a path as to any string.
        f.pad(self.as_str())
    }
}

impl fmt::Debug for RecordPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl From<&str> for RecordPath {
    fn from(s: &str) -> RecordPath {
        RecordPath(Text::Shared(Arc::from(s)))
    }
}

impl From<String> for RecordPath {
    fn from(s: String) -> RecordPath {
        RecordPath(Text::Shared(Arc::from(s)))
    }
}

impl From<&String> for RecordPath {
    fn from(s: &String) -> RecordPath {
        RecordPath::from(s.as_str())
    }
}

impl PartialEq<str> for RecordPath {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for RecordPath {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for RecordPath {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<RecordPath> for str {
    fn eq(&self, other: &RecordPath) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<RecordPath> for &str {
    fn eq(&self, other: &RecordPath) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<RecordPath> for String {
    fn eq(&self, other: &RecordPath) -> bool {
        self.as_str() == other.as_str()
    }
}

impl serde::Serialize for RecordPath {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Hands out one shared [`RecordPath`] per distinct path string (and one
/// shared shape per distinct shape), so that a trace of millions of records
/// holds a few dozen allocations for them instead of millions.
#[derive(Debug, Default)]
pub struct Interner {
    paths: HashSet<RecordPath>,
    shapes: HashSet<Arc<[u64]>>,
}

impl Interner {
    /// An empty interner.
    pub fn new() -> Interner {
        Interner::default()
    }

    /// The shared path equal to `s`.
    pub fn path(&mut self, s: &str) -> RecordPath {
        if let Some(p) = self.paths.get(s) {
            return p.clone();
        }
        let p = RecordPath::from(s);
        self.paths.insert(p.clone());
        p
    }

    /// `path` as the interner would share it: a `'static` path as it is
    /// (it owns no allocation to share, and looking it up would hash it
    /// for nothing), any other the shared path equal to it.
    pub fn share(&mut self, path: RecordPath) -> RecordPath {
        match path.0 {
            Text::Static(_) => path,
            Text::Shared(_) => self.path(&path),
        }
    }

    /// The shared shape equal to `dims`.
    pub fn shape(&mut self, dims: &[u64]) -> Arc<[u64]> {
        if let Some(s) = self.shapes.get(dims) {
            return s.clone();
        }
        let s: Arc<[u64]> = Arc::from(dims);
        self.shapes.insert(s.clone());
        s
    }
}

impl Coord {
    /// Checks the path charset and length (`[A-Za-z0-9_.:\[\]-]`, 1–128 bytes).
    pub fn validate_path(path: &str) -> Result<(), String> {
        if path.is_empty() {
            return Err("component path is empty".into());
        }
        if path.len() > MAX_PATH_LEN {
            return Err(format!(
                "component path is {} bytes, longer than {MAX_PATH_LEN}",
                path.len()
            ));
        }
        let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'[' | b']' | b'-');
        if let Some(c) = path
            .bytes()
            .position(|b| !ok(b))
            .and_then(|i| path[i..].chars().next())
        {
            return Err(format!("component path {path:?} has invalid character {c:?}"));
        }
        Ok(())
    }

    /// Appends the wire encoding: `step u32, position u32, phase u32,
    /// layer Option<u32>, path String`.
    pub fn encode(&self, e: &mut Encoder) {
        e.u32(self.step)
            .u32(self.position)
            .u32(self.phase as u32)
            .opt_u32(self.layer)
            .str(&self.path);
    }

    /// Decodes and validates a coordinate.
    pub fn decode(d: &mut Decoder<'_>) -> Result<Coord, WireError> {
        Coord::decode_interned(d, &mut Interner::new())
    }

    /// Decodes and validates a coordinate, sharing its path through `paths`.
    pub fn decode_interned(d: &mut Decoder<'_>, paths: &mut Interner) -> Result<Coord, WireError> {
        let step = d.u32("coordinate step")?;
        let position = d.u32("coordinate position")?;
        let at = d.offset();
        let phase = match d.u32("coordinate phase")? {
            0 => Phase::Prefill,
            1 => Phase::Decode,
            p => return Err(d.error_at(at, format!("unknown phase code {p}"))),
        };
        let layer = d.opt_u32("coordinate layer")?;
        let at = d.offset();
        let path = d.str("coordinate path", MAX_PATH_LEN as u64)?;
        Coord::validate_path(path).map_err(|m| d.error_at(at, m))?;
        let path = paths.path(path);
        Ok(Coord {
            step,
            position,
            phase,
            layer,
            path,
        })
    }

    /// Canonical order of records inside the hash tree (after step, level and
    /// layer, which the tree nodes already separate): position, phase, path.
    pub fn tree_order(&self, other: &Coord) -> Ordering {
        (self.step, self.layer, self.position, self.phase, &self.path).cmp(&(
            other.step,
            other.layer,
            other.position,
            other.phase,
            &other.path,
        ))
    }
}

impl fmt::Display for Coord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} pos {} ({})",
            self.step,
            self.position,
            self.phase.name()
        )?;
        if let Some(l) = self.layer {
            write!(f, " layer {l}")?;
        }
        write!(f, " {}", self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_shared_paths_are_the_same_path() {
        use std::collections::{BTreeSet, HashSet};
        let shared = RecordPath::from("moe.combine");
        let fixed = RecordPath::from_static(&"moe.combine");
        assert_eq!(shared, fixed);
        assert_eq!(shared.cmp(&fixed), std::cmp::Ordering::Equal);
        let (a, b) = (RecordPath::from_static(&"moe.a"), RecordPath::from("moe.b"));
        assert_eq!(a.cmp(&b), std::cmp::Ordering::Less);
        let (a, b) = (RecordPath::from("moe.a"), RecordPath::from_static(&"moe.b"));
        assert_eq!(a.cmp(&b), std::cmp::Ordering::Less);
        // A set holding one finds the other, and a `str` finds both.
        let set: HashSet<RecordPath> = [shared.clone()].into();
        assert!(set.contains(&fixed));
        assert!(set.contains("moe.combine"));
        let set: HashSet<RecordPath> = [fixed.clone()].into();
        assert!(set.contains(&shared));
        assert!(set.contains("moe.combine"));
        let mut interner = Interner::new();
        let first = interner.share(RecordPath::from("moe.combine"));
        let again = interner.share(shared.clone());
        assert_eq!(first.as_ptr(), again.as_ptr(), "shared paths get one allocation");
        assert_eq!(
            interner.share(fixed.clone()).as_ptr(),
            fixed.as_ptr(),
            "static paths stay as they are"
        );
        let ordered: BTreeSet<RecordPath> = [fixed.clone(), shared.clone()].into();
        assert_eq!(ordered.len(), 1);
        assert_eq!(format!("{fixed:?} {fixed:>12}"), "\"moe.combine\"  moe.combine");
        assert_eq!(RecordPath::default(), "");
    }

    #[test]
    fn paths_and_levels_take_widths_like_strings() {
        let p = RecordPath::from("lm.margin");
        assert_eq!(format!("[{p:<12}]"), "[lm.margin   ]");
        assert_eq!(format!("[{p:>12}]"), "[   lm.margin]");
        assert_eq!(format!("[{p}]"), "[lm.margin]");
        assert_eq!(format!("[{:<4}]", Level::L3), "[L3  ]");
    }

    #[test]
    fn round_trip_and_validation() {
        let c = Coord {
            step: 3,
            position: 7,
            phase: Phase::Decode,
            layer: Some(5),
            path: "moe.term[2]".into(),
        };
        let mut e = Encoder::new();
        c.encode(&mut e);
        let bytes = e.into_bytes();
        let mut d = Decoder::new(&bytes, 0);
        assert_eq!(Coord::decode(&mut d).unwrap(), c);
        assert!(Coord::validate_path("").is_err());
        assert!(Coord::validate_path("a b").is_err());
        assert!(Coord::validate_path(&"x".repeat(129)).is_err());
        assert_eq!(Level::from_name("l3"), Some(Level::L3));
        assert_eq!(Level::from_name("L9"), None);
        assert_eq!(Level::from_name("LL3"), None);
        assert_eq!(Level::from_name("3"), Some(Level::L3));
        assert_eq!(Level::from_name("L03"), None);
        let set: LevelSet = [Level::L1, Level::L3].into_iter().collect();
        assert_eq!(set.bits(), 0b01010);
        assert_eq!(set.iter().collect::<Vec<_>>(), vec![Level::L1, Level::L3]);
        assert_eq!(LevelSet::from_bits(0b100000), None);
    }
}
