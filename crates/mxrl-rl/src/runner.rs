//! The RL loop: rollout → reward → GRPO update → live weight sync → metrics, resumable from a
//! checkpoint in the run directory; and the supervised warm-up (SFT).

use crate::grpo::{group_advantages, policy_loss, GrpoConfig, IsCorrection, SeqLossInput};
use crate::metrics::{append_jsonl, is_spike, mismatch, MetricsError, StepMetrics};
use crate::optim::{AdamW, AdamWConfig};
use crate::policy::{
    PolicyError, RolloutPolicy, Sample, SamplingConfig, TrainForward, TrainPolicy, TrainSeq,
};
use crate::sync::{RolloutEngine, SyncError, WeightUpdate};
use crate::task::{Problem, TaskSource};
use crate::text::{TextCodec, TextError};
use mxrl_ckpt::{write_safetensors_atomic, Dtype, SafetensorsFile, TensorSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Errors of the loop.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Policy failure.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// Weight sync failure.
    #[error(transparent)]
    Sync(#[from] SyncError),
    /// Tokenizer failure.
    #[error(transparent)]
    Text(#[from] TextError),
    /// Metrics I/O.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// Checkpoint I/O or format.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// Writing a file or an output directory (the message names it).
    #[error(transparent)]
    Write(#[from] mxrl_ckpt::CkptError),
    /// The configuration is unusable.
    #[error("config: {0}")]
    Config(String),
    /// The directory holds another run (or a run of unknown configuration).
    #[error(
        "{dir} holds another run; differing fields:\n  {}\nuse another --out, or --restart to discard that run",
        diffs.join("\n  ")
    )]
    OtherRun {
        /// The run (or ablation) directory.
        dir: String,
        /// One line per differing field.
        diffs: Vec<String>,
    },
    /// Training produced a non-finite loss, gradient norm or weight.
    #[error("step {step}: {what} is not finite; training stopped (the last checkpoint is kept)")]
    NonFinite {
        /// The step (0-based) that produced it.
        step: u64,
        /// What was not finite (`loss NaN`, `gradient norm inf`, `weight X`).
        what: String,
    },
}

/// Everything that defines an RL run (identical across the recipes of an ablation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlConfig {
    /// Seed of prompts and sampling.
    pub seed: u64,
    /// Optimizer steps (= rollout steps).
    pub steps: u64,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Samples per prompt (the GRPO group size).
    pub samples: usize,
    /// Sampling.
    pub sampling: SamplingConfig,
    /// GRPO loss.
    pub grpo: GrpoConfig,
    /// Optimizer.
    pub adam: AdamWConfig,
    /// Sequences per micro-batch (gradients accumulate over micro-batches).
    pub micro_batch: usize,
    /// Replay the rollout's routing in the training forward.
    pub routing_replay: bool,
    /// Bitwise mode: the rollout re-scores its samples with exactly the trainer's forward
    /// (same kernels, same micro-batch shapes), so rollout logprobs equal trainer logprobs.
    pub bitwise: bool,
    /// Compare the rollout's bytes with the trainer's after every update.
    pub check_weight_sync: bool,
    /// Bucket size of weight updates (bytes).
    pub bucket_bytes: usize,
    /// Spike flag threshold: grad norm > this × running median.
    pub spike_factor: f64,
    /// Write a checkpoint every this many steps (and at the end); 0: never (the run cannot be
    /// resumed, and nothing of its size is written: for runs whose checkpoints would not fit
    /// on the disk).
    pub checkpoint_every: u64,
    /// Record per-layer probes (the `hidden_diff` metric) of the first [`PROBE_SEQUENCES`]
    /// samples of each step: the rollout's residual stream after every layer at the
    /// response-predicting positions, from its generation (or, in bitwise mode, its
    /// re-scoring), and the trainer's in its forward. On a device engine they cost `layers ×
    /// PROBE_SEQUENCES × max_new_tokens × hidden` f32 of device memory during generation.
    #[serde(default = "probes_on")]
    pub probes: bool,
    /// Coefficient of the MoE auxiliary load-balancing loss added to the GRPO loss (HF
    /// `load_balancing_loss_func` over the MoE layers of each micro-batch's forward, the
    /// routes it used — replayed ones included); 0 (the default) adds none. Written into a
    /// run's configuration only when not 0, so runs made before the field existed keep theirs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub aux_loss_coef: f32,
}

fn is_zero(x: &f32) -> bool {
    *x == 0.0
}

/// Samples per step, from the first, whose per-layer probes are recorded and compared for the
/// `hidden_diff` metric (a mean over their response positions). Recording every sample's
/// residual stream made the probes most of a GPU rollout's time at real width (512 samples ×
/// responses × layers × hidden f32 read back per step: 0.31 s of rollout against 0.07 s
/// without probes, BENCHMARKS.md); 64 samples give the metric ~1 500 positions per layer at
/// 25-token responses.
pub const PROBE_SEQUENCES: usize = 64;

/// [`RlConfig::probes`] of configurations written before the field existed.
fn probes_on() -> bool {
    true
}

impl Default for RlConfig {
    fn default() -> Self {
        RlConfig {
            seed: 1,
            steps: 50,
            prompts_per_step: 8,
            samples: 8,
            sampling: SamplingConfig::default(),
            grpo: GrpoConfig::default(),
            adam: AdamWConfig::default(),
            micro_batch: 16,
            routing_replay: true,
            bitwise: false,
            check_weight_sync: false,
            bucket_bytes: 1 << 20,
            spike_factor: 5.0,
            checkpoint_every: 10,
            probes: true,
            aux_loss_coef: 0.0,
        }
    }
}

