//! MoE dispatch on the device, gather, combine and their backward (kernels
//! `kernels/ops_moe.cu`).
//!
//! # Layout
//! For `N` tokens routed to `k` slots each over `E` experts (`ids: [N, k]` u32, flat index
//! `i = t·k + s`), [`Moe::dispatch`] builds, with no host round trip (so a decode step can be
//! captured in a CUDA graph) and deterministically (prefix sums, no atomics):
//! - `offsets: [E + 1]` u32 — expert `x` owns packed rows `offsets[x] .. offsets[x+1]`;
//! - `perm: [N·k]` u32 — packed row `p` → flat index `t·k + s` (`token = perm[p] / k`,
//!   `slot = perm[p] % k`), expert-major and in increasing flat index within an expert: exactly
//!   the entry order of `mxrl_tensor::moe::Dispatch` (its `entries[p] = (perm[p]/k, perm[p]%k)`,
//!   its `starts = offsets`);
//! - `row_of: [N·k]` u32 — the inverse: flat index → packed row.
//!
//! The packed activations (`[N·k, H]`, expert-major: the grouped GEMM's operand) come from
//! [`Moe::gather`] (f32) or [`Moe::gather_bf16`] (bf16 bit patterns). After the experts,
//! [`Moe::combine`] sums each token's rows weighted by its combine weights; the backward ops are
//! [`Moe::combine_backward`] and [`Moe::gather_backward`].
//!
//! # Numerics
//! Combine and gather backward sum a token's rows from `0.0` in ascending packed row order, which
//! is ascending expert order — the order in which the CPU reference (called per expert
//! `0..E` into a zeroed output) visits them — with f32 `+`/`·` and no FMA contraction: given
//! equal inputs they are **bitwise** equal to `combine_forward` / `gather_backward`. The dy rows
//! of the combine backward are single products (bitwise); its dweights are length-`H` dot
//! products in a fixed tree (bound: `mxrl_tensor::tolerance::two_order_sum_bound`).
//!
//! Ids `≥ E` are a caller error (the router writes valid ids; replayed ids are validated on the
//! host before upload); the kernels never touch memory out of bounds for them: such slots get
//! `row_of = u32::MAX`, no packed row, contribute nothing and get a zero dweight.
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_moe.cu");

/// Threads per dispatch block (`MOE_THREADS` in the kernel source): flat entries per block.
const DISPATCH_THREADS: usize = 256;
/// Warps per dispatch block.
const DISPATCH_WARPS: usize = DISPATCH_THREADS / 32;
/// Largest expert count the dispatch kernels accept (`MOE_MAX_EXPERTS`).
pub const MAX_EXPERTS: usize = 1024;
/// Largest `k` the combine / gather-backward kernels accept (`MOE_MAX_TOP_K`).
pub const MAX_TOP_K: usize = 256;
/// `row_of` value of a slot whose id was `≥ E`.
pub const INVALID_ROW: u32 = u32::MAX;

const THREADS: u32 = 256;
/// Threads per block of the per-token kernels (combine, gather backward; 4 columns each).
const TOKEN_THREADS: u32 = 128;
/// The single-launch dispatch (`moe_dispatch_small`) handles up to this many entries `N·k`
/// (its block size) ...
const SMALL_DISPATCH_ENTRIES: usize = 1024;
/// ... and up to this many experts (its shared-memory table).
const SMALL_DISPATCH_EXPERTS: usize = 256;

/// Number of dispatch blocks for `n·k` entries.
fn dispatch_blocks(n: usize, k: usize) -> usize {
    (n * k).div_ceil(DISPATCH_THREADS).max(1)
}

/// Length (u32 elements) of the scratch buffer [`Moe::dispatch`] needs for `n` tokens, `k`
/// slots and `e` experts (per-block expert counts, `E · ⌈N·k / 256⌉`). Allocate it once per
/// shape bucket; the dispatch allocates nothing.
pub fn dispatch_scratch_len(n: usize, k: usize, e: usize) -> usize {
    e * dispatch_blocks(n, k)
}

