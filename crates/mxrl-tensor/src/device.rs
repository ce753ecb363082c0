//! The op set every device implements, and the CPU implementation (the reference).
//!
//! A model is written once over [`Backend`] (see `mxrl_model::engine`); a backend owns its
//! buffers (`F32`, `Bf16`, `U32`) and runs every op on them. [`CpuBackend`] implements each op
//! with the functions of this crate, in the order the CPU model uses them, so the CPU engine is
//! bitwise the CPU model; a GPU backend (`mxrl_cuda::backend::CudaBackend`) implements the same
//! ops with kernels and must match the CPU within the bounds of [`crate::tolerance`].
//!
//! Conventions: row-major, explicit shapes, lengths checked by the backend (a mismatch is a
//! [`DeviceError`], never a panic). BF16 operands are carried by the backend's `Bf16` type
//! (on the CPU: the exactly widened f32 values of the rounded numbers). Linear layers multiply
//! BF16 operands with f32 accumulation (`y = bf16(x)·bf16(W)ᵀ`), the products of
//! `LinearPrecision::Bf16`.

use crate::attention::{attention_decode, attention_forward, AttnShape};
use crate::host_gemm;
use crate::loss::logprobs_forward;
use crate::moe::{combine_forward, Dispatch};
use crate::norm::rmsnorm_forward;
use crate::precision::round_bf16;
use crate::qlinear::{LinearSpec, PreparedWeight};
use crate::rope::RopeTable;
use crate::routing::{router_forward, RouteMode, Routes};
use crate::sample::{sample_rows, SampleParams};
use crate::SeqLayout;
use rayon::prelude::*;
use std::convert::Infallible;

/// Where a model lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU (the reference backend).
    Cpu,
    /// CUDA GPU with this ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (cpu, cuda or cuda:N)")),
        }
    }
}

/// A device failure (out of memory, a failed launch, a shape the device refuses).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{device}: {what}")]
pub struct DeviceError {
    /// The device.
    pub device: String,
    /// What failed.
    pub what: String,
}

impl DeviceError {
    /// An error on `device`.
    pub fn new(device: impl Into<String>, what: impl Into<String>) -> Self {
        DeviceError {
            device: device.into(),
            what: what.into(),
        }
    }
}

/// Result of a backend op.
pub type DResult<T> = Result<T, DeviceError>;

/// Routing of one MoE layer as the engine passes it between ops: ids `[N, k]`, combine weights
/// `[N, k]`, softmax probabilities `[N, E]`, and the expert-major dispatch (`offsets [E+1]`,
/// `perm [N·k]`: packed row → `token·k + slot`).
pub struct RouteBufs<B: Backend + ?Sized> {
    /// Expert ids `[N, k]`.
    pub ids: B::U32,
    /// Combine weights `[N, k]`.
    pub weights: B::F32,
    /// Router probabilities `[N, E]`.
    pub probs: B::F32,
    /// Expert row offsets `[E + 1]` into the packed rows.
    pub offsets: B::U32,
    /// Packed row → `token·k + slot`, `[N·k]`.
    pub perm: B::U32,
    /// `token·k + slot` → packed row, `[N·k]` (the inverse of `perm`).
    pub row_of: B::U32,
}

/// How a backward op writes a weight gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `dW += Σ`: the buffer holds the gradient so far.
    Accumulate,
    /// The buffer holds nothing yet (its contents are unspecified, e.g. a fresh step whose
    /// zeroing was deferred): `dW = 0 + Σ`, the bits accumulating into zeros gives, and every
    /// element is written (zeros where there is no contribution), without reading the buffer.
    Overwrite,
}

/// [`Backend::rmsnorm_linear_shared`] as its two ops ([`Backend::rmsnorm_bf16`], then
/// [`Backend::linear_shared`]): the default, and what a device does where it has no fused kernel.
///
/// # Errors
/// As the two ops.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub fn rmsnorm_then_linear_shared<B: Backend + ?Sized>(
    b: &B,
    x: &B::F32,
    w: &B::F32,
    eps: f32,
    m: usize,
    k: usize,
    outs: &mut [(&B::Bf16, usize, &mut B::F32)],
) -> DResult<()> {
    let mut xb = b.empty_bf16(m * k)?;
    let mut rstd = b.empty_f32(m)?;
    b.rmsnorm_bf16(x, w, m, k, eps, &mut xb, &mut rstd)?;
    b.linear_shared(&xb, m, k, outs)
}

/// [`Backend::add_rmsnorm_linear`] as its two ops ([`Backend::add_rmsnorm`] in `o`'s buffer,
/// which then becomes `x`, and [`Backend::linear`]): the default, and what a device does where
/// it has no fused kernel.
///
/// # Errors
/// As the two ops.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_then_linear<B: Backend + ?Sized>(
    b: &B,
    (o, res, x): (&mut B::F32, &B::F32, &mut B::F32),
    w: &B::F32,
    (rows, d, eps): (usize, usize, f32),
    (y, yb, rstd): (Option<&mut B::F32>, &mut B::Bf16, &mut B::F32),
    (lw, n, out): (&B::Bf16, usize, &mut B::F32),
) -> DResult<()> {
    b.add_rmsnorm(o, res, w, rows, d, eps, y, Some(&mut *yb), rstd)?;
    std::mem::swap(o, x);
    b.linear(yb, lw, rows, d, n, out)
}

/// [`Backend::moe_gate_up_swiglu_bf16`] as its three ops ([`Backend::gather_rows_bf16`],
/// [`Backend::grouped_linear`], [`Backend::swiglu_bf16`]): the default, and what a device does
/// where it has no fused kernel.
///
/// # Errors
/// As the three ops.
#[allow(clippy::too_many_arguments)]
pub fn gather_gate_up_swiglu_bf16<B: Backend + ?Sized>(
    b: &B,
    xb: &B::Bf16,
    route: &RouteBufs<B>,
    n: usize,
    e: usize,
    top_k: usize,
    h: usize,
    f: usize,
    w: &B::Bf16,
    act: &mut B::Bf16,
) -> DResult<()> {
    let rows = n * top_k;
    let mut xg = b.empty_bf16(rows * h)?;
    b.gather_rows_bf16(xb, route, n, e, top_k, h, &mut xg)?;
    let mut gu = b.empty_f32(rows * 2 * f)?;
    b.grouped_linear(&xg, w, &route.offsets, None, e, rows, h, 2 * f, &mut gu)?;
    b.swiglu_bf16(&gu, rows, f, act)
}

/// [`Backend::moe_down_combine_bf16`] as its two ops ([`Backend::grouped_linear`],
/// [`Backend::combine_add`]): the default, and what a device does where it has no fused kernel.
///
/// # Errors
/// As the two ops.
#[allow(clippy::too_many_arguments)]
pub fn grouped_down_then_combine_add<B: Backend + ?Sized>(
    b: &B,
    act: &B::Bf16,
    route: &RouteBufs<B>,
    n: usize,
    e: usize,
    top_k: usize,
    f: usize,
    h: usize,
    w: &B::Bf16,
    residual: &B::F32,
    out: &mut B::F32,
) -> DResult<()> {
    let rows = n * top_k;
    let mut y = b.empty_f32(rows * h)?;
    b.grouped_linear(act, w, &route.offsets, None, e, rows, f, h, &mut y)?;
    b.combine_add(&y, route, n, e, top_k, h, residual, out)
}

/// [`Backend::grouped_qlinear_swiglu`] as its two ops ([`Backend::swiglu_f32`],
/// [`Backend::grouped_qlinear`]): the default, and what a device does where it has no fused
/// quantizer for the weights' format.
///
/// # Errors
/// As the two ops.
#[allow(clippy::too_many_arguments)]
pub fn swiglu_then_grouped_qlinear<B: Backend + ?Sized>(
    b: &B,
    gu: &B::F32,
    w: &B::QExperts,
    offsets: &B::U32,
    experts: usize,
    rows: usize,
    f: usize,
    n: usize,
    y: &mut B::F32,
) -> DResult<()> {
    let mut a = b.empty_f32(rows * f)?;
    b.swiglu_f32(gu, rows, f, &mut a)?;
    b.grouped_qlinear(&a, w, offsets, experts, rows, f, n, y)
}

/// The op set of a device. Shapes in each doc; buffers may be longer than needed.
#[allow(clippy::too_many_arguments)]
pub trait Backend {
    /// f32 buffer.
    type F32;
    /// BF16 buffer (GEMM operands, KV cache).
    type Bf16;
    /// u32 buffer (token ids, expert ids, offsets).
    type U32;
    /// The RoPE table of positions `0..max_pos` ([`Backend::rope_table`]).
    type Rope;
    /// Recorded device work that can be replayed ([`Backend::end_capture`]).
    type Graph;
    /// The routed experts' weights of one projection in a block format, as stored
    /// ([`Backend::upload_experts`]).
    type QExperts;
    /// A gradient norm whose buffers are summed one by one as they become final
    /// ([`Backend::grad_norm_begin`]).
    type NormParts;

    /// The device.
    fn device(&self) -> Device;

    /// Waits until every queued operation has finished (timing; nothing else needs it).
    ///
    /// # Errors
    /// Device failure.
    fn synchronize(&self) -> DResult<()> {
        Ok(())
    }

    /// Zero-filled buffers.
    ///
    /// # Errors
    /// Out of memory.
    fn zeros_f32(&self, n: usize) -> DResult<Self::F32>;
    /// See [`Backend::zeros_f32`].
    ///
    /// # Errors
    /// Out of memory.
    fn zeros_bf16(&self, n: usize) -> DResult<Self::Bf16>;
    /// Host → device copies.
    ///
    /// # Errors
    /// Out of memory.
    fn upload_f32(&self, v: &[f32]) -> DResult<Self::F32>;
    /// See [`Backend::upload_f32`].
    ///
    /// # Errors
    /// Out of memory.
    fn upload_u32(&self, v: &[u32]) -> DResult<Self::U32>;
    /// Device → host copies (the first `n` elements).
    ///
    /// # Errors
    /// A device failure (also of an earlier queued op).
    fn download_f32(&self, b: &Self::F32, n: usize) -> DResult<Vec<f32>>;
    /// See [`Backend::download_f32`].
    ///
    /// # Errors
    /// A device failure.
    fn download_u32(&self, b: &Self::U32, n: usize) -> DResult<Vec<u32>>;
    /// Device → host read-back of the first `n` elements without a new `Vec`: `f` is called
    /// once with them, borrowed from the backend's own host memory (the CPU's buffer itself;
    /// CUDA's reusable page-locked read-back buffer, held by this call until `f` returns).
    /// For large tables of which the caller keeps only parts. `f` must not read back through
    /// the same backend.
    ///
    /// # Errors
    /// Short buffer; a device failure (also of an earlier queued op).
    fn download_f32_with(&self, b: &Self::F32, n: usize, f: &mut dyn FnMut(&[f32])) -> DResult<()>;
    /// See [`Backend::download_f32_with`].
    ///
    /// # Errors
    /// Short buffer; a device failure.
    fn download_u32_with(&self, b: &Self::U32, n: usize, f: &mut dyn FnMut(&[u32])) -> DResult<()>;

