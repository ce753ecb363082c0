//! Quantize a master f32 weight into its wire form and back, through `mxrl-formats` (the one
//! quantizer of the contract; the converter uses the same functions).
//!
//! Wire schemes: BF16 little-endian; MXFP8 row-wise (1×32 blocks along K, UE8M0 scales);
//! NVFP4 with one per-tensor FP32 amax (1×16 blocks, E4M3 scales). Scales are compact.

use crate::policy::{PolicyError, WireTensor};
use half::bf16;
use mxrl_formats::{Format, Padding, QuantizedTensor, ScaleLayout, Scales, Scheme};
use mxrl_tensor::device::StoredBytes;

/// The wire scheme of a storage format (`None` for BF16): MXFP8 row-wise 1×32 blocks, NVFP4
/// 1×16 blocks with one per-tensor FP32 amax, FP8-block 128×128 tiles with exact FP32
/// `scale_inv` — exactly the weight schemes of the quantized linear
/// (`mxrl_tensor::qlinear::LinearSpec::weight_scheme`) and of `mxrl convert`.
pub fn wire_scheme(format: Format) -> Option<Scheme> {
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
    match wire_scheme(format) {
        None => Ok(bf16_wire(name, vec![rows, cols], values)),
        Some(scheme) => {
            let q = mxrl_formats::quantize(values, &[rows, cols], scheme, Padding::Reject)
                .map_err(|e| PolicyError::Invalid(format!("tensor {name}: {e}")))?;
            from_quantized(name, &q)
        }
    }
}

/// A BF16 wire tensor of `values` (round to nearest even; lossless for BF16-exact values).
pub fn bf16_wire(name: &str, shape: Vec<usize>, values: &[f32]) -> WireTensor {
    let bits: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    bf16_bits_wire(name, shape, &bits)
}

/// A BF16 tensor on the wire from its BF16 bit patterns (the data: little-endian bytes).
pub fn bf16_bits_wire(name: &str, shape: Vec<usize>, bits: &[u16]) -> WireTensor {
    let mut data = vec![0u8; 2 * bits.len()];
    for (o, b) in data.chunks_exact_mut(2).zip(bits) {
        o.copy_from_slice(&b.to_le_bytes());
    }
    WireTensor {
        name: name.into(),
        format: Format::Bf16,
        shape,
        data,
        scales: Vec::new(),
        amax: Vec::new(),
    }
}

/// A stored quantized tensor (a quantized linear's forward weight, a converted checkpoint
/// tensor) in wire form, losslessly: data, scales (FP32 scales as little-endian bytes) and
/// amax are copied as they are. [`to_quantized`] gives back an equal tensor.
///
/// # Errors
/// A scheme that is not its format's [`wire_scheme`], a non-compact scale layout, a padded
/// or non-2-D tensor — each naming `name`.
pub fn from_quantized(name: &str, q: &QuantizedTensor) -> Result<WireTensor, PolicyError> {
    into_wire(name, q.clone())
}

