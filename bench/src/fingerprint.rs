//! The fingerprint throughput benchmark (`moeconf bench fingerprint`): the
//! same f32 buffer hashed as raw bytes with BLAKE3 and through the canonical
//! record path, single- and multi-threaded, measured against each other in
//! the same run. It measures `moeconf-fingerprint` through its public API
//! (`record_digest_with_sink`, `record_digests_in_place`).

use moeconf_fingerprint::{
    record_digest_with_sink, record_digests_in_place, Algorithm, CanonPolicy, Coord, DType, Digest, Level,
    Phase, RecordRef, TensorView,
};

use crate::measure::best_of;

/// `bytes` of deterministic finite f32 values (no NaN, so the canonical
/// path hashes in place; the point is the cost of the scan).
pub fn f32_buffer(bytes: usize) -> Vec<u8> {
    let mut s: u32 = 0x1234_5678;
    let mut v = Vec::with_capacity(bytes);
    while v.len() < bytes {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let x = (s >> 9) as f32 / (1u32 << 23) as f32 - 0.5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

/// Best times (seconds) of hashing one buffer each way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FingerprintBench {
    /// Bytes hashed per measurement.
    pub bytes: usize,
    /// Raw BLAKE3, one thread.
    pub raw_1thread: f64,
    /// Canonical record digest (BLAKE3), one thread.
    pub canonical_1thread: f64,
    /// Raw BLAKE3 over the rayon pool.
    pub raw_rayon: f64,
    /// Canonical record digest (BLAKE3) over the rayon pool.
    pub canonical_rayon: f64,
    /// Canonical record digest with SHA-256, one thread.
    pub canonical_sha256_1thread: f64,
    /// Bytes of the small-record set (data bytes, [`small_records`]).
    pub small_bytes: usize,
    /// The small records digested one by one (`record_digest_with_sink`), one thread.
    pub small_one_by_one: f64,
    /// The same records digested together (`record_digests_in_place`), one thread.
    pub small_batched: f64,
    /// Whether every canonical digest (single- and multi-threaded) agreed,
    /// and the batched small-record digests equal the one-by-one ones.
    pub digests_agree: bool,
}

/// Data lengths of the small-record set: the sizes of one fixture decode
/// step's records (1 KiB operator outputs, 2 KiB attention rows, 4 KiB
/// layer states, odd state buffers), 384 records, about 0.75 MiB.
pub fn small_records() -> Vec<usize> {
    [1024, 1024, 1024, 2048, 4096, 640, 1152, 1792]
        .iter()
        .copied()
        .cycle()
        .take(384)
        .collect()
}

impl FingerprintBench {
    /// Throughput in GB/s of a measurement that took `seconds`.
    pub fn gbps(&self, seconds: f64) -> f64 {
        self.bytes as f64 / seconds / 1e9
    }

    /// The text report of `moeconf bench fingerprint` (`threads`: the rayon
    /// pool's size), with the ratios against the raw-BLAKE3 baseline.
    pub fn render_text(&self, threads: usize) -> String {
        let g = |s: f64| self.gbps(s);
        let (r1, rn) = (
            self.raw_1thread / self.canonical_1thread,
            self.raw_rayon / self.canonical_rayon,
        );
        let scaling = self.canonical_1thread / self.canonical_rayon;
        format!(
            "fingerprint throughput over {} MiB of f32 ({threads} rayon threads)\n\
             \x20 (a) raw BLAKE3, 1 thread          {:>7.2} GB/s\n\
             \x20 (b) canonical record, 1 thread    {:>7.2} GB/s   ratio b/a = {r1:.3}  (target >= 0.90)\n\
             \x20 (c) raw BLAKE3, rayon             {:>7.2} GB/s\n\
             \x20 (d) canonical record, rayon       {:>7.2} GB/s   ratio d/c = {rn:.3}\n\
             \x20 canonical scaling 1 -> {threads} threads: {scaling:.2}x\n\
             \x20 (e) canonical record, SHA-256     {:>7.2} GB/s\n\
             {} records of 0.6-4 KiB ({} KiB), 1 thread\n\
             \x20 (f) one by one                    {:>7.2} GB/s\n\
             \x20 (g) batched (SIMD lanes)          {:>7.2} GB/s   ratio g/f = {:.2}\n",
            self.bytes >> 20,
            g(self.raw_1thread),
            g(self.canonical_1thread),
            g(self.raw_rayon),
            g(self.canonical_rayon),
            g(self.canonical_sha256_1thread),
            small_records().len(),
            self.small_bytes >> 10,
            self.small_bytes as f64 / self.small_one_by_one / 1e9,
            self.small_bytes as f64 / self.small_batched / 1e9,
            self.small_one_by_one / self.small_batched,
        )
    }
}

/// Measures `data` (f32 values) `repeat` times each way. The raw and
/// canonical measurements are interleaved so that load from other processes
/// hits baseline and candidate alike; the best of each is kept.
pub fn bench_fingerprint(data: &[u8], repeat: u32) -> FingerprintBench {
    let shape = [(data.len() / 4) as u64];
    let coord = Coord {
        step: 0,
        position: 0,
        phase: Phase::Decode,
        layer: Some(0),
        path: "bench.tensor".into(),
    };
    let t = TensorView {
        dtype: DType::F32,
        shape: &shape,
        bytes: data,
    };
    let policy = CanonPolicy::default();
    let canonical = |alg: Algorithm, parallel: bool| {
        record_digest_with_sink(alg, policy, &coord, Level::L4, t, parallel, |_| Ok(())).ok()
    };
    let raw = |parallel: bool| {
        let mut h = blake3::Hasher::new();
        if parallel {
            h.update_rayon(data);
        } else {
            h.update(data);
        }
        std::hint::black_box(h.finalize());
    };
    let (mut raw_1, mut canon_1, mut raw_n, mut canon_n) =
        (f64::INFINITY, f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let mut digests = Vec::new();
    for _ in 0..repeat {
        raw_1 = raw_1.min(best_of(1, || raw(false)));
        canon_1 = canon_1.min(best_of(1, || digests.push(canonical(Algorithm::Blake3, false))));
        raw_n = raw_n.min(best_of(1, || raw(true)));
        canon_n = canon_n.min(best_of(1, || digests.push(canonical(Algorithm::Blake3, true))));
    }
    let mut digests_agree = digests.windows(2).all(|w| w[0] == w[1]);
    let sha_1 = best_of(1, || {
        std::hint::black_box(canonical(Algorithm::Sha256, false));
    });
    // The small-record set, cut from the same values.
    let lens = small_records();
    let mut at = 0;
    let shapes: Vec<[u64; 1]> = lens.iter().map(|&n| [(n / 4) as u64]).collect();
    let views: Vec<TensorView<'_>> = lens
        .iter()
        .zip(&shapes)
        .map(|(&n, shape)| {
            let start = at % data.len().saturating_sub(n).max(1);
            at += n;
            TensorView {
                dtype: DType::F32,
                shape,
                bytes: data.get(start..start + n).unwrap_or(&[]),
            }
        })
        .collect();
    let coords: Vec<Coord> = (0..views.len())
        .map(|i| Coord {
            position: i as u32,
            ..coord.clone()
        })
        .collect();
    let refs: Vec<RecordRef<'_>> = coords
        .iter()
        .zip(&views)
        .map(|(c, &tensor)| RecordRef {
            coord: c,
            level: Level::L4,
            tensor,
        })
        .collect();
    let one_by_one = || -> Vec<Option<Digest>> {
        refs.iter()
            .map(|r| {
                record_digest_with_sink(
                    Algorithm::Blake3,
                    policy,
                    r.coord,
                    r.level,
                    r.tensor,
                    false,
                    |_| Ok(()),
                )
                .ok()
            })
            .collect()
    };
    let batched = || record_digests_in_place(Algorithm::Blake3, policy, &refs);
    let (mut small_1, mut small_b) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..repeat.max(5) {
        small_1 = small_1.min(best_of(1, || {
            std::hint::black_box(one_by_one());
        }));
        small_b = small_b.min(best_of(1, || {
            std::hint::black_box(batched());
        }));
    }
    // (Without a vector kernel every record takes the one-record path: `None`.)
    digests_agree &= batched()
        .iter()
        .zip(one_by_one())
        .all(|(b, o)| b.is_none() || *b == o);
    FingerprintBench {
        bytes: data.len(),
        raw_1thread: raw_1,
        canonical_1thread: canon_1,
        raw_rayon: raw_n,
        canonical_rayon: canon_n,
        canonical_sha256_1thread: sha_1,
        small_bytes: views.iter().map(|v| v.bytes.len()).sum(),
        small_one_by_one: small_1,
        small_batched: small_b,
        digests_agree,
    }
}
