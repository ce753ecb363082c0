//! The chunked lm_head + log-softmax / logprob / entropy (forward and backward) and the full
//! logits GEMM on the GPU against the CPU references (`mxrl_tensor::loss::{logprobs_forward,
//! logprobs_backward}` on `mxrl_tensor::gemm::matmul_nt` of the same BF16 values, and
//! `mxrl_rl::sampling::entropy`), within the bounds of `mxrl_tensor::tolerance`: the GEMMs
//! differ from the CPU's only in summation order, the softmax statistics in summation order,
//! chunking and `exp`/`ln` ulps.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::head::{Head, HeadGradGemm, HeadOutputs, HeadShape};
use mxrl_tensor::gemm::{matmul_nn, matmul_nt, matmul_tn};
use mxrl_tensor::gradcheck::gamma;
use mxrl_tensor::loss::{log_softmax_forward, logprobs_backward, logprobs_forward};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::tolerance::{entropy_bound, gemm_nt_bounds, lse_bound, violations};
use mxrl_tensor::F32_UNIT_ROUNDOFF as U;

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

/// BF16-exact values in `[-scale, scale)` and their bit patterns.
fn bf16_values(n: usize, seed: u64, scale: f32) -> (Vec<f32>, Vec<u16>) {
    let v: Vec<f32> = mxrl_tensor::gradcheck::test_values(n, seed, scale)
        .into_iter()
        .map(round_bf16)
        .collect();
    let bits = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    (v, bits)
}

fn targets(t: usize, v: usize, seed: u64) -> Vec<u32> {
    mxrl_tensor::gradcheck::test_values(t, seed, 1.0)
        .into_iter()
        .map(|u| (((u + 1.0) * 0.5 * v as f32) as usize).min(v - 1) as u32)
        .collect()
}

/// One case: `t` tokens, hidden `hd`, vocabulary `v`, chunk, temperature, seed.
#[derive(Clone, Copy, Debug)]
struct Case {
    t: usize,
    hd: usize,
    v: usize,
    chunk: usize,
    tau: f32,
    seed: u64,
}

const CASES: &[Case] = &[
    // ragged last chunk
    Case {
        t: 37,
        hd: 64,
        v: 1000,
        chunk: 256,
        tau: 1.0,
        seed: 11,
    },
    // one token, one chunk covering everything
    Case {
        t: 1,
        hd: 96,
        v: 517,
        chunk: 517,
        tau: 0.7,
        seed: 12,
    },
    // many tiny chunks, odd sizes
    Case {
        t: 5,
        hd: 33,
        v: 301,
        chunk: 7,
        tau: 1.3,
        seed: 13,
    },
    // chunk larger than the vocabulary
    Case {
        t: 19,
        hd: 128,
        v: 250,
        chunk: 8192,
        tau: 0.6,
        seed: 14,
    },
    // a real vocabulary with the default chunk (three full chunks and a ragged one)
    Case {
        t: 8,
        hd: 64,
        v: 32000,
        chunk: mxrl_cuda::ops::head::DEFAULT_CHUNK,
        tau: 1.0,
        seed: 15,
    },
    // a peaked distribution (low temperature: the max dominates, far tails underflow)
    Case {
        t: 6,
        hd: 48,
        v: 700,
        chunk: 128,
        tau: 0.1,
        seed: 16,
    },
];

/// The reference's per-row quantities and the derived bounds.
struct Reference {
    z: Vec<f32>,
    lp: Vec<f32>,
    lse: Vec<f32>,
    ent: Vec<f32>,
    lp_bound: Vec<f64>,
    lse_bound: Vec<f64>,
    ent_bound: Vec<f64>,
    /// Per row, the largest difference of y = z/τ allowed by the GEMM bound.
    delta_y: Vec<f64>,
}

