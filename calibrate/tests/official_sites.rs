//! The official profile's activation-quantization sites as the bisector sees
//! them (docs/operators.md §10, docs/diff.md "Quantization sites"): on the
//! quantized fixture `builtin:tiny-v4-fp8`, a candidate trace whose run skips
//! one site's quantize-dequantize at one (step, layer) — a backend that does
//! not quantize there — is localized by `moeconf_bisect::diff` exactly to that
//! site, step and layer, with every input of the site matching; for each of
//! the ten sites.

use moeconf_bisect::{diff, DiffOptions, Verdict};
use moeconf_calibrate::{Ctx, CtxOptions, Sizes, TraceRequest};
use moeconf_contract::NativeCombine;
use moeconf_fingerprint::Component;
use moeconf_reference_runtime::faults::{Fault, FaultKind, FaultPlan};
use moeconf_reference_runtime::official::SITES;
use moeconf_reference_runtime::precision::Precision;
use moeconf_schema::Trace;

const PROMPT: &str = "why the sheep";
const TOKENS: usize = 3;

/// A (step, layer) where `site` exists for the 5-token prompt: layer 2 is CSA
/// (its compressors close a window at position 3 of the prefill), layer 3 HCA.
fn case(site: Component) -> (u32, u32) {
    match site {
        Component::AttnCompressedFp8 | Component::AttnIndexerCompressedFp4 => (0, 2),
        Component::AttnIndexerQFp4 => (1, 2),
        _ => (2, 3),
    }
}

#[test]
fn skipping_a_site_is_localized_to_that_site() {
    let dir = tempfile::tempdir().unwrap();
    let m = moeconf_runner::load_model("builtin:tiny-v4-fp8").expect("built-in quantized model");
    let ctx = Ctx::new(
        m,
        CtxOptions {
            precision: Precision::Official,
            fork_layer: 5,
            sizes: Sizes::QUICK,
            out: dir.path().to_path_buf(),
            progress: moeconf_shard::ProgressMode::Off,
        },
    )
    .expect("context");
    let ids = ctx.encode(PROMPT).unwrap();
    assert_eq!(ids.len(), 5, "the cases assume a 5-token prompt");
    let write = |name: &str, plan: Option<&FaultPlan>| {
        let path = dir.path().join(name);
        ctx.write_trace(TraceRequest {
            prompt: PROMPT,
            prompt_ids: &ids,
            tokens: TOKENS,
            combine: &NativeCombine,
            faults: plan,
            notes: Vec::new(),
            path: &path,
        })
        .expect("trace");
        Trace::open_verified(&path).expect("open")
    };
    let reference = write("reference.bin", None);
    assert_eq!(reference.binding().precision, "official");
    for site in SITES {
        let (step, layer) = case(site);
        let kind = FaultKind::QuantizationSiteSkipped(site);
        let plan = FaultPlan::new(vec![Fault::at(step, layer, kind.clone())]);
        let candidate = write(
            &format!("{}.bin", kind.name().replace([':', '*'], "_")),
            Some(&plan),
        );
        let report = diff(&reference, &candidate, &DiffOptions::default()).expect("diff");
        assert_eq!(report.verdict, Verdict::Divergent, "{site}");
        let f = report
            .first_divergence
            .as_ref()
            .unwrap_or_else(|| panic!("{site}: no first divergence"));
        assert_eq!(
            (f.step, f.layer, f.present_in.as_str()),
            (step, Some(layer), "both"),
            "{site}: localized at {}",
            f.operator
        );
        assert!(site.matches(&f.operator), "{site}: localized at {}", f.operator);
        let first = &report.divergences[0];
        assert!(first.inputs_match, "{site}: inputs {:?}", first.inputs);
        assert!(
            first.inputs.iter().all(|i| i.status == "match"),
            "{site}: inputs {:?}",
            first.inputs
        );
        assert!(report.quantization_one_side.is_empty(), "{site}");
    }
}