    /// `out[i] = bf16(x[i])`, `i < n` (round to nearest even).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn to_bf16(&self, x: &Self::F32, out: &mut Self::Bf16, n: usize) -> DResult<()>;
    /// `out[i] = f32(bf16(x[i]))`, `i < n`: a parameter's BF16 value, kept as f32.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn round_bf16(&self, x: &Self::F32, out: &mut Self::F32, n: usize) -> DResult<()>;
    /// `dst[..n] = src[..n]` (device to device).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn copy_bf16(&self, src: &Self::Bf16, dst: &mut Self::Bf16, n: usize) -> DResult<()>;
    /// Block copies (bitwise): for `j < count`, the block of `block` values at index
    /// `map[2j + 1]` of `dst` becomes the block at index `map[2j]` of `src`; a pair naming a
    /// block outside either buffer is skipped, and the pairs' destinations must be distinct
    /// (else which copy lands is unspecified). E.g. a prompt's prefilled KV-cache rows copied
    /// to every slot that decodes it.
    ///
    /// # Errors
    /// A map shorter than `2·count`; device failure.
    fn copy_blocks_bf16(
        &self,
        src: &Self::Bf16,
        dst: &mut Self::Bf16,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()>;
    /// [`Backend::copy_blocks_bf16`] on f32 buffers.
    ///
    /// # Errors
    /// As [`Backend::copy_blocks_bf16`].
    fn copy_blocks_f32(
        &self,
        src: &Self::F32,
        dst: &mut Self::F32,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()>;
    /// [`Backend::copy_blocks_bf16`] on u32 buffers.
    ///
    /// # Errors
    /// As [`Backend::copy_blocks_bf16`].
    fn copy_blocks_u32(
        &self,
        src: &Self::U32,
        dst: &mut Self::U32,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()>;
    /// `out[i] = f32(x[i])`, `i < n` (exact).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn widen_bf16(&self, x: &Self::Bf16, out: &mut Self::F32, n: usize) -> DResult<()>;
    /// Adds [`checksum_bf16_bits`] of `x[..n]` to the u64 held in `out[2·slot]` (low word),
    /// `out[2·slot + 1]` (high word); the caller zeroes it first.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn checksum_bf16(
        &self,
        x: &Self::Bf16,
        n: usize,
        out: &mut Self::U32,
        slot: usize,
    ) -> DResult<()>;
    /// The first `n` BF16 values of `b` as bit patterns (device → host).
    ///
    /// # Errors
    /// Short buffer; a device failure.
    fn download_bf16(&self, b: &Self::Bf16, n: usize) -> DResult<Vec<u16>>;
    /// BF16 values from their little-endian bytes (2 per value), host → device, as a weight
    /// update carries them: a device copies the bytes as they are (CUDA through page-locked
    /// staging buffers); the CPU, whose BF16 buffers hold the values as f32, widens them
    /// (exact). The inverse of [`Backend::download_bf16`].
    ///
    /// # Errors
    /// An odd byte count; out of memory; device failure.
    fn upload_bf16_bytes(&self, bytes: &[u8]) -> DResult<Self::Bf16>;
    /// `y[i] += x[i]`, `i < n`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn add(&self, y: &mut Self::F32, x: &Self::F32, n: usize) -> DResult<()>;
    /// `y[r, :] += b[:]` for `r < rows` (bias).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn add_bias(&self, y: &mut Self::F32, b: &Self::F32, rows: usize, n: usize) -> DResult<()>;
    /// `out[r] = table[tokens[r]]`, `table: [vocab, h]`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn embed(
        &self,
        table: &Self::F32,
        vocab: usize,
        tokens: &Self::U32,
        rows: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()>;
    /// RMSNorm forward (reference [`rmsnorm_forward`]): `x: [rows, d]` → `y`, `rstd: [rows]`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn rmsnorm(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: &mut Self::F32,
        rstd: &mut Self::F32,
    ) -> DResult<()>;
    /// RoPE forward in place on `x: [rows, heads·D]`, row `r` at position `pos[r]`, with the
    /// table over positions `0..` built by [`Backend::rope_table`].
    ///
    /// # Errors
    /// Short buffers; a position beyond the table; device failure.
    fn rope(
        &self,
        x: &mut Self::F32,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &Self::U32,
        table: &Self::Rope,
    ) -> DResult<()>;
    /// The RoPE table of positions `0..max_pos` (values of [`RopeTable::new`]).
    ///
    /// # Errors
    /// An odd head width; out of memory.
    fn rope_table(&self, max_pos: usize, head_dim: usize, theta: f64) -> DResult<Self::Rope>;
    /// `y[m, n] = x[m, k] · W[n, k]ᵀ` with BF16 operands, f32 accumulation (overwrites `y`).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn linear(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        m: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()>;
    /// Several BF16 linears of one input (a layer's q, k and v projections): `y_i [m, n_i] =
    /// x [m, k] · W_i [n_i, k]ᵀ` for each `(W_i, n_i, y_i)`: the products of
    /// [`Backend::linear`], each sum in an order the device fixes for the call's shapes (the
    /// same bits on one device for the same shapes). The default calls [`Backend::linear`] per
    /// weight; a device may run them in one launch, summing in another order than `linear`
    /// alone (CUDA: q, k and v of a decode batch on the fragment kernels).
    ///
    /// # Errors
    /// As [`Backend::linear`].
    #[allow(clippy::type_complexity)]
    fn linear_shared(
        &self,
        x: &Self::Bf16,
        m: usize,
        k: usize,
        outs: &mut [(&Self::Bf16, usize, &mut Self::F32)],
    ) -> DResult<()> {
        for (w, n, y) in outs.iter_mut() {
            self.linear(x, w, m, k, *n, y)?;
        }
        Ok(())
    }
    /// [`Backend::rmsnorm_bf16`] of `x [m, k]` with weight `w [k]`, then
    /// [`Backend::linear_shared`] of the normalized BF16 rows (decode's attention input and its
    /// q, k, v projections), with exactly those bits; neither the rows nor `rstd` are kept. The
    /// default composes the two; a device may fuse them.
    ///
    /// # Errors
    /// As the two ops.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn rmsnorm_linear_shared(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        eps: f32,
        m: usize,
        k: usize,
        outs: &mut [(&Self::Bf16, usize, &mut Self::F32)],
    ) -> DResult<()> {
        rmsnorm_then_linear_shared(self, x, w, eps, m, k, outs)
    }
    /// Decode's residual add, RMSNorm and router of an MoE layer in one op: `x = o + res` (the
    /// f32 sum of [`Backend::add`]), its norm into `y` (f32, when given) and `yb` (BF16) with
    /// `rstd`, then `out [rows, n] = yb · lwᵀ` — the bits of [`Backend::add_rmsnorm`] followed
    /// by [`Backend::linear`] (`lw [n, d]`). `o` holds the attention's projection on entry and
    /// anything after; `x` is overwritten. The default composes the two ops; a device may fuse
    /// them (CUDA: for the rows its small-M linear takes).
    ///
    /// # Errors
    /// As the two ops.
    #[allow(clippy::too_many_arguments)]
    fn add_rmsnorm_linear(
        &self,
        (o, res, x): (&mut Self::F32, &Self::F32, &mut Self::F32),
        w: &Self::F32,
        (rows, d, eps): (usize, usize, f32),
        (y, yb, rstd): (Option<&mut Self::F32>, &mut Self::Bf16, &mut Self::F32),
        (lw, n, out): (&Self::Bf16, usize, &mut Self::F32),
    ) -> DResult<()> {
        add_rmsnorm_then_linear(
            self,
            (o, res, x),
            w,
            (rows, d, eps),
            (y, yb, rstd),
            (lw, n, out),
        )
    }
    /// Per-expert linear over expert-major packed rows: for every expert `e`, rows
    /// `offsets[e]..offsets[e+1]` of `x: [R, k]` times `W[e]: [n, k]` (stacked `[E, n, k]`)
    /// into the same rows of `y: [R, n]`. `host_offsets`: the same offsets when the caller
    /// has them on the host (they must equal `offsets`): a GPU backend may then split the
    /// work per expert without reading `offsets` back.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn grouped_linear(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()>;
    /// Causal GQA attention inside packed sequences (reference [`attention_forward`]):
    /// `q: [N, Hq·D]`, `k, v: [N, Hkv·D]` → `out: [N, Hq·D]`, `lse: [N, Hq]`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn attention(
        &self,
        q: &Self::F32,
        k: &Self::F32,
        v: &Self::F32,
        layout: &SeqLayout,
        offsets: &Self::U32,
        shape: AttnShape,
        out: &mut Self::F32,
        lse: &mut Self::F32,
    ) -> DResult<()>;
    /// Writes rows `k, v: [B, Hkv·D]` into the BF16 caches `[slots, max_len, Hkv·D]` at
    /// position `lens[b] − 1` of slot `b`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn kv_append(
        &self,
        k: &Self::F32,
        v: &Self::F32,
        lens: &Self::U32,
        batch: usize,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()>;
    /// Writes the rows of packed sequences (prefill) into the caches: sequence `b`'s rows
    /// `layout.offset(b)..` at positions `0..len(b)` of slot `b`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn kv_fill(
        &self,
        k: &Self::F32,
        v: &Self::F32,
        layout: &SeqLayout,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()>;
    /// Decode attention: `q: [batch, Hq·D]` against slot `b`'s first `lens[b]` cached rows
    /// (reference [`attention_decode`] on the BF16 cache values) → `out: [batch, Hq·D]`.
    /// The lengths are read where they live (on the device), so recorded work replays at
    /// any length.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn attention_decode(
        &self,
        q: &Self::F32,
        k_cache: &Self::Bf16,
        v_cache: &Self::Bf16,
        lens: &Self::U32,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
        out: &mut Self::F32,
    ) -> DResult<()>;
    /// [`Backend::attention_decode`]'s output as its [`Backend::to_bf16`] rounding alone
    /// (`out: [batch, Hq·D]`), bitwise; one op where the device writes it directly (the
    /// default composes the two).
    ///
    /// # Errors
    /// Short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode_bf16(
        &self,
        q: &Self::F32,
        k_cache: &Self::Bf16,
        v_cache: &Self::Bf16,
        lens: &Self::U32,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
        out: &mut Self::Bf16,
    ) -> DResult<()> {
        let n = batch * shape.q_heads * shape.head_dim;
        let mut y = self.empty_f32(n)?;
        self.attention_decode(q, k_cache, v_cache, lens, batch, max_len, shape, &mut y)?;
        self.to_bf16(&y, out, n)
    }
    /// A decode step's attention inputs in one op: with `norms` (`[w_q, w_k]`, the per-head
    /// q/k RMSNorm weights of width `head_dim`) each head of `q [rows, q_heads·D]` and
    /// `k [rows, kv_heads·D]` is normalized in place ([`Backend::rmsnorm`] over rows of `D`),
    /// then RoPE rotates both at `pos` ([`Backend::rope`]), then `k` and `v` are appended to
    /// the caches ([`Backend::kv_append`]). The default runs exactly those ops; a backend that
    /// fuses them must give the same bits.
    ///
    /// # Errors
    /// As the ops it stands for.
    #[allow(clippy::too_many_arguments)]
    fn decode_attn_prep(
        &self,
        q: &mut Self::F32,
        k: &mut Self::F32,
        v: &Self::F32,
        norms: Option<[&Self::F32; 2]>,
        eps: f32,
        rows: usize,
        shape: AttnShape,
        pos: &Self::U32,
        table: &Self::Rope,
        lens: &Self::U32,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()> {
        decode_attn_prep_ops(
            self, q, k, v, norms, eps, rows, shape, pos, table, lens, max_len, k_cache, v_cache,
        )
    }
    /// A decode step's attention with the preparation of its inputs, as one op:
    /// [`Backend::decode_attn_prep`], then [`Backend::attention_decode`] into `out`
    /// ([`DecodeAttnOut::F32`]) or [`Backend::attention_decode_bf16`] ([`DecodeAttnOut::Bf16`]).
    /// The default runs exactly those ops; a backend that fuses them gives the same bits (the
    /// caches and the output). `q` and `k` hold unspecified values afterwards.
    ///
    /// # Errors
    /// As the ops it stands for.
    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        &self,
        q: &mut Self::F32,
        k: &mut Self::F32,
        v: &Self::F32,
        norms: Option<[&Self::F32; 2]>,
        eps: f32,
        rows: usize,
        shape: AttnShape,
        pos: &Self::U32,
        table: &Self::Rope,
        lens: &Self::U32,
        max_len: usize,
        (k_cache, v_cache): (&mut Self::Bf16, &mut Self::Bf16),
        out: DecodeAttnOut<'_, Self>,
    ) -> DResult<()> {
        decode_attention_ops(
            self,
            q,
            k,
            v,
            norms,
            eps,
            rows,
            shape,
            pos,
            table,
            lens,
            max_len,
            (k_cache, v_cache),
            out,
        )
    }
    /// Router forward + dispatch (reference [`router_forward`], [`Dispatch::new`]):
    /// `logits: [N, E]` → routes, probabilities and the expert-major dispatch. With `replay`
    /// (expert ids `[N, k]`, slot order) those experts are used instead of the top-k and the
    /// combine weights are recomputed from the current probabilities (reference
    /// `RouteMode::ReplayIds`), so the router still receives gradients.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn route(
        &self,
        logits: &Self::F32,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        replay: Option<&Self::U32>,
        out: &mut RouteBufs<Self>,
    ) -> DResult<()>;
    /// Copies every row's routes (`ids`, `weights`: `[rows, k]`) into capture tables
    /// `[max_len, S, k]` (position-major, so the first positions of every sequence are one
    /// prefix of the table): row `r` goes to sequence `s = seq[r]` (`r` itself when `seq` is
    /// `None`) at position `p = pos[r]`, table row `p·slots + s`; rows whose sequence is
    /// `≥ slots` or position `≥ max_len` are skipped.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn capture_routes(
        &self,
        ids: &Self::U32,
        weights: &Self::F32,
        rows: usize,
        k: usize,
        seq: Option<&Self::U32>,
        pos: &Self::U32,
        slots: usize,
        max_len: usize,
        dst_ids: &mut Self::U32,
        dst_weights: &mut Self::F32,
    ) -> DResult<()>;
    /// Copies rows of `x: [rows, w]` into a table `[len, slots, w]` (the per-layer probes a
    /// generation records; index-major, so the first `i` indices of every slot are one prefix
    /// of the table): row `r` goes to slot `s = seq[r]` (`r` itself when `seq` is `None`) at
    /// index `i = pos[r] − first[s]`, i.e. table row `i·slots + s`; rows whose slot is
    /// `≥ slots`, or whose position is outside `first[s] .. first[s] + len`, are skipped. A
    /// plain copy (bitwise); reads positions on the device, so a recorded decode step replays
    /// it at every length.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn capture_rows(
        &self,
        x: &Self::F32,
        rows: usize,
        w: usize,
        seq: Option<&Self::U32>,
        pos: &Self::U32,
        first: &Self::U32,
        slots: usize,
        len: usize,
        dst: &mut Self::F32,
    ) -> DResult<()>;
    /// Gathers `x: [N, h]` rows into expert-major packed BF16 rows `[N·k, h]` per `perm`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn gather_bf16(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()>;
    /// SwiGLU on the fused gate/up output `gu: [rows, 2F]` → BF16 activation `[rows, F]`
    /// (reference `activation::swiglu_forward`, then BF16 rounding for the next GEMM).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn swiglu_bf16(
        &self,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()>;
    /// A routed MoE's gate/up projection and SwiGLU without a tape (decode): the BF16 token
    /// rows `xb: [N, h]` gathered into expert-major rows ([`Backend::gather_rows_bf16`]), times
    /// the stacked BF16 gate/up weights `w: [E, 2F, h]` ([`Backend::grouped_linear`]), then
    /// [`Backend::swiglu_bf16`] into `act: [N·k, F]`. The default composes the three; a device
    /// may fuse them (no gathered rows, no f32 `[N·k, 2F]`), with the same products and each
    /// gate/up sum in an order of its own (the CUDA kernel sums as its small-M grouped GEMM
    /// does, while its `grouped_linear` may take the fragment kernels): the same bits for the
    /// same shapes on one device, bounded differences against the composition.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn moe_gate_up_swiglu_bf16(
        &self,
        xb: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        f: usize,
        w: &Self::Bf16,
        act: &mut Self::Bf16,
    ) -> DResult<()> {
        gather_gate_up_swiglu_bf16(self, xb, route, n, e, top_k, h, f, w, act)
    }
    /// A routed MoE's down projection and combine without a tape (decode): the BF16 activation
    /// rows `act: [N·k, F]` (expert-major, as routed) times the stacked BF16 down weights `w:
    /// [E, h, F]` ([`Backend::grouped_linear`]), then [`Backend::combine_add`] with
    /// `residual: [N, h]` into `out: [N, h]`. The default composes the two; a device may fuse
    /// them (no f32 `[N·k, h]`), with the same products, the combine's order, and each down
    /// projection sum in an order of its own (as `moe_gate_up_swiglu_bf16`).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn moe_down_combine_bf16(
        &self,
        act: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        f: usize,
        h: usize,
        w: &Self::Bf16,
        residual: &Self::F32,
        out: &mut Self::F32,
    ) -> DResult<()> {
        grouped_down_then_combine_add(self, act, route, n, e, top_k, f, h, w, residual, out)
    }
    /// Combine (reference [`combine_forward`] called for experts in order): `out[t] +=
    /// Σ w[t, s]·y[row(t, s)]` over expert-major rows `y: [N·k, h]`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn combine(
        &self,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()>;
    /// Per-token logprobs of `targets` under `softmax(h·Wᵀ/τ)` without materialising
    /// `[N, V]` (reference: `lm_head` then [`logprobs_forward`]): `h: [N, H]` BF16,
    /// `W: [V, H]` BF16 → `logprob: [N]`, `lse: [N]`, and the entropy of each row's
    /// distribution `entropy: [N]` (reference [`crate::loss::entropy_forward`]).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn head_logprobs(
        &self,
        h: &Self::Bf16,
        w: &Self::Bf16,
        targets: &Self::U32,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        logprob: &mut Self::F32,
        lse: &mut Self::F32,
        entropy: &mut Self::F32,
    ) -> DResult<()>;

    // ---- backward and optimizer ----

    /// RMSNorm backward (reference `norm::rmsnorm_backward`): `dx` overwritten, `dw` += .
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn rmsnorm_backward(
        &self,
        dy: &Self::F32,
        x: &Self::F32,
        w: &Self::F32,
        rstd: &Self::F32,
        rows: usize,
        d: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
    ) -> DResult<()>;
    /// Backward of [`Backend::linear`] with BF16 operands: `dW[n, k] += bf16(dy)ᵀ·x` (f32),
    /// then `dx[m, k] = bf16(dy)·W` (overwritten) when `dx` is given — the CPU model's order.
    /// `dy: [m, n]` f32.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn linear_backward(
        &self,
        dy: &Self::F32,
        x: &Self::Bf16,
        w: &Self::Bf16,
        m: usize,
        k: usize,
        n: usize,
        dx: Option<&mut Self::F32>,
        dw: &mut Self::F32,
    ) -> DResult<()>;
    /// Backward of [`Backend::grouped_linear`]: per expert, `dW[e] += bf16(dy_e)ᵀ·x_e` and
    /// `dx_e = bf16(dy_e)·W[e]` over the expert's packed rows (`host_offsets` as in
    /// [`Backend::grouped_linear`]). `dw_write` [`GradWrite::Overwrite`]: `dW` (all `E·n·k`
    /// values) is written as if it had been zeroed first, without being read.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn grouped_linear_backward(
        &self,
        dy: &Self::F32,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()>;
    /// SwiGLU backward (reference `activation::swiglu_backward`): `dact: [rows, F]`, the
    /// forward's `gu: [rows, 2F]` → `dgu` (overwritten).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn swiglu_backward(
        &self,
        dact: &Self::F32,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        dgu: &mut Self::F32,
    ) -> DResult<()>;
    /// Combine backward (reference `moe::combine_backward` for experts in order, into zeroed
    /// `dweights`): `dy[row] = w·dout[token]` and `dweights[token, slot] = 0 + dout[token]·y[row]`,
    /// both overwritten (`[N·k, h]` and `[N, k]`; their contents on entry are not read).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn combine_backward(
        &self,
        dout: &Self::F32,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        dy: &mut Self::F32,
        dweights: &mut Self::F32,
    ) -> DResult<()>;
    /// [`Backend::swiglu_backward`] writing `dgu` as its BF16 rounding only: the bits of the
    /// f32 op followed by [`Backend::to_bf16`] (a GEMM operand that needs nothing else).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn swiglu_backward_bf16(
        &self,
        dact: &Self::F32,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        dgu: &mut Self::Bf16,
    ) -> DResult<()> {
        let mut t = self.empty_f32(rows * 2 * f)?;
        self.swiglu_backward(dact, gu, rows, f, &mut t)?;
        self.to_bf16(&t, dgu, rows * 2 * f)
    }
    /// [`Backend::combine_backward`] writing `dy` as its BF16 rounding only (the bits of the
    /// f32 op followed by [`Backend::to_bf16`]; the same `dweights`).
    ///
    /// # Errors
    /// Short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn combine_backward_bf16(
        &self,
        dout: &Self::F32,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        dy: &mut Self::Bf16,
        dweights: &mut Self::F32,
    ) -> DResult<()> {
        let mut t = self.zeros_f32(n * k * h)?;
        self.combine_backward(dout, y, route, n, e, k, h, &mut t, dweights)?;
        self.to_bf16(&t, dy, n * k * h)
    }
    /// [`Backend::grouped_linear_backward`] from `dy` already rounded to BF16 (`dyb`, e.g.
    /// from [`Backend::combine_backward_bf16`]): the same results as from any f32 `dy` whose
    /// rounding is `dyb`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn grouped_linear_backward_bf16(
        &self,
        dyb: &Self::Bf16,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()> {
        let mut t = self.empty_f32(rows * n)?;
        self.widen_bf16(dyb, &mut t, rows * n)?;
        self.grouped_linear_backward(
            &t,
            x,
            w,
            offsets,
            host_offsets,
            experts,
            rows,
            k,
            n,
            dx,
            dw,
            dw_write,
        )
    }
    /// Gather backward (reference `moe::gather_backward` for experts in order): `dx[token] +=
    /// dg[row]` over the packed rows `dg: [N·k, h]`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn gather_backward(
        &self,
        dg: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        dx: &mut Self::F32,
    ) -> DResult<()>;
    /// Router backward (reference `routing::router_backward`): `dweights: [N, k]` →
    /// `dlogits: [N, E]` (overwritten); `extra: [E]`, when given, is added to every token's
    /// `∂L/∂probs` first (the auxiliary loss's gradient, [`Backend::aux_loss_grad`]; the
    /// reference's `[N, E]` with `extra` in every row).
    ///
    /// # Errors
    /// Short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn router_backward(
        &self,
        dweights: &Self::F32,
        route: &RouteBufs<Self>,
        extra: Option<&Self::F32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        dlogits: &mut Self::F32,
    ) -> DResult<()>;
    /// The auxiliary load-balancing loss over the MoE layers of one forward (reference
    /// [`crate::routing::load_balancing_loss`]) from each layer's routes ([`Backend::route`]:
    /// probabilities `[N, E]`, and the `N·k` slots routed to the experts). Writes `grad: [E]` =
    /// `coef · ∂aux/∂probs`, the same for every token and layer (bitwise the reference's row
    /// times `coef`), and `loss: [1]` = `aux` (f64 sums rounded to f32; the order of the
    /// probability sums is the backend's).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn aux_loss_grad(
        &self,
        layers: &[&RouteBufs<Self>],
        n: usize,
        e: usize,
        k: usize,
        coef: f32,
        loss: &mut Self::F32,
        grad: &mut Self::F32,
    ) -> DResult<()>;
    /// Attention backward (reference `attention::attention_backward`): `dq, dk, dv`
    /// overwritten, from the forward's `q, k, v, out, lse`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn attention_backward(
        &self,
        dout: &Self::F32,
        q: &Self::F32,
        k: &Self::F32,
        v: &Self::F32,
        out: &Self::F32,
        lse: &Self::F32,
        layout: &SeqLayout,
        offsets: &Self::U32,
        shape: AttnShape,
        dq: &mut Self::F32,
        dk: &mut Self::F32,
        dv: &mut Self::F32,
    ) -> DResult<()>;
    /// RoPE backward in place (reference `rope::rope_backward`).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn rope_backward(
        &self,
        dx: &mut Self::F32,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &Self::U32,
        table: &Self::Rope,
    ) -> DResult<()>;
    /// Backward of [`Backend::head_logprobs`] from `dlogprob: [N]`: `dh: [N, H]`
    /// (overwritten) and `dW: [V, H]` (+=), BF16 operands `bf16(dlogits)`, `h`, `W`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn head_backward(
        &self,
        h: &Self::Bf16,
        w: &Self::Bf16,
        targets: &Self::U32,
        lse: &Self::F32,
        dlogprob: &Self::F32,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        dh: &mut Self::F32,
        dw: &mut Self::F32,
    ) -> DResult<()>;
    /// Embedding backward: `dtable[tokens[r]] += dx[r]` in row order (`host_tokens`: the same
    /// ids on the host).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn embed_backward(
        &self,
        dx: &Self::F32,
        tokens: &Self::U32,
        host_tokens: &[u32],
        h: usize,
        dtable: &mut Self::F32,
    ) -> DResult<()>;
    /// Sum of squares of the first `n` entries of each buffer, accumulated into the global
    /// gradient norm the way `optim::global_grad_norm` does (f64 on the CPU).
    ///
    /// # Errors
    /// Device failure.
    fn grad_norm(&self, grads: &[(&Self::F32, usize)]) -> DResult<f64>;
    /// Starts a [`Backend::grad_norm`] over buffers of lengths `lens` (in the order the
    /// finishing call lists them) whose buffers are handed in one by one, each as soon as no
    /// later op writes it: a device may sum a buffer's squares while the ops that follow run
    /// (the backward of the layers below it). The result is [`Backend::grad_norm`]'s, bit for
    /// bit.
    ///
    /// # Errors
    /// Device failure.
    fn grad_norm_begin(&self, lens: &[usize]) -> DResult<Self::NormParts>;
    /// Hands in buffers `(i, grad)` of a [`Backend::grad_norm_begin`]: the first `lens[i]`
    /// entries of each are final (no op may write them before
    /// [`Backend::grad_norm_finish`]).
    ///
    /// # Errors
    /// An index out of range or handed in twice, a short buffer; device failure.
    fn grad_norm_add(
        &self,
        parts: &mut Self::NormParts,
        bufs: &[(usize, &Self::F32)],
    ) -> DResult<()>;
    /// The norm of `grads` (the buffers and lengths of the `grad_norm_begin`, in its order),
    /// those not handed in summed now: [`Backend::grad_norm`]`(grads)`, bit for bit.
    ///
    /// # Errors
    /// Lengths other than the `grad_norm_begin`'s; device failure.
    fn grad_norm_finish(
        &self,
        parts: Self::NormParts,
        grads: &[(&Self::F32, usize)],
    ) -> DResult<f64>;
    /// One AdamW step on `param[..n]` (reference `optim::adamw_update`, step `t ≥ 1`) on the
    /// gradient multiplied by `grad_scale` first (`fl(g · s)`, the clipping coefficient, 1 for
    /// none: the same bits as scaling the gradient in place and stepping; the gradient buffer
    /// is left as it was) that also refreshes the BF16 GEMM copy `op` when given.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn adamw(
        &self,
        param: &mut Self::F32,
        grad: &Self::F32,
        m: &mut Self::F32,
        v: &mut Self::F32,
        n: usize,
        step: u64,
        cfg: &crate::optim::AdamWConfig,
        weight_decay: f32,
        grad_scale: f32,
        op: Option<&mut Self::Bf16>,
    ) -> DResult<()>;
    /// One AdamW step of a block-format linear's master (as [`Backend::adamw`] on
    /// `param[..n]`, `n = stored.groups · stored.n · stored.k`) followed by its stored weights:
    /// the new master quantized for `stored.spec` (as [`Backend::quantize_weights`]). The
    /// default runs those two; a device may do both in one pass over the master (the same
    /// bits and bytes).
    ///
    /// # Errors
    /// As [`Backend::adamw`] and [`Backend::quantize_weights`].
    fn adamw_requantize(
        &self,
        param: &mut Self::F32,
        grad: &Self::F32,
        m: &mut Self::F32,
        v: &mut Self::F32,
        update: &AdamWUpdate<'_>,
        op: Option<&mut Self::Bf16>,
        stored: &StoredLayout<'_>,
    ) -> DResult<Self::QExperts> {
        adamw_then_quantize(self, param, grad, m, v, update, op, stored)
    }
    /// Bias gradient: `db[j] += Σ_r dy[r, j]` over `rows` rows in row order.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn bias_backward(
        &self,
        dy: &Self::F32,
        rows: usize,
        n: usize,
        db: &mut Self::F32,
    ) -> DResult<()>;
    /// Sets the first `n` entries to zero.
    ///
    /// # Errors
    /// Device failure.
    fn fill_zero(&self, x: &mut Self::F32, n: usize) -> DResult<()>;

    /// `out = bf16(rmsnorm(x))` with `rstd`: [`Backend::rmsnorm`] then [`Backend::to_bf16`],
    /// bitwise, in one pass where the device has the fused kernel (the default composes the
    /// two).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn rmsnorm_bf16(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        out: &mut Self::Bf16,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        let mut y = self.empty_f32(rows * d)?;
        self.rmsnorm(x, w, rows, d, eps, &mut y, rstd)?;
        self.to_bf16(&y, out, rows * d)
    }
    /// [`Backend::rmsnorm`] into `y` and its [`Backend::to_bf16`] rounding into `yb`, bitwise,
    /// in one pass where the device has the fused kernel (the default composes the two).
    ///
    /// # Errors
    /// Short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_both(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: &mut Self::F32,
        yb: &mut Self::Bf16,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        self.rmsnorm(x, w, rows, d, eps, y, rstd)?;
        self.to_bf16(y, yb, rows * d)
    }
    /// The residual sum `x += res` ([`Backend::add`], `x, res: [rows, d]`) and the RMSNorm of
    /// the new rows into `y` ([`Backend::rmsnorm`]), `yb` ([`Backend::rmsnorm_bf16`]) or both
    /// ([`Backend::rmsnorm_both`]), bitwise, in one pass where the device has the fused kernel
    /// (the default composes them).
    ///
    /// # Errors
    /// Neither output; short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn add_rmsnorm(
        &self,
        x: &mut Self::F32,
        res: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: Option<&mut Self::F32>,
        yb: Option<&mut Self::Bf16>,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        self.add(x, res, rows * d)?;
        self.rmsnorm_into(x, w, rows, d, eps, y, yb, rstd)
    }
    /// The RMSNorm of `x` into `y` ([`Backend::rmsnorm`]), `yb` ([`Backend::rmsnorm_bf16`])
    /// or both ([`Backend::rmsnorm_both`]), whichever are given.
    ///
    /// # Errors
    /// Neither output; short buffers; device failure.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_into(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: Option<&mut Self::F32>,
        yb: Option<&mut Self::Bf16>,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        match (y, yb) {
            (Some(y), Some(yb)) => self.rmsnorm_both(x, w, rows, d, eps, y, yb, rstd),
            (None, Some(yb)) => self.rmsnorm_bf16(x, w, rows, d, eps, yb, rstd),
            (Some(y), None) => self.rmsnorm(x, w, rows, d, eps, y, rstd),
            (None, None) => Err(DeviceError::new(
                self.device().to_string(),
                "rmsnorm: neither an f32 nor a BF16 output",
            )),
        }
    }
    /// [`Backend::gather_bf16`] from rows already in BF16 (`xb: [N, h]`): the same values,
    /// without a second rounding.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn gather_rows_bf16(
        &self,
        xb: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()>;
    /// `out = combine(y) + residual`: [`Backend::combine`] into zeros, then
    /// [`Backend::add`] of `residual: [N, h]`, bitwise, in one pass where the device has the
    /// fused kernel (the default composes the three).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn combine_add(
        &self,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        residual: &Self::F32,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.fill_zero(out, n * h)?;
        self.combine(y, route, n, e, k, h, out)?;
        self.add(out, residual, n * h)
    }

    /// Keeps the stored (quantized) weights of one projection's experts (`[n, k]` each, one
    /// linear spec, expert order): the CPU keeps them as they are, a device uploads the stored
    /// bytes and scales.
    ///
    /// # Errors
    /// Weights without stored bytes (BF16), mixed specs or shapes; out of memory.
    fn upload_experts(&self, experts: Vec<PreparedWeight>) -> DResult<Self::QExperts>;
    /// Quantized grouped linear over expert-major rows (`x: [rows, k]` f32; the rows of expert
    /// `e` are `offsets[e]..offsets[e+1]`) → `y: [rows, n]`: for every expert,
    /// [`PreparedWeight::forward_inference`] on its rows — bitwise on the CPU; a device
    /// quantizes the activations to the same bytes and multiplies the same exact products,
    /// summed in another order.
    ///
    /// # Errors
    /// Short buffers, shapes that disagree with the weights; device failure.
    fn grouped_qlinear(
        &self,
        x: &Self::F32,
        w: &Self::QExperts,
        offsets: &Self::U32,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()>;
    /// [`Backend::grouped_qlinear`] of the rows [`Backend::gather_f32`] makes of the token rows
    /// `x: [tokens, k]` (expert-major, `tokens · top_k` of them; `route.offsets` the experts'
    /// ranges), for a forward that keeps no gathered rows (decode). Every block format
    /// quantizes each row alone, so a device may quantize the token rows once and gather their
    /// operands: the same operands. The default gathers, then calls `grouped_qlinear`.
    ///
    /// # Errors
    /// As [`Backend::grouped_qlinear`].
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_gathered(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        tokens: usize,
        top_k: usize,
        w: &Self::QExperts,
        experts: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        let rows = tokens * top_k;
        let mut xg = self.empty_f32(rows * k)?;
        self.gather_f32(x, route, tokens, experts, top_k, k, &mut xg)?;
        self.grouped_qlinear(&xg, w, &route.offsets, experts, rows, k, n, y)
    }
    /// [`Backend::grouped_qlinear`] of the SwiGLU of a fused gate/up output `gu: [rows, 2f]`
    /// (the rows [`Backend::swiglu_f32`] writes, `k = f`), for a forward that keeps no
    /// activation (decode). Every block format quantizes each row alone, so a device may
    /// compute SwiGLU inside its activation quantizer: the same operands. The default is
    /// [`swiglu_then_grouped_qlinear`].
    ///
    /// # Errors
    /// As [`Backend::grouped_qlinear`].
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_swiglu(
        &self,
        gu: &Self::F32,
        w: &Self::QExperts,
        offsets: &Self::U32,
        experts: usize,
        rows: usize,
        f: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        swiglu_then_grouped_qlinear(self, gu, w, offsets, experts, rows, f, n, y)
    }
    /// Whether a taped forward of routed experts stored for `spec`, with inputs of `k`
    /// columns, may keep the activation operand its backward's wgrad multiplies, made by the
    /// forward's quantizer from the same read of the rows
    /// ([`Backend::grouped_qlinear_gathered_kept`], [`Backend::grouped_qlinear_swiglu_kept`]),
    /// and hand it to [`Backend::grouped_qlinear_backward`] as [`SavedX::Operand`] instead of
    /// the f32 rows that backward would quantize again (the same bytes). The default: never.
    fn keeps_forward_operand(&self, _spec: &LinearSpec, _k: usize) -> bool {
        false
    }
    /// [`Backend::grouped_qlinear_gathered`], returning the activation operand the backward's
    /// wgrad multiplies (`[rows, k]`, or its parts: [`SavedX::Operand`]; `host_offsets`: the
    /// experts' row offsets), for weights whose spec [`Backend::keeps_forward_operand`] takes.
    ///
    /// # Errors
    /// As [`Backend::grouped_qlinear_gathered`]; a spec the backend keeps no operand of (the
    /// default: every spec).
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_gathered_kept(
        &self,
        _x: &Self::F32,
        _route: &RouteBufs<Self>,
        _host_offsets: &[u32],
        _tokens: usize,
        _top_k: usize,
        _w: &Self::QExperts,
        _experts: usize,
        _k: usize,
        _n: usize,
        _y: &mut Self::F32,
    ) -> DResult<Self::Bf16> {
        Err(DeviceError::new(
            "backend",
            "grouped_qlinear_gathered_kept: this backend keeps no forward operand",
        ))
    }
    /// [`Backend::grouped_qlinear_swiglu`], returning the activation operand the backward's
    /// wgrad multiplies (`[rows, f]`, or its parts: [`SavedX::Operand`]; `host_offsets`: the
    /// experts' row offsets), for weights whose spec [`Backend::keeps_forward_operand`] takes.
    ///
    /// # Errors
    /// As [`Backend::grouped_qlinear_gathered_kept`].
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_swiglu_kept(
        &self,
        _gu: &Self::F32,
        _w: &Self::QExperts,
        _offsets: &Self::U32,
        _host_offsets: &[u32],
        _experts: usize,
        _rows: usize,
        _f: usize,
        _n: usize,
        _y: &mut Self::F32,
    ) -> DResult<Self::Bf16> {
        Err(DeviceError::new(
            "backend",
            "grouped_qlinear_swiglu_kept: this backend keeps no forward operand",
        ))
    }
    /// The activation operand (`[rows, k]`, or its parts: [`SavedX::Operand`]) that
    /// [`Backend::grouped_qlinear_backward`]'s wgrad multiplies for a weight stored for
    /// `spec`, made from the f32 rows `x` as that backward would make it (`host_offsets`: the
    /// groups' row offsets; `[0, rows]` for a dense linear), for specs
    /// [`Backend::keeps_forward_operand`] takes: several linears of one input (q, k and v)
    /// then hand the same operand to each backward as [`SavedX::Operand`] instead of
    /// quantizing the rows once per linear (the same bytes).
    ///
    /// # Errors
    /// A spec the backend keeps no operand of (the default: every spec); short buffers;
    /// device failure.
    fn qlinear_backward_operand(
        &self,
        _x: &Self::F32,
        _spec: &LinearSpec,
        _host_offsets: &[u32],
        _rows: usize,
        _k: usize,
    ) -> DResult<Self::Bf16> {
        Err(DeviceError::new(
            "backend",
            "qlinear_backward_operand: this backend keeps no forward operand",
        ))
    }
    /// Gathers `x: [N, h]` rows into expert-major packed f32 rows `[N·k, h]` per `perm`.
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn gather_f32(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()>;
    /// SwiGLU with an f32 output (the input of a quantized linear): `gu: [rows, 2F]` →
    /// `out: [rows, F]` (reference [`crate::activation::swiglu_forward`]).
    ///
    /// # Errors
    /// Short buffers; device failure.
    fn swiglu_f32(&self, gu: &Self::F32, rows: usize, f: usize, out: &mut Self::F32)
        -> DResult<()>;

    /// Quantizes `groups` weights `[n, k]` stored back to back in `master` (routed experts
    /// stacked `[groups·n, k]`, or one dense linear) for `spec`, each exactly as
    /// [`PreparedWeight::quantize`] does (`name(g)` names weight `g` in errors), and keeps
    /// them as [`Backend::upload_experts`] does. The default copies the masters to the host
    /// and quantizes there with the contract library; a device may quantize in place (the
    /// same bytes).
    ///
    /// # Errors
    /// A BF16 spec, K not a multiple of the format's block, out of memory, device failure.
    #[allow(clippy::too_many_arguments)]
    fn quantize_weights(
        &self,
        master: &Self::F32,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
        name: &(dyn Fn(usize) -> String + Sync),
        version: u64,
    ) -> DResult<Self::QExperts> {
        if spec.weight_scheme().is_none() {
            return Err(DeviceError::new(
                self.device().to_string(),
                format!(
                    "quantize_weights: {} has no block format ({spec:?})",
                    name(0)
                ),
            ));
        }
        let all = self.download_f32(master, groups * n * k)?;
        let dev = self.device().to_string();
        let pws = all
            .par_chunks(n * k)
            .enumerate()
            .map(|(g, w)| {
                PreparedWeight::quantize(&name(g), w, n, k, spec, version)
                    .map_err(|e| DeviceError::new(dev.clone(), e.to_string()))
            })
            .collect::<DResult<Vec<_>>>()?;
        self.upload_experts(pws)
    }
    /// A device copy of stored weights (the same bytes in new buffers).
    ///
    /// # Errors
    /// Out of memory; device failure.
    fn copy_qweights(&self, w: &Self::QExperts) -> DResult<Self::QExperts>;
    /// The stored weights of one projection (`weights`: `[n, k]` each, stored for `spec`, in
    /// order) from the bytes a weight update carries, kept as [`Backend::upload_experts`]
    /// keeps them; every weight is checked first ([`StoredBytes::check`]), naming it. The
    /// default (the CPU) builds each weight's [`PreparedWeight::from_quantized`] and uploads
    /// them; a device copies the bytes straight into its buffers (the same bytes).
    ///
    /// # Errors
    /// A BF16 spec, no weights, a weight whose byte counts do not fit `[n, k]` under the
    /// spec's scheme (named); out of memory; device failure.
    fn upload_stored(
        &self,
        spec: LinearSpec,
        n: usize,
        k: usize,
        weights: &[StoredBytes<'_>],
    ) -> DResult<Self::QExperts> {
        let dev = self.device().to_string();
        let scheme = stored_scheme(&dev, spec, weights)?;
        let pws = weights
            .par_iter()
            .map(|w| {
                let q = w
                    .to_quantized(scheme, &[n, k])
                    .map_err(|e| DeviceError::new(dev.clone(), e))?;
                PreparedWeight::from_quantized(w.name, q, spec, 0, None)
                    .map_err(|e| DeviceError::new(dev.clone(), e.to_string()))
            })
            .collect::<DResult<Vec<_>>>()?;
        self.upload_experts(pws)
    }
    /// Adds [`checksum_stored`] of `w`'s stored weights to the u64 in `out[2·slot]` (as
    /// [`Backend::checksum_bf16`]); the caller zeroes it first.
    ///
    /// # Errors
    /// Short buffer; device failure.
    fn checksum_qweights(
        &self,
        w: &Self::QExperts,
        out: &mut Self::U32,
        slot: usize,
    ) -> DResult<()>;
    /// The stored quantized tensors of `w`, one per weight (what
    /// [`Backend::upload_experts`] or [`Backend::quantize_weights`] kept), copied to the host.
    ///
    /// # Errors
    /// Device failure.
    fn stored_weights(&self, w: &Self::QExperts) -> DResult<Vec<mxrl_formats::QuantizedTensor>>;
    /// A dense quantized linear (`w` holds one weight `[n, k]`): `y [rows, n] = x [rows, k] ·
    /// Wᵀ`, reference [`PreparedWeight::forward_inference`] (bitwise on the CPU; a device
    /// multiplies the same exact products, summed in another order).
    ///
    /// # Errors
    /// Short buffers, shapes that disagree with the weight; device failure.
    #[allow(clippy::too_many_arguments)]
    fn qlinear(
        &self,
        x: &Self::F32,
        w: &Self::QExperts,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()>;
    /// [`Backend::qlinear`] of one input `x: [rows, k]` by several block-format weights
    /// (`outs[i] = (w, n, y)`: `y [rows, n] = x · wᵀ`), as q, k and v of attention are: a
    /// device may quantize `x` once for weights that quantize their input alike (the same
    /// bytes each time). The default calls `qlinear` for each.
    ///
    /// # Errors
    /// As [`Backend::qlinear`].
    #[allow(clippy::type_complexity)]
    fn qlinear_shared(
        &self,
        x: &Self::F32,
        rows: usize,
        k: usize,
        outs: &mut [(&Self::QExperts, usize, &mut Self::F32)],
    ) -> DResult<()> {
        for (w, n, y) in outs.iter_mut() {
            self.qlinear(x, w, rows, k, *n, y)?;
        }
        Ok(())
    }
    /// Backward of a quantized (grouped) linear over expert-major rows (`host_offsets`: the
    /// `[groups + 1]` row offsets, and `offsets` the same on the device when the caller has
    /// them — `None` for a dense linear or to let the backend upload them; one group for a
    /// dense linear): for every group with rows,
    /// the context [`PreparedWeight::forward`] builds from its f32 input rows `x` (the same
    /// bytes the forward quantized), then [`PreparedWeight::backward_accumulate`] with `dy`:
    /// writes those rows of `dx [rows, k]` and **accumulates** `dW` into the group's part of
    /// `dw [groups·n, k]`. `master` holds the f32 weights `w` was quantized from (the
    /// high-precision operand of the `HighPrecision` and `Lowp` modes); `master_bf16`, where
    /// the caller keeps one, is `bf16(master)` (round to nearest even: the BF16 copy the
    /// optimizer step writes with the master), which a device may multiply instead of
    /// rounding `master` again (the same operand). `dy` may come rounded to BF16 already
    /// ([`OutGrad::Bf16`]) where the mode multiplies only `bf16(dy)`
    /// ([`LinearSpec::rounds_dy_to_bf16`]; an error otherwise), and `x` likewise where it
    /// multiplies only `bf16(x)` ([`LinearSpec::rounds_x_to_bf16`]). Bitwise the CPU model's
    /// on the CPU; a device multiplies the same operands, summed in another order.
    /// `dw_write` [`GradWrite::Overwrite`]: `dw` (all `groups·n·k` values) is written as if it
    /// had been zeroed first.
    ///
    /// # Errors
    /// Short buffers, bad offsets, a weight without what its backward mode needs; device
    /// failure.
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_backward(
        &self,
        x: SavedX<'_, Self::F32, Self::Bf16>,
        w: &Self::QExperts,
        master: &Self::F32,
        master_bf16: Option<&Self::Bf16>,
        dy: OutGrad<'_, Self::F32, Self::Bf16>,
        offsets: Option<&Self::U32>,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()>;

    /// Buffers for outputs an op overwrites whole: their contents before the op are
    /// unspecified (a device may skip the zero fill). The default zero-fills.
    ///
    /// # Errors
    /// Out of memory.
    fn empty_f32(&self, n: usize) -> DResult<Self::F32> {
        self.zeros_f32(n)
    }
    /// See [`Backend::empty_f32`].
    ///
    /// # Errors
    /// Out of memory.
    fn empty_bf16(&self, n: usize) -> DResult<Self::Bf16> {
        self.zeros_bf16(n)
    }
    /// See [`Backend::empty_f32`].
    ///
    /// # Errors
    /// Out of memory.
    fn empty_u32(&self, n: usize) -> DResult<Self::U32> {
        self.zeros_u32(n)
    }
    /// A zero-filled u32 buffer (no host copy).
    ///
    /// # Errors
    /// Out of memory.
    fn zeros_u32(&self, n: usize) -> DResult<Self::U32>;
    /// Host → device copy into the first `v.len()` elements of an existing buffer.
    ///
    /// # Errors
    /// A short buffer; device failure.
    fn write_u32(&self, dst: &mut Self::U32, v: &[u32]) -> DResult<()>;

    /// One token per row of `logits: [rows, v]` into `tokens[rows]` with its logprob in
    /// `logprobs[rows]`: bitwise the semantics of [`crate::sample::sample_rows`] (row `r`
    /// draws `uniform(p.seed, p.step, r)`).
    ///
    /// # Errors
    /// Invalid parameters ([`SampleParams::validate`]), short buffers, device failure.
    fn sample(
        &self,
        logits: &Self::F32,
        rows: usize,
        v: usize,
        p: &SampleParams,
        tokens: &mut Self::U32,
        logprobs: &mut Self::F32,
    ) -> DResult<()>;

    /// Starts recording the ops that follow into a graph instead of running them; `false`
    /// (and nothing recorded) where the backend has no graphs, as the CPU.
    ///
    /// # Errors
    /// Device failure.
    fn begin_capture(&self) -> DResult<bool> {
        Ok(false)
    }
    /// Ends a recording begun by [`Backend::begin_capture`]: the graph (none of its work has
    /// run yet), or `None` when nothing was recorded. Also called to abandon a recording after
    /// an op failed inside it.
    ///
    /// # Errors
    /// An op that cannot be recorded was issued during the capture; instantiation failure.
    fn end_capture(&self) -> DResult<Option<Self::Graph>>;
    /// Runs a recorded graph (on the same buffers it was recorded with).
    ///
    /// # Errors
    /// Device failure.
    fn launch_graph(&self, g: &Self::Graph) -> DResult<()>;
}

/// One stored block-format weight as a weight update carries it ([`Backend::upload_stored`]):
/// element codes, block scales (FP8 block: its f32 `scale_inv` as little-endian bytes) and the
/// NVFP4 amax, compact scale layout, unpadded.
#[derive(Debug, Clone, Copy)]
pub struct StoredBytes<'a> {
    /// The weight's name (for errors).
    pub name: &'a str,
    /// Element codes.
    pub data: &'a [u8],
    /// Block scales as bytes.
    pub scales: &'a [u8],
    /// Second-level f32 scales (NVFP4), empty otherwise.
    pub amax: &'a [f32],
}

impl StoredBytes<'_> {
    /// Whether the byte counts are those of an unpadded `shape` tensor of `scheme` with
    /// compact scales ([`mxrl_formats::QuantizedTensor::compact_lengths`]); the error names
    /// the weight and what differs.
    ///
    /// # Errors
    /// A shape the scheme does not tile, or a count that differs.
    pub fn check(&self, scheme: mxrl_formats::Scheme, shape: &[usize]) -> Result<(), String> {
        let name = self.name;
        let (data, scales, amax) = mxrl_formats::QuantizedTensor::compact_lengths(scheme, shape)
            .map_err(|e| format!("tensor {name}: {e}"))?;
        let scale_bytes = if scheme.format() == mxrl_formats::Format::Fp8Block {
            4 * scales
        } else {
            scales
        };
        if (self.data.len(), self.scales.len(), self.amax.len()) != (data, scale_bytes, amax) {
            return Err(format!(
                "tensor {name}: {} data bytes, {} scale bytes and {} amax for {scheme} {shape:?}, \
                 expected {data}, {scale_bytes} and {amax}",
                self.data.len(),
                self.scales.len(),
                self.amax.len()
            ));
        }
        Ok(())
    }

    /// The stored tensor these bytes are (copied), checked ([`StoredBytes::check`]) and
    /// validated by the contract library; nothing is re-quantized.
    ///
    /// # Errors
    /// As [`StoredBytes::check`], naming the weight.
    pub fn to_quantized(
        &self,
        scheme: mxrl_formats::Scheme,
        shape: &[usize],
    ) -> Result<mxrl_formats::QuantizedTensor, String> {
        use mxrl_formats::{Format, QuantizedTensor, ScaleLayout, Scales};
        self.check(scheme, shape)?;
        let scales = if scheme.format() == Format::Fp8Block {
            Scales::F32(
                self.scales
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )
        } else {
            Scales::Bytes(self.scales.to_vec())
        };
        let q = QuantizedTensor {
            scheme,
            shape: shape.to_vec(),
            padded_shape: shape.to_vec(),
            data: self.data.to_vec(),
            scales,
            scale_layout: ScaleLayout::Compact,
            amax: self.amax.to_vec(),
        };
        q.validate()
            .map_err(|e| format!("tensor {}: {e}", self.name))?;
        Ok(q)
    }
}

/// Where [`Backend::decode_attention`] writes the attention: f32, or its BF16 rounding alone.
pub enum DecodeAttnOut<'a, B: Backend + ?Sized> {
    /// `[rows, Hq·D]` f32.
    F32(&'a mut B::F32),
    /// `[rows, Hq·D]` BF16 (the bits `to_bf16` of the f32 output gives).
    Bf16(&'a mut B::Bf16),
}

/// [`Backend::decode_attention`] as the ops it stands for (the trait's default, and the
/// reference a fused implementation is tested against).
///
/// # Errors
/// As those ops.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_ops<B: Backend + ?Sized>(
    b: &B,
    q: &mut B::F32,
    k: &mut B::F32,
    v: &B::F32,
    norms: Option<[&B::F32; 2]>,
    eps: f32,
    rows: usize,
    shape: AttnShape,
    pos: &B::U32,
    table: &B::Rope,
    lens: &B::U32,
    max_len: usize,
    (k_cache, v_cache): (&mut B::Bf16, &mut B::Bf16),
    out: DecodeAttnOut<'_, B>,
) -> DResult<()> {
    b.decode_attn_prep(
        q, k, v, norms, eps, rows, shape, pos, table, lens, max_len, k_cache, v_cache,
    )?;
    match out {
        DecodeAttnOut::F32(o) => {
            b.attention_decode(q, k_cache, v_cache, lens, rows, max_len, shape, o)
        }
        DecodeAttnOut::Bf16(o) => {
            b.attention_decode_bf16(q, k_cache, v_cache, lens, rows, max_len, shape, o)
        }
    }
}

/// [`Backend::decode_attn_prep`] as the ops it stands for, one after the other (the trait's
/// default, and the reference a fused implementation is tested against).
///
/// # Errors
/// As those ops.
#[allow(clippy::too_many_arguments)]
pub fn decode_attn_prep_ops<B: Backend + ?Sized>(
    b: &B,
    q: &mut B::F32,
    k: &mut B::F32,
    v: &B::F32,
    norms: Option<[&B::F32; 2]>,
    eps: f32,
    rows: usize,
    shape: AttnShape,
    pos: &B::U32,
    table: &B::Rope,
    lens: &B::U32,
    max_len: usize,
    k_cache: &mut B::Bf16,
    v_cache: &mut B::Bf16,
) -> DResult<()> {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    if let Some([wq, wk]) = norms {
        for (x, w, heads) in [(&mut *q, wq, hq), (&mut *k, wk, hkv)] {
            let mut y = b.empty_f32(rows * heads * d)?;
            let mut rstd = b.empty_f32(rows * heads)?;
            b.rmsnorm(x, w, rows * heads, d, eps, &mut y, &mut rstd)?;
            *x = y;
        }
    }
    b.rope(q, rows, hq, d, pos, table)?;
    b.rope(k, rows, hkv, d, pos, table)?;
    b.kv_append(k, v, lens, rows, hkv * d, max_len, k_cache, v_cache)
}

/// Values handed to an op as their producer wrote them: f32, or rounded to BF16 (a backend's
/// BF16 buffer).
pub enum F32OrBf16<'a, F, H> {
    /// f32 values.
    F32(&'a F),
    /// The values rounded to BF16 (round to nearest even).
    Bf16(&'a H),
}

/// The output gradient of a linear ([`Backend::grouped_qlinear_backward`]).
pub type OutGrad<'a, F, H> = F32OrBf16<'a, F, H>;

/// The input rows a linear's backward takes ([`Backend::grouped_qlinear_backward`]).
pub enum SavedX<'a, F, H> {
    /// The f32 rows.
    F32(&'a F),
    /// The rows rounded to BF16, where the backward multiplies only `bf16(x)`
    /// ([`LinearSpec::rounds_x_to_bf16`]).
    Bf16(&'a H),
    /// The activation operand the backward's wgrad multiplies, as the forward's quantizer
    /// wrote it (or [`Backend::qlinear_backward_operand`] made it), from a backend that keeps
    /// it ([`Backend::keeps_forward_operand`]): MXFP8 `dequantized`, the row-wise operand;
    /// `lowp`, the column-wise copy in the groups' 32-row blocks; NVFP4 `dequantized`, the
    /// three BF16 parts `[3, rows, k]` of the rows' contract dequantization.
    Operand(&'a H),
}

/// [`Backend::adamw_requantize`] as two calls: [`Backend::adamw`], then
/// [`Backend::quantize_weights`] of the new master (the trait's default, and a device's way
/// for the formats it does not fuse).
///
/// # Errors
/// As the two calls.
#[allow(clippy::too_many_arguments)]
pub fn adamw_then_quantize<B: Backend + ?Sized>(
    b: &B,
    param: &mut B::F32,
    grad: &B::F32,
    m: &mut B::F32,
    v: &mut B::F32,
    update: &AdamWUpdate<'_>,
    op: Option<&mut B::Bf16>,
    stored: &StoredLayout<'_>,
) -> DResult<B::QExperts> {
    let n = stored.groups * stored.n * stored.k;
    b.adamw(
        param,
        grad,
        m,
        v,
        n,
        update.step,
        update.cfg,
        update.weight_decay,
        update.grad_scale,
        op,
    )?;
    b.quantize_weights(
        param,
        stored.groups,
        stored.n,
        stored.k,
        stored.spec,
        stored.name,
        stored.version,
    )
}

/// One AdamW step's settings for [`Backend::adamw_requantize`] (those of [`Backend::adamw`]).
#[derive(Clone, Copy, Debug)]
pub struct AdamWUpdate<'a> {
    /// Step number, from 1.
    pub step: u64,
    /// Learning rate, betas, epsilon.
    pub cfg: &'a crate::optim::AdamWConfig,
    /// This parameter's weight decay.
    pub weight_decay: f32,
    /// The clipping coefficient multiplying the gradient first (1 for none).
    pub grad_scale: f32,
}

/// The stored weights a block-format linear's master is quantized into
/// ([`Backend::quantize_weights`]' arguments): `groups` weights `[n, k]` back to back.
#[derive(Clone, Copy)]
pub struct StoredLayout<'a> {
    /// Weights in the stack (routed experts), 1 for a dense linear.
    pub groups: usize,
    /// Output rows of each weight.
    pub n: usize,
    /// Input columns.
    pub k: usize,
    /// The spec the weights are stored for.
    pub spec: LinearSpec,
    /// `name(g)` names weight `g` in errors.
    pub name: &'a (dyn Fn(usize) -> String + Sync),
    /// The weights' version tag.
    pub version: u64,
}

/// The weight scheme of `spec` for [`Backend::upload_stored`] (refusing a BF16 spec and an
/// empty list).
///
/// # Errors
/// As described, naming the first weight.
pub fn stored_scheme(
    device: &str,
    spec: LinearSpec,
    weights: &[StoredBytes<'_>],
) -> DResult<mxrl_formats::Scheme> {
    let first = weights
        .first()
        .ok_or_else(|| DeviceError::new(device, "upload_stored: no weights"))?;
    spec.weight_scheme().ok_or_else(|| {
        DeviceError::new(
            device,
            format!(
                "upload_stored: {} has no stored form ({spec:?})",
                first.name
            ),
        )
    })
}

/// Checks a projection's expert weights for [`Backend::upload_experts`]: stored bytes, one
/// spec and shape.
pub fn check_experts(experts: &[PreparedWeight]) -> DResult<()> {
    let Some(first) = experts.first() else {
        return Err(DeviceError::new("cpu", "upload_experts: no experts"));
    };
    for pw in experts {
        if pw.stored().is_none() {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "upload_experts: {} has no stored block-format bytes",
                    pw.name()
                ),
            ));
        }
        if pw.spec() != first.spec() || pw.n() != first.n() || pw.k() != first.k() {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "upload_experts: {} ({:?} [{}, {}]) differs from {} ({:?} [{}, {}])",
                    pw.name(),
                    pw.spec(),
                    pw.n(),
                    pw.k(),
                    first.name(),
                    first.spec(),
                    first.n(),
                    first.k()
                ),
            ));
        }
    }
    Ok(())
}

