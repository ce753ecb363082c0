//! SwiGLU forward and backward (kernels `kernels/ops_swiglu.cu`).
//!
//! Layout (as the CPU reference): the fused gate/up activation `gu: [rows, 2F]` f32 holds the
//! gate in columns `0..F` and up in `F..2F` (the rows of a fused `[2F, H]` gate_up weight);
//! the activation `h: [rows, F]` f32. Every element is computed in f32 with the reference's
//! operation sequence (no FMA contraction, IEEE division).
//!
//! `exp`: the kernels evaluate `(float)exp((double)x)` — CUDA's f64 `exp` is within 1 ulp of
//! f64 and the conversion rounds once, so the result is within 0.5 ulp + 2⁻²⁹ ulp of the exact
//! value (CUDA's f32 `expf`, even without fast math, is documented at 2 ulps). The CPU
//! reference's `f32::exp` is the platform libm's `expf` (glibc/musl: 0.502 ulp). Both are
//! therefore usually the correctly rounded value and agree bitwise; where one is not, results
//! differ within `mxrl_tensor::tolerance::swiglu_forward_bound` / `swiglu_backward_bounds`
//! with one ulp per device ([`mxrl_tensor::tolerance::EXP_ULPS_DEVICE`]).
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_swiglu.cu");

/// Threads per block: each block walks rows, its threads the row's columns.
const THREADS: u32 = 256;
/// Row-strided kernels: at most this many blocks (16 per SM of a 132-SM H200).
const MAX_BLOCKS: usize = 132 * 16;

fn grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The loaded kernels.
pub struct Swiglu {
    gpu: Gpu,
    fwd: CudaFunction,
    fwd_bf16: CudaFunction,
    fwd_bf16_only: CudaFunction,
    bwd: CudaFunction,
    bwd_bf16: CudaFunction,
}

