//! What a checkpoint stores: safetensors header entries (never the data), grouped into
//! logical tensors, each with its detected storage format. The entries come from the one
//! strict reader in `mxrl-ckpt` (`Checkpoint::stored_tensors`); this module only classifies.
//!
//! Detection, per logical weight `P.weight` (companions are the tensors `P.<suffix>`):
//!
//! | stored tensors | format |
//! |---|---|
//! | `weight` BF16/F16/F32, no scale companions | unquantized |
//! | `weight` F8_E4M3 `[N,K]` + `weight_scale_inv` U8 `[N,K/32]` | MXFP8 (SGLang form) |
//! | `weight` U8 `[N,K/2]` + `weight_scale` F8_E4M3 `[N,K/16]` + `weight_scale_2` F32 | NVFP4 (ModelOpt) |
//! | `weight_packed` U8 `[N,K/2]` + `weight_scale` F8_E4M3 `[N,K/16]` + `weight_global_scale` F32 | NVFP4 (compressed-tensors) |
//! | `weight` F8_E4M3 `[N,K]` + `weight_scale_inv` F32 `[ceil(N/128),ceil(K/128)]` | FP8 block |
//!
//! Anything else is reported as unrecognized with the reason. `input_scale`,
//! `input_global_scale` and `weight_shape` are accepted companions that do not change
//! the verdict.

use mxrl_formats::Format;
use std::collections::BTreeMap;
use std::fmt;

/// Companion suffixes (the last dot-segment of a stored name).
const COMPANIONS: [&str; 8] = [
    "weight_scale_inv",
    "weight_scale_2",
    "weight_scale",
    "weight_global_scale",
    "weight_packed",
    "weight_shape",
    "input_scale",
    "input_global_scale",
];

/// The detected storage format of one logical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredFormat {
    /// Stored unquantized (BF16 / F16 / F32), i.e. what a plan calls `bf16`.
    Unquantized,
    /// MXFP8, SGLang checkpoint form.
    Mxfp8,
    /// NVFP4, ModelOpt form.
    Nvfp4ModelOpt,
    /// NVFP4, compressed-tensors form.
    Nvfp4CompressedTensors,
    /// DeepSeek-V3 style FP8 with 128×128 block scales.
    Fp8Block,
    /// Something else; the string says what was found.
    Unrecognized(String),
}

impl StoredFormat {
    /// The plan format this storage corresponds to (`None` if unrecognized).
    pub fn format(&self) -> Option<Format> {
        match self {
            StoredFormat::Unquantized => Some(Format::Bf16),
            StoredFormat::Mxfp8 => Some(Format::Mxfp8),
            StoredFormat::Nvfp4ModelOpt | StoredFormat::Nvfp4CompressedTensors => {
                Some(Format::Nvfp4)
            }
            StoredFormat::Fp8Block => Some(Format::Fp8Block),
            StoredFormat::Unrecognized(_) => None,
        }
    }
}

impl fmt::Display for StoredFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoredFormat::Unquantized => f.write_str("bf16 (unquantized)"),
            StoredFormat::Mxfp8 => f.write_str("mxfp8"),
            StoredFormat::Nvfp4ModelOpt => f.write_str("nvfp4 (modelopt)"),
            StoredFormat::Nvfp4CompressedTensors => f.write_str("nvfp4 (compressed-tensors)"),
            StoredFormat::Fp8Block => f.write_str("fp8_block"),
            StoredFormat::Unrecognized(why) => write!(f, "unrecognized ({why})"),
        }
    }
}

/// One entry of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Stored tensor name.
    pub name: String,
    /// Dtype as safetensors spells it (`BF16`, `F8_E4M3`, `U8`, ...).
    pub dtype: String,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Byte offset of the data (relative to the data section).
    pub offset: usize,
}

/// A logical tensor of a checkpoint: a weight together with its scale companions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Logical name (`P.weight` for a weight group, the stored name otherwise).
    pub name: String,
    /// Detected storage format.
    pub format: StoredFormat,
    /// Dtype of the main data tensor.
    pub dtype: String,
    /// Logical shape (packed NVFP4 `[N, K/2]` becomes `[N, K]`).
    pub logical_shape: Vec<usize>,
    /// Stored tensor names making up this logical tensor.
    pub parts: Vec<String>,
    /// Checkpoint order key: (file index, first data offset).
    pub order: (usize, usize),
}

