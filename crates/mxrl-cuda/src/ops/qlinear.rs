//! The quantized linear layer `y = x · Wᵀ` on the device, with the three backward modes of
//! the mxrl recipes (kernels `kernels/ops_qlinear.cu` after the contract's `kernels/quant.cu`).
//!
//! Named CPU reference: [`mxrl_tensor::qlinear::PreparedWeight`] (`forward`,
//! `forward_inference`, `backward`); the operands, what is kept from forward to backward and
//! the modes are those of its module doc. Shapes: `x [M, K]`, `W [N, K]`, `y [M, N]`,
//! `dy [M, N]`, `dx [M, K]`, `dW [N, K]`, row-major; inputs f32 or BF16 ([`DeviceInput`]),
//! outputs f32; every GEMM accumulates in f32 on BF16 tensor cores (cuBLAS,
//! [`super::gemm::Gemm`]).
//!
//! # Operands
//! Quantization runs on the contract's device quantizers ([`CudaDevice::on_gpu`]: the same
//! kernels as `CudaDevice::quantize_device`, on this GPU's stream), so every stored byte equals
//! the CPU library's. The GEMMs multiply exact products:
//!
//! | format | forward operand (BF16) | after the f32 sum |
//! |---|---|---|
//! | BF16 | `bf16(x)`, `bf16(W)` | — |
//! | MXFP8 | `e4m3 × 2^(s−127)` (the contract dequantization, [`QGemm::dequant_weights_mxfp8`]) | — |
//! | NVFP4 | `e2m1 × e4m3(block scale)` ([`QGemm::dequant_weights_nvfp4`]) | `y = fl(α · acc)` per row ([`QGemm::nvfp4_scale_rows`]) |
//!
//! Backward, per [`BackwardMode`]:
//! - `Lowp` (MXFP8): dgrad `q_row(dy) · q_col(W)`, wgrad `q_col(dy)ᵀ · q_col(x)`; the
//!   column-wise copies (32×1 blocks along M, zero-padded to whole blocks like the CPU's
//!   `Padding::Zero`) are quantized from the high-precision tensors and dequantized to BF16 by
//!   `qlinear_dequant_mxfp8_col_bf16` (exact in the range below).
//! - `HighPrecision`: `bf16(dy) · bf16(W)`, `bf16(dy)ᵀ · bf16(x)`.
//! - `Dequantized`: `bf16(dy)` times the forward's operands dequantized by the contract:
//!   MXFP8's are the forward's BF16 operands themselves; NVFP4's contract dequantization
//!   `fl(e2m1 · fl(fl(sf · amax) · R2688))` has up to 24 significant bits, so it is split into
//!   three BF16 parts `v = hi + mid + lo` (`qlinear_nvfp4_dequant_split3`) and each GEMM runs
//!   three times into one f32 accumulator (cuBLAS β = 1): the products `dy · hi`, `dy · mid`,
//!   `dy · lo` are exact and add up to the CPU's f32 operand's products.
//!
//! # Where the products are exact
//! BF16 has f32's exponent range; its smallest subnormal is 2⁻¹³³.
//! - MXFP8: `e4m3 × 2^(s−127)` is a BF16 number for every scale byte `s ≥ 3` (a block amax
//!   above 448·2⁻¹²⁵ ≈ 1.05·10⁻³⁵). A block with a smaller scale has subnormal-E4M3 values
//!   below 2⁻¹³³·2⁸: the dequantizers round them to nearest-even BF16 (possibly to zero), the
//!   one place the device operand differs from the contract's f32 value.
//! - NVFP4: `e2m1 × e4m3` is always exact (≤ 2 × 4 significant bits, in `[2⁻¹⁰, 2688]`); α is
//!   applied after the sum as on the CPU. The three-part split of the `Dequantized` operands
//!   is exact for `|v| ≥ 2⁻¹¹⁰`; below, the last part is rounded (error ≤ 2⁻¹³⁴).
//! - Products of two exact BF16 operands are exact in f32 while they stay in f32's normal
//!   range; tensor cores may flush a product below 2⁻¹²⁶ (the CPU keeps it as a subnormal).
//!   Data whose block amaxes multiply to more than ~2⁻¹¹³ never get there.
//!
//! Inside that range only the f32 summation order differs from the CPU reference (bound
//! [`mxrl_tensor::tolerance::tensor_core_sum_bound`]; NVFP4 forward: `|α|` times it plus the
//! final rounding).
//!
//! # What is kept, and device memory
//! A [`QWeight`] holds the forward operand (the stored quantized bytes, quantized once per
//! weight version; BF16: the BF16 weight) and what the mode needs for backward: the
//! column-wise MXFP8 copy (`Lowp`), the BF16 weight (`HighPrecision`: the caller's BF16
//! parameter itself when `W` is BF16, no copy), or nothing (`Dequantized`). A [`QSaved`] holds
//! what the forward keeps of `x`: the column-wise MXFP8 copy (`Lowp`), `bf16(x)`
//! (`HighPrecision` and BF16: the caller's BF16 `x` itself when it is BF16), or the forward's
//! quantized `x` (`Dequantized`). The BF16 GEMM operands (dequantized `x`, `W`, `dy`) are
//! transient: made right before their GEMM and freed after it. This is what
//! `mxrl bench memory --device cuda` measures against `mxrl_tensor::qlinear::memory_model`.
//!
//! Deterministic: cuBLAS on one handle per stream without atomics, element-wise kernels.
#![allow(unsafe_code)]

use super::check_len;
use super::elementwise::Elementwise;
use super::gemm::{Gemm, Grouped};
use super::qgemm::{ActRows, QGemm};
use crate::cuda::{CudaDevice, DeviceInput, DeviceQuantized, InputView};
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg,
};
use mxrl_formats::{AmaxScope, Format, Scheme, MXFP8_BLOCK};
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
use std::sync::Arc;

/// Kernel source of this family (the module's name is `ops_qlinear`).
pub const SOURCE: &str = super::QLINEAR_SOURCE;

