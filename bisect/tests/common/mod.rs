//! Synthetic traces that imitate the reference runtime's capture (the record
//! catalogue of docs/format.md §6, in the runtime's execution order) with a
//! controlled injected difference, so the bisection can be tested without
//! running a model.
//!
//! Values are pseudo-random functions of (side salt, coordinate, element), so
//! a record is bitwise equal on both sides unless the injection *taints* it.
//! Taint follows the data flow of a decoder: an origin at (step s, layer L,
//! position t, operator o) taints the operators after o at (L, t), every
//! layer above L at positions ≥ t of step s, the logits of step s, the state
//! of layers above L from boundary s on, and everything once a different
//! token has been fed back.
#![allow(dead_code)]

use moeconf_contract::{combine_native, AggregationContract};
use moeconf_fingerprint::{Algorithm, Coord, DType, Level, Phase, TensorView};
use moeconf_schema::{Binding, CaptureSpec, Header, Provenance, Trace, TraceWriter};
use std::path::Path;

pub const LAYERS: u32 = 4;
pub const PROMPT: u32 = 3;
pub const STEPS: u32 = 4;
pub const D: usize = 48;
pub const HC: usize = 2;
pub const K: usize = 6;
pub const E: usize = 16;
pub const V: usize = 32;
pub const HEADS: usize = 2;
pub const HD: usize = 8;

/// Operators of one layer and position, in execution order (`moe.term.*` is one slot).
pub const OPS: [&str; 17] = [
    "attn.hc_pre",
    "attn.norm",
    "attn.q",
    "attn.kv",
    "attn.core",
    "attn.output",
    "layer.post_attn_mhc",
    "ffn.hc_pre",
    "ffn.norm",
    "router.scores",
    "router.topk",
    "router.gates",
    "router.margin",
    "moe.term",
    "moe.shared",
    "moe.combine",
    "layer.post_ffn_mhc",
];

/// What the candidate does differently.
#[derive(Debug, Clone, PartialEq)]
pub enum Inject {
    /// Nothing: the candidate equals the reference.
    None,
    /// The candidate's combine at (step, layer, position) uses `contract`
    /// (e.g. B with a class order); everything downstream differs.
    Combine {
        step: u32,
        layer: u32,
        position: u32,
        contract: AggregationContract,
    },
    /// The candidate's attn.output differs at (step, layer, position) with equal inputs.
    Attention { step: u32, layer: u32, position: u32 },
    /// Only the persistent state (`state.window_kv`) of `layer` at the boundary after `step` differs.
    State { step: u32, layer: u32 },
    /// Only the candidate's `moe.term.0` at (step, layer, position) differs
    /// (its inputs and the combine match: the difference is absorbed).
    Term { step: u32, layer: u32, position: u32 },
    /// The candidate's `moe.term.1` at (step, layer, position) differs by
    /// one f32 ulp in one value, which R_BF16 erases (the combine reads it).
    Nudge { step: u32, layer: u32, position: u32 },
}

/// A synthetic run.
#[derive(Debug, Clone)]
pub struct Synth {
    pub inject: Inject,
    /// More independent injections.
    pub also: Vec<Inject>,
    /// Also record `moe.routed` (the routed sum, combine − shared), as a
    /// capture of a backend that materializes it does.
    pub routed: bool,
    /// Generated ordinal whose token differs (g_n predicted by step n−1), if any.
    pub token_step: Option<u32>,
    /// (step, layer, position) where router.topk changes (swap one expert), if any.
    pub route_change: Option<(u32, u32, u32)>,
    pub payloads: bool,
    pub binding: Binding,
    pub provenance: Provenance,
}

pub fn base_binding() -> Binding {
    Binding {
        prompt: moeconf_schema::PromptBinding {
            text: "why the sheep".into(),
            ids: vec![5, 6, 7],
        },
        decoding: moeconf_schema::Decoding {
            strategy: "greedy".into(),
            max_new_tokens: STEPS,
        },
        precision: "bf16".into(),
        contract: "native".into(),
        schedule: "identity".into(),
        capture: CaptureSpec {
            levels: moeconf_fingerprint::LevelSet::ALL,
            payload_levels: moeconf_fingerprint::LevelSet::ALL,
        },
        ..Binding::default()
    }
}

impl Synth {
    pub fn reference() -> Synth {
        Synth {
            inject: Inject::None,
            also: Vec::new(),
            routed: false,
            token_step: None,
            route_change: None,
            payloads: true,
            binding: base_binding(),
            provenance: Provenance {
                runtime: "synthetic".into(),
                version: "0".into(),
                threads: 1,
                notes: Vec::new(),
            },
        }
    }

