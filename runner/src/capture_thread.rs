//! The trace writer on a thread of its own, so that canonicalizing, hashing
//! and writing records overlap the forward pass instead of lengthening it.
//!
//! The runtime's thread copies each record (coordinate, level, dtype, shape
//! and bytes; the bytes with non-temporal stores, which keep them out of
//! its caches: the writer reads them next, the forward never; an F32
//! record of BF16 values as its words' high halves, which the writer widens
//! back) into a batch
//! and hands full batches to the writer thread over
//! a bounded channel (a fingerprint-only record of growing state: only the
//! bytes appended since its last step, the writer keeping a copy of the
//! rest, [`crate::growing::Mirrors`]); the writer thread appends each batch with
//! [`TraceWriter::append_batch`] (which writes what `append` would, record
//! by record, but digests the batch's short records together). The channel
//! is first-in first-out and has one producer and one consumer, so the
//! writer sees the records in exactly the order a writer on the runtime's
//! thread would: the trace's bytes do not depend on how the two threads
//! are scheduled (tests compare the files byte for byte). The writer polls
//! the channel while batches keep coming and blocks only when idle, so a
//! hand-over rarely costs the runtime's thread a wake-up system call.
//!
//! Errors: the writer thread stops at the first failed `append` (the
//! writer then removes its temporary file) and keeps the error; the
//! runtime's next record, or [`CaptureThread::finish`], reports it. A
//! failed record is therefore reported up to one batch after it was
//! emitted, with the writer's own message; nothing is ever written after
//! it. Dropping an unfinished `CaptureThread` waits for the writer thread,
//! so the temporary file is gone when the drop returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::growing::{MirrorUpdate, Mirrors};
use moeconf_fingerprint::{Coord, DType, Level, Phase, RecordPath, TensorView};
use moeconf_schema::{BatchRecord, TraceError, TraceWriter, WriteSummary};

/// Most batches in circulation between the two threads. A batch is
/// allocated when the runtime needs one and none is free, up to this many;
/// then the runtime waits for the writer to empty one. So the capture's
/// memory is bounded whatever the length of the run (a record larger than
/// a batch grows that batch only until the writer has written it).
const POOL: usize = 6;
/// A batch is handed over once it holds this many payload bytes ...
/// (small, because every buffer the capture cycles through takes last-level
/// cache from the model's weights, which the forward reads again every
/// step: with batches of 512 KiB the fixture's decode lost several points
/// more to the capture than with these. Small batches mean several
/// hand-overs per fixture step, which is cheap only because the writer
/// thread polls for them instead of sleeping until woken, see [`POLL`]) ...
const BATCH_BYTES: usize = 64 * 1024;
/// ... or this many records.
const BATCH_RECORDS: usize = 256;
/// The payload buffer of a batch: a full batch plus room for the record
/// that fills it.
const DATA_CAPACITY: usize = BATCH_BYTES + BATCH_BYTES / 4;
/// How long the writer thread sleeps when it finds no batch waiting. While
/// batches keep coming, the writer polls instead of blocking on the
/// channel, so handing a batch over never has to wake a sleeping thread:
/// that wake-up (a futex system call) cost the runtime's thread tens of
/// microseconds per hand-over on the 2-vCPU machine we measure on
/// (docs/performance.md, "Capture overhead").
const POLL: std::time::Duration = std::time::Duration::from_micros(20);
/// Empty polls in a row after which the writer blocks until the next batch
/// (about 1–4 ms, timer slack included: a run between steps, or one that
/// hands over a batch only every few milliseconds, does not keep a core
/// waking every few tens of microseconds).
const IDLE_POLLS: u32 = 50;
/// F32 records from this size on are handed over as BF16 halves when
/// they can be (smaller ones: not worth the check).
const MIN_HALVED_BYTES: usize = 256;
/// Payloads start at multiples of this in a batch's buffer (the
/// canonicalization scan reads aligned words).
const ALIGN: usize = 64;

/// One record of a batch: everything `TraceWriter::append` takes, with the
/// shape and bytes as ranges of the batch's buffers. The path travels as
/// the runtime gave it: the reference runtime's paths are `'static`
/// ([`RecordPath::from_static`]), so moving one between the threads
/// touches no reference count (a shared path would move its count's cache
/// line between the cores on every record, but stays correct).
struct Item {
    step: u32,
    position: u32,
    phase: Phase,
    layer: Option<u32>,
    path: RecordPath,
    level: Level,
    dtype: DType,
    shape: (usize, usize),
    bytes: (usize, usize),
    keep: bool,
    digest: ItemDigest,
}

