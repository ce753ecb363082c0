//! The MoE transformer: structure, random init, forward (prefill / decode) and backward.

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::linear::{Linear, LinearPrecision, Prepared};
use crate::params::{Grads, NormalRng, ParamId, ParamStore, TensorRole};
use mxrl_tensor::activation::{sigmoid, swiglu_backward, swiglu_forward};
use mxrl_tensor::attention::{
    attention_backward, attention_decode, attention_forward, AttnProbs, AttnShape,
};
use mxrl_tensor::loss::{
    entropy_of_logprobs, log_softmax_tempered, logprobs_backward, logprobs_forward,
};
use mxrl_tensor::moe::{combine_backward, combine_forward, gather, gather_backward, Dispatch};
use mxrl_tensor::norm::{rmsnorm_backward, rmsnorm_forward};
use mxrl_tensor::precision::round_bf16_vec;
use mxrl_tensor::qlinear::{LinearSpec, PreparedWeight, Saved};
use mxrl_tensor::rope::{rope_backward, rope_forward, RopeTable};
use mxrl_tensor::routing::{
    load_balancing_loss, router_backward, router_forward, RouteMode, RouterState, Routes,
};
use mxrl_tensor::SeqLayout;
use std::ops::{Deref, DerefMut};

#[derive(Clone, Debug)]
struct Mlp {
    gate_up: Linear,
    down: Linear,
    inter: usize,
}

#[derive(Clone, Debug)]
struct SharedExpert {
    mlp: Mlp,
    gate: Linear,
}

#[derive(Clone, Debug)]
enum Ffn {
    Dense(Mlp),
    Moe {
        router: Linear,
        experts: Vec<Mlp>,
        shared: Option<SharedExpert>,
    },
}

#[derive(Clone, Debug)]
struct Layer {
    ln1: ParamId,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<ParamId>,
    k_norm: Option<ParamId>,
    ln2: ParamId,
    ffn: Ffn,
}

/// Checks a coefficient of the auxiliary load-balancing loss (`Model::backward`'s
/// `aux_loss_coef`, `Engine::set_aux_loss_coef`): finite and ≥ 0.
///
/// # Errors
/// Any other value, named.
pub fn check_aux_loss_coef(coef: f32) -> Result<()> {
    if coef.is_finite() && coef >= 0.0 {
        Ok(())
    } else {
        Err(ModelError::Input(format!(
            "aux loss coefficient {coef}: must be finite and ≥ 0"
        )))
    }
}

/// Replay input of one layer for the packed batch: ids and weights `[N, k]` (`None`: dense).
pub(crate) type PackedRoutes = Option<(Vec<u32>, Vec<f32>)>;

/// Routing decisions of one sequence: for every MoE layer in decoder order (a dense layer
/// routes nothing and has no entry), the [`Routes`] of the sequence's tokens: expert ids
/// **and** combine weights `[token][k]`, in slot order. What a forward or a generation
/// captures, what [`ForwardOptions::replay`] replays, and what the RL loop moves from the
/// rollout to the trainer.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RoutingTrace {
    /// One entry per MoE layer, in decoder order.
    pub layers: Vec<Routes>,
}

impl RoutingTrace {
    /// A trace of `tokens` tokens with zero ids and weights in every MoE layer of `config`.
    pub fn zeros(config: &ModelConfig, tokens: usize) -> RoutingTrace {
        let k = config.num_experts_per_tok;
        RoutingTrace {
            layers: (0..config.num_layers)
                .filter(|&l| config.is_moe_layer(l))
                .map(|_| Routes {
                    top_k: k,
                    ids: vec![0; tokens * k],
                    weights: vec![0.0; tokens * k],
                })
                .collect(),
        }
    }

    /// Number of tokens covered (0 for a model without MoE layers).
    pub fn num_tokens(&self) -> usize {
        self.layers.first().map_or(0, Routes::num_tokens)
    }

    /// Experts per token (0 for a model without MoE layers).
    pub fn top_k(&self) -> usize {
        self.layers.first().map_or(0, |r| r.top_k)
    }

    /// Per MoE layer, over the tokens both traces cover: (tokens whose expert **sets**
    /// agree, tokens compared). `None` when the layer counts or top-k differ.
    pub fn agreement_per_layer(&self, other: &RoutingTrace) -> Option<Vec<(usize, usize)>> {
        let k = self.top_k();
        if self.layers.len() != other.layers.len() || k != other.top_k() {
            return None;
        }
        let n = self.num_tokens().min(other.num_tokens());
        Some(
            self.layers
                .iter()
                .zip(&other.layers)
                .map(|(a, b)| {
                    let same = (0..n)
                        .filter(|&p| {
                            let mut x = a.ids[p * k..(p + 1) * k].to_vec();
                            let mut y = b.ids[p * k..(p + 1) * k].to_vec();
                            x.sort_unstable();
                            y.sort_unstable();
                            x == y
                        })
                        .count();
                    (same, n)
                })
                .collect(),
        )
    }
}

/// How the training forward replays captured routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayKind {
    /// Replay expert ids; recompute combine weights from the current router (router trains).
    Ids,
    /// Replay expert ids and combine weights verbatim (full-decision replay).
    Full,
}

/// One sequence of a forward batch: input tokens and, per input position, the target token
/// whose logprob is wanted (`targets[t]` is usually `tokens[t+1]`).
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Input token ids `[T]`.
    pub tokens: &'a [u32],
    /// Target token ids `[T]`.
    pub targets: &'a [u32],
}

impl<'a> SeqInput<'a> {
    /// Next-token form of a full sequence `s`: tokens `s[..T-1]`, targets `s[1..]`.
    pub fn next_token(seq: &'a [u32]) -> Self {
        let t = seq.len().saturating_sub(1);
        SeqInput {
            tokens: &seq[..t],
            targets: &seq[seq.len() - t..],
        }
    }
}

/// Options of [`Model::forward`].
#[derive(Clone, Copy, Debug)]
pub struct ForwardOptions<'a> {
    /// Logprobs are of `softmax(logits / temperature)` (1.0: the model's distribution).
    pub temperature: f32,
    /// Also return the logits `[T, V]` of every sequence.
    pub return_logits: bool,
    /// Keep what backward needs (the returned [`Tape`]).
    pub train: bool,
    /// Replay the given routing (one trace per sequence, covering all of its tokens).
    pub replay: Option<(&'a [RoutingTrace], ReplayKind)>,
}

impl Default for ForwardOptions<'_> {
    fn default() -> Self {
        ForwardOptions {
            temperature: 1.0,
            return_logits: false,
            train: false,
            replay: None,
        }
    }
}

/// Residual-stream states of one sequence: for every decoder layer, the hidden state after
/// that layer (attention and FFN residuals added) at every position, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct HiddenStates {
    /// Hidden size H.
    pub hidden_size: usize,
    /// `layers[l]`: `[T, H]` row-major, the residual stream after decoder layer `l`.
    pub layers: Vec<Vec<f32>>,
}

impl HiddenStates {
    /// Positions covered.
    pub fn num_tokens(&self) -> usize {
        self.layers
            .first()
            .map_or(0, |l| l.len() / self.hidden_size.max(1))
    }

    /// The hidden state `[H]` after layer `layer` at position `pos`.
    ///
    /// # Panics
    /// If `layer` or `pos` is out of range.
    pub fn at(&self, layer: usize, pos: usize) -> &[f32] {
        let h = self.hidden_size;
        &self.layers[layer][pos * h..(pos + 1) * h]
    }

    /// Rows `[row0, row0 + rows)` of packed per-layer states `[n, H]`.
    pub(crate) fn from_packed(packed: &[Vec<f32>], h: usize, row0: usize, rows: usize) -> Self {
        HiddenStates {
            hidden_size: h,
            layers: packed
                .iter()
                .map(|x| x[row0 * h..(row0 + rows) * h].to_vec())
                .collect(),
        }
    }

    /// Appends rows `[row0, row0 + rows)` of packed per-layer states `[n, H]`.
    pub(crate) fn append_packed(&mut self, packed: &[Vec<f32>], row0: usize, rows: usize) {
        let h = self.hidden_size;
        for (dst, src) in self.layers.iter_mut().zip(packed) {
            dst.extend_from_slice(&src[row0 * h..(row0 + rows) * h]);
        }
    }
}

/// Result of [`Model::forward`].
#[derive(Debug)]
pub struct ForwardOutput {
    /// Per sequence, `log p(targets[t] | tokens[..=t])` `[T]`.
    pub logprobs: Vec<Vec<f32>>,
    /// Per sequence, logits `[T, V]` row-major (when asked for).
    pub logits: Option<Vec<Vec<f32>>>,
    /// Per sequence, the routing used.
    pub routing: Vec<RoutingTrace>,
    /// Auxiliary load-balancing loss over all MoE layers and tokens (`None` without MoE layers).
    pub aux_loss: Option<f32>,
    /// Saved activations for [`Model::backward`] (when `train`).
    pub tape: Option<Tape>,
    /// Per sequence, the residual stream after every decoder layer
    /// ([`Model::forward_capturing`] only; `None` from [`Model::forward`]).
    pub hidden: Option<Vec<HiddenStates>>,
}

/// What a training forward keeps of an MLP. The f32 input `x` (experts only; a dense or
/// shared MLP reads the layer's `h2`) and `act` are kept only where the linear reading them
/// saved no quantized context; `y` only where backward needs it (routed and shared experts).
struct MlpTape {
    x: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
    gu_saved: Option<Saved>,
    down_saved: Option<Saved>,
}

