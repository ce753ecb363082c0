//! safetensors element types.

use std::fmt;

/// An element type of a safetensors tensor (the `dtype` strings of the format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `BOOL`
    Bool,
    /// `U8`
    U8,
    /// `I8`
    I8,
    /// `U16`
    U16,
    /// `I16`
    I16,
    /// `F16`
    F16,
    /// `BF16`
    Bf16,
    /// `U32`
    U32,
    /// `I32`
    I32,
    /// `F32`
    F32,
    /// `U64`
    U64,
    /// `I64`
    I64,
    /// `F64`
    F64,
    /// `F8_E4M3` (e4m3fn: no Inf, NaN = 0x7F / 0xFF)
    F8E4m3,
    /// `F8_E5M2`
    F8E5m2,
}

impl Dtype {
    /// Every dtype, in a stable order.
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::U32,
        Dtype::I32,
        Dtype::F32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F64,
        Dtype::F8E4m3,
        Dtype::F8E5m2,
    ];

    /// The name used in safetensors headers.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
            Dtype::F8E4m3 => "F8_E4M3",
            Dtype::F8E5m2 => "F8_E5M2",
        }
    }

    /// Parses a header dtype string; `None` for an unknown one.
    pub fn parse(s: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4m3 | Dtype::F8E5m2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// Whether the dtype is a floating-point type whose values can be NaN or Inf.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64 | Dtype::F8E4m3 | Dtype::F8E5m2
        )
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
