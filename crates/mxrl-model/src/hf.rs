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
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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
    let mut out = Vec::new();
    for p in model.params().iter() {
        let names = hf_names(&p.name);
        if names.len() == 2 {
            let (rows, cols) = (p.shape[0] / 2, p.shape[1]);
            let (g, u) = p.data.split_at(rows * cols);
            out.push((names[0].clone(), vec![rows, cols], g.to_vec()));
            out.push((names[1].clone(), vec![rows, cols], u.to_vec()));
        } else {
            out.push((names[0].clone(), p.shape.clone(), p.data.clone()));
        }
    }
    out
}

fn read_f32(path: &Path, st: &SafeTensors<'_>, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = st.tensor(name).map_err(|e| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: format!("{name}: {e}"),
    })?;
    let data = t.data();
    let vals: Vec<f32> = match t.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::BadTensor {
                name: name.into(),
                message: format!(
                    "{}: dtype {other:?}, expected F32, BF16 or F16",
                    path.display()
                ),
            })
        }
    };
    Ok((t.shape().to_vec(), vals))
}

impl Model {
    /// Loads a model from an HF directory: `config.json` plus `*.safetensors` (one file or
    /// shards; every file in the directory is indexed). Tensors are widened to f32 exactly.
    /// Every parameter must be present with its expected shape; a tied model ignores a stored
    /// `lm_head.weight`.
    pub fn load_hf(dir: &Path) -> Result<Model> {
        let config = ModelConfig::from_dir(dir)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| ModelError::Io {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        let mut blobs = Vec::new();
        for f in &files {
            blobs.push(std::fs::read(f).map_err(|source| ModelError::Io {
                path: f.clone(),
                source,
            })?);
        }
        let mut tables = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for (i, (f, b)) in files.iter().zip(&blobs).enumerate() {
            let st = SafeTensors::deserialize(b).map_err(|e| ModelError::Safetensors {
                path: f.clone(),
                message: e.to_string(),
            })?;
            for name in st.names() {
                index.insert(name.to_string(), i);
            }
            tables.push(st);
        }
        let mut model = Model::zeros(&config)?;
        let names: Vec<(String, Vec<usize>)> = model
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect();
        {
            let mut ps = model.params_mut();
            for (name, shape) in names {
                let mut vals = Vec::new();
                let parts = hf_names(&name);
                let part_shape = if parts.len() == 2 {
                    vec![shape[0] / 2, shape[1]]
                } else {
                    shape.clone()
                };
                for part in &parts {
                    let i = *index.get(part).ok_or_else(|| ModelError::MissingTensor {
                        dir: dir.to_path_buf(),
                        name: part.clone(),
                    })?;
                    let (s, v) = read_f32(&files[i], &tables[i], part)?;
                    if s != part_shape {
                        return Err(ModelError::BadTensor {
                            name: part.clone(),
                            message: format!("shape {s:?}, expected {part_shape:?}"),
                        });
                    }
                    vals.extend_from_slice(&v);
                }
                ps.set(&name, &vals)?;
            }
        }
        Ok(model)
    }
}

/// Writes `config.json` and `model.safetensors` (F32, HF names) into `dir` (created if
/// needed). Each file is written to a temporary name and renamed when complete.
pub fn save_hf(model: &Model, dir: &Path) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensors = to_hf_tensors(model);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                .expect("shape matches the f32 byte length");
            (n.clone(), view)
        })
        .collect();
    let st_path = dir.join("model.safetensors");
    let tmp = dir.join(".model.safetensors.tmp");
    safetensors::serialize_to_file(views, &None, &tmp).map_err(|e| ModelError::Safetensors {
        path: tmp.clone(),
        message: e.to_string(),
    })?;
    std::fs::rename(&tmp, &st_path).map_err(io(&st_path))?;
    let cfg_path = dir.join("config.json");
    let tmp = dir.join(".config.json.tmp");
    std::fs::write(&tmp, model.config().to_json()).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &cfg_path).map_err(io(&cfg_path))?;
    Ok(())
}
