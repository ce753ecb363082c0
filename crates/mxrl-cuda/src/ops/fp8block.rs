//! FP8-block linears on the device (kernels `kernels/ops_fp8block.cu`, the quantizers of
//! `kernels/quant.cu` through [`CudaDevice`]): E4M3 codes with f32 `scale_inv` blocks,
//! activations 1×128 along K ([`Scheme::FP8_BLOCK_ACT`]) and weights 128×128
//! ([`Scheme::FP8_BLOCK_WEIGHT`]), the DeepSeek-V3 recipe.
//!
//! # Ops and their CPU references
//! - [`Fp8Block::quantize_act`] / [`Fp8Block::quantize_weights`]: f32 rows (the first `M·K`
//!   values of a device buffer) → codes and `scale_inv` bytes, byte for byte
//!   `mxrl_formats::quantize` with those schemes (the contract quantizer kernels of
//!   [`CudaDevice`], on the engine's stream). Weights of several experts `[E·N, K]` are
//!   quantized as one tensor: with `N % 128 == 0` no 128-row tile crosses two experts, so the
//!   bytes are every expert's own; other `N` are refused (the CPU's `PreparedWeight::quantize`
//!   refuses them too: 128×128 tiles are not padded).
//! - [`Fp8Block::gemm_nt`]: `y [R, N] = x · W_eᵀ` per expert over expert-major rows (or one
//!   dense weight), the arithmetic of `mxrl_tensor::qlinear::FP8_BLOCK_EMULATION`: a fresh
//!   accumulator per 128-wide K block, the exact E4M3×E4M3 products summed on BF16 tensor
//!   cores (`mma.m16n8k16`, f32 accumulation), then `y = fl(y + fl(fl(sx·sw) · P))` in
//!   increasing block order on CUDA cores. Reference
//!   `mxrl_tensor::qlinear::PreparedWeight::forward_inference` (the CPU backend's
//!   `grouped_qlinear` / `qlinear`); only the order of each block's f32 sum differs (bound
//!   [`mxrl_tensor::tolerance::fp8_block_sum_bound`]).
//! - [`Fp8Block::gemm_nt_frag`]: the same product over expert-major rows for few rows per
//!   expert (decode batches): the stored weight codes streamed with 16-byte loads straight into
//!   tensor-core fragments (no shared-memory staging), 32 output columns per block, K split
//!   over the block's warps by whole 128-wide blocks, each block's `P_b` in a fresh f32
//!   accumulator and the promotion in the contract's order (module comment of the kernels).
//!   Same reference and bound; its bits do not depend on the split or the rows per pass.
//!
//! Deterministic (one thread per output element, fixed order, no atomics). Launchers check
//! lengths, alignment and block multiples, allocate only the outputs they return, and read
//! nothing back, so a decode step that uses them can be captured in a CUDA graph.
#![allow(unsafe_code)]

use super::gemm::Grouped;
use super::qgemm::{frag_row_blocks, frag_split, FragRows, FRAG_COLS, FRAG_MAX_SPLIT};
use super::{check_align, check_len, check_u32, mul};
use crate::cuda::CudaDevice;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use mxrl_formats::{Scheme, FP8_BLOCK};
use std::cell::Cell;

/// Kernel source of this family (the module's name is `ops_fp8block`).
pub const SOURCE: &str = include_str!("../../kernels/ops_fp8block.cu");

/// Output columns per CTA of the GEMM (`F8_BN`).
const F8_BN: usize = 64;
/// Activation rows per pass of the narrow kernels (one 16-row tile).
const F8_BM: usize = 16;
/// Activation rows per pass of the wide (`_m64`) kernels: four 16-row tiles share each
/// decoded weight tile. They serve calls with at least this many rows per expert on average.
const F8_BM_WIDE: usize = 64;
/// Threads per CTA (`F8_THREADS`).
const F8_THREADS: u32 = 128;
/// Most CTAs along the row passes of one expert (grid z).
const MAX_PASS_CTAS: usize = 64;

