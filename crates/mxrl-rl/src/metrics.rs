//! Per-step metrics: one JSON object per line in `metrics.jsonl`, and helpers to compute the
//! mismatch and drift numbers.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// Everything logged for one RL step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Step index (0-based).
    pub step: u64,
    /// Weight version the rollout sampled with.
    pub weight_version: u64,
    /// Mean reward.
    pub reward_mean: f64,
    /// Reward standard deviation (population).
    pub reward_std: f64,
    /// Fraction of correct responses.
    pub accuracy: f64,
    /// Mean response length (tokens).
    pub response_len: f64,
    /// mean |logp_train − logp_rollout| over response tokens.
    pub train_rollout_logprob_abs_diff: f64,
    /// K3 estimate of KL(rollout ‖ trainer): mean of `e^δ − 1 − δ`, δ = logp_train − logp_rollout.
    pub k3_kl: f64,
    /// Mean of the rollout→trainer importance ratio `e^δ`.
    pub is_ratio_mean: f64,
    /// Max of the importance ratio.
    pub is_ratio_max: f64,
    /// Fraction of tokens whose PPO clip was active.
    pub clip_frac: f64,
    /// Fraction of tokens whose IS weight was truncated/masked.
    pub is_corrected_frac: f64,
    /// Mean K3 KL to the frozen reference policy (`None` when no reference is kept).
    pub ref_kl: Option<f64>,
    /// Mean entropy of the trainer's next-token distribution over response tokens.
    pub entropy: f64,
    /// Policy loss.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// `grad_norm` exceeded `spike_factor ×` the running median of earlier steps.
    pub grad_spike: bool,
    /// Per MoE layer: fraction of (token, layer) routing decisions where the trainer's own
    /// expert set equals the rollout's.
    pub routing_agreement: Vec<f64>,
    /// Per decoder layer: mean over the response tokens' predicting positions of
    /// `‖h_train − h_rollout‖₂ / ‖h_rollout‖₂`, `h` the residual stream after the layer. The
    /// rollout's states come from its own generation (KV-cache decode, its weights and
    /// kernels) or, in bitwise mode, from its re-scoring forward; the trainer's from its
    /// training forward (with routing replay when on). Empty when a policy gives no probes.
    pub hidden_diff: Vec<f64>,
    /// Per MoE layer: the busiest expert's share of a decode step's routed rows (the
    /// rollout's recorded routes; `k` rows per sequence still decoding), averaged over the
    /// decode steps weighted by their sequences ([`decode_busiest_share`]). Uniform routing
    /// over `E` experts gives about `1/E`; the fragment kernels' time follows the busiest
    /// expert's rows. Empty without recorded routes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_busiest_share: Vec<f64>,
    /// The MoE auxiliary load-balancing loss of the training forwards (HF
    /// `load_balancing_loss_func` over the MoE layers, not multiplied by the coefficient):
    /// the mean over the step's micro-batches, when the run adds it (`aux_loss_coef` ≠ 0).
    /// About `k` (the experts per token) when the routing is even, up to `E` when every token
    /// goes to the same `k` experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Rollout wall time (s).
    pub rollout_s: f64,
    /// Where the generation inside the rollout spent its time (prefill, decode steps,
    /// read-back of what it recorded), when the rollout policy measures it (the device
    /// engine does); bitwise mode's re-scoring is in `rollout_s` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_phases: Option<crate::policy::GenTiming>,
    /// Training (forward + backward + optimizer) wall time (s).
    pub train_s: f64,
    /// Weight-sync wall time (export, bucket, verify, apply) (s).
    pub sync_s: f64,
    /// Generated tokens per second of rollout.
    pub tokens_per_s: f64,
    /// Bytes shipped by the weight update.
    pub sync_bytes: u64,
    /// Response tokens in the step.
    pub tokens: u64,
}

/// Per MoE layer, the busiest expert's share of each decode step's routed rows, averaged over
/// the steps weighted by the sequences decoding at each (see
/// [`StepMetrics::decode_busiest_share`]). Sequence `s` (prompt of `p` tokens, response of
/// `m`) is fed at decode step `j` (1 ≤ j < m) its response token `j − 1`, trace position
/// `p + j − 1`; the prompt's positions are the prefill's and are left out. `seqs` gives each
/// sequence's prompt length, response length and recorded routes (per MoE layer). Empty when
/// no sequence has routes or decode steps.
pub fn decode_busiest_share(seqs: &[(usize, usize, &[mxrl_model::Routes])]) -> Vec<f64> {
    let layers = seqs.iter().map(|s| s.2.len()).max().unwrap_or(0);
    let steps = seqs.iter().map(|s| s.1).max().unwrap_or(0);
    let mut out = Vec::with_capacity(layers);
    for l in 0..layers {
        let (mut weighted, mut total) = (0f64, 0usize);
        let mut counts: Vec<usize> = Vec::new();
        for j in 1..steps {
            counts.iter_mut().for_each(|c| *c = 0);
            let (mut rows, mut seqs_here) = (0usize, 0usize);
            for &(p, m, routes) in seqs {
                let Some(r) = routes.get(l) else { continue };
                let pos = p + j - 1;
                if j >= m || pos >= r.num_tokens() {
                    continue;
                }
                seqs_here += 1;
                for &e in &r.ids[pos * r.top_k..(pos + 1) * r.top_k] {
                    let e = e as usize;
                    if counts.len() <= e {
                        counts.resize(e + 1, 0);
                    }
                    counts[e] += 1;
                    rows += 1;
                }
            }
            if rows > 0 {
                let busiest = counts.iter().copied().max().unwrap_or(0);
                weighted += seqs_here as f64 * busiest as f64 / rows as f64;
                total += seqs_here;
            }
        }
        if total == 0 {
            return Vec::new();
        }
        out.push(weighted / total as f64);
    }
    out
}