impl RlConfig {
    /// Check every field: counts ≥ 1 (samples ≥ 2: with one sample per prompt every GRPO
    /// advantage is 0 and nothing is learned), rates finite and in range. The error names the
    /// field and the value.
    pub fn validate(&self) -> Result<(), RunError> {
        let mut bad: Vec<String> = Vec::new();
        let mut count = |name: &str, v: u64, min: u64, why: &str| {
            if v < min {
                bad.push(format!("{name} = {v}: must be ≥ {min}{why}"));
            }
        };
        count("steps", self.steps, 1, "");
        count("prompts_per_step", self.prompts_per_step as u64, 1, "");
        count(
            "samples",
            self.samples as u64,
            2,
            " (GRPO normalises rewards within a prompt's group: with one sample every advantage is 0)",
        );
        count("micro_batch", self.micro_batch as u64, 1, "");
        count(
            "sampling.max_new_tokens",
            self.sampling.max_new_tokens as u64,
            1,
            "",
        );
        count("bucket_bytes", self.bucket_bytes as u64, 1, "");
        let mut real = |name: &str, v: f64, ok: bool, want: &str| {
            if !v.is_finite() || !ok {
                bad.push(format!("{name} = {v}: must be {want}"));
            }
        };
        let t = self.sampling.temperature as f64;
        real("sampling.temperature", t, t > 0.0, "finite and > 0");
        let p = self.sampling.top_p as f64;
        real("sampling.top_p", p, p > 0.0 && p <= 1.0, "in (0, 1]");
        let g = &self.grpo;
        real(
            "grpo.clip_low",
            g.clip_low as f64,
            g.clip_low >= 0.0,
            "finite and ≥ 0",
        );
        real(
            "grpo.clip_high",
            g.clip_high as f64,
            g.clip_high >= 0.0,
            "finite and ≥ 0",
        );
        real(
            "grpo.kl_coef",
            g.kl_coef as f64,
            g.kl_coef >= 0.0,
            "finite and ≥ 0",
        );
        real(
            "aux_loss_coef",
            self.aux_loss_coef as f64,
            self.aux_loss_coef >= 0.0,
            "finite and ≥ 0",
        );
        match g.is_correction {
            IsCorrection::None => {}
            IsCorrection::Truncated { cap, .. } => real(
                "grpo.is_correction.cap",
                cap as f64,
                cap > 0.0,
                "finite and > 0",
            ),
            IsCorrection::Masked { low, high, .. } => {
                real(
                    "grpo.is_correction.low",
                    low as f64,
                    low >= 0.0,
                    "finite and ≥ 0",
                );
                real(
                    "grpo.is_correction.high",
                    high as f64,
                    high > low,
                    "finite and > low",
                );
            }
        }
        let a = &self.adam;
        real("adam.lr", a.lr as f64, a.lr > 0.0, "finite and > 0");
        real(
            "adam.beta1",
            a.beta1 as f64,
            (0.0..1.0).contains(&a.beta1),
            "in [0, 1)",
        );
        real(
            "adam.beta2",
            a.beta2 as f64,
            (0.0..1.0).contains(&a.beta2),
            "in [0, 1)",
        );
        real("adam.eps", a.eps as f64, a.eps > 0.0, "finite and > 0");
        real(
            "adam.weight_decay",
            a.weight_decay as f64,
            a.weight_decay >= 0.0,
            "finite and ≥ 0",
        );
        real(
            "adam.max_grad_norm",
            a.max_grad_norm as f64,
            true,
            "finite (≤ 0 turns clipping off)",
        );
        real(
            "spike_factor",
            self.spike_factor,
            self.spike_factor > 0.0,
            "finite and > 0",
        );
        if bad.is_empty() {
            Ok(())
        } else {
            Err(RunError::Config(bad.join("; ")))
        }
    }
}

/// The first non-finite value among the trainer's parameters, as `weight NAME[i] = v`.
pub fn first_non_finite_weight<T: TrainPolicy>(trainer: &mut T) -> Option<String> {
    trainer.first_non_finite_weight()
}

/// One optimizer step: the policy's own ([`TrainPolicy::optimizer_step`]) when it takes one,
/// else `opt` over [`TrainPolicy::params`]. Returns the gradient norm before clipping.
pub fn optimizer_step<T: TrainPolicy>(trainer: &mut T, opt: &mut AdamW) -> Result<f64, RunError> {
    if let Some(r) = trainer.optimizer_step(&opt.cfg, opt.step + 1) {
        let norm = r?;
        opt.step += 1;
        return Ok(norm);
    }
    let mut params = trainer.params();
    Ok(opt.step(&mut params))
}

/// The state of a run that a checkpoint restores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Steps completed.
    pub step: u64,
    /// Weight version served by the rollout.
    pub version: u64,
    /// Grad norms of completed steps (for the spike median).
    pub grad_norms: Vec<f64>,
    /// Optimizer step count.
    pub adam_step: u64,
}

