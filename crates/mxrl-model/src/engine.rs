//! The MoE transformer written once over a device's op set ([`Backend`]): blocks with their
//! weights on the device, a device-resident forward (per-token logprobs) and batched decode
//! over a preallocated BF16 KV cache.
//!
//! ```text
//! x = embed(tokens)
//! for layer: x += attention(rmsnorm(x)); x += ffn(rmsnorm(x))     (ffn: MoeBlock | DenseMlp)
//! logprob = log_softmax(lm_head(rmsnorm(x)) / τ)[target]
//! ```
//!
//! Numerics: a linear multiplies BF16 operands with f32 accumulation (the products of
//! [`LinearPrecision::Bf16`](crate::LinearPrecision::Bf16)), or, where a precision plan stores it
//! in MXFP8 / NVFP4 / FP8-block ([`Engine::apply_plan`]), its stored quantized weight with the
//! activations quantized per forward from the f32 rows and the plan's backward mode (the products of
//! [`LinearPrecision::Quantized`](crate::LinearPrecision::Quantized)); the residual stream,
//! norms, softmax, router and loss are f32; the KV cache is BF16. On [`CpuBackend`] each op is
//! the CPU model's own function, so [`Engine`] on the CPU reproduces [`Model`] with the same
//! linear precisions (bitwise for the forward, backward and AdamW; decode differs only by the
//! BF16 KV cache). A GPU backend runs the same definition; only summation orders differ.

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{Model, RoutingTrace, SeqInput};
use mxrl_formats::QuantizedTensor;
use mxrl_tensor::attention::AttnShape;
use mxrl_tensor::device::{
    AdamWUpdate, Backend, CpuBackend, DecodeAttnOut, DeviceError, GradWrite, OutGrad, RouteBufs,
    SavedX, StoredLayout,
};
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec, PreparedWeight};
use mxrl_tensor::sample::SampleParams;
use mxrl_tensor::SeqLayout;
use std::borrow::Cow;

/// A layer's normalized rows: f32 (for block-format linears) and/or BF16 (for BF16 ones).
type NormRows<B> = (Option<<B as Backend>::F32>, Option<<B as Backend>::Bf16>);

/// Rows a layer made only where a reader needs them, asked for by such a reader.
fn rows_made<'a, T>(rows: Option<&'a T>, what: &str) -> Result<&'a T> {
    rows.ok_or_else(|| ModelError::Input(format!("{what} was not made (internal)")))
}

/// The host expert offsets of a taped forward (downloaded for every pass outside decode).
fn taped_offsets(ho: Option<&[u32]>) -> Result<&[u32]> {
    ho.ok_or_else(|| ModelError::Input("a taped forward without host expert offsets".into()))
}

fn dev(e: DeviceError) -> ModelError {
    ModelError::Device(e.to_string())
}

/// One parameter on the device: f32 master values and, for a linear weight, its BF16 GEMM
/// operand (refreshed by every optimizer step).
struct Param<B: Backend> {
    name: String,
    /// Shape as the engine holds it (routed experts stacked: `[E·rows, cols]`).
    shape: Vec<usize>,
    len: usize,
    /// The f32 master; `None` once [`Engine::drop_masters`] freed it (the forward reads the
    /// BF16 operand, BF16 value or stored weights instead).
    master: Option<B::F32>,
    op: Option<B::Bf16>,
    /// With BF16 parameters ([`Engine::use_bf16_params`]): the BF16 value of a parameter
    /// without a GEMM operand (norms, biases, an untied embedding), as f32; the forward reads
    /// it instead of the master.
    compute: Option<B::F32>,
    /// Weight decay applies (linear and embedding weights; not norms and biases).
    decay: bool,
    /// A linear in a block format: the stored quantized weights the forward multiplies
    /// (rebuilt from the master by every optimizer step).
    q: Option<QParam<B>>,
}

impl<B: Backend> Param<B> {
    /// The f32 master, or an error naming the parameter once [`Engine::drop_masters`] freed it.
    fn master(&self) -> Result<&B::F32> {
        self.master.as_ref().ok_or_else(|| no_master(&self.name))
    }

    /// What the forward reads as f32 values: the BF16 value where there is one, else the
    /// master.
    fn value_f32(&self) -> Result<&B::F32> {
        match &self.compute {
            Some(c) => Ok(c),
            None => self.master(),
        }
    }
}

/// The error of a call that needs a master [`Engine::drop_masters`] freed.
fn no_master(name: &str) -> ModelError {
    ModelError::BadTensor {
        name: name.into(),
        message: "this engine only samples and scores (its f32 masters were freed by \
                  drop_masters): it has no master to read, train or re-quantize; new weights \
                  come in as a weight update"
            .into(),
    }
}

/// A linear weight in a block format: `groups` weights `[n, k]` (the routed experts of a
/// layer, or one dense linear) as stored, with the spec they were quantized for.
struct QParam<B: Backend> {
    spec: LinearSpec,
    groups: usize,
    n: usize,
    k: usize,
    w: B::QExperts,
}

impl<B: Backend> QParam<B> {
    /// Stored bytes (codes, scales, amax).
    fn bytes(&self) -> usize {
        self.groups * self.spec.format().stored_bytes(self.n, self.k)
    }
}

/// Attention block: `q/k/v/o` weights, optional q/k/v biases and per-head q/k norms.
struct Attention {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    bias: Option<[usize; 3]>,
    qk_norm: Option<[usize; 2]>,
}

/// SwiGLU MLP of a dense layer: fused gate/up `[2F, H]` and down `[H, F]`.
struct DenseMlp {
    gate_up: usize,
    down: usize,
    f: usize,
}

/// Routed experts of an MoE layer: router `[E, H]`, stacked gate/up `[E, 2F, H]` and down
/// `[E, H, F]`.
struct MoeBlock {
    router: usize,
    gate_up: usize,
    down: usize,
    f: usize,
}

enum Ffn {
    Dense(DenseMlp),
    Moe(MoeBlock),
}

struct Layer {
    ln1: usize,
    attn: Attention,
    ln2: usize,
    ffn: Ffn,
    /// The indices of this layer's parameters (every one of them, contiguous).
    params: std::ops::Range<usize>,
}

/// The per-head q/k norms' inputs and reciprocal RMS: `(q_pre, rstd_q, k_pre, rstd_k)`.
type QkNormTape<B> = (
    <B as Backend>::F32,
    <B as Backend>::F32,
    <B as Backend>::F32,
    <B as Backend>::F32,
);

/// A checked, packed batch: layout, tokens, targets, positions.
type Packed = (SeqLayout, Vec<u32>, Vec<u32>, Vec<u32>);

/// What a training forward keeps of one layer for backward (all on the device).
struct LayerTape<B: Backend> {
    x_in: B::F32,
    rstd1: B::F32,
    /// The BF16 normalized rows; `None` where every q/k/v linear takes the f32 rows.
    h1b: Option<B::Bf16>,
    q_pre: Option<QkNormTape<B>>,
    q: B::F32,
    k: B::F32,
    v: B::F32,
    att: B::F32,
    lse: B::F32,
    /// The BF16 attention output; `None` where the o linear takes the f32 rows.
    attb: Option<B::Bf16>,
    x_mid: B::F32,
    rstd2: B::F32,
    /// The f32 normalized rows, kept where a block-format linear quantizes them.
    h1: Option<B::F32>,
    h2: Option<B::F32>,
    /// The BF16 normalized rows of the FFN; `None` where only block-format linears read them.
    h2b: Option<B::Bf16>,
    ffn: FfnTape<B>,
}

enum FfnTape<B: Backend> {
    Dense {
        gu: B::F32,
        act: Act<B>,
    },
    Moe {
        route: RouteBufs<B>,
        /// The expert offsets on the host (outside decode).
        host_offsets: Option<Vec<u32>>,
        /// The gathered input rows; `None` without a tape (no backward).
        xg: Option<Act<B>>,
        gu: B::F32,
        act: Act<B>,
        y: B::F32,
    },
}

/// The input rows of a linear as its backward needs them: the BF16 operand of a BF16
/// linear, the f32 rows a block-format linear quantizes, or the activation operand a
/// block-format forward multiplied where the backend keeps it for the backward
/// ([`Backend::keeps_forward_operand`]).
enum Act<B: Backend> {
    Bf16(B::Bf16),
    F32(B::F32),
    Operand(B::Bf16),
}

impl<B: Backend> Act<B> {
    fn r(&self) -> ActRef<'_, B> {
        match self {
            Act::Bf16(x) => ActRef::Bf16(x),
            Act::F32(x) => ActRef::F32(x),
            Act::Operand(x) => ActRef::Operand(x),
        }
    }
}

/// A borrowed [`Act`].
enum ActRef<'a, B: Backend> {
    Bf16(&'a B::Bf16),
    F32(&'a B::F32),
    Operand(&'a B::Bf16),
}

impl<B: Backend> Clone for ActRef<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for ActRef<'_, B> {}

/// Activations of a training forward ([`Engine::forward_train`]), consumed by
/// [`Engine::backward`]; device buffers only.
pub struct Tape<B: Backend> {
    layout: SeqLayout,
    tokens: Vec<u32>,
    tokens_dev: B::U32,
    targets: B::U32,
    offsets: B::U32,
    pos: B::U32,
    temperature: f32,
    layers: Vec<LayerTape<B>>,
    x_final: B::F32,
    rstd_final: B::F32,
    hfb: B::Bf16,
    lse: B::F32,
    /// Entropy of every position's tempered next-token distribution.
    entropy: B::F32,
    /// The number of probed rows `P` and, per layer, the residual stream after it at those
    /// rows `[P, H]` (when asked).
    probes: (usize, Vec<B::F32>),
}

/// A Qwen3-MoE / Qwen2-MoE (without shared experts) model on one device: every parameter,
/// gradient and optimizer moment lives there.
pub struct Engine<B: Backend> {
    b: B,
    cfg: ModelConfig,
    params: Vec<Param<B>>,
    embed: usize,
    head: usize,
    norm: usize,
    layers: Vec<Layer>,
    rope: B::Rope,
    max_pos: usize,
    train: Option<TrainState<B>>,
    /// Record decode steps as device graphs and replay them ([`Engine::set_decode_graphs`]).
    graphs: bool,
    /// Prefill a prompt that several slots decode once ([`Engine::set_shared_prefill`]).
    shared_prefill: bool,
    /// Coefficient of the auxiliary load-balancing loss in the backward
    /// ([`Engine::set_aux_loss_coef`]; 0: none).
    aux_coef: f32,
}

/// Gradients, AdamW moments and the step count (allocated by [`Engine::enable_training`]).
struct TrainState<B: Backend> {
    /// The gradient norm begun by [`Engine::backward_last`] (its layers' buffers handed in as
    /// each became final); dropped by anything that writes a gradient after it. Declared
    /// first so that it is dropped first: a device finishes its reads of the gradients
    /// before their buffers are freed.
    norm_parts: Option<B::NormParts>,
    grads: Vec<B::F32>,
    /// Per parameter: zeroed by [`Engine::zero_grads`] but not yet written, its buffer's
    /// contents unspecified (the routed experts' wgrad overwrites instead of accumulating, so
    /// their zeroing costs no pass over the buffer); every reader settles it first.
    pending_zero: Vec<bool>,
    m: Vec<B::F32>,
    v: Vec<B::F32>,
    step: u64,
    /// The auxiliary load-balancing loss of the last backward (`[1]`, unscaled by the
    /// coefficient), when it had one ([`Engine::last_aux_loss`]).
    aux_loss: Option<B::F32>,
}

/// One parameter of a device-resident weight update ([`Engine::export_device`]).
pub enum DeviceTensor<B: Backend> {
    /// BF16 values.
    Bf16(B::Bf16),
    /// The stored weights of a block-format linear.
    Stored(B::QExperts),
}

/// One parameter of a weight update received on the host ([`Engine::install_host`]).
#[derive(Debug, Clone)]
pub enum HostTensor<'a> {
    /// BF16 values, little-endian bytes.
    Bf16(&'a [u8]),
    /// The stored weights of a block-format linear, one per group (routed expert).
    Stored(Vec<mxrl_tensor::device::StoredBytes<'a>>),
}

/// A batch being decoded: BF16 KV caches `[slots, max_len, Hkv·D]` per layer, the current
/// length of every sequence, and the step's device buffers (token ids, positions and lengths
/// going up; logits, sampled ids and logprobs). After one plain step, a device with graphs
/// records the step (embedding → layers → head) once and replays it for every later step:
/// the kernels read positions and lengths from the device, so one recording serves every
/// length up to `max_len`.
pub struct DecodeState<B: Backend> {
    k: Vec<B::Bf16>,
    v: Vec<B::Bf16>,
    lens: Vec<u32>,
    max_len: usize,
    io: StepIo<B>,
    /// Per layer, the routes of every fed position `[max_len, slots, k]` (ids, weights), for
    /// MoE layers when routes are captured ([`Engine::generate_capturing`]); else empty.
    routes: Vec<Option<(B::U32, B::F32)>>,
    /// The per-layer probes when they are recorded ([`Record::probes`]).
    probes: Option<ProbeTable<B>>,
    /// Prompt tokens its prefill ran ([`GenTiming::prefill_tokens`]).
    prefilled: usize,
}

/// The probes a generation records on the device: per layer, the residual stream after the
/// layer at the response-predicting positions of the first `slots` sequences, `[len, slots,
/// H]` (index-major: the read-back takes only the indices the longest response reached);
/// position `p` of slot `s` goes to index `p − first[s]` (`first[s]` = the prompt's last
/// position, which predicts the first new token).
struct ProbeTable<B: Backend> {
    first: B::U32,
    slots: usize,
    len: usize,
    layers: Vec<B::F32>,
}

/// What [`Engine::generate_recording`] records on the device besides the sampled tokens
/// (each costs device memory, so only what a caller reads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The routes of every position fed to the model (MoE layers): `[slots, max_len, k]` ids
    /// and weights per MoE layer.
    pub routes: bool,
    /// The residual stream after every layer at the positions that predict the new tokens,
    /// for the first `probes` sequences (0: none): `[probes, new_tokens, H]` f32 per layer.
    pub probes: usize,
}

/// Where one [`Engine::generate_timed`] call's wall time went (s). Each phase ends when its
/// results are on the host (the sampled ids are read back after every step), so the phases
/// add up to the call's time without extra synchronisation.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenTiming {
    /// Prefill of every prompt up to the first sampled tokens.
    pub prefill_s: f64,
    /// The decode steps after it.
    pub decode_s: f64,
    /// Decode steps run.
    pub decode_steps: u64,
    /// Reading back what was recorded (routes, probes).
    pub readback_s: f64,
    /// Prompt tokens the prefill ran: every distinct prompt's once with a shared prefill
    /// ([`Engine::set_shared_prefill`]), else every slot's.
    #[serde(default)]
    pub prefill_tokens: u64,
}

/// One sequence of [`Engine::generate_recording`].
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    /// The sampled tokens and their logprobs.
    pub sampled: Sampled,
    /// The routes of every fed position (the prompt and every new token but the last), when
    /// recorded.
    pub routes: Option<RoutingTrace>,
    /// When recorded, `[L, R, H]` row-major (`L` layers, `R` new tokens): after each layer,
    /// the residual stream at the positions that predict the new tokens (the prompt's last
    /// position, then every new token but the last), as the KV-cache decode computed it.
    pub probes: Option<Vec<f32>>,
}

/// The persistent buffers of one decode step of `batch` rows.
struct StepIo<B: Backend> {
    tokens: B::U32,
    pos: B::U32,
    lens: B::U32,
    logits: B::F32,
    ids: B::U32,
    lps: B::F32,
    graph: GraphState<B>,
    plain_steps: u64,
}

enum GraphState<B: Backend> {
    /// Not recorded yet.
    None,
    /// Recorded; replayed every step.
    Ready(B::Graph),
    /// Recording failed (the reason); steps run op by op.
    Failed(String),
}

impl<B: Backend> DecodeState<B> {
    /// Tokens held by every sequence.
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    /// Positions each sequence's cache holds room for.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Whether decode steps replay a recorded device graph (`None`: not recorded yet, or
    /// the backend has no graphs) and, if recording failed, why.
    pub fn graph_status(&self) -> (bool, Option<&str>) {
        match &self.io.graph {
            GraphState::Ready(_) => (true, None),
            GraphState::Failed(why) => (false, Some(why)),
            GraphState::None => (false, None),
        }
    }
}

/// One parameter in BF16 ([`Engine::weights_bf16`]): name, shape, bit patterns.
pub type Bf16Param = (String, Vec<usize>, Vec<u16>);

/// The tokens and logprobs [`Engine::generate`] sampled for one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// New tokens (ending with a stop token when one was sampled).
    pub tokens: Vec<u32>,
    /// Logprob of each new token under the full tempered distribution (temperature 1 when
    /// greedy), as [`crate::Generation::logprobs`].
    pub logprobs: Vec<f32>,
}

impl<B: Backend> Engine<B> {
    /// Uploads `model`'s weights to backend `b` (BF16 copies of the linear weights, f32
    /// embeddings and norms). `max_pos`: the longest sequence it will run (RoPE table size).
    ///
    /// # Errors
    /// A shared expert (not supported by the engine yet), or a device failure.
    pub fn from_model(model: &Model, b: B, max_pos: usize) -> Result<Self> {
        let ps = model.params();
        Self::build(model.config().clone(), b, max_pos, |name, _| {
            ps.by_name(name)
                .map(|p| Cow::Borrowed(p.data.as_slice()))
                .ok_or_else(|| ModelError::BadTensor {
                    name: name.into(),
                    message: "missing from the model".into(),
                })
        })
    }

    /// Random weights generated tensor by tensor (HF init: linear and embedding weights
    /// `N(0, initializer_range²)`, norms 1, biases 0) from a counter-based generator, so
    /// no full f32 copy of the model exists on the host; same seed → same weights. Meant for
    /// benchmarks at real width.
    ///
    /// # Errors
    /// As [`Engine::build`].
    pub fn random(cfg: &ModelConfig, b: B, max_pos: usize, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let std = cfg.initializer_range;
        let mut counter = 0u64;
        Self::build(cfg.clone(), b, max_pos, |name, shape| {
            let n: usize = shape.iter().product();
            counter += 1;
            Ok(Cow::Owned(if name.contains("norm") {
                vec![1.0; n]
            } else if name.ends_with("bias") {
                vec![0.0; n]
            } else {
                normal_values(n, seed ^ counter.wrapping_mul(0x9E37_79B9_7F4A_7C15), std)
            }))
        })
    }

