//! Resolution of a recipe against an inventory into a per-tensor [`PrecisionPlan`].

use crate::error::PlanError;
use crate::inventory::{Arch, Inventory, TensorInfo, TensorKind};
use crate::recipe::{ActivationScale, BackwardMode, Recipe, Rule};
use crate::role::{Proj, Role};
use mxrl_formats::Format;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Why an entry has its format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Rule `i` (0-based, in recipe order) matched first.
    Rule(usize),
    /// No rule matched; the recipe's `default` applies.
    Default,
    /// Not a GEMM weight (norm, bias, embedding, router bias): always BF16.
    Fixed,
}

/// The plan's decision for one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanEntry {
    /// The tensor.
    pub tensor: TensorInfo,
    /// Storage / forward format.
    pub format: Format,
    /// What decided it.
    pub decision: Decision,
    /// The deciding rule asked for another format the tensor cannot take, and its
    /// `fallback` applied.
    pub fell_back: bool,
    /// Backward mode of this tensor's GEMMs: the recipe's mode for quantized weights,
    /// `high_precision` (BF16 on the original operands) for everything kept in BF16.
    pub backward: BackwardMode,
    /// Bytes as stored by the plan (data + block scales + second-level scale; BF16 =
    /// 2 bytes per element).
    pub bytes: usize,
}

impl PlanEntry {
    /// The deciding rule's index, if a rule decided.
    pub fn rule(&self) -> Option<usize> {
        match self.decision {
            Decision::Rule(i) => Some(i),
            _ => None,
        }
    }
}

/// A pair of tensors that share one NVFP4 FP32 amax because they run as one fused GEMM:
/// an expert's (or dense / shared MLP's) gate and up projections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmaxGroup {
    /// HF name of the gate projection.
    pub gate: String,
    /// HF name of the up projection.
    pub up: String,
    /// Role of the pair.
    pub role: Role,
    /// Decoder layer.
    pub layer: Option<usize>,
    /// Routed expert index.
    pub expert: Option<usize>,
}

/// Per-rule resolution facts, for printing ("last 15% → layers 41-47, 7 of 48").
#[derive(Debug, Clone, PartialEq)]
pub struct RuleSummary {
    /// Rule index.
    pub index: usize,
    /// One-line description.
    pub description: String,
    /// The layers its `layers` selector resolved to.
    pub layers: Option<Vec<usize>>,
    /// Number of tensors it decided.
    pub decided: usize,
}

/// Byte and tensor totals of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Totals {
    /// Bytes per format.
    pub bytes: BTreeMap<Format, usize>,
    /// Tensor count per format.
    pub count: BTreeMap<Format, usize>,
    /// All bytes of the plan.
    pub plan_bytes: usize,
    /// Bytes of the same model entirely in BF16.
    pub bf16_bytes: usize,
}

impl Totals {
    /// `bf16_bytes / plan_bytes`.
    pub fn compression(&self) -> f64 {
        self.bf16_bytes as f64 / self.plan_bytes.max(1) as f64
    }
}

/// One decision per tensor: the single source every stage (conversion, training,
/// rollout, weight sync) reads its precision from.
#[derive(Debug, Clone)]
pub struct PrecisionPlan {
    recipe: Recipe,
    arch: Arch,
    num_layers: usize,
    entries: Vec<PlanEntry>,
    by_hf: HashMap<String, usize>,
    by_mxrl: HashMap<String, usize>,
    rules: Vec<RuleSummary>,
    hash: String,
}

/// Version tag of the plan hash input; bump when its canonical form changes.
const PLAN_HASH_VERSION: &str = "mxrl-plan/1";

/// Safetensors metadata key under which checkpoints and weight-update messages carry
/// [`PrecisionPlan::hash`]; `mxrl_ckpt::audit_dir` checks it when present.
pub const META_PLAN_HASH: &str = "mxrl.plan_hash";

