//! `mxrl sft`: supervised warm-up on a task's reference completions; writes a model directory.

use super::device::Device;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use mxrl_ckpt::{partial_path, StagedDir};
use mxrl_rl::ablate::Built;
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{measured_reward, sft_until, SftConfig};
use mxrl_rl::session::{build, demo_config, demo_model, load_model_dir, write_model_dir};
use mxrl_rl::task::TaskSpec;
use mxrl_rl::text::TextCodec;
use mxrl_rl::{RolloutPolicy, SamplingConfig, TrainPolicy};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// Arguments of `mxrl sft`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory to start from (default: a fresh demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Built-in task: `arithmetic` (a+b=) or `chain` (a chain of operations such as
    /// `17+5*3-8=`, standard precedence; with --worked the targets are worked responses).
    #[arg(long, default_value = "arithmetic")]
    task: String,
    #[command(flatten)]
    problems: super::rl::ProblemArgs,
    /// A `tokenizer.json` (e.g. from `mxrl tokenizer train`; or a directory holding one) for
    /// the fresh model: its vocabulary size becomes the model's and the file is copied into
    /// OUT. Default: the char-level tokenizer.
    #[arg(long, conflicts_with = "model")]
    tokenizer: Option<PathBuf>,
    /// Optimizer steps (≥ 1).
    #[arg(long, default_value_t = 300, value_parser = super::validate::count)]
    steps: u64,
    /// Examples per step (≥ 1).
    #[arg(long, default_value_t = 64, value_parser = super::validate::count_usize)]
    batch: usize,
    /// Learning rate (> 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 3e-3, value_parser = super::validate::positive)]
    lr: f32,
    /// Coefficient of the MoE auxiliary load-balancing loss added to the SFT loss (≥ 0; e.g.
    /// 0.001, Qwen3-MoE's `router_aux_loss_coef`); 0 (the default): none.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0, value_parser = super::validate::non_negative)]
    aux_loss_coef: f32,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Output model directory (written as OUT.partial, renamed when complete).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing OUT (only once the new model is complete).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Read a `tokenizer.json` (`path`, or `path/tokenizer.json` for a directory): its text and
/// codec.
pub fn read_tokenizer(path: &Path) -> Result<(String, TextCodec)> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    let json = std::fs::read_to_string(&file)
        .with_context(|| format!("reading the tokenizer {}", file.display()))?;
    let codec = TextCodec::from_bytes(json.as_bytes(), &file.display().to_string())?;
    Ok((json, codec))
}

/// SFT from `start` (or a fresh demo model, with the char-level tokenizer or `tokenizer`)
/// on `task` into `out`; returns the final loss.
#[allow(clippy::too_many_arguments)]
pub fn sft_to_dir(
    start: Option<&Path>,
    task: &TaskSpec,
    tokenizer: Option<&Path>,
    steps: u64,
    batch: usize,
    lr: f32,
    aux_loss_coef: f32,
    seed: u64,
    out: &Path,
    force: bool,
    device: Device,
) -> Result<f64> {
    if device == Device::Cuda {
        super::device::cuda_built()?;
    }
    let task = task.source(None)?;
    if start.is_some() && tokenizer.is_some() {
        anyhow::bail!(
            "--tokenizer makes a fresh model for that tokenizer; a --model brings its own \
             tokenizer.json"
        );
    }
    let tokenizer = tokenizer.map(read_tokenizer).transpose()?;
    if out.exists() && !force {
        anyhow::bail!(
            "{}: already exists; refusing to overwrite it (pass --force to replace it once the \
             new model is complete)",
            out.display()
        );
    }
    // Fail on an unwritable output before training, not after: stage the output directory
    // once (what an interrupted run left there is recovered) and let it go again.
    drop(StagedDir::create(out, force).with_context(|| {
        format!(
            "creating the output directory {}",
            partial_path(out).display()
        )
    })?);
    let (model, tok_json, codec) = match start {
        Some(d) => {
            let (m, c) = load_model_dir(d)?;
            let tp = d.join("tokenizer.json");
            let tok = std::fs::read_to_string(&tp)
                .with_context(|| format!("reading the tokenizer {}", tp.display()))?;
            (m, tok, c)
        }
        None if tokenizer.is_some() => {
            let (json, codec) = tokenizer.expect("checked");
            let cfg = mxrl_model::ModelConfig {
                vocab_size: codec.vocab_size,
                ..demo_config()
            };
            (mxrl_model::Model::random(&cfg, seed)?, json, codec)
        }
        None => {
            let (m, j) = demo_model(seed)?;
            (
                m,
                j.clone(),
                TextCodec::from_bytes(j.as_bytes(), "<char-level>")?,
            )
        }
    };
    let cfg = SftConfig {
        steps,
        batch,
        seed: seed ^ 0x5f7,
        adam: AdamWConfig {
            lr,
            ..AdamWConfig::default()
        },
        aux_loss_coef,
    };
    sft_model_to_dir(
        &model, &tok_json, &codec, &task, &cfg, None, out, force, device,
    )
}

