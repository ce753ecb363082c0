//! Exports of a plan into the syntaxes other stacks use, each checked by re-resolving
//! it under that stack's matching semantics (as modelled here) against the inventory.
//!
//! | kind | syntax | semantics used for the check |
//! |---|---|---|
//! | `miles` | `--num-layers-at-{start,end}-in-bf16`, `--extra-high-precision-layers-{hf,megatron}` | layer counts; **substring** match on HF names (conversion/rollout view) and on Megatron parameter names (training view); quantizes linear weights except router, lm_head and shared-expert gate (`nvfp4`: routed experts only) |
//! | `te-yaml` | Megatron TE precision YAML: `configs` + ordered glob `matchers` | first matching enabled matcher decides a Megatron module; `*` matches any run of characters including dots (Python `fnmatch`); router, output layer and shared-expert gate are not TE modules and stay BF16; fused modules (`linear_qkv`, `linear_fc1`, grouped experts) take one format |
//! | `ignore` | ModelOpt `exclude_modules` (explicit module names, fused engine names included; `clients` module) | every ModelOpt client's own rule (`fnmatch`, vLLM's exact/substring/`fnmatch`, SGLang's full match with packed shards) must quantize exactly the plan's quantized linears |
//!
//! The quantized format of a foreign export is the plan's most common non-BF16 format
//! (those syntaxes have one); tensors the plan gives another format show up as
//! differences.

use crate::inventory::{Inventory, TensorInfo, TensorKind};
use crate::names::megatron_name;
use crate::plan::PrecisionPlan;
use crate::recipe::{ActivationScale, BackwardMode};
use crate::role::Role;
use mxrl_formats::Format;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;
use std::str::FromStr;

/// Which foreign syntax to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    /// Miles / Megatron command-line flags (and the environment the recipe needs).
    Miles,
    /// Megatron TransformerEngine precision YAML.
    TeYaml,
    /// ModelOpt / SGLang `exclude_modules` list (JSON).
    Ignore,
}

impl FromStr for ExportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "miles" => Ok(ExportKind::Miles),
            "te-yaml" => Ok(ExportKind::TeYaml),
            "ignore" => Ok(ExportKind::Ignore),
            other => Err(format!(
                "unknown export `{other}` (expected miles, te-yaml, ignore)"
            )),
        }
    }
}

/// A tensor whose format under the exported syntax differs from the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDiff {
    /// HF tensor name.
    pub hf: String,
    /// Which consumer's view (`hf`, `megatron`, `modelopt`, `te`).
    pub view: &'static str,
    /// The plan's format.
    pub planned: Format,
    /// The format the export yields.
    pub exported: Format,
}

/// An export and its check.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    /// Which syntax.
    pub kind: ExportKind,
    /// The exported text.
    pub text: String,
    /// Every tensor whose re-resolved format differs from the plan (empty: exact).
    pub diffs: Vec<ExportDiff>,
}

impl Export {
    /// Whether the foreign syntax expresses the plan exactly.
    pub fn is_exact(&self) -> bool {
        self.diffs.is_empty()
    }

    /// A readable check report.
    pub fn render_diffs(&self) -> String {
        let mut s = String::new();
        if self.diffs.is_empty() {
            let _ = writeln!(
                s,
                "check: re-resolving the export reproduces the plan exactly"
            );
            return s;
        }
        let _ = writeln!(
            s,
            "check: the export cannot express the plan exactly; {} tensor decision(s) differ:",
            self.diffs.len()
        );
        for d in &self.diffs {
            let _ = writeln!(
                s,
                "  [{}] {}: plan {}, export {}",
                d.view, d.hf, d.planned, d.exported
            );
        }
        s
    }
}

/// Python-`fnmatch`-style full match: `*` any run (dots included), `?` one character.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    crate::glob::match_one_segment(pattern.as_bytes(), name.as_bytes())
}

/// HF module name of a tensor (its name without `.weight`).
fn hf_module(t: &TensorInfo) -> &str {
    t.hf.strip_suffix(".weight").unwrap_or(&t.hf)
}

