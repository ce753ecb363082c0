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
    /// Convert a Hugging Face checkpoint to MXFP8 / NVFP4 / FP8-block by a precision plan.
    Convert(cmd::convert::Args),
    /// Dequantize a converted (or block-FP8) checkpoint back to BF16.
    Dequantize(cmd::dequantize::Args),
    /// Re-derive a converted checkpoint from its source and compare every byte.
    Verify(cmd::verify::Args),
    /// Write a synthetic checkpoint in a real HF MoE layout (tests, benchmarks).
    #[command(hide = true)]
    Synth(cmd::synth::Args),
    /// Benchmark conversion against a plain copy of the same bytes.
    #[command(hide = true)]
    CkptBench(cmd::ckpt_bench::Args),
    /// Run a model over a token sequence; write logits and logprobs to safetensors.
    Forward(cmd::forward::Args),
    /// Sample a continuation of a prompt with a model.
    Generate(cmd::generate::Args),
    /// GRPO with a precision recipe, live weight sync and mismatch metrics (resumable).
    Rl(cmd::rl::Args),
    /// Serve a model's rollout engine over a Unix socket or TCP (for `mxrl rl --rollout`).
    RolloutServer(cmd::rollout_server::Args),
    /// Supervised warm-up on the arithmetic task; writes a model directory.
    Sft(cmd::sft::Args),
    /// Run the RL loop once per recipe (plus a noise seed) and write the report.
    Ablate(cmd::ablate::Args),
    /// Regenerate report.md and plots of an ablation directory.
    Report(cmd::report::Args),
    /// The main job: tiny MoE, SFT warm-up, BF16/MXFP8/NVFP4 ablation, runs/demo/report.md.
    Demo(cmd::demo::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Commands::Quantize(a) => cmd::quantize::run(a),
        Commands::Inspect(a) => cmd::inspect::run(a),
        Commands::Bench(a) => cmd::bench::run(a),
        Commands::Plan(a) => cmd::plan::run(a),
        Commands::Convert(a) => cmd::convert::run(a),
        Commands::Dequantize(a) => cmd::dequantize::run(a),
        Commands::Verify(a) => cmd::verify::run(a),
        Commands::Synth(a) => cmd::synth::run(a),
        Commands::CkptBench(a) => cmd::ckpt_bench::run(a),
        Commands::Forward(a) => cmd::forward::run(a),
        Commands::Generate(a) => cmd::generate::run(a),
        Commands::Rl(a) => cmd::rl::run(a),
        Commands::RolloutServer(a) => cmd::rollout_server::run(a),
        Commands::Sft(a) => cmd::sft::run(a),
        Commands::Ablate(a) => cmd::ablate::run(a),
        Commands::Report(a) => cmd::report::run(a),
        Commands::Demo(a) => cmd::demo::run(a),
    }
}
