//! Every command that reads a checkpoint rejects the same bad inputs the same way, and the
//! checkpoints current transformers writes convert and run:
//! - the transformers-5 Qwen3-MoE / Qwen2-MoE fixtures through `plan`, `convert` (SGLang
//!   MXFP8, ModelOpt and compressed-tensors NVFP4), `plan --audit`, `verify`, `inspect`,
//!   `dequantize` and `forward` of the converted checkpoint, whose logits equal the source's
//!   under the same recipe bit for bit;
//! - the shared malformed-config set (`mxrl-plan/tests/fixtures/malformed-configs.json`) and
//!   the corrupt-header corpus (`mxrl-ckpt/tests/corpus/headers`) through `inspect`, `plan`,
//!   `plan --audit`, `convert`, `verify`, `dequantize`, `forward`, `generate`, `sft --model`
//!   and `rl --model`: each exits non-zero with a message naming the file (and the config
//!   field), writes nothing, and never panics;
//! - a shard index that disagrees with its shards (omitted entry, a path outside the
//!   directory, a tensor no shard holds) refused by `forward`.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn mxrl(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_mxrl"))
        .args(args)
        .output()
        .expect("mxrl runs");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> String {
    let (success, out, err) = mxrl(args);
    assert!(success, "mxrl {args:?} failed:\n{err}");
    out
}

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

fn crates_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture(arch: &str) -> PathBuf {
    crates_dir().join("mxrl-model/tests/fixtures").join(arch)
}

/// A copy of a fixture's config.json and model.safetensors.
fn copy_fixture(arch: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(arch).join(f), dir.join(f)).unwrap();
    }
}

fn logits(file: &Path) -> Vec<u8> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("logits").unwrap().data().to_vec()
}

/// MXFP8 wherever the fixture's shapes allow it (K % 32 == 0: attention, dense gate/up; the
/// dense down projections (K = 16 / 24) fall back to BF16). Routed experts stay BF16: their
/// down projections cannot take MXFP8 here, and serving engines load a layer's experts as one
/// fused module, so a plan may not split them across formats (`convert` refuses it).
const MXFP8: &str = r#"
name = "mxfp8-fixture"
backward = "high_precision"
default = "bf16"
nvfp4_activation_scale = "per_token"
[[rule]]
role = "dense_mlp"
format = "mxfp8"
fallback = "bf16"
[[rule]]
role = "attn_q"
format = "mxfp8"
[[rule]]
role = "attn_k"
format = "mxfp8"
[[rule]]
role = "attn_v"
format = "mxfp8"
[[rule]]
role = "attn_o"
format = "mxfp8"
"#;

/// FP8-block is not among the formats: it needs K % 128 == 0 and every linear of these
/// fixtures has K <= 32, so it would store nothing quantized (the synthetic checkpoints of
/// `mxrl-ckpt` and `mxrl-model` cover it).
#[test]
fn transformers5_fixtures_plan_convert_verify_dequantize_and_forward_bitwise() {
    let d = tempfile::tempdir().unwrap();
    let mx = d.path().join("mxfp8.toml");
    std::fs::write(&mx, MXFP8).unwrap();
    let recipes: [(&str, &str); 3] = [
        (p(&mx), "modelopt"),
        ("nvfp4-hp", "modelopt"),
        ("nvfp4-hp", "compressed-tensors"),
    ];
    let tokens = "1,5,9,2,14,3,30,7";
    for arch in ["qwen3_moe", "qwen2_moe"] {
        let src = d.path().join(arch);
        copy_fixture(arch, &src);
        ok(&["plan", "--model", p(&src), "--recipe", "nvfp4-hp"]);
        let plain = d.path().join(format!("{arch}-f32.safetensors"));
        ok(&[
            "forward",
            "--model",
            p(&src),
            "--tokens",
            tokens,
            "--out",
            p(&plain),
        ]);
        for (i, (recipe, container)) in recipes.iter().enumerate() {
            let out = d.path().join(format!("{arch}-{i}"));
            ok(&[
                "convert",
                "--model",
                p(&src),
                "--recipe",
                recipe,
                "--format",
                container,
                "--out",
                p(&out),
            ]);
            ok(&["plan", "--audit", p(&out), "--recipe", recipe]);
            ok(&["verify", "--source", p(&src), "--converted", p(&out)]);
            ok(&["inspect", p(&out)]);
            let deq = d.path().join(format!("{arch}-{i}-bf16"));
            ok(&["dequantize", "--model", p(&out), "--out", p(&deq)]);
            let a = d.path().join(format!("{arch}-{i}-src.safetensors"));
            let b = d.path().join(format!("{arch}-{i}-conv.safetensors"));
            ok(&[
                "forward",
                "--model",
                p(&src),
                "--recipe",
                recipe,
                "--tokens",
                tokens,
                "--out",
                p(&a),
            ]);
            ok(&[
                "forward",
                "--model",
                p(&out),
                "--tokens",
                tokens,
                "--out",
                p(&b),
            ]);
            assert!(
                logits(&a) == logits(&b),
                "{arch} {recipe} {container}: converted logits differ from the source's"
            );
            // The recipe matters: the quantized model is not the f32 one.
            assert!(
                logits(&a) != logits(&plain),
                "{arch} {recipe}: nothing was quantized"
            );
        }
    }
}

