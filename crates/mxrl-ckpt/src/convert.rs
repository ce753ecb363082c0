//! `convert`: a Hugging Face checkpoint → a servable checkpoint in the formats its precision
//! plan decides, with every quantized byte from the contract quantizers of `mxrl-formats`.
//!
//! Output layouts (per linear weight `P.weight` of shape `[N, K]`): `bf16` weights are the
//! source tensor unchanged (block-FP8 sources: dequantized exactly, rounded to BF16); every
//! quantized weight is written by the encoder of its serving layout in [`crate::container`]
//! (SGLang MXFP8, ModelOpt or compressed-tensors NVFP4 as [`Nvfp4Container`] chooses,
//! FP8-block), which lists the tensors of each. Gate and up projections
//! of one MLP share one amax (the plan's `nvfp4_amax_groups`), read from wherever the partner
//! sits, also in another shard.
//!
//! Block-FP8 sources (`quant_method: fp8`, 128×128 `weight_scale_inv`) are decoded by the
//! FP8-block layout and dequantized exactly (`fl(e4m3(q) × scale_inv)`, contract §FP8-block)
//! before quantizing; to MXFP8 they are re-packed losslessly instead when every block scale of
//! the tensor is a power of two ([`mxrl_formats::fp8_block_to_mxfp8`]), and to FP8-block they
//! are copied unchanged.
//!
//! Memory: tensors are converted in chunks of at most `chunk_bytes` source bytes (one tensor
//! at least), rayon-parallel inside a chunk, and streamed to their shard in order; sources
//! are memory-mapped. Peak memory is about 4 × `chunk_bytes` (f32 widening + outputs) or the
//! largest tensor pair, whatever the model size.

use crate::container::{split_name, Layout, Nvfp4Container, Part};
use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::header::index_json;
use crate::reader::{Checkpoint, TensorView, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use crate::record::{ContractRecord, MxrlRecord, RecipeRecord, TensorRecord};
use crate::values::{check_finite, f32_from_bytes, f32_to_bf16_bytes, to_f32};
use crate::writer::{
    check_output_vs_source, copy_other_files, write_json, ShardWriter, StagedDir, TensorSpec,
};
use mxrl_formats::{
    amax_of, contract_hash, fp8_block_scales_are_ue8m0, fp8_block_to_mxfp8, quantize,
    quantize_nvfp4_with_amax, AmaxScope, Format, Nvfp4Blocks, Nvfp4Scheme, Padding,
    QuantizedTensor, Scheme, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
use mxrl_plan::{check_list, client_list, resolve, ListKind, PrecisionPlan, Recipe};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// File name of the mxrl record written into every converted checkpoint.
pub const MXRL_JSON: &str = "mxrl.json";
/// File name of ModelOpt's quantization record.
pub const HF_QUANT_CONFIG: &str = "hf_quant_config.json";

/// Options of [`convert`].
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// NVFP4 on-disk layout.
    pub nvfp4: Nvfp4Container,
    /// Replace an existing output directory.
    pub force: bool,
    /// Convert tensors holding NaN/Inf instead of refusing.
    pub allow_nonfinite: bool,
    /// Source bytes converted per parallel chunk (bounds memory).
    pub chunk_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            nvfp4: Nvfp4Container::ModelOpt,
            force: false,
            allow_nonfinite: false,
            chunk_bytes: 128 << 20,
        }
    }
}

/// Progress of a long operation, in source bytes.
pub trait Progress: Sync {
    /// Work of `total` bytes starts.
    fn start(&self, _total: u64) {}
    /// `bytes` more are done.
    fn advance(&self, _bytes: u64) {}
}

/// A [`Progress`] that shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;
impl Progress for NoProgress {}

/// How one source tensor becomes its outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Copied byte for byte.
    Copy,
    /// Quantized by the contract quantizer (from block-FP8 sources: after exact dequantize).
    Quantize,
    /// Block-FP8 → MXFP8 lossless re-pack (power-of-two scales).
    Repack,
    /// Block-FP8 → BF16 (exact dequantize, rounded to BF16).
    Dequantize,
}

