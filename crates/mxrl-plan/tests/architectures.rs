//! Tensor names, roles and shapes of each architecture, against the real configs in
//! `tests/fixtures/` and the tensor naming of transformers' modeling files
//! (`modeling_qwen3_moe.py`, `modeling_qwen2_moe.py`, DeepSeek-V3's `modeling_deepseek.py`).

use mxrl_plan::{count_by_role, Arch, Inventory, Proj, Role, TensorKind};
use std::path::PathBuf;

fn fixture(name: &str) -> Inventory {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Inventory::from_config_path(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn names_of_layer(inv: &Inventory, prefix: &str, skip_experts: bool) -> Vec<String> {
    inv.tensors()
        .iter()
        .filter(|t| t.hf.starts_with(prefix))
        .filter(|t| !(skip_experts && t.expert.is_some()))
        .map(|t| t.hf.clone())
        .collect()
}

#[test]
fn qwen3_30b_a3b_names_roles_shapes() {
    let inv = fixture("qwen3-30b-a3b.config.json");
    assert_eq!(inv.arch(), Arch::Qwen3Moe);
    assert_eq!(inv.num_layers(), 48);
    // Per layer: q,k,v,o + q_norm,k_norm + router + 128·3 experts + 2 layer norms = 393;
    // 48·393 + embed + final norm + lm_head = 18867.
    assert_eq!(inv.tensors().len(), 48 * 393 + 3);
    let l = "model.layers.7.";
    let expected: Vec<String> = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    .iter()
    .map(|s| format!("{l}{s}"))
    .collect();
    assert_eq!(names_of_layer(&inv, l, true), expected);
    let t = |hf: &str| inv.by_hf(hf).unwrap_or_else(|| panic!("missing {hf}"));
    let q = t("model.layers.7.self_attn.q_proj.weight");
    assert_eq!(
        (q.mxrl.as_str(), q.role, q.shape.clone()),
        ("layers.7.attn.q", Role::AttnQ, vec![4096, 2048])
    );
    assert_eq!(
        t("model.layers.7.self_attn.k_proj.weight").shape,
        vec![512, 2048]
    );
    assert_eq!(
        t("model.layers.7.self_attn.o_proj.weight").shape,
        vec![2048, 4096]
    );
    assert_eq!(t("model.layers.7.self_attn.q_norm.weight").shape, vec![128]);
    let r = t("model.layers.7.mlp.gate.weight");
    assert_eq!(
        (r.mxrl.as_str(), r.role, r.shape.clone()),
        ("layers.7.moe.router", Role::Router, vec![128, 2048])
    );
    let e = t("model.layers.7.mlp.experts.127.down_proj.weight");
    assert_eq!(e.mxrl, "layers.7.moe.experts.127.down");
    assert_eq!(
        (e.role, e.expert, e.proj, e.layer),
        (Role::RoutedExpert, Some(127), Some(Proj::Down), Some(7))
    );
    assert_eq!(e.shape, vec![2048, 768]);
    assert_eq!(
        t("model.layers.7.mlp.experts.0.gate_proj.weight").shape,
        vec![768, 2048]
    );
    assert_eq!(t("model.embed_tokens.weight").shape, vec![151936, 2048]);
    assert_eq!(t("lm_head.weight").role, Role::LmHead);
    assert_eq!(t("model.norm.weight").mxrl, "final_norm");
    // Checkpoint (module) order: embed first, lm_head last.
    assert_eq!(inv.tensors()[0].hf, "model.embed_tokens.weight");
    assert_eq!(inv.tensors().last().unwrap().hf, "lm_head.weight");
    let roles = count_by_role(inv.tensors());
    assert_eq!(roles[&Role::RoutedExpert], 48 * 128 * 3);
    assert_eq!(roles[&Role::Norm], 48 * 4 + 1);
    assert!(!roles.contains_key(&Role::SharedExpert));
    // mxrl names are unique and map back.
    for x in inv.tensors() {
        assert_eq!(inv.by_mxrl(&x.mxrl).unwrap().hf, x.hf);
    }
}

#[test]
fn qwen1_5_moe_a2_7b_shared_expert_and_gate() {
    let inv = fixture("qwen1.5-moe-a2.7b-chat.config.json");
    assert_eq!(inv.arch(), Arch::Qwen2Moe);
    // Per layer: q,k,v (+3 biases), o = 7; router; 60·3 experts; shared gate/up/down;
    // shared_expert_gate; 2 norms = 194. 24·194 + 3 = 4659.
    assert_eq!(inv.tensors().len(), 24 * 194 + 3);
    let l = "model.layers.23.";
    let expected: Vec<String> = [
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    .iter()
    .map(|s| format!("{l}{s}"))
    .collect();
    assert_eq!(names_of_layer(&inv, l, true), expected);
    let t = |hf: &str| inv.by_hf(hf).unwrap();
    let s = t("model.layers.23.mlp.shared_expert.up_proj.weight");
    assert_eq!(
        (s.mxrl.as_str(), s.role, s.proj),
        (
            "layers.23.moe.shared.up",
            Role::SharedExpert,
            Some(Proj::Up)
        )
    );
    assert_eq!(s.shape, vec![5632, 2048]);
    let g = t("model.layers.23.mlp.shared_expert_gate.weight");
    assert_eq!(
        (g.mxrl.as_str(), g.role, g.shape.clone()),
        (
            "layers.23.moe.shared_gate",
            Role::SharedExpertGate,
            vec![1, 2048]
        )
    );
    let b = t("model.layers.0.self_attn.k_proj.bias");
    assert_eq!(
        (b.mxrl.as_str(), b.role, b.kind, b.shape.clone()),
        (
            "layers.0.attn.k.bias",
            Role::AttnK,
            TensorKind::Bias,
            vec![2048]
        )
    );
    assert_eq!(
        t("model.layers.5.mlp.experts.59.up_proj.weight").shape,
        vec![1408, 2048]
    );
    assert_eq!(t("model.layers.5.mlp.gate.weight").shape, vec![60, 2048]);
}

#[test]
fn deepseek_v3_mla_dense_first_shared_and_mtp() {
    let inv = fixture("deepseek-v3.config.json");
    assert_eq!(inv.arch(), Arch::DeepseekV3);
    assert_eq!((inv.num_layers(), inv.num_mtp()), (61, 1));
    // MLA: q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o (7) + 2 layer norms = 9.
    // Dense layers 0-2: 9 + 3 = 12. MoE layers 3-60: 9 + 256·3 + router + bias + 3 shared = 782.
    // MTP module: embed, enorm, hnorm, eh_proj, head norm, head + one MoE layer = 788.
    assert_eq!(inv.tensors().len(), 3 * 12 + 58 * 782 + 3 + 788);
    let dense: Vec<String> = [
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    .iter()
    .map(|s| format!("model.layers.2.{s}"))
    .collect();
    assert_eq!(names_of_layer(&inv, "model.layers.2.", false), dense);
    let moe: Vec<String> = [
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    .iter()
    .map(|s| format!("model.layers.3.{s}"))
    .collect();
    assert_eq!(names_of_layer(&inv, "model.layers.3.", true), moe);
    let t = |hf: &str| inv.by_hf(hf).unwrap_or_else(|| panic!("missing {hf}"));
    // The seed's figure: kv_b_proj is 32768 × 512.
    let kvb = t("model.layers.10.self_attn.kv_b_proj.weight");
    assert_eq!(
        (kvb.mxrl.as_str(), kvb.role, kvb.shape.clone()),
        ("layers.10.attn.kv_b", Role::MlaKvB, vec![32768, 512])
    );
    assert_eq!(
        t("model.layers.10.self_attn.q_b_proj.weight").shape,
        vec![128 * 192, 1536]
    );
    assert_eq!(
        t("model.layers.10.self_attn.kv_a_proj_with_mqa.weight").shape,
        vec![576, 7168]
    );
    assert_eq!(
        t("model.layers.10.self_attn.o_proj.weight").shape,
        vec![7168, 16384]
    );
    assert_eq!(
        t("model.layers.0.mlp.gate_proj.weight").role,
        Role::DenseMlp
    );
    assert_eq!(
        t("model.layers.0.mlp.gate_proj.weight").shape,
        vec![18432, 7168]
    );
    let rb = t("model.layers.3.mlp.gate.e_score_correction_bias");
    assert_eq!(
        (rb.mxrl.as_str(), rb.role, rb.kind, rb.dtype.as_str()),
        (
            "layers.3.moe.router.bias",
            Role::Router,
            TensorKind::RouterBias,
            "F32"
        )
    );
    assert_eq!(
        t("model.layers.3.mlp.shared_experts.down_proj.weight").shape,
        vec![7168, 2048]
    );
    // MTP module 0 is stored as layer 61.
    let eh = t("model.layers.61.eh_proj.weight");
    assert_eq!(
        (eh.mxrl.as_str(), eh.role, eh.layer, eh.mtp),
        ("mtp.0.eh_proj", Role::Mtp, None, Some(0))
    );
    assert_eq!(eh.shape, vec![7168, 14336]);
    let mtp_expert = t("model.layers.61.mlp.experts.5.up_proj.weight");
    assert_eq!(
        (mtp_expert.mxrl.as_str(), mtp_expert.role, mtp_expert.expert),
        ("mtp.0.moe.experts.5.up", Role::Mtp, Some(5))
    );
    assert_eq!(
        t("model.layers.61.shared_head.head.weight").mxrl,
        "mtp.0.head"
    );
    assert_eq!(
        t("model.layers.61.embed_tokens.weight").kind,
        TensorKind::Embedding
    );
    assert!(inv.by_hf("model.layers.62.eh_proj.weight").is_none());
    // The seed's expert-parameter arithmetic: (61 − 3)·(256 + 1)·3·7168·2048 ≈ 656.5B.
    let expert_params: usize = inv
        .tensors()
        .iter()
        .filter(|t| t.layer.is_some() && matches!(t.role, Role::RoutedExpert | Role::SharedExpert))
        .map(|t| t.numel())
        .sum();
    assert_eq!(expert_params, 58 * 257 * 3 * 7168 * 2048);
    // 656,463,101,952 parameters: 656.5B to one decimal.
    assert_eq!((expert_params + 50_000_000) / 100_000_000, 6565);
}

#[test]
fn dense_llama_and_qwen3_from_config_json() {
    let llama = Inventory::from_config_json(
        r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":2,"vocab_size":100,
            "num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":128,
            "tie_word_embeddings":true}"#,
        "llama",
    )
    .unwrap();
    // Tied embeddings: no lm_head tensor is stored.
    assert!(llama.by_hf("lm_head.weight").is_none());
    assert_eq!(llama.tensors().len(), 1 + 2 * 9 + 1);
    assert_eq!(
        llama
            .by_hf("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .shape,
        vec![32, 64]
    );
    assert_eq!(
        llama
            .by_hf("model.layers.1.mlp.up_proj.weight")
            .unwrap()
            .role,
        Role::DenseMlp
    );
    let qwen3 = Inventory::from_config_json(
        r#"{"model_type":"qwen3","hidden_size":64,"num_hidden_layers":1,"vocab_size":100,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96}"#,
        "qwen3",
    )
    .unwrap();
    assert_eq!(
        qwen3
            .by_hf("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .shape,
        vec![128, 64]
    );
    assert_eq!(
        qwen3
            .by_hf("model.layers.0.self_attn.k_norm.weight")
            .unwrap()
            .shape,
        vec![32]
    );
    assert!(qwen3.by_hf("lm_head.weight").is_some());
}

#[test]
fn config_errors_name_the_field() {
    let e = Inventory::from_config_json(r#"{"model_type":"gpt2"}"#, "cfg.json").unwrap_err();
    assert!(
        e.to_string().contains("gpt2") && e.to_string().contains("qwen3_moe"),
        "{e}"
    );
    let e =
        Inventory::from_config_json(r#"{"model_type":"qwen3_moe","hidden_size":64}"#, "cfg.json")
            .unwrap_err();
    assert!(
        e.to_string().contains("num_hidden_layers") && e.to_string().contains("cfg.json"),
        "{e}"
    );
    let e = Inventory::from_config_json("{", "cfg.json").unwrap_err();
    assert!(e.to_string().contains("JSON"), "{e}");
}
