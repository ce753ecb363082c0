//! `mxrl ckpt-bench` (hidden): conversion throughput against a plain read+write copy of the
//! same checkpoint, measured in the same run (BENCHMARKS.md).
//!
//! Baseline: every shard file read with 8 MiB buffered reads and written to a new file with
//! 8 MiB buffered writes, then fsync'ed (conversion fsyncs its shards too). Measured before and
//! after the conversions; ratios use the faster copy. All runs read the source from the page
//! cache (a warm-up read comes first), so the numbers compare CPU + write cost.

use anyhow::{bail, Context, Result};
use mxrl_ckpt::{convert, Checkpoint, ConvertOptions, NoProgress, Nvfp4Container};
use mxrl_plan::Recipe;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `mxrl ckpt-bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Source checkpoint (e.g. written by `mxrl synth`).
    #[arg(long)]
    model: PathBuf,
    /// Scratch directory for outputs (removed after each run).
    #[arg(long, default_value = "/tmp/mxrl-ckpt-bench")]
    work: PathBuf,
    /// Recipe for the FP8-block case (a file; the others use presets).
    #[arg(long)]
    fp8_recipe: Option<PathBuf>,
}

fn copy_files(src: &Path, dst: &Path) -> Result<f64> {
    if dst.exists() {
        std::fs::remove_dir_all(dst)?;
    }
    std::fs::create_dir_all(dst)?;
    let t = Instant::now();
    let mut buf = vec![0u8; 8 << 20];
    for e in std::fs::read_dir(src)? {
        let p = e?.path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut r = BufReader::with_capacity(8 << 20, std::fs::File::open(&p)?);
        let f = std::fs::File::create(dst.join(p.file_name().expect("file")))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            w.write_all(&buf[..n])?;
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    let s = t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dst)?;
    Ok(s)
}

fn warm(src: &Path) -> Result<()> {
    let mut buf = vec![0u8; 8 << 20];
    for e in std::fs::read_dir(src)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let mut f = std::fs::File::open(&p)?;
            while f.read(&mut buf)? > 0 {}
        }
    }
    Ok(())
}

/// Run `mxrl ckpt-bench`.
pub fn run(a: Args) -> Result<()> {
    let ck = Checkpoint::open(&a.model).with_context(|| format!("{}", a.model.display()))?;
    let bytes = ck.total_data_bytes();
    drop(ck);
    if a.work.starts_with(&a.model) {
        bail!("--work must be outside --model");
    }
    std::fs::create_dir_all(&a.work)?;
    warm(&a.model)?;
    let gb = bytes as f64 / 1e9;
    let copy1 = copy_files(&a.model, &a.work.join("copy"))?;
    let fp8 = match &a.fp8_recipe {
        Some(p) => Some(Recipe::from_path(p)?),
        None => None,
    };
    let mut cases = vec![
        ("mxfp8", Recipe::preset("mxfp8")?, Nvfp4Container::ModelOpt),
        (
            "nvfp4-hp",
            Recipe::preset("nvfp4-hp")?,
            Nvfp4Container::ModelOpt,
        ),
        (
            "nvfp4-hp",
            Recipe::preset("nvfp4-hp")?,
            Nvfp4Container::CompressedTensors,
        ),
    ];
    if let Some(r) = fp8 {
        cases.push(("fp8-block", r, Nvfp4Container::ModelOpt));
    }
    let mut rows = Vec::new();
    for (label, recipe, c) in &cases {
        let out = a.work.join("out");
        let opts = ConvertOptions {
            nvfp4: *c,
            force: true,
            ..Default::default()
        };
        let s = convert(&a.model, recipe, label, &out, &opts, &NoProgress)?;
        rows.push((format!("{label} ({})", c.name()), s.seconds, s.bytes_out));
        std::fs::remove_dir_all(&out)?;
    }
    let copy2 = copy_files(&a.model, &a.work.join("copy"))?;
    let copy = copy1.min(copy2);
    println!(
        "source: {} ({gb:.3} GB of tensors), {} threads",
        a.model.display(),
        rayon::current_num_threads()
    );
    println!("| case | seconds | GB/s | ratio to copy | output GB |");
    println!("|---|---|---|---|---|");
    println!(
        "| plain read+write copy (best of 2: {copy1:.2} s, {copy2:.2} s) | {copy:.2} | {:.3} | 1.00 | {gb:.3} |",
        gb / copy
    );
    for (name, s, out) in rows {
        println!(
            "| convert {name} | {s:.2} | {:.3} | {:.2} | {:.3} |",
            gb / s,
            copy / s,
            out as f64 / 1e9
        );
    }
    Ok(())
}
