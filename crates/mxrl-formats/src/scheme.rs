//! Quantization schemes: which format, which blocks, which scale rule, which usage.

use crate::Format;
use serde::{Deserialize, Serialize};
use std::fmt;

/// `fl(1/448)` = f32 bits 0x3B12_4925 (MXFP8 scale computation, contract §2).
pub const R448: f32 = f32::from_bits(0x3B12_4925);
/// `fl(1/6)` = f32 bits 0x3E2A_AAAB (NVFP4 block-scale multiplier, contract §3).
pub const R6: f32 = f32::from_bits(0x3E2A_AAAB);
/// `fl(1/2688)` = f32 bits 0x39C3_0C31 (NVFP4 dequantization, contract §3).
pub const R2688: f32 = f32::from_bits(0x39C3_0C31);
/// 2688 = 448 · 6: the NVFP4 global-scale numerator (E4M3 max × E2M1 max).
pub const NVFP4_GLOBAL_NUMERATOR: f32 = 2688.0;
/// MXFP8 block length (elements sharing one UE8M0 scale).
pub const MXFP8_BLOCK: usize = 32;
/// NVFP4 block length (elements sharing one E4M3 scale).
pub const NVFP4_BLOCK: usize = 16;
/// FP8-block block edge (128×128 weight tiles, 1×128 activation blocks).
pub const FP8_BLOCK: usize = 128;

/// Which copy of a tensor a quantization is: blocks along the last dim or along the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Usage {
    /// Blocks run along the last dim K (the forward GEMM operand). Data `[M, K]`, scales
    /// `[M, K/block]`.
    RowWise,
    /// Blocks run along the rows M (MXFP8 only; the backward operand), quantized from the
    /// high-precision input. Data stays in the input's shape `[M, K]` (TE's layout), scales
    /// `[M/32, K]`.
    ColumnWise,
}

impl Usage {
    /// `"row"` or `"col"` (the vector-file spelling).
    pub fn name(self) -> &'static str {
        match self {
            Usage::RowWise => "row",
            Usage::ColumnWise => "col",
        }
    }
}

/// How the MXFP8 blocks are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MxBlocks {
    /// 1×32 blocks (row-wise usage) or 32×1 blocks (column-wise usage): the block amax is
    /// `max|x|` over those 32 values.
    Vector,
    /// 32×32 weight tiles: the tile amax is used for every 1×32 / 32×1 block inside it, so the
    /// scale is written for every row (row-wise) or column (column-wise) and both usages hold
    /// the same data bytes. Needs M and K multiples of 32.
    Tile32x32,
}

/// Scope of the NVFP4 FP32 second-level amax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxScope {
    /// One amax per tensor (per expert for a 3-D `[E, M, K]` input): weights.
    PerTensor,
    /// One amax per row (per token): activations in the mxrl NVFP4 recipe.
    PerRow,
}

impl AmaxScope {
    /// `"tensor"` or `"row"` (the vector-file spelling).
    pub fn name(self) -> &'static str {
        match self {
            AmaxScope::PerTensor => "tensor",
            AmaxScope::PerRow => "row",
        }
    }
}

/// How the NVFP4 blocks are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Nvfp4Blocks {
    /// 1×16 blocks along K: `bmax = max|x|` over the 16 values.
    Vector,
    /// 16×16 weight tiles: the tile amax replaces `bmax` for all 16 rows; scales are still
    /// written per row `[M, K/16]`. Needs M and K multiples of 16.
    Tile16x16,
}

/// FP8-block (DeepSeek-V3 style) block shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Blocks {
    /// 128×128 tiles (weights): scales `[M/128, K/128]`.
    Weight128x128,
    /// 1×128 blocks along K (activations): scales `[M, K/128]`.
    Activation1x128,
}