/// Group header entries (with their file index) into logical tensors.
pub fn group(entries: Vec<(usize, HeaderEntry)>) -> Vec<StoredTensor> {
    // prefix -> (suffix -> entry)
    let mut groups: BTreeMap<String, BTreeMap<String, (usize, HeaderEntry)>> = BTreeMap::new();
    let mut singles: Vec<(usize, HeaderEntry)> = Vec::new();
    for (fi, e) in entries {
        match e.name.rsplit_once('.') {
            Some((prefix, last)) if last == "weight" || COMPANIONS.contains(&last) => {
                groups
                    .entry(prefix.to_string())
                    .or_default()
                    .insert(last.to_string(), (fi, e));
            }
            _ => singles.push((fi, e)),
        }
    }
    let mut out = Vec::new();
    for (fi, e) in singles {
        let format = if matches!(e.dtype.as_str(), "BF16" | "F16" | "F32") {
            StoredFormat::Unquantized
        } else {
            StoredFormat::Unrecognized(format!("{} tensor without a weight", e.dtype))
        };
        out.push(StoredTensor {
            name: e.name.clone(),
            format,
            dtype: e.dtype.clone(),
            logical_shape: e.shape.clone(),
            parts: vec![e.name.clone()],
            order: (fi, e.offset),
        });
    }
    for (prefix, parts) in groups {
        let order = parts
            .values()
            .map(|(fi, e)| (*fi, e.offset))
            .min()
            .expect("a group has at least one member");
        let (format, dtype, logical_shape) = detect(&parts);
        out.push(StoredTensor {
            name: format!("{prefix}.weight"),
            format,
            dtype,
            logical_shape,
            parts: parts.values().map(|(_, e)| e.name.clone()).collect(),
            order,
        });
    }
    out.sort_by_key(|t| t.order);
    out
}

