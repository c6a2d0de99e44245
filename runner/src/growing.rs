//! Fingerprints of persistent state that only grows (the compressed caches,
//! catalogue rows marked `append_only`) at a cost proportional to what was
//! appended, not to the context: the record digest of docs/format.md §4.1,
//! unchanged, computed with [`IncrementalBlake3`] over the record's preimage
//! (its header, then its bytes), one digest state per (layer, component).
//!
//! Trust: the incremental digest assumes the old bytes did not change. Each
//! record re-hashes [`VERIFY_BLOCKS`] cached blocks round robin every
//! [`VERIFY_PERIOD`] digests (the records staggered, so that each step
//! shares the work), and every record of the run's last step re-hashes all
//! of them: an old entry
//! rewritten without being appended (a runtime bug) that stays rewritten
//! until the sweep or the last step reaches its block fails the run, naming
//! the record and the bytes, and no trace is written. A rewrite undone
//! before then is not seen: the digests of the steps in between commit to
//! the bytes before it (docs/format.md §4.5; payload capture hashes whole).

use moeconf_fingerprint::incremental::{Digested, IncrementalBlake3, PendingRoot, DEFAULT_BLOCK};
use moeconf_fingerprint::{
    catalogue::Component, is_canonical, record_prefix, surely_canonical, Algorithm, CanonPolicy, Coord,
    Digest, Level, RecordPath, TensorView,
};
use moeconf_reference_runtime::capture::CaptureError;
use std::collections::HashMap;

/// Records smaller than this are hashed whole as before (two blocks).
pub const MIN_INCREMENTAL_BYTES: usize = 2 * DEFAULT_BLOCK;
/// Cached blocks re-hashed per record to find unreported rewrites ...
pub const VERIFY_BLOCKS: usize = 1;
/// ... at every this many digests of the record. Re-hashing a 16 KiB block
/// per growing record at every step was half of the growing digests' cost
/// on the fixture at 4,096 tokens of context (15 records, 240 KiB a step);
/// the sweep finds a lasting rewrite within `VERIFY_PERIOD` × blocks
/// steps, and the last step checks every block whatever the period.
pub const VERIFY_PERIOD: u32 = 4;

/// The digest state of one growing record.
struct Growing {
    hasher: IncrementalBlake3,
    /// Bytes of the record at its last digest.
    len: usize,
    /// Digests so far, plus an offset that staggers the records' verifications.
    calls: u32,
}