/// Each command that reads the model directory `dir`, with its other arguments.
fn commands(dir: &Path, good: &Path, scratch: &Path) -> Vec<Vec<String>> {
    let s = |x: &str| x.to_string();
    let dir = p(dir).to_string();
    let out = p(&scratch.join("out")).to_string();
    let file = p(&scratch.join("f.safetensors")).to_string();
    let run = p(&scratch.join("run")).to_string();
    vec![
        vec![
            s("plan"),
            s("--model"),
            dir.clone(),
            s("--recipe"),
            s("nvfp4-hp"),
        ],
        vec![
            s("plan"),
            s("--audit"),
            dir.clone(),
            s("--recipe"),
            s("nvfp4-hp"),
        ],
        vec![
            s("convert"),
            s("--model"),
            dir.clone(),
            s("--recipe"),
            s("nvfp4-hp"),
            s("--out"),
            out.clone(),
        ],
        vec![
            s("verify"),
            s("--source"),
            dir.clone(),
            s("--converted"),
            p(good).to_string(),
        ],
        vec![s("dequantize"), s("--model"), dir.clone(), s("--out"), out],
        vec![
            s("forward"),
            s("--model"),
            dir.clone(),
            s("--tokens"),
            s("1,2"),
            s("--out"),
            file,
        ],
        vec![
            s("generate"),
            s("--model"),
            dir.clone(),
            s("--tokens"),
            s("1,2"),
            s("--max-new-tokens"),
            s("2"),
        ],
        vec![
            s("sft"),
            s("--model"),
            dir.clone(),
            s("--steps"),
            s("1"),
            s("--out"),
            run.clone(),
        ],
        vec![
            s("rl"),
            s("--model"),
            dir,
            s("--recipe"),
            s("nvfp4-hp"),
            s("--steps"),
            s("1"),
            s("--out"),
            run,
        ],
    ]
}

fn expect_named_error(args: &[String], case: &str, needles: &[&str]) {
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (success, _, err) = mxrl(&argv);
    assert!(!success, "{case}: mxrl {argv:?} accepted it");
    assert!(
        !err.contains("panicked"),
        "{case}: mxrl {argv:?} panicked:\n{err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{case}: mxrl {argv:?}: `{err}` does not name `{n}`"
        );
    }
}

/// A converted checkpoint of the Qwen3-MoE fixture (the other side of `verify`).
fn good_converted(root: &Path) -> PathBuf {
    let src = root.join("good-src");
    copy_fixture("qwen3_moe", &src);
    let out = root.join("good");
    ok(&[
        "convert",
        "--model",
        p(&src),
        "--recipe",
        "nvfp4-hp",
        "--out",
        p(&out),
    ]);
    out
}

