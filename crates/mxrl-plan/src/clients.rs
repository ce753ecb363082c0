//! The module lists a converted checkpoint's `quantization_config` carries (compressed-tensors
//! `ignore`, ModelOpt `exclude_modules`, fp8-family `modules_to_not_convert`), built from the
//! plan's per-tensor decisions, and each serving client's own rule for reading them.
//!
//! Every client matches the list against *its* module names with *its* rule, and the rules
//! differ (none of them is mxrl's dot-segment glob):
//!
//! | client | names it matches | rule | source (repository, file, function) |
//! |---|---|---|---|
//! | compressed-tensors (library; transformers' `CompressedTensorsHfQuantizer`) | HF module names | exact, or `re:`-prefixed regex with `re.match` | vllm-project/compressed-tensors `src/compressed_tensors/utils/match.py` `match_name` (via `match_named_modules` in `quantization/lifecycle/apply.py` `apply_quantization_config`) |
//! | vLLM compressed-tensors | vLLM modules (`qkv_proj`, `gate_up_proj` fused; FusedMoE `experts`) | exact or `re:`; a fused layer is ignored iff its shards are (mixed shards: `ValueError`); FusedMoE uses expert 0's `gate_proj`/`up_proj`/`down_proj` | vllm-project/vllm `vllm/model_executor/layers/quantization/compressed_tensors/utils.py` `should_ignore_layer`; `compressed_tensors_moe.py` `CompressedTensorsMoEMethod.get_moe_method` |
//! | ModelOpt / TensorRT-LLM | HF module names | `fnmatch` wildcards | the wildcard semantics vLLM's `ModelOptQuantConfigBase.is_layer_excluded` documents ("The ModelOpt exclude_modules list is a list of wildcards") |
//! | vLLM ModelOpt | vLLM modules | exact with fused shards (`is_layer_skipped`), **or substring**, or `fnmatch` | vllm-project/vllm `vllm/model_executor/layers/quantization/modelopt.py` `ModelOptQuantConfigBase.is_layer_excluded` |
//! | SGLang ModelOpt | SGLang modules | `re.fullmatch` with `*` → `.*`, a packed layer excluded iff all shards are (mixed: `ValueError`) | sgl-project/sglang `python/sglang/srt/layers/quantization/modelopt_quant.py` `ModelOptQuantConfig.is_layer_excluded` / `_is_packed_layer_excluded` |
//! | SGLang ModelOpt (earlier releases; not checked, see [`Client::SglangModelOptMla`]) | SGLang modules | `re.fullmatch` with `*` → `.*`; MLA `q_a_proj`/`kv_a_proj_with_mqa`/`q_b_proj`/`kv_b_proj` entries also exclude the fused module containing them, in any layer | sgl-project/sglang `modelopt_quant.py` `ModelOptFp4Config.is_layer_excluded` |
//! | SGLang fp8 family (`fp8`, `mxfp8`) | SGLang modules | dot-bounded path match (`ignored == prefix`, `prefix` starts with `ignored.`, or `.ignored.` inside); fused layers by shards | sgl-project/sglang `python/sglang/srt/layers/quantization/utils.py` `is_layer_skipped` / `_module_path_match` (PR #23467) |
//! | vLLM fp8 family | vLLM modules | linears: exact with fused shards; FusedMoE: substring (`skip_with_substr=True`) | vllm-project/vllm `vllm/model_executor/layers/quantization/utils/quant_utils.py` `is_layer_skipped`, called from `fp8.py` `Fp8Config.get_quant_method` |
//! | transformers (`fp8`, `mxfp8` → `FineGrainedFP8HfQuantizer`) | HF module names, routed experts fused into `mlp.experts` | `re.match(key + "\.")`, `re.match(key)` or `endswith(key)` | huggingface/transformers `src/transformers/quantizers/quantizers_utils.py` `should_convert_module` (5.17) |
//!
//! The list each format gets ([`client_list`]) names modules explicitly — no wildcard, no
//! regex — so it means the same under every rule above: the HF module name of every linear
//! the plan keeps BF16, plus, for the formats read by fusing engines, the fused module names
//! vLLM and SGLang build (`…self_attn.qkv_proj`, `…gate_up_proj`, `…mlp.experts`,
//! `…fused_qkv_a_proj_with_mqa`) when all their parts are BF16. A fused module whose parts
//! the plan stores in different formats cannot be served (the engines refuse or silently pick
//! one) and is an error. [`check_list`] re-resolves a list under every client rule of its
//! format and reports each linear whose client decision differs from the plan.

