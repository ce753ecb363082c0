//! Log-softmax, per-token logprobs and cross-entropy.
//!
//! With temperature `τ > 0`, the distribution is `softmax(z / τ)`; `lse = logsumexp(z / τ)`
//! is computed max-subtracted with an f32 sum over the vocabulary.

/// `logsumexp` of one row scaled by `1/τ`: `m + ln Σ_v exp(z_v/τ − m)`, `m = max_v z_v/τ`.
fn row_lse(z: &[f32], inv_t: f32) -> f32 {
    let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b * inv_t));
    let mut s = 0.0f32;
    for &v in z {
        s += (v * inv_t - m).exp();
    }
    m + s.ln()
}

/// Log-softmax forward: `z: [n, v]` → `y = z/τ − lse(z/τ)` (`[n, v]`).
pub fn log_softmax_forward(z: &[f32], n: usize, v: usize, temperature: f32, y: &mut [f32]) {
    assert_eq!(z.len(), n * v);
    assert_eq!(y.len(), n * v);
    let inv_t = 1.0 / temperature;
    for r in 0..n {
        let zr = &z[r * v..(r + 1) * v];
        let lse = row_lse(zr, inv_t);
        for (o, &x) in y[r * v..(r + 1) * v].iter_mut().zip(zr) {
            *o = x * inv_t - lse;
        }
    }
}

/// Per-token logprobs forward: `z: [n, v]`, `targets: [n]` → `logprobs: [n]`
/// (`= z[t]/τ − lse_t`) and `lse: [n]` (saved for backward).
///
/// # Panics
/// If a target id is not below `v` (the model validates token ids before calling this).
pub fn logprobs_forward(
    z: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
    temperature: f32,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(z.len(), n * v);
    assert_eq!(targets.len(), n);
    let inv_t = 1.0 / temperature;
    let mut lp = Vec::with_capacity(n);
    let mut lses = Vec::with_capacity(n);
    for r in 0..n {
        let zr = &z[r * v..(r + 1) * v];
        let lse = row_lse(zr, inv_t);
        let t = targets[r] as usize;
        assert!(t < v, "target {t} out of vocabulary {v}");
        lp.push(zr[t] * inv_t - lse);
        lses.push(lse);
    }
    (lp, lses)
}

/// Per-token logprobs backward: `dlogp: [n]` → overwrites `dz: [n, v]` with
/// `dz_v = (dlogp / τ)·(1[v = target] − softmax(z/τ)_v)`.
#[allow(clippy::too_many_arguments)]
pub fn logprobs_backward(
    dlogp: &[f32],
    z: &[f32],
    lse: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
    temperature: f32,
    dz: &mut [f32],
) {
    assert_eq!(dz.len(), n * v);
    let inv_t = 1.0 / temperature;
    for r in 0..n {
        let g = dlogp[r] * inv_t;
        let zr = &z[r * v..(r + 1) * v];
        let dr = &mut dz[r * v..(r + 1) * v];
        for (d, &x) in dr.iter_mut().zip(zr) {
            *d = -g * (x * inv_t - lse[r]).exp();
        }
        dr[targets[r] as usize] += g;
    }
}

/// `log softmax(logits / temperature)` of one row into `out`, the normaliser summed in f64 (so
/// the same row always gives the same bits): the row form the RL loop's entropy and sampling
/// use.
pub fn log_softmax_tempered(logits: &[f32], temperature: f32, out: &mut Vec<f32>) {
    out.clear();
    let inv_t = 1.0 / temperature;
    let mx = logits
        .iter()
        .map(|&x| x * inv_t)
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&x| ((x * inv_t - mx) as f64).exp())
        .sum();
    let lse = mx + sum.ln() as f32;
    out.extend(logits.iter().map(|&x| x * inv_t - lse));
}

