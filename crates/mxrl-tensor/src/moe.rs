//! MoE dispatch (group token rows by expert) and combine (weighted scatter-add back).
//!
//! The expert computation itself (gate_up GEMM, SwiGLU, down GEMM) runs on each expert's
//! gathered rows `[n_e, H]` between [`gather`] and [`combine_forward`].

use crate::routing::Routes;

/// Token → expert assignment grouped by expert: the rows of expert `x` are
/// `entries[starts[x] .. starts[x+1]]`, each `(token, slot)`, in increasing token order.
#[derive(Clone, Debug)]
pub struct Dispatch {
    /// `(token, slot)` pairs grouped by expert.
    pub entries: Vec<(u32, u32)>,
    /// `[E + 1]` group boundaries into `entries`.
    pub starts: Vec<usize>,
}

impl Dispatch {
    /// Groups the routes of `N` tokens over `e` experts (a counting sort: stable in token order).
    pub fn new(routes: &Routes, e: usize) -> Self {
        let k = routes.top_k;
        let mut counts = vec![0usize; e + 1];
        for &i in &routes.ids {
            counts[i as usize + 1] += 1;
        }
        for x in 0..e {
            counts[x + 1] += counts[x];
        }
        let starts = counts.clone();
        let mut fill = counts;
        let mut entries = vec![(0u32, 0u32); routes.ids.len()];
        for (idx, &i) in routes.ids.iter().enumerate() {
            let p = &mut fill[i as usize];
            entries[*p] = ((idx / k) as u32, (idx % k) as u32);
            *p += 1;
        }
        Dispatch { entries, starts }
    }

    /// The `(token, slot)` rows of expert `x`.
    pub fn rows(&self, x: usize) -> &[(u32, u32)] {
        &self.entries[self.starts[x]..self.starts[x + 1]]
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        self.starts.len() - 1
    }
}

/// Gathers rows `x[token]` (`x: [N, h]`) for the given `(token, slot)` list into `[rows, h]`.
pub fn gather(x: &[f32], h: usize, rows: &[(u32, u32)]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * h);
    for &(t, _) in rows {
        out.extend_from_slice(&x[t as usize * h..(t as usize + 1) * h]);
    }
    out
}

/// Backward of [`gather`]: `dx[token] += dg[row]` (`dx: [N, h]`, `dg: [rows, h]`).
pub fn gather_backward(dg: &[f32], h: usize, rows: &[(u32, u32)], dx: &mut [f32]) {
    for (r, &(t, _)) in rows.iter().enumerate() {
        let d = &mut dx[t as usize * h..(t as usize + 1) * h];
        for (a, &b) in d.iter_mut().zip(&dg[r * h..(r + 1) * h]) {
            *a += b;
        }
    }
}

/// Combine forward: `out[token] += w[token, slot] · y[row]` for one expert's output rows
/// `y: [rows, h]` (`out: [N, h]`). Calling it for experts `0..E` in order gives, per token,
/// an f32 sum in expert order (as HF's per-expert `index_add_`).
pub fn combine_forward(y: &[f32], h: usize, rows: &[(u32, u32)], routes: &Routes, out: &mut [f32]) {
    let k = routes.top_k;
    for (r, &(t, s)) in rows.iter().enumerate() {
        let w = routes.weights[t as usize * k + s as usize];
        let o = &mut out[t as usize * h..(t as usize + 1) * h];
        for (a, &b) in o.iter_mut().zip(&y[r * h..(r + 1) * h]) {
            *a += w * b;
        }
    }
}

/// Combine backward for one expert: given `dout: [N, h]` and the expert's forward output
/// `y: [rows, h]`, returns `dy: [rows, h] = w·dout[token]` and **accumulates**
/// `dweights[token, slot] += dout[token]·y[row]` (f32 dot of length h).
pub fn combine_backward(
    dout: &[f32],
    y: &[f32],
    h: usize,
    rows: &[(u32, u32)],
    routes: &Routes,
    dweights: &mut [f32],
) -> Vec<f32> {
    let k = routes.top_k;
    let mut dy = vec![0.0f32; rows.len() * h];
    for (r, &(t, s)) in rows.iter().enumerate() {
        let idx = t as usize * k + s as usize;
        let w = routes.weights[idx];
        let d = &dout[t as usize * h..(t as usize + 1) * h];
        let yr = &y[r * h..(r + 1) * h];
        let mut dot = 0.0f32;
        for c in 0..h {
            dy[r * h + c] = w * d[c];
            dot += d[c] * yr[c];
        }
        dweights[idx] += dot;
    }
    dy
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    fn routes() -> Routes {
        Routes {
            top_k: 2,
            ids: vec![2, 0, 1, 2, 0, 1, 2, 1],
            weights: test_values(8, 5, 1.0),
        }
    }

    #[test]
    fn dispatch_groups_by_expert_in_token_order() {
        let d = Dispatch::new(&routes(), 4);
        assert_eq!(d.rows(0), &[(0, 1), (2, 0)]);
        assert_eq!(d.rows(1), &[(1, 0), (2, 1), (3, 1)]);
        assert_eq!(d.rows(2), &[(0, 0), (1, 1), (3, 0)]);
        assert!(d.rows(3).is_empty());
    }

    /// `out = Σ_experts combine(expert_fn(gather(x)))` with a fixed per-expert scaling as the
    /// "expert"; checks d/dx and d/dweights against finite differences.
    #[test]
    fn dispatch_combine_gradients_match_finite_differences() {
        let (n, h, e) = (4, 3, 4);
        let x = test_values(n * h, 7, 1.0);
        let r = test_values(n * h, 8, 1.0);
        let base = routes();
        let forward = |x: &[f32], w: &[f32]| {
            let rt = Routes {
                top_k: 2,
                ids: base.ids.clone(),
                weights: w.to_vec(),
            };
            let d = Dispatch::new(&rt, e);
            let mut out = vec![0.0; n * h];
            for ex in 0..e {
                let g: Vec<f32> = gather(x, h, d.rows(ex))
                    .iter()
                    .map(|v| v * (ex as f32 + 1.0) + v * v)
                    .collect();
                combine_forward(&g, h, d.rows(ex), &rt, &mut out);
            }
            Eval {
                value: out.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum(),
                magnitude: out
                    .iter()
                    .zip(&r)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum(),
            }
        };
        let d = Dispatch::new(&base, e);
        let mut dx = vec![0.0; n * h];
        let mut dw = vec![0.0; 8];
        for ex in 0..e {
            let xin = gather(&x, h, d.rows(ex));
            let y: Vec<f32> = xin.iter().map(|v| v * (ex as f32 + 1.0) + v * v).collect();
            let dy = combine_backward(&r, &y, h, d.rows(ex), &base, &mut dw);
            let dxin: Vec<f32> = dy
                .iter()
                .zip(&xin)
                .map(|(g, v)| g * (ex as f32 + 1.0 + 2.0 * v))
                .collect();
            gather_backward(&dxin, h, d.rows(ex), &mut dx);
        }
        let gm = |g: &[f32]| {
            g.iter()
                .map(|v| 4.0 * v.abs() as f64 + 1e-7)
                .collect::<Vec<_>>()
        };
        let f = check(&x, &dx, &gm(&dx), gamma(16), None, |xp| {
            forward(xp, &base.weights)
        });
        assert!(f.is_empty(), "dx {f:#?}");
        let f = check(&base.weights, &dw, &gm(&dw), gamma(16), None, |wp| {
            forward(&x, wp)
        });
        assert!(f.is_empty(), "dw {f:#?}");
    }
}
