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
//! - **Trainer** ([`MoeTrainer`]): the model owns the f32 master weights and their
//!   gradients ([`Model::enable_training`]); the trainer keeps no copy. The model multiplies
//!   the quantized linears' stored bytes, `quantize(master)` with the plan's scheme (the bytes
//!   `mxrl convert` writes; `high_precision` backward multiplies the BF16 master), and reads
//!   every other tensor at its BF16 value ([`Model::use_bf16_params`]: BF16 linears, router,
//!   norms, embeddings; the plan stores them BF16, so the trainer computes with exactly the
//!   values it ships). Gradients are [`Model::backward_accumulate`]'s, with the plan's backward
//!   modes; the optimizer updates the f32 masters in place ([`Model::train_params_mut`]; for
//!   the BF16 tensors the usual BF16-parameter / FP32-master split). After an optimizer step
//!   [`TrainPolicy::refresh_weights`] has the model re-derive its working weights from its
//!   masters ([`Model::refresh_weights`]), quantizing each weight once for the new version —
//!   as the device trainer (`crate::engine::EngineTrainer`) does on its engine.
//! - **Export** ([`TrainPolicy::export_weights`]): the weights the model computes with, never
//!   re-quantized: for quantized linears the stored tensor its forward multiplies
//!   ([`Model::stored_weight`], converted losslessly by [`crate::wire::from_quantized`]), the
//!   BF16 value ([`Model::param_bf16`]) of everything else.
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
use crate::wire::{bf16_bits_wire, bf16_values, from_quantized, to_quantized};
use mxrl_formats::Format;
use mxrl_model::{
    ForwardOptions, HiddenStates, Model, ModelConfig, ReplayKind, SamplingParams, SeqInput, Tape,
    WeightValue,
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

/// What a model computes with, in wire form: the stored bytes of its quantized linears, the
/// BF16 value of the rest (a rollout's values are BF16-exact, so for it this is lossless).
fn held_weights(model: &Model) -> Result<Vec<WireTensor>, PolicyError> {
    model
        .params()
        .iter()
        .map(|p| match model.stored_weight(&p.name) {
            Some(stored) => from_quantized(&p.name, stored),
            None => Ok(bf16_bits_wire(
                &p.name,
                p.shape.clone(),
                &model.param_bf16(&p.name).ok_or_else(|| {
                    PolicyError::Backend(format!("parameter {} has no BF16 value", p.name))
                })?,
            )),
        })
        .collect()
}

/// Trainer side for the MoE model: the model owns the f32 masters and their gradients.
pub struct MoeTrainer {
    model: Model,
    formats: Vec<Format>,
    quantized: Vec<bool>,
    tape: Option<Tape>,
    resp_lens: Vec<(usize, usize)>,
    /// How routing is replayed in the training forward.
    pub replay_kind: ReplayKind,
    /// Coefficient of the auxiliary load-balancing loss in the backward (0: none).
    aux_coef: f32,
    /// The auxiliary loss of the training forward whose tape is kept (taken with it).
    forward_aux: Option<f32>,
    /// The auxiliary loss of the forward whose backward ran last, when that backward added
    /// it ([`TrainPolicy::last_aux_loss`]).
    last_aux: Option<f32>,
}

impl Clone for MoeTrainer {
    /// A copy of the weights and formats (gradients and saved activations are not copied).
    fn clone(&self) -> Self {
        let mut model = self.model.clone();
        model
            .zero_grads()
            .unwrap_or_else(|e| panic!("a trainer's model is in training: {e}"));
        MoeTrainer {
            model,
            formats: self.formats.clone(),
            quantized: self.quantized.clone(),
            tape: None,
            resp_lens: Vec::new(),
            replay_kind: self.replay_kind,
            aux_coef: self.aux_coef,
            forward_aux: None,
            last_aux: None,
        }
    }
}

impl std::fmt::Debug for MoeTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MoeTrainer({} tensors)", self.formats.len())
    }
}