/// Where the staged kernels of [`crate::ops::qgemm`] do not take a routed step (fewer than 9
/// or more than 512 rows per expert on average: `backend/fp8.rs`), the engine backend's
/// grouped forward runs the fragment kernels ([`Fp8Block::gemm_nt_frag`]) up to this many rows
/// per expert and the tiled kernels ([`Fp8Block::gemm_nt`]) above, whose decoded 64 × 128
/// weight tiles serve 64 rows per pass. The fragment kernels' largest pass (32 rows,
/// [`FragRows::R32`]) reads an expert's codes once per 32 rows, so at 64 rows per expert each
/// used expert's codes are read twice (the second time mostly from L2). Measured on an H200
/// (`bench_fp8block`, BENCHMARKS.md): at 64 rows per expert the fragment kernels (binary16,
/// one warp per block) took 297 / 163 µs for the benchmark model's gate_up / down against 463
/// / 228 µs for the tiled ones; past 64 not measured.
pub const FRAG_ROWS_PER_EXPERT: usize = 64;

/// The passes the fragment kernels have (8, 16 and 32 rows; no 64-row kernel).
pub const FRAG_PASSES: [FragRows; 3] = [FragRows::R8, FragRows::R16, FragRows::R32];

/// How the fragment kernels ([`Fp8Block::gemm_nt_frag`]) sum each 128-wide block's products on
/// the tensor cores. Both multiply exact E4M3 values into an f32 accumulator (every product
/// exact), so they differ from the CPU reference only in the order of each block's f32 sum —
/// provided the tensor cores keep f32's significand while summing, which the GPU tests check
/// (sums that f32 holds exactly must come out bit for bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8FragMma {
    /// `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` on the codes as stored in both
    /// operands (no decode in the kernel). Needs sm_89+. For sm_90 ptxas lowers it to the
    /// instructions of [`Fp8FragMma::F16`] (E4M3 → binary16 conversions, then 16-bit HMMA with
    /// f32 accumulation; Hopper's FP8 tensor-core path is wgmma); sm_89 and sm_100+ run FP8
    /// `mma.sync` natively.
    E4m3,
    /// Every code decoded to binary16 (`cvt.rn.f16x2.e4m3x2`: exact, E4M3 values lie in
    /// binary16's normal range with ≤ 4 significant bits), then
    /// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`. Needs sm_89+.
    F16,
}

impl Fp8FragMma {
    /// Both variants.
    pub const ALL: [Fp8FragMma; 2] = [Fp8FragMma::E4m3, Fp8FragMma::F16];

    fn index(self) -> usize {
        match self {
            Fp8FragMma::E4m3 => 0,
            Fp8FragMma::F16 => 1,
        }
    }
}

/// The fragment kernels' split of the reduction (warps per 32-column block): up to 16 rows per
/// expert on average, the split of the MXFP8 fragment kernels ([`frag_split`]) for the same
/// weight row bytes (`K`: one code byte per element); past that one warp per block, whose
/// passes of 32 rows keep it busy (on an H200 at 64 rows per expert, `bench_fp8block`: split 1
/// took 297 / 163 µs for gate_up / down against 355 / 225 µs with that rule's 4 / 2; at 1–16
/// rows the rule's pick was within 4 % of the best). The kernels hand each warp whole
/// 128-wide K blocks, round by round.
pub fn fp8_frag_split(s: Grouped) -> usize {
    if s.rows.div_ceil(s.experts.max(1)) > 16 {
        1
    } else {
        frag_split(s, s.k)
    }
}

/// Stored FP8-block operands: E4M3 codes and the f32 `scale_inv` of every block as
/// little-endian bytes (4 per block).
pub struct Fp8Operand {
    /// E4M3 codes, row-major.
    pub codes: CudaSlice<u8>,
    /// `scale_inv` bytes.
    pub scales: CudaSlice<u8>,
}

/// The FP8-block kernels on one GPU.
pub struct Fp8Block {
    gpu: Gpu,
    quant: CudaDevice,
    grouped: CudaFunction,
    dense: CudaFunction,
    grouped_wide: CudaFunction,
    dense_wide: CudaFunction,
    /// Fragment kernels: [mma variant][rows per pass 8, 16, 32].
    frag: [[CudaFunction; 3]; 2],
    /// Whether the device runs the fragment kernels (sm_89+: E4M3 mma and conversions).
    frag_ok: bool,
    frag_mma: Cell<Fp8FragMma>,
}