    pub fn candidate(inject: Inject) -> Synth {
        let mut s = Synth::reference();
        s.inject = inject;
        s
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn path_hash(p: &str) -> u64 {
    p.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Deterministic values in [-1, 1) for one record.
fn values(salt: u64, step: u32, pos: u32, layer: Option<u32>, path: &str, n: usize) -> Vec<f32> {
    let seed = splitmix(
        salt ^ splitmix(
            u64::from(step) << 40 ^ u64::from(pos) << 20 ^ u64::from(layer.map_or(999, |l| l + 1)),
        ) ^ path_hash(path),
    );
    (0..n)
        .map(|i| {
            let r = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
            ((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bf16ish(v: Vec<f32>) -> Vec<f32> {
    v.into_iter()
        .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
        .collect()
}

fn f32b(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32b(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

struct W {
    w: TraceWriter,
    keep: bool,
}

impl W {
    // One argument per field of the record written (coordinate, level,
    // tensor): the synthetic traces spell every record out in full.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        step: u32,
        pos: u32,
        layer: Option<u32>,
        path: &str,
        level: Level,
        dtype: DType,
        shape: &[u64],
        bytes: &[u8],
    ) {
        let coord = Coord {
            step,
            position: pos,
            phase: if step == 0 { Phase::Prefill } else { Phase::Decode },
            layer,
            path: path.into(),
        };
        self.w
            .append(coord, level, TensorView { dtype, shape, bytes }, self.keep)
            .expect("append");
    }
    // As `put`, for an f32 tensor.
    #[allow(clippy::too_many_arguments)]
    fn f32(
        &mut self,
        step: u32,
        pos: u32,
        layer: Option<u32>,
        path: &str,
        level: Level,
        shape: &[u64],
        v: &[f32],
    ) {
        self.put(step, pos, layer, path, level, DType::F32, shape, &f32b(v));
    }
}

fn op_index(op: &str) -> usize {
    let op = if op.starts_with("moe.term.") {
        "moe.term"
    } else {
        op
    };
    OPS.iter().position(|o| *o == op).expect("known op")
}

pub fn token_of(step: u32) -> i32 {
    (3 + 5 * step as i32) % V as i32
}

pub fn word(id: i32) -> String {
    const WORDS: [&str; 8] = ["the", "sheep", "ate", "grass", "slept", "here", "and", "ran"];
    format!(" {}", WORDS[id as usize % WORDS.len()])
}

impl Synth {
    /// The injections.
    fn injections(&self) -> impl Iterator<Item = &Inject> {
        std::iter::once(&self.inject).chain(&self.also)
    }

    /// The origins of the numeric injections: (step, layer, position, op
    /// index, whether the origin's own record differs).
    fn origins(&self) -> Vec<(u32, u32, u32, usize, bool)> {
        self.injections().filter_map(Self::origin_of).collect()
    }

    /// The origin of one numeric injection.
    fn origin_of(inject: &Inject) -> Option<(u32, u32, u32, usize, bool)> {
        match inject {
            Inject::Combine {
                step,
                layer,
                position,
                ..
            } => Some((*step, *layer, *position, op_index("moe.combine"), false)),
            Inject::Attention {
                step,
                layer,
                position,
            } => Some((*step, *layer, *position, op_index("attn.output"), true)),
            _ => None,
        }
    }

    /// Token id predicted by `step` on this side.
    fn token(&self, step: u32) -> i32 {
        match self.token_step {
            Some(n) if step + 1 == n => (token_of(step) + 1) % V as i32,
            _ => token_of(step),
        }
    }

    /// Whether a token different from the reference's has been fed by `step`.
    fn fed_different(&self, step: u32) -> bool {
        self.token_step.is_some_and(|n| step >= n)
    }

    fn tainted_layer_op(&self, step: u32, layer: u32, pos: u32, op: &str) -> bool {
        if self.fed_different(step) {
            return true;
        }
        self.origins().into_iter().any(|(s, l, t, o, itself)| {
            if step == s {
                let origin_itself = itself && op_index(op) == o;
                (layer == l && pos == t && (op_index(op) > o || origin_itself)) || (layer > l && pos >= t)
            } else {
                step > s && layer > l
            }
        })
    }

    fn tainted_global(&self, step: u32) -> bool {
        self.fed_different(step) || self.origins().iter().any(|&(s, ..)| step >= s)
    }

    fn tainted_state(&self, step: u32, layer: u32) -> bool {
        if self.fed_different(step) {
            return true;
        }
        if let Inject::State { step: s, layer: l } = self.inject {
            return s == step && l == layer;
        }
        self.origins().iter().any(|&(s, l, ..)| step >= s && layer > l)
    }

    /// Writes the trace to `path` and opens it.
    pub fn write(&self, path: &Path) -> Trace {
        let header = Header {
            binding: self.binding.clone(),
            provenance: self.provenance.clone(),
        };
        let mut w = W {
            w: TraceWriter::create(path, Algorithm::Blake3, header).expect("create"),
            keep: self.payloads,
        };
        let mut generated: Vec<i32> = Vec::new();
        for step in 0..STEPS {
            let (pos0, n) = if step == 0 {
                (0, PROMPT)
            } else {
                (PROMPT + step - 1, 1)
            };
            let last = pos0 + n - 1;
            let input: Vec<i32> = if step == 0 {
                vec![5, 6, 7]
            } else {
                vec![self.token(step - 1)]
            };
            w.put(
                step,
                pos0,
                None,
                "token.input",
                Level::L0,
                DType::I32,
                &[n as u64],
                &i32b(&input),
            );
            for layer in 0..LAYERS {
                let l = Some(layer);
                for pos in pos0..=last {
                    let salt = |op: &str| u64::from(self.tainted_layer_op(step, layer, pos, op));
                    let v = |op: &str, n: usize| values(salt(op), step, pos, l, op, n);
                    let dm = D as u64;
                    for op in ["attn.hc_pre", "attn.norm"] {
                        w.f32(step, pos, l, op, Level::L4, &[dm], &v(op, D));
                    }
                    w.f32(
                        step,
                        pos,
                        l,
                        "attn.q",
                        Level::L4,
                        &[HEADS as u64, HD as u64],
                        &v("attn.q", HEADS * HD),
                    );
                    w.f32(
                        step,
                        pos,
                        l,
                        "attn.kv",
                        Level::L4,
                        &[HD as u64],
                        &v("attn.kv", HD),
                    );
                    w.f32(
                        step,
                        pos,
                        l,
                        "attn.core",
                        Level::L4,
                        &[HEADS as u64, HD as u64],
                        &v("attn.core", HEADS * HD),
                    );
                    w.f32(
                        step,
                        pos,
                        l,
                        "attn.output",
                        Level::L4,
                        &[dm],
                        &v("attn.output", D),
                    );
                    w.f32(
                        step,
                        pos,
                        l,
                        "layer.post_attn_mhc",
                        Level::L3,
                        &[HC as u64, dm],
                        &v("layer.post_attn_mhc", HC * D),
                    );
                    for op in ["ffn.hc_pre", "ffn.norm"] {
                        w.f32(step, pos, l, op, Level::L4, &[dm], &v(op, D));
                    }
                    w.f32(
                        step,
                        pos,
                        l,
                        "router.scores",
                        Level::L3,
                        &[E as u64],
                        &v("router.scores", E),
                    );
                    // Routes: the reference's, unless a route change is injected here.
                    let mut topk: Vec<i32> = (0..K as i32)
                        .map(|j| (j * 2 + layer as i32 + pos as i32) % E as i32)
                        .collect();
                    let route_salt = if self.route_change == Some((step, layer, pos)) {
                        topk[K - 1] = (topk[K - 1] + 1) % E as i32;
                        1
                    } else {
                        0
                    };
                    w.put(
                        step,
                        pos,
                        l,
                        "router.topk",
                        Level::L3,
                        DType::I32,
                        &[K as u64],
                        &i32b(&topk),
                    );
                    let gates = values(route_salt, step, pos, l, "router.gates", K);
                    w.f32(step, pos, l, "router.gates", Level::L3, &[K as u64], &gates);
                    w.f32(
                        step,
                        pos,
                        l,
                        "router.margin",
                        Level::L3,
                        &[1],
                        &values(route_salt, step, pos, l, "router.margin", 1),
                    );
                    let term_salt = |j: usize| {
                        let hit = self.injections().any(|i| {
                            matches!(i, Inject::Term { step: s, layer: ll, position: t } if (*s, *ll, *t) == (step, layer, pos))
                        });
                        u64::from(hit && j == 0) << 1
                    };
                    let nudged = self.injections().any(|i| {
                        matches!(i, Inject::Nudge { step: s, layer: ll, position: t } if (*s, *ll, *t) == (step, layer, pos))
                    });
                    let mut terms: Vec<Vec<f32>> = (0..K)
                        .map(|j| {
                            values(
                                salt("moe.term") | route_salt,
                                step,
                                pos,
                                l,
                                &format!("moe.term.{j}"),
                                D,
                            )
                        })
                        .collect();
                    if nudged {
                        // One ulp in the first value whose R_BF16 it cannot change.
                        if let Some(x) = terms[1].iter_mut().find(|x| {
                            let low = x.to_bits() & 0xffff;
                            **x != 0.0 && low != 0x8000 && low != 0x8001
                        }) {
                            *x = f32::from_bits(x.to_bits() ^ 1);
                        }
                    }
                    for (j, t) in terms.iter().enumerate() {
                        let path = format!("moe.term.{j}");
                        // An absorbed term difference: the record differs,
                        // the combine is computed from the reference's term.
                        let absorbed;
                        let t = if term_salt(j) != 0 {
                            absorbed = values(
                                salt("moe.term") | route_salt | term_salt(j),
                                step,
                                pos,
                                l,
                                &path,
                                D,
                            );
                            &absorbed
                        } else {
                            t
                        };
                        w.f32(step, pos, l, &path, Level::L4, &[dm], t);
                    }
                    let shared = bf16ish(v("moe.shared", D));
                    w.f32(step, pos, l, "moe.shared", Level::L4, &[dm], &shared);
                    let refs: Vec<&[f32]> = terms.iter().map(|t| t.as_slice()).collect();
                    let mut y = vec![0.0f32; D];
                    let forked = self.injections().find_map(|i| match i {
                        Inject::Combine {
                            step: s,
                            layer: ll,
                            position: t,
                            contract,
                        } if (*s, *ll, *t) == (step, layer, pos) => Some(contract),
                        _ => None,
                    });
                    match forked {
                        Some(contract) => {
                            // Named orders (asc-id, desc-gate) resolve at this event's routes.
                            let experts: Vec<u32> = topk.iter().map(|&e| e as u32).collect();
                            let ctx = moeconf_contract::EventContext {
                                experts: &experts,
                                gates: &gates,
                            };
                            contract
                                .try_combine_in(Some(&ctx), &refs, &shared, &mut y)
                                .expect("combine")
                        }
                        None => combine_native(&refs, &shared, &mut y),
                    }
                    if self.routed {
                        let routed: Vec<f32> = y.iter().zip(&shared).map(|(a, b)| a - b).collect();
                        w.f32(step, pos, l, "moe.routed", Level::L4, &[dm], &routed);
                    }
                    w.f32(step, pos, l, "moe.combine", Level::L4, &[dm], &y);
                    w.f32(
                        step,
                        pos,
                        l,
                        "layer.post_ffn_mhc",
                        Level::L3,
                        &[HC as u64, dm],
                        &v("layer.post_ffn_mhc", HC * D),
                    );
                }
            }
            let g = u64::from(self.tainted_global(step));
            let tok = self.token(step);
            let mut logits = values(g, step, last, None, "lm.logits", V);
            logits[tok as usize] = 4.0;
            let second = (tok as usize + 1) % V;
            logits[second] = 3.0 + 0.25 * g as f32;
            let mut order: Vec<usize> = (0..V).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let top: Vec<i32> = order[..8].iter().map(|&i| i as i32).collect();
            let top_l: Vec<f32> = order[..8].iter().map(|&i| logits[i]).collect();
            w.f32(step, last, None, "lm.logits", Level::L1, &[V as u64], &logits);
            w.put(
                step,
                last,
                None,
                "lm.topk_ids",
                Level::L1,
                DType::I32,
                &[8],
                &i32b(&top),
            );
            w.f32(step, last, None, "lm.topk_logits", Level::L1, &[8], &top_l);
            w.f32(
                step,
                last,
                None,
                "lm.margin",
                Level::L1,
                &[1],
                &[top_l[0] - top_l[1]],
            );
            w.put(
                step,
                last,
                None,
                "token.output",
                Level::L0,
                DType::I32,
                &[1],
                &i32b(&[tok]),
            );
            generated.push(tok);
            let text: String = generated.iter().map(|&t| word(t)).collect();
            w.put(
                step,
                last,
                None,
                "text.continuation",
                Level::L0,
                DType::U8,
                &[text.len() as u64],
                text.as_bytes(),
            );
            for layer in 0..LAYERS {
                let l = Some(layer);
                let s = u64::from(self.tainted_state(step, layer));
                let len = i64::from(last + 1);
                w.put(
                    step,
                    last,
                    l,
                    "state.cumulative_length",
                    Level::L2,
                    DType::I64,
                    &[1],
                    &len.to_le_bytes(),
                );
                let rows = (last + 1).min(4) as usize;
                w.f32(
                    step,
                    last,
                    l,
                    "state.window_kv",
                    Level::L2,
                    &[rows as u64, HD as u64],
                    &values(s, step, last, l, "state.window_kv", rows * HD),
                );
            }
        }
        let path_buf = path.to_path_buf();
        w.w.finish().expect("finish");
        Trace::open(&path_buf).expect("open")
    }
}
