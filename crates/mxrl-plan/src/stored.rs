//! What a checkpoint stores: its logical tensors (a weight with its scale companions), each
//! with its detected storage format — the vocabulary of the plan audit and the inventory.
//! The grouping and the detection are done by the serving containers of `mxrl-ckpt`
//! (`Checkpoint::stored_tensors`, from the safetensors headers of its one strict reader, never
//! the data); a group that is no layout is [`StoredFormat::Unrecognized`] with the reason.

use mxrl_formats::Format;
use std::fmt;

/// The detected storage format of one logical tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredFormat {
    /// Stored unquantized (BF16 / F16 / F32), i.e. what a plan calls `bf16`.
    Unquantized,
    /// MXFP8, SGLang checkpoint form.
    Mxfp8,
    /// NVFP4, ModelOpt form.
    Nvfp4ModelOpt,
    /// NVFP4, compressed-tensors form.
    Nvfp4CompressedTensors,
    /// DeepSeek-V3 style FP8 with 128×128 block scales.
    Fp8Block,
    /// Something else; the string says what was found.
    Unrecognized(String),
}

impl StoredFormat {
    /// The plan format this storage corresponds to (`None` if unrecognized).
    pub fn format(&self) -> Option<Format> {
        match self {
            StoredFormat::Unquantized => Some(Format::Bf16),
            StoredFormat::Mxfp8 => Some(Format::Mxfp8),
            StoredFormat::Nvfp4ModelOpt | StoredFormat::Nvfp4CompressedTensors => {
                Some(Format::Nvfp4)
            }
            StoredFormat::Fp8Block => Some(Format::Fp8Block),
            StoredFormat::Unrecognized(_) => None,
        }
    }
}

impl fmt::Display for StoredFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoredFormat::Unquantized => f.write_str("bf16 (unquantized)"),
            StoredFormat::Mxfp8 => f.write_str("mxfp8"),
            StoredFormat::Nvfp4ModelOpt => f.write_str("nvfp4 (modelopt)"),
            StoredFormat::Nvfp4CompressedTensors => f.write_str("nvfp4 (compressed-tensors)"),
            StoredFormat::Fp8Block => f.write_str("fp8_block"),
            StoredFormat::Unrecognized(why) => write!(f, "unrecognized ({why})"),
        }
    }
}

/// A logical tensor of a checkpoint: a weight together with its scale companions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Logical name (`P.weight` for a weight group, the stored name otherwise).
    pub name: String,
    /// Detected storage format.
    pub format: StoredFormat,
    /// Dtype of the main data tensor.
    pub dtype: String,
    /// Logical shape (packed NVFP4 `[N, K/2]` becomes `[N, K]`).
    pub logical_shape: Vec<usize>,
    /// Stored tensor names making up this logical tensor.
    pub parts: Vec<String>,
    /// Checkpoint order key: (file index, first data offset).
    pub order: (usize, usize),
}