/// Save trainer parameters, AdamW moments and the run state to `DIR/checkpoint.safetensors`
/// (written to a temporary file, then renamed).
pub fn save_checkpoint<T: TrainPolicy>(
    dir: &Path,
    trainer: &mut T,
    opt: &AdamW,
    state: &RunState,
) -> Result<(), RunError> {
    let path = dir.join("checkpoint.safetensors");
    let err = |msg: String| RunError::Checkpoint {
        path: path.display().to_string(),
        msg,
    };
    let mut blobs: Vec<(String, Vec<u8>, usize)> = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // Moments held by the policy itself (a device engine) or by the loop's optimizer.
    let own = match trainer.optimizer_moments() {
        Some(r) => Some(r?),
        None => None,
    };
    let moments = own.as_ref().unwrap_or(&opt.state);
    for p in trainer.params() {
        blobs.push((
            format!("param/{}", p.name),
            f32_bytes(p.value),
            p.value.len(),
        ));
        if let Some(m) = moments.get(p.name) {
            blobs.push((format!("adam_m/{}", p.name), f32_bytes(&m.m), m.m.len()));
            blobs.push((format!("adam_v/{}", p.name), f32_bytes(&m.v), m.v.len()));
        }
    }
    let tensors: Vec<(TensorSpec, Vec<u8>)> = blobs
        .into_iter()
        .map(|(n, b, len)| (TensorSpec::new(n, Dtype::F32, vec![len]), b))
        .collect();
    let mut meta = BTreeMap::new();
    meta.insert(
        "run_state".to_string(),
        serde_json::to_string(state).expect("state serializes"),
    );
    write_safetensors_atomic(&path, &tensors, &meta).map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Restore a checkpoint written by [`save_checkpoint`]; `Ok(None)` when there is none.
pub fn load_checkpoint<T: TrainPolicy>(
    dir: &Path,
    trainer: &mut T,
    opt: &mut AdamW,
) -> Result<Option<RunState>, RunError> {
    let path = dir.join("checkpoint.safetensors");
    if !path.exists() {
        return Ok(None);
    }
    let err = |msg: String| RunError::Checkpoint {
        path: path.display().to_string(),
        msg,
    };
    // The one strict reader: header, offsets and dtypes validated, errors name the file.
    let st = SafetensorsFile::open(&path).map_err(|e| err(e.to_string()))?;
    let state: RunState = st
        .header()
        .metadata
        .get("run_state")
        .ok_or_else(|| err("no `run_state` metadata".into()))
        .and_then(|s| serde_json::from_str(s).map_err(|e| err(e.to_string())))?;
    let by_name: BTreeMap<&str, &mxrl_ckpt::TensorInfo> = st
        .header()
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let read = |name: &str, len: usize| -> Result<Vec<f32>, RunError> {
        let t = by_name
            .get(name)
            .ok_or_else(|| err(format!("tensor {name}: not found")))?;
        if t.dtype != Dtype::F32 || t.shape != [len] {
            return Err(err(format!(
                "tensor {name}: {} {:?}, expected F32 [{len}]",
                t.dtype.name(),
                t.shape
            )));
        }
        Ok(mxrl_ckpt::f32_from_bytes(st.data(t)))
    };
    let mut moments = BTreeMap::new();
    for p in trainer.params() {
        let n = p.value.len();
        p.value
            .copy_from_slice(&read(&format!("param/{}", p.name), n)?);
        if by_name.contains_key(format!("adam_m/{}", p.name).as_str()) {
            moments.insert(
                p.name.to_string(),
                crate::optim::Moments {
                    m: read(&format!("adam_m/{}", p.name), n)?,
                    v: read(&format!("adam_v/{}", p.name), n)?,
                },
            );
        }
    }
    opt.step = state.adam_step;
    if !trainer.set_optimizer_state(state.adam_step, &moments)? {
        opt.state = moments;
    }
    Ok(Some(state))
}

/// Console line callback: called after every step with the metrics.
pub type Progress<'a> = &'a mut dyn FnMut(&StepMetrics);

/// One RL run: trainer, rollout engine, optional frozen reference, optimizer and task.
pub struct RlRun<'a, T: TrainPolicy, R: RolloutPolicy> {
    /// Configuration.
    pub cfg: RlConfig,
    /// Learning side.
    pub trainer: T,
    /// Sampling side.
    pub rollout: RolloutEngine<R>,
    /// Frozen reference for the KL term / metric.
    pub reference: Option<T>,
    /// Optimizer.
    pub opt: AdamW,
    /// Prompts and labels.
    pub task: TaskSource,
    /// Tokenizer.
    pub codec: &'a TextCodec,
    /// Run directory (metrics.jsonl, checkpoint).
    pub dir: PathBuf,
    /// Contract hash put on weight updates.
    pub contract_hash: String,
    /// Resume state.
    pub state: RunState,
}

fn encode_problems(codec: &TextCodec, ps: &[Problem]) -> Result<Vec<Vec<u32>>, RunError> {
    ps.iter()
        .map(|p| codec.encode(&p.prompt).map_err(RunError::from))
        .collect()
}