/// The plan's most common quantized format (what a one-format syntax can say).
fn main_quant_format(plan: &PrecisionPlan) -> Option<Format> {
    let mut count: BTreeMap<Format, usize> = BTreeMap::new();
    for e in plan.entries() {
        if e.format != Format::Bf16 {
            *count.entry(e.format).or_insert(0) += 1;
        }
    }
    count.into_iter().max_by_key(|(_, n)| *n).map(|(f, _)| f)
}

fn diffs(plan: &PrecisionPlan, view: &'static str, got: &[Format]) -> Vec<ExportDiff> {
    plan.entries()
        .iter()
        .zip(got)
        .filter(|(e, g)| e.format != **g)
        .map(|(e, g)| ExportDiff {
            hf: e.tensor.hf.clone(),
            view,
            planned: e.format,
            exported: *g,
        })
        .collect()
}

/// Replace layer and expert indices of a dotted name with `*`.
fn generic(name: &str) -> String {
    let segs: Vec<&str> = name.split('.').collect();
    let mut out = Vec::with_capacity(segs.len());
    for (i, s) in segs.iter().enumerate() {
        let after_index_holder = i > 0 && matches!(segs[i - 1], "layers" | "experts");
        if after_index_holder && s.bytes().all(|b| b.is_ascii_digit()) {
            out.push("*");
        } else {
            out.push(s);
        }
    }
    out.join(".")
}

// ---------------------------------------------------------------------------------------
// ModelOpt / SGLang ignore list

/// Re-resolve an `exclude_modules` list: each linear weight is BF16 iff its HF module
/// name fully matches a pattern (`fnmatch`), else `quant`. Non-linear tensors are BF16.
pub fn resolve_ignore_list(inv: &Inventory, patterns: &[String], quant: Format) -> Vec<Format> {
    inv.tensors()
        .iter()
        .map(|t| {
            if t.kind != TensorKind::Linear || patterns.iter().any(|p| fnmatch(p, hf_module(t))) {
                Format::Bf16
            } else {
                quant
            }
        })
        .collect()
}

fn export_ignore(plan: &PrecisionPlan, inv: &Inventory) -> Export {
    let quant = main_quant_format(plan).unwrap_or(Format::Bf16);
    let kind = crate::clients::ListKind::ModelOptExclude;
    // A plan the engines cannot serve (a fused module in mixed formats) still gets a list:
    // its BF16 linears by name; the check then shows what each client makes of it.
    let list = crate::clients::client_list(plan, inv, kind).unwrap_or_else(|_| {
        inv.tensors()
            .iter()
            .zip(plan.entries())
            .filter(|(t, e)| t.kind == TensorKind::Linear && e.format == Format::Bf16)
            .map(|(t, _)| hf_module(t).to_string())
            .collect()
    });
    let mut d: Vec<ExportDiff> = crate::clients::check_list(plan, inv, kind, &list)
        .into_iter()
        .map(|c| ExportDiff {
            hf: c.hf,
            view: c.client.name(),
            planned: c.planned,
            exported: match c.client_quantizes {
                Ok(true) => quant,
                Ok(false) => Format::Bf16,
                // The client refuses the checkpoint: the planned format is not served.
                Err(_) if c.planned == Format::Bf16 => quant,
                Err(_) => Format::Bf16,
            },
        })
        .collect();
    // Tensors of another quantized format than the one the syntax can name.
    d.extend(
        plan.entries()
            .iter()
            .filter(|e| e.format != Format::Bf16 && e.format != quant)
            .map(|e| ExportDiff {
                hf: e.tensor.hf.clone(),
                view: "modelopt",
                planned: e.format,
                exported: quant,
            }),
    );
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "quant_algo": quant_algo(quant),
        "exclude_modules": list,
    }))
    .expect("JSON of strings")
        + "\n";
    Export {
        kind: ExportKind::Ignore,
        text,
        diffs: d,
    }
}

