//! Derived tolerances for comparing two evaluations of the same f32 computation that differ
//! only in summation order (a device against the CPU reference). One place for the bounds;
//! never tuned by eye (conventions.md §6).
//!
//! A sum of `n` terms `tᵢ` evaluated in f32 in any order is within `γ_{n−1}·Σ|tᵢ|` of the exact
//! sum (Higham §4.2), so two such evaluations differ by at most `2·γ_n·Σ|tᵢ|`. Products of
//! BF16-exact operands are exact in f32, so a BF16-operand GEMM entry obeys the same bound with
//! `Σ|tᵢ| = Σₖ |aₖ·bₖ|`.

use crate::gradcheck::gamma;

/// `2·γ_n·abs_sum`: the largest difference between two f32 evaluations (any orders) of a sum
/// of `n` terms whose absolute values add up to `abs_sum`.
pub fn two_order_sum_bound(n: usize, abs_sum: f64) -> f64 {
    2.0 * gamma(n.max(1)) * abs_sum
}

/// Per-entry bound of `C = A·Bᵀ` (`A: [m, k]`, `B: [n, k]`, f32 values) computed in two
/// summation orders: `2·γ_k·Σₖ|A[i,k]·B[j,k]|` for every `(i, j)`, row-major `[m, n]`.
pub fn gemm_nt_bounds(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        let ar = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let br = &b[j * k..(j + 1) * k];
            let s: f64 = ar
                .iter()
                .zip(br)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            out.push(two_order_sum_bound(k, s));
        }
    }
    out
}

/// Compares `got` with `want` entrywise against `bound[i]` (NaN never passes; infinities must
/// match exactly). Returns the first few violations as text (empty: all within bounds).
pub fn violations(got: &[f32], want: &[f32], bound: impl Fn(usize) -> f64) -> Vec<String> {
    let mut out = Vec::new();
    if got.len() != want.len() {
        out.push(format!("length {} vs reference {}", got.len(), want.len()));
        return out;
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if g.is_nan() || w.is_nan() {
            false
        } else if g.is_infinite() || w.is_infinite() {
            g == w
        } else {
            ((g as f64) - (w as f64)).abs() <= bound(i)
        };
        if !ok {
            out.push(format!(
                "[{i}] got {g:e}, reference {w:e}, bound {:e}",
                bound(i)
            ));
            if out.len() >= 8 {
                break;
            }
        }
    }
    out
}

/// Unit roundoff of f64 (`2⁻⁵³`).
pub const F64_UNIT_ROUNDOFF: f64 = 1.0 / 9_007_199_254_740_992.0;

/// `γ_n = n·u/(1 − n·u)` for f64's unit roundoff.
pub fn gamma_f64(n: usize) -> f64 {
    let nu = n.max(1) as f64 * F64_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// `2·γ_n·abs_sum` in f64 arithmetic: two f64 evaluations (any orders) of a sum of `n` terms
/// (e.g. exact squares of f32 values) whose absolute values add up to `abs_sum`.
pub fn two_order_sum_bound_f64(n: usize, abs_sum: f64) -> f64 {
    2.0 * gamma_f64(n) * abs_sum
}

/// Relative difference between two f32 evaluations of one row's softmax normaliser
/// `s = Σ_v exp(y_v − m)` (`m = max y`, so `s ≥ 1`), one of which may combine `chunks`
/// partial sums by rescaling with `exp(m_c − m)` (online softmax). Per evaluation: each `exp`
/// is within 2 ulp (≤ 4u relative; CUDA's `expf` bound, libm's is 1 ulp), `y_v − m` is
/// rounded (a relative error of `u·|y_v − m|` in the term after `exp`, in total
/// `u·Σ e_v|y_v − m| = u·q`), the sum of `v + chunks` terms adds `γ`, and each rescale adds
/// an `exp` and a product (8u + 2u relative) plus the rounding of `m_c − m`, which costs at
/// most `u·|d|·e^{d}·s_c ≤ u·s_c/e` absolutely (`≤ u·v/2` over all chunks). With `q_over_s =
/// Σ e_v(m − y_v)/s` (≥ 0, from the reference), the two evaluations differ relatively by at
/// most twice the worst single one.
pub fn softmax_sum_rel_bound(v: usize, chunks: usize, q_over_s: f64) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rescale = if chunks > 1 {
        10.0 * u + u * v as f64 / 2.0
    } else {
        0.0
    };
    2.0 * (4.0 * u + gamma(v + chunks) + u * q_over_s + rescale)
}

