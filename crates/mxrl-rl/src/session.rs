//! What the `mxrl rl`, `sft`, `ablate` and `demo` commands share: loading a model directory
//! (HF `config.json` + safetensors + `tokenizer.json`), building the trainer/rollout pair of a
//! recipe, and the embedded demo model.

use crate::ablate::Built;
use crate::engine::{EngineRollout, EngineTrainer};
use crate::moe::{formats_for, plan_for, weight_bytes, MoeRollout, MoeTrainer};
use crate::policy::{PolicyError, RolloutPolicy, TrainPolicy};
use crate::runner::RunError;
use crate::text::{char_tokenizer_json, TextCodec, CHAR_VOCAB};
use mxrl_ckpt::StagedDir;
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

/// The demo model with every linear's K and N a multiple of 128 except the router's and
/// lm_head's, so that the `fp8-block` preset's 128×128 weight tiles apply (at the demo's hidden
/// size 64 it falls back to BF16 everywhere): hidden 128, 4 heads of 64 (2 KV heads), 4
/// experts of F = 128.
pub fn fp8_block_demo_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 128,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        moe_intermediate_size: 128,
        num_experts: 4,
        ..demo_config()
    }
}

/// The `mxrl demo --size large` model: the demo's char-level vocabulary (128) and Qwen3-MoE
/// layout with hidden 384, 6 layers, 6 query / 2 kv heads of width 64, 16 experts top-2 with
/// F = 384 — 44.7M parameters (~5.9M active per token). Every contraction dim is a multiple
/// of 32.
pub fn large_demo_config() -> ModelConfig {
    ModelConfig {
        hidden_size: 384,
        num_layers: 6,
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 64,
        moe_intermediate_size: 384,
        num_experts: 16,
        num_experts_per_tok: 2,
        initializer_range: 0.02,
        ..demo_config()
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

/// Write a model directory: config.json (with the tokenizer's `eos_token_id`, so that
/// generation stops there) + model.safetensors (f32) + `tokenizer_json`.
///
/// The directory is assembled in `DIR.partial` and renamed when complete
/// (`mxrl_ckpt::StagedDir`); an existing `dir` is refused unless `overwrite`, and then kept
/// until the new one is in place.
pub fn write_model_dir(
    model: &Model,
    tokenizer_json: &str,
    dir: &Path,
    overwrite: bool,
) -> Result<(), RunError> {
    let fail = |p: &Path, what: &str, e: &dyn std::fmt::Display| RunError::Checkpoint {
        path: p.display().to_string(),
        msg: format!("{what}: {e}"),
    };
    if dir.exists() && !overwrite {
        return Err(RunError::Checkpoint {
            path: dir.display().to_string(),
            msg: "already exists; refusing to overwrite it (pass --force to replace it)".into(),
        });
    }
    if dir.exists() && !dir.is_dir() {
        return Err(RunError::Checkpoint {
            path: dir.display().to_string(),
            msg: "exists and is not a directory".into(),
        });
    }
    let codec = TextCodec::from_bytes(tokenizer_json.as_bytes(), "<tokenizer.json>")?;
    let staged = StagedDir::create(dir, overwrite)?;
    let partial = staged.path();
    mxrl_model::hf::save_hf(model, partial).map_err(|e| fail(partial, "writing the model", &e))?;
    let cfg_path = partial.join("config.json");
    let mut cfg: serde_json::Value = std::fs::read_to_string(&cfg_path)
        .map_err(|e| fail(&cfg_path, "reading back", &e))
        .and_then(|t| serde_json::from_str(&t).map_err(|e| fail(&cfg_path, "parsing", &e)))?;
    if let Some(o) = cfg.as_object_mut() {
        o.insert("eos_token_id".into(), codec.eos.into());
    }
    std::fs::write(
        &cfg_path,
        serde_json::to_string_pretty(&cfg).expect("JSON serializes"),
    )
    .map_err(|e| fail(&cfg_path, "writing", &e))?;
    let tok = partial.join("tokenizer.json");
    std::fs::write(&tok, tokenizer_json).map_err(|e| fail(&tok, "writing", &e))?;
    staged.commit()?;
    Ok(())
}

/// [`write_model_dir`], replacing an existing `dir`.
pub fn save_model_dir(model: &Model, tokenizer_json: &str, dir: &Path) -> Result<(), RunError> {
    write_model_dir(model, tokenizer_json, dir, true)
}

/// What `recipe` resolves to on `model` (plan hash, weight bytes per format), without
/// building policies: used to validate every recipe before a run starts.
pub fn recipe_info(model: &Model, recipe: &str) -> Result<crate::ablate::RecipeInfo, RunError> {
    let plan = plan_for(model.config(), recipe)?;
    let formats = formats_for(model, &plan)?;
    Ok(crate::ablate::RecipeInfo {
        plan_hash: plan.hash().to_string(),
        weight_bytes: weight_bytes(model, &formats),
        contract_hash: crate::wire::contract_hash().to_string(),
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
        build_phases: Vec::new(),
    })
}

/// [`build`] on the device engine: trainer, rollout and frozen reference are three engines
/// made by `backend` from `model`'s weights, sequences up to `max_pos` tokens; the rollout
/// starts with the trainer's exported weights. Only the trainer holds f32 masters.
///
/// # Errors
/// A recipe that stores a tensor in a block format (named), a model the engine cannot run, a
/// device failure.
pub fn build_engine<B: mxrl_tensor::device::Backend + 'static>(
    model: &Model,
    recipe: &str,
    max_pos: usize,
    backend: impl FnMut() -> Result<B, RunError>,
) -> Result<Built<EngineTrainer<B>, EngineRollout<B>>, RunError> {
    build_engines(model, recipe, max_pos, true, backend)
}

/// [`build_engine`] without the frozen reference (`reference` false: [`Built::reference`] is
/// `None`, one engine fewer to build and hold), e.g. for SFT, which never scores against one.
///
/// # Errors
/// As [`build_engine`].
pub fn build_engines<B: mxrl_tensor::device::Backend + 'static>(
    model: &Model,
    recipe: &str,
    max_pos: usize,
    reference: bool,
    mut backend: impl FnMut() -> Result<B, RunError>,
) -> Result<Built<EngineTrainer<B>, EngineRollout<B>>, RunError> {
    use mxrl_model::engine::Engine;
    let plan = plan_for(model.config(), recipe)?;
    let formats = formats_for(model, &plan)?;
    let bytes = weight_bytes(model, &formats);
    let mut phases = Vec::new();
    let mut t = std::time::Instant::now();
    let mut lap = |what: &'static str, phases: &mut Vec<(&'static str, f64)>| {
        phases.push((what, t.elapsed().as_secs_f64()));
        t = std::time::Instant::now();
    };
    let engine = |backend: &mut dyn FnMut() -> Result<B, RunError>| -> Result<Engine<B>, RunError> {
        Engine::from_model(model, backend()?, max_pos).map_err(be)
    };
    // The two engines without masters first: each holds its f32 masters only until it is
    // built, so the device's peak is the trainer's 18 bytes per parameter plus their 2 each
    // (BF16 recipes), not plus the masters too.
    let reference = if reference {
        let e = engine(&mut backend)?;
        lap("reference uploaded", &mut phases);
        let r = EngineTrainer::frozen(e, &plan)?;
        lap("reference planned", &mut phases);
        Some(r)
    } else {
        None
    };
    // The rollout takes the trainer's weights below: its own start on zeroed buffers.
    let e = Engine::zeroed(model.config(), backend()?, max_pos).map_err(be)?;
    lap("rollout allocated", &mut phases);
    let mut rollout = EngineRollout::new(e, &plan)?;
    lap("rollout planned", &mut phases);
    let e = engine(&mut backend)?;
    lap("trainer uploaded", &mut phases);
    let mut trainer = EngineTrainer::new(e, &plan)?;
    lap("trainer planned", &mut phases);
    // The trainer's weights into the rollout: device to device where the backend keeps them
    // there (checksummed on the device), else through the host.
    let mut local = trainer.local_export().transpose()?;
    match local
        .as_mut()
        .and_then(|x| rollout.load_local(0, x))
        .transpose()?
    {
        Some(()) => {}
        None => rollout.load_weights(&trainer.export_weights()?)?,
    }
    lap("trainer's weights loaded into the rollout", &mut phases);
    Ok(Built {
        trainer,
        rollout,
        reference,
        weight_bytes: bytes,
        contract_hash: crate::wire::contract_hash().to_string(),
        build_phases: phases,
    })
}

