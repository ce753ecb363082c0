//! Exports to Miles flags, TE YAML and ignore lists, each re-resolved and compared with
//! the plan.

use mxrl_plan::{
    export, resolve, resolve_ignore_list, resolve_miles, ExportKind, Format, Inventory, MilesFlags,
    Recipe,
};
use std::path::PathBuf;

fn fixture(name: &str) -> Inventory {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Inventory::from_config_path(&p).unwrap()
}

fn recipe(default: &str, rules: &str) -> Recipe {
    Recipe::from_toml_str(
        &format!("name = \"t\"\nbackward = \"high_precision\"\ndefault = \"{default}\"\n{rules}"),
        "t",
    )
    .unwrap()
}

#[test]
fn presets_export_exactly_on_the_fixture_models() {
    for (model, preset) in [
        ("qwen3-30b-a3b.config.json", "nvfp4-hp"),
        ("qwen3-30b-a3b.config.json", "mxfp8"),
        ("qwen1.5-moe-a2.7b-chat.config.json", "mxfp8-dq"),
        ("qwen1.5-moe-a2.7b-chat.config.json", "nvfp4-dq"),
        ("deepseek-v3.config.json", "mxfp8-hp"),
        ("deepseek-v3.config.json", "nvfp4-hp"),
    ] {
        let inv = fixture(model);
        let plan = resolve(&inv, &Recipe::preset(preset).unwrap()).unwrap();
        for kind in [ExportKind::Miles, ExportKind::TeYaml, ExportKind::Ignore] {
            let ex = export(&plan, &inv, kind);
            assert!(
                ex.is_exact(),
                "{model} {preset} {kind:?}:\n{}\n{}",
                ex.text,
                ex.render_diffs()
            );
        }
    }
}

#[test]
fn miles_export_of_deepseek_mxfp8_uses_the_seed_flags() {
    let inv = fixture("deepseek-v3.config.json");
    let plan = resolve(&inv, &Recipe::preset("mxfp8-hp").unwrap()).unwrap();
    let ex = export(&plan, &inv, ExportKind::Miles);
    let t = &ex.text;
    assert!(t.contains("--num-layers-at-start-in-bf16 0\n"), "{t}");
    assert!(t.contains("--num-layers-at-end-in-bf16 9\n"), "{t}");
    assert!(
        t.contains("--extra-high-precision-layers-hf .kv_b_proj. .shared_experts.\n"),
        "{t}"
    );
    assert!(
        t.contains("--extra-high-precision-layers-megatron .linear_kv_up_proj. .shared_experts.\n"),
        "{t}"
    );
    assert!(t.contains("NVTE_BACKWARD_OVERRIDE=high_precision"), "{t}");
}

#[test]
fn nvfp4_exports_carry_the_per_token_switches() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("nvfp4-dq").unwrap()).unwrap();
    let t = export(&plan, &inv, ExportKind::Miles).text;
    for line in [
        "--num-layers-at-end-in-bf16 7",
        "NVTE_BACKWARD_OVERRIDE=dequantized",
        "NVTE_NVFP4_ROW_SCALED_ACTIVATION=1",
        "NVTE_NVFP4_DISABLE_RHT=1",
        "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1",
    ] {
        assert!(t.contains(line), "missing {line}:\n{t}");
    }
    let ig = export(&plan, &inv, ExportKind::Ignore);
    let v: serde_json::Value = serde_json::from_str(&ig.text).unwrap();
    assert_eq!(v["quant_algo"], "NVFP4");
    let list: Vec<&str> = v["exclude_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    // Explicit module names (clients::client_list): the last 15% of layers whole, the
    // fused engine modules of those layers, every router, lm_head.
    for l in 41..48 {
        for m in [
            "self_attn.q_proj",
            "self_attn.qkv_proj",
            "mlp.experts",
            "mlp.experts.127.down_proj",
        ] {
            let name = format!("model.layers.{l}.{m}");
            assert!(list.contains(&name.as_str()), "{name} not in {list:?}");
        }
    }
    assert!(!list.contains(&"model.layers.40.mlp.experts"), "{list:?}");
    assert!(list.contains(&"model.layers.0.mlp.gate"), "{list:?}");
    assert!(list.contains(&"lm_head"), "{list:?}");
    let yaml = export(&plan, &inv, ExportKind::TeYaml).text;
    assert!(yaml.contains("pattern: \"decoder.layers.41.*\""), "{yaml}");
    assert!(
        yaml.contains("pattern: \"decoder.layers.*.self_attention.linear_qkv\""),
        "{yaml}"
    );
    assert!(yaml.contains("fp4_recipe: \"nvfp4\""), "{yaml}");
}

