//! Paged traces for the `lies` target (docs/format.md §11.9): generated
//! format version 4 BLAKE3 traces with a long prompt, so that step 0's
//! per-layer groups are longer than one page (128 KiB of preimage: about
//! 4,100 records) and are stored as page blocks under a page table, and
//! candidates that differ from them inside a page, at a record two pages
//! share, in several pages, by one record fewer (another page layout), or
//! only outside the paged groups.
//!
//! Writing a paged trace costs tens of milliseconds (some 20,000 records),
//! a hundred times a fuzz execution's budget, so each base and candidate is
//! written once per process ([`base`], [`candidate`]) and every execution
//! lies about a copy of its bytes.

use crate::gen::{GenOptions, Record, TraceSpec};
use crate::lies::Model;
use arbitrary::Unstructured;
use moeconf_fingerprint::{Algorithm, Component, DType, LevelSet};
use moeconf_schema::v2::FORMAT_V4;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

/// How many paged bases there are.
pub const BASES: usize = 2;
/// How many candidates each base has ([`candidate`]).
pub const CANDIDATES: usize = 8;

/// The prompt length of base `i` and the levels it keeps. Base 0: 700
/// positions at L0, L1 and L3, its L3 group (6 records a position, 4,200)
/// 2 pages. Base 1: 1,024 positions at L0 and L4, its L4 group (3 + k
/// records a position) at least 4,096 records, 2 pages; for k = 1 the
/// second page holds only the prefix's overhang (45 bytes: two records,
/// both straddling). The other levels are left out (to keep an execution
/// cheap: a command's cost grows with the records).
fn shape(i: usize) -> (u32, LevelSet) {
    if i.is_multiple_of(2) {
        (700, LevelSet::of_mask(0b01011))
    } else {
        (1024, LevelSet::of_mask(0b10001))
    }
}