/// How an item's record digest is had.
enum ItemDigest {
    /// From its bytes (`Item::bytes`), by the writer.
    Bytes,
    /// From its bytes, which `Item::bytes` holds as the high halves of its
    /// F32 words, whose low halves are zero
    /// ([`moeconf_fingerprint::streaming::extend_streaming_bf16_halves`]).
    Halves,
    /// A growing record the writer keeps a copy of
    /// ([`CaptureThread::append_mirrored`]): `Item::bytes` are its new
    /// bytes, after the first `same` of its `len`; `checked` is the range of
    /// the batch's buffer holding its bytes from `check_at` on, to check
    /// the copy against (a [`MirrorUpdate`] in parts, which keeps items
    /// small and the hand-over free of allocations).
    Mirrored {
        same: usize,
        len: usize,
        check_at: usize,
        checked: (usize, usize),
    },
}

/// Records in emission order and the buffers their shapes and bytes live
/// in (`Default`: no buffers, the placeholder while the current batch
/// is with the writer).
#[derive(Default)]
struct Batch {
    items: Vec<Item>,
    shapes: Vec<u64>,
    data: Vec<u8>,
}

impl Batch {
    /// An empty batch with room for a full one (growing a buffer of this
    /// size by doubling would copy it and fault its pages in on the
    /// runtime's thread).
    fn with_capacity() -> Batch {
        Batch {
            items: Vec::with_capacity(BATCH_RECORDS),
            shapes: Vec::with_capacity(2 * BATCH_RECORDS),
            data: Vec::with_capacity(DATA_CAPACITY),
        }
    }

    /// Empties the batch for reuse; a payload buffer that grew for a record
    /// larger than a batch goes back to its usual size.
    fn clear(&mut self) {
        self.items.clear();
        self.shapes.clear();
        self.data.clear();
        if self.data.capacity() > DATA_CAPACITY {
            self.data.shrink_to(DATA_CAPACITY);
        }
    }

    fn push(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>, keep: bool) {
        let b0 = self.data.len().next_multiple_of(ALIGN);
        self.data.resize(b0, 0);
        // Non-temporal: the writer thread reads these bytes next, and kept
        // in this core's caches they only evict the forward's weights and
        // state (docs/performance.md, "Long context"). F32 records of BF16
        // values (the bf16 profile's activations) move as their high halves.
        let halves = tensor.dtype == DType::F32
            && tensor.bytes.len() >= MIN_HALVED_BYTES
            && moeconf_fingerprint::streaming::extend_streaming_bf16_halves(&mut self.data, tensor.bytes);
        if !halves {
            moeconf_fingerprint::streaming::extend_streaming(&mut self.data, tensor.bytes);
        }
        let bytes = (b0, self.data.len());
        let digest = if halves {
            ItemDigest::Halves
        } else {
            ItemDigest::Bytes
        };
        self.push_item(coord, level, tensor.dtype, tensor.shape, bytes, keep, digest);
    }

    /// A mirrored growing record: its new bytes, then the bytes to check.
    #[allow(clippy::too_many_arguments)]
    fn push_mirrored(
        &mut self,
        coord: Coord,
        level: Level,
        dtype: DType,
        shape: &[u64],
        new: &[u8],
        checked: &[u8],
        update: MirrorUpdate,
    ) {
        let b0 = self.data.len().next_multiple_of(ALIGN);
        self.data.resize(b0, 0);
        moeconf_fingerprint::streaming::extend_streaming(&mut self.data, new);
        let b1 = self.data.len();
        let c0 = b1.next_multiple_of(ALIGN);
        self.data.resize(c0, 0);
        moeconf_fingerprint::streaming::extend_streaming(&mut self.data, checked);
        let digest = ItemDigest::Mirrored {
            same: update.same,
            len: update.len,
            check_at: update.check.start,
            checked: (c0, self.data.len()),
        };
        self.push_item(coord, level, dtype, shape, (b0, b1), false, digest);
    }