/// Bound on the difference of `lse = m + ln s` between two f32 evaluations of a row of
/// `v` tempered logits whose inputs `y` differ by at most `delta_y` per entry: `lse` is
/// 1-Lipschitz in the max norm of `y` (`delta_y`), `s` differs relatively by `ρ`
/// ([`softmax_sum_rel_bound`]) so `ln s` by `ρ/(1−ρ)`, `ln` is within 1 ulp on either side
/// (`4u·|ln s|` together) and the final `m + ln s` rounds on either side (`2u·|lse|`).
pub fn lse_bound(v: usize, chunks: usize, delta_y: f64, q_over_s: f64, ln_s: f64, lse: f64) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rho = softmax_sum_rel_bound(v, chunks, q_over_s);
    delta_y + rho / (1.0 - rho) + 4.0 * u * ln_s.abs() + 2.0 * u * lse.abs() * (1.0 + 2.0 * u)
}

/// Bound on the difference of a softmax entropy `H = Σ p_v (lse − y_v) = ln s − q/s` between
/// two f32 evaluations (one as `ln s − q/s`, one as `−Σ exp(l_v)·l_v` with `l = y − lse` and an
/// f64 sum): `∂H/∂y_v = −p_v(l_v + H)`, so input and `lse` differences `d = delta_y +
/// lse_diff` move `H` by at most `2d·(1 + H)`; the relative error `ρ` of `s` (and of `q`,
/// which sums the same terms times `m − y_v`) moves `ln s` and `q/s` by `ρ·(1 + |ln s| +
/// 2q/s)`; rounding `l_v` (by `u·|l_v|`) moves `exp(l_v)·l_v` by `p_v·|1 + l_v|·u·|l_v|`,
/// at most `u·(m2 + H)` in total with `m2 = Σ p_v l_v²`; the remaining roundings (`exp`, the
/// product, `ln`, the quotient and the final difference, at most 8 units of `u` per quantity)
/// add `8u·(H + |ln s| + q/s)` and the f64 sum `γ_v·H`.
#[allow(clippy::too_many_arguments)]
pub fn entropy_bound(
    v: usize,
    chunks: usize,
    delta_y: f64,
    lse_diff: f64,
    q_over_s: f64,
    ln_s: f64,
    entropy: f64,
    m2: f64,
) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rho = softmax_sum_rel_bound(v, chunks, q_over_s);
    let h = entropy.abs();
    2.0 * (delta_y + lse_diff) * (1.0 + h)
        + rho / (1.0 - rho) * (1.0 + ln_s.abs() + 2.0 * q_over_s)
        + u * (m2.abs() + h)
        + 8.0 * u * (h + ln_s.abs() + q_over_s)
        + gamma_f64(v) * h
}