use crate::inventory::{Inventory, TensorInfo, TensorKind};
use crate::names::{has_q_lora, sglang_module_with};
use crate::plan::PrecisionPlan;
use mxrl_formats::Format;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

/// Which list of a converted checkpoint (one per serving container).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListKind {
    /// compressed-tensors `quantization_config.ignore` (NVFP4 `nvfp4-pack-quantized`).
    CompressedTensorsIgnore,
    /// ModelOpt `hf_quant_config.json` `exclude_modules` (= `config.json` `ignore`).
    ModelOptExclude,
    /// fp8-family `modules_to_not_convert` (`mxfp8` and `fp8` block checkpoints; the `fp8`
    /// config also carries it as `ignored_layers`).
    Fp8ModulesToNotConvert,
}

impl ListKind {
    /// All kinds.
    pub const ALL: [ListKind; 3] = [
        ListKind::CompressedTensorsIgnore,
        ListKind::ModelOptExclude,
        ListKind::Fp8ModulesToNotConvert,
    ];

    /// The clients that read this list (each with its own rule).
    pub fn clients(self) -> &'static [Client] {
        match self {
            ListKind::CompressedTensorsIgnore => {
                &[Client::CompressedTensors, Client::VllmCompressedTensors]
            }
            ListKind::ModelOptExclude => &[
                Client::ModelOptFnmatch,
                Client::VllmModelOpt,
                Client::SglangModelOpt,
            ],
            ListKind::Fp8ModulesToNotConvert => {
                &[Client::SglangFp8, Client::VllmFp8, Client::TransformersFp8]
            }
        }
    }

    /// The config key.
    pub fn key(self) -> &'static str {
        match self {
            ListKind::CompressedTensorsIgnore => "ignore",
            ListKind::ModelOptExclude => "exclude_modules",
            ListKind::Fp8ModulesToNotConvert => "modules_to_not_convert",
        }
    }
}

/// A serving client's reading of an exclusion list (see the module docs for the sources).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Client {
    /// compressed-tensors `match_name` over HF module names (also transformers).
    CompressedTensors,
    /// vLLM `compressed_tensors/utils.py` `should_ignore_layer` + FusedMoE expert-0 lookup.
    VllmCompressedTensors,
    /// ModelOpt's own wildcard semantics (`fnmatch` over HF module names).
    ModelOptFnmatch,
    /// vLLM `modelopt.py` `ModelOptQuantConfigBase.is_layer_excluded`.
    VllmModelOpt,
    /// SGLang `modelopt_quant.py` `is_layer_excluded` + `_is_packed_layer_excluded`.
    SglangModelOpt,
    /// SGLang `modelopt_quant.py` `ModelOptFp4Config.is_layer_excluded` of earlier releases:
    /// an entry ending in an MLA projection (`q_a_proj`, `kv_a_proj_with_mqa`, ...) excludes
    /// the fused module containing it **in every layer** (the layer index is not compared), so
    /// a plan that keeps only some layers' MLA projections BF16 cannot be expressed for it.
    /// Not among [`ListKind::ModelOptExclude`]'s clients; kept to document that limit.
    SglangModelOptMla,
    /// SGLang `quantization/utils.py` `is_layer_skipped` (dot-bounded `_module_path_match`).
    SglangFp8,
    /// vLLM `quant_utils.py` `is_layer_skipped` as `Fp8Config.get_quant_method` calls it.
    VllmFp8,
    /// transformers `quantizers_utils.py` `should_convert_module`.
    TransformersFp8,
}

