//! mxrl-model: the MoE transformer that is both the trainer and the rollout engine.
//!
//! Supported: `Qwen3MoeForCausalLM` (GQA, RoPE θ, q/k RMSNorm, softmax top-k router with
//! `norm_topk_prob`, SwiGLU experts, tied or untied embeddings) and `Qwen2MoeForCausalLM`
//! (q/k/v bias, shared expert with a sigmoid gate); dense layers where
//! `mlp_only_layers` / `decoder_sparse_step` say so.
//!
//! # Public API (what the RL loop calls)
//! - [`ModelConfig`]: from an HF `config.json` ([`ModelConfig::from_dir`]) or built in code
//!   ([`ModelConfig::tiny`]).
//! - [`Model`]: [`Model::random`] (seeded), [`Model::load_hf`] (BF16/F32 safetensors),
//!   [`Model::load_converted`] (an `mxrl convert` output, quantized weights used as stored),
//!   [`Model::params`] / [`Model::params_mut`] (named f32 master weights for the optimizer and
//!   weight export; prepared GEMM weights are rebuilt when the guard drops),
//!   [`Model::set_precision`] (per-linear GEMM precision).
//! - Training: [`Model::forward`] over a batch of variable-length [`SeqInput`]s returns
//!   per-token logprobs of the given targets (and logits when asked), the [`RoutingTrace`] of
//!   each sequence, the auxiliary load-balancing loss, and a [`Tape`]; [`Model::backward`] takes
//!   `∂L/∂logprob` per token (plus the aux-loss coefficient) and returns [`Grads`] for every
//!   parameter. Routing replay: pass the rollout's traces in [`ForwardOptions::replay`]
//!   ([`ReplayKind::Ids`] recomputes combine weights, [`ReplayKind::Full`] uses them verbatim).
//! - Training state: the model owns its f32 masters ([`Model::params`]) and, after
//!   [`Model::enable_training`], their gradients: [`Model::backward_accumulate`] adds a
//!   backward's gradients, [`Model::train_params_mut`] hands masters and gradients to an
//!   optimizer, and [`Model::refresh_weights`] re-derives the working weights (BF16 operands,
//!   quantized stored bytes, and after [`Model::use_bf16_params`] the BF16 values of norms,
//!   biases and an untied embedding) from the masters. [`Model::stored_weight`] and
//!   [`Model::param_bf16`] are the weights the forward computes with, as a weight update
//!   ships them. The same API shape as the device [`engine::Engine`].
//! - Rollout: [`Model::generate`] (batched decode, per-sequence KV caches, seeded
//!   temperature / top-k / top-p sampling) returns tokens, per-token logprobs and routing;
//!   [`Model::prefill`] and [`Model::decode_step`] are the building blocks.
//! - Per-layer drift: [`Model::forward_capturing`] and [`Model::generate_capturing`] also
//!   return [`HiddenStates`], the residual stream after every decoder layer per token.
//! - Device engine: [`engine::Engine`] holds the model on one backend; `Engine::from_checkpoint`
//!   streams an HF checkpoint into it tensor by tensor (no host [`Model`] is built).
//! - Optimizer pieces live in [`mxrl_tensor::optim`] (AdamW, grad norm, clipping).
//!
//! # Parameter names
//! HF names, except that every SwiGLU MLP stores gate and up fused as one
//! `….gate_up_proj.weight` `[2F, H]` (gate rows first), so a block format quantizes them as
//! one tensor with a shared amax. [`hf`] converts names and tensors both ways.
//!
//! # Numerics
//! All activations are f32; every linear goes through one layer type whose GEMM operands follow
//! its [`LinearPrecision`] (f32 or BF16, f32 accumulation). The KV cache is f32, and decode uses
//! the same attention row kernel as prefill.
#![deny(missing_docs)]

mod config;
mod converted;
pub mod engine;
mod engine_load;
mod error;
mod generate;
pub mod hf;
mod linear;
mod model;
mod params;

pub use config::{Arch, ModelConfig, DEFAULT_MAX_POSITIONS};
pub use error::{ModelError, Result};
pub use generate::{sample_token, DecodeStep, FinishReason, Generation, Prefilled, SamplingParams};
pub use linear::LinearPrecision;
pub use model::{
    check_aux_loss_coef, ForwardOptions, ForwardOutput, HiddenStates, KvCache, Model, ParamsMut,
    ReplayKind, RoutingTrace, SeqInput, Tape, TrainParamMut, WeightValue,
};
pub use mxrl_tensor::routing::Routes;
pub use params::{Grads, Param, ParamId, ParamStore, TensorRole};