fn quant_algo(f: Format) -> &'static str {
    match f {
        Format::Bf16 => "NONE",
        Format::Mxfp8 => "MXFP8",
        Format::Nvfp4 => "NVFP4",
        Format::Fp8Block => "FP8_BLOCK",
    }
}

// ---------------------------------------------------------------------------------------
// Megatron TE precision YAML

/// Whether Megatron runs this tensor through a TransformerEngine linear module (router,
/// output layer and the shared-expert gate are plain parameters, always BF16 there).
fn te_scope(t: &TensorInfo) -> bool {
    t.kind == TensorKind::Linear
        && !matches!(t.role, Role::Router | Role::LmHead | Role::SharedExpertGate)
        && !t.mxrl.ends_with(".head")
}

/// Re-resolve TE matchers `(pattern, format)` in order against Megatron module names.
/// Unmatched in-scope modules take `default`.
pub fn resolve_te_matchers(
    inv: &Inventory,
    matchers: &[(String, Format)],
    default: Format,
) -> Vec<Format> {
    inv.tensors()
        .iter()
        .map(|t| {
            if !te_scope(t) {
                return Format::Bf16;
            }
            let Some(m) = megatron_name(inv, t) else {
                return Format::Bf16;
            };
            matchers
                .iter()
                .find(|(p, _)| fnmatch(p, m.module()))
                .map(|(_, f)| *f)
                .unwrap_or(default)
        })
        .collect()
}

fn te_config(f: Format) -> &'static str {
    match f {
        Format::Bf16 => "{}",
        Format::Mxfp8 => "{fp8_format: \"e4m3\", fp8_recipe: \"mxfp8\"}",
        Format::Nvfp4 => "{fp4_format: \"e2m1\", fp4_recipe: \"nvfp4\"}",
        Format::Fp8Block => "{fp8_format: \"e4m3\", fp8_recipe: \"blockwise\"}",
    }
}

