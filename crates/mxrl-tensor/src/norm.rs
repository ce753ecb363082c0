//! RMSNorm (Qwen/LLaMA form: `y = x / sqrt(mean(x²) + ε) · w`).

/// RMSNorm forward over `n` rows of width `h`.
///
/// `x: [n, h]`, `w: [h]` → `y: [n, h]`, `rstd: [n]` (saved for backward), with
/// `rstd[r] = 1 / sqrt(Σ_j x[r,j]² / h + eps)` and `y[r,j] = (x[r,j] · rstd[r]) · w[j]`.
/// Accumulation: f32, in index order. (Matches HF `Qwen3MoeRMSNorm` in f32.)
pub fn rmsnorm_forward(
    x: &[f32],
    w: &[f32],
    n: usize,
    h: usize,
    eps: f32,
    y: &mut [f32],
    rstd: &mut [f32],
) {
    assert_eq!(x.len(), n * h);
    assert_eq!(w.len(), h);
    assert_eq!(y.len(), n * h);
    assert_eq!(rstd.len(), n);
    for r in 0..n {
        let xr = &x[r * h..(r + 1) * h];
        let mut ss = 0.0f32;
        for &v in xr {
            ss += v * v;
        }
        let rs = 1.0 / (ss / h as f32 + eps).sqrt();
        rstd[r] = rs;
        for ((yo, &xv), &wv) in y[r * h..(r + 1) * h].iter_mut().zip(xr).zip(w) {
            *yo = (xv * rs) * wv;
        }
    }
}

/// RMSNorm backward.
///
/// Inputs `dy, x: [n, h]`, `w: [h]`, `rstd: [n]` from the forward. Overwrites `dx: [n, h]`,
/// **accumulates** into `dw: [h]`:
/// `dw[j] += Σ_r dy[r,j]·x[r,j]·rstd[r]`,
/// `dx[r,j] = rstd[r]·(w[j]·dy[r,j]) − x[r,j]·rstd[r]³/h · Σ_i w[i]·dy[r,i]·x[r,i]`.
/// Accumulation: f32.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    n: usize,
    h: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) {
    assert_eq!(dy.len(), n * h);
    assert_eq!(x.len(), n * h);
    assert_eq!(dx.len(), n * h);
    assert_eq!(dw.len(), h);
    for r in 0..n {
        let rs = rstd[r];
        let xr = &x[r * h..(r + 1) * h];
        let dyr = &dy[r * h..(r + 1) * h];
        let mut dot = 0.0f32;
        for j in 0..h {
            dot += w[j] * dyr[j] * xr[j];
            dw[j] += dyr[j] * xr[j] * rs;
        }
        let c = dot * rs * rs * rs / h as f32;
        for j in 0..h {
            dx[r * h + j] = rs * w[j] * dyr[j] - xr[j] * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    #[test]
    fn rmsnorm_gradients_match_finite_differences() {
        let (n, h, eps) = (3, 8, 1e-6f32);
        let x = test_values(n * h, 1, 2.0);
        let w = test_values(h, 2, 1.5);
        let r = test_values(n * h, 3, 1.0); // L = Σ r·y
        let loss = |x: &[f32], w: &[f32]| {
            let mut y = vec![0.0; n * h];
            let mut rs = vec![0.0; n];
            rmsnorm_forward(x, w, n, h, eps, &mut y, &mut rs);
            let value = y
                .iter()
                .zip(&r)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            let magnitude = y
                .iter()
                .zip(&r)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            Eval { value, magnitude }
        };
        let mut y = vec![0.0; n * h];
        let mut rs = vec![0.0; n];
        rmsnorm_forward(&x, &w, n, h, eps, &mut y, &mut rs);
        let mut dx = vec![0.0; n * h];
        let mut dw = vec![0.0; h];
        rmsnorm_backward(&r, &x, &w, &rs, n, h, &mut dx, &mut dw);
        // Longest f32 chain: the h-term sum of squares, sqrt, divide, two products (≈ h + 4).
        let eps_l = gamma(2 * (h + 4));
        let gx: Vec<f64> = dx.iter().map(|v| v.abs() as f64 * 4.0 + 1e-6).collect();
        let f = check(&x, &dx, &gx, eps_l, None, |xp| loss(xp, &w));
        assert!(f.is_empty(), "dx: {f:#?}");
        let gw: Vec<f64> = dw.iter().map(|v| v.abs() as f64 * 4.0 + 1e-6).collect();
        let f = check(&w, &dw, &gw, eps_l, None, |wp| loss(&x, wp));
        assert!(f.is_empty(), "dw: {f:#?}");
    }
}