/// The CPU backend: the functions of this crate, as the CPU model calls them (bitwise).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

/// The checksum of a BF16 weight update copied on a device ([`Backend::checksum_bf16`]):
/// `Σ_i mix64((i << 16) | bits[i]) mod 2⁶⁴` with SplitMix64's finaliser as `mix64`. Every
/// element's position and bits enter, and the sum is independent of the order it is taken in
/// (so a device computes it with atomics and gets the same value). Not cryptographic.
pub fn checksum_bf16_bits(bits: impl Iterator<Item = u16>) -> u64 {
    bits.enumerate().fold(0u64, |acc, (i, b)| {
        acc.wrapping_add(crate::sample::splitmix64(((i as u64) << 16) | u64::from(b)))
    })
}

/// [`checksum_bf16_bits`] over bytes at positions `base + i`: the checksum of stored quantized
/// weights ([`Backend::checksum_qweights`]: codes, then scales, then NVFP4 amax bytes, in one
/// run of positions).
pub fn checksum_bytes(base: usize, bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_add(crate::sample::splitmix64(
            (((base + i) as u64) << 16) | u64::from(b),
        ))
    })
}

/// The checksum of stored weights: every weight's codes, then every weight's scale bytes,
/// then (NVFP4) every weight's amax as little-endian f32 bytes, as one run of positions.
pub fn checksum_stored(ws: &[&mxrl_formats::QuantizedTensor]) -> u64 {
    let mut bytes: Vec<u8> = Vec::new();
    for q in ws {
        bytes.extend_from_slice(&q.data);
    }
    for q in ws {
        match &q.scales {
            mxrl_formats::Scales::Bytes(b) => bytes.extend_from_slice(b),
            mxrl_formats::Scales::F32(v) => bytes.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        }
    }
    if ws
        .first()
        .is_some_and(|q| q.scheme.format() == mxrl_formats::Format::Nvfp4)
    {
        for q in ws {
            bytes.extend(q.amax.iter().flat_map(|x| x.to_le_bytes()));
        }
    }
    checksum_bytes(0, &bytes)
}

