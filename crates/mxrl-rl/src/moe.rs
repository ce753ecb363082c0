//! The RL traits for the MoE transformer of `mxrl-model`, run under a precision plan of
//! `mxrl-plan`: trainer and rollout are the same quantized model.
//!
//! - **Plan.** Both sides call [`Model::apply_plan`]: every linear the plan stores in a block
//!   format runs as a quantized linear (`mxrl_tensor::qlinear`): activations are quantized on
//!   every forward (NVFP4 per token, α applied after the f32 sum), the weight once per weight
//!   version (a fused `gate_up_proj` as one tensor, so NVFP4 gives gate and up one amax), and
//!   the backward GEMMs follow the plan's backward mode (`lowp`, `high_precision`,
//!   `dequantized`). BF16 linears round operands to BF16; f32 accumulation throughout. Model
//!   names map to plan names; a fused `gate_up_proj` takes its `gate_proj` entry (the plan
//!   keeps gate and up equal).
//! - **Trainer** ([`MoeTrainer`]): f32 master weights and gradients live here. The model holds
//!   the masters of the quantized linears (their bytes are `quantize(master)` with the plan's
//!   scheme, the bytes `mxrl convert` writes; `high_precision` backward multiplies the BF16
//!   master) and the BF16 values of every other tensor (BF16 linears, router, norms,
//!   embeddings: the plan stores them BF16, so the trainer computes with exactly the values
//!   it ships). Gradients are [`Model::backward`]'s, with the plan's backward modes; they
//!   update the f32 masters (for the BF16 tensors: the usual BF16-parameter / FP32-master
//!   split). After an optimizer step [`TrainPolicy::refresh_weights`] puts the masters back
//!   into the model, which re-quantizes each weight once for the new version.
//! - **Export** ([`TrainPolicy::export_weights`]): the trainer's own bytes, never
//!   re-quantized: for quantized linears the stored tensor its forward multiplies
//!   ([`Model::stored_weight`], converted losslessly by [`crate::wire::from_quantized`]), BF16
//!   for everything else.
//! - **Rollout** ([`MoeRollout`]): the same model under the same plan. [`RolloutPolicy::
//!   load_weights`] checks every tensor (name, shape, plan format, bytes) and installs them
//!   atomically with [`Model::load_weights`]: quantized linears get the sent bytes as their
//!   stored weight (used as sent, no dequantize-requantize), the rest their BF16 values.
//!   Generation (KV-cache decode) therefore multiplies exactly the trainer's bytes with
//!   quantized activations; [`RolloutPolicy::weights`] reads back what the model holds.
//! - **Probes** ([`LayerProbes`], the per-layer `hidden_diff` metric): the residual stream
//!   after every decoder layer at the positions that predict the response tokens. The
//!   trainer's come from its training forward; the rollout's from its generation
//!   ([`Model::generate_capturing`]: prefill + KV-cache decode with its own weights) or, in
//!   bitwise mode, from its re-scoring forward ([`RolloutPolicy::score_with_probes`]).

use crate::policy::{
    replay_of, routed, LayerProbes, ParamMut, PolicyError, RolloutPolicy, Sample, SamplingConfig,
    Scored, TrainForward, TrainPolicy, TrainSeq, WireTensor,
};
use crate::wire::{bf16_values, bf16_wire, from_quantized, to_quantized};
use mxrl_formats::Format;
use mxrl_model::{
    ForwardOptions, HiddenStates, Model, ModelConfig, ReplayKind, SamplingParams, SeqInput, Tape,
    WeightValue,
};
use mxrl_plan::{PrecisionPlan, Recipe};
use mxrl_tensor::precision::round_bf16;
use std::collections::BTreeMap;

fn be<E: std::fmt::Display>(e: E) -> PolicyError {
    PolicyError::Backend(e.to_string())
}

/// Resolve `recipe` (preset name or TOML file) for a model configuration.
pub fn plan_for(config: &ModelConfig, recipe: &str) -> Result<PrecisionPlan, PolicyError> {
    let inv =
        mxrl_plan::Inventory::from_config_json(&config.to_json(), "<model config>").map_err(be)?;
    let r = Recipe::load(recipe).map_err(|e| PolicyError::Invalid(e.to_string()))?;
    mxrl_plan::resolve(&inv, &r)
        .map_err(|e| PolicyError::Invalid(format!("recipe `{recipe}` on this model: {e}")))
}

