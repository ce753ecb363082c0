//! Low-byte decode (kernels `kernels/ops_qgemm.cu`, compiled after the contract encoders of
//! `kernels/quant.cu`): the routed experts' MXFP8 / NVFP4 weights are multiplied as stored —
//! codes and block scales read once per used expert with 16-byte loads and dequantized in
//! registers — by activations quantized per the contract on the device.
//!
//! # Ops and their CPU references
//! - [`QGemm::quant_act_mxfp8`]: `x [rows, K]` f32 → the MXFP8 row-wise (1×32, E4M3 + UE8M0)
//!   dequantized values as BF16 bit patterns; reference `mxrl_formats::quantize(x,
//!   Scheme::MXFP8_ROW)` then [`mxrl_formats::QuantizedTensor::dequantize`] (the `Plain`
//!   operand of `mxrl_tensor::qlinear`).
//! - [`QGemm::quant_act_nvfp4`]: `x` → per-token NVFP4 (`Scheme::NVFP4_ROW`): the row amax
//!   (f32) and the GEMM operand `pre = e2m1(code) · e4m3(block scale)` as BF16 (the
//!   `Operand::Nvfp4 { pre }` values of `mxrl_tensor::qlinear`); [`QGemm::quant_act_nvfp4_f16`]
//!   the same values in binary16, the fragment kernels' operand.
//! - [`QGemm::quant_act_mxfp8_from`] / [`QGemm::quant_act_nvfp4_from`]: the same quantizers
//!   reading their rows through the dispatch permutation ([`ActRows::Gather`]) or computing
//!   SwiGLU of a gate/up output ([`ActRows::Swiglu`]); reference: `moe::Moe::gather` or
//!   `swiglu::Swiglu::forward`, then the plain quantizer (bit for bit).
//! - [`QGemm::grouped_nt_small_m_mxfp8`] / [`QGemm::grouped_nt_small_m_nvfp4`]: per expert,
//!   `y = x · W_eᵀ` on those operands (NVFP4: then `y = fl(y · α)`,
//!   α = [`mxrl_tensor::qlinear::nvfp4_alpha`]`(x_amax[r], w_amax[e])`); reference
//!   [`mxrl_tensor::qlinear::PreparedWeight::forward_inference`] per expert (the CPU backend's
//!   `grouped_qlinear`).
//! - [`QGemm::grouped_nt_tc_mxfp8`] / [`QGemm::grouped_nt_tc_nvfp4`] (weights decoded to BF16
//!   in shared memory) and [`QGemm::grouped_nt_frag_mxfp8`] / [`QGemm::grouped_nt_frag_nvfp4`]
//!   (decoded straight into the `mma` A fragments, K split over a block's warps): the same
//!   products on tensor cores, same references (bound `tensor_core_sum_bound`).
//! - [`QGemm::dequant_weights_mxfp8`] / [`QGemm::dequant_weights_nvfp4`]: stored weights →
//!   BF16 GEMM operands for the large-M (tensor-core) path, and [`QGemm::nvfp4_scale_rows`],
//!   NVFP4's α on that path's output.
//!
//! # Numerics
//! The operands are exact BF16 numbers (MXFP8: ≤ 4 significant bits times a power of two;
//! NVFP4: ≤ 6 bits in `[2⁻¹⁰, 2688]`), their products are exact in f32, and the sums run in
//! IEEE f32 on CUDA cores (`fma` of an exact product = a separate multiply and add): only the
//! summation order differs from the CPU emulation (bound
//! `mxrl_tensor::tolerance::two_order_sum_bound` over `Σ|x·w|`; NVFP4 `|α|·` that bound with
//! one more term for the final rounding). Where this holds, exactly:
//! - MXFP8 activation values are exact in BF16 for every block with scale byte ≥ 3, i.e.
//!   amax > 448·2⁻¹²⁵ ≈ 1.05·10⁻³⁵; a block below that is rounded to nearest-even BF16 (the
//!   one deviation from the contract's dequantized value). Weights through
//!   [`QGemm::dequant_weights_mxfp8`] the same; the small-M GEMM decodes weights to f32 and
//!   has no such limit.
//! - MXFP8 products are exact while `|x·w|` is 0 or in `[2⁻¹²⁶, f32::MAX]` (the blocks' scale
//!   bytes add up to ≥ 123: amax products above ~2⁻¹¹³); the CPU emulation rounds products
//!   outside that range too, so the bound assumes data inside it.
//! - NVFP4 operands and products are always exact. Special values: NaN codes decode to NaN,
//!   a block at f32's limit to ±Inf, as on the CPU.
//!
//! Deterministic: one thread owns each output and sums in an order fixed by the shapes and
//! the [`QLanes`] choice (the fragment kernels: each warp's tensor-core partial sums, added in
//! warp order through shared memory); no atomics on data. Every launcher checks lengths, alignment and
//! block multiples, then launches on the GPU's one stream without allocating or reading
//! anything back, so a decode step that uses them can be captured in a CUDA graph. The
//! grouped layout is [`super::gemm`]'s: rows of expert `e` are `offsets[e]..offsets[e+1]`
//! (device `u32 [E+1]`, clamped to `[0, R]` in the kernels), weights stacked per expert. The
//! fragment kernels' grid has a block row per expert, or one per row where most experts are
//! idle ([`frag_expert_rows`]).
//! Needs sm_89 or newer (`cvt.rn.f16x2.e4m3x2`): [`QGemm::new`] fails with NVRTC's message
//! elsewhere.
#![allow(unsafe_code)]

use super::gemm::Grouped;
use super::{check_align, check_len, check_u32, mul};
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};

/// Kernel source of this family (the module's name is `ops_qgemm`).
pub const SOURCE: &str = super::QGEMM_SOURCE;

/// Warps per block of the small-M kernels (`QM_WARPS`).
const QM_WARPS: usize = 8;
/// Output columns per lane group (`QM_NB`).
const QM_NB: usize = 4;
const QM_THREADS: u32 = (QM_WARPS * 32) as u32;
/// Threads per row of the NVFP4 activation quantizer (`QA_THREADS`).
const QA_THREADS: u32 = 128;
const THREADS: u32 = 256;

/// Block rows of a fragment kernel's grid: one per expert, or — with fewer rows than half the
/// experts, where most experts are idle (a decode step of one or two tokens) — one per row,
/// block row `y` then taking the `y`-th expert that has rows (`nth_busy_expert` in the
/// kernels), so the busy experts' blocks do not wait behind the idle ones'. Measured on an
/// H100 (BENCHMARKS.md): the busy-expert rows made NVFP4 decode 5.7 % faster at batch 1 and
/// 2.9 % at batch 2; at batch 4 and up the scan they start with cost MXFP8 up to 2 %.
pub fn frag_expert_rows(s: Grouped) -> usize {
    if 2 * s.rows < s.experts {
        s.rows.max(1)
    } else {
        s.experts
    }
}

/// Where a fused activation quantizer ([`QGemm::quant_act_mxfp8_from`],
/// [`QGemm::quant_act_nvfp4_from`]) reads the f32 values of its rows.
pub enum ActRows<'a, 'b> {
    /// `x [rows, k]` itself (the plain quantizer).
    Rows(&'a CudaView<'b, f32>),
    /// The expert-major routed rows of [`super::moe::Moe::gather`]: row `p` is token row
    /// `perm[p] / top_k` of `x [tokens, k]`, for `p < offsets[experts]` (read on the device);
    /// `rows = tokens · top_k`.
    Gather {
        /// Token rows `[tokens, k]`.
        x: &'a CudaView<'b, f32>,
        /// Token count.
        tokens: usize,
        /// The dispatch's permutation (`tokens · top_k` slots).
        perm: &'a CudaView<'b, u32>,
        /// The experts' row ranges (`experts + 1`).
        offsets: &'a CudaView<'b, u32>,
        /// Expert count.
        experts: usize,
        /// Experts per token.
        top_k: usize,
    },
    /// SwiGLU of a fused gate/up output `gu [rows, 2k]` (gate in `0..k`, up in `k..2k`): the
    /// values [`super::swiglu::Swiglu`]'s f32 forward writes.
    Swiglu(&'a CudaView<'b, f32>),
}

/// The stored block format of a low-byte weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowByte {
    /// E4M3 codes `[N, K]` with UE8M0 scales `[N, K/32]` (`Scheme::MXFP8_ROW`).
    Mxfp8,
    /// Packed E2M1 codes `[N, K/2]` (low nibble first) with E4M3 scales `[N, K/16]` and one
    /// f32 amax per tensor (`Scheme::NVFP4_TENSOR`).
    Nvfp4,
}

impl LowByte {
    /// Both formats.
    pub const ALL: [LowByte; 2] = [LowByte::Mxfp8, LowByte::Nvfp4];

    /// Weight elements in one 16-byte load of codes (16 E4M3 or 32 E2M1).
    pub fn chunk(self) -> usize {
        match self {
            LowByte::Mxfp8 => 16,
            LowByte::Nvfp4 => 32,
        }
    }

    /// Code bytes of one stored weight row of `k` elements (MXFP8 one per element, NVFP4 two
    /// elements per byte): the kernels' `row_bytes`.
    pub fn row_code_bytes(self, k: usize) -> usize {
        match self {
            LowByte::Mxfp8 => k,
            LowByte::Nvfp4 => k / 2,
        }
    }

    /// Stored bytes of one `[n, k]` weight: codes + scales (+ the f32 amax of NVFP4).
    pub fn weight_bytes(self, n: usize, k: usize) -> usize {
        match self {
            LowByte::Mxfp8 => n * k + n * k / 32,
            LowByte::Nvfp4 => n * k / 2 + n * k / 16 + 4,
        }
    }
}

/// How many lanes of a warp share one group of 4 output columns (`QM_NB`) in the small-M
/// kernels (the rest of the warp takes further columns): 32 lanes split a row's 16-byte
/// chunks 32 ways; 16 or 8 lanes keep every lane busy when a row has fewer chunks
/// (`K / LowByte::chunk`), at the cost of fewer, larger blocks. Also changes the summation
/// order (each within the same bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QLanes {
    /// 32 lanes per column group: 4 columns per warp, 32 per block.
    L32,
    /// 16 lanes: 8 columns per warp, 64 per block.
    L16,
    /// 8 lanes: 16 columns per warp, 128 per block.
    L8,
}

impl QLanes {
    /// Every choice.
    pub const ALL: [QLanes; 3] = [QLanes::L32, QLanes::L16, QLanes::L8];

    /// Lanes per column group.
    pub fn lanes(self) -> usize {
        match self {
            QLanes::L32 => 32,
            QLanes::L16 => 16,
            QLanes::L8 => 8,
        }
    }

    /// Output columns one block covers.
    pub fn cols_per_block(self) -> usize {
        QM_WARPS * QM_NB * (32 / self.lanes())
    }

    fn index(self) -> usize {
        match self {
            QLanes::L32 => 0,
            QLanes::L16 => 1,
            QLanes::L8 => 2,
        }
    }

    /// The launchers' choice for rows of `k` elements in `format`: the split that leaves the
    /// fewest lanes idle on the row's `k / chunk` loads (ties: more lanes per group, i.e.
    /// more blocks). Benchmark shapes: MXFP8 K = 2048 → 32, K = 768 → 16; NVFP4 K = 2048 →
    /// 32, K = 768 → 8.
    pub fn for_shape(format: LowByte, k: usize) -> Self {
        let chunks = k / format.chunk();
        let mut best = QLanes::L32;
        let mut best_idle = usize::MAX;
        for l in QLanes::ALL {
            let idle = chunks.div_ceil(l.lanes()) * l.lanes() - chunks;
            if idle < best_idle {
                best = l;
                best_idle = idle;
            }
        }
        best
    }
}

/// One thread per eight elements (`n8` of them), blocks of 256: the AdamW passes' grid.
fn threads_8(n8: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n8.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The loaded low-byte kernels of one GPU.
pub struct QGemm {
    gpu: Gpu,
    act_mxfp8: CudaFunction,
    act_nvfp4: CudaFunction,
    act_nvfp4_f16: CudaFunction,
    /// The activation quantizers fused with the op that makes their rows
    /// ([`QGemm::quant_act_mxfp8_from`], [`QGemm::quant_act_nvfp4_from`]): MXFP8 gathered /
    /// SwiGLU, NVFP4 gathered / SwiGLU in BF16 and in binary16.
    act_mxfp8_gather: CudaFunction,
    act_mxfp8_swiglu: CudaFunction,
    /// `quant_act_mxfp8_rowcol{,_gather,_swiglu}`.
    act_mxfp8_rowcol: [CudaFunction; 3],
    act_nvfp4_gather: [CudaFunction; 2],
    act_nvfp4_swiglu: [CudaFunction; 2],
    /// `quant_act_nvfp4[_f16]_parts_{gather,swiglu}` ([`QGemm::quant_act_nvfp4_parts_from`]).
    act_nvfp4_parts_gather: [CudaFunction; 2],
    act_nvfp4_parts_swiglu: [CudaFunction; 2],
    deq_mxfp8: CudaFunction,
    deq_nvfp4: CudaFunction,
    adamw_mxfp8: CudaFunction,
    adamw_mxfp8_rowcol: CudaFunction,
    adamw_fp8_block: CudaFunction,
    adamw_amax: CudaFunction,
    /// An 8-element stand-in for an absent optional output of the AdamW passes (never
    /// written).
    no_u16: CudaSlice<u16>,
    scale_rows: CudaFunction,
    mxfp8: [CudaFunction; 3],
    nvfp4: [CudaFunction; 3],
    tc_mxfp8: CudaFunction,
    tc_nvfp4: CudaFunction,
    frag_mxfp8: [CudaFunction; 4],
    /// The same with the fast MXFP8 decode ([`Mxfp8Decode::Fast`]).
    frag_mxfp8f: [CudaFunction; 4],
    frag_nvfp4: [CudaFunction; 4],
    frag_bf16: [CudaFunction; 4],
    /// Up to three dense BF16 weights on one input ([`QGemm::dense_nt_frag_bf16_multi`]).
    frag_bf16x3: [CudaFunction; 4],
    staged_mxfp8: [CudaFunction; 4],
    staged_mxfp8f: [CudaFunction; 4],
    staged_nvfp4: [CudaFunction; 4],
    staged_bf16: [CudaFunction; 4],
    act_fp8b: CudaFunction,
    mxfp8_fast_check: CudaFunction,
    mxfp8_decode_table: CudaFunction,
    /// [stage count of FP8_STAGES][rows per pass].
    staged_fp8b: [[CudaFunction; 4]; 3],
    /// [stage count of FP8_STAGES][rows per pass].
    staged_fp8b3: [[CudaFunction; 4]; 3],
}

/// Columns per block of the tensor-core grouped kernels (`QT_BN`); `N` must be a multiple.
pub const TC_COLS: usize = 64;
/// Reduction depth of one stage of the tensor-core grouped kernels (`QT_BK`); `K` must be a
/// multiple.
pub const TC_DEPTH: usize = 64;
const QT_THREADS: u32 = 128;

/// Output columns per block of the fragment kernels (`QF_COLS`); `N` must be a multiple.
pub const FRAG_COLS: usize = 32;
/// The most warps a block of the fragment kernels splits the reduction over (`QF_MAX_WARPS`).
pub const FRAG_MAX_SPLIT: usize = 8;

/// The fragment kernels' split of the reduction for a shape whose weight rows are `row_bytes`
/// long (BF16 `2K`, MXFP8 `K`, NVFP4 `K/2`): warps per 32-column block, the largest of 8, 4,
/// 2, 1 that leaves each warp at least [`FRAG_MIN_STEPS`] super-steps of 64 bytes per row —
/// 3 while the step's blocks (`min(experts, rows)` experts × `n / 32` column blocks) are
/// fewer than [`FRAG_MANY_BLOCKS`] (batch 1: a deep split keeps enough loads in flight), 6
/// beyond (batch 32–128: a shallow split leaves more of each warp's time to its loads than to
/// the reduction). Measured on an H200 (BENCHMARKS.md). Changes the f32 summation order
/// (deterministic for a shape), not the products.
pub fn frag_split(s: Grouped, row_bytes: usize) -> usize {
    let blocks = s.experts.min(s.rows) * (s.n / FRAG_COLS);
    let min_steps = FRAG_MIN_STEPS[usize::from(blocks >= FRAG_MANY_BLOCKS)];
    let steps = row_bytes.div_ceil(64);
    let mut split = FRAG_MAX_SPLIT;
    while split > 1 && steps < min_steps * split {
        split /= 2;
    }
    split
}

/// Dynamic shared memory of a fragment kernel's block: the partial sums of its `split` warps,
/// each 8 accumulators per token group of 8 rows for each of 32 lanes (f32); none for one warp.
fn frag_smem_bytes(rows: FragRows, split: usize) -> usize {
    if split > 1 {
        split * 8 * (rows.rows() / 8) * 32 * 4
    } else {
        0
    }
}

/// Super-steps per warp [`frag_split`] keeps at least: few blocks, many blocks.
pub const FRAG_MIN_STEPS: [usize; 2] = [3, 6];

/// Blocks of a step from which [`frag_split`] counts it as many (~16 per SM of an H200).
pub const FRAG_MANY_BLOCKS: usize = 2048;

/// How the warps of a fragment kernel's block share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragLayout {
    /// 1, 2, 4 or 8 warps split the reduction of one block of [`FRAG_COLS`] columns, each lane
    /// loading its weight and activation chunks from global memory into registers, one
    /// super-step ahead ([`frag_split`]).
    Split(usize),
    /// [`STAGED_WARPS`] warps on adjacent [`FRAG_COLS`]-column blocks of one expert (one warp
    /// each, the whole reduction), the expert's activation rows loaded once per block: every
    /// super-step's weight and activation bytes are copied into shared memory by `cp.async`
    /// [`STAGED_STAGES`] − 1 super-steps ahead. The same fragments and the same `mma`
    /// sequence as `Split(1)`, so the same bits.
    Staged,
}

