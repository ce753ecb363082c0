//! `--device cpu|cuda`: where the model runs.
//!
//! - `cpu`: the CPU reference (`mxrl-model`'s model and kernels).
//! - `cuda`: the device engine on GPU 0 (`mxrl_model::engine::Engine` on `mxrl-cuda`'s
//!   backend: weights, gradients, AdamW moments, activations and KV caches on the GPU) for
//!   `forward`, `generate`, `sft`, `rl`, `ablate`, `demo` and `rollout-server`, block-format
//!   linears on their stored bytes. A recipe the engine has no kernels for (`check_engine_plan`
//!   names the tensor and why) is refused with `--device cuda` and runs with `--device cpu`. A
//!   trainer and its rollout server started with the same `--device` hold the same tensor
//!   layout; `rl --rollout` refuses a server whose layout differs.

use anyhow::Result;

/// What the CPU reference runs on, for the lines commands print.
pub const CPU_LINE: &str = "cpu (the reference model; matrixmultiply f32 GEMMs)";

/// Where the model runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference.
    #[default]
    Cpu,
    /// GPU 0 (needs a binary built with `--features cuda`).
    Cuda,
}

/// The `--device` option.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct DeviceArgs {
    /// Where the model runs: `cpu` (the reference), or `cuda`: GPU 0, the whole model on the
    /// device engine. Each command prints which.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
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
/// f32 at a time); an `mxrl convert` output is streamed from its stored tensors, block-format
/// linears on their stored bytes. Returns the engine
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

/// Trainer, rollout and frozen reference of one recipe, boxed so that a run can hold either
/// backend.
pub type Policies =
    mxrl_rl::ablate::Built<Box<dyn mxrl_rl::TrainPolicy>, Box<dyn mxrl_rl::RolloutPolicy>>;

/// `b` with its policies boxed.
fn boxed<T, R>(b: mxrl_rl::ablate::Built<T, R>) -> Policies
where
    T: mxrl_rl::TrainPolicy + 'static,
    R: mxrl_rl::RolloutPolicy + 'static,
{
    Policies {
        trainer: Box::new(b.trainer),
        rollout: Box::new(b.rollout),
        reference: b
            .reference
            .map(|r| Box::new(r) as Box<dyn mxrl_rl::TrainPolicy>),
        weight_bytes: b.weight_bytes,
        contract_hash: b.contract_hash,
        build_phases: b.build_phases,
    }
}

/// The policies of `recipe` on `device`, and a line saying what runs where: the CPU reference,
/// or with `cuda` the device engine (a recipe it has no kernels for is refused, naming the
/// tensor). A rollout server started with the same `--device` holds the same layout
/// ([`build_rollout`]).
///
/// # Errors
/// The recipe does not resolve; no usable GPU; a recipe or model the engine cannot run.
pub fn build_policies(
    model: &mxrl_model::Model,
    recipe: &str,
    device: Device,
) -> Result<(Policies, String)> {
    if device == Device::Cpu {
        let b = mxrl_rl::session::build(model, recipe)?;
        return Ok((boxed(b), CPU_LINE.to_string()));
    }
    cuda_built()?;
    engine_plan(model, recipe)?;
    engine_policies(model, recipe)
}

/// Fails unless the device engine runs every tensor `recipe` stores on `model`.
fn engine_plan(model: &mxrl_model::Model, recipe: &str) -> Result<()> {
    let plan = mxrl_rl::moe::plan_for(model.config(), recipe)?;
    mxrl_rl::engine::check_engine_plan(&plan).map_err(|e| anyhow::anyhow!("--device cuda: {e}"))
}

/// The rollout side alone (`rollout-server`): the CPU reference, or the device engine on
/// `cuda`; with its weight bytes per format, the contract hash and a line saying what runs
/// where.
///
/// # Errors
/// As [`build_policies`].
pub fn build_rollout(
    model: &mxrl_model::Model,
    recipe: &str,
    device: Device,
) -> Result<(Box<dyn mxrl_rl::RolloutPolicy + Send>, Built, String)> {
    if device == Device::Cpu {
        let b = mxrl_rl::session::build(model, recipe)?;
        return Ok((
            Box::new(b.rollout),
            Built {
                weight_bytes: b.weight_bytes,
                contract_hash: b.contract_hash,
            },
            CPU_LINE.to_string(),
        ));
    }
    cuda_built()?;
    engine_plan(model, recipe)?;
    engine_rollout(model, recipe)
}

