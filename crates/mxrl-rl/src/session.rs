//! What the `mxrl rl`, `sft`, `ablate` and `demo` commands share: loading a model directory
//! (HF `config.json` + safetensors + `tokenizer.json`), building the trainer/rollout pair of a
//! recipe, and the embedded demo model.

use crate::ablate::Built;
use crate::moe::{formats_for, plan_for, weight_bytes, MoeRollout, MoeTrainer};
use crate::policy::{PolicyError, TrainPolicy};
use crate::runner::RunError;
use crate::task::{load_jsonl, ArithmeticTask, ChatTemplate, TaskSource};
use crate::text::{char_tokenizer_json, TextCodec, CHAR_VOCAB};
use mxrl_model::{Model, ModelConfig};
use std::path::Path;

/// The demo's tiny MoE (Qwen3-MoE layout): the char-level vocabulary (128), hidden 64,
/// 4 layers, 8 experts top-2 with F = 32, 4 query / 2 kv heads of width 16. Every GEMM's
/// contraction dim is a multiple of 32, so MXFP8 and NVFP4 blocks tile it exactly.
pub fn demo_config() -> ModelConfig {
    ModelConfig {
        vocab_size: CHAR_VOCAB,
        initializer_range: 0.05,
        ..ModelConfig::tiny()
    }
}

fn be<E: std::fmt::Display>(e: E) -> RunError {
    RunError::Policy(PolicyError::Backend(e.to_string()))
}

/// Load `DIR` (config.json, *.safetensors, tokenizer.json).
pub fn load_model_dir(dir: &Path) -> Result<(Model, TextCodec), RunError> {
    let model = Model::load_hf(dir).map_err(be)?;
    let codec = TextCodec::from_model_dir(dir)?;
    if codec.vocab_size > model.config().vocab_size {
        return Err(RunError::Config(format!(
            "{}: tokenizer has {} tokens, the model's vocabulary is {}",
            dir.display(),
            codec.vocab_size,
            model.config().vocab_size
        )));
    }
    Ok((model, codec))
}

/// Write a model directory: config.json + model.safetensors (f32) + `tokenizer_json`.
pub fn save_model_dir(model: &Model, tokenizer_json: &str, dir: &Path) -> Result<(), RunError> {
    mxrl_model::hf::save_hf(model, dir).map_err(be)?;
    let tmp = dir.join("tokenizer.json.tmp");
    std::fs::write(&tmp, tokenizer_json)
        .and_then(|_| std::fs::rename(&tmp, dir.join("tokenizer.json")))
        .map_err(|e| RunError::Checkpoint {
            path: dir.join("tokenizer.json").display().to_string(),
            msg: e.to_string(),
        })
}

/// A fresh demo model (seeded) and its char-level tokenizer JSON.
pub fn demo_model(seed: u64) -> Result<(Model, String), RunError> {
    Ok((
        Model::random(&demo_config(), seed).map_err(be)?,
        char_tokenizer_json(),
    ))
}

/// Build the trainer, rollout and frozen reference of `recipe` from `model`'s weights.
pub fn build(model: &Model, recipe: &str) -> Result<Built<MoeTrainer, MoeRollout>, RunError> {
    let plan = plan_for(model.config(), recipe)?;
    let formats = formats_for(model, &plan)?;
    let bytes = weight_bytes(model, &formats);
    let mut trainer = MoeTrainer::new(model.clone(), &plan)?;
    let rollout = trainer.rollout()?;
    let reference = Some(trainer.clone());
    Ok(Built {
        trainer,
        rollout,
        reference,
        weight_bytes: bytes,
        contract_hash: crate::wire::contract_hash().to_string(),
    })
}

/// The task of a command line: `arithmetic` (with `digits`) or a JSONL file.
pub fn task_source(
    task: Option<&str>,
    data: Option<&Path>,
    digits: u32,
    model_dir: Option<&Path>,
) -> Result<TaskSource, RunError> {
    match (task, data) {
        (_, Some(f)) => {
            let tpl = match model_dir {
                Some(d) => {
                    ChatTemplate::from_model_dir(d).map_err(|e| RunError::Config(e.to_string()))?
                }
                None => None,
            };
            let v = load_jsonl(f, tpl.as_ref()).map_err(|e| RunError::Config(e.to_string()))?;
            if v.is_empty() {
                return Err(RunError::Config(format!("{}: no prompts", f.display())));
            }
            Ok(TaskSource::List(v))
        }
        (Some("arithmetic") | None, None) => Ok(TaskSource::Arithmetic(ArithmeticTask {
            digits,
            ops: "+".into(),
        })),
        (Some(other), None) => Err(RunError::Config(format!(
            "unknown task `{other}` (expected `arithmetic`, or --data FILE.jsonl)"
        ))),
    }
}

/// Save the trainer's f32 masters as a model directory (after SFT).
pub fn save_trainer(t: &MoeTrainer, tokenizer_json: &str, dir: &Path) -> Result<(), RunError> {
    save_model_dir(&t.master_model()?, tokenizer_json, dir)
}

/// Number of trainable scalars.
pub fn num_params<T: TrainPolicy>(t: &mut T) -> usize {
    t.params().iter().map(|p| p.value.len()).sum()
}