fn reference(c: &Case, h: &[f32], w: &[f32], tg: &[u32]) -> Reference {
    let Case {
        t,
        hd,
        v,
        chunk,
        tau,
        ..
    } = *c;
    let z = matmul_nt(h, w, t, hd, v);
    let zb = gemm_nt_bounds(h, w, t, hd, v);
    let (lp, lse) = logprobs_forward(&z, tg, t, v, tau);
    let mut ls = vec![0.0; t * v];
    log_softmax_forward(&z, t, v, tau, &mut ls);
    let inv_t = 1.0 / tau;
    let chunks = v.div_ceil(chunk.min(v));
    let mut r = Reference {
        z: z.clone(),
        lp: lp.clone(),
        lse: lse.clone(),
        ent: Vec::new(),
        lp_bound: Vec::new(),
        lse_bound: Vec::new(),
        ent_bound: Vec::new(),
        delta_y: Vec::new(),
    };
    for row in 0..t {
        let zr = &z[row * v..(row + 1) * v];
        let y: Vec<f64> = zr.iter().map(|&x| (x * inv_t) as f64).collect();
        let m = y.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = y.iter().map(|&x| (x - m).exp()).sum();
        let q: f64 = y.iter().map(|&x| (x - m).exp() * (m - x)).sum();
        let ymax = y.iter().fold(0.0f64, |a, &b| a.max(b.abs()));
        let dz = (0..v).map(|j| zb[row * v + j]).fold(0.0f64, f64::max);
        // y = fl(z·(1/τ)) on both sides from z's that differ by ≤ dz.
        let delta_y = dz * inv_t as f64 * (1.0 + 2.0 * U) + 2.0 * U * ymax;
        let lb = lse_bound(v, chunks, delta_y, q / s, s.ln(), lse[row] as f64);
        let lr = &ls[row * v..(row + 1) * v];
        let ent = mxrl_rl::sampling::entropy(lr);
        let m2: f64 = lr
            .iter()
            .map(|&l| (l as f64).exp() * (l as f64) * (l as f64))
            .sum();
        r.lse_bound.push(lb);
        r.lp_bound
            .push(delta_y + lb + 2.0 * U * (lp[row] as f64).abs() * 1.01);
        r.ent_bound.push(entropy_bound(
            v,
            chunks,
            delta_y,
            lb,
            q / s,
            s.ln(),
            ent as f64,
            m2,
        ));
        r.ent.push(ent);
        r.delta_y.push(delta_y);
    }
    r
}

#[test]
fn head_forward_matches_logprobs_forward_and_entropy() {
    let g = gpu();
    let head = Head::new(&g).unwrap();
    for c in CASES {
        let (h, hb) = bf16_values(c.t * c.hd, c.seed, 1.0);
        let (w, wb) = bf16_values(c.v * c.hd, c.seed + 100, 0.5);
        let tg = targets(c.t, c.v, c.seed + 200);
        let r = reference(c, &h, &w, &tg);
        let (dh, dw, dt) = (
            g.upload(&hb).unwrap(),
            g.upload(&wb).unwrap(),
            g.upload(&tg).unwrap(),
        );
        let mut lp = g.zeros::<f32>(c.t).unwrap();
        let mut lse = g.zeros::<f32>(c.t).unwrap();
        let mut ent = g.zeros::<f32>(c.t).unwrap();
        let shape = HeadShape {
            t: c.t,
            h: c.hd,
            v: c.v,
            chunk: c.chunk,
        };
        head.forward(
            &dh.as_view(),
            &dw.as_view(),
            &dt.as_view(),
            c.tau,
            shape,
            HeadOutputs {
                logprob: &mut lp.as_view_mut(),
                lse: &mut lse.as_view_mut(),
                entropy: &mut ent.as_view_mut(),
            },
        )
        .unwrap();
        let (glp, glse, gent) = (
            g.download(&lp).unwrap(),
            g.download(&lse).unwrap(),
            g.download(&ent).unwrap(),
        );
        let f = violations(&glse[..c.t], &r.lse, |i| r.lse_bound[i]);
        assert!(f.is_empty(), "lse, case {c:?}: {f:#?}");
        let f = violations(&glp[..c.t], &r.lp, |i| r.lp_bound[i]);
        assert!(f.is_empty(), "logprob, case {c:?}: {f:#?}");
        let f = violations(&gent[..c.t], &r.ent, |i| r.ent_bound[i]);
        assert!(f.is_empty(), "entropy, case {c:?}: {f:#?}");

        // Deterministic: a second run gives the same bits.
        let mut lp2 = g.zeros::<f32>(c.t).unwrap();
        let mut lse2 = g.zeros::<f32>(c.t).unwrap();
        let mut ent2 = g.zeros::<f32>(c.t).unwrap();
        head.forward(
            &dh.as_view(),
            &dw.as_view(),
            &dt.as_view(),
            c.tau,
            shape,
            HeadOutputs {
                logprob: &mut lp2.as_view_mut(),
                lse: &mut lse2.as_view_mut(),
                entropy: &mut ent2.as_view_mut(),
            },
        )
        .unwrap();
        let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(g.download(&lp2).unwrap()), bits(glp), "case {c:?}");
        assert_eq!(bits(g.download(&ent2).unwrap()), bits(gent), "case {c:?}");
    }
}

#[test]
fn head_backward_matches_logprobs_backward_and_gemms() {
    head_backward_case(HeadGradGemm::F32);
}

