//! `mxrl rl`: GRPO on a model directory with one precision recipe, live weight sync and
//! per-step metrics; resumable from `RUN_DIR/checkpoint.safetensors`.

use super::validate;
use anyhow::{bail, Context, Result};
use mxrl_rl::ablate::{run_summary_line, StepLog};
use mxrl_rl::grpo::{GrpoConfig, IsCorrection, IsLevel};
use mxrl_rl::manifest::{model_digest, prepare_run_dir, RunManifest, RUN_MANIFEST_VERSION};
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{RlConfig, RlRun};
use mxrl_rl::server::{ClientTls, Endpoint, RemoteRollout, RolloutClient, Token};
use mxrl_rl::session::load_model_dir;
use mxrl_rl::task::{ChainResponse, TaskSource, TaskSpec};
use mxrl_rl::text::TextCodec;
use mxrl_rl::{RolloutPolicy, SamplingConfig, TrainPolicy};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The shape of the built-in tasks' problems, shared by `sft`, `rl`, `ablate`, `demo` and
/// `tokenizer train`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProblemArgs {
    /// Digits per operand: 1–6 for the arithmetic task, 1–9 for the chain task.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub digits: u32,
    /// Operations per problem of the chain task (1–16; default 3).
    #[arg(long)]
    pub ops: Option<u32>,
    /// Operators the chain task draws from (some of `+-*`; default all three).
    #[arg(long, allow_hyphen_values = true)]
    pub operators: Option<String>,
    /// Chain task with worked responses: the reference (SFT) response writes every step of
    /// the evaluation, then `. #` and the result (`17+5*3-8=` → `5*3=15, 17+15=32, 32-8=24.
    /// #24`); the reward is 1 for a well-formed working whose answer after `#` is right.
    #[arg(long)]
    pub worked: bool,
}

impl ProblemArgs {
    /// A task of these problems (no name, no data file: the caller sets those).
    pub fn task_spec(&self) -> TaskSpec {
        TaskSpec {
            name: None,
            data: None,
            digits: self.digits,
            ops: self.ops,
            operators: self.operators.clone(),
            worked: self.worked,
        }
    }
}

/// Hyper-parameters shared by `rl`, `ablate` and `demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct RlArgs {
    /// Built-in task: `arithmetic` (a+b=) or `chain` (a chain of operations such as
    /// `17+5*3-8=`, standard precedence; with --worked, responses show their working);
    /// ignored when --data is given.
    #[arg(long)]
    pub task: Option<String>,
    /// DAPO-style JSONL prompt file (`prompt`, `label`), scored with the `Answer: X` reward.
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub problems: ProblemArgs,
    /// Optimizer steps (≥ 1).
    #[arg(long, default_value_t = 50, value_parser = validate::count)]
    pub steps: u64,
    /// Prompts per step (≥ 1).
    #[arg(long, default_value_t = 16, value_parser = validate::count_usize)]
    pub prompts_per_step: usize,
    /// Samples per prompt (GRPO group size, ≥ 2).
    #[arg(long, default_value_t = 8, value_parser = validate::group_size)]
    pub samples: usize,
    /// Longest response in tokens (≥ 1).
    #[arg(long, default_value_t = 4, value_parser = validate::count_usize)]
    pub max_new_tokens: usize,
    /// Sampling temperature (> 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0, value_parser = validate::positive)]
    pub temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = validate::unit_mass)]
    pub top_p: f32,
    /// AdamW learning rate (> 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1e-3, value_parser = validate::positive)]
    pub lr: f32,
    /// Global grad-norm clip (≤ 0: no clipping).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0, value_parser = validate::finite)]
    pub max_grad_norm: f32,
    /// Sequences per micro-batch (≥ 1).
    #[arg(long, default_value_t = 32, value_parser = validate::count_usize)]
    pub micro_batch: usize,
    /// Seed of prompts and sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Coefficient of the K3 KL to the frozen reference (≥ 0; the KL is always logged).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0, value_parser = validate::non_negative)]
    pub kl_coef: f32,
    /// Coefficient of the MoE auxiliary load-balancing loss added to the GRPO loss (≥ 0; HF
    /// `load_balancing_loss_func` over the MoE layers, e.g. 0.001 as Qwen3-MoE's
    /// `router_aux_loss_coef`); 0 (the default): none, the router learns from the policy loss
    /// alone.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0, value_parser = validate::non_negative)]
    pub aux_loss_coef: f32,
    /// Mean-only group normalisation (no division by the group std).
    #[arg(long)]
    pub mean_only: bool,
    /// Truncated importance-sampling cap (token level, > 0) for the rollout/trainer mismatch.
    #[arg(long, allow_negative_numbers = true, value_parser = validate::positive, conflicts_with = "mis")]
    pub tis_cap: Option<f32>,
    /// Masked importance sampling `LO,HI` (sequence level, 0 ≤ LO < HI).
    #[arg(long, value_name = "LO,HI", value_parser = validate::mis_bounds)]
    pub mis: Option<validate::MisBounds>,
    /// Turn routing replay off.
    #[arg(long)]
    pub no_routing_replay: bool,
    /// Bitwise mode: the rollout re-scores with the trainer's forward and batch shapes.
    #[arg(long)]
    pub bitwise: bool,
    /// Compare the rollout's weight bytes with the trainer's after every update.
    #[arg(long)]
    pub check_weight_sync: bool,
    /// Record no per-layer probes (the `hidden_diff` metric, measured on the first 64 samples
    /// of each step). On a GPU engine the rollout holds them during generation: layers × 64 ×
    /// max-new-tokens × hidden f32 of device memory.
    #[arg(long)]
    pub no_probes: bool,
    /// Checkpoint every N steps and at the end; 0: never (the run cannot be resumed; for
    /// models whose checkpoints would not fit on the disk).
    #[arg(long, default_value_t = 10)]
    pub checkpoint_every: u64,
}

