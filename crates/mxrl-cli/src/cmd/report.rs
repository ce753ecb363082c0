//! `mxrl report RUN_DIR`: regenerate `report.md` and the plots from an ablation directory.

use anyhow::Result;
use std::path::PathBuf;

/// Arguments of `mxrl report`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ablation directory (with ablation.json and one metrics.jsonl per run).
    dir: PathBuf,
}

/// Run `mxrl report`.
pub fn run(a: Args) -> Result<()> {
    let p = mxrl_rl::report::write_report(&a.dir)?;
    eprintln!("report: {}", p.display());
    Ok(())
}
