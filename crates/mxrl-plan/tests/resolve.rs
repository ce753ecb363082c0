//! Resolution: every selector, rule order, defaults, fixed tensors, format constraints,
//! fused partners, the presets on Qwen3-30B-A3B, hashing and JSON.

use mxrl_plan::{
    resolve, sglang_module, BackwardMode, Decision, Format, Inventory, PlanError, Recipe, Role,
    TensorKind,
};
use std::path::PathBuf;

fn fixture(name: &str) -> Inventory {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Inventory::from_config_path(&p).unwrap()
}

/// 4 layers (layer 0 dense via mlp_only_layers), 4 experts, hidden 64.
fn tiny_moe() -> Inventory {
    Inventory::from_config_json(
        r#"{"model_type":"qwen2_moe","hidden_size":64,"num_hidden_layers":4,"vocab_size":128,
            "num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":128,
            "num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32,"shared_expert_intermediate_size":64,
            "mlp_only_layers":[0]}"#,
        "tiny",
    )
    .unwrap()
}

fn recipe(default: &str, rules: &str) -> Recipe {
    Recipe::from_toml_str(
        &format!("name = \"t\"\nbackward = \"dequantized\"\ndefault = \"{default}\"\n{rules}"),
        "t",
    )
    .unwrap()
}

fn fmt(plan: &mxrl_plan::PrecisionPlan, hf: &str) -> Format {
    plan.by_hf(hf).unwrap_or_else(|| panic!("no {hf}")).format
}

#[test]
fn layers_selector() {
    let inv = tiny_moe();
    let plan = resolve(
        &inv,
        &recipe("bf16", "[[rule]]\nlayers = \"1-2\"\nformat = \"mxfp8\""),
    )
    .unwrap();
    assert_eq!(
        fmt(&plan, "model.layers.1.self_attn.q_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.2.mlp.experts.3.up_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.0.self_attn.q_proj.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.3.self_attn.q_proj.weight"),
        Format::Bf16
    );
    // A layers selector never matches tensors outside decoder layers.
    let plan = resolve(
        &inv,
        &recipe("bf16", "[[rule]]\nlayers = \"0-3\"\nformat = \"mxfp8\""),
    )
    .unwrap();
    assert_eq!(fmt(&plan, "lm_head.weight"), Format::Bf16);
    assert_eq!(
        plan.rule_summaries()[0].layers.as_deref(),
        Some(&[0, 1, 2, 3][..])
    );
}

#[test]
fn role_and_proj_selectors() {
    let inv = tiny_moe();
    let plan = resolve(
        &inv,
        &recipe(
            "bf16",
            "[[rule]]\nrole = \"routed_expert\"\nproj = \"down\"\nformat = \"mxfp8\"",
        ),
    )
    .unwrap();
    for e in plan.entries() {
        let t = &e.tensor;
        let want = t.role == Role::RoutedExpert && t.proj == Some(mxrl_plan::Proj::Down);
        assert_eq!(e.format == Format::Mxfp8, want, "{}", t.hf);
    }
    // proj alone selects dense, shared and routed MLPs alike (down has no fused partner).
    let plan = resolve(
        &inv,
        &recipe("bf16", "[[rule]]\nproj = \"down\"\nformat = \"mxfp8\""),
    )
    .unwrap();
    assert_eq!(
        fmt(&plan, "model.layers.0.mlp.down_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.1.mlp.shared_expert.down_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.1.mlp.shared_expert.up_proj.weight"),
        Format::Bf16
    );
}

#[test]
fn name_and_hf_glob_selectors() {
    let inv = tiny_moe();
    let plan = resolve(
        &inv,
        &recipe(
            "mxfp8",
            "[[rule]]\nname = \"layers.*.moe.shared.*\"\nformat = \"bf16\"",
        ),
    )
    .unwrap();
    assert_eq!(
        fmt(&plan, "model.layers.2.mlp.shared_expert.gate_proj.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.2.mlp.shared_expert_gate.weight"),
        Format::Mxfp8
    );
    let plan = resolve(
        &inv,
        &recipe(
            "mxfp8",
            "[[rule]]\nhf = \"model.layers.*.mlp.experts.1.**\"\nformat = \"bf16\"",
        ),
    )
    .unwrap();
    assert_eq!(
        fmt(&plan, "model.layers.3.mlp.experts.1.down_proj.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.3.mlp.experts.2.down_proj.weight"),
        Format::Mxfp8
    );
}

