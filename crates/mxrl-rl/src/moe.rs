//! The RL traits for the MoE transformer of `mxrl-model`, under a precision plan of `mxrl-plan`.
//!
//! - Every parameter gets its storage format from the plan (model names map to plan names; a
//!   fused `gate_up_proj` takes its `gate_proj` entry — the plan guarantees gate and up agree).
//! - Trainer: f32 masters + gradients live here; the model multiplies the **effective**
//!   weights `dequantize(quantize_plan(master))` (exactly the values the rollout holds), and
//!   weight gradients pass straight through to the masters. Refreshed lazily after each
//!   optimizer step.
//! - Rollout: holds the wire tensors it was sent and a model whose weights are their
//!   contract dequantization; [`RolloutPolicy::load_weights`] validates and dequantizes every
//!   tensor before it changes anything.
//! - GEMM operands: BF16-rounded activations and weights for BF16 / MXFP8 tensors (MXFP8
//!   values are BF16-exact), f32 for NVFP4 tensors (their per-tensor FP32 scale makes the
//!   dequantized values not BF16-exact); f32 accumulation throughout.

use crate::policy::{
    LayerProbes, ParamMut, PolicyError, RolloutPolicy, RoutingTrace, Sample, SamplingConfig,
    TrainForward, TrainPolicy, TrainSeq, WireTensor,
};
use crate::sampling::{entropy, log_softmax_tempered};
use crate::wire::{dequantize, quantize};
use mxrl_formats::Format;
use mxrl_model::{
    ForwardOptions, LinearPrecision, Model, ModelConfig, ReplayKind, Routes, SamplingParams,
    SeqInput, Tape,
};
use mxrl_plan::{PrecisionPlan, Recipe};
use std::collections::BTreeMap;

fn be<E: std::fmt::Display>(e: E) -> PolicyError {
    PolicyError::Backend(e.to_string())
}

