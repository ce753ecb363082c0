//! `mxrl rollout-server`: the rollout engine of a model directory and recipe in its own
//! process, serving generation, scoring and live weight updates over a Unix socket or TCP
//! (protocol: `mxrl_rl::server`, docs/rollout-server.md). `mxrl rl --rollout ADDR` uses it.

use anyhow::{Context, Result};
use mxrl_rl::server::{Endpoint, RolloutServer};
use mxrl_rl::session::{build, load_model_dir};
use mxrl_rl::sync::RolloutEngine;
use std::path::PathBuf;

/// Arguments of `mxrl rollout-server`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer.json): the weights served as
    /// version 0 until the first update.
    #[arg(long)]
    model: PathBuf,
    /// Precision recipe: a preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq) or a TOML file.
    #[arg(long, default_value = "bf16")]
    recipe: String,
    /// Where to listen: unix:PATH or tcp:HOST:PORT (port 0 picks a free port).
    #[arg(long)]
    listen: String,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run `mxrl rollout-server` until a client asks it to shut down (or the process is killed).
pub fn run(a: Args) -> Result<()> {
    let ep: Endpoint = a.listen.parse()?;
    let gemm = a.device.select()?;
    let (model, _codec) = load_model_dir(&a.model)?;
    let b = build(&model, &a.recipe).with_context(|| format!("recipe {}", a.recipe))?;
    let engine = RolloutEngine::new(b.rollout, 0, &b.contract_hash);
    let model_name = a.model.display().to_string();
    let server = RolloutServer::bind(&ep, engine, &a.recipe, &model_name)?;
    // The first line is what a parent process waits for.
    println!("mxrl rollout-server: listening on {}", server.endpoint());
    println!(
        "model {model_name} · recipe {} · contract {} · weights {:?} · GEMMs on {gemm} · serving v0",
        a.recipe, b.contract_hash, b.weight_bytes
    );
    server.serve(&mut |ev| println!("{ev}"))?;
    println!("mxrl rollout-server: shut down");
    Ok(())
}
