//! Small safetensors helpers shared by subcommands, on the one reader and writer of
//! `mxrl_ckpt` (strict header validation, errors naming the file and tensor; atomic writes).

use anyhow::{anyhow, bail, Result};
use mxrl_ckpt::{write_safetensors_atomic, Dtype, SafetensorsFile, TensorSpec, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// A safetensors file opened by the strict reader, with tensors looked up by name.
pub struct StFile {
    file: SafetensorsFile,
    by_name: HashMap<String, usize>,
}

impl StFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = SafetensorsFile::open(path)?;
        let by_name = file
            .header()
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(StFile { file, by_name })
    }

    /// Tensor names (header order: by data offset).
    pub fn names(&self) -> Vec<&String> {
        self.file.header().tensors.iter().map(|t| &t.name).collect()
    }

    /// A tensor by name, or an error naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let &i = self
            .by_name
            .get(name)
            .ok_or_else(|| anyhow!("{}: tensor `{name}` not found", self.file.path().display()))?;
        let t = &self.file.header().tensors[i];
        Ok(TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data: self.file.data(t),
            file: self.file.file_name(),
        })
    }

    /// The `__metadata__` map (empty if none).
    pub fn metadata(&self) -> HashMap<String, String> {
        self.file
            .header()
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

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
pub fn read_float(st: &StFile, name: &str, file: &Path) -> Result<(FloatData, Vec<usize>)> {
    let t = st.tensor(name)?;
    let b = t.data;
    let data = match t.dtype {
        Dtype::F32 => FloatData::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::Bf16 => FloatData::Bf16(
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
            "{}: tensor `{name}` has dtype {other}, expected F32, BF16 or F16",
            file.display()
        ),
    };
    Ok((data, t.shape.to_vec()))
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

/// Write `tensors` with `metadata` to `path` with the one shard writer, atomically (temporary
/// file, then rename: `mxrl_ckpt::write_safetensors_atomic`).
pub fn write_tensors(
    path: &Path,
    tensors: Vec<(String, OwnedTensor)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "output path {} is a directory; give a file name such as {}",
            path.display(),
            path.join("out.safetensors").display()
        );
    }
    let tensors: Vec<(TensorSpec, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, t)| (TensorSpec::new(n, t.dtype, t.shape), t.bytes))
        .collect();
    let metadata: BTreeMap<String, String> = metadata.into_iter().collect();
    write_safetensors_atomic(path, &tensors, &metadata)?;
    Ok(())
}