#[test]
fn head_backward_bf16x3_matches_logprobs_backward_and_gemms() {
    head_backward_case(HeadGradGemm::Bf16x3);
}

/// The backward in one GEMM mode. Bf16x3 sums three BF16 parts of `dz` (their products exact
/// in f32), so its sums are three times as long and `dz` is represented to within `2⁻²⁴·|dz|`
/// (= u·|dz|, added to the per-entry `dz` bound).
fn head_backward_case(mode: HeadGradGemm) {
    let g = gpu();
    let head = Head::new(&g).unwrap().with_grad_gemm(mode);
    let parts = if mode == HeadGradGemm::Bf16x3 { 3 } else { 1 };
    for c in CASES {
        let Case {
            t,
            hd,
            v,
            chunk,
            tau,
            seed,
        } = *c;
        let (h, hb) = bf16_values(t * hd, seed, 1.0);
        let (w, wb) = bf16_values(v * hd, seed + 100, 0.5);
        let tg = targets(t, v, seed + 200);
        let r = reference(c, &h, &w, &tg);
        let dlp = mxrl_tensor::gradcheck::test_values(t, seed + 300, 2.0);
        let dh0 = mxrl_tensor::gradcheck::test_values(t * hd, seed + 400, 0.1);
        let dw0 = mxrl_tensor::gradcheck::test_values(v * hd, seed + 500, 0.1);
        // CPU: dz, then dh = dh0 + dz·W, dW = dW0 + dzᵀ·h.
        let mut dz = vec![0.0; t * v];
        logprobs_backward(&dlp, &r.z, &r.lse, &tg, t, v, tau, &mut dz);
        let want_dh: Vec<f32> = matmul_nn(&dz, &w, t, v, hd)
            .iter()
            .zip(&dh0)
            .map(|(a, b)| b + a)
            .collect();
        let want_dw: Vec<f32> = matmul_tn(&dz, &h, v, t, hd)
            .iter()
            .zip(&dw0)
            .map(|(a, b)| b + a)
            .collect();
        // Bound on each dz entry: its argument y − lse differs by ≤ δy + Δlse (+ rounding of
        // the difference on both sides), exp by 2 + 1 ulp, and two products round (the GPU
        // uses its own forward's lse, which is within lse_bound of the reference's).
        let inv_t = 1.0 / tau as f64;
        let mut dzb = vec![0.0f64; t * v];
        for row in 0..t {
            let gabs = (dlp[row] as f64 * inv_t).abs();
            for j in 0..v {
                let y = r.z[row * v + j] as f64 * inv_t;
                let arg = y - r.lse[row] as f64;
                let darg = r.delta_y[row] + r.lse_bound[row] + 2.0 * U * arg.abs() * 1.01;
                let p = arg.exp();
                dzb[row * v + j] = gabs * p * ((darg.exp() - 1.0) + 10.0 * U * darg.exp())
                    + 2.0 * U * gabs
                    + if parts == 3 {
                        U * (dz_abs_bound(gabs, p, darg))
                    } else {
                        0.0
                    };
            }
        }
        // Propagate: Σ dzb·|b| + 2γ_{n+chunks+1}·Σ(|dz| + dzb)·|b| (+ the initial value's add).
        let chunks = v.div_ceil(chunk.min(v));
        let mut bdh = vec![0.0f64; t * hd];
        for row in 0..t {
            for k in 0..hd {
                let (mut e, mut a) = (0.0f64, 0.0f64);
                for j in 0..v {
                    let wv = (w[j * hd + k] as f64).abs();
                    e += dzb[row * v + j] * wv;
                    a += ((dz[row * v + j] as f64).abs() + dzb[row * v + j]) * wv;
                }
                a += (dh0[row * hd + k] as f64).abs();
                bdh[row * hd + k] = e + 2.0 * gamma(parts * (v + chunks) + 1) * a;
            }
        }
        let mut bdw = vec![0.0f64; v * hd];
        for j in 0..v {
            for k in 0..hd {
                let (mut e, mut a) = (0.0f64, 0.0f64);
                for row in 0..t {
                    let hv = (h[row * hd + k] as f64).abs();
                    e += dzb[row * v + j] * hv;
                    a += ((dz[row * v + j] as f64).abs() + dzb[row * v + j]) * hv;
                }
                a += (dw0[j * hd + k] as f64).abs();
                bdw[j * hd + k] = e + 2.0 * gamma(parts * (t + 1) + 2) * a;
            }
        }

        let (dhb, dwb, dt) = (
            g.upload(&hb).unwrap(),
            g.upload(&wb).unwrap(),
            g.upload(&tg).unwrap(),
        );
        let shape = HeadShape { t, h: hd, v, chunk };
        let mut lp = g.zeros::<f32>(t).unwrap();
        let mut lse = g.zeros::<f32>(t).unwrap();
        let mut ent = g.zeros::<f32>(t).unwrap();
        head.forward(
            &dhb.as_view(),
            &dwb.as_view(),
            &dt.as_view(),
            tau,
            shape,
            HeadOutputs {
                logprob: &mut lp.as_view_mut(),
                lse: &mut lse.as_view_mut(),
                entropy: &mut ent.as_view_mut(),
            },
        )
        .unwrap();
        let ddlp = g.upload(&dlp).unwrap();
        let mut gdh = g.upload(&dh0).unwrap();
        let mut gdw = g.upload(&dw0).unwrap();
        head.backward(
            &dhb.as_view(),
            &dwb.as_view(),
            &dt.as_view(),
            &lse.as_view(),
            &ddlp.as_view(),
            tau,
            shape,
            &mut gdh.as_view_mut(),
            &mut gdw.as_view_mut(),
        )
        .unwrap();
        let got_dh = g.download(&gdh).unwrap();
        let got_dw = g.download(&gdw).unwrap();
        let f = violations(&got_dh, &want_dh, |i| bdh[i]);
        assert!(f.is_empty(), "dh, {mode:?}, case {c:?}: {f:#?}");
        let f = violations(&got_dw, &want_dw, |i| bdw[i]);
        assert!(f.is_empty(), "dW, {mode:?}, case {c:?}: {f:#?}");
        // The gradient is not trivially within bound: it moved the buffers.
        assert!(got_dh.iter().zip(&dh0).any(|(a, b)| a != b), "case {c:?}");
    }
}