impl Fp8Block {
    /// Loads (compiling on first use) the GEMM module and the contract quantizers on `gpu`
    /// (its stream).
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_fp8block", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        let (major, minor) = gpu
            .ctx()
            .compute_capability()
            .map_err(|x| gpu.err(format!("compute capability: {x:?}")))?;
        let frags = |mma: &str| -> Result<[CudaFunction; 3], DeviceError> {
            Ok([
                f(&format!("fp8_block_frag_{mma}_t1"))?,
                f(&format!("fp8_block_frag_{mma}_t2"))?,
                f(&format!("fp8_block_frag_{mma}_t4"))?,
            ])
        };
        Ok(Fp8Block {
            frag: [frags("e4m3")?, frags("f16")?],
            frag_ok: (major, minor) >= (8, 9),
            frag_mma: Cell::new(Fp8FragMma::F16),
            gpu: gpu.clone(),
            quant: CudaDevice::on_gpu(gpu)?,
            grouped: f("fp8_block_gemm_grouped")?,
            dense: f("fp8_block_gemm_dense")?,
            grouped_wide: f("fp8_block_gemm_grouped_m64")?,
            dense_wide: f("fp8_block_gemm_dense_m64")?,
        })
    }

    /// The contract quantizers (on the GPU's stream).
    pub fn quantizer(&self) -> &CudaDevice {
        &self.quant
    }

    /// `scheme` of the first `rows·k` values of `x` into new buffers.
    fn quantize(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        scheme: Scheme,
        blocks: usize,
    ) -> Result<Fp8Operand, DeviceError> {
        let g = &self.gpu;
        let n = mul(g, "FP8-block quantize", rows, k)?;
        let mut codes = g.empty::<u8>(n)?;
        let mut scales = g.empty::<u8>(4 * blocks)?;
        self.quant.fp8_block_f32_into(
            x,
            [rows, k],
            scheme,
            &mut codes.as_view_mut(),
            &mut scales.as_view_mut(),
        )?;
        Ok(Fp8Operand { codes, scales })
    }

    /// Activations `x [rows, k]` (the first `rows·k` values) with [`Scheme::FP8_BLOCK_ACT`]:
    /// codes `[rows, k]`, `scale_inv [rows, k/128]`.
    ///
    /// # Errors
    /// `k` not a multiple of 128, a short buffer, driver errors.
    pub fn quantize_act(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
    ) -> Result<Fp8Operand, DeviceError> {
        self.quantize(x, rows, k, Scheme::FP8_BLOCK_ACT, rows * (k / FP8_BLOCK))
    }

    /// `groups` weights `[n, k]` back to back in `w` with [`Scheme::FP8_BLOCK_WEIGHT`]: codes
    /// `[groups, n, k]`, `scale_inv [groups, n/128, k/128]` — each weight's own bytes.
    ///
    /// # Errors
    /// `n` or `k` not a multiple of 128 (named by `name`), a short buffer, driver errors.
    pub fn quantize_weights(
        &self,
        name: &str,
        w: &CudaView<'_, f32>,
        groups: usize,
        n: usize,
        k: usize,
    ) -> Result<Fp8Operand, DeviceError> {
        if !n.is_multiple_of(FP8_BLOCK) || !k.is_multiple_of(FP8_BLOCK) {
            return Err(self.gpu.err(format!(
                "{name}: FP8-block weights are stored in 128×128 tiles, so N and K must be \
                 multiples of 128; the weight is [{n}, {k}]"
            )));
        }
        let rows = mul(&self.gpu, name, groups, n)?;
        let blocks = (rows / FP8_BLOCK) * (k / FP8_BLOCK);
        self.quantize(w, rows, k, Scheme::FP8_BLOCK_WEIGHT, blocks)
            .map_err(|e| self.gpu.err(format!("{name}: {e}")))
    }

    /// The launchers' checks (see [`Fp8Block::gemm_nt`]); `false` when there is nothing to do.
    #[allow(clippy::too_many_arguments)]
    fn check_operands(
        &self,
        op: &str,
        x_codes: &CudaView<'_, u8>,
        x_scales: &CudaView<'_, u8>,
        w_codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: Option<&CudaView<'_, u32>>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<bool, DeviceError> {
        let g = &self.gpu;
        let Grouped {
            experts,
            rows,
            n,
            k,
        } = s;
        if !n.is_multiple_of(FP8_BLOCK) || !k.is_multiple_of(FP8_BLOCK) {
            return Err(g.err(format!(
                "{op}: N = {n} and K = {k} must be multiples of 128 (FP8-block tiles)"
            )));
        }
        if offsets.is_none() && experts != 1 {
            return Err(g.err(format!("{op}: a dense call with {experts} weights")));
        }
        check_u32(
            g,
            op,
            &[("experts", experts), ("rows", rows), ("n", n), ("k", k)],
        )?;
        let kb = k / FP8_BLOCK;
        let xn = mul(g, op, rows, k)?;
        let wn = mul(g, op, mul(g, op, experts, n)?, k)?;
        check_len(g, &format!("{op} x codes"), x_codes.len(), xn)?;
        check_len(g, &format!("{op} x scales"), x_scales.len(), 4 * rows * kb)?;
        check_len(g, &format!("{op} w codes"), w_codes.len(), wn)?;
        check_len(
            g,
            &format!("{op} w scales"),
            w_scales.len(),
            4 * experts * (n / FP8_BLOCK) * kb,
        )?;
        check_len(g, &format!("{op} y"), y.len(), mul(g, op, rows, n)?)?;
        if let Some(o) = offsets {
            check_len(g, &format!("{op} offsets"), o.len(), experts + 1)?;
        }
        if experts == 0 || rows == 0 || n == 0 || k == 0 {
            return Ok(false);
        }
        let stream = g.stream();
        check_align(
            g,
            &format!("{op} x codes"),
            x_codes.device_ptr(stream).0,
            16,
        )?;
        check_align(
            g,
            &format!("{op} w codes"),
            w_codes.device_ptr(stream).0,
            16,
        )?;
        check_align(
            g,
            &format!("{op} x scales"),
            x_scales.device_ptr(stream).0,
            4,
        )?;
        check_align(
            g,
            &format!("{op} w scales"),
            w_scales.device_ptr(stream).0,
            4,
        )?;
        check_align(g, &format!("{op} y"), y.device_ptr_mut(stream).0, 8)?;
        Ok(true)
    }

    /// `y [R, N] = x · W_eᵀ` over expert-major rows (rows of expert `e`:
    /// `offsets[e] .. offsets[e+1]`, clamped to `[0, R]`), or, with `offsets = None`, one
    /// dense weight (`s.experts == 1`) over rows `0 .. R`. `x_codes [R, K]` and `x_scales`
    /// (`scale_inv [R, K/128]` bytes) from [`Fp8Block::quantize_act`]; `w_codes [E, N, K]`,
    /// `w_scales` (`scale_inv [E, N/128, K/128]` bytes) from [`Fp8Block::quantize_weights`]
    /// or stored bytes. Rows of no expert are left as they are.
    ///
    /// # Errors
    /// `N` or `K` not multiples of 128, short or misaligned buffers, sizes beyond `u32`,
    /// launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_nt(
        &self,
        x_codes: &CudaView<'_, u8>,
        x_scales: &CudaView<'_, u8>,
        w_codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: Option<&CudaView<'_, u32>>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "fp8_block_gemm";
        if !self.check_operands(op, x_codes, x_scales, w_codes, w_scales, offsets, y, s)? {
            return Ok(());
        }
        let Grouped {
            experts,
            rows,
            n,
            k,
        } = s;
        let stream = g.stream();
        // Wide passes once the experts average a whole wide pass of rows (prefill, training);
        // both kernels give the same bits.
        let wide = rows >= F8_BM_WIDE * experts;
        let bm = if wide { F8_BM_WIDE } else { F8_BM };
        let passes = rows.div_ceil(bm * experts);
        let z = passes.clamp(1, MAX_PASS_CTAS) as u32;
        let cfg = LaunchConfig {
            grid_dim: ((n / F8_BN) as u32, experts as u32, z),
            block_dim: (F8_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, n32, k32) = (rows as u32, n as u32, k as u32);
        match offsets {
            Some(off) => {
                let mut b = stream.launch_builder(if wide {
                    &self.grouped_wide
                } else {
                    &self.grouped
                });
                b.arg(x_codes)
                    .arg(x_scales)
                    .arg(w_codes)
                    .arg(w_scales)
                    .arg(off);
                b.arg(y).arg(&r).arg(&n32).arg(&k32);
                // SAFETY: lengths checked above: x codes R·K, x scales 4·R·K/128 bytes, w codes
                // E·N·K, w scales 4·E·(N/128)·(K/128) bytes, offsets E+1, y R·N; N and K
                // multiples of 128 (checked). CTA (bx, e, z) reads offsets[e], offsets[e+1]
                // (e < E = gridDim.y) and only rows in [lo, hi) ⊆ [0, R] (clamped): activation
                // codes of those rows at 16-byte chunks below K (16-byte aligned: base checked,
                // row and chunk offsets multiples of 16) and their scales (< R·K/128 floats,
                // 4-byte aligned), weight rows e·N + 64·bx .. +64 ≤ E·N (64·(bx+1) ≤ N) and
                // their scale row (< E·(N/128)·(K/128) floats), and writes y at those rows,
                // columns 64·bx .. +64 ≤ N as 8-byte stores (even column, N even, base
                // 8-byte aligned). An empty expert returns before any barrier as a whole
                // CTA; otherwise all its threads run the same pass and K-block loops (bounds
                // from lo, hi, K, blockIdx.z), so every barrier is reached by all. Shared
                // memory is static (≈ 22 KB; 35 KB for the wide kernels). Argument types match (const u8*, const float*,
                // const u8*, const float*, const u32*, float*, u32, u32, u32).
                unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            }
            None => {
                let mut b =
                    stream.launch_builder(if wide { &self.dense_wide } else { &self.dense });
                b.arg(x_codes).arg(x_scales).arg(w_codes).arg(w_scales);
                b.arg(y).arg(&r).arg(&n32).arg(&k32);
                // SAFETY: as the grouped launch with E = 1 and rows 0 .. R (gridDim.y = 1):
                // every read and write is inside the lengths checked above. Argument types
                // match (const u8*, const float*, const u8*, const float*, float*, u32, u32,
                // u32).
                unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
            }
        }
        Ok(())
    }

    /// Whether this device runs the fragment kernels ([`Fp8Block::gemm_nt_frag`]): sm_89 or
    /// newer (E4M3 tensor-core operands and conversions).
    pub fn frag_supported(&self) -> bool {
        self.frag_ok
    }

    /// The tensor-core variant [`Fp8Block::gemm_nt_frag`] runs.
    pub fn frag_mma(&self) -> Fp8FragMma {
        self.frag_mma.get()
    }

    /// Chooses the tensor-core variant of [`Fp8Block::gemm_nt_frag`] (default
    /// [`Fp8FragMma::F16`]: on an H200 as fast as [`Fp8FragMma::E4m3`] at 1–16 rows per
    /// expert and 1.4× faster at 64, with 150 registers per thread against 206).
    pub fn set_frag_mma(&self, mma: Fp8FragMma) {
        self.frag_mma.set(mma);
    }

    /// [`Fp8Block::gemm_nt`] over expert-major rows with the fragment kernels: the stored
    /// weight codes streamed straight into tensor-core fragments ([`Fp8Block::frag_mma`]), 32
    /// output columns of one expert per block, the expert's activation rows in passes of
    /// [`FragRows::for_rows`], K split over [`fp8_frag_split`] warps by whole 128-wide blocks.
    /// The arithmetic of `mxrl_tensor::qlinear::FP8_BLOCK_EMULATION` (fresh f32 `P_b` per K
    /// block, exact products; `y = fl(y + fl(fl(sx·sw) · P_b))` in increasing block order);
    /// reference `PreparedWeight::forward_inference`, bound `fp8_block_sum_bound`. For few
    /// rows per expert (decode batches, up to [`FRAG_ROWS_PER_EXPERT`] on average in the
    /// engine backend). Rows of no expert are left as they are.
    ///
    /// # Errors
    /// As [`Fp8Block::gemm_nt`]; also a device below sm_89.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_nt_frag(
        &self,
        x_codes: &CudaView<'_, u8>,
        x_scales: &CudaView<'_, u8>,
        w_codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        self.gemm_nt_frag_with(
            self.frag_mma(),
            FragRows::for_rows(s.rows, s.experts, FragRows::R32),
            fp8_frag_split(s),
            x_codes,
            x_scales,
            w_codes,
            w_scales,
            offsets,
            y,
            s,
        )
    }

    /// [`Fp8Block::gemm_nt_frag`] with the tensor-core variant `mma`, `rows` activation rows
    /// per pass and the reduction split over `split` warps per block (1 ..= 8). Neither
    /// `rows` nor `split` changes any bit of the result.
    ///
    /// # Errors
    /// As [`Fp8Block::gemm_nt_frag`]; also `split` outside 1 ..= 8.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_nt_frag_with(
        &self,
        mma: Fp8FragMma,
        rows: FragRows,
        split: usize,
        x_codes: &CudaView<'_, u8>,
        x_scales: &CudaView<'_, u8>,
        w_codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "fp8_block_gemm_frag";
        if !self.frag_ok {
            return Err(g.err(format!(
                "{op}: the fragment kernels need sm_89 or newer (E4M3 tensor-core operands)"
            )));
        }
        if !(1..=FRAG_MAX_SPLIT).contains(&split) {
            return Err(g.err(format!(
                "{op}: split {split} is not 1 ..= {FRAG_MAX_SPLIT} warps"
            )));
        }
        let groups = rows.rows() / 8;
        let tg = match groups {
            1 => 0,
            2 => 1,
            4 => 2,
            _ => {
                return Err(g.err(format!(
                    "{op}: no kernel for {} rows per pass (8, 16 or 32)",
                    rows.rows()
                )))
            }
        };
        if !self.check_operands(
            op,
            x_codes,
            x_scales,
            w_codes,
            w_scales,
            Some(offsets),
            y,
            s,
        )? {
            return Ok(());
        }
        debug_assert!(s.n.is_multiple_of(FRAG_COLS));
        // y of the pass (8 entries per token group × 32 lanes, f32), then the terms of the
        // block's warps in one round (split × as many) when split > 1.
        let entries = 8 * groups * 32;
        let smem = 4 * entries * (1 + if split > 1 { split } else { 0 });
        let cfg = LaunchConfig {
            grid_dim: (
                (s.n / FRAG_COLS) as u32,
                s.experts as u32,
                frag_row_blocks(s, rows) as u32,
            ),
            block_dim: (32 * split as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (r, n32, k32) = (s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(&self.frag[mma.index()][tg]);
        b.arg(x_codes)
            .arg(x_scales)
            .arg(w_codes)
            .arg(w_scales)
            .arg(offsets);
        b.arg(y).arg(&r).arg(&n32).arg(&k32);
        // SAFETY: lengths checked (check_operands): x codes R·K, x scales 4·R·K/128 bytes, w
        // codes E·N·K, w scales 4·E·(N/128)·(K/128) bytes, offsets E+1, y R·N; N and K
        // multiples of 128, N/32 blocks along x, E along y and frag_row_blocks (≤ FRAG_ROW_BLOCKS) along z
        // (all < 2³¹: u32-checked sizes, N/32 < 2²⁷). Block (bx, e, z) reads offsets[e],
        // offsets[e+1] (e < E) and only rows in [lo, hi) ⊆ [0, R] (clamped; its passes z,
        // z + Z, …): activation codes of those rows and weight rows
        // e·N + 32·bx + 0 .. 32 (< E·N) at 16-byte chunks 128·kb + 64h + 16t < K (kb < K/128;
        // 16-byte aligned: bases checked, row lengths K and chunk offsets multiples of 16),
        // their scales (< R·K/128 and < E·(N/128)·(K/128) floats, 4-byte aligned), and writes
        // y at those rows, columns 32·bx .. +32 ≤ N. Every thread of a block runs the same pass
        // and round loops (bounds from offsets, K and blockDim, equal for all), so both
        // barriers per round are reached by all (none with split 1); the dynamic shared array
        // holds (1 + split) × 8·TG × 32 floats (`smem`, ≤ 36 KiB; 8·TG × 32 with split 1), and
        // each thread indexes it below 8·TG·32·(1 + blockDim/32). sm_89+ checked. Argument
        // types match (const u8*, const float*, const u8*, const float*, const u32*, float*,
        // u32 × 3).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }
}
