//! `mxrl demo`: the README's main job, CPU only, a few minutes. Builds the embedded tiny MoE
//! (char-level tokenizer), warms it up with SFT on 1-digit addition, runs the RL ablation for
//! BF16, MXFP8 and NVFP4 (plus two more BF16 seeds for the noise band) and writes
//! `runs/demo/report.md` with plots.
//!
//! `--size large` uses the embedded ~45M-parameter MoE ([`large_demo_config`]) instead, meant for
//! `--device cuda` (the device engine on GPU 0); its default output is `runs/demo-large`.
//!
//! `--size real` runs decoder layers of Qwen3-30B-A3B's shape ([`real_config`]; 4 layers,
//! `--layers N`) on the chain task with a byte-level BPE tokenizer trained on the task's text
//! at the start (`OUT/tokenizer/`, with a `tokenizer_config.json` for Hugging Face tooling);
//! the SFT warm-up stops once sampled answers reach a mean reward of `--sft-reward` (0.2), so
//! GRPO starts where rewards vary within groups. Only for `--device cuda` (refused on the CPU
//! without `--allow-cpu`); its default output is `runs/demo-real`.
//!
//! `--task chain` (with `--ops`, `--operators`, `--digits`, and `--worked` for responses that
//! show every step before the answer) warms up and runs on chains of operations instead;
//! `--tokenizer FILE` gives the fresh model a trained BPE tokenizer. The
//! warm-up's task is recorded in `OUT/warmup.json`, so a warmed-up model is only reused for
//! the task it was trained on.

use super::rl::RlArgs;
use anyhow::{Context, Result};
use clap::Parser;
use mxrl_model::{Model, ModelConfig};
use mxrl_rl::session::{demo_config, large_demo_config, save_model_dir};
use mxrl_rl::task::TaskSpec;
use std::path::{Path, PathBuf};

/// Which embedded demo model.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// The tiny MoE (hidden 64, 4 layers, 8 experts; ~0.2M parameters): CPU, minutes.
    Small,
    /// A ~45M-parameter MoE (hidden 384, 6 layers, 16 experts top-2, F = 384): for `--device cuda`.
    Large,
    /// Qwen3-30B-A3B's layer shape (hidden 2048, 32/4 heads of 128, 128 experts top-8,
    /// F = 768), 4 layers by default (~2.5B parameters, ~0.23B active per token): for
    /// `--device cuda`.
    Real,
}

/// The `--size real` model: `layers` decoder layers of Qwen3-30B-A3B's shape — hidden 2048,
/// 32 query / 4 kv heads of width 128 with Qwen3's q/k RMSNorm, 128 routed experts top-8 with
/// F = 768 and renormalised top-k probabilities (`norm_topk_prob`), no shared expert, every
/// layer MoE, RoPE θ = 10⁶, RMSNorm ε = 10⁻⁶, untied head — over a `vocab_size` vocabulary.
/// ~623M parameters per layer (~57M active per token). Every contraction dim is a multiple
/// of 32 (the MXFP8/NVFP4 blocks).
pub fn real_config(layers: usize, vocab_size: usize) -> ModelConfig {
    real_config_scaled(layers, vocab_size, 1)
}

/// [`real_config`] with the hidden size, the head and expert counts and the expert width
/// divided by `shrink` (at least one kv head, two experts; top-k at most half the experts):
/// `shrink = 1` is the real shape; larger ones run the same code path on a CPU in tests.
fn real_config_scaled(layers: usize, vocab_size: usize, shrink: usize) -> ModelConfig {
    let d = shrink.max(1);
    let experts = (128 / d).max(2);
    ModelConfig {
        arch: mxrl_model::Arch::Qwen3Moe,
        vocab_size,
        hidden_size: 2048 / d,
        num_layers: layers,
        num_heads: (32 / d).max(1),
        num_kv_heads: (4 / d).max(1),
        head_dim: 128,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-6,
        intermediate_size: 6144 / d,
        moe_intermediate_size: 768 / d,
        num_experts: experts,
        num_experts_per_tok: 8.min(experts / 2),
        norm_topk_prob: true,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        shared_expert_intermediate_size: 0,
        qkv_bias: false,
        tie_word_embeddings: false,
        initializer_range: 0.02,
        router_aux_loss_coef: 0.001,
    }
}

