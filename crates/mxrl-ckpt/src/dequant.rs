//! `dequantize`: any checkpoint [`crate::convert`] writes (and DeepSeek-style block FP8) back to
//! a BF16 Hugging Face checkpoint.
//!
//! Stored forms are recognized per weight `P` from the tensors present (config.json is not
//! trusted for this), and dequantized with the formula of the format's consumer, rounded once
//! to BF16 (round to nearest even):
//!
//! | stored form | value |
//! |---|---|
//! | MXFP8: `weight` F8_E4M3 + `weight_scale_inv` U8 | `fl(ue8m0(s) × e4m3(q))` (contract; `mxrl_formats::QuantizedTensor::dequantize`) |
//! | FP8 block: `weight` F8_E4M3 + `weight_scale_inv` F32 | `fl(e4m3(q) × s)` (contract; `mxrl_formats::QuantizedTensor::dequantize`) |
//! | NVFP4 ModelOpt: `weight` U8 + `weight_scale` F8 + `weight_scale_2` F32 | `fl(fl(e2m1(c) × e4m3(sf)) × scale_2)` (the product `e2m1 × e4m3` is exact) |
//! | NVFP4 compressed-tensors: `weight_packed` + `weight_scale` + `weight_global_scale` | `fl(e2m1(c) × fl(e4m3(sf) / global))` (as its decompressor computes) |
//!
//! `input_scale` / `input_global_scale` are dropped; every other tensor is copied unchanged.
//! The output has one shard per input shard, a rewritten index, `config.json` without
//! `quantization_config`, and the source's other files except `hf_quant_config.json` and
//! `mxrl.json`.

use crate::convert::{is_weight_or_record, Progress};
use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::header::index_json;
use crate::load::{decode_fp8_block, decode_mxfp8};
use crate::reader::{Checkpoint, TensorView, CONFIG_FILE, INDEX_FILE};
use crate::values::{check_finite, f32_to_bf16_bytes};
use crate::writer::{
    check_output_vs_source, copy_other_files, write_json, ShardWriter, StagedDir, TensorSpec,
};
use mxrl_formats::{e2m1_decode, e4m3_decode};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A stored form of one weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredForm {
    /// Unquantized (copied).
    Plain,
    /// MXFP8 (SGLang).
    Mxfp8,
    /// FP8 128×128 blocks.
    Fp8Block,
    /// NVFP4 ModelOpt.
    Nvfp4ModelOpt,
    /// NVFP4 compressed-tensors.
    Nvfp4CompressedTensors,
}

impl StoredForm {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            StoredForm::Plain => "plain",
            StoredForm::Mxfp8 => "mxfp8",
            StoredForm::Fp8Block => "fp8_block",
            StoredForm::Nvfp4ModelOpt => "nvfp4 (modelopt)",
            StoredForm::Nvfp4CompressedTensors => "nvfp4 (compressed-tensors)",
        }
    }
}

const COMPANIONS: [&str; 7] = [
    "weight_scale_inv",
    "weight_scale_2",
    "weight_scale",
    "weight_global_scale",
    "weight_packed",
    "input_scale",
    "input_global_scale",
];

fn split_companion(name: &str) -> Option<(&str, &str)> {
    let (p, last) = name.rsplit_once('.')?;
    COMPANIONS.contains(&last).then_some((p, last))
}

/// One output weight: its stored parts and form.
#[derive(Debug, Clone)]
struct Group {
    form: StoredForm,
    /// Main data tensor name.
    data: String,
    /// Block scale tensor.
    scale: Option<String>,
    /// Second-level scale (NVFP4).
    scale2: Option<String>,
    /// Output `[N, K]`.
    n: usize,
    k: usize,
    in_bytes: u64,
}

fn bad(name: &str, msg: String) -> CkptError {
    CkptError::tensor(name, msg)
}

fn expect(t: &TensorView<'_>, dtype: Dtype, shape: &[usize], what: &str) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(CkptError::TensorEntry {
            file: t.file.into(),
            tensor: t.name.into(),
            msg: format!(
                "{what} must be {dtype} {shape:?}, found {} {:?}",
                t.dtype, t.shape
            ),
        });
    }
    Ok(())
}

