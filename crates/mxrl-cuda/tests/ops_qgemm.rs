//! The low-byte decode family (`mxrl_cuda::ops::qgemm`) on the GPU against the contract library
//! (`mxrl_formats`) and the CPU emulation of the quantized linear (`mxrl_tensor::qlinear`):
//!
//! - activation quantizers: every BF16 value (and NVFP4 row amax) equals, bit for bit, the
//!   library's quantization turned into the GEMM operand (MXFP8: `QuantizedTensor::dequantize`;
//!   NVFP4: `e2m1 · e4m3(scale)`, the `pre` operand of `qlinear`), on random, zero, max,
//!   boundary, special-value and per-row-scale families and ragged K; the documented BF16 limit
//!   of MXFP8 is checked from both sides (blocks just above it are exact, blocks of amax 1e−36
//!   are rounded to nearest even, as documented);
//! - decoders: every E4M3 code under scale bytes across the whole range, and every E2M1 code
//!   under every block scale, through the weight dequantizers;
//! - grouped small-M GEMMs on the stored bytes (every lane split and the launcher's pick)
//!   against `PreparedWeight::forward_inference` per expert, within
//!   `two_order_sum_bound(K, Σ|x·w|)` (exact products, only the f32 summation order differs;
//!   NVFP4: `|α|·two_order_sum_bound(K + 1, ·)`, the last term for the final `fl(acc·α)`), on
//!   ragged expert row counts with 0-row experts and rows of no expert, R from 1 to 256;
//! - the tensor-core kernels on stored bytes (weights decoded in shared memory, or straight into
//!   mma fragments with the reduction split over warps) within `tensor_core_sum_bound`;
//! - the large-M path (dequantized weights, the tensor-core grouped GEMM, NVFP4's α per row);
//! - replay in a CUDA graph (no allocation, no host round trip) bitwise equal to direct calls;
//! - launchers refuse short buffers and bad K / N with errors naming the buffer or the rule.
//!
//! Outputs are pre-filled with NaN so that an entry a kernel forgets fails, and rows of no
//! expert must stay NaN. Seeds are fixed and printed with every failure. The tests of this file
//! run one at a time (one of them records the stream into a graph).
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::gemm::{Gemm, Grouped};
use mxrl_cuda::ops::moe::Moe;
use mxrl_cuda::ops::qgemm::{
    frag_layout, frag_rows, mxfp8_fast_eligible, ActRows, FragLayout, FragRows, LowByte,
    Mxfp8Decode, QGemm, QLanes, MXFP8_FAST_MAX_SCALE,
};
use mxrl_cuda::ops::swiglu::Swiglu;
use mxrl_formats::{
    e2m1_decode, e4m3_decode, quantize, Format, Padding, QuantizedTensor, ScaleLayout, Scales,
    Scheme,
};
use mxrl_tensor::gradcheck::{gamma, test_values};
use mxrl_tensor::qlinear::{nvfp4_alpha, BackwardMode, LinearSpec, PreparedWeight};
use mxrl_tensor::tolerance::{tensor_core_sum_bound, two_order_sum_bound};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[path = "common/grouped.rs"]
mod grouped;
use grouped::{routed, Case};
use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU and this file's lock (tests run one at a time: one captures the stream).
fn gpu() -> (MutexGuard<'static, ()>, Gpu) {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = Gpu::shared(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"));
    (guard, g)
}

/// BF16 bit pattern of an f32, round to nearest even (NaN stays NaN): the host twin of the
/// kernels' `f32_to_bf16`.
fn bf16_bits(v: f32) -> u16 {
    bf16::from_f32(v).to_bits()
}

fn is_bf16_exact(v: f32) -> bool {
    v.is_nan() || v.to_bits() & 0xFFFF == 0
}

fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Entries where `got` (BF16 bits) differs from `want` (BF16 bits), NaN matching any NaN.
fn bf16_mismatches(got: &[u16], want: &[u16]) -> Vec<usize> {
    (0..want.len())
        .filter(|&i| {
            let (g, w) = (widen(got[i]), widen(want[i]));
            !(got[i] == want[i] || (g.is_nan() && w.is_nan()))
        })
        .collect()
}

fn spec(f: LowByte) -> LinearSpec {
    let format = match f {
        LowByte::Mxfp8 => Format::Mxfp8,
        LowByte::Nvfp4 => Format::Nvfp4,
    };
    LinearSpec::new(format, BackwardMode::Dequantized).expect("spec")
}

/// The NVFP4 GEMM operand of a quantized tensor: `e2m1_value(code) · e4m3_value(scale)` per
/// element (`qlinear`'s `Operand::Nvfp4 { pre }`; exact).
fn nvfp4_pre(q: &QuantizedTensor) -> Vec<f32> {
    let q = q
        .clone()
        .with_scale_layout(ScaleLayout::Compact)
        .expect("compact");
    let (rows, k) = (q.shape[0], q.shape[1]);
    let Scales::Bytes(scales) = &q.scales else {
        panic!("NVFP4 scales are bytes")
    };
    let mut out = Vec::with_capacity(rows * k);
    for i in 0..rows {
        for j in 0..k {
            let code = (q.data[i * (k / 2) + j / 2] >> (4 * (j % 2))) & 0xF;
            out.push(e2m1_decode(code) * e4m3_decode(scales[i * (k / 16) + j / 16]));
        }
    }
    out
}

/// The library's activation operand of `x [rows, k]`: the f32 values the CPU GEMM multiplies
/// and, for NVFP4, the per-row amax.
fn act_operand(f: LowByte, x: &[f32], rows: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    match f {
        LowByte::Mxfp8 => {
            let q = quantize(x, &[rows, k], Scheme::MXFP8_ROW, Padding::Reject).expect("mxfp8");
            (q.dequantize().expect("dequantize"), Vec::new())
        }
        LowByte::Nvfp4 => {
            let q = quantize(x, &[rows, k], Scheme::NVFP4_ROW, Padding::Reject).expect("nvfp4");
            (nvfp4_pre(&q), q.amax[..rows].to_vec())
        }
    }
}

// ---------------------------------------------------------------- activation quantizers

/// Input families `(name, x, every library value BF16-exact)` for `[rows, k]`.
fn act_families(rows: usize, k: usize, seed: u64) -> Vec<(String, Vec<f32>, bool)> {
    let n = rows * k;
    let mut out = vec![
        ("random ±2".to_string(), test_values(n, seed, 2.0), true),
        (
            "random ±3e-3".to_string(),
            test_values(n, seed + 1, 3e-3),
            true,
        ),
        ("zeros".to_string(), vec![0.0; n], true),
        (
            "maxes".to_string(),
            (0..n)
                .map(|i| if i % 3 == 0 { -f32::MAX } else { f32::MAX })
                .collect(),
            true,
        ),
    ];
    // Rows at scales 2^-40 .. 2^40 (per-row amax; blocks of very different scale bytes).
    let mut scaled = test_values(n, seed + 2, 1.0);
    for r in 0..rows {
        let s = 2f32.powi(((r * 23) % 81) as i32 - 40);
        for v in &mut scaled[r * k..(r + 1) * k] {
            *v *= s;
        }
    }
    out.push(("row scales 2^-40..2^40".into(), scaled, true));
    // The contract's boundary family: linspace(−12, 12, K/2) ± 1e-3, repeated per row.
    let half = k / 2;
    let boundary: Vec<f32> = (0..rows)
        .flat_map(|_| {
            (0..half).flat_map(move |i| {
                let t = -12.0 + 24.0 * i as f32 / (half.max(2) - 1) as f32;
                [t - 1e-3, t + 1e-3]
            })
        })
        .collect();
    out.push(("boundary".into(), boundary, true));
    // NaN, ±Inf and −0 among ordinary values.
    let mut specials = test_values(n, seed + 3, 4.0);
    for (i, v) in specials.iter_mut().enumerate() {
        match i % 37 {
            0 => *v = f32::NAN,
            5 => *v = f32::INFINITY,
            11 => *v = f32::NEG_INFINITY,
            17 => *v = -0.0,
            _ => {}
        }
    }
    out.push(("specials".into(), specials, true));
    // Just above MXFP8's BF16 limit: every 32-block's amax is 1.5·448·2^-125 (scale byte 3),
    // so its values reach down to BF16's smallest subnormal 2^-133 and are still exact.
    let limit = 1.5 * 448.0 * 2f32.powi(-125);
    let mut near = test_values(n, seed + 4, limit);
    for v in near.iter_mut().step_by(32) {
        *v = limit;
    }
    out.push(("MXFP8 BF16 limit (scale byte 3)".into(), near, true));
    // Below it: block amax 1e-36 (scale byte 0) and elements down to 2^-15.5 of it: the small
    // MXFP8 values need bits below 2^-133 and are rounded to nearest-even BF16 (documented);
    // NVFP4 is unaffected.
    let tiny: Vec<f32> = test_values(n, seed + 5, 1.0)
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let m = if i % 32 == 0 {
                1.0
            } else {
                0.5 + 0.5 * r.abs()
            };
            let v = 1e-36 * m * 2f32.powf(-((i % 32) as f32) / 2.0);
            if r < 0.0 {
                -v
            } else {
                v
            }
        })
        .collect();
    out.push(("tiny 1e-36".into(), tiny, false));
    out
}

