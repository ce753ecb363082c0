//! AdamW on f32 master weights, global gradient norm and clipping.

/// AdamW hyper-parameters shared by all parameters (weight decay is per parameter).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay β₁.
    pub beta1: f32,
    /// Second-moment decay β₂.
    pub beta2: f32,
    /// Denominator ε.
    pub eps: f32,
}

impl Default for AdamWConfig {
    /// PyTorch defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8.
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// One AdamW step on one tensor, PyTorch's `_single_tensor_adamw` order of operations in f32:
/// `p ← p·(1 − lr·wd)`; `m ← β₁m + (1−β₁)g`; `v ← β₂v + (1−β₂)g²`;
/// `p ← p − (lr / (1−β₁ᵗ)) · m / (√v / √(1−β₂ᵗ) + ε)`. `step` is `t ≥ 1`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    cfg: &AdamWConfig,
    weight_decay: f32,
) {
    assert!(step >= 1, "AdamW step counts from 1");
    assert_eq!(param.len(), grad.len());
    assert_eq!(param.len(), m.len());
    assert_eq!(param.len(), v.len());
    let bc1 = 1.0 - (cfg.beta1 as f64).powi(step as i32);
    let bc2 = 1.0 - (cfg.beta2 as f64).powi(step as i32);
    let step_size = (cfg.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = 1.0 - cfg.lr * weight_decay;
    for i in 0..param.len() {
        let g = grad[i];
        param[i] *= decay;
        m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * g;
        v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * g * g;
        let denom = v[i].sqrt() / bc2_sqrt + cfg.eps;
        param[i] -= step_size * m[i] / denom;
    }
}

/// AdamW over a list of parameter tensors, holding the moments and the step count.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Hyper-parameters (may be changed between steps, e.g. for a learning-rate schedule).
    pub config: AdamWConfig,
    step: u64,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl AdamW {
    /// State for tensors of the given sizes (moments start at zero).
    pub fn new(config: AdamWConfig, sizes: &[usize]) -> Self {
        AdamW {
            config,
            step: 0,
            m: sizes.iter().map(|&s| vec![0.0; s]).collect(),
            v: sizes.iter().map(|&s| vec![0.0; s]).collect(),
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// One step: tensor `i` is `params[i]` with gradient `grads[i]` and weight decay
    /// `weight_decay[i]`.
    ///
    /// # Panics
    /// If the number or sizes of tensors differ from construction.
    pub fn step(&mut self, params: &mut [&mut [f32]], grads: &[&[f32]], weight_decay: &[f32]) {
        assert_eq!(params.len(), self.m.len());
        assert_eq!(grads.len(), self.m.len());
        assert_eq!(weight_decay.len(), self.m.len());
        self.step += 1;
        for i in 0..params.len() {
            adamw_update(
                params[i],
                grads[i],
                &mut self.m[i],
                &mut self.v[i],
                self.step,
                &self.config,
                weight_decay[i],
            );
        }
    }
}

/// Global L2 norm `sqrt(Σ_tensors Σ_i g_i²)`, accumulated in f64.
pub fn global_grad_norm(grads: &[&[f32]]) -> f64 {
    grads
        .iter()
        .flat_map(|g| g.iter())
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

/// Clips gradients to a global norm of at most `max_norm` (PyTorch's `clip_grad_norm_`:
/// coefficient `max_norm / (norm + 1e-6)`, applied only when below 1). Returns the norm before
/// clipping.
pub fn clip_grad_norm(grads: &mut [&mut [f32]], max_norm: f64) -> f64 {
    let norm = {
        let views: Vec<&[f32]> = grads.iter().map(|g| &**g).collect();
        global_grad_norm(&views)
    };
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        let c = coef as f32;
        for g in grads.iter_mut() {
            for x in g.iter_mut() {
                *x *= c;
            }
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference AdamW in f64 from the textbook formula (Loshchilov & Hutter, decoupled decay);
    /// f32 and f64 paths agree to a few f32 roundings per step.
    #[test]
    fn adamw_matches_f64_textbook_formula() {
        let cfg = AdamWConfig {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        };
        let mut p = vec![1.0f32, -2.0, 0.5];
        let mut opt = AdamW::new(cfg, &[3]);
        let (mut rp, mut rm, mut rv) = (vec![1.0f64, -2.0, 0.5], [0.0f64; 3], [0.0f64; 3]);
        for t in 1..=5u64 {
            let g: Vec<f32> = p.iter().map(|x| 2.0 * x + 0.1 * t as f32).collect();
            let rg: Vec<f64> = rp.iter().map(|x| 2.0 * x + 0.1 * t as f64).collect();
            opt.step(&mut [&mut p], &[&g], &[0.1]);
            for i in 0..3 {
                rp[i] *= 1.0 - 0.01 * 0.1;
                rm[i] = 0.9 * rm[i] + 0.1 * rg[i];
                rv[i] = 0.99 * rv[i] + 0.01 * rg[i] * rg[i];
                let mh = rm[i] / (1.0 - 0.9f64.powi(t as i32));
                let vh = rv[i] / (1.0 - 0.99f64.powi(t as i32));
                rp[i] -= 0.01 * mh / (vh.sqrt() + 1e-8);
            }
        }
        for i in 0..3 {
            // ~12 f32 operations per step, 5 steps, each bounded by u·|p|-scale quantities.
            let tol = crate::gradcheck::gamma(60) * 4.0;
            assert!((p[i] as f64 - rp[i]).abs() <= tol, "{} vs {}", p[i], rp[i]);
        }
        assert_eq!(opt.steps(), 5);
    }

    #[test]
    fn weight_decay_zero_leaves_zero_gradient_params_alone() {
        let mut p = vec![3.0f32];
        let mut opt = AdamW::new(AdamWConfig::default(), &[1]);
        opt.step(&mut [&mut p], &[&[0.0]], &[0.0]);
        assert_eq!(p, vec![3.0]);
        opt.step(&mut [&mut p], &[&[0.0]], &[0.5]);
        assert_eq!(p, vec![3.0 * (1.0 - 1e-3 * 0.5)]);
    }

    #[test]
    fn clipping_scales_to_max_norm_only_when_above() {
        let mut a = vec![3.0f32, 0.0];
        let mut b = vec![4.0f32];
        let n = clip_grad_norm(&mut [&mut a, &mut b], 1.0);
        assert_eq!(n, 5.0);
        let after = global_grad_norm(&[&a, &b]);
        assert!((after - 1.0).abs() < 1e-6, "{after}");
        let mut c = vec![0.3f32];
        clip_grad_norm(&mut [&mut c], 1.0);
        assert_eq!(c, vec![0.3]);
    }
}
