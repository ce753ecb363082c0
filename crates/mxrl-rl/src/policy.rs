//! What the RL loop needs from a model, as two small traits.
//!
//! - [`RolloutPolicy`]: the sampling side. Holds its **own copy** of the weights in the plan's
//!   formats, generates `n` samples per prompt with per-token logprobs (and, for MoE models, the
//!   routing decisions and per-layer probes), and swaps in a verified weight set atomically.
//! - [`TrainPolicy`]: the learning side. f32 master weights; a training forward that returns
//!   per-token logprobs of the response tokens (optionally replaying the rollout's routing), a
//!   backward from d(loss)/d(logprob), named parameters for AdamW, and an export of the weights
//!   quantized by the plan ([`WireTensor`]s, exactly the bytes the rollout will hold).
//!
//! Both sides compute logprobs of the **tempered** distribution `softmax(logits / T)`.

use mxrl_formats::Format;
pub use mxrl_model::engine::GenTiming;
use serde::{Deserialize, Serialize};

/// Sampling settings of the rollout engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// Softmax temperature (> 0).
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Longest response, in tokens.
    pub max_new_tokens: usize,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 8,
        }
    }
}

/// The routing decisions of one sequence (the model's type): for every MoE layer, the top-k
/// expert ids **in order** and their combine weights of every position fed to the model
/// (`prompt + response[..len-1]`).
pub use mxrl_model::RoutingTrace;

/// A captured trace as the loop carries it: `None` for a model without MoE layers.
pub(crate) fn routed(t: RoutingTrace) -> Option<RoutingTrace> {
    (!t.layers.is_empty()).then_some(t)
}

/// The traces a batch replays: `None` unless every sequence carries one.
pub(crate) fn replay_of(batch: &[TrainSeq<'_>]) -> Option<Vec<RoutingTrace>> {
    batch
        .iter()
        .map(|s| s.replay.cloned())
        .collect::<Option<Vec<_>>>()
        .filter(|r| !r.is_empty())
}

/// Per-layer hidden-state probes of one sequence: `[layer][position][hidden]` flattened, the
/// residual stream after each layer, for the positions of the response tokens' predictions.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LayerProbes {
    /// Layers probed.
    pub layers: usize,
    /// Width of one probe vector.
    pub width: usize,
    /// Values, `[layer][position][width]`.
    pub values: Vec<f32>,
}

/// One generated response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index of the prompt in the batch.
    pub prompt_index: usize,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Response token ids (including the end-of-sequence token when sampled).
    pub response: Vec<u32>,
    /// Rollout logprob of each response token under the rollout's weights.
    pub logprobs: Vec<f32>,
    /// Routing decisions of the rollout (MoE models).
    pub routing: Option<RoutingTrace>,
    /// Per-layer hidden-state probes of the rollout.
    pub probes: Option<LayerProbes>,
}

/// What the trainer is given for one sequence.
#[derive(Debug, Clone, Copy)]
pub struct TrainSeq<'a> {
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Response token ids (their logprobs are computed).
    pub response: &'a [u32],
    /// Routing to replay, when routing replay is on.
    pub replay: Option<&'a RoutingTrace>,
}

/// The training forward's outputs for one sequence.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrainForward {
    /// logprob of every response token.
    pub logprobs: Vec<f32>,
    /// Entropy of the tempered next-token distribution at every response position.
    pub entropy: Vec<f32>,
    /// The routing the model itself would choose (for the routing-agreement metric), MoE only.
    pub routing: Option<RoutingTrace>,
    /// Per-layer probes, same layout as the rollout's.
    pub probes: Option<LayerProbes>,
}

/// One sequence re-scored by the rollout ([`RolloutPolicy::score_with_probes`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scored {
    /// logprob of every response token.
    pub logprobs: Vec<f32>,
    /// Per-layer probes from the same forward, when the policy has them.
    pub probes: Option<LayerProbes>,
}

