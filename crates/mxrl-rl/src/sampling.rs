//! Tempered softmax, entropy and nucleus sampling over one logit row (reference loops, f64
//! accumulation of the normaliser so that the same row always gives the same bits).

use rand::Rng;

/// `log softmax(logits / temperature)` into `out` (`mxrl_tensor::loss::log_softmax_tempered`).
pub use mxrl_tensor::loss::log_softmax_tempered;

/// Entropy of a distribution given by its logprobs (`mxrl_tensor::loss::entropy_of_logprobs`).
pub use mxrl_tensor::loss::entropy_of_logprobs as entropy;

/// Draw a token from `logp` (already tempered) restricted to the smallest set of most probable
/// tokens whose mass reaches `top_p`. Returns the token; its logprob under the full tempered
/// distribution is `logp[token]`.
pub fn sample_top_p<R: Rng>(logp: &[f32], top_p: f32, rng: &mut R) -> u32 {
    let u: f64 = rng.gen();
    if top_p >= 1.0 {
        let mut acc = 0.0f64;
        for (i, &l) in logp.iter().enumerate() {
            acc += (l as f64).exp();
            if u < acc {
                return i as u32;
            }
        }
        return (logp.len() - 1) as u32;
    }
    let mut idx: Vec<usize> = (0..logp.len()).collect();
    idx.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
    let mut kept = 0.0f64;
    let mut n = 0;
    for &i in &idx {
        kept += (logp[i] as f64).exp();
        n += 1;
        if kept >= top_p as f64 {
            break;
        }
    }
    let target = u * kept;
    let mut acc = 0.0f64;
    for &i in &idx[..n] {
        acc += (logp[i] as f64).exp();
        if target < acc {
            return i as u32;
        }
    }
    idx[n - 1] as u32
}

/// The per-sample RNG seed: a pure function of the call seed, the prompt index and the sample
/// index (so every recipe of an ablation draws the same random numbers).
pub fn sample_seed(seed: u64, prompt: usize, sample: usize) -> u64 {
    let mut h = seed ^ 0x9E37_79B9_7F4A_7C15;
    for x in [prompt as u64, sample as u64] {
        h ^= x
            .wrapping_add(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(h << 6)
            .wrapping_add(h >> 2);
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn log_softmax_normalises_and_tempers() {
        let mut o = Vec::new();
        log_softmax_tempered(&[1.0, 2.0, 3.0], 0.5, &mut o);
        let s: f32 = o.iter().map(|l| l.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
        assert!((o[2] - o[1] - 2.0).abs() < 1e-6);
        assert!((entropy(&[0.5f32.ln(), 0.5f32.ln()]) - 2f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn top_p_never_draws_outside_the_nucleus() {
        let p = [0.6f32, 0.3, 0.05, 0.05];
        let lp: Vec<f32> = p.iter().map(|x| x.ln()).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut counts = [0usize; 4];
        for _ in 0..2000 {
            counts[sample_top_p(&lp, 0.85, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0);
        assert!(counts[0] > counts[1] && counts[1] > 400, "{counts:?}");
    }
}
