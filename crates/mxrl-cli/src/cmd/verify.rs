//! `mxrl verify`: re-derive a converted checkpoint from its source and compare every byte,
//! the recorded plan, config and index. Exits non-zero on any difference.

use super::progress::Bar;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

/// Arguments of `mxrl verify`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The source checkpoint the conversion was made from.
    #[arg(long, value_name = "SRC")]
    source: PathBuf,
    /// The converted checkpoint.
    #[arg(long, value_name = "DST")]
    converted: PathBuf,
    /// Print only the differences and the total.
    #[arg(long)]
    quiet: bool,
}

/// Run `mxrl verify`.
pub fn run(a: Args) -> Result<()> {
    let bar = Bar::new("verify");
    let r = mxrl_ckpt::verify(&a.source, &a.converted, &bar);
    bar.finish();
    let report = r.with_context(|| {
        format!(
            "verifying {} against {}",
            a.converted.display(),
            a.source.display()
        )
    })?;
    for i in &report.items {
        if !(a.quiet && i.ok) {
            println!(
                "{} {}  {}",
                if i.ok { "ok  " } else { "DIFF" },
                i.item,
                i.detail
            );
        }
    }
    println!(
        "{} checked, {} difference(s)",
        report.items.len(),
        report.differences()
    );
    if !report.is_clean() {
        bail!(
            "{} differs from a fresh conversion of {} in {} item(s)",
            a.converted.display(),
            a.source.display(),
            report.differences()
        );
    }
    Ok(())
}
