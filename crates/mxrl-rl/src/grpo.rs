//! GRPO: group-normalised advantages and the PPO-clipped, token-averaged policy loss with its
//! exact gradient with respect to each token's logprob.
//!
//! For response token `t` of sample `i` with advantage `A_i`:
//! - `r = exp(lp − lp_old)` (the PPO ratio; `lp_old` is the trainer's logprob before this
//!   rollout batch's first update, detached);
//! - `ℓ_pg = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))`;
//! - importance-sampling correction for the rollout/trainer mismatch (detached weight `w` from
//!   `Δ = lp_old − lp_rollout`): truncated `w = min(e^Δ, C)` or masked `w = e^Δ·[lo ≤ e^Δ ≤ hi]`,
//!   per token or per sequence (`Δ` summed over the sequence);
//! - KL to a frozen reference, K3 estimator: `k3 = e^(lp_ref − lp) − (lp_ref − lp) − 1`;
//! - `loss = Σ_tokens (w·ℓ_pg + β·k3) / N_tokens` (token-level averaging over the whole
//!   optimizer batch, so micro-batches accumulate to the same gradient).

use serde::{Deserialize, Serialize};

/// Where the importance-sampling correction is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsLevel {
    /// One weight per token.
    Token,
    /// One weight per sequence (Δ summed over its tokens).
    Sequence,
}

/// Correction for the rollout/trainer probability mismatch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum IsCorrection {
    /// No correction (w = 1).
    None,
    /// Truncated IS: `w = min(e^Δ, cap)`.
    Truncated {
        /// Token or sequence level.
        level: IsLevel,
        /// Upper bound C.
        cap: f32,
    },
    /// Masked IS: `w = e^Δ` when `low ≤ e^Δ ≤ high`, else 0.
    Masked {
        /// Token or sequence level.
        level: IsLevel,
        /// Lower bound.
        low: f32,
        /// Upper bound.
        high: f32,
    },
}

/// GRPO hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrpoConfig {
    /// ε_low of the PPO clip.
    pub clip_low: f32,
    /// ε_high of the PPO clip.
    pub clip_high: f32,
    /// Divide the centred group rewards by the group's standard deviation (off: mean-only).
    pub std_normalize: bool,
    /// Coefficient of the K3 KL to the reference policy (0: logged only).
    pub kl_coef: f32,
    /// Rollout/trainer mismatch correction.
    pub is_correction: IsCorrection,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            std_normalize: true,
            kl_coef: 0.0,
            is_correction: IsCorrection::None,
        }
    }
}

/// ε added to the group standard deviation.
pub const ADV_EPS: f32 = 1e-6;

/// Group-normalised advantages: rewards come in consecutive groups of `group` samples of the
/// same prompt; `A = (r − mean_g)` or `(r − mean_g) / (std_g + ε)` with the unbiased (n−1)
/// standard deviation (a group of one gets A = 0).
pub fn group_advantages(rewards: &[f32], group: usize, std_normalize: bool) -> Vec<f32> {
    assert!(
        group > 0 && rewards.len().is_multiple_of(group),
        "rewards come in whole groups"
    );
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let n = g.len() as f64;
        let mean = g.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = if g.len() > 1 {
            g.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        for &r in g {
            let c = r as f64 - mean;
            let a = if std_normalize {
                c / (var.sqrt() + ADV_EPS as f64)
            } else {
                c
            };
            out.push(a as f32);
        }
    }
    out
}

/// Per-sequence inputs of the loss.
#[derive(Debug, Clone, Copy)]
pub struct SeqLossInput<'a> {
    /// Advantage of the sequence.
    pub advantage: f32,
    /// Current trainer logprobs.
    pub logprobs: &'a [f32],
    /// Trainer logprobs before the first update of this batch.
    pub old_logprobs: &'a [f32],
    /// Rollout logprobs.
    pub rollout_logprobs: &'a [f32],
    /// Reference-policy logprobs, when a reference is kept.
    pub ref_logprobs: Option<&'a [f32]>,
}

/// Sums the loss terms produce (divide by the token count for means).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LossStats {
    /// Σ of the per-token total loss (`w·ℓ_pg + β·k3`) / N.
    pub loss: f64,
    /// Tokens whose PPO clip was active (gradient cut).
    pub clipped_tokens: usize,
    /// Tokens whose IS weight was truncated or masked.
    pub is_corrected_tokens: usize,
    /// Σ k3 to the reference over tokens.
    pub ref_kl_sum: f64,
    /// Tokens seen.
    pub tokens: usize,
}

