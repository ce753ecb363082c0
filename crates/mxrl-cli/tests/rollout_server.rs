//! The rollout engine in its own process (`mxrl rollout-server`, gRPC): `mxrl rl --rollout`
//! against it equals the in-process run bit for bit; an update stream cut before its commit
//! changes nothing; a contract-hash mismatch is refused; every attack of the threat model
//! (garbage bytes, torn and oversized messages, absurd counts, malformed traces,
//! unauthenticated calls, a wrong token, 1 000 idle connections, EMFILE) is refused or survived
//! and followed by a real trainer run; off loopback the server needs TLS and a trainer runs
//! over it; sequence limits follow the model's positions; a spawned server dies with its
//! trainer; and the Python client drives a server, with and without TLS.

use mxrl_rl::metrics::read_jsonl;
use mxrl_rl::optim::{AdamW, AdamWConfig};
use mxrl_rl::proto as pb;
use mxrl_rl::proto::refusal::Reason;
use mxrl_rl::runner::load_checkpoint;
use mxrl_rl::server::{ClientTls, Endpoint, RemoteRollout, RolloutClient, ServerError, Token};
use mxrl_rl::session::{build, demo_model, load_model_dir, save_model_dir};
use mxrl_rl::sync::{check_equal, WeightUpdate};
use mxrl_rl::TrainPolicy;
use std::io::{BufRead, BufReader, Read, Write};
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
        Server::start_with(model, recipe, &format!("unix:{}", s(socket)), &[], None)
    }

    /// `mxrl rollout-server --listen LISTEN EXTRA...`, optionally under `sh -c "ulimit -n N"`.
    fn start_with(
        model: &Path,
        recipe: &str,
        listen: &str,
        extra: &[&str],
        fd_limit: Option<u32>,
    ) -> Server {
        let mut cmd = match fd_limit {
            None => mxrl(),
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(env!("CARGO_BIN_EXE_mxrl"));
                c
            }
        };
        let mut child = cmd
            .args(["rollout-server", "--model", s(model), "--recipe", recipe])
            .args(["--listen", listen])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).unwrap();
        let at = first
            .trim_end()
            .strip_prefix("mxrl rollout-server: listening on ")
            .unwrap_or_else(|| panic!("server exited? first line {first:?}"))
            .to_string();
        let srv = Server {
            child,
            endpoint: at.parse().unwrap(),
            lines: Arc::default(),
        };
        if let Some(sock) = listen.strip_prefix("unix:") {
            assert_eq!(at, format!("unix:{sock}"));
        }
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
    let mut c = RolloutClient::connect(&srv.endpoint, None).unwrap();
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

/// New weights for `model`: its own trainer with every master weight moved.
fn moved_export(model: &Path) -> (Vec<mxrl_rl::WireTensor>, String) {
    let (m, _) = load_model_dir(model).unwrap();
    let mut b = build(&m, RECIPE).unwrap();
    for p in b.trainer.params() {
        for v in p.value.iter_mut() {
            *v = *v * 0.5 + 0.01;
        }
    }
    b.trainer.refresh_weights().unwrap();
    (b.trainer.export_weights().unwrap(), b.contract_hash)
}

fn update_messages(u: &WeightUpdate) -> Vec<pb::UpdateMessage> {
    use pb::update_message::Kind;
    let h = &u.header;
    let mut m = vec![Kind::Header(pb::UpdateHeader {
        version: h.version,
        contract_hash: h.contract_hash.clone(),
        buckets: h.buckets,
        tensors: h.tensors,
        bytes: h.bytes,
    })];
    for b in &u.buckets {
        m.push(Kind::Bucket(pb::WeightBucket {
            index: b.index,
            sha256: b.checksum.to_vec(),
            payload: b.payload.clone(),
        }));
    }
    m.push(Kind::Commit(pb::Commit { version: h.version }));
    m.into_iter()
        .map(|k| pb::UpdateMessage { kind: Some(k) })
        .collect()
}