/// Warps (column blocks of [`FRAG_COLS`]) per block of [`FragLayout::Staged`] (`QS_WARPS`).
pub const STAGED_WARPS: usize = 4;
/// Shared-memory stages of [`FragLayout::Staged`] (`QS_STAGES`).
pub const STAGED_STAGES: usize = 3;
/// The most dynamic shared memory a [`FragLayout::Staged`] launch may take (H200: 227 KiB per
/// block).
pub const STAGED_SMEM_MAX: usize = 200 << 10;

/// Dynamic shared memory of a [`FragLayout::Staged`] block for weights of `format` (`None`:
/// BF16) with rows of `k` elements and `rows` activation rows per pass: the scale rows of its
/// `32 · STAGED_WARPS` weight rows, the stages of each warp's 32 × 64 weight bytes and the
/// stages of the pass's activation rows (elements per super-step + 8, as BF16).
pub fn staged_smem_bytes(format: Option<LowByte>, k: usize, rows: FragRows) -> usize {
    let (scale_row, elems) = match format {
        Some(LowByte::Mxfp8) => (k / 32, 64),
        Some(LowByte::Nvfp4) => (k / 16, 128),
        None => (0, 32),
    };
    FRAG_COLS * STAGED_WARPS * scale_row
        + STAGED_STAGES * STAGED_WARPS * 32 * 64
        + STAGED_STAGES * rows.rows() * (elems + 8) * 2
}

/// Dynamic shared memory of a staged FP8-block block ([`QGemm::grouped_nt_staged_fp8_block`])
/// at `k` elements per row, `rows` activation rows per pass and `stages` stages: its 128-row
/// weight scale tile row (`k / 128` floats, rounded up to 16 bytes), the stages of each warp's
/// 32 × 64 code bytes, the stages of the pass's binary16 activation rows (64 elements per
/// super-step + 8) and the pass's activation scales (`rows · k / 128` floats).
pub fn fp8_staged_smem_bytes(k: usize, rows: FragRows, stages: usize) -> usize {
    let kbs = k / 128;
    (4 * kbs).div_ceil(16) * 16
        + stages * STAGED_WARPS * 32 * 64
        + stages * rows.rows() * (64 + 8) * 2
        + rows.rows() * kbs * 4
}

/// The stage counts the staged FP8-block kernels are compiled for
/// ([`QGemm::grouped_nt_staged_fp8_block_with`], [`QGemm::dense_nt_staged_fp8_block_multi_with`]).
pub const FP8_STAGES: [usize; 3] = [3, 4, 6];

/// The stages [`QGemm::grouped_nt_staged_fp8_block`] takes for routed experts: three, the
/// count measured on an H200 (`bench_fp8block --staged`, BENCHMARKS.md). The 64-row kernel's
/// 211 registers hold an SM to two blocks, so four or six stages would cost no occupancy;
/// `bench_fp8block --staged` times them beside it.
pub const FP8_ROUTED_STAGES_PICK: usize = 3;

/// The stages [`QGemm::dense_nt_staged_fp8_block_multi`] takes: six. A dense launch has few
/// blocks (q, k and v of a decode step: 40 column blocks × 8 row blocks), each bound by its
/// own latency, and its 64-row kernel's registers (216) already hold an SM to two blocks, which
/// six stages' shared memory (≈ 107 KB at k = 2048) still allows.
pub const FP8_DENSE_STAGES_PICK: usize = 6;

/// One dense weight of [`QGemm::dense_nt_staged_fp8_block_multi`]: E4M3 codes `[n, k]`, the
/// f32 `scale_inv [n/128, k/128]` as bytes, the output `y [rows, n]` and `n`.
pub type Fp8DenseOut<'a, 'b> = (
    CudaView<'a, u8>,
    CudaView<'a, u8>,
    CudaViewMut<'b, f32>,
    usize,
);

/// The most warps a block of [`QGemm::dense_nt_frag_bf16_multi`] splits the reduction over
/// (`QF_DENSE_MAX_WARPS`).
pub const DENSE_FRAG_MAX_SPLIT: usize = 16;

/// [`QGemm::dense_nt_frag_bf16_multi`]'s rows per pass and split for `rows` rows of dense
/// weights with rows of `k`: the smallest pass that holds the rows (at most
/// [`FragRows::largest`] for BF16, 32 rows), and the deepest split up to
/// [`dense_frag_max_split`] warps that leaves each warp at least `FRAG_MIN_STEPS[0]`
/// super-steps of 64 bytes per row. A dense launch has few column blocks (`n / 32`), and each
/// warp's super-steps run one after another, so a deep split is a short chain. Changes the
/// f32 summation order (deterministic for a shape), not the products.
pub fn dense_frag_plan(rows: usize, k: usize) -> (FragRows, usize) {
    let fr = FragRows::for_rows(rows, 1, FragRows::largest(None));
    let steps = frag_row_bytes(None, k).div_ceil(64);
    let mut split = dense_frag_max_split(rows);
    while split > 1 && steps < FRAG_MIN_STEPS[0] * split {
        split /= 2;
    }
    (fr, split)
}

/// The deepest split [`dense_frag_plan`] takes for `rows` rows: [`DENSE_FRAG_MAX_SPLIT`] (16
/// warps) up to 32 rows, 8 up to 64, 4 beyond — each pass of 32 rows past the first adds row
/// blocks, so the warps per column block multiply. Measured on an H100 (`bench_qgemm --dense`
/// under Nsight Compute, q/k/v of the benchmark model, BENCHMARKS.md): 8.7 µs at 16 warps
/// against 10.2 at 8 for 3 rows; 13.2 at 8 against 16.9 at 16 for 64 rows; 18.8 at 4 against
/// 23.1 at 8 for 128 rows.
pub fn dense_frag_max_split(rows: usize) -> usize {
    if rows <= 32 {
        DENSE_FRAG_MAX_SPLIT
    } else if rows <= 64 {
        8
    } else {
        4
    }
}

/// Blocks per column block of [`QGemm::dense_nt_frag_bf16_multi`]: one per pass of `fr` rows
/// over the `rows`, at most [`DENSE_ROW_BLOCKS`]. Changes which block runs a pass, not any
/// sum.
pub fn dense_frag_row_blocks(rows: usize, fr: FragRows) -> usize {
    rows.div_ceil(fr.rows()).clamp(1, DENSE_ROW_BLOCKS)
}

/// The launchers' layout for a step: [`FragLayout::Staged`] from [`STAGED_ROWS_PER_EXPERT`]
/// rows per expert on average, where its shared memory fits; else [`FragLayout::Split`] of
/// [`frag_split`]. Measured on an H200 (`bench_qgemm --large`, BENCHMARKS.md, three stages):
/// from 16 rows per expert the staged kernels are the faster for every weight format (gate/up
/// at up to 26 rows per expert: MXFP8 118.5 against 127.0 µs, NVFP4 85.2 against 103.6, BF16
/// 175.6 against 182.4).
pub fn frag_layout(s: Grouped, format: Option<LowByte>, rows: FragRows) -> FragLayout {
    if rows_per_expert(s) >= staged_layout_rows()
        && staged_smem_bytes(format, s.k, rows) <= STAGED_SMEM_MAX
    {
        FragLayout::Staged
    } else {
        FragLayout::Split(frag_split(s, frag_row_bytes(format, s.k)))
    }
}

/// Bytes of one stored weight row of `k` elements for the fragment kernels: the format's
/// codes ([`LowByte::row_code_bytes`]), or `2k` for BF16 weights (`None`).
pub fn frag_row_bytes(format: Option<LowByte>, k: usize) -> usize {
    format.map_or(2 * k, |f| f.row_code_bytes(k))
}

/// Rows per expert of a step on average (rounded up), what the launchers' choices read.
fn rows_per_expert(s: Grouped) -> usize {
    s.rows.div_ceil(s.experts.max(1))
}

/// Blocks per (column block, expert) of the fragment kernels, each taking every
/// `FRAG_ROW_BLOCKS`-th pass over the expert's rows from its own: 1 up to
/// [`STAGED_ROWS_PER_EXPERT`] rows per expert on average, else the passes the step's rows
/// could fill, at most [`FRAG_ROW_BLOCKS`]. Routing in a rollout is far from uniform (many
/// sequences at a similar point send their tokens to the same experts), and a busy expert's
/// passes run one after another in one block while the others are done; the extra blocks of
/// idle experts return at once. Changes which block runs a pass, not any sum. Taken by both
/// layouts ([`FragLayout`]) and the FP8-block fragment kernels.
pub fn frag_row_blocks(s: Grouped, rows: FragRows) -> usize {
    if rows_per_expert(s) < STAGED_ROWS_PER_EXPERT {
        return 1;
    }
    s.rows.div_ceil(rows.rows()).clamp(1, FRAG_ROW_BLOCKS)
}

/// The most blocks [`frag_row_blocks`] gives one expert's column block.
pub const FRAG_ROW_BLOCKS: usize = 8;

/// Blocks per column block of the staged FP8-block kernels: [`frag_row_blocks`] for routed
/// experts; for one weight over every row (a dense linear: prefill, training) up to
/// [`DENSE_ROW_BLOCKS`], one pass each where the rows allow — a dense launch has only
/// `n / 128` column blocks, and each block's passes run one after another. Changes which
/// block runs a pass, not any sum.
pub fn fp8_row_blocks(s: Grouped, rows: FragRows) -> usize {
    if s.experts == 1 {
        s.rows.div_ceil(rows.rows()).clamp(1, DENSE_ROW_BLOCKS)
    } else {
        frag_row_blocks(s, rows)
    }
}

/// The most blocks [`fp8_row_blocks`] gives one column block of a dense weight (the tiled
/// FP8-block kernels' limit).
pub const DENSE_ROW_BLOCKS: usize = 64;

/// Average rows per expert from which [`frag_layout`] takes [`FragLayout::Staged`].
pub const STAGED_ROWS_PER_EXPERT: usize = 9;

/// The average rows per expert from which [`frag_layout`] takes [`FragLayout::Staged`]:
/// `MXRL_STAGED_ROWS` (for comparisons; the passes and row blocks keep their
/// [`STAGED_ROWS_PER_EXPERT`] rule) or [`STAGED_ROWS_PER_EXPERT`]. Read once.
pub fn staged_layout_rows() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("MXRL_STAGED_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(STAGED_ROWS_PER_EXPERT)
    })
}

/// The launchers' rows per pass for weights of `format` (`None`: BF16): in the staged layout
/// (from [`STAGED_ROWS_PER_EXPERT`] rows per expert on average), the smallest pass that holds
/// `avg + ⌈2·√avg⌉` rows (`avg` the average rows per expert), so that most experts of a
/// routed step (whose counts spread around the average) take one pass over their weights
/// rather than two, capped at [`FragRows::largest_staged`]; else [`FragRows::for_rows`]
/// capped at [`FragRows::largest`]. Measured on an H200 at 32 rows per expert on average (up
/// to 42): MXFP8 gate/up in 64-row passes 134 µs against 176 µs in 32-row passes.
pub fn frag_rows(s: Grouped, format: Option<LowByte>) -> FragRows {
    let avg = rows_per_expert(s);
    if avg >= STAGED_ROWS_PER_EXPERT {
        let margin = (2.0 * (avg as f64).sqrt()).ceil() as usize;
        FragRows::for_rows(avg + margin, 1, FragRows::largest_staged(format))
    } else {
        FragRows::for_rows(s.rows, s.experts, FragRows::largest(format))
    }
}

/// The largest MXFP8 scale byte [`Mxfp8Decode::Fast`] takes (`MXFP8_FAST_MAX_SCALE`): its BF16
/// factor `2^(s − 7)` stays finite.
pub const MXFP8_FAST_MAX_SCALE: u8 = 134;

/// [`QGemm::mxfp8_fast_check`] on the host, for stored bytes that are there: no NaN code
/// (`0x7F` / `0xFF`) and no scale byte above [`MXFP8_FAST_MAX_SCALE`].
pub fn mxfp8_fast_eligible(codes: &[u8], scales: &[u8]) -> bool {
    codes.iter().all(|&c| c & 0x7F != 0x7F) && scales.iter().all(|&b| b <= MXFP8_FAST_MAX_SCALE)
}

/// How the MXFP8 fragment kernels decode the stored weights into their BF16 operands; both
/// give the same operand bits, so the same sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mxfp8Decode {
    /// Every code and scale byte (E4M3 → binary16 → f32, times the scale, rounded to BF16).
    General,
    /// In BF16 throughout (the code's bits placed as `value · 2⁻¹²⁰`, one BF16 multiply by
    /// `2^(s − 7)`), in two thirds of the instructions; only for weights without NaN codes and
    /// with scale bytes ≤ 134 ([`QGemm::mxfp8_fast_check`]).
    Fast,
}

/// Activation rows per pass of the fragment kernels ([`QGemm::grouped_nt_frag_mxfp8`]): token
/// groups of 8 (the `n8` of `mma.m16n8k16`) multiplied by each decoded weight fragment. An
/// expert with more rows takes further passes over its weights; fewer leave columns of the
/// B operand zero. Changes only which rows share a pass, not any sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragRows {
    /// 8 rows per pass (one token group).
    R8,
    /// 16 rows per pass.
    R16,
    /// 32 rows per pass.
    R32,
    /// 64 rows per pass (prefill-sized decode batches: 512 sequences over 64 experts).
    R64,
}

impl FragRows {
    /// Every choice.
    pub const ALL: [FragRows; 4] = [FragRows::R8, FragRows::R16, FragRows::R32, FragRows::R64];

    /// Activation rows per pass.
    pub fn rows(self) -> usize {
        match self {
            FragRows::R8 => 8,
            FragRows::R16 => 16,
            FragRows::R32 => 32,
            FragRows::R64 => 64,
        }
    }

    fn index(self) -> usize {
        match self {
            FragRows::R8 => 0,
            FragRows::R16 => 1,
            FragRows::R32 => 2,
            FragRows::R64 => 3,
        }
    }

    /// The launchers' choice for `rows` activation rows over `experts` experts: the smallest
    /// pass that holds the average expert's rows (⌈rows / experts⌉ ≤ 8 → 8, ≤ 16 → 16, ≤ 32
    /// → 32, else 64), at most `largest`. The per-expert counts live on the device, so a busier
    /// expert than the average takes more passes.
    pub fn for_rows(rows: usize, experts: usize, largest: FragRows) -> Self {
        let avg = rows.div_ceil(experts.max(1));
        let fit = if avg <= 8 {
            FragRows::R8
        } else if avg <= 16 {
            FragRows::R16
        } else if avg <= 32 {
            FragRows::R32
        } else {
            FragRows::R64
        };
        if fit.rows() <= largest.rows() {
            fit
        } else {
            largest
        }
    }