impl MoeTrainer {
    /// Train `model` under `plan`: its current weights are the f32 masters (which it keeps),
    /// every tensor the plan stores BF16 is read at its BF16 value, every weight is derived
    /// from its master (stored bytes a converted model was loaded with are re-quantized from
    /// their dequantized masters), and the model allocates the gradients.
    ///
    /// # Errors
    /// A parameter the plan does not cover, or one whose plan format the model cannot run.
    pub fn new(mut model: Model, plan: &PrecisionPlan) -> Result<MoeTrainer, PolicyError> {
        let (formats, quantized) = apply_plan(&mut model, plan)?;
        model.use_bf16_params();
        model.enable_training();
        model.refresh_weights();
        Ok(MoeTrainer {
            model,
            formats,
            quantized,
            tape: None,
            resp_lens: Vec::new(),
            replay_kind: ReplayKind::Ids,
            aux_coef: 0.0,
            forward_aux: None,
            last_aux: None,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The model the trainer runs (under the plan; it holds the f32 masters and gradients,
    /// and its working weights are up to date after [`TrainPolicy::refresh_weights`]).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Storage format of every parameter (store order), from the plan.
    pub fn formats(&self) -> &[Format] {
        &self.formats
    }

    /// The model with the f32 master weights (for saving a checkpoint): [`Model::master_model`].
    pub fn master_model(&self) -> Result<Model, PolicyError> {
        Ok(self.model.master_model())
    }

    /// A rollout engine under the same plan, holding this trainer's exported weights.
    pub fn rollout(&mut self) -> Result<MoeRollout, PolicyError> {
        self.refresh();
        let mut r = MoeRollout {
            model: self.model.master_model(),
            formats: self.formats.clone(),
            quantized: self.quantized.clone(),
            replay_kind: self.replay_kind,
        };
        r.load_weights(&self.export_weights()?)?;
        Ok(r)
    }

    /// After the masters were edited ([`TrainPolicy::params`]), has the model re-derive its
    /// working weights from them: quantized linears are quantized once for the new weight
    /// version, every other tensor takes its BF16 value.
    fn refresh(&mut self) {
        if self.model.weights_stale() {
            self.model.refresh_weights();
            self.tape = None;
        }
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

/// What [`model_forward`] returns: per sequence, its response's logprobs and the rest; the
/// tape of a training forward; the forward's MoE auxiliary loss (`None` without MoE layers).
struct ModelForward {
    seqs: Vec<TrainForward>,
    tape: Option<Tape>,
    aux_loss: Option<f32>,
}

/// Forward a batch through `model`; returns per-sequence (response logprobs, entropy, routing,
/// probes when `probes`), the tape when `train`, and the auxiliary loss.
fn model_forward(
    model: &Model,
    batch: &[TrainSeq<'_>],
    temperature: f32,
    train: bool,
    probes: bool,
    replay_kind: ReplayKind,
) -> Result<ModelForward, PolicyError> {
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
    Ok(ModelForward {
        seqs: res,
        tape: out.tape,
        aux_loss: out.aux_loss,
    })
}

impl TrainPolicy for MoeTrainer {
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError> {
        self.refresh();
        let ModelForward {
            seqs: mut fw,
            tape,
            aux_loss,
        } = model_forward(
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
            let own = model_forward(
                &self.model,
                &free,
                temperature,
                false,
                false,
                self.replay_kind,
            )?
            .seqs;
            for (f, o) in fw.iter_mut().zip(own) {
                f.routing = o.routing;
            }
        }
        self.tape = tape;
        self.forward_aux = aux_loss;
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
        // The forward's loss goes with its tape; an earlier backward's no longer applies.
        let aux = self.forward_aux.take();
        self.last_aux = None;
        if dlogp.len() != self.resp_lens.len() {
            return Err(PolicyError::Invalid(format!(
                "backward: {} gradient rows for {} sequences",
                dlogp.len(),
                self.resp_lens.len()
            )));
        }
        let full = crate::policy::full_sequence_grads(dlogp, &self.resp_lens);
        self.model
            .backward_accumulate(&tape, &full, self.aux_coef)
            .map_err(be)?;
        self.last_aux = aux.filter(|_| self.aux_coef != 0.0);
        Ok(())
    }

    fn last_aux_loss(&self) -> Result<Option<f64>, PolicyError> {
        Ok(self.last_aux.map(f64::from))
    }

    fn set_aux_loss_coef(&mut self, coef: f32) -> Result<(), PolicyError> {
        mxrl_model::check_aux_loss_coef(coef).map_err(|e| PolicyError::Invalid(e.to_string()))?;
        self.aux_coef = coef;
        Ok(())
    }

    fn params(&mut self) -> Vec<ParamMut<'_>> {
        self.tape = None;
        self.model
            .train_params_mut()
            .unwrap_or_else(|e| panic!("a trainer's model is in training: {e}"))
            .into_iter()
            .zip(&self.formats)
            .map(|(p, f)| ParamMut {
                name: p.name,
                value: p.value,
                grad: p.grad,
                format: *f,
            })
            .collect()
    }

    fn zero_grad(&mut self) {
        // Gradients only: the weights (and the tape of a pending backward) stay valid.
        self.model
            .zero_grads()
            .unwrap_or_else(|e| panic!("a trainer's model is in training: {e}"));
    }

    fn refresh_weights(&mut self) -> Result<(), PolicyError> {
        self.refresh();
        Ok(())
    }

    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        if self.model.weights_stale() {
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
        let fw = model_forward(
            &self.model,
            batch,
            temperature,
            false,
            false,
            self.replay_kind,
        )?
        .seqs;
        Ok(fw.into_iter().map(|f| f.logprobs).collect())
    }

    fn score_with_probes(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Scored>, PolicyError> {
        let fw = model_forward(
            &self.model,
            batch,
            temperature,
            false,
            true,
            self.replay_kind,
        )?
        .seqs;
        Ok(fw
            .into_iter()
            .map(|f| Scored {
                logprobs: f.logprobs,
                probes: f.probes,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::demo_model;
    use crate::wire::{bf16_wire, wire_scheme};

    /// The trainer's parameters are the model's own masters and gradients (no second copy):
    /// the gradients [`TrainPolicy::params`] hands out are the model's, an edit through it is
    /// the model's master at once, the export is refused until
    /// [`TrainPolicy::refresh_weights`], and then it carries the BF16 value of an edited BF16
    /// tensor's master and the plan's quantization of an edited quantized linear's master —
    /// the bytes the model multiplies.
    #[test]
    fn the_trainer_edits_the_models_own_masters_and_gradients() {
        let (model, _) = demo_model(3).unwrap();
        let plan = plan_for(model.config(), "mxfp8").unwrap();
        let mut t = MoeTrainer::new(model, &plan).unwrap();
        let (bf, q) = (
            "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight",
        );
        assert!(t.model().stored_weight(q).is_some() && t.model().stored_weight(bf).is_none());
        let seq = TrainSeq {
            prompt: &[1, 2, 3],
            response: &[4, 5],
            replay: None,
        };
        let fw = t.forward(&[seq], 1.0).unwrap();
        t.backward(&[vec![1.0; fw[0].logprobs.len()]]).unwrap();
        let grads = t.model().grads().unwrap().grads.clone();
        assert!(grads.iter().flatten().any(|&g| g != 0.0));
        let mut edited = Vec::new();
        for (p, g) in t.params().into_iter().zip(&grads) {
            assert_eq!(p.grad, &g[..], "{}", p.name);
            if p.name == bf || p.name == q {
                p.value.iter_mut().for_each(|x| *x += 0.1234);
                edited.push((p.name.to_string(), p.value.to_vec()));
            }
        }
        assert!(t.model().weights_stale());
        assert!(t.export_weights().is_err());
        t.refresh_weights().unwrap();
        let ex = t.export_weights().unwrap();
        let m = t.model();
        assert_eq!(edited.len(), 2);
        for (name, want) in &edited {
            let name = name.as_str();
            let master = &m.params().by_name(name).unwrap().data;
            assert!(
                master == want,
                "{name}: the model's master is not the edited value"
            );
            let w = ex.iter().find(|w| w.name == name).unwrap();
            if name == bf {
                assert_eq!(*w, bf16_wire(bf, w.shape.clone(), master));
            } else {
                let scheme = wire_scheme(Format::Mxfp8).unwrap();
                let shape = &w.shape;
                let qt =
                    mxrl_formats::quantize(master, shape, scheme, mxrl_formats::Padding::Reject)
                        .unwrap();
                assert_eq!(m.stored_weight(q).unwrap(), &qt);
                assert_eq!(*w, from_quantized(q, &qt).unwrap());
            }
        }
    }
}
