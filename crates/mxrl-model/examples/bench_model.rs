//! Throughput of forward, backward and batched decode on the CPU backend.
//!
//! `cargo run --release -p mxrl-model --example bench_model -- [tiny|20m] [batch] [seq_len] [new_tokens]`
//!
//! Baseline measured in the same run: one f32 GEMM `[batch·seq_len, H] × [H, H]ᵀ` through the
//! same `mxrl_tensor::gemm` path, reported as GFLOP/s, so model throughput can be read as a
//! fraction of what the GEMM alone achieves on this machine.

use mxrl_model::{ForwardOptions, Model, SamplingParams, SeqInput};
use std::time::Instant;

mod common;
use common::config;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("tiny");
    let batch: usize = args.get(2).map(|s| s.parse().expect("batch")).unwrap_or(8);
    let len: usize = args
        .get(3)
        .map(|s| s.parse().expect("seq_len"))
        .unwrap_or(64);
    let new: usize = args
        .get(4)
        .map(|s| s.parse().expect("new_tokens"))
        .unwrap_or(32);
    let c = config(name);
    let model = Model::random(&c, 0).expect("valid config");
    let params = model.params().num_elements();
    // active params per token: everything except the non-selected experts
    let v = c.vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..len + 1)
                .map(|t| ((b * 131 + t * 17) as u32) % v)
                .collect()
        })
        .collect();
    let inputs: Vec<SeqInput> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    let ntok = batch * len;
    let reps = 3;

    let t0 = Instant::now();
    let mut tape = None;
    for _ in 0..reps {
        let out = model
            .forward(
                &inputs,
                &ForwardOptions {
                    train: true,
                    ..Default::default()
                },
            )
            .expect("forward");
        tape = out.tape;
    }
    let fwd = t0.elapsed().as_secs_f64() / reps as f64;
    let dl: Vec<Vec<f32>> = (0..batch).map(|_| vec![-1.0 / ntok as f32; len]).collect();
    let t0 = Instant::now();
    for _ in 0..reps {
        let g = model
            .backward(tape.as_ref().unwrap(), &dl, 0.01)
            .expect("backward");
        std::hint::black_box(g);
    }
    let bwd = t0.elapsed().as_secs_f64() / reps as f64;

    let prompts: Vec<&[u32]> = seqs.iter().map(|s| &s[..8]).collect();
    let sp = SamplingParams {
        max_new_tokens: new,
        seed: 1,
        ..Default::default()
    };
    let t0 = Instant::now();
    let gens = model.generate(&prompts, &sp).expect("generate");
    let dec = t0.elapsed().as_secs_f64();
    let ndec: usize = gens.iter().map(|g| g.tokens.len()).sum();

    // baseline GEMM in the same run
    let (m, k) = (ntok, c.hidden_size);
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * k];
    let t0 = Instant::now();
    let greps = 20;
    for _ in 0..greps {
        std::hint::black_box(mxrl_tensor::gemm::matmul_nt(&a, &b, m, k, k));
    }
    let gt = t0.elapsed().as_secs_f64() / greps as f64;
    let gflops = 2.0 * (m * k * k) as f64 / gt / 1e9;

    println!("config {name}: {params} parameters, batch {batch} × {len} tokens, decode {batch} × {new} new tokens");
    println!(
        "forward  (train, tape kept): {:>10.0} tokens/s",
        ntok as f64 / fwd
    );
    println!(
        "backward                   : {:>10.0} tokens/s",
        ntok as f64 / bwd
    );
    println!(
        "decode (prefill 8 + sample): {:>10.0} tokens/s ({ndec} tokens in {dec:.3} s)",
        ndec as f64 / dec
    );
    println!("baseline f32 GEMM [{m}×{k}]·[{k}×{k}]ᵀ: {gflops:.2} GFLOP/s");
}