/// Save the trainer's f32 masters as a model directory (after SFT).
pub fn save_trainer(
    t: &MoeTrainer,
    tokenizer_json: &str,
    dir: &Path,
    overwrite: bool,
) -> Result<(), RunError> {
    write_model_dir(&t.master_model()?, tokenizer_json, dir, overwrite)
}

/// Number of trainable scalars.
pub fn num_params<T: TrainPolicy>(t: &mut T) -> usize {
    t.params().iter().map(|p| p.value.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a `DIR.partial` that mxrl did not stage (someone's data) was removed as a
    /// "stale partial output". It is now refused and kept; once moved away, the model
    /// directory is written and no staging marker or `.partial` is left.
    #[test]
    fn a_foreign_partial_directory_is_never_removed() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("m");
        let foreign = d.path().join("m.partial");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("keep.txt"), "mine").unwrap();
        let (model, tok) = demo_model(1).unwrap();
        let e = write_model_dir(&model, &tok, &dir, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.partial") && e.contains("move it away"), "{e}");
        assert_eq!(
            std::fs::read_to_string(foreign.join("keep.txt")).unwrap(),
            "mine"
        );
        assert!(!dir.exists());
        std::fs::remove_dir_all(&foreign).unwrap();
        write_model_dir(&model, &tok, &dir, false).unwrap();
        assert!(dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file());
        assert!(!foreign.exists() && !dir.join(mxrl_ckpt::STAGING_MARKER).exists());
        load_model_dir(&dir).unwrap();
    }
}
