//! The rollout engine in its own process (`mxrl rollout-server`): `mxrl rl --rollout` against
//! it equals the in-process run bit for bit, a connection dropped in the middle of a weight
//! update changes nothing, and a contract-hash mismatch is refused, across process boundaries.

use mxrl_rl::metrics::read_jsonl;
use mxrl_rl::optim::{AdamW, AdamWConfig};
use mxrl_rl::runner::load_checkpoint;
use mxrl_rl::server::{Endpoint, RemoteRollout, RolloutClient, ServerError};
use mxrl_rl::session::{build, demo_model, load_model_dir, save_model_dir};
use mxrl_rl::sync::{check_equal, write_frame, WeightUpdate, K_BUCKET, K_HEADER};
use mxrl_rl::TrainPolicy;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn mxrl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mxrl"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The demo's tiny MoE (char-level tokenizer) as a model directory.
fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let (m, tok) = demo_model(3).unwrap();
    save_model_dir(&m, &tok, &dir).unwrap();
    dir
}

/// A `mxrl rollout-server` child process, killed when dropped.
struct Server {
    child: Child,
    endpoint: Endpoint,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(model: &Path, recipe: &str, socket: &Path) -> Server {
        let mut child = mxrl()
            .args(["rollout-server", "--model", s(model), "--recipe", recipe])
            .arg("--listen")
            .arg(format!("unix:{}", s(socket)))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).unwrap();
        let mut srv = Server {
            child,
            endpoint: Endpoint::Unix(socket.to_path_buf()),
            lines: Arc::default(),
        };
        let want = format!("mxrl rollout-server: listening on unix:{}", s(socket));
        assert_eq!(
            first.trim_end(),
            want,
            "server exited? {:?}",
            srv.child.try_wait()
        );
        let lines = srv.lines.clone();
        std::thread::spawn(move || {
            for l in out.lines() {
                let Ok(l) = l else { return };
                lines.lock().unwrap().push(l);
            }
        });
        srv
    }

    /// The first log line containing `pat`, waiting up to 20 s.
    fn wait_line(&self, pat: &str) -> String {
        let t = Instant::now();
        loop {
            if let Some(l) = self.lines.lock().unwrap().iter().find(|l| l.contains(pat)) {
                return l.clone();
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no `{pat}` in the server log: {:?}",
                self.lines.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_ok(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

const RECIPE: &str = "mxfp8";

fn rl_args(model: &Path, out: &Path) -> Vec<String> {
    [
        "rl",
        "--model",
        s(model),
        "--recipe",
        RECIPE,
        "--out",
        s(out),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--samples",
        "2",
        "--max-new-tokens",
        "3",
        "--lr",
        "0.01",
        "--check-weight-sync",
        "--bitwise",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect()
}

/// The trainer of a finished run rebuilt from its checkpoint: the bytes a weight update of
/// its final state ships.
fn final_export(model: &Path, run: &Path) -> Vec<mxrl_rl::WireTensor> {
    let (m, _) = load_model_dir(model).unwrap();
    let mut b = build(&m, RECIPE).unwrap();
    let mut opt = AdamW::new(AdamWConfig::default());
    load_checkpoint(run, &mut b.trainer, &mut opt)
        .unwrap()
        .expect("the run wrote a checkpoint");
    b.trainer.refresh_weights().unwrap();
    b.trainer.export_weights().unwrap()
}

#[test]
fn rl_against_a_server_process_equals_the_in_process_run() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let srv = Server::start(&model, RECIPE, &d.path().join("r.sock"));
    let (remote_dir, local_dir) = (d.path().join("remote"), d.path().join("local"));
    run_ok(
        mxrl()
            .args(rl_args(&model, &remote_dir))
            .arg("--rollout")
            .arg(srv.endpoint.to_string()),
    );
    run_ok(mxrl().args(rl_args(&model, &local_dir)));

    let remote = read_jsonl(&remote_dir.join("metrics.jsonl")).unwrap();
    let local = read_jsonl(&local_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(remote.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(
        remote.iter().map(|m| m.weight_version).collect::<Vec<_>>(),
        [1, 2]
    );
    for (r, l) in remote.iter().zip(&local) {
        assert!(r.tokens > 0);
        // Bitwise mode through the socket: the server re-scores with the trainer's forward.
        assert_eq!(r.train_rollout_logprob_abs_diff, 0.0, "{r:?}");
        // Same samples, same rewards, same update as the in-process engine, bit for bit.
        let key = |m: &mxrl_rl::metrics::StepMetrics| {
            (
                m.step,
                m.weight_version,
                m.tokens,
                m.sync_bytes,
                m.reward_mean.to_bits(),
                m.loss.to_bits(),
                m.grad_norm.to_bits(),
                m.k3_kl.to_bits(),
                m.entropy.to_bits(),
            )
        };
        assert_eq!(key(r), key(l));
    }
    // The server applied v1 (initial sync) and one update per step, and now holds exactly
    // the bytes of the trainer's final state.
    for v in 1..=3 {
        srv.wait_line(&format!("applied weight version {v} "));
    }
    let mut c = RolloutClient::connect(&srv.endpoint).unwrap();
    let (v, held) = c.fetch().unwrap();
    assert_eq!(v, 3);
    let want = final_export(&model, &remote_dir);
    check_equal(&held, &want).unwrap();
    check_equal(&held, &final_export(&model, &local_dir)).unwrap();
    // A second run from scratch against the same server is refused: versions only advance.
    let out = mxrl()
        .args(rl_args(&model, &d.path().join("again")))
        .arg("--rollout")
        .arg(srv.endpoint.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not newer than the served version v3") && err.contains("r.sock"),
        "{err}"
    );
}

#[test]
fn dropped_connection_mid_update_leaves_the_server_on_its_version() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let srv = Server::start(&model, RECIPE, &d.path().join("d.sock"));
    let mut c = RolloutClient::connect(&srv.endpoint).unwrap();
    let (v0, before) = c.fetch().unwrap();
    assert_eq!(v0, 0);

    // New weights: the model's own trainer, every master weight moved.
    let (m, _) = load_model_dir(&model).unwrap();
    let mut b = build(&m, RECIPE).unwrap();
    check_equal(&before, &b.trainer.export_weights().unwrap()).unwrap();
    for p in b.trainer.params() {
        for v in p.value.iter_mut() {
            *v = *v * 0.5 + 0.01;
        }
    }
    b.trainer.refresh_weights().unwrap();
    let new = b.trainer.export_weights().unwrap();
    let u = WeightUpdate::build(1, &b.contract_hash, &new, 16 << 10);
    assert!(u.buckets.len() >= 3, "{} buckets", u.buckets.len());

    // Header, bucket 0, then half of bucket 1; then the connection drops.
    {
        let Endpoint::Unix(p) = &srv.endpoint else {
            unreachable!()
        };
        let mut raw = std::os::unix::net::UnixStream::connect(p).unwrap();
        let h = serde_json::to_vec(&u.header).unwrap();
        write_frame(&mut raw, K_HEADER, &[&h]).unwrap();
        let b0 = &u.buckets[0];
        write_frame(
            &mut raw,
            K_BUCKET,
            &[&b0.index.to_le_bytes(), &b0.checksum, &b0.payload],
        )
        .unwrap();
        let mut frame = Vec::new();
        let b1 = &u.buckets[1];
        write_frame(
            &mut frame,
            K_BUCKET,
            &[&b1.index.to_le_bytes(), &b1.checksum, &b1.payload],
        )
        .unwrap();
        raw.write_all(&frame[..frame.len() / 2]).unwrap();
    }
    let line = srv.wait_line("connection dropped");
    assert!(
        line.contains("weight update v1, before its commit frame") && line.contains("serving v0"),
        "{line}"
    );

    // A new connection: still version 0, the same bytes.
    let mut c2 = RolloutClient::connect(&srv.endpoint).unwrap();
    assert_eq!(c2.info().unwrap().version, 0);
    let (v, held) = c2.fetch().unwrap();
    assert_eq!(v, 0);
    check_equal(&held, &before).unwrap();

    // The complete update is accepted afterwards and the server holds its bytes.
    assert_eq!(c2.update(&u).unwrap().version, 1);
    srv.wait_line("applied weight version 1 ");
    let (v, held) = c.fetch().unwrap();
    assert_eq!(v, 1);
    check_equal(&held, &new).unwrap();

    // A remote rollout's digest check sees the same bytes.
    let r = RemoteRollout::connect(&srv.endpoint, &b.contract_hash).unwrap();
    mxrl_rl::RolloutPolicy::check_weights(&r, &new).unwrap();
    assert!(mxrl_rl::RolloutPolicy::check_weights(&r, &before).is_err());

    // Shutdown over the protocol: the process exits cleanly and removes its socket.
    c.shutdown().unwrap();
    let t = Instant::now();
    let mut srv = srv;
    let st = loop {
        if let Some(st) = srv.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(st.success());
    assert!(!d.path().join("d.sock").exists());
}

#[test]
fn contract_hash_mismatch_is_refused_across_processes() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let srv = Server::start(&model, RECIPE, &d.path().join("c.sock"));
    let (m, _) = load_model_dir(&model).unwrap();
    let b = build(&m, RECIPE).unwrap();
    let ex = b.trainer.export_weights().unwrap();

    // The server refuses an update made under another contract, on the same connection that
    // keeps working afterwards.
    let mut c = RolloutClient::connect(&srv.endpoint).unwrap();
    let info = c.info().unwrap();
    assert_eq!(info.contract_hash, b.contract_hash);
    let e = c
        .update(&WeightUpdate::build(1, "0123456789abcdef", &ex, 16 << 10))
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, ServerError::Refused { version: 1, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("0123456789abcdef")
            && msg.contains(&b.contract_hash)
            && msg.contains("c.sock"),
        "{msg}"
    );
    let line = srv.wait_line("refused a weight update");
    assert!(line.contains("0123456789abcdef"), "{line}");
    assert_eq!(c.info().unwrap().version, 0);
    // A client under another contract is turned away before sending anything.
    let e = RemoteRollout::connect(&srv.endpoint, "0123456789abcdef").unwrap_err();
    assert!(matches!(e, ServerError::Contract { .. }), "{e}");
    // `mxrl rl` against a server of another recipe is a clear error.
    let out = mxrl()
        .args([
            "rl",
            "--model",
            s(&model),
            "--recipe",
            "bf16",
            "--steps",
            "1",
        ])
        .arg("--out")
        .arg(d.path().join("run"))
        .arg("--rollout")
        .arg(srv.endpoint.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("serves recipe `mxfp8`") && err.contains("`bf16`"),
        "{err}"
    );
}

#[test]
fn rollout_spawn_starts_and_stops_its_own_server() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let run = d.path().join("run");
    let mut args = rl_args(&model, &run);
    let i = args.iter().position(|a| a == "--steps").unwrap();
    args[i + 1] = "1".into();
    run_ok(mxrl().args(args).args(["--rollout", "spawn"]));
    let ms = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(ms.len(), 1);
    assert!(!run.join("rollout.sock").exists(), "socket left behind");
    let log = std::fs::read_to_string(run.join("rollout-server.log")).unwrap();
    assert!(
        log.contains("applied weight version 2 ") && log.contains("shutdown requested"),
        "{log}"
    );
    assert!(
        log.trim_end().ends_with("mxrl rollout-server: shut down"),
        "{log}"
    );
}
