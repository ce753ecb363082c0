//! Elementwise ops and the embedding gather (kernels `kernels/ops_elementwise.cu`).
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_elementwise.cu");

const THREADS: u32 = 256;

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch of a grid-stride reduction over `n` elements: at most 1 024 blocks.
fn stride_grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1024) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The loaded kernels.
pub struct Elementwise {
    gpu: Gpu,
    to_bf16: CudaFunction,
    to_bf16_x8: CudaFunction,
    round_bf16: CudaFunction,
    widen_bf16: CudaFunction,
    checksum_bf16: CudaFunction,
    checksum_u8: CudaFunction,
    capture_routes: CudaFunction,
    capture_rows: CudaFunction,
    add_inplace: CudaFunction,
    add_inplace_x4: CudaFunction,
    embed_gather: CudaFunction,
}

impl Elementwise {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_elementwise", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Elementwise {
            gpu: gpu.clone(),
            to_bf16: f("to_bf16")?,
            to_bf16_x8: f("to_bf16_x8")?,
            round_bf16: f("round_bf16_f32")?,
            widen_bf16: f("widen_bf16")?,
            checksum_bf16: f("checksum_bf16")?,
            checksum_u8: f("checksum_u8")?,
            capture_routes: f("capture_routes")?,
            capture_rows: f("capture_rows")?,
            add_inplace: f("add_inplace")?,
            add_inplace_x4: f("add_inplace_x4")?,
            embed_gather: f("embed_gather")?,
        })
    }

    /// `out[i] = bf16(x[i])` (bit patterns), `i < n`. Reference:
    /// `mxrl_tensor::precision::round_bf16`.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn to_bf16(
        &self,
        x: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "to_bf16 x", x.len(), n)?;
        check_len(&self.gpu, "to_bf16 out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let stream = self.gpu.stream();
        // Eight elements per thread with 16-byte accesses where both views are 16-byte aligned
        // (whole buffers always are; views at other offsets take the element kernel).
        let aligned = x.device_ptr(stream).0.is_multiple_of(16)
            && out.device_ptr_mut(stream).0.is_multiple_of(16);
        if aligned {
            let mut b = stream.launch_builder(&self.to_bf16_x8);
            b.arg(x).arg(out).arg(&n64);
            // SAFETY: thread t reads x[8t..min(8t+8, n)) and writes out[..] alike, with 16-byte
            // accesses only for a whole group of eight (8t + 8 ≤ n) at 16-byte aligned bases
            // (both pointers checked, 8 · 4 and 8 · 2 bytes per group); both hold ≥ n elements
            // (checked); argument types match (const float*, u16*, u64).
            unsafe { crate::gpu::launch_op(&mut b, grid(n.div_ceil(8))) }
                .map_err(|e| self.gpu.err(e))?;
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.to_bf16);
        b.arg(x).arg(out).arg(&n64);
        // SAFETY: thread i < n reads x[i] and writes out[i]; both hold ≥ n elements (checked);
        // argument types match (const float*, u16*, u64).
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// `out[i] = f32(bf16(x[i]))`, `i < n` (round to nearest even). Reference:
    /// `mxrl_tensor::precision::round_bf16`.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn round_bf16(
        &self,
        x: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "round_bf16 x", x.len(), n)?;
        check_len(&self.gpu, "round_bf16 out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.gpu.stream().launch_builder(&self.round_bf16);
        b.arg(x).arg(out).arg(&n64);
        // SAFETY: thread i < n reads x[i] and writes out[i]; both hold ≥ n elements (checked);
        // argument types match (const float*, float*, u64).
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// `out[i] = f32(x[i])` for BF16 bit patterns, `i < n` (exact).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn widen_bf16(
        &self,
        x: &CudaView<'_, u16>,
        out: &mut CudaViewMut<'_, f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "widen_bf16 x", x.len(), n)?;
        check_len(&self.gpu, "widen_bf16 out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let mut b = self.gpu.stream().launch_builder(&self.widen_bf16);
        b.arg(x).arg(out).arg(&n64);
        // SAFETY: thread i < n reads x[i] and writes out[i]; both hold ≥ n elements (checked);
        // argument types match (const u16*, float*, u64).
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Adds the checksum of `x[..n]` (BF16 bit patterns) to the u64 held by `out[2·slot]`,
    /// `out[2·slot + 1]` (low, high word; zero it first): `Σ_i mix64((i << 16) | x[i]) mod
    /// 2⁶⁴`, reference `mxrl_tensor::device::checksum_bf16_bits`. Not cryptographic: it
    /// detects a corrupted or misplaced copy, not a crafted one.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn checksum_bf16(
        &self,
        x: &CudaView<'_, u16>,
        n: usize,
        out: &mut CudaViewMut<'_, u32>,
        slot: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "checksum_bf16 x", x.len(), n)?;
        check_len(&self.gpu, "checksum_bf16 out", out.len(), 2 * slot + 2)?;
        if n == 0 {
            return Ok(());
        }
        let (n64, s64) = (n as u64, slot as u64);
        let mut b = self.gpu.stream().launch_builder(&self.checksum_bf16);
        b.arg(x).arg(&n64).arg(out).arg(&s64);
        // SAFETY: threads read x[i] for i < n (x holds ≥ n, checked) and add atomically to the
        // 8-byte-aligned u64 at out[2·slot] (out holds ≥ 2·slot + 2 u32, checked; device
        // allocations are 256-byte aligned); argument types match (const u16*, u64, u32*, u64).
        unsafe { crate::gpu::launch_op(&mut b, stride_grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Adds the checksum of `n` bytes at positions `base..base + n` to the u64 at
    /// `out[2·slot]`: `Σ_i mix64(((base + i) << 16) | x[i])`, reference
    /// `mxrl_tensor::device::checksum_bytes`.
    ///
    /// # Errors
    /// Short buffers; driver errors.
    pub fn checksum_u8(
        &self,
        x: &CudaView<'_, u8>,
        n: usize,
        base: usize,
        out: &mut CudaViewMut<'_, u32>,
        slot: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "checksum_u8 x", x.len(), n)?;
        check_len(&self.gpu, "checksum_u8 out", out.len(), 2 * slot + 2)?;
        if n == 0 {
            return Ok(());
        }
        let (n64, b64, s64) = (n as u64, base as u64, slot as u64);
        let mut b = self.gpu.stream().launch_builder(&self.checksum_u8);
        b.arg(x).arg(&n64).arg(&b64).arg(out).arg(&s64);
        // SAFETY: threads read x[i] for i < n (x holds ≥ n, checked) and add atomically to the
        // 8-byte-aligned u64 at out[2·slot] (out holds ≥ 2·slot + 2 u32, checked; device
        // allocations are 256-byte aligned); argument types match (const u8*, u64, u64, u32*,
        // u64).
        unsafe { crate::gpu::launch_op(&mut b, stride_grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// [`Elementwise::checksum_u8`] over the little-endian bytes of the f32 values `x`.
    ///
    /// # Errors
    /// Short buffers; driver errors.
    pub fn checksum_f32_bytes(
        &self,
        x: &CudaSlice<f32>,
        base: usize,
        out: &mut CudaViewMut<'_, u32>,
        slot: usize,
    ) -> Result<(), DeviceError> {
        let n = 4 * x.len();
        // SAFETY: u8 has no invalid bit patterns and the view covers exactly x's bytes.
        let bytes = unsafe { x.transmute::<u8>(n) }
            .ok_or_else(|| self.gpu.err("checksum_f32_bytes: byte view of the buffer"))?;
        self.checksum_u8(&bytes, n, base, out, slot)
    }

    /// Copies f32 bit patterns held as u32 (`src`, e.g. the quantizer's amax) into `dst[..n]`
    /// as f32 values (the same bits).
    ///
    /// # Errors
    /// Short buffers; driver errors.
    pub fn copy_f32_bits(
        &self,
        src: &CudaView<'_, u32>,
        dst: &mut CudaSlice<f32>,
        at: usize,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "copy_f32_bits src", src.len(), n)?;
        check_len(&self.gpu, "copy_f32_bits dst", dst.len(), at + n)?;
        let mut d = dst.slice_mut(at..at + n);
        // SAFETY: u32 and f32 have the same size and every bit pattern is a valid f32; the
        // view covers exactly the n destination elements.
        let mut bits = unsafe { d.transmute_mut::<u32>(n) }
            .ok_or_else(|| self.gpu.err("copy_f32_bits: u32 view of the destination"))?;
        self.gpu
            .stream()
            .memcpy_dtod(&src.slice(0..n), &mut bits)
            .map_err(|e| self.gpu.err(e))
    }

    /// Copies routes `ids`, `weights: [rows, k]` into tables `[max_len, slots, k]`: row `r` to
    /// sequence `s = seq[r]` (`r` when `seq` is `None`) at position `p = pos[r]`, table row
    /// `p·slots + s`; rows outside the tables are skipped. Reference:
    /// `CpuBackend::capture_routes` (`mxrl_tensor::device`).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn capture_routes(
        &self,
        ids: &CudaView<'_, u32>,
        weights: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        seq: Option<&CudaView<'_, u32>>,
        pos: &CudaView<'_, u32>,
        slots: usize,
        max_len: usize,
        dst_ids: &mut CudaViewMut<'_, u32>,
        dst_weights: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, "capture_routes ids", ids.len(), rows * k)?;
        check_len(g, "capture_routes weights", weights.len(), rows * k)?;
        check_len(g, "capture_routes pos", pos.len(), rows)?;
        if let Some(s) = seq {
            check_len(g, "capture_routes seq", s.len(), rows)?;
        }
        check_len(
            g,
            "capture_routes dst ids",
            dst_ids.len(),
            slots * max_len * k,
        )?;
        check_len(
            g,
            "capture_routes dst weights",
            dst_weights.len(),
            slots * max_len * k,
        )?;
        if rows == 0 || k == 0 {
            return Ok(());
        }
        let (rows64, k32, has, slots64, len64) = (
            rows as u64,
            k as u32,
            i32::from(seq.is_some()),
            slots as u64,
            max_len as u64,
        );
        let mut b = g.stream().launch_builder(&self.capture_routes);
        b.arg(ids)
            .arg(weights)
            .arg(&rows64)
            .arg(&k32)
            .arg(seq.unwrap_or(pos))
            .arg(&has)
            .arg(pos)
            .arg(&slots64)
            .arg(&len64)
            .arg(dst_ids)
            .arg(dst_weights);
        // SAFETY: thread i < rows·k reads ids[i], weights[i] (rows·k checked), seq[r] and
        // pos[r] (rows checked; `seq` is only read when has_seq, else `pos` stands in), and
        // writes one element of each table at an index below slots·max_len·k (rows whose
        // sequence or position falls outside are skipped in the kernel; table lengths checked);
        // argument types match the kernel's.
        unsafe { crate::gpu::launch_op(&mut b, grid(rows * k)) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Copies rows of `x: [rows, w]` into a table `[len, slots, w]`: row `r` to slot
    /// `s = seq[r]` (`r` when `seq` is `None`) at index `i = pos[r] − first[s]`, table row
    /// `i·slots + s`; rows whose slot or index falls outside the table are skipped. Reference:
    /// `CpuBackend::capture_rows` (`mxrl_tensor::device`).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn capture_rows(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        w: usize,
        seq: Option<&CudaView<'_, u32>>,
        pos: &CudaView<'_, u32>,
        first: &CudaView<'_, u32>,
        slots: usize,
        len: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, "capture_rows x", x.len(), rows * w)?;
        check_len(g, "capture_rows pos", pos.len(), rows)?;
        if let Some(s) = seq {
            check_len(g, "capture_rows seq", s.len(), rows)?;
        }
        check_len(g, "capture_rows first", first.len(), slots)?;
        check_len(g, "capture_rows dst", dst.len(), slots * len * w)?;
        if rows == 0 || w == 0 || slots == 0 || len == 0 {
            return Ok(());
        }
        let (rows64, w64, has, slots64, len64) = (
            rows as u64,
            w as u64,
            i32::from(seq.is_some()),
            slots as u64,
            len as u64,
        );
        let mut b = g.stream().launch_builder(&self.capture_rows);
        b.arg(x)
            .arg(&rows64)
            .arg(&w64)
            .arg(seq.unwrap_or(pos))
            .arg(&has)
            .arg(pos)
            .arg(first)
            .arg(&slots64)
            .arg(&len64)
            .arg(dst);
        // SAFETY: thread i < rows·w reads x[i] (rows·w checked), seq[r] and pos[r] (rows
        // checked; `seq` is only read when has_seq, else `pos` stands in) and first[s] for
        // s < slots (slots checked; larger slots are skipped before the read), and writes one
        // element at an index below slots·len·w (rows outside the table are skipped in the
        // kernel; the table length is checked); argument types match the kernel's (const
        // float*, u64, u64, const u32*, int, const u32*, const u32*, u64, u64, float*).
        unsafe { crate::gpu::launch_op(&mut b, grid(rows * w)) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// `y[i] += x[i]`, `i < n`.
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn add_inplace(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        x: &CudaView<'_, f32>,
        n: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "add y", y.len(), n)?;
        check_len(&self.gpu, "add x", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let stream = self.gpu.stream();
        // Four elements per thread with 16-byte accesses where both views are 16-byte aligned.
        let aligned = x.device_ptr(stream).0.is_multiple_of(16)
            && y.device_ptr_mut(stream).0.is_multiple_of(16);
        if aligned {
            let mut b = stream.launch_builder(&self.add_inplace_x4);
            b.arg(y).arg(x).arg(&n64);
            // SAFETY: thread t reads x, y at [4t, min(4t+4, n)) and writes y there, with 16-byte
            // accesses only for a whole group (4t + 4 ≤ n) at 16-byte aligned bases (checked);
            // both hold ≥ n elements (checked); types match (float*, const float*, u64).
            unsafe { crate::gpu::launch_op(&mut b, grid(n.div_ceil(4))) }
                .map_err(|e| self.gpu.err(e))?;
            return Ok(());
        }
        let mut b = stream.launch_builder(&self.add_inplace);
        b.arg(y).arg(x).arg(&n64);
        // SAFETY: thread i < n reads x[i], y[i] and writes y[i]; both hold ≥ n (checked).
        unsafe { crate::gpu::launch_op(&mut b, grid(n)) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// `out[r] = table[tokens[r]]` for `r < rows`, rows of width `h`. Token ids must be
    /// `< vocab` (checked by the caller on the host, where the ids come from).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn embed_gather(
        &self,
        table: &CudaView<'_, f32>,
        vocab: usize,
        tokens: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
        rows: usize,
        h: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "embed table", table.len(), vocab * h)?;
        check_len(&self.gpu, "embed tokens", tokens.len(), rows)?;
        check_len(&self.gpu, "embed out", out.len(), rows * h)?;
        if rows == 0 {
            return Ok(());
        }
        let h64 = h as u64;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.embed_gather);
        b.arg(table).arg(tokens).arg(out).arg(&h64);
        // SAFETY: block r < rows reads tokens[r] (< vocab, the caller's contract) and copies
        // table row tokens[r] (vocab·h elements checked) into out row r (rows·h checked).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