/// IS weights of one sequence (detached).
fn is_weights(cfg: &IsCorrection, old: &[f32], roll: &[f32]) -> (Vec<f32>, usize) {
    let n = old.len();
    let per_token = |f: &dyn Fn(f32) -> f32| -> (Vec<f32>, usize) {
        let mut c = 0;
        let w = old
            .iter()
            .zip(roll)
            .map(|(&o, &r)| {
                let raw = (o - r).exp();
                let w = f(raw);
                c += usize::from(w != raw);
                w
            })
            .collect();
        (w, c)
    };
    let per_seq = |f: &dyn Fn(f32) -> f32| -> (Vec<f32>, usize) {
        let d: f32 = old.iter().zip(roll).map(|(&o, &r)| o - r).sum();
        let raw = d.exp();
        let w = f(raw);
        (vec![w; n], if w != raw { n } else { 0 })
    };
    match *cfg {
        IsCorrection::None => (vec![1.0; n], 0),
        IsCorrection::Truncated { level, cap } => {
            let f = move |x: f32| x.min(cap);
            match level {
                IsLevel::Token => per_token(&f),
                IsLevel::Sequence => per_seq(&f),
            }
        }
        IsCorrection::Masked { level, low, high } => {
            let f = move |x: f32| if (low..=high).contains(&x) { x } else { 0.0 };
            match level {
                IsLevel::Token => per_token(&f),
                IsLevel::Sequence => per_seq(&f),
            }
        }
    }
}