impl<'a, T: TrainPolicy, R: RolloutPolicy> RlRun<'a, T, R> {
    /// Set up a run in `dir`: restores `checkpoint.safetensors` when present (then the rollout
    /// gets the restored weights through a regular weight update).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: RlConfig,
        mut trainer: T,
        mut rollout: R,
        reference: Option<T>,
        task: TaskSource,
        codec: &'a TextCodec,
        dir: &Path,
        contract_hash: &str,
    ) -> Result<Self, RunError> {
        cfg.validate()?;
        std::fs::create_dir_all(dir).map_err(|e| RunError::Checkpoint {
            path: dir.display().to_string(),
            msg: e.to_string(),
        })?;
        let mut opt = AdamW::new(cfg.adam);
        let restored = load_checkpoint(dir, &mut trainer, &mut opt)?;
        // What the rollout records besides tokens: the routes when the trainer replays them;
        // the probes from generation unless a bitwise re-scoring gives them. The trainer
        // computes probes only for samples that carry some (set every step); the reference
        // never needs them.
        rollout.set_routes(cfg.routing_replay);
        rollout.set_probes(if cfg.probes && !cfg.bitwise {
            PROBE_SEQUENCES
        } else {
            0
        });
        trainer.set_probes(false);
        trainer.set_aux_loss_coef(cfg.aux_loss_coef)?;
        let mut reference = reference;
        if let Some(r) = reference.as_mut() {
            r.set_probes(false);
        }
        let mut run = RlRun {
            cfg,
            trainer,
            rollout: RolloutEngine::new(rollout, 0, contract_hash),
            reference,
            opt,
            task,
            codec,
            dir: dir.to_path_buf(),
            contract_hash: contract_hash.into(),
            state: RunState {
                step: 0,
                version: 0,
                grad_norms: Vec::new(),
                adam_step: 0,
            },
        };
        if let Some(st) = restored {
            // Metrics lines past the checkpoint belong to steps that will run again.
            truncate_metrics(&dir.join("metrics.jsonl"), st.step)?;
            run.state = st;
            run.sync(run.state.version)?;
        } else {
            let _ = std::fs::remove_file(dir.join("metrics.jsonl"));
            // Version 0 → 1: the rollout starts from exactly the trainer's exported bytes.
            run.state.version = 1;
            run.sync(1)?;
        }
        Ok(run)
    }

    fn sync(&mut self, version: u64) -> Result<(u64, f64), RunError> {
        let t = Instant::now();
        self.trainer.refresh_weights()?;
        // One process, one device: the update stays there when both sides can do that.
        if let Some(x) = self.trainer.local_export() {
            let mut x = x?;
            if let Some(rep) = self.rollout.apply_local(version, &mut x) {
                let rep = rep?;
                if self.cfg.check_weight_sync {
                    self.rollout.check(&self.trainer.export_weights()?)?;
                }
                return Ok((rep.bytes, t.elapsed().as_secs_f64()));
            }
        }
        let ex = self.trainer.export_weights()?;
        // The tensors move into the update's buckets unless they are compared afterwards.
        let (u, kept) = if self.cfg.check_weight_sync {
            let u = WeightUpdate::build(version, &self.contract_hash, &ex, self.cfg.bucket_bytes);
            (u, Some(ex))
        } else {
            let u =
                WeightUpdate::from_tensors(version, &self.contract_hash, ex, self.cfg.bucket_bytes);
            (u, None)
        };
        let rep = self.rollout.apply(&u)?;
        if let Some(ex) = kept {
            self.rollout.check(&ex)?;
        }
        Ok((rep.bytes, t.elapsed().as_secs_f64()))
    }

    /// Run the remaining steps; `progress` sees every step's metrics.
    pub fn run(&mut self, progress: Progress<'_>) -> Result<(), RunError> {
        while self.state.step < self.cfg.steps {
            let m = self.step()?;
            progress(&m);
            let done = self.state.step;
            let every = self.cfg.checkpoint_every;
            if every > 0 && (done.is_multiple_of(every) || done == self.cfg.steps) {
                save_checkpoint(&self.dir, &mut self.trainer, &self.opt, &self.state)?;
            }
        }
        Ok(())
    }

    fn forward_all(
        policy: &mut T,
        samples: &[Sample],
        replay: bool,
        temperature: f32,
    ) -> Result<Vec<TrainForward>, RunError> {
        let seqs: Vec<TrainSeq<'_>> = samples
            .iter()
            .map(|s| TrainSeq {
                prompt: &s.prompt,
                response: &s.response,
                replay: if replay { s.routing.as_ref() } else { None },
            })
            .collect();
        Ok(policy.forward(&seqs, temperature)?)
    }

    /// One step: rollout, score, GRPO update, weight sync, metrics.
    pub fn step(&mut self) -> Result<StepMetrics, RunError> {
        let cfg = self.cfg.clone();
        let step = self.state.step;
        let problems = self.task.batch(cfg.seed, step, cfg.prompts_per_step);
        let prompts = encode_problems(self.codec, &problems)?;

        // 1. Rollout with the served weights.
        let t0 = Instant::now();
        let mut samples = self.rollout.policy.generate(
            &prompts,
            cfg.samples,
            &cfg.sampling,
            self.codec.eos,
            cfg.seed.wrapping_mul(1_000_003).wrapping_add(step),
        )?;
        let rollout_phases = self.rollout.policy.last_timing();
        if cfg.bitwise {
            for (mb_i, mb) in samples.chunks_mut(cfg.micro_batch).enumerate() {
                let seqs: Vec<TrainSeq<'_>> = mb
                    .iter()
                    .map(|s| TrainSeq {
                        prompt: &s.prompt,
                        response: &s.response,
                        replay: if cfg.routing_replay {
                            s.routing.as_ref()
                        } else {
                            None
                        },
                    })
                    .collect();
                let scored = if cfg.probes && mb_i * cfg.micro_batch < PROBE_SEQUENCES {
                    self.rollout
                        .policy
                        .score_with_probes(&seqs, cfg.sampling.temperature)?
                } else {
                    self.rollout
                        .policy
                        .score(&seqs, cfg.sampling.temperature)?
                        .into_iter()
                        .map(|logprobs| crate::policy::Scored {
                            logprobs,
                            probes: None,
                        })
                        .collect()
                };
                for (s, sc) in mb.iter_mut().zip(scored) {
                    s.logprobs = sc.logprobs;
                    if sc.probes.is_some() {
                        s.probes = sc.probes;
                    }
                }
            }
        }
        // The drift metric is measured on the first PROBE_SEQUENCES samples, whatever a
        // policy recorded.
        for s in samples.iter_mut().skip(PROBE_SEQUENCES) {
            s.probes = None;
        }
        let rollout_s = t0.elapsed().as_secs_f64();
        let tokens: usize = samples.iter().map(|s| s.response.len()).sum();
        let routed: Vec<(usize, usize, &[mxrl_model::Routes])> = samples
            .iter()
            .filter_map(|s| {
                let r = s.routing.as_ref()?;
                Some((s.prompt.len(), s.response.len(), r.layers.as_slice()))
            })
            .collect();
        let decode_busiest_share = crate::metrics::decode_busiest_share(&routed);

        // 2. Rewards and advantages.
        let kind = self.task.reward_kind();
        let mut rewards = Vec::with_capacity(samples.len());
        let mut correct = 0usize;
        for s in &samples {
            let text = self.codec.decode(&s.response)?;
            let sc = kind.score(&text, &problems[s.prompt_index].label);
            rewards.push(sc.reward);
            correct += usize::from(sc.correct);
        }
        let adv = group_advantages(&rewards, cfg.samples, cfg.grpo.std_normalize);

        // 3. Training: forward (routing replay), loss, backward per micro-batch; one AdamW step.
        let t1 = Instant::now();
        self.trainer.zero_grad();
        let replay = cfg.routing_replay;
        let mut train_lp: Vec<Vec<f32>> = Vec::with_capacity(samples.len());
        let mut ent_sum = 0f64;
        let mut agree: Vec<(usize, usize)> = Vec::new();
        let mut hid: Vec<(f64, usize)> = Vec::new();
        let (mut loss, mut clipped, mut corrected, mut ref_kl_sum) = (0f64, 0usize, 0usize, 0f64);
        // The aux loss over the micro-batches that added it: sum, count.
        let mut aux = (0f64, 0usize);
        let n_mb = samples.len().div_ceil(cfg.micro_batch.max(1));
        for (mb_i, mb) in samples.chunks(cfg.micro_batch).enumerate() {
            let base = mb_i * cfg.micro_batch;
            // The trainer's probes are compared with the rollout's: only where there are some.
            self.trainer
                .set_probes(cfg.probes && mb.iter().any(|s| s.probes.is_some()));
            let fw = Self::forward_all(&mut self.trainer, mb, replay, cfg.sampling.temperature)?;
            let refl = match self.reference.as_mut() {
                Some(r) => Some(Self::forward_all(r, mb, replay, cfg.sampling.temperature)?),
                None => None,
            };
            let inputs: Vec<SeqLossInput<'_>> = mb
                .iter()
                .enumerate()
                .map(|(i, s)| SeqLossInput {
                    advantage: adv[base + i],
                    logprobs: &fw[i].logprobs,
                    // One optimizer step per rollout batch: the trainer's current weights are
                    // the "old" policy, so the PPO ratio is 1 at the gradient.
                    old_logprobs: &fw[i].logprobs,
                    rollout_logprobs: &s.logprobs,
                    ref_logprobs: refl.as_ref().map(|r| r[i].logprobs.as_slice()),
                })
                .collect();
            let (st, dlogp) = policy_loss(&cfg.grpo, &inputs, tokens);
            loss += st.loss;
            clipped += st.clipped_tokens;
            corrected += st.is_corrected_tokens;
            ref_kl_sum += st.ref_kl_sum;
            if mb_i + 1 == n_mb {
                self.trainer.backward_last(&dlogp)?;
            } else {
                self.trainer.backward(&dlogp)?;
            }
            if let Some(a) = self.trainer.last_aux_loss()? {
                aux.0 += a;
                aux.1 += 1;
            }
            for (f, s) in fw.iter().zip(mb) {
                ent_sum += f.entropy.iter().map(|&e| e as f64).sum::<f64>();
                if let (Some(a), Some(b)) = (&f.routing, &s.routing) {
                    if let Some(per) = a.agreement_per_layer(b) {
                        if agree.len() < per.len() {
                            agree.resize(per.len(), (0, 0));
                        }
                        for (acc, p) in agree.iter_mut().zip(per) {
                            acc.0 += p.0;
                            acc.1 += p.1;
                        }
                    }
                }
                if let (Some(a), Some(b)) = (&f.probes, &s.probes) {
                    if a.layers == b.layers
                        && a.width == b.width
                        && a.values.len() == b.values.len()
                    {
                        if hid.len() < a.layers {
                            hid.resize(a.layers, (0.0, 0));
                        }
                        let per_layer = a.values.len() / a.layers.max(1);
                        for (l, acc) in hid.iter_mut().enumerate().take(a.layers) {
                            let r = l * per_layer..(l + 1) * per_layer;
                            for (x, y) in a.values[r.clone()]
                                .chunks(a.width.max(1))
                                .zip(b.values[r].chunks(b.width.max(1)))
                            {
                                let d: f64 =
                                    x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                                let n: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
                                acc.0 += (d / n.max(1e-30)).sqrt();
                                acc.1 += 1;
                            }
                        }
                    }
                }
            }
            train_lp.extend(fw.into_iter().map(|f| f.logprobs));
        }
        if !loss.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: format!("the loss ({loss})"),
            });
        }
        let grad_norm = optimizer_step(&mut self.trainer, &mut self.opt)?;
        if !grad_norm.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: format!("the gradient norm ({grad_norm})"),
            });
        }
        if let Some(w) = first_non_finite_weight(&mut self.trainer) {
            return Err(RunError::NonFinite { step, what: w });
        }
        let train_s = t1.elapsed().as_secs_f64();

        // 4. Live weight sync of the new weights.
        let version = self.state.version + 1;
        let (sync_bytes, sync_s) = self.sync(version)?;

        // 5. Metrics.
        let mm = mismatch(
            train_lp
                .iter()
                .zip(&samples)
                .flat_map(|(t, s)| t.iter().zip(&s.logprobs)),
        );
        let n = rewards.len() as f64;
        let rmean = rewards.iter().map(|&r| r as f64).sum::<f64>() / n;
        let rstd = (rewards
            .iter()
            .map(|&r| (r as f64 - rmean).powi(2))
            .sum::<f64>()
            / n)
            .sqrt();
        let tok = tokens.max(1) as f64;
        let spike = is_spike(&self.state.grad_norms, grad_norm, cfg.spike_factor);
        let m = StepMetrics {
            step,
            weight_version: self.state.version,
            reward_mean: rmean,
            reward_std: rstd,
            accuracy: correct as f64 / n,
            response_len: tokens as f64 / n,
            train_rollout_logprob_abs_diff: mm.abs_diff,
            k3_kl: mm.k3,
            is_ratio_mean: mm.ratio_mean,
            is_ratio_max: mm.ratio_max,
            clip_frac: clipped as f64 / tok,
            is_corrected_frac: corrected as f64 / tok,
            ref_kl: self.reference.as_ref().map(|_| ref_kl_sum / tok),
            entropy: ent_sum / tok,
            loss,
            grad_norm,
            grad_spike: spike,
            routing_agreement: agree
                .iter()
                .map(|&(a, b)| a as f64 / b.max(1) as f64)
                .collect(),
            hidden_diff: hid.iter().map(|&(s, c)| s / c.max(1) as f64).collect(),
            decode_busiest_share,
            aux_loss: (aux.1 > 0).then(|| aux.0 / aux.1 as f64),
            rollout_s,
            rollout_phases,
            train_s,
            sync_s,
            tokens_per_s: tokens as f64 / rollout_s.max(1e-9),
            sync_bytes,
            tokens: tokens as u64,
        };
        append_jsonl(&self.dir.join("metrics.jsonl"), &m)?;
        if grad_norm.is_finite() {
            self.state.grad_norms.push(grad_norm);
        }
        self.state.step += 1;
        self.state.version = version;
        self.state.adam_step = self.opt.step;
        Ok(m)
    }
}

