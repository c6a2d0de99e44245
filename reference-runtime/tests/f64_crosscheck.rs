//! An independent, slow float64 implementation of the DeepSeek-V4 equations
//! (docs/deepseek-v4-architecture.md §2, written separately from the runtime:
//! no runtime code is called except to produce the f32 run under test),
//! compared with the runtime's f32 profile on the fixture. A transcription
//! error in either path shows up as a large difference.
//!
//! The f64 path reads the safetensors file itself, uses plain sequential sums,
//! exact angles and libm's f64 functions, and is teacher-forced with the tokens
//! the f32 run generated (so a near-tie flip of the greedy choice cannot derail it).

mod common;

use std::collections::HashMap;

use common::{fixture_dir, fixture_model, prompt, F32Combine};
use moeconf_reference_runtime::capture::MemorySink;
use moeconf_reference_runtime::generate::GenerateOptions;
use moeconf_reference_runtime::precision::Precision;
use serde_json::Value;

struct Cfg {
    v: usize,
    d: usize,
    n: usize,
    h: usize,
    hd: usize,
    r: usize,
    k: usize,
    g: usize,
    orank: usize,
    hi: usize,
    di: usize,
    ki: usize,
    w: usize,
    m_csa: usize,
    m_hca: usize,
    eps: f64,
    hc_eps: f64,
    iters: usize,
    limit: f64,
    scale: f64,
    theta: f64,
    ctheta: f64,
    yarn: (f64, f64, f64, f64),
    kinds: Vec<String>,
    hash: Vec<bool>,
}

