//! Fingerprints of persistent state that only grows (the compressed caches,
//! catalogue rows marked `append_only`) at a cost proportional to what was
//! appended, not to the context: the record digest of docs/format.md §4.1,
//! unchanged, computed with [`IncrementalBlake3`] over the record's preimage
//! (its header, then its bytes), one digest state per (layer, component).
//!
//! Trust: the incremental digest assumes the old bytes did not change. Each
//! record re-hashes [`VERIFY_BLOCKS`] cached blocks round robin every
//! [`VERIFY_PERIOD`] digests (the records staggered, so that each step
//! shares the work), and every record at the run's last position (each
//! path's last record, [`GrowingDigests::with_prompt_tokens`]) re-hashes all
//! of them: an old entry
//! rewritten without being appended (a runtime bug) that stays rewritten
//! until the sweep or the last position reaches its block fails the run,
//! naming the record and the bytes, and no trace is written. A rewrite undone
//! before then is not seen: the digests of the steps in between commit to
//! the bytes before it (docs/format.md §4.5; payload capture hashes whole).
//!
//! Where the work runs: with the writer on the recording thread,
//! [`GrowingDigests::digest`] does all of the above there. With the writer
//! on its own thread, [`GrowingDigests::mirror`] hands over only the bytes
//! appended since the last step, and for the sweep the same blocks' bytes
//! instead of their hashes; [`Mirrors`], on the writer's thread, keeps a
//! copy of each record, digests it and compares the swept bytes with it.
//! The digests are the same either way.

use moeconf_fingerprint::incremental::{IncrementalBlake3, DEFAULT_BLOCK};
use moeconf_fingerprint::{
    catalogue::Component, is_canonical, record_prefix, surely_canonical, Algorithm, CanonPolicy, Coord,
    DType, Digest, Level, RecordPath, TensorView,
};
use moeconf_reference_runtime::capture::CaptureError;
use std::collections::HashMap;

/// Records smaller than this are hashed whole as before (two blocks).
pub const MIN_INCREMENTAL_BYTES: usize = 2 * DEFAULT_BLOCK;
/// Growing records of at least this many bytes are mirrored on the
/// writer's thread ([`GrowingDigests::mirror`]); smaller ones are copied
/// whole.
pub const MIN_MIRRORED_BYTES: usize = 4096;
/// Cached blocks re-hashed per record to find unreported rewrites ...
pub const VERIFY_BLOCKS: usize = 1;
/// ... at every this many digests of the record. Re-hashing a 16 KiB block
/// per growing record at every step was half of the growing digests' cost
/// on the fixture at 4,096 tokens of context (15 records, 240 KiB a step);
/// the sweep finds a lasting rewrite within `VERIFY_PERIOD` × blocks
/// steps, and the last step checks every block whatever the period.
pub const VERIFY_PERIOD: u32 = 4;

/// The recording side's state of one growing record.
struct Growing {
    /// Its incremental digest ([`GrowingDigests::digest`]; unused when
    /// mirrored, [`GrowingDigests::mirror`]).
    hasher: IncrementalBlake3,
    /// Bytes of the record at its last digest or hand-over.
    len: usize,
    /// Digests or hand-overs so far, plus an offset that staggers the
    /// records' verifications.
    calls: u32,
    /// Next 16 KiB window ([`DEFAULT_BLOCK`]) a mirrored record's sweep checks.
    cursor: usize,
    /// The step of its latest record, and whether that record was checked
    /// whole ([`GrowingDigests::unverified`]).
    latest: (u32, bool),
}

/// What a record's verification sweep checks this time.
enum Sweep {
    /// Every byte (the run's last step).
    All,
    /// The next block or window, round robin.
    Next,
    Skip,
}

impl Growing {
    fn new(stagger: u32) -> Growing {
        Growing {
            hasher: IncrementalBlake3::default(),
            len: 0,
            calls: stagger,
            cursor: 0,
            latest: (0, false),
        }
    }

    /// This digest's share of the sweep: everything for the run's `last`
    /// record of this path, else one block every [`VERIFY_PERIOD`] calls.
    fn sweep(&mut self, step: u32, last: bool) -> Sweep {
        self.latest = (step, last);
        let s = if last {
            Sweep::All
        } else if self.calls.is_multiple_of(VERIFY_PERIOD) {
            Sweep::Next
        } else {
            Sweep::Skip
        };
        self.calls = self.calls.wrapping_add(1);
        s
    }
}

