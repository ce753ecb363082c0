//! Small engine ops (kernels `kernels/ops_engine.cu`): bias add and its gradient, scaling,
//! the prefill KV-cache fill, block copies. Bitwise with `mxrl_tensor::device::CpuBackend`.
#![allow(unsafe_code)]

use super::check_len as check;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_engine.cu");

const THREADS: u32 = 256;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The loaded kernels.
pub struct EngineOps {
    gpu: Gpu,
    add_bias: CudaFunction,
    bias_backward: CudaFunction,
    kv_fill: CudaFunction,
    copy_blocks_u16: CudaFunction,
    copy_blocks_u32: CudaFunction,
}

impl EngineOps {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_engine", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(EngineOps {
            gpu: gpu.clone(),
            add_bias: f("add_bias")?,
            bias_backward: f("bias_backward")?,
            kv_fill: f("kv_fill")?,
            copy_blocks_u16: f("copy_blocks_u16")?,
            copy_blocks_u32: f("copy_blocks_u32")?,
        })
    }

    /// `y[r, j] += b[j]` for `r < rows`, `j < n`.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn add_bias(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        b: &CudaView<'_, f32>,
        rows: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        check(&self.gpu, "add_bias y", y.len(), rows * n)?;
        check(&self.gpu, "add_bias b", b.len(), n)?;
        if rows * n == 0 {
            return Ok(());
        }
        let (r, c) = (rows as u64, n as u64);
        let mut l = self.gpu.stream().launch_builder(&self.add_bias);
        l.arg(y).arg(b).arg(&r).arg(&c);
        // SAFETY: thread i < rows·n reads b[i % n] and updates y[i]; lengths checked above.
        unsafe { crate::gpu::launch_op(&mut l, grid(rows * n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// `db[j] += Σ_r dy[r, j]` in row order.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn bias_backward(
        &self,
        dy: &CudaView<'_, f32>,
        db: &mut CudaViewMut<'_, f32>,
        rows: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        check(&self.gpu, "bias_backward dy", dy.len(), rows * n)?;
        check(&self.gpu, "bias_backward db", db.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (r, c) = (rows as u64, n as u64);
        let mut l = self.gpu.stream().launch_builder(&self.bias_backward);
        l.arg(dy).arg(db).arg(&r).arg(&c);
        // SAFETY: thread j < n reads dy[r·n + j] for r < rows and updates db[j]; checked above.
        unsafe { crate::gpu::launch_op(&mut l, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Writes packed prefill rows `k, v: [N, w]` into BF16 caches `[slots, max_len, w]`: row
    /// `r` of sequence `row_seq[r]` at position `r − offsets[row_seq[r]]`. The caller
    /// guarantees every sequence fits (`len ≤ max_len`) and `row_seq`/`offsets` describe the
    /// packed batch.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_fill(
        &self,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        row_seq: &CudaView<'_, u32>,
        offsets: &CudaView<'_, u32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        rows: usize,
        slots: usize,
        w: usize,
        max_len: usize,
    ) -> Result<(), DeviceError> {
        check(&self.gpu, "kv_fill k", k.len(), rows * w)?;
        check(&self.gpu, "kv_fill v", v.len(), rows * w)?;
        check(&self.gpu, "kv_fill row_seq", row_seq.len(), rows)?;
        check(&self.gpu, "kv_fill offsets", offsets.len(), slots)?;
        check(
            &self.gpu,
            "kv_fill k_cache",
            k_cache.len(),
            slots * max_len * w,
        )?;
        check(
            &self.gpu,
            "kv_fill v_cache",
            v_cache.len(),
            slots * max_len * w,
        )?;
        if rows == 0 {
            return Ok(());
        }
        let (w64, ml) = (w as u64, max_len as u64);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.gpu.stream().launch_builder(&self.kv_fill);
        l.arg(k)
            .arg(v)
            .arg(row_seq)
            .arg(offsets)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&w64)
            .arg(&ml);
        // SAFETY: block r < rows reads k, v row r (rows·w checked) and writes cache row
        // (b·max_len + p)·w.. with b = row_seq[r] < slots and p = r − offsets[b] < max_len (the
        // caller's contract on the packed layout); cache lengths checked above.
        unsafe { crate::gpu::launch_op(&mut l, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Block copies of 2-byte elements: `dst[map[2j+1]·block ..][..block] =
    /// src[map[2j]·block ..][..block]` for `j < count`; pairs naming a block outside either
    /// buffer are skipped (the map lives on the device).
    ///
    /// # Errors
    /// A short map; launch errors.
    pub fn copy_blocks_u16(
        &self,
        src: &CudaView<'_, u16>,
        dst: &mut CudaViewMut<'_, u16>,
        map: &CudaView<'_, u32>,
        block: usize,
        count: usize,
    ) -> Result<(), DeviceError> {
        self.copy_blocks(&self.copy_blocks_u16, src, dst, map, block, count)
    }

    /// [`EngineOps::copy_blocks_u16`] for 4-byte elements (f32 or u32, copied as bits).
    ///
    /// # Errors
    /// A short map; launch errors.
    pub fn copy_blocks_u32<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        map: &CudaView<'_, u32>,
        block: usize,
        count: usize,
    ) -> Result<(), DeviceError> {
        assert_eq!(
            std::mem::size_of::<T>(),
            4,
            "copy_blocks_u32 copies 4-byte elements"
        );
        self.copy_blocks(&self.copy_blocks_u32, src, dst, map, block, count)
    }

    fn copy_blocks<T: cudarc::driver::DeviceRepr>(
        &self,
        f: &CudaFunction,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
        map: &CudaView<'_, u32>,
        block: usize,
        count: usize,
    ) -> Result<(), DeviceError> {
        check(&self.gpu, "copy_blocks map", map.len(), 2 * count)?;
        if block * count == 0 {
            return Ok(());
        }
        // Whole blocks in each buffer: the kernel skips pairs naming any other.
        let (src_blocks, dst_blocks) = (src.len() / block, dst.len() / block);
        let (b64, c64, s64, d64) = (
            block as u64,
            count as u64,
            src_blocks as u64,
            dst_blocks as u64,
        );
        let mut l = self.gpu.stream().launch_builder(f);
        l.arg(src)
            .arg(dst)
            .arg(map)
            .arg(&b64)
            .arg(&c64)
            .arg(&s64)
            .arg(&d64);
        // SAFETY: thread i < count·block reads map[2j], map[2j+1] (j = i / block < count, the
        // map's length checked above) and copies one element between blocks that lie inside
        // src (src_blocks whole blocks) and dst (dst_blocks), the kernel skipping any other.
        unsafe { crate::gpu::launch_op(&mut l, grid(block * count)) }
            .map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
