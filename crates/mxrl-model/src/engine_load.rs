//! Building a device engine straight from a checkpoint directory, tensor by tensor.
//!
//! [`Engine::from_checkpoint`] reads `config.json` with the one HF config type, maps the shards
//! with the one safetensors reader ([`mxrl_ckpt::Checkpoint`]) and hands [`Engine::build`] one
//! parameter at a time, widened to f32 by the same function [`Model::load_hf`](crate::Model::load_hf) uses
//! (`hf::read_param`: HF names, gate/up parts fused row-wise). The host holds one parameter's
//! f32 values at a time, or one MoE layer's stacked experts — never the model. The weights are
//! the values [`Model::load_hf`](crate::Model::load_hf) would hold, so the engine equals
//! `Engine::from_model(&Model::load_hf(dir)?, ..)` bit for bit.
//!
//! An `mxrl convert` output (a directory with `mxrl.json`) is streamed the same way from its
//! stored tensors ([`mxrl_ckpt::load_quantized`]: compact stored bytes, the plan re-resolved from
//! the recipe it records): plain tensors widen to f32, a block-format linear's stored bytes are
//! installed as stored (each routed expert's `gate_proj` / `up_proj` stacked along N) with its
//! master the contract dequantization — the values and bytes [`Model::load_converted`](crate::Model::load_converted) holds,
//! so the engine equals `Engine::from_model_as_run(&Model::load_converted(dir)?, ..)` bit for
//! bit, without an f32 copy of the model on the host.

use crate::config::ModelConfig;
use crate::converted::fuse;
use crate::engine::group_name;
use crate::engine::Engine;
use crate::error::{ModelError, Result};
use crate::hf::{hf_names, read_param};
use crate::model::WeightValue;
use mxrl_ckpt::Checkpoint;
use mxrl_tensor::device::Backend;
use mxrl_tensor::qlinear::PreparedWeight;
use std::collections::BTreeSet;
use std::collections::HashMap;
use std::path::Path;

impl<B: Backend> Engine<B> {
    /// The engine of the checkpoint in `dir` on backend `b` (`max_pos`: the longest sequence
    /// it will run), and a one-line description of what runs and how it was read.
    ///
    /// A Hugging Face checkpoint (`config.json` plus `model.safetensors` or the shards of
    /// `model.safetensors.index.json`, BF16 / F16 / F32) is streamed: each tensor is widened
    /// to f32 for itself only and uploaded; linears run with BF16 operands. An `mxrl convert`
    /// output is streamed from its stored tensors, its block-format linears running on the
    /// stored bytes (see the module docs).
    ///
    /// # Errors
    /// Everything [`Model::load_hf`](crate::Model::load_hf) refuses, with the same messages: the config (naming the
    /// file and field), a checkpoint the reader refuses (naming the file), a missing tensor
    /// (naming it and the directory), a tensor of the wrong shape or an unsupported dtype
    /// (naming it and its file); a config the engine does not run; device failures. For a
    /// converted checkpoint, what [`Model::load_converted`](crate::Model::load_converted) refuses (naming the file and
    /// tensor), and a block-format router, lm_head or routed experts of mixed formats.
    pub fn from_checkpoint(dir: &Path, b: B, max_pos: usize) -> Result<(Self, String)> {
        if mxrl_ckpt::is_converted(dir) {
            return Self::from_converted(dir, b, max_pos);
        }
        // The config is validated before any weight file is opened, as in `Model::load_hf`.
        let cfg = ModelConfig::from_dir(dir)?;
        cfg.validate()?;
        let ck = Checkpoint::open(dir)?;
        let mut dtypes = BTreeSet::new();
        let e = Self::build(cfg, b, max_pos, |name, shape| {
            for part in crate::hf::hf_names(name) {
                if let Some(t) = ck.get(&part) {
                    dtypes.insert(t.dtype.to_string());
                }
            }
            read_param(&ck, dir, name, shape).map(std::borrow::Cow::Owned)
        })?;
        let dtypes: Vec<String> = dtypes.into_iter().collect();
        let shards = ck.shards().len();
        Ok((
            e,
            format!(
                "device engine: BF16 linears; {} weights read tensor by tensor from {shards} \
                 memory-mapped file{}",
                dtypes.join("/"),
                if shards == 1 { "" } else { "s" }
            ),
        ))
    }

