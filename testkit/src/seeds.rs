//! Deterministic fuzz inputs for the default test suite, and the scratch
//! directory the target bodies write into.

use std::path::PathBuf;

/// `n` deterministic inputs of 16–2048 bytes from a SplitMix64 stream
/// seeded with `seed` (the same bytes on every machine).
pub fn inputs(seed: u64, n: usize) -> impl Iterator<Item = Vec<u8>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n).map(move |_| {
        let len = 16 + (next() % 2033) as usize;
        (0..len.div_ceil(8))
            .flat_map(|_| next().to_le_bytes())
            .take(len)
            .collect()
    })
}

/// Where scratch files go: `/dev/shm` when it is a writable directory (the
/// writers sync every file; on a RAM file system that costs nothing),
/// otherwise the system temporary directory.
pub fn scratch_root() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    let writable = std::fs::metadata(&shm).is_ok_and(|m| m.is_dir() && !m.permissions().readonly());
    if writable {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// The scratch directory of a fuzzing process: `moeconf-fuzz-PID` under
/// [`scratch_root`], created on first use (one per process, so parallel
/// fuzzing jobs never share files). Left behind on exit: remove
/// `/dev/shm/moeconf-fuzz-*` after a campaign.
///
/// The first call also gives rayon's global pool a single thread, so that
/// the payload verification and hashing a target triggers do not fan out
/// over pool threads: on a loaded machine every hand-off waits for a CPU,
/// and the fuzzing process otherwise spent most of its time waiting. The
/// calling thread is not made that pool thread (`use_current_thread`):
/// `bisect::open_pair_with` opens one trace on a scoped thread whose rayon
/// work then waited for the fuzzing thread, itself blocked joining that
/// scoped thread, a deadlock on the first `diff` execution. Results never
/// depend on the number of threads (a project rule, tested elsewhere), so
/// this changes speed only.
pub fn fuzz_dir() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        // Fails only when the global pool already exists; then it stays as it is.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(1).build_global();
        let d = scratch_root().join(format!("moeconf-fuzz-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir_all(&d) {
            panic!("cannot create the fuzz scratch directory {}: {e}", d.display());
        }
        d
    })
}
