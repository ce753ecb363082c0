//! GEMMs of the engine (kernels `kernels/ops_gemm.cu`): dense BF16 GEMMs through cuBLAS and
//! the grouped expert GEMMs (own tensor-core kernels, one launch per projection).
//!
//! All operands are BF16 bit patterns (`u16`) in device memory, every product is exact in f32
//! and sums accumulate in f32; outputs are f32. Row-major shapes as in [`mxrl_tensor::gemm`]:
//! - forward `y[m,n] = x[m,k] · W[n,k]ᵀ` (reference [`mxrl_tensor::gemm::matmul_nt`]),
//! - dgrad `dx[m,k] = dy[m,n] · W[n,k]` (reference [`mxrl_tensor::gemm::matmul_nn`]),
//! - wgrad `dW[n,k] += dy[m,n]ᵀ · x[m,k]` (reference [`mxrl_tensor::gemm::matmul_tn`] added to
//!   the old `dW`), also with `x` given as stacked BF16 parts `x = Σ_p x_p` summed in one
//!   launch ([`Gemm::grouped_tn_parts`]),
//!
//! each on the widened BF16 values. The tiled grouped kernels stage (rows × cols) × 32 operand
//! tiles in shared memory with 16-byte `cp.async` copies (three stages in flight, two for the
//! 128 × 128 tile), read fragments with `ldmatrix` (`.trans` where the source is contiguous
//! along the output index) and multiply with `mma.sync.m16n8k16` BF16 → f32. On sm_90 the
//! large-expert default is [`Tile::W128x256`]: two warpgroups of `wgmma.m64n256k16` reading
//! both operands from 128-byte swizzled shared-memory tiles, about twice as fast on the
//! training shapes and bit for bit the same sums (every tile adds each output's products in
//! the same k16 groups in increasing order; tested). Only the summation order differs from
//! the reference; the
//! bounds are `mxrl_tensor::tolerance::gemm_*_bounds_with` with
//! `mxrl_tensor::tolerance::tensor_core_sum_bound` (tensor cores: cuBLAS and the tiled grouped
//! kernels) or `two_order_sum_bound` (the small-M kernel: IEEE f32 adds on CUDA cores).
//!
//! Deterministic: equal inputs and shapes give equal bits. The grouped kernels own every output
//! element in one thread and sum in an order fixed by the shapes; cuBLAS runs on one handle per
//! stream with atomics disallowed and a fixed workspace, so it picks the same algorithm (no
//! split-K atomics) for the same shapes.
//!
//! Grouped layout: the activation is packed expert-major, the rows of expert `e` are
//! `offsets[e]..offsets[e+1]` (`offsets: u32 [E+1]` in **device** memory — no launcher reads it
//! on the host, so a decode step can be captured in a CUDA graph); expert weights are stacked
//! `[E, N, K]`. Offsets are clamped to `[0, R]` inside the kernels (an invalid table gives wrong
//! rows, never an out-of-bounds access); rows outside every expert's range are not written.
#![allow(unsafe_code)]

use super::{check_align, check_len, check_u32, mul};
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use mxrl_tensor::device::GradWrite;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_gemm.cu");

/// Block tile of the tensor-core grouped kernels (output rows × output columns; the kernels
/// `*_t64` / `*_t128` / `*_t32x128` / `*_t128k64` of the source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tile {
    /// 64 × 64 outputs, 4 warps (each 32 × 32).
    T64,
    /// 128 × 128 outputs, 8 warps (each 64 × 32): half the operand traffic per FLOP.
    T128,
    /// 32 × 128 outputs, 8 warps (each 16 × 32): experts with few rows (decode).
    T32x128,
    /// 128 × 128 outputs, 8 warps, three stages 64 deep instead of four 32 deep (half the
    /// barriers per reduction step).
    T128k64,
    /// 128 × 256 outputs, two warpgroups of Hopper's `wgmma` (m64n256k16, operands read from
    /// shared memory in 128-byte swizzled layouts), four stages 64 deep. sm_90 only
    /// ([`Gpu::has_wgmma`]).
    W128x256,
}

impl Tile {
    /// Every tile.
    pub const ALL: [Tile; 5] = [
        Tile::T64,
        Tile::T128,
        Tile::T32x128,
        Tile::T128k64,
        Tile::W128x256,
    ];

    /// Output rows of the tile (rows of the activation for forward and dgrad, rows of the
    /// expert weight for wgrad).
    pub fn rows(self) -> usize {
        match self {
            Tile::T64 => 64,
            Tile::T128 | Tile::T128k64 | Tile::W128x256 => 128,
            Tile::T32x128 => 32,
        }
    }

    /// Output columns of the tile.
    pub fn cols(self) -> usize {
        match self {
            Tile::T64 => 64,
            Tile::T128 | Tile::T32x128 | Tile::T128k64 => 128,
            Tile::W128x256 => 256,
        }
    }

    fn threads(self) -> u32 {
        match self {
            Tile::T64 => 128,
            Tile::T128 | Tile::T32x128 | Tile::T128k64 | Tile::W128x256 => 256,
        }
    }

    /// Reduction depth of one shared-memory stage and the stages in flight (the kernels'
    /// `BK`, `ST`).
    fn stages(self) -> (usize, usize) {
        match self {
            Tile::T128k64 => (64, 3),
            Tile::W128x256 => (64, 4),
            _ => (32, 4),
        }
    }

    /// Dynamic shared memory of the tile's kernel: `ST` stages of both operand tiles, each
    /// `rows × (BK + 8)` BF16 when its reduction index is the contiguous one (`mn` false),
    /// else `BK × (rows + 8)` (the kernel's `TileSize`).
    fn smem_bytes(self, a_mn: bool, b_mn: bool) -> usize {
        let (bk, st) = self.stages();
        if self == Tile::W128x256 {
            // Unpadded swizzled tiles in either layout, plus 1024 bytes to align the first.
            return st * (self.rows() + self.cols()) * bk * 2 + 1024;
        }
        let tile = |rows: usize, mn: bool| {
            if mn {
                bk * (rows + 8)
            } else {
                rows * (bk + 8)
            }
        };
        st * (tile(self.rows(), a_mn) + tile(self.cols(), b_mn)) * 2
    }

    fn index(self) -> usize {
        match self {
            Tile::T64 => 0,
            Tile::T128 => 1,
            Tile::T32x128 => 2,
            Tile::T128k64 => 3,
            Tile::W128x256 => 4,
        }
    }

    /// The kernels' name suffix (`grouped_nt_t64`, …).
    fn suffix(self) -> &'static str {
        match self {
            Tile::T64 => "64",
            Tile::T128 => "128",
            Tile::T32x128 => "32x128",
            Tile::T128k64 => "128k64",
            Tile::W128x256 => "w128x256",
        }
    }

    /// The tile the plain dgrad and wgrad launchers use: 128 × 128 when the experts average at
    /// least 128 rows (training and prefill), else 64 × 64 (fewer wasted rows on small
    /// experts).
    pub fn for_shape(s: Grouped) -> Self {
        if s.rows >= 128 * s.experts.max(1) {
            Tile::T128
        } else {
            Tile::T64
        }
    }

    /// The forward's tile: as [`Tile::for_shape`], with the 64-deep stages for large experts
    /// (8–10 % faster than [`Tile::T128`] on the training shapes on an H100, where the dgrad
    /// gained at most 4 % and the wgrad lost 1–2 %: BENCHMARKS.md).
    pub fn for_forward(s: Grouped) -> Self {
        match Tile::for_shape(s) {
            Tile::T128 => Tile::T128k64,
            t => t,
        }
    }
}
/// Most parts [`Gemm::grouped_tn_parts`] sums in one launch.
pub const MAX_TN_PARTS: usize = 8;

/// Output columns one block of the small-M kernel covers (`SM_WARPS · SM_NB`).
const SMALL_M_COLS: usize = 32;
const SMALL_M_THREADS: u32 = 256;

/// [`Gemm::dense_nt_small_m`]'s outputs per launch (a layer's q, k and v projections).
pub const DENSE_SMALL_M_OUTPUTS: usize = 3;

/// Most dynamic shared memory [`Gemm::rmsnorm_dense_nt_small_m`] takes (8 rows of 6144).
pub const RMSNORM_SMALL_M_MAX_SMEM: usize = 96 << 10;

/// Rows up to which a dense BF16 forward runs on [`Gemm::dense_nt_small_m`] rather than
/// cuBLAS ([`dense_small_m_rows`]): the small-M kernel reads the weight once per 8 rows and sums
/// on CUDA cores, so it wins where the weight bytes dominate. Measured on an H100 (BENCHMARKS.md,
/// decode steps of the benchmark model): faster than cuBLAS at 1 and 2 rows, slower at 4 and 8.
pub const DENSE_SMALL_M_ROWS: usize = 2;