/// What a pass keeps for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Nothing (inference, decode).
    Nothing,
    /// Each quantized linear's [`Saved`] context (its f32 input is dropped when no other
    /// consumer needs it); f32 inputs of the other linears.
    Saved,
    /// The f32 input of every linear; backward re-runs the forward quantization of a quantized
    /// linear's input to rebuild its context (the reference of [`Keep::Saved`]).
    Recompute,
}

/// Shared expert of a training forward: its MLP, gate logits and the gate linear's context.
type SharedTape = (MlpTape, Vec<f32>, Option<Saved>);

enum FfnTape {
    Dense(MlpTape),
    Moe {
        routes: Routes,
        state: RouterState,
        dispatch: Dispatch,
        experts: Vec<MlpTape>,
        shared: Option<Box<SharedTape>>,
        router_saved: Option<Saved>,
    },
}

pub(crate) struct LayerTape {
    x_in: Vec<f32>,
    rstd1: Vec<f32>,
    h1: Vec<f32>,
    q_pre: Vec<f32>,
    rstd_q: Vec<f32>,
    k_pre: Vec<f32>,
    rstd_k: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: AttnProbs,
    att: Vec<f32>,
    x_mid: Vec<f32>,
    rstd2: Vec<f32>,
    h2: Vec<f32>,
    ffn: FfnTape,
    /// Contexts of the quantized q/k/v projections; linears with the same spec and weight
    /// version read the same input into the same context, so they share one entry.
    qkv_saved: Vec<Saved>,
    /// Index into `qkv_saved` of q, k and v (`None`: not quantized; `h1` is kept).
    qkv_idx: [Option<usize>; 3],
    o_saved: Option<Saved>,
}

/// Activations saved by a training forward, consumed by [`Model::backward`].
pub struct Tape {
    layout: SeqLayout,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    temperature: f32,
    rope: RopeTable,
    layers: Vec<LayerTape>,
    x_final: Vec<f32>,
    rstd_final: Vec<f32>,
    h_final: Vec<f32>,
    logits: Vec<f32>,
    lse: Vec<f32>,
    head_saved: Option<Saved>,
    version: u64,
}

fn f32_bytes(v: &[f32]) -> usize {
    4 * v.len()
}

fn saved_bytes(s: &Option<Saved>) -> usize {
    s.as_ref().map_or(0, Saved::kept_bytes)
}

impl MlpTape {
    fn nbytes(&self) -> usize {
        f32_bytes(&self.x)
            + f32_bytes(&self.gu)
            + f32_bytes(&self.act)
            + f32_bytes(&self.y)
            + saved_bytes(&self.gu_saved)
            + saved_bytes(&self.down_saved)
    }
}

impl LayerTape {
    fn nbytes(&self) -> usize {
        let f = [
            &self.x_in,
            &self.rstd1,
            &self.h1,
            &self.q_pre,
            &self.rstd_q,
            &self.k_pre,
            &self.rstd_k,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.x_mid,
            &self.rstd2,
            &self.h2,
        ]
        .iter()
        .map(|v| f32_bytes(v))
        .sum::<usize>();
        let ffn = match &self.ffn {
            FfnTape::Dense(t) => t.nbytes(),
            FfnTape::Moe {
                routes,
                state,
                dispatch,
                experts,
                shared,
                router_saved,
            } => {
                saved_bytes(router_saved)
                    + 4 * (routes.ids.len() + routes.weights.len() + state.probs.len())
                    + 8 * dispatch.entries.len()
                    + std::mem::size_of::<usize>() * dispatch.starts.len()
                    + experts.iter().map(MlpTape::nbytes).sum::<usize>()
                    + shared.as_deref().map_or(0, |(t, gl, gs)| {
                        t.nbytes() + f32_bytes(gl) + saved_bytes(gs)
                    })
            }
        };
        f + self.probs.nbytes()
            + ffn
            + self.qkv_saved.iter().map(Saved::kept_bytes).sum::<usize>()
            + saved_bytes(&self.o_saved)
    }
}

impl Tape {
    /// Bytes of the saved activations this tape holds for backward (f32 and integer buffers
    /// at their CPU sizes; a quantized linear's saved input at its device-format size,
    /// [`mxrl_tensor::qlinear::Saved::kept_bytes`]). The logits and the final-norm state
    /// are included; the RoPE table is not (it is recomputable from the positions).
    pub fn nbytes(&self) -> usize {
        8 * self.tokens.len()
            + self.layers.iter().map(LayerTape::nbytes).sum::<usize>()
            + [
                &self.x_final,
                &self.rstd_final,
                &self.h_final,
                &self.logits,
                &self.lse,
            ]
            .iter()
            .map(|v| f32_bytes(v))
            .sum::<usize>()
            + saved_bytes(&self.head_saved)
    }
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tape({} tokens)", self.tokens.len())
    }
}

/// Per-sequence key/value cache: for every layer, keys and values `[len, Hkv·D]` (f32).
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
            len: 0,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Attention mode of one pass.
pub(crate) enum Pass<'a> {
    /// Causal attention inside each packed sequence from position 0; optionally fills caches.
    Prefill {
        layout: &'a SeqLayout,
        caches: Option<&'a mut [KvCache]>,
    },
    /// One new token per cache (row `r` belongs to `caches[r]`).
    Decode { caches: &'a mut [KvCache] },
}

/// Result of the shared trunk pass.
pub(crate) struct TrunkOut {
    pub h_final: Vec<f32>,
    pub routes: Vec<Option<Routes>>,
    pub probs: Vec<Option<Vec<f32>>>,
    pub layers: Vec<LayerTape>,
    pub x_final: Vec<f32>,
    pub rstd_final: Vec<f32>,
    pub rope: RopeTable,
    /// Per layer, the residual stream after the layer `[n, H]` (empty unless captured).
    pub hidden: Vec<Vec<f32>>,
}

/// A Qwen3-MoE / Qwen2-MoE causal language model on the CPU backend.
///
/// Parameters are f32 master weights in a [`ParamStore`]; each linear layer multiplies a
/// prepared copy chosen by its [`LinearPrecision`] (rebuilt when the parameters change through
/// [`Model::params_mut`], or by [`Model::refresh_weights`] after [`Model::train_params_mut`]).
/// After [`Model::use_bf16_params`] every other tensor (norms, biases, an untied embedding) is
/// read at its BF16 value too, so a BF16 recipe computes with exactly the values it stores
/// while the masters keep full precision. A model in training ([`Model::enable_training`])
/// also owns the gradients of its masters.
#[derive(Clone, Debug)]
pub struct Model {
    config: ModelConfig,
    params: ParamStore,
    embed: ParamId,
    lm_head: ParamId,
    norm: ParamId,
    layers: Vec<Layer>,
    precision: Vec<Option<LinearPrecision>>,
    prepared: Vec<Prepared>,
    /// `stored[i]`: the prepared weight `i` was built from stored quantized bytes
    /// ([`Model::load_weights`]) and is kept as is until the parameters are edited.
    stored: Vec<bool>,
    version: u64,
    /// Tensors that are not linear weights are read at their BF16 value
    /// ([`Model::use_bf16_params`]).
    bf16_params: bool,
    /// Gradients of the masters, once [`Model::enable_training`] allocated them.
    grads: Option<Grads>,
    /// Masters edited through [`Model::train_params_mut`] since the working weights were
    /// derived from them ([`Model::refresh_weights`]).
    stale: bool,
}

/// One parameter of a model in training, as [`Model::train_params_mut`] hands it out: its f32
/// master values and its accumulated gradient.
#[derive(Debug)]
pub struct TrainParamMut<'a> {
    /// Parameter name (as in [`Model::params`]).
    pub name: &'a str,
    /// What the tensor is.
    pub role: TensorRole,
    /// f32 master values.
    pub value: &'a mut [f32],
    /// Accumulated gradient (same length).
    pub grad: &'a mut [f32],
}

/// Mutable access to a model's parameters; when dropped, the model rebuilds the prepared
/// (rounded / quantized) weights from the new master values and bumps its weight version.
pub struct ParamsMut<'a> {
    model: &'a mut Model,
}

impl Deref for ParamsMut<'_> {
    type Target = ParamStore;
    fn deref(&self) -> &ParamStore {
        &self.model.params
    }
}

impl DerefMut for ParamsMut<'_> {
    fn deref_mut(&mut self) -> &mut ParamStore {
        &mut self.model.params
    }
}

impl Drop for ParamsMut<'_> {
    fn drop(&mut self) {
        self.model.refresh_weights();
    }
}

/// One tensor of [`Model::load_weights`].
#[derive(Clone, Debug)]
pub enum WeightValue {
    /// Plain values (f32; BF16 weights arrive as their exact f32 values).
    Values(Vec<f32>),
    /// Stored quantized bytes of a quantized linear's weight (a converted checkpoint, a
    /// weight-sync message): the GEMM uses these bytes as they are, never re-quantized.
    Quantized(mxrl_formats::QuantizedTensor),
}

