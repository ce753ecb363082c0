//! Causal GQA attention (kernels `kernels/ops_attention.cu`): the training forward and backward
//! over packed sequences, and decode over a BF16 KV cache.
//!
//! Layout (f32, row-major): `q, out, dout, dq: [N, Hq·D]`, `k, v, dk, dv: [N, Hkv·D]`,
//! `lse: [N, Hq]`; sequence `b` owns rows `offsets[b]..offsets[b+1]` (`u32 [B+1]` on the
//! device); query head `h` reads kv head `h / (Hq/Hkv)`; scale `1/√D`
//! (`mxrl_tensor::attention::AttnShape::scale`). Any even `D ≤ 256`.
//!
//! The forward is flash-style: a block owns 64 query rows and walks tiles of keys in shared
//! memory, an online softmax in registers, `O(T)` memory per head (no `[T, T]` matrix
//! anywhere). The backward recomputes the probabilities from `lse`:
//! `delta = rowsum(dout∘out)`, one kernel for `dq` iterating over key tiles and one for
//! `dk, dv` (64 key rows per block) iterating over query tiles (the group's query heads
//! summed in order), no atomics.
//!
//! Two implementations of these three kernels ([`TrainingKernels`]). The tensor-core ones
//! (`D ≤ 128`, the default) split every f32 operand into three BF16 parts and sum the six
//! leading part products with `mma.m16n8k16` (f32 accumulation): the f32 operands, scores and
//! probabilities enter with all their bits, nothing is rounded to BF16 that the reference
//! keeps in f32, and the error is bounded by `mxrl_tensor::tolerance::AttnSums::Bf16x3Mma`.
//! The forward: blocks of 4 warps, 16 rows per warp; key tiles of 64 for `D ≤ 64`, 32 for
//! `D ≤ 128` (shared memory: three BF16 planes per tile), split as they are loaded. The
//! backward splits `q, dout, k, v` once per call into BF16 planes in its scratch
//! ([`backward_scratch_len`]: 1.5× the four operands' f32 bytes) and its kernels copy tiles of
//! them with `cp.async`, the streamed tiles (32 keys or queries) double buffered; blocks of
//! 8 warps, each pair of warps sharing 16 rows and taking one half of every tile (the two
//! partial sums added once at the end). The CUDA-core ones (any `D ≤ 256`,
//! and the fallback above 128) are register-tiled: each thread computes
//! 4 rows × 2 or 4 columns of a score tile (one accumulator per score, the `D` products added
//! in index order) and 4 rows × `4·NCH` columns of a weighted sum; each kernel comes in three
//! instantiations by the column chunks `NCH = ceil(D/64)` (1, 2 or 4), picked here by `D`.
//! Decode splits each sequence into chunks of
//! [`DECODE_CHUNK`] keys (a constant, so a sequence's result does not depend on the batch) and
//! combines the chunks in order. For head widths 64, 128 and 256 the decode step's q/k norms,
//! RoPE and cache append run inside the chunks' launch ([`Attention::decode_fused`]: each block
//! prepares its query heads, the new position's block its k row; the bits of the separate ops).
//! Every reduction order depends only on the shapes and the offsets/lengths, so equal inputs give
//! equal bits.
//!
//! References: `mxrl_tensor::attention::{attention_forward, attention_backward,
//! attention_decode}`; the summation order differs (online softmax), bounds in
//! `mxrl_tensor::tolerance::attention_*`.
#![allow(unsafe_code)]

use super::{check_align, check_len};
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::sys::CUdevice_attribute_enum;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use mxrl_tensor::attention::AttnShape;

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_attention.cu");

/// Largest head width the kernels take (`ATT_MAX_D`).
pub const MAX_HEAD_DIM: usize = 256;
/// Keys per decode chunk (`ATT_DEC_CHUNK`): one block of the first decode pass.
pub const DECODE_CHUNK: usize = 64;
/// Threads per block of the training tile kernels (`ATT_THREADS`).
const TILE_THREADS: u32 = 256;
/// Query rows of a forward / dq block, key rows of a dk/dv block (`ATT_BR`, `ATC_BR`).
const BR: usize = 64;
/// Keys per forward tile (`ATT_BF`).
const BF: usize = 64;
/// Largest `D` of the tensor-core kernels (`ATC_MAX_D`).
const TC_MAX_D: usize = 128;
/// Threads per block of the tensor-core forward (`ATC_THREADS`).
const TC_THREADS: u32 = 128;
/// Threads per block of the tensor-core backward kernels (`ATC_BWD_THREADS`).
const TC_BWD_THREADS: u32 = 256;
/// Keys (dq) or queries (dk/dv) per streamed tile of the tensor-core backward (`ATC_BT`).
const TC_BT: usize = 32;
/// Keys per dq tile (`ATT_BK`).
const BK: usize = 32;
/// Row stride of the probability tiles (`ATT_PS`).
const PS: usize = 68;
/// Rows per block of `attn_bwd_delta` (`ATT_WARPS`, one warp per row and head).
const WARPS: usize = 16;
const THREADS: u32 = (WARPS * 32) as u32;
const DEC_WARPS: usize = 4;
const DEC_THREADS: u32 = (DEC_WARPS * 32) as u32;
const MAX_GRID_YZ: usize = 65_535;