    /// The item of a record whose bytes (if any) are `bytes` of the batch.
    #[allow(clippy::too_many_arguments)]
    fn push_item(
        &mut self,
        coord: Coord,
        level: Level,
        dtype: DType,
        shape: &[u64],
        bytes: (usize, usize),
        keep: bool,
        digest: ItemDigest,
    ) {
        let s0 = self.shapes.len();
        self.shapes.extend_from_slice(shape);
        self.items.push(Item {
            step: coord.step,
            position: coord.position,
            phase: coord.phase,
            layer: coord.layer,
            path: coord.path,
            level,
            dtype,
            shape: (s0, self.shapes.len()),
            bytes,
            keep,
            digest,
        });
    }

    /// Whether appending a payload of `bytes` would reallocate a batch
    /// that already holds records.
    fn would_grow(&self, bytes: usize) -> bool {
        !self.items.is_empty() && self.data.len().next_multiple_of(ALIGN) + bytes > self.data.capacity()
    }

    fn full(&self) -> bool {
        self.data.len() >= BATCH_BYTES || self.items.len() >= BATCH_RECORDS
    }
}

/// The first error of the writer thread, as the writer reported it, and
/// a flag the runtime's thread checks on every record.
#[derive(Default)]
struct FailureState {
    set: AtomicBool,
    message: Mutex<Option<String>>,
}

type Failure = Arc<FailureState>;

/// A [`TraceWriter`] running on its own thread, fed in emission order.
pub struct CaptureThread {
    batch: Batch,
    tx: Option<SyncSender<Batch>>,
    /// Batches the writer has emptied, to be filled again.
    free: Receiver<Batch>,
    /// Batches allocated so far (at most [`POOL`]).
    allocated: usize,
    worker: Option<JoinHandle<Result<TraceWriter, TraceError>>>,
    failure: Failure,
}

impl CaptureThread {
    /// Moves `writer` to a new thread; gives it back if the operating
    /// system refuses a thread.
    pub fn spawn_or_return(writer: TraceWriter) -> Result<CaptureThread, Box<TraceWriter>> {
        let (tx, rx) = sync_channel::<Batch>(POOL);
        let (back, free) = sync_channel::<Batch>(POOL);
        let failure: Failure = Arc::default();
        let f = failure.clone();
        // The writer goes to the thread through a slot it can be taken back from.
        let slot = Arc::new(Mutex::new(Some(writer)));
        let theirs = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("moeconf-trace-writer".into())
            .spawn(move || {
                let w = match theirs.lock() {
                    Ok(mut s) => s.take(),
                    Err(p) => p.into_inner().take(),
                };
                match w {
                    Some(w) => write_batches(w, rx, back, f),
                    None => unreachable_writer(),
                }
            });
        let worker = match spawned {
            Ok(h) => Some(h),
            Err(e) => {
                let w = match slot.lock() {
                    Ok(mut s) => s.take(),
                    Err(p) => p.into_inner().take(),
                };
                // The closure never ran, so the writer is still in the slot;
                // should it not be, every record reports why.
                if let Some(w) = w {
                    return Err(Box::new(w));
                }
                if let Ok(mut m) = failure.message.lock() {
                    *m = Some(format!("could not start the trace writer thread: {e}"));
                }
                failure.set.store(true, Ordering::Release);
                None
            }
        };
        Ok(CaptureThread {
            batch: Batch::with_capacity(),
            tx: Some(tx),
            free,
            allocated: 1,
            worker,
            failure,
        })
    }

    /// The writer thread's first error, if it failed.
    fn failed(&self) -> Option<String> {
        if !self.failure.set.load(Ordering::Acquire) {
            return None;
        }
        let m = match self.failure.message.lock() {
            Ok(m) => m.clone(),
            Err(p) => p.into_inner().clone(),
        };
        Some(m.unwrap_or_else(|| "the trace writer thread failed".to_string()))
    }

    /// Queues one record (copying its bytes). Fails with the writer's
    /// message once the writer thread has failed.
    pub fn append(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        keep: bool,
    ) -> Result<(), String> {
        self.queue(Some(tensor.bytes.len()), |b| b.push(coord, level, tensor, keep))
    }

