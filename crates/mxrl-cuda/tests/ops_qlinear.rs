//! The device quantized linear layer (`mxrl_cuda::ops::qlinear`) against its CPU reference
//! `mxrl_tensor::qlinear::PreparedWeight` (forward, backward) and the contract library:
//!
//! - every quantized operand the device stores (the weight's forward bytes, its column-wise
//!   `Lowp` copy, the kept `x`: the forward's bytes in `Dequantized`, the zero-padded
//!   column-wise copy in `Lowp`) equals the library's bytes exactly;
//! - `y`, `dx` and `dW` are within the derived bound of the CPU's values for every format ×
//!   backward mode, on random data and ragged M (not a multiple of 32: the column-wise copies
//!   are padded): the operands are the same exact values on both sides, so only the f32
//!   summation order differs (`tensor_core_sum_bound(K, Σ|a·b|)`; NVFP4 forward `|α|·` that
//!   bound with one more term for `fl(α·acc)`; NVFP4 `Dequantized` backward: three BF16 parts
//!   per operand, `Σ|a|·(|hi|+|mid|+|lo|) ≤ (1 + 2⁻⁶)·Σ|a·b|` and three more roundings, bound
//!   `tensor_core_sum_bound(K + 3, (1 + 2⁻⁶)·Σ|a·b|)`; the engine backend's NVFP4
//!   `Dequantized` dgrad: the weights' exact `e2m1 × e4m3` values and their per-tensor factor
//!   after the sum, `tensor_core_sum_bound(K + 5, Σ|a·b|)`, `factored_sum`; its wgrad: the
//!   three parts of `x̂` in one sum of `3·M` products, `tensor_core_sum_bound(3·M, (1 +
//!   2⁻⁶)·Σ|a·b|)`, `parts_wgrad_sum`);
//! - the bound is tight enough to fail: each quantized forward is outside it from the BF16
//!   forward, and each mode's gradients are outside it from another mode's;
//! - the bytes each context keeps equal the CPU layer's (`Saved::kept_bytes`), BF16 inputs are
//!   kept without a copy, and a context of another weight version is refused.
//!
//! Seeds are fixed and printed with every failure. Tests run one at a time (one GPU).
#![cfg(feature = "cuda")]

use half::bf16;
use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::qgemm::ActRows;
use mxrl_cuda::ops::qlinear::QLinear;
use mxrl_cuda::DeviceInput;
use mxrl_formats::{quantize, Format, Padding, QuantizedTensor, Scheme};
use mxrl_tensor::device::{GradWrite, OutGrad, SavedX};
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::qlinear::{nvfp4_alpha, BackwardMode, LinearSpec, PreparedWeight};
use mxrl_tensor::tolerance::{
    gemm_nn_bounds_with, gemm_nt_bounds_with, gemm_tn_bounds_with, tensor_core_sum_bound,
    violations,
};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

static SERIAL: Mutex<()> = Mutex::new(());

fn layer() -> (MutexGuard<'static, ()>, &'static QLinear) {
    static LAYER: OnceLock<QLinear> = OnceLock::new();
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let l = LAYER.get_or_init(|| {
        let g = Gpu::shared(0)
            .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"));
        QLinear::new(&g).unwrap_or_else(|e| panic!("QLinear::new: {e}"))
    });
    (guard, l)
}

fn up_f32(l: &QLinear, v: &[f32]) -> Arc<DeviceInput> {
    Arc::new(DeviceInput::F32(l.gpu().upload(v).expect("upload")))
}

fn up_bf16(l: &QLinear, v: &[f32]) -> Arc<DeviceInput> {
    Arc::new(DeviceInput::Bf16(
        l.gpu().upload(&bf16_bits(v)).expect("upload"),
    ))
}

/// The BF16 bit patterns of `v` (round to nearest even).
fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

/// The bit patterns of `v`, for bitwise comparisons.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn down(l: &QLinear, v: &cudarc::driver::CudaSlice<f32>) -> Vec<f32> {
    l.gpu().download(v).expect("download")
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Shapes `(m, k, n)`: K a multiple of 32, N of 32 (`Lowp` quantizes dy row-wise along N),
/// M ragged in most.
const SHAPES: [(usize, usize, usize); 4] =
    [(64, 128, 96), (40, 96, 160), (1, 32, 32), (130, 64, 64)];

fn specs() -> Vec<LinearSpec> {
    let mut out = vec![LinearSpec::bf16()];
    for f in [Format::Mxfp8, Format::Nvfp4] {
        for mode in BackwardMode::ALL {
            if let Ok(s) = LinearSpec::new(f, mode) {
                out.push(s);
            }
        }
    }
    out
}

fn deq(q: &QuantizedTensor) -> Vec<f32> {
    q.dequantize().expect("dequantize")
}

fn q(v: &[f32], rows: usize, cols: usize, scheme: Scheme, pad: Padding) -> QuantizedTensor {
    quantize(v, &[rows, cols], scheme, pad).expect("quantize")
}

/// `e2m1 · e4m3(scale)` of an NVFP4 tensor: the dequantization with α divided out is not
/// exact, so it is decoded from the bytes.
fn nvfp4_pre(t: &QuantizedTensor) -> Vec<f32> {
    let (rows, k) = (t.shape[0], t.shape[1]);
    let mxrl_formats::Scales::Bytes(scales) = &t.scales else {
        panic!("NVFP4 scales are bytes")
    };
    let mut out = Vec::with_capacity(rows * k);
    for i in 0..rows {
        for j in 0..k {
            let code = (t.data[i * (k / 2) + j / 2] >> (4 * (j % 2))) & 0xF;
            out.push(
                mxrl_formats::e2m1_decode(code)
                    * mxrl_formats::e4m3_decode(scales[i * (k / 16) + j / 16]),
            );
        }
    }
    out
}