/// Errors writing or reading metrics.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// I/O on the metrics file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line did not parse.
    #[error("{path}:{line}: {msg}")]
    Parse {
        /// The file.
        path: String,
        /// 1-based line.
        line: usize,
        /// The parse error.
        msg: String,
    },
}

/// Append one line to a JSONL file.
pub fn append_jsonl(path: &Path, m: &StepMetrics) -> Result<(), MetricsError> {
    let io = |source| MetricsError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    let mut line = serde_json::to_string(m).expect("metrics serialize");
    line.push('\n');
    f.write_all(line.as_bytes()).map_err(io)
}

/// Read all lines of a metrics file.
pub fn read_jsonl(path: &Path) -> Result<Vec<StepMetrics>, MetricsError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
        path: p.clone(),
        source,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| MetricsError::Parse {
                path: p.clone(),
                line: i + 1,
                msg: e.to_string(),
            })
        })
        .collect()
}

/// Median of a slice (NaN-free), `None` when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    })
}

/// Spike rule: `norm > factor × median(history)`, once at least 3 earlier steps exist.
pub fn is_spike(history: &[f64], norm: f64, factor: f64) -> bool {
    history.len() >= 3 && median(history).is_some_and(|m| norm > factor * m)
}

/// Mismatch statistics over token pairs `(trainer logprob, rollout logprob)`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mismatch {
    /// Mean |δ|.
    pub abs_diff: f64,
    /// Mean `e^δ − 1 − δ`.
    pub k3: f64,
    /// Mean `e^δ`.
    pub ratio_mean: f64,
    /// Max `e^δ`.
    pub ratio_max: f64,
}

/// Mismatch of paired logprobs (δ = train − rollout).
pub fn mismatch<'a>(pairs: impl Iterator<Item = (&'a f32, &'a f32)>) -> Mismatch {
    let (mut n, mut a, mut k, mut r, mut mx) = (0usize, 0f64, 0f64, 0f64, 0f64);
    for (&t, &ro) in pairs {
        let d = t as f64 - ro as f64;
        let e = d.exp();
        n += 1;
        a += d.abs();
        k += e - 1.0 - d;
        r += e;
        mx = mx.max(e);
    }
    if n == 0 {
        return Mismatch::default();
    }
    let n = n as f64;
    Mismatch {
        abs_diff: a / n,
        k3: k / n,
        ratio_mean: r / n,
        ratio_max: mx,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_matches_hand_values() {
        let t = [0.0f32, -1.0];
        let r = [0.0f32, -1.5];
        let m = mismatch(t.iter().zip(&r));
        assert!((m.abs_diff - 0.25).abs() < 1e-12);
        let e = 0.5f64.exp();
        assert!((m.k3 - (e - 1.5) / 2.0).abs() < 1e-9);
        assert!((m.ratio_max - e).abs() < 1e-9);
        assert!((m.ratio_mean - (1.0 + e) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn spikes_need_history_and_exceed_factor_times_median() {
        assert!(!is_spike(&[1.0, 1.0], 100.0, 5.0));
        assert!(is_spike(&[1.0, 2.0, 1.0], 5.1, 5.0));
        assert!(!is_spike(&[1.0, 2.0, 1.0], 5.0, 5.0));
        assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), Some(2.5));
    }

    /// Two sequences with prompts of 2 and 1 tokens, responses of 3 and 2, top-2 routes over
    /// one MoE layer: decode step 1 feeds positions 2 and 1 (experts {0, 1} and {0, 2}: the
    /// busiest, 0, has 2 of 4 rows), step 2 only the first sequence's position 3 ({3, 4}: 1
    /// of 2). Weighted by sequences: (2 · 0.5 + 1 · 0.5) / 3 = 0.5. Prompt positions (the
    /// prefill's) never count; no routes or no decode step give nothing.
    #[test]
    fn decode_busiest_share_follows_the_decode_steps() {
        use mxrl_model::Routes;
        let r = |ids: Vec<u32>| {
            vec![Routes {
                top_k: 2,
                weights: vec![0.5; ids.len()],
                ids,
            }]
        };
        // Fed positions: prompt + response minus its last token.
        let a = r(vec![7, 7, 7, 7, 0, 1, 3, 4]); // positions 0..4
        let b = r(vec![7, 7, 0, 2]); // positions 0..2
        let seqs = [(2usize, 3usize, a.as_slice()), (1, 2, b.as_slice())];
        let got = decode_busiest_share(&seqs);
        assert_eq!(got.len(), 1);
        assert!((got[0] - 0.5).abs() < 1e-12, "{got:?}");
        // All of step 1 on one expert: share 1 there.
        let c = r(vec![7, 7, 7, 7, 5, 5, 3, 4]);
        let d = r(vec![7, 7, 5, 5]);
        let got = decode_busiest_share(&[(2, 3, c.as_slice()), (1, 2, d.as_slice())]);
        assert!((got[0] - (2.0 * 1.0 + 0.5) / 3.0).abs() < 1e-12, "{got:?}");
        assert!(decode_busiest_share(&[]).is_empty());
        assert!(decode_busiest_share(&[(2, 1, a.as_slice())]).is_empty());
    }

    #[test]
    fn jsonl_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.jsonl");
        let mut m = StepMetrics {
            step: 3,
            reward_mean: 0.5,
            routing_agreement: vec![1.0, 0.5],
            ..Default::default()
        };
        append_jsonl(&p, &m).unwrap();
        m.step = 4;
        append_jsonl(&p, &m).unwrap();
        let v = read_jsonl(&p).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1], m);
    }
}
