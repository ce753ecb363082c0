//! `mxrl inspect`: tensors, dtypes, shapes, detected quantization format, contract hash and
//! size on disk of a safetensors file or of every `*.safetensors` file in a directory.
//! Files are opened by the one strict reader (`mxrl_ckpt`): a malformed header, offsets that
//! overlap, leave gaps or run past the end of the file are errors naming the file and tensor.
//! Only the headers are read.

use anyhow::{bail, Context, Result};
use mxrl_ckpt::{Checkpoint, SafetensorsFile, TensorInfo, INDEX_FILE, SINGLE_FILE};
use mxrl_formats::{
    contract_hash, Scheme, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Arguments of `mxrl inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A `.safetensors` file or a directory of them (e.g. a sharded checkpoint).
    #[arg(value_name = "FILE_OR_DIR")]
    path: PathBuf,
    /// Print only the per-file summary, not every tensor.
    #[arg(long)]
    summary: bool,
}

/// Detected role/format of one tensor, from its name, dtype and siblings.
fn detect(name: &str, e: &TensorInfo, all: &BTreeMap<&str, &TensorInfo>) -> String {
    // mxrl layout: NAME/<scheme>.{data,scale,amax}
    if let Some((_, tail)) = name.rsplit_once('/') {
        if let Some((scheme, field)) = tail.rsplit_once('.') {
            if let Some(s) = Scheme::from_name(scheme) {
                if matches!(field, "data" | "scale" | "amax") {
                    return format!("{s} {field}");
                }
            }
        }
    }
    let sibling = |suffix: &str| {
        name.strip_suffix(".weight")
            .map(|b| all.contains_key(format!("{b}.{suffix}").as_str()))
            .unwrap_or(false)
    };
    let scale_inv_dtype = name
        .strip_suffix(".weight")
        .and_then(|b| all.get(format!("{b}.weight_scale_inv").as_str()))
        .map(|s| s.dtype.name());
    match e.dtype.name() {
        "F8_E4M3" if scale_inv_dtype == Some("U8") => "mxfp8 data (SGLang, ue8m0 scale_inv)".into(),
        "F8_E4M3" if sibling("weight_scale_inv") => "fp8_block data (DeepSeek scale_inv)".into(),
        "F8_E4M3" if sibling("weight_scale") => "fp8 e4m3 data (per-tensor/channel scale)".into(),
        "F8_E4M3" => "fp8 e4m3 data".into(),
        "F8_E5M2" => "fp8 e5m2 data".into(),
        "U8" if sibling("weight_scale_2") => "nvfp4 packed data (ModelOpt)".into(),
        "U8" if sibling("weight_scale") => "mx/nv packed or fp8 data".into(),
        "U8" if name.ends_with("weight_scale_inv") => "mxfp8 ue8m0 scale".into(),
        _ if name.ends_with("weight_scale_inv") => "fp8_block scale_inv".into(),
        _ if name.ends_with("weight_scale_2") => "nvfp4 global scale".into(),
        _ if name.ends_with("weight_scale") => "block scale".into(),
        "BF16" | "F16" | "F32" | "F64" => "unquantized".into(),
        _ => "other".into(),
    }
}

fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// The files to inspect, each opened and validated by the one strict reader: a checkpoint
/// directory (`model.safetensors` or an index and its shards, cross-checked), another
/// directory's `*.safetensors` files, or one file.
fn open_all(path: &Path) -> Result<Vec<SafetensorsFile>> {
    if !path.is_dir() {
        return Ok(vec![SafetensorsFile::open(path)?]);
    }
    if path.join(INDEX_FILE).is_file() || path.join(SINGLE_FILE).is_file() {
        let ck = Checkpoint::open(path)?;
        return ck
            .shards()
            .iter()
            .map(|s| Ok(SafetensorsFile::open(s.path())?))
            .collect();
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    if v.is_empty() {
        bail!(
            "{}: no *.safetensors files in this directory",
            path.display()
        );
    }
    v.iter().map(|p| Ok(SafetensorsFile::open(p)?)).collect()
}

/// Run `mxrl inspect`.
pub fn run(a: Args) -> Result<()> {
    let files = open_all(&a.path)?;
    let mut total = 0u64;
    let mut totals: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for sf in &files {
        let f = sf.path();
        let h = sf.header();
        let size = sf.len() as u64;
        total += size;
        println!(
            "{}  ({}, {} tensors)",
            f.display(),
            human(size),
            h.tensors.len()
        );
        let hash = h.metadata.get(META_CONTRACT_HASH);
        let ver = h.metadata.get(META_CONTRACT_VERSION);
        match hash {
            Some(hh) => {
                let verdict = if hh == contract_hash() {
                    "matches this build"
                } else {
                    "DIFFERS from this build"
                };
                println!(
                    "  contract: v{} hash {hh} ({verdict}: v{CONTRACT_VERSION} {})",
                    ver.map(String::as_str).unwrap_or("?"),
                    contract_hash()
                );
            }
            None => println!("  contract: none recorded"),
        }
        let other: Vec<String> = h
            .metadata
            .iter()
            .filter(|(k, _)| {
                k.as_str() != META_CONTRACT_HASH && k.as_str() != META_CONTRACT_VERSION
            })
            .map(|(k, v)| format!("{k} ({} chars)", v.len()))
            .collect();
        if !other.is_empty() {
            println!("  metadata: {}", other.join(", "));
        }
        let by_name: BTreeMap<&str, &TensorInfo> =
            h.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut per: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        for (name, e) in &by_name {
            let bytes = e.nbytes() as u64;
            let d = detect(name, e, &by_name);
            let key = d.split(' ').next().unwrap_or("").to_string();
            let s = per.entry(key.clone()).or_default();
            s.0 += 1;
            s.1 += bytes;
            let t = totals.entry(key).or_default();
            t.0 += 1;
            t.1 += bytes;
            if !a.summary {
                println!(
                    "  {name:<60} {:<8} {:<18} {:>12}  {d}",
                    e.dtype.name(),
                    format!("{:?}", e.shape),
                    human(bytes)
                );
            }
        }
        for (k, (n, b)) in &per {
            println!("  summary: {k:<14} {n:>6} tensors {:>12}", human(*b));
        }
    }
    if files.len() > 1 {
        println!("total: {} files, {}", files.len(), human(total));
        for (k, (n, b)) in &totals {
            println!("  {k:<14} {n:>6} tensors {:>12}", human(*b));
        }
    }
    Ok(())
}