impl Method {
    /// Record name.
    pub fn name(self) -> &'static str {
        match self {
            Method::Copy => "copy",
            Method::Quantize => "quantize",
            Method::Repack => "repack",
            Method::Dequantize => "dequantize",
        }
    }
}

/// One source tensor's conversion.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub name: String,
    pub format: Format,
    pub method: Method,
    /// Block-FP8 source: the `weight_scale_inv` companion.
    pub scale: Option<String>,
    /// NVFP4: the gate/up partner sharing the amax.
    pub partner: Option<String>,
    pub outputs: Vec<TensorSpec>,
    pub in_bytes: u64,
}

/// Everything decided before any data is read.
pub(crate) struct Prepared<'a> {
    pub ck: &'a Checkpoint,
    pub plan: PrecisionPlan,
    pub recipe_label: String,
    pub container: Nvfp4Container,
    pub quant: Option<Format>,
    pub shards: Vec<(String, Vec<Job>)>,
    pub sharded: bool,
    pub config: Value,
    pub hf_quant_config: Option<Value>,
}

fn is_full_precision(d: Dtype) -> bool {
    matches!(d, Dtype::Bf16 | Dtype::F16 | Dtype::F32)
}

/// Whether the source config declares DeepSeek-style block FP8 (and refuses other schemes).
fn source_is_block_fp8(ck: &Checkpoint) -> Result<bool> {
    let cfg = ck.require_config()?;
    let Some(q) = cfg.get("quantization_config") else {
        return Ok(false);
    };
    let file = ck.dir().join(CONFIG_FILE).display().to_string();
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    let block = q.get("weight_block_size");
    if method == "fp8" && block == Some(&json!([128, 128])) {
        return Ok(true);
    }
    Err(CkptError::Config {
        file,
        field: "quantization_config".into(),
        msg: format!(
            "unsupported input quantization (quant_method `{method}`, weight_block_size {}); expected an unquantized BF16/F16/F32 checkpoint or DeepSeek-style block FP8 (quant_method `fp8`, weight_block_size [128, 128]); use `mxrl dequantize` first",
            block.map(|b| b.to_string()).unwrap_or_else(|| "absent".into())
        ),
    })
}

/// Every `X.gate_proj.weight` needs `X.up_proj.weight` and vice versa (they share one NVFP4
/// amax and one fused GEMM).
fn check_gate_up_pairs(ck: &Checkpoint) -> Result<()> {
    for name in ck.names() {
        let partner = if let Some(p) = name.strip_suffix(".gate_proj.weight") {
            format!("{p}.up_proj.weight")
        } else if let Some(p) = name.strip_suffix(".up_proj.weight") {
            format!("{p}.gate_proj.weight")
        } else {
            continue;
        };
        if !ck.contains(&partner) {
            let file = ck.get(name).map(|t| t.file.to_string()).unwrap_or_default();
            return Err(CkptError::tensor(
                name.clone(),
                format!(
                    "(in `{file}`) has no pair: `{partner}` is missing from {}; gate and up projections are fused and share one NVFP4 amax, so both halves must be present",
                    ck.dir().display()
                ),
            ));
        }
    }
    Ok(())
}

fn all_scales_power_of_two(scale: &TensorView<'_>) -> bool {
    fp8_block_scales_are_ue8m0(&f32_from_bytes(scale.data))
}

fn shape2(name: &str, shape: &[usize], what: &str) -> Result<(usize, usize)> {
    match *shape {
        [n, k] => Ok((n, k)),
        _ => Err(CkptError::tensor(
            name,
            format!("{what} needs a 2-D [N, K] weight, found shape {shape:?}"),
        )),
    }
}

/// The output tensors of one source weight in `format`: the layout's ([`Layout::specs`]), or
/// one BF16 tensor.
fn output_specs(
    name: &str,
    format: Format,
    container: Nvfp4Container,
    shape: &[usize],
) -> Result<Vec<TensorSpec>> {
    let (n, k) = shape2(name, shape, format.name())?;
    match Layout::for_format(format, container) {
        Some(layout) => layout.specs(name, [n, k]),
        None => Ok(vec![TensorSpec::new(name, Dtype::Bf16, vec![n, k])]),
    }
}

