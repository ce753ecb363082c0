//! `mxrl demo`: the README's main job, CPU only, a few minutes. Builds the embedded tiny MoE
//! (char-level tokenizer), warms it up with SFT on 1-digit addition, runs the RL ablation for
//! BF16, MXFP8 and NVFP4 (plus two more BF16 seeds for the noise band) and writes
//! `runs/demo/report.md` with plots.
//!
//! `--size large` uses the embedded ~45M-parameter MoE ([`large_config`]) instead, meant for
//! `--device cuda` (the linear GEMMs on GPU 0); its default output is `runs/demo-large`.

use super::rl::RlArgs;
use anyhow::{Context, Result};
use clap::Parser;
use mxrl_model::{Model, ModelConfig};
use mxrl_rl::session::{demo_config, save_model_dir};
use std::path::PathBuf;

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
    #[command(flatten)]
    device: super::device::DeviceArgs,
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
    let want = match a.size {
        Size::Small => demo_config(),
        Size::Large => large_config(),
    };
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
                save_model_dir(&model, &mxrl_rl::text::char_tokenizer_json(), &init)?;
                Some(init)
            }
        };
        eprintln!(
            "demo: SFT warm-up of the {:?} MoE on 1-digit addition ({} steps)",
            a.size, a.sft_steps
        );
        let loss = super::sft::sft_to_dir(
            start.as_deref(),
            1,
            a.sft_steps,
            64,
            3e-3,
            7,
            &base,
            false,
            a.device.device,
        )?;
        eprintln!("demo: SFT done, loss {loss:.4}");
    }
    let mut rl = Defaults::parse_from(["demo"]).rl;
    rl.steps = a.steps;
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
