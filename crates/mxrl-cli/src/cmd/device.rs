//! `--device cpu|cuda`: where the linear layers' GEMMs run (the rest of the model stays on the
//! host). `cuda` installs `mxrl_cuda::CudaGemm` on GPU 0 as the process-wide GEMM backend:
//! cuBLAS f32 SGEMM (pedantic math, no TF32) on exactly the operands the CPU emulation
//! multiplies, so only the summation order differs; weights stay resident on the GPU.

use anyhow::Result;

/// Device of the linear layers' GEMMs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference backend.
    #[default]
    Cpu,
    /// GPU 0 through cuBLAS (needs a binary built with `--features cuda`).
    Cuda,
}

/// The `--device` option.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct DeviceArgs {
    /// Where the linear layers' GEMMs run: `cpu`, or `cuda` (GPU 0, cuBLAS f32 SGEMM on the
    /// same operands as the CPU emulation; the rest of the model stays on the host).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
}

impl DeviceArgs {
    /// Select the process-wide GEMM backend; returns a one-line description.
    ///
    /// # Errors
    /// `cuda` in a binary built without the `cuda` feature, or no usable GPU.
    pub fn select(&self) -> Result<String> {
        match self.device {
            Device::Cpu => Ok(mxrl_tensor::backend::gemm_backend().name()),
            Device::Cuda => select_cuda(),
        }
    }
}

/// The device engine of `model` on GPU 0 (`forward` and `generate` with `--device cuda`):
/// every tensor on the GPU, BF16 linears, block-format routed experts as stored; returns it
/// and a line saying what runs.
///
/// # Errors
/// No usable GPU, a model the engine cannot run (named), out of device memory.
#[cfg(feature = "cuda")]
pub fn cuda_engine(
    model: &mxrl_model::Model,
    max_pos: usize,
) -> Result<(
    mxrl_model::engine::Engine<mxrl_cuda::backend::CudaBackend>,
    String,
)> {
    let b = mxrl_cuda::backend::CudaBackend::new(0)
        .map_err(|e| anyhow::anyhow!("--device cuda: GPU 0 is not usable: {e}"))?;
    let name = b.name();
    let (e, what) = mxrl_model::engine::Engine::from_model_as_run(model, b, max_pos)
        .map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
    Ok((e, format!("{what} on {name}")))
}

/// The device engine of the checkpoint in `dir` on GPU 0 (`forward` and `generate` with
/// `--device cuda`): a Hugging Face checkpoint is streamed from its memory-mapped files tensor
/// by tensor (`Engine::from_checkpoint`: no host model, one tensor or one layer's experts in
/// f32 at a time); an `mxrl convert` output goes through the host model. Returns the engine
/// and a line saying what runs and how it was read.
///
/// # Errors
/// No usable GPU, a checkpoint the loader refuses (naming the file and tensor), a model the
/// engine cannot run (named), out of device memory.
#[cfg(feature = "cuda")]
pub fn cuda_engine_from_checkpoint(
    dir: &std::path::Path,
    max_pos: usize,
) -> Result<(
    mxrl_model::engine::Engine<mxrl_cuda::backend::CudaBackend>,
    String,
)> {
    use anyhow::Context;
    let b = mxrl_cuda::backend::CudaBackend::new(0)
        .map_err(|e| anyhow::anyhow!("--device cuda: GPU 0 is not usable: {e}"))?;
    let name = b.name();
    let (e, what) = mxrl_model::engine::Engine::from_checkpoint(dir, b, max_pos)
        .with_context(|| format!("--device cuda: loading {}", dir.display()))?;
    Ok((e, format!("{what} on {name}")))
}

#[cfg(feature = "cuda")]
fn select_cuda() -> Result<String> {
    let g = mxrl_cuda::CudaGemm::new(0)
        .map_err(|e| anyhow::anyhow!("--device cuda: GPU 0 is not usable: {e}"))?;
    let name = mxrl_tensor::backend::GemmBackend::name(&g);
    mxrl_tensor::backend::set_gemm_backend(std::sync::Arc::new(g));
    Ok(name)
}

#[cfg(not(feature = "cuda"))]
fn select_cuda() -> Result<String> {
    cuda_built().map(|()| String::new())
}

/// Fails in a binary built without CUDA support, saying how to build one (checked before any
/// work by the commands that run the device engine).
///
/// # Errors
/// Built without the `cuda` feature.
pub fn cuda_built() -> Result<()> {
    if cfg!(feature = "cuda") {
        return Ok(());
    }
    anyhow::bail!(
        "--device cuda: this mxrl binary was built without CUDA support; rebuild it with \
         `cargo build --release -p mxrl-cli --features cuda` (CUDA libraries are loaded at run \
         time, so the build itself needs no CUDA installation)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_and_selects_the_reference_backend() {
        let d = DeviceArgs::default();
        assert_eq!(d.device, Device::Cpu);
        assert!(d.select().unwrap().starts_with("cpu"));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let e = DeviceArgs {
            device: Device::Cuda,
        }
        .select()
        .unwrap_err()
        .to_string();
        assert!(e.contains("built without CUDA support"), "{e}");
        assert!(e.contains("--features cuda"), "{e}");
    }
}
