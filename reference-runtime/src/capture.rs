//! Capture of L0–L4 tensors through a [`CaptureSink`] (the contract is
//! notes/capture.md): the runtime emits records in execution order, as FP32 /
//! I32 / I64 / U8 little-endian tensors, and skips every level the sink does
//! not want without building its payload. Records are named by catalogue
//! [`Component`]s (their levels are the catalogue's), never by path strings.

use std::cell::RefCell;
use std::collections::BTreeMap;

use moeconf_fingerprint::{Component, Coord, DType, Level, LevelSet, Phase, RecordPath, TensorView};

use crate::error::RuntimeError;

/// A sink refused or failed to store a record.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct CaptureError {
    /// What went wrong (e.g. the trace writer's I/O error).
    pub message: String,
}

impl CaptureError {
    pub fn new(message: impl Into<String>) -> CaptureError {
        CaptureError {
            message: message.into(),
        }
    }
}

/// Receives the tensors the runtime captures.
pub trait CaptureSink {
    /// Whether records of `level` should be built and passed to [`CaptureSink::record`].
    fn wants(&self, level: Level) -> bool;
    /// Stores one record (called in execution order).
    fn record(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError>;
    /// Stores one record whose first `kept` bytes are those of the previous
    /// record of the same path, level and layer (`text.continuation`, which
    /// grows and may change only in its last few bytes). `kept` is a hint
    /// for incremental hashing: the record is the same whatever it says.
    /// Default: [`CaptureSink::record`].
    fn record_grown(
        &mut self,
        coord: Coord,
        level: Level,
        tensor: TensorView<'_>,
        kept: usize,
    ) -> Result<(), CaptureError> {
        let _ = kept;
        self.record(coord, level, tensor)
    }
    /// Where the forward is, before each layer of each position (for
    /// progress on long runs; whatever is captured). Default: ignored.
    fn progress(&mut self, _at: Progress) {}
}

/// A point of a forward step, for progress reports ([`CaptureSink::progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Forward step (0: the prefill).
    pub step: u32,
    /// Decoder layer about to run.
    pub layer: u32,
    /// Decoder layers of the model.
    pub layers: u32,
    /// Positions of this step done through `layer` so far (a chunked
    /// prefill runs every layer over one chunk before the next).
    pub done: u64,
    /// Positions of this step.
    pub positions: u64,
    /// Positions per chunk of a chunked prefill (`positions` when the step
    /// is not chunked): the chunk of `done` starts at the multiple of
    /// `chunk` at or below it.
    pub chunk: u64,
}

/// A sink that wants nothing (for benchmarks of the bare forward).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullSink;

impl CaptureSink for NullSink {
    fn wants(&self, _level: Level) -> bool {
        false
    }
    fn record(&mut self, _coord: Coord, _level: Level, _tensor: TensorView<'_>) -> Result<(), CaptureError> {
        Ok(())
    }
}

/// One owned captured record.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Tensor identity.
    pub coord: Coord,
    pub level: Level,
    pub dtype: DType,
    /// Logical shape.
    pub shape: Vec<u64>,
    /// Little-endian element bytes.
    pub bytes: Vec<u8>,
}

