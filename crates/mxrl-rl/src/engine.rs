//! The RL traits over the device engine (`mxrl_model::engine::Engine`): trainer and rollout
//! whose weights, gradients, AdamW moments, activations and KV caches live on one backend
//! (the GPU with `mxrl-cuda`'s `CudaBackend`; the CPU reference `CpuBackend` runs the same
//! code in tests).
//!
//! - **Recipes.** The engine runs the precision plan ([`Engine::apply_plan`]): a tensor the
//!   plan stores in BF16 is computed with exactly its BF16 value ([`Engine::use_bf16_params`]:
//!   linear weights multiply their BF16 operand, norms and the embedding are read as
//!   `f32(bf16(master))`); a linear it stores in MXFP8, NVFP4 or FP8-block multiplies its
//!   stored bytes,
//!   quantized from the f32 master after every optimizer step by the contract library, with
//!   the plan's backward mode. The export is therefore the bytes the trainer computes with:
//!   BF16 values, and the stored tensors of block-format linears (routed experts one tensor
//!   per expert, as the CPU model names them). NVFP4 with per-tensor activation scaling is
//!   not run by the engine ([`check_engine_plan`]).
//! - **Trainer** ([`EngineTrainer`]): per micro-batch the host sends token ids and receives the
//!   response tokens' logprobs; the backward takes `∂L/∂logprob`; the optimizer step (global
//!   gradient clipping, AdamW with the engine's weight-decay rule: linear and embedding
//!   weights, not norms and biases) runs on the device ([`TrainPolicy::optimizer_step`]).
//!   [`TrainPolicy::params`] copies masters and gradients to the host (checkpoints); values
//!   edited there go back to the device before the next use.
//! - **Rollout** ([`EngineRollout`]): batched sampling on the device (prefill, KV-cache
//!   decode, counter-based sampling by seed, step and row), a weight update validated in full
//!   before anything is replaced, and re-scoring with the trainer's forward (`--bitwise`).
//! - **Weight update in one process** ([`TrainPolicy::local_export`] →
//!   [`RolloutPolicy::load_local`]): the trainer's BF16 bytes are copied device to device into
//!   buffers the rollout then owns; the checksum of every source (taken before the copy) must
//!   equal the checksum of its copy (both on the device), and only then are the rollout's
//!   tensors swapped (the old version serves until the new one is complete and verified). Never
//!   through the host, never re-quantized. The wire form ([`TrainPolicy::export_weights`],
//!   SHA-256-checked buckets) remains for `--check-weight-sync` and other rollouts.
//! - **Routing replay**: the rollout records the routes of every position it feeds (prefill
//!   and decode, on the device, in the recorded decode step too; only when the loop replays
//!   them, [`RolloutPolicy::set_routes`]) and returns them with each sample; the trainer
//!   (and the bitwise re-scoring) replays the expert ids and recomputes their combine weights
//!   from its own router (`ReplayKind::Ids`), so the router trains.
//!   With replay the trainer also reports the routing it would choose itself (one more
//!   forward with route capture), for the routing-agreement metric.
//! - **Probes** (the per-layer `hidden_diff` metric): the residual stream after every layer
//!   at the response-predicting positions, gathered on the device in the training forward, in
//!   the bitwise re-scoring, and while generating when asked ([`RolloutPolicy::set_probes`],
//!   off by default: `layers × samples × max_new_tokens × hidden` f32 of device memory): the
//!   prefill copies the prompt's last position (it predicts the first new token), every
//!   decode step the row it fed, into a per-layer table (in the recorded decode step too),
//!   read back once at the end, as the CPU `MoeRollout` records them while decoding. The
//!   per-token entropy comes from the head kernel's pass that computes the logprobs.
//!
//! Parameter names are the engine's: Hugging Face names, with the routed experts of a layer
//! stacked as `model.layers.L.mlp.experts.*.{gate_up,down}_proj.weight` (`[E·rows, cols]`).

use crate::optim::{AdamWConfig, Moments};
use crate::policy::{
    replay_of, routed, LayerProbes, LocalExport, ParamMut, PolicyError, RolloutPolicy, Sample,
    SamplingConfig, Scored, TrainForward, TrainPolicy, TrainSeq, WireTensor,
};
use mxrl_formats::Format;
use mxrl_model::engine::{Engine, GenTiming, HostTensor, Record, Tape};
use mxrl_model::{ModelConfig, SeqInput};
use mxrl_plan::PrecisionPlan;
use mxrl_tensor::device::Backend;
use mxrl_tensor::device::StoredBytes;
use mxrl_tensor::sample::SampleParams;
use std::collections::BTreeMap;

