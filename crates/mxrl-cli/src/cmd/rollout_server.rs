//! `mxrl rollout-server`: the rollout engine of a model directory and recipe in its own
//! process, serving generation, scoring and live weight updates over gRPC on a Unix socket or
//! TCP (protocol: `crates/mxrl-rl/proto/rollout.proto`, docs/rollout-server.md). `mxrl rl
//! --rollout ADDR` and `scripts/rollout_client.py` use it.

use anyhow::{bail, Context, Result};
use mxrl_rl::server::{
    Endpoint, Limits, ModelShape, RolloutServer, ServerConfig, ServerTls, Token,
};
use mxrl_rl::session::load_model_dir;
use mxrl_rl::sync::RolloutEngine;
use mxrl_rl::RolloutPolicy;
use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `mxrl rollout-server`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer.json): the weights served as
    /// version 0 until the first update.
    #[arg(long)]
    model: PathBuf,
    /// Precision recipe: a preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq,
    /// fp8-block) or a TOML file.
    #[arg(long, default_value = "bf16")]
    recipe: String,
    /// Where to listen: unix:PATH (created 0600) or tcp:HOST:PORT (needs --token-file, and
    /// --tls-cert/--tls-key unless HOST is loopback; port 0 picks a free port).
    #[arg(long)]
    listen: String,
    /// File holding the shared secret every call must carry (`authorization: Bearer TOKEN`);
    /// required on TCP. At least 16 characters, readable by its owner only (chmod 600).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Serve TCP over TLS with this PEM certificate chain (the server's certificate first; it
    /// must name the host clients connect to). Required when HOST is not loopback.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert (readable by its owner only).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// A nonce reported by the Info call, so a parent knows it reached the child it started.
    #[arg(long, default_value = "")]
    instance: String,
    /// Stop when standard input reaches end of file (the parent that holds its other end died
    /// or closed it): `mxrl rl --rollout spawn` uses this so its server dies with it.
    #[arg(long)]
    exit_with_stdin: bool,
    /// Largest weight bucket (bytes); default 256 MiB or the model's largest tensor if larger.
    #[arg(long)]
    max_bucket_bytes: Option<u64>,
    /// Largest Generate/Score request message (bytes).
    #[arg(long, default_value_t = mxrl_rl::server::DEFAULT_MAX_REQUEST_BYTES)]
    max_request_bytes: u64,
    /// Largest prompts × n of a Generate call (and sequences of a Score call).
    #[arg(long, default_value_t = mxrl_rl::server::DEFAULT_MAX_SEQUENCES)]
    max_sequences: u64,
    /// Largest prompt + response length in tokens; default and upper bound: the model's
    /// max_position_embeddings (config.json).
    #[arg(long)]
    max_sequence_length: Option<u64>,
    /// Largest max_new_tokens of a Generate call; default and upper bound: the sequence
    /// length limit.
    #[arg(long)]
    max_new_tokens: Option<u64>,
    /// Connections served at once (more wait in the listen backlog).
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// Concurrent calls per connection.
    #[arg(long, default_value_t = 8)]
    max_calls_per_connection: usize,
    /// Close a connection after this many seconds without a byte from the peer.
    #[arg(long, default_value_t = 300.0)]
    idle_timeout: f64,
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run `mxrl rollout-server` until a client asks it to shut down (or the process is killed).
pub fn run(a: Args) -> Result<()> {
    let ep: Endpoint = a.listen.parse()?;
    let token = a.token_file.as_deref().map(Token::from_file).transpose()?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(ServerTls::from_files(c, k)?),
        _ => None,
    };
    if a.device.device == super::device::Device::Cuda {
        super::device::cuda_built()?;
    }
    let (model, _codec) = load_model_dir(&a.model)?;
    let (rollout, b, runs_on) = super::device::build_rollout(&model, &a.recipe, a.device.device)
        .with_context(|| format!("recipe {}", a.recipe))?;
    let mut limits = Limits::for_model(ModelShape::of(model.config()), &rollout.weights());
    if let Some(m) = a.max_bucket_bytes {
        limits.max_bucket_bytes = m;
    }
    limits.max_request_bytes = a.max_request_bytes;
    limits.max_sequences = a.max_sequences;
    let positions = model.config().max_position_embeddings as u64;
    if let Some(n) = a.max_sequence_length {
        if n == 0 || n > positions {
            bail!(
                "--max-sequence-length {n}: expected 1..={positions} (the model's \
                 max_position_embeddings, {}/config.json)",
                a.model.display()
            );
        }
        limits.max_sequence_length = n;
    }
    limits.max_new_tokens = limits.max_sequence_length;
    if let Some(n) = a.max_new_tokens {
        if n == 0 || n > limits.max_sequence_length {
            bail!(
                "--max-new-tokens {n}: expected 1..={} (the sequence length limit)",
                limits.max_sequence_length
            );
        }
        limits.max_new_tokens = n;
    }
    if !(a.idle_timeout > 0.0 && a.idle_timeout.is_finite()) {
        bail!("--idle-timeout {}: expected seconds > 0", a.idle_timeout);
    }
    let model_name = a.model.display().to_string();
    let mut cfg = ServerConfig::new(&a.recipe, &model_name, limits);
    cfg.token = token;
    cfg.tls = tls;
    cfg.instance = a.instance.clone();
    cfg.max_connections = a.max_connections;
    cfg.max_calls_per_connection = a.max_calls_per_connection;
    cfg.idle_timeout = Duration::from_secs_f64(a.idle_timeout);
    let engine = RolloutEngine::new(rollout, 0, &b.contract_hash);
    let server = RolloutServer::bind(&ep, engine, cfg)?;
    if a.exit_with_stdin {
        let stop = server.stop_handle();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            println!("mxrl rollout-server: standard input closed (the parent is gone); stopping");
            stop.stop();
            // Calls in flight get a few seconds; then the process ends regardless.
            std::thread::sleep(Duration::from_secs(10));
            std::process::exit(1);
        });
    }
    // The first line is what a parent process waits for.
    println!("mxrl rollout-server: listening on {}", server.endpoint());
    println!(
        "model {model_name} · recipe {} · contract {} · weights {:?} · the model runs on {runs_on} · \
         {} · limits {limits:?} · serving v0",
        a.recipe,
        b.contract_hash,
        b.weight_bytes,
        match &a.tls_cert {
            Some(c) => format!("TLS certificate {}", c.display()),
            None if matches!(ep, Endpoint::Tcp(_)) => "TCP without TLS (loopback)".into(),
            None => "Unix socket".into(),
        }
    );
    server.serve(&mut |ev| println!("{ev}"))?;
    println!("mxrl rollout-server: shut down");
    Ok(())
}