/// Digest states of every growing record of a run.
pub struct GrowingDigests {
    alg: Algorithm,
    policy: CanonPolicy,
    /// The run's last step (`max_new_tokens - 1`): its records verify every block.
    last_step: u32,
    states: HashMap<(Option<u32>, Level, RecordPath), Growing>,
    /// Rows that only grow on some layers ([`GrowingDigests::grow_on_layers`]).
    layered: Vec<(Component, u32)>,
    /// Bytes hashed so far, for tests and measurements.
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
            states: HashMap::new(),
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
    }

    /// The run's last step, whose records verify every block.
    pub fn last_step(&self) -> u32 {
        self.last_step
    }

    /// Bytes hashed by the incremental digests so far on this side (the
    /// first chunk of a pending digest is hashed by whoever finishes it).
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
        Ok(self
            .digest_with(coord, level, tensor, None, false)?
            .map(|d| d.finish()))
    }

    /// [`GrowingDigests::digest`] (`kept`: [`GrowingDigests::digest_grown`])
    /// leaving the part that changes at every digest, the record header's
    /// chunk and its path to the root, to whoever finishes the
    /// [`GrowingDigest`] (the trace writer's thread).
    pub fn digest_pending(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
    ) -> Result<Option<GrowingDigest>, CaptureError> {
        self.digest_with(coord, level, tensor, kept, true)
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
        Ok(self
            .digest_with(coord, level, tensor, Some(kept), false)?
            .map(|d| d.finish()))
    }

    fn digest_with(
        &mut self,
        coord: &Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: Option<usize>,
        pending: bool,
    ) -> Result<Option<GrowingDigest>, CaptureError> {
        if self.alg != Algorithm::Blake3 || tensor.bytes.len() < MIN_INCREMENTAL_BYTES {
            return Ok(None);
        }
        let growing = kept.is_some()
            || Component::parse(&coord.path).is_some_and(|(c, _)| {
                c.spec().append_only || coord.layer.is_some_and(|l| self.layered.contains(&(c, l)))
            });
        if !growing || tensor.validate(&coord.path).is_err() {
            return Ok(None);
        }
        // The runtime's paths are `'static`: the key costs no allocation.
        let key = (coord.layer, level, coord.path.clone());
        let data = tensor.bytes;
        let previous = self.states.get(&key).map(|g| g.len).unwrap_or(0);
        // Bytes [same..) may differ from the last digest's: the appended
        // ones, and for a grown record those after its kept prefix.
        let same = kept.map_or(previous, |k| k.min(previous)).min(data.len());
        // Bytes not digested before must be canonical as they are (the old
        // ones were checked when they were); otherwise the whole record goes
        // the usual way, which canonicalizes.
        let new = &data[same..];
        if !surely_canonical(tensor.dtype, new, self.policy) && !is_canonical(tensor.dtype, new, self.policy)
        {
            self.states.remove(&key);
            return Ok(None);
        }
        let rewritten: Vec<std::ops::Range<usize>> =
            (previous > same).then_some(same..previous).into_iter().collect();
        let prefix = record_prefix(coord, level, tensor.dtype, tensor.shape, data.len() as u64);
        let stagger = self.states.len() as u32;
        let g = self.states.entry(key).or_insert_with(|| Growing {
            hasher: IncrementalBlake3::default(),
            len: 0,
            calls: stagger,
        });
        let root = match pending {
            true => g.hasher.digest_stream_pending(&prefix, data, &rewritten),
            false => Digested::Done(g.hasher.digest_stream(&prefix, data, &rewritten)),
        };
        self.hashed += g.hasher.last_hashed() as u64;
        g.len = data.len();
        let checked = if coord.step >= self.last_step {
            g.hasher.verify_all_stream(&prefix, data)
        } else if g.calls.is_multiple_of(VERIFY_PERIOD) {
            g.hasher.verify_next_stream(&prefix, data, VERIFY_BLOCKS)
        } else {
            Ok(())
        };
        g.calls = g.calls.wrapping_add(1);
        if let Err(stale) = checked {
            let p = prefix.len();
            return Err(CaptureError::new(format!(
                "{coord}: bytes {}..{} of this growing record changed after they were fingerprinted, without \
                 being appended (an old entry was rewritten): the incremental fingerprint cannot commit to it, \
                 no trace is written. To trace this run anyway, capture the persistent state with its payloads \
                 (`--capture L0,L1+payload,L2+payload,L3+payload,L4`: the default plus L2 payloads), which hashes \
                 every step's state whole",
                stale.start.saturating_sub(p),
                stale.end.saturating_sub(p)
            )));
        }
        self.records += 1;
        Ok(Some(match root {
            Digested::Done(h) => GrowingDigest::Done(Digest(*h.as_bytes())),
            Digested::Pending(p) => GrowingDigest::Pending(p),
        }))
    }
}

/// A growing record's digest, or all of it but the header's part
/// ([`GrowingDigests::digest_pending`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrowingDigest {
    Done(Digest),
    Pending(PendingRoot),
}

