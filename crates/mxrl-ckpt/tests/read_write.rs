//! Reading, validation and atomic writing of checkpoints, on synthetic real-layout models.

use mxrl_ckpt::synth::{write_synthetic, Arch, Fp8Scales, SynthSpec};
use mxrl_ckpt::{partial_path, write_json, Checkpoint, CkptError, Dtype, StagedDir, INDEX_FILE};
use std::path::Path;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn synthetic_checkpoints_open_and_straddle_shards() {
    for arch in Arch::ALL {
        for fp8 in [None, Some(Fp8Scales::PowerOfTwo)] {
            if fp8.is_some() && arch != Arch::DeepseekV3 {
                continue;
            }
            let d = tmp();
            let spec = SynthSpec {
                fp8,
                ..SynthSpec::tiny(arch)
            };
            let info = write_synthetic(&spec, d.path()).unwrap();
            assert_eq!(info.files.len(), 3);
            assert!(
                !info.straddling.is_empty(),
                "{arch:?}: no gate/up pair straddles shards"
            );
            let ck = Checkpoint::open(d.path()).unwrap();
            assert_eq!(ck.shards().len(), 3);
            let want = spec.tensors();
            assert_eq!(ck.len(), want.len());
            for t in &want {
                let v = ck.tensor(&t.name).unwrap();
                assert_eq!(
                    (v.dtype, v.shape),
                    (t.dtype, t.shape.as_slice()),
                    "{}",
                    t.name
                );
            }
            let (g, u) = &info.straddling[0];
            assert_ne!(ck.shard_of(g), ck.shard_of(u));
            assert_eq!(ck.index().unwrap().total_size, Some(ck.total_data_bytes()));
            assert_eq!(
                ck.config().unwrap()["model_type"],
                arch.model_type(),
                "{arch:?}"
            );
            // Deterministic: a second generation is byte-identical.
            let d2 = tmp();
            write_synthetic(&spec, d2.path()).unwrap();
            for f in files(d.path()) {
                assert_eq!(
                    std::fs::read(d.path().join(&f)).unwrap(),
                    std::fs::read(d2.path().join(&f)).unwrap(),
                    "{f}"
                );
            }
        }
    }
}

#[test]
fn deepseek_fp8_layout_has_block_scales() {
    let d = tmp();
    let spec = SynthSpec {
        fp8: Some(Fp8Scales::Arbitrary),
        ..SynthSpec::tiny(Arch::DeepseekV3)
    };
    write_synthetic(&spec, d.path()).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    let w = ck
        .tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
        .unwrap();
    assert_eq!((w.dtype, w.shape), (Dtype::F8E4m3, &[128usize, 256][..]));
    let s = ck
        .tensor("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv")
        .unwrap();
    assert_eq!((s.dtype, s.shape), (Dtype::F32, &[1usize, 2][..]));
    assert_eq!(
        ck.tensor("model.layers.1.mlp.gate.weight").unwrap().dtype,
        Dtype::Bf16
    );
    assert!(ck.contains("model.layers.0.mlp.gate_proj.weight")); // first-k dense
    assert!(ck.contains("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"));
    assert_eq!(
        ck.config().unwrap()["quantization_config"]["weight_block_size"],
        serde_json::json!([128, 128])
    );
}

fn expect_err(dir: &Path, want: &[&str]) -> String {
    let e = Checkpoint::open(dir).expect_err("must fail").to_string();
    for w in want {
        assert!(e.contains(w), "`{e}` lacks `{w}`");
    }
    e
}

fn qwen(dir: &Path) -> mxrl_ckpt::synth::SynthInfo {
    write_synthetic(&SynthSpec::tiny(Arch::Qwen3Moe), dir).unwrap()
}

#[test]
fn missing_shard_is_named() {
    let d = tmp();
    let info = qwen(d.path());
    std::fs::remove_file(d.path().join(&info.files[1])).unwrap();
    expect_err(d.path(), &[&info.files[1], "is missing", INDEX_FILE]);
}

#[test]
fn index_entry_without_tensor_is_named() {
    let d = tmp();
    let info = qwen(d.path());
    let p = d.path().join(INDEX_FILE);
    let mut idx: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    idx["weight_map"]["model.layers.9.ghost.weight"] = info.files[0].clone().into();
    write_json(&p, &idx).unwrap();
    expect_err(
        d.path(),
        &["model.layers.9.ghost.weight", "no shard contains it"],
    );
}