/// Parameters of a model of `c` whose every layer is MoE without a shared expert (attention
/// with q/k norms, router, routed experts, two norms per layer; embedding, final norm, head).
fn moe_parameters(c: &ModelConfig) -> usize {
    let (h, qd, kvd) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    );
    let attention = 2 * h * qd + 2 * h * kvd + 2 * c.head_dim;
    let experts = c.num_experts * (h + 3 * h * c.moe_intermediate_size);
    c.num_layers * (attention + experts + 2 * h) + 2 * c.vocab_size * h + h
}

/// Device bytes per parameter a real-width run holds at least: its SFT warm-up (BF16: the
/// trainer's f32 master, gradient and two AdamW moments and BF16 weight, the rollout's BF16
/// weight) and a BF16 RL run (also the frozen reference's BF16 weight), before activations.
const WARMUP_BYTES: usize = 20;
const RL_BYTES: usize = 22;

/// Whether the real-width model `c` can fit a GPU with `free` bytes free (`gpu` names it):
/// an error when even the warm-up's weights and optimizer state exceed it, a warning when a
/// BF16 RL run's, with a tenth more for activations, do; each names the most layers that pass
/// without a warning.
fn real_fit(c: &ModelConfig, gpu: &str, free: usize) -> Result<Option<String>> {
    let params = moe_parameters(c);
    let most = |bytes: usize| {
        (0..=c.num_layers).rev().find(|&l| {
            let d = ModelConfig {
                num_layers: l,
                ..c.clone()
            };
            bytes * moe_parameters(&d) * 11 / 10 <= free
        })
    };
    let gb = |b: usize| b as f64 / 1e9;
    let layers = |l: Option<usize>| match l {
        Some(0) | None => "not even one layer fits".to_string(),
        Some(l) => format!("--layers {l} should fit"),
    };
    anyhow::ensure!(
        WARMUP_BYTES * params <= free,
        "--size real --layers {}: {:.2} B parameters need at least {:.1} GB of device memory \
         before any activation ({WARMUP_BYTES} bytes per parameter: the trainer's f32 master, \
         gradient, AdamW moments and BF16 weight, the rollout's BF16 weight), and {gpu} \
         has {:.1} GB free; {}",
        c.num_layers,
        gb(params),
        gb(WARMUP_BYTES * params),
        gb(free),
        layers(most(RL_BYTES))
    );
    Ok((RL_BYTES * params * 11 / 10 > free).then(|| {
        format!(
            "demo: warning: --layers {}: a BF16 RL run holds {RL_BYTES} bytes per parameter, \
             {:.1} GB, plus activations, and {gpu} has {:.1} GB free: it may run out \
             of memory; {}",
            c.num_layers,
            gb(RL_BYTES * params),
            gb(free),
            layers(most(RL_BYTES))
        )
    }))
}

/// Vocabulary of the BPE tokenizer `--size real` trains on the task's text.
pub const REAL_VOCAB: usize = 512;