impl Record {
    /// Borrowed view of the tensor.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
        }
    }
    /// The elements as FP32 (empty unless dtype is F32).
    pub fn f32s(&self) -> Vec<f32> {
        self.words(DType::F32, f32::from_le_bytes)
    }
    /// The elements as I32 (empty unless dtype is I32).
    pub fn i32s(&self) -> Vec<i32> {
        self.words(DType::I32, i32::from_le_bytes)
    }
    /// The 4-byte elements decoded with `decode` (empty unless dtype is `want`).
    fn words<T>(&self, want: DType, decode: fn([u8; 4]) -> T) -> Vec<T> {
        if self.dtype != want {
            return Vec::new();
        }
        self.bytes
            .chunks_exact(4)
            .map(|c| decode([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Collects owned records of the wanted levels in memory (tests, small runs).
#[derive(Debug, Clone)]
pub struct MemorySink {
    levels: LevelSet,
    /// The records, in the order they were emitted.
    pub records: Vec<Record>,
}

impl MemorySink {
    /// A sink that wants exactly the levels of `levels`.
    pub fn new(levels: LevelSet) -> MemorySink {
        MemorySink {
            levels,
            records: Vec::new(),
        }
    }
    /// A sink that wants every level.
    pub fn all() -> MemorySink {
        MemorySink::new(LevelSet::ALL)
    }
    /// A sink that wants exactly `levels`.
    pub fn with_levels(levels: &[Level]) -> MemorySink {
        MemorySink::new(levels.iter().copied().collect())
    }
    /// Records whose path equals `path`, in order.
    pub fn by_path<'a>(&'a self, path: &'a str) -> impl Iterator<Item = &'a Record> + 'a {
        self.records.iter().filter(move |r| r.coord.path == path)
    }
}

impl CaptureSink for MemorySink {
    fn wants(&self, level: Level) -> bool {
        self.levels.contains(level)
    }
    fn record(&mut self, coord: Coord, level: Level, tensor: TensorView<'_>) -> Result<(), CaptureError> {
        self.records.push(Record {
            coord,
            level,
            dtype: tensor.dtype,
            shape: tensor.shape.to_vec(),
            bytes: tensor.bytes.to_vec(),
        });
        Ok(())
    }
}

/// Where in a step a record belongs: the token position and the decoder
/// layer (`None` for model-global records).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct At {
    /// Absolute token position.
    pub position: u32,
    /// Decoder layer, or `None` for model-global records.
    pub layer: Option<u32>,
}

impl At {
    /// A model-global record at `position`.
    pub(crate) fn global(position: u32) -> At {
        At {
            position,
            layer: None,
        }
    }

    /// A record of `layer` at `position`.
    pub(crate) fn layer(position: u32, layer: u32) -> At {
        At {
            position,
            layer: Some(layer),
        }
    }
}

/// The record a capture call names: a catalogue component, with the member
/// index for a family (`moe.term.J`). Its level is the catalogue's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Name {
    component: Component,
    index: u32,
}

impl From<Component> for Name {
    fn from(component: Component) -> Name {
        Name { component, index: 0 }
    }
}

impl Name {
    /// Member `index` of the family `component` (`moe.term.J`).
    pub(crate) fn member(component: Component, index: u32) -> Name {
        Name { component, index }
    }

    fn level(self) -> Level {
        self.component.level()
    }

    fn path(self) -> String {
        self.component.indexed_path(self.index)
    }

    /// The path as a `'static` [`RecordPath`]: formatted once per name for
    /// the whole program, then looked up in a per-thread table. A run emits
    /// hundreds of records per step over a few dozen names; formatting each
    /// path was a visible part of the capture's cost on the forward thread,
    /// and so was a shared path's reference count (a locked instruction per
    /// record, which also waits for the record's copy to leave the store
    /// buffer).
    fn record_path(self) -> RecordPath {
        thread_local! {
            /// Paths by component (its declaration order) and member index.
            static PATHS: RefCell<Vec<Vec<Option<&'static &'static str>>>> = const { RefCell::new(Vec::new()) };
        }
        let text = PATHS.with(|paths| {
            let mut paths = paths.borrow_mut();
            let (c, i) = (self.component as usize, self.index as usize);
            if paths.len() <= c {
                paths.resize_with(c + 1, Vec::new);
            }
            let members = &mut paths[c];
            if members.len() <= i {
                members.resize(i + 1, None);
            }
            *members[i].get_or_insert_with(|| static_path(self))
        });
        RecordPath::from_static(text)
    }
}

/// The program's one copy of `name`'s path (its text and a reference to
/// it, see [`RecordPath::from_static`]). Each distinct name is leaked
/// once: their number is bounded by the components and their member
/// indices (the top-k slots of `moe.term.J`), a few hundred short strings,
/// and every thread's table points at the same copies.
fn static_path(name: Name) -> &'static &'static str {
    static ALL: std::sync::Mutex<BTreeMap<(usize, u32), &'static &'static str>> =
        std::sync::Mutex::new(BTreeMap::new());
    let key = (name.component as usize, name.index);
    let mut all = match ALL.lock() {
        Ok(g) => g,
        // A panic while holding the lock cannot leave the map half-updated.
        Err(p) => p.into_inner(),
    };
    all.entry(key)
        .or_insert_with(|| Box::leak(Box::new(&*Box::leak(name.path().into_boxed_str()))))
}

/// Index of the first NaN or infinity of `data`, if any. The common case (all
/// finite) is one branch-free pass that the compiler vectorizes.
#[inline]
pub(crate) fn first_non_finite(data: &[f32]) -> Option<usize> {
    if data.iter().fold(true, |ok, v| ok & v.is_finite()) {
        return None;
    }
    data.iter().position(|v| !v.is_finite())
}

/// Builds coordinates and little-endian payloads for one forward step, and
/// checks every FP32 operator output it is shown for non-finite values.
pub(crate) struct Recorder<'a> {
    sink: &'a mut dyn CaptureSink,
    step: u32,
    phase: Phase,
    want: LevelSet,
    buf: Vec<u8>,
    check_finite: bool,
}

