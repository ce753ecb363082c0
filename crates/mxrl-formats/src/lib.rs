//! mxrl-formats: the bit-exact quantizer contract of mxrl (`quant-contract.md`, v1).
//!
//! Every quantizer in mxrl — checkpoint conversion, training forward, rollout, live weight
//! export — goes through this crate, so the trainer and the rollout engine produce the same
//! bytes. The arithmetic is TransformerEngine's default math: IEEE binary32, round to nearest
//! even, no flush-to-zero, no FMA contraction; bf16/f16 inputs are widened exactly.
//!
//! # API summary
//!
//! **Element codecs** ([`element`]): [`e4m3_encode`]/[`e4m3_decode`],
//! [`e5m2_encode`]/[`e5m2_decode`], [`ue4m3_encode`], [`e2m1_encode`]/[`e2m1_decode`],
//! [`ue8m0_round_up`]/[`ue8m0_decode`]/[`ue8m0_reciprocal`]; decode tables [`E4M3_VALUES`],
//! [`E5M2_VALUES`], [`E2M1_VALUES`]. All encoders saturate (satfinite). Each rule is an
//! [`ElementRule`] variant whose doc is its formula.
//!
//! **Schemes** ([`Scheme`]): what decides the bytes besides the input.
//! - [`Scheme::Mxfp8`]`(`[`Mxfp8Scheme`]` { usage, blocks })`: [`Usage::RowWise`] (1×32 along K)
//!   or [`Usage::ColumnWise`] (32×1 along M, data kept `[M, K]`, scales `[M/32, K]`);
//!   [`MxBlocks::Vector`] or [`MxBlocks::Tile32x32`].
//! - [`Scheme::Nvfp4`]`(`[`Nvfp4Scheme`]` { amax, blocks })`: [`AmaxScope::PerTensor`] (weights;
//!   per expert for 3-D) or [`AmaxScope::PerRow`] (activations, per token);
//!   [`Nvfp4Blocks::Vector`] (1×16) or [`Nvfp4Blocks::Tile16x16`].
//! - [`Scheme::Fp8Block`]`(`[`Fp8BlockScheme`]` { blocks, scale_rule })`:
//!   [`Fp8Blocks::Weight128x128`] / [`Fp8Blocks::Activation1x128`], [`ScaleRule::F32Exact`] or
//!   [`ScaleRule::F32PowerOfTwo`].
//! - Constants for the common cases: [`Scheme::MXFP8_ROW`], [`Scheme::MXFP8_COL`],
//!   [`Scheme::NVFP4_TENSOR`], [`Scheme::NVFP4_ROW`], [`Scheme::NVFP4_2D`],
//!   [`Scheme::FP8_BLOCK_WEIGHT`], [`Scheme::FP8_BLOCK_ACT`]; [`Scheme::name`] /
//!   [`Scheme::from_name`] give stable names (`mxfp8.row`, `nvfp4.tensor`, ...).
//! - The block-scale rule of each scheme is a [`ScaleRule`] variant whose doc is its formula;
//!   the scalar rule implementations are [`mxfp8_scale`], [`Nvfp4Global`], [`fp8_block_scale`].
//!
//! **Quantize** (input `&[T]` with `T` = `f32`, [`half::bf16`] or [`half::f16`], row-major,
//! shape `[M, K]` or `[E, M, K]` — a 3-D tensor is E independent matrices, e.g. experts):
//! - [`quantize`]`(x, shape, scheme, padding) -> Result<QuantizedTensor>` — the production path
//!   (rayon-parallel fast CPU loops), byte-identical to
//!   [`reference::quantize`] (the named reference every fast path and CUDA kernel is tested
//!   against). [`quantize_into`] does the same into an existing [`QuantizedTensor`], reusing its
//!   buffers (no allocation in a training loop).
//! - [`quantize_nvfp4_stacked`]`(&[TensorRef], Nvfp4Scheme, padding)` — several tensors (an
//!   expert's gate and up) under one shared per-tensor amax; equals quantizing them stacked
//!   along M. [`quantize_nvfp4_with_amax`] takes the amax from the caller.
//! - [`Padding::Reject`] (default): a blocked dim (K, or M for column-wise / tiles) that is not
//!   a multiple of the block is a [`FormatError::NotMultiple`]. [`Padding::Zero`] quantizes
//!   the zero-padded tensor explicitly (stored shape [`QuantizedTensor::padded_shape`]).
//!
//! **Quantized tensors** ([`QuantizedTensor`]): `scheme` (format + usage + rules), `shape`,
//! `padded_shape`, `data` bytes (E4M3, or E2M1 packed low nibble first), `scales`
//! ([`Scales::Bytes`] UE8M0/UE4M3, or [`Scales::F32`] scale_inv for FP8 block), `scale_layout`
//! ([`ScaleLayout::Compact`] or [`ScaleLayout::Swizzled128x4`], convert both ways with
//! [`QuantizedTensor::with_scale_layout`]), `amax` (NVFP4 FP32). Shapes of each buffer are in
//! the type's doc table and from [`QuantizedTensor::data_shape`], [`QuantizedTensor::scale_shape`],
//! [`QuantizedTensor::amax_shape`]. [`QuantizedTensor::dequantize`] applies TE's formulas and
//! returns f32 in the logical shape.
//!
//! **Serving checkpoints** (the dequantization formulas of their consumers):
//! [`Nvfp4SecondLevel`] (NVFP4's FP32 factor stored as the contract's amax, ModelOpt's
//! `S_dec` or compressed-tensors' `S`, each with its formula), [`dequantize_nvfp4`],
//! [`nvfp4_block_product`]; the lossless FP8-block → MXFP8 re-pack [`fp8_block_to_mxfp8`]
//! ([`ue8m0_exact`], [`fp8_block_scales_are_ue8m0`]). `mxrl-ckpt` stores and reads the layouts;
//! every formula that turns stored bytes into values is here.
//!
//! **Layouts** ([`layout`]): [`pack_nibbles`] / [`unpack_nibbles`], [`swizzle_128x4`] /
//! [`unswizzle_128x4`], [`swizzle_offset`], [`swizzled_len`].
//!
//! **Corner cases** ([`corner`]): [`corner::ELEMENT_CASES`] (hand-derived expected bytes) and
//! [`corner::tensor_cases`] — the one table every path (reference, fast CPU, CUDA) runs.
//!
//! **Contract identity**: [`CONTRACT_VERSION`], [`contract_hash`] (16 hex digits, SHA-256 of
//! [`contract_params`]), metadata keys [`META_CONTRACT_VERSION`], [`META_CONTRACT_HASH`].
//!
//! # Design decisions
//! - One implementation of each scalar rule, shared by the reference loops and the fast loops;
//!   the fast paths differ only in iteration order and parallelism, and are tested byte-equal
//!   against the reference on random shapes and seeds.
//! - A column-wise MXFP8 copy is always quantized from the high-precision input.
//! - Nothing here reads environment variables or global state; a [`Scheme`] plus a
//!   [`Padding`] fully determine the bytes.
#![deny(missing_docs)]

