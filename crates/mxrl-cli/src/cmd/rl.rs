//! `mxrl rl`: GRPO on a model directory with one precision recipe, live weight sync and
//! per-step metrics; resumable from `RUN_DIR/checkpoint.safetensors`.

use anyhow::{Context, Result};
use mxrl_rl::ablate::{progress_line, step_bar};
use mxrl_rl::grpo::{GrpoConfig, IsCorrection, IsLevel};
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{RlConfig, RlRun};
use mxrl_rl::session::{build, load_model_dir, task_source};
use mxrl_rl::SamplingConfig;
use std::path::PathBuf;

/// Hyper-parameters shared by `rl`, `ablate` and `demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct RlArgs {
    /// Built-in task (`arithmetic`); ignored when --data is given.
    #[arg(long)]
    pub task: Option<String>,
    /// DAPO-style JSONL prompt file (`prompt`, `label`), scored with the `Answer: X` reward.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Digits per operand of the arithmetic task.
    #[arg(long, default_value_t = 1)]
    pub digits: u32,
    /// Optimizer steps.
    #[arg(long, default_value_t = 50)]
    pub steps: u64,
    /// Prompts per step.
    #[arg(long, default_value_t = 16)]
    pub prompts_per_step: usize,
    /// Samples per prompt (GRPO group size).
    #[arg(long, default_value_t = 8)]
    pub samples: usize,
    /// Longest response in tokens.
    #[arg(long, default_value_t = 4)]
    pub max_new_tokens: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Global grad-norm clip.
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f32,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 32)]
    pub micro_batch: usize,
    /// Seed of prompts and sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Coefficient of the K3 KL to the frozen reference (always logged).
    #[arg(long, default_value_t = 0.0)]
    pub kl_coef: f32,
    /// Mean-only group normalisation (no division by the group std).
    #[arg(long)]
    pub mean_only: bool,
    /// Truncated importance-sampling cap (token level) for the rollout/trainer mismatch.
    #[arg(long)]
    pub tis_cap: Option<f32>,
    /// Masked importance sampling `low,high` (sequence level).
    #[arg(long, value_delimiter = ',', num_args = 2)]
    pub mis: Option<Vec<f32>>,
    /// Turn routing replay off.
    #[arg(long)]
    pub no_routing_replay: bool,
    /// Bitwise mode: the rollout re-scores with the trainer's forward and batch shapes.
    #[arg(long)]
    pub bitwise: bool,
    /// Compare the rollout's weight bytes with the trainer's after every update.
    #[arg(long)]
    pub check_weight_sync: bool,
    /// Checkpoint every N steps.
    #[arg(long, default_value_t = 10)]
    pub checkpoint_every: u64,
}

impl RlArgs {
    /// The run configuration.
    pub fn config(&self) -> RlConfig {
        let is_correction = match (&self.tis_cap, &self.mis) {
            (Some(c), _) => IsCorrection::Truncated {
                level: IsLevel::Token,
                cap: *c,
            },
            (None, Some(v)) => IsCorrection::Masked {
                level: IsLevel::Sequence,
                low: v[0],
                high: v[1],
            },
            _ => IsCorrection::None,
        };
        RlConfig {
            seed: self.seed,
            steps: self.steps,
            prompts_per_step: self.prompts_per_step,
            samples: self.samples,
            sampling: SamplingConfig {
                temperature: self.temperature,
                top_p: self.top_p,
                max_new_tokens: self.max_new_tokens,
            },
            grpo: GrpoConfig {
                std_normalize: !self.mean_only,
                kl_coef: self.kl_coef,
                is_correction,
                ..GrpoConfig::default()
            },
            adam: AdamWConfig {
                lr: self.lr,
                max_grad_norm: self.max_grad_norm,
                ..AdamWConfig::default()
            },
            micro_batch: self.micro_batch,
            routing_replay: !self.no_routing_replay,
            bitwise: self.bitwise,
            check_weight_sync: self.check_weight_sync,
            checkpoint_every: self.checkpoint_every,
            ..RlConfig::default()
        }
    }
}

/// Arguments of `mxrl rl`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Precision recipe: a preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq) or a TOML file.
    #[arg(long, default_value = "bf16")]
    recipe: String,
    /// Run directory (metrics.jsonl, checkpoint.safetensors).
    #[arg(long, default_value = "runs/rl")]
    out: PathBuf,
    #[command(flatten)]
    rl: RlArgs,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run `mxrl rl`.
pub fn run(a: Args) -> Result<()> {
    let gemm = a.device.select()?;
    eprintln!("mxrl rl: linear GEMMs on {gemm}");
    let (model, codec) = load_model_dir(&a.model)?;
    let task = task_source(
        a.rl.task.as_deref(),
        a.rl.data.as_deref(),
        a.rl.digits,
        Some(&a.model),
    )?;
    let b = build(&model, &a.recipe).with_context(|| format!("recipe {}", a.recipe))?;
    let cfg = a.rl.config();
    eprintln!(
        "mxrl rl: model {} · recipe {} · contract {} · weights {:?} · {} steps × {} prompts × {} samples",
        a.model.display(),
        a.recipe,
        b.contract_hash,
        b.weight_bytes,
        cfg.steps,
        cfg.prompts_per_step,
        cfg.samples
    );
    let mut run = RlRun::new(
        cfg.clone(),
        b.trainer,
        b.rollout,
        b.reference,
        task,
        &codec,
        &a.out,
        &b.contract_hash,
    )?;
    if run.state.step > 0 {
        eprintln!(
            "resuming from step {} ({})",
            run.state.step,
            a.out.display()
        );
    }
    let pb = step_bar(&a.recipe, cfg.steps);
    pb.set_position(run.state.step);
    run.run(&mut |m| {
        pb.set_message(progress_line(m));
        pb.inc(1);
    })?;
    pb.finish();
    eprintln!("metrics: {}", a.out.join("metrics.jsonl").display());
    Ok(())
}
