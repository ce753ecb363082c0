//! The CUDA backend of the engine: [`mxrl_tensor::device::Backend`] on device buffers, every op
//! one of the typed launchers in [`crate::ops`]. Buffers are `CudaSlice`s on the backend's
//! stream; nothing but token ids, lengths and positions goes up per call, and only what the
//! caller downloads comes back.
//!
//! Numerics: BF16 operands on tensor cores with f32 accumulation (cuBLAS `GemmEx` for dense
//! linears, the grouped expert kernels for routed experts), f32 for everything else, no fast
//! math, deterministic (no atomics in reductions). The reference of every op is
//! [`mxrl_tensor::device::CpuBackend`]; only summation orders (and a few ulps of `exp`) differ.

use crate::cuda::InputView;
use crate::gpu::DeviceGraph;
use crate::gpu::Gpu;
use crate::ops::attention::{self, Attention};
use crate::ops::elementwise::Elementwise;
use crate::ops::embed_backward::{EmbedBackward, EmbedGrouping};
use crate::ops::engine::EngineOps;
use crate::ops::gemm::{
    dense_small_m_rows, Gemm, Grouped, GroupedPath, DENSE_SMALL_M_OUTPUTS, RMSNORM_SMALL_M_MAX_SMEM,
};
use crate::ops::head::{Head, HeadGradGemm, HeadOutputs, HeadShape, DEFAULT_CHUNK};
use crate::ops::moe::{self, Moe};
use crate::ops::norm::{self, Norm};
use crate::ops::optim::{AdamWParam, Optim};
use crate::ops::qgemm::{mxfp8_fast_eligible, ActRows, Mxfp8Decode, QGemm};
use crate::ops::qlinear::{ColSegments, QLinear};
use crate::ops::rope::{Rope, RopeDeviceTable};
use crate::ops::router::{DeviceRouteMode, ExtraDprobs, Router};
use crate::ops::sample::Sampler;
use crate::ops::swiglu::Swiglu;
use crate::DeviceError as CudaError;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use mxrl_formats::{Format, Scheme};
use mxrl_tensor::attention::AttnShape;
use mxrl_tensor::device::{
    adamw_then_quantize, add_rmsnorm_then_linear, decode_attention_ops, gather_gate_up_swiglu_bf16,
    grouped_down_then_combine_add, rmsnorm_then_linear_shared, swiglu_then_grouped_qlinear,
    AdamWUpdate, Backend, DResult, DecodeAttnOut, Device, DeviceError, GradWrite, OutGrad,
    RouteBufs, SavedX, StoredBytes, StoredLayout,
};
use mxrl_tensor::optim::AdamWConfig;
use mxrl_tensor::qlinear::{ActScaling, BackwardMode, LinearSpec, PreparedWeight};
use mxrl_tensor::sample::SampleParams;
use mxrl_tensor::SeqLayout;
use std::cell::Cell;

mod fp8;

/// Whether a dense BF16 forward of `m` rows runs on the small-M kernel
/// ([`Gemm::dense_nt_small_m`]): at most [`dense_small_m_rows`] rows and every width a multiple
/// of 8 (its 16-byte loads); a shape-only choice, so equal shapes always take the same path.
fn small_m_dense(m: usize, k: usize, ns: &[usize]) -> bool {
    m >= 1
        && m <= dense_small_m_rows()
        && k.is_multiple_of(8)
        && !ns.is_empty()
        && ns.iter().all(|n| n.is_multiple_of(8))
}

/// Which dense BF16 forwards (past [`dense_small_m_rows`]) run on the fragment kernels
/// ([`QGemm::dense_nt_frag_bf16_multi`]) rather than cuBLAS: launches of at most `max_rows`
/// rows whose weights' widths add up to `min_cols ..= max_cols`. cuBLAS runs q, k and v of a
/// decode step as three GEMMs of a few dozen blocks each, far from the memory bandwidth; the
/// fragment kernels put the three weights' 32-column blocks in one grid, deep splits of the
/// reduction shortening each warp's chain of loads. A shape-only choice, so equal shapes
/// always take the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenseFrag {
    /// Most rows (`0`: never).
    pub max_rows: usize,
    /// Fewest output columns of one launch (all its weights).
    pub min_cols: usize,
    /// Most output columns of one launch.
    pub max_cols: usize,
}

impl DenseFrag {
    /// Never: every dense BF16 forward past the small-M rows on cuBLAS.
    pub const OFF: DenseFrag = DenseFrag {
        max_rows: 0,
        min_cols: 0,
        max_cols: 0,
    };

    /// The default: up to 128 rows (decode batches), launches of 3072 to 8192 columns (96 to
    /// 256 column blocks: q, k and v of the benchmark model together). Measured on an H100
    /// (`bench_qgemm --dense` under Nsight Compute, BENCHMARKS.md): q, k and v (3072
    /// columns) in one launch took 0.40–0.82× cuBLAS's three GEMMs at 3–128 rows; a single
    /// 2048-wide weight (64 blocks for 132 SMs) 1.0× at up to 8 rows and 1.2–1.7× beyond; the
    /// router (64 columns) and the lm_head (32 000) were never faster. In the recorded decode
    /// step of the benchmark model (same card, two runs each way): BF16 batch 4 / 8 / 32
    /// 1.30 / 1.72 / 2.37 against 1.36 / 1.78 / 2.43 ms, NVFP4 experts 1.06 / 1.26 / 1.54
    /// against 1.14 / 1.31 / 1.60 ms; batch 128 unchanged.
    pub const DEFAULT: DenseFrag = DenseFrag {
        max_rows: 128,
        min_cols: 3072,
        max_cols: 8192,
    };

    /// [`DenseFrag::DEFAULT`] with `MXRL_DENSE_FRAG` (rows; `0` or `off` = never) and
    /// `MXRL_DENSE_FRAG_COLS=MIN,MAX` applied.
    pub fn from_env() -> Self {
        let mut d = DenseFrag::DEFAULT;
        d.max_rows = env_count("MXRL_DENSE_FRAG", d.max_rows);
        if let Some((lo, hi)) = std::env::var("MXRL_DENSE_FRAG_COLS").ok().and_then(|v| {
            let (a, b) = v.trim().split_once(',')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        }) {
            (d.min_cols, d.max_cols) = (lo, hi);
        }
        d
    }

    /// Whether a dense BF16 forward of `m` rows by weights of widths `ns` with rows of `k`
    /// takes the fragment kernels: past the small-M kernel's rows, within these limits, at
    /// most three weights, `k` a multiple of 32 and every width of
    /// [`crate::ops::qgemm::FRAG_COLS`].
    pub fn takes(&self, m: usize, k: usize, ns: &[usize]) -> bool {
        let total: usize = ns.iter().sum();
        m > dense_small_m_rows()
            && m <= self.max_rows
            && total >= self.min_cols
            && total <= self.max_cols
            && k.is_multiple_of(32)
            && !ns.is_empty()
            && ns.len() <= 3
            && ns.iter().all(|&n| QGemm::frag_fits(n, k))
    }
}

/// The small-M launchers' `(weight view, width, output view)` list of `outs`, passed to `f`.
#[allow(clippy::type_complexity)]
fn with_small_m_views<R>(
    outs: &mut [(&CudaSlice<u16>, usize, &mut CudaSlice<f32>)],
    f: impl FnOnce(&mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)]) -> R,
) -> R {
    let views: Vec<_> = outs.iter().map(|o| o.0.as_view()).collect();
    let widths: Vec<usize> = outs.iter().map(|o| o.1).collect();
    let mut ys: Vec<_> = outs.iter_mut().map(|o| o.2.as_view_mut()).collect();
    let mut args: Vec<_> = views
        .iter()
        .zip(ys.iter_mut())
        .zip(widths)
        .map(|((w, y), n)| (w, n, y))
        .collect();
    f(&mut args)
}

/// Whether the environment variable `name` turns a fused path off (`off`, `0`, `false`).
fn env_off(name: &str) -> bool {
    matches!(
        std::env::var(name).ok().as_deref().map(str::trim),
        Some("off" | "0" | "false")
    )
}

/// A count from the environment variable `name`: `off` is 0, a number is itself, anything else
/// (or unset) is `default`.
fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name).as_deref().map(str::trim) {
        Ok("off") => 0,
        Ok(v) => v.parse().unwrap_or(default),
        Err(_) => default,
    }
}

/// Whether decode's BF16 routed gate/up runs fused with the gather and SwiGLU on the small-M
/// kernel (`MXRL_MOE_FUSED=off`: the three ops, the gate/up on the fragment kernels). It is
/// taken only while the experts average at most half a row each: its sums run on CUDA cores,
/// and with more rows the fragment kernels' tensor cores win (H100: 26 µs per layer faster at
/// batch 1 of the benchmark model, 45 µs slower at batch 32; BENCHMARKS.md).
fn moe_fused_small_m() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !env_off("MXRL_MOE_FUSED"))
}

/// Whether decode's residual add, norm and router run as one kernel where the shape allows
/// (`MXRL_ADD_NORM_ROUTER=off`: the add-and-norm kernel, then the router's small-M linear).
fn add_norm_router_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !env_off("MXRL_ADD_NORM_ROUTER"))
}

/// Whether the small-M kernels with the RMSNorm in front take `m` rows of `k` into outputs of
/// widths `ns`, needing `smem` bytes of shared memory: the small-M linear's rows, and the
/// 256-thread norm's reduction and the shared-memory limit that `Gemm::norm_small_m` refuses
/// outside of.
fn norm_small_m_shape(m: usize, k: usize, ns: &[usize], smem: usize) -> bool {
    small_m_dense(m, k, ns) && k >= 256 && smem <= RMSNORM_SMALL_M_MAX_SMEM
}

/// Whether a decode projection of the routed experts is small enough for the fused small-M
/// kernels: at most half a row per expert on average, on the small-M path.
fn moe_fused_shape(s: Grouped) -> bool {
    2 * s.rows <= s.experts && GroupedPath::for_shape(s) == GroupedPath::SmallM
}

/// [`moe_down_fused_tokens`]' default (H100, BENCHMARKS.md: at one token 0.837 against 0.864 ms
/// per batch-1 step unfused, within that call's run-to-run spread; at 2 and 4 tokens slower).
const MOE_DOWN_FUSED_TOKENS: usize = 1;

/// Up to how many tokens decode's BF16 routed down projection runs fused with the combine and
/// the residual add on the small-M kernel (`MXRL_MOE_DOWN_FUSED=N`; `0` or `off`: never, the
/// two ops with the down projection on the fragment kernels), where the fused gate/up runs
/// (`moe_fused_small_m`). Default [`MOE_DOWN_FUSED_TOKENS`]: the kernel reads each token's experts apart, so tokens
/// that share an expert read its weights again (H100: +20 µs per layer at 4 tokens).
fn moe_down_fused_tokens() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        if !moe_fused_small_m() {
            return 0;
        }
        env_count("MXRL_MOE_DOWN_FUSED", MOE_DOWN_FUSED_TOKENS)
    })
}

/// Decode routing runs fused up to this many tokens: one token per warp of the fused kernel.
/// Beyond, a warp takes several tokens in turn and the per-token-block kernel is faster (H100:
/// +34 µs per layer at 128 tokens, BENCHMARKS.md).
const ROUTE_FUSED_MAX_TOKENS: usize = 16;

/// Whether decode-sized routing runs the router and the dispatch in one launch
/// (`MXRL_ROUTE_FUSED=off`: two launches; the same bits either way).
fn route_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !env_off("MXRL_ROUTE_FUSED"))
}

fn de(e: CudaError) -> DeviceError {
    match e {
        CudaError::Cuda { device, what } => DeviceError::new(device, what),
        other => DeviceError::new("cuda", other.to_string()),
    }
}

/// The routed experts' weights of one projection as stored: element codes and block scales
/// of every expert back to back (`[E, N, K]` E4M3 bytes and `[E, N, K/32]` E8M0 scales for
/// MXFP8; `[E, N, K/2]` packed E2M1 and `[E, N, K/16]` E4M3 scales plus one f32 amax per
/// expert for NVFP4; `[E, N, K]` E4M3 bytes and the f32 `scale_inv [E, N/128, K/128]` as
/// little-endian bytes in `scales` for FP8 block), the bytes `mxrl_formats` wrote, compact
/// scale layout.
pub struct QExperts {
    /// The block format of every expert.
    pub format: Format,
    /// Experts, output rows, input columns.
    pub e: usize,
    /// Output rows per expert.
    pub n: usize,
    /// Input columns.
    pub k: usize,
    /// Element codes.
    pub codes: CudaSlice<u8>,
    /// Block scales.
    pub scales: CudaSlice<u8>,
    /// NVFP4 per-expert amax (one element, unused, for MXFP8 and FP8 block).
    pub amax: CudaSlice<f32>,
    /// NVFP4 activations' amax scope is per token (the only one the device path takes).
    pub spec: LinearSpec,
    /// The weights' operand of the training backward's dgrad, for every expert at once
    /// (BF16, `parts` stacks of `[E, N, K]`, module doc of [`Backend::grouped_qlinear_backward`]
    /// here), made on the first backward of this weight version (MXFP8 `lowp`: written by the
    /// optimizer pass that made the weights, where its tiles allow).
    pub train: std::cell::OnceCell<CudaSlice<u16>>,
    /// MXFP8: every scale byte ≤ 134 and no NaN code, so the fragment kernels may decode
    /// with [`Mxfp8Decode::Fast`] (the same bits); checked once when the weights are made.
    pub fast_decode: FastDecode,
    /// MXFP8 weights' forward operand on BF16 tensor cores: their contract dequantization
    /// to BF16 (`[E, N, K]`). Written by the optimizer pass that made the weights
    /// (`Backend::adamw_requantize`), where the large-M grouped forward and the dequantized
    /// backward take it; a dense weight's is otherwise made by its first forward of this
    /// version that is not being recorded into a graph (a recorded step reuses it; the weights
    /// never change within a version).
    pub serve: std::cell::OnceCell<CudaSlice<u16>>,
}

/// Whether stored MXFP8 weights may take [`Mxfp8Decode::Fast`]: known on the host, or a
/// device flag written by the kernel that made the weights (`QGemm::adamw_mxfp8`), read back
/// once, on the first use outside graph recording.
pub struct FastDecode {
    known: std::cell::Cell<Option<bool>>,
    flag: Option<CudaSlice<u32>>,
}

impl FastDecode {
    /// An answer known on the host.
    pub fn known(v: bool) -> Self {
        FastDecode {
            known: std::cell::Cell::new(Some(v)),
            flag: None,
        }
    }

    /// An answer in a device flag (0: eligible, 1: not), read when first asked for.
    pub fn on_device(flag: CudaSlice<u32>) -> Self {
        FastDecode {
            known: std::cell::Cell::new(None),
            flag: Some(flag),
        }
    }

    /// The answer: `None` only while `gpu`'s stream records a graph and the flag has not
    /// been read yet (a read would synchronize; the caller takes the general decode, which
    /// gives the same bits).
    ///
    /// # Errors
    /// The copy of the flag failed.
    pub fn get(&self, gpu: &Gpu) -> Result<Option<bool>, CudaError> {
        if let Some(v) = self.known.get() {
            return Ok(Some(v));
        }
        let Some(flag) = &self.flag else {
            return Ok(Some(false));
        };
        if gpu.capturing()? {
            return Ok(None);
        }
        let v = gpu.download(flag)?[0] == 0;
        self.known.set(Some(v));
        Ok(Some(v))
    }
}

impl QExperts {
    /// Stored bytes on the device (codes, scales, and the amax of NVFP4).
    pub fn bytes(&self) -> usize {
        let amax = if self.format == Format::Nvfp4 {
            4 * self.amax.len()
        } else {
            0
        };
        self.codes.len() + self.scales.len() + amax
    }
}

/// Average rows per expert from which routed-expert GEMMs run as one cuBLAS call per expert
/// by default: never (`usize::MAX`), every size runs the one-launch grouped kernels. At the
/// training shape of `mxrl bench model` (512 rows per expert) cuBLAS per expert takes less GPU
/// time (`bench_gemm`), but its ~2 000 calls per step keep the host queueing for most of the
/// backward: measured in one call on an H200, the whole step took 109 ms with the grouped
/// kernels against 107–213 ms (median 167) per expert. [`CudaBackend::set_per_expert_rows`]
/// chooses another split.
pub const PER_EXPERT_ROWS: usize = usize::MAX;

