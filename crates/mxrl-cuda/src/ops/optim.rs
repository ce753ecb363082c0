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
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use mxrl_tensor::optim::AdamWConfig;
use std::sync::Arc;

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

/// A gradient norm whose buffers are handed in one at a time ([`Optim::grad_norm_begin`]).
pub struct NormParts {
    /// Stage-1 block partials of every buffer, in [`Optim::grad_norm`]'s slots.
    partial: CudaSlice<f64>,
    lens: Vec<usize>,
    /// First slot of each buffer.
    offs: Vec<usize>,
    /// Slots in all.
    total: usize,
    added: Vec<bool>,
    /// (second stream, main stream) once a buffer ran on the second stream.
    side: Option<(Arc<CudaStream>, Arc<CudaStream>)>,
}

impl NormParts {
    /// Makes the main stream wait for the partials queued on the second stream.
    fn join(&mut self) -> Result<(), cudarc::driver::DriverError> {
        if let Some((side, main)) = self.side.take() {
            main.join(&side)?;
        }
        Ok(())
    }
}

impl Drop for NormParts {
    /// The partials buffer is freed in the main stream's order: that stream waits for the
    /// second one first, so no partial is written after the free.
    fn drop(&mut self) {
        let _ = self.join();
    }
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
    /// The second stream of [`Optim::grad_norm_add`].
    side: std::sync::OnceLock<Arc<CudaStream>>,
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
            side: std::sync::OnceLock::new(),
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

