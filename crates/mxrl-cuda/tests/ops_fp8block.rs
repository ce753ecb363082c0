//! FP8 block (E4M3 codes, f32 `scale_inv` per 1×128 activation block or 128×128 weight tile)
//! on every device, against the named CPU references:
//!
//! - the quantizers (`QuantDevice::quantize` with every FP8-block scheme, f32 and BF16 inputs)
//!   equal `mxrl_formats::reference::quantize` byte for byte on random data of many
//!   magnitudes, zeros, f32::MAX, values around the E4M3 grid and special values (NaN, ±Inf,
//!   subnormals, −0); their dequantization equals the library's bit for bit; shapes off the
//!   block are refused with the library's error;
//! - (with `cuda`) the engine backend's FP8-block linears (`CudaBackend::quantize_weights`,
//!   `upload_experts`, `stored_weights`, `checksum_qweights`, `grouped_qlinear`, `qlinear`)
//!   against `CpuBackend`: stored bytes and checksums equal; `y` within the derived bound
//!   `mxrl_tensor::tolerance::fp8_block_sum_bound` of the CPU's for ragged groups, experts
//!   without rows and more rows than one pass, and that bound is tight enough that the BF16
//!   forward violates it; weights with N not a multiple of 128 are refused by name.
//!
//! Seeds are fixed and printed with every failure.

use half::bf16;
use mxrl_cuda::{test_device, Input, QuantDevice};
use mxrl_formats::{
    reference, Fp8BlockScheme, Fp8Blocks, Padding, QuantizedTensor, ScaleRule, Scheme,
};
use rand::{Rng, SeedableRng};

/// Every FP8-block scheme: both block shapes, both FP32 scale rules.
fn schemes() -> Vec<Scheme> {
    let mut v = Vec::new();
    for blocks in [Fp8Blocks::Weight128x128, Fp8Blocks::Activation1x128] {
        for scale_rule in [ScaleRule::F32Exact, ScaleRule::F32PowerOfTwo] {
            v.push(Scheme::Fp8Block(Fp8BlockScheme { blocks, scale_rule }));
        }
    }
    assert!(v.contains(&Scheme::FP8_BLOCK_WEIGHT) && v.contains(&Scheme::FP8_BLOCK_ACT));
    v
}

fn tile_rows(s: Scheme) -> usize {
    match s {
        Scheme::Fp8Block(f) if f.blocks == Fp8Blocks::Weight128x128 => 128,
        _ => 1,
    }
}

/// Test data families; `cols` sets where magnitudes change (per 128-column block and row).
fn family(name: &str, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = rows * cols;
    match name {
        // Every block its own magnitude, from 2⁻³⁰ to 2³⁰.
        "random" => (0..n)
            .map(|i| {
                let b = (i / cols) + (i % cols) / 128;
                r.gen_range(-1.0f32..1.0) * 2f32.powi((b % 11) as i32 * 6 - 30)
            })
            .collect(),
        // Values between E4M3 grid points after scaling (amax 448 in every block).
        "grid" => (0..n)
            .map(|i| {
                if i % 128 == 0 {
                    448.0
                } else {
                    let j = (i % 97) as f32;
                    (-12.0 + 0.25 * j) * if i % 2 == 0 { 1.0 + 1e-3 } else { 1.0 - 1e-3 }
                }
            })
            .collect(),
        "zeros" => vec![0.0; n],
        "maxes" => (0..n)
            .map(|i| if i % 3 == 0 { -f32::MAX } else { f32::MAX })
            .collect(),
        "special" => (0..n)
            .map(|i| match i % 13 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                4 => f32::from_bits(1), // smallest subnormal
                5 => 1e-40,
                6 => 464.0, // E4M3 satfinite tie
                7 => -449.0,
                8 => f32::MIN_POSITIVE,
                _ => r.gen_range(-3.0f32..3.0),
            })
            .collect(),
        // Only tiny values: the scale quotient overflows to f32::MAX.
        "tiny" => (0..n)
            .map(|i| f32::from_bits(1 + (i as u32 % 7)) * if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        _ => unreachable!(),
    }
}

const FAMILIES: [&str; 6] = ["random", "grid", "zeros", "maxes", "special", "tiny"];

fn assert_same(dev: &dyn QuantDevice, got: &QuantizedTensor, want: &QuantizedTensor, what: &str) {
    assert_eq!(
        (got.scheme, &got.shape),
        (want.scheme, &want.shape),
        "{} {what}",
        dev.name()
    );
    if got.data != want.data {
        let i = got
            .data
            .iter()
            .zip(&want.data)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "{} {what}: codes differ first at byte {i}: {:#04x} vs reference {:#04x}",
            dev.name(),
            got.data.get(i).copied().unwrap_or(0),
            want.data.get(i).copied().unwrap_or(0)
        );
    }
    // f32 scales compared by bit pattern.
    let bits = |q: &QuantizedTensor| match &q.scales {
        mxrl_formats::Scales::F32(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        mxrl_formats::Scales::Bytes(_) => panic!("{what}: FP8-block scales are f32"),
    };
    assert_eq!(bits(got), bits(want), "{} {what}: scales", dev.name());
    assert!(got.amax.is_empty(), "{} {what}: amax", dev.name());
}