    /// Builds the device weights from a source of f32 tensors by HF name and shape, borrowed
    /// where the source holds them (a [`Model`]'s parameters are uploaded from their own
    /// memory) or made for the call (routed experts are read per expert and stacked on the
    /// host one layer at a time).
    ///
    /// # Errors
    /// A shared expert (not supported by the engine yet), a source error, a device failure.
    pub fn build<'s>(
        cfg: ModelConfig,
        b: B,
        max_pos: usize,
        mut src: impl FnMut(&str, &[usize]) -> Result<Cow<'s, [f32]>>,
    ) -> Result<Self> {
        Self::build_from(cfg, b, max_pos, Some(&mut src))
    }

    /// An engine of `cfg`'s shape whose every parameter is zero, made on the device without
    /// host values: for an engine whose weights are installed next (a rollout that takes the
    /// trainer's weights), so the model is not uploaded for nothing.
    ///
    /// # Errors
    /// As [`Engine::build`].
    pub fn zeroed(cfg: &ModelConfig, b: B, max_pos: usize) -> Result<Self> {
        cfg.validate()?;
        Self::build_from(cfg.clone(), b, max_pos, None)
    }

    /// [`Engine::build`] from `src`, or with every parameter zero (`None`).
    #[allow(clippy::type_complexity)]
    fn build_from<'s>(
        cfg: ModelConfig,
        b: B,
        max_pos: usize,
        mut src: Option<&mut dyn FnMut(&str, &[usize]) -> Result<Cow<'s, [f32]>>>,
    ) -> Result<Self> {
        let zero = src.is_none();
        let mut src = |name: &str, shape: &[usize]| -> Result<Option<Cow<'s, [f32]>>> {
            match src.as_mut() {
                Some(f) => f(name, shape).map(Some),
                None => Ok(None),
            }
        };
        if cfg.shared_expert_intermediate_size > 0 {
            return Err(ModelError::Unsupported {
                origin: "device engine".into(),
                field: "shared_expert_intermediate_size",
                message: "the device engine does not run shared experts yet (Qwen2-MoE)".into(),
            });
        }
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let mut params: Vec<Param<B>> = Vec::new();
        // Uploads one parameter (`None`: zeros made on the device); `linear`: also its BF16
        // GEMM operand.
        let push = |params: &mut Vec<Param<B>>,
                    name: String,
                    shape: Vec<usize>,
                    vals: Option<&[f32]>,
                    linear: bool,
                    decay: bool|
         -> Result<usize> {
            let len: usize = shape.iter().product();
            if let Some(v) = vals.filter(|v| v.len() != len) {
                return Err(ModelError::BadTensor {
                    name,
                    message: format!("{} values for shape {shape:?} ({len} expected)", v.len()),
                });
            }
            let master = match vals {
                Some(v) => b.upload_f32(v).map_err(dev)?,
                None => b.zeros_f32(len).map_err(dev)?,
            };
            let op = if linear {
                let mut o = b.zeros_bf16(len).map_err(dev)?;
                if vals.is_some() {
                    b.to_bf16(&master, &mut o, len).map_err(dev)?;
                }
                Some(o)
            } else {
                None
            };
            params.push(Param {
                name,
                shape,
                len,
                master: Some(master),
                op,
                compute: None,
                decay,
                q: None,
            });
            Ok(params.len() - 1)
        };
        let v = cfg.vocab_size;
        let embed_vals = src("model.embed_tokens.weight", &[v, h])?;
        let embed = push(
            &mut params,
            "model.embed_tokens.weight".into(),
            vec![v, h],
            embed_vals.as_deref(),
            cfg.tie_word_embeddings,
            true,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let first = params.len();
            let mut one = |params: &mut Vec<Param<B>>,
                           name: String,
                           shape: &[usize],
                           linear: bool,
                           decay: bool|
             -> Result<usize> {
                let vals = src(&name, shape)?;
                push(params, name, shape.to_vec(), vals.as_deref(), linear, decay)
            };
            let ln1 = one(
                &mut params,
                format!("{p}.input_layernorm.weight"),
                &[h],
                false,
                false,
            )?;
            let q = one(
                &mut params,
                format!("{a}.q_proj.weight"),
                &[qd, h],
                true,
                true,
            )?;
            let k = one(
                &mut params,
                format!("{a}.k_proj.weight"),
                &[kvd, h],
                true,
                true,
            )?;
            let vv = one(
                &mut params,
                format!("{a}.v_proj.weight"),
                &[kvd, h],
                true,
                true,
            )?;
            let o = one(
                &mut params,
                format!("{a}.o_proj.weight"),
                &[h, qd],
                true,
                true,
            )?;
            let bias = if cfg.qkv_bias {
                Some([
                    one(&mut params, format!("{a}.q_proj.bias"), &[qd], false, false)?,
                    one(
                        &mut params,
                        format!("{a}.k_proj.bias"),
                        &[kvd],
                        false,
                        false,
                    )?,
                    one(
                        &mut params,
                        format!("{a}.v_proj.bias"),
                        &[kvd],
                        false,
                        false,
                    )?,
                ])
            } else {
                None
            };
            let qk_norm = match cfg.arch {
                Arch::Qwen3Moe => Some([
                    one(
                        &mut params,
                        format!("{a}.q_norm.weight"),
                        &[d],
                        false,
                        false,
                    )?,
                    one(
                        &mut params,
                        format!("{a}.k_norm.weight"),
                        &[d],
                        false,
                        false,
                    )?,
                ]),
                Arch::Qwen2Moe => None,
            };
            let ln2 = one(
                &mut params,
                format!("{p}.post_attention_layernorm.weight"),
                &[h],
                false,
                false,
            )?;
            let ffn = if cfg.is_moe_layer(l) {
                let (e, f) = (cfg.num_experts, cfg.moe_intermediate_size);
                let router = one(
                    &mut params,
                    format!("{p}.mlp.gate.weight"),
                    &[e, h],
                    true,
                    true,
                )?;
                // Every expert's weights stacked on the host, one layer at a time (none for a
                // zeroed engine).
                let mut stacked: Option<(Vec<f32>, Vec<f32>)> = None;
                if !zero {
                    let mut gu = Vec::with_capacity(e * 2 * f * h);
                    let mut dn = Vec::with_capacity(e * h * f);
                    for x in 0..e {
                        let name = format!("{p}.mlp.experts.{x}.gate_up_proj.weight");
                        if let Some(g) = src(&name, &[2 * f, h])? {
                            gu.extend_from_slice(&g);
                        }
                        let name = format!("{p}.mlp.experts.{x}.down_proj.weight");
                        if let Some(d) = src(&name, &[h, f])? {
                            dn.extend_from_slice(&d);
                        }
                    }
                    stacked = Some((gu, dn));
                }
                let gu = stacked.as_ref().map(|s| s.0.as_slice());
                let dn = stacked.as_ref().map(|s| s.1.as_slice());
                let gate_up = push(
                    &mut params,
                    format!("{p}.mlp.experts.*.gate_up_proj.weight"),
                    vec![e * 2 * f, h],
                    gu,
                    true,
                    true,
                )?;
                let down = push(
                    &mut params,
                    format!("{p}.mlp.experts.*.down_proj.weight"),
                    vec![e * h, f],
                    dn,
                    true,
                    true,
                )?;
                Ffn::Moe(MoeBlock {
                    router,
                    gate_up,
                    down,
                    f,
                })
            } else {
                let f = cfg.intermediate_size;
                Ffn::Dense(DenseMlp {
                    gate_up: one(
                        &mut params,
                        format!("{p}.mlp.gate_up_proj.weight"),
                        &[2 * f, h],
                        true,
                        true,
                    )?,
                    down: one(
                        &mut params,
                        format!("{p}.mlp.down_proj.weight"),
                        &[h, f],
                        true,
                        true,
                    )?,
                    f,
                })
            };
            layers.push(Layer {
                ln1,
                attn: Attention {
                    q,
                    k,
                    v: vv,
                    o,
                    bias,
                    qk_norm,
                },
                ln2,
                ffn,
                params: first..params.len(),
            });
        }
        let norm = {
            let vals = src("model.norm.weight", &[h])?;
            push(
                &mut params,
                "model.norm.weight".into(),
                vec![h],
                vals.as_deref(),
                false,
                false,
            )?
        };
        let head = if cfg.tie_word_embeddings {
            embed
        } else {
            let vals = src("lm_head.weight", &[v, h])?;
            push(
                &mut params,
                "lm_head.weight".into(),
                vec![v, h],
                vals.as_deref(),
                true,
                true,
            )?
        };
        let rope = b
            .rope_table(max_pos.max(1), cfg.head_dim, cfg.rope_theta)
            .map_err(dev)?;
        Ok(Engine {
            params,
            embed,
            head,
            norm,
            layers,
            rope,
            max_pos,
            cfg,
            b,
            train: None,
            graphs: true,
            shared_prefill: true,
            aux_coef: 0.0,
        })
    }

    fn w(&self, i: usize) -> &B::F32 {
        self.params[i]
            .value_f32()
            .expect("drop_masters keeps the master of a parameter read as f32")
    }

    /// Whether the forward reads parameter `i`'s master itself as f32: it has no BF16 value
    /// and no stored weights, and no BF16 operand either unless it is the embedding (a tied
    /// one is gathered as f32 beside the lm_head's operand). [`Engine::use_bf16_params`]
    /// gives such a parameter a BF16 value; [`Engine::drop_masters`] keeps its master.
    fn reads_master(&self, i: usize) -> bool {
        let p = &self.params[i];
        p.compute.is_none() && p.q.is_none() && (p.op.is_none() || i == self.embed)
    }

    fn op(&self, i: usize) -> &B::Bf16 {
        self.params[i]
            .op
            .as_ref()
            .expect("linear weights carry a BF16 operand")
    }

    /// Whether linear parameter `i` runs in a block format (its input is the f32 rows).
    fn quantized(&self, i: usize) -> bool {
        self.params[i].q.is_some()
    }

    /// RMSNorm of `x` with norm parameter `wi`: the f32 rows (`f32`: a block-format linear
    /// quantizes them) and/or their BF16 rounding (`bf16`: a BF16 linear reads it), with
    /// `rstd` for the backward. Both from one pass where both are wanted.
    fn norm_rows(
        &self,
        x: &B::F32,
        wi: usize,
        n: usize,
        f32: bool,
        bf16: bool,
        rstd: &mut B::F32,
    ) -> Result<NormRows<B>> {
        let (hd, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        let (mut h, mut hb) = self.norm_bufs(n, f32, bf16)?;
        self.b
            .rmsnorm_into(x, self.w(wi), n, hd, eps, h.as_mut(), hb.as_mut(), rstd)
            .map_err(dev)?;
        Ok((h, hb))
    }

    /// `x += res`, then [`Engine::norm_rows`] of the new `x`, in one op
    /// ([`Backend::add_rmsnorm`]: the same bits as the add and the norm).
    #[allow(clippy::too_many_arguments)]
    fn add_norm_rows(
        &self,
        x: &mut B::F32,
        res: &B::F32,
        wi: usize,
        n: usize,
        f32: bool,
        bf16: bool,
        rstd: &mut B::F32,
    ) -> Result<NormRows<B>> {
        let (hd, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        let (mut h, mut hb) = self.norm_bufs(n, f32, bf16)?;
        self.b
            .add_rmsnorm(
                x,
                res,
                self.w(wi),
                n,
                hd,
                eps,
                h.as_mut(),
                hb.as_mut(),
                rstd,
            )
            .map_err(dev)?;
        Ok((h, hb))
    }

    /// The outputs [`Engine::norm_rows`] writes for `n` rows: the f32 rows when `f32` (also
    /// when neither is asked for: every caller wants one), the BF16 rows when `bf16`.
    fn norm_bufs(&self, n: usize, f32: bool, bf16: bool) -> Result<NormRows<B>> {
        let (b, len) = (&self.b, n * self.cfg.hidden_size);
        let h = match f32 || !bf16 {
            true => Some(b.empty_f32(len).map_err(dev)?),
            false => None,
        };
        let hb = match bf16 {
            true => Some(b.empty_bf16(len).map_err(dev)?),
            false => None,
        };
        Ok((h, hb))
    }

    /// The input of linear `i`: the f32 rows for a block-format linear, else the BF16 rows
    /// (a rounding that only block-format linears read is not made: `xb` is then `None`).
    fn input<'a>(
        &self,
        i: usize,
        xb: Option<&'a B::Bf16>,
        x: Option<&'a B::F32>,
    ) -> Result<ActRef<'a, B>> {
        match (self.quantized(i), x, xb) {
            (true, Some(x), _) => Ok(ActRef::F32(x)),
            (_, _, Some(xb)) => Ok(ActRef::Bf16(xb)),
            _ => Err(self.wrong_input(i)),
        }
    }

    /// `y [rows, n] = x · Wᵀ` of dense linear parameter `i`: its stored block-format weight
    /// from the f32 rows, else its BF16 operand from the BF16 rows.
    fn lin(
        &self,
        i: usize,
        x: ActRef<'_, B>,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut B::F32,
    ) -> Result<()> {
        match (&self.params[i].q, x) {
            (Some(q), ActRef::F32(x)) => self.b.qlinear(x, &q.w, rows, k, n, y),
            (None, ActRef::Bf16(x)) => self.b.linear(x, self.op(i), rows, k, n, y),
            _ => return Err(self.wrong_input(i)),
        }
        .map_err(dev)
    }

    /// The grouped (routed-expert) form of [`Engine::lin`] over expert-major rows.
    #[allow(clippy::too_many_arguments)]
    fn glin(
        &self,
        i: usize,
        x: ActRef<'_, B>,
        offsets: &B::U32,
        host_offsets: Option<&[u32]>,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut B::F32,
    ) -> Result<()> {
        let ne = self.cfg.num_experts;
        match (&self.params[i].q, x) {
            (Some(q), ActRef::F32(x)) => {
                self.b.grouped_qlinear(x, &q.w, offsets, ne, rows, k, n, y)
            }
            (None, ActRef::Bf16(x)) => {
                self.b
                    .grouped_linear(x, self.op(i), offsets, host_offsets, ne, rows, k, n, y)
            }
            _ => return Err(self.wrong_input(i)),
        }
        .map_err(dev)
    }

    /// Backward of [`Engine::lin`] / [`Engine::glin`] (`host_offsets`: the expert offsets;
    /// `None` for a dense linear): writes `dx`, accumulates `dW` into `g`. `dy` is f32, or
    /// already rounded to BF16 for routed experts whose backward takes only `bf16(dy)`
    /// ([`Engine::bf16_dy`]: stored in BF16, whose GEMMs take it as their operand as it is,
    /// or a block format's `HighPrecision` / `Dequantized` backward). `fresh`: `g` is a pending zero ([`Engine::zero_grads`]): the grouped
    /// and block-format backwards overwrite it, the dense BF16 one zeroes it first.
    #[allow(clippy::too_many_arguments)]
    fn lin_bwd(
        &self,
        i: usize,
        dy: ActRef<'_, B>,
        x: ActRef<'_, B>,
        offsets: Option<(&B::U32, &[u32])>,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut B::F32,
        g: &mut B::F32,
        fresh: bool,
    ) -> Result<()> {
        let b = &self.b;
        let p = &self.params[i];
        let dense = [0, rows as u32];
        let overwrite = fresh && (p.q.is_some() || offsets.is_some());
        if fresh && !overwrite {
            b.fill_zero(g, p.len).map_err(dev)?;
        }
        let dw_write = if overwrite {
            GradWrite::Overwrite
        } else {
            GradWrite::Accumulate
        };
        match (&p.q, x, offsets, dy) {
            (Some(q), x, o, dy) => {
                let (dev, host) = o.map_or((None, &dense[..]), |o| (Some(o.0), o.1));
                let dy = match dy {
                    ActRef::F32(d) => OutGrad::F32(d),
                    ActRef::Bf16(d) => OutGrad::Bf16(d),
                    ActRef::Operand(_) => return Err(self.wrong_input(i)),
                };
                let x = match x {
                    ActRef::F32(x) => SavedX::F32(x),
                    ActRef::Bf16(x) => SavedX::Bf16(x),
                    ActRef::Operand(x) => SavedX::Operand(x),
                };
                b.grouped_qlinear_backward(
                    x,
                    &q.w,
                    p.master()?,
                    p.op.as_ref(),
                    dy,
                    dev,
                    host,
                    rows,
                    k,
                    n,
                    dx,
                    g,
                    dw_write,
                )
            }
            (None, ActRef::Bf16(x), None, ActRef::F32(dy)) => {
                b.linear_backward(dy, x, self.op(i), rows, k, n, Some(dx), g)
            }
            (None, ActRef::Bf16(x), Some((off, host)), ActRef::F32(dy)) => b
                .grouped_linear_backward(
                    dy,
                    x,
                    self.op(i),
                    off,
                    Some(host),
                    self.cfg.num_experts,
                    rows,
                    k,
                    n,
                    dx,
                    g,
                    dw_write,
                ),
            (None, ActRef::Bf16(x), Some((off, host)), ActRef::Bf16(dyb)) => b
                .grouped_linear_backward_bf16(
                    dyb,
                    x,
                    self.op(i),
                    off,
                    Some(host),
                    self.cfg.num_experts,
                    rows,
                    k,
                    n,
                    dx,
                    g,
                    dw_write,
                ),
            _ => return Err(self.wrong_input(i)),
        }
        .map_err(dev)
    }

    fn wrong_input(&self, i: usize) -> ModelError {
        ModelError::Input(format!(
            "{}: input rows of the wrong precision for a {} linear (internal)",
            self.params[i].name,
            if self.quantized(i) {
                "block-format"
            } else {
                "BF16"
            }
        ))
    }

    /// Parameters held (counted from the configuration; tied embeddings once).
    pub fn num_parameters(&self) -> usize {
        let c = &self.cfg;
        let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
        let mut n = v * h * if c.tie_word_embeddings { 1 } else { 2 } + h;
        for l in 0..c.num_layers {
            n += 2 * h + h * qd + 2 * h * kvd + qd * h;
            if c.qkv_bias {
                n += qd + 2 * kvd;
            }
            if c.arch == Arch::Qwen3Moe {
                n += 2 * d;
            }
            n += if c.is_moe_layer(l) {
                c.num_experts * (h + 3 * h * c.moe_intermediate_size)
            } else {
                3 * h * c.intermediate_size
            };
        }
        n
    }

    /// Parameters one token's forward multiplies (attention, router, its `top_k` experts or
    /// the dense MLP, the head; embeddings are a gather and not counted).
    pub fn active_parameters(&self) -> usize {
        let c = &self.cfg;
        let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
        let mut n = v * h;
        for l in 0..c.num_layers {
            n += h * qd + 2 * h * kvd + qd * h;
            n += if c.is_moe_layer(l) {
                c.num_experts * h + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
            } else {
                3 * h * c.intermediate_size
            };
        }
        n
    }

    /// Weight bytes one decode step reads at batch `batch` if each token touches `top_k`
    /// distinct experts (all `min(E, batch·k)` experts at most), BF16: the roofline numerator.
    pub fn decode_weight_bytes(&self, batch: usize) -> usize {
        let c = &self.cfg;
        let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
        let mut n = v * h;
        for l in 0..c.num_layers {
            n += h * qd + 2 * h * kvd + qd * h;
            n += if c.is_moe_layer(l) {
                let used = (batch * c.num_experts_per_tok).min(c.num_experts);
                let f = c.moe_intermediate_size;
                // Stored bytes of the used experts, in BF16 elements' worth.
                let part = |q: Option<&QParam<B>>, elems: usize| match q {
                    Some(q) => q.bytes() / c.num_experts / 2,
                    None => elems,
                };
                let (gu, dn) = match &self.layers[l].ffn {
                    Ffn::Moe(m) => (
                        self.params[m.gate_up].q.as_ref(),
                        self.params[m.down].q.as_ref(),
                    ),
                    Ffn::Dense(_) => (None, None),
                };
                c.num_experts * h + used * (part(gu, 2 * h * f) + part(dn, h * f))
            } else {
                3 * h * c.intermediate_size
            };
        }
        2 * n
    }

    /// Runs the routed experts of every MoE layer in the block format of `spec` (MXFP8,
    /// NVFP4 or FP8-block): each expert's fused gate/up and down weights are quantized from
    /// the master weights by the contract library, exactly as the CPU model's
    /// `PreparedWeight::quantize` does, and the device keeps the stored bytes; activations
    /// are quantized on every forward. A BF16 spec returns the experts to BF16.
    ///
    /// # Errors
    /// A spec the backend has no kernels for, quantizer or device errors.
    pub fn quantize_experts(&mut self, spec: LinearSpec) -> Result<()> {
        let spec = spec.weight_scheme().map(|_| spec);
        let idx: Vec<usize> = self
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(m) => Some([m.gate_up, m.down]),
                Ffn::Dense(_) => None,
            })
            .flatten()
            .collect();
        for i in idx {
            self.set_linear_spec(i, spec)?;
        }
        Ok(())
    }

    /// The linear weights a precision plan decides on, with the number of weights each
    /// holds (routed experts stacked: `E`).
    pub(crate) fn plan_linears(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for l in &self.layers {
            let a = &l.attn;
            out.extend([(a.q, 1), (a.k, 1), (a.v, 1), (a.o, 1)]);
            match &l.ffn {
                Ffn::Dense(m) => out.extend([(m.gate_up, 1), (m.down, 1)]),
                Ffn::Moe(m) => out.extend([
                    (m.router, 1),
                    (m.gate_up, self.cfg.num_experts),
                    (m.down, self.cfg.num_experts),
                ]),
            }
        }
        out.push((self.head, 1));
        out
    }

    /// Runs every linear as `plan` stores it: BF16 entries multiply their BF16 operand,
    /// block-format ones (attention, MLP and routed-expert linears) their stored weights,
    /// quantized from the masters now and after every optimizer step with the contract
    /// library (the bytes the CPU model's `PreparedWeight::quantize` writes) and the plan's
    /// backward mode in training. Returns a one-line description of what runs.
    ///
    /// # Errors
    /// A linear the plan does not cover, experts of one layer in different formats, a block
    /// format on the router or lm_head (the engine keeps those BF16), quantizer or device
    /// errors.
    pub fn apply_plan(&mut self, plan: &mxrl_plan::PrecisionPlan) -> Result<String> {
        let mut decided = Vec::new();
        for (i, groups) in self.plan_linears() {
            let name = self.params[i].name.clone();
            let mut spec: Option<Option<LinearSpec>> = None;
            for g in 0..groups {
                let one = match crate::model::plan_precision(plan, &group_name(&name, g, groups))? {
                    crate::LinearPrecision::Quantized(s) => Some(s),
                    _ => None,
                };
                match spec {
                    None => spec = Some(one),
                    Some(s) if s == one => {}
                    Some(s) => {
                        return Err(ModelError::BadTensor {
                            name,
                            message: format!(
                                "the plan gives the stacked weights different formats ({s:?} \
                                 and {one:?}); the engine runs a layer's experts in one"
                            ),
                        })
                    }
                }
            }
            let spec = spec.flatten();
            if spec.is_some() && self.bf16_only(i) {
                return Err(ModelError::BadTensor {
                    name,
                    message: "the device engine runs the router and lm_head in BF16; the plan \
                              stores it in a block format"
                        .into(),
                });
            }
            decided.push((i, spec));
        }
        for (i, spec) in decided {
            self.set_linear_spec(i, spec)?;
        }
        Ok(self.describe())
    }

    /// Bytes of the BF16 GEMM operands the engine holds beside the f32 masters: every BF16
    /// linear's (and a tied embedding's), and a block-format linear's only under the
    /// `high_precision` backward, the one mode that multiplies it.
    pub fn bf16_operand_bytes(&self) -> usize {
        self.params
            .iter()
            .filter(|p| p.op.is_some())
            .map(|p| 2 * p.len)
            .sum()
    }

    /// Whether any linear runs in a block format.
    pub fn runs_block_formats(&self) -> bool {
        self.params.iter().any(|p| p.q.is_some())
    }

    /// One line on how the linears run.
    pub fn describe(&self) -> String {
        let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
        for p in &self.params {
            if let Some(q) = &p.q {
                *counts.entry(format!("{:?}", q.spec.format())).or_default() += q.groups;
            }
        }
        if counts.is_empty() {
            return "device engine: BF16 linears".into();
        }
        let parts: Vec<String> = counts
            .iter()
            .map(|(f, n)| format!("{n} weights in {f} (stored bytes)"))
            .collect();
        format!("device engine: {}, the rest BF16", parts.join(", "))
    }

    /// Runs linear parameter `i` in the block format of `spec` (quantized from its master
    /// now), or with its BF16 operand (`None`).
    fn set_linear_spec(&mut self, i: usize, spec: Option<LinearSpec>) -> Result<()> {
        // Both ways build from the master: refused before anything changes without one.
        self.params[i].master()?;
        let Some(spec) = spec else {
            self.params[i].q = None;
            return self.keep_bf16_operand(i, true);
        };
        let groups = match self.plan_linears().iter().find(|x| x.0 == i) {
            Some(&(_, g)) => g,
            None => {
                return Err(ModelError::BadTensor {
                    name: self.params[i].name.clone(),
                    message: "not a linear weight of this engine".into(),
                })
            }
        };
        let p = &self.params[i];
        let (n, k) = (p.shape[0] / groups, p.shape[1]);
        let q = self.quantize_param(i, spec, groups, n, k)?;
        self.params[i].q = Some(q);
        self.keep_bf16_operand(i, spec.backward() == BackwardMode::HighPrecision)
    }

    /// Keeps (`keep`: made from the master where it is missing) or frees linear parameter
    /// `i`'s BF16 operand `bf16(master)`. BF16 linears multiply it; of the block formats'
    /// backward modes only `high_precision` does (the weight operand of its dgrad), so a
    /// `lowp` or `dequantized` linear holds none and the optimizer step writes none: 2 bytes
    /// per weight less to write per step and to hold. Exports read the master's BF16
    /// rounding where there is no operand (the same bits).
    fn keep_bf16_operand(&mut self, i: usize, keep: bool) -> Result<()> {
        let b = &self.b;
        let p = &mut self.params[i];
        match (keep, p.op.is_some()) {
            (true, false) => {
                let mut o = b.empty_bf16(p.len).map_err(dev)?;
                b.to_bf16(p.master()?, &mut o, p.len).map_err(dev)?;
                p.op = Some(o);
            }
            (false, true) => p.op = None,
            _ => {}
        }
        Ok(())
    }

    fn quantize_param(
        &self,
        i: usize,
        spec: LinearSpec,
        groups: usize,
        n: usize,
        k: usize,
    ) -> Result<QParam<B>> {
        let p = &self.params[i];
        let base = p.name.clone();
        let name = move |g: usize| group_name(&base, g, groups);
        let w = self
            .b
            .quantize_weights(p.master()?, groups, n, k, spec, &name, self.adam_step())
            .map_err(dev)?;
        Ok(QParam {
            spec,
            groups,
            n,
            k,
            w,
        })
    }

    /// Rebuilds parameter `i`'s stored weights from its master (block-format linears).
    fn requantize(&mut self, i: usize) -> Result<()> {
        if let Some(q) = &self.params[i].q {
            let (spec, groups, n, k) = (q.spec, q.groups, q.n, q.k);
            let q = self.quantize_param(i, spec, groups, n, k)?;
            self.params[i].q = Some(q);
        }
        Ok(())
    }

    fn install_prepared(&mut self, i: usize, pws: Vec<PreparedWeight>) -> Result<()> {
        let first = pws
            .first()
            .ok_or_else(|| ModelError::Input("no stored weights".into()))?;
        let (spec, n, k, groups) = (first.spec(), first.n(), first.k(), pws.len());
        let w = self.b.upload_experts(pws).map_err(dev)?;
        self.params[i].q = Some(QParam {
            spec,
            groups,
            n,
            k,
            w,
        });
        Ok(())
    }

    /// Whether linear parameter `i`'s backward takes its output gradient rounded to BF16
    /// (stored in BF16, or a block format whose backward multiplies only `bf16(dy)`).
    fn bf16_dy(&self, i: usize) -> bool {
        self.params[i]
            .q
            .as_ref()
            .is_none_or(|q| q.spec.rounds_dy_to_bf16())
    }

    /// Whether linear parameter `i` runs in BF16 whatever a plan says (the router and
    /// lm_head: the engine has no block-format path for them).
    fn bf16_only(&self, i: usize) -> bool {
        i == self.head
            || self
                .layers
                .iter()
                .any(|l| matches!(&l.ffn, Ffn::Moe(m) if m.router == i))
    }

    /// Installs the stored weights of linear parameter `i` (one per group; `None` where the
    /// source holds none): nothing when none is stored; all of them when every group is
    /// stored in one spec. Returns the number installed.
    ///
    /// # Errors
    /// Some groups stored and some not, groups in different specs, a stored router or
    /// lm_head (named); device failure.
    pub(crate) fn install_groups(
        &mut self,
        i: usize,
        pws: Vec<Option<PreparedWeight>>,
    ) -> Result<usize> {
        if pws.iter().all(Option::is_none) {
            return Ok(0);
        }
        let name = &self.params[i].name;
        if self.bf16_only(i) {
            return Err(ModelError::Input(format!(
                "{name}: the device engine runs the router and lm_head in BF16; this model \
                 stores it in a block format"
            )));
        }
        if pws.iter().any(Option::is_none) {
            return Err(ModelError::Input(format!(
                "{name}: the device engine runs a layer's routed experts in one format; some \
                 are stored in a block format and some are not"
            )));
        }
        let pws: Vec<PreparedWeight> = pws.into_iter().flatten().collect();
        if pws.iter().any(|p| p.spec() != pws[0].spec()) {
            return Err(ModelError::Input(format!(
                "{name}: routed experts in different formats"
            )));
        }
        let n = pws.len();
        self.install_prepared(i, pws)?;
        Ok(n)
    }

    /// The engine of `model` as the model runs: BF16 operands for its BF16 and f32 linears
    /// (the device engine multiplies BF16 on tensor cores), and its block-format linears as
    /// the model prepared them (the same stored bytes: quantized from the masters or loaded
    /// from a converted checkpoint). Returns a one-line description of what runs.
    ///
    /// # Errors
    /// A block-format router or lm_head, routed experts of one layer in different formats,
    /// and [`Engine::from_model`]'s errors.
    pub fn from_model_as_run(model: &Model, b: B, max_pos: usize) -> Result<(Self, String)> {
        let f32_linears = model
            .linear_precisions()
            .iter()
            .filter(|(_, p)| *p == crate::LinearPrecision::F32)
            .count();
        let mut e = Self::from_model(model, b, max_pos)?;
        for (i, groups) in e.plan_linears() {
            let name = e.params[i].name.clone();
            let pws: Vec<Option<PreparedWeight>> = (0..groups)
                .map(|g| {
                    model
                        .prepared_weight(&group_name(&name, g, groups))
                        .cloned()
                })
                .collect();
            e.install_groups(i, pws)?;
        }
        let mut what = e.describe();
        if f32_linears > 0 {
            what.push_str(&format!(
                " (BF16 operands for {f32_linears} f32 linears of the model)"
            ));
        }
        Ok((e, what))
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.b
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            q_heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
        let v = self.cfg.vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(ModelError::Input(format!(
                "{what}: token id {t} ≥ vocab_size {v}"
            )));
        }
        Ok(())
    }

    /// One decoder layer over `n` rows: returns the new residual stream and the layer's
    /// tape (dropped by inference callers).
    fn layer(
        &self,
        li: usize,
        n: usize,
        x_in: B::F32,
        pass: &mut Pass<'_, B>,
    ) -> Result<(B::F32, LayerTape<B>)> {
        let c = &self.cfg;
        let b = &self.b;
        let l = &self.layers[li];
        let (hd, hq, hkv, d) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        let (qd, kvd) = (hq * d, hkv * d);
        let eps = c.rms_norm_eps;
        // Every output here is overwritten whole by its op: buffers with unspecified contents.
        let e = |m: usize| b.empty_f32(m).map_err(dev);
        let eb = |m: usize| b.empty_bf16(m).map_err(dev);
        // x_mid = x_in + attention(rmsnorm(x_in))
        let mut rstd1 = e(n)?;
        // Block-format linears quantize the f32 normalized rows (as the CPU model's quantized
        // linears do); BF16 ones take their BF16 rounding (made only when one reads it).
        let qkv = [l.attn.q, l.attn.k, l.attn.v];
        let (mut q, mut k, mut v) = (e(n * qd)?, e(n * kvd)?, e(n * kvd)?);
        let p = |i: usize| self.params[i].q.as_ref();
        let decode = matches!(pass, Pass::Decode { .. });
        // Decode with BF16 q, k, v: the norm and the three projections as one op (the device
        // may fuse them); neither the normalized rows nor rstd are kept.
        let fused_norm = decode && qkv.iter().all(|&i| !self.quantized(i));
        let (h1, h1b) = if fused_norm {
            b.rmsnorm_linear_shared(
                &x_in,
                self.w(l.ln1),
                eps,
                n,
                hd,
                &mut [
                    (self.op(l.attn.q), qd, &mut q),
                    (self.op(l.attn.k), kvd, &mut k),
                    (self.op(l.attn.v), kvd, &mut v),
                ],
            )
            .map_err(dev)?;
            (None, None)
        } else {
            self.norm_rows(
                &x_in,
                l.ln1,
                n,
                qkv.iter().any(|&i| self.quantized(i)),
                qkv.iter().any(|&i| !self.quantized(i)),
                &mut rstd1,
            )?
        };
        match (p(l.attn.q), p(l.attn.k), p(l.attn.v), h1.as_ref()) {
            _ if fused_norm => {}
            // All three in a block format: one input, quantized once where the device can.
            (Some(wq), Some(wk), Some(wv), Some(h1)) => b
                .qlinear_shared(
                    h1,
                    n,
                    hd,
                    &mut [
                        (&wq.w, qd, &mut q),
                        (&wk.w, kvd, &mut k),
                        (&wv.w, kvd, &mut v),
                    ],
                )
                .map_err(dev)?,
            // All three BF16: one input, one launch where the device has it.
            (None, None, None, _) => {
                let xb = rows_made(h1b.as_ref(), "the attention's BF16 input")?;
                b.linear_shared(
                    xb,
                    n,
                    hd,
                    &mut [
                        (self.op(l.attn.q), qd, &mut q),
                        (self.op(l.attn.k), kvd, &mut k),
                        (self.op(l.attn.v), kvd, &mut v),
                    ],
                )
                .map_err(dev)?
            }
            _ => {
                for (i, width, y) in [
                    (l.attn.q, qd, &mut q),
                    (l.attn.k, kvd, &mut k),
                    (l.attn.v, kvd, &mut v),
                ] {
                    self.lin(
                        i,
                        self.input(i, h1b.as_ref(), h1.as_ref())?,
                        n,
                        hd,
                        width,
                        y,
                    )?;
                }
            }
        }
        if let Some([bq, bk, bv]) = l.attn.bias {
            b.add_bias(&mut q, self.w(bq), n, qd).map_err(dev)?;
            b.add_bias(&mut k, self.w(bk), n, kvd).map_err(dev)?;
            b.add_bias(&mut v, self.w(bv), n, kvd).map_err(dev)?;
        }
        let mut q_pre = None;
        // Decode runs the q/k norms inside `decode_attn_prep` (nothing is taped there).
        if let (false, Some([nq, nk])) = (decode, l.attn.qk_norm) {
            let (mut qn, mut kn) = (e(n * qd)?, e(n * kvd)?);
            let (mut rq, mut rk) = (e(n * hq)?, e(n * hkv)?);
            b.rmsnorm(&q, self.w(nq), n * hq, d, eps, &mut qn, &mut rq)
                .map_err(dev)?;
            b.rmsnorm(&k, self.w(nk), n * hkv, d, eps, &mut kn, &mut rk)
                .map_err(dev)?;
            let qp = std::mem::replace(&mut q, qn);
            let kp = std::mem::replace(&mut k, kn);
            q_pre = Some((qp, rq, kp, rk));
        }
        let shape = self.shape();
        // Decode before a BF16 o projection writes the attention's BF16 rounding alone (the
        // f32 rows are read by nothing then, and no tape keeps them: `att` stays unwritten).
        let decode_bf16 = decode && !self.quantized(l.attn.o);
        let mut att = e(if decode_bf16 { 1 } else { n * qd })?;
        let mut attb = None;
        let mut lse = e(n * hq)?;
        match pass {
            Pass::Prefill {
                layout,
                offsets,
                pos,
                cache,
                ..
            } => {
                b.rope(&mut q, n, hq, d, pos, &self.rope).map_err(dev)?;
                b.rope(&mut k, n, hkv, d, pos, &self.rope).map_err(dev)?;
                if let Some(st) = cache {
                    b.kv_fill(
                        &k,
                        &v,
                        layout,
                        kvd,
                        st.max_len,
                        &mut st.k[li],
                        &mut st.v[li],
                    )
                    .map_err(dev)?;
                }
                b.attention(&q, &k, &v, layout, offsets, shape, &mut att, &mut lse)
                    .map_err(dev)?;
            }
            Pass::Decode {
                k: kc,
                v: vc,
                max_len,
                lens,
                batch,
                pos,
                ..
            } => {
                debug_assert_eq!(*batch, n);
                let norms = l.attn.qk_norm.map(|[nq, nk]| [self.w(nq), self.w(nk)]);
                // The q/k norms, RoPE, the cache append and the attention as one op (the
                // device may fuse them). The lengths are read on the device: a recorded step
                // replays at any length.
                let mut ab = None;
                let out = if decode_bf16 {
                    DecodeAttnOut::Bf16(ab.insert(eb(n * qd)?))
                } else {
                    DecodeAttnOut::F32(&mut att)
                };
                b.decode_attention(
                    &mut q,
                    &mut k,
                    &v,
                    norms,
                    eps,
                    n,
                    shape,
                    pos,
                    &self.rope,
                    lens,
                    *max_len,
                    (&mut kc[li], &mut vc[li]),
                    out,
                )
                .map_err(dev)?;
                attb = ab;
            }
        }
        if attb.is_none() && !self.quantized(l.attn.o) {
            let mut ab = eb(n * qd)?;
            b.to_bf16(&att, &mut ab, n * qd).map_err(dev)?;
            attb = Some(ab);
        }
        // Decode of an MoE layer runs the residual add, the norm and the router as one op (the
        // device may fuse them), so the o projection writes a buffer of its own there:
        // `fused` holds the router and that buffer.
        let mut fused = match (&l.ffn, decode) {
            (Ffn::Moe(m), true) => Some((m.router, e(n * hd)?)),
            _ => None,
        };
        let mut x_mid = e(n * hd)?;
        self.lin(
            l.attn.o,
            self.input(l.attn.o, attb.as_ref(), Some(&att))?,
            n,
            qd,
            hd,
            match fused.as_mut() {
                Some((_, o)) => o,
                None => &mut x_mid,
            },
        )?;
        // x_out = x_mid + ffn(rmsnorm(x_mid))
        let mut rstd2 = e(n)?;
        let (gate_up, down) = match &l.ffn {
            Ffn::Dense(m) => (m.gate_up, m.down),
            Ffn::Moe(m) => (m.gate_up, m.down),
        };
        // x_mid = o + x_in (the same f32 sum as the CPU model's `x += o`) and its norm in one
        // op. The router (a BF16 linear) reads the BF16 rows of an MoE layer.
        let mut router_logits = None;
        let (h2, h2b) = match fused.as_mut() {
            Some((router, o)) => {
                let (mut h, mut hb) = self.norm_bufs(n, self.quantized(gate_up), true)?;
                let mut logits = e(n * c.num_experts)?;
                b.add_rmsnorm_linear(
                    (o, &x_in, &mut x_mid),
                    self.w(l.ln2),
                    (n, hd, eps),
                    (
                        h.as_mut(),
                        hb.as_mut().ok_or_else(|| {
                            ModelError::Input(
                                "the router's BF16 input was not made (internal)".into(),
                            )
                        })?,
                        &mut rstd2,
                    ),
                    (self.op(*router), c.num_experts, &mut logits),
                )
                .map_err(dev)?;
                router_logits = Some(logits);
                (h, hb)
            }
            None => self.add_norm_rows(
                &mut x_mid,
                &x_in,
                l.ln2,
                n,
                self.quantized(gate_up),
                matches!(l.ffn, Ffn::Moe(_)) || !self.quantized(gate_up),
                &mut rstd2,
            )?,
        };
        // SwiGLU of `rows` rows into the down projection's input: f32 for a block-format
        // down projection, else BF16.
        let swiglu = |gu: &B::F32, rows: usize, f: usize| -> Result<Act<B>> {
            if self.quantized(down) {
                let mut a = e(rows * f)?;
                b.swiglu_f32(gu, rows, f, &mut a).map_err(dev)?;
                Ok(Act::F32(a))
            } else {
                let mut a = eb(rows * f)?;
                b.swiglu_bf16(gu, rows, f, &mut a).map_err(dev)?;
                Ok(Act::Bf16(a))
            }
        };
        let (x_out, ffn) = match &l.ffn {
            Ffn::Dense(m) => {
                let mut gu = e(n * 2 * m.f)?;
                self.lin(
                    m.gate_up,
                    self.input(m.gate_up, h2b.as_ref(), h2.as_ref())?,
                    n,
                    hd,
                    2 * m.f,
                    &mut gu,
                )?;
                let act = swiglu(&gu, n, m.f)?;
                let mut y = e(n * hd)?;
                self.lin(m.down, act.r(), n, m.f, hd, &mut y)?;
                b.add(&mut y, &x_mid, n * hd).map_err(dev)?;
                (y, FfnTape::Dense { gu, act })
            }
            Ffn::Moe(m) => {
                let (ne, k) = (c.num_experts, c.num_experts_per_tok);
                let rows = n * k;
                let h2b_router = rows_made(h2b.as_ref(), "the router's BF16 input")?;
                let logits = match router_logits.take() {
                    Some(l) => l,
                    None => {
                        let mut logits = e(n * ne)?;
                        b.linear(h2b_router, self.op(m.router), n, hd, ne, &mut logits)
                            .map_err(dev)?;
                        logits
                    }
                };
                // Router and dispatch write every entry of these.
                let u = |m: usize| b.empty_u32(m).map_err(dev);
                let mut route = RouteBufs {
                    ids: u(rows)?,
                    weights: e(rows)?,
                    probs: e(n * ne)?,
                    offsets: u(ne + 1)?,
                    perm: u(rows)?,
                    row_of: u(rows)?,
                };
                let replay = match pass {
                    Pass::Prefill {
                        replay: Some(r), ..
                    } => r[li].as_ref(),
                    _ => None,
                };
                b.route(&logits, n, ne, k, c.norm_topk_prob, replay, &mut route)
                    .map_err(dev)?;
                match pass {
                    Pass::Prefill {
                        cache: Some(st),
                        seq: Some(seq),
                        pos,
                        ..
                    } => {
                        let (slots, max_len) = (st.lens.len(), st.max_len);
                        if let Some(Some((ti, tw))) = st.routes.get_mut(li) {
                            b.capture_routes(
                                &route.ids,
                                &route.weights,
                                n,
                                k,
                                Some(seq),
                                pos,
                                slots,
                                max_len,
                                ti,
                                tw,
                            )
                            .map_err(dev)?;
                        }
                    }
                    Pass::Decode {
                        routes,
                        pos,
                        batch,
                        max_len,
                        ..
                    } => {
                        if let Some(Some((ti, tw))) = routes.get_mut(li) {
                            b.capture_routes(
                                &route.ids,
                                &route.weights,
                                n,
                                k,
                                None,
                                pos,
                                *batch,
                                *max_len,
                                ti,
                                tw,
                            )
                            .map_err(dev)?;
                        }
                    }
                    Pass::Prefill { .. } => {}
                }
                // Outside decode (no recording), the offsets once on the host for every
                // grouped GEMM of this layer, forward and backward.
                let host_offsets = match pass {
                    Pass::Decode { .. } => None,
                    Pass::Prefill { .. } => {
                        Some(b.download_u32(&route.offsets, ne + 1).map_err(dev)?)
                    }
                };
                let ho = host_offsets.as_deref();
                // Decode with BF16 experts: gather, gate/up and SwiGLU as one op (the device
                // may fuse them); nothing of it is kept (`gu` stays a one-element placeholder).
                let fused = matches!(
                    (
                        &*pass,
                        &h2,
                        &self.params[m.gate_up].q,
                        &self.params[m.down].q
                    ),
                    (Pass::Decode { .. }, None, None, None)
                );
                // Without a tape (decode, a forward for scoring or generation) nothing of the
                // gate/up is kept, and a block-format down projection may quantize SwiGLU's
                // rows as it computes them (the same operands): its stored weights then.
                let taped = matches!(pass, Pass::Prefill { tape: true, .. });
                let swiglu_down = match taped {
                    true => None,
                    false => self.params[m.down].q.as_ref(),
                };
                // With a tape, a backend that keeps the down projection's activation operand
                // computes SwiGLU inside its quantizer too, and the tape holds that operand
                // instead of the f32 SwiGLU rows (the SwiGLU backward reads `gu`).
                let kept_down = match (taped, &self.params[m.down].q) {
                    (true, Some(q)) if b.keeps_forward_operand(&q.spec, m.f) => Some(q),
                    _ => None,
                };
                let (xg, gu, mut act) = if fused {
                    let mut act = eb(rows * m.f)?;
                    b.moe_gate_up_swiglu_bf16(
                        h2b_router,
                        &route,
                        n,
                        ne,
                        k,
                        hd,
                        m.f,
                        self.op(m.gate_up),
                        &mut act,
                    )
                    .map_err(dev)?;
                    (None, e(1)?, Act::Bf16(act))
                } else {
                    let mut gu = e(rows * 2 * m.f)?;
                    // A block-format gate/up quantizes the routed rows as it gathers them (the
                    // same operands) where no f32 gathered rows are kept: without a tape, and
                    // for a backward that multiplies only bf16(x), which keeps the gathered
                    // rows of the norm's BF16 output (the same values).
                    let xg = match (&h2, &self.params[m.gate_up].q, taped) {
                        // A backend that keeps the quantizer's operand for the backward: the
                        // tape holds it instead of the f32 gathered rows.
                        (Some(h2), Some(q), true) if b.keeps_forward_operand(&q.spec, hd) => {
                            let xq = b
                                .grouped_qlinear_gathered_kept(
                                    h2,
                                    &route,
                                    taped_offsets(ho)?,
                                    n,
                                    k,
                                    &q.w,
                                    ne,
                                    hd,
                                    2 * m.f,
                                    &mut gu,
                                )
                                .map_err(dev)?;
                            Some(Act::Operand(xq))
                        }
                        (Some(h2), Some(q), taped) if !taped || q.spec.rounds_x_to_bf16() => {
                            b.grouped_qlinear_gathered(
                                h2,
                                &route,
                                n,
                                k,
                                &q.w,
                                ne,
                                hd,
                                2 * m.f,
                                &mut gu,
                            )
                            .map_err(dev)?;
                            match taped {
                                true => {
                                    let mut xg = eb(rows * hd)?;
                                    b.gather_rows_bf16(h2b_router, &route, n, ne, k, hd, &mut xg)
                                        .map_err(dev)?;
                                    Some(Act::Bf16(xg))
                                }
                                false => None,
                            }
                        }
                        _ => {
                            let xg = match &h2 {
                                Some(h2) => {
                                    let mut xg = e(rows * hd)?;
                                    b.gather_f32(h2, &route, n, ne, k, hd, &mut xg)
                                        .map_err(dev)?;
                                    Act::F32(xg)
                                }
                                None => {
                                    let mut xg = eb(rows * hd)?;
                                    b.gather_rows_bf16(h2b_router, &route, n, ne, k, hd, &mut xg)
                                        .map_err(dev)?;
                                    Act::Bf16(xg)
                                }
                            };
                            self.glin(
                                m.gate_up,
                                xg.r(),
                                &route.offsets,
                                ho,
                                rows,
                                hd,
                                2 * m.f,
                                &mut gu,
                            )?;
                            Some(xg)
                        }
                    };
                    // SwiGLU inside the down projection: `act` stays a placeholder.
                    let act = match (swiglu_down, kept_down) {
                        (Some(_), _) | (_, Some(_)) => Act::F32(e(1)?),
                        (None, None) => swiglu(&gu, rows, m.f)?,
                    };
                    (xg, gu, act)
                };
                // Σ over experts, then + x_mid: the CPU model's `x += out`.
                let mut out = e(n * hd)?;
                let mut kept_act = None;
                let y = match (&act, fused) {
                    // Decode with BF16 experts: the down projection, the combine and the
                    // residual as one op (the device may fuse them); `y` stays a placeholder.
                    (Act::Bf16(a), true) => {
                        b.moe_down_combine_bf16(
                            a,
                            &route,
                            n,
                            ne,
                            k,
                            m.f,
                            hd,
                            self.op(m.down),
                            &x_mid,
                            &mut out,
                        )
                        .map_err(dev)?;
                        e(1)?
                    }
                    _ => {
                        let mut y = e(rows * hd)?;
                        match (swiglu_down, kept_down) {
                            (_, Some(q)) => {
                                kept_act = Some(
                                    b.grouped_qlinear_swiglu_kept(
                                        &gu,
                                        &q.w,
                                        &route.offsets,
                                        taped_offsets(ho)?,
                                        ne,
                                        rows,
                                        m.f,
                                        hd,
                                        &mut y,
                                    )
                                    .map_err(dev)?,
                                )
                            }
                            (Some(q), None) => b
                                .grouped_qlinear_swiglu(
                                    &gu,
                                    &q.w,
                                    &route.offsets,
                                    ne,
                                    rows,
                                    m.f,
                                    hd,
                                    &mut y,
                                )
                                .map_err(dev)?,
                            (None, None) => self.glin(
                                m.down,
                                act.r(),
                                &route.offsets,
                                ho,
                                rows,
                                m.f,
                                hd,
                                &mut y,
                            )?,
                        }
                        b.combine_add(&y, &route, n, ne, k, hd, &x_mid, &mut out)
                            .map_err(dev)?;
                        y
                    }
                };
                if let Some(xq) = kept_act {
                    act = Act::Operand(xq);
                }
                (
                    out,
                    FfnTape::Moe {
                        route,
                        host_offsets,
                        xg,
                        gu,
                        act,
                        y,
                    },
                )
            }
        };
        Ok((
            x_out,
            LayerTape {
                x_in,
                rstd1,
                h1b,
                q_pre,
                q,
                k,
                v,
                att,
                lse,
                attb,
                x_mid,
                rstd2,
                h1,
                h2,
                h2b,
                ffn,
            },
        ))
    }

    /// Checks a batch and packs it: tokens, targets, positions.
    fn pack(&self, batch: &[SeqInput<'_>], temperature: f32) -> Result<Packed> {
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature {temperature} must be positive and finite"
            )));
        }
        let lens: Vec<usize> = batch.iter().map(|s| s.tokens.len()).collect();
        let layout = SeqLayout::new(&lens);
        let n = layout.num_tokens();
        let mut tokens = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        for (i, s) in batch.iter().enumerate() {
            if s.targets.len() != s.tokens.len() {
                return Err(ModelError::Input(format!(
                    "sequence {i}: {} tokens but {} targets",
                    s.tokens.len(),
                    s.targets.len()
                )));
            }
            if s.tokens.len() > self.max_pos {
                return Err(ModelError::Input(format!(
                    "sequence {i} of {} tokens exceeds the engine's max positions {}",
                    s.tokens.len(),
                    self.max_pos
                )));
            }
            tokens.extend_from_slice(s.tokens);
            targets.extend_from_slice(s.targets);
            pos.extend(0..s.tokens.len() as u32);
        }
        self.check_tokens(&tokens, "input")?;
        self.check_tokens(&targets, "target")?;
        Ok((layout, tokens, targets, pos))
    }

    fn run_forward(
        &self,
        batch: &[SeqInput<'_>],
        temperature: f32,
        replay: Option<&[RoutingTrace]>,
        probe_last: Option<&[usize]>,
    ) -> Result<(Tape<B>, B::F32)> {
        let b = &self.b;
        let (layout, tokens, targets, pos) = self.pack(batch, temperature)?;
        let replay = match replay {
            Some(r) => Some(self.replay_tables(r, &layout)?),
            None => None,
        };
        let n = tokens.len();
        let hd = self.cfg.hidden_size;
        let tokens_dev = b.upload_u32(&tokens).map_err(dev)?;
        let pos_dev = b.upload_u32(&pos).map_err(dev)?;
        let offsets = b.upload_u32(&seq_offsets(&layout)).map_err(dev)?;
        let mut x = b.zeros_f32(n * hd).map_err(dev)?;
        b.embed(
            self.w(self.embed),
            self.cfg.vocab_size,
            &tokens_dev,
            n,
            hd,
            &mut x,
        )
        .map_err(dev)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut probes = Vec::new();
        let probe_rows = match probe_last {
            Some(last) => {
                if last.len() != layout.num_seqs()
                    || last.iter().zip(layout.lens()).any(|(&r, &l)| r > l)
                {
                    return Err(ModelError::Input(format!(
                        "probes of the last {last:?} positions of sequences of {:?} tokens",
                        layout.lens()
                    )));
                }
                let rows: Vec<u32> = (0..layout.num_seqs())
                    .flat_map(|s| {
                        let end = layout.offset(s) + layout.len(s);
                        (end - last[s]..end).map(|r| r as u32)
                    })
                    .collect();
                let count = rows.len();
                Some((b.upload_u32(&rows).map_err(dev)?, count))
            }
            None => None,
        };
        {
            let mut pass = Pass::Prefill {
                layout: &layout,
                offsets: &offsets,
                pos: &pos_dev,
                cache: None,
                seq: None,
                replay: replay.as_deref(),
                tape: true,
            };
            for li in 0..self.layers.len() {
                let (nx, t) = self.layer(li, n, x, &mut pass)?;
                x = nx;
                layers.push(t);
                if let Some((rows, count)) = &probe_rows {
                    // The residual stream after this layer at the probed rows (a row gather).
                    let mut pr = b.empty_f32(count * hd).map_err(dev)?;
                    b.embed(&x, n, rows, *count, hd, &mut pr).map_err(dev)?;
                    probes.push(pr);
                }
            }
        }
        let mut hf = b.zeros_f32(n * hd).map_err(dev)?;
        let mut rstd_final = b.zeros_f32(n).map_err(dev)?;
        b.rmsnorm(
            &x,
            self.w(self.norm),
            n,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut rstd_final,
        )
        .map_err(dev)?;
        let mut hfb = b.zeros_bf16(n * hd).map_err(dev)?;
        b.to_bf16(&hf, &mut hfb, n * hd).map_err(dev)?;
        let targets_dev = b.upload_u32(&targets).map_err(dev)?;
        let mut lp = b.zeros_f32(n).map_err(dev)?;
        let mut lse = b.zeros_f32(n).map_err(dev)?;
        let mut entropy = b.zeros_f32(n).map_err(dev)?;
        b.head_logprobs(
            &hfb,
            self.op(self.head),
            &targets_dev,
            n,
            hd,
            self.cfg.vocab_size,
            temperature,
            &mut lp,
            &mut lse,
            &mut entropy,
        )
        .map_err(dev)?;
        Ok((
            Tape {
                layout,
                tokens,
                tokens_dev,
                targets: targets_dev,
                offsets,
                pos: pos_dev,
                temperature,
                layers,
                x_final: x,
                rstd_final,
                hfb,
                lse,
                entropy,
                probes: (probe_rows.as_ref().map_or(0, |p| p.1), probes),
            },
            lp,
        ))
    }

    fn split(&self, layout: &SeqLayout, lp: &B::F32) -> Result<Vec<Vec<f32>>> {
        let all = self.b.download_f32(lp, layout.num_tokens()).map_err(dev)?;
        Ok((0..layout.num_seqs())
            .map(|s| all[layout.offset(s)..layout.offset(s) + layout.len(s)].to_vec())
            .collect())
    }

    /// Per-token logprobs of every sequence's targets (`softmax(logits / temperature)`),
    /// computed on the device; only token ids go up and logprobs come back.
    ///
    /// # Errors
    /// Token ids out of range, sequences longer than the engine's `max_pos`, device failures.
    pub fn logprobs(&self, batch: &[SeqInput<'_>], temperature: f32) -> Result<Vec<Vec<f32>>> {
        if batch.iter().all(|s| s.tokens.is_empty()) {
            self.pack(batch, temperature)?;
            return Ok(batch.iter().map(|_| Vec::new()).collect());
        }
        let (tape, lp) = self.run_forward(batch, temperature, None, None)?;
        self.split(&tape.layout, &lp)
    }

    /// The entropy of the tempered next-token distribution at every position of a training
    /// forward (per sequence), computed by the head kernel in the same pass as the logprobs.
    ///
    /// # Errors
    /// Device failure.
    pub fn entropy(&self, tape: &Tape<B>) -> Result<Vec<Vec<f32>>> {
        self.split(&tape.layout, &tape.entropy)
    }

    /// The probes of a [`Engine::forward_train_probed`]: per layer, `[P, H]` row-major, the
    /// probed positions of every sequence in order (empty when none were asked for).
    ///
    /// # Errors
    /// Device failure.
    pub fn probes(&self, tape: &Tape<B>) -> Result<Vec<Vec<f32>>> {
        let hd = self.cfg.hidden_size;
        let (count, bufs) = &tape.probes;
        bufs.iter()
            .map(|p| self.b.download_f32(p, count * hd).map_err(dev))
            .collect()
    }

    /// Training forward: per-token logprobs and the device tape for [`Engine::backward`].
    ///
    /// # Errors
    /// As [`Engine::logprobs`].
    pub fn forward_train(
        &self,
        batch: &[SeqInput<'_>],
        temperature: f32,
    ) -> Result<(Vec<Vec<f32>>, Tape<B>)> {
        self.forward_train_replay(batch, temperature, None)
    }

    /// [`Engine::forward_train`] with routing replay: with `replay` (one trace per sequence,
    /// covering every input position), every MoE layer uses the given expert ids and
    /// recomputes their combine weights from its current router probabilities (the model's
    /// `ReplayKind::Ids`), so the router still trains.
    ///
    /// # Errors
    /// As [`Engine::logprobs`]; a trace of the wrong shape or with an expert id out of range.
    pub fn forward_train_replay(
        &self,
        batch: &[SeqInput<'_>],
        temperature: f32,
        replay: Option<&[RoutingTrace]>,
    ) -> Result<(Vec<Vec<f32>>, Tape<B>)> {
        self.forward_train_probed(batch, temperature, replay, None)
    }

    /// [`Engine::forward_train_replay`] that also keeps, per layer, the residual stream after
    /// it at the last `probe_last[s]` positions of every sequence `s` (read with
    /// [`Engine::probes`]).
    ///
    /// # Errors
    /// As [`Engine::forward_train_replay`]; more probed positions than a sequence has.
    pub fn forward_train_probed(
        &self,
        batch: &[SeqInput<'_>],
        temperature: f32,
        replay: Option<&[RoutingTrace]>,
        probe_last: Option<&[usize]>,
    ) -> Result<(Vec<Vec<f32>>, Tape<B>)> {
        if batch.iter().all(|s| s.tokens.is_empty()) {
            return Err(ModelError::Input(
                "training forward of an empty batch".into(),
            ));
        }
        let (tape, lp) = self.run_forward(batch, temperature, replay, probe_last)?;
        let out = self.split(&tape.layout, &lp)?;
        Ok((out, tape))
    }

    /// Per MoE layer, the replayed expert ids of the packed rows `[N, k]` on the device.
    fn replay_tables(
        &self,
        traces: &[RoutingTrace],
        layout: &SeqLayout,
    ) -> Result<Vec<Option<B::U32>>> {
        let c = &self.cfg;
        let (ne, k) = (c.num_experts, c.num_experts_per_tok);
        if traces.len() != layout.num_seqs() {
            return Err(ModelError::Input(format!(
                "routing replay: {} traces for {} sequences",
                traces.len(),
                layout.num_seqs()
            )));
        }
        let mut moe = 0;
        (0..c.num_layers)
            .map(|li| {
                if !c.is_moe_layer(li) {
                    return Ok(None);
                }
                moe += 1;
                let mut ids = Vec::with_capacity(layout.num_tokens() * k);
                for (s, t) in traces.iter().enumerate() {
                    let r = t.layers.get(moe - 1).ok_or_else(|| {
                        ModelError::Input(format!(
                            "routing replay: sequence {s} has no routes for MoE layer {li}"
                        ))
                    })?;
                    if r.top_k != k || r.ids.len() != layout.len(s) * k {
                        return Err(ModelError::Input(format!(
                            "routing replay: sequence {s}, layer {li}: {} ids of top-{}, \
                             expected {} tokens × top-{k}",
                            r.ids.len(),
                            r.top_k,
                            layout.len(s)
                        )));
                    }
                    if let Some(&bad) = r.ids.iter().find(|&&x| x as usize >= ne) {
                        return Err(ModelError::Input(format!(
                            "routing replay: sequence {s}, layer {li}: expert {bad} out of \
                             range for {ne} experts"
                        )));
                    }
                    ids.extend_from_slice(&r.ids);
                }
                Ok(Some(self.b.upload_u32(&ids).map_err(dev)?))
            })
            .collect()
    }

    /// Embeds and runs every layer over packed sequences (positions from 0 in each), filling
    /// `cache`; returns the final-norm hidden states `[n, H]` f32, or with a cache only each
    /// sequence's last row `[sequences, H]` (what the head reads to sample).
    fn prefill_hidden(
        &self,
        tokens: &[u32],
        pos: &[u32],
        layout: &SeqLayout,
        cache: Option<&mut DecodeState<B>>,
    ) -> Result<B::F32> {
        let b = &self.b;
        let n = tokens.len();
        let hd = self.cfg.hidden_size;
        let tk = b.upload_u32(tokens).map_err(dev)?;
        let ps = b.upload_u32(pos).map_err(dev)?;
        let offsets = b.upload_u32(&seq_offsets(layout)).map_err(dev)?;
        let mut x = b.zeros_f32(n * hd).map_err(dev)?;
        b.embed(self.w(self.embed), self.cfg.vocab_size, &tk, n, hd, &mut x)
            .map_err(dev)?;
        let seq = match &cache {
            Some(_) => {
                let rows: Vec<u32> = (0..layout.num_seqs())
                    .flat_map(|s| std::iter::repeat_n(s as u32, layout.len(s)))
                    .collect();
                Some(b.upload_u32(&rows).map_err(dev)?)
            }
            None => None,
        };
        let mut pass = Pass::Prefill {
            layout,
            offsets: &offsets,
            pos: &ps,
            cache,
            seq: seq.as_ref(),
            replay: None,
            tape: false,
        };
        for li in 0..self.layers.len() {
            x = self.layer(li, n, x, &mut pass)?.0;
            // The prompt's last position predicts the first new token: its probe.
            if let Pass::Prefill {
                cache: Some(st),
                seq: Some(seq),
                ..
            } = &mut pass
            {
                if let Some(pt) = st.probes.as_mut() {
                    b.capture_rows(
                        &x,
                        n,
                        hd,
                        Some(*seq),
                        &ps,
                        &pt.first,
                        pt.slots,
                        pt.len,
                        &mut pt.layers[li],
                    )
                    .map_err(dev)?;
                }
            }
        }
        let mut hf = b.zeros_f32(n * hd).map_err(dev)?;
        let mut rstd = b.zeros_f32(n).map_err(dev)?;
        b.rmsnorm(
            &x,
            self.w(self.norm),
            n,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut rstd,
        )
        .map_err(dev)?;
        let Some(seq) = seq else {
            return Ok(hf);
        };
        // With a decode state only each sequence's last row feeds the head: gathered on the
        // device (a plain copy; row r of sequence seq[r] at position pos[r] goes to slot seq[r]
        // when pos[r] = len − 1, the positions counting from 0 in every sequence).
        let slots = layout.num_seqs();
        let last_pos: Vec<u32> = (0..slots).map(|s| layout.len(s) as u32 - 1).collect();
        let last_pos = b.upload_u32(&last_pos).map_err(dev)?;
        let mut last = b.empty_f32(slots * hd).map_err(dev)?;
        b.capture_rows(&hf, n, hd, Some(&seq), &ps, &last_pos, slots, 1, &mut last)
            .map_err(dev)?;
        Ok(last)
    }

    /// Logits `[rows, V]` (f32, into `out`) of final hidden states `hf: [rows, H]`.
    fn head_into(&self, hf: &B::F32, rows: usize, out: &mut B::F32) -> Result<()> {
        let b = &self.b;
        let (hd, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let mut hb = b.empty_bf16(rows * hd).map_err(dev)?;
        b.to_bf16(hf, &mut hb, rows * hd).map_err(dev)?;
        b.linear(&hb, self.op(self.head), rows, hd, v, out)
            .map_err(dev)
    }

    /// Record decode steps as device graphs and replay them (default on; the CPU has none).
    /// Off, every step runs op by op: the same kernels on the same buffers, so the same bits.
    pub fn set_decode_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// Prefill every distinct prompt of a generation once (default on): the slots that decode
    /// the same prompt (a group's samples) take copies of its KV-cache rows, logits, routes
    /// and probe. Off, every slot's prompt is prefilled as its own sequence. The two agree
    /// bit for bit where a sequence's prefill does not depend on the batch beside it (the
    /// CPU backend); on a GPU the kernels are chosen by the batch's shape, so the prefill's
    /// sums (and from them the sampled tokens) may differ between the two.
    pub fn set_shared_prefill(&mut self, on: bool) {
        self.shared_prefill = on;
    }

    /// Adds `coef ·` the auxiliary load-balancing loss (HF `load_balancing_loss_func` over the
    /// MoE layers of each forward, as `Model::backward`'s `aux_loss_coef`) to the loss
    /// [`Engine::backward`] differentiates; 0 (the default) adds none.
    ///
    /// # Errors
    /// A negative or non-finite coefficient.
    pub fn set_aux_loss_coef(&mut self, coef: f32) -> Result<()> {
        crate::model::check_aux_loss_coef(coef)?;
        self.aux_coef = coef;
        Ok(())
    }

    /// The auxiliary loss coefficient ([`Engine::set_aux_loss_coef`]).
    pub fn aux_loss_coef(&self) -> f32 {
        self.aux_coef
    }

    fn step_io(&self, slots: usize) -> Result<StepIo<B>> {
        let b = &self.b;
        let v = self.cfg.vocab_size;
        Ok(StepIo {
            tokens: b.zeros_u32(slots).map_err(dev)?,
            pos: b.zeros_u32(slots).map_err(dev)?,
            lens: b.zeros_u32(slots).map_err(dev)?,
            logits: b.zeros_f32(slots * v).map_err(dev)?,
            ids: b.zeros_u32(slots).map_err(dev)?,
            lps: b.zeros_f32(slots).map_err(dev)?,
            graph: GraphState::None,
            plain_steps: 0,
        })
    }

    /// Prefills `prompts` into a new decode state with room for `max_len` tokens per
    /// sequence; the logits of every prompt's last position are left in the state's buffer.
    /// A prompt that several slots hold is prefilled once ([`Engine::set_shared_prefill`]).
    fn prefill_state(
        &self,
        prompts: &[&[u32]],
        max_len: usize,
        capture: Record,
        new_tokens: usize,
    ) -> Result<DecodeState<B>> {
        if max_len > self.max_pos {
            return Err(ModelError::Input(format!(
                "max_len {max_len} exceeds the engine's max positions {}",
                self.max_pos
            )));
        }
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        if let Some(i) = lens.iter().position(|&l| l == 0 || l > max_len) {
            return Err(ModelError::Input(format!(
                "prompt {i} has {} tokens (1..={max_len} allowed)",
                lens[i]
            )));
        }
        let (distinct, src) = distinct_prompts(prompts);
        let mut st = self.new_state(&lens, max_len, capture, new_tokens)?;
        if !self.shared_prefill || distinct.len() == prompts.len() {
            self.prefill_into(prompts, &mut st)?;
            return Ok(st);
        }
        // The distinct prompts in a state of their own (their cache as long as the longest,
        // a probe table of their first index only), then copied to the slots that hold them.
        let dl: Vec<usize> = distinct.iter().map(|p| p.len()).collect();
        let longest = dl.iter().copied().max().unwrap_or(1);
        let cap = Record {
            routes: capture.routes,
            probes: if capture.probes > 0 {
                distinct.len()
            } else {
                0
            },
        };
        let mut once = self.new_state(&dl, longest, cap, 1)?;
        self.prefill_into(&distinct, &mut once)?;
        self.share_prefill(&once, &src, &mut st)?;
        st.prefilled = once.prefilled;
        Ok(st)
    }

    /// The KV cache of layer `layer` of `st` as BF16 bits, keys then values, each `[slots,
    /// max_len, Hkv·D]` (positions a sequence has not reached hold zeros), e.g. to check
    /// what a prefill wrote.
    ///
    /// # Errors
    /// No such layer; device failures.
    pub fn kv_cache(&self, st: &DecodeState<B>, layer: usize) -> Result<(Vec<u16>, Vec<u16>)> {
        if layer >= st.k.len() {
            return Err(ModelError::Input(format!(
                "kv_cache: layer {layer} of {}",
                st.k.len()
            )));
        }
        let n = st.lens.len() * st.max_len * self.cfg.num_kv_heads * self.cfg.head_dim;
        let k = self.b.download_bf16(&st.k[layer], n).map_err(dev)?;
        let v = self.b.download_bf16(&st.v[layer], n).map_err(dev)?;
        Ok((k, v))
    }

    /// A decode state for sequences of `lens` tokens with room for `max_len` each: zeroed
    /// caches, step buffers, and the route and probe tables `capture` asks for.
    fn new_state(
        &self,
        lens: &[usize],
        max_len: usize,
        capture: Record,
        new_tokens: usize,
    ) -> Result<DecodeState<B>> {
        let b = &self.b;
        let kvd = self.cfg.num_kv_heads * self.cfg.head_dim;
        let slots = lens.len();
        Ok(DecodeState {
            k: (0..self.layers.len())
                .map(|_| b.zeros_bf16(slots * max_len * kvd).map_err(dev))
                .collect::<Result<_>>()?,
            v: (0..self.layers.len())
                .map(|_| b.zeros_bf16(slots * max_len * kvd).map_err(dev))
                .collect::<Result<_>>()?,
            lens: lens.iter().map(|&l| l as u32).collect(),
            max_len,
            io: self.step_io(slots)?,
            routes: if capture.routes {
                let kk = self.cfg.num_experts_per_tok;
                (0..self.layers.len())
                    .map(|li| {
                        if !self.cfg.is_moe_layer(li) {
                            return Ok(None);
                        }
                        Ok(Some((
                            b.zeros_u32(slots * max_len * kk).map_err(dev)?,
                            b.zeros_f32(slots * max_len * kk).map_err(dev)?,
                        )))
                    })
                    .collect::<Result<_>>()?
            } else {
                Vec::new()
            },
            probes: if capture.probes > 0 {
                let ps = capture.probes.min(slots);
                let first: Vec<u32> = lens[..ps].iter().map(|&l| l as u32 - 1).collect();
                let cells = ps * new_tokens * self.cfg.hidden_size;
                Some(ProbeTable {
                    first: b.upload_u32(&first).map_err(dev)?,
                    slots: ps,
                    len: new_tokens,
                    layers: (0..self.layers.len())
                        .map(|_| b.zeros_f32(cells).map_err(dev))
                        .collect::<Result<_>>()?,
                })
            } else {
                None
            },
            prefilled: 0,
        })
    }

    /// Prefills `prompts` (slot `s` holds `prompts[s]`) into `st`, made by
    /// [`Engine::new_state`] for their lengths: caches, recorded routes and probes, and the
    /// logits of every prompt's last position.
    fn prefill_into(&self, prompts: &[&[u32]], st: &mut DecodeState<B>) -> Result<()> {
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let layout = SeqLayout::new(&lens);
        let tokens: Vec<u32> = prompts.iter().flat_map(|p| p.iter().copied()).collect();
        self.check_tokens(&tokens, "prompt")?;
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        let last = self.prefill_hidden(&tokens, &pos, &layout, Some(st))?;
        st.prefilled = tokens.len();
        self.head_into(&last, prompts.len(), &mut st.io.logits)
    }

    /// Fills `st` (fresh from [`Engine::new_state`]) from `once`, the prefill of the distinct
    /// prompts: slot `s` takes distinct prompt `src[s]`'s cache rows, recorded routes, logits
    /// and first probe, bit for bit.
    fn share_prefill(
        &self,
        once: &DecodeState<B>,
        src: &[usize],
        st: &mut DecodeState<B>,
    ) -> Result<()> {
        let b = &self.b;
        let slots = src.len();
        let idx = |i: usize| {
            u32::try_from(i).map_err(|_| {
                ModelError::Input(format!(
                    "{slots} slots of {} positions are too many to share a prefill",
                    st.max_len
                ))
            })
        };
        // Position p of slot s: cache row s·max_len + p, route table row p·slots + s.
        let (mut rows, mut cells) = (Vec::new(), Vec::new());
        for (s, &d) in src.iter().enumerate() {
            for p in 0..st.lens[s] as usize {
                rows.extend([idx(d * once.max_len + p)?, idx(s * st.max_len + p)?]);
                cells.extend([idx(p * once.lens.len() + d)?, idx(p * slots + s)?]);
            }
        }
        let count = rows.len() / 2;
        let kvd = self.cfg.num_kv_heads * self.cfg.head_dim;
        let map = b.upload_u32(&rows).map_err(dev)?;
        for li in 0..self.layers.len() {
            b.copy_blocks_bf16(&once.k[li], &mut st.k[li], &map, kvd, count)
                .map_err(dev)?;
            b.copy_blocks_bf16(&once.v[li], &mut st.v[li], &map, kvd, count)
                .map_err(dev)?;
        }
        if !st.routes.is_empty() {
            let kk = self.cfg.num_experts_per_tok;
            let map = b.upload_u32(&cells).map_err(dev)?;
            for (from, to) in once.routes.iter().zip(st.routes.iter_mut()) {
                if let (Some((fi, fw)), Some((ti, tw))) = (from, to) {
                    b.copy_blocks_u32(fi, ti, &map, kk, count).map_err(dev)?;
                    b.copy_blocks_f32(fw, tw, &map, kk, count).map_err(dev)?;
                }
            }
        }
        // Slot s's logits and first probe (index 0 of the tables) from distinct prompt src[s].
        let pairs: Vec<u32> = src
            .iter()
            .enumerate()
            .map(|(s, &d)| Ok([idx(d)?, idx(s)?]))
            .collect::<Result<Vec<_>>>()?
            .concat();
        let map = b.upload_u32(&pairs).map_err(dev)?;
        b.copy_blocks_f32(
            &once.io.logits,
            &mut st.io.logits,
            &map,
            self.cfg.vocab_size,
            slots,
        )
        .map_err(dev)?;
        if let (Some(from), Some(to)) = (&once.probes, &mut st.probes) {
            for (f, t) in from.layers.iter().zip(to.layers.iter_mut()) {
                b.copy_blocks_f32(f, t, &map, self.cfg.hidden_size, to.slots)
                    .map_err(dev)?;
            }
        }
        Ok(())
    }

    /// Logits `[T, V]` (f32, on the host) of every position of one sequence.
    ///
    /// # Errors
    /// An empty sequence or one longer than the engine's `max_pos`, bad token ids, device
    /// failures.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let t = tokens.len();
        if t == 0 || t > self.max_pos {
            return Err(ModelError::Input(format!(
                "{t} tokens (1..={} allowed)",
                self.max_pos
            )));
        }
        self.check_tokens(tokens, "input")?;
        let layout = SeqLayout::new(&[t]);
        let pos: Vec<u32> = (0..t as u32).collect();
        let hf = self.prefill_hidden(tokens, &pos, &layout, None)?;
        let v = self.cfg.vocab_size;
        let mut z = self.b.empty_f32(t * v).map_err(dev)?;
        self.head_into(&hf, t, &mut z)?;
        self.b.download_f32(&z, t * v).map_err(dev)
    }

    /// Logits `[rows, V]` (f32, on the host) of residual-stream rows `h: [rows, H]`: the final
    /// norm and the head, as prefill and decode apply them to the last layer's output (e.g.
    /// to read a recorded probe, [`Recorded::probes`]).
    ///
    /// # Errors
    /// `h` not `rows × H` values; device failures.
    pub fn head_logits(&self, h: &[f32], rows: usize) -> Result<Vec<f32>> {
        let b = &self.b;
        let (hd, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        if h.len() != rows * hd {
            return Err(ModelError::Input(format!(
                "head_logits: {} values for {rows} rows of width {hd}",
                h.len()
            )));
        }
        let x = b.upload_f32(h).map_err(dev)?;
        let mut hf = b.empty_f32(rows * hd).map_err(dev)?;
        let mut rstd = b.empty_f32(rows).map_err(dev)?;
        b.rmsnorm(
            &x,
            self.w(self.norm),
            rows,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut rstd,
        )
        .map_err(dev)?;
        let mut z = b.empty_f32(rows * v).map_err(dev)?;
        self.head_into(&hf, rows, &mut z)?;
        b.download_f32(&z, rows * v).map_err(dev)
    }

    /// Prefills `prompts` into a new decode state with room for `max_len` tokens per
    /// sequence; returns it and the logits `[B, V]` of every prompt's last position.
    ///
    /// # Errors
    /// Empty prompts, prompts longer than `max_len` or the engine's `max_pos`, bad token
    /// ids, device failures (out of memory for the cache).
    pub fn prefill(
        &self,
        prompts: &[&[u32]],
        max_len: usize,
    ) -> Result<(DecodeState<B>, Vec<f32>)> {
        let st = self.prefill_state(prompts, max_len, Record::default(), 0)?;
        let logits = self
            .b
            .download_f32(&st.io.logits, prompts.len() * self.cfg.vocab_size)
            .map_err(dev)?;
        Ok((st, logits))
    }

    /// As [`Engine::prefill`], then samples each prompt's first new token on the device with
    /// `p` (only the ids and their logprobs come back).
    ///
    /// # Errors
    /// As [`Engine::prefill`]; invalid sampling parameters.
    pub fn prefill_sample(
        &self,
        prompts: &[&[u32]],
        max_len: usize,
        p: &SampleParams,
    ) -> Result<(DecodeState<B>, Vec<u32>, Vec<f32>)> {
        p.validate().map_err(ModelError::Input)?;
        let mut st = self.prefill_state(prompts, max_len, Record::default(), 0)?;
        let (ids, lps) = self.sample_state(&mut st, p)?;
        Ok((st, ids, lps))
    }

    fn sample_state(
        &self,
        st: &mut DecodeState<B>,
        p: &SampleParams,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let b = &self.b;
        let n = st.lens.len();
        let io = &mut st.io;
        b.sample(
            &io.logits,
            n,
            self.cfg.vocab_size,
            p,
            &mut io.ids,
            &mut io.lps,
        )
        .map_err(dev)?;
        let ids = b.download_u32(&io.ids, n).map_err(dev)?;
        let lps = b.download_f32(&io.lps, n).map_err(dev)?;
        Ok((ids, lps))
    }

    /// The device work of one decode step: embedding of `io.tokens` → layers (appending to the
    /// caches) → final norm → head into `io.logits`. Issues no host transfer, so it can be
    /// recorded; every buffer it allocates is freed before it returns.
    #[allow(clippy::too_many_arguments)]
    fn decode_body(
        &self,
        k: &mut [B::Bf16],
        v: &mut [B::Bf16],
        routes: &mut [Option<(B::U32, B::F32)>],
        mut probes: Option<&mut ProbeTable<B>>,
        max_len: usize,
        io: &mut StepIo<B>,
        n: usize,
    ) -> Result<()> {
        let b = &self.b;
        let hd = self.cfg.hidden_size;
        let mut x = b.empty_f32(n * hd).map_err(dev)?;
        b.embed(
            self.w(self.embed),
            self.cfg.vocab_size,
            &io.tokens,
            n,
            hd,
            &mut x,
        )
        .map_err(dev)?;
        {
            let mut pass = Pass::Decode {
                k,
                v,
                max_len,
                lens: &io.lens,
                batch: n,
                pos: &io.pos,
                routes,
            };
            for li in 0..self.layers.len() {
                x = self.layer(li, n, x, &mut pass)?.0;
                // Row r fed position pos[r], which predicts the next token: its probe (the
                // positions are read on the device, so the recorded step replays it).
                if let Some(pt) = probes.as_deref_mut() {
                    b.capture_rows(
                        &x,
                        n,
                        hd,
                        None,
                        &io.pos,
                        &pt.first,
                        pt.slots.min(n),
                        pt.len,
                        &mut pt.layers[li],
                    )
                    .map_err(dev)?;
                }
            }
        }
        let mut hf = b.empty_f32(n * hd).map_err(dev)?;
        let mut rstd = b.empty_f32(n).map_err(dev)?;
        b.rmsnorm(
            &x,
            self.w(self.norm),
            n,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut rstd,
        )
        .map_err(dev)?;
        drop(x);
        self.head_into(&hf, n, &mut io.logits)
    }

    /// Appends `tokens[b]` to sequence `b` and leaves the next position's logits in the
    /// state's buffer: replays the recorded step where there is one, records it on the second
    /// step, else runs op by op.
    fn advance(&self, st: &mut DecodeState<B>, tokens: &[u32]) -> Result<()> {
        let b = &self.b;
        let n = tokens.len();
        if n != st.lens.len() {
            return Err(ModelError::Input(format!(
                "{n} tokens for {} sequences",
                st.lens.len()
            )));
        }
        if let Some(i) = st.lens.iter().position(|&l| l as usize >= st.max_len) {
            return Err(ModelError::Input(format!(
                "sequence {i} is full ({} tokens)",
                st.max_len
            )));
        }
        self.check_tokens(tokens, "decode")?;
        let new_lens: Vec<u32> = st.lens.iter().map(|&l| l + 1).collect();
        let DecodeState {
            k,
            v,
            lens,
            max_len,
            io,
            routes,
            probes,
            ..
        } = st;
        b.write_u32(&mut io.tokens, tokens).map_err(dev)?;
        b.write_u32(&mut io.pos, lens).map_err(dev)?;
        b.write_u32(&mut io.lens, &new_lens).map_err(dev)?;
        if !self.graphs {
            self.decode_body(k, v, routes, probes.as_mut(), *max_len, io, n)?;
        } else if let GraphState::Ready(g) = &io.graph {
            b.launch_graph(g).map_err(dev)?;
        } else if matches!(io.graph, GraphState::None)
            && io.plain_steps >= 1
            && b.begin_capture().map_err(dev)?
        {
            // Record (nothing runs while recording), then run the recording.
            let body = self.decode_body(k, v, routes, probes.as_mut(), *max_len, io, n);
            let ended = b.end_capture();
            match (body, ended) {
                (Ok(()), Ok(Some(g))) => {
                    b.launch_graph(&g).map_err(dev)?;
                    io.graph = GraphState::Ready(g);
                }
                (body, ended) => {
                    let why = match (body, ended) {
                        (Err(e), _) => e.to_string(),
                        (_, Err(e)) => e.to_string(),
                        _ => "nothing was recorded".to_string(),
                    };
                    io.graph = GraphState::Failed(why);
                    self.decode_body(k, v, routes, probes.as_mut(), *max_len, io, n)?;
                }
            }
        } else {
            self.decode_body(k, v, routes, probes.as_mut(), *max_len, io, n)?;
            io.plain_steps += 1;
        }
        *lens = new_lens;
        Ok(())
    }

    /// One decode step: appends `tokens[b]` to sequence `b` and returns the logits `[B, V]`
    /// of the next position.
    ///
    /// # Errors
    /// A full cache, bad token ids, device failures.
    pub fn decode_step(&self, st: &mut DecodeState<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        self.advance(st, tokens)?;
        self.b
            .download_f32(&st.io.logits, tokens.len() * self.cfg.vocab_size)
            .map_err(dev)
    }

    /// One decode step that samples on the device: appends `tokens[b]` to sequence `b` and
    /// returns the next token of every sequence and its logprob (sampled with `p`; the logits
    /// stay on the device).
    ///
    /// # Errors
    /// A full cache, bad token ids, invalid sampling parameters, device failures.
    pub fn decode_sample(
        &self,
        st: &mut DecodeState<B>,
        tokens: &[u32],
        p: &SampleParams,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        p.validate().map_err(ModelError::Input)?;
        self.advance(st, tokens)?;
        self.sample_state(st, p)
    }

    /// Samples up to `new_tokens` tokens after each prompt, on the device: the first from the
    /// prefill's logits, then one per decode step; step `t` (0 for the first token) draws
    /// with `SampleParams { step: p.step + t, ..p }`. A sequence stops after sampling one of
    /// `stop` (included in its tokens); the batch stops when every sequence has.
    ///
    /// # Errors
    /// As [`Engine::prefill_sample`] and [`Engine::decode_sample`].
    pub fn generate(
        &self,
        prompts: &[&[u32]],
        new_tokens: usize,
        p: &SampleParams,
        stop: &[u32],
    ) -> Result<Vec<Sampled>> {
        let mut timing = GenTiming::default();
        Ok(self
            .generate_inner(prompts, new_tokens, p, stop, Record::default(), &mut timing)?
            .0)
    }

    /// [`Engine::generate`] that also returns, per prompt, the routes of every position it
    /// fed to the model (the prompt and every new token but the last), recorded on the device
    /// during prefill and decode (in the recorded step too) and read back once at the end.
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub fn generate_capturing(
        &self,
        prompts: &[&[u32]],
        new_tokens: usize,
        p: &SampleParams,
        stop: &[u32],
    ) -> Result<Vec<(Sampled, RoutingTrace)>> {
        let rec = Record {
            routes: true,
            probes: 0,
        };
        Ok(self
            .generate_recording(prompts, new_tokens, p, stop, rec)?
            .into_iter()
            .map(|r| (r.sampled, r.routes.expect("routes were recorded")))
            .collect())
    }

    /// [`Engine::generate`] that also records, on the device during prefill and decode (in
    /// the recorded step too), what `rec` asks for — the routes of every fed position, the
    /// residual stream after every layer at the response-predicting positions — and reads it
    /// back once at the end. Tokens and logprobs are [`Engine::generate`]'s.
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub fn generate_recording(
        &self,
        prompts: &[&[u32]],
        new_tokens: usize,
        p: &SampleParams,
        stop: &[u32],
        rec: Record,
    ) -> Result<Vec<Recorded>> {
        Ok(self.generate_timed(prompts, new_tokens, p, stop, rec)?.0)
    }

    /// [`Engine::generate_recording`] that also says where its time went.
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub fn generate_timed(
        &self,
        prompts: &[&[u32]],
        new_tokens: usize,
        p: &SampleParams,
        stop: &[u32],
        rec: Record,
    ) -> Result<(Vec<Recorded>, GenTiming)> {
        let mut timing = GenTiming::default();
        let (out, st) = self.generate_inner(prompts, new_tokens, p, stop, rec, &mut timing)?;
        let t_read = std::time::Instant::now();
        let fed: Vec<usize> = prompts
            .iter()
            .zip(&out)
            .map(|(q, s)| q.len() + s.tokens.len().saturating_sub(1))
            .collect();
        let mut traces = match (&st, rec.routes) {
            (_, false) => None,
            (Some(st), true) => Some(self.traces_of(st, &fed)?),
            // Nothing was generated: no position was fed.
            (None, true) => Some(vec![RoutingTrace::zeros(&self.cfg, 0); prompts.len()]),
        }
        .map(|t| t.into_iter().map(Some).collect::<Vec<_>>());
        let mut probes = match (&st, rec.probes) {
            (_, 0) => None,
            (Some(st), _) => {
                let lens: Vec<usize> = out.iter().map(|s| s.tokens.len()).collect();
                Some(self.probes_of(st, &lens)?)
            }
            (None, n) => Some(vec![Vec::new(); n.min(prompts.len())]),
        }
        .map(|t| t.into_iter().map(Some).collect::<Vec<_>>());
        timing.readback_s = t_read.elapsed().as_secs_f64();
        let recorded = out
            .into_iter()
            .enumerate()
            .map(|(i, sampled)| Recorded {
                sampled,
                routes: traces.as_mut().and_then(|t| t[i].take()),
                probes: probes
                    .as_mut()
                    .and_then(|t| t.get_mut(i).and_then(Option::take)),
            })
            .collect();
        Ok((recorded, timing))
    }

    /// The recorded probes of `st`'s first sequences (those the table holds): per sequence,
    /// per layer the first `lens[s]` rows `[lens[s], H]`.
    fn probes_of(&self, st: &DecodeState<B>, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        let pt = st
            .probes
            .as_ref()
            .ok_or_else(|| ModelError::Input("no probes were recorded".into()))?;
        let hd = self.cfg.hidden_size;
        let lens = &lens[..pt.slots.min(lens.len())];
        // Each sequence's layers one after another, copied once from the read-back buffer.
        let mut out: Vec<Vec<f32>> = lens
            .iter()
            .map(|&l| Vec::with_capacity(pt.layers.len() * l.min(pt.len) * hd))
            .collect();
        // The table's first indices, up to the longest response (index-major: one prefix),
        // read back into the backend's host buffer; each sequence's rows are copied from
        // there (index i of slot s at table row i·slots + s).
        let slots = pt.slots;
        let most = lens.iter().copied().max().unwrap_or(0).min(pt.len);
        for t in &pt.layers {
            self.b
                .download_f32_with(t, most * slots * hd, &mut |all| {
                    for (s, o) in out.iter_mut().enumerate() {
                        for i in 0..lens[s].min(pt.len) {
                            let a = (i * slots + s) * hd;
                            o.extend_from_slice(&all[a..a + hd]);
                        }
                    }
                })
                .map_err(dev)?;
        }
        Ok(out)
    }

    /// The routes the model takes at every position of each sequence (one prefill of the
    /// batch with route capture), e.g. to compare a trainer's own routing with a rollout's.
    ///
    /// # Errors
    /// Empty sequences, sequences longer than `max_pos`, bad token ids, device failures.
    pub fn routes_of(&self, seqs: &[&[u32]]) -> Result<Vec<RoutingTrace>> {
        let longest = seqs.iter().map(|q| q.len()).max().unwrap_or(0);
        let rec = Record {
            routes: true,
            probes: 0,
        };
        let st = self.prefill_state(seqs, longest.max(1), rec, 0)?;
        let lens: Vec<usize> = seqs.iter().map(|q| q.len()).collect();
        self.traces_of(&st, &lens)
    }

    /// The captured routes of `st`'s sequences, the first `fed[s]` positions of each.
    fn traces_of(&self, st: &DecodeState<B>, fed: &[usize]) -> Result<Vec<RoutingTrace>> {
        let k = self.cfg.num_experts_per_tok;
        let mut traces: Vec<RoutingTrace> = fed
            .iter()
            .map(|&n| RoutingTrace::zeros(&self.cfg, n))
            .collect();
        // The tables' first positions, up to the longest sequence fed (position-major: one
        // prefix), each read back into the backend's host buffer; each sequence's cells are
        // copied from there (position p of sequence s at table row p·slots + s).
        let slots = st.lens.len();
        let most = fed.iter().copied().max().unwrap_or(0).min(st.max_len);
        let cells = most * slots * k;
        for (mi, (ti, tw)) in st.routes.iter().flatten().enumerate() {
            self.b
                .download_u32_with(ti, cells, &mut |ids| {
                    for (s, tr) in traces.iter_mut().enumerate() {
                        for p in 0..fed[s] {
                            let (a, d) = ((p * slots + s) * k, p * k);
                            tr.layers[mi].ids[d..d + k].copy_from_slice(&ids[a..a + k]);
                        }
                    }
                })
                .map_err(dev)?;
            self.b
                .download_f32_with(tw, cells, &mut |ws| {
                    for (s, tr) in traces.iter_mut().enumerate() {
                        for p in 0..fed[s] {
                            let (a, d) = ((p * slots + s) * k, p * k);
                            tr.layers[mi].weights[d..d + k].copy_from_slice(&ws[a..a + k]);
                        }
                    }
                })
                .map_err(dev)?;
        }
        Ok(traces)
    }

    fn generate_inner(
        &self,
        prompts: &[&[u32]],
        new_tokens: usize,
        p: &SampleParams,
        stop: &[u32],
        capture: Record,
        timing: &mut GenTiming,
    ) -> Result<(Vec<Sampled>, Option<DecodeState<B>>)> {
        let mut out = vec![
            Sampled {
                tokens: Vec::with_capacity(new_tokens),
                logprobs: Vec::with_capacity(new_tokens),
            };
            prompts.len()
        ];
        if new_tokens == 0 || prompts.is_empty() {
            return Ok((out, None));
        }
        let longest = prompts.iter().map(|q| q.len()).max().unwrap_or(0);
        p.validate().map_err(ModelError::Input)?;
        let t0 = std::time::Instant::now();
        let mut st = self.prefill_state(prompts, longest + new_tokens, capture, new_tokens)?;
        let (mut ids, mut lps) = self.sample_state(&mut st, p)?;
        timing.prefill_s = t0.elapsed().as_secs_f64();
        timing.prefill_tokens = st.prefilled as u64;
        let t1 = std::time::Instant::now();
        let mut done = vec![false; prompts.len()];
        for t in 0..new_tokens {
            for (i, o) in out.iter_mut().enumerate() {
                if !done[i] {
                    o.tokens.push(ids[i]);
                    o.logprobs.push(lps[i]);
                    done[i] = stop.contains(&ids[i]);
                }
            }
            if t + 1 == new_tokens || done.iter().all(|&d| d) {
                break;
            }
            let sp = SampleParams {
                step: p.step + t as u64 + 1,
                ..*p
            };
            (ids, lps) = self.decode_sample(&mut st, &ids, &sp)?;
            timing.decode_steps += 1;
        }
        timing.decode_s = t1.elapsed().as_secs_f64();
        Ok((out, Some(st)))
    }

    /// Greedy decoding of `new_tokens` tokens after each prompt (ties to the lowest id):
    /// the generated ids per prompt.
    ///
    /// # Errors
    /// As [`Engine::prefill`] and [`Engine::decode_step`].
    pub fn generate_greedy(&self, prompts: &[&[u32]], new_tokens: usize) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .generate(prompts, new_tokens, &SampleParams::greedy(), &[])?
            .into_iter()
            .map(|s| s.tokens)
            .collect())
    }
}

impl<B: Backend> Engine<B> {
    /// Allocates gradients and AdamW moments on the device (once; zero).
    ///
    /// # Errors
    /// Out of device memory.
    pub fn enable_training(&mut self) -> Result<()> {
        if self.train.is_some() {
            return Ok(());
        }
        if let Some(p) = self.params.iter().find(|p| p.master.is_none()) {
            return Err(no_master(&p.name));
        }
        let b = &self.b;
        let z = |p: &Param<B>| b.zeros_f32(p.len).map_err(dev);
        self.train = Some(TrainState {
            grads: self.params.iter().map(z).collect::<Result<_>>()?,
            pending_zero: vec![false; self.params.len()],
            m: self.params.iter().map(z).collect::<Result<_>>()?,
            v: self.params.iter().map(z).collect::<Result<_>>()?,
            step: 0,
            aux_loss: None,
            norm_parts: None,
        });
        Ok(())
    }

    /// Sets every gradient to zero. The routed experts' buffers are not touched here: they are
    /// marked pending, their first wgrad of the next backward overwrites them (`0 + Σ`, the
    /// same bits), and [`Engine::optimizer_step`] / [`Engine::grad_values`] see zeros where no
    /// backward wrote them.
    ///
    /// # Errors
    /// Training not enabled; device failure.
    pub fn zero_grads(&mut self) -> Result<()> {
        let b = &self.b;
        let st = self
            .train
            .as_mut()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        st.norm_parts = None;
        // The routed experts' gradients are only written by their wgrad, which takes a pending
        // zero as "overwrite"; the rest are zeroed here.
        let mut deferred = vec![false; self.params.len()];
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                deferred[m.gate_up] = true;
                deferred[m.down] = true;
            }
        }
        for (i, (g, p)) in st.grads.iter_mut().zip(&self.params).enumerate() {
            if deferred[i] {
                st.pending_zero[i] = true;
            } else {
                b.fill_zero(g, p.len).map_err(dev)?;
                st.pending_zero[i] = false;
            }
        }
        Ok(())
    }

    /// Zeroes the gradients [`Engine::zero_grads`] left pending (no backward wrote them).
    fn settle_grads(&mut self) -> Result<()> {
        let b = &self.b;
        if let Some(st) = self.train.as_mut() {
            for (i, p) in self.params.iter().enumerate() {
                if std::mem::replace(&mut st.pending_zero[i], false) {
                    b.fill_zero(&mut st.grads[i], p.len).map_err(dev)?;
                }
            }
        }
        Ok(())
    }

    /// Backward of a [`Engine::forward_train`] from `dlogprobs` (per sequence,
    /// `∂L/∂logprob[t]`): **accumulates** every parameter's gradient on the device (call
    /// [`Engine::zero_grads`] first for a fresh step). The order of every f32 operation is the
    /// CPU model's (`Model::backward`), so the CPU engine's gradients equal it bitwise.
    ///
    /// # Errors
    /// Training not enabled, `dlogprobs` of the wrong shape, device failures.
    pub fn backward(&mut self, tape: &Tape<B>, dlogprobs: &[Vec<f32>]) -> Result<()> {
        self.backward_with(tape, dlogprobs, false)
    }

    /// [`Engine::backward`] of the step's last micro-batch: every gradient is final once it
    /// returns, so the global gradient norm of the next [`Engine::optimizer_step`] starts
    /// here, each layer's buffers summed as soon as its backward is done (on a device, while
    /// the layers below run). The norm, and so the step, has the bits of `backward` followed
    /// by `optimizer_step`; a gradient written after this call (another backward,
    /// [`Engine::zero_grads`]) discards the early sums.
    ///
    /// # Errors
    /// As [`Engine::backward`].
    pub fn backward_last(&mut self, tape: &Tape<B>, dlogprobs: &[Vec<f32>]) -> Result<()> {
        self.backward_with(tape, dlogprobs, true)
    }

    fn backward_with(&mut self, tape: &Tape<B>, dlogprobs: &[Vec<f32>], last: bool) -> Result<()> {
        let layout = &tape.layout;
        if dlogprobs.len() != layout.num_seqs()
            || dlogprobs
                .iter()
                .zip(layout.lens())
                .any(|(d, &l)| d.len() != l)
        {
            return Err(ModelError::Input(format!(
                "dlogprobs: expected lengths {:?}, got {:?}",
                layout.lens(),
                dlogprobs.iter().map(|d| d.len()).collect::<Vec<_>>()
            )));
        }
        let mut st = self
            .train
            .take()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        // Early sums of an earlier backward_last no longer describe the gradients, nor does
        // its aux loss this backward's forward.
        st.norm_parts = None;
        st.aux_loss = None;
        let mut parts = None;
        let r = (|| {
            if last {
                let lens: Vec<usize> = self.params.iter().map(|p| p.len).collect();
                parts = Some(self.b.grad_norm_begin(&lens).map_err(dev)?);
            }
            self.backward_into(
                tape,
                dlogprobs,
                &mut st.grads,
                &mut st.pending_zero,
                parts.as_mut(),
            )
        })();
        let r = r.map(|aux| {
            st.norm_parts = parts;
            st.aux_loss = aux;
        });
        self.train = Some(st);
        r
    }

    /// The auxiliary load-balancing loss (HF `load_balancing_loss_func` over the MoE layers,
    /// not multiplied by the coefficient) of the forward whose backward ran last, when that
    /// backward added it ([`Engine::set_aux_loss_coef`] non-zero and a MoE layer); `None`
    /// otherwise. Reads one value from the device.
    ///
    /// # Errors
    /// Training not enabled; device failures.
    pub fn last_aux_loss(&self) -> Result<Option<f32>> {
        let st = self
            .train
            .as_ref()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        st.aux_loss
            .as_ref()
            .map(|l| Ok(self.b.download_f32(l, 1).map_err(dev)?[0]))
            .transpose()
    }

    fn backward_into(
        &self,
        tape: &Tape<B>,
        dlogprobs: &[Vec<f32>],
        g: &mut [B::F32],
        pending_zero: &mut [bool],
        mut norm_parts: Option<&mut B::NormParts>,
    ) -> Result<Option<B::F32>> {
        let b = &self.b;
        let c = &self.cfg;
        let layout = &tape.layout;
        let n = layout.num_tokens();
        let (hd, hq, hkv, d, v) = (
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
        );
        let (qd, kvd) = (hq * d, hkv * d);
        // `z`: zeroed, for outputs an op accumulates into; `o`: unspecified contents, for
        // outputs an op overwrites whole (every backend op says which in its contract).
        let z = |m: usize| b.zeros_f32(m).map_err(dev);
        let o = |m: usize| b.empty_f32(m).map_err(dev);
        let dlp: Vec<f32> = dlogprobs.iter().flatten().copied().collect();
        let dlp = b.upload_f32(&dlp).map_err(dev)?;
        let mut dhf = o(n * hd)?;
        b.head_backward(
            &tape.hfb,
            self.op(self.head),
            &tape.targets,
            &tape.lse,
            &dlp,
            n,
            hd,
            v,
            tape.temperature,
            &mut dhf,
            &mut g[self.head],
        )
        .map_err(dev)?;
        let mut dx = o(n * hd)?;
        b.rmsnorm_backward(
            &dhf,
            &tape.x_final,
            self.w(self.norm),
            &tape.rstd_final,
            n,
            hd,
            &mut dx,
            &mut g[self.norm],
        )
        .map_err(dev)?;
        // The auxiliary loss's gradient with respect to every MoE layer's router
        // probabilities: one `[E]` row, the same for every token and layer.
        let moe_routes: Vec<&RouteBufs<B>> = if self.aux_coef != 0.0 {
            tape.layers
                .iter()
                .filter_map(|t| match &t.ffn {
                    FfnTape::Moe { route, .. } => Some(route),
                    FfnTape::Dense { .. } => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        let (aux_loss, aux_grad) = if moe_routes.is_empty() {
            (None, None)
        } else {
            let (e, k) = (c.num_experts, c.num_experts_per_tok);
            let mut loss = o(1)?;
            let mut grad = o(e)?;
            b.aux_loss_grad(&moe_routes, n, e, k, self.aux_coef, &mut loss, &mut grad)
                .map_err(dev)?;
            (Some(loss), Some(grad))
        };
        let shape = self.shape();
        for (l, t) in self.layers.iter().zip(&tape.layers).rev() {
            // FFN block: x_out = x_mid + ffn(rmsnorm(x_mid))
            let mut dh2 = z(n * hd)?;
            match (&l.ffn, &t.ffn) {
                (Ffn::Dense(m), FfnTape::Dense { gu, act }) => {
                    let mut dact = o(n * m.f)?;
                    self.lin_bwd(
                        m.down,
                        ActRef::F32(&dx),
                        act.r(),
                        None,
                        n,
                        m.f,
                        hd,
                        &mut dact,
                        &mut g[m.down],
                        false,
                    )?;
                    let mut dgu = o(n * 2 * m.f)?;
                    b.swiglu_backward(&dact, gu, n, m.f, &mut dgu)
                        .map_err(dev)?;
                    let x = self.input(m.gate_up, t.h2b.as_ref(), t.h2.as_ref())?;
                    self.lin_bwd(
                        m.gate_up,
                        ActRef::F32(&dgu),
                        x,
                        None,
                        n,
                        hd,
                        2 * m.f,
                        &mut dh2,
                        &mut g[m.gate_up],
                        false,
                    )?;
                }
                (
                    Ffn::Moe(m),
                    FfnTape::Moe {
                        route,
                        host_offsets,
                        xg,
                        gu,
                        act,
                        y,
                    },
                ) => {
                    let ho = host_offsets.as_deref().ok_or_else(|| {
                        ModelError::Input("a training tape without host expert offsets".into())
                    })?;
                    let off = Some((&route.offsets, ho));
                    let (e, k) = (c.num_experts, c.num_experts_per_tok);
                    let rows = n * k;
                    // Overwritten by the combine backward.
                    let mut dweights = o(rows)?;
                    // Experts stored in BF16, and block formats whose backward multiplies
                    // only bf16(dy), take their output gradient as BF16 straight from the
                    // combine (and the gate/up gradient from SwiGLU); `lowp` needs the f32
                    // values.
                    let dy = if self.bf16_dy(m.down) {
                        let mut dyb = b.empty_bf16(rows * hd).map_err(dev)?;
                        b.combine_backward_bf16(
                            &dx,
                            y,
                            route,
                            n,
                            e,
                            k,
                            hd,
                            &mut dyb,
                            &mut dweights,
                        )
                        .map_err(dev)?;
                        Act::Bf16(dyb)
                    } else {
                        let mut dy = o(rows * hd)?;
                        b.combine_backward(&dx, y, route, n, e, k, hd, &mut dy, &mut dweights)
                            .map_err(dev)?;
                        Act::F32(dy)
                    };
                    let mut dact = o(rows * m.f)?;
                    self.lin_bwd(
                        m.down,
                        dy.r(),
                        act.r(),
                        off,
                        rows,
                        m.f,
                        hd,
                        &mut dact,
                        &mut g[m.down],
                        std::mem::replace(&mut pending_zero[m.down], false),
                    )?;
                    let dgu = if self.bf16_dy(m.gate_up) {
                        let mut dgub = b.empty_bf16(rows * 2 * m.f).map_err(dev)?;
                        b.swiglu_backward_bf16(&dact, gu, rows, m.f, &mut dgub)
                            .map_err(dev)?;
                        Act::Bf16(dgub)
                    } else {
                        let mut dgu = o(rows * 2 * m.f)?;
                        b.swiglu_backward(&dact, gu, rows, m.f, &mut dgu)
                            .map_err(dev)?;
                        Act::F32(dgu)
                    };
                    let mut dxg = o(rows * hd)?;
                    self.lin_bwd(
                        m.gate_up,
                        dgu.r(),
                        rows_made(xg.as_ref(), "the experts' gathered input")?.r(),
                        off,
                        rows,
                        hd,
                        2 * m.f,
                        &mut dxg,
                        &mut g[m.gate_up],
                        std::mem::replace(&mut pending_zero[m.gate_up], false),
                    )?;
                    b.gather_backward(&dxg, route, n, e, k, hd, &mut dh2)
                        .map_err(dev)?;
                    let mut dlogits = o(n * e)?;
                    b.router_backward(
                        &dweights,
                        route,
                        aux_grad.as_ref(),
                        n,
                        e,
                        k,
                        c.norm_topk_prob,
                        &mut dlogits,
                    )
                    .map_err(dev)?;
                    let mut dr = o(n * hd)?;
                    b.linear_backward(
                        &dlogits,
                        rows_made(t.h2b.as_ref(), "the router's BF16 input")?,
                        self.op(m.router),
                        n,
                        hd,
                        e,
                        Some(&mut dr),
                        &mut g[m.router],
                    )
                    .map_err(dev)?;
                    b.add(&mut dh2, &dr, n * hd).map_err(dev)?;
                }
                _ => unreachable!("tape layer kind matches the layer kind"),
            }
            let mut dxm = o(n * hd)?;
            b.rmsnorm_backward(
                &dh2,
                &t.x_mid,
                self.w(l.ln2),
                &t.rstd2,
                n,
                hd,
                &mut dxm,
                &mut g[l.ln2],
            )
            .map_err(dev)?;
            b.add(&mut dx, &dxm, n * hd).map_err(dev)?;
            // Attention block: x_mid = x_in + o(attn(rope(norm(q(h1))), ...)), h1 = rmsnorm(x_in)
            let mut datt = o(n * qd)?;
            let x = self.input(l.attn.o, t.attb.as_ref(), Some(&t.att))?;
            self.lin_bwd(
                l.attn.o,
                ActRef::F32(&dx),
                x,
                None,
                n,
                qd,
                hd,
                &mut datt,
                &mut g[l.attn.o],
                false,
            )?;
            let (mut dq, mut dk, mut dv) = (o(n * qd)?, o(n * kvd)?, o(n * kvd)?);
            b.attention_backward(
                &datt,
                &t.q,
                &t.k,
                &t.v,
                &t.att,
                &t.lse,
                layout,
                &tape.offsets,
                shape,
                &mut dq,
                &mut dk,
                &mut dv,
            )
            .map_err(dev)?;
            b.rope_backward(&mut dq, n, hq, d, &tape.pos, &self.rope)
                .map_err(dev)?;
            b.rope_backward(&mut dk, n, hkv, d, &tape.pos, &self.rope)
                .map_err(dev)?;
            if let (Some([nq, nk]), Some((qp, rq, kp, rk))) = (l.attn.qk_norm, &t.q_pre) {
                let mut dqp = o(n * qd)?;
                b.rmsnorm_backward(&dq, qp, self.w(nq), rq, n * hq, d, &mut dqp, &mut g[nq])
                    .map_err(dev)?;
                dq = dqp;
                let mut dkp = o(n * kvd)?;
                b.rmsnorm_backward(&dk, kp, self.w(nk), rk, n * hkv, d, &mut dkp, &mut g[nk])
                    .map_err(dev)?;
                dk = dkp;
            }
            let mut dh1 = o(n * hd)?;
            let mut tmp = o(n * hd)?;
            // q, k and v of one spec multiply one input: what their backwards take from the
            // f32 rows (bf16 of them, or the operand a backend keeps), made once.
            let spec = |i: usize| self.params[i].q.as_ref().map(|q| q.spec);
            let shared = match (spec(l.attn.q), t.h1.as_ref()) {
                (Some(s), Some(h1)) if spec(l.attn.k) == Some(s) && spec(l.attn.v) == Some(s) => {
                    if s.rounds_x_to_bf16() {
                        let mut xb = b.empty_bf16(n * hd).map_err(dev)?;
                        b.to_bf16(h1, &mut xb, n * hd).map_err(dev)?;
                        Some(Act::Bf16(xb))
                    } else if b.keeps_forward_operand(&s, hd) {
                        let op = b
                            .qlinear_backward_operand(h1, &s, &[0, n as u32], n, hd)
                            .map_err(dev)?;
                        Some(Act::Operand(op))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            for (j, (wi, dd, width)) in [
                (l.attn.q, &dq, qd),
                (l.attn.k, &dk, kvd),
                (l.attn.v, &dv, kvd),
            ]
            .into_iter()
            .enumerate()
            {
                if let Some(bias) = l.attn.bias {
                    b.bias_backward(dd, n, width, &mut g[bias[j]])
                        .map_err(dev)?;
                }
                let out = if j == 0 { &mut dh1 } else { &mut tmp };
                let x = match &shared {
                    Some(x) => x.r(),
                    None => self.input(wi, t.h1b.as_ref(), t.h1.as_ref())?,
                };
                self.lin_bwd(
                    wi,
                    ActRef::F32(dd),
                    x,
                    None,
                    n,
                    hd,
                    width,
                    out,
                    &mut g[wi],
                    false,
                )?;
                if j > 0 {
                    b.add(&mut dh1, &tmp, n * hd).map_err(dev)?;
                }
            }
            let mut dxi = o(n * hd)?;
            b.rmsnorm_backward(
                &dh1,
                &t.x_in,
                self.w(l.ln1),
                &t.rstd1,
                n,
                hd,
                &mut dxi,
                &mut g[l.ln1],
            )
            .map_err(dev)?;
            b.add(&mut dx, &dxi, n * hd).map_err(dev)?;
            if let Some(parts) = norm_parts.as_deref_mut() {
                // No later op of this backward writes this layer's gradients: their norm
                // partials may run alongside the layers below. A gradient still pending its
                // zero is not final yet (the optimizer step zeroes it, then sums it).
                let ready: Vec<(usize, &B::F32)> = l
                    .params
                    .clone()
                    .filter(|&i| !pending_zero[i])
                    .map(|i| (i, &g[i]))
                    .collect();
                b.grad_norm_add(parts, &ready).map_err(dev)?;
            }
        }
        b.embed_backward(&dx, &tape.tokens_dev, &tape.tokens, hd, &mut g[self.embed])
            .map_err(dev)?;
        Ok(aux_loss)
    }

    /// Global gradient norm, clipping to `max_norm` (when given, PyTorch's rule), then one
    /// AdamW step on every parameter with weight decay `weight_decay` on linear and embedding
    /// weights (0 on norms and biases); refreshes the BF16 GEMM operands in the same pass.
    /// Returns the norm before clipping. The clipping coefficient multiplies the gradients inside
    /// the AdamW pass (the gradient buffers keep the unclipped values).
    ///
    /// # Errors
    /// Training not enabled; a non-finite gradient norm (nothing is updated); device failure.
    pub fn optimizer_step(
        &mut self,
        cfg: &mxrl_tensor::optim::AdamWConfig,
        weight_decay: f32,
        max_norm: Option<f64>,
    ) -> Result<f64> {
        self.settle_grads()?;
        let b = &self.b;
        let st = self
            .train
            .as_mut()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        let norm = {
            let views: Vec<(&B::F32, usize)> = st
                .grads
                .iter()
                .zip(&self.params)
                .map(|(g, p)| (g, p.len))
                .collect();
            match st.norm_parts.take() {
                Some(parts) => b.grad_norm_finish(parts, &views).map_err(dev)?,
                None => b.grad_norm(&views).map_err(dev)?,
            }
        };
        if !norm.is_finite() {
            return Err(ModelError::Input(format!(
                "non-finite gradient norm {norm}: no parameter was updated"
            )));
        }
        // PyTorch's clip_grad_norm_ coefficient, applied inside the AdamW pass.
        let grad_scale = match max_norm {
            Some(mx) if mx / (norm + 1e-6) < 1.0 => (mx / (norm + 1e-6)) as f32,
            _ => 1.0,
        };
        st.step += 1;
        for (i, p) in self.params.iter_mut().enumerate() {
            let wd = if p.decay { weight_decay } else { 0.0 };
            let master = p.master.as_mut().ok_or_else(|| no_master(&p.name))?;
            match p.q.as_mut() {
                // Block-format linears: the new master and its stored weights in one call.
                Some(q) => {
                    let base = p.name.clone();
                    let groups = q.groups;
                    let name = move |g: usize| group_name(&base, g, groups);
                    let update = AdamWUpdate {
                        step: st.step,
                        cfg,
                        weight_decay: wd,
                        grad_scale,
                    };
                    let stored = StoredLayout {
                        groups,
                        n: q.n,
                        k: q.k,
                        spec: q.spec,
                        name: &name,
                        version: st.step,
                    };
                    q.w = b
                        .adamw_requantize(
                            master,
                            &st.grads[i],
                            &mut st.m[i],
                            &mut st.v[i],
                            &update,
                            p.op.as_mut(),
                            &stored,
                        )
                        .map_err(dev)?;
                }
                None => b
                    .adamw(
                        master,
                        &st.grads[i],
                        &mut st.m[i],
                        &mut st.v[i],
                        p.len,
                        st.step,
                        cfg,
                        wd,
                        grad_scale,
                        p.op.as_mut(),
                    )
                    .map_err(dev)?,
            }
            if let Some(c) = p.compute.as_mut() {
                b.round_bf16(master, c, p.len).map_err(dev)?;
            }
        }
        Ok(norm)
    }

    /// Runs every parameter at its BF16 value, as a BF16 recipe stores it: linear weights
    /// already multiply their BF16 operand; from now on norms, biases and the embedding (tied
    /// or not: a tied one's gather reads it beside the lm_head's BF16 operand) are read as
    /// `f32(bf16(master))` too (refreshed after every optimizer step and
    /// [`Engine::set_param_values`]), so the forward computes with exactly the values
    /// [`Engine::weights_bf16`] exports. The f32 masters keep the optimizer's updates.
    ///
    /// # Errors
    /// Out of device memory.
    pub fn use_bf16_params(&mut self) -> Result<()> {
        for i in 0..self.params.len() {
            // Block-format linears multiply their stored weights (and may hold no BF16
            // operand): they need no BF16 value either. A tied embedding is gathered as f32
            // beside its BF16 operand (the lm_head's): it gets the BF16 value too.
            if self.reads_master(i) {
                let c = self.b.zeros_f32(self.params[i].len).map_err(dev)?;
                self.params[i].compute = Some(c);
            }
            self.refresh_copies(i)?;
        }
        Ok(())
    }

    /// Frees what only training reads, for an engine that samples and scores (a rollout
    /// engine, a frozen reference): the f32 master of every parameter whose forward reads
    /// something else (a linear's BF16 operand, the BF16 value of a norm, bias or untied
    /// embedding, a block-format linear's stored weights), and the BF16 operand of
    /// block-format linears (only their `high_precision` backward multiplies it). Call it after
    /// [`Engine::use_bf16_params`] and [`Engine::apply_plan`]: at 4 or 6 bytes per weight, it
    /// is most of what such an engine held beyond its 2 (BF16) or fewer (stored) bytes. The
    /// forward's values are unchanged: a parameter the forward reads as f32 without a BF16
    /// value (before [`Engine::use_bf16_params`]: norms, biases, the embedding) keeps its
    /// master. Weight updates ([`Engine::install_host`],
    /// [`Engine::install_device`]) keep working; training, re-quantizing, setting values and
    /// reading masters ([`Engine::to_model`], [`Engine::param_values`]) are refused with an
    /// error naming the parameter. Returns the bytes freed.
    ///
    /// # Errors
    /// Training is enabled ([`Engine::enable_training`]).
    pub fn drop_masters(&mut self) -> Result<usize> {
        if self.train.is_some() {
            return Err(ModelError::Input(
                "drop_masters on an engine that trains: its optimizer updates the masters".into(),
            ));
        }
        let mut freed = 0;
        for i in 0..self.params.len() {
            if self.reads_master(i) {
                continue;
            }
            let p = &mut self.params[i];
            if p.master.take().is_some() {
                freed += 4 * p.len;
            }
            if p.q.is_some() && p.op.take().is_some() {
                freed += 2 * p.len;
            }
        }
        Ok(freed)
    }

    /// Parameters that hold an f32 master (all of them unless [`Engine::drop_masters`]).
    pub fn masters_held(&self) -> usize {
        self.params.iter().filter(|p| p.master.is_some()).count()
    }

    /// Rewrites parameter `i`'s BF16 operand and BF16 value from its master.
    fn refresh_copies(&mut self, i: usize) -> Result<()> {
        let b = &self.b;
        let p = &mut self.params[i];
        let master = p.master.as_ref().ok_or_else(|| no_master(&p.name))?;
        if let Some(op) = p.op.as_mut() {
            b.to_bf16(master, op, p.len).map_err(dev)?;
        }
        if let Some(c) = p.compute.as_mut() {
            b.round_bf16(master, c, p.len).map_err(dev)?;
        }
        self.requantize(i)
    }

    pub(crate) fn param_name(&self, i: usize) -> &str {
        &self.params[i].name
    }

    fn param_index(&self, name: &str) -> Result<usize> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ModelError::BadTensor {
                name: name.into(),
                message: "not a parameter of this engine".into(),
            })
    }

    /// The shape of parameter `name` as the engine holds it (routed experts stacked:
    /// `[E·rows, cols]`).
    ///
    /// # Errors
    /// Unknown name.
    pub fn param_shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.params[self.param_index(name)?].shape)
    }

    /// Replaces parameter `name`'s master values (and its BF16 copies) with `values`.
    ///
    /// # Errors
    /// Unknown name, wrong length; device failure.
    pub fn set_param_values(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.param_index(name)?;
        if values.len() != self.params[i].len {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!(
                    "{} values for shape {:?} ({} elements)",
                    values.len(),
                    self.params[i].shape,
                    self.params[i].len
                ),
            });
        }
        self.params[i].master()?;
        self.params[i].master = Some(self.b.upload_f32(values).map_err(dev)?);
        self.refresh_copies(i)
    }

    /// Every parameter as the forward multiplies it, in BF16 bit patterns (engine order; name,
    /// shape, bits): a linear weight's BF16 operand, the BF16 value of anything else (after
    /// [`Engine::use_bf16_params`] exactly what the forward reads; before it, the master
    /// rounded to BF16).
    ///
    /// # Errors
    /// Device failure.
    pub fn weights_bf16(&self) -> Result<Vec<Bf16Param>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), p.shape.clone(), self.bf16_bits(p)?)))
            .collect()
    }

    /// Parameter `name` as [`Engine::weights_bf16`] gives it (bit patterns).
    ///
    /// # Errors
    /// Unknown name; device failure.
    pub fn param_bf16(&self, name: &str) -> Result<Vec<u16>> {
        self.bf16_bits(&self.params[self.param_index(name)?])
    }

    fn bf16_bits(&self, p: &Param<B>) -> Result<Vec<u16>> {
        let b = &self.b;
        Ok(match &p.op {
            Some(op) => b.download_bf16(op, p.len).map_err(dev)?,
            None => b
                .download_f32(p.value_f32()?, p.len)
                .map_err(dev)?
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_bits())
                .collect(),
        })
    }

    /// The master weights as a host [`Model`] (stacked experts split per expert), e.g. to
    /// save a checkpoint after training.
    ///
    /// # Errors
    /// Device failure; a parameter the model does not have (not expected).
    pub fn to_model(&self) -> Result<Model> {
        let mut m = Model::zeros(&self.cfg)?;
        let mut ps = m.params_mut();
        for p in &self.params {
            let v = self.b.download_f32(p.master()?, p.len).map_err(dev)?;
            match p.name.split_once(".experts.*.") {
                Some((base, tail)) => {
                    let e = self.cfg.num_experts;
                    for (x, chunk) in v.chunks(p.len / e).enumerate() {
                        ps.set(&format!("{base}.experts.{x}.{tail}"), chunk)?;
                    }
                }
                None => ps.set(&p.name, &v)?,
            }
        }
        drop(ps);
        Ok(m)
    }

    /// Element counts of the parameters (engine order).
    pub fn param_lens(&self) -> Vec<usize> {
        self.params.iter().map(|p| p.len).collect()
    }

    /// Every parameter as the forward multiplies it, copied into fresh device buffers (engine
    /// order): a BF16 linear's BF16 operand, the BF16 value of anything else, and the stored
    /// weights of a block-format linear; with the checksum of each source taken on the device
    /// before the copy ([`mxrl_tensor::device::checksum_bf16_bits`],
    /// [`mxrl_tensor::device::checksum_stored`]): a weight update that never leaves the
    /// device.
    ///
    /// # Errors
    /// Out of device memory; device failure.
    pub fn export_device(&self) -> Result<(Vec<DeviceTensor<B>>, Vec<u64>)> {
        let b = &self.b;
        let mut sums = b.zeros_u32(2 * self.params.len()).map_err(dev)?;
        let mut out = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            if let Some(q) = &p.q {
                b.checksum_qweights(&q.w, &mut sums, i).map_err(dev)?;
                out.push(DeviceTensor::Stored(b.copy_qweights(&q.w).map_err(dev)?));
                continue;
            }
            let mut buf = b.empty_bf16(p.len).map_err(dev)?;
            match &p.op {
                Some(op) => {
                    b.checksum_bf16(op, p.len, &mut sums, i).map_err(dev)?;
                    b.copy_bf16(op, &mut buf, p.len).map_err(dev)?;
                }
                None => {
                    b.to_bf16(p.value_f32()?, &mut buf, p.len).map_err(dev)?;
                    b.checksum_bf16(&buf, p.len, &mut sums, i).map_err(dev)?;
                }
            }
            out.push(DeviceTensor::Bf16(buf));
        }
        Ok((out, self.checksums_of(&sums)?))
    }

    /// Bytes of an [`Engine::export_device`] update: 2 per BF16 element, the stored bytes of
    /// block-format linears.
    pub fn export_device_bytes(&self) -> u64 {
        self.params
            .iter()
            .map(|p| match &p.q {
                Some(q) => q.bytes() as u64,
                None => 2 * p.len as u64,
            })
            .sum()
    }

    fn checksums_of(&self, sums: &B::U32) -> Result<Vec<u64>> {
        let w = self
            .b
            .download_u32(sums, 2 * self.params.len())
            .map_err(dev)?;
        Ok(w.chunks(2)
            .map(|c| u64::from(c[0]) | (u64::from(c[1]) << 32))
            .collect())
    }

    /// Installs an update from [`Engine::export_device`] of an engine of the same
    /// configuration and plan: the checksums of the buffers are taken on the device and
    /// compared with `expected` first; only then are they put in place: the BF16 buffers as
    /// operands, the masters and BF16 values rewritten from them in place, the stored weight
    /// sets swapped. On any error nothing changes (short of a device fault while they are put
    /// in place).
    ///
    /// # Errors
    /// Wrong count, a tensor of another kind than this engine runs it as, a checksum mismatch
    /// (the tensor named), out of device memory.
    pub fn install_device(&mut self, bufs: Vec<DeviceTensor<B>>, expected: &[u64]) -> Result<()> {
        let np = self.params.len();
        if bufs.len() != np || expected.len() != np {
            return Err(ModelError::Input(format!(
                "weight update of {} tensors ({} checksums) for an engine of {np}",
                bufs.len(),
                expected.len()
            )));
        }
        let b = &self.b;
        let mut sums = b.zeros_u32(2 * np).map_err(dev)?;
        for (i, (buf, p)) in bufs.iter().zip(&self.params).enumerate() {
            match (buf, &p.q) {
                (DeviceTensor::Bf16(x), None) => {
                    b.checksum_bf16(x, p.len, &mut sums, i).map_err(dev)?
                }
                (DeviceTensor::Stored(w), Some(_)) => {
                    b.checksum_qweights(w, &mut sums, i).map_err(dev)?
                }
                _ => {
                    return Err(ModelError::BadTensor {
                        name: p.name.clone(),
                        message: "the update sends it in another form than this engine runs it \
                                  (BF16 values vs stored block-format bytes)"
                            .into(),
                    })
                }
            }
        }
        let got = self.checksums_of(&sums)?;
        if let Some(i) = (0..np).find(|&i| got[i] != expected[i]) {
            return Err(ModelError::BadTensor {
                name: self.params[i].name.clone(),
                message: format!(
                    "checksum {:016x} after the device copy, {:016x} at the source",
                    got[i], expected[i]
                ),
            });
        }
        self.swap_in(bufs)
    }

    /// Installs a weight update received on the host (engine order, one entry per
    /// parameter): BF16 values as little-endian bytes, copied to the device as they are and
    /// widened there, and the stored bytes of block-format linears copied straight into new
    /// stored weights ([`Backend::upload_stored`]). Every entry is checked against its
    /// parameter (kind, byte count, the stored weights' count and byte counts) before
    /// anything is copied; every new buffer is built before the first parameter is replaced.
    /// On any error nothing changes (short of a device fault while they are put in place).
    ///
    /// # Errors
    /// Wrong count, an entry of another kind or size than its parameter (the tensor named),
    /// out of device memory, device failure.
    pub fn install_host(&mut self, tensors: &[HostTensor<'_>]) -> Result<()> {
        let np = self.params.len();
        if tensors.len() != np {
            return Err(ModelError::Input(format!(
                "weight update of {} tensors for an engine of {np}",
                tensors.len()
            )));
        }
        for (t, p) in tensors.iter().zip(&self.params) {
            let bad = |message: String| ModelError::BadTensor {
                name: p.name.clone(),
                message,
            };
            match (t, &p.q) {
                (HostTensor::Bf16(bytes), None) => {
                    if bytes.len() != 2 * p.len {
                        return Err(bad(format!(
                            "{} BF16 bytes for {} values {:?}",
                            bytes.len(),
                            p.len,
                            p.shape
                        )));
                    }
                }
                (HostTensor::Stored(ws), Some(q)) => {
                    let scheme = q.spec.weight_scheme().ok_or_else(|| {
                        bad(format!("stored as {:?} without a block format", q.spec))
                    })?;
                    if ws.len() != q.groups {
                        return Err(bad(format!(
                            "{} stored weights for {} weights [{}, {}]",
                            ws.len(),
                            q.groups,
                            q.n,
                            q.k
                        )));
                    }
                    for w in ws {
                        w.check(scheme, &[q.n, q.k]).map_err(ModelError::Input)?;
                    }
                }
                _ => {
                    return Err(bad(
                        "the update sends it in another form than this engine runs \
                                    it (BF16 values vs stored block-format bytes)"
                            .into(),
                    ))
                }
            }
        }
        let b = &self.b;
        let mut bufs = Vec::with_capacity(np);
        for (t, p) in tensors.iter().zip(&self.params) {
            bufs.push(match (t, &p.q) {
                (HostTensor::Bf16(bytes), _) => {
                    DeviceTensor::Bf16(b.upload_bf16_bytes(bytes).map_err(dev)?)
                }
                (HostTensor::Stored(ws), Some(q)) => {
                    DeviceTensor::Stored(b.upload_stored(q.spec, q.n, q.k, ws).map_err(dev)?)
                }
                (HostTensor::Stored(_), None) => unreachable!("checked above"),
            });
        }
        self.swap_in(bufs)
    }

    /// Puts `bufs` (checked to match the parameters' kinds and sizes, every one already
    /// built) in place: a stored weight set replaces the old one; BF16 values become the
    /// parameter's BF16 operand (where it has one), and its master (and BF16 value) are
    /// rewritten from them in place, exactly (`f32(bf16)`). Nothing is allocated here, so an
    /// update that ran out of memory did so while its buffers were built, before anything
    /// changed, and the old masters are not held beside new ones (a BF16 update's peak is
    /// its 2 bytes per value, not 6). A launch that fails here (a device fault) may leave the
    /// parameters before it updated.
    fn swap_in(&mut self, bufs: Vec<DeviceTensor<B>>) -> Result<()> {
        let b = &self.b;
        for (buf, p) in bufs.into_iter().zip(self.params.iter_mut()) {
            match buf {
                DeviceTensor::Stored(w) => {
                    if let Some(q) = p.q.as_mut() {
                        q.w = w;
                    }
                }
                DeviceTensor::Bf16(x) => {
                    match (p.master.as_mut(), p.compute.as_mut()) {
                        (Some(m), c) => {
                            b.widen_bf16(&x, m, p.len).map_err(dev)?;
                            if let Some(c) = c {
                                b.round_bf16(m, c, p.len).map_err(dev)?;
                            }
                        }
                        // No master (`drop_masters`): the BF16 value is the update's
                        // values widened, as `round_bf16(widen(x))` would give.
                        (None, Some(c)) => b.widen_bf16(&x, c, p.len).map_err(dev)?,
                        (None, None) => {}
                    }
                    if p.op.is_some() {
                        p.op = Some(x);
                    }
                }
            }
        }
        Ok(())
    }

    /// How linear parameter `name` is stored when it runs in a block format: its spec and
    /// its weights' count and shape (`groups` weights `[n, k]`); `None` for BF16.
    ///
    /// # Errors
    /// Unknown name.
    pub fn stored_layout(&self, name: &str) -> Result<Option<(LinearSpec, usize, usize, usize)>> {
        let i = self.param_index(name)?;
        Ok(self.params[i]
            .q
            .as_ref()
            .map(|q| (q.spec, q.groups, q.n, q.k)))
    }

    /// The name of weight `g` of parameter `name` as stored (routed experts stacked as
    /// `….experts.*.…` are stored per expert: `….experts.{g}.…`).
    pub fn stored_name(name: &str, g: usize, groups: usize) -> String {
        group_name(name, g, groups)
    }

    /// The stored quantized weights of block-format parameter `name` (one per routed
    /// expert), copied to the host; `None` for a BF16 parameter.
    ///
    /// # Errors
    /// Unknown name; device failure.
    pub fn stored_weights(&self, name: &str) -> Result<Option<Vec<QuantizedTensor>>> {
        let i = self.param_index(name)?;
        match &self.params[i].q {
            Some(q) => Ok(Some(self.b.stored_weights(&q.w).map_err(dev)?)),
            None => Ok(None),
        }
    }

    /// Replaces block-format parameter `name`'s stored weights with `weights` (built from
    /// stored bytes, e.g. a weight update; one per routed expert), which must have the
    /// parameter's spec and shapes. The master is left as it is.
    ///
    /// # Errors
    /// Unknown name, a BF16 parameter, weights of another spec, count or shape; device
    /// failure.
    pub fn install_stored(&mut self, name: &str, weights: Vec<PreparedWeight>) -> Result<()> {
        let i = self.param_index(name)?;
        let Some((spec, groups, n, k)) = self.stored_layout(name)? else {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: "runs in BF16: it takes values, not stored bytes".into(),
            });
        };
        if weights.len() != groups
            || weights
                .iter()
                .any(|w| w.spec() != spec || w.n() != n || w.k() != k)
        {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!(
                    "{} stored weights for {groups} weights [{n}, {k}] in {spec:?}",
                    weights.len()
                ),
            });
        }
        self.install_prepared(i, weights)
    }

    /// AdamW steps taken.
    pub fn adam_step(&self) -> u64 {
        self.train.as_ref().map_or(0, |t| t.step)
    }

    /// AdamW moments `(m, v)` of parameter `name`, copied to the host.
    ///
    /// # Errors
    /// Unknown name, training not enabled; device failure.
    pub fn adam_moments(&self, name: &str) -> Result<(Vec<f32>, Vec<f32>)> {
        let i = self.param_index(name)?;
        let st = self
            .train
            .as_ref()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        let n = self.params[i].len;
        Ok((
            self.b.download_f32(&st.m[i], n).map_err(dev)?,
            self.b.download_f32(&st.v[i], n).map_err(dev)?,
        ))
    }

    /// Restores the AdamW step count and, per parameter, its moments (a resumed run).
    ///
    /// # Errors
    /// Unknown name, wrong length, training not enabled; device failure.
    pub fn set_adam_state(&mut self, step: u64, moments: &[(&str, &[f32], &[f32])]) -> Result<()> {
        let idx: Vec<usize> = moments
            .iter()
            .map(|(n, m, v)| {
                let i = self.param_index(n)?;
                let len = self.params[i].len;
                if m.len() != len || v.len() != len {
                    return Err(ModelError::BadTensor {
                        name: (*n).into(),
                        message: format!(
                            "moments of {} / {} values for {len} elements",
                            m.len(),
                            v.len()
                        ),
                    });
                }
                Ok(i)
            })
            .collect::<Result<_>>()?;
        let b = &self.b;
        let st = self
            .train
            .as_mut()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        for (&i, (_, m, v)) in idx.iter().zip(moments) {
            st.m[i] = b.upload_f32(m).map_err(dev)?;
            st.v[i] = b.upload_f32(v).map_err(dev)?;
        }
        st.step = step;
        Ok(())
    }

    /// The first non-finite master value (`name[index] = value`), if any: one norm pass over
    /// every master on the device, and a search on the host only when it is not finite.
    ///
    /// # Errors
    /// Device failure.
    pub fn first_non_finite_param(&self) -> Result<Option<String>> {
        let views: Vec<(&B::F32, usize)> = self
            .params
            .iter()
            .filter_map(|p| Some((p.master.as_ref()?, p.len)))
            .collect();
        if self.b.grad_norm(&views).map_err(dev)?.is_finite() {
            return Ok(None);
        }
        for p in &self.params {
            let Some(m) = &p.master else { continue };
            let v = self.b.download_f32(m, p.len).map_err(dev)?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Ok(Some(format!("weight {}[{i}] = {}", p.name, v[i])));
            }
        }
        Ok(None)
    }

    /// A parameter's master values (HF name; routed experts stacked as
    /// `model.layers.L.mlp.experts.*.{gate_up,down}_proj.weight`), copied to the host.
    ///
    /// # Errors
    /// Unknown name; device failure.
    pub fn param_values(&self, name: &str) -> Result<Vec<f32>> {
        let p =
            self.params
                .iter()
                .find(|p| p.name == name)
                .ok_or_else(|| ModelError::BadTensor {
                    name: name.into(),
                    message: "not a parameter of this engine".into(),
                })?;
        self.b.download_f32(p.master()?, p.len).map_err(dev)
    }

    /// A parameter's gradient, copied to the host (names as [`Engine::param_values`]).
    ///
    /// # Errors
    /// Unknown name, training not enabled; device failure.
    pub fn grad_values(&self, name: &str) -> Result<Vec<f32>> {
        let i = self
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ModelError::BadTensor {
                name: name.into(),
                message: "not a parameter of this engine".into(),
            })?;
        let st = self
            .train
            .as_ref()
            .ok_or_else(|| ModelError::Input("training is not enabled on this engine".into()))?;
        if st.pending_zero[i] {
            return Ok(vec![0.0; self.params[i].len]);
        }
        self.b
            .download_f32(&st.grads[i], self.params[i].len)
            .map_err(dev)
    }

    /// Names of the parameters (routed experts stacked per layer).
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }
}

