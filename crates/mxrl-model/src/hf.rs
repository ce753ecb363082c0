//! Hugging Face checkpoints: name mapping and loading BF16/F32 safetensors.
//!
//! HF stores each SwiGLU MLP as `gate_proj.weight [F, H]` and `up_proj.weight [F, H]`; mxrl
//! stores `gate_up_proj.weight [2F, H]` = rows of gate, then rows of up. Everything else has
//! the same name and layout. (Newer `transformers` versions may hold experts fused as
//! `mlp.experts.gate_up_proj [E, 2F, H]` in memory, but their checkpoints keep the per-expert
//! names above.)

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::Model;
use mxrl_ckpt::{
    f32_bytes, to_f32, write_atomic, write_bytes_atomic, Checkpoint, Dtype, ShardWriter, TensorSpec,
};
use std::path::Path;

/// The HF tensor names that make up the mxrl parameter `name`: one name, or for a fused
/// `….gate_up_proj.weight` the pair (`….gate_proj.weight`, `….up_proj.weight`).
pub fn hf_names(name: &str) -> Vec<String> {
    match name.strip_suffix(".gate_up_proj.weight") {
        Some(base) => vec![
            format!("{base}.gate_proj.weight"),
            format!("{base}.up_proj.weight"),
        ],
        None => vec![name.to_string()],
    }
}

/// HF-named tensors of a model (f32, gate/up split), e.g. to save a checkpoint HF can read.
pub fn to_hf_tensors(model: &Model) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    hf_parts(model)
        .into_iter()
        .map(|(n, s, v)| (n, s, v.to_vec()))
        .collect()
}

/// [`to_hf_tensors`] without copying a value: each HF tensor's name, shape and values, the
/// halves of a fused gate/up parameter as slices of it.
fn hf_parts(model: &Model) -> Vec<(String, Vec<usize>, &[f32])> {
    let mut out = Vec::new();
    for p in model.params().iter() {
        let names = hf_names(&p.name);
        if names.len() == 2 {
            let (rows, cols) = (p.shape[0] / 2, p.shape[1]);
            let (g, u) = p.data.split_at(rows * cols);
            out.push((names[0].clone(), vec![rows, cols], g));
            out.push((names[1].clone(), vec![rows, cols], u));
        } else {
            out.push((names[0].clone(), p.shape.clone(), &p.data[..]));
        }
    }
    out
}

/// Little-endian bytes of `v`: the values' own memory on a little-endian machine, a copy
/// elsewhere.
fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        std::borrow::Cow::Owned(f32_bytes(v))
    }
}

/// The f32 values of the mxrl parameter `name` of shape `shape` read from `ck` (the checkpoint
/// in `dir`): its HF tensor, or for a fused `….gate_up_proj.weight` `[2F, H]` the rows of
/// `….gate_proj.weight` `[F, H]` then those of `….up_proj.weight`, each widened to f32 exactly.
/// Only this parameter's values are held on the host.
///
/// # Errors
/// A missing part ([`ModelError::MissingTensor`]), a part of another shape (naming it and its
/// file), a dtype that is not BF16, F16 or F32 (naming it and its file).
pub(crate) fn read_param(
    ck: &Checkpoint,
    dir: &Path,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>> {
    let parts = hf_names(name);
    let part_shape = if parts.len() == 2 {
        vec![shape[0] / 2, shape[1]]
    } else {
        shape.to_vec()
    };
    let mut vals = Vec::with_capacity(shape.iter().product());
    for part in &parts {
        let t = ck.get(part).ok_or_else(|| ModelError::MissingTensor {
            dir: dir.to_path_buf(),
            name: part.clone(),
        })?;
        if t.shape != part_shape.as_slice() {
            return Err(ModelError::BadTensor {
                name: part.clone(),
                message: format!(
                    "{}: shape {:?}, expected {part_shape:?}",
                    dir.join(t.file).display(),
                    t.shape
                ),
            });
        }
        vals.extend_from_slice(&to_f32(&t)?);
    }
    Ok(vals)
}

impl Model {
    /// Loads a model from an HF directory: `config.json` plus `model.safetensors` or the shards
    /// of `model.safetensors.index.json`, read through the one strict reader
    /// ([`mxrl_ckpt::Checkpoint`]: a tensor in two shards, an index entry without its tensor or
    /// a shard outside the index are errors naming the file). Tensors are widened to f32 exactly.
    /// Every parameter must be present with its expected shape; a tied model ignores a stored
    /// `lm_head.weight`.
    pub fn load_hf(dir: &Path) -> Result<Model> {
        // The config is validated before any weight file is opened.
        let config = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        let mut model = Model::zeros(&config)?;
        let names: Vec<(String, Vec<usize>)> = model
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        {
            let mut ps = model.params_mut();
            for (name, shape) in names {
                let vals = read_param(&ck, dir, &name, &shape)?;
                ps.set(&name, &vals)?;
            }
        }
        Ok(model)
    }
}

/// Writes `config.json` and `model.safetensors` (F32, HF names) into `dir` (created if
/// needed). Each file is written atomically (`mxrl_ckpt::write_atomic`: a temporary name,
/// renamed when complete).
pub fn save_hf(model: &Model, dir: &Path) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // Streamed from the parameters' own memory: no copy of the model is made.
    let parts = hf_parts(model);
    let specs: Vec<TensorSpec> = parts
        .iter()
        .map(|(n, s, _)| TensorSpec::new(n.clone(), Dtype::F32, s.clone()))
        .collect();
    write_atomic(&dir.join("model.safetensors"), |tmp| {
        let mut w = ShardWriter::create(tmp, specs, &Default::default())?;
        for (n, _, v) in &parts {
            w.write_tensor(n, &le_bytes(v))?;
        }
        w.finish()
    })?;
    write_bytes_atomic(
        &dir.join("config.json"),
        model.config().to_json().as_bytes(),
    )?;
    Ok(())
}
