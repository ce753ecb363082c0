//! The CUDA device: NVRTC-compiled quantizer kernels and their typed launchers.
//!
//! The only `unsafe` of mxrl outside memory-mapping and the GEMM wrapper lives here: one
//! launcher per kernel, each checking shapes and stating why the launch is sound.
#![allow(unsafe_code)]

use crate::{module_cache_key, module_source, DeviceError, Input, QuantDevice, NVRTC_OPTIONS};
use cudarc::cublas::{sys as cublas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use mxrl_formats::{
    AmaxScope, Format, FormatError, Fp8BlockScheme, Fp8Blocks, MxBlocks, Nvfp4Blocks,
    QuantizedTensor, ScaleLayout, ScaleRule, Scales, Scheme, Usage, FP8_BLOCK, MXFP8_BLOCK,
    NVFP4_BLOCK,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const THREADS: u32 = 256;
/// CTA size of the column-wise register kernel.
const COL_REG_THREADS: u32 = 128;
/// The per-row NVFP4 kernel's compiled variants: 16-blocks per thread kept in registers
/// (`nvfp4_row_reg{C}_{f32,bf16}` in kernels/quant.cu).
pub const NVFP4_ROW_CHUNKS: [usize; 4] = [1, 2, 4, 8];
/// The variant the launcher takes by default, per input type (f32, BF16).
pub const NVFP4_ROW_CHUNKS_DEFAULT: (usize, usize) = (4, 4);
/// Resident CTAs per SM the per-tensor amax grid is sized for (256 threads, 32 registers).
const AMAX_CTAS_PER_SM: u32 = 8;
/// CTA size of the FP8-block weight quantizer (`FP8W_THREADS` in kernels/quant.cu).
const FP8W_THREADS: u32 = 256;

/// Compiled modules by `(device ordinal, cache key)`; the key covers source and options.
type ModuleCache = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;

fn module_cache() -> &'static ModuleCache {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// NVFP4 amax entries of a `shape` input: one per tensor, or one per row.
fn amax_len(shape: [usize; 2], scope: AmaxScope) -> usize {
    match scope {
        AmaxScope::PerTensor => 1,
        AmaxScope::PerRow => shape[0],
    }
}

/// Shared devices by ordinal (tests and tools reuse one context and module per GPU).
fn device_cache() -> &'static Mutex<HashMap<usize, Arc<CudaDevice>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

struct Kernels {
    mxfp8_row_f32: CudaFunction,
    mxfp8_row_bf16: CudaFunction,
    mxfp8_col_f32: CudaFunction,
    mxfp8_col_bf16: CudaFunction,
    mxfp8_col_reg_f32: CudaFunction,
    mxfp8_col_reg_bf16: CudaFunction,
    /// Per `NVFP4_ROW_CHUNKS` entry: (f32, BF16) input.
    nvfp4_row_reg: Vec<(CudaFunction, CudaFunction)>,
    amax_tensor_f32: CudaFunction,
    amax_tensor_bf16: CudaFunction,
    mxfp8_row_dequantize: CudaFunction,
    amax_f32: CudaFunction,
    amax_bf16: CudaFunction,
    nvfp4_blocks_f32: CudaFunction,
    nvfp4_blocks_bf16: CudaFunction,
    nvfp4_dequantize: CudaFunction,
    nvfp4_prescaled: CudaFunction,
    nvfp4_apply_alpha: CudaFunction,
    fp8_block_act_f32: CudaFunction,
    fp8_block_act_bf16: CudaFunction,
    fp8_block_weight_f32: CudaFunction,
    fp8_block_weight_bf16: CudaFunction,
    fp8_block_dequantize: CudaFunction,
}

/// The FP8-block schemes this device quantizes: either block shape, either FP32 scale rule.
fn fp8_block_scheme(scheme: Scheme) -> Option<Fp8BlockScheme> {
    match scheme {
        Scheme::Fp8Block(s)
            if matches!(s.scale_rule, ScaleRule::F32Exact | ScaleRule::F32PowerOfTwo) =>
        {
            Some(s)
        }
        _ => None,
    }
}

/// The element type of a quantizer's high-precision input.
#[derive(Clone, Copy)]
enum Elem {
    /// f32 values.
    F32,
    /// BF16 bit patterns.
    Bf16,
}

/// Rows of one FP8-block scale: 128 for 128×128 weight tiles, 1 for 1×128 activation blocks.
fn fp8_tile_rows(s: Fp8BlockScheme) -> usize {
    match s.blocks {
        Fp8Blocks::Weight128x128 => FP8_BLOCK,
        Fp8Blocks::Activation1x128 => 1,
    }
}

/// `f32` values as their little-endian bytes (how FP8-block scales sit in a device byte
/// buffer, and how the checksums of stored weights read them).
pub(crate) fn f32_le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes back to `f32` values (a trailing partial value is dropped; callers
/// check the length).
pub(crate) fn f32_from_le_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A high-precision input resident on the GPU (BF16 kept as its 16-bit pattern).
pub enum DeviceInput {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// BF16 bit patterns.
    Bf16(CudaSlice<u16>),
}

/// A borrowed high-precision input on the GPU (a view of a buffer the caller owns, e.g. an
/// engine's parameter): what every quantizer reads.
pub enum InputView<'a> {
    /// f32 values.
    F32(CudaView<'a, f32>),
    /// BF16 bit patterns.
    Bf16(CudaView<'a, u16>),
}

impl InputView<'_> {
    fn len(&self) -> usize {
        match self {
            InputView::F32(s) => s.len(),
            InputView::Bf16(s) => s.len(),
        }
    }
}

impl DeviceInput {
    /// A view of the whole input.
    pub fn view(&self) -> InputView<'_> {
        match self {
            DeviceInput::F32(s) => InputView::F32(s.as_view()),
            DeviceInput::Bf16(s) => InputView::Bf16(s.as_view()),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            DeviceInput::F32(s) => 4 * s.len(),
            DeviceInput::Bf16(s) => 2 * s.len(),
        }
    }
}

/// A quantized tensor resident on the GPU: data, compact scales and (NVFP4) amax bit patterns.
pub struct DeviceQuantized {
    /// The scheme.
    pub scheme: Scheme,
    /// `[M, K]`.
    pub shape: [usize; 2],
    /// Element bytes.
    pub data: CudaSlice<u8>,
    /// Compact scales: bytes (MXFP8, NVFP4), or the f32 `scale_inv` of every block as
    /// little-endian bytes (FP8 block).
    pub scales: CudaSlice<u8>,
    /// NVFP4 amax as f32 bit patterns (per tensor: 1, per row: M); empty otherwise.
    pub amax_bits: Option<CudaSlice<u32>>,
}

/// Timing of one quantizer against a device-to-device copy of the same input, measured with
/// CUDA events in one run.
#[derive(Debug, Clone)]
pub struct QuantizeTiming {
    /// Scheme name.
    pub scheme: String,
    /// Input shape.
    pub shape: [usize; 2],
    /// Input dtype (`f32` / `bf16`).
    pub dtype: &'static str,
    /// Bytes the quantizer must move: the input counted once + data + scales + amax written.
    /// Per-tensor NVFP4 reads the input twice (amax pass, then quantize pass); the second
    /// read is not credited, so its ratio to the copy is bounded by
    /// (input + outputs) / (2·input + outputs) when the input does not stay in L2.
    pub quantize_bytes: usize,
    /// Mean milliseconds per quantize call.
    pub quantize_ms: f64,
    /// Bytes the copy moves (input read + written).
    pub memcpy_bytes: usize,
    /// Mean milliseconds per copy.
    pub memcpy_ms: f64,
}

impl QuantizeTiming {
    /// Quantizer throughput, GB/s (10⁹ bytes).
    pub fn quantize_gbps(&self) -> f64 {
        self.quantize_bytes as f64 / self.quantize_ms / 1e6
    }
    /// Copy throughput, GB/s.
    pub fn memcpy_gbps(&self) -> f64 {
        self.memcpy_bytes as f64 / self.memcpy_ms / 1e6
    }
}

/// One CUDA GPU with the quantizer module loaded.
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    options: Vec<String>,
    cache_key: String,
    k: Kernels,
    /// Streaming multiprocessors (sizes the per-tensor amax grid to the resident CTAs).
    sms: u32,
    blas: Mutex<Option<CudaBlas>>,
    /// `set_nvfp4_row_chunks`: 0 = the default per input type.
    nvfp4_row_chunks: std::sync::atomic::AtomicUsize,
}

impl CudaDevice {
    fn err(&self, what: impl std::fmt::Display) -> DeviceError {
        DeviceError::Cuda {
            device: self.name(),
            what: what.to_string(),
        }
    }

    /// Open GPU `ordinal`, compile (or reuse) the quantizer module.
    ///
    /// # Errors
    /// No driver / no such GPU (the driver's message), or an NVRTC compile error with its log.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let dev = format!("cuda:{ordinal}");
        let e = |what: String| DeviceError::Cuda {
            device: dev.clone(),
            what,
        };
        // SAFETY: only asks whether the dynamically loaded driver library can be found.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(e(
                "the CUDA driver library (libcuda) cannot be loaded".into()
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|x| e(format!("cuInit/context: {x:?}")))?;
        let stream = ctx.default_stream();
        Self::open(ordinal, ctx, stream)
    }

    /// The quantizers of `gpu` on the engine's stream (`gpu.stream()`), so that their buffers
    /// are ordered with the engine's ops without any cross-stream synchronization (the
    /// quantized linear layer, [`crate::ops::qlinear`]). Same module as [`CudaDevice::new`].
    ///
    /// # Errors
    /// As [`CudaDevice::new`].
    pub fn on_gpu(gpu: &crate::gpu::Gpu) -> Result<Self, DeviceError> {
        Self::open(gpu.ordinal(), gpu.ctx().clone(), gpu.stream().clone())
    }

    /// Compile (or reuse) the quantizer module on `ctx` and launch on `stream`.
    fn open(
        ordinal: usize,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
    ) -> Result<Self, DeviceError> {
        let dev = format!("cuda:{ordinal}");
        let e = |what: String| DeviceError::Cuda {
            device: dev.clone(),
            what,
        };
        let name = format!(
            "{dev} ({})",
            ctx.name().unwrap_or_else(|_| "unknown".into())
        );
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|x| e(format!("compute capability: {x:?}")))?;
        let arch = crate::gpu::arch_for(major, minor);
        let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        if let Some(a) = arch {
            options.push(format!("--gpu-architecture={a}"));
        }
        let source = module_source();
        let cache_key = module_cache_key(&source, &options);
        let module = {
            let mut cache = module_cache().lock().expect("module cache poisoned");
            match cache.get(&(ordinal, cache_key.clone())) {
                Some(m) => m.clone(),
                None => {
                    let m = crate::gpu::load_module_cached(
                        &ctx,
                        &name,
                        "mxrl_quant",
                        &source,
                        &cache_key,
                        arch,
                        &options,
                    )?;
                    cache.insert((ordinal, cache_key.clone()), m.clone());
                    m
                }
            }
        };
        let f = |n: &str| {
            module
                .load_function(n)
                .map_err(|x| e(format!("kernel {n}: {x:?}")))
        };
        let k = Kernels {
            mxfp8_row_f32: f("mxfp8_row_f32")?,
            mxfp8_row_bf16: f("mxfp8_row_bf16")?,
            mxfp8_col_f32: f("mxfp8_col_f32")?,
            mxfp8_col_bf16: f("mxfp8_col_bf16")?,
            mxfp8_col_reg_f32: f("mxfp8_col_reg_f32")?,
            mxfp8_col_reg_bf16: f("mxfp8_col_reg_bf16")?,
            nvfp4_row_reg: NVFP4_ROW_CHUNKS
                .iter()
                .map(|c| {
                    Ok((
                        f(&format!("nvfp4_row_reg{c}_f32"))?,
                        f(&format!("nvfp4_row_reg{c}_bf16"))?,
                    ))
                })
                .collect::<Result<_, DeviceError>>()?,
            amax_tensor_f32: f("amax_tensor_f32")?,
            amax_tensor_bf16: f("amax_tensor_bf16")?,
            mxfp8_row_dequantize: f("mxfp8_row_dequantize")?,
            amax_f32: f("amax_f32")?,
            amax_bf16: f("amax_bf16")?,
            nvfp4_blocks_f32: f("nvfp4_blocks_f32")?,
            nvfp4_blocks_bf16: f("nvfp4_blocks_bf16")?,
            nvfp4_dequantize: f("nvfp4_dequantize")?,
            nvfp4_prescaled: f("nvfp4_prescaled")?,
            nvfp4_apply_alpha: f("nvfp4_apply_alpha")?,
            fp8_block_act_f32: f("fp8_block_act_f32")?,
            fp8_block_act_bf16: f("fp8_block_act_bf16")?,
            fp8_block_weight_f32: f("fp8_block_weight_f32")?,
            fp8_block_weight_bf16: f("fp8_block_weight_bf16")?,
            fp8_block_dequantize: f("fp8_block_dequantize")?,
        };
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|x| e(format!("multiprocessor count: {x:?}")))?
            .max(1) as u32;
        Ok(CudaDevice {
            ordinal,
            name,
            ctx,
            stream,
            options,
            cache_key,
            k,
            sms,
            blas: Mutex::new(None),
            nvfp4_row_chunks: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Which compiled variant of the per-row NVFP4 kernel the launcher takes: `Some(c)` with
    /// `c` in [`NVFP4_ROW_CHUNKS`] (16-blocks per thread kept in registers), `None` the default
    /// per input type. Every variant writes the same bytes; `mxrl bench quantize` times them.
    ///
    /// # Errors
    /// A count that is not compiled.
    pub fn set_nvfp4_row_chunks(&self, chunks: Option<usize>) -> Result<(), DeviceError> {
        let c = chunks.unwrap_or(0);
        if c != 0 && !NVFP4_ROW_CHUNKS.contains(&c) {
            return Err(self.err(format!(
                "per-row NVFP4 kernel with {c} blocks per thread: compiled are {NVFP4_ROW_CHUNKS:?}"
            )));
        }
        self.nvfp4_row_chunks
            .store(c, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The process-wide shared device for `ordinal` (opened on first use).
    ///
    /// # Errors
    /// As [`CudaDevice::new`].
    pub fn shared(ordinal: usize) -> Result<Arc<CudaDevice>, DeviceError> {
        let mut cache = device_cache().lock().expect("device cache poisoned");
        if let Some(d) = cache.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(CudaDevice::new(ordinal)?);
        cache.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The NVRTC options the module was compiled with.
    pub fn nvrtc_options(&self) -> &[String] {
        &self.options
    }

    /// The module cache key (source + options).
    pub fn module_key(&self) -> &str {
        &self.cache_key
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Copy a host input to the GPU.
    ///
    /// # Errors
    /// A driver error.
    pub fn upload(&self, x: Input<'_>) -> Result<DeviceInput, DeviceError> {
        Ok(match x {
            Input::F32(v) => DeviceInput::F32(self.stream.clone_htod(v).map_err(|e| self.err(e))?),
            Input::Bf16(v) => {
                let bits: Vec<u16> = v.iter().map(|b| b.to_bits()).collect();
                DeviceInput::Bf16(self.stream.clone_htod(&bits).map_err(|e| self.err(e))?)
            }
        })
    }

    /// An output buffer every element of which the next kernel writes.
    fn output<T: cudarc::driver::DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, DeviceError> {
        // SAFETY: the buffer is only handed to a launcher whose kernel writes each of its
        // `len` elements before anything reads it (stated in that launcher's SAFETY comment).
        unsafe { self.stream.alloc::<T>(len) }.map_err(|e| self.err(e))
    }

    /// A launch of `f32k` or `bf16k` by the input's element type, with the input as its
    /// first argument.
    fn launch_on<'a>(
        &'a self,
        x: &'a InputView<'a>,
        f32k: &'a CudaFunction,
        bf16k: &'a CudaFunction,
    ) -> LaunchArgs<'a> {
        let mut b = self.stream.launch_builder(match x {
            InputView::F32(_) => f32k,
            InputView::Bf16(_) => bf16k,
        });
        match x {
            InputView::F32(s) => b.arg(s),
            InputView::Bf16(s) => b.arg(s),
        };
        b
    }

    fn grid(&self, threads_total: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (threads_total.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<(), DeviceError> {
        let n = shape[0] * shape[1];
        if x.len() != n {
            return Err(FormatError::LengthMismatch {
                what: "input",
                shape: shape.to_vec(),
                expected: n,
                got: x.len(),
            }
            .into());
        }
        let (bm, bk) = match scheme {
            Scheme::MXFP8_ROW => (1, MXFP8_BLOCK),
            Scheme::MXFP8_COL => (MXFP8_BLOCK, 1),
            Scheme::Nvfp4(s) if s.blocks == Nvfp4Blocks::Vector => (1, NVFP4_BLOCK),
            other => match fp8_block_scheme(other) {
                Some(s) => (fp8_tile_rows(s), FP8_BLOCK),
                None => {
                    return Err(DeviceError::Unsupported {
                        device: self.name(),
                        scheme: other.name(),
                    })
                }
            },
        };
        for (dim, size, block) in [("M", shape[0], bm), ("K", shape[1], bk)] {
            if size % block != 0 {
                return Err(FormatError::NotMultiple {
                    scheme: scheme.name(),
                    dim,
                    size,
                    block,
                    shape: shape.to_vec(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Launch the MXFP8 row-wise quantizer (`mxfp8_row_{f32,bf16}`): four threads per
    /// 32-element block along K. Returns data `[M, K]` and scales `[M, K/32]`.
    ///
    /// # Errors
    /// Shape errors (K % 32 ≠ 0, length mismatch) or a driver error.
    pub fn mxfp8_row(
        &self,
        x: &DeviceInput,
        shape: [usize; 2],
    ) -> Result<DeviceQuantized, DeviceError> {
        let mut q = self.alloc_quantized(shape, Scheme::MXFP8_ROW)?;
        self.quantize_device_into(x, shape, Scheme::MXFP8_ROW, &mut q)?;
        Ok(q)
    }

    fn mxfp8_row_into(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        data: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), DeviceError> {
        self.check(x, shape, Scheme::MXFP8_ROW)?;
        let n = x.len();
        self.check_out(data.len(), n, scales.len(), n / MXFP8_BLOCK)?;
        let n_blocks = (n / MXFP8_BLOCK) as u64;
        if n > 0 {
            // Two quarters per thread: t and t + half, half a multiple of 32.
            let half = (n / 8).div_ceil(2).next_multiple_of(32);
            let cfg = self.grid(half);
            let half = half as u64;
            let mut b = self.launch_on(x, &self.k.mxfp8_row_f32, &self.k.mxfp8_row_bf16);
            b.arg(data).arg(scales).arg(&n_blocks).arg(&half);
            // SAFETY: the grid covers `half` threads, each taking quarters q = t and t + half
            // with 2·half ≥ n/8 = 4·n_blocks; for q < 4·n_blocks it reads x[8q..8q+8) with one
            // or two 16-byte loads (aligned: allocation base + 16·q or 32·q bytes) and writes
            // data[8q..8q+8) as one aligned u64 and, for q % 4 == 0, scales[q/4]; x and data
            // hold n elements, scales n/32 (checked above); quarters past n/8 only shuffle
            // zeros and write nothing (half % 32 == 0 keeps both quarters of a thread on one
            // lane group); arguments match the C signature (T*, u8*, u8*, u64, u64).
            unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    /// Launch the MXFP8 column-wise quantizer, quantized from the high-precision input: one
    /// thread per (32-row strip, 8 bytes of columns: four BF16 or two f32), the strip held in
    /// registers so the input is read once (`mxfp8_col_reg_{f32,bf16}`), when K is a multiple
    /// of that column count; else one thread per (32-row strip, column)
    /// (`mxfp8_col_{f32,bf16}`); the same bytes either way. Data `[M, K]`, scales `[M/32, K]`.
    ///
    /// # Errors
    /// Shape errors (M % 32 ≠ 0, length mismatch) or a driver error.
    pub fn mxfp8_col(
        &self,
        x: &DeviceInput,
        shape: [usize; 2],
    ) -> Result<DeviceQuantized, DeviceError> {
        let mut q = self.alloc_quantized(shape, Scheme::MXFP8_COL)?;
        self.quantize_device_into(x, shape, Scheme::MXFP8_COL, &mut q)?;
        Ok(q)
    }

    fn mxfp8_col_into(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        data: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), DeviceError> {
        self.check(x, shape, Scheme::MXFP8_COL)?;
        let n = x.len();
        self.check_out(data.len(), n, scales.len(), n / MXFP8_BLOCK)?;
        let (strips, cols) = ((shape[0] / MXFP8_BLOCK) as u64, shape[1] as u64);
        if n == 0 {
            return Ok(());
        }
        // Columns per thread of the register kernel: 8 bytes of one row.
        let group: u64 = match x {
            InputView::F32(_) => 2,
            InputView::Bf16(_) => 4,
        };
        let reg = cols.is_multiple_of(group);
        let cfg = if reg {
            // 128 threads: the kernel holds 32 rows × 8 bytes per thread (~150 registers), so
            // small CTAs let several share an SM and overlap loads with encoding.
            let threads = (strips * cols / group) as usize;
            LaunchConfig {
                grid_dim: (threads.div_ceil(COL_REG_THREADS as usize) as u32, 1, 1),
                block_dim: (COL_REG_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else {
            self.grid((strips * cols) as usize)
        };
        let mut b = if reg {
            self.launch_on(x, &self.k.mxfp8_col_reg_f32, &self.k.mxfp8_col_reg_bf16)
        } else {
            self.launch_on(x, &self.k.mxfp8_col_f32, &self.k.mxfp8_col_bf16)
        };
        b.arg(data).arg(scales).arg(&strips).arg(&cols);
        // SAFETY: col_reg (K % G == 0, G = 2 for f32, 4 for BF16): thread t < strips·K/G
        // reads and writes rows 32·(t/(K/G))..+32 of columns G·(t%(K/G))..+G (8-byte loads,
        // G-byte stores, aligned: the element offset is a multiple of G, the bases 256-byte
        // aligned) and scales[strip·K + col..+G] as one G-byte word; col: thread t < strips·K
        // reads and writes
        // rows 32·(t/K)..+32 of column t%K and scales[t]; all < M·K = n elements (M =
        // 32·strips), scales n/32 (checked above); threads past the count return first;
        // argument types match (T*, u8*, u8*, u64, u64).
        unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Output buffers of `scheme` for an input of `shape` (every byte written by the next
    /// quantize into them): for [`CudaDevice::quantize_device_into`].
    ///
    /// # Errors
    /// Unsupported scheme, shape errors, out of device memory.
    pub fn alloc_quantized(
        &self,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<DeviceQuantized, DeviceError> {
        let n = shape[0]
            .checked_mul(shape[1])
            .ok_or_else(|| self.err(format!("shape {shape:?} overflows")))?;
        let (data, scales, amax) = match scheme {
            Scheme::MXFP8_ROW | Scheme::MXFP8_COL => (n, n / MXFP8_BLOCK, None),
            Scheme::Nvfp4(s) if s.blocks == Nvfp4Blocks::Vector => {
                (n / 2, n / NVFP4_BLOCK, Some(amax_len(shape, s.amax)))
            }
            other => match fp8_block_scheme(other) {
                // f32 scale_inv per block, as raw little-endian bytes.
                Some(s) => {
                    let blocks = shape[0].div_ceil(fp8_tile_rows(s)) * shape[1].div_ceil(FP8_BLOCK);
                    (n, 4 * blocks, None)
                }
                None => {
                    return Err(DeviceError::Unsupported {
                        device: self.name(),
                        scheme: other.name(),
                    })
                }
            },
        };
        Ok(DeviceQuantized {
            scheme,
            shape,
            data: self.output::<u8>(data)?,
            scales: self.output::<u8>(scales)?,
            amax_bits: match amax {
                Some(a) => Some(self.output::<u32>(a)?),
                None => None,
            },
        })
    }

    /// Quantize an input already on the GPU with `scheme` into `out`'s buffers (made by
    /// [`CudaDevice::alloc_quantized`] for the same shape and scheme): nothing is allocated.
    ///
    /// # Errors
    /// Unsupported scheme, shape or output mismatch, driver errors.
    pub fn quantize_device_into(
        &self,
        x: &DeviceInput,
        shape: [usize; 2],
        scheme: Scheme,
        out: &mut DeviceQuantized,
    ) -> Result<(), DeviceError> {
        self.quantize_view_into(&x.view(), shape, scheme, out)
    }

    /// [`CudaDevice::quantize_device_into`] of a view of a buffer the caller keeps (the first
    /// `M·K` elements are the tensor): the same bytes, without a copy of the input.
    ///
    /// # Errors
    /// As [`CudaDevice::quantize_device_into`].
    pub fn quantize_view_into(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scheme: Scheme,
        out: &mut DeviceQuantized,
    ) -> Result<(), DeviceError> {
        if out.scheme != scheme || out.shape != shape {
            return Err(self.err(format!(
                "quantize into a {} {:?} output with {} {shape:?}",
                out.scheme.name(),
                out.shape,
                scheme.name()
            )));
        }
        match scheme {
            Scheme::MXFP8_ROW => self.mxfp8_row_into(x, shape, &mut out.data, &mut out.scales),
            Scheme::MXFP8_COL => self.mxfp8_col_into(x, shape, &mut out.data, &mut out.scales),
            Scheme::Nvfp4(s) if s.blocks == Nvfp4Blocks::Vector => {
                let amax = out
                    .amax_bits
                    .as_mut()
                    .ok_or_else(|| self.err("NVFP4 output without an amax buffer"))?;
                self.nvfp4_into(x, shape, s.amax, amax, &mut out.data, &mut out.scales)
            }
            other => match fp8_block_scheme(other) {
                Some(s) => self.fp8_block_into(x, shape, s, &mut out.data, &mut out.scales),
                None => Err(DeviceError::Unsupported {
                    device: self.name(),
                    scheme: other.name(),
                }),
            },
        }
    }

    /// FP8-block quantization (`s`) of `x` into `data` / `scales`: [`CudaDevice::fp8_block_launch`]
    /// after the input checks of every scheme.
    fn fp8_block_into(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        s: Fp8BlockScheme,
        data: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), DeviceError> {
        self.check(x, shape, Scheme::Fp8Block(s))?;
        let (mut d, mut sc) = (data.as_view_mut(), scales.as_view_mut());
        match x {
            InputView::F32(v) => self.fp8_block_launch(v, Elem::F32, shape, s, &mut d, &mut sc),
            InputView::Bf16(v) => self.fp8_block_launch(v, Elem::Bf16, shape, s, &mut d, &mut sc),
        }
    }

    /// FP8-block quantization (`s`) of the first `M·K` values of an f32 device view (e.g. an
    /// engine buffer longer than the tensor) into caller buffers: codes into `data` (`M·K`
    /// bytes), the f32 `scale_inv` of every block into `scales` (little-endian bytes). The
    /// bytes of [`CudaDevice::quantize_device`].
    ///
    /// # Errors
    /// A scheme that is not FP8 block, M or K not multiples of the block, short or misaligned
    /// buffers, driver errors.
    pub(crate) fn fp8_block_f32_into(
        &self,
        x: &CudaView<'_, f32>,
        shape: [usize; 2],
        scheme: Scheme,
        data: &mut CudaViewMut<'_, u8>,
        scales: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), DeviceError> {
        let Some(s) = fp8_block_scheme(scheme) else {
            return Err(DeviceError::Unsupported {
                device: self.name(),
                scheme: scheme.name(),
            });
        };
        self.fp8_block_launch(x, Elem::F32, shape, s, data, scales)
    }

    /// The launcher of the FP8-block quantizers (reference `mxrl_formats::reference::quantize`
    /// with `Scheme::Fp8Block`): 1×128 activation blocks one warp each
    /// (`fp8_block_act_{f32,bf16}`), 128×128 weight tiles one CTA each
    /// (`fp8_block_weight_{f32,bf16}`). Data `[M, K]` E4M3 codes; scales the f32 `scale_inv`
    /// of every block (row-major `[M, K/128]` or `[M/128, K/128]`) as little-endian bytes.
    /// `x` holds f32 values (`Elem::F32`) or BF16 bit patterns (`Elem::Bf16`).
    fn fp8_block_launch<T: cudarc::driver::DeviceRepr>(
        &self,
        x: &CudaView<'_, T>,
        elem: Elem,
        shape: [usize; 2],
        s: Fp8BlockScheme,
        data: &mut CudaViewMut<'_, u8>,
        scales: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), DeviceError> {
        let expected = match elem {
            Elem::F32 => std::mem::size_of::<f32>(),
            Elem::Bf16 => std::mem::size_of::<u16>(),
        };
        if std::mem::size_of::<T>() != expected {
            return Err(self.err("FP8-block quantizer: element type and kind disagree"));
        }
        let tile_rows = fp8_tile_rows(s);
        let [m, k] = shape;
        for (dim, size, block) in [("M", m, tile_rows), ("K", k, FP8_BLOCK)] {
            if !size.is_multiple_of(block) {
                return Err(FormatError::NotMultiple {
                    scheme: Scheme::Fp8Block(s).name(),
                    dim,
                    size,
                    block,
                    shape: shape.to_vec(),
                }
                .into());
            }
        }
        let n = m
            .checked_mul(k)
            .ok_or_else(|| self.err(format!("shape {shape:?} overflows")))?;
        let blocks = (m / tile_rows) * (k / FP8_BLOCK);
        if x.len() < n {
            return Err(self.err(format!(
                "FP8-block quantizer: input of {} elements for {shape:?}",
                x.len()
            )));
        }
        self.check_out(data.len(), n, scales.len(), 4 * blocks)?;
        if blocks == 0 {
            return Ok(());
        }
        for (what, ptr) in [
            ("codes", data.device_ptr_mut(&self.stream).0),
            ("scales", scales.device_ptr_mut(&self.stream).0),
        ] {
            if !ptr.is_multiple_of(4) {
                return Err(self.err(format!(
                    "FP8-block quantizer: {what} at {ptr:#x} are not 4-byte aligned"
                )));
            }
        }
        let pow2 = i32::from(s.scale_rule == ScaleRule::F32PowerOfTwo);
        let (act, weight) = match elem {
            Elem::F32 => (&self.k.fp8_block_act_f32, &self.k.fp8_block_weight_f32),
            Elem::Bf16 => (&self.k.fp8_block_act_bf16, &self.k.fp8_block_weight_bf16),
        };
        match s.blocks {
            Fp8Blocks::Activation1x128 => {
                let nb = blocks as u64;
                let cfg = self.grid(blocks * 32);
                let mut b = self.stream.launch_builder(act);
                b.arg(x).arg(data).arg(scales).arg(&nb).arg(&pow2);
                // SAFETY: warp w (global thread index / 32) < n/128 = blocks reads x[128w ..
                // 128w + 128) (x holds ≥ n elements of the kernel's type, checked), writes
                // data[128w .. 128w + 128) as 4-byte words at 128w + 4·lane and the f32 at byte
                // 4w of scales (data ≥ n bytes, scales ≥ 4·blocks, both 4-byte aligned,
                // checked); a warp past the last block returns as a whole (blockDim 256 is a
                // multiple of 32); the grid covers 32·blocks threads. Argument types match
                // (T*, u8*, float* (the byte buffer), u64, int).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
            Fp8Blocks::Weight128x128 => {
                let (tpr, cols) = ((k / FP8_BLOCK) as u64, k as u64);
                let grid = u32::try_from(blocks)
                    .ok()
                    .filter(|&g| g <= i32::MAX as u32)
                    .ok_or_else(|| self.err(format!("{blocks} FP8-block tiles: grid too large")))?;
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (FP8W_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(weight);
                b.arg(x).arg(data).arg(scales).arg(&tpr).arg(&cols);
                b.arg(&pow2);
                // SAFETY: CTA t < blocks = (M/128)·(K/128) reads x and writes data at the
                // elements of tile (t / (K/128), t % (K/128)): rows 128·(t / (K/128)) .. +128 ≤ M,
                // columns 128·(t % (K/128)) .. +128 ≤ K (M, K multiples of 128, checked; x ≥ n
                // elements and data ≥ n bytes, checked), and writes the f32 at byte 4t of scales
                // (≥ 4·blocks bytes, 4-byte aligned, checked); blockDim equals the kernel's
                // FP8W_THREADS (its shared array and launch bound) and every thread reaches its
                // one barrier. Argument types match (T*, u8*, float*, u64, u64, int).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
        }
        Ok(())
    }

    fn check_out(
        &self,
        data: usize,
        want_data: usize,
        scales: usize,
        want_scales: usize,
    ) -> Result<(), DeviceError> {
        if data < want_data || scales < want_scales {
            return Err(self.err(format!(
                "quantize output buffers of {data} / {scales} bytes, {want_data} / \
                 {want_scales} needed"
            )));
        }
        Ok(())
    }

    /// Launch the amax kernel (`amax_{f32,bf16}`): per row (one CUDA block per row) or per
    /// tensor (grid-stride + atomicMax on the bit pattern). NaN is ignored.
    ///
    /// # Errors
    /// Shape errors (K % 16 ≠ 0, length mismatch) or a driver error.
    pub fn amax(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scope: AmaxScope,
    ) -> Result<CudaSlice<u32>, DeviceError> {
        let scheme = Scheme::Nvfp4(mxrl_formats::Nvfp4Scheme {
            amax: scope,
            blocks: Nvfp4Blocks::Vector,
        });
        self.check(x, shape, scheme)?; // length and K % 16 (the loads take 8 elements)
        let (rows, cols) = (shape[0] as u64, shape[1] as u64);
        let (len, cfg, per_row) = match scope {
            AmaxScope::PerRow => (
                shape[0],
                LaunchConfig {
                    grid_dim: (shape[0] as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                },
                1i32,
            ),
            AmaxScope::PerTensor => {
                let blocks = (x.len() / 8).div_ceil(THREADS as usize).clamp(1, 4096) as u32;
                (
                    1,
                    LaunchConfig {
                        grid_dim: (blocks, 1, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                    0i32,
                )
            }
        };
        let mut out = self
            .stream
            .alloc_zeros::<u32>(len)
            .map_err(|e| self.err(e))?;
        if len > 0 && x.len() > 0 {
            let mut b = self.launch_on(x, &self.k.amax_f32, &self.k.amax_bf16);
            b.arg(&mut out).arg(&rows).arg(&cols).arg(&per_row);
            // SAFETY: (8-element aligned loads; callers guarantee cols % 16 == 0.) Per row,
            // block r < rows reads x[r·cols..(r+1)·cols) and writes out[r]
            // (out has rows entries); per tensor, the grid-stride loop reads x[0..rows·cols)
            // and atomically updates out[0] (zero-initialised, 1 entry); blockDim = 256 ≤ the
            // kernel's 32-warp shared array; argument types match (T*, u32*, u64, u64, int).
            unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
        }
        Ok(out)
    }

    /// Launch the NVFP4 quantizer (`nvfp4_{f32,bf16}`) with a precomputed amax (bit patterns,
    /// 1 per tensor or M per row). Data `[M, K/2]` packed low nibble first, scales `[M, K/16]`.
    ///
    /// # Errors
    /// Shape errors (K % 16 ≠ 0, length mismatch, amax length) or a driver error.
    pub fn nvfp4_with_amax(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scope: AmaxScope,
        amax_bits: CudaSlice<u32>,
    ) -> Result<DeviceQuantized, DeviceError> {
        let scheme = Scheme::Nvfp4(mxrl_formats::Nvfp4Scheme {
            amax: scope,
            blocks: Nvfp4Blocks::Vector,
        });
        self.check(x, shape, scheme)?;
        let want = amax_len(shape, scope);
        if amax_bits.len() != want {
            return Err(FormatError::LengthMismatch {
                what: "amax",
                shape: vec![want],
                expected: want,
                got: amax_bits.len(),
            }
            .into());
        }
        let n = x.len();
        let mut data = self.output::<u8>(n / 2)?;
        let mut scales = self.output::<u8>(n / NVFP4_BLOCK)?;
        self.nvfp4_blocks(x, shape, scope, &amax_bits, &mut data, &mut scales)?;
        Ok(DeviceQuantized {
            scheme,
            shape,
            data,
            scales,
            amax_bits: Some(amax_bits),
        })
    }

    /// Launch `nvfp4_blocks_{f32,bf16}`: one thread per 16-block with the amax already in
    /// `amax` (entry 0, or one per row), CTAs mapped back to front. Callers checked the shape
    /// (K % 16 == 0, length) and that data / scales / amax hold n/2, n/16 and 1 or M entries.
    fn nvfp4_blocks(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scope: AmaxScope,
        amax: &CudaSlice<u32>,
        data: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), DeviceError> {
        let n = shape[0] * shape[1];
        let n_blocks = n / NVFP4_BLOCK;
        let want_amax = amax_len(shape, scope);
        assert!(
            x.len() == n
                && data.len() >= n / 2
                && scales.len() >= n_blocks
                && amax.len() >= want_amax
                && shape[1].is_multiple_of(NVFP4_BLOCK),
            "nvfp4_blocks: unchecked buffers"
        );
        if n_blocks == 0 {
            return Ok(());
        }
        let (nb, bpr, per_row) = (
            n_blocks as u64,
            (shape[1] / NVFP4_BLOCK) as u64,
            i32::from(scope == AmaxScope::PerRow),
        );
        let cfg = self.grid(n_blocks);
        let mut b = self.launch_on(x, &self.k.nvfp4_blocks_f32, &self.k.nvfp4_blocks_bf16);
        b.arg(amax)
            .arg(data)
            .arg(scales)
            .arg(&nb)
            .arg(&bpr)
            .arg(&per_row);
        // SAFETY: thread b < n/16 (CTA index reversed, the grid covers n/16 threads) reads
        // x[16b..16b+16) (16-byte aligned loads: bases 256-byte aligned, offsets 32b or 64b
        // bytes) and amax[b/(K/16)] (< M entries, per row) or amax[0]; it writes
        // data[8b..8b+8) as one aligned 8-byte store (n/2 entries) and scales[b] (n/16
        // entries), lengths asserted above; threads past n/16 return before touching memory;
        // argument types match (T*, u32*, u8*, u8*, u64, u64, int).
        unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
        Ok(())
    }

    /// NVFP4 quantize: per row, one kernel per row (`nvfp4_row_reg_{f32,bf16}`: the row's
    /// amax, then its blocks from registers, the row read once); per tensor, a read-only amax
    /// pass (`amax_tensor_{f32,bf16}`, grid-wide atomicMax on the bit pattern) then
    /// `nvfp4_blocks_{f32,bf16}` (the input is read twice; from L2 where it still is).
    ///
    /// # Errors
    /// As the launchers.
    pub fn nvfp4(
        &self,
        x: &DeviceInput,
        shape: [usize; 2],
        scope: AmaxScope,
    ) -> Result<DeviceQuantized, DeviceError> {
        let scheme = Scheme::Nvfp4(mxrl_formats::Nvfp4Scheme {
            amax: scope,
            blocks: Nvfp4Blocks::Vector,
        });
        self.check(&x.view(), shape, scheme)?;
        let mut q = self.alloc_quantized(shape, scheme)?;
        self.quantize_device_into(x, shape, scheme, &mut q)?;
        Ok(q)
    }

    fn nvfp4_into(
        &self,
        x: &InputView<'_>,
        shape: [usize; 2],
        scope: AmaxScope,
        amax: &mut CudaSlice<u32>,
        data: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), DeviceError> {
        let scheme = Scheme::Nvfp4(mxrl_formats::Nvfp4Scheme {
            amax: scope,
            blocks: Nvfp4Blocks::Vector,
        });
        self.check(x, shape, scheme)?;
        let n = x.len();
        self.check_out(data.len(), n / 2, scales.len(), n / NVFP4_BLOCK)?;
        let want_amax = amax_len(shape, scope);
        if amax.len() < want_amax {
            return Err(self.err(format!(
                "NVFP4 amax buffer of {} entries, {want_amax} needed",
                amax.len()
            )));
        }
        let cols = shape[1] as u64;
        match scope {
            AmaxScope::PerRow => {
                if n == 0 {
                    return Ok(());
                }
                // Enough threads that each keeps at most `chunks` 16-blocks of its row in
                // registers (warp multiples, 32 up to what the kernel's register use allows per
                // block: ~96 registers per thread at 4 f32 blocks, so 1024 threads would exceed
                // an SM's 64 K registers and the launch would be refused); longer rows re-read
                // the rest.
                let forced = self
                    .nvfp4_row_chunks
                    .load(std::sync::atomic::Ordering::Relaxed);
                let chunks = match (forced, x) {
                    (0, InputView::F32(_)) => NVFP4_ROW_CHUNKS_DEFAULT.0,
                    (0, InputView::Bf16(_)) => NVFP4_ROW_CHUNKS_DEFAULT.1,
                    (c, _) => c,
                };
                let variant = NVFP4_ROW_CHUNKS
                    .iter()
                    .position(|&c| c == chunks)
                    .ok_or_else(|| {
                        self.err(format!(
                            "per-row NVFP4 kernel with {chunks} blocks per thread is not compiled"
                        ))
                    })?;
                let (f32_fn, bf16_fn) = &self.k.nvfp4_row_reg[variant];
                let func = match x {
                    InputView::F32(_) => f32_fn,
                    InputView::Bf16(_) => bf16_fn,
                };
                let max_threads = func
                    .get_attribute(
                        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                    )
                    .map_err(|e| self.err(e))?
                    .clamp(32, 1024) as usize
                    / 32
                    * 32;
                let blocks_per_row = shape[1] / NVFP4_BLOCK;
                let threads = blocks_per_row
                    .div_ceil(chunks)
                    .next_multiple_of(32)
                    .clamp(32, max_threads) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (shape[0] as u32, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(func);
                match x {
                    InputView::F32(s) => b.arg(s),
                    InputView::Bf16(s) => b.arg(s),
                };
                b.arg(amax).arg(data).arg(scales).arg(&cols);
                // SAFETY: CTA r < M reads row r only, x[r·K..(r+1)·K) (16-byte aligned loads
                // of 16-blocks: K % 16 == 0 checked, bases 256-byte aligned), writes amax[r]
                // (≥ M entries, checked), data[r·K/2 + 8b..+8) as one aligned 8-byte store and
                // scales[r·K/16 + b] for its 16-blocks b < K/16 (n/2 and n/16 entries,
                // checked); every thread reaches the one __syncthreads and the full-warp
                // shuffles (no early return); blockDim is a multiple of 32, ≤ 1024 and ≤ the
                // kernel's per-block limit, within the kernel's 32-warp array; argument types
                // match (T*, u32*, u8*, u8*, u64).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
            AmaxScope::PerTensor => {
                self.stream
                    .memset_zeros(&mut amax.slice_mut(0..1))
                    .map_err(|e| self.err(e))?;
                if n == 0 {
                    return Ok(());
                }
                let chunks = (n / 8) as u64;
                // The resident CTAs, so the grid-stride sweep runs front to back.
                let blocks = (n / 8)
                    .div_ceil(THREADS as usize)
                    .min((self.sms * AMAX_CTAS_PER_SM) as usize)
                    .max(1) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.launch_on(x, &self.k.amax_tensor_f32, &self.k.amax_tensor_bf16);
                b.arg(&mut *amax).arg(&chunks);
                // SAFETY: the grid-stride loops read 8-element chunks i < n/8, x[8i..8i+8)
                // (16-byte aligned loads; n % 16 == 0 since K % 16 == 0 was checked), and
                // thread 0 of each CTA atomically updates amax[0] (zeroed just before on this
                // stream, ≥ 1 entry); every thread reaches the __syncthreads; blockDim 256 ≤
                // the kernel's 32-warp array; argument types match (T*, u32*, u64).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
                self.nvfp4_blocks(x, shape, scope, amax, data, scales)?;
            }
        }
        Ok(())
    }

    /// Launch a dequantizer (`mxfp8_row_dequantize` or `nvfp4_dequantize`) → f32 `[M, K]`.
    ///
    /// # Errors
    /// Unsupported scheme (column-wise MXFP8) or a driver error.
    pub fn dequantize_device(&self, q: &DeviceQuantized) -> Result<CudaSlice<f32>, DeviceError> {
        let n = q.shape[0] * q.shape[1];
        let mut out = self.output::<f32>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let cfg = self.grid(n);
        let n64 = n as u64;
        match (q.scheme, &q.amax_bits) {
            (Scheme::Mxfp8(s), _) if s.usage == Usage::RowWise && s.blocks == MxBlocks::Vector => {
                assert!(q.data.len() == n && q.scales.len() == n / MXFP8_BLOCK);
                let mut b = self.stream.launch_builder(&self.k.mxfp8_row_dequantize);
                b.arg(&q.data).arg(&q.scales).arg(&mut out).arg(&n64);
                // SAFETY: thread i < n reads data[i], scales[i/32] (lengths asserted above)
                // and writes out[i] (n entries); types match (u8*, u8*, float*, u64).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
            (Scheme::Nvfp4(s), Some(amax)) if s.blocks == Nvfp4Blocks::Vector => {
                let per_row = i32::from(s.amax == AmaxScope::PerRow);
                let want_amax = if per_row == 1 { q.shape[0] } else { 1 };
                assert!(q.data.len() == n / 2 && q.scales.len() == n / NVFP4_BLOCK);
                assert_eq!(amax.len(), want_amax);
                let cols = q.shape[1] as u64;
                let mut b = self.stream.launch_builder(&self.k.nvfp4_dequantize);
                b.arg(&q.data)
                    .arg(&q.scales)
                    .arg(amax)
                    .arg(&mut out)
                    .arg(&n64)
                    .arg(&cols)
                    .arg(&per_row);
                // SAFETY: thread i < n reads data[i/2], scales[i/16], amax[i/cols] or amax[0]
                // (lengths asserted above) and writes out[i]; types match
                // (u8*, u8*, u32*, float*, u64, u64, int).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
            (Scheme::Fp8Block(s), _) if fp8_block_scheme(q.scheme).is_some() => {
                let tile_rows = fp8_tile_rows(s);
                let [m, k] = q.shape;
                if !m.is_multiple_of(tile_rows) || !k.is_multiple_of(FP8_BLOCK) {
                    return Err(self.err(format!("FP8-block dequantize of a {:?} tensor", q.shape)));
                }
                let blocks = (m / tile_rows) * (k / FP8_BLOCK);
                assert!(q.data.len() == n && q.scales.len() == 4 * blocks);
                let (cols, tr) = (k as u64, tile_rows as u64);
                let mut b = self.stream.launch_builder(&self.k.fp8_block_dequantize);
                b.arg(&q.data)
                    .arg(&q.scales)
                    .arg(&mut out)
                    .arg(&n64)
                    .arg(&cols)
                    .arg(&tr);
                // SAFETY: thread i < n reads data[i] and the f32 at scale index (i / K / tr)·(K /
                // 128) + (i % K) / 128 < blocks (M % tr == 0, K % 128 == 0 checked; scales hold
                // 4·blocks bytes, asserted) and writes out[i]; types match (u8*, float*, float*,
                // u64, u64, u64).
                unsafe { b.launch(cfg) }.map_err(|e| self.err(e))?;
            }
            _ => {
                return Err(DeviceError::Unsupported {
                    device: self.name(),
                    scheme: q.scheme.name(),
                })
            }
        }
        Ok(out)
    }

    /// Copy a device tensor back into a host [`QuantizedTensor`] (compact scales).
    ///
    /// # Errors
    /// A driver error.
    pub fn download(&self, q: &DeviceQuantized) -> Result<QuantizedTensor, DeviceError> {
        let data = self.stream.clone_dtoh(&q.data).map_err(|e| self.err(e))?;
        let scales = self.stream.clone_dtoh(&q.scales).map_err(|e| self.err(e))?;
        let amax = match &q.amax_bits {
            Some(a) => self
                .stream
                .clone_dtoh(a)
                .map_err(|e| self.err(e))?
                .into_iter()
                .map(f32::from_bits)
                .collect(),
            None => Vec::new(),
        };
        let scales = if q.scheme.format() == Format::Fp8Block {
            Scales::F32(f32_from_le_bytes(&scales))
        } else {
            Scales::Bytes(scales)
        };
        Ok(QuantizedTensor {
            scheme: q.scheme,
            shape: q.shape.to_vec(),
            padded_shape: q.shape.to_vec(),
            data,
            scales,
            scale_layout: ScaleLayout::Compact,
            amax,
        })
    }

    /// Upload a host quantized tensor (compact or swizzled scales) to the GPU.
    ///
    /// # Errors
    /// An invalid tensor, not 2-D, or a driver error.
    pub fn upload_quantized(&self, q: &QuantizedTensor) -> Result<DeviceQuantized, DeviceError> {
        let q = q.clone().with_scale_layout(ScaleLayout::Compact)?;
        q.validate()?;
        let scales = match &q.scales {
            Scales::Bytes(b) => b.clone(),
            // FP8-block scale_inv values: little-endian f32 bytes in the byte buffer.
            Scales::F32(v) => f32_le_bytes(v),
        };
        let &[m, k] = &q.shape[..] else {
            return Err(DeviceError::Unsupported {
                device: self.name(),
                scheme: format!("{} of shape {:?}", q.scheme, q.shape),
            });
        };
        if q.padded_shape != q.shape {
            return Err(DeviceError::Unsupported {
                device: self.name(),
                scheme: format!("{} padded to {:?}", q.scheme, q.padded_shape),
            });
        }
        let up8 = |v: &[u8]| self.stream.clone_htod(v).map_err(|e| self.err(e));
        let amax_bits = if q.amax.is_empty() {
            None
        } else {
            let bits: Vec<u32> = q.amax.iter().map(|a| a.to_bits()).collect();
            Some(self.stream.clone_htod(&bits).map_err(|e| self.err(e))?)
        };
        Ok(DeviceQuantized {
            scheme: q.scheme,
            shape: [m, k],
            data: up8(&q.data)?,
            scales: up8(&scales)?,
            amax_bits,
        })
    }

    /// Quantize an input already on the GPU with `scheme`.
    ///
    /// # Errors
    /// Unsupported scheme, shape or driver errors.
    pub fn quantize_device(
        &self,
        x: &DeviceInput,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<DeviceQuantized, DeviceError> {
        match scheme {
            Scheme::MXFP8_ROW => self.mxfp8_row(x, shape),
            Scheme::MXFP8_COL => self.mxfp8_col(x, shape),
            Scheme::Nvfp4(s) if s.blocks == Nvfp4Blocks::Vector => self.nvfp4(x, shape, s.amax),
            other if fp8_block_scheme(other).is_some() => {
                self.check(&x.view(), shape, other)?;
                let mut q = self.alloc_quantized(shape, other)?;
                self.quantize_device_into(x, shape, other, &mut q)?;
                Ok(q)
            }
            other => Err(DeviceError::Unsupported {
                device: self.name(),
                scheme: other.name(),
            }),
        }
    }

    /// Time `scheme` on an input of `shape` (values from `x`) against a device-to-device copy
    /// of the same input, `iters` calls each after one warm-up, with CUDA events; the quantizer
    /// writes into outputs allocated once before the loop ([`CudaDevice::quantize_device_into`]).
    ///
    /// # Errors
    /// Unsupported scheme, shape or driver errors.
    pub fn time_quantize(
        &self,
        x: Input<'_>,
        shape: [usize; 2],
        scheme: Scheme,
        iters: usize,
    ) -> Result<QuantizeTiming, DeviceError> {
        let dx = self.upload(x)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut q = self.alloc_quantized(shape, scheme)?;
        self.quantize_device_into(&dx, shape, scheme, &mut q)?;
        let out_bytes =
            q.data.len() + q.scales.len() + 4 * q.amax_bits.as_ref().map_or(0, |a| a.len());
        let start = self.stream.record_event(timing).map_err(|e| self.err(e))?;
        for _ in 0..iters {
            self.quantize_device_into(&dx, shape, scheme, &mut q)?;
        }
        let stop = self.stream.record_event(timing).map_err(|e| self.err(e))?;
        stop.synchronize().map_err(|e| self.err(e))?;
        let quantize_ms =
            f64::from(start.elapsed_ms(&stop).map_err(|e| self.err(e))?) / iters as f64;
        let copy = |src: &DeviceInput| -> Result<(), DeviceError> {
            match src {
                DeviceInput::F32(s) => drop(self.stream.clone_dtod(s).map_err(|e| self.err(e))?),
                DeviceInput::Bf16(s) => drop(self.stream.clone_dtod(s).map_err(|e| self.err(e))?),
            }
            Ok(())
        };
        copy(&dx)?;
        let start = self.stream.record_event(timing).map_err(|e| self.err(e))?;
        for _ in 0..iters {
            copy(&dx)?;
        }
        let stop = self.stream.record_event(timing).map_err(|e| self.err(e))?;
        stop.synchronize().map_err(|e| self.err(e))?;
        let memcpy_ms = f64::from(start.elapsed_ms(&stop).map_err(|e| self.err(e))?) / iters as f64;
        Ok(QuantizeTiming {
            scheme: scheme.name(),
            shape,
            dtype: match x {
                Input::F32(_) => "f32",
                Input::Bf16(_) => "bf16",
            },
            quantize_bytes: dx.bytes() + out_bytes,
            quantize_ms,
            memcpy_bytes: 2 * dx.bytes(),
            memcpy_ms,
        })
    }

    /// Emulated MXFP8 GEMM `y [m, n] = deq(a) [m, k] · deq(b) [n, k]ᵀ` (f32, row-major): both
    /// row-wise operands are dequantized by the contract kernel, then multiplied by one cuBLAS
    /// SGEMM in `CUBLAS_PEDANTIC_MATH` (f32 products, f32 accumulation, no TF32). These are the
    /// operands the CPU emulation (`mxrl_tensor::qlinear`) multiplies; only the summation order
    /// differs.
    ///
    /// # Errors
    /// Operands that are not row-wise MXFP8 of one K, no cuBLAS library, or a driver error.
    pub fn mxfp8_gemm_nt(
        &self,
        a: &DeviceQuantized,
        b: &DeviceQuantized,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        if a.scheme != Scheme::MXFP8_ROW
            || b.scheme != Scheme::MXFP8_ROW
            || a.shape[1] != b.shape[1]
        {
            return Err(self.err(format!(
                "mxfp8_gemm_nt needs two row-wise MXFP8 operands of one K, got {} {:?} and {} {:?}",
                a.scheme, a.shape, b.scheme, b.shape
            )));
        }
        let ([m, k], n) = (a.shape, b.shape[0]);
        let xa = self.dequantize_device(a)?;
        let xb = self.dequantize_device(b)?;
        self.sgemm_nt(&xa, &xb, m, k, n)
    }

    /// Emulated NVFP4 GEMM `y [m, n]`, as `mxrl_tensor::qlinear` computes it: operands
    /// `e2m1 × e4m3(block scale)` (exact, kernel `nvfp4_prescaled`), one cuBLAS SGEMM in
    /// pedantic math, then `y = fl(α · acc)` with `α = fl(fl(amax_a · amax_b) ·
    /// fl(1/(6·6·448·448)))` per row of a per-token `a` (kernel `nvfp4_apply_alpha`).
    ///
    /// # Errors
    /// `a` not NVFP4 (per tensor or per row), `b` not per-tensor NVFP4, K mismatch, no cuBLAS,
    /// or a driver error.
    pub fn nvfp4_gemm_nt(
        &self,
        a: &DeviceQuantized,
        b: &DeviceQuantized,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        let (Scheme::Nvfp4(sa), Scheme::NVFP4_TENSOR, Some(amax_a), Some(amax_b)) =
            (a.scheme, b.scheme, &a.amax_bits, &b.amax_bits)
        else {
            return Err(self.err(format!(
                "nvfp4_gemm_nt needs NVFP4 activations and a per-tensor NVFP4 weight, got {} and {}",
                a.scheme, b.scheme
            )));
        };
        if sa.blocks != Nvfp4Blocks::Vector || a.shape[1] != b.shape[1] {
            return Err(self.err(format!(
                "nvfp4_gemm_nt: operands {} {:?} and {} {:?} do not share K",
                a.scheme, a.shape, b.scheme, b.shape
            )));
        }
        let ([m, k], n) = (a.shape, b.shape[0]);
        let pa = self.prescaled(a)?;
        let pb = self.prescaled(b)?;
        let mut y = self.sgemm_nt(&pa, &pb, m, k, n)?;
        let per_row = i32::from(sa.amax == AmaxScope::PerRow);
        assert_eq!(amax_a.len(), if per_row == 1 { m } else { 1 });
        assert_eq!(amax_b.len(), 1);
        let (m64, n64) = (m as u64, n as u64);
        if m * n > 0 {
            let mut bld = self.stream.launch_builder(&self.k.nvfp4_apply_alpha);
            bld.arg(&mut y)
                .arg(amax_a)
                .arg(amax_b)
                .arg(&m64)
                .arg(&n64)
                .arg(&per_row);
            // SAFETY: thread i < m·n reads amax_a[i/n] (m entries, per row) or amax_a[0],
            // amax_b[0] (lengths asserted above), and rescales y[i] in place (m·n entries);
            // types match (float*, u32*, u32*, u64, u64, int).
            unsafe { bld.launch(self.grid(m * n)) }.map_err(|e| self.err(e))?;
        }
        Ok(y)
    }

    /// `e2m1 × e4m3(block scale)` of an NVFP4 tensor (the GEMM operand before α).
    fn prescaled(&self, q: &DeviceQuantized) -> Result<CudaSlice<f32>, DeviceError> {
        let n = q.shape[0] * q.shape[1];
        assert!(q.data.len() == n / 2 && q.scales.len() == n / NVFP4_BLOCK);
        let mut out = self.output::<f32>(n)?;
        if n > 0 {
            let n64 = n as u64;
            let mut b = self.stream.launch_builder(&self.k.nvfp4_prescaled);
            b.arg(&q.data).arg(&q.scales).arg(&mut out).arg(&n64);
            // SAFETY: thread i < n reads data[i/2], scales[i/16] (lengths asserted above) and
            // writes out[i] (n entries); types match (u8*, u8*, float*, u64).
            unsafe { b.launch(self.grid(n)) }.map_err(|e| self.err(e))?;
        }
        Ok(out)
    }

    /// Row-major `y [m, n] = a [m, k] · b [n, k]ᵀ` by one cuBLAS SGEMM in pedantic math.
    pub(crate) fn sgemm_nt(
        &self,
        xa: &CudaSlice<f32>,
        xb: &CudaSlice<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<CudaSlice<f32>, DeviceError> {
        assert!(xa.len() == m * k && xb.len() == n * k);
        let mut y = self.output::<f32>(m * n)?;
        // Row-major y[m,n] is column-major yᵀ [n, m] = b · aᵀ: A = b's buffer seen as
        // column-major [k, n] (transposed), B = a's buffer as column-major [k, m].
        self.sgemm_cm(true, false, n, m, k, xb, k, xa, k, &mut y, n)?;
        Ok(y)
    }

    /// Column-major `C [m, n] = op(A) · op(B)` (`op(A)` `[m, k]`, `op(B)` `[k, n]`, β = 0) by
    /// one cuBLAS SGEMM on the device's handle in `CUBLAS_PEDANTIC_MATH` (f32 products and
    /// accumulation, no TF32). One handle on one stream, default (deterministic) atomics
    /// mode: the same call on the same GPU gives the same bits.
    #[allow(clippy::too_many_arguments)]
    fn sgemm_cm(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &CudaSlice<f32>,
        lda: usize,
        b: &CudaSlice<f32>,
        ldb: usize,
        c: &mut CudaSlice<f32>,
        ldc: usize,
    ) -> Result<(), DeviceError> {
        let (ra, ca) = if trans_a { (k, m) } else { (m, k) };
        let (rb, cb) = if trans_b { (n, k) } else { (k, n) };
        // Stored (column-major) extents: A is ra × ca with ld ≥ ra, likewise B and C.
        assert!(lda >= ra.max(1) && ldb >= rb.max(1) && ldc >= m.max(1));
        assert!(a.len() >= lda * ca && b.len() >= ldb * cb && c.len() >= ldc * n);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // An empty sum: C = 0 (not left to the library's quick-return rules).
            return self.stream.memset_zeros(c).map_err(|e| self.err(e));
        }
        let mut guard = self.blas.lock().expect("cuBLAS handle poisoned");
        if guard.is_none() {
            // SAFETY: only asks whether the cuBLAS library can be found.
            if !unsafe { cublas_sys::is_culib_present() } {
                return Err(self.err("the cuBLAS library (libcublas) cannot be loaded"));
            }
            let blas =
                CudaBlas::new(self.stream.clone()).map_err(|e| self.err(format!("{e:?}")))?;
            // SAFETY: `blas.handle()` is a live handle owned by `blas`; setting the math mode
            // only changes which algorithms cuBLAS may pick for later calls on it.
            let st = unsafe {
                cublas_sys::cublasSetMathMode(
                    *blas.handle(),
                    cublas_sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
                )
            };
            if st != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(self.err(format!("cublasSetMathMode: {st:?}")));
            }
            *guard = Some(blas);
        }
        let blas = guard.as_ref().expect("initialised above");
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| self.err(format!("dimension {v} exceeds i32")));
        let op = |t: bool| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(trans_a),
            transb: op(trans_b),
            m: dim(m)?,
            n: dim(n)?,
            k: dim(k)?,
            alpha: 1.0f32,
            lda: dim(lda)?,
            ldb: dim(ldb)?,
            beta: 0.0f32,
            ldc: dim(ldc)?,
        };
        // SAFETY: A holds ≥ lda·ca f32 read as ra × ca (column-major, ld = lda ≥ ra), B holds
        // ≥ ldb·cb read as rb × cb, C holds ≥ ldc·n written as m × n (asserted above); all
        // three live on this device's stream, and C is exclusively borrowed, so it aliases
        // neither input.
        unsafe { blas.gemm(cfg, a, b, c) }.map_err(|e| self.err(format!("{e:?}")))?;
        Ok(())
    }

    /// Copy a device f32 buffer to the host.
    ///
    /// # Errors
    /// A driver error.
    pub fn download_f32(&self, v: &CudaSlice<f32>) -> Result<Vec<f32>, DeviceError> {
        self.stream.clone_dtoh(v).map_err(|e| self.err(e))
    }

    /// Wait for all queued work.
    ///
    /// # Errors
    /// A driver error (e.g. a faulting kernel).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.ctx.synchronize().map_err(|e| self.err(e))
    }
}

impl QuantDevice for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn quantize(
        &self,
        x: Input<'_>,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<QuantizedTensor, DeviceError> {
        let dx = self.upload(x)?;
        let q = self.quantize_device(&dx, shape, scheme)?;
        self.download(&q)
    }

    fn dequantize(&self, q: &QuantizedTensor) -> Result<Vec<f32>, DeviceError> {
        let dq = self.upload_quantized(q)?;
        let out = self.dequantize_device(&dq)?;
        self.stream.clone_dtoh(&out).map_err(|e| self.err(e))
    }
}