/// The name of weight `g` of a parameter holding `groups` (routed experts stacked as
/// `….experts.*.…` → `….experts.{g}.…`).
pub(crate) fn group_name(name: &str, g: usize, groups: usize) -> String {
    match name.split_once(".experts.*.") {
        Some((a, b)) => format!("{a}.experts.{g}.{b}"),
        None => {
            debug_assert_eq!(groups, 1, "{name}: only routed experts are stacked");
            name.to_string()
        }
    }
}

/// The distinct prompts in order of first appearance, and for every prompt the index of its
/// distinct copy.
fn distinct_prompts<'a>(prompts: &[&'a [u32]]) -> (Vec<&'a [u32]>, Vec<usize>) {
    let mut seen: std::collections::HashMap<&'a [u32], usize> = Default::default();
    let mut distinct = Vec::new();
    let src = prompts
        .iter()
        .map(|&p| {
            *seen.entry(p).or_insert_with(|| {
                distinct.push(p);
                distinct.len() - 1
            })
        })
        .collect();
    (distinct, src)
}

/// `[B + 1]` row offsets of packed sequences.
fn seq_offsets(layout: &SeqLayout) -> Vec<u32> {
    let mut o: Vec<u32> = (0..layout.num_seqs())
        .map(|i| layout.offset(i) as u32)
        .collect();
    o.push(layout.num_tokens() as u32);
    o
}

