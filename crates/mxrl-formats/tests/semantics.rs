//! Shape, padding, stacking, 3-D, layout and contract-identity rules of the API.

use mxrl_formats::{
    contract_hash, reference, swizzle_128x4, unswizzle_128x4, AmaxScope, FormatError, Nvfp4Blocks,
    Nvfp4Scheme, Padding, ScaleLayout, Scheme, TensorRef, ALL_SCHEMES, CONTRACT_VERSION,
};

fn ramp(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 100.0 - 10.0)
        .collect()
}

#[test]
fn contract_hash_is_pinned() {
    // Changing any contract parameter changes this hash; that must be deliberate: bump
    // CONTRACT_VERSION, update quant-contract.md, and update this value.
    assert_eq!(CONTRACT_VERSION, 1);
    assert_eq!(contract_hash(), "b53ec8b557adbe76");
    assert_eq!(contract_hash().len(), 16);
}

#[test]
fn k_not_multiple_is_a_clear_error_unless_padding_is_explicit() {
    let x = ramp(3 * 40, 1);
    let err = mxrl_formats::quantize(&x, &[3, 40], Scheme::MXFP8_ROW, Padding::Reject).unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::NotMultiple {
                dim: "K",
                size: 40,
                block: 32,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("K = 40") && msg.contains("32") && msg.contains("Padding::Zero"),
        "{msg}"
    );
    let err = mxrl_formats::quantize(&x, &[3, 40], Scheme::MXFP8_COL, Padding::Reject).unwrap_err();
    assert!(
        matches!(
            err,
            FormatError::NotMultiple {
                dim: "M",
                size: 3,
                block: 32,
                ..
            }
        ),
        "{err}"
    );
    let err = mxrl_formats::quantize(&x, &[3, 41], Scheme::NVFP4_ROW, Padding::Reject).unwrap_err();
    assert!(
        matches!(err, FormatError::LengthMismatch { what: "input", .. }),
        "{err}"
    );
    let err = mxrl_formats::quantize(&x, &[120], Scheme::NVFP4_ROW, Padding::Reject).unwrap_err();
    assert!(matches!(err, FormatError::BadRank { .. }), "{err}");
}

#[test]
fn zero_padding_equals_quantizing_the_explicitly_padded_tensor() {
    let (m, k) = (3, 40);
    let x = ramp(m * k, 2);
    for scheme in ALL_SCHEMES {
        let q = mxrl_formats::quantize(&x, &[m, k], scheme, Padding::Zero).unwrap();
        let (mp, kp) = (q.padded_shape[0], q.padded_shape[1]);
        let mut xp = vec![0.0f32; mp * kp];
        for i in 0..m {
            xp[i * kp..i * kp + k].copy_from_slice(&x[i * k..(i + 1) * k]);
        }
        let p = reference::quantize(&xp, &[mp, kp], scheme, Padding::Reject).unwrap();
        assert_eq!(q.shape, vec![m, k]);
        assert_eq!((&q.data, &q.scales), (&p.data, &p.scales), "{scheme}");
        // Per-row amax of padded rows is 0; per-tensor amax is unchanged by zeros.
        assert_eq!(q.amax, p.amax, "{scheme}");
        let d = q.dequantize().unwrap();
        let dp = p.dequantize().unwrap();
        for i in 0..m {
            assert_eq!(
                &d[i * k..(i + 1) * k],
                &dp[i * kp..i * kp + k],
                "{scheme} row {i}"
            );
        }
    }
}

