//! Where the time of a two-process weight update goes: a device-engine trainer (the CPU
//! backend, so it runs anywhere) sends its weights to a rollout server holding a device-engine
//! rollout, over a Unix socket, exactly as `mxrl rl --rollout spawn` does (the runner's
//! `RolloutEngine::apply` on a `RemoteRollout`), and every stage is timed.
//!
//! ```text
//! cargo run --release -p mxrl-rl --example sync_breakdown -- --size large --recipe bf16 --updates 5
//! ```
//!
//! Printed per stage: the median over the updates (the first update is a warm-up and not
//! counted). `apply` is the whole update as the runner's sync sees it after the export; the
//! server's own part comes from its `Applied` event (`receive`: the transfer, SHA-256 and
//! decoding of the buckets; `install`: the engine thread). The isolated rows time the same
//! functions alone on this thread: one SHA-256 pass over all payload bytes, the engine
//! rollout's `load_weights` of the export, and the Digest snapshot (every held tensor copied
//! to the host and hashed).

use mxrl_model::engine::Engine;
use mxrl_model::Model;
use mxrl_rl::engine::EngineRollout;
use mxrl_rl::server::{
    Endpoint, Limits, ModelShape, RemoteRollout, RolloutServer, ServerConfig, ServerEvent,
    TensorDigest,
};
use mxrl_rl::session::{build_engine, demo_config, large_demo_config};
use mxrl_rl::sync::{RolloutEngine, UpdateAssembler, WeightUpdate};
use mxrl_rl::{RolloutPolicy, TrainPolicy};
use mxrl_tensor::device::CpuBackend;
use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};

struct Args {
    size: String,
    recipe: String,
    updates: usize,
    bucket_bytes: usize,
}

fn args() -> Args {
    let mut a = Args {
        size: "tiny".into(),
        recipe: "bf16".into(),
        updates: 5,
        bucket_bytes: 1 << 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--size" => a.size = v(),
            "--recipe" => a.recipe = v(),
            "--updates" => a.updates = v().parse().expect("--updates N"),
            "--bucket-bytes" => a.bucket_bytes = v().parse().expect("--bucket-bytes N"),
            other => panic!(
                "unknown argument {other}; expected --size tiny|large, --recipe NAME, \
                 --updates N, --bucket-bytes N"
            ),
        }
    }
    a
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

fn main() {
    let a = args();
    let cfg = match a.size.as_str() {
        "tiny" => demo_config(),
        "large" => large_demo_config(),
        other => panic!("--size {other}: expected tiny or large"),
    };
    let max_pos = 64;
    let model = Model::random(&cfg, 1).expect("model");
    let built = build_engine(&model, &a.recipe, max_pos, || Ok(CpuBackend)).expect("engines");
    let contract = built.contract_hash.clone();
    let mut trainer = built.trainer;
    let plan = mxrl_rl::moe::plan_for(model.config(), &a.recipe).expect("plan");
    let mut probe = EngineRollout::new(
        Engine::from_model(&model, CpuBackend, max_pos).expect("engine"),
        &plan,
    )
    .expect("rollout");

    let dir = tempfile::tempdir().expect("tempdir");
    let ep = Endpoint::Unix(dir.path().join("ro.sock"));
    let limits = Limits::for_model(ModelShape::of(model.config()), &built.rollout.weights());
    let server = RolloutServer::bind(
        &ep,
        RolloutEngine::new(built.rollout, 0, &contract),
        ServerConfig::new(&a.recipe, "bench", limits),
    )
    .expect("bind");
    let at = server.endpoint().clone();
    let stop = server.stop_handle();
    let (tx, events) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        server
            .serve(&mut |e| {
                let _ = tx.send(e.clone());
            })
            .expect("serve")
    });
    let mut remote = RemoteRollout::connect(&at, &contract, None).expect("connect");
    remote.set_bucket_bytes(a.bucket_bytes);
    let mut eng = RolloutEngine::new(remote, 0, &contract);

    let (mut export, mut build, mut apply, mut receive, mut install) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut sha, mut assemble, mut load, mut snapshot) = (vec![], vec![], vec![], vec![]);
    let mut bytes = 0;
    let mut buckets = 0;
    for v in 1..=a.updates as u64 + 1 {
        trainer.refresh_weights().expect("refresh");
        let (ex, t_export) = timed(|| trainer.export_weights().expect("export"));
        let sent = ex.clone();
        let (u, t_build) = timed(|| WeightUpdate::from_tensors(v, &contract, sent, a.bucket_bytes));
        let (r, t_apply) = timed(|| eng.apply(&u).expect("apply"));
        let (srv_receive, srv_install) = loop {
            match events
                .recv_timeout(Duration::from_secs(600))
                .expect("event")
            {
                ServerEvent::Applied {
                    receive, install, ..
                } => break (receive, install),
                ServerEvent::Refused { error, .. } => panic!("refused: {error}"),
                _ => {}
            }
        };
        let (_, t_sha) = timed(|| {
            for b in &u.buckets {
                std::hint::black_box(Sha256::digest(&b.payload));
            }
        });
        let (_, t_assemble) = timed(|| {
            let mut asm = UpdateAssembler::begin(u.header.clone(), &contract).expect("begin");
            for b in &u.buckets {
                asm.add(b).expect("bucket");
            }
            std::hint::black_box(asm.finish().expect("finish"));
        });
        let (_, t_load) = timed(|| probe.load_weights(&ex).expect("load"));
        let (_, t_snapshot) = timed(|| {
            let w = probe.weights();
            std::hint::black_box(w.iter().map(TensorDigest::of).collect::<Vec<_>>());
        });
        bytes = r.bytes;
        buckets = r.buckets;
        if v > 1 {
            export.push(t_export);
            build.push(t_build);
            apply.push(t_apply);
            receive.push(srv_receive);
            install.push(srv_install);
            sha.push(t_sha);
            assemble.push(t_assemble);
            load.push(t_load);
            snapshot.push(t_snapshot);
        }
    }
    eng.policy.shutdown_server().expect("shutdown");
    stop.stop();
    h.join().expect("server thread");

    let mb = bytes as f64 / 1e6;
    println!(
        "model {} ({} parameters), recipe {}, {mb:.1} MB in {buckets} buckets of ≤ {} bytes, \
         median of {} updates (ms):",
        a.size,
        model.params().num_elements(),
        a.recipe,
        a.bucket_bytes,
        a.updates
    );
    let row = |what: &str, ms: f64| {
        println!(
            "  {what:<44} {ms:>9.1} ms  {:>8.0} MB/s",
            if ms > 0.0 { mb / (ms / 1e3) } else { 0.0 }
        )
    };
    let (export_ms, build_ms, apply_ms) = (median(export), median(build), median(apply));
    row("trainer export_weights", export_ms);
    row("WeightUpdate::from_tensors (encode + SHA-256)", build_ms);
    row("RolloutEngine::apply (sent, applied, acked)", apply_ms);
    row("  server: receive + verify + decode", median(receive));
    row("  server: install on the engine thread", median(install));
    row(
        "export + build + apply (the runner's sync)",
        export_ms + build_ms + apply_ms,
    );
    println!("isolated, on this thread:");
    row("SHA-256 of every bucket payload (one pass)", median(sha));
    row(
        "UpdateAssembler: verify + decode all buckets",
        median(assemble),
    );
    row("EngineRollout::load_weights of the export", median(load));
    row(
        "Digest snapshot (weights() + SHA-256 each)",
        median(snapshot),
    );
}
