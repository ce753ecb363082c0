//! Named parameters (f32 master weights) and their gradients.
//!
//! Names follow Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`, …) except that the
//! gate and up projections of every SwiGLU MLP (routed expert, shared expert, dense MLP) are
//! stored fused as one `[2F, H]` tensor named `….gate_up_proj.weight`, gate rows first, as
//! serving engines run them. [`crate::hf`] maps to and from the HF per-projection names.

use crate::error::{ModelError, Result};

/// Index of a parameter in a [`ParamStore`].
pub type ParamId = usize;

/// What a parameter is, for optimizer settings (e.g. weight decay) and precision plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorRole {
    /// `model.embed_tokens.weight` `[V, H]`.
    Embedding,
    /// `lm_head.weight` `[V, H]` (untied models only).
    LmHead,
    /// An RMSNorm weight (layer norms, final norm, q/k norms).
    Norm,
    /// Attention projection weight (q, k, v, o).
    Attention,
    /// Attention projection bias (q, k, v of Qwen2-MoE).
    Bias,
    /// Router `mlp.gate.weight` `[E, H]`.
    Router,
    /// Routed expert weight (fused gate_up or down).
    Expert,
    /// Shared expert weight (fused gate_up or down).
    SharedExpert,
    /// Shared expert gate `[1, H]`.
    SharedExpertGate,
    /// Dense MLP weight (fused gate_up or down).
    DenseMlp,
}

/// One named f32 tensor.
#[derive(Clone, Debug)]
pub struct Param {
    /// mxrl name (see the module docs).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Role of the tensor.
    pub role: TensorRole,
    /// Decoder layer, when the tensor belongs to one.
    pub layer: Option<usize>,
    /// Values (f32 master copy).
    pub data: Vec<f32>,
}

/// All parameters of a model, in a fixed order (the order of creation).
#[derive(Clone, Debug, Default)]
pub struct ParamStore {
    params: Vec<Param>,
}

impl ParamStore {
    pub(crate) fn push(
        &mut self,
        name: String,
        shape: Vec<usize>,
        role: TensorRole,
        layer: Option<usize>,
    ) -> ParamId {
        let n = shape.iter().product();
        self.params.push(Param {
            name,
            shape,
            role,
            layer,
            data: vec![0.0; n],
        });
        self.params.len() - 1
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Total number of scalar parameters.
    pub fn num_elements(&self) -> usize {
        self.params.iter().map(|p| p.data.len()).sum()
    }

    /// Tensor by id.
    pub fn get(&self, id: ParamId) -> &Param {
        &self.params[id]
    }

    /// Id of a tensor by name.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.params.iter().position(|p| p.name == name)
    }

    /// Tensor by name.
    pub fn by_name(&self, name: &str) -> Option<&Param> {
        self.id(name).map(|i| &self.params[i])
    }

    /// All tensors in order.
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }

    /// All tensors in order, mutably (only values may change; names and shapes are fixed).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Param> {
        self.params.iter_mut()
    }

    pub(crate) fn replace_data(&mut self, id: ParamId, values: Vec<f32>) {
        debug_assert_eq!(values.len(), self.params[id].data.len());
        self.params[id].data = values;
    }

    pub(crate) fn data(&self, id: ParamId) -> &[f32] {
        &self.params[id].data
    }

    /// Overwrites tensor `name` with `values` (shape-checked).
    pub fn set(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let id = self.id(name).ok_or_else(|| ModelError::BadTensor {
            name: name.into(),
            message: "no such parameter".into(),
        })?;
        let p = &mut self.params[id];
        if p.data.len() != values.len() {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!(
                    "{} values given, shape {:?} needs {}",
                    values.len(),
                    p.shape,
                    p.data.len()
                ),
            });
        }
        p.data.copy_from_slice(values);
        Ok(())
    }

    /// A zero gradient buffer for every tensor.
    pub fn zero_grads(&self) -> Grads {
        Grads {
            grads: self
                .params
                .iter()
                .map(|p| vec![0.0; p.data.len()])
                .collect(),
        }
    }
}

