//! Storage formats a weight can take in a precision plan.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The storage format of one tensor, as a precision plan decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Kept in BF16 (not quantized).
    Bf16,
    /// MXFP8: E4M3 elements, blocks of 32 along K, UE8M0 (power-of-two, round-up) scales.
    Mxfp8,
    /// NVFP4: E2M1 elements, blocks of 16 along K, E4M3 block scales, FP32 amax.
    Nvfp4,
    /// DeepSeek-V3 style FP8 block: E4M3 elements, 128×128 weight blocks, FP32 scales.
    Fp8Block,
}

impl Format {
    /// All formats, in a stable order.
    pub const ALL: [Format; 4] = [Format::Bf16, Format::Mxfp8, Format::Nvfp4, Format::Fp8Block];

    /// The canonical lower-case name used in recipes, plans and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Mxfp8 => "mxfp8",
            Format::Nvfp4 => "nvfp4",
            Format::Fp8Block => "fp8_block",
        }
    }

    /// Number of consecutive elements along K that share one block scale (K must be a
    /// multiple of it), or `None` for BF16.
    pub fn k_block(self) -> Option<usize> {
        match self {
            Format::Bf16 => None,
            Format::Mxfp8 => Some(32),
            Format::Nvfp4 => Some(16),
            Format::Fp8Block => Some(128),
        }
    }

    /// Stored bytes of an `[rows, cols]` weight in this format (data + block scales +
    /// second-level scale), with `cols` the contraction dim K.
    pub fn stored_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            Format::Bf16 => rows * cols * 2,
            Format::Mxfp8 => rows * cols + rows * cols.div_ceil(32),
            Format::Nvfp4 => rows * cols.div_ceil(2) + rows * cols.div_ceil(16) + 4,
            Format::Fp8Block => rows * cols + 4 * rows.div_ceil(128) * cols.div_ceil(128),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for an unknown format name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown format `{0}` (expected one of: bf16, mxfp8, nvfp4, fp8_block)")]
pub struct UnknownFormat(pub String);

impl FromStr for Format {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(Format::Bf16),
            "mxfp8" => Ok(Format::Mxfp8),
            "nvfp4" => Ok(Format::Nvfp4),
            "fp8_block" | "fp8-block" => Ok(Format::Fp8Block),
            other => Err(UnknownFormat(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_from_str() {
        for f in Format::ALL {
            assert_eq!(f.name().parse::<Format>().unwrap(), f);
        }
        assert!("fp4".parse::<Format>().is_err());
    }

    #[test]
    fn stored_bytes_match_layouts() {
        // 64×64: MXFP8 = 4096 data + 64·2 scales; NVFP4 = 2048 data + 64·4 scales + f32 amax.
        assert_eq!(Format::Mxfp8.stored_bytes(64, 64), 4096 + 128);
        assert_eq!(Format::Nvfp4.stored_bytes(64, 64), 2048 + 256 + 4);
        assert_eq!(Format::Bf16.stored_bytes(64, 64), 8192);
    }
}
