//! `mxrl dequantize`: a converted (or block-FP8) checkpoint back to BF16 Hugging Face form.

use super::progress::Bar;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// Arguments of `mxrl dequantize`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Quantized checkpoint directory.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Output directory (written as OUT.partial, renamed when complete).
    #[arg(long, value_name = "DST_DIR")]
    out: PathBuf,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
}

/// Run `mxrl dequantize`.
pub fn run(a: Args) -> Result<()> {
    let bar = Bar::new("dequantize");
    let r = mxrl_ckpt::dequantize(&a.model, &a.out, a.force, &bar);
    bar.finish();
    let s = r.with_context(|| format!("dequantizing {}", a.model.display()))?;
    println!("{s}");
    Ok(())
}
