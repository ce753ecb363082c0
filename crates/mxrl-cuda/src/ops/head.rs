//! The lm_head fused with log-softmax, per-token logprob and entropy, computed in vocabulary
//! chunks so that the `[T, V]` f32 logits are never materialised (kernels `kernels/ops_head.cu`),
//! its backward, and the plain full-logits GEMM of decode.
//!
//! # Numerics
//! Each chunk's logits `z [T, C] = h · W[c0..c0+C]ᵀ` come from one cuBLAS `GemmEx` with BF16
//! operands (`h`, `W` as bit patterns), f32 output and `CUBLAS_COMPUTE_32F` (f32 accumulation;
//! products of BF16 values are exact in f32). The softmax statistics are f32 with the
//! temperature applied as `y = z·(1/τ)` exactly as `mxrl_tensor::loss` does; the per-chunk
//! max / Σexp / Σexp·(y−m) are combined across chunks by rescaling (online softmax). The
//! backward recomputes each chunk's logits, forms `dz` as `mxrl_tensor::loss::logprobs_backward`
//! does and accumulates `dh += dz · W[chunk]` and `dW[chunk] += dzᵀ · h` by f32 GEMMs
//! (`CUBLAS_COMPUTE_32F_PEDANTIC`: f32 products, no TF32) on f32 copies of the BF16 operands.
//!
//! # Determinism
//! Fixed chunk order, fixed block reduction trees, no atomics; one cuBLAS handle on the
//! engine's stream in its default (non-atomic) mode: equal inputs and shapes give equal bits.
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use std::ffi::c_void;

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_head.cu");

const THREADS: u32 = 256;
/// Default vocabulary chunk (columns per GEMM + softmax pass).
pub const DEFAULT_CHUNK: usize = 8192;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Element type of a GEMM operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dt {
    /// BF16 bit patterns (`u16`).
    Bf16,
    /// f32.
    F32,
}

/// One row-major GEMM operand: a device address, its element type and its element count.
struct Operand {
    ptr: u64,
    dt: Dt,
    len: usize,
}

/// The private GEMM helper of this family: row-major GEMMs through `cublasGemmEx` on the
/// engine's stream (BF16 × BF16 → f32 with `CUBLAS_COMPUTE_32F`; f32 × f32 → f32 with
/// `CUBLAS_COMPUTE_32F_PEDANTIC`).
struct Blas {
    gpu: Gpu,
    blas: CudaBlas,
}

/// Layout of a row-major product `C [m, n] (β·C +) = op(A) · op(B)`.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// `A [m, k] · B [n, k]ᵀ`.
    Nt,
    /// `A [m, k] · B [k, n]`.
    Nn,
    /// `A [k, m]ᵀ · B [k, n]`.
    Tn,
}

