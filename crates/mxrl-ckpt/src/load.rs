//! Reading an mxrl-converted checkpoint back as stored quantized tensors, for a model that
//! runs the stored bytes as they are (never dequantized and re-quantized).
//!
//! [`load_quantized`] reads what [`crate::convert()`] wrote: `mxrl.json` (contract, recipe,
//! per-tensor format, stored tensor names and NVFP4 amax), `config.json` and the shards. Every
//! weight comes back under its Hugging Face name as either
//!
//! | recorded format | [`StoredWeight`] |
//! |---|---|
//! | `bf16` | `Values`: the stored tensor widened to f32 (exact) |
//! | `mxfp8`, `nvfp4` (either container), `fp8_block` | `Quantized`: the tensors the record lists, decoded by their serving layout ([`crate::container::Layout::decode_quantized`]); NVFP4 with the amax recorded in `mxrl.json`, whose second-level scale must equal the stored one, bit for bit |
//!
//! The precision plan is re-resolved from the recorded recipe and the checkpoint's inventory
//! and must decide every tensor as recorded. Every stored tensor must belong to a recorded
//! weight. All mismatches are errors naming the file and tensor.
//!
//! [`stack_rows`] joins quantized parts along N (a fused gate/up weight): data and compact
//! scales concatenate row-wise; NVFP4 parts must share their amax.

use crate::container::{Layout, Nvfp4Container, Part};
use crate::convert::MXRL_JSON;
use crate::error::{CkptError, Result};
use crate::reader::{Checkpoint, TensorView};
use crate::record::{MxrlRecord, TensorRecord};
use crate::values::to_f32;
use mxrl_formats::{contract_hash, Format, QuantizedTensor, ScaleLayout, Scales, Scheme};
use mxrl_plan::{resolve, PrecisionPlan, Recipe};
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// One weight of a converted checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredWeight {
    /// Unquantized values (BF16/F16/F32 widened exactly to f32) with their shape.
    Values {
        /// Shape as stored.
        shape: Vec<usize>,
        /// Values, row-major.
        values: Vec<f32>,
    },
    /// Quantized bytes as stored (compact scales, unpadded `[N, K]` unless the FP8-block
    /// tiles pad it).
    Quantized(QuantizedTensor),
}

/// Everything [`load_quantized`] read.
#[derive(Debug, Clone)]
pub struct QuantizedCheckpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// `config.json` (with the serving engines' `quantization_config`).
    pub config: Value,
    /// The recipe recorded in `mxrl.json`.
    pub recipe: Recipe,
    /// The plan resolved from that recipe and the checkpoint's inventory; it decides every
    /// tensor as `mxrl.json` records.
    pub plan: PrecisionPlan,
    /// The plan hash recorded at conversion.
    pub plan_hash: String,
    /// NVFP4 container of the checkpoint.
    pub nvfp4_container: Nvfp4Container,
    /// Every weight by HF name, in the order of `mxrl.json`.
    pub tensors: Vec<(String, StoredWeight)>,
}

/// Whether `dir` holds an mxrl-converted checkpoint (has `mxrl.json`).
pub fn is_converted(dir: &Path) -> bool {
    dir.join(MXRL_JSON).is_file()
}

fn record_err(file: &Path, field: impl Into<String>, msg: impl Into<String>) -> CkptError {
    CkptError::Config {
        file: file.display().to_string(),
        field: field.into(),
        msg: msg.into(),
    }
}

/// Reads the weight `name` stored as `stored` (the names recorded in `mxrl.json`) in `format`.
fn read_weight(
    ck: &Checkpoint,
    record: &Path,
    name: &str,
    entry: &TensorRecord,
    format: Format,
    stored: &[String],
    container: Nvfp4Container,
) -> Result<StoredWeight> {
    let get = |i: usize, what: &str| -> Result<TensorView<'_>> {
        let s = stored.get(i).ok_or_else(|| {
            record_err(
                record,
                format!("tensors.{name}.stored"),
                format!("{format} needs a {what} tensor, the record lists {stored:?}"),
            )
        })?;
        ck.get(s).ok_or_else(|| {
            CkptError::tensor(
                s.clone(),
                format!(
                    "recorded in {} as the {what} of `{name}`, but no safetensors file of {} holds it",
                    record.display(),
                    ck.dir().display()
                ),
            )
        })
    };
    let want = |n: usize| -> Result<()> {
        if stored.len() != n {
            return Err(record_err(
                record,
                format!("tensors.{name}.stored"),
                format!("{format} stores {n} tensors, the record lists {stored:?}"),
            ));
        }
        Ok(())
    };
    let Some(layout) = Layout::for_format(format, container) else {
        want(1)?;
        let t = get(0, "weight")?;
        return Ok(StoredWeight::Values {
            shape: t.shape.to_vec(),
            values: to_f32(&t)?,
        });
    };
    let parts = layout.part_list();
    want(parts.len())?;
    // The record lists the layout's tensors in its part order.
    let by_part = |p: Part| -> Result<Option<TensorView<'_>>> {
        let i = parts
            .iter()
            .position(|&q| q == p)
            .expect("a part of the layout");
        get(i, layout.what(p)).map(Some)
    };
    let amax = match layout.nvfp4_form() {
        None => None,
        Some(_) => Some(entry.amax_from_bits().ok_or_else(|| {
            record_err(
                record,
                format!("tensors.{name}.amax_bits"),
                "an NVFP4 weight needs its amax as 0xXXXXXXXX f32 bits",
            )
        })?),
    };
    Ok(StoredWeight::Quantized(
        layout.decode_quantized(name, &by_part, amax)?,
    ))
}

