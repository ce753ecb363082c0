//! Sampling one token from a row of logits: the reference of every device's sampler.
//!
//! Greedy (temperature 0) takes the first index of the maximum and reports its logprob at
//! `τ = 1`; otherwise the kept set is the first `keep` tokens in the order (probability
//! descending, index ascending) with `keep = top_k` (0: all) cut to the smallest prefix whose
//! mass reaches `top_p·Σp` (at least one), and the token is the kept one whose cumulative
//! mass — kept tokens in index order — first exceeds `u·Σ_kept p` for the uniform
//! `u ∈ [0, 1)` (so drawn with probability `p/Σ_kept p`); its logprob is `z/τ − lse(z/τ)`
//! under the full tempered distribution. Index order (not probability order) is what a
//! device walks in parallel, each thread over its own contiguous range, so host and device
//! draw the same token from the same `u` up to the rounding of the f64 partial sums.
//!
//! Devices draw `u` with [`uniform`]: a counter-based generator of `(seed, step, row)`, so the
//! same sequence samples the same token on every run and for any batch size, and a captured
//! decode step needs no generator state.

use crate::loss::logprobs_forward;

/// Sampling parameters of one decode step (shared by all rows).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// Temperature (`0` = greedy; otherwise `> 0`).
    pub temperature: f32,
    /// Nucleus mass (`≥ 1` = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (`0` = off).
    pub top_k: usize,
    /// RNG seed.
    pub seed: u64,
    /// Decode step (the RNG counter besides the row).
    pub step: u64,
}

impl SampleParams {
    /// Greedy decoding (argmax, lowest id among ties).
    pub fn greedy() -> Self {
        SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            step: 0,
        }
    }

    /// Checks the parameters: temperature finite and `≥ 0`, top-p not NaN and `≥ 0`.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature {t} must be finite and ≥ 0"));
        }
        if self.top_p.is_nan() || self.top_p < 0.0 {
            return Err(format!("top_p {} must be ≥ 0", self.top_p));
        }
        Ok(())
    }
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The uniform draw in `[0, 1)` of row `row` at step `step` (53 random bits of splitmix64
/// chained over the three counters).
pub fn uniform(seed: u64, step: u64, row: u64) -> f64 {
    let mut h = splitmix64(seed);
    h = splitmix64(h ^ step);
    h = splitmix64(h ^ row);
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Samples one token of `logits` (one row, `V` entries) with the uniform draw `u ∈ [0, 1)`
/// (ignored when greedy); returns `(token, logprob)` as the module documents.
pub fn sample_row(
    logits: &[f32],
    temperature: f32,
    top_p: f32,
    top_k: usize,
    u: f64,
) -> (u32, f32) {
    let v = logits.len();
    if temperature == 0.0 {
        let mut best = 0;
        for i in 1..v {
            if logits[i] > logits[best] {
                best = i;
            }
        }
        let (lp, _) = logprobs_forward(logits, &[best as u32], 1, v, 1.0);
        return (best as u32, lp[0]);
    }
    let inv_t = 1.0 / temperature;
    let m = logits
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b * inv_t));
    let p: Vec<f32> = logits.iter().map(|&z| (z * inv_t - m).exp()).collect();
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    let mut keep = if top_k > 0 { top_k.min(v) } else { v };
    if top_p < 1.0 {
        let total: f64 = p.iter().map(|&x| x as f64).sum();
        let mut acc = 0.0f64;
        for (i, &idx) in order.iter().enumerate().take(keep) {
            acc += p[idx] as f64;
            if acc >= top_p as f64 * total {
                keep = i + 1;
                break;
            }
        }
    }
    // The kept set, walked in index order (as a device walks it, each thread over its own
    // contiguous range); the last kept token if rounding leaves `u` past the mass.
    let mut kept = vec![false; v];
    for &i in &order[..keep.max(1)] {
        kept[i] = true;
    }
    let mass: f64 = (0..v).filter(|&i| kept[i]).map(|i| p[i] as f64).sum();
    let u = u * mass;
    let mut acc = 0.0f64;
    let mut tok = (0..v).rev().find(|&i| kept[i]).unwrap_or(0);
    for i in (0..v).filter(|&i| kept[i]) {
        acc += p[i] as f64;
        if u < acc {
            tok = i;
            break;
        }
    }
    let (lp, _) = logprobs_forward(logits, &[tok as u32], 1, v, temperature);
    (tok as u32, lp[0])
}