impl Blas {
    fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        // SAFETY: only asks whether the cuBLAS library can be found.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(gpu.err("the cuBLAS library (libcublas) cannot be loaded"));
        }
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| gpu.err(format!("{e:?}")))?;
        Ok(Blas {
            gpu: gpu.clone(),
            blas,
        })
    }

    /// Row-major `C [m, n] = β·C + op(A)·op(B)` (see [`Layout`]); `A` and `B` of one type.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        layout: Layout,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        beta: f32,
        c: u64,
        c_len: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if a.dt != b.dt {
            return Err(g.err("gemm: operands of different types"));
        }
        if a.len < m * k || b.len < n * k || c_len < m * n {
            return Err(g.err(format!(
                "gemm {layout:?} m {m} n {n} k {k}: operand lengths {} / {} / {c_len}",
                a.len, b.len
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return Err(g.err("gemm with k = 0 (callers handle empty sums)"));
        }
        let dim = |v: usize| i32::try_from(v).map_err(|_| g.err(format!("dimension {v} > i32")));
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        // Row-major C [m, n] is column-major Cᵀ [n, m] = op(B)ᵀ · op(A)ᵀ: cuBLAS's first
        // operand is B, its second A. Each tuple: (op of B, op of A, ld of B, ld of A).
        let (op_b, op_a, ld_b, ld_a) = match layout {
            // Cᵀ = B · Aᵀ: B [n, k] row-major is column-major [k, n] (ld k) → transposed;
            // A [m, k] row-major is column-major [k, m] (ld k) as needed.
            Layout::Nt => (T, N, k, k),
            // Cᵀ = Bᵀ · Aᵀ: B [k, n] row-major is column-major [n, k] (ld n) as needed;
            // A [m, k] row-major is column-major [k, m] (ld k) as needed.
            Layout::Nn => (N, N, n, k),
            // Cᵀ = Bᵀ · A: B as in Nn (ld n); A [k, m] row-major is column-major [m, k]
            // (ld m) → transposed.
            Layout::Tn => (N, T, n, m),
        };
        let (dt, compute) = match a.dt {
            Dt::Bf16 => (
                blas_sys::cudaDataType::CUDA_R_16BF,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            Dt::F32 => (
                blas_sys::cudaDataType::CUDA_R_32F,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            ),
        };
        let alpha = 1.0f32;
        // cuBLAS runs on the calling thread's current context: make it this GPU's.
        g.ctx()
            .bind_to_thread()
            .map_err(|e| g.err(format!("bind context: {e:?}")))?;
        // SAFETY: B (the first cuBLAS operand) holds ≥ n·k elements and A ≥ m·k of type `dt`
        // (checked above), read with the leading dimensions of their row-major shapes; C holds
        // ≥ m·n f32 written as column-major [n, m] with ld n. All live on the handle's stream;
        // the callers pass C from an exclusive borrow, so it aliases neither input. α, β are f32
        // as the 32F compute types require.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                op_b,
                op_a,
                dim(n)?,
                dim(m)?,
                dim(k)?,
                &alpha as *const f32 as *const c_void,
                b.ptr as *const c_void,
                dt,
                dim(ld_b)?,
                a.ptr as *const c_void,
                dt,
                dim(ld_a)?,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                dim(n)?,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| g.err(format!("cublasGemmEx {layout:?} m {m} n {n} k {k}: {e:?}")))
    }
}

/// Shapes of a head call: `t` tokens, hidden `h`, vocabulary `v`, chunk `chunk` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    /// Tokens (rows of `h`).
    pub t: usize,
    /// Hidden size.
    pub h: usize,
    /// Vocabulary size (rows of `W_head`).
    pub v: usize,
    /// Vocabulary columns per chunk (≥ 1; [`DEFAULT_CHUNK`] is a sensible choice).
    pub chunk: usize,
}

/// Outputs of [`Head::forward`], each `[t]` f32.
pub struct HeadOutputs<'a, 'b, 'c> {
    /// `logprob[t] = z[t, target]/τ − lse[t]`.
    pub logprob: &'a mut CudaViewMut<'b, f32>,
    /// `lse[t] = logsumexp(z[t, :]/τ)` (saved for the backward).
    pub lse: &'a mut CudaViewMut<'c, f32>,
    /// Entropy of `softmax(z[t, :]/τ)`.
    pub entropy: &'a mut CudaViewMut<'c, f32>,
}

/// How the backward's two GEMMs (`dz · W`, `dzᵀ · h`) multiply the f32 `dz` by the BF16
/// operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeadGradGemm {
    /// f32 GEMMs (`CUBLAS_COMPUTE_32F_PEDANTIC`) on f32 copies of the BF16 operands: f32
    /// products, f32 accumulation, CUDA cores.
    #[default]
    F32,
    /// `dz` split into three BF16 parts (`dz = hi + mid + lo` to within `2⁻²⁴·|dz|`), each
    /// multiplied on BF16 tensor cores with f32 accumulation (products exact) and summed into
    /// the same f32 output: the f32 result to within the split's residual and a sum three
    /// times as long, at three BF16 GEMMs' cost instead of two f32 ones.
    Bf16x3,
}

/// The loaded kernels and the family's cuBLAS handle.
pub struct Head {
    gpu: Gpu,
    blas: Blas,
    grad_gemm: HeadGradGemm,
    init: CudaFunction,
    chunk_fwd: CudaFunction,
    finish: CudaFunction,
    chunk_bwd: CudaFunction,
    to_f32: CudaFunction,
    split3: CudaFunction,
}