/// Gradients aligned with a [`ParamStore`] (`grads[i]` has the shape of parameter `i`).
#[derive(Clone, Debug)]
pub struct Grads {
    /// One buffer per parameter, in store order.
    pub grads: Vec<Vec<f32>>,
}

impl Grads {
    /// Gradient of parameter `id`.
    pub fn get(&self, id: ParamId) -> &[f32] {
        &self.grads[id]
    }

    pub(crate) fn get_mut(&mut self, id: ParamId) -> &mut [f32] {
        &mut self.grads[id]
    }

    /// Adds another gradient (e.g. micro-batch accumulation).
    pub fn add(&mut self, other: &Grads) {
        for (a, b) in self.grads.iter_mut().zip(&other.grads) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
    }

    /// Views for [`mxrl_tensor::optim`].
    pub fn as_slices(&self) -> Vec<&[f32]> {
        self.grads.iter().map(|g| g.as_slice()).collect()
    }

    /// Mutable views for [`mxrl_tensor::optim::clip_grad_norm`].
    pub fn as_mut_slices(&mut self) -> Vec<&mut [f32]> {
        self.grads.iter_mut().map(|g| g.as_mut_slice()).collect()
    }
}

/// Normal samples (Box–Muller over a ChaCha8 stream) for random initialization.
pub(crate) struct NormalRng {
    rng: rand_chacha::ChaCha8Rng,
    spare: Option<f64>,
}

impl NormalRng {
    pub(crate) fn new(seed: u64) -> Self {
        use rand::SeedableRng;
        NormalRng {
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            spare: None,
        }
    }

    /// The generator positioned at value `index` of its stream: the values it gives are
    /// those a fresh one gives after `index` draws. Each pair of values consumes four 32-bit
    /// words of the ChaCha stream (two `f64`s, no rejection), so the pair's words are found
    /// directly; an odd index draws the pair and keeps its second value.
    pub(crate) fn at(seed: u64, index: u64) -> Self {
        let mut r = NormalRng::new(seed);
        r.rng.set_word_pos(u128::from(index / 2) * 4);
        if index % 2 == 1 {
            r.sample();
        }
        r
    }

    pub(crate) fn sample(&mut self) -> f64 {
        use rand::Rng;
        if let Some(s) = self.spare.take() {
            return s;
        }
        let u1: f64 = 1.0 - self.rng.gen::<f64>(); // (0, 1]
        let u2: f64 = self.rng.gen::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Model, ModelConfig};

    /// A generator placed at any index (odd: inside a pair) gives the values a sequential one
    /// gives from there, bit for bit.
    #[test]
    fn a_generator_placed_at_an_index_continues_the_sequential_stream() {
        let mut seq = NormalRng::new(9);
        let v: Vec<u64> = (0..2003).map(|_| seq.sample().to_bits()).collect();
        for start in [0u64, 1, 2, 3, 17, 1000, 1001, 2002] {
            let mut r = NormalRng::at(9, start);
            for (i, want) in v.iter().enumerate().skip(start as usize) {
                assert_eq!(r.sample().to_bits(), *want, "start {start}, value {i}");
            }
        }
    }

    /// `Model::random`, drawn in chunks on all cores, equals one sequential pass over the
    /// parameters in order (norms 1, biases 0, every other value `N(0, 1) · std` in turn).
    #[test]
    fn random_weights_are_one_sequential_stream() {
        let mut c = ModelConfig::tiny();
        c.qkv_bias = true;
        let m = Model::random(&c, 11).unwrap();
        let mut rng = NormalRng::new(11);
        let std = c.initializer_range as f64;
        let mut sampled = 0;
        for p in m.params().iter() {
            let want: Vec<f32> = match p.role {
                TensorRole::Norm => vec![1.0; p.data.len()],
                TensorRole::Bias => vec![0.0; p.data.len()],
                _ => {
                    sampled += p.data.len();
                    (0..p.data.len())
                        .map(|_| (rng.sample() * std) as f32)
                        .collect()
                }
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&p.data), bits(&want), "{}", p.name);
        }
        assert!(sampled > 0);
    }
}
