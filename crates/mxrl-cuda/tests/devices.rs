//! Quantizers on every device against the named CPU reference
//! (`mxrl_formats::reference::quantize`) and the public vector file — byte equality.
//!
//! Each `test_device!` expands to a `cpu` test and, with `--features cuda`, a `cuda` test on
//! GPU 0 that fails (never skips) when no GPU is usable.

use half::bf16;
use mxrl_cuda::{test_device, Input, QuantDevice};
use mxrl_formats::{reference, Padding, QuantizedTensor, Scheme};
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

const SCHEMES: [Scheme; 4] = [
    Scheme::MXFP8_ROW,
    Scheme::MXFP8_COL,
    Scheme::NVFP4_TENSOR,
    Scheme::NVFP4_ROW,
];

/// `<repo root>/vectors`, or `$MXRL_VECTORS_DIR` when the tests run from a copied binary
/// (test data location only; nothing numeric depends on it).
fn vectors_dir() -> PathBuf {
    std::env::var_os("MXRL_VECTORS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../vectors"))
}

fn applies(scheme: Scheme, shape: [usize; 2]) -> bool {
    match scheme {
        Scheme::MXFP8_ROW => shape[1].is_multiple_of(32),
        Scheme::MXFP8_COL => shape[0].is_multiple_of(32),
        _ => shape[1].is_multiple_of(16),
    }
}

/// Compare with the reference byte for byte (amax by bit pattern), naming what differs.
fn assert_same(dev: &dyn QuantDevice, got: &QuantizedTensor, want: &QuantizedTensor, what: &str) {
    assert_eq!(got.scheme, want.scheme, "{} {what}: scheme", dev.name());
    assert_eq!(got.shape, want.shape, "{} {what}: shape", dev.name());
    if got.data != want.data {
        let i = got
            .data
            .iter()
            .zip(&want.data)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "{} {what}: data differ first at byte {i}: {:#04x} vs reference {:#04x}",
            dev.name(),
            got.data.get(i).copied().unwrap_or(0),
            want.data.get(i).copied().unwrap_or(0)
        );
    }
    assert_eq!(got.scales, want.scales, "{} {what}: scales", dev.name());
    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got.amax),
        bits(&want.amax),
        "{} {what}: amax",
        dev.name()
    );
}

fn check_all(dev: &dyn QuantDevice, x: Input<'_>, shape: [usize; 2], what: &str) {
    for scheme in SCHEMES {
        if !applies(scheme, shape) {
            continue;
        }
        let want = match x {
            Input::F32(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
            Input::Bf16(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
        }
        .unwrap();
        let got = dev.quantize(x, shape, scheme).unwrap();
        assert_same(dev, &got, &want, &format!("{what} {scheme} {shape:?}"));
        if scheme != Scheme::MXFP8_COL {
            let d = dev.dequantize(&got).unwrap();
            let r = want.dequantize().unwrap();
            // Bit for bit, except that every NaN counts as one value: NaN payloads are not part
            // of the contract (x86 yields 0xFFC00000 for 0·∞, an NVIDIA GPU 0x7FFFFFFF).
            let b = |v: &[f32]| {
                v.iter()
                    .map(|a| if a.is_nan() { u32::MAX } else { a.to_bits() })
                    .collect::<Vec<_>>()
            };
            assert_eq!(b(&d), b(&r), "{} {what} {scheme}: dequantize", dev.name());
        }
    }
}

/// Families of the contract's test data plus special values.
fn family(name: &str, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = rows * cols;
    match name {
        "random" => (0..n)
            .map(|i| {
                let scale = 2f32.powi((i / cols % 9) as i32 * 6 - 24);
                r.gen_range(-1.0f32..1.0) * scale
            })
            .collect(),
        "boundary" => (0..n)
            .map(|i| {
                let j = (i % cols) as f32 / cols as f32;
                -12.0 + 24.0 * j + if i % 2 == 0 { 1e-3 } else { -1e-3 }
            })
            .collect(),
        "zeros" => vec![0.0; n],
        "maxes" => vec![f32::MAX; n],
        "special" => (0..n)
            .map(|i| match i % 11 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                4 => f32::from_bits(1), // smallest subnormal
                5 => 1e-36,
                6 => 464.0, // E4M3 satfinite tie
                7 => -449.0,
                8 => f32::MIN_POSITIVE,
                _ => r.gen_range(-3.0f32..3.0),
            })
            .collect(),
        _ => unreachable!(),
    }
}

test_device!(families_match_the_reference, |dev| {
    // Odd row counts leave partial warps (NVFP4: 1×16 is half a warp). Column-wise on the
    // GPU: 64×96 and 32×20 the register kernel for both dtypes (8 bytes of columns per
    // thread), 32×18 the register kernel for f32 and the one-column kernel for BF16
    // (K % 4 ≠ 0), 32×17 the one-column kernel for both. Per-row NVFP4: 3×2096 (131 blocks)
    // leaves the register chunks partly filled, 2×65552 has rows longer than the register
    // cache (4 blocks per thread, threads limited by the kernel's registers), whose rest is read
    // again.
    for (rows, cols) in [
        (1, 16),
        (3, 48),
        (64, 96),
        (32, 256),
        (32, 18),
        (32, 20),
        (32, 17),
        (3, 2096),
        (2, 65552),
    ] {
        for (i, fam) in ["random", "boundary", "zeros", "maxes", "special"]
            .iter()
            .enumerate()
        {
            let x = family(fam, rows, cols, 100 + i as u64);
            check_all(dev, Input::F32(&x), [rows, cols], &format!("f32 {fam}"));
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            check_all(dev, Input::Bf16(&xb), [rows, cols], &format!("bf16 {fam}"));
        }
    }
});

test_device!(every_bf16_value_matches_the_reference, |dev| {
    // All 65,536 BF16 patterns (NaNs, infinities, subnormals included) as a [2048, 32] tensor,
    // in two orders so each value meets different block-mates.
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut shuffled = all.clone();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, r.gen_range(0..=i));
    }
    check_all(dev, Input::Bf16(&all), [2048, 32], "all bf16 (in order)");
    check_all(
        dev,
        Input::Bf16(&shuffled),
        [2048, 32],
        "all bf16 (shuffled)",
    );
});