fn act_shapes(f: LowByte) -> Vec<(usize, usize)> {
    let ks: &[usize] = match f {
        LowByte::Mxfp8 => &[32, 96, 160, 2048],
        LowByte::Nvfp4 => &[16, 48, 96, 160, 2048],
    };
    let mut v = Vec::new();
    for &k in ks {
        for rows in [1usize, 5, 33] {
            v.push((rows, k));
        }
    }
    v
}

/// First mismatches of an activation comparison, with the input and the library's values.
fn act_report(
    what: &str,
    x: &[f32],
    k: usize,
    lib: &[f32],
    got: &[u16],
    want: &[u16],
    bad: &[usize],
) -> String {
    let mut s = format!("{what}: {} of {} values differ", bad.len(), want.len());
    for &i in bad.iter().take(8) {
        s += &format!(
            "\n  [{}, {}] x = {:e}: library {:e} ({:#010x}) → want bf16 {:#06x}, got {:#06x} ({:e})",
            i / k,
            i % k,
            x[i],
            lib[i],
            lib[i].to_bits(),
            want[i],
            got[i],
            widen(got[i])
        );
    }
    s
}

#[test]
fn mxfp8_activation_values_equal_the_contract_library() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    for (si, (rows, k)) in act_shapes(LowByte::Mxfp8).into_iter().enumerate() {
        for (name, x, exact) in act_families(rows, k, 100 + si as u64) {
            let what = format!("quant_act_mxfp8 {name} [{rows}, {k}] (seed {})", 100 + si);
            let (lib, _) = act_operand(LowByte::Mxfp8, &x, rows, k);
            let inexact = lib.iter().filter(|v| !is_bf16_exact(**v)).count();
            if exact {
                assert_eq!(inexact, 0, "{what}: library values not exact in BF16");
            } else if name.starts_with("tiny") {
                assert!(inexact > 0, "{what}: the family exercises no BF16 rounding");
            }
            let want: Vec<u16> = lib.iter().map(|&v| bf16_bits(v)).collect();
            let dx = g.upload(&x).unwrap();
            let mut out = g.upload(&vec![0xFFFFu16; rows * k]).unwrap();
            ops.quant_act_mxfp8(&dx.as_view(), rows, k, &mut out.as_view_mut())
                .unwrap();
            let got = g.download(&out).unwrap();
            let bad = bf16_mismatches(&got, &want);
            assert!(
                bad.is_empty(),
                "{}",
                act_report(&what, &x, k, &lib, &got, &want, &bad)
            );
        }
    }
}

#[test]
fn nvfp4_activation_values_and_row_amax_equal_the_contract_library() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    for (si, (rows, k)) in act_shapes(LowByte::Nvfp4).into_iter().enumerate() {
        for (name, x, _) in act_families(rows, k, 200 + si as u64) {
            let what = format!("quant_act_nvfp4 {name} [{rows}, {k}] (seed {})", 200 + si);
            let (lib, amax) = act_operand(LowByte::Nvfp4, &x, rows, k);
            // NVFP4 operands are always exact in BF16 (≤ 6 significant bits in [2^-10, 2688]).
            assert!(
                lib.iter().all(|v| is_bf16_exact(*v)),
                "{what}: library values not exact in BF16"
            );
            let want: Vec<u16> = lib.iter().map(|&v| bf16_bits(v)).collect();
            let dx = g.upload(&x).unwrap();
            // One quantizer (BF16 or binary16 operand) into fresh buffers of 0xFFFF and NaN.
            let run = |f16_operand: bool| {
                let mut pre = g.upload(&vec![0xFFFFu16; rows * k]).unwrap();
                let mut damax = g.upload(&vec![f32::NAN; rows]).unwrap();
                let (xv, mut pv, mut av) = (dx.as_view(), pre.as_view_mut(), damax.as_view_mut());
                if f16_operand {
                    ops.quant_act_nvfp4_f16(&xv, rows, k, &mut pv, &mut av)
                } else {
                    ops.quant_act_nvfp4(&xv, rows, k, &mut pv, &mut av)
                }
                .unwrap();
                (g.download(&pre).unwrap(), g.download(&damax).unwrap())
            };
            let (got, got_amax) = run(false);
            for r in 0..rows {
                assert_eq!(
                    got_amax[r].to_bits(),
                    amax[r].to_bits(),
                    "{what}: row {r} amax {:e}, library {:e}",
                    got_amax[r],
                    amax[r]
                );
            }
            let bad = bf16_mismatches(&got, &want);
            assert!(
                bad.is_empty(),
                "{}",
                act_report(&what, &x, k, &lib, &got, &want, &bad)
            );
            // The fragment kernels' binary16 operand: the same values, the same amax.
            let what16 = format!(
                "quant_act_nvfp4_f16 {name} [{rows}, {k}] (seed {})",
                200 + si
            );
            assert!(
                lib.iter()
                    .all(|&v| v.is_nan() || f16::from_f32(v).to_f32().to_bits() == v.to_bits()),
                "{what16}: library values not exact in binary16"
            );
            let want16: Vec<u16> = lib.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            let (got16, got_amax16) = run(true);
            assert!(
                got_amax16
                    .iter()
                    .zip(&got_amax)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what16}: row amax differs from quant_act_nvfp4's"
            );
            // NaN matches any NaN, as for BF16.
            let bad16: Vec<usize> = (0..want16.len())
                .filter(|&i| {
                    let (a, b) = (f16::from_bits(got16[i]), f16::from_bits(want16[i]));
                    !(got16[i] == want16[i] || (a.is_nan() && b.is_nan()))
                })
                .collect();
            assert!(
                bad16.is_empty(),
                "{what16}: {} of {} values differ, first at {} (got {:#06x}, library {:#06x} = {:e})",
                bad16.len(),
                want16.len(),
                bad16[0],
                got16[bad16[0]],
                want16[bad16[0]],
                lib[bad16[0]]
            );
        }
    }
}

// ---------------------------------------------------------------- weight dequantization

/// A dispatch built on the host: `tokens · top_k` slots with random experts, slot `s` of
/// token `s / top_k` dropped (expert id `experts`, placed nowhere) when `drop` says so;
/// `perm` lists the placed slots expert by expert (slot order within an expert, as the
/// device's dispatch orders them), `offsets` the experts' ranges; the entries of `perm` past
/// `offsets[experts]` are arbitrary (here `u32::MAX`, which a kernel must never read).
fn host_dispatch(
    tokens: usize,
    top_k: usize,
    experts: usize,
    seed: u64,
    drop: impl Fn(usize) -> bool,
) -> (Vec<u32>, Vec<u32>) {
    use rand::Rng;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let slots = tokens * top_k;
    let ids: Vec<usize> = (0..slots)
        .map(|s| {
            if drop(s) {
                experts
            } else {
                rng.gen_range(0..experts)
            }
        })
        .collect();
    let mut perm = Vec::with_capacity(slots);
    let mut offsets = vec![0u32];
    for e in 0..experts {
        perm.extend((0..slots).filter(|&s| ids[s] == e).map(|s| s as u32));
        offsets.push(perm.len() as u32);
    }
    perm.resize(slots, u32::MAX);
    (perm, offsets)
}

