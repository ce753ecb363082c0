//! Finite-difference gradient checking with a derived error bound.
//!
//! For a scalar function `L(x)` evaluated in f32 arithmetic, the central difference
//! `D(h) = (L(x+h) − L(x−h)) / 2h` has two errors:
//! - truncation `c·h² + O(h⁴)`: estimated by `|D(h) − D(h/2)|`, which is `(3/4)·c·h²` and so
//!   bounds the truncation error of `D(h/2)` (`c·h²/4`) with a factor 3 to spare;
//! - rounding: each evaluation of `L` is off by at most `ε_L·A`, where `A` is a magnitude the
//!   caller supplies (a sum of absolute values of the terms that make up `L`) and `ε_L` a
//!   relative bound derived from the op's longest f32 reduction (`γ_n = n·u/(1−n·u)`), so the
//!   difference quotient is off by at most `ε_L·A / h`.
//!
//! The analytic gradient `g` itself is computed in f32 and is off by at most `ε_L·G` with `G`
//! the caller-supplied magnitude of the gradient's terms. [`check`] asserts
//! `|g − D(h/2)| ≤ |D(h) − D(h/2)| + 2·ε_L·A/h + ε_L·G` per checked coordinate.

/// Evaluation result of the checked scalar function: the value and the magnitude `A` of its
/// terms (used in the rounding bound).
#[derive(Clone, Copy, Debug)]
pub struct Eval {
    /// `L(x)`, accumulated in f64 from f32 op outputs.
    pub value: f64,
    /// `A`: an upper bound on the absolute size of what was summed to get `value`.
    pub magnitude: f64,
}

/// `γ_n = n·u / (1 − n·u)` with `u = 2⁻²⁴`: the relative error bound of an f32 reduction of
/// length `n` (Higham, Accuracy and Stability of Numerical Algorithms, §3.1).
pub fn gamma(n: usize) -> f64 {
    let nu = n as f64 * crate::F32_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// Checks the analytic gradient `analytic = ∂L/∂x` at `x` by central differences for the
/// coordinates in `indices` (all when `None`). `eps` is `ε_L`, `grad_magnitude[i]` is `G_i`.
/// Returns a description of every failing coordinate (empty when all pass).
pub fn check(
    x: &[f32],
    analytic: &[f32],
    grad_magnitude: &[f64],
    eps: f64,
    indices: Option<&[usize]>,
    f: impl FnMut(&[f32]) -> Eval,
) -> Vec<String> {
    check_with_step(x, analytic, grad_magnitude, eps, indices, 1.0 / 128.0, f)
}

/// [`check`] with a chosen relative step `h = step·max(1, |x_i|)`: a larger step shrinks the
/// rounding term `2·ε_L·A/h` (deep compositions with a large `A`) at the price of a larger,
/// still estimated and bounded, truncation term.
pub fn check_with_step(
    x: &[f32],
    analytic: &[f32],
    grad_magnitude: &[f64],
    eps: f64,
    indices: Option<&[usize]>,
    step: f32,
    mut f: impl FnMut(&[f32]) -> Eval,
) -> Vec<String> {
    assert_eq!(x.len(), analytic.len());
    assert_eq!(x.len(), grad_magnitude.len());
    let all: Vec<usize> = (0..x.len()).collect();
    let idx = indices.unwrap_or(&all);
    let mut failures = Vec::new();
    let mut xp = x.to_vec();
    for &i in idx {
        let x0 = x[i];
        let base = (x0.abs()).max(1.0) * step;
        let mut diff = |h: f32| -> (f64, f64) {
            xp[i] = x0 + h;
            let hi = xp[i];
            let a = f(&xp);
            xp[i] = x0 - h;
            let lo = xp[i];
            let b = f(&xp);
            xp[i] = x0;
            let step = hi as f64 - lo as f64; // the exact perturbation that was applied
            (
                (a.value - b.value) / step,
                a.magnitude.max(b.magnitude) / (step / 2.0),
            )
        };
        let (d1, _) = diff(base);
        let (d2, round) = diff(base / 2.0);
        let tol = (d1 - d2).abs() + 2.0 * eps * round + eps * grad_magnitude[i];
        let g = analytic[i] as f64;
        if (g - d2).abs() > tol || !g.is_finite() {
            failures.push(format!(
                "x[{i}] = {x0}: analytic {g:e}, finite difference {d2:e} (h-step {d1:e}), tol {tol:e}"
            ));
        }
    }
    failures
}

/// Deterministic pseudo-random f32 values in `[-scale, scale)` from a seed (SplitMix64), for
/// tests that should not depend on `rand`'s stream stability.
pub fn test_values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checker must reject a gradient that is off by 1% (it is only useful if it can fail).
    #[test]
    fn rejects_a_slightly_wrong_gradient() {
        let x = test_values(6, 3, 2.0);
        let f = |x: &[f32]| {
            let v: f64 = x.iter().map(|&a| (a as f64).sin() * a as f64).sum();
            Eval {
                value: v,
                magnitude: x.iter().map(|&a| (a as f64).abs()).sum(),
            }
        };
        let g: Vec<f32> = x.iter().map(|&a| a.sin() + a * a.cos()).collect();
        let gm = vec![1e-6; 6];
        assert!(check(&x, &g, &gm, gamma(4), None, f).is_empty());
        let wrong: Vec<f32> = g.iter().map(|v| v * 1.01).collect();
        assert_eq!(check(&x, &wrong, &gm, gamma(4), None, f).len(), 6);
    }
}
