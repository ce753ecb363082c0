//! `mxrl ablate`: the same RL run per recipe (only precision differs) plus a second BF16 seed,
//! sequential and resumable, then the report.

use super::rl::RlArgs;
use anyhow::Result;
use mxrl_rl::ablate::{run_ablation, AblationSpec};
use mxrl_rl::session::{build, load_model_dir, task_source};
use std::path::{Path, PathBuf};

/// Arguments of `mxrl ablate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Recipes, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq"
    )]
    recipes: Vec<String>,
    /// Seed of the extra BF16 run that measures run-to-run noise (0: none).
    #[arg(long, default_value_t = 2)]
    noise_seed: u64,
    /// Output directory.
    #[arg(long, default_value = "runs/ablate")]
    out: PathBuf,
    #[command(flatten)]
    rl: RlArgs,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run an ablation of `model_dir` into `out`; returns the report path.
pub fn ablate(
    model_dir: &Path,
    recipes: &[String],
    noise_seed: u64,
    out: &Path,
    rl: &RlArgs,
) -> Result<PathBuf> {
    let (model, codec) = load_model_dir(model_dir)?;
    let task = task_source(
        rl.task.as_deref(),
        rl.data.as_deref(),
        rl.digits,
        Some(model_dir),
    )?;
    let task_desc = match &rl.data {
        Some(f) => format!("prompts from {} (Answer: X reward)", f.display()),
        None => format!(
            "synthetic arithmetic, {}-digit addition (exact-match reward 1/0)",
            rl.digits
        ),
    };
    let c = model.config();
    let spec = AblationSpec {
        recipes: recipes.to_vec(),
        noise_seed: (noise_seed != 0).then_some(noise_seed),
        cfg: rl.config(),
        out: out.to_path_buf(),
        model: format!(
            "{} ({:?}, {} layers, hidden {}, {} experts top-{}, vocab {}, {} parameters; linear GEMMs on {})",
            model_dir.display(),
            c.arch,
            c.num_layers,
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            c.vocab_size,
            model.params().num_elements(),
            mxrl_tensor::backend::gemm_backend().name()
        ),
        task: task_desc,
    };
    Ok(run_ablation(&spec, &task, &codec, |r| build(&model, r))?)
}

/// Run `mxrl ablate`.
pub fn run(a: Args) -> Result<()> {
    let gemm = a.device.select()?;
    eprintln!("mxrl ablate: linear GEMMs on {gemm}");
    let p = ablate(&a.model, &a.recipes, a.noise_seed, &a.out, &a.rl)?;
    eprintln!("report: {}", p.display());
    Ok(())
}