const THREADS: u32 = 256;
/// Grid cap of the grid-stride kernels (enough resident blocks for any H100/H200).
const MAX_BLOCKS: usize = 4096;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A BF16 tensor the layer keeps: the caller's BF16 buffer (shared, no copy) or one it made.
enum Bf16Kept {
    /// The caller's input; always [`DeviceInput::Bf16`] (checked where it is built).
    Shared(Arc<DeviceInput>),
    /// Rounded from an f32 input here.
    Owned(CudaSlice<u16>),
}

impl Bf16Kept {
    fn view(&self) -> CudaView<'_, u16> {
        match self {
            Bf16Kept::Shared(x) => match &**x {
                DeviceInput::Bf16(s) => s.as_view(),
                DeviceInput::F32(_) => unreachable!("Bf16Kept::Shared holds BF16 inputs only"),
            },
            Bf16Kept::Owned(s) => s.as_view(),
        }
    }

    /// Device bytes this layer allocated for it (0 for the caller's own buffer).
    fn owned_bytes(&self) -> usize {
        match self {
            Bf16Kept::Shared(_) => 0,
            Bf16Kept::Owned(s) => 2 * s.len(),
        }
    }
}

/// A transient BF16 operand: a BF16 input borrowed, or an f32 input rounded to BF16.
enum Bf16Op<'a> {
    Borrowed(&'a CudaSlice<u16>),
    Owned(CudaSlice<u16>),
}

impl Bf16Op<'_> {
    fn view(&self) -> CudaView<'_, u16> {
        match self {
            Bf16Op::Borrowed(s) => s.as_view(),
            Bf16Op::Owned(s) => s.as_view(),
        }
    }
}

fn quantized_bytes(q: &DeviceQuantized) -> usize {
    q.data.len() + q.scales.len() + 4 * q.amax_bits.as_ref().map_or(0, |a| a.len())
}

/// The forward operand of a weight.
enum WeightForward {
    /// BF16 format: `bf16(W)`.
    Bf16(Bf16Kept),
    /// The stored quantized weight ([`LinearSpec::weight_scheme`]), quantized once.
    Quantized(DeviceQuantized),
}

/// What a weight keeps for backward besides its forward operand.
enum WeightBackward {
    /// BF16 format (the forward operand is the BF16 weight) or `Dequantized` (the stored
    /// bytes are dequantized when backward needs them).
    Nothing,
    /// `Lowp`: the column-wise MXFP8 copy `[roundup(N, 32), K]`, from the high-precision `W`.
    ColumnWise(DeviceQuantized),
    /// `HighPrecision`: `bf16(W)`.
    Original(Bf16Kept),
}

/// A weight `W [N, K]` prepared for one linear on the device (quantized once per version);
/// the device twin of [`mxrl_tensor::qlinear::PreparedWeight`].
pub struct QWeight {
    name: String,
    spec: LinearSpec,
    n: usize,
    k: usize,
    version: u64,
    forward: WeightForward,
    backward: WeightBackward,
}

impl QWeight {
    /// Weight name (used in every error message).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The linear's numerics.
    pub fn spec(&self) -> LinearSpec {
        self.spec
    }
    /// Output features N.
    pub fn n(&self) -> usize {
        self.n
    }
    /// Input features K.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Weight version this was prepared from.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// The stored (forward, row-wise) quantized weight; `None` for BF16.
    pub fn stored(&self) -> Option<&DeviceQuantized> {
        match &self.forward {
            WeightForward::Quantized(q) => Some(q),
            WeightForward::Bf16(_) => None,
        }
    }
    /// The column-wise MXFP8 copy kept for a `Lowp` dgrad (`[roundup(N, 32), K]`).
    pub fn column_wise(&self) -> Option<&DeviceQuantized> {
        match &self.backward {
            WeightBackward::ColumnWise(q) => Some(q),
            _ => None,
        }
    }
    /// Device bytes this weight allocated only for backward: the column-wise MXFP8 copy
    /// (`Lowp`) or a BF16 rounding of an f32 weight (`HighPrecision`); 0 otherwise.
    pub fn backward_bytes(&self) -> usize {
        match &self.backward {
            WeightBackward::Nothing => 0,
            WeightBackward::ColumnWise(q) => quantized_bytes(q),
            WeightBackward::Original(b) => b.owned_bytes(),
        }
    }

    /// Device bytes this weight allocated: the forward operand (0 for a BF16 weight that is
    /// the caller's BF16 buffer) and the backward copy (column-wise MXFP8, or a BF16 rounding
    /// of an f32 weight).
    pub fn device_bytes(&self) -> usize {
        let f = match &self.forward {
            WeightForward::Bf16(b) => b.owned_bytes(),
            WeightForward::Quantized(q) => quantized_bytes(q),
        };
        f + self.backward_bytes()
    }
}

/// What the forward keeps of `x`.
enum Kept {
    /// `bf16(x)` (`HighPrecision`, and every BF16 linear).
    Original(Bf16Kept),
    /// The forward's quantized `x` (`Dequantized`).
    Forward(DeviceQuantized),
    /// Column-wise MXFP8 `x` `[roundup(M, 32), K]`, from the high-precision `x` (`Lowp`).
    ColumnWise(DeviceQuantized),
}

/// Context saved by [`QLinear::forward`] for [`QLinear::backward`] (consumed by it, so what it
/// keeps is freed when backward is done).
pub struct QSaved {
    m: usize,
    version: u64,
    kept: Kept,
}

impl QSaved {
    /// Tokens M of the forward call.
    pub fn m(&self) -> usize {
        self.m
    }
    /// The quantized `x` kept: the forward's (`Dequantized`) or the column-wise copy (`Lowp`).
    pub fn kept_quantized(&self) -> Option<&DeviceQuantized> {
        match &self.kept {
            Kept::Forward(q) | Kept::ColumnWise(q) => Some(q),
            Kept::Original(_) => None,
        }
    }
    /// Device bytes the context allocated (0 when it keeps the caller's BF16 `x` itself).
    pub fn kept_bytes(&self) -> usize {
        match &self.kept {
            Kept::Original(b) => b.owned_bytes(),
            Kept::Forward(q) | Kept::ColumnWise(q) => quantized_bytes(q),
        }
    }
}

