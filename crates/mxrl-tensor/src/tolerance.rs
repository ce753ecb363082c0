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
}