test_device!(public_vectors_match, |dev| {
    let path = vectors_dir().join("quant-public.safetensors");
    let raw = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "vector file {} is missing or unreadable: {e}",
            path.display()
        )
    });
    let st = SafeTensors::deserialize(&raw).expect("vector file parses");
    let (_, meta) = SafeTensors::read_metadata(&raw).expect("header");
    let manifest = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("manifest"))
        .expect("manifest");
    let cases: Vec<serde_json::Value> = serde_json::from_str(manifest).expect("manifest JSON");
    let mut compared = 0;
    for case in &cases {
        let c = case["case"].as_str().unwrap();
        let t = st.tensor(&format!("{c}/x")).unwrap();
        let shape = [t.shape()[0], t.shape()[1]];
        let (xf, xb): (Vec<f32>, Vec<bf16>) = match t.dtype() {
            Dtype::F32 => (
                t.data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                Vec::new(),
            ),
            Dtype::BF16 => (
                Vec::new(),
                t.data()
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            other => panic!("{c}: unexpected input dtype {other:?}"),
        };
        let x = if xb.is_empty() {
            Input::F32(&xf)
        } else {
            Input::Bf16(&xb)
        };
        for out in case["outputs"].as_array().unwrap() {
            let name = out.as_str().unwrap();
            let Some(scheme) = Scheme::from_name(name) else {
                continue;
            };
            if !SCHEMES.contains(&scheme) {
                continue; // 2-D tiles: not a kernel of this device
            }
            let q = dev.quantize(x, shape, scheme).unwrap();
            let bytes = |n: &str| {
                st.tensor(&format!("{c}/{name}.{n}"))
                    .unwrap()
                    .data()
                    .to_vec()
            };
            assert_eq!(q.data, bytes("data"), "{} {c} {name}: data", dev.name());
            assert_eq!(
                q.scales.as_bytes().unwrap(),
                bytes("scale"),
                "{} {c} {name}: scale",
                dev.name()
            );
            if name.starts_with("nvfp4") {
                let amax: Vec<u8> = q.amax.iter().flat_map(|a| a.to_le_bytes()).collect();
                assert_eq!(amax, bytes("amax"), "{} {c} {name}: amax", dev.name());
            }
            compared += 1;
        }
    }
    assert!(compared >= 100, "only {compared} outputs compared");
});