fn rule_matches(rule: &Rule, layers: &Option<HashSet<usize>>, t: &TensorInfo) -> bool {
    if let Some(set) = layers {
        match t.layer {
            Some(l) if set.contains(&l) => {}
            _ => return false,
        }
    }
    if rule.role.is_some_and(|r| r != t.role) {
        return false;
    }
    if rule.proj.is_some_and(|p| t.proj != Some(p)) {
        return false;
    }
    if rule.name.as_ref().is_some_and(|g| !g.matches(&t.mxrl)) {
        return false;
    }
    if rule.hf.as_ref().is_some_and(|g| !g.matches(&t.hf)) {
        return false;
    }
    true
}

/// Why `t` cannot be stored as `format`, if it cannot.
pub fn format_constraint(t: &TensorInfo, format: Format) -> Option<String> {
    let block = format.k_block()?;
    let Some((_, k)) = t.linear_dims() else {
        return Some(format!("{format} needs a 2-D GEMM weight"));
    };
    (k % block != 0).then(|| format!("{format} needs K % {block} == 0 but K = {k}"))
}

/// Stored bytes of one tensor in a format.
pub fn entry_bytes(t: &TensorInfo, format: Format) -> usize {
    match t.linear_dims() {
        Some((n, k)) => format.stored_bytes(n, k),
        None => t.numel() * 2,
    }
}

/// Resolve a recipe against an inventory: the first matching rule decides each GEMM
/// weight, the recipe default decides the rest, and every non-GEMM tensor stays BF16.
/// Errors: a layer selection that does not fit the model, a tensor that cannot take its
/// format (without `fallback`), and fused GEMM partners (gate/up, q/k/v) with different
/// formats.
pub fn resolve(inv: &Inventory, recipe: &Recipe) -> Result<PrecisionPlan, PlanError> {
    let n_layers = inv.num_layers();
    let mut layer_sets = Vec::with_capacity(recipe.rules.len());
    let mut rules = Vec::with_capacity(recipe.rules.len());
    for (i, r) in recipe.rules.iter().enumerate() {
        let resolved = r
            .layers
            .as_ref()
            .map(|l| l.resolve(n_layers))
            .transpose()
            .map_err(|source| PlanError::Layers { rule: i, source })?;
        layer_sets.push(
            resolved
                .as_ref()
                .map(|v| v.iter().copied().collect::<HashSet<_>>()),
        );
        rules.push(RuleSummary {
            index: i,
            description: r.describe(),
            layers: resolved,
            decided: 0,
        });
    }
    let mut entries = Vec::with_capacity(inv.tensors().len());
    for t in inv.tensors() {
        let (mut format, decision, fallback) = if t.kind != TensorKind::Linear {
            (Format::Bf16, Decision::Fixed, None)
        } else {
            match recipe
                .rules
                .iter()
                .enumerate()
                .find(|(i, r)| rule_matches(r, &layer_sets[*i], t))
            {
                Some((i, r)) => (r.format, Decision::Rule(i), r.fallback),
                None => (recipe.default, Decision::Default, None),
            }
        };
        let mut fell_back = false;
        if let Some(reason) = format_constraint(t, format) {
            match fallback {
                Some(fb) => {
                    format = fb;
                    fell_back = true;
                }
                None => {
                    return Err(PlanError::FormatConstraint {
                        tensor: t.hf.clone(),
                        shape: t.shape.clone(),
                        format,
                        by: match decision {
                            Decision::Rule(i) => format!("rule {i}"),
                            _ => "recipe default".to_string(),
                        },
                        reason,
                    })
                }
            }
        }
        if let Decision::Rule(i) = decision {
            rules[i].decided += 1;
        }
        let backward = if format == Format::Bf16 {
            BackwardMode::HighPrecision
        } else {
            recipe.backward
        };
        entries.push(PlanEntry {
            bytes: entry_bytes(t, format),
            tensor: t.clone(),
            format,
            decision,
            fell_back,
            backward,
        });
    }
    check_fused(&entries)?;
    let by_hf = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.tensor.hf.clone(), i))
        .collect();
    let by_mxrl = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.tensor.mxrl.clone(), i))
        .collect();
    let hash = plan_hash(recipe, &entries);
    Ok(PrecisionPlan {
        recipe: recipe.clone(),
        arch: inv.arch(),
        num_layers: n_layers,
        entries,
        by_hf,
        by_mxrl,
        rules,
        hash,
    })
}

