//! Strict parsing of safetensors headers and of sharded indexes.
//!
//! Both parsers are pure functions over bytes (no I/O), so they can be fuzzed and tested over
//! a corpus of malformed inputs. Every accepted header satisfies: the 8-byte length prefix and
//! the JSON header fit in the file; every entry has a known dtype, a shape whose byte size
//! (checked for overflow) equals its `data_offsets` span; no two tensors overlap; every span
//! lies inside the data section; and the data section is exactly covered (no gap, no trailing
//! bytes), as the reference safetensors loader requires.

use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// Largest header accepted (the reference implementation uses the same 100 MB bound).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Begin offset, relative to the data section.
    pub begin: usize,
    /// End offset (exclusive), relative to the data section.
    pub end: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Number of data bytes.
    pub fn nbytes(&self) -> usize {
        self.end - self.begin
    }
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors, sorted by their begin offset.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map (string → string).
    pub metadata: BTreeMap<String, String>,
    /// Absolute file offset at which the data section starts (8 + header length).
    pub data_start: usize,
}

fn header_err(file: &str, msg: impl Into<String>) -> CkptError {
    CkptError::Header {
        file: file.to_string(),
        msg: msg.into(),
    }
}

fn entry_err(file: &str, tensor: &str, msg: impl Into<String>) -> CkptError {
    CkptError::TensorEntry {
        file: file.to_string(),
        tensor: tensor.to_string(),
        msg: msg.into(),
    }
}

fn as_usize(file: &str, tensor: &str, field: &str, v: &Value) -> Result<usize> {
    v.as_u64()
        .and_then(|u| usize::try_from(u).ok())
        .ok_or_else(|| {
            entry_err(
                file,
                tensor,
                format!("`{field}` must hold non-negative integers, found {v}"),
            )
        })
}

/// Parses and validates the header of a whole safetensors file held in `bytes`; `file` names
/// it in errors.
pub fn parse_header(file: &str, bytes: &[u8]) -> Result<Header> {
    let len = bytes.len() as u64;
    if len < 8 {
        return Err(CkptError::Truncated {
            file: file.into(),
            what: "the 8-byte header length".into(),
            needed: 8,
            len,
        });
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_LEN {
        return Err(header_err(
            file,
            format!("header length {n} exceeds the {MAX_HEADER_LEN}-byte limit"),
        ));
    }
    if 8 + n > len {
        return Err(CkptError::Truncated {
            file: file.into(),
            what: format!("the {n}-byte JSON header"),
            needed: 8 + n,
            len,
        });
    }
    let data_start = 8 + n as usize;
    let text = std::str::from_utf8(&bytes[8..data_start])
        .map_err(|e| header_err(file, format!("header is not UTF-8: {e}")))?;
    let root: Value = serde_json::from_str(text)
        .map_err(|e| header_err(file, format!("header is not valid JSON: {e}")))?;
    let obj = root
        .as_object()
        .ok_or_else(|| header_err(file, "header must be a JSON object"))?;
    let data_len = bytes.len() - data_start;

    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(obj.len());
    for (name, entry) in obj {
        if name == "__metadata__" {
            let m = entry
                .as_object()
                .ok_or_else(|| header_err(file, "`__metadata__` must be an object of strings"))?;
            for (k, v) in m {
                let s = v.as_str().ok_or_else(|| {
                    header_err(
                        file,
                        format!("`__metadata__.{k}` must be a string, found {v}"),
                    )
                })?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let e = entry
            .as_object()
            .ok_or_else(|| entry_err(file, name, "entry must be an object"))?;
        for key in e.keys() {
            if !matches!(key.as_str(), "dtype" | "shape" | "data_offsets") {
                return Err(entry_err(file, name, format!("unknown field `{key}`")));
            }
        }
        let dtype_s = e
            .get("dtype")
            .ok_or_else(|| entry_err(file, name, "missing field `dtype`"))?
            .as_str()
            .ok_or_else(|| entry_err(file, name, "`dtype` must be a string"))?;
        let dtype = Dtype::parse(dtype_s).ok_or_else(|| {
            entry_err(
                file,
                name,
                format!(
                    "unsupported dtype `{dtype_s}` (expected one of BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64, F8_E4M3, F8_E5M2)"
                ),
            )
        })?;
        let shape_v = e
            .get("shape")
            .ok_or_else(|| entry_err(file, name, "missing field `shape`"))?
            .as_array()
            .ok_or_else(|| entry_err(file, name, "`shape` must be an array"))?;
        let shape = shape_v
            .iter()
            .map(|v| as_usize(file, name, "shape", v))
            .collect::<Result<Vec<_>>>()?;
        let offs = e
            .get("data_offsets")
            .ok_or_else(|| entry_err(file, name, "missing field `data_offsets`"))?
            .as_array()
            .ok_or_else(|| entry_err(file, name, "`data_offsets` must be an array"))?;
        if offs.len() != 2 {
            return Err(entry_err(
                file,
                name,
                format!("`data_offsets` must have 2 entries, found {}", offs.len()),
            ));
        }
        let begin = as_usize(file, name, "data_offsets", &offs[0])?;
        let end = as_usize(file, name, "data_offsets", &offs[1])?;
        if begin > end {
            return Err(entry_err(
                file,
                name,
                format!("data_offsets [{begin}, {end}] end before they begin"),
            ));
        }
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                entry_err(
                    file,
                    name,
                    format!("shape {shape:?} overflows the byte size"),
                )
            })?;
        if end - begin != nbytes {
            return Err(entry_err(
                file,
                name,
                format!(
                    "shape {shape:?} of {dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}] span {} (mismatched dtype or shape)",
                    end - begin
                ),
            ));
        }
        if end > data_len {
            return Err(entry_err(
                file,
                name,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the file (data section has {data_len} bytes; file truncated?)"
                ),
            ));
        }
        tensors.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            begin,
            end,
        });
    }
    tensors.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut covered = 0usize;
    for w in tensors.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        // Zero-sized tensors occupy no bytes and cannot overlap anything.
        if a.begin < a.end && b.begin < b.end && b.begin < a.end {
            return Err(CkptError::Overlap {
                file: file.into(),
                a: a.name.clone(),
                a_begin: a.begin,
                a_end: a.end,
                b: b.name.clone(),
                b_begin: b.begin,
                b_end: b.end,
            });
        }
    }
    for t in &tensors {
        if t.begin == t.end {
            continue;
        }
        if t.begin != covered {
            return Err(entry_err(
                file,
                &t.name,
                format!(
                    "data starts at byte {} but the previous tensor ends at {covered} (gap in the data section)",
                    t.begin
                ),
            ));
        }
        covered = t.end;
    }
    if covered != data_len {
        return Err(header_err(
            file,
            format!(
                "tensors cover {covered} bytes of the {data_len}-byte data section ({} trailing bytes)",
                data_len - covered
            ),
        ));
    }
    // The reference implementation's own validation as well (header JSON, dtypes, shapes
    // against offsets, offsets against the buffer): a file mxrl accepts is one the
    // `safetensors` crate — and so every client built on it — accepts too.
    if let Err(e) = safetensors::SafeTensors::deserialize(bytes) {
        return Err(header_err(
            file,
            format!("rejected by the safetensors reference reader: {e}"),
        ));
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

/// A validated `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    /// Tensor name → shard file name (a plain file name inside the checkpoint directory).
    pub weight_map: BTreeMap<String, String>,
    /// `metadata.total_size`, when present.
    pub total_size: Option<u64>,
    /// Other `metadata` fields, kept as they are.
    pub metadata: serde_json::Map<String, Value>,
}