/// What a built rollout reports besides the policy.
pub struct Built {
    /// Stored bytes per format name.
    pub weight_bytes: std::collections::BTreeMap<String, u64>,
    /// The contract hash weight updates must carry.
    pub contract_hash: String,
}

#[cfg(feature = "cuda")]
fn engine_rollout(
    model: &mxrl_model::Model,
    recipe: &str,
) -> Result<(Box<dyn mxrl_rl::RolloutPolicy + Send>, Built, String)> {
    let plan = mxrl_rl::moe::plan_for(model.config(), recipe)?;
    let formats = mxrl_rl::moe::formats_for(model, &plan)?;
    let b = mxrl_cuda::backend::CudaBackend::new(0)
        .map_err(|e| anyhow::anyhow!("--device cuda: GPU 0 is not usable: {e}"))?;
    let name = b.name();
    let e =
        mxrl_model::engine::Engine::from_model(model, b, model.config().max_position_embeddings)
            .map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
    Ok((
        Box::new(mxrl_rl::engine::EngineRollout::new(e, &plan)?),
        Built {
            weight_bytes: mxrl_rl::moe::weight_bytes(model, &formats),
            contract_hash: mxrl_rl::wire::contract_hash().to_string(),
        },
        format!("the device engine on {name}"),
    ))
}

#[cfg(not(feature = "cuda"))]
fn engine_rollout(
    _: &mxrl_model::Model,
    _: &str,
) -> Result<(Box<dyn mxrl_rl::RolloutPolicy + Send>, Built, String)> {
    cuda_built().map(|()| unreachable!("cuda_built fails without the feature"))
}

#[cfg(feature = "cuda")]
fn engine_policies(model: &mxrl_model::Model, recipe: &str) -> Result<(Policies, String)> {
    use mxrl_rl::runner::RunError;
    let mut name = String::new();
    let b = mxrl_rl::session::build_engine(
        model,
        recipe,
        model.config().max_position_embeddings,
        || {
            let b = mxrl_cuda::backend::CudaBackend::new(0).map_err(|e| {
                RunError::Policy(mxrl_rl::PolicyError::Backend(format!(
                    "--device cuda: GPU 0 is not usable: {e}"
                )))
            })?;
            name = b.name();
            Ok(b)
        },
    )?;
    Ok((boxed(b), format!("the device engine on {name}")))
}

#[cfg(not(feature = "cuda"))]
fn engine_policies(_: &mxrl_model::Model, _: &str) -> Result<(Policies, String)> {
    cuda_built().map(|()| unreachable!("cuda_built fails without the feature"))
}

/// GPU 0 (`cuda:0 (name)`) and its free and total memory in bytes, when a CUDA device
/// answers (no kernel module is loaded); `None` otherwise (no GPU, or built without the `cuda`
/// feature).
#[cfg(feature = "cuda")]
pub fn gpu_memory() -> Option<(String, usize, usize)> {
    let g = mxrl_cuda::gpu::Gpu::shared(0).ok()?;
    let (free, total) = g.ctx().mem_get_info().ok()?;
    Some((g.name().to_string(), free, total))
}

/// Without the `cuda` feature there is no GPU to ask.
#[cfg(not(feature = "cuda"))]
pub fn gpu_memory() -> Option<(String, usize, usize)> {
    None
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
    fn cpu_is_the_default() {
        assert_eq!(DeviceArgs::default().device, Device::Cpu);
    }

    #[test]
    fn policies_on_the_cpu_run_the_reference_model() {
        let (model, _) = mxrl_rl::session::demo_model(1).unwrap();
        let (b, on) = build_policies(&model, "bf16", Device::Cpu).unwrap();
        assert!(on.starts_with("cpu"), "{on}");
        assert!(b.reference.is_some());
        assert!(!b.rollout.weights().is_empty());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn policies_on_cuda_without_the_feature_are_a_clear_error() {
        let (model, _) = mxrl_rl::session::demo_model(1).unwrap();
        let e = build_policies(&model, "bf16", Device::Cuda)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("built without CUDA support"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let e = cuda_built().unwrap_err().to_string();
        assert!(e.contains("built without CUDA support"), "{e}");
        assert!(e.contains("--features cuda"), "{e}");
    }
}