#[test]
fn an_update_cut_before_its_commit_leaves_the_server_on_its_version() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let srv = Server::start(&model, RECIPE, &d.path().join("d.sock"));
    let mut c = RolloutClient::connect(&srv.endpoint, None).unwrap();
    let (v0, before) = c.fetch().unwrap();
    assert_eq!(v0, 0);
    let (new, contract) = moved_export(&model);
    let u = WeightUpdate::build(1, &contract, &new, 16 << 10);
    assert!(u.buckets.len() >= 3, "{} buckets", u.buckets.len());

    // Header and bucket 0, then the stream ends: refused as incomplete, nothing changed.
    let msgs = update_messages(&u);
    let e = c.update_messages(1, msgs[..2].to_vec()).unwrap_err();
    assert_eq!(e.refusal(), Some(Reason::Incomplete), "{e}");
    let line = srv.wait_line("refused a weight update");
    assert!(
        line.contains("before its commit") && line.contains("still serving v0"),
        "{line}"
    );
    let mut c2 = RolloutClient::connect(&srv.endpoint, None).unwrap();
    assert_eq!(c2.info().unwrap().version, 0);
    let (v, held) = c2.fetch().unwrap();
    assert_eq!(v, 0);
    check_equal(&held, &before).unwrap();

    // The complete update is accepted afterwards and the server holds its bytes.
    assert_eq!(c2.update(u).unwrap(), 1);
    srv.wait_line("applied weight version 1 ");
    let (v, held) = c.fetch().unwrap();
    assert_eq!(v, 1);
    check_equal(&held, &new).unwrap();

    // A remote rollout's digest check sees the same bytes.
    let r = RemoteRollout::connect(&srv.endpoint, &contract, None).unwrap();
    mxrl_rl::RolloutPolicy::check_weights(&r, &new).unwrap();
    assert!(mxrl_rl::RolloutPolicy::check_weights(&r, &before).is_err());

    // Shutdown over the protocol: the process exits cleanly and removes its socket.
    c.shutdown().unwrap();
    let mut srv = srv;
    let st = wait_exit(&mut srv.child, 20);
    assert!(st.success());
    assert!(!d.path().join("d.sock").exists());
}

fn wait_exit(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "process did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
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
    let mut c = RolloutClient::connect(&srv.endpoint, None).unwrap();
    let info = c.info().unwrap();
    assert_eq!(info.contract_hash, b.contract_hash);
    let e = c
        .update(WeightUpdate::build(1, "0123456789abcdef", &ex, 16 << 10))
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            ServerError::Refused {
                version: 1,
                serving: 0,
                reason: Reason::ContractMismatch,
                ..
            }
        ),
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
    let e = RemoteRollout::connect(&srv.endpoint, "0123456789abcdef", None).unwrap_err();
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

/// A trainer run of 2 steps against `ep` that must succeed (versions 1..=3 applied).
fn trainer_run(model: &Path, out: &Path, ep: &Endpoint, token_file: Option<&Path>) {
    let mut c = mxrl();
    c.args(rl_args(model, out))
        .arg("--rollout")
        .arg(ep.to_string());
    if let Some(f) = token_file {
        c.arg("--token-file").arg(f);
    }
    run_ok(&mut c);
    let ms = read_jsonl(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        ms.iter().map(|m| m.weight_version).collect::<Vec<_>>(),
        [1, 2]
    );
}

fn generate_req(prompt: Vec<u32>, n: u64, max_new_tokens: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompts: vec![pb::TokenIds { ids: prompt }],
        n,
        sampling: Some(pb::SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens,
        }),
        eos: 0,
        seed: 1,
    }
}