/// Stops the SFT warm-up once the model's sampled answers reach a reward: every `every`
/// steps, `prompts` problems (a stream of their own, never trained on: seed `seed`) are
/// answered with the current weights (temperature 1, up to `max_new_tokens` tokens) and
/// scored with the task's reward ([`mxrl_rl::runner::measured_reward`]); SFT stops at the
/// first mean reward ≥ `target`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RewardStop {
    /// Mean reward that ends the warm-up.
    pub target: f64,
    /// Steps between measurements (≥ 1).
    pub every: u64,
    /// Problems per measurement.
    pub prompts: usize,
    /// Longest sampled answer.
    pub max_new_tokens: usize,
    /// Seed of the measured problems and of sampling.
    pub seed: u64,
}

/// The answers to `prompts` under the trainer's current weights (for [`RewardStop`]): the
/// rollout takes the trainer's weights as version `version` (device to device when both sides
/// can), then samples one response per prompt (temperature 1, stopping after `eos`).
fn sample<T: TrainPolicy, R: RolloutPolicy>(
    t: &mut T,
    rollout: &mut R,
    version: u64,
    prompts: &[Vec<u32>],
    s: &RewardStop,
    eos: u32,
) -> Result<Vec<Vec<u32>>, mxrl_rl::runner::RunError> {
    t.refresh_weights()?;
    let local = match t.local_export() {
        Some(x) => rollout.load_local(version, &mut x?),
        None => None,
    };
    match local {
        Some(done) => done?,
        None => rollout.load_weights(&t.export_weights()?)?,
    }
    let cfg = SamplingConfig {
        temperature: 1.0,
        top_p: 1.0,
        max_new_tokens: s.max_new_tokens,
    };
    Ok(rollout
        .generate(prompts, 1, &cfg, eos, s.seed)?
        .into_iter()
        .map(|x| x.response)
        .collect())
}

/// SFT of `model` (with its tokenizer `tok_json`, `codec`) on `task` into the model directory
/// `out`, on `device`; with `stop`, ends early once the measured reward is reached. Returns
/// the final loss.
#[allow(clippy::too_many_arguments)]
pub fn sft_model_to_dir(
    model: &mxrl_model::Model,
    tok_json: &str,
    codec: &TextCodec,
    task: &mxrl_rl::task::TaskSource,
    cfg: &SftConfig,
    stop: Option<&RewardStop>,
    out: &Path,
    force: bool,
    device: Device,
) -> Result<f64> {
    let (trained, last) = match device {
        Device::Cpu => {
            let Built {
                trainer: mut t,
                rollout: mut r,
                ..
            } = build(model, "bf16")?;
            let last = train(&mut t, &mut r, task, codec, cfg, stop)?;
            (t.master_model()?, last)
        }
        Device::Cuda => sft_on_device(model, task, codec, cfg, stop)?,
    };
    write_model_dir(&trained, tok_json, out, force)
        .with_context(|| format!("writing the trained model to {}", out.display()))?;
    Ok(last)
}

