//! Rotary position embedding forward and backward, in place (kernels `kernels/ops_rope.cu`).
//!
//! The device table holds cos/sin for positions `0..max_pos`, built once on the host by
//! `mxrl_tensor::rope::RopeTable` (so the values are the CPU's); each row's position comes from
//! a device `u32 [n]`. The arithmetic is the reference's (two products and one sum per output),
//! so the result is bitwise `mxrl_tensor::rope::{rope_forward, rope_backward}`.
#![allow(unsafe_code)]

use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use mxrl_tensor::rope::RopeTable;

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_rope.cu");

const THREADS: u32 = 256;
/// (row, head) items per block of `decode_attn_prep_w2/w4/w8` (`DPW_HEADS`), one warp each.
const DPW_HEADS: u64 = 8;

/// cos/sin of positions `0..max_pos` on the device: `[max_pos, D/2]` each, f32.
pub struct RopeDeviceTable {
    pub(crate) cos: CudaSlice<f32>,
    pub(crate) sin: CudaSlice<f32>,
    pub(crate) max_pos: usize,
    pub(crate) head_dim: usize,
}

impl RopeDeviceTable {
    /// Builds `RopeTable::new(0..max_pos, head_dim, theta)` on the host and uploads it.
    ///
    /// # Errors
    /// An odd or zero `head_dim`, `max_pos` beyond `u32`; out of device memory.
    pub fn new(
        gpu: &Gpu,
        max_pos: usize,
        head_dim: usize,
        theta: f64,
    ) -> Result<Self, DeviceError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(gpu.err(format!(
                "RoPE table: head_dim {head_dim} must be even and > 0"
            )));
        }
        if max_pos > u32::MAX as usize {
            return Err(gpu.err(format!(
                "RoPE table: max_pos {max_pos} beyond u32 positions"
            )));
        }
        let positions: Vec<usize> = (0..max_pos).collect();
        let t = RopeTable::new(&positions, head_dim, theta);
        Ok(RopeDeviceTable {
            cos: gpu.upload(t.cos())?,
            sin: gpu.upload(t.sin())?,
            max_pos,
            head_dim,
        })
    }

    /// Number of positions (`0..max_pos`).
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Head width `D`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// The loaded RoPE kernel.
pub struct Rope {
    gpu: Gpu,
    apply: CudaFunction,
    decode_prep: CudaFunction,
    /// `decode_attn_prep_w2/w4/w8`: D = 64, 128, 256.
    decode_prep_warp: [CudaFunction; 3],
}