/// Garbage, torn and oversized messages, absurd counts and malformed routing traces: each is
/// refused (typed where the server decides, by the framework where a message is too large to
/// read), the server keeps serving on the same connection, and a real trainer run succeeds.
#[test]
fn malformed_and_oversized_requests_are_refused_and_a_trainer_run_then_succeeds() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let sock = d.path().join("a.sock");
    let srv = Server::start_with(
        &model,
        RECIPE,
        &format!("unix:{}", s(&sock)),
        &[
            "--max-request-bytes",
            "65536",
            "--max-bucket-bytes",
            "65536",
        ],
        None,
    );
    // Garbage bytes, then a torn HTTP/2 connection (preface, half a frame, close).
    for junk in [
        (0..4096u32)
            .map(|i| (i * 7919 % 251) as u8)
            .collect::<Vec<u8>>(),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00".to_vec(),
    ] {
        let mut raw = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = raw.write_all(&junk);
        let _ = raw.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = raw.read_to_end(&mut sink);
    }
    let mut c = RolloutClient::connect(&srv.endpoint, None).unwrap();
    let info = c.info().unwrap();
    assert_eq!(info.version, 0);
    let (m, _) = load_model_dir(&model).unwrap();
    let vocab = m.config().vocab_size as u32;

    // Absurd counts and lengths, out-of-vocabulary tokens.
    for (req, want) in [
        (generate_req(vec![1], 1 << 40, 4), Reason::LimitExceeded),
        (generate_req(vec![1], 1, 1 << 40), Reason::LimitExceeded),
        (generate_req(vec![vocab], 1, 4), Reason::InvalidRequest),
    ] {
        let e = c.generate_raw(req).unwrap_err();
        assert_eq!(e.refusal(), Some(want), "{e}");
    }
    // An oversized message: refused from its length prefix with the typed refusal naming
    // the limit, the connection still usable.
    let e = c
        .generate_raw(generate_req(vec![1; 100_000], 1, 4))
        .unwrap_err();
    let ServerError::Remote {
        refusal: Some(r), ..
    } = &e
    else {
        panic!("no typed refusal: {e}")
    };
    assert_eq!(r.reason(), Reason::LimitExceeded, "{e}");
    assert_eq!(
        (r.limit_name.as_str(), r.limit),
        ("max_request_bytes", 65536)
    );
    // Malformed routing traces (the model has MoE layers): short, wrong top-k, bad expert.
    let (n_moe, k, experts) = {
        let c = m.config();
        let l = (0..c.num_layers).filter(|&l| c.is_moe_layer(l)).count() as u64;
        (l, c.num_experts_per_tok as u64, c.num_experts as u32)
    };
    let positions = 3u64; // prompt 2 + response 2 - 1
    let full = (positions * n_moe * k) as usize;
    for (layers, top_k, len, expert) in [
        (n_moe, k, full - 1, 0),
        (n_moe, k + 1, full, 0),
        (n_moe + 1, k, full, 0),
        (n_moe, k, full, experts),
    ] {
        let mut ids = vec![0u32; len];
        ids[0] = expert;
        let e = c
            .score_raw(pb::ScoreRequest {
                temperature: 1.0,
                sequences: vec![pb::ScoreSequence {
                    prompt: vec![1, 2],
                    response: vec![3, 4],
                    replay: Some(pb::RoutingTrace {
                        layers,
                        top_k,
                        weights: vec![0.5; len],
                        ids,
                    }),
                }],
            })
            .unwrap_err();
        assert_eq!(e.refusal(), Some(Reason::InvalidRequest), "{e}");
    }
    // A header announcing 2^32 - 1 buckets or tensors; a bucket over the size limit.
    let (new, contract) = moved_export(&model);
    let mut u = WeightUpdate::build(1, &contract, &new, 16 << 10);
    for (b, t) in [(u32::MAX, u.header.tensors), (1, u32::MAX)] {
        u.header.buckets = b;
        u.header.tensors = t;
        let e = c
            .update_messages(1, update_messages(&u)[..1].to_vec())
            .unwrap_err();
        assert!(
            matches!(e.refusal(), Some(Reason::BadUpdate | Reason::LimitExceeded)),
            "{e}"
        );
    }
    let one_bucket = WeightUpdate::build(1, &contract, &new, usize::MAX);
    assert!(one_bucket.header.bytes > 65536);
    assert!(c.update(one_bucket).is_err());
    assert_eq!(c.info().unwrap().version, 0);
    srv.wait_line("generate refused");

    trainer_run(&model, &d.path().join("run"), &srv.endpoint, None);
    for v in 1..=3 {
        srv.wait_line(&format!("applied weight version {v} "));
    }
}

