//! Row softmax, SiLU and SwiGLU.

/// Row softmax forward: `x: [n, c]` → `y: [n, c]`, `y = exp(x − max) / Σ exp(x − max)`,
/// f32 sum in index order.
pub fn softmax_forward(x: &[f32], n: usize, c: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * c);
    assert_eq!(y.len(), n * c);
    for r in 0..n {
        let xr = &x[r * c..(r + 1) * c];
        let yr = &mut y[r * c..(r + 1) * c];
        let mx = xr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut s = 0.0f32;
        for (o, &v) in yr.iter_mut().zip(xr) {
            *o = (v - mx).exp();
            s += *o;
        }
        for o in yr.iter_mut() {
            *o /= s;
        }
    }
}

/// Row softmax backward: `dx = y ⊙ (dy − Σ_j y_j·dy_j)` for `dy, y: [n, c]`; overwrites `dx`.
/// f32 accumulation.
pub fn softmax_backward(dy: &[f32], y: &[f32], n: usize, c: usize, dx: &mut [f32]) {
    assert_eq!(dy.len(), n * c);
    assert_eq!(y.len(), n * c);
    assert_eq!(dx.len(), n * c);
    for r in 0..n {
        let (dyr, yr) = (&dy[r * c..(r + 1) * c], &y[r * c..(r + 1) * c]);
        let mut dot = 0.0f32;
        for j in 0..c {
            dot += yr[j] * dyr[j];
        }
        for j in 0..c {
            dx[r * c + j] = yr[j] * (dyr[j] - dot);
        }
    }
}

/// `silu(x) = x / (1 + e^{−x})` in f32 (PyTorch's formula).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `sigmoid(x) = 1 / (1 + e^{−x})` in f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SwiGLU forward on a fused gate/up activation: `gu: [n, 2F]` (gate in columns `0..F`, up in
/// `F..2F`, the layout of a fused `[2F, H]` gate_up weight) → `h: [n, F]`,
/// `h = silu(gate) · up`. Elementwise f32.
pub fn swiglu_forward(gu: &[f32], n: usize, f: usize, h: &mut [f32]) {
    assert_eq!(gu.len(), n * 2 * f);
    assert_eq!(h.len(), n * f);
    for r in 0..n {
        let (g, u) = gu[r * 2 * f..(r + 1) * 2 * f].split_at(f);
        for j in 0..f {
            h[r * f + j] = silu(g[j]) * u[j];
        }
    }
}

/// SwiGLU backward: `dh: [n, F]`, `gu: [n, 2F]` → overwrites `dgu: [n, 2F]` with
/// `dgate = dh·up·σ(g)·(1 + g·(1 − σ(g)))`, `dup = dh·silu(g)`. Elementwise f32.
pub fn swiglu_backward(dh: &[f32], gu: &[f32], n: usize, f: usize, dgu: &mut [f32]) {
    assert_eq!(dh.len(), n * f);
    assert_eq!(gu.len(), n * 2 * f);
    assert_eq!(dgu.len(), n * 2 * f);
    for r in 0..n {
        let (g, u) = gu[r * 2 * f..(r + 1) * 2 * f].split_at(f);
        let (dg, du) = dgu[r * 2 * f..(r + 1) * 2 * f].split_at_mut(f);
        for j in 0..f {
            let s = sigmoid(g[j]);
            let d = dh[r * f + j];
            dg[j] = d * u[j] * (s * (1.0 + g[j] * (1.0 - s)));
            du[j] = d * (g[j] * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    fn dot_eval(y: &[f32], r: &[f32]) -> Eval {
        Eval {
            value: y.iter().zip(r).map(|(a, b)| *a as f64 * *b as f64).sum(),
            magnitude: y
                .iter()
                .zip(r)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum(),
        }
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        let (n, c) = (3, 7);
        let x = test_values(n * c, 51, 3.0);
        let r = test_values(n * c, 52, 1.0);
        let mut y = vec![0.0; n * c];
        softmax_forward(&x, n, c, &mut y);
        for row in y.chunks(c) {
            let s: f32 = row.iter().sum();
            assert!((s - 1.0).abs() <= gamma(2 * c) as f32, "row sums to {s}");
        }
        let mut dx = vec![0.0; n * c];
        softmax_backward(&r, &y, n, c, &mut dx);
        let gm: Vec<f64> = dx.iter().map(|v| 4.0 * v.abs() as f64 + 1e-7).collect();
        let f = check(&x, &dx, &gm, gamma(3 * c), None, |xp| {
            let mut y = vec![0.0; n * c];
            softmax_forward(xp, n, c, &mut y);
            dot_eval(&y, &r)
        });
        assert!(f.is_empty(), "{f:#?}");
    }

    #[test]
    fn swiglu_gradient_matches_finite_differences() {
        let (n, f) = (3, 5);
        let gu = test_values(n * 2 * f, 61, 3.0);
        let r = test_values(n * f, 62, 1.0);
        let mut dgu = vec![0.0; n * 2 * f];
        swiglu_backward(&r, &gu, n, f, &mut dgu);
        let gm: Vec<f64> = dgu.iter().map(|v| 2.0 * v.abs() as f64 + 1e-7).collect();
        let fails = check(&gu, &dgu, &gm, gamma(8), None, |x| {
            let mut h = vec![0.0; n * f];
            swiglu_forward(x, n, f, &mut h);
            dot_eval(&h, &r)
        });
        assert!(fails.is_empty(), "{fails:#?}");
    }
}
