//! Element codecs against an independent oracle, exhaustively on small domains:
//! - every code of each 8-bit format and every E2M1 nibble decode→encode round-trips;
//! - every one of the 65,536 BF16 bit patterns goes through each encoder and is compared with
//!   an oracle that enumerates the representable values and picks the nearest (ties to the
//!   even code, i.e. mantissa LSB 0), saturating to the largest finite value.
//!
//! The oracle shares no code with the encoders: its value grids are built here from the
//! format definitions (sign, exponent, mantissa fields), and distances are compared in f64.
//! Exactness of the f64 comparison: a BF16 value has 8 significant bits and every grid value
//! at most 4, all within 2^-149..2^128. When two candidates are close enough for the
//! comparison to matter (neighbours around x), x and both candidates lie within a few binades
//! of each other, so |x − g| needs fewer than 53 bits and is computed exactly; a far candidate
//! can at worst be rounded, but it is farther by at least one grid step, far more than the
//! rounding error of ≤ 2^-53 relative.

use mxrl_formats::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e5m2_decode, e5m2_encode, ue4m3_encode,
    ue8m0_decode, ue8m0_reciprocal, ue8m0_round_up,
};

/// Finite, non-negative values of a sign-less minifloat grid: `(code, value)` for every code
/// with sign bit 0, built from the field definitions.
fn grid(
    exp_bits: u32,
    man_bits: u32,
    bias: i32,
    is_finite: impl Fn(u32, u32) -> bool,
) -> Vec<(u8, f64)> {
    let mut v = Vec::new();
    for e in 0..(1u32 << exp_bits) {
        for m in 0..(1u32 << man_bits) {
            if !is_finite(e, m) {
                continue;
            }
            let frac = m as f64 / (1u32 << man_bits) as f64;
            let value = if e == 0 {
                frac * 2f64.powi(1 - bias)
            } else {
                (1.0 + frac) * 2f64.powi(e as i32 - bias)
            };
            v.push((((e << man_bits) | m) as u8, value));
        }
    }
    v
}

fn e4m3_grid() -> Vec<(u8, f64)> {
    // e4m3fn: exponent 15 with mantissa 7 is NaN; no Inf.
    grid(4, 3, 7, |e, m| !(e == 15 && m == 7))
}

fn e5m2_grid() -> Vec<(u8, f64)> {
    // IEEE-like: exponent 31 is Inf/NaN.
    grid(5, 2, 15, |e, _| e != 31)
}

fn e2m1_grid() -> Vec<(u8, f64)> {
    grid(2, 1, 1, |_, _| true)
}

/// Nearest grid value to |x| (ties to the even code), saturating; sign bit `sign_bit` kept.
fn oracle(x: f32, grid: &[(u8, f64)], sign_bit: u8, nan_code: u8) -> u8 {
    if x.is_nan() {
        return nan_code;
    }
    let a = (x as f64).abs();
    let mut best = grid[0];
    let mut best_d = f64::INFINITY;
    for &(c, g) in grid {
        let d = if a.is_infinite() {
            f64::INFINITY
        } else {
            (a - g).abs()
        };
        let better = d < best_d || (d == best_d && c & 1 == 0 && best.0 & 1 == 1);
        if better {
            best = (c, g);
            best_d = d;
        }
    }
    if a.is_infinite() || a > grid.iter().map(|g| g.1).fold(0.0, f64::max) {
        best = *grid.iter().max_by(|p, q| p.1.total_cmp(&q.1)).unwrap();
    }
    let sign = if x.is_sign_negative() { sign_bit } else { 0 };
    best.0 | sign
}

fn all_bf16() -> impl Iterator<Item = f32> {
    (0..=u16::MAX).map(|b| f32::from_bits((b as u32) << 16))
}

#[test]
fn every_e4m3_code_round_trips() {
    for c in 0..=255u8 {
        let v = e4m3_decode(c);
        if c & 0x7F == 0x7F {
            assert!(v.is_nan(), "{c:#04x} must be NaN");
            assert_eq!(e4m3_encode(v), 0x7F, "NaN encodes to the canonical 0x7F");
        } else {
            assert_eq!(e4m3_encode(v), c, "code {c:#04x} value {v}");
        }
    }
}