    /// Queues a growing fingerprint-only record that the writer thread
    /// digests from its copy of the record ([`crate::growing::Mirrors`]):
    /// only `new`, the bytes after the `update.same` kept ones, and
    /// `checked`, the bytes `update.check` to verify the copy against, are
    /// copied.
    #[allow(clippy::too_many_arguments)]
    pub fn append_mirrored(
        &mut self,
        coord: Coord,
        level: Level,
        dtype: DType,
        shape: &[u64],
        new: &[u8],
        checked: &[u8],
        update: MirrorUpdate,
    ) -> Result<(), String> {
        self.queue(Some(new.len() + checked.len() + ALIGN), |b| {
            b.push_mirrored(coord, level, dtype, shape, new, checked, update)
        })
    }

    /// Adds one record to the current batch with `push`, handing batches
    /// over around it: before, when its `bytes` would make a batch that
    /// holds records reallocate (a buffer only grows for a record larger
    /// than a whole batch); after, when the batch is full. Fails with the
    /// writer's message once the writer thread has failed.
    fn queue(&mut self, bytes: Option<usize>, push: impl FnOnce(&mut Batch)) -> Result<(), String> {
        if let Some(m) = self.failed() {
            return Err(m);
        }
        if bytes.is_some_and(|n| self.batch.would_grow(n)) {
            self.hand_over()?;
        }
        push(&mut self.batch);
        if self.batch.full() {
            self.hand_over()?;
        }
        Ok(())
    }

    /// Sends the current batch to the writer thread and continues in a
    /// batch the writer has emptied, or a new one while fewer than [`POOL`]
    /// exist, or else waits for the writer to empty one.
    fn hand_over(&mut self) -> Result<(), String> {
        self.send_current()?;
        let next = match self.free.try_recv() {
            Ok(b) => Ok(b),
            Err(_) if self.allocated < POOL => {
                self.allocated += 1;
                Ok(Batch::with_capacity())
            }
            Err(_) => self.free.recv(),
        };
        match next {
            Ok(b) => {
                self.batch = b;
                Ok(())
            }
            Err(_) => Err(self.stopped()),
        }
    }

    /// Sends the current batch to the writer thread, leaving an empty,
    /// unallocated one in its place.
    fn send_current(&mut self) -> Result<(), String> {
        // The batch's non-temporal stores are ordered before the hand-over.
        moeconf_fingerprint::streaming::fence();
        let full = std::mem::take(&mut self.batch);
        let sent = self.tx.as_ref().map(|tx| tx.send(full).is_ok()).unwrap_or(false);
        if sent {
            Ok(())
        } else {
            Err(self.stopped())
        }
    }

    /// Why the writer thread stopped: its error, which says why.
    fn stopped(&self) -> String {
        self.failed()
            .unwrap_or_else(|| "the trace writer thread stopped".to_string())
    }

    /// Hands over the last records, waits for the writer thread and
    /// finishes the trace.
    pub fn finish(mut self) -> Result<WriteSummary, TraceError> {
        let pending = !self.batch.items.is_empty();
        if pending {
            // A failure is reported by the join below.
            let _ = self.send_current();
        }
        self.tx = None;
        let writer = match self.worker.take().map(|w| w.join()) {
            Some(Ok(r)) => r?,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => unreachable_writer()?,
        };
        writer.finish()
    }
}

/// A `CaptureThread` always has its worker until `finish` or drop takes it.
fn unreachable_writer() -> Result<TraceWriter, TraceError> {
    Err(TraceError::Io {
        path: std::path::PathBuf::new(),
        what: "finishing the trace",
        source: std::io::Error::other("the trace writer thread was already joined"),
    })
}

