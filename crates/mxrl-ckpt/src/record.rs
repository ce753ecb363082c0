//! The typed `mxrl.json` record of a converted checkpoint: written by [`crate::convert`], read
//! by [`crate::load_quantized`] and [`crate::verify`] through this one type, so the three
//! cannot disagree about a field.

use crate::container::Nvfp4Container;
use crate::error::{CkptError, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Largest `mxrl.json` read (bytes); one entry per tensor of the checkpoint.
pub const MAX_RECORD_BYTES: u64 = 1 << 30;

/// `mxrl.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MxrlRecord {
    /// The mxrl version that converted the checkpoint.
    pub mxrl_version: String,
    /// The quantization contract the bytes follow.
    pub contract: ContractRecord,
    /// The recipe (its source label and full TOML).
    pub recipe: RecipeRecord,
    /// Hash of the precision plan the recipe resolved to.
    pub plan_hash: String,
    /// NVFP4 on-disk layout (`modelopt` or `compressed-tensors`).
    pub nvfp4_container: String,
    /// The one quantized format stored (`None`: everything BF16).
    pub quantized_format: Option<String>,
    /// Every logical weight of the checkpoint by its Hugging Face name.
    pub tensors: BTreeMap<String, TensorRecord>,
}

/// The quantization contract recorded in `mxrl.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContractRecord {
    /// Contract version.
    pub version: u32,
    /// Contract hash.
    pub hash: String,
}

/// The recipe recorded in `mxrl.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipeRecord {
    /// A preset name or the recipe file's path, as given to `convert`.
    pub source: String,
    /// The recipe's full TOML.
    pub toml: String,
}

/// One logical weight in `mxrl.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRecord {
    /// Plan format (`bf16`, `mxfp8`, `nvfp4`, `fp8_block`).
    pub format: String,
    /// How it was produced (quantized, re-packed, copied, ...).
    pub method: String,
    /// The stored tensor names making it up (data first, then scales).
    pub stored: Vec<String>,
    /// NVFP4 per-tensor amax (informational; `amax_bits` is authoritative).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax: Option<f32>,
    /// NVFP4 amax as `0xXXXXXXXX` f32 bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax_bits: Option<String>,
    /// The gate/up partner sharing this amax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amax_shared_with: Option<String>,
}

impl TensorRecord {
    /// The recorded amax from `amax_bits`, or `None` when absent or not `0x` + 8 hex digits.
    pub fn amax_from_bits(&self) -> Option<f32> {
        let b = self.amax_bits.as_deref()?.strip_prefix("0x")?;
        (b.len() == 8)
            .then(|| u32::from_str_radix(b, 16).ok())
            .flatten()
            .map(f32::from_bits)
    }
}

impl MxrlRecord {
    /// Reads `path`; a malformed record is an error naming the file and the field.
    pub fn read(path: &Path) -> Result<MxrlRecord> {
        Ok(MxrlRecord::read_with_value(path)?.0)
    }

    /// Reads `path` as the typed record and as the JSON value it was parsed from.
    pub fn read_with_value(path: &Path) -> Result<(MxrlRecord, Value)> {
        use std::io::Read;
        let f = std::fs::File::open(path).map_err(|e| CkptError::io(path, "read", e))?;
        let mut text = String::new();
        f.take(MAX_RECORD_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| CkptError::io(path, "read", e))?;
        let err = |field: String, msg: String| CkptError::Config {
            file: path.display().to_string(),
            field,
            msg,
        };
        if text.len() as u64 > MAX_RECORD_BYTES {
            return Err(err(
                "(document)".into(),
                format!("larger than {MAX_RECORD_BYTES} bytes"),
            ));
        }
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| err("(document)".into(), format!("not valid JSON: {e}")))?;
        let rec: MxrlRecord = serde_path_to_error::deserialize(&value).map_err(|e| {
            let field = e.path().to_string();
            err(field, e.into_inner().to_string())
        })?;
        Ok((rec, value))
    }

    /// The record as JSON (keys sorted, as written to `mxrl.json`).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("the record serializes")
    }

    /// The NVFP4 container, or an error naming `path` and the field.
    pub fn container(&self, path: &Path) -> Result<Nvfp4Container> {
        Nvfp4Container::parse(&self.nvfp4_container).ok_or_else(|| CkptError::Config {
            file: path.display().to_string(),
            field: "nvfp4_container".into(),
            msg: format!(
                "`{}`: expected modelopt or compressed-tensors",
                self.nvfp4_container
            ),
        })
    }
}