/// Gradients of one linear on the device, f32.
pub struct QGrads {
    /// `dx [M, K]`.
    pub dx: CudaSlice<f32>,
    /// `dW [N, K]`.
    pub dw: CudaSlice<f32>,
}

/// The row segments (≤ 32 rows, never across a group) of the column-wise MXFP8 blocks of a
/// grouped tensor, on the device ([`QLinear::col_segments`]).
pub struct ColSegments {
    /// `[first row, rows]` per segment; `None` when there are none.
    seg: Option<CudaSlice<u32>>,
    count: usize,
    rows: usize,
}

/// A stack of NVFP4 weights quantized in one call ([`QLinear::quantize_nvfp4_stack`]).
pub struct Nvfp4Stack {
    /// Packed E2M1 codes `[experts·n, k/2]`.
    pub codes: CudaSlice<u8>,
    /// E4M3 block scales `[experts·n, k/16]`.
    pub scales: CudaSlice<u8>,
    /// One f32 amax (bit pattern) per weight.
    pub amax_bits: CudaSlice<u32>,
}

/// The quantized linear layer's kernels on one GPU: the contract quantizers on the engine's
/// stream, the BF16 GEMMs, the low-byte dequantizers and this family's operand kernels.
pub struct QLinear {
    gpu: Gpu,
    quant: CudaDevice,
    gemm: Gemm,
    qgemm: QGemm,
    elem: Elementwise,
    deq_col: CudaFunction,
    split3: CudaFunction,
    col_groups: CudaFunction,
    amax_groups: CudaFunction,
}

