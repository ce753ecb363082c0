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
    gemm_nt_bounds_with(a, b, m, k, n, two_order_sum_bound)
}

/// A bound between two evaluations of a sum of `n` terms with absolute sum `abs_sum`:
/// [`two_order_sum_bound`] (both IEEE f32) or [`tensor_core_sum_bound`] (one on tensor cores).
pub type SumBound = fn(usize, f64) -> f64;

/// `(γ_n + 2·γ_{3n})·abs_sum`: the largest difference between an IEEE f32 evaluation (any
/// order) of a sum of `n` exact products and a tensor-core evaluation of the same sum (BF16
/// `mma` or cuBLAS BF16 GEMM with f32 accumulation).
///
/// Derivation. Tensor cores add a group of `b ≥ 1` products to the f32 accumulator by aligning
/// every term to the largest exponent, truncating the bits below the f32 significand and
/// normalizing the result by truncation (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior
/// of NVIDIA tensor cores", PeerJ Comput. Sci. 2021): each of the `b + 1` terms loses less than
/// one ulp of the group's largest magnitude, `2u·max|t| ≤ 2u·Σ_group|t|`, and the normalization
/// less than one ulp of the result, so a group step errs by at most `(b + 2)·2u·Σ_group|t|`
/// (`Σ_group` including the accumulator, itself at most the absolute sum so far). Over the
/// `⌈n/b⌉` steps of the sum this is, to first order, `2u·(n + 2⌈n/b⌉)·Σ|t| ≤ 6u·n·Σ|t|` for any
/// `b ≥ 1`, which `2·γ_{3n}·Σ|t|` bounds. The IEEE reference is within `γ_n·Σ|t|` of the exact
/// sum (Higham §4.2); the two add up.
pub fn tensor_core_sum_bound(n: usize, abs_sum: f64) -> f64 {
    let n = n.max(1);
    (gamma(n) + 2.0 * gamma(3 * n)) * abs_sum
}

/// [`gemm_nt_bounds`] with the sum bound `sum` (per entry `sum(k, Σₖ|A[i,k]·B[j,k]|)`).
pub fn gemm_nt_bounds_with(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
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
            out.push(sum(k, s));
        }
    }
    out
}

/// Per-entry bound of `C = A·B` (`A: [m, k]`, `B: [k, n]`, the shapes of
/// [`crate::gemm::matmul_nn`]): `sum(k, Σₖ|A[i,k]·B[k,j]|)`, row-major `[m, n]`.
pub fn gemm_nn_bounds_with(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| (a[i * k + p] as f64 * b[p * n + j] as f64).abs())
                .sum();
            out.push(sum(k, s));
        }
    }
    out
}

/// Per-entry bound of `C = C₀ + Aᵀ·B` (`A: [k, m]`, `B: [k, n]`, the shapes of
/// [`crate::gemm::matmul_tn`]; `c0: [m, n]` the value accumulated into, if any):
/// `sum(k + 1, |C₀[i,j]| + Σₖ|A[k,i]·B[k,j]|)` with `C₀`, else `sum(k, Σₖ|A[k,i]·B[k,j]|)`.
pub fn gemm_tn_bounds_with(
    a: &[f32],
    b: &[f32],
    c0: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| (a[p * m + i] as f64 * b[p * n + j] as f64).abs())
                .sum();
            out.push(match c0 {
                Some(c) => sum(k + 1, s + (c[i * n + j] as f64).abs()),
                None => sum(k, s),
            });
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
    fn tensor_core_bound_exceeds_the_ieee_bound() {
        for n in [1, 2, 16, 1000, 100_000] {
            let (ieee, tc) = (two_order_sum_bound(n, 1.0), tensor_core_sum_bound(n, 1.0));
            // Truncating additions (unit roundoff 2u) over at most 3n steps, plus the IEEE
            // side: at least 3.5× the IEEE-vs-IEEE bound, and linear in the absolute sum.
            assert!(tc >= 3.5 * ieee, "n = {n}: {tc:e} vs {ieee:e}");
            assert_eq!(tensor_core_sum_bound(n, 4.0), 4.0 * tc);
        }
    }

    #[test]
    fn nn_and_tn_bounds_are_nt_bounds_of_the_transposed_operands() {
        let (m, k, n) = (3, 5, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.25 - 1.0).collect(); // [m, k]
        let bt: Vec<f32> = (0..n * k).map(|i| 2.0 - i as f32 * 0.125).collect(); // [n, k]
        let t = |x: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..c * r).map(|i| x[(i % r) * c + i / r]).collect()
        };
        let b = t(&bt, n, k); // [k, n]
        let at = t(&a, m, k); // [k, m]
        let nt = gemm_nt_bounds(&a, &bt, m, k, n);
        assert_eq!(
            gemm_nn_bounds_with(&a, &b, m, k, n, two_order_sum_bound),
            nt
        );
        assert_eq!(
            gemm_tn_bounds_with(&at, &b, None, m, k, n, two_order_sum_bound),
            nt
        );
        // Accumulating into C₀ adds one term and |C₀| to the absolute sum.
        let c0 = vec![-3.0f32; m * n];
        let acc = gemm_tn_bounds_with(&at, &b, Some(&c0), m, k, n, two_order_sum_bound);
        let plain = gemm_nt_bounds_with(&a, &bt, m, k, n, |_, s| s);
        for (x, s) in acc.iter().zip(plain) {
            assert_eq!(*x, two_order_sum_bound(k + 1, s + 3.0));
        }
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
}
