//! Rounding of GEMM operands to narrower float formats.

use half::bf16;

/// Round one f32 to the nearest BF16 value (ties to even; NaN stays NaN) and widen it back
/// exactly. This is `half::bf16::from_f32`, i.e. the same rounding PyTorch's `.to(bfloat16)` uses.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// [`round_bf16`] applied to every element, into a new vector.
pub fn round_bf16_vec(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| round_bf16(v)).collect()
}

/// [`round_bf16`] applied to every element in place.
pub fn round_bf16_inplace(x: &mut [f32]) {
    for v in x {
        *v = round_bf16(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties to even → 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2⁻⁸ is halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: ties to even → 1 + 2⁻⁶.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(1.0 + 1.5 / 256.0), 1.0 + 1.0 / 128.0);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
    }
}