/// The row limit for [`Gemm::dense_nt_small_m`] in the engine's dense forwards:
/// `MXRL_DENSE_SMALL_M` (rows; `0` = always cuBLAS) or [`DENSE_SMALL_M_ROWS`]. Read once.
pub fn dense_small_m_rows() -> usize {
    static ROWS: OnceLock<usize> = OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("MXRL_DENSE_SMALL_M")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DENSE_SMALL_M_ROWS)
    })
}

/// Output columns per warp of [`Gemm::dense_nt_small_m`] for `cols` output columns in all:
/// `MXRL_SMALL_M_NB` (1 or 2) if set, else 1 below 4096 columns (more warps share a narrow
/// weight's bytes), else 2. Only the launch shape changes: every column is summed the same way.
fn dense_small_m_nb(cols: usize) -> usize {
    static NB: OnceLock<Option<usize>> = OnceLock::new();
    let forced = *NB.get_or_init(|| {
        std::env::var("MXRL_SMALL_M_NB")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&v| v == 1 || v == 2)
    });
    forced.unwrap_or(if cols < 4096 { 1 } else { 2 })
}

/// Operand layouts (A, B contiguous along the output index?) of the forward, dgrad and wgrad.
const NT_MN: (bool, bool) = (false, false);
const NN_MN: (bool, bool) = (false, true);
const TN_MN: (bool, bool) = (true, true);

/// [`Gemm::grouped_nt`] takes the small-M (GEMV-style) kernel when the total row count is at
/// most this many rows per expert on average (`rows ≤ SMALL_M_ROWS_PER_EXPERT · experts`):
/// decode steps, where each used expert sees a handful of rows and the weight bytes dominate.
pub const SMALL_M_ROWS_PER_EXPERT: usize = 4;

/// cuBLAS workspace per handle (fixed, so the algorithm choice never depends on what the
/// library could allocate, and no allocation happens inside a captured graph).
const BLAS_WORKSPACE: usize = 32 << 20;

/// Shape of a grouped expert GEMM: `experts` experts, `rows` packed rows (`R`), weights
/// `[experts, n, k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grouped {
    /// Number of experts `E` (offsets hold `E + 1` entries).
    pub experts: usize,
    /// Packed rows `R` of the activation (`offsets[E] ≤ R`).
    pub rows: usize,
    /// Output features `N` of the forward (rows of each expert's weight); a multiple of 8.
    pub n: usize,
    /// Input features `K` of the forward (columns of each expert's weight); a multiple of 8.
    pub k: usize,
}

impl Grouped {
    /// Refuses a shape whose experts, rows, `n` or `k` exceed u32 (the kernels' index type),
    /// naming `op` and the dimension.
    pub(crate) fn check_u32(self, gpu: &Gpu, op: &str) -> Result<(), DeviceError> {
        check_u32(
            gpu,
            op,
            &[
                ("experts", self.experts),
                ("rows", self.rows),
                ("n", self.n),
                ("k", self.k),
            ],
        )
    }
}

/// Which kernel a grouped forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedPath {
    /// Tensor-core tiles (`mma.m16n8k16`, 64 × 64 block tiles).
    Tiled,
    /// GEMV-style: each used expert's weights read once, all its rows computed from them.
    SmallM,
}

impl GroupedPath {
    /// The path [`Gemm::grouped_nt`] picks for a shape (host-known sizes only).
    pub fn for_shape(s: Grouped) -> Self {
        if s.rows <= SMALL_M_ROWS_PER_EXPERT * s.experts {
            GroupedPath::SmallM
        } else {
            GroupedPath::Tiled
        }
    }
}

struct Blas {
    // Field order is drop order: the handle is destroyed before its workspace is freed.
    handle: CudaBlas,
    _workspace: CudaSlice<u8>,
}

type BlasCache = Mutex<HashMap<(usize, usize), Arc<Mutex<Blas>>>>;

fn blas_handles() -> &'static BlasCache {
    static CACHE: OnceLock<BlasCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The cuBLAS handle of `gpu`'s stream (created on first use: atomics disallowed, default math
/// with tensor cores, a fixed workspace).
fn blas_for(gpu: &Gpu) -> Result<Arc<Mutex<Blas>>, DeviceError> {
    let key = (gpu.ordinal(), gpu.stream().cu_stream() as usize);
    let mut cache = blas_handles().lock().expect("cuBLAS cache poisoned");
    if let Some(h) = cache.get(&key) {
        return Ok(h.clone());
    }
    // SAFETY: only asks whether the cuBLAS library can be found.
    if !unsafe { blas_sys::is_culib_present() } {
        return Err(gpu.err("the cuBLAS library (libcublas) cannot be loaded"));
    }
    let handle = CudaBlas::new(gpu.stream().clone()).map_err(|e| gpu.err(format!("{e:?}")))?;
    let mut workspace = gpu.zeros::<u8>(BLAS_WORKSPACE)?;
    {
        let (ws, _rec) = workspace.device_ptr_mut(gpu.stream());
        // SAFETY: `handle.handle()` is a live handle owned by `handle`; the workspace is a
        // device buffer of BLAS_WORKSPACE bytes on the handle's stream that lives as long as
        // the handle (both are kept in `Blas`, the handle dropped first).
        unsafe {
            blas_sys::cublasSetAtomicsMode(
                *handle.handle(),
                blas_sys::cublasAtomicsMode_t::CUBLAS_ATOMICS_NOT_ALLOWED,
            )
            .result()
            .map_err(|e| gpu.err(format!("cublasSetAtomicsMode: {e:?}")))?;
            blas_sys::cublasSetMathMode(
                *handle.handle(),
                blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            )
            .result()
            .map_err(|e| gpu.err(format!("cublasSetMathMode: {e:?}")))?;
            blas_sys::cublasSetWorkspace_v2(
                *handle.handle(),
                ws as *mut std::ffi::c_void,
                BLAS_WORKSPACE,
            )
            .result()
            .map_err(|e| gpu.err(format!("cublasSetWorkspace: {e:?}")))?;
        }
    }
    let h = Arc::new(Mutex::new(Blas {
        handle,
        _workspace: workspace,
    }));
    cache.insert(key, h.clone());
    Ok(h)
}

/// The loaded GEMM kernels and the stream's cuBLAS handle.
pub struct Gemm {
    gpu: Gpu,
    blas: Arc<Mutex<Blas>>,
    /// The tiled grouped kernels by [`Tile::index`] (`None`: a tile this device cannot run).
    nt_tiled: [Option<CudaFunction>; 5],
    nn_tiled: [Option<CudaFunction>; 5],
    tn_tiled: [Option<CudaFunction>; 5],
    /// `grouped_nt_tw128x256_alpha` (sm_90 only).
    nt_alpha: Option<CudaFunction>,
    /// `grouped_nn_tw128x256_wfactor` (sm_90 only).
    nn_wfactor: Option<CudaFunction>,
    /// Whether the default tiles are the `wgmma` ones ([`Tile::W128x256`]) for large experts:
    /// on an sm_90 device unless `MXRL_WGMMA=off`.
    wgmma: bool,
    nt_small_m: CudaFunction,
    /// `dense_nt_small_m_nb1`, `dense_nt_small_m_nb2`.
    dense_small_m: [CudaFunction; 2],
    /// `rmsnorm_dense_small_m_nb1`, `rmsnorm_dense_small_m_nb2`.
    rmsnorm_small_m: [CudaFunction; 2],
    add_rmsnorm_small_m: [CudaFunction; 2],
    gate_up_swiglu_small_m: CudaFunction,
    down_combine_small_m: CudaFunction,
}

fn dim_i32(gpu: &Gpu, what: &str, v: usize) -> Result<i32, DeviceError> {
    i32::try_from(v).map_err(|_| gpu.err(format!("{what} = {v} exceeds cuBLAS' i32 range")))
}

