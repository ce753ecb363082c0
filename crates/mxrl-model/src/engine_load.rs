//! Building a device engine straight from a checkpoint directory, tensor by tensor.
//!
//! [`Engine::from_checkpoint`] reads `config.json` with the one HF config type, maps the shards
//! with the one safetensors reader ([`mxrl_ckpt::Checkpoint`]) and hands [`Engine::build`] one
//! parameter at a time, widened to f32 by the same function [`Model::load_hf`] uses
//! (`hf::read_param`: HF names, gate/up parts fused row-wise). The host holds one parameter's
//! f32 values at a time, or one MoE layer's stacked experts — never the model. The weights are
//! the values [`Model::load_hf`] would hold, so the engine equals
//! `Engine::from_model(&Model::load_hf(dir)?, ..)` bit for bit.
//!
//! An `mxrl convert` output (a directory with `mxrl.json`) is read through
//! [`Model::load_converted`] and [`Engine::from_model_as_run`] instead: its block-format
//! weights are decoded and checked against the recorded plan as one model; the description
//! says so.

use crate::config::ModelConfig;
use crate::engine::Engine;
use crate::error::Result;
use crate::hf::read_param;
use crate::model::Model;
use mxrl_ckpt::Checkpoint;
use mxrl_tensor::device::Backend;
use std::collections::BTreeSet;
use std::path::Path;

impl<B: Backend> Engine<B> {
    /// The engine of the checkpoint in `dir` on backend `b` (`max_pos`: the longest sequence
    /// it will run), and a one-line description of what runs and how it was read.
    ///
    /// A Hugging Face checkpoint (`config.json` plus `model.safetensors` or the shards of
    /// `model.safetensors.index.json`, BF16 / F16 / F32) is streamed: each tensor is widened
    /// to f32 for itself only and uploaded; linears run with BF16 operands. An `mxrl convert`
    /// output goes through the host model (see the module docs).
    ///
    /// # Errors
    /// Everything [`Model::load_hf`] refuses, with the same messages: the config (naming the
    /// file and field), a checkpoint the reader refuses (naming the file), a missing tensor
    /// (naming it and the directory), a tensor of the wrong shape or an unsupported dtype
    /// (naming it and its file); a config the engine does not run; device failures. For a
    /// converted checkpoint, [`Model::load_converted`]'s and
    /// [`Engine::from_model_as_run`]'s errors.
    pub fn from_checkpoint(dir: &Path, b: B, max_pos: usize) -> Result<(Self, String)> {
        if mxrl_ckpt::is_converted(dir) {
            let model = Model::load_converted(dir)?;
            let (e, what) = Self::from_model_as_run(&model, b, max_pos)?;
            return Ok((
                e,
                format!(
                    "{what}; converted checkpoint read through the host model (its stored \
                     block formats are decoded and checked as one model)"
                ),
            ));
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
            read_param(&ck, dir, name, shape)
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
}
