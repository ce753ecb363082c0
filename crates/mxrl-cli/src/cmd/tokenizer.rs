//! `mxrl tokenizer train`: a byte-level BPE `tokenizer.json` trained on a task's text
//! ([`mxrl_rl::text::train_bpe`]), with a `tokenizer_config.json` beside it for Hugging Face
//! tooling, for `mxrl sft --tokenizer` and `mxrl demo --tokenizer` (`mxrl demo --size real`
//! trains one itself, [`train_into`]).

use anyhow::{Context, Result};
use mxrl_rl::task::TaskSpec;
use mxrl_rl::text::{task_corpus, train_bpe};
use std::path::{Path, PathBuf};

/// Arguments of `mxrl tokenizer`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Train a byte-level BPE tokenizer.json on a task's prompts and answers.
    Train(TrainArgs),
}

/// Arguments of `mxrl tokenizer train`.
#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// Output directory; DIR/tokenizer.json is written (to a temporary file, renamed when
    /// complete).
    #[arg(long)]
    out: PathBuf,
    /// Vocabulary size, exactly: 4 specials + 256 byte symbols + merges, the rest reserved
    /// tokens when the corpus has fewer pairs worth merging (260–262144).
    #[arg(long, default_value_t = 384)]
    vocab_size: usize,
    /// Built-in task: `arithmetic` (a+b=) or `chain` (a chain of operations such as
    /// `17+5*3-8=`; with --worked the corpus holds worked responses); ignored when --data is
    /// given.
    #[arg(long)]
    task: Option<String>,
    /// DAPO-style JSONL prompt file (`prompt`, `label`): its prompts and `Answer: X` lines.
    #[arg(long)]
    data: Option<PathBuf>,
    #[command(flatten)]
    problems: super::rl::ProblemArgs,
    /// Problems in the corpus (each gives its prompt and its answer; a prompt file gives at
    /// most its own lines) (≥ 1).
    #[arg(long, default_value_t = 4096, value_parser = super::validate::count_usize)]
    samples: usize,
    /// Seed of the corpus's problem stream.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Replace an existing DIR/tokenizer.json.
    #[arg(long)]
    force: bool,
}

/// Run `mxrl tokenizer`.
pub fn run(a: Args) -> Result<()> {
    match a.cmd {
        Cmd::Train(t) => train(t),
    }
}

fn train(a: TrainArgs) -> Result<()> {
    let spec = TaskSpec {
        name: a.task.clone(),
        data: a.data.clone(),
        ..a.problems.task_spec()
    };
    let file = a.out.join("tokenizer.json");
    anyhow::ensure!(
        !file.exists() || a.force,
        "{}: already exists; refusing to overwrite it (pass --force to replace it)",
        file.display()
    );
    train_into(&spec, a.vocab_size, a.samples, a.seed, &a.out)?;
    eprintln!(
        "written: {}\n  next: mxrl sft --tokenizer {} --out runs/base-bpe",
        file.display(),
        file.display()
    );
    Ok(())
}

/// `tokenizer_config.json` beside a trained `tokenizer.json`, so Hugging Face tooling
/// (`AutoTokenizer.from_pretrained(DIR)`) loads it as a fast tokenizer with its specials
/// ([`mxrl_rl::text::SPECIALS`]); nothing is added to an encoding.
pub fn tokenizer_config_json() -> String {
    let [pad, bos, eos, unk] = mxrl_rl::text::SPECIALS;
    serde_json::to_string_pretty(&serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
    }))
    .expect("static JSON")
}

/// Trains a byte-level BPE of `vocab_size` tokens on `samples` problems of `spec` (problem
/// stream `seed`) and writes `DIR/tokenizer.json` (checked to load with the `tokenizers`
/// crate) and `DIR/tokenizer_config.json` ([`tokenizer_config_json`]), each to a temporary
/// file renamed when complete; returns the `tokenizer.json` text.
pub fn train_into(
    spec: &TaskSpec,
    vocab_size: usize,
    samples: usize,
    seed: u64,
    dir: &Path,
) -> Result<String> {
    let task = spec.source(None)?;
    let file = dir.join("tokenizer.json");
    let corpus = task_corpus(&task, samples, seed);
    let json = train_bpe(corpus.iter(), vocab_size)?;
    let tok: tokenizers::Tokenizer = json
        .parse()
        .map_err(|e| anyhow::anyhow!("{}: reloading: {e}", file.display()))?;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the output directory {}", dir.display()))?;
    mxrl_ckpt::write_bytes_atomic(&file, json.as_bytes())?;
    mxrl_ckpt::write_bytes_atomic(
        &dir.join("tokenizer_config.json"),
        tokenizer_config_json().as_bytes(),
    )?;
    let v: serde_json::Value = serde_json::from_str(&json)?;
    let merges = v["model"]["merges"].as_array().map_or(0, Vec::len);
    eprintln!(
        "tokenizer: {} tokens (4 specials, 256 bytes, {merges} merges, {} reserved) from {} texts of {}",
        vocab_size,
        vocab_size - 260 - merges,
        corpus.len(),
        spec.describe()?
    );
    for text in corpus.iter().take(2) {
        let enc = tok
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("encoding {text:?}: {e}"))?;
        eprintln!("  {text:?} → {:?}", enc.get_tokens());
    }
    Ok(json)
}