impl Index {
    /// The distinct shard file names, sorted.
    pub fn shard_files(&self) -> Vec<String> {
        let mut v: Vec<String> = self.weight_map.values().cloned().collect();
        v.sort();
        v.dedup();
        v
    }
}

fn index_err(file: &str, msg: impl Into<String>) -> CkptError {
    CkptError::Index {
        file: file.into(),
        msg: msg.into(),
    }
}

/// Parses and validates a sharded index; `file` names it in errors. Shard names must be plain
/// `*.safetensors` file names (no directories, no `..`), so an index can never point outside
/// its checkpoint.
pub fn parse_index(file: &str, bytes: &[u8]) -> Result<Index> {
    let root: Value = serde_json::from_slice(bytes)
        .map_err(|e| index_err(file, format!("not valid JSON: {e}")))?;
    let obj = root
        .as_object()
        .ok_or_else(|| index_err(file, "must be a JSON object"))?;
    let wm = obj
        .get("weight_map")
        .ok_or_else(|| index_err(file, "missing field `weight_map`"))?
        .as_object()
        .ok_or_else(|| index_err(file, "field `weight_map` must be an object"))?;
    if wm.is_empty() {
        return Err(index_err(file, "field `weight_map` is empty"));
    }
    let mut weight_map = BTreeMap::new();
    for (name, v) in wm {
        let shard = v.as_str().ok_or_else(|| {
            index_err(
                file,
                format!("weight_map[`{name}`] must be a shard file name, found {v}"),
            )
        })?;
        let plain = !shard.is_empty()
            && !shard.contains(['/', '\\'])
            && shard != "."
            && shard != ".."
            && shard.ends_with(".safetensors");
        if !plain {
            return Err(index_err(
                file,
                format!(
                    "weight_map[`{name}`] = `{shard}` is not a plain `*.safetensors` file name in the checkpoint directory"
                ),
            ));
        }
        weight_map.insert(name.clone(), shard.to_string());
    }
    let mut metadata = serde_json::Map::new();
    let mut total_size = None;
    if let Some(m) = obj.get("metadata") {
        let m = m
            .as_object()
            .ok_or_else(|| index_err(file, "field `metadata` must be an object"))?;
        for (k, v) in m {
            if k == "total_size" {
                total_size = Some(v.as_u64().ok_or_else(|| {
                    index_err(
                        file,
                        format!("`metadata.total_size` must be a non-negative integer, found {v}"),
                    )
                })?);
            } else {
                metadata.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(Index {
        weight_map,
        total_size,
        metadata,
    })
}

/// Serializes an index the way Hugging Face writes it (`metadata.total_size` + `weight_map`).
pub fn index_json(weight_map: &BTreeMap<String, String>, total_size: u64) -> Value {
    serde_json::json!({
        "metadata": { "total_size": total_size },
        "weight_map": weight_map,
    })
}
