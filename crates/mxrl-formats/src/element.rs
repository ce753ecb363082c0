//! Element codecs (contract §1): f32 → E4M3 / E5M2 / E2M1 / UE4M3 / UE8M0 and back.
//!
//! Every encoder is "satfinite": overflow and ±Inf saturate to the largest finite value, never
//! to Inf. The decoders are exact (every code's value is an f32). The rules are named by
//! [`ElementRule`] and [`ScaleRule`](crate::ScaleRule); this module is their one implementation.

/// The rounding rule of one element conversion. Each variant is implemented by exactly one
/// function of this module, named in its doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementRule {
    /// f32 → E4M3 (`e4m3fn`: bias 7, 3 mantissa bits, max 448 = 0x7E, NaN 0x7F/0xFF, no Inf):
    /// round to nearest, ties to even, on the grid k·2⁻⁹ below 2⁻⁶ (subnormals) and 3 mantissa
    /// bits above; |x| ≤ 2⁻¹⁰ → signed zero; |x| ≥ 464 or ±Inf → ±448 (464 is a tie → 448);
    /// NaN → 0x7F; the sign is kept (−0.0 → 0x80). Implemented by [`e4m3_encode`].
    E4m3SatfiniteRne,
    /// f32 → E5M2 (bias 15, 2 mantissa bits, max 57344 = 0x7B, ±Inf 0x7C/0xFC, NaN 0x7D..):
    /// round to nearest, ties to even (subnormals k·2⁻¹⁶); |x| ≥ 61440 or ±Inf → ±57344;
    /// NaN → 0x7F; sign kept. Implemented by [`e5m2_encode`].
    E5m2SatfiniteRne,
    /// f32 → E2M1 nibble (values 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign): on |x|:
    /// ≤0.25→0; <0.75→0.5; ≤1.25→1; <1.75→1.5; ≤2.5→2; <3.5→3; ≤5→4; >5 (incl. Inf)→6, i.e.
    /// nearest, ties to even, saturating; sign kept (−0.0 and −tiny → 0x8); NaN → 0x7.
    /// Implemented by [`e2m1_encode`].
    E2m1SatfiniteRne,
    /// f32 v ≥ 0 → UE4M3 block scale: the E4M3 byte of v (sign bit always 0, codes
    /// 0x00..=0x7E); negative inputs and −0.0 give 0x00, NaN 0x7F. Implemented by
    /// [`ue4m3_encode`].
    Ue4m3SatfiniteRne,
    /// f32 v ≥ 0 → UE8M0 byte, rounding **up** (PTX `cvt.rp.satfinite.ue8m0x2.f32`): the
    /// smallest k with 2^(k−127) ≥ v, clamped to [0, 254]; NaN → 0xFF; +Inf → 0xFE; negative
    /// inputs and −0.0 → 0x00. Bitwise: e = exponent field, m = mantissa: e = 0 → 1 if
    /// m > 0x400000 else 0; m = 0 → e; e = 0xFE → 0xFE; else e + 1.
    /// Implemented by [`ue8m0_round_up`].
    Ue8m0RoundUp,
}

impl ElementRule {
    /// All element rules, in a stable order (part of the contract hash).
    pub const ALL: [ElementRule; 5] = [
        ElementRule::E4m3SatfiniteRne,
        ElementRule::E5m2SatfiniteRne,
        ElementRule::E2m1SatfiniteRne,
        ElementRule::Ue4m3SatfiniteRne,
        ElementRule::Ue8m0RoundUp,
    ];

    /// Stable name used in the contract hash.
    pub fn name(self) -> &'static str {
        match self {
            ElementRule::E4m3SatfiniteRne => "e4m3.satfinite.rne",
            ElementRule::E5m2SatfiniteRne => "e5m2.satfinite.rne",
            ElementRule::E2m1SatfiniteRne => "e2m1.satfinite.rne",
            ElementRule::Ue4m3SatfiniteRne => "ue4m3.satfinite.rne",
            ElementRule::Ue8m0RoundUp => "ue8m0.satfinite.rp",
        }
    }
}

