//! The exclusion lists converted checkpoints carry, checked under every serving client's own
//! matching rule (`mxrl_plan::clients`, each rule citing its source): for every model, preset
//! and list kind, the linears each client quantizes are exactly the ones the plan stores
//! quantized.

use mxrl_plan::{
    check_list, client_decisions, client_list, resolve, Client, Format, Inventory, ListKind,
    Recipe, TensorKind, PRESETS,
};
use std::path::PathBuf;

fn fixture(name: &str) -> Inventory {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Inventory::from_config_path(&p).unwrap()
}

const MODELS: [&str; 3] = [
    "qwen3-30b-a3b.config.json",
    "qwen1.5-moe-a2.7b-chat.config.json",
    "deepseek-v3.config.json",
];

/// A recipe that quantizes attention and dense/shared MLPs too (the linears transformers keeps
/// as `nn.Linear`), with the last layer BF16: fused q/k/v and gate/up stay uniform.
const ATTN_NVFP4: &str = r#"
name = "attn-nvfp4"
backward = "high_precision"
default = "bf16"
[[rule]]
layers = "last 1"
format = "bf16"
[[rule]]
role = "attn_q"
format = "nvfp4"
fallback = "bf16"
[[rule]]
role = "attn_k"
format = "nvfp4"
fallback = "bf16"
[[rule]]
role = "attn_v"
format = "nvfp4"
fallback = "bf16"
[[rule]]
role = "attn_o"
format = "nvfp4"
fallback = "bf16"
"#;

fn recipes() -> Vec<(String, Recipe)> {
    let mut v: Vec<(String, Recipe)> = PRESETS
        .iter()
        .map(|p| (p.to_string(), Recipe::preset(p).unwrap()))
        .collect();
    v.push((
        "attn-nvfp4".into(),
        Recipe::from_toml_str(ATTN_NVFP4, "attn-nvfp4").unwrap(),
    ));
    v
}

#[test]
fn every_list_selects_exactly_the_bf16_linears_under_every_client_rule() {
    let mut checked = 0;
    for model in MODELS {
        let inv = fixture(model);
        for (name, recipe) in recipes() {
            let plan = resolve(&inv, &recipe).unwrap();
            let quantized = plan
                .entries()
                .iter()
                .filter(|e| e.format != Format::Bf16)
                .count();
            let kept = plan
                .entries()
                .iter()
                .filter(|e| e.format == Format::Bf16 && e.tensor.kind == TensorKind::Linear)
                .count();
            for kind in ListKind::ALL {
                let list = client_list(&plan, &inv, kind)
                    .unwrap_or_else(|e| panic!("{model} {name} {kind:?}: {e}"));
                let diffs = check_list(&plan, &inv, kind, &list);
                assert!(
                    diffs.is_empty(),
                    "{model} {name} {kind:?}: {} differences, first: {}",
                    diffs.len(),
                    diffs
                        .iter()
                        .take(5)
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                // The check is not vacuous: every client decided every linear, and both
                // answers occur where the plan has both.
                for &c in kind.clients() {
                    let d = client_decisions(c, &inv, &list);
                    let q = d.iter().filter(|x| x.2 == Ok(true)).count();
                    let k = d.iter().filter(|x| x.2 == Ok(false)).count();
                    assert_eq!(q, quantized, "{model} {name} {c}");
                    assert_eq!(k, kept, "{model} {name} {c}");
                }
                checked += 1;
            }
        }
    }
    assert_eq!(
        checked,
        MODELS.len() * (PRESETS.len() + 1) * ListKind::ALL.len()
    );
}

#[test]
fn regression_glob_lists_ignore_nothing_under_compressed_tensors_and_fp8_rules() {
    // What mxrl wrote before: dot-segment globs. compressed-tensors' match_name and SGLang's
    // dot-bounded fp8 rule match none of them, so every BF16 linear would be quantized.
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    let globs: Vec<String> = [
        "model.layers.47.*",
        "model.layers.*.self_attn.q_proj",
        "model.layers.*.mlp.gate",
        "lm_head",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let ct = check_list(&plan, &inv, ListKind::CompressedTensorsIgnore, &globs);
    assert!(ct.iter().any(|d| d.client == Client::CompressedTensors
        && d.hf == "model.layers.3.self_attn.q_proj.weight"
        && d.client_quantizes == Ok(true)));
    assert!(ct
        .iter()
        .any(|d| d.hf == "model.layers.47.mlp.experts.5.up_proj.weight"));
    let fp8 = check_list(&plan, &inv, ListKind::Fp8ModulesToNotConvert, &globs);
    assert!(fp8.iter().any(|d| d.client == Client::SglangFp8
        && d.module == "model.layers.47.mlp.experts"
        && d.client_quantizes == Ok(true)));
}

#[test]
fn lists_name_modules_explicitly_and_add_the_engines_fused_names() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    let ct = client_list(&plan, &inv, ListKind::CompressedTensorsIgnore).unwrap();
    let mo = client_list(&plan, &inv, ListKind::ModelOptExclude).unwrap();
    for l in [&ct, &mo] {
        assert!(
            l.iter().all(|e| !e.contains('*') && !e.starts_with("re:")),
            "{l:?}"
        );
        assert!(l.contains(&"model.layers.0.self_attn.q_proj".to_string()));
        assert!(l.contains(&"model.layers.47.mlp.experts.127.down_proj".to_string()));
        assert!(l.contains(&"lm_head".to_string()));
        assert!(!l.contains(&"model.layers.0.mlp.experts.0.up_proj".to_string()));
    }
    // Fused engine names only where engines build them (not for compressed-tensors).
    assert!(mo.contains(&"model.layers.0.self_attn.qkv_proj".to_string()));
    assert!(mo.contains(&"model.layers.47.mlp.experts".to_string()));
    assert!(!mo.contains(&"model.layers.40.mlp.experts".to_string()));
    assert!(!ct
        .iter()
        .any(|e| e.ends_with("qkv_proj") || e.ends_with(".experts")));
}

#[test]
fn a_plan_that_splits_a_fused_module_never_reaches_a_list() {
    // Engines load q/k/v as one module: the plan itself refuses to split it, so no
    // checkpoint with a mixed fused module is ever written (client_list also refuses).
    let inv = fixture("qwen3-30b-a3b.config.json");
    let r = Recipe::from_toml_str(
        "name = \"q-only\"\nbackward = \"high_precision\"\ndefault = \"bf16\"\n[[rule]]\nrole = \"attn_q\"\nformat = \"mxfp8\"\n",
        "q-only",
    )
    .unwrap();
    let e = resolve(&inv, &r).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.self_attn.q_proj.weight"), "{e}");
}

#[test]
fn earlier_sglang_modelopt_mla_rule_ignores_the_layer_index() {
    // Documented limit (Client::SglangModelOptMla): DeepSeek-V3 with the last layers BF16
    // excludes every layer's fused q_a/kv_a module under that rule.
    let inv = fixture("deepseek-v3.config.json");
    let plan = resolve(&inv, &Recipe::preset("mxfp8").unwrap()).unwrap();
    let list = client_list(&plan, &inv, ListKind::ModelOptExclude).unwrap();
    let d = client_decisions(Client::SglangModelOptMla, &inv, &list);
    let idx = inv
        .index_of_hf("model.layers.3.self_attn.q_a_proj.weight")
        .unwrap();
    assert_eq!(plan.entries()[idx].format, Format::Mxfp8);
    let got = d.iter().find(|x| x.0 == idx).unwrap();
    assert_eq!(got.2, Ok(false), "{got:?}");
}