fn classify(ck: &Checkpoint, prefix: &str) -> Result<Group> {
    let get = |s: &str| ck.get(&format!("{prefix}.{s}"));
    let mk = |form, data: String, scale, scale2, n, k| Group {
        form,
        data,
        scale,
        scale2,
        n,
        k,
        in_bytes: 0,
    };
    let name = |s: &str| format!("{prefix}.{s}");
    let dims = |t: &TensorView<'_>| -> Result<(usize, usize)> {
        match *t.shape {
            [n, k] => Ok((n, k)),
            _ => Err(bad(
                t.name,
                format!("expected a 2-D tensor, found {:?}", t.shape),
            )),
        }
    };
    let mut g = if let Some(p) = get("weight_packed") {
        let (n, kh) = dims(&p)?;
        let k = kh * 2;
        expect(&p, Dtype::U8, &[n, kh], "packed NVFP4 data")?;
        let s = get("weight_scale")
            .ok_or_else(|| bad(p.name, format!("`{}` is missing", name("weight_scale"))))?;
        expect(&s, Dtype::F8E4m3, &[n, k / 16], "NVFP4 block scale")?;
        let g2 = get("weight_global_scale").ok_or_else(|| {
            bad(
                p.name,
                format!("`{}` is missing", name("weight_global_scale")),
            )
        })?;
        if g2.dtype != Dtype::F32 || g2.numel() != 1 {
            return Err(bad(
                g2.name,
                format!("must be one F32, found {} {:?}", g2.dtype, g2.shape),
            ));
        }
        mk(
            StoredForm::Nvfp4CompressedTensors,
            name("weight_packed"),
            Some(name("weight_scale")),
            Some(name("weight_global_scale")),
            n,
            k,
        )
    } else if let Some(w) = get("weight") {
        let sinv = get("weight_scale_inv");
        let s = get("weight_scale");
        match (w.dtype, sinv, s) {
            (Dtype::F8E4m3, Some(si), None) => {
                let (n, k) = dims(&w)?;
                if si.dtype == Dtype::U8 {
                    if k % 32 != 0 {
                        return Err(bad(w.name, format!("MXFP8 needs K % 32 == 0, shape {:?}", w.shape)));
                    }
                    expect(&si, Dtype::U8, &[n, k / 32], "MXFP8 UE8M0 scale")?;
                    mk(StoredForm::Mxfp8, name("weight"), Some(name("weight_scale_inv")), None, n, k)
                } else {
                    expect(&si, Dtype::F32, &[n.div_ceil(128), k.div_ceil(128)], "FP8 block scale")?;
                    mk(StoredForm::Fp8Block, name("weight"), Some(name("weight_scale_inv")), None, n, k)
                }
            }
            (Dtype::U8, None, Some(s)) => {
                let (n, kh) = dims(&w)?;
                let k = kh * 2;
                expect(&s, Dtype::F8E4m3, &[n, k / 16], "NVFP4 block scale")?;
                let s2 = get("weight_scale_2").ok_or_else(|| bad(w.name, format!("`{}` is missing", name("weight_scale_2"))))?;
                if s2.dtype != Dtype::F32 || s2.numel() != 1 {
                    return Err(bad(s2.name, format!("must be one F32, found {} {:?}", s2.dtype, s2.shape)));
                }
                mk(StoredForm::Nvfp4ModelOpt, name("weight"), Some(name("weight_scale")), Some(name("weight_scale_2")), n, k)
            }
            (_, None, None) => {
                let (n, k) = match *w.shape {
                    [n, k] => (n, k),
                    _ => (0, 0),
                };
                mk(StoredForm::Plain, name("weight"), None, None, n, k)
            }
            (d, si, s) => {
                return Err(bad(
                    w.name,
                    format!(
                        "unrecognized quantized layout: weight {d}, weight_scale_inv {}, weight_scale {}",
                        si.map(|t| t.dtype.name()).unwrap_or("absent"),
                        s.map(|t| t.dtype.name()).unwrap_or("absent")
                    ),
                ))
            }
        }
    } else {
        return Err(bad(
            &name("weight"),
            "scale tensors are present but the weight is missing".into(),
        ));
    };
    g.in_bytes = [Some(&g.data), g.scale.as_ref(), g.scale2.as_ref()]
        .into_iter()
        .flatten()
        .map(|n| ck.get(n).map(|t| t.data.len() as u64).unwrap_or(0))
        .sum();
    Ok(g)
}

