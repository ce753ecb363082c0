//! The precision plan's view of a checkpoint directory, read through the one strict reader
//! ([`Checkpoint`]): stored tensors grouped into logical tensors, the model inventory
//! (config + stored tensors) and the plan audit.

use crate::container::{groups, Detected, Layout};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::reader::{Checkpoint, TensorView, CONFIG_FILE};
use mxrl_plan::{
    audit, resolve, AuditReport, HfConfig, Inventory, PrecisionPlan, Recipe, StoredFormat,
    StoredTensor, META_PLAN_HASH,
};
use std::collections::HashMap;
use std::path::Path;

/// The plan audit's name of a serving layout.
fn stored_format(layout: Layout) -> StoredFormat {
    match layout {
        Layout::Mxfp8 => StoredFormat::Mxfp8,
        Layout::Nvfp4ModelOpt => StoredFormat::Nvfp4ModelOpt,
        Layout::Nvfp4CompressedTensors => StoredFormat::Nvfp4CompressedTensors,
        Layout::Fp8Block => StoredFormat::Fp8Block,
    }
}

impl Checkpoint {
    /// The stored tensors grouped into logical tensors (a weight with its scale companions,
    /// the format detected by its serving layout ([`crate::container::Group::detect`]), packed
    /// NVFP4 unpacked to its logical shape), in checkpoint order (shard, offset). Only the
    /// headers are read.
    pub fn stored_tensors(&self) -> Vec<StoredTensor> {
        let mut order: HashMap<&str, (usize, usize)> = HashMap::with_capacity(self.len());
        let mut views = Vec::with_capacity(self.len());
        for (fi, s) in self.shards().iter().enumerate() {
            for t in &s.header().tensors {
                order.insert(&t.name, (fi, t.begin));
                views.push(TensorView {
                    name: &t.name,
                    dtype: t.dtype,
                    shape: &t.shape,
                    data: s.data(t),
                    file: s.file_name(),
                });
            }
        }
        let (grouped, singles) = groups(views);
        let mut out = Vec::with_capacity(grouped.len() + singles.len());
        for t in singles {
            let format = if matches!(t.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32) {
                StoredFormat::Unquantized
            } else {
                StoredFormat::Unrecognized(format!("{} tensor without a weight", t.dtype))
            };
            out.push(StoredTensor {
                name: t.name.to_string(),
                format,
                dtype: t.dtype.name().to_string(),
                logical_shape: t.shape.to_vec(),
                parts: vec![t.name.to_string()],
                order: order[t.name],
            });
        }
        for g in grouped {
            let main = g.main();
            let as_stored = || (main.dtype.name().to_string(), main.shape.to_vec());
            let (format, (dtype, logical_shape)) = match g.detect() {
                Ok(Detected::Unquantized) => (StoredFormat::Unquantized, as_stored()),
                Ok(Detected::Quantized(layout)) => {
                    let [n, k] = layout
                        .validate(&g.weight_name(), &|p| {
                            Ok(layout.suffix(p).and_then(|s| g.parts.get(s)).copied())
                        })
                        .expect("detect validated the group");
                    (stored_format(layout), ("BF16".to_string(), vec![n, k]))
                }
                Err(e) => (StoredFormat::Unrecognized(e.to_string()), as_stored()),
            };
            out.push(StoredTensor {
                name: g.weight_name(),
                format,
                dtype,
                logical_shape,
                parts: g.parts.values().map(|t| t.name.to_string()).collect(),
                order: g
                    .parts
                    .values()
                    .map(|t| order[t.name])
                    .min()
                    .expect("a group has at least one member"),
            });
        }
        out.sort_by_key(|t| t.order);
        out
    }

    /// The model inventory: `config.json` (validated, [`HfConfig`]) gives the architecture,
    /// the stored tensors their shapes, dtypes and checkpoint order. Tensors the architecture
    /// does not have and missing ones are errors listing all of them (an absent MTP module as
    /// a whole is allowed).
    pub fn model_inventory(&self) -> Result<Inventory> {
        let cfg_path = self.dir().join(CONFIG_FILE);
        let cfg = HfConfig::from_path(&cfg_path)?;
        let expected = Inventory::from_config(&cfg, &cfg_path.display().to_string());
        Ok(expected.reconcile(self.dir(), &self.stored_tensors())?)
    }
}

/// The inventory of a Hugging Face model directory ([`Checkpoint::model_inventory`]); the
/// config is validated before any weight file is opened.
pub fn model_inventory(dir: &Path) -> Result<Inventory> {
    HfConfig::from_path(&dir.join(CONFIG_FILE))?;
    Checkpoint::open(dir)?.model_inventory()
}

/// Audits a checkpoint directory against `recipe`: the inventory comes from its
/// `config.json`, the plan from resolving `recipe` against it, the stored formats from its
/// safetensors headers. A shard whose metadata records another plan hash (`mxrl.plan_hash`)
/// is drift too.
pub fn audit_dir(dir: &Path, recipe: &Recipe) -> Result<(PrecisionPlan, AuditReport)> {
    let cfg_path = dir.join(CONFIG_FILE);
    let cfg = HfConfig::from_path(&cfg_path)?;
    let inv = Inventory::from_config(&cfg, &cfg_path.display().to_string());
    let plan = resolve(&inv, recipe)?;
    let ck = Checkpoint::open(dir)?;
    let mut report = audit(&plan, &ck.stored_tensors());
    for s in ck.shards() {
        if let Some(h) = s.header().metadata.get(META_PLAN_HASH) {
            if h != plan.hash() {
                report
                    .hash_mismatches
                    .push((s.path().display().to_string(), h.clone()));
            }
        }
    }
    Ok((plan, report))
}
