//! Typed errors of the quantizer library.

/// Everything that can go wrong when quantizing or dequantizing. Messages name the offending
/// field or dimension and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FormatError {
    /// The shape is not `[M, K]` or `[E, M, K]`.
    #[error("expected a 2-D [M, K] or 3-D [E, M, K] shape, got {shape:?}")]
    BadRank {
        /// The shape given.
        shape: Vec<usize>,
    },
    /// The element count does not match the shape.
    #[error("{what}: shape {shape:?} needs {expected} elements, got {got}")]
    LengthMismatch {
        /// Which buffer (e.g. `input`, `data`, `scales`, `amax`).
        what: &'static str,
        /// The shape it should have.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
        /// Elements present.
        got: usize,
    },
    /// A blocked dimension is not a multiple of its block and padding was not requested.
    #[error(
        "{scheme}: dimension {dim} = {size} of shape {shape:?} is not a multiple of the block \
         size {block}; pass Padding::Zero (CLI: --pad) to zero-pad explicitly"
    )]
    NotMultiple {
        /// The scheme name.
        scheme: String,
        /// `"M"` or `"K"`.
        dim: &'static str,
        /// The dimension's size.
        size: usize,
        /// The block size it must be a multiple of.
        block: usize,
        /// The full shape.
        shape: Vec<usize>,
    },
    /// The operation does not apply to this scheme or tensor.
    #[error("{0}")]
    Unsupported(String),
    /// Parts of a stacked quantization disagree.
    #[error("stacked quantization: part {index} has shape {shape:?}, expected {expected}")]
    StackMismatch {
        /// Index of the offending part.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// What was expected.
        expected: String,
    },
}