impl Drop for CaptureThread {
    fn drop(&mut self) {
        // Unfinished: close the channel and wait, so the writer (and its
        // temporary file) is gone when the drop returns.
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The next batch, in order: polled every [`POLL`] while batches keep
/// coming, waited for after [`IDLE_POLLS`] empty polls; `None` once the
/// runtime's side is gone and every batch it sent has been taken.
fn next_batch(rx: &Receiver<Batch>) -> Option<Batch> {
    for _ in 0..IDLE_POLLS {
        match rx.try_recv() {
            Ok(b) => return Some(b),
            Err(TryRecvError::Empty) => std::thread::sleep(POLL),
            Err(TryRecvError::Disconnected) => return None,
        }
    }
    rx.recv().ok()
}

/// The writer thread: appends every record of every batch in order, and
/// returns the emptied batches to the pool. Stops at the first error
/// (dropping its end of both channels, which the runtime's thread then
/// sees as a stopped writer).
fn write_batches(
    mut writer: TraceWriter,
    rx: Receiver<Batch>,
    back: SyncSender<Batch>,
    failure: Failure,
) -> Result<TraceWriter, TraceError> {
    let mut mirrors = Mirrors::default();
    let mut widened = Vec::new();
    while let Some(mut batch) = next_batch(&rx) {
        if let Err(e) = append_items(&mut writer, &mut mirrors, &batch, &mut widened) {
            let message = moeconf_output::error_chain(&e);
            match failure.message.lock() {
                Ok(mut f) => *f = Some(message),
                Err(p) => *p.into_inner() = Some(message),
            }
            failure.set.store(true, Ordering::Release);
            return Err(e);
        }
        batch.clear();
        // A record larger than a batch widened into a buffer of its size:
        // back to a batch's.
        widened.clear();
        widened.shrink_to(2 * DATA_CAPACITY);
        // Room for every batch of the pool: never full. Fails only once
        // the runtime's side is gone, when nothing needs the batch.
        let _ = back.try_send(batch);
    }
    Ok(writer)
}

/// Appends a batch's records in order: runs of records with bytes through
/// [`TraceWriter::append_batch`] (those handed over as BF16 halves widened
/// first, into `widened`), those with a digest through
/// [`TraceWriter::append_fingerprint`].
fn append_items<'a>(
    writer: &mut TraceWriter,
    mirrors: &mut Mirrors,
    batch: &'a Batch,
    widened: &'a mut Vec<u8>,
) -> Result<(), TraceError> {
    let coord = |item: &Item| Coord {
        step: item.step,
        position: item.position,
        phase: item.phase,
        layer: item.layer,
        path: item.path.clone(),
    };
    // The records handed over as BF16 halves, widened back to their
    // words, in order.
    widened.clear();
    for item in &batch.items {
        if let ItemDigest::Halves = item.digest {
            moeconf_fingerprint::streaming::widen_bf16_halves(
                widened,
                &batch.data[item.bytes.0..item.bytes.1],
            );
        }
    }
    let mut at = 0;
    let mut run: Vec<BatchRecord<'_>> = Vec::new();
    for item in &batch.items {
        let shape = &batch.shapes[item.shape.0..item.shape.1];
        let mut bytes = &batch.data[item.bytes.0..item.bytes.1];
        let digest = match item.digest {
            ItemDigest::Bytes => None,
            ItemDigest::Halves => {
                bytes = &widened[at..at + 2 * bytes.len()];
                at += bytes.len();
                None
            }
            ItemDigest::Mirrored {
                same,
                len,
                check_at,
                checked: (c0, c1),
            } => {
                let c = coord(item);
                let update = MirrorUpdate {
                    same,
                    len,
                    check: check_at..check_at + (c1 - c0),
                };
                match mirrors.digest(
                    &c,
                    item.level,
                    item.dtype,
                    shape,
                    &update,
                    bytes,
                    &batch.data[c0..c1],
                ) {
                    Ok(d) => Some(d),
                    Err(what) => {
                        return Err(TraceError::Invalid {
                            path: writer.path().to_path_buf(),
                            what,
                        })
                    }
                }
            }
        };
        match digest {
            Some(d) => {
                writer.append_batch(std::mem::take(&mut run))?;
                writer.append_fingerprint(coord(item), item.level, item.dtype, shape, d)?;
            }
            None => run.push(BatchRecord {
                coord: coord(item),
                level: item.level,
                tensor: TensorView {
                    dtype: item.dtype,
                    shape,
                    bytes,
                },
                keep_payload: item.keep,
            }),
        }
    }
    writer.append_batch(run)
}

#[cfg(test)]
mod tests {
    use crate::{parse_capture, TraceSink};
    use moeconf_contract::NativeCombine;
    use moeconf_fingerprint::Algorithm;
    use moeconf_reference_runtime::capture::CaptureSink;
    use moeconf_reference_runtime::generate::GenerateOptions;
    use moeconf_reference_runtime::model::Model;
    use moeconf_reference_runtime::precision::Precision;
    use moeconf_schema::{Header, TraceWriter};
    use std::path::Path;