impl QLinear {
    /// Loads (compiling on first use) the modules on `gpu`.
    ///
    /// # Errors
    /// NVRTC (the low-byte dequantizers need sm_89+), module-load or cuBLAS errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_qlinear", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(QLinear {
            gpu: gpu.clone(),
            quant: CudaDevice::on_gpu(gpu)?,
            gemm: Gemm::new(gpu)?,
            qgemm: QGemm::new(gpu)?,
            elem: Elementwise::new(gpu)?,
            deq_col: f("qlinear_dequant_mxfp8_col_bf16")?,
            split3: f("qlinear_nvfp4_dequant_split3")?,
            col_groups: f("qlinear_mxfp8_col_segments_bf16")?,
            amax_groups: f("qlinear_amax_groups")?,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The contract quantizers this layer uses (on the GPU's stream).
    pub fn quantizer(&self) -> &CudaDevice {
        &self.quant
    }

    /// Prepare `w` (`[n, k]`, f32 or BF16, on this GPU) for `spec`, tagged with `version`:
    /// the forward operand (quantized with [`LinearSpec::weight_scheme`], or `bf16(W)`) and
    /// what the backward mode keeps (module doc). Reference
    /// [`mxrl_tensor::qlinear::PreparedWeight::quantize`].
    ///
    /// # Errors
    /// Shape errors (K not a multiple of the block; FP8 block: N too), driver errors; each
    /// names `name`. (FP8-block forward GEMMs run in `ops::fp8block`; this layer prepares an
    /// FP8-block weight for its `high_precision` backward.)
    pub fn prepare(
        &self,
        name: &str,
        w: &Arc<DeviceInput>,
        n: usize,
        k: usize,
        spec: LinearSpec,
        version: u64,
    ) -> Result<QWeight, DeviceError> {
        let ctx = |e: DeviceError| self.gpu.err(format!("linear `{name}`: {e}"));
        self.check_input(name, "weight", w, n, k)?;
        let forward = match spec.format() {
            Format::Bf16 => WeightForward::Bf16(self.bf16_kept(w).map_err(ctx)?),
            Format::Mxfp8 | Format::Nvfp4 | Format::Fp8Block => {
                let scheme = spec
                    .weight_scheme()
                    .expect("quantized formats have a scheme");
                WeightForward::Quantized(
                    self.quant.quantize_device(w, [n, k], scheme).map_err(ctx)?,
                )
            }
        };
        let backward = match (spec.format(), spec.backward()) {
            (Format::Bf16, _) | (_, BackwardMode::Dequantized) => WeightBackward::Nothing,
            (_, BackwardMode::HighPrecision) => {
                WeightBackward::Original(self.bf16_kept(w).map_err(ctx)?)
            }
            (_, BackwardMode::Lowp) => {
                WeightBackward::ColumnWise(self.quantize_col(w, n, k).map_err(ctx)?)
            }
        };
        Ok(QWeight {
            name: name.to_string(),
            spec,
            n,
            k,
            version,
            forward,
            backward,
        })
    }

    /// Forward without keeping anything for backward: `y [m, N] = x [m, K] · Wᵀ` (f32).
    /// Reference [`mxrl_tensor::qlinear::PreparedWeight::forward_inference`].
    ///
    /// # Errors
    /// Shape, quantizer or driver errors, naming the weight.
    pub fn forward_inference(
        &self,
        w: &QWeight,
        x: &DeviceInput,
        m: usize,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        self.check_input(&w.name, "input x", x, m, w.k)?;
        match &w.forward {
            WeightForward::Bf16(wb) => {
                let xb = self.bf16_op(x)?;
                self.gemm_nt(&xb.view(), &wb.view(), m, w.n, w.k)
            }
            WeightForward::Quantized(wq) => {
                let qx = self.quantize_x(w, x, m)?;
                self.quantized_gemm(&qx, wq)
            }
        }
    }

    /// Training forward: `y [m, N] = x [m, K] · Wᵀ` (f32) and the context the backward mode
    /// needs ([`QSaved`]). Reference [`mxrl_tensor::qlinear::PreparedWeight::forward`].
    ///
    /// # Errors
    /// Shape, quantizer or driver errors, naming the weight.
    pub fn forward(
        &self,
        w: &QWeight,
        x: &Arc<DeviceInput>,
        m: usize,
    ) -> Result<(CudaSlice<f32>, QSaved), DeviceError> {
        self.check_input(&w.name, "input x", x, m, w.k)?;
        let (y, kept) = match &w.forward {
            WeightForward::Bf16(wb) => {
                let xb = self.bf16_kept(x)?;
                let y = self.gemm_nt(&xb.view(), &wb.view(), m, w.n, w.k)?;
                (y, Kept::Original(xb))
            }
            WeightForward::Quantized(wq) => {
                let qx = self.quantize_x(w, x, m)?;
                match w.spec.backward() {
                    BackwardMode::Dequantized => {
                        let y = self.quantized_gemm(&qx, wq)?;
                        (y, Kept::Forward(qx))
                    }
                    BackwardMode::Lowp => {
                        // Quantized before the GEMM, as the forward's quantization step makes
                        // both copies; the row-wise x is freed after the GEMM.
                        let col = self.quantize_col(x, m, w.k)?;
                        let y = self.quantized_gemm(&qx, wq)?;
                        (y, Kept::ColumnWise(col))
                    }
                    BackwardMode::HighPrecision => {
                        let y = self.quantized_gemm(&qx, wq)?;
                        drop(qx);
                        (y, Kept::Original(self.bf16_kept(x)?))
                    }
                }
            }
        };
        Ok((
            y,
            QSaved {
                m,
                version: w.version,
                kept,
            },
        ))
    }

    /// What [`QLinear::forward`] keeps of `x` for backward, without computing `y` (a caller
    /// that ran the forward GEMM elsewhere on the same bytes): the same quantization of the
    /// same input, so the same context.
    ///
    /// # Errors
    /// Shape, quantizer or driver errors, naming the weight.
    pub fn save(&self, w: &QWeight, x: &Arc<DeviceInput>, m: usize) -> Result<QSaved, DeviceError> {
        self.check_input(&w.name, "input x", x, m, w.k)?;
        let kept = match (&w.forward, w.spec.backward()) {
            (WeightForward::Bf16(_), _) | (_, BackwardMode::HighPrecision) => {
                Kept::Original(self.bf16_kept(x)?)
            }
            (WeightForward::Quantized(_), BackwardMode::Dequantized) => {
                Kept::Forward(self.quantize_x(w, x, m)?)
            }
            (WeightForward::Quantized(_), BackwardMode::Lowp) => {
                Kept::ColumnWise(self.quantize_col(x, m, w.k)?)
            }
        };
        Ok(QSaved {
            m,
            version: w.version,
            kept,
        })
    }

    /// Backward of [`QLinear::forward`]: `dy [m, N]` (f32 or BF16) → `dx [m, K]`, `dW [N, K]`
    /// (f32), operands per the backward mode (module doc); consumes `saved`. Reference
    /// [`mxrl_tensor::qlinear::PreparedWeight::backward`].
    ///
    /// # Errors
    /// `saved` from another weight version, shape or driver errors, naming the weight.
    pub fn backward(
        &self,
        w: &QWeight,
        saved: QSaved,
        dy: &DeviceInput,
    ) -> Result<QGrads, DeviceError> {
        if saved.version != w.version {
            return Err(self.gpu.err(format!(
                "linear `{}`: backward with weight version {} but the forward used version {}",
                w.name, w.version, saved.version
            )));
        }
        let (m, n, k) = (saved.m, w.n, w.k);
        self.check_input(&w.name, "output gradient dy", dy, m, n)?;
        let inconsistent = || {
            self.gpu.err(format!(
                "linear `{}`: the saved context does not match the weight's backward mode {}",
                w.name,
                w.spec.backward()
            ))
        };
        match saved.kept {
            Kept::ColumnWise(x_col) => {
                let WeightBackward::ColumnWise(w_col) = &w.backward else {
                    return Err(inconsistent());
                };
                // dgrad: q_row(dy) [m, n] · q_col(W) [n, k] (the copy's padding rows unused).
                let dy_row = self.quant.quantize_device(dy, [m, n], Scheme::MXFP8_ROW)?;
                let dy_col = self.quantize_col(dy, m, n)?;
                let dyr = self.mxfp8_row_bf16(&dy_row)?;
                drop(dy_row);
                let wc = self.mxfp8_col_bf16(w_col)?;
                let mut dx = self.gpu.empty::<f32>(m * k)?;
                self.gemm.dense_nn(
                    &dyr.as_view(),
                    &wc.as_view(),
                    &mut dx.as_view_mut(),
                    m,
                    n,
                    k,
                )?;
                drop((dyr, wc));
                // wgrad: q_col(dy)ᵀ · q_col(x) over the m real rows (padding rows are zero).
                let dyc = self.mxfp8_col_bf16(&dy_col)?;
                drop(dy_col);
                let xc = self.mxfp8_col_bf16(&x_col)?;
                drop(x_col);
                let mut dw = self.gpu.zeros::<f32>(n * k)?;
                self.gemm.dense_tn(
                    &dyc.as_view(),
                    &xc.as_view(),
                    &mut dw.as_view_mut(),
                    m,
                    n,
                    k,
                )?;
                Ok(QGrads { dx, dw })
            }
            Kept::Original(xb) => {
                let wb = match (&w.backward, &w.forward) {
                    (WeightBackward::Original(b), _) => b,
                    (WeightBackward::Nothing, WeightForward::Bf16(b)) => b,
                    _ => return Err(inconsistent()),
                };
                let dyb = self.bf16_op(dy)?;
                let mut dx = self.gpu.empty::<f32>(m * k)?;
                self.gemm
                    .dense_nn(&dyb.view(), &wb.view(), &mut dx.as_view_mut(), m, n, k)?;
                let mut dw = self.gpu.zeros::<f32>(n * k)?;
                self.gemm
                    .dense_tn(&dyb.view(), &xb.view(), &mut dw.as_view_mut(), m, n, k)?;
                Ok(QGrads { dx, dw })
            }
            Kept::Forward(qx) => {
                let WeightForward::Quantized(wq) = &w.forward else {
                    return Err(inconsistent());
                };
                let dyb = self.bf16_op(dy)?;
                let mut dx = self.gpu.empty::<f32>(m * k)?;
                let mut dw = self.gpu.zeros::<f32>(n * k)?;
                match w.spec.format() {
                    Format::Mxfp8 => {
                        let wd = self.mxfp8_row_bf16(wq)?;
                        self.gemm.dense_nn(
                            &dyb.view(),
                            &wd.as_view(),
                            &mut dx.as_view_mut(),
                            m,
                            n,
                            k,
                        )?;
                        drop(wd);
                        let xd = self.mxfp8_row_bf16(&qx)?;
                        drop(qx);
                        self.gemm.dense_tn(
                            &dyb.view(),
                            &xd.as_view(),
                            &mut dw.as_view_mut(),
                            m,
                            n,
                            k,
                        )?;
                    }
                    _ => {
                        // NVFP4: three BF16 parts of the contract dequantization, summed into
                        // one f32 accumulator (β = 1 after the first GEMM).
                        let wp = self.nvfp4_split3(wq)?;
                        let nk = n * k;
                        for p in 0..3 {
                            let part = wp.slice(p * nk..(p + 1) * nk);
                            let mut out = dx.as_view_mut();
                            if p == 0 {
                                self.gemm.dense_nn(&dyb.view(), &part, &mut out, m, n, k)?;
                            } else {
                                self.gemm
                                    .dense_nn_acc(&dyb.view(), &part, &mut out, m, n, k)?;
                            }
                        }
                        drop(wp);
                        let xp = self.nvfp4_split3(&qx)?;
                        drop(qx);
                        let mk = m * k;
                        for p in 0..3 {
                            let part = xp.slice(p * mk..(p + 1) * mk);
                            self.gemm.dense_tn(
                                &dyb.view(),
                                &part,
                                &mut dw.as_view_mut(),
                                m,
                                n,
                                k,
                            )?;
                        }
                    }
                }
                Ok(QGrads { dx, dw })
            }
        }
    }

    // ---------------------------------------------------------------- helpers

    fn check_input(
        &self,
        name: &str,
        what: &str,
        x: &DeviceInput,
        rows: usize,
        cols: usize,
    ) -> Result<(), DeviceError> {
        let want = rows.checked_mul(cols).ok_or_else(|| {
            self.gpu.err(format!(
                "linear `{name}`: {what} [{rows}, {cols}] overflows"
            ))
        })?;
        let got = match x {
            DeviceInput::F32(s) => s.len(),
            DeviceInput::Bf16(s) => s.len(),
        };
        if got != want {
            return Err(self.gpu.err(format!(
                "linear `{name}`: {what} has {got} elements, expected {want} ([{rows}, {cols}])"
            )));
        }
        Ok(())
    }

    /// The forward's activation quantization ([`LinearSpec::activation_scheme`]).
    fn quantize_x(
        &self,
        w: &QWeight,
        x: &DeviceInput,
        m: usize,
    ) -> Result<DeviceQuantized, DeviceError> {
        let scheme = w
            .spec
            .activation_scheme()
            .expect("quantized formats have a scheme");
        self.quant
            .quantize_device(x, [m, w.k], scheme)
            .map_err(|e| self.gpu.err(format!("linear `{}`: {e}", w.name)))
    }

    /// Column-wise MXFP8 of `x [rows, cols]`, zero-padded along the rows to a multiple of 32
    /// (zero rows leave every block's amax, hence every byte, as the CPU's `Padding::Zero`).
    fn quantize_col(
        &self,
        x: &DeviceInput,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceQuantized, DeviceError> {
        let padded_rows = rows.next_multiple_of(MXFP8_BLOCK);
        if padded_rows == rows {
            return self
                .quant
                .quantize_device(x, [rows, cols], Scheme::MXFP8_COL);
        }
        let n = rows * cols;
        let stream = self.gpu.stream();
        let copy_err = |e| self.gpu.err(format!("padding copy: {e:?}"));
        let padded = match x {
            DeviceInput::F32(s) => {
                let mut p = self.gpu.zeros::<f32>(padded_rows * cols)?;
                stream
                    .memcpy_dtod(&s.slice(0..n), &mut p.slice_mut(0..n))
                    .map_err(copy_err)?;
                DeviceInput::F32(p)
            }
            DeviceInput::Bf16(s) => {
                let mut p = self.gpu.zeros::<u16>(padded_rows * cols)?;
                stream
                    .memcpy_dtod(&s.slice(0..n), &mut p.slice_mut(0..n))
                    .map_err(copy_err)?;
                DeviceInput::Bf16(p)
            }
        };
        self.quant
            .quantize_device(&padded, [padded_rows, cols], Scheme::MXFP8_COL)
    }

    /// `bf16(x)` to keep: the caller's buffer when it is BF16, else a rounded copy.
    fn bf16_kept(&self, x: &Arc<DeviceInput>) -> Result<Bf16Kept, DeviceError> {
        Ok(match &**x {
            DeviceInput::Bf16(_) => Bf16Kept::Shared(Arc::clone(x)),
            DeviceInput::F32(s) => Bf16Kept::Owned(self.round_bf16(s)?),
        })
    }

    /// `bf16(x)` as a transient operand.
    fn bf16_op<'a>(&self, x: &'a DeviceInput) -> Result<Bf16Op<'a>, DeviceError> {
        Ok(match x {
            DeviceInput::Bf16(s) => Bf16Op::Borrowed(s),
            DeviceInput::F32(s) => Bf16Op::Owned(self.round_bf16(s)?),
        })
    }