/// Block-format routed experts pick their kernels by the average rows per expert: up to
/// [`QFRAG_ROWS_PER_EXPERT`] ([`QFRAG_WGMMA_ROWS_PER_EXPERT`] where the dequantized path runs
/// on the `wgmma` tile), where the weights' shape fits ([`QGemm::frag_fits`]: `N` a
/// multiple of 32), the tensor-core kernels with the stored bytes decoded straight into mma
/// fragments (decode batches); beyond that, weights dequantized to BF16 for the tiled
/// tensor-core grouped GEMMs (prefill, scoring). Off the fragment kernels' shapes the small-M
/// kernels serve up to [`QSMALL_M_ROWS_PER_EXPERT`] rows per expert, the dequantized path
/// beyond. BF16 routed experts take the same fragment kernels on their stored BF16 values up
/// to [`QFRAG_BF16_ROWS_PER_EXPERT`] rows per expert (`grouped_linear`), the tiled kernels
/// beyond.
pub const QSMALL_M_ROWS_PER_EXPERT: usize = crate::ops::gemm::SMALL_M_ROWS_PER_EXPERT;

/// Average rows per expert up to which the fragment kernels on stored bytes
/// ([`QGemm::grouped_nt_frag_mxfp8`]) serve block-format experts. Each pass (64 rows in the
/// staged layout: [`crate::ops::qgemm::FragRows::largest_staged`]) reads the expert's bytes
/// again, mostly from L2; the dequantized path writes and rereads every stack as BF16 once
/// per step. Measured on an H200 (`bench_qgemm --large`, 64 experts, BENCHMARKS.md): at 64
/// and 128 rows per expert on average the staged kernels took 0.40–0.62× the dequantized
/// path's time; with one expert holding 1/8 of the rows (the rollouts' routing), 0.85–0.93×
/// at 256 rows per expert and 0.91–1.02× at 768 (prefill-sized steps).
pub const QFRAG_ROWS_PER_EXPERT: usize = 512;

/// Where the dequantized path's grouped GEMMs run on the `wgmma` tile (sm_90, at least 128
/// rows per expert on average: [`crate::ops::gemm::Gemm::forward_tile`]), MXFP8 and NVFP4
/// experts take the fragment kernels up to this many rows per expert on average instead of
/// [`QFRAG_ROWS_PER_EXPERT`]. Measured by Nsight Compute on an H100 in a training step of the
/// benchmark config (64 experts, 511 rows each, BENCHMARKS.md): the MXFP8 fragment kernel took
/// 0.99 / 0.50 ms (gate/up, down) where the `wgmma` tile on the BF16 operand took 0.43 /
/// 0.26 ms, plus about 0.14 ms to dequantize a stack where the optimizer's pass did not write
/// the operand; at half the rows the fragment kernels take half the passes and the two paths
/// meet.
pub const QFRAG_WGMMA_ROWS_PER_EXPERT: usize = 256;

/// Average rows per expert up to which BF16 routed experts take the fragment kernels
/// ([`QGemm::grouped_nt_frag_bf16`]); the tiled kernels beyond. Measured on an H200
/// (`bench_qgemm --large`, 64 experts): the staged 64-row passes against the tiled kernels
/// 261.9 against 271.5 µs (gate/up) at 64 rows per expert on average, 432.5 against 378.6 at
/// 128.
pub const QFRAG_BF16_ROWS_PER_EXPERT: usize = 64;

/// The engine's CUDA backend on one GPU.
pub struct CudaBackend {
    gpu: Gpu,
    ew: Elementwise,
    eng: EngineOps,
    norm: Norm,
    rope: Rope,
    attn: Attention,
    moe: Moe,
    router: Router,
    swiglu: Swiglu,
    gemm: Gemm,
    head: Head,
    optim: Optim,
    embed_bwd: EmbedBackward,
    sampler: Sampler,
    /// The low-byte expert kernels (need sm_89+; the error says why they are missing).
    qgemm: Result<QGemm, String>,
    /// The quantized linear layer (training backward of block-format linears; the error says
    /// why it is missing).
    qlin: Result<QLinear, String>,
    /// The FP8-block quantizers and GEMM (the error says why they are missing).
    fp8: Result<crate::ops::fp8block::Fp8Block, String>,
    /// Grouped-GEMM offsets `[0, u32::MAX]`: one group holding every row (the kernels clamp
    /// offsets to their row count), for dense linears on the grouped kernels.
    whole_rows: CudaSlice<u32>,
    /// AdamW's gradient scale on the device (value bits, buffer).
    grad_scale: std::sync::Mutex<Option<(u32, std::sync::Arc<CudaSlice<f32>>)>>,
    peak: Cell<usize>,
    /// Average rows per expert from which the routed-expert GEMMs run one cuBLAS call per
    /// expert ([`PER_EXPERT_ROWS`] unless set by [`CudaBackend::set_per_expert_rows`]).
    per_expert_rows: Cell<usize>,
    /// Which dense BF16 forwards take the fragment kernels ([`DenseFrag::from_env`] unless set
    /// by [`CudaBackend::set_dense_frag`]).
    dense_frag: Cell<DenseFrag>,
    /// Whether taped forwards keep the operands their backward multiplies
    /// ([`Backend::keeps_forward_operand`]; on unless [`CudaBackend::set_keep_forward_operands`]).
    keep_operands: Cell<bool>,
}

