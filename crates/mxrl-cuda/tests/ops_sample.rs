//! On-device sampling against `mxrl_model::generate::sample_token`: greedy equals its argmax
//! (first index of the maximum); the sampled frequencies match the reference's (drawn with its
//! own ChaCha RNG) within a two-sample binomial bound (`mxrl_tensor::tolerance`) for plain,
//! top-k, top-p and combined settings; logprobs within the derived log-softmax bound; the same
//! (seed, step, row) gives the same token whatever the batch.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::sample::{SampleParams, Sampler};
use mxrl_model::{sample_token, SamplingParams};
use mxrl_tensor::loss::logprobs_forward;
use mxrl_tensor::tolerance::{binomial_two_sample_bound, lse_bound};
use mxrl_tensor::F32_UNIT_ROUNDOFF as U;
use rand::SeedableRng;

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, scale)
}

/// Runs the device sampler on `logits [rows, v]`.
fn run(
    g: &Gpu,
    s: &Sampler,
    logits: &[f32],
    rows: usize,
    v: usize,
    p: SampleParams,
) -> (Vec<u32>, Vec<f32>) {
    let d = g.upload(logits).unwrap();
    let mut tok = g.zeros::<u32>(rows).unwrap();
    let mut lp = g.zeros::<f32>(rows).unwrap();
    s.sample(
        &d.as_view(),
        rows,
        v,
        &p,
        &mut tok.as_view_mut(),
        &mut lp.as_view_mut(),
    )
    .unwrap();
    let t = g.download(&tok).unwrap();
    let l = g.download(&lp).unwrap();
    (t[..rows].to_vec(), l[..rows].to_vec())
}

/// Bound on a token's logprob `z/τ − lse` between the device and the reference (same logits:
/// δy = 0; one chunk).
fn lp_bound(row: &[f32], tau: f32, lp: f32, lse: f32) -> f64 {
    let inv_t = 1.0 / tau;
    let y: Vec<f64> = row.iter().map(|&x| (x * inv_t) as f64).collect();
    let m = y.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = y.iter().map(|&x| (x - m).exp()).sum();
    let q: f64 = y.iter().map(|&x| (x - m).exp() * (m - x)).sum();
    lse_bound(row.len(), 1, 0.0, q / s, s.ln(), lse as f64) + 2.0 * U * (lp as f64).abs() * 1.01
}

#[test]
fn greedy_is_argmax_with_lowest_index_on_ties() {
    let g = gpu();
    let s = Sampler::new(&g).unwrap();
    for &(rows, v, seed) in &[
        (9usize, 32000usize, 1u64),
        (3, 151_936, 2),
        (5, 1, 3),
        (4, 37, 4),
    ] {
        let mut logits = values(rows * v, seed, 4.0);
        if v > 20 {
            // a tie for the maximum in row 0: indices 5 and 17
            logits[5] = 10.0;
            logits[17] = 10.0;
        }
        let p = SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            step: 0,
        };
        let (tok, lp) = run(&g, &s, &logits, rows, v, p);
        let sp = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        for r in 0..rows {
            let row = &logits[r * v..(r + 1) * v];
            let (wt, wl) = sample_token(row, &sp, &mut rng);
            assert_eq!(tok[r], wt, "rows {rows} v {v} seed {seed} row {r}");
            let (_, lse) = logprobs_forward(row, &[wt], 1, v, 1.0);
            let b = lp_bound(row, 1.0, wl, lse[0]);
            assert!(
                ((lp[r] - wl) as f64).abs() <= b,
                "row {r}: {} vs {wl}, bound {b:e}",
                lp[r]
            );
        }
        if v > 20 {
            assert_eq!(tok[0], 5);
        }
    }
}

