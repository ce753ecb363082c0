//! `mxrl demo`: the README's main job, CPU only, a few minutes. Builds the embedded tiny MoE
//! (char-level tokenizer), warms it up with SFT on 1-digit addition, runs the RL ablation for
//! BF16, MXFP8 and NVFP4 (plus two more BF16 seeds for the noise band) and writes
//! `runs/demo/report.md` with plots.
//!
//! `--size large` uses the embedded ~45M-parameter MoE ([`large_config`]) instead, meant for
//! `--device cuda` (the device engine on GPU 0); its default output is `runs/demo-large`.
//!
//! `--task chain` (with `--ops`, `--operators`, `--digits`) warms up and runs on chains of
//! operations instead; `--tokenizer FILE` gives the fresh model a trained BPE tokenizer. The
//! warm-up's task is recorded in `OUT/warmup.json`, so a warmed-up model is only reused for
//! the task it was trained on.

use super::rl::RlArgs;
use anyhow::{Context, Result};
use clap::Parser;
use mxrl_model::{Model, ModelConfig};
use mxrl_rl::session::{demo_config, save_model_dir};
use mxrl_rl::task::TaskSpec;
use std::path::{Path, PathBuf};

/// Which embedded demo model.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The tiny MoE (hidden 64, 4 layers, 8 experts; ~0.2M parameters): CPU, minutes.
    Small,
    /// A ~45M-parameter MoE (hidden 384, 6 layers, 16 experts top-2, F = 384): for `--device cuda`.
    Large,
}

/// The `--size large` model: the demo's char-level vocabulary (128) and Qwen3-MoE layout with
/// hidden 384, 6 layers, 6 query / 2 kv heads of width 64, 16 experts top-2 with F = 384 —
/// 44.7M parameters (~5.9M active per token). Every contraction dim is a multiple of 32.
pub fn large_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 384,
        num_layers: 6,
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 64,
        moe_intermediate_size: 384,
        num_experts: 16,
        num_experts_per_tok: 2,
        initializer_range: 0.02,
        ..demo_config()
    }
}

/// The RL defaults of `mxrl rl`, parsed from an empty command line.
#[derive(Parser, Debug)]
struct Defaults {
    #[command(flatten)]
    rl: RlArgs,
}

/// Arguments of `mxrl demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output directory (default `runs/demo`, `runs/demo-large` with `--size large`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Embedded model: `small` (CPU, minutes) or `large` (~45M parameters, for `--device cuda`).
    #[arg(long, value_enum, default_value_t = Size::Small)]
    size: Size,
    /// Recipes to compare.
    #[arg(long, value_delimiter = ',', default_value = "bf16,mxfp8,nvfp4-hp")]
    recipes: Vec<String>,
    /// RL steps per recipe (≥ 1).
    #[arg(long, default_value_t = 60, value_parser = super::validate::count)]
    steps: u64,
    /// SFT warm-up steps (≥ 1).
    #[arg(long, default_value_t = 50, value_parser = super::validate::count)]
    sft_steps: u64,
    /// Built-in task: `arithmetic` (1-digit addition by default) or `chain` (a chain of
    /// operations such as `7+5*3-8=`, standard precedence).
    #[arg(long, default_value = "arithmetic")]
    task: String,
    /// Digits per operand: 1–6 for the arithmetic task, 1–9 for the chain task.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    digits: u32,
    /// Operations per problem of the chain task (1–16; default 3).
    #[arg(long)]
    ops: Option<u32>,
    /// Operators the chain task draws from (some of `+-*`; default all three).
    #[arg(long, allow_hyphen_values = true)]
    operators: Option<String>,
    /// A `tokenizer.json` (e.g. from `mxrl tokenizer train`) for the demo model instead of
    /// the char-level one; the model's vocabulary becomes the tokenizer's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// `OUT/warmup.json`: the task a demo's warmed-up model was trained on.
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct Warmup {
    /// [`TaskSpec::describe`] of the warm-up task.
    task: String,
}

/// Refuse to reuse the warmed-up model in `out/base` for another task than `task`: the one
/// recorded in `out/warmup.json`, or 1-digit addition for a directory from before the record.
fn check_warmup(out: &Path, task: &str) -> Result<()> {
    let p = out.join("warmup.json");
    let had = if p.exists() {
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str::<Warmup>(&text)
            .with_context(|| format!("parsing {}", p.display()))?
            .task
    } else {
        TaskSpec::default().describe()?
    };
    anyhow::ensure!(
        had == task,
        "{}: the warmed-up model there was trained on {had}, not on {task}; use another --out",
        out.join("base").display()
    );
    Ok(())
}