/// Resolves the plan and lays out every job and output shard; reads no tensor data except
/// block-FP8 scales (to decide re-packing).
pub(crate) fn prepare<'a>(
    ck: &'a Checkpoint,
    recipe: &Recipe,
    recipe_label: &str,
    container: Nvfp4Container,
) -> Result<Prepared<'a>> {
    let src_cfg = ck.require_config()?.clone();
    let fp8_src = source_is_block_fp8(ck)?;
    check_gate_up_pairs(ck)?;
    let inv = ck.model_inventory()?;
    let plan = resolve(&inv, recipe)?;
    let partners: HashMap<String, String> = plan
        .nvfp4_amax_groups()
        .into_iter()
        .flat_map(|g| [(g.gate.clone(), g.up.clone()), (g.up, g.gate)])
        .collect();

    let mut quant_formats: Vec<Format> = plan
        .entries()
        .iter()
        .map(|e| e.format)
        .filter(|f| *f != Format::Bf16)
        .collect();
    quant_formats.sort();
    quant_formats.dedup();
    if quant_formats.len() > 1 {
        return Err(CkptError::Invalid(format!(
            "the plan (recipe {recipe_label}, plan {}) stores weights as {}; a servable checkpoint holds one quantized format (serving engines read one quantization_config)",
            plan.short_hash(),
            quant_formats.iter().map(|f| f.name()).collect::<Vec<_>>().join(" and ")
        )));
    }
    let quant = quant_formats.first().copied();

    let mut shards: Vec<(String, Vec<Job>)> = ck
        .shards()
        .iter()
        .map(|s| (s.file_name().to_string(), Vec::new()))
        .collect();
    for name in ck.names() {
        let t = ck.tensor(name)?;
        let fp8_scale_of = split_name(name)
            .filter(|&(_, s)| fp8_src && Some(s) == Layout::Fp8Block.suffix(Part::Scale));
        if let Some((p, _)) = fp8_scale_of {
            let w = format!("{p}.weight");
            if !ck.contains(&w) {
                return Err(CkptError::tensor(
                    name.clone(),
                    format!("block-FP8 scale without its weight `{w}`"),
                ));
            }
            continue;
        }
        let entry = plan.by_hf(name).ok_or_else(|| {
            CkptError::tensor(name.clone(), "has no decision in the precision plan")
        })?;
        let format = entry.format;
        let mut scale = None;
        let mut in_bytes = t.data.len() as u64;
        if t.dtype == Dtype::F8E4m3 {
            let sname = Layout::Fp8Block.tensor_name(name, Part::Scale)?;
            let s = ck.get(&sname).filter(|_| fp8_src).ok_or_else(|| {
                CkptError::tensor(
                    name.clone(),
                    format!(
                        "F8_E4M3 weight without a block-FP8 `{sname}` (and config.json quantization_config quant_method `fp8`, weight_block_size [128, 128])"
                    ),
                )
            })?;
            // The source's FP8-block layout, checked by its decoder (dtypes and shapes).
            Layout::Fp8Block.validate(name, &fp8_source_parts(t, s))?;
            in_bytes += s.data.len() as u64;
            scale = Some((sname, s));
        } else if format != Format::Bf16 && !is_full_precision(t.dtype) {
            return Err(CkptError::TensorEntry {
                file: t.file.into(),
                tensor: name.clone(),
                msg: format!(
                    "unsupported dtype {} for a weight the plan stores as {format} (expected BF16, F16, F32 or block-FP8 F8_E4M3)",
                    t.dtype
                ),
            });
        }
        let (method, outputs) = match (format, &scale) {
            (Format::Bf16, None) => (
                Method::Copy,
                vec![TensorSpec::new(name.clone(), t.dtype, t.shape.to_vec())],
            ),
            (Format::Bf16, Some(_)) => (
                Method::Dequantize,
                output_specs(name, Format::Bf16, container, t.shape)?,
            ),
            (Format::Fp8Block, Some(_)) => (
                Method::Copy,
                output_specs(name, format, container, t.shape)?,
            ),
            (Format::Mxfp8, Some((_, s))) if all_scales_power_of_two(s) => (
                Method::Repack,
                output_specs(name, format, container, t.shape)?,
            ),
            _ => (
                Method::Quantize,
                output_specs(name, format, container, t.shape)?,
            ),
        };
        let partner = if format == Format::Nvfp4 {
            partners.get(name).cloned()
        } else {
            None
        };
        let si = ck.shard_of(name).expect("listed tensor has a shard");
        shards[si].1.push(Job {
            name: name.clone(),
            format,
            method,
            scale: scale.map(|(n, _)| n),
            partner,
            outputs,
            in_bytes,
        });
    }
    let exclude = match exclusion_list_kind(quant, container) {
        Some(kind) => {
            // Explicit module names, checked under every serving client's own rule
            // (`mxrl_plan::clients`, sources cited there).
            let list = client_list(&plan, &inv, kind).map_err(|e| {
                CkptError::Invalid(format!(
                    "the plan (recipe {recipe_label}, plan {}) cannot be served: {e}",
                    plan.short_hash()
                ))
            })?;
            let diffs = check_list(&plan, &inv, kind, &list);
            if !diffs.is_empty() {
                return Err(CkptError::Invalid(format!(
                    "the `{}` list cannot express the plan under the serving clients' rules; {} decision(s) differ:\n{}",
                    kind.key(),
                    diffs.len(),
                    diffs.iter().take(20).map(|d| format!("  {d}")).collect::<Vec<_>>().join("\n")
                )));
            }
            list
        }
        None => Vec::new(),
    };
    let (config, hf_quant_config) = output_config(&src_cfg, quant, container, &exclude);
    Ok(Prepared {
        ck,
        plan,
        recipe_label: recipe_label.into(),
        container,
        quant,
        shards,
        sharded: ck.index().is_some(),
        config,
        hf_quant_config,
    })
}