fn load_cfg(v: &Value) -> Cfg {
    let u = |k: &str| v[k].as_u64().unwrap() as usize;
    let f = |k: &str| v[k].as_f64().unwrap();
    let rp = &v["rope_parameters"];
    let hd = u("head_dim");
    Cfg {
        v: u("vocab_size"),
        d: u("hidden_size"),
        n: u("hc_mult"),
        h: u("num_attention_heads"),
        hd,
        r: (hd as f64 * f("partial_rotary_factor")) as usize,
        k: u("num_experts_per_tok"),
        g: u("o_groups"),
        orank: u("o_lora_rank"),
        hi: u("index_n_heads"),
        di: u("index_head_dim"),
        ki: u("index_topk"),
        w: u("sliding_window"),
        m_csa: v["compress_rates"]["compressed_sparse_attention"]
            .as_u64()
            .unwrap() as usize,
        m_hca: v["compress_rates"]["heavily_compressed_attention"]
            .as_u64()
            .unwrap() as usize,
        eps: f("rms_norm_eps"),
        hc_eps: f("hc_eps"),
        iters: u("hc_sinkhorn_iters"),
        limit: f("swiglu_limit"),
        scale: f("routed_scaling_factor"),
        theta: f("rope_theta"),
        ctheta: f("compress_rope_theta"),
        yarn: (
            rp["factor"].as_f64().unwrap(),
            rp["original_max_position_embeddings"].as_f64().unwrap(),
            rp["beta_fast"].as_f64().unwrap(),
            rp["beta_slow"].as_f64().unwrap(),
        ),
        kinds: v["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect(),
        hash: v["mlp_layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap() == "hash_moe")
            .collect(),
    }
}

struct Weights(HashMap<String, Vec<f64>>);

impl Weights {
    fn load(path: &std::path::Path) -> Weights {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut m = HashMap::new();
        for (name, t) in st.tensors() {
            let data = t.data();
            let vals: Vec<f64> = match t.dtype() {
                safetensors::Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|c| f64::from(f32::from_bits((u32::from(c[1]) << 24) | (u32::from(c[0]) << 16))))
                    .collect(),
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect(),
                safetensors::Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{other:?}"),
            };
            m.insert(name, vals);
        }
        Weights(m)
    }
    fn t(&self, name: &str) -> &[f64] {
        self.0.get(name).unwrap_or_else(|| panic!("missing {name}"))
    }
}

fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    w.chunks_exact(cols)
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms(x: &[f64], eps: f64) -> f64 {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    1.0 / (ms + eps).sqrt()
}

fn rms_w(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    let r = rms(x, eps);
    x.iter().zip(g).map(|(a, b)| a * r * b).collect()
}

fn sig(z: f64) -> f64 {
    1.0 / (1.0 + libm::exp(-z))
}

/// Inverse frequencies (f64): main = θ^(−2i/r); compress = YaRN-blended.
fn freqs(c: &Cfg, compress: bool) -> Vec<f64> {
    let r = c.r as f64;
    if !compress {
        return (0..c.r / 2)
            .map(|i| libm::pow(c.theta, -(2.0 * i as f64) / r))
            .collect();
    }
    let (s, l0, bf, bs) = c.yarn;
    let base = c.ctheta;
    let cd = |b: f64| r * libm::log(l0 / (2.0 * std::f64::consts::PI * b)) / (2.0 * libm::log(base));
    let lo = libm::floor(cd(bf)).max(0.0);
    let mut hi = libm::ceil(cd(bs)).min(r - 1.0);
    if lo == hi {
        hi += 0.001;
    }
    (0..c.r / 2)
        .map(|i| {
            let ext = libm::pow(base, -(2.0 * i as f64) / r);
            let int = ext / s;
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let e = 1.0 - ramp;
            int * (1.0 - e) + ext * e
        })
        .collect()
}

fn rope(x: &mut [f64], f: &[f64], t: f64, inverse: bool) {
    let r = 2 * f.len();
    let start = x.len() - r;
    for (i, fi) in f.iter().enumerate() {
        let th = t * fi;
        let (c, mut s) = (libm::cos(th), libm::sin(th));
        if inverse {
            s = -s;
        }
        let (a, b) = (x[start + 2 * i], x[start + 2 * i + 1]);
        x[start + 2 * i] = a * c - b * s;
        x[start + 2 * i + 1] = b * c + a * s;
    }
}

fn softmax_inplace(v: &mut [f64]) {
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = v.iter().map(|x| libm::exp(x - m)).sum();
    for x in v.iter_mut() {
        *x = libm::exp(*x - m) / s;
    }
}

/// mHC pre: returns (x, post, C) with C[j][k].
fn hc_pre(c: &Cfg, w: &Weights, site: &str, xs: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
    let n = c.n;
    let flat: Vec<f64> = xs.concat();
    let r = rms(&flat, c.eps);
    let u: Vec<f64> = flat.iter().map(|v| v * r).collect();
    let mu = mv(w.t(&format!("{site}_fn")), &u);
    let b = w.t(&format!("{site}_base"));
    let a = w.t(&format!("{site}_scale"));
    let pre: Vec<f64> = (0..n).map(|j| sig(a[0] * mu[j] + b[j]) + c.hc_eps).collect();
    let post: Vec<f64> = (0..n).map(|j| 2.0 * sig(a[1] * mu[n + j] + b[n + j])).collect();
    let mut cm: Vec<Vec<f64>> = (0..n)
        .map(|j| {
            let mut row: Vec<f64> = (0..n)
                .map(|k| a[2] * mu[2 * n + j * n + k] + b[2 * n + j * n + k])
                .collect();
            softmax_inplace(&mut row);
            row.iter().map(|v| v + c.hc_eps).collect()
        })
        .collect();
    let col = |cm: &mut Vec<Vec<f64>>| {
        for k in 0..n {
            let s: f64 = (0..n).map(|j| cm[j][k]).sum::<f64>() + c.hc_eps;
            for row in cm.iter_mut() {
                row[k] /= s;
            }
        }
    };
    col(&mut cm);
    for _ in 1..c.iters {
        for row in cm.iter_mut() {
            let s: f64 = row.iter().sum::<f64>() + c.hc_eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        col(&mut cm);
    }
    let x: Vec<f64> = (0..c.d)
        .map(|i| (0..n).map(|j| pre[j] * xs[j][i]).sum())
        .collect();
    (x, post, cm)
}

fn hc_post(c: &Cfg, xs: &[Vec<f64>], y: &[f64], post: &[f64], cm: &[Vec<f64>]) -> Vec<Vec<f64>> {
    (0..c.n)
        .map(|k| {
            (0..c.d)
                .map(|i| post[k] * y[i] + (0..c.n).map(|j| cm[j][k] * xs[j][i]).sum::<f64>())
                .collect()
        })
        .collect()
}

/// (kv rows, gate rows) of an overlap slice.
type Slots = (Vec<Vec<f64>>, Vec<Vec<f64>>);

#[derive(Default)]
struct Comp {
    buf_kv: Vec<Vec<f64>>,
    buf_g: Vec<Vec<f64>>,
    entries: Vec<Vec<f64>>,
    ov: Option<Slots>,
}

/// Compressor step; `dim` = entry width, `overlap` = CSA layout.
// The f64 re-statement keeps every quantity of the compressor explicit (one
// argument each) so it reads against docs/operators.md, not the runtime's code.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn comp_step(
    c: &Cfg,
    w: &Weights,
    p: &str,
    st: &mut Comp,
    a: &[f64],
    rate: usize,
    dim: usize,
    overlap: bool,
    fc: &[f64],
) {
    st.buf_kv.push(mv(w.t(&format!("{p}.wkv.weight")), a));
    st.buf_g.push(mv(w.t(&format!("{p}.wgate.weight")), a));
    if st.buf_kv.len() < rate {
        return;
    }
    let ape = w.t(&format!("{p}.ape"));
    let width = if overlap { 2 * dim } else { dim };
    let i = st.entries.len();
    let g: Vec<Vec<f64>> = st
        .buf_g
        .iter()
        .enumerate()
        .map(|(j, z)| (0..width).map(|ch| z[ch] + ape[j * width + ch]).collect())
        .collect();
    let mut slots_kv: Vec<Vec<f64>> = Vec::new();
    let mut slots_g: Vec<Vec<f64>> = Vec::new();
    if overlap {
        match &st.ov {
            Some((ok, og)) => {
                slots_kv.extend(ok.iter().cloned());
                slots_g.extend(og.iter().cloned());
            }
            None => {
                for _ in 0..rate {
                    slots_kv.push(vec![0.0; dim]);
                    slots_g.push(vec![f64::NEG_INFINITY; dim]);
                }
            }
        }
        for j in 0..rate {
            slots_kv.push(st.buf_kv[j][dim..].to_vec());
            slots_g.push(g[j][dim..].to_vec());
        }
        st.ov = Some((
            st.buf_kv.iter().map(|v| v[..dim].to_vec()).collect(),
            g.iter().map(|v| v[..dim].to_vec()).collect(),
        ));
    } else {
        slots_kv = st.buf_kv.clone();
        slots_g = g;
    }
    let mut e = vec![0.0; dim];
    for ch in 0..dim {
        let mut col: Vec<f64> = slots_g.iter().map(|s| s[ch]).collect();
        softmax_inplace(&mut col);
        e[ch] = col.iter().zip(&slots_kv).map(|(p, kv)| p * kv[ch]).sum();
    }
    let mut e = rms_w(&e, w.t(&format!("{p}.norm.weight")), c.eps);
    rope(&mut e, fc, (i * rate) as f64, false);
    st.entries.push(e);
    st.buf_kv.clear();
    st.buf_g.clear();
}

struct Layer {
    window: Vec<Vec<f64>>,
    comp: Comp,
    idx: Comp,
}

fn topk(scores: &[f64], k: usize) -> Vec<usize> {
    let mut i: Vec<usize> = (0..scores.len()).collect();
    i.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
    i.truncate(k);
    i
}

fn swiglu(c: &Cfg, w: &Weights, p: &str, f: &[f64]) -> Vec<f64> {
    let g = mv(w.t(&format!("{p}.w1.weight")), f);
    let u = mv(w.t(&format!("{p}.w3.weight")), f);
    let h: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let g = g.min(c.limit);
            let u = u.clamp(-c.limit, c.limit);
            g * sig(g) * u
        })
        .collect();
    mv(w.t(&format!("{p}.w2.weight")), &h)
}