impl Swiglu {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_swiglu", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Swiglu {
            gpu: gpu.clone(),
            fwd: f("swiglu_fwd")?,
            fwd_bf16: f("swiglu_fwd_bf16")?,
            fwd_bf16_only: f("swiglu_fwd_bf16_only")?,
            bwd: f("swiglu_bwd")?,
            bwd_bf16: f("swiglu_bwd_bf16")?,
        })
    }

    /// SwiGLU forward: `gu: [rows, 2F]` f32 → `h: [rows, F]` f32, `h = silu(gate)·up`,
    /// `silu(g) = g / (1 + exp(−g))`; when `h_bf16` is given it also receives `bf16(h)` (bit
    /// patterns, round to nearest even: the next GEMM's operand). Elementwise f32. Reference:
    /// `mxrl_tensor::activation::swiglu_forward` (bound: module doc).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn forward(
        &self,
        gu: &CudaView<'_, f32>,
        h: &mut CudaViewMut<'_, f32>,
        h_bf16: Option<&mut CudaViewMut<'_, u16>>,
        rows: usize,
        f: usize,
    ) -> Result<(), DeviceError> {
        let n = rows * f;
        check_len(&self.gpu, "swiglu gu", gu.len(), 2 * n)?;
        check_len(&self.gpu, "swiglu h", h.len(), n)?;
        if let Some(hb) = &h_bf16 {
            check_len(&self.gpu, "swiglu h_bf16", hb.len(), n)?;
        }
        if n == 0 {
            return Ok(());
        }
        let (r64, f64_) = (rows as u64, f as u64);
        match h_bf16 {
            None => {
                let mut b = self.gpu.stream().launch_builder(&self.fwd);
                b.arg(gu).arg(h).arg(&r64).arg(&f64_);
                // SAFETY: row r < rows, column j < F reads gu[r·2F + j] and gu[r·2F + F + j]
                // (< 2·rows·F, checked) and writes h[r·F + j] (rows·F checked); argument types
                // match the kernel's (const float*, float*, u64, u64).
                unsafe { crate::gpu::launch_op(&mut b, grid(rows)) }
                    .map_err(|e| self.gpu.err(e))?;
            }
            Some(hb) => {
                let mut b = self.gpu.stream().launch_builder(&self.fwd_bf16);
                b.arg(gu).arg(h).arg(hb).arg(&r64).arg(&f64_);
                // SAFETY: as above, plus hb[r·F + j] (rows·F checked); (const float*, float*, u16*,
                // u64, u64).
                unsafe { crate::gpu::launch_op(&mut b, grid(rows)) }
                    .map_err(|e| self.gpu.err(e))?;
            }
        }
        Ok(())
    }

    /// [`Swiglu::forward`]'s BF16 output alone (`h_bf16: [rows, F]`, the same bits; no f32
    /// `h` is written).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn forward_bf16(
        &self,
        gu: &CudaView<'_, f32>,
        h_bf16: &mut CudaViewMut<'_, u16>,
        rows: usize,
        f: usize,
    ) -> Result<(), DeviceError> {
        let n = rows * f;
        check_len(&self.gpu, "swiglu gu", gu.len(), 2 * n)?;
        check_len(&self.gpu, "swiglu h_bf16", h_bf16.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, f64_) = (rows as u64, f as u64);
        let mut b = self.gpu.stream().launch_builder(&self.fwd_bf16_only);
        b.arg(gu).arg(h_bf16).arg(&r64).arg(&f64_);
        // SAFETY: row r < rows, column j < F reads gu[r·2F + j] and gu[r·2F + F + j] (< 2·rows·F,
        // checked) and writes h_bf16[r·F + j] (rows·F checked); types (const float*, u16*, u64,
        // u64).
        unsafe { crate::gpu::launch_op(&mut b, grid(rows)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// SwiGLU backward: `dh: [rows, F]`, `gu: [rows, 2F]` → overwrites `dgu: [rows, 2F]` with
    /// `dgate = (dh·up)·(s·(1 + g·(1 − s)))`, `dup = dh·(g·s)`, `s = 1/(1 + exp(−g))`.
    /// Elementwise f32. Reference: `mxrl_tensor::activation::swiglu_backward` (bound: module
    /// doc).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn backward(
        &self,
        dh: &CudaView<'_, f32>,
        gu: &CudaView<'_, f32>,
        dgu: &mut CudaViewMut<'_, f32>,
        rows: usize,
        f: usize,
    ) -> Result<(), DeviceError> {
        self.backward_to(dh, gu, &self.bwd, dgu, rows, f)
    }

    /// [`Swiglu::backward`] writing `dgu` as its BF16 bit patterns only (the bits of the f32
    /// op followed by a BF16 conversion).
    ///
    /// # Errors
    /// As [`Swiglu::backward`].
    pub fn backward_bf16(
        &self,
        dh: &CudaView<'_, f32>,
        gu: &CudaView<'_, f32>,
        dgu: &mut CudaViewMut<'_, u16>,
        rows: usize,
        f: usize,
    ) -> Result<(), DeviceError> {
        self.backward_to(dh, gu, &self.bwd_bf16, dgu, rows, f)
    }

    fn backward_to<T: cudarc::driver::DeviceRepr>(
        &self,
        dh: &CudaView<'_, f32>,
        gu: &CudaView<'_, f32>,
        kernel: &CudaFunction,
        dgu: &mut CudaViewMut<'_, T>,
        rows: usize,
        f: usize,
    ) -> Result<(), DeviceError> {
        let n = rows * f;
        check_len(&self.gpu, "swiglu_bwd dh", dh.len(), n)?;
        check_len(&self.gpu, "swiglu_bwd gu", gu.len(), 2 * n)?;
        check_len(&self.gpu, "swiglu_bwd dgu", dgu.len(), 2 * n)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, f64_) = (rows as u64, f as u64);
        let mut b = self.gpu.stream().launch_builder(kernel);
        b.arg(dh).arg(gu).arg(dgu).arg(&r64).arg(&f64_);
        // SAFETY: row r < rows, column j < F reads dh[r·F + j] (rows·F checked), gu[r·2F + j] and
        // gu[r·2F + F + j] and writes dgu at the same two offsets (2·rows·F checked); types
        // (const float*, const float*, T* (f32, or u16 for the BF16 kernel), u64, u64).
        unsafe { crate::gpu::launch_op(&mut b, grid(rows)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
