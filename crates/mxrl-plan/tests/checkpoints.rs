//! Model directories (safetensors headers + index) and checkpoint audits, on tiny
//! checkpoints written to a temporary directory.

use mxrl_ckpt::{audit_dir, model_inventory, Checkpoint, CkptError};
use mxrl_plan::{
    audit, resolve, Format, Inventory, PlanError, Recipe, StoredFormat, TensorInfo, TensorKind,
};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

const TINY: &str = r#"{"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":2,"vocab_size":64,
  "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32,"intermediate_size":128,
  "num_experts":2,"moe_intermediate_size":32,"num_experts_per_tok":1}"#;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Store {
    Bf16,
    Mxfp8,
    Nvfp4ModelOpt,
    Nvfp4Ct,
    Fp8Block,
}

type Part = (String, Dtype, Vec<usize>);

/// The stored tensors of one logical tensor in a given layout.
fn parts(t: &TensorInfo, how: Store) -> Vec<Part> {
    let Some(prefix) =
        t.hf.strip_suffix(".weight")
            .filter(|_| t.kind == TensorKind::Linear)
    else {
        return vec![(t.hf.clone(), Dtype::BF16, t.shape.clone())];
    };
    let (n, k) = (t.shape[0], t.shape[1]);
    let p = |s: &str, d: Dtype, sh: Vec<usize>| (format!("{prefix}.{s}"), d, sh);
    match how {
        Store::Bf16 => vec![p("weight", Dtype::BF16, vec![n, k])],
        Store::Mxfp8 => vec![
            p("weight", Dtype::F8_E4M3, vec![n, k]),
            p("weight_scale_inv", Dtype::U8, vec![n, k / 32]),
        ],
        Store::Nvfp4ModelOpt => vec![
            p("weight", Dtype::U8, vec![n, k / 2]),
            p("weight_scale", Dtype::F8_E4M3, vec![n, k / 16]),
            p("weight_scale_2", Dtype::F32, vec![]),
            p("input_scale", Dtype::F32, vec![]),
        ],
        Store::Nvfp4Ct => vec![
            p("weight_packed", Dtype::U8, vec![n, k / 2]),
            p("weight_scale", Dtype::F8_E4M3, vec![n, k / 16]),
            p("weight_global_scale", Dtype::F32, vec![1]),
        ],
        Store::Fp8Block => vec![
            p("weight", Dtype::F8_E4M3, vec![n, k]),
            p(
                "weight_scale_inv",
                Dtype::F32,
                vec![n.div_ceil(128), k.div_ceil(128)],
            ),
        ],
    }
}

/// Write `shards` safetensors files (tensors dealt in order) plus an index.
fn write_ckpt(dir: &Path, config: &str, tensors: &[Part], shards: usize) {
    write_ckpt_meta(dir, config, tensors, shards, None)
}