/// A trainable parameter as the optimizer sees it.
#[derive(Debug)]
pub struct ParamMut<'a> {
    /// Stable name (checkpoint key).
    pub name: &'a str,
    /// f32 master values.
    pub value: &'a mut [f32],
    /// Accumulated gradient (same length).
    pub grad: &'a mut [f32],
    /// The format this tensor is stored in by the plan (weight decay is 0 for low-precision
    /// weights).
    pub format: Format,
}

/// One tensor of a weight update, already in the plan's storage format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    /// Tensor name.
    pub name: String,
    /// Storage format.
    pub format: Format,
    /// Logical shape `[rows, cols]` (cols = K, the contraction dim).
    pub shape: Vec<usize>,
    /// Element data (BF16 little-endian bytes, E4M3 bytes, packed E2M1 nibbles).
    pub data: Vec<u8>,
    /// Block scales (empty for BF16).
    pub scales: Vec<u8>,
    /// Second-level f32 scales / amax (NVFP4), empty otherwise.
    pub amax: Vec<f32>,
}

impl WireTensor {
    /// Bytes this tensor occupies on the wire (data + scales + amax).
    pub fn byte_len(&self) -> usize {
        self.data.len() + self.scales.len() + 4 * self.amax.len()
    }
}

/// A weight update that stays where the weights live (one process, one device): what a
/// trainer's [`TrainPolicy::local_export`] hands to the rollout's [`RolloutPolicy::load_local`].
/// Its payload is the trainer's own type; a rollout that does not know it leaves it and the
/// loop falls back to the wire form ([`TrainPolicy::export_weights`]).
pub struct LocalExport {
    /// Bytes the update carries.
    pub bytes: u64,
    /// Tensors it carries.
    pub tensors: usize,
    payload: Option<Box<dyn std::any::Any>>,
}

impl std::fmt::Debug for LocalExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LocalExport({} tensors, {} bytes)",
            self.tensors, self.bytes
        )
    }
}

impl LocalExport {
    /// An update of `tensors` tensors and `bytes` bytes held in `payload`.
    pub fn new(bytes: u64, tensors: usize, payload: Box<dyn std::any::Any>) -> Self {
        LocalExport {
            bytes,
            tensors,
            payload: Some(payload),
        }
    }

    /// Takes the payload if it is a `T` (and leaves it otherwise).
    pub fn take<T: 'static>(&mut self) -> Option<Box<T>> {
        match self.payload.take()?.downcast::<T>() {
            Ok(t) => Some(t),
            Err(other) => {
                self.payload = Some(other);
                None
            }
        }
    }
}

/// Errors a policy can report.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A weight update does not match the model's tensors.
    #[error("weight update: {0}")]
    Update(String),
    /// A shape or input was invalid.
    #[error("{0}")]
    Invalid(String),
    /// The model backend failed.
    #[error("model: {0}")]
    Backend(String),
}

/// The sampling side of the loop.
pub trait RolloutPolicy {
    /// Generate `n` samples for each prompt. Sample `j` of prompt `i` draws its randomness from
    /// `seed`, `i` and `j` only, so the same call gives the same tokens.
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<Vec<Sample>, PolicyError>;

    /// Replace all weights with `tensors` atomically: validate every tensor (names, formats,
    /// shapes, byte lengths) first; on any error nothing changes.
    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError>;

    /// The weights as held now, in wire form (for `--check-weight-sync`).
    fn weights(&self) -> Vec<WireTensor>;

    /// [`RolloutPolicy::load_weights`] for weight `version` (the rollout engine calls this).
    /// A policy that lives elsewhere (the rollout server's client,
    /// [`crate::server::RemoteRollout`]) forwards the version; the default ignores it.
    fn load_weights_versioned(
        &mut self,
        version: u64,
        tensors: &[WireTensor],
    ) -> Result<(), PolicyError> {
        let _ = version;
        self.load_weights(tensors)
    }

    /// Has `update` — bucketed and checksummed ([`crate::sync::WeightUpdate`]), its contract
    /// hash and version already checked by the rollout engine — verified and applied where
    /// the weights live, atomically. `None` (the default): the policy takes tensors; the
    /// rollout engine verifies and decodes the update itself and calls
    /// [`RolloutPolicy::load_weights_versioned`]. A remote policy
    /// ([`crate::server::RemoteRollout`]) sends the buckets as they are, so an update is
    /// encoded and hashed once on the sending side.
    fn load_update(
        &mut self,
        update: &crate::sync::WeightUpdate,
    ) -> Option<Result<(), PolicyError>> {
        let _ = update;
        None
    }

