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

/// `γ_n = n·u / (1 − n·u)` with `u = 2⁻⁵³`: the relative error bound of an f64 reduction of
/// length `n`.
pub fn gamma_f64(n: usize) -> f64 {
    let nu = n as f64 * F64_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// Largest error, in ulps of the exact result, of the f32 `exp` the CPU reference calls
/// (`f32::exp` → the platform libm's `expf`; glibc ≥ 2.27 and musl share the Arm optimized
/// routine whose documented error is 0.502 ulp). One ulp is used.
pub const EXP_ULPS_CPU: u32 = 1;

/// Largest error, in ulps of the exact result, of the engine's device `exp`: the kernels
/// evaluate `(float)exp((double)x)` (CUDA's double `exp` is within 1 ulp of f64, then one
/// round-to-nearest conversion: ≤ 0.5 ulp of f32 + 2⁻²⁹ ulp). One ulp is used. (CUDA's f32
/// `expf` without fast math is documented at 2 ulps; the kernels do not use it.)
pub const EXP_ULPS_DEVICE: u32 = 1;

/// Half the smallest f32 subnormal: the absolute rounding error of one f32 operation whose
/// result is subnormal (IEEE round to nearest; no flush to zero on either device).
const SUBNORMAL_HALF: f64 = 1.0 / (1u128 << 126) as f64 / (1u64 << 24) as f64;

/// Bound on `|p_a − p_b|` for one probability of an f32 row softmax over `c` columns
/// (`mxrl_tensor::activation::softmax_forward`'s formula: `e_i = exp(x_i − max)`, any summation
/// order, one division) evaluated on two devices whose `exp` is within `ulps_a` / `ulps_b`
/// ulps; `p_ref` is device b's value.
///
/// An exp within `m` ulps is `e·(1+θ_{2m})`; the sum of `c` positive terms adds `θ_{c−1}`, the
/// division one rounding, so `p̂ = p·(1+θ_{4m+c})` (Higham's θ/γ calculus). The difference is
/// at most `(γ_{4m_a+c} + γ_{4m_b+c})·p` with `p ≤ p_ref / (1 − γ_{4m_b+c})`, plus an absolute
/// term for results in the subnormal range (`c·(m_a+m_b+2)` half-subnormals: the max term is
/// `exp(0)`, so the sum is ≥ 1 and does not amplify them).
pub fn softmax_prob_bound(p_ref: f32, c: usize, ulps_a: u32, ulps_b: u32) -> f64 {
    let na = 4 * ulps_a as usize + c;
    let nb = 4 * ulps_b as usize + c;
    let p = (p_ref as f64).abs() / (1.0 - gamma(nb));
    (gamma(na) + gamma(nb)) * p + (c as f64) * (2 * (ulps_a + ulps_b) + 4) as f64 * SUBNORMAL_HALF
}

/// Bound on `|w_a − w_b|` for one `norm_topk_prob` combine weight `w_s = p_s / Σ_j p_j` over
/// `k` selected probabilities of one softmax row of `c` columns (sum in slot order, one
/// division), on two devices whose `exp` is within `ulps_a` / `ulps_b` ulps; `w_ref` is device
/// b's value.
///
/// The softmax denominator is one common factor of every `p_j` and cancels up to the per-entry
/// divisions: `ŵ_s = e_s(1+θ_{2m+1}) / (Σ_j e_j (1+θ_{2m+k}))·(1+δ) = w_s·(1+θ_{4m+k+2})`.
/// Plus the subnormal term of [`softmax_prob_bound`] amplified by at most `c` (the selected sum
/// holds the row's largest probability, ≥ 1/c).
pub fn topk_norm_weight_bound(w_ref: f32, k: usize, c: usize, ulps_a: u32, ulps_b: u32) -> f64 {
    let na = 4 * ulps_a as usize + k + 2;
    let nb = 4 * ulps_b as usize + k + 2;
    let w = (w_ref as f64).abs() / (1.0 - gamma(nb));
    (gamma(na) + gamma(nb)) * w
        + (c * c) as f64 * (2 * (ulps_a + ulps_b) + 6) as f64 * SUBNORMAL_HALF
}

/// Bound on the difference of two evaluations of the auxiliary load-balancing loss
/// (`mxrl_tensor::routing::load_balancing_loss`: f64 sums of `m` f32 probabilities per expert
/// in any order, exact integer counts, then `E·Σ_e (c_e/m)(P_e/m)` over `e` experts in f64,
/// rounded once to f32); `loss_ref` is one device's f32 value.
///
/// Each evaluation is `loss·(1+θ⁽⁶⁴⁾_{m+e+4})·(1+δ₃₂)` (positive terms only), so they differ by
/// at most `2·(γ⁽⁶⁴⁾_{m+e+4} + u₃₂ + γ⁽⁶⁴⁾·u₃₂)·loss`, `loss ≤ loss_ref/((1−γ⁽⁶⁴⁾)(1−u₃₂))`.
pub fn aux_loss_bound(loss_ref: f32, m: usize, e: usize) -> f64 {
    let g = gamma_f64(m + e + 4);
    let u = crate::F32_UNIT_ROUNDOFF;
    let loss = (loss_ref as f64).abs() / ((1.0 - g) * (1.0 - u));
    2.0 * (g + u + g * u) * loss
}

/// A value of an f32 computation tracked against its exact result: `value` is the exact
/// result (evaluated in f64 from the exact inputs) and `err` bounds `|computed − exact|` for
/// one device (running error analysis: every f32 operation adds `u·|result| + 2⁻¹⁵⁰`, errors
/// of operands propagate through first-order-exact formulas). Used to derive per-element
/// bounds of elementwise ops whose two evaluations follow the same operation sequence.
#[derive(Clone, Copy, Debug)]
pub struct Tracked {
    /// The exact value (in f64).
    pub value: f64,
    /// Bound on the distance of the device's f32 result from `value`.
    pub err: f64,
}

impl Tracked {
    /// An input, exact on every device.
    pub fn exact(x: f32) -> Self {
        Tracked {
            value: x as f64,
            err: 0.0,
        }
    }

    fn rounded(value: f64, prop: f64) -> Self {
        let err = prop + crate::F32_UNIT_ROUNDOFF * (value.abs() + prop) + SUBNORMAL_HALF;
        Tracked { value, err }
    }

    /// `exp(a)` by a function within `ulps` ulps of the exact result (an ulp is at most
    /// `2u·|x|`, or `2⁻¹⁴⁹` in the subnormal range). Infinite error where the result leaves
    /// f32's range (a device may return the largest finite value or infinity).
    pub fn exp(self, ulps: u32) -> Self {
        let value = self.value.exp();
        let prop = (self.value + self.err).exp() * self.err;
        if value + prop >= f32::MAX as f64 {
            return Tracked {
                value,
                err: f64::INFINITY,
            };
        }
        let err = prop
            + ulps as f64
                * (2.0 * crate::F32_UNIT_ROUNDOFF * (value + prop) + 2.0 * SUBNORMAL_HALF);
        Tracked { value, err }
    }
}

impl std::ops::Neg for Tracked {
    type Output = Tracked;
    /// `−a` (exact).
    fn neg(self) -> Tracked {
        Tracked {
            value: -self.value,
            err: self.err,
        }
    }
}

impl std::ops::Add for Tracked {
    type Output = Tracked;
    /// `a + b` in f32.
    fn add(self, b: Tracked) -> Tracked {
        Tracked::rounded(self.value + b.value, self.err + b.err)
    }
}

impl std::ops::Sub for Tracked {
    type Output = Tracked;
    /// `a − b` in f32.
    fn sub(self, b: Tracked) -> Tracked {
        Tracked::rounded(self.value - b.value, self.err + b.err)
    }
}

impl std::ops::Mul for Tracked {
    type Output = Tracked;
    /// `a · b` in f32.
    fn mul(self, b: Tracked) -> Tracked {
        let prop = self.value.abs() * b.err + b.value.abs() * self.err + self.err * b.err;
        Tracked::rounded(self.value * b.value, prop)
    }
}

impl std::ops::Div for Tracked {
    type Output = Tracked;
    /// `a / b` in f32 (infinite error when `b`'s error reaches its magnitude).
    fn div(self, b: Tracked) -> Tracked {
        let bv = b.value.abs();
        if b.err >= bv {
            return Tracked {
                value: self.value / b.value,
                err: f64::INFINITY,
            };
        }
        let prop = (self.value.abs() * b.err + bv * self.err) / (bv * (bv - b.err));
        Tracked::rounded(self.value / b.value, prop)
    }
}

/// Bound on `|h_a − h_b|` for one element of `mxrl_tensor::activation::swiglu_forward`
/// (`h = (g / (1 + exp(−g)))·up`, the same operation sequence on both devices) whose `exp`
/// is within `ulps_a` / `ulps_b` ulps: the sum of both devices' tracked errors (`Tracked`),
/// with a `2⁻³⁰` relative margin for the f64 evaluation of the exact values.
pub fn swiglu_forward_bound(g: f32, up: f32, ulps_a: u32, ulps_b: u32) -> f64 {
    let one = |ulps: u32| {
        let gt = Tracked::exact(g);
        let d = Tracked::exact(1.0) + (-gt).exp(ulps);
        (gt / d * Tracked::exact(up)).err
    };
    (one(ulps_a) + one(ulps_b)) * (1.0 + 1.0 / (1u64 << 30) as f64)
}

/// Bounds `(dgate, dup)` on the two devices' difference for one element of
/// `mxrl_tensor::activation::swiglu_backward` (`s = 1/(1+exp(−g))`,
/// `dgate = (dh·up)·(s·(1 + g·(1 − s)))`, `dup = dh·(g·s)`), as [`swiglu_forward_bound`].
pub fn swiglu_backward_bounds(dh: f32, g: f32, up: f32, ulps_a: u32, ulps_b: u32) -> (f64, f64) {
    let one = |ulps: u32| {
        let (gt, one) = (Tracked::exact(g), Tracked::exact(1.0));
        let s = one / (one + (-gt).exp(ulps));
        let c = s * (one + gt * (one - s));
        let p = Tracked::exact(dh) * Tracked::exact(up);
        let dgate = (p * c).err;
        let dup = (Tracked::exact(dh) * (gt * s)).err;
        (dgate, dup)
    };
    let (a, b) = (one(ulps_a), one(ulps_b));
    let m = 1.0 + 1.0 / (1u64 << 30) as f64;
    ((a.0 + b.0) * m, (a.1 + b.1) * m)
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
    fn tracked_bound_covers_a_perturbed_exp() {
        // A device whose exp is off by one ulp stays within the swiglu bound of a correct one.
        for &(g, up) in &[
            (0.3f32, 1.5f32),
            (-1.278, 2.0),
            (5.0, -0.7),
            (-20.0, 3.0),
            (40.0, 1.0),
        ] {
            let e = (-g).exp();
            let e_bad = f32::from_bits(e.to_bits() + 1);
            let h = g / (1.0 + e) * up;
            let h_bad = g / (1.0 + e_bad) * up;
            let b = swiglu_forward_bound(g, up, 1, 1);
            assert!(
                ((h - h_bad) as f64).abs() <= b,
                "g={g}: {h} vs {h_bad}, bound {b:e}"
            );
            assert!(
                b <= 1e-5 * (h as f64).abs() + 1e-30,
                "g={g}: bound {b:e} is loose"
            );
        }
    }

    #[test]
    fn softmax_bound_covers_a_perturbed_exp() {
        let x = [0.5f32, -1.0, 2.0, 0.0, 1.25];
        let mx = 2.0f32;
        let e: Vec<f32> = x.iter().map(|v| (v - mx).exp()).collect();
        let mut e_bad = e.clone();
        e_bad[1] = f32::from_bits(e[1].to_bits() - 1);
        let s: f32 = e.iter().sum();
        let s_bad: f32 = e_bad.iter().rev().sum();
        for i in 0..x.len() {
            let (p, pb) = (e[i] / s, e_bad[i] / s_bad);
            let b = softmax_prob_bound(p, x.len(), 1, 1);
            assert!(
                ((p - pb) as f64).abs() <= b,
                "[{i}] {p} vs {pb}, bound {b:e}"
            );
        }
    }
    /// A device whose exp is one ulp off (either way) on every call stays within the SwiGLU
    /// forward and backward bounds of a correct one, over a sweep that includes the
    /// cancellation of `1 + g·(1 − s)` near `g ≈ −1.28`.
    #[test]
    fn swiglu_bounds_cover_an_exp_one_ulp_off() {
        let gs = crate::gradcheck::test_values(20_000, 11, 30.0);
        let ups = crate::gradcheck::test_values(20_000, 12, 3.0);
        let dhs = crate::gradcheck::test_values(20_000, 13, 2.0);
        let near = crate::gradcheck::test_values(2_000, 14, 0.01);
        let cases = gs
            .iter()
            .zip(&ups)
            .zip(&dhs)
            .map(|((&g, &u), &d)| (g, u, d))
            .chain(near.iter().map(|&x| (-1.278_464_5 + x, 1.5, -0.75)));
        for (g, up, dh) in cases {
            for bump in [-1i32, 1] {
                let exp_bad = |x: f32| f32::from_bits((x.exp().to_bits() as i32 + bump) as u32);
                let fwd = |e: f32| g / (1.0 + e) * up;
                let bwd = |e: f32| {
                    let s = 1.0 / (1.0 + e);
                    (dh * up * (s * (1.0 + g * (1.0 - s))), dh * (g * s))
                };
                let (e, eb) = ((-g).exp(), exp_bad(-g));
                let b = swiglu_forward_bound(g, up, 1, 1);
                let (h, hb) = (fwd(e), fwd(eb));
                assert!(
                    ((h - hb) as f64).abs() <= b,
                    "g={g} up={up}: {h:e} vs {hb:e}, {b:e}"
                );
                let (bg, bu) = swiglu_backward_bounds(dh, g, up, 1, 1);
                let ((dg, du), (dgb, dub)) = (bwd(e), bwd(eb));
                assert!(
                    ((dg - dgb) as f64).abs() <= bg,
                    "g={g}: dgate {dg:e} vs {dgb:e}, {bg:e}"
                );
                assert!(
                    ((du - dub) as f64).abs() <= bu,
                    "g={g}: dup {du:e} vs {dub:e}, {bu:e}"
                );
            }
        }
    }
    /// A softmax whose exps are each one ulp off (pseudo-random direction) and whose sums run
    /// in reverse order stays within the probability and normalized-weight bounds.
    #[test]
    fn softmax_and_topk_bounds_cover_perturbed_exps_and_order() {
        let (n, c, k) = (200, 64, 8);
        let x = crate::gradcheck::test_values(n * c, 21, 6.0);
        let dir = crate::gradcheck::test_values(n * c, 22, 1.0);
        for r in 0..n {
            let xr = &x[r * c..(r + 1) * c];
            let mx = xr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = xr.iter().map(|v| (v - mx).exp()).collect();
            let eb: Vec<f32> = e
                .iter()
                .zip(&dir[r * c..(r + 1) * c])
                .map(|(v, d)| {
                    f32::from_bits(if *d < 0.0 {
                        v.to_bits() - 1
                    } else {
                        v.to_bits() + 1
                    })
                })
                .collect();
            let s: f32 = e.iter().sum();
            let sb: f32 = eb.iter().rev().sum();
            let p: Vec<f32> = e.iter().map(|v| v / s).collect();
            let pb: Vec<f32> = eb.iter().map(|v| v / sb).collect();
            for j in 0..c {
                let b = softmax_prob_bound(p[j], c, 1, 1);
                assert!(((p[j] - pb[j]) as f64).abs() <= b, "row {r} [{j}]");
            }
            // the first k columns stand for the selected experts
            let sel: f32 = p[..k].iter().sum();
            let selb: f32 = pb[..k].iter().rev().sum();
            for j in 0..k {
                let (w, wb) = (p[j] / sel, pb[j] / selb);
                let b = topk_norm_weight_bound(w, k, c, 1, 1);
                assert!(
                    ((w - wb) as f64).abs() <= b,
                    "row {r} slot {j}: {w:e} vs {wb:e}"
                );
            }
        }
    }
}