/// Resolve `recipe` (preset name or TOML file) for a model configuration.
pub fn plan_for(config: &ModelConfig, recipe: &str) -> Result<PrecisionPlan, PolicyError> {
    let inv =
        mxrl_plan::Inventory::from_config_json(&config.to_json(), "<model config>").map_err(be)?;
    let r = Recipe::load(recipe).map_err(be)?;
    mxrl_plan::resolve(&inv, &r).map_err(be)
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

fn set_precisions(model: &mut Model, formats: &[Format]) {
    let by_name: BTreeMap<String, Format> = model
        .params()
        .iter()
        .zip(formats)
        .map(|(p, f)| (p.name.clone(), *f))
        .collect();
    model
        .set_precision_by(|name, _| match by_name.get(name) {
            Some(Format::Nvfp4) => LinearPrecision::F32,
            _ => LinearPrecision::Bf16,
        })
        .expect("f32 and bf16 linears accept every weight shape");
}

fn export(
    model: &Model,
    formats: &[Format],
    values: &[Vec<f32>],
) -> Result<Vec<WireTensor>, PolicyError> {
    model
        .params()
        .iter()
        .zip(formats)
        .zip(values)
        .map(|((p, f), v)| {
            let (r, c) = rows_cols(&p.shape);
            let mut w = quantize(&p.name, *f, r, c, v)?;
            w.shape = p.shape.clone();
            Ok(w)
        })
        .collect()
}

fn wire_rows_cols(t: &WireTensor) -> WireTensor {
    let (r, c) = rows_cols(&t.shape);
    WireTensor {
        shape: vec![r, c],
        ..t.clone()
    }
}

/// Model routing (per layer, `None` for dense) → the loop's flat trace over MoE layers.
fn to_trace(t: &mxrl_model::RoutingTrace) -> Option<RoutingTrace> {
    let moe: Vec<&Routes> = t.layers.iter().flatten().collect();
    let first = moe.first()?;
    let (l, k, n) = (moe.len(), first.top_k, first.num_tokens());
    let mut ids = Vec::with_capacity(n * l * k);
    let mut weights = Vec::with_capacity(n * l * k);
    for p in 0..n {
        for r in &moe {
            ids.extend_from_slice(&r.ids[p * k..(p + 1) * k]);
            weights.extend_from_slice(&r.weights[p * k..(p + 1) * k]);
        }
    }
    Some(RoutingTrace {
        layers: l,
        top_k: k,
        ids,
        weights,
    })
}

/// The loop's trace → model routing for replay.
fn from_trace(cfg: &ModelConfig, t: &RoutingTrace) -> mxrl_model::RoutingTrace {
    let n = t.positions();
    let (l, k) = (t.layers, t.top_k);
    let mut moe_i = 0;
    let layers = (0..cfg.num_layers)
        .map(|layer| {
            if !cfg.is_moe_layer(layer) {
                return None;
            }
            let li = moe_i;
            moe_i += 1;
            let mut ids = Vec::with_capacity(n * k);
            let mut weights = Vec::with_capacity(n * k);
            for p in 0..n {
                let b = (p * l + li) * k;
                ids.extend_from_slice(&t.ids[b..b + k]);
                weights.extend_from_slice(&t.weights[b..b + k]);
            }
            Some(Routes {
                top_k: k,
                ids,
                weights,
            })
        })
        .collect();
    mxrl_model::RoutingTrace { layers }
}

/// Trainer side for the MoE model.
pub struct MoeTrainer {
    model: Model,
    formats: Vec<Format>,
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

fn scatter_bf(model: &mut Model, values: &[Vec<f32>]) -> Result<(), PolicyError> {
    let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
    let mut ps = model.params_mut();
    for (n, v) in names.iter().zip(values) {
        ps.set(n, v).map_err(be)?;
    }
    Ok(())
}

impl MoeTrainer {
    /// Wrap `model` (its current weights become the f32 masters) under `formats` (one per
    /// parameter, from [`formats_for`]).
    pub fn new(mut model: Model, formats: Vec<Format>) -> Result<MoeTrainer, PolicyError> {
        if formats.len() != model.params().len() {
            return Err(PolicyError::Invalid(format!(
                "{} formats for {} parameters",
                formats.len(),
                model.params().len()
            )));
        }
        set_precisions(&mut model, &formats);
        let master: Vec<Vec<f32>> = model.params().iter().map(|p| p.data.clone()).collect();
        let names = model.params().iter().map(|p| p.name.clone()).collect();
        let grad = master.iter().map(|m| vec![0.0; m.len()]).collect();
        let mut t = MoeTrainer {
            model,
            formats,
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

    /// The model with the f32 master weights (for saving a checkpoint).
    pub fn master_model(&self) -> Result<Model, PolicyError> {
        let mut m = self.model.clone();
        scatter_bf(&mut m, &self.master)?;
        Ok(m)
    }

    /// A rollout engine holding this trainer's exported weights.
    pub fn rollout(&self) -> Result<MoeRollout, PolicyError> {
        let mut r = MoeRollout {
            model: self.model.clone(),
            wire: Vec::new(),
            replay_kind: self.replay_kind,
        };
        r.load_weights(&self.export_weights()?)?;
        Ok(r)
    }

    fn refresh(&mut self) -> Result<(), PolicyError> {
        if !self.dirty {
            return Ok(());
        }
        let eff: Vec<Vec<f32>> = export(&self.model, &self.formats, &self.master)?
            .iter()
            .map(|w| dequantize(&wire_rows_cols(w)))
            .collect::<Result<_, _>>()?;
        scatter_bf(&mut self.model, &eff)?;
        self.tape = None;
        self.dirty = false;
        Ok(())
    }
}

fn seq_tokens(s: &TrainSeq<'_>) -> (Vec<u32>, Vec<u32>) {
    let mut full = s.prompt.to_vec();
    full.extend_from_slice(s.response);
    let t = full.len() - 1;
    (full[..t].to_vec(), full[1..].to_vec())
}

/// Forward a batch through `model`; returns per-sequence (response logprobs, entropy, trace)
/// and the tape when `train`.
fn model_forward(
    model: &Model,
    batch: &[TrainSeq<'_>],
    temperature: f32,
    train: bool,
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
    let replay: Option<Vec<mxrl_model::RoutingTrace>> =
        if batch.iter().all(|s| s.replay.is_some()) && !batch.is_empty() {
            Some(
                batch
                    .iter()
                    .map(|s| from_trace(model.config(), s.replay.expect("checked")))
                    .collect(),
            )
        } else {
            None
        };
    let out = model
        .forward(
            &inputs,
            &ForwardOptions {
                temperature,
                return_logits: true,
                train,
                replay: replay.as_deref().map(|r| (r, replay_kind)),
            },
        )
        .map_err(be)?;
    let v = model.config().vocab_size;
    let logits = out.logits.unwrap_or_default();
    let mut res = Vec::with_capacity(batch.len());
    let mut lp = Vec::new();
    for (i, s) in batch.iter().enumerate() {
        let t = toks[i].0.len();
        let r = s.response.len();
        let start = t - r;
        let mut f = TrainForward {
            logprobs: out.logprobs[i][start..].to_vec(),
            ..TrainForward::default()
        };
        if let Some(lg) = logits.get(i) {
            for p in start..t {
                log_softmax_tempered(&lg[p * v..(p + 1) * v], temperature, &mut lp);
                f.entropy.push(entropy(&lp));
            }
        }
        f.routing = out.routing.get(i).and_then(to_trace);
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
        let (mut fw, tape) =
            model_forward(&self.model, batch, temperature, true, self.replay_kind)?;
        // With replay, the routing returned is the replayed one; the trainer's own choice
        // (for the routing-agreement metric) comes from a forward without replay.
        if batch.iter().any(|s| s.replay.is_some()) {
            let free: Vec<TrainSeq<'_>> = batch
                .iter()
                .map(|s| TrainSeq { replay: None, ..*s })
                .collect();
            let (own, _) = model_forward(&self.model, &free, temperature, false, self.replay_kind)?;
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

    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        export(&self.model, &self.formats, &self.master)
    }
}

/// Rollout side for the MoE model.
#[derive(Clone)]
pub struct MoeRollout {
    model: Model,
    wire: Vec<WireTensor>,
    /// Replay kind used by [`RolloutPolicy::score`] (must equal the trainer's).
    pub replay_kind: ReplayKind,
}

impl std::fmt::Debug for MoeRollout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeRollout({} tensors)", self.wire.len())
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
        let gens = self.model.generate(&expanded, &sp).map_err(be)?;
        Ok(gens
            .into_iter()
            .enumerate()
            .map(|(i, g)| Sample {
                prompt_index: i / n,
                prompt: prompts[i / n].clone(),
                response: g.tokens,
                logprobs: g.logprobs,
                routing: to_trace(&g.routing),
                probes: None::<LayerProbes>,
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
        let mut values = Vec::with_capacity(tensors.len());
        let mut formats = Vec::with_capacity(tensors.len());
        for (t, p) in tensors.iter().zip(params.iter()) {
            if t.name != p.name || t.shape != p.shape {
                return Err(PolicyError::Update(format!(
                    "expected `{}` {:?}, got `{}` {:?}",
                    p.name, p.shape, t.name, t.shape
                )));
            }
            values.push(dequantize(&wire_rows_cols(t))?);
            formats.push(t.format);
        }
        // Everything verified: now swap.
        set_precisions(&mut self.model, &formats);
        scatter_bf(&mut self.model, &values)?;
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
        let (fw, _) = model_forward(&self.model, batch, temperature, false, self.replay_kind)?;
        Ok(fw.into_iter().map(|f| f.logprobs).collect())
    }
}