/// Which exclusion list a checkpoint of quantized format `quant` carries (`None`: no
/// quantization config).
fn exclusion_list_kind(quant: Option<Format>, container: Nvfp4Container) -> Option<ListKind> {
    match (quant, container) {
        (None | Some(Format::Bf16), _) => None,
        (Some(Format::Mxfp8 | Format::Fp8Block), _) => Some(ListKind::Fp8ModulesToNotConvert),
        (Some(Format::Nvfp4), Nvfp4Container::ModelOpt) => Some(ListKind::ModelOptExclude),
        (Some(Format::Nvfp4), Nvfp4Container::CompressedTensors) => {
            Some(ListKind::CompressedTensorsIgnore)
        }
    }
}

/// `config.json` (and ModelOpt's `hf_quant_config.json`) of the output.
fn output_config(
    src: &Value,
    quant: Option<Format>,
    container: Nvfp4Container,
    exclude: &[String],
) -> (Value, Option<Value>) {
    let mut cfg = src.clone();
    let o = cfg.as_object_mut().expect("config.json is an object");
    o.remove("quantization_config");
    o.insert("torch_dtype".into(), json!("bfloat16"));
    let producer = json!({"name": "mxrl", "version": env!("CARGO_PKG_VERSION")});
    let mut hf_quant = None;
    match (quant, container) {
        (None | Some(Format::Bf16), _) => {}
        (Some(Format::Mxfp8), _) => {
            o.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "mxfp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": [1, 32],
                    "scale_fmt": "ue8m0",
                    "modules_to_not_convert": exclude,
                }),
            );
        }
        (Some(Format::Fp8Block), _) => {
            o.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128],
                    "modules_to_not_convert": exclude,
                    "ignored_layers": exclude,
                }),
            );
        }
        (Some(Format::Nvfp4), Nvfp4Container::ModelOpt) => {
            o.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "modelopt",
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "kv_cache_quant_algo": null,
                    "ignore": exclude,
                    "producer": producer,
                }),
            );
            hf_quant = Some(json!({
                "producer": producer,
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": null,
                    "group_size": 16,
                    "exclude_modules": exclude,
                }
            }));
        }
        (Some(Format::Nvfp4), Nvfp4Container::CompressedTensors) => {
            let args = |dynamic: Value| {
                json!({
                    "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": true, "dynamic": dynamic, "observer": if dynamic == json!(false) { json!("minmax") } else { Value::Null },
                    "actorder": null, "block_structure": null, "observer_kwargs": {},
                })
            };
            o.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "compressed-tensors",
                    "format": "nvfp4-pack-quantized",
                    "quantization_status": "compressed",
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": args(json!(false)),
                            "input_activations": args(json!("local")),
                            "output_activations": null,
                            "format": "nvfp4-pack-quantized",
                        }
                    },
                    "ignore": exclude,
                    "kv_cache_scheme": null,
                    "global_compression_ratio": null,
                    "sparsity_config": {},
                    "transform_config": {},
                    "version": "0.12.0",
                }),
            );
        }
    }
    (cfg, hf_quant)
}

