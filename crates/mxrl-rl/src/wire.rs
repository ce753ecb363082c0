//! Quantize a master f32 weight into its wire form and back, through `mxrl-formats` (the one
//! quantizer of the contract; the converter uses the same functions).
//!
//! Wire schemes: BF16 little-endian; MXFP8 row-wise (1×32 blocks along K, UE8M0 scales);
//! NVFP4 with one per-tensor FP32 amax (1×16 blocks, E4M3 scales). Scales are compact.

use crate::policy::{PolicyError, WireTensor};
use half::bf16;
use mxrl_formats::{Format, Padding, QuantizedTensor, ScaleLayout, Scales, Scheme};

fn scheme_of(format: Format) -> Option<Scheme> {
    match format {
        Format::Mxfp8 => Some(Scheme::MXFP8_ROW),
        Format::Nvfp4 => Some(Scheme::NVFP4_TENSOR),
        Format::Fp8Block => Some(Scheme::FP8_BLOCK_WEIGHT),
        Format::Bf16 => None,
    }
}

/// The contract hash every weight update carries.
pub fn contract_hash() -> &'static str {
    mxrl_formats::contract_hash()
}

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
        other => {
            let scheme = scheme_of(other).expect("non-BF16 formats have a scheme");
            let q = mxrl_formats::quantize(values, &[rows, cols], scheme, Padding::Reject)
                .map_err(|e| PolicyError::Invalid(format!("tensor {name}: {e}")))?;
            let scales = match q.scales {
                Scales::Bytes(b) => b,
                Scales::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            Ok(WireTensor {
                name: name.into(),
                format,
                shape: vec![rows, cols],
                data: q.data,
                scales,
                amax: q.amax,
            })
        }
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
        other => {
            let scheme = scheme_of(other).expect("non-BF16 formats have a scheme");
            let scales = if other == Format::Fp8Block {
                if t.scales.len() % 4 != 0 {
                    return Err(PolicyError::Update(format!(
                        "tensor {}: {} FP8-block scale bytes is not a whole number of f32",
                        t.name,
                        t.scales.len()
                    )));
                }
                Scales::F32(
                    t.scales
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                )
            } else {
                Scales::Bytes(t.scales.clone())
            };
            let q = QuantizedTensor {
                scheme,
                shape: t.shape.clone(),
                padded_shape: t.shape.clone(),
                data: t.data.clone(),
                scales,
                scale_layout: ScaleLayout::Compact,
                amax: t.amax.clone(),
            };
            q.validate()
                .and_then(|_| q.dequantize())
                .map_err(|e| PolicyError::Update(format!("tensor {}: {e}", t.name)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_equals_the_contract_dequantization() {
        let (r, c) = (4, 64);
        let x: Vec<f32> = (0..r * c)
            .map(|i| ((i * 7919) % 113) as f32 / 17.0 - 3.0)
            .collect();
        for f in [Format::Bf16, Format::Mxfp8, Format::Nvfp4] {
            let w = quantize("w", f, r, c, &x).unwrap();
            assert_eq!(w.byte_len(), f.stored_bytes(r, c), "{f}");
            let d = dequantize(&w).unwrap();
            // Quantizing the dequantized values of the same bytes again through the
            // contract library gives back values equal to `d` (no drift through the wire).
            if let Some(s) = scheme_of(f) {
                let q = mxrl_formats::quantize(&x, &[r, c], s, Padding::Reject).unwrap();
                assert_eq!(q.data, w.data, "{f}");
                let want = q.dequantize().unwrap();
                assert_eq!(
                    d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
        let mut bad = quantize("w", Format::Mxfp8, r, c, &x).unwrap();
        bad.scales.pop();
        assert!(dequantize(&bad)
            .unwrap_err()
            .to_string()
            .contains("tensor w"));
    }
}
