//! `mxrl convert`: a Hugging Face checkpoint → a servable MXFP8 / NVFP4 / FP8-block checkpoint
//! by a precision plan (see `mxrl_ckpt::convert`).

use super::progress::Bar;
use anyhow::{bail, Context, Result};
use mxrl_ckpt::{convert, ConvertOptions, Nvfp4Container};
use mxrl_plan::Recipe;
use std::path::PathBuf;

/// Arguments of `mxrl convert`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Source Hugging Face checkpoint directory (config.json + safetensors).
    #[arg(long, value_name = "SRC_DIR")]
    model: PathBuf,
    /// Recipe TOML file or preset name (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq,
    /// fp8-block).
    #[arg(long, value_name = "FILE_OR_PRESET")]
    recipe: String,
    /// Output directory (written as OUT.partial, renamed when complete).
    #[arg(long, value_name = "DST_DIR")]
    out: PathBuf,
    /// On-disk layout of NVFP4 weights.
    #[arg(
        long,
        value_name = "modelopt|compressed-tensors",
        default_value = "modelopt"
    )]
    format: String,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
    /// Convert tensors that hold NaN/Inf instead of refusing.
    #[arg(long)]
    allow_nonfinite: bool,
    /// Source MiB converted per parallel chunk (bounds memory to about 4x this).
    #[arg(long, default_value_t = 128, value_name = "MIB")]
    chunk_mib: usize,
}

/// Run `mxrl convert`.
pub fn run(a: Args) -> Result<()> {
    let Some(nvfp4) = Nvfp4Container::parse(&a.format) else {
        bail!(
            "--format `{}`: expected `modelopt` or `compressed-tensors`",
            a.format
        );
    };
    let recipe = Recipe::load(&a.recipe).with_context(|| format!("recipe `{}`", a.recipe))?;
    let opts = ConvertOptions {
        nvfp4,
        force: a.force,
        allow_nonfinite: a.allow_nonfinite,
        chunk_bytes: a.chunk_mib.max(1) << 20,
    };
    let bar = Bar::new("convert");
    let r = convert(&a.model, &recipe, &a.recipe, &a.out, &opts, &bar);
    bar.finish();
    let summary = r.with_context(|| {
        format!(
            "converting {} -> {} (nothing was written under {})",
            a.model.display(),
            a.out.display(),
            a.out.display()
        )
    })?;
    println!("{summary}");
    Ok(())
}