impl RlArgs {
    /// The task these options name.
    pub fn task_spec(&self) -> TaskSpec {
        TaskSpec {
            name: self.task.clone(),
            data: self.data.clone(),
            ..self.problems.task_spec()
        }
    }

    /// What the task is, for run manifests and reports ([`TaskSpec::describe`]).
    pub fn task_description(&self) -> Result<String> {
        Ok(self.task_spec().describe()?)
    }

    /// Warn when --max-new-tokens is shorter than the chain task's longest reference
    /// response (the char-level tokenizer spends one token per character; a BPE one at most
    /// that).
    pub fn warn_short_responses(&self) -> Result<()> {
        if let Some(c) = self.task_spec().chain()? {
            if self.max_new_tokens < c.max_response_chars() {
                let what = match c.response() {
                    ChainResponse::Answer => "answers",
                    ChainResponse::Worked => "worked responses",
                };
                eprintln!(
                    "warning: the chain task's {what} take up to {} characters, and responses \
                     are cut at --max-new-tokens {}: longer ones cannot be rewarded",
                    c.max_response_chars(),
                    self.max_new_tokens
                );
            }
        }
        Ok(())
    }

    /// The run configuration.
    pub fn config(&self) -> RlConfig {
        let is_correction = match (&self.tis_cap, &self.mis) {
            (Some(c), _) => IsCorrection::Truncated {
                level: IsLevel::Token,
                cap: *c,
            },
            (None, Some(v)) => IsCorrection::Masked {
                level: IsLevel::Sequence,
                low: v.low,
                high: v.high,
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
            probes: !self.no_probes,
            aux_loss_coef: self.aux_loss_coef,
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
    /// Precision recipe: a preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq,
    /// fp8-block) or a TOML file.
    #[arg(long, default_value = "bf16")]
    recipe: String,
    /// Run directory (run.json, metrics.jsonl, checkpoint.safetensors); default
    /// `runs/rl-RECIPE`. An existing run there is resumed only if run.json records the same
    /// configuration.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Discard the run already in the run directory and start over.
    #[arg(long)]
    restart: bool,
    /// Rollout engine: in this process (default); a running `mxrl rollout-server` at
    /// unix:PATH or tcp:HOST:PORT; or `spawn`: a rollout-server child process on
    /// RUN_DIR/rollout.sock (log in RUN_DIR/rollout-server.log, same --device), stopped at
    /// the end.
    #[arg(long)]
    rollout: Option<String>,
    /// The rollout server's shared secret (needed for --rollout tcp:HOST:PORT): a file only
    /// you can read, as given to `mxrl rollout-server --token-file`.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Connect to --rollout tcp:HOST:PORT over TLS, trusting the certificate authority in
    /// this PEM file (the one that signed the server's --tls-cert). Required when HOST is not
    /// loopback.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Check the server's certificate against this name instead of HOST (e.g. through an
    /// SSH tunnel to 127.0.0.1).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
    #[command(flatten)]
    rl: RlArgs,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run `mxrl rl`.
pub fn run(a: Args) -> Result<()> {
    if a.device.device == super::device::Device::Cuda {
        super::device::cuda_built()?;
    }
    let (model, codec) = load_model_dir(&a.model)?;
    let task = a.rl.task_spec().source(Some(&a.model))?;
    a.rl.warn_short_responses()?;
    let (b, runs_on) = super::device::build_policies(&model, &a.recipe, a.device.device)?;
    eprintln!("mxrl rl: the model runs on {runs_on}");
    let cfg = a.rl.config();
    let out = a.out.clone().unwrap_or_else(|| default_out(&a.recipe));
    let manifest = RunManifest {
        version: RUN_MANIFEST_VERSION,
        recipe: a.recipe.clone(),
        plan_hash: mxrl_rl::session::recipe_info(&model, &a.recipe)?.plan_hash,
        contract_hash: b.contract_hash.clone(),
        model_path: a.model.display().to_string(),
        model_digest: model_digest(&a.model)?,
        task: a.rl.task_description()?,
        device: runs_on.clone(),
        config: cfg.clone(),
    };
    if prepare_run_dir(&out, &manifest, a.restart)? {
        eprintln!("mxrl rl: resuming the run in {}", out.display());
    }
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
    match a.rollout.as_deref() {
        None => {
            drive(
                &a.recipe,
                &out,
                cfg,
                b.trainer,
                b.rollout,
                b.reference,
                task,
                &codec,
                &b.contract_hash,
            )?;
        }
        Some(spec) => {
            let spawned = if spec == "spawn" {
                Some(SpawnedServer::start(
                    &a.model,
                    &a.recipe,
                    &out,
                    a.device.device,
                )?)
            } else {
                None
            };
            let ep: Endpoint = match &spawned {
                Some(s) => s.endpoint.clone(),
                None => spec.parse()?,
            };
            let token = a.token_file.as_deref().map(Token::from_file).transpose()?;
            let tls = match &a.tls_ca {
                Some(ca) => {
                    let t = ClientTls::from_file(ca)?;
                    Some(match &a.tls_server_name {
                        Some(n) => t.with_server_name(n),
                        None => t,
                    })
                }
                None => None,
            };
            let mut remote =
                RemoteRollout::connect_tls(&ep, &b.contract_hash, token.as_ref(), tls.as_ref())?;
            let info = remote.info().clone();
            let ours = b.trainer.export_weights()?.len();
            if info.tensors != ours {
                bail!(
                    "rollout server {ep} holds {} tensors, this trainer exports {ours}: the \
                     device engine stacks each layer's experts, the host model does not; start \
                     the server with the same --device as this run ({runs_on})",
                    info.tensors
                );
            }
            if info.recipe != a.recipe {
                bail!(
                    "rollout server {ep} serves recipe `{}`, this run uses `{}`",
                    info.recipe,
                    a.recipe
                );
            }
            eprintln!(
                "rollout: server {ep} (model {}, {} tensors, serving v{})",
                info.model, info.tensors, info.version
            );
            remote.set_bucket_bytes(cfg.bucket_bytes);
            let remote = drive(
                &a.recipe,
                &out,
                cfg,
                b.trainer,
                remote,
                b.reference,
                task,
                &codec,
                &b.contract_hash,
            )?;
            if let Some(s) = spawned {
                remote.shutdown_server()?;
                s.wait(Duration::from_secs(10))?;
            }
        }
    }
    let metrics = out.join("metrics.jsonl");
    let m = mxrl_rl::metrics::read_jsonl(&metrics)?;
    eprintln!("{}", run_summary_line(&a.recipe, &m));
    eprintln!(
        "metrics: {}; report with plots: mxrl report {}",
        metrics.display(),
        out.display()
    );
    Ok(())
}

/// `runs/rl-RECIPE` (a TOML recipe by its file stem), so runs of different recipes never
/// share a directory by default.
pub fn default_out(recipe: &str) -> PathBuf {
    let stem = Path::new(recipe)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(recipe);
    PathBuf::from(format!("runs/rl-{stem}"))
}

/// Run (or resume) the loop in `out` with `rollout`; hands the rollout policy back.
#[allow(clippy::too_many_arguments)]
fn drive<T: TrainPolicy, R: RolloutPolicy>(
    name: &str,
    out: &Path,
    cfg: RlConfig,
    trainer: T,
    rollout: R,
    reference: Option<T>,
    task: TaskSource,
    codec: &TextCodec,
    contract_hash: &str,
) -> Result<R> {
    let mut run = RlRun::new(
        cfg.clone(),
        trainer,
        rollout,
        reference,
        task,
        codec,
        out,
        contract_hash,
    )?;
    let log = StepLog::new(name, cfg.steps, run.state.step);
    run.run(&mut |m| log.step(m))?;
    log.finish();
    Ok(run.rollout.policy)
}

/// `--rollout spawn`: `mxrl rollout-server` as a child process on `RUN_DIR/rollout.sock`,
/// killed when dropped unless it already exited. The child watches its standard input, a pipe
/// whose other end only this process holds: when this process dies (even by SIGKILL) the
/// child sees end of file and stops. It is ready when the server on the socket answers Info
/// with the nonce this process gave it — never merely because something listens there.
struct SpawnedServer {
    child: Child,
    endpoint: Endpoint,
    log: PathBuf,
    _lifeline: Option<std::process::ChildStdin>,
}

/// 128 random bits as hex, from the kernel.
fn nonce() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom for the rollout server's nonce")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

impl SpawnedServer {
    fn start(
        model: &Path,
        recipe: &str,
        out: &Path,
        device: super::device::Device,
    ) -> Result<Self> {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let socket = out.join("rollout.sock");
        // sun_path holds 108 bytes including the terminating NUL.
        if socket.as_os_str().len() > 107 {
            bail!(
                "{}: a Unix socket path must be shorter than 108 bytes; use a shorter --out, \
                 or start `mxrl rollout-server` yourself and pass --rollout",
                socket.display()
            );
        }
        let log = out.join("rollout-server.log");
        let f =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let nonce = nonce()?;
        let mut child = Command::new(std::env::current_exe().context("locating the mxrl binary")?)
            .arg("rollout-server")
            .arg("--model")
            .arg(model)
            .args(["--recipe", recipe])
            .arg("--device")
            .arg(match device {
                super::device::Device::Cpu => "cpu",
                super::device::Device::Cuda => "cuda",
            })
            .arg("--listen")
            .arg(format!("unix:{}", socket.display()))
            .args(["--instance", &nonce, "--exit-with-stdin"])
            .stdin(Stdio::piped())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .context("starting `mxrl rollout-server`")?;
        let lifeline = child.stdin.take();
        let mut s = SpawnedServer {
            child,
            endpoint: Endpoint::Unix(socket.clone()),
            log,
            _lifeline: lifeline,
        };
        let t = Instant::now();
        loop {
            if let Some(st) = s.child.try_wait()? {
                bail!(
                    "the rollout server exited ({st}) before serving on {}; its log {}:\n{}",
                    s.endpoint,
                    s.log.display(),
                    std::fs::read_to_string(&s.log).unwrap_or_default()
                );
            }
            if socket.exists() {
                if let Ok(info) =
                    RolloutClient::connect(&s.endpoint, None).and_then(|mut c| c.info())
                {
                    if info.instance == nonce {
                        return Ok(s);
                    }
                }
            }
            if t.elapsed() > Duration::from_secs(300) {
                bail!(
                    "the rollout server started by this run did not answer on {} within 300 s; \
                     its log: {}",
                    s.endpoint,
                    s.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    /// Wait for the child to exit after a shutdown request (killed on drop after `limit`).
    fn wait(mut self, limit: Duration) -> Result<()> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(st) = self.child.try_wait()? {
                if !st.success() {
                    bail!(
                        "the rollout server exited with {st}; its log: {}",
                        self.log.display()
                    );
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "the rollout server did not exit within {} s of the shutdown request; killing it",
            limit.as_secs()
        )
    }
}

impl Drop for SpawnedServer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            if let Endpoint::Unix(p) = &self.endpoint {
                let _ = std::fs::remove_file(p);
            }
        }
        let _ = self.child.wait();
    }
}
