//! `mxrl inspect`: tensors, dtypes, shapes, detected quantization format, contract hash and
//! size on disk of a safetensors file or of every `*.safetensors` file in a directory.
//! Files are opened by the one strict reader (`mxrl_ckpt`): a malformed header, offsets that
//! overlap, leave gaps or run past the end of the file are errors naming the file and tensor.
//! Only the headers are read. Formats are detected per weight group by the serving
//! containers of `mxrl_ckpt` (`container::Group::detect`), across the shards of a checkpoint.

use anyhow::{bail, Context, Result};
use mxrl_ckpt::container::{self, Detected};
use mxrl_ckpt::{Checkpoint, SafetensorsFile, TensorView, INDEX_FILE, SINGLE_FILE};
use mxrl_formats::{
    contract_hash, Scheme, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
use std::collections::{BTreeMap, HashMap};
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

/// The label of a tensor outside every weight group, from its name and dtype: a tensor of
/// the mxrl vector layout (`NAME/<scheme>.{data,scale,amax}`, contract §6), or by dtype.
fn single_label(t: &TensorView<'_>) -> String {
    if let Some((_, tail)) = t.name.rsplit_once('/') {
        if let Some((scheme, field)) = tail.rsplit_once('.') {
            if let Some(s) = Scheme::from_name(scheme) {
                if matches!(field, "data" | "scale" | "amax") {
                    return format!("{s} {field}");
                }
            }
        }
    }
    match t.dtype.name() {
        "BF16" | "F16" | "F32" | "F64" => "unquantized".into(),
        _ => "other".into(),
    }
}

/// The label of every tensor of one name space (a checkpoint, or one loose file): weight
/// groups are detected by the serving containers of `mxrl_ckpt` (the same detector that
/// convert, dequantize and the plan audit use), each member labelled `FORMAT ROLE (CONSUMER)`;
/// a group that is no layout is `unrecognized (why)`.
fn labels<'a>(views: Vec<TensorView<'a>>) -> HashMap<&'a str, String> {
    let (groups, singles) = container::groups(views);
    let mut out: HashMap<&str, String> =
        singles.iter().map(|t| (t.name, single_label(t))).collect();
    for g in groups {
        let detected = g.detect();
        for (suffix, t) in &g.parts {
            let label = match &detected {
                Ok(Detected::Unquantized) => "unquantized".to_string(),
                Ok(Detected::Quantized(l)) => match l.part_of_suffix(suffix) {
                    Some(p) => format!("{} {} ({})", l.format(), p.role(), l.consumer()),
                    None => format!("{} companion, ignored ({})", l.format(), l.consumer()),
                },
                Err(e) => format!("unrecognized ({e})"),
            };
            out.insert(t.name, label);
        }
    }
    out
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
/// directory (`model.safetensors` or an index and its shards, cross-checked: one name space,
/// `true`), another directory's `*.safetensors` files, or one file (a name space each).
fn open_all(path: &Path) -> Result<(Vec<SafetensorsFile>, bool)> {
    if !path.is_dir() {
        return Ok((vec![SafetensorsFile::open(path)?], false));
    }
    if path.join(INDEX_FILE).is_file() || path.join(SINGLE_FILE).is_file() {
        let ck = Checkpoint::open(path)?;
        let files = ck
            .shards()
            .iter()
            .map(|s| Ok(SafetensorsFile::open(s.path())?))
            .collect::<Result<_>>()?;
        return Ok((files, true));
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
    let files = v
        .iter()
        .map(|p| Ok(SafetensorsFile::open(p)?))
        .collect::<Result<_>>()?;
    Ok((files, false))
}

/// Every tensor of `f` as a view (the data is mapped, not read).
fn views(f: &SafetensorsFile) -> impl Iterator<Item = TensorView<'_>> {
    f.header().tensors.iter().map(move |t| TensorView {
        name: &t.name,
        dtype: t.dtype,
        shape: &t.shape,
        data: f.data(t),
        file: f.file_name(),
    })
}

/// Run `mxrl inspect`.
pub fn run(a: Args) -> Result<()> {
    let (files, one_checkpoint) = open_all(&a.path)?;
    // A checkpoint's weight groups may straddle its shards; loose files are labelled alone.
    let shared = one_checkpoint.then(|| labels(files.iter().flat_map(views).collect()));
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
        let own = if shared.is_none() {
            labels(views(sf).collect())
        } else {
            HashMap::new()
        };
        let label = |name: &str| shared.as_ref().unwrap_or(&own)[name].clone();
        let by_name: BTreeMap<&str, _> = h.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut per: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        for (name, e) in &by_name {
            let bytes = e.nbytes() as u64;
            let d = label(name);
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
