//! The ablation runner: the same RL run once per recipe (identical seeds, prompts and
//! hyper-parameters), plus a second BF16 seed to measure run-to-run noise; sequential and
//! resumable (each run resumes from its own checkpoint; a finished run is kept, checkpoint or
//! not), optionally in parts (`only`), then the report.

use crate::metrics::StepMetrics;
use crate::policy::{RolloutPolicy, TrainPolicy};
use crate::report::{Manifest, RunEntry};
use crate::runner::{RlConfig, RlRun, RunError};
use crate::task::TaskSource;
use crate::text::TextCodec;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::path::PathBuf;

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
    /// How long the parts of the build took, in order (what, seconds); empty where not
    /// timed.
    pub build_phases: Vec<(&'static str, f64)>,
}

/// What a recipe resolves to before anything runs (validated up front for every recipe).
#[derive(Debug, Clone, PartialEq)]
pub struct RecipeInfo {
    /// Hash of the resolved precision plan.
    pub plan_hash: String,
    /// Stored weight bytes by format name.
    pub weight_bytes: BTreeMap<String, u64>,
    /// Quantizer contract hash.
    pub contract_hash: String,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct AblationSpec {
    /// Recipe names, in order (BF16 should come first).
    pub recipes: Vec<String>,
    /// Seeds of the additional BF16 runs that measure run-to-run noise (two give the
    /// three-seed band of the report).
    pub noise_seeds: Vec<u64>,
    /// Shared configuration.
    pub cfg: RlConfig,
    /// Output directory.
    pub out: PathBuf,
    /// Model description for the report.
    pub model: String,
    /// Model directory as given.
    pub model_path: String,
    /// [`crate::manifest::model_digest`] of the model directory.
    pub model_digest: String,
    /// Task description for the report.
    pub task: String,
    /// Where the linear GEMMs run.
    pub device: String,
    /// What this invocation does with the runs already in `out`.
    pub selection: Selection,
}

/// What an ablation invocation does with the runs of its output directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// Discard the runs already in `out` and start over.
    pub restart: bool,
    /// Names of the runs ([`AblationSpec::runs`]) this invocation runs; empty: all of them.
    /// The others are left as they are, so one ablation can be run in parts (on several
    /// machines, or in several sessions) into one directory. Finished runs are kept in any
    /// case.
    pub only: Vec<String>,
}

impl AblationSpec {
    /// `(name, recipe, seed)` of every run, in order: the recipes with the shared seed, then
    /// `bf16-seedS` per noise seed.
    pub fn runs(&self) -> Vec<(String, String, u64)> {
        let mut v: Vec<(String, String, u64)> = self
            .recipes
            .iter()
            .map(|r| (r.clone(), r.clone(), self.cfg.seed))
            .collect();
        for &s in &self.noise_seeds {
            v.push((format!("bf16-seed{s}"), "bf16".into(), s));
        }
        v
    }
}

/// The one-line console summary of a step (with the rollout's prefill / decode split when
/// the policy measured it).
pub fn progress_line(m: &StepMetrics) -> String {
    let phases = m.rollout_phases.map_or(String::new(), |p| {
        format!(
            " (prefill {:.3}s, {} decode steps {:.3}s)",
            p.prefill_s, p.decode_steps, p.decode_s
        )
    });
    format!(
        "reward {:+.3} acc {:.2} len {:.1} |Δlp| {:.1e} k3 {:.1e} gn {:.2}{} ent {:.2} v{} {:.0} tok/s roll {:.2}s{phases} train {:.2}s sync {:.3}s",
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

/// The plain-text line of a step, for logs (stderr not a terminal).
pub fn plain_step_line(name: &str, steps: u64, m: &StepMetrics) -> String {
    format!(
        "{name} step {}/{steps}: reward {:.3} acc {:.2} |Δlogp| {:.2e} grad norm {:.3}{} {:.0} tok/s",
        m.step + 1,
        m.reward_mean,
        m.accuracy,
        m.train_rollout_logprob_abs_diff,
        m.grad_norm,
        if m.grad_spike { " (spike)" } else { "" },
        m.tokens_per_s
    )
}

/// Per-step progress of a run: a progress bar on a terminal, one plain line per step
/// ([`plain_step_line`]) on stderr otherwise.
pub struct StepLog {
    bar: Option<ProgressBar>,
    name: String,
    steps: u64,
}

impl StepLog {
    /// For run `name` of `steps` steps, `done` of them already done (resumed).
    pub fn new(name: &str, steps: u64, done: u64) -> StepLog {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let pb = step_bar(name, steps);
            pb.set_position(done);
            pb
        });
        if bar.is_none() && done > 0 {
            eprintln!("{name}: resuming at step {}/{steps}", done + 1);
        }
        StepLog {
            bar,
            name: name.to_string(),
            steps,
        }
    }

    /// One step done.
    pub fn step(&self, m: &StepMetrics) {
        match &self.bar {
            Some(pb) => {
                pb.set_message(progress_line(m));
                pb.inc(1);
            }
            None => eprintln!("{}", plain_step_line(&self.name, self.steps, m)),
        }
    }

    /// The run ended.
    pub fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish();
        }
    }
}