/// SFT of `model` on the device engine (GPU 0); returns the trained masters and the last loss.
#[cfg(feature = "cuda")]
fn sft_on_device(
    model: &mxrl_model::Model,
    task: &mxrl_rl::task::TaskSource,
    codec: &TextCodec,
    cfg: &SftConfig,
    stop: Option<&RewardStop>,
) -> Result<(mxrl_model::Model, f64)> {
    let mut name = String::new();
    let Built {
        trainer: mut t,
        rollout: mut r,
        ..
    } = mxrl_rl::session::build_engines(
        model,
        "bf16",
        model.config().max_position_embeddings,
        false,
        || {
            let b = mxrl_cuda::backend::CudaBackend::new(0).map_err(|e| {
                mxrl_rl::runner::RunError::Policy(mxrl_rl::PolicyError::Backend(format!(
                    "--device cuda: GPU 0 is not usable: {e}"
                )))
            })?;
            name = b.name();
            Ok(b)
        },
    )?;
    eprintln!("sft: the model runs on the device engine on {name}");
    let last = train(&mut t, &mut r, task, codec, cfg, stop)?;
    Ok((t.master_model()?, last))
}

#[cfg(not(feature = "cuda"))]
fn sft_on_device(
    _: &mxrl_model::Model,
    _: &mxrl_rl::task::TaskSource,
    _: &TextCodec,
    _: &SftConfig,
    _: Option<&RewardStop>,
) -> Result<(mxrl_model::Model, f64)> {
    super::device::cuda_built()?;
    unreachable!("cuda_built fails without the feature")
}

/// The SFT loop with a progress bar (a line per step when stderr is not a terminal), ending
/// early at `stop`'s reward; returns the last loss.
fn train<T: TrainPolicy, R: RolloutPolicy>(
    t: &mut T,
    rollout: &mut R,
    task: &mxrl_rl::task::TaskSource,
    codec: &TextCodec,
    cfg: &SftConfig,
    stop: Option<&RewardStop>,
) -> Result<f64> {
    let steps = cfg.steps;
    let plain = !std::io::stderr().is_terminal();
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:25}] {pos:>4}/{len} {elapsed_precise} {msg}",
        )?
        .progress_chars("=> "),
    );
    pb.set_prefix("sft");
    let mut last = f64::NAN;
    let mut reward: Option<f64> = None;
    let mut version = 0;
    // Generation records nothing beyond the tokens here.
    rollout.set_routes(false);
    let took = sft_until(t, task, codec, cfg, &mut |t, step, loss| {
        last = loss;
        let mut done = false;
        if let Some(s) = stop {
            if (step + 1).is_multiple_of(s.every.max(1)) {
                version += 1;
                let r = measured_reward(task, codec, s.prompts, s.seed, &mut |ps| {
                    sample(t, rollout, version, ps, s, codec.eos)
                })?;
                reward = Some(r);
                done = r >= s.target;
            }
        }
        let mut shown = format!("loss {loss:.4}");
        // The MoE auxiliary loss, when the warm-up adds it (even routing: about top-k).
        if let Some(a) = t.last_aux_loss()? {
            shown += &format!(" aux {a:.3}");
        }
        if let Some(r) = reward {
            shown += &format!(" reward {r:.3}");
        }
        if plain {
            eprintln!("sft step {}/{steps}: {shown}", step + 1);
        }
        pb.set_message(shown);
        pb.inc(1);
        Ok(done)
    })?;
    pb.finish();
    if let Some(s) = stop {
        match reward {
            Some(r) if r >= s.target => eprintln!(
                "sft: measured reward {r:.3} ≥ {:.3} after {took} steps: warm-up done",
                s.target
            ),
            Some(r) => eprintln!(
                "sft: warning: the measured reward {r:.3} did not reach {:.3} in {took} steps",
                s.target
            ),
            None => eprintln!(
                "sft: warning: the reward was never measured (every {} steps; {took} ran), so \
                 the warm-up did not reach {:.3}",
                s.every.max(1),
                s.target
            ),
        }
    }
    Ok(last)
}

/// Run `mxrl sft`.
pub fn run(a: Args) -> Result<()> {
    let task = TaskSpec {
        name: Some(a.task.clone()),
        data: None,
        ..a.problems.task_spec()
    };
    let loss = sft_to_dir(
        a.model.as_deref(),
        &task,
        a.tokenizer.as_deref(),
        a.steps,
        a.batch,
        a.lr,
        a.aux_loss_coef,
        a.seed,
        &a.out,
        a.force,
        a.device.device,
    )?;
    eprintln!(
        "sft: final loss {loss:.4}; model written to {}",
        a.out.display()
    );
    Ok(())
}