/// The parts of a block-FP8 source weight for the FP8-block decoder.
fn fp8_source_parts<'a>(
    w: TensorView<'a>,
    s: TensorView<'a>,
) -> impl Fn(Part) -> Result<Option<TensorView<'a>>> {
    move |p| {
        Ok(match p {
            Part::Data => Some(w),
            Part::Scale => Some(s),
            Part::Global | Part::Input => None,
        })
    }
}

/// A block-FP8 source weight decoded by the FP8-block layout.
fn fp8_source(ck: &Checkpoint, name: &str, scale: &str) -> Result<QuantizedTensor> {
    let parts = fp8_source_parts(ck.tensor(name)?, ck.tensor(scale)?);
    Layout::Fp8Block.decode_quantized(name, &parts, None)
}

/// Source values of a weight as f32: widened BF16/F16/F32, or block-FP8 decoded and
/// dequantized exactly (`fl(e4m3(q) × scale_inv[i/128][j/128])`, contract).
pub(crate) fn source_values(ck: &Checkpoint, name: &str, scale: Option<&str>) -> Result<Vec<f32>> {
    match scale {
        None => to_f32(&ck.tensor(name)?),
        Some(sname) => fp8_source(ck, name, sname)?
            .dequantize()
            .map_err(|e| fmt_err(name, e)),
    }
}

/// NVFP4 per-tensor, 1-D blocks of 16 (contract §3).
const NVFP4_WEIGHT: Nvfp4Scheme = Nvfp4Scheme {
    amax: AmaxScope::PerTensor,
    blocks: Nvfp4Blocks::Vector,
};

fn fmt_err(name: &str, e: mxrl_formats::FormatError) -> CkptError {
    CkptError::tensor(name, e.to_string())
}

/// The output bytes of one job (in `job.outputs` order) and, for NVFP4, the amax used.
pub(crate) type JobOutput<'a> = (Vec<Cow<'a, [u8]>>, Option<f32>);