    /// The largest pass the launchers take for weights of format `f` (`None`: BF16). Measured
    /// on an H200 at 64–128 rows per expert (`bench_qgemm --large`, BENCHMARKS.md): 64-row
    /// passes are faster for MXFP8 (its decode is shared by twice the rows); for NVFP4 and
    /// BF16 the 64-row kernels' registers (up to 249 per thread) cost more than they save, so
    /// their passes stop at 32 rows.
    pub fn largest(f: Option<LowByte>) -> Self {
        match f {
            Some(LowByte::Mxfp8) => FragRows::R64,
            Some(LowByte::Nvfp4) | None => FragRows::R32,
        }
    }

    /// The largest pass of the staged layout ([`FragLayout::Staged`]) for weights of format
    /// `f`: 64 rows for every format (a pass whose rows fill at most half of it runs half its
    /// token groups). Measured on an H200 (`bench_qgemm --large --busy`, 64 experts, one of
    /// them holding 1/8 of the rows, as in the rollouts; gate/up, 4096 rows): NVFP4 192.7
    /// against 231.7 µs in 32-row passes, MXFP8 183.0 against 265.6, BF16 259.0 against
    /// 417.4. With uniform routing at up to 42 rows per expert NVFP4's 32-row passes are the
    /// faster (114.8 against 129.6 µs); the rollouts' routing is not uniform.
    pub fn largest_staged(_f: Option<LowByte>) -> Self {
        FragRows::R64
    }
}

fn grid_x(gpu: &Gpu, op: &str, blocks: usize) -> Result<u32, DeviceError> {
    if blocks > i32::MAX as usize {
        return Err(gpu.err(format!("{op}: {blocks} blocks exceed the grid's x limit")));
    }
    Ok(blocks as u32)
}

fn check_multiple(gpu: &Gpu, op: &str, k: usize, of: usize, why: &str) -> Result<(), DeviceError> {
    if !k.is_multiple_of(of) {
        return Err(gpu.err(format!("{op}: k = {k} must be a multiple of {of} ({why})")));
    }
    Ok(())
}