/// Storage format of every model parameter (store order) under `plan`.
pub fn formats_for(model: &Model, plan: &PrecisionPlan) -> Result<Vec<Format>, PolicyError> {
    model
        .params()
        .iter()
        .map(|p| {
            let hf = match p.name.strip_suffix(".gate_up_proj.weight") {
                Some(base) => format!("{base}.gate_proj.weight"),
                None => p.name.clone(),
            };
            plan.by_hf(&hf).map(|e| e.format).ok_or_else(|| {
                PolicyError::Invalid(format!(
                    "parameter {} (plan name {hf}) is not in the precision plan",
                    p.name
                ))
            })
        })
        .collect()
}

/// Stored bytes per format name of a model under a plan.
pub fn weight_bytes(model: &Model, formats: &[Format]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (p, f) in model.params().iter().zip(formats) {
        let (r, c) = rows_cols(&p.shape);
        *out.entry(f.name().to_string()).or_insert(0) += f.stored_bytes(r, c) as u64;
    }
    out
}

fn rows_cols(shape: &[usize]) -> (usize, usize) {
    let c = *shape.last().unwrap_or(&1);
    (shape.iter().product::<usize>() / c.max(1), c)
}

/// Apply `plan` to `model` and check that the model runs exactly the plan's storage formats:
/// a parameter the plan stores in a block format is a quantized linear of that format, every
/// other one is stored BF16. Returns the formats and which parameters are quantized linears.
fn apply_plan(
    model: &mut Model,
    plan: &PrecisionPlan,
) -> Result<(Vec<Format>, Vec<bool>), PolicyError> {
    let formats = formats_for(model, plan)?;
    model.apply_plan(plan).map_err(be)?;
    let quantized = model
        .params()
        .iter()
        .zip(&formats)
        .map(|(p, &f)| {
            let runs = model.stored_weight(&p.name).map(|q| q.format());
            match runs {
                Some(g) if g == f && f != Format::Bf16 => Ok(true),
                None if f == Format::Bf16 => Ok(false),
                _ => Err(PolicyError::Invalid(format!(
                    "parameter {}: the plan stores it as {f}, the model runs it as {}",
                    p.name,
                    runs.map_or("a BF16/f32 tensor".to_string(), |g| format!("a {g} linear"))
                ))),
            }
        })
        .collect::<Result<Vec<bool>, _>>()?;
    Ok((formats, quantized))
}

/// What a model holds, in wire form: the stored bytes of its quantized linears, BF16 for the
/// rest (their values are BF16-exact, so this is lossless).
fn held_weights(model: &Model) -> Result<Vec<WireTensor>, PolicyError> {
    model
        .params()
        .iter()
        .map(|p| match model.stored_weight(&p.name) {
            Some(stored) => from_quantized(&p.name, stored),
            None => Ok(bf16_wire(&p.name, p.shape.clone(), &p.data)),
        })
        .collect()
}

/// Trainer side for the MoE model.
pub struct MoeTrainer {
    model: Model,
    formats: Vec<Format>,
    quantized: Vec<bool>,
    master: Vec<Vec<f32>>,
    grad: Vec<Vec<f32>>,
    names: Vec<String>,
    dirty: bool,
    tape: Option<Tape>,
    resp_lens: Vec<(usize, usize)>,
    /// How routing is replayed in the training forward.
    pub replay_kind: ReplayKind,
}

impl Clone for MoeTrainer {
    /// A copy of the weights and formats (gradients and saved activations are not copied).
    fn clone(&self) -> Self {
        MoeTrainer {
            model: self.model.clone(),
            formats: self.formats.clone(),
            quantized: self.quantized.clone(),
            master: self.master.clone(),
            grad: self.grad.iter().map(|g| vec![0.0; g.len()]).collect(),
            names: self.names.clone(),
            dirty: self.dirty,
            tape: None,
            resp_lens: Vec::new(),
            replay_kind: self.replay_kind,
        }
    }
}

impl std::fmt::Debug for MoeTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeTrainer({} tensors)", self.names.len())
    }
}

