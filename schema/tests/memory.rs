//! Memory of writing, reading and inspecting large traces, measured with a
//! counting allocator (requested bytes, deterministic): a version 1 index
//! holds one shared allocation per distinct path and shape instead of two
//! per record; a version 2 trace holds a few hundred bytes per step when
//! opened, whatever its record count, and its writer holds one step's
//! entries at a time, whatever the number of steps; `inspect --format json
//! --tensors` streams the weight tensor list instead of building it as one
//! JSON value (which took ~2 KiB per tensor).

use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_output::{check_output, Inputs};
use moeconf_schema::inspect::{InspectOptions, Inspection};
use moeconf_schema::{weights_digest, Binding, CaptureSpec, Header, TensorDigest, Trace, TraceWriter};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live heap bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The counters are process-wide: tests that measure take this lock.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resets the peak to the live bytes and returns them.
fn mark() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

const RECORDS: usize = 100_000;
/// Paths per (step, layer) group: ten records per group of the hash tree.
const PATHS: [&str; 10] = [
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.o",
    "router.scores",
    "router.topk",
    "router.gates",
    "moe.combine",
    "moe.shared",
    "layer.post_ffn_mhc",
];
const TENSORS: usize = 100_000;

fn binding(tensors: Vec<TensorDigest>) -> Binding {
    let mut b = Binding {
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        ..Binding::default()
    };
    b.decoding.max_new_tokens = u32::MAX;
    b.model.weights_digest = weights_digest(Algorithm::Blake3, &tensors);
    b.model.tensors = tensors;
    b
}

fn write(path: &std::path::Path, records: usize, tensors: Vec<TensorDigest>) {
    write_version(path, records, tensors, 1);
}

/// `records` records, ten per (step, layer) group, 61 layers per step, in
/// container format `version`.
fn write_version(path: &std::path::Path, records: usize, tensors: Vec<TensorDigest>, version: u32) {
    let header = Header {
        binding: binding(tensors),
        ..Header::default()
    };
    let out = check_output(path, &Inputs::new()).unwrap();
    let mut w = TraceWriter::create_version(&out, Algorithm::Blake3, header, version).unwrap();
    let ids = [1i32, 2, 3, 4].map(i32::to_le_bytes).concat();
    for i in 0..records {
        let group = (i / PATHS.len()) as u32;
        let coord = Coord {
            step: group / 61,
            position: group / 61,
            phase: if group < 61 { Phase::Prefill } else { Phase::Decode },
            layer: Some(group % 61),
            path: PATHS[i % PATHS.len()].into(),
        };
        let view = TensorView {
            dtype: DType::I32,
            shape: &[4],
            bytes: &ids,
        };
        w.append(coord, Level::L4, view, i % 2 == 0).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn index_and_inspect_memory_stay_compact() {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();

    let p = dir.path().join("records.bin");
    write(&p, RECORDS, vec![]);
    let before = mark();
    let t = Trace::open(&p).unwrap();
    let held = LIVE.load(Ordering::Relaxed) - before;
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let per_record = held / RECORDS;
    // An entry is 120 bytes (the path and shape are shared pointers) plus
    // its share of the hash tree: 135 bytes held, 159 at peak. A String
    // path and a Vec shape per record, and a collected leaf list while the
    // tree was built, made it 174 held and 246 at peak.
    assert!(per_record <= 145, "{per_record} bytes held per record");
    assert!(peak / RECORDS <= 200, "{} bytes peak per record", peak / RECORDS);
    let paths: std::collections::HashSet<*const u8> = t
        .records()
        .unwrap()
        .iter()
        .map(|e| e.coord.path.as_ptr())
        .collect();
    assert_eq!(paths.len(), PATHS.len(), "one allocation per distinct path");
    drop(t);

    // Version 2: opening holds the root block's step list, not the index.
    let p = dir.path().join("records2.bin");
    write_version(&p, RECORDS, vec![], 2);
    let before = mark();
    let t = Trace::open(&p).unwrap();
    let held = LIVE.load(Ordering::Relaxed) - before;
    let steps = t.steps().len();
    assert_eq!(steps, RECORDS.div_ceil(610));
    assert!(
        held <= 1024 + 400 * steps,
        "{held} bytes held for {steps} steps ({RECORDS} records)"
    );
    // Its whole index, when asked for, shares paths like version 1's.
    let paths: std::collections::HashSet<*const u8> = t
        .records()
        .unwrap()
        .iter()
        .map(|e| e.coord.path.as_ptr())
        .collect();
    assert_eq!(paths.len(), PATHS.len(), "one allocation per distinct path");
    drop(t);

    let p = dir.path().join("tensors.bin");
    let mut tensors: Vec<TensorDigest> = (0..TENSORS)
        .map(|i| TensorDigest {
            name: format!("layers.{}.experts.{}.w{}", i / 768, (i / 3) % 256, i % 3),
            dtype: "bf16".into(),
            shape: vec![2048, 7168],
            digest: Algorithm::Blake3.hash(&(i as u64).to_le_bytes()),
        })
        .collect();
    // A binding lists its tensors sorted by name (docs/format.md §5.2; writers refuse otherwise).
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    write(&p, 16, tensors);
    let t = Trace::open(&p).unwrap();
    let opts = InspectOptions {
        verify_payloads: true,
        list_tensors: true,
    };
    let before = mark();
    let i = Inspection::new(&t, opts).unwrap();
    let mut out = CountingSink(0);
    i.write_json(&mut out).unwrap();
    i.write_text(&mut out).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    assert!(out.0 > 100 * TENSORS, "every tensor is listed ({} bytes)", out.0);
    // Streaming: a few KiB of document and buffers, whatever the tensor count.
    assert!(
        peak < 256 << 10,
        "inspect --tensors allocated {peak} bytes at peak"
    );
}

/// The peak heap bytes of writing `steps` steps of 610 records each.
fn writer_peak(dir: &std::path::Path, steps: usize, version: u32) -> usize {
    let p = dir.join(format!("w{steps}-{version}.bin"));
    let before = mark();
    write_version(&p, steps * 610, vec![], version);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    std::fs::remove_file(&p).unwrap();
    peak
}

/// `run`'s memory does not grow with the number of steps: the version 2
/// writer holds the current step's entries (and 124 bytes per finished
/// step), while the version 1 writer holds the whole index.
#[test]
fn writer_memory_does_not_grow_with_the_steps() {
    let _one = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (short, long) = (writer_peak(dir.path(), 10, 2), writer_peak(dir.path(), 200, 2));
    // The 1 MiB write buffer and one step's entries, both runs alike.
    assert!(
        long < short + 200 * 200,
        "writing 200 steps peaked at {long} bytes, 10 steps at {short}"
    );
    let v1 = writer_peak(dir.path(), 200, 1);
    assert!(
        v1 > long + 200 * 610 * 100,
        "version 1 keeps its index ({v1} vs {long})"
    );
}

/// Counts the bytes written.
struct CountingSink(usize);

impl std::io::Write for CountingSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len();
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
