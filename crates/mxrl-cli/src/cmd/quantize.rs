//! `mxrl quantize`: quantize tensors of a safetensors file, or reproduce / check a vector file
//! in the quant-contract §6 layout.

use crate::st::{self, FloatData, OwnedTensor};
use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use mxrl_formats::{
    contract_hash, AmaxScope, FormatError, Fp8BlockScheme, Fp8Blocks, MxBlocks, Mxfp8Scheme,
    Nvfp4Blocks, Nvfp4Scheme, Padding, QuantizedTensor, ScaleLayout, ScaleRule, Scales, Scheme,
    TensorRef, Usage, CONTRACT_VERSION, META_CONTRACT_HASH, META_CONTRACT_VERSION,
};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Arguments of `mxrl quantize`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  mxrl quantize --vectors quant-public.safetensors --check
  mxrl quantize --vectors quant-public.safetensors mine.safetensors
  mxrl quantize --format nvfp4 --stack gate,up weights.safetensors out.safetensors
  mxrl quantize --format mxfp8 --usage both experts.safetensors out.safetensors

Quantized tensor NAME is written as NAME/<scheme>.data, NAME/<scheme>.scale and (NVFP4)
NAME/<scheme>.amax, e.g. w/mxfp8.row.data; other tensors are copied unchanged.")]
pub struct Args {
    /// Treat IN as a vector file (quant-contract §6): quantize every case `c/x` and write each
    /// output applicable to its shape under the same names (with `--check`: compare instead).
    #[arg(long)]
    vectors: bool,
    /// With --vectors: compare against the outputs already in IN, print a per-case table and
    /// a final `N passed, N failed` line; exit non-zero if any case differs.
    #[arg(long, requires = "vectors")]
    check: bool,
    /// Target format for ordinary tensors.
    #[arg(long, value_enum, conflicts_with = "vectors")]
    format: Option<FormatArg>,
    /// MXFP8: which copies to write.
    #[arg(long, value_enum, default_value = "row")]
    usage: UsageArg,
    /// MXFP8: 32×32 tiles; NVFP4: 16×16 tiles (one block amax per tile).
    #[arg(long)]
    tile: bool,
    /// NVFP4: amax per tensor (per expert for 3-D tensors) or per row.
    #[arg(long, value_enum, default_value = "tensor")]
    amax: AmaxArg,
    /// FP8 block: 128×128 weight tiles or 1×128 activation blocks.
    #[arg(long, value_enum, default_value = "weight")]
    blocks: BlocksArg,
    /// FP8 block: round scales down to powers of two.
    #[arg(long)]
    pow2: bool,
    /// Zero-pad blocked dimensions that are not a multiple of the block (otherwise an error).
    #[arg(long)]
    pad: bool,
    /// Write byte scales in the 128×4 swizzled GEMM layout instead of compact row-major.
    #[arg(long)]
    swizzle: bool,
    /// Quantize only these tensors (repeatable); default: every 2-D / 3-D float tensor.
    #[arg(long = "tensor", value_name = "NAME")]
    tensors: Vec<String>,
    /// NVFP4: quantize these tensors under one shared amax (comma-separated names, e.g. an
    /// expert's gate and up projections); repeatable.
    #[arg(long, value_name = "A,B[,..]")]
    stack: Vec<String>,
    /// Input safetensors file.
    #[arg(value_name = "IN")]
    input: PathBuf,
    /// Output safetensors file (optional with --check).
    #[arg(value_name = "OUT")]
    output: Option<PathBuf>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum FormatArg {
    Mxfp8,
    Nvfp4,
    #[value(name = "fp8-block")]
    Fp8Block,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum UsageArg {
    Row,
    Col,
    Both,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum AmaxArg {
    Tensor,
    Row,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum BlocksArg {
    Weight,
    Act,
}

/// Run `mxrl quantize`.
pub fn run(a: Args) -> Result<()> {
    if a.vectors {
        return run_vectors(&a);
    }
    let Some(format) = a.format else {
        bail!("pass --format mxfp8|nvfp4|fp8-block, or --vectors for a vector file");
    };
    let Some(out) = &a.output else {
        bail!("missing OUT path")
    };
    run_format(&a, format, out)
}

fn progress(n: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(n as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn quantize_float(
    x: &FloatData,
    shape: &[usize],
    scheme: Scheme,
    padding: Padding,
) -> Result<QuantizedTensor, FormatError> {
    match x {
        FloatData::F32(v) => mxrl_formats::quantize(v, shape, scheme, padding),
        FloatData::Bf16(v) => mxrl_formats::quantize(v, shape, scheme, padding),
        FloatData::F16(v) => mxrl_formats::quantize(v, shape, scheme, padding),
    }
}

/// The tensors `NAME/<scheme>.data|scale|amax` of one quantized tensor.
fn quantized_outputs(base: &str, q: &QuantizedTensor) -> Vec<(String, OwnedTensor)> {
    let name = q.scheme.name();
    let mut v = vec![(
        format!("{base}/{name}.data"),
        OwnedTensor::u8(q.data_shape(), q.data.clone()),
    )];
    let scale_shape = match q.scale_layout {
        ScaleLayout::Compact => q.scale_shape(),
        ScaleLayout::Swizzled128x4 => vec![q.scales.nbytes()],
    };
    v.push((
        format!("{base}/{name}.scale"),
        match &q.scales {
            Scales::Bytes(b) => OwnedTensor::u8(scale_shape, b.clone()),
            Scales::F32(f) => OwnedTensor::f32(scale_shape, f),
        },
    ));
    if !q.amax.is_empty() {
        v.push((
            format!("{base}/{name}.amax"),
            OwnedTensor::f32(q.amax_shape(), &q.amax),
        ));
    }
    v
}

fn contract_metadata() -> HashMap<String, String> {
    HashMap::from([
        (
            META_CONTRACT_VERSION.to_string(),
            CONTRACT_VERSION.to_string(),
        ),
        (META_CONTRACT_HASH.to_string(), contract_hash().to_string()),
    ])
}

// ---------------------------------------------------------------------------------------------
// Vector files.

#[derive(serde::Deserialize, serde::Serialize, Debug, Clone)]
struct Case {
    case: String,
    shape: Vec<usize>,
    family: String,
    dtype: String,
    outputs: Vec<String>,
}

/// Outputs applicable to a case shape (quant-contract §6 / the list).
fn applicable(shape: &[usize]) -> Vec<Scheme> {
    let m = shape[0];
    let mut v = vec![Scheme::MXFP8_ROW];
    if m.is_multiple_of(32) {
        v.push(Scheme::MXFP8_COL);
    }
    v.push(Scheme::NVFP4_TENSOR);
    v.push(Scheme::NVFP4_ROW);
    if m.is_multiple_of(16) {
        v.push(Scheme::NVFP4_2D);
    }
    v
}

fn run_vectors(a: &Args) -> Result<()> {
    let input = &a.input;
    if !a.check && a.output.is_none() {
        bail!("--vectors without --check needs an OUT path");
    }
    let stf = st::StFile::open(input)?;
    let meta = stf.metadata();
    let manifest_json = meta.get("manifest").with_context(|| {
        format!(
            "{}: metadata has no `manifest` key (quant-contract §6)",
            input.display()
        )
    })?;
    let cases: Vec<Case> = serde_json::from_str(manifest_json).with_context(|| {
        format!(
            "{}: metadata `manifest` is not a list of cases",
            input.display()
        )
    })?;

    let pb = progress(cases.len(), "quantizing cases");
    let mut out_tensors = Vec::new();
    let mut rows = Vec::new();
    let (mut passed, mut failed) = (0usize, 0usize);
    for case in &cases {
        let xname = format!("{}/x", case.case);
        let (x, shape) = st::read_float(&stf, &xname, input)?;
        if shape.len() != 2 || shape != case.shape {
            bail!(
                "{}: `{xname}` has shape {shape:?}, manifest says {:?}",
                input.display(),
                case.shape
            );
        }
        let schemes = applicable(&shape);
        let mut cells = Vec::new();
        let mut ok = true;
        for scheme in &schemes {
            let q = quantize_float(&x, &shape, *scheme, Padding::Reject)
                .with_context(|| format!("case {} output {scheme}", case.case))?;
            let outs = quantized_outputs(&case.case, &q);
            if a.check {
                let cell = if case.outputs.contains(&scheme.name()) {
                    let diffs = compare(&stf, input, &outs)?;
                    if diffs.is_empty() {
                        "ok".to_string()
                    } else {
                        ok = false;
                        format!("DIFF({})", diffs.join(","))
                    }
                } else {
                    "-".to_string()
                };
                cells.push((scheme.name(), cell));
            }
            out_tensors.extend(outs);
        }
        if a.check {
            for listed in &case.outputs {
                if !schemes.iter().any(|s| &s.name() == listed) {
                    ok = false;
                    cells.push((listed.clone(), "NOT-PRODUCED".into()));
                }
            }
            if ok {
                passed += 1;
            } else {
                failed += 1;
            }
            rows.push((case.clone(), cells, ok));
        }
        let xt = stf.tensor(&xname).expect("read above");
        out_tensors.push((
            xname,
            OwnedTensor {
                dtype: xt.dtype,
                shape,
                bytes: xt.data.to_vec(),
            },
        ));
        pb.inc(1);
    }
    pb.finish_and_clear();

    if let Some(out) = &a.output {
        let mut m = contract_metadata();
        m.insert("manifest".into(), manifest_json.clone());
        let producer = format!(
            "mxrl-formats {} contract v{CONTRACT_VERSION} {}",
            env!("CARGO_PKG_VERSION"),
            contract_hash()
        );
        m.insert("mxfp8".into(), producer.clone());
        m.insert("nvfp4".into(), producer);
        st::write_tensors(out, out_tensors, m)?;
        eprintln!("wrote {} ({} cases)", out.display(), cases.len());
    }
    if a.check {
        print_table(&rows);
        println!("{passed} passed, {failed} failed");
        if failed > 0 {
            bail!(
                "{failed} of {} cases differ from {}",
                cases.len(),
                input.display()
            );
        }
    }
    Ok(())
}

/// Names of the fields of `outs` that differ from the same-named tensors in the file.
fn compare(stf: &st::StFile, file: &Path, outs: &[(String, OwnedTensor)]) -> Result<Vec<String>> {
    let mut diffs = Vec::new();
    for (name, t) in outs {
        let field = name.rsplit('.').next().unwrap_or(name).to_string();
        match stf.tensor(name) {
            Ok(want) => {
                if want.dtype != t.dtype
                    || want.shape != t.shape.as_slice()
                    || want.data != t.bytes.as_slice()
                {
                    diffs.push(field);
                }
            }
            Err(_) => {
                let _ = file;
                diffs.push(format!("{field}:missing"));
            }
        }
    }
    Ok(diffs)
}

/// One table row: the case, `(output, cell)` pairs, pass/fail.
type Row = (Case, Vec<(String, String)>, bool);

fn print_table(rows: &[Row]) {
    let cols = [
        "mxfp8.row",
        "mxfp8.col",
        "nvfp4.tensor",
        "nvfp4.row",
        "nvfp4.2d",
    ];
    print!(
        "{:<8} {:<11} {:<9} {:<9}",
        "case", "shape", "family", "dtype"
    );
    for c in cols {
        print!(" {c:<13}");
    }
    println!(" result");
    for (case, cells, ok) in rows {
        let shape = format!("{}x{}", case.shape[0], case.shape[1]);
        print!(
            "{:<8} {:<11} {:<9} {:<9}",
            case.case, shape, case.family, case.dtype
        );
        for c in cols {
            let cell = cells
                .iter()
                .find(|(n, _)| n == c)
                .map(|(_, v)| v.as_str())
                .unwrap_or("-");
            print!(" {cell:<13}");
        }
        let extra: Vec<String> = cells
            .iter()
            .filter(|(n, _)| !cols.contains(&n.as_str()))
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        println!(
            " {}{}",
            if *ok { "PASS" } else { "FAIL" },
            if extra.is_empty() {
                String::new()
            } else {
                format!(" {}", extra.join(" "))
            }
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Ordinary tensors.

fn schemes_for(a: &Args, format: FormatArg) -> Vec<Scheme> {
    match format {
        FormatArg::Mxfp8 => {
            let blocks = if a.tile {
                MxBlocks::Tile32x32
            } else {
                MxBlocks::Vector
            };
            let usages = match a.usage {
                UsageArg::Row => vec![Usage::RowWise],
                UsageArg::Col => vec![Usage::ColumnWise],
                UsageArg::Both => vec![Usage::RowWise, Usage::ColumnWise],
            };
            usages
                .into_iter()
                .map(|usage| Scheme::Mxfp8(Mxfp8Scheme { usage, blocks }))
                .collect()
        }
        FormatArg::Nvfp4 => vec![Scheme::Nvfp4(Nvfp4Scheme {
            amax: match a.amax {
                AmaxArg::Tensor => AmaxScope::PerTensor,
                AmaxArg::Row => AmaxScope::PerRow,
            },
            blocks: if a.tile {
                Nvfp4Blocks::Tile16x16
            } else {
                Nvfp4Blocks::Vector
            },
        })],
        FormatArg::Fp8Block => vec![Scheme::Fp8Block(Fp8BlockScheme {
            blocks: match a.blocks {
                BlocksArg::Weight => Fp8Blocks::Weight128x128,
                BlocksArg::Act => Fp8Blocks::Activation1x128,
            },
            scale_rule: if a.pow2 {
                ScaleRule::F32PowerOfTwo
            } else {
                ScaleRule::F32Exact
            },
        })],
    }
}

fn run_format(a: &Args, format: FormatArg, out: &Path) -> Result<()> {
    let input = &a.input;
    let stf = st::StFile::open(input)?;
    let padding = if a.pad {
        Padding::Zero
    } else {
        Padding::Reject
    };
    let layout = if a.swizzle {
        ScaleLayout::Swizzled128x4
    } else {
        ScaleLayout::Compact
    };
    let schemes = schemes_for(a, format);

    let mut names: Vec<String> = stf.names().into_iter().cloned().collect();
    names.sort();
    let is_float = |n: &str| {
        stf.tensor(n)
            .map(|t| {
                matches!(
                    t.dtype,
                    mxrl_ckpt::Dtype::F32 | mxrl_ckpt::Dtype::Bf16 | mxrl_ckpt::Dtype::F16
                ) && matches!(t.shape.len(), 2 | 3)
            })
            .unwrap_or(false)
    };
    for n in &a.tensors {
        if !names.contains(n) {
            bail!("{}: --tensor `{n}` not found", input.display());
        }
        if !is_float(n) {
            bail!(
                "{}: --tensor `{n}` is not a 2-D or 3-D F32/BF16/F16 tensor",
                input.display()
            );
        }
    }
    let stacks: Vec<Vec<String>> = a
        .stack
        .iter()
        .map(|s| s.split(',').map(str::to_string).collect())
        .collect();
    if !stacks.is_empty() && format != FormatArg::Nvfp4 {
        bail!("--stack applies to --format nvfp4 only");
    }
    let stacked: Vec<&String> = stacks.iter().flatten().collect();
    for n in &stacked {
        if !names.contains(n) || !is_float(n) {
            bail!(
                "{}: --stack member `{n}` is not a 2-D or 3-D F32/BF16/F16 tensor of the file",
                input.display()
            );
        }
    }
    let selected: Vec<String> = names
        .iter()
        .filter(|n| {
            if a.tensors.is_empty() {
                is_float(n)
            } else {
                a.tensors.contains(n)
            }
        })
        .filter(|n| !stacked.contains(n))
        .cloned()
        .collect();

    let pb = progress(selected.len() + stacks.len(), "quantizing tensors");
    let mut out_tensors = Vec::new();
    let mut record = BTreeMap::new();
    let mut done: Vec<String> = Vec::new();
    for name in &selected {
        let (x, shape) = st::read_float(&stf, name, input)?;
        for scheme in &schemes {
            let q = quantize_float(&x, &shape, *scheme, padding)
                .and_then(|q| q.with_scale_layout(layout))
                .with_context(|| format!("{}: tensor `{name}`", input.display()))?;
            record.insert(format!("{name}/{scheme}"), describe(&q, None));
            out_tensors.extend(quantized_outputs(name, &q));
        }
        done.push(name.clone());
        pb.inc(1);
    }
    for group in &stacks {
        let Scheme::Nvfp4(ns) = schemes[0] else {
            unreachable!("checked --format nvfp4")
        };
        let loaded: Vec<(FloatData, Vec<usize>)> = group
            .iter()
            .map(|n| st::read_float(&stf, n, input))
            .collect::<Result<_>>()?;
        let qs = stacked_quantize(&loaded, ns, padding)
            .with_context(|| format!("{}: --stack {}", input.display(), group.join(",")))?;
        for (name, q) in group.iter().zip(qs) {
            let q = q.with_scale_layout(layout)?;
            record.insert(format!("{name}/{}", q.scheme), describe(&q, Some(group)));
            out_tensors.extend(quantized_outputs(name, &q));
            done.push(name.clone());
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    for name in &names {
        if !done.contains(name) {
            let t = stf.tensor(name).expect("listed name");
            out_tensors.push((
                name.clone(),
                OwnedTensor {
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    bytes: t.data.to_vec(),
                },
            ));
        }
    }
    let mut meta = stf.metadata();
    meta.extend(contract_metadata());
    meta.insert("mxrl.quantized".into(), serde_json::to_string(&record)?);
    st::write_tensors(out, out_tensors, meta)?;
    println!(
        "quantized {} tensors ({}) into {}; copied {} unchanged; contract v{CONTRACT_VERSION} {}",
        done.len(),
        schemes
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", "),
        out.display(),
        names.len() - done.len(),
        contract_hash()
    );
    Ok(())
}

fn describe(q: &QuantizedTensor, stack: Option<&Vec<String>>) -> serde_json::Value {
    serde_json::json!({
        "scheme": q.scheme.name(),
        "shape": q.shape,
        "padded_shape": q.padded_shape,
        "scale_layout": q.scale_layout,
        "stacked_with": stack,
    })
}

fn stacked_quantize(
    parts: &[(FloatData, Vec<usize>)],
    scheme: Nvfp4Scheme,
    padding: Padding,
) -> Result<Vec<QuantizedTensor>> {
    macro_rules! go {
        ($variant:ident) => {{
            let refs = parts
                .iter()
                .map(|(d, s)| match d {
                    FloatData::$variant(v) => Ok(TensorRef::new(v, s)),
                    _ => bail!("--stack members must share one dtype"),
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(mxrl_formats::quantize_nvfp4_stacked(
                &refs, scheme, padding,
            )?)
        }};
    }
    match &parts[0].0 {
        FloatData::F32(_) => go!(F32),
        FloatData::Bf16(_) => go!(Bf16),
        FloatData::F16(_) => go!(F16),
    }
}