impl Head {
    /// Loads (compiling on first use) the module on `gpu` and creates the cuBLAS handle.
    ///
    /// # Errors
    /// NVRTC, module-load or cuBLAS errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_head", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Head {
            gpu: gpu.clone(),
            blas: Blas::new(gpu)?,
            grad_gemm: HeadGradGemm::default(),
            init: f("head_init")?,
            chunk_fwd: f("head_chunk_fwd")?,
            finish: f("head_finish")?,
            chunk_bwd: f("head_chunk_bwd")?,
            to_f32: f("head_bf16_to_f32")?,
            split3: f("head_split_bf16x3")?,
        })
    }

    /// The same kernels with the backward's GEMMs done as `mode` says.
    pub fn with_grad_gemm(mut self, mode: HeadGradGemm) -> Self {
        self.grad_gemm = mode;
        self
    }

    /// How the backward's GEMMs multiply.
    pub fn grad_gemm(&self) -> HeadGradGemm {
        self.grad_gemm
    }

    fn check_shape(&self, s: &HeadShape) -> Result<(), DeviceError> {
        if s.chunk == 0 || s.h == 0 || s.v == 0 {
            return Err(self.gpu.err(format!(
                "head: hidden {}, vocabulary {} and chunk {} must be ≥ 1",
                s.h, s.v, s.chunk
            )));
        }
        if s.t > i32::MAX as usize {
            return Err(self
                .gpu
                .err(format!("head: {} tokens exceed one launch", s.t)));
        }
        Ok(())
    }

    /// Full logits `z [rows, v] = h [rows, hd] · W [v, hd]ᵀ` (BF16 operands, f32 output and
    /// accumulation): the decode path feeding sampling. Reference: `mxrl_tensor::gemm::matmul_nt`
    /// on the BF16 values.
    ///
    /// # Errors
    /// Short buffers; cuBLAS errors.
    pub fn logits(
        &self,
        h_bf16: &CudaView<'_, u16>,
        w_bf16: &CudaView<'_, u16>,
        z: &mut CudaViewMut<'_, f32>,
        rows: usize,
        hd: usize,
        v: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "logits h", h_bf16.len(), rows * hd)?;
        check_len(&self.gpu, "logits W", w_bf16.len(), v * hd)?;
        check_len(&self.gpu, "logits z", z.len(), rows * v)?;
        if rows == 0 || v == 0 {
            return Ok(());
        }
        if hd == 0 {
            return self
                .gpu
                .stream()
                .memset_zeros(z)
                .map_err(|e| self.gpu.err(e));
        }
        let s = self.gpu.stream();
        let (hp, _g1) = h_bf16.device_ptr(s);
        let (wp, _g2) = w_bf16.device_ptr(s);
        let zl = z.len();
        let (zp, _g3) = z.device_ptr_mut(s);
        self.blas.gemm(
            Layout::Nt,
            rows,
            v,
            hd,
            Operand {
                ptr: hp,
                dt: Dt::Bf16,
                len: h_bf16.len(),
            },
            Operand {
                ptr: wp,
                dt: Dt::Bf16,
                len: w_bf16.len(),
            },
            0.0,
            zp,
            zl,
        )
    }

    /// Chunked forward: per token `r < t`, with `y = z/τ`, `z = h · Wᵀ` (never stored whole),
    /// writes `logprob[r] = y[r, targets[r]] − lse[r]`, `lse[r] = logsumexp(y[r, :])` and the
    /// entropy of `softmax(y[r, :])`.
    ///
    /// Shapes and dtypes: `h_bf16 [t, h]`, `w_bf16 [v, h]` (BF16 bit patterns), `targets [t]`
    /// (each `< v`, validated by the caller on the host, where the ids come from; an
    /// out-of-range id gives a NaN logprob), outputs `[t]` f32. Accumulation: f32 (GEMM and
    /// softmax statistics). References: `mxrl_tensor::loss::logprobs_forward` on
    /// `matmul_nt(h, W)` and `mxrl_rl::sampling::entropy`.
    ///
    /// # Errors
    /// Zero sizes, short buffers, out of device memory (the `[t, chunk]` scratch), launch or
    /// cuBLAS errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        h_bf16: &CudaView<'_, u16>,
        w_bf16: &CudaView<'_, u16>,
        targets: &CudaView<'_, u32>,
        temperature: f32,
        shape: HeadShape,
        out: HeadOutputs<'_, '_, '_>,
    ) -> Result<(), DeviceError> {
        let HeadShape { t, h, v, chunk } = shape;
        self.check_shape(&shape)?;
        let g = &self.gpu;
        if temperature.is_nan() || temperature <= 0.0 {
            return Err(g.err(format!("head: temperature {temperature} must be > 0")));
        }
        check_len(g, "head h", h_bf16.len(), t * h)?;
        check_len(g, "head W", w_bf16.len(), v * h)?;
        check_len(g, "head targets", targets.len(), t)?;
        check_len(g, "head logprob", out.logprob.len(), t)?;
        check_len(g, "head lse", out.lse.len(), t)?;
        check_len(g, "head entropy", out.entropy.len(), t)?;
        if t == 0 {
            return Ok(());
        }
        let inv_t = 1.0f32 / temperature;
        let chunk = chunk.min(v);
        let mut st: CudaSlice<f32> = g.zeros(4 * t)?;
        let mut z: CudaSlice<f32> = g.zeros(t * chunk)?;
        let t64 = t as u64;
        {
            let mut b = g.stream().launch_builder(&self.init);
            b.arg(&mut st).arg(&t64);
            // SAFETY: thread r < t writes st[r + i·t], i < 4; st holds 4·t floats.
            unsafe { crate::gpu::launch_op(&mut b, grid(t)) }.map_err(|e| g.err(e))?;
        }
        let mut c0 = 0usize;
        while c0 < v {
            let cols = chunk.min(v - c0);
            let wc = w_bf16.slice(c0 * h..(c0 + cols) * h);
            {
                let s = g.stream();
                let (hp, _g1) = h_bf16.device_ptr(s);
                let (wp, _g2) = wc.device_ptr(s);
                let zl = z.len();
                let (zp, _g3) = z.device_ptr_mut(s);
                self.blas.gemm(
                    Layout::Nt,
                    t,
                    cols,
                    h,
                    Operand {
                        ptr: hp,
                        dt: Dt::Bf16,
                        len: h_bf16.len(),
                    },
                    Operand {
                        ptr: wp,
                        dt: Dt::Bf16,
                        len: wc.len(),
                    },
                    0.0,
                    zp,
                    zl,
                )?;
            }
            let (cols64, c064) = (cols as u64, c0 as u64);
            let cfg = LaunchConfig {
                grid_dim: (t as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&self.chunk_fwd);
            b.arg(&z)
                .arg(&cols64)
                .arg(&c064)
                .arg(targets)
                .arg(&inv_t)
                .arg(&mut st)
                .arg(&t64);
            // SAFETY: block r < t reads z[r·cols .. (r+1)·cols) (z holds t·chunk ≥ t·cols),
            // targets[r] (≥ t checked), and reads/writes st[r + i·t], i < 4 (4·t held); the
            // target column is read only when it lies in [c0, c0 + cols).
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            c0 += cols;
        }
        let mut b = g.stream().launch_builder(&self.finish);
        b.arg(&st)
            .arg(&mut *out.logprob)
            .arg(&mut *out.lse)
            .arg(&mut *out.entropy)
            .arg(&t64);
        // SAFETY: thread r < t reads st[r + i·t] (4·t held) and writes element r of the three
        // outputs (each ≥ t, checked).
        unsafe { crate::gpu::launch_op(&mut b, grid(t)) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    fn bf16_to_f32(
        &self,
        x: &CudaView<'_, u16>,
        out: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "bf16→f32 in", x.len(), n)?;
        check_len(&self.gpu, "bf16→f32 out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.gpu.stream().launch_builder(&self.to_f32);
        b.arg(x).arg(out).arg(&n64);
        // SAFETY: grid-stride over i < n: reads x[i], writes out[i]; both hold ≥ n (checked).
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Splits `x[0..n)` into three BF16 parts at `parts[i·stride ..]`, `i < 3`.
    fn split_bf16x3(
        &self,
        x: &CudaSlice<f32>,
        parts: &mut CudaSlice<u16>,
        n: usize,
        stride: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "split in", x.len(), n)?;
        check_len(&self.gpu, "split parts", parts.len(), 3 * stride)?;
        if n == 0 {
            return Ok(());
        }
        if n > stride {
            return Err(self.gpu.err("split: part stride below the length"));
        }
        let n64 = n as u64;
        let (mut a, mut rest) = parts.split_at_mut(stride);
        let (mut b, mut c) = rest.split_at_mut(stride);
        let mut l = self.gpu.stream().launch_builder(&self.split3);
        l.arg(x).arg(&mut a).arg(&mut b).arg(&mut c).arg(&n64);
        // SAFETY: grid-stride over i < n ≤ stride: reads x[i] (≥ n, checked), writes element i
        // of three disjoint views of `stride` elements each (3·stride held, checked).
        unsafe { crate::gpu::launch_op(&mut l, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Chunked backward from `dlogprob [t]` (with the forward's `lse [t]`): recomputes each
    /// chunk's logits, `dz = (onehot − softmax(z/τ))·dlogprob/τ`, and accumulates
    /// `dh [t, h] += dz · W[chunk]` and `dw [v, h]` rows of the chunk `+= dzᵀ · h` (f32).
    ///
    /// Dtypes: `h_bf16`, `w_bf16` BF16 bit patterns, everything else f32; accumulation f32;
    /// the GEMMs as [`Head::grad_gemm`] says ([`HeadGradGemm::F32`] unless chosen with
    /// [`Head::with_grad_gemm`]).
    /// References: `mxrl_tensor::loss::logprobs_backward` for `dz`, then
    /// `mxrl_tensor::gemm::matmul_nn(dz, W)` and `matmul_tn(dz, h)`.
    ///
    /// # Errors
    /// As [`Head::forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        h_bf16: &CudaView<'_, u16>,
        w_bf16: &CudaView<'_, u16>,
        targets: &CudaView<'_, u32>,
        lse: &CudaView<'_, f32>,
        dlogprob: &CudaView<'_, f32>,
        temperature: f32,
        shape: HeadShape,
        dh: &mut CudaViewMut<'_, f32>,
        dw: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let HeadShape { t, h, v, chunk } = shape;
        self.check_shape(&shape)?;
        let g = &self.gpu;
        if temperature.is_nan() || temperature <= 0.0 {
            return Err(g.err(format!("head: temperature {temperature} must be > 0")));
        }
        check_len(g, "head h", h_bf16.len(), t * h)?;
        check_len(g, "head W", w_bf16.len(), v * h)?;
        check_len(g, "head targets", targets.len(), t)?;
        check_len(g, "head lse", lse.len(), t)?;
        check_len(g, "head dlogprob", dlogprob.len(), t)?;
        check_len(g, "head dh", dh.len(), t * h)?;
        check_len(g, "head dW", dw.len(), v * h)?;
        if t == 0 {
            return Ok(());
        }
        let inv_t = 1.0f32 / temperature;
        let chunk = chunk.min(v);
        let mut z: CudaSlice<f32> = g.zeros(t * chunk)?;
        let split = self.grad_gemm == HeadGradGemm::Bf16x3;
        // F32 mode: f32 copies of h and of each W chunk; Bf16x3 mode: dz's three BF16 parts.
        let (mut hf, mut wf, mut parts): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u16>) = if split
        {
            (g.zeros(1)?, g.zeros(1)?, g.zeros(3 * t * chunk)?)
        } else {
            (g.zeros(t * h)?, g.zeros(chunk * h)?, g.zeros(1)?)
        };
        if !split {
            self.bf16_to_f32(h_bf16, &mut hf, t * h)?;
        }
        let t64 = t as u64;
        let mut c0 = 0usize;
        while c0 < v {
            let cols = chunk.min(v - c0);
            let wc = w_bf16.slice(c0 * h..(c0 + cols) * h);
            let s = g.stream();
            {
                let (hp, _g1) = h_bf16.device_ptr(s);
                let (wp, _g2) = wc.device_ptr(s);
                let zl = z.len();
                let (zp, _g3) = z.device_ptr_mut(s);
                self.blas.gemm(
                    Layout::Nt,
                    t,
                    cols,
                    h,
                    Operand {
                        ptr: hp,
                        dt: Dt::Bf16,
                        len: h_bf16.len(),
                    },
                    Operand {
                        ptr: wp,
                        dt: Dt::Bf16,
                        len: wc.len(),
                    },
                    0.0,
                    zp,
                    zl,
                )?;
            }
            {
                let (cols64, c064) = (cols as u64, c0 as u64);
                let mut b = s.launch_builder(&self.chunk_bwd);
                b.arg(&mut z)
                    .arg(&cols64)
                    .arg(&c064)
                    .arg(targets)
                    .arg(lse)
                    .arg(dlogprob)
                    .arg(&inv_t)
                    .arg(&t64);
                // SAFETY: grid-stride over i < t·cols (≤ z's t·chunk): reads/writes z[i],
                // reads targets, lse, dlogprob at i / cols < t (each ≥ t, checked).
                unsafe { crate::gpu::launch_op(&mut b, grid(t * cols)) }.map_err(|e| g.err(e))?;
            }
            if split {
                self.split_bf16x3(&z, &mut parts, t * cols, t * chunk)?;
                for i in 0..3 {
                    let part = parts.slice(i * t * chunk..i * t * chunk + t * cols);
                    let (pp, _g1) = part.device_ptr(s);
                    let dz = Operand {
                        ptr: pp,
                        dt: Dt::Bf16,
                        len: t * cols,
                    };
                    {
                        let (wp, _g2) = wc.device_ptr(s);
                        let dhl = dh.len();
                        let (dp, _g3) = dh.device_ptr_mut(s);
                        // dh [t, h] += part [t, cols] · Wc [cols, h]
                        self.blas.gemm(
                            Layout::Nn,
                            t,
                            h,
                            cols,
                            dz,
                            Operand {
                                ptr: wp,
                                dt: Dt::Bf16,
                                len: cols * h,
                            },
                            1.0,
                            dp,
                            dhl,
                        )?;
                    }
                    let dz = Operand {
                        ptr: pp,
                        dt: Dt::Bf16,
                        len: t * cols,
                    };
                    let mut dwc = dw.slice_mut(c0 * h..(c0 + cols) * h);
                    let (hp, _g2) = h_bf16.device_ptr(s);
                    let dwl = dwc.len();
                    let (dp, _g3) = dwc.device_ptr_mut(s);
                    // dWc [cols, h] += part [t, cols]ᵀ · h [t, h]
                    self.blas.gemm(
                        Layout::Tn,
                        cols,
                        h,
                        t,
                        dz,
                        Operand {
                            ptr: hp,
                            dt: Dt::Bf16,
                            len: t * h,
                        },
                        1.0,
                        dp,
                        dwl,
                    )?;
                }
                c0 += cols;
                continue;
            }
            self.bf16_to_f32(&wc, &mut wf, cols * h)?;
            {
                let (zp, _g1) = z.device_ptr(s);
                let (wp, _g2) = wf.device_ptr(s);
                let dhl = dh.len();
                let (dp, _g3) = dh.device_ptr_mut(s);
                // dh [t, h] += dz [t, cols] · Wc [cols, h]
                self.blas.gemm(
                    Layout::Nn,
                    t,
                    h,
                    cols,
                    Operand {
                        ptr: zp,
                        dt: Dt::F32,
                        len: t * cols,
                    },
                    Operand {
                        ptr: wp,
                        dt: Dt::F32,
                        len: cols * h,
                    },
                    1.0,
                    dp,
                    dhl,
                )?;
            }
            {
                let mut dwc = dw.slice_mut(c0 * h..(c0 + cols) * h);
                let (zp, _g1) = z.device_ptr(s);
                let (hp, _g2) = hf.device_ptr(s);
                let dwl = dwc.len();
                let (dp, _g3) = dwc.device_ptr_mut(s);
                // dWc [cols, h] += dz [t, cols]ᵀ · h [t, h]
                self.blas.gemm(
                    Layout::Tn,
                    cols,
                    h,
                    t,
                    Operand {
                        ptr: zp,
                        dt: Dt::F32,
                        len: t * cols,
                    },
                    Operand {
                        ptr: hp,
                        dt: Dt::F32,
                        len: t * h,
                    },
                    1.0,
                    dp,
                    dwl,
                )?;
            }
            c0 += cols;
        }
        Ok(())
    }
}