impl Model {
    /// Builds the parameter layout of `config` with all values zero.
    pub fn zeros(config: &ModelConfig) -> Result<Self> {
        config.validate()?;
        let c = config;
        let (h, d) = (c.hidden_size, c.head_dim);
        let mut ps = ParamStore::default();
        let embed = ps.push(
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, h],
            TensorRole::Embedding,
            None,
        );
        let mut precision_default = Vec::new();
        let mut lin = |ps: &mut ParamStore,
                       name: String,
                       n: usize,
                       k: usize,
                       bias: bool,
                       role: TensorRole,
                       layer: usize| {
            let w = ps.push(format!("{name}.weight"), vec![n, k], role, Some(layer));
            precision_default.push(w);
            let b = bias.then(|| {
                ps.push(
                    format!("{name}.bias"),
                    vec![n],
                    TensorRole::Bias,
                    Some(layer),
                )
            });
            Linear { w, b, n, k }
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let ln1 = ps.push(
                format!("{p}.input_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
                Some(l),
            );
            let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
            let a = TensorRole::Attention;
            let q = lin(
                &mut ps,
                format!("{p}.self_attn.q_proj"),
                qd,
                h,
                c.qkv_bias,
                a,
                l,
            );
            let k = lin(
                &mut ps,
                format!("{p}.self_attn.k_proj"),
                kvd,
                h,
                c.qkv_bias,
                a,
                l,
            );
            let v = lin(
                &mut ps,
                format!("{p}.self_attn.v_proj"),
                kvd,
                h,
                c.qkv_bias,
                a,
                l,
            );
            let o = lin(&mut ps, format!("{p}.self_attn.o_proj"), h, qd, false, a, l);
            let (q_norm, k_norm) = match c.arch {
                Arch::Qwen3Moe => (
                    Some(ps.push(
                        format!("{p}.self_attn.q_norm.weight"),
                        vec![d],
                        TensorRole::Norm,
                        Some(l),
                    )),
                    Some(ps.push(
                        format!("{p}.self_attn.k_norm.weight"),
                        vec![d],
                        TensorRole::Norm,
                        Some(l),
                    )),
                ),
                Arch::Qwen2Moe => (None, None),
            };
            let ln2 = ps.push(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
                Some(l),
            );
            let mut mlp = |ps: &mut ParamStore, name: String, inter: usize, role| Mlp {
                gate_up: lin(
                    ps,
                    format!("{name}.gate_up_proj"),
                    2 * inter,
                    h,
                    false,
                    role,
                    l,
                ),
                down: lin(ps, format!("{name}.down_proj"), h, inter, false, role, l),
                inter,
            };
            let ffn = if c.is_moe_layer(l) {
                let router = Linear {
                    w: ps.push(
                        format!("{p}.mlp.gate.weight"),
                        vec![c.num_experts, h],
                        TensorRole::Router,
                        Some(l),
                    ),
                    b: None,
                    n: c.num_experts,
                    k: h,
                };
                let experts = (0..c.num_experts)
                    .map(|e| {
                        mlp(
                            &mut ps,
                            format!("{p}.mlp.experts.{e}"),
                            c.moe_intermediate_size,
                            TensorRole::Expert,
                        )
                    })
                    .collect();
                let shared = (c.shared_expert_intermediate_size > 0).then(|| {
                    let m = mlp(
                        &mut ps,
                        format!("{p}.mlp.shared_expert"),
                        c.shared_expert_intermediate_size,
                        TensorRole::SharedExpert,
                    );
                    let gate = Linear {
                        w: ps.push(
                            format!("{p}.mlp.shared_expert_gate.weight"),
                            vec![1, h],
                            TensorRole::SharedExpertGate,
                            Some(l),
                        ),
                        b: None,
                        n: 1,
                        k: h,
                    };
                    SharedExpert { mlp: m, gate }
                });
                Ffn::Moe {
                    router,
                    experts,
                    shared,
                }
            } else {
                Ffn::Dense(mlp(
                    &mut ps,
                    format!("{p}.mlp"),
                    c.intermediate_size,
                    TensorRole::DenseMlp,
                ))
            };
            layers.push(Layer {
                ln1,
                q,
                k,
                v,
                o,
                q_norm,
                k_norm,
                ln2,
                ffn,
            });
        }
        let norm = ps.push("model.norm.weight".into(), vec![h], TensorRole::Norm, None);
        let lm_head = if c.tie_word_embeddings {
            embed
        } else {
            ps.push(
                "lm_head.weight".into(),
                vec![c.vocab_size, h],
                TensorRole::LmHead,
                None,
            )
        };
        let mut precision = vec![None; ps.len()];
        for w in precision_default {
            precision[w] = Some(LinearPrecision::F32);
        }
        // Router, shared-expert gate and lm_head are linears too.
        for layer in &layers {
            if let Ffn::Moe { router, shared, .. } = &layer.ffn {
                precision[router.w] = Some(LinearPrecision::F32);
                if let Some(s) = shared {
                    precision[s.gate.w] = Some(LinearPrecision::F32);
                }
            }
        }
        precision[lm_head] = Some(LinearPrecision::F32);
        let mut m = Model {
            config: config.clone(),
            params: ps,
            embed,
            lm_head,
            norm,
            layers,
            stored: vec![false; precision.len()],
            precision,
            prepared: Vec::new(),
            version: 0,
            bf16_params: false,
            grads: None,
            stale: false,
        };
        m.prepare();
        Ok(m)
    }

    /// Random initialization from a seed (HF `_init_weights`: linear and embedding weights
    /// `N(0, initializer_range²)`, norms 1, biases 0). Same seed → same bytes.
    pub fn random(config: &ModelConfig, seed: u64) -> Result<Self> {
        use rayon::prelude::*;
        let mut m = Model::zeros(config)?;
        let std = config.initializer_range as f64;
        {
            let mut ps = m.params_mut();
            // One stream over every sampled value in parameter order, drawn in chunks on all
            // cores: each chunk starts its generator at its first value's place in the stream
            // (`NormalRng::at`), so the values are those of one sequential pass.
            const CHUNK: usize = 1 << 20;
            let mut chunks: Vec<(u64, &mut [f32])> = Vec::new();
            let mut at = 0u64;
            for p in ps.iter_mut() {
                match p.role {
                    TensorRole::Norm => p.data.fill(1.0),
                    TensorRole::Bias => p.data.fill(0.0),
                    _ => {
                        for c in p.data.chunks_mut(CHUNK) {
                            let n = c.len() as u64;
                            chunks.push((at, c));
                            at += n;
                        }
                    }
                }
            }
            chunks.into_par_iter().for_each(|(at, c)| {
                let mut rng = NormalRng::at(seed, at);
                for x in c {
                    *x = (rng.sample() * std) as f32;
                }
            });
        }
        Ok(m)
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// All parameters by name (for optimizers, export and weight sync).
    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Mutable parameters; prepared weights are rebuilt when the guard is dropped.
    pub fn params_mut(&mut self) -> ParamsMut<'_> {
        ParamsMut { model: self }
    }

    /// Weight version: incremented every time [`Model::params_mut`] is released (and by
    /// [`Model::refresh_weights`] and [`Model::load_weights`]).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Runs every parameter at its BF16 value, as a BF16 recipe stores it: BF16 linears
    /// already multiply their BF16 operand; from now on norms, biases and an untied embedding
    /// are read as `f32(bf16(master))` too (re-derived whenever the working weights are), so
    /// the forward computes with exactly the values [`Model::param_bf16`] exports. The f32
    /// masters in [`Model::params`] keep full precision. Linears running in f32
    /// ([`LinearPrecision::F32`]) and quantized linears are not affected. The CPU twin of
    /// [`crate::engine::Engine::use_bf16_params`].
    pub fn use_bf16_params(&mut self) {
        self.bf16_params = true;
        // Only the tensors that are not linear weights read differently.
        for i in 0..self.params.len() {
            if self.precision[i].is_none() {
                self.prepared[i] = self.non_linear(self.params.data(i));
            }
        }
    }

    /// Re-derives every working weight from the f32 masters — the GEMM weight of each linear
    /// (its BF16 operand, or its stored bytes quantized once for the new version) and, after
    /// [`Model::use_bf16_params`], the BF16 value of every other tensor — and bumps the weight
    /// version. Weights installed from stored bytes ([`Model::load_weights`]) are rebuilt from
    /// their masters like every other weight. What releasing [`Model::params_mut`] does; call
    /// it after editing the masters through [`Model::train_params_mut`].
    pub fn refresh_weights(&mut self) {
        self.stored.fill(false);
        self.version += 1;
        self.stale = false;
        self.prepare();
    }

    /// Whether the masters were edited through [`Model::train_params_mut`] after the working
    /// weights were last derived from them; until [`Model::refresh_weights`], forward,
    /// backward and generation are refused.
    pub fn weights_stale(&self) -> bool {
        self.stale
    }