/// Keep the metrics lines of steps `< steps` (the ones the checkpoint covers), byte for byte:
/// the kept lines are copied as text, not re-serialized.
fn truncate_metrics(path: &Path, steps: u64) -> Result<(), RunError> {
    if !path.exists() {
        return Ok(());
    }
    let v = crate::metrics::read_jsonl(path)?;
    let io = |p: &Path, e: std::io::Error| RunError::Checkpoint {
        path: p.display().to_string(),
        msg: e.to_string(),
    };
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    // `read_jsonl` skips blank lines; pair the parsed steps with the non-blank lines.
    let lines = text.lines().filter(|l| !l.trim().is_empty());
    let keep: String = lines
        .zip(&v)
        .filter(|(_, m)| m.step < steps)
        .map(|(l, _)| format!("{l}\n"))
        .collect();
    if keep.is_empty() {
        return std::fs::remove_file(path).map_err(|e| io(path, e));
    }
    Ok(mxrl_ckpt::write_bytes_atomic(path, keep.as_bytes())?)
}

/// Settings of the supervised warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SftConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Examples per step.
    pub batch: usize,
    /// Seed of the example stream.
    pub seed: u64,
    /// Optimizer.
    pub adam: AdamWConfig,
    /// Coefficient of the MoE auxiliary load-balancing loss added to the SFT loss (0: none);
    /// as [`RlConfig::aux_loss_coef`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub aux_loss_coef: f32,
}