fn detect(parts: &BTreeMap<String, (usize, HeaderEntry)>) -> (StoredFormat, String, Vec<usize>) {
    let get = |s: &str| parts.get(s).map(|(_, e)| e);
    let unrec = |why: String, dtype: &str, shape: &[usize]| {
        (
            StoredFormat::Unrecognized(why),
            dtype.to_string(),
            shape.to_vec(),
        )
    };
    let is = |e: Option<&HeaderEntry>, dtype: &str, shape: &[usize]| {
        e.is_some_and(|e| e.dtype == dtype && e.shape == shape)
    };
    let scalar_f32 = |e: Option<&HeaderEntry>| {
        e.is_some_and(|e| e.dtype == "F32" && e.shape.iter().product::<usize>() == 1)
    };
    if let Some(p) = get("weight_packed") {
        if get("weight").is_some() {
            return unrec("both weight and weight_packed".into(), &p.dtype, &p.shape);
        }
        if p.dtype != "U8" || p.shape.len() != 2 {
            return unrec(
                format!("weight_packed is {} {:?}", p.dtype, p.shape),
                &p.dtype,
                &p.shape,
            );
        }
        let (n, k) = (p.shape[0], p.shape[1] * 2);
        if is(get("weight_scale"), "F8_E4M3", &[n, k.div_ceil(16)])
            && scalar_f32(get("weight_global_scale"))
        {
            return (
                StoredFormat::Nvfp4CompressedTensors,
                "BF16".into(),
                vec![n, k],
            );
        }
        return unrec(
            "weight_packed without weight_scale F8_E4M3 [N,K/16] + weight_global_scale F32".into(),
            &p.dtype,
            &p.shape,
        );
    }
    let Some(w) = get("weight") else {
        let names: Vec<&String> = parts.keys().collect();
        let any = parts.values().next().expect("non-empty group").1.clone();
        return unrec(
            format!("scale tensors {names:?} without a weight"),
            &any.dtype,
            &any.shape,
        );
    };
    let has = |s: &str| parts.contains_key(s);
    let scales = [
        "weight_scale_inv",
        "weight_scale",
        "weight_scale_2",
        "weight_global_scale",
    ];
    match w.dtype.as_str() {
        "BF16" | "F16" | "F32" => {
            if scales.iter().any(|s| has(s)) {
                unrec(
                    format!("{} weight with scale tensors", w.dtype),
                    &w.dtype,
                    &w.shape,
                )
            } else {
                (StoredFormat::Unquantized, w.dtype.clone(), w.shape.clone())
            }
        }
        "U8" if w.shape.len() == 2 => {
            let (n, k) = (w.shape[0], w.shape[1] * 2);
            if is(get("weight_scale"), "F8_E4M3", &[n, k.div_ceil(16)])
                && scalar_f32(get("weight_scale_2"))
            {
                (StoredFormat::Nvfp4ModelOpt, "BF16".into(), vec![n, k])
            } else {
                unrec(
                    "U8 weight without weight_scale F8_E4M3 [N,K/16] + weight_scale_2 F32".into(),
                    &w.dtype,
                    &w.shape,
                )
            }
        }
        "F8_E4M3" if w.shape.len() == 2 => {
            let (n, k) = (w.shape[0], w.shape[1]);
            match get("weight_scale_inv") {
                Some(s) if s.dtype == "U8" && k % 32 == 0 && s.shape == [n, k / 32] => {
                    (StoredFormat::Mxfp8, "BF16".into(), vec![n, k])
                }
                Some(s) if s.dtype == "F32" && s.shape == [n.div_ceil(128), k.div_ceil(128)] => {
                    (StoredFormat::Fp8Block, "BF16".into(), vec![n, k])
                }
                Some(s) => unrec(
                    format!(
                        "F8_E4M3 weight with weight_scale_inv {} {:?}",
                        s.dtype, s.shape
                    ),
                    &w.dtype,
                    &w.shape,
                ),
                None => unrec(
                    "F8_E4M3 weight without weight_scale_inv".into(),
                    &w.dtype,
                    &w.shape,
                ),
            }
        }
        other => unrec(format!("{other} weight {:?}", w.shape), &w.dtype, &w.shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, dtype: &str, shape: &[usize], offset: usize) -> (usize, HeaderEntry) {
        (
            0,
            HeaderEntry {
                name: name.into(),
                dtype: dtype.into(),
                shape: shape.to_vec(),
                offset,
            },
        )
    }

    fn one(entries: Vec<(usize, HeaderEntry)>) -> StoredTensor {
        let g = group(entries);
        assert_eq!(g.len(), 1, "{g:?}");
        g.into_iter().next().unwrap()
    }

    #[test]
    fn each_layout_is_detected() {
        let t = one(vec![e("a.weight", "BF16", &[64, 64], 0)]);
        assert_eq!(t.format, StoredFormat::Unquantized);
        let t = one(vec![
            e("a.weight", "F8_E4M3", &[64, 64], 0),
            e("a.weight_scale_inv", "U8", &[64, 2], 4096),
        ]);
        assert_eq!(
            (t.format, t.logical_shape),
            (StoredFormat::Mxfp8, vec![64, 64])
        );
        let t = one(vec![
            e("a.weight", "U8", &[64, 32], 0),
            e("a.weight_scale", "F8_E4M3", &[64, 4], 2048),
            e("a.weight_scale_2", "F32", &[], 2304),
            e("a.input_scale", "F32", &[], 2308),
        ]);
        assert_eq!(
            (t.format, t.logical_shape),
            (StoredFormat::Nvfp4ModelOpt, vec![64, 64])
        );
        let t = one(vec![
            e("a.weight_packed", "U8", &[64, 32], 0),
            e("a.weight_scale", "F8_E4M3", &[64, 4], 2048),
            e("a.weight_global_scale", "F32", &[1], 2304),
        ]);
        assert_eq!(t.format, StoredFormat::Nvfp4CompressedTensors);
        assert_eq!(t.name, "a.weight");
        let t = one(vec![
            e("a.weight", "F8_E4M3", &[200, 300], 0),
            e("a.weight_scale_inv", "F32", &[2, 3], 60000),
        ]);
        assert_eq!(
            (t.format, t.logical_shape),
            (StoredFormat::Fp8Block, vec![200, 300])
        );
    }

    #[test]
    fn wrong_companions_are_unrecognized_not_guessed() {
        // MXFP8 scale with the wrong shape.
        let t = one(vec![
            e("a.weight", "F8_E4M3", &[64, 64], 0),
            e("a.weight_scale_inv", "U8", &[64, 4], 4096),
        ]);
        assert!(matches!(t.format, StoredFormat::Unrecognized(_)));
        // FP8 weight without scales.
        let t = one(vec![e("a.weight", "F8_E4M3", &[64, 64], 0)]);
        assert!(matches!(t.format, StoredFormat::Unrecognized(_)));
        // NVFP4 without the second-level scale.
        let t = one(vec![
            e("a.weight", "U8", &[64, 32], 0),
            e("a.weight_scale", "F8_E4M3", &[64, 4], 2048),
        ]);
        assert!(matches!(t.format, StoredFormat::Unrecognized(_)));
    }

    #[test]
    fn biases_stay_separate_tensors() {
        let g = group(vec![
            e("a.q_proj.weight", "BF16", &[8, 8], 0),
            e("a.q_proj.bias", "BF16", &[8], 128),
        ]);
        let names: Vec<&str> = g.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a.q_proj.weight", "a.q_proj.bias"]);
    }
}
