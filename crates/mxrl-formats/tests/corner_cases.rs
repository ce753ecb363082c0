//! The named corner-case table (`mxrl_formats::corner`) through every CPU path: element
//! encoders against hand-derived bytes, and every tensor case × every scheme through the
//! reference and the fast path, byte-equal, plus the semantic rules the contract states for
//! special values (NaN never poisons a scale, −0.0 keeps its sign, zeros give zero scales).

use mxrl_formats::corner::{tensor_cases, ELEMENT_CASES};
use mxrl_formats::{
    e2m1_encode, e4m3_encode, e5m2_encode, reference, ue8m0_round_up, Format, Padding, Scales,
    Scheme, ALL_SCHEMES,
};

/// The element code at logical (r, c) of a 2-D quantized tensor (handles padding, packing).
fn code_at(q: &mxrl_formats::QuantizedTensor, r: usize, c: usize) -> u8 {
    let kp = q.padded_shape[1];
    let i = r * kp + c;
    match q.format() {
        Format::Nvfp4 => (q.data[i / 2] >> (4 * (i % 2))) & 0xF,
        _ => q.data[i],
    }
}

#[test]
fn element_corner_cases_match_hand_derived_bytes() {
    for c in ELEMENT_CASES {
        let got = (
            e4m3_encode(c.x),
            e5m2_encode(c.x),
            e2m1_encode(c.x),
            ue8m0_round_up(c.x),
        );
        assert_eq!(
            got,
            (c.e4m3, c.e5m2, c.e2m1, c.ue8m0),
            "case `{}` (x = {:e})",
            c.name,
            c.x
        );
    }
}

#[test]
fn element_corner_cases_through_the_fast_path() {
    // A 1×32 MXFP8 block whose scale is 2^0 (amax in (224, 448]: v = fl(amax/448) ≤ 1) leaves
    // every element unscaled, so the fast path's E4M3 encoder sees the corner value itself.
    for c in ELEMENT_CASES
        .iter()
        .filter(|c| c.x.is_finite() && c.x.abs() <= 448.0)
    {
        let mut x = vec![0.0f32; 32];
        x[0] = 448.0;
        x[1] = c.x;
        let q = mxrl_formats::quantize(&x, &[1, 32], Scheme::MXFP8_ROW, Padding::Reject).unwrap();
        assert_eq!(q.scales.as_bytes().unwrap()[0], 127, "scale 2^0");
        assert_eq!(q.data[1], c.e4m3, "case `{}`", c.name);
    }
}

#[test]
fn every_tensor_case_through_every_scheme_fast_equals_reference() {
    for case in tensor_cases() {
        for scheme in ALL_SCHEMES {
            let r = reference::quantize(&case.values, &case.shape, scheme, Padding::Zero).unwrap();
            let f =
                mxrl_formats::quantize(&case.values, &case.shape, scheme, Padding::Zero).unwrap();
            assert_eq!(r, f, "case `{}` scheme {scheme}", case.name);
            r.validate().unwrap();
            let d = r.dequantize().unwrap();
            assert_eq!(
                d.len(),
                case.values.len(),
                "case `{}` scheme {scheme}",
                case.name
            );
        }
    }
}

#[test]
fn zeros_give_zero_codes_and_zero_scales() {
    let case = tensor_cases()
        .into_iter()
        .find(|c| c.name == "zeros")
        .unwrap();
    for scheme in ALL_SCHEMES {
        let q = mxrl_formats::quantize(&case.values, &case.shape, scheme, Padding::Zero).unwrap();
        assert!(q.data.iter().all(|&b| b == 0), "{scheme} data");
        match &q.scales {
            Scales::Bytes(b) => assert!(b.iter().all(|&s| s == 0), "{scheme} scales"),
            // FP8 block: amax 0 → scale 1 → scale_inv 1.
            Scales::F32(f) => assert!(f.iter().all(|&s| s == 1.0), "{scheme} scales"),
        }
        assert!(q.amax.iter().all(|&a| a == 0.0));
        assert!(q.dequantize().unwrap().iter().all(|&v| v == 0.0));
    }
}

#[test]
fn negative_zeros_keep_their_sign() {
    let case = tensor_cases()
        .into_iter()
        .find(|c| c.name == "negative_zeros")
        .unwrap();
    for scheme in ALL_SCHEMES {
        let q = mxrl_formats::quantize(&case.values, &case.shape, scheme, Padding::Zero).unwrap();
        let want = if scheme.format() == Format::Nvfp4 {
            0x8
        } else {
            0x80
        };
        let [m, k] = case.shape;
        for (r, c) in (0..m).flat_map(|r| (0..k).map(move |c| (r, c))) {
            assert_eq!(
                code_at(&q, r, c),
                want,
                "{scheme}: −0.0 → sign-only code at ({r}, {c})"
            );
        }
        assert!(
            q.dequantize()
                .unwrap()
                .iter()
                .all(|v| v.to_bits() == 0x8000_0000),
            "{scheme}"
        );
    }
}

#[test]
fn nan_never_poisons_a_scale() {
    let case = tensor_cases()
        .into_iter()
        .find(|c| c.name == "nan_elements")
        .unwrap();
    let cleaned: Vec<f32> = case
        .values
        .iter()
        .map(|&v| if v.is_nan() { 0.0 } else { v })
        .collect();
    for scheme in ALL_SCHEMES {
        let q = mxrl_formats::quantize(&case.values, &case.shape, scheme, Padding::Zero).unwrap();
        let c = mxrl_formats::quantize(&cleaned, &case.shape, scheme, Padding::Zero).unwrap();
        assert_eq!(
            q.scales, c.scales,
            "{scheme}: scales with NaN = scales with NaN → 0"
        );
        assert_eq!(q.amax, c.amax, "{scheme}: amax ignores NaN");
        // NaN elements get the NaN code; the others are unchanged.
        let nan_code = if scheme.format() == Format::Nvfp4 {
            0x7
        } else {
            0x7F
        };
        let k = case.shape[1];
        for (i, v) in case.values.iter().enumerate() {
            let code = code_at(&q, i / k, i % k);
            let clean = code_at(&c, i / k, i % k);
            if v.is_nan() {
                assert_eq!(code, nan_code, "{scheme} element {i}");
            } else {
                assert_eq!(code, clean, "{scheme} element {i}");
            }
        }
    }
}
