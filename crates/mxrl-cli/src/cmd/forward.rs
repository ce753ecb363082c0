//! `mxrl forward`: run a model over one token sequence and write its logits and logprobs.
//!
//! Output (safetensors, written atomically): `logits` F32 `[T, V]` (every position),
//! `logprobs` F32 `[T-1]` (`log p(tokens[t+1] | tokens[..=t])`), `tokens` I32 `[T]`;
//! metadata names the model directory and the weight precision.
//!
//! With `--device cuda` the model runs on the GPU's device engine (every tensor on the device,
//! BF16 linears, block-format routed experts as stored).
//!
//! `--model` may be an `mxrl convert` output (a directory with `mxrl.json`): its quantized
//! weights run as stored, under the recipe the checkpoint records.

use crate::st::{write_tensors, OwnedTensor};
use anyhow::{bail, Context, Result};
use mxrl_model::{ForwardOptions, Model, SeqInput};
use std::collections::HashMap;
use std::path::PathBuf;

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
pub fn load_model(dir: &std::path::Path) -> Result<(Model, String)> {
    if !mxrl_ckpt::is_converted(dir) {
        let m = Model::load_hf(dir).with_context(|| format!("loading {}", dir.display()))?;
        return Ok((m, "f32".into()));
    }
    let m = Model::load_converted(dir)
        .with_context(|| format!("loading converted checkpoint {}", dir.display()))?;
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
    Ok((
        m,
        format!(
            "converted checkpoint: recipe {}, plan {}, stored quantized weights",
            field("/recipe/source"),
            &hash[..hash.len().min(16)]
        ),
    ))
}

/// Logits `[T, V]`, logprobs `[T]` and a description, on the GPU's device engine.
#[cfg(feature = "cuda")]
fn engine_forward(
    model: &Model,
    tokens: &[u32],
    targets: &[u32],
) -> Result<(Vec<f32>, Vec<f32>, String)> {
    let (e, what) = super::device::cuda_engine(model, tokens.len())?;
    let logits = e.logits(tokens)?;
    let lp = e.logprobs(&[SeqInput { tokens, targets }], 1.0)?.remove(0);
    Ok((logits, lp, what))
}

#[cfg(not(feature = "cuda"))]
fn engine_forward(_: &Model, _: &[u32], _: &[u32]) -> Result<(Vec<f32>, Vec<f32>, String)> {
    super::device::DeviceArgs {
        device: super::device::Device::Cuda,
    }
    .select()?;
    unreachable!("selecting CUDA fails in a binary built without it")
}

/// Parses the tokens into the forward's inputs: all `T` positions, with the targets of the
/// first `T-1` the next tokens (the last target is a placeholder whose logprob is dropped).
pub fn run(a: Args) -> Result<()> {
    let on_gpu = a.device.device == super::device::Device::Cuda;
    if on_gpu {
        super::device::cuda_built()?;
    } else {
        a.device.select()?;
    }
    let (mut model, mut precision) = load_model(&a.model)?;
    if mxrl_ckpt::is_converted(&a.model) && (a.bf16 || a.recipe.is_some()) {
        bail!(
            "{} is a converted checkpoint: it runs the recipe its mxrl.json records; --recipe and --bf16 apply to unquantized checkpoints only",
            a.model.display()
        );
    }
    if a.bf16 {
        model.set_precision_by(|_, _| mxrl_model::LinearPrecision::Bf16)?;
        precision = "bf16".into();
    }
    if let Some(r) = &a.recipe {
        let recipe = mxrl_plan::Recipe::load(r)?;
        let inv = mxrl_plan::Inventory::from_config_path(&a.model.join("config.json"))?;
        let plan = mxrl_plan::resolve(&inv, &recipe)?;
        model
            .apply_plan(&plan)
            .with_context(|| format!("applying recipe {r}"))?;
        precision = format!("recipe {r}, plan {}", plan.short_hash());
    }
    let t = a.tokens.len();
    if t == 0 {
        bail!("--tokens: at least one token is needed");
    }
    let mut targets = a.tokens[1..].to_vec();
    targets.push(a.tokens[0]);
    let v = model.config().vocab_size;
    let (logits, logprobs) = if on_gpu {
        let (lz, lp, what) = engine_forward(&model, &a.tokens, &targets)?;
        precision = format!("{precision}; {what}");
        println!("{what}");
        (lz, lp)
    } else {
        let mut out = model.forward(
            &[SeqInput {
                tokens: &a.tokens,
                targets: &targets,
            }],
            &ForwardOptions {
                return_logits: true,
                ..Default::default()
            },
        )?;
        let lz = out.logits.take().expect("logits were asked for").remove(0);
        (lz, out.logprobs.remove(0))
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
