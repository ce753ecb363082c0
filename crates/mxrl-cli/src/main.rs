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
    /// Supervised warm-up on a built-in task; writes a model directory.
    Sft(cmd::sft::Args),
    /// Train a byte-level BPE tokenizer.json on a task's text (`tokenizer train`).
    Tokenizer(cmd::tokenizer::Args),
    /// Run the RL loop once per recipe (plus a noise seed) and write the report.
    Ablate(cmd::ablate::Args),
    /// Regenerate report.md and plots of an ablation directory.
    Report(cmd::report::Args),
    /// The main job: tiny MoE, SFT warm-up, BF16/MXFP8/NVFP4 ablation, runs/demo/report.md.
    Demo(cmd::demo::Args),
}

/// Let a closed stdout end the program quietly (`mxrl inspect DIR | head -1`), as other Unix
/// tools do, instead of a panic inside `println!`: the default SIGPIPE action, which Rust's
/// runtime replaces with "ignore". Commands that talk over sockets (`rl`, `rollout-server`)
/// keep "ignore", so a peer that hangs up is an error they handle, not a kill.
#[allow(unsafe_code)]
fn quiet_on_closed_stdout() {
    #[cfg(unix)]
    // SAFETY: called at the start of `main`, before any thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE and no Rust code relies on it being ignored in these commands.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if !matches!(cli.command, Commands::Rl(_) | Commands::RolloutServer(_)) {
        quiet_on_closed_stdout();
    }
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
        Commands::Tokenizer(a) => cmd::tokenizer::run(a),
        Commands::Ablate(a) => cmd::ablate::run(a),
        Commands::Report(a) => cmd::report::run(a),
        Commands::Demo(a) => cmd::demo::run(a),
    }
}

#[cfg(test)]
mod readme {
    use super::Cli;
    use clap::Parser;

    /// Every `mxrl …` command of a markdown text: lines of ```sh blocks run as `mxrl`,
    /// `target/release/mxrl` or `cargo run … -p mxrl-cli … -- …` (comments dropped, `$VAR`s
    /// set earlier in the block substituted; `--features cuda` lines only in a CUDA build),
    /// and one-line inline code spans that start with `mxrl `, pass an option and elide
    /// nothing. Returns (line number, arguments after the program name).
    fn commands(md: &str) -> Vec<(usize, Vec<String>)> {
        let mut out = Vec::new();
        let mut in_sh = false;
        let mut vars: Vec<(String, String)> = Vec::new();
        for (i, line) in md.lines().enumerate() {
            let t = line.trim();
            if t.starts_with("```") {
                in_sh = !in_sh && (t == "```sh" || t == "```bash" || t == "```shell");
                vars.clear();
                continue;
            }
            if in_sh {
                let code = t.split(" #").next().unwrap_or("").trim();
                if let Some((k, v)) = code.split_once('=') {
                    if !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                        vars.push((k.to_string(), v.to_string()));
                        continue;
                    }
                }
                let mut words: Vec<String> = code
                    .split_whitespace()
                    .map(|w| {
                        let mut w = w.to_string();
                        for (k, v) in &vars {
                            w = w.replace(&format!("${k}"), v);
                        }
                        w
                    })
                    .collect();
                let args = match words.first().map(String::as_str) {
                    Some("mxrl") | Some("target/release/mxrl") => words.split_off(1),
                    Some("cargo") if words.get(1).map(String::as_str) == Some("run") => {
                        let is_cli = words.windows(2).any(|w| w[0] == "-p" && w[1] == "mxrl-cli");
                        let needs_cuda = words
                            .windows(2)
                            .any(|w| w[0] == "--features" && w[1] == "cuda");
                        if needs_cuda && !cfg!(feature = "cuda") {
                            continue;
                        }
                        match words.iter().position(|w| w == "--") {
                            Some(p) if is_cli => words.split_off(p + 1),
                            _ => continue,
                        }
                    }
                    _ => continue,
                };
                out.push((i + 1, args));
            } else {
                let parts: Vec<&str> = t.split('`').collect();
                // An odd part is inside backticks; the last one is unterminated when the
                // count is even (the span continues on the next line): skipped.
                let closed = if parts.len().is_multiple_of(2) {
                    parts.len() - 1
                } else {
                    parts.len()
                };
                for (k, span) in parts[..closed].iter().enumerate() {
                    if k % 2 == 1
                        && span.starts_with("mxrl ")
                        && span.contains(" --")
                        && !span.contains("...")
                        && !span.contains('…')
                    {
                        let w: Vec<String> = span.split_whitespace().map(String::from).collect();
                        out.push((i + 1, w[1..].to_vec()));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_mxrl_command_of_the_readme_parses() {
        let md = include_str!("../../../README.md");
        let cmds = commands(md);
        // The quick start, conversion, demo, quantizer, CUDA and plan sections.
        assert!(cmds.len() >= 20, "only {} commands found", cmds.len());
        let bad: Vec<String> = cmds
            .iter()
            .filter_map(|(line, args)| {
                let argv = std::iter::once("mxrl".to_string()).chain(args.iter().cloned());
                Cli::try_parse_from(argv)
                    .err()
                    .map(|e| format!("README.md:{line}: mxrl {}\n{}", args.join(" "), e.render()))
            })
            .collect();
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    #[test]
    fn the_readme_check_catches_a_drifted_flag() {
        let md = "```sh\nM=x\nmxrl plan --model $M --recipe bf16   # ok\nmxrl rl --model m --mis 0.5 2\n```\nrun `mxrl plan --model m --recipe bf16`, `mxrl generate ...` or `mxrl rl`\n";
        let cmds = commands(md);
        assert_eq!(cmds.len(), 3, "{cmds:?}");
        assert_eq!(cmds[0].1, ["plan", "--model", "x", "--recipe", "bf16"]);
        let parse = |a: &Vec<String>| {
            Cli::try_parse_from(std::iter::once("mxrl".to_string()).chain(a.iter().cloned()))
        };
        assert!(parse(&cmds[0].1).is_ok());
        // `--mis LO HI` (two words) is not the CLI's `--mis LO,HI`.
        assert!(parse(&cmds[1].1).is_err());
        assert!(parse(&cmds[2].1).is_ok());
    }
}
