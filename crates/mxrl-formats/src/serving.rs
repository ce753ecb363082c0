//! The dequantization formulas of serving checkpoints, and the one lossless conversion between
//! stored formats (FP8-block with power-of-two scales → MXFP8).
//!
//! A serving container (`mxrl-ckpt`'s container module) stores an NVFP4 weight's FP32
//! second-level factor in its consumer's own form — not the contract's amax — and that consumer
//! applies it with its own order of operations. [`Nvfp4SecondLevel`] names each form with its
//! formula; [`dequantize_nvfp4`] applies one. These formulas are not part of the quantizer
//! contract (they never decide a quantized byte), so they are not in [`crate::contract_params`].

use crate::element::{e2m1_decode, e4m3_decode, ue8m0_decode};
use crate::rules::Nvfp4Global;
use crate::scheme::{Fp8Blocks, ScaleLayout, Scheme, FP8_BLOCK, MXFP8_BLOCK, NVFP4_BLOCK};
use crate::tensor::{QuantizedTensor, Scales};
use crate::FormatError;

/// How an NVFP4 tensor's FP32 second-level factor is stored, and the formula that turns an
/// E2M1 code `c`, its block's E4M3 scale byte (value `sf`) and that stored value into the
/// dequantized element. `e2m1(c) × sf` is exact (≤ 2 × ≤ 4 significant bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Nvfp4SecondLevel {
    /// The contract (TransformerEngine): the FP32 `amax` is stored;
    /// `x̂ = fl(e2m1(c) × fl(fl(sf × amax) × R2688))` (contract §3).
    Amax,
    /// NVIDIA ModelOpt / TensorRT-LLM `weight_scale_2`: `S_dec = fl(1 / S)` is stored;
    /// `x̂ = fl(fl(e2m1(c) × sf) × S_dec)`.
    DecodeScale,
    /// compressed-tensors `weight_global_scale`: `S = fl(2688 / amax)` is stored;
    /// `x̂ = fl(e2m1(c) × fl(sf / S))` (the order of its decompressor).
    EncodeScale,
}

impl Nvfp4SecondLevel {
    /// The value stored for a tensor quantized with `amax`: `amax`, `S_dec` or `S` of
    /// [`Nvfp4Global::from_amax`].
    pub fn stored_value(self, amax: f32) -> f32 {
        let g = Nvfp4Global::from_amax(amax);
        match self {
            Nvfp4SecondLevel::Amax => amax,
            Nvfp4SecondLevel::DecodeScale => g.s_dec,
            Nvfp4SecondLevel::EncodeScale => g.s_enc,
        }
    }

    /// One element: E2M1 `code` (low nibble), E4M3 block `scale` byte, the `stored` value
    /// (see the variant's formula).
    #[inline]
    pub fn dequantize(self, code: u8, scale: u8, stored: f32) -> f32 {
        let v = e2m1_decode(code);
        let sf = e4m3_decode(scale);
        match self {
            Nvfp4SecondLevel::Amax => v * Nvfp4Global::dequant_multiplier(stored, scale),
            Nvfp4SecondLevel::DecodeScale => (v * sf) * stored,
            Nvfp4SecondLevel::EncodeScale => v * (sf / stored),
        }
    }
}

/// The exact product `e2m1(code) × e4m3(scale)`: an NVFP4 element with its block scale applied
/// and the second-level factor not yet (what an emulated GEMM multiplies before applying the
/// per-tensor or per-row factor after the sum).
#[inline]
pub fn nvfp4_block_product(code: u8, scale: u8) -> f32 {
    e2m1_decode(code) * e4m3_decode(scale)
}

/// Dequantizes one NVFP4 matrix `[rows, k]` with one second-level value per tensor: `data`
/// packed E2M1 `[rows, k/2]` (low nibble first), `scales` compact E4M3 `[rows, k/16]`,
/// `stored` in the form `form` (see [`Nvfp4SecondLevel`]). Returns f32 `[rows, k]`.
///
/// # Errors
/// `k` not a multiple of 16, or buffer lengths that do not match the shape.
pub fn dequantize_nvfp4(
    data: &[u8],
    scales: &[u8],
    rows: usize,
    k: usize,
    form: Nvfp4SecondLevel,
    stored: f32,
) -> Result<Vec<f32>, FormatError> {
    if !k.is_multiple_of(NVFP4_BLOCK) {
        return Err(FormatError::NotMultiple {
            scheme: Scheme::NVFP4_TENSOR.name(),
            dim: "K",
            size: k,
            block: NVFP4_BLOCK,
            shape: vec![rows, k],
        });
    }
    let kb = k / NVFP4_BLOCK;
    for (what, got, expected, shape) in [
        ("data", data.len(), rows * k / 2, vec![rows, k / 2]),
        ("scales", scales.len(), rows * kb, vec![rows, kb]),
    ] {
        if got != expected {
            return Err(FormatError::LengthMismatch {
                what,
                shape,
                expected,
                got,
            });
        }
    }
    let mut out = Vec::with_capacity(rows * k);
    for i in 0..rows {
        for j in 0..k {
            let byte = data[i * (k / 2) + j / 2];
            let code = (byte >> (4 * (j % 2))) & 0xF;
            out.push(form.dequantize(code, scales[i * kb + j / NVFP4_BLOCK], stored));
        }
    }
    Ok(out)
}

