//! Reading checkpoints: memory-mapped safetensors files, single or sharded, validated strictly.

use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::header::{parse_header, parse_index, Header, Index, TensorInfo};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the Hugging Face model config.
pub const CONFIG_FILE: &str = "config.json";

/// One memory-mapped, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    file_name: String,
    map: Mmap,
    header: Header,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

#[allow(unsafe_code)]
fn map_file(path: &Path) -> Result<Mmap> {
    let f = File::open(path).map_err(|e| CkptError::io(path, "open", e))?;
    // SAFETY: the mapping is read-only and private to this process. The usual caveat of
    // file-backed maps applies: if another process truncates or rewrites the file while it is
    // mapped, reads may fault or see new bytes. Checkpoint inputs are not modified while mxrl
    // converts them; outputs are written to separate files, never to a mapped one.
    unsafe { Mmap::map(&f) }.map_err(|e| CkptError::io(path, "mmap", e))
}

impl SafetensorsFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let map = map_file(path)?;
        let file_name = path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let header = parse_header(&path.display().to_string(), &map)?;
        Ok(SafetensorsFile {
            path: path.into(),
            file_name,
            map,
            header,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file name (no directory).
    pub fn file_name(&self) -> &str {
        &self.file_name
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The data bytes of a tensor entry of this file.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        let s = self.header.data_start;
        &self.map[s + t.begin..s + t.end]
    }

    /// Total size of the file in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the file is empty (never true for a validated file).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// A borrowed view of one tensor of a checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// Raw little-endian bytes.
    pub data: &'a [u8],
    /// The shard file name holding it.
    pub file: &'a str,
}

impl TensorView<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A Hugging Face checkpoint directory: config, index (when sharded) and mapped shards.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config: Option<Value>,
    index: Option<Index>,
    shards: Vec<SafetensorsFile>,
    by_name: HashMap<String, (usize, usize)>,
    order: Vec<String>,
}

impl Checkpoint {
    /// Opens `dir`: `model.safetensors.index.json` and its shards when present, else
    /// `model.safetensors`. Validates every header, that every indexed tensor exists in the
    /// shard the index names, that every shard tensor is indexed to that shard, that no
    /// tensor name appears twice, and reads `config.json` when present.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(CkptError::io(
                dir,
                "open checkpoint directory",
                std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            ));
        }
        let config = read_config_opt(dir)?;
        let index_path = dir.join(INDEX_FILE);
        let (index, shards) = if index_path.is_file() {
            let bytes =
                std::fs::read(&index_path).map_err(|e| CkptError::io(&index_path, "read", e))?;
            let index = parse_index(&index_path.display().to_string(), &bytes)?;
            let mut shards = Vec::new();
            for f in index.shard_files() {
                let p = dir.join(&f);
                if !p.is_file() {
                    return Err(CkptError::Index {
                        file: index_path.display().to_string(),
                        msg: format!(
                            "shard `{f}` (holding e.g. `{}`) is missing from {}",
                            index
                                .weight_map
                                .iter()
                                .find(|(_, s)| **s == f)
                                .map(|(n, _)| n.as_str())
                                .unwrap_or("?"),
                            dir.display()
                        ),
                    });
                }
                shards.push(SafetensorsFile::open(&p)?);
            }
            (Some(index), shards)
        } else if dir.join(SINGLE_FILE).is_file() {
            (None, vec![SafetensorsFile::open(&dir.join(SINGLE_FILE))?])
        } else {
            return Err(CkptError::NoWeights { dir: dir.into() });
        };

        let mut by_name = HashMap::new();
        let mut order = Vec::new();
        for (si, s) in shards.iter().enumerate() {
            for (ti, t) in s.header.tensors.iter().enumerate() {
                if let Some((other, _)) = by_name.insert(t.name.clone(), (si, ti)) {
                    return Err(CkptError::Invalid(format!(
                        "{}: tensor `{}` appears in both `{}` and `{}`",
                        dir.display(),
                        t.name,
                        shards[other].file_name,
                        s.file_name
                    )));
                }
                order.push(t.name.clone());
            }
        }
        if let Some(idx) = &index {
            let ipath = index_path.display().to_string();
            for (name, shard) in &idx.weight_map {
                match by_name.get(name) {
                    None => {
                        return Err(CkptError::Index {
                            file: ipath,
                            msg: format!(
                                "tensor `{name}` is mapped to `{shard}` but no shard contains it"
                            ),
                        })
                    }
                    Some(&(si, _)) if shards[si].file_name != *shard => {
                        return Err(CkptError::Index {
                            file: ipath,
                            msg: format!(
                                "tensor `{name}` is mapped to `{shard}` but is stored in `{}`",
                                shards[si].file_name
                            ),
                        })
                    }
                    _ => {}
                }
            }
            for name in &order {
                if !idx.weight_map.contains_key(name) {
                    let (si, _) = by_name[name];
                    return Err(CkptError::Index {
                        file: ipath,
                        msg: format!(
                            "tensor `{name}` of shard `{}` has no entry in weight_map",
                            shards[si].file_name
                        ),
                    });
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.into(),
            config,
            index,
            shards,
            by_name,
            order,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`, if the directory has one.
    pub fn config(&self) -> Option<&Value> {
        self.config.as_ref()
    }

    /// The `config.json`, or an error naming the missing file.
    pub fn require_config(&self) -> Result<&Value> {
        self.config.as_ref().ok_or_else(|| CkptError::Config {
            file: self.dir.join(CONFIG_FILE).display().to_string(),
            field: "(file)".into(),
            msg: "config.json is missing".into(),
        })
    }

    /// The sharded index, if the checkpoint is sharded.
    pub fn index(&self) -> Option<&Index> {
        self.index.as_ref()
    }

    /// The shard files, in file-name order (one file for an unsharded checkpoint).
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// Tensor names in storage order (shard by shard, by offset).
    pub fn names(&self) -> &[String] {
        &self.order
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let &(si, ti) = self.by_name.get(name)?;
        let s = &self.shards[si];
        let t = &s.header.tensors[ti];
        Some(TensorView {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            data: s.data(t),
            file: &s.file_name,
        })
    }

    /// A tensor by name, or an error naming it and the checkpoint.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.get(name).ok_or_else(|| {
            CkptError::tensor(
                name,
                format!("not found in checkpoint {}", self.dir.display()),
            )
        })
    }

    /// Index of the shard holding a tensor.
    pub fn shard_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).map(|&(s, _)| s)
    }

    /// Sum of all tensors' data bytes.
    pub fn total_data_bytes(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.header.tensors.iter())
            .map(|t| t.nbytes() as u64)
            .sum()
    }

    /// Name → (dtype, shape) of every tensor.
    pub fn inventory(&self) -> BTreeMap<String, (Dtype, Vec<usize>)> {
        self.order
            .iter()
            .map(|n| {
                let v = self.get(n).expect("listed tensor exists");
                (n.clone(), (v.dtype, v.shape.to_vec()))
            })
            .collect()
    }
}

fn read_config_opt(dir: &Path) -> Result<Option<Value>> {
    let p = dir.join(CONFIG_FILE);
    if !p.is_file() {
        return Ok(None);
    }
    let bytes = std::fs::read(&p).map_err(|e| CkptError::io(&p, "read", e))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| CkptError::Config {
        file: p.display().to_string(),
        field: "(file)".into(),
        msg: format!("not valid JSON: {e}"),
    })?;
    if !v.is_object() {
        return Err(CkptError::Config {
            file: p.display().to_string(),
            field: "(file)".into(),
            msg: "must be a JSON object".into(),
        });
    }
    Ok(Some(v))
}
