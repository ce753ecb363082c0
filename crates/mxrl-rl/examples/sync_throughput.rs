//! Weight-update throughput of the rollout service over a Unix socket: a bucketed update of
//! `--gib` GiB of BF16 tensors (16 MiB each, 64 MiB buckets) sent by a client to a rollout
//! server in the same process, checksummed and applied, `--reps` times.
//!
//! `cargo run --release -p mxrl-rl --example sync_throughput -- --gib 2 --reps 3`

use mxrl_formats::Format;
use mxrl_rl::policy::{PolicyError, RolloutPolicy, Sample, SamplingConfig, TrainSeq, WireTensor};
use mxrl_rl::server::{Endpoint, Limits, ModelShape, RolloutClient, RolloutServer, ServerConfig};
use mxrl_rl::sync::{RolloutEngine, WeightUpdate};
use std::time::Instant;

/// A policy that accepts any tensors and keeps only their byte count.
struct Sink(u64);

impl RolloutPolicy for Sink {
    fn generate(
        &mut self,
        _: &[Vec<u32>],
        _: usize,
        _: &SamplingConfig,
        _: u32,
        _: u64,
    ) -> Result<Vec<Sample>, PolicyError> {
        Ok(Vec::new())
    }
    fn load_weights(&mut self, tensors: &[WireTensor]) -> Result<(), PolicyError> {
        self.0 = tensors.iter().map(|t| t.byte_len() as u64).sum();
        Ok(())
    }
    fn weights(&self) -> Vec<WireTensor> {
        Vec::new()
    }
    fn score(&mut self, _: &[TrainSeq<'_>], _: f32) -> Result<Vec<Vec<f32>>, PolicyError> {
        Ok(Vec::new())
    }
}

fn arg(name: &str, default: f64) -> f64 {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let gib = arg("--gib", 2.0);
    let reps = arg("--reps", 3.0) as usize;
    let tensor_bytes = 16usize << 20;
    let n = ((gib * (1u64 << 30) as f64) as usize / tensor_bytes).max(1);
    let tensors: Vec<WireTensor> = (0..n)
        .map(|i| WireTensor {
            name: format!("layers.{i}.weight"),
            format: Format::Bf16,
            shape: vec![2048, 4096],
            data: (0..tensor_bytes).map(|j| (i * 31 + j * 7) as u8).collect(),
            scales: Vec::new(),
            amax: Vec::new(),
        })
        .collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let ep = Endpoint::Unix(dir.path().join("bench.sock"));
    let contract = mxrl_rl::wire::contract_hash();
    let mut limits = Limits::for_model(
        ModelShape {
            vocab_size: 1,
            moe_layers: 0,
            top_k: 0,
            num_experts: 0,
            max_positions: 1,
        },
        &[],
    );
    limits.max_tensors = n as u64;
    limits.max_update_bytes = u64::MAX;
    let cfg = ServerConfig::new("bf16", "sink", limits);
    let srv =
        RolloutServer::bind(&ep, RolloutEngine::new(Sink(0), 0, contract), cfg).expect("bind");
    let stop = srv.stop_handle();
    let h = std::thread::spawn(move || srv.serve(&mut |_| {}).expect("serve"));
    let mut c = RolloutClient::connect(&ep, None).expect("connect");
    let mut rates = Vec::new();
    for v in 1..=reps as u64 {
        let u = WeightUpdate::build(v, contract, &tensors, 64 << 20);
        let t = Instant::now();
        let (bytes, buckets) = (u.header.bytes, u.buckets.len());
        let served = c.update(u).expect("update");
        let s = t.elapsed().as_secs_f64();
        assert_eq!(served, v);
        let gb = bytes as f64 / 1e9;
        println!(
            "update v{v}: {:.3} GB in {} buckets, {s:.3} s, {:.3} GB/s",
            gb,
            buckets,
            gb / s
        );
        rates.push(gb / s);
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "median {:.3} GB/s, best {:.3} GB/s over {reps} updates of {:.2} GiB",
        rates[rates.len() / 2],
        rates[rates.len() - 1],
        gib
    );
    stop.stop();
    drop(c);
    h.join().expect("server thread");
}