impl SftConfig {
    /// Check the fields: steps and batch ≥ 1, learning rate finite and > 0.
    pub fn validate(&self) -> Result<(), RunError> {
        let mut bad = Vec::new();
        if self.steps == 0 {
            bad.push("steps = 0: must be ≥ 1".to_string());
        }
        if self.batch == 0 {
            bad.push("batch = 0: must be ≥ 1".to_string());
        }
        if !(self.adam.lr.is_finite() && self.adam.lr > 0.0) {
            bad.push(format!("lr = {}: must be finite and > 0", self.adam.lr));
        }
        if !(self.aux_loss_coef.is_finite() && self.aux_loss_coef >= 0.0) {
            bad.push(format!(
                "aux_loss_coef = {}: must be finite and ≥ 0",
                self.aux_loss_coef
            ));
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(RunError::Config(bad.join("; ")))
        }
    }
}

/// Supervised warm-up: minimise `−mean log p(completion + eos | prompt)` over the task's
/// reference completions (token-level average). `progress(step, loss)` is called per step.
pub fn sft<T: TrainPolicy>(
    trainer: &mut T,
    task: &TaskSource,
    codec: &TextCodec,
    cfg: &SftConfig,
    progress: &mut dyn FnMut(u64, f64),
) -> Result<(), RunError> {
    sft_until(trainer, task, codec, cfg, &mut |_, step, loss| {
        progress(step, loss);
        Ok(false)
    })
    .map(|_| ())
}

/// [`sft`] that stops early: `after(trainer, step, loss)` is called after every step and
/// returns whether to stop there (e.g. once a measured reward is reached,
/// [`measured_reward`]). Returns the number of steps taken.
pub fn sft_until<T: TrainPolicy>(
    trainer: &mut T,
    task: &TaskSource,
    codec: &TextCodec,
    cfg: &SftConfig,
    after: &mut dyn FnMut(&mut T, u64, f64) -> Result<bool, RunError>,
) -> Result<u64, RunError> {
    cfg.validate()?;
    trainer.set_aux_loss_coef(cfg.aux_loss_coef)?;
    let mut opt = AdamW::new(cfg.adam);
    for step in 0..cfg.steps {
        let ps = task.batch(cfg.seed, step, cfg.batch);
        let mut pairs = Vec::with_capacity(ps.len());
        for p in &ps {
            let c = p.completion.as_ref().ok_or_else(|| {
                RunError::Config("SFT needs a task with reference completions".into())
            })?;
            let mut r = codec.encode(c)?;
            r.push(codec.eos);
            pairs.push((codec.encode(&p.prompt)?, r));
        }
        let n: usize = pairs.iter().map(|p| p.1.len()).sum();
        let seqs: Vec<TrainSeq<'_>> = pairs
            .iter()
            .map(|(p, r)| TrainSeq {
                prompt: p,
                response: r,
                replay: None,
            })
            .collect();
        trainer.zero_grad();
        let fw = trainer.forward(&seqs, 1.0)?;
        let loss = -fw
            .iter()
            .flat_map(|f| f.logprobs.iter())
            .map(|&l| l as f64)
            .sum::<f64>()
            / n as f64;
        let d: Vec<Vec<f32>> = fw
            .iter()
            .map(|f| vec![-1.0 / n as f32; f.logprobs.len()])
            .collect();
        if !loss.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: format!("the SFT loss ({loss})"),
            });
        }
        trainer.backward_last(&d)?;
        let norm = optimizer_step(trainer, &mut opt)?;
        if !norm.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: format!("the gradient norm ({norm})"),
            });
        }
        if let Some(w) = first_non_finite_weight(trainer) {
            return Err(RunError::NonFinite { step, what: w });
        }
        if after(trainer, step, loss)? {
            return Ok(step + 1);
        }
    }
    Ok(cfg.steps)
}

/// What [`measured_reward`] samples with: the encoded prompts → the response token ids.
pub type Generate<'a> = dyn FnMut(&[Vec<u32>]) -> Result<Vec<Vec<u32>>, RunError> + 'a;

