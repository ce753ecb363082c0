//! The one config type: transformers-5 configs parse, the two spellings agree, and every
//! malformed config of the shared set is rejected with an error naming the field.

use mxrl_plan::{Arch, HfConfig, Inventory, MoeLayers, Role};
use serde_json::Value;
use std::path::PathBuf;

fn model_fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../mxrl-model/tests/fixtures")
        .join(arch)
        .join("config.json")
}

/// The malformed-config set: (case name, config text, field the error must name).
fn malformed() -> Vec<(String, String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let set: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("malformed-configs.json")).unwrap())
            .unwrap();
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(model_fixture("qwen3_moe")).unwrap())
            .unwrap();
    set["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut v = base.clone();
            let o = v.as_object_mut().unwrap();
            for (k, x) in c["set"].as_object().into_iter().flatten() {
                o.insert(k.clone(), x.clone());
            }
            for k in c["remove"].as_array().into_iter().flatten() {
                o.remove(k.as_str().unwrap());
            }
            (
                c["name"].as_str().unwrap().to_string(),
                serde_json::to_string_pretty(&v).unwrap(),
                c["field"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn transformers5_qwen3_moe_fixture_parses_with_its_spellings() {
    let p = model_fixture("qwen3_moe");
    let c = HfConfig::from_path(&p).unwrap();
    assert_eq!(c.arch, Arch::Qwen3Moe);
    // `num_local_experts` (transformers 5) is the expert count; `rope_parameters` the RoPE.
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.num_experts_per_tok), (4, 2));
    assert_eq!(
        m.layers,
        MoeLayers::Qwen {
            decoder_sparse_step: 1,
            mlp_only_layers: vec![1]
        }
    );
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.rope_type, "default");
    assert_eq!(c.max_position_embeddings, Some(64));
    let inv = Inventory::from_config_path(&p).unwrap();
    let experts = inv
        .tensors()
        .iter()
        .filter(|t| t.role == Role::RoutedExpert)
        .count();
    // Layers 0 and 2 are MoE (layer 1 is in mlp_only_layers): 2 × 4 experts × 3 projections.
    assert_eq!(experts, 24);
    assert!(inv
        .by_hf("model.layers.1.mlp.gate_proj.weight")
        .is_some_and(|t| t.role == Role::DenseMlp));
}

#[test]
fn transformers5_qwen2_moe_fixture_parses() {
    let c = HfConfig::from_path(&model_fixture("qwen2_moe")).unwrap();
    assert_eq!(c.arch, Arch::Qwen2Moe);
    assert!(c.qkv_bias && !c.o_bias && c.tie_word_embeddings);
    assert_eq!(c.moe.as_ref().unwrap().shared_intermediate_size, 20);
    let inv = Inventory::from_config_path(&model_fixture("qwen2_moe")).unwrap();
    assert!(inv.by_hf("lm_head.weight").is_none(), "tied embeddings");
    assert!(inv
        .by_hf("model.layers.0.mlp.shared_expert_gate.weight")
        .is_some());
}

#[test]
fn transformers4_and_5_spellings_give_the_same_config() {
    let text = std::fs::read_to_string(model_fixture("qwen3_moe")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let o = v.as_object_mut().unwrap();
    let experts = o.remove("num_local_experts").unwrap();
    o.insert("num_experts".into(), experts);
    o.remove("rope_parameters");
    o.insert("rope_theta".into(), 10000.0.into());
    o.remove("dtype");
    o.insert("torch_dtype".into(), "bfloat16".into());
    let v4 = HfConfig::from_json(&v.to_string(), "v4").unwrap();
    let v5 = HfConfig::from_json(&text, "v5").unwrap();
    assert_eq!(v4, v5);
}

#[test]
fn every_malformed_config_is_rejected_naming_the_field() {
    let cases = malformed();
    assert!(cases.len() >= 20);
    for (name, text, field) in cases {
        let e = HfConfig::from_json(&text, "cfg/config.json")
            .map(|_| ())
            .expect_err(&name);
        let msg = e.to_string();
        assert!(
            msg.contains(&field) && msg.contains("cfg/config.json"),
            "{name}: `{msg}` should name `{field}` and the file"
        );
        // The inventory goes through the same validator.
        assert!(Inventory::from_config_json(&text, "cfg").is_err(), "{name}");
    }
}

#[test]
fn config_file_size_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(mxrl_plan::MAX_CONFIG_BYTES + 10).unwrap();
    let e = HfConfig::from_path(&p).unwrap_err().to_string();
    assert!(
        e.contains("larger than") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn counts_reject_overflowing_products_within_field_bounds() {
    // Every field within its own bound, but the product beyond the parameter limit.
    let mut c = HfConfig::from_path(&model_fixture("qwen3_moe")).unwrap();
    c.hidden_size = mxrl_plan::Limits::WIDTH;
    c.num_hidden_layers = mxrl_plan::Limits::LAYERS;
    let m = c.moe.as_mut().unwrap();
    m.num_experts = mxrl_plan::Limits::EXPERTS;
    m.moe_intermediate_size = mxrl_plan::Limits::WIDTH;
    let e = c.validate("big").unwrap_err().to_string();
    assert!(e.contains("parameters"), "{e}");
}