/// The end-of-run summary of a run's metrics file (windows as in the report).
pub fn run_summary_line(name: &str, m: &[StepMetrics]) -> String {
    if m.is_empty() {
        return format!("{name}: no steps logged");
    }
    let e = RunEntry {
        name: name.into(),
        recipe: name.into(),
        seed: 0,
        dir: ".".into(),
        weight_bytes: BTreeMap::new(),
        plan_hash: String::new(),
    };
    let s = crate::report::summarize(&e, m);
    format!(
        "{name}: {} steps; reward {:.3} (steps {}–{}) → {:.3} (steps {}–{}), mean {:.3}; |Δlogp| mean / median {}; median step {:.3} s",
        s.steps,
        s.initial_reward,
        s.first_window.0,
        s.first_window.1,
        s.final_reward,
        s.final_window.0,
        s.final_window.1,
        s.mean_reward,
        crate::report::fmt_stat(&s.abs_diff),
        s.step_s.median
    )
}

/// `Some(steps)` when `dir/metrics.jsonl` holds every step `0..steps` of a run in order (a
/// finished run, with or without a checkpoint): re-running it would repeat the same steps.
fn finished_steps(dir: &std::path::Path, steps: u64) -> Option<u64> {
    let m = crate::metrics::read_jsonl(&dir.join("metrics.jsonl")).ok()?;
    let complete = m.len() as u64 == steps && m.iter().zip(0..).all(|(x, i)| x.step == i);
    (steps > 0 && complete).then_some(steps)
}

/// Fields of `ablation.json` that may change on a re-run ([`crate::manifest::RESUMABLE_FIELDS`]).
const ABLATION_RESUMABLE: [&str; 4] = [
    "config.steps",
    "config.checkpoint_every",
    "config.check_weight_sync",
    "model_path",
];

