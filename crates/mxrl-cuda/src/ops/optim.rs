//! AdamW with the BF16 operand copy written in the same pass, the global gradient norm and
//! clipping by scale, on device f32 buffers (kernels `kernels/ops_optim.cu`).
//!
//! # Numerics
//! AdamW follows `mxrl_tensor::optim::adamw_update`'s operation order in f32 with the
//! host-computed bias-correction terms of the reference (`lr/(1−β₁ᵗ)` and `√(1−β₂ᵗ)` in f64,
//! rounded to f32), and IEEE division and square root (no FMA contraction): the updated weights
//! and moments are bitwise the reference's. The grad norm sums exact f64 squares in a fixed
//! two-stage tree (per-buffer block partials, then one block over all partials); it differs
//! from the reference's sequential f64 sum only in order.
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg,
};
use mxrl_tensor::optim::AdamWConfig;

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_optim.cu");

const THREADS: u32 = 256;
/// Most blocks of a stage-1 norm launch (a function of the buffer length alone).
const NORM_BLOCKS: usize = 2048;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn norm_blocks(n: usize) -> usize {
    n.div_ceil(THREADS as usize).clamp(1, NORM_BLOCKS)
}

/// One parameter tensor of an AdamW step (all `[n]`).
pub struct AdamWParam<'a, 'b> {
    /// f32 master weights (updated in place).
    pub param: &'a mut CudaViewMut<'b, f32>,
    /// Gradient.
    pub grad: &'a CudaView<'b, f32>,
    /// First moment (updated).
    pub m: &'a mut CudaViewMut<'b, f32>,
    /// Second moment (updated).
    pub v: &'a mut CudaViewMut<'b, f32>,
    /// BF16 copy of the new weights (bit patterns), written in the same pass when given
    /// (the GEMM operand of a linear weight; `None` for norms and biases).
    pub param_bf16: Option<&'a mut CudaViewMut<'b, u16>>,
    /// Element count.
    pub n: usize,
    /// Weight decay of this tensor.
    pub weight_decay: f32,
}

impl<'a> AdamWParam<'a, '_> {
    /// Pushes the first five arguments of every AdamW kernel — param, grad, m, v and the BF16
    /// copy (`stand_in`, never written, when there is none) — and returns the kernels'
    /// `write_bf16` flag.
    pub(crate) fn push_buffers<'c>(
        self,
        b: &mut cudarc::driver::LaunchArgs<'c>,
        stand_in: &'c CudaSlice<u16>,
    ) -> i32
    where
        'a: 'c,
    {
        let write_bf16 = self.param_bf16.is_some() as i32;
        b.arg(&mut *self.param)
            .arg(self.grad)
            .arg(&mut *self.m)
            .arg(&mut *self.v);
        match self.param_bf16 {
            Some(x) => b.arg(x),
            None => b.arg(stand_in),
        };
        write_bf16
    }
}

/// The eight f32 terms of an AdamW kernel (`adamw_elem` in `kernels/common.cuh`), computed on
/// the host the way the reference computes them: `lr/(1−β₁ᵗ)` and `√(1−β₂ᵗ)` in f64 rounded to
/// f32, `1 − lr·wd` in f32.
pub(crate) struct AdamWTerms {
    v: [f32; 8],
}

impl AdamWTerms {
    pub(crate) fn new(cfg: &AdamWConfig, step: u64, weight_decay: f32) -> Self {
        let bc1 = 1.0 - (cfg.beta1 as f64).powi(step as i32);
        let bc2 = 1.0 - (cfg.beta2 as f64).powi(step as i32);
        let step_size = (cfg.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = 1.0 - cfg.lr * weight_decay;
        AdamWTerms {
            v: [
                cfg.beta1,
                cfg.beta2,
                1.0 - cfg.beta1,
                1.0 - cfg.beta2,
                cfg.eps,
                step_size,
                bc2_sqrt,
                decay,
            ],
        }
    }

    /// Pushes the terms in the kernels' order (β₁, β₂, 1−β₁, 1−β₂, ε, step size, √(1−β₂ᵗ),
    /// decay): the last eight arguments of every AdamW kernel.
    pub(crate) fn args<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        for x in &self.v {
            b.arg(x);
        }
    }
}