test_device!(bad_shapes_are_refused_with_the_dimension, |dev| {
    let x = vec![1.0f32; 3 * 40];
    let e = dev
        .quantize(Input::F32(&x), [3, 40], Scheme::MXFP8_ROW)
        .unwrap_err();
    assert!(e.to_string().contains("K = 40"), "{e}");
    let e = dev
        .quantize(Input::F32(&x), [3, 40], Scheme::MXFP8_COL)
        .unwrap_err();
    assert!(e.to_string().contains("M = 3"), "{e}");
});

/// The GPU's emulated MXFP8 GEMM (contract dequantization + cuBLAS SGEMM, pedantic math)
/// against the exact sum of the contract's dequantized operands.
#[cfg(feature = "cuda")]
#[test]
fn mxfp8_gemm_is_the_f32_sum_of_the_contract_operands() {
    let dev = mxrl_cuda::CudaDevice::shared(0).expect("CUDA device 0");
    let (m, k, n) = (96, 512, 80);
    let x = family("random", m, k, 11);
    let w = family("random", n, k, 12);
    let q = |v: &[f32], r: usize| {
        let d = dev.upload(Input::F32(v)).unwrap();
        dev.quantize_device(&d, [r, k], Scheme::MXFP8_ROW).unwrap()
    };
    let y = dev
        .download_f32(&dev.mxfp8_gemm_nt(&q(&x, m), &q(&w, n)).unwrap())
        .unwrap();
    let deq = |v: &[f32], r: usize| {
        reference::quantize(v, &[r, k], Scheme::MXFP8_ROW, Padding::Reject)
            .unwrap()
            .dequantize()
            .unwrap()
    };
    let (xd, wd) = (deq(&x, m), deq(&w, n));
    // Products of two dequantized MXFP8 values are exact in f32 (≤ 4 + 4 significant bits,
    // power-of-two scales, all in the normal range for this data), so any f32 summation order
    // is within γ_{K−1}·Σ|x̂ŵ| of the exact sum, γ_p = p·u/(1 − p·u), u = 2⁻²⁴ (Higham 3.4).
    // The reference sum is taken in f64; its own error (≤ (K−1)·2⁻⁵³·Σ|x̂ŵ| < 2⁻⁴⁰·Σ|x̂ŵ| for
    // K = 512) is added to the bound.
    let u = 2f64.powi(-24);
    let gamma = (k - 1) as f64 * u / (1.0 - (k - 1) as f64 * u);
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let t = xd[i * k + p] as f64 * wd[j * k + p] as f64;
                exact += t;
                mag += t.abs();
            }
            let d = (y[i * n + j] as f64 - exact).abs();
            assert!(
                d <= (gamma + 2f64.powi(-40)) * mag,
                "({i},{j}): {} vs {exact}",
                y[i * n + j]
            );
        }
    }
}

