//! The named corner-case table that every quantizer path runs (reference, fast CPU, CUDA):
//! zeros, −0.0, NaN, ±Inf, f32 subnormal inputs, tiny blocks, the 448/449/464 boundaries,
//! E2M1 midpoints, E4M3 subnormal results, f32::MAX, rows of wildly different magnitude.
//!
//! [`ELEMENT_CASES`] carries expected bytes derived by hand from the contract text (§1);
//! [`tensor_cases`] are inputs whose outputs every path must produce byte-identically to
//! [`crate::reference`].

/// One element-level corner case with the expected byte of every encoder (contract §1).
#[derive(Debug, Clone, Copy)]
pub struct ElementCase {
    /// What the case exercises.
    pub name: &'static str,
    /// The f32 input.
    pub x: f32,
    /// Expected [`crate::e4m3_encode`].
    pub e4m3: u8,
    /// Expected [`crate::e5m2_encode`].
    pub e5m2: u8,
    /// Expected [`crate::e2m1_encode`] nibble.
    pub e2m1: u8,
    /// Expected [`crate::ue8m0_round_up`].
    pub ue8m0: u8,
}

const fn c(name: &'static str, x: f32, e4m3: u8, e5m2: u8, e2m1: u8, ue8m0: u8) -> ElementCase {
    ElementCase {
        name,
        x,
        e4m3,
        e5m2,
        e2m1,
        ue8m0,
    }
}