impl Client {
    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Client::CompressedTensors => "compressed-tensors match_name",
            Client::VllmCompressedTensors => "vLLM compressed-tensors should_ignore_layer",
            Client::ModelOptFnmatch => "ModelOpt fnmatch",
            Client::VllmModelOpt => "vLLM ModelOpt is_layer_excluded",
            Client::SglangModelOpt => "SGLang ModelOpt is_layer_excluded",
            Client::SglangModelOptMla => "SGLang ModelOpt (MLA fused patterns) is_layer_excluded",
            Client::SglangFp8 => "SGLang fp8 is_layer_skipped",
            Client::VllmFp8 => "vLLM fp8 is_layer_skipped",
            Client::TransformersFp8 => "transformers should_convert_module",
        }
    }

    /// Whether the client names modules as the fusing engines do (vLLM/SGLang).
    fn engine_view(self) -> bool {
        !matches!(
            self,
            Client::CompressedTensors | Client::ModelOptFnmatch | Client::TransformersFp8
        )
    }
}

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One linear whose client decision differs from the plan (or that the client refuses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientDiff {
    /// The client.
    pub client: Client,
    /// HF tensor name.
    pub hf: String,
    /// The module name the client matched.
    pub module: String,
    /// The plan's format.
    pub planned: Format,
    /// What the client does: `Ok(true)` quantizes, `Ok(false)` keeps it unquantized,
    /// `Err(message)` refuses to load (the client's own error, paraphrased).
    pub client_quantizes: Result<bool, String>,
}

impl fmt::Display for ClientDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match &self.client_quantizes {
            Ok(true) => "quantizes it".to_string(),
            Ok(false) => "keeps it unquantized".to_string(),
            Err(e) => format!("refuses: {e}"),
        };
        write!(
            f,
            "[{}] {} (module `{}`): plan {}, client {what}",
            self.client, self.hf, self.module, self.planned
        )
    }
}

/// HF module name of a linear weight (its name without `.weight`).
fn hf_module(t: &TensorInfo) -> &str {
    t.hf.strip_suffix(".weight").unwrap_or(&t.hf)
}

fn linears(inv: &Inventory) -> impl Iterator<Item = (usize, &TensorInfo)> {
    inv.tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.kind == TensorKind::Linear)
}

/// The module a client matches for a linear weight: the engine's fused module for vLLM and
/// SGLang, transformers' fused `mlp.experts` for routed experts, else the HF module.
fn client_module(client: Client, q_lora: bool, t: &TensorInfo) -> String {
    if client.engine_view() {
        return sglang_module_with(q_lora, t).unwrap_or_else(|| hf_module(t).to_string());
    }
    if client == Client::TransformersFp8 && t.expert.is_some() {
        // transformers 5 fuses a layer's routed experts into one `mlp.experts` module.
        let m = hf_module(t);
        let experts = m.rsplit_once('.').and_then(|(h, _)| h.rsplit_once('.'));
        return experts
            .map(|(h, _)| h.to_string())
            .unwrap_or_else(|| m.to_string());
    }
    hf_module(t).to_string()
}

/// The exclusion list of `kind` for `plan`: every BF16 linear's HF module name, and (except
/// for compressed-tensors, whose clients resolve fused layers from the unfused names) the
/// engines' fused module names whose parts are all BF16. In checkpoint order, no duplicates.
///
/// # Errors
/// A fused engine module (q/k/v, gate/up, a layer's routed experts, MLA q_a/kv_a) whose parts
/// the plan stores in different formats: no client can serve it; the message names the
/// module and every part's format.
pub fn client_list(
    plan: &PrecisionPlan,
    inv: &Inventory,
    kind: ListKind,
) -> Result<Vec<String>, String> {
    let fmt_of = |i: usize| plan.entries()[i].format;
    let q_lora = has_q_lora(inv);
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, t) in linears(inv) {
        let m = sglang_module_with(q_lora, t).unwrap_or_else(|| hf_module(t).to_string());
        groups.entry(m).or_default().push(i);
    }
    for (m, members) in &groups {
        let f0 = fmt_of(members[0]);
        if members.iter().any(|&i| fmt_of(i) != f0) {
            // The first part and up to five parts in another format than it.
            let shown: Vec<usize> = std::iter::once(members[0])
                .chain(members.iter().copied().filter(|&i| fmt_of(i) != f0).take(5))
                .collect();
            let parts: Vec<String> = shown
                .iter()
                .map(|&i| format!("{} {}", hf_module(&inv.tensors()[i]), fmt_of(i)))
                .collect();
            let more = members.len() - shown.len();
            let more = if more > 0 {
                format!(", … {more} more")
            } else {
                String::new()
            };
            return Err(format!(
                "serving engines load `{m}` as one fused module, but the plan stores its parts in different formats ({}{more}); keep them in one format",
                parts.join(", ")
            ));
        }
    }
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, t) in linears(inv) {
        if fmt_of(i) != Format::Bf16 {
            continue;
        }
        let m = hf_module(t).to_string();
        if kind != ListKind::CompressedTensorsIgnore {
            let fused = sglang_module_with(q_lora, t).unwrap_or_else(|| m.clone());
            if fused != m && seen.insert(fused.clone()) {
                out.push(fused);
            }
        }
        if seen.insert(m.clone()) {
            out.push(m);
        }
    }
    Ok(out)
}

