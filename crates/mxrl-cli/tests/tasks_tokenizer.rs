//! The chain task and the trained BPE tokenizer through the `mxrl` binary: `tokenizer train`
//! writes a tokenizer.json the tokenizers crate loads; `sft --tokenizer` builds a model of
//! that vocabulary; `rl`, `ablate`, `generate` and `demo` run on it with `--task chain` or a
//! prompt file; bad settings are named before anything runs.

use std::path::Path;

mod common;
use common::{fails, ok};

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The smallest RL run: one step of 2 prompts × 2 samples.
const TINY: [&str; 6] = ["--steps", "1", "--prompts-per-step", "2", "--samples", "2"];

#[test]
fn a_trained_tokenizer_makes_a_model_that_sft_rl_ablate_and_generate_run_on() {
    let d = tempfile::tempdir().unwrap();
    let cwd = d.path();
    let chain = [
        "--task",
        "chain",
        "--digits",
        "2",
        "--ops",
        "2",
        "--operators",
        "+*",
    ];
    let mut train = vec!["tokenizer", "train", "--out", "tok", "--vocab-size", "320"];
    train.extend(chain);
    let out = ok(&train, cwd);
    assert!(
        out.contains("320 tokens") && out.contains("merges"),
        "{out}"
    );
    let mut names: Vec<String> = std::fs::read_dir(cwd.join("tok"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["tokenizer.json", "tokenizer_config.json"],
        "temporary files left behind"
    );
    // Hugging Face tooling's companion file names the fast tokenizer and its specials.
    let tc = json(&cwd.join("tok/tokenizer_config.json"));
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(tc["eos_token"], "<eos>");
    let file = cwd.join("tok/tokenizer.json");
    let tok = tokenizers::Tokenizer::from_file(&file).unwrap();
    assert_eq!(tok.get_vocab_size(true), 320);
    assert_eq!(tok.token_to_id("<eos>"), Some(2));
    let ids = tok.encode("12*34+56=", false).unwrap();
    assert_eq!(tok.decode(ids.get_ids(), true).unwrap(), "12*34+56=");
    // An existing tokenizer is kept unless --force.
    let before = std::fs::read(&file).unwrap();
    let e = fails(&train, cwd);
    assert!(
        e.contains("tokenizer.json: already exists") && e.contains("--force"),
        "{e}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), before);

    // sft --tokenizer: the model's vocabulary is the tokenizer's, the file is copied.
    let mut sft = vec![
        "sft",
        "--tokenizer",
        "tok/tokenizer.json",
        "--out",
        "m",
        "--steps",
        "3",
        "--batch",
        "8",
    ];
    sft.extend(chain);
    ok(&sft, cwd);
    let cfg = json(&cwd.join("m/config.json"));
    assert_eq!(cfg["vocab_size"], 320, "{cfg}");
    assert_eq!(cfg["eos_token_id"], 2, "{cfg}");
    assert_eq!(std::fs::read(cwd.join("m/tokenizer.json")).unwrap(), before);
    // A --model brings its own tokenizer: the two are refused together.
    let e = fails(
        &["sft", "--model", "m", "--tokenizer", "tok", "--out", "m2"],
        cwd,
    );
    assert!(e.contains("--tokenizer") && e.contains("--model"), "{e}");

    // rl on the chain task: the run records the task; a short response limit is warned about.
    let mut rl = vec!["rl", "--model", "m", "--out", "r", "--max-new-tokens", "3"];
    rl.extend(TINY);
    rl.extend(chain);
    let out = ok(&rl, cwd);
    assert!(
        out.contains("answers take up to 6 characters") && out.contains("--max-new-tokens 3"),
        "{out}"
    );
    let task = json(&cwd.join("r/run.json"))["task"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        task.contains("chains, 2 operations from `+*`") && task.contains("up to 2 digit"),
        "{task}"
    );
    // ablate on it too (one recipe, no noise seeds): its report has the new sections.
    let mut ab = vec![
        "ablate",
        "--model",
        "m",
        "--out",
        "ab",
        "--recipes",
        "bf16,mxfp8",
        "--noise-seeds",
        "none",
        "--max-new-tokens",
        "6",
    ];
    ab.extend(TINY);
    ab.extend(chain);
    ok(&ab, cwd);
    let md = std::fs::read_to_string(cwd.join("ab/report.md")).unwrap();
    assert!(md.contains("chains, 2 operations"), "{md}");
    assert!(
        md.contains("## Speedups vs BF16") && md.contains("## Per-layer drift"),
        "{md}"
    );
    assert!(cwd.join("ab/drift.png").exists() && cwd.join("ab/train.png").exists());
    // generate decodes with the trained tokenizer.
    let out = ok(
        &[
            "generate",
            "--model",
            "m",
            "--prompt",
            "12*3+4=",
            "--max-new-tokens",
            "4",
        ],
        cwd,
    );
    // The prompt is encoded by the model directory's tokenizer (merges included).
    let want: Vec<String> = tok
        .encode("12*3+4=", false)
        .unwrap()
        .get_ids()
        .iter()
        .map(|i| i.to_string())
        .collect();
    assert!(want.len() < "12*3+4=".len(), "{want:?}");
    assert!(
        out.contains(&format!("prompt tokens: {}\n", want.join(","))),
        "{out}"
    );

    // A prompt file works with the same model and tokenizer (Answer: X reward).
    std::fs::write(
        cwd.join("p.jsonl"),
        "{\"prompt\": \"12*3+4=\", \"label\": \"40\"}\n{\"prompt\": \"5+6*7=\", \"label\": 47}\n",
    )
    .unwrap();
    let mut rl = vec!["rl", "--model", "m", "--out", "rd", "--data", "p.jsonl"];
    rl.extend(TINY);
    ok(&rl, cwd);
    let task = json(&cwd.join("rd/run.json"))["task"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        task.contains("p.jsonl") && task.contains("sha256"),
        "{task}"
    );
    ok(
        &[
            "tokenizer",
            "train",
            "--out",
            "tokd",
            "--data",
            "p.jsonl",
            "--vocab-size",
            "300",
        ],
        cwd,
    );
    let t = tokenizers::Tokenizer::from_file(cwd.join("tokd/tokenizer.json")).unwrap();
    assert_eq!(t.get_vocab_size(true), 300);
}

#[test]
fn bad_task_and_tokenizer_settings_are_named_before_anything_runs() {
    let d = tempfile::tempdir().unwrap();
    let cwd = d.path();
    for (args, want) in [
        (
            &["sft", "--out", "x", "--task", "chain", "--ops", "0"][..],
            "setting `ops`",
        ),
        (
            &["sft", "--out", "x", "--task", "chain", "--operators", "+/"][..],
            "`/`",
        ),
        (&["sft", "--out", "x", "--ops", "2"][..], "--task chain"),
        (
            &["sft", "--out", "x", "--task", "chains"][..],
            "unknown task",
        ),
        (
            &[
                "sft", "--out", "x", "--task", "chain", "--ops", "5", "--digits", "4",
            ][..],
            "more than an i64 holds",
        ),
        (
            &["sft", "--out", "x", "--tokenizer", "missing.json"][..],
            "missing.json",
        ),
        (
            &["tokenizer", "train", "--out", "t", "--vocab-size", "100"][..],
            "vocab size 100",
        ),
        (
            &[
                "tokenizer",
                "train",
                "--out",
                "t",
                "--task",
                "chain",
                "--operators",
                "-+-",
            ][..],
            "appears twice",
        ),
        (
            &["demo", "--out", "dm", "--task", "chain", "--ops", "17"][..],
            "setting `ops`",
        ),
        // --worked is a setting of the chain task: refused elsewhere, not ignored.
        (&["sft", "--out", "x", "--worked"][..], "--task chain"),
        (
            &["sft", "--out", "x", "--task", "arithmetic", "--worked"][..],
            "setting `worked`",
        ),
        (
            &[
                "tokenizer",
                "train",
                "--out",
                "t",
                "--data",
                "p.jsonl",
                "--worked",
            ][..],
            "setting `worked`",
        ),
        (&["demo", "--out", "dm", "--worked"][..], "--task chain"),
        (
            &[
                "demo", "--out", "dm", "--task", "chain", "--worked", "--ops", "0",
            ][..],
            "setting `ops`",
        ),
    ] {
        let e = fails(args, cwd);
        assert!(e.contains(want), "mxrl {args:?}: {e}");
    }
    // Nothing was created by the refused commands.
    let left: Vec<_> = std::fs::read_dir(cwd).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A demo warm-up records its task and auxiliary loss coefficient (`warmup.json`) and is not
/// reused for another task, tokenizer or coefficient; with `--aux-loss-coef` the warm-up
/// shows the loss and every run of the demo trains with it.
#[test]
fn demo_records_its_warm_up_and_refuses_to_reuse_it_for_another_task_or_aux_loss() {
    let d = tempfile::tempdir().unwrap();
    let cwd = d.path();
    ok(
        &[
            "tokenizer",
            "train",
            "--out",
            "tok",
            "--task",
            "chain",
            "--ops",
            "2",
        ],
        cwd,
    );
    let demo = [
        "demo",
        "--out",
        "dm",
        "--task",
        "chain",
        "--ops",
        "2",
        "--tokenizer",
        "tok/tokenizer.json",
        "--recipes",
        "bf16",
        "--steps",
        "1",
        "--sft-steps",
        "1",
    ];
    ok(&demo, cwd);
    let w = json(&cwd.join("dm/warmup.json"));
    assert!(
        w["task"].as_str().unwrap().contains("chains, 2 operations"),
        "{w}"
    );
    assert_eq!(json(&cwd.join("dm/base/config.json"))["vocab_size"], 384);
    let md = std::fs::read_to_string(cwd.join("dm/report.md")).unwrap();
    assert!(md.contains("chains, 2 operations"), "{md}");
    assert!(!md.contains("Training routing balance"), "{md}");
    assert!(w.get("aux_loss_coef").is_none(), "{w}");
    assert!(json(&cwd.join("dm/bf16/run.json"))["config"]
        .get("aux_loss_coef")
        .is_none());
    // The same warm-up with the auxiliary loss is another model: refused, naming both.
    let with_aux: Vec<&str> = demo
        .iter()
        .copied()
        .chain(["--aux-loss-coef", "0.01"])
        .collect();
    let e = fails(&with_aux, cwd);
    assert!(
        e.contains("dm/base") && e.contains("--aux-loss-coef 0, not 0.01"),
        "{e}"
    );
    // The default task on the same directory would reuse a model warmed up on chains.
    let e = fails(&["demo", "--out", "dm", "--steps", "1"], cwd);
    assert!(
        e.contains("dm/base") && e.contains("trained on synthetic arithmetic chains"),
        "{e}"
    );
    // So would another tokenizer.
    ok(
        &[
            "tokenizer",
            "train",
            "--out",
            "tok2",
            "--task",
            "chain",
            "--ops",
            "2",
            "--vocab-size",
            "400",
        ],
        cwd,
    );
    let mut other = demo;
    other[8] = "tok2/tokenizer.json";
    let e = fails(&other, cwd);
    assert!(
        e.contains("another tokenizer than tok2/tokenizer.json"),
        "{e}"
    );
    // And the char-level default.
    let e = fails(&demo[..7], cwd);
    assert!(
        e.contains("another tokenizer than the char-level one"),
        "{e}"
    );
    // A warm-up with the auxiliary loss records its coefficient, every run of the demo
    // trains with it, and it is not reused without it.
    let aux = [
        "demo",
        "--out",
        "da",
        "--recipes",
        "bf16",
        "--steps",
        "1",
        "--sft-steps",
        "1",
        "--aux-loss-coef",
        "0.01",
    ];
    let out = ok(&aux, cwd);
    assert!(
        out.contains("sft step 1/1: loss ") && out.contains(" aux "),
        "{out}"
    );
    let md = std::fs::read_to_string(cwd.join("da/report.md")).unwrap();
    assert!(md.contains("## Training routing balance"), "{md}");
    let w = json(&cwd.join("da/warmup.json"));
    assert_eq!(w["aux_loss_coef"].as_f64().unwrap() as f32, 0.01, "{w}");
    for run in ["bf16", "bf16-seed2", "bf16-seed3"] {
        let c = &json(&cwd.join("da").join(run).join("run.json"))["config"];
        assert_eq!(
            c["aux_loss_coef"].as_f64().unwrap() as f32,
            0.01,
            "{run}: {c}"
        );
    }
    let e = fails(&aux[..9], cwd);
    assert!(
        e.contains("da/base") && e.contains("--aux-loss-coef 0.01, not 0"),
        "{e}"
    );
}

/// `--worked` through the binary: `sft` trains on the worked responses, `rl` and `ablate`
/// record the worked task in run.json / the report and warn about a response limit shorter
/// than the longest working; a run directory or a demo warm-up of the worked task is not
/// resumed or reused for the answer-only one (nor the other way round).
#[test]
fn worked_chain_runs_record_their_task_and_are_not_mixed_with_answer_only_runs() {
    let d = tempfile::tempdir().unwrap();
    let cwd = d.path();
    let chain = [
        "--task",
        "chain",
        "--ops",
        "2",
        "--operators",
        "+*",
        "--worked",
    ];
    let mut sft = vec!["sft", "--out", "m", "--steps", "2", "--batch", "8"];
    sft.extend(chain);
    ok(&sft, cwd);

    // 1-digit chains of 2 operations from `+*`: values up to 9³ = 729, so steps of at most
    // 3·3 + 2 characters, 2 of them, ", ", ". #" and the answer: 30 characters.
    let mut rl = vec!["rl", "--model", "m", "--out", "r", "--max-new-tokens", "8"];
    rl.extend(TINY);
    rl.extend(chain);
    let out = ok(&rl, cwd);
    assert!(
        out.contains("worked responses take up to 30 characters")
            && out.contains("--max-new-tokens 8"),
        "{out}"
    );
    let task = json(&cwd.join("r/run.json"))["task"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        task.contains("chains, 2 operations from `+*`") && task.contains("worked responses"),
        "{task}"
    );
    // The same directory without --worked is another run: refused, the task named.
    let answer_only: Vec<&str> = rl.iter().copied().filter(|a| *a != "--worked").collect();
    let e = fails(&answer_only, cwd);
    assert!(
        e.contains("holds another run") && e.contains("task:") && e.contains("worked"),
        "{e}"
    );
    // Long enough: no warning.
    let mut rl = vec![
        "rl",
        "--model",
        "m",
        "--out",
        "r30",
        "--max-new-tokens",
        "30",
    ];
    rl.extend(TINY);
    rl.extend(chain);
    let out = ok(&rl, cwd);
    assert!(!out.contains("take up to"), "{out}");

    let mut ab = vec![
        "ablate",
        "--model",
        "m",
        "--out",
        "ab",
        "--recipes",
        "bf16",
        "--noise-seeds",
        "none",
        "--max-new-tokens",
        "30",
    ];
    ab.extend(TINY);
    ab.extend(chain);
    ok(&ab, cwd);
    let md = std::fs::read_to_string(cwd.join("ab/report.md")).unwrap();
    assert!(md.contains("worked responses"), "{md}");
    let answer_only: Vec<&str> = ab.iter().copied().filter(|a| *a != "--worked").collect();
    let e = fails(&answer_only, cwd);
    assert!(e.contains("task") && e.contains("worked"), "{e}");

    // demo: the warm-up records the worked task and is not reused for the answer-only one.
    let mut demo = vec!["demo", "--out", "dm", "--warmup-only", "--sft-steps", "1"];
    demo.extend(chain);
    ok(&demo, cwd);
    let w = json(&cwd.join("dm/warmup.json"));
    assert!(
        w["task"].as_str().unwrap().contains("worked responses"),
        "{w}"
    );
    let answer_only: Vec<&str> = demo.iter().copied().filter(|a| *a != "--worked").collect();
    let e = fails(&answer_only, cwd);
    assert!(
        e.contains("dm/base") && e.contains("trained on") && e.contains("worked responses"),
        "{e}"
    );
}

/// `demo --size real`: Qwen3-30B-A3B's layer shape, refused on the CPU without `--allow-cpu`
/// (and `--layers` refused for the other sizes); with it, and the widths divided by 8 (the
/// test-only `--real-shrink`), the whole path runs: a BPE tokenizer trained on the chain
/// task's text into the run directory (loadable by the tokenizers crate, with its
/// `tokenizer_config.json`), a model of that vocabulary and the real shape's structure (Qwen3
/// q/k norms, `norm_topk_prob`, every layer MoE), an SFT warm-up that measures the reward of
/// sampled answers, and the RL ablation.
#[test]
fn demo_real_size_trains_its_tokenizer_and_runs_the_real_layer_structure() {
    let d = tempfile::tempdir().unwrap();
    let cwd = d.path();
    let e = fails(&["demo", "--size", "real", "--out", "dr"], cwd);
    assert!(
        e.contains("--device cuda") && e.contains("--allow-cpu"),
        "{e}"
    );
    assert!(
        !cwd.join("dr").exists(),
        "a refused demo wrote its directory"
    );
    let e = fails(&["demo", "--layers", "2", "--out", "ds"], cwd);
    assert!(e.contains("--layers") && e.contains("--size real"), "{e}");
    let out = ok(
        &[
            "demo",
            "--size",
            "real",
            "--allow-cpu",
            "--real-shrink",
            "8",
            "--layers",
            "2",
            "--out",
            "dr",
            "--recipes",
            "bf16",
            "--steps",
            "1",
            "--sft-steps",
            "10",
        ],
        cwd,
    );
    assert!(out.contains("reward"), "{out}");
    for dir in ["dr/tokenizer", "dr/base"] {
        let tok = tokenizers::Tokenizer::from_file(cwd.join(dir).join("tokenizer.json")).unwrap();
        assert_eq!(tok.get_vocab_size(true), 512, "{dir}");
        let ids = tok.encode("7+5*3-8=", false).unwrap();
        assert_eq!(tok.decode(ids.get_ids(), true).unwrap(), "7+5*3-8=");
        let tc = json(&cwd.join(dir).join("tokenizer_config.json"));
        assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast", "{dir}");
    }
    let c = json(&cwd.join("dr/base/config.json"));
    assert_eq!(c["model_type"], "qwen3_moe", "{c}");
    assert_eq!(c["vocab_size"], 512, "{c}");
    assert_eq!(c["num_hidden_layers"], 2, "{c}");
    assert_eq!(c["hidden_size"], 2048 / 8, "{c}");
    assert_eq!(c["head_dim"], 128, "{c}");
    assert_eq!(c["num_attention_heads"], 32 / 8, "{c}");
    assert_eq!(c["num_key_value_heads"], 1, "{c}");
    assert_eq!(c["num_experts"], 128 / 8, "{c}");
    assert_eq!(c["num_experts_per_tok"], 8, "{c}");
    assert_eq!(c["moe_intermediate_size"], 768 / 8, "{c}");
    assert_eq!(c["norm_topk_prob"], true, "{c}");
    let w = json(&cwd.join("dr/warmup.json"));
    assert!(w["task"].as_str().unwrap().contains("chains"), "{w}");
    assert!(cwd.join("dr/report.md").exists());
}