/// Run every recipe of `spec` (then the noise seeds) and write `ablation.json` and the report.
///
/// Before the first run: `info(recipe)` resolves every recipe (all errors are reported at
/// once), and `ablation.json` is compared with the one already in `out` (a re-run with
/// another configuration is refused with the differing fields unless `spec.selection.restart`), then
/// written. Each run directory gets its own `run.json` ([`crate::manifest::prepare_run_dir`]);
/// a run whose `metrics.jsonl` already holds all its steps is kept without building anything,
/// and runs not named in `spec.selection.only` (when it names any) are left as they are.
/// `make(recipe)` builds fresh policies from the same base weights.
pub fn run_ablation<T, R, I, F>(
    spec: &AblationSpec,
    task: &TaskSource,
    codec: &TextCodec,
    mut info: I,
    mut make: F,
) -> Result<PathBuf, RunError>
where
    T: TrainPolicy,
    R: RolloutPolicy,
    I: FnMut(&str) -> Result<RecipeInfo, RunError>,
    F: FnMut(&str) -> Result<Built<T, R>, RunError>,
{
    spec.cfg.validate()?;
    let plan = spec.runs();
    let mut names = std::collections::BTreeSet::new();
    for (n, _, _) in &plan {
        if !names.insert(n.as_str()) {
            return Err(RunError::Config(format!(
                "run `{n}` appears twice (repeated recipe or noise seed)"
            )));
        }
    }
    let unknown: Vec<&str> = spec
        .selection
        .only
        .iter()
        .map(String::as_str)
        .filter(|n| !names.contains(n))
        .collect();
    if !unknown.is_empty() {
        return Err(RunError::Config(format!(
            "nothing was run; --only names no run of this ablation: {}; its runs are {}",
            unknown.join(", "),
            plan.iter()
                .map(|(n, _, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut infos: BTreeMap<String, RecipeInfo> = BTreeMap::new();
    let mut bad = Vec::new();
    for r in &spec.recipes {
        match info(r) {
            Ok(i) => {
                infos.insert(r.clone(), i);
            }
            Err(e) => bad.push(format!("recipe `{r}`: {e}")),
        }
    }
    if !spec.noise_seeds.is_empty() && !infos.contains_key("bf16") {
        match info("bf16") {
            Ok(i) => {
                infos.insert("bf16".into(), i);
            }
            Err(e) => bad.push(format!("recipe `bf16` (noise seeds): {e}")),
        }
    }
    if !bad.is_empty() {
        return Err(RunError::Config(format!(
            "nothing was run; {} recipe(s) do not resolve:\n  {}",
            bad.len(),
            bad.join("\n  ")
        )));
    }
    std::fs::create_dir_all(&spec.out).map_err(|e| RunError::Checkpoint {
        path: spec.out.display().to_string(),
        msg: format!("creating the ablation directory: {e}"),
    })?;
    let entries: Vec<RunEntry> = plan
        .iter()
        .map(|(name, recipe, seed)| RunEntry {
            name: name.clone(),
            recipe: recipe.clone(),
            seed: *seed,
            dir: name.clone(),
            weight_bytes: infos[recipe].weight_bytes.clone(),
            plan_hash: infos[recipe].plan_hash.clone(),
        })
        .collect();
    let man = Manifest {
        model: spec.model.clone(),
        task: spec.task.clone(),
        config: crate::manifest::as_written(&spec.cfg),
        runs: entries,
        model_path: spec.model_path.clone(),
        model_digest: spec.model_digest.clone(),
        device: spec.device.clone(),
    };
    let mp = spec.out.join("ablation.json");
    if mp.exists() && !spec.selection.restart {
        let text = std::fs::read_to_string(&mp).map_err(|e| RunError::Checkpoint {
            path: mp.display().to_string(),
            msg: format!("reading: {e}"),
        })?;
        let there: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| RunError::Checkpoint {
                path: mp.display().to_string(),
                msg: format!("parsing: {e}"),
            })?;
        let now = crate::manifest::as_written(&man);
        let diffs = crate::manifest::differing_fields(&there, &now, &ABLATION_RESUMABLE);
        if !diffs.is_empty() {
            return Err(RunError::OtherRun {
                dir: spec.out.display().to_string(),
                diffs,
            });
        }
    }
    crate::manifest::write_json_atomic(&mp, &man)?;
    // Runs left unfinished by this invocation (not in --only and not finished before).
    let mut left: Vec<&str> = Vec::new();
    for (name, recipe, seed) in &plan {
        if !spec.selection.only.is_empty() && !spec.selection.only.contains(name) {
            eprintln!("mxrl ablate: {name}: not in --only, left as it is");
            if finished_steps(&spec.out.join(name), spec.cfg.steps).is_none() {
                left.push(name);
            }
            continue;
        }
        let mut cfg = spec.cfg.clone();
        cfg.seed = *seed;
        let dir = spec.out.join(name);
        let i = &infos[recipe];
        let rm = crate::manifest::RunManifest {
            version: crate::manifest::RUN_MANIFEST_VERSION,
            recipe: recipe.clone(),
            plan_hash: i.plan_hash.clone(),
            contract_hash: i.contract_hash.clone(),
            model_path: spec.model_path.clone(),
            model_digest: spec.model_digest.clone(),
            task: spec.task.clone(),
            device: spec.device.clone(),
            config: cfg.clone(),
        };
        crate::manifest::prepare_run_dir(&dir, &rm, spec.selection.restart)?;
        if let Some(done) = finished_steps(&dir, cfg.steps) {
            eprintln!("mxrl ablate: {name}: finished ({done} steps), kept");
            continue;
        }
        let b = make(recipe)?;
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
        let log = StepLog::new(name, cfg.steps, run.state.step);
        run.run(&mut |m| log.step(m))?;
        log.finish();
        if let Ok(m) = crate::metrics::read_jsonl(&dir.join("metrics.jsonl")) {
            eprintln!("{}", run_summary_line(name, &m));
        }
    }
    if !left.is_empty() {
        eprintln!(
            "mxrl ablate: {} of {} runs finished; not run yet: {} (the same command without \
             --only, or --only with their names, runs them; finished runs are kept)",
            plan.len() - left.len(),
            plan.len(),
            left.join(", ")
        );
    }
    crate::report::write_report(&spec.out).map_err(|e| RunError::Config(e.to_string()))
}