/// A growing record: its layer, level and path.
type GrowingKey = (Option<u32>, Level, RecordPath);

/// Digest states of every growing record of a run.
pub struct GrowingDigests {
    alg: Algorithm,
    policy: CanonPolicy,
    /// The run's last step (`max_new_tokens - 1`) ...
    last_step: u32,
    /// ... and the position of its last token, when known: the records
    /// there are each path's last, and verify every block.
    final_position: Option<u32>,
    states: HashMap<GrowingKey, Growing>,
    /// Whether the record of a `'static` path ([`RecordPath::static_addr`])
    /// on a layer grows, once found from its text.
    grows: HashMap<(usize, Option<u32>), bool>,
    /// Rows that only grow on some layers ([`GrowingDigests::grow_on_layers`]).
    layered: Vec<(Component, u32)>,
    /// Bytes of growing records read again so far ([`Self::hashed_bytes`]).
    hashed: u64,
    /// Records digested incrementally so far.
    records: u64,
}

impl GrowingDigests {
    /// Digests for a trace of `alg` and `policy` whose run ends at `last_step`.
    pub fn new(alg: Algorithm, policy: CanonPolicy, last_step: u32) -> GrowingDigests {
        GrowingDigests {
            alg,
            policy,
            last_step,
            final_position: None,
            states: HashMap::new(),
            grows: HashMap::new(),
            layered: Vec::new(),
            hashed: 0,
            records: 0,
        }
    }

    /// Treats `component` as growing on `layers` too, where the model makes
    /// it append-only although the catalogue row is not on every layer:
    /// `attn.compressed_read` on HCA layers, which read every compressed
    /// entry in order (CSA layers read the selected ones). A layer named
    /// wrongly costs the run, never the trace: a record that is not
    /// append-only fails the verification below.
    pub fn grow_on_layers(&mut self, component: Component, layers: impl IntoIterator<Item = u32>) {
        self.layered.extend(layers.into_iter().map(|l| (component, l)));
        self.grows.clear();
    }