#[test]
fn fused_activation_quantizers_equal_the_ops_they_replace_bitwise() {
    // Each fused quantizer (the routed rows read through the dispatch's permutation; SwiGLU
    // computed in the quantizer) against the ops it replaces — Moe::gather or Swiglu::forward
    // into a buffer, then the plain quantizer — bit for bit, on every value family; rows past
    // offsets[E] (dropped slots) must stay as they were. K past 2048 takes the NVFP4
    // quantizer's second read of a row (its register cache holds 2048 values).
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let moe = Moe::new(&g).unwrap();
    let sw = Swiglu::new(&g).unwrap();
    let (top_k, experts) = (3usize, 5usize);
    for f in LowByte::ALL {
        let ks: &[usize] = match f {
            LowByte::Mxfp8 => &[32, 160, 768, 2048, 2080],
            LowByte::Nvfp4 => &[16, 96, 768, 2048, 2064, 4096],
        };
        for (ki, &k) in ks.iter().enumerate() {
            for tokens in [1usize, 5, 33] {
                let rows = tokens * top_k;
                let seed = 700 + 10 * ki as u64 + tokens as u64;
                // Every fourth slot of the larger batches dropped.
                let (perm, offsets) =
                    host_dispatch(tokens, top_k, experts, seed, |s| tokens > 1 && s % 4 == 1);
                let placed = offsets[experts] as usize;
                let (dperm, doffs) = (g.upload(&perm).unwrap(), g.upload(&offsets).unwrap());
                let x_families = act_families(tokens, k, seed);
                let gu_families = act_families(rows, 2 * k, seed + 5);
                for ((name, x, _), (gname, gu, _)) in x_families.iter().zip(&gu_families) {
                    let dx = g.upload(x).unwrap();
                    let dgu = g.upload(gu).unwrap();
                    // The rows the unfused ops write: gathered (NaN past `placed`) and SwiGLU.
                    let mut xg = g.upload(&vec![f32::NAN; rows * k]).unwrap();
                    moe.gather(
                        &dx.as_view(),
                        &dperm.as_view(),
                        &doffs.as_view(),
                        &mut xg.as_view_mut(),
                        tokens,
                        k,
                        experts,
                        top_k,
                    )
                    .unwrap();
                    let mut h = g.upload(&vec![f32::NAN; rows * k]).unwrap();
                    sw.forward(&dgu.as_view(), &mut h.as_view_mut(), None, rows, k)
                        .unwrap();
                    let (xv, pv, ov) = (dx.as_view(), dperm.as_view(), doffs.as_view());
                    let gather = ActRows::Gather {
                        x: &xv,
                        tokens,
                        perm: &pv,
                        offsets: &ov,
                        experts,
                        top_k,
                    };
                    let guv = dgu.as_view();
                    let swiglu = ActRows::Swiglu(&guv);
                    let (xgv, hv) = (xg.as_view(), h.as_view());
                    let cases = [
                        (format!("gathered {name}"), &gather, &xgv, placed),
                        (format!("SwiGLU of {gname}"), &swiglu, &hv, rows),
                    ];
                    for (what, src, plain, valid) in cases {
                        let what = format!("{f:?} {what} [{rows}, {k}] (seed {seed})");
                        let plain_src = ActRows::Rows(plain);
                        for f16 in match f {
                            LowByte::Mxfp8 => vec![false],
                            LowByte::Nvfp4 => vec![false, true],
                        } {
                            // Both into buffers of 0xFFFF / NaN; the plain run's rows past
                            // `valid` are quantized from NaN and not compared.
                            let run = |src: &ActRows<'_, '_>| {
                                let mut pre = g.upload(&vec![0xFFFFu16; rows * k]).unwrap();
                                let mut am = g.upload(&vec![f32::NAN; rows]).unwrap();
                                let (mut p, mut a) = (pre.as_view_mut(), am.as_view_mut());
                                match f {
                                    LowByte::Mxfp8 => {
                                        ops.quant_act_mxfp8_from(src, rows, k, &mut p)
                                    }
                                    LowByte::Nvfp4 => {
                                        ops.quant_act_nvfp4_from(src, f16, rows, k, &mut p, &mut a)
                                    }
                                }
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                                (g.download(&pre).unwrap(), g.download(&am).unwrap())
                            };
                            let (got, got_amax) = run(src);
                            let (want, want_amax) = run(&plain_src);
                            let what = format!("{what}{}", if f16 { " (binary16)" } else { "" });
                            let bad = (0..valid * k).find(|&i| got[i] != want[i]);
                            assert!(
                                bad.is_none(),
                                "{what}: element {:?} is {:#06x}, the unfused ops give {:#06x}",
                                bad,
                                got[bad.unwrap_or(0)],
                                want[bad.unwrap_or(0)]
                            );
                            assert!(
                                got[valid * k..].iter().all(|&b| b == 0xFFFF),
                                "{what}: a row past the {valid} placed rows was written"
                            );
                            if f == LowByte::Nvfp4 {
                                for r in 0..rows {
                                    let (a, b) = (got_amax[r], want_amax[r]);
                                    if r < valid {
                                        assert_eq!(
                                            a.to_bits(),
                                            b.to_bits(),
                                            "{what}: row {r} amax {a:e}, unfused {b:e}"
                                        );
                                    } else {
                                        assert!(
                                            a.is_nan(),
                                            "{what}: amax of unplaced row {r} written"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn mxfp8_weight_dequantization_decodes_every_code_under_every_scale_range() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    // Row i: all 256 codes under scale byte S[i] (every block of the row): zero, the BF16
    // limit (0..3), ordinary scales, the top of the range and the NaN scale.
    let s: [u8; 14] = [0, 1, 2, 3, 4, 64, 100, 120, 127, 134, 135, 200, 254, 255];
    let (n, k) = (s.len(), 256usize);
    let codes: Vec<u8> = (0..n).flat_map(|_| 0..=255u8).collect();
    let scales: Vec<u8> = s.iter().flat_map(|&b| [b; 8]).collect();
    let q = QuantizedTensor {
        scheme: Scheme::MXFP8_ROW,
        shape: vec![n, k],
        padded_shape: vec![n, k],
        data: codes.clone(),
        scales: Scales::Bytes(scales.clone()),
        scale_layout: ScaleLayout::Compact,
        amax: Vec::new(),
    };
    let lib = q.dequantize().expect("library dequantize");
    let want: Vec<u16> = lib.iter().map(|&v| bf16_bits(v)).collect();
    let (dc, ds) = (g.upload(&codes).unwrap(), g.upload(&scales).unwrap());
    let mut out = g.upload(&vec![0xFFFFu16; n * k]).unwrap();
    ops.dequant_weights_mxfp8(
        &dc.as_view(),
        &ds.as_view(),
        &mut out.as_view_mut(),
        1,
        n,
        k,
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    let bad = bf16_mismatches(&got, &want);
    let mut msg = format!("dequant_weights_mxfp8: {} of {} differ", bad.len(), n * k);
    for &i in bad.iter().take(8) {
        msg += &format!(
            "\n  scale {:#04x} code {:#04x}: library {:e} → bf16 {:#06x}, got {:#06x}",
            scales[i / 32],
            codes[i],
            lib[i],
            want[i],
            got[i]
        );
    }
    assert!(bad.is_empty(), "{msg}");
}

#[test]
fn nvfp4_weight_dequantization_decodes_every_code_under_every_block_scale() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    // Row i: the 16 codes (each twice, both nibble positions) under block scale byte i, for
    // every UE4M3 byte 0x00 ..= 0x7F (0x7F is E4M3's NaN).
    let (n, k) = (128usize, 32usize);
    let codes: Vec<u8> = (0..n)
        .flat_map(|_| (0..16u8).map(|c| c | (((c + 5) & 0xF) << 4)))
        .collect();
    let scales: Vec<u8> = (0..n as u8).flat_map(|b| [b, b]).collect();
    let want_f: Vec<f32> = (0..n * k)
        .map(|i| {
            let code = (codes[i / 2] >> (4 * (i % 2))) & 0xF;
            e2m1_decode(code) * e4m3_decode(scales[i / 16])
        })
        .collect();
    assert!(want_f.iter().all(|v| is_bf16_exact(*v)));
    let want: Vec<u16> = want_f.iter().map(|&v| bf16_bits(v)).collect();
    let (dc, ds) = (g.upload(&codes).unwrap(), g.upload(&scales).unwrap());
    let mut out = g.upload(&vec![0xFFFFu16; n * k]).unwrap();
    ops.dequant_weights_nvfp4(
        &dc.as_view(),
        &ds.as_view(),
        &mut out.as_view_mut(),
        1,
        n,
        k,
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    let bad = bf16_mismatches(&got, &want);
    let mut msg = format!("dequant_weights_nvfp4: {} of {} differ", bad.len(), n * k);
    for &i in bad.iter().take(8) {
        msg += &format!(
            "\n  scale {:#04x} code {:#x}: want {:e} ({:#06x}), got {:#06x}",
            scales[i / 16],
            (codes[i / 2] >> (4 * (i % 2))) & 0xF,
            want_f[i],
            want[i],
            got[i]
        );
    }
    assert!(bad.is_empty(), "{msg}");
}

// ---------------------------------------------------------------- grouped GEMMs

/// Routed experts' weights in one format: the stored bytes of every expert back to back (as
/// `CudaBackend::upload_experts` lays them out), the CPU layers built from those bytes only (as
/// the rollout gets them) and the f32 operand values the CPU GEMM multiplies.
struct QExperts {
    codes: Vec<u8>,
    scales: Vec<u8>,
    amax: Vec<f32>,
    layers: Vec<PreparedWeight>,
    operand: Vec<f32>,
}

fn quantize_experts(f: LowByte, e: usize, n: usize, k: usize, seed: u64) -> QExperts {
    let spec = spec(f);
    let mut w = QExperts {
        codes: Vec::new(),
        scales: Vec::new(),
        amax: Vec::new(),
        layers: Vec::new(),
        operand: Vec::new(),
    };
    for i in 0..e {
        // Experts of different magnitudes (different per-tensor amax, scale bytes).
        let scale = 0.05 * 2f32.powi((i % 5) as i32 - 2);
        let values = test_values(n * k, seed * 1000 + i as u64, scale);
        let name = format!("expert{i}");
        let pw = PreparedWeight::quantize(&name, &values, n, k, spec, 0).expect("quantize");
        let q = pw
            .stored()
            .expect("stored bytes")
            .clone()
            .with_scale_layout(ScaleLayout::Compact)
            .expect("compact");
        let Scales::Bytes(sb) = &q.scales else {
            panic!("byte scales")
        };
        w.codes.extend_from_slice(&q.data);
        w.scales.extend_from_slice(sb);
        match f {
            LowByte::Mxfp8 => w.operand.extend(q.dequantize().expect("dequantize")),
            LowByte::Nvfp4 => {
                assert_eq!(q.amax.len(), 1);
                w.amax.push(q.amax[0]);
                w.operand.extend(nvfp4_pre(&q));
            }
        }
        w.layers
            .push(PreparedWeight::from_quantized(&name, q, spec, 0, None).expect("from bytes"));
    }
    if w.amax.is_empty() {
        w.amax.push(0.0);
    }
    w
}

/// Ragged rows (0-row experts, passes of 8 and one more, rows of no expert, N off the block
/// width), a batch-1 and a batch-32 decode step of the benchmark model's routing (K = 2048 and
/// 768: the 32- and the 16/8-lane splits), one dense row, 256 rows of one expert, and random
/// shapes.
fn gemm_cases() -> Vec<(u64, Case)> {
    let mut v = vec![
        (
            1,
            Case {
                counts: vec![0, 1, 7, 8, 9, 0, 17, 3],
                n: 72,
                k: 96,
                extra: 2,
            },
        ),
        (2, routed(1, 2, 96, 2048)),
        // Fewer rows than half the experts, one row of no expert: the fragment grid takes a
        // block row per row, each on the next busy expert (qgemm::frag_expert_rows).
        (
            7,
            Case {
                counts: vec![0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0, 0],
                n: 64,
                k: 64,
                extra: 1,
            },
        ),
        (3, routed(32, 3, 68, 768)),
        (
            4,
            Case {
                counts: vec![1],
                n: 40,
                k: 160,
                extra: 0,
            },
        ),
        (
            5,
            Case {
                counts: vec![256],
                n: 12,
                k: 64,
                extra: 0,
            },
        ),
        (
            6,
            Case {
                counts: vec![0, 0, 3],
                n: 4,
                k: 32,
                extra: 5,
            },
        ),
    ];
    for seed in 10..14u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        use rand::Rng;
        let e = [3usize, 20][rng.gen_range(0..2)];
        let counts = (0..e)
            .map(|_| {
                if rng.gen_bool(0.3) {
                    0
                } else {
                    rng.gen_range(1..=12)
                }
            })
            .collect();
        v.push((
            seed,
            Case {
                counts,
                n: 4 * rng.gen_range(1..=40),
                k: 32 * rng.gen_range(1..=12),
                extra: rng.gen_range(0..3),
            },
        ));
    }
    v
}

/// The CPU emulation per expert (`forward_inference` on the expert's f32 rows; rows of no
/// expert NaN) and the per-entry bound.
fn reference(f: LowByte, c: &Case, x: &[f32], w: &QExperts) -> (Vec<f32>, Vec<f64>) {
    let (n, k, rows) = (c.n, c.k, c.rows());
    let (xo, xamax) = act_operand(f, x, rows, k);
    let off = c.offsets();
    let mut want = vec![f32::NAN; rows * n];
    let mut bound = vec![0.0f64; rows * n];
    for (e, &cnt) in c.counts.iter().enumerate() {
        if cnt == 0 {
            continue;
        }
        let r0 = off[e] as usize;
        let y = w.layers[e]
            .forward_inference(&x[r0 * k..(r0 + cnt) * k], cnt)
            .expect("forward_inference");
        want[r0 * n..(r0 + cnt) * n].copy_from_slice(&y);
        for r in r0..r0 + cnt {
            let xr = &xo[r * k..(r + 1) * k];
            for j in 0..n {
                let wr = &w.operand[(e * n + j) * k..(e * n + j + 1) * k];
                let s: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                bound[r * n + j] = match f {
                    LowByte::Mxfp8 => two_order_sum_bound(k, s),
                    LowByte::Nvfp4 => {
                        (nvfp4_alpha(xamax[r], w.amax[e]) as f64).abs()
                            * two_order_sum_bound(k + 1, s)
                    }
                };
            }
        }
    }
    (want, bound)
}

/// Device buffers of one problem: x (f32 input and its quantized operand), weights, offsets.
struct Dev {
    x: cudarc::driver::CudaSlice<f32>,
    xq: cudarc::driver::CudaSlice<u16>,
    xamax: cudarc::driver::CudaSlice<f32>,
    codes: cudarc::driver::CudaSlice<u8>,
    scales: cudarc::driver::CudaSlice<u8>,
    wamax: cudarc::driver::CudaSlice<f32>,
    off: cudarc::driver::CudaSlice<u32>,
    y: cudarc::driver::CudaSlice<f32>,
}

fn upload(g: &Gpu, c: &Case, x: &[f32], w: &QExperts) -> Dev {
    let rows = c.rows();
    Dev {
        x: g.upload(x).unwrap(),
        xq: g.zeros(rows * c.k).unwrap(),
        xamax: g.zeros(rows).unwrap(),
        codes: g.upload(&w.codes).unwrap(),
        scales: g.upload(&w.scales).unwrap(),
        wamax: g.upload(&w.amax).unwrap(),
        off: g.upload(&c.offsets()).unwrap(),
        y: g.upload(&vec![f32::NAN; rows * c.n]).unwrap(),
    }
}

/// Activation quantization then the small-M GEMM on `d` (`lanes` None: the launcher's pick).
fn run_small_m(ops: &QGemm, f: LowByte, lanes: Option<QLanes>, c: &Case, d: &mut Dev) {
    let (s, rows, k) = (c.shape(), c.rows(), c.k);
    match f {
        LowByte::Mxfp8 => {
            ops.quant_act_mxfp8(&d.x.as_view(), rows, k, &mut d.xq.as_view_mut())
                .unwrap();
            let (xv, cv, sv, ov) = (
                d.xq.as_view(),
                d.codes.as_view(),
                d.scales.as_view(),
                d.off.as_view(),
            );
            let mut yv = d.y.as_view_mut();
            match lanes {
                Some(l) => ops.grouped_nt_small_m_mxfp8_with(l, &xv, &cv, &sv, &ov, &mut yv, s),
                None => ops.grouped_nt_small_m_mxfp8(&xv, &cv, &sv, &ov, &mut yv, s),
            }
            .unwrap();
        }
        LowByte::Nvfp4 => {
            ops.quant_act_nvfp4(
                &d.x.as_view(),
                rows,
                k,
                &mut d.xq.as_view_mut(),
                &mut d.xamax.as_view_mut(),
            )
            .unwrap();
            let (xv, av, cv, sv, wv, ov) = (
                d.xq.as_view(),
                d.xamax.as_view(),
                d.codes.as_view(),
                d.scales.as_view(),
                d.wamax.as_view(),
                d.off.as_view(),
            );
            let mut yv = d.y.as_view_mut();
            match lanes {
                Some(l) => {
                    ops.grouped_nt_small_m_nvfp4_with(l, &xv, &av, &cv, &sv, &wv, &ov, &mut yv, s)
                }
                None => ops.grouped_nt_small_m_nvfp4(&xv, &av, &cv, &sv, &wv, &ov, &mut yv, s),
            }
            .unwrap();
        }
    }
}

fn download_y(g: &Gpu, c: &Case, d: &Dev) -> Vec<f32> {
    let mut y = g.download(&d.y).unwrap();
    y.truncate(c.rows() * c.n);
    y
}

/// Rows of no expert must still be NaN; every other entry within its bound of the reference.
fn assert_grouped(what: &str, c: &Case, got: &[f32], want: &[f32], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let n = c.n;
    let mut bad = Vec::new();
    for i in 0..want.len() {
        let ok = if want[i].is_nan() {
            got[i].is_nan()
        } else if got[i].is_nan() || got[i].is_infinite() || want[i].is_infinite() {
            got[i] == want[i]
        } else {
            ((got[i] as f64) - (want[i] as f64)).abs() <= bound[i]
        };
        if !ok {
            bad.push(i);
        }
    }
    if bad.is_empty() {
        return;
    }
    let mut msg = format!(
        "{what}: {} of {} entries outside the bound",
        bad.len(),
        want.len()
    );
    for &i in bad.iter().take(8) {
        let (r, j) = (i / n, i % n);
        msg += &format!(
            "\n  y[{r}, {j}] (expert {:?}): got {:e}, reference {:e}, |diff| {:e}, bound {:e}",
            c.expert_of(r),
            got[i],
            want[i],
            ((got[i] as f64) - (want[i] as f64)).abs(),
            bound[i]
        );
    }
    panic!("{msg}");
}

fn gemm_matches_cpu_emulation(f: LowByte) {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    for (seed, c) in gemm_cases() {
        let s = c.shape();
        let x = test_values(s.rows * s.k, seed * 7 + 1, 3.0);
        let w = quantize_experts(f, s.experts, s.n, s.k, seed);
        let (want, bound) = reference(f, &c, &x, &w);
        let auto_lanes = QLanes::for_shape(f, s.k);
        let mut d = upload(&g, &c, &x, &w);
        run_small_m(&ops, f, None, &c, &mut d);
        let auto = download_y(&g, &c, &d);
        let what = format!("{f:?} small-M auto ({auto_lanes:?}), seed {seed}, {c:?}");
        assert_grouped(&what, &c, &auto, &want, &bound);
        for lanes in QLanes::ALL {
            let mut d = upload(&g, &c, &x, &w);
            run_small_m(&ops, f, Some(lanes), &c, &mut d);
            let got = download_y(&g, &c, &d);
            let what = format!("{f:?} small-M {lanes:?}, seed {seed}, {c:?}");
            assert_grouped(&what, &c, &got, &want, &bound);
            if lanes == auto_lanes {
                let same = got
                    .iter()
                    .zip(&auto)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: differs from the launcher's own pick");
            }
        }
        // Deterministic: a second run gives the same bits.
        run_small_m(&ops, f, None, &c, &mut d);
        let again = download_y(&g, &c, &d);
        let same = again
            .iter()
            .zip(&auto)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{f:?} seed {seed}: a second run differs");
    }
}

#[test]
fn mxfp8_small_m_gemm_matches_the_cpu_emulation() {
    gemm_matches_cpu_emulation(LowByte::Mxfp8);
}

#[test]
fn nvfp4_small_m_gemm_matches_the_cpu_emulation() {
    gemm_matches_cpu_emulation(LowByte::Nvfp4);
}

/// The tensor-core grouped kernels on the stored bytes against the CPU emulation, with the
/// tiled kernels' bound (`tensor_core_sum_bound`; NVFP4 over K + 1 terms as the large-M path):
/// ragged experts (0 rows, 1, 15, 16, 17, 33 — several 16-row passes — and rows of no
/// expert), a batch-32 decode step of the benchmark model's routing, random shapes; a second
/// run gives the same bits; shapes off the 64-column / 64-deep tiles are refused by name.
#[test]
fn tensor_core_grouped_kernels_on_stored_bytes_match_the_cpu_emulation() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let mut cases = vec![
        (
            41u64,
            Case {
                counts: vec![0, 1, 15, 16, 17, 0, 33, 2],
                n: 128,
                k: 192,
                extra: 3,
            },
        ),
        (42, routed(32, 42, 192, 768)),
        (43, routed(4, 43, 64, 2048)),
    ];
    for seed in 44..47u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        use rand::Rng;
        let e = rng.gen_range(1..=12);
        let counts = (0..e)
            .map(|_| {
                if rng.gen_bool(0.25) {
                    0
                } else {
                    rng.gen_range(1..=40)
                }
            })
            .collect();
        cases.push((
            seed,
            Case {
                counts,
                n: 64 * rng.gen_range(1..=4),
                k: 64 * rng.gen_range(1..=6),
                extra: rng.gen_range(0..3),
            },
        ));
    }
    for f in LowByte::ALL {
        for (seed, c) in &cases {
            let s = c.shape();
            assert!(QGemm::tc_fits(s.n, s.k));
            let x = test_values(s.rows * s.k, seed * 5 + 2, 3.0);
            let w = quantize_experts(f, s.experts, s.n, s.k, *seed);
            let (want, ieee) = reference(f, c, &x, &w);
            let kk = match f {
                LowByte::Mxfp8 => s.k,
                LowByte::Nvfp4 => s.k + 1,
            };
            let bound: Vec<f64> = ieee
                .iter()
                .map(|&b| b / two_order_sum_bound(kk, 1.0) * tensor_core_sum_bound(kk, 1.0))
                .collect();
            let run = |d: &mut Dev| match f {
                LowByte::Mxfp8 => {
                    ops.quant_act_mxfp8(&d.x.as_view(), s.rows, s.k, &mut d.xq.as_view_mut())
                        .unwrap();
                    ops.grouped_nt_tc_mxfp8(
                        &d.xq.as_view(),
                        &d.codes.as_view(),
                        &d.scales.as_view(),
                        &d.off.as_view(),
                        &mut d.y.as_view_mut(),
                        s,
                    )
                    .unwrap();
                }
                LowByte::Nvfp4 => {
                    ops.quant_act_nvfp4(
                        &d.x.as_view(),
                        s.rows,
                        s.k,
                        &mut d.xq.as_view_mut(),
                        &mut d.xamax.as_view_mut(),
                    )
                    .unwrap();
                    ops.grouped_nt_tc_nvfp4(
                        &d.xq.as_view(),
                        &d.xamax.as_view(),
                        &d.codes.as_view(),
                        &d.scales.as_view(),
                        &d.wamax.as_view(),
                        &d.off.as_view(),
                        &mut d.y.as_view_mut(),
                        s,
                    )
                    .unwrap();
                }
            };
            let mut d = upload(&g, c, &x, &w);
            run(&mut d);
            let got = download_y(&g, c, &d);
            assert_grouped(
                &format!("{f:?} tensor-core, seed {seed}, {c:?}"),
                c,
                &got,
                &want,
                &bound,
            );
            run(&mut d);
            let again = download_y(&g, c, &d);
            assert!(
                got.iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{f:?} seed {seed}: a second run differs"
            );
        }
        // Off the tiles: refused with the rule.
        let c = Case {
            counts: vec![2],
            n: 72,
            k: 64,
            extra: 0,
        };
        let w = quantize_experts(f, 1, c.n, c.k, 9);
        let x = test_values(c.rows() * c.k, 9, 1.0);
        let mut d = upload(&g, &c, &x, &w);
        let err = match f {
            LowByte::Mxfp8 => ops.grouped_nt_tc_mxfp8(
                &d.xq.as_view(),
                &d.codes.as_view(),
                &d.scales.as_view(),
                &d.off.as_view(),
                &mut d.y.as_view_mut(),
                c.shape(),
            ),
            LowByte::Nvfp4 => ops.grouped_nt_tc_nvfp4(
                &d.xq.as_view(),
                &d.xamax.as_view(),
                &d.codes.as_view(),
                &d.scales.as_view(),
                &d.wamax.as_view(),
                &d.off.as_view(),
                &mut d.y.as_view_mut(),
                c.shape(),
            ),
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains("multiple of 64"), "{err}");
    }
}

/// Quantizes the activations and runs the fragment kernel (`plan` None: the launcher's pick
/// of rows per pass and layout).
fn run_frag(ops: &QGemm, f: LowByte, plan: Option<(FragRows, FragLayout)>, c: &Case, d: &mut Dev) {
    let s = c.shape();
    match f {
        LowByte::Mxfp8 => {
            ops.quant_act_mxfp8(&d.x.as_view(), s.rows, s.k, &mut d.xq.as_view_mut())
                .unwrap();
            let (xv, cv, sv, ov) = (
                d.xq.as_view(),
                d.codes.as_view(),
                d.scales.as_view(),
                d.off.as_view(),
            );
            let mut yv = d.y.as_view_mut();
            match plan {
                Some((p, k)) => {
                    ops.grouped_nt_frag_mxfp8_with(p, k, &xv, &cv, &sv, &ov, &mut yv, s)
                }
                None => ops.grouped_nt_frag_mxfp8(&xv, &cv, &sv, &ov, &mut yv, s),
            }
            .unwrap();
        }
        LowByte::Nvfp4 => {
            // The fragment kernels' operand is the binary16 one.
            ops.quant_act_nvfp4_f16(
                &d.x.as_view(),
                s.rows,
                s.k,
                &mut d.xq.as_view_mut(),
                &mut d.xamax.as_view_mut(),
            )
            .unwrap();
            let (xv, av, cv, sv, wv, ov) = (
                d.xq.as_view(),
                d.xamax.as_view(),
                d.codes.as_view(),
                d.scales.as_view(),
                d.wamax.as_view(),
                d.off.as_view(),
            );
            let mut yv = d.y.as_view_mut();
            match plan {
                Some((p, k)) => {
                    ops.grouped_nt_frag_nvfp4_with(p, k, &xv, &av, &cv, &sv, &wv, &ov, &mut yv, s)
                }
                None => ops.grouped_nt_frag_nvfp4(&xv, &av, &cv, &sv, &wv, &ov, &mut yv, s),
            }
            .unwrap();
        }
    }
}

/// The fragment kernels (stored bytes decoded straight into mma fragments, K split over the
/// block's warps) against the CPU emulation with the tensor-core bound (NVFP4 over K + 1
/// terms): experts of 0, 1, 3, 16, 17 and 33 rows (one pass, several passes of 8, 16 and 32
/// rows), one of 300 rows whose passes several blocks share, and rows of no expert; K = 32 (most lanes past the row), K off the 64-byte super-step,
/// batch-1 (K 2048) and batch-32 (K 768) decode steps of the benchmark model's routing, random
/// shapes with K up to 2048. Every pass size gives the same bits as the launcher's pick for its
/// split of the reduction (passes change which rows share a weight fragment, not any sum), and
/// a second run the same bits; every split (1, 2, 4, 8 warps) is within the bound and
/// deterministic; `n` off the 32-column blocks is refused by name.
#[test]
fn fragment_kernels_on_stored_bytes_match_the_cpu_emulation() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let mut cases = vec![
        (
            51u64,
            Case {
                counts: vec![0, 1, 3, 16, 17, 0, 33, 2],
                n: 96,
                k: 192,
                extra: 3,
            },
        ),
        (
            52,
            Case {
                counts: vec![2, 0, 5],
                n: 32,
                k: 32,
                extra: 1,
            },
        ),
        (
            53,
            Case {
                counts: vec![4, 9],
                n: 64,
                k: 96,
                extra: 0,
            },
        ),
        (54, routed(1, 54, 64, 2048)),
        // Fewer rows than half the experts (an expert of two rows, a row of no expert): the
        // grid has a block row per row, each on the next busy expert (frag_expert_rows).
        (
            62,
            Case {
                counts: vec![0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0, 0],
                n: 64,
                k: 64,
                extra: 1,
            },
        ),
        (55, routed(32, 55, 128, 768)),
        // Prefill-sized decode batches: 64 rows per pass and more, ragged last passes.
        (
            60,
            Case {
                counts: vec![70, 0, 130, 64, 1],
                n: 64,
                k: 256,
                extra: 2,
            },
        ),
        // One busy expert: its passes spread over several blocks (frag_row_blocks), one
        // block taking two of them.
        (
            61,
            Case {
                counts: vec![300, 2, 0, 5],
                n: 64,
                k: 256,
                extra: 1,
            },
        ),
    ];
    for seed in 56..60u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        use rand::Rng;
        let e = rng.gen_range(1..=10);
        let counts = (0..e)
            .map(|_| {
                if rng.gen_bool(0.25) {
                    0
                } else {
                    rng.gen_range(1..=40)
                }
            })
            .collect();
        cases.push((
            seed,
            Case {
                counts,
                n: 32 * rng.gen_range(1..=4),
                k: 32 * rng.gen_range(1..=64),
                extra: rng.gen_range(0..3),
            },
        ));
    }
    for f in LowByte::ALL {
        for (seed, c) in &cases {
            let s = c.shape();
            assert!(QGemm::frag_fits(s.n, s.k));
            let x = test_values(s.rows * s.k, seed * 5 + 3, 3.0);
            let w = quantize_experts(f, s.experts, s.n, s.k, *seed);
            let (want, ieee) = reference(f, c, &x, &w);
            let kk = match f {
                LowByte::Mxfp8 => s.k,
                LowByte::Nvfp4 => s.k + 1,
            };
            let bound: Vec<f64> = ieee
                .iter()
                .map(|&b| b / two_order_sum_bound(kk, 1.0) * tensor_core_sum_bound(kk, 1.0))
                .collect();
            let auto = frag_rows(s, Some(f));
            let mut d = upload(&g, c, &x, &w);
            run_frag(&ops, f, None, c, &mut d);
            let got = download_y(&g, c, &d);
            let what = format!("{f:?} fragment auto ({auto:?}), seed {seed}, {c:?}");
            assert_grouped(&what, c, &got, &want, &bound);
            run_frag(&ops, f, None, c, &mut d);
            let again = download_y(&g, c, &d);
            assert!(
                got.iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: a second run differs"
            );
            let layout = frag_layout(s, Some(f), auto);
            for rows in FragRows::ALL {
                let mut d = upload(&g, c, &x, &w);
                run_frag(&ops, f, Some((rows, layout)), c, &mut d);
                let other = download_y(&g, c, &d);
                let what = format!("{f:?} fragment {rows:?}, seed {seed}, {c:?}");
                assert_grouped(&what, c, &other, &want, &bound);
                assert!(
                    other
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: differs from the launcher's pick {auto:?}"
                );
            }
            // The staged layout: the bits of one warp per column block, at every pass size.
            for rows in FragRows::ALL {
                let mut d = upload(&g, c, &x, &w);
                run_frag(&ops, f, Some((rows, FragLayout::Split(1))), c, &mut d);
                let one = download_y(&g, c, &d);
                // Fresh buffers (y all NaN): a row the staged launch leaves unwritten shows.
                let mut d = upload(&g, c, &x, &w);
                run_frag(&ops, f, Some((rows, FragLayout::Staged)), c, &mut d);
                let staged = download_y(&g, c, &d);
                let what = format!("{f:?} fragment staged {rows:?}, seed {seed}, {c:?}");
                assert_grouped(&what, c, &staged, &want, &bound);
                assert!(
                    staged
                        .iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: differs from one warp per column block"
                );
            }
            // MXFP8's fast decode (these weights are eligible): the general decode's bits, on
            // the split and the staged kernels at every pass size.
            if f == LowByte::Mxfp8 {
                assert!(
                    mxfp8_fast_eligible(&w.codes, &w.scales),
                    "seed {seed}: test weights with a NaN code or a scale byte above 134"
                );
                let dev = upload(&g, c, &x, &w);
                assert!(ops
                    .mxfp8_fast_check(&dev.codes.as_view(), &dev.scales.as_view())
                    .unwrap());
                for rows in FragRows::ALL {
                    for layout in [
                        FragLayout::Split(1),
                        FragLayout::Split(4),
                        FragLayout::Staged,
                    ] {
                        let run = |decode: Mxfp8Decode| {
                            let mut d = upload(&g, c, &x, &w);
                            ops.quant_act_mxfp8(
                                &d.x.as_view(),
                                s.rows,
                                s.k,
                                &mut d.xq.as_view_mut(),
                            )
                            .unwrap();
                            ops.grouped_nt_frag_mxfp8_decode_with(
                                decode,
                                rows,
                                layout,
                                &d.xq.as_view(),
                                &d.codes.as_view(),
                                &d.scales.as_view(),
                                &d.off.as_view(),
                                &mut d.y.as_view_mut(),
                                s,
                            )
                            .unwrap();
                            download_y(&g, c, &d)
                        };
                        let (general, fast) = (run(Mxfp8Decode::General), run(Mxfp8Decode::Fast));
                        assert!(
                            fast.iter()
                                .zip(&general)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "MXFP8 fast decode {rows:?} {layout:?}, seed {seed}, {c:?}: differs \
                             from the general decode"
                        );
                    }
                }
            }
            // Every split of the reduction: other sums, within the same bound, deterministic.
            for split in [1usize, 2, 4, 8] {
                let mut d = upload(&g, c, &x, &w);
                let layout = FragLayout::Split(split);
                run_frag(&ops, f, Some((auto, layout)), c, &mut d);
                let other = download_y(&g, c, &d);
                let what = format!("{f:?} fragment split {split}, seed {seed}, {c:?}");
                assert_grouped(&what, c, &other, &want, &bound);
                run_frag(&ops, f, Some((auto, layout)), c, &mut d);
                let again = download_y(&g, c, &d);
                assert!(
                    other
                        .iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: a second run differs"
                );
            }
        }
        // Off the 32-column blocks: refused with the rule.
        let c = Case {
            counts: vec![2],
            n: 48,
            k: 64,
            extra: 0,
        };
        let w = quantize_experts(f, 1, c.n, c.k, 9);
        let x = test_values(c.rows() * c.k, 9, 1.0);
        let mut d = upload(&g, &c, &x, &w);
        let err = match f {
            LowByte::Mxfp8 => ops.grouped_nt_frag_mxfp8(
                &d.xq.as_view(),
                &d.codes.as_view(),
                &d.scales.as_view(),
                &d.off.as_view(),
                &mut d.y.as_view_mut(),
                c.shape(),
            ),
            LowByte::Nvfp4 => ops.grouped_nt_frag_nvfp4(
                &d.xq.as_view(),
                &d.xamax.as_view(),
                &d.codes.as_view(),
                &d.scales.as_view(),
                &d.wamax.as_view(),
                &d.off.as_view(),
                &mut d.y.as_view_mut(),
                c.shape(),
            ),
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains("multiple of 32"), "{err}");
    }
}

/// The launchers' pass size: the smallest pass holding the average expert's rows, at most the
/// format's largest.
/// The fast MXFP8 decode gives the general decode's BF16 operand for every non-NaN E4M3 code
/// under every scale byte it takes (0..=134), and both give the contract's value rounded to
/// BF16 (`bf16(e4m3_value(code) · 2^(s − 127))`, exact in f32 before the rounding).
#[test]
fn mxfp8_fast_decode_equals_the_general_decode_for_every_code_and_scale() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let (general, fast) = ops.mxfp8_decode_table().unwrap();
    let mut nan_seen = 0;
    for s in 0..=u32::from(MXFP8_FAST_MAX_SCALE) {
        for code in 0..256u32 {
            let i = (s * 256 + code) as usize;
            let value = e4m3_decode(code as u8);
            if value.is_nan() {
                // The fast decode does not take NaN codes (mxfp8_fast_check); the general one
                // keeps them NaN.
                assert!(
                    widen(general[i]).is_nan(),
                    "scale {s} code {code:#04x}: not NaN"
                );
                nan_seen += 1;
                continue;
            }
            let want =
                bf16_bits(value * f32::from_bits(if s == 0 { 0x0040_0000 } else { s << 23 }));
            assert_eq!(
                general[i], want,
                "scale {s} code {code:#04x}: general decode {:#06x}, contract {want:#06x}",
                general[i]
            );
            assert_eq!(
                fast[i], general[i],
                "scale {s} code {code:#04x}: fast decode {:#06x}, general {:#06x}",
                fast[i], general[i]
            );
        }
    }
    assert_eq!(nan_seen, 2 * 135);
}

/// `mxfp8_fast_check` (device) and `mxfp8_fast_eligible` (host) refuse weights with a NaN
/// code or a scale byte above 134, and take the rest.
#[test]
fn mxfp8_fast_check_refuses_nan_codes_and_large_scales() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let w = quantize_experts(LowByte::Mxfp8, 3, 64, 256, 77);
    let check = |codes: &[u8], scales: &[u8]| {
        let (dc, ds) = (g.upload(codes).unwrap(), g.upload(scales).unwrap());
        let dev = ops.mxfp8_fast_check(&dc.as_view(), &ds.as_view()).unwrap();
        assert_eq!(
            dev,
            mxfp8_fast_eligible(codes, scales),
            "device and host disagree"
        );
        dev
    };
    assert!(check(&w.codes, &w.scales), "ordinary weights refused");
    for (at, code) in [(0usize, 0x7Fu8), (w.codes.len() - 1, 0xFF), (4097, 0x7F)] {
        let mut codes = w.codes.clone();
        codes[at] = code;
        assert!(
            !check(&codes, &w.scales),
            "NaN code {code:#04x} at {at} taken"
        );
    }
    let mut codes = w.codes.clone();
    codes[5] = 0x7E; // 448, the largest finite code
    codes[6] = 0xFE;
    assert!(check(&codes, &w.scales), "codes ±448 refused");
    for (at, b) in [(0usize, 135u8), (w.scales.len() - 1, 255)] {
        let mut scales = w.scales.clone();
        scales[at] = b;
        assert!(!check(&w.codes, &scales), "scale byte {b} at {at} taken");
    }
    let mut scales = w.scales.clone();
    scales[1] = MXFP8_FAST_MAX_SCALE;
    assert!(check(&w.codes, &scales), "scale byte 134 refused");
}

#[test]
fn fragment_pass_holds_the_average_experts_rows() {
    let big = FragRows::R64;
    assert_eq!(FragRows::for_rows(8, 8, big), FragRows::R8);
    assert_eq!(FragRows::for_rows(256, 64, big), FragRows::R8);
    assert_eq!(FragRows::for_rows(512, 64, big), FragRows::R8);
    assert_eq!(FragRows::for_rows(513, 64, big), FragRows::R16);
    assert_eq!(FragRows::for_rows(1024, 64, big), FragRows::R16);
    assert_eq!(FragRows::for_rows(1025, 64, big), FragRows::R32);
    assert_eq!(FragRows::for_rows(2048, 64, big), FragRows::R32);
    assert_eq!(FragRows::for_rows(2049, 64, big), FragRows::R64);
    assert_eq!(FragRows::for_rows(8192, 64, big), FragRows::R64);
    assert_eq!(FragRows::for_rows(5, 0, big), FragRows::R8);
    // Capped at the format's largest pass.
    assert_eq!(FragRows::for_rows(8192, 64, FragRows::R32), FragRows::R32);
    assert_eq!(FragRows::for_rows(600, 64, FragRows::R8), FragRows::R8);
    assert_eq!(FragRows::for_rows(600, 64, FragRows::R32), FragRows::R16);
    // The staged layout (from 9 rows per expert): a pass that holds avg + ⌈2√avg⌉ rows.
    let step = |rows: usize| Grouped {
        experts: 64,
        rows,
        n: 1536,
        k: 2048,
    };
    let (mx, nv) = (Some(LowByte::Mxfp8), Some(LowByte::Nvfp4));
    assert_eq!(frag_rows(step(512), mx), FragRows::R8); // 8 per expert: split layout
    assert_eq!(frag_rows(step(576), mx), FragRows::R16); // 9 + 6
    assert_eq!(frag_rows(step(1024), mx), FragRows::R32); // 16 + 8
    assert_eq!(frag_rows(step(512), None), FragRows::R8); // BF16 too
    assert_eq!(frag_rows(step(1024), None), FragRows::R32);
    assert_eq!(frag_rows(step(2048), mx), FragRows::R64); // 32 + 12
    assert_eq!(frag_rows(step(2048), None), FragRows::R64);
    assert_eq!(frag_rows(step(2048), nv), FragRows::R64);
    for f in [mx, nv, None] {
        assert_eq!(
            frag_layout(step(1024), f, FragRows::R32),
            FragLayout::Staged
        );
        assert!(matches!(
            frag_layout(step(512), f, FragRows::R8),
            FragLayout::Split(_)
        ));
    }
    assert_eq!(FragRows::largest(Some(LowByte::Mxfp8)), FragRows::R64);
    assert_eq!(FragRows::largest(Some(LowByte::Nvfp4)), FragRows::R32);
    assert_eq!(FragRows::largest(None), FragRows::R32);
    assert_eq!(FragRows::largest_staged(mx), FragRows::R64);
    assert_eq!(FragRows::largest_staged(nv), FragRows::R64);
    assert_eq!(FragRows::largest_staged(None), FragRows::R64);
}

/// Large-M path: weights dequantized to BF16 once, the activation operand, the tensor-core
/// grouped GEMM, and for NVFP4 α per row. Bound: `tensor_core_sum_bound(K, Σ|x·w|)` (MXFP8);
/// NVFP4 `|α|·tensor_core_sum_bound(K + 1, ·)`: each side's final `fl(acc·α)` adds at most
/// `u·|α|·|acc|` with `|acc| ≤ (1 + 2γ_3K)·Σ`, which the extra term covers
/// (`γ_{K+1} − γ_K + 2(γ_{3K+3} − γ_{3K}) ≥ 7u`).
#[test]
fn large_m_path_dequantized_weights_tensor_cores_and_row_alpha_match_the_cpu_emulation() {
    let (_l, g) = gpu();
    let (ops, gemm) = (QGemm::new(&g).unwrap(), Gemm::new(&g).unwrap());
    let cases = [
        (31u64, routed(64, 31, 64, 256)),
        (
            32,
            Case {
                counts: vec![0, 130, 3, 0, 70],
                n: 136,
                k: 96,
                extra: 4,
            },
        ),
    ];
    for f in LowByte::ALL {
        for (seed, c) in &cases {
            let s = c.shape();
            let x = test_values(s.rows * s.k, seed * 7 + 3, 3.0);
            let w = quantize_experts(f, s.experts, s.n, s.k, *seed);
            let (want, ieee) = reference(f, c, &x, &w);
            // The tensor-core bound from the IEEE one: same Σ|x·w|, per format.
            let bound: Vec<f64> = ieee
                .iter()
                .map(|&b| {
                    let kk = match f {
                        LowByte::Mxfp8 => s.k,
                        LowByte::Nvfp4 => s.k + 1,
                    };
                    b / two_order_sum_bound(kk, 1.0) * tensor_core_sum_bound(kk, 1.0)
                })
                .collect();
            let mut d = upload(&g, c, &x, &w);
            let mut wbf = g.zeros::<u16>(s.experts * s.n * s.k).unwrap();
            match f {
                LowByte::Mxfp8 => {
                    ops.dequant_weights_mxfp8(
                        &d.codes.as_view(),
                        &d.scales.as_view(),
                        &mut wbf.as_view_mut(),
                        s.experts,
                        s.n,
                        s.k,
                    )
                    .unwrap();
                    ops.quant_act_mxfp8(&d.x.as_view(), s.rows, s.k, &mut d.xq.as_view_mut())
                        .unwrap();
                }
                LowByte::Nvfp4 => {
                    ops.dequant_weights_nvfp4(
                        &d.codes.as_view(),
                        &d.scales.as_view(),
                        &mut wbf.as_view_mut(),
                        s.experts,
                        s.n,
                        s.k,
                    )
                    .unwrap();
                    ops.quant_act_nvfp4(
                        &d.x.as_view(),
                        s.rows,
                        s.k,
                        &mut d.xq.as_view_mut(),
                        &mut d.xamax.as_view_mut(),
                    )
                    .unwrap();
                }
            }
            // The dequantized weights are the CPU operand values, bit for bit.
            let wgot = g.download(&wbf).unwrap();
            let wwant: Vec<u16> = w.operand.iter().map(|&v| bf16_bits(v)).collect();
            assert!(
                w.operand.iter().all(|v| is_bf16_exact(*v)),
                "{f:?} seed {seed}: operand not BF16-exact"
            );
            let bad = bf16_mismatches(&wgot, &wwant);
            assert!(
                bad.is_empty(),
                "{f:?} seed {seed}: {} dequantized weights differ, first at {:?}",
                bad.len(),
                bad.first()
            );
            gemm.grouped_nt_tiled(
                &d.xq.as_view(),
                &wbf.as_view(),
                &d.off.as_view(),
                &mut d.y.as_view_mut(),
                s,
            )
            .unwrap();
            if f == LowByte::Nvfp4 {
                ops.nvfp4_scale_rows(
                    &mut d.y.as_view_mut(),
                    &d.xamax.as_view(),
                    &d.wamax.as_view(),
                    &d.off.as_view(),
                    s,
                )
                .unwrap();
            }
            let got = download_y(&g, c, &d);
            assert_grouped(
                &format!("{f:?} large-M path, seed {seed}, {c:?}"),
                c,
                &got,
                &want,
                &bound,
            );
        }
    }
}

/// A decode step's quantize + GEMM for both formats (small-M and fragment kernels), recorded once and replayed with new
/// activations written into the same input buffer, equals the direct calls bit for bit.
#[test]
fn decode_step_replays_in_a_cuda_graph() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let c = routed(4, 41, 64, 256);
    let s = c.shape();
    let x1 = test_values(s.rows * s.k, 42, 3.0);
    let x2 = test_values(s.rows * s.k, 43, 3.0);
    let wm = quantize_experts(LowByte::Mxfp8, s.experts, s.n, s.k, 44);
    let wn = quantize_experts(LowByte::Nvfp4, s.experts, s.n, s.k, 45);
    // The small-M kernels and the fragment kernels, each as a decode step would record it.
    for frag in [false, true] {
        let run = |f: LowByte, d: &mut Dev| {
            if frag {
                run_frag(&ops, f, None, &c, d)
            } else {
                run_small_m(&ops, f, None, &c, d)
            }
        };
        // Direct results for x2.
        let mut dm = upload(&g, &c, &x2, &wm);
        let mut dn = upload(&g, &c, &x2, &wn);
        run(LowByte::Mxfp8, &mut dm);
        run(LowByte::Nvfp4, &mut dn);
        let (want_m, want_n) = (download_y(&g, &c, &dm), download_y(&g, &c, &dn));
        // Record with x1 in place, then replay after writing x2.
        let mut dm = upload(&g, &c, &x1, &wm);
        let mut dn = upload(&g, &c, &x1, &wn);
        g.sync().unwrap();
        g.begin_capture().unwrap();
        run(LowByte::Mxfp8, &mut dm);
        run(LowByte::Nvfp4, &mut dn);
        let graph = g.end_capture().unwrap().expect("a recorded graph");
        g.write(&mut dm.x, &x2).unwrap();
        g.write(&mut dn.x, &x2).unwrap();
        graph.launch().unwrap();
        let (got_m, got_n) = (download_y(&g, &c, &dm), download_y(&g, &c, &dn));
        for (what, got, want) in [("MXFP8", got_m, want_m), ("NVFP4", got_n, want_n)] {
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{what} (fragment kernels: {frag}): graph replay differs from the direct calls"
            );
        }
    }
}

// ---------------------------------------------------------------- launcher checks

fn expect_err(what: &str, r: Result<(), mxrl_cuda::DeviceError>, needle: &str) {
    match r {
        Ok(()) => panic!("{what}: accepted, expected an error mentioning {needle:?}"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "{what}: error {e} does not mention {needle:?}"
        ),
    }
}

#[test]
fn launchers_reject_short_buffers_and_bad_shapes_with_named_errors() {
    let (_l, g) = gpu();
    let ops = QGemm::new(&g).unwrap();
    let s = Grouped {
        experts: 2,
        rows: 3,
        n: 8,
        k: 64,
    };
    let (ek, nk) = (s.experts * s.n * s.k, s.rows * s.k);
    let u16s = |n: usize| g.zeros::<u16>(n).unwrap();
    let u8s = |n: usize| g.zeros::<u8>(n).unwrap();
    let f32s = |n: usize| g.zeros::<f32>(n).unwrap();
    let off = g.upload(&[0u32, 1, 3]).unwrap();
    let (x, codes, scales) = (u16s(nk), u8s(ek), u8s(ek / 32));
    let mut y = f32s(s.rows * s.n);
    let mx = |x: &cudarc::driver::CudaSlice<u16>,
              c: &cudarc::driver::CudaSlice<u8>,
              sc: &cudarc::driver::CudaSlice<u8>,
              o: &cudarc::driver::CudaSlice<u32>,
              y: &mut cudarc::driver::CudaSlice<f32>,
              s: Grouped| {
        ops.grouped_nt_small_m_mxfp8(
            &x.as_view(),
            &c.as_view(),
            &sc.as_view(),
            &o.as_view(),
            &mut y.as_view_mut(),
            s,
        )
    };
    let m = "grouped_nt_small_m_mxfp8";
    mx(&x, &codes, &scales, &off, &mut y, s).expect("MXFP8 with full buffers");
    let x_short = u16s(nk - 1);
    expect_err(
        "short x",
        mx(&x_short, &codes, &scales, &off, &mut y, s),
        &format!("{m} x"),
    );
    expect_err(
        "short codes",
        mx(&x, &u8s(ek - 16), &scales, &off, &mut y, s),
        &format!("{m} codes"),
    );
    expect_err(
        "short scales",
        mx(&x, &codes, &u8s(ek / 32 - 1), &off, &mut y, s),
        &format!("{m} scales"),
    );
    let off_short = g.upload(&[0u32, 1]).unwrap();
    expect_err(
        "short offsets",
        mx(&x, &codes, &scales, &off_short, &mut y, s),
        &format!("{m} offsets"),
    );
    expect_err(
        "short y",
        mx(&x, &codes, &scales, &off, &mut f32s(s.rows * s.n - 1), s),
        &format!("{m} y"),
    );
    expect_err(
        "k = 48",
        mx(&x, &codes, &scales, &off, &mut y, Grouped { k: 48, ..s }),
        "multiple of 32",
    );
    expect_err(
        "n = 6",
        mx(&x, &codes, &scales, &off, &mut y, Grouped { n: 6, ..s }),
        "multiple of 4",
    );
    // NVFP4: its own buffers.
    let (ncodes, nscales) = (u8s(ek / 2), u8s(ek / 16));
    let nv = |xa: usize, wa: usize| {
        let (xa, wa) = (f32s(xa), f32s(wa));
        let mut y = f32s(s.rows * s.n);
        ops.grouped_nt_small_m_nvfp4(
            &x.as_view(),
            &xa.as_view(),
            &ncodes.as_view(),
            &nscales.as_view(),
            &wa.as_view(),
            &off.as_view(),
            &mut y.as_view_mut(),
            s,
        )
    };
    nv(s.rows, s.experts).expect("NVFP4 with full buffers");
    expect_err(
        "short x_amax",
        nv(s.rows - 1, s.experts),
        "grouped_nt_small_m_nvfp4 x_amax",
    );
    expect_err(
        "short w_amax",
        nv(s.rows, s.experts - 1),
        "grouped_nt_small_m_nvfp4 w_amax",
    );
    // Fragment kernels: the shared checks under their own names, N off the 32-column blocks.
    let sf = Grouped { n: 32, ..s };
    let efk = sf.experts * sf.n * sf.k;
    let (fcodes, fscales) = (u8s(efk), u8s(efk / 32));
    let fr = |x: &cudarc::driver::CudaSlice<u16>, y_len: usize, s: Grouped| {
        let mut y = f32s(y_len);
        ops.grouped_nt_frag_mxfp8(
            &x.as_view(),
            &fcodes.as_view(),
            &fscales.as_view(),
            &off.as_view(),
            &mut y.as_view_mut(),
            s,
        )
    };
    let fy = sf.rows * sf.n;
    fr(&x, fy, sf).expect("fragment MXFP8 with full buffers");
    expect_err(
        "fragment short x",
        fr(&x_short, fy, sf),
        "grouped_nt_frag_mxfp8 x",
    );
    expect_err(
        "fragment short y",
        fr(&x, fy - 1, sf),
        "grouped_nt_frag_mxfp8 y",
    );
    expect_err("fragment n = 8", fr(&x, fy, s), "multiple of 32");
    let (fncodes, fnscales) = (u8s(efk / 2), u8s(efk / 16));
    let fnv = |xa: usize, wa: usize| {
        let (xa, wa) = (f32s(xa), f32s(wa));
        let mut y = f32s(fy);
        ops.grouped_nt_frag_nvfp4(
            &x.as_view(),
            &xa.as_view(),
            &fncodes.as_view(),
            &fnscales.as_view(),
            &wa.as_view(),
            &off.as_view(),
            &mut y.as_view_mut(),
            sf,
        )
    };
    fnv(sf.rows, sf.experts).expect("fragment NVFP4 with full buffers");
    expect_err(
        "fragment short x_amax",
        fnv(sf.rows - 1, sf.experts),
        "grouped_nt_frag_nvfp4 x_amax",
    );
    expect_err(
        "fragment short w_amax",
        fnv(sf.rows, sf.experts - 1),
        "grouped_nt_frag_nvfp4 w_amax",
    );
    // Activation quantizers and dequantizers.
    let xf = f32s(nk);
    expect_err(
        "act mxfp8 k = 48",
        ops.quant_act_mxfp8(&xf.as_view(), 3, 48, &mut u16s(nk).as_view_mut()),
        "multiple of 32",
    );
    expect_err(
        "act mxfp8 short out",
        ops.quant_act_mxfp8(&xf.as_view(), 3, 64, &mut u16s(nk - 1).as_view_mut()),
        "quant_act_mxfp8 out",
    );
    expect_err(
        "act nvfp4 k = 24",
        ops.quant_act_nvfp4(
            &xf.as_view(),
            3,
            24,
            &mut u16s(nk).as_view_mut(),
            &mut f32s(3).as_view_mut(),
        ),
        "multiple of 16",
    );
    expect_err(
        "act nvfp4 short amax",
        ops.quant_act_nvfp4(
            &xf.as_view(),
            3,
            64,
            &mut u16s(nk).as_view_mut(),
            &mut f32s(2).as_view_mut(),
        ),
        "quant_act_nvfp4 amax",
    );
    expect_err(
        "dequant mxfp8 short scales",
        ops.dequant_weights_mxfp8(
            &codes.as_view(),
            &u8s(ek / 32 - 1).as_view(),
            &mut u16s(ek).as_view_mut(),
            2,
            8,
            64,
        ),
        "dequant_weights_mxfp8 scales",
    );
    expect_err(
        "dequant nvfp4 short codes",
        ops.dequant_weights_nvfp4(
            &u8s(ek / 2 - 1).as_view(),
            &nscales.as_view(),
            &mut u16s(ek).as_view_mut(),
            2,
            8,
            64,
        ),
        "dequant_weights_nvfp4 codes",
    );
}

#[test]
fn lane_split_leaves_the_fewest_lanes_idle() {
    // Benchmark shapes (doc of QLanes::for_shape) and the rule on other chunk counts.
    assert_eq!(QLanes::for_shape(LowByte::Mxfp8, 2048), QLanes::L32);
    assert_eq!(QLanes::for_shape(LowByte::Mxfp8, 768), QLanes::L16);
    assert_eq!(QLanes::for_shape(LowByte::Nvfp4, 2048), QLanes::L32);
    assert_eq!(QLanes::for_shape(LowByte::Nvfp4, 768), QLanes::L8);
    for f in LowByte::ALL {
        for k in (32..=4096).step_by(32) {
            let chunks = k / f.chunk();
            let idle = |l: QLanes| chunks.div_ceil(l.lanes()) * l.lanes() - chunks;
            let pick = QLanes::for_shape(f, k);
            for l in QLanes::ALL {
                assert!(idle(pick) <= idle(l), "{f:?} k = {k}: {pick:?} vs {l:?}");
                if idle(l) == idle(pick) {
                    assert!(
                        pick.lanes() >= l.lanes(),
                        "{f:?} k = {k}: tie to more lanes"
                    );
                }
            }
        }
    }
    // The derived-bound identity used for NVFP4 (γ_k + u(1 + γ_k) ≤ γ_{k+1}).
    let u = mxrl_tensor::F32_UNIT_ROUNDOFF;
    for k in [1usize, 32, 768, 2048, 1 << 20] {
        assert!(gamma(k) + u * (1.0 + gamma(k)) <= gamma(k + 1));
    }
}
