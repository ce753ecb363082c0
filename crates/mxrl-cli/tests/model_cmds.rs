//! `mxrl forward` and `mxrl generate` against the library they wrap.

use mxrl_model::{ForwardOptions, Model, ModelConfig, SamplingParams, SeqInput};
use std::path::Path;
use std::process::Command;

fn tiny_model(dir: &Path) -> Model {
    let mut c = ModelConfig::tiny();
    c.initializer_range = 0.3;
    let m = Model::random(&c, 5).unwrap();
    mxrl_model::hf::save_hf(&m, dir).unwrap();
    // a word-level tokenizer: "w{i}" ↔ id i
    let vocab: serde_json::Map<String, serde_json::Value> = (0..c.vocab_size)
        .map(|i| (format!("w{i}"), serde_json::Value::from(i)))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    m
}

fn mxrl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mxrl"))
        .args(args)
        .output()
        .expect("mxrl runs")
}

fn line<'a>(stdout: &'a str, key: &str) -> &'a str {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no `{key}` line in {stdout}"))
        .trim()
}

#[test]
fn forward_writes_the_library_logits_and_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(dir.path());
    let out = dir.path().join("fwd.safetensors");
    let o = mxrl(&[
        "forward",
        "--model",
        dir.path().to_str().unwrap(),
        "--tokens",
        "1,2,3,4,30",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> (Vec<usize>, Vec<f32>) {
        let t = st.tensor(n).unwrap();
        let v = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (t.shape().to_vec(), v)
    };
    let (ls, logits) = f32s("logits");
    let (ps, logprobs) = f32s("logprobs");
    assert_eq!(ls, vec![5, 32]);
    assert_eq!(ps, vec![4]);
    let toks = [1u32, 2, 3, 4, 30];
    let want = m
        .forward(
            &[SeqInput::next_token(&toks)],
            &ForwardOptions {
                return_logits: true,
                ..Default::default()
            },
        )
        .unwrap();
    // same code path, same inputs: the first T-1 rows are bit-identical
    assert_eq!(&logits[..4 * 32], &want.logits.unwrap()[0][..]);
    assert_eq!(logprobs, want.logprobs[0]);
}

/// `mxrl generate --model DIR --tokens 1,2,3` greedily for 5 tokens prints the tokens `model`
/// generates itself; returns the command's stdout and those tokens.
fn greedy_generate_matches(dir: &str, model: &Model) -> (String, Vec<u32>) {
    let o = mxrl(&[
        "generate",
        "--model",
        dir,
        "--tokens",
        "1,2,3",
        "--temperature",
        "0",
        "--max-new-tokens",
        "5",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let g = &model
        .generate(
            &[&[1, 2, 3]],
            &SamplingParams {
                temperature: 0.0,
                max_new_tokens: 5,
                ..Default::default()
            },
        )
        .unwrap()[0];
    let want = g
        .tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(line(&stdout, "new tokens:"), want);
    (stdout, g.tokens.clone())
}

#[test]
fn generate_from_tokens_and_from_text() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_model(dir.path());
    let d = dir.path().to_str().unwrap();
    let (_, tokens) = greedy_generate_matches(d, &m);
    let want = tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let o = mxrl(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "w1 w2 w3",
        "--temperature",
        "0",
        "--max-new-tokens",
        "5",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(line(&stdout, "prompt tokens:"), "1,2,3");
    assert_eq!(line(&stdout, "new tokens:"), want);
    let text: Vec<String> = tokens.iter().map(|t| format!("w{t}")).collect();
    assert_eq!(line(&stdout, "text:"), text.join(" "));
}

#[test]
fn out_of_vocabulary_token_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let out = dir.path().join("x.safetensors");
    let o = mxrl(&[
        "forward",
        "--model",
        dir.path().to_str().unwrap(),
        "--tokens",
        "1,99",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("token id 99"));
    assert!(!out.exists(), "a failed run must not leave an output file");
}

#[test]
fn forward_with_a_recipe_quantizes_per_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let d = dir.path().to_str().unwrap();
    let run = |extra: &[&str], name: &str| -> Vec<u8> {
        let out = dir.path().join(name);
        let mut args = vec![
            "forward",
            "--model",
            d,
            "--tokens",
            "1,2,3,4",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = mxrl(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read(out).unwrap()
    };
    let plain = run(&[], "a.safetensors");
    let nvfp4 = run(&["--recipe", "nvfp4-dq"], "b.safetensors");
    let logits = |b: &[u8]| -> Vec<u8> {
        safetensors::SafeTensors::deserialize(b)
            .unwrap()
            .tensor("logits")
            .unwrap()
            .data()
            .to_vec()
    };
    assert_ne!(logits(&plain), logits(&nvfp4), "the recipe changed nothing");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&nvfp4).unwrap();
    let p = meta.metadata().as_ref().unwrap()["precision"].clone();
    assert!(p.starts_with("recipe nvfp4-dq, plan "), "{p}");
    let o = mxrl(&[
        "forward",
        "--model",
        d,
        "--tokens",
        "1",
        "--recipe",
        "no-such-recipe",
        "--out",
        "/dev/null/x",
    ]);
    assert!(!o.status.success());
}

/// `mxrl forward` and `mxrl generate` take an `mxrl convert` output (detected by its
/// mxrl.json): the logprobs are bitwise those of the library's converted-checkpoint loader and
/// of the original model under the same plan, generation matches the library, and an extra
/// `--recipe` is refused.
#[test]
fn forward_and_generate_run_a_converted_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    tiny_model(&src);
    let dst = dir.path().join("nvfp4");
    let recipe = mxrl_plan::Recipe::load("nvfp4-dq").unwrap();
    mxrl_ckpt::convert(
        &src,
        &recipe,
        "nvfp4-dq",
        &dst,
        &mxrl_ckpt::ConvertOptions::default(),
        &mxrl_ckpt::NoProgress,
    )
    .unwrap();
    let loaded = Model::load_converted(&dst).unwrap();
    let mut orig = Model::load_hf(&src).unwrap();
    let inv = mxrl_ckpt::model_inventory(&src).unwrap();
    orig.apply_plan(&mxrl_plan::resolve(&inv, &recipe).unwrap())
        .unwrap();
    let d = dst.to_str().unwrap();
    let out = dir.path().join("fwd.safetensors");
    let o = mxrl(&[
        "forward",
        "--model",
        d,
        "--tokens",
        "1,2,3,4,30",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logprobs: Vec<f32> = st
        .tensor("logprobs")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let toks = [1u32, 2, 3, 4, 30];
    for m in [&loaded, &orig] {
        let want = m
            .forward(&[SeqInput::next_token(&toks)], &ForwardOptions::default())
            .unwrap();
        assert_eq!(logprobs, want.logprobs[0]);
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let precision = &meta.metadata().as_ref().unwrap()["precision"];
    assert!(
        precision.contains("converted") && precision.contains("nvfp4-dq"),
        "{precision}"
    );

    let (stdout, _) = greedy_generate_matches(d, &loaded);
    assert!(line(&stdout, "weights:").contains("converted"), "{stdout}");

    let o = mxrl(&[
        "forward",
        "--model",
        d,
        "--tokens",
        "1,2",
        "--recipe",
        "mxfp8",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("converted checkpoint") && err.contains("--recipe"),
        "{err}"
    );
}