impl Rope {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_rope", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Rope {
            gpu: gpu.clone(),
            apply: f("rope_apply")?,
            decode_prep: f("decode_attn_prep")?,
            decode_prep_warp: [
                f("decode_attn_prep_w2")?,
                f("decode_attn_prep_w4")?,
                f("decode_attn_prep_w8")?,
            ],
        })
    }

    /// RoPE forward in place on `x: [n, heads·D]` (f32), row `t` rotated by position
    /// `pos[t]` (`u32 [n]` on the device) of `table`:
    /// `y[i] = x[i]·cos − x[i+D/2]·sin`, `y[i+D/2] = x[i+D/2]·cos + x[i]·sin`.
    /// A position `≥ table.max_pos()` turns its row into NaN. Reference:
    /// `mxrl_tensor::rope::rope_forward` (bitwise).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn forward(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        pos: &CudaView<'_, u32>,
        n: usize,
        heads: usize,
        table: &RopeDeviceTable,
    ) -> Result<(), DeviceError> {
        self.apply(x, pos, n, heads, table, 1.0, "rope forward")
    }

    /// RoPE backward in place: turns `dy: [n, heads·D]` into `dx` by the transposed rotation
    /// (`dx[i] = dy[i]·cos + dy[i+D/2]·sin`, `dx[i+D/2] = dy[i+D/2]·cos − dy[i]·sin`).
    /// Reference: `mxrl_tensor::rope::rope_backward` (bitwise).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn backward(
        &self,
        dy: &mut CudaViewMut<'_, f32>,
        pos: &CudaView<'_, u32>,
        n: usize,
        heads: usize,
        table: &RopeDeviceTable,
    ) -> Result<(), DeviceError> {
        self.apply(dy, pos, n, heads, table, -1.0, "rope backward")
    }

    /// A decode step's attention inputs in one launch (`decode_attn_prep`): per row `r` and
    /// head, with `norms` the per-head RMSNorm of `q [rows, q_heads·D]` / `k [rows,
    /// kv_heads·D]` (bitwise [`super::norm`]'s forward: same reduction tree), then the RoPE
    /// rotation at `pos[r]` (bitwise [`Rope::forward`]), written back in place; for k heads,
    /// with `len = lens[r]` in `1..=max_len`, `bf16` of the rotated k row and of v's row to
    /// the caches `[rows, max_len, kv_heads·D]` at position `len − 1` (the bytes of
    /// `Attention::kv_append`). Reference: those ops one after the other.
    ///
    /// # Errors
    /// Short buffers, an odd head width or one that is not the table's, shapes past u32;
    /// launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attn_prep(
        &self,
        q: &mut CudaViewMut<'_, f32>,
        k: &mut CudaViewMut<'_, f32>,
        v: &CudaView<'_, f32>,
        norms: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>)>,
        eps: f32,
        rows: usize,
        (hq, hkv): (usize, usize),
        pos: &CudaView<'_, u32>,
        table: &RopeDeviceTable,
        lens: &CudaView<'_, u32>,
        max_len: usize,
        (kc, vc): (&mut CudaViewMut<'_, u16>, &mut CudaViewMut<'_, u16>),
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "decode_attn_prep";
        let d = table.head_dim;
        let len = |a: usize, b: usize| {
            a.checked_mul(b)
                .ok_or_else(|| g.err(format!("{op}: shape too large")))
        };
        let (qn, kn) = (len(rows, hq * d)?, len(rows, hkv * d)?);
        let cache = len(len(rows, max_len)?, hkv * d)?;
        for (what, have, need) in [
            ("q", q.len(), qn),
            ("k", k.len(), kn),
            ("v", v.len(), kn),
            ("pos", pos.len(), rows),
            ("lens", lens.len(), rows),
            ("k cache", kc.len(), cache),
            ("v cache", vc.len(), cache),
        ] {
            if have < need {
                return Err(g.err(format!("{op}: {what} holds {have} entries, {need} needed")));
            }
        }
        if let Some((wq, wk)) = &norms {
            if wq.len() < d || wk.len() < d {
                return Err(g.err(format!("{op}: q/k norm weights shorter than D = {d}")));
            }
        }
        if rows == 0 || hq + hkv == 0 {
            return Ok(());
        }
        if rows > i32::MAX as usize || hq + hkv > 65_535 || max_len > u32::MAX as usize {
            return Err(g.err(format!("{op}: shape too large for one launch")));
        }
        let (norm, (wq, wk)) = match norms {
            Some(w) => (1i32, w),
            // Never read without `norm`: any device pointers do.
            None => (0, (v, v)),
        };
        let (hq32, hkv32, d32) = (hq as u32, hkv as u32, d as u32);
        let (maxp32, max_len32) = (table.max_pos as u32, max_len as u32);
        // Head widths 64, 128, 256: one warp per (row, head), the same reduction tree and the
        // same bits (kernel comment).
        let warp_kernel = match d {
            64 => Some(&self.decode_prep_warp[0]),
            128 => Some(&self.decode_prep_warp[1]),
            256 => Some(&self.decode_prep_warp[2]),
            _ => None,
        };
        if let Some(func) = warp_kernel {
            let items = (rows as u64) * (hq + hkv) as u64;
            let cfg = LaunchConfig {
                grid_dim: (
                    u32::try_from(items.div_ceil(DPW_HEADS))
                        .map_err(|_| g.err(format!("{op}: shape too large for one launch")))?,
                    1,
                    1,
                ),
                block_dim: (32 * DPW_HEADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(func);
            b.arg(q).arg(k).arg(v).arg(wq).arg(wk).arg(&norm).arg(&eps);
            b.arg(&hq32).arg(&hkv32).arg(&d32);
            b.arg(&table.cos).arg(&table.sin).arg(pos).arg(&maxp32);
            b.arg(lens).arg(&max_len32).arg(kc).arg(vc).arg(&items);
            // SAFETY: warp item it < items = rows·(hq + hkv) touches exactly what block (r, h)
            // of `decode_attn_prep` does (below), lanes covering the D elements 32w + lane
            // (D ∈ {64, 128, 256}, the entry's D); warps past `items` return whole; no shared
            // memory. Argument types match (float*, float*, const float* × 3, int, float,
            // u32 × 3, const float* × 2, const u32*, u32, const u32*, u32, u16* × 2, u64).
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, (hq + hkv) as u32, 1),
            block_dim: (super::norm::row_threads(d), 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        let mut b = g.stream().launch_builder(&self.decode_prep);
        b.arg(q).arg(k).arg(v).arg(wq).arg(wk).arg(&norm).arg(&eps);
        b.arg(&hq32).arg(&hkv32).arg(&d32);
        b.arg(&table.cos).arg(&table.sin).arg(pos).arg(&maxp32);
        b.arg(lens).arg(&max_len32).arg(kc).arg(vc);
        // SAFETY: block (r, h) with r < rows and h < hq + hkv touches the D-element head row of
        // q (h < hq) or k (rows·heads·D checked), reads v's head row (rows·hkv·D checked), the
        // norm weights below D (checked, read only with norm), pos[r] and lens[r] (rows
        // checked), table entries below max_pos·D/2 only when pos[r] < max_pos, and writes the
        // caches at (r·max_len + len − 1)·hkv·D + kh·D + j < rows·max_len·hkv·D only when
        // 1 ≤ len ≤ max_len; shared memory D floats (dynamic) plus 32 (static); blockDim a
        // warp multiple ≤ 256 (block_sum). Argument types match (float*, float*, const float*
        // × 3, int, float, u32 × 3, const float* × 2, const u32*, u32, const u32*, u32, u16* × 2).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        pos: &CudaView<'_, u32>,
        n: usize,
        heads: usize,
        table: &RopeDeviceTable,
        sign: f32,
        op: &str,
    ) -> Result<(), DeviceError> {
        let half = table.head_dim / 2;
        let total = n
            .checked_mul(heads)
            .and_then(|v| v.checked_mul(table.head_dim))
            .ok_or_else(|| self.gpu.err(format!("{op}: shape too large")))?;
        if x.len() < total {
            return Err(self.gpu.err(format!(
                "{op}: x holds {} elements, [{n}, {heads}·{}] needed",
                x.len(),
                table.head_dim
            )));
        }
        if pos.len() < n {
            return Err(self.gpu.err(format!(
                "{op}: positions hold {} entries, {n} needed",
                pos.len()
            )));
        }
        let threads_total = total / 2;
        let blocks = threads_total.div_ceil(THREADS as usize);
        if heads > u32::MAX as usize || half > u32::MAX as usize || blocks > i32::MAX as usize {
            return Err(self
                .gpu
                .err(format!("{op}: shape too large for one launch")));
        }
        if threads_total == 0 {
            return Ok(());
        }
        let (n64, heads32, half32, maxp32) =
            (n as u64, heads as u32, half as u32, table.max_pos as u32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.apply);
        b.arg(x)
            .arg(&table.cos)
            .arg(&table.sin)
            .arg(pos)
            .arg(&n64)
            .arg(&heads32)
            .arg(&half32)
            .arg(&maxp32)
            .arg(&sign);
        // SAFETY: thread idx < n·heads·half touches x[(t·heads + h)·D + i] and
        // x[... + i + half] with t < n (n·heads·D checked), reads pos[t] (n checked) and, only
        // when pos[t] < max_pos, table entries pos[t]·half + i < max_pos·half (the table's
        // length by construction); types match (float*, 2 × const float*, const u32*, u64,
        // u32, u32, u32, float).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }
}
