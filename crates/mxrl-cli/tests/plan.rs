//! `mxrl plan` end to end: table, JSON, exports and audit exit codes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../mxrl-plan/tests/fixtures")
        .join(name)
}

fn mxrl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mxrl"))
        .args(args)
        .output()
        .expect("run mxrl")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn table_prints_resolved_layers_and_totals() {
    let cfg = fixture("qwen3-30b-a3b.config.json");
    let out = mxrl(&["plan", "--model", s(&cfg), "--recipe", "nvfp4-hp"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("[layers 41-47 = 7 of 48]"), "{text}");
    assert!(text.contains("routed_expert"), "{text}");
    assert!(text.contains("smaller"), "{text}");
}

#[test]
fn json_lists_every_tensor_in_checkpoint_order() {
    let cfg = fixture("qwen1.5-moe-a2.7b-chat.config.json");
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("plan.json");
    let out = mxrl(&[
        "plan",
        "--model",
        s(&cfg),
        "--recipe",
        "mxfp8",
        "--json",
        "--out",
        s(&out_file),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    let ts = v["tensors"].as_array().unwrap();
    // 24 layers · 194 tensors + embed, final norm, lm_head.
    assert_eq!(ts.len(), 24 * 194 + 3);
    assert_eq!(ts[0]["hf"], "model.embed_tokens.weight");
    assert_eq!(ts.last().unwrap()["hf"], "lm_head.weight");
    assert_eq!(v["contract"].as_str().unwrap().len(), 64);
    // No temporary file is left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn exports_succeed_when_exact_and_fail_when_not() {
    let cfg = fixture("deepseek-v3.config.json");
    for kind in ["miles", "te-yaml", "ignore"] {
        let out = mxrl(&[
            "plan",
            "--model",
            s(&cfg),
            "--recipe",
            "mxfp8-dq",
            "--export",
            kind,
        ]);
        assert!(
            out.status.success(),
            "{kind}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("exactly"));
    }
    // Keeping one expert BF16 is not expressible in Megatron's grouped-expert TE modules.
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("r.toml");
    std::fs::write(
        &r,
        "name = \"one-expert\"\nbackward = \"high_precision\"\ndefault = \"bf16\"\n\
         [[rule]]\nname = \"layers.5.moe.experts.3.*\"\nformat = \"bf16\"\n\
         [[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"\n",
    )
    .unwrap();
    let out = mxrl(&[
        "plan",
        "--model",
        s(&cfg),
        "--recipe",
        s(&r),
        "--export",
        "te-yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.layers.5.mlp.experts.3.up_proj.weight"),
        "{err}"
    );
    // Nor in the serving engines: vLLM and SGLang load a layer's experts as one FusedMoE
    // module, so one BF16 expert among NVFP4 ones cannot be excluded by any list.
    let out = mxrl(&[
        "plan",
        "--model",
        s(&cfg),
        "--recipe",
        s(&r),
        "--export",
        "ignore",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.layers.5.mlp.experts.3.up_proj.weight") && err.contains("vLLM"),
        "{err}"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let cfg = fixture("qwen3-30b-a3b.config.json");
    let out = mxrl(&["plan", "--model", s(&cfg), "--recipe", "fp4-everything"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nvfp4-hp"));
    let out = mxrl(&[
        "plan",
        "--model",
        s(&cfg),
        "--recipe",
        "mxfp8",
        "--export",
        "yaml",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("te-yaml"));
}

#[test]
fn audit_exits_non_zero_on_drift() {
    use safetensors::{tensor::TensorView, Dtype};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","hidden_size":64,"num_hidden_layers":1,"vocab_size":32,
            "num_attention_heads":2,"num_key_value_heads":1,"intermediate_size":64}"#,
    )
    .unwrap();
    let names = [
        ("model.embed_tokens.weight", vec![32, 64]),
        ("model.layers.0.self_attn.q_proj.weight", vec![64, 64]),
        ("model.layers.0.self_attn.k_proj.weight", vec![32, 64]),
        ("model.layers.0.self_attn.v_proj.weight", vec![32, 64]),
        ("model.layers.0.self_attn.o_proj.weight", vec![64, 64]),
        ("model.layers.0.mlp.gate_proj.weight", vec![64, 64]),
        ("model.layers.0.mlp.up_proj.weight", vec![64, 64]),
        ("model.layers.0.mlp.down_proj.weight", vec![64, 64]),
        ("model.layers.0.input_layernorm.weight", vec![64]),
        ("model.layers.0.post_attention_layernorm.weight", vec![64]),
        ("model.norm.weight", vec![64]),
        ("lm_head.weight", vec![32, 64]),
    ];
    let data: Vec<Vec<u8>> = names
        .iter()
        .map(|(_, sh)| vec![0u8; sh.iter().product::<usize>() * 2])
        .collect();
    let views: Vec<(String, TensorView)> = names
        .iter()
        .zip(&data)
        .map(|((n, sh), d)| {
            (
                n.to_string(),
                TensorView::new(Dtype::BF16, sh.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &dir.path().join("model.safetensors")).unwrap();
    // All BF16: clean against `bf16`, drift against `mxfp8` (every linear but lm_head).
    let out = mxrl(&["plan", "--audit", s(dir.path()), "--recipe", "bf16"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = mxrl(&["plan", "--audit", s(dir.path()), "--recipe", "mxfp8"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("7 differ"), "{text}");
    assert!(
        text.contains("model.layers.0.mlp.up_proj.weight: plan mxfp8, stored bf16"),
        "{text}"
    );
}