/// Groups of linear weights that serving engines and Megatron run as one fused GEMM:
/// q/k/v of one (non-MLA) attention, gate/up of one MLP. Returned as entry indices.
pub(crate) fn fused_groups(entries: &[PlanEntry]) -> Vec<Vec<usize>> {
    let mut groups: BTreeMap<(String, u8), Vec<usize>> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        let t = &e.tensor;
        if t.kind != TensorKind::Linear {
            continue;
        }
        let class = match (t.role, t.proj) {
            (_, Some(Proj::Gate | Proj::Up)) => 1,
            (Role::AttnQ | Role::AttnK | Role::AttnV, _) => 2,
            _ => continue,
        };
        groups
            .entry((t.mxrl_parent().to_string(), class))
            .or_default()
            .push(i);
    }
    groups.into_values().filter(|g| g.len() > 1).collect()
}

fn check_fused(entries: &[PlanEntry]) -> Result<(), PlanError> {
    for g in fused_groups(entries) {
        let f0 = entries[g[0]].format;
        if g.iter().any(|&i| entries[i].format != f0) {
            return Err(PlanError::FusedMismatch {
                tensors: g.iter().map(|&i| entries[i].tensor.hf.clone()).collect(),
                formats: g.iter().map(|&i| entries[i].format).collect(),
            });
        }
    }
    Ok(())
}