impl MoeTrainer {
    /// Wrap `model` (its current weights become the f32 masters) and run it under `plan`.
    ///
    /// # Errors
    /// A parameter the plan does not cover, or one whose plan format the model cannot run.
    pub fn new(mut model: Model, plan: &PrecisionPlan) -> Result<MoeTrainer, PolicyError> {
        let (formats, quantized) = apply_plan(&mut model, plan)?;
        let master: Vec<Vec<f32>> = model.params().iter().map(|p| p.data.clone()).collect();
        let names = model.params().iter().map(|p| p.name.clone()).collect();
        let grad = master.iter().map(|m| vec![0.0; m.len()]).collect();
        let mut t = MoeTrainer {
            model,
            formats,
            quantized,
            master,
            grad,
            names,
            dirty: true,
            tape: None,
            resp_lens: Vec::new(),
            replay_kind: ReplayKind::Ids,
        };
        t.refresh()?;
        Ok(t)
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The model the trainer runs (under the plan; up to date after
    /// [`TrainPolicy::refresh_weights`]).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Storage format of every parameter (store order), from the plan.
    pub fn formats(&self) -> &[Format] {
        &self.formats
    }

    /// The model with the f32 master weights (for saving a checkpoint).
    pub fn master_model(&self) -> Result<Model, PolicyError> {
        let mut m = self.model.clone();
        let mut ps = m.params_mut();
        for (n, v) in self.names.iter().zip(&self.master) {
            ps.set(n, v).map_err(be)?;
        }
        drop(ps);
        Ok(m)
    }

    /// A rollout engine under the same plan, holding this trainer's exported weights.
    pub fn rollout(&mut self) -> Result<MoeRollout, PolicyError> {
        self.refresh()?;
        let mut r = MoeRollout {
            model: self.model.clone(),
            formats: self.formats.clone(),
            quantized: self.quantized.clone(),
            replay_kind: self.replay_kind,
        };
        r.load_weights(&self.export_weights()?)?;
        Ok(r)
    }

    /// Put the masters into the model: quantized linears get the f32 masters (quantized once
    /// for the new weight version when the guard drops), every other tensor its BF16 value.
    fn refresh(&mut self) -> Result<(), PolicyError> {
        if !self.dirty {
            return Ok(());
        }
        let mut ps = self.model.params_mut();
        for ((n, v), &q) in self.names.iter().zip(&self.master).zip(&self.quantized) {
            if q {
                ps.set(n, v).map_err(be)?;
            } else {
                let b: Vec<f32> = v.iter().map(|&x| round_bf16(x)).collect();
                ps.set(n, &b).map_err(be)?;
            }
        }
        drop(ps);
        self.tape = None;
        self.dirty = false;
        Ok(())
    }
}

/// The tokens a sequence feeds to the model (`prompt + response[..len-1]`) and their targets.
pub(crate) fn seq_tokens(s: &TrainSeq<'_>) -> (Vec<u32>, Vec<u32>) {
    let mut full = s.prompt.to_vec();
    full.extend_from_slice(s.response);
    let t = full.len() - 1;
    (full[..t].to_vec(), full[1..].to_vec())
}

/// Per-layer probes of the last `r` positions of captured residual streams (the positions
/// that predict the `r` response tokens).
fn probes_of(h: &HiddenStates, r: usize) -> LayerProbes {
    let (w, t) = (h.hidden_size, h.num_tokens());
    let start = t.saturating_sub(r);
    LayerProbes {
        layers: h.layers.len(),
        width: w,
        values: h
            .layers
            .iter()
            .flat_map(|l| l[start * w..t * w].iter().copied())
            .collect(),
    }
}

/// Forward a batch through `model`; returns per-sequence (response logprobs, entropy, routing,
/// probes when `probes`) and the tape when `train`.
fn model_forward(
    model: &Model,
    batch: &[TrainSeq<'_>],
    temperature: f32,
    train: bool,
    probes: bool,
    replay_kind: ReplayKind,
) -> Result<(Vec<TrainForward>, Option<Tape>), PolicyError> {
    if batch
        .iter()
        .any(|s| s.prompt.is_empty() || s.response.is_empty())
    {
        return Err(PolicyError::Invalid(
            "every sequence needs a non-empty prompt and response".into(),
        ));
    }
    let toks: Vec<(Vec<u32>, Vec<u32>)> = batch.iter().map(seq_tokens).collect();
    let inputs: Vec<SeqInput<'_>> = toks
        .iter()
        .map(|(t, g)| SeqInput {
            tokens: t,
            targets: g,
        })
        .collect();
    let replay = replay_of(batch);
    let opts = ForwardOptions {
        temperature,
        return_logits: false,
        train,
        replay: replay.as_deref().map(|r| (r, replay_kind)),
    };
    let out = if probes {
        model.forward_capturing(&inputs, &opts)
    } else {
        model.forward(&inputs, &opts)
    }
    .map_err(be)?;
    // The trainer's forward reports the entropy; a scoring forward needs none.
    let entropy = out.tape.as_ref().map(|t| model.entropy(t));
    let mut routing = out.routing.into_iter();
    let mut res = Vec::with_capacity(batch.len());
    for (i, s) in batch.iter().enumerate() {
        let t = toks[i].0.len();
        let r = s.response.len();
        let start = t - r;
        let mut f = TrainForward {
            logprobs: out.logprobs[i][start..].to_vec(),
            entropy: entropy
                .as_ref()
                .map_or(Vec::new(), |e| e[i][start..].to_vec()),
            ..TrainForward::default()
        };
        f.routing = routing.next().and_then(routed);
        f.probes = out
            .hidden
            .as_ref()
            .and_then(|h| h.get(i))
            .map(|h| probes_of(h, r));
        res.push(f);
    }
    Ok((res, out.tape))
}

impl TrainPolicy for MoeTrainer {
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError> {
        self.refresh()?;
        let (mut fw, tape) = model_forward(
            &self.model,
            batch,
            temperature,
            true,
            true,
            self.replay_kind,
        )?;
        // With replay, the routing returned is the replayed one; the trainer's own choice
        // (for the routing-agreement metric) comes from a forward without replay.
        if batch.iter().any(|s| s.replay.is_some()) {
            let free: Vec<TrainSeq<'_>> = batch
                .iter()
                .map(|s| TrainSeq { replay: None, ..*s })
                .collect();
            let (own, _) = model_forward(
                &self.model,
                &free,
                temperature,
                false,
                false,
                self.replay_kind,
            )?;
            for (f, o) in fw.iter_mut().zip(own) {
                f.routing = o.routing;
            }
        }
        self.tape = tape;
        self.resp_lens = batch
            .iter()
            .map(|s| (s.prompt.len() + s.response.len() - 1, s.response.len()))
            .collect();
        Ok(fw)
    }

    fn backward(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        let tape = self
            .tape
            .take()
            .ok_or_else(|| PolicyError::Invalid("backward without a training forward".into()))?;
        if dlogp.len() != self.resp_lens.len() {
            return Err(PolicyError::Invalid(format!(
                "backward: {} gradient rows for {} sequences",
                dlogp.len(),
                self.resp_lens.len()
            )));
        }
        let full: Vec<Vec<f32>> = dlogp
            .iter()
            .zip(&self.resp_lens)
            .map(|(d, &(t, r))| {
                let mut v = vec![0.0f32; t - r];
                v.extend_from_slice(d);
                v
            })
            .collect();
        let g = self.model.backward(&tape, &full, 0.0).map_err(be)?;
        for (acc, gi) in self.grad.iter_mut().zip(&g.grads) {
            for (a, b) in acc.iter_mut().zip(gi) {
                *a += b;
            }
        }
        Ok(())
    }

    fn params(&mut self) -> Vec<ParamMut<'_>> {
        self.dirty = true;
        self.tape = None;
        self.names
            .iter()
            .zip(self.master.iter_mut())
            .zip(self.grad.iter_mut())
            .zip(&self.formats)
            .map(|(((n, v), g), f)| ParamMut {
                name: n,
                value: v,
                grad: g,
                format: *f,
            })
            .collect()
    }

    fn zero_grad(&mut self) {
        // Gradients only: the weights (and the tape of a pending backward) stay valid.
        for g in &mut self.grad {
            g.fill(0.0);
        }
    }

    fn refresh_weights(&mut self) -> Result<(), PolicyError> {
        self.refresh()
    }

    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        if self.dirty {
            return Err(PolicyError::Invalid(
                "export_weights: the parameters changed since the last refresh_weights; \
                 refresh first so the export is the bytes the trainer multiplies"
                    .into(),
            ));
        }
        held_weights(&self.model)
    }
}

/// Rollout side for the MoE model.
#[derive(Clone)]
pub struct MoeRollout {
    model: Model,
    formats: Vec<Format>,
    quantized: Vec<bool>,
    /// Replay kind used by [`RolloutPolicy::score`] (must equal the trainer's).
    pub replay_kind: ReplayKind,
}

impl std::fmt::Debug for MoeRollout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeRollout({} tensors)", self.formats.len())
    }
}

