//! A small, exact policy for testing the loop end to end: a softmax table indexed by
//! (prompt bucket, response position).
//!
//! The context of response position `t` of a prompt is `row = bucket(prompt)·max_len + t`
//! (FNV-1a hash of the prompt's ids modulo `buckets`); the next-token distribution is
//! `softmax(W[row] / T)` with `W` a `[buckets·max_len, vocab]` table. Gradients are exact:
//! `∂logp(y)/∂W[row] = (onehot(y) − p) / T`. The table is one weight in the plan's format; the
//! trainer's forward uses `dequantize(quantize(master))` — the same bytes the rollout holds —
//! and passes gradients straight through to the f32 master.

use crate::policy::{
    ParamMut, PolicyError, RolloutPolicy, Sample, SamplingConfig, TrainForward, TrainPolicy,
    TrainSeq, WireTensor,
};
use crate::sampling::{entropy, log_softmax_tempered, sample_seed, sample_top_p};
use crate::wire::{dequantize, quantize};
use mxrl_formats::Format;
use rand::SeedableRng;

/// Shape of a tabular policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TabularShape {
    /// Prompt hash buckets.
    pub buckets: usize,
    /// Response positions with their own row (later positions reuse the last row).
    pub max_len: usize,
    /// Vocabulary size (the row length; a multiple of 32 for block formats).
    pub vocab: usize,
}

impl TabularShape {
    fn rows(&self) -> usize {
        self.buckets * self.max_len
    }

    fn row(&self, prompt: &[u32], t: usize) -> usize {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &x in prompt {
            h ^= x as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        (h % self.buckets as u64) as usize * self.max_len + t.min(self.max_len - 1)
    }
}

/// Name of the table in weight updates.
pub const TABLE: &str = "table.weight";

/// Trainer side: f32 master table, gradient, and the quantized view used in forward.
#[derive(Debug, Clone)]
pub struct TabularTrainer {
    shape: TabularShape,
    format: Format,
    master: Vec<f32>,
    grad: Vec<f32>,
    saved: Vec<(usize, u32, Vec<f32>)>,
    temperature: f32,
    saved_seqs: Vec<usize>,
}

impl TabularTrainer {
    /// A table of zeros (uniform policy) stored in `format`.
    pub fn new(shape: TabularShape, format: Format) -> TabularTrainer {
        TabularTrainer {
            shape,
            format,
            master: vec![0.0; shape.rows() * shape.vocab],
            grad: vec![0.0; shape.rows() * shape.vocab],
            saved: Vec::new(),
            temperature: 1.0,
            saved_seqs: Vec::new(),
        }
    }

    /// A rollout engine holding this trainer's current exported weights.
    pub fn rollout(&self) -> Result<TabularRollout, PolicyError> {
        let mut r = TabularRollout {
            shape: self.shape,
            weights: Vec::new(),
            wire: Vec::new(),
        };
        r.load_weights(&self.export_weights()?)?;
        Ok(r)
    }

    fn effective(&self) -> Result<Vec<f32>, PolicyError> {
        let w = quantize(
            TABLE,
            self.format,
            self.shape.rows(),
            self.shape.vocab,
            &self.master,
        )?;
        dequantize(&w)
    }
}

impl TrainPolicy for TabularTrainer {
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError> {
        let w = self.effective()?;
        let v = self.shape.vocab;
        self.saved.clear();
        self.saved_seqs.clear();
        self.temperature = temperature;
        let mut out = Vec::with_capacity(batch.len());
        let mut lp = Vec::new();
        for s in batch {
            let mut f = TrainForward::default();
            for (t, &y) in s.response.iter().enumerate() {
                let row = self.shape.row(s.prompt, t);
                log_softmax_tempered(&w[row * v..(row + 1) * v], temperature, &mut lp);
                f.logprobs.push(lp[y as usize]);
                f.entropy.push(entropy(&lp));
                self.saved
                    .push((row, y, lp.iter().map(|l| l.exp()).collect::<Vec<f32>>()));
            }
            self.saved_seqs.push(s.response.len());
            out.push(f);
        }
        Ok(out)
    }

    fn backward(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        if dlogp.len() != self.saved_seqs.len()
            || dlogp
                .iter()
                .zip(&self.saved_seqs)
                .any(|(d, &n)| d.len() != n)
        {
            return Err(PolicyError::Invalid(
                "backward: gradient shape differs from the last forward".into(),
            ));
        }
        let v = self.shape.vocab;
        let inv_t = 1.0 / self.temperature;
        for ((row, y, p), &d) in self.saved.iter().zip(dlogp.iter().flatten()) {
            let g = &mut self.grad[row * v..(row + 1) * v];
            for (j, gj) in g.iter_mut().enumerate() {
                let onehot = if j == *y as usize { 1.0 } else { 0.0 };
                *gj += d * (onehot - p[j]) * inv_t;
            }
        }
        Ok(())
    }

    fn params(&mut self) -> Vec<ParamMut<'_>> {
        vec![ParamMut {
            name: TABLE,
            value: &mut self.master,
            grad: &mut self.grad,
            format: self.format,
        }]
    }

    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        Ok(vec![quantize(
            TABLE,
            self.format,
            self.shape.rows(),
            self.shape.vocab,
            &self.master,
        )?])
    }
}

