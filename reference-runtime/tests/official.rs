//! The `official` precision profile on the quantized fixture `builtin:tiny-v4-fp8`
//! (docs/operators.md §10): every activation-quantization site holds exactly the
//! documented quantization of the record it quantizes (or, where that tensor is
//! internal, a fixed point of the quantizer); the caches store the quantized KV and
//! indexer keys; the profile is identical across thread counts; a fault that skips
//! one site at one (step, layer) changes that site's record first and nothing
//! before it; the bf16 and f32 profiles, which have no sites, ignore that fault;
//! and a model whose dimensions DeepSeek's kernels would reject is refused.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use common::{digests, fixture_model, prompt};
use moeconf_contract::bf16::r_bf16;
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Component;
use moeconf_fixtures::{ensure_builtin_in, BUILTIN_TINY_V4_FP8};
use moeconf_reference_runtime::actquant::{fp4_quantize_blocks, fp8_quantize_blocks, hadamard_rotate};
use moeconf_reference_runtime::capture::{MemorySink, Record};
use moeconf_reference_runtime::error::RuntimeError;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::model::{Model, StepOptions};
use moeconf_reference_runtime::official::SITES;
use moeconf_reference_runtime::precision::Precision;

fn fp8_model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("moeconf-fixtures");
        let dir: PathBuf = ensure_builtin_in(BUILTIN_TINY_V4_FP8, &root).expect("materialize");
        Model::load(&dir).expect("load fp8 fixture")
    })
}

/// `ids` as a prefill, then `decodes` greedy decode steps, every level captured.
fn run(m: &Model, precision: Precision, ids: &[u32], decodes: u32, plan: Option<&FaultPlan>) -> MemorySink {
    let opts = StepOptions {
        precision,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut sink = MemorySink::all();
    let mut st = m.new_state();
    while st.step <= decodes {
        let input = match st.step {
            0 => ids.to_vec(),
            _ => vec![st.pending.expect("pending token")],
        };
        m.step_with_faults(&mut st, &input, &opts, plan, &mut sink)
            .expect("step");
    }
    sink
}

type Key = (u32, u32, Option<u32>, String);

fn key(r: &Record) -> Key {
    (
        r.coord.step,
        r.coord.position,
        r.coord.layer,
        r.coord.path.to_string(),
    )
}

fn index(sink: &MemorySink) -> HashMap<Key, &Record> {
    sink.records.iter().map(|r| (key(r), r)).collect()
}

/// The record of `component` at `r`'s step, position and layer.
fn at<'a>(ix: &HashMap<Key, &'a Record>, r: &Record, component: Component) -> &'a Record {
    let k = (
        r.coord.step,
        r.coord.position,
        r.coord.layer,
        component.path().to_string(),
    );
    ix.get(&k)
        .unwrap_or_else(|| panic!("no {component} at {}", r.coord))
}