fn f32_at(d: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(d[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

/// Dequantized f32 values of a quantized group (formulas in the module docs).
fn dequant_values(ck: &Checkpoint, g: &Group) -> Result<Vec<f32>> {
    let d = ck.tensor(&g.data)?.data;
    let s = ck
        .tensor(g.scale.as_ref().expect("quantized group has a scale"))?
        .data;
    let (n, k) = (g.n, g.k);
    let mut out = Vec::with_capacity(n * k);
    match g.form {
        // The contract's formulas, in mxrl-formats (`QuantizedTensor::dequantize`), on the
        // layouts decoded by the loader's decoders.
        StoredForm::Mxfp8 | StoredForm::Fp8Block => {
            let w = ck.tensor(&g.data)?;
            let st = ck.tensor(g.scale.as_ref().expect("quantized group has a scale"))?;
            let q = if g.form == StoredForm::Mxfp8 {
                decode_mxfp8(&g.data, &w, &st)?
            } else {
                decode_fp8_block(&g.data, &w, &st)?
            };
            out = q.dequantize().map_err(|e| bad(&g.data, e.to_string()))?;
        }
        StoredForm::Nvfp4ModelOpt | StoredForm::Nvfp4CompressedTensors => {
            let s2 = f32_at(
                ck.tensor(g.scale2.as_ref().expect("nvfp4 second scale"))?
                    .data,
                0,
            );
            let mo = g.form == StoredForm::Nvfp4ModelOpt;
            for i in 0..n {
                for jb in 0..k / 16 {
                    let sf = e4m3_decode(s[i * (k / 16) + jb]);
                    let ct_mult = sf / s2;
                    for j in jb * 16..jb * 16 + 16 {
                        let byte = d[i * (k / 2) + j / 2];
                        let v = e2m1_decode((byte >> (4 * (j % 2))) & 0xF);
                        out.push(if mo { (v * sf) * s2 } else { v * ct_mult });
                    }
                }
            }
        }
        StoredForm::Plain => unreachable!("plain groups are copied"),
    }
    Ok(out)
}

/// What [`dequantize`] did.
#[derive(Debug, Clone)]
pub struct DequantSummary {
    /// Output directory.
    pub out: PathBuf,
    /// Weights dequantized per stored form.
    pub forms: BTreeMap<&'static str, usize>,
    /// Source bytes.
    pub bytes_in: u64,
    /// Output safetensors bytes.
    pub bytes_out: u64,
    /// Wall time in seconds.
    pub seconds: f64,
}

impl std::fmt::Display for DequantSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "wrote {}", self.out.display())?;
        for (form, n) in &self.forms {
            writeln!(f, "  {form:<28} {n:>6} tensors")?;
        }
        write!(
            f,
            "  bytes: {:.3} GB -> {:.3} GB in {:.2} s",
            self.bytes_in as f64 / 1e9,
            self.bytes_out as f64 / 1e9,
            self.seconds
        )
    }
}

/// An output shard: its file name and items with their output specs.
type ShardItems = (String, Vec<(Item, Vec<TensorSpec>)>);
/// An output tensor's name and bytes.
type Named<'a> = (String, Cow<'a, [u8]>);

enum Item {
    Group(Group),
    /// Dropped static input scales.
    Skip,
    Copy(String),
}