fn export_te_yaml(plan: &PrecisionPlan, inv: &Inventory) -> Export {
    let default = main_quant_format(plan).unwrap_or(Format::Bf16);
    // Megatron module -> member entry indices (in scope only).
    let mut modules: Vec<(String, Vec<usize>)> = Vec::new();
    let mut pos: HashMap<String, usize> = HashMap::new();
    for (i, t) in inv.tensors().iter().enumerate() {
        if !te_scope(t) {
            continue;
        }
        let Some(m) = megatron_name(inv, t) else {
            continue;
        };
        let key = m.module().to_string();
        let p = *pos.entry(key.clone()).or_insert_with(|| {
            modules.push((key, Vec::new()));
            modules.len() - 1
        });
        modules[p].1.push(i);
    }
    let fmt_of = |m: &(String, Vec<usize>)| plan.entries()[m.1[0]].format;
    let layer_of = |m: &(String, Vec<usize>)| inv.tensors()[m.1[0]].layer;
    let mut matchers: Vec<(String, String, Format)> = Vec::new();
    let mut covered = HashSet::new();
    for l in 0..inv.num_layers() {
        let ms: Vec<&(String, Vec<usize>)> =
            modules.iter().filter(|m| layer_of(m) == Some(l)).collect();
        if let Some(first) = ms.first() {
            let f = fmt_of(first);
            if f != default && ms.iter().all(|m| fmt_of(m) == f) {
                matchers.push((format!("layer_{l}_{f}"), format!("decoder.layers.{l}.*"), f));
                covered.insert(l);
            }
        }
    }
    let mtp_of = |m: &(String, Vec<usize>)| inv.tensors()[m.1[0]].mtp;
    let mut covered_mtp = HashSet::new();
    for j in 0..inv.num_mtp() {
        let ms: Vec<&(String, Vec<usize>)> =
            modules.iter().filter(|m| mtp_of(m) == Some(j)).collect();
        if let Some(first) = ms.first() {
            let f = fmt_of(first);
            if f != default && ms.iter().all(|m| fmt_of(m) == f) {
                matchers.push((format!("mtp_{j}_{f}"), format!("mtp.layers.{j}.*"), f));
                covered_mtp.insert(j);
            }
        }
    }
    let rest: Vec<&(String, Vec<usize>)> = modules
        .iter()
        .filter(|m| !layer_of(m).is_some_and(|l| covered.contains(&l)))
        .filter(|m| !mtp_of(m).is_some_and(|j| covered_mtp.contains(&j)))
        .collect();
    let mut by_generic: BTreeMap<String, Vec<Format>> = BTreeMap::new();
    for m in &rest {
        by_generic.entry(generic(&m.0)).or_default().push(fmt_of(m));
    }
    let mut seen = HashSet::new();
    for m in &rest {
        let f = fmt_of(m);
        if f == default {
            continue;
        }
        let g = generic(&m.0);
        if by_generic[&g].iter().all(|x| *x == f) {
            if seen.insert(g.clone()) {
                let label = g.replace(".*", "").replace('.', "_");
                matchers.push((format!("{label}_{f}"), g, f));
            }
        } else {
            let label = m.0.replace('.', "_");
            matchers.push((format!("{label}_{f}"), m.0.clone(), f));
        }
    }
    matchers.push(("default".into(), "*".into(), default));
    let mut used: Vec<Format> = matchers.iter().map(|m| m.2).collect();
    used.sort();
    used.dedup();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Megatron TE precision config for mxrl plan {} (recipe `{}`)",
        plan.short_hash(),
        plan.recipe().name
    );
    let _ = writeln!(text, "configs:");
    for f in &used {
        let _ = writeln!(text, "  {}:", f.name());
        let _ = writeln!(
            text,
            "    transformer_engine_config_type: \"TEQuantizationParams\""
        );
        let _ = writeln!(text, "    training_recipe: {}", te_config(*f));
    }
    let _ = writeln!(text, "matchers:");
    for (name, pattern, f) in &matchers {
        let _ = writeln!(text, "  {name}:");
        let _ = writeln!(text, "    type: \"glob\"");
        let _ = writeln!(text, "    enabled: true");
        let _ = writeln!(text, "    pattern: \"{pattern}\"");
        let _ = writeln!(text, "    config: \"{}\"", f.name());
    }
    let pairs: Vec<(String, Format)> = matchers.iter().map(|(_, p, f)| (p.clone(), *f)).collect();
    let got = resolve_te_matchers(inv, &pairs, default);
    Export {
        kind: ExportKind::TeYaml,
        text,
        diffs: diffs(plan, "te", &got),
    }
}

// ---------------------------------------------------------------------------------------
// Miles flags

/// Miles' precision flags, as far as they decide per-tensor formats.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MilesFlags {
    /// `--num-layers-at-start-in-bf16`.
    pub start_bf16: usize,
    /// `--num-layers-at-end-in-bf16`.
    pub end_bf16: usize,
    /// `--extra-high-precision-layers-hf` (substrings of HF names).
    pub hf_substrings: Vec<String>,
    /// `--extra-high-precision-layers-megatron` (substrings of Megatron parameter names).
    pub megatron_substrings: Vec<String>,
}

/// Whether Miles would quantize this tensor at all with format `quant`.
fn miles_scope(t: &TensorInfo, quant: Format) -> bool {
    if t.kind != TensorKind::Linear || t.mtp.is_some() {
        return false;
    }
    match quant {
        Format::Nvfp4 => t.role == Role::RoutedExpert,
        _ => !matches!(t.role, Role::Router | Role::LmHead | Role::SharedExpertGate),
    }
}