/// 2^e as an f32 (const helper for normal exponents).
const fn p2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Element corner cases. Columns: E4M3 (bias 7, RNE, satfinite 448), E5M2 (bias 15,
/// satfinite 57344), E2M1 nibble, UE8M0 round-up (negative → 0).
pub const ELEMENT_CASES: &[ElementCase] = &[
    c("+0", 0.0, 0x00, 0x00, 0x0, 0x00),
    c("-0 keeps its sign", -0.0, 0x80, 0x80, 0x8, 0x00),
    c("NaN", f32::NAN, 0x7F, 0x7F, 0x7, 0xFF),
    c("+Inf saturates", f32::INFINITY, 0x7E, 0x7B, 0x7, 0xFE),
    c("-Inf saturates", f32::NEG_INFINITY, 0xFE, 0xFB, 0xF, 0x00),
    c("f32::MAX", f32::MAX, 0x7E, 0x7B, 0x7, 0xFE),
    c("-f32::MAX", -f32::MAX, 0xFE, 0xFB, 0xF, 0x00),
    c("2^127 exact power", p2(127), 0x7E, 0x7B, 0x7, 0xFE),
    c("448 = E4M3 max", 448.0, 0x7E, 0x5F, 0x7, 0x88),
    c("449 rounds to 448", 449.0, 0x7E, 0x5F, 0x7, 0x88),
    c("464 is a tie -> 448", 464.0, 0x7E, 0x5F, 0x7, 0x88),
    c("465 saturates", 465.0, 0x7E, 0x5F, 0x7, 0x88),
    c("-449", -449.0, 0xFE, 0xDF, 0xF, 0x00),
    c("57344 = E5M2 max", 57344.0, 0x7E, 0x7B, 0x7, 0x8F),
    c(
        "61440 is an E5M2 tie -> saturate",
        61440.0,
        0x7E,
        0x7B,
        0x7,
        0x8F,
    ),
    c("2^-10: E4M3 tie -> 0", p2(-10), 0x00, 0x14, 0x0, 0x75),
    c("-2^-10: E4M3 -> -0", -p2(-10), 0x80, 0x94, 0x8, 0x00),
    c(
        "1.5*2^-10 rounds up to 2^-9",
        1.5 * p2(-10),
        0x01,
        0x16,
        0x0,
        0x76,
    ),
    c(
        "2^-9: smallest E4M3 subnormal",
        p2(-9),
        0x01,
        0x18,
        0x0,
        0x76,
    ),
    c(
        "6.5*2^-9: subnormal tie -> even 6",
        6.5 * p2(-9),
        0x06,
        0x22,
        0x0,
        0x79,
    ),
    c(
        "7.5*2^-9: tie -> 8 = min normal",
        7.5 * p2(-9),
        0x08,
        0x24,
        0x0,
        0x79,
    ),
    c("2^-6: smallest E4M3 normal", p2(-6), 0x08, 0x24, 0x0, 0x79),
    c(
        "2^-16: smallest E5M2 subnormal",
        p2(-16),
        0x00,
        0x01,
        0x0,
        0x6F,
    ),
    c(
        "f32 subnormal 2^-140",
        p2(-126) * p2(-14),
        0x00,
        0x00,
        0x0,
        0x00,
    ),
    c(
        "2^-127 (bits 0x00400000) -> ue8m0 0",
        f32::from_bits(0x0040_0000),
        0x00,
        0x00,
        0x0,
        0x00,
    ),
    c(
        "just above 2^-127 -> ue8m0 1",
        f32::from_bits(0x0040_0001),
        0x00,
        0x00,
        0x0,
        0x01,
    ),
    c(
        "2^-126 min normal -> ue8m0 1",
        f32::from_bits(0x0080_0000),
        0x00,
        0x00,
        0x0,
        0x01,
    ),
    c("E2M1 midpoint 0.25 -> 0", 0.25, 0x28, 0x34, 0x0, 0x7D),
    c("E2M1 midpoint 0.75 -> 1", 0.75, 0x34, 0x3A, 0x2, 0x7F),
    c("E2M1 midpoint 1.25 -> 1", 1.25, 0x3A, 0x3D, 0x2, 0x80),
    c("E2M1 midpoint 1.75 -> 2", 1.75, 0x3E, 0x3F, 0x4, 0x80),
    c("E2M1 midpoint 2.5 -> 2", 2.5, 0x42, 0x41, 0x4, 0x81),
    c("E2M1 midpoint 3.5 -> 4", 3.5, 0x46, 0x43, 0x6, 0x81),
    c("E2M1 midpoint 5 -> 4", 5.0, 0x4A, 0x45, 0x6, 0x82),
    c("-5 -> -4", -5.0, 0xCA, 0xC5, 0xE, 0x00),
    c("just above 5 -> 6", 5.000_000_5, 0x4A, 0x45, 0x7, 0x82),
    c(
        "just below 0.75 -> 0.5",
        0.749_999_94,
        0x34,
        0x3A,
        0x1,
        0x7F,
    ),
    c("1.0", 1.0, 0x38, 0x3C, 0x2, 0x7F),
];

/// A named high-precision input for the tensor-level corner table.
#[derive(Debug, Clone)]
pub struct TensorCase {
    /// What the case exercises.
    pub name: &'static str,
    /// `[M, K]`.
    pub shape: [usize; 2],
    /// Row-major values.
    pub values: Vec<f32>,
}

/// Deterministic background values in (−1, 1) (a fixed xorshift; no RNG dependency).
fn background(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// The tensor-level corner cases. Every path runs every case with every
/// [`ALL_SCHEMES`](crate::ALL_SCHEMES) entry under [`Padding::Zero`](crate::Padding::Zero)
/// (so shapes that are not block multiples are included too) and must match the reference
/// byte for byte.
pub fn tensor_cases() -> Vec<TensorCase> {
    let mut v = Vec::new();
    let (m, k) = (32, 64);
    let n = m * k;
    v.push(TensorCase {
        name: "zeros",
        shape: [m, k],
        values: vec![0.0; n],
    });
    v.push(TensorCase {
        name: "negative_zeros",
        shape: [m, k],
        values: vec![-0.0; n],
    });

    let mut x = background(n, 1);
    for i in (0..n).step_by(37) {
        x[i] = f32::NAN;
    }
    x[64..96].fill(f32::NAN); // a whole MXFP8 block (row 1, cols 0..32) of NaN
    v.push(TensorCase {
        name: "nan_elements",
        shape: [m, k],
        values: x,
    });

    let mut x = background(n, 2);
    for (j, i) in (5..n).step_by(53).enumerate() {
        x[i] = if j % 2 == 0 {
            f32::INFINITY
        } else {
            f32::NEG_INFINITY
        };
    }
    v.push(TensorCase {
        name: "inf_elements",
        shape: [m, k],
        values: x,
    });

    let x: Vec<f32> = background(n, 3)
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (i / 16) % 3 == 0 {
                b * 1.0
            } else {
                b * f32::from_bits(0x0000_4000)
            }
        })
        .collect();
    v.push(TensorCase {
        name: "f32_subnormal_inputs",
        shape: [m, k],
        values: x,
    });

    let x: Vec<f32> = background(n, 4)
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (i / 16) % 4 == 0 {
                b * 1e3
            } else {
                b * 1e-30
            }
        })
        .collect();
    v.push(TensorCase {
        name: "tiny_blocks",
        shape: [m, k],
        values: x,
    });

    let pattern = [
        448.0f32, 449.0, 464.0, 465.0, 480.0, -448.0, -449.0, 447.0, 1.0, -0.0, 0.5, 224.5,
    ];
    let x: Vec<f32> = (0..n)
        .map(|i| {
            let p = pattern[i % pattern.len()];
            // Some blocks are scaled so the boundaries fall on the scaled grid of MX and NV.
            if (i / 32) % 2 == 0 {
                p
            } else {
                p / 448.0 * 6.0
            }
        })
        .collect();
    v.push(TensorCase {
        name: "boundary_448_449",
        shape: [m, k],
        values: x,
    });

    let mids = [
        0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
        -5.0, -6.0,
    ];
    let x: Vec<f32> = (0..n)
        .map(|i| mids[i % 16] * if (i / 16) % 2 == 0 { 1.0 } else { 0.5 })
        .collect();
    v.push(TensorCase {
        name: "e2m1_midpoints",
        shape: [m, k],
        values: x,
    });

    // Block max 448 with the rest spread over 2^-16..2^-5 so x·inv lands on E4M3 subnormals.
    let x: Vec<f32> = (0..n)
        .map(|i| {
            if i % 32 == 0 {
                448.0
            } else {
                p2(-16 + (i % 12) as i32) * (1.0 + (i % 7) as f32 / 8.0)
            }
        })
        .collect();
    v.push(TensorCase {
        name: "e4m3_subnormal_results",
        shape: [m, k],
        values: x,
    });

    let x: Vec<f32> = background(n, 5)
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if i % 97 == 0 {
                f32::MAX
            } else if i % 89 == 0 {
                -f32::MAX
            } else {
                b * 3e38
            }
        })
        .collect();
    v.push(TensorCase {
        name: "f32_max",
        shape: [m, k],
        values: x,
    });

    let x: Vec<f32> = background(n, 6)
        .iter()
        .enumerate()
        .map(|(i, b)| b * p2((i / k) as i32 * 8 - 120))
        .collect();
    v.push(TensorCase {
        name: "rows_of_wildly_different_magnitude",
        shape: [m, k],
        values: x,
    });

    let x: Vec<f32> = (0..n)
        .map(|i| {
            if i % 16 == 3 {
                (i as f32 - 1000.0) * 0.37
            } else {
                0.0
            }
        })
        .collect();
    v.push(TensorCase {
        name: "single_element_blocks",
        shape: [m, k],
        values: x,
    });

    v.push(TensorCase {
        name: "tiny_shape_1x16",
        shape: [1, 16],
        values: background(16, 7),
    });
    v.push(TensorCase {
        name: "k_not_multiple_3x40",
        shape: [3, 40],
        values: background(120, 8),
    });
    v.push(TensorCase {
        name: "fp8_weight_tile_130x256",
        shape: [130, 256],
        values: background(130 * 256, 9),
    });
    v
}