/// Run `mxrl demo`.
pub fn run(a: Args) -> Result<()> {
    let t0 = std::time::Instant::now();
    if a.device.device == super::device::Device::Cuda {
        super::device::cuda_built()?;
    }
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(match a.size {
            Size::Small => "runs/demo",
            Size::Large => "runs/demo-large",
        })
    });
    let spec = TaskSpec {
        name: Some(a.task.clone()),
        data: None,
        digits: a.digits,
        ops: a.ops,
        operators: a.operators.clone(),
    };
    let task_text = spec.describe()?;
    let chain = spec.chain()?;
    let tokenizer = a
        .tokenizer
        .as_deref()
        .map(super::sft::read_tokenizer)
        .transpose()?;
    let mut want = match a.size {
        Size::Small => demo_config(),
        Size::Large => large_config(),
    };
    if let Some((_, codec)) = &tokenizer {
        want.vocab_size = codec.vocab_size;
    }
    // Every recipe is resolved before the warm-up, so a typo costs nothing.
    let bad: Vec<String> = a
        .recipes
        .iter()
        .filter_map(|r| {
            mxrl_rl::moe::plan_for(&want, r)
                .err()
                .map(|e| format!("{r}: {e}"))
        })
        .collect();
    anyhow::ensure!(
        bad.is_empty(),
        "nothing was run; {} recipe(s) do not resolve:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
    std::fs::create_dir_all(&out)
        .with_context(|| format!("creating the demo output directory {}", out.display()))?;
    let base = out.join("base");
    if base.join("config.json").exists() && base.join("tokenizer.json").exists() {
        let have = ModelConfig::from_dir(&base)
            .with_context(|| format!("reading {}", base.join("config.json").display()))?;
        let shape = |c: &ModelConfig| (c.hidden_size, c.num_layers, c.num_experts);
        anyhow::ensure!(
            shape(&have) == shape(&want),
            "{}: the warmed-up model there is not the {:?} demo model (hidden, layers, experts              {:?}, expected {:?}); use another --out",
            base.display(),
            a.size,
            shape(&have),
            shape(&want)
        );
        check_warmup(&out, &task_text)?;
        let there = std::fs::read_to_string(base.join("tokenizer.json"))
            .with_context(|| format!("reading {}", base.join("tokenizer.json").display()))?;
        let (json, name) = match (&tokenizer, &a.tokenizer) {
            (Some((json, _)), Some(p)) => (json.clone(), p.display().to_string()),
            _ => (
                mxrl_rl::text::char_tokenizer_json(),
                "the char-level one (no --tokenizer)".to_string(),
            ),
        };
        anyhow::ensure!(
            there == json,
            "{}: the warmed-up model there has another tokenizer than {name}; use another --out",
            base.display()
        );
        eprintln!("demo: reusing the warmed-up model in {}", base.display());
    } else {
        let start = match a.size {
            Size::Small => None,
            Size::Large => {
                let init = out.join("init");
                let model = Model::random(&want, 7)?;
                eprintln!(
                    "demo: large MoE, {} parameters",
                    model.params().num_elements()
                );
                let json = match &tokenizer {
                    Some((json, _)) => json.clone(),
                    None => mxrl_rl::text::char_tokenizer_json(),
                };
                save_model_dir(&model, &json, &init)?;
                Some(init)
            }
        };
        eprintln!(
            "demo: SFT warm-up of the {:?} MoE on {task_text} ({} steps)",
            a.size, a.sft_steps
        );
        let loss = super::sft::sft_to_dir(
            start.as_deref(),
            &spec,
            match a.size {
                Size::Small => a.tokenizer.as_deref(),
                Size::Large => None,
            },
            a.sft_steps,
            64,
            3e-3,
            7,
            &base,
            false,
            a.device.device,
        )?;
        eprintln!("demo: SFT done, loss {loss:.4}");
        mxrl_rl::manifest::write_json_atomic(
            &out.join("warmup.json"),
            &Warmup { task: task_text },
        )?;
    }
    let mut rl = Defaults::parse_from(["demo"]).rl;
    rl.steps = a.steps;
    rl.task = spec.name.clone();
    rl.digits = spec.digits;
    rl.ops = spec.ops;
    rl.operators = spec.operators.clone();
    if let Some(c) = &chain {
        // Room for the longest answer (one token per character at most).
        rl.max_new_tokens = rl.max_new_tokens.max(c.max_label_chars());
    }
    let report = super::ablate::ablate(
        &base,
        &a.recipes,
        &[2, 3],
        &out,
        &rl,
        false,
        a.device.device,
    )?;
    eprintln!(
        "demo: done in {:.0} s.\n  open the report: {}\n  next, one run of your own: mxrl rl --model {} --recipe nvfp4-hp --steps 50\n  \
         (writes runs/rl-nvfp4-hp; `mxrl report runs/rl-nvfp4-hp` draws its plots)",
        t0.elapsed().as_secs_f64(),
        report.display(),
        base.display()
    );
    Ok(())
}
