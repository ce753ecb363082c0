//! Quantize a master f32 weight into its wire form and back, through `mxrl-formats` (the one
//! quantizer of the contract; the converter uses the same functions).

use crate::policy::{PolicyError, WireTensor};
use half::bf16;
use mxrl_formats::Format;

/// Quantize `[rows, cols]` f32 values into the storage `format` (row-wise blocks along `cols`).
pub fn quantize(
    name: &str,
    format: Format,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> Result<WireTensor, PolicyError> {
    if values.len() != rows * cols {
        return Err(PolicyError::Invalid(format!(
            "tensor {name}: {} values for shape [{rows}, {cols}]",
            values.len()
        )));
    }
    match format {
        Format::Bf16 => Ok(WireTensor {
            name: name.into(),
            format,
            shape: vec![rows, cols],
            data: values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            scales: Vec::new(),
            amax: Vec::new(),
        }),
        other => Err(PolicyError::Invalid(format!(
            "tensor {name}: format {other} is not available in this build"
        ))),
    }
}

/// Dequantize a wire tensor to f32 (exact: every stored value is representable in f32).
pub fn dequantize(t: &WireTensor) -> Result<Vec<f32>, PolicyError> {
    let n: usize = t.shape.iter().product();
    match t.format {
        Format::Bf16 => {
            if t.data.len() != 2 * n {
                return Err(PolicyError::Update(format!(
                    "tensor {}: {} data bytes, expected {} for BF16 {:?}",
                    t.name,
                    t.data.len(),
                    2 * n,
                    t.shape
                )));
            }
            Ok(t.data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect())
        }
        other => Err(PolicyError::Update(format!(
            "tensor {}: format {other} is not available in this build",
            t.name
        ))),
    }
}
