//! Name schemes: canonical mxrl ↔ Megatron-Core (TransformerEngine layer spec) and the
//! fused module names SGLang uses at rollout time.
//!
//! Megatron fuses q/k/v into `self_attention.linear_qkv` and an MLP's gate/up into
//! `linear_fc1` (gate rows first), and keeps grouped-GEMM experts as
//! `mlp.experts.linear_fc1.weight{e}`. Such a parameter holds several HF tensors; the
//! [`FusedPart`] says which slice a tensor is.

use crate::inventory::{Inventory, TensorInfo};

/// Which slice of a fused Megatron parameter a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedPart {
    /// Query rows of `linear_qkv`.
    Q,
    /// Key rows of `linear_qkv`.
    K,
    /// Value rows of `linear_qkv`.
    V,
    /// Gate rows of `linear_fc1`.
    Gate,
    /// Up rows of `linear_fc1`.
    Up,
}

/// A tensor's Megatron-Core parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronName {
    /// Parameter name, e.g. `decoder.layers.3.mlp.experts.linear_fc1.weight7`.
    pub param: String,
    /// The slice of a fused parameter, `None` for an unfused one.
    pub part: Option<FusedPart>,
}

impl MegatronName {
    /// The module the parameter belongs to (what TE precision matchers see):
    /// the parameter name without its last segment.
    pub fn module(&self) -> &str {
        self.param
            .rsplit_once('.')
            .map(|(m, _)| m)
            .unwrap_or(&self.param)
    }
}

fn mk(param: String, part: Option<FusedPart>) -> Option<MegatronName> {
    Some(MegatronName { param, part })
}

