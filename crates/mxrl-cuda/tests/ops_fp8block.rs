//! FP8 block (E4M3 codes, f32 `scale_inv` per 1×128 activation block or 128×128 weight tile)
//! on every device, against the named CPU references:
//!
//! - the quantizers (`QuantDevice::quantize` with every FP8-block scheme, f32 and BF16 inputs)
//!   equal `mxrl_formats::reference::quantize` byte for byte on random data of many
//!   magnitudes, zeros, f32::MAX, values around the E4M3 grid and special values (NaN, ±Inf,
//!   subnormals, −0); their dequantization equals the library's bit for bit; shapes off the
//!   block are refused with the library's error;
//! - (with `cuda`) the fragment kernels (`Fp8Block::gemm_nt_frag_with`, both tensor-core
//!   variants) and the tiled kernels (`Fp8Block::gemm_nt`) on stored codes against the CPU
//!   reference `PreparedWeight::forward_inference` at decode shapes of 64 and 128 experts
//!   (batch 1, 32, 128 and 512 routed top-8; N 1536 / 2048, K 2048 / 768) and ragged groups
//!   (empty experts, rows across pass boundaries, rows of no expert left untouched), within
//!   `fp8_block_sum_bound`; bit for bit where every block sum is exact in f32 (what a
//!   tensor-core sum with fewer bits than f32 would break); the fragment kernels' bits the same
//!   for every split and rows per pass and from run to run; the staged kernels
//!   (`QGemm::grouped_nt_staged_fp8_block_with`, every rows per pass) the bits of the `F16`
//!   fragment kernels, and their activation quantizer (`QGemm::quant_act_fp8_block`) the
//!   reference's codes as binary16 values and its scales; up to three dense weights in one
//!   launch (`QGemm::dense_nt_staged_fp8_block_multi`) the bits of their own launches;
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
    pub(super) fn bounds(x: &[f32], rows: usize, w: &mxrl_formats::QuantizedTensor) -> Vec<f64> {
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

    pub(super) fn check(what: &str, got: &[f32], want: &[f32], bound: &[f64], seed: u64) {
        let v = violations(got, want, |i| bound[i]);
        assert!(v.is_empty(), "{what} (seed {seed}): {}", v.join("; "));
    }

    /// Stored bytes, checksums and the grouped forward over four experts [256, 384] with
    /// ragged groups (37 rows, none, 33 rows, none: 17.5 rows per expert, the staged
    /// kernels) and over 70 rows of one dense weight, then 300 rows (the tiled kernels: several
    /// passes of 16 rows per CTA, split over the grid).
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

    /// Many rows per expert (the tiled kernels, more passes than grid CTAs along the rows) and
    /// a larger K: the grouped forward stays within the bound.
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

    /// The optimizer step of FP8-block weights in one pass on the device
    /// (`Backend::adamw_requantize`: `QGemm::adamw_fp8_block`) gives the bits of the two calls
    /// it fuses (`adamw`, then `quantize_weights` of the new master) on the same backend —
    /// master, moments, BF16 copy and stored bytes — and those bytes are the CPU backend's for
    /// the downloaded master.
    #[test]
    fn fp8_block_optimizer_pass_equals_adamw_then_quantize() {
        use mxrl_tensor::device::{adamw_then_quantize, AdamWUpdate, StoredLayout};
        use mxrl_tensor::optim::AdamWConfig;
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let cb = backend();
        let (groups, n, k) = (3usize, 256usize, 384usize);
        let len = groups * n * k;
        let seed = 6060;
        let master = test_values(len, seed, 1.0);
        let grad = test_values(len, seed + 1, 0.3);
        let m0 = test_values(len, seed + 2, 0.01);
        let v0: Vec<f32> = test_values(len, seed + 3, 0.03)
            .iter()
            .map(|x| x * x)
            .collect();
        let cfg = AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        };
        let update = AdamWUpdate {
            step: 2,
            cfg: &cfg,
            weight_decay: 0.1,
            grad_scale: 0.5,
        };
        let name = |g: usize| format!("w{g}");
        let stored = StoredLayout {
            groups,
            n,
            k,
            spec: spec(),
            name: &name,
            version: 0,
        };
        let run = |fused: bool| {
            let mut p = cb.upload_f32(&master).unwrap();
            let gd = cb.upload_f32(&grad).unwrap();
            let mut m = cb.upload_f32(&m0).unwrap();
            let mut v = cb.upload_f32(&v0).unwrap();
            let mut copy = cb.zeros_bf16(len).unwrap();
            let q = if fused {
                cb.adamw_requantize(
                    &mut p,
                    &gd,
                    &mut m,
                    &mut v,
                    &update,
                    Some(&mut copy),
                    &stored,
                )
            } else {
                adamw_then_quantize(
                    &cb,
                    &mut p,
                    &gd,
                    &mut m,
                    &mut v,
                    &update,
                    Some(&mut copy),
                    &stored,
                )
            }
            .unwrap();
            let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (
                bits(cb.download_f32(&p, len).unwrap()),
                bits(cb.download_f32(&m, len).unwrap()),
                bits(cb.download_f32(&v, len).unwrap()),
                cb.download_bf16(&copy, len).unwrap(),
                cb.stored_weights(&q).unwrap(),
            )
        };
        let (fused, plain) = (run(true), run(false));
        assert!(fused.0 == plain.0, "master");
        assert!(fused.1 == plain.1, "m");
        assert!(fused.2 == plain.2, "v");
        assert!(fused.3 == plain.3, "BF16 copy");
        assert!(fused.4 == plain.4, "stored bytes");
        let new_master: Vec<f32> = fused.0.iter().map(|&b| f32::from_bits(b)).collect();
        let qc = CpuBackend
            .quantize_weights(&new_master, groups, n, k, spec(), &name, 0)
            .unwrap();
        assert!(
            CpuBackend.stored_weights(&qc).unwrap() == fused.4,
            "the CPU's bytes for the new master"
        );
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

/// The FP8-block GEMM kernels (`Fp8Block`) on stored codes against the CPU reference
/// `PreparedWeight::forward_inference`.
#[cfg(feature = "cuda")]
mod gemm_kernels {
    use super::engine_backend::{bounds, check};
    use cudarc::driver::CudaSlice;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::fp8block::{fp8_frag_split, Fp8Block, Fp8FragMma};
    use mxrl_cuda::ops::gemm::Grouped;
    use mxrl_cuda::ops::qgemm::{frag_rows, FragRows, QGemm, FP8_ROUTED_STAGES_PICK, FP8_STAGES};
    use mxrl_formats::{
        e4m3_decode, Format, Padding, QuantizedTensor, ScaleLayout, Scales, Scheme,
    };
    use mxrl_tensor::gradcheck::test_values;
    use mxrl_tensor::qlinear::{BackwardMode, LinearSpec, PreparedWeight};
    use rand::seq::index::sample;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::sync::Mutex;

    static SERIAL: Mutex<()> = Mutex::new(());

    /// Bits written to `y` before each call: rows of no expert must keep them.
    const SENTINEL: u32 = 0x7fc0_0bad;

    fn ops() -> (Gpu, Fp8Block) {
        let g = Gpu::shared(0)
            .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"));
        let f = Fp8Block::new(&g).expect("FP8-block kernels");
        assert!(
            f.frag_supported(),
            "{}: the FP8-block fragment kernels need sm_89+",
            g.name()
        );
        (g, f)
    }

    /// The kernels under test: the tiled kernels, and the fragment kernels with a tensor-core
    /// variant, rows per pass and split (`None`: the launcher's choices).
    #[derive(Debug, Clone, Copy)]
    enum Kernel {
        Tiled,
        Frag(Fp8FragMma, Option<(FragRows, usize)>),
        /// The staged kernels (`QGemm::grouped_nt_staged_fp8_block_with`) with rows per pass
        /// (`None`: the launcher's choice) and stages.
        Staged(Option<FragRows>, usize),
    }

    /// The staged kernels' activation operand on the host: the binary16 bits of each code's
    /// E4M3 value (exact).
    fn f16_operand(codes: &[u8]) -> Vec<u16> {
        codes
            .iter()
            .map(|&c| half::f16::from_f32(e4m3_decode(c)).to_bits())
            .collect()
    }

    /// One grouped problem: per-expert stored weights and host-quantized activations.
    struct Problem {
        s: Grouped,
        offsets: Vec<u32>,
        weights: Vec<QuantizedTensor>,
        x: Vec<f32>,
        seed: u64,
        wc: CudaSlice<u8>,
        ws: CudaSlice<u8>,
        xc: CudaSlice<u8>,
        xs: CudaSlice<u8>,
        /// The staged kernels' operand: binary16 code values and the f32 scale_inv.
        xh: CudaSlice<u16>,
        xsf: CudaSlice<f32>,
        off: CudaSlice<u32>,
    }

    fn le_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    fn f32_scales(q: &QuantizedTensor) -> &[f32] {
        match &q.scales {
            Scales::F32(v) => v,
            Scales::Bytes(_) => panic!("FP8-block scales are f32"),
        }
    }

    impl Problem {
        /// `rows` activation rows (offsets `offsets`, R = `rows` ≥ offsets[E]), weights
        /// `weights` (one per expert), activations `x [rows, k]` quantized on the host.
        fn new(
            g: &Gpu,
            offsets: Vec<u32>,
            rows: usize,
            weights: Vec<QuantizedTensor>,
            x: Vec<f32>,
            seed: u64,
        ) -> Self {
            let (n, k) = (weights[0].shape[0], weights[0].shape[1]);
            let qx = mxrl_formats::quantize(&x, &[rows, k], Scheme::FP8_BLOCK_ACT, Padding::Reject)
                .expect("activation quantize");
            let mut codes = Vec::with_capacity(weights.len() * n * k);
            let mut scales = Vec::new();
            for w in &weights {
                codes.extend_from_slice(&w.data);
                scales.extend(le_bytes(f32_scales(w)));
            }
            let up = |v: &[u8]| g.upload(v).expect("upload");
            Problem {
                s: Grouped {
                    experts: weights.len(),
                    rows,
                    n,
                    k,
                },
                wc: up(&codes),
                ws: up(&scales),
                xc: up(&qx.data),
                xs: up(&le_bytes(f32_scales(&qx))),
                xh: g.upload(&f16_operand(&qx.data)).expect("upload"),
                xsf: g.upload(f32_scales(&qx)).expect("upload"),
                off: g.upload(&offsets).expect("upload"),
                offsets,
                weights,
                x,
                seed,
            }
        }

        /// `y` of `kernel` (rows of no expert hold SENTINEL).
        fn run(&self, g: &Gpu, f: &Fp8Block, kernel: Kernel) -> Vec<f32> {
            let mut y = g
                .upload(&vec![f32::from_bits(SENTINEL); self.s.rows * self.s.n])
                .expect("upload");
            let (xc, xs, wc, ws) = (
                self.xc.as_view(),
                self.xs.as_view(),
                self.wc.as_view(),
                self.ws.as_view(),
            );
            let off = self.off.as_view();
            let mut yv = y.as_view_mut();
            match kernel {
                Kernel::Tiled => f.gemm_nt(&xc, &xs, &wc, &ws, Some(&off), &mut yv, self.s),
                Kernel::Frag(mma, choice) => {
                    let (rows, split) = choice.unwrap_or((
                        FragRows::for_rows(self.s.rows, self.s.experts, FragRows::R32),
                        fp8_frag_split(self.s),
                    ));
                    f.gemm_nt_frag_with(mma, rows, split, &xc, &xs, &wc, &ws, &off, &mut yv, self.s)
                }
                Kernel::Staged(rows, stages) => QGemm::new(g)
                    .expect("low-byte kernels")
                    .grouped_nt_staged_fp8_block_with(
                        rows.unwrap_or_else(|| frag_rows(self.s, None)),
                        stages,
                        &self.xh.as_view(),
                        &self.xsf.as_view(),
                        &wc,
                        &ws,
                        &off,
                        &mut yv,
                        self.s,
                    ),
            }
            .unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
            g.download(&y).expect("download")
        }

        /// Rows `[a, b)` of expert `e`.
        fn rows_of(&self, e: usize) -> (usize, usize) {
            let hi = (self.offsets[e + 1] as usize).min(self.s.rows);
            ((self.offsets[e] as usize).min(hi), hi)
        }

        /// The rows the CPU checks: every row when `every`, else each expert's first and last
        /// rows, those on either side of its 32-row passes, and every 17th.
        fn checked_rows(&self, e: usize, every: bool) -> Vec<usize> {
            let (a, b) = self.rows_of(e);
            (a..b)
                .filter(|&r| {
                    let i = r - a;
                    every || i == 0 || r + 1 == b || i % 32 == 0 || i % 32 == 31 || r % 17 == 0
                })
                .collect()
        }

        /// The CPU reference on the checked rows: per expert with rows, those rows, `y` and
        /// the per-entry bound.
        fn reference(&self, every: bool) -> Vec<Checked> {
            let k = self.s.k;
            let spec = LinearSpec::new(Format::Fp8Block, BackwardMode::Dequantized).unwrap();
            let mut out = Vec::new();
            for (e, w) in self.weights.iter().enumerate() {
                let rows = self.checked_rows(e, every);
                if rows.is_empty() {
                    continue;
                }
                let xs: Vec<f32> = rows
                    .iter()
                    .flat_map(|&r| self.x[r * k..(r + 1) * k].iter().copied())
                    .collect();
                let pw = PreparedWeight::from_quantized("w", w.clone(), spec, 0, None)
                    .expect("prepared weight");
                let want = pw
                    .forward_inference(&xs, rows.len())
                    .expect("CPU reference");
                let bound = bounds(&xs, rows.len(), w);
                out.push(Checked {
                    expert: e,
                    rows,
                    want,
                    bound,
                });
            }
            out
        }

        /// `kernel`'s `y` within `fp8_block_sum_bound` of the CPU reference `want` on its
        /// rows; rows of no expert untouched. Returns `y`.
        fn check_against(
            &self,
            g: &Gpu,
            f: &Fp8Block,
            kernel: Kernel,
            want: &[Checked],
        ) -> Vec<f32> {
            let y = self.run(g, f, kernel);
            let n = self.s.n;
            for c in want {
                let got: Vec<f32> = c
                    .rows
                    .iter()
                    .flat_map(|&r| y[r * n..(r + 1) * n].iter().copied())
                    .collect();
                check(
                    &format!(
                        "{kernel:?} {:?} expert {} rows {:?}",
                        self.s, c.expert, c.rows
                    ),
                    &got,
                    &c.want,
                    &c.bound,
                    self.seed,
                );
            }
            let covered = self.offsets[self.s.experts] as usize;
            for r in covered.min(self.s.rows)..self.s.rows {
                assert!(
                    y[r * n..(r + 1) * n]
                        .iter()
                        .all(|v| v.to_bits() == SENTINEL),
                    "{kernel:?} {:?}: row {r} of no expert was written (seed {})",
                    self.s,
                    self.seed
                );
            }
            y
        }
    }

    /// The CPU reference on some rows of one expert.
    struct Checked {
        expert: usize,
        rows: Vec<usize>,
        want: Vec<f32>,
        bound: Vec<f64>,
    }

    /// Random stored FP8-block weights `[n, k]`: codes without NaN, every 128×128 tile its own
    /// `scale_inv` (magnitudes 2⁻¹² .. 2⁴).
    fn random_weight(n: usize, k: usize, rng: &mut ChaCha8Rng) -> QuantizedTensor {
        let mut data = vec![0u8; n * k];
        rng.fill(&mut data[..]);
        for c in &mut data {
            if *c & 0x7F == 0x7F {
                *c -= 1;
            }
        }
        let tiles = (n / 128) * (k / 128);
        let scales: Vec<f32> = (0..tiles)
            .map(|_| rng.gen_range(1.0f32..2.0) * 2f32.powi(rng.gen_range(-12..5)))
            .collect();
        let q = QuantizedTensor {
            scheme: Scheme::FP8_BLOCK_WEIGHT,
            shape: vec![n, k],
            padded_shape: vec![n, k],
            data,
            scales: Scales::F32(scales),
            scale_layout: ScaleLayout::Compact,
            amax: Vec::new(),
        };
        q.validate().expect("valid FP8-block weight");
        q
    }

    /// `tokens` tokens each routed to 8 distinct random experts of `experts`: offsets.
    fn routed(experts: usize, tokens: usize, rng: &mut ChaCha8Rng) -> Vec<u32> {
        let mut counts = vec![0u32; experts];
        for _ in 0..tokens {
            for e in sample(rng, experts, 8) {
                counts[e] += 1;
            }
        }
        let mut o = vec![0u32];
        for c in counts {
            o.push(o.last().unwrap() + c);
        }
        o
    }

    fn decode_problem(
        g: &Gpu,
        experts: usize,
        n: usize,
        k: usize,
        batch: usize,
        seed: u64,
    ) -> Problem {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let offsets = routed(experts, batch, &mut rng);
        let rows = batch * 8;
        let weights = (0..experts)
            .map(|_| random_weight(n, k, &mut rng))
            .collect();
        let x = test_values(rows * k, seed + 1, 3.0);
        Problem::new(g, offsets, rows, weights, x, seed)
    }

    /// Decode steps of the benchmark model's routed experts (fused gate/up [1536, 2048] and
    /// down [2048, 768]) at batch 1, 32, 128 (128 experts) and 512 (64 rows per expert on
    /// average: two 32-row passes): both fragment variants with the launcher's choices and
    /// the tiled kernels within the bound of the CPU reference; the fragment kernels give the
    /// same bits on a second run, and the staged kernels the bits of the `F16` fragments.
    #[test]
    fn fp8_block_fragment_kernels_match_the_cpu_at_decode_batches() {
        let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (g, f) = ops();
        for (i, &(experts, n, k, batch)) in [
            (64usize, 1536usize, 2048usize, 1usize),
            (64, 2048, 768, 1),
            (64, 2048, 768, 32),
            (64, 1536, 2048, 32),
            (128, 1536, 2048, 128),
            (64, 2048, 768, 512),
        ]
        .iter()
        .enumerate()
        {
            let seed = 9100 + i as u64;
            let p = decode_problem(&g, experts, n, k, batch, seed);
            let want = p.reference(batch <= 32);
            for mma in Fp8FragMma::ALL {
                let y = p.check_against(&g, &f, Kernel::Frag(mma, None), &want);
                let y2 = p.run(&g, &f, Kernel::Frag(mma, None));
                assert!(
                    y.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{mma:?} {:?}: two runs differ (seed {seed})",
                    p.s
                );
            }
            if batch >= 32 {
                p.check_against(&g, &f, Kernel::Tiled, &want);
            }
            let frag = p.run(&g, &f, Kernel::Frag(Fp8FragMma::F16, None));
            let staged =
                p.check_against(&g, &f, Kernel::Staged(None, FP8_ROUTED_STAGES_PICK), &want);
            assert!(
                staged
                    .iter()
                    .zip(&frag)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{:?}: the staged kernels' bits differ from the F16 fragments' (seed {seed})",
                p.s
            );
        }
    }

    /// Ragged groups: experts without rows, 1, 7–9, 15–17, 31–33 and 65 rows (every pass
    /// boundary of 8, 16 and 32 rows), rows after the last expert's (left untouched); K of one
    /// block up to 16 blocks (more blocks than warps: several rounds). Every split 1 ..= 8 and
    /// every rows per pass give the same bits as the launcher's choice, within the bound; so
    /// do the staged kernels in passes of 8 to 64 rows (experts over several passes, passes
    /// run at half their token groups).
    #[test]
    fn fp8_block_fragment_kernels_on_ragged_groups_for_every_split_and_pass() {
        let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (g, f) = ops();
        let counts = [0u32, 1, 7, 8, 9, 0, 15, 16, 17, 31, 32, 33, 65, 0];
        let mut offsets = vec![0u32];
        for c in counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        let rows = *offsets.last().unwrap() as usize + 5;
        for (i, &(n, k)) in [(256usize, 128usize), (128, 384), (256, 2048)]
            .iter()
            .enumerate()
        {
            let seed = 9200 + i as u64;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let weights = (0..counts.len())
                .map(|_| random_weight(n, k, &mut rng))
                .collect();
            let x = test_values(rows * k, seed + 1, 2.0);
            let p = Problem::new(&g, offsets.clone(), rows, weights, x, seed);
            let want = p.reference(true);
            for mma in Fp8FragMma::ALL {
                let y = p.check_against(&g, &f, Kernel::Frag(mma, None), &want);
                for fr in mxrl_cuda::ops::fp8block::FRAG_PASSES {
                    for split in 1..=8 {
                        let y2 = p.run(&g, &f, Kernel::Frag(mma, Some((fr, split))));
                        assert!(
                            y.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{mma:?} [{n}, {k}] {fr:?} split {split}: bits differ from the launcher's choice (seed {seed})"
                        );
                    }
                }
            }
            p.check_against(&g, &f, Kernel::Tiled, &want);
            let frag = p.run(&g, &f, Kernel::Frag(Fp8FragMma::F16, None));
            for fr in [
                None,
                Some(FragRows::R8),
                Some(FragRows::R16),
                Some(FragRows::R32),
                Some(FragRows::R64),
            ] {
                for stages in FP8_STAGES {
                    let y = p.check_against(&g, &f, Kernel::Staged(fr, stages), &want);
                    assert!(
                        y.iter().zip(&frag).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "staged {fr:?}, {stages} stages [{n}, {k}]: bits differ from the F16 \
                         fragments' (seed {seed})"
                    );
                }
            }
        }
    }

    /// Block sums that f32 holds exactly: per 128-wide block 32 products of E4M3 values in
    /// 256 ..= 448 (multiples of 2¹⁰ up to 448²) and 96 odd products of odd integers ≤ 15, all
    /// positive, so every partial sum is an integer below 2²³ that needs up to 23 significant
    /// bits; block scales are powers of two (exact promotion products). Any f32 summation
    /// order gives the exact P_b, so every kernel must equal the CPU reference bit for bit —
    /// a tensor core that summed with fewer bits than f32 (or a promotion out of order) fails.
    #[test]
    fn fp8_block_kernels_are_exact_where_f32_block_sums_are() {
        let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (g, f) = ops();
        let seed = 9300;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (n, k) = (256usize, 512usize);
        let offsets = vec![0u32, 8, 8, 29, 30];
        let rows = 30;
        let big = [256.0f32, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0];
        let odd = [1.0f32, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0];
        let value = |i: usize, rng: &mut ChaCha8Rng| -> f32 {
            match i % 128 {
                0 => 448.0,
                1..=31 => big[rng.gen_range(0..big.len())],
                _ => odd[rng.gen_range(0..odd.len())],
            }
        };
        let x: Vec<f32> = (0..rows * k)
            .map(|i| value(i % k, &mut rng) * 2f32.powi(((i / k + i % k / 128) % 5) as i32 - 2))
            .collect();
        let master: Vec<f32> = (0..4 * n * k)
            .map(|i| {
                let (row, c) = (i / k, i % k);
                value(c, &mut rng) * 2f32.powi(((row / 128 + c / 128) % 3) as i32 - 1)
            })
            .collect();
        let weights: Vec<QuantizedTensor> = master
            .chunks(n * k)
            .map(|w| {
                mxrl_formats::quantize(w, &[n, k], Scheme::FP8_BLOCK_WEIGHT, Padding::Reject)
                    .unwrap()
            })
            .collect();
        // The design holds: codes are the values, scales the powers of two.
        for (e, w) in weights.iter().enumerate() {
            for (i, &c) in w.data.iter().enumerate() {
                let (row, col) = (i / k, i % k);
                let s = 2f32.powi((((e * n + row) / 128 + col / 128) % 3) as i32 - 1);
                assert_eq!(
                    e4m3_decode(c) * s,
                    master[e * n * k + i],
                    "weight code {i} of {e}"
                );
            }
            assert!(f32_scales(w).iter().all(|s| [0.5f32, 1.0, 2.0].contains(s)));
        }
        let p = Problem::new(&g, offsets, rows, weights, x, seed);
        let spec = LinearSpec::new(Format::Fp8Block, BackwardMode::Dequantized).unwrap();
        let mut kernels = vec![Kernel::Tiled];
        for fr in FragRows::ALL {
            for stages in FP8_STAGES {
                kernels.push(Kernel::Staged(Some(fr), stages));
            }
        }
        for mma in Fp8FragMma::ALL {
            for split in [1, 2, 3, 4, 8] {
                kernels.push(Kernel::Frag(mma, Some((FragRows::R8, split))));
                kernels.push(Kernel::Frag(mma, Some((FragRows::R32, split))));
            }
        }
        for kernel in kernels {
            let y = p.run(&g, &f, kernel);
            for (e, w) in p.weights.iter().enumerate() {
                let (a, b) = p.rows_of(e);
                if a == b {
                    continue;
                }
                let pw = PreparedWeight::from_quantized("w", w.clone(), spec, 0, None).unwrap();
                let want = pw.forward_inference(&p.x[a * k..b * k], b - a).unwrap();
                for (i, (got, want)) in y[a * n..b * n].iter().zip(&want).enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{kernel:?} expert {e} row {} column {}: {got} vs the CPU's {want} (seed {seed})",
                        a + i / n,
                        i % n
                    );
                }
            }
        }
    }

    /// The staged kernels' activation quantizer (`QGemm::quant_act_fp8_block`) on every data
    /// family of the quantizer tests, both scale rules: the binary16 operand is the E4M3 value
    /// of `mxrl_formats::quantize`'s code (NaN codes NaN) and the scales its `scale_inv` bit
    /// for bit.
    #[test]
    fn fp8_block_staged_operand_quantizer_matches_the_reference() {
        let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _f) = ops();
        let q = QGemm::new(&g).expect("low-byte kernels");
        let (rows, k) = (37usize, 640usize);
        for (fi, fam) in super::FAMILIES.iter().enumerate() {
            let x = super::family(fam, rows, k, 9400 + fi as u64);
            let xd = g.upload(&x).expect("upload");
            for scheme in super::schemes() {
                let mxrl_formats::Scheme::Fp8Block(fs) = scheme else {
                    unreachable!()
                };
                if fs.blocks != mxrl_formats::Fp8Blocks::Activation1x128 {
                    continue;
                }
                let want = mxrl_formats::quantize(&x, &[rows, k], scheme, Padding::Reject)
                    .expect("reference");
                let mut out = g.upload(&vec![0xFFFFu16; rows * k]).expect("upload");
                let mut sc = g.upload(&vec![f32::NAN; rows * k / 128]).expect("upload");
                q.quant_act_fp8_block(
                    &xd.as_view(),
                    rows,
                    k,
                    fs.scale_rule == mxrl_formats::ScaleRule::F32PowerOfTwo,
                    &mut out.as_view_mut(),
                    &mut sc.as_view_mut(),
                )
                .expect("quant_act_fp8_block");
                let (out, sc) = (g.download(&out).unwrap(), g.download(&sc).unwrap());
                for (i, (&h, &c)) in out.iter().zip(&want.data).enumerate() {
                    let (got, v) = (half::f16::from_bits(h).to_f32(), e4m3_decode(c));
                    assert!(
                        got.to_bits() == v.to_bits() || (got.is_nan() && v.is_nan()),
                        "{fam} {scheme}: element {i}: operand {got} for code {c:#04x} ({v})"
                    );
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&sc),
                    bits(f32_scales(&want)),
                    "{fam} {scheme}: scale_inv"
                );
            }
        }
    }

    /// Up to three dense weights in one launch (`QGemm::dense_nt_staged_fp8_block_multi`, the
    /// layer's q, k and v): each output has the bits of the weight's own one-expert staged
    /// launch over every row (offsets `[0, u32::MAX]`, clamped to the rows), which are within
    /// the bound of the CPU reference, for every stage count; 5, 37, 300 and 1100 rows (one
    /// pass and several, spread over up to 18 blocks per column block), one to three weights of
    /// 256, 128 and 384 columns.
    #[test]
    fn fp8_block_staged_dense_weights_in_one_launch() {
        let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _f) = ops();
        let q = QGemm::new(&g).expect("low-byte kernels");
        let k = 384usize;
        let ns = [256usize, 128, 384];
        let whole = g.upload(&[0u32, u32::MAX]).expect("upload");
        let spec = LinearSpec::new(Format::Fp8Block, BackwardMode::Dequantized).unwrap();
        for (i, &rows) in [5usize, 37, 300, 1100].iter().enumerate() {
            let seed = 9500 + i as u64;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let weights: Vec<QuantizedTensor> =
                ns.iter().map(|&n| random_weight(n, k, &mut rng)).collect();
            let x = test_values(rows * k, seed + 1, 2.0);
            let qx = mxrl_formats::quantize(&x, &[rows, k], Scheme::FP8_BLOCK_ACT, Padding::Reject)
                .expect("activation quantize");
            let xh = g.upload(&f16_operand(&qx.data)).expect("upload");
            let xs = g.upload(f32_scales(&qx)).expect("upload");
            let codes: Vec<CudaSlice<u8>> = weights
                .iter()
                .map(|w| g.upload(&w.data).expect("upload"))
                .collect();
            let scales: Vec<CudaSlice<u8>> = weights
                .iter()
                .map(|w| g.upload(&le_bytes(f32_scales(w))).expect("upload"))
                .collect();
            let sentinel = |n: usize| {
                g.upload(&vec![f32::from_bits(SENTINEL); rows * n])
                    .expect("upload")
            };
            // Each weight alone, checked against the CPU.
            let mut singles = Vec::new();
            for (j, w) in weights.iter().enumerate() {
                let n = ns[j];
                let mut y = sentinel(n);
                q.grouped_nt_staged_fp8_block(
                    &xh.as_view(),
                    &xs.as_view(),
                    &codes[j].as_view(),
                    &scales[j].as_view(),
                    &whole.as_view(),
                    &mut y.as_view_mut(),
                    Grouped {
                        experts: 1,
                        rows,
                        n,
                        k,
                    },
                )
                .expect("staged FP8 block, one weight");
                let y = g.download(&y).expect("download");
                let pw = PreparedWeight::from_quantized("w", w.clone(), spec, 0, None).unwrap();
                let want = pw.forward_inference(&x, rows).unwrap();
                check(
                    &format!("dense weight {j} [{n}, {k}] over {rows} rows"),
                    &y,
                    &want,
                    &bounds(&x, rows, w),
                    seed,
                );
                singles.push(y);
            }
            for (count, stages) in (1..=3).flat_map(|c| FP8_STAGES.map(|st| (c, st))) {
                let mut ys: Vec<CudaSlice<f32>> =
                    ns[..count].iter().map(|&n| sentinel(n)).collect();
                let mut outs: Vec<_> = ys
                    .iter_mut()
                    .enumerate()
                    .map(|(j, y)| {
                        (
                            codes[j].as_view(),
                            scales[j].as_view(),
                            y.as_view_mut(),
                            ns[j],
                        )
                    })
                    .collect();
                q.dense_nt_staged_fp8_block_multi_with(
                    stages,
                    &xh.as_view(),
                    &xs.as_view(),
                    &whole.as_view(),
                    &mut outs,
                    rows,
                    k,
                )
                .expect("staged FP8 block, weights in one launch");
                drop(outs);
                for (j, y) in ys.iter().enumerate() {
                    let y = g.download(y).expect("download");
                    assert!(
                        y.iter()
                            .zip(&singles[j])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{count} weights in one launch ({stages} stages), weight {j} over {rows} \
                         rows: bits differ from its own launch (seed {seed})"
                    );
                }
            }
        }
    }
}
