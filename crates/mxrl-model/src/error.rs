//! Typed errors of the model crate.

use std::path::PathBuf;

/// Everything that can go wrong building, loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A config.json could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file of a model directory could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A `config.json` is malformed or breaks a rule of its architecture (the shared
    /// Hugging Face config type of `mxrl-plan`; the message names the file and field).
    #[error(transparent)]
    HfConfig(#[from] mxrl_plan::PlanError),
    /// A checkpoint file is malformed or inconsistent (the message names the file and
    /// tensor).
    #[error(transparent)]
    Ckpt(#[from] mxrl_ckpt::CkptError),
    /// A valid config the engine does not run.
    #[error("{origin}: config field `{field}`: {message}")]
    Unsupported {
        /// Where the config came from.
        origin: String,
        /// The field name as in config.json.
        field: &'static str,
        /// What is not supported.
        message: String,
    },
    /// A tensor is missing from a checkpoint.
    #[error("{dir}: tensor `{name}` not found in any safetensors file")]
    MissingTensor {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The expected tensor name.
        name: String,
    },
    /// A tensor has the wrong shape or dtype.
    #[error("tensor `{name}`: {message}")]
    BadTensor {
        /// Tensor name.
        name: String,
        /// Expected vs found.
        message: String,
    },
    /// An mxrl-converted checkpoint could not be loaded (the message names the file and
    /// tensor).
    #[error("{dir}: converted checkpoint: {message}")]
    Checkpoint {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Bad runtime input (token ids, lengths, replay tables, gradients).
    #[error("invalid input: {0}")]
    Input(String),
    /// The device failed (out of memory, a failed launch); the device's message.
    #[error("device: {0}")]
    Device(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