/// The Megatron-Core parameter of a tensor, or `None` for tensors Megatron does not keep
/// separately (an MTP module's embedding and output head share the main model's).
pub fn megatron_name(inv: &Inventory, t: &TensorInfo) -> Option<MegatronName> {
    let segs: Vec<&str> = t.mxrl.split('.').collect();
    match segs.as_slice() {
        ["embed"] => return mk("embedding.word_embeddings.weight".into(), None),
        ["final_norm"] => return mk("decoder.final_layernorm.weight".into(), None),
        ["lm_head"] => return mk("output_layer.weight".into(), None),
        _ => {}
    }
    let (prefix, scope, rest): (String, String, &[&str]) = match segs.as_slice() {
        ["layers", i, rest @ ..] => (format!("decoder.layers.{i}."), format!("layers.{i}"), rest),
        ["mtp", j, rest @ ..] => {
            match rest {
                ["embed"] | ["head"] => return None,
                ["enorm"] => return mk(format!("mtp.layers.{j}.enorm.weight"), None),
                ["hnorm"] => return mk(format!("mtp.layers.{j}.hnorm.weight"), None),
                ["eh_proj"] => return mk(format!("mtp.layers.{j}.eh_proj.weight"), None),
                ["head_norm"] => return mk(format!("mtp.layers.{j}.final_layernorm.weight"), None),
                _ => {}
            }
            (
                format!("mtp.layers.{j}.transformer_layer."),
                format!("mtp.{j}"),
                rest,
            )
        }
        _ => return None,
    };
    let mla = inv.by_mxrl(&format!("{scope}.attn.kv_b")).is_some();
    let moe = inv.by_mxrl(&format!("{scope}.moe.router")).is_some();
    let fc1 = |base: &str, p: &str, suffix: &str| {
        let part = if p == "gate" {
            FusedPart::Gate
        } else {
            FusedPart::Up
        };
        mk(
            format!("{prefix}{base}linear_fc1.weight{suffix}"),
            Some(part),
        )
    };
    match rest {
        ["attn_norm"] if mla => mk(format!("{prefix}input_layernorm.weight"), None),
        ["attn_norm"] => mk(
            format!("{prefix}self_attention.linear_qkv.layer_norm_weight"),
            None,
        ),
        ["mlp_norm"] if moe => mk(format!("{prefix}pre_mlp_layernorm.weight"), None),
        ["mlp_norm"] => mk(format!("{prefix}mlp.linear_fc1.layer_norm_weight"), None),
        ["attn", p @ ("q" | "k" | "v")] if !mla => {
            let part = match *p {
                "q" => FusedPart::Q,
                "k" => FusedPart::K,
                _ => FusedPart::V,
            };
            mk(
                format!("{prefix}self_attention.linear_qkv.weight"),
                Some(part),
            )
        }
        ["attn", p @ ("q" | "k" | "v"), "bias"] => {
            let part = match *p {
                "q" => FusedPart::Q,
                "k" => FusedPart::K,
                _ => FusedPart::V,
            };
            mk(
                format!("{prefix}self_attention.linear_qkv.bias"),
                Some(part),
            )
        }
        ["attn", "q"] => mk(format!("{prefix}self_attention.linear_q_proj.weight"), None),
        ["attn", "o"] => mk(format!("{prefix}self_attention.linear_proj.weight"), None),
        ["attn", "o", "bias"] => mk(format!("{prefix}self_attention.linear_proj.bias"), None),
        ["attn", "q_norm"] => mk(format!("{prefix}self_attention.q_layernorm.weight"), None),
        ["attn", "k_norm"] => mk(format!("{prefix}self_attention.k_layernorm.weight"), None),
        ["attn", "q_a"] => mk(
            format!("{prefix}self_attention.linear_q_down_proj.weight"),
            None,
        ),
        ["attn", "q_a_norm"] => mk(
            format!("{prefix}self_attention.linear_q_up_proj.layer_norm_weight"),
            None,
        ),
        ["attn", "q_b"] => mk(
            format!("{prefix}self_attention.linear_q_up_proj.weight"),
            None,
        ),
        ["attn", "kv_a"] => mk(
            format!("{prefix}self_attention.linear_kv_down_proj.weight"),
            None,
        ),
        ["attn", "kv_a_norm"] => mk(
            format!("{prefix}self_attention.linear_kv_up_proj.layer_norm_weight"),
            None,
        ),
        ["attn", "kv_b"] => mk(
            format!("{prefix}self_attention.linear_kv_up_proj.weight"),
            None,
        ),
        ["mlp", p @ ("gate" | "up")] => fc1("mlp.", p, ""),
        ["mlp", "down"] => mk(format!("{prefix}mlp.linear_fc2.weight"), None),
        ["mlp", p @ ("gate" | "up"), "bias"] => {
            let part = if *p == "gate" {
                FusedPart::Gate
            } else {
                FusedPart::Up
            };
            mk(format!("{prefix}mlp.linear_fc1.bias"), Some(part))
        }
        ["mlp", "down", "bias"] => mk(format!("{prefix}mlp.linear_fc2.bias"), None),
        ["moe", "router"] => mk(format!("{prefix}mlp.router.weight"), None),
        ["moe", "router", "bias"] => mk(format!("{prefix}mlp.router.expert_bias"), None),
        ["moe", "experts", e, p @ ("gate" | "up")] => fc1("mlp.experts.", p, e),
        ["moe", "experts", e, "down"] => {
            mk(format!("{prefix}mlp.experts.linear_fc2.weight{e}"), None)
        }
        ["moe", "shared", p @ ("gate" | "up")] => fc1("mlp.shared_experts.", p, ""),
        ["moe", "shared", "down"] => mk(
            format!("{prefix}mlp.shared_experts.linear_fc2.weight"),
            None,
        ),
        ["moe", "shared_gate"] => mk(format!("{prefix}mlp.shared_experts.gate_weight"), None),
        _ => None,
    }
}

/// Reverse index Megatron-Core parameter → HF tensors (with their fused slice), for
/// converting Megatron weights back to Hugging Face names (live export).
#[derive(Debug, Clone)]
pub struct MegatronMap {
    by_param: std::collections::HashMap<String, Vec<(usize, Option<FusedPart>)>>,
}

impl MegatronMap {
    /// Index every tensor of `inv` that has a Megatron parameter.
    pub fn new(inv: &Inventory) -> MegatronMap {
        let mut by_param: std::collections::HashMap<String, Vec<(usize, Option<FusedPart>)>> =
            std::collections::HashMap::new();
        for (i, t) in inv.tensors().iter().enumerate() {
            if let Some(m) = megatron_name(inv, t) {
                by_param.entry(m.param).or_default().push((i, m.part));
            }
        }
        MegatronMap { by_param }
    }