/// `n` values `N(0, std²)` from a counter-based generator (SplitMix64 of `seed + i`, Box–Muller
/// per pair), in parallel and deterministic.
fn normal_values(n: usize, seed: u64, std: f32) -> Vec<f32> {
    use rayon::prelude::*;
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(2).enumerate().for_each(|(i, pair)| {
        let a = mix(seed.wrapping_add(2 * i as u64));
        let b = mix(seed.wrapping_add(2 * i as u64 + 1));
        let u1 = ((a >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        pair[0] = (r * t.cos()) as f32 * std;
        if pair.len() > 1 {
            pair[1] = (r * t.sin()) as f32 * std;
        }
    });
    out
}

enum Pass<'a, B: Backend> {
    Prefill {
        layout: &'a SeqLayout,
        offsets: &'a B::U32,
        pos: &'a B::U32,
        cache: Option<&'a mut DecodeState<B>>,
        /// The sequence of every packed row (device), with a decode state.
        seq: Option<&'a B::U32>,
        /// Per layer, expert ids `[N, k]` to replay (MoE layers).
        replay: Option<&'a [Option<B::U32>]>,
        /// Whether the layers' tapes are kept for a backward (a training forward): inputs
        /// only a backward reads are made only then.
        tape: bool,
    },
    Decode {
        k: &'a mut [B::Bf16],
        v: &'a mut [B::Bf16],
        max_len: usize,
        /// Lengths after this step's token (device), and the batch size.
        lens: &'a B::U32,
        batch: usize,
        pos: &'a B::U32,
        /// Per layer, the route capture tables (empty: no capture).
        routes: &'a mut [Option<(B::U32, B::F32)>],
    },
}

/// The CPU engine of a model (the reference of every device engine).
///
/// # Errors
/// As [`Engine::from_model`].
pub fn cpu_engine(model: &Model, max_pos: usize) -> Result<Engine<CpuBackend>> {
    Engine::from_model(model, CpuBackend, max_pos)
}