#[test]
fn sampled_frequencies_match_sample_token() {
    let g = gpu();
    let s = Sampler::new(&g).unwrap();
    let v = 40;
    let n = 60_000;
    let row = values(v, 77, 2.5);
    let logits: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
    // (temperature, top_p, top_k)
    for &(tau, top_p, top_k) in &[
        (1.0f32, 1.0f32, 0usize),
        (0.7, 1.0, 5),
        (1.2, 0.8, 0),
        (0.9, 0.6, 10),
        (1.0, 0.0, 0),
        (2.0, 0.95, 39),
    ] {
        let p = SampleParams {
            temperature: tau,
            top_p,
            top_k,
            seed: 1234,
            step: 7,
        };
        let (tok, lp) = run(&g, &s, &logits, n, v, p);
        let sp = SamplingParams {
            temperature: tau,
            top_p,
            top_k,
            ..Default::default()
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(99);
        let mut want = vec![0usize; v];
        for _ in 0..n {
            want[sample_token(&row, &sp, &mut rng).0 as usize] += 1;
        }
        let mut got = vec![0usize; v];
        for (r, &t) in tok.iter().enumerate() {
            assert!((t as usize) < v, "row {r}: token {t}");
            got[t as usize] += 1;
        }
        for j in 0..v {
            let (fg, fc) = (got[j] as f64 / n as f64, want[j] as f64 / n as f64);
            let pooled = (got[j] + want[j]) as f64 / (2 * n) as f64;
            let b = binomial_two_sample_bound(pooled, n, n, 6.0);
            assert!(
                (fg - fc).abs() <= b,
                "τ {tau} top_p {top_p} top_k {top_k}: token {j} frequency {fg} vs reference {fc} (bound {b:e}); got {got:?} want {want:?}"
            );
            // A token the reference's kept set excludes (it never draws it and its
            // probability under the kept set is 0) must never be drawn: checked for top-k,
            // where the excluded set is exact (the k largest logits).
        }
        if top_k > 0 {
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            for &j in &order[top_k..] {
                assert_eq!(
                    got[j], 0,
                    "τ {tau} top_k {top_k}: token {j} outside the top-k"
                );
            }
        }
        // Logprobs under the full tempered distribution.
        let (_, lse) = logprobs_forward(&row, &[0], 1, v, tau);
        for (r, (&t, &l)) in tok.iter().zip(&lp).enumerate().take(200) {
            let (want_lp, _) = logprobs_forward(&row, &[t], 1, v, tau);
            let b = lp_bound(&row, tau, want_lp[0], lse[0]);
            assert!(
                ((l - want_lp[0]) as f64).abs() <= b,
                "row {r}: {l} vs {}",
                want_lp[0]
            );
        }
    }
}

#[test]
fn sampling_is_deterministic_per_seed_step_and_row() {
    let g = gpu();
    let s = Sampler::new(&g).unwrap();
    let (rows, v) = (64, 5003);
    let logits = values(rows * v, 5, 3.0);
    let p = SampleParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 50,
        seed: 42,
        step: 3,
    };
    let (a, la) = run(&g, &s, &logits, rows, v, p);
    let (b, lb) = run(&g, &s, &logits, rows, v, p);
    assert_eq!(a, b);
    assert_eq!(
        la.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        lb.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    // The first 7 rows alone give the same tokens (a row does not depend on its batch-mates).
    let (c, _) = run(&g, &s, &logits[..7 * v], 7, v, p);
    assert_eq!(&a[..7], &c[..]);
    // Another step or seed changes the draws.
    let (d, _) = run(&g, &s, &logits, rows, v, SampleParams { step: 4, ..p });
    let (e, _) = run(&g, &s, &logits, rows, v, SampleParams { seed: 43, ..p });
    assert_ne!(a, d);
    assert_ne!(a, e);
    // The caller's scratch gives the same draws; a short one is refused.
    let d_logits = g.upload(&logits).unwrap();
    let mut scratch = g.zeros::<f32>(rows * v).unwrap();
    let mut tok = g.zeros::<u32>(rows).unwrap();
    let mut lp = g.zeros::<f32>(rows).unwrap();
    s.sample_with_scratch(
        &d_logits.as_view(),
        rows,
        v,
        &p,
        &mut scratch.as_view_mut(),
        &mut tok.as_view_mut(),
        &mut lp.as_view_mut(),
    )
    .unwrap();
    assert_eq!(g.download(&tok).unwrap(), a);
    let mut short = g.zeros::<f32>(rows * v - 1).unwrap();
    let e = s
        .sample_with_scratch(
            &d_logits.as_view(),
            rows,
            v,
            &p,
            &mut short.as_view_mut(),
            &mut tok.as_view_mut(),
            &mut lp.as_view_mut(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("sample scratch"), "{e}");
    // top_k = 1 is greedy whatever the draw.
    let (f, _) = run(&g, &s, &logits, rows, v, SampleParams { top_k: 1, ..p });
    let (gr, _) = run(
        &g,
        &s,
        &logits,
        rows,
        v,
        SampleParams {
            temperature: 0.0,
            ..p
        },
    );
    assert_eq!(f, gr);
}

#[test]
fn host_uniform_is_in_range_and_spread() {
    let u: Vec<f64> = (0..10_000)
        .map(|r| mxrl_cuda::ops::sample::uniform(7, 1, r))
        .collect();
    assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
    let mean = u.iter().sum::<f64>() / u.len() as f64;
    // mean of 10⁴ uniforms: σ = 1/√(12·10⁴) ≈ 0.0029; 6σ.
    assert!((mean - 0.5).abs() < 6.0 * 0.0029, "{mean}");
}

#[test]
fn sample_rejects_bad_parameters() {
    let g = gpu();
    let s = Sampler::new(&g).unwrap();
    let d = g.upload(&[0.0f32; 8]).unwrap();
    let mut tok = g.zeros::<u32>(2).unwrap();
    let mut lp = g.zeros::<f32>(2).unwrap();
    let ok = SampleParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        seed: 0,
        step: 0,
    };
    let mut go = |p: SampleParams, rows: usize, v: usize| {
        s.sample(
            &d.as_view(),
            rows,
            v,
            &p,
            &mut tok.as_view_mut(),
            &mut lp.as_view_mut(),
        )
    };
    assert!(go(ok, 2, 4).is_ok());
    assert!(go(ok, 0, 4).is_ok());
    assert!(go(
        SampleParams {
            temperature: -1.0,
            ..ok
        },
        2,
        4
    )
    .is_err());
    assert!(go(
        SampleParams {
            temperature: f32::NAN,
            ..ok
        },
        2,
        4
    )
    .is_err());
    assert!(go(
        SampleParams {
            top_p: f32::NAN,
            ..ok
        },
        2,
        4
    )
    .is_err());
    assert!(go(ok, 3, 4).is_err());
    assert!(go(ok, 2, 0).is_err());
}
