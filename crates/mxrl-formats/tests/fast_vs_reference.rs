//! The fast CPU path equals the reference byte for byte on random shapes (2-D and 3-D,
//! block multiples and not), dtypes, value families and seeds. Seeds are fixed and printed in
//! every failure message.

use half::{bf16, f16};
use mxrl_formats::{
    reference, HighPrecision, Padding, QuantizedTensor, Scheme, TensorRef, ALL_SCHEMES,
};
use mxrl_formats::{AmaxScope, Nvfp4Blocks, Nvfp4Scheme};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn values(rng: &mut ChaCha8Rng, rows: usize, k: usize) -> Vec<f32> {
    let family = rng.gen_range(0..4);
    let mut v = Vec::with_capacity(rows * k);
    for _ in 0..rows {
        // Rows of wildly different magnitude, outliers, tiny values, exact grid points.
        let row_exp = rng.gen_range(-40i32..40);
        for _ in 0..k {
            let u: f32 = rng.gen_range(-1.0..1.0);
            let x = match family {
                0 => u * 2f32.powi(row_exp),
                1 => {
                    if rng.gen_ratio(1, 50) {
                        u * 1e4
                    } else {
                        u
                    }
                }
                2 => {
                    [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 448.0, -0.0][rng.gen_range(0..10)]
                        * if rng.gen() { 1.0 } else { -1.0 }
                }
                _ => match rng.gen_range(0..40) {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => -f32::INFINITY,
                    3 => f32::from_bits(rng.gen_range(1..0x0080_0000)),
                    _ => u * 3.0,
                },
            };
            v.push(x);
        }
    }
    v
}

/// Assert equality, reporting the first differing byte / scale instead of whole buffers.
fn assert_same(r: &QuantizedTensor, f: &QuantizedTensor, what: &str) {
    let first = |a: &[u8], b: &[u8]| a.iter().zip(b).position(|(x, y)| x != y);
    assert_eq!(r.data.len(), f.data.len(), "{what}: data length");
    if let Some(i) = first(&r.data, &f.data) {
        panic!(
            "{what}: data byte {i} differs: reference {:#04x}, fast {:#04x}",
            r.data[i], f.data[i]
        );
    }
    if let (Some(a), Some(b)) = (r.scales.as_bytes(), f.scales.as_bytes()) {
        if let Some(i) = first(a, b) {
            panic!(
                "{what}: scale {i} differs: reference {:#04x}, fast {:#04x}",
                a[i], b[i]
            );
        }
    }
    let bits = |q: &QuantizedTensor| q.amax.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(r), bits(f), "{what}: amax bits");
    assert!(r == f, "{what}: tensors differ in metadata or f32 scales");
}

fn check<T: HighPrecision>(x: &[T], shape: &[usize], seed: u64) {
    // One reused output buffer across all schemes exercises `quantize_into`'s buffer reuse
    // (different sizes, byte vs f32 scales, with and without amax).
    let mut reused = QuantizedTensor::empty(Scheme::MXFP8_ROW);
    for scheme in ALL_SCHEMES {
        let r = reference::quantize(x, shape, scheme, Padding::Zero).unwrap();
        let f = mxrl_formats::quantize(x, shape, scheme, Padding::Zero).unwrap();
        let what = format!(
            "seed {seed} shape {shape:?} dtype {} scheme {scheme}",
            T::DTYPE
        );
        assert_same(&r, &f, &what);
        mxrl_formats::quantize_into(x, shape, scheme, Padding::Zero, &mut reused).unwrap();
        assert_same(&r, &reused, &format!("{what} (quantize_into)"));
    }
}

#[test]
fn fast_equals_reference_on_random_inputs() {
    for seed in 0..24u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let e = if rng.gen_ratio(1, 3) {
            Some(rng.gen_range(1..3))
        } else {
            None
        };
        let m = [1, 2, 3, 16, 17, 31, 32, 33, 64, 96, 130][rng.gen_range(0..11)];
        let k = [16, 32, 48, 64, 100, 128, 160, 256][rng.gen_range(0..8)];
        let shape: Vec<usize> = match e {
            Some(e) => vec![e, m, k],
            None => vec![m, k],
        };
        let x = values(&mut rng, e.unwrap_or(1) * m, k);
        match seed % 3 {
            0 => check(&x, &shape, seed),
            1 => check(
                &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                &shape,
                seed,
            ),
            _ => check(
                &x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
                &shape,
                seed,
            ),
        }
    }
}

#[test]
fn fast_stacked_and_given_amax_equal_reference() {
    for seed in 100..108u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let k = [32, 64, 96][rng.gen_range(0..3)];
        let (m1, m2) = (16 * rng.gen_range(1..4), 16 * rng.gen_range(1..4));
        let (a, b) = (values(&mut rng, m1, k), values(&mut rng, m2, k));
        let (sa, sb) = ([m1, k], [m2, k]);
        let parts = [TensorRef::new(&a, &sa), TensorRef::new(&b, &sb)];
        for blocks in [Nvfp4Blocks::Vector, Nvfp4Blocks::Tile16x16] {
            let s = Nvfp4Scheme {
                amax: AmaxScope::PerTensor,
                blocks,
            };
            let r = reference::quantize_nvfp4_stacked(&parts, s, Padding::Reject).unwrap();
            let f = mxrl_formats::quantize_nvfp4_stacked(&parts, s, Padding::Reject).unwrap();
            assert_same(&r[0], &f[0], &format!("seed {seed} part 0"));
            assert_same(&r[1], &f[1], &format!("seed {seed} part 1"));
            let amax = [rng.gen_range(0.5f32..100.0)];
            let r =
                reference::quantize_nvfp4_with_amax(&a, &sa, s, Padding::Reject, &amax).unwrap();
            let f =
                mxrl_formats::quantize_nvfp4_with_amax(&a, &sa, s, Padding::Reject, &amax).unwrap();
            assert_same(&r, &f, &format!("seed {seed} given amax"));
        }
        let _ = Scheme::NVFP4_ROW;
    }
}
