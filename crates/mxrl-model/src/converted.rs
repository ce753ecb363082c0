//! Loading an mxrl-converted checkpoint with its quantized weights used as stored.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::hf::hf_names;
use crate::model::{Model, WeightValue};
use mxrl_ckpt::{load_quantized, stack_rows, StoredWeight};
use std::collections::HashMap;
use std::path::Path;

/// The model parameter `name`'s value from its HF parts: plain values concatenate row-wise
/// (gate rows, then up rows); quantized parts stack along N with [`stack_rows`].
pub(crate) fn fuse(
    dir: &Path,
    name: &str,
    parts: &[String],
    stored: &mut HashMap<String, StoredWeight>,
) -> Result<WeightValue> {
    let mut got = Vec::with_capacity(parts.len());
    for p in parts {
        let w = stored.remove(p).ok_or_else(|| ModelError::MissingTensor {
            dir: dir.to_path_buf(),
            name: p.clone(),
        })?;
        got.push(w);
    }
    match got.as_slice() {
        [StoredWeight::Values { values, .. }] => Ok(WeightValue::Values(values.clone())),
        [StoredWeight::Quantized(q)] => Ok(WeightValue::Quantized(q.clone())),
        _ if got.iter().all(|w| matches!(w, StoredWeight::Values { .. })) => {
            let mut v = Vec::new();
            for w in &got {
                if let StoredWeight::Values { values, .. } = w {
                    v.extend_from_slice(values);
                }
            }
            Ok(WeightValue::Values(v))
        }
        _ if got.iter().all(|w| matches!(w, StoredWeight::Quantized(_))) => {
            let qs: Vec<(&str, &mxrl_formats::QuantizedTensor)> = parts
                .iter()
                .zip(&got)
                .filter_map(|(p, w)| match w {
                    StoredWeight::Quantized(q) => Some((p.as_str(), q)),
                    StoredWeight::Values { .. } => None,
                })
                .collect();
            let q = stack_rows(&qs).map_err(|e| ModelError::Checkpoint {
                dir: dir.to_path_buf(),
                message: format!("fusing {} from {parts:?}: {e}", name),
            })?;
            Ok(WeightValue::Quantized(q))
        }
        _ => Err(ModelError::Checkpoint {
            dir: dir.to_path_buf(),
            message: format!(
                "{parts:?} make up the fused `{name}`, but some are quantized and some are not"
            ),
        }),
    }
}

impl Model {
    /// Loads a checkpoint written by `mxrl convert` (a directory with `mxrl.json`): the
    /// configuration from its `config.json`, the precision plan re-resolved from the recipe it
    /// records (applied with [`Model::apply_plan`]), and every quantized weight installed from
    /// the stored bytes exactly as stored ([`Model::load_weights`] with
    /// [`WeightValue::Quantized`]; a fused `gate_up_proj` from its stored `gate_proj` and
    /// `up_proj` stacked along N, which for NVFP4 must share one amax). Unquantized tensors are
    /// widened to f32 exactly.
    ///
    /// Quantized linears then run forward and the `dequantized` backward; their master values
    /// are the contract dequantization of the stored bytes.
    ///
    /// # Errors
    /// Everything [`mxrl_ckpt::load_quantized`] refuses (naming the file and tensor), a tensor
    /// the model lacks or does not have, fused parts that cannot be stacked (naming both), a
    /// shape or scheme the model cannot run.
    pub fn load_converted(dir: &Path) -> Result<Model> {
        let ck = load_quantized(dir).map_err(|e| ModelError::Checkpoint {
            dir: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        let config = ModelConfig::from_json(
            &ck.config.to_string(),
            &dir.join("config.json").display().to_string(),
        )?;
        let mut model = Model::zeros(&config)?;
        model.apply_plan(&ck.plan)?;
        let mut stored: HashMap<String, StoredWeight> = ck.tensors.into_iter().collect();
        let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
        let mut updates = Vec::with_capacity(names.len());
        for name in names {
            let parts = hf_names(&name);
            let v = fuse(dir, &name, &parts, &mut stored)?;
            updates.push((name, v));
        }
        if let Some(extra) = stored.keys().min() {
            return Err(ModelError::Checkpoint {
                dir: dir.to_path_buf(),
                message: format!("tensor `{extra}` is not a parameter of this model"),
            });
        }
        model.load_weights(updates)?;
        Ok(model)
    }
}
