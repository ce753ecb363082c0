//! `mxrl generate`: sample a continuation of a prompt (text through the model directory's
//! `tokenizer.json`, or token ids) and print the new tokens with their logprobs.
//!
//! With `--device cuda` the checkpoint is read from its memory-mapped files straight into the
//! GPU's device engine, one tensor at a time (no f32 copy of the model on the host).

use anyhow::{bail, Context, Result};
use mxrl_model::{FinishReason, SamplingParams};
use std::path::{Path, PathBuf};

/// Arguments of `mxrl generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory (config.json + safetensors [+ tokenizer.json]), or an
    /// `mxrl convert` output (detected by its mxrl.json; quantized weights run as stored).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Prompt text, tokenized with DIR/tokenizer.json.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    prompt: Option<String>,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    tokens: Option<Vec<u32>>,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop token ids (default: `eos_token_id` of config.json, if any).
    #[arg(long, value_delimiter = ',')]
    stop: Option<Vec<u32>>,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

fn eos_from_config(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(match v.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    })
}

fn load_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| anyhow::anyhow!("loading {}: {e}", path.display()))
}

/// New tokens and their logprobs from the GPU's device engine, the checkpoint in `dir` streamed
/// into it tensor by tensor ([`super::device::cuda_engine_from_checkpoint`]; no host model).
/// Its sampler is counter-based (seed, step, row), so a seeded run repeats itself but draws
/// differently from the CPU model's.
#[cfg(feature = "cuda")]
fn engine_generate(
    dir: &Path,
    prompt: &[u32],
    sp: &SamplingParams,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (e, what) =
        super::device::cuda_engine_from_checkpoint(dir, prompt.len() + sp.max_new_tokens)?;
    println!("{what}");
    let p = mxrl_tensor::sample::SampleParams {
        temperature: sp.temperature,
        top_p: sp.top_p,
        top_k: sp.top_k,
        seed: sp.seed,
        step: 0,
    };
    let s = e
        .generate(&[prompt], sp.max_new_tokens, &p, &sp.stop_tokens)?
        .remove(0);
    Ok((s.tokens, s.logprobs))
}

#[cfg(not(feature = "cuda"))]
fn engine_generate(_: &Path, _: &[u32], _: &SamplingParams) -> Result<(Vec<u32>, Vec<f32>)> {
    super::device::cuda_built()?;
    unreachable!("cuda_built fails in a binary built without CUDA")
}

/// Runs the command.
pub fn run(a: Args) -> Result<()> {
    let on_gpu = a.device.device == super::device::Device::Cuda;
    if on_gpu {
        super::device::cuda_built()?;
    }
    // On the GPU the checkpoint is streamed into the device engine; only the CPU path
    // builds the host model.
    let model = if on_gpu {
        let precision = if mxrl_ckpt::is_converted(&a.model) {
            super::forward::converted_description(&a.model)?
        } else {
            "checkpoint weights, streamed to the device".to_string()
        };
        println!("weights: {precision}");
        None
    } else {
        let (model, precision) = super::forward::load_model(&a.model)?;
        println!("weights: {precision}");
        Some(model)
    };
    let tokenizer = if a.prompt.is_some() || a.model.join("tokenizer.json").exists() {
        Some(load_tokenizer(&a.model)?)
    } else {
        None
    };
    let prompt: Vec<u32> = match (&a.prompt, &a.tokens) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().expect("loaded above for --prompt");
            let enc = tok
                .encode(text.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing --prompt: {e}"))?;
            enc.get_ids().to_vec()
        }
        (None, Some(t)) => t.clone(),
        (None, None) => bail!("give --prompt or --tokens"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let sp = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_new_tokens: a.max_new_tokens,
        stop_tokens: match a.stop {
            Some(s) => s,
            None => eos_from_config(&a.model)?,
        },
    };
    let (tokens, logprobs, finish) = if let Some(model) = &model {
        let g = model.generate(&[&prompt], &sp)?.remove(0);
        (g.tokens, g.logprobs, g.finish)
    } else {
        let (tokens, logprobs) = engine_generate(&a.model, &prompt, &sp)?;
        let finish = match tokens.last() {
            Some(t) if sp.stop_tokens.contains(t) => FinishReason::Stop,
            _ => FinishReason::Length,
        };
        (tokens, logprobs, finish)
    };
    println!(
        "prompt tokens: {}",
        prompt
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    println!(
        "new tokens:    {}",
        tokens
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    println!(
        "logprobs:      {}",
        logprobs
            .iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    if let Some(tok) = &tokenizer {
        let text = tok
            .decode(&tokens, false)
            .map_err(|e| anyhow::anyhow!("detokenizing: {e}"))?;
        println!("text:          {text}");
    }
    let why = match finish {
        FinishReason::Stop => "stop token",
        FinishReason::Length => "max_new_tokens",
    };
    println!("finished:      {why}");
    Ok(())
}