struct Out {
    post_ffn: Vec<Vec<f64>>, // per layer, flattened streams
    topk: Vec<Vec<usize>>,
}

#[allow(clippy::needless_range_loop)]
fn token_forward(
    c: &Cfg,
    w: &Weights,
    ls: &mut [Layer],
    tok: usize,
    t: usize,
    fm: &[f64],
    fc: &[f64],
) -> (Vec<Vec<f64>>, Out) {
    let emb = &w.t("embed.weight")[tok * c.d..(tok + 1) * c.d];
    let mut xs: Vec<Vec<f64>> = vec![emb.to_vec(); c.n];
    let mut out = Out {
        post_ffn: Vec::new(),
        topk: Vec::new(),
    };
    for (li, st) in ls.iter_mut().enumerate() {
        let p = format!("layers.{li}");
        let kind = c.kinds[li].as_str();
        let fr = if kind == "sliding_attention" { fm } else { fc };
        // Attention half.
        let (x, post, cm) = hc_pre(c, w, &format!("{p}.hc_attn"), &xs);
        let a = rms_w(&x, w.t(&format!("{p}.attn_norm.weight")), c.eps);
        let ap = format!("{p}.attn");
        let q_lat = rms_w(
            &mv(w.t(&format!("{ap}.wq_a.weight")), &a),
            w.t(&format!("{ap}.q_norm.weight")),
            c.eps,
        );
        let qall = mv(w.t(&format!("{ap}.wq_b.weight")), &q_lat);
        let q: Vec<Vec<f64>> = qall
            .chunks_exact(c.hd)
            .map(|h| {
                let r = rms(h, c.eps);
                let mut v: Vec<f64> = h.iter().map(|x| x * r).collect();
                rope(&mut v, fr, t as f64, false);
                v
            })
            .collect();
        let mut kv = rms_w(
            &mv(w.t(&format!("{ap}.wkv.weight")), &a),
            w.t(&format!("{ap}.kv_norm.weight")),
            c.eps,
        );
        rope(&mut kv, fr, t as f64, false);
        st.window.push(kv);
        let mut keys: Vec<Vec<f64>> = st.window.clone();
        if kind == "heavily_compressed_attention" {
            comp_step(
                c,
                w,
                &format!("{ap}.compressor"),
                &mut st.comp,
                &a,
                c.m_hca,
                c.hd,
                false,
                fc,
            );
            keys.extend(st.comp.entries.iter().cloned());
        } else if kind == "compressed_sparse_attention" {
            comp_step(
                c,
                w,
                &format!("{ap}.compressor"),
                &mut st.comp,
                &a,
                c.m_csa,
                c.hd,
                true,
                fc,
            );
            comp_step(
                c,
                w,
                &format!("{ap}.indexer.compressor"),
                &mut st.idx,
                &a,
                c.m_csa,
                c.di,
                true,
                fc,
            );
            let qi_all = mv(w.t(&format!("{ap}.indexer.wq_b.weight")), &q_lat);
            let qi: Vec<Vec<f64>> = qi_all
                .chunks_exact(c.di)
                .map(|h| {
                    let mut v = h.to_vec();
                    rope(&mut v, fc, t as f64, false);
                    v
                })
                .collect();
            let om: Vec<f64> = mv(w.t(&format!("{ap}.indexer.weights_proj.weight")), &a)
                .iter()
                .map(|v| v / (c.hi as f64).sqrt())
                .collect();
            let scores: Vec<f64> = st
                .idx
                .entries
                .iter()
                .map(|k| {
                    (0..c.hi)
                        .map(|h| {
                            let dot: f64 = qi[h].iter().zip(k).map(|(a, b)| a * b).sum();
                            om[h] * dot.max(0.0) / (c.di as f64).sqrt()
                        })
                        .sum()
                })
                .collect();
            let mut sel = topk(&scores, c.ki.min(scores.len()));
            sel.sort_unstable();
            keys.extend(sel.iter().map(|&i| st.comp.entries[i].clone()));
        }
        let sinks = w.t(&format!("{ap}.attn_sink"));
        let mut o = vec![0.0; c.h * c.hd];
        for h in 0..c.h {
            let mut l: Vec<f64> = keys
                .iter()
                .map(|k| q[h].iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (c.hd as f64).sqrt())
                .collect();
            l.push(sinks[h]);
            softmax_inplace(&mut l);
            let mut oh = vec![0.0; c.hd];
            for (pj, k) in l.iter().zip(&keys) {
                for i in 0..c.hd {
                    oh[i] += pj * k[i];
                }
            }
            rope(&mut oh, fr, t as f64, true);
            o[h * c.hd..(h + 1) * c.hd].copy_from_slice(&oh);
        }
        let woa = w.t(&format!("{ap}.wo_a.weight"));
        let per = c.h * c.hd / c.g;
        let mut u = Vec::new();
        for gi in 0..c.g {
            u.extend(mv(
                &woa[gi * c.orank * per..(gi + 1) * c.orank * per],
                &o[gi * per..(gi + 1) * per],
            ));
        }
        let y = mv(w.t(&format!("{ap}.wo_b.weight")), &u);
        if st.window.len() > c.w - 1 {
            st.window.remove(0);
        }
        xs = hc_post(c, &xs, &y, &post, &cm);
        // FFN half.
        let (x, post, cm) = hc_pre(c, w, &format!("{p}.hc_ffn"), &xs);
        let f = rms_w(&x, w.t(&format!("{p}.ffn_norm.weight")), c.eps);
        let fp = format!("{p}.ffn");
        let logits = mv(w.t(&format!("{fp}.gate.weight")), &f);
        let s: Vec<f64> = logits
            .iter()
            .map(|&l| if l > 20.0 { l } else { libm::log1p(libm::exp(l)) })
            .map(f64::sqrt)
            .collect();
        let sel: Vec<usize> = if c.hash[li] {
            w.t(&format!("{fp}.gate.tid2eid"))[tok * c.k..(tok + 1) * c.k]
                .iter()
                .map(|&v| v as usize)
                .collect()
        } else {
            let b = w.t(&format!("{fp}.gate.bias"));
            let biased: Vec<f64> = s.iter().zip(b).map(|(a, b)| a + b).collect();
            topk(&biased, c.k)
        };
        let tot: f64 = sel.iter().map(|&e| s[e]).sum::<f64>() + 1e-20;
        let mut y = swiglu(c, w, &format!("{fp}.shared_experts"), &f);
        for &e in &sel {
            let ye = swiglu(c, w, &format!("{fp}.experts.{e}"), &f);
            let g = s[e] / tot * c.scale;
            for i in 0..c.d {
                y[i] += g * ye[i];
            }
        }
        xs = hc_post(c, &xs, &y, &post, &cm);
        out.post_ffn.push(xs.concat());
        out.topk.push(sel);
    }
    (xs, out)
}

