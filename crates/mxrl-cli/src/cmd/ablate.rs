//! `mxrl ablate`: the same RL run per recipe (only precision differs) plus BF16 runs with
//! other seeds, sequential and resumable, then the report.

use super::device::Device;
use super::rl::RlArgs;
use anyhow::Result;
use mxrl_rl::ablate::{run_ablation, AblationSpec, Selection};
use mxrl_rl::session::{load_model_dir, recipe_info};
use std::path::{Path, PathBuf};

/// Arguments of `mxrl ablate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Recipes, comma-separated: presets (the default six, or `fp8-block`) or TOML files (every
    /// one is resolved before the first run starts).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bf16,mxfp8,mxfp8-hp,mxfp8-dq,nvfp4-hp,nvfp4-dq"
    )]
    recipes: Vec<String>,
    /// Seeds of the extra BF16 runs that measure run-to-run noise, comma-separated; with the
    /// main BF16 run, two give the report's three-seed noise band (`none`: no extra runs,
    /// the band is then a bootstrap interval over steps).
    #[arg(long, default_value = "2,3", value_parser = noise_seeds)]
    noise_seeds: NoiseSeeds,
    /// Output directory.
    #[arg(long, default_value = "runs/ablate")]
    out: PathBuf,
    /// Discard the runs already in the output directory and start over.
    #[arg(long)]
    restart: bool,
    /// Run only these runs (names as in the report: a recipe, or `bf16-seedS`), comma-
    /// separated; the others are left as they are. Runs an ablation in parts into one
    /// directory; runs already finished are kept in any case.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    #[command(flatten)]
    rl: RlArgs,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// The `--noise-seeds` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoiseSeeds(pub Vec<u64>);

fn noise_seeds(s: &str) -> Result<NoiseSeeds, String> {
    if s == "none" || s.is_empty() {
        return Ok(NoiseSeeds(Vec::new()));
    }
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<u64>()
                .map_err(|_| format!("`{x}` is not a seed (a whole number)"))
        })
        .collect::<Result<Vec<u64>, String>>()
        .map(NoiseSeeds)
}

/// Run an ablation of `model_dir` into `out`; returns the report path.
pub fn ablate(
    model_dir: &Path,
    recipes: &[String],
    noise_seeds: &[u64],
    out: &Path,
    rl: &RlArgs,
    selection: &Selection,
    device: Device,
) -> Result<PathBuf> {
    if device == Device::Cuda {
        super::device::cuda_built()?;
    }
    // The digest reads the same files as the load: both run side by side (on the device
    // host of BENCHMARKS.md, 10 s each for a 10 GB model when run one after the other).
    let t = std::time::Instant::now();
    let (loaded, loaded_s, digest, digest_s) = std::thread::scope(|s| {
        let digest = s.spawn(|| {
            let r = mxrl_rl::manifest::model_digest(model_dir);
            (r, t.elapsed().as_secs_f64())
        });
        let loaded = load_model_dir(model_dir);
        let loaded_s = t.elapsed().as_secs_f64();
        let (digest, digest_s) = digest.join().expect("the model digest thread panicked");
        (loaded, loaded_s, digest, digest_s)
    });
    let (model, codec) = loaded?;
    let model_digest = digest?;
    let task = rl.task_spec().source(Some(model_dir))?;
    rl.warn_short_responses()?;
    let c = model.config();
    let cfg = rl.config();
    let device_line = match device {
        Device::Cpu => super::device::CPU_LINE.to_string(),
        // The card's name: its parts' timings compare only on the same kind of card, so a
        // part run on another one is refused as another run (`device` differs).
        Device::Cuda => format!(
            "{}: the device engine (block-format linears on their stored bytes)",
            super::device::gpu_memory().map_or_else(|| "GPU 0".to_string(), |g| g.0)
        ),
    };
    eprintln!(
        "mxrl ablate: {} loaded in {loaded_s:.1} s, its digest taken beside it in {digest_s:.1} s",
        model_dir.display(),
    );
    let spec = AblationSpec {
        recipes: recipes.to_vec(),
        noise_seeds: noise_seeds.to_vec(),
        cfg,
        out: out.to_path_buf(),
        model: format!(
            "{} ({:?}, {} layers, hidden {}, {} experts top-{}, vocab {}, {} parameters)",
            model_dir.display(),
            c.arch,
            c.num_layers,
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            c.vocab_size,
            model.params().num_elements(),
        ),
        model_path: model_dir.display().to_string(),
        model_digest,
        task: rl.task_description()?,
        device: device_line,
        selection: selection.clone(),
    };
    Ok(run_ablation(
        &spec,
        &task,
        &codec,
        |r| recipe_info(&model, r),
        |r| {
            let t = std::time::Instant::now();
            let (b, runs_on) = super::device::build_policies(&model, r, device)
                .map_err(|e| mxrl_rl::runner::RunError::Config(format!("{e:#}")))?;
            let parts: Vec<String> = b
                .build_phases
                .iter()
                .map(|(what, s)| format!("{what} {s:.1} s"))
                .collect();
            eprintln!(
                "mxrl ablate: recipe {r} runs on {runs_on} (trainer, rollout and reference \
                 built in {:.1} s{}{})",
                t.elapsed().as_secs_f64(),
                if parts.is_empty() { "" } else { ": " },
                parts.join(", ")
            );
            Ok(b)
        },
    )?)
}

/// Run `mxrl ablate`.
pub fn run(a: Args) -> Result<()> {
    let p = ablate(
        &a.model,
        &a.recipes,
        &a.noise_seeds.0,
        &a.out,
        &a.rl,
        &Selection {
            restart: a.restart,
            only: a.only,
        },
        a.device.device,
    )?;
    eprintln!("report: {}", p.display());
    Ok(())
}
