//! The ablation runner: the same RL run once per recipe (identical seeds, prompts and
//! hyper-parameters), plus a second BF16 seed to measure run-to-run noise; sequential and
//! resumable (each run resumes from its own checkpoint), then the report.

use crate::metrics::StepMetrics;
use crate::policy::{RolloutPolicy, TrainPolicy};
use crate::report::{Manifest, RunEntry};
use crate::runner::{RlConfig, RlRun, RunError};
use crate::task::TaskSource;
use crate::text::TextCodec;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A policy pair built for one recipe.
pub struct Built<T, R> {
    /// Trainer (f32 masters, plan-quantized forward).
    pub trainer: T,
    /// Rollout engine's policy.
    pub rollout: R,
    /// Frozen reference (the same base weights), for the reference-KL metric.
    pub reference: Option<T>,
    /// Stored weight bytes by format name.
    pub weight_bytes: BTreeMap<String, u64>,
    /// Quantizer contract hash stamped on weight updates.
    pub contract_hash: String,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct AblationSpec {
    /// Recipe names, in order (BF16 should come first).
    pub recipes: Vec<String>,
    /// Seed of the additional BF16 run (`None`: no noise run).
    pub noise_seed: Option<u64>,
    /// Shared configuration.
    pub cfg: RlConfig,
    /// Output directory.
    pub out: PathBuf,
    /// Model description for the report.
    pub model: String,
    /// Task description for the report.
    pub task: String,
}

/// The one-line console summary of a step.
pub fn progress_line(m: &StepMetrics) -> String {
    format!(
        "reward {:+.3} acc {:.2} len {:.1} |Δlp| {:.1e} k3 {:.1e} gn {:.2}{} ent {:.2} v{} {:.0} tok/s roll {:.2}s train {:.2}s sync {:.3}s",
        m.reward_mean,
        m.accuracy,
        m.response_len,
        m.train_rollout_logprob_abs_diff,
        m.k3_kl,
        m.grad_norm,
        if m.grad_spike { "!" } else { "" },
        m.entropy,
        m.weight_version,
        m.tokens_per_s,
        m.rollout_s,
        m.train_s,
        m.sync_s
    )
}

/// A progress bar for `steps` steps of run `name`.
pub fn step_bar(name: &str, steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template(
            "{prefix:>12} [{bar:25}] {pos:>3}/{len} {elapsed_precise} {msg}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    pb.set_prefix(name.to_string());
    pb
}

/// Run every recipe of `spec` (then the noise seed) and write `ablation.json` and the report.
/// `make(recipe)` builds fresh policies from the same base weights.
pub fn run_ablation<T, R, F>(
    spec: &AblationSpec,
    task: &TaskSource,
    codec: &TextCodec,
    mut make: F,
) -> Result<PathBuf, RunError>
where
    T: TrainPolicy,
    R: RolloutPolicy,
    F: FnMut(&str) -> Result<Built<T, R>, RunError>,
{
    std::fs::create_dir_all(&spec.out).map_err(|e| RunError::Checkpoint {
        path: spec.out.display().to_string(),
        msg: e.to_string(),
    })?;
    let mut plan: Vec<(String, String, u64)> = spec
        .recipes
        .iter()
        .map(|r| (r.clone(), r.clone(), spec.cfg.seed))
        .collect();
    if let Some(s) = spec.noise_seed {
        plan.push((format!("bf16-seed{s}"), "bf16".into(), s));
    }
    let mut entries = Vec::new();
    for (name, recipe, seed) in &plan {
        let b = make(recipe)?;
        entries.push(RunEntry {
            name: name.clone(),
            recipe: recipe.clone(),
            seed: *seed,
            dir: name.clone(),
            weight_bytes: b.weight_bytes.clone(),
        });
        write_manifest(&spec.out, spec, &entries)?;
        let mut cfg = spec.cfg.clone();
        cfg.seed = *seed;
        let dir = spec.out.join(name);
        let mut run = RlRun::new(
            cfg.clone(),
            b.trainer,
            b.rollout,
            b.reference,
            task.clone(),
            codec,
            &dir,
            &b.contract_hash,
        )?;
        let pb = step_bar(name, cfg.steps);
        pb.set_position(run.state.step);
        run.run(&mut |m| {
            pb.set_message(progress_line(m));
            pb.inc(1);
        })?;
        pb.finish();
    }
    crate::report::write_report(&spec.out).map_err(|e| RunError::Config(e.to_string()))
}

fn write_manifest(out: &Path, spec: &AblationSpec, runs: &[RunEntry]) -> Result<(), RunError> {
    let m = Manifest {
        model: spec.model.clone(),
        task: spec.task.clone(),
        config: serde_json::to_value(&spec.cfg).expect("config serializes"),
        runs: runs.to_vec(),
    };
    let p = out.join("ablation.json");
    let tmp = out.join("ablation.json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_string_pretty(&m).expect("manifest serializes"),
    )
    .and_then(|_| std::fs::rename(&tmp, &p))
    .map_err(|e| RunError::Checkpoint {
        path: p.display().to_string(),
        msg: e.to_string(),
    })
}
