//! Aggregation contracts against straightforward reimplementations of the
//! paper's equations (section 2.5), the B first-pair quotient (section 2.6),
//! the order enumerations, the exact contract against i128 arithmetic,
//! schedules, forks and the order-sensitivity certificate.
//!
//! Inputs come from a fixed-seed SplitMix64 generator (fewer iterations in
//! debug builds) and deliberately include subnormals, signed zeros, operands
//! whose exponents are far apart, values near overflow, and (where stated)
//! infinities and NaNs with payloads in the high and only in the low 16 bits.

use std::collections::BTreeMap;

use moeconf_contract::{
    all_permutations, b_canonical, b_class_count, b_class_of, b_class_representative,
    b_class_representatives, combine_native, derive_seed, draw_index, index_of_permutation,
    order_sensitivity, parse_fork_order, permutation_from_index, prompt_hash, splitmix64, Accumulator,
    AggregationContract, CombineEvent, ContractError, ExactSum, ForkCombine, ForkPoint, InvarianceProof,
    MoeCombine, NativeCombine, OperandPrecision, Order, OutputRounding, Schedule, ScheduledCombine, Shape,
    CANONICAL_NAN_BITS, DOMAIN_LAYER_STATIC,
};

// ---------------------------------------------------------------------------
// Deterministic inputs
// ---------------------------------------------------------------------------

/// SplitMix64 stream (fixed seeds; no external RNG crate).
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

    fn bits32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }

    /// A finite f32 from a mix of classes chosen to hit the rounding corners.
    fn finite(&mut self) -> f32 {
        let sign = if self.next() & 1 == 1 { 0x8000_0000u32 } else { 0 };
        let frac = self.bits32() & 0x007f_ffff;
        let bits = match self.below(16) {
            // Signed zeros.
            0 => sign,
            // Subnormals.
            1 => sign | frac,
            // Any finite exponent: huge spreads, near-overflow values.
            2 | 3 => sign | ((self.below(255) as u32) << 23) | frac,
            // Values with few significant bits (exact BF16 values and ties).
            4 => sign | ((117 + self.below(20) as u32) << 23) | (frac & 0x007f_8000),
            // Typical activations: 2^-10 .. 2^10.
            _ => sign | ((117 + self.below(20) as u32) << 23) | frac,
        };
        f32::from_bits(bits)
    }

    /// Like [`Rng::finite`], but one value in eight is ±∞ or a NaN.
    fn any(&mut self) -> f32 {
        if self.below(8) != 0 {
            return self.finite();
        }
        let sign = if self.next() & 1 == 1 { 0x8000_0000u32 } else { 0 };
        let bits = match self.below(4) {
            0 => 0x7f80_0000,                                                 // ∞
            1 => 0x7fc0_0000 | (self.bits32() & 0x003f_ffff),                 // quiet NaN
            2 => 0x7f80_0000 | (1 + (self.bits32() & 0xfffe)),                // NaN → ∞ under R_BF16
            _ => 0x7f80_0000 | (0x0001_0000 + (self.bits32() & 0x003e_ffff)), // signalling NaN
        };
        f32::from_bits(sign | bits)
    }
}

/// k terms of length d and a shared output (BF16-valued, as the runtime's).
fn random_event(rng: &mut Rng, k: usize, d: usize, nonfinite: bool) -> (Vec<Vec<f32>>, Vec<f32>) {
    let draw = |rng: &mut Rng| if nonfinite { rng.any() } else { rng.finite() };
    let terms = (0..k).map(|_| (0..d).map(|_| draw(rng)).collect()).collect();
    let shared = (0..d).map(|_| rb(draw(rng))).collect();
    (terms, shared)
}

fn refs(terms: &[Vec<f32>]) -> Vec<&[f32]> {
    terms.iter().map(|t| t.as_slice()).collect()
}

fn iterations(release: usize) -> usize {
    if cfg!(debug_assertions) {
        (release / 20).max(2)
    } else {
        release
    }
}

const EVENT: CombineEvent<'static> = CombineEvent {
    layer: 0,
    step: 0,
    position: 0,
    experts: &[],
    gates: &[],
    units: &[],
};

fn run(c: &dyn MoeCombine, terms: &[Vec<f32>], shared: &[f32]) -> Vec<u32> {
    let mut out = vec![0.0f32; shared.len()];
    c.combine(&EVENT, &refs(terms), shared, &mut out);
    out.iter().map(|x| x.to_bits()).collect()
}

/// Bitwise equality, except that any NaN matches any NaN (the paper's
/// equations say nothing about NaN bits; the contracts canonicalize them).
fn same(got: u32, want: u32) -> bool {
    let nan = |b: u32| b & 0x7fff_ffff > 0x7f80_0000;
    got == want || (nan(got) && nan(want))
}

// ---------------------------------------------------------------------------
// The paper's equations, written out independently
// ---------------------------------------------------------------------------

/// R_BF16 restated from the paper: finite values get the bias 0x7fff + lsb,
/// NaN and ∞ skip it; the low 16 bits are cleared.
fn rb(x: f32) -> f32 {
    let b = x.to_bits();
    let biased = if (b >> 23) & 0xff == 0xff {
        b
    } else {
        b.wrapping_add(0x7fff + ((b >> 16) & 1))
    };
    f32::from_bits(biased & 0xffff_0000)
}

/// P32: a_{j+1} = R_FP32(a_j + v_{π_j}); y = R_BF16(a_k + s).
fn paper_p32(v: &[f32], s: f32, pi: &[usize]) -> f32 {
    let mut a = 0.0f32;
    for &p in pi {
        a += v[p];
    }
    rb(a + s)
}

