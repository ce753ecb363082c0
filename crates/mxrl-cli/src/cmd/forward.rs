//! `mxrl forward`: run a model over one token sequence and write its logits and logprobs.
//!
//! Output (safetensors, written atomically): `logits` F32 `[T, V]` (every position),
//! `logprobs` F32 `[T-1]` (`log p(tokens[t+1] | tokens[..=t])`), `tokens` I32 `[T]`;
//! metadata names the model directory and the weight precision.
//!
//! With `--device cuda` the model runs on the GPU's device engine (every tensor on the device,
//! BF16 linears, block-format routed experts as stored). A Hugging Face checkpoint is then read
//! from its memory-mapped files straight into the engine, one tensor at a time (no f32 copy of
//! the model on the host), unless `--recipe` asks for a plan to be applied on the host model.
//!
//! `--model` may be an `mxrl convert` output (a directory with `mxrl.json`): its quantized
//! weights run as stored, under the recipe the checkpoint records.

use crate::st::{write_tensors, OwnedTensor};
use anyhow::{bail, Context, Result};
use mxrl_model::{ForwardOptions, Model, SeqInput};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Arguments of `mxrl forward`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory (config.json + safetensors), or an `mxrl convert` output
    /// (detected by its mxrl.json; its recorded recipe applies and quantized weights run as
    /// stored).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Input token ids, comma separated (e.g. `1,2,3`).
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true)]
    tokens: Vec<u32>,
    /// Precision recipe (a preset such as `mxfp8` / `nvfp4-dq`, or a recipe TOML file):
    /// every linear layer runs in the format and backward mode its plan entry says.
    /// Without it, all linears run with f32 operands.
    #[arg(long, value_name = "R")]
    recipe: Option<String>,
    /// Run every linear layer with BF16 GEMM operands (f32 accumulation).
    #[arg(long, conflicts_with = "recipe")]
    bf16: bool,
    /// Output safetensors file.
    #[arg(long, value_name = "FILE.safetensors")]
    out: PathBuf,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Loads `dir` as an mxrl-converted checkpoint when it has `mxrl.json` (quantized weights used
/// as stored), else as a Hugging Face checkpoint with f32 linears; returns the model and a
/// description of its precision.
pub fn load_model(dir: &Path) -> Result<(Model, String)> {
    if !mxrl_ckpt::is_converted(dir) {
        let m = Model::load_hf(dir).with_context(|| format!("loading {}", dir.display()))?;
        return Ok((m, "f32".into()));
    }
    let m = Model::load_converted(dir)
        .with_context(|| format!("loading converted checkpoint {}", dir.display()))?;
    Ok((m, converted_description(dir)?))
}

/// The precision line of an `mxrl convert` output: the recipe and plan hash its `mxrl.json`
/// records.
pub fn converted_description(dir: &Path) -> Result<String> {
    let record = dir.join(mxrl_ckpt::MXRL_JSON);
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&record)
            .with_context(|| format!("reading {}", record.display()))?,
    )
    .with_context(|| format!("parsing {}", record.display()))?;
    let field = |p: &str| {
        v.pointer(p)
            .and_then(|x| x.as_str())
            .unwrap_or("?")
            .to_string()
    };
    let hash = field("/plan_hash");
    Ok(format!(
        "converted checkpoint: recipe {}, plan {}, stored quantized weights",
        field("/recipe/source"),
        &hash[..hash.len().min(16)]
    ))
}

/// Applies the recipe `r` (a preset or a TOML file) to `model` through the plan resolved from
/// `dir/config.json`; returns the precision line.
fn apply_recipe(model: &mut Model, dir: &Path, r: &str) -> Result<String> {
    let recipe = mxrl_plan::Recipe::load(r)?;
    let inv = mxrl_plan::Inventory::from_config_path(&dir.join("config.json"))?;
    let plan = mxrl_plan::resolve(&inv, &recipe)?;
    model
        .apply_plan(&plan)
        .with_context(|| format!("applying recipe {r}"))?;
    Ok(format!("recipe {r}, plan {}", plan.short_hash()))
}

/// What a forward returns: logits `[T, V]`, logprobs `[T]`, `V`, and the precision line.
type ForwardResult = (Vec<f32>, Vec<f32>, usize, String);