/// The block-scale rule of a scheme. Each variant's doc is its formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRule {
    /// MXFP8 (contract §2; TE default math, torchao `RCEIL`): per block `amax = max|x|`
    /// (NaN ignored, start +0); `v = fl(amax × R448)`, `R448 = fl(1/448)`;
    /// `scale = ue8m0_round_up(v)`; `inv = ue8m0_reciprocal(scale)` (exact);
    /// `q_i = e4m3(fl(x_i × inv))`. Dequantize: `x̂ = fl(ue8m0_decode(scale) × e4m3_value(q))`.
    Ue8m0RoundUp,
    /// NVFP4 two-level scale (contract §3; TE `NVFP4QuantizerRef`): `S = fl(2688 / amax)`,
    /// `S = min(S, f32::MAX)`, `S = 1` if amax == 0 or S == 0; `S_dec = fl(1/S)`;
    /// `mult = fl(S × R6)`, `R6 = fl(1/6)`. Per block: `sdec = min(fl(bmax × mult), f32::MAX)`;
    /// `scale = ue4m3(sdec)`; `sf = e4m3_value(scale)`;
    /// `enc = min(fl(1 / fl(sf × S_dec)), f32::MAX)`; `code_i = e2m1(fl(x_i × enc))`.
    /// Dequantize: `x̂ = fl(e2m1_value(code) × fl(fl(sf × amax) × R2688))`, `R2688 = fl(1/2688)`.
    E4m3TwoLevel,
    /// FP8 block with exact FP32 scales (TE `Float8BlockScaling` with `force_pow_2_scales =
    /// false`, epsilon 0; DeepSeek-V3): per block `amax = max|x|` (NaN ignored);
    /// `scale = 1` if amax == 0 or amax is Inf, else `scale = fl(448 / amax)`, and
    /// `scale = f32::MAX` if that is Inf; `q_i = e4m3(fl(x_i × scale))`; the stored FP32 scale
    /// is `scale_inv = fl(1 / scale)`. Dequantize: `x̂ = fl(e4m3_value(q) × scale_inv)`.
    F32Exact,
    /// As [`ScaleRule::F32Exact`], then the scale is rounded **down** to a power of two by
    /// clearing its mantissa bits (`bits & 0xFF80_0000`; TE `force_pow_2_scales = true`), so
    /// `scale_inv` is exact.
    F32PowerOfTwo,
}

impl ScaleRule {
    /// All scale rules, in a stable order (part of the contract hash).
    pub const ALL: [ScaleRule; 4] = [
        ScaleRule::Ue8m0RoundUp,
        ScaleRule::E4m3TwoLevel,
        ScaleRule::F32Exact,
        ScaleRule::F32PowerOfTwo,
    ];

    /// Stable name used in the contract hash.
    pub fn name(self) -> &'static str {
        match self {
            ScaleRule::Ue8m0RoundUp => "ue8m0.round_up(fl(amax*R448))",
            ScaleRule::E4m3TwoLevel => "e4m3(min(fl(bmax*fl(S*R6)),MAX)),S=fl(2688/amax)",
            ScaleRule::F32Exact => "f32(fl(448/amax)),inv=fl(1/scale)",
            ScaleRule::F32PowerOfTwo => "f32(fl(448/amax)&0xFF800000),inv=fl(1/scale)",
        }
    }
}

/// MXFP8 scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mxfp8Scheme {
    /// Row-wise (1×32) or column-wise (32×1) copy.
    pub usage: Usage,
    /// 1-D blocks or 32×32 tiles.
    pub blocks: MxBlocks,
}

/// NVFP4 scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Nvfp4Scheme {
    /// Per-tensor or per-row amax.
    pub amax: AmaxScope,
    /// 1×16 blocks or 16×16 tiles.
    pub blocks: Nvfp4Blocks,
}

/// FP8-block scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fp8BlockScheme {
    /// 128×128 weight tiles or 1×128 activation blocks.
    pub blocks: Fp8Blocks,
    /// [`ScaleRule::F32Exact`] or [`ScaleRule::F32PowerOfTwo`].
    pub scale_rule: ScaleRule,
}

/// A complete quantization scheme: everything that decides the output bytes besides the
/// input (and, for [`Padding`], the explicit padding choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "format", rename_all = "snake_case")]
pub enum Scheme {
    /// MXFP8 (contract §2).
    Mxfp8(Mxfp8Scheme),
    /// NVFP4 (contract §3).
    Nvfp4(Nvfp4Scheme),
    /// FP8 block (DeepSeek-V3 style, Hopper-era baseline).
    Fp8Block(Fp8BlockScheme),
}