/// Re-resolve Miles flags: `(conversion/rollout view over HF names, training view over
/// Megatron names)`.
pub fn resolve_miles(
    inv: &Inventory,
    flags: &MilesFlags,
    quant: Format,
) -> (Vec<Format>, Vec<Format>) {
    let n = inv.num_layers();
    let mut hf = Vec::new();
    let mut mg = Vec::new();
    for t in inv.tensors() {
        let in_layers = t
            .layer
            .is_some_and(|l| l < flags.start_bf16 || l + flags.end_bf16 >= n);
        if !miles_scope(t, quant) || in_layers {
            hf.push(Format::Bf16);
            mg.push(Format::Bf16);
            continue;
        }
        hf.push(
            if flags
                .hf_substrings
                .iter()
                .any(|s| t.hf.contains(s.as_str()))
            {
                Format::Bf16
            } else {
                quant
            },
        );
        let mname = megatron_name(inv, t).map(|m| m.param).unwrap_or_default();
        mg.push(
            if flags
                .megatron_substrings
                .iter()
                .any(|s| mname.contains(s.as_str()))
            {
                Format::Bf16
            } else {
                quant
            },
        );
    }
    (hf, mg)
}

/// The segment naming a tensor's module kind inside a layer, as a Miles substring
/// token: `.kv_b_proj.`, `.shared_experts.`, `.linear_kv_up_proj.`.
fn miles_token(name: &str, after: &[&str]) -> Option<String> {
    let segs: Vec<&str> = name.split('.').collect();
    let i = segs.iter().position(|s| after.contains(s))?;
    segs.get(i + 1).map(|s| format!(".{s}."))
}

fn pick_tokens(
    candidates: &[(usize, String, Option<String>)],
    fmt_of: &dyn Fn(usize) -> Format,
) -> Vec<String> {
    // candidates: (entry index, full name, token); choose the token when every candidate
    // whose name contains it is BF16 in the plan, else the full name.
    let mut out: Vec<String> = Vec::new();
    let mut safe_cache: HashMap<&str, bool> = HashMap::new();
    for (i, full, tok) in candidates {
        if fmt_of(*i) != Format::Bf16 {
            continue;
        }
        let safe = tok.as_ref().filter(|tok| {
            *safe_cache.entry(tok.as_str()).or_insert_with(|| {
                candidates
                    .iter()
                    .filter(|(_, n, _)| n.contains(tok.as_str()))
                    .all(|(j, _, _)| fmt_of(*j) == Format::Bf16)
            })
        });
        let s = safe.cloned().unwrap_or_else(|| full.clone());
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

fn export_miles(plan: &PrecisionPlan, inv: &Inventory) -> Export {
    let quant = main_quant_format(plan).unwrap_or(Format::Bf16);
    let n = inv.num_layers();
    let fmt_of = |i: usize| plan.entries()[i].format;
    let scoped: Vec<(usize, &TensorInfo)> = inv
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| miles_scope(t, quant))
        .collect();
    let layer_bf16 = |l: usize| {
        scoped
            .iter()
            .filter(|(_, t)| t.layer == Some(l))
            .all(|(i, _)| fmt_of(*i) == Format::Bf16)
    };
    let start = (0..n).take_while(|&l| layer_bf16(l)).count();
    let end = if start == n {
        0
    } else {
        (0..n).rev().take_while(|&l| layer_bf16(l)).count()
    };
    let rest: Vec<(usize, &TensorInfo)> = scoped
        .iter()
        .copied()
        .filter(|(_, t)| t.layer.is_none_or(|l| l >= start && l + end < n))
        .collect();
    let hf_c: Vec<(usize, String, Option<String>)> = rest
        .iter()
        .map(|(i, t)| (*i, t.hf.clone(), miles_token(&t.hf, &["self_attn", "mlp"])))
        .collect();
    let mg_c: Vec<(usize, String, Option<String>)> = rest
        .iter()
        .map(|(i, t)| {
            let m = megatron_name(inv, t).map(|m| m.param).unwrap_or_default();
            let tok = miles_token(&m, &["self_attention", "mlp"]);
            (*i, m, tok)
        })
        .collect();
    let flags = MilesFlags {
        start_bf16: start,
        end_bf16: end,
        hf_substrings: pick_tokens(&hf_c, &fmt_of),
        megatron_substrings: pick_tokens(&mg_c, &fmt_of),
    };
    let (hf, mg) = resolve_miles(inv, &flags, quant);
    let mut d = diffs(plan, "hf", &hf);
    d.extend(diffs(plan, "megatron", &mg));
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Miles / Megatron flags for mxrl plan {} (recipe `{}`)",
        plan.short_hash(),
        plan.recipe().name
    );
    match quant {
        Format::Mxfp8 => {
            let _ = writeln!(text, "--fp8-format e4m3 --fp8-recipe mxfp8");
        }
        Format::Fp8Block => {
            let _ = writeln!(text, "--fp8-format e4m3 --fp8-recipe blockwise");
        }
        Format::Nvfp4 => {
            let _ = writeln!(
                text,
                "--fp4-format e2m1 --fp4-recipe nvfp4   # routed experts only"
            );
        }
        Format::Bf16 => {
            let _ = writeln!(text, "# no quantized tensors: plain BF16");
        }
    }
    let _ = writeln!(text, "--num-layers-at-start-in-bf16 {start}");
    let _ = writeln!(text, "--num-layers-at-end-in-bf16 {end}");
    if start + end > 0 {
        let _ = writeln!(text, "--first-last-layers-bf16");
    }
    if !flags.hf_substrings.is_empty() {
        let _ = writeln!(
            text,
            "--extra-high-precision-layers-hf {}",
            flags.hf_substrings.join(" ")
        );
    }
    if !flags.megatron_substrings.is_empty() {
        let _ = writeln!(
            text,
            "--extra-high-precision-layers-megatron {}",
            flags.megatron_substrings.join(" ")
        );
    }
    let _ = writeln!(text, "# environment");
    match plan.backward() {
        BackwardMode::Lowp => {}
        m => {
            let _ = writeln!(text, "NVTE_BACKWARD_OVERRIDE={}", m.name());
        }
    }
    if quant == Format::Nvfp4 {
        if plan.nvfp4_activation_scale() == ActivationScale::PerToken {
            let _ = writeln!(text, "NVTE_NVFP4_ROW_SCALED_ACTIVATION=1");
            let _ = writeln!(text, "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1");
        }
        let _ = writeln!(text, "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1");
        let _ = writeln!(text, "NVTE_NVFP4_DISABLE_RHT=1");
        let _ = writeln!(text, "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1");
    }
    if quant != Format::Bf16 {
        let _ = writeln!(text, "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH=1");
        let _ = writeln!(text, "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1");
    }
    Export {
        kind: ExportKind::Miles,
        text,
        diffs: d,
    }
}