/// C: a_{j+1} = R_FP32(a_j + FP32(R_BF16(v_{π_j}))); y = R_BF16(a_k + s).
fn paper_c(v: &[f32], s: f32, pi: &[usize]) -> f32 {
    let mut a = 0.0f32;
    for &p in pi {
        a += rb(v[p]);
    }
    rb(a + s)
}

/// A: a_{j+1} = R_BF16(FP32(a_j) + v_{π_j}); y = R_BF16(a_k + s).
fn paper_a(v: &[f32], s: f32, pi: &[usize]) -> f32 {
    let mut a = 0.0f32;
    for &p in pi {
        a = rb(a + v[p]);
    }
    rb(a + s)
}

/// B: a_{j+1} = R_BF16(FP32(a_j) + FP32(R_BF16(v_{π_j}))); y = R_BF16(a_k + R_BF16(s))
/// (the paper's B implementation redundantly rounds s).
fn paper_b(v: &[f32], s: f32, pi: &[usize]) -> f32 {
    let mut a = 0.0f32;
    for &p in pi {
        a = rb(a + rb(v[p]));
    }
    rb(a + rb(s))
}

type Paper = fn(&[f32], f32, &[usize]) -> f32;

fn presets() -> [(&'static str, AggregationContract, Paper); 4] {
    [
        ("p32", AggregationContract::p32(), paper_p32 as Paper),
        ("c", AggregationContract::c(), paper_c),
        ("a", AggregationContract::a(), paper_a),
        ("b", AggregationContract::b(), paper_b),
    ]
}

/// Compares a contract (with the order set to `perm`) against an element-wise equation.
fn check_against_equation(
    name: &str,
    contract: &AggregationContract,
    eq: Paper,
    terms: &[Vec<f32>],
    shared: &[f32],
    perm: &[usize],
) {
    let c = contract.clone().with_order(Order::Permutation(perm.to_vec()));
    let got = run(&c, terms, shared);
    for (d, &g) in got.iter().enumerate() {
        let v: Vec<f32> = terms.iter().map(|t| t[d]).collect();
        let want = eq(&v, shared[d], perm).to_bits();
        assert!(
            same(g, want),
            "{name} perm {perm:?} element {d}: got {g:#010x}, equation {want:#010x}; terms {:08x?} shared {:#010x}",
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            shared[d].to_bits()
        );
        if g & 0x7fff_ffff > 0x7f80_0000 {
            assert_eq!(g, CANONICAL_NAN_BITS, "{name}: NaN outputs are canonical");
        }
    }
}

#[test]
fn presets_match_the_paper_equations_on_finite_terms() {
    let mut rng = Rng(1);
    for _ in 0..iterations(3000) {
        let k = 1 + rng.below(8) as usize;
        let (terms, shared) = random_event(&mut rng, k, 32, false);
        let perm = permutation_from_index(k, rng.below(factorial(k))).unwrap();
        for (name, contract, eq) in presets() {
            check_against_equation(name, &contract, eq, &terms, &shared, &perm);
        }
    }
}

#[test]
fn presets_match_the_paper_equations_with_infinities_and_nans() {
    let mut rng = Rng(2);
    for _ in 0..iterations(3000) {
        let (terms, shared) = random_event(&mut rng, 6, 32, true);
        let perm = permutation_from_index(6, rng.below(720)).unwrap();
        for (name, contract, eq) in presets() {
            check_against_equation(name, &contract, eq, &terms, &shared, &perm);
        }
    }
}

#[test]
fn zero_terms_give_the_rounded_shared_output() {
    // k = 0: a_0 = +0 and y = R_BF16(+0 + s); −0 + +0 = +0.
    let shared = [1.5f32, -0.0, 3.0e-39, f32::from_bits(0x3f80_8000)];
    for (name, contract, eq) in presets() {
        let got = run(&contract, &[], &shared);
        for (d, g) in got.iter().enumerate() {
            assert_eq!(*g, eq(&[], shared[d], &[]).to_bits(), "{name} element {d}");
        }
    }
    assert_eq!(
        run(&AggregationContract::c(), &[], &[-0.0])[0],
        0,
        "+0 accumulator absorbs −0"
    );
}

#[test]
fn fp32_output_rounding_skips_the_final_r_bf16() {
    let mut rng = Rng(3);
    let c = AggregationContract::parse("p32+output=f32").unwrap();
    assert_eq!(c.output, OutputRounding::F32);
    let (terms, shared) = random_event(&mut rng, 6, 64, false);
    let got = run(&c, &terms, &shared);
    for (d, g) in got.iter().enumerate() {
        let mut a = 0.0f32;
        for t in &terms {
            a += t[d];
        }
        assert!(same(*g, (a + shared[d]).to_bits()), "element {d}");
    }
}

#[test]
fn native_equals_c_with_identity_bitwise() {
    let mut rng = Rng(4);
    for i in 0..iterations(300) {
        let k = rng.below(9) as usize;
        let (terms, shared) = random_event(&mut rng, k, 48, i % 2 == 1);
        let mut native = vec![0.0f32; shared.len()];
        combine_native(&refs(&terms), &shared, &mut native);
        let native: Vec<u32> = native.iter().map(|x| x.to_bits()).collect();
        assert_eq!(native, run(&NativeCombine, &terms, &shared));
        assert_eq!(
            native,
            run(&AggregationContract::native(), &terms, &shared),
            "iteration {i}"
        );
        assert_eq!(native, run(&AggregationContract::c(), &terms, &shared));
    }
    assert_eq!(
        AggregationContract::native(),
        AggregationContract::c().with_order(Order::Identity)
    );
}

// ---------------------------------------------------------------------------
// Other accumulators and shapes
// ---------------------------------------------------------------------------

#[test]
fn f64_accumulator_matches_its_equation() {
    // a_{j+1} = fl64(a_j + FP32(R_BF16(v))), FP32(a_k) = a_k as f32, y = R_BF16(FP32(a_k) + s).
    let mut rng = Rng(5);
    for _ in 0..iterations(200) {
        let (terms, shared) = random_event(&mut rng, 6, 32, true);
        let perm = permutation_from_index(6, rng.below(720)).unwrap();
        let got = run(
            &AggregationContract::f64().with_order(Order::Permutation(perm.clone())),
            &terms,
            &shared,
        );
        for (d, g) in got.iter().enumerate() {
            let mut a = 0.0f64;
            for &p in &perm {
                a += f64::from(rb(terms[p][d]));
            }
            let want = rb(a as f32 + shared[d]).to_bits();
            assert!(same(*g, want), "element {d}: {g:#010x} vs {want:#010x}");
        }
    }
}

#[test]
fn tree_shape_matches_its_written_out_equation() {
    // k = 6: ((u0+u1)+(u2+u3))+(u4+u5); k = 5: ((u0+u1)+(u2+u3))+u4; k = 3: (u0+u1)+u2;
    // then +0 + root (maps −0 to +0) and the common merge.
    let mut rng = Rng(6);
    for _ in 0..iterations(200) {
        for k in [1usize, 2, 3, 5, 6] {
            let (terms, shared) = random_event(&mut rng, k, 32, false);
            let got = run(&AggregationContract::tree(), &terms, &shared);
            for (d, g) in got.iter().enumerate() {
                let u: Vec<f32> = terms.iter().map(|t| rb(t[d])).collect();
                let root = match k {
                    1 => u[0],
                    2 => u[0] + u[1],
                    3 => (u[0] + u[1]) + u[2],
                    5 => ((u[0] + u[1]) + (u[2] + u[3])) + u[4],
                    _ => ((u[0] + u[1]) + (u[2] + u[3])) + (u[4] + u[5]),
                };
                let want = rb((0.0f32 + root) + shared[d]).to_bits();
                assert!(same(*g, want), "k {k} element {d}");
            }
        }
    }
}

/// Rounds the integer `n · 2^q` to `p` significant bits, never below the
/// quantum 2^min_exp (f32: 24, −149; bf16: 8, −133), ties to even, overflow
/// from 2^128 to ∞, with i128 arithmetic only: a second formulation
/// independent of the superaccumulator.
fn round_scaled_i128(n: i128, q: i32, p: i32, min_exp: i32) -> f32 {
    if n == 0 {
        return 0.0;
    }
    let mag = n.unsigned_abs();
    let t = 127 - mag.leading_zeros() as i32; // highest set bit
                                              // Quantum exponent of the result: p significant bits, but never below 2^min_exp.
    let qe = (t + q - (p - 1)).max(min_exp);
    let shift = qe - q;
    let (mut m, e) = if shift <= 0 {
        (mag << (-shift) as u32, qe) // exact
    } else {
        let s = shift as u32;
        let floor = mag >> s;
        let rem = mag - (floor << s);
        let half = 1u128 << (s - 1);
        let up = rem > half || (rem == half && floor & 1 == 1);
        (floor + u128::from(up), qe)
    };
    let mut e = e;
    while m >= (1 << p) {
        // Only from a round-up carry: m = 2^p, exact halving.
        m >>= 1;
        e += 1;
    }
    let value = (m as f64) * 2f64.powi(e);
    let magnitude = if value >= 2f64.powi(128) {
        f32::INFINITY
    } else {
        value as f32
    };
    if n < 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// A finite f32 as (integer, exponent) with value = integer · 2^exponent.
fn split(x: f32) -> (i128, i32) {
    let b = x.to_bits();
    let e = ((b >> 23) & 0xff) as i32;
    let f = i128::from(b & 0x007f_ffff);
    let (sig, exp) = if e == 0 {
        (f, -149)
    } else {
        (f | 0x0080_0000, e - 150)
    };
    (if b >> 31 == 1 { -sig } else { sig }, exp)
}

#[test]
fn exact_contract_equals_an_i128_reference() {
    let mut rng = Rng(7);
    // Windows of about 90 binades so that every term, scaled to the window's
    // lowest quantum, fits an i128 with room for the sum: one touching the
    // subnormals, one around 1, one reaching the top of the range (overflow).
    let windows: [(u32, u32); 3] = [(0, 90), (80, 170), (165, 255)];
    for i in 0..iterations(3000) {
        let (lo, hi) = windows[i % 3];
        let k = 1 + rng.below(8) as usize;
        let mut terms: Vec<Vec<f32>> = Vec::with_capacity(k);
        for _ in 0..k {
            let sign = (rng.next() & 1) as u32;
            let exp = (lo + rng.below(u64::from(hi - lo)) as u32).min(254);
            let frac = rng.bits32() & 0x007f_ffff;
            let fresh = f32::from_bits((sign << 31) | (exp << 23) | frac);
            // One term in four cancels the previous one exactly.
            let x = match terms.last() {
                Some(prev) if rng.below(4) == 0 => -prev[0],
                _ => fresh,
            };
            terms.push(vec![x]);
        }
        let q = -149 + (lo as i32 - 1).max(0);
        let mut sum: i128 = 0;
        let mut s = ExactSum::new();
        for t in &terms {
            let (n, e) = split(t[0]);
            sum += n << (e - q) as u32;
            s.add(t[0]);
        }
        let want = round_scaled_i128(sum, q, 24, -149);
        let want_bf16 = round_scaled_i128(sum, q, 8, -133);
        assert_eq!(s.to_f32().to_bits(), want.to_bits(), "terms {:?}", terms);
        assert_eq!(
            s.to_bf16().to_bits(),
            want_bf16.to_bits(),
            "bf16: terms {:?}",
            terms
        );
        // Through the contract, F32 operands, no final rounding and a +0 shared
        // term: y = FP32(a_k) + 0 = FP32(a_k) (an exact sum is never −0).
        let c = AggregationContract::parse("exact+operand=f32+output=f32").unwrap();
        let perm = permutation_from_index(k, rng.below(factorial(k))).unwrap();
        let got = run(&c.with_order(Order::Permutation(perm)), &terms, &[0.0]);
        assert_eq!(got[0], want.to_bits(), "terms {:?}", terms);
        // exact-fused: the last term passed as the shared output is part of the
        // one exact sum, rounded once to the output precision.
        let (routed, shared) = terms.split_at(k - 1);
        let fused = AggregationContract::parse("exact-fused+operand=f32").unwrap();
        assert_eq!(
            run(&fused, routed, &shared[0])[0],
            want_bf16.to_bits(),
            "fused: terms {:?}",
            terms
        );
        let fused32 = AggregationContract::parse("exact-fused+operand=f32+output=f32").unwrap();
        assert_eq!(
            run(&fused32, routed, &shared[0])[0],
            want.to_bits(),
            "fused f32: terms {:?}",
            terms
        );
    }
}

/// One value rounded once to bf16 by the superaccumulator is R_BF16 of it
/// (R_BF16 is tested exhaustively in tests/bf16.rs), over every
/// sign/exponent/top-fraction pattern with boundary low halves.
#[test]
fn exact_bf16_rounding_of_one_value_is_r_bf16() {
    for high in 0u32..=0xffff {
        if (high >> 7) & 0xff == 0xff {
            continue; // NaN and ∞: the exact policy, not R_BF16's bit rule
        }
        for low in [0x0000u32, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff] {
            let x = f32::from_bits((high << 16) | low);
            let mut s = ExactSum::new();
            s.add(x);
            // An exact zero sum is +0 (R_BF16 would keep −0); a nonzero value
            // that underflows keeps its sign, as R_BF16's does.
            let want = if x == 0.0 { 0 } else { rb(x).to_bits() };
            assert_eq!(s.to_bf16().to_bits(), want, "{:#010x}", x.to_bits());
        }
    }
}

#[test]
fn exact_contract_is_order_invariant_including_non_finite_terms() {
    let mut rng = Rng(8);
    for i in 0..iterations(40) {
        let (terms, shared) = random_event(&mut rng, 6, 16, i % 2 == 0);
        for c in [AggregationContract::exact(), AggregationContract::exact_fused()] {
            let cert = order_sensitivity(&c, &refs(&terms), &shared).unwrap();
            assert_eq!((cert.orders, cert.distinct_outputs), (720, 1), "{}", c.describe());
            assert_eq!(cert.proof, Some(InvarianceProof::ExactAccumulator));
        }
    }
}

// ---------------------------------------------------------------------------
// Orders and B classes
// ---------------------------------------------------------------------------

fn factorial(k: usize) -> u64 {
    (1..=k as u64).product()
}

#[test]
fn permutation_index_round_trips_in_lexicographic_order() {
    let all = all_permutations(6).unwrap();
    assert_eq!(all.len(), 720);
    assert_eq!(all[0], vec![0, 1, 2, 3, 4, 5], "index 0 is the identity");
    assert_eq!(all[719], vec![5, 4, 3, 2, 1, 0], "the last index is the reversal");
    for (i, p) in all.iter().enumerate() {
        assert_eq!(index_of_permutation(p).unwrap(), i as u64);
        assert_eq!(&permutation_from_index(6, i as u64).unwrap(), p);
        if i > 0 {
            assert!(all[i - 1] < *p, "strictly increasing lexicographically at {i}");
        }
    }
    assert_eq!(
        all_permutations(3).unwrap(),
        vec![
            vec![0, 1, 2],
            vec![0, 2, 1],
            vec![1, 0, 2],
            vec![1, 2, 0],
            vec![2, 0, 1],
            vec![2, 1, 0]
        ]
    );
    assert!(matches!(
        permutation_from_index(6, 720),
        Err(ContractError::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        index_of_permutation(&[0, 0, 1]),
        Err(ContractError::NotAPermutation { .. })
    ));
    assert!(matches!(
        index_of_permutation(&[0, 3, 1]),
        Err(ContractError::NotAPermutation { .. })
    ));
    // 20! fits a u64: the largest index round-trips.
    let last = factorial(20) - 1;
    assert_eq!(
        index_of_permutation(&permutation_from_index(20, last).unwrap()).unwrap(),
        last
    );
    assert!(permutation_from_index(21, 0).is_err());
}

#[test]
fn seven_hundred_twenty_permutations_collapse_to_360_b_classes_of_two() {
    let mut classes: BTreeMap<u64, Vec<Vec<usize>>> = BTreeMap::new();
    for p in all_permutations(6).unwrap() {
        classes.entry(b_class_of(&p).unwrap()).or_default().push(p);
    }
    assert_eq!(classes.len(), 360);
    assert_eq!(*classes.keys().last().unwrap(), 359, "class ids are 0..360");
    let reps = b_class_representatives(6).unwrap();
    assert_eq!(reps.len(), 360);
    for (id, members) in &classes {
        assert_eq!(members.len(), 2, "class {id}");
        let (x, y) = (&members[0], &members[1]);
        assert_eq!(
            (x[0], x[1], &x[2..]),
            (y[1], y[0], &y[2..]),
            "members differ by the first-pair swap"
        );
        let rep = &reps[*id as usize];
        assert!(
            rep[0] < rep[1] && (rep == x || rep == y),
            "class {id} representative {rep:?}"
        );
        assert_eq!(b_canonical(x), *rep);
        assert_eq!(b_class_representative(6, *id).unwrap(), *rep);
    }
    // Class ids number the representatives in lexicographic order.
    assert!(reps.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(reps[0], vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(reps[359], vec![4, 5, 3, 2, 1, 0]);
    for k in 0..=7 {
        let n = b_class_count(k).unwrap();
        assert_eq!(n, if k < 2 { 1 } else { factorial(k) / 2 }, "k = {k}");
        assert_eq!(b_class_representatives(k).unwrap().len() as u64, n);
        for p in all_permutations(k).unwrap() {
            assert_eq!(
                b_class_representative(k, b_class_of(&p).unwrap()).unwrap(),
                b_canonical(&p)
            );
        }
    }
    assert!(matches!(
        b_class_representative(6, 360),
        Err(ContractError::ClassOutOfRange { .. })
    ));
}

fn swap_first_pair(p: &[usize]) -> Vec<usize> {
    let mut q = p.to_vec();
    q.swap(0, 1);
    q
}

/// Property: B(π) == B(π with its first two entries swapped) bitwise, over
/// every permutation of many random finite term sets (section 2.6); it also
/// holds with ±∞ and NaN once NaN bits are canonical, which the contract
/// guarantees.
#[test]
fn b_is_invariant_under_the_first_pair_swap() {
    let mut rng = Rng(9);
    let b = AggregationContract::b();
    let perms = all_permutations(6).unwrap();
    for i in 0..iterations(300) {
        let (terms, shared) = random_event(&mut rng, 6, 16, i % 4 == 3);
        let t = refs(&terms);
        let mut x = vec![0.0f32; 16];
        let mut y = vec![0.0f32; 16];
        for p in &perms {
            b.try_combine_with_permutation(p, &t, &shared, &mut x).unwrap();
            b.try_combine_with_permutation(&swap_first_pair(p), &t, &shared, &mut y)
                .unwrap();
            let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let yb: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
            assert_eq!(xb, yb, "iteration {i} perm {p:?}");
        }
    }
}

/// A does not merge a permutation with its first-pair swap: 1 + 2^-8 is a
/// BF16 tie that rounds down to 1 when it enters the accumulator first, but
/// 2^-8 entering first survives and the sum rounds up to 1 + 2^-7.
#[test]
fn a_distinguishes_permutations_that_differ_only_in_the_first_pair() {
    let v0 = f32::from_bits(0x3f80_8000); // 1 + 2^-8, not a BF16 value
    let v1 = f32::from_bits(0x3b80_0000); // 2^-8
    let mut terms = vec![vec![v0], vec![v1]];
    terms.extend([0.0f32, 0.0, 0.0, 0.0].iter().map(|&z| vec![z]));
    let shared = [0.0f32];
    let a = AggregationContract::a();
    let p = vec![0, 1, 2, 3, 4, 5];
    let y01 = run(
        &a.clone().with_order(Order::Permutation(p.clone())),
        &terms,
        &shared,
    )[0];
    let y10 = run(
        &a.clone().with_order(Order::Permutation(swap_first_pair(&p))),
        &terms,
        &shared,
    )[0];
    assert_eq!(y01, 0x3f80_0000, "1");
    assert_eq!(y10, 0x3f81_0000, "1 + 2^-7");
    // B rounds both operands first (1 + 2^-8 → 1), so the two orders agree.
    let b = AggregationContract::b();
    let b01 = run(
        &b.clone().with_order(Order::Permutation(p.clone())),
        &terms,
        &shared,
    )[0];
    let b10 = run(
        &b.with_order(Order::Permutation(swap_first_pair(&p))),
        &terms,
        &shared,
    )[0];
    assert_eq!(b01, b10);
    // Over all 720 orders A has more distinct outputs than B's 360 classes allow.
    let mut rng = Rng(10);
    let found = (0..50).any(|_| {
        let (terms, shared) = random_event(&mut rng, 6, 64, false);
        let ca = order_sensitivity(&AggregationContract::a(), &refs(&terms), &shared).unwrap();
        let cb = order_sensitivity(&AggregationContract::b(), &refs(&terms), &shared).unwrap();
        assert!(cb.distinct_outputs <= 360);
        ca.distinct_outputs > 360
    });
    assert!(found, "some random state separates more than 360 A orders");
}

// ---------------------------------------------------------------------------
// Certificate
// ---------------------------------------------------------------------------

#[test]
fn certificate_proof_implies_a_single_output() {
    let mut rng = Rng(11);
    let families = [
        AggregationContract::p32(),
        AggregationContract::c(),
        AggregationContract::a(),
        AggregationContract::b(),
        AggregationContract::tree(),
        AggregationContract::f64(),
    ];
    let mut proven = 0;
    let mut sensitive = 0;
    for i in 0..iterations(60) {
        // Small-integer-valued terms times a random power of two: often
        // provably exact in FP32, sometimes not in BF16.
        let scale = f32::from_bits((100 + rng.below(50) as u32) << 23);
        let terms: Vec<Vec<f32>> = (0..6)
            .map(|_| {
                (0..8)
                    .map(|_| (rng.below(1 << (4 + i % 18)) as f32 - 1000.0) * scale)
                    .collect()
            })
            .collect();
        let shared: Vec<f32> = (0..8).map(|_| rb(rng.finite())).collect();
        for f in &families {
            let cert = order_sensitivity(f, &refs(&terms), &shared).unwrap();
            assert_eq!(cert.orders, 720);
            if cert.proof.is_some() {
                proven += 1;
                assert_eq!(
                    cert.distinct_outputs,
                    1,
                    "{} proven but order-sensitive",
                    f.describe()
                );
                assert_eq!(cert.sensitive_elements, 0);
                assert!(cert.is_order_invariant());
            }
            if cert.distinct_outputs > 1 {
                sensitive += 1;
                assert!(cert.sensitive_elements > 0);
            }
        }
    }
    assert!(
        proven > 0 && sensitive > 0,
        "the inputs exercise both outcomes ({proven}, {sensitive})"
    );
}

#[test]
fn certificate_counts_distinct_outputs() {
    // Element 0: 1 + 2^-24 + 2^-24 in FP32 depends on the order (P32).
    let terms = vec![vec![1.0f32], vec![f32::EPSILON / 2.0], vec![f32::EPSILON / 2.0]];
    let shared = [0.0f32];
    let p32 = AggregationContract::parse("p32+output=f32").unwrap();
    let cert = order_sensitivity(&p32, &refs(&terms), &shared).unwrap();
    // Orders starting with 1.0 lose both halves (ties to even); the others keep them.
    assert_eq!(
        (
            cert.orders,
            cert.distinct_outputs,
            cert.sensitive_elements,
            cert.proof
        ),
        (6, 2, 1, None)
    );
    let exact = AggregationContract::parse("exact+operand=f32+output=f32").unwrap();
    let cert = order_sensitivity(&exact, &refs(&terms), &shared).unwrap();
    assert_eq!(cert.distinct_outputs, 1);
    let too_many: Vec<Vec<f32>> = (0..9).map(|_| vec![0.0]).collect();
    assert!(matches!(
        order_sensitivity(&p32, &refs(&too_many), &shared),
        Err(ContractError::TooManyTerms { .. })
    ));
}

// ---------------------------------------------------------------------------
// Parsing and description
// ---------------------------------------------------------------------------

#[test]
fn presets_parse_case_insensitively_and_describe_round_trips() {
    let expected = [
        ("native", AggregationContract::c()),
        ("P32", AggregationContract::p32()),
        ("c", AggregationContract::c()),
        ("A", AggregationContract::a()),
        ("b", AggregationContract::b()),
        ("Exact", AggregationContract::exact()),
        ("TREE", AggregationContract::tree()),
        ("f64", AggregationContract::f64()),
        ("Exact-Fused", AggregationContract::exact_fused()),
    ];
    for (s, c) in expected {
        assert_eq!(AggregationContract::parse(s).unwrap(), c, "{s}");
        assert_eq!(AggregationContract::parse(&c.describe()).unwrap(), c);
    }
    let b = AggregationContract::parse("b+order=135").unwrap();
    assert_eq!(b.order, Order::BClass(135), "a bare integer is a B class for b");
    assert_eq!(b.describe(), "b+order=class:135");
    let c = AggregationContract::parse("c+order=135").unwrap();
    assert_eq!(
        c.order,
        Order::PermutationIndex(135),
        "and a permutation index otherwise"
    );
    let custom =
        AggregationContract::parse("operand=f32+accumulator=exact+shape=tree+order=perm:1,0,2").unwrap();
    assert_eq!(
        (custom.operand, custom.accumulator, custom.shape),
        (OperandPrecision::F32, Accumulator::Exact, Shape::PairwiseTree)
    );
    assert_eq!(AggregationContract::parse(&custom.describe()).unwrap(), custom);
    for bad in [
        "",
        "d",
        "native2",
        "b+order",
        "b+colour=red",
        "c+acc=f16",
        "b+order=perm:1,x",
    ] {
        assert!(
            AggregationContract::parse(bad).is_err(),
            "{bad:?} must be rejected"
        );
    }
    let msg = AggregationContract::parse("z").unwrap_err().to_string();
    assert!(msg.contains("native, p32, c, a, b, exact, tree, f64"), "{msg}");
}

#[test]
fn orders_parse_and_resolve() {
    let b = AggregationContract::b();
    assert_eq!(parse_fork_order("135", &b).unwrap(), Order::BClass(135));
    assert_eq!(
        parse_fork_order("5", &AggregationContract::a()).unwrap(),
        Order::PermutationIndex(5)
    );
    assert_eq!(
        Order::parse("3,1,0,2,4,5", false).unwrap(),
        Order::Permutation(vec![3, 1, 0, 2, 4, 5])
    );
    assert_eq!(Order::parse("Identity", true).unwrap(), Order::Identity);
    assert_eq!(
        Order::parse("index:719", true).unwrap().resolve(6).unwrap(),
        vec![5, 4, 3, 2, 1, 0]
    );
    assert_eq!(
        Order::BClass(135).resolve(6).unwrap(),
        b_class_representative(6, 135).unwrap()
    );
    assert!(Order::Permutation(vec![0, 1, 2]).resolve(6).is_err());
    assert!(Order::BClass(360).resolve(6).is_err());
    for bad in ["", "perm:", "class:x", "-1", "1,,2"] {
        assert!(Order::parse(bad, true).is_err(), "{bad:?} must be rejected");
    }
    // A contract whose order does not fit k fails in try_combine, not silently.
    let c = AggregationContract::c().with_order(Order::PermutationIndex(720));
    assert!(c.validate_for_k(6).is_err());
    let terms = vec![vec![1.0f32]; 6];
    assert!(c.try_combine(&refs(&terms), &[0.0], &mut [0.0]).is_err());
    let short = vec![vec![1.0f32], vec![]];
    assert!(matches!(
        AggregationContract::c().try_combine(&refs(&short), &[0.0], &mut [0.0]),
        Err(ContractError::LengthMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------
// Schedules and forks
// ---------------------------------------------------------------------------

#[test]
fn hash_functions_match_published_vectors() {
    // SplitMix64 from state 0 (Vigna's reference splitmix64.c).
    assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    assert_eq!(splitmix64(0x9e37_79b9_7f4a_7c15), 0x6e78_9e6a_a1b9_65f4);
    // 64-bit FNV-1a.
    assert_eq!(prompt_hash(""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(prompt_hash("a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(prompt_hash("foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn schedules_parse() {
    assert_eq!(Schedule::parse("identity").unwrap(), Schedule::Identity);
    assert_eq!(
        Schedule::parse("Layer-Static:7").unwrap(),
        Schedule::LayerStatic {
            experiment_seed: 20_260_722,
            request_seed: 7
        }
    );
    let td = Schedule::parse("token-dynamic:7:9").unwrap();
    assert_eq!(
        td,
        Schedule::TokenDynamic {
            experiment_seed: 9,
            request_seed: 7
        }
    );
    assert_eq!(Schedule::parse(&td.to_string()).unwrap(), td);
    for bad in [
        "",
        "static:1",
        "layer-static",
        "layer-static:",
        "layer-static:-1",
        "layer-static:1:2:3",
    ] {
        assert!(Schedule::parse(bad).is_err(), "{bad:?} must be rejected");
    }
}

fn event(layer: u32, step: u32, position: u32) -> CombineEvent<'static> {
    CombineEvent {
        layer,
        step,
        position,
        experts: &[],
        gates: &[],
        units: &[],
    }
}

#[test]
fn layer_static_reuses_one_permutation_per_layer_and_token_dynamic_varies() {
    let h = prompt_hash("why the sheep");
    let ls = Schedule::parse("layer-static:3").unwrap();
    let td = Schedule::parse("token-dynamic:3").unwrap();
    let mut per_layer = Vec::new();
    for layer in 0..8u32 {
        let i = ls.permutation_index(h, layer, 0, 6).unwrap();
        for pos in 0..40 {
            assert_eq!(
                ls.permutation_index(h, layer, pos, 6),
                Some(i),
                "layer-static is position-free"
            );
        }
        assert!(i < 720);
        per_layer.push(i);
        // The documented derivation, spelled out.
        let seed = derive_seed(DOMAIN_LAYER_STATIC, &[20_260_722, 3, h, u64::from(layer)]);
        assert_eq!(i, draw_index(seed, 720));
    }
    per_layer.sort_unstable();
    per_layer.dedup();
    assert!(
        per_layer.len() > 4,
        "layers get different permutations: {per_layer:?}"
    );
    let dynamic: std::collections::BTreeSet<u64> = (0..40)
        .map(|pos| td.permutation_index(h, 5, pos, 6).unwrap())
        .collect();
    assert!(dynamic.len() > 20, "token-dynamic varies with the position");
    // Request seed and prompt both matter.
    let other = Schedule::parse("layer-static:4").unwrap();
    assert!((0..8).any(|l| other.permutation_index(h, l, 0, 6) != ls.permutation_index(h, l, 0, 6)));
    assert!((0..8).any(|l| ls.permutation_index(h ^ 1, l, 0, 6) != ls.permutation_index(h, l, 0, 6)));
    assert_eq!(Schedule::Identity.permutation_index(h, 0, 0, 6), None);
}

#[test]
fn scheduled_combine_applies_the_scheduled_permutation() {
    let mut rng = Rng(12);
    let h = prompt_hash("朋友昨天打来电话");
    let schedule = Schedule::parse("token-dynamic:11").unwrap();
    let sc = ScheduledCombine::new(AggregationContract::a(), schedule.clone(), h);
    sc.validate_for_k(6).unwrap();
    for pos in 0..10 {
        let (terms, shared) = random_event(&mut rng, 6, 32, false);
        let ev = event(2, pos, pos);
        let mut got = vec![0.0f32; 32];
        sc.combine(&ev, &refs(&terms), &shared, &mut got);
        let idx = schedule.permutation_index(h, 2, pos, 6).unwrap();
        let want = run(
            &AggregationContract::a().with_order(Order::PermutationIndex(idx)),
            &terms,
            &shared,
        );
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
    }
    let identity = ScheduledCombine::new(AggregationContract::c(), Schedule::Identity, h);
    let (terms, shared) = random_event(&mut rng, 6, 32, false);
    assert_eq!(
        run(&identity, &terms, &shared),
        run(&NativeCombine, &terms, &shared)
    );
    assert_eq!(identity.describe(), "c");
}

#[test]
fn fork_changes_only_the_forked_event() {
    let mut rng = Rng(13);
    let point = ForkPoint::first_decode(5);
    assert_eq!((point.layer, point.step, point.position), (5, 1, None));
    // A contract that visibly differs from native: B in the reversed order.
    let b = AggregationContract::b().with_order(Order::PermutationIndex(719));
    let fork = ForkCombine::new(point, b.clone());
    let mut differed = false;
    for (layer, step) in [(5u32, 1u32), (5, 0), (5, 2), (4, 1), (6, 1)] {
        let (terms, shared) = random_event(&mut rng, 6, 64, false);
        let ev = event(layer, step, 7 + step);
        let mut got = vec![0.0f32; 64];
        fork.combine(&ev, &refs(&terms), &shared, &mut got);
        let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        if (layer, step) == (5, 1) {
            assert_eq!(got, run(&b, &terms, &shared));
            differed = got != run(&NativeCombine, &terms, &shared);
        } else {
            assert_eq!(
                got,
                run(&NativeCombine, &terms, &shared),
                "layer {layer} step {step}"
            );
        }
    }
    assert!(
        differed,
        "the forked contract differs from native on random terms"
    );
    let at_position = ForkPoint {
        layer: 5,
        step: 0,
        position: Some(3),
    };
    assert!(at_position.matches(&event(5, 0, 3)) && !at_position.matches(&event(5, 0, 4)));
    assert_eq!(
        fork.describe(),
        "native fork(layer=5 step=1 contract=b+order=index:719)"
    );
}

/// Hand-derived class representatives for k = 6: class c has pair rank
/// c / 24 and suffix rank c % 24. Class 135: pair rank 5 is (1, 2) (ranks
/// 0–4 are (0, 1)…(0, 5)); suffix rank 15 = 2·3! + 1·2! + 1·1! picks
/// entries 2, 1, 1, 0 of the remaining [0, 3, 4, 5] → [4, 3, 5, 0].
#[test]
fn b_class_representatives_match_hand_derivations() {
    assert_eq!(b_class_representative(6, 0).unwrap(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(b_class_representative(6, 23).unwrap(), vec![0, 1, 5, 4, 3, 2]);
    assert_eq!(b_class_representative(6, 24).unwrap(), vec![0, 2, 1, 3, 4, 5]);
    assert_eq!(b_class_representative(6, 135).unwrap(), vec![1, 2, 4, 3, 5, 0]);
    assert_eq!(b_class_of(&[2, 1, 4, 3, 5, 0]).unwrap(), 135);
}

/// The parsers reject or accept arbitrary CLI text without panicking
/// (strings built from the grammar's own characters, so that many are near
/// misses of valid forms).
#[test]
fn parsers_never_panic() {
    let alphabet: Vec<char> = "abcdefilnoprstuxyz0123456789+=:,-_ ABCEP\u{00e9}"
        .chars()
        .collect();
    let mut rng = Rng(14);
    for _ in 0..iterations(20_000) {
        let len = rng.below(24) as usize;
        let s: String = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
            .collect();
        let _ = AggregationContract::parse(&s);
        let _ = Schedule::parse(&s);
        if let Ok(o) = Order::parse(&s, rng.below(2) == 0) {
            let _ = o.resolve(6);
        }
    }
    // Near misses of valid forms.
    for s in [
        "b+order=class:99999999999999999999",
        "layer-static:18446744073709551616",
        "index:18446744073709551615",
    ] {
        let _ = AggregationContract::parse(s);
        let _ = Schedule::parse(s);
        if let Ok(o) = Order::parse(s, true) {
            assert!(o.resolve(6).is_err());
        }
    }
}

/// `operand=fma` (vLLM-CPU's BF16-expert weighted sum): the gate multiply is
/// fused into the chain, so a product that FP32 cannot hold survives, which
/// the multiply-then-add member with the same fields loses (the kernel probe
/// of docs/interop-vllm.md §4.1). Exact values: IEEE fusedMultiplyAdd is
/// correctly rounded on every CPU.
#[test]
fn fma_operand_fuses_the_gate_multiply_into_the_chain() {
    let fma = AggregationContract::parse("p32+start=first+routed=bf16+operand=fma").unwrap();
    assert_eq!(fma.operand, OperandPrecision::Fma);
    assert_eq!(fma.describe(), "p32+routed=bf16+start=first+operand=fma");
    assert_eq!(AggregationContract::parse(&fma.describe()).unwrap(), fma);
    let d_a = -(1.0f32 + 2f32.powi(-22));
    let d_b = 1.0f32 + 2f32.powi(-23);
    let (units, gates) = (vec![vec![d_a], vec![d_b]], [1.0f32, d_b]);
    let unit_refs = refs(&units);
    let event = CombineEvent {
        layer: 0,
        step: 0,
        position: 0,
        experts: &[3, 5],
        gates: &gates,
        units: &unit_refs,
    };
    let terms: Vec<Vec<f32>> = units.iter().zip(gates).map(|(u, g)| vec![u[0] * g]).collect();
    let mut y = [0.0f32];
    fma.combine(&event, &refs(&terms), &[0.0], &mut y);
    assert_eq!(
        y[0],
        2f32.powi(-46),
        "fma(d_B, g_B, d_A) keeps the product's low bits"
    );
    // The same fields without the fusion lose them.
    let mul_add = AggregationContract::parse("p32+start=first+routed=bf16").unwrap();
    mul_add.combine(&event, &refs(&terms), &[0.0], &mut y);
    assert_eq!(y[0], 0.0);
    // A schedule applies the fused chain as well (the same permutation here).
    let scheduled = ScheduledCombine::new(fma.clone(), Schedule::Identity, 0);
    scheduled.combine(&event, &refs(&terms), &[0.0], &mut y);
    assert_eq!(y[0], 2f32.powi(-46));
    // Reversed: fl32(d_B·g_B) = 1 + 2⁻²² first, then fma(d_A, 1, ·) = 0.
    fma.clone()
        .with_order(Order::Reversed)
        .combine(&event, &refs(&terms), &[0.0], &mut y);
    assert_eq!(y[0], 0.0);
}

#[test]
fn fma_operand_needs_the_unweighted_outputs_and_an_fp32_chain() {
    let fma = AggregationContract::parse("p32+operand=fma").unwrap();
    let terms = vec![vec![1.0f32], vec![2.0]];
    let mut y = [0.0f32];
    // Recorded terms cannot stand in for the unweighted outputs.
    let err = fma.try_combine(&refs(&terms), &[0.0], &mut y).unwrap_err();
    assert!(matches!(err, ContractError::NeedsUnits { .. }), "{err}");
    assert!(err.to_string().contains("operand=fma"), "{err}");
    // Units of the wrong length are refused, not read past.
    let short: Vec<Vec<f32>> = vec![vec![1.0], vec![]];
    let short_refs = refs(&short);
    let event = CombineEvent {
        layer: 0,
        step: 0,
        position: 0,
        experts: &[0, 1],
        gates: &[0.5, 0.5],
        units: &short_refs,
    };
    let err = fma
        .try_combine_event_with_permutation(&[0, 1], &event, &refs(&terms), &[0.0], &mut y)
        .unwrap_err();
    assert!(matches!(err, ContractError::LengthMismatch { .. }), "{err}");
    for bad in [
        "b+operand=fma",
        "p32+shape=tree+operand=fma",
        "p32+acc=exact+operand=fma",
    ] {
        let err = AggregationContract::parse(bad).unwrap_err();
        assert!(
            err.to_string().contains("accumulator=f32 and shape=sequential"),
            "{bad}: {err}"
        );
    }
}
