//! `mxrl`: the command-line entry point. One file per subcommand in `cmd/`.

mod cmd;
mod st;

use clap::{Parser, Subcommand};

/// Low-precision RL of LLMs with MXFP8 / NVFP4 under one bit-exact precision contract.
#[derive(Parser, Debug)]
#[command(name = "mxrl", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand, Debug)]
enum Commands {
    /// Quantize tensors of a safetensors file, or reproduce / check a quantizer vector file.
    Quantize(cmd::quantize::Args),
    /// List tensors, dtypes, shapes, detected quantization formats and contract hash.
    Inspect(cmd::inspect::Args),
    /// Measurements reproducing the seed's experiments (`bench memory`).
    Bench(cmd::bench::Args),
    /// Resolve a precision recipe against a model: per-tensor plan, exports, checkpoint audit.
    Plan(cmd::plan::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Commands::Quantize(a) => cmd::quantize::run(a),
        Commands::Inspect(a) => cmd::inspect::run(a),
        Commands::Bench(a) => cmd::bench::run(a),
        Commands::Plan(a) => cmd::plan::run(a),
    }
}