impl MoeRollout {
    /// A rollout engine running `model` under `plan`, with the model's own weights (quantized
    /// from its values) until the first [`RolloutPolicy::load_weights`].
    ///
    /// # Errors
    /// As [`MoeTrainer::new`].
    pub fn new(mut model: Model, plan: &PrecisionPlan) -> Result<MoeRollout, PolicyError> {
        let (formats, quantized) = apply_plan(&mut model, plan)?;
        Ok(MoeRollout {
            model,
            formats,
            quantized,
            replay_kind: ReplayKind::Ids,
        })
    }

    /// The model the rollout runs.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl RolloutPolicy for MoeRollout {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<Vec<Sample>, PolicyError> {
        let expanded: Vec<&[u32]> = prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.as_slice(), n))
            .collect();
        let sp = SamplingParams {
            temperature: cfg.temperature,
            top_p: cfg.top_p,
            top_k: 0,
            seed,
            max_new_tokens: cfg.max_new_tokens,
            stop_tokens: vec![eos],
        };
        let gens = self.model.generate_capturing(&expanded, &sp).map_err(be)?;
        Ok(gens
            .into_iter()
            .enumerate()
            .map(|(i, g)| Sample {
                prompt_index: i / n,
                prompt: prompts[i / n].clone(),
                probes: g.hidden.as_ref().map(|h| probes_of(h, g.tokens.len())),
                response: g.tokens,
                logprobs: g.logprobs,
                routing: routed(g.routing),
            })
            .collect())
    }

    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        let params = self.model.params();
        if tensors.len() != params.len() {
            return Err(PolicyError::Update(format!(
                "{} tensors sent, the model has {}",
                tensors.len(),
                params.len()
            )));
        }
        let mut updates = Vec::with_capacity(tensors.len());
        for (i, (t, p)) in tensors.iter().zip(params.iter()).enumerate() {
            if t.name != p.name || t.shape != p.shape {
                return Err(PolicyError::Update(format!(
                    "expected `{}` {:?}, got `{}` {:?}",
                    p.name, p.shape, t.name, t.shape
                )));
            }
            if t.format != self.formats[i] {
                return Err(PolicyError::Update(format!(
                    "tensor {}: sent as {}, the precision plan stores it as {}",
                    t.name, t.format, self.formats[i]
                )));
            }
            let v = if self.quantized[i] {
                WeightValue::Quantized(to_quantized(t)?)
            } else {
                WeightValue::Values(bf16_values(t)?)
            };
            updates.push((p.name.clone(), v));
        }
        // Everything decoded; the model validates and prepares every tensor before it swaps.
        self.model
            .load_weights(updates)
            .map_err(|e| PolicyError::Update(e.to_string()))
    }

    fn weights(&self) -> Vec<WireTensor> {
        held_weights(&self.model)
            .unwrap_or_else(|e| panic!("the rollout holds only wire-representable weights: {e}"))
    }

    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError> {
        let (fw, _) = model_forward(
            &self.model,
            batch,
            temperature,
            false,
            false,
            self.replay_kind,
        )?;
        Ok(fw.into_iter().map(|f| f.logprobs).collect())
    }

    fn score_with_probes(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Scored>, PolicyError> {
        let (fw, _) = model_forward(
            &self.model,
            batch,
            temperature,
            false,
            true,
            self.replay_kind,
        )?;
        Ok(fw
            .into_iter()
            .map(|f| Scored {
                logprobs: f.logprobs,
                probes: f.probes,
            })
            .collect())
    }
}