#[test]
fn stacked_gate_up_equals_one_tensor_stacked_along_m() {
    let k = 64;
    let (gate, up) = (
        ramp(32 * k, 3),
        ramp(48 * k, 4).iter().map(|v| v * 3.0).collect::<Vec<_>>(),
    );
    let mut cat = gate.clone();
    cat.extend(&up);
    for blocks in [Nvfp4Blocks::Vector, Nvfp4Blocks::Tile16x16] {
        let s = Nvfp4Scheme {
            amax: AmaxScope::PerTensor,
            blocks,
        };
        let (sg, su) = ([32, k], [48, k]);
        let parts = [TensorRef::new(&gate, &sg), TensorRef::new(&up, &su)];
        let q = mxrl_formats::quantize_nvfp4_stacked(&parts, s, Padding::Reject).unwrap();
        let whole = mxrl_formats::quantize(
            &cat,
            &[80, k],
            mxrl_formats::Scheme::Nvfp4(s),
            Padding::Reject,
        )
        .unwrap();
        assert_eq!(q[0].amax, whole.amax);
        assert_eq!(q[1].amax, whole.amax);
        let mut data = q[0].data.clone();
        data.extend(&q[1].data);
        assert_eq!(data, whole.data);
        let mut sc = q[0].scales.as_bytes().unwrap().to_vec();
        sc.extend(q[1].scales.as_bytes().unwrap());
        assert_eq!(sc, whole.scales.as_bytes().unwrap());
    }
    // Per-row amax has nothing to share.
    let s = Nvfp4Scheme {
        amax: AmaxScope::PerRow,
        blocks: Nvfp4Blocks::Vector,
    };
    let sh = [32, k];
    let err =
        mxrl_formats::quantize_nvfp4_stacked(&[TensorRef::new(&gate, &sh)], s, Padding::Reject)
            .unwrap_err();
    assert!(matches!(err, FormatError::Unsupported(_)));
    // Parts with different K are refused.
    let s = Nvfp4Scheme {
        amax: AmaxScope::PerTensor,
        blocks: Nvfp4Blocks::Vector,
    };
    let (s1, s2) = ([32, 64], [64, 32]);
    let err = mxrl_formats::quantize_nvfp4_stacked(
        &[TensorRef::new(&gate, &s1), TensorRef::new(&gate, &s2)],
        s,
        Padding::Reject,
    )
    .unwrap_err();
    assert!(
        matches!(err, FormatError::StackMismatch { index: 1, .. }),
        "{err}"
    );
}

#[test]
fn three_d_tensor_is_independent_experts() {
    let (e, m, k) = (3, 32, 128);
    let x: Vec<f32> = ramp(e * m * k, 5)
        .iter()
        .enumerate()
        .map(|(i, v)| v * (1 + i / (m * k)) as f32)
        .collect();
    for scheme in ALL_SCHEMES {
        let q = mxrl_formats::quantize(&x, &[e, m, k], scheme, Padding::Zero).unwrap();
        let mut data = Vec::new();
        let mut amax = Vec::new();
        for b in 0..e {
            let p = mxrl_formats::quantize(
                &x[b * m * k..(b + 1) * m * k],
                &[m, k],
                scheme,
                Padding::Zero,
            )
            .unwrap();
            data.extend(p.data);
            amax.extend(p.amax);
        }
        assert_eq!(q.data, data, "{scheme}");
        assert_eq!(q.amax, amax, "{scheme}: amax per expert / per row");
        assert_eq!(q.shape, vec![e, m, k]);
    }
}

#[test]
fn swizzle_round_trips_and_pads_with_zeros() {
    for (rows, cols) in [(1, 1), (3, 5), (128, 4), (130, 9), (256, 8)] {
        let c: Vec<u8> = (0..rows * cols).map(|i| (i % 251 + 1) as u8).collect();
        let s = swizzle_128x4(&c, rows, cols);
        assert_eq!(s.len(), rows.div_ceil(128) * 128 * cols.div_ceil(4) * 4);
        assert_eq!(
            s.iter().filter(|&&b| b == 0).count(),
            s.len() - c.len(),
            "padding bytes 0"
        );
        assert_eq!(unswizzle_128x4(&s, rows, cols), c);
    }
    // Tensor-level: both directions, row- and column-wise, 2-D and 3-D.
    let x = ramp(2 * 64 * 96, 6);
    for scheme in [
        Scheme::MXFP8_ROW,
        Scheme::MXFP8_COL,
        Scheme::NVFP4_TENSOR,
        Scheme::NVFP4_ROW,
    ] {
        for shape in [vec![128, 96], vec![2, 64, 96]] {
            let q = mxrl_formats::quantize(&x, &shape, scheme, Padding::Reject).unwrap();
            let s = q
                .clone()
                .with_scale_layout(ScaleLayout::Swizzled128x4)
                .unwrap();
            s.validate().unwrap();
            assert_eq!(
                s.dequantize().unwrap(),
                q.dequantize().unwrap(),
                "{scheme} {shape:?}"
            );
            assert_eq!(s.with_scale_layout(ScaleLayout::Compact).unwrap(), q);
        }
    }
    let x = ramp(128 * 128, 8);
    let q =
        mxrl_formats::quantize(&x, &[128, 128], Scheme::FP8_BLOCK_WEIGHT, Padding::Reject).unwrap();
    assert!(
        q.with_scale_layout(ScaleLayout::Swizzled128x4).is_err(),
        "f32 scales have no swizzle"
    );
}