impl Gemm {
    /// Loads (compiling on first use) the module on `gpu` and gets its stream's cuBLAS handle.
    ///
    /// # Errors
    /// NVRTC, module-load or cuBLAS errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_gemm", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        let tiled = |kind: &str, (a_mn, b_mn): (bool, bool)| {
            Tile::ALL.map(|t| {
                if t == Tile::W128x256 && !gpu.has_wgmma() {
                    return Ok(None);
                }
                let name = format!("grouped_{kind}_t{}", t.suffix());
                let func = f(&name)?;
                gpu.allow_dynamic_smem(&func, &name, t.smem_bytes(a_mn, b_mn))?;
                Ok::<_, DeviceError>(Some(func))
            })
        };
        let [a, b, c, d, w] = tiled("nt", NT_MN);
        let nt_tiled = [a?, b?, c?, d?, w?];
        let [a, b, c, d, w] = tiled("nn", NN_MN);
        let nn_tiled = [a?, b?, c?, d?, w?];
        let [a, b, c, d, w] = tiled("tn", TN_MN);
        let tn_tiled = [a?, b?, c?, d?, w?];
        let wgmma_only = |name: &str, (a_mn, b_mn): (bool, bool)| {
            if !gpu.has_wgmma() {
                return Ok::<_, DeviceError>(None);
            }
            let func = f(name)?;
            gpu.allow_dynamic_smem(&func, name, Tile::W128x256.smem_bytes(a_mn, b_mn))?;
            Ok(Some(func))
        };
        let nt_alpha = wgmma_only("grouped_nt_tw128x256_alpha", NT_MN)?;
        let nn_wfactor = wgmma_only("grouped_nn_tw128x256_wfactor", NN_MN)?;
        let wgmma = gpu.has_wgmma()
            && !std::env::var("MXRL_WGMMA").is_ok_and(|v| v.eq_ignore_ascii_case("off"));
        // The small-M kernels that stage normalized rows in dynamic shared memory.
        let with_smem = |n: &str| {
            let func = f(n)?;
            gpu.allow_dynamic_smem(&func, n, RMSNORM_SMALL_M_MAX_SMEM)?;
            Ok::<_, DeviceError>(func)
        };
        Ok(Gemm {
            gpu: gpu.clone(),
            blas: blas_for(gpu)?,
            nt_tiled,
            nn_tiled,
            tn_tiled,
            nt_alpha,
            nn_wfactor,
            wgmma,
            nt_small_m: f("grouped_nt_small_m")?,
            dense_small_m: [f("dense_nt_small_m_nb1")?, f("dense_nt_small_m_nb2")?],
            rmsnorm_small_m: [
                with_smem("rmsnorm_dense_small_m_nb1")?,
                with_smem("rmsnorm_dense_small_m_nb2")?,
            ],
            add_rmsnorm_small_m: [
                with_smem("add_rmsnorm_dense_small_m_nb1")?,
                with_smem("add_rmsnorm_dense_small_m_nb2")?,
            ],
            gate_up_swiglu_small_m: f("grouped_gate_up_swiglu_small_m")?,
            down_combine_small_m: f("grouped_down_combine_small_m")?,
        })
    }

    /// Column-major `C[m,n] = α·op(A)·op(B) + β·C` by one `cublasGemmEx` (BF16 A and B, f32 C,
    /// `CUBLAS_COMPUTE_32F`). The caller has checked every extent: A holds `lda × (k or m)`,
    /// B `ldb × (n or k)`, C `ldc × n` elements, `m, n, k ≥ 1`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ex(
        &self,
        ta: bool,
        tb: bool,
        (m, n, k): (usize, usize, usize),
        a: &CudaView<'_, u16>,
        lda: usize,
        b: &CudaView<'_, u16>,
        ldb: usize,
        c: &mut CudaViewMut<'_, f32>,
        ldc: usize,
        beta: f32,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (mi, ni, ki) = (
            dim_i32(g, "m", m)?,
            dim_i32(g, "n", n)?,
            dim_i32(g, "k", k)?,
        );
        let (lda, ldb, ldc) = (
            dim_i32(g, "lda", lda)?,
            dim_i32(g, "ldb", ldb)?,
            dim_i32(g, "ldc", ldc)?,
        );
        let alpha = 1.0f32;
        // cuBLAS runs on the calling thread's current context: make it this GPU's.
        g.ctx()
            .bind_to_thread()
            .map_err(|e| g.err(format!("bind context: {e:?}")))?;
        let blas = self.blas.lock().expect("cuBLAS handle poisoned");
        let stream = g.stream();
        let (pa, _ra) = a.device_ptr(stream);
        let (pb, _rb) = b.device_ptr(stream);
        let (pc, _rc) = c.device_ptr_mut(stream);
        // SAFETY: the handle is live and bound to this stream; A, B and C are device buffers
        // on this stream whose extents the caller checked against (m, n, k, ld*); C is
        // exclusively borrowed, so it aliases neither input; alpha and beta are host f32
        // values (pointer mode host) alive for the call.
        unsafe {
            blas_result::gemm_ex(
                *blas.handle.handle(),
                op(ta),
                op(tb),
                mi,
                ni,
                ki,
                (&alpha) as *const f32 as *const _,
                pa as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                lda,
                pb as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ldb,
                (&beta) as *const f32 as *const _,
                pc as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| g.err(format!("cublasGemmEx: {e:?}")))
    }

    /// Dense forward `y[m,n] = x[m,k] · W[n,k]ᵀ` (cuBLAS; x, W BF16; y f32, overwritten).
    /// Reference: [`mxrl_tensor::gemm::matmul_nt`] on the widened values.
    ///
    /// # Errors
    /// Short buffers, sizes beyond cuBLAS' i32 range; cuBLAS errors.
    pub fn dense_nt(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, "dense_nt x", x.len(), mul(g, "x", m, k)?)?;
        check_len(g, "dense_nt w", w.len(), mul(g, "w", n, k)?)?;
        check_len(g, "dense_nt y", y.len(), mul(g, "y", m, n)?)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            return self.zero(y, m * n);
        }
        // Row-major y[m,n] is column-major yᶜ[n,m] = W·xᵀ: W's buffer is column-major [k,n]
        // (ld k), taken transposed; x's buffer is column-major [k,m] (ld k) = xᵀ.
        self.gemm_ex(true, false, (n, m, k), w, k, x, k, y, n, 0.0)
    }

    /// Dense dgrad `dx[m,k] = dy[m,n] · W[n,k]` (cuBLAS; dy, W BF16; dx f32, overwritten).
    /// Reference: [`mxrl_tensor::gemm::matmul_nn`] on the widened values.
    ///
    /// # Errors
    /// Short buffers, sizes beyond cuBLAS' i32 range; cuBLAS errors.
    pub fn dense_nn(
        &self,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        dx: &mut CudaViewMut<'_, f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.dense_nn_beta(dy, w, dx, (m, n, k), 0.0)
    }

    /// Dense dgrad accumulated: `dx[m,k] += dy[m,n] · W[n,k]` (cuBLAS, β = 1; dy, W BF16;
    /// dx f32). Reference: [`mxrl_tensor::gemm::matmul_nn`] on the widened values, added to
    /// the old dx.
    ///
    /// # Errors
    /// Short buffers, sizes beyond cuBLAS' i32 range; cuBLAS errors.
    pub fn dense_nn_acc(
        &self,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        dx: &mut CudaViewMut<'_, f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        self.dense_nn_beta(dy, w, dx, (m, n, k), 1.0)
    }

    fn dense_nn_beta(
        &self,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        dx: &mut CudaViewMut<'_, f32>,
        (m, n, k): (usize, usize, usize),
        beta: f32,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, "dense_nn dy", dy.len(), mul(g, "dy", m, n)?)?;
        check_len(g, "dense_nn w", w.len(), mul(g, "w", n, k)?)?;
        check_len(g, "dense_nn dx", dx.len(), mul(g, "dx", m, k)?)?;
        if m == 0 || k == 0 {
            return Ok(());
        }
        if n == 0 {
            return if beta == 0.0 {
                self.zero(dx, m * k)
            } else {
                Ok(())
            };
        }
        // Row-major dx[m,k] is column-major dxᶜ[k,m] = Wᶜ·dyᶜ: W's buffer is column-major
        // [k,n] (ld k), dy's is column-major [n,m] (ld n); neither transposed.
        self.gemm_ex(false, false, (k, m, n), w, k, dy, n, dx, k, beta)
    }

    /// Dense wgrad `dW[n,k] += dy[m,n]ᵀ · x[m,k]` (cuBLAS, β = 1; dy, x BF16; dW f32).
    /// Reference: [`mxrl_tensor::gemm::matmul_tn`] on the widened values, added to the old dW.
    ///
    /// # Errors
    /// Short buffers, sizes beyond cuBLAS' i32 range; cuBLAS errors.
    pub fn dense_tn(
        &self,
        dy: &CudaView<'_, u16>,
        x: &CudaView<'_, u16>,
        dw: &mut CudaViewMut<'_, f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        check_len(g, "dense_tn dy", dy.len(), mul(g, "dy", m, n)?)?;
        check_len(g, "dense_tn x", x.len(), mul(g, "x", m, k)?)?;
        check_len(g, "dense_tn dw", dw.len(), mul(g, "dw", n, k)?)?;
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        // Row-major dW[n,k] is column-major dWᶜ[k,n] = xᶜ·dyᶜᵀ: x's buffer is column-major
        // [k,m] (ld k), dy's is column-major [n,m] (ld n), taken transposed to [m,n].
        self.gemm_ex(false, true, (k, n, m), x, k, dy, n, dw, k, 1.0)
    }

    fn zero(&self, y: &mut CudaViewMut<'_, f32>, len: usize) -> Result<(), DeviceError> {
        let mut head = y.slice_mut(0..len);
        self.gpu
            .stream()
            .memset_zeros(&mut head)
            .map_err(|e| self.gpu.err(format!("memset: {e:?}")))
    }

    /// [`Gemm::check_grouped`] for a forward: `x [R, K]`, `w [E, N, K]`, `y [R, N]`.
    fn check_nt(
        &self,
        op: &str,
        s: Grouped,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let w_len = mul(g, "w", mul(g, "w", s.experts, s.n)?, s.k)?;
        let y_len = mul(g, "y", s.rows, s.n)?;
        self.check_grouped(op, s, (x, s.k), w, w_len, offsets, y, y_len)
    }

    /// Checks a grouped shape and its buffers: `n`, `k` multiples of 8, sizes within the
    /// kernels' u32 range, operand lengths and alignments. `a` is `[R, a_cols]`, `b` the
    /// stacked weight `[E, n, k]`, `out` has `out_len` elements.
    #[allow(clippy::too_many_arguments)]
    fn check_grouped(
        &self,
        op: &str,
        s: Grouped,
        a: (&CudaView<'_, u16>, usize),
        b: &CudaView<'_, u16>,
        b_len: usize,
        offsets: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, f32>,
        out_len: usize,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if !s.n.is_multiple_of(8) || !s.k.is_multiple_of(8) {
            return Err(g.err(format!(
                "{op}: n = {} and k = {} must be multiples of 8 (16-byte operand loads)",
                s.n, s.k
            )));
        }
        s.check_u32(g, op)?;
        let a_len = mul(g, op, s.rows, a.1)?;
        check_len(g, &format!("{op} activation"), a.0.len(), a_len)?;
        check_len(g, &format!("{op} weight/operand"), b.len(), b_len)?;
        check_len(g, &format!("{op} offsets"), offsets.len(), s.experts + 1)?;
        check_len(g, &format!("{op} output"), out.len(), out_len)?;
        let stream = g.stream();
        check_align(g, &format!("{op} activation"), a.0.device_ptr(stream).0, 16)?;
        check_align(
            g,
            &format!("{op} weight/operand"),
            b.device_ptr(stream).0,
            16,
        )?;
        check_align(g, &format!("{op} output"), out.device_ptr_mut(stream).0, 8)?;
        Ok(())
    }

    /// Grouped forward `Y[r, :] = X[r, :] · W[e]ᵀ` for every row `r` of every expert `e`:
    /// `X [R, K]` BF16, `W [E, N, K]` BF16, `Y [R, N]` f32 (overwritten on the experts' rows),
    /// f32 accumulation, one launch. Picks [`GroupedPath::for_shape`]: the small-M kernel
    /// for decode-sized row counts, the tensor-core tiles otherwise. Reference, per expert:
    /// [`mxrl_tensor::gemm::matmul_nt`] on the widened values.
    ///
    /// # Errors
    /// `n` or `k` not a multiple of 8, short or misaligned buffers, sizes beyond u32 or the
    /// grid limits; launch errors.
    pub fn grouped_nt(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<GroupedPath, DeviceError> {
        let path = GroupedPath::for_shape(s);
        match path {
            GroupedPath::Tiled => self.grouped_nt_tiled(x, w, offsets, y, s)?,
            GroupedPath::SmallM => self.grouped_nt_small_m(x, w, offsets, y, s)?,
        }
        Ok(path)
    }

    /// [`Gemm::grouped_nt`] on the tensor-core tiles with [`Gemm::forward_tile`].
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_nt_tiled(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        self.grouped_nt_tiled_with(self.forward_tile(s), x, w, offsets, y, s)
    }

    /// [`Gemm::grouped_nt`] on the tensor-core tiles (`tile.rows()` × `tile.cols()` outputs per
    /// block, `cp.async` stages, `mma.m16n8k16` BF16 → f32), grid `(⌈R/rows⌉ + E, ⌈N/cols⌉)`: block
    /// `x` maps to (expert, row tile) from the device offsets; surplus blocks exit.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_nt_tiled_with(
        &self,
        tile: Tile,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        self.check_nt("grouped_nt", s, x, w, offsets, y)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        let cfg = self.row_tile_grid("grouped_nt", tile, s, s.n, NT_MN)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b =
            g.stream()
                .launch_builder(self.tiled_kernel(&self.nt_tiled, tile, "grouped_nt")?);
        b.arg(x).arg(w).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, w E·N·K, offsets E+1 and y R·N elements (checked); n, k are
        // multiples of 8 and x, w 16-byte / y 8-byte aligned (checked), as the 16-byte copies
        // and float2 stores need; the kernel clamps offsets to [0, R], bounds-checks rows < R,
        // columns < N and k < K (out-of-range chunks are zero-filled, not read), and the grid
        // covers Σ⌈rows_e/rows⌉ ≤ ⌈R/rows⌉ + E row tiles. The block size is the kernel's
        // (`tile.threads()`). Argument types match (const u16*, const u16*, const u32*,
        // float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// [`Gemm::grouped_nt`] with NVFP4's per-row factor applied as each output is stored, in
    /// the one launch of the `wgmma` tile: `y[r, n] = fl(Σ · α)`, `α = fl(fl(x_amax[r] ·
    /// w_amax[e]) · (1 / factor))` for the rows `r` of expert `e` — the bits of
    /// [`Gemm::grouped_nt`] followed by `QGemm::nvfp4_scale_rows`, without writing and reading
    /// `y` a second time. Returns `false` without launching anything where the shape does not
    /// take the `wgmma` tile ([`Gemm::forward_tile`]); the caller then runs the two steps.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`]; `x_amax` shorter than the rows or `w_amax` than the experts.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_nt_alpha(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        x_amax: &CudaView<'_, f32>,
        w_amax: &CudaView<'_, f32>,
    ) -> Result<bool, DeviceError> {
        let Some(func) = self.nt_alpha.as_ref() else {
            return Ok(false);
        };
        if GroupedPath::for_shape(s) != GroupedPath::Tiled || self.forward_tile(s) != Tile::W128x256
        {
            return Ok(false);
        }
        let g = &self.gpu;
        self.check_nt("grouped_nt_alpha", s, x, w, offsets, y)?;
        check_len(g, "grouped_nt_alpha x_amax", x_amax.len(), s.rows)?;
        check_len(g, "grouped_nt_alpha w_amax", w_amax.len(), s.experts)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(true);
        }
        let cfg = self.row_tile_grid("grouped_nt_alpha", Tile::W128x256, s, s.n, NT_MN)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(func);
        b.arg(x).arg(w).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        b.arg(x_amax).arg(w_amax);
        // SAFETY: as grouped_nt_tiled_with's launch on the W128x256 tile; x_amax holds R and
        // w_amax E values (checked): the kernel reads x_amax[r] for rows r < R of its tile and
        // w_amax[e] for its expert e < E. Argument types match (…, u32 × 4, const float* × 2).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(true)
    }

    /// [`Gemm::grouped_nt`] on the small-M kernel: grid `(⌈N/32⌉, E)`, each block reads its
    /// expert's 32 weight rows once with 16-byte loads and computes all of the expert's rows
    /// (8 per pass); blocks of experts without rows exit at once. Also a dense small-M linear
    /// with `E = 1`, `offsets = [0, M]`. Summation on CUDA cores in IEEE f32 (bound
    /// `two_order_sum_bound`).
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_nt_small_m(
        &self,
        x: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        y: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        self.check_nt("grouped_nt_small_m", s, x, w, offsets, y)?;
        if s.experts == 0 || s.rows == 0 || s.n == 0 {
            return Ok(());
        }
        if s.experts > 65_535 {
            return Err(g.err(format!(
                "grouped_nt_small_m: {} experts exceed the grid's y limit 65535",
                s.experts
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (s.n.div_ceil(SMALL_M_COLS) as u32, s.experts as u32, 1),
            block_dim: (SMALL_M_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(&self.nt_small_m);
        b.arg(x).arg(w).arg(offsets).arg(y);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: x holds R·K, w E·N·K, offsets E+1 and y R·N elements (checked); n, k are
        // multiples of 8 and x, w 16-byte aligned (checked), so each lane's 16-byte loads at
        // k = 8l + 256i < K stay inside a row; block (bx, e) reads offsets[e], offsets[e+1]
        // (e < E), clamps them to [0, R], and warps whose columns start at or beyond N exit.
        // Argument types match (const u16*, const u16*, const u32*, float*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Dense small-M forwards sharing one input, in one launch: `y_i[m, n_i] = x[m, k] ·
    /// W_i[n_i, k]ᵀ` for each `(W_i, n_i, y_i)` of `outs` (at most [`DENSE_SMALL_M_OUTPUTS`]),
    /// x and W BF16, y f32 (overwritten). Each column is summed as [`Gemm::grouped_nt_small_m`]
    /// sums it (IEEE f32 on CUDA cores, bound `two_order_sum_bound`), whatever the other
    /// outputs: a layer's q, k and v projections in one launch give the bits of three. The
    /// weights are read once per 8 rows, so this is for small `m` (decode).
    ///
    /// # Errors
    /// No output or more than three; `k` or an `n_i` not a multiple of 8; short or misaligned
    /// buffers; sizes beyond u32; launch errors.
    pub fn dense_nt_small_m(
        &self,
        x: &CudaView<'_, u16>,
        m: usize,
        k: usize,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
    ) -> Result<(), DeviceError> {
        let cols = outs.iter().map(|o| o.1).sum();
        self.dense_nt_small_m_with(dense_small_m_nb(cols), x, m, k, outs)
    }

    /// [`Gemm::dense_nt_small_m`] with `nb` (1 or 2) output columns per warp instead of the
    /// launcher's pick: the same bits, another launch shape.
    ///
    /// # Errors
    /// As [`Gemm::dense_nt_small_m`]; `nb` not 1 or 2.
    pub fn dense_nt_small_m_with(
        &self,
        nb: usize,
        x: &CudaView<'_, u16>,
        m: usize,
        k: usize,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "dense_nt_small_m";
        check_len(g, &format!("{op} x"), x.len(), mul(g, op, m, k)?)?;
        check_align(g, &format!("{op} x"), x.device_ptr(g.stream()).0, 16)?;
        let Some((cfg, ptrs)) = self.small_m_outputs(op, nb, m, k, outs, 0)? else {
            return Ok(());
        };
        let (mm, kk) = (m as u32, k as u32);
        let mut b = g.stream().launch_builder(&self.dense_small_m[nb - 1]);
        b.arg(x).arg(&mm).arg(&kk);
        for (w, y, n) in &ptrs {
            b.arg(w).arg(y).arg(n);
        }
        // SAFETY: x holds m·k elements and each W_i n_i·k, y_i m·n_i (checked); k and every
        // n_i are multiples of 8 and x, W_i 16-byte aligned (checked), so each lane's 16-byte
        // loads stay inside a row; a block's columns start below its output's n_i or its warps
        // exit; the padded slots have n = 0 and get no blocks. The device pointers outlive the
        // launch (borrowed for the call). Argument types match (const u16*, u32, u32, then
        // (const u16*, float*, u32) × 3).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Shared memory [`Gemm::rmsnorm_dense_nt_small_m`] needs for `m` rows of `k`: one pass of
    /// up to 8 normalized BF16 rows.
    pub fn rmsnorm_small_m_smem(m: usize, k: usize) -> usize {
        m.min(8) * k * 2
    }

    /// RMSNorm, then [`Gemm::dense_nt_small_m`] of the normalized rows' BF16 rounding, in one
    /// launch: `y_i = bf16((x·rstd)·nw) · W_iᵀ` with `x [m, k]` f32 and the norm weight `nw [k]`
    /// f32 (decode's attention input and its q, k, v projections). For `k ≥ 256` the operands
    /// are exactly those of the 256-thread RMSNorm kernel (`Norm::forward_bf16`), and each
    /// output the bits [`Gemm::dense_nt_small_m`] gives them; no normalized rows are written.
    ///
    /// # Errors
    /// As [`Gemm::dense_nt_small_m`]; `k < 256`; more shared memory than
    /// [`RMSNORM_SMALL_M_MAX_SMEM`] ([`Gemm::rmsnorm_small_m_smem`]).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_dense_nt_small_m(
        &self,
        x: &CudaView<'_, f32>,
        nw: &CudaView<'_, f32>,
        eps: f32,
        m: usize,
        k: usize,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
    ) -> Result<(), DeviceError> {
        let smem = Self::rmsnorm_small_m_smem(m, k);
        self.norm_small_m(
            "rmsnorm_dense_nt_small_m",
            x,
            nw,
            eps,
            m,
            k,
            outs,
            smem,
            None,
        )
    }

    /// Shared memory [`Gemm::add_rmsnorm_dense_nt_small_m`] needs for `m` rows of `k`: the
    /// normalized BF16 rows and the f32 sums.
    pub fn add_rmsnorm_small_m_smem(m: usize, k: usize) -> usize {
        m * k * 6
    }

    /// Decode's residual add, RMSNorm and a narrow linear (an MoE layer's router) in one
    /// launch: `x_out = o + res`, `rstd`, `yb` (and `y` when given) the norm of `x_out` with
    /// weight `nw` — the bits `Norm::forward_add` writes, for `k ≥ 256` — and
    /// `out = yb · Wᵀ` with the bits of [`Gemm::dense_nt_small_m`]. `o, res, x_out, y: [m, k]`
    /// f32, `yb [m, k]` BF16, `rstd [m]`; `o` is only read. At most 8 rows.
    ///
    /// # Errors
    /// As [`Gemm::rmsnorm_dense_nt_small_m`]; more than 8 rows; short outputs.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn add_rmsnorm_dense_nt_small_m(
        &self,
        (o, res): (&CudaView<'_, f32>, &CudaView<'_, f32>),
        nw: &CudaView<'_, f32>,
        eps: f32,
        m: usize,
        k: usize,
        (x_out, y, yb, rstd): (
            &mut CudaViewMut<'_, f32>,
            Option<&mut CudaViewMut<'_, f32>>,
            &mut CudaViewMut<'_, u16>,
            &mut CudaViewMut<'_, f32>,
        ),
        out: (&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>),
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "add_rmsnorm_dense_nt_small_m";
        if m > 8 {
            return Err(g.err(format!("{op}: {m} rows (at most 8: one pass)")));
        }
        let mk = mul(g, op, m, k)?;
        check_len(g, &format!("{op} residual"), res.len(), mk)?;
        check_len(g, &format!("{op} sum"), x_out.len(), mk)?;
        check_len(g, &format!("{op} BF16 rows"), yb.len(), mk)?;
        check_len(g, &format!("{op} rstd"), rstd.len(), m)?;
        let stream = g.stream();
        let y_ptr = match y {
            Some(y) => {
                check_len(g, &format!("{op} f32 rows"), y.len(), mk)?;
                y.device_ptr_mut(stream).0
            }
            None => 0,
        };
        let add = AddNormPtrs {
            res: res.device_ptr(stream).0,
            x: x_out.device_ptr_mut(stream).0,
            y: y_ptr,
            yb: yb.device_ptr_mut(stream).0,
            rstd: rstd.device_ptr_mut(stream).0,
        };
        let smem = Self::add_rmsnorm_small_m_smem(m, k);
        self.norm_small_m(op, o, nw, eps, m, k, &mut [out], smem, Some(add))
    }

    /// The launch of [`Gemm::rmsnorm_dense_nt_small_m`] and (`add`: the residual and the
    /// norm's outputs) [`Gemm::add_rmsnorm_dense_nt_small_m`].
    #[allow(clippy::too_many_arguments)]
    fn norm_small_m(
        &self,
        op: &str,
        x: &CudaView<'_, f32>,
        nw: &CudaView<'_, f32>,
        eps: f32,
        m: usize,
        k: usize,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
        smem: usize,
        add: Option<AddNormPtrs>,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if k < 256 {
            return Err(g.err(format!(
                "{op}: k = {k}; the 256-thread norm's reduction needs k ≥ 256"
            )));
        }
        if smem > RMSNORM_SMALL_M_MAX_SMEM {
            return Err(g.err(format!(
                "{op}: {m} rows of {k} need {smem} bytes of shared memory (at most \
                 {RMSNORM_SMALL_M_MAX_SMEM})"
            )));
        }
        check_len(g, &format!("{op} x"), x.len(), mul(g, op, m, k)?)?;
        check_len(g, &format!("{op} norm weight"), nw.len(), k)?;
        let cols: usize = outs.iter().map(|o| o.1).sum();
        let nb = dense_small_m_nb(cols);
        let Some((cfg, ptrs)) = self.small_m_outputs(op, nb, m, k, outs, smem)? else {
            return Ok(());
        };
        let (mm, kk) = (m as u32, k as u32);
        let func = match add {
            Some(_) => &self.add_rmsnorm_small_m[nb - 1],
            None => &self.rmsnorm_small_m[nb - 1],
        };
        let mut b = g.stream().launch_builder(func);
        b.arg(x).arg(nw).arg(&eps).arg(&mm).arg(&kk);
        for (w, y, n) in &ptrs {
            b.arg(w).arg(y).arg(n);
        }
        if let Some(a) = &add {
            b.arg(&a.res).arg(&a.x).arg(&a.y).arg(&a.yb).arg(&a.rstd);
        }
        // SAFETY: x holds m·k and nw k f32 (checked), each W_i n_i·k, y_i m·n_i (checked);
        // the block writes `smem` bytes of dynamic shared memory (the launch's size, allowed
        // in `new`: min(m, 8)·k BF16, and with `add` m ≤ 8 rows of k f32 after them) and reads
        // its rows with 16-byte loads (k a multiple of 8); with `add`, block 0 writes m·k
        // elements of x, yb and y (when not null) and m of rstd, and every block reads m·k of
        // res (all checked by the caller); the rest as dense_nt_small_m. Argument types match
        // (const float*, const float*, float, u32, u32, then (const u16*, float*, u32) × 3,
        // then with `add` const float*, float*, float* — 0 for none — u16*, float*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Checks the outputs of the small-M dense launchers (count, widths, lengths, alignment)
    /// and returns the launch shape (`smem` bytes of dynamic shared memory) and the three
    /// (weight, output, width) slots, padded with empty ones; `None` when there is nothing to
    /// launch (outputs zeroed when `k = 0`).
    #[allow(clippy::type_complexity)]
    fn small_m_outputs(
        &self,
        op: &str,
        nb: usize,
        m: usize,
        k: usize,
        outs: &mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)],
        smem: usize,
    ) -> Result<Option<(LaunchConfig, Vec<(u64, u64, u32)>)>, DeviceError> {
        let g = &self.gpu;
        if nb != 1 && nb != 2 {
            return Err(g.err(format!("{op}: {nb} columns per warp (1 or 2)")));
        }
        if outs.is_empty() || outs.len() > DENSE_SMALL_M_OUTPUTS {
            return Err(g.err(format!(
                "{op}: {} outputs (1 to {DENSE_SMALL_M_OUTPUTS})",
                outs.len()
            )));
        }
        if !k.is_multiple_of(8) || outs.iter().any(|o| !o.1.is_multiple_of(8)) {
            return Err(g.err(format!(
                "{op}: k = {k} and every n ({:?}) must be multiples of 8 (16-byte operand loads)",
                outs.iter().map(|o| o.1).collect::<Vec<_>>()
            )));
        }
        let stream = g.stream();
        for (i, (w, n, y)) in outs.iter_mut().enumerate() {
            check_len(g, &format!("{op} w{i}"), w.len(), mul(g, op, *n, k)?)?;
            check_len(g, &format!("{op} y{i}"), y.len(), mul(g, op, m, *n)?)?;
            check_align(g, &format!("{op} w{i}"), w.device_ptr(stream).0, 16)?;
        }
        let cols: usize = outs.iter().map(|o| o.1).sum();
        check_u32(g, op, &[("m", m), ("k", k), ("columns", cols)])?;
        if m == 0 || cols == 0 {
            return Ok(None);
        }
        if k == 0 {
            for (_, n, y) in outs.iter_mut() {
                self.zero(y, m * *n)?;
            }
            return Ok(None);
        }
        let per_block = 8 * nb;
        let blocks: usize = outs.iter().map(|o| o.1.div_ceil(per_block)).sum();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (SMALL_M_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // Unused output slots: no columns (no blocks), any valid pointers.
        let mut ptrs = Vec::with_capacity(DENSE_SMALL_M_OUTPUTS);
        for (w, n, y) in outs.iter_mut() {
            ptrs.push((
                w.device_ptr(stream).0,
                y.device_ptr_mut(stream).0,
                *n as u32,
            ));
        }
        let last = ptrs[ptrs.len() - 1];
        while ptrs.len() < DENSE_SMALL_M_OUTPUTS {
            ptrs.push((last.0, last.1, 0));
        }
        Ok(Some((cfg, ptrs)))
    }

    /// Fused MoE gate/up projection and SwiGLU for small `M` (decode): `act[p, j] =
    /// bf16(silu(g)·u)` with `g, u` the gate and up columns `j`, `F + j` of
    /// `x[t] · W[e]ᵀ` for every packed row `p` of expert `e`, where the token is `t =
    /// perm[p] / top_k` (`x [T, K]` BF16 token rows, `perm [R]` packed row → `token·top_k +
    /// slot`, `W [E, 2F, K]` BF16, `act [R, F]` BF16 bit patterns, overwritten on the experts'
    /// rows). The bits of gathering the rows, [`Gemm::grouped_nt_small_m`] over `W` and the
    /// SwiGLU kernel's BF16 forward, without the gathered rows or the f32 `[R, 2F]` output.
    ///
    /// # Errors
    /// `f` or `k` not a multiple of 8; short or misaligned buffers; `top_k = 0`; sizes beyond
    /// u32 or the grid limits; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_gate_up_swiglu_small_m(
        &self,
        x: &CudaView<'_, u16>,
        tokens: usize,
        perm: &CudaView<'_, u32>,
        top_k: usize,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        act: &mut CudaViewMut<'_, u16>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "grouped_gate_up_swiglu_small_m";
        // s.n = 2F columns of W; s.k = K.
        if !s.n.is_multiple_of(16) || !s.k.is_multiple_of(8) {
            return Err(g.err(format!(
                "{op}: 2F = {} must be a multiple of 16 and k = {} of 8 (16-byte operand loads)",
                s.n, s.k
            )));
        }
        if top_k == 0 {
            return Err(g.err(format!("{op}: top_k = 0")));
        }
        s.check_u32(g, op)?;
        check_u32(g, op, &[("tokens", tokens), ("top_k", top_k)])?;
        let f = s.n / 2;
        let stream = g.stream();
        check_len(g, &format!("{op} x"), x.len(), mul(g, op, tokens, s.k)?)?;
        check_len(g, &format!("{op} perm"), perm.len(), s.rows)?;
        let w_len = mul(g, op, mul(g, op, s.experts, s.n)?, s.k)?;
        check_len(g, &format!("{op} w"), w.len(), w_len)?;
        check_len(g, &format!("{op} offsets"), offsets.len(), s.experts + 1)?;
        check_len(g, &format!("{op} act"), act.len(), mul(g, op, s.rows, f)?)?;
        check_align(g, &format!("{op} x"), x.device_ptr(stream).0, 16)?;
        check_align(g, &format!("{op} w"), w.device_ptr(stream).0, 16)?;
        if s.experts == 0 || s.rows == 0 || f == 0 || tokens == 0 {
            return Ok(());
        }
        if s.experts > 65_535 {
            return Err(g.err(format!(
                "{op}: {} experts exceed the grid's y limit 65535",
                s.experts
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (f.div_ceil(16) as u32, s.experts as u32, 1),
            block_dim: (SMALL_M_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tk, t, e, r, ff, k) = (
            top_k as u32,
            tokens as u32,
            s.experts as u32,
            s.rows as u32,
            f as u32,
            s.k as u32,
        );
        let mut b = g.stream().launch_builder(&self.gate_up_swiglu_small_m);
        b.arg(x)
            .arg(perm)
            .arg(&tk)
            .arg(&t)
            .arg(w)
            .arg(offsets)
            .arg(act);
        b.arg(&e).arg(&r).arg(&ff).arg(&k);
        // SAFETY: x holds T·K, perm R, W E·2F·K, offsets E+1, act R·F elements (checked); the
        // kernel clamps offsets to [0, R] and tokens to T − 1, reads perm only on experts'
        // rows, K is a multiple of 8 and x, W 16-byte aligned (checked), so every 16-byte load
        // stays inside a row; warps whose features start at or beyond F exit. Argument types
        // match (const u16*, const u32*, u32, u32, const u16*, const u32*, u16*, u32 × 4).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Fused MoE down projection, combine and residual for small `M` (decode): for every token
    /// `t < tokens` and column `j < H`, `out[t, j] = Σ_s rw[t, s]·y_s + residual[t, j]` over
    /// the token's valid slots in ascending packed row order (the combine's), where `y_s` is
    /// column `j` of `act[row_of[t, s]] · W[ids[t, s]]ᵀ` (`act [R, F]` BF16 packed rows, `W
    /// [E, H, F]` BF16, `ids`, `row_of`, `rw [tokens·top_k]` as routing wrote them, `out
    /// [tokens, H]` overwritten). The bits of [`Gemm::grouped_nt_small_m`] into `y [R, H]`
    /// followed by [`crate::ops::moe::Moe::combine_add`] (or `combine` without a residual),
    /// without the f32 `y`. `s`: `experts`, `rows = tokens·top_k`, `n = H`, `k = F`.
    ///
    /// # Errors
    /// `F` not a multiple of 8; `top_k` outside 1..=256; short or misaligned buffers; sizes
    /// beyond u32 or the grid limits; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_down_combine_small_m(
        &self,
        act: &CudaView<'_, u16>,
        ids: &CudaView<'_, u32>,
        row_of: &CudaView<'_, u32>,
        rw: &CudaView<'_, f32>,
        top_k: usize,
        w: &CudaView<'_, u16>,
        residual: Option<&CudaView<'_, f32>>,
        out: &mut CudaViewMut<'_, f32>,
        tokens: usize,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let op = "grouped_down_combine_small_m";
        if !s.k.is_multiple_of(8) {
            return Err(g.err(format!(
                "{op}: F = {} must be a multiple of 8 (16-byte operand loads)",
                s.k
            )));
        }
        if top_k == 0 || top_k > 256 {
            return Err(g.err(format!("{op}: top_k {top_k}; 1..=256 supported")));
        }
        if tokens.checked_mul(top_k) != Some(s.rows) {
            return Err(g.err(format!(
                "{op}: {} rows for {tokens} tokens × top_k {top_k}",
                s.rows
            )));
        }
        check_u32(
            g,
            op,
            &[
                ("experts", s.experts),
                ("rows", s.rows),
                ("H", s.n),
                ("F", s.k),
            ],
        )?;
        let stream = g.stream();
        check_len(g, &format!("{op} act"), act.len(), mul(g, op, s.rows, s.k)?)?;
        for (what, len) in [("ids", ids.len()), ("row_of", row_of.len())] {
            check_len(g, &format!("{op} {what}"), len, s.rows)?;
        }
        check_len(g, &format!("{op} weights"), rw.len(), s.rows)?;
        let w_len = mul(g, op, mul(g, op, s.experts, s.n)?, s.k)?;
        check_len(g, &format!("{op} w"), w.len(), w_len)?;
        let out_len = mul(g, op, tokens, s.n)?;
        check_len(g, &format!("{op} out"), out.len(), out_len)?;
        if let Some(r) = residual {
            check_len(g, &format!("{op} residual"), r.len(), out_len)?;
        }
        check_align(g, &format!("{op} act"), act.device_ptr(stream).0, 16)?;
        check_align(g, &format!("{op} w"), w.device_ptr(stream).0, 16)?;
        if tokens == 0 || s.n == 0 {
            return Ok(());
        }
        if s.experts == 0 {
            return Err(g.err(format!("{op}: no experts")));
        }
        if tokens > 65_535 {
            return Err(g.err(format!(
                "{op}: {tokens} tokens exceed the grid's y limit 65535"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (
                s.n.div_ceil(SMALL_M_THREADS as usize / 32) as u32,
                tokens as u32,
                1,
            ),
            block_dim: (SMALL_M_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tk, e, h, f) = (top_k as u32, s.experts as u32, s.n as u32, s.k as u32);
        let null: u64 = 0;
        let mut b = g.stream().launch_builder(&self.down_combine_small_m);
        b.arg(act).arg(ids).arg(row_of).arg(rw).arg(&tk).arg(w);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(out).arg(&e).arg(&h).arg(&f);
        // SAFETY: act holds R·F, ids / row_of / rw R, W E·H·F, out (and the residual) T·H
        // elements (checked). The kernel reads only valid rows (row_of < R is written by the
        // dispatch for every valid slot; MOE_INVALID slots are skipped), clamps expert ids to
        // E − 1, F is a multiple of 8 and act, W are 16-byte aligned (checked), so every
        // 16-byte load stays inside a row; warps past H exit after the block's barriers.
        // Argument types match (const u16*, const u32*, const u32*, const float*, u32, const
        // u16*, const float* or null, float*, u32 × 3).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// Grouped dgrad `dX[r, :] = dY[r, :] · W[e]` for every row `r` of expert `e`: `dY [R, N]`
    /// BF16, `W [E, N, K]` BF16, `dX [R, K]` f32 (overwritten on the experts' rows), f32
    /// accumulation on tensor cores, one launch with [`Gemm::tile`]. Reference, per
    /// expert: [`mxrl_tensor::gemm::matmul_nn`] on the widened values.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_nn(
        &self,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dx: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        self.grouped_nn_with(self.tile(s), dy, w, offsets, dx, s)
    }

    /// [`Gemm::grouped_nn`] with block tile `tile`: grid `(⌈R/rows⌉ + E, ⌈K/cols⌉)`.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_nn_with(
        &self,
        tile: Tile,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dx: &mut CudaViewMut<'_, f32>,
        s: Grouped,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        let w_len = mul(g, "w", mul(g, "w", s.experts, s.n)?, s.k)?;
        let dx_len = mul(g, "dx", s.rows, s.k)?;
        self.check_grouped("grouped_nn", s, (dy, s.n), w, w_len, offsets, dx, dx_len)?;
        if s.experts == 0 || s.rows == 0 || s.k == 0 {
            return Ok(());
        }
        let cfg = self.row_tile_grid("grouped_nn", tile, s, s.k, NN_MN)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b =
            g.stream()
                .launch_builder(self.tiled_kernel(&self.nn_tiled, tile, "grouped_nn")?);
        b.arg(dy).arg(w).arg(offsets).arg(dx);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        // SAFETY: dy holds R·N, w E·N·K, offsets E+1 and dx R·K elements (checked); n, k are
        // multiples of 8 with dy, w 16-byte / dx 8-byte aligned (checked); the kernel clamps
        // offsets to [0, R] and bounds-checks rows < R, n < N and output columns < K
        // (out-of-range chunks zero-filled, not read); the grid covers every row tile
        // (Σ⌈rows_e/rows⌉ ≤ ⌈R/rows⌉ + E); block size `tile.threads()`. Argument types match.
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// [`Gemm::grouped_nn`] of NVFP4 weights given as their `e2m1 × e4m3` values, with each
    /// expert's per-tensor factor applied as the sums are stored, in the one launch of the
    /// `wgmma` tile: `dX[r, :] = fl(Σ · g(e))`, `g(e) = fl(w_amax[e] · R2688)` — the bits of
    /// [`Gemm::grouped_nn`] followed by `QGemm::nvfp4_weight_factor_rows`. Returns `false`
    /// without launching anything where the shape does not take the `wgmma` tile
    /// ([`Gemm::tile`]); the caller then runs the two steps.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nn`]; `w_amax` shorter than the experts.
    pub fn grouped_nn_wfactor(
        &self,
        dy: &CudaView<'_, u16>,
        w: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dx: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        w_amax: &CudaView<'_, f32>,
    ) -> Result<bool, DeviceError> {
        let Some(func) = self.nn_wfactor.as_ref() else {
            return Ok(false);
        };
        if self.tile(s) != Tile::W128x256 {
            return Ok(false);
        }
        let g = &self.gpu;
        let w_len = mul(g, "w", mul(g, "w", s.experts, s.n)?, s.k)?;
        let dx_len = mul(g, "dx", s.rows, s.k)?;
        self.check_grouped(
            "grouped_nn_wfactor",
            s,
            (dy, s.n),
            w,
            w_len,
            offsets,
            dx,
            dx_len,
        )?;
        check_len(g, "grouped_nn_wfactor w_amax", w_amax.len(), s.experts)?;
        if s.experts == 0 || s.rows == 0 || s.k == 0 {
            return Ok(true);
        }
        let cfg = self.row_tile_grid("grouped_nn_wfactor", Tile::W128x256, s, s.k, NN_MN)?;
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let mut b = g.stream().launch_builder(func);
        b.arg(dy).arg(w).arg(offsets).arg(dx);
        b.arg(&e).arg(&r).arg(&n).arg(&k);
        b.arg(w_amax);
        // SAFETY: as grouped_nn_with's launch on the W128x256 tile; w_amax holds E values
        // (checked): the kernel reads w_amax[e] for its expert e < E. Argument types match
        // (…, u32 × 4, const float*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(true)
    }

    /// Grouped wgrad `dW[e] += dY[rows of e]ᵀ · X[rows of e]` for every expert: `dY [R, N]`
    /// BF16, `X [R, K]` BF16, `dW [E, N, K]` f32 (accumulated: `old + Σ`, the sum over the
    /// expert's rows in increasing order on tensor cores, added once). Experts without rows
    /// leave their `dW[e]` untouched. With [`GradWrite::Overwrite`] the old value is taken as
    /// +0 instead of being read (`0 + Σ`: the bits of accumulating into a zeroed buffer, one
    /// f32 read of `dW` fewer) and experts without rows get zeros. One launch with
    /// [`Gemm::tile`]. Reference, per expert: [`mxrl_tensor::gemm::matmul_tn`] on the
    /// widened values plus the old dW.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    pub fn grouped_tn(
        &self,
        dy: &CudaView<'_, u16>,
        x: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dw: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        self.grouped_tn_with(self.tile(s), dy, x, offsets, dw, s, write)
    }

    /// [`Gemm::grouped_tn`] with block tile `tile`: grid `(⌈N/rows⌉, ⌈K/cols⌉, E)`.
    /// Every block of an expert without rows exits at once, or, overwriting, writes zeros.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_tn_with(
        &self,
        tile: Tile,
        dy: &CudaView<'_, u16>,
        x: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dw: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        self.grouped_tn_parts_with(tile, dy, x, offsets, dw, s, 1, write)
    }

    /// Grouped wgrad of an activation given as `parts` stacked BF16 parts `X = Σ_p X_p`
    /// (`x: [parts, R, K]`, e.g. the three exact BF16 parts of NVFP4's dequantized rows):
    /// `dW[e] += Σ_p dY[rows of e]ᵀ · X_p[rows of e]` as **one** sum per output on tensor
    /// cores, over `parts × rows_e` products, added to (or, [`GradWrite::Overwrite`], stored
    /// over) `dW` once, in one launch with [`Gemm::tile`]. The products are the ones `parts`
    /// calls of [`Gemm::grouped_tn`] on the parts would add; the sum takes the expert's rows
    /// in groups of 64 in increasing order, each group's rows of part 0, 1, … in turn (k16
    /// groups in increasing order within each), the same order on every tile. So it differs
    /// from those calls only in the summation order: against the per-expert reference
    /// [`mxrl_tensor::gemm::matmul_tn`] of `dY` stacked `parts` times by the stacked parts
    /// (plus the old dW), the bound is `tensor_core_sum_bound` over `parts × rows_e` terms (one
    /// more with the old value). `parts = 1` is [`Gemm::grouped_tn`], bit for bit.
    ///
    /// # Errors
    /// As [`Gemm::grouped_nt`]; `parts` not in `1..=`[`MAX_TN_PARTS`]; `x` shorter than
    /// `parts × R × K`.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_tn_parts(
        &self,
        dy: &CudaView<'_, u16>,
        x: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dw: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        parts: usize,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        self.grouped_tn_parts_with(self.tile(s), dy, x, offsets, dw, s, parts, write)
    }

    /// [`Gemm::grouped_tn_parts`] with block tile `tile` (grid as [`Gemm::grouped_tn_with`]).
    ///
    /// # Errors
    /// As [`Gemm::grouped_tn_parts`].
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_tn_parts_with(
        &self,
        tile: Tile,
        dy: &CudaView<'_, u16>,
        x: &CudaView<'_, u16>,
        offsets: &CudaView<'_, u32>,
        dw: &mut CudaViewMut<'_, f32>,
        s: Grouped,
        parts: usize,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        let g = &self.gpu;
        if !(1..=MAX_TN_PARTS).contains(&parts) {
            return Err(g.err(format!("grouped_tn: {parts} parts (1 to {MAX_TN_PARTS})")));
        }
        let x_len = mul(g, "x", mul(g, "x", parts, s.rows)?, s.k)?;
        let dw_len = mul(g, "dw", mul(g, "dw", s.experts, s.n)?, s.k)?;
        self.check_grouped("grouped_tn", s, (dy, s.n), x, x_len, offsets, dw, dw_len)?;
        if s.experts == 0 || s.n == 0 || s.k == 0 {
            return Ok(());
        }
        if s.rows == 0 {
            return match write {
                GradWrite::Accumulate => Ok(()),
                GradWrite::Overwrite => self.zero(dw, dw_len),
            };
        }
        let (gx, gy) = (s.n.div_ceil(tile.rows()), s.k.div_ceil(tile.cols()));
        if gy > 65_535 || s.experts > 65_535 {
            return Err(g.err(format!(
                "grouped_tn: k = {} or {} experts exceed the grid limits (65535 tiles / experts)",
                s.k, s.experts
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (gx as u32, gy as u32, s.experts as u32),
            block_dim: (tile.threads(), 1, 1),
            shared_mem_bytes: tile.smem_bytes(TN_MN.0, TN_MN.1) as u32,
        };
        let (e, r, n, k) = (s.experts as u32, s.rows as u32, s.n as u32, s.k as u32);
        let overwrite = u32::from(write == GradWrite::Overwrite);
        let parts_u32 = parts as u32;
        let mut b =
            g.stream()
                .launch_builder(self.tiled_kernel(&self.tn_tiled, tile, "grouped_tn")?);
        b.arg(dy).arg(x).arg(offsets).arg(dw);
        b.arg(&e)
            .arg(&r)
            .arg(&n)
            .arg(&k)
            .arg(&overwrite)
            .arg(&parts_u32);
        // SAFETY: dy holds R·N, x parts·R·K, offsets E+1 and dw E·N·K elements (checked;
        // parts ≤ 8, so the kernel's u32 stage count, ≤ 16·⌈R/64⌉, cannot wrap); n, k are multiples of 8 with
        // dy, x 16-byte / dw 8-byte aligned (checked; part p starts p·R·K elements, a multiple
        // of 8, into x); block (·, ·, e) reads offsets[e], offsets[e+1] (e < E), clamps them
        // to [0, R], and bounds-checks n < N, k < K and rows < offsets[e+1] of each part
        // (out-of-range chunks zero-filled, not read); block size `tile.threads()`. Argument
        // types match (…, u32 × 6).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|e| g.err(e))?;
        Ok(())
    }

    /// The tiles this device runs ([`Tile::W128x256`] only on sm_90).
    pub fn tiles(&self) -> Vec<Tile> {
        Tile::ALL
            .into_iter()
            .filter(|t| self.nt_tiled[t.index()].is_some())
            .collect()
    }

    /// The tile of the plain dgrad and wgrad launchers: [`Tile::W128x256`] for experts of 128
    /// rows or more on average where the device has `wgmma` (unless `MXRL_WGMMA=off`), else
    /// [`Tile::for_shape`].
    pub fn tile(&self, s: Grouped) -> Tile {
        match Tile::for_shape(s) {
            Tile::T128 if self.wgmma => Tile::W128x256,
            t => t,
        }
    }

    /// The forward's tile: as [`Gemm::tile`], with [`Tile::for_forward`] where `wgmma` is not
    /// used.
    pub fn forward_tile(&self, s: Grouped) -> Tile {
        match self.tile(s) {
            Tile::W128x256 => Tile::W128x256,
            _ => Tile::for_forward(s),
        }
    }

    fn tiled_kernel<'a>(
        &self,
        kernels: &'a [Option<CudaFunction>; 5],
        tile: Tile,
        op: &str,
    ) -> Result<&'a CudaFunction, DeviceError> {
        kernels[tile.index()].as_ref().ok_or_else(|| {
            self.gpu.err(format!(
                "{op}: the {tile:?} tile needs Hopper's wgmma (an sm_90 device); this one has none"
            ))
        })
    }

    /// Launch shape of the row-tiled grouped kernels: `(⌈cols/tile cols⌉, ⌈R/rows⌉ + E)` blocks.
    fn row_tile_grid(
        &self,
        op: &str,
        tile: Tile,
        s: Grouped,
        cols: usize,
        (a_mn, b_mn): (bool, bool),
    ) -> Result<LaunchConfig, DeviceError> {
        // Column tiles along x (the fastest-launched index): the blocks that share a row tile
        // run together and read its activation rows from L2 instead of once per column sweep.
        let gy = s.rows.div_ceil(tile.rows()) + s.experts;
        let gx = cols.div_ceil(tile.cols());
        if gx > i32::MAX as usize || gy > 65_535 {
            return Err(self
                .gpu
                .err(format!("{op}: grid ({gx}, {gy}) exceeds the launch limits")));
        }
        Ok(LaunchConfig {
            grid_dim: (gx as u32, gy as u32, 1),
            block_dim: (tile.threads(), 1, 1),
            shared_mem_bytes: tile.smem_bytes(a_mn, b_mn) as u32,
        })
    }
}

/// The residual and the norm's outputs of [`Gemm::add_rmsnorm_dense_nt_small_m`] (device
/// addresses, `y` 0 for none).
struct AddNormPtrs {
    res: u64,
    x: u64,
    y: u64,
    yb: u64,
    rstd: u64,
}