/// Reads an mxrl-converted checkpoint (see the module docs).
///
/// # Errors
/// A missing or malformed `mxrl.json`, another quantization contract, a recipe that no longer
/// resolves to the recorded formats, a stored tensor of the wrong dtype or shape, an NVFP4
/// second-level scale that disagrees with the recorded amax, invalid quantized bytes, or a
/// stored tensor no record accounts for — each naming the file and tensor or field.
pub fn load_quantized(dir: &Path) -> Result<QuantizedCheckpoint> {
    let record = dir.join(MXRL_JSON);
    let rec = MxrlRecord::read(&record)?;
    if rec.contract.hash != contract_hash() {
        return Err(record_err(
            &record,
            "contract.hash",
            format!(
                "converted under quantization contract {}, this build implements {}; re-convert the checkpoint",
                rec.contract.hash,
                contract_hash()
            ),
        ));
    }
    let recipe = Recipe::from_toml_str(
        &rec.recipe.toml,
        &format!("{} recipe.toml", record.display()),
    )?;
    let plan_hash = rec.plan_hash.clone();
    let container = rec.container(&record)?;
    let entries = &rec.tensors;

    let ck = Checkpoint::open(dir)?;
    let config = ck.require_config()?.clone();
    let inv = ck.model_inventory()?;
    let plan = resolve(&inv, &recipe)?;
    let mut accounted = HashSet::new();
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, entry) in entries {
        let fname = entry.format.as_str();
        let format = Format::ALL
            .into_iter()
            .find(|f| f.name() == fname)
            .ok_or_else(|| {
                record_err(
                    &record,
                    format!("tensors.{name}.format"),
                    format!("unknown format `{fname}`"),
                )
            })?;
        let decided = plan.by_hf(name).map(|e| e.format);
        if decided != Some(format) {
            return Err(record_err(
                &record,
                format!("tensors.{name}.format"),
                format!(
                    "recorded as {format}, but the recorded recipe decides {} for this checkpoint",
                    decided.map_or("nothing".to_string(), |f| f.name().to_string())
                ),
            ));
        }
        let stored = entry.stored.clone();
        let w = read_weight(&ck, &record, name, entry, format, &stored, container)?;
        accounted.extend(stored);
        tensors.push((name.clone(), w));
    }
    if let Some(extra) = ck.names().iter().find(|n| !accounted.contains(*n)) {
        let file = ck
            .get(extra)
            .map(|t| t.file.to_string())
            .unwrap_or_default();
        return Err(CkptError::TensorEntry {
            file,
            tensor: extra.clone(),
            msg: format!("stored but not recorded in {}", record.display()),
        });
    }
    Ok(QuantizedCheckpoint {
        dir: dir.to_path_buf(),
        config,
        recipe,
        plan,
        plan_hash,
        nvfp4_container: container,
        tensors,
    })
}