/// As [`write_ckpt`], recording `plan_hash` under `mxrl.plan_hash` in every shard.
fn write_ckpt_meta(
    dir: &Path,
    config: &str,
    tensors: &[Part],
    shards: usize,
    plan_hash: Option<&str>,
) {
    let meta = plan_hash.map(|h| {
        std::collections::HashMap::from([(mxrl_plan::META_PLAN_HASH.to_string(), h.to_string())])
    });
    std::fs::write(dir.join("config.json"), config).unwrap();
    let mut files: BTreeMap<String, Vec<&Part>> = BTreeMap::new();
    let mut weight_map = serde_json::Map::new();
    for (i, t) in tensors.iter().enumerate() {
        let f = format!(
            "model-{:05}-of-{shards:05}.safetensors",
            1 + (i * shards / tensors.len())
        );
        weight_map.insert(t.0.clone(), serde_json::Value::String(f.clone()));
        files.entry(f).or_default().push(t);
    }
    for (f, ts) in &files {
        let data: Vec<Vec<u8>> = ts
            .iter()
            .map(|(_, d, sh)| vec![0u8; sh.iter().product::<usize>() * d.size()])
            .collect();
        let views: Vec<(String, TensorView)> = ts
            .iter()
            .zip(&data)
            .map(|((n, d, sh), b)| (n.clone(), TensorView::new(*d, sh.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, &meta, &dir.join(f)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn tiny_inv() -> Inventory {
    Inventory::from_config_json(TINY, "tiny").unwrap()
}

fn all_parts(inv: &Inventory, how: impl Fn(&TensorInfo) -> Store) -> Vec<Part> {
    inv.tensors()
        .iter()
        .flat_map(|t| parts(t, how(t)))
        .collect()
}

#[test]
fn model_dir_inventory_reads_headers_in_checkpoint_order() {
    let inv = tiny_inv();
    let dir = tempfile::tempdir().unwrap();
    // Store the tensors in reverse module order across 3 shards.
    let mut ts = all_parts(&inv, |_| Store::Bf16);
    ts.reverse();
    write_ckpt(dir.path(), TINY, &ts, 3);
    let got = model_inventory(dir.path()).unwrap();
    assert_eq!(got.tensors().len(), inv.tensors().len());
    // Checkpoint order = (shard file, data offset), with offsets read by the safetensors
    // crate's own parser as the independent reference.
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut keys = Vec::new();
    for t in got.tensors() {
        let file = idx["weight_map"][&t.hf].as_str().unwrap();
        let bytes = std::fs::read(dir.path().join(file)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        keys.push((file.to_string(), meta.info(&t.hf).unwrap().data_offsets.0));
    }
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
    // Reverse module order across shards: the last module tensor is in the first shard.
    assert_eq!(
        idx["weight_map"]["lm_head.weight"],
        "model-00001-of-00003.safetensors"
    );
    assert!(
        got.index_of_hf("lm_head.weight").unwrap()
            < got.index_of_hf("model.embed_tokens.weight").unwrap()
    );
    assert_eq!(got.by_hf("lm_head.weight").unwrap().mxrl, "lm_head");
}

#[test]
fn model_dir_folds_quantized_companions_into_logical_weights() {
    let inv = tiny_inv();
    let dir = tempfile::tempdir().unwrap();
    let ts = all_parts(&inv, |t| {
        if t.expert.is_some() {
            Store::Nvfp4ModelOpt
        } else {
            Store::Bf16
        }
    });
    write_ckpt(dir.path(), TINY, &ts, 2);
    let got = model_inventory(dir.path()).unwrap();
    assert_eq!(got.tensors().len(), inv.tensors().len());
    assert_eq!(
        got.by_hf("model.layers.1.mlp.experts.1.down_proj.weight")
            .unwrap()
            .shape,
        vec![64, 32]
    );
}

#[test]
fn unknown_missing_and_misshaped_tensors_are_errors_naming_them() {
    let inv = tiny_inv();
    let dir = tempfile::tempdir().unwrap();
    let mut ts = all_parts(&inv, |_| Store::Bf16);
    ts.push((
        "model.layers.0.mlp.shared_expert.up_proj.weight".into(),
        Dtype::BF16,
        vec![8, 64],
    ));
    ts.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Dtype::F32,
        vec![16],
    ));
    write_ckpt(dir.path(), TINY, &ts, 1);
    match model_inventory(dir.path()).unwrap_err() {
        CkptError::Plan(PlanError::UnknownTensors { mut names, .. }) => {
            names.sort();
            assert_eq!(
                names,
                [
                    "model.layers.0.mlp.shared_expert.up_proj.weight",
                    "model.layers.0.self_attn.rotary_emb.inv_freq"
                ]
            )
        }
        e => panic!("unexpected {e}"),
    }
    let dir = tempfile::tempdir().unwrap();
    let ts: Vec<Part> = all_parts(&inv, |_| Store::Bf16)
        .into_iter()
        .filter(|t| t.0 != "model.layers.1.mlp.experts.0.up_proj.weight")
        .collect();
    write_ckpt(dir.path(), TINY, &ts, 1);
    let e = model_inventory(dir.path()).unwrap_err();
    assert!(
        matches!(&e, CkptError::Plan(PlanError::MissingTensors { names, .. }) if names == &["model.layers.1.mlp.experts.0.up_proj.weight"]),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let ts: Vec<Part> = all_parts(&inv, |_| Store::Bf16)
        .into_iter()
        .map(|mut t| {
            if t.0 == "model.layers.0.self_attn.o_proj.weight" {
                t.2 = vec![64, 32];
            }
            t
        })
        .collect();
    write_ckpt(dir.path(), TINY, &ts, 1);
    let e = model_inventory(dir.path()).unwrap_err();
    assert!(
        e.to_string()
            .contains("model.layers.0.self_attn.o_proj.weight")
            && e.to_string().contains("[64, 64]"),
        "{e}"
    );
}

#[test]
fn malformed_files_and_indexes_are_errors_naming_the_file() {
    let inv = tiny_inv();
    let dir = tempfile::tempdir().unwrap();
    write_ckpt(dir.path(), TINY, &all_parts(&inv, |_| Store::Bf16), 2);
    // Truncate one shard: its header no longer fits the data.
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
    let e = model_inventory(dir.path()).unwrap_err();
    assert!(
        matches!(e, CkptError::Header { .. } | CkptError::TensorEntry { .. })
            && e.to_string().contains("model-00002-of-00002"),
        "{e}"
    );
    // An index naming a tensor its shard does not hold.
    let dir = tempfile::tempdir().unwrap();
    write_ckpt(dir.path(), TINY, &all_parts(&inv, |_| Store::Bf16), 1);
    let idx = dir.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    v["weight_map"]["ghost.weight"] = "model-00001-of-00001.safetensors".into();
    std::fs::write(&idx, v.to_string()).unwrap();
    let e = model_inventory(dir.path()).unwrap_err();
    assert!(e.to_string().contains("ghost.weight"), "{e}");
}

#[test]
fn audit_is_clean_when_the_checkpoint_stores_the_plan() {
    let inv = tiny_inv();
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    for nv in [Store::Nvfp4ModelOpt, Store::Nvfp4Ct] {
        let dir = tempfile::tempdir().unwrap();
        let fmt = |t: &TensorInfo| {
            if plan.by_hf(&t.hf).unwrap().format == Format::Nvfp4 {
                nv
            } else {
                Store::Bf16
            }
        };
        write_ckpt(dir.path(), TINY, &all_parts(&inv, fmt), 2);
        let (p2, report) = audit_dir(dir.path(), &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
        assert_eq!(p2.hash(), plan.hash());
        assert!(report.is_clean(), "{nv:?}: {}", report.render());
        assert_eq!(report.checked, inv.tensors().len());
    }
    let mx = resolve(&inv, &Recipe::preset("mxfp8").unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fmt = |t: &TensorInfo| {
        if mx.by_hf(&t.hf).unwrap().format == Format::Mxfp8 {
            Store::Mxfp8
        } else {
            Store::Bf16
        }
    };
    write_ckpt(dir.path(), TINY, &all_parts(&inv, fmt), 1);
    assert!(audit(&mx, &Checkpoint::open(dir.path()).unwrap().stored_tensors()).is_clean());
    // FP8 block needs K % 128 == 0; N = 64 rows still get ceil(64/128) = 1 scale row.
    let wide = TINY
        .replace("\"hidden_size\":64", "\"hidden_size\":128")
        .replace(
            "\"moe_intermediate_size\":32",
            "\"moe_intermediate_size\":128",
        )
        .replace("\"head_dim\":32", "\"head_dim\":64");
    let inv_w = Inventory::from_config_json(&wide, "wide").unwrap();
    let fp8 = Recipe::from_toml_str(
        "name = \"fp8\"\nbackward = \"lowp\"\ndefault = \"fp8_block\"",
        "fp8",
    )
    .unwrap();
    let plan_fp8 = resolve(&inv_w, &fp8).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_ckpt(
        dir.path(),
        &wide,
        &all_parts(&inv_w, |_| Store::Fp8Block),
        1,
    );
    let r = audit(
        &plan_fp8,
        &Checkpoint::open(dir.path()).unwrap().stored_tensors(),
    );
    assert!(r.is_clean(), "{}", r.render());
}

#[test]
fn audit_lists_every_drifted_tensor() {
    let inv = tiny_inv();
    let plan = resolve(&inv, &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let drift_bf16 = "model.layers.0.mlp.experts.1.down_proj.weight";
    let drift_mx = "model.layers.1.self_attn.o_proj.weight";
    let missing = "model.layers.1.mlp.experts.0.down_proj.weight";
    let fmt = |t: &TensorInfo| {
        if t.hf == drift_bf16 {
            Store::Bf16
        } else if t.hf == drift_mx {
            Store::Mxfp8
        } else if plan.by_hf(&t.hf).unwrap().format == Format::Nvfp4 {
            Store::Nvfp4ModelOpt
        } else {
            Store::Bf16
        }
    };
    let missing_prefix = missing.strip_suffix("weight").unwrap();
    let mut ts: Vec<Part> = all_parts(&inv, fmt)
        .into_iter()
        .filter(|p| !p.0.starts_with(missing_prefix))
        .collect();
    ts.push((
        "model.layers.0.mlp.experts.7.up_proj.weight".into(),
        Dtype::BF16,
        vec![32, 64],
    ));
    // An MXFP8 weight whose scale has the wrong shape is reported as unrecognized.
    let bad_scale = "model.layers.0.self_attn.q_proj.weight_scale_inv";
    ts.retain(|p| p.0 != "model.layers.0.self_attn.q_proj.weight");
    ts.push((
        "model.layers.0.self_attn.q_proj.weight".into(),
        Dtype::F8_E4M3,
        vec![64, 64],
    ));
    ts.push((bad_scale.into(), Dtype::U8, vec![64, 4]));
    write_ckpt(dir.path(), TINY, &ts, 2);
    let (_, report) = audit_dir(dir.path(), &Recipe::preset("nvfp4-hp").unwrap()).unwrap();
    assert!(!report.is_clean());
    let by: BTreeMap<&str, &mxrl_plan::AuditFinding> =
        report.findings.iter().map(|f| (f.hf.as_str(), f)).collect();
    assert_eq!(by.len(), 5, "{}", report.render());
    assert_eq!(by[drift_bf16].planned, Some(Format::Nvfp4));
    assert_eq!(by[drift_bf16].stored, Some(StoredFormat::Unquantized));
    assert_eq!(by[drift_mx].stored, Some(StoredFormat::Mxfp8));
    assert_eq!(by[missing].stored, None);
    assert_eq!(
        by["model.layers.0.mlp.experts.7.up_proj.weight"].planned,
        None
    );
    assert!(matches!(
        by["model.layers.0.self_attn.q_proj.weight"].stored,
        Some(StoredFormat::Unrecognized(_))
    ));
    let text = report.render();
    assert!(
        text.contains("5 differ") && text.contains(drift_mx),
        "{text}"
    );
}

#[test]
fn audit_checks_the_recorded_plan_hash() {
    let inv = tiny_inv();
    let plan = resolve(&inv, &Recipe::preset("mxfp8-hp").unwrap()).unwrap();
    let fmt = |t: &TensorInfo| {
        if plan.by_hf(&t.hf).unwrap().format == Format::Mxfp8 {
            Store::Mxfp8
        } else {
            Store::Bf16
        }
    };
    let dir = tempfile::tempdir().unwrap();
    write_ckpt_meta(
        dir.path(),
        TINY,
        &all_parts(&inv, fmt),
        2,
        Some(plan.hash()),
    );
    let (_, report) = audit_dir(dir.path(), &Recipe::preset("mxfp8-hp").unwrap()).unwrap();
    assert!(report.is_clean(), "{}", report.render());
    // Same bytes, but the shards say they were written for another plan (dequantized
    // backward): refused.
    let (_, report) = audit_dir(dir.path(), &Recipe::preset("mxfp8-dq").unwrap()).unwrap();
    assert!(report.findings.is_empty());
    assert_eq!(report.hash_mismatches.len(), 2);
    assert!(!report.is_clean());
    assert!(
        report.render().contains("records plan hash"),
        "{}",
        report.render()
    );
}