impl CudaBackend {
    /// Opens GPU `ordinal` and loads (compiling on first use) every op module.
    ///
    /// # Errors
    /// No usable GPU, NVRTC or module-load errors.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let gpu = Gpu::shared(ordinal)?;
        Ok(CudaBackend {
            ew: Elementwise::new(&gpu)?,
            eng: EngineOps::new(&gpu)?,
            norm: Norm::new(&gpu)?,
            rope: Rope::new(&gpu)?,
            attn: Attention::new(&gpu)?,
            moe: Moe::new(&gpu)?,
            router: Router::new(&gpu)?,
            swiglu: Swiglu::new(&gpu)?,
            gemm: Gemm::new(&gpu)?,
            // The lm_head backward on BF16 tensor cores (dz split in three BF16 parts: f32
            // accuracy to 2⁻²⁴·|dz|, three BF16 GEMMs instead of two f32 ones).
            head: Head::new(&gpu)?.with_grad_gemm(HeadGradGemm::Bf16x3),
            optim: Optim::new(&gpu)?,
            embed_bwd: EmbedBackward::new(&gpu)?,
            sampler: Sampler::new(&gpu)?,
            qgemm: QGemm::new(&gpu).map_err(|e| e.to_string()),
            qlin: QLinear::new(&gpu).map_err(|e| e.to_string()),
            fp8: crate::ops::fp8block::Fp8Block::new(&gpu).map_err(|e| e.to_string()),
            whole_rows: gpu.upload(&[0u32, u32::MAX])?,
            grad_scale: std::sync::Mutex::new(None),
            peak: Cell::new(0),
            per_expert_rows: Cell::new(PER_EXPERT_ROWS),
            keep_operands: Cell::new(true),
            dense_frag: Cell::new(DenseFrag::from_env()),
            gpu,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Average rows per expert from which routed-expert GEMMs (outside decode) run as one
    /// cuBLAS call per expert instead of the one-launch grouped kernels (`usize::MAX`: always
    /// the grouped kernels). Both give the same products, summed in another order.
    pub fn set_per_expert_rows(&self, rows: usize) {
        self.per_expert_rows.set(rows);
    }

    /// Whether taped forwards of MXFP8 `dequantized` / `lowp` and NVFP4 `dequantized` experts
    /// keep the activation operand their backward multiplies, and q, k and v share one made
    /// once (on by default), or the backward makes it from the f32 rows for each linear: the
    /// same operands, so the same bits (what the tests compare).
    pub fn set_keep_forward_operands(&self, on: bool) {
        self.keep_operands.set(on);
    }

    /// Which dense BF16 forwards run on the fragment kernels instead of cuBLAS
    /// ([`DenseFrag`]); both give the same products, summed in another order.
    pub fn set_dense_frag(&self, d: DenseFrag) {
        self.dense_frag.set(d);
    }

    /// `cuda:N (name)`.
    pub fn name(&self) -> String {
        self.gpu.name().to_string()
    }

    /// Largest device memory in use (total − free) seen at a synchronizing call (downloads).
    pub fn peak_bytes(&self) -> Option<usize> {
        self.note_memory();
        Some(self.peak.get())
    }

    /// The first `n` elements of `b` through [`Gpu::download_with`] (`download_*_with`).
    fn download_with<T>(&self, b: &CudaSlice<T>, n: usize, f: &mut dyn FnMut(&[T])) -> DResult<()>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
    {
        let v = b.try_slice(0..n).ok_or_else(|| {
            de(self.gpu.err(format!(
                "download: buffer of {} elements, {n} needed",
                b.len()
            )))
        })?;
        self.gpu.download_with(&v, |h| f(h)).map_err(de)
    }

    fn note_memory(&self) {
        if let Ok((free, total)) = self.gpu.ctx().mem_get_info() {
            self.peak.set(self.peak.get().max(total - free));
        }
    }

    /// Device-to-device copy bandwidth (bytes read + written per second / 10⁹) of a `bytes`
    /// buffer, median of 10 copies after a warm-up, timed with CUDA events.
    ///
    /// # Errors
    /// Out of memory; driver errors.
    pub fn copy_bandwidth_gbps(&self, bytes: usize) -> Result<f64, CudaError> {
        let n = bytes / 4;
        let s = self.gpu.stream();
        let src = self.gpu.upload(&vec![1.0f32; n])?;
        let mut dst = self.gpu.zeros::<f32>(n)?;
        let e = |x| self.gpu.err(format!("{x:?}"));
        s.memcpy_dtod(&src, &mut dst).map_err(e)?;
        let mut times = Vec::new();
        for _ in 0..10 {
            let a = s
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(e)?;
            s.memcpy_dtod(&src, &mut dst).map_err(e)?;
            let b = s
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(e)?;
            b.synchronize().map_err(e)?;
            times.push(a.elapsed_ms(&b).map_err(e)? as f64);
        }
        times.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        let ms = times[times.len() / 2];
        Ok(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9)
    }

    /// For batches of at least the set rows per expert on average ([`PER_EXPERT_ROWS`] by
    /// default),
    /// the expert row offsets read back to the host so that each expert's GEMM runs as one
    /// cuBLAS call (faster than the one-launch grouped kernel at these sizes, measured by
    /// `bench_gemm`); `None` for decode-sized batches, which stay in one launch with no host
    /// round trip (CUDA-graph capturable). The caller's host copy is used when given.
    /// Whether `rows` routed rows over `experts` run one cuBLAS call per expert
    /// (`--per-expert-rows`) instead of the grouped kernels.
    fn per_expert_path(&self, experts: usize, rows: usize) -> bool {
        rows >= self.per_expert_rows.get().saturating_mul(experts.max(1))
    }

    fn per_expert_offsets(
        &self,
        offsets: &CudaSlice<u32>,
        host: Option<&[u32]>,
        experts: usize,
        rows: usize,
    ) -> DResult<Option<Vec<u32>>> {
        if !self.per_expert_path(experts, rows) {
            return Ok(None);
        }
        let o = match host {
            Some(h) if h.len() == experts + 1 => h.to_vec(),
            Some(h) => {
                return Err(DeviceError::new(
                    self.gpu.name(),
                    format!("{} host expert offsets for {experts} experts", h.len()),
                ))
            }
            None => self
                .gpu
                .download(&offsets.slice(0..experts + 1))
                .map_err(de)?,
        };
        if o.windows(2).any(|w| w[0] > w[1]) || o[experts] as usize > rows {
            return Err(DeviceError::new(
                self.gpu.name(),
                format!("invalid expert offsets {o:?} for {rows} rows"),
            ));
        }
        Ok(Some(o))
    }

    /// A one-element device buffer holding `s` (AdamW's gradient scale): the last one made is
    /// kept and reused while the value stays the same (one upload per optimizer step).
    fn grad_scale_buffer(&self, s: f32) -> DResult<std::sync::Arc<CudaSlice<f32>>> {
        let mut cache = self.grad_scale.lock().expect("grad scale cache poisoned");
        if let Some((bits, buf)) = cache.as_ref() {
            if *bits == s.to_bits() {
                return Ok(buf.clone());
            }
        }
        let buf = std::sync::Arc::new(self.gpu.upload(&[s]).map_err(de)?);
        *cache = Some((s.to_bits(), buf.clone()));
        Ok(buf)
    }

    /// NVFP4 weights (per-tensor amax each) quantized on the device as one stack
    /// ([`QLinear::quantize_nvfp4_stack`]: three launches, the bytes of each weight quantized
    /// alone), laid out as [`QExperts`] keeps them.
    fn quantize_nvfp4_groups(
        &self,
        master: &CudaSlice<f32>,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
        name: &(dyn Fn(usize) -> String + Sync),
    ) -> DResult<QExperts> {
        let ql = self.nvfp4_weight_checks(master, groups, n, k, spec, name)?;
        // One device call for the stack: each weight keeps its own amax (the bytes of each
        // weight quantized alone).
        let stack = ql
            .quantize_nvfp4_stack(&master.slice(0..groups * n * k), groups, n, k)
            .map_err(|e| self.stack_err(name, groups, e))?;
        self.nvfp4_experts(stack, groups, n, k, spec)
    }

    /// The device's conditions on NVFP4 weights (per-token activations, one amax per weight,
    /// the master long enough); returns the quantizers.
    fn nvfp4_weight_checks(
        &self,
        master: &CudaSlice<f32>,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
        name: &(dyn Fn(usize) -> String + Sync),
    ) -> DResult<&QLinear> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if spec.act_scaling() != ActScaling::PerToken {
            return Err(dev(format!(
                "{}: NVFP4 with per-tensor activation scaling has no device expert kernels",
                name(0)
            )));
        }
        let ql = self
            .qlin
            .as_ref()
            .map_err(|e| dev(format!("{}: the quantizers did not load: {e}", name(0))))?;
        if !matches!(
            spec.weight_scheme(),
            Some(Scheme::Nvfp4(w)) if w.amax == mxrl_formats::AmaxScope::PerTensor
        ) {
            return Err(dev(format!(
                "{}: NVFP4 weights carry one amax per weight on the device",
                name(0)
            )));
        }
        if master.len() < groups * n * k {
            return Err(dev(format!(
                "quantize_weights {}: master of {} values for [{groups}·{n}, {k}]",
                name(0),
                master.len()
            )));
        }
        Ok(ql)
    }

    /// A device error naming the weights of a stack.
    fn stack_err(
        &self,
        name: &(dyn Fn(usize) -> String + Sync),
        groups: usize,
        e: CudaError,
    ) -> DeviceError {
        DeviceError::new(
            self.gpu.name(),
            format!("{}..{}: {e}", name(0), name(groups.max(1) - 1)),
        )
    }

    /// NVFP4 weights as [`QExperts`] keeps them (each amax as f32 beside the bytes).
    fn nvfp4_experts(
        &self,
        stack: crate::ops::qlinear::Nvfp4Stack,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
    ) -> DResult<QExperts> {
        let mut amax = self.gpu.empty::<f32>(groups.max(1)).map_err(de)?;
        if groups > 0 {
            self.ew
                .copy_f32_bits(&stack.amax_bits.as_view(), &mut amax, 0, groups)
                .map_err(de)?;
        }
        Ok(QExperts {
            format: Format::Nvfp4,
            e: groups,
            n,
            k,
            codes: stack.codes,
            scales: stack.scales,
            amax,
            spec,
            fast_decode: FastDecode::known(false),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    /// [`Backend::adamw_requantize`] of NVFP4 weights: the step finds each weight's amax of
    /// its new values in the same pass (`QGemm::adamw_amax_groups`), then one launch
    /// quantizes the blocks (the bytes of [`CudaBackend::quantize_nvfp4_groups`]).
    #[allow(clippy::too_many_arguments)]
    fn adamw_nvfp4(
        &self,
        q: &QGemm,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        update: &AdamWUpdate<'_>,
        op: Option<&mut CudaSlice<u16>>,
        stored: &StoredLayout<'_>,
    ) -> DResult<QExperts> {
        let (groups, n, k, spec, name) =
            (stored.groups, stored.n, stored.k, stored.spec, stored.name);
        let ql = self.nvfp4_weight_checks(param, groups, n, k, spec, name)?;
        let len = groups * n * k;
        let scale = self.grad_scale_buffer(update.grad_scale)?;
        let wd = update.weight_decay;
        let bits = with_adamw_param(param, grad, m, v, op, len, wd, |p| {
            q.adamw_amax_groups(p, &scale.as_view(), update.step, update.cfg, n * k)
        })
        .map_err(|e| self.stack_err(name, groups, e))?;
        let stack = ql
            .nvfp4_stack_with_amax(&InputView::F32(param.slice(0..len)), groups, n, k, bits)
            .map_err(|e| self.stack_err(name, groups, e))?;
        self.nvfp4_experts(stack, groups, n, k, spec)
    }

    /// `bf16(x[..n])` in a new buffer (every element written by the conversion).
    fn bf16(&self, x: &CudaSlice<f32>, n: usize) -> DResult<CudaSlice<u16>> {
        let mut o = self.gpu.empty::<u16>(n).map_err(de)?;
        self.ew
            .to_bf16(&x.as_view(), &mut o.as_view_mut(), n)
            .map_err(de)?;
        Ok(o)
    }

    /// The stored experts `w` as BF16 `[E, N, K]` GEMM operands: MXFP8 the contract
    /// dequantization (exact), NVFP4 `e2m1 × e4m3(scale)` (exact; α applied after the sum).
    fn experts_bf16(&self, q: &QGemm, w: &QExperts) -> DResult<CudaSlice<u16>> {
        let mut wb = self.gpu.empty::<u16>(w.e * w.n * w.k).map_err(de)?;
        let (codes, scales, mut out) = (w.codes.as_view(), w.scales.as_view(), wb.as_view_mut());
        match w.format {
            Format::Mxfp8 => q.dequant_weights_mxfp8(&codes, &scales, &mut out, w.e, w.n, w.k),
            Format::Nvfp4 => q.dequant_weights_nvfp4(&codes, &scales, &mut out, w.e, w.n, w.k),
            other => {
                return Err(DeviceError::new(
                    self.gpu.name(),
                    format!("no BF16 dequantization of {other:?} experts"),
                ))
            }
        }
        .map_err(de)?;
        Ok(wb)
    }
}

/// One parameter's AdamW operands as views of the whole buffers (the launchers check their
/// lengths against `n`), handed to `f`.
#[allow(clippy::too_many_arguments)]
fn with_adamw_param<R>(
    param: &mut CudaSlice<f32>,
    grad: &CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    op: Option<&mut CudaSlice<u16>>,
    n: usize,
    weight_decay: f32,
    f: impl FnOnce(AdamWParam<'_, '_>) -> R,
) -> R {
    let (mut pv, gv) = (param.as_view_mut(), grad.as_view());
    let (mut mv, mut vv) = (m.as_view_mut(), v.as_view_mut());
    let mut ov = op.map(|o| o.as_view_mut());
    f(AdamWParam {
        param: &mut pv,
        grad: &gv,
        m: &mut mv,
        v: &mut vv,
        param_bf16: ov.as_mut(),
        n,
        weight_decay,
    })
}

impl Backend for CudaBackend {
    type F32 = CudaSlice<f32>;
    type Bf16 = CudaSlice<u16>;
    type U32 = CudaSlice<u32>;
    type Rope = RopeDeviceTable;
    type Graph = DeviceGraph;
    type QExperts = QExperts;
    type NormParts = crate::ops::optim::NormParts;

    fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }

    fn synchronize(&self) -> DResult<()> {
        self.gpu.sync().map_err(de)
    }

    fn empty_f32(&self, n: usize) -> DResult<Self::F32> {
        self.gpu.empty(n).map_err(de)
    }

    fn empty_bf16(&self, n: usize) -> DResult<Self::Bf16> {
        self.gpu.empty(n).map_err(de)
    }

    fn rmsnorm_bf16(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        out: &mut Self::Bf16,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        self.norm
            .forward_bf16(
                &x.as_view(),
                &w.as_view(),
                &mut out.as_view_mut(),
                &mut rstd.as_view_mut(),
                rows,
                d,
                eps,
            )
            .map_err(de)
    }

    fn rmsnorm_both(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: &mut Self::F32,
        yb: &mut Self::Bf16,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        self.norm
            .forward_both(
                &x.as_view(),
                &w.as_view(),
                &mut y.as_view_mut(),
                &mut yb.as_view_mut(),
                &mut rstd.as_view_mut(),
                rows,
                d,
                eps,
            )
            .map_err(de)
    }

    fn add_rmsnorm(
        &self,
        x: &mut Self::F32,
        res: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: Option<&mut Self::F32>,
        yb: Option<&mut Self::Bf16>,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        let mut yv = y.map(|y| y.as_view_mut());
        let mut ybv = yb.map(|yb| yb.as_view_mut());
        self.norm
            .forward_add(
                &mut x.as_view_mut(),
                &res.as_view(),
                &w.as_view(),
                yv.as_mut(),
                ybv.as_mut(),
                &mut rstd.as_view_mut(),
                rows,
                d,
                eps,
            )
            .map_err(de)
    }

    fn gather_rows_bf16(
        &self,
        xb: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()> {
        self.moe
            .gather_rows_bf16(
                &xb.as_view(),
                &route.perm.as_view(),
                &route.offsets.as_view(),
                &mut out.as_view_mut(),
                n,
                h,
                e,
                top_k,
            )
            .map_err(de)
    }

    fn combine_add(
        &self,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        k: usize,
        h: usize,
        residual: &Self::F32,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .combine_add(
                &y.as_view(),
                &route.weights.as_view(),
                &route.row_of.as_view(),
                &residual.as_view(),
                &mut out.as_view_mut(),
                n,
                h,
                k,
            )
            .map_err(de)
    }

    fn upload_experts(&self, experts: Vec<PreparedWeight>) -> DResult<QExperts> {
        mxrl_tensor::device::check_experts(&experts)?;
        let first = &experts[0];
        let (spec, n, k) = (first.spec(), first.n(), first.k());
        let format = spec.format();
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if format == Format::Fp8Block {
            return self.fp8_upload_experts(experts);
        }
        match format {
            Format::Mxfp8 => {}
            Format::Nvfp4 if spec.act_scaling() == ActScaling::PerToken => {}
            _ => {
                return Err(dev(format!(
                    "upload_experts: {} ({spec:?}) has no device expert kernels (MXFP8, or \
                     NVFP4 with per-token activation scaling)",
                    first.name()
                )))
            }
        }
        let (mut codes, mut scales, mut amax) = (Vec::new(), Vec::new(), Vec::new());
        for pw in &experts {
            let q = pw
                .stored()
                .expect("checked: stored bytes")
                .clone()
                .with_scale_layout(mxrl_formats::ScaleLayout::Compact)
                .map_err(|e| dev(format!("{}: {e}", pw.name())))?;
            let Some(sb) = q.scales.as_bytes() else {
                return Err(dev(format!("{}: scales are not bytes", pw.name())));
            };
            codes.extend_from_slice(&q.data);
            scales.extend_from_slice(sb);
            if format == Format::Nvfp4 {
                if q.amax.len() != 1 {
                    return Err(dev(format!(
                        "{}: {} amax values, one per-tensor amax expected",
                        pw.name(),
                        q.amax.len()
                    )));
                }
                amax.push(q.amax[0]);
            }
        }
        if amax.is_empty() {
            amax.push(0.0);
        }
        Ok(QExperts {
            format,
            e: experts.len(),
            n,
            k,
            codes: self.gpu.upload(&codes).map_err(de)?,
            scales: self.gpu.upload(&scales).map_err(de)?,
            amax: self.gpu.upload(&amax).map_err(de)?,
            spec,
            fast_decode: FastDecode::known(
                format == Format::Mxfp8 && mxfp8_fast_eligible(&codes, &scales),
            ),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    fn upload_stored(
        &self,
        spec: LinearSpec,
        n: usize,
        k: usize,
        weights: &[StoredBytes<'_>],
    ) -> DResult<QExperts> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        let scheme = mxrl_tensor::device::stored_scheme(self.gpu.name(), spec, weights)?;
        let name = weights[0].name;
        for w in weights {
            w.check(scheme, &[n, k]).map_err(dev)?;
        }
        let format = spec.format();
        match format {
            Format::Mxfp8 => {}
            Format::Nvfp4 if spec.act_scaling() == ActScaling::PerToken => {
                if let Some(w) = weights.iter().find(|w| w.amax.len() != 1) {
                    return Err(dev(format!(
                        "{}: {} amax values, one per-tensor amax expected",
                        w.name,
                        w.amax.len()
                    )));
                }
            }
            Format::Fp8Block
                if scheme == Scheme::FP8_BLOCK_WEIGHT
                    && n.is_multiple_of(mxrl_formats::FP8_BLOCK)
                    && k.is_multiple_of(mxrl_formats::FP8_BLOCK) => {}
            _ => {
                return Err(dev(format!(
                    "upload_stored: {name} ({spec:?} [{n}, {k}]) has no device expert kernels \
                     (MXFP8, NVFP4 with per-token activation scaling, FP8-block 128×128 tiles \
                     with N and K multiples of 128)"
                )))
            }
        }
        // The layout of `QExperts`: every weight's codes back to back, then every weight's
        // scale bytes, copied as they are through the page-locked staging buffers.
        let staged = |parts: Vec<&[u8]>| self.gpu.upload_staged::<u8>(&parts).map_err(de);
        let codes = staged(weights.iter().map(|w| w.data).collect())?;
        let scales = staged(weights.iter().map(|w| w.scales).collect())?;
        if format == Format::Fp8Block {
            return self.fp8_experts(spec, weights.len(), n, k, codes, scales);
        }
        let amax: Vec<f32> = if format == Format::Nvfp4 {
            weights.iter().map(|w| w.amax[0]).collect()
        } else {
            vec![0.0]
        };
        Ok(QExperts {
            format,
            e: weights.len(),
            n,
            k,
            codes,
            scales,
            amax: self.gpu.upload(&amax).map_err(de)?,
            spec,
            fast_decode: FastDecode::known(
                format == Format::Mxfp8
                    && weights
                        .iter()
                        .all(|w| mxfp8_fast_eligible(w.data, w.scales)),
            ),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    fn grouped_qlinear(
        &self,
        x: &Self::F32,
        w: &QExperts,
        offsets: &Self::U32,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        if w.format == Format::Fp8Block {
            return self.fp8_forward(x, w, Some(offsets), experts, rows, k, n, y);
        }
        let xv = x.as_view();
        let act = self.quant_act_rows(&ActRows::Rows(&xv), w, rows, k, "grouped_qlinear")?;
        self.grouped_qlinear_on(&act, w, offsets, experts, rows, k, n, y)
    }

    fn grouped_qlinear_gathered(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        tokens: usize,
        top_k: usize,
        w: &QExperts,
        experts: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        let rows = tokens * top_k;
        if w.format == Format::Fp8Block {
            return self.fp8_forward_gathered(x, route, tokens, top_k, w, experts, k, n, y);
        }
        // Each row is quantized alone (MXFP8 blocks along k, NVFP4's per-token factor): the
        // quantizer reads the routed rows through the permutation (one launch, no gathered
        // copy), the operands of the gathered rows.
        let act = with_gathered(x, route, tokens, top_k, experts, |src| {
            self.quant_act_rows(src, w, rows, k, "grouped_qlinear")
        })?;
        self.grouped_qlinear_on(&act, w, &route.offsets, experts, rows, k, n, y)
    }

    fn keeps_forward_operand(&self, spec: &LinearSpec, k: usize) -> bool {
        // MXFP8's `dequantized` wgrad multiplies exactly the forward's activation operand
        // (the BF16 of its contract dequantization, every row quantized alone); `lowp`'s the
        // column-wise copy, which the forward's quantizer makes from the same read where the
        // width takes its tiles. NVFP4's `dequantized` (per-token scales) multiplies the three
        // BF16 parts of the rows' contract dequantization, which its quantizer writes too.
        self.keep_operands.get()
            && match (spec.format(), spec.backward()) {
                (Format::Mxfp8, BackwardMode::Dequantized) => true,
                (Format::Mxfp8, BackwardMode::Lowp) => QLinear::rowcol_fits(k),
                (Format::Nvfp4, BackwardMode::Dequantized) => {
                    spec.act_scaling() == ActScaling::PerToken
                }
                _ => false,
            }
    }

    fn grouped_qlinear_gathered_kept(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        host_offsets: &[u32],
        tokens: usize,
        top_k: usize,
        w: &QExperts,
        experts: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<Self::Bf16> {
        let rows = tokens * top_k;
        let (act, kept) = with_gathered(x, route, tokens, top_k, experts, |src| {
            self.kept_operands(src, w, host_offsets, rows, k, "gathered")
        })?;
        self.grouped_qlinear_on(&act, w, &route.offsets, experts, rows, k, n, y)?;
        Ok(kept.unwrap_or(act.xq))
    }

    fn grouped_qlinear_swiglu_kept(
        &self,
        gu: &Self::F32,
        w: &QExperts,
        offsets: &Self::U32,
        host_offsets: &[u32],
        experts: usize,
        rows: usize,
        f: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<Self::Bf16> {
        let guv = gu.as_view();
        let src = ActRows::Swiglu(&guv);
        let (act, kept) = self.kept_operands(&src, w, host_offsets, rows, f, "swiglu")?;
        self.grouped_qlinear_on(&act, w, offsets, experts, rows, f, n, y)?;
        Ok(kept.unwrap_or(act.xq))
    }

    fn qlinear_backward_operand(
        &self,
        x: &Self::F32,
        spec: &LinearSpec,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
    ) -> DResult<Self::Bf16> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if !self.keeps_forward_operand(spec, k) {
            return Err(dev(format!(
                "qlinear_backward_operand: no operand is kept for {:?} with the {} backward \
                 at {k} columns",
                spec.format(),
                spec.backward().name()
            )));
        }
        if x.len() < rows * k {
            return Err(dev(format!(
                "qlinear_backward_operand x: {} elements, {} needed",
                x.len(),
                rows * k
            )));
        }
        self.wgrad_x_operand(&x.slice(0..rows * k), spec, None, host_offsets, rows, k)
    }

    fn grouped_qlinear_swiglu(
        &self,
        gu: &Self::F32,
        w: &QExperts,
        offsets: &Self::U32,
        experts: usize,
        rows: usize,
        f: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        if !matches!(w.format, Format::Mxfp8 | Format::Nvfp4) {
            return swiglu_then_grouped_qlinear(self, gu, w, offsets, experts, rows, f, n, y);
        }
        let guv = gu.as_view();
        let act = self.quant_act_rows(&ActRows::Swiglu(&guv), w, rows, f, "grouped_qlinear")?;
        self.grouped_qlinear_on(&act, w, offsets, experts, rows, f, n, y)
    }

    fn quantize_weights(
        &self,
        master: &Self::F32,
        groups: usize,
        n: usize,
        k: usize,
        spec: LinearSpec,
        name: &(dyn Fn(usize) -> String + Sync),
        _version: u64, // the stored weights on the device carry no version tag
    ) -> DResult<QExperts> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        // MXFP8 blocks run along K inside a row, so the stack quantizes as one tensor on the
        // device (the same bytes as each weight alone). NVFP4 has one amax per weight: each is
        // quantized alone on the device and the bytes are laid out back to back.
        if spec.format() == Format::Nvfp4 {
            return self.quantize_nvfp4_groups(master, groups, n, k, spec, name);
        }
        if spec.format() == Format::Fp8Block {
            return self.fp8_quantize_weights(master, groups, n, k, spec, name);
        }
        if spec.format() != Format::Mxfp8 {
            return Err(dev(format!(
                "quantize_weights {}: {:?} has no device kernels (MXFP8, NVFP4 and FP8 block do)",
                name(0),
                spec.format()
            )));
        }
        let ql = self
            .qlin
            .as_ref()
            .map_err(|e| dev(format!("{}: the quantizers did not load: {e}", name(0))))?;
        let len = groups * n * k;
        if master.len() < len {
            return Err(dev(format!(
                "quantize_weights {}: master of {} values for [{groups}·{n}, {k}]",
                name(0),
                master.len()
            )));
        }
        let scheme = spec.weight_scheme().expect("MXFP8 has a weight scheme");
        let quant = ql.quantizer();
        let mut q = quant
            .alloc_quantized([groups * n, k], scheme)
            .map_err(|e| dev(format!("{}: {e}", name(0))))?;
        quant
            .quantize_view_into(
                &InputView::F32(master.slice(0..len)),
                [groups * n, k],
                scheme,
                &mut q,
            )
            .map_err(|e| dev(format!("{}: {e}", name(0))))?;
        // Once per weight version: may the fragment kernels take the fast decode?
        let fast_decode = match self.qgemm.as_ref() {
            Ok(g) => g
                .mxfp8_fast_check(&q.data.as_view(), &q.scales.as_view())
                .map_err(de)?,
            Err(_) => false,
        };
        Ok(QExperts {
            format: Format::Mxfp8,
            e: groups,
            n,
            k,
            codes: q.data,
            scales: q.scales,
            amax: self.gpu.zeros::<f32>(1).map_err(de)?,
            spec,
            fast_decode: FastDecode::known(fast_decode),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    fn copy_qweights(&self, w: &QExperts) -> DResult<QExperts> {
        let s = self.gpu.stream();
        let e =
            |x: cudarc::driver::DriverError| DeviceError::new(self.gpu.name(), format!("{x:?}"));
        Ok(QExperts {
            format: w.format,
            e: w.e,
            n: w.n,
            k: w.k,
            codes: s.clone_dtod(&w.codes).map_err(e)?,
            scales: s.clone_dtod(&w.scales).map_err(e)?,
            amax: s.clone_dtod(&w.amax).map_err(e)?,
            spec: w.spec,
            fast_decode: FastDecode::known(w.fast_decode.get(&self.gpu).map_err(de)? == Some(true)),
            train: std::cell::OnceCell::new(),
            serve: std::cell::OnceCell::new(),
        })
    }

    fn checksum_qweights(&self, w: &QExperts, out: &mut Self::U32, slot: usize) -> DResult<()> {
        let (nc, ns) = (w.codes.len(), w.scales.len());
        self.ew
            .checksum_u8(&w.codes.as_view(), nc, 0, &mut out.as_view_mut(), slot)
            .map_err(de)?;
        self.ew
            .checksum_u8(&w.scales.as_view(), ns, nc, &mut out.as_view_mut(), slot)
            .map_err(de)?;
        if w.format == Format::Nvfp4 {
            self.ew
                .checksum_f32_bytes(&w.amax, nc + ns, &mut out.as_view_mut(), slot)
                .map_err(de)?;
        }
        Ok(())
    }

    fn stored_weights(&self, w: &QExperts) -> DResult<Vec<mxrl_formats::QuantizedTensor>> {
        if w.format == Format::Fp8Block {
            return self.fp8_stored_weights(w);
        }
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        let scheme = w
            .spec
            .weight_scheme()
            .ok_or_else(|| dev(format!("stored_weights: {:?} has no stored form", w.spec)))?;
        let codes = self.gpu.download(&w.codes).map_err(de)?;
        let scales = self.gpu.download(&w.scales).map_err(de)?;
        let amax = self.gpu.download(&w.amax).map_err(de)?;
        let (cg, sg) = (codes.len() / w.e.max(1), scales.len() / w.e.max(1));
        (0..w.e)
            .map(|g| {
                let q = mxrl_formats::QuantizedTensor {
                    scheme,
                    shape: vec![w.n, w.k],
                    padded_shape: vec![w.n, w.k],
                    data: codes[g * cg..(g + 1) * cg].to_vec(),
                    scales: mxrl_formats::Scales::Bytes(scales[g * sg..(g + 1) * sg].to_vec()),
                    scale_layout: mxrl_formats::ScaleLayout::Compact,
                    amax: if w.format == Format::Nvfp4 {
                        vec![amax[g]]
                    } else {
                        Vec::new()
                    },
                };
                q.validate()
                    .map_err(|e| dev(format!("stored weight {g}: {e}")))?;
                Ok(q)
            })
            .collect()
    }

    fn qlinear(
        &self,
        x: &Self::F32,
        w: &QExperts,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if w.format == Format::Fp8Block {
            return self.fp8_forward(x, w, None, 1, rows, k, n, y);
        }
        if (w.e, w.n, w.k) != (1, n, k) {
            return Err(dev(format!(
                "qlinear: weight stored as [{}, {}, {}], called as a dense [{n}, {k}]",
                w.e, w.n, w.k
            )));
        }
        match w.format {
            Format::Mxfp8 => {
                let xv = x.as_view();
                let act = self.quant_act_rows(&ActRows::Rows(&xv), w, rows, k, "qlinear")?;
                self.mxfp8_dense_on(&act.xq, w, rows, k, n, y)
            }
            other => Err(dev(format!(
                "qlinear: no dense device path for {other:?} (block-format dense linears run \
                 MXFP8 and FP8 block on the device)"
            ))),
        }
    }

    fn qlinear_shared(
        &self,
        x: &Self::F32,
        rows: usize,
        k: usize,
        outs: &mut [(&QExperts, usize, &mut Self::F32)],
    ) -> DResult<()> {
        let dense = |f: Format| {
            outs.iter()
                .all(|(w, n, _)| (w.format, w.e, w.n, w.k) == (f, 1, *n, k))
        };
        if outs.len() > 1 && dense(Format::Mxfp8) {
            let xv = x.as_view();
            let act = self.quant_act_rows(&ActRows::Rows(&xv), outs[0].0, rows, k, "qlinear")?;
            for (w, n, y) in outs.iter_mut() {
                self.mxfp8_dense_on(&act.xq, w, rows, k, *n, y)?;
            }
            return Ok(());
        }
        if outs.len() > 1 && dense(Format::Fp8Block) {
            return self.fp8_forward_shared(x, rows, k, outs);
        }
        for (w, n, y) in outs.iter_mut() {
            self.qlinear(x, w, rows, k, *n, y)?;
        }
        Ok(())
    }

    /// All groups at once, in one launch per GEMM (cuBLAS for a dense linear, the grouped
    /// tensor-core kernels for experts), on exactly the CPU layer's operands
    /// ([`mxrl_tensor::qlinear`], `ops::qlinear` module doc), every one a BF16 number, so the
    /// products are the CPU's and only the f32 summation order differs:
    /// - `HighPrecision`: dgrad `bf16(dy)·bf16(W)`, wgrad `bf16(dy)ᵀ·bf16(x)`.
    /// - `Dequantized`: `bf16(dy)` times the contract dequantization of the stored `W` and of
    ///   the forward's quantized `x` (re-quantized here: the same bytes). NVFP4's `x̂` has up
    ///   to 24 significant bits and its wgrad runs on three BF16 parts; its dgrad multiplies
    ///   the weights' exact `e2m1 × e4m3` values and applies each weight's per-tensor factor
    ///   to the sum (`QGemm::nvfp4_weight_factor_rows`).
    /// - `Lowp` (MXFP8): dgrad `q_row(dy)·q_col(W)`, wgrad `q_col(dy)ᵀ·q_col(x)`, the
    ///   column-wise blocks of `x` and `dy` starting at each group's first row (each group is
    ///   its own tensor, as on the CPU), those of `W` at each weight's first row.
    ///
    /// The weights' operand is made once per weight version (`QExperts::train`).
    fn grouped_qlinear_backward(
        &self,
        x: SavedX<'_, Self::F32, Self::Bf16>,
        w: &QExperts,
        master: &Self::F32,
        master_bf16: Option<&Self::Bf16>,
        dy: OutGrad<'_, Self::F32, Self::Bf16>,
        dev_offsets: Option<&Self::U32>,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        let ql = self.qlin.as_ref().map_err(|e| {
            dev(format!(
                "grouped_qlinear_backward: the quantized linear did not load: {e}"
            ))
        })?;
        let q = self.qgemm.as_ref().map_err(|e| {
            dev(format!(
                "grouped_qlinear_backward: the low-byte kernels did not load: {e}"
            ))
        })?;
        let groups = w.e;
        if (w.n, w.k) != (n, k) || host_offsets.len() != groups + 1 {
            return Err(dev(format!(
                "grouped_qlinear_backward: weights [{groups}, {}, {}] with {} offsets, called \
                 with [{n}, {k}]",
                w.n,
                w.k,
                host_offsets.len()
            )));
        }
        let dy_len = match dy {
            OutGrad::F32(d) => d.len(),
            OutGrad::Bf16(d) => d.len(),
        };
        let x_len = match x {
            SavedX::F32(x) => x.len(),
            SavedX::Bf16(x) | SavedX::Operand(x) => x.len(),
        };
        for (what, got, want) in [
            ("x", x_len, rows * k),
            ("dy", dy_len, rows * n),
            ("dx", dx.len(), rows * k),
            ("dw", dw.len(), groups * n * k),
            ("master", master.len(), groups * n * k),
            (
                "master_bf16",
                master_bf16.map_or(groups * n * k, |b| b.len()),
                groups * n * k,
            ),
        ] {
            if got < want {
                return Err(dev(format!(
                    "grouped_qlinear_backward {what}: {got} elements, {want} needed"
                )));
            }
        }
        if host_offsets.windows(2).any(|o| o[0] > o[1]) || host_offsets[groups] as usize > rows {
            return Err(dev(format!(
                "grouped_qlinear_backward: offsets {host_offsets:?} not increasing within 0..{rows}"
            )));
        }
        let (mode, format) = (w.spec.backward(), w.format);
        if format == Format::Nvfp4 && w.spec.act_scaling() != ActScaling::PerToken {
            return Err(dev(
                "grouped_qlinear_backward: NVFP4 with per-tensor activation scaling has no \
                 device path"
                    .into(),
            ));
        }
        let wlen = groups * n * k;
        // The weights' dgrad operand (parts × [E, N, K] BF16): the high-precision mode's is
        // the caller's BF16 copy of the master where it keeps one (the bits `bf16(master)`
        // gives), MXFP8's dequantized one the forward operand the optimizer's pass wrote (the
        // bits `experts_bf16` gives); otherwise made once per weight version.
        let kept = match (mode, master_bf16, format) {
            (BackwardMode::HighPrecision, Some(b), _) => Some(b),
            (BackwardMode::Dequantized, _, Format::Mxfp8) => w.serve.get(),
            _ => None,
        };
        if kept.is_none() && w.train.get().is_none() {
            let op = match (mode, format) {
                (BackwardMode::HighPrecision, _) => self.bf16(master, wlen)?,
                // NVFP4: `e2m1 × e4m3` (exact in BF16); the weight's per-tensor factor
                // follows the dgrad's sum.
                (BackwardMode::Dequantized, Format::Mxfp8 | Format::Nvfp4) => {
                    self.experts_bf16(q, w)?
                }
                (BackwardMode::Lowp, Format::Mxfp8) => {
                    let per_weight: Vec<u32> = (0..=groups).map(|g| (g * n) as u32).collect();
                    let segs = ql.col_segments(&per_weight, groups * n).map_err(de)?;
                    ql.mxfp8_col_groups_bf16(&master.slice(0..wlen), &segs, k)
                        .map_err(de)?
                }
                (m, f) => {
                    return Err(dev(format!(
                        "grouped_qlinear_backward: no device path for {f:?} with the {} \
                         backward",
                        m.name()
                    )))
                }
            };
            let _ = w.train.set(op);
        }
        // One `[E, N, K]` BF16 operand in every mode (the products are exact in BF16).
        let wop = match kept {
            Some(b) => b,
            None => w.train.get().expect("set above"),
        };
        // The grouped kernels read the offsets on the device: the caller's, else uploaded.
        let uploaded;
        let offsets = match (groups == 1, dev_offsets) {
            (true, _) => None,
            (false, Some(o)) => {
                if o.len() < groups + 1 {
                    return Err(dev(format!(
                        "grouped_qlinear_backward: {} device offsets for {groups} groups",
                        o.len()
                    )));
                }
                Some(o)
            }
            (false, None) => {
                uploaded = self.gpu.upload(host_offsets).map_err(de)?;
                Some(&uploaded)
            }
        };
        let s = Grouped {
            experts: groups,
            rows,
            n,
            k,
        };
        let (r0, r1) = (host_offsets[0] as usize, host_offsets[groups] as usize);
        // dx = a · W (overwrites the groups' rows); dW += b ᵀ · c.
        let dgrad = |a: &CudaSlice<u16>, dx: &mut CudaSlice<f32>| -> DResult<()> {
            let wp = wop.slice(0..wlen);
            match &offsets {
                None => {
                    let (a, mut d) = (a.slice(r0 * n..r1 * n), dx.slice_mut(r0 * k..r1 * k));
                    self.gemm.dense_nn(&a, &wp, &mut d, r1 - r0, n, k)
                }
                Some(o) => {
                    self.gemm
                        .grouped_nn(&a.as_view(), &wp, &o.as_view(), &mut dx.as_view_mut(), s)
                }
            }
            .map_err(de)
        };
        // dW is still to be zeroed (`GradWrite::Overwrite`) until the first wgrad writes it.
        let dw_pending = Cell::new(dw_write == GradWrite::Overwrite);
        // dW += bᵀ · Σ_p c_p over `parts` stacked [rows, k] parts of c: grouped, one sum over
        // every part's rows, added once; dense (one group), one cuBLAS pass per part.
        let wgrad_parts =
            |b: &CudaSlice<u16>, c: &CudaView<'_, u16>, parts: usize, dw: &mut CudaSlice<f32>| {
                let overwrite = dw_pending.replace(false);
                match &offsets {
                    None => {
                        if overwrite {
                            self.fill_zero(dw, n * k)?;
                        }
                        for p in 0..parts {
                            let part = p * rows * k;
                            self.gemm
                                .dense_tn(
                                    &b.slice(r0 * n..r1 * n),
                                    &c.slice(part + r0 * k..part + r1 * k),
                                    &mut dw.slice_mut(0..n * k),
                                    r1 - r0,
                                    n,
                                    k,
                                )
                                .map_err(de)?;
                        }
                        Ok(())
                    }
                    Some(o) => self
                        .gemm
                        .grouped_tn_parts(
                            &b.as_view(),
                            c,
                            &o.as_view(),
                            &mut dw.as_view_mut(),
                            s,
                            parts,
                            if overwrite {
                                GradWrite::Overwrite
                            } else {
                                GradWrite::Accumulate
                            },
                        )
                        .map_err(de),
                }
            };
        let wgrad = |b: &CudaSlice<u16>, c: &CudaView<'_, u16>, dw: &mut CudaSlice<f32>| {
            wgrad_parts(b, c, 1, dw)
        };
        if r0 == r1 {
            if dw_pending.get() {
                self.fill_zero(dw, wlen)?;
            }
            return Ok(());
        }
        // bf16(dy) for the modes that take no other: as handed over, else rounded here.
        let made_dyb;
        let dyb = match dy {
            OutGrad::Bf16(d) if w.spec.rounds_dy_to_bf16() => Some(d),
            OutGrad::Bf16(_) => {
                return Err(dev(format!(
                    "grouped_qlinear_backward: the {} backward takes dy in f32",
                    mode.name()
                )))
            }
            OutGrad::F32(d) if w.spec.rounds_dy_to_bf16() => {
                made_dyb = self.bf16(d, rows * n)?;
                Some(&made_dyb)
            }
            OutGrad::F32(_) => None,
        };
        let dyb = || dyb.ok_or_else(|| dev("grouped_qlinear_backward: no bf16(dy)".into()));
        // x: f32 for the modes that quantize it; bf16(x), as handed over or rounded here, for
        // the high-precision one.
        let (x, xb, kept_x) = match x {
            SavedX::F32(x) => (Some(x), None, None),
            SavedX::Bf16(xb) if w.spec.rounds_x_to_bf16() => (None, Some(xb), None),
            SavedX::Bf16(_) => {
                return Err(dev(format!(
                    "grouped_qlinear_backward: the {} backward takes x in f32",
                    mode.name()
                )))
            }
            SavedX::Operand(o) if self.keeps_forward_operand(&w.spec, k) => (None, None, Some(o)),
            SavedX::Operand(_) => {
                return Err(dev(format!(
                    "grouped_qlinear_backward: no forward operand is kept for {format:?} with \
                     the {} backward",
                    mode.name()
                )))
            }
        };
        let x = || x.ok_or_else(|| dev("grouped_qlinear_backward: no f32 x".into()));
        match (mode, format) {
            (BackwardMode::Lowp, _) => {
                let OutGrad::F32(dy) = dy else {
                    unreachable!("refused above")
                };
                let segs = ql.col_segments(host_offsets, rows).map_err(de)?;
                let dy = dy.slice(0..rows * n);
                let mut dyr = self.gpu.empty::<u16>(rows * n).map_err(de)?;
                // dy's row-wise (dgrad) and column-wise (wgrad) operands from one read of it
                // where the width takes the tiles, else one pass each.
                let dyc = if QLinear::rowcol_fits(n) {
                    ql.mxfp8_rowcol_groups_bf16(
                        &ActRows::Rows(&dy),
                        &segs,
                        n,
                        &mut dyr.as_view_mut(),
                    )
                    .map_err(de)?
                } else {
                    q.quant_act_mxfp8(&dy, rows, n, &mut dyr.as_view_mut())
                        .map_err(de)?;
                    ql.mxfp8_col_groups_bf16(&dy, &segs, n).map_err(de)?
                };
                dgrad(&dyr, dx)?;
                drop(dyr);
                // The forward's column-wise copy of x where it was kept, else made here.
                if let Some(xc) = kept_x {
                    return wgrad(&dyc, &xc.slice(0..rows * k), dw);
                }
                let xv = x()?.slice(0..rows * k);
                let xc = self.wgrad_x_operand(&xv, &w.spec, Some(&segs), host_offsets, rows, k)?;
                wgrad(&dyc, &xc.as_view(), dw)
            }
            (BackwardMode::HighPrecision, _) => {
                dgrad(dyb()?, dx)?;
                let made;
                let xb = match xb {
                    Some(b) => b,
                    None => {
                        made = self.bf16(x()?, rows * k)?;
                        &made
                    }
                };
                wgrad(dyb()?, &xb.slice(0..rows * k), dw)
            }
            (BackwardMode::Dequantized, Format::Mxfp8) => {
                dgrad(dyb()?, dx)?;
                // The forward's operand where it was kept, else the same bytes again.
                if let Some(xq) = kept_x {
                    return wgrad(dyb()?, &xq.slice(0..rows * k), dw);
                }
                let xv = x()?.slice(0..rows * k);
                let xq = self.wgrad_x_operand(&xv, &w.spec, None, host_offsets, rows, k)?;
                wgrad(dyb()?, &xq.as_view(), dw)
            }
            (BackwardMode::Dequantized, _) => {
                // dx = g(W) · (bf16(dy) · (e2m1 × e4m3)) per group: the contract's f32 values
                // Ŵ = fl(e2m1 · fl(fl(sf · amax) · R2688)) with the factor taken out of the
                // sum (each product's relative change below 4u, then one rounding of the sum),
                // applied in the GEMM's stores where the shape takes the `wgmma` tile.
                let stored = match &offsets {
                    Some(o) => self
                        .gemm
                        .grouped_nn_wfactor(
                            &dyb()?.as_view(),
                            &wop.slice(0..wlen),
                            &o.as_view(),
                            &mut dx.as_view_mut(),
                            s,
                            &w.amax.as_view(),
                        )
                        .map_err(de)?,
                    None => false,
                };
                if !stored {
                    dgrad(dyb()?, dx)?;
                    let dense_offsets;
                    let offs = match &offsets {
                        Some(o) => *o,
                        None => {
                            dense_offsets = self.gpu.upload(host_offsets).map_err(de)?;
                            &dense_offsets
                        }
                    };
                    q.nvfp4_weight_factor_rows(
                        &mut dx.as_view_mut(),
                        &w.amax.as_view(),
                        &offs.as_view(),
                        Grouped {
                            experts: groups,
                            rows,
                            n: k,
                            k: n,
                        },
                    )
                    .map_err(de)?;
                }
                // x's three BF16 parts: the forward's where it kept them, else made here.
                let made;
                let xp = match kept_x {
                    Some(xp) if xp.len() < 3 * rows * k => {
                        return Err(dev(format!(
                            "grouped_qlinear_backward: a kept NVFP4 operand of {} elements, \
                             3 parts of {rows} × {k} needed",
                            xp.len()
                        )))
                    }
                    Some(xp) => xp,
                    None => {
                        let xv = x()?.slice(0..rows * k);
                        made = self.wgrad_x_operand(&xv, &w.spec, None, host_offsets, rows, k)?;
                        &made
                    }
                };
                // One wgrad over the three parts: a single sum per output, dW written once.
                wgrad_parts(dyb()?, &xp.slice(0..3 * rows * k), 3, dw)
            }
        }
    }

    fn gather_f32(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .gather(
                &x.as_view(),
                &route.perm.as_view(),
                &route.offsets.as_view(),
                &mut out.as_view_mut(),
                n,
                h,
                e,
                top_k,
            )
            .map_err(de)
    }

    fn swiglu_f32(
        &self,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.swiglu
            .forward(&gu.as_view(), &mut out.as_view_mut(), None, rows, f)
            .map_err(de)
    }

    fn empty_u32(&self, n: usize) -> DResult<Self::U32> {
        self.gpu.empty(n).map_err(de)
    }

    fn zeros_u32(&self, n: usize) -> DResult<Self::U32> {
        self.gpu.zeros(n).map_err(de)
    }

    fn write_u32(&self, dst: &mut Self::U32, v: &[u32]) -> DResult<()> {
        self.gpu.write(dst, v).map_err(de)
    }

    fn sample(
        &self,
        logits: &Self::F32,
        rows: usize,
        v: usize,
        p: &SampleParams,
        tokens: &mut Self::U32,
        logprobs: &mut Self::F32,
    ) -> DResult<()> {
        p.validate()
            .map_err(|m| DeviceError::new(self.gpu.name(), format!("sample: {m}")))?;
        self.sampler
            .sample(
                &logits.as_view(),
                rows,
                v,
                p,
                &mut tokens.as_view_mut(),
                &mut logprobs.as_view_mut(),
            )
            .map_err(de)
    }

    fn begin_capture(&self) -> DResult<bool> {
        self.gpu.begin_capture().map_err(de)?;
        Ok(true)
    }

    fn end_capture(&self) -> DResult<Option<Self::Graph>> {
        self.gpu.end_capture().map_err(de)
    }

    fn launch_graph(&self, g: &Self::Graph) -> DResult<()> {
        g.launch()
            .map_err(|x| DeviceError::new(self.gpu.name(), format!("graph launch: {x:?}")))
    }

    fn zeros_f32(&self, n: usize) -> DResult<Self::F32> {
        self.gpu.zeros(n).map_err(de)
    }

    fn zeros_bf16(&self, n: usize) -> DResult<Self::Bf16> {
        self.gpu.zeros(n).map_err(de)
    }

    fn upload_f32(&self, v: &[f32]) -> DResult<Self::F32> {
        self.gpu.upload(v).map_err(de)
    }

    fn upload_u32(&self, v: &[u32]) -> DResult<Self::U32> {
        self.gpu.upload(v).map_err(de)
    }

    fn download_f32(&self, b: &Self::F32, n: usize) -> DResult<Vec<f32>> {
        let r = self.gpu.download(&b.slice(0..n)).map_err(de);
        self.note_memory();
        r
    }

    fn download_u32(&self, b: &Self::U32, n: usize) -> DResult<Vec<u32>> {
        self.gpu.download(&b.slice(0..n)).map_err(de)
    }

    fn download_f32_with(&self, b: &Self::F32, n: usize, f: &mut dyn FnMut(&[f32])) -> DResult<()> {
        let r = self.download_with(b, n, f);
        self.note_memory();
        r
    }

    fn download_u32_with(&self, b: &Self::U32, n: usize, f: &mut dyn FnMut(&[u32])) -> DResult<()> {
        self.download_with(b, n, f)
    }

    fn copy_bf16(&self, src: &Self::Bf16, dst: &mut Self::Bf16, n: usize) -> DResult<()> {
        if src.len() < n || dst.len() < n {
            return Err(de(self.gpu.err(format!(
                "copy_bf16 of {n} elements: source {}, destination {}",
                src.len(),
                dst.len()
            ))));
        }
        self.gpu
            .stream()
            .memcpy_dtod(&src.slice(0..n), &mut dst.slice_mut(0..n))
            .map_err(|e| de(self.gpu.err(format!("copy_bf16: {e:?}"))))
    }

    fn copy_blocks_bf16(
        &self,
        src: &Self::Bf16,
        dst: &mut Self::Bf16,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        self.eng
            .copy_blocks_u16(
                &src.as_view(),
                &mut dst.as_view_mut(),
                &map.as_view(),
                block,
                count,
            )
            .map_err(de)
    }

    fn copy_blocks_f32(
        &self,
        src: &Self::F32,
        dst: &mut Self::F32,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        self.eng
            .copy_blocks_u32(
                &src.as_view(),
                &mut dst.as_view_mut(),
                &map.as_view(),
                block,
                count,
            )
            .map_err(de)
    }

    fn copy_blocks_u32(
        &self,
        src: &Self::U32,
        dst: &mut Self::U32,
        map: &Self::U32,
        block: usize,
        count: usize,
    ) -> DResult<()> {
        self.eng
            .copy_blocks_u32(
                &src.as_view(),
                &mut dst.as_view_mut(),
                &map.as_view(),
                block,
                count,
            )
            .map_err(de)
    }

    fn widen_bf16(&self, x: &Self::Bf16, out: &mut Self::F32, n: usize) -> DResult<()> {
        self.ew
            .widen_bf16(&x.as_view(), &mut out.as_view_mut(), n)
            .map_err(de)
    }

    fn checksum_bf16(
        &self,
        x: &Self::Bf16,
        n: usize,
        out: &mut Self::U32,
        slot: usize,
    ) -> DResult<()> {
        self.ew
            .checksum_bf16(&x.as_view(), n, &mut out.as_view_mut(), slot)
            .map_err(de)
    }

    fn upload_bf16_bytes(&self, bytes: &[u8]) -> DResult<Self::Bf16> {
        if !bytes.len().is_multiple_of(2) {
            return Err(DeviceError::new(
                self.gpu.name(),
                format!(
                    "upload_bf16_bytes: {} bytes is not 2 per value",
                    bytes.len()
                ),
            ));
        }
        // BF16 values are their little-endian bytes on the host and on the device.
        self.gpu.upload_staged::<u16>(&[bytes]).map_err(de)
    }

    fn download_bf16(&self, b: &Self::Bf16, n: usize) -> DResult<Vec<u16>> {
        self.gpu.download(&b.slice(0..n)).map_err(de)
    }

    fn round_bf16(&self, x: &Self::F32, out: &mut Self::F32, n: usize) -> DResult<()> {
        self.ew
            .round_bf16(&x.as_view(), &mut out.as_view_mut(), n)
            .map_err(de)
    }

    fn rope_table(&self, max_pos: usize, head_dim: usize, theta: f64) -> DResult<Self::Rope> {
        RopeDeviceTable::new(&self.gpu, max_pos, head_dim, theta).map_err(de)
    }

    fn to_bf16(&self, x: &Self::F32, out: &mut Self::Bf16, n: usize) -> DResult<()> {
        self.ew
            .to_bf16(&x.as_view(), &mut out.as_view_mut(), n)
            .map_err(de)
    }

    fn add(&self, y: &mut Self::F32, x: &Self::F32, n: usize) -> DResult<()> {
        self.ew
            .add_inplace(&mut y.as_view_mut(), &x.as_view(), n)
            .map_err(de)
    }

    fn add_bias(&self, y: &mut Self::F32, b: &Self::F32, rows: usize, n: usize) -> DResult<()> {
        self.eng
            .add_bias(&mut y.as_view_mut(), &b.as_view(), rows, n)
            .map_err(de)
    }

    fn embed(
        &self,
        table: &Self::F32,
        vocab: usize,
        tokens: &Self::U32,
        rows: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.ew
            .embed_gather(
                &table.as_view(),
                vocab,
                &tokens.as_view(),
                &mut out.as_view_mut(),
                rows,
                h,
            )
            .map_err(de)
    }

    fn rmsnorm(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        rows: usize,
        d: usize,
        eps: f32,
        y: &mut Self::F32,
        rstd: &mut Self::F32,
    ) -> DResult<()> {
        self.norm
            .forward(
                &x.as_view(),
                &w.as_view(),
                &mut y.as_view_mut(),
                &mut rstd.as_view_mut(),
                rows,
                d,
                eps,
            )
            .map_err(de)
    }

    fn rope(
        &self,
        x: &mut Self::F32,
        rows: usize,
        heads: usize,
        _head_dim: usize,
        pos: &Self::U32,
        table: &Self::Rope,
    ) -> DResult<()> {
        self.rope
            .forward(&mut x.as_view_mut(), &pos.as_view(), rows, heads, table)
            .map_err(de)
    }

    fn linear(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        m: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        if small_m_dense(m, k, &[n]) {
            return self
                .gemm
                .dense_nt_small_m(
                    &x.as_view(),
                    m,
                    k,
                    &mut [(&w.as_view(), n, &mut y.as_view_mut())],
                )
                .map_err(de);
        }
        if let (true, Ok(q)) = (self.dense_frag.get().takes(m, k, &[n]), &self.qgemm) {
            return q
                .dense_nt_frag_bf16_multi(
                    &x.as_view(),
                    &self.whole_rows.as_view(),
                    &mut [(&w.as_view(), n, &mut y.as_view_mut())],
                    m,
                    k,
                )
                .map_err(de);
        }
        self.gemm
            .dense_nt(&x.as_view(), &w.as_view(), &mut y.as_view_mut(), m, n, k)
            .map_err(de)
    }

    fn linear_shared(
        &self,
        x: &Self::Bf16,
        m: usize,
        k: usize,
        outs: &mut [(&Self::Bf16, usize, &mut Self::F32)],
    ) -> DResult<()> {
        let ns: Vec<usize> = outs.iter().map(|o| o.1).collect();
        if outs.len() <= DENSE_SMALL_M_OUTPUTS && small_m_dense(m, k, &ns) {
            // One launch; each output is summed as `linear` sums it alone.
            return with_small_m_views(outs, |args| {
                self.gemm.dense_nt_small_m(&x.as_view(), m, k, args)
            })
            .map_err(de);
        }
        if let (true, Ok(q)) = (self.dense_frag.get().takes(m, k, &ns), &self.qgemm) {
            // One launch; each output has the bits of a launch of its weight alone on these
            // kernels (not of `linear`, which takes cuBLAS below `min_cols`).
            return with_small_m_views(outs, |args| {
                q.dense_nt_frag_bf16_multi(&x.as_view(), &self.whole_rows.as_view(), args, m, k)
            })
            .map_err(de);
        }
        for (w, n, y) in outs.iter_mut() {
            self.linear(x, w, m, k, *n, y)?;
        }
        Ok(())
    }

    fn rmsnorm_linear_shared(
        &self,
        x: &Self::F32,
        w: &Self::F32,
        eps: f32,
        m: usize,
        k: usize,
        outs: &mut [(&Self::Bf16, usize, &mut Self::F32)],
    ) -> DResult<()> {
        let ns: Vec<usize> = outs.iter().map(|o| o.1).collect();
        if outs.len() <= DENSE_SMALL_M_OUTPUTS
            && norm_small_m_shape(m, k, &ns, Gemm::rmsnorm_small_m_smem(m, k))
        {
            return with_small_m_views(outs, |args| {
                self.gemm
                    .rmsnorm_dense_nt_small_m(&x.as_view(), &w.as_view(), eps, m, k, args)
            })
            .map_err(de);
        }
        rmsnorm_then_linear_shared(self, x, w, eps, m, k, outs)
    }

    fn add_rmsnorm_linear(
        &self,
        (o, res, x): (&mut Self::F32, &Self::F32, &mut Self::F32),
        w: &Self::F32,
        (rows, d, eps): (usize, usize, f32),
        (y, yb, rstd): (Option<&mut Self::F32>, &mut Self::Bf16, &mut Self::F32),
        (lw, n, out): (&Self::Bf16, usize, &mut Self::F32),
    ) -> DResult<()> {
        // Where `linear` takes the small-M kernel and the norm the 256-thread block: one
        // launch with both ops' bits.
        if add_norm_router_fused()
            && rows <= 8
            && norm_small_m_shape(rows, d, &[n], Gemm::add_rmsnorm_small_m_smem(rows, d))
        {
            let mut yv = y.map(|y| y.as_view_mut());
            return self
                .gemm
                .add_rmsnorm_dense_nt_small_m(
                    (&o.as_view(), &res.as_view()),
                    &w.as_view(),
                    eps,
                    rows,
                    d,
                    (
                        &mut x.as_view_mut(),
                        yv.as_mut(),
                        &mut yb.as_view_mut(),
                        &mut rstd.as_view_mut(),
                    ),
                    (&lw.as_view(), n, &mut out.as_view_mut()),
                )
                .map_err(de);
        }
        add_rmsnorm_then_linear(
            self,
            (o, res, x),
            w,
            (rows, d, eps),
            (y, yb, rstd),
            (lw, n, out),
        )
    }

    fn moe_gate_up_swiglu_bf16(
        &self,
        xb: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        f: usize,
        w: &Self::Bf16,
        act: &mut Self::Bf16,
    ) -> DResult<()> {
        let rows = n * top_k;
        let s = Grouped {
            experts: e,
            rows,
            n: 2 * f,
            k: h,
        };
        if moe_fused_small_m() && moe_fused_shape(s) {
            return self
                .gemm
                .grouped_gate_up_swiglu_small_m(
                    &xb.as_view(),
                    n,
                    &route.perm.as_view(),
                    top_k,
                    &w.as_view(),
                    &route.offsets.as_view(),
                    &mut act.as_view_mut(),
                    s,
                )
                .map_err(de);
        }
        gather_gate_up_swiglu_bf16(self, xb, route, n, e, top_k, h, f, w, act)
    }

    fn moe_down_combine_bf16(
        &self,
        act: &Self::Bf16,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        f: usize,
        h: usize,
        w: &Self::Bf16,
        residual: &Self::F32,
        out: &mut Self::F32,
    ) -> DResult<()> {
        let rows = n * top_k;
        let s = Grouped {
            experts: e,
            rows,
            n: h,
            k: f,
        };
        if n <= moe_down_fused_tokens() && moe_fused_shape(s) {
            return self
                .gemm
                .grouped_down_combine_small_m(
                    &act.as_view(),
                    &route.ids.as_view(),
                    &route.row_of.as_view(),
                    &route.weights.as_view(),
                    top_k,
                    &w.as_view(),
                    Some(&residual.as_view()),
                    &mut out.as_view_mut(),
                    n,
                    s,
                )
                .map_err(de);
        }
        grouped_down_then_combine_add(self, act, route, n, e, top_k, f, h, w, residual, out)
    }

    fn grouped_linear(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut Self::F32,
    ) -> DResult<()> {
        if let Some(offs) = self.per_expert_offsets(offsets, host_offsets, experts, rows)? {
            for e in 0..experts {
                let (a, b) = (offs[e] as usize, offs[e + 1] as usize);
                if a == b {
                    continue;
                }
                self.gemm
                    .dense_nt(
                        &x.slice(a * k..b * k),
                        &w.slice(e * n * k..(e + 1) * n * k),
                        &mut y.slice_mut(a * n..b * n),
                        b - a,
                        n,
                        k,
                    )
                    .map_err(de)?;
            }
            return Ok(());
        }
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        // Decode batches: the fragment kernels stream the BF16 experts into the mma operands.
        if let Ok(q) = &self.qgemm {
            if QGemm::frag_fits(n, k) && rows <= QFRAG_BF16_ROWS_PER_EXPERT * experts {
                return q
                    .grouped_nt_frag_bf16(
                        &x.as_view(),
                        &w.as_view(),
                        &offsets.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .map_err(de);
            }
        }
        self.gemm
            .grouped_nt(
                &x.as_view(),
                &w.as_view(),
                &offsets.as_view(),
                &mut y.as_view_mut(),
                s,
            )
            .map(|_| ())
            .map_err(de)
    }

    fn attention(
        &self,
        q: &Self::F32,
        k: &Self::F32,
        v: &Self::F32,
        layout: &SeqLayout,
        offsets: &Self::U32,
        shape: AttnShape,
        out: &mut Self::F32,
        lse: &mut Self::F32,
    ) -> DResult<()> {
        let max_len = layout.lens().iter().copied().max().unwrap_or(0);
        self.attn
            .forward(
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &offsets.as_view(),
                layout.num_seqs(),
                max_len,
                layout.num_tokens(),
                shape,
                &mut out.as_view_mut(),
                &mut lse.as_view_mut(),
            )
            .map_err(de)
    }

    fn decode_attn_prep(
        &self,
        q: &mut Self::F32,
        k: &mut Self::F32,
        v: &Self::F32,
        norms: Option<[&Self::F32; 2]>,
        eps: f32,
        rows: usize,
        shape: AttnShape,
        pos: &Self::U32,
        table: &Self::Rope,
        lens: &Self::U32,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()> {
        if shape.head_dim != table.head_dim() {
            return Err(DeviceError::new(
                self.gpu.name(),
                format!(
                    "decode_attn_prep: head width {} but a RoPE table of {}",
                    shape.head_dim,
                    table.head_dim()
                ),
            ));
        }
        let norm_views = norms.map(|[a, b]| (a.as_view(), b.as_view()));
        self.rope
            .decode_attn_prep(
                &mut q.as_view_mut(),
                &mut k.as_view_mut(),
                &v.as_view(),
                norm_views.as_ref().map(|(a, b)| (a, b)),
                eps,
                rows,
                (shape.q_heads, shape.kv_heads),
                &pos.as_view(),
                table,
                &lens.as_view(),
                max_len,
                (&mut k_cache.as_view_mut(), &mut v_cache.as_view_mut()),
            )
            .map_err(de)
    }

    fn kv_append(
        &self,
        k: &Self::F32,
        v: &Self::F32,
        lens: &Self::U32,
        batch: usize,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()> {
        // The kernel converts whole rows; any split of a row into heads of an even width
        // ≤ 256 gives the same bytes.
        let d = (2..=256usize)
            .rev()
            .step_by(2)
            .find(|d| kv_width.is_multiple_of(*d))
            .ok_or_else(|| {
                DeviceError::new(self.gpu.name(), format!("kv width {kv_width} is odd"))
            })?;
        let shape = AttnShape {
            q_heads: kv_width / d,
            kv_heads: kv_width / d,
            head_dim: d,
        };
        self.attn
            .kv_append(
                &k.as_view(),
                &v.as_view(),
                &mut k_cache.as_view_mut(),
                &mut v_cache.as_view_mut(),
                &lens.as_view(),
                batch,
                batch,
                max_len,
                shape,
            )
            .map_err(de)
    }

    fn kv_fill(
        &self,
        k: &Self::F32,
        v: &Self::F32,
        layout: &SeqLayout,
        kv_width: usize,
        max_len: usize,
        k_cache: &mut Self::Bf16,
        v_cache: &mut Self::Bf16,
    ) -> DResult<()> {
        if let Some(b) = layout.lens().iter().position(|&l| l > max_len) {
            return Err(DeviceError::new(
                self.gpu.name(),
                format!(
                    "sequence {b} of {} tokens exceeds the KV cache ({max_len})",
                    layout.len(b)
                ),
            ));
        }
        let mut row_seq = Vec::with_capacity(layout.num_tokens());
        let mut offs = Vec::with_capacity(layout.num_seqs());
        for b in 0..layout.num_seqs() {
            offs.push(layout.offset(b) as u32);
            row_seq.extend(std::iter::repeat_n(b as u32, layout.len(b)));
        }
        let rs = self.gpu.upload(&row_seq).map_err(de)?;
        let of = self.gpu.upload(&offs).map_err(de)?;
        self.eng
            .kv_fill(
                &k.as_view(),
                &v.as_view(),
                &rs.as_view(),
                &of.as_view(),
                &mut k_cache.as_view_mut(),
                &mut v_cache.as_view_mut(),
                layout.num_tokens(),
                layout.num_seqs(),
                kv_width,
                max_len,
            )
            .map_err(de)
    }

    fn decode_attention(
        &self,
        q: &mut Self::F32,
        k: &mut Self::F32,
        v: &Self::F32,
        norms: Option<[&Self::F32; 2]>,
        eps: f32,
        rows: usize,
        shape: AttnShape,
        pos: &Self::U32,
        table: &Self::Rope,
        lens: &Self::U32,
        max_len: usize,
        (k_cache, v_cache): (&mut Self::Bf16, &mut Self::Bf16),
        out: DecodeAttnOut<'_, Self>,
    ) -> DResult<()> {
        // Head widths the fused kernel takes, with a table of that width: one launch.
        if !Attention::fuses_decode(shape.head_dim) || table.head_dim() != shape.head_dim {
            return decode_attention_ops(
                self,
                q,
                k,
                v,
                norms,
                eps,
                rows,
                shape,
                pos,
                table,
                lens,
                max_len,
                (k_cache, v_cache),
                out,
            );
        }
        let mut scratch = self.attn_decode_scratch(rows, max_len, shape)?;
        let norm_views = norms.map(|[a, b]| (a.as_view(), b.as_view()));
        let (mut o32, mut o16);
        let outs = match out {
            DecodeAttnOut::F32(o) => {
                o32 = o.as_view_mut();
                attention::DecodeOut::F32(&mut o32)
            }
            DecodeAttnOut::Bf16(o) => {
                o16 = o.as_view_mut();
                attention::DecodeOut::Bf16(&mut o16)
            }
        };
        self.attn
            .decode_fused(
                (&q.as_view(), &k.as_view(), &v.as_view()),
                norm_views.as_ref().map(|(a, b)| (a, b)),
                eps,
                &pos.as_view(),
                table,
                &lens.as_view(),
                (rows, rows, max_len),
                shape,
                (&mut k_cache.as_view_mut(), &mut v_cache.as_view_mut()),
                &mut scratch.as_view_mut(),
                outs,
            )
            .map_err(de)
    }

    fn attention_decode(
        &self,
        q: &Self::F32,
        k_cache: &Self::Bf16,
        v_cache: &Self::Bf16,
        lens: &Self::U32,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
        out: &mut Self::F32,
    ) -> DResult<()> {
        let mut scratch = self.attn_decode_scratch(batch, max_len, shape)?;
        self.attn
            .decode(
                &q.as_view(),
                &k_cache.as_view(),
                &v_cache.as_view(),
                &lens.as_view(),
                batch,
                batch,
                max_len,
                shape,
                &mut scratch.as_view_mut(),
                &mut out.as_view_mut(),
            )
            .map_err(de)
    }

    fn attention_decode_bf16(
        &self,
        q: &Self::F32,
        k_cache: &Self::Bf16,
        v_cache: &Self::Bf16,
        lens: &Self::U32,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
        out: &mut Self::Bf16,
    ) -> DResult<()> {
        let mut scratch = self.attn_decode_scratch(batch, max_len, shape)?;
        self.attn
            .decode_bf16(
                &q.as_view(),
                &k_cache.as_view(),
                &v_cache.as_view(),
                &lens.as_view(),
                batch,
                batch,
                max_len,
                shape,
                &mut scratch.as_view_mut(),
                &mut out.as_view_mut(),
            )
            .map_err(de)
    }

    fn route(
        &self,
        logits: &Self::F32,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        replay: Option<&Self::U32>,
        out: &mut RouteBufs<Self>,
    ) -> DResult<()> {
        // Decode-sized batches: the router and the dispatch in one launch (the same bits).
        if replay.is_none()
            && route_fused()
            && n <= ROUTE_FUSED_MAX_TOKENS
            && Router::dispatch_small_fits(n, e, k)
        {
            return self
                .router
                .forward_dispatch_small(
                    &logits.as_view(),
                    &mut out.probs.as_view_mut(),
                    &mut out.ids.as_view_mut(),
                    &mut out.weights.as_view_mut(),
                    &mut out.offsets.as_view_mut(),
                    &mut out.perm.as_view_mut(),
                    &mut out.row_of.as_view_mut(),
                    n,
                    e,
                    k,
                    norm_topk_prob,
                )
                .map_err(de);
        }
        let replayed = replay.map(|r| r.as_view());
        self.router
            .forward(
                &logits.as_view(),
                match &replayed {
                    Some(r) => DeviceRouteMode::ReplayIds(r),
                    None => DeviceRouteMode::Compute,
                },
                &mut out.probs.as_view_mut(),
                &mut out.ids.as_view_mut(),
                &mut out.weights.as_view_mut(),
                n,
                e,
                k,
                norm_topk_prob,
            )
            .map_err(de)?;
        // moe_hist writes every count the scan reads: no zero fill.
        let mut scratch = self
            .gpu
            .empty::<u32>(moe::dispatch_scratch_len(n, k, e))
            .map_err(de)?;
        self.moe
            .dispatch(
                &out.ids.as_view(),
                n,
                e,
                k,
                &mut scratch.as_view_mut(),
                &mut out.offsets.as_view_mut(),
                &mut out.perm.as_view_mut(),
                &mut out.row_of.as_view_mut(),
            )
            .map_err(de)
    }

    fn capture_routes(
        &self,
        ids: &Self::U32,
        weights: &Self::F32,
        rows: usize,
        k: usize,
        seq: Option<&Self::U32>,
        pos: &Self::U32,
        slots: usize,
        max_len: usize,
        dst_ids: &mut Self::U32,
        dst_weights: &mut Self::F32,
    ) -> DResult<()> {
        let sv = seq.map(|s| s.as_view());
        self.ew
            .capture_routes(
                &ids.as_view(),
                &weights.as_view(),
                rows,
                k,
                sv.as_ref(),
                &pos.as_view(),
                slots,
                max_len,
                &mut dst_ids.as_view_mut(),
                &mut dst_weights.as_view_mut(),
            )
            .map_err(de)
    }

    fn capture_rows(
        &self,
        x: &Self::F32,
        rows: usize,
        w: usize,
        seq: Option<&Self::U32>,
        pos: &Self::U32,
        first: &Self::U32,
        slots: usize,
        len: usize,
        dst: &mut Self::F32,
    ) -> DResult<()> {
        let sv = seq.map(|s| s.as_view());
        self.ew
            .capture_rows(
                &x.as_view(),
                rows,
                w,
                sv.as_ref(),
                &pos.as_view(),
                &first.as_view(),
                slots,
                len,
                &mut dst.as_view_mut(),
            )
            .map_err(de)
    }

    fn gather_bf16(
        &self,
        x: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        e: usize,
        top_k: usize,
        h: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()> {
        self.moe
            .gather_bf16(
                &x.as_view(),
                &route.perm.as_view(),
                &route.offsets.as_view(),
                &mut out.as_view_mut(),
                n,
                h,
                e,
                top_k,
            )
            .map_err(de)
    }

    fn swiglu_bf16(
        &self,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        out: &mut Self::Bf16,
    ) -> DResult<()> {
        self.swiglu
            .forward_bf16(&gu.as_view(), &mut out.as_view_mut(), rows, f)
            .map_err(de)
    }

    fn combine(
        &self,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        k: usize,
        h: usize,
        out: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .combine(
                &y.as_view(),
                &route.weights.as_view(),
                &route.row_of.as_view(),
                &mut out.as_view_mut(),
                n,
                h,
                k,
            )
            .map_err(de)
    }

    fn head_logprobs(
        &self,
        h: &Self::Bf16,
        w: &Self::Bf16,
        targets: &Self::U32,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        logprob: &mut Self::F32,
        lse: &mut Self::F32,
        entropy: &mut Self::F32,
    ) -> DResult<()> {
        let mut lp = logprob.as_view_mut();
        let mut ls = lse.as_view_mut();
        let mut en = entropy.as_view_mut();
        self.head
            .forward(
                &h.as_view(),
                &w.as_view(),
                &targets.as_view(),
                temperature,
                HeadShape {
                    t: n,
                    h: hidden,
                    v: vocab,
                    chunk: DEFAULT_CHUNK.min(vocab.max(1)),
                },
                HeadOutputs {
                    logprob: &mut lp,
                    lse: &mut ls,
                    entropy: &mut en,
                },
            )
            .map_err(de)
    }

    fn rmsnorm_backward(
        &self,
        dy: &Self::F32,
        x: &Self::F32,
        w: &Self::F32,
        rstd: &Self::F32,
        rows: usize,
        d: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
    ) -> DResult<()> {
        let mut scratch = self
            .gpu
            .zeros::<f32>(norm::backward_scratch_len(rows, d))
            .map_err(de)?;
        self.norm
            .backward(
                &dy.as_view(),
                &x.as_view(),
                &w.as_view(),
                &rstd.as_view(),
                &mut dx.as_view_mut(),
                &mut dw.as_view_mut(),
                &mut scratch.as_view_mut(),
                rows,
                d,
            )
            .map_err(de)
    }

    fn linear_backward(
        &self,
        dy: &Self::F32,
        x: &Self::Bf16,
        w: &Self::Bf16,
        m: usize,
        k: usize,
        n: usize,
        dx: Option<&mut Self::F32>,
        dw: &mut Self::F32,
    ) -> DResult<()> {
        let dyb = self.bf16(dy, m * n)?;
        self.gemm
            .dense_tn(&dyb.as_view(), &x.as_view(), &mut dw.as_view_mut(), m, n, k)
            .map_err(de)?;
        if let Some(dx) = dx {
            self.gemm
                .dense_nn(&dyb.as_view(), &w.as_view(), &mut dx.as_view_mut(), m, n, k)
                .map_err(de)?;
        }
        Ok(())
    }

    fn grouped_linear_backward(
        &self,
        dy: &Self::F32,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()> {
        let dyb = self.bf16(dy, rows * n)?;
        self.grouped_linear_backward_bf16(
            &dyb,
            x,
            w,
            offsets,
            host_offsets,
            experts,
            rows,
            k,
            n,
            dx,
            dw,
            dw_write,
        )
    }

    fn grouped_linear_backward_bf16(
        &self,
        dyb: &Self::Bf16,
        x: &Self::Bf16,
        w: &Self::Bf16,
        offsets: &Self::U32,
        host_offsets: Option<&[u32]>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        dx: &mut Self::F32,
        dw: &mut Self::F32,
        dw_write: GradWrite,
    ) -> DResult<()> {
        if let Some(offs) = self.per_expert_offsets(offsets, host_offsets, experts, rows)? {
            if dw_write == GradWrite::Overwrite {
                self.fill_zero(dw, experts * n * k)?;
            }
            for e in 0..experts {
                let (a, b) = (offs[e] as usize, offs[e + 1] as usize);
                if a == b {
                    continue;
                }
                let dys = dyb.slice(a * n..b * n);
                self.gemm
                    .dense_tn(
                        &dys,
                        &x.slice(a * k..b * k),
                        &mut dw.slice_mut(e * n * k..(e + 1) * n * k),
                        b - a,
                        n,
                        k,
                    )
                    .map_err(de)?;
                self.gemm
                    .dense_nn(
                        &dys,
                        &w.slice(e * n * k..(e + 1) * n * k),
                        &mut dx.slice_mut(a * k..b * k),
                        b - a,
                        n,
                        k,
                    )
                    .map_err(de)?;
            }
            return Ok(());
        }
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        self.gemm
            .grouped_tn(
                &dyb.as_view(),
                &x.as_view(),
                &offsets.as_view(),
                &mut dw.as_view_mut(),
                s,
                dw_write,
            )
            .map_err(de)?;
        self.gemm
            .grouped_nn(
                &dyb.as_view(),
                &w.as_view(),
                &offsets.as_view(),
                &mut dx.as_view_mut(),
                s,
            )
            .map_err(de)
    }

    fn swiglu_backward(
        &self,
        dact: &Self::F32,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        dgu: &mut Self::F32,
    ) -> DResult<()> {
        self.swiglu
            .backward(
                &dact.as_view(),
                &gu.as_view(),
                &mut dgu.as_view_mut(),
                rows,
                f,
            )
            .map_err(de)
    }

    fn swiglu_backward_bf16(
        &self,
        dact: &Self::F32,
        gu: &Self::F32,
        rows: usize,
        f: usize,
        dgu: &mut Self::Bf16,
    ) -> DResult<()> {
        self.swiglu
            .backward_bf16(
                &dact.as_view(),
                &gu.as_view(),
                &mut dgu.as_view_mut(),
                rows,
                f,
            )
            .map_err(de)
    }

    fn combine_backward_bf16(
        &self,
        dout: &Self::F32,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        k: usize,
        h: usize,
        dy: &mut Self::Bf16,
        dweights: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .combine_backward_bf16(
                &dout.as_view(),
                &y.as_view(),
                &route.weights.as_view(),
                &route.row_of.as_view(),
                &mut dy.as_view_mut(),
                &mut dweights.as_view_mut(),
                n,
                h,
                k,
            )
            .map_err(de)
    }

    fn combine_backward(
        &self,
        dout: &Self::F32,
        y: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        k: usize,
        h: usize,
        dy: &mut Self::F32,
        dweights: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .combine_backward(
                &dout.as_view(),
                &y.as_view(),
                &route.weights.as_view(),
                &route.row_of.as_view(),
                &mut dy.as_view_mut(),
                &mut dweights.as_view_mut(),
                n,
                h,
                k,
            )
            .map_err(de)
    }

    fn gather_backward(
        &self,
        dg: &Self::F32,
        route: &RouteBufs<Self>,
        n: usize,
        _e: usize,
        k: usize,
        h: usize,
        dx: &mut Self::F32,
    ) -> DResult<()> {
        self.moe
            .gather_backward(
                &dg.as_view(),
                &route.row_of.as_view(),
                &mut dx.as_view_mut(),
                n,
                h,
                k,
            )
            .map_err(de)
    }

    fn router_backward(
        &self,
        dweights: &Self::F32,
        route: &RouteBufs<Self>,
        extra: Option<&Self::F32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
        dlogits: &mut Self::F32,
    ) -> DResult<()> {
        let g = extra.map(|g| g.as_view());
        self.router
            .backward(
                &route.probs.as_view(),
                &route.ids.as_view(),
                &route.weights.as_view(),
                Some(&dweights.as_view()),
                g.as_ref().map_or(ExtraDprobs::None, ExtraDprobs::Broadcast),
                &mut dlogits.as_view_mut(),
                n,
                e,
                k,
                norm_topk_prob,
            )
            .map_err(de)
    }

    fn aux_loss_grad(
        &self,
        layers: &[&RouteBufs<Self>],
        n: usize,
        e: usize,
        _k: usize,
        coef: f32,
        loss: &mut Self::F32,
        grad: &mut Self::F32,
    ) -> DResult<()> {
        let mut psum = self.gpu.empty::<f64>(e.max(1)).map_err(de)?;
        let mut counts = self.gpu.empty::<f64>(e.max(1)).map_err(de)?;
        self.router
            .aux_reset(&mut psum.as_view_mut(), &mut counts.as_view_mut(), e)
            .map_err(de)?;
        // The slots routed to each expert are the dispatch's row counts (its offsets).
        for r in layers {
            self.router
                .aux_accumulate(
                    &r.probs.as_view(),
                    &r.offsets.as_view(),
                    &mut psum.as_view_mut(),
                    &mut counts.as_view_mut(),
                    n,
                    e,
                )
                .map_err(de)?;
        }
        self.router
            .aux_finish(
                &psum.as_view(),
                &counts.as_view(),
                layers.len() * n,
                e,
                coef,
                &mut loss.as_view_mut(),
                &mut grad.as_view_mut(),
            )
            .map_err(de)
    }

    fn attention_backward(
        &self,
        dout: &Self::F32,
        q: &Self::F32,
        k: &Self::F32,
        v: &Self::F32,
        out: &Self::F32,
        lse: &Self::F32,
        layout: &SeqLayout,
        offsets: &Self::U32,
        shape: AttnShape,
        dq: &mut Self::F32,
        dk: &mut Self::F32,
        dv: &mut Self::F32,
    ) -> DResult<()> {
        let n = layout.num_tokens();
        let max_len = layout.lens().iter().copied().max().unwrap_or(0);
        // Unspecified contents: the backward writes every scratch element it reads (delta,
        // then the operands' BF16 planes) before reading it.
        let mut delta = self
            .gpu
            .empty::<f32>(attention::backward_scratch_len(n, shape))
            .map_err(de)?;
        self.attn
            .backward(
                &dout.as_view(),
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &out.as_view(),
                &lse.as_view(),
                &offsets.as_view(),
                layout.num_seqs(),
                max_len,
                n,
                shape,
                &mut delta.as_view_mut(),
                &mut dq.as_view_mut(),
                &mut dk.as_view_mut(),
                &mut dv.as_view_mut(),
            )
            .map_err(de)
    }

    fn rope_backward(
        &self,
        dx: &mut Self::F32,
        rows: usize,
        heads: usize,
        _head_dim: usize,
        pos: &Self::U32,
        table: &Self::Rope,
    ) -> DResult<()> {
        self.rope
            .backward(&mut dx.as_view_mut(), &pos.as_view(), rows, heads, table)
            .map_err(de)
    }

    fn head_backward(
        &self,
        h: &Self::Bf16,
        w: &Self::Bf16,
        targets: &Self::U32,
        lse: &Self::F32,
        dlogprob: &Self::F32,
        n: usize,
        hidden: usize,
        vocab: usize,
        temperature: f32,
        dh: &mut Self::F32,
        dw: &mut Self::F32,
    ) -> DResult<()> {
        // The head accumulates `dh` over its vocabulary chunks; this op overwrites it.
        self.fill_zero(dh, n * hidden)?;
        self.head
            .backward(
                &h.as_view(),
                &w.as_view(),
                &targets.as_view(),
                &lse.as_view(),
                &dlogprob.as_view(),
                temperature,
                HeadShape {
                    t: n,
                    h: hidden,
                    v: vocab,
                    chunk: DEFAULT_CHUNK.min(vocab.max(1)),
                },
                &mut dh.as_view_mut(),
                &mut dw.as_view_mut(),
            )
            .map_err(de)
    }

    fn embed_backward(
        &self,
        dx: &Self::F32,
        _tokens: &Self::U32,
        host_tokens: &[u32],
        h: usize,
        dtable: &mut Self::F32,
    ) -> DResult<()> {
        let vocab = dtable.len() / h.max(1);
        let g = EmbedGrouping::new(host_tokens, vocab)
            .map_err(|e| DeviceError::new(self.gpu.name(), e))?;
        let dg = self.embed_bwd.upload(&g).map_err(de)?;
        self.embed_bwd
            .run(
                &mut dtable.as_view_mut(),
                vocab,
                &dx.as_view(),
                host_tokens.len(),
                h,
                &dg,
            )
            .map_err(de)
    }

    fn grad_norm(&self, grads: &[(&Self::F32, usize)]) -> DResult<f64> {
        let lens: Vec<usize> = grads.iter().map(|(_, n)| *n).collect();
        let parts = self.grad_norm_begin(&lens)?;
        self.grad_norm_finish(parts, grads)
    }

    fn grad_norm_begin(&self, lens: &[usize]) -> DResult<Self::NormParts> {
        self.optim.grad_norm_begin(lens).map_err(de)
    }

    /// The buffers' partials run on a second stream, alongside the ops queued after them.
    fn grad_norm_add(
        &self,
        parts: &mut Self::NormParts,
        bufs: &[(usize, &Self::F32)],
    ) -> DResult<()> {
        let views: Vec<_> = bufs.iter().map(|(i, g)| (*i, g.as_view())).collect();
        self.optim.grad_norm_add(parts, &views, true).map_err(de)
    }

    fn grad_norm_finish(
        &self,
        parts: Self::NormParts,
        grads: &[(&Self::F32, usize)],
    ) -> DResult<f64> {
        let views: Vec<_> = grads.iter().map(|(g, _)| g.as_view()).collect();
        let lens: Vec<usize> = grads.iter().map(|(_, n)| *n).collect();
        let r = self
            .optim
            .grad_norm_finish(parts, &views, &lens, None)
            .map_err(de)?;
        let v = self.gpu.download(&r.norm).map_err(de)?;
        Ok(v[0])
    }

    fn adamw(
        &self,
        param: &mut Self::F32,
        grad: &Self::F32,
        m: &mut Self::F32,
        v: &mut Self::F32,
        n: usize,
        step: u64,
        cfg: &AdamWConfig,
        weight_decay: f32,
        grad_scale: f32,
        op: Option<&mut Self::Bf16>,
    ) -> DResult<()> {
        let scale = self.grad_scale_buffer(grad_scale)?;
        with_adamw_param(param, grad, m, v, op, n, weight_decay, |p| {
            self.optim.adamw_step(p, &scale.as_view(), step, cfg)
        })
        .map_err(de)
    }

    fn adamw_requantize(
        &self,
        param: &mut Self::F32,
        grad: &Self::F32,
        m: &mut Self::F32,
        v: &mut Self::F32,
        update: &AdamWUpdate<'_>,
        op: Option<&mut Self::Bf16>,
        stored: &StoredLayout<'_>,
    ) -> DResult<QExperts> {
        let (groups, n, k, spec) = (stored.groups, stored.n, stored.k, stored.spec);
        let row_wise = spec.weight_scheme() == Some(Scheme::MXFP8_ROW);
        let q = match self.qgemm.as_ref() {
            Ok(q) if row_wise && k.is_multiple_of(32) => q,
            Ok(q) if spec.format() == Format::Nvfp4 && k.is_multiple_of(16) => {
                return self.adamw_nvfp4(q, param, grad, m, v, update, op, stored)
            }
            Ok(q)
                if spec.format() == Format::Fp8Block
                    && n.is_multiple_of(mxrl_formats::FP8_BLOCK)
                    && k.is_multiple_of(mxrl_formats::FP8_BLOCK) =>
            {
                return self.adamw_fp8_block(q, param, grad, m, v, update, op, stored)
            }
            // Other formats: the step, then the device quantizers.
            _ => return adamw_then_quantize(self, param, grad, m, v, update, op, stored),
        };
        // MXFP8 row-wise: one pass writes the master, the moments, the BF16 copy, the stored
        // bytes and the large-M forward's BF16 operand (kept as `serve`), and the fast-decode
        // flag; for the `lowp` backward also its column-wise dgrad operand (kept as `train`)
        // where the tiles allow (weights of whole 32-row blocks, K a multiple of 64).
        let len = groups * n * k;
        let scale = self.grad_scale_buffer(update.grad_scale)?;
        let mut codes = self.gpu.empty::<u8>(len).map_err(de)?;
        let mut scales = self.gpu.empty::<u8>(len / 32).map_err(de)?;
        let mut deq = self.gpu.empty::<u16>(len).map_err(de)?;
        let mut col = match spec.backward() {
            BackwardMode::Lowp if n.is_multiple_of(32) && k.is_multiple_of(64) => {
                Some(self.gpu.empty::<u16>(len).map_err(de)?)
            }
            _ => None,
        };
        let mut cv = col.as_mut().map(|c| c.as_view_mut());
        let wd = update.weight_decay;
        let flag = with_adamw_param(param, grad, m, v, op, len, wd, |p| {
            q.adamw_mxfp8(
                p,
                &scale.as_view(),
                update.step,
                update.cfg,
                k,
                &mut codes.as_view_mut(),
                &mut scales.as_view_mut(),
                Some(&mut deq.as_view_mut()),
                cv.as_mut(),
            )
        })
        .map_err(|e| DeviceError::new(self.gpu.name(), format!("{}: {e}", (stored.name)(0))))?;
        let (serve, train) = (std::cell::OnceCell::new(), std::cell::OnceCell::new());
        let _ = serve.set(deq);
        if let Some(c) = col {
            let _ = train.set(c);
        }
        Ok(QExperts {
            format: Format::Mxfp8,
            e: groups,
            n,
            k,
            codes,
            scales,
            amax: self.gpu.zeros::<f32>(1).map_err(de)?,
            spec,
            fast_decode: FastDecode::on_device(flag),
            train,
            serve,
        })
    }

    fn fill_zero(&self, x: &mut Self::F32, n: usize) -> DResult<()> {
        self.gpu
            .stream()
            .memset_zeros(&mut x.slice_mut(0..n))
            .map_err(|e| DeviceError::new(self.gpu.name(), format!("memset: {e:?}")))
    }

    fn bias_backward(
        &self,
        dy: &Self::F32,
        rows: usize,
        n: usize,
        db: &mut Self::F32,
    ) -> DResult<()> {
        self.eng
            .bias_backward(&dy.as_view(), &mut db.as_view_mut(), rows, n)
            .map_err(de)
    }
}

/// The activation operand of an MXFP8 / NVFP4 linear: the contract's dequantized rows as BF16
/// (MXFP8) or as NVFP4's pre-scaled values with each row's amax (`amax`, NVFP4 only).
struct QuantRows {
    xq: CudaSlice<u16>,
    amax: Option<CudaSlice<f32>>,
    /// NVFP4: `xq` holds binary16 values (the fragment kernels' operand), not BF16.
    f16: bool,
}

impl CudaBackend {
    /// Scratch of the decode attention: allocated without a fill, since the partial kernel
    /// writes every chunk the combine reads (those below each sequence's length).
    fn attn_decode_scratch(
        &self,
        batch: usize,
        max_len: usize,
        shape: AttnShape,
    ) -> DResult<CudaSlice<f32>> {
        self.gpu
            .empty::<f32>(attention::decode_scratch_len(batch, max_len, shape))
            .map_err(de)
    }

    /// The dense MXFP8 linear on the quantized rows `xq` (the contract's dequantized BF16
    /// values): exact BF16 operands, W's dequantization made once per weight version, outside
    /// graph recording (memory allocated while recording would belong to the graph).
    fn mxfp8_dense_on(
        &self,
        xq: &CudaSlice<u16>,
        w: &QExperts,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> DResult<()> {
        if let Some(wb) = w.serve.get() {
            return self.linear(xq, wb, rows, k, n, y);
        }
        let q = self.qgemm.as_ref().map_err(|e| {
            DeviceError::new(
                self.gpu.name(),
                format!("qlinear: the low-byte kernels did not load: {e}"),
            )
        })?;
        let wb = self.experts_bf16(q, w)?;
        if self.gpu.capturing().map_err(de)? {
            return self.linear(xq, &wb, rows, k, n, y);
        }
        self.linear(xq, w.serve.get_or_init(|| wb), rows, k, n, y)
    }

    /// Token rows `src [tokens, width]` (u16 operands) in the routed order of `route`:
    /// `[tokens · top_k, width]`, row `i` the token row the permutation puts there.
    fn gather_token_rows_u16(
        &self,
        src: &CudaSlice<u16>,
        route: &RouteBufs<Self>,
        tokens: usize,
        top_k: usize,
        experts: usize,
        width: usize,
    ) -> DResult<CudaSlice<u16>> {
        let rows = tokens * top_k;
        let mut out = self.gpu.empty::<u16>(rows * width).map_err(de)?;
        self.moe
            .gather_rows_bf16(
                &src.as_view(),
                &route.perm.as_view(),
                &route.offsets.as_view(),
                &mut out.as_view_mut(),
                tokens,
                width,
                experts,
                top_k,
            )
            .map_err(de)?;
        Ok(out)
    }

    /// [`CudaBackend::gather_token_rows_u16`] for f32 rows (per-row factors, scale rows).
    fn gather_token_rows_f32(
        &self,
        src: &CudaSlice<f32>,
        route: &RouteBufs<Self>,
        tokens: usize,
        top_k: usize,
        experts: usize,
        width: usize,
    ) -> DResult<CudaSlice<f32>> {
        let rows = tokens * top_k;
        let mut out = self.gpu.empty::<f32>((rows * width).max(1)).map_err(de)?;
        self.moe
            .gather(
                &src.as_view(),
                &route.perm.as_view(),
                &route.offsets.as_view(),
                &mut out.slice_mut(0..rows * width),
                tokens,
                width,
                experts,
                top_k,
            )
            .map_err(de)?;
        Ok(out)
    }

    /// Whether a grouped MXFP8 / NVFP4 linear of `rows` rows over `experts` experts runs on
    /// the fragment kernels ([`QGemm::grouped_nt_frag_mxfp8`] and NVFP4's, which take NVFP4
    /// activations in binary16).
    /// The shapes alone decide (the same rows take the same kernels, hence the same bits, in
    /// every engine holding these weights).
    fn qfrag_path(&self, experts: usize, rows: usize, k: usize, n: usize) -> bool {
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        let most = match self.gemm.forward_tile(s) {
            crate::ops::gemm::Tile::W128x256 => QFRAG_WGMMA_ROWS_PER_EXPERT,
            _ => QFRAG_ROWS_PER_EXPERT,
        };
        QGemm::frag_fits(n, k) && rows <= most.saturating_mul(experts)
    }

    /// The activation operand [`Backend::grouped_qlinear_backward`]'s wgrad multiplies for
    /// weights stored for `spec`, made from the f32 rows `x [rows, k]` (groups of
    /// `host_offsets`): `lowp`'s column-wise MXFP8 copy per group (`segs`: those groups'
    /// column segments where the caller has them), NVFP4 `dequantized`'s three BF16 parts
    /// `[3, rows, k]` of the rows' contract dequantization (per-row amax, split exactly),
    /// MXFP8 `dequantized`'s row-wise forward operand. What a taped forward keeps instead
    /// ([`Backend::keeps_forward_operand`]) are these bytes.
    fn wgrad_x_operand(
        &self,
        x: &CudaView<'_, f32>,
        spec: &LinearSpec,
        segs: Option<&ColSegments>,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
    ) -> DResult<CudaSlice<u16>> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        let ql = || {
            self.qlin.as_ref().map_err(|e| {
                dev(format!(
                    "the wgrad's operand: the quantized linear did not load: {e}"
                ))
            })
        };
        match (spec.format(), spec.backward()) {
            (Format::Mxfp8, BackwardMode::Lowp) => {
                let ql = ql()?;
                let made;
                let segs = match segs {
                    Some(s) => s,
                    None => {
                        made = ql.col_segments(host_offsets, rows).map_err(de)?;
                        &made
                    }
                };
                ql.mxfp8_col_groups_bf16(x, segs, k).map_err(de)
            }
            (Format::Nvfp4, BackwardMode::Dequantized) => {
                let ql = ql()?;
                let scheme = spec
                    .activation_scheme()
                    .ok_or_else(|| dev("NVFP4 without an activation scheme".into()))?;
                let quant = ql.quantizer();
                let mut qx = quant.alloc_quantized([rows, k], scheme).map_err(de)?;
                quant
                    .quantize_view_into(
                        &InputView::F32(x.slice(0..rows * k)),
                        [rows, k],
                        scheme,
                        &mut qx,
                    )
                    .map_err(de)?;
                let amax = qx
                    .amax_bits
                    .as_ref()
                    .ok_or_else(|| dev("NVFP4 activations without their amax".into()))?;
                ql.nvfp4_split3_rows(
                    &qx.data.as_view(),
                    &qx.scales.as_view(),
                    &amax.as_view(),
                    rows,
                    k,
                    1,
                )
                .map_err(de)
            }
            (Format::Mxfp8, BackwardMode::Dequantized) => {
                let q = self.qgemm.as_ref().map_err(|e| {
                    dev(format!(
                        "the wgrad's operand: the low-byte kernels did not load: {e}"
                    ))
                })?;
                let mut xq = self.gpu.empty::<u16>(rows * k).map_err(de)?;
                q.quant_act_mxfp8(x, rows, k, &mut xq.as_view_mut())
                    .map_err(de)?;
                Ok(xq)
            }
            (f, m) => Err(dev(format!(
                "the wgrad's operand: none is made for {f:?} with the {} backward",
                m.name()
            ))),
        }
    }

    /// The forward's activation operand of the rows `src` names and, for `lowp`, the
    /// column-wise copy its wgrad multiplies (groups of `host_offsets`), from one read:
    /// `(operand, Some(copy))`; for NVFP4 `dequantized`, `(operand, Some(parts))`, the three
    /// BF16 parts of the rows' dequantization; for MXFP8 `dequantized`, `(operand, None)`,
    /// the operand kept itself. Refuses weights whose spec keeps none
    /// ([`Backend::keeps_forward_operand`]).
    fn kept_operands(
        &self,
        src: &ActRows<'_, '_>,
        w: &QExperts,
        host_offsets: &[u32],
        rows: usize,
        k: usize,
        what: &str,
    ) -> DResult<(QuantRows, Option<CudaSlice<u16>>)> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if !self.keeps_forward_operand(&w.spec, k) {
            return Err(dev(format!(
                "grouped_qlinear_{what}_kept: no forward operand is kept for {:?} with the {} \
                 backward and {k} columns",
                w.format,
                w.spec.backward().name()
            )));
        }
        if w.format == Format::Nvfp4 {
            let q = self.qgemm.as_ref().map_err(|e| {
                dev(format!(
                    "grouped_qlinear_{what}_kept: the low-byte kernels did not load: {e}"
                ))
            })?;
            let mut xq = self.gpu.empty::<u16>(rows * k).map_err(de)?;
            let mut amax = self.gpu.empty::<f32>(rows.max(1)).map_err(de)?;
            let f16 = self.qfrag_path(w.e, rows, k, w.n);
            let parts = q
                .quant_act_nvfp4_parts_from(
                    src,
                    f16,
                    rows,
                    k,
                    &mut xq.as_view_mut(),
                    &mut amax.slice_mut(0..rows),
                )
                .map_err(de)?;
            return Ok((
                QuantRows {
                    xq,
                    amax: Some(amax),
                    f16,
                },
                Some(parts),
            ));
        }
        if w.spec.backward() != BackwardMode::Lowp {
            return Ok((
                self.quant_act_rows(src, w, rows, k, "grouped_qlinear")?,
                None,
            ));
        }
        let ql = self.qlin.as_ref().map_err(|e| {
            dev(format!(
                "grouped_qlinear_{what}_kept: the quantized linear did not load: {e}"
            ))
        })?;
        let segs = ql.col_segments(host_offsets, rows).map_err(de)?;
        let mut xq = self.gpu.empty::<u16>(rows * k).map_err(de)?;
        let col = ql
            .mxfp8_rowcol_groups_bf16(src, &segs, k, &mut xq.as_view_mut())
            .map_err(de)?;
        Ok((
            QuantRows {
                xq,
                amax: None,
                f16: false,
            },
            Some(col),
        ))
    }

    /// Quantizes the `rows` rows `src` names (token rows, gathered rows, or SwiGLU of a gate/up
    /// output) as the activations of the MXFP8 / NVFP4 weights `w` (dense or routed experts):
    /// NVFP4 in binary16 where a GEMM of `rows` rows takes the fragment kernels, BF16
    /// otherwise.
    fn quant_act_rows(
        &self,
        src: &ActRows<'_, '_>,
        w: &QExperts,
        rows: usize,
        k: usize,
        op: &str,
    ) -> DResult<QuantRows> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        let q = self
            .qgemm
            .as_ref()
            .map_err(|e| dev(format!("{op}: the low-byte kernels did not load: {e}")))?;
        let mut xq = self.gpu.empty::<u16>(rows * k).map_err(de)?;
        let mut ov = xq.as_view_mut();
        match w.format {
            Format::Mxfp8 => {
                q.quant_act_mxfp8_from(src, rows, k, &mut ov).map_err(de)?;
                Ok(QuantRows {
                    xq,
                    amax: None,
                    f16: false,
                })
            }
            Format::Nvfp4 => {
                let mut amax = self.gpu.empty::<f32>(rows.max(1)).map_err(de)?;
                let mut xa = amax.slice_mut(0..rows);
                let f16 = self.qfrag_path(w.e, rows, k, w.n);
                q.quant_act_nvfp4_from(src, f16, rows, k, &mut ov, &mut xa)
                    .map_err(de)?;
                Ok(QuantRows {
                    xq,
                    amax: Some(amax),
                    f16,
                })
            }
            other => Err(dev(format!(
                "{op}: no device kernels for {other:?} experts"
            ))),
        }
    }

    /// The grouped MXFP8 / NVFP4 linear on quantized rows `act` (expert-major, `rows` of them).
    #[allow(clippy::too_many_arguments)]
    fn grouped_qlinear_on(
        &self,
        act: &QuantRows,
        w: &QExperts,
        offsets: &CudaSlice<u32>,
        experts: usize,
        rows: usize,
        k: usize,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> DResult<()> {
        let dev = |m: String| DeviceError::new(self.gpu.name(), m);
        if (w.e, w.n, w.k) != (experts, n, k) {
            return Err(dev(format!(
                "grouped_qlinear: experts stored as [{}, {}, {}], called with [{experts}, {n}, {k}]",
                w.e, w.n, w.k
            )));
        }
        let q = self.qgemm.as_ref().map_err(|e| {
            dev(format!(
                "grouped_qlinear: the low-byte expert kernels did not load: {e}"
            ))
        })?;
        let s = Grouped {
            experts,
            rows,
            n,
            k,
        };
        let frag = self.qfrag_path(experts, rows, k, n);
        if w.format == Format::Nvfp4 && act.f16 != frag {
            return Err(dev(format!(
                "grouped_qlinear: NVFP4 activations quantized for the {} kernels, called for \
                 the {} ones ({rows} rows over {experts} experts)",
                if act.f16 {
                    "fragment"
                } else {
                    "small-M / tiled"
                },
                if frag { "fragment" } else { "small-M / tiled" },
            )));
        }
        let small = !frag && rows <= QSMALL_M_ROWS_PER_EXPERT * experts;
        let xq = &act.xq;
        match (w.format, &act.amax) {
            (Format::Mxfp8, None) => {
                if frag {
                    let decode = if w.fast_decode.get(&self.gpu).map_err(de)? == Some(true) {
                        Mxfp8Decode::Fast
                    } else {
                        Mxfp8Decode::General
                    };
                    return q
                        .grouped_nt_frag_mxfp8_decode(
                            decode,
                            &xq.as_view(),
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            &offsets.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .map_err(de);
                }
                if small {
                    return q
                        .grouped_nt_small_m_mxfp8(
                            &xq.as_view(),
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            &offsets.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .map_err(de);
                }
                // The operand the optimizer's pass wrote with the weights, else made here.
                let made;
                let wb = match w.serve.get() {
                    Some(b) => b,
                    None => {
                        made = self.experts_bf16(q, w)?;
                        &made
                    }
                };
                self.grouped_linear(xq, wb, offsets, None, experts, rows, k, n, y)
            }
            (Format::Nvfp4, Some(x_amax)) => {
                let xa = x_amax.slice(0..rows);
                if frag {
                    return q
                        .grouped_nt_frag_nvfp4(
                            &xq.as_view(),
                            &xa,
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            &w.amax.as_view(),
                            &offsets.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .map_err(de);
                }
                if small {
                    return q
                        .grouped_nt_small_m_nvfp4(
                            &xq.as_view(),
                            &xa,
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            &w.amax.as_view(),
                            &offsets.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .map_err(de);
                }
                let wb = self.experts_bf16(q, w)?;
                // Large experts on sm_90: α applied in the GEMM's own stores (same bits).
                if !self.per_expert_path(experts, rows)
                    && self
                        .gemm
                        .grouped_nt_alpha(
                            &xq.as_view(),
                            &wb.as_view(),
                            &offsets.as_view(),
                            &mut y.as_view_mut(),
                            s,
                            &xa,
                            &w.amax.as_view(),
                        )
                        .map_err(de)?
                {
                    return Ok(());
                }
                self.grouped_linear(xq, &wb, offsets, None, experts, rows, k, n, y)?;
                q.nvfp4_scale_rows(
                    &mut y.as_view_mut(),
                    &xa,
                    &w.amax.as_view(),
                    &offsets.as_view(),
                    s,
                )
                .map_err(de)
            }
            (other, _) => Err(dev(format!(
                "grouped_qlinear: no device kernels for {other:?} experts (or an activation \
                 operand of another format)"
            ))),
        }
    }
}

/// The routed rows of token rows `x` (`route`'s permutation and offsets) as a fused
/// quantizer's source, handed to `f`.
fn with_gathered<R>(
    x: &CudaSlice<f32>,
    route: &RouteBufs<CudaBackend>,
    tokens: usize,
    top_k: usize,
    experts: usize,
    f: impl FnOnce(&ActRows<'_, '_>) -> DResult<R>,
) -> DResult<R> {
    let (xv, perm, offs) = (x.as_view(), route.perm.as_view(), route.offsets.as_view());
    f(&ActRows::Gather {
        x: &xv,
        tokens,
        perm: &perm,
        offsets: &offs,
        experts,
        top_k,
    })
}

#[cfg(test)]
mod send_tests {
    /// A rollout server moves its policy to its engine thread: the device engine must be Send.
    #[test]
    fn the_device_engine_can_move_to_another_thread() {
        fn send<T: Send>() {}
        send::<super::CudaBackend>();
        send::<mxrl_model::engine::Engine<super::CudaBackend>>();
    }
}