/// [`Backend::copy_blocks_bf16`] on host buffers.
fn copy_blocks<T: Copy>(
    src: &[T],
    dst: &mut [T],
    map: &[u32],
    block: usize,
    count: usize,
) -> DResult<()> {
    need("copy_blocks map", map.len(), 2 * count)?;
    if block == 0 {
        return Ok(());
    }
    let (sb, db) = (src.len() / block, dst.len() / block);
    for pair in map[..2 * count].chunks_exact(2) {
        let (s, d) = (pair[0] as usize, pair[1] as usize);
        if s < sb && d < db {
            dst[d * block..(d + 1) * block].copy_from_slice(&src[s * block..(s + 1) * block]);
        }
    }
    Ok(())
}

/// Rows `offsets[g]..offsets[g + 1]` of weight `g` of a grouped quantized linear, checked to
/// lie in `0..rows`, with the weight checked to be `[n, k]`.
fn group_rows(
    op: &str,
    pw: &PreparedWeight,
    offsets: &[u32],
    g: usize,
    rows: usize,
    n: usize,
    k: usize,
) -> DResult<(usize, usize)> {
    let (a, b) = (offsets[g] as usize, offsets[g + 1] as usize);
    if a > b || b > rows {
        return Err(DeviceError::new(
            "cpu",
            format!("{op}: group {g} rows {a}..{b} outside 0..{rows}"),
        ));
    }
    if pw.n() != n || pw.k() != k {
        return Err(DeviceError::new(
            "cpu",
            format!(
                "{op}: {} is [{}, {}], not [{n}, {k}]",
                pw.name(),
                pw.n(),
                pw.k()
            ),
        ));
    }
    Ok((a, b))
}