    /// [`Engine::from_checkpoint`] of an `mxrl convert` output (module docs).
    fn from_converted(dir: &Path, b: B, max_pos: usize) -> Result<(Self, String)> {
        let ck = mxrl_ckpt::load_quantized(dir).map_err(|e| ModelError::Checkpoint {
            dir: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        let cfg = ModelConfig::from_json(
            &ck.config.to_string(),
            &dir.join("config.json").display().to_string(),
        )?;
        cfg.validate()?;
        let plan = ck.plan;
        let mut stored: HashMap<String, mxrl_ckpt::StoredWeight> = ck.tensors.into_iter().collect();
        // The stored tensors of block-format linears, by model parameter name.
        let mut quantized: HashMap<String, mxrl_formats::QuantizedTensor> = HashMap::new();
        let mut e = Self::build(cfg, b, max_pos, |name, shape| {
            let bad = |message: String| ModelError::BadTensor {
                name: name.to_string(),
                message,
            };
            let numel: usize = shape.iter().product();
            let values = match fuse(dir, name, &hf_names(name), &mut stored)? {
                WeightValue::Values(v) => v,
                WeightValue::Quantized(q) => {
                    if q.shape != shape {
                        return Err(bad(format!(
                            "stored shape {:?}, the model has {shape:?}",
                            q.shape
                        )));
                    }
                    let v = q.dequantize().map_err(|e| bad(e.to_string()))?;
                    quantized.insert(name.to_string(), q);
                    v
                }
            };
            if values.len() != numel {
                return Err(bad(format!(
                    "{} values for shape {shape:?} ({numel} expected)",
                    values.len()
                )));
            }
            Ok(std::borrow::Cow::Owned(values))
        })?;
        if let Some(extra) = stored.keys().min() {
            return Err(ModelError::Checkpoint {
                dir: dir.to_path_buf(),
                message: format!("tensor `{extra}` is not a parameter of this model"),
            });
        }
        let mut installed = 0usize;
        for (i, groups) in e.plan_linears() {
            let name = e.param_name(i).to_string();
            let mut pws = Vec::with_capacity(groups);
            for g in 0..groups {
                let gname = group_name(&name, g, groups);
                let q = quantized.remove(&gname);
                let spec = match crate::model::plan_precision(&plan, &gname)? {
                    crate::LinearPrecision::Quantized(s) => Some(s),
                    _ => None,
                };
                pws.push(match (q, spec) {
                    (Some(q), Some(spec)) => Some(
                        PreparedWeight::from_quantized(&gname, q, spec, 0, None).map_err(|e| {
                            ModelError::BadTensor {
                                name: gname.clone(),
                                message: e.to_string(),
                            }
                        })?,
                    ),
                    (None, None) => None,
                    (q, _) => {
                        return Err(ModelError::BadTensor {
                            name: gname,
                            message: format!(
                                "stored {} but the recorded plan runs it {}",
                                if q.is_some() {
                                    "quantized"
                                } else {
                                    "as values"
                                },
                                if q.is_some() {
                                    "in BF16"
                                } else {
                                    "in a block format"
                                }
                            ),
                        })
                    }
                });
            }
            installed += e.install_groups(i, pws)?;
        }
        if let Some(extra) = quantized.keys().min() {
            return Err(ModelError::BadTensor {
                name: extra.clone(),
                message: "stored in a block format, which the device engine runs only for \
                          attention, MLP and routed-expert linears"
                    .into(),
            });
        }
        let shards = mxrl_ckpt::Checkpoint::open(dir).map_or(1, |c| c.shards().len());
        let what = format!(
            "{}; converted checkpoint ({installed} stored block-format weights) read tensor by \
             tensor from {shards} file{}",
            e.describe(),
            if shards == 1 { "" } else { "s" }
        );
        Ok((e, what))
    }
}