/// [`from_quantized`] taking the tensor: its bytes move into the wire tensor.
///
/// # Errors
/// As [`from_quantized`].
pub fn into_wire(name: &str, q: QuantizedTensor) -> Result<WireTensor, PolicyError> {
    let format = q.scheme.format();
    if wire_scheme(format) != Some(q.scheme)
        || q.scale_layout != ScaleLayout::Compact
        || q.padded_shape != q.shape
        || q.shape.len() != 2
    {
        return Err(PolicyError::Invalid(format!(
            "tensor {name}: stored as {} {:?} (padded {:?}, {:?} scales); the wire carries \
             unpadded 2-D {} tensors with compact scales",
            q.scheme.name(),
            q.shape,
            q.padded_shape,
            q.scale_layout,
            wire_scheme(format).map_or_else(|| format.name().to_string(), |s| s.name()),
        )));
    }
    let scales = match q.scales {
        Scales::Bytes(b) => b,
        Scales::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    Ok(WireTensor {
        name: name.into(),
        format,
        shape: q.shape,
        data: q.data,
        scales,
        amax: q.amax,
    })
}

/// A wire tensor of a block format → the stored quantized tensor it carries (validated by
/// the contract library; nothing is re-quantized).
///
/// # Errors
/// A BF16 tensor, FP32 scale bytes that are not whole f32s, or bytes that do not form a
/// valid tensor of the wire scheme for its shape — each naming the tensor.
pub fn to_quantized(t: &WireTensor) -> Result<QuantizedTensor, PolicyError> {
    let scheme = wire_scheme(t.format).ok_or_else(|| {
        PolicyError::Update(format!(
            "tensor {}: BF16 has no quantized form (send its values)",
            t.name
        ))
    })?;
    StoredBytes {
        name: &t.name,
        data: &t.data,
        scales: &t.scales,
        amax: &t.amax,
    }
    .to_quantized(scheme, &t.shape)
    .map_err(PolicyError::Update)
}

/// Checks that `t` is a BF16 tensor with 2 data bytes per element of its shape and no
/// scales or amax.
///
/// # Errors
/// Another format or byte count, naming the tensor.
pub fn check_bf16(t: &WireTensor) -> Result<(), PolicyError> {
    let n: usize = t.shape.iter().product();
    if t.format != Format::Bf16
        || t.data.len() != 2 * n
        || !t.scales.is_empty()
        || !t.amax.is_empty()
    {
        return Err(PolicyError::Update(format!(
            "tensor {}: {} {:?} with {} data / {} scale bytes / {} amax, expected BF16 with {} \
             data bytes and no scales",
            t.name,
            t.format,
            t.shape,
            t.data.len(),
            t.scales.len(),
            t.amax.len(),
            2 * n
        )));
    }
    Ok(())
}

/// Decode a BF16 wire tensor to its (exact) f32 values.
///
/// # Errors
/// As [`check_bf16`].
pub fn bf16_values(t: &WireTensor) -> Result<Vec<f32>, PolicyError> {
    check_bf16(t)?;
    Ok(t.data
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect())
}

/// Dequantize a wire tensor to f32 (exact: every stored value is representable in f32).
/// A block-format tensor is read as its rows × last-dim matrix.
pub fn dequantize(t: &WireTensor) -> Result<Vec<f32>, PolicyError> {
    if t.format == Format::Bf16 {
        return bf16_values(t);
    }
    let c = *t.shape.last().unwrap_or(&1);
    let n: usize = t.shape.iter().product();
    let as_matrix = WireTensor {
        shape: vec![n / c.max(1), c],
        ..t.clone()
    };
    to_quantized(&as_matrix)?
        .dequantize()
        .map_err(|e| PolicyError::Update(format!("tensor {}: {e}", t.name)))
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
            if let Some(s) = wire_scheme(f) {
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

    /// QuantizedTensor → WireTensor → QuantizedTensor gives back an equal tensor (every
    /// field, FP32 scales of FP8-block included) for each wire scheme; other schemes, padded
    /// tensors and swizzled scales are refused rather than silently changed.
    #[test]
    fn quantized_wire_conversion_is_lossless_and_refuses_other_layouts() {
        let (r, c) = (128, 256);
        let x: Vec<f32> = (0..r * c)
            .map(|i| ((i * 7919) % 1009) as f32 / 37.0 - 13.0)
            .collect();
        for f in [Format::Mxfp8, Format::Nvfp4, Format::Fp8Block] {
            let s = wire_scheme(f).unwrap();
            let q = mxrl_formats::quantize(&x, &[r, c], s, Padding::Reject).unwrap();
            let w = from_quantized("w", &q).unwrap();
            assert_eq!((w.format, w.shape.clone()), (f, vec![r, c]));
            assert_eq!(w.byte_len(), q.nbytes(), "{f}");
            let back = to_quantized(&w).unwrap();
            assert_eq!(back, q, "{f}");
            assert_eq!(
                back.amax.iter().map(|a| a.to_bits()).collect::<Vec<_>>(),
                q.amax.iter().map(|a| a.to_bits()).collect::<Vec<_>>()
            );
            // The same bytes as quantizing through the wire entry point.
            assert_eq!(quantize("w", f, r, c, &x).unwrap(), w, "{f}");
        }
        for s in [Scheme::NVFP4_ROW, Scheme::MXFP8_COL] {
            let q = mxrl_formats::quantize(&x, &[r, c], s, Padding::Reject).unwrap();
            let e = from_quantized("w.nope", &q).unwrap_err().to_string();
            assert!(e.contains("w.nope"), "{e}");
        }
        let padded =
            mxrl_formats::quantize(&x[..r * 40], &[r, 40], Scheme::MXFP8_ROW, Padding::Zero)
                .unwrap();
        assert!(from_quantized("p", &padded).is_err());
        let mut bad = quantize("w", Format::Nvfp4, r, c, &x).unwrap();
        bad.amax.clear();
        assert!(to_quantized(&bad)
            .unwrap_err()
            .to_string()
            .contains("tensor w"));
        assert!(to_quantized(&bf16_wire("b", vec![2], &[1.0, 2.0])).is_err());
    }
}