fn head(c: &Cfg, w: &Weights, xs: &[Vec<f64>]) -> Vec<f64> {
    let flat = xs.concat();
    let r = rms(&flat, c.eps);
    let u: Vec<f64> = flat.iter().map(|v| v * r).collect();
    let mu = mv(w.t("hc_head_fn"), &u);
    let (b, a) = (w.t("hc_head_base"), w.t("hc_head_scale")[0]);
    let pre: Vec<f64> = (0..c.n).map(|j| sig(mu[j] * a + b[j]) + c.hc_eps).collect();
    let y: Vec<f64> = (0..c.d)
        .map(|i| (0..c.n).map(|j| pre[j] * xs[j][i]).sum())
        .collect();
    let h = rms_w(&y, w.t("norm.weight"), c.eps);
    mv(w.t("head.weight"), &h)
}

/// Relative tolerance (difference over the vector's max magnitude). Measured on
/// the fixture: 1.9e-6 for states and 1.5e-6 for logits (f32 rounding through 9
/// layers plus f32 rope angles); 2e-5 leaves a 10x margin and still catches any
/// transcription error, which shows up at O(1e-2) or more.
const TOL: f64 = 2e-5;

fn max_rel(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((f64::from(*x) - y).abs()))
        / scale
}

#[test]
fn f32_profile_matches_independent_f64_implementation() {
    let dir = fixture_dir();
    let cfgv: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let c = load_cfg(&cfgv);
    assert_eq!(c.v, 1024);
    let w = Weights::load(&dir.join("model.safetensors"));
    let (fm, fc) = (freqs(&c, false), freqs(&c, true));

    let p = prompt(3, 21);
    let mut sink = MemorySink::all();
    let opts = GenerateOptions {
        max_new_tokens: 20,
        precision: Precision::F32,
        combine: &F32Combine,
        detokenizer: None,
        allow_non_finite: false,
    };
    let gen = fixture_model().generate(&p, &opts, &mut sink).unwrap();

    let mut seq = p.clone();
    seq.extend_from_slice(&gen.tokens[..gen.tokens.len() - 1]);
    let mut layers: Vec<Layer> = (0..c.kinds.len())
        .map(|_| Layer {
            window: Vec::new(),
            comp: Comp::default(),
            idx: Comp::default(),
        })
        .collect();
    let logits_rec: Vec<Vec<f32>> = sink.by_path("lm.logits").map(|r| r.f32s()).collect();
    let mut post: HashMap<(u32, u32), Vec<f32>> = HashMap::new();
    let mut tk: HashMap<(u32, u32), Vec<i32>> = HashMap::new();
    for r in sink.by_path("layer.post_ffn_mhc") {
        post.insert((r.coord.position, r.coord.layer.unwrap()), r.f32s());
    }
    for r in sink.by_path("router.topk") {
        tk.insert((r.coord.position, r.coord.layer.unwrap()), r.i32s());
    }
    let mut worst_state = 0.0f64;
    let mut worst_logit = 0.0f64;
    for (t, &tok) in seq.iter().enumerate() {
        let (xs, out) = token_forward(&c, &w, &mut layers, tok as usize, t, &fm, &fc);
        for (li, st) in out.post_ffn.iter().enumerate() {
            let mut mine: Vec<i32> = tk[&(t as u32, li as u32)].clone();
            let mut theirs: Vec<i32> = out.topk[li].iter().map(|&e| e as i32).collect();
            mine.sort_unstable();
            theirs.sort_unstable();
            assert_eq!(
                mine, theirs,
                "expert selection differs at position {t} layer {li}"
            );
            let d = max_rel(&post[&(t as u32, li as u32)], st);
            worst_state = worst_state.max(d);
            assert!(
                d < TOL,
                "post_ffn_mhc at position {t} layer {li}: relative difference {d:e}"
            );
        }
        if t + 1 >= p.len() {
            let logits = head(&c, &w, &xs);
            let step = t + 1 - p.len();
            let d = max_rel(&logits_rec[step], &logits);
            worst_logit = worst_logit.max(d);
            assert!(d < TOL, "logits of step {step}: relative difference {d:e}");
        }
    }
    eprintln!("worst relative difference: states {worst_state:e}, logits {worst_logit:e}");
}
