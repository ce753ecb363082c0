//! A newcomer's first hour, end to end through the `mxrl` binary: runs that cannot be
//! silently mixed, options refused at parse time, non-finite training, `eos_token_id` in the
//! models the project writes, plain progress lines without a terminal, single-run reports,
//! and errors that name their path.

use std::path::{Path, PathBuf};
use std::process::Stdio;

mod common;
use common::{fails, mxrl, ok};

/// A briefly warmed-up demo model in `cwd/base` (30 SFT steps: enough to answer and stop).
fn base(cwd: &Path) -> PathBuf {
    ok(
        &[
            "sft", "--out", "base", "--steps", "30", "--batch", "32", "--lr", "0.01",
        ],
        cwd,
    );
    cwd.join("base")
}

/// The smallest RL run: one step of 2 prompts × 2 samples.
const TINY: [&str; 8] = [
    "--steps",
    "1",
    "--prompts-per-step",
    "2",
    "--samples",
    "2",
    "--max-new-tokens",
    "2",
];

#[test]
fn sft_writes_eos_token_id_generate_stops_there_and_an_existing_out_needs_force() {
    let d = tempfile::tempdir().unwrap();
    let m = base(d.path());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("config.json")).unwrap()).unwrap();
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(m.join("tokenizer.json")).unwrap()).unwrap();
    assert_eq!(cfg["eos_token_id"], tok["model"]["vocab"]["<eos>"], "{cfg}");
    assert!(!d.path().join("base.partial").exists());
    let gen = [
        "generate",
        "--model",
        "base",
        "--prompt",
        "3+4=",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
    ];
    let out = ok(&gen, d.path());
    assert!(out.contains("finished:      stop token"), "{out}");
    // The same model without eos_token_id runs on to the length limit: the key is what stops it.
    let mut no_eos = cfg.clone();
    no_eos.as_object_mut().unwrap().remove("eos_token_id");
    std::fs::write(m.join("config.json"), no_eos.to_string()).unwrap();
    let out = ok(&gen, d.path());
    assert!(out.contains("finished:      max_new_tokens"), "{out}");
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();

    // A second sft into the same directory is refused before training and changes nothing.
    let before = std::fs::read(m.join("model.safetensors")).unwrap();
    let e = fails(&["sft", "--out", "base", "--steps", "2"], d.path());
    assert!(
        e.contains("base: already exists") && e.contains("--force"),
        "{e}"
    );
    assert_eq!(std::fs::read(m.join("model.safetensors")).unwrap(), before);
    ok(
        &[
            "sft", "--out", "base", "--steps", "2", "--batch", "4", "--force",
        ],
        d.path(),
    );
    assert_ne!(std::fs::read(m.join("model.safetensors")).unwrap(), before);
}

#[test]
fn bad_numbers_are_refused_at_parse_time_naming_the_option() {
    let d = tempfile::tempdir().unwrap();
    for (args, want) in [
        (
            &["sft", "--out", "x", "--lr", "nan"][..],
            "'--lr <LR>': `nan` is not finite",
        ),
        (
            &["sft", "--out", "x", "--lr", "-1"][..],
            "'--lr <LR>': -1 must be > 0",
        ),
        (
            &["sft", "--out", "x", "--steps", "0"][..],
            "'--steps <STEPS>': must be at least 1",
        ),
        (
            &["sft", "--out", "x", "--batch", "0"][..],
            "'--batch <BATCH>': must be at least 1",
        ),
        (
            &["rl", "--model", "m", "--steps", "0"][..],
            "'--steps <STEPS>'",
        ),
        (&["rl", "--model", "m", "--lr", "-1"][..], "-1 must be > 0"),
        (
            &["rl", "--model", "m", "--kl-coef", "-1"][..],
            "-1 must be ≥ 0",
        ),
        (
            &["rl", "--model", "m", "--samples", "1"][..],
            "every advantage is 0",
        ),
        (
            &["rl", "--model", "m", "--mis", "2,0.5"][..],
            "LO 2 must be below HI 0.5",
        ),
        (
            &["rl", "--model", "m", "--top-p", "1.5"][..],
            "must be in (0, 1]",
        ),
        (
            &["ablate", "--model", "m", "--micro-batch", "0"][..],
            "'--micro-batch <MICRO_BATCH>'",
        ),
        (
            &["demo", "--steps", "0"][..],
            "'--steps <STEPS>': must be at least 1",
        ),
    ] {
        let e = fails(args, d.path());
        assert!(e.contains(want), "mxrl {args:?}: {e}");
    }
    // Nothing was created by any of them.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    // The README's spelling of --mis parses.
    let e = fails(&["rl", "--model", "missing", "--mis", "0.5,2"], d.path());
    assert!(!e.contains("--mis"), "{e}");
}