#[test]
fn selectors_of_one_rule_must_all_hold() {
    let inv = tiny_moe();
    let plan = resolve(
        &inv,
        &recipe(
            "bf16",
            "[[rule]]\nlayers = \"last 1\"\nrole = \"attn_o\"\nformat = \"mxfp8\"",
        ),
    )
    .unwrap();
    let quantized: Vec<&str> = plan
        .entries()
        .iter()
        .filter(|e| e.format == Format::Mxfp8)
        .map(|e| e.tensor.hf.as_str())
        .collect();
    assert_eq!(quantized, ["model.layers.3.self_attn.o_proj.weight"]);
}

#[test]
fn first_matching_rule_decides() {
    let inv = tiny_moe();
    let a = "[[rule]]\nlayers = \"last 1\"\nformat = \"bf16\"\n[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"";
    let b = "[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"\n[[rule]]\nlayers = \"last 1\"\nformat = \"bf16\"";
    let pa = resolve(&inv, &recipe("bf16", a)).unwrap();
    let pb = resolve(&inv, &recipe("bf16", b)).unwrap();
    let x = "model.layers.3.mlp.experts.0.gate_proj.weight";
    assert_eq!(
        (fmt(&pa, x), pa.by_hf(x).unwrap().rule()),
        (Format::Bf16, Some(0))
    );
    assert_eq!(
        (fmt(&pb, x), pb.by_hf(x).unwrap().rule()),
        (Format::Nvfp4, Some(0))
    );
    assert_ne!(pa.hash(), pb.hash());
    // An unmatched weight takes the default; non-GEMM tensors are fixed BF16.
    let q = pa.by_hf("model.layers.1.self_attn.q_proj.weight").unwrap();
    assert_eq!((q.format, q.decision), (Format::Bf16, Decision::Default));
    let pm = resolve(&inv, &recipe("mxfp8", "")).unwrap();
    for e in pm.entries() {
        if e.tensor.kind == TensorKind::Linear {
            assert_eq!((e.format, e.decision), (Format::Mxfp8, Decision::Default));
            assert_eq!(e.backward, BackwardMode::Dequantized);
        } else {
            assert_eq!(
                (e.format, e.decision),
                (Format::Bf16, Decision::Fixed),
                "{}",
                e.tensor.hf
            );
            assert_eq!(e.backward, BackwardMode::HighPrecision);
        }
    }
}