fn be<E: std::fmt::Display>(e: E) -> PolicyError {
    PolicyError::Backend(e.to_string())
}

/// Whether the device engine runs `plan`'s formats: BF16, MXFP8, FP8-block, and NVFP4 with
/// per-token activation scaling; refuses, naming the first such tensor, a plan that stores a
/// tensor in NVFP4 with per-tensor activation scaling (the CUDA engine has no kernels for
/// it). Where a block format may go is checked by [`Engine::apply_plan`].
///
/// # Errors
/// The plan uses a format the engine does not run.
pub fn check_engine_plan(plan: &PrecisionPlan) -> Result<(), PolicyError> {
    let per_tensor = plan.nvfp4_activation_scale() == mxrl_plan::ActivationScale::PerTensor;
    if let Some(e) = plan.entries().iter().find(|e| match e.format {
        Format::Bf16 | Format::Mxfp8 | Format::Fp8Block => false,
        Format::Nvfp4 => per_tensor,
    }) {
        return Err(PolicyError::Invalid(format!(
            "recipe `{}` stores `{}` as {}{}: the device engine runs BF16, MXFP8, FP8-block and \
             NVFP4 with per-token activation scaling; run this recipe with --device cpu",
            plan.recipe().name,
            e.tensor.hf,
            e.format,
            if e.format == Format::Nvfp4 {
                " with per-tensor activation scaling"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// Prepares `engine` to run `plan`: BF16 parameters, block-format linears as stored.
fn engine_for_plan<B: Backend>(
    engine: &mut Engine<B>,
    plan: &PrecisionPlan,
) -> Result<(), PolicyError> {
    check_engine_plan(plan)?;
    engine.use_bf16_params().map_err(be)?;
    engine
        .apply_plan(plan)
        .map_err(|e| PolicyError::Invalid(format!("recipe `{}`: {e}", plan.recipe().name)))?;
    Ok(())
}

/// The tokens of `s` fed to the model and their targets.
fn seq_tokens(s: &TrainSeq<'_>) -> Result<(Vec<u32>, Vec<u32>), PolicyError> {
    if s.prompt.is_empty() || s.response.is_empty() {
        return Err(PolicyError::Invalid(
            "every sequence needs a non-empty prompt and response".into(),
        ));
    }
    Ok(crate::moe::seq_tokens(s))
}

/// What [`engine_forward`] returns.
struct Forward<B: Backend> {
    /// The tokens fed per sequence (`prompt + response[..len-1]`).
    fed: Vec<Vec<u32>>,
    /// The logprob of every fed position's target.
    logprobs: Vec<Vec<f32>>,
    tape: Tape<B>,
    /// Each sequence's probes at its response-predicting positions, when asked.
    probes: Option<Vec<LayerProbes>>,
}

/// The training forward of `batch` on `engine` (trainer and bitwise re-scoring alike: same
/// kernels, same packing), with the batch's replayed routes when every sequence carries one.
fn engine_forward<B: Backend>(
    engine: &Engine<B>,
    batch: &[TrainSeq<'_>],
    temperature: f32,
    probes: bool,
) -> Result<Forward<B>, PolicyError> {
    let toks: Vec<(Vec<u32>, Vec<u32>)> = batch.iter().map(seq_tokens).collect::<Result<_, _>>()?;
    let inputs: Vec<SeqInput<'_>> = toks
        .iter()
        .map(|(t, g)| SeqInput {
            tokens: t,
            targets: g,
        })
        .collect();
    let replay = replay_of(batch);
    let rl: Vec<usize> = batch.iter().map(|s| s.response.len()).collect();
    let (lp, tape) = engine
        .forward_train_probed(
            &inputs,
            temperature,
            replay.as_deref(),
            probes.then_some(rl.as_slice()),
        )
        .map_err(be)?;
    let pr = if probes {
        Some(split_probes(
            &engine.probes(&tape).map_err(be)?,
            &rl,
            engine.config().hidden_size,
        ))
    } else {
        None
    };
    Ok(Forward {
        fed: toks.into_iter().map(|(t, _)| t).collect(),
        logprobs: lp,
        tape,
        probes: pr,
    })
}

/// Per-sequence probes (`[layer][position][width]`) from the engine's per-layer probe rows
/// (`[P, H]`, the sequences' last `lens[s]` positions in order).
fn split_probes(per_layer: &[Vec<f32>], lens: &[usize], width: usize) -> Vec<LayerProbes> {
    let mut start = 0;
    lens.iter()
        .map(|&r| {
            let values = per_layer
                .iter()
                .flat_map(|l| l[start * width..(start + r) * width].iter().copied())
                .collect();
            start += r;
            LayerProbes {
                layers: per_layer.len(),
                width,
                values,
            }
        })
        .collect()
}

/// Every parameter as the forward computes with it, as wire tensors (engine order): BF16
/// values, and the stored tensors of a block-format linear (routed experts one per expert,
/// `….experts.{e}.…`).
fn export<B: Backend>(e: &Engine<B>) -> Result<Vec<WireTensor>, PolicyError> {
    let mut out = Vec::new();
    for name in e.param_names() {
        match e.stored_weights(name).map_err(be)? {
            Some(qs) => {
                let groups = qs.len();
                for (g, q) in qs.into_iter().enumerate() {
                    out.push(crate::wire::into_wire(
                        &Engine::<B>::stored_name(name, g, groups),
                        q,
                    )?);
                }
            }
            // Only the BF16 parameters are copied as values.
            None => out.push(crate::wire::bf16_bits_wire(
                name,
                e.param_shape(name).map_err(be)?.to_vec(),
                &e.param_bf16(name).map_err(be)?,
            )),
        }
    }
    Ok(out)
}

/// The device-resident weight update of an [`EngineTrainer`]: device copies of every
/// parameter (BF16 values, or a block-format linear's stored weights) and the checksums of
/// their sources, with the names and sizes they must match.
struct DeviceUpdate<B: Backend> {
    names: Vec<String>,
    lens: Vec<usize>,
    bufs: Vec<mxrl_model::engine::DeviceTensor<B>>,
    sums: Vec<u64>,
}

/// Host copies of every parameter's values and gradients (engine order).
type HostCopies = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Trainer side on the device engine.
pub struct EngineTrainer<B: Backend> {
    engine: Engine<B>,
    names: Vec<String>,
    tape: Option<Tape<B>>,
    /// Per sequence of the last forward: (positions fed, response length).
    resp_lens: Vec<(usize, usize)>,
    /// Host copies handed out by [`TrainPolicy::params`] (values, gradients); the values go
    /// back to the device before the engine is used again.
    host: Option<HostCopies>,
    /// Gather per-layer probes in the forward ([`TrainPolicy::set_probes`]; on by default).
    probes: bool,
}

impl<B: Backend> std::fmt::Debug for EngineTrainer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EngineTrainer({} tensors)", self.names.len())
    }
}

impl<B: Backend> EngineTrainer<B> {
    /// Trains `engine` under `plan` (BF16 recipes): allocates gradients and moments and
    /// switches the engine to BF16 parameters.
    ///
    /// # Errors
    /// A plan that stores a tensor in a block format (named); out of device memory.
    pub fn new(engine: Engine<B>, plan: &PrecisionPlan) -> Result<Self, PolicyError> {
        let mut t = Self::with_plan(engine, plan)?;
        t.engine.enable_training().map_err(be)?;
        Ok(t)
    }

    /// A frozen copy for the reference policy: runs the training forward, never steps (no
    /// gradients or moments are allocated, and the f32 masters are freed:
    /// [`Engine::drop_masters`]).
    ///
    /// # Errors
    /// As [`EngineTrainer::new`].
    pub fn frozen(engine: Engine<B>, plan: &PrecisionPlan) -> Result<Self, PolicyError> {
        let mut t = Self::with_plan(engine, plan)?;
        t.engine.drop_masters().map_err(be)?;
        Ok(t)
    }

    fn with_plan(mut engine: Engine<B>, plan: &PrecisionPlan) -> Result<Self, PolicyError> {
        engine_for_plan(&mut engine, plan)?;
        let names = engine.param_names().into_iter().map(String::from).collect();
        Ok(EngineTrainer {
            engine,
            names,
            tape: None,
            resp_lens: Vec::new(),
            host: None,
            probes: true,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }

    /// The f32 master weights as a host model (for saving a checkpoint).
    ///
    /// # Errors
    /// Device failure.
    pub fn master_model(&mut self) -> Result<mxrl_model::Model, PolicyError> {
        self.flush()?;
        self.engine.to_model().map_err(be)
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        self.engine.config()
    }

    /// Sends values edited through [`TrainPolicy::params`] back to the device.
    fn flush(&mut self) -> Result<(), PolicyError> {
        if let Some((values, _)) = self.host.take() {
            for (n, v) in self.names.iter().zip(&values) {
                self.engine.set_param_values(n, v).map_err(be)?;
            }
        }
        Ok(())
    }

    /// Backward of the last forward's micro-batch; `last`: the step's last one
    /// ([`Engine::backward_last`]).
    fn backward_with(&mut self, dlogp: &[Vec<f32>], last: bool) -> Result<(), PolicyError> {
        let tape = self
            .tape
            .take()
            .ok_or_else(|| PolicyError::Invalid("backward without a training forward".into()))?;
        if dlogp.len() != self.resp_lens.len()
            || dlogp
                .iter()
                .zip(&self.resp_lens)
                .any(|(d, &(_, r))| d.len() != r)
        {
            return Err(PolicyError::Invalid(format!(
                "backward: gradient rows of lengths {:?} for responses of lengths {:?}",
                dlogp.iter().map(Vec::len).collect::<Vec<_>>(),
                self.resp_lens.iter().map(|r| r.1).collect::<Vec<_>>()
            )));
        }
        let full = crate::policy::full_sequence_grads(dlogp, &self.resp_lens);
        if last {
            self.engine.backward_last(&tape, &full).map_err(be)
        } else {
            self.engine.backward(&tape, &full).map_err(be)
        }
    }
}

impl<B: Backend + 'static> TrainPolicy for EngineTrainer<B> {
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError> {
        self.flush()?;
        self.tape = None;
        let Forward {
            fed,
            logprobs: lp,
            tape,
            probes,
        } = engine_forward(&self.engine, batch, temperature, self.probes)?;
        let ent = self.engine.entropy(&tape).map_err(be)?;
        let probes: Vec<Option<LayerProbes>> = match probes {
            Some(p) => p.into_iter().map(Some).collect(),
            None => vec![None; batch.len()],
        };
        // With replay, the routing the trainer would choose itself (the routing-agreement
        // metric) comes from one more forward of the same tokens with route capture.
        let mut own = if batch.iter().all(|s| s.replay.is_some()) {
            let f: Vec<&[u32]> = fed.iter().map(Vec::as_slice).collect();
            Some(self.engine.routes_of(&f).map_err(be)?.into_iter())
        } else {
            None
        };
        self.tape = Some(tape);
        self.resp_lens = batch
            .iter()
            .zip(&fed)
            .map(|(s, t)| (t.len(), s.response.len()))
            .collect();
        Ok(lp
            .into_iter()
            .zip(ent)
            .zip(&self.resp_lens)
            .zip(probes)
            .map(|(((l, e), &(t, r)), p)| TrainForward {
                logprobs: l[t - r..].to_vec(),
                entropy: e[t - r..].to_vec(),
                routing: own.as_mut().and_then(Iterator::next).and_then(routed),
                probes: p,
            })
            .collect())
    }

    fn backward(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        self.backward_with(dlogp, false)
    }

    fn backward_last(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        self.backward_with(dlogp, true)
    }

    fn params(&mut self) -> Vec<ParamMut<'_>> {
        self.tape = None;
        if self.host.is_none() {
            let mut values = Vec::with_capacity(self.names.len());
            let mut grads = Vec::with_capacity(self.names.len());
            for n in &self.names {
                values.push(
                    self.engine
                        .param_values(n)
                        .unwrap_or_else(|e| panic!("copying parameter {n} to the host: {e}")),
                );
                grads.push(
                    self.engine
                        .grad_values(n)
                        .unwrap_or_else(|e| panic!("copying gradient {n} to the host: {e}")),
                );
            }
            self.host = Some((values, grads));
        }
        let (values, grads) = self.host.as_mut().expect("filled above");
        self.names
            .iter()
            .zip(values.iter_mut())
            .zip(grads.iter_mut())
            .map(|((n, v), g)| ParamMut {
                name: n,
                value: v,
                grad: g,
                format: match self.engine.stored_layout(n) {
                    Ok(Some((spec, ..))) => spec.format(),
                    _ => Format::Bf16,
                },
            })
            .collect()
    }

    fn zero_grad(&mut self) {
        if let Err(e) = self.engine.zero_grads() {
            panic!("zeroing the gradients on the device: {e}");
        }
        if let Some((_, g)) = self.host.as_mut() {
            g.iter_mut().for_each(|x| x.fill(0.0));
        }
    }

    fn refresh_weights(&mut self) -> Result<(), PolicyError> {
        self.flush()
    }

    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        if self.host.is_some() {
            return Err(PolicyError::Invalid(
                "export_weights: parameters were handed to the host; refresh_weights first".into(),
            ));
        }
        export(&self.engine)
    }

    fn optimizer_step(&mut self, cfg: &AdamWConfig, step: u64) -> Option<Result<f64, PolicyError>> {
        Some((|| {
            self.flush()?;
            self.tape = None;
            if step != self.engine.adam_step() + 1 {
                return Err(PolicyError::Invalid(format!(
                    "optimizer step {step} after {} steps on the device",
                    self.engine.adam_step()
                )));
            }
            let tc = mxrl_tensor::optim::AdamWConfig {
                lr: cfg.lr,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
            };
            let clip = (cfg.max_grad_norm > 0.0).then_some(cfg.max_grad_norm as f64);
            self.engine
                .optimizer_step(&tc, cfg.weight_decay, clip)
                .map_err(be)
        })())
    }

    fn optimizer_moments(&mut self) -> Option<Result<BTreeMap<String, Moments>, PolicyError>> {
        if self.engine.adam_step() == 0 {
            return Some(Ok(BTreeMap::new()));
        }
        Some(
            self.names
                .iter()
                .map(|n| {
                    let (m, v) = self.engine.adam_moments(n).map_err(be)?;
                    Ok((n.clone(), Moments { m, v }))
                })
                .collect(),
        )
    }

    fn set_optimizer_state(
        &mut self,
        step: u64,
        moments: &BTreeMap<String, Moments>,
    ) -> Result<bool, PolicyError> {
        let list: Vec<(&str, &[f32], &[f32])> = moments
            .iter()
            .map(|(n, m)| (n.as_str(), m.m.as_slice(), m.v.as_slice()))
            .collect();
        self.engine.set_adam_state(step, &list).map_err(be)?;
        Ok(true)
    }

    fn local_export(&mut self) -> Option<Result<LocalExport, PolicyError>> {
        Some((|| {
            self.flush()?;
            let (bufs, sums) = self.engine.export_device().map_err(be)?;
            let lens = self.engine.param_lens();
            let bytes = self.engine.export_device_bytes();
            Ok(LocalExport::new(
                bytes,
                bufs.len(),
                Box::new(DeviceUpdate::<B> {
                    names: self.names.clone(),
                    lens,
                    bufs,
                    sums,
                }),
            ))
        })())
    }

    fn set_probes(&mut self, on: bool) {
        self.probes = on;
    }

    fn set_aux_loss_coef(&mut self, coef: f32) -> Result<(), PolicyError> {
        self.engine.set_aux_loss_coef(coef).map_err(be)
    }

    fn last_aux_loss(&self) -> Result<Option<f64>, PolicyError> {
        Ok(self.engine.last_aux_loss().map_err(be)?.map(f64::from))
    }

    fn first_non_finite_weight(&mut self) -> Option<String> {
        if let Err(e) = self.flush() {
            return Some(format!("the weights could not be checked: {e}"));
        }
        match self.engine.first_non_finite_param() {
            Ok(w) => w,
            Err(e) => Some(format!("the weights could not be checked: {e}")),
        }
    }
}

/// Rollout side on the device engine.
pub struct EngineRollout<B: Backend> {
    engine: Engine<B>,
    /// What generation records besides tokens ([`RolloutPolicy::set_routes`], on by default;
    /// [`RolloutPolicy::set_probes`], off by default).
    record: Record,
    /// Where the last generation's time went.
    timing: Option<GenTiming>,
}

impl<B: Backend> std::fmt::Debug for EngineRollout<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EngineRollout({} tensors)",
            self.engine.param_names().len()
        )
    }
}

impl<B: Backend> EngineRollout<B> {
    /// Samples from `engine` under `plan` with its current weights until the first
    /// [`RolloutPolicy::load_weights`]; the engine's f32 masters are freed
    /// ([`Engine::drop_masters`]): sampling and scoring read the BF16 operands and stored
    /// weights, and weight updates write those.
    ///
    /// # Errors
    /// As [`EngineTrainer::new`].
    pub fn new(mut engine: Engine<B>, plan: &PrecisionPlan) -> Result<Self, PolicyError> {
        engine_for_plan(&mut engine, plan)?;
        // Sampling and scoring read the BF16 operands and stored weights only.
        engine.drop_masters().map_err(be)?;
        Ok(EngineRollout {
            engine,
            record: Record {
                routes: true,
                probes: 0,
            },
            timing: None,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }

    fn forward(
        &self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
        probes: bool,
    ) -> Result<Vec<Scored>, PolicyError> {
        // The trainer's forward (same kernels, same packing), so `--bitwise` scores equal
        // the trainer's logprobs bit for bit.
        let Forward {
            logprobs: lp,
            probes: pr,
            ..
        } = engine_forward(&self.engine, batch, temperature, probes)?;
        let mut pr: Vec<Option<LayerProbes>> = match pr {
            Some(p) => p.into_iter().map(Some).collect(),
            None => vec![None; batch.len()],
        };
        Ok(lp
            .into_iter()
            .zip(batch)
            .zip(pr.drain(..))
            .map(|((l, s), probes)| Scored {
                logprobs: l[l.len() - s.response.len()..].to_vec(),
                probes,
            })
            .collect())
    }
}

impl<B: Backend + 'static> RolloutPolicy for EngineRollout<B> {
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
        let sp = SampleParams {
            temperature: cfg.temperature,
            top_p: cfg.top_p,
            top_k: 0,
            seed,
            step: 0,
        };
        let (gens, timing) = self
            .engine
            .generate_timed(&expanded, cfg.max_new_tokens, &sp, &[eos], self.record)
            .map_err(be)?;
        self.timing = Some(timing);
        let (width, layers) = (
            self.engine.config().hidden_size,
            self.engine.config().num_layers,
        );
        Ok(gens
            .into_iter()
            .enumerate()
            .map(|(i, g)| Sample {
                prompt_index: i / n,
                prompt: prompts[i / n].clone(),
                routing: g.routes.and_then(routed),
                probes: g.probes.map(|values| LayerProbes {
                    layers,
                    width,
                    values,
                }),
                response: g.sampled.tokens,
                logprobs: g.sampled.logprobs,
            })
            .collect())
    }

    fn set_probes(&mut self, sequences: usize) {
        self.record.probes = sequences;
    }

    fn last_timing(&self) -> Option<GenTiming> {
        self.timing
    }

    fn set_routes(&mut self, on: bool) {
        self.record.routes = on;
    }

    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        // The tensors this engine takes, in order: (stored weight index, name, shape, format).
        let mut expected = Vec::new();
        for n in self.engine.param_names() {
            match self.engine.stored_layout(n).map_err(be)? {
                Some((spec, groups, rows, cols)) => {
                    for g in 0..groups {
                        expected.push((
                            Some(g),
                            Engine::<B>::stored_name(n, g, groups),
                            vec![rows, cols],
                            spec.format(),
                        ));
                    }
                }
                None => {
                    let shape = self.engine.param_shape(n).map_err(be)?.to_vec();
                    expected.push((None, n.to_string(), shape, Format::Bf16));
                }
            }
        }
        if tensors.len() != expected.len() {
            return Err(PolicyError::Update(format!(
                "{} tensors sent, the engine takes {}",
                tensors.len(),
                expected.len()
            )));
        }
        // Check every tensor against the engine before anything is copied; the engine then
        // builds every new device buffer from these bytes before it replaces the first one.
        let mut host: Vec<HostTensor<'_>> = Vec::new();
        for (t, (g, name, shape, format)) in tensors.iter().zip(&expected) {
            if t.name != *name || t.shape != *shape || t.format != *format {
                return Err(PolicyError::Update(format!(
                    "expected `{name}` {format} {shape:?}, got `{}` {} {:?}",
                    t.name, t.format, t.shape
                )));
            }
            match g {
                None => {
                    crate::wire::check_bf16(t)?;
                    host.push(HostTensor::Bf16(&t.data));
                }
                Some(g) => {
                    let w = StoredBytes {
                        name: &t.name,
                        data: &t.data,
                        scales: &t.scales,
                        amax: &t.amax,
                    };
                    if *g == 0 {
                        host.push(HostTensor::Stored(Vec::new()));
                    }
                    match host.last_mut() {
                        Some(HostTensor::Stored(ws)) => ws.push(w),
                        _ => unreachable!("a stored weight set starts at weight 0"),
                    }
                }
            }
        }
        self.engine
            .install_host(&host)
            .map_err(|e| PolicyError::Update(e.to_string()))
    }

    fn load_local(
        &mut self,
        // The caller's error names the version (`SyncError::Policy`).
        _version: u64,
        update: &mut LocalExport,
    ) -> Option<Result<(), PolicyError>> {
        let u = update.take::<DeviceUpdate<B>>()?;
        Some((|| {
            let names = self.engine.param_names();
            if u.names.len() != names.len()
                || u.names.iter().zip(&names).any(|(a, b)| a != b)
                || u.lens != self.engine.param_lens()
            {
                return Err(PolicyError::Update(format!(
                    "the device update's tensors ({}) are not this engine's ({})",
                    u.names.len(),
                    names.len()
                )));
            }
            self.engine
                .install_device(u.bufs, &u.sums)
                .map_err(|e| PolicyError::Update(e.to_string()))
        })())
    }

    fn weights(&self) -> Vec<WireTensor> {
        export(&self.engine)
            .unwrap_or_else(|e| panic!("copying the rollout's weights to the host: {e}"))
    }

    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError> {
        Ok(self
            .forward(batch, temperature, false)?
            .into_iter()
            .map(|s| s.logprobs)
            .collect())
    }

    fn score_with_probes(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Scored>, PolicyError> {
        self.forward(batch, temperature, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{build_engine, demo_model};
    use crate::sync::check_equal;
    use mxrl_tensor::device::CpuBackend;

    /// Without the reference (as SFT builds them), trainer and rollout are those of the full
    /// build: the same exported bytes, the same rollout weights.
    #[test]
    fn engines_built_without_the_reference_equal_the_full_builds() {
        let (model, _) = demo_model(2).unwrap();
        for recipe in ["bf16", "mxfp8"] {
            let full = build_engine(&model, recipe, 32, || Ok(CpuBackend)).unwrap();
            let two = crate::session::build_engines(&model, recipe, 32, false, || Ok(CpuBackend))
                .unwrap();
            assert!(
                full.reference.is_some() && two.reference.is_none(),
                "{recipe}"
            );
            let (a, b) = (&full.trainer, &two.trainer);
            check_equal(&a.export_weights().unwrap(), &b.export_weights().unwrap()).unwrap();
            check_equal(&full.rollout.weights(), &two.rollout.weights()).unwrap();
        }
    }

    /// The built rollout starts on zeroed buffers and takes the trainer's weights device to
    /// device: its weights, and what it samples, are those of a rollout built from the model
    /// that took the trainer's exported weights through the host (the build before), for every
    /// kind of stored weight.
    #[test]
    fn the_rollout_built_on_zeros_equals_one_built_from_the_model() {
        let (model, _) = demo_model(2).unwrap();
        let prompts: Vec<Vec<u32>> = vec![vec![3, 5, 7], vec![4, 2]];
        let cfg = SamplingConfig {
            max_new_tokens: 6,
            ..SamplingConfig::default()
        };
        for recipe in ["bf16", "mxfp8", "nvfp4-hp", "fp8-block"] {
            let mut built = build_engine(&model, recipe, 32, || Ok(CpuBackend)).unwrap();
            let plan = crate::moe::plan_for(model.config(), recipe).unwrap();
            let mut before =
                EngineRollout::new(Engine::from_model(&model, CpuBackend, 32).unwrap(), &plan)
                    .unwrap();
            let exported = built.trainer.export_weights().unwrap();
            before.load_weights(&exported).unwrap();
            check_equal(&exported, &built.rollout.weights())
                .unwrap_or_else(|e| panic!("{recipe}: {e}"));
            check_equal(&before.weights(), &built.rollout.weights())
                .unwrap_or_else(|e| panic!("{recipe}: {e}"));
            let a = built.rollout.generate(&prompts, 2, &cfg, 0, 11).unwrap();
            let b = before.generate(&prompts, 2, &cfg, 0, 11).unwrap();
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.response, y.response, "{recipe}");
                assert_eq!(
                    x.logprobs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    y.logprobs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{recipe}"
                );
            }
            assert_eq!(a.len(), b.len());
        }
    }

    /// A wire update is installed only whole: one tensor with a wrong byte count — the last
    /// BF16 tensor, or the scales of one stored block-format weight — is refused naming it,
    /// with every earlier (valid) tensor left uninstalled and the old weights serving; the
    /// intact update is then installed bit for bit.
    #[test]
    fn a_wire_update_with_one_bad_tensor_is_refused_by_name_and_changes_nothing() {
        for recipe in ["bf16", "mxfp8", "nvfp4-hp"] {
            let (model, _) = demo_model(2).unwrap();
            let mut b = build_engine(&model, recipe, 32, || Ok(CpuBackend)).unwrap();
            let (other, _) = demo_model(9).unwrap();
            let t2 = build_engine(&other, recipe, 32, || Ok(CpuBackend))
                .unwrap()
                .trainer;
            let before = b.rollout.weights();
            let good = t2.export_weights().unwrap();
            assert!(check_equal(&before, &good).is_err());
            let mut cases = vec![good.len() - 1];
            if recipe != "bf16" {
                let i = good.iter().rposition(|t| t.format != Format::Bf16).unwrap();
                cases.push(i);
            }
            for i in cases {
                let mut bad = good.clone();
                if bad[i].format == Format::Bf16 {
                    bad[i].data.pop();
                } else {
                    bad[i].scales.pop();
                }
                let e = b.rollout.load_weights(&bad).unwrap_err().to_string();
                assert!(e.contains(&bad[i].name), "{recipe}: {e}");
                check_equal(&b.rollout.weights(), &before).unwrap();
            }
            b.rollout.load_weights(&good).unwrap();
            check_equal(&b.rollout.weights(), &good).unwrap();
        }
    }

    /// The device update carries the trainer's exact bytes (the wire export of both sides is
    /// then equal: BF16 values and, under a block-format recipe, the stored weights), and a
    /// copy whose checksum does not match its source is refused by tensor name with the
    /// rollout's weights left as they were.
    #[test]
    fn device_update_is_exact_and_a_corrupted_copy_is_refused() {
        for recipe in ["bf16", "nvfp4-hp"] {
            let (model, _) = demo_model(2).unwrap();
            let mut b = build_engine(&model, recipe, 32, || Ok(CpuBackend)).unwrap();
            let (other, _) = demo_model(9).unwrap();
            let mut t2 = build_engine(&other, recipe, 32, || Ok(CpuBackend))
                .unwrap()
                .trainer;
            let before = b.rollout.weights();
            // A different model's update, one checksum altered in transit: a BF16 tensor, or
            // under the block-format recipe a set of stored experts.
            let mut x = t2.local_export().unwrap().unwrap();
            let mut u = x.take::<DeviceUpdate<CpuBackend>>().unwrap();
            let i = if recipe == "bf16" {
                3
            } else {
                let i = u
                    .names
                    .iter()
                    .position(|n| n.contains(".experts.*."))
                    .unwrap();
                assert!(matches!(
                    u.bufs[i],
                    mxrl_model::engine::DeviceTensor::Stored(_)
                ));
                i
            };
            u.sums[i] ^= 1;
            let name = u.names[i].clone();
            let mut bad = LocalExport::new(x.bytes, x.tensors, u);
            let e = b.rollout.load_local(1, &mut bad).unwrap().unwrap_err();
            assert!(e.to_string().contains(&name), "{recipe}: {e}");
            check_equal(&b.rollout.weights(), &before).unwrap();
            // The intact update is installed and is the other trainer's bytes.
            let mut ok = t2.local_export().unwrap().unwrap();
            if recipe == "bf16" {
                assert_eq!(ok.bytes, 2 * other.params().num_elements() as u64);
            } else {
                assert!(ok.bytes < 2 * other.params().num_elements() as u64);
            }
            b.rollout.load_local(2, &mut ok).unwrap().unwrap();
            check_equal(&b.rollout.weights(), &t2.export_weights().unwrap()).unwrap();
            assert!(check_equal(&b.rollout.weights(), &before).is_err());
            // A payload of another kind is left for the wire path.
            let mut foreign = LocalExport::new(0, 0, Box::new(7u32));
            assert!(b.rollout.load_local(3, &mut foreign).is_none());
            assert_eq!(*foreign.take::<u32>().unwrap(), 7);
        }
    }
}