    /// Of a run whose prompt is `prompt_tokens` long (one token a step
    /// after it): only the records at its last position verify every block,
    /// not every position's of a last step that is the prefill (whose
    /// growing records would each be checked whole, a cost growing with the
    /// square of the prompt). Unknown (0): every record of the last step.
    pub fn with_prompt_tokens(mut self, prompt_tokens: usize) -> GrowingDigests {
        self.final_position = u32::try_from(prompt_tokens)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|p| p.checked_add(self.last_step));
        self
    }

    /// The run's last step, whose records verify every block.
    pub fn last_step(&self) -> u32 {
        self.last_step
    }

    /// Whether `coord`'s record is its path's last of the run, which
    /// verifies every block.
    fn is_last(&self, coord: &Coord) -> bool {
        coord.step >= self.last_step && self.final_position.is_none_or(|f| coord.position >= f)
    }

    /// A growing record whose last record of the run's last step was not
    /// verified whole, if any: the run cannot vouch for its old bytes (its
    /// prompt was not the length it was said to be), and no trace may be
    /// written.
    pub fn unverified(&self) -> Option<String> {
        let mut bad = self
            .states
            .iter()
            .filter(|(_, g)| g.latest.0 >= self.last_step && !g.latest.1)
            .map(|((layer, level, path), _)| (*layer, *level, path.as_str()))
            .collect::<Vec<_>>();
        bad.sort();
        bad.first().map(|(layer, level, path)| {
            format!(
                "{} growing record(s) of the run's last step were not verified whole (the first: {path} at \
                 {level:?}{}): the trace cannot vouch for their old bytes, and none is written. Their last \
                 records came before the last position that the prompt's length and the step count give ({})",
                bad.len(),
                layer.map(|l| format!(" on layer {l}")).unwrap_or_default(),
                self.final_position
                    .map_or("unknown".to_string(), |p| p.to_string()),
            )
        })
    }

    /// Bytes of growing records this side read again so far: hashed by the
    /// incremental digests ([`Self::digest`]), or handed over for the
    /// writer's comparison ([`Self::mirror`], whose new bytes are not counted).
    pub fn hashed_bytes(&self) -> u64 {
        self.hashed
    }

    /// Records digested incrementally so far.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// The digest of a fingerprint-only record, when it is one this module
    /// handles (BLAKE3, an append-only component, at least
    /// [`MIN_INCREMENTAL_BYTES`], canonical bytes); `None`: digest it whole.
    pub fn digest(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
    ) -> Result<Option<Digest>, CaptureError> {
        self.digest_with(coord, level, tensor, None)
    }

    /// [`GrowingDigests::digest`] of a record whose first `kept` bytes are
    /// those of its previous record of the same path, level and layer and
    /// whose other bytes may all have changed (`text.continuation`, whose
    /// last characters can change as a split character completes; see
    /// `CaptureSink::record_grown`). Handled whatever its catalogue row
    /// says; the verification is the same as for append-only records.
    pub fn digest_grown(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: usize,
    ) -> Result<Option<Digest>, CaptureError> {
        self.digest_with(coord, level, tensor, Some(kept))
    }

    /// For a fingerprint-only record that grows (what [`Self::digest`]
    /// handles: from [`MIN_INCREMENTAL_BYTES`] on, below which copying the
    /// whole record costs the recording thread less), what the writer's
    /// thread needs to digest it from its own copy of the record
    /// ([`Mirrors`]): the bytes to keep from the last hand-over (the rest,
    /// `tensor.bytes[same..]`, is handed over), and the bytes this step
    /// verifies, `tensor.bytes[check]`, which the writer compares with its
    /// copy: one [`DEFAULT_BLOCK`] every [`VERIFY_PERIOD`] hand-overs (round
    /// robin), the whole record at the run's last step. So the recording
    /// thread hashes nothing, and an old entry rewritten without being
    /// appended fails the run as with [`Self::digest`]. `None`: hand the
    /// record over whole.
    pub fn mirror(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
    ) -> Option<MirrorUpdate> {
        let (key, _, same) = self.changed(coord, level, tensor, kept, MIN_MIRRORED_BYTES)?;
        let data = tensor.bytes;
        let last = self.is_last(coord);
        let stagger = self.states.len() as u32;
        let g = self.states.entry(key).or_insert_with(|| Growing::new(stagger));
        g.len = data.len();
        let check = match g.sweep(coord.step, last) {
            Sweep::All => 0..data.len(),
            Sweep::Next => {
                let windows = data.len().div_ceil(DEFAULT_BLOCK);
                let w = g.cursor % windows;
                g.cursor = (w + VERIFY_BLOCKS) % windows;
                w * DEFAULT_BLOCK..((w + VERIFY_BLOCKS) * DEFAULT_BLOCK).min(data.len())
            }
            Sweep::Skip => 0..0,
        };
        self.hashed += check.len() as u64;
        self.records += 1;
        Some(MirrorUpdate {
            same,
            len: data.len(),
            check,
        })
    }

    /// For a record to digest incrementally (BLAKE3, at least
    /// [`MIN_INCREMENTAL_BYTES`], of an append-only component or one that
    /// grows on this layer, or grown (`kept`), of a valid shape): its key,
    /// its length at the last digest, and from where its bytes may differ
    /// from that digest's (the appended ones, and for a grown record those
    /// after its kept prefix). `None` also when those bytes are not
    /// canonical as they are (the old ones were checked when they were):
    /// the record then goes whole, the usual way, which canonicalizes, and
    /// its state starts over.
    fn changed(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
        min: usize,
    ) -> Option<(GrowingKey, usize, usize)> {
        if self.alg != Algorithm::Blake3 || tensor.bytes.len() < min {
            return None;
        }
        if kept.is_none() && !self.grows(coord) {
            return None;
        }
        if tensor.validate(&coord.path).is_err() {
            return None;
        }
        // The runtime's paths are `'static`: the key costs no allocation.
        let key = (coord.layer, level, coord.path.clone());
        let data = tensor.bytes;
        let previous = self.states.get(&key).map_or(0, |g| g.len);
        let same = kept.map_or(previous, |k| k.min(previous)).min(data.len());
        let new = &data[same..];
        if !surely_canonical(tensor.dtype, new, self.policy) && !is_canonical(tensor.dtype, new, self.policy)
        {
            self.states.remove(&key);
            return None;
        }
        Some((key, previous, same))
    }

    /// Whether `coord`'s record is of a component that only grows there:
    /// append-only, or growing on its layer ([`Self::grow_on_layers`]).
    /// Looked up by the path's address when it has one, so that the text is
    /// parsed once per path and layer, not once per record.
    fn grows(&mut self, coord: &Coord) -> bool {
        let of_text = |layered: &[(Component, u32)]| {
            Component::parse(&coord.path).is_some_and(|(c, _)| {
                c.spec().append_only || coord.layer.is_some_and(|l| layered.contains(&(c, l)))
            })
        };
        match coord.path.static_addr() {
            Some(a) => *self
                .grows
                .entry((a, coord.layer))
                .or_insert_with(|| of_text(&self.layered)),
            None => of_text(&self.layered),
        }
    }

    fn digest_with(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
    ) -> Result<Option<Digest>, CaptureError> {
        let Some((key, previous, same)) = self.changed(coord, level, tensor, kept, MIN_INCREMENTAL_BYTES)
        else {
            return Ok(None);
        };
        let data = tensor.bytes;
        let rewritten: Vec<std::ops::Range<usize>> =
            (previous > same).then_some(same..previous).into_iter().collect();
        let prefix = record_prefix(coord, level, tensor.dtype, tensor.shape, data.len() as u64);
        let last = self.is_last(coord);
        let stagger = self.states.len() as u32;
        let g = self.states.entry(key).or_insert_with(|| Growing::new(stagger));
        let root = g.hasher.digest_stream(&prefix, data, &rewritten);
        self.hashed += g.hasher.last_hashed() as u64;
        g.len = data.len();
        let checked = match g.sweep(coord.step, last) {
            Sweep::All => g.hasher.verify_all_stream(&prefix, data),
            Sweep::Next => g.hasher.verify_next_stream(&prefix, data, VERIFY_BLOCKS),
            Sweep::Skip => Ok(()),
        };
        if let Err(stale) = checked {
            let p = prefix.len();
            return Err(CaptureError::new(stale_message(
                coord,
                stale.start.saturating_sub(p),
                stale.end.saturating_sub(p),
            )));
        }
        self.records += 1;
        Ok(Some(Digest(*root.as_bytes())))
    }
}

