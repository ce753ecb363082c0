//! On-device sampling of one token per row of logits (kernel `kernels/ops_sample.cu`):
//! temperature, top-k, top-p, greedy at temperature 0, with a counter-based RNG.
//!
//! # Semantics
//! Those of the reference `mxrl_tensor::sample::sample_row` (also behind
//! `mxrl_model::generate::sample_token`): greedy takes the first index of
//! the maximum and reports its logprob at `τ = 1`; otherwise the kept set is the first `keep`
//! tokens in the order (probability descending, index ascending) with `keep = top_k` (0: all)
//! cut to the smallest prefix whose mass reaches `top_p·Σp` (at least one), the token is drawn
//! with probability `p/Σ_kept p`, and its logprob is `z/τ − lse(z/τ)` under the full tempered
//! distribution. The kept set's masses are f64 sums in a different order from the reference's,
//! so the top-p cut can differ from it only where a prefix mass equals the target to within
//! f64 rounding.
//!
//! # Randomness
//! The draw of row `r` at decode step `step` is `u = uniform(seed, step, r)` (splitmix64 of the
//! three counters, 53 bits), so the same `(seed, step, row)` gives the same token on every run
//! and for any batch size; [`uniform`] (`mxrl_tensor::sample`) is the host twin of the device
//! function and `mxrl_tensor::sample::sample_rows` the reference of the whole kernel.
#![allow(unsafe_code)]

use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_sample.cu");

/// Threads per row (`SAMPLE_THREADS` in the kernel).
const THREADS: u32 = 512;

pub use mxrl_tensor::sample::{uniform, SampleParams};

/// The loaded kernel.
pub struct Sampler {
    gpu: Gpu,
    f: CudaFunction,
}

impl Sampler {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_sample", SOURCE)?;
        let f = m
            .load_function("sample_rows")
            .map_err(|x| gpu.err(format!("kernel sample_rows: {x:?}")))?;
        Ok(Sampler {
            gpu: gpu.clone(),
            f,
        })
    }

    /// Samples one token per row of `logits [rows, v]` (f32) into `tokens [rows]` with its
    /// logprob in `logprobs [rows]` (f32; the softmax statistics in f32, the kept-set masses
    /// in f64). Reference: `mxrl_model::generate::sample_token`. Allocates its `[rows, v]`
    /// f32 scratch (none when greedy); [`Sampler::sample_with_scratch`] takes it from the
    /// caller (no allocation: for a captured decode step).
    ///
    /// # Errors
    /// A negative or NaN temperature or top-p, `v = 0` with rows, `v ≥ 2³²`, short buffers,
    /// out of device memory; launch errors.
    pub fn sample(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        v: usize,
        params: &SampleParams,
        tokens: &mut CudaViewMut<'_, u32>,
        logprobs: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let n = if params.temperature == 0.0 {
            1
        } else {
            rows * v
        };
        let mut scratch: CudaSlice<f32> = self.gpu.zeros(n)?;
        self.sample_with_scratch(
            logits,
            rows,
            v,
            params,
            &mut scratch.as_view_mut(),
            tokens,
            logprobs,
        )
    }

    /// As [`Sampler::sample`] with the caller's scratch (`[rows, v]` f32 unless greedy, whose
    /// kernel does not touch it; its contents are overwritten).
    ///
    /// # Errors
    /// As [`Sampler::sample`], and a short scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_with_scratch(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        v: usize,
        params: &SampleParams,
        scratch: &mut CudaViewMut<'_, f32>,
        tokens: &mut CudaViewMut<'_, u32>,
        logprobs: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let t = params.temperature;
        if t.is_nan() || t < 0.0 || !t.is_finite() {
            return Err(g.err(format!("sample: temperature {t} must be finite and ≥ 0")));
        }
        if params.top_p.is_nan() || params.top_p < 0.0 {
            return Err(g.err(format!("sample: top_p {} must be ≥ 0", params.top_p)));
        }
        if rows > i32::MAX as usize {
            return Err(g.err(format!("sample: {rows} rows exceed one launch")));
        }
        if v >= u32::MAX as usize {
            return Err(g.err(format!("sample: vocabulary {v} exceeds u32 token ids")));
        }
        for (what, got, want) in [
            ("logits", logits.len(), rows * v),
            ("tokens", tokens.len(), rows),
            ("logprobs", logprobs.len(), rows),
        ] {
            if got < want {
                return Err(g.err(format!(
                    "sample {what}: buffer of {got} elements, {want} needed"
                )));
            }
        }
        if rows == 0 {
            return Ok(());
        }
        if v == 0 {
            return Err(g.err("sample: empty vocabulary"));
        }
        let greedy: i32 = (t == 0.0) as i32;
        if greedy == 0 && scratch.len() < rows * v {
            return Err(g.err(format!(
                "sample scratch: buffer of {} elements, {} needed",
                scratch.len(),
                rows * v
            )));
        }
        let inv_t: f32 = if t == 0.0 { 1.0 } else { 1.0 / t };
        let (v64, k64) = (v as u64, params.top_k as u64);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.f);
        b.arg(logits)
            .arg(&v64)
            .arg(&greedy)
            .arg(&inv_t)
            .arg(&k64)
            .arg(&params.top_p)
            .arg(&params.seed)
            .arg(&params.step)
            .arg(scratch)
            .arg(tokens)
            .arg(logprobs);
        // SAFETY: block r < rows reads logits[r·v .. (r+1)·v) (rows·v held, checked) and,
        // unless greedy, reads/writes scratch[r·v .. (r+1)·v) (rows·v held, checked; the greedy
        // branch never touches it), writes tokens[r] and
        // logprobs[r] (≥ rows, checked); tokens written are < v. Argument types match
        // (ptr, u64, i32, f32, u64, f32, u64, u64, ptr, ptr, ptr).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }
}