    fn round_bf16(&self, s: &CudaSlice<f32>) -> Result<CudaSlice<u16>, DeviceError> {
        let mut out = self.gpu.empty::<u16>(s.len())?;
        self.elem
            .to_bf16(&s.as_view(), &mut out.as_view_mut(), s.len())?;
        Ok(out)
    }

    /// `y [m, n] = a [m, k] · b [n, k]ᵀ` on BF16 operands into a new f32 buffer.
    fn gemm_nt(
        &self,
        a: &CudaView<'_, u16>,
        b: &CudaView<'_, u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        let mut y = self.gpu.empty::<f32>(m * n)?;
        self.gemm.dense_nt(a, b, &mut y.as_view_mut(), m, n, k)?;
        Ok(y)
    }

    /// The forward GEMM of a quantized activation and weight (module doc table).
    fn quantized_gemm(
        &self,
        qx: &DeviceQuantized,
        wq: &DeviceQuantized,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        let ([m, k], n) = (qx.shape, wq.shape[0]);
        match (qx.scheme, wq.scheme) {
            (Scheme::Mxfp8(_), Scheme::Mxfp8(_)) => {
                let xd = self.mxfp8_row_bf16(qx)?;
                let wd = self.mxfp8_row_bf16(wq)?;
                self.gemm_nt(&xd.as_view(), &wd.as_view(), m, n, k)
            }
            (Scheme::Nvfp4(sx), Scheme::Nvfp4(_)) => {
                let xp = self.nvfp4_pre(qx)?;
                let wp = self.nvfp4_pre(wq)?;
                let mut y = self.gemm_nt(&xp.as_view(), &wp.as_view(), m, n, k)?;
                drop((xp, wp));
                let (Some(xa), Some(wa)) = (&qx.amax_bits, &wq.amax_bits) else {
                    return Err(self.gpu.err("NVFP4 operand without its amax"));
                };
                // One α per row: per-token amax as it is, a per-tensor amax repeated.
                let repeated;
                let xa = match sx.amax {
                    AmaxScope::PerRow => xa,
                    AmaxScope::PerTensor => {
                        let a = self.gpu.download(&xa.slice(0..1))?;
                        repeated = self.gpu.upload(&vec![a[0]; m])?;
                        &repeated
                    }
                };
                check_len(&self.gpu, "NVFP4 x amax", xa.len(), m)?;
                check_len(&self.gpu, "NVFP4 W amax", wa.len(), 1)?;
                // SAFETY: u32 and f32 have one size and alignment; the views cover m and 1
                // entries of buffers that hold at least that many (checked above), and the
                // bits are f32 amax values (DeviceQuantized's contract).
                let (xa_f, wa_f) = unsafe { (xa.transmute::<f32>(m), wa.transmute::<f32>(1)) };
                let (Some(xa_f), Some(wa_f)) = (xa_f, wa_f) else {
                    return Err(self.gpu.err("NVFP4 amax views"));
                };
                let offsets = self.gpu.upload(&[0u32, m as u32])?;
                self.qgemm.nvfp4_scale_rows(
                    &mut y.as_view_mut(),
                    &xa_f,
                    &wa_f,
                    &offsets.as_view(),
                    Grouped {
                        experts: 1,
                        rows: m,
                        n,
                        k,
                    },
                )?;
                Ok(y)
            }
            (a, b) => Err(self.gpu.err(format!(
                "quantized linear GEMM of {} and {} operands",
                a.name(),
                b.name()
            ))),
        }
    }