/// TCP: no server without a token, no call without the right token (fetch, update, shutdown,
/// info), then a trainer with the token file runs; one without it is turned away.
#[test]
fn tcp_requires_the_token_and_a_trainer_with_it_runs() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let out = mxrl()
        .args([
            "rollout-server",
            "--model",
            s(&model),
            "--listen",
            "tcp:127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--token-file"), "{err}");

    let tok = d.path().join("token");
    std::fs::write(&tok, "s3cret-token-for-the-test\n").unwrap();
    std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o600)).unwrap();
    let srv = Server::start_with(
        &model,
        RECIPE,
        "tcp:127.0.0.1:0",
        &["--token-file", s(&tok)],
        None,
    );
    let (new, contract) = moved_export(&model);
    let wrong = Token::new("s3cret-token-for-the-tesT").unwrap();
    for t in [None, Some(&wrong)] {
        let mut c = RolloutClient::connect(&srv.endpoint, t).unwrap();
        for e in [
            c.fetch().unwrap_err(),
            c.update(WeightUpdate::build(u64::MAX, &contract, &new, 16 << 10))
                .unwrap_err(),
            c.shutdown().unwrap_err(),
            c.info().unwrap_err(),
        ] {
            assert_eq!(e.refusal(), Some(Reason::Unauthenticated), "{e}");
        }
    }
    srv.wait_line("call without a valid token refused");
    let token = Token::from_file(&tok).unwrap();
    let mut c = RolloutClient::connect(&srv.endpoint, Some(&token)).unwrap();
    assert_eq!(c.info().unwrap().version, 0, "nothing changed");

    let out = mxrl()
        .args(rl_args(&model, &d.path().join("no-token")))
        .arg("--rollout")
        .arg(srv.endpoint.to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Unauthenticated"), "{err}");
    trainer_run(&model, &d.path().join("run"), &srv.endpoint, Some(&tok));
    assert_eq!(c.info().unwrap().version, 3);
}

/// Test certificates made with rcgen in `dir`: a CA (`ca.pem`) and a server certificate for
/// `names` signed by it (`server.pem`, `server.key` owner-only). Returns the three paths.
fn tls_files(dir: &Path, names: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "mxrl test CA");
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let ca = rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().unwrap()).unwrap();
    let mut p =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca).unwrap();
    let (ca_f, cert_f, key_f) = (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    );
    std::fs::write(&ca_f, ca.pem()).unwrap();
    std::fs::write(&cert_f, cert.pem()).unwrap();
    std::fs::write(&key_f, key.serialize_pem()).unwrap();
    std::fs::set_permissions(&key_f, std::fs::Permissions::from_mode(0o600)).unwrap();
    (ca_f, cert_f, key_f)
}

/// An address of this machine that is not loopback (the source address of its route to a
/// documentation-only address; no packet is sent), or why there is none.
fn machine_address() -> Result<std::net::IpAddr, String> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    s.connect("192.0.2.1:9")
        .map_err(|e| format!("no route off this machine ({e})"))?;
    let ip = s.local_addr().map_err(|e| e.to_string())?.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return Err(format!("the route off this machine uses {ip}"));
    }
    Ok(ip)
}

