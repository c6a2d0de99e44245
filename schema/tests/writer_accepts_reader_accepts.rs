//! Property: whatever the writer accepts, the reader accepts (docs/format.md
//! §10). A seeded generator (no dependency: SplitMix64) builds random
//! headers and records, valid and invalid, with values at and just past every
//! reader limit: string and dtype/strategy lengths, extra and note counts,
//! ranks, capture bits, shapes whose byte length overflows a u64 (with and
//! without payload), step and phase combinations around `max_new_tokens`,
//! invalid paths, duplicate coordinates. Every refused append must leave the
//! writer as it was, so the records the writer took are exactly what the
//! reader finds; every finished trace must open fully verified with the
//! writer's root, header and records; a refused header or a failed finish
//! leaves no file and no temporary file. Both container versions are
//! drawn (version 2 also refuses a record of an earlier step than one it
//! took).

use moeconf_fingerprint::{Algorithm, Coord, DType, Digest, Level, LevelSet, Phase, TensorView};
use moeconf_schema::{
    Binding, CaptureSpec, Header, Provenance, TensorDigest, Trace, TraceWriter, MAX_STRING,
};
use std::path::Path;

/// SplitMix64: a small, seedable, dependency-free generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// `bad` with probability 4 %, else a choice of `good`.
fn rare<T: Copy>(rng: &mut Rng, bad: T, good: &[T]) -> T {
    if rng.chance(4) {
        bad
    } else {
        rng.pick(good)
    }
}

/// A string of about `len` bytes (multi-byte characters included).
fn text(rng: &mut Rng, len: usize) -> String {
    let mut s = String::with_capacity(len + 4);
    while s.len() < len {
        s.push(rng.pick(&['a', 'z', '0', ' ', 'é', '公']));
    }
    while s.len() > len {
        s.pop();
    }
    s
}

/// A string field: usually short, sometimes at or just over `cap`.
fn field(rng: &mut Rng, cap: usize, big_percent: u64) -> String {
    if rng.chance(big_percent) {
        let len = rng.pick(&[cap - 1, cap, cap + 1, cap + 3]);
        text(rng, len)
    } else {
        let len = rng.below(12) as usize;
        text(rng, len)
    }
}

fn pairs(rng: &mut Rng, sorted: bool) -> Vec<(String, String)> {
    let n = if rng.chance(3) {
        rng.pick(&[4095usize, 4096, 4097])
    } else {
        rng.below(4) as usize
    };
    let mut v: Vec<(String, String)> = (0..n).map(|i| (format!("k{i:05}"), field(rng, 16, 0))).collect();
    if !sorted && n > 1 && rng.chance(15) {
        v.swap(0, n - 1);
    }
    if rng.chance(2) {
        if let Some(p) = v.first_mut() {
            p.1 = text(rng, MAX_STRING as usize + 1);
        }
    }
    v
}

fn header(rng: &mut Rng) -> Header {
    let cap = MAX_STRING as usize;
    let mut tensors: Vec<TensorDigest> = (0..rng.below(4))
        .map(|i| TensorDigest {
            name: format!("t{i}"),
            dtype: field(rng, 64, 8),
            shape: (0..rare(rng, 9, &[0u64, 1, 2, 8]))
                .map(|_| rng.below(5))
                .collect(),
            digest: Digest([rng.below(256) as u8; 32]),
        })
        .collect();
    if tensors.len() > 1 && rng.chance(10) {
        tensors.reverse();
    }
    let mut b = Binding::default();
    b.model.tensors = tensors;
    b.model.name = field(rng, cap, 2);
    b.tokenizer.name = field(rng, cap, 1);
    b.prompt.text = field(rng, cap, 2);
    b.prompt.ids = (0..rng.below(5)).map(|_| rng.next() as u32).collect();
    b.decoding.strategy = field(rng, 64, 10);
    b.decoding.max_new_tokens = rng.pick(&[0, 1, 2, 3, 3, 5, 5, u32::MAX]);
    b.precision = field(rng, cap, 1);
    b.contract = field(rng, 8, 0);
    b.schedule = field(rng, 8, 0);
    // A level above L4 is not representable (`LevelSet`); the reader's
    // refusal of one on the wire is tested by the corruption tests.
    b.capture = CaptureSpec {
        levels: LevelSet::of_mask(rng.pick(&[0, 1, 0b11111, 0b11111, 0b11110])),
        payload_levels: LevelSet::of_mask(rng.pick(&[0, 0b01010, 0b11111])),
    };
    b.canon.fold_negative_zero = rng.chance(50);
    b.extra = pairs(rng, false);
    Header {
        binding: b,
        provenance: Provenance {
            runtime: field(rng, cap, 1),
            version: field(rng, 8, 0),
            threads: rng.next() as u32,
            notes: pairs(rng, true),
        },
    }
}

/// One generated record.
#[derive(Clone)]
struct Gen {
    coord: Coord,
    level: Level,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    keep: bool,
}