/// Per-entry bound of the forward `y`, from the CPU's exact operands.
fn forward_bound(
    s: LinearSpec,
    x: &[f32],
    w: &[f32],
    (m, k, n): (usize, usize, usize),
) -> Vec<f64> {
    match s.format() {
        Format::Bf16 => gemm_nt_bounds_with(
            &round_bf16(x),
            &round_bf16(w),
            m,
            k,
            n,
            tensor_core_sum_bound,
        ),
        Format::Mxfp8 => {
            let xo = deq(&q(x, m, k, Scheme::MXFP8_ROW, Padding::Reject));
            let wo = deq(&q(w, n, k, Scheme::MXFP8_ROW, Padding::Reject));
            gemm_nt_bounds_with(&xo, &wo, m, k, n, tensor_core_sum_bound)
        }
        _ => {
            let qx = q(x, m, k, Scheme::NVFP4_ROW, Padding::Reject);
            let qw = q(w, n, k, Scheme::NVFP4_TENSOR, Padding::Reject);
            // One more term: the final fl(α·acc) on each side.
            let b = gemm_nt_bounds_with(&nvfp4_pre(&qx), &nvfp4_pre(&qw), m, k, n, |k, s| {
                tensor_core_sum_bound(k + 1, s)
            });
            b.iter()
                .enumerate()
                .map(|(i, v)| v * f64::from(nvfp4_alpha(qx.amax[i / n], qw.amax[0]).abs()))
                .collect()
        }
    }
}

/// Bound of an NVFP4 `Dequantized` backward GEMM (three BF16 parts per operand, module doc).
fn split_sum(k: usize, s: f64) -> f64 {
    tensor_core_sum_bound(k + 3, s * (1.0 + 2f64.powi(-6)))
}

/// Bound of the engine backend's NVFP4 `Dequantized` dgrad: one GEMM on the weights' exact
/// `e2m1 × e4m3` values, then `fl(g · sum)` with `g = fl(amax · R2688)`. The CPU multiplies
/// `Ŵ = fl(e2m1 · fl(fl(sf · amax) · R2688))`, so each of its products differs from the
/// device's `e·sf·g` by at most three roundings of `Ŵ` and one of `g`, and `fl(g · sum)` adds
/// one more: five terms of at most `u·Σ|a·b|` (first order) beside the two summation orders,
/// which `γ_{K+5}` covers over `γ_K`.
fn factored_sum(k: usize, s: f64) -> f64 {
    tensor_core_sum_bound(k + 5, s)
}

/// Bound of the engine backend's NVFP4 `Dequantized` wgrad over `M` rows: `x̂`'s three exact
/// BF16 parts multiplied by `dy` and added as one tensor-core sum of `3·M` products (grouped:
/// one launch), where the CPU sums the `M` products of `x̂`. With `Σ|a|·(|p0|+|p1|+|p2|) ≤
/// (1 + 2⁻⁶)·Σ|a·b|` (module doc) and `γ_M ≤ γ_{3M}` for the CPU's side, that is
/// `tensor_core_sum_bound(3·M, (1 + 2⁻⁶)·Σ|a·b|)`. The dense path's three cuBLAS passes stay
/// inside it too: per part a tensor-core sum of `M` products, within `2·γ_{3M}` of its exact
/// value, and two f32 additions of the parts, `2·γ_{3M}·Σ + 2u·Σ` to first order against the
/// bound's device side `2·γ_{9M}·Σ`.
fn parts_wgrad_sum(m: usize, s: f64) -> f64 {
    tensor_core_sum_bound(3 * m, s * (1.0 + 2f64.powi(-6)))
}

/// The dgrad sum bound of the engine backend's grouped backward (`CudaBackend`) for `s`, where
/// it differs from the single layer's (`backward_operands`).
fn grouped_dgrad_sum(s: LinearSpec, single: fn(usize, f64) -> f64) -> fn(usize, f64) -> f64 {
    match (s.format(), s.backward()) {
        (Format::Nvfp4, BackwardMode::Dequantized) => factored_sum,
        _ => single,
    }
}

/// The wgrad sum bound of the engine backend's grouped backward for `s`, where it differs from
/// the single layer's (`backward_operands`).
fn grouped_wgrad_sum(s: LinearSpec, single: fn(usize, f64) -> f64) -> fn(usize, f64) -> f64 {
    match (s.format(), s.backward()) {
        (Format::Nvfp4, BackwardMode::Dequantized) => parts_wgrad_sum,
        _ => single,
    }
}

/// The backward operands of the CPU reference per mode: `(dy for dgrad, W, dy for wgrad, x)`
/// as f32 values, and the sum bound of the GEMMs.
#[allow(clippy::type_complexity)]
fn backward_operands(
    s: LinearSpec,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    (m, k, n): (usize, usize, usize),
) -> (
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    fn(usize, f64) -> f64,
) {
    match (s.format(), s.backward()) {
        (Format::Bf16, _) | (_, BackwardMode::HighPrecision) => {
            let d = round_bf16(dy);
            (
                d.clone(),
                round_bf16(w),
                d,
                round_bf16(x),
                tensor_core_sum_bound,
            )
        }
        (_, BackwardMode::Lowp) => (
            deq(&q(dy, m, n, Scheme::MXFP8_ROW, Padding::Reject)),
            deq(&q(w, n, k, Scheme::MXFP8_COL, Padding::Zero)),
            deq(&q(dy, m, n, Scheme::MXFP8_COL, Padding::Zero)),
            deq(&q(x, m, k, Scheme::MXFP8_COL, Padding::Zero)),
            tensor_core_sum_bound,
        ),
        (f, BackwardMode::Dequantized) => {
            let d = round_bf16(dy);
            let wo = deq(&q(w, n, k, s.weight_scheme().unwrap(), Padding::Reject));
            let xo = deq(&q(x, m, k, s.activation_scheme().unwrap(), Padding::Reject));
            let sum: fn(usize, f64) -> f64 = if f == Format::Nvfp4 {
                split_sum
            } else {
                tensor_core_sum_bound
            };
            (d.clone(), wo, d, xo, sum)
        }
    }
}

fn check(what: &str, got: &[f32], want: &[f32], bound: &[f64], seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let v = violations(got, want, |i| bound[i]);
    assert!(v.is_empty(), "{what} (seed {seed}): {v:?}");
}

/// A spec's CPU gradients and their bounds: `(spec, dx, dW, dx bound, dW bound)`.
type ModeGrads = (LinearSpec, Vec<f32>, Vec<f32>, Vec<f64>, Vec<f64>);