impl Scheme {
    /// MXFP8 row-wise, 1×32 blocks (the forward operand).
    pub const MXFP8_ROW: Scheme = Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::RowWise,
        blocks: MxBlocks::Vector,
    });
    /// MXFP8 column-wise, 32×1 blocks (the backward operand).
    pub const MXFP8_COL: Scheme = Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::ColumnWise,
        blocks: MxBlocks::Vector,
    });
    /// NVFP4 with one amax per tensor (weights).
    pub const NVFP4_TENSOR: Scheme = Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerTensor,
        blocks: Nvfp4Blocks::Vector,
    });
    /// NVFP4 with one amax per row (activations, per token).
    pub const NVFP4_ROW: Scheme = Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerRow,
        blocks: Nvfp4Blocks::Vector,
    });
    /// NVFP4 per-tensor amax with 16×16 tiles (the vector files' `nvfp4.2d`).
    pub const NVFP4_2D: Scheme = Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerTensor,
        blocks: Nvfp4Blocks::Tile16x16,
    });
    /// FP8 block, 128×128 weight tiles, exact FP32 scales.
    pub const FP8_BLOCK_WEIGHT: Scheme = Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Weight128x128,
        scale_rule: ScaleRule::F32Exact,
    });
    /// FP8 block, 1×128 activation blocks, exact FP32 scales.
    pub const FP8_BLOCK_ACT: Scheme = Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Activation1x128,
        scale_rule: ScaleRule::F32Exact,
    });

    /// The storage format.
    pub fn format(self) -> Format {
        match self {
            Scheme::Mxfp8(_) => Format::Mxfp8,
            Scheme::Nvfp4(_) => Format::Nvfp4,
            Scheme::Fp8Block(_) => Format::Fp8Block,
        }
    }

    /// The block-scale rule.
    pub fn scale_rule(self) -> ScaleRule {
        match self {
            Scheme::Mxfp8(_) => ScaleRule::Ue8m0RoundUp,
            Scheme::Nvfp4(_) => ScaleRule::E4m3TwoLevel,
            Scheme::Fp8Block(s) => s.scale_rule,
        }
    }

    /// The usage (NVFP4 and FP8 block are always row-wise).
    pub fn usage(self) -> Usage {
        match self {
            Scheme::Mxfp8(s) => s.usage,
            _ => Usage::RowWise,
        }
    }

    /// Block shape `[rows, cols]` of one scale: e.g. `[1, 32]` MXFP8 row-wise, `[32, 1]`
    /// column-wise, `[1, 16]` NVFP4, `[128, 128]` FP8 weight tiles. (Tile modes of MXFP8/NVFP4
    /// still store one scale per 1-D block; their amax extent is given by [`Scheme::amax_tile`].)
    pub fn scale_block(self) -> [usize; 2] {
        match self {
            Scheme::Mxfp8(s) => match s.usage {
                Usage::RowWise => [1, MXFP8_BLOCK],
                Usage::ColumnWise => [MXFP8_BLOCK, 1],
            },
            Scheme::Nvfp4(_) => [1, NVFP4_BLOCK],
            Scheme::Fp8Block(s) => match s.blocks {
                Fp8Blocks::Weight128x128 => [FP8_BLOCK, FP8_BLOCK],
                Fp8Blocks::Activation1x128 => [1, FP8_BLOCK],
            },
        }
    }

    /// Extent `[rows, cols]` over which one block amax is taken.
    pub fn amax_tile(self) -> [usize; 2] {
        match self {
            Scheme::Mxfp8(Mxfp8Scheme {
                blocks: MxBlocks::Tile32x32,
                ..
            }) => [MXFP8_BLOCK, MXFP8_BLOCK],
            Scheme::Nvfp4(Nvfp4Scheme {
                blocks: Nvfp4Blocks::Tile16x16,
                ..
            }) => [NVFP4_BLOCK, NVFP4_BLOCK],
            other => other.scale_block(),
        }
    }

    /// Short stable name, e.g. `mxfp8.row`, `mxfp8.col.tile32`, `nvfp4.tensor`, `nvfp4.2d`,
    /// `nvfp4.row`, `fp8_block.weight`, `fp8_block.act.pow2`. The vector-file output names
    /// (`mxfp8.row`, `mxfp8.col`, `nvfp4.tensor`, `nvfp4.row`, `nvfp4.2d`) are among them.
    pub fn name(self) -> String {
        match self {
            Scheme::Mxfp8(s) => {
                let tile = if s.blocks == MxBlocks::Tile32x32 {
                    ".tile32"
                } else {
                    ""
                };
                format!("mxfp8.{}{tile}", s.usage.name())
            }
            Scheme::Nvfp4(s) => match (s.amax, s.blocks) {
                (AmaxScope::PerTensor, Nvfp4Blocks::Tile16x16) => "nvfp4.2d".into(),
                (a, Nvfp4Blocks::Vector) => format!("nvfp4.{}", a.name()),
                (a, Nvfp4Blocks::Tile16x16) => format!("nvfp4.{}.tile16", a.name()),
            },
            Scheme::Fp8Block(s) => {
                let b = match s.blocks {
                    Fp8Blocks::Weight128x128 => "weight",
                    Fp8Blocks::Activation1x128 => "act",
                };
                let p = if s.scale_rule == ScaleRule::F32PowerOfTwo {
                    ".pow2"
                } else {
                    ""
                };
                format!("fp8_block.{b}{p}")
            }
        }
    }

    /// Parse a name produced by [`Scheme::name`].
    pub fn from_name(name: &str) -> Option<Scheme> {
        ALL_SCHEMES.iter().copied().find(|s| s.name() == name)
    }
}

