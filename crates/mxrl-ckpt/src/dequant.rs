//! `dequantize`: any checkpoint [`crate::convert()`] writes (and DeepSeek-style block FP8) back to
//! a BF16 Hugging Face checkpoint.
//!
//! Stored forms are recognized per weight `P` from the tensors present (config.json is not
//! trusted for this) by the serving layouts' detector ([`crate::container::Group::detect`]),
//! decoded by the layout, and dequantized with the formula of the layout's consumer
//! ([`crate::container::Stored::dequantize`]; the formulas are in `mxrl-formats`), rounded
//! once to BF16 (round to nearest even):
//!
//! | stored form | value |
//! |---|---|
//! | MXFP8 | `fl(ue8m0(s) × e4m3(q))` (contract) |
//! | FP8 block | `fl(e4m3(q) × s)` (contract) |
//! | NVFP4 ModelOpt | `fl(fl(e2m1(c) × e4m3(sf)) × weight_scale_2)` ([`mxrl_formats::Nvfp4SecondLevel::DecodeScale`]) |
//! | NVFP4 compressed-tensors | `fl(e2m1(c) × fl(e4m3(sf) / weight_global_scale))` ([`mxrl_formats::Nvfp4SecondLevel::EncodeScale`]) |
//!
//! `input_scale` / `input_global_scale` are dropped; every other tensor is copied unchanged.
//! The output has one shard per input shard, a rewritten index, `config.json` without
//! `quantization_config`, and the source's other files except `hf_quant_config.json` and
//! `mxrl.json`.

use crate::container::{groups, split_name, Detected, Group, Layout, Part};
use crate::convert::{is_weight_or_record, Progress};
use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::header::index_json;
use crate::reader::{Checkpoint, TensorView, CONFIG_FILE, INDEX_FILE};
use crate::values::{check_finite, f32_to_bf16_bytes};
use crate::writer::{
    check_output_vs_source, copy_other_files, write_json, ShardWriter, StagedDir, TensorSpec,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Dequantized f32 values of a quantized group, its data, block and second-level scales
/// checked for NaN/Inf first (the static input scale is dropped, not read).
fn dequant_values(g: &Group<'_>, layout: Layout) -> Result<Vec<f32>> {
    for part in [Part::Data, Part::Scale, Part::Global] {
        if let Some(t) = layout.suffix(part).and_then(|s| g.parts.get(s)) {
            check_finite(t, false)?;
        }
    }
    let stored = g
        .decode()?
        .ok_or_else(|| CkptError::tensor(g.weight_name(), "is not quantized"))?;
    stored.dequantize(&g.weight_name())
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
type ShardItems<'a> = (String, Vec<(Item<'a>, Vec<TensorSpec>)>);
/// An output tensor's name and bytes.
type Named<'a> = (String, Cow<'a, [u8]>);

enum Item<'a> {
    /// A quantized weight group, dequantized into one BF16 tensor.
    Group(Group<'a>, Layout),
    /// A tensor copied unchanged.
    Copy(TensorView<'a>),
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
    mxrl_plan::HfConfig::from_path(&src.join(CONFIG_FILE))?;
    let ck = Checkpoint::open(src)?;
    let cfg = ck.require_config()?.clone();
    // Group by weight prefix; every group must be unquantized or a serving layout.
    let views: Vec<TensorView<'_>> = ck
        .names()
        .iter()
        .map(|n| ck.tensor(n))
        .collect::<Result<_>>()?;
    let (grouped, _) = groups(views.iter().copied());
    let mut by_prefix: HashMap<String, Group<'_>> =
        grouped.into_iter().map(|g| (g.prefix.clone(), g)).collect();
    let mut seen = HashSet::new();
    let mut shards: Vec<ShardItems<'_>> = ck
        .shards()
        .iter()
        .map(|s| (s.file_name().to_string(), Vec::new()))
        .collect();
    let mut forms: BTreeMap<&'static str, usize> = BTreeMap::new();
    for t in &views {
        let copy = |t: &TensorView<'_>| TensorSpec::new(t.name, t.dtype, t.shape.to_vec());
        let Some((prefix, _)) = split_name(t.name) else {
            let si = ck.shard_of(t.name).expect("listed");
            shards[si].1.push((Item::Copy(*t), vec![copy(t)]));
            continue;
        };
        if !seen.insert(prefix) {
            continue;
        }
        let g = by_prefix
            .remove(prefix)
            .expect("every grouped name has a group");
        match g.detect()? {
            Detected::Unquantized => {
                let w = *g.main();
                let si = ck.shard_of(w.name).expect("listed");
                shards[si].1.push((Item::Copy(w), vec![copy(&w)]));
            }
            Detected::Quantized(layout) => {
                *forms.entry(layout.name()).or_insert(0) += 1;
                let weight = g.weight_name();
                let [n, k] = layout.validate(&weight, &|p| {
                    Ok(layout.suffix(p).and_then(|s| g.parts.get(s)).copied())
                })?;
                // The output goes to the shard of the main data tensor.
                let data = layout.tensor_name(&weight, Part::Data)?;
                let si = ck.shard_of(&data).expect("listed");
                let spec = TensorSpec::new(weight, Dtype::Bf16, vec![n, k]);
                shards[si].1.push((Item::Group(g, layout), vec![spec]));
            }
        }
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
            let outs: Vec<Result<Named<'_>>> = chunk
                .par_iter()
                .map(|(item, specs)| match item {
                    Item::Copy(t) => {
                        progress.advance(t.data.len() as u64);
                        Ok((t.name.to_string(), Cow::Borrowed(t.data)))
                    }
                    Item::Group(g, layout) => {
                        let v = dequant_values(g, *layout)?;
                        progress.advance(g.parts.values().map(|t| t.data.len() as u64).sum());
                        Ok((specs[0].name.clone(), Cow::Owned(f32_to_bf16_bytes(&v))))
                    }
                })
                .collect();
            for o in outs {
                let (n, d) = o?;
                w.write_tensor(&n, &d)?;
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