#[test]
fn forward_and_gradients_match_the_cpu_layer_for_every_format_and_mode() {
    let (_g, l) = layer();
    for (si, &(m, k, n)) in SHAPES.iter().enumerate() {
        let seed = 100 + 10 * si as u64;
        let x = test_values(m * k, seed, 2.0);
        let w = test_values(n * k, seed + 1, 1.0);
        let dy = test_values(m * n, seed + 2, 0.5);
        let (xd, wd, dyd) = (up_f32(l, &x), up_f32(l, &w), up_f32(l, &dy));
        let bf = PreparedWeight::quantize("t", &w, n, k, LinearSpec::bf16(), 0).unwrap();
        let y_bf16 = bf.forward_inference(&x, m).unwrap();
        let mut grads_by_mode: Vec<ModeGrads> = Vec::new();
        for s in specs() {
            let tag = format!("{s} [{m}, {k}] x [{n}, {k}]");
            let pw = PreparedWeight::quantize("t", &w, n, k, s, 7).unwrap();
            let (y_cpu, saved_cpu) = pw.forward(&x, m).unwrap();
            let g_cpu = pw.backward(&saved_cpu, &dy).unwrap();

            let qw = l.prepare("t", &wd, n, k, s, 7).unwrap();
            let y_inf = down(l, &l.forward_inference(&qw, &xd, m).unwrap());
            let (y, saved) = l.forward(&qw, &xd, m).unwrap();
            let y = down(l, &y);

            // Stored bytes equal the library's.
            match (pw.stored(), qw.stored()) {
                (Some(c), Some(d)) => {
                    assert_eq!(&l.quantizer().download(d).unwrap(), c, "{tag}: W bytes")
                }
                (None, None) => {}
                _ => panic!("{tag}: stored weight on one side only"),
            }
            if let Some(col) = qw.column_wise() {
                let d = l.quantizer().download(col).unwrap();
                let c = q(&w, n, k, Scheme::MXFP8_COL, Padding::Zero);
                assert_eq!(
                    (&d.data, &d.scales),
                    (&c.data, &c.scales),
                    "{tag}: W column-wise"
                );
            }
            match (s.backward(), saved.kept_quantized()) {
                (BackwardMode::Dequantized, Some(kq)) if s.format() != Format::Bf16 => {
                    let d = l.quantizer().download(kq).unwrap();
                    assert_eq!(
                        Some(&d),
                        saved_cpu.forward_quantized(),
                        "{tag}: kept x bytes"
                    );
                }
                (BackwardMode::Lowp, Some(kq)) => {
                    let d = l.quantizer().download(kq).unwrap();
                    let c = q(&x, m, k, Scheme::MXFP8_COL, Padding::Zero);
                    assert_eq!(
                        (&d.data, &d.scales),
                        (&c.data, &c.scales),
                        "{tag}: x column-wise"
                    );
                }
                (_, None) => {}
                (mode, Some(_)) => panic!("{tag}: {mode} keeps no quantized x"),
            }
            assert_eq!(
                saved.kept_bytes(),
                saved_cpu.kept_bytes(),
                "{tag}: kept bytes"
            );

            let fb = forward_bound(s, &x, &w, (m, k, n));
            check(&format!("{tag} y"), &y, &y_cpu, &fb, seed);
            assert_eq!(
                y, y_inf,
                "{tag}: forward and forward_inference are one computation"
            );
            if s.format() != Format::Bf16 {
                assert!(
                    !violations(&y_bf16, &y_cpu, |i| fb[i]).is_empty(),
                    "{tag}: the bound cannot tell the quantized forward from BF16"
                );
            }

            let g = l.backward(&qw, saved, &dyd).unwrap();
            let (dx, dw) = (down(l, &g.dx), down(l, &g.dw));
            let (dy_d, w_o, dy_w, x_o, sum) = backward_operands(s, &x, &w, &dy, (m, k, n));
            let bx = gemm_nn_bounds_with(&dy_d, &w_o, m, n, k, sum);
            let bw = gemm_tn_bounds_with(&dy_w, &x_o, None, n, m, k, sum);
            check(&format!("{tag} dx"), &dx, &g_cpu.dx, &bx, seed);
            check(&format!("{tag} dW"), &dw, &g_cpu.dw, &bw, seed);
            grads_by_mode.push((s, g_cpu.dx, g_cpu.dw, bx, bw));
        }
        // The gradient bounds separate the modes of one format (so a mode that silently used
        // another mode's operands would fail above). M = 1, K = 32 is too small to rely on.
        if m > 1 {
            for (a, dxa, dwa, bxa, bwa) in &grads_by_mode {
                for (b, dxb, dwb, _, _) in &grads_by_mode {
                    if a.format() == b.format() && a.backward() != b.backward() {
                        let dx_apart = !violations(dxb, dxa, |i| bxa[i]).is_empty();
                        let dw_apart = !violations(dwb, dwa, |i| bwa[i]).is_empty();
                        assert!(dx_apart && dw_apart, "{a} vs {b} [{m}, {k}, {n}]");
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_inputs_are_kept_without_a_copy_and_give_the_f32_path_results() {
    let (_g, l) = layer();
    let (m, k, n) = (48, 64, 96);
    let x = round_bf16(&test_values(m * k, 1, 2.0));
    let w = round_bf16(&test_values(n * k, 2, 1.0));
    let dy = round_bf16(&test_values(m * n, 3, 0.5));
    for s in specs() {
        let run = |xd: Arc<DeviceInput>, wd: Arc<DeviceInput>, dyd: Arc<DeviceInput>| {
            let qw = l.prepare("t", &wd, n, k, s, 0).unwrap();
            let (y, saved) = l.forward(&qw, &xd, m).unwrap();
            let kept = saved.kept_bytes();
            let wbytes = qw.device_bytes();
            let g = l.backward(&qw, saved, &dyd).unwrap();
            (down(l, &y), down(l, &g.dx), down(l, &g.dw), kept, wbytes)
        };
        let a = run(up_f32(l, &x), up_f32(l, &w), up_f32(l, &dy));
        let b = run(up_bf16(l, &x), up_bf16(l, &w), up_bf16(l, &dy));
        assert_eq!(
            (&a.0, &a.1, &a.2),
            (&b.0, &b.1, &b.2),
            "{s}: same operands, same bits"
        );
        let keeps_x = s.format() == Format::Bf16 || s.backward() == BackwardMode::HighPrecision;
        if keeps_x {
            assert_eq!(a.3, 2 * m * k, "{s}: f32 x is kept as a BF16 copy");
            assert_eq!(b.3, 0, "{s}: a BF16 x is kept as it is");
        } else {
            assert_eq!(a.3, b.3, "{s}");
        }
        if s.format() != Format::Bf16 && s.backward() == BackwardMode::HighPrecision {
            assert_eq!(
                a.4 - b.4,
                2 * n * k,
                "{s}: a BF16 W is its own backward operand"
            );
        }
    }
}

#[test]
fn backward_refuses_a_context_of_another_weight_version() {
    let (_g, l) = layer();
    let (m, k, n) = (4, 32, 64);
    let w = up_f32(l, &test_values(n * k, 4, 1.0));
    let x = up_f32(l, &test_values(m * k, 5, 1.0));
    let dy = up_f32(l, &test_values(m * n, 6, 1.0));
    let s = LinearSpec::new(Format::Mxfp8, BackwardMode::Dequantized).unwrap();
    let v1 = l.prepare("layers.0.mlp", &w, n, k, s, 1).unwrap();
    let v2 = l.prepare("layers.0.mlp", &w, n, k, s, 2).unwrap();
    let (_, saved) = l.forward(&v1, &x, m).unwrap();
    let e = l
        .backward(&v2, saved, &dy)
        .err()
        .expect("stale context refused");
    let msg = e.to_string();
    assert!(
        msg.contains("layers.0.mlp") && msg.contains("version"),
        "{msg}"
    );
    // A wrong dy shape names the weight and the operand.
    let (_, saved) = l.forward(&v1, &x, m).unwrap();
    let e = l.backward(&v1, saved, &x).err().expect("shape refused");
    assert!(e.to_string().contains("output gradient dy"), "{e}");
}

/// The engine backend's block-format linears (`CudaBackend::quantize_weights`,
/// `grouped_qlinear`, `qlinear`, `grouped_qlinear_backward`) against the CPU backend's, over
/// three stacked weights with ragged groups (37 rows, none, 33 rows): the stored bytes
/// (quantized on the device: MXFP8 as one tensor, NVFP4 as a stack with one amax per weight)
/// equal the CPU's exactly; `y`,
/// `dx` and `dW` of every group are within the same derived bounds as the single layer above
/// (NVFP4 `dequantized`: `dx` within `factored_sum`, `dW`, its three parts in one sum, within
/// `parts_wgrad_sum`); `dW` accumulates into what the buffer held.
#[test]
fn the_engine_backends_grouped_quantized_linears_match_the_cpu_backend() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::device::{Backend, CpuBackend};
    let (_g, _) = layer();
    let cb = CudaBackend::new(0).unwrap_or_else(|e| panic!("GPU 0 is unusable: {e}"));
    let (groups, n, k) = (3usize, 64usize, 96usize);
    let offsets = [0u32, 37, 37, 70];
    let rows = 70;
    for (si, s) in specs()
        .into_iter()
        .filter(|s| s.format() != Format::Bf16)
        .enumerate()
    {
        let seed = 900 + 10 * si as u64;
        let tag = format!("{s} grouped [{groups}·{n}, {k}]");
        let master = test_values(groups * n * k, seed, 1.0);
        let x = test_values(rows * k, seed + 1, 2.0);
        let dy = test_values(rows * n, seed + 2, 0.5);
        let acc = test_values(groups * n * k, seed + 3, 0.25);
        let name = |g: usize| format!("w{g}");
        let qc = CpuBackend
            .quantize_weights(&master, groups, n, k, s, &name, 0)
            .unwrap();
        let md = cb.upload_f32(&master).unwrap();
        let qd = cb.quantize_weights(&md, groups, n, k, s, &name, 0).unwrap();
        assert_eq!(
            cb.stored_weights(&qd).unwrap(),
            CpuBackend.stored_weights(&qc).unwrap(),
            "{tag}: stored bytes"
        );
        // The device checksum of the stored weights (a device-resident weight update) and of
        // their device copy is the reference's.
        let mut sums = cb.zeros_u32(4).unwrap();
        cb.checksum_qweights(&qd, &mut sums, 0).unwrap();
        cb.checksum_qweights(&cb.copy_qweights(&qd).unwrap(), &mut sums, 1)
            .unwrap();
        let w = cb.download_u32(&sums, 4).unwrap();
        let stored = CpuBackend.stored_weights(&qc).unwrap();
        let want = mxrl_tensor::device::checksum_stored(&stored.iter().collect::<Vec<_>>());
        for slot in 0..2 {
            let got = u64::from(w[2 * slot]) | (u64::from(w[2 * slot + 1]) << 32);
            assert_eq!(got, want, "{tag}: checksum {slot}");
        }
        // Forward.
        let (xd, od) = (cb.upload_f32(&x).unwrap(), cb.upload_u32(&offsets).unwrap());
        let mut yd = cb.zeros_f32(rows * n).unwrap();
        cb.grouped_qlinear(&xd, &qd, &od, groups, rows, k, n, &mut yd)
            .unwrap();
        let y = cb.download_f32(&yd, rows * n).unwrap();
        let mut yc = vec![0f32; rows * n];
        CpuBackend
            .grouped_qlinear(&x, &qc, &offsets.to_vec(), groups, rows, k, n, &mut yc)
            .unwrap();
        // Backward into a dW that holds `dw0` (dx overwritten), with or without the caller's
        // BF16 copy of the master.
        let dyd = cb.upload_f32(&dy).unwrap();
        let backward_x_dy = |x: SavedX<'_, _, _>,
                             master_bf16: Option<&cudarc::driver::CudaSlice<u16>>,
                             dw0: &[f32],
                             write: GradWrite,
                             dy: OutGrad<'_, _, _>| {
            let mut dxd = cb.zeros_f32(rows * k).unwrap();
            let mut dwd = cb.upload_f32(dw0).unwrap();
            cb.grouped_qlinear_backward(
                x,
                &qd,
                &md,
                master_bf16,
                dy,
                None,
                &offsets,
                rows,
                k,
                n,
                &mut dxd,
                &mut dwd,
                write,
            )
            .map(|()| {
                (
                    cb.download_f32(&dxd, rows * k).unwrap(),
                    cb.download_f32(&dwd, groups * n * k).unwrap(),
                )
            })
        };
        let backward_dy = |master_bf16: Option<&cudarc::driver::CudaSlice<u16>>,
                           dw0: &[f32],
                           write: GradWrite,
                           dy: OutGrad<'_, _, _>| {
            backward_x_dy(SavedX::F32(&xd), master_bf16, dw0, write, dy)
        };
        let backward = |master_bf16: Option<&cudarc::driver::CudaSlice<u16>>,
                        dw0: &[f32],
                        write: GradWrite| {
            backward_dy(master_bf16, dw0, write, OutGrad::F32(&dyd)).unwrap()
        };
        // Accumulating into `acc`.
        let (dx, dw) = backward(None, &acc, GradWrite::Accumulate);
        // A fresh dW: overwriting a buffer of NaNs gives, bit for bit, what accumulating into
        // zeros gives (zeros for groups without rows).
        let fresh =
            |init: f32, write: GradWrite| backward(None, &vec![init; groups * n * k], write).1;
        let (over, zero) = (
            fresh(f32::NAN, GradWrite::Overwrite),
            fresh(0.0, GradWrite::Accumulate),
        );
        assert!(
            over.iter()
                .zip(&zero)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{tag}: overwriting dW differs from accumulating into zeros"
        );
        // The caller's BF16 copy of the master (what the optimizer step writes) gives the bits
        // of rounding the master here: the high-precision mode multiplies it, the others do
        // not read it.
        let mut mb = cb.empty_bf16(groups * n * k).unwrap();
        cb.to_bf16(&md, &mut mb, groups * n * k).unwrap();
        let (dxc, dwc) = backward(Some(&mb), &acc, GradWrite::Accumulate);
        assert_eq!(bits(&dxc), bits(&dx), "{tag}: dx with the kept BF16 copy");
        assert_eq!(bits(&dwc), bits(&dw), "{tag}: dW with the kept BF16 copy");
        // dy handed over in BF16 (what the combine and SwiGLU backwards write for these
        // modes) gives the bits of rounding it here; `lowp` refuses it.
        let mut dyb = cb.empty_bf16(rows * n).unwrap();
        cb.to_bf16(&dyd, &mut dyb, rows * n).unwrap();
        let with_bf16_dy = backward_dy(None, &acc, GradWrite::Accumulate, OutGrad::Bf16(&dyb));
        if s.rounds_dy_to_bf16() {
            let (dxb, dwb) = with_bf16_dy.unwrap();
            assert_eq!(bits(&dxb), bits(&dx), "{tag}: dx with a BF16 dy");
            assert_eq!(bits(&dwb), bits(&dw), "{tag}: dW with a BF16 dy");
        } else {
            assert!(
                with_bf16_dy.is_err(),
                "{tag}: a BF16 dy for the lowp backward"
            );
        }
        // x kept in BF16 (the forward's gathered BF16 rows, for the high-precision mode) gives
        // the bits of rounding it here; the modes that quantize the f32 x refuse it.
        let mut xb = cb.empty_bf16(rows * k).unwrap();
        cb.to_bf16(&xd, &mut xb, rows * k).unwrap();
        let with_bf16_x = backward_x_dy(
            SavedX::Bf16(&xb),
            None,
            &acc,
            GradWrite::Accumulate,
            OutGrad::F32(&dyd),
        );
        if s.rounds_x_to_bf16() {
            let (dxb, dwb) = with_bf16_x.unwrap();
            assert_eq!(bits(&dxb), bits(&dx), "{tag}: dx with a BF16 x");
            assert_eq!(bits(&dwb), bits(&dw), "{tag}: dW with a BF16 x");
        } else {
            let e = with_bf16_x.unwrap_err().to_string();
            assert!(e.contains("takes x in f32"), "{tag}: {e}");
        }
        for g in 0..groups {
            let (a, b) = (offsets[g] as usize, offsets[g + 1] as usize);
            let m = b - a;
            let wg = &master[g * n * k..(g + 1) * n * k];
            let dwg = &dw[g * n * k..(g + 1) * n * k];
            let accg = &acc[g * n * k..(g + 1) * n * k];
            if m == 0 {
                assert_eq!(
                    dwg, accg,
                    "{tag}: group {g} has no rows, its dW is untouched"
                );
                continue;
            }
            let (xg, dyg) = (&x[a * k..b * k], &dy[a * n..b * n]);
            let fb = forward_bound(s, xg, wg, (m, k, n));
            check(
                &format!("{tag} y[{g}]"),
                &y[a * n..b * n],
                &yc[a * n..b * n],
                &fb,
                seed,
            );
            let pw = PreparedWeight::quantize("t", wg, n, k, s, 0).unwrap();
            let (_, saved) = pw.forward(xg, m).unwrap();
            let gc = pw.backward(&saved, dyg).unwrap();
            let (dy_d, w_o, dy_w, x_o, sum) = backward_operands(s, xg, wg, dyg, (m, k, n));
            let bx = gemm_nn_bounds_with(&dy_d, &w_o, m, n, k, grouped_dgrad_sum(s, sum));
            check(
                &format!("{tag} dx[{g}]"),
                &dx[a * k..b * k],
                &gc.dx,
                &bx,
                seed,
            );
            // dW = acc + dW_cpu: one more f32 rounding of the sum on each side.
            let bw = gemm_tn_bounds_with(&dy_w, &x_o, None, n, m, k, grouped_wgrad_sum(s, sum));
            let want: Vec<f32> = accg.iter().zip(&gc.dw).map(|(p, q)| p + q).collect();
            let bw: Vec<f64> = bw
                .iter()
                .zip(&want)
                .map(|(b, w)| b + 2.0 * f64::from(w.abs()) * f64::from(f32::EPSILON))
                .collect();
            check(&format!("{tag} dW[{g}]"), dwg, &want, &bw, seed);
        }
        // A dense linear (one weight) through `qlinear`: MXFP8 on the device; NVFP4 dense
        // linears have no device path and say so.
        let q1c = CpuBackend
            .quantize_weights(&master, 1, n, k, s, &name, 0)
            .unwrap();
        let q1d = cb.quantize_weights(&md, 1, n, k, s, &name, 0).unwrap();
        let mut y1 = cb.zeros_f32(rows * n).unwrap();
        let r = cb.qlinear(&xd, &q1d, rows, k, n, &mut y1);
        if s.format() == Format::Mxfp8 {
            r.unwrap();
            let mut y1c = vec![0f32; rows * n];
            CpuBackend.qlinear(&x, &q1c, rows, k, n, &mut y1c).unwrap();
            let fb = forward_bound(s, &x, &master[..n * k], (rows, k, n));
            check(
                &format!("{tag} dense y"),
                &cb.download_f32(&y1, rows * n).unwrap(),
                &y1c,
                &fb,
                seed,
            );
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("no dense device path"), "{e}");
        }
        // The dense backward (one group of every row: cuBLAS on the same operands).
        let w1 = &master[..n * k];
        let mut dx1 = cb.zeros_f32(rows * k).unwrap();
        let mut dw1 = cb.upload_f32(&acc[..n * k]).unwrap();
        let md1 = cb.upload_f32(w1).unwrap();
        let dense = [0u32, rows as u32];
        cb.grouped_qlinear_backward(
            SavedX::F32(&xd),
            &q1d,
            &md1,
            None,
            OutGrad::F32(&dyd),
            None,
            &dense,
            rows,
            k,
            n,
            &mut dx1,
            &mut dw1,
            GradWrite::Accumulate,
        )
        .unwrap();
        let (mut dx1c, mut dw1c) = (vec![0f32; rows * k], acc[..n * k].to_vec());
        CpuBackend
            .grouped_qlinear_backward(
                SavedX::F32(&x),
                &q1c,
                &w1.to_vec(),
                None,
                OutGrad::F32(&dy),
                None,
                &dense,
                rows,
                k,
                n,
                &mut dx1c,
                &mut dw1c,
                GradWrite::Accumulate,
            )
            .unwrap();
        let (dy_d, w_o, dy_w, x_o, sum) = backward_operands(s, &x, w1, &dy, (rows, k, n));
        check(
            &format!("{tag} dense dx"),
            &cb.download_f32(&dx1, rows * k).unwrap(),
            &dx1c,
            &gemm_nn_bounds_with(&dy_d, &w_o, rows, n, k, grouped_dgrad_sum(s, sum)),
            seed,
        );
        let bw: Vec<f64> =
            gemm_tn_bounds_with(&dy_w, &x_o, None, n, rows, k, grouped_wgrad_sum(s, sum))
                .iter()
                .zip(&dw1c)
                .map(|(b, w)| b + 2.0 * f64::from(w.abs()) * f64::from(f32::EPSILON))
                .collect();
        check(
            &format!("{tag} dense dW"),
            &cb.download_f32(&dw1, n * k).unwrap(),
            &dw1c,
            &bw,
            seed,
        );
    }
}

/// The engine backend's fused forms give the unfused ops' bits on the device: the grouped
/// quantized linear of gathered token rows (`grouped_qlinear_gathered`: the token rows
/// quantized once, their operands gathered) against `gather_f32` + `grouped_qlinear`, and one
/// input times several dense weights (`qlinear_shared`: the input quantized once) against
/// `qlinear` per weight, for MXFP8, NVFP4 (grouped only: NVFP4 dense linears have no device
/// path) and FP8 block, at token counts that take the fragment and the tiled kernels. The
/// fused outputs go into NaN-filled buffers, so an element left unwritten fails.
#[test]
fn gathered_and_shared_quantized_linears_give_the_unfused_bits() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::device::{Backend, RouteBufs};
    let (_g, _) = layer();
    let cb = CudaBackend::new(0).unwrap_or_else(|e| panic!("GPU 0 is unusable: {e}"));
    let (experts, top_k, n, k) = (4usize, 2usize, 128usize, 256usize);
    let nan = |len: usize| cb.upload_f32(&vec![f32::NAN; len]).unwrap();
    let mut specs: Vec<LinearSpec> = [Format::Mxfp8, Format::Nvfp4]
        .into_iter()
        .map(|f| LinearSpec::new(f, BackwardMode::HighPrecision).unwrap())
        .collect();
    specs.push(LinearSpec::new(Format::Fp8Block, BackwardMode::HighPrecision).unwrap());
    for (si, s) in specs.into_iter().enumerate() {
        let name = |g: usize| format!("w{g}");
        let master = test_values(experts * n * k, 1300 + si as u64, 1.0);
        let md = cb.upload_f32(&master).unwrap();
        let qd = cb
            .quantize_weights(&md, experts, n, k, s, &name, 0)
            .unwrap();
        for tokens in [1usize, 37, 300] {
            let tag = format!("{s}, {tokens} tokens");
            let seed = 1400 + 10 * si as u64 + tokens as u64;
            let x = test_values(tokens * k, seed, 2.0);
            let logits = cb
                .upload_f32(&test_values(tokens * experts, seed + 1, 3.0))
                .unwrap();
            let rows = tokens * top_k;
            let mut r = RouteBufs {
                ids: cb.zeros_u32(rows).unwrap(),
                weights: cb.zeros_f32(rows).unwrap(),
                probs: cb.zeros_f32(tokens * experts).unwrap(),
                offsets: cb.zeros_u32(experts + 1).unwrap(),
                perm: cb.zeros_u32(rows).unwrap(),
                row_of: cb.zeros_u32(rows).unwrap(),
            };
            cb.route(&logits, tokens, experts, top_k, true, None, &mut r)
                .unwrap();
            let xd = cb.upload_f32(&x).unwrap();
            let mut xg = cb.zeros_f32(rows * k).unwrap();
            cb.gather_f32(&xd, &r, tokens, experts, top_k, k, &mut xg)
                .unwrap();
            let mut want = cb.zeros_f32(rows * n).unwrap();
            cb.grouped_qlinear(&xg, &qd, &r.offsets, experts, rows, k, n, &mut want)
                .unwrap();
            let mut got = nan(rows * n);
            cb.grouped_qlinear_gathered(&xd, &r, tokens, top_k, &qd, experts, k, n, &mut got)
                .unwrap();
            assert_eq!(
                bits(&cb.download_f32(&got, rows * n).unwrap()),
                bits(&cb.download_f32(&want, rows * n).unwrap()),
                "{tag}: grouped_qlinear_gathered"
            );
            if s.format() == Format::Nvfp4 {
                continue;
            }
            // Three dense weights of different widths, as q, k and v.
            let widths = [n, 2 * n, n];
            let dense: Vec<_> = widths
                .iter()
                .enumerate()
                .map(|(i, &w)| {
                    let m = cb
                        .upload_f32(&test_values(w * k, seed + 2 + i as u64, 1.0))
                        .unwrap();
                    cb.quantize_weights(&m, 1, w, k, s, &name, 0).unwrap()
                })
                .collect();
            let mut ys: Vec<_> = widths.iter().map(|&w| nan(tokens * w)).collect();
            {
                let mut outs: Vec<_> = dense
                    .iter()
                    .zip(&widths)
                    .zip(ys.iter_mut())
                    .map(|((q, &w), y)| (q, w, y))
                    .collect();
                cb.qlinear_shared(&xd, tokens, k, &mut outs).unwrap();
            }
            for ((q, &w), y) in dense.iter().zip(&widths).zip(&ys) {
                let mut one = cb.zeros_f32(tokens * w).unwrap();
                cb.qlinear(&xd, q, tokens, k, w, &mut one).unwrap();
                assert_eq!(
                    bits(&cb.download_f32(y, tokens * w).unwrap()),
                    bits(&cb.download_f32(&one, tokens * w).unwrap()),
                    "{tag}: qlinear_shared, width {w}"
                );
            }
        }
    }
}

/// The `Lowp` backward's operands of a grouped tensor, bit for bit the contract library's:
/// every group's rows quantized column-wise as their own tensor (32×1 blocks from the group's
/// first row, the last one zero-padded) and, from the same read of `dy`, row-wise (1×32
/// blocks), both dequantized into BF16 — for widths that take the 64-column tiles (64, 192)
/// and one that takes the one-thread-per-column kernel (96), on ragged groups (an empty one,
/// one of a single row, groups past 32 rows) with zeros, a large and a tiny block mixed in.
#[test]
fn lowp_row_and_column_operands_of_groups_equal_the_library() {
    let (_g, l) = layer();
    let offsets = [0u32, 37, 37, 38, 101, 103];
    let rows = 107; // rows past the last group are no group's
    for (ci, cols) in [64usize, 192, 96].into_iter().enumerate() {
        let seed = 1300 + ci as u64;
        let mut x = test_values(rows * cols, seed, 3.0);
        // Magnitudes spread over 2⁻⁴..2⁴ by row and column, so a block's largest value (and
        // its scale) comes from any of its rows or columns; zero rows, a block of large and
        // one of tiny values.
        for (i, v) in x.iter_mut().enumerate() {
            let (r, c) = (i / cols, i % cols);
            *v *= 2f32.powi(((r * 5 + c * 3) % 9) as i32 - 4);
        }
        x[..cols].iter_mut().for_each(|v| *v = 0.0);
        for r in 40..50 {
            x[r * cols + 5] = 3.0e4 * (r as f32 - 44.5);
            x[r * cols + 9] = 1.0e-30 * (r as f32 - 44.5);
        }
        let xd = l.gpu().upload(&x).unwrap();
        let segs = l.col_segments(&offsets, rows).unwrap();
        let col = l.mxfp8_col_groups_bf16(&xd.as_view(), &segs, cols).unwrap();
        let col = l.gpu().download(&col).unwrap();
        let row = if QLinear::rowcol_fits(cols) {
            let mut rd = l.gpu().upload(&vec![0xDEADu16; rows * cols]).unwrap();
            let col2 = l
                .mxfp8_rowcol_groups_bf16(
                    &ActRows::Rows(&xd.as_view()),
                    &segs,
                    cols,
                    &mut rd.as_view_mut(),
                )
                .unwrap();
            // Rows outside every group are unspecified in both (fresh allocations).
            let held = offsets[offsets.len() - 1] as usize * cols;
            assert_eq!(
                l.gpu().download(&col2).unwrap()[..held],
                col[..held],
                "{cols} columns: col twice"
            );
            Some(l.gpu().download(&rd).unwrap())
        } else {
            assert!(l
                .mxfp8_rowcol_groups_bf16(
                    &ActRows::Rows(&xd.as_view()),
                    &segs,
                    cols,
                    &mut l.gpu().zeros::<u16>(rows * cols).unwrap().as_view_mut()
                )
                .is_err());
            None
        };
        for w in offsets.windows(2) {
            let (a, b) = (w[0] as usize, w[1] as usize);
            if a == b {
                continue;
            }
            let part = &x[a * cols..b * cols];
            let want = bf16_bits(&deq(&q(
                part,
                b - a,
                cols,
                Scheme::MXFP8_COL,
                Padding::Zero,
            )));
            assert_eq!(
                &col[a * cols..b * cols],
                &want[..],
                "{cols} columns, rows {a}..{b}: column-wise"
            );
            if let Some(row) = &row {
                let want = bf16_bits(&deq(&q(
                    part,
                    b - a,
                    cols,
                    Scheme::MXFP8_ROW,
                    Padding::Reject,
                )));
                assert_eq!(
                    &row[a * cols..b * cols],
                    &want[..],
                    "{cols} columns, rows {a}..{b}: row-wise"
                );
            }
        }
        // Rows outside every group keep what they held.
        if let Some(row) = &row {
            assert!(
                row[103 * cols..].iter().all(|&v| v == 0xDEAD),
                "{cols} columns"
            );
        }
    }
}

/// The forward operands a taped forward keeps (`Backend::keeps_forward_operand`: MXFP8 with
/// the `dequantized` backward, the row-wise operand; with `lowp`, the column-wise copy made
/// from the same read; NVFP4 with `dequantized`, the three BF16 parts of the rows'
/// dequantization): `grouped_qlinear_{swiglu,gathered}_kept` give the bits of SwiGLU /
/// the gather followed by `grouped_qlinear`, and the backward on the kept operand
/// (`SavedX::Operand`) gives, bit for bit, the `dx` and `dW` of the backward on the f32 rows
/// (which quantizes them again). Specs that keep none refuse both.
#[test]
fn the_kept_forward_operand_gives_the_backward_of_the_f32_rows() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::device::{Backend, RouteBufs};
    let (_g, _) = layer();
    let cb = CudaBackend::new(0).unwrap_or_else(|e| panic!("GPU 0 is unusable: {e}"));
    // 35 tokens × top-2 over 3 experts: 70 routed rows (the fragment kernels, NVFP4 in
    // binary16); 800 tokens: 1 600 rows (the tiles, NVFP4 in BF16). `f` takes the 64-column
    // tiles.
    let (groups, n, f, top_k) = (3usize, 64usize, 128usize, 2usize);
    for tokens in [35usize, 800] {
        let rows = tokens * top_k;
        let mut kept_specs = 0;
        for (si, s) in specs()
            .into_iter()
            .filter(|s| s.format() != Format::Bf16)
            .enumerate()
        {
            let seed = 1500 + 10 * si as u64;
            let tag = format!("{s} grouped [{groups}·{n}, {f}], {rows} rows");
            let master = test_values(groups * n * f, seed, 1.0);
            let name = |g: usize| format!("w{g}");
            let md = cb.upload_f32(&master).unwrap();
            let qd = cb.quantize_weights(&md, groups, n, f, s, &name, 0).unwrap();
            // The routes of random logits.
            let logits = cb
                .upload_f32(&test_values(tokens * groups, seed + 1, 3.0))
                .unwrap();
            let u = |m: usize| cb.zeros_u32(m).unwrap();
            let mut rb = RouteBufs::<CudaBackend> {
                ids: u(rows),
                weights: cb.zeros_f32(rows).unwrap(),
                probs: cb.zeros_f32(tokens * groups).unwrap(),
                offsets: u(groups + 1),
                perm: u(rows),
                row_of: u(rows),
            };
            cb.route(&logits, tokens, groups, top_k, true, None, &mut rb)
                .unwrap();
            let offsets = cb.download_u32(&rb.offsets, groups + 1).unwrap();
            assert_eq!(offsets[groups] as usize, rows, "{tag}: routes");
            let x = cb
                .upload_f32(&test_values(tokens * f, seed + 2, 2.0))
                .unwrap();
            let gu = cb
                .upload_f32(&test_values(rows * 2 * f, seed + 3, 2.0))
                .unwrap();
            let dyd = cb
                .upload_f32(&test_values(rows * n, seed + 4, 0.5))
                .unwrap();
            // The f32 rows each source names.
            let mut xg = cb.zeros_f32(rows * f).unwrap();
            cb.gather_f32(&x, &rb, tokens, groups, top_k, f, &mut xg)
                .unwrap();
            let mut act = cb.zeros_f32(rows * f).unwrap();
            cb.swiglu_f32(&gu, rows, f, &mut act).unwrap();
            let keeps = cb.keeps_forward_operand(&s, f);
            let mut yk = cb.zeros_f32(rows * n).unwrap();
            let kept = [
                cb.grouped_qlinear_gathered_kept(
                    &x, &rb, &offsets, tokens, top_k, &qd, groups, f, n, &mut yk,
                ),
                cb.grouped_qlinear_swiglu_kept(
                    &gu,
                    &qd,
                    &rb.offsets,
                    &offsets,
                    groups,
                    rows,
                    f,
                    n,
                    &mut cb.zeros_f32(rows * n).unwrap(),
                ),
            ];
            if !keeps {
                assert!(kept.iter().all(|k| k.is_err()), "{tag}: keeps no operand");
                continue;
            }
            kept_specs += 1;
            let backward = |x: SavedX<'_, _, _>| {
                let mut dxd = cb.zeros_f32(rows * f).unwrap();
                let mut dwd = cb.zeros_f32(groups * n * f).unwrap();
                cb.grouped_qlinear_backward(
                    x,
                    &qd,
                    &md,
                    None,
                    OutGrad::F32(&dyd),
                    Some(&rb.offsets),
                    &offsets,
                    rows,
                    f,
                    n,
                    &mut dxd,
                    &mut dwd,
                    GradWrite::Overwrite,
                )
                .unwrap();
                (
                    bits(&cb.download_f32(&dxd, rows * f).unwrap()),
                    bits(&cb.download_f32(&dwd, groups * n * f).unwrap()),
                )
            };
            for ((what, rows_f32), kept) in
                [("gathered", &xg), ("swiglu", &act)].into_iter().zip(kept)
            {
                let kept = kept.unwrap();
                if what == "gathered" {
                    let mut y = cb.zeros_f32(rows * n).unwrap();
                    cb.grouped_qlinear(rows_f32, &qd, &rb.offsets, groups, rows, f, n, &mut y)
                        .unwrap();
                    assert_eq!(
                        bits(&cb.download_f32(&y, rows * n).unwrap()),
                        bits(&cb.download_f32(&yk, rows * n).unwrap()),
                        "{tag} {what}: forward"
                    );
                }
                let (dx, dw) = backward(SavedX::F32(rows_f32));
                let (dxk, dwk) = backward(SavedX::Operand(&kept));
                assert_eq!(dx, dxk, "{tag} {what}: dx");
                assert_eq!(dw, dwk, "{tag} {what}: dW");
                assert!(dw.iter().any(|&b| b != 0), "{tag} {what}: dW all zero");
            }
        }
        assert_eq!(
            kept_specs, 3,
            "MXFP8 `dequantized` and `lowp`, NVFP4 `dequantized` keep an operand"
        );
    }
    // A spec that keeps none refuses the operand in the backward too.
    let s = LinearSpec::new(Format::Nvfp4, BackwardMode::HighPrecision).unwrap();
    let master = test_values(n * f, 7, 1.0);
    let md = cb.upload_f32(&master).unwrap();
    let qd = cb
        .quantize_weights(&md, 1, n, f, s, &|g| format!("w{g}"), 0)
        .unwrap();
    let op = cb.zeros_bf16(8 * f).unwrap();
    let dyd = cb.zeros_f32(8 * n).unwrap();
    let (mut dxd, mut dwd) = (cb.zeros_f32(8 * f).unwrap(), cb.zeros_f32(n * f).unwrap());
    let e = cb
        .grouped_qlinear_backward(
            SavedX::Operand(&op),
            &qd,
            &md,
            None,
            OutGrad::F32(&dyd),
            None,
            &[0, 8],
            8,
            f,
            n,
            &mut dxd,
            &mut dwd,
            GradWrite::Overwrite,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no forward operand") && e.contains("high_precision"),
        "{e}"
    );
}