/// A token file (0600) in `dir`.
fn token_file(dir: &Path, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let tok = dir.join("token");
    std::fs::write(&tok, format!("{text}\n")).unwrap();
    std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o600)).unwrap();
    tok
}

/// TCP off loopback: `mxrl rollout-server` refuses to start without --tls-cert/--tls-key and
/// names them; with them it serves on this machine's network address (loopback where the
/// machine has none, said in the output), `mxrl rl` without --tls-ca is turned away naming
/// it, and a trainer with --tls-ca and the token runs.
#[test]
fn off_loopback_the_server_needs_tls_and_a_trainer_runs_over_it() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let tok = token_file(d.path(), "tls-trainer-token-0123");
    let out = mxrl()
        .args(["rollout-server", "--model", s(&model)])
        .args(["--listen", "tcp:0.0.0.0:0", "--token-file", s(&tok)])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tls-cert") && err.contains("0.0.0.0"),
        "{err}"
    );
    // A key that does not belong to the certificate: refused before listening, named.
    let (ca, _, key) = tls_files(d.path(), &["127.0.0.1"]);
    let out = mxrl()
        .args(["rollout-server", "--model", s(&model)])
        .args(["--listen", "tcp:127.0.0.1:0", "--token-file", s(&tok)])
        .args(["--tls-cert", s(&ca), "--tls-key", s(&key)])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not usable together") && err.contains("server.key"),
        "{err}"
    );

    let (host, off_loopback) = match machine_address() {
        Ok(ip) => (ip.to_string(), true),
        Err(why) => {
            println!("no network address ({why}): the TLS server listens on 127.0.0.1");
            ("127.0.0.1".to_string(), false)
        }
    };
    let tls_dir = d.path().join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let (ca, cert, key) = tls_files(&tls_dir, &[&host]);
    let srv = Server::start_with(
        &model,
        RECIPE,
        &format!("tcp:{host}:0"),
        &[
            "--token-file",
            s(&tok),
            "--tls-cert",
            s(&cert),
            "--tls-key",
            s(&key),
        ],
        None,
    );
    srv.wait_line("TLS certificate");
    if off_loopback {
        let out = mxrl()
            .args(rl_args(&model, &d.path().join("no-tls")))
            .arg("--rollout")
            .arg(srv.endpoint.to_string())
            .args(["--token-file", s(&tok)])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--tls-ca") && err.contains(&host), "{err}");
    }
    let mut c = mxrl();
    c.args(rl_args(&model, &d.path().join("run")))
        .arg("--rollout")
        .arg(srv.endpoint.to_string())
        .args(["--token-file", s(&tok), "--tls-ca", s(&ca)]);
    run_ok(&mut c);
    let ms = read_jsonl(&d.path().join("run").join("metrics.jsonl")).unwrap();
    assert_eq!(
        ms.iter().map(|m| m.weight_version).collect::<Vec<_>>(),
        [1, 2]
    );
    let token = Token::from_file(&tok).unwrap();
    let tls = ClientTls::from_file(&ca).unwrap();
    let mut rc = RolloutClient::connect_tls(&srv.endpoint, Some(&token), Some(&tls)).unwrap();
    assert_eq!(rc.info().unwrap().version, 3);
    srv.wait_line("(TLS): applied weight version 3 ");
}

