//! Element decoding for full-precision inputs, BF16 encoding for outputs, and the NaN/Inf scan.

use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::reader::TensorView;
use half::{bf16, f16};

/// Widens a BF16 / F16 / F32 tensor to f32 (exactly: every BF16 and F16 value is an f32).
pub fn to_f32(t: &TensorView<'_>) -> Result<Vec<f32>> {
    let d = t.data;
    Ok(match t.dtype {
        Dtype::Bf16 => d
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        other => {
            return Err(CkptError::TensorEntry {
                file: t.file.into(),
                tensor: t.name.into(),
                msg: format!(
                    "dtype {other} cannot be read as full precision (expected BF16, F16 or F32)"
                ),
            })
        }
    })
}

/// Rounds f32 values to BF16 (round to nearest even; NaN stays NaN) as little-endian bytes.
pub fn f32_to_bf16_bytes(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * 2);
    for &v in x {
        out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
    out
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * 4);
    for &v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Little-endian f32 bytes as values (`bytes.len()` must be a multiple of 4).
pub fn f32_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Number of NaN or Inf elements of a floating-point tensor (0 for integer dtypes).
pub fn count_nonfinite(dtype: Dtype, data: &[u8]) -> usize {
    match dtype {
        Dtype::Bf16 | Dtype::F16 => {
            // Exponent field all ones: 0x7F80 for BF16, 0x7C00 for F16.
            let m = if dtype == Dtype::Bf16 { 0x7F80 } else { 0x7C00 };
            data.chunks_exact(2)
                .filter(|c| u16::from_le_bytes([c[0], c[1]]) & m == m)
                .count()
        }
        Dtype::F32 => data
            .chunks_exact(4)
            .filter(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
            .count(),
        Dtype::F64 => data
            .chunks_exact(8)
            .filter(|c| !f64::from_le_bytes((*c).try_into().expect("8 bytes")).is_finite())
            .count(),
        // e4m3fn has no Inf; NaN is S.1111.111.
        Dtype::F8E4m3 => data.iter().filter(|&&b| b & 0x7F == 0x7F).count(),
        Dtype::F8E5m2 => data.iter().filter(|&&b| b & 0x7C == 0x7C).count(),
        _ => 0,
    }
}

/// Fails with [`CkptError::NonFinite`] naming the tensor and the count, unless `allow`.
pub fn check_finite(t: &TensorView<'_>, allow: bool) -> Result<()> {
    if allow {
        return Ok(());
    }
    let count = count_nonfinite(t.dtype, t.data);
    if count > 0 {
        return Err(CkptError::NonFinite {
            file: t.file.into(),
            tensor: t.name.into(),
            count,
            numel: t.numel(),
        });
    }
    Ok(())
}