#[test]
fn column_wise_swizzle_uses_the_transposed_view() {
    // Column-wise scales [M/32, K] = [1, 130] are swizzled as the [K, M/32] = [130, 1] matrix.
    let x = ramp(32 * 130, 7);
    let q = mxrl_formats::quantize(&x, &[32, 130], Scheme::MXFP8_COL, Padding::Reject).unwrap();
    let compact = q.scales.as_bytes().unwrap().to_vec();
    let s = q.with_scale_layout(ScaleLayout::Swizzled128x4).unwrap();
    assert_eq!(
        s.scales.as_bytes().unwrap(),
        swizzle_128x4(&compact, 130, 1).as_slice()
    );
}

#[test]
fn dequantize_applies_the_contract_formulas() {
    // MXFP8: scale 0x77 (2^-8), element 0x78 (256) → 1.0 exactly.
    let mut x = vec![0.0f32; 32];
    x[0] = 1.0;
    x[1] = -0.5;
    let q = mxrl_formats::quantize(&x, &[1, 32], Scheme::MXFP8_ROW, Padding::Reject).unwrap();
    let d = q.dequantize().unwrap();
    assert_eq!((d[0], d[1]), (1.0, -0.5));
    // NVFP4 (TE formula) on the contract's worked block: x̂ = e2m1 · fl(fl(sf·amax)·R2688),
    // sf = 352 (0x7B), amax = 4 → fl(1408 · fl(1/2688)); 1.75 → code 0x4 (2.0 after ×enc
    // 1.9090908 = 3.34 → 3) ... check one element by the formula with literal constants.
    let block = [
        0.125f32, -0.25, 0.3125, 1.1875, -2.0, 0.046875, 0.0, -0.0, 1.75, 2.5, -3.25, 0.625, 0.875,
        -1.125, 0.1875, 0.375,
    ];
    let mut x = block.to_vec();
    x.push(4.0);
    x.extend([0.0f32; 15]);
    let q = mxrl_formats::quantize(&x, &[1, 32], Scheme::NVFP4_TENSOR, Padding::Reject).unwrap();
    let d = q.dequantize().unwrap();
    let mult = (352.0f32 * 4.0) * f32::from_bits(0x39C3_0C31);
    // Packed byte 4 is 0x65: element 8 → code 0x5 (3.0), element 9 → code 0x6 (4.0).
    assert_eq!(d[8], 3.0 * mult);
    assert_eq!(d[9], 4.0 * mult);
    // FP8 block with power-of-two scales: amax 3 → scale = 448/3 = 149.33 → 128, inv 1/128.
    let mut x = vec![0.0f32; 128];
    x[0] = 3.0;
    x[1] = 1.0;
    let s = Scheme::Fp8Block(mxrl_formats::Fp8BlockScheme {
        blocks: mxrl_formats::Fp8Blocks::Activation1x128,
        scale_rule: mxrl_formats::ScaleRule::F32PowerOfTwo,
    });
    let q = mxrl_formats::quantize(&x, &[1, 128], s, Padding::Reject).unwrap();
    assert_eq!(q.scales.as_f32().unwrap(), &[1.0 / 128.0]);
    assert_eq!(&q.dequantize().unwrap()[..2], &[3.0, 1.0]);
}

/// `compact_lengths` gives exactly the buffer lengths of a quantized, compact, unpadded tensor
/// of every weight scheme (the checks `validate` makes), 2-D and stacked 3-D, and refuses a
/// shape its blocks do not tile.
#[test]
fn compact_lengths_are_the_lengths_of_quantized_tensors() {
    use mxrl_formats::{Padding, QuantizedTensor, Scales, Scheme};
    for (scheme, shape) in [
        (Scheme::MXFP8_ROW, vec![256, 384]),
        (Scheme::NVFP4_TENSOR, vec![256, 384]),
        (Scheme::NVFP4_ROW, vec![3, 64, 128]),
        (Scheme::FP8_BLOCK_WEIGHT, vec![256, 384]),
    ] {
        let n: usize = shape.iter().product();
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 997) as f32 / 97.0 - 5.0)
            .collect();
        let q = mxrl_formats::quantize(&x, &shape, scheme, Padding::Reject).unwrap();
        let scales = match &q.scales {
            Scales::Bytes(b) => b.len(),
            Scales::F32(v) => v.len(),
        };
        assert_eq!(
            QuantizedTensor::compact_lengths(scheme, &shape).unwrap(),
            (q.data.len(), scales, q.amax.len()),
            "{scheme} {shape:?}"
        );
    }
    assert!(QuantizedTensor::compact_lengths(Scheme::MXFP8_ROW, &[128, 40]).is_err());
}