#[test]
fn format_constraints_error_or_fall_back() {
    // hidden 48: K = 48 is a multiple of 16 but not of 32.
    let inv = Inventory::from_config_json(
        r#"{"model_type":"qwen3","hidden_size":48,"num_hidden_layers":1,"vocab_size":64,
            "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32,"intermediate_size":64}"#,
        "k48",
    )
    .unwrap();
    let err = resolve(
        &inv,
        &recipe("bf16", "[[rule]]\nrole = \"attn_q\"\nformat = \"mxfp8\""),
    )
    .unwrap_err();
    match &err {
        PlanError::FormatConstraint { tensor, by, .. } => {
            assert_eq!(tensor, "model.layers.0.self_attn.q_proj.weight");
            assert_eq!(by, "rule 0");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(
        err.to_string().contains("K % 32") && err.to_string().contains("fallback"),
        "{err}"
    );
    // q/k/v must agree (fused), so the fallback rule covers all three.
    let plan = resolve(
        &inv,
        &recipe(
            "bf16",
            "[[rule]]\nname = \"layers.*.attn.*\"\nformat = \"mxfp8\"\nfallback = \"bf16\"",
        ),
    )
    .unwrap();
    let q = plan
        .by_hf("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!((q.format, q.fell_back), (Format::Bf16, true));
    // o_proj has K = 64: it takes MXFP8.
    let o = plan
        .by_hf("model.layers.0.self_attn.o_proj.weight")
        .unwrap();
    assert_eq!((o.format, o.fell_back), (Format::Mxfp8, false));
    // NVFP4 only needs K % 16: fine for K = 48.
    let plan = resolve(&inv, &recipe("nvfp4", "")).unwrap_or_else(|e| panic!("{e}"));
    let _ = plan;
}

#[test]
fn nvfp4_recipe_with_lowp_backward_is_rejected() {
    assert!(Recipe::from_toml_str(
        "name = \"x\"\nbackward = \"lowp\"\ndefault = \"nvfp4\"",
        "x"
    )
    .is_err());
}

#[test]
fn fused_partners_must_share_a_format() {
    let inv = tiny_moe();
    let err = resolve(
        &inv,
        &recipe(
            "bf16",
            "[[rule]]\nrole = \"routed_expert\"\nproj = \"gate\"\nformat = \"nvfp4\"",
        ),
    )
    .unwrap_err();
    match err {
        PlanError::FusedMismatch { tensors, .. } => {
            assert_eq!(
                tensors,
                [
                    "model.layers.1.mlp.experts.0.gate_proj.weight",
                    "model.layers.1.mlp.experts.0.up_proj.weight"
                ]
            );
        }
        other => panic!("unexpected {other}"),
    }
    let err = resolve(
        &inv,
        &recipe("bf16", "[[rule]]\nrole = \"attn_k\"\nformat = \"mxfp8\""),
    )
    .unwrap_err();
    assert!(matches!(err, PlanError::FusedMismatch { .. }), "{err}");
}

#[test]
fn qwen3_30b_a3b_nvfp4_hp_keeps_last_7_layers_bf16_and_quantizes_exactly_routed_experts() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    // 15% of 48 = 7.2 → 7 layers: 41-47.
    assert_eq!(
        plan.rule_summaries()[0].layers.as_deref(),
        Some(&(41..48).collect::<Vec<_>>()[..])
    );
    let mut nvfp4 = 0;
    for e in plan.entries() {
        let t = &e.tensor;
        let want = t.role == Role::RoutedExpert && t.layer.is_some_and(|l| l <= 40);
        assert_eq!(e.format == Format::Nvfp4, want, "{}", t.hf);
        if want {
            nvfp4 += 1;
            assert_eq!(e.backward, BackwardMode::HighPrecision);
        } else {
            assert_eq!(e.format, Format::Bf16, "{}", t.hf);
        }
        if t.layer.is_some_and(|l| l >= 41) {
            assert_eq!(e.format, Format::Bf16, "{}", t.hf);
        }
    }
    assert_eq!(nvfp4, 41 * 128 * 3);
    // One shared amax per expert gate/up pair.
    let groups = plan.nvfp4_amax_groups();
    assert_eq!(groups.len(), 41 * 128);
    assert_eq!(
        groups[0].gate,
        "model.layers.0.mlp.experts.0.gate_proj.weight"
    );
    assert_eq!(groups[0].up, "model.layers.0.mlp.experts.0.up_proj.weight");
    assert_eq!(
        plan.nvfp4_activation_scale(),
        mxrl_plan::ActivationScale::PerToken
    );
    // Totals: expert bytes shrink by the NVFP4 layout, the rest stays at 2 bytes/elem.
    let tot = plan.totals();
    let expert = Format::Nvfp4.stored_bytes(768, 2048) * 2 + Format::Nvfp4.stored_bytes(2048, 768);
    assert_eq!(tot.bytes[&Format::Nvfp4], 41 * 128 * expert);
    assert_eq!(tot.plan_bytes, tot.bytes.values().sum::<usize>());
    assert!(tot.compression() > 1.0);
}

#[test]
fn mxfp8_preset_on_deepseek_v3_keeps_the_seed_exceptions_bf16() {
    let inv = fixture("deepseek-v3.config.json");
    let plan = resolve(&inv, &Recipe::preset("mxfp8").unwrap()).unwrap();
    // 15% of 61 = 9.15 → 9 layers: 52-60.
    assert_eq!(
        plan.rule_summaries()[0].layers.as_ref().unwrap().first(),
        Some(&52)
    );
    for e in plan.entries() {
        let t = &e.tensor;
        let keep = t.kind != TensorKind::Linear
            || t.layer.is_none_or(|l| l >= 52)
            || matches!(
                t.role,
                Role::SharedExpert | Role::MlaKvB | Role::Router | Role::LmHead | Role::Mtp
            );
        assert_eq!(e.format == Format::Bf16, keep, "{}", t.hf);
        if !keep {
            assert_eq!((e.format, e.backward), (Format::Mxfp8, BackwardMode::Lowp));
        }
    }
}

#[test]
fn qwen1_5_moe_mxfp8_hp_keeps_shared_expert_and_its_gate_bf16() {
    let inv = fixture("qwen1.5-moe-a2.7b-chat.config.json");
    let plan = resolve(&inv, &Recipe::preset("mxfp8-hp").unwrap()).unwrap();
    assert_eq!(
        fmt(&plan, "model.layers.0.mlp.shared_expert.up_proj.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.0.mlp.shared_expert_gate.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.0.mlp.experts.0.up_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.0.self_attn.q_proj.weight"),
        Format::Mxfp8
    );
    assert_eq!(
        fmt(&plan, "model.layers.0.self_attn.q_proj.bias"),
        Format::Bf16
    );
    // 15% of 24 = 3.6 → 4 layers: 20-23.
    assert_eq!(
        fmt(&plan, "model.layers.20.mlp.experts.0.up_proj.weight"),
        Format::Bf16
    );
    assert_eq!(
        fmt(&plan, "model.layers.19.mlp.experts.0.up_proj.weight"),
        Format::Mxfp8
    );
}

#[test]
fn regression_mlp_gate_rule_does_not_catch_gate_up_proj() {
    // Other stacks' ignore rule `mlp.gate`, meant for the MoE router, is a substring
    // match; on SGLang's fused module names it also catches every `mlp.gate_up_proj`.
    // On a 28-layer dense model (Qwen2.5-7B shapes) that is 28 fused modules = 56 HF
    // tensors silently left BF16 at rollout while training quantized them.
    let dense = Inventory::from_config_json(
        r#"{"model_type":"qwen2","hidden_size":3584,"num_hidden_layers":28,"vocab_size":152064,
            "num_attention_heads":28,"num_key_value_heads":4,"intermediate_size":18944,
            "tie_word_embeddings":false}"#,
        "qwen2.5-7b",
    )
    .unwrap();
    let substring_hits = dense
        .tensors()
        .iter()
        .filter(|t| sglang_module(&dense, t).is_some_and(|m| m.contains("mlp.gate")))
        .count();
    assert_eq!(substring_hits, 56);
    // The mxrl rule for routers is typed or a dot-segment glob: it catches no MLP weight.
    for rules in [
        "[[rule]]\nhf = \"**.mlp.gate.weight\"\nformat = \"bf16\"",
        "[[rule]]\nhf = \"**.mlp.gate.*\"\nformat = \"bf16\"",
        "[[rule]]\nname = \"**.router\"\nformat = \"bf16\"",
        "[[rule]]\nrole = \"router\"\nformat = \"bf16\"",
    ] {
        let plan = resolve(&dense, &recipe("mxfp8", rules)).unwrap();
        assert!(plan.rule_summaries()[0].decided == 0, "{rules}");
        assert!(plan
            .entries()
            .iter()
            .filter(|e| e.tensor.role == Role::DenseMlp)
            .all(|e| e.format == Format::Mxfp8));
        // On an MoE model the same rule decides exactly the routers.
        let moe = tiny_moe();
        let plan = resolve(&moe, &recipe("mxfp8", rules)).unwrap();
        let bf16: Vec<&str> = plan
            .entries()
            .iter()
            .filter(|e| e.tensor.kind == TensorKind::Linear && e.format == Format::Bf16)
            .map(|e| e.tensor.hf.as_str())
            .collect();
        assert_eq!(
            bf16,
            [
                "model.layers.1.mlp.gate.weight",
                "model.layers.2.mlp.gate.weight",
                "model.layers.3.mlp.gate.weight"
            ],
            "{rules}"
        );
    }
}

#[test]
fn plan_hash_depends_on_decisions_only() {
    let inv = tiny_moe();
    let preset = resolve(&inv, &Recipe::preset("nvfp4-dq").unwrap()).unwrap();
    assert_eq!(
        preset.hash(),
        resolve(&inv, &Recipe::preset("nvfp4-dq").unwrap())
            .unwrap()
            .hash()
    );
    assert_eq!(preset.hash().len(), 64);
    // Written differently, deciding the same: same hash.
    let same = recipe(
        "bf16",
        "[[rule]]\nlayers = \"last 1\"\nformat = \"bf16\"\n[[rule]]\nname = \"layers.*.moe.experts.*.*\"\nformat = \"nvfp4\"",
    );
    assert_eq!(resolve(&inv, &same).unwrap().hash(), preset.hash());
    // Another backward mode, or one tensor more in BF16: another hash.
    assert_ne!(
        resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap())
            .unwrap()
            .hash(),
        preset.hash()
    );
    let one_more = recipe(
        "bf16",
        "[[rule]]\nlayers = \"last 1\"\nformat = \"bf16\"\n[[rule]]\nhf = \"model.layers.1.mlp.experts.0.**\"\nformat = \"bf16\"\n[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"",
    );
    assert_ne!(resolve(&inv, &one_more).unwrap().hash(), preset.hash());
}