fn fp8(x: &[f32], block: usize) -> Vec<f32> {
    let mut v = x.to_vec();
    fp8_quantize_blocks(&mut v, block);
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_site_holds_the_documented_quantization() {
    let m = fp8_model();
    let cfg = m.config();
    let (d, r) = (cfg.head_dim, cfg.rope_dim);
    // 21 prompt tokens + 8 decodes: CSA windows (rate 4) close in prefill and decode.
    let sink = run(m, Precision::Official, &prompt(3, 21), 8, None);
    let ix = index(&sink);
    let mut seen: HashMap<Component, usize> = HashMap::new();
    for rec in &sink.records {
        let Some((c, _)) = Component::parse(&rec.coord.path) else {
            continue;
        };
        if !c.spec().presence.is_quantized() {
            continue;
        }
        *seen.entry(c).or_default() += 1;
        let v = rec.f32s();
        for x in &v {
            assert_eq!(
                r_bf16(*x).to_bits(),
                x.to_bits(),
                "{c} holds a non-BF16 value at {}",
                rec.coord
            );
        }
        let want = match c {
            Component::AttnNormFp8 => fp8(&at(&ix, rec, Component::AttnNorm).f32s(), 128),
            Component::FfnNormFp8 => fp8(&at(&ix, rec, Component::FfnNorm).f32s(), 128),
            Component::AttnKvFp8 | Component::AttnCompressedFp8 => {
                let src = match c {
                    Component::AttnKvFp8 => Component::AttnKv,
                    _ => Component::AttnCompressed,
                };
                let mut kv = at(&ix, rec, src).f32s();
                fp8_quantize_blocks(&mut kv[..d - r], 64);
                kv
            }
            Component::AttnIndexerCompressedFp4 => {
                let mut k = at(&ix, rec, Component::AttnIndexerCompressed).f32s();
                hadamard_rotate(&mut k);
                k.iter_mut().for_each(|x| *x = r_bf16(*x));
                fp4_quantize_blocks(&mut k, 32);
                k
            }
            // The quantized tensor is internal to the operator: the record is a
            // fixed point of its quantizer (values on the grid, scales powers of two).
            Component::AttnIndexerQFp4 => {
                let mut q = v.clone();
                fp4_quantize_blocks(&mut q, 32);
                q
            }
            _ => fp8(&v, 128),
        };
        assert_eq!(bits(&v), bits(&want), "{c} at {}", rec.coord);
    }
    for site in SITES {
        assert!(seen.get(&site).copied().unwrap_or(0) > 0, "{site} never recorded");
    }
    // The caches hold the quantized values: the window's newest row is this
    // position's attn.kv_fp8, and every compressed entry read is a stored Q4/Q5 value.
    let stored: Vec<Vec<u32>> = sink
        .by_path(Component::AttnCompressedFp8.path())
        .map(|r| bits(&r.f32s()))
        .collect();
    for rec in sink.by_path(Component::AttnWindowRead.path()) {
        let w = rec.f32s();
        let kvq = at(&ix, rec, Component::AttnKvFp8).f32s();
        assert_eq!(bits(&w[w.len() - d..]), bits(&kvq), "window at {}", rec.coord);
    }
    for rec in sink.by_path(Component::AttnCompressedRead.path()) {
        for row in rec.f32s().chunks(d) {
            assert!(
                stored.contains(&bits(row)),
                "compressed read at {} is no stored entry",
                rec.coord
            );
        }
    }
    // Quantization changes values: the sites are not the identity on this fixture.
    let changed = sink
        .by_path(Component::AttnNormFp8.path())
        .filter(|rec| bits(&rec.f32s()) != bits(&at(&ix, rec, Component::AttnNorm).f32s()))
        .count();
    assert!(changed > 0);
}

#[test]
fn official_profile_is_identical_across_thread_counts() {
    let run_with = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| digests(&run(fp8_model(), Precision::Official, &prompt(0, 21), 6, None)))
    };
    let one = run_with(1);
    assert!(one.len() > 1000, "{} records", one.len());
    for threads in [2, 4] {
        assert_eq!(run_with(threads), one, "{threads} threads");
    }
}

/// Where each site exists at a (step, layer) of the 5-token prompt + 3 decodes:
/// layer 2 is CSA (a window closes at position 3 in the prefill), layer 3 HCA.
fn site_case(site: Component) -> (u32, u32) {
    match site {
        Component::AttnCompressedFp8 | Component::AttnIndexerCompressedFp4 => (0, 2),
        Component::AttnIndexerQFp4 => (1, 2),
        _ => (1, 3),
    }
}

/// The first record (in execution order) whose digest differs, with its coordinate.
fn first_difference(a: &MemorySink, b: &MemorySink) -> Option<(u32, Option<u32>, String)> {
    assert_eq!(a.records.len(), b.records.len(), "record counts differ");
    let (da, db) = (digests(a), digests(b));
    (0..da.len()).find(|&i| da[i] != db[i]).map(|i| {
        let c = &a.records[i].coord;
        assert_eq!(c, &b.records[i].coord, "records out of step");
        (c.step, c.layer, c.path.to_string())
    })
}

