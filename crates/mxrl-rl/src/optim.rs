//! AdamW on f32 master weights, with global gradient-norm clipping: the loop's view of
//! [`mxrl_tensor::optim`] (the one AdamW update and clipping of the workspace) — moments kept by
//! parameter name (so checkpoints store them by name), weight decay by the plan's format.

use crate::policy::ParamMut;
use mxrl_formats::Format;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay for BF16 weights (low-precision weights always get 0).
    pub weight_decay: f32,
    /// Clip the global gradient L2 norm to this value (≤ 0 disables clipping).
    pub max_grad_norm: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
        }
    }
}

/// Moments of one parameter.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Moments {
    /// First moment.
    pub m: Vec<f32>,
    /// Second moment.
    pub v: Vec<f32>,
}

/// AdamW state: step count and moments by parameter name.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AdamW {
    /// Hyper-parameters.
    pub cfg: AdamWConfig,
    /// Steps taken.
    pub step: u64,
    /// Moments by parameter name.
    pub state: BTreeMap<String, Moments>,
}

/// Global L2 norm of all gradients (accumulated in f64).
pub fn grad_norm(params: &[ParamMut<'_>]) -> f64 {
    let g: Vec<&[f32]> = params.iter().map(|p| &*p.grad).collect();
    mxrl_tensor::optim::global_grad_norm(&g)
}

impl AdamW {
    /// A fresh optimizer.
    pub fn new(cfg: AdamWConfig) -> AdamW {
        AdamW {
            cfg,
            step: 0,
            state: BTreeMap::new(),
        }
    }

    /// Clip gradients to `max_grad_norm` (in place, `mxrl_tensor::optim::clip_grad_norm`) and
    /// take one AdamW step (`mxrl_tensor::optim::adamw_update`, PyTorch's order of
    /// operations); returns the gradient norm before clipping. Weight decay is applied only
    /// to BF16 parameters (the plan's low-precision weights get 0, as the recipe requires).
    pub fn step(&mut self, params: &mut [ParamMut<'_>]) -> f64 {
        let c = self.cfg;
        let norm = {
            let mut g: Vec<&mut [f32]> = params.iter_mut().map(|p| &mut *p.grad).collect();
            if c.max_grad_norm > 0.0 {
                mxrl_tensor::optim::clip_grad_norm(&mut g, c.max_grad_norm as f64)
            } else {
                let v: Vec<&[f32]> = g.iter().map(|x| &**x).collect();
                mxrl_tensor::optim::global_grad_norm(&v)
            }
        };
        self.step += 1;
        let tc = mxrl_tensor::optim::AdamWConfig {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
        };
        for p in params.iter_mut() {
            let st = self.state.entry(p.name.to_string()).or_default();
            if st.m.len() != p.value.len() {
                st.m = vec![0.0; p.value.len()];
                st.v = vec![0.0; p.value.len()];
            }
            let wd = if p.format == Format::Bf16 {
                c.weight_decay
            } else {
                0.0
            };
            mxrl_tensor::optim::adamw_update(
                p.value, p.grad, &mut st.m, &mut st.v, self.step, &tc, wd,
            );
        }
        norm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_matches_hand_computation_and_skips_decay_for_low_precision() {
        let cfg = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.5,
            max_grad_norm: 0.0,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(cfg);
        let mut w1 = vec![1.0f32, -2.0];
        let mut g1 = vec![0.5f32, -0.25];
        let mut w2 = vec![1.0f32];
        let mut g2 = vec![0.5f32];
        let mut ps = vec![
            ParamMut {
                name: "a",
                value: &mut w1,
                grad: &mut g1,
                format: Format::Bf16,
            },
            ParamMut {
                name: "b",
                value: &mut w2,
                grad: &mut g2,
                format: Format::Mxfp8,
            },
        ];
        let n = opt.step(&mut ps);
        assert!((n - (0.25f64 + 0.0625 + 0.25).sqrt()).abs() < 1e-7);
        // Step 1: m̂ = g, v̂ = g², update = sign(g)·g/(|g|+ε) ≈ ±1 (ε = 1e-8 shifts it by 2e-8);
        // decay first (PyTorch): p·(1 − lr·wd) = p·0.95.
        // a[0] = 0.95 − 0.1·1 = 0.85; a[1] = −1.9 − 0.1·(−1) = −1.8.
        assert!(
            (w1[0] - 0.85).abs() < 1e-6 && (w1[1] + 1.8).abs() < 1e-6,
            "{w1:?}"
        );
        // b has no decay: 1 − 0.1·1 = 0.9.
        assert!((w2[0] - 0.9).abs() < 1e-6);
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let mut opt = AdamW::new(AdamWConfig {
            lr: 0.0,
            max_grad_norm: 1.0,
            ..AdamWConfig::default()
        });
        let mut w = vec![0.0f32; 2];
        let mut g = vec![3.0f32, 4.0];
        let mut ps = vec![ParamMut {
            name: "w",
            value: &mut w,
            grad: &mut g,
            format: Format::Bf16,
        }];
        assert_eq!(opt.step(&mut ps), 5.0);
        // m after one step = (1−β1)·g·(1/5): 0.1·0.6 = 0.06 for the first element.
        assert!((opt.state["w"].m[0] - 0.06).abs() < 1e-6);
    }
}
