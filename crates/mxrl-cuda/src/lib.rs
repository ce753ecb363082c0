//! mxrl-cuda: the CUDA backend of mxrl's quantizer contract.
//!
//! # Design
//! - **Byte-identical to the CPU library.** Every kernel reproduces `mxrl_formats`' arithmetic
//!   exactly (IEEE f32, round to nearest even, no FTZ, no FMA contraction); its named reference
//!   is [`mxrl_formats::reference::quantize`] / [`mxrl_formats::QuantizedTensor::dequantize`],
//!   and the tests compare bytes, never an error norm.
//! - **Numerics are in the compile options.** Kernels are compiled at run time by NVRTC with
//!   the explicit options [`NVRTC_OPTIONS`] (`--fmad=false --ftz=false --prec-div=true
//!   --prec-sqrt=true`, no `--use_fast_math`); the options are logged when a module is built
//!   and are part of the module cache key ([`module_cache_key`]).
//! - **One source of truth for constants.** The CUDA source starts with a prelude generated
//!   from `mxrl-formats` ([`cuda_prelude`]); the kernel file spells no contract constant.
//! - **`unsafe` at one boundary.** Each kernel has one typed launcher in the `cuda` module that
//!   checks shapes and carries a `// SAFETY:` comment; nothing else launches kernels.
//! - **Optional.** Without the `cuda` feature this crate still builds and tests everything
//!   that needs no GPU (prelude, source, the CPU device, the per-device test harness). With it,
//!   `cudarc` loads the CUDA driver, NVRTC and cuBLAS dynamically at run time, so the crate
//!   also builds on machines without CUDA; a CUDA test there fails loudly (no silent skip).
//!
//! # API
//! Kernels (one typed launcher each on `CudaDevice`): MXFP8 row-wise and column-wise quantize,
//! NVFP4 amax (per tensor / per row) and quantize, FP8-block quantize (1×128 activation blocks,
//! 128×128 weight tiles, f32 `scale_inv` kept as little-endian bytes), MXFP8, NVFP4 and
//! FP8-block dequantize, and the emulated
//! GEMMs `mxfp8_gemm_nt` / `nvfp4_gemm_nt` (exact operands, one cuBLAS SGEMM in pedantic math,
//! NVFP4's α applied after the sum — the arithmetic of `mxrl_tensor::qlinear`).
//!
//! `backend::CudaBackend` (feature `cuda`) is the device engine's backend: every op of
//! [`mxrl_tensor::device::Backend`] on one GPU, so `mxrl … --device cuda` runs the whole model
//! there.
//!
//! [`QuantDevice`] (quantize / dequantize on a device, host buffers in and out) implemented by
//! [`CpuDevice`] (the contract library) and, with `cuda`, `CudaDevice`; [`test_device!`] writes
//! one test per device.
#![deny(missing_docs)]

mod prelude;

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod ops;
pub mod ptx_cache;
#[cfg(feature = "cuda")]
pub use cuda::{
    CudaDevice, DeviceInput, DeviceQuantized, InputView, QuantizeTiming, NVFP4_ROW_CHUNKS,
    NVFP4_ROW_CHUNKS_DEFAULT,
};

pub use prelude::cuda_prelude;

use half::bf16;
use mxrl_formats::{FormatError, Padding, QuantizedTensor, Scheme};
use sha2::{Digest, Sha256};

/// The kernel source (after the prelude): `kernels/quant.cu`.
pub const KERNEL_SOURCE: &str = include_str!("../kernels/quant.cu");

/// NVRTC options every mxrl kernel module is compiled with (besides `--gpu-architecture`,
/// chosen from the device's compute capability and added to the cache key as well).
pub const NVRTC_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// The full CUDA source of the quantizer module: generated prelude + kernels.
pub fn module_source() -> String {
    format!("{}\n{}", cuda_prelude(), KERNEL_SOURCE)
}