fn plan_hash(recipe: &Recipe, entries: &[PlanEntry]) -> String {
    let mut h = Sha256::new();
    h.update(format!(
        "{PLAN_HASH_VERSION}\nquant_contract={}\nbackward={}\nnvfp4_activation_scale={}\n",
        mxrl_formats::contract_hash(),
        recipe.backward.name(),
        recipe.nvfp4_activation_scale.name()
    ));
    for e in entries {
        let shape: Vec<String> = e.tensor.shape.iter().map(|d| d.to_string()).collect();
        h.update(format!(
            "{}\t{}\t{}\t{}\t{}\n",
            e.tensor.hf,
            e.tensor.mxrl,
            shape.join("x"),
            e.format,
            e.backward.name()
        ));
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl PrecisionPlan {
    /// Entries in checkpoint order.
    pub fn entries(&self) -> &[PlanEntry] {
        &self.entries
    }

    /// The entry of a Hugging Face tensor name.
    pub fn by_hf(&self, name: &str) -> Option<&PlanEntry> {
        self.by_hf.get(name).map(|&i| &self.entries[i])
    }

    /// The entry of a canonical mxrl name.
    pub fn by_mxrl(&self, name: &str) -> Option<&PlanEntry> {
        self.by_mxrl.get(name).map(|&i| &self.entries[i])
    }

    /// Hex SHA-256 of the plan's decisions (tensor names, shapes, formats, backward
    /// modes, NVFP4 activation scale) and of the quantizer contract
    /// ([`mxrl_formats::contract_hash`]) the formats are produced by. Independent of how
    /// the recipe was written: two recipes that decide the same thing hash the same.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The first 16 hex digits of [`PrecisionPlan::hash`].
    pub fn short_hash(&self) -> &str {
        &self.hash[..16]
    }

    /// The quantizer contract hash bound into [`PrecisionPlan::hash`].
    pub fn quant_contract(&self) -> &'static str {
        mxrl_formats::contract_hash()
    }

    /// The recipe the plan was resolved from.
    pub fn recipe(&self) -> &Recipe {
        &self.recipe
    }

    /// The recipe's backward mode (applies to every quantized weight).
    pub fn backward(&self) -> BackwardMode {
        self.recipe.backward
    }

    /// The recipe's NVFP4 activation-scale scope.
    pub fn nvfp4_activation_scale(&self) -> ActivationScale {
        self.recipe.nvfp4_activation_scale
    }

    /// Architecture of the model.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Per-rule facts (resolved layers, number of tensors decided).
    pub fn rule_summaries(&self) -> &[RuleSummary] {
        &self.rules
    }

    /// NVFP4 gate/up pairs that must share one FP32 amax (both members NVFP4; the plan
    /// guarantees fused partners share a format).
    pub fn nvfp4_amax_groups(&self) -> Vec<AmaxGroup> {
        let mut out = Vec::new();
        for g in fused_groups(&self.entries) {
            let es: Vec<&PlanEntry> = g.iter().map(|&i| &self.entries[i]).collect();
            if es[0].format != Format::Nvfp4 {
                continue;
            }
            let gate = es.iter().find(|e| e.tensor.proj == Some(Proj::Gate));
            let up = es.iter().find(|e| e.tensor.proj == Some(Proj::Up));
            if let (Some(g), Some(u)) = (gate, up) {
                out.push(AmaxGroup {
                    gate: g.tensor.hf.clone(),
                    up: u.tensor.hf.clone(),
                    role: g.tensor.role,
                    layer: g.tensor.layer,
                    expert: g.tensor.expert,
                });
            }
        }
        out.sort_by_key(|a| self.by_hf[&a.gate]);
        out
    }

    /// Byte and count totals.
    pub fn totals(&self) -> Totals {
        let mut bytes = BTreeMap::new();
        let mut count = BTreeMap::new();
        let mut bf16_bytes = 0;
        for e in &self.entries {
            *bytes.entry(e.format).or_insert(0) += e.bytes;
            *count.entry(e.format).or_insert(0) += 1;
            bf16_bytes += e.tensor.numel() * 2;
        }
        Totals {
            plan_bytes: bytes.values().sum(),
            bytes,
            count,
            bf16_bytes,
        }
    }

    /// The plan as JSON: `{"contract", "recipe", "tensors": [...], "totals"}`, one tensor
    /// entry per HF tensor in checkpoint order.
    pub fn to_json(&self) -> Value {
        let tensors: Vec<Value> = self
            .entries
            .iter()
            .map(|e| {
                let t = &e.tensor;
                json!({
                    "hf": t.hf,
                    "mxrl": t.mxrl,
                    "role": t.role,
                    "layer": t.layer,
                    "expert": t.expert,
                    "shape": t.shape,
                    "format": e.format,
                    "rule": e.rule(),
                    "backward": e.backward,
                    "bytes": e.bytes,
                })
            })
            .collect();
        let tot = self.totals();
        let per_fmt = |m: &BTreeMap<Format, usize>| -> Value {
            Value::Object(
                m.iter()
                    .map(|(f, n)| (f.name().to_string(), json!(n)))
                    .collect(),
            )
        };
        let rules: Vec<Value> = self
            .rules
            .iter()
            .map(|r| {
                json!({
                    "index": r.index,
                    "rule": r.description,
                    "layers": r.layers,
                    "decided": r.decided,
                })
            })
            .collect();
        json!({
            "contract": self.hash,
            "quant_contract": self.quant_contract(),
            "recipe": self.recipe.file(),
            "rules": rules,
            "arch": self.arch,
            "num_layers": self.num_layers,
            "tensors": tensors,
            "totals": {
                "bytes": per_fmt(&tot.bytes),
                "tensors": per_fmt(&tot.count),
                "plan_bytes": tot.plan_bytes,
                "bf16_bytes": tot.bf16_bytes,
                "compression_vs_bf16": tot.compression(),
            },
        })
    }
}