    /// Installs a weight update that stayed on the device ([`LocalExport`]) as `version`,
    /// verified and atomic like [`RolloutPolicy::load_weights`]. `None`: this policy does not
    /// take the exporter's kind (the default); the loop then sends the wire form.
    fn load_local(
        &mut self,
        version: u64,
        update: &mut LocalExport,
    ) -> Option<Result<(), PolicyError>> {
        let _ = (version, update);
        None
    }

    /// `--check-weight-sync`: the held weights equal `expected` byte for byte. The default
    /// compares [`RolloutPolicy::weights`] with [`crate::sync::check_equal`]; a remote policy
    /// compares SHA-256 digests computed where the weights live.
    fn check_weights(&self, expected: &[WireTensor]) -> Result<(), crate::sync::SyncError> {
        crate::sync::check_equal(&self.weights(), expected)
    }

    /// Bitwise mode: logprobs of the response tokens computed with exactly the trainer's
    /// forward (same kernels, same batch shapes as the trainer's micro-batch `batch`).
    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError>;

    /// For how many samples, from the first, [`RolloutPolicy::generate`] should record the
    /// per-layer probes ([`Sample::probes`]; the loop asks for [`crate::runner::PROBE_SEQUENCES`]
    /// for the `hidden_diff` metric; 0: none). A device engine records them only when asked
    /// (they cost device memory and a download); a policy whose probes cost little may ignore
    /// it and record more (the loop drops those past the count; the default does nothing).
    fn set_probes(&mut self, sequences: usize) {
        let _ = sequences;
    }

    /// Whether [`RolloutPolicy::generate`] must record each sample's routing decisions
    /// ([`Sample::routing`]; the loop needs them for routing replay). A policy may record
    /// them anyway (the default does nothing).
    fn set_routes(&mut self, on: bool) {
        let _ = on;
    }

    /// Where the last [`RolloutPolicy::generate`] call's time went (prefill, decode steps,
    /// read-back), when the policy measures it (the device engine does; the default: `None`).
    fn last_timing(&self) -> Option<GenTiming> {
        None
    }

    /// [`RolloutPolicy::score`] that also returns each sequence's per-layer probes from the
    /// same forward, so bitwise mode compares hidden states computed like the trainer's. The
    /// default gives no probes (the generation's probes are kept).
    fn score_with_probes(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Scored>, PolicyError> {
        Ok(self
            .score(batch, temperature)?
            .into_iter()
            .map(|logprobs| Scored {
                logprobs,
                probes: None,
            })
            .collect())
    }
}

/// The learning side of the loop.
pub trait TrainPolicy {
    /// Forward a micro-batch, keeping what [`TrainPolicy::backward`] needs.
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError>;