/// The GPU's emulated NVFP4 GEMM against the CPU linear layer (`mxrl_tensor::qlinear`), per-
/// token and per-tensor activations: same operands and α, different summation order.
#[cfg(feature = "cuda")]
#[test]
fn nvfp4_gemm_matches_the_cpu_linear() {
    use mxrl_formats::{e2m1_decode, e4m3_decode, Format};
    use mxrl_tensor::qlinear::{ActScaling, BackwardMode, LinearSpec, PreparedWeight};
    let dev = mxrl_cuda::CudaDevice::shared(0).expect("CUDA device 0");
    let (m, k, n) = (40, 256, 48);
    let x = family("random", m, k, 21);
    let w = family("random", n, k, 22);
    for scaling in [ActScaling::PerToken, ActScaling::PerTensor] {
        let spec = LinearSpec::new(Format::Nvfp4, BackwardMode::Dequantized)
            .unwrap()
            .with_act_scaling(scaling)
            .unwrap();
        let cpu = PreparedWeight::quantize("t", &w, n, k, spec, 0)
            .unwrap()
            .forward_inference(&x, m)
            .unwrap();
        let xs = spec.activation_scheme().unwrap();
        let dq = |v: &[f32], r: usize, s: Scheme| {
            let d = dev.upload(Input::F32(v)).unwrap();
            dev.quantize_device(&d, [r, k], s).unwrap()
        };
        let (qa, qb) = (dq(&x, m, xs), dq(&w, n, Scheme::NVFP4_TENSOR));
        let gpu = dev
            .download_f32(&dev.nvfp4_gemm_nt(&qa, &qb).unwrap())
            .unwrap();
        // Bound: both sum the same exact products a'b' (a' = e2m1·sf) in f32, so the sums
        // differ by ≤ 2γ_{K−1}·Σ|a'b'|; both scale by the same f32 α and round once more
        // (≤ u·|y| each): |Δy| ≤ |α|·2γ_{K−1}·Σ|a'b'|·(1 + u) + u·(|y_gpu| + |y_cpu|).
        let pre = |v: &[f32], r: usize, s: Scheme| -> (Vec<f32>, Vec<f32>) {
            let q = reference::quantize(v, &[r, k], s, Padding::Reject).unwrap();
            let sc = q.scales.as_bytes().unwrap();
            let p = (0..r * k)
                .map(|i| e2m1_decode(q.data[i / 2] >> (4 * (i % 2))) * e4m3_decode(sc[i / 16]))
                .collect();
            (p, q.amax)
        };
        let ((pa, aa), (pb, ab)) = (pre(&x, m, xs), pre(&w, n, Scheme::NVFP4_TENSOR));
        let u = 2f64.powi(-24);
        let g = (k - 1) as f64 * u / (1.0 - (k - 1) as f64 * u);
        for i in 0..m {
            let alpha =
                mxrl_tensor::qlinear::nvfp4_alpha(if aa.len() == 1 { aa[0] } else { aa[i] }, ab[0]);
            for j in 0..n {
                let mag: f64 = (0..k)
                    .map(|p| (pa[i * k + p] as f64 * pb[j * k + p] as f64).abs())
                    .sum();
                let (yg, yc) = (gpu[i * n + j] as f64, cpu[i * n + j] as f64);
                let tol =
                    alpha.abs() as f64 * 2.0 * g * mag * (1.0 + u) + u * (yg.abs() + yc.abs());
                assert!(
                    (yg - yc).abs() <= tol,
                    "{scaling:?} ({i},{j}): gpu {yg} cpu {yc} tol {tol}"
                );
            }
        }
    }
}

/// Quantizer throughput against a device-to-device copy in the same run (H200 numbers in
/// BENCHMARKS.md): `cargo test -p mxrl-cuda --features cuda --release -- --ignored --nocapture`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "GPU benchmark; run explicitly"]
fn quantizer_throughput() {
    let dev = mxrl_cuda::CudaDevice::shared(0).expect("CUDA device 0");
    eprintln!(
        "device {} options {:?} key {}",
        dev.name(),
        dev.nvrtc_options(),
        dev.module_key()
    );
    let (rows, cols) = (8192, 8192);
    let x = family("random", rows, cols, 1);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    for scheme in SCHEMES {
        for input in [Input::Bf16(&xb), Input::F32(&x)] {
            let t = dev.time_quantize(input, [rows, cols], scheme, 20).unwrap();
            println!(
                "THROUGHPUT {} {} {:?}: quantize {:.3} ms {:.0} GB/s | memcpy {:.3} ms {:.0} GB/s | ratio {:.2}",
                t.scheme,
                t.dtype,
                t.shape,
                t.quantize_ms,
                t.quantize_gbps(),
                t.memcpy_ms,
                t.memcpy_gbps(),
                t.quantize_gbps() / t.memcpy_gbps()
            );
        }
    }
}

