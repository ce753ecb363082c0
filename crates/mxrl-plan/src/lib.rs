//! mxrl-plan: one precision declaration, resolved per tensor, read by every stage.
//!
//! Low-precision RL keeps some tensors in BF16 (the last layers, shared experts, MLA
//! `kv_b`, router, embeddings, lm_head, norms) and the *same* decision must hold in
//! checkpoint conversion, training, rollout and live weight export. This crate turns a
//! [`Recipe`] (TOML, or a built-in preset) and a model [`Inventory`] into a
//! [`PrecisionPlan`]: one [`PlanEntry`] per checkpoint tensor with its format, the rule
//! that decided it and its backward mode, plus a stable hash. Everything else —
//! converter, model, RL loop — takes its per-tensor decisions from the plan only.
//!
//! ```no_run
//! use mxrl_plan::{resolve, Inventory, Recipe};
//! let inv = Inventory::from_config_path("Qwen3-30B-A3B/config.json".as_ref())?;
//! let plan = resolve(&inv, &Recipe::load("nvfp4-hp")?)?;
//! let e = plan.by_hf("model.layers.0.mlp.experts.0.up_proj.weight").unwrap();
//! println!("{} {} {}", e.format, e.backward, plan.short_hash());
//! # Ok::<(), mxrl_plan::PlanError>(())
//! ```
//!
//! Design decisions:
//! - **Typed selection, never substrings.** Rules select by layer range, [`Role`],
//!   [`Proj`] and dot-segment [`Glob`]s; `mlp.gate` can never match `mlp.gate_up_proj`.
//! - **Only GEMM weights are quantized.** Norms, biases, embedding tables and router
//!   biases are BF16 whatever the recipe says ([`Decision::Fixed`]).
//! - **Fused partners agree.** Gate/up of one MLP and q/k/v of one attention run as one
//!   fused GEMM in serving engines and Megatron; a plan that splits them is an error.
//!   NVFP4 gate/up pairs share one FP32 amax ([`PrecisionPlan::nvfp4_amax_groups`]).
//! - **Foreign syntaxes are derived and checked.** [`export()`] writes Miles flags, a
//!   Megatron TE precision YAML or a ModelOpt/SGLang ignore list, re-resolves it under
//!   that tool's matching semantics and reports every tensor whose format would differ.
//! - **Checkpoints are audited.** [`audit()`] compares what a checkpoint stores (from
//!   safetensors headers, read by `mxrl-ckpt`'s one strict reader) against the plan.
//! - **One config type.** [`HfConfig`] parses and validates every `config.json` (transformers
//!   4.x and 5.x spellings) for the inventory, the converter and the model alike.
#![deny(missing_docs)]

mod audit;
mod clients;
mod config;
mod error;
mod export;
mod glob;
mod inventory;
mod layers;
mod names;
mod plan;
mod recipe;
mod report;
mod role;
mod stored;

pub use audit::{audit, AuditFinding, AuditReport};
pub use clients::{check_list, client_decisions, client_list, Client, ClientDiff, ListKind};
pub use config::{HfConfig, Limits, MlaConfig, MoeConfig, MoeLayers, MAX_CONFIG_BYTES};
pub use error::PlanError;
pub use export::{
    export, fnmatch, resolve_ignore_list, resolve_miles, resolve_te_matchers, Export, ExportDiff,
    ExportKind, MilesFlags,
};
pub use glob::{Glob, GlobError};
pub use inventory::{config_path, count_by_role, Arch, Inventory, TensorInfo, TensorKind};
pub use layers::{format_ranges, LayerSpec, LayerSpecError};
pub use mxrl_formats::Format;
pub use names::{megatron_name, sglang_module, FusedPart, MegatronMap, MegatronName};
pub use plan::{
    entry_bytes, format_constraint, resolve, AmaxGroup, Decision, PlanEntry, PrecisionPlan,
    RuleSummary, Totals, META_PLAN_HASH,
};
pub use recipe::{
    preset_toml, ActivationScale, BackwardMode, Recipe, RecipeFile, Rule, RuleFile, ALL_PRESETS,
    EXTRA_PRESETS, PRESETS,
};
pub use report::summary_table;
pub use role::{Proj, Role, UnknownName};
pub use stored::{StoredFormat, StoredTensor};