impl GrowingDigest {
    /// The record digest (finishing a pending one here).
    pub fn finish(&self) -> Digest {
        match self {
            GrowingDigest::Done(d) => *d,
            GrowingDigest::Pending(p) => Digest(*p.finish().as_bytes()),
        }
    }
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
            let t = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &bytes,
            };
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
    fn an_old_entry_rewritten_in_place_fails_by_the_last_step() {
        let policy = CanonPolicy::default();
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, 5);
        let mut bytes = entries(200);
        let mut failed = None;
        for step in 0..6u32 {
            if step == 2 {
                bytes[100_000] ^= 1; // an old entry changes; nothing was appended there
            }
            bytes.extend(entries(1));
            let shape = [(bytes.len() / 2048) as u64, 512];
            let t = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &bytes,
            };
            if let Err(e) = g.digest(&coord(step, step), Level::L2, t) {
                failed = Some(e.message);
                break;
            }
        }
        let m = failed.expect("the rewrite is found by the last step at the latest");
        assert!(m.contains("rewritten"), "{m}");
        let range = m
            .split("bytes ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .unwrap();
        let (a, b) = range.split_once("..").unwrap();
        let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
        assert!(a <= 100_000 && 100_000 < b, "{m}");
    }

    /// A text that grows by a few bytes per step and whose last character
    /// is sometimes U+FFFD replaced by the completed character (the
    /// `text.continuation` record): every digest is the whole-record digest,
    /// and past the threshold each step hashes a bounded number of bytes.
    #[test]
    fn a_grown_text_with_rewritten_tails_gets_the_whole_record_digest() {
        let policy = CanonPolicy::default();
        let steps = 12_000u32;
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, steps - 1);
        let mut text = String::new();
        let mut prev = String::new();
        let mut hashed_before = 0;
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
            let got = g.digest_grown(&c, Level::L0, t, kept).unwrap();
            match got {
                Some(d) => {
                    assert_eq!(d, want, "step {step}");
                    let per_step = g.hashed_bytes() - hashed_before;
                    // After the first (whole) one: the header's chunk, the
                    // tail's chunks, one verified block (every block at the
                    // last step).
                    if incremental > 0 && step + 1 < steps {
                        assert!(per_step <= 2 * DEFAULT_BLOCK as u64, "step {step}: {per_step}");
                    }
                    incremental += 1;
                }
                None => assert!(bytes.len() < MIN_INCREMENTAL_BYTES, "step {step}: hashed whole"),
            }
            hashed_before = g.hashed_bytes();
            prev = text.clone();
        }
        assert!(text.len() > 2 * MIN_INCREMENTAL_BYTES, "{}", text.len());
        assert!(incremental > 5_000, "{incremental}");
    }

    #[test]
    fn a_lasting_rewrite_is_found_by_the_sweep_long_before_the_last_step() {
        let policy = CanonPolicy::default();
        let last = 10_000;
        let mut g = GrowingDigests::new(Algorithm::Blake3, policy, last);
        let mut bytes = entries(200);
        let mut found = None;
        for step in 0..last {
            if step == 2 {
                bytes[100_000] ^= 1;
            }
            if step % 4 == 0 {
                bytes.extend(entries(1));
            }
            let shape = [(bytes.len() / 2048) as u64, 512];
            let t = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &bytes,
            };
            if g.digest(&coord(step, step), Level::L2, t).is_err() {
                found = Some(step);
                break;
            }
        }
        // One sweep: every block once per VERIFY_PERIOD digests.
        let blocks = (bytes.len() + 256).div_ceil(DEFAULT_BLOCK) as u32;
        let step = found.expect("the sweep finds it");
        assert!(
            step <= 2 + VERIFY_PERIOD * (blocks + 1),
            "found at step {step}, {blocks} blocks"
        );
    }

    #[test]
    fn other_records_go_the_usual_way() {
        let policy = CanonPolicy::default();
        let bytes = entries(200);
        let shape = [200u64, 512];
        let t = TensorView {
            dtype: DType::F32,
            shape: &shape,
            bytes: &bytes,
        };
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
        let t = TensorView {
            dtype: DType::F32,
            shape: &shape,
            bytes: &nan,
        };
        assert_eq!(
            g.digest(&coord(0, 0), Level::L2, t).unwrap(),
            None,
            "a non-canonical NaN"
        );
    }
}