#[test]
fn a_skipped_site_is_the_first_record_to_differ() {
    let m = fp8_model();
    let ids = prompt(1, 5);
    let clean = run(m, Precision::Official, &ids, 3, None);
    for site in SITES {
        let (step, layer) = site_case(site);
        let plan = FaultPlan::new(vec![Fault::at(
            step,
            layer,
            FaultKind::QuantizationSiteSkipped(site),
        )]);
        assert_eq!(FaultKind::QuantizationSiteSkipped(site).component(), site);
        let faulted = run(m, Precision::Official, &ids, 3, Some(&plan));
        let (s, l, path) =
            first_difference(&clean, &faulted).unwrap_or_else(|| panic!("skipping {site} changed nothing"));
        assert_eq!(
            (s, l),
            (step, Some(layer)),
            "skipping {site}: first difference at {path}"
        );
        assert!(site.matches(&path), "skipping {site}: first difference is {path}");
    }
}

#[test]
fn profiles_without_sites_ignore_the_skip_fault() {
    let ids = prompt(1, 5);
    let plan = FaultPlan::new(vec![Fault::at(
        1,
        3,
        FaultKind::QuantizationSiteSkipped(Component::AttnNormFp8),
    )]);
    for p in [Precision::Bf16, Precision::F32] {
        let clean = run(fp8_model(), p, &ids, 2, None);
        let faulted = run(fp8_model(), p, &ids, 2, Some(&plan));
        assert_eq!(digests(&clean), digests(&faulted), "{}", p.name());
        assert!(
            clean
                .records
                .iter()
                .all(|r| Component::parse(&r.coord.path)
                    .is_none_or(|(c, _)| !c.spec().presence.is_quantized())),
            "{} records a quantization site",
            p.name()
        );
    }
}

