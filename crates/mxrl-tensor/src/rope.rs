//! Rotary position embedding in the rotate-half form used by Qwen/LLaMA in Hugging Face:
//! for a head vector `x` of width `D` (half `D/2`), frequency `i < D/2`:
//! `y[i] = x[i]·cos − x[i+D/2]·sin`, `y[i+D/2] = x[i+D/2]·cos + x[i]·sin`,
//! angle `= pos · inv_freq[i]`, `inv_freq[i] = 1 / θ^(2i/D)`.

/// cos/sin tables for a list of token positions: `cos, sin: [n, D/2]`.
///
/// Computed in f32 like HF's `rotary_emb`: `e = fl(2i / D)`, `inv = fl(1 / fl(θ^e))`,
/// `angle = fl(pos · inv)`, `cos = fl(cos(angle))`.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Tables for the given positions, head width `head_dim` (even) and base `theta`.
    pub fn new(positions: &[usize], head_dim: usize, theta: f64) -> Self {
        assert!(head_dim & 1 == 0, "RoPE head_dim {head_dim} must be even");
        let half = head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| {
                let e = (2 * i) as f32 / head_dim as f32;
                1.0f32 / (theta as f32).powf(e)
            })
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Number of positions in the table.
    pub fn len(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.cos.is_empty()
    }

    /// Half the head width, `D/2` (the table's row width).
    pub fn half(&self) -> usize {
        self.half
    }

    /// The cosines, row-major `[len, D/2]` (row `t` for the `t`-th position given to [`RopeTable::new`]).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// The sines, row-major `[len, D/2]`, like [`RopeTable::cos`].
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// RoPE forward, in place: `x: [n, heads·D]`, row `t` rotated by the table's row `t`.
/// Pure f32 arithmetic, two products and one sum per output.
pub fn rope_forward(x: &mut [f32], n: usize, heads: usize, table: &RopeTable) {
    rope_apply(x, n, heads, table, 1.0);
}

/// RoPE backward, in place: turns `dy: [n, heads·D]` into `dx` by the transposed rotation
/// (`dx[i] = dy[i]·cos + dy[i+D/2]·sin`, `dx[i+D/2] = dy[i+D/2]·cos − dy[i]·sin`).
pub fn rope_backward(dy: &mut [f32], n: usize, heads: usize, table: &RopeTable) {
    rope_apply(dy, n, heads, table, -1.0);
}

fn rope_apply(x: &mut [f32], n: usize, heads: usize, table: &RopeTable, sign: f32) {
    let half = table.half;
    let d = 2 * half;
    assert_eq!(x.len(), n * heads * d);
    assert!(
        table.len() >= n,
        "RoPE table has {} rows, need {n}",
        table.len()
    );
    for t in 0..n {
        let cs = &table.cos[t * half..(t + 1) * half];
        let sn = &table.sin[t * half..(t + 1) * half];
        for hh in 0..heads {
            let v = &mut x[(t * heads + hh) * d..(t * heads + hh + 1) * d];
            for i in 0..half {
                let (a, b) = (v[i], v[i + half]);
                let s = sign * sn[i];
                v[i] = a * cs[i] - b * s;
                v[i + half] = b * cs[i] + a * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    #[test]
    fn rope_gradient_matches_finite_differences() {
        let (n, heads, d) = (4, 2, 8);
        let pos = [0usize, 1, 5, 17];
        let table = RopeTable::new(&pos, d, 10000.0);
        let x = test_values(n * heads * d, 11, 1.0);
        let r = test_values(n * heads * d, 12, 1.0);
        let mut g = r.clone();
        rope_backward(&mut g, n, heads, &table);
        let f = |xp: &[f32]| {
            let mut y = xp.to_vec();
            rope_forward(&mut y, n, heads, &table);
            Eval {
                value: y.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum(),
                magnitude: y
                    .iter()
                    .zip(&r)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum(),
            }
        };
        let gm: Vec<f64> = r.iter().map(|v| 2.0 * v.abs() as f64).collect();
        let fails = check(&x, &g, &gm, gamma(4), None, f);
        assert!(fails.is_empty(), "{fails:#?}");
    }

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let d = 16;
        let table = RopeTable::new(&[0, 1000], d, 1e6);
        let x = test_values(2 * d, 5, 3.0);
        let mut y = x.clone();
        rope_forward(&mut y, 2, 1, &table);
        assert_eq!(&y[..d], &x[..d]);
        let n0: f64 = x[d..].iter().map(|v| (*v as f64).powi(2)).sum();
        let n1: f64 = y[d..].iter().map(|v| (*v as f64).powi(2)).sum();
        // each output: 2 products + 1 sum in f32, and cos²+sin² = 1 within 2 roundings.
        assert!((n0 - n1).abs() <= n0 * gamma(8), "{n0} vs {n1}");
    }
}