    /// A greedy run of `tokens` tokens into `path`, through the writer
    /// thread or on this thread; `header_tokens` is the binding's
    /// `max_new_tokens` (a smaller value makes the writer refuse a record).
    fn run(
        model: &Model,
        path: &Path,
        threaded: bool,
        tokens: u32,
        header_tokens: u32,
    ) -> Result<(), String> {
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = header_tokens;
        let w = TraceWriter::create(path, Algorithm::Blake3, header).map_err(|e| e.to_string())?;
        let spec = parse_capture("all").map_err(|e| e.to_string())?;
        let mut sink = if threaded {
            TraceSink::new(w, spec)
        } else {
            TraceSink::on_this_thread(w, spec)
        };
        let opts = GenerateOptions {
            max_new_tokens: tokens as usize,
            precision: Precision::Bf16,
            combine: &NativeCombine,
            detokenizer: None,
            allow_non_finite: false,
        };
        model
            .generate(&[1, 2, 3, 4, 5], &opts, &mut sink as &mut dyn CaptureSink)
            .map_err(|e| moeconf_output::error_chain(&e))?;
        sink.finish()
            .map(|_| ())
            .map_err(|e| moeconf_output::error_chain(&e))
    }

    #[test]
    fn the_writer_thread_writes_the_same_bytes_as_the_recording_thread() {
        let dir = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").unwrap();
        let model = Model::load(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("here.bin"), tmp.path().join("thread.bin"));
        run(&model, &a, false, 6, 6).unwrap();
        run(&model, &b, true, 6, 6).unwrap();
        let (x, y) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert!(x.len() > 1 << 20, "a trace with payloads ({} bytes)", x.len());
        assert!(x == y, "the two traces differ");
        // The streaming writer (format version 4, one step's entries in
        // memory) is the one both threads ran, and its file verifies.
        let t = moeconf_schema::Trace::open_verified(&b).unwrap();
        assert_eq!(t.format_version(), moeconf_schema::DEFAULT_FORMAT_VERSION);
        assert_eq!(t.format_version(), 4);
        assert_eq!(t.steps().len(), 6);
    }

    /// Writes a synthetic stream through the writer thread or on this
    /// thread: every step has more records than a batch holds, and one
    /// record larger than a whole batch, so batches are handed over full,
    /// by size and by count, grow for the large record and are reused.
    /// With `pause`, the stream stops after every step for longer than the
    /// writer thread polls, so the writer blocks and is woken again.
    fn synthetic(path: &Path, threaded: bool, pause: bool) -> Vec<u8> {
        use moeconf_fingerprint::{Coord, DType, Level, Phase, TensorView};
        let steps = 4u32;
        let mut header = Header::default();
        header.binding.decoding.max_new_tokens = steps;
        let w = TraceWriter::create(path, Algorithm::Blake3, header).unwrap();
        let (mut here, mut thread) = if threaded {
            (None, super::CaptureThread::spawn_or_return(w).ok())
        } else {
            (Some(w), None)
        };
        let big: Vec<u8> = (0..3 * super::DATA_CAPACITY / 4)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let mut n = 0u64;
        for step in 0..steps {
            for k in 0..(super::BATCH_RECORDS as u32 + 300) {
                let small: Vec<u8> = (0..k % 97)
                    .flat_map(|i| ((i ^ k ^ step) as f32).to_le_bytes())
                    .collect();
                let (bytes, keep) = if k == 7 {
                    (&big[..], step % 2 == 0)
                } else {
                    (&small[..], k % 5 == 0)
                };
                let coord = Coord {
                    step,
                    position: step + k,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: Some(k % 9),
                    path: format!("op.{:03}", k % 50).into(),
                };
                let shape = [(bytes.len() / 4) as u64];
                let view = TensorView {
                    dtype: DType::F32,
                    shape: &shape,
                    bytes,
                };
                match (&mut here, &mut thread) {
                    (Some(w), _) => {
                        w.append(coord, Level::L4, view, keep).unwrap();
                    }
                    (None, Some(t)) => t.append(coord, Level::L4, view, keep).unwrap(),
                    _ => unreachable!(),
                }
                n += 1;
            }
            if pause {
                // Far longer than IDLE_POLLS polls take, timer slack included.
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        let summary = match (here, thread) {
            (Some(w), _) => w.finish().unwrap(),
            (None, Some(t)) => t.finish().unwrap(),
            _ => unreachable!(),
        };
        assert_eq!(summary.records, n);
        std::fs::read(path).unwrap()
    }

    #[test]
    fn batches_larger_records_and_a_bounded_pool_write_the_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let a = synthetic(&tmp.path().join("here.bin"), false, false);
        let b = synthetic(&tmp.path().join("thread.bin"), true, false);
        assert!(a.len() > 4 * super::DATA_CAPACITY, "{} bytes", a.len());
        assert!(a == b, "the two traces differ");
    }

    #[test]
    fn a_writer_that_went_idle_between_steps_writes_the_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let a = synthetic(&tmp.path().join("here.bin"), false, false);
        let b = synthetic(&tmp.path().join("thread.bin"), true, true);
        assert!(a == b, "the two traces differ");
    }

