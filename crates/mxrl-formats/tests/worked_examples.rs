//! Every worked example of quant-contract.md, checked through the reference and fast paths.
//! Expected values are copied from the contract text, never computed by the code under test.

use mxrl_formats::{
    e2m1_encode, reference, swizzle_offset, Nvfp4Global, Padding, QuantizedTensor, Scheme,
};

fn both(x: &[f32], shape: &[usize], scheme: Scheme) -> [QuantizedTensor; 2] {
    let r = reference::quantize(x, shape, scheme, Padding::Reject).unwrap();
    let f = mxrl_formats::quantize(x, shape, scheme, Padding::Reject).unwrap();
    assert_eq!(r, f, "fast path differs from reference for {scheme}");
    [r, f]
}

/// §2: a 32-element block holding `v` at index 0 and zeros elsewhere → (scale, q[0]).
fn mx_block(v: f32) -> (u8, u8) {
    let mut x = vec![0.0f32; 32];
    x[0] = v;
    let [q, _] = both(&x, &[1, 32], Scheme::MXFP8_ROW);
    assert!(q.data[1..].iter().all(|&b| b == 0));
    (q.scales.as_bytes().unwrap()[0], q.data[0])
}

#[test]
fn mxfp8_worked_examples() {
    assert_eq!(mx_block(1.0), (0x77, 0x78), "amax 1.0");
    assert_eq!(mx_block(448.0).0, 0x7F, "amax 448");
    assert_eq!(mx_block(449.0), (0x80, 0x76), "amax 449");
    assert_eq!(mx_block(1e-36), (0x00, 0x73), "amax 1e-36");
    assert_eq!(mx_block(0.0), (0x00, 0x00), "all zeros");
}

#[test]
fn mxfp8_worked_examples_column_wise() {
    // The same blocks along M: a [32, 1] column.
    for (v, scale, q0) in [
        (1.0f32, 0x77u8, 0x78u8),
        (449.0, 0x80, 0x76),
        (1e-36, 0x00, 0x73),
    ] {
        let mut x = vec![0.0f32; 32];
        x[0] = v;
        let [q, _] = both(&x, &[32, 1], Scheme::MXFP8_COL);
        assert_eq!(
            (q.scales.as_bytes().unwrap()[0], q.data[0]),
            (scale, q0),
            "amax {v}"
        );
    }
}

#[test]
fn nvfp4_worked_example() {
    let block = [
        0.125f32, -0.25, 0.3125, 1.1875, -2.0, 0.046875, 0.0, -0.0, 1.75, 2.5, -3.25, 0.625, 0.875,
        -1.125, 0.1875, 0.375,
    ];
    // Per-tensor amax 4.0: a second block carries the 4.0.
    let mut x = block.to_vec();
    x.extend([4.0f32].iter().chain([0.0f32; 15].iter()));
    let [q, _] = both(&x, &[1, 32], Scheme::NVFP4_TENSOR);
    assert_eq!(q.amax, vec![4.0]);
    let g = Nvfp4Global::from_amax(4.0);
    assert_eq!(g.s_enc, 672.0, "S");
    assert_eq!(q.scales.as_bytes().unwrap()[0], 0x7B, "scale byte");
    let (scale, enc) = g.block(3.25);
    assert_eq!(scale, 0x7B);
    assert_eq!(enc, 1.909_090_8f32, "enc");
    assert_eq!(
        &q.data[..8],
        &[0x90, 0x41, 0x0E, 0x80, 0x65, 0x2F, 0xC3, 0x11],
        "packed bytes"
    );
}

#[test]
fn nvfp4_order_of_operations_example() {
    // S = 672, sf = 384: the multiplier is 1.7499999, not 1.75, so −2.0 → 0xD (torchao: 0xE).
    let g = Nvfp4Global::from_amax(4.0);
    let enc = 1.0f32 / (384.0f32 * g.s_dec);
    assert_eq!(enc, 1.749_999_9f32);
    assert_ne!(enc, 1.75);
    assert_eq!(e2m1_encode(-2.0 * enc), 0xD);
    // End to end: block max 3.5 → sdec = 3.5·112 = 392 → e4m3 384; amax 4.0 in block 2.
    let mut x = vec![0.0f32; 32];
    x[0] = 3.5;
    x[1] = -2.0;
    x[16] = 4.0;
    let [q, _] = both(&x, &[1, 32], Scheme::NVFP4_TENSOR);
    assert_eq!(q.scales.as_bytes().unwrap()[0], 0x7C, "sf = 384");
    assert_eq!(q.data[0] >> 4, 0xD, "−2.0 with S = 672, sf = 384");
}

#[test]
fn nvfp4_zero_and_tiny_blocks() {
    // Zero block: scale 0x00, codes 0. Tiny block: scale 0x00 but enc = MAX → ±6 (0x7/0xF),
    // dequantizing to 0 all the same.
    let mut x = vec![0.0f32; 48];
    x[16] = 1e-6;
    x[17] = -1e-6;
    x[32] = 6000.0; // amax: S = fl(2688/6000), tiny blocks then have sdec ≤ 2⁻¹⁰
    let [q, _] = both(&x, &[1, 48], Scheme::NVFP4_TENSOR);
    let s = q.scales.as_bytes().unwrap();
    assert_eq!((s[0], s[1]), (0x00, 0x00));
    assert!(q.data[..8].iter().all(|&b| b == 0), "zero block codes");
    assert_eq!(q.data[8], 0xF7, "tiny ±: +6 low nibble, −6 high nibble");
    let d = q.dequantize().unwrap();
    assert!(d[..32].iter().all(|&v| v == 0.0));
}

#[test]
fn swizzle_worked_examples() {
    for ((r, c), want) in [
        ((0, 0), 0),
        ((1, 0), 16),
        ((32, 0), 4),
        ((0, 1), 1),
        ((0, 4), 512),
        ((127, 3), 511),
        ((130, 5), 1569),
    ] {
        assert_eq!(swizzle_offset(r, c, 8), want, "({r}, {c}) with Cp = 8");
    }
}
