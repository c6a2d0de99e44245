//! The combine contracts of real backends, written in the notation, with
//! where each was established (docs/contracts.md, "Real backends", has the
//! same table with the measurements).

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
}

/// Every backend combine moeconf knows, in the order of docs/contracts.md.
pub const KNOWN_BACKENDS: [KnownBackend; 9] = [
    KnownBackend {
        id: "moeconf-native",
        description: "moeconf reference runtime, default combine (the paper's native C)",
        contract: "c",
        source: "contract/src/lib.rs combine_native; paper section 2.5",
    },
    KnownBackend {
        id: "transformers-eager-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=eager, bf16",
        contract: "b+order=asc-id",
        source: "modeling_deepseek_v4.py L1055-1067 (index_add_ per expert in ascending id on a bf16 tensor), L1148 (merge); measured bitwise 38400/38400 values",
    },
    KnownBackend {
        id: "transformers-grouped_mm-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=grouped_mm (the default), bf16",
        contract: "c+routed=bf16",
        source: "integrations/moe.py L524-537 (un-sort to slot order, sum(dim=1) in fp32, one rounding), modeling L1148; measured 38400/38400 and 16384/16384 on crafted terms",
    },
    KnownBackend {
        id: "transformers-batched_mm-bf16",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=batched_mm, bf16",
        contract: "c+routed=bf16",
        source: "integrations/moe.py L175-183, modeling L1148; measured 38400/38400 and 16384/16384 on crafted terms",
    },
    KnownBackend {
        id: "transformers-eager-fp32",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=eager, fp32",
        contract: "p32+output=f32+order=asc-id",
        source: "modeling_deepseek_v4.py L1055-1067, L1148; measured 38400/38400 and 16384/16384 on crafted terms",
    },
    KnownBackend {
        id: "transformers-grouped_mm-fp32",
        description: "transformers 5.23.0 DeepSeek-V4, experts_implementation=grouped_mm or batched_mm, fp32",
        contract: "p32+output=f32",
        source: "integrations/moe.py L524-537 / L175-183, modeling L1148; measured 38400/38400 and 16384/16384",
    },
    KnownBackend {
        id: "deepseek-official",
        description: "DeepSeek-V4 reference inference/model.py (fp32 combine of bf16 expert outputs)",
        contract: "c+shared=last+order=asc-id",
        source: "model.py L630-644: y = zeros(fp32); y[idx] += expert_out in ascending expert id; y += shared; y.type_as(x)",
    },
    KnownBackend {
        id: "llama.cpp-cpu",
        description: "llama.cpp (0c1e5709) CPU, build_moe_ffn + deepseek4 graph, f32 activations",
        contract: "p32+start=first+output=f32",
        source: "llama-graph.cpp L2334-2362 (((t0 + t1) + t2) + … in selection order, f32), deepseek4.cpp L1313-1321 (ffn_out = moe_out + shexp); verified bitwise on captured tensors",
    },
    KnownBackend {
        id: "paper-p32-c-a-b",
        description: "the paper's probe schemes (section 2.5), here B; p32, c, a name the others",
        contract: "b",
        source: "paper section 2.5 equations P32, C, A, B and the common merge",
    },
];
