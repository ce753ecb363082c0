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
    /// config.json is not valid JSON of the expected shape.
    #[error("{origin}: invalid config.json: {source}")]
    ConfigJson {
        /// Where the text came from.
        origin: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// A config field has a value the engine does not support or that is inconsistent.
    #[error("config field `{field}`: {message}")]
    Config {
        /// The field name as in config.json.
        field: &'static str,
        /// What was wrong and what was expected.
        message: String,
    },
    /// A weight file could not be parsed.
    #[error("{path}: invalid safetensors: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
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
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
