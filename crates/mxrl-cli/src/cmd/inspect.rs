//! `mxrl inspect`: tensors, dtypes, shapes, detected quantization format, contract hash and
//! size on disk of a safetensors file or of every `*.safetensors` file in a directory.
//! Only the headers are read.

use anyhow::{bail, Context, Result};
use mxrl_formats::{
    contract_hash, Scheme, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
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

#[derive(serde::Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

struct Header {
    tensors: BTreeMap<String, Entry>,
    metadata: HashMap<String, String>,
}

fn read_header(path: &Path) -> Result<Header> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .with_context(|| format!("{}: shorter than a safetensors header", path.display()))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 {
        bail!(
            "{}: header length {n} is implausible (not a safetensors file?)",
            path.display()
        );
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)
        .with_context(|| format!("{}: truncated header", path.display()))?;
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&buf)
        .with_context(|| format!("{}: header is not a JSON object", path.display()))?;
    let metadata = match v.remove("__metadata__") {
        Some(m) => serde_json::from_value(m)
            .with_context(|| format!("{}: bad __metadata__", path.display()))?,
        None => HashMap::new(),
    };
    let mut tensors = BTreeMap::new();
    for (k, e) in v {
        let e: Entry = serde_json::from_value(e)
            .with_context(|| format!("{}: bad entry for `{k}`", path.display()))?;
        tensors.insert(k, e);
    }
    Ok(Header { tensors, metadata })
}

/// Detected role/format of one tensor, from its name, dtype and siblings.
fn detect(name: &str, e: &Entry, all: &BTreeMap<String, Entry>) -> String {
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
            .map(|b| all.contains_key(&format!("{b}.{suffix}")))
            .unwrap_or(false)
    };
    let scale_inv_dtype = name
        .strip_suffix(".weight")
        .and_then(|b| all.get(&format!("{b}.weight_scale_inv")))
        .map(|s| s.dtype.as_str());
    match e.dtype.as_str() {
        "F8_E4M3" if scale_inv_dtype == Some("U8") => "mxfp8 data (SGLang, ue8m0 scale_inv)".into(),
        "F8_E4M3" if sibling("weight_scale_inv") => "fp8_block data (DeepSeek scale_inv)".into(),
        "F8_E4M3" if sibling("weight_scale") => "fp8 e4m3 data (per-tensor/channel scale)".into(),
        "F8_E4M3" => "fp8 e4m3 data".into(),
        "F8_E5M2" => "fp8 e5m2 data".into(),
        "U8" if sibling("weight_scale_2") => "nvfp4 packed data (ModelOpt)".into(),
        "U8" if sibling("weight_scale") => "mx/nv packed or fp8 data".into(),
        "F8_E8M0" | "E8M0" => "mxfp8 ue8m0 scale".into(),
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

/// Run `mxrl inspect`.
pub fn run(a: Args) -> Result<()> {
    let files: Vec<PathBuf> = if a.path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&a.path)
            .with_context(|| format!("listing {}", a.path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        v.sort();
        if v.is_empty() {
            bail!(
                "{}: no *.safetensors files in this directory",
                a.path.display()
            );
        }
        v
    } else {
        vec![a.path.clone()]
    };
    let mut total = 0u64;
    let mut totals: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for f in &files {
        let h = read_header(f)?;
        let size = std::fs::metadata(f)
            .with_context(|| format!("stat {}", f.display()))?
            .len();
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
        let mut keys: Vec<&String> = h.metadata.keys().collect();
        keys.sort();
        let other: Vec<String> = keys
            .iter()
            .filter(|k| k.as_str() != META_CONTRACT_HASH && k.as_str() != META_CONTRACT_VERSION)
            .map(|k| format!("{k} ({} chars)", h.metadata[*k].len()))
            .collect();
        if !other.is_empty() {
            println!("  metadata: {}", other.join(", "));
        }
        let mut per: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        for (name, e) in &h.tensors {
            let bytes = (e.data_offsets[1] - e.data_offsets[0]) as u64;
            let d = detect(name, e, &h.tensors);
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
                    e.dtype,
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