#[test]
fn malformed_configs_are_rejected_by_every_command_naming_file_and_field() {
    let set: Value = serde_json::from_str(
        &std::fs::read_to_string(
            crates_dir().join("mxrl-plan/tests/fixtures/malformed-configs.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let root = tempfile::tempdir().unwrap();
    let good = good_converted(root.path());
    let cases = set["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let mut v = base.clone();
        let o = v.as_object_mut().unwrap();
        for (k, x) in c["set"].as_object().into_iter().flatten() {
            o.insert(k.clone(), x.clone());
        }
        for k in c["remove"].as_array().into_iter().flatten() {
            o.remove(k.as_str().unwrap());
        }
        let dir = root.path().join(name);
        copy_fixture("qwen3_moe", &dir);
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&v).unwrap(),
        )
        .unwrap();
        let scratch = root.path().join(format!("{name}-scratch"));
        std::fs::create_dir_all(&scratch).unwrap();
        for args in commands(&dir, &good, &scratch) {
            expect_named_error(&args, name, &["config.json", c["field"].as_str().unwrap()]);
        }
        assert!(!scratch.join("out").exists() && !scratch.join("out.partial").exists());
        assert!(!scratch.join("run").join("model.safetensors").exists());
    }
}

#[test]
fn corrupt_headers_are_rejected_by_every_command_naming_the_file() {
    let corpus = crates_dir().join("mxrl-ckpt/tests/corpus/headers");
    let root = tempfile::tempdir().unwrap();
    let good = good_converted(root.path());
    let mut cases: Vec<(String, Vec<u8>)> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|f| f.extension().is_some_and(|x| x == "st"))
        .map(|f| {
            (
                f.file_stem().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&f).unwrap(),
            )
        })
        .collect();
    // The fixture's weights cut in half.
    let whole = std::fs::read(fixture("qwen3_moe").join("model.safetensors")).unwrap();
    cases.push(("cut_in_half".into(), whole[..whole.len() / 2].to_vec()));
    cases.sort();
    assert!(cases.len() >= 24);
    for (name, bytes) in &cases {
        let dir = root.path().join(name);
        copy_fixture("qwen3_moe", &dir);
        let st = dir.join("model.safetensors");
        std::fs::write(&st, bytes).unwrap();
        let scratch = root.path().join(format!("{name}-scratch"));
        std::fs::create_dir_all(&scratch).unwrap();
        let mut all = commands(&dir, &good, &scratch);
        all.push(vec!["inspect".into(), p(&st).into()]);
        all.push(vec!["inspect".into(), p(&dir).into()]);
        for args in all {
            expect_named_error(&args, name, &["model.safetensors"]);
        }
    }
}

#[test]
fn forward_refuses_an_index_that_disagrees_with_the_shards() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m");
    copy_fixture("qwen3_moe", &dir);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = st.names().into_iter().cloned().collect();
    std::fs::rename(
        dir.join("model.safetensors"),
        dir.join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    let write_index = |map: serde_json::Map<String, Value>| {
        let idx = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), idx.to_string()).unwrap();
    };
    let shard = "model-00001-of-00001.safetensors";
    let full: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| (n.clone(), Value::from(shard)))
        .collect();
    let fwd = |case: &str, needle: &str| {
        let out = root.path().join("f.safetensors");
        let args: Vec<String> = [
            "forward",
            "--model",
            p(&dir),
            "--tokens",
            "1,2",
            "--out",
            p(&out),
        ]
        .map(String::from)
        .to_vec();
        expect_named_error(&args, case, &["model.safetensors.index.json", needle]);
    };
    // An index entry omitted: the tensor is in the shard but not indexed.
    let mut m = full.clone();
    m.remove(&names[0]);
    write_index(m);
    fwd("omitted", &names[0]);
    // An index pointing outside the directory.
    let mut m = full.clone();
    m.insert(names[0].clone(), Value::from("../elsewhere.safetensors"));
    write_index(m);
    fwd("outside", "../elsewhere.safetensors");
    // A tensor indexed to a shard that does not hold it.
    let mut m = full.clone();
    m.insert("ghost.weight".into(), Value::from(shard));
    write_index(m);
    fwd("ghost", "ghost.weight");
    // The complete index runs.
    write_index(full);
    ok(&[
        "forward",
        "--model",
        p(&dir),
        "--tokens",
        "1,2",
        "--out",
        p(&root.path().join("f.safetensors")),
    ]);
}
