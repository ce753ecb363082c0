//! The CUDA op set of the engine: one module per op family, each with its kernel source
//! (`kernels/ops_*.cu`), a struct holding the loaded functions, and one typed launcher per op
//! that checks shapes before the `unsafe` launch. The named CPU reference of every op is the
//! `mxrl_tensor` function its doc comment names; `tests/ops_*.rs` compare against it.

#[cfg(feature = "cuda")]
pub mod attention;
#[cfg(feature = "cuda")]
pub mod elementwise;
#[cfg(feature = "cuda")]
pub mod embed_backward;
#[cfg(feature = "cuda")]
pub mod engine;
#[cfg(feature = "cuda")]
pub mod fp8block;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod head;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod norm;
#[cfg(feature = "cuda")]
pub mod optim;
#[cfg(feature = "cuda")]
pub mod qgemm;
#[cfg(feature = "cuda")]
pub mod qlinear;
#[cfg(feature = "cuda")]
pub mod rope;
#[cfg(feature = "cuda")]
pub mod router;
#[cfg(feature = "cuda")]
pub mod sample;
#[cfg(feature = "cuda")]
pub mod swiglu;

/// A launcher's length check: `got ≥ want` elements, or an error naming the buffer.
#[cfg(feature = "cuda")]
pub(crate) fn check_len(
    gpu: &crate::gpu::Gpu,
    what: &str,
    got: usize,
    want: usize,
) -> Result<(), crate::DeviceError> {
    if got < want {
        return Err(gpu.err(format!("{what}: buffer of {got} elements, {want} needed")));
    }
    Ok(())
}

/// `a · b` elements, or an error naming `what` when the product overflows `usize`.
#[cfg(feature = "cuda")]
pub(crate) fn mul(
    gpu: &crate::gpu::Gpu,
    what: &str,
    a: usize,
    b: usize,
) -> Result<usize, crate::DeviceError> {
    a.checked_mul(b)
        .ok_or_else(|| gpu.err(format!("{what}: {a} × {b} elements overflow")))
}

/// A launcher's size check: every named dimension fits a kernel's `u32` argument, or an error
/// naming the first that does not.
#[cfg(feature = "cuda")]
pub(crate) fn check_u32(
    gpu: &crate::gpu::Gpu,
    op: &str,
    dims: &[(&str, usize)],
) -> Result<(), crate::DeviceError> {
    for &(what, v) in dims {
        if u32::try_from(v).is_err() {
            return Err(gpu.err(format!("{op}: {what} = {v} exceeds u32")));
        }
    }
    Ok(())
}

/// A launcher's alignment check: the device address is a multiple of `bytes`, or an error
/// naming the buffer.
#[cfg(feature = "cuda")]
pub(crate) fn check_align(
    gpu: &crate::gpu::Gpu,
    what: &str,
    ptr: cudarc::driver::sys::CUdeviceptr,
    bytes: u64,
) -> Result<(), crate::DeviceError> {
    if !ptr.is_multiple_of(bytes) {
        return Err(gpu.err(format!(
            "{what}: device address {ptr:#x} is not {bytes}-byte aligned"
        )));
    }
    Ok(())
}

/// Kernel source of the low-byte family (`ops::qgemm`, feature `cuda`): the contract's
/// device encoders of `kernels/quant.cu` (the byte-tested quantizer functions) followed by
/// `kernels/ops_qgemm.cu`, so its activation quantizers round with the very same code.
pub const QGEMM_SOURCE: &str = concat!(
    include_str!("../../kernels/quant.cu"),
    "\n",
    include_str!("../../kernels/ops_qgemm.cu")
);

/// Kernel source of the quantized linear layer (`ops::qlinear`, feature `cuda`): the contract's
/// device quantizer functions of `kernels/quant.cu` (its dequantization, element by element)
/// followed by `kernels/ops_qlinear.cu`.
pub const QLINEAR_SOURCE: &str = concat!(
    include_str!("../../kernels/quant.cu"),
    "\n",
    include_str!("../../kernels/ops_qlinear.cu")
);

/// Every op module's name and kernel source (compiled by `gpu::Gpu::module`; also compiled on
/// the host by the `nvrtc_check` example).
pub const SOURCES: &[(&str, &str)] = &[
    (
        "ops_elementwise",
        include_str!("../../kernels/ops_elementwise.cu"),
    ),
    ("ops_engine", include_str!("../../kernels/ops_engine.cu")),
    ("ops_norm", include_str!("../../kernels/ops_norm.cu")),
    ("ops_rope", include_str!("../../kernels/ops_rope.cu")),
    (
        "ops_attention",
        include_str!("../../kernels/ops_attention.cu"),
    ),
    ("ops_moe", include_str!("../../kernels/ops_moe.cu")),
    ("ops_router", include_str!("../../kernels/ops_router.cu")),
    ("ops_swiglu", include_str!("../../kernels/ops_swiglu.cu")),
    ("ops_gemm", include_str!("../../kernels/ops_gemm.cu")),
    ("ops_head", include_str!("../../kernels/ops_head.cu")),
    ("ops_optim", include_str!("../../kernels/ops_optim.cu")),
    (
        "ops_embed_backward",
        include_str!("../../kernels/ops_embed_backward.cu"),
    ),
    ("ops_sample", include_str!("../../kernels/ops_sample.cu")),
    ("ops_qgemm", QGEMM_SOURCE),
    ("ops_qlinear", QLINEAR_SOURCE),
    (
        "ops_fp8block",
        include_str!("../../kernels/ops_fp8block.cu"),
    ),
];