#[test]
fn json_has_one_entry_per_hf_tensor_in_checkpoint_order() {
    let inv = tiny_moe();
    let plan = resolve(&inv, &Recipe::preset("mxfp8").unwrap()).unwrap();
    let j = plan.to_json();
    assert_eq!(j["contract"], plan.hash());
    assert_eq!(j["quant_contract"], mxrl_formats::contract_hash());
    // tiny_moe has 4 layers: 15% of 4 = 0.6 → 1 layer.
    assert_eq!(j["rules"][0]["layers"], serde_json::json!([3]));
    assert_eq!(j["rules"][0]["rule"], "layers = \"last 15%\" → bf16");
    assert_eq!(j["recipe"]["name"], "mxfp8");
    let ts = j["tensors"].as_array().unwrap();
    assert_eq!(ts.len(), inv.tensors().len());
    for (v, t) in ts.iter().zip(inv.tensors()) {
        assert_eq!(v["hf"], t.hf.as_str());
        assert_eq!(v["mxrl"], t.mxrl.as_str());
        for key in [
            "role", "layer", "expert", "shape", "format", "rule", "backward", "bytes",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
    }
    let e = &ts[inv
        .index_of_hf("model.layers.1.mlp.experts.2.up_proj.weight")
        .unwrap()];
    assert_eq!(e["format"], "mxfp8");
    assert_eq!(e["expert"], 2);
    assert_eq!(e["layer"], 1);
    assert_eq!(e["backward"], "lowp");
    assert_eq!(e["rule"], serde_json::Value::Null);
    assert_eq!(e["bytes"], Format::Mxfp8.stored_bytes(32, 64));
    let r = &ts[inv.index_of_hf("model.layers.1.mlp.gate.weight").unwrap()];
    assert_eq!(
        (r["format"].as_str(), r["rule"].as_u64()),
        (Some("bf16"), Some(2))
    );
    assert!(j["totals"]["compression_vs_bf16"].as_f64().unwrap() > 1.0);
}

#[test]
fn summary_table_prints_resolved_layer_counts_and_groups() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    let s = mxrl_plan::summary_table(&plan);
    assert!(s.contains("[layers 41-47 = 7 of 48]"), "{s}");
    // Layers 0-40 share one row group; routed experts there are 41·384 NVFP4 tensors.
    assert!(
        s.lines().any(|l| l.starts_with("0-40 ")
            && l.contains("routed_expert")
            && l.contains(&(41 * 384).to_string())
            && l.contains("nvfp4")),
        "{s}"
    );
    assert!(
        s.lines()
            .any(|l| l.starts_with("41-47 ") && l.contains("routed_expert") && l.contains("bf16")),
        "{s}"
    );
    assert!(s.contains("smaller"), "{s}");
}