/// Result of [`Optim::grad_norm`]: device scalars.
pub struct GradNorm {
    /// `√(Σ g²)` (f64, `[1]`).
    pub norm: CudaSlice<f64>,
    /// The clipping coefficient `max_norm/(norm + 1e-6)` as f32 when below 1, else 1 (`[1]`);
    /// pass to [`Optim::adamw_step`] or [`Optim::scale`] (with a host coefficient, clipping is
    /// `ops::engine`'s `scale`).
    pub scale: CudaSlice<f32>,
}

/// The loaded kernels.
pub struct Optim {
    gpu: Gpu,
    adamw: CudaFunction,
    adamw8: CudaFunction,
    partial: CudaFunction,
    final_: CudaFunction,
    scale: CudaFunction,
    /// `[1.0]`: the gradient scale of an unclipped step.
    one: CudaSlice<f32>,
    /// A one-element stand-in for an absent BF16 copy (never written).
    no_bf16: CudaSlice<u16>,
}

impl Optim {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_optim", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Optim {
            gpu: gpu.clone(),
            adamw: f("adamw_step")?,
            adamw8: f("adamw_step8")?,
            partial: f("sumsq_partial")?,
            final_: f("sumsq_final")?,
            scale: f("scale_inplace")?,
            one: gpu.upload(&[1.0f32])?,
            no_bf16: gpu.zeros(1)?,
        })
    }

    /// One AdamW step (`step ≥ 1`) of one tensor with its gradient multiplied by
    /// `grad_scale[0]` first (the clipping coefficient of [`Optim::grad_norm`]; a buffer
    /// holding 1.0 for none), and the BF16 copy of the new weights written in the same pass.
    /// f32 throughout. Reference: `mxrl_tensor::optim::adamw_update` (after
    /// `clip_grad_norm`'s scaling) and `mxrl_tensor::precision::round_bf16`; bitwise.
    ///
    /// # Errors
    /// `step = 0`, short buffers; launch errors.
    pub fn adamw_step(
        &self,
        p: AdamWParam<'_, '_>,
        grad_scale: &CudaView<'_, f32>,
        step: u64,
        cfg: &AdamWConfig,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if step == 0 {
            return Err(g.err("AdamW step counts from 1"));
        }
        let n = p.n;
        check_len(g, "adamw param", p.param.len(), n)?;
        check_len(g, "adamw grad", p.grad.len(), n)?;
        check_len(g, "adamw m", p.m.len(), n)?;
        check_len(g, "adamw v", p.v.len(), n)?;
        if let Some(b) = &p.param_bf16 {
            check_len(g, "adamw bf16 copy", b.len(), n)?;
        }
        check_len(g, "adamw grad scale", grad_scale.len(), 1)?;
        if n == 0 {
            return Ok(());
        }
        let t = AdamWTerms::new(cfg, step, p.weight_decay);
        // Eight elements per thread (float4 accesses) where every buffer allows it.
        let stream = g.stream();
        let aligned = |ptr: u64| ptr.is_multiple_of(16);
        let vec8 = n.is_multiple_of(8)
            && aligned(p.param.device_ptr(stream).0)
            && aligned(p.grad.device_ptr(stream).0)
            && aligned(p.m.device_ptr(stream).0)
            && aligned(p.v.device_ptr(stream).0)
            && p.param_bf16
                .as_ref()
                .is_none_or(|b| aligned(b.device_ptr(stream).0));
        let (n64, f, cfg) = if vec8 {
            let n8 = n / 8;
            let cfg = LaunchConfig {
                grid_dim: (n8.div_ceil(THREADS as usize) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            (n8 as u64, &self.adamw8, cfg)
        } else {
            (n as u64, &self.adamw, grid(n))
        };
        let mut b = stream.launch_builder(f);
        let write_bf16 = p.push_buffers(&mut b, &self.no_bf16);
        b.arg(&write_bf16).arg(grad_scale).arg(&n64);
        t.args(&mut b);
        // SAFETY: adamw_step: grid-stride over i < n; adamw_step8: thread t < n8 = n/8 over
        // i in [8t, 8t + 8), every buffer 16-byte aligned (checked above, float4 accesses).
        // Either reads grad[i], reads/writes p[i], m[i], v[i], writes p_bf16[i] only when a
        // copy of ≥ n elements was given (write_bf16 = 1; the stand-in is never written),
        // reads grad_scale[0] (≥ 1, checked); the argument lists match the kernels' (five
        // pointers, i32, pointer, u64, eight f32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// One AdamW step without clipping (gradient scale 1): [`Optim::adamw_step`] with the
    /// module's `[1.0]` scale buffer.
    ///
    /// # Errors
    /// As [`Optim::adamw_step`].
    pub fn adamw(
        &self,
        p: AdamWParam<'_, '_>,
        step: u64,
        cfg: &AdamWConfig,
    ) -> Result<(), DeviceError> {
        self.adamw_step(p, &self.one.as_view(), step, cfg)
    }

    /// The global gradient norm as an f64 on the host (downloads one value; synchronizes).
    /// Reference: `mxrl_tensor::optim::global_grad_norm`.
    ///
    /// # Errors
    /// As [`Optim::grad_norm`].
    pub fn grad_norm_host(
        &self,
        grads: &[CudaView<'_, f32>],
        lens: &[usize],
    ) -> Result<f64, DeviceError> {
        let r = self.grad_norm(grads, lens, None)?;
        Ok(self.gpu.download(&r.norm)?[0])
    }

    /// Global L2 norm of many gradient buffers (`grads[i]` of `lens[i]` elements) and the
    /// clipping coefficient for `max_norm` (`None`: no clipping, scale 1). f64 accumulation of
    /// exact squares in a fixed two-stage tree. References:
    /// `mxrl_tensor::optim::{global_grad_norm, clip_grad_norm}`.
    ///
    /// # Errors
    /// Mismatched lists, short buffers, out of device memory; launch errors.
    pub fn grad_norm(
        &self,
        grads: &[CudaView<'_, f32>],
        lens: &[usize],
        max_norm: Option<f64>,
    ) -> Result<GradNorm, DeviceError> {
        let g = &self.gpu;
        if grads.len() != lens.len() {
            return Err(g.err(format!(
                "grad norm: {} buffers, {} lengths",
                grads.len(),
                lens.len()
            )));
        }
        if let Some(mn) = max_norm {
            if mn.is_nan() || mn < 0.0 {
                return Err(g.err(format!("grad norm: max_norm {mn} must be ≥ 0")));
            }
        }
        for (i, (x, &n)) in grads.iter().zip(lens).enumerate() {
            check_len(g, &format!("grad norm buffer {i}"), x.len(), n)?;
        }
        let total_blocks: usize = lens
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| norm_blocks(n))
            .sum();
        let mut partial: CudaSlice<f64> = g.zeros(total_blocks.max(1))?;
        let mut off = 0usize;
        for (x, &n) in grads.iter().zip(lens) {
            if n == 0 {
                continue;
            }
            let nb = norm_blocks(n);
            let mut dst = partial.slice_mut(off..off + nb);
            let n64 = n as u64;
            let cfg = LaunchConfig {
                grid_dim: (nb as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&self.partial);
            b.arg(x).arg(&n64).arg(&mut dst);
            // SAFETY: grid-stride over i < n reads x[i] (≥ n, checked); block k < nb writes
            // dst[k] (nb elements).
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            off += nb;
        }
        let mut norm: CudaSlice<f64> = g.zeros(1)?;
        let mut scale: CudaSlice<f32> = g.zeros(1)?;
        let np = total_blocks as u64;
        let mn = max_norm.unwrap_or(-1.0);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.final_);
        b.arg(&partial)
            .arg(&np)
            .arg(&mn)
            .arg(&mut norm)
            .arg(&mut scale);
        // SAFETY: one block reads partial[0..np) (np = total_blocks ≤ its length) and writes
        // norm[0], scale[0] (one element each).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(GradNorm { norm, scale })
    }

    /// `x[i] *= scale[0]`, `i < n` (clipping a gradient by [`GradNorm::scale`]). Reference:
    /// the scaling loop of `mxrl_tensor::optim::clip_grad_norm`; bitwise.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn scale(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        scale: &CudaView<'_, f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "scale x", x.len(), n)?;
        check_len(&self.gpu, "scale factor", scale.len(), 1)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.gpu.stream().launch_builder(&self.scale);
        b.arg(x).arg(scale).arg(&n64);
        // SAFETY: grid-stride over i < n reads/writes x[i] (≥ n, checked), reads scale[0].
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
