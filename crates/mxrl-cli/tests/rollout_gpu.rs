//! The rollout engine in its own process on the GPU: `mxrl rl --device cuda --rollout spawn`
//! starts `mxrl rollout-server --device cuda`, and every weight update moves the trainer's
//! stored bytes (BF16, MXFP8, FP8-block) over gRPC into the server's device engine. In bitwise
//! mode the server re-scores with the trainer's forward, so |Δlogprob| is exactly 0 at every
//! step, and the run equals the in-process GPU run bit for bit: same samples, rewards, loss,
//! gradient norm and update (the bytes counted differ: the wire adds names and framing). Needs
//! a GPU (`--features cuda`); `MXRL_BIN` names the binary where the test runs on another
//! machine than it was built on (`tests/common`).
#![cfg(feature = "cuda")]

use mxrl_rl::metrics::{read_jsonl, StepMetrics};
use std::path::Path;

mod common;
use common::ok;

fn rl_args(model: &Path, recipe: &str, out: &Path) -> Vec<String> {
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let mut v = vec!["rl".to_string(), "--model".into(), p(model)];
    for a in [
        "--recipe",
        recipe,
        "--device",
        "cuda",
        "--steps",
        "3",
        "--prompts-per-step",
        "4",
        "--samples",
        "4",
        "--max-new-tokens",
        "4",
        "--lr",
        "0.01",
        "--bitwise",
        "--check-weight-sync",
        "--checkpoint-every",
        "0",
    ] {
        v.push(a.into());
    }
    v.push("--out".into());
    v.push(p(out));
    v
}

#[test]
fn spawned_gpu_rollout_server_equals_the_in_process_gpu_run() {
    let d = tempfile::tempdir().unwrap();
    // A briefly warmed-up demo model, so that rewards, losses and updates are not all zero.
    ok(
        &[
            "sft", "--out", "base", "--steps", "30", "--batch", "32", "--lr", "0.01",
        ],
        d.path(),
    );
    let model = d.path().join("base");
    let run = |args: &[String]| {
        ok(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            d.path(),
        )
    };
    let mut moved = false;
    for recipe in ["bf16", "mxfp8", "fp8-block"] {
        let (local, remote) = (
            d.path().join(format!("{recipe}-local")),
            d.path().join(format!("{recipe}-remote")),
        );
        run(&rl_args(&model, recipe, &local));
        let mut args = rl_args(&model, recipe, &remote);
        args.extend(["--rollout".to_string(), "spawn".to_string()]);
        run(&args);
        let l = read_jsonl(&local.join("metrics.jsonl")).unwrap();
        let r = read_jsonl(&remote.join("metrics.jsonl")).unwrap();
        assert_eq!(r.len(), 3, "{recipe}: {r:?}");
        let key = |m: &StepMetrics| {
            (
                m.step,
                m.weight_version,
                m.tokens,
                m.reward_mean.to_bits(),
                m.loss.to_bits(),
                m.grad_norm.to_bits(),
                m.k3_kl.to_bits(),
                m.entropy.to_bits(),
            )
        };
        for (a, b) in r.iter().zip(&l) {
            assert!(a.tokens > 0 && a.sync_bytes > 0, "{recipe}: {a:?}");
            assert_eq!(a.train_rollout_logprob_abs_diff, 0.0, "{recipe}: {a:?}");
            assert_eq!(key(a), key(b), "{recipe}: server process vs in process");
            moved |= a.grad_norm > 0.0;
        }
        let log = std::fs::read_to_string(remote.join("rollout-server.log")).unwrap();
        assert!(log.contains("applied weight version 4"), "{recipe}: {log}");
    }
    assert!(moved, "no step had a gradient: the comparison says nothing");
}