    pub(crate) fn check_current(&self) -> Result<()> {
        if self.stale {
            return Err(ModelError::Input(
                "the master weights were edited since the working weights were derived from \
                 them; call Model::refresh_weights first"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Allocates a zero gradient for every master (once): the model can then accumulate
    /// gradients ([`Model::backward_accumulate`]) and hand out masters with their gradients
    /// ([`Model::train_params_mut`]). The CPU twin of
    /// [`crate::engine::Engine::enable_training`] (the optimizer's moments stay with the
    /// optimizer).
    pub fn enable_training(&mut self) {
        if self.grads.is_none() {
            self.grads = Some(self.params.zero_grads());
        }
    }

    /// The accumulated gradients (store order), when training is enabled.
    pub fn grads(&self) -> Option<&Grads> {
        self.grads.as_ref()
    }

    /// Sets every gradient to zero.
    ///
    /// # Errors
    /// Training not enabled ([`Model::enable_training`]).
    pub fn zero_grads(&mut self) -> Result<()> {
        for g in &mut self.training_grads()?.grads {
            g.fill(0.0);
        }
        Ok(())
    }

    fn training_grads(&mut self) -> Result<&mut Grads> {
        self.grads
            .as_mut()
            .ok_or_else(|| ModelError::Input("training is not enabled on this model".into()))
    }

    /// [`Model::backward`], with the gradients **added** to the model's own (call
    /// [`Model::zero_grads`] first for a fresh step): each call's gradients are computed
    /// whole and then summed into the accumulator element by element.
    ///
    /// # Errors
    /// Training not enabled; as [`Model::backward`].
    pub fn backward_accumulate(
        &mut self,
        tape: &Tape,
        dlogprobs: &[Vec<f32>],
        aux_loss_coef: f32,
    ) -> Result<()> {
        self.training_grads()?;
        let g = self.backward(tape, dlogprobs, aux_loss_coef)?;
        self.training_grads()?.add(&g);
        Ok(())
    }

    /// Every master with its gradient (store order), for an optimizer step. The working
    /// weights are stale from here until [`Model::refresh_weights`].
    ///
    /// # Errors
    /// Training not enabled ([`Model::enable_training`]).
    pub fn train_params_mut(&mut self) -> Result<Vec<TrainParamMut<'_>>> {
        let grads = self
            .grads
            .as_mut()
            .ok_or_else(|| ModelError::Input("training is not enabled on this model".into()))?;
        self.stale = true;
        Ok(self
            .params
            .iter_mut()
            .zip(grads.grads.iter_mut())
            .map(|(p, g)| TrainParamMut {
                name: &p.name,
                role: p.role,
                value: &mut p.data,
                grad: g,
            })
            .collect())
    }

    /// A copy holding this model's f32 masters and precisions that runs them as a freshly
    /// built model does: no gradients, no BF16 values of the non-linear tensors
    /// ([`Model::use_bf16_params`] off), every weight derived from the masters. For saving a
    /// checkpoint, or as the start of a rollout that then loads its weights.
    pub fn master_model(&self) -> Model {
        let mut m = Model {
            config: self.config.clone(),
            params: self.params.clone(),
            embed: self.embed,
            lm_head: self.lm_head,
            norm: self.norm,
            layers: self.layers.clone(),
            precision: self.precision.clone(),
            prepared: self
                .prepared
                .iter()
                .map(|p| match p {
                    Prepared::Bf16Value(_) => Prepared::Master,
                    p => p.clone(),
                })
                .collect(),
            stored: self.stored.clone(),
            version: self.version,
            bf16_params: false,
            grads: None,
            stale: false,
        };
        if self.stale {
            m.refresh_weights();
        }
        m
    }

    /// The BF16 value (bit patterns) of a parameter that does not run as a quantized linear:
    /// what a BF16 recipe stores and ships, and (a BF16 linear, or any tensor after
    /// [`Model::use_bf16_params`]) exactly what the forward reads. `None` for an unknown name
    /// or a quantized linear (its stored bytes are [`Model::stored_weight`]).
    pub fn param_bf16(&self, name: &str) -> Option<Vec<u16>> {
        let id = self.params.id(name)?;
        let values = match &self.prepared[id] {
            Prepared::Quant(_) => return None,
            Prepared::Bf16(op) => op.values(),
            Prepared::Bf16Value(v) => v,
            Prepared::Master => self.params.data(id),
        };
        Some(
            values
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect(),
        )
    }

    /// Parameter `id` as the forward reads it when it is not a linear's GEMM weight (an
    /// embedding, a norm, a bias): its BF16 value after [`Model::use_bf16_params`] (a tied
    /// embedding shares the lm_head's BF16 operand), else its master.
    fn value(&self, id: ParamId) -> &[f32] {
        match &self.prepared[id] {
            Prepared::Bf16Value(v) => v,
            Prepared::Bf16(op) if self.bf16_params => op.values(),
            _ => self.params.data(id),
        }
    }

    /// Names of every linear-layer weight (the tensors a precision plan decides on), with
    /// their current GEMM precision.
    pub fn linear_precisions(&self) -> Vec<(&str, LinearPrecision)> {
        self.precision
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.map(|p| (self.params.get(i).name.as_str(), p)))
            .collect()
    }

    /// Sets the GEMM precision of the linear whose weight is named `name`.
    pub fn set_precision(&mut self, name: &str, prec: LinearPrecision) -> Result<()> {
        let id = self
            .params
            .id(name)
            .filter(|&i| self.precision[i].is_some())
            .ok_or_else(|| ModelError::BadTensor {
                name: name.into(),
                message: "not a linear-layer weight of this model".into(),
            })?;
        let p = self.params.get(id);
        let prepared =
            Prepared::build(prec, &p.name, &p.data, p.shape[0], p.shape[1], self.version).map_err(
                |e| ModelError::BadTensor {
                    name: name.into(),
                    message: format!("cannot run with {prec:?}: {e}"),
                },
            )?;
        self.precision[id] = Some(prec);
        self.prepared[id] = prepared;
        self.stored[id] = false;
        Ok(())
    }

    /// Sets every linear's precision by a rule on (weight name, role).
    ///
    /// # Errors
    /// A weight that cannot take its format (e.g. K not a multiple of the block size); then
    /// no precision is changed.
    pub fn set_precision_by(
        &mut self,
        rule: impl Fn(&str, TensorRole) -> LinearPrecision,
    ) -> Result<()> {
        let old = self.precision.clone();
        for i in 0..self.params.len() {
            if self.precision[i].is_some() {
                let p = self.params.get(i);
                self.precision[i] = Some(rule(&p.name, p.role));
            }
        }
        if let Err(e) = self.try_prepare() {
            self.precision = old;
            self.prepare();
            return Err(e);
        }
        Ok(())
    }

    /// Takes every linear's precision from a resolved [`mxrl_plan::PrecisionPlan`]: a fused
    /// `gate_up_proj` follows its HF `gate_proj` / `up_proj` entries (which the plan keeps
    /// equal), BF16 entries run as [`LinearPrecision::Bf16`], block formats as
    /// [`LinearPrecision::Quantized`] with the plan's backward mode and NVFP4 activation
    /// scaling.
    ///
    /// # Errors
    /// A linear the plan does not cover, fused parts with different decisions, or a format
    /// the weight cannot take; then no precision is changed.
    pub fn apply_plan(&mut self, plan: &mxrl_plan::PrecisionPlan) -> Result<()> {
        let mut decided = Vec::new();
        for i in 0..self.params.len() {
            if self.precision[i].is_none() {
                continue;
            }
            decided.push((i, plan_precision(plan, &self.params.get(i).name)?));
        }
        let old = self.precision.clone();
        for (i, p) in decided {
            self.precision[i] = Some(p);
        }
        if let Err(e) = self.try_prepare() {
            self.precision = old;
            self.prepare();
            return Err(e);
        }
        Ok(())
    }

    fn try_prepare(&mut self) -> Result<()> {
        let mut prepared = Vec::with_capacity(self.params.len());
        for i in 0..self.params.len() {
            let p = self.params.get(i);
            if self.stored[i] {
                if let (Some(LinearPrecision::Quantized(spec)), Some(Prepared::Quant(pw))) =
                    (self.precision[i], self.prepared.get(i))
                {
                    if pw.spec() == spec {
                        prepared.push(Prepared::Quant(pw.clone()));
                        continue;
                    }
                }
            }
            prepared.push(match self.precision[i] {
                Some(prec) => {
                    Prepared::build(prec, &p.name, &p.data, p.shape[0], p.shape[1], self.version)
                        .map_err(|e| ModelError::BadTensor {
                            name: p.name.clone(),
                            message: format!("cannot run with {prec:?}: {e}"),
                        })?
                }
                None => self.non_linear(&p.data),
            });
        }
        for (i, p) in prepared.iter().enumerate() {
            if !matches!(p, Prepared::Quant(_)) {
                self.stored[i] = false;
            }
        }
        self.prepared = prepared;
        Ok(())
    }

    /// The prepared quantized weight of the linear whose weight is `name` (`None` when that
    /// linear does not run in a block format): its [`PreparedWeight::stored`] bytes are what a
    /// converted checkpoint or a weight update carries.
    pub fn prepared_weight(&self, name: &str) -> Option<&PreparedWeight> {
        let id = self.params.id(name)?;
        match self.prepared.get(id)? {
            Prepared::Quant(pw) => Some(pw),
            _ => None,
        }
    }

    /// The stored quantized tensor the linear whose weight is `name` multiplies (quantized
    /// from the master values, or installed by [`Model::load_weights`]): what a converted
    /// checkpoint or a weight update carries. `None` when that linear does not run in a
    /// block format (its values are then the parameter's).
    pub fn stored_weight(&self, name: &str) -> Option<&mxrl_formats::QuantizedTensor> {
        self.prepared_weight(name)?.stored()
    }

    /// Whether the quantized weight `name` runs from stored bytes installed by
    /// [`Model::load_weights`] (rather than quantized from the master values).
    pub fn runs_stored_bytes(&self, name: &str) -> bool {
        self.params.id(name).is_some_and(|i| self.stored[i])
    }

    /// Replaces the named tensors atomically and bumps the weight version: everything is
    /// validated and prepared first; on any error nothing changes.
    ///
    /// - [`WeightValue::Values`]: any parameter; its master values are replaced and its GEMM
    ///   weight is rebuilt for the linear's precision.
    /// - [`WeightValue::Quantized`]: only a linear running as [`LinearPrecision::Quantized`]
    ///   whose weight scheme the bytes have (set it with [`Model::apply_plan`] first). The
    ///   GEMM uses exactly these bytes ([`PreparedWeight::from_quantized`]); the master values
    ///   become their contract dequantization. They stay in use until the parameters are
    ///   edited through [`Model::params_mut`] or the linear's precision changes. Without the
    ///   high-precision weight, such a linear supports forward and the `dequantized` backward
    ///   only (the serving side).
    ///
    /// # Errors
    /// An unknown name, a wrong length or shape, stored bytes of another scheme, invalid
    /// stored bytes — each naming the tensor.
    pub fn load_weights(&mut self, updates: Vec<(String, WeightValue)>) -> Result<()> {
        let version = self.version + 1;
        let ids: std::collections::HashMap<&str, ParamId> = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut staged = Vec::with_capacity(updates.len());
        for (name, value) in updates {
            let bad = |message: String| ModelError::BadTensor {
                name: name.clone(),
                message,
            };
            let id = *ids
                .get(name.as_str())
                .ok_or_else(|| bad("not a parameter of this model".into()))?;
            let p = self.params.get(id);
            let numel: usize = p.shape.iter().product();
            let (values, prepared, stored) = match value {
                WeightValue::Values(v) => {
                    if v.len() != numel {
                        return Err(bad(format!(
                            "{} values for shape {:?} ({numel} expected)",
                            v.len(),
                            p.shape
                        )));
                    }
                    let prep = match self.precision[id] {
                        Some(prec) => {
                            Prepared::build(prec, &p.name, &v, p.shape[0], p.shape[1], version)
                                .map_err(|e| bad(format!("cannot run with {prec:?}: {e}")))?
                        }
                        None => self.non_linear(&v),
                    };
                    (v, prep, false)
                }
                WeightValue::Quantized(q) => {
                    let Some(LinearPrecision::Quantized(spec)) = self.precision[id] else {
                        return Err(bad(format!(
                            "stored {} bytes sent, but this tensor runs as {:?}; apply the \
                             precision plan first",
                            q.scheme, self.precision[id]
                        )));
                    };
                    if q.shape != p.shape {
                        return Err(bad(format!(
                            "stored shape {:?}, the model has {:?}",
                            q.shape, p.shape
                        )));
                    }
                    let values = q.dequantize().map_err(|e| bad(e.to_string()))?;
                    let pw = PreparedWeight::from_quantized(&p.name, q, spec, version, None)
                        .map_err(|e| bad(e.to_string()))?;
                    (values, Prepared::Quant(Box::new(pw)), true)
                }
            };
            staged.push((id, values, prepared, stored));
        }
        // Everything validated: swap.
        for (id, values, prepared, stored) in staged {
            self.params.replace_data(id, values);
            self.prepared[id] = prepared;
            self.stored[id] = stored;
        }
        self.version = version;
        Ok(())
    }

    /// How the forward reads a tensor that is not a linear weight, with master values
    /// `values`: at its BF16 value after [`Model::use_bf16_params`], else the master itself.
    fn non_linear(&self, values: &[f32]) -> Prepared {
        if self.bf16_params {
            Prepared::Bf16Value(round_bf16_vec(values))
        } else {
            Prepared::Master
        }
    }

    /// Rebuilds the prepared weights; every precision was validated when it was set.
    fn prepare(&mut self) {
        self.try_prepare()
            .unwrap_or_else(|e| panic!("precisions were validated when set: {e}"));
    }

    fn lin_fwd(&self, l: &Linear, x: &[f32], m: usize) -> Vec<f32> {
        let prec = self.precision[l.w].expect("linear weight has a precision");
        let bias = l.b.map(|b| self.value(b));
        l.forward(&self.params, &self.prepared[l.w], prec, bias, x, m)
    }

    /// Forward of one linear in a pass that keeps `keep`: with [`Keep::Saved`] a quantized
    /// linear also returns its backward context (same `y` bitwise).
    fn lin_fwd_keep(
        &self,
        l: &Linear,
        x: &[f32],
        m: usize,
        keep: Keep,
    ) -> (Vec<f32>, Option<Saved>) {
        let prec = self.precision[l.w].expect("linear weight has a precision");
        let bias = l.b.map(|b| self.value(b));
        match keep {
            // No context for zero rows (unused experts): backward skips them.
            Keep::Saved if m > 0 => {
                l.forward_saving(&self.params, &self.prepared[l.w], prec, bias, x, m)
            }
            _ => (
                l.forward(&self.params, &self.prepared[l.w], prec, bias, x, m),
                None,
            ),
        }
    }

    /// Backward of one linear from its saved context, or from its f32 input `x`.
    fn lin_bwd(
        &self,
        l: &Linear,
        x: &[f32],
        saved: Option<&Saved>,
        dy: &[f32],
        m: usize,
        g: &mut Grads,
    ) -> Vec<f32> {
        let prec = self.precision[l.w].expect("linear weight has a precision");
        l.backward(&self.params, &self.prepared[l.w], prec, x, saved, dy, m, g)
    }

    fn attn_shape(&self) -> AttnShape {
        AttnShape {
            q_heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
        let v = self.config.vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(ModelError::Input(format!(
                "{what}: token id {t} ≥ vocab_size {v}"
            )));
        }
        Ok(())
    }

    /// SwiGLU MLP forward over `m` rows of `x` (not stored: the caller keeps the input where
    /// `gu_saved` is `None` and backward needs it).
    fn mlp_forward(&self, mlp: &Mlp, x: &[f32], m: usize, keep: Keep) -> MlpTape {
        let (gu, gu_saved) = self.lin_fwd_keep(&mlp.gate_up, x, m, keep);
        let mut act = vec![0.0; m * mlp.inter];
        swiglu_forward(&gu, m, mlp.inter, &mut act);
        let (y, down_saved) = self.lin_fwd_keep(&mlp.down, &act, m, keep);
        if down_saved.is_some() {
            act = Vec::new();
        }
        MlpTape {
            x: Vec::new(),
            gu,
            act,
            y,
            gu_saved,
            down_saved,
        }
    }

    /// MLP backward; `x` is the MLP's f32 input where its gate_up saved no context.
    fn mlp_backward(
        &self,
        mlp: &Mlp,
        t: &MlpTape,
        x: &[f32],
        dy: &[f32],
        m: usize,
        g: &mut Grads,
    ) -> Vec<f32> {
        let dact = self.lin_bwd(&mlp.down, &t.act, t.down_saved.as_ref(), dy, m, g);
        let mut dgu = vec![0.0; m * 2 * mlp.inter];
        swiglu_backward(&dact, &t.gu, m, mlp.inter, &mut dgu);
        self.lin_bwd(&mlp.gate_up, x, t.gu_saved.as_ref(), &dgu, m, g)
    }

    /// The decoder trunk over `n` packed rows: embeddings → layers → final norm.
    /// `replay[l]`: routing to replay for layer `l` (packed `[n, k]`).
    pub(crate) fn trunk(
        &self,
        tokens: &[u32],
        positions: &[usize],
        mut pass: Pass<'_>,
        replay: Option<(&[PackedRoutes], ReplayKind)>,
        keep_mode: Keep,
        capture: bool,
    ) -> TrunkOut {
        let c = &self.config;
        let keep = keep_mode != Keep::Nothing;
        let (n, h, d) = (tokens.len(), c.hidden_size, c.head_dim);
        let (hq, hkv) = (c.num_heads, c.num_kv_heads);
        let emb = self.value(self.embed);
        let mut x = Vec::with_capacity(n * h);
        for &t in tokens {
            x.extend_from_slice(&emb[t as usize * h..(t as usize + 1) * h]);
        }
        let rope = RopeTable::new(positions, d, c.rope_theta);
        let shape = self.attn_shape();
        let mut routes_out = Vec::with_capacity(c.num_layers);
        let mut probs_out = Vec::with_capacity(c.num_layers);
        let mut tapes = Vec::new();
        let mut hidden = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            let mut h1 = vec![0.0; n * h];
            let mut rstd1 = vec![0.0; n];
            rmsnorm_forward(
                &x,
                self.value(layer.ln1),
                n,
                h,
                c.rms_norm_eps,
                &mut h1,
                &mut rstd1,
            );
            // q, k and v read h1; quantized ones with one spec and weight version share one
            // saved context (it depends only on x, the spec and the version).
            let mut qkv_ctx: Vec<(LinearSpec, u64, Saved)> = Vec::new();
            let mut qkv_idx = [None; 3];
            let mut qkv_out = Vec::with_capacity(3);
            for (j, lin) in [&layer.q, &layer.k, &layer.v].into_iter().enumerate() {
                let id = match (&self.prepared[lin.w], keep_mode) {
                    (Prepared::Quant(pw), Keep::Saved) => Some((pw.spec(), pw.version())),
                    _ => None,
                };
                let shared = id.and_then(|(sp, ver)| {
                    qkv_ctx.iter().position(|(s, v, _)| *s == sp && *v == ver)
                });
                if let Some(i) = shared {
                    qkv_idx[j] = Some(i);
                    qkv_out.push(self.lin_fwd(lin, &h1, n));
                    continue;
                }
                let (y, saved) = self.lin_fwd_keep(lin, &h1, n, keep_mode);
                if let (Some(saved), Some((sp, ver))) = (saved, id) {
                    qkv_idx[j] = Some(qkv_ctx.len());
                    qkv_ctx.push((sp, ver, saved));
                }
                qkv_out.push(y);
            }
            let v = qkv_out.pop().expect("three projections");
            let k_pre = qkv_out.pop().expect("three projections");
            let q_pre = qkv_out.pop().expect("three projections");
            let qkv_saved: Vec<Saved> = qkv_ctx.into_iter().map(|(_, _, s)| s).collect();
            let (mut q, mut k) = (q_pre.clone(), k_pre.clone());
            let mut rstd_q = Vec::new();
            let mut rstd_k = Vec::new();
            if let (Some(qn), Some(kn)) = (layer.q_norm, layer.k_norm) {
                rstd_q = vec![0.0; n * hq];
                rstd_k = vec![0.0; n * hkv];
                rmsnorm_forward(
                    &q_pre,
                    self.value(qn),
                    n * hq,
                    d,
                    c.rms_norm_eps,
                    &mut q,
                    &mut rstd_q,
                );
                rmsnorm_forward(
                    &k_pre,
                    self.value(kn),
                    n * hkv,
                    d,
                    c.rms_norm_eps,
                    &mut k,
                    &mut rstd_k,
                );
            }
            rope_forward(&mut q, n, hq, &rope);
            rope_forward(&mut k, n, hkv, &rope);
            let mut att = vec![0.0; n * hq * d];
            let kvs = hkv * d;
            let probs = match &mut pass {
                Pass::Prefill { layout, caches } => {
                    if let Some(caches) = caches {
                        for (b, cache) in caches.iter_mut().enumerate() {
                            let (o, len) = (layout.offset(b), layout.len(b));
                            cache.k[li].extend_from_slice(&k[o * kvs..(o + len) * kvs]);
                            cache.v[li].extend_from_slice(&v[o * kvs..(o + len) * kvs]);
                        }
                    }
                    attention_forward(&q, &k, &v, layout, shape, &mut att)
                }
                Pass::Decode { caches } => {
                    let mut scratch = Vec::new();
                    for (r, cache) in caches.iter_mut().enumerate() {
                        cache.k[li].extend_from_slice(&k[r * kvs..(r + 1) * kvs]);
                        cache.v[li].extend_from_slice(&v[r * kvs..(r + 1) * kvs]);
                        let len = cache.k[li].len() / kvs;
                        scratch.resize(len, 0.0);
                        attention_decode(
                            &q[r * hq * d..(r + 1) * hq * d],
                            &cache.k[li],
                            &cache.v[li],
                            len,
                            shape,
                            &mut scratch,
                            &mut att[r * hq * d..(r + 1) * hq * d],
                        );
                    }
                    AttnProbs::default()
                }
            };
            let (o, o_saved) = self.lin_fwd_keep(&layer.o, &att, n, keep_mode);
            let x_in = if keep { x.clone() } else { Vec::new() };
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let mut h2 = vec![0.0; n * h];
            let mut rstd2 = vec![0.0; n];
            rmsnorm_forward(
                &x,
                self.value(layer.ln2),
                n,
                h,
                c.rms_norm_eps,
                &mut h2,
                &mut rstd2,
            );
            let x_mid = if keep { x.clone() } else { Vec::new() };
            // h2 is kept only for a linear reading it that saved no context.
            let (ffn_out, ffn_tape, lr, lp, h2_needed) = match &layer.ffn {
                Ffn::Dense(mlp) => {
                    let mut t = self.mlp_forward(mlp, &h2, n, keep_mode);
                    let y = std::mem::take(&mut t.y);
                    let needed = t.gu_saved.is_none();
                    (y, FfnTape::Dense(t), None, None, needed)
                }
                Ffn::Moe {
                    router,
                    experts,
                    shared,
                } => {
                    let e = c.num_experts;
                    let (logits, router_saved) = self.lin_fwd_keep(router, &h2, n, keep_mode);
                    let mode = match replay.and_then(|(r, kind)| r[li].as_ref().map(|x| (x, kind)))
                    {
                        Some(((ids, _), ReplayKind::Ids)) => RouteMode::ReplayIds(ids),
                        Some(((ids, w), ReplayKind::Full)) => RouteMode::ReplayFull(ids, w),
                        None => RouteMode::Compute,
                    };
                    let (routes, state) = router_forward(
                        &logits,
                        n,
                        e,
                        c.num_experts_per_tok,
                        c.norm_topk_prob,
                        mode,
                    );
                    let dispatch = Dispatch::new(&routes, e);
                    let mut out = vec![0.0f32; n * h];
                    let mut etapes = Vec::with_capacity(e);
                    for (ei, mlp) in experts.iter().enumerate() {
                        let rows = dispatch.rows(ei);
                        let xe = gather(&h2, h, rows);
                        let mut t = self.mlp_forward(mlp, &xe, rows.len(), keep_mode);
                        combine_forward(&t.y, h, rows, &routes, &mut out);
                        if keep && t.gu_saved.is_none() {
                            t.x = xe;
                        }
                        etapes.push(t);
                    }
                    let shared_tape = shared.as_ref().map(|s| {
                        let t = self.mlp_forward(&s.mlp, &h2, n, keep_mode);
                        let (gl, gate_saved) = self.lin_fwd_keep(&s.gate, &h2, n, keep_mode);
                        for (r, row) in out.chunks_mut(h).enumerate() {
                            let g = sigmoid(gl[r]);
                            for (a, &b) in row.iter_mut().zip(&t.y[r * h..(r + 1) * h]) {
                                *a += g * b;
                            }
                        }
                        Box::new((t, gl, gate_saved))
                    });
                    let needed = router_saved.is_none()
                        || shared_tape
                            .as_ref()
                            .is_some_and(|b| b.0.gu_saved.is_none() || b.2.is_none());
                    let probs = state.probs.clone();
                    let r2 = routes.clone();
                    (
                        out,
                        FfnTape::Moe {
                            routes,
                            state,
                            dispatch,
                            experts: etapes,
                            shared: shared_tape,
                            router_saved,
                        },
                        Some(r2),
                        Some(probs),
                        needed,
                    )
                }
            };
            for (a, b) in x.iter_mut().zip(&ffn_out) {
                *a += b;
            }
            if capture {
                hidden.push(x.clone());
            }
            routes_out.push(lr);
            probs_out.push(lp);
            if keep {
                let h1_needed = qkv_idx.iter().any(Option::is_none);
                tapes.push(LayerTape {
                    x_in,
                    rstd1,
                    h1: if h1_needed { h1 } else { Vec::new() },
                    q_pre,
                    rstd_q,
                    k_pre,
                    rstd_k,
                    q,
                    k,
                    v,
                    probs,
                    att: if o_saved.is_none() { att } else { Vec::new() },
                    x_mid,
                    rstd2,
                    h2: if h2_needed { h2 } else { Vec::new() },
                    ffn: ffn_tape,
                    qkv_saved,
                    qkv_idx,
                    o_saved,
                });
            }
        }
        if let Pass::Prefill {
            layout,
            caches: Some(caches),
        } = &mut pass
        {
            for (b, cache) in caches.iter_mut().enumerate() {
                cache.len += layout.len(b);
            }
        }
        if let Pass::Decode { caches } = &mut pass {
            for cache in caches.iter_mut() {
                cache.len += 1;
            }
        }
        let mut hf = vec![0.0; n * h];
        let mut rstd_final = vec![0.0; n];
        rmsnorm_forward(
            &x,
            self.value(self.norm),
            n,
            h,
            c.rms_norm_eps,
            &mut hf,
            &mut rstd_final,
        );
        TrunkOut {
            h_final: hf,
            routes: routes_out,
            probs: probs_out,
            layers: tapes,
            x_final: if keep { x } else { Vec::new() },
            rstd_final,
            rope,
            hidden,
        }
    }

    /// Logits `[n, V]` from final hidden states `[n, H]`.
    pub(crate) fn lm_head(&self, hf: &[f32], n: usize) -> Vec<f32> {
        let l = Linear {
            w: self.lm_head,
            b: None,
            n: self.config.vocab_size,
            k: self.config.hidden_size,
        };
        self.lin_fwd(&l, hf, n)
    }

    /// Forward over a batch of variable-length sequences: per-token logprobs of the given
    /// targets, optionally logits, the routing used, the auxiliary loss and (when
    /// `opts.train`) the tape for [`Model::backward`].
    pub fn forward(
        &self,
        batch: &[SeqInput<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<ForwardOutput> {
        self.forward_impl(batch, opts, false, Keep::Saved)
    }

    /// [`Model::forward`] whose tape (when `opts.train`) keeps the f32 input of every linear
    /// instead of a quantized linear's saved context, so that [`Model::backward`] re-runs the
    /// forward quantization of each quantized linear's input to rebuild that context.
    ///
    /// This is the reference of the saved-context tape: quantization is deterministic, so
    /// both give bitwise the same gradients (tested for every recipe), and the reference keeps
    /// more memory ([`Tape::nbytes`]). Outputs other than the tape equal [`Model::forward`]'s.
    pub fn forward_recompute_reference(
        &self,
        batch: &[SeqInput<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<ForwardOutput> {
        self.forward_impl(batch, opts, false, Keep::Recompute)
    }

    /// [`Model::forward`] that also returns, per sequence, the residual stream after every
    /// decoder layer at every position ([`ForwardOutput::hidden`]). Everything else is computed
    /// by the same operations, so logprobs, logits, routing and tape are identical to
    /// [`Model::forward`]'s. The last layer's state gives the logits through
    /// [`Model::logits_from_residual`].
    pub fn forward_capturing(
        &self,
        batch: &[SeqInput<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<ForwardOutput> {
        self.forward_impl(batch, opts, true, Keep::Saved)
    }

    /// Logits `[n, V]` from residual-stream states `[n, H]` after the last decoder layer: the
    /// final RMSNorm and the lm_head, the same operations the forward runs.
    ///
    /// # Errors
    /// `residual.len()` not a multiple of the hidden size.
    pub fn logits_from_residual(&self, residual: &[f32]) -> Result<Vec<f32>> {
        self.check_current()?;
        let c = &self.config;
        let h = c.hidden_size;
        if !residual.len().is_multiple_of(h) {
            return Err(ModelError::Input(format!(
                "residual of {} values is not a whole number of rows of hidden size {h}",
                residual.len()
            )));
        }
        let n = residual.len() / h;
        let mut hf = vec![0.0; n * h];
        let mut rstd = vec![0.0; n];
        rmsnorm_forward(
            residual,
            self.value(self.norm),
            n,
            h,
            c.rms_norm_eps,
            &mut hf,
            &mut rstd,
        );
        Ok(self.lm_head(&hf, n))
    }

    fn forward_impl(
        &self,
        batch: &[SeqInput<'_>],
        opts: &ForwardOptions<'_>,
        capture: bool,
        train_keep: Keep,
    ) -> Result<ForwardOutput> {
        self.check_current()?;
        let c = &self.config;
        let keep = if opts.train {
            train_keep
        } else {
            Keep::Nothing
        };
        if !(opts.temperature > 0.0 && opts.temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature {} must be positive and finite",
                opts.temperature
            )));
        }
        let mut tokens = Vec::new();
        let mut targets = Vec::new();
        let mut lens = Vec::new();
        for (b, s) in batch.iter().enumerate() {
            if s.tokens.len() != s.targets.len() {
                return Err(ModelError::Input(format!(
                    "sequence {b}: {} tokens but {} targets",
                    s.tokens.len(),
                    s.targets.len()
                )));
            }
            self.check_tokens(s.tokens, &format!("sequence {b} tokens"))?;
            self.check_tokens(s.targets, &format!("sequence {b} targets"))?;
            tokens.extend_from_slice(s.tokens);
            targets.extend_from_slice(s.targets);
            lens.push(s.tokens.len());
        }
        let layout = SeqLayout::new(&lens);
        let n = tokens.len();
        let packed_replay = match opts.replay {
            Some((traces, kind)) => Some((self.pack_replay(traces, &lens)?, kind)),
            None => None,
        };
        let positions = layout.positions();
        let trunk = self.trunk(
            &tokens,
            &positions,
            Pass::Prefill {
                layout: &layout,
                caches: None,
            },
            packed_replay.as_ref().map(|(r, k)| (r.as_slice(), *k)),
            keep,
            capture,
        );
        let v = c.vocab_size;
        let head = Linear {
            w: self.lm_head,
            b: None,
            n: c.vocab_size,
            k: c.hidden_size,
        };
        let (logits, head_saved) = self.lin_fwd_keep(&head, &trunk.h_final, n, keep);
        let (lp, lse) = logprobs_forward(&logits, &targets, n, v, opts.temperature);
        let aux_layers: Vec<(&[f32], &[u32])> = trunk
            .probs
            .iter()
            .zip(&trunk.routes)
            .filter_map(|(p, r)| Some((p.as_ref()?.as_slice(), r.as_ref()?.ids.as_slice())))
            .collect();
        let aux_loss =
            (!aux_layers.is_empty()).then(|| load_balancing_loss(&aux_layers, c.num_experts).0);
        let split = |x: &[f32], w: usize| -> Vec<Vec<f32>> {
            (0..layout.num_seqs())
                .map(|b| x[layout.offset(b) * w..(layout.offset(b) + layout.len(b)) * w].to_vec())
                .collect()
        };
        let routing = (0..layout.num_seqs())
            .map(|b| RoutingTrace {
                layers: trunk
                    .routes
                    .iter()
                    .flatten()
                    .map(|r| {
                        let k = r.top_k;
                        let (o, l) = (layout.offset(b), layout.len(b));
                        Routes {
                            top_k: k,
                            ids: r.ids[o * k..(o + l) * k].to_vec(),
                            weights: r.weights[o * k..(o + l) * k].to_vec(),
                        }
                    })
                    .collect(),
            })
            .collect();
        let logprobs = split(&lp, 1);
        let logits_out = opts.return_logits.then(|| split(&logits, v));
        let hidden = capture.then(|| {
            (0..layout.num_seqs())
                .map(|b| {
                    HiddenStates::from_packed(
                        &trunk.hidden,
                        c.hidden_size,
                        layout.offset(b),
                        layout.len(b),
                    )
                })
                .collect()
        });
        let tape = opts.train.then(|| Tape {
            layout: layout.clone(),
            tokens,
            targets,
            temperature: opts.temperature,
            rope: trunk.rope,
            layers: trunk.layers,
            x_final: trunk.x_final,
            rstd_final: trunk.rstd_final,
            h_final: if head_saved.is_some() {
                Vec::new()
            } else {
                trunk.h_final
            },
            logits,
            lse,
            head_saved,
            version: self.version,
        });
        Ok(ForwardOutput {
            logprobs,
            logits: logits_out,
            routing,
            aux_loss,
            tape,
            hidden,
        })
    }

    fn pack_replay(&self, traces: &[RoutingTrace], lens: &[usize]) -> Result<Vec<PackedRoutes>> {
        let c = &self.config;
        if traces.len() != lens.len() {
            return Err(ModelError::Input(format!(
                "routing replay: {} traces for {} sequences",
                traces.len(),
                lens.len()
            )));
        }
        let mut out = Vec::with_capacity(c.num_layers);
        let mut moe = 0;
        for l in 0..c.num_layers {
            if !c.is_moe_layer(l) {
                out.push(None);
                continue;
            }
            let k = c.num_experts_per_tok;
            let mut ids = Vec::new();
            let mut w = Vec::new();
            for (b, t) in traces.iter().enumerate() {
                let r = t.layers.get(moe).ok_or_else(|| {
                    ModelError::Input(format!(
                        "routing replay: sequence {b} has no routes for MoE layer {l}"
                    ))
                })?;
                if r.top_k != k || r.ids.len() != lens[b] * k || r.weights.len() != lens[b] * k {
                    return Err(ModelError::Input(format!(
                        "routing replay: sequence {b} layer {l}: {} ids / {} weights with top_k {}, expected {}×{k}",
                        r.ids.len(),
                        r.weights.len(),
                        r.top_k,
                        lens[b]
                    )));
                }
                if let Some(&bad) = r.ids.iter().find(|&&i| i as usize >= c.num_experts) {
                    return Err(ModelError::Input(format!(
                        "routing replay: sequence {b} layer {l}: expert id {bad} ≥ num_experts {}",
                        c.num_experts
                    )));
                }
                ids.extend_from_slice(&r.ids);
                w.extend_from_slice(&r.weights);
            }
            moe += 1;
            out.push(Some((ids, w)));
        }
        Ok(out)
    }

    /// The entropy of the tempered next-token distribution at every position of a training
    /// forward (per sequence), from the logits its tape kept
    /// ([`mxrl_tensor::loss::log_softmax_tempered`], then
    /// [`mxrl_tensor::loss::entropy_of_logprobs`]): what [`crate::engine::Engine::entropy`]
    /// returns on a device.
    pub fn entropy(&self, tape: &Tape) -> Vec<Vec<f32>> {
        let v = self.config.vocab_size;
        let mut lp = Vec::with_capacity(v);
        (0..tape.layout.num_seqs())
            .map(|b| {
                let rows = tape.layout.offset(b)..tape.layout.offset(b) + tape.layout.len(b);
                tape.logits[rows.start * v..rows.end * v]
                    .chunks(v)
                    .map(|row| {
                        log_softmax_tempered(row, tape.temperature, &mut lp);
                        entropy_of_logprobs(&lp)
                    })
                    .collect()
            })
            .collect()
    }

    /// Backward from `dlogprobs` (per sequence, `∂L/∂logprob[t]`, same shapes as the forward's
    /// logprobs) and, when `aux_loss_coef ≠ 0`, `aux_loss_coef · aux_loss` added to the loss.
    /// Returns the gradients of all parameters (f32).
    pub fn backward(
        &self,
        tape: &Tape,
        dlogprobs: &[Vec<f32>],
        aux_loss_coef: f32,
    ) -> Result<Grads> {
        self.check_current()?;
        let c = &self.config;
        if tape.version != self.version {
            return Err(ModelError::Input(format!(
                "tape was recorded with weight version {}, model is at {}",
                tape.version, self.version
            )));
        }
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
        let dlp: Vec<f32> = dlogprobs.iter().flatten().copied().collect();
        let (n, h, d, v) = (tape.tokens.len(), c.hidden_size, c.head_dim, c.vocab_size);
        let (hq, hkv) = (c.num_heads, c.num_kv_heads);
        let mut g = self.params.zero_grads();
        let mut dlogits = vec![0.0; n * v];
        logprobs_backward(
            &dlp,
            &tape.logits,
            &tape.lse,
            &tape.targets,
            n,
            v,
            tape.temperature,
            &mut dlogits,
        );
        let head = Linear {
            w: self.lm_head,
            b: None,
            n: v,
            k: h,
        };
        let dhf = self.lin_bwd(
            &head,
            &tape.h_final,
            tape.head_saved.as_ref(),
            &dlogits,
            n,
            &mut g,
        );
        let mut dx = vec![0.0; n * h];
        rmsnorm_backward(
            &dhf,
            &tape.x_final,
            self.value(self.norm),
            &tape.rstd_final,
            n,
            h,
            &mut dx,
            g.get_mut(self.norm),
        );
        // aux loss gradient w.r.t. each MoE layer's router probabilities
        let mut aux_dprobs: Vec<Option<Vec<f32>>> = vec![None; c.num_layers];
        if aux_loss_coef != 0.0 {
            let mut idx = Vec::new();
            let mut pairs: Vec<(&[f32], &[u32])> = Vec::new();
            for (l, t) in tape.layers.iter().enumerate() {
                if let FfnTape::Moe { routes, state, .. } = &t.ffn {
                    idx.push(l);
                    pairs.push((&state.probs, &routes.ids));
                }
            }
            let (_, grads) = load_balancing_loss(&pairs, c.num_experts);
            for (l, gr) in idx.into_iter().zip(grads) {
                aux_dprobs[l] = Some(gr.into_iter().map(|x| x * aux_loss_coef).collect());
            }
        }
        let shape = self.attn_shape();
        for (li, (layer, t)) in self.layers.iter().zip(&tape.layers).enumerate().rev() {
            // FFN block: x = x_mid + ffn(rmsnorm(x_mid))
            let mut dh2 = vec![0.0f32; n * h];
            match (&layer.ffn, &t.ffn) {
                (Ffn::Dense(mlp), FfnTape::Dense(mt)) => {
                    dh2 = self.mlp_backward(mlp, mt, &t.h2, &dx, n, &mut g);
                }
                (
                    Ffn::Moe {
                        router,
                        experts,
                        shared,
                    },
                    FfnTape::Moe {
                        routes,
                        state,
                        dispatch,
                        experts: et,
                        shared: st,
                        router_saved,
                    },
                ) => {
                    let e = c.num_experts;
                    let k = c.num_experts_per_tok;
                    let mut dweights = vec![0.0f32; n * k];
                    for (ei, (mlp, mt)) in experts.iter().zip(et).enumerate() {
                        let rows = dispatch.rows(ei);
                        if rows.is_empty() {
                            continue;
                        }
                        let dy = combine_backward(&dx, &mt.y, h, rows, routes, &mut dweights);
                        let dxe = self.mlp_backward(mlp, mt, &mt.x, &dy, rows.len(), &mut g);
                        gather_backward(&dxe, h, rows, &mut dh2);
                    }
                    if let (Some(s), Some((smt, gl, gs))) = (shared, st.as_deref()) {
                        // out += sigmoid(gl) · y_s
                        let mut dys = vec![0.0f32; n * h];
                        let mut dgl = vec![0.0f32; n];
                        for r in 0..n {
                            let sg = sigmoid(gl[r]);
                            let mut dot = 0.0f32;
                            for j in 0..h {
                                dys[r * h + j] = sg * dx[r * h + j];
                                dot += dx[r * h + j] * smt.y[r * h + j];
                            }
                            dgl[r] = dot * sg * (1.0 - sg);
                        }
                        let a = self.mlp_backward(&s.mlp, smt, &t.h2, &dys, n, &mut g);
                        let b = self.lin_bwd(&s.gate, &t.h2, gs.as_ref(), &dgl, n, &mut g);
                        for ((o, x), y) in dh2.iter_mut().zip(&a).zip(&b) {
                            *o += x + y;
                        }
                    }
                    let mut dlogits_r = vec![0.0f32; n * e];
                    router_backward(
                        &dweights,
                        routes,
                        state,
                        n,
                        e,
                        c.norm_topk_prob,
                        aux_dprobs[li].as_deref(),
                        &mut dlogits_r,
                    );
                    let dr =
                        self.lin_bwd(router, &t.h2, router_saved.as_ref(), &dlogits_r, n, &mut g);
                    for (o, x) in dh2.iter_mut().zip(&dr) {
                        *o += x;
                    }
                }
                _ => unreachable!("tape layer kind matches the model layer kind"),
            }
            let mut dxm = vec![0.0f32; n * h];
            rmsnorm_backward(
                &dh2,
                &t.x_mid,
                self.value(layer.ln2),
                &t.rstd2,
                n,
                h,
                &mut dxm,
                g.get_mut(layer.ln2),
            );
            for (a, b) in dx.iter_mut().zip(&dxm) {
                *a += b;
            }
            // attention block: x_mid = x_in + o(attn(rope(norm(q(h1))), …)), h1 = rmsnorm(x_in)
            let datt = self.lin_bwd(&layer.o, &t.att, t.o_saved.as_ref(), &dx, n, &mut g);
            let mut dq = vec![0.0f32; n * hq * d];
            let mut dk = vec![0.0f32; n * hkv * d];
            let mut dv = vec![0.0f32; n * hkv * d];
            attention_backward(
                &datt, &t.q, &t.k, &t.v, &t.probs, layout, shape, &mut dq, &mut dk, &mut dv,
            );
            rope_backward(&mut dq, n, hq, &tape.rope);
            rope_backward(&mut dk, n, hkv, &tape.rope);
            if let (Some(qn), Some(kn)) = (layer.q_norm, layer.k_norm) {
                let mut dqp = vec![0.0f32; n * hq * d];
                rmsnorm_backward(
                    &dq,
                    &t.q_pre,
                    self.value(qn),
                    &t.rstd_q,
                    n * hq,
                    d,
                    &mut dqp,
                    g.get_mut(qn),
                );
                dq = dqp;
                let mut dkp = vec![0.0f32; n * hkv * d];
                rmsnorm_backward(
                    &dk,
                    &t.k_pre,
                    self.value(kn),
                    &t.rstd_k,
                    n * hkv,
                    d,
                    &mut dkp,
                    g.get_mut(kn),
                );
                dk = dkp;
            }
            let ctx = |j: usize| t.qkv_idx[j].map(|i| &t.qkv_saved[i]);
            let mut dh1 = self.lin_bwd(&layer.q, &t.h1, ctx(0), &dq, n, &mut g);
            for (j, lin, dd) in [(1, &layer.k, &dk), (2, &layer.v, &dv)] {
                let r = self.lin_bwd(lin, &t.h1, ctx(j), dd, n, &mut g);
                for (a, b) in dh1.iter_mut().zip(&r) {
                    *a += b;
                }
            }
            let mut dxi = vec![0.0f32; n * h];
            rmsnorm_backward(
                &dh1,
                &t.x_in,
                self.value(layer.ln1),
                &t.rstd1,
                n,
                h,
                &mut dxi,
                g.get_mut(layer.ln1),
            );
            for (a, b) in dx.iter_mut().zip(&dxi) {
                *a += b;
            }
        }
        let rows = tape.tokens.len();
        mxrl_tensor::embedding::embedding_backward(
            g.get_mut(self.embed),
            &dx[..rows * h],
            &tape.tokens,
            h,
        );
        Ok(g)
    }
}

/// The GEMM precision `plan` gives the linear whose weight is `name` (a model parameter name;
/// a fused `gate_up_proj` follows its HF `gate_proj` / `up_proj` entries, which must agree):
/// BF16 entries run as [`LinearPrecision::Bf16`], block formats as
/// [`LinearPrecision::Quantized`] with the plan's backward mode and NVFP4 activation scaling.
///
/// # Errors
/// A name the plan does not cover, fused parts with different decisions, or a spec the
/// library refuses.
pub fn plan_precision(plan: &mxrl_plan::PrecisionPlan, name: &str) -> Result<LinearPrecision> {
    use mxrl_tensor::qlinear::{ActScaling, BackwardMode};
    let mut prec = None;
    for hf in crate::hf::hf_names(name) {
        let e = plan.by_hf(&hf).ok_or_else(|| ModelError::BadTensor {
            name: hf.clone(),
            message: "not covered by the precision plan".into(),
        })?;
        let p = if e.format == mxrl_formats::Format::Bf16 {
            LinearPrecision::Bf16
        } else {
            let mode = match e.backward {
                mxrl_plan::BackwardMode::Lowp => BackwardMode::Lowp,
                mxrl_plan::BackwardMode::HighPrecision => BackwardMode::HighPrecision,
                mxrl_plan::BackwardMode::Dequantized => BackwardMode::Dequantized,
            };
            let bad = |e: mxrl_tensor::qlinear::QLinearError| ModelError::BadTensor {
                name: hf.clone(),
                message: e.to_string(),
            };
            let mut spec = LinearSpec::new(e.format, mode).map_err(bad)?;
            if e.format == mxrl_formats::Format::Nvfp4 {
                let scaling = match plan.nvfp4_activation_scale() {
                    mxrl_plan::ActivationScale::PerToken => ActScaling::PerToken,
                    mxrl_plan::ActivationScale::PerTensor => ActScaling::PerTensor,
                };
                spec = spec.with_act_scaling(scaling).map_err(bad)?;
            }
            LinearPrecision::Quantized(spec)
        };
        match prec {
            None => prec = Some(p),
            Some(q) if q == p => {}
            Some(q) => {
                return Err(ModelError::BadTensor {
                    name: name.into(),
                    message: format!("fused parts disagree in the plan: {q:?} vs {p:?}"),
                })
            }
        }
    }
    Ok(prec.expect("hf_names gives at least one name"))
}