/// Rollout side: the wire bytes it was given and their dequantized values.
#[derive(Debug, Clone)]
pub struct TabularRollout {
    shape: TabularShape,
    weights: Vec<f32>,
    wire: Vec<WireTensor>,
}

impl RolloutPolicy for TabularRollout {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<Vec<Sample>, PolicyError> {
        let v = self.shape.vocab;
        let mut out = Vec::with_capacity(prompts.len() * n);
        let mut lp = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            for j in 0..n {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(sample_seed(seed, i, j));
                let mut s = Sample {
                    prompt_index: i,
                    prompt: p.clone(),
                    response: Vec::new(),
                    logprobs: Vec::new(),
                    routing: None,
                    probes: None,
                };
                for t in 0..cfg.max_new_tokens {
                    let row = self.shape.row(p, t);
                    log_softmax_tempered(
                        &self.weights[row * v..(row + 1) * v],
                        cfg.temperature,
                        &mut lp,
                    );
                    let y = sample_top_p(&lp, cfg.top_p, &mut rng);
                    s.response.push(y);
                    s.logprobs.push(lp[y as usize]);
                    if y == eos {
                        break;
                    }
                }
                out.push(s);
            }
        }
        Ok(out)
    }

    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        let [t] = tensors else {
            return Err(PolicyError::Update(format!(
                "expected exactly one tensor `{TABLE}`, got {}",
                tensors.len()
            )));
        };
        let want = vec![self.shape.rows(), self.shape.vocab];
        if t.name != TABLE || t.shape != want {
            return Err(PolicyError::Update(format!(
                "expected `{TABLE}` {want:?}, got `{}` {:?}",
                t.name, t.shape
            )));
        }
        let w = dequantize(t)?;
        self.weights = w;
        self.wire = tensors.to_vec();
        Ok(())
    }

    fn weights(&self) -> Vec<WireTensor> {
        self.wire.clone()
    }

    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError> {
        let v = self.shape.vocab;
        let mut lp = Vec::new();
        Ok(batch
            .iter()
            .map(|s| {
                s.response
                    .iter()
                    .enumerate()
                    .map(|(t, &y)| {
                        let row = self.shape.row(s.prompt, t);
                        log_softmax_tempered(
                            &self.weights[row * v..(row + 1) * v],
                            temperature,
                            &mut lp,
                        );
                        lp[y as usize]
                    })
                    .collect()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analytic_gradient_matches_finite_differences() {
        let shape = TabularShape {
            buckets: 2,
            max_len: 3,
            vocab: 32,
        };
        let mut tr = TabularTrainer::new(shape, Format::Bf16);
        // Values exactly representable in BF16 so quantization is the identity here.
        for (i, m) in tr.master.iter_mut().enumerate() {
            *m = ((i * 37 % 17) as f32 - 8.0) / 8.0;
        }
        let prompt = [5u32, 6];
        let resp = [3u32, 9, 9, 1];
        let seqs = [TrainSeq {
            prompt: &prompt,
            response: &resp,
            replay: None,
        }];
        let f = tr.forward(&seqs, 0.7).unwrap();
        let d = vec![vec![0.5f32, -1.0, 0.25, 2.0]];
        tr.backward(&d).unwrap();
        let obj = |f: &[TrainForward]| -> f64 {
            f[0].logprobs
                .iter()
                .zip(&d[0])
                .map(|(&l, &g)| l as f64 * g as f64)
                .sum()
        };
        let base = obj(&f);
        let row = shape.row(&prompt, 1);
        // Step 1/8 keeps values BF16-exact; the objective is smooth, so a one-sided difference
        // has O(h·|f''|) ≈ 0.06 error; compare with that bound.
        let h = 0.125f32;
        for j in [3usize, 9, 20] {
            let mut tp = tr.clone();
            tp.master[row * 32 + j] += h;
            let fp = tp.forward(&seqs, 0.7).unwrap();
            let fd = (obj(&fp) - base) / h as f64;
            let g = tr.grad[row * 32 + j] as f64;
            assert!((fd - g).abs() < 0.08, "j {j}: fd {fd} vs analytic {g}");
        }
        assert!(f[0].entropy.iter().all(|&e| e > 0.0));
    }

    #[test]
    fn rollout_and_trainer_logprobs_agree_bitwise() {
        let shape = TabularShape {
            buckets: 4,
            max_len: 4,
            vocab: 32,
        };
        let mut tr = TabularTrainer::new(shape, Format::Bf16);
        for (i, m) in tr.master.iter_mut().enumerate() {
            *m = (i as f32 * 0.37).sin();
        }
        let mut ro = tr.rollout().unwrap();
        let cfg = SamplingConfig {
            temperature: 0.9,
            top_p: 0.95,
            max_new_tokens: 4,
        };
        let samples = ro.generate(&[vec![1, 2], vec![7]], 3, &cfg, 0, 11).unwrap();
        let seqs: Vec<TrainSeq> = samples
            .iter()
            .map(|s| TrainSeq {
                prompt: &s.prompt,
                response: &s.response,
                replay: None,
            })
            .collect();
        let f = tr.forward(&seqs, 0.9).unwrap();
        for (s, f) in samples.iter().zip(&f) {
            let a: Vec<u32> = s.logprobs.iter().map(|x| x.to_bits()).collect();
            let b: Vec<u32> = f.logprobs.iter().map(|x| x.to_bits()).collect();
            assert_eq!(a, b);
        }
    }
}
