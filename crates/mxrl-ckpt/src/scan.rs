//! The precision plan's view of a checkpoint directory, read through the one strict reader
//! ([`Checkpoint`]): stored tensors grouped into logical tensors, the model inventory
//! (config + stored tensors) and the plan audit.

use crate::error::Result;
use crate::reader::{Checkpoint, CONFIG_FILE};
use mxrl_plan::{
    audit, group, resolve, AuditReport, HeaderEntry, HfConfig, Inventory, PrecisionPlan, Recipe,
    StoredTensor, META_PLAN_HASH,
};
use std::path::Path;

impl Checkpoint {
    /// The stored tensors grouped into logical tensors (a weight with its scale companions,
    /// packed NVFP4 unpacked to its logical shape), in checkpoint order (shard, offset).
    pub fn stored_tensors(&self) -> Vec<StoredTensor> {
        let mut entries = Vec::with_capacity(self.len());
        for (fi, s) in self.shards().iter().enumerate() {
            for t in &s.header().tensors {
                entries.push((
                    fi,
                    HeaderEntry {
                        name: t.name.clone(),
                        dtype: t.dtype.name().to_string(),
                        shape: t.shape.clone(),
                        offset: t.begin,
                    },
                ));
            }
        }
        group(entries)
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