mod contract;
pub mod corner;
pub mod element;
mod error;
mod fast;
mod format;
mod input;
pub mod layout;
pub mod reference;
mod rules;
mod scheme;
mod serving;
mod tensor;

pub use contract::{
    contract_hash, contract_params, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
pub use element::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e5m2_decode, e5m2_encode, ue4m3_encode,
    ue8m0_decode, ue8m0_reciprocal, ue8m0_round_up, ElementRule, E2M1_MAX, E2M1_VALUES, E4M3_MAX,
    E4M3_VALUES, E5M2_MAX, E5M2_VALUES,
};
pub use error::FormatError;
pub use fast::{quantize, quantize_into, quantize_nvfp4_stacked, quantize_nvfp4_with_amax};
pub use format::Format;
pub use input::{HighPrecision, TensorRef};
pub use layout::{
    pack_nibbles, swizzle_128x4, swizzle_offset, swizzled_len, unpack_nibbles, unswizzle_128x4,
};
pub use rules::{amax_of, fp8_block_scale, mxfp8_scale, Nvfp4Global};
pub use scheme::{
    AmaxScope, Fp8BlockScheme, Fp8Blocks, MxBlocks, Mxfp8Scheme, Nvfp4Blocks, Nvfp4Scheme, Padding,
    ScaleLayout, ScaleRule, Scheme, Usage, ALL_SCHEMES, FP8_BLOCK, MXFP8_BLOCK, NVFP4_BLOCK,
    NVFP4_GLOBAL_NUMERATOR, R2688, R448, R6,
};
pub use serving::{
    dequantize_nvfp4, fp8_block_scales_are_ue8m0, fp8_block_to_mxfp8, nvfp4_block_product,
    ue8m0_exact, Nvfp4SecondLevel,
};
pub use tensor::{QuantizedTensor, Scales};