    #[test]
    fn a_record_the_writer_refuses_fails_the_run_and_leaves_no_file() {
        let dir = moeconf_fixtures::ensure_builtin("builtin:tiny-v4").unwrap();
        let model = Model::load(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut messages = Vec::new();
        for threaded in [false, true] {
            let out = tmp.path().join("refused.bin");
            // The binding allows steps 0..2; step 2's first record is refused.
            let e = run(&model, &out, threaded, 5, 2).unwrap_err();
            assert!(e.contains("max_new_tokens"), "{e}");
            let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
            assert!(left.is_empty(), "files left behind: {left:?}");
            messages.push(e);
        }
        // The same writer message, whichever thread the writer ran on.
        assert!(
            messages[1].ends_with(&messages[0]) || messages[0].ends_with(&messages[1]),
            "{messages:?}"
        );
    }

    /// An old entry of a growing state record that changes in place, with
    /// nothing appended there, fails the run with the writer on either
    /// thread (on its own thread the writer finds it, comparing its copy
    /// with the bytes the recording side's sweep sends), naming the bytes,
    /// and no file is left.
    #[test]
    fn an_old_growing_entry_rewritten_in_place_fails_the_run_on_either_thread() {
        use moeconf_fingerprint::{Coord, DType, Level, Phase, TensorView};
        let tmp = tempfile::tempdir().unwrap();
        let entry = |i: usize| -> Vec<u8> {
            (0..512)
                .flat_map(|j| ((i * 512 + j) as f32 * 0.37).sin().to_le_bytes())
                .collect()
        };
        for threaded in [false, true] {
            let out = tmp.path().join("rewritten.bin");
            let mut header = Header::default();
            header.binding.decoding.max_new_tokens = 6;
            let w = TraceWriter::create(&out, Algorithm::Blake3, header).unwrap();
            let spec = parse_capture("default").unwrap();
            let mut sink = if threaded {
                TraceSink::new(w, spec)
            } else {
                TraceSink::on_this_thread(w, spec)
            };
            let mut bytes: Vec<u8> = (0..100).flat_map(entry).collect();
            let mut failed = None;
            for step in 0..6u32 {
                if step == 2 {
                    bytes[100_000] ^= 1; // an old entry changes; nothing was appended there
                }
                bytes.extend(entry(100 + step as usize));
                let shape = [(bytes.len() / 2048) as u64, 512];
                let coord = Coord {
                    step,
                    position: step,
                    phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
                    layer: Some(2),
                    path: "state.compressor.compressed_kv".into(),
                };
                let view = TensorView {
                    dtype: DType::F32,
                    shape: &shape,
                    bytes: &bytes,
                };
                if let Err(e) = sink.record(coord, Level::L2, view) {
                    failed = Some(e.message);
                    break;
                }
            }
            let m = match failed {
                Some(m) => {
                    drop(sink); // as a failed run does: the writer removes its file
                    m
                }
                None => moeconf_output::error_chain(&sink.finish().expect_err("the rewrite fails the run")),
            };
            assert!(
                m.contains("rewritten") && m.contains("state.compressor.compressed_kv"),
                "{m}"
            );
            let (a, b) = crate::growing::stale_range(&m);
            assert!(a <= 100_000 && 100_000 < b, "threaded {threaded}: {m}");
            let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
            assert!(left.is_empty(), "files left behind: {left:?}");
        }
    }
}