/// The sequence limits default to the model's max_position_embeddings: a request beyond the
/// model's positions is refused with LIMIT_EXCEEDED naming the limit, and flags beyond them
/// are refused at startup.
#[test]
fn sequence_limits_default_to_the_models_positions() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let cfg = model.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["max_position_embeddings"] = 48.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    for (flag, value, says) in [
        ("--max-sequence-length", "49", "max_position_embeddings"),
        ("--max-new-tokens", "49", "sequence length limit"),
    ] {
        let out = mxrl()
            .args(["rollout-server", "--model", s(&model)])
            .args(["--listen", &format!("unix:{}", s(&d.path().join("x.sock")))])
            .args([flag, value])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && err.contains(says), "{err}");
    }
    let srv = Server::start(&model, RECIPE, &d.path().join("p.sock"));
    let mut c = RolloutClient::connect(&srv.endpoint, None).unwrap();
    let limit = |e: ServerError| match e {
        ServerError::Remote {
            refusal: Some(r), ..
        } => (r.reason(), r.limit_name.clone(), r.limit),
        e => panic!("no typed refusal: {e}"),
    };
    let want = (Reason::LimitExceeded, "max_sequence_length".to_string(), 48);
    // 40 prompt tokens + 9 new tokens = 49 positions; 49 max_new_tokens alone.
    let e = c.generate_raw(generate_req(vec![1; 40], 1, 9)).unwrap_err();
    assert_eq!(limit(e), want);
    let e = c.generate_raw(generate_req(vec![1], 1, 49)).unwrap_err();
    assert_eq!(
        limit(e),
        (Reason::LimitExceeded, "max_new_tokens".to_string(), 48)
    );
    let e = c
        .score_raw(pb::ScoreRequest {
            temperature: 1.0,
            sequences: vec![pb::ScoreSequence {
                prompt: vec![1; 40],
                response: vec![2; 9],
                replay: None,
            }],
        })
        .unwrap_err();
    assert_eq!(limit(e), want);
    // At the limit: served.
    assert!(c.generate_raw(generate_req(vec![1; 40], 1, 8)).is_ok());
}

/// 1 000 connections that never speak: the server holds at most --max-connections of them,
/// closes each after --idle-timeout, and a trainer run succeeds meanwhile.
#[test]
fn idle_connections_are_capped_and_closed_and_a_trainer_run_succeeds() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let sock = d.path().join("i.sock");
    let srv = Server::start_with(
        &model,
        RECIPE,
        &format!("unix:{}", s(&sock)),
        &["--max-connections", "64", "--idle-timeout", "2"],
        None,
    );
    let mut idle = Vec::new();
    for _ in 0..1000 {
        idle.push(std::os::unix::net::UnixStream::connect(&sock).unwrap());
    }
    trainer_run(&model, &d.path().join("run"), &srv.endpoint, None);
    // The first connections were accepted and then closed by the server for idleness.
    let mut first = &idle[0];
    first
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut b = [0u8; 64];
    let mut closed = false;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        match first.read(&mut b) {
            Ok(0) | Err(_) => {
                closed = true;
                break;
            }
            Ok(_) => {}
        }
    }
    assert!(closed, "an idle connection was never closed");
}

/// Out of file descriptors: `accept` fails with EMFILE; the server logs it, keeps retrying,
/// and serves a trainer run once descriptors are free again.
#[test]
fn accept_errors_are_not_fatal() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let sock = d.path().join("e.sock");
    let srv = Server::start_with(
        &model,
        RECIPE,
        &format!("unix:{}", s(&sock)),
        &["--max-connections", "10000", "--idle-timeout", "600"],
        Some(64),
    );
    let mut held = Vec::new();
    for _ in 0..120 {
        held.push(std::os::unix::net::UnixStream::connect(&sock).unwrap());
    }
    let line = srv.wait_line("accept failed");
    assert!(line.contains("retrying"), "{line}");
    drop(held);
    trainer_run(&model, &d.path().join("run"), &srv.endpoint, None);
}

