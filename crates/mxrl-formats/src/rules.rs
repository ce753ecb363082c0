//! The scalar scale rules (one implementation each, shared by the reference and fast paths).

use crate::element::{e4m3_decode, ue4m3_encode, ue8m0_reciprocal, ue8m0_round_up};
use crate::scheme::{ScaleRule, NVFP4_GLOBAL_NUMERATOR, R448, R6};

/// `max|x|` ignoring NaN, starting at +0 (contract notation).
#[inline]
pub fn amax_of(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut a = 0.0f32;
    for v in values {
        let m = v.abs();
        if m > a {
            a = m;
        }
    }
    a
}

/// MXFP8 block scale, rule [`ScaleRule::Ue8m0RoundUp`]: returns `(scale byte, inv)` with
/// `scale = ue8m0_round_up(fl(amax × R448))` and `inv = ue8m0_reciprocal(scale)`.
#[inline]
pub fn mxfp8_scale(amax: f32) -> (u8, f32) {
    let scale = ue8m0_round_up(amax * R448);
    (scale, ue8m0_reciprocal(scale))
}

/// The NVFP4 second-level (global) scale of one tensor or row, rule
/// [`ScaleRule::E4m3TwoLevel`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Nvfp4Global {
    /// The FP32 amax it was computed from (stored with the tensor).
    pub amax: f32,
    /// `S = fl(2688 / amax)`, clamped to f32::MAX, 1 if amax == 0 or S == 0.
    pub s_enc: f32,
    /// `S_dec = fl(1 / S)`.
    pub s_dec: f32,
    /// `mult = fl(S × R6)`.
    pub mult: f32,
}

impl Nvfp4Global {
    /// Steps 2–3 of contract §3.
    #[inline]
    pub fn from_amax(amax: f32) -> Self {
        let mut s = (NVFP4_GLOBAL_NUMERATOR / amax).min(f32::MAX);
        if amax == 0.0 || s == 0.0 {
            s = 1.0;
        }
        Nvfp4Global {
            amax,
            s_enc: s,
            s_dec: 1.0 / s,
            mult: s * R6,
        }
    }

    /// Step 4 of contract §3 for one block with maximum `bmax`: returns
    /// `(scale byte, enc)` with `scale = ue4m3(min(fl(bmax × mult), MAX))`,
    /// `enc = min(fl(1 / fl(sf × S_dec)), MAX)`.
    #[inline]
    pub fn block(&self, bmax: f32) -> (u8, f32) {
        let sdec = (bmax * self.mult).min(f32::MAX);
        let scale = ue4m3_encode(sdec);
        let sf = e4m3_decode(scale);
        let enc = (1.0 / (sf * self.s_dec)).min(f32::MAX);
        (scale, enc)
    }

    /// The dequantization multiplier of a block with scale byte `scale`:
    /// `fl(fl(sf × amax) × R2688)`.
    #[inline]
    pub fn dequant_multiplier(amax: f32, scale: u8) -> f32 {
        (e4m3_decode(scale) * amax) * crate::scheme::R2688
    }
}

/// FP8-block scale of one block: returns `(scale, scale_inv)`, rule [`ScaleRule::F32Exact`]
/// or [`ScaleRule::F32PowerOfTwo`] (see their docs for the formula).
///
/// # Panics
/// If `rule` is not one of the two FP32 rules (a broken invariant of the caller).
#[inline]
pub fn fp8_block_scale(amax: f32, rule: ScaleRule) -> (f32, f32) {
    let mut scale = if amax == 0.0 || amax.is_infinite() {
        1.0
    } else {
        let s = crate::element::E4M3_MAX / amax;
        if s.is_infinite() {
            f32::MAX
        } else {
            s
        }
    };
    match rule {
        ScaleRule::F32Exact => {}
        ScaleRule::F32PowerOfTwo => scale = f32::from_bits(scale.to_bits() & 0xFF80_0000),
        other => panic!("fp8_block_scale called with non-FP32 rule {other:?}"),
    }
    (scale, 1.0 / scale)
}