#[test]
fn tensor_missing_from_index_is_named() {
    let d = tmp();
    qwen(d.path());
    let p = d.path().join(INDEX_FILE);
    let mut idx: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    idx["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.norm.weight");
    write_json(&p, &idx).unwrap();
    expect_err(
        d.path(),
        &["model.norm.weight", "has no entry in weight_map"],
    );
}

#[test]
fn index_pointing_at_wrong_shard_is_named() {
    let d = tmp();
    let info = qwen(d.path());
    let p = d.path().join(INDEX_FILE);
    let mut idx: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    idx["weight_map"]["lm_head.weight"] = info.files[0].clone().into();
    write_json(&p, &idx).unwrap();
    expect_err(
        d.path(),
        &["lm_head.weight", "is stored in", &info.files[2]],
    );
}

#[test]
fn truncated_shard_is_named() {
    let d = tmp();
    let info = qwen(d.path());
    let p = d.path().join(&info.files[2]);
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 100]).unwrap();
    expect_err(
        d.path(),
        &[&info.files[2], "run past the end", "lm_head.weight"],
    );
}

#[test]
fn no_weights_is_an_error() {
    let d = tmp();
    let e = expect_err(d.path(), &["no model.safetensors"]);
    assert!(e.contains(&d.path().display().to_string()));
}

#[test]
fn bad_config_json_is_named() {
    let d = tmp();
    qwen(d.path());
    std::fs::write(d.path().join("config.json"), "{").unwrap();
    expect_err(d.path(), &["config.json", "not valid JSON"]);
}

#[test]
fn staged_dir_refuses_existing_output_without_force() {
    let d = tmp();
    let dst = d.path().join("out");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep"), "x").unwrap();
    let e = StagedDir::create(&dst, false).unwrap_err();
    assert!(matches!(e, CkptError::OutputExists { .. }));
    assert!(e.to_string().contains("--force"));
    assert!(!partial_path(&dst).exists());
    assert_eq!(std::fs::read(dst.join("keep")).unwrap(), b"x");
    // With force, the old directory is replaced on commit, not before.
    let s = StagedDir::create(&dst, true).unwrap();
    std::fs::write(s.path().join("new"), "y").unwrap();
    assert!(dst.join("keep").exists());
    s.commit().unwrap();
    assert_eq!(files(&dst), ["new"]);
    assert!(!partial_path(&dst).exists());
}

#[test]
fn staged_dir_dropped_without_commit_leaves_nothing() {
    let d = tmp();
    let dst = d.path().join("out");
    {
        let s = StagedDir::create(&dst, false).unwrap();
        std::fs::write(s.path().join("half-written"), "z").unwrap();
        assert!(partial_path(&dst).exists());
    }
    assert!(!dst.exists());
    assert!(!partial_path(&dst).exists());
    assert!(files(d.path()).is_empty());
}

#[test]
fn qwen_dense_leading_layers_match_the_plan_inventory() {
    // `first_k_dense` writes Qwen `mlp_only_layers` (here: every layer dense); the tensors
    // written must be exactly the ones the architecture's inventory expects from config.json.
    for (arch, dense) in [
        (Arch::Qwen3Moe, 4),
        (Arch::Qwen3Moe, 2),
        (Arch::Qwen2Moe, 1),
    ] {
        let d = tmp();
        let spec = SynthSpec {
            first_k_dense: dense,
            ..SynthSpec::tiny(arch)
        };
        write_synthetic(&spec, d.path()).unwrap();
        let ck = Checkpoint::open(d.path()).unwrap();
        let cfg = ck.config().unwrap();
        let want: Vec<usize> = (0..dense).collect();
        assert_eq!(cfg["mlp_only_layers"], serde_json::json!(want), "{arch:?}");
        assert!(
            ck.contains("model.layers.0.mlp.gate_proj.weight"),
            "{arch:?}"
        );
        assert!(!ck.contains("model.layers.0.mlp.gate.weight"), "{arch:?}");
        let inv = ck.model_inventory().unwrap();
        let mut got: Vec<&str> = ck.names().iter().map(|s| s.as_str()).collect();
        let mut exp: Vec<&str> = inv.tensors().iter().map(|t| t.hf.as_str()).collect();
        got.sort();
        exp.sort();
        assert_eq!(got, exp, "{arch:?} dense {dense}");
    }
}
