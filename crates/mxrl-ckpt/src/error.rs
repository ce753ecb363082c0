//! The one error type of mxrl-ckpt. Every message names the file, tensor or field at fault
//! and what was expected.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;

/// An error while reading, validating, converting or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    /// An I/O operation failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done ("open", "read", "rename", ...).
        op: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A safetensors file is shorter than its own header says.
    #[error("{file}: truncated: {what} needs {needed} bytes but the file has {len}")]
    Truncated {
        /// The file.
        file: String,
        /// What did not fit.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        len: u64,
    },
    /// A safetensors header is malformed (not JSON, wrong field types, ...).
    #[error("{file}: bad safetensors header: {msg}")]
    Header {
        /// The file.
        file: String,
        /// What is wrong.
        msg: String,
    },
    /// One tensor entry of a header is inconsistent (shape vs offsets, dtype, ...).
    #[error("{file}: tensor `{tensor}`: {msg}")]
    TensorEntry {
        /// The file.
        file: String,
        /// The tensor name.
        tensor: String,
        /// What is wrong.
        msg: String,
    },
    /// Two tensors of one file claim overlapping byte ranges.
    #[error("{file}: tensors `{a}` (bytes {a_begin}..{a_end}) and `{b}` (bytes {b_begin}..{b_end}) overlap")]
    Overlap {
        /// The file.
        file: String,
        /// First tensor.
        a: String,
        /// Its begin offset.
        a_begin: usize,
        /// Its end offset.
        a_end: usize,
        /// Second tensor.
        b: String,
        /// Its begin offset.
        b_begin: usize,
        /// Its end offset.
        b_end: usize,
    },
    /// A sharded index (`model.safetensors.index.json`) is malformed or disagrees with its shards.
    #[error("{file}: {msg}")]
    Index {
        /// The index file.
        file: String,
        /// What is wrong.
        msg: String,
    },
    /// A checkpoint directory has no weights.
    #[error("{dir}: no model.safetensors and no model.safetensors.index.json")]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// A `config.json` is missing a field or has a field of the wrong type or value.
    #[error("{file}: field `{field}`: {msg}")]
    Config {
        /// The config file.
        file: String,
        /// The field.
        field: String,
        /// What was expected.
        msg: String,
    },
    /// A tensor holds NaN or Inf values.
    #[error("tensor `{tensor}` ({file}): {count} of {numel} values are NaN or Inf; refusing to convert (pass --allow-nonfinite to convert anyway)")]
    NonFinite {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// Number of NaN/Inf values.
        count: usize,
        /// Number of values.
        numel: usize,
    },
    /// The output directory exists already.
    #[error("{path}: output directory exists already; pass --force to replace it")]
    OutputExists {
        /// The output directory.
        path: PathBuf,
    },
    /// A conversion request is invalid for one tensor (shape a format cannot take, dtype, pairing).
    #[error("tensor `{tensor}`: {msg}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong and what was expected.
        msg: String,
    },
    /// The precision plan could not be built (recipe, inventory, format constraints).
    #[error("precision plan: {0}")]
    Plan(#[from] mxrl_plan::PlanError),
    /// Any other invalid request (paths, options, metadata).
    #[error("{0}")]
    Invalid(String),
}

impl CkptError {
    /// An I/O error at `path`.
    pub fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        CkptError::Io {
            path: path.into(),
            op,
            source,
        }
    }

    /// A tensor-level error.
    pub fn tensor(tensor: impl Into<String>, msg: impl Into<String>) -> Self {
        CkptError::Tensor {
            tensor: tensor.into(),
            msg: msg.into(),
        }
    }
}