#[test]
fn every_e5m2_code_round_trips() {
    for c in 0..=255u8 {
        let v = e5m2_decode(c);
        match c & 0x7F {
            0x7C => {
                assert!(v.is_infinite(), "{c:#04x} is ±Inf");
                // satfinite: Inf saturates to ±57344.
                assert_eq!(e5m2_encode(v), (c & 0x80) | 0x7B);
            }
            0x7D..=0x7F => {
                assert!(v.is_nan(), "{c:#04x} is NaN");
                assert_eq!(e5m2_encode(v), 0x7F);
            }
            _ => assert_eq!(e5m2_encode(v), c, "code {c:#04x} value {v}"),
        }
    }
}

#[test]
fn every_ue4m3_code_round_trips() {
    for c in 0..=0x7Eu8 {
        assert_eq!(ue4m3_encode(e4m3_decode(c)), c, "code {c:#04x}");
    }
    assert_eq!(ue4m3_encode(f32::NAN), 0x7F);
}

#[test]
fn every_ue8m0_code_round_trips_and_reciprocal_is_exact() {
    for b in 0..=255u8 {
        let v = ue8m0_decode(b);
        if b == 0xFF {
            assert!(v.is_nan() && ue8m0_reciprocal(b).is_nan());
            assert_eq!(ue8m0_round_up(v), 0xFF);
            continue;
        }
        assert_eq!(v as f64, 2f64.powi(b as i32 - 127), "decode {b}");
        assert_eq!(ue8m0_round_up(v), b, "round trip {b}");
        let r = ue8m0_reciprocal(b);
        if b == 0 {
            // 2^127 · 2^-127 = 1 exactly.
            assert_eq!(r as f64, 2f64.powi(127));
        } else if b == 254 {
            // 1/2^127 = 2^-127 (bits 0x00400000), the contract's special case.
            assert_eq!(r.to_bits(), 0x0040_0000);
        } else {
            assert_eq!(r as f64 * v as f64, 1.0, "reciprocal of {b}");
        }
    }
}

#[test]
fn every_e2m1_code_round_trips() {
    for c in 0..16u8 {
        assert_eq!(e2m1_encode(e2m1_decode(c)), c, "nibble {c:#x}");
    }
}

#[test]
fn e4m3_matches_oracle_on_all_bf16() {
    let g = e4m3_grid();
    assert_eq!(g.len(), 127);
    for x in all_bf16() {
        assert_eq!(
            e4m3_encode(x),
            oracle(x, &g, 0x80, 0x7F),
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}

#[test]
fn e5m2_matches_oracle_on_all_bf16() {
    let g = e5m2_grid();
    assert_eq!(g.len(), 124);
    for x in all_bf16() {
        assert_eq!(
            e5m2_encode(x),
            oracle(x, &g, 0x80, 0x7F),
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}

#[test]
fn e2m1_matches_oracle_on_all_bf16() {
    let g = e2m1_grid();
    assert_eq!(
        g.iter().map(|p| p.1).collect::<Vec<_>>(),
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    );
    for x in all_bf16() {
        assert_eq!(
            e2m1_encode(x),
            oracle(x, &g, 0x8, 0x7),
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}

#[test]
fn ue4m3_matches_oracle_on_all_bf16() {
    let g = e4m3_grid();
    for x in all_bf16() {
        // UE4M3 of a non-negative value is its E4M3 byte; negative inputs (and −0) clamp to 0.
        let want = if x.is_nan() {
            0x7F
        } else if x.is_sign_negative() {
            0x00
        } else {
            oracle(x, &g, 0x80, 0x7F)
        };
        assert_eq!(ue4m3_encode(x), want, "x = {x:e}");
    }
}

#[test]
fn ue8m0_round_up_matches_oracle_on_all_bf16() {
    // Oracle: the smallest k in [0, 254] with 2^(k−127) ≥ v, found by enumeration in f64
    // (every power of two involved is exact in f64), clamped to 254; NaN → 0xFF; v ≤ 0 → 0.
    for x in all_bf16() {
        let want = if x.is_nan() {
            0xFF
        } else if x <= 0.0 {
            0x00
        } else {
            (0..=254u8)
                .find(|&k| 2f64.powi(k as i32 - 127) >= x as f64)
                .unwrap_or(254)
        };
        assert_eq!(ue8m0_round_up(x), want, "v = {x:e} ({:#010x})", x.to_bits());
    }
}