/// The loss of a micro-batch and `d loss / d logprob` per token. `total_tokens` is the token
/// count of the **whole optimizer batch** (token-level averaging across micro-batches).
pub fn policy_loss(
    cfg: &GrpoConfig,
    seqs: &[SeqLossInput<'_>],
    total_tokens: usize,
) -> (LossStats, Vec<Vec<f32>>) {
    let inv_n = 1.0 / total_tokens.max(1) as f64;
    let mut st = LossStats::default();
    let mut grads = Vec::with_capacity(seqs.len());
    for s in seqs {
        let (w, corrected) = is_weights(&cfg.is_correction, s.old_logprobs, s.rollout_logprobs);
        st.is_corrected_tokens += corrected;
        let mut g = Vec::with_capacity(s.logprobs.len());
        for t in 0..s.logprobs.len() {
            let lp = s.logprobs[t];
            let r = (lp - s.old_logprobs[t]).exp();
            let a = s.advantage;
            let unclipped = -a * r;
            let clipped = -a * r.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
            let (pg, dpg) = if unclipped >= clipped {
                (unclipped, -a * r)
            } else {
                st.clipped_tokens += 1;
                (clipped, 0.0)
            };
            let mut loss_t = w[t] as f64 * pg as f64;
            let mut d = w[t] * dpg;
            if let Some(refl) = s.ref_logprobs {
                let x = refl[t] - lp;
                let k3 = x.exp() - x - 1.0;
                st.ref_kl_sum += k3 as f64;
                loss_t += cfg.kl_coef as f64 * k3 as f64;
                d += cfg.kl_coef * (1.0 - x.exp());
            }
            st.loss += loss_t * inv_n;
            g.push((d as f64 * inv_n) as f32);
            st.tokens += 1;
        }
        grads.push(g);
    }
    (st, grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_match_hand_computation() {
        // Group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4·0.25/3) = 0.5773503.
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0, 2.0, 2.0], 2, true);
        // Groups of 2: [1,0] → mean .5, std = sqrt(0.5) = .70710678 → ±.70710618 (ε=1e-6).
        let e = 0.5 / (0.5f64.sqrt() + 1e-6);
        assert!((a[0] as f64 - e).abs() < 1e-6 && (a[1] as f64 + e).abs() < 1e-6);
        assert!((a[2] as f64 + e).abs() < 1e-6 && (a[3] as f64 - e).abs() < 1e-6);
        // A group of equal rewards gets 0, not NaN.
        assert_eq!(&a[4..], &[0.0, 0.0]);
        let b = group_advantages(&[1.0, 0.0, 0.0, 1.0], 4, true);
        let e4 = 0.5 / ((1.0f64 / 3.0).sqrt() + 1e-6);
        assert!((b[0] as f64 - e4).abs() < 1e-6, "{b:?}");
        let m = group_advantages(&[3.0, 1.0, 2.0], 3, false);
        assert_eq!(m, vec![1.0, -1.0, 0.0]);
    }

    #[test]
    fn clipped_loss_and_gradient_match_hand_computation() {
        let cfg = GrpoConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            ..GrpoConfig::default()
        };
        let ln = |x: f32| x.ln();
        // A = +1: r = 1.5 (clipped at 1.28, no gradient); r = 1.1 (unclipped, d = −1.1/N).
        // A = −2: r = 0.5 (clipped at 0.8: loss 1.6, no gradient); r = 1.5 (unclipped: loss 3,
        // d = +3/N). N = 4 tokens.
        let lp1 = [ln(1.5), ln(1.1)];
        let lp2 = [ln(0.5), ln(1.5)];
        let zeros = [0.0f32; 2];
        let seqs = [
            SeqLossInput {
                advantage: 1.0,
                logprobs: &lp1,
                old_logprobs: &zeros,
                rollout_logprobs: &zeros,
                ref_logprobs: None,
            },
            SeqLossInput {
                advantage: -2.0,
                logprobs: &lp2,
                old_logprobs: &zeros,
                rollout_logprobs: &zeros,
                ref_logprobs: None,
            },
        ];
        let (st, g) = policy_loss(&cfg, &seqs, 4);
        let want_loss = (-1.28 - 1.1 + 1.6 + 3.0) / 4.0;
        assert!(
            (st.loss - want_loss).abs() < 1e-6,
            "{} vs {want_loss}",
            st.loss
        );
        assert_eq!(st.clipped_tokens, 2);
        assert_eq!(g[0][0], 0.0);
        assert!((g[0][1] + 1.1 / 4.0).abs() < 1e-6);
        assert_eq!(g[1][0], 0.0);
        assert!((g[1][1] - 3.0 / 4.0).abs() < 1e-6);
    }

    #[test]
    fn gradient_matches_finite_differences_with_kl_and_truncated_is() {
        let cfg = GrpoConfig {
            kl_coef: 0.3,
            is_correction: IsCorrection::Truncated {
                level: IsLevel::Token,
                cap: 1.1,
            },
            ..GrpoConfig::default()
        };
        let old = [-1.0f32, -2.0, -0.5];
        let roll = [-1.3f32, -1.9, -0.5];
        let refl = [-0.8f32, -2.2, -0.7];
        let lp = [-0.95f32, -2.05, -0.45];
        let f = |lp: &[f32]| {
            let s = [SeqLossInput {
                advantage: 0.7,
                logprobs: lp,
                old_logprobs: &old,
                rollout_logprobs: &roll,
                ref_logprobs: Some(&refl),
            }];
            policy_loss(&cfg, &s, 3)
        };
        let (st, g) = f(&lp);
        // Token 0: e^(0.3) = 1.35 > 1.1 → truncated; token 1: e^(−0.1) < 1.1 kept.
        assert_eq!(st.is_corrected_tokens, 1);
        for t in 0..3 {
            let h = 1e-3f32;
            let mut p = lp;
            p[t] += h;
            let mut m = lp;
            m[t] -= h;
            let fd = (f(&p).0.loss - f(&m).0.loss) / (2.0 * h as f64);
            // Central difference on f32 inputs: truncation O(h²) ≈ 1e-6 plus f32 rounding of
            // the loss terms (~1e-7 / 2e-3 ≈ 1e-4); 5e-4 covers both.
            assert!(
                (fd - g[0][t] as f64).abs() < 5e-4,
                "token {t}: fd {fd} vs {}",
                g[0][t]
            );
        }
    }

    #[test]
    fn masked_sequence_level_is_zeroes_whole_sequence() {
        let cfg = GrpoConfig {
            is_correction: IsCorrection::Masked {
                level: IsLevel::Sequence,
                low: 0.5,
                high: 2.0,
            },
            ..GrpoConfig::default()
        };
        let lp = [-1.0f32, -1.0];
        let roll = [-1.5f32, -1.5]; // Δ summed = 1.0 → e^1 = 2.72 > 2 → masked
        let s = [SeqLossInput {
            advantage: 1.0,
            logprobs: &lp,
            old_logprobs: &lp,
            rollout_logprobs: &roll,
            ref_logprobs: None,
        }];
        let (st, g) = policy_loss(&cfg, &s, 2);
        assert_eq!(g[0], vec![0.0, 0.0]);
        assert_eq!(st.is_corrected_tokens, 2);
        assert_eq!(st.loss, 0.0);
    }
}