/// Joins quantized weights `[n_i, K]` of one scheme along N into `[Σ n_i, K]` (a fused gate/up
/// weight: gate rows first when given first). Element data and compact scales concatenate
/// row-wise, which is exactly the stacked tensor for MXFP8 and NVFP4 (row-local blocks) when
/// NVFP4 parts share their per-tensor amax, and for FP8-block when every part has whole
/// 128-row tiles. `names` name the parts in errors.
///
/// # Errors
/// Parts of different schemes or K, NVFP4 parts with different amax (naming both tensors),
/// FP8-block parts with N not a multiple of 128, padded parts.
pub fn stack_rows(parts: &[(&str, &QuantizedTensor)]) -> Result<QuantizedTensor> {
    let Some(&(first_name, first)) = parts.first() else {
        return Err(CkptError::Invalid("stack_rows: no parts".into()));
    };
    let k = first.shape.get(1).copied().unwrap_or(0);
    let mut out = QuantizedTensor {
        scheme: first.scheme,
        shape: vec![0, k],
        padded_shape: vec![0, k],
        data: Vec::new(),
        scales: match &first.scales {
            Scales::Bytes(_) => Scales::Bytes(Vec::new()),
            Scales::F32(_) => Scales::F32(Vec::new()),
        },
        scale_layout: ScaleLayout::Compact,
        amax: first.amax.clone(),
    };
    for &(name, q) in parts {
        let bad = |msg: String| CkptError::tensor(name, msg);
        if q.scheme != first.scheme || q.shape.len() != 2 || q.shape[1] != k {
            return Err(bad(format!(
                "cannot be stacked with `{first_name}`: {} {:?} vs {} {:?}",
                q.scheme, q.shape, first.scheme, first.shape
            )));
        }
        if q.padded_shape != q.shape {
            return Err(bad(format!(
                "padded to {:?}; only unpadded parts can be stacked",
                q.padded_shape
            )));
        }
        if q.amax
            .iter()
            .map(|a| a.to_bits())
            .ne(first.amax.iter().map(|a| a.to_bits()))
        {
            return Err(bad(format!(
                "NVFP4 amax {:?} differs from `{first_name}`'s {:?}: parts of one fused GEMM must share one per-tensor amax (convert quantizes gate and up with their joint amax)",
                q.amax, first.amax
            )));
        }
        if matches!(q.scheme, Scheme::Fp8Block(_)) && q.shape[0] % 128 != 0 {
            return Err(bad(format!(
                "FP8-block rows {} are not whole 128-row tiles; the stacked tensor's tiles would straddle the parts",
                q.shape[0]
            )));
        }
        let q = q
            .clone()
            .with_scale_layout(ScaleLayout::Compact)
            .map_err(|e| bad(e.to_string()))?;
        out.shape[0] += q.shape[0];
        out.padded_shape[0] += q.shape[0];
        out.data.extend_from_slice(&q.data);
        match (&mut out.scales, &q.scales) {
            (Scales::Bytes(o), Scales::Bytes(s)) => o.extend_from_slice(s),
            (Scales::F32(o), Scales::F32(s)) => o.extend_from_slice(s),
            _ => return Err(bad("scales of another kind".into())),
        }
    }
    out.validate()
        .map_err(|e| CkptError::tensor(first_name, format!("stacked tensor: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mxrl_formats::{amax_of, quantize, quantize_nvfp4_with_amax, Padding};

    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
                scale * ((h % 2001) as f32 / 1000.0 - 1.0)
            })
            .collect()
    }

    /// Stacking separately quantized parts gives the bytes of quantizing the stacked tensor:
    /// MXFP8 row-wise (row-local blocks), and NVFP4 when each part was quantized with the
    /// joint amax (what convert writes for gate/up).
    #[test]
    fn stacked_parts_equal_the_quantized_stack() {
        let (f, k) = (3, 64);
        let gate = values(f * k, 1, 1.0);
        let up = values(f * k, 2, 3.0);
        let stack: Vec<f32> = gate.iter().chain(&up).copied().collect();
        let q = |x: &[f32]| quantize(x, &[x.len() / k, k], Scheme::MXFP8_ROW, Padding::Reject);
        let got = stack_rows(&[("g", &q(&gate).unwrap()), ("u", &q(&up).unwrap())]).unwrap();
        let want = q(&stack).unwrap();
        assert_eq!((got.data, got.scales), (want.data, want.scales));

        let Scheme::Nvfp4(s) = Scheme::NVFP4_TENSOR else {
            unreachable!("NVFP4_TENSOR is NVFP4")
        };
        let amax = amax_of(stack.iter().copied());
        let q4 = |x: &[f32]| {
            quantize_nvfp4_with_amax(x, &[x.len() / k, k], s, Padding::Reject, &[amax]).unwrap()
        };
        let got = stack_rows(&[("g", &q4(&gate)), ("u", &q4(&up))]).unwrap();
        let want = quantize(&stack, &[2 * f, k], Scheme::NVFP4_TENSOR, Padding::Reject).unwrap();
        assert_eq!(
            (got.data, got.scales, got.amax),
            (want.data, want.scales, want.amax)
        );
    }

    /// NVFP4 parts with their own amax are refused, naming both tensors.
    #[test]
    fn nvfp4_parts_with_different_amax_are_refused() {
        let k = 32;
        let gate = values(2 * k, 3, 1.0);
        let up = values(2 * k, 4, 5.0);
        let q = |x: &[f32]| quantize(x, &[2, k], Scheme::NVFP4_TENSOR, Padding::Reject).unwrap();
        let e = stack_rows(&[
            ("a.gate_proj.weight", &q(&gate)),
            ("a.up_proj.weight", &q(&up)),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("a.gate_proj.weight")
                && e.contains("a.up_proj.weight")
                && e.contains("amax"),
            "{e}"
        );
    }
}