/// Converts one job (see [`JobOutput`]).
pub(crate) fn run_job<'a>(
    ck: &'a Checkpoint,
    job: &Job,
    container: Nvfp4Container,
    allow_nonfinite: bool,
) -> Result<JobOutput<'a>> {
    let t = ck.tensor(&job.name)?;
    check_finite(&t, allow_nonfinite)?;
    let scale = match &job.scale {
        Some(s) => {
            let v = ck.tensor(s)?;
            check_finite(&v, allow_nonfinite)?;
            Some(v)
        }
        None => None,
    };
    let shape = t.shape;
    match job.method {
        Method::Copy => {
            let mut v = vec![Cow::Borrowed(t.data)];
            if let Some(s) = scale {
                v.push(Cow::Borrowed(s.data));
            }
            Ok((v, None))
        }
        Method::Dequantize => {
            let x = source_values(ck, &job.name, job.scale.as_deref())?;
            Ok((vec![Cow::Owned(f32_to_bf16_bytes(&x))], None))
        }
        Method::Repack => {
            let src = fp8_source(
                ck,
                &job.name,
                job.scale.as_deref().expect("repack has a scale"),
            )?;
            let q = fp8_block_to_mxfp8(&src).map_err(|e| fmt_err(&job.name, e))?;
            Ok((encode(job, Layout::Mxfp8, &q)?, None))
        }
        Method::Quantize => {
            let x = source_values(ck, &job.name, job.scale.as_deref())?;
            let (n, k) = shape2(&job.name, shape, job.format.name())?;
            let layout = Layout::for_format(job.format, container)
                .expect("bf16 jobs are copies or dequantizations");
            let (q, amax) = match job.format {
                Format::Mxfp8 => (
                    quantize(&x, &[n, k], Scheme::MXFP8_ROW, Padding::Reject),
                    None,
                ),
                Format::Nvfp4 => {
                    let mut amax = amax_of(x.iter().copied());
                    if let Some(p) = &job.partner {
                        let sname = Layout::Fp8Block.tensor_name(p, Part::Scale)?;
                        let pscale = (ck.contains(&sname) && ck.tensor(p)?.dtype == Dtype::F8E4m3)
                            .then_some(sname);
                        let px = source_values(ck, p, pscale.as_deref())?;
                        let pa = amax_of(px.iter().copied());
                        if pa > amax {
                            amax = pa;
                        }
                    }
                    let q = quantize_nvfp4_with_amax(
                        &x,
                        &[n, k],
                        NVFP4_WEIGHT,
                        Padding::Reject,
                        &[amax],
                    );
                    (q, Some(amax))
                }
                // Whole 128×128 tiles; the layout stores the unpadded elements.
                Format::Fp8Block => (
                    quantize(&x, &[n, k], Scheme::FP8_BLOCK_WEIGHT, Padding::Zero),
                    None,
                ),
                Format::Bf16 => unreachable!("bf16 has no layout"),
            };
            let q = q.map_err(|e| fmt_err(&job.name, e))?;
            Ok((encode(job, layout, &q)?, amax))
        }
    }
}

/// `q` encoded by `layout` as the job's output tensors (in `job.outputs` order).
fn encode<'a>(job: &Job, layout: Layout, q: &QuantizedTensor) -> Result<Vec<Cow<'a, [u8]>>> {
    let enc = layout.encode(&job.name, q)?;
    if enc.iter().map(|(s, _)| s).ne(job.outputs.iter()) {
        return Err(CkptError::tensor(
            job.name.clone(),
            format!(
                "the {} encoder wrote {:?}, the plan laid out {:?}",
                layout.name(),
                enc.iter().map(|(s, _)| s).collect::<Vec<_>>(),
                job.outputs
            ),
        ));
    }
    Ok(enc.into_iter().map(|(_, b)| Cow::Owned(b)).collect())
}

/// Where converted tensors go: a writer, or a comparison against an existing checkpoint.
pub(crate) trait Sink {
    fn begin_shard(&mut self, file: &str, specs: &[TensorSpec]) -> Result<()>;
    fn tensor(&mut self, job: &Job, spec: &TensorSpec, data: &[u8]) -> Result<()>;
    fn end_shard(&mut self) -> Result<()>;
}

/// Safetensors `__metadata__` of every output shard.
pub(crate) fn shard_metadata() -> BTreeMap<String, String> {
    [
        ("format".to_string(), "pt".to_string()),
        (
            META_CONTRACT_VERSION.to_string(),
            CONTRACT_VERSION.to_string(),
        ),
        (META_CONTRACT_HASH.to_string(), contract_hash().to_string()),
    ]
    .into()
}

