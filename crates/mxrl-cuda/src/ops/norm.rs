//! RMSNorm forward and backward (kernels `kernels/ops_norm.cu`).
//!
//! Used with rows = tokens (width = hidden) and for the per-head q/k norms (rows = tokens·heads,
//! width = head_dim). f32 in, f32 out, f32 accumulation. Reference:
//! `mxrl_tensor::norm::{rmsnorm_forward, rmsnorm_backward}`; every per-element operation is the
//! reference's, only the row sums and the `dw` sum over rows run in another fixed order
//! (bound: `mxrl_tensor::tolerance::rmsnorm_*`). Deterministic: the block size, the row chunks of
//! the `dw` partial sums and every reduction tree depend only on `(rows, d)`.
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_norm.cu");

/// Rows summed by one block of the `dw` partial sums (at least; more when `rows` would need
/// more than 65 535 chunks).
pub const DW_ROWS_PER_CHUNK: usize = 64;

const MAX_GRID_Y: usize = 65_535;

fn rows_per_chunk(rows: usize) -> usize {
    DW_ROWS_PER_CHUNK.max(rows.div_ceil(MAX_GRID_Y))
}

/// Elements of the scratch buffer [`Norm::backward`] needs for `rows × d`: `[chunks, d]` with
/// `chunks = ceil(rows / rows_per_chunk)` (at least one element).
pub fn backward_scratch_len(rows: usize, d: usize) -> usize {
    (rows.div_ceil(rows_per_chunk(rows)) * d).max(1)
}

/// Widths up to which the forward and the backward's `dx` run one warp per row
/// (`rmsnorm_*_w`, [`WARP_ROWS_PER_BLOCK`] rows per block): the per-head q/k norms' rows. Same
/// bits as one block per row (whose block holds at most one column per thread at these widths).
pub const WARP_ROW_MAX_D: usize = 256;

/// Rows (warps) per block of the one-warp-per-row kernels.
pub const WARP_ROWS_PER_BLOCK: usize = 8;

/// Threads per block of the per-row kernels: one warp per 32 columns up to 256 (a function of
/// `d` only, so the reduction tree is fixed by the shape).
pub(crate) fn row_threads(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 256) as u32
}

fn check_dims(gpu: &Gpu, op: &str, rows: usize, d: usize) -> Result<(), DeviceError> {
    if rows > i32::MAX as usize || d > u32::MAX as usize || rows.checked_mul(d).is_none() {
        return Err(gpu.err(format!("{op}: shape [{rows}, {d}] too large")));
    }
    Ok(())
}

/// The loaded RMSNorm kernels.
pub struct Norm {
    gpu: Gpu,
    fwd: CudaFunction,
    fwd_bf16: CudaFunction,
    fwd_both: CudaFunction,
    fwd_add: CudaFunction,
    bwd_dx: CudaFunction,
    dw_partial: CudaFunction,
    dw_reduce: CudaFunction,
    fwd_w: CudaFunction,
    fwd_bf16_w: CudaFunction,
    fwd_both_w: CudaFunction,
    bwd_dx_w: CudaFunction,
    /// [`Norm::set_block_rows`]: one block per row at every width.
    block_rows: std::cell::Cell<bool>,
}