/// Export a plan in a foreign syntax and check it by re-resolving it against the
/// inventory (see the module docs for the semantics each check uses).
pub fn export(plan: &PrecisionPlan, inv: &Inventory, kind: ExportKind) -> Export {
    match kind {
        ExportKind::Miles => export_miles(plan, inv),
        ExportKind::TeYaml => export_te_yaml(plan, inv),
        ExportKind::Ignore => export_ignore(plan, inv),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnmatch_crosses_dots() {
        assert!(fnmatch(
            "*.self_attention.linear_kv_up_proj",
            "decoder.layers.3.self_attention.linear_kv_up_proj"
        ));
        assert!(fnmatch("model.layers.4.*", "model.layers.4.mlp.gate"));
        assert!(!fnmatch("model.layers.4.*", "model.layers.41.mlp.gate"));
        assert!(!fnmatch(
            "model.layers.*.mlp.gate",
            "model.layers.3.mlp.gate_up_proj"
        ));
        assert!(fnmatch("*", "anything"));
    }

    #[test]
    fn generic_replaces_layer_and_expert_indices_only() {
        assert_eq!(
            generic("model.layers.12.mlp.experts.7.up_proj"),
            "model.layers.*.mlp.experts.*.up_proj"
        );
        assert_eq!(
            generic("decoder.layers.3.mlp.experts.linear_fc1"),
            "decoder.layers.*.mlp.experts.linear_fc1"
        );
        assert_eq!(
            miles_token(
                "model.layers.3.self_attn.kv_b_proj.weight",
                &["self_attn", "mlp"]
            )
            .unwrap(),
            ".kv_b_proj."
        );
    }
}