fn check(dev: &dyn QuantDevice, x: Input<'_>, shape: [usize; 2], what: &str) {
    for scheme in schemes() {
        if !shape[0].is_multiple_of(tile_rows(scheme)) {
            continue;
        }
        let want = match x {
            Input::F32(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
            Input::Bf16(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
        }
        .unwrap();
        let got = dev.quantize(x, shape, scheme).unwrap();
        let what = format!("{what} {scheme} {shape:?}");
        assert_same(dev, &got, &want, &what);
        // Dequantized bit for bit, every NaN counted as one value (payloads are not part of
        // the contract).
        let b = |v: &[f32]| {
            v.iter()
                .map(|a| if a.is_nan() { u32::MAX } else { a.to_bits() })
                .collect::<Vec<_>>()
        };
        let d = dev.dequantize(&got).unwrap();
        assert_eq!(
            b(&d),
            b(&want.dequantize().unwrap()),
            "{} {what}: dequantize",
            dev.name()
        );
    }
}

test_device!(fp8_block_quantizers_match_the_reference, |dev| {
    // One tile; several tiles both ways; activation-only shapes (rows not a multiple of 128).
    for (si, shape) in [[128, 128], [256, 384], [3, 256], [1, 128], [130, 640]]
        .into_iter()
        .enumerate()
    {
        for (fi, fam) in FAMILIES.iter().enumerate() {
            let seed = 7000 + 100 * si as u64 + fi as u64;
            let x = family(fam, shape[0], shape[1], seed);
            check(
                dev,
                Input::F32(&x),
                shape,
                &format!("{fam} f32 seed {seed}"),
            );
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            check(
                dev,
                Input::Bf16(&xb),
                shape,
                &format!("{fam} bf16 seed {seed}"),
            );
        }
    }
});

test_device!(fp8_block_shapes_off_the_block_are_refused, |dev| {
    let x = vec![1.0f32; 128 * 192];
    // One dimension off the block at a time: K = 192 is not whole 128-blocks, M = 100 rows
    // are not whole 128×128 tiles.
    for (shape, scheme, dim) in [
        ([128, 192], Scheme::FP8_BLOCK_WEIGHT, "K = 192"),
        ([100, 128], Scheme::FP8_BLOCK_WEIGHT, "M = 100"),
        ([3, 192], Scheme::FP8_BLOCK_ACT, "K = 192"),
    ] {
        let e = dev
            .quantize(Input::F32(&x[..shape[0] * shape[1]]), shape, scheme)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(dim) && e.contains("128"),
            "{} {scheme} {shape:?}: {e}",
            dev.name()
        );
    }
});

/// The engine backend's FP8-block linears on the GPU against the CPU backend.
#[cfg(feature = "cuda")]
mod engine_backend {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_formats::{e4m3_decode, Format, Padding, Scales, Scheme};
    use mxrl_tensor::device::{Backend, CpuBackend};
    use mxrl_tensor::gradcheck::test_values;
    use mxrl_tensor::qlinear::{BackwardMode, LinearSpec, PreparedWeight};
    use mxrl_tensor::tolerance::{fp8_block_sum_bound, violations};
    use std::sync::Mutex;

    static SERIAL: Mutex<()> = Mutex::new(());

    fn backend() -> CudaBackend {
        CudaBackend::new(0)
            .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
    }

    fn spec() -> LinearSpec {
        LinearSpec::new(Format::Fp8Block, BackwardMode::HighPrecision).unwrap()
    }

    /// Per-entry bound of `y` rows `a..b` (of `x`) against expert weight `w` (stored bytes):
    /// `fp8_block_sum_bound(K/128, Σ_b |sx·sw|·Σ_{k∈b} |x_k·w_k|)` on the E4M3 values.
    fn bounds(x: &[f32], rows: usize, w: &mxrl_formats::QuantizedTensor) -> Vec<f64> {
        let (n, k) = (w.shape[0], w.shape[1]);
        let kb = k / 128;
        let qx =
            mxrl_formats::quantize(x, &[rows, k], Scheme::FP8_BLOCK_ACT, Padding::Reject).unwrap();
        let (Scales::F32(sx), Scales::F32(sw)) = (&qx.scales, &w.scales) else {
            panic!("FP8-block scales are f32")
        };
        let mut out = Vec::with_capacity(rows * n);
        for i in 0..rows {
            for j in 0..n {
                let mut total = 0f64;
                for b in 0..kb {
                    let a: f64 = (b * 128..(b + 1) * 128)
                        .map(|kk| {
                            (e4m3_decode(qx.data[i * k + kk]) as f64
                                * e4m3_decode(w.data[j * k + kk]) as f64)
                                .abs()
                        })
                        .sum();
                    total += ((sx[i * kb + b] * sw[(j / 128) * kb + b]) as f64).abs() * a;
                }
                out.push(fp8_block_sum_bound(kb, total));
            }
        }
        out
    }

    fn check(what: &str, got: &[f32], want: &[f32], bound: &[f64], seed: u64) {
        let v = violations(got, want, |i| bound[i]);
        assert!(v.is_empty(), "{what} (seed {seed}): {}", v.join("; "));
    }

    /// Stored bytes, checksums and the grouped forward over four experts [256, 384] with
    /// ragged groups (37 rows, none, 33 rows, none) and over 70 rows of one dense weight,
    /// then 300 rows (several passes of 16 rows per CTA, split over the grid).
    #[test]
    fn grouped_and_dense_fp8_block_linears_match_the_cpu_backend() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let cb = backend();
        let s = spec();
        let (groups, n, k) = (4usize, 256usize, 384usize);
        let offsets = [0u32, 37, 37, 70, 70];
        let rows = 70;
        let seed = 4242;
        let name = |g: usize| format!("w{g}");
        // Weights of different magnitudes per expert and per 128-column block.
        let master: Vec<f32> = test_values(groups * n * k, seed, 1.0)
            .into_iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i / (n * k)) as i32 * 2 - (i % k / 128) as i32))
            .collect();
        let x = test_values(rows * k, seed + 1, 3.0);
        let qc = CpuBackend
            .quantize_weights(&master, groups, n, k, s, &name, 0)
            .unwrap();
        let md = cb.upload_f32(&master).unwrap();
        let qd = cb.quantize_weights(&md, groups, n, k, s, &name, 0).unwrap();
        let stored = CpuBackend.stored_weights(&qc).unwrap();
        assert_eq!(
            cb.stored_weights(&qd).unwrap(),
            stored,
            "stored bytes (seed {seed})"
        );
        assert_eq!(qd.bytes(), groups * Format::Fp8Block.stored_bytes(n, k));
        // The same bytes uploaded from the CPU's prepared weights.
        let up = cb.upload_experts(qc.clone()).unwrap();
        assert_eq!(cb.stored_weights(&up).unwrap(), stored, "uploaded bytes");
        // Device checksums (quantized, copied, uploaded) are the reference's.
        let mut sums = cb.zeros_u32(6).unwrap();
        cb.checksum_qweights(&qd, &mut sums, 0).unwrap();
        cb.checksum_qweights(&cb.copy_qweights(&qd).unwrap(), &mut sums, 1)
            .unwrap();
        cb.checksum_qweights(&up, &mut sums, 2).unwrap();
        let w = cb.download_u32(&sums, 6).unwrap();
        let want = mxrl_tensor::device::checksum_stored(&stored.iter().collect::<Vec<_>>());
        for slot in 0..3 {
            let got = u64::from(w[2 * slot]) | (u64::from(w[2 * slot + 1]) << 32);
            assert_eq!(got, want, "checksum {slot}");
        }
        // Grouped forward.
        let (xd, od) = (cb.upload_f32(&x).unwrap(), cb.upload_u32(&offsets).unwrap());
        let mut yd = cb.zeros_f32(rows * n).unwrap();
        cb.grouped_qlinear(&xd, &qd, &od, groups, rows, k, n, &mut yd)
            .unwrap();
        let y = cb.download_f32(&yd, rows * n).unwrap();
        let mut yc = vec![0f32; rows * n];
        CpuBackend
            .grouped_qlinear(&x, &qc, &offsets.to_vec(), groups, rows, k, n, &mut yc)
            .unwrap();
        let mut bf16_violates = false;
        for g in 0..groups {
            let (a, b) = (offsets[g] as usize, offsets[g + 1] as usize);
            if a == b {
                continue;
            }
            let bd = bounds(&x[a * k..b * k], b - a, &stored[g]);
            check(
                &format!("grouped y[{g}]"),
                &y[a * n..b * n],
                &yc[a * n..b * n],
                &bd,
                seed,
            );
            // Tight enough to fail: the BF16 forward of the same weights is outside it.
            let pb = PreparedWeight::quantize(
                "bf16",
                &master[g * n * k..(g + 1) * n * k],
                n,
                k,
                LinearSpec::bf16(),
                0,
            )
            .unwrap();
            let yb = pb.forward_inference(&x[a * k..b * k], b - a).unwrap();
            bf16_violates |= !violations(&yb, &yc[a * n..b * n], |i| bd[i]).is_empty();
        }
        assert!(bf16_violates, "the bound does not tell FP8 block from BF16");
        // Dense: one weight over 70 rows, then 300 rows (19 passes of 16 rows).
        let q1c = CpuBackend
            .quantize_weights(&master, 1, n, k, s, &name, 0)
            .unwrap();
        let q1d = cb.quantize_weights(&md, 1, n, k, s, &name, 0).unwrap();
        for m in [rows, 300] {
            let xm = test_values(m * k, seed + 2 + m as u64, 2.0);
            let xmd = cb.upload_f32(&xm).unwrap();
            let mut y1 = cb.zeros_f32(m * n).unwrap();
            cb.qlinear(&xmd, &q1d, m, k, n, &mut y1).unwrap();
            let mut y1c = vec![0f32; m * n];
            CpuBackend.qlinear(&xm, &q1c, m, k, n, &mut y1c).unwrap();
            let bd = bounds(&xm, m, &CpuBackend.stored_weights(&q1c).unwrap()[0]);
            check(
                &format!("dense y ({m} rows)"),
                &cb.download_f32(&y1, m * n).unwrap(),
                &y1c,
                &bd,
                seed,
            );
        }
        // Deterministic: the same call gives the same bits.
        let mut y2 = cb.zeros_f32(rows * n).unwrap();
        cb.grouped_qlinear(&xd, &qd, &od, groups, rows, k, n, &mut y2)
            .unwrap();
        let y2 = cb.download_f32(&y2, rows * n).unwrap();
        assert!(
            y.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()),
            "two runs differ"
        );
    }

    /// Many rows per expert (more passes than grid CTAs along the rows) and a larger K: the
    /// grouped forward stays within the bound.
    #[test]
    fn fp8_block_forward_with_many_rows_per_expert() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let cb = backend();
        let s = spec();
        let (groups, n, k) = (2usize, 128usize, 1024usize);
        let offsets = [0u32, 1500, 2300];
        let rows = 2300;
        let seed = 5151;
        let name = |g: usize| format!("w{g}");
        let master = test_values(groups * n * k, seed, 0.5);
        let x = test_values(rows * k, seed + 1, 4.0);
        let qc = CpuBackend
            .quantize_weights(&master, groups, n, k, s, &name, 0)
            .unwrap();
        let qd = cb
            .quantize_weights(&cb.upload_f32(&master).unwrap(), groups, n, k, s, &name, 0)
            .unwrap();
        let stored = CpuBackend.stored_weights(&qc).unwrap();
        assert_eq!(cb.stored_weights(&qd).unwrap(), stored);
        let (xd, od) = (cb.upload_f32(&x).unwrap(), cb.upload_u32(&offsets).unwrap());
        let mut yd = cb.zeros_f32(rows * n).unwrap();
        cb.grouped_qlinear(&xd, &qd, &od, groups, rows, k, n, &mut yd)
            .unwrap();
        let y = cb.download_f32(&yd, rows * n).unwrap();
        let mut yc = vec![0f32; rows * n];
        CpuBackend
            .grouped_qlinear(&x, &qc, &offsets.to_vec(), groups, rows, k, n, &mut yc)
            .unwrap();
        for g in 0..groups {
            let (a, b) = (offsets[g] as usize, offsets[g + 1] as usize);
            let bd = bounds(&x[a * k..b * k], b - a, &stored[g]);
            check(
                &format!("y[{g}]"),
                &y[a * n..b * n],
                &yc[a * n..b * n],
                &bd,
                seed,
            );
        }
    }

    /// Weights whose N is not a multiple of 128 (not whole 128×128 tiles) are refused by
    /// name on the device, as the CPU refuses them.
    #[test]
    fn fp8_block_weights_off_the_tiles_are_refused_by_name() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let cb = backend();
        let (groups, n, k) = (2usize, 64usize, 128usize);
        let master = test_values(groups * n * k, 1, 1.0);
        let name = |g: usize| format!("model.layers.0.mlp.experts.{g}.down_proj.weight");
        assert!(CpuBackend
            .quantize_weights(&master, groups, n, k, spec(), &name, 0)
            .is_err());
        let e = cb
            .quantize_weights(
                &cb.upload_f32(&master).unwrap(),
                groups,
                n,
                k,
                spec(),
                &name,
                0,
            )
            .err()
            .expect("N = 64 refused")
            .to_string();
        assert!(
            e.contains("model.layers.0.mlp.experts.0.down_proj.weight") && e.contains("128"),
            "{e}"
        );
    }
}