fn record(rng: &mut Rng, max_new_tokens: u32, previous: &[Gen]) -> Gen {
    if !previous.is_empty() && rng.chance(5) {
        // A duplicate coordinate and level.
        let p = &previous[rng.below(previous.len() as u64) as usize];
        return p.clone();
    }
    let step = rng.pick(&[
        0,
        1,
        2,
        max_new_tokens.saturating_sub(1),
        max_new_tokens,
        max_new_tokens.saturating_add(1),
    ]);
    let phase = if rng.chance(90) == (step == 0) {
        Phase::Prefill
    } else {
        Phase::Decode
    };
    let path = match rng.below(30) {
        0 => String::new(),
        1 => "x".repeat(129),
        2 => "x".repeat(128),
        3 => "lm logits".into(),
        _ => rng
            .pick(&[
                "token.output",
                "lm.logits",
                "lm.margin",
                "router.topk",
                "moe.combine",
                "state.window_kv",
            ])
            .into(),
    };
    let dtype = rng.pick(&DType::ALL);
    let rank = rng.pick(&[0usize, 1, 1, 1, 2, 2, 3, 8, 9]);
    let mut shape: Vec<u64> = (0..rank).map(|_| rng.below(4)).collect();
    if rank > 0 && rng.chance(15) {
        // Byte lengths at and beyond a u64, with zero dimensions before or after.
        let i = rng.below(rank as u64) as usize;
        shape[i] = rng.pick(&[1 << 32, 1 << 62, 1 << 63, u64::MAX]);
    }
    let want = TensorView::byte_len(dtype, &shape).unwrap_or(u64::MAX);
    let len = if want <= 4096 && rng.chance(92) {
        want as usize
    } else {
        rng.below(9) as usize
    };
    Gen {
        coord: Coord {
            step,
            position: rng.below(8) as u32,
            phase,
            layer: rng.chance(50).then(|| rng.below(3) as u32),
            path: path.as_str().into(),
        },
        level: rng.pick(&Level::ALL),
        dtype,
        shape,
        bytes: (0..len).map(|_| rng.below(256) as u8).collect(),
        keep: rng.chance(60),
    }
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// Runs one generated case; returns (header accepted, records accepted, finished).
fn case(rng: &mut Rng, dir: &Path, n: usize) -> (bool, usize, bool) {
    let path = dir.join(format!("c{n}.bin"));
    let h = header(rng);
    let alg = rng.pick(&[Algorithm::Blake3, Algorithm::Sha256]);
    let version = rng.pick(&[1, 2, 2]);
    let out = moeconf_output::check_output(&path, &moeconf_output::Inputs::new()).unwrap();
    let Ok(mut w) = TraceWriter::create_version(&out, alg, h.clone(), version) else {
        assert!(
            !path.exists() && leftovers(dir).is_empty(),
            "case {n}: a refused header left a file"
        );
        return (false, 0, false);
    };
    let mut taken: Vec<Gen> = vec![];
    let mut tried: Vec<Gen> = vec![];
    for _ in 0..rng.below(10) {
        let g = record(rng, h.binding.decoding.max_new_tokens, &tried);
        let view = TensorView {
            dtype: g.dtype,
            shape: &g.shape,
            bytes: &g.bytes,
        };
        let ok = w.append(g.coord.clone(), g.level, view, g.keep).is_ok();
        if ok {
            taken.push(g.clone());
        }
        tried.push(g);
    }
    let Ok(summary) = w.finish() else {
        assert!(
            !path.exists() && leftovers(dir).is_empty(),
            "case {n}: a failed finish left a file"
        );
        return (true, taken.len(), false);
    };
    let t = Trace::open_verified(&path)
        .unwrap_or_else(|e| panic!("case {n}: the writer accepted, the reader refuses: {e}"));
    assert_eq!(t.root(), summary.root, "case {n}");
    assert_eq!(t.format_version(), version, "case {n}");
    assert_eq!(t.binding(), &h.binding, "case {n}");
    assert_eq!(t.provenance(), &h.provenance, "case {n}");
    assert_eq!(t.records().unwrap().len(), taken.len(), "case {n}");
    for (i, (r, g)) in t.records().unwrap().iter().zip(&taken).enumerate() {
        assert_eq!(
            (&r.coord, r.level, r.dtype, &r.shape[..]),
            (&g.coord, g.level, g.dtype, &g.shape[..])
        );
        if g.keep {
            let p = t.payload_verified(i).unwrap().unwrap();
            assert_eq!(p.len(), g.bytes.len(), "case {n} record {i}");
        }
    }
    std::fs::remove_file(&path).unwrap();
    (true, taken.len(), true)
}

#[test]
fn whatever_the_writer_accepts_the_reader_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let seed = std::env::var("MOECONF_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x006d_6f65_636f_6e66_u64);
    let cases = std::env::var("MOECONF_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let mut rng = Rng(seed);
    let (mut headers, mut records, mut finished) = (0, 0, 0);
    for n in 0..cases {
        let (h, r, f) = case(&mut rng, dir.path(), n);
        headers += usize::from(h);
        records += r;
        finished += usize::from(f);
    }
    // The generator exercises both sides of the limits.
    assert!(
        headers > cases / 10 && headers < cases,
        "{headers} of {cases} headers accepted"
    );
    assert!(finished > cases / 10, "{finished} of {cases} traces finished");
    assert!(records > cases / 2, "{records} records accepted");
    eprintln!(
        "{cases} cases: {headers} headers accepted, {finished} traces finished, {records} records accepted"
    );
    assert!(leftovers(dir.path()).is_empty());
}