/// compressed-tensors `match_name(name, target)`: `re:` targets are `re.match` regexes, any
/// other target must equal the name. mxrl writes no regex; a `re:` entry is reported as
/// not modelled.
fn ct_match(name: &str, target: &str) -> Result<bool, String> {
    if target.starts_with("re:") {
        return Err(format!("regex entry `{target}` is not modelled here"));
    }
    Ok(target == name)
}

fn any_ok(
    list: &[String],
    mut f: impl FnMut(&str) -> Result<bool, String>,
) -> Result<bool, String> {
    for e in list {
        if f(e)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Python `fnmatch.fnmatch(name, pattern)` for the patterns mxrl writes (`*`, `?`, no `[`).
fn fnmatch(name: &str, pattern: &str) -> bool {
    crate::glob::match_one_segment(pattern.as_bytes(), name.as_bytes())
}

/// Whether an entry uses regex syntax beyond `.` (not modelled by [`re_match_prefix`]).
fn regex_meta(pattern: &str) -> bool {
    pattern.bytes().any(|c| b"*+?[](){}|^$\\".contains(&c))
}

/// Python `re.match(pattern, name)` (anchored at the start only) for a pattern whose only
/// metacharacter is `.` (any character); callers check [`regex_meta`] first.
fn re_match_prefix(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    p.len() <= n.len() && p.iter().zip(n).all(|(a, b)| *a == b'.' || a == b)
}

/// SGLang `_module_path_match(ignored, prefix)` (PR #23467): dot-bounded path match.
fn module_path_match(ignored: &str, prefix: &str) -> bool {
    let ignored = ignored.trim_end_matches('.');
    let prefix = prefix.trim_end_matches('.');
    if ignored.is_empty() {
        return false;
    }
    // `(".." + ignored + ".") in ("." + prefix + ".")`: an occurrence bounded by dots or ends
    // (this also covers `ignored == prefix` and `prefix.startswith(ignored + ".")`).
    let (p, i) = (prefix.as_bytes(), ignored.as_bytes());
    prefix.match_indices(ignored).any(|(at, _)| {
        let end = at + i.len();
        (at == 0 || p[at - 1] == b'.') && (end == p.len() || p[end] == b'.')
    })
}

/// A fused engine module's shard names (vLLM/SGLang `packed_modules_mapping`), or `None`.
fn shards(module: &str) -> Option<Vec<String>> {
    let (head, last) = module.rsplit_once('.')?;
    let parts: &[&str] = match last {
        "qkv_proj" => &["q_proj", "k_proj", "v_proj"],
        "gate_up_proj" => &["gate_proj", "up_proj"],
        "fused_qkv_a_proj_with_mqa" => &["q_a_proj", "kv_a_proj_with_mqa"],
        _ => return None,
    };
    Some(parts.iter().map(|p| format!("{head}.{p}")).collect())
}

/// Every shard must give the same answer (vLLM/SGLang raise `ValueError` otherwise).
fn all_shards(
    module: &str,
    shard_names: &[String],
    mut f: impl FnMut(&str) -> Result<bool, String>,
) -> Result<bool, String> {
    let mut got: Option<bool> = None;
    for s in shard_names {
        let v = f(s)?;
        match got {
            None => got = Some(v),
            Some(g) if g != v => {
                return Err(format!(
                    "some but not all shards of `{module}` are excluded ({shard_names:?})"
                ))
            }
            _ => {}
        }
    }
    Ok(got.unwrap_or(false))
}

/// A list with its wildcard-free entries indexed (exact and `fnmatch` lookups of literal
/// entries are set lookups; only entries with `*`/`?` are scanned).
struct Prepared<'a> {
    all: &'a [String],
    regex: Vec<String>,
    regex_like: Vec<&'a str>,
    literal: HashSet<&'a str>,
    wild: Vec<&'a str>,
}

impl<'a> Prepared<'a> {
    fn new(all: &'a [String]) -> Self {
        let (wild, literal): (Vec<&str>, Vec<&str>) = all
            .iter()
            .map(|s| s.as_str())
            .partition(|e| e.contains(['*', '?', '[']));
        Prepared {
            all,
            regex: all
                .iter()
                .filter(|e| e.starts_with("re:"))
                .cloned()
                .collect(),
            regex_like: all
                .iter()
                .map(|e| e.as_str())
                .filter(|e| regex_meta(e))
                .collect(),
            literal: literal.into_iter().collect(),
            wild,
        }
    }

    fn exact(&self, n: &str) -> bool {
        self.literal.contains(n)
    }

    /// `any(match_name(n, e) for e in list)` (compressed-tensors).
    fn ct_match_any(&self, n: &str) -> Result<bool, String> {
        if self.exact(n) {
            return Ok(true);
        }
        // Literal entries are all in the set; only `re:` entries remain to try.
        any_ok(&self.regex, |e| ct_match(n, e))
    }

    /// `any(fnmatch(n, e) for e in list)`.
    fn fnmatch_any(&self, n: &str) -> bool {
        self.exact(n) || self.wild.iter().any(|e| fnmatch(n, e))
    }
}

/// Whether `client` keeps `module` unquantized under `list`.
fn excluded(
    client: Client,
    module: &str,
    is_experts: bool,
    p: &Prepared<'_>,
) -> Result<bool, String> {
    let list = p.all;
    let exact = |n: &str| p.exact(n);
    match client {
        Client::CompressedTensors => p.ct_match_any(module),
        Client::VllmCompressedTensors => {
            let ct_any = |n: &str| p.ct_match_any(n);
            if is_experts {
                // get_moe_method resolves the scheme of `{prefix}.0.{gate,up,down}_proj`
                // and requires all three to agree.
                let names: Vec<String> = ["gate_proj", "up_proj", "down_proj"]
                    .iter()
                    .map(|p| format!("{module}.0.{p}"))
                    .collect();
                return all_shards(module, &names, ct_any);
            }
            match shards(module) {
                Some(s) if !exact(module) => all_shards(module, &s, ct_any),
                _ => ct_any(module),
            }
        }
        Client::ModelOptFnmatch => Ok(p.fnmatch_any(module)),
        Client::VllmModelOpt => {
            if list.is_empty() {
                return Ok(false);
            }
            let skipped = match shards(module) {
                Some(s) => all_shards(module, &s, |n| Ok(exact(n)))?,
                None => exact(module),
            };
            Ok(skipped
                || list
                    .iter()
                    .any(|e| e != module && module.contains(e.as_str()))
                || p.fnmatch_any(module))
        }
        Client::SglangModelOpt => {
            let full = |n: &str| p.fnmatch_any(n);
            if full(module) {
                return Ok(true);
            }
            match shards(module) {
                Some(s) => all_shards(module, &s, |n| Ok(full(n))),
                None => Ok(false),
            }
        }
        Client::SglangModelOptMla => {
            const FUSED: [&str; 4] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];
            let last = module.rsplit('.').next().unwrap_or(module);
            Ok(list.iter().any(|e| {
                let pl = e.rsplit('.').next().unwrap_or(e);
                fnmatch(module, e) || (FUSED.contains(&pl) && last.contains(pl))
            }))
        }
        Client::SglangFp8 => {
            let m = |n: &str| Ok(list.iter().any(|e| module_path_match(e, n)));
            match shards(module) {
                Some(s) => all_shards(module, &s, m),
                None => m(module),
            }
        }
        Client::VllmFp8 => {
            if is_experts {
                return Ok(list.iter().any(|e| module.contains(e.as_str())));
            }
            match shards(module) {
                Some(s) => all_shards(module, &s, |n| Ok(exact(n))),
                None => Ok(exact(module)),
            }
        }
        // `re.match(key + "\\.", name)` implies `re.match(key, name)`: the second test covers both.
        Client::TransformersFp8 => {
            if let Some(e) = p.regex_like.first() {
                return Err(format!("entry `{e}` uses regex syntax not modelled here"));
            }
            Ok(list
                .iter()
                .any(|e| re_match_prefix(e, module) || module.ends_with(e.as_str())))
        }
    }
}