/// Largest expected difference between the observed frequencies `k₁/n₁` and `k₂/n₂` of one
/// outcome of probability `p` in two independent samples of sizes `n₁`, `n₂`: `z` standard
/// deviations of the difference, `z·√(p(1−p)(1/n₁ + 1/n₂))`, plus one count of each sample's
/// granularity. `z = 6` keeps a false alarm below 2·10⁻⁹ per outcome (normal approximation).
pub fn binomial_two_sample_bound(p: f64, n1: usize, n2: usize, z: f64) -> f64 {
    let (a, b) = (n1.max(1) as f64, n2.max(1) as f64);
    z * (p * (1.0 - p) * (1.0 / a + 1.0 / b)).max(0.0).sqrt() + 1.0 / a + 1.0 / b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn violations_reject_nan_and_out_of_bound() {
        assert!(violations(&[1.0, 2.0], &[1.0, 2.0], |_| 0.0).is_empty());
        assert_eq!(violations(&[f32::NAN], &[f32::NAN], |_| 1.0).len(), 1);
        assert_eq!(violations(&[1.0 + 1e-3], &[1.0], |_| 1e-4).len(), 1);
        assert!(violations(&[1.0 + 1e-5], &[1.0], |_| 1e-4).is_empty());
    }

    #[test]
    fn sum_bound_covers_reordering() {
        // Summing the same terms forwards and backwards stays within the bound.
        let t: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let f: f32 = t.iter().sum();
        let b: f32 = t.iter().rev().sum();
        let abs: f64 = t.iter().map(|x| x.abs() as f64).sum();
        assert!(((f - b) as f64).abs() <= two_order_sum_bound(t.len(), abs));
    }

    #[test]
    fn f64_sum_bound_covers_reordering_of_squares() {
        let t: Vec<f64> = (0..5000)
            .map(|i| {
                let x = ((i * 7919) % 5000) as f32 * 1.37e-3 - 3.1;
                (x as f64) * (x as f64)
            })
            .collect();
        let f: f64 = t.iter().sum();
        let b: f64 = t.iter().rev().sum();
        let pair: f64 = t.chunks(2).map(|c| c.iter().sum::<f64>()).sum();
        let abs: f64 = t.iter().sum();
        assert!((f - b).abs() <= two_order_sum_bound_f64(t.len(), abs));
        assert!((f - pair).abs() <= two_order_sum_bound_f64(t.len(), abs));
        assert!(two_order_sum_bound_f64(t.len(), abs) < 1e-9 * abs);
    }

    #[test]
    fn lse_bound_covers_chunked_and_plain_evaluations() {
        // A row summed plainly and by chunks with rescaling (online softmax) stays in bound.
        let y: Vec<f32> = (0..3001)
            .map(|i| ((i * 104_729) % 3001) as f32 * 0.01 - 15.0)
            .collect();
        let m = y.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let s: f32 = y.iter().map(|&x| (x - m).exp()).sum();
        let plain = m + s.ln();
        let (mut mm, mut ss) = (f32::NEG_INFINITY, 0.0f32);
        for c in y.chunks(256) {
            let mc = c.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let sc: f32 = c.iter().map(|&x| (x - mc).exp()).sum();
            let m1 = mm.max(mc);
            ss = if mm == f32::NEG_INFINITY {
                0.0
            } else {
                (mm - m1).exp() * ss
            } + (mc - m1).exp() * sc;
            mm = m1;
        }
        let chunked = mm + ss.ln();
        let q: f64 = y
            .iter()
            .map(|&x| ((x - m) as f64).exp() * (m - x) as f64)
            .sum::<f64>()
            / s as f64;
        let b = lse_bound(y.len(), 12, 0.0, q, (s as f64).ln(), plain as f64);
        assert!(
            ((plain - chunked) as f64).abs() <= b,
            "{plain} vs {chunked}, bound {b}"
        );
        assert!(
            b < 1e-3,
            "the bound is tight enough to catch a wrong term: {b}"
        );
        // A wrong normaliser (one term of exp(0) = 1 missing out of s) is caught.
        let wrong = m + (s - 1.0).ln();
        assert!(((plain - wrong) as f64).abs() > b);
    }

    #[test]
    fn binomial_bound_grows_with_variance_and_shrinks_with_samples() {
        let a = binomial_two_sample_bound(0.5, 1000, 1000, 6.0);
        let b = binomial_two_sample_bound(0.5, 100_000, 100_000, 6.0);
        assert!(a > b && b > 0.0);
        assert!(binomial_two_sample_bound(0.0, 1000, 1000, 6.0) < a);
    }
}