/// Runs every job through `sink`, shard by shard, chunk by chunk. Returns the NVFP4 amax of
/// every NVFP4 tensor.
pub(crate) fn run(
    p: &Prepared<'_>,
    sink: &mut dyn Sink,
    allow_nonfinite: bool,
    chunk_bytes: usize,
    progress: &dyn Progress,
) -> Result<BTreeMap<String, f32>> {
    let mut amaxes = BTreeMap::new();
    for (file, jobs) in &p.shards {
        let specs: Vec<TensorSpec> = jobs.iter().flat_map(|j| j.outputs.clone()).collect();
        sink.begin_shard(file, &specs)?;
        let mut i = 0;
        while i < jobs.len() {
            let mut j = i;
            let mut b = 0u64;
            while j < jobs.len() && (j == i || b + jobs[j].in_bytes <= chunk_bytes as u64) {
                b += jobs[j].in_bytes;
                j += 1;
            }
            let results: Vec<Result<_>> = jobs[i..j]
                .par_iter()
                .map(|job| {
                    let r = run_job(p.ck, job, p.container, allow_nonfinite);
                    progress.advance(job.in_bytes);
                    r
                })
                .collect();
            for (job, r) in jobs[i..j].iter().zip(results) {
                let (outs, amax) = r?;
                for (spec, d) in job.outputs.iter().zip(&outs) {
                    sink.tensor(job, spec, d)?;
                }
                if let Some(a) = amax {
                    amaxes.insert(job.name.clone(), a);
                }
            }
            i = j;
        }
        sink.end_shard()?;
    }
    Ok(amaxes)
}

/// `mxrl.json`: contract, recipe, plan hash and the per-tensor record.
pub(crate) fn mxrl_json(p: &Prepared<'_>, amaxes: &BTreeMap<String, f32>) -> Value {
    let mut tensors = BTreeMap::new();
    for (_, jobs) in &p.shards {
        for j in jobs {
            let amax = amaxes.get(&j.name).copied();
            tensors.insert(
                j.name.clone(),
                TensorRecord {
                    format: j.format.name().to_string(),
                    method: j.method.name().to_string(),
                    stored: j.outputs.iter().map(|s| s.name.clone()).collect(),
                    amax,
                    amax_bits: amax.map(|a| format!("0x{:08X}", a.to_bits())),
                    amax_shared_with: j.partner.clone(),
                },
            );
        }
    }
    MxrlRecord {
        mxrl_version: env!("CARGO_PKG_VERSION").to_string(),
        contract: ContractRecord {
            version: CONTRACT_VERSION,
            hash: contract_hash().to_string(),
        },
        recipe: RecipeRecord {
            source: p.recipe_label.to_string(),
            toml: p.plan.recipe().to_toml(),
        },
        plan_hash: p.plan.hash().to_string(),
        nvfp4_container: p.container.name().to_string(),
        quantized_format: p.quant.map(|f| f.name().to_string()),
        tensors,
    }
    .to_value()
}

/// Expected index of the output (`None` for an unsharded checkpoint).
pub(crate) fn output_index(p: &Prepared<'_>) -> Option<Value> {
    if !p.sharded {
        return None;
    }
    let mut wm = BTreeMap::new();
    let mut total = 0u64;
    for (file, jobs) in &p.shards {
        for s in jobs.iter().flat_map(|j| &j.outputs) {
            wm.insert(s.name.clone(), file.clone());
            total += s.nbytes() as u64;
        }
    }
    Some(index_json(&wm, total))
}

/// Files never copied from a source checkpoint (rewritten or not carried over).
pub(crate) fn is_weight_or_record(rel: &str) -> bool {
    rel.ends_with(".safetensors")
        || rel == INDEX_FILE
        || rel == CONFIG_FILE
        || rel == HF_QUANT_CONFIG
        || rel == MXRL_JSON
}

struct WriteSink<'d> {
    dir: &'d Path,
    cur: Option<ShardWriter>,
    bytes: u64,
}

impl Sink for WriteSink<'_> {
    fn begin_shard(&mut self, file: &str, specs: &[TensorSpec]) -> Result<()> {
        self.cur = Some(ShardWriter::create(
            self.dir.join(file),
            specs.to_vec(),
            &shard_metadata(),
        )?);
        Ok(())
    }
    fn tensor(&mut self, _job: &Job, spec: &TensorSpec, data: &[u8]) -> Result<()> {
        self.cur
            .as_mut()
            .expect("shard begun")
            .write_tensor(&spec.name, data)
    }
    fn end_shard(&mut self) -> Result<()> {
        self.bytes += self.cur.take().expect("shard begun").finish()?;
        Ok(())
    }
}