#[test]
fn fp8_block_preset_on_qwen3_30b_a3b_keeps_the_mxfp8_exceptions_bf16() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    let plan = resolve(&inv, &Recipe::preset("fp8-block").unwrap()).unwrap();
    // 15% of 48 = 7.2 → 7 layers: 41-47, as in the MXFP8 presets.
    assert_eq!(
        plan.rule_summaries()[0].layers.as_deref(),
        Some(&(41..48).collect::<Vec<_>>()[..])
    );
    let mut fp8 = 0;
    for e in plan.entries() {
        let t = &e.tensor;
        let keep = t.kind != TensorKind::Linear
            || t.layer.is_none_or(|l| l >= 41)
            || matches!(t.role, Role::Router | Role::LmHead);
        assert_eq!(e.format == Format::Bf16, keep, "{}", t.hf);
        // Every dimension of this model is a multiple of 128: nothing falls back.
        assert!(!e.fell_back, "{}", t.hf);
        if !keep {
            fp8 += 1;
            assert_eq!(
                (e.format, e.backward),
                (Format::Fp8Block, BackwardMode::HighPrecision),
                "{}",
                t.hf
            );
            let (n, k) = t.linear_dims().unwrap();
            assert_eq!(e.bytes, n * k + 4 * (n / 128) * (k / 128), "{}", t.hf);
        }
    }
    // Per layer: q/k/v/o and 128 experts × gate/up/down.
    assert_eq!(fp8, 41 * (4 + 128 * 3));
    let expert =
        Format::Fp8Block.stored_bytes(768, 2048) * 2 + Format::Fp8Block.stored_bytes(2048, 768);
    let attn = Format::Fp8Block.stored_bytes(4096, 2048)
        + 2 * Format::Fp8Block.stored_bytes(512, 2048)
        + Format::Fp8Block.stored_bytes(2048, 4096);
    assert_eq!(
        plan.totals().bytes[&Format::Fp8Block],
        41 * (128 * expert + attn)
    );
}