/// Quantizing into preallocated outputs (what the throughput benchmark times) gives the
/// reference's bytes, also when the buffers are reused for a second input.
#[cfg(feature = "cuda")]
#[test]
fn cuda_quantize_into_reused_outputs_matches_the_reference() {
    let dev = mxrl_cuda::CudaDevice::shared(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}"));
    let shape = [64, 2096];
    for scheme in SCHEMES {
        if !applies(scheme, shape) {
            continue;
        }
        let mut out = dev.alloc_quantized(shape, scheme).unwrap();
        for (i, fam) in ["random", "special", "zeros"].iter().enumerate() {
            let x = family(fam, shape[0], shape[1], 300 + i as u64);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            for input in [Input::F32(&x), Input::Bf16(&xb)] {
                let dx = dev.upload(input).unwrap();
                dev.quantize_device_into(&dx, shape, scheme, &mut out)
                    .unwrap();
                let got = dev.download(&out).unwrap();
                let want = match input {
                    Input::F32(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
                    Input::Bf16(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
                }
                .unwrap();
                assert_same(&*dev, &got, &want, &format!("into {fam} {scheme}"));
            }
        }
        let wrong = if scheme == Scheme::MXFP8_ROW {
            Scheme::MXFP8_COL
        } else {
            Scheme::MXFP8_ROW
        };
        let dx = dev.upload(Input::F32(&vec![0.0; 64 * 2096])).unwrap();
        assert!(dev
            .quantize_device_into(&dx, shape, wrong, &mut out)
            .is_err());
    }
}

/// NVFP4 with an amax computed by the device's amax kernel and passed in
/// (`CudaDevice::amax` + `CudaDevice::nvfp4_with_amax`, the one-thread-per-block kernel with
/// per-row or per-tensor amax) gives the reference's bytes.
#[cfg(feature = "cuda")]
#[test]
fn cuda_nvfp4_with_precomputed_amax_matches_the_reference() {
    use mxrl_formats::AmaxScope;
    let dev = mxrl_cuda::CudaDevice::shared(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}"));
    for shape in [[3, 48], [64, 2096]] {
        for (i, fam) in ["random", "boundary", "special", "maxes"]
            .iter()
            .enumerate()
        {
            let x = family(fam, shape[0], shape[1], 500 + i as u64);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            for input in [Input::F32(&x), Input::Bf16(&xb)] {
                for (scope, scheme) in [
                    (AmaxScope::PerTensor, Scheme::NVFP4_TENSOR),
                    (AmaxScope::PerRow, Scheme::NVFP4_ROW),
                ] {
                    let dx = dev.upload(input).unwrap();
                    let amax = dev.amax(&dx.view(), shape, scope).unwrap();
                    let q = dev.nvfp4_with_amax(&dx.view(), shape, scope, amax).unwrap();
                    let got = dev.download(&q).unwrap();
                    let want = match input {
                        Input::F32(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
                        Input::Bf16(v) => reference::quantize(v, &shape, scheme, Padding::Reject),
                    }
                    .unwrap();
                    assert_same(&*dev, &got, &want, &format!("with amax {fam} {scheme}"));
                }
            }
        }
    }
}

/// Every compiled variant of the per-row NVFP4 kernel (16-blocks per thread kept in registers)
/// writes the reference's bytes: the launcher's default is picked by speed, so each must be
/// exact. 3×2096 leaves the register chunks partly filled; 2×16400 and 2×65552 give rows
/// longer than the register cache of the small variants, whose rest is read again.
#[cfg(feature = "cuda")]
#[test]
fn cuda_nvfp4_row_variants_match_the_reference() {
    let dev = mxrl_cuda::CudaDevice::new(0).expect("GPU 0 (the cuda feature's tests need one)");
    for &chunks in &mxrl_cuda::NVFP4_ROW_CHUNKS {
        dev.set_nvfp4_row_chunks(Some(chunks)).unwrap();
        for (rows, cols) in [(1, 16), (5, 48), (3, 2096), (2, 16400), (2, 65552)] {
            for (i, fam) in ["random", "boundary", "special"].iter().enumerate() {
                let x = family(fam, rows, cols, 300 + i as u64);
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                for input in [Input::F32(&x), Input::Bf16(&xb)] {
                    let want = match input {
                        Input::F32(v) => reference::quantize(
                            v,
                            &[rows, cols],
                            Scheme::NVFP4_ROW,
                            Padding::Reject,
                        ),
                        Input::Bf16(v) => reference::quantize(
                            v,
                            &[rows, cols],
                            Scheme::NVFP4_ROW,
                            Padding::Reject,
                        ),
                    }
                    .unwrap();
                    let got = dev
                        .quantize(input, [rows, cols], Scheme::NVFP4_ROW)
                        .unwrap();
                    let dtype = if matches!(input, Input::F32(_)) {
                        "f32"
                    } else {
                        "bf16"
                    };
                    assert_same(
                        &dev,
                        &got,
                        &want,
                        &format!("{chunks} blocks per thread, {dtype} {fam} [{rows}, {cols}]"),
                    );
                }
            }
        }
    }
    assert!(
        dev.set_nvfp4_row_chunks(Some(3)).is_err(),
        "an uncompiled variant is refused"
    );
}
