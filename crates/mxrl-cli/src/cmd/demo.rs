//! `mxrl demo`: the README's main job, CPU only, a few minutes. Builds the embedded tiny MoE
//! (char-level tokenizer), warms it up with SFT on 1-digit addition, runs the RL ablation for
//! BF16, MXFP8 and NVFP4 (plus a second BF16 seed for the noise level) and writes
//! `runs/demo/report.md` with plots.

use super::rl::RlArgs;
use anyhow::Result;
use clap::Parser;
use std::path::PathBuf;

/// The RL defaults of `mxrl rl`, parsed from an empty command line.
#[derive(Parser, Debug)]
struct Defaults {
    #[command(flatten)]
    rl: RlArgs,
}

/// Arguments of `mxrl demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output directory.
    #[arg(long, default_value = "runs/demo")]
    out: PathBuf,
    /// Recipes to compare.
    #[arg(long, value_delimiter = ',', default_value = "bf16,mxfp8,nvfp4-hp")]
    recipes: Vec<String>,
    /// RL steps per recipe.
    #[arg(long, default_value_t = 60)]
    steps: u64,
    /// SFT warm-up steps.
    #[arg(long, default_value_t = 50)]
    sft_steps: u64,
}

/// Run `mxrl demo`.
pub fn run(a: Args) -> Result<()> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(&a.out)?;
    let base = a.out.join("base");
    if base.join("config.json").exists() && base.join("tokenizer.json").exists() {
        eprintln!("demo: reusing the warmed-up model in {}", base.display());
    } else {
        eprintln!(
            "demo: SFT warm-up of the tiny MoE on 1-digit addition ({} steps)",
            a.sft_steps
        );
        let loss = super::sft::sft_to_dir(None, 1, a.sft_steps, 64, 3e-3, 7, &base)?;
        eprintln!("demo: SFT done, loss {loss:.4}");
    }
    let mut rl = Defaults::parse_from(["demo"]).rl;
    rl.steps = a.steps;
    let report = super::ablate::ablate(&base, &a.recipes, 2, &a.out, &rl)?;
    eprintln!(
        "demo: done in {:.0} s; report {}",
        t0.elapsed().as_secs_f64(),
        report.display()
    );
    Ok(())
}