impl QGemm {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC (e.g. a GPU older than sm_89) or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_qgemm", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        // The fragment kernels' reduction array at its largest (FragRows::R64 at their most
        // warps: 64 KiB for split 8, 128 for the dense entries' 16) is past the 48 KiB a
        // launch gets without asking.
        let frag = |fmt: &str, split: usize| {
            ["t1", "t2", "t4", "t8"].map(|t| {
                let name = format!("qgemm_frag_{fmt}_{t}");
                let func = f(&name)?;
                gpu.allow_dynamic_smem(&func, &name, frag_smem_bytes(FragRows::R64, split))?;
                Ok::<_, DeviceError>(func)
            })
        };
        let [a, b, c, d] = frag("mxfp8", FRAG_MAX_SPLIT);
        let frag_mxfp8 = [a?, b?, c?, d?];
        let [a, b, c, d] = frag("mxfp8f", FRAG_MAX_SPLIT);
        let frag_mxfp8f = [a?, b?, c?, d?];
        let [a, b, c, d] = frag("nvfp4", FRAG_MAX_SPLIT);
        let frag_nvfp4 = [a?, b?, c?, d?];
        let [a, b, c, d] = frag("bf16", FRAG_MAX_SPLIT);
        let frag_bf16 = [a?, b?, c?, d?];
        let [a, b, c, d] = frag("bf16x3", DENSE_FRAG_MAX_SPLIT);
        let frag_bf16x3 = [a?, b?, c?, d?];
        // The staged kernels' stages and scale rows: up to STAGED_SMEM_MAX (checked per launch).
        let staged = |fmt: &str| {
            ["t1", "t2", "t4", "t8"].map(|t| {
                let name = format!("qgemm_fragsm_{fmt}_{t}");
                let func = f(&name)?;
                gpu.allow_dynamic_smem(&func, &name, STAGED_SMEM_MAX)?;
                Ok::<_, DeviceError>(func)
            })
        };
        let [a, b, c, d] = staged("mxfp8");
        let staged_mxfp8 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("mxfp8f");
        let staged_mxfp8f = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("nvfp4");
        let staged_nvfp4 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("bf16");
        let staged_bf16 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("fp8b");
        let s3 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("fp8b_s4");
        let s4 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("fp8b_s6");
        let staged_fp8b = [s3, s4, [a?, b?, c?, d?]];
        let [a, b, c, d] = staged("fp8b3_s3");
        let s3 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("fp8b3_s4");
        let s4 = [a?, b?, c?, d?];
        let [a, b, c, d] = staged("fp8b3_s6");
        let staged_fp8b3 = [s3, s4, [a?, b?, c?, d?]];
        Ok(QGemm {
            gpu: gpu.clone(),
            act_mxfp8: f("quant_act_mxfp8")?,
            act_nvfp4: f("quant_act_nvfp4")?,
            act_nvfp4_f16: f("quant_act_nvfp4_f16")?,
            act_mxfp8_gather: f("quant_act_mxfp8_gather")?,
            act_mxfp8_swiglu: f("quant_act_mxfp8_swiglu")?,
            act_mxfp8_rowcol: [
                f("quant_act_mxfp8_rowcol")?,
                f("quant_act_mxfp8_rowcol_gather")?,
                f("quant_act_mxfp8_rowcol_swiglu")?,
            ],
            act_nvfp4_gather: [
                f("quant_act_nvfp4_gather")?,
                f("quant_act_nvfp4_f16_gather")?,
            ],
            act_nvfp4_swiglu: [
                f("quant_act_nvfp4_swiglu")?,
                f("quant_act_nvfp4_f16_swiglu")?,
            ],
            act_nvfp4_parts_gather: [
                f("quant_act_nvfp4_parts_gather")?,
                f("quant_act_nvfp4_f16_parts_gather")?,
            ],
            act_nvfp4_parts_swiglu: [
                f("quant_act_nvfp4_parts_swiglu")?,
                f("quant_act_nvfp4_f16_parts_swiglu")?,
            ],
            deq_mxfp8: f("dequant_mxfp8_bf16")?,
            deq_nvfp4: f("dequant_nvfp4_bf16")?,
            adamw_mxfp8: f("adamw_mxfp8_row")?,
            adamw_mxfp8_rowcol: f("adamw_mxfp8_rowcol")?,
            adamw_fp8_block: f("adamw_fp8_block")?,
            adamw_amax: f("adamw_amax_groups")?,
            no_u16: gpu.zeros(8)?,
            scale_rows: f("nvfp4_scale_rows")?,
            mxfp8: [
                f("qgemm_mxfp8_l32")?,
                f("qgemm_mxfp8_l16")?,
                f("qgemm_mxfp8_l8")?,
            ],
            nvfp4: [
                f("qgemm_nvfp4_l32")?,
                f("qgemm_nvfp4_l16")?,
                f("qgemm_nvfp4_l8")?,
            ],
            tc_mxfp8: f("qgemm_tc_mxfp8")?,
            tc_nvfp4: f("qgemm_tc_nvfp4")?,
            frag_mxfp8,
            frag_mxfp8f,
            frag_nvfp4,
            frag_bf16,
            frag_bf16x3,
            staged_mxfp8,
            staged_mxfp8f,
            staged_nvfp4,
            staged_bf16,
            act_fp8b: f("quant_act_fp8_block_f16")?,
            mxfp8_fast_check: f("mxfp8_fast_check")?,
            mxfp8_decode_table: f("mxfp8_decode_table")?,
            staged_fp8b,
            staged_fp8b3,
        })
    }

    /// MXFP8 row-wise activation quantization as the GEMM operand: `x [rows, k]` f32 →
    /// `out [rows, k]` BF16 bit patterns of the dequantized values
    /// `fl(ue8m0_decode(s) · e4m3_value(q))` (1×32 blocks, E4M3 codes and UE8M0 scales bytewise
    /// those of `mxrl_formats::quantize(x, [rows, k], Scheme::MXFP8_ROW)`). Exact in BF16 for
    /// blocks with amax > 448·2⁻¹²⁵; smaller blocks are rounded to nearest-even BF16 (module
    /// doc).
    ///
    /// # Errors
    /// `k` not a multiple of 32, short or misaligned buffers (x and out 16-byte aligned),
    /// launch errors.
    pub fn quant_act_mxfp8(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "quant_act_mxfp8";
        check_multiple(g, op, k, 32, "MXFP8 blocks of 32")?;
        let len = mul(g, op, rows, k)?;
        check_len(g, &format!("{op} x"), x.len(), len)?;
        check_len(g, &format!("{op} out"), out.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let stream = g.stream();
        check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)?;
        check_align(g, &format!("{op} out"), out.device_ptr_mut(stream).0, 16)?;
        let n_blocks = (len / 32) as u64;
        let threads = len / 8;
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, threads.div_ceil(THREADS as usize))?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.act_mxfp8);
        b.arg(x).arg(out).arg(&n_blocks);
        // SAFETY: x and out hold rows·k elements (checked), 16-byte aligned (checked); thread t
        // handles elements 8t .. 8t+8 of block t/4 only when t/4 < rows·k/32 (whole blocks, as
        // k % 32 == 0), other threads load nothing and store nothing; the grid covers rows·k/8
        // threads in whole blocks of 256 (every warp complete for the shuffles). Argument
        // types match (const float*, u16*, u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Per-token NVFP4 activation quantization as the GEMM operand: `x [rows, k]` f32 →
    /// `amax [rows]` f32 (the row's max |x|, NaN ignored, as `mxrl_formats` computes it) and
    /// `out_pre [rows, k]` BF16 bit patterns of `e2m1_value(code) · e4m3_value(scale)` (exact),
    /// codes and scales bytewise those of `mxrl_formats::quantize(x, [rows, k],
    /// Scheme::NVFP4_ROW)`. The GEMM applies the row's factor after the sum.
    ///
    /// # Errors
    /// `k` not a multiple of 16, short or misaligned buffers (x and out_pre 16-byte aligned),
    /// launch errors.
    pub fn quant_act_nvfp4(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        self.quant_act_nvfp4_on(
            &self.act_nvfp4,
            "quant_act_nvfp4",
            x,
            rows,
            k,
            out_pre,
            amax,
        )
    }

    /// [`QGemm::quant_act_nvfp4`] with `out_pre` the binary16 bit patterns of the same values
    /// (exact: ≤ 6 significant bits in `[2⁻¹⁰, 2688]`): the operand of the fragment kernels
    /// ([`QGemm::grouped_nt_frag_nvfp4`]), which multiply binary16.
    ///
    /// # Errors
    /// As [`QGemm::quant_act_nvfp4`].
    pub fn quant_act_nvfp4_f16(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let op = "quant_act_nvfp4_f16";
        self.quant_act_nvfp4_on(&self.act_nvfp4_f16, op, x, rows, k, out_pre, amax)
    }

    #[allow(clippy::too_many_arguments)]
    fn quant_act_nvfp4_on(
        &self,
        func: &CudaFunction,
        op: &str,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_multiple(g, op, k, 16, "NVFP4 blocks of 16")?;
        let len = mul(g, op, rows, k)?;
        check_len(g, &format!("{op} x"), x.len(), len)?;
        check_len(g, &format!("{op} out_pre"), out_pre.len(), len)?;
        check_len(g, &format!("{op} amax"), amax.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let stream = g.stream();
        check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)?;
        check_align(
            g,
            &format!("{op} out_pre"),
            out_pre.device_ptr_mut(stream).0,
            16,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, rows)?, 1, 1),
            block_dim: (QA_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let k64 = k as u64;
        let mut b = g.stream().launch_builder(func);
        b.arg(x).arg(out_pre).arg(amax).arg(&k64);
        // SAFETY: x and out_pre hold rows·k elements, amax rows (checked); block r touches row
        // r < rows only: elements 8c .. 8c+8 for c < k/8 (k % 16 == 0, so pairs of threads
        // share whole 16-blocks), 16-byte aligned (bases checked, rows are 64-byte multiples);
        // amax[r] written by thread 0. Every warp runs the same iterations (shuffles complete).
        // Argument types match (const float*, u16*, float*, u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// [`QGemm::quant_act_mxfp8`] of the rows `src` names, in one launch: the gathered token
    /// rows or the SwiGLU of a gate/up output quantized without first writing them. Every row
    /// is quantized alone, so `out [rows, k]` holds the bytes of the unfused ops followed by
    /// [`QGemm::quant_act_mxfp8`] (rows past a gather's `offsets[experts]` are left untouched,
    /// as [`super::moe::Moe::gather`] leaves them).
    ///
    /// # Errors
    /// `k` not a multiple of 32, short or misaligned buffers (16-byte aligned), a gather's
    /// shape past the dispatch's limits, launch errors.
    pub fn quant_act_mxfp8_from(
        &self,
        src: &ActRows<'_, '_>,
        rows: usize,
        k: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "quant_act_mxfp8_from";
        if let ActRows::Rows(x) = src {
            return self.quant_act_mxfp8(x, rows, k, out);
        }
        check_multiple(g, op, k, 32, "MXFP8 blocks of 32")?;
        let len = mul(g, op, rows, k)?;
        check_len(g, &format!("{op} out"), out.len(), len)?;
        self.check_act_rows(op, src, rows, k)?;
        if len == 0 {
            return Ok(());
        }
        check_align(
            g,
            &format!("{op} out"),
            out.device_ptr_mut(g.stream()).0,
            16,
        )?;
        let fs = (&self.act_mxfp8_gather, &self.act_mxfp8_swiglu);
        self.launch_act_rows(src, fs, THREADS, rows, k, out, None, None)
    }

    /// [`QGemm::quant_act_nvfp4`] (`f16`: [`QGemm::quant_act_nvfp4_f16`]) of the rows `src`
    /// names, in one launch: `out_pre [rows, k]` and `amax [rows]` hold the bytes of the
    /// unfused ops (the gathers of the token rows' operands and amaxes, or SwiGLU) followed by
    /// the quantizer (rows past a gather's `offsets[experts]` are left untouched).
    ///
    /// # Errors
    /// As [`QGemm::quant_act_mxfp8_from`], with NVFP4's blocks of 16.
    pub fn quant_act_nvfp4_from(
        &self,
        src: &ActRows<'_, '_>,
        f16: bool,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let op = "quant_act_nvfp4_from";
        if let ActRows::Rows(x) = src {
            return if f16 {
                self.quant_act_nvfp4_f16(x, rows, k, out_pre, amax)
            } else {
                self.quant_act_nvfp4(x, rows, k, out_pre, amax)
            };
        }
        self.nvfp4_fused(op, src, f16, rows, k, out_pre, amax, false)
            .map(|_| ())
    }

    /// [`QGemm::quant_act_nvfp4_from`] of gathered or SwiGLU rows that also returns, from the
    /// same pass, the three BF16 parts `[3, rows, k]` (`hi`, `mid`, `lo` planes) of every
    /// element's contract dequantization, `fl(e2m1 · fl(fl(e4m3(scale) · amax) · R2688))`
    /// split exactly (`QLinear::nvfp4_split3_rows`'s values for the same codes, scales and
    /// per-row amax): the operand the NVFP4 `dequantized` backward's wgrad multiplies.
    ///
    /// # Errors
    /// Plain rows (they take the unfused quantizer and the split), and as
    /// [`QGemm::quant_act_nvfp4_from`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quant_act_nvfp4_parts_from(
        &self,
        src: &ActRows<'_, '_>,
        f16: bool,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
    ) -> Result<CudaSlice<u16>, DeviceError> {
        let op = "quant_act_nvfp4_parts_from";
        if let ActRows::Rows(_) = src {
            return Err(self
                .gpu
                .err(format!("{op}: plain rows have no fused split")));
        }
        let parts = self.nvfp4_fused(op, src, f16, rows, k, out_pre, amax, true)?;
        Ok(parts.expect("asked for"))
    }

    /// The fused NVFP4 quantizer of gathered or SwiGLU rows, with the dequantization's three
    /// parts where `with_parts` (returned).
    #[allow(clippy::too_many_arguments)]
    fn nvfp4_fused(
        &self,
        op: &str,
        src: &ActRows<'_, '_>,
        f16: bool,
        rows: usize,
        k: usize,
        out_pre: &mut CudaViewMut<'_, u16>,
        amax: &mut CudaViewMut<'_, f32>,
        with_parts: bool,
    ) -> Result<Option<CudaSlice<u16>>, DeviceError> {
        let g = &self.gpu;
        check_multiple(g, op, k, 16, "NVFP4 blocks of 16")?;
        let len = mul(g, op, rows, k)?;
        check_len(g, &format!("{op} out_pre"), out_pre.len(), len)?;
        check_len(g, &format!("{op} amax"), amax.len(), rows)?;
        self.check_act_rows(op, src, rows, k)?;
        let mut parts = match with_parts {
            true => Some(g.empty::<u16>(mul(g, op, 3, len)?)?),
            false => None,
        };
        if rows == 0 {
            return Ok(parts);
        }
        let ptr = out_pre.device_ptr_mut(g.stream()).0;
        check_align(g, &format!("{op} out_pre"), ptr, 16)?;
        let w = usize::from(f16);
        let fs = match with_parts {
            true => (
                &self.act_nvfp4_parts_gather[w],
                &self.act_nvfp4_parts_swiglu[w],
            ),
            false => (&self.act_nvfp4_gather[w], &self.act_nvfp4_swiglu[w]),
        };
        let mut pv = parts.as_mut().map(|p| p.as_view_mut());
        self.launch_act_rows(
            src,
            fs,
            QA_THREADS,
            rows,
            k,
            out_pre,
            Some(amax),
            pv.as_mut(),
        )?;
        Ok(parts)
    }

    /// Column-wise MXFP8 of the rows `src` names (`rows` of `k`, `k % 64 == 0`) in the row
    /// segments `seg` (`count` pairs `[first row, rows ≤ 32]`, never across a group), each
    /// segment one 32×1 block per column zero-padded, dequantized into BF16 `col_out [rows,
    /// k]`; with `row_out`, also [`QGemm::quant_act_mxfp8`]'s values of those rows, from the
    /// same read. One launch over tiles of a segment × 64 columns
    /// (`quant_act_mxfp8_rowcol{,_gather,_swiglu}`); rows outside every segment are left
    /// untouched. The segments must lie in `0..rows` (`QLinear::col_segments` builds them so).
    ///
    /// # Errors
    /// `k` not a multiple of 64, short or misaligned buffers (16-byte), a gather's shape past
    /// the dispatch's limits, launch errors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quant_act_mxfp8_rowcol(
        &self,
        src: &ActRows<'_, '_>,
        rows: usize,
        k: usize,
        seg: &CudaView<'_, u32>,
        count: usize,
        col_out: &mut CudaViewMut<'_, u16>,
        row_out: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "quant_act_mxfp8_rowcol";
        check_multiple(g, op, k, 64, "tiles of 64 columns")?;
        let len = mul(g, op, rows, k)?;
        self.check_act_rows(op, src, rows, k)?;
        check_len(
            g,
            &format!("{op} segments"),
            seg.len(),
            mul(g, op, 2, count)?,
        )?;
        let stream = g.stream();
        check_len(g, &format!("{op} column-wise out"), col_out.len(), len)?;
        check_align(
            g,
            &format!("{op} column-wise out"),
            col_out.device_ptr_mut(stream).0,
            16,
        )?;
        if let Some(r) = &row_out {
            check_len(g, &format!("{op} row-wise out"), r.len(), len)?;
            check_align(g, &format!("{op} row-wise out"), r.device_ptr(stream).0, 16)?;
        }
        if count == 0 || len == 0 {
            return Ok(());
        }
        let tiles = mul(g, op, count, k / 64)?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, tiles)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (write_row, k64) = (i32::from(row_out.is_some()), k as u64);
        let t32 = match src {
            ActRows::Gather { top_k, .. } => *top_k as u32,
            _ => 0,
        };
        let mut b = match src {
            ActRows::Rows(x) => {
                let mut b = stream.launch_builder(&self.act_mxfp8_rowcol[0]);
                b.arg(*x);
                b
            }
            ActRows::Gather { x, perm, .. } => {
                let mut b = stream.launch_builder(&self.act_mxfp8_rowcol[1]);
                b.arg(*x).arg(*perm).arg(&t32);
                b
            }
            ActRows::Swiglu(gu) => {
                let mut b = stream.launch_builder(&self.act_mxfp8_rowcol[2]);
                b.arg(*gu);
                b
            }
        };
        b.arg(seg).arg(col_out);
        match row_out {
            Some(r) => b.arg(r),
            None => b.arg(&self.no_u16),
        };
        b.arg(&write_row).arg(&k64);
        // SAFETY: block (j, tc) < (count, k/64) reads seg[2j], seg[2j+1] (2·count held,
        // checked); its threads read row p = seg[2j] + r < rows of the source (the segments lie
        // in 0..rows, the caller's contract: x rows·k, a gather's perm[p] < tokens·top_k slots
        // of x tokens·k, gate/up rows·2k, all checked) at chunk 8·tc + c8 < k/8, and write
        // col_out (and row_out when write_row != 0) at p·k + 64·tc + 8·c8 + [0, 8) < rows·k
        // (both hold rows·k, 16-byte aligned, checked; the stand-in for an absent row_out is
        // never written). Every thread reaches the barriers and every lane the shuffles.
        // Argument types match (const float*, [const u32*, u32,] const u32*, u16*, u16*, int,
        // u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Launches a fused quantizer over `src` (checked by the caller: lengths, alignment, shape)
    /// with one block of `threads` per row: `fs` = (gathered, SwiGLU) kernels, whose arguments
    /// are the source's, then `k`, `out` and (NVFP4) `amax`.
    #[allow(clippy::too_many_arguments)]
    fn launch_act_rows(
        &self,
        src: &ActRows<'_, '_>,
        fs: (&CudaFunction, &CudaFunction),
        threads: u32,
        rows: usize,
        k: usize,
        out: &mut CudaViewMut<'_, u16>,
        amax: Option<&mut CudaViewMut<'_, f32>>,
        parts: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "fused activation quantizer";
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, rows)?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let k64 = k as u64;
        let (e32, t32) = match src {
            ActRows::Gather { experts, top_k, .. } => (*experts as u32, *top_k as u32),
            _ => (0, 0),
        };
        let mut b = match src {
            ActRows::Rows(_) => unreachable!("plain rows take the plain quantizers"),
            ActRows::Gather {
                x, perm, offsets, ..
            } => {
                let mut b = g.stream().launch_builder(fs.0);
                b.arg(*x).arg(*perm).arg(*offsets).arg(&e32).arg(&t32);
                b
            }
            ActRows::Swiglu(gu) => {
                let mut b = g.stream().launch_builder(fs.1);
                b.arg(*gu);
                b
            }
        };
        b.arg(&k64).arg(out);
        if let Some(a) = amax {
            b.arg(a);
        }
        let pstride = (rows * k) as u64;
        if let Some(p) = parts {
            b.arg(p).arg(&pstride);
        }
        // SAFETY: the caller checked every length against rows·k (x: tokens·k, perm: rows,
        // offsets: experts + 1, gate/up: rows·2k, out: rows·k, amax: rows), k a multiple of
        // the format's block (so 16-byte chunks stay inside a row) and the bases 16-byte
        // aligned. Block r < rows reads row r's source (token row perm[r] / top_k < tokens,
        // the dispatch's permutation of tokens·top_k slots, for r < offsets[experts], else it
        // returns; or gate/up row r) and writes row r of out and amax[r] only, and with parts
        // (3·rows·k held, 16-byte aligned: a fresh allocation) row r of each of its three
        // planes of rows·k. Every warp of a block runs the same chunk loop (shuffles and
        // barriers complete). Argument types match the kernels' (const float*, [const u32*,
        // const u32*, u32, u32,] u64, u16* [, float* [, u16*, u64]]).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// The lengths, alignment and shape of a fused quantizer's source of `rows` rows of `k`.
    fn check_act_rows(
        &self,
        op: &str,
        src: &ActRows<'_, '_>,
        rows: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let stream = g.stream();
        match src {
            ActRows::Rows(x) => {
                check_len(g, &format!("{op} x"), x.len(), mul(g, op, rows, k)?)?;
                check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)
            }
            ActRows::Gather {
                x,
                tokens,
                perm,
                offsets,
                experts,
                top_k,
            } => {
                let slots = mul(g, op, *tokens, *top_k)?;
                if slots != rows || *top_k == 0 || *experts == 0 {
                    return Err(g.err(format!(
                        "{op}: {rows} gathered rows from {tokens} tokens × top-{top_k} over \
                         {experts} experts (rows must be tokens · top_k, both nonzero)"
                    )));
                }
                check_u32(g, op, &[("experts", *experts), ("top_k", *top_k)])?;
                check_len(g, &format!("{op} x"), x.len(), mul(g, op, *tokens, k)?)?;
                check_len(g, &format!("{op} perm"), perm.len(), rows)?;
                check_len(g, &format!("{op} offsets"), offsets.len(), experts + 1)?;
                check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)
            }
            ActRows::Swiglu(gu) => {
                let len = mul(g, op, rows, mul(g, op, 2, k)?)?;
                check_len(g, &format!("{op} gate/up"), gu.len(), len)?;
                check_align(g, &format!("{op} gate/up"), gu.device_ptr(stream).0, 16)
            }
        }
    }

    /// Sizes of a grouped GEMM within u32 and the experts within the grid's y limit.
    fn check_dims(&self, op: &str, s: Grouped) -> Result<(), DeviceError> {
        let g = &self.gpu;
        s.check_u32(g, op)?;
        if s.experts > 65_535 {
            return Err(g.err(format!(
                "{op}: {} experts exceed the grid's y limit 65535",
                s.experts
            )));
        }
        Ok(())
    }

    /// Lengths of the activation rows `x [R, K]` (16-byte aligned), the offsets `[E + 1]` and
    /// the output `y [R, N]` of a grouped GEMM.
    fn check_rows_io(
        &self,
        op: &str,
        s: Grouped,
        x: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, &format!("{op} x"), x.len(), mul(g, op, s.rows, s.k)?)?;
        check_len(g, &format!("{op} offsets"), offsets.len(), s.experts + 1)?;
        check_len(g, &format!("{op} y"), y.len(), mul(g, op, s.rows, s.n)?)?;
        check_align(g, &format!("{op} x"), x.device_ptr(g.stream()).0, 16)
    }

    /// Checks a low-byte grouped GEMM: `k % 32`, `n % 4`, u32 and grid limits, lengths and
    /// alignment of the operands every format has.
    #[allow(clippy::too_many_arguments)]
    fn check_grouped(
        &self,
        op: &str,
        f: LowByte,
        s: Grouped,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_multiple(
            g,
            op,
            s.k,
            32,
            "one 16-byte load of codes never straddles a scale block",
        )?;
        if !s.n.is_multiple_of(QM_NB) {
            return Err(g.err(format!(
                "{op}: n = {} must be a multiple of {QM_NB} (columns per lane group)",
                s.n
            )));
        }
        self.check_dims(op, s)?;
        let en = mul(g, op, s.experts, s.n)?;
        let enk = mul(g, op, en, s.k)?;
        let codes_len = mul(g, op, en, f.row_code_bytes(s.k))?;
        let scales_len = match f {
            LowByte::Mxfp8 => enk / 32,
            LowByte::Nvfp4 => enk / 16,
        };
        self.check_rows_io(op, s, x, offsets, y)?;
        check_len(g, &format!("{op} codes"), codes.len(), codes_len)?;
        check_len(g, &format!("{op} scales"), scales.len(), scales_len)?;
        let stream = g.stream();
        check_align(g, &format!("{op} codes"), codes.device_ptr(stream).0, 16)?;
        if f == LowByte::Nvfp4 {
            check_align(g, &format!("{op} scales"), scales.device_ptr(stream).0, 2)?;
        }
        Ok(())
    }

    fn grouped_grid(
        &self,
        op: &str,
        lanes: QLanes,
        s: Grouped,
    ) -> Result<LaunchConfig, DeviceError> {
        Ok(LaunchConfig {
            grid_dim: (
                grid_x(&self.gpu, op, s.n.div_ceil(lanes.cols_per_block()))?,
                s.experts as u32,
                1,
            ),
            block_dim: (QM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Grouped small-M forward on MXFP8 weights as stored: `y[r, :] = x[r, :] · W_eᵀ` for
    /// every row `r` of every expert `e`, `x [R, K]` the BF16 operand of
    /// [`QGemm::quant_act_mxfp8`], `codes [E, N, K]` E4M3, `scales [E, N, K/32]` UE8M0 (compact,
    /// per expert back to back, the bytes `mxrl_formats` writes), `y [R, N]` f32 (written on
    /// the experts' rows only); [`QLanes::for_shape`]. Reference, per expert:
    /// `PreparedWeight::forward_inference` with `LinearSpec(Mxfp8)` on the f32 rows.
    ///
    /// # Errors
    /// `k` not a multiple of 32 or `n` of 4, short or misaligned buffers (x and codes 16-byte
    /// aligned), sizes beyond u32 or the grid; launch errors.
    pub fn grouped_nt_small_m_mxfp8(
        &self,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let lanes = QLanes::for_shape(LowByte::Mxfp8, s.k);
        self.grouped_nt_small_m_mxfp8_with(lanes, x, codes, scales, offsets, y, s)
    }

    /// [`QGemm::grouped_nt_small_m_mxfp8`] with the lane split `lanes`: grid
    /// `(⌈N / lanes.cols_per_block()⌉, E)`, blocks of experts without rows exit at once.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_mxfp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_small_m_mxfp8_with(
        &self,
        lanes: QLanes,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_small_m_mxfp8";
        self.check_grouped(op, LowByte::Mxfp8, s, x, codes, scales, offsets, y)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = self.grouped_grid(op, lanes, s)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let g = &self.gpu;
        let mut b = g.stream().launch_builder(&self.mxfp8[lanes.index()]);
        b.arg(x).arg(codes).arg(scales).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, codes E·N·K, scales E·N·K/32, offsets E+1 and y R·N elements
        // (checked); k % 32 == 0 and n % 4 == 0 (checked), x and codes 16-byte aligned
        // (checked) and every weight row K bytes (a multiple of 16), so each 16-byte load at
        // chunk c < K/16 of a column n < N stays inside its row and its scale byte c/2 inside
        // the row's K/32; block (bx, e) reads offsets[e], offsets[e+1] (e < E), clamps them to
        // [0, R]; lane groups whose columns start at N or beyond load nothing and write
        // nothing, whole warps past N exit before any shuffle. Argument types match (const
        // u16*, const u8*, const u8*, const u32*, float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Grouped small-M forward on NVFP4 weights as stored: `y[r, :] = fl(α · x_pre[r, :] ·
    /// W_eᵀ)` for every row `r` of every expert `e`, `x_pre [R, K]` and `x_amax [R]` from
    /// [`QGemm::quant_act_nvfp4`], `codes [E, N, K/2]` packed E2M1 (low nibble first),
    /// `scales [E, N, K/16]` E4M3, `w_amax [E]` (each expert's per-tensor amax), `y [R, N]`
    /// f32 (experts' rows only), `α = fl(fl(x_amax[r] · w_amax[e]) · NVFP4_ALPHA_FACTOR_INV)`
    /// ([`mxrl_tensor::qlinear::nvfp4_alpha`]); [`QLanes::for_shape`]. Reference, per expert:
    /// `PreparedWeight::forward_inference` with `LinearSpec(Nvfp4)`, per-token activations.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_mxfp8`]; also short amax buffers, scales not 2-byte
    /// aligned.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_small_m_nvfp4(
        &self,
        x_pre: &CudaView<'_, u16>,
        x_amax: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let lanes = QLanes::for_shape(LowByte::Nvfp4, s.k);
        self.grouped_nt_small_m_nvfp4_with(
            lanes, x_pre, x_amax, codes, scales, w_amax, offsets, y, s,
        )
    }

    /// [`QGemm::grouped_nt_small_m_nvfp4`] with the lane split `lanes`.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_nvfp4`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_small_m_nvfp4_with(
        &self,
        lanes: QLanes,
        x_pre: &CudaView<'_, u16>,
        x_amax: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_small_m_nvfp4";
        let g = &self.gpu;
        self.check_grouped(op, LowByte::Nvfp4, s, x_pre, codes, scales, offsets, y)?;
        check_len(g, &format!("{op} x_amax"), x_amax.len(), s.rows)?;
        check_len(g, &format!("{op} w_amax"), w_amax.len(), s.experts)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = self.grouped_grid(op, lanes, s)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(&self.nvfp4[lanes.index()]);
        b.arg(x_pre).arg(x_amax).arg(codes).arg(scales).arg(w_amax);
        b.arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x_pre holds R·K, x_amax R, codes E·N·K/2, scales E·N·K/16, w_amax E, offsets
        // E+1 and y R·N elements (checked); k % 32 == 0 and n % 4 == 0 (checked); x_pre and
        // codes 16-byte, scales 2-byte aligned (checked), weight rows K/2 bytes (a multiple of
        // 16) and scale rows K/16 (even), so each 16-byte load at chunk c < K/32 and each u16
        // scale pair 2c stays inside its row; rows come from offsets clamped to [0, R], x_amax
        // is read for those rows, w_amax for e < E; lane groups past N load and write
        // nothing, whole warps past N exit before any shuffle. Argument types match (const
        // u16*, const float*, const u8*, const u8*, const float*, const u32*, float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Whether the tensor-core grouped kernels take this shape (`N` a multiple of
    /// [`TC_COLS`], `K` of [`TC_DEPTH`]).
    pub fn tc_fits(n: usize, k: usize) -> bool {
        n.is_multiple_of(TC_COLS) && k.is_multiple_of(TC_DEPTH)
    }

    fn check_tc(&self, op: &str, s: Grouped) -> Result<(), DeviceError> {
        if !Self::tc_fits(s.n, s.k) {
            return Err(self.gpu.err(format!(
                "{op}: n = {} must be a multiple of {TC_COLS} and k = {} of {TC_DEPTH}",
                s.n, s.k
            )));
        }
        Ok(())
    }

    fn tc_grid(&self, op: &str, s: Grouped) -> Result<LaunchConfig, DeviceError> {
        Ok(LaunchConfig {
            grid_dim: (grid_x(&self.gpu, op, s.n / TC_COLS)?, s.experts as u32, 1),
            block_dim: (QT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// [`QGemm::grouped_nt_small_m_mxfp8`] on tensor cores: per expert, 16-row tiles of the
    /// BF16 activation operand times the stored MXFP8 weights decoded to BF16 in shared memory
    /// (the exact values [`QGemm::dequant_weights_mxfp8`] writes), `mma.m16n8k16` with f32
    /// accumulation; each used expert's bytes are read once per 16 of its rows. For 1–32 rows
    /// per expert (decode batches). Products exact, sums in the tensor cores' order: the
    /// tiled kernels' bound.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_mxfp8`]; also `n` not a multiple of [`TC_COLS`] or `k`
    /// of [`TC_DEPTH`].
    pub fn grouped_nt_tc_mxfp8(
        &self,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_tc_mxfp8";
        self.check_grouped(op, LowByte::Mxfp8, s, x, codes, scales, offsets, y)?;
        self.check_tc(op, s)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = self.tc_grid(op, s)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let g = &self.gpu;
        let mut b = g.stream().launch_builder(&self.tc_mxfp8);
        b.arg(x).arg(codes).arg(scales).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, codes E·N·K, scales E·N·K/32, offsets E+1 and y R·N elements
        // (checked); n % 64 == 0 and k % 64 == 0 (checked), x and codes 16-byte aligned
        // (checked), rows K elements / K bytes (multiples of 64): block (bx, e) reads weight
        // rows bx·64 .. +64 < N of expert e < E, 16-byte chunks c < K/16 and scale bytes c/2 <
        // K/32 of each, activation rows in [lo, hi) ⊆ [0, R] (offsets clamped) with 16-byte
        // loads inside K, and writes y at those rows, columns < N (8-byte float2 stores at even
        // offsets); shared tiles are static; every thread of a block runs the same loop
        // counts, so the barriers are reached by all. Argument types match (const u16*, const
        // u8*, const u8*, const u32*, float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// [`QGemm::grouped_nt_small_m_nvfp4`] on tensor cores (as [`QGemm::grouped_nt_tc_mxfp8`]:
    /// the stored E2M1 codes and E4M3 scales decoded to the exact `pre` values in shared
    /// memory), `y = fl(α · sum)` per row.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_nvfp4`]; also `n` not a multiple of [`TC_COLS`] or `k`
    /// of [`TC_DEPTH`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_tc_nvfp4(
        &self,
        x_pre: &CudaView<'_, u16>,
        x_amax: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_tc_nvfp4";
        let g = &self.gpu;
        self.check_grouped(op, LowByte::Nvfp4, s, x_pre, codes, scales, offsets, y)?;
        self.check_tc(op, s)?;
        check_len(g, &format!("{op} x_amax"), x_amax.len(), s.rows)?;
        check_len(g, &format!("{op} w_amax"), w_amax.len(), s.experts)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = self.tc_grid(op, s)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(&self.tc_nvfp4);
        b.arg(x_pre).arg(x_amax).arg(codes).arg(scales).arg(w_amax);
        b.arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: as grouped_nt_tc_mxfp8, with codes E·N·K/2 and scales E·N·K/16 bytes
        // (checked; weight rows K/2 bytes, 16-byte chunks c < K/32, the u16 scale pair 2c <
        // K/16 of each row, 2-byte aligned: scales checked 2-byte aligned and K/16 even),
        // x_amax read at rows < R (R entries), w_amax at e < E (E entries). Argument types
        // match (const u16*, const float*, const u8*, const u8*, const float*, const u32*,
        // float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// The staged layout copies each block's scale rows with 16-byte `cp.async`: `scales`
    /// must be 16-byte aligned there (every block's rows start at a multiple of 32 rows).
    fn check_staged_scales(
        &self,
        op: &str,
        layout: FragLayout,
        scales: &CudaView<'_, u8>,
    ) -> Result<(), DeviceError> {
        if layout == FragLayout::Staged && !scales.is_empty() {
            let g = &self.gpu;
            check_align(
                g,
                &format!("{op} scales"),
                scales.device_ptr(g.stream()).0,
                16,
            )?;
        }
        Ok(())
    }

    /// Whether the fragment kernels take this shape (`N` a multiple of [`FRAG_COLS`]; `K` of 32
    /// as every low-byte GEMM).
    pub fn frag_fits(n: usize, k: usize) -> bool {
        n.is_multiple_of(FRAG_COLS) && k.is_multiple_of(32)
    }

    fn frag_grid(
        &self,
        op: &str,
        s: Grouped,
        format: Option<LowByte>,
        rows: FragRows,
        layout: FragLayout,
    ) -> Result<LaunchConfig, DeviceError> {
        if !Self::frag_fits(s.n, s.k) {
            return Err(self.gpu.err(format!(
                "{op}: n = {} must be a multiple of {FRAG_COLS} (columns per block)",
                s.n
            )));
        }
        match layout {
            FragLayout::Split(split) => {
                if !matches!(split, 1 | 2 | 4 | 8) {
                    return Err(self
                        .gpu
                        .err(format!("{op}: split {split} is not 1, 2, 4 or 8 warps")));
                }
                Ok(LaunchConfig {
                    grid_dim: (
                        grid_x(&self.gpu, op, s.n / FRAG_COLS)?,
                        frag_expert_rows(s) as u32,
                        frag_row_blocks(s, rows) as u32,
                    ),
                    block_dim: (32 * split as u32, 1, 1),
                    shared_mem_bytes: frag_smem_bytes(rows, split) as u32,
                })
            }
            FragLayout::Staged => {
                let smem = staged_smem_bytes(format, s.k, rows);
                if smem > STAGED_SMEM_MAX {
                    return Err(self.gpu.err(format!(
                        "{op}: the staged layout needs {smem} B of shared memory at k = {} \
                         (at most {STAGED_SMEM_MAX})",
                        s.k
                    )));
                }
                let cols = FRAG_COLS * STAGED_WARPS;
                Ok(LaunchConfig {
                    grid_dim: (
                        grid_x(&self.gpu, op, s.n.div_ceil(cols))?,
                        s.experts as u32,
                        frag_row_blocks(s, rows) as u32,
                    ),
                    block_dim: (32 * STAGED_WARPS as u32, 1, 1),
                    shared_mem_bytes: smem as u32,
                })
            }
        }
    }

    /// The kernel of `layout` among a format's split (`frag`) and staged (`staged`) entries.
    fn frag_kernel<'a>(
        layout: FragLayout,
        rows: FragRows,
        frag: &'a [CudaFunction; 4],
        staged: &'a [CudaFunction; 4],
    ) -> &'a CudaFunction {
        match layout {
            FragLayout::Split(_) => &frag[rows.index()],
            FragLayout::Staged => &staged[rows.index()],
        }
    }

    /// [`QGemm::grouped_nt_small_m_mxfp8`] on tensor cores with the stored weights decoded
    /// straight into `mma.m16n8k16` A fragments (no shared-memory round trip): per block 32
    /// output columns of one expert, its warps ([`frag_split`]) splitting K (or, from
    /// [`STAGED_ROWS_PER_EXPERT`] rows per expert, [`FragLayout::Staged`]: [`frag_layout`]), the expert's
    /// activation rows as the B operand in passes of [`FragRows::for_rows`] (up to
    /// [`FragRows::largest`]). Weight values are those
    /// [`QGemm::dequant_weights_mxfp8`] writes (exact for scale bytes ≥ 3); products exact,
    /// f32 sums in the tensor cores' order per warp, then the warps' partial sums added in a
    /// fixed order (bound: `tensor_core_sum_bound`; deterministic). Each used expert's bytes
    /// are read once per pass. The engine backend takes it up to
    /// `backend::QFRAG_ROWS_PER_EXPERT` rows per expert (decode batches up to rollout size).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_mxfp8`]; also `n` not a multiple of [`FRAG_COLS`].
    pub fn grouped_nt_frag_mxfp8(
        &self,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let decode = Mxfp8Decode::General;
        self.grouped_nt_frag_mxfp8_decode(decode, x, codes, scales, offsets, y, s)
    }

    /// [`QGemm::grouped_nt_frag_mxfp8`] with the weights decoded by `decode`: the same bits
    /// either way, [`Mxfp8Decode::Fast`] in fewer instructions but only for weights
    /// [`QGemm::mxfp8_fast_check`] found eligible (the caller's promise; other weights would
    /// give wrong values, not an error).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_frag_mxfp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_mxfp8_decode(
        &self,
        decode: Mxfp8Decode,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let f = Some(LowByte::Mxfp8);
        let rows = frag_rows(s, f);
        let layout = frag_layout(s, f, rows);
        self.grouped_nt_frag_mxfp8_decode_with(
            decode, rows, layout, x, codes, scales, offsets, y, s,
        )
    }

    /// Whether stored MXFP8 weights (`codes`, `scales` as [`QGemm::grouped_nt_frag_mxfp8`]
    /// takes them) may take [`Mxfp8Decode::Fast`]: no NaN code (0x7F / 0xFF) and no scale byte
    /// above 134 (a block amax below 2⁸·448). One pass over the bytes, then the answer is read
    /// back (a synchronization): once per weight version.
    ///
    /// # Errors
    /// `codes` not a multiple of 4 bytes or misaligned, launch and copy errors.
    pub fn mxfp8_fast_check(
        &self,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
    ) -> Result<bool, DeviceError> {
        let g = &self.gpu;
        let op = "mxfp8_fast_check";
        check_multiple(g, op, codes.len(), 4, "whole u32 words of codes")?;
        let stream = g.stream();
        check_align(g, &format!("{op} codes"), codes.device_ptr(stream).0, 4)?;
        let mut ok = g.upload(&[1u32])?;
        if codes.is_empty() && scales.is_empty() {
            return Ok(true);
        }
        let (nc, ns) = (codes.len() as u64, scales.len() as u64);
        let blocks = (codes.len() / 4).div_ceil(256).clamp(1, 1024) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.mxfp8_fast_check);
        b.arg(codes).arg(&nc).arg(scales).arg(&ns).arg(&mut ok);
        // SAFETY: codes holds nc bytes (nc % 4 == 0, 4-byte aligned: read as nc/4 u32 words),
        // scales ns bytes, ok one u32; the grid-stride loops stay below those counts. Argument
        // types match (const u32*, u64, const u8*, u64, u32*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(g.download(&ok)?[0] == 1)
    }

    /// The checks of an AdamW pass over `p` in rows of `k` (`k` a positive multiple of
    /// `block`, `p.n` of `k`): step ≥ 1, lengths, 16-byte aligned f32 and BF16 buffers.
    fn check_adamw(
        &self,
        op: &str,
        p: &crate::ops::optim::AdamWParam<'_, '_>,
        grad_scale: &CudaView<'_, f32>,
        step: u64,
        k: usize,
        block: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if step == 0 {
            return Err(g.err("AdamW step counts from 1"));
        }
        let n = p.n;
        if k == 0 || !k.is_multiple_of(block) || !n.is_multiple_of(k) {
            return Err(g.err(format!(
                "{op}: {n} elements in rows of {k} (K must be a positive multiple of {block})"
            )));
        }
        check_len(g, &format!("{op} param"), p.param.len(), n)?;
        check_len(g, &format!("{op} grad"), p.grad.len(), n)?;
        check_len(g, &format!("{op} m"), p.m.len(), n)?;
        check_len(g, &format!("{op} v"), p.v.len(), n)?;
        check_len(g, &format!("{op} grad scale"), grad_scale.len(), 1)?;
        let stream = g.stream();
        for (what, ptr) in [
            ("param", p.param.device_ptr(stream).0),
            ("grad", p.grad.device_ptr(stream).0),
            ("m", p.m.device_ptr(stream).0),
            ("v", p.v.device_ptr(stream).0),
        ] {
            check_align(g, &format!("{op} {what}"), ptr, 16)?;
        }
        if let Some(b) = &p.param_bf16 {
            check_len(g, &format!("{op} bf16 copy"), b.len(), n)?;
            check_align(g, &format!("{op} bf16 copy"), b.device_ptr(stream).0, 16)?;
        }
        Ok(())
    }

    /// One AdamW step of MXFP8-stored weights and their quantization in one pass
    /// (`adamw_mxfp8_row`): `p.param` (`p.n` elements, rows of `k` with `k % 32 == 0`) is
    /// updated as [`crate::ops::optim::Optim::adamw_step`] updates it (the same bits; also
    /// `p.m`, `p.v` and the BF16 copy when given), then quantized row-wise into `codes`
    /// (`n` bytes) and `scales` (`n/32`), the bytes `mxfp8_row_f32` gives for the new values.
    /// `deq`, when given, receives their contract dequantization in BF16 (the values of
    /// [`QGemm::dequant_weights_mxfp8`]). Returns a device flag: 0 when the weights may take
    /// [`Mxfp8Decode::Fast`] ([`QGemm::mxfp8_fast_check`]'s answer), else 1 (zeroed on the
    /// stream, no upload); reading it is left to the caller (no synchronization here). `col`,
    /// when given, receives the BF16 of the contract dequantization of the new values'
    /// column-wise MXFP8 in blocks of 32 rows from row 0 (`QLinear::mxfp8_col_groups_bf16`'s
    /// values for weights of a multiple of 32 rows each; `adamw_mxfp8_rowcol`, which needs
    /// `k % 64 == 0` and whole 32-row blocks).
    ///
    /// # Errors
    /// `step = 0`, `k` not a multiple of 32 or `p.n` not of `k`, with `col` `k` not a multiple
    /// of 64 or the rows not of 32, short buffers, buffers not 16-byte (f32, BF16) or 8-byte
    /// (codes) aligned; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_mxfp8(
        &self,
        p: crate::ops::optim::AdamWParam<'_, '_>,
        grad_scale: &CudaView<'_, f32>,
        step: u64,
        cfg: &mxrl_tensor::optim::AdamWConfig,
        k: usize,
        codes: &mut CudaViewMut<'_, u8>,
        scales: &mut CudaViewMut<'_, u8>,
        deq: Option<&mut CudaViewMut<'_, u16>>,
        col: Option<&mut CudaViewMut<'_, u16>>,
    ) -> Result<CudaSlice<u32>, DeviceError> {
        let g = &self.gpu;
        let op = "adamw_mxfp8";
        self.check_adamw(
            op,
            &p,
            grad_scale,
            step,
            k,
            if col.is_some() { 64 } else { 32 },
        )?;
        let n = p.n;
        if let Some(c) = &col {
            let rows = n / k;
            if !rows.is_multiple_of(32) {
                return Err(g.err(format!(
                    "{op}: the column-wise operand takes whole 32-row blocks ({rows} rows)"
                )));
            }
            check_len(g, &format!("{op} column-wise operand"), c.len(), n)?;
            check_align(
                g,
                &format!("{op} column-wise operand"),
                c.device_ptr(g.stream()).0,
                16,
            )?;
        }
        check_len(g, &format!("{op} codes"), codes.len(), n)?;
        check_len(g, &format!("{op} scales"), scales.len(), n / 32)?;
        let stream = g.stream();
        check_align(g, &format!("{op} codes"), codes.device_ptr(stream).0, 8)?;
        if let Some(d) = &deq {
            check_len(g, &format!("{op} dequantized"), d.len(), n)?;
            check_align(g, &format!("{op} dequantized"), d.device_ptr(stream).0, 16)?;
        }
        let mut bad = g.zeros::<u32>(1)?;
        if n == 0 {
            return Ok(bad);
        }
        let t = crate::ops::optim::AdamWTerms::new(cfg, step, p.weight_decay);
        let n8 = (n / 8) as u64;
        let write_deq = deq.is_some() as i32;
        let f = if col.is_some() {
            &self.adamw_mxfp8_rowcol
        } else {
            &self.adamw_mxfp8
        };
        let mut b = stream.launch_builder(f);
        let write_bf16 = p.push_buffers(&mut b, &self.no_u16);
        b.arg(&write_bf16).arg(grad_scale).arg(codes).arg(scales);
        match deq {
            Some(d) => b.arg(d),
            None => b.arg(&self.no_u16),
        };
        b.arg(&write_deq);
        let k64 = k as u64;
        let launch = match col {
            Some(c) => {
                b.arg(c).arg(&mut bad).arg(&k64);
                LaunchConfig {
                    grid_dim: (((n / k / 32) * (k / 64)) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                }
            }
            None => {
                b.arg(&mut bad).arg(&n8);
                threads_8(n8)
            }
        };
        t.args(&mut b);
        // SAFETY: adamw_mxfp8_row: thread t < n8 covers elements [8t, 8t + 8) < n;
        // adamw_mxfp8_rowcol: block (tr, tc) < (rows/32, k/64) covers rows [32tr, 32tr + 32)
        // < rows = n/k (a multiple of 32, checked) and columns [64tc, 64tc + 64) < k, thread
        // (r, c8) elements [(32tr + r)·k + 64tc + 8c8, +8) < n. Either reads and writes those
        // elements of param, m, v (16-byte aligned: float4 accesses), reads grad there, writes
        // codes there (8-byte aligned), scales at element/32 < n/32, the BF16 copy and deq
        // there only when given (n elements, 16-byte aligned; the 8-element stand-ins are
        // never written), col there (rowcol only: n elements, 16-byte aligned), and bad[0];
        // reads grad_scale[0] (all checked). The argument lists match the kernels' (pointers,
        // i32, pointers, i32, [u16*,] u32*, u64, eight f32).
        unsafe { crate::gpu::launch_op(&mut b, launch) }.map_err(|e| g.err(e))?;
        Ok(bad)
    }

    /// One AdamW step of a stack of weights of `group_len` elements each (`p.n` a multiple,
    /// `group_len % 8 == 0`), as [`crate::ops::optim::Optim::adamw_step`] (the same bits;
    /// also `p.m`, `p.v` and the BF16 copy when given), returning each weight's amax of its new
    /// values as f32 bits (NaN ignored: the bits of the NVFP4 per-tensor amax,
    /// `qlinear_amax_groups`'), found in the same pass (`adamw_amax_groups`).
    ///
    /// # Errors
    /// `step = 0`, `group_len` not a multiple of 8 or `p.n` not of it, short or misaligned
    /// buffers; launch errors.
    pub fn adamw_amax_groups(
        &self,
        p: crate::ops::optim::AdamWParam<'_, '_>,
        grad_scale: &CudaView<'_, f32>,
        step: u64,
        cfg: &mxrl_tensor::optim::AdamWConfig,
        group_len: usize,
    ) -> Result<CudaSlice<u32>, DeviceError> {
        let g = &self.gpu;
        self.check_adamw("adamw_amax_groups", &p, grad_scale, step, group_len, 8)?;
        let n = p.n;
        let mut bits = g.zeros::<u32>((n / group_len).max(1))?;
        if n == 0 {
            return Ok(bits);
        }
        let t = crate::ops::optim::AdamWTerms::new(cfg, step, p.weight_decay);
        let (n8, gl) = ((n / 8) as u64, group_len as u64);
        let mut b = g.stream().launch_builder(&self.adamw_amax);
        let write_bf16 = p.push_buffers(&mut b, &self.no_u16);
        b.arg(&write_bf16)
            .arg(grad_scale)
            .arg(&mut bits)
            .arg(&gl)
            .arg(&n8);
        t.args(&mut b);
        // SAFETY: thread t < n8 reads and writes elements [8t, 8t + 8) < n of param, m, v
        // (16-byte aligned), reads grad there, writes the BF16 copy there only when given (n
        // elements, 16-byte aligned; the stand-in no_u16 is never written), and raises bits[8t /
        // group_len] < n / group_len; reads grad_scale[0] (all checked). The argument list
        // matches the kernel's (pointers, i32, pointers, u64, u64, eight f32).
        unsafe { crate::gpu::launch_op(&mut b, threads_8(n8)) }.map_err(|e| g.err(e))?;
        Ok(bits)
    }

    /// One AdamW step of FP8-block-stored weights `[p.n / k, k]` (row count and `k` multiples
    /// of 128) and their 128×128-tile quantization in one pass (`adamw_fp8_block`): the master,
    /// moments and BF16 copy as [`crate::ops::optim::Optim::adamw_step`] (the same bits), then
    /// `codes` (E4M3, `p.n` bytes) and `scales` (the tiles' f32 `scale_inv` as little-endian
    /// bytes, row-major over `[rows/128, k/128]`) those of `Scheme::FP8_BLOCK_WEIGHT` for the
    /// new master (quant.cu's `fp8_block_weight_f32`), without reading the master again.
    ///
    /// # Errors
    /// `step = 0`, `k` or the row count not a multiple of 128, short or misaligned buffers;
    /// launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_fp8_block(
        &self,
        p: crate::ops::optim::AdamWParam<'_, '_>,
        grad_scale: &CudaView<'_, f32>,
        step: u64,
        cfg: &mxrl_tensor::optim::AdamWConfig,
        k: usize,
        codes: &mut CudaViewMut<'_, u8>,
        scales: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "adamw_fp8_block";
        self.check_adamw(op, &p, grad_scale, step, k, 128)?;
        let n = p.n;
        let rows = n / k;
        if !rows.is_multiple_of(128) {
            return Err(g.err(format!(
                "{op}: 128×128 tiles need whole 128-row blocks ({rows} rows)"
            )));
        }
        let tiles = (rows / 128) * (k / 128);
        check_len(g, &format!("{op} codes"), codes.len(), n)?;
        check_len(g, &format!("{op} scales"), scales.len(), 4 * tiles)?;
        let stream = g.stream();
        check_align(g, &format!("{op} codes"), codes.device_ptr(stream).0, 8)?;
        check_align(g, &format!("{op} scales"), scales.device_ptr(stream).0, 4)?;
        if n == 0 {
            return Ok(());
        }
        let grid = u32::try_from(tiles)
            .ok()
            .filter(|&t| t <= i32::MAX as u32)
            .ok_or_else(|| g.err(format!("{op}: {tiles} tiles exceed the grid")))?;
        let mxrl_formats::Scheme::Fp8Block(ws) = mxrl_formats::Scheme::FP8_BLOCK_WEIGHT else {
            return Err(g.err("FP8_BLOCK_WEIGHT is not an FP8-block scheme"));
        };
        let pow2 = i32::from(ws.scale_rule == mxrl_formats::ScaleRule::F32PowerOfTwo);
        let t = crate::ops::optim::AdamWTerms::new(cfg, step, p.weight_decay);
        let mut b = stream.launch_builder(&self.adamw_fp8_block);
        let write_bf16 = p.push_buffers(&mut b, &self.no_u16);
        let k64 = k as u64;
        b.arg(&write_bf16)
            .arg(grad_scale)
            .arg(codes)
            .arg(scales)
            .arg(&k64)
            .arg(&pow2);
        t.args(&mut b);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block (tr, tc) < (rows/128, k/128) covers rows [128tr, 128tr + 128) < rows =
        // n/k (a multiple of 128, checked) and columns [128tc, 128tc + 128) < k; thread x's
        // chunks j < 8 are elements [(128tr + c/16)·k + 128tc + 8(c%16), +8), c = x + 256j <
        // 2048, all < n. It reads and writes those elements of param, m, v (16-byte aligned:
        // float4 accesses), reads grad there, writes the BF16 copy there only when given (n
        // elements, 16-byte aligned; the stand-in is never written), codes there (8-byte
        // aligned uint2) and scales[blockIdx] < tiles (4-byte aligned floats), and reads
        // grad_scale[0] (all checked). The argument list matches the kernel's (pointers, i32,
        // pointers, u64, i32, eight f32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Every E4M3 code under every scale byte up to 134 through both MXFP8 decoders of the
    /// fragment kernels: `(general, fast)`, each `[135 · 256]` BF16 bit patterns indexed by
    /// `scale · 256 + code` (the operand bits the kernels multiply; equal where the fast
    /// decode is allowed, i.e. for every non-NaN code).
    ///
    /// # Errors
    /// Allocation, launch and copy errors.
    pub fn mxfp8_decode_table(&self) -> Result<(Vec<u16>, Vec<u16>), DeviceError> {
        let g = &self.gpu;
        let n = 135 * 256;
        let mut general = g.zeros::<u16>(n)?;
        let mut fast = g.zeros::<u16>(n)?;
        let cfg = LaunchConfig {
            grid_dim: (135, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(&self.mxfp8_decode_table);
        b.arg(&mut general).arg(&mut fast);
        // SAFETY: both outputs hold 135·256 u16; thread (s, c4) writes [s·256 + 4·c4, +4) with
        // s < 135, c4 < 64. Argument types match (u16*, u16*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok((g.download(&general)?, g.download(&fast)?))
    }

    /// [`QGemm::grouped_nt_frag_mxfp8`] with `rows` activation rows per pass and the
    /// reduction split over `split` warps per block (1, 2, 4 or 8).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_frag_mxfp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_mxfp8_with(
        &self,
        rows: FragRows,
        layout: FragLayout,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let decode = Mxfp8Decode::General;
        self.grouped_nt_frag_mxfp8_decode_with(
            decode, rows, layout, x, codes, scales, offsets, y, s,
        )
    }

    /// [`QGemm::grouped_nt_frag_mxfp8_with`] with the weights decoded by `decode` (as
    /// [`QGemm::grouped_nt_frag_mxfp8_decode`]).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_frag_mxfp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_mxfp8_decode_with(
        &self,
        decode: Mxfp8Decode,
        rows: FragRows,
        layout: FragLayout,
        x: &CudaView<'_, u16>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_frag_mxfp8";
        self.check_grouped(op, LowByte::Mxfp8, s, x, codes, scales, offsets, y)?;
        let cfg = self.frag_grid(op, s, Some(LowByte::Mxfp8), rows, layout)?;
        self.check_staged_scales(op, layout, scales)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let g = &self.gpu;
        let func = match decode {
            Mxfp8Decode::General => {
                Self::frag_kernel(layout, rows, &self.frag_mxfp8, &self.staged_mxfp8)
            }
            Mxfp8Decode::Fast => {
                Self::frag_kernel(layout, rows, &self.frag_mxfp8f, &self.staged_mxfp8f)
            }
        };
        let mut b = g.stream().launch_builder(func);
        b.arg(x).arg(codes).arg(scales).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, codes E·N·K, scales E·N·K/32, offsets E+1 and y R·N elements
        // (checked); n % 32 == 0 and k % 32 == 0 (checked), x and codes 16-byte aligned
        // (checked), weight rows K bytes and activation rows K elements (64-byte multiples):
        // block (bx, e) reads weight rows bx·32 .. +32 ≤ N of expert e < E, each 16-byte chunk c
        // only when 16c < K and its scale byte c/2 < K/32, activation rows in [lo, hi) ⊆ [0, R]
        // (offsets clamped) at 16-element chunks starting below K, and writes y at those rows,
        // columns < N; with frag_row_blocks > 1 block (bx, e, z) takes the passes z, z + Z, …
        // of those rows. The block's threads run the same pass loop (bounds from offsets and
        // blockIdx.z, equal for all), so both barriers per pass are reached by all (none with
        // split 1); the
        // dynamic shared array holds split × 8·TG × 32 floats (frag_grid). Staged layout: block
        // bx covers weight rows bx·128 .. min(+128, N) (warps past N copy zeros, read nothing),
        // its scale rows (a contiguous 16-byte aligned range, checked) and the 16-byte
        // chunks above, by cp.async into the dynamic shared memory that frag_grid sizes with
        // staged_smem_bytes; every thread reaches every barrier of the step loop. Argument
        // types match (const u16*, const u8*, const u8*, const u32*, float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// [`QGemm::grouped_nt_small_m_nvfp4`] on tensor cores with the stored weights decoded
    /// straight into mma fragments, as [`QGemm::grouped_nt_frag_mxfp8`]: operands the exact
    /// `pre` values in binary16 (weights `e2m1 · e4m3(scale)` decoded from the stored bytes,
    /// `x_pre` the binary16 operand of [`QGemm::quant_act_nvfp4_f16`], not the BF16 one of
    /// the other NVFP4 kernels), f32 accumulation, `y = fl(sum · α)` per row with
    /// α = `nvfp4_alpha(x_amax[r], w_amax[e])`.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_small_m_nvfp4`]; also `n` not a multiple of [`FRAG_COLS`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_nvfp4(
        &self,
        x_pre: &CudaView<'_, u16>,
        x_amax: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let f = Some(LowByte::Nvfp4);
        let rows = frag_rows(s, f);
        let layout = frag_layout(s, f, rows);
        self.grouped_nt_frag_nvfp4_with(
            rows, layout, x_pre, x_amax, codes, scales, w_amax, offsets, y, s,
        )
    }

    /// [`QGemm::grouped_nt_frag_nvfp4`] with `rows` activation rows per pass and the
    /// reduction split over `split` warps per block (1, 2, 4 or 8).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_frag_nvfp4`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_nvfp4_with(
        &self,
        rows: FragRows,
        layout: FragLayout,
        x_pre: &CudaView<'_, u16>,
        x_amax: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_frag_nvfp4";
        let g = &self.gpu;
        self.check_grouped(op, LowByte::Nvfp4, s, x_pre, codes, scales, offsets, y)?;
        let cfg = self.frag_grid(op, s, Some(LowByte::Nvfp4), rows, layout)?;
        self.check_staged_scales(op, layout, scales)?;
        check_len(g, &format!("{op} x_amax"), x_amax.len(), s.rows)?;
        check_len(g, &format!("{op} w_amax"), w_amax.len(), s.experts)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let func = Self::frag_kernel(layout, rows, &self.frag_nvfp4, &self.staged_nvfp4);
        let mut b = g.stream().launch_builder(func);
        b.arg(x_pre).arg(x_amax).arg(codes).arg(scales).arg(w_amax);
        b.arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: as grouped_nt_frag_mxfp8, with codes E·N·K/2 and scales E·N·K/16 bytes
        // (checked; weight rows K/2 bytes, 16-byte chunks c with 16c < K/2, the u16 scale pair
        // 2c < K/16 of each row, 2-byte aligned: scales checked 2-byte aligned and K/16 even;
        // activation chunks of 32 elements starting below K), x_amax read at rows < R (R
        // entries), w_amax at e < E (E entries); the staged layout as there. Argument types
        // match (const u16*, const float*, const u8*, const u8*, const float*, const u32*,
        // float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// BF16 routed experts (`w [E, N, K]` BF16 bit patterns) by the fragment kernels: the
    /// [`QGemm::grouped_nt_frag_mxfp8`] scheme with the stored values as the A fragments
    /// (16-byte loads straight into registers, no shared memory), `x [R, K]` BF16 as B. Every
    /// product exact in f32; tensor-core f32 sums (bound `tensor_core_sum_bound`);
    /// deterministic. For 1–32 rows per expert (decode batches), where it streams the weights
    /// closer to the copy bandwidth than the tiled kernels.
    ///
    /// # Errors
    /// `n` not a multiple of [`FRAG_COLS`], `k` not a multiple of 32, short or misaligned
    /// buffers (x and w 16-byte aligned), sizes past u32, launch errors.
    pub fn grouped_nt_frag_bf16(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let rows = frag_rows(s, None);
        let layout = frag_layout(s, None, rows);
        self.grouped_nt_frag_bf16_with(rows, layout, x, w, offsets, y, s)
    }

    /// [`QGemm::grouped_nt_frag_bf16`] with `rows` activation rows per pass and `split` warps
    /// per block.
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_frag_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_frag_bf16_with(
        &self,
        rows: FragRows,
        layout: FragLayout,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_frag_bf16";
        let g = &self.gpu;
        check_multiple(g, op, s.k, 32, "64-byte super-steps of BF16 weight rows")?;
        let cfg = self.frag_grid(op, s, None, rows, layout)?;
        self.check_dims(op, s)?;
        let enk = mul(g, op, mul(g, op, s.experts, s.n)?, s.k)?;
        self.check_rows_io(op, s, x, offsets, y)?;
        check_len(g, &format!("{op} w"), w.len(), enk)?;
        check_align(g, &format!("{op} w"), w.device_ptr(g.stream()).0, 16)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let func = Self::frag_kernel(layout, rows, &self.frag_bf16, &self.staged_bf16);
        let mut b = g.stream().launch_builder(func);
        // The kernel's `scales` is never read for BF16 weights (QfBf16::load_scale).
        b.arg(x).arg(w).arg(w).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, w E·N·K, offsets E+1 and y R·N elements (checked); n % 32 == 0
        // and k % 32 == 0 (checked), x and w 16-byte aligned (checked): block (bx, e) reads
        // the 2K-byte weight rows bx·32 .. +32 ≤ N of expert e < E in 16-byte chunks below 2K,
        // activation rows in [lo, hi) ⊆ [0, R] (offsets clamped) at 8-element chunks starting
        // below K, and writes y at those rows, columns < N; barriers and shared memory as
        // grouped_nt_frag_mxfp8. Argument types match (const u16*, const u8*, const u8*,
        // const u32*, float*, u32 × 4): device pointers of u16 buffers passed as bytes.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Dense BF16 linears on one input, up to three per launch (a layer's q, k and v
    /// projections, or one linear): `y_i = x · W_iᵀ` for each `(W_i [n_i, k], n_i, y_i [rows,
    /// n_i])` of `outs`, on the fragment kernels ([`QGemm::grouped_nt_frag_bf16`]'s split
    /// layout) with each weight as a one-expert group (`whole_rows` = `[0, u32::MAX]`), the
    /// column blocks of all weights side by side in one grid. [`dense_frag_plan`] picks the
    /// rows per pass, the split and the row blocks from the shape alone; each output's blocks
    /// are those of a one-weight launch, so the bits do not depend on which weights share it.
    /// For decode batches of 3–128 rows, where cuBLAS runs each weight as a GEMM of a few
    /// dozen blocks.
    ///
    /// # Errors
    /// No output or more than three; `n_i` not a multiple of [`FRAG_COLS`]; as
    /// [`QGemm::grouped_nt_frag_bf16`] per weight.
    #[allow(clippy::type_complexity)]
    pub fn dense_nt_frag_bf16_multi(
        &self,
        x: &CudaView<'_, u16>,
        whole_rows: &CudaView<'_, u32>,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
        rows: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let (fr, split) = dense_frag_plan(rows, k);
        self.dense_nt_frag_bf16_multi_with(fr, split, x, whole_rows, outs, rows, k)
    }

    /// [`QGemm::dense_nt_frag_bf16_multi`] with `fr` rows per pass and `split` warps per block
    /// (1, 2, 4, 8 or 16).
    ///
    /// # Errors
    /// As [`QGemm::dense_nt_frag_bf16_multi`]; `split` not 1, 2, 4, 8 or 16.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub fn dense_nt_frag_bf16_multi_with(
        &self,
        fr: FragRows,
        split: usize,
        x: &CudaView<'_, u16>,
        whole_rows: &CudaView<'_, u32>,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
        rows: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let op = "dense_nt_frag_bf16_multi";
        let g = &self.gpu;
        if outs.is_empty() || outs.len() > 3 {
            return Err(g.err(format!("{op}: {} weights (one to three)", outs.len())));
        }
        check_multiple(g, op, k, 32, "64-byte super-steps of BF16 weight rows")?;
        let total: usize = outs.iter().map(|o| o.1).sum();
        if !matches!(split, 1 | 2 | 4 | 8 | 16) {
            return Err(g.err(format!("{op}: split {split} is not 1, 2, 4, 8 or 16 warps")));
        }
        for (w, n, y) in outs.iter_mut() {
            let s = Grouped {
                experts: 1,
                rows,
                n: *n,
                k,
            };
            if !Self::frag_fits(s.n, s.k) {
                return Err(g.err(format!(
                    "{op}: n = {} must be a multiple of {FRAG_COLS} (columns per block)",
                    s.n
                )));
            }
            self.check_dims(op, s)?;
            self.check_rows_io(op, s, x, whole_rows, y)?;
            check_len(g, &format!("{op} w"), w.len(), mul(g, op, s.n, s.k)?)?;
            check_align(g, &format!("{op} w"), w.device_ptr(g.stream()).0, 16)?;
        }
        if rows == 0 || total == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                grid_x(g, op, total / FRAG_COLS)?,
                1,
                dense_frag_row_blocks(rows, fr) as u32,
            ),
            block_dim: (32 * split as u32, 1, 1),
            shared_mem_bytes: frag_smem_bytes(fr, split) as u32,
        };
        let (r, k32) = (rows as u32, k as u32);
        let null = 0u64;
        let zero = 0u32;
        let ns: Vec<u32> = outs.iter().map(|o| o.1 as u32).collect();
        let missing = 3 - outs.len();
        let mut b = g.stream().launch_builder(&self.frag_bf16x3[fr.index()]);
        b.arg(x);
        for (i, (w, _, y)) in outs.iter_mut().enumerate() {
            b.arg(*w).arg(&mut **y).arg(&ns[i]);
        }
        for _ in 0..missing {
            // A missing weight: N = 0, no blocks, its pointers never read.
            b.arg(&null).arg(&null).arg(&zero);
        }
        b.arg(whole_rows).arg(&r).arg(&k32);
        // SAFETY: each weight was checked as a one-expert grouped_nt_frag_bf16 call (w n·k, y
        // rows·n, x rows·k elements, whole_rows 2, n % 32 == 0, k % 32 == 0, x and w 16-byte
        // aligned, sizes within u32); block column bx runs weight i's column block
        // bx − Σ_{j<i} n_j/32 < n_i/32 with that weight's pointers and N (grid x = Σ n_i/32),
        // so it touches exactly what that single call's block would; missing weights have
        // N = 0 and no blocks. Shared memory for `split` warps' partial sums (≤ the amount
        // allowed at load: R64 at DENSE_FRAG_MAX_SPLIT); blocks of 32·split ≤ 512 threads,
        // the kernels' launch bound. Argument types match (const u16*, then three × (const
        // u16*, float*, u32), const u32*, u32, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// FP8-block activation quantization (1×128 along K, [`mxrl_formats::Scheme::FP8_BLOCK_ACT`]
    /// or any 1×128 scheme with `pow2` its power-of-two scale rule) as the staged kernels'
    /// operand: `x [rows, k]` f32 → `out [rows, k]` the binary16 values of the E4M3 codes
    /// (exact) and `scales [rows, k/128]` the blocks' f32 `scale_inv`. Codes and scales are
    /// those of `mxrl_formats::quantize(x, [rows, k], scheme)` (quant.cu's `fp8_block_act`).
    ///
    /// # Errors
    /// `k` not a multiple of 128, short or misaligned buffers (x 16-byte, out 8-byte aligned),
    /// launch errors.
    pub fn quant_act_fp8_block(
        &self,
        x: &CudaView<'_, f32>,
        rows: usize,
        k: usize,
        pow2: bool,
        out: &mut CudaViewMut<'_, u16>,
        scales: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "quant_act_fp8_block";
        check_multiple(g, op, k, 128, "FP8 blocks of 128")?;
        let len = mul(g, op, rows, k)?;
        check_len(g, &format!("{op} x"), x.len(), len)?;
        check_len(g, &format!("{op} out"), out.len(), len)?;
        check_len(g, &format!("{op} scales"), scales.len(), len / 128)?;
        if len == 0 {
            return Ok(());
        }
        let stream = g.stream();
        check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)?;
        check_align(g, &format!("{op} out"), out.device_ptr_mut(stream).0, 8)?;
        let n_blocks = (len / 128) as u64;
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, (len / 128).div_ceil(8))?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let pow2 = i32::from(pow2);
        let mut b = g.stream().launch_builder(&self.act_fp8b);
        b.arg(x).arg(out).arg(scales).arg(&n_blocks).arg(&pow2);
        // SAFETY: x and out hold rows·k elements, scales rows·k/128 (checked); warp w of the
        // grid (8 per block of 256) handles block w < n_blocks only — elements 128w + 4l ..
        // +4 of lane l (16-byte loads of x, 8-byte stores of out: bases checked, offsets
        // multiples of 4 elements) and scales[w] — and a warp past the last block returns
        // whole (every shuffle complete). Argument types match (const float*, u16*, float*,
        // u64, int).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// FP8-block routed experts on the staged fragment kernels: `y [R, N] = x · W_eᵀ` per
    /// expert (rows of expert `e`: `offsets[e] .. offsets[e+1]`, clamped to `[0, R]`) with
    /// the arithmetic of `mxrl_tensor::qlinear::FP8_BLOCK_EMULATION`: for each 128-wide K block
    /// `b` in increasing order a fresh f32 sum `P_b` of the exact E4M3 × E4M3 products
    /// (binary16 operands on the tensor cores), then `y = fl(y + fl(fl(sx·sw) · P_b))`.
    /// `x` from [`QGemm::quant_act_fp8_block`] (binary16 code values `[R, K]`, `x_scales`
    /// `[R, K/128]`), `codes [E, N, K]` E4M3 and `w_scales` the f32 `scale_inv [E, N/128,
    /// K/128]` as bytes. Blocks of [`STAGED_WARPS`] warps cover 128 columns (one weight scale
    /// tile) of one expert, passes of [`frag_rows`] rows, a busy expert's passes spread over
    /// [`frag_row_blocks`] blocks. Every `P_b` is the same 8 `mma` steps in the same order as
    /// `Fp8Block::gemm_nt_frag` with `Fp8FragMma::F16`, and every promotion the same
    /// operations, so the two give the same bits; the CPU reference differs in the order of
    /// each block's sum only (bound `fp8_block_sum_bound`). Deterministic.
    ///
    /// # Errors
    /// `n` or `k` not a multiple of 128, short or misaligned buffers, sizes past u32, the
    /// stages past [`STAGED_SMEM_MAX`], launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_staged_fp8_block(
        &self,
        x: &CudaView<'_, u16>,
        x_scales: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let rows = frag_rows(s, None);
        self.grouped_nt_staged_fp8_block_with(
            rows,
            FP8_ROUTED_STAGES_PICK,
            x,
            x_scales,
            codes,
            w_scales,
            offsets,
            y,
            s,
        )
    }

    /// [`QGemm::grouped_nt_staged_fp8_block`] with `rows` activation rows per pass and
    /// `stages` shared-memory stages (one of [`FP8_STAGES`]; the same bits for every choice).
    ///
    /// # Errors
    /// As [`QGemm::grouped_nt_staged_fp8_block`]; a stage count not compiled.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_staged_fp8_block_with(
        &self,
        rows: FragRows,
        stages: usize,
        x: &CudaView<'_, u16>,
        x_scales: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let op = "grouped_nt_staged_fp8_block";
        let g = &self.gpu;
        let si = self.fp8_stage_index(op, stages)?;
        let smem = self.check_staged_fp8(
            op, rows, stages, x, x_scales, codes, w_scales, offsets, y, s,
        )?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let stream = g.stream();
        let cfg = LaunchConfig {
            grid_dim: (
                grid_x(g, op, s.n / 128)?,
                s.experts as u32,
                fp8_row_blocks(s, rows) as u32,
            ),
            block_dim: (32 * STAGED_WARPS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = stream.launch_builder(&self.staged_fp8b[si][rows.index()]);
        b.arg(x)
            .arg(x_scales)
            .arg(codes)
            .arg(w_scales)
            .arg(offsets)
            .arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, x_scales R·K/128, codes E·N·K, w_scales 4·E·(N/128)·(K/128)
        // bytes, offsets E+1 and y R·N elements (checked); n and k multiples of 128 (checked),
        // x and codes 16-byte aligned, the scales 4-byte aligned (checked). Block (bx, e, z)
        // covers weight rows bx·128 .. +128 ≤ N of expert e < E and their scale row (kbs
        // floats at (e·N/128 + bx)·kbs), copies 16-byte chunks of weight rows below K,
        // activation rows in [lo, hi) ⊆ [0, R] (offsets clamped) at 8-element chunks below K
        // and their scale_inv rows (4-byte copies, zeros past hi) into the dynamic shared
        // memory sized by fp8_staged_smem_bytes (checked ≤ STAGED_SMEM_MAX, allowed at load),
        // and writes y at those rows, columns < N. Every thread runs the same pass and step
        // loops (bounds from offsets, blockIdx.z and K), so every barrier is reached by all.
        // Argument types match (const u16*, const float*, const u8*, const float*, const u32*,
        // float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// The index of `stages` in [`FP8_STAGES`] (the staged FP8-block kernels compiled).
    fn fp8_stage_index(&self, op: &str, stages: usize) -> Result<usize, DeviceError> {
        FP8_STAGES
            .iter()
            .position(|&st| st == stages)
            .ok_or_else(|| {
                self.gpu
                    .err(format!("{op}: {stages} stages (compiled: {FP8_STAGES:?})"))
            })
    }

    /// The staged FP8-block kernels' checks (see [`QGemm::grouped_nt_staged_fp8_block`]);
    /// returns the dynamic shared memory of a block.
    #[allow(clippy::too_many_arguments)]
    fn check_staged_fp8(
        &self,
        op: &str,
        rows: FragRows,
        stages: usize,
        x: &CudaView<'_, u16>,
        x_scales: &CudaView<'_, f32>,
        codes: &CudaView<'_, u8>,
        w_scales: &CudaView<'_, u8>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<usize, DeviceError> {
        let g = &self.gpu;
        if !s.n.is_multiple_of(128) || !s.k.is_multiple_of(128) {
            return Err(g.err(format!(
                "{op}: n = {} and k = {} must be multiples of 128 (FP8-block tiles)",
                s.n, s.k
            )));
        }
        self.check_dims(op, s)?;
        self.check_rows_io(op, s, x, offsets, y)?;
        let kb = s.k / 128;
        let en = mul(g, op, s.experts, s.n)?;
        check_len(g, &format!("{op} x scales"), x_scales.len(), s.rows * kb)?;
        check_len(g, &format!("{op} codes"), codes.len(), mul(g, op, en, s.k)?)?;
        check_len(
            g,
            &format!("{op} w scales"),
            w_scales.len(),
            4 * (en / 128) * kb,
        )?;
        let smem = fp8_staged_smem_bytes(s.k, rows, stages);
        if smem > STAGED_SMEM_MAX {
            return Err(g.err(format!(
                "{op}: the staged layout needs {smem} B of shared memory at k = {} (at most \
                 {STAGED_SMEM_MAX})",
                s.k
            )));
        }
        let stream = g.stream();
        check_align(g, &format!("{op} codes"), codes.device_ptr(stream).0, 16)?;
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
        Ok(smem)
    }

    /// Up to three dense FP8-block weights on one input in one launch (q, k and v of a layer):
    /// for each `(codes [n, k], w_scales, y [rows, n], n)` of `outs`, `y = x · Wᵀ` exactly as
    /// [`QGemm::grouped_nt_staged_fp8_block`] with one expert over every row (`whole_rows`:
    /// offsets `[0, ≥ rows]`) — the same blocks, so the same bits — with the weights' column
    /// blocks side by side in one grid, so a small weight (k and v: 4 blocks of 128 columns)
    /// runs beside the others instead of after them.
    ///
    /// # Errors
    /// No output or more than three; as [`QGemm::grouped_nt_staged_fp8_block`] per weight.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn dense_nt_staged_fp8_block_multi(
        &self,
        x: &CudaView<'_, u16>,
        x_scales: &CudaView<'_, f32>,
        whole_rows: &CudaView<'_, u32>,
        outs: &mut [Fp8DenseOut<'_, '_>],
        rows: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.dense_nt_staged_fp8_block_multi_with(
            FP8_DENSE_STAGES_PICK,
            x,
            x_scales,
            whole_rows,
            outs,
            rows,
            k,
        )
    }

    /// [`QGemm::dense_nt_staged_fp8_block_multi`] with `stages` shared-memory stages (one of
    /// [`FP8_STAGES`]; the same bits for every count).
    ///
    /// # Errors
    /// As [`QGemm::dense_nt_staged_fp8_block_multi`]; a stage count not compiled.
    #[allow(clippy::too_many_arguments)]
    pub fn dense_nt_staged_fp8_block_multi_with(
        &self,
        stages: usize,
        x: &CudaView<'_, u16>,
        x_scales: &CudaView<'_, f32>,
        whole_rows: &CudaView<'_, u32>,
        outs: &mut [Fp8DenseOut<'_, '_>],
        rows: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let si = self.fp8_stage_index("dense_nt_staged_fp8_block_multi", stages)?;
        let op = "dense_nt_staged_fp8_block_multi";
        if outs.is_empty() || outs.len() > 3 {
            return Err(g.err(format!("{op}: {} weights (one to three)", outs.len())));
        }
        let shape = |n: usize| Grouped {
            experts: 1,
            rows,
            n,
            k,
        };
        let fr = frag_rows(shape(128), None);
        let mut smem = 0;
        for (codes, w_scales, y, n) in outs.iter_mut() {
            smem = self.check_staged_fp8(
                op,
                fr,
                stages,
                x,
                x_scales,
                codes,
                w_scales,
                whole_rows,
                y,
                shape(*n),
            )?;
        }
        let blocks: usize = outs.iter().map(|o| o.3 / 128).sum();
        if rows == 0 || blocks == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                grid_x(g, op, blocks)?,
                1,
                fp8_row_blocks(shape(128), fr) as u32,
            ),
            block_dim: (32 * STAGED_WARPS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (r, k32) = (rows as u32, k as u32);
        let null = 0u64;
        let zero = 0u32;
        let mut b = g
            .stream()
            .launch_builder(&self.staged_fp8b3[si][fr.index()]);
        b.arg(x).arg(x_scales);
        let ns: Vec<u32> = outs.iter().map(|o| o.3 as u32).collect();
        let missing = 3 - outs.len();
        for (i, (codes, w_scales, y, _)) in outs.iter_mut().enumerate() {
            b.arg(&*codes).arg(&*w_scales).arg(y).arg(&ns[i]);
        }
        for _ in 0..missing {
            // A missing weight: N = 0, no blocks, its pointers never read.
            b.arg(&null).arg(&null).arg(&null).arg(&zero);
        }
        b.arg(whole_rows).arg(&r).arg(&k32);
        // SAFETY: each weight was checked as a one-expert grouped_nt_staged_fp8_block call
        // (codes n·k, scales 4·(n/128)·(k/128) bytes, y rows·n, x rows·k and x_scales
        // rows·k/128 elements, whole_rows 2, n and k multiples of 128, alignment); block column
        // bx runs weight i's column block bx − Σ_{j<i} n_j/128 < n_i/128 with that weight's
        // pointers and N (grid x = Σ n_i/128), so it touches exactly what that single call's
        // block would; missing weights have N = 0 and no blocks. Shared memory as checked (≤
        // STAGED_SMEM_MAX, allowed at load). Argument types match (const u16*, const float*,
        // then three × (const u8*, const float*, float*, u32), const u32*, u32, u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Checks a weight dequantization: `k` a multiple of `block`, u32-free sizes, lengths.
    #[allow(clippy::too_many_arguments)]
    fn check_dequant(
        &self,
        op: &str,
        f: LowByte,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        out: &mut CudaViewMut<'_, u16>,
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<usize, DeviceError> {
        let g = &self.gpu;
        let (block, codes_per_elem) = match f {
            LowByte::Mxfp8 => (32, 2),
            LowByte::Nvfp4 => (16, 1),
        };
        check_multiple(g, op, k, block, "whole scale blocks")?;
        let len = mul(g, op, mul(g, op, experts, n)?, k)?;
        check_len(
            g,
            &format!("{op} codes"),
            codes.len(),
            len * codes_per_elem / 2,
        )?;
        check_len(g, &format!("{op} scales"), scales.len(), len / block)?;
        check_len(g, &format!("{op} out"), out.len(), len)?;
        if len > 0 {
            let stream = g.stream();
            let code_align = match f {
                LowByte::Mxfp8 => 8,
                LowByte::Nvfp4 => 4,
            };
            check_align(
                g,
                &format!("{op} codes"),
                codes.device_ptr(stream).0,
                code_align,
            )?;
            check_align(g, &format!("{op} out"), out.device_ptr_mut(stream).0, 16)?;
        }
        Ok(len)
    }

    /// Plain dequantization of stored MXFP8 weights (`codes [E, N, K]`, `scales [E, N, K/32]`)
    /// to BF16 bit patterns `out [E, N, K]`: the contract's `fl(ue8m0_decode(s) ·
    /// e4m3_value(q))` (reference [`mxrl_formats::QuantizedTensor::dequantize`]), exact in BF16
    /// for scale bytes ≥ 3 and rounded to nearest even below — the operand of the large-M
    /// grouped GEMMs ([`super::gemm::Gemm::grouped_nt`]).
    ///
    /// # Errors
    /// `k` not a multiple of 32, short buffers, codes not 8-byte / out not 16-byte aligned,
    /// launch errors.
    pub fn dequant_weights_mxfp8(
        &self,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        out: &mut CudaViewMut<'_, u16>,
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let op = "dequant_weights_mxfp8";
        let len = self.check_dequant(op, LowByte::Mxfp8, codes, scales, out, experts, n, k)?;
        self.launch_dequant(op, &self.deq_mxfp8, codes, scales, out, len)
    }

    /// Dequantization of stored NVFP4 weights (`codes [E, N, K/2]`, `scales [E, N, K/16]`) to
    /// their GEMM operand in BF16, `out [E, N, K]` = `e2m1_value(code) · e4m3_value(scale)`
    /// (exact; the `pre` values of `mxrl_tensor::qlinear`). The per-tensor amax is **not**
    /// applied: a GEMM on these values takes α afterwards ([`QGemm::nvfp4_scale_rows`]), as
    /// the CPU emulation does.
    ///
    /// # Errors
    /// `k` not a multiple of 16, short buffers, codes not 4-byte / out not 16-byte aligned,
    /// launch errors.
    pub fn dequant_weights_nvfp4(
        &self,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        out: &mut CudaViewMut<'_, u16>,
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let op = "dequant_weights_nvfp4";
        let len = self.check_dequant(op, LowByte::Nvfp4, codes, scales, out, experts, n, k)?;
        self.launch_dequant(op, &self.deq_nvfp4, codes, scales, out, len)
    }

    fn launch_dequant(
        &self,
        op: &str,
        f: &CudaFunction,
        codes: &CudaView<'_, u8>,
        scales: &CudaView<'_, u8>,
        out: &mut CudaViewMut<'_, u16>,
        len: usize,
    ) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let n8 = (len / 8) as u64;
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, (len / 8).div_ceil(THREADS as usize))?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = g.stream().launch_builder(f);
        b.arg(codes).arg(scales).arg(out).arg(&n8);
        // SAFETY: the caller (check_dequant) checked codes, scales and out against len = E·N·K
        // elements with k a multiple of the scale block (so len % 8 == 0 and a thread's eight
        // elements share one scale), codes 8-byte (MXFP8) / 4-byte (NVFP4) and out 16-byte
        // aligned; thread t < len/8 reads codes of elements 8t .. 8t+8 and scale byte
        // 8t / block, writes out[8t .. 8t+8]; other threads return. Argument types match
        // (const u8*, const u8*, u16*, u64).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// NVFP4's output factor on the large-M path: `y[r, :] = fl(y[r, :] · α(r, e))` for the
    /// expert `e` owning row `r` (`offsets` as the grouped GEMMs, clamped to `[0, R]`),
    /// `α = fl(fl(x_amax[r] · w_amax[e]) · NVFP4_ALPHA_FACTOR_INV)`; rows of no expert are
    /// untouched. Applied to a grouped GEMM of [`QGemm::quant_act_nvfp4`]'s `pre` operand and
    /// [`QGemm::dequant_weights_nvfp4`]'s weights it is the CPU emulation's forward.
    ///
    /// # Errors
    /// Short buffers, sizes beyond u32 or the grid; launch errors.
    pub fn nvfp4_scale_rows(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        x_amax: &CudaView<'_, f32>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        self.scale_rows("nvfp4_scale_rows", y, Some(x_amax), w_amax, offsets, s)
    }

    /// The weights' per-tensor factor of NVFP4's dequantization, after a sum over their
    /// `e2m1 × e4m3` values ([`QGemm::dequant_weights_nvfp4`]): `y[r, :] = fl(y[r, :] · g(e))`,
    /// `g(e) = fl(w_amax[e] · R2688)`, for the expert `e` owning row `r` (`offsets` as the
    /// grouped GEMMs, clamped to `[0, R]`); rows of no expert are untouched. The `dequantized`
    /// backward's dgrad `bf16(dy) · Ŵ` of NVFP4 experts is this after a grouped GEMM on those
    /// exact BF16 operands, one GEMM instead of three on the split f32 values.
    ///
    /// # Errors
    /// Short buffers, sizes beyond u32 or the grid; launch errors.
    pub fn nvfp4_weight_factor_rows(
        &self,
        y: &mut CudaViewMut<'_, f32>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        self.scale_rows("nvfp4_weight_factor_rows", y, None, w_amax, offsets, s)
    }

    /// The launch of `nvfp4_scale_rows`: α per row from `x_amax` and the expert's `w_amax`,
    /// or (`x_amax` `None`) the expert's weight factor alone.
    fn scale_rows(
        &self,
        op: &str,
        y: &mut CudaViewMut<'_, f32>,
        x_amax: Option<&CudaView<'_, f32>>,
        w_amax: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_u32(
            g,
            op,
            &[("experts", s.experts), ("rows", s.rows), ("n", s.n)],
        )?;
        check_len(g, &format!("{op} y"), y.len(), mul(g, op, s.rows, s.n)?)?;
        if let Some(xa) = x_amax {
            check_len(g, &format!("{op} x_amax"), xa.len(), s.rows)?;
        }
        check_len(g, &format!("{op} w_amax"), w_amax.len(), s.experts)?;
        check_len(g, &format!("{op} offsets"), offsets.len(), s.experts + 1)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_x(g, op, s.rows)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (e, r, n) = (s.experts as u32, s.rows as u32, s.n as u32);
        let per_row = u32::from(x_amax.is_some());
        let mut b = g.stream().launch_builder(&self.scale_rows);
        // Without x_amax the kernel does not read that pointer: w_amax stands in.
        b.arg(y)
            .arg(x_amax.unwrap_or(w_amax))
            .arg(w_amax)
            .arg(offsets);
        b.arg(&e).arg(&r).arg(&n).arg(&per_row);
        // SAFETY: y holds R·N, w_amax E, offsets E+1 and (per_row = 1) x_amax R elements
        // (checked); block r < R scans offsets[e], offsets[e+1] for e < E, reads w_amax[owner
        // < E], x_amax[r] only when per_row = 1, and rewrites y[r·N .. r·N + N] (16-byte
        // accesses only where that row starts 16-byte aligned and N % 4 == 0). Argument types
        // match (float*, const float*, const float*, const u32*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use mxrl_formats::e4m3_decode;

    /// `prmt.b32 d, q, 0, sel` in its default mode: byte `i` of `d` is byte `sel[i] & 7` of
    /// `{0 (bytes 4-7), q (bytes 0-3)}`, or with bit 3 of the selector nibble set, that byte's
    /// top bit copied into all eight bits.
    fn prmt(q: u32, sel: u32) -> u32 {
        let bytes = (q as u64).to_le_bytes();
        (0..4)
            .map(|i| {
                let nib = (sel >> (4 * i)) & 0xF;
                let b = bytes[(nib & 7) as usize];
                let b = if nib & 8 != 0 {
                    if b & 0x80 != 0 {
                        0xFF
                    } else {
                        0
                    }
                } else {
                    b
                };
                u32::from(b) << (8 * i)
            })
            .sum()
    }

    /// The kernels' fast MXFP8 decode of one code (`mxfp8_fast_pair` with its `fma.rn.bf16x2`
    /// by the factor and −0: one rounding of the exact product, here through f64, where the
    /// product of a BF16 value and a power of two is exact).
    fn fast_decode(code: u8, scale: u8) -> u16 {
        let t = (prmt(u32::from(code), 0x9180) << 4) & 0x87F0_87F0;
        let factor = ((u32::from(scale) + 120) << 7) as u16;
        let product = bf16::from_bits(t as u16).to_f64() * bf16::from_bits(factor).to_f64();
        bf16::from_f64(product).to_bits()
    }

    #[test]
    fn fast_mxfp8_decode_rounds_the_contract_value_for_every_code_and_scale() {
        for scale in 0..=MXFP8_FAST_MAX_SCALE {
            let sc = if scale == 0 {
                f32::from_bits(0x0040_0000)
            } else {
                f32::from_bits(u32::from(scale) << 23)
            };
            for code in 0..=255u8 {
                if code & 0x7F == 0x7F {
                    continue; // NaN codes: not eligible
                }
                // The contract's dequantized value (exact in f32), rounded to BF16.
                let want = bf16::from_f32(e4m3_decode(code) * sc).to_bits();
                assert_eq!(
                    fast_decode(code, scale),
                    want,
                    "code {code:#04x} scale {scale}"
                );
            }
        }
        // The pair layout: code 1's bits in the high half, from byte 1 and its sign copies.
        let q = 0x0000_B838u32; // codes 0x38 (1.0) and 0xB8 (−1.0)
        let t = (prmt(q, 0x9180) << 4) & 0x87F0_87F0;
        assert_eq!(
            (
                bf16::from_bits(t as u16).to_f32(),
                bf16::from_bits((t >> 16) as u16).to_f32()
            ),
            (2f32.powi(-120), -(2f32.powi(-120)))
        );
    }

    #[test]
    fn fast_mxfp8_eligibility_refuses_nan_codes_and_large_scales() {
        assert!(mxfp8_fast_eligible(&[0, 0x7E, 0xFE, 0x80], &[0, 134]));
        assert!(!mxfp8_fast_eligible(&[0x7F], &[]));
        assert!(!mxfp8_fast_eligible(&[0xFF], &[]));
        assert!(!mxfp8_fast_eligible(&[], &[135]));
        assert!(mxfp8_fast_eligible(&[], &[]));
    }
}