/// The mean reward of sampled answers to `count` problems of `task` (the problem stream of
/// `seed`, step 0), scored with the task's reward: `generate` maps the encoded prompts to the
/// response token ids it samples (ending at the end-of-sequence token when it is sampled).
///
/// # Errors
/// What `generate` returns; a prompt or response the codec cannot encode or decode.
pub fn measured_reward(
    task: &TaskSource,
    codec: &TextCodec,
    count: usize,
    seed: u64,
    generate: &mut Generate<'_>,
) -> Result<f64, RunError> {
    let problems = task.batch(seed, 0, count);
    let prompts = encode_problems(codec, &problems)?;
    let responses = generate(&prompts)?;
    if responses.len() != problems.len() {
        return Err(RunError::Config(format!(
            "measured_reward: {} responses for {} prompts",
            responses.len(),
            problems.len()
        )));
    }
    let kind = task.reward_kind();
    let mut sum = 0f64;
    // Scored as the RL loop scores a sample.
    for (p, r) in problems.iter().zip(&responses) {
        sum += kind.score(&codec.decode(r)?, &p.label).reward as f64;
    }
    Ok(sum / problems.len().max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tabular::{TabularShape, TabularTrainer};
    use crate::task::ArithmeticTask;
    use mxrl_formats::Format;

    /// The auxiliary-loss coefficient stays out of a configuration's JSON at 0, so runs
    /// written before it existed compare equal (`--only` parts, resumed runs); set, it is
    /// written and read back; negative or non-finite, it is refused by name; a policy
    /// without MoE routers refuses any but 0.
    #[test]
    fn the_aux_loss_coefficient_is_written_only_when_set() {
        let cfg = RlConfig::default();
        let j = serde_json::to_value(&cfg).unwrap();
        assert!(j.get("aux_loss_coef").is_none(), "{j}");
        let back: RlConfig = serde_json::from_value(j).unwrap();
        assert_eq!(back, cfg);
        let set = RlConfig {
            aux_loss_coef: 1e-3,
            ..cfg.clone()
        };
        let j = serde_json::to_value(&set).unwrap();
        assert!(j.get("aux_loss_coef").is_some(), "{j}");
        assert_eq!(serde_json::from_value::<RlConfig>(j).unwrap(), set);
        for bad in [-1e-3, f32::NAN, f32::INFINITY] {
            let e = RlConfig {
                aux_loss_coef: bad,
                ..cfg.clone()
            }
            .validate()
            .unwrap_err()
            .to_string();
            assert!(e.contains("aux_loss_coef"), "{e}");
        }
        let codec = TextCodec::char_level();
        let mut tr = TabularTrainer::new(
            TabularShape {
                buckets: 8,
                max_len: 3,
                vocab: codec.vocab_size,
            },
            Format::Bf16,
        );
        tr.set_aux_loss_coef(0.0).unwrap();
        let e = tr.set_aux_loss_coef(1e-3).unwrap_err().to_string();
        assert!(e.contains("no MoE router"), "{e}");
    }

    fn setup(dir: &Path, steps: u64) -> (RlConfig, TabularTrainer, TaskSource, TextCodec) {
        let codec = TextCodec::char_level();
        let task = TaskSource::Arithmetic(ArithmeticTask::default());
        let mut tr = TabularTrainer::new(
            TabularShape {
                buckets: 512,
                max_len: 3,
                vocab: codec.vocab_size,
            },
            Format::Bf16,
        );
        // A weak base policy: a short SFT leaves accuracy well below 1.
        sft(
            &mut tr,
            &task,
            &codec,
            &SftConfig {
                steps: 4,
                batch: 64,
                seed: 99,
                adam: AdamWConfig {
                    lr: 1.0,
                    ..AdamWConfig::default()
                },
                aux_loss_coef: 0.0,
            },
            &mut |_, _| {},
        )
        .unwrap();
        let _ = dir;
        let cfg = RlConfig {
            steps,
            prompts_per_step: 16,
            samples: 8,
            sampling: SamplingConfig {
                temperature: 1.0,
                top_p: 1.0,
                max_new_tokens: 3,
            },
            adam: AdamWConfig {
                lr: 0.3,
                ..AdamWConfig::default()
            },
            micro_batch: 32,
            check_weight_sync: true,
            checkpoint_every: 5,
            ..RlConfig::default()
        };
        (cfg, tr, task, codec)
    }

    #[test]
    fn reward_rises_on_arithmetic_with_exact_policy() {
        let d = tempfile::tempdir().unwrap();
        let (cfg, tr, task, codec) = setup(d.path(), 30);
        let ro = tr.rollout().unwrap();
        let reference = Some(tr.clone());
        let mut run = RlRun::new(
            cfg,
            tr,
            ro,
            reference,
            task,
            &codec,
            d.path(),
            "test-contract",
        )
        .unwrap();
        let mut rewards = Vec::new();
        run.run(&mut |m| rewards.push(m.reward_mean)).unwrap();
        let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
        let last: f64 = rewards[25..].iter().sum::<f64>() / 5.0;
        assert!(first < 0.8, "base policy already solves the task: {first}");
        assert!(
            last > first + 0.1,
            "reward did not rise: first {first:.3}, last {last:.3}, all {rewards:?}"
        );
        let ms = crate::metrics::read_jsonl(&d.path().join("metrics.jsonl")).unwrap();
        assert_eq!(ms.len(), 30);
        // Trainer and rollout use the same table bytes and the same softmax code: the mismatch
        // is exactly zero, and the reference KL is logged.
        assert!(ms
            .iter()
            .all(|m| m.train_rollout_logprob_abs_diff == 0.0 && m.k3_kl == 0.0));
        assert!(ms.iter().all(|m| m.ref_kl.is_some()));
        assert_eq!(ms.last().unwrap().weight_version, 30);
    }

    /// `checkpoint_every = 0`: the run's metrics are written, no checkpoint ever is; with any
    /// other value the last step leaves one.
    #[test]
    fn checkpoint_every_zero_writes_no_checkpoint() {
        for (every, want) in [(0u64, false), (5, true)] {
            let d = tempfile::tempdir().unwrap();
            let (mut cfg, tr, task, codec) = setup(d.path(), 2);
            cfg.checkpoint_every = every;
            let ro = tr.rollout().unwrap();
            let mut run =
                RlRun::new(cfg, tr.clone(), ro, None, task, &codec, d.path(), "h").unwrap();
            run.run(&mut |_| {}).unwrap();
            let ms = crate::metrics::read_jsonl(&d.path().join("metrics.jsonl")).unwrap();
            assert_eq!(ms.len(), 2, "every = {every}");
            assert_eq!(
                d.path().join("checkpoint.safetensors").exists(),
                want,
                "every = {every}"
            );
        }
    }

    #[test]
    fn resume_from_checkpoint_reproduces_the_uninterrupted_run() {
        let d1 = tempfile::tempdir().unwrap();
        let (cfg, tr, task, codec) = setup(d1.path(), 10);
        let ro = tr.rollout().unwrap();
        let mut full = RlRun::new(
            cfg.clone(),
            tr.clone(),
            ro.clone(),
            None,
            task.clone(),
            &codec,
            d1.path(),
            "h",
        )
        .unwrap();
        full.run(&mut |_| {}).unwrap();

        let d2 = tempfile::tempdir().unwrap();
        let mut c5 = cfg.clone();
        c5.steps = 5;
        let mut part = RlRun::new(
            c5,
            tr.clone(),
            ro.clone(),
            None,
            task.clone(),
            &codec,
            d2.path(),
            "h",
        )
        .unwrap();
        part.run(&mut |_| {}).unwrap();
        // A fresh process: same base weights, picks up the checkpoint at step 5.
        let mut rest = RlRun::new(cfg, tr, ro, None, task, &codec, d2.path(), "h").unwrap();
        assert_eq!(rest.state.step, 5);
        rest.run(&mut |_| {}).unwrap();
        let a = crate::metrics::read_jsonl(&d1.path().join("metrics.jsonl")).unwrap();
        let b = crate::metrics::read_jsonl(&d2.path().join("metrics.jsonl")).unwrap();
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.step, x.reward_mean.to_bits(), x.grad_norm.to_bits()),
                (y.step, y.reward_mean.to_bits(), y.grad_norm.to_bits())
            );
        }
    }

    #[test]
    fn one_sample_per_prompt_and_bad_numbers_are_refused_before_running() {
        let d = tempfile::tempdir().unwrap();
        let (cfg, tr, task, codec) = setup(d.path(), 3);
        let ro = tr.rollout().unwrap();
        let mut one = cfg.clone();
        one.samples = 1;
        let e = RlRun::new(
            one,
            tr.clone(),
            ro.clone(),
            None,
            task.clone(),
            &codec,
            d.path(),
            "h",
        )
        .err()
        .expect("refused");
        assert!(e.to_string().contains("samples = 1: must be ≥ 2"), "{e}");
        let mut bad = cfg.clone();
        bad.adam.lr = f32::NAN;
        bad.grpo.kl_coef = -1.0;
        bad.steps = 0;
        bad.grpo.is_correction = IsCorrection::Masked {
            level: crate::grpo::IsLevel::Sequence,
            low: 2.0,
            high: 0.5,
        };
        let e = bad.validate().unwrap_err().to_string();
        for want in [
            "steps = 0",
            "adam.lr = NaN",
            "grpo.kl_coef = -1",
            "grpo.is_correction.high = 0.5",
        ] {
            assert!(e.contains(want), "{want} missing in: {e}");
        }
        assert!(!d.path().join("metrics.jsonl").exists());
    }

    #[test]
    fn a_non_finite_weight_stops_training_at_the_step_it_reaches_the_loss() {
        let d = tempfile::tempdir().unwrap();
        let (cfg, tr, task, codec) = setup(d.path(), 10);
        let ro = tr.rollout().unwrap();
        let mut run = RlRun::new(cfg, tr, ro, None, task, &codec, d.path(), "h").unwrap();
        for _ in 0..3 {
            run.step().unwrap();
        }
        // Poison the trainer's table: the next step's logprobs, hence its loss, are NaN.
        for p in run.trainer.params() {
            p.value.fill(f32::NAN);
        }
        let e = run.run(&mut |_| {}).unwrap_err();
        let RunError::NonFinite { step, what } = &e else {
            panic!("expected NonFinite, got {e}")
        };
        assert_eq!(*step, 3);
        assert!(what.contains("loss"), "{what}");
        assert!(
            e.to_string()
                .starts_with("step 3: the loss (NaN) is not finite"),
            "{e}"
        );
        // The failed step logged nothing.
        let ms = crate::metrics::read_jsonl(&d.path().join("metrics.jsonl")).unwrap();
        assert_eq!(ms.len(), 3);
    }

    #[test]
    fn sft_with_a_nan_learning_rate_is_refused_and_a_diverging_one_names_the_step() {
        let codec = TextCodec::char_level();
        let task = TaskSource::Arithmetic(ArithmeticTask::default());
        let shape = TabularShape {
            buckets: 64,
            max_len: 3,
            vocab: codec.vocab_size,
        };
        let mut tr = TabularTrainer::new(shape, Format::Bf16);
        let mut cfg = SftConfig {
            steps: 3,
            batch: 8,
            seed: 1,
            adam: AdamWConfig {
                lr: f32::NAN,
                ..AdamWConfig::default()
            },
            aux_loss_coef: 0.0,
        };
        let e = sft(&mut tr, &task, &codec, &cfg, &mut |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("lr = NaN"), "{e}");
        // A finite but absurd rate overflows the weights within a few steps.
        cfg.adam.lr = 1e38;
        cfg.adam.max_grad_norm = 0.0;
        cfg.steps = 50;
        let mut seen = 0;
        let e = sft(&mut tr, &task, &codec, &cfg, &mut |_, _| seen += 1).unwrap_err();
        let RunError::NonFinite { step, .. } = e else {
            panic!("expected NonFinite, got {e}")
        };
        assert_eq!(step, seen, "the failing step is the first one not reported");
    }

    /// `sft_until` stops after the step its callback ends (returning the steps taken, the
    /// optimizer having stepped exactly that often), and `measured_reward` scores generated
    /// answers with the task's reward as the loop does: the reference answers score 1, an
    /// empty answer 0.
    #[test]
    fn sft_until_stops_where_asked_and_measured_reward_scores_answers() {
        let codec = TextCodec::char_level();
        let task = TaskSource::Arithmetic(ArithmeticTask::default());
        let mut tr = TabularTrainer::new(
            TabularShape {
                buckets: 64,
                max_len: 3,
                vocab: codec.vocab_size,
            },
            Format::Bf16,
        );
        let cfg = SftConfig {
            steps: 10,
            batch: 8,
            seed: 1,
            adam: AdamWConfig::default(),
            aux_loss_coef: 0.0,
        };
        let mut seen = Vec::new();
        let took = sft_until(&mut tr, &task, &codec, &cfg, &mut |_, step, _| {
            seen.push(step);
            Ok(step == 2)
        })
        .unwrap();
        assert_eq!((took, seen), (3, vec![0, 1, 2]));
        let problems = task.batch(5, 0, 6);
        let right = measured_reward(&task, &codec, 6, 5, &mut |ps| {
            assert_eq!(ps.len(), 6);
            Ok(problems
                .iter()
                .map(|p| {
                    let mut r = codec.encode(p.completion.as_ref().unwrap()).unwrap();
                    r.push(codec.eos);
                    r
                })
                .collect())
        })
        .unwrap();
        assert_eq!(right, 1.0);
        let empty = measured_reward(&task, &codec, 6, 5, &mut |ps| {
            Ok(vec![Vec::new(); ps.len()])
        })
        .unwrap();
        assert_eq!(empty, 0.0);
    }
}