/// Dequantizes the checkpoint in `src` to BF16 into `dst` (see the module docs).
pub fn dequantize(
    src: &Path,
    dst: &Path,
    force: bool,
    progress: &dyn Progress,
) -> Result<DequantSummary> {
    let t0 = Instant::now();
    check_output_vs_source(src, dst)?;
    if dst.exists() && !force {
        return Err(CkptError::OutputExists { path: dst.into() });
    }
    // The config is validated (the shared rules and bounds) before any weight file is read.
    mxrl_plan::HfConfig::from_path(&src.join(crate::reader::CONFIG_FILE))?;
    let ck = Checkpoint::open(src)?;
    let cfg = ck.require_config()?.clone();
    // Group by weight prefix; every companion must belong to a recognized group.
    let mut seen = HashSet::new();
    let mut shards: Vec<ShardItems> = ck
        .shards()
        .iter()
        .map(|s| (s.file_name().to_string(), Vec::new()))
        .collect();
    let mut forms: BTreeMap<&'static str, usize> = BTreeMap::new();
    for name in ck.names() {
        let t = ck.tensor(name)?;
        let prefix = match split_companion(name) {
            Some((_, "input_scale" | "input_global_scale")) => {
                let si = ck.shard_of(name).expect("listed");
                shards[si].1.push((Item::Skip, vec![]));
                continue;
            }
            Some((p, _)) => p.to_string(),
            None => match name.strip_suffix(".weight") {
                Some(p)
                    if ck.contains(&format!("{p}.weight_scale_inv"))
                        || ck.contains(&format!("{p}.weight_scale")) =>
                {
                    p.to_string()
                }
                _ => {
                    let si = ck.shard_of(name).expect("listed");
                    let spec = TensorSpec::new(name.clone(), t.dtype, t.shape.to_vec());
                    shards[si].1.push((Item::Copy(name.clone()), vec![spec]));
                    continue;
                }
            },
        };
        if !seen.insert(prefix.clone()) {
            continue;
        }
        let g = classify(&ck, &prefix)?;
        *forms.entry(g.form.name()).or_insert(0) += 1;
        // The output goes to the shard of the main data tensor.
        let si = ck.shard_of(&g.data).expect("listed");
        let spec = TensorSpec::new(format!("{prefix}.weight"), Dtype::Bf16, vec![g.n, g.k]);
        shards[si].1.push((Item::Group(g), vec![spec]));
    }
    let staged = StagedDir::create_for(src, dst, force)?;
    let total = ck.total_data_bytes();
    progress.start(total);
    let mut wm = BTreeMap::new();
    let mut total_size = 0u64;
    let mut bytes_out = 0u64;
    for (file, items) in &shards {
        let specs: Vec<TensorSpec> = items.iter().flat_map(|(_, s)| s.clone()).collect();
        for s in &specs {
            wm.insert(s.name.clone(), file.clone());
            total_size += s.nbytes() as u64;
        }
        let mut w = ShardWriter::create(
            staged.path().join(file),
            specs,
            &[("format".to_string(), "pt".to_string())].into(),
        )?;
        for chunk in items.chunks(64) {
            let outs: Vec<Result<Option<Named<'_>>>> = chunk
                .par_iter()
                .map(|(item, specs)| {
                    let r = match item {
                        Item::Skip => Ok(None),
                        Item::Copy(n) => {
                            let t = ck.tensor(n)?;
                            progress.advance(t.data.len() as u64);
                            Ok(Some((n.clone(), Cow::Borrowed(t.data))))
                        }
                        Item::Group(g) => {
                            for part in [Some(&g.data), g.scale.as_ref(), g.scale2.as_ref()]
                                .into_iter()
                                .flatten()
                            {
                                check_finite(&ck.tensor(part)?, false)?;
                            }
                            let v = dequant_values(&ck, g)?;
                            progress.advance(g.in_bytes);
                            Ok(Some((
                                specs[0].name.clone(),
                                Cow::Owned(f32_to_bf16_bytes(&v)),
                            )))
                        }
                    };
                    r
                })
                .collect();
            for o in outs {
                if let Some((n, d)) = o? {
                    w.write_tensor(&n, &d)?;
                }
            }
        }
        bytes_out += w.finish()?;
    }
    if ck.index().is_some() {
        write_json(
            &staged.path().join(INDEX_FILE),
            &index_json(&wm, total_size),
        )?;
    }
    let mut cfg = cfg;
    let o = cfg.as_object_mut().expect("config is an object");
    o.remove("quantization_config");
    o.insert("torch_dtype".into(), serde_json::json!("bfloat16"));
    write_json(&staged.path().join(CONFIG_FILE), &cfg)?;
    copy_other_files(src, staged.path(), &is_weight_or_record)?;
    let out = staged.commit()?;
    Ok(DequantSummary {
        out,
        forms,
        bytes_in: total,
        bytes_out,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