/// Every scheme, in a stable order (each appears in the contract hash by name).
pub const ALL_SCHEMES: [Scheme; 12] = [
    Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::RowWise,
        blocks: MxBlocks::Vector,
    }),
    Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::ColumnWise,
        blocks: MxBlocks::Vector,
    }),
    Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::RowWise,
        blocks: MxBlocks::Tile32x32,
    }),
    Scheme::Mxfp8(Mxfp8Scheme {
        usage: Usage::ColumnWise,
        blocks: MxBlocks::Tile32x32,
    }),
    Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerTensor,
        blocks: Nvfp4Blocks::Vector,
    }),
    Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerRow,
        blocks: Nvfp4Blocks::Vector,
    }),
    Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerTensor,
        blocks: Nvfp4Blocks::Tile16x16,
    }),
    Scheme::Nvfp4(Nvfp4Scheme {
        amax: AmaxScope::PerRow,
        blocks: Nvfp4Blocks::Tile16x16,
    }),
    Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Weight128x128,
        scale_rule: ScaleRule::F32Exact,
    }),
    Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Weight128x128,
        scale_rule: ScaleRule::F32PowerOfTwo,
    }),
    Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Activation1x128,
        scale_rule: ScaleRule::F32Exact,
    }),
    Scheme::Fp8Block(Fp8BlockScheme {
        blocks: Fp8Blocks::Activation1x128,
        scale_rule: ScaleRule::F32PowerOfTwo,
    }),
];

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// What to do when a blocked dimension is not a multiple of its block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Padding {
    /// Refuse with [`FormatError::NotMultiple`](crate::FormatError::NotMultiple) (default).
    #[default]
    Reject,
    /// Quantize as if the input were zero-padded up to the next multiple of the block along
    /// every blocked dim. Data and scales cover the padded shape
    /// ([`QuantizedTensor::padded_shape`](crate::QuantizedTensor::padded_shape)); dequantize
    /// returns the original shape. Zeros never change an amax, so the real elements get the
    /// same bytes as in an unpadded tensor of the padded shape.
    Zero,
}

/// Byte layout of a block-scale matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleLayout {
    /// Row-major `[rows, cols]`, unpadded (checkpoint form).
    #[default]
    Compact,
    /// cuBLASLt / CUTLASS / FlashInfer "128×4" swizzle (contract §4): rows padded to 128,
    /// cols to a multiple of 4, (r, c) → `((r/128)·(Cp/4) + c/4)·512 + (r%32)·16 +
    /// ((r%128)/32)·4 + c%4`, padding bytes 0. Applied per expert for 3-D tensors, and to
    /// the transposed `[K, M/32]` view for column-wise MXFP8 scales (the GEMM's view).
    Swizzled128x4,
}
