//! The CUDA op set of the engine: one module per op family, each with its kernel source
//! (`kernels/ops_*.cu`), a struct holding the loaded functions, and one typed launcher per op
//! that checks shapes before the `unsafe` launch. The named CPU reference of every op is the
//! `mxrl_tensor` function its doc comment names; `tests/ops_*.rs` compare against it.

#[cfg(feature = "cuda")]
pub mod elementwise;
#[cfg(feature = "cuda")]
pub mod embed_backward;
#[cfg(feature = "cuda")]
pub mod head;
#[cfg(feature = "cuda")]
pub mod optim;
#[cfg(feature = "cuda")]
pub mod sample;

/// Every op module's name and kernel source (compiled by `gpu::Gpu::module`; also compiled on
/// the host by the `nvrtc_check` example).
pub const SOURCES: &[(&str, &str)] = &[
    (
        "ops_elementwise",
        include_str!("../../kernels/ops_elementwise.cu"),
    ),
    ("ops_head", include_str!("../../kernels/ops_head.cu")),
    ("ops_optim", include_str!("../../kernels/ops_optim.cu")),
    (
        "ops_embed_backward",
        include_str!("../../kernels/ops_embed_backward.cu"),
    ),
    ("ops_sample", include_str!("../../kernels/ops_sample.cu")),
];