/// FP8-block tiles are 128 wide in K and N. The plan layer checks K only (as for every
/// block format): a weight whose K is not a multiple of 128 falls back to BF16 under the
/// preset's catch-all rule (a demo-sized model runs entirely in BF16); one with K = 128 and
/// N = 64 takes FP8-block with one (partial) 128×128 scale tile, and the quantizer decides
/// whether it can store it.
#[test]
fn fp8_block_preset_falls_back_where_k_is_not_a_multiple_of_128() {
    // The demo model's shape: hidden 64, experts of 32.
    let demo = Inventory::from_config_json(
        r#"{"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,"vocab_size":96,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":128,
            "num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32}"#,
        "demo",
    )
    .unwrap();
    let plan = resolve(&demo, &Recipe::preset("fp8-block").unwrap()).unwrap();
    let linear: Vec<_> = plan
        .entries()
        .iter()
        .filter(|e| e.tensor.kind == TensorKind::Linear)
        .collect();
    assert!(linear.iter().all(|e| e.format == Format::Bf16));
    // Outside the last layer and the router/lm_head, the catch-all rule decided and fell back.
    let fell = linear.iter().filter(|e| e.fell_back).count();
    assert_eq!(fell, 3 * (4 + 8 * 3));
    // Hidden 128: K = 128 everywhere but the experts' down projection (K = 32); the k/v
    // projections have N = 2 · 32 = 64.
    let wide = Inventory::from_config_json(
        r#"{"model_type":"qwen3_moe","hidden_size":128,"num_hidden_layers":2,"vocab_size":96,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":128,
            "num_experts":2,"num_experts_per_tok":1,"moe_intermediate_size":32}"#,
        "wide",
    )
    .unwrap();
    let plan = resolve(&wide, &Recipe::preset("fp8-block").unwrap()).unwrap();
    let k = plan
        .by_hf("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!((k.format, k.fell_back), (Format::Fp8Block, false));
    assert_eq!(k.bytes, 64 * 128 + 4);
    let gate = plan
        .by_hf("model.layers.0.mlp.experts.1.gate_proj.weight")
        .unwrap();
    assert_eq!((gate.format, gate.fell_back), (Format::Fp8Block, false));
    let down = plan
        .by_hf("model.layers.0.mlp.experts.1.down_proj.weight")
        .unwrap();
    assert_eq!((down.format, down.fell_back), (Format::Bf16, true));
    // 15% of 2 layers rounds to none: the last-layers exception selects nothing here.
    assert_eq!(plan.rule_summaries()[0].layers.as_deref(), Some(&[][..]));
}
