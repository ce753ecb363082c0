//! The GPU GEMM backend (`CudaGemm`) against the CPU reference backend (`CpuGemm`) on the same
//! operands, within the bound of two f32 summation orders; determinism; the resident-operand
//! cache. Needs `--features cuda` and a GPU (fails, never skips, without one).
#![cfg(feature = "cuda")]

use mxrl_cuda::CudaGemm;
use mxrl_tensor::backend::{CpuGemm, GemmBackend, GemmOperand, WeightView};
use rand::{Rng, SeedableRng};

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // Magnitudes over several binades, some exact zeros of both signs.
    (0..n)
        .map(|i| match i % 17 {
            0 => 0.0,
            1 => -0.0,
            _ => r.gen_range(-1.0f32..1.0) * 2f32.powi((i % 7) as i32 - 3),
        })
        .collect()
}

/// Bound between two f32 evaluations of `Σ_p a_p·b_p` (k terms) in different orders (either
/// with or without FMA): each is within `γ_k·Σ|a_p·b_p|` of the exact sum, `γ_k = k·u/(1−k·u)`,
/// `u = 2⁻²⁴` (Higham, Accuracy and Stability, §3.1: k−1 additions and ≤ 1 rounding per
/// product along any path), so they differ by at most `2γ_k·Σ|a_p·b_p|`; products that underflow
/// add at most `2⁻¹⁵⁰` each, i.e. `2·k·2⁻¹⁵⁰` for the pair.
fn pair_bound(k: usize, mag: f64) -> f64 {
    let u = 2f64.powi(-24);
    let g = k as f64 * u / (1.0 - k as f64 * u);
    2.0 * g * mag + 2.0 * k as f64 * 2f64.powi(-150)
}

/// `Σ_p |a(i,p)·b(p,j)|` in f64 for accessor closures.
fn mag(k: usize, a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32) -> f64 {
    (0..k).map(|p| (a(p) as f64 * b(p) as f64).abs()).sum()
}

fn check(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (*g as f64 - *w as f64).abs();
        assert!(
            d <= tol(i),
            "{what}: element {i}: gpu {g} cpu {w} (|Δ| {d:e} > {:e})",
            tol(i)
        );
    }
}

#[test]
fn gpu_gemms_match_the_cpu_backend_within_the_summation_bound() {
    let gpu = CudaGemm::new(0).expect("CUDA device 0");
    let cpu = CpuGemm;
    // Both sides of the CPU's dot-product threshold (8 rows), odd sizes, long reductions.
    for &(m, k, n) in &[
        (1, 64, 33),
        (8, 96, 40),
        (9, 96, 40),
        (37, 513, 70),
        (128, 1024, 96),
        (5, 1, 3),
    ] {
        let (x, w) = (rnd(m * k, 1 + m as u64), rnd(n * k, 2 + k as u64));
        let wk = GemmOperand::resident(w.clone(), 1);
        // forward nt: y[m,n] = x[m,k]·w[n,k]ᵀ, keyed and unkeyed weight.
        let want = cpu.nt(&x, wk.view(), m, k, n).unwrap();
        for view in [wk.view(), WeightView::transient(&w)] {
            let got = gpu.nt(&x, view, m, k, n).unwrap();
            check(&format!("nt {m}x{k}x{n}"), &got, &want, |e| {
                let (i, j) = (e / n, e % n);
                pair_bound(k, mag(k, |p| x[i * k + p], |p| w[j * k + p]))
            });
        }
        // dgrad nn: dx[m,k] = dy[m,n]·w[n,k].
        let dy = rnd(m * n, 3 + n as u64);
        let want = cpu.nn(&dy, wk.view(), m, n, k).unwrap();
        let got = gpu.nn(&dy, wk.view(), m, n, k).unwrap();
        check(&format!("nn {m}x{n}x{k}"), &got, &want, |e| {
            let (i, j) = (e / k, e % k);
            pair_bound(n, mag(n, |p| dy[i * n + p], |p| w[p * k + j]))
        });
        // wgrad tn: dW[n,k] (+)= dy[m,n]ᵀ·x[m,k], fresh and accumulating.
        for accumulate in [false, true] {
            let c0 = rnd(n * k, 4);
            let (mut cg, mut cc) = (c0.clone(), c0.clone());
            gpu.tn_into(&dy, &x, &mut cg, n, m, k, accumulate).unwrap();
            cpu.tn_into(&dy, &x, &mut cc, n, m, k, accumulate).unwrap();
            // Accumulating: r_s = fl(c + p_s) = (c + p_s)(1 + δ_s), |δ_s| ≤ u, so
            // |r_g − r_c| ≤ |p_g − p_c| + u·(|r_g| + |r_c|)/(1 − u).
            let u = 2f64.powi(-24);
            check(&format!("tn {n}x{m}x{k} acc {accumulate}"), &cg, &cc, |e| {
                let (i, j) = (e / k, e % k);
                let extra = if accumulate {
                    u * (cg[e].abs() as f64 + cc[e].abs() as f64) / (1.0 - u)
                } else {
                    0.0
                };
                pair_bound(m, mag(m, |p| dy[p * n + i], |p| x[p * k + j])) + extra
            });
        }
    }
}

#[test]
fn gpu_gemms_are_deterministic_and_cache_resident_operands() {
    let gpu = CudaGemm::new(0).expect("CUDA device 0");
    let (m, k, n) = (64, 512, 96);
    let x = rnd(m * k, 10);
    let w = GemmOperand::resident(rnd(n * k, 11), 3);
    let s0 = gpu.stats();
    let a = gpu.nt(&x, w.view(), m, k, n).unwrap();
    let b = gpu.nt(&x, w.view(), m, k, n).unwrap();
    let c = gpu.nt(&x, WeightView::transient(&w), m, k, n).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    // Same call, same shapes: same bits (cached or uploaded operand alike).
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(bits(&a), bits(&c));
    let s1 = gpu.stats();
    assert_eq!(
        s1.weight_uploads - s0.weight_uploads,
        1,
        "one upload per key"
    );
    assert_eq!(
        s1.weight_hits - s0.weight_hits,
        1,
        "second call hits the cache"
    );
    assert_eq!(s1.calls - s0.calls, 3);
    // dgrad with the same resident operand reuses the same device copy.
    let dy = rnd(m * n, 12);
    let d1 = gpu.nn(&dy, w.view(), m, n, k).unwrap();
    let d2 = gpu.nn(&dy, w.view(), m, n, k).unwrap();
    assert_eq!(bits(&d1), bits(&d2));
    assert_eq!(gpu.stats().weight_uploads, s1.weight_uploads);
    assert_eq!(gpu.stats().resident, s1.resident);
    // Releasing the key frees its copy (this backend is not the process-wide one here, so
    // release it by hand; the model test checks the drop path).
    gpu.release(w.key().unwrap());
    assert_eq!(gpu.stats().resident, s1.resident - 1);
    // Empty shapes: zeros, no device call needed.
    assert_eq!(gpu.nt(&[], w.view(), 0, k, n).unwrap(), Vec::<f32>::new());
    assert_eq!(
        gpu.nt(&[], WeightView::transient(&[]), 3, 0, 2).unwrap(),
        vec![0.0; 6]
    );
}