/// Largest finite E4M3 value (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value (code 0x7B).
pub const E5M2_MAX: f32 = 57344.0;
/// Largest E2M1 value (code 0x7).
pub const E2M1_MAX: f32 = 6.0;
/// Canonical E4M3 NaN code produced by [`e4m3_encode`].
pub const E4M3_NAN: u8 = 0x7F;
/// Canonical E5M2 NaN code produced by [`e5m2_encode`].
pub const E5M2_NAN: u8 = 0x7F;
/// E2M1 code produced for NaN input by [`e2m1_encode`] (there is no NaN in E2M1; 0x7 = +6).
pub const E2M1_NAN: u8 = 0x7;
/// UE8M0 NaN code.
pub const UE8M0_NAN: u8 = 0xFF;

#[inline(always)]
fn encode_minifloat(x: f32, man: u32, bias: i32, max_code: u32, nan_code: u8) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return nan_code;
    }
    let min_normal_exp = 1 - bias;
    let e = (abs >> 23) as i32 - 127;
    let code = if e >= min_normal_exp {
        // Round the f32 mantissa to `man` bits (ties to even) in the bit pattern, then re-bias.
        let shift = 23 - man;
        let rounded = abs + ((1u32 << (shift - 1)) - 1) + ((abs >> shift) & 1);
        let rebias = ((127 - bias) as u32) << man;
        ((rounded >> shift) - rebias).min(max_code)
    } else {
        // Subnormal target: value = k · 2^(min_normal_exp − man). Scaling by a power of two
        // is exact here (the product grows), so one RNE rounding to an integer is the rule.
        let scale = f32::from_bits(((man as i32 - min_normal_exp + 127) as u32) << 23);
        (f32::from_bits(abs) * scale).round_ties_even() as u32
    };
    sign | code as u8
}

/// f32 → E4M3 byte, rule [`ElementRule::E4m3SatfiniteRne`].
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    encode_minifloat(x, 3, 7, 0x7E, E4M3_NAN)
}

/// f32 → E5M2 byte, rule [`ElementRule::E5m2SatfiniteRne`].
#[inline]
pub fn e5m2_encode(x: f32) -> u8 {
    encode_minifloat(x, 2, 15, 0x7B, E5M2_NAN)
}

/// f32 v ≥ 0 → UE4M3 block-scale byte, rule [`ElementRule::Ue4m3SatfiniteRne`].
#[inline]
pub fn ue4m3_encode(v: f32) -> u8 {
    if v.is_nan() {
        return E4M3_NAN;
    }
    if v.is_sign_negative() {
        return 0x00;
    }
    e4m3_encode(v)
}

/// f32 → E2M1 nibble (in the low 4 bits), rule [`ElementRule::E2m1SatfiniteRne`].
#[inline]
pub fn e2m1_encode(x: f32) -> u8 {
    if x.is_nan() {
        return E2M1_NAN;
    }
    let sign = if x.is_sign_negative() { 0x8 } else { 0 };
    let a = x.abs();
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | code
}

/// f32 v ≥ 0 → UE8M0 byte rounding up, rule [`ElementRule::Ue8m0RoundUp`].
#[inline]
pub fn ue8m0_round_up(v: f32) -> u8 {
    let bits = v.to_bits();
    if v.is_nan() {
        return UE8M0_NAN;
    }
    if bits & 0x8000_0000 != 0 {
        return 0x00;
    }
    if bits == 0x7F80_0000 {
        return 0xFE;
    }
    let e = bits >> 23;
    let m = bits & 0x7F_FFFF;
    if e == 0 {
        return u8::from(m > 0x40_0000);
    }
    if m == 0 {
        return e as u8;
    }
    if e == 0xFE {
        0xFE
    } else {
        (e + 1) as u8
    }
}