    /// Accumulate parameter gradients of `Σ dlogp[s][t] · logprob[s][t]` for the micro-batch of
    /// the last forward.
    fn backward(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError>;

    /// [`TrainPolicy::backward`] of the last micro-batch before
    /// [`TrainPolicy::optimizer_step`]: a trainer may start that step's work on gradients
    /// that are final (the device engine's gradient norm, layer by layer). Same result as
    /// `backward`, which it defaults to.
    fn backward_last(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        self.backward(dlogp)
    }

    /// Named parameters with their gradients.
    fn params(&mut self) -> Vec<ParamMut<'_>>;

    /// Set every gradient to zero.
    fn zero_grad(&mut self) {
        for p in self.params() {
            p.grad.fill(0.0);
        }
    }

    /// Bring the weights the forward multiplies (and [`TrainPolicy::export_weights`] ships) up
    /// to date after the parameters were changed through [`TrainPolicy::params`]: a quantizing
    /// policy quantizes them here, once per weight version. The loop calls it before every
    /// export; the default does nothing.
    fn refresh_weights(&mut self) -> Result<(), PolicyError> {
        Ok(())
    }

    /// The weights quantized by the plan, in the rollout's layout (the bytes a weight update
    /// ships). Must use the same quantizer as checkpoint conversion. A policy whose parameters
    /// changed since its last [`TrainPolicy::refresh_weights`] may refuse.
    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError>;

    /// One optimizer step taken where the parameters live (a device engine keeps weights,
    /// gradients and moments on the device): clip to `cfg.max_grad_norm`, AdamW step number
    /// `step` (≥ 1); returns the gradient norm before clipping. `None`: the policy leaves the
    /// step to the loop's [`crate::optim::AdamW`] over [`TrainPolicy::params`] (the default).
    fn optimizer_step(
        &mut self,
        cfg: &crate::optim::AdamWConfig,
        step: u64,
    ) -> Option<Result<f64, PolicyError>> {
        let _ = (cfg, step);
        None
    }

    /// The AdamW moments by parameter name when the policy holds them itself (it takes its own
    /// [`TrainPolicy::optimizer_step`]); `None` otherwise (the default).
    fn optimizer_moments(
        &mut self,
    ) -> Option<Result<std::collections::BTreeMap<String, crate::optim::Moments>, PolicyError>>
    {
        None
    }

    /// Restores moments saved from [`TrainPolicy::optimizer_moments`] and the AdamW step count;
    /// `Ok(false)`: the policy holds no optimizer state (the default), the loop keeps it.
    fn set_optimizer_state(
        &mut self,
        step: u64,
        moments: &std::collections::BTreeMap<String, crate::optim::Moments>,
    ) -> Result<bool, PolicyError> {
        let _ = (step, moments);
        Ok(false)
    }

    /// Adds `coef ·` the MoE auxiliary load-balancing loss to what
    /// [`TrainPolicy::backward`] differentiates (HF `load_balancing_loss_func` over the MoE
    /// layers of each forward); 0 adds none. The default accepts only 0 (a policy without
    /// MoE routers).
    fn set_aux_loss_coef(&mut self, coef: f32) -> Result<(), PolicyError> {
        if coef == 0.0 {
            Ok(())
        } else {
            Err(PolicyError::Invalid(format!(
                "aux loss coefficient {coef}: this policy has no MoE router"
            )))
        }
    }

    /// The auxiliary load-balancing loss (not multiplied by the coefficient) of the forward
    /// whose [`TrainPolicy::backward`] ran last, when that backward added it (a non-zero
    /// [`TrainPolicy::set_aux_loss_coef`]); `None` otherwise (the default).
    fn last_aux_loss(&self) -> Result<Option<f64>, PolicyError> {
        Ok(None)
    }

    /// Whether [`TrainPolicy::forward`] should return per-layer probes (the loop turns them
    /// off when nothing will be compared with them: no bitwise re-scoring, or the frozen
    /// reference). A policy whose probes cost nothing may ignore it (the default does).
    fn set_probes(&mut self, on: bool) {
        let _ = on;
    }

    /// The weight update as it stays on the device, for a rollout in the same process
    /// ([`RolloutPolicy::load_local`]); `None` (the default): only the wire form exists.
    fn local_export(&mut self) -> Option<Result<LocalExport, PolicyError>> {
        None
    }

    /// The first non-finite weight (`name[index] = value`), if any. The default scans
    /// [`TrainPolicy::params`].
    fn first_non_finite_weight(&mut self) -> Option<String> {
        self.params().iter().find_map(|p| {
            p.value
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| format!("weight {}[{i}] = {}", p.name, p.value[i]))
        })
    }
}

/// A boxed rollout policy is one (the commands pick the model backend at run time).
impl<P: RolloutPolicy + ?Sized> RolloutPolicy for Box<P> {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        cfg: &SamplingConfig,
        eos: u32,
        seed: u64,
    ) -> Result<Vec<Sample>, PolicyError> {
        (**self).generate(prompts, n, cfg, eos, seed)
    }
    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        (**self).load_weights(tensors)
    }
    fn weights(&self) -> Vec<WireTensor> {
        (**self).weights()
    }
    fn load_weights_versioned(
        &mut self,
        version: u64,
        tensors: &[WireTensor],
    ) -> Result<(), PolicyError> {
        (**self).load_weights_versioned(version, tensors)
    }
    fn check_weights(&self, expected: &[WireTensor]) -> Result<(), crate::sync::SyncError> {
        (**self).check_weights(expected)
    }
    fn load_update(
        &mut self,
        update: &crate::sync::WeightUpdate,
    ) -> Option<Result<(), PolicyError>> {
        (**self).load_update(update)
    }
    fn load_local(
        &mut self,
        version: u64,
        update: &mut LocalExport,
    ) -> Option<Result<(), PolicyError>> {
        (**self).load_local(version, update)
    }
    fn score(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, PolicyError> {
        (**self).score(batch, temperature)
    }
    fn score_with_probes(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<Scored>, PolicyError> {
        (**self).score_with_probes(batch, temperature)
    }
    fn set_probes(&mut self, sequences: usize) {
        (**self).set_probes(sequences)
    }
    fn set_routes(&mut self, on: bool) {
        (**self).set_routes(on)
    }
    fn last_timing(&self) -> Option<GenTiming> {
        (**self).last_timing()
    }
}

/// A boxed trainer is one (the commands pick the model backend at run time).
impl<P: TrainPolicy + ?Sized> TrainPolicy for Box<P> {
    fn forward(
        &mut self,
        batch: &[TrainSeq<'_>],
        temperature: f32,
    ) -> Result<Vec<TrainForward>, PolicyError> {
        (**self).forward(batch, temperature)
    }
    fn backward(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        (**self).backward(dlogp)
    }
    fn backward_last(&mut self, dlogp: &[Vec<f32>]) -> Result<(), PolicyError> {
        (**self).backward_last(dlogp)
    }
    fn set_aux_loss_coef(&mut self, coef: f32) -> Result<(), PolicyError> {
        (**self).set_aux_loss_coef(coef)
    }
    fn last_aux_loss(&self) -> Result<Option<f64>, PolicyError> {
        (**self).last_aux_loss()
    }
    fn params(&mut self) -> Vec<ParamMut<'_>> {
        (**self).params()
    }
    fn zero_grad(&mut self) {
        (**self).zero_grad()
    }
    fn refresh_weights(&mut self) -> Result<(), PolicyError> {
        (**self).refresh_weights()
    }
    fn export_weights(&self) -> Result<Vec<WireTensor>, PolicyError> {
        (**self).export_weights()
    }
    fn optimizer_step(
        &mut self,
        cfg: &crate::optim::AdamWConfig,
        step: u64,
    ) -> Option<Result<f64, PolicyError>> {
        (**self).optimizer_step(cfg, step)
    }
    fn optimizer_moments(
        &mut self,
    ) -> Option<Result<std::collections::BTreeMap<String, crate::optim::Moments>, PolicyError>>
    {
        (**self).optimizer_moments()
    }
    fn set_optimizer_state(
        &mut self,
        step: u64,
        moments: &std::collections::BTreeMap<String, crate::optim::Moments>,
    ) -> Result<bool, PolicyError> {
        (**self).set_optimizer_state(step, moments)
    }
    fn first_non_finite_weight(&mut self) -> Option<String> {
        (**self).first_non_finite_weight()
    }
    fn local_export(&mut self) -> Option<Result<LocalExport, PolicyError>> {
        (**self).local_export()
    }
    fn set_probes(&mut self, on: bool) {
        (**self).set_probes(on)
    }
}

/// The gradient rows of whole sequences from those of their responses: `resp_lens[s] = (t, r)`
/// (sequence and response lengths), `t − r` zeros (the prompt) before each response's row.
pub(crate) fn full_sequence_grads(
    dlogp: &[Vec<f32>],
    resp_lens: &[(usize, usize)],
) -> Vec<Vec<f32>> {
    dlogp
        .iter()
        .zip(resp_lens)
        .map(|(d, &(t, r))| {
            let mut v = vec![0.0f32; t - r];
            v.extend_from_slice(d);
            v
        })
        .collect()
}