    /// Row-wise MXFP8 `[r, c]` → BF16 contract dequantization.
    fn mxfp8_row_bf16(&self, q: &DeviceQuantized) -> Result<CudaSlice<u16>, DeviceError> {
        let [r, c] = q.shape;
        let mut out = self.gpu.empty::<u16>(r * c)?;
        self.qgemm.dequant_weights_mxfp8(
            &q.data.as_view(),
            &q.scales.as_view(),
            &mut out.as_view_mut(),
            1,
            r,
            c,
        )?;
        Ok(out)
    }

    /// NVFP4 `[r, c]` → `e2m1 · e4m3(scale)` in BF16 (α not applied).
    fn nvfp4_pre(&self, q: &DeviceQuantized) -> Result<CudaSlice<u16>, DeviceError> {
        let [r, c] = q.shape;
        let mut out = self.gpu.empty::<u16>(r * c)?;
        self.qgemm.dequant_weights_nvfp4(
            &q.data.as_view(),
            &q.scales.as_view(),
            &mut out.as_view_mut(),
            1,
            r,
            c,
        )?;
        Ok(out)
    }

    /// Column-wise MXFP8 `[r, c]` (scales `[r/32, c]`) → BF16 contract dequantization
    /// (`qlinear_dequant_mxfp8_col_bf16`).
    fn mxfp8_col_bf16(&self, q: &DeviceQuantized) -> Result<CudaSlice<u16>, DeviceError> {
        let g = &self.gpu;
        let [r, c] = q.shape;
        if q.scheme != Scheme::MXFP8_COL || !r.is_multiple_of(MXFP8_BLOCK) {
            return Err(g.err(format!(
                "column-wise dequantize of a {} {:?} tensor",
                q.scheme.name(),
                q.shape
            )));
        }
        let n = r * c;
        check_len(g, "column-wise codes", q.data.len(), n)?;
        check_len(g, "column-wise scales", q.scales.len(), n / MXFP8_BLOCK)?;
        let mut out = g.empty::<u16>(n)?;
        if n > 0 {
            let (n64, c64) = (n as u64, c as u64);
            let mut b = g.stream().launch_builder(&self.deq_col);
            b.arg(&q.data)
                .arg(&q.scales)
                .arg(&mut out)
                .arg(&n64)
                .arg(&c64);
            // SAFETY: grid-stride over i < n = r·c: reads codes[i] (n held, checked) and
            // scales[(i / c / 32)·c + i % c] < (r/32)·c = n/32 (held, checked; r % 32 == 0),
            // writes out[i] (n held). Argument types match (const u8*, const u8*, u16*, u64,
            // u64).
            unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| g.err(e))?;
        }
        Ok(out)
    }

    /// NVFP4 `[r, c]` → the contract dequantization split into three BF16 parts, stored as
    /// `[3, r, c]` (`qlinear_nvfp4_dequant_split3`).
    fn nvfp4_split3(&self, q: &DeviceQuantized) -> Result<CudaSlice<u16>, DeviceError> {
        let g = &self.gpu;
        let [r, c] = q.shape;
        let Scheme::Nvfp4(s) = q.scheme else {
            return Err(g.err(format!("NVFP4 split of a {} tensor", q.scheme.name())));
        };
        let Some(amax) = &q.amax_bits else {
            return Err(g.err("NVFP4 tensor without its amax"));
        };
        let rows_per_amax = if s.amax == AmaxScope::PerRow {
            1
        } else {
            r.max(1)
        };
        self.nvfp4_split3_rows(
            &q.data.as_view(),
            &q.scales.as_view(),
            &amax.as_view(),
            r,
            c,
            rows_per_amax,
        )
    }

    /// NVFP4 codes `[rows, cols/2]` and E4M3 scales `[rows, cols/16]` with one f32 amax (as
    /// bits) per `rows_per_amax` rows (1: per row; the rows of one weight: a stack of weights
    /// with one amax each; `rows`: one per-tensor amax) → the contract dequantization split
    /// into three BF16 parts, `[3, rows, cols]` (`qlinear_nvfp4_dequant_split3`; exact for
    /// `|v| ≥ 2⁻¹¹⁰`, module doc).
    ///
    /// # Errors
    /// Columns not whole 16-blocks, `rows_per_amax` 0, short buffers; driver errors.
    pub fn nvfp4_split3_rows(
        &self,
        data: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        amax_bits: &CudaView<'_, u32>,
        rows: usize,
        cols: usize,
        rows_per_amax: usize,
    ) -> Result<CudaSlice<u16>, DeviceError> {
        let g = &self.gpu;
        if !cols.is_multiple_of(mxrl_formats::NVFP4_BLOCK) {
            return Err(g.err(format!(
                "NVFP4 split: {cols} columns are not whole 16-blocks"
            )));
        }
        if rows_per_amax == 0 {
            return Err(g.err("NVFP4 split: 0 rows per amax"));
        }
        let n = rows * cols;
        check_len(g, "NVFP4 codes", data.len(), n / 2)?;
        check_len(
            g,
            "NVFP4 scales",
            scales.len(),
            n / mxrl_formats::NVFP4_BLOCK,
        )?;
        check_len(
            g,
            "NVFP4 amax",
            amax_bits.len(),
            rows.div_ceil(rows_per_amax).max(1),
        )?;
        let mut out = g.empty::<u16>(3 * n)?;
        if n > 0 {
            let (n64, c64, rpa) = (n as u64, cols as u64, rows_per_amax as u64);
            let mut b = g.stream().launch_builder(&self.split3);
            b.arg(data)
                .arg(scales)
                .arg(amax_bits)
                .arg(&mut out)
                .arg(&n64)
                .arg(&c64)
                .arg(&rpa);
            // SAFETY: grid-stride over i < n = rows·cols: reads data[i/2] (n/2 held),
            // scales[i/16] (n/16 held), amax_bits[(i/cols)/rows_per_amax] <
            // ⌈rows/rows_per_amax⌉ (held, checked; rows_per_amax ≥ 1); writes out[i],
            // out[n + i], out[2n + i] (3n held). Argument types match (const u8*, const u8*,
            // const u32*, u16*, u64, u64, u64).
            unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| g.err(e))?;
        }
        Ok(out)
    }

    /// NVFP4 of a stack of `experts` weights `[n, k]` (f32), each quantized as its own tensor
    /// (one per-tensor amax each, the weight scheme's bytes) in three
    /// launches for the whole stack: the amax of every row, the largest per weight
    /// (`qlinear_amax_groups`), then the blocks with one amax per weight (a weight's `n·k`
    /// elements are one row of the `[experts, n·k]` view, so its blocks read its amax).
    /// Returns codes `[experts·n, k/2]`, scales `[experts·n, k/16]` and the `experts` amax
    /// values as f32 bits.
    ///
    /// # Errors
    /// `k` not whole 16-blocks, short input; driver errors.
    pub fn quantize_nvfp4_stack(
        &self,
        w: &CudaView<'_, f32>,
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<Nvfp4Stack, DeviceError> {
        let g = &self.gpu;
        let rows = experts * n;
        check_len(g, "NVFP4 weight stack", w.len(), rows * k)?;
        let w = InputView::F32(w.slice(0..rows * k));
        let row_bits = self.quant.amax(&w, [rows, k], AmaxScope::PerRow)?;
        let mut bits = g.empty::<u32>(experts.max(1))?;
        if experts > 0 {
            let rpg = n as u64;
            let mut b = g.stream().launch_builder(&self.amax_groups);
            b.arg(&row_bits).arg(&mut bits).arg(&rpg);
            // SAFETY: CTA g < experts reads row_bits[g·n..(g+1)·n) (rows = experts·n held:
            // the per-row amax of [rows, k]) and writes bits[g] (experts held); 256 threads
            // = the kernel's 8 warp slots. Argument types match (const u32*, u32*, u64).
            unsafe {
                crate::gpu::launch_op(
                    &mut b,
                    LaunchConfig {
                        grid_dim: (experts as u32, 1, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            }
            .map_err(|e| g.err(e))?;
        }
        self.nvfp4_stack_with_amax(&w, experts, n, k, bits)
    }

    /// The blocks of [`QLinear::quantize_nvfp4_stack`] given each weight's amax (`bits`, f32
    /// bit patterns, one per weight: e.g. found by the optimizer pass that wrote `w`,
    /// `QGemm::adamw_amax_groups`): one launch.
    ///
    /// # Errors
    /// `k` not whole 16-blocks, short input or amax; driver errors.
    pub fn nvfp4_stack_with_amax(
        &self,
        w: &InputView<'_>,
        experts: usize,
        n: usize,
        k: usize,
        bits: CudaSlice<u32>,
    ) -> Result<Nvfp4Stack, DeviceError> {
        let g = &self.gpu;
        check_len(g, "NVFP4 weight stack amax", bits.len(), experts)?;
        let q = self
            .quant
            .nvfp4_with_amax(w, [experts, n * k], AmaxScope::PerRow, bits)?;
        let bits = q
            .amax_bits
            .ok_or_else(|| g.err("NVFP4 quantizer returned no amax"))?;
        Ok(Nvfp4Stack {
            codes: q.data,
            scales: q.scales,
            amax_bits: bits,
        })
    }

    /// The row segments of the column-wise MXFP8 blocks of a grouped tensor of `rows` rows:
    /// group `g` holds rows `offsets[g]..offsets[g+1]` and is quantized as its own tensor
    /// (32×1 blocks from its first row, the last one zero-padded as the CPU's
    /// `Padding::Zero`), uploaded once for every tensor of that grouping
    /// ([`QLinear::mxfp8_col_groups_bf16`]).
    ///
    /// # Errors
    /// Offsets that decrease or pass `rows`; driver errors.
    pub fn col_segments(&self, offsets: &[u32], rows: usize) -> Result<ColSegments, DeviceError> {
        let g = &self.gpu;
        let mut seg = Vec::with_capacity(2 * (rows / MXFP8_BLOCK + offsets.len()));
        for w in offsets.windows(2) {
            let (a, b) = (w[0] as usize, w[1] as usize);
            if a > b || b > rows {
                return Err(g.err(format!(
                    "column-wise groups: rows {a}..{b} outside 0..{rows}"
                )));
            }
            for r in (a..b).step_by(MXFP8_BLOCK) {
                seg.push(r as u32);
                seg.push((b - r).min(MXFP8_BLOCK) as u32);
            }
        }
        let count = seg.len() / 2;
        Ok(ColSegments {
            seg: if count > 0 {
                Some(g.upload(&seg)?)
            } else {
                None
            },
            count,
            rows,
        })
    }

    /// Column-wise MXFP8 of `x [rows, cols]` (f32) in the groups of `segs`, each group its own
    /// tensor, dequantized by the contract into BF16 `[rows, cols]`
    /// (`qlinear_mxfp8_col_segments_bf16`; exact for scale bytes ≥ 3): what the `Lowp`
    /// backward multiplies for every expert of a grouped linear in one launch. Rows outside
    /// every group are left unspecified.
    ///
    /// # Errors
    /// Short input; driver errors.
    pub fn mxfp8_col_groups_bf16(
        &self,
        x: &CudaView<'_, f32>,
        segs: &ColSegments,
        cols: usize,
    ) -> Result<CudaSlice<u16>, DeviceError> {
        let g = &self.gpu;
        let n = segs.rows * cols;
        check_len(g, "column-wise input", x.len(), n)?;
        let mut out = g.empty::<u16>(n)?;
        if Self::rowcol_fits(cols) && x.device_ptr(g.stream()).0 % 16 == 0 {
            self.rowcol_launch(&ActRows::Rows(x), segs, cols, &mut out.as_view_mut(), None)?;
            return Ok(out);
        }
        if let (Some(seg), true) = (&segs.seg, cols > 0) {
            let (s64, c64) = (segs.count as u64, cols as u64);
            let mut b = g.stream().launch_builder(&self.col_groups);
            b.arg(x).arg(seg).arg(&mut out).arg(&s64).arg(&c64);
            // SAFETY: grid-stride over t < count·cols: reads seg[2j], seg[2j+1] (2·count held)
            // and x / writes out at (r0 + i)·cols + c for i < len, where every segment lies in
            // 0..rows (built by col_segments from offsets checked against rows), so < rows·cols
            // = n (x holds n, checked; out n). Argument types match (const float*, const u32*,
            // u16*, u64, u64).
            unsafe { crate::gpu::launch_op(&mut b, grid(segs.count * cols)) }
                .map_err(|e| g.err(e))?;
        }
        Ok(out)
    }

    /// Whether [`QLinear::mxfp8_rowcol_groups_bf16`] takes tensors of `cols` columns (tiles of
    /// 64 columns; [`QLinear::mxfp8_col_groups_bf16`] runs on the same kernels then).
    pub fn rowcol_fits(cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(64)
    }

    /// [`QLinear::mxfp8_col_groups_bf16`] of the rows `src` names (`segs.rows` of `cols`:
    /// `x` itself, gathered token rows, or SwiGLU of a gate/up output), returned, and from the
    /// same read their row-wise MXFP8 (1×32 blocks along the columns) dequantized into BF16 in
    /// `row_out [rows, cols]` for the rows of the groups: the values
    /// [`QGemm::quant_act_mxfp8`] writes there (rows outside every group are left as they
    /// were). The two operands the `Lowp` backward multiplies of one tensor: `dy`'s (dgrad and
    /// wgrad), or the forward's row-wise operand of `x` with the column-wise copy its wgrad
    /// takes. One launch (`quant_act_mxfp8_rowcol{,_gather,_swiglu}`).
    ///
    /// # Errors
    /// `cols` not a multiple of 64 ([`QLinear::rowcol_fits`]), short or misaligned buffers
    /// (16-byte), driver errors.
    pub fn mxfp8_rowcol_groups_bf16(
        &self,
        src: &ActRows<'_, '_>,
        segs: &ColSegments,
        cols: usize,
        row_out: &mut CudaViewMut<'_, u16>,
    ) -> Result<CudaSlice<u16>, DeviceError> {
        let g = &self.gpu;
        if !Self::rowcol_fits(cols) {
            return Err(g.err(format!(
                "mxfp8_rowcol_groups_bf16: {cols} columns, a multiple of 64 needed"
            )));
        }
        let mut out = g.empty::<u16>(segs.rows * cols)?;
        self.rowcol_launch(src, segs, cols, &mut out.as_view_mut(), Some(row_out))?;
        Ok(out)
    }

    /// [`QGemm::quant_act_mxfp8_rowcol`] over `segs` (segments that lie in `0..segs.rows`, as
    /// [`QLinear::col_segments`] builds them).
    fn rowcol_launch(
        &self,
        src: &ActRows<'_, '_>,
        segs: &ColSegments,
        cols: usize,
        col_out: &mut CudaViewMut<'_, u16>,
        row_out: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<(), DeviceError> {
        let Some(seg) = &segs.seg else {
            return Ok(());
        };
        self.qgemm.quant_act_mxfp8_rowcol(
            src,
            segs.rows,
            cols,
            &seg.as_view(),
            segs.count,
            col_out,
            row_out,
        )
    }
}