/// Why a run with a growing record whose bytes `start..end` changed
/// unreported cannot be traced, and how to trace it anyway.
fn stale_message(coord: &Coord, start: usize, end: usize) -> String {
    format!(
        "{coord}: bytes {start}..{end} of this growing record changed after they were fingerprinted, without \
         being appended (an old entry was rewritten): the incremental fingerprint cannot commit to it, \
         no trace is written. To trace this run anyway, capture the persistent state with its payloads \
         (`--capture L0,L1+payload,L2+payload,L3+payload,L4`: the default plus L2 payloads), which hashes \
         every step's state whole"
    )
}

/// What [`GrowingDigests::mirror`] hands to the writer's thread with a
/// record's new bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorUpdate {
    /// Bytes of the record's last hand-over that are unchanged.
    pub same: usize,
    /// The record's length in bytes.
    pub len: usize,
    /// The bytes the writer checks its copy against (handed over too).
    pub check: std::ops::Range<usize>,
}

/// The writer's side of mirrored growing records: a copy of each record's
/// bytes, kept up to date from the new bytes of each hand-over, and its
/// incremental digest, so that the recording thread hands over what
/// changed instead of the whole record and hashes none of it. Memory: the
/// growing records' bytes once more (a 32,768-token run of the fixture
/// peaked 24 MB higher, docs/format.md §4.5).
#[derive(Default)]
pub struct Mirrors {
    records: HashMap<GrowingKey, MirrorState>,
}

#[derive(Default)]
struct MirrorState {
    bytes: Vec<u8>,
    hasher: IncrementalBlake3,
}

impl Mirrors {
    /// The record digest of `coord`'s record after applying `update` and its
    /// `new` bytes, once `checked` (the recording side's bytes
    /// `update.check`) equals this copy there: an error names the bytes that
    /// changed unreported.
    #[allow(clippy::too_many_arguments)]
    pub fn digest(
        &mut self,
        coord: &Coord,
        level: Level,
        dtype: DType,
        shape: &[u64],
        update: &MirrorUpdate,
        new: &[u8],
        checked: &[u8],
    ) -> Result<Digest, String> {
        let key = (coord.layer, level, coord.path.clone());
        let m = self.records.entry(key).or_default();
        if update.same == 0 {
            *m = MirrorState::default();
        }
        let previous = m.bytes.len();
        if update.same > previous
            || update.same + new.len() != update.len
            || update.check.end > update.len
            || update.check.len() != checked.len()
        {
            return Err(format!(
                "{coord}: a growing record's hand-over does not continue its last one ({} bytes kept of {previous}, \
                 {} new, {} in all, {} checked at {:?})",
                update.same,
                new.len(),
                update.len,
                checked.len(),
                update.check
            ));
        }
        m.bytes.truncate(update.same);
        m.bytes.extend_from_slice(new);
        let ours = &m.bytes[update.check.clone()];
        if ours != checked {
            let first = ours.iter().zip(checked).position(|(a, b)| a != b).unwrap_or(0);
            let last = ours
                .iter()
                .zip(checked)
                .rposition(|(a, b)| a != b)
                .unwrap_or(first);
            let at = update.check.start;
            return Err(stale_message(coord, at + first, at + last + 1));
        }
        let rewritten: Vec<std::ops::Range<usize>> = (previous > update.same)
            .then_some(update.same..previous)
            .into_iter()
            .collect();
        let prefix = record_prefix(coord, level, dtype, shape, update.len as u64);
        let root = m.hasher.digest_stream(&prefix, &m.bytes, &rewritten);
        Ok(Digest(*root.as_bytes()))
    }
}