    /// The inventory positions (and fused slices) a Megatron parameter holds, in
    /// checkpoint order: q, k, v for `linear_qkv`; gate, up for `linear_fc1`.
    pub fn members(&self, param: &str) -> &[(usize, Option<FusedPart>)] {
        self.by_param.get(param).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Number of distinct Megatron parameters.
    pub fn len(&self) -> usize {
        self.by_param.len()
    }

    /// Whether no tensor has a Megatron parameter.
    pub fn is_empty(&self) -> bool {
        self.by_param.is_empty()
    }
}

/// The SGLang module a linear weight is loaded into at rollout time (fused names:
/// `qkv_proj`, `gate_up_proj`, `fused_qkv_a_proj_with_mqa`, FusedMoE `experts`), or
/// `None` for non-linear tensors.
pub fn sglang_module(inv: &Inventory, t: &TensorInfo) -> Option<String> {
    sglang_module_with(has_q_lora(inv), t)
}

/// Whether the model has MLA query LoRA (`q_a_proj`), which SGLang fuses with
/// `kv_a_proj_with_mqa`.
pub(crate) fn has_q_lora(inv: &Inventory) -> bool {
    inv.tensors()
        .iter()
        .any(|x| x.hf.ends_with("self_attn.q_a_proj.weight"))
}

/// [`sglang_module`] with [`has_q_lora`] computed once by the caller.
pub(crate) fn sglang_module_with(q_lora: bool, t: &TensorInfo) -> Option<String> {
    if t.kind != crate::inventory::TensorKind::Linear {
        return None;
    }
    let module = t.hf.strip_suffix(".weight")?;
    let (head, last) = module.rsplit_once('.').unwrap_or(("", module));
    let join = |m: &str| {
        if head.is_empty() {
            m.to_string()
        } else {
            format!("{head}.{m}")
        }
    };
    Some(match last {
        "q_proj" | "k_proj" | "v_proj" => join("qkv_proj"),
        "q_a_proj" | "kv_a_proj_with_mqa" if q_lora => join("fused_qkv_a_proj_with_mqa"),
        "gate_proj" | "up_proj" if t.expert.is_some() => {
            // model.layers.i.mlp.experts.e.gate_proj -> model.layers.i.mlp.experts
            let experts = head.rsplit_once('.').map(|(h, _)| h).unwrap_or(head);
            experts.to_string()
        }
        "down_proj" if t.expert.is_some() => head
            .rsplit_once('.')
            .map(|(h, _)| h)
            .unwrap_or(head)
            .to_string(),
        "gate_proj" | "up_proj" => join("gate_up_proj"),
        _ => module.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2_MOE_TINY: &str = r#"{"model_type":"qwen2_moe","hidden_size":64,"num_hidden_layers":2,
        "vocab_size":128,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":128,
        "num_experts":2,"num_experts_per_tok":1,"moe_intermediate_size":32,"shared_expert_intermediate_size":64,
        "mlp_only_layers":[0]}"#;

    #[test]
    fn megatron_fuses_qkv_and_gate_up() {
        let inv = Inventory::from_config_json(QWEN2_MOE_TINY, "tiny").unwrap();
        let m = |hf: &str| megatron_name(&inv, inv.by_hf(hf).unwrap()).unwrap();
        let q = m("model.layers.0.self_attn.q_proj.weight");
        assert_eq!(q.param, "decoder.layers.0.self_attention.linear_qkv.weight");
        assert_eq!(q.part, Some(FusedPart::Q));
        assert_eq!(
            m("model.layers.0.self_attn.v_proj.bias").part,
            Some(FusedPart::V)
        );
        let g = m("model.layers.0.mlp.gate_proj.weight");
        assert_eq!(
            (g.param.as_str(), g.part),
            (
                "decoder.layers.0.mlp.linear_fc1.weight",
                Some(FusedPart::Gate)
            )
        );
        assert_eq!(
            m("model.layers.0.post_attention_layernorm.weight").param,
            "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
        );
        assert_eq!(
            m("model.layers.1.post_attention_layernorm.weight").param,
            "decoder.layers.1.pre_mlp_layernorm.weight"
        );
        let e = m("model.layers.1.mlp.experts.1.up_proj.weight");
        assert_eq!(
            (e.param.as_str(), e.part),
            (
                "decoder.layers.1.mlp.experts.linear_fc1.weight1",
                Some(FusedPart::Up)
            )
        );
        assert_eq!(e.module(), "decoder.layers.1.mlp.experts.linear_fc1");
        assert_eq!(
            m("model.layers.1.mlp.shared_expert.down_proj.weight").param,
            "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"
        );
        assert_eq!(
            m("model.layers.1.mlp.shared_expert_gate.weight").param,
            "decoder.layers.1.mlp.shared_experts.gate_weight"
        );
        assert_eq!(
            m("model.layers.1.mlp.gate.weight").param,
            "decoder.layers.1.mlp.router.weight"
        );
        assert_eq!(m("lm_head.weight").param, "output_layer.weight");
        // Every tensor of the model has a Megatron name, and no two unfused ones collide.
        let mut seen = std::collections::HashSet::new();
        for t in inv.tensors() {
            let n =
                megatron_name(&inv, t).unwrap_or_else(|| panic!("{} has no Megatron name", t.hf));
            assert!(seen.insert((n.param.clone(), n.part)), "duplicate {n:?}");
        }
    }

    #[test]
    fn megatron_map_inverts_the_mapping() {
        let inv = Inventory::from_config_json(QWEN2_MOE_TINY, "tiny").unwrap();
        let map = MegatronMap::new(&inv);
        let qkv: Vec<(&str, Option<FusedPart>)> = map
            .members("decoder.layers.1.self_attention.linear_qkv.weight")
            .iter()
            .map(|(i, p)| (inv.tensors()[*i].hf.as_str(), *p))
            .collect();
        assert_eq!(
            qkv,
            [
                ("model.layers.1.self_attn.q_proj.weight", Some(FusedPart::Q)),
                ("model.layers.1.self_attn.k_proj.weight", Some(FusedPart::K)),
                ("model.layers.1.self_attn.v_proj.weight", Some(FusedPart::V)),
            ]
        );
        let fc1: Vec<&str> = map
            .members("decoder.layers.1.mlp.experts.linear_fc1.weight0")
            .iter()
            .map(|(i, _)| inv.tensors()[*i].hf.as_str())
            .collect();
        assert_eq!(
            fc1,
            [
                "model.layers.1.mlp.experts.0.gate_proj.weight",
                "model.layers.1.mlp.experts.0.up_proj.weight"
            ]
        );
        // Every tensor is reachable from exactly one parameter.
        let total: usize = inv
            .tensors()
            .iter()
            .filter_map(|t| megatron_name(&inv, t))
            .map(|m| m.param)
            .collect::<std::collections::HashSet<_>>()
            .iter()
            .map(|p| map.members(p).len())
            .sum();
        assert_eq!(total, inv.tensors().len());
        assert!(map.members("decoder.layers.9.nothing").is_empty());
    }

    #[test]
    fn sglang_modules_are_fused() {
        let inv = Inventory::from_config_json(QWEN2_MOE_TINY, "tiny").unwrap();
        let s = |hf: &str| sglang_module(&inv, inv.by_hf(hf).unwrap()).unwrap();
        assert_eq!(
            s("model.layers.0.self_attn.k_proj.weight"),
            "model.layers.0.self_attn.qkv_proj"
        );
        assert_eq!(
            s("model.layers.0.mlp.up_proj.weight"),
            "model.layers.0.mlp.gate_up_proj"
        );
        assert_eq!(
            s("model.layers.1.mlp.experts.1.down_proj.weight"),
            "model.layers.1.mlp.experts"
        );
        assert_eq!(
            s("model.layers.1.mlp.gate.weight"),
            "model.layers.1.mlp.gate"
        );
        assert_eq!(
            s("model.layers.1.mlp.shared_expert.gate_proj.weight"),
            "model.layers.1.mlp.shared_expert.gate_up_proj"
        );
        assert_eq!(s("lm_head.weight"), "lm_head");
        assert!(sglang_module(&inv, inv.by_hf("model.norm.weight").unwrap()).is_none());
    }
}