/// Device helpers shared by every op kernel (bf16 conversion, warp reductions, ...):
/// `kernels/common.cuh`, placed after the prelude and before each op source.
pub const COMMON_SOURCE: &str = include_str!("../kernels/common.cuh");

/// The full source of an op module: prelude + common helpers + the op's kernels (what NVRTC
/// compiles in `gpu::Gpu::module`, and what `scripts/cuemu` runs on the host).
///
/// Every `__global__` function's body starts with `mxrl_grid_dependency();` (common.cuh),
/// inserted here so that no kernel can be left without it: a kernel that a decode graph
/// reaches through a programmatic edge must wait for its predecessor before it reads.
pub fn op_module_source(source: &str) -> String {
    with_grid_dependency(&format!(
        "{}\n{}\n{}",
        cuda_prelude(),
        COMMON_SOURCE,
        source
    ))
}

/// `src` with `mxrl_grid_dependency();` after the opening brace of every `__global__`
/// function (the first `{` after the keyword; `//` comments are skipped, and so is the
/// keyword inside one).
fn with_grid_dependency(src: &str) -> String {
    const KEY: &str = "__global__";
    const CALL: &str = " mxrl_grid_dependency();";
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len() + 8 * 1024);
    let mut copied = 0;
    let mut i = 0;
    while let Some(off) = src[i..].find(KEY) {
        let at = i + off;
        let line_start = src[..at].rfind('\n').map_or(0, |p| p + 1);
        i = at + KEY.len();
        if src[line_start..at].contains("//") {
            continue;
        }
        // The body's brace: the first `{` outside `//` comments.
        let mut j = i;
        while j < b.len() && b[j] != b'{' {
            if b[j] == b'/' && b.get(j + 1) == Some(&b'/') {
                while j < b.len() && b[j] != b'\n' {
                    j += 1;
                }
            } else {
                j += 1;
            }
        }
        if j == b.len() {
            break;
        }
        out.push_str(&src[copied..=j]);
        out.push_str(CALL);
        copied = j + 1;
        i = j + 1;
    }
    out.push_str(&src[copied..]);
    out
}