/// Largest `|dz|` of an entry: `|g|·(p·e^{darg} + 1)` (the softmax term plus the target's `g`).
fn dz_abs_bound(gabs: f64, p: f64, darg: f64) -> f64 {
    gabs * (p * darg.exp() + 1.0)
}

#[test]
fn full_logits_match_matmul_nt() {
    let g = gpu();
    let head = Head::new(&g).unwrap();
    for &(rows, hd, v, seed) in &[
        (1usize, 64usize, 32000usize, 21u64),
        (8, 96, 1031, 22),
        (3, 17, 1, 23),
    ] {
        let (h, hb) = bf16_values(rows * hd, seed, 1.0);
        let (w, wb) = bf16_values(v * hd, seed + 1, 0.5);
        let want = matmul_nt(&h, &w, rows, hd, v);
        let b = gemm_nt_bounds(&h, &w, rows, hd, v);
        let (dh, dw) = (g.upload(&hb).unwrap(), g.upload(&wb).unwrap());
        let mut z = g.zeros::<f32>(rows * v).unwrap();
        head.logits(
            &dh.as_view(),
            &dw.as_view(),
            &mut z.as_view_mut(),
            rows,
            hd,
            v,
        )
        .unwrap();
        let got = g.download(&z).unwrap();
        let f = violations(&got[..rows * v], &want, |i| b[i]);
        assert!(
            f.is_empty(),
            "rows {rows} hd {hd} v {v} seed {seed}: {f:#?}"
        );
    }
}

#[test]
fn head_rejects_bad_shapes_and_accepts_zero_tokens() {
    let g = gpu();
    let head = Head::new(&g).unwrap();
    let hb = g.upload(&[0u16; 8]).unwrap();
    let wb = g.upload(&[0u16; 8]).unwrap();
    let tg = g.upload(&[0u32; 2]).unwrap();
    let mut a = g.zeros::<f32>(2).unwrap();
    let mut b = g.zeros::<f32>(2).unwrap();
    let mut c = g.zeros::<f32>(2).unwrap();
    let mut run = |t: usize, v: usize, chunk: usize, tau: f32| {
        head.forward(
            &hb.as_view(),
            &wb.as_view(),
            &tg.as_view(),
            tau,
            HeadShape { t, h: 4, v, chunk },
            HeadOutputs {
                logprob: &mut a.as_view_mut(),
                lse: &mut b.as_view_mut(),
                entropy: &mut c.as_view_mut(),
            },
        )
    };
    assert!(run(0, 2, 1, 1.0).is_ok());
    assert!(run(2, 2, 1, 1.0).is_ok());
    let e = run(2, 3, 1, 1.0).unwrap_err().to_string();
    assert!(e.contains("head W"), "{e}");
    assert!(run(2, 2, 0, 1.0).is_err());
    assert!(run(2, 2, 1, 0.0).is_err());
    assert!(run(3, 2, 1, 1.0).is_err());
}