/// `n` deterministic bytes from a SplitMix64 stream seeded with `seed`.
fn stream(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// The content of base `i`: a generated run with a long prompt, one layer,
/// the levels of `shape` (payload levels drawn among them), BLAKE3,
/// format version 4.
pub fn base_spec(i: usize) -> TraceSpec {
    for attempt in 0..64u64 {
        let data = stream(0x9a9e_d000 + 97 * i as u64 + attempt, 1 << 18);
        let mut u = Unstructured::new(&data);
        let (prompt, keep) = shape(i);
        let opts = GenOptions {
            levels: keep,
            prompt: Some(prompt),
        };
        if let Ok(mut s) = TraceSpec::generate(&mut u, opts) {
            // The levels it keeps, as if captured alone.
            s.records.retain(|r| keep.contains(r.level));
            let capture = &mut s.header.binding.capture;
            capture.levels = keep;
            capture.payload_levels = capture.payload_levels.intersection(keep);
            s.alg = Algorithm::Blake3;
            s.version = FORMAT_V4;
            return s;
        }
    }
    panic!("no paged base {i} could be generated")
}

/// Changes the value of record `r` (its first element).
fn change(r: &mut Record) {
    match r.dtype {
        DType::F32 if r.bytes.len() >= 4 => {
            let x = f32::from_le_bytes([r.bytes[0], r.bytes[1], r.bytes[2], r.bytes[3]]);
            let y = if x.is_finite() && x + 1.0 != x {
                x + 1.0
            } else {
                2.5
            };
            r.bytes[..4].copy_from_slice(&y.to_le_bytes());
        }
        _ => match r.bytes.first_mut() {
            Some(b) => *b ^= 1,
            None => r.bytes.push(1),
        },
    }
}

/// The index in `spec.records` of the record at `(step, level, group)`'s
/// canonical index `k` of the decoded model `m`.
fn find(spec: &TraceSpec, m: &Model, (si, li, gi): (usize, usize, usize), k: usize) -> Option<usize> {
    let e = &m
        .steps
        .get(si)?
        .levels
        .get(li)?
        .groups
        .get(gi)?
        .entries
        .get(k)?
        .entry;
    spec.records
        .iter()
        .position(|r| r.coord == e.coord && r.level == e.level)
}

/// The content of candidate `c` of base `i` (`f` its written bytes):
///
/// 0. the same content;
/// 1. one record in the middle of page 1 of the first paged group changed;
/// 2. the record pages 0 and 1 of that group share changed;
/// 3. its first and last records changed (pages 0 and the last);
/// 4. one record in each page of every paged group changed;
/// 5. one record of that group dropped (another record count: the group
///    is compared whole);
/// 6. the last step's token changed (no paged group differs);
/// 7. 0–3 drawn mutations ([`crate::mutate::mutate`]) from a fixed seed.
pub fn candidate_spec(i: usize, c: usize, spec: &TraceSpec, f: &[u8]) -> TraceSpec {
    let mut g = spec.clone();
    let m = match Model::decode(f) {
        Ok(m) => m,
        Err(e) => panic!("the rewriter refused paged base {i}: {e}"),
    };
    let paged = m.paged_groups();
    let Some(&first) = paged.first() else {
        panic!("paged base {i} holds no paged group");
    };
    let layout_of = |at: (usize, usize, usize)| {
        let l = &m.steps[at.0].levels[at.1];
        m.layout(l.level, &l.groups[at.2])
    };
    let Some(layout) = layout_of(first) else {
        panic!("paged base {i}: its first paged group has no layout");
    };
    let n = layout.records() as usize;
    let mut targets = Vec::new();
    match c {
        0 => {}
        1 => {
            let r = layout.entries(1);
            targets.push((first, ((r.start + r.end) / 2) as usize));
        }
        2 => targets.push((first, layout.entries(1).start as usize)),
        3 => {
            targets.push((first, 0));
            targets.push((first, n - 1));
        }
        4 => {
            for &at in &paged {
                if let Some(l) = layout_of(at) {
                    for j in 0..l.count() {
                        let r = l.entries(j);
                        targets.push((at, (r.start + (r.end - r.start) / 3) as usize));
                    }
                }
            }
        }
        5 => {
            if let Some(x) = find(&g, &m, first, n / 2) {
                g.records.remove(x);
            }
        }
        6 => {
            let last = g.records.iter().map(|r| r.coord.step).max().unwrap_or(0);
            let at = g
                .records
                .iter()
                .rposition(|r| r.coord.step == last && &*r.coord.path == Component::TokenOutput.path());
            if let Some(x) = at {
                change(&mut g.records[x]);
            }
        }
        _ => {
            let data = stream(0x6a11_0000 + 31 * i as u64, 4096);
            if let Ok(x) = crate::mutate::mutate(&mut Unstructured::new(&data), spec) {
                g = x;
            }
        }
    }
    for (at, k) in targets {
        if let Some(x) = find(&g, &m, at, k) {
            change(&mut g.records[x]);
        }
    }
    g.alg = spec.alg;
    g.version = spec.version;
    g
}

type Cache = Mutex<HashMap<(usize, usize), Arc<Vec<u8>>>>;

/// The bytes written for `(base, candidate)` (`usize::MAX`: the base).
fn cached(key: (usize, usize), dir: &Path) -> Arc<Vec<u8>> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(b) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return b;
    }
    let (i, c) = key;
    let spec = base_spec(i);
    let spec = if c == usize::MAX {
        spec
    } else {
        let f = cached((i, usize::MAX), dir);
        candidate_spec(i, c, &spec, &f)
    };
    let path = dir.join(format!("paged-{}-{}-{}.bin", std::process::id(), i, c));
    if let Err(e) = spec.write(&path) {
        if c == usize::MAX {
            panic!("the writer refused paged base {i}: {e}");
        }
        // A candidate the writer refuses (a drawn mutation): the base's bytes.
        return cached((i, usize::MAX), dir);
    }
    let bytes = match std::fs::read(&path) {
        Ok(b) => Arc::new(b),
        Err(e) => panic!("cannot read {}: {e}", path.display()),
    };
    let _ = std::fs::remove_file(&path);
    if c == usize::MAX {
        if let Err(e) =
            moeconf_schema::Trace::from_bytes(&path, bytes.to_vec()).and_then(|t| t.verify_payloads())
        {
            panic!("the reader refused paged base {i}: {e}");
        }
        match Model::decode(&bytes) {
            Ok(m) if !m.paged_groups().is_empty() => {}
            Ok(_) => panic!("paged base {i} holds no paged group"),
            Err(e) => panic!("the rewriter refused paged base {i}: {e}"),
        }
    }
    if let Ok(mut c) = cache.lock() {
        c.insert(key, bytes.clone());
    }
    bytes
}

/// The written bytes of paged base `i` (modulo [`BASES`]), built on first
/// use in `dir` (checked: the reader verifies it, and it holds a paged group).
pub fn base(i: usize, dir: &Path) -> Arc<Vec<u8>> {
    cached((i % BASES, usize::MAX), dir)
}

/// The written bytes of candidate `c` (modulo [`CANDIDATES`]) of base `i`
/// ([`candidate_spec`]), built on first use in `dir`.
pub fn candidate(i: usize, c: usize, dir: &Path) -> Arc<Vec<u8>> {
    cached((i % BASES, c % CANDIDATES), dir)
}
