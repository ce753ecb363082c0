//! mxrl-tensor: the compute core shared by the trainer and the rollout engine.
//!
//! The CPU backend here is the permanent reference every other device must match.
//!
//! # Design
//! Ops work on plain row-major `f32` slices with explicit shapes, in the style of llm.c: every
//! layer is one `*_forward` and one `*_backward` function whose doc comment gives the shapes and
//! the accumulation dtype. Forward functions return (or fill) what their backward needs; backward
//! functions **accumulate** (`+=`) into parameter gradients and **overwrite** input gradients
//! unless the doc says otherwise. Variable-length batches are packed token-major (`[N, ...]`
//! with `N = Σ len_b`) and described by [`SeqLayout`].
//!
//! | module | ops |
//! |---|---|
//! | [`gemm`] | f32 GEMM `nt`/`nn`/`tn` (+ triple-loop reference) |
//! | [`device`] | the op set every device implements ([`device::Backend`]) and the CPU reference implementation; [`device::Device`] |
//! | [`host_gemm`] | the host model's linear-layer GEMMs on the CPU, shared weight operands |
//! | [`precision`] | BF16 rounding of GEMM operands ([`precision::round_bf16`]) |
//! | [`norm`] | RMSNorm |
//! | [`rope`] | rotary position embedding (rotate-half form) |
//! | [`attention`] | causal GQA attention: prefill forward/backward, single-token decode |
//! | [`activation`] | softmax, SiLU, SwiGLU |
//! | [`routing`] | top-k softmax router (`norm_topk_prob`), routing replay, aux load-balancing loss |
//! | [`moe`] | MoE dispatch / combine |
//! | [`embedding`] | token embedding gather and scatter-add backward |
//! | [`loss`] | log-softmax, per-token logprobs, cross-entropy |
//! | [`optim`] | AdamW with f32 master weights, global grad norm and clipping |
//! | [`gradcheck`] | finite-difference gradient checking with a derived error bound |
//! | [`sample`] | sampling one token per row (temperature, top-k, top-p) with a counter-based uniform draw: every device sampler's reference |
//! | [`tolerance`] | derived bounds for comparing a device with the CPU reference (summation order only) |
//! | [`qlinear`] | quantized linear `y = x·Wᵀ` (BF16/MXFP8/NVFP4/FP8-block) with `lowp` / `high_precision` / `dequantized` backward, prepared weights, memory accounting |
#![deny(missing_docs)]

pub mod activation;
pub mod attention;
pub mod device;
pub mod embedding;
pub mod gemm;
pub mod gradcheck;
pub mod host_gemm;
pub mod loss;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod precision;
pub mod qlinear;
pub mod rope;
pub mod routing;
pub mod sample;
pub mod tolerance;

mod layout;
pub use layout::SeqLayout;

/// Unit roundoff of IEEE binary32, `u = 2⁻²⁴`; all derived tolerances are multiples of it.
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0;