/// The values of operand `what` of the CPU backward of weights `w`: as given in f32, or
/// already rounded to BF16 where every weight's mode multiplies only their BF16 rounding
/// (`rounds`); otherwise an error naming the first weight that takes f32 and its mode.
fn cpu_operand<'a>(
    v: F32OrBf16<'a, Vec<f32>, Vec<f32>>,
    w: &[PreparedWeight],
    what: &str,
    rounds: fn(&LinearSpec) -> bool,
) -> DResult<&'a Vec<f32>> {
    match v {
        F32OrBf16::F32(v) => Ok(v),
        F32OrBf16::Bf16(v) => match w.iter().find(|pw| !rounds(&pw.spec())) {
            Some(pw) => Err(DeviceError::new(
                "cpu",
                format!(
                    "grouped_qlinear_backward {}: the {} backward takes {what} in f32",
                    pw.name(),
                    pw.spec().backward().name()
                ),
            )),
            None => Ok(v),
        },
    }
}

fn need(what: &str, got: usize, want: usize) -> DResult<()> {
    if got < want {
        return Err(DeviceError::new(
            "cpu",
            format!("{what}: buffer of {got} elements, {want} needed"),
        ));
    }
    Ok(())
}

/// RoPE on `x: [rows, heads·D]` with row `r` at position `pos[r]` of a `[max_pos, D/2]`
/// cos-then-sin table: the arithmetic of `rope::rope_forward` (`sign` +1) and
/// `rope::rope_backward` (`sign` −1).
fn rope_rows(
    x: &mut [f32],
    rows: usize,
    heads: usize,
    head_dim: usize,
    pos: &[u32],
    table: &[f32],
    sign: f32,
) -> DResult<()> {
    let half = head_dim / 2;
    need("rope x", x.len(), rows * heads * head_dim)?;
    need("rope pos", pos.len(), rows)?;
    let max_pos = table.len() / (2 * half.max(1));
    let (cos, sin) = table.split_at(max_pos * half);
    for r in 0..rows {
        let p = pos[r] as usize;
        if p >= max_pos {
            return Err(DeviceError::new(
                "cpu",
                format!("position {p} beyond the RoPE table ({max_pos})"),
            ));
        }
        let (cs, sn) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        for hh in 0..heads {
            let v = &mut x[(r * heads + hh) * head_dim..(r * heads + hh + 1) * head_dim];
            for i in 0..half {
                let (a, b) = (v[i], v[i + half]);
                let s = sign * sn[i];
                v[i] = a * cs[i] - b * s;
                v[i + half] = b * cs[i] + a * s;
            }
        }
    }
    Ok(())
}