/// Entropy `−Σ_v p_v·log p_v` of a distribution given by its logprobs (terms with a
/// non-finite logprob count 0), summed in f64.
pub fn entropy_of_logprobs(logp: &[f32]) -> f32 {
    -logp
        .iter()
        .map(|&l| {
            if l.is_finite() {
                (l.exp() * l) as f64
            } else {
                0.0
            }
        })
        .sum::<f64>() as f32
}

/// Per-row entropy of `softmax(z / τ)`, `z: [n, v]`: [`log_softmax_forward`] of each row, then
/// [`entropy_of_logprobs`].
pub fn entropy_forward(z: &[f32], n: usize, v: usize, temperature: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; v];
    (0..n)
        .map(|r| {
            log_softmax_forward(&z[r * v..(r + 1) * v], 1, v, temperature, &mut y);
            entropy_of_logprobs(&y)
        })
        .collect()
}

/// Mean cross-entropy `−(1/n)·Σ_t logprob_t` at `τ = 1` and its gradient `dz: [n, v]`
/// (`(softmax − onehot)/n`), accumulated in f64 over tokens.
pub fn cross_entropy(z: &[f32], targets: &[u32], n: usize, v: usize) -> (f32, Vec<f32>) {
    let (lp, lse) = logprobs_forward(z, targets, n, v, 1.0);
    let loss = -lp.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let dlogp = vec![-1.0 / n as f32; n];
    let mut dz = vec![0.0; n * v];
    logprobs_backward(&dlogp, z, &lse, targets, n, v, 1.0, &mut dz);
    (loss as f32, dz)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    #[test]
    fn logprobs_match_log_softmax_and_normalize() {
        let (n, v) = (3, 11);
        let z = test_values(n * v, 101, 4.0);
        let mut ls = vec![0.0; n * v];
        log_softmax_forward(&z, n, v, 0.7, &mut ls);
        let targets = [3u32, 0, 10];
        let (lp, _) = logprobs_forward(&z, &targets, n, v, 0.7);
        for r in 0..n {
            assert_eq!(lp[r], ls[r * v + targets[r] as usize]);
            let s: f64 = ls[r * v..(r + 1) * v]
                .iter()
                .map(|x| (*x as f64).exp())
                .sum();
            // lse carries γ_{v+2} relative error of a value ≤ ~6 in magnitude
            assert!((s - 1.0).abs() <= 8.0 * gamma(v + 4), "row {r} sums to {s}");
        }
    }

    #[test]
    fn logprob_and_cross_entropy_gradients_match_finite_differences() {
        let (n, v) = (3, 9);
        let z = test_values(n * v, 111, 3.0);
        let targets = [1u32, 8, 4];
        let r = test_values(n, 112, 1.0);
        for tau in [1.0f32, 0.6] {
            let (_, lse) = logprobs_forward(&z, &targets, n, v, tau);
            let mut dz = vec![0.0; n * v];
            logprobs_backward(&r, &z, &lse, &targets, n, v, tau, &mut dz);
            let gm: Vec<f64> = dz.iter().map(|x| 4.0 * x.abs() as f64 + 1e-7).collect();
            let f = check(&z, &dz, &gm, gamma(2 * v + 8), None, |zp| {
                let (lp, _) = logprobs_forward(zp, &targets, n, v, tau);
                Eval {
                    value: lp.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum(),
                    magnitude: lp.iter().map(|a| a.abs() as f64 + 8.0).sum(),
                }
            });
            assert!(f.is_empty(), "tau {tau}: {f:#?}");
        }
        let (_, dz) = cross_entropy(&z, &targets, n, v);
        let gm: Vec<f64> = dz.iter().map(|x| 4.0 * x.abs() as f64 + 1e-7).collect();
        let f = check(&z, &dz, &gm, gamma(2 * v + 8), None, |zp| {
            let (l, _) = cross_entropy(zp, &targets, n, v);
            Eval {
                value: l as f64,
                magnitude: l.abs() as f64 + 8.0,
            }
        });
        assert!(f.is_empty(), "ce: {f:#?}");
    }
}