/// Launch shape of the one-warp-per-row kernels for `rows` (`None` for widths past
/// [`WARP_ROW_MAX_D`]: one block per row).
fn warp_rows_cfg(rows: usize, d: usize) -> Option<LaunchConfig> {
    (d <= WARP_ROW_MAX_D).then(|| LaunchConfig {
        grid_dim: (rows.div_ceil(WARP_ROWS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * WARP_ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl Norm {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_norm", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Norm {
            gpu: gpu.clone(),
            fwd: f("rmsnorm_fwd")?,
            fwd_bf16: f("rmsnorm_fwd_bf16")?,
            fwd_both: f("rmsnorm_fwd_both")?,
            fwd_add: f("add_rmsnorm_fwd")?,
            bwd_dx: f("rmsnorm_bwd_dx")?,
            dw_partial: f("rmsnorm_bwd_dw_partial")?,
            dw_reduce: f("rmsnorm_bwd_dw_reduce")?,
            fwd_w: f("rmsnorm_fwd_w")?,
            fwd_bf16_w: f("rmsnorm_fwd_bf16_w")?,
            fwd_both_w: f("rmsnorm_fwd_both_w")?,
            bwd_dx_w: f("rmsnorm_bwd_dx_w")?,
            block_rows: std::cell::Cell::new(false),
        })
    }

    /// Runs every width on the one-block-per-row kernels (`true`), as widths past
    /// [`WARP_ROW_MAX_D`] always do, instead of one warp per row up to it (`false`, the
    /// default). Same bits either way; for tests that compare the two.
    pub fn set_block_rows(&self, on: bool) {
        self.block_rows.set(on);
    }

    /// The one-block-per-row kernel `block` with its launch shape `cfg`, or its
    /// one-warp-per-row twin `warp` (same arguments, same bits) where the width allows it.
    fn pick<'a>(
        &self,
        block: &'a CudaFunction,
        warp: &'a CudaFunction,
        cfg: LaunchConfig,
        rows: usize,
        d: usize,
    ) -> (&'a CudaFunction, LaunchConfig) {
        match warp_rows_cfg(rows, d) {
            Some(w) if !self.block_rows.get() => (warp, w),
            _ => (block, cfg),
        }
    }

    /// The forward kernels' checks (x, w, each named output of `rows · d` elements, rstd) and
    /// launch shape (one block of [`row_threads`] per row); `None` when there is nothing to do.
    fn forward_cfg(
        &self,
        x: usize,
        w: usize,
        outs: &[(&str, usize)],
        rstd: usize,
        rows: usize,
        d: usize,
    ) -> Result<Option<LaunchConfig>, DeviceError> {
        let g = &self.gpu;
        check_dims(g, "rmsnorm forward", rows, d)?;
        check_len(g, "rmsnorm forward x", x, rows * d)?;
        check_len(g, "rmsnorm forward w", w, d)?;
        for &(name, len) in outs {
            check_len(g, &format!("rmsnorm forward {name}"), len, rows * d)?;
        }
        check_len(g, "rmsnorm forward rstd", rstd, rows)?;
        if rows == 0 || d == 0 {
            return Ok(None);
        }
        Ok(Some(LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (row_threads(d), 1, 1),
            shared_mem_bytes: 0,
        }))
    }

    /// RMSNorm forward: `x: [rows, d]`, `w: [d]` → `y: [rows, d]`, `rstd: [rows]` with
    /// `rstd[r] = 1/sqrt(Σ_j x[r,j]²/d + eps)`, `y[r,j] = (x[r,j]·rstd[r])·w[j]`; f32
    /// accumulation. Reference: `mxrl_tensor::norm::rmsnorm_forward`.
    ///
    /// # Errors
    /// Short buffers, a shape too large for one launch; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        rstd: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        self.forward_to((&self.fwd, &self.fwd_w), x, w, y, rstd, rows, d, eps)
    }

    /// [`Norm::forward`] writing `y` as BF16 bit patterns (round to nearest even): the forward
    /// followed by a BF16 conversion, in one pass and bitwise the same.
    ///
    /// # Errors
    /// As [`Norm::forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_bf16(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, u16>,
        rstd: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        self.forward_to(
            (&self.fwd_bf16, &self.fwd_bf16_w),
            x,
            w,
            y,
            rstd,
            rows,
            d,
            eps,
        )
    }

    /// The launch of [`Norm::forward`] / [`Norm::forward_bf16`]: `kernels` = (one block per
    /// row, one warp per row), `y`'s elements f32 or BF16 bit patterns.
    #[allow(clippy::too_many_arguments)]
    fn forward_to<T: cudarc::driver::DeviceRepr>(
        &self,
        (block, warp): (&CudaFunction, &CudaFunction),
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, T>,
        rstd: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let Some(cfg) =
            self.forward_cfg(x.len(), w.len(), &[("y", y.len())], rstd.len(), rows, d)?
        else {
            return Ok(());
        };
        let (d32, rows32) = (d as u32, rows as u32);
        let (f, cfg) = self.pick(block, warp, cfg, rows, d);
        let mut b = self.gpu.stream().launch_builder(f);
        b.arg(x)
            .arg(w)
            .arg(y)
            .arg(rstd)
            .arg(&rows32)
            .arg(&d32)
            .arg(&eps);
        // SAFETY: row r < rows (one block, or one warp with the rest returning) reads
        // x[r·d .. (r+1)·d] and w[..d], writes the same range of y and rstd[r]; every buffer
        // holds at least that (checked above); both kernel pairs take (const float*,
        // const float*, T*, float*, u32, u32, float) with T the element type of `y` (float for
        // `fwd`, u16 for `fwd_bf16`), which the callers pass.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// [`Norm::forward`] into `y` and [`Norm::forward_bf16`]'s output into `yb`, in one
    /// pass (the same bits as the two).
    ///
    /// # Errors
    /// Short buffers, a shape too large for one launch; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_both(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        yb: &mut CudaViewMut<'_, u16>,
        rstd: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let Some(cfg) = self.forward_cfg(
            x.len(),
            w.len(),
            &[("y", y.len()), ("yb", yb.len())],
            rstd.len(),
            rows,
            d,
        )?
        else {
            return Ok(());
        };
        let (d32, rows32) = (d as u32, rows as u32);
        let (f, cfg) = self.pick(&self.fwd_both, &self.fwd_both_w, cfg, rows, d);
        let mut b = self.gpu.stream().launch_builder(f);
        b.arg(x)
            .arg(w)
            .arg(y)
            .arg(yb)
            .arg(rstd)
            .arg(&rows32)
            .arg(&d32)
            .arg(&eps);
        // SAFETY: as `forward`, also writing yb[r·d .. (r+1)·d] (checked); argument types match
        // (const float*, const float*, float*, u16*, float*, u32, u32, float).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// The residual sum `x += res` (`x, res: [rows, d]`, the f32 sum of `add_inplace`) and
    /// the forward of the new `x` into `y` (f32) and/or `yb` (BF16 bits), in one pass: the
    /// bits of the add followed by [`Norm::forward`], [`Norm::forward_bf16`] or
    /// [`Norm::forward_both`]. At least one of `y`, `yb`.
    ///
    /// # Errors
    /// Neither output, short buffers, a shape too large for one launch; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        res: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        y: Option<&mut CudaViewMut<'_, f32>>,
        yb: Option<&mut CudaViewMut<'_, u16>>,
        rstd: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let mut outs = vec![("res", res.len())];
        if let Some(y) = &y {
            outs.push(("y", y.len()));
        }
        if let Some(yb) = &yb {
            outs.push(("yb", yb.len()));
        }
        if outs.len() == 1 {
            return Err(self
                .gpu
                .err("rmsnorm forward with a residual: neither an f32 nor a BF16 output"));
        }
        let Some(cfg) = self.forward_cfg(x.len(), w.len(), &outs, rstd.len(), rows, d)? else {
            return Ok(());
        };
        let (d32, null) = (d as u32, 0u64);
        let mut b = self.gpu.stream().launch_builder(&self.fwd_add);
        b.arg(&mut *x).arg(res).arg(w);
        match y {
            Some(y) => b.arg(y),
            None => b.arg(&null),
        };
        match yb {
            Some(yb) => b.arg(yb),
            None => b.arg(&null),
        };
        b.arg(rstd).arg(&d32).arg(&eps);
        // SAFETY: block r < rows reads and writes x[r·d .. (r+1)·d], reads that range of res
        // and w[..d], writes that range of each output that is not null and rstd[r]; every
        // buffer holds at least that (checked above); argument types match (float*, const
        // float*, const float*, float*, u16* — a missing output passed as a 0 u64 — float*,
        // u32, float).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// RMSNorm backward: `dy, x: [rows, d]`, `w: [d]`, `rstd: [rows]` (from the forward) →
    /// `dx: [rows, d]` (overwritten) and `dw: [d]` (**accumulated**, `+=`):
    /// `dx[r,j] = (rstd·w[j])·dy[r,j] − x[r,j]·(Σ_i w[i]·dy[r,i]·x[r,i])·rstd³/d`,
    /// `dw[j] += Σ_r (dy[r,j]·x[r,j])·rstd[r]`. f32 accumulation. `dw` is summed
    /// deterministically: per chunk of rows into `scratch: [chunks, d]`
    /// ([`backward_scratch_len`]), then over the chunks in order. Reference:
    /// `mxrl_tensor::norm::rmsnorm_backward`.
    ///
    /// # Errors
    /// Short buffers, a shape too large for one launch; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dy: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        rstd: &CudaView<'_, f32>,
        dx: &mut CudaViewMut<'_, f32>,
        dw: &mut CudaViewMut<'_, f32>,
        scratch: &mut CudaViewMut<'_, f32>,
        rows: usize,
        d: usize,
    ) -> Result<(), DeviceError> {
        check_dims(&self.gpu, "rmsnorm backward", rows, d)?;
        check_len(&self.gpu, "rmsnorm backward dy", dy.len(), rows * d)?;
        check_len(&self.gpu, "rmsnorm backward x", x.len(), rows * d)?;
        check_len(&self.gpu, "rmsnorm backward w", w.len(), d)?;
        check_len(&self.gpu, "rmsnorm backward rstd", rstd.len(), rows)?;
        check_len(&self.gpu, "rmsnorm backward dx", dx.len(), rows * d)?;
        check_len(&self.gpu, "rmsnorm backward dw", dw.len(), d)?;
        check_len(
            &self.gpu,
            "rmsnorm backward scratch",
            scratch.len(),
            backward_scratch_len(rows, d),
        )?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let d32 = d as u32;
        let rows32 = rows as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (row_threads(d), 1, 1),
            shared_mem_bytes: 0,
        };
        let (f, cfg) = self.pick(&self.bwd_dx, &self.bwd_dx_w, cfg, rows, d);
        let mut b = self.gpu.stream().launch_builder(f);
        b.arg(dy)
            .arg(x)
            .arg(w)
            .arg(rstd)
            .arg(&mut *dx)
            .arg(&rows32)
            .arg(&d32);
        // SAFETY: row r < rows (one block, or one warp with the rest returning) reads dy, x
        // rows r (rows·d checked), w[..d], rstd[r] and writes dx row r (rows·d checked); types
        // match (4 × const float*, float*, u32, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;

        let rpc = rows_per_chunk(rows);
        let chunks = rows.div_ceil(rpc);
        let rpc32 = rpc as u32;
        let chunks32 = chunks as u32;
        let col_blocks = d.div_ceil(128) as u32;
        let cfg = LaunchConfig {
            grid_dim: (col_blocks, chunks as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.dw_partial);
        b.arg(dy)
            .arg(x)
            .arg(rstd)
            .arg(&mut *scratch)
            .arg(&rows32)
            .arg(&d32)
            .arg(&rpc32);
        // SAFETY: thread (column j < d, chunk c < chunks) reads dy, x at rows of chunk c (all
        // < rows, rows·d checked) and rstd of those rows, and writes scratch[c·d + j]
        // (chunks·d checked via backward_scratch_len); chunks ≤ 65 535 by rows_per_chunk.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;

        let cfg = LaunchConfig {
            grid_dim: (col_blocks, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.dw_reduce);
        let partial = scratch.slice(..);
        b.arg(&partial).arg(dw).arg(&chunks32).arg(&d32);
        // SAFETY: thread j < d reads scratch[c·d + j] for c < chunks (checked) and updates
        // dw[j] (d checked); types match (const float*, float*, u32, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