/// What `client` does with every linear weight of `inv` under `list`: `Ok(true)` quantizes,
/// `Ok(false)` keeps it unquantized, `Err` refuses (in inventory order, linears only, with
/// the module name matched).
pub fn client_decisions(
    client: Client,
    inv: &Inventory,
    list: &[String],
) -> Vec<(usize, String, Result<bool, String>)> {
    let p = Prepared::new(list);
    let q_lora = has_q_lora(inv);
    let mut memo: HashMap<(String, bool), Result<bool, String>> = HashMap::new();
    linears(inv)
        .map(|(i, t)| {
            let m = client_module(client, q_lora, t);
            let is_experts = t.expert.is_some();
            let d = memo
                .entry((m.clone(), is_experts))
                .or_insert_with(|| excluded(client, &m, is_experts, &p).map(|ex| !ex))
                .clone();
            (i, m, d)
        })
        .collect()
}

/// Re-resolves `list` under every client rule of `kind` and returns each linear whose client
/// decision differs from the plan (empty: every client quantizes exactly what the plan stores
/// quantized and keeps exactly the BF16 linears).
pub fn check_list(
    plan: &PrecisionPlan,
    inv: &Inventory,
    kind: ListKind,
    list: &[String],
) -> Vec<ClientDiff> {
    let mut diffs = Vec::new();
    for &client in kind.clients() {
        for (i, module, d) in client_decisions(client, inv, list) {
            let planned = plan.entries()[i].format;
            let want = planned != Format::Bf16;
            if d.as_ref().map(|q| *q != want).unwrap_or(true) {
                diffs.push(ClientDiff {
                    client,
                    hf: inv.tensors()[i].hf.clone(),
                    module,
                    planned,
                    client_quantizes: d,
                });
            }
        }
    }
    diffs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn excluded(
        client: Client,
        module: &str,
        experts: bool,
        list: &[String],
    ) -> Result<bool, String> {
        super::excluded(client, module, experts, &Prepared::new(list))
    }

    #[test]
    fn compressed_tensors_matches_exact_names_only() {
        // The bug this module fixes: a glob entry matches nothing under match_name.
        let glob = l(&["model.layers.*.self_attn.q_proj"]);
        assert!(!excluded(
            Client::CompressedTensors,
            "model.layers.3.self_attn.q_proj",
            false,
            &glob
        )
        .unwrap());
        let exact = l(&["model.layers.3.self_attn.q_proj"]);
        assert!(excluded(
            Client::CompressedTensors,
            "model.layers.3.self_attn.q_proj",
            false,
            &exact
        )
        .unwrap());
        assert!(!excluded(
            Client::CompressedTensors,
            "model.layers.31.self_attn.q_proj",
            false,
            &exact
        )
        .unwrap());
    }

    #[test]
    fn vllm_fused_layers_need_agreeing_shards() {
        let two = l(&[
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
        ]);
        let e = excluded(
            Client::VllmCompressedTensors,
            "model.layers.0.self_attn.qkv_proj",
            false,
            &two,
        );
        assert!(e.is_err(), "{e:?}");
        let moe = l(&[
            "model.layers.2.mlp.experts.0.gate_proj",
            "model.layers.2.mlp.experts.0.up_proj",
            "model.layers.2.mlp.experts.0.down_proj",
        ]);
        assert!(excluded(
            Client::VllmCompressedTensors,
            "model.layers.2.mlp.experts",
            true,
            &moe
        )
        .unwrap());
    }

    #[test]
    fn glob_lists_fail_under_the_fp8_family_and_substring_rules_bite() {
        // `model.layers.7.*` matches nothing under the dot-bounded rule (the report).
        let glob = l(&["model.layers.7.*"]);
        assert!(!excluded(
            Client::SglangFp8,
            "model.layers.7.self_attn.o_proj",
            false,
            &glob
        )
        .unwrap());
        // vLLM ModelOpt's substring rule: a router entry `mlp.gate` hits a fused `mlp.gate_up_proj`.
        let router = l(&["model.layers.1.mlp.gate"]);
        assert!(excluded(
            Client::VllmModelOpt,
            "model.layers.1.mlp.gate_up_proj",
            false,
            &router
        )
        .unwrap());
        // ... while SGLang's dot-bounded rule does not.
        assert!(!excluded(
            Client::SglangFp8,
            "model.layers.1.mlp.gate_up_proj",
            false,
            &router
        )
        .unwrap());
        // transformers: `re.match` treats the dots as wildcards but stays anchored.
        let t = l(&["model.layers.1.mlp.experts"]);
        assert!(excluded(
            Client::TransformersFp8,
            "model.layers.1.mlp.experts",
            true,
            &t
        )
        .unwrap());
        assert!(!excluded(
            Client::TransformersFp8,
            "model.layers.11.mlp.experts",
            true,
            &t
        )
        .unwrap());
    }
}