/// Cache key of a compiled module: SHA-256 (16 hex digits) of the source and the exact
/// option list, so a change of either compiles a new module.
pub fn module_cache_key(source: &str, options: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A high-precision input on the host.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// BF16 values (widened to f32 exactly by every device).
    Bf16(&'a [bf16]),
}

impl Input<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Input::F32(v) => v.len(),
            Input::Bf16(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Errors of a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The contract library refused the input (shape, block multiple, ...).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The device does not implement this scheme.
    #[error("{device}: scheme {scheme} is not implemented on this device")]
    Unsupported {
        /// The device.
        device: String,
        /// The scheme name.
        scheme: String,
    },
    /// A CUDA driver, NVRTC or cuBLAS failure.
    #[error("{device}: {what}")]
    Cuda {
        /// The device.
        device: String,
        /// What failed, with the driver's message.
        what: String,
    },
}

/// A device that runs the contract's quantizers: host buffers in, host [`QuantizedTensor`]s
/// out (compact scales, no padding).
pub trait QuantDevice {
    /// Human-readable device name.
    fn name(&self) -> String;
    /// Quantize `x` of `shape` = `[M, K]` with `scheme`.
    ///
    /// # Errors
    /// Shape or block-multiple errors, or an unsupported scheme on this device.
    fn quantize(
        &self,
        x: Input<'_>,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<QuantizedTensor, DeviceError>;
    /// Dequantize to f32 (contract formulas).
    ///
    /// # Errors
    /// An invalid tensor, or an unsupported scheme on this device.
    fn dequantize(&self, q: &QuantizedTensor) -> Result<Vec<f32>, DeviceError>;
}

/// The CPU device: `mxrl_formats`' production quantizer and dequantizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuDevice;

impl QuantDevice for CpuDevice {
    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn quantize(
        &self,
        x: Input<'_>,
        shape: [usize; 2],
        scheme: Scheme,
    ) -> Result<QuantizedTensor, DeviceError> {
        Ok(match x {
            Input::F32(v) => mxrl_formats::quantize(v, &shape, scheme, Padding::Reject)?,
            Input::Bf16(v) => mxrl_formats::quantize(v, &shape, scheme, Padding::Reject)?,
        })
    }

    fn dequantize(&self, q: &QuantizedTensor) -> Result<Vec<f32>, DeviceError> {
        Ok(q.dequantize()?)
    }
}

/// Write a test once and run it on every device: expands to a module `$name` with a test
/// `cpu` and, when the calling crate's `cuda` feature is on, a test `cuda` on GPU 0. With the
/// feature on and no usable GPU the `cuda` test fails with the driver's message; without
/// the feature it does not exist.
///
/// ```ignore
/// test_device!(mxfp8_zeros, |dev: &dyn QuantDevice| { /* ... */ });
/// ```
#[macro_export]
macro_rules! test_device {
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn cpu() {
                let run: fn(&dyn $crate::QuantDevice) = $body;
                run(&$crate::CpuDevice)
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                let dev = $crate::CudaDevice::shared(0).unwrap_or_else(|e| {
                    panic!("the `cuda` feature is on but CUDA device 0 is not usable: {e}")
                });
                let run: fn(&dyn $crate::QuantDevice) = $body;
                run(dev.as_ref())
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_kernel_starts_with_the_grid_dependency() {
        let t = with_grid_dependency(
            "// __global__ in a comment {\nextern \"C\" __global__ void a(int x, // {\n int y) {\n  x; }\n\
             __global__ void __launch_bounds__(64) b() {}\n",
        );
        assert_eq!(
            t,
            "// __global__ in a comment {\nextern \"C\" __global__ void a(int x, // {\n int y) { \
             mxrl_grid_dependency();\n  x; }\n__global__ void __launch_bounds__(64) b() { \
             mxrl_grid_dependency();}\n"
        );
        // In every op module, each kernel (one per `__global__` outside comments) gets the
        // call as the first statement of its body.
        for (name, src) in ops::SOURCES {
            let full = op_module_source(src);
            let kernels = full
                .lines()
                .filter(|l| l.contains("__global__") && !l.trim_start().starts_with("//"))
                .count();
            assert!(kernels > 0, "{name}: no kernels");
            assert_eq!(
                full.matches("{ mxrl_grid_dependency();").count(),
                kernels,
                "{name}: every kernel starts with mxrl_grid_dependency()"
            );
        }
    }

    #[test]
    fn cache_key_depends_on_source_and_options() {
        let opts: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        let src = module_source();
        let k = module_cache_key(&src, &opts);
        assert_eq!(k.len(), 16);
        let mut other = opts.clone();
        other[0] = "--fmad=true".into();
        assert_ne!(k, module_cache_key(&src, &other));
        assert_ne!(k, module_cache_key(&format!("{src} "), &opts));
        assert!(!NVRTC_OPTIONS.iter().any(|o| o.contains("fast_math")));
    }

    #[test]
    fn kernel_source_spells_no_contract_constant() {
        // The reciprocal constants and the NVFP4 numerator come from the prelude only (also in
        // the low-byte family, which compiles quant.cu's encoders with its own kernels).
        for literal in [
            "0x3B124925",
            "0x3E2AAAAB",
            "0x39C30C31",
            "2688.",
            "448.",
            "0.25f",
            "6.0f",
            "1.5f",
        ] {
            for (file, src) in [
                ("kernels/quant.cu", KERNEL_SOURCE),
                ("kernels/ops_qgemm.cu", ops::QGEMM_SOURCE),
            ] {
                assert!(
                    !src.to_uppercase().contains(&literal.to_uppercase()),
                    "{file} hand-copies {literal}"
                );
            }
        }
    }
}