/// The loaded kernels.
pub struct Moe {
    gpu: Gpu,
    hist: CudaFunction,
    scan: CudaFunction,
    scatter: CudaFunction,
    dispatch_small: CudaFunction,
    gather_f32: CudaFunction,
    gather_bf16: CudaFunction,
    gather_u16: CudaFunction,
    combine: CudaFunction,
    gather_bwd: CudaFunction,
    combine_bwd: CudaFunction,
    combine_bwd_bf16: CudaFunction,
}

impl Moe {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_moe", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Moe {
            gpu: gpu.clone(),
            hist: f("moe_hist")?,
            scan: f("moe_scan")?,
            scatter: f("moe_scatter")?,
            dispatch_small: f("moe_dispatch_small")?,
            gather_f32: f("moe_gather_f32")?,
            gather_bf16: f("moe_gather_bf16")?,
            gather_u16: f("moe_gather_rows_u16")?,
            combine: f("moe_combine")?,
            gather_bwd: f("moe_gather_bwd")?,
            combine_bwd: f("moe_combine_bwd")?,
            combine_bwd_bf16: f("moe_combine_bwd_bf16")?,
        })
    }

    fn check_shape(&self, what: &str, n: usize, e: usize, k: usize) -> Result<(), DeviceError> {
        if e == 0 || e > MAX_EXPERTS {
            return Err(self
                .gpu
                .err(format!("{what}: {e} experts; 1..={MAX_EXPERTS} supported")));
        }
        if k == 0 || k > MAX_TOP_K {
            return Err(self
                .gpu
                .err(format!("{what}: top_k {k}; 1..={MAX_TOP_K} supported")));
        }
        if n.checked_mul(k).is_none_or(|t| t > i32::MAX as usize) {
            return Err(self.gpu.err(format!(
                "{what}: {n} tokens × {k} slots exceed 2³¹ − 1 rows"
            )));
        }
        Ok(())
    }

    /// Builds the dispatch of `ids: [N, k]` (u32, each `< E`) on the device: writes
    /// `offsets: [E + 1]`, `perm: [N·k]` and `row_of: [N·k]` (module doc), using `scratch`
    /// (≥ [`dispatch_scratch_len`] u32). Integer prefix sums only: deterministic.
    /// One launch for `N·k ≤ 1024` and `E ≤ 256` (decode), else three (per-block counts, scan,
    /// scatter). Reference: `mxrl_tensor::moe::Dispatch::new` (equal, element for element).
    ///
    /// # Errors
    /// `E` outside `1..=1024`, `k` outside `1..=256`, `N·k ≥ 2³¹`, short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch(
        &self,
        ids: &CudaView<'_, u32>,
        n: usize,
        e: usize,
        k: usize,
        scratch: &mut CudaViewMut<'_, u32>,
        offsets: &mut CudaViewMut<'_, u32>,
        perm: &mut CudaViewMut<'_, u32>,
        row_of: &mut CudaViewMut<'_, u32>,
    ) -> Result<(), DeviceError> {
        self.check_shape("moe dispatch", n, e, k)?;
        let total = n * k;
        check_len(&self.gpu, "moe dispatch ids", ids.len(), total)?;
        check_len(
            &self.gpu,
            "moe dispatch scratch",
            scratch.len(),
            dispatch_scratch_len(n, k, e),
        )?;
        check_len(&self.gpu, "moe dispatch offsets", offsets.len(), e + 1)?;
        check_len(&self.gpu, "moe dispatch perm", perm.len(), total)?;
        check_len(&self.gpu, "moe dispatch row_of", row_of.len(), total)?;
        if total <= SMALL_DISPATCH_ENTRIES && e <= SMALL_DISPATCH_EXPERTS {
            let (total32, e32) = (total as u32, e as u32);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (SMALL_DISPATCH_ENTRIES as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.gpu.stream().launch_builder(&self.dispatch_small);
            b.arg(ids)
                .arg(&total32)
                .arg(&e32)
                .arg(&mut *offsets)
                .arg(&mut *perm)
                .arg(&mut *row_of);
            // SAFETY: one block of 1024 threads; thread i reads ids[i] only when i < N·k ≤ 1024
            // (checked length), writes row_of[i] (N·k checked) and perm[pos], pos < offsets[E]
            // ≤ N·k; offsets[0..=E] (E + 1 checked); static shared memory sized for E ≤ 256
            // (checked above); types (const u32*, u32, u32, u32*, u32*, u32*).
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
            return Ok(());
        }
        let g = dispatch_blocks(n, k);
        let (total64, e32, g32) = (total as u64, e as u32, g as u32);
        let cfg = LaunchConfig {
            grid_dim: (g32, 1, 1),
            block_dim: (DISPATCH_THREADS as u32, 1, 1),
            shared_mem_bytes: (DISPATCH_WARPS * e * 4) as u32,
        };
        let mut b = self.gpu.stream().launch_builder(&self.hist);
        b.arg(ids)
            .arg(&total64)
            .arg(&e32)
            .arg(&mut *scratch)
            .arg(&g32);
        // SAFETY: block b, thread j reads ids[b·256 + j] only when < N·k (checked length); the
        // block writes hist[x·G + b] for x < E (E·G = scratch length checked); dynamic shared
        // memory holds 8·E u32 (E ≤ 1024: 32 KiB); types (const u32*, u64, u32, u32*, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        let scan_cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.scan);
        b.arg(&mut *scratch).arg(&e32).arg(&g32).arg(&mut *offsets);
        // SAFETY: one block reads/writes hist[x·G + b], x < E, b < G (E·G checked) and writes
        // offsets[0..=E] (E + 1 checked); static shared memory sized for E ≤ 1024 (checked);
        // types (u32*, u32, u32, u32*).
        unsafe { crate::gpu::launch_op(&mut b, scan_cfg) }.map_err(|x| self.gpu.err(x))?;
        let mut b = self.gpu.stream().launch_builder(&self.scatter);
        b.arg(ids)
            .arg(&total64)
            .arg(&e32)
            .arg(&mut *scratch)
            .arg(&g32)
            .arg(&mut *perm)
            .arg(&mut *row_of);
        // SAFETY: as moe_hist for ids and shared memory; reads bases[x·G + b] (checked); writes
        // row_of[i] for i < N·k and perm[pos] with pos < offsets[E] ≤ N·k (a permutation of the
        // valid entries; lengths checked); types (const u32*, u64, u32, const u32*, u32, u32*,
        // u32*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn check_gather(
        &self,
        what: &str,
        x_len: usize,
        perm_len: usize,
        offsets_len: usize,
        out_len: usize,
        n: usize,
        h: usize,
        e: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_shape(what, n, e, k)?;
        check_len(&self.gpu, &format!("{what} x"), x_len, n * h)?;
        check_len(&self.gpu, &format!("{what} perm"), perm_len, n * k)?;
        check_len(&self.gpu, &format!("{what} offsets"), offsets_len, e + 1)?;
        check_len(&self.gpu, &format!("{what} out"), out_len, n * k * h)?;
        Ok(())
    }

    fn rows_cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Gathers `x: [N, H]` f32 into the expert-major packed buffer `out: [N·k, H]` f32:
    /// `out[p] = x[perm[p] / k]` for `p < offsets[E]` (read on the device). `perm`, `offsets`
    /// from [`Moe::dispatch`]. Exact copies. Reference: `mxrl_tensor::moe::gather` of each
    /// expert's rows, concatenated in expert order.
    ///
    /// # Errors
    /// Shape limits as [`Moe::dispatch`]; short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &self,
        x: &CudaView<'_, f32>,
        perm: &CudaView<'_, u32>,
        offsets: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        e: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_gather(
            "moe gather",
            x.len(),
            perm.len(),
            offsets.len(),
            out.len(),
            n,
            h,
            e,
            k,
        )?;
        if n == 0 || h == 0 {
            return Ok(());
        }
        let (e32, k32, h64) = (e as u32, k as u32, h as u64);
        let mut b = self.gpu.stream().launch_builder(&self.gather_f32);
        b.arg(x)
            .arg(perm)
            .arg(offsets)
            .arg(&e32)
            .arg(&k32)
            .arg(&h64)
            .arg(out);
        // SAFETY: block p < N·k returns unless p < offsets[E] (≤ N·k by construction); it reads
        // perm[p] (N·k checked), x row perm[p]/k < N (perm holds flat indices < N·k), writes out
        // row p (N·k·H checked); types (const float*, const u32*, const u32*, u32, u32, u64,
        // float*).
        unsafe { crate::gpu::launch_op(&mut b, Self::rows_cfg(n * k)) }
            .map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// As [`Moe::gather`], writing `bf16(x)` bit patterns (round to nearest even, the rule of
    /// `mxrl_tensor::precision::round_bf16`) into `out: [N·k, H]` u16: the grouped GEMM's
    /// BF16 operand.
    ///
    /// # Errors
    /// As [`Moe::gather`].
    #[allow(clippy::too_many_arguments)]
    pub fn gather_bf16(
        &self,
        x: &CudaView<'_, f32>,
        perm: &CudaView<'_, u32>,
        offsets: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, u16>,
        n: usize,
        h: usize,
        e: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_gather(
            "moe gather_bf16",
            x.len(),
            perm.len(),
            offsets.len(),
            out.len(),
            n,
            h,
            e,
            k,
        )?;
        if n == 0 || h == 0 {
            return Ok(());
        }
        let (e32, k32, h64) = (e as u32, k as u32, h as u64);
        let mut b = self.gpu.stream().launch_builder(&self.gather_bf16);
        b.arg(x)
            .arg(perm)
            .arg(offsets)
            .arg(&e32)
            .arg(&k32)
            .arg(&h64)
            .arg(out);
        // SAFETY: as `gather`, with u16 output rows (N·k·H checked); types (const float*,
        // const u32*, const u32*, u32, u32, u64, u16*).
        unsafe { crate::gpu::launch_op(&mut b, Self::rows_cfg(n * k)) }
            .map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// As [`Moe::gather_bf16`] from rows already in BF16 (`x: [N, H]` u16 bit patterns): the
    /// rounding happened once, where the rows were made.
    ///
    /// # Errors
    /// As [`Moe::gather_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows_bf16(
        &self,
        x: &CudaView<'_, u16>,
        perm: &CudaView<'_, u32>,
        offsets: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, u16>,
        n: usize,
        h: usize,
        e: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_gather(
            "moe gather_rows_bf16",
            x.len(),
            perm.len(),
            offsets.len(),
            out.len(),
            n,
            h,
            e,
            k,
        )?;
        if n == 0 || h == 0 {
            return Ok(());
        }
        let (e32, k32, h64) = (e as u32, k as u32, h as u64);
        let mut b = self.gpu.stream().launch_builder(&self.gather_u16);
        b.arg(x)
            .arg(perm)
            .arg(offsets)
            .arg(&e32)
            .arg(&k32)
            .arg(&h64)
            .arg(out);
        // SAFETY: as `gather`, with u16 input and output rows (N·H and N·k·H checked); types
        // (const u16*, const u32*, const u32*, u32, u32, u64, u16*).
        unsafe { crate::gpu::launch_op(&mut b, Self::rows_cfg(n * k)) }
            .map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Grid of the per-token row kernels: one block row per token, each thread 4 columns.
    fn token_cols_cfg(&self, what: &str, n: usize, h: usize) -> Result<LaunchConfig, DeviceError> {
        let per_block = 4 * TOKEN_THREADS as usize;
        let cols = h.div_ceil(per_block);
        if cols > 65_535 {
            return Err(self.gpu.err(format!(
                "{what}: hidden size {h} exceeds {}",
                65_535 * per_block
            )));
        }
        Ok(LaunchConfig {
            grid_dim: (n as u32, cols as u32, 1),
            block_dim: (TOKEN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Combine forward: `out[t] = Σ_s weights[t, s] · y[row_of[t, s]]` (`y: [N·k, H]` packed
    /// expert outputs, `weights: [N, k]` f32, `row_of` from [`Moe::dispatch`], `out: [N, H]`
    /// f32, overwritten). Per token, f32 sum from 0 in ascending expert order: bitwise equal to
    /// `mxrl_tensor::moe::combine_forward` called for experts `0..E` into a zeroed output.
    ///
    /// # Errors
    /// Shape limits as [`Moe::dispatch`] (`E` is not needed); short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.combine_impl(y, weights, row_of, out, n, h, k, None)
    }

    /// [`Moe::combine`] then `out += residual` (`residual: [N, H]`), in one pass and bitwise
    /// the same as the combine followed by an element-wise add.
    ///
    /// # Errors
    /// As [`Moe::combine`], and a short residual.
    #[allow(clippy::too_many_arguments)]
    pub fn combine_add(
        &self,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        residual: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.combine_impl(y, weights, row_of, out, n, h, k, Some(residual))
    }

    #[allow(clippy::too_many_arguments)]
    fn combine_impl(
        &self,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
        residual: Option<&CudaView<'_, f32>>,
    ) -> Result<(), DeviceError> {
        self.check_shape("moe combine", n, 1, k)?;
        check_len(&self.gpu, "moe combine y", y.len(), n * k * h)?;
        check_len(&self.gpu, "moe combine weights", weights.len(), n * k)?;
        check_len(&self.gpu, "moe combine row_of", row_of.len(), n * k)?;
        check_len(&self.gpu, "moe combine out", out.len(), n * h)?;
        if let Some(r) = residual {
            check_len(&self.gpu, "moe combine residual", r.len(), n * h)?;
        }
        if n == 0 || h == 0 {
            return Ok(());
        }
        let cfg = self.token_cols_cfg("moe combine", n, h)?;
        let (k32, h64) = (k as u32, h as u64);
        let mut b = self.gpu.stream().launch_builder(&self.combine);
        b.arg(y)
            .arg(weights)
            .arg(row_of)
            .arg(out)
            .arg(&k32)
            .arg(&h64);
        let null: u64 = 0;
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        // SAFETY: block (t < N, c) reads row_of/weights[t·k .. t·k + k] (N·k checked), y rows
        // row_of[..] < N·k (a permutation from `dispatch`; invalid rows skipped) at columns
        // < H (N·k·H checked), reads residual[t·H + j] when given (N·H checked) and writes
        // out[t·H + j], j < H (N·H checked); types (const float*, const float*, const u32*,
        // float*, u32, u64, const float* or a null pointer as a u64 the kernel tests).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Gather backward: `dx[t] = Σ_s dg[row_of[t, s]]` (`dg: [N·k, H]` packed gradients,
    /// `dx: [N, H]` f32, overwritten), per token f32 sum from 0 in ascending expert order:
    /// bitwise equal to `mxrl_tensor::moe::gather_backward` called for experts `0..E` into a
    /// zeroed `dx`.
    ///
    /// # Errors
    /// As [`Moe::combine`].
    pub fn gather_backward(
        &self,
        dg: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        dx: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_shape("moe gather_backward", n, 1, k)?;
        check_len(&self.gpu, "moe gather_backward dg", dg.len(), n * k * h)?;
        check_len(&self.gpu, "moe gather_backward row_of", row_of.len(), n * k)?;
        check_len(&self.gpu, "moe gather_backward dx", dx.len(), n * h)?;
        if n == 0 || h == 0 {
            return Ok(());
        }
        let cfg = self.token_cols_cfg("moe gather_backward", n, h)?;
        let (k32, h64) = (k as u32, h as u64);
        let mut b = self.gpu.stream().launch_builder(&self.gather_bwd);
        b.arg(dg).arg(row_of).arg(dx).arg(&k32).arg(&h64);
        // SAFETY: as `combine` (dg in place of y, no weights); types (const float*,
        // const u32*, float*, u32, u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Combine backward: given `dout: [N, H]` and the packed expert outputs `y: [N·k, H]`,
    /// writes `dy[row_of[t, s]] = weights[t, s] · dout[t]` (`dy: [N·k, H]`, bitwise as the
    /// reference) and `dweights[t, s] = Σ_j dout[t, j] · y[row, j]` (`[N, k]` f32, overwritten;
    /// one warp per slot, f32 partial sums in a fixed tree: deterministic, within
    /// `mxrl_tensor::tolerance::two_order_sum_bound(H, Σ|fl(dout·y)|)` of the reference's
    /// sequential sum). Reference: `mxrl_tensor::moe::combine_backward` per expert into zeroed
    /// dweights.
    ///
    /// # Errors
    /// As [`Moe::combine`].
    #[allow(clippy::too_many_arguments)]
    pub fn combine_backward(
        &self,
        dout: &CudaView<'_, f32>,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        dy: &mut CudaViewMut<'_, f32>,
        dweights: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.combine_backward_to(
            dout,
            y,
            weights,
            row_of,
            &self.combine_bwd,
            dy,
            dweights,
            n,
            h,
            k,
        )
    }

    /// [`Moe::combine_backward`] writing `dy` as its BF16 bit patterns only (the bits of the
    /// f32 op followed by a BF16 conversion; the same `dweights`).
    ///
    /// # Errors
    /// As [`Moe::combine`].
    #[allow(clippy::too_many_arguments)]
    pub fn combine_backward_bf16(
        &self,
        dout: &CudaView<'_, f32>,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        dy: &mut CudaViewMut<'_, u16>,
        dweights: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.combine_backward_to(
            dout,
            y,
            weights,
            row_of,
            &self.combine_bwd_bf16,
            dy,
            dweights,
            n,
            h,
            k,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn combine_backward_to<T: cudarc::driver::DeviceRepr>(
        &self,
        dout: &CudaView<'_, f32>,
        y: &CudaView<'_, f32>,
        weights: &CudaView<'_, f32>,
        row_of: &CudaView<'_, u32>,
        kernel: &CudaFunction,
        dy: &mut CudaViewMut<'_, T>,
        dweights: &mut CudaViewMut<'_, f32>,
        n: usize,
        h: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.check_shape("moe combine_backward", n, 1, k)?;
        check_len(&self.gpu, "moe combine_backward dout", dout.len(), n * h)?;
        check_len(&self.gpu, "moe combine_backward y", y.len(), n * k * h)?;
        check_len(
            &self.gpu,
            "moe combine_backward weights",
            weights.len(),
            n * k,
        )?;
        check_len(
            &self.gpu,
            "moe combine_backward row_of",
            row_of.len(),
            n * k,
        )?;
        check_len(&self.gpu, "moe combine_backward dy", dy.len(), n * k * h)?;
        check_len(
            &self.gpu,
            "moe combine_backward dweights",
            dweights.len(),
            n * k,
        )?;
        if n == 0 {
            return Ok(());
        }
        let (total64, k32, h64) = ((n * k) as u64, k as u32, h as u64);
        let slots_per_block = THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: ((n * k).div_ceil(slots_per_block) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(kernel);
        b.arg(dout)
            .arg(y)
            .arg(weights)
            .arg(row_of)
            .arg(dy)
            .arg(dweights)
            .arg(&total64)
            .arg(&k32)
            .arg(&h64);
        // SAFETY: warp ts < N·k (one per slot, 8 per block; warps past N·k exit) reads
        // row_of[ts], weights[ts] (N·k checked), dout row ts/k < N (N·H checked), y and dy row
        // row_of[ts] < N·k (N·k·H checked; invalid rows skipped) and writes dweights[ts];
        // types (const float* ×3, const u32*, T* (f32, or u16 for the BF16 kernel), float*,
        // u64, u32, u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }
}