/// `D` rounded up to 4 (`att_d4`): the zero-padded row width of the shared tiles.
fn d4(d: usize) -> usize {
    d.div_ceil(4) * 4
}
/// Row stride of the shared tiles (`att_stride`): `d4` when `d4/4` is odd, else `d4 + 4`.
fn stride(d: usize) -> usize {
    let d4 = d4(d);
    if (d4 / 4) % 2 == 1 {
        d4
    } else {
        d4 + 4
    }
}
/// The instantiation of the tile kernels for `D`: 0, 1, 2 for `NCH` = 1, 2, 4 column chunks
/// of 64 (`D ≤ 64`, `≤ 128`, `≤ 256`; kernel suffixes `_64`, `_128`, `_256`).
fn class(d: usize) -> usize {
    match d4(d).div_ceil(64) {
        0 | 1 => 0,
        2 => 1,
        _ => 2,
    }
}
/// Largest `D` of each class (the shared memory the attribute allows).
const CLASS_MAX_D: [usize; 3] = [64, 128, 256];
fn smem_fwd(d: usize) -> usize {
    4 * (BR * stride(d) + BF * stride(d).max(PS) + BF * stride(d))
}
fn smem_dq(d: usize) -> usize {
    4 * (2 * BR * stride(d) + BK * stride(d) + BK * stride(d).max(PS))
}
/// Queries per dk/dv tile: `16·QPT`, `QPT` = 4 for `D ≤ 128`, 2 above (shared memory).
fn dkdv_bq(d: usize) -> usize {
    if class(d) == 2 {
        32
    } else {
        64
    }
}
fn smem_dkdv(d: usize) -> usize {
    let bq = dkdv_bq(d);
    4 * (2 * BR * stride(d) + 2 * bq * stride(d) + 2 * bq * PS + 2 * bq)
}
/// Keys (forward, dq) or queries (dk/dv) per step of the tensor-core kernels for `D`:
/// 64 for `D ≤ 64` (`_tc_64`), 32 above (`_tc_128`).
fn tc_tile(d: usize) -> usize {
    if d <= 64 {
        64
    } else {
        32
    }
}
/// Row stride (BF16 elements) of the tensor-core kernels' shared planes: `D` rounded up to 16,
/// plus 8.
fn tc_ld(d: usize) -> usize {
    d.div_ceil(16) * 16 + 8
}
fn smem_fwd_tc(d: usize) -> usize {
    2 * 3 * tc_ld(d) * (BR + 2 * tc_tile(d))
}
/// The backward's resident planes (64 rows of two operands) and two stages of the streamed
/// ones (`TC_BT` rows of two operands), BF16.
fn smem_dq_tc(d: usize) -> usize {
    2 * 3 * tc_ld(d) * (2 * BR + 4 * TC_BT)
}
/// As dq, plus the two stages' lse and delta (f32).
fn smem_dkdv_tc(d: usize) -> usize {
    smem_dq_tc(d) + 4 * 2 * 2 * TC_BT
}
/// `D` rounded up to 16: the row width of the BF16 planes of the tensor-core backward.
fn tc_dp(d: usize) -> usize {
    d.div_ceil(16) * 16
}
/// f32 elements of the scratch holding the three BF16 planes (`[3][N][H][dp]`) of an
/// `[N, H·D]` operand.
fn plane_len(n: usize, heads: usize, d: usize) -> usize {
    3 * n * heads * tc_dp(d) / 2
}
/// Largest `D` of each tensor-core instantiation (`_tc_64`, `_tc_128`).
const TC_CLASS_MAX_D: [usize; 2] = [64, 128];

/// Which kernels run the training forward and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TrainingKernels {
    /// BF16 tensor cores on three-part splits of the f32 operands for `D ≤ 128`
    /// (`attn_*_tc_*`; sums bounded by `AttnSums::Bf16x3Mma`), the CUDA-core kernels above.
    #[default]
    TensorCores,
    /// The register-tiled f32 CUDA-core kernels for every `D` (IEEE f32 products and sums;
    /// `AttnSums::F32`).
    CudaCores,
}

/// Query heads a decode block keeps in shared memory per pass (`ATT_DEC_G`).
const DEC_G: usize = 8;
/// Dynamic shared memory of `attn_decode_partial`: the pass's query rows and scores (f32), the
/// chunk's K rows as BF16 pairs padded to `D/2 + 1` words, its V rows, each pass head's chunk
/// sum and max.
fn smem_dec(d: usize) -> usize {
    4 * (DEC_G * d
        + DEC_G * DECODE_CHUNK
        + DECODE_CHUNK * (d / 2 + 1)
        + DECODE_CHUNK * d / 2
        + 2 * DEC_G)
}

/// Elements (f32) of the scratch [`Attention::backward`] needs: `delta` (`N·Hq`, rounded up
/// to a multiple of 4), and for `D ≤ 128` (the tensor-core kernels) the three BF16 planes of
/// `q`, `dout` (`3·N·Hq·dp` BF16 each, `dp` = `D` rounded up to 16) and of `k`, `v`
/// (`3·N·Hkv·dp` each): `12·N·(Hq + Hkv)·dp` bytes, 1.5× the f32 size of the four operands
/// when `D` is a multiple of 16. At least one element.
pub fn backward_scratch_len(n: usize, shape: AttnShape) -> usize {
    let delta = (n * shape.q_heads).next_multiple_of(4);
    let planes = if shape.head_dim <= TC_MAX_D {
        2 * plane_len(n, shape.q_heads, shape.head_dim)
            + 2 * plane_len(n, shape.kv_heads, shape.head_dim)
    } else {
        0
    };
    (delta + planes).max(1)
}

/// Where a decode attention's output goes: f32, or its BF16 rounding alone.
pub enum DecodeOut<'a, 'b> {
    /// `[batch, Hq·D]` f32.
    F32(&'a mut CudaViewMut<'b, f32>),
    /// `[batch, Hq·D]` BF16 bit patterns (the bits `to_bf16` of the f32 output gives).
    Bf16(&'a mut CudaViewMut<'b, u16>),
}

impl DecodeOut<'_, '_> {
    fn len(&self) -> usize {
        match self {
            DecodeOut::F32(o) => o.len(),
            DecodeOut::Bf16(o) => o.len(),
        }
    }
}

/// Elements of the scratch [`Attention::decode`] needs for `batch` sequences in a cache of
/// `max_len` positions: per (sequence, query head, chunk) a running max, a sum and `D` partial
/// outputs, `batch·Hq·ceil(max_len/DECODE_CHUNK)·(D + 2)`; none (one element) for a cache of
/// one chunk, whose blocks write the output themselves.
pub fn decode_scratch_len(batch: usize, max_len: usize, shape: AttnShape) -> usize {
    let chunks = max_len.div_ceil(DECODE_CHUNK);
    if chunks <= 1 {
        return 1;
    }
    batch * shape.q_heads * chunks * (shape.head_dim + 2)
}

fn check_shape(gpu: &Gpu, op: &str, s: AttnShape) -> Result<(), DeviceError> {
    let d = s.head_dim;
    if s.kv_heads == 0 || s.q_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(gpu.err(format!(
            "{op}: {} query heads are not a positive multiple of {} kv heads",
            s.q_heads, s.kv_heads
        )));
    }
    if d == 0 || !d.is_multiple_of(2) || d > MAX_HEAD_DIM {
        return Err(gpu.err(format!(
            "{op}: head_dim {d} must be even and in 2..={MAX_HEAD_DIM}"
        )));
    }
    if s.q_heads > MAX_GRID_YZ {
        return Err(gpu.err(format!(
            "{op}: {} query heads exceed {MAX_GRID_YZ}",
            s.q_heads
        )));
    }
    Ok(())
}