#[test]
fn per_expert_decisions_cannot_be_expressed_in_te_yaml_and_are_reported() {
    // Megatron's grouped-GEMM experts are one TE module per layer: keeping one expert
    // BF16 is not expressible there; the ignore list (per module) can say it.
    let inv = fixture("qwen3-30b-a3b.config.json");
    let keep = "[[rule]]\nrole = \"router\"\nformat = \"bf16\"\n[[rule]]\nrole = \"lm_head\"\nformat = \"bf16\"\n";
    let plan = resolve(
        &inv,
        &recipe(
            "mxfp8",
            &format!("{keep}[[rule]]\nname = \"layers.0.moe.experts.3.*\"\nformat = \"bf16\""),
        ),
    )
    .unwrap();
    let te = export(&plan, &inv, ExportKind::TeYaml);
    let mut hf: Vec<&str> = te.diffs.iter().map(|d| d.hf.as_str()).collect();
    hf.sort();
    assert_eq!(
        hf,
        [
            "model.layers.0.mlp.experts.3.down_proj.weight",
            "model.layers.0.mlp.experts.3.gate_proj.weight",
            "model.layers.0.mlp.experts.3.up_proj.weight",
        ]
    );
    assert!(te
        .diffs
        .iter()
        .all(|d| d.planned == Format::Bf16 && d.exported == Format::Mxfp8 && d.view == "te"));
    assert!(te.render_diffs().contains("cannot express"));
    // Router and lm_head are not TE modules: a plan quantizing them differs too.
    let plan2 = resolve(&inv, &recipe("mxfp8", "")).unwrap();
    let te2 = export(&plan2, &inv, ExportKind::TeYaml);
    assert_eq!(te2.diffs.len(), 48 + 1, "{}", te2.render_diffs());
    // Nor can the serving engines: vLLM and SGLang load layer 0's experts as one FusedMoE
    // module, so no exclusion list keeps expert 3 alone BF16; the check says so.
    let ig = export(&plan, &inv, ExportKind::Ignore);
    assert!(!ig.is_exact());
    assert!(ig
        .diffs
        .iter()
        .all(|d| d.hf.starts_with("model.layers.0.mlp.experts.3.") && d.planned == Format::Bf16));
    assert!(
        ig.diffs.iter().any(|d| d.view.starts_with("vLLM")),
        "{}",
        ig.render_diffs()
    );
}

#[test]
fn substring_flags_that_over_match_are_caught_by_re_resolution() {
    // A hand-written Miles flag `.gate` (meant for the router) also catches every
    // expert's gate_proj in the HF view; the re-resolution sees it.
    let inv = fixture("qwen3-30b-a3b.config.json");
    let flags = MilesFlags {
        start_bf16: 0,
        end_bf16: 0,
        hf_substrings: vec!["gate".into()],
        megatron_substrings: vec![],
    };
    let (hf, mg) = resolve_miles(&inv, &flags, Format::Mxfp8);
    let hf_bf16_experts = inv
        .tensors()
        .iter()
        .zip(&hf)
        .filter(|(t, f)| t.role == mxrl_plan::Role::RoutedExpert && **f == Format::Bf16)
        .count();
    assert_eq!(hf_bf16_experts, 48 * 128);
    // The training view (Megatron names, `linear_fc1`) does not contain `gate`: drift.
    let mg_bf16_experts = inv
        .tensors()
        .iter()
        .zip(&mg)
        .filter(|(t, f)| t.role == mxrl_plan::Role::RoutedExpert && **f == Format::Bf16)
        .count();
    assert_eq!(mg_bf16_experts, 0);
}

#[test]
fn ignore_list_semantics_match_whole_module_names() {
    let inv = fixture("qwen1.5-moe-a2.7b-chat.config.json");
    let got = resolve_ignore_list(
        &inv,
        &["model.layers.*.mlp.shared_expert".into()],
        Format::Nvfp4,
    );
    // Module names are `...shared_expert.gate_proj`: the pattern names no module.
    assert!(inv
        .tensors()
        .iter()
        .zip(&got)
        .filter(|(t, _)| t.role == mxrl_plan::Role::SharedExpert)
        .all(|(_, f)| *f == Format::Nvfp4));
    let got = resolve_ignore_list(
        &inv,
        &["model.layers.*.mlp.shared_expert.*".into()],
        Format::Nvfp4,
    );
    assert!(inv
        .tensors()
        .iter()
        .zip(&got)
        .filter(|(t, _)| t.role == mxrl_plan::Role::SharedExpert)
        .all(|(_, f)| *f == Format::Bf16));
    // `*` crosses dots in this syntax, so `shared_expert*` also catches the gate.
    let got = resolve_ignore_list(
        &inv,
        &["model.layers.*.mlp.shared_expert*".into()],
        Format::Nvfp4,
    );
    let idx = inv
        .index_of_hf("model.layers.0.mlp.shared_expert_gate.weight")
        .unwrap();
    assert_eq!(got[idx], Format::Bf16);
}