    /// Global gradient norm of `grads[i][..lens[i]]` and the clipping coefficient for
    /// `max_norm` (`None`: no clipping, scale 1). f64 accumulation of exact squares in a fixed
    /// two-stage tree. References: `mxrl_tensor::optim::{global_grad_norm, clip_grad_norm}`.
    /// The same as [`Optim::grad_norm_begin`] and [`Optim::grad_norm_finish`] with nothing
    /// handed in between.
    ///
    /// # Errors
    /// Mismatched lists, short buffers, out of device memory; launch errors.
    pub fn grad_norm(
        &self,
        grads: &[CudaView<'_, f32>],
        lens: &[usize],
        max_norm: Option<f64>,
    ) -> Result<GradNorm, DeviceError> {
        let parts = self.grad_norm_begin(lens)?;
        self.grad_norm_finish(parts, grads, lens, max_norm)
    }

    /// Starts a gradient norm over buffers of lengths `lens` whose stage-1 partials may be
    /// launched one buffer at a time ([`Optim::grad_norm_add`]) before
    /// [`Optim::grad_norm_finish`] launches the rest and the final sum. Every buffer's
    /// partials land in the slots [`Optim::grad_norm`] gives them and are computed by the same
    /// launch, so the norm is its bits whatever was handed in, in whatever order.
    ///
    /// # Errors
    /// Out of device memory.
    pub fn grad_norm_begin(&self, lens: &[usize]) -> Result<NormParts, DeviceError> {
        let mut offs = Vec::with_capacity(lens.len());
        let mut total = 0usize;
        for &n in lens {
            offs.push(total);
            if n > 0 {
                total += norm_blocks(n);
            }
        }
        Ok(NormParts {
            partial: self.gpu.zeros(total.max(1))?,
            lens: lens.to_vec(),
            offs,
            total,
            added: vec![false; lens.len()],
            side: None,
        })
    }

    /// Launches the stage-1 partials of buffers `bufs` (index in the `grad_norm_begin`'s
    /// list, its first `lens[i]` entries). With `concurrent`, they run on a second stream
    /// after everything queued so far on the main stream, alongside what is queued after
    /// them; the buffers must then not be written until [`Optim::grad_norm_finish`] (which,
    /// like dropping the parts, makes the main stream wait for that stream).
    ///
    /// # Errors
    /// An index out of range or handed in twice, a short buffer; launch errors.
    pub fn grad_norm_add(
        &self,
        parts: &mut NormParts,
        bufs: &[(usize, CudaView<'_, f32>)],
        concurrent: bool,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        for (k, (i, x)) in bufs.iter().enumerate() {
            let Some(&n) = parts.lens.get(*i) else {
                return Err(g.err(format!(
                    "grad norm: buffer {i} handed in, {} begun",
                    parts.lens.len()
                )));
            };
            if parts.added[*i] || bufs[..k].iter().any(|(j, _)| j == i) {
                return Err(g.err(format!("grad norm: buffer {i} handed in twice")));
            }
            check_len(g, &format!("grad norm buffer {i}"), x.len(), n)?;
        }
        let stream = if concurrent {
            let main = g.stream();
            let side = match &parts.side {
                Some((s, _)) => s.clone(),
                None => {
                    let s = self.side_stream()?;
                    parts.side = Some((s.clone(), main.clone()));
                    s
                }
            };
            // The side stream starts these partials once everything queued so far on the main
            // stream (the backward that wrote the buffers) is done.
            side.join(main)
                .map_err(|e| g.err(format!("grad norm: stream wait: {e:?}")))?;
            side
        } else {
            g.stream().clone()
        };
        for (i, x) in bufs {
            self.launch_partial(&stream, parts, *i, x)?;
            parts.added[*i] = true;
        }
        Ok(())
    }

    /// Stage 1 for buffer `i` on `stream`: block partials into its slots.
    fn launch_partial(
        &self,
        stream: &Arc<CudaStream>,
        parts: &mut NormParts,
        i: usize,
        x: &CudaView<'_, f32>,
    ) -> Result<(), DeviceError> {
        let n = parts.lens[i];
        if n == 0 {
            return Ok(());
        }
        let nb = norm_blocks(n);
        let off = parts.offs[i];
        let mut dst = parts.partial.slice_mut(off..off + nb);
        let n64 = n as u64;
        let cfg = LaunchConfig {
            grid_dim: (nb as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.partial);
        b.arg(x).arg(&n64).arg(&mut dst);
        // SAFETY: grid-stride over i < n reads x[i] (≥ n, checked by the caller); block k < nb
        // writes dst[k] (nb elements).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// The second stream of [`Optim::grad_norm_add`] (made on first use).
    fn side_stream(&self) -> Result<Arc<CudaStream>, DeviceError> {
        if let Some(s) = self.side.get() {
            return Ok(s.clone());
        }
        let s = self
            .gpu
            .ctx()
            .new_stream()
            .map_err(|e| self.gpu.err(format!("grad norm: new stream: {e:?}")))?;
        Ok(self.side.get_or_init(|| s).clone())
    }

    /// Launches the partials of the buffers not handed in (main stream), makes the main
    /// stream wait for the second stream's, then sums them: the norm and clipping coefficient
    /// of [`Optim::grad_norm`] over `grads` and `lens` (the `grad_norm_begin`'s lengths).
    ///
    /// # Errors
    /// Lengths other than the `grad_norm_begin`'s, short buffers; launch errors.
    pub fn grad_norm_finish(
        &self,
        mut parts: NormParts,
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
        if lens != parts.lens.as_slice() {
            let at = lens
                .iter()
                .zip(&parts.lens)
                .position(|(a, b)| a != b)
                .unwrap_or(lens.len().min(parts.lens.len()));
            return Err(g.err(format!(
                "grad norm: {} buffers finished, {} begun (first difference at buffer {at})",
                lens.len(),
                parts.lens.len()
            )));
        }
        if let Some(mn) = max_norm {
            if mn.is_nan() || mn < 0.0 {
                return Err(g.err(format!("grad norm: max_norm {mn} must be ≥ 0")));
            }
        }
        for (i, (x, &n)) in grads.iter().zip(lens).enumerate() {
            if !parts.added[i] {
                check_len(g, &format!("grad norm buffer {i}"), x.len(), n)?;
            }
        }
        let main = g.stream().clone();
        for (i, x) in grads.iter().enumerate() {
            if !parts.added[i] {
                self.launch_partial(&main, &mut parts, i, x)?;
                parts.added[i] = true;
            }
        }
        parts
            .join()
            .map_err(|e| g.err(format!("grad norm: stream wait: {e:?}")))?;
        let mut norm: CudaSlice<f64> = g.zeros(1)?;
        let mut scale: CudaSlice<f32> = g.zeros(1)?;
        let np = parts.total as u64;
        let mn = max_norm.unwrap_or(-1.0);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = main.launch_builder(&self.final_);
        b.arg(&parts.partial)
            .arg(&np)
            .arg(&mn)
            .arg(&mut norm)
            .arg(&mut scale);
        // SAFETY: one block reads partial[0..np) (np = total ≤ its length) and writes
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