/// The tokenizer `--size real` trains into `dir`: a BPE of [`REAL_VOCAB`] tokens on the
/// prompts and reference responses (the worked ones with `--worked`) of 4096 problems of
/// `spec` (problem stream 0; deterministic: the same task gives the same file).
fn train_real_tokenizer(spec: &TaskSpec, dir: &Path) -> Result<String> {
    super::tokenizer::train_into(spec, REAL_VOCAB, 4096, 0, dir)
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
    /// Output directory (default `runs/demo`, `runs/demo-large` with `--size large`,
    /// `runs/demo-real` with `--size real`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Embedded model: `small` (CPU, minutes), `large` (~45M parameters, for `--device cuda`)
    /// or `real` (Qwen3-30B-A3B's layer shape, for `--device cuda`).
    #[arg(long, value_enum, default_value_t = Size::Small)]
    size: Size,
    /// Decoder layers of the `--size real` model (default 4).
    #[arg(long, value_parser = super::validate::count_usize)]
    layers: Option<usize>,
    /// Run `--size real` on the CPU anyway (hours per step at the real width).
    #[arg(long)]
    allow_cpu: bool,
    /// `--size real`: the mean reward of sampled answers that ends the SFT warm-up (measured
    /// every 10 steps on 64 problems; --sft-steps is then the most it may take).
    #[arg(long, default_value_t = 0.2, value_parser = super::validate::non_negative)]
    sft_reward: f32,
    /// Stop after the SFT warm-up (the model in OUT/base), without the RL ablation (e.g. to
    /// run `mxrl ablate` on it with other settings).
    #[arg(long)]
    warmup_only: bool,
    /// Test only: divides the `--size real` widths by N (the same code path on a small model).
    #[arg(long, hide = true, default_value_t = 1, value_parser = super::validate::count_usize)]
    real_shrink: usize,
    /// Recipes to compare.
    #[arg(long, value_delimiter = ',', default_value = "bf16,mxfp8,nvfp4-hp")]
    recipes: Vec<String>,
    /// RL steps per recipe (≥ 1).
    #[arg(long, default_value_t = 60, value_parser = super::validate::count)]
    steps: u64,
    /// SFT warm-up steps (≥ 1; default 50, with `--size real` at most 400, ending earlier at
    /// --sft-reward).
    #[arg(long, value_parser = super::validate::count)]
    sft_steps: Option<u64>,
    /// Built-in task: `arithmetic` (1-digit addition by default) or `chain` (a chain of
    /// operations such as `7+5*3-8=`, standard precedence; the default with `--size real`;
    /// `--worked` for responses that show their working).
    #[arg(long)]
    task: Option<String>,
    #[command(flatten)]
    problems: super::rl::ProblemArgs,
    /// A `tokenizer.json` (e.g. from `mxrl tokenizer train`) for the demo model instead of
    /// the char-level one; the model's vocabulary becomes the tokenizer's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Coefficient of the MoE auxiliary load-balancing loss in the SFT warm-up and every RL
    /// run (≥ 0; e.g. 0.001, Qwen3-MoE's `router_aux_loss_coef`); 0 (the default): none. A
    /// warm-up is reused only with the coefficient it was trained with.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0, value_parser = super::validate::non_negative)]
    aux_loss_coef: f32,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// `OUT/warmup.json`: the task a demo's warmed-up model was trained on, and the auxiliary
/// loss coefficient of its warm-up (absent: 0, as in records from before the field).
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct Warmup {
    /// [`TaskSpec::describe`] of the warm-up task.
    task: String,
    /// The warm-up's MoE auxiliary loss coefficient (`--aux-loss-coef`).
    #[serde(default, skip_serializing_if = "is_zero")]
    aux_loss_coef: f32,
}

fn is_zero(x: &f32) -> bool {
    *x == 0.0
}

/// Refuse to reuse the warmed-up model in `out/base` for another task than `task` or another
/// auxiliary loss coefficient than `aux`: the ones recorded in `out/warmup.json`, or 1-digit
/// addition without the loss for a directory from before the record.
fn check_warmup(out: &Path, task: &str, aux: f32) -> Result<()> {
    let p = out.join("warmup.json");
    let had = if p.exists() {
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str::<Warmup>(&text).with_context(|| format!("parsing {}", p.display()))?
    } else {
        Warmup {
            task: TaskSpec::default().describe()?,
            aux_loss_coef: 0.0,
        }
    };
    anyhow::ensure!(
        had.task == task,
        "{}: the warmed-up model there was trained on {}, not on {task}; use another --out",
        out.join("base").display(),
        had.task
    );
    anyhow::ensure!(
        had.aux_loss_coef == aux,
        "{}: the warmed-up model there was trained with --aux-loss-coef {}, not {aux}; use \
         another --out",
        out.join("base").display(),
        had.aux_loss_coef
    );
    Ok(())
}

/// Run `mxrl demo`.
pub fn run(a: Args) -> Result<()> {
    let t0 = std::time::Instant::now();
    if a.device.device == super::device::Device::Cuda {
        super::device::cuda_built()?;
    }
    anyhow::ensure!(
        a.layers.is_none() || a.size == Size::Real,
        "--layers sets the depth of the --size real model; the {:?} demo model has a fixed one",
        a.size
    );
    anyhow::ensure!(
        a.size != Size::Real || a.device.device == super::device::Device::Cuda || a.allow_cpu,
        "--size real is Qwen3-30B-A3B's layer width (~{:.1}B parameters at {} layers): it is          meant for --device cuda; pass --allow-cpu to run it on the CPU anyway",
        moe_parameters(&real_config(a.layers.unwrap_or(4), REAL_VOCAB)) as f64 / 1e9,
        a.layers.unwrap_or(4)
    );
    let out = a.out.clone().unwrap_or_else(|| {
        PathBuf::from(match a.size {
            Size::Small => "runs/demo",
            Size::Large => "runs/demo-large",
            Size::Real => "runs/demo-real",
        })
    });
    let task_name = a.task.clone().unwrap_or_else(|| {
        match a.size {
            Size::Real => "chain",
            _ => "arithmetic",
        }
        .to_string()
    });
    let spec = TaskSpec {
        name: Some(task_name),
        data: None,
        ..a.problems.task_spec()
    };
    let task_text = spec.describe()?;
    let chain = spec.chain()?;
    let mut tokenizer = a
        .tokenizer
        .as_deref()
        .map(super::sft::read_tokenizer)
        .transpose()?;
    if a.size == Size::Real && tokenizer.is_none() {
        // A readable vocabulary for the real-width model: BPE trained on the task's text.
        let dir = out.join("tokenizer");
        let json = train_real_tokenizer(&spec, &dir)?;
        let codec = mxrl_rl::text::TextCodec::from_bytes(
            json.as_bytes(),
            &dir.join("tokenizer.json").display().to_string(),
        )?;
        eprintln!(
            "demo: tokenizer of {} tokens in {}",
            codec.vocab_size,
            dir.display()
        );
        tokenizer = Some((json, codec));
    }
    let mut want = match a.size {
        Size::Small => demo_config(),
        Size::Large => large_demo_config(),
        Size::Real => real_config_scaled(a.layers.unwrap_or(4), REAL_VOCAB, a.real_shrink),
    };
    if a.size == Size::Real && a.device.device == super::device::Device::Cuda {
        // Before minutes of warm-up: a depth that cannot fit is refused, one that may not is
        // warned about.
        if let Some((gpu, free, _)) = super::device::gpu_memory() {
            if let Some(w) = real_fit(&want, &gpu, free)? {
                eprintln!("{w}");
            }
        }
    }
    if let Some((_, codec)) = &tokenizer {
        want.vocab_size = codec.vocab_size;
    }
    // Every recipe is resolved before the warm-up, so a typo costs nothing (none runs after
    // --warmup-only).
    let bad: Vec<String> = a
        .recipes
        .iter()
        .filter(|_| !a.warmup_only)
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
        check_warmup(&out, &task_text, a.aux_loss_coef)?;
        let there = std::fs::read_to_string(base.join("tokenizer.json"))
            .with_context(|| format!("reading {}", base.join("tokenizer.json").display()))?;
        let (json, name) = match (&tokenizer, &a.tokenizer) {
            (Some((json, _)), Some(p)) => (json.clone(), p.display().to_string()),
            (Some((json, _)), None) => (
                json.clone(),
                format!("the one trained in {}", out.join("tokenizer").display()),
            ),
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
        let (sft_steps, sft_lr, stop) = match a.size {
            Size::Small | Size::Large => (a.sft_steps.unwrap_or(50), 3e-3, None),
            // From scratch at width 2048 a smaller step; the warm-up ends at the reward.
            Size::Real => {
                let c = chain.as_ref().ok_or_else(|| {
                    anyhow::anyhow!("--size real runs the chain task (--task chain)")
                })?;
                let stop = super::sft::RewardStop {
                    target: a.sft_reward as f64,
                    every: 10,
                    prompts: 64,
                    max_new_tokens: c.max_response_chars() + 1,
                    seed: 0x5eed,
                };
                (a.sft_steps.unwrap_or(400), 1e-3, Some(stop))
            }
        };
        eprintln!(
            "demo: SFT warm-up of the {:?} MoE on {task_text} ({}{sft_steps} steps)",
            a.size,
            if stop.is_some() { "at most " } else { "" }
        );
        let loss = match a.size {
            Size::Small | Size::Large => {
                let start = match a.size {
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
                    _ => None,
                };
                super::sft::sft_to_dir(
                    start.as_deref(),
                    &spec,
                    match a.size {
                        Size::Small => a.tokenizer.as_deref(),
                        _ => None,
                    },
                    sft_steps,
                    64,
                    sft_lr,
                    a.aux_loss_coef,
                    7,
                    &base,
                    false,
                    a.device.device,
                )?
            }
            Size::Real => {
                let (json, codec) = tokenizer.as_ref().expect("trained or given above");
                let model = Model::random(&want, 7)?;
                eprintln!(
                    "demo: real-width MoE ({} layers), {} parameters",
                    want.num_layers,
                    model.params().num_elements()
                );
                let cfg = mxrl_rl::runner::SftConfig {
                    steps: sft_steps,
                    batch: 64,
                    seed: 7 ^ 0x5f7,
                    adam: mxrl_rl::optim::AdamWConfig {
                        lr: sft_lr,
                        ..Default::default()
                    },
                    aux_loss_coef: a.aux_loss_coef,
                };
                let loss = super::sft::sft_model_to_dir(
                    &model,
                    json,
                    codec,
                    &spec.source(None)?,
                    &cfg,
                    stop.as_ref(),
                    &base,
                    false,
                    a.device.device,
                )?;
                // Beside the model's tokenizer.json, for Hugging Face tooling.
                mxrl_ckpt::write_bytes_atomic(
                    &base.join("tokenizer_config.json"),
                    super::tokenizer::tokenizer_config_json().as_bytes(),
                )?;
                loss
            }
        };
        eprintln!("demo: SFT done, loss {loss:.4}");
        mxrl_rl::manifest::write_json_atomic(
            &out.join("warmup.json"),
            &Warmup {
                task: task_text,
                aux_loss_coef: a.aux_loss_coef,
            },
        )?;
    }
    if a.warmup_only {
        eprintln!(
            "demo: warm-up done in {:.0} s; the model is in {}",
            t0.elapsed().as_secs_f64(),
            base.display()
        );
        return Ok(());
    }
    let mut rl = Defaults::parse_from(["demo"]).rl;
    rl.steps = a.steps;
    rl.task = spec.name.clone();
    rl.problems = a.problems.clone();
    rl.aux_loss_coef = a.aux_loss_coef;
    if let Some(c) = &chain {
        // Room for the longest reference response (one token per character at most).
        rl.max_new_tokens = rl.max_new_tokens.max(c.max_response_chars());
    }
    let report = super::ablate::ablate(
        &base,
        &a.recipes,
        &[2, 3],
        &out,
        &rl,
        &mxrl_rl::ablate::Selection::default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The real-width depth check against an 80 GB H100's free memory (84 GB): five layers
    /// (measured to fit, 73.6 GiB at peak) pass silently, six are warned about with five
    /// suggested, seven are refused (their warm-up alone needs 87 GB); a GPU too small for one
    /// layer says so.
    #[test]
    fn real_width_depths_that_cannot_fit_are_refused_before_the_warm_up() {
        let c = |l| real_config_scaled(l, REAL_VOCAB, 1);
        let free = 84_000_000_000;
        assert_eq!(moe_parameters(&c(5)), 3_117_702_400);
        assert!(real_fit(&c(4), "H100", free).unwrap().is_none());
        assert!(real_fit(&c(5), "H100", free).unwrap().is_none());
        let w = real_fit(&c(6), "H100", free).unwrap().unwrap();
        assert!(
            w.contains("--layers 6") && w.contains("--layers 5 should fit"),
            "{w}"
        );
        let e = real_fit(&c(7), "H100", free).unwrap_err().to_string();
        assert!(
            e.contains("--layers 7") && e.contains("87.3 GB") && e.contains("H100"),
            "{e}"
        );
        assert!(e.contains("--layers 5 should fit"), "{e}");
        let e = real_fit(&c(1), "small", 1_000_000_000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not even one layer fits"), "{e}");
    }

    /// The point of `--worked`: decoding, not prefill, dominates a rollout. With the
    /// tokenizer `--size real` trains (here for 1-digit chains of 3 operations, the task's
    /// defaults), the worked responses of problems it was not trained on take ≥ 10 tokens on
    /// average, the answers alone under 3; every one round-trips.
    #[test]
    fn worked_chain_responses_are_long_with_the_demo_tokenizer() {
        let mean_tokens = |worked: bool| {
            let spec = TaskSpec {
                name: Some("chain".into()),
                worked,
                ..TaskSpec::default()
            };
            let dir = tempfile::tempdir().unwrap();
            let json = train_real_tokenizer(&spec, dir.path()).unwrap();
            let codec = mxrl_rl::text::TextCodec::from_bytes(json.as_bytes(), "t").unwrap();
            assert_eq!(codec.vocab_size, REAL_VOCAB);
            let vocab: serde_json::Value = serde_json::from_str(&json).unwrap();
            // `Ġ#` (a space and the marker) is learnt only from worked text.
            assert_eq!(
                vocab["model"]["vocab"].get("Ġ#").is_some(),
                worked,
                "worked {worked}"
            );
            let Some(c) = spec.chain().unwrap() else {
                panic!("the chain task")
            };
            let problems = spec.source(None).unwrap().batch(0xfeed, 0, 500);
            let mut total = 0usize;
            for p in &problems {
                let text = p.completion.as_ref().unwrap();
                let ids = codec.encode(text).unwrap();
                assert_eq!(&codec.decode(&ids).unwrap(), text);
                assert!(ids.len() <= c.max_response_chars(), "{text}: {ids:?}");
                total += ids.len();
            }
            total as f64 / problems.len() as f64
        };
        let worked = mean_tokens(true);
        let answer = mean_tokens(false);
        eprintln!("tokens per response on average: worked {worked:.1}, answer {answer:.1}");
        assert!(
            worked >= 10.0,
            "worked responses: {worked:.1} tokens on average"
        );
        assert!(answer < 3.0, "answers: {answer:.1} tokens on average");
    }

    /// `--size real` is Qwen3-30B-A3B's decoder layer (its config.json: hidden 2048, 32 q /
    /// 4 kv heads of head_dim 128, 128 experts top-8 of moe_intermediate_size 768,
    /// norm_topk_prob, every layer sparse, rope_theta 10⁶, ε 10⁻⁶, untied): ~623M parameters
    /// per layer; the scaled constructor the CPU test uses keeps that structure.
    #[test]
    fn real_config_is_the_qwen3_30b_a3b_layer_shape() {
        let c = real_config(4, REAL_VOCAB);
        assert_eq!(c.arch, mxrl_model::Arch::Qwen3Moe);
        assert_eq!(
            (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim),
            (2048, 32, 4, 128)
        );
        assert_eq!(
            (
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size
            ),
            (128, 8, 768)
        );
        assert!(c.norm_topk_prob && !c.tie_word_embeddings && !c.qkv_bias);
        assert_eq!((c.decoder_sparse_step, c.mlp_only_layers.len()), (1, 0));
        assert_eq!((c.rope_theta, c.rms_norm_eps), (1e6, 1e-6));
        assert_eq!(c.num_layers, 4);
        c.validate().unwrap();
        let per_layer = moe_parameters(&real_config(1, 0));
        assert!(
            (620_000_000..625_000_000).contains(&per_layer),
            "{per_layer}"
        );
        // The scaled shape keeps the structure at a CPU size (what the CLI test runs).
        let s = real_config_scaled(2, REAL_VOCAB, 16);
        s.validate().unwrap();
        assert_eq!(
            (s.hidden_size, s.num_heads, s.num_kv_heads, s.num_experts),
            (128, 2, 1, 8)
        );
        assert_eq!(
            moe_parameters(&s),
            Model::zeros(&s).unwrap().params().num_elements()
        );
    }
}