/// A trainer killed with SIGKILL takes its spawned server with it (the server watches a pipe
/// only the trainer holds), and the rerun resumes from the checkpoint with a fresh server.
#[test]
fn a_spawned_server_dies_with_its_killed_trainer_and_the_rerun_resumes() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let run = d.path().join("run");
    let mut args = rl_args(&model, &run);
    let i = args.iter().position(|a| a == "--steps").unwrap();
    args[i + 1] = "4".into();
    args.extend(["--checkpoint-every".into(), "1".into()]);
    let mut trainer = mxrl()
        .args(&args)
        .args(["--rollout", "spawn"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !run.join("checkpoint.safetensors").exists() {
        assert!(
            trainer.try_wait().unwrap().is_none(),
            "the trainer ended before its first checkpoint"
        );
        assert!(t.elapsed() < Duration::from_secs(300), "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    trainer.kill().unwrap(); // SIGKILL
    trainer.wait().unwrap();
    let log = run.join("rollout-server.log");
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("mxrl rollout-server: shut down") && !run.join("rollout.sock").exists() {
            assert!(text.contains("standard input closed"), "{text}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the orphaned server is still running: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = mxrl()
        .args(&args)
        .args(["--rollout", "spawn"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("resuming the run in"));
    let ms = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    assert_eq!(ms.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1, 2, 3]);
}

/// `python3` with grpcio and grpcio-tools importable: as it is, or with both installed (pinned)
/// into `target/pydeps` by pip. Fails loudly when neither works.
fn python_with_grpc() -> (String, Option<PathBuf>) {
    let ok = |pp: Option<&Path>| {
        let mut c = Command::new("python3");
        c.args(["-c", "import grpc, grpc_tools"]);
        if let Some(p) = pp {
            c.env("PYTHONPATH", p);
        }
        c.output().map(|o| o.status.success()).unwrap_or(false)
    };
    if ok(None) {
        return ("python3".into(), None);
    }
    let deps = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/pydeps");
    if !ok(Some(&deps)) {
        let out = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--target"])
            .arg(&deps)
            .args(["grpcio==1.68.1", "grpcio-tools==1.68.1"])
            .output()
            .expect("running python3 -m pip (python3 with pip is needed for this test)");
        assert!(
            out.status.success() && ok(Some(&deps)),
            "could not make grpcio and grpcio-tools importable (pip install into {}): {}{}",
            deps.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    ("python3".into(), Some(deps))
}

/// The Python client (scripts/rollout_client.py, built from the same .proto at run time)
/// drives a TCP server with its token: info, fetch, digest, an update of weights it changed
/// itself, typed refusals, generate and score. The server then holds exactly the bytes the
/// Python side sent, and samples as the Rust client does.
#[test]
fn the_python_client_drives_a_server() {
    use std::os::unix::fs::PermissionsExt;
    let (py, pythonpath) = python_with_grpc();
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let tok = d.path().join("token");
    std::fs::write(&tok, "python-client-token-0123\n").unwrap();
    std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(0o600)).unwrap();
    let srv = Server::start_with(
        &model,
        RECIPE,
        "tcp:127.0.0.1:0",
        &["--token-file", s(&tok)],
        None,
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rollout_client.py");
    let mut c = Command::new(&py);
    c.arg(&script)
        .args(["--address", &srv.endpoint.to_string()])
        .args(["--token-file", s(&tok)])
        .args(["--bucket-bytes", "4096", "selftest"]);
    if let Some(p) = &pythonpath {
        c.env("PYTHONPATH", p);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["protocol"], mxrl_rl::server::PROTOCOL);
    assert_eq!(
        (r["version"].as_u64(), r["applied"].as_u64()),
        (Some(0), Some(1))
    );
    for k in ["stale_refusal", "checksum_refusal", "vocab_refusal"] {
        assert!(r[k].is_string(), "{k}: {r}");
    }
    assert_eq!(r["digest_version"], 1);

    // The server holds the original export with every BF16 tensor negated by Python.
    let token = Token::from_file(&tok).unwrap();
    let mut rc = RolloutClient::connect(&srv.endpoint, Some(&token)).unwrap();
    let (v, held) = rc.fetch().unwrap();
    assert_eq!(v, 1);
    let (m, _) = load_model_dir(&model).unwrap();
    let mut want = build(&m, RECIPE).unwrap().trainer.export_weights().unwrap();
    let mut negated = Vec::new();
    for t in &mut want {
        if t.format == mxrl_formats::Format::Bf16 {
            for b in t.data.iter_mut().skip(1).step_by(2) {
                *b ^= 0x80;
            }
            negated.push(serde_json::Value::from(t.name.clone()));
        }
    }
    assert!(!negated.is_empty());
    assert_eq!(r["negated"], serde_json::Value::from(negated));
    check_equal(&held, &want).unwrap();
    // Python's samples equal the Rust client's for the same request.
    let cfg = mxrl_rl::SamplingConfig {
        temperature: 0.8,
        top_p: 1.0,
        max_new_tokens: 4,
    };
    let (_, samples) = rc
        .generate(&[vec![1, 2, 3], vec![4]], 2, &cfg, 0, 7)
        .unwrap();
    let py_samples: Vec<Vec<u32>> = serde_json::from_value(r["samples"].clone()).unwrap();
    let py_lps: Vec<Vec<f64>> = serde_json::from_value(r["logprobs"].clone()).unwrap();
    assert_eq!(
        samples
            .iter()
            .map(|s| s.response.clone())
            .collect::<Vec<_>>(),
        py_samples
    );
    for (s, l) in samples.iter().zip(&py_lps) {
        let bits: Vec<u32> = l.iter().map(|&x| (x as f32).to_bits()).collect();
        assert_eq!(
            s.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            bits
        );
    }

    // Over TLS: `--tls-ca` makes a TLS channel that reaches a TLS server; without it the
    // call fails.
    let tls_dir = d.path().join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let (ca, cert, key) = tls_files(&tls_dir, &["127.0.0.1"]);
    let tls_srv = Server::start_with(
        &model,
        RECIPE,
        "tcp:127.0.0.1:0",
        &[
            "--token-file",
            s(&tok),
            "--tls-cert",
            s(&cert),
            "--tls-key",
            s(&key),
        ],
        None,
    );
    for with_ca in [true, false] {
        let mut c = Command::new(&py);
        c.arg(&script)
            .args(["--address", &tls_srv.endpoint.to_string()])
            .args(["--token-file", s(&tok)]);
        if with_ca {
            c.args(["--tls-ca", s(&ca)]);
        }
        c.arg("info");
        if let Some(p) = &pythonpath {
            c.env("PYTHONPATH", p);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), with_ca, "--tls-ca {with_ca}: {err}");
        if with_ca {
            let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(r["protocol"], mxrl_rl::server::PROTOCOL, "{r}");
        }
    }
    // Plain TCP to an address off loopback: refused by the client itself, naming --tls-ca.
    let mut c = Command::new(&py);
    c.arg(&script).args([
        "--address",
        "tcp:192.0.2.1:7000",
        "--token-file",
        s(&tok),
        "info",
    ]);
    if let Some(p) = &pythonpath {
        c.env("PYTHONPATH", p);
    }
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--tls-ca"), "{err}");
}

/// Readiness is "my child answered with my nonce", not "something listens": with a foreign
/// server already on RUN_DIR/rollout.sock, `--rollout spawn` refuses to start (its child cannot
/// bind there) instead of training against the stranger, and the stranger is untouched.
#[test]
fn rollout_spawn_never_adopts_a_server_it_did_not_start() {
    let d = tempfile::tempdir().unwrap();
    let model = model_dir(d.path());
    let run = d.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let stranger = Server::start(&model, RECIPE, &run.join("rollout.sock"));
    let out = mxrl()
        .args(rl_args(&model, &run))
        .args(["--rollout", "spawn"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("another server is listening there") && err.contains("rollout-server.log"),
        "{err}"
    );
    let mut c = RolloutClient::connect(&stranger.endpoint, None).unwrap();
    let info = c.info().unwrap();
    assert_eq!((info.version, info.instance.as_str()), (0, ""));
    assert!(!run.join("metrics.jsonl").exists());
}