/// The UE8M0 byte `b` with `ue8m0_decode(b) == v`, if `v` is a positive normal power of two
/// (2⁻¹²⁶ … 2¹²⁷, bytes 1..=254); `None` otherwise.
#[inline]
pub fn ue8m0_exact(v: f32) -> Option<u8> {
    let b = v.to_bits();
    let e = b >> 23;
    (b & 0x807F_FFFF == 0 && (1..=254).contains(&e)).then(|| {
        let byte = e as u8;
        debug_assert_eq!(ue8m0_decode(byte).to_bits(), b);
        byte
    })
}

/// Whether every scale of an FP8-block tensor is a UE8M0 value ([`ue8m0_exact`]), so that
/// [`fp8_block_to_mxfp8`] can re-pack it losslessly.
pub fn fp8_block_scales_are_ue8m0(scale_inv: &[f32]) -> bool {
    scale_inv.iter().all(|&s| ue8m0_exact(s).is_some())
}

/// Re-packs a 2-D FP8-block weight (128×128 tiles) whose every `scale_inv` is a power of two
/// as row-wise MXFP8 `[N, K]`, losslessly: the E4M3 bytes are kept and each 1×32 block takes
/// its 128×128 tile's scale as the UE8M0 byte [`ue8m0_exact`]. Both dequantize to the same
/// values: `fl(e4m3(q) × scale_inv) = fl(ue8m0(b) × e4m3(q))` with `ue8m0(b) = scale_inv`.
///
/// # Errors
/// Another scheme, a 3-D tensor, K not a multiple of 32, or a scale that is not a UE8M0 value
/// (naming its tile).
pub fn fp8_block_to_mxfp8(q: &QuantizedTensor) -> Result<QuantizedTensor, FormatError> {
    let Scheme::Fp8Block(s) = q.scheme else {
        return Err(FormatError::Unsupported(format!(
            "{}: only FP8-block tensors re-pack as MXFP8",
            q.scheme
        )));
    };
    if s.blocks != Fp8Blocks::Weight128x128 {
        return Err(FormatError::Unsupported(format!(
            "{}: only 128×128 weight tiles re-pack as MXFP8",
            q.scheme
        )));
    }
    q.validate()?;
    let (&[n, k], &[_, kp]) = (q.shape.as_slice(), q.padded_shape.as_slice()) else {
        return Err(FormatError::BadRank {
            shape: q.shape.clone(),
        });
    };
    if !k.is_multiple_of(MXFP8_BLOCK) {
        return Err(FormatError::NotMultiple {
            scheme: Scheme::MXFP8_ROW.name(),
            dim: "K",
            size: k,
            block: MXFP8_BLOCK,
            shape: q.shape.clone(),
        });
    }
    let scale_inv = q
        .scales
        .as_f32()
        .expect("validated FP8-block scales are f32");
    let tk = kp / FP8_BLOCK;
    let mut scales = Vec::with_capacity(n * k / MXFP8_BLOCK);
    for i in 0..n {
        for jb in 0..k / MXFP8_BLOCK {
            let (ti, tj) = (i / FP8_BLOCK, jb * MXFP8_BLOCK / FP8_BLOCK);
            let v = scale_inv[ti * tk + tj];
            scales.push(ue8m0_exact(v).ok_or_else(|| {
                FormatError::Unsupported(format!(
                    "FP8-block scale_inv[{ti}][{tj}] = {v:e} (0x{:08X}) is not a power of two in UE8M0 range; the tensor cannot be re-packed as MXFP8",
                    v.to_bits()
                ))
            })?);
        }
    }
    let mut data = Vec::with_capacity(n * k);
    for i in 0..n {
        data.extend_from_slice(&q.data[i * kp..i * kp + k]);
    }
    let out = QuantizedTensor {
        scheme: Scheme::MXFP8_ROW,
        shape: vec![n, k],
        padded_shape: vec![n, k],
        data,
        scales: Scales::Bytes(scales),
        scale_layout: ScaleLayout::Compact,
        amax: Vec::new(),
    };
    out.validate()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::E2M1_VALUES;
    use crate::{quantize, Padding};

    /// The three forms dequantize by their own formulas, written out here independently:
    /// every (code, scale) pair against one amax and its S / S_dec.
    #[test]
    fn each_second_level_form_applies_its_formula() {
        let amax = 5.75f32;
        let s = 2688.0f32 / amax;
        let s_dec = 1.0f32 / s;
        assert_eq!(Nvfp4SecondLevel::EncodeScale.stored_value(amax), s);
        assert_eq!(Nvfp4SecondLevel::DecodeScale.stored_value(amax), s_dec);
        assert_eq!(Nvfp4SecondLevel::Amax.stored_value(amax), amax);
        let r2688 = 1.0f32 / 2688.0;
        for code in 0..16u8 {
            let v = E2M1_VALUES[code as usize];
            for scale in 0..0x7Fu8 {
                let sf = crate::E4M3_VALUES[scale as usize];
                let te = Nvfp4SecondLevel::Amax.dequantize(code, scale, amax);
                let mo = Nvfp4SecondLevel::DecodeScale.dequantize(code, scale, s_dec);
                let ct = Nvfp4SecondLevel::EncodeScale.dequantize(code, scale, s);
                assert_eq!(te.to_bits(), (v * ((sf * amax) * r2688)).to_bits());
                assert_eq!(mo.to_bits(), ((v * sf) * s_dec).to_bits());
                assert_eq!(ct.to_bits(), (v * (sf / s)).to_bits());
                assert_eq!(
                    nvfp4_block_product(code, scale).to_bits(),
                    (v * sf).to_bits()
                );
            }
        }
    }

    /// A tensor dequantized in the contract form equals `QuantizedTensor::dequantize`.
    #[test]
    fn amax_form_equals_the_contract_dequantizer() {
        let x: Vec<f32> = (0..4 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let q = quantize(&x, &[4, 64], Scheme::NVFP4_TENSOR, Padding::Reject).unwrap();
        let scales = q.scales.as_bytes().unwrap();
        let got =
            dequantize_nvfp4(&q.data, scales, 4, 64, Nvfp4SecondLevel::Amax, q.amax[0]).unwrap();
        let want = q.dequantize().unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let e = dequantize_nvfp4(&q.data, &scales[1..], 4, 64, Nvfp4SecondLevel::Amax, 1.0)
            .unwrap_err();
        assert!(
            matches!(e, FormatError::LengthMismatch { what: "scales", .. }),
            "{e}"
        );
    }

    #[test]
    fn ue8m0_exact_accepts_exactly_the_normal_powers_of_two() {
        assert_eq!(ue8m0_exact(1.0), Some(127));
        assert_eq!(ue8m0_exact(2f32.powi(-126)), Some(1));
        assert_eq!(ue8m0_exact(2f32.powi(127)), Some(254));
        for bad in [
            0.0,
            -1.0,
            1.5,
            3.0,
            f32::INFINITY,
            f32::NAN,
            2f32.powi(-127),
        ] {
            assert_eq!(ue8m0_exact(bad), None, "{bad:e}");
        }
    }

    /// A re-packed tensor dequantizes to the FP8-block tensor's values, bit for bit, also with
    /// N and K that are not multiples of 128 (padded tiles).
    #[test]
    fn fp8_block_repack_keeps_every_value() {
        let (n, k) = (200, 160);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 2f32.powi(-((i / k) as i32 % 9)))
            .collect();
        let pow2 = Scheme::Fp8Block(crate::Fp8BlockScheme {
            blocks: Fp8Blocks::Weight128x128,
            scale_rule: crate::ScaleRule::F32PowerOfTwo,
        });
        let q = quantize(&x, &[n, k], pow2, Padding::Zero).unwrap();
        let m = fp8_block_to_mxfp8(&q).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(m.dequantize().unwrap()), bits(q.dequantize().unwrap()));
        // Exact FP32 scales (448 / tile amax) here are not powers of two: refused, naming the tile.
        let q = quantize(&x, &[n, k], Scheme::FP8_BLOCK_WEIGHT, Padding::Zero).unwrap();
        assert!(!fp8_block_scales_are_ue8m0(q.scales.as_f32().unwrap()));
        let e = fp8_block_to_mxfp8(&q).unwrap_err().to_string();
        assert!(e.contains("scale_inv[0][0]"), "{e}");
    }
}
