//! The crate's error type. Every message names the file, recipe, rule or tensor involved
//! and what was expected.

use std::path::PathBuf;

/// Everything that can go wrong while loading a recipe or a model, resolving a plan,
/// exporting it or auditing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A recipe file is not valid TOML or has unknown / mistyped fields.
    #[error("recipe {origin}: {message}")]
    RecipeSyntax {
        /// File path or preset name.
        origin: String,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A recipe parses but says something impossible.
    #[error("recipe `{recipe}`: {message}")]
    RecipeInvalid {
        /// Recipe name.
        recipe: String,
        /// What is wrong.
        message: String,
    },
    /// `load` was given neither an existing file nor a known preset.
    #[error("`{name}` is neither a recipe file nor a built-in preset (presets: {known})")]
    UnknownPreset {
        /// What was asked for.
        name: String,
        /// Comma-separated preset names.
        known: String,
    },
    /// A model `config.json` is malformed or lacks a field the architecture needs.
    #[error("model config {origin}: {message}")]
    Config {
        /// File path (or `<json>` for in-memory text).
        origin: String,
        /// What is wrong.
        message: String,
    },
    /// The config names an architecture mxrl has no tensor map for.
    #[error(
        "model config {origin}: unsupported model_type `{model_type}` (supported: {supported})"
    )]
    UnsupportedArch {
        /// File path.
        origin: String,
        /// The `model_type` field.
        model_type: String,
        /// Comma-separated supported types.
        supported: String,
    },
    /// A checkpoint holds tensors the architecture does not have.
    #[error("{dir}: {} tensor(s) not known for this architecture: {}", names.len(), names.join(", "))]
    UnknownTensors {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Every unknown tensor name.
        names: Vec<String>,
    },
    /// A checkpoint lacks tensors the config implies.
    #[error("{dir}: {} tensor(s) missing for this architecture: {}", names.len(), names.join(", "))]
    MissingTensors {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Every missing tensor name.
        names: Vec<String>,
    },
    /// A stored tensor's shape disagrees with the config.
    #[error(
        "tensor `{tensor}`: shape {found:?} in the checkpoint, but the config implies {expected:?}"
    )]
    ShapeMismatch {
        /// HF tensor name.
        tensor: String,
        /// Shape from the config.
        expected: Vec<usize>,
        /// Shape found (logical, after unpacking).
        found: Vec<usize>,
    },
    /// A rule's layer selection does not fit the model.
    #[error("rule {rule}: {source}")]
    Layers {
        /// Rule index.
        rule: usize,
        /// The selection error.
        source: crate::layers::LayerSpecError,
    },
    /// A tensor cannot take the format its rule gives it, and the rule has no fallback.
    #[error("tensor `{tensor}` ({shape:?}): {reason}; it cannot be stored as {format} ({by}); add `fallback = \"bf16\"` to the rule to keep such tensors in BF16")]
    FormatConstraint {
        /// HF tensor name.
        tensor: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The format asked for.
        format: mxrl_formats::Format,
        /// "rule N" or "recipe default".
        by: String,
        /// Why it does not fit.
        reason: String,
    },
    /// Tensors that run as one fused GEMM were given different formats.
    #[error(
        "tensors {tensors:?} run as one fused GEMM but were given different formats {formats:?}"
    )]
    FusedMismatch {
        /// HF names of the fused group.
        tensors: Vec<String>,
        /// Their formats, in the same order.
        formats: Vec<mxrl_formats::Format>,
    },
}
