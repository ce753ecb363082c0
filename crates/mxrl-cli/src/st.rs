//! Small safetensors helpers shared by subcommands: typed reads, atomic writes.

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// A float tensor widened to its own element type.
pub enum FloatData {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    Bf16(Vec<half::bf16>),
    /// f16 elements.
    F16(Vec<half::f16>),
}

/// Read a float tensor (F32 / BF16 / F16) by name.
pub fn read_float(
    st: &SafeTensors<'_>,
    name: &str,
    file: &Path,
) -> Result<(FloatData, Vec<usize>)> {
    let t = st
        .tensor(name)
        .with_context(|| format!("{}: tensor `{name}` not found", file.display()))?;
    let b = t.data();
    let data = match t.dtype() {
        Dtype::F32 => FloatData::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::BF16 => FloatData::Bf16(
            b.chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        Dtype::F16 => FloatData::F16(
            b.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        other => bail!(
            "{}: tensor `{name}` has dtype {other:?}, expected F32, BF16 or F16",
            file.display()
        ),
    };
    Ok((data, t.shape().to_vec()))
}

/// The `__metadata__` map of a safetensors buffer (empty if none).
pub fn metadata(raw: &[u8], file: &Path) -> Result<HashMap<String, String>> {
    let (_, meta) = SafeTensors::read_metadata(raw)
        .map_err(|e| anyhow::anyhow!("{}: not a safetensors file: {e:?}", file.display()))?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// An owned tensor to write.
pub struct OwnedTensor {
    /// Element dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    /// A U8 tensor.
    pub fn u8(shape: Vec<usize>, bytes: Vec<u8>) -> Self {
        OwnedTensor {
            dtype: Dtype::U8,
            shape,
            bytes,
        }
    }
    /// An F32 tensor.
    pub fn f32(shape: Vec<usize>, v: &[f32]) -> Self {
        OwnedTensor {
            dtype: Dtype::F32,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Serialize `tensors` with `metadata` to `path` atomically (temporary file, then rename).
pub fn write_atomic(
    path: &Path,
    tensors: Vec<(String, OwnedTensor)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (n.clone(), v))
                .map_err(|e| anyhow::anyhow!("tensor `{n}`: {e:?}"))
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, &Some(metadata))
        .map_err(|e| anyhow::anyhow!("serializing {}: {e:?}", path.display()))?;
    let file_name = path
        .file_name()
        .with_context(|| format!("output path {} has no file name", path.display()))?;
    if path.is_dir() {
        anyhow::bail!(
            "output path {} is a directory; give a file name such as {}",
            path.display(),
            path.join("out.safetensors").display()
        );
    }
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let written = std::fs::write(&tmp, &bytes)
        .with_context(|| format!("writing {}", tmp.display()))
        .and_then(|_| {
            std::fs::rename(&tmp, path)
                .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
        });
    if written.is_err() {
        // Nothing half-written is left behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