#[test]
fn rl_runs_cannot_be_silently_mixed_and_log_plain_lines_without_a_terminal() {
    let d = tempfile::tempdir().unwrap();
    base(d.path());
    let mut args = vec!["rl", "--model", "base"];
    args.extend(TINY);
    // Default directory per recipe; stderr is a pipe here, so one line per step and a summary.
    let out = ok(&args, d.path());
    let dir = d.path().join("runs/rl-bf16");
    assert!(dir.join("run.json").exists() && dir.join("metrics.jsonl").exists());
    assert!(out.contains("bf16 step 1/1: reward "), "{out}");
    assert!(out.contains("tok/s"), "{out}");
    assert!(out.contains("bf16: 1 steps; reward "), "{out}");
    assert!(out.contains("mxrl report runs/rl-bf16"), "{out}");
    let run_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    for key in [
        "recipe",
        "plan_hash",
        "model_digest",
        "task",
        "device",
        "config",
    ] {
        assert!(
            run_json.get(key).is_some(),
            "run.json lacks {key}: {run_json}"
        );
    }
    assert_eq!(run_json["config"]["seed"], 1);

    // Another recipe into the same directory, and another learning rate: refused, listed.
    let mut other = args.clone();
    other.extend([
        "--out",
        "runs/rl-bf16",
        "--recipe",
        "mxfp8",
        "--lr",
        "0.002",
    ]);
    let e = fails(&other, d.path());
    assert!(e.contains("runs/rl-bf16 holds another run"), "{e}");
    assert!(
        e.contains("recipe: \"bf16\" (recorded) ≠ \"mxfp8\" (now)"),
        "{e}"
    );
    assert!(
        e.contains("config.adam.lr: 0.001 (recorded) ≠ 0.002 (now)"),
        "{e}"
    );
    let metrics = std::fs::read(dir.join("metrics.jsonl")).unwrap();
    // Resuming the same run with more steps extends it.
    let mut more = args.clone();
    more[4] = "2";
    assert_eq!(more[3], "--steps");
    let out = ok(&more, d.path());
    assert!(out.contains("resuming"), "{out}");
    let after = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(after.as_bytes().starts_with(&metrics) && after.lines().count() == 2);
    // Asked to, it starts over with the new configuration.
    other.push("--restart");
    ok(&other, d.path());
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(m["recipe"], "mxfp8");
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        1
    );

    // `mxrl report` takes the single run directory.
    let out = ok(&["report", "runs/rl-bf16"], d.path());
    assert!(out.contains("report.md"), "{out}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.starts_with("# mxrl run report"), "{md}");
    assert!(md.contains("| `mxfp8` | 1 |"), "{md}");
    assert!(dir.join("mismatch.png").exists());
}

#[test]
fn ablate_checks_every_recipe_before_running_and_refuses_a_changed_rerun() {
    let d = tempfile::tempdir().unwrap();
    base(d.path());
    let mut args = vec![
        "ablate",
        "--model",
        "base",
        "--out",
        "abl",
        "--noise-seeds",
        "none",
    ];
    args.extend(TINY);
    let mut typo = args.clone();
    typo.extend(["--recipes", "bf16,mxfp8,nvfp4-hq"]);
    let e = fails(&typo, d.path());
    assert!(
        e.contains("nothing was run") && e.contains("recipe `nvfp4-hq`"),
        "{e}"
    );
    assert!(
        !d.path().join("abl").exists(),
        "a run started despite the typo"
    );

    let mut good = args.clone();
    good.extend(["--recipes", "bf16,mxfp8"]);
    ok(&good, d.path());
    let man: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("abl/ablation.json")).unwrap())
            .unwrap();
    assert_eq!(man["runs"].as_array().unwrap().len(), 2);
    assert!(d.path().join("abl/mxfp8/run.json").exists());
    let report = std::fs::read_to_string(d.path().join("abl/report.md")).unwrap();
    // Re-running with another temperature would state it over the old runs' numbers: refused.
    let mut changed = good.clone();
    changed.extend(["--temperature", "0.7"]);
    let e = fails(&changed, d.path());
    assert!(
        e.contains("config.sampling.temperature: 1.0 (recorded) ≠ 0.7 (now)"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(d.path().join("abl/report.md")).unwrap(),
        report
    );
}