/// What [`convert`] did.
#[derive(Debug, Clone)]
pub struct ConvertSummary {
    /// The output directory.
    pub out: PathBuf,
    /// Full plan hash.
    pub plan_hash: String,
    /// Tensors per (format, method).
    pub tensors: BTreeMap<(String, String), usize>,
    /// Source tensor bytes.
    pub bytes_in: u64,
    /// Output safetensors bytes (headers included).
    pub bytes_out: u64,
    /// Output shard files.
    pub shards: usize,
    /// Other files copied (tokenizer, ...).
    pub copied: Vec<String>,
    /// Wall time in seconds.
    pub seconds: f64,
}

impl std::fmt::Display for ConvertSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "wrote {} ({} shard(s), plan {})",
            self.out.display(),
            self.shards,
            &self.plan_hash[..self.plan_hash.len().min(16)]
        )?;
        for ((fmt, method), n) in &self.tensors {
            writeln!(f, "  {fmt:<9} {method:<10} {n:>6} tensors")?;
        }
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "  bytes: {:.3} GB -> {:.3} GB ({:.2}x smaller)",
            gb(self.bytes_in),
            gb(self.bytes_out),
            self.bytes_in as f64 / self.bytes_out.max(1) as f64
        )?;
        if !self.copied.is_empty() {
            writeln!(f, "  copied: {}", self.copied.join(", "))?;
        }
        write!(
            f,
            "  time: {:.2} s ({:.3} GB/s of source)",
            self.seconds,
            gb(self.bytes_in) / self.seconds.max(1e-9)
        )
    }
}

/// Converts the checkpoint in `src` by `recipe` into `dst` (see the module docs).
/// `recipe_label` (a preset name or file path) is recorded in `mxrl.json`.
pub fn convert(
    src: &Path,
    recipe: &Recipe,
    recipe_label: &str,
    dst: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertSummary> {
    let t0 = Instant::now();
    check_output_vs_source(src, dst)?;
    if dst.exists() && !opts.force {
        return Err(CkptError::OutputExists { path: dst.into() });
    }
    let ck = Checkpoint::open(src)?;
    let p = prepare(&ck, recipe, recipe_label, opts.nvfp4)?;
    let staged = StagedDir::create_for(src, dst, opts.force)?;
    let bytes_in: u64 = p
        .shards
        .iter()
        .flat_map(|(_, j)| j)
        .map(|j| j.in_bytes)
        .sum();
    progress.start(bytes_in);
    let mut sink = WriteSink {
        dir: staged.path(),
        cur: None,
        bytes: 0,
    };
    let amaxes = run(
        &p,
        &mut sink,
        opts.allow_nonfinite,
        opts.chunk_bytes,
        progress,
    )?;
    let out = staged.path();
    if let Some(idx) = output_index(&p) {
        write_json(&out.join(INDEX_FILE), &idx)?;
    } else if p.shards.len() != 1 || p.shards[0].0 != SINGLE_FILE {
        return Err(CkptError::Invalid(
            "unsharded checkpoint with several files".into(),
        ));
    }
    write_json(&out.join(CONFIG_FILE), &p.config)?;
    if let Some(h) = &p.hf_quant_config {
        write_json(&out.join(HF_QUANT_CONFIG), h)?;
    }
    write_json(&out.join(MXRL_JSON), &mxrl_json(&p, &amaxes))?;
    let copied = copy_other_files(src, out, &is_weight_or_record)?;
    let mut tensors = BTreeMap::new();
    for j in p.shards.iter().flat_map(|(_, j)| j) {
        *tensors
            .entry((j.format.name().to_string(), j.method.name().to_string()))
            .or_insert(0) += 1;
    }
    let bytes_out = sink.bytes;
    let shards = p.shards.len();
    let plan_hash = p.plan.hash().to_string();
    drop(p);
    let out = staged.commit()?;
    Ok(ConvertSummary {
        out,
        plan_hash,
        tensors,
        bytes_in,
        bytes_out,
        shards,
        copied,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