impl<'a> Recorder<'a> {
    /// A recorder of forward step `step`; with `check_finite`, a NaN or
    /// infinity in any checked output is a [`RuntimeError::NonFinite`].
    pub(crate) fn new(
        sink: &'a mut dyn CaptureSink,
        step: u32,
        phase: Phase,
        check_finite: bool,
    ) -> Recorder<'a> {
        let want = Level::ALL.into_iter().filter(|&l| sink.wants(l)).collect();
        Recorder {
            sink,
            step,
            phase,
            want,
            buf: Vec::new(),
            check_finite,
        }
    }

    /// Fails with [`RuntimeError::NonFinite`] if `data`, the output `name`
    /// at `at`, holds a NaN or an infinity (and the run checks), whether or
    /// not the record is captured.
    #[inline]
    pub(crate) fn check(&self, name: impl Into<Name>, at: At, data: &[f32]) -> Result<(), RuntimeError> {
        if !self.check_finite {
            return Ok(());
        }
        match first_non_finite(data) {
            None => Ok(()),
            Some(index) => Err(RuntimeError::NonFinite {
                step: self.step,
                layer: at.layer,
                position: at.position,
                path: name.into().path(),
                index,
                value: data[index],
            }),
        }
    }

    #[inline]
    pub(crate) fn wants(&self, level: Level) -> bool {
        self.want.contains(level)
    }

    /// Reports progress to the sink ([`CaptureSink::progress`]).
    #[inline]
    pub(crate) fn progress(&mut self, at: Progress) {
        self.sink.progress(at);
    }

    fn coord(&self, name: Name, at: At) -> Coord {
        Coord {
            step: self.step,
            position: at.position,
            phase: self.phase,
            layer: at.layer,
            path: name.record_path(),
        }
    }

    /// Passes `self.buf` to the sink as the payload of `name`.
    fn emit(&mut self, name: Name, at: At, dtype: DType, shape: &[u64]) -> Result<(), CaptureError> {
        let coord = self.coord(name, at);
        let bytes = std::mem::take(&mut self.buf);
        let r = self.sink.record(
            coord,
            name.level(),
            TensorView {
                dtype,
                shape,
                bytes: &bytes,
            },
        );
        self.buf = bytes;
        r
    }

    /// An FP32 record of logical shape `shape`. Operator outputs are checked
    /// for non-finite values ([`Recorder::check`]) even when not captured;
    /// L2 state records are not re-checked here (state is checked where it
    /// is produced, so the whole cache is not scanned again every step).
    pub(crate) fn f32(
        &mut self,
        name: impl Into<Name>,
        at: At,
        shape: &[u64],
        data: &[f32],
    ) -> Result<(), RuntimeError> {
        let name = name.into();
        if name.level() != Level::L2 {
            self.check(name, at, data)?;
        }
        if !self.wants(name.level()) {
            return Ok(());
        }
        #[cfg(target_endian = "little")]
        {
            // f32 in memory is already the little-endian payload: no copy.
            let coord = self.coord(name, at);
            let bytes: &[u8] = bytemuck::cast_slice(data);
            self.sink
                .record(
                    coord,
                    name.level(),
                    TensorView {
                        dtype: DType::F32,
                        shape,
                        bytes,
                    },
                )
                .map_err(RuntimeError::from)
        }
        #[cfg(not(target_endian = "little"))]
        {
            self.buf.clear();
            for v in data {
                self.buf.extend_from_slice(&v.to_le_bytes());
            }
            Ok(self.emit(name, at, DType::F32, shape)?)
        }
    }

    /// An I32 vector record (ids).
    pub(crate) fn i32(&mut self, name: impl Into<Name>, at: At, data: &[i32]) -> Result<(), RuntimeError> {
        let name = name.into();
        if !self.wants(name.level()) {
            return Ok(());
        }
        self.buf.clear();
        for v in data {
            self.buf.extend_from_slice(&v.to_le_bytes());
        }
        Ok(self.emit(name, at, DType::I32, &[data.len() as u64])?)
    }

    /// An I64 scalar record (a counter), shape `[1]`.
    pub(crate) fn i64_scalar(&mut self, name: impl Into<Name>, at: At, v: i64) -> Result<(), RuntimeError> {
        let name = name.into();
        if !self.wants(name.level()) {
            return Ok(());
        }
        self.buf.clear();
        self.buf.extend_from_slice(&v.to_le_bytes());
        Ok(self.emit(name, at, DType::I64, &[1])?)
    }

    /// A U8 vector record (UTF-8 text) whose first `kept` bytes are those
    /// of this name's record at the previous step
    /// ([`CaptureSink::record_grown`]); passed without a copy.
    pub(crate) fn grown_bytes(
        &mut self,
        name: impl Into<Name>,
        at: At,
        data: &[u8],
        kept: usize,
    ) -> Result<(), RuntimeError> {
        let name = name.into();
        if !self.wants(name.level()) {
            return Ok(());
        }
        let coord = self.coord(name, at);
        let shape = [data.len() as u64];
        let tensor = TensorView {
            dtype: DType::U8,
            shape: &shape,
            bytes: data,
        };
        Ok(self.sink.record_grown(coord, name.level(), tensor, kept)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_paths_are_one_static_copy_per_name_on_every_thread() {
        let names = [
            Name::from(Component::MoeCombine),
            Name::member(Component::MoeTerm, 0),
            Name::member(Component::MoeTerm, 5),
        ];
        let here: Vec<&'static str> = names.iter().map(|&n| *static_path(n)).collect();
        for (&n, &text) in names.iter().zip(&here) {
            assert_eq!(n.record_path(), n.path());
            assert_eq!(text, n.path());
        }
        let there: Vec<(usize, usize)> = std::thread::spawn(move || {
            names
                .iter()
                .map(|&n| {
                    let p = n.record_path();
                    (p.as_ptr() as usize, p.len())
                })
                .collect()
        })
        .join()
        .unwrap_or_default();
        let here: Vec<(usize, usize)> = here.iter().map(|s| (s.as_ptr() as usize, s.len())).collect();
        assert_eq!(there, here, "another thread gets the same copies");
    }
}