#[test]
fn an_ablation_runs_in_parts_and_keeps_finished_runs_without_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    base(d.path());
    let mut args = vec![
        "ablate",
        "--model",
        "base",
        "--out",
        "abl",
        "--recipes",
        "bf16,mxfp8",
        "--noise-seeds",
        "2",
        "--checkpoint-every",
        "0",
    ];
    args.extend(TINY);
    // A name that is no run of this ablation: refused before anything is written.
    let mut typo = args.clone();
    typo.extend(["--only", "bf16,bf16-seed3"]);
    let e = fails(&typo, d.path());
    assert!(
        e.contains("--only names no run of this ablation: bf16-seed3")
            && e.contains("its runs are bf16, mxfp8, bf16-seed2"),
        "{e}"
    );
    assert!(!d.path().join("abl").exists());

    // The first part: two of the three runs.
    let mut part = args.clone();
    part.extend(["--only", "bf16-seed2,bf16"]);
    let out = ok(&part, d.path());
    assert!(out.contains("mxfp8: not in --only, left as it is"), "{out}");
    assert!(
        out.contains("2 of 3 runs finished; not run yet: mxfp8 (the same command"),
        "{out}"
    );
    let abl = d.path().join("abl");
    let bf16 = std::fs::read(abl.join("bf16/metrics.jsonl")).unwrap();
    let seed2 = std::fs::read(abl.join("bf16-seed2/metrics.jsonl")).unwrap();
    assert!(!abl.join("mxfp8/metrics.jsonl").exists());
    assert!(!abl.join("bf16/checkpoint.safetensors").exists());
    let report = std::fs::read_to_string(abl.join("report.md")).unwrap();
    assert!(
        report.contains("| `bf16` | 1 |") && !report.contains("| `mxfp8` | 1 |"),
        "{report}"
    );

    // The rest: the finished runs are kept as they are (no checkpoint to resume from, and
    // they are not run again), the missing one runs, and the report holds all three.
    let out = ok(&args, d.path());
    assert!(out.contains("bf16: finished (1 steps), kept"), "{out}");
    assert!(
        out.contains("bf16-seed2: finished (1 steps), kept"),
        "{out}"
    );
    assert!(!out.contains("recipe bf16 runs on"), "{out}");
    assert!(out.contains("recipe mxfp8 runs on"), "{out}");
    assert_eq!(std::fs::read(abl.join("bf16/metrics.jsonl")).unwrap(), bf16);
    assert_eq!(
        std::fs::read(abl.join("bf16-seed2/metrics.jsonl")).unwrap(),
        seed2
    );
    let report = std::fs::read_to_string(abl.join("report.md")).unwrap();
    assert!(report.contains("| `mxfp8` | 1 |"), "{report}");
    assert!(!out.contains("not run yet"), "{out}");

    // A run cut short (here: its metrics truncated to none) is not finished: it runs again.
    std::fs::write(abl.join("mxfp8/metrics.jsonl"), "").unwrap();
    let out = ok(&args, d.path());
    assert!(out.contains("recipe mxfp8 runs on"), "{out}");
    assert_eq!(
        std::fs::read_to_string(abl.join("mxfp8/metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        1
    );
}

#[test]
fn demo_and_sft_on_an_unwritable_path_name_it_and_a_bad_recipe_costs_nothing() {
    let d = tempfile::tempdir().unwrap();
    // /proc refuses new directories even to root.
    let e = fails(
        &["demo", "--out", "/proc/mxrl-demo", "--steps", "1"],
        d.path(),
    );
    assert!(
        e.contains("creating the demo output directory /proc/mxrl-demo"),
        "{e}"
    );
    let e = fails(
        &["sft", "--out", "/proc/mxrl-sft", "--steps", "1"],
        d.path(),
    );
    assert!(
        e.contains("creating the output directory /proc/mxrl-sft.partial"),
        "{e}"
    );
    assert!(!e.contains("sft step 1/1"), "trained before failing: {e}");
    let e = fails(&["demo", "--recipes", "bf16,mxfp9"], d.path());
    assert!(e.contains("mxfp9") && e.contains("nothing was run"), "{e}");
    assert!(!d.path().join("runs").exists());
}

#[test]
fn an_output_path_that_is_a_directory_is_refused_and_leaves_no_temporary_file() {
    let d = tempfile::tempdir().unwrap();
    let vectors =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vectors/quant-public.safetensors");
    std::fs::create_dir(d.path().join("out")).unwrap();
    let e = fails(
        &["quantize", "--vectors", vectors.to_str().unwrap(), "out"],
        d.path(),
    );
    assert!(e.contains("output path out is a directory"), "{e}");
    let names: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["out"]);
}

#[test]
fn a_closed_stdout_ends_inspect_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let vectors =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../vectors/quant-public.safetensors");
    let mut child = mxrl()
        .arg("inspect")
        .arg(&vectors)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the reading end before anything is read (`| head -0`): every write fails.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.is_empty(), "{err}");
    // Ended by SIGPIPE like other Unix tools, not by a panic's exit code 101.
    assert_eq!(
        out.status.signal(),
        Some(libc_sigpipe()),
        "{:?}",
        out.status
    );
}

/// SIGPIPE's number on Linux and the BSDs.
fn libc_sigpipe() -> i32 {
    13
}