/// The byte range a failure of [`stale_message`] names (tests).
#[cfg(test)]
pub(crate) fn stale_range(message: &str) -> (usize, usize) {
    let range = message
        .split("bytes ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_default();
    let (a, b) = range.split_once("..").unwrap_or_default();
    (a.parse().unwrap_or(usize::MAX), b.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeconf_fingerprint::{record_digest, DType, Phase};

    fn coord(step: u32, position: u32) -> Coord {
        Coord {
            step,
            position,
            phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
            layer: Some(2),
            path: "state.compressor.compressed_kv".into(),
        }
    }

    /// An F32 record of `bytes` and `shape`.
    fn f32_view<'a>(bytes: &'a [u8], shape: &'a [u64]) -> TensorView<'a> {
        TensorView {
            dtype: DType::F32,
            shape,
            bytes,
        }
    }

    fn entries(n: usize) -> Vec<u8> {
        (0..n * 512)
            .flat_map(|i| ((i as f32 * 0.37).sin()).to_le_bytes())
            .collect()
    }

    #[test]
    fn a_growing_cache_gets_the_whole_record_digest_hashing_only_what_grew() {
        let policy = CanonPolicy::default();
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 40);
        let mut hashed_before = 0;
        for step in 0..40u32 {
            let n = 100 + step as usize;
            let bytes = entries(n);
            let shape = [n as u64, 512];
            let t = f32_view(&bytes, &shape);
            let c = coord(step, 10 + step);
            let want = record_digest(Algorithm::Blake3, policy, &c, Level::L2, t).unwrap();
            assert_eq!(g.digest(&c, Level::L2, t).unwrap(), Some(want), "step {step}");
            if step > 0 {
                // One 2 KiB entry appended: the prefix's block, the last
                // block, one verified block; never the whole cache (200-340 KiB).
                let per_step = g.hashed_bytes() - hashed_before;
                assert!(
                    per_step <= 3 * DEFAULT_BLOCK as u64 + 2048,
                    "step {step}: {per_step}"
                );
                assert!(per_step < bytes.len() as u64);
            }
            hashed_before = g.hashed_bytes();
        }
    }

    #[test]
    fn other_records_go_the_usual_way() {
        let policy = CanonPolicy::default();
        let bytes = entries(200);
        let shape = [200u64, 512];
        let t = f32_view(&bytes, &shape);
        let mut g = GrowingDigests::new(Algorithm::Sha256, policy, 5);
        assert_eq!(g.digest(&coord(0, 0), Level::L2, t).unwrap(), None, "SHA-256");
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 5);
        let mut other = coord(0, 0);
        other.path = "state.window_kv".into();
        assert_eq!(g.digest(&other, Level::L2, t).unwrap(), None, "not append-only");
        let small = TensorView {
            dtype: DType::F32,
            shape: &[1, 512],
            bytes: &bytes[..2048],
        };
        assert_eq!(g.digest(&coord(0, 0), Level::L2, small).unwrap(), None, "small");
        let mut nan = bytes.clone();
        nan[0..4].copy_from_slice(&f32::from_bits(0x7fc0_0001).to_le_bytes());
        let t = f32_view(&nan, &shape);
        assert_eq!(
            g.digest(&coord(0, 0), Level::L2, t).unwrap(),
            None,
            "a non-canonical NaN"
        );
    }

    #[test]
    fn records_are_mirrored_from_a_smaller_size_than_they_are_digested_incrementally_here() {
        let policy = CanonPolicy::default();
        let bytes = entries(16);
        let t = |n: usize| TensorView {
            dtype: DType::F32,
            shape: &[],
            bytes: &bytes[..n],
        };
        let shape = |n: usize| [(n / 4) as u64];
        let at = |step| {
            let mut c = coord(step, step);
            c.path = RecordPath::from_static(&"state.compressor.compressed_kv");
            c
        };
        for (n, mirrored) in [
            (MIN_MIRRORED_BYTES - 4, false),
            (MIN_MIRRORED_BYTES, true),
            (MIN_INCREMENTAL_BYTES - 4, true),
        ] {
            let s = shape(n);
            let v = TensorView { shape: &s, ..t(n) };
            let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 5);
            assert_eq!(
                g.mirror(&at(0), Level::L2, v, None).is_some(),
                mirrored,
                "{n} mirrored"
            );
            let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 5);
            assert_eq!(g.digest(&at(0), Level::L2, v).unwrap(), None, "{n} here");
        }
        // A component that grows on some layers only, named after a record
        // of it was seen: the next record of it on such a layer grows.
        let s = shape(MIN_MIRRORED_BYTES);
        let v = TensorView {
            shape: &s,
            ..t(MIN_MIRRORED_BYTES)
        };
        let mut read = at(1);
        read.path = RecordPath::from_static(&"attn.compressed_read");
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 5);
        assert!(
            g.mirror(&read, Level::L4, v, None).is_none(),
            "not on every layer"
        );
        g.grow_on_layers(Component::AttnCompressedRead, [2]);
        assert!(g.mirror(&read, Level::L4, v, None).is_some(), "on layer 2");
        read.layer = Some(3);
        assert!(g.mirror(&read, Level::L4, v, None).is_none(), "not on layer 3");
    }

    /// One record through both sides of a mirrored digest: the recording
    /// side's hand-over, then the writer's copy. Also returns the bytes
    /// handed over and the bytes checked.
    fn mirrored(
        g: &mut GrowingDigests,
        mirrors: &mut Mirrors,
        c: &Coord,
        level: Level,
        t: TensorView<'_>,
        kept: Option<usize>,
    ) -> Result<Option<(Digest, usize, usize)>, String> {
        let Some(u) = g.mirror(c, level, t, kept) else {
            return Ok(None);
        };
        let (new, checked) = (&t.bytes[u.same..], &t.bytes[u.check.clone()]);
        let d = mirrors.digest(c, level, t.dtype, t.shape, &u, new, checked)?;
        Ok(Some((d, new.len(), checked.len())))
    }

    #[test]
    fn a_mirrored_cache_gets_the_whole_record_digest_handing_over_only_what_grew() {
        let policy = CanonPolicy::default();
        let steps = 40u32;
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, steps - 1);
        let mut mirrors = Mirrors::default();
        for step in 0..steps {
            let n = 100 + step as usize;
            let bytes = entries(n);
            let shape = [n as u64, 512];
            let t = f32_view(&bytes, &shape);
            let c = coord(step, 10 + step);
            let want = record_digest(Algorithm::Blake3, policy, &c, Level::L2, t).unwrap();
            let (got, handed, checked) = mirrored(&mut g, &mut mirrors, &c, Level::L2, t, None)
                .unwrap()
                .expect("a growing record is mirrored");
            assert_eq!(got, want, "step {step}");
            if step > 0 {
                assert_eq!(handed, 2048, "step {step}: one entry handed over");
            }
            if step + 1 == steps {
                assert_eq!(checked, bytes.len(), "the last step checks every byte");
            } else {
                assert!(
                    checked <= VERIFY_BLOCKS * DEFAULT_BLOCK,
                    "step {step}: {checked} bytes checked"
                );
            }
        }
    }

    /// Where a test's records are digested: by [`GrowingDigests::digest`] on
    /// the recording thread, or through the writer thread's copy.
    #[derive(Clone, Copy, Debug)]
    enum Side {
        Here,
        Mirror,
    }

    const SIDES: [Side; 2] = [Side::Here, Side::Mirror];

    impl Side {
        /// The smallest record the side digests from what changed.
        fn min_bytes(&self) -> usize {
            match self {
                Side::Here => MIN_INCREMENTAL_BYTES,
                Side::Mirror => MIN_MIRRORED_BYTES,
            }
        }
    }

    /// One record's digest on `side` (`None`: digested whole), and the bytes
    /// that side hashed (here) or handed over besides the swept ones
    /// (mirror) for it.
    #[allow(clippy::too_many_arguments)]
    fn digest_on(
        side: Side,
        g: &mut GrowingDigests,
        mirrors: &mut Mirrors,
        c: &Coord,
        level: Level,
        t: TensorView<'_>,
        kept: Option<usize>,
    ) -> Result<Option<(Digest, u64)>, String> {
        match side {
            Side::Here => {
                let before = g.hashed_bytes();
                let d = match kept {
                    Some(k) => g.digest_grown(c, level, t, k),
                    None => g.digest(c, level, t),
                }
                .map_err(|e| e.message)?;
                Ok(d.map(|d| (d, g.hashed_bytes() - before)))
            }
            Side::Mirror => Ok(mirrored(g, mirrors, c, level, t, kept)?.map(|(d, new, _)| (d, new as u64))),
        }
    }

    /// A cache of 2 KiB entries whose entry 48 (byte 100,000) changes in place
    /// at step 2, with nothing appended there, then grows as `grow` says:
    /// the step at which the run fails, if it does, and the message.
    fn rewritten_cache(side: Side, last: u32, grow: impl Fn(u32) -> bool) -> Option<(u32, String, usize)> {
        let mut g = GrowingDigests::new(Algorithm::Blake3, CanonPolicy::default(), last);
        let mut mirrors = Mirrors::default();
        let mut bytes = entries(200);
        for step in 0..=last {
            if step == 2 {
                bytes[100_000] ^= 1;
            }
            if grow(step) {
                bytes.extend(entries(1));
            }
            let shape = [(bytes.len() / 2048) as u64, 512];
            let t = f32_view(&bytes, &shape);
            if let Err(m) = digest_on(side, &mut g, &mut mirrors, &coord(step, step), Level::L2, t, None) {
                return Some((step, m, bytes.len()));
            }
        }
        None
    }

    #[test]
    fn an_old_entry_rewritten_in_place_fails_by_the_last_step() {
        for side in SIDES {
            let (_, m, _) = rewritten_cache(side, 5, |_| true)
                .expect("the rewrite is found by the last step at the latest");
            assert!(m.contains("rewritten"), "{side:?}: {m}");
            let (a, b) = stale_range(&m);
            assert!(a <= 100_000 && 100_000 < b, "{side:?}: {m}");
        }
    }

    #[test]
    fn a_lasting_rewrite_is_found_by_the_sweep_long_before_the_last_step() {
        for side in SIDES {
            let (step, _, len) = rewritten_cache(side, 10_000, |s| s % 4 == 0).expect("the sweep finds it");
            // One sweep: every block once per VERIFY_PERIOD digests.
            let blocks = (len + 256).div_ceil(DEFAULT_BLOCK) as u32;
            assert!(
                step <= 2 + VERIFY_PERIOD * (blocks + 1),
                "{side:?}: found at step {step}, {blocks} blocks"
            );
        }
    }

    /// A text that grows by a few bytes per step and whose last character
    /// is sometimes U+FFFD replaced by the completed character (the
    /// `text.continuation` record): every digest is the whole-record digest,
    /// and past the threshold each step hashes (here) or hands over (mirror)
    /// a bounded number of bytes.
    #[test]
    fn a_grown_text_with_rewritten_tails_gets_the_whole_record_digest() {
        let policy = CanonPolicy::default();
        let steps = 12_000u32;
        for side in SIDES {
            let mut g = GrowingDigests::new(Algorithm::Blake3, policy, steps - 1);
            let mut mirrors = Mirrors::default();
            let (mut text, mut prev) = (String::new(), String::new());
            let mut incremental = 0;
            for step in 0..steps {
                // Every third step ends in a split character (U+FFFD) that the
                // next step completes: the tail is rewritten, not appended.
                if text.ends_with('\u{FFFD}') {
                    text.truncate(text.len() - '\u{FFFD}'.len_utf8());
                    text.push('羊');
                }
                text.push_str(if step % 2 == 0 { " sheep" } else { " why" });
                if step % 3 == 0 {
                    text.push('\u{FFFD}');
                }
                let kept = prev.bytes().zip(text.bytes()).take_while(|(a, b)| a == b).count();
                let bytes = text.as_bytes();
                let shape = [bytes.len() as u64];
                let t = TensorView {
                    dtype: DType::U8,
                    shape: &shape,
                    bytes,
                };
                let c = Coord {
                    step,
                    position: 5 + step,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: None,
                    path: "text.continuation".into(),
                };
                let want = record_digest(Algorithm::Blake3, policy, &c, Level::L0, t).unwrap();
                match digest_on(side, &mut g, &mut mirrors, &c, Level::L0, t, Some(kept)).unwrap() {
                    Some((d, cost)) => {
                        assert_eq!(d, want, "{side:?} step {step}");
                        // After the first (whole) one, here: the header's chunk,
                        // the tail's chunks, one verified block (every block at
                        // the last step); mirrored: the changed tail.
                        let bound = match side {
                            Side::Here => 2 * DEFAULT_BLOCK as u64,
                            Side::Mirror => 16,
                        };
                        if incremental > 0 && step + 1 < steps {
                            assert!(cost <= bound, "{side:?} step {step}: {cost}");
                        }
                        incremental += 1;
                    }
                    None => assert!(bytes.len() < side.min_bytes(), "{side:?} step {step}: whole"),
                }
                prev = text.clone();
            }
            assert!(text.len() > 2 * MIN_INCREMENTAL_BYTES, "{}", text.len());
            assert!(incremental > 5_000, "{side:?}: {incremental}");
        }
    }

    #[test]
    fn a_prefill_that_ends_the_run_verifies_only_its_last_positions_records_whole() {
        let policy = CanonPolicy::default();
        let positions = 24u32;
        for side in SIDES {
            for prompt in [positions as usize, positions as usize + 1] {
                let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 0).with_prompt_tokens(prompt);
                let mut mirrors = Mirrors::default();
                for position in 0..positions {
                    let n = 40 + position as usize;
                    let bytes = entries(n);
                    let shape = [n as u64, 512];
                    let t = f32_view(&bytes, &shape);
                    let mut c = coord(0, position);
                    c.phase = Phase::Prefill;
                    let before = g.hashed_bytes();
                    let d = digest_on(side, &mut g, &mut mirrors, &c, Level::L2, t, None).unwrap();
                    let want = record_digest(Algorithm::Blake3, policy, &c, Level::L2, t).unwrap();
                    assert_eq!(d.map(|(d, _)| d), Some(want), "{side:?} {position}");
                    let read = g.hashed_bytes() - before;
                    // (Here the count leaves out the verification's reads.)
                    let whole = position + 1 == prompt as u32;
                    if position > 0 && matches!(side, Side::Mirror) {
                        assert_eq!(
                            read >= bytes.len() as u64,
                            whole,
                            "{side:?} {prompt} {position}: {read}"
                        );
                    }
                }
                // A prompt said to be longer than the positions recorded:
                // the last record was not checked whole, and the run fails.
                let told = g.unverified();
                assert_eq!(
                    told.is_some(),
                    prompt > positions as usize,
                    "{side:?} {prompt}: {told:?}"
                );
            }
        }
        // Unknown prompt length: every record of the last step whole.
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 0);
        let bytes = entries(40);
        let t = TensorView {
            dtype: DType::F32,
            shape: &[40, 512],
            bytes: &bytes,
        };
        g.mirror(&coord(0, 3), Level::L2, t, None);
        assert!(g.hashed_bytes() >= bytes.len() as u64);
        assert_eq!(g.unverified(), None);
    }

    #[test]
    fn a_hand_over_that_does_not_continue_the_last_one_is_refused() {
        let bytes = entries(20);
        let shape = [20u64, 512];
        let c = coord(1, 1);
        let mut mirrors = Mirrors::default();
        let update =
            |same: usize, len: usize, check: std::ops::Range<usize>| MirrorUpdate { same, len, check };
        let whole = update(0, bytes.len(), 0..0);
        mirrors
            .digest(&c, Level::L2, DType::F32, &shape, &whole, &bytes, &[])
            .unwrap();
        let refused = [
            // Kept bytes it never had.
            (
                update(bytes.len() + 10, bytes.len() + 20, 0..0),
                &bytes[..10],
                &[][..],
            ),
            // New bytes that do not make its length.
            (update(100, bytes.len(), 0..0), &bytes[..10], &[][..]),
            // Checked bytes beyond its end, or not the length they say.
            (
                update(bytes.len(), bytes.len(), 0..bytes.len() + 1),
                &[][..],
                &bytes[..],
            ),
            (update(bytes.len(), bytes.len(), 0..8), &[][..], &bytes[..4]),
        ];
        for (u, new, checked) in refused {
            let e = mirrors
                .digest(&c, Level::L2, DType::F32, &shape, &u, new, checked)
                .unwrap_err();
            assert!(e.contains("does not continue"), "{u:?}: {e}");
        }
    }
}