/// The forward on the GPU's device engine: the checkpoint is streamed into the engine tensor
/// by tensor ([`super::device::cuda_engine_from_checkpoint`]; no host model), and a recipe's
/// plan is applied on the engine (its block-format linears quantized there, the bytes the
/// host model's plan gives). A recipe the engine has no kernels for (per-tensor NVFP4
/// activations) is applied to a host model whose engine then runs as the model would.
#[cfg(feature = "cuda")]
fn engine_forward(a: &Args, targets: &[u32]) -> Result<ForwardResult> {
    let tokens = &a.tokens;
    // The recipe's plan, and whether the engine runs its formats.
    let plan = match &a.recipe {
        Some(r) => {
            let recipe = mxrl_plan::Recipe::load(r)?;
            let inv = mxrl_plan::Inventory::from_config_path(&a.model.join("config.json"))?;
            let plan = mxrl_plan::resolve(&inv, &recipe)?;
            let ok = mxrl_rl::engine::check_engine_plan(&plan);
            Some((r, plan, ok))
        }
        None => None,
    };
    let (e, precision, what) = if let Some((r, plan, Ok(()))) = &plan {
        let (mut e, what) = super::device::cuda_engine_from_checkpoint(&a.model, tokens.len())?;
        let ran = e
            .apply_plan(plan)
            .with_context(|| format!("applying recipe {r} on the device engine"))?;
        (
            e,
            format!("recipe {r}, plan {}", plan.short_hash()),
            format!("{what}; {ran}"),
        )
    } else if let Some((r, _, Err(why))) = &plan {
        let (mut model, _) = load_model(&a.model)?;
        let precision = apply_recipe(&mut model, &a.model, r)?;
        let (e, what) = super::device::cuda_engine(&model, tokens.len())?;
        (
            e,
            precision,
            format!("{what} (the recipe's plan is applied on a host model first: {why})"),
        )
    } else {
        let (e, what) = super::device::cuda_engine_from_checkpoint(&a.model, tokens.len())?;
        let precision = if mxrl_ckpt::is_converted(&a.model) {
            converted_description(&a.model)?
        } else if a.bf16 {
            "bf16".to_string()
        } else {
            "checkpoint weights".to_string()
        };
        (e, precision, what)
    };
    println!("{what}");
    let logits = e.logits(tokens)?;
    let lp = e.logprobs(&[SeqInput { tokens, targets }], 1.0)?.remove(0);
    Ok((
        logits,
        lp,
        e.config().vocab_size,
        format!("{precision}; {what}"),
    ))
}

#[cfg(not(feature = "cuda"))]
fn engine_forward(_: &Args, _: &[u32]) -> Result<ForwardResult> {
    super::device::cuda_built()?;
    unreachable!("cuda_built fails in a binary built without CUDA")
}

/// The forward of the CPU model (loaded on the host), with `--bf16` or `--recipe` applied.
fn host_forward(a: &Args, targets: &[u32]) -> Result<ForwardResult> {
    let (mut model, mut precision) = load_model(&a.model)?;
    if a.bf16 {
        model.set_precision_by(|_, _| mxrl_model::LinearPrecision::Bf16)?;
        precision = "bf16".into();
    }
    if let Some(r) = &a.recipe {
        precision = apply_recipe(&mut model, &a.model, r)?;
    }
    let mut out = model.forward(
        &[SeqInput {
            tokens: &a.tokens,
            targets,
        }],
        &ForwardOptions {
            return_logits: true,
            ..Default::default()
        },
    )?;
    let lz = out.logits.take().expect("logits were asked for").remove(0);
    let v = model.config().vocab_size;
    Ok((lz, out.logprobs.remove(0), v, precision))
}

/// Parses the tokens into the forward's inputs: all `T` positions, with the targets of the
/// first `T-1` the next tokens (the last target is a placeholder whose logprob is dropped).
pub fn run(a: Args) -> Result<()> {
    let on_gpu = a.device.device == super::device::Device::Cuda;
    if on_gpu {
        super::device::cuda_built()?;
    }
    if mxrl_ckpt::is_converted(&a.model) && (a.bf16 || a.recipe.is_some()) {
        bail!(
            "{} is a converted checkpoint: it runs the recipe its mxrl.json records; --recipe and --bf16 apply to unquantized checkpoints only",
            a.model.display()
        );
    }
    let t = a.tokens.len();
    if t == 0 {
        bail!("--tokens: at least one token is needed");
    }
    let mut targets = a.tokens[1..].to_vec();
    targets.push(a.tokens[0]);
    let (logits, logprobs, v, precision) = if on_gpu {
        engine_forward(&a, &targets)?
    } else {
        host_forward(&a, &targets)?
    };
    let (logits, logprobs) = (&logits, &logprobs[..t - 1]);
    let tokens: Vec<u8> = a
        .tokens
        .iter()
        .flat_map(|&x| (x as i32).to_le_bytes())
        .collect();
    let mut meta = HashMap::new();
    meta.insert("model".to_string(), a.model.display().to_string());
    meta.insert("precision".to_string(), precision);
    write_tensors(
        &a.out,
        vec![
            ("logits".into(), OwnedTensor::f32(vec![t, v], logits)),
            ("logprobs".into(), OwnedTensor::f32(vec![t - 1], logprobs)),
            (
                "tokens".into(),
                OwnedTensor {
                    dtype: mxrl_ckpt::Dtype::I32,
                    shape: vec![t],
                    bytes: tokens,
                },
            ),
        ],
        meta,
    )?;
    let mean = if t > 1 {
        logprobs.iter().map(|&x| x as f64).sum::<f64>() / (t - 1) as f64
    } else {
        0.0
    };
    println!(
        "{}: {t} tokens, vocab {v}, mean next-token logprob {mean:.6}",
        a.out.display()
    );
    Ok(())
}