/// The loaded attention kernels.
pub struct Attention {
    gpu: Gpu,
    kernels: TrainingKernels,
    fwd: [CudaFunction; 3],
    delta: CudaFunction,
    dq: [CudaFunction; 3],
    dkdv: [CudaFunction; 3],
    fwd_tc: [CudaFunction; 2],
    dq_tc: [CudaFunction; 2],
    dkdv_tc: [CudaFunction; 2],
    split: CudaFunction,
    append: CudaFunction,
    dec_partial: CudaFunction,
    dec_combine: CudaFunction,
    /// `attn_decode_fused_w2/w4/w8`: D = 64, 128, 256.
    dec_fused: [CudaFunction; 3],
    /// Dynamic shared memory per block the device allows (opt-in) and the attributes grant.
    smem_limit: usize,
}

impl Attention {
    /// Loads (compiling on first use) the module on `gpu` and allows each tile kernel the
    /// dynamic shared memory of the largest `D` of its instantiation (above the default 48 KB),
    /// at most what the device allows; a launch that would need more is refused with an error.
    ///
    /// # Errors
    /// NVRTC, module-load or attribute errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_attention", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        let a = Attention {
            gpu: gpu.clone(),
            kernels: TrainingKernels::default(),
            fwd_tc: [f("attn_fwd_tc_64")?, f("attn_fwd_tc_128")?],
            dq_tc: [f("attn_bwd_dq_tc_64")?, f("attn_bwd_dq_tc_128")?],
            dkdv_tc: [f("attn_bwd_dkdv_tc_64")?, f("attn_bwd_dkdv_tc_128")?],
            split: f("attn_split_planes")?,
            fwd: [f("attn_fwd_64")?, f("attn_fwd_128")?, f("attn_fwd_256")?],
            delta: f("attn_bwd_delta")?,
            dq: [
                f("attn_bwd_dq_64")?,
                f("attn_bwd_dq_128")?,
                f("attn_bwd_dq_256")?,
            ],
            dkdv: [
                f("attn_bwd_dkdv_64")?,
                f("attn_bwd_dkdv_128")?,
                f("attn_bwd_dkdv_256")?,
            ],
            append: f("kv_append")?,
            dec_partial: f("attn_decode_partial")?,
            dec_combine: f("attn_decode_combine")?,
            dec_fused: [
                f("attn_decode_fused_w2")?,
                f("attn_decode_fused_w4")?,
                f("attn_decode_fused_w8")?,
            ],
            smem_limit: gpu
                .ctx()
                .attribute(
                    CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(|x| gpu.err(format!("shared memory per block: {x:?}")))?
                .max(0) as usize,
        };
        let mut limits = vec![(
            &a.dec_partial,
            smem_dec(MAX_HEAD_DIM),
            "attn_decode_partial".to_string(),
        )];
        for (i, f) in a.dec_fused.iter().enumerate() {
            let d = 64 << i;
            limits.push((f, smem_dec(d), format!("attn_decode_fused (D = {d})")));
        }
        for (c, &dmax) in CLASS_MAX_D.iter().enumerate() {
            limits.push((&a.fwd[c], smem_fwd(dmax), format!("attn_fwd_{dmax}")));
            limits.push((&a.dq[c], smem_dq(dmax), format!("attn_bwd_dq_{dmax}")));
            limits.push((&a.dkdv[c], smem_dkdv(dmax), format!("attn_bwd_dkdv_{dmax}")));
        }
        for (c, &dmax) in TC_CLASS_MAX_D.iter().enumerate() {
            limits.push((
                &a.fwd_tc[c],
                smem_fwd_tc(dmax),
                format!("attn_fwd_tc_{dmax}"),
            ));
            limits.push((
                &a.dq_tc[c],
                smem_dq_tc(dmax),
                format!("attn_bwd_dq_tc_{dmax}"),
            ));
            limits.push((
                &a.dkdv_tc[c],
                smem_dkdv_tc(dmax),
                format!("attn_bwd_dkdv_tc_{dmax}"),
            ));
        }
        for (func, need, name) in limits {
            gpu.allow_dynamic_smem(func, &name, need.min(a.smem_limit))?;
        }
        Ok(a)
    }

    /// The same kernels with the training forward and backward run by `kernels`.
    pub fn with_training_kernels(mut self, kernels: TrainingKernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// How the training forward and backward evaluate their dot products and weighted sums
    /// for head width `d` (the error model of their bounds).
    pub fn training_sums(&self, d: usize) -> mxrl_tensor::tolerance::AttnSums {
        if self.tensor_cores(d) {
            mxrl_tensor::tolerance::AttnSums::Bf16x3Mma
        } else {
            mxrl_tensor::tolerance::AttnSums::F32
        }
    }

    fn tensor_cores(&self, d: usize) -> bool {
        self.kernels == TrainingKernels::TensorCores && d <= TC_MAX_D
    }

    /// Function, block size and shared memory of the training kernel `which` (0 forward, 1 dq,
    /// 2 dk/dv) for head width `d`.
    fn training_kernel(&self, which: usize, d: usize) -> (&CudaFunction, u32, usize) {
        if self.tensor_cores(d) {
            let c = usize::from(d > 64);
            match which {
                0 => (&self.fwd_tc[c], TC_THREADS, smem_fwd_tc(d)),
                1 => (&self.dq_tc[c], TC_BWD_THREADS, smem_dq_tc(d)),
                _ => (&self.dkdv_tc[c], TC_BWD_THREADS, smem_dkdv_tc(d)),
            }
        } else {
            match which {
                0 => (&self.fwd[class(d)], TILE_THREADS, smem_fwd(d)),
                1 => (&self.dq[class(d)], TILE_THREADS, smem_dq(d)),
                _ => (&self.dkdv[class(d)], TILE_THREADS, smem_dkdv(d)),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn check_packed(
        &self,
        op: &str,
        offsets: &CudaView<'_, u32>,
        num_seqs: usize,
        max_len: usize,
        n: usize,
        shape: AttnShape,
    ) -> Result<(), DeviceError> {
        check_shape(&self.gpu, op, shape)?;
        check_len(
            &self.gpu,
            &format!("{op} offsets"),
            offsets.len(),
            num_seqs + 1,
        )?;
        if num_seqs > MAX_GRID_YZ {
            return Err(self
                .gpu
                .err(format!("{op}: {num_seqs} sequences exceed {MAX_GRID_YZ}")));
        }
        if max_len > n || n > u32::MAX as usize {
            return Err(self.gpu.err(format!(
                "{op}: longest sequence {max_len} with {n} rows (rows must fit u32 and hold it)"
            )));
        }
        if max_len.div_ceil(BR) > MAX_GRID_YZ {
            return Err(self.gpu.err(format!(
                "{op}: longest sequence {max_len} exceeds {} rows",
                BR * MAX_GRID_YZ
            )));
        }
        Ok(())
    }

    fn check_smem(&self, op: &str, d: usize, bytes: usize) -> Result<(), DeviceError> {
        if bytes > self.smem_limit {
            return Err(self.gpu.err(format!(
                "{op}: head_dim {d} needs {bytes} B of shared memory per block, the device allows {}",
                self.smem_limit
            )));
        }
        Ok(())
    }

    /// Training forward: `q: [N, Hq·D]`, `k, v: [N, Hkv·D]`, device `offsets: u32 [B+1]` →
    /// `out: [N, Hq·D]`, `lse: [N, Hq]` (log-sum-exp of the scaled scores of each row, for the
    /// backward). Causal inside each sequence; f32 accumulation. `max_len` must be at least
    /// the longest sequence (`max_b offsets[b+1] − offsets[b]`, known to the host that built the
    /// offsets; rows of longer sequences would be left unwritten), offsets nondecreasing with
    /// `offsets[B] ≤ N`. Reference: `mxrl_tensor::attention::attention_forward`.
    ///
    /// # Errors
    /// A bad head geometry, short buffers, more shared memory than the device allows; launch
    /// errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        num_seqs: usize,
        max_len: usize,
        n: usize,
        shape: AttnShape,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let op = "attention forward";
        self.check_packed(op, offsets, num_seqs, max_len, n, shape)?;
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        check_len(&self.gpu, "attention forward q", q.len(), n * hq * d)?;
        check_len(&self.gpu, "attention forward k", k.len(), n * hkv * d)?;
        check_len(&self.gpu, "attention forward v", v.len(), n * hkv * d)?;
        check_len(&self.gpu, "attention forward out", out.len(), n * hq * d)?;
        check_len(&self.gpu, "attention forward lse", lse.len(), n * hq)?;
        let (func, threads, smem) = self.training_kernel(0, d);
        self.check_smem(op, d, smem)?;
        if num_seqs == 0 || max_len == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (num_seqs as u32, hq as u32, max_len.div_ceil(BR) as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (hq32, hkv32, d32, scale) = (hq as u32, hkv as u32, d as u32, shape.scale());
        let mut b = self.gpu.stream().launch_builder(func);
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(offsets)
            .arg(out)
            .arg(lse)
            .arg(&hq32)
            .arg(&hkv32)
            .arg(&d32)
            .arg(&scale);
        // SAFETY: block (b, h, z) reads offsets[b], offsets[b+1] (B+1 checked) and touches rows
        // offsets[b] + i for i < T_b ≤ max_len (reads and writes guarded by i < T_b), rows <
        // offsets[B] ≤ N (the caller's offsets contract) of q/out (N·Hq·D checked), k/v
        // (N·Hkv·D checked) and lse (N·Hq checked), head slices h·D + d < Hq·D,
        // kh·D + d < Hkv·D (geometry checked); the instantiation training_kernel picks covers
        // D; its shared memory ≤ the attribute set in `new` for that instantiation (the
        // largest D of the class); types match (both families take the same arguments).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| self.gpu.err(e))?;
        Ok(())
    }

    /// Training backward: `dout, out: [N, Hq·D]`, `q`, `k, v`, `lse` (from
    /// [`Attention::forward`]) → `dq: [N, Hq·D]`, `dk, dv: [N, Hkv·D]` (overwritten on the
    /// sequences' rows). `delta`: the scratch ([`backward_scratch_len`], 16-byte aligned,
    /// contents unspecified on entry), whose first `N·Hq` elements receive `rowsum(dout∘out)`; with the tensor-core
    /// kernels the rest receives the BF16 planes of `q, dout, k, v` (`attn_split_planes`) the
    /// dq and dk/dv kernels read. With `p_ij = exp(s_ij − lse_i)` and
    /// `ds_ij = p_ij·(dout_i·v_j − delta_i)`: `dq_i = scale·Σ_j ds_ij k_j`,
    /// `dk_j = scale·Σ_{h,i} ds_ij q_i`, `dv_j = Σ_{h,i} p_ij dout_i` (the group's query heads in
    /// order). f32 accumulation, no atomics. Offsets and `max_len` as in the forward.
    /// Reference: `mxrl_tensor::attention::attention_backward`.
    ///
    /// # Errors
    /// A bad head geometry, short buffers, more shared memory than the device allows; launch
    /// errors.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dout: &CudaView<'_, f32>,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        out: &CudaView<'_, f32>,
        lse: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        num_seqs: usize,
        max_len: usize,
        n: usize,
        shape: AttnShape,
        delta: &mut CudaViewMut<'_, f32>,
        dq: &mut CudaViewMut<'_, f32>,
        dk: &mut CudaViewMut<'_, f32>,
        dv: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let op = "attention backward";
        self.check_packed(op, offsets, num_seqs, max_len, n, shape)?;
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let g = &self.gpu;
        check_len(g, "attention backward dout", dout.len(), n * hq * d)?;
        check_len(g, "attention backward q", q.len(), n * hq * d)?;
        check_len(g, "attention backward k", k.len(), n * hkv * d)?;
        check_len(g, "attention backward v", v.len(), n * hkv * d)?;
        check_len(g, "attention backward out", out.len(), n * hq * d)?;
        check_len(g, "attention backward lse", lse.len(), n * hq)?;
        check_len(
            g,
            "attention backward scratch",
            delta.len(),
            backward_scratch_len(n, shape),
        )?;
        {
            // The planes are copied with 16-byte cp.async.
            let stream = g.stream();
            check_align(
                g,
                "attention backward scratch",
                delta.device_ptr(stream).0,
                16,
            )?;
        }
        check_len(g, "attention backward dq", dq.len(), n * hq * d)?;
        check_len(g, "attention backward dk", dk.len(), n * hkv * d)?;
        check_len(g, "attention backward dv", dv.len(), n * hkv * d)?;
        let (dq_func, dq_threads, dq_smem) = self.training_kernel(1, d);
        let (dkdv_func, dkdv_threads, dkdv_smem) = self.training_kernel(2, d);
        self.check_smem(op, d, dq_smem)?;
        self.check_smem(op, d, dkdv_smem)?;
        if num_seqs == 0 || max_len == 0 || n == 0 {
            return Ok(());
        }
        let (n64, hq32, hkv32, d32, scale) =
            (n as u64, hq as u32, hkv as u32, d as u32, shape.scale());
        // The scratch: delta, then (tensor cores) the planes of q, dout, k, v; every part
        // starts at a multiple of 4 f32 (16 bytes: the kernels' cp.async sources).
        let (mut delta, mut planes) = delta.split_at_mut((n * hq).next_multiple_of(4));
        let cfg = LaunchConfig {
            grid_dim: ((n * hq).div_ceil(WARPS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.delta);
        b.arg(dout)
            .arg(out)
            .arg(&mut delta)
            .arg(&n64)
            .arg(&hq32)
            .arg(&d32);
        // SAFETY: warp r·Hq + h < N·Hq reads dout/out[(r·Hq + h)·D + d], d < D (N·Hq·D checked)
        // and writes delta[r·Hq + h] (N·Hq ≤ the first part of the checked scratch); types
        // match (2 × const float*, float*, u64, u32, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        let delta_v = delta.as_view();

        let dq_grid = (num_seqs as u32, hq as u32, max_len.div_ceil(BR) as u32);
        let dkdv_grid = (num_seqs as u32, hkv as u32, max_len.div_ceil(BR) as u32);
        if self.tensor_cores(d) {
            let (ql, kl) = (plane_len(n, hq, d), plane_len(n, hkv, d));
            let dp32 = tc_dp(d) as u32;
            // SAFETY: the scratch holds 2·(ql + kl) f32 past delta (checked above); u16 is
            // plain data, and each part is written whole by attn_split_planes before it is read.
            let mut p16 = unsafe { planes.transmute_mut::<u16>(4 * (ql + kl)) }
                .ok_or_else(|| g.err("attention backward: scratch too short for the planes"))?;
            let (mut qdo, mut kv) = p16.split_at_mut(4 * ql);
            let (mut qp, mut dop) = qdo.split_at_mut(2 * ql);
            let (mut kp, mut vp) = kv.split_at_mut(2 * kl);
            for (x, p, heads) in [
                (q, &mut qp, hq),
                (dout, &mut dop, hq),
                (k, &mut kp, hkv),
                (v, &mut vp, hkv),
            ] {
                let pairs = n * heads * tc_dp(d) / 2;
                let cfg = LaunchConfig {
                    grid_dim: (pairs.div_ceil(256).min(1 << 20) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let heads32 = heads as u32;
                let mut b = g.stream().launch_builder(&self.split);
                b.arg(x).arg(p).arg(&n64).arg(&heads32).arg(&d32).arg(&dp32);
                // SAFETY: reads x[(r·H + h)·D + c], c < D, r < N (N·H·D checked for q, dout,
                // k, v) and writes the three planes' elements ((p·N + r)·H + h)·dp + c,
                // p < 3, c < dp: 3·N·H·dp BF16, the part of the scratch passed (u16);
                // types match (const float*, u16*, u64, u32, u32, u32).
                unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            }
            let (qv, dov, kv_, vv) = (qp.as_view(), dop.as_view(), kp.as_view(), vp.as_view());
            let cfg = LaunchConfig {
                grid_dim: dq_grid,
                block_dim: (dq_threads, 1, 1),
                shared_mem_bytes: dq_smem as u32,
            };
            let mut b = g.stream().launch_builder(dq_func);
            b.arg(&qv)
                .arg(&dov)
                .arg(&kv_)
                .arg(&vv)
                .arg(lse)
                .arg(&delta_v)
                .arg(offsets)
                .arg(dq)
                .arg(&n64)
                .arg(&hq32)
                .arg(&hkv32)
                .arg(&d32)
                .arg(&scale);
            // SAFETY: block (b, h, z) reads the planes of rows offsets[b] + i < offsets[B] ≤ N
            // (3·N·H·dp BF16 each, written above; cp.async sources 16-byte aligned: the
            // scratch parts start at multiples of 16 bytes and dp is a multiple of 8), lse and
            // delta (N·Hq) of those rows and writes dq (N·Hq·D checked); the kernel's shared
            // memory ≤ the attribute set in `new` for its instantiation; types match the kernel
            // (4 × const u16*, 2 × const float*, const u32*, float*, u64, 3 × u32, float).
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            let cfg = LaunchConfig {
                grid_dim: dkdv_grid,
                block_dim: (dkdv_threads, 1, 1),
                shared_mem_bytes: dkdv_smem as u32,
            };
            let mut b = g.stream().launch_builder(dkdv_func);
            b.arg(&qv)
                .arg(&dov)
                .arg(&kv_)
                .arg(&vv)
                .arg(lse)
                .arg(&delta_v)
                .arg(offsets)
                .arg(dk)
                .arg(dv)
                .arg(&n64)
                .arg(&hq32)
                .arg(&hkv32)
                .arg(&d32)
                .arg(&scale);
            // SAFETY: as dq: key rows offsets[b] + j (j < T_b) of the k, v planes and of dk/dv
            // (N·Hkv·D checked), query rows offsets[b] + i (i < T_b) of the q, dout planes and
            // lse/delta (N·Hq), heads kh·g + hh < Hq; the kernel's shared memory ≤ the
            // attribute set in `new` for its instantiation; types match the kernel.
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            return Ok(());
        }

        let cfg = LaunchConfig {
            grid_dim: dq_grid,
            block_dim: (dq_threads, 1, 1),
            shared_mem_bytes: dq_smem as u32,
        };
        let mut b = g.stream().launch_builder(dq_func);
        b.arg(dout)
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(lse)
            .arg(&delta_v)
            .arg(offsets)
            .arg(dq)
            .arg(&hq32)
            .arg(&hkv32)
            .arg(&d32)
            .arg(&scale);
        // SAFETY: as the forward: rows offsets[b] + i < offsets[B] ≤ N of dout/q/dq (N·Hq·D),
        // k/v (N·Hkv·D), lse/delta (N·Hq), all checked; the kernel's shared memory ≤ the
        // attribute set in `new` for its instantiation; types match the kernel.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;

        let cfg = LaunchConfig {
            grid_dim: dkdv_grid,
            block_dim: (dkdv_threads, 1, 1),
            shared_mem_bytes: dkdv_smem as u32,
        };
        let mut b = g.stream().launch_builder(dkdv_func);
        b.arg(dout)
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(lse)
            .arg(&delta_v)
            .arg(offsets)
            .arg(dk)
            .arg(dv)
            .arg(&hq32)
            .arg(&hkv32)
            .arg(&d32)
            .arg(&scale);
        // SAFETY: block (b, kh, z) touches key rows offsets[b] + j (j < T_b) of k/v/dk/dv
        // (N·Hkv·D checked) and query rows offsets[b] + i (i < T_b) of q/dout (N·Hq·D) and
        // lse/delta (N·Hq), heads kh·g + hh < Hq; the kernel's shared memory ≤ the attribute
        // set in `new` for its instantiation (same tile); types match the kernel.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// KV-cache append: for each sequence `b < batch` writes `k_new[b], v_new[b]` (`[batch,
    /// Hkv·D]` f32) rounded to BF16 (nearest even; bit patterns) at position `lens[b] − 1` of
    /// slot `b` of `k_cache, v_cache: [slots, max_len, Hkv, D]`. `lens: u32 [batch]` on the
    /// device is each sequence's length including the new token; a length of 0 or above
    /// `max_len` writes nothing. Reference: `mxrl_tensor::precision::round_bf16` of the rows.
    ///
    /// # Errors
    /// A bad head geometry, more sequences than slots, short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k_new: &CudaView<'_, f32>,
        v_new: &CudaView<'_, f32>,
        k_cache: &mut CudaViewMut<'_, u16>,
        v_cache: &mut CudaViewMut<'_, u16>,
        lens: &CudaView<'_, u32>,
        batch: usize,
        slots: usize,
        max_len: usize,
        shape: AttnShape,
    ) -> Result<(), DeviceError> {
        check_shape(&self.gpu, "kv_append", shape)?;
        let row = shape.kv_heads * shape.head_dim;
        self.check_cache("kv_append", batch, slots, max_len, row)?;
        let g = &self.gpu;
        check_len(g, "kv_append k_new", k_new.len(), batch * row)?;
        check_len(g, "kv_append v_new", v_new.len(), batch * row)?;
        check_len(g, "kv_append k_cache", k_cache.len(), slots * max_len * row)?;
        check_len(g, "kv_append v_cache", v_cache.len(), slots * max_len * row)?;
        check_len(g, "kv_append lens", lens.len(), batch)?;
        if batch == 0 || max_len == 0 {
            return Ok(());
        }
        let (b32, row32, ml32) = (batch as u32, row as u32, max_len as u32);
        let cfg = LaunchConfig {
            grid_dim: ((batch * row).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.append);
        b.arg(k_new)
            .arg(v_new)
            .arg(k_cache)
            .arg(v_cache)
            .arg(lens)
            .arg(&b32)
            .arg(&row32)
            .arg(&ml32);
        // SAFETY: thread b·row + e < batch·row reads k_new/v_new at that index (checked) and
        // lens[b] (batch checked); it writes cache element (b·max_len + lens[b] − 1)·row + e
        // only when 1 ≤ lens[b] ≤ max_len, inside slot b < batch ≤ slots (slots·max_len·row
        // checked); types match (2 × const float*, 2 × u16*, const u32*, 3 × u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    fn check_cache(
        &self,
        op: &str,
        batch: usize,
        slots: usize,
        max_len: usize,
        row: usize,
    ) -> Result<(), DeviceError> {
        if batch > slots {
            return Err(self
                .gpu
                .err(format!("{op}: {batch} sequences but {slots} cache slots")));
        }
        if batch > MAX_GRID_YZ.min(i32::MAX as usize)
            || max_len > u32::MAX as usize
            || slots
                .checked_mul(max_len)
                .and_then(|x| x.checked_mul(row))
                .is_none()
        {
            return Err(self.gpu.err(format!(
                "{op}: cache [{slots}, {max_len}, {row}] or batch {batch} too large"
            )));
        }
        Ok(())
    }

    /// Decode attention: one new token per sequence, `q: [batch, Hq·D]` f32, against the BF16
    /// caches `k_cache, v_cache: [slots, max_len, Hkv, D]` (slot `b` = sequence `b`, already
    /// holding the new token's k/v, see [`Attention::kv_append`]) with device `lens: u32
    /// [batch]` (length including the new token) → `out: [batch, Hq·D]`. f32 accumulation;
    /// each sequence is split into chunks of [`DECODE_CHUNK`] keys combined in order through
    /// `scratch` ([`decode_scratch_len`]; a cache of one chunk is written directly, one launch,
    /// the same bits). A length of 0 gives zeros, one above `max_len` NaN.
    /// Reference: `mxrl_tensor::attention::attention_decode` on the BF16 values of the cache.
    ///
    /// # Errors
    /// A bad head geometry, more sequences than slots, short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        q: &CudaView<'_, f32>,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        lens: &CudaView<'_, u32>,
        batch: usize,
        slots: usize,
        max_len: usize,
        shape: AttnShape,
        scratch: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        self.decode_to(
            q,
            k_cache,
            v_cache,
            lens,
            batch,
            slots,
            max_len,
            shape,
            scratch,
            DecodeOut::F32(out),
        )
    }

    /// [`Attention::decode`] with the output written as its BF16 rounding (the bits of
    /// `to_bf16` of the f32 output) into `out: [batch, Hq·D]` u16, and no f32 output: what a
    /// BF16 linear after the attention reads.
    ///
    /// # Errors
    /// As [`Attention::decode`].
    #[allow(clippy::too_many_arguments)]
    pub fn decode_bf16(
        &self,
        q: &CudaView<'_, f32>,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        lens: &CudaView<'_, u32>,
        batch: usize,
        slots: usize,
        max_len: usize,
        shape: AttnShape,
        scratch: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), DeviceError> {
        self.decode_to(
            q,
            k_cache,
            v_cache,
            lens,
            batch,
            slots,
            max_len,
            shape,
            scratch,
            DecodeOut::Bf16(out),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn decode_to(
        &self,
        q: &CudaView<'_, f32>,
        k_cache: &CudaView<'_, u16>,
        v_cache: &CudaView<'_, u16>,
        lens: &CudaView<'_, u32>,
        batch: usize,
        slots: usize,
        max_len: usize,
        shape: AttnShape,
        scratch: &mut CudaViewMut<'_, f32>,
        mut out: DecodeOut<'_, '_>,
    ) -> Result<(), DeviceError> {
        let Some(nsplit) = self.check_decode(
            "attention decode",
            q.len(),
            (k_cache, v_cache),
            (lens.len(), out.len(), scratch.len()),
            (batch, slots, max_len),
            shape,
        )?
        else {
            return Ok(());
        };
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let g = &self.gpu;
        // The kernels take both outputs and write the one that is not null.
        let null: u64 = 0;
        // One chunk: the partial kernel writes `out` and takes no scratch.
        let parts = if nsplit == 1 { 0 } else { batch * hq * nsplit };
        let (mut part_m, mut rest) = scratch.split_at_mut(parts);
        let (mut part_l, mut part_o) = rest.split_at_mut(parts);
        let (hq32, hkv32, d32, ml32, scale) = (
            hq as u32,
            hkv as u32,
            d as u32,
            max_len as u32,
            shape.scale(),
        );
        // Scoped: the builder borrows the partial buffers mutably until it is dropped.
        {
            let cfg = LaunchConfig {
                grid_dim: (batch as u32, hkv as u32, nsplit as u32),
                block_dim: (DEC_THREADS, 1, 1),
                shared_mem_bytes: smem_dec(d) as u32,
            };
            let mut b = g.stream().launch_builder(&self.dec_partial);
            b.arg(q)
                .arg(k_cache)
                .arg(v_cache)
                .arg(lens)
                .arg(&mut part_m)
                .arg(&mut part_l)
                .arg(&mut part_o);
            match &mut out {
                DecodeOut::F32(o) => b.arg(&mut **o).arg(&null),
                DecodeOut::Bf16(o) => b.arg(&null).arg(&mut **o),
            };
            b.arg(&hq32).arg(&hkv32).arg(&d32).arg(&ml32).arg(&scale);
            // SAFETY: block (b, kh, s) returns unless lens[b] ≤ max_len and s·64 < lens[b]
            // (with nsplit = 1 after writing out row b's heads of kh, batch·Hq·D checked); it
            // reads cache positions < lens[b] ≤ max_len of slot b < batch ≤ slots
            // (slots·max_len·Hkv·D checked), q row b (batch·Hq·D checked), and writes, with
            // nsplit = 1, out row b's heads of kh and nothing else; else
            // part_m/part_l[(b·Hq + h)·nsplit + s] (batch·Hq·nsplit each) and part_o at that
            // index ·D (+D): the three splits of scratch hold exactly that
            // (decode_scratch_len checked); shared memory smem_dec(D) ≤ the attribute.
            unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        }
        if nsplit == 1 {
            return Ok(());
        }
        let parts = (part_m.slice(..), part_l.slice(..), part_o.slice(..));
        self.launch_combine(parts, lens, out, batch, shape, max_len, nsplit)
    }

    /// What both decodes check: the head geometry, the shared memory, the cache's shape, the
    /// lengths of `q` (`q_len`), the caches, `lens`, `out` and `scratch`
    /// ([`decode_scratch_len`]), the caches' 4-byte alignment; returns the number of chunks
    /// (`None`: no sequences, nothing to launch).
    fn check_decode(
        &self,
        op: &str,
        q_len: usize,
        (k_cache, v_cache): (&CudaView<'_, u16>, &CudaView<'_, u16>),
        (lens_len, out_len, scratch_len): (usize, usize, usize),
        (batch, slots, max_len): (usize, usize, usize),
        shape: AttnShape,
    ) -> Result<Option<usize>, DeviceError> {
        let g = &self.gpu;
        check_shape(g, op, shape)?;
        let (hq, d) = (shape.q_heads, shape.head_dim);
        self.check_smem(op, d, smem_dec(d))?;
        let row = shape.kv_heads * d;
        self.check_cache(op, batch, slots, max_len, row)?;
        for (what, have, need) in [
            ("q", q_len, batch * hq * d),
            ("k_cache", k_cache.len(), slots * max_len * row),
            ("v_cache", v_cache.len(), slots * max_len * row),
            ("lens", lens_len, batch),
            ("out", out_len, batch * hq * d),
            (
                "scratch",
                scratch_len,
                decode_scratch_len(batch, max_len, shape),
            ),
        ] {
            check_len(g, &format!("{op} {what}"), have, need)?;
        }
        let stream = g.stream();
        check_align(g, &format!("{op} k_cache"), k_cache.device_ptr(stream).0, 4)?;
        check_align(g, &format!("{op} v_cache"), v_cache.device_ptr(stream).0, 4)?;
        if max_len == 0 {
            return Err(g.err(format!("{op}: a KV cache of max_len 0 holds no keys")));
        }
        if batch == 0 {
            return Ok(None);
        }
        let nsplit = max_len.div_ceil(DECODE_CHUNK);
        if nsplit > MAX_GRID_YZ {
            return Err(g.err(format!("{op}: max_len {max_len} too large")));
        }
        Ok(Some(nsplit))
    }

    /// The decode's second pass (`attn_decode_combine`): the chunks' partials of every
    /// (sequence, query head) combined in order into `out`. The callers checked the shapes:
    /// partials `[batch, Hq, nsplit]` (+ `D` each for `part_o`), `lens [batch]`, `out
    /// [batch, Hq·D]`.
    #[allow(clippy::too_many_arguments)]
    fn launch_combine(
        &self,
        (pm, pl, po): (CudaView<'_, f32>, CudaView<'_, f32>, CudaView<'_, f32>),
        lens: &CudaView<'_, u32>,
        mut out: DecodeOut<'_, '_>,
        batch: usize,
        shape: AttnShape,
        max_len: usize,
        nsplit: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let (hq, d) = (shape.q_heads, shape.head_dim);
        let null: u64 = 0;
        let (hq32, d32, ml32, ns32) = (hq as u32, d as u32, max_len as u32, nsplit as u32);
        let cfg = LaunchConfig {
            grid_dim: (batch as u32, hq as u32, 1),
            block_dim: (d.div_ceil(32).clamp(1, 8) as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.dec_combine);
        b.arg(&pm).arg(&pl).arg(&po).arg(lens);
        match &mut out {
            DecodeOut::F32(o) => b.arg(&mut **o).arg(&null),
            DecodeOut::Bf16(o) => b.arg(&null).arg(&mut **o),
        };
        b.arg(&hq32).arg(&d32).arg(&ml32).arg(&ns32);
        // SAFETY: block (b, h) reads lens[b] and, for 1 ≤ lens[b] ≤ max_len, the partials of
        // chunks s < ceil(lens[b]/64) ≤ nsplit that pass 1 wrote for (b, h); it writes row b,
        // head h of the output that is not null (batch·Hq·D, the callers checked); types match
        // (3 × const float*, const u32*, float*, u16* — a null one passed as a 0 u64 — and
        // 4 × u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Whether [`Attention::decode_fused`] takes heads of width `d` (64, 128 or 256).
    pub fn fuses_decode(d: usize) -> bool {
        matches!(d, 64 | 128 | 256)
    }

    /// A decode step's attention with its inputs' preparation: what `Rope::decode_attn_prep`
    /// (per-head q/k RMSNorm with `norms`, RoPE at `pos`, the new k and v rows appended to the
    /// caches at `lens[b] − 1`) followed by [`Attention::decode_bf16`] (a BF16 output) or
    /// [`Attention::decode`] (f32) give, bit for bit, in one launch for a cache of one chunk
    /// and two for more (the chunks' combine). `q` and `k` are the projections before their norm
    /// and rotation and are only read. Head widths 64, 128, 256 ([`Attention::fuses_decode`]);
    /// the table's width must be `D`.
    ///
    /// # Errors
    /// As the two ops; another head width.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_fused(
        &self,
        (q, k, v): (&CudaView<'_, f32>, &CudaView<'_, f32>, &CudaView<'_, f32>),
        norms: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>)>,
        eps: f32,
        pos: &CudaView<'_, u32>,
        table: &super::rope::RopeDeviceTable,
        lens: &CudaView<'_, u32>,
        (batch, slots, max_len): (usize, usize, usize),
        shape: AttnShape,
        (k_cache, v_cache): (&mut CudaViewMut<'_, u16>, &mut CudaViewMut<'_, u16>),
        scratch: &mut CudaViewMut<'_, f32>,
        mut out: DecodeOut<'_, '_>,
    ) -> Result<(), DeviceError> {
        let op = "fused decode attention";
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let g = &self.gpu;
        let func = match d {
            64 => &self.dec_fused[0],
            128 => &self.dec_fused[1],
            256 => &self.dec_fused[2],
            _ => return Err(g.err(format!("{op}: head_dim {d} is not 64, 128 or 256"))),
        };
        if table.head_dim != d {
            return Err(g.err(format!(
                "{op}: head width {d} but a RoPE table of {}",
                table.head_dim
            )));
        }
        let splits = self.check_decode(
            op,
            q.len(),
            (&k_cache.as_view(), &v_cache.as_view()),
            (lens.len(), out.len(), scratch.len()),
            (batch, slots, max_len),
            shape,
        )?;
        for (what, have, need) in [
            ("k", k.len(), batch * hkv * d),
            ("v", v.len(), batch * hkv * d),
            ("pos", pos.len(), batch),
        ] {
            check_len(g, &format!("{op} {what}"), have, need)?;
        }
        if let Some((wq, wk)) = &norms {
            check_len(g, &format!("{op} q norm"), wq.len(), d)?;
            check_len(g, &format!("{op} k norm"), wk.len(), d)?;
        }
        let Some(nsplit) = splits else {
            return Ok(());
        };
        let parts = if nsplit == 1 { 0 } else { batch * hq * nsplit };
        let (mut part_m, mut rest) = scratch.split_at_mut(parts);
        let (mut part_l, mut part_o) = rest.split_at_mut(parts);
        let null: u64 = 0;
        let (wq, wk) = match norms {
            Some((a, b)) => (a.device_ptr(g.stream()).0, b.device_ptr(g.stream()).0),
            None => (0, 0),
        };
        let (hq32, hkv32, d32, ml32, maxp32, scale) = (
            hq as u32,
            hkv as u32,
            d as u32,
            max_len as u32,
            table.max_pos as u32,
            shape.scale(),
        );
        let cfg = LaunchConfig {
            grid_dim: (batch as u32, hkv as u32, nsplit as u32),
            block_dim: (DEC_THREADS, 1, 1),
            shared_mem_bytes: smem_dec(d) as u32,
        };
        let mut b = g.stream().launch_builder(func);
        b.arg(q).arg(k).arg(v).arg(&wq).arg(&wk).arg(&eps);
        b.arg(&table.cos).arg(&table.sin).arg(pos).arg(&maxp32);
        b.arg(k_cache).arg(v_cache).arg(lens);
        b.arg(&mut part_m).arg(&mut part_l).arg(&mut part_o);
        match &mut out {
            DecodeOut::F32(o) => b.arg(&mut **o).arg(&null),
            DecodeOut::Bf16(o) => b.arg(&null).arg(&mut **o),
        };
        b.arg(&hq32).arg(&hkv32).arg(&d32).arg(&ml32).arg(&scale);
        // SAFETY: block (b, kh, s), b < batch ≤ slots: reads q row b's heads of kh, k's and v's
        // head kh of row b (batch·Hq·D, batch·Hkv·D checked), the norm weights below D
        // (checked; null pointers only without norms, then never read), pos[b], lens[b] and the
        // table below max_pos·D/2 only when pos[b] < max_pos; it writes the caches at
        // (b·max_len + lens[b] − 1)·Hkv·D + kh·D + j only when 1 ≤ lens[b] ≤ max_len (slots ·
        // max_len·Hkv·D checked) and reads cache positions < lens[b]; partials and out as
        // attn_decode_partial (scratch = decode_scratch_len checked); shared memory
        // smem_dec(D) ≤ the attribute (allowed in `new`). Types match ATT_DEC_FUSED_ARGS (3 ×
        // const float*, 2 × const float* as u64, float, 2 × const float*, const u32*, u32, 2 ×
        // u16*, const u32*, 3 × float*, float*, u16* — the null one a 0 u64 — 4 × u32, float).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        drop(b);
        if nsplit == 1 {
            return Ok(());
        }
        let parts = (part_m.slice(..), part_l.slice(..), part_o.slice(..));
        self.launch_combine(parts, lens, out, batch, shape, max_len, nsplit)
    }
}