/// Samples every row of `logits: [rows, V]` with `p`, row `r` drawing [`uniform`]`(p.seed,
/// p.step, r)`: the reference of a device's batched sampler.
pub fn sample_rows(
    logits: &[f32],
    rows: usize,
    v: usize,
    p: &SampleParams,
) -> (Vec<u32>, Vec<f32>) {
    (0..rows)
        .map(|r| {
            let u = uniform(p.seed, p.step, r as u64);
            sample_row(
                &logits[r * v..(r + 1) * v],
                p.temperature,
                p.top_p,
                p.top_k,
                u,
            )
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        let (t, lp) = sample_row(&[0.5, 2.0, 2.0, -1.0], 0.0, 1.0, 0, 0.99);
        assert_eq!(t, 1);
        let want = logprobs_forward(&[0.5, 2.0, 2.0, -1.0], &[1], 1, 4, 1.0).0[0];
        assert_eq!(lp.to_bits(), want.to_bits());
    }

    #[test]
    fn draw_walks_the_kept_set_in_index_order() {
        // p ∝ e^z: token 2 is most likely, then 0, then 1.
        let z = [1.0f32, 0.0, 2.0];
        let e: Vec<f64> = z.iter().map(|&x| ((x - 2.0f32).exp()) as f64).collect();
        let total: f64 = e.iter().sum();
        // Cumulative mass in index order: token 0, then 1, then 2.
        let c0 = e[0] / total;
        let c1 = (e[0] + e[1]) / total;
        assert_eq!(sample_row(&z, 1.0, 1.0, 0, c0 * 0.999).0, 0);
        assert_eq!(sample_row(&z, 1.0, 1.0, 0, c0 * 1.001).0, 1);
        assert_eq!(sample_row(&z, 1.0, 1.0, 0, c1 * 1.001).0, 2);
        // top_k 2 keeps tokens 2 and 0: index order walks 0 first.
        let k2 = e[0] / (e[0] + e[2]);
        assert_eq!(sample_row(&z, 1.0, 1.0, 2, k2 * 0.999).0, 0);
        assert_eq!(sample_row(&z, 1.0, 1.0, 2, k2 * 1.001).0, 2);
        // top_k 1 always picks the most likely token.
        assert_eq!(sample_row(&z, 1.0, 1.0, 1, 0.0).0, 2);
        // top_p below p(2)/Σ keeps only token 2.
        assert_eq!(
            sample_row(&z, 1.0, (e[2] / total * 0.5) as f32, 0, 0.0).0,
            2
        );
    }

    #[test]
    fn uniform_is_a_function_of_its_counters() {
        let a = uniform(7, 3, 11);
        assert_eq!(a.to_bits(), uniform(7, 3, 11).to_bits());
        assert_ne!(a.to_bits(), uniform(7, 4, 11).to_bits());
        assert_ne!(a.to_bits(), uniform(7, 3, 12).to_bits());
        assert_ne!(a.to_bits(), uniform(8, 3, 11).to_bits());
        assert!((0.0..1.0).contains(&a));
    }

    #[test]
    fn validate_names_the_field() {
        let mut p = SampleParams::greedy();
        assert!(p.validate().is_ok());
        p.temperature = f32::NAN;
        assert!(p.validate().unwrap_err().contains("temperature"));
        p.temperature = 1.0;
        p.top_p = -0.5;
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