impl CpuBackend {
    /// The CPU reference GEMM `y = a·wᵀ` exactly as the CPU model's linear layers run it
    /// (dot products for few rows, packed GEMM otherwise).
    fn nt(a: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        host_gemm::linear_nt(a, w, m, k, n)
    }
}

impl Backend for CpuBackend {
    type F32 = Vec<f32>;
    type Bf16 = Vec<f32>;
    type U32 = Vec<u32>;
    type Rope = Vec<f32>;
    type Graph = Infallible;
    type QExperts = Vec<PreparedWeight>;
    /// The lengths of the `grad_norm_begin` and which buffers were handed in (the CPU sums
    /// every buffer in the finishing call, in order, as `optim::global_grad_norm` does).
    type NormParts = (Vec<usize>, Vec<bool>);

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn upload_experts(&self, experts: Vec<PreparedWeight>) -> DResult<Vec<PreparedWeight>> {
        check_experts(&experts)?;
        Ok(experts)
    }

    fn grouped_qlinear(
        &self,
        x: &Vec<f32>,
        w: &Vec<PreparedWeight>,
        offsets: &Vec<u32>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        need("grouped_qlinear offsets", offsets.len(), experts + 1)?;
        need("grouped_qlinear x", x.len(), rows * k)?;
        need("grouped_qlinear y", y.len(), rows * n)?;
        if w.len() != experts {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "grouped_qlinear: {} expert weights for {experts} experts",
                    w.len()
                ),
            ));
        }
        for (e, pw) in w.iter().enumerate() {
            let (a, b) = group_rows("grouped_qlinear", pw, offsets, e, rows, n, k)?;
            if a == b {
                continue;
            }
            let out = pw
                .forward_inference(&x[a * k..b * k], b - a)
                .map_err(|e| DeviceError::new("cpu", e.to_string()))?;
            y[a * n..b * n].copy_from_slice(&out);
        }
        Ok(())
    }

    fn copy_qweights(&self, w: &Vec<PreparedWeight>) -> DResult<Vec<PreparedWeight>> {
        Ok(w.clone())
    }

    fn checksum_qweights(
        &self,
        w: &Vec<PreparedWeight>,
        out: &mut Vec<u32>,
        slot: usize,
    ) -> DResult<()> {
        need("checksum_qweights out", out.len(), 2 * slot + 2)?;
        let ws: Vec<&mxrl_formats::QuantizedTensor> = w
            .iter()
            .map(|pw| {
                pw.stored().ok_or_else(|| {
                    DeviceError::new("cpu", format!("{}: no stored bytes", pw.name()))
                })
            })
            .collect::<DResult<_>>()?;
        let cur = u64::from(out[2 * slot]) | (u64::from(out[2 * slot + 1]) << 32);
        let sum = cur.wrapping_add(checksum_stored(&ws));
        out[2 * slot] = sum as u32;
        out[2 * slot + 1] = (sum >> 32) as u32;
        Ok(())
    }

    fn stored_weights(
        &self,
        w: &Vec<PreparedWeight>,
    ) -> DResult<Vec<mxrl_formats::QuantizedTensor>> {
        w.iter()
            .map(|pw| {
                pw.stored().cloned().ok_or_else(|| {
                    DeviceError::new("cpu", format!("{}: no stored bytes", pw.name()))
                })
            })
            .collect()
    }

    fn qlinear(
        &self,
        x: &Vec<f32>,
        w: &Vec<PreparedWeight>,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        need("qlinear x", x.len(), rows * k)?;
        need("qlinear y", y.len(), rows * n)?;
        let [pw] = w.as_slice() else {
            return Err(DeviceError::new(
                "cpu",
                format!("qlinear: {} weights for a dense linear", w.len()),
            ));
        };
        if pw.n() != n || pw.k() != k {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "qlinear: {} is [{}, {}], not [{n}, {k}]",
                    pw.name(),
                    pw.n(),
                    pw.k()
                ),
            ));
        }
        let out = pw
            .forward_inference(&x[..rows * k], rows)
            .map_err(|e| DeviceError::new("cpu", e.to_string()))?;
        y[..rows * n].copy_from_slice(&out);
        Ok(())
    }

    fn grouped_qlinear_backward(
        &self,
        x: SavedX<'_, Vec<f32>, Vec<f32>>,
        w: &Vec<PreparedWeight>,
        _master: &Vec<f32>,
        _master_bf16: Option<&Vec<f32>>,
        dy: OutGrad<'_, Vec<f32>, Vec<f32>>,
        _offsets: Option<&Vec<u32>>,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dw_write: GradWrite,
    ) -> DResult<()> {
        let groups = w.len();
        need(
            "grouped_qlinear_backward offsets",
            host_offsets.len(),
            groups + 1,
        )?;
        // BF16 values (already rounded) are the operand the backward would round them to.
        let dy = cpu_operand(dy, w, "dy", LinearSpec::rounds_dy_to_bf16)?;
        let x = match x {
            SavedX::F32(v) => F32OrBf16::F32(v),
            SavedX::Bf16(v) => F32OrBf16::Bf16(v),
            SavedX::Operand(_) => {
                return Err(DeviceError::new(
                    "cpu",
                    "grouped_qlinear_backward: the CPU backend keeps no forward operand (x in \
                     f32 or BF16)",
                ))
            }
        };
        let x = cpu_operand(x, w, "x", LinearSpec::rounds_x_to_bf16)?;
        need("grouped_qlinear_backward x", x.len(), rows * k)?;
        need("grouped_qlinear_backward dy", dy.len(), rows * n)?;
        need("grouped_qlinear_backward dx", dx.len(), rows * k)?;
        need("grouped_qlinear_backward dw", dw.len(), groups * n * k)?;
        if dw_write == GradWrite::Overwrite {
            dw[..groups * n * k].fill(0.0);
        }
        let err = |e: crate::qlinear::QLinearError| DeviceError::new("cpu", e.to_string());
        for (g, pw) in w.iter().enumerate() {
            let (a, b) = group_rows("grouped_qlinear_backward", pw, host_offsets, g, rows, n, k)?;
            // No context for zero rows: the CPU model skips unused experts.
            if a == b {
                continue;
            }
            let (_, saved) = pw.forward(&x[a * k..b * k], b - a).map_err(err)?;
            let d = pw
                .backward_accumulate(
                    &saved,
                    &dy[a * n..b * n],
                    &mut dw[g * n * k..(g + 1) * n * k],
                )
                .map_err(err)?;
            dx[a * k..b * k].copy_from_slice(&d);
        }
        Ok(())
    }

    fn gather_f32(
        &self,
        x: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        top_k: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        let perm = &route.perm;
        let rows = n * top_k;
        need("gather perm", perm.len(), rows)?;
        need("gather out", out.len(), rows * h)?;
        for (r, &ts) in perm[..rows].iter().enumerate() {
            let t = ts as usize / top_k;
            need("gather x", x.len(), (t + 1) * h)?;
            out[r * h..(r + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        Ok(())
    }

    fn swiglu_f32(&self, gu: &Vec<f32>, rows: usize, f: usize, out: &mut Vec<f32>) -> DResult<()> {
        need("swiglu gu", gu.len(), rows * 2 * f)?;
        need("swiglu out", out.len(), rows * f)?;
        crate::activation::swiglu_forward(&gu[..rows * 2 * f], rows, f, &mut out[..rows * f]);
        Ok(())
    }

    fn gather_rows_bf16(
        &self,
        xb: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        top_k: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        let perm = &route.perm;
        let rows = n * top_k;
        need("gather perm", perm.len(), rows)?;
        need("gather out", out.len(), rows * h)?;
        for (r, &ts) in perm[..rows].iter().enumerate() {
            let t = ts as usize / top_k;
            need("gather x", xb.len(), (t + 1) * h)?;
            out[r * h..(r + 1) * h].copy_from_slice(&xb[t * h..(t + 1) * h]);
        }
        Ok(())
    }

    fn zeros_u32(&self, n: usize) -> DResult<Vec<u32>> {
        Ok(vec![0; n])
    }

    fn write_u32(&self, dst: &mut Vec<u32>, v: &[u32]) -> DResult<()> {
        need("write_u32 destination", dst.len(), v.len())?;
        dst[..v.len()].copy_from_slice(v);
        Ok(())
    }

    fn sample(
        &self,
        logits: &Vec<f32>,
        rows: usize,
        v: usize,
        p: &SampleParams,
        tokens: &mut Vec<u32>,
        logprobs: &mut Vec<f32>,
    ) -> DResult<()> {
        p.validate()
            .map_err(|m| DeviceError::new("cpu", format!("sample: {m}")))?;
        if rows > 0 && v == 0 {
            return Err(DeviceError::new("cpu", "sample: empty vocabulary"));
        }
        need("sample logits", logits.len(), rows * v)?;
        need("sample tokens", tokens.len(), rows)?;
        need("sample logprobs", logprobs.len(), rows)?;
        let (t, lp) = sample_rows(&logits[..rows * v], rows, v, p);
        tokens[..rows].copy_from_slice(&t);
        logprobs[..rows].copy_from_slice(&lp);
        Ok(())
    }

    fn end_capture(&self) -> DResult<Option<Infallible>> {
        Ok(None)
    }

    fn launch_graph(&self, g: &Infallible) -> DResult<()> {
        match *g {}
    }

    /// `[max_pos, D/2]` cosines then sines.
    fn rope_table(&self, max_pos: usize, head_dim: usize, theta: f64) -> DResult<Vec<f32>> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(DeviceError::new(
                "cpu",
                format!("RoPE head_dim {head_dim} must be even"),
            ));
        }
        let pos: Vec<usize> = (0..max_pos).collect();
        let t = RopeTable::new(&pos, head_dim, theta);
        let mut v = t.cos().to_vec();
        v.extend_from_slice(t.sin());
        Ok(v)
    }

    fn zeros_f32(&self, n: usize) -> DResult<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn zeros_bf16(&self, n: usize) -> DResult<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn upload_f32(&self, v: &[f32]) -> DResult<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn upload_u32(&self, v: &[u32]) -> DResult<Vec<u32>> {
        Ok(v.to_vec())
    }

    fn download_f32(&self, b: &Vec<f32>, n: usize) -> DResult<Vec<f32>> {
        need("download", b.len(), n)?;
        Ok(b[..n].to_vec())
    }

    fn download_u32(&self, b: &Vec<u32>, n: usize) -> DResult<Vec<u32>> {
        need("download", b.len(), n)?;
        Ok(b[..n].to_vec())
    }

    fn download_f32_with(&self, b: &Vec<f32>, n: usize, f: &mut dyn FnMut(&[f32])) -> DResult<()> {
        need("download", b.len(), n)?;
        f(&b[..n]);
        Ok(())
    }

    fn download_u32_with(&self, b: &Vec<u32>, n: usize, f: &mut dyn FnMut(&[u32])) -> DResult<()> {
        need("download", b.len(), n)?;
        f(&b[..n]);
        Ok(())
    }

    fn copy_bf16(&self, src: &Vec<f32>, dst: &mut Vec<f32>, n: usize) -> DResult<()> {
        need("copy_bf16 src", src.len(), n)?;
        need("copy_bf16 dst", dst.len(), n)?;
        dst[..n].copy_from_slice(&src[..n]);
        Ok(())
    }

    fn widen_bf16(&self, x: &Vec<f32>, out: &mut Vec<f32>, n: usize) -> DResult<()> {
        self.copy_bf16(x, out, n)
    }

    fn copy_blocks_bf16(
        &self,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
        map: &Vec<u32>,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        copy_blocks(src, dst, map, block, count)
    }

    fn copy_blocks_f32(
        &self,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
        map: &Vec<u32>,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        copy_blocks(src, dst, map, block, count)
    }

    fn copy_blocks_u32(
        &self,
        src: &Vec<u32>,
        dst: &mut Vec<u32>,
        map: &Vec<u32>,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        copy_blocks(src, dst, map, block, count)
    }

    fn checksum_bf16(
        &self,
        x: &Vec<f32>,
        n: usize,
        out: &mut Vec<u32>,
        slot: usize,
    ) -> DResult<()> {
        need("checksum_bf16 x", x.len(), n)?;
        need("checksum_bf16 out", out.len(), 2 * slot + 2)?;
        let old = u64::from(out[2 * slot]) | (u64::from(out[2 * slot + 1]) << 32);
        let sum = old.wrapping_add(checksum_bf16_bits(
            x[..n].iter().map(|&v| half::bf16::from_f32(v).to_bits()),
        ));
        out[2 * slot] = sum as u32;
        out[2 * slot + 1] = (sum >> 32) as u32;
        Ok(())
    }

    fn round_bf16(&self, x: &Vec<f32>, out: &mut Vec<f32>, n: usize) -> DResult<()> {
        need("round_bf16 x", x.len(), n)?;
        need("round_bf16 out", out.len(), n)?;
        for (o, &v) in out[..n].iter_mut().zip(&x[..n]) {
            *o = round_bf16(v);
        }
        Ok(())
    }

    fn upload_bf16_bytes(&self, bytes: &[u8]) -> DResult<Vec<f32>> {
        if !bytes.len().is_multiple_of(2) {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "upload_bf16_bytes: {} bytes is not 2 per value",
                    bytes.len()
                ),
            ));
        }
        // CPU BF16 buffers hold BF16 values as f32: the widening is exact.
        Ok(bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect())
    }

    fn download_bf16(&self, b: &Vec<f32>, n: usize) -> DResult<Vec<u16>> {
        need("download", b.len(), n)?;
        // CPU BF16 buffers hold BF16 values as f32: the conversion is exact.
        Ok(b[..n]
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect())
    }

    fn to_bf16(&self, x: &Vec<f32>, out: &mut Vec<f32>, n: usize) -> DResult<()> {
        need("to_bf16 x", x.len(), n)?;
        need("to_bf16 out", out.len(), n)?;
        for (o, &v) in out[..n].iter_mut().zip(&x[..n]) {
            *o = round_bf16(v);
        }
        Ok(())
    }

    fn add(&self, y: &mut Vec<f32>, x: &Vec<f32>, n: usize) -> DResult<()> {
        need("add y", y.len(), n)?;
        need("add x", x.len(), n)?;
        for (a, &b) in y[..n].iter_mut().zip(&x[..n]) {
            *a += b;
        }
        Ok(())
    }

    fn add_bias(&self, y: &mut Vec<f32>, b: &Vec<f32>, rows: usize, n: usize) -> DResult<()> {
        need("bias y", y.len(), rows * n)?;
        need("bias b", b.len(), n)?;
        for r in 0..rows {
            for (a, &c) in y[r * n..(r + 1) * n].iter_mut().zip(&b[..n]) {
                *a += c;
            }
        }
        Ok(())
    }

    fn embed(
        &self,
        table: &Vec<f32>,
        vocab: usize,
        tokens: &Vec<u32>,
        rows: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        need("embed table", table.len(), vocab * h)?;
        need("embed tokens", tokens.len(), rows)?;
        need("embed out", out.len(), rows * h)?;
        for (r, &t) in tokens[..rows].iter().enumerate() {
            let t = t as usize;
            if t >= vocab {
                return Err(DeviceError::new(
                    "cpu",
                    format!("token {t} ≥ vocab {vocab}"),
                ));
            }
            out[r * h..(r + 1) * h].copy_from_slice(&table[t * h..(t + 1) * h]);
        }
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        d: usize,
        eps: f32,
        y: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
    ) -> DResult<()> {
        need("rmsnorm x", x.len(), rows * d)?;
        need("rmsnorm w", w.len(), d)?;
        need("rmsnorm y", y.len(), rows * d)?;
        need("rmsnorm rstd", rstd.len(), rows)?;
        rmsnorm_forward(
            &x[..rows * d],
            &w[..d],
            rows,
            d,
            eps,
            &mut y[..rows * d],
            &mut rstd[..rows],
        );
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &Vec<u32>,
        table: &Vec<f32>,
    ) -> DResult<()> {
        rope_rows(x, rows, heads, head_dim, pos, table, 1.0)
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        m: usize,
        k: usize,
        n: usize,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        need("linear x", x.len(), m * k)?;
        need("linear w", w.len(), n * k)?;
        need("linear y", y.len(), m * n)?;
        let r = Self::nt(&x[..m * k], &w[..n * k], m, k, n);
        y[..m * n].copy_from_slice(&r);
        Ok(())
    }

    fn grouped_linear(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        offsets: &Vec<u32>,
        _host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Vec<f32>,
    ) -> DResult<()> {
        need("grouped x", x.len(), rows * k)?;
        need("grouped w", w.len(), experts * n * k)?;
        need("grouped offsets", offsets.len(), experts + 1)?;
        need("grouped y", y.len(), rows * n)?;
        for e in 0..experts {
            let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
            if a > b || b > rows {
                return Err(DeviceError::new(
                    "cpu",
                    format!("bad expert offsets {a}..{b}"),
                ));
            }
            if a == b {
                continue;
            }
            let r = Self::nt(
                &x[a * k..b * k],
                &w[e * n * k..(e + 1) * n * k],
                b - a,
                k,
                n,
            );
            y[a * n..b * n].copy_from_slice(&r);
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        layout: &SeqLayout,
        _offsets: &Vec<u32>,
        shape: AttnShape,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> DResult<()> {
        let n = layout.num_tokens();
        let (qd, kvd) = (
            shape.q_heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        need("attention q", q.len(), n * qd)?;
        need("attention k", k.len(), n * kvd)?;
        need("attention v", v.len(), n * kvd)?;
        need("attention out", out.len(), n * qd)?;
        need("attention lse", lse.len(), n * shape.q_heads)?;
        let _probs = attention_forward(
            &q[..n * qd],
            &k[..n * kvd],
            &v[..n * kvd],
            layout,
            shape,
            &mut out[..n * qd],
        );
        Ok(())
    }

    fn kv_append(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        lens: &Vec<u32>,
        batch: usize,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> DResult<()> {
        need("kv_append k", k.len(), batch * kv_width)?;
        need("kv_append v", v.len(), batch * kv_width)?;
        need("kv_append lens", lens.len(), batch)?;
        for b in 0..batch {
            let p = lens[b] as usize;
            if p == 0 || p > max_len {
                return Err(DeviceError::new(
                    "cpu",
                    format!("KV cache slot {b}: length {p} outside 1..={max_len}"),
                ));
            }
            let dst = (b * max_len + p - 1) * kv_width;
            need("kv cache", k_cache.len().min(v_cache.len()), dst + kv_width)?;
            for j in 0..kv_width {
                k_cache[dst + j] = round_bf16(k[b * kv_width + j]);
                v_cache[dst + j] = round_bf16(v[b * kv_width + j]);
            }
        }
        Ok(())
    }

    fn kv_fill(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        layout: &SeqLayout,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> DResult<()> {
        for b in 0..layout.num_seqs() {
            let (o, len) = (layout.offset(b), layout.len(b));
            if len > max_len {
                return Err(DeviceError::new(
                    "cpu",
                    format!("sequence {b} of {len} tokens exceeds the KV cache ({max_len})"),
                ));
            }
            let dst = b * max_len * kv_width;
            need(
                "kv cache",
                k_cache.len().min(v_cache.len()),
                dst + len * kv_width,
            )?;
            for j in 0..len * kv_width {
                k_cache[dst + j] = round_bf16(k[o * kv_width + j]);
                v_cache[dst + j] = round_bf16(v[o * kv_width + j]);
            }
        }
        Ok(())
    }

    fn attention_decode(
        &self,
        q: &Vec<f32>,
        k_cache: &Vec<f32>,
        v_cache: &Vec<f32>,
        lens: &Vec<u32>,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        let (qd, kvd) = (
            shape.q_heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        need("decode lens", lens.len(), batch)?;
        need("decode q", q.len(), batch * qd)?;
        need("decode out", out.len(), batch * qd)?;
        let mut scratch = vec![0.0f32; max_len];
        for (b, &len) in lens[..batch].iter().enumerate() {
            let len = len as usize;
            if len > max_len {
                return Err(DeviceError::new(
                    "cpu",
                    format!("decode: sequence {b} of {len} tokens exceeds the cache's {max_len}"),
                ));
            }
            let base = b * max_len * kvd;
            need(
                "decode cache",
                k_cache.len().min(v_cache.len()),
                base + len * kvd,
            )?;
            attention_decode(
                &q[b * qd..(b + 1) * qd],
                &k_cache[base..base + len * kvd],
                &v_cache[base..base + len * kvd],
                len,
                shape,
                &mut scratch[..len],
                &mut out[b * qd..(b + 1) * qd],
            );
        }
        Ok(())
    }

    fn capture_routes(
        &self,
        ids: &Vec<u32>,
        weights: &Vec<f32>,
        rows: usize,
        k: usize,
        seq: Option<&Vec<u32>>,
        pos: &Vec<u32>,
        slots: usize,
        max_len: usize,
        dst_ids: &mut Vec<u32>,
        dst_weights: &mut Vec<f32>,
    ) -> DResult<()> {
        need("capture_routes ids", ids.len(), rows * k)?;
        need("capture_routes weights", weights.len(), rows * k)?;
        need("capture_routes pos", pos.len(), rows)?;
        if let Some(s) = seq {
            need("capture_routes seq", s.len(), rows)?;
        }
        need("capture_routes dst ids", dst_ids.len(), slots * max_len * k)?;
        need(
            "capture_routes dst weights",
            dst_weights.len(),
            slots * max_len * k,
        )?;
        for r in 0..rows {
            let s = seq.map_or(r, |q| q[r] as usize);
            let p = pos[r] as usize;
            if s >= slots || p >= max_len {
                continue;
            }
            let d = (p * slots + s) * k;
            dst_ids[d..d + k].copy_from_slice(&ids[r * k..(r + 1) * k]);
            dst_weights[d..d + k].copy_from_slice(&weights[r * k..(r + 1) * k]);
        }
        Ok(())
    }

    fn capture_rows(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: usize,
        seq: Option<&Vec<u32>>,
        pos: &Vec<u32>,
        first: &Vec<u32>,
        slots: usize,
        len: usize,
        dst: &mut Vec<f32>,
    ) -> DResult<()> {
        need("capture_rows x", x.len(), rows * w)?;
        need("capture_rows pos", pos.len(), rows)?;
        if let Some(s) = seq {
            need("capture_rows seq", s.len(), rows)?;
        }
        need("capture_rows first", first.len(), slots)?;
        need("capture_rows dst", dst.len(), slots * len * w)?;
        for r in 0..rows {
            let s = seq.map_or(r, |q| q[r] as usize);
            if s >= slots {
                continue;
            }
            let (p, f) = (pos[r] as usize, first[s] as usize);
            if p < f || p - f >= len {
                continue;
            }
            let d = ((p - f) * slots + s) * w;
            dst[d..d + w].copy_from_slice(&x[r * w..(r + 1) * w]);
        }
        Ok(())
    }

    fn route(
        &self,
        logits: &Vec<f32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        replay: Option<&Vec<u32>>,
        out: &mut RouteBufs<Self>,
    ) -> DResult<()> {
        need("route logits", logits.len(), n * e)?;
        if let Some(r) = replay {
            need("route replayed ids", r.len(), n * k)?;
            if let Some(&bad) = r[..n * k].iter().find(|&&x| x as usize >= e) {
                return Err(DeviceError::new(
                    "cpu",
                    format!("route: replayed expert id {bad} out of range for {e} experts"),
                ));
            }
        }
        let (routes, state) = router_forward(
            &logits[..n * e],
            n,
            e,
            k,
            norm_topk_prob,
            match replay {
                Some(r) => RouteMode::ReplayIds(&r[..n * k]),
                None => RouteMode::Compute,
            },
        );
        let d = Dispatch::new(&routes, e);
        out.ids = routes.ids;
        out.weights = routes.weights;
        out.probs = state.probs;
        out.offsets = d.starts.iter().map(|&s| s as u32).collect();
        out.perm = d.entries.iter().map(|&(t, s)| t * k as u32 + s).collect();
        out.row_of = vec![0; n * k];
        for (r, &ts) in out.perm.iter().enumerate() {
            out.row_of[ts as usize] = r as u32;
        }
        Ok(())
    }

    fn gather_bf16(
        &self,
        x: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        top_k: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        let perm = &route.perm;
        let rows = n * top_k;
        need("gather perm", perm.len(), rows)?;
        need("gather out", out.len(), rows * h)?;
        for (r, &ts) in perm[..rows].iter().enumerate() {
            let t = ts as usize / top_k;
            need("gather x", x.len(), (t + 1) * h)?;
            for j in 0..h {
                out[r * h + j] = round_bf16(x[t * h + j]);
            }
        }
        Ok(())
    }

    fn swiglu_bf16(&self, gu: &Vec<f32>, rows: usize, f: usize, out: &mut Vec<f32>) -> DResult<()> {
        need("swiglu gu", gu.len(), rows * 2 * f)?;
        need("swiglu out", out.len(), rows * f)?;
        crate::activation::swiglu_forward(&gu[..rows * 2 * f], rows, f, &mut out[..rows * f]);
        for v in &mut out[..rows * f] {
            *v = round_bf16(*v);
        }
        Ok(())
    }

    fn combine(
        &self,
        y: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        out: &mut Vec<f32>,
    ) -> DResult<()> {
        need("combine y", y.len(), n * k * h)?;
        need("combine out", out.len(), n * h)?;
        let routes = Routes {
            top_k: k,
            ids: route.ids[..n * k].to_vec(),
            weights: route.weights[..n * k].to_vec(),
        };
        for x in 0..e {
            let (a, b) = (route.offsets[x] as usize, route.offsets[x + 1] as usize);
            let rows: Vec<(u32, u32)> = route.perm[a..b]
                .iter()
                .map(|&ts| (ts / k as u32, ts % k as u32))
                .collect();
            combine_forward(&y[a * h..b * h], h, &rows, &routes, &mut out[..n * h]);
        }
        Ok(())
    }

    fn head_logprobs(
        &self,
        h: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        logprob: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        entropy: &mut Vec<f32>,
    ) -> DResult<()> {
        need("head h", h.len(), n * hidden)?;
        need("head entropy", entropy.len(), n)?;
        need("head w", w.len(), vocab * hidden)?;
        need("head targets", targets.len(), n)?;
        need("head logprob", logprob.len(), n)?;
        need("head lse", lse.len(), n)?;
        let z = Self::nt(&h[..n * hidden], &w[..vocab * hidden], n, hidden, vocab);
        let (lp, l) = logprobs_forward(&z, &targets[..n], n, vocab, temperature);
        logprob[..n].copy_from_slice(&lp);
        lse[..n].copy_from_slice(&l);
        entropy[..n].copy_from_slice(&crate::loss::entropy_forward(&z, n, vocab, temperature));
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        rows: usize,
        d: usize,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> DResult<()> {
        for (what, len, want) in [
            ("dy", dy.len(), rows * d),
            ("x", x.len(), rows * d),
            ("w", w.len(), d),
            ("rstd", rstd.len(), rows),
            ("dx", dx.len(), rows * d),
            ("dw", dw.len(), d),
        ] {
            need(&format!("rmsnorm_backward {what}"), len, want)?;
        }
        crate::norm::rmsnorm_backward(
            &dy[..rows * d],
            &x[..rows * d],
            &w[..d],
            &rstd[..rows],
            rows,
            d,
            &mut dx[..rows * d],
            &mut dw[..d],
        );
        Ok(())
    }

    fn linear_backward(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        m: usize,
        k: usize,
        n: usize,
        dx: Option<&mut Vec<f32>>,
        dw: &mut Vec<f32>,
    ) -> DResult<()> {
        need("linear_backward dy", dy.len(), m * n)?;
        need("linear_backward x", x.len(), m * k)?;
        need("linear_backward w", w.len(), n * k)?;
        need("linear_backward dw", dw.len(), n * k)?;
        let dyo: Vec<f32> = dy[..m * n].iter().map(|&v| round_bf16(v)).collect();
        host_gemm::linear_tn_into(&dyo, &x[..m * k], &mut dw[..n * k], n, m, k, true);
        if let Some(dx) = dx {
            need("linear_backward dx", dx.len(), m * k)?;
            let r = host_gemm::linear_nn(&dyo, &w[..n * k], m, n, k);
            dx[..m * k].copy_from_slice(&r);
        }
        Ok(())
    }

    fn grouped_linear_backward(
        &self,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        offsets: &Vec<u32>,
        _host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dw_write: GradWrite,
    ) -> DResult<()> {
        need("grouped_backward offsets", offsets.len(), experts + 1)?;
        need("grouped_backward dx", dx.len(), rows * k)?;
        need("grouped_backward dw", dw.len(), experts * n * k)?;
        if dw_write == GradWrite::Overwrite {
            dw[..experts * n * k].fill(0.0);
        }
        for e in 0..experts {
            let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
            if a == b {
                continue;
            }
            let dys = dy[a * n..b * n].to_vec();
            let xs = x[a * k..b * k].to_vec();
            let ws = w[e * n * k..(e + 1) * n * k].to_vec();
            let mut dxs = vec![0.0f32; (b - a) * k];
            let mut dws = dw[e * n * k..(e + 1) * n * k].to_vec();
            self.linear_backward(&dys, &xs, &ws, b - a, k, n, Some(&mut dxs), &mut dws)?;
            dx[a * k..b * k].copy_from_slice(&dxs);
            dw[e * n * k..(e + 1) * n * k].copy_from_slice(&dws);
        }
        Ok(())
    }

    fn swiglu_backward(
        &self,
        dact: &Vec<f32>,
        gu: &Vec<f32>,
        rows: usize,
        f: usize,
        dgu: &mut Vec<f32>,
    ) -> DResult<()> {
        need("swiglu_backward dact", dact.len(), rows * f)?;
        need("swiglu_backward gu", gu.len(), rows * 2 * f)?;
        need("swiglu_backward dgu", dgu.len(), rows * 2 * f)?;
        crate::activation::swiglu_backward(
            &dact[..rows * f],
            &gu[..rows * 2 * f],
            rows,
            f,
            &mut dgu[..rows * 2 * f],
        );
        Ok(())
    }

    fn combine_backward(
        &self,
        dout: &Vec<f32>,
        y: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        dy: &mut Vec<f32>,
        dweights: &mut Vec<f32>,
    ) -> DResult<()> {
        need("combine_backward dy", dy.len(), n * k * h)?;
        need("combine_backward dweights", dweights.len(), n * k)?;
        // Overwritten: the reference accumulates, so from zeros.
        dweights[..n * k].fill(0.0);
        let routes = Routes {
            top_k: k,
            ids: route.ids[..n * k].to_vec(),
            weights: route.weights[..n * k].to_vec(),
        };
        for x in 0..e {
            let (a, b) = (route.offsets[x] as usize, route.offsets[x + 1] as usize);
            if a == b {
                continue;
            }
            let rows: Vec<(u32, u32)> = route.perm[a..b]
                .iter()
                .map(|&ts| (ts / k as u32, ts % k as u32))
                .collect();
            let r = crate::moe::combine_backward(
                &dout[..n * h],
                &y[a * h..b * h],
                h,
                &rows,
                &routes,
                &mut dweights[..n * k],
            );
            dy[a * h..b * h].copy_from_slice(&r);
        }
        Ok(())
    }

    fn gather_backward(
        &self,
        dg: &Vec<f32>,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        k: usize,
        h: usize,
        dx: &mut Vec<f32>,
    ) -> DResult<()> {
        need("gather_backward dx", dx.len(), n * h)?;
        for x in 0..e {
            let (a, b) = (route.offsets[x] as usize, route.offsets[x + 1] as usize);
            let rows: Vec<(u32, u32)> = route.perm[a..b]
                .iter()
                .map(|&ts| (ts / k as u32, ts % k as u32))
                .collect();
            crate::moe::gather_backward(&dg[a * h..b * h], h, &rows, &mut dx[..n * h]);
        }
        Ok(())
    }

    fn router_backward(
        &self,
        dweights: &Vec<f32>,
        route: &RouteBufs<Self>,
        extra: Option<&Vec<f32>>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        dlogits: &mut Vec<f32>,
    ) -> DResult<()> {
        need("router_backward dlogits", dlogits.len(), n * e)?;
        let extra = match extra {
            Some(g) => {
                need("router_backward extra", g.len(), e)?;
                let mut rows = Vec::with_capacity(n * e);
                for _ in 0..n {
                    rows.extend_from_slice(&g[..e]);
                }
                Some(rows)
            }
            None => None,
        };
        let routes = Routes {
            top_k: k,
            ids: route.ids[..n * k].to_vec(),
            weights: route.weights[..n * k].to_vec(),
        };
        let state = crate::routing::RouterState {
            probs: route.probs[..n * e].to_vec(),
            weights_frozen: false,
        };
        crate::routing::router_backward(
            &dweights[..n * k],
            &routes,
            &state,
            n,
            e,
            norm_topk_prob,
            extra.as_deref(),
            &mut dlogits[..n * e],
        );
        Ok(())
    }

    fn aux_loss_grad(
        &self,
        layers: &[&RouteBufs<Self>],
        n: usize,
        e: usize,
        k: usize,
        coef: f32,
        loss: &mut Vec<f32>,
        grad: &mut Vec<f32>,
    ) -> DResult<()> {
        need("aux loss", loss.len(), 1)?;
        need("aux grad", grad.len(), e)?;
        let mut refs: Vec<(&[f32], &[u32])> = Vec::with_capacity(layers.len());
        for r in layers {
            need("aux probs", r.probs.len(), n * e)?;
            need("aux ids", r.ids.len(), n * k)?;
            refs.push((&r.probs[..n * e], &r.ids[..n * k]));
        }
        let (l, rows) = crate::routing::load_balancing_loss(&refs, e);
        loss[0] = l;
        match rows.iter().find(|g| !g.is_empty()) {
            // Every token's row is the same: the first one, times the coefficient.
            Some(g) => {
                for (d, &x) in grad[..e].iter_mut().zip(&g[..e]) {
                    *d = x * coef;
                }
            }
            None => grad[..e].fill(0.0),
        }
        Ok(())
    }

    fn attention_backward(
        &self,
        dout: &Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        _out: &Vec<f32>,
        _lse: &Vec<f32>,
        layout: &SeqLayout,
        _offsets: &Vec<u32>,
        shape: AttnShape,
        dq: &mut Vec<f32>,
        dk: &mut Vec<f32>,
        dv: &mut Vec<f32>,
    ) -> DResult<()> {
        let n = layout.num_tokens();
        let (qd, kvd) = (
            shape.q_heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        need("attention_backward dq", dq.len(), n * qd)?;
        need("attention_backward dk", dk.len(), n * kvd)?;
        need("attention_backward dv", dv.len(), n * kvd)?;
        // The CPU reference keeps no probabilities between forward and backward here: it
        // recomputes them with the same forward (bitwise the forward's).
        let mut scratch = vec![0.0f32; n * qd];
        let probs = attention_forward(
            &q[..n * qd],
            &k[..n * kvd],
            &v[..n * kvd],
            layout,
            shape,
            &mut scratch,
        );
        crate::attention::attention_backward(
            &dout[..n * qd],
            &q[..n * qd],
            &k[..n * kvd],
            &v[..n * kvd],
            &probs,
            layout,
            shape,
            &mut dq[..n * qd],
            &mut dk[..n * kvd],
            &mut dv[..n * kvd],
        );
        Ok(())
    }

    fn rope_backward(
        &self,
        dx: &mut Vec<f32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &Vec<u32>,
        table: &Vec<f32>,
    ) -> DResult<()> {
        rope_rows(dx, rows, heads, head_dim, pos, table, -1.0)
    }

    fn head_backward(
        &self,
        h: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        lse: &Vec<f32>,
        dlogprob: &Vec<f32>,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        dh: &mut Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> DResult<()> {
        need("head_backward dh", dh.len(), n * hidden)?;
        let z = Self::nt(&h[..n * hidden], &w[..vocab * hidden], n, hidden, vocab);
        let mut dz = vec![0.0f32; n * vocab];
        crate::loss::logprobs_backward(
            &dlogprob[..n],
            &z,
            &lse[..n],
            &targets[..n],
            n,
            vocab,
            temperature,
            &mut dz,
        );
        self.linear_backward(&dz, h, w, n, hidden, vocab, Some(dh), dw)
    }

    fn embed_backward(
        &self,
        dx: &Vec<f32>,
        _tokens: &Vec<u32>,
        host_tokens: &[u32],
        h: usize,
        dtable: &mut Vec<f32>,
    ) -> DResult<()> {
        let rows = host_tokens.len();
        need("embed_backward dx", dx.len(), rows * h)?;
        if let Some(&t) = host_tokens.iter().max() {
            need("embed_backward dtable", dtable.len(), (t as usize + 1) * h)?;
        }
        crate::embedding::embedding_backward(dtable, &dx[..rows * h], host_tokens, h);
        Ok(())
    }

    fn grad_norm(&self, grads: &[(&Vec<f32>, usize)]) -> DResult<f64> {
        let slices: Vec<&[f32]> = grads.iter().map(|(g, n)| &g[..*n]).collect();
        Ok(crate::optim::global_grad_norm(&slices))
    }

    fn grad_norm_begin(&self, lens: &[usize]) -> DResult<(Vec<usize>, Vec<bool>)> {
        Ok((lens.to_vec(), vec![false; lens.len()]))
    }

    fn grad_norm_add(
        &self,
        parts: &mut (Vec<usize>, Vec<bool>),
        bufs: &[(usize, &Vec<f32>)],
    ) -> DResult<()> {
        let (lens, added) = parts;
        for &(i, grad) in bufs {
            let Some(&n) = lens.get(i) else {
                return Err(DeviceError::new(
                    "cpu",
                    format!("grad_norm_add: buffer {i} handed in, {} begun", lens.len()),
                ));
            };
            if std::mem::replace(&mut added[i], true) {
                return Err(DeviceError::new(
                    "cpu",
                    format!("grad_norm_add: buffer {i} handed in twice"),
                ));
            }
            need("grad_norm_add grad", grad.len(), n)?;
        }
        Ok(())
    }

    fn grad_norm_finish(
        &self,
        parts: (Vec<usize>, Vec<bool>),
        grads: &[(&Vec<f32>, usize)],
    ) -> DResult<f64> {
        let lens: Vec<usize> = grads.iter().map(|(_, n)| *n).collect();
        if lens != parts.0 {
            return Err(DeviceError::new(
                "cpu",
                format!(
                    "grad_norm_finish: lengths {lens:?}, begun with {:?}",
                    parts.0
                ),
            ));
        }
        self.grad_norm(grads)
    }

    fn adamw(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        n: usize,
        step: u64,
        cfg: &crate::optim::AdamWConfig,
        weight_decay: f32,
        grad_scale: f32,
        op: Option<&mut Vec<f32>>,
    ) -> DResult<()> {
        let scaled: Vec<f32>;
        let g = if grad_scale == 1.0 {
            &grad[..n]
        } else {
            scaled = grad[..n].iter().map(|&x| x * grad_scale).collect();
            &scaled
        };
        crate::optim::adamw_update(
            &mut param[..n],
            g,
            &mut m[..n],
            &mut v[..n],
            step,
            cfg,
            weight_decay,
        );
        if let Some(op) = op {
            for (o, &p) in op[..n].iter_mut().zip(&param[..n]) {
                *o = round_bf16(p);
            }
        }
        Ok(())
    }

    fn fill_zero(&self, x: &mut Vec<f32>, n: usize) -> DResult<()> {
        x[..n].fill(0.0);
        Ok(())
    }

    fn bias_backward(
        &self,
        dy: &Vec<f32>,
        rows: usize,
        n: usize,
        db: &mut Vec<f32>,
    ) -> DResult<()> {
        need("bias_backward dy", dy.len(), rows * n)?;
        need("bias_backward db", db.len(), n)?;
        for row in dy[..rows * n].chunks(n) {
            for (a, &c) in db[..n].iter_mut().zip(row) {
                *a += c;
            }
        }
        Ok(())
    }
}