#[test]
fn dimensions_the_official_kernels_reject_are_refused() {
    // tiny-v4: head_dim 64 with 16 rotary channels leaves 48 non-rope KV channels.
    let m = fixture_model();
    assert!(m.check_precision(Precision::Bf16).is_ok());
    let err = m.check_precision(Precision::Official).unwrap_err();
    match &err {
        RuntimeError::Config { path, message } => {
            assert!(path.ends_with("config.json"), "{}", path.display());
            assert!(
                message.contains("head_dim") && message.contains("48"),
                "{message}"
            );
        }
        other => panic!("unexpected error {other}"),
    }
    let opts = StepOptions {
        precision: Precision::Official,
        combine: &NativeCombine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let mut st = m.new_state();
    let mut sink = MemorySink::all();
    assert!(m.step(&mut st, &[1, 2, 3], &opts, &mut sink).is_err());
    assert!(sink.records.is_empty(), "a refused step records nothing");
    assert!(fp8_model().check_precision(Precision::Official).is_ok());
}

/// The official mHC pre on a layer of the quantized fixture equals DeepSeek's
/// `hc_pre` written out independently (M L674–680): `mixes = F.linear(x,
/// hc_fn) * rsqrt(mean(x²) + ε)` — each row's dot product on the unscaled
/// streams, then the factor — then the pre and post weights of
/// `hc_split_sinkhorn` (K L391–394) and the FP32 collapse with one BF16
/// cast; bit for bit. The bf16 profile (`Φ·(x·r)`) gives other mixes here.
#[test]
fn official_mhc_pre_scales_the_mixes_after_the_dot_products() {
    use moeconf_reference_runtime::linear::dot8;
    use moeconf_reference_runtime::mhc::{hc_pre, sigmoid};
    let m = fp8_model();
    let cfg = m.config();
    let (n, d) = (cfg.hc_mult, cfg.hidden_size);
    let site = &m.layer_weights(1).expect("layer 1").hc_attn;
    let streams: Vec<f32> = (0..n * d)
        .map(|i| r_bf16(((i as f32) * 0.0137).sin() * 2.0 + 0.01))
        .collect();
    let got = hc_pre(
        site,
        &streams,
        n,
        cfg.rms_norm_eps,
        cfg.hc_eps,
        cfg.hc_sinkhorn_iters,
        Precision::Official,
    );
    let ss = dot8(&streams, &streams);
    let rsqrt = 1.0 / (ss / (n * d) as f32 + cfg.rms_norm_eps).sqrt();
    let row = |r: usize| -> Vec<f32> { (0..n * d).map(|c| site.fn_.get(r, c)).collect() };
    let mixes: Vec<f32> = (0..(2 + n) * n)
        .map(|r| dot8(&row(r), &streams) * rsqrt)
        .collect();
    let (a, b) = (&site.scale, &site.base);
    for j in 0..n {
        let pre = sigmoid(mixes[j] * a[0] + b[j]) + cfg.hc_eps;
        let post = 2.0 * sigmoid(mixes[j + n] * a[1] + b[j + n]);
        assert_eq!(got.pre[j].to_bits(), pre.to_bits(), "pre {j}");
        assert_eq!(got.post[j].to_bits(), post.to_bits(), "post {j}");
    }
    for i in 0..d {
        let mut y = 0.0f32;
        for j in 0..n {
            y += got.pre[j] * streams[j * d + i];
        }
        assert_eq!(got.x[i].to_bits(), r_bf16(y).to_bits(), "x {i}");
    }
    let bf16 = hc_pre(
        site,
        &streams,
        n,
        cfg.rms_norm_eps,
        cfg.hc_eps,
        cfg.hc_sinkhorn_iters,
        Precision::Bf16,
    );
    assert_ne!((got.pre, got.post, got.comb), (bf16.pre, bf16.post, bf16.comb));
}

/// DeepSeek's kernel reads a CSA layer's compressed keys in the order of the
/// indexer's top-k (`topk_idxs`, score descending, M L427, L514), not sorted:
/// in the official profile `attn.compressed_read` holds the stored entries
/// in exactly the order of `attn.indexer_topk`; the bf16 profile keeps
/// ascending entry order.
#[test]
fn official_csa_reads_the_selection_in_top_k_order() {
    let m = fp8_model();
    let d = m.config().head_dim;
    for (precision, sorted) in [(Precision::Official, false), (Precision::Bf16, true)] {
        let sink = run(m, precision, &prompt(3, 21), 8, None);
        let ix = index(&sink);
        // The stored entries of each layer in emission order.
        let mut stored: HashMap<Option<u32>, Vec<Vec<u32>>> = HashMap::new();
        let entry = match precision {
            Precision::Official => Component::AttnCompressedFp8,
            _ => Component::AttnCompressed,
        };
        for r in sink.by_path(entry.path()) {
            stored.entry(r.coord.layer).or_default().push(bits(&r.f32s()));
        }
        let mut unsorted = 0;
        let mut checked = 0;
        for rec in sink.by_path(Component::AttnIndexerTopk.path()) {
            let mut ids: Vec<usize> = rec.i32s().iter().map(|&i| i as usize).collect();
            if ids.windows(2).any(|w| w[0] > w[1]) {
                unsorted += 1;
            }
            if sorted {
                ids.sort_unstable();
            }
            let read = at(&ix, rec, Component::AttnCompressedRead).f32s();
            let entries = &stored[&rec.coord.layer];
            let want: Vec<Vec<u32>> = ids.iter().map(|&i| entries[i].clone()).collect();
            let got: Vec<Vec<u32>> = read.chunks(d).map(bits).collect();
            assert_eq!(got, want, "{precision:?} at {}", rec.coord);
            checked += 1;
        }
        assert!(
            checked > 0 && unsorted > 0,
            "{precision:?}: {checked} reads, {unsorted} unsorted selections"
        );
    }
}