/// UE8M0 byte → f32 2^(b−127): 0xFF → NaN; 0x00 → 2⁻¹²⁷ (bits 0x0040_0000); else bits b<<23.
#[inline]
pub fn ue8m0_decode(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// Exact reciprocal 2^(127−b) of a UE8M0 scale: 0xFF → NaN; 254 → 2⁻¹²⁷ (bits 0x0040_0000);
/// else bits (254−b)<<23.
#[inline]
pub fn ue8m0_reciprocal(b: u8) -> f32 {
    match b {
        0xFF => f32::NAN,
        254 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((254 - b as u32) << 23),
    }
}

/// Exact decode of an 8-bit minifloat to f32 bits (`e4m3`: NaN at S.1111.111, no Inf;
/// otherwise IEEE-like with Inf/NaN at the all-ones exponent).
const fn decode_minifloat_bits(code: u8, exp_bits: u32, man: u32, e4m3fn: bool) -> u32 {
    let sign = ((code as u32) >> 7) << 31;
    let exp_mask = (1u32 << exp_bits) - 1;
    let bias = exp_mask >> 1;
    let e = ((code as u32) >> man) & exp_mask;
    let m = (code as u32) & ((1u32 << man) - 1);
    if e4m3fn {
        if e == exp_mask && m == (1u32 << man) - 1 {
            return 0x7FC0_0000 | sign;
        }
    } else if e == exp_mask {
        return if m == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000
        };
    }
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // m · 2^(1 − bias − man): normalise on the highest set bit p of m.
        let mut p = man - 1;
        while (m >> p) & 1 == 0 {
            p -= 1;
        }
        let f32_exp = (p as i32 + 1 - bias as i32 - man as i32 + 127) as u32;
        let frac = (m - (1u32 << p)) << (23 - p);
        return sign | (f32_exp << 23) | frac;
    }
    sign | ((e + 127 - bias) << 23) | (m << (23 - man))
}

const fn table_bits(exp_bits: u32, man: u32, e4m3fn: bool) -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_minifloat_bits(i as u8, exp_bits, man, e4m3fn);
        i += 1;
    }
    t
}

const E4M3_BITS: [u32; 256] = table_bits(4, 3, true);
const E5M2_BITS: [u32; 256] = table_bits(5, 2, false);

const fn to_f32_table(bits: [u32; 256]) -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = f32::from_bits(bits[i]);
        i += 1;
    }
    t
}

/// Value of every E4M3 code (`E4M3_VALUES[code]`); 0x7F and 0xFF are NaN.
pub static E4M3_VALUES: [f32; 256] = to_f32_table(E4M3_BITS);
/// Value of every E5M2 code; 0x7C/0xFC are ±Inf, 0x7D..0x7F / 0xFD..0xFF NaN.
pub static E5M2_VALUES: [f32; 256] = to_f32_table(E5M2_BITS);
/// Value of every E2M1 nibble (bit 3 = sign; 0x8 is −0.0).
pub static E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E4M3 byte → f32 (exact; table lookup).
#[inline]
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3_VALUES[code as usize]
}

/// E5M2 byte → f32 (exact; table lookup).
#[inline]
pub fn e5m2_decode(code: u8) -> f32 {
    E5M2_VALUES[code as usize]
}

/// E2M1 nibble (low 4 bits of `code`; higher bits ignored) → f32.
#[inline]
pub fn e2m1_decode(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_tables_spot_values() {
        assert_eq!(e4m3_decode(0x7E), 448.0);
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert_eq!(e4m3_decode(0x78), 256.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert!(e4m3_decode(0x7F).is_nan() && e4m3_decode(0xFF).is_nan());
        assert_eq!(e4m3_decode(0x80).to_bits(), 0x8000_0000);
        assert_eq!(e5m2_decode(0x7B), 57344.0);
        assert_eq!(e5m2_decode(0x01), 2f32.powi(-16));
        assert_eq!(e5m2_decode(0x7C), f32::INFINITY);
        assert_eq!(ue8m0_decode(127), 1.0);
        assert_eq!(ue8m0_reciprocal(0), 2f32.powi(127));
    }
}
