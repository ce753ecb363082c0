//! SwiGLU forward/backward on the GPU against `mxrl_tensor::activation::{swiglu_forward,
//! swiglu_backward}`: per element within the derived bound of
//! `mxrl_tensor::tolerance::swiglu_{forward_bound, backward_bounds}` (the two devices' `exp`
//! may differ by an ulp; everything else is the same f32 operation sequence), special values
//! classified identically, and the bf16 output equal to `round_bf16` of the f32 output.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::swiglu::Swiglu;
use mxrl_tensor::activation::{swiglu_backward, swiglu_forward};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::tolerance::{
    swiglu_backward_bounds, swiglu_forward_bound, EXP_ULPS_CPU, EXP_ULPS_DEVICE,
};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, scale)
}

/// `got` vs `want` with `bound`: equal bits always pass (also where the bound is not finite:
/// an exp past f32's range on one device), NaN only against NaN, infinities equal, finite
/// values within the bound.
fn close(got: f32, want: f32, bound: f64) -> bool {
    if got.to_bits() == want.to_bits() {
        return true;
    }
    if got.is_nan() || want.is_nan() {
        return got.is_nan() && want.is_nan();
    }
    if got.is_infinite() || want.is_infinite() {
        return got == want;
    }
    ((got as f64) - (want as f64)).abs() <= bound
}

/// Runs forward (with and without the bf16 output) and backward on `gu`, `dh` and checks
/// every element; returns how many f32 outputs were not bitwise equal to the reference.
fn check(g: &Gpu, ops: &Swiglu, gu: &[f32], dh: &[f32], rows: usize, f: usize, seed: u64) -> usize {
    let ctx = format!("rows={rows} F={f} seed={seed}");
    let mut want_h = vec![0.0f32; rows * f];
    swiglu_forward(gu, rows, f, &mut want_h);
    let mut want_dgu = vec![0.0f32; rows * 2 * f];
    swiglu_backward(dh, gu, rows, f, &mut want_dgu);

    let dgu_in = g.upload(gu).unwrap();
    let ddh = g.upload(dh).unwrap();
    let mut h = g.zeros::<f32>(rows * f).unwrap();
    let mut h2 = g.zeros::<f32>(rows * f).unwrap();
    let mut hb = g.zeros::<u16>(rows * f).unwrap();
    let mut dgu = g.zeros::<f32>(rows * 2 * f).unwrap();
    ops.forward(&dgu_in.as_view(), &mut h.as_view_mut(), None, rows, f)
        .unwrap();
    ops.forward(
        &dgu_in.as_view(),
        &mut h2.as_view_mut(),
        Some(&mut hb.as_view_mut()),
        rows,
        f,
    )
    .unwrap();
    ops.backward(
        &ddh.as_view(),
        &dgu_in.as_view(),
        &mut dgu.as_view_mut(),
        rows,
        f,
    )
    .unwrap();
    let mut hb_only = g.zeros::<u16>(rows * f).unwrap();
    ops.forward_bf16(&dgu_in.as_view(), &mut hb_only.as_view_mut(), rows, f)
        .unwrap();
    let hb_only = g.download(&hb_only).unwrap();
    let mut dgub = g.zeros::<u16>(rows * 2 * f).unwrap();
    ops.backward_bf16(
        &ddh.as_view(),
        &dgu_in.as_view(),
        &mut dgub.as_view_mut(),
        rows,
        f,
    )
    .unwrap();
    let dgub = g.download(&dgub).unwrap();
    let (h, h2, hb, dgu) = (
        g.download(&h).unwrap(),
        g.download(&h2).unwrap(),
        g.download(&hb).unwrap(),
        g.download(&dgu).unwrap(),
    );
    let (h, h2, hb, dgu) = (
        &h[..rows * f],
        &h2[..rows * f],
        &hb[..rows * f],
        &dgu[..rows * 2 * f],
    );
    let mut differ = 0;
    for r in 0..rows {
        for j in 0..f {
            let i = r * f + j;
            let (gv, uv) = (gu[r * 2 * f + j], gu[r * 2 * f + f + j]);
            let b = swiglu_forward_bound(gv, uv, EXP_ULPS_DEVICE, EXP_ULPS_CPU);
            assert!(
                close(h[i], want_h[i], b),
                "{ctx}: h[{r},{j}] (g={gv:e}, up={uv:e}) gpu {:e}, cpu {:e}, bound {b:e}",
                h[i],
                want_h[i]
            );
            assert_eq!(
                h2[i].to_bits(),
                h[i].to_bits(),
                "{ctx}: bf16 variant's f32 h[{i}]"
            );
            let wb = round_bf16(h[i]);
            let gb = f32::from_bits((hb[i] as u32) << 16);
            assert!(
                gb.to_bits() == wb.to_bits() || (gb.is_nan() && wb.is_nan()),
                "{ctx}: bf16 h[{i}] {gb:e} vs round_bf16 {wb:e}"
            );
            assert_eq!(hb_only[i], hb[i], "{ctx}: bf16-only h[{i}]");
            let (bg, bu) = swiglu_backward_bounds(dh[i], gv, uv, EXP_ULPS_DEVICE, EXP_ULPS_CPU);
            let (ig, iu) = (r * 2 * f + j, r * 2 * f + f + j);
            assert!(
                close(dgu[ig], want_dgu[ig], bg),
                "{ctx}: dgate[{r},{j}] (dh={:e}, g={gv:e}, up={uv:e}) gpu {:e}, cpu {:e}, bound {bg:e}",
                dh[i],
                dgu[ig],
                want_dgu[ig]
            );
            assert!(
                close(dgu[iu], want_dgu[iu], bu),
                "{ctx}: dup[{r},{j}] gpu {:e}, cpu {:e}, bound {bu:e}",
                dgu[iu],
                want_dgu[iu]
            );
            for at in [ig, iu] {
                let (gb, wb) = (f32::from_bits((dgub[at] as u32) << 16), round_bf16(dgu[at]));
                assert!(
                    gb.to_bits() == wb.to_bits() || (gb.is_nan() && wb.is_nan()),
                    "{ctx}: bf16 variant's dgu[{at}] {gb:e} vs round_bf16 {wb:e}"
                );
            }
            for (a, w) in [
                (h[i], want_h[i]),
                (dgu[ig], want_dgu[ig]),
                (dgu[iu], want_dgu[iu]),
            ] {
                if a.to_bits() != w.to_bits() && !(a.is_nan() && w.is_nan()) {
                    differ += 1;
                }
            }
        }
    }
    differ
}

#[test]
fn swiglu_matches_reference_on_random_and_ragged_shapes() {
    let g = gpu();
    let ops = Swiglu::new(&g).unwrap();
    let shapes = [
        (0usize, 5usize),
        (3, 0),
        (1, 1),
        (1, 768),
        (7, 13),
        (37, 129),
        (128, 768),
        (513, 31),
    ];
    let (mut total, mut differ) = (0, 0);
    for (i, &(rows, f)) in shapes.iter().enumerate() {
        let seed = 100 + i as u64;
        let gu = values(rows * 2 * f, seed, 8.0);
        let dh = values(rows * f, seed + 1000, 2.0);
        differ += check(&g, &ops, &gu, &dh, rows, f, seed);
        total += 3 * rows * f;
    }
    println!("swiglu: {differ} of {total} f32 outputs not bitwise equal to the CPU reference");
}

#[test]
fn swiglu_special_values_classify_as_the_reference() {
    let g = gpu();
    let ops = Swiglu::new(&g).unwrap();
    let gates = [
        0.0f32,
        -0.0,
        1e-30,
        -1e-30,
        -1.2784645,
        50.0,
        -50.0,
        88.0,
        -88.0,
        89.0,
        -89.0,
        100.0,
        -100.0,
        110.0,
        1e30,
        -1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
    ];
    let ups = [1.0f32, -2.5, 0.0, f32::INFINITY, 3e38];
    let f = gates.len();
    let rows = ups.len();
    let mut gu = vec![0.0f32; rows * 2 * f];
    let mut dh = vec![0.0f32; rows * f];
    for r in 0..rows {
        for j in 0..f {
            gu[r * 2 * f + j] = gates[j];
            gu[r * 2 * f + f + j] = ups[r];
            dh[r * f + j] = [1.0f32, -0.5, 2.0][(r + j) % 3];
        }
    }
    check(&g, &ops, &gu, &dh, rows, f, 0);
}

#[test]
fn swiglu_launcher_rejects_short_buffers() {
    let g = gpu();
    let ops = Swiglu::new(&g).unwrap();
    let gu = g.zeros::<f32>(2 * 4 * 3 - 1).unwrap();
    let mut h = g.zeros::<f32>(12).unwrap();
    let e = ops
        .forward(&gu.as_view(), &mut h.as_view_mut(), None, 4, 3)
        .unwrap_err();
    assert!(e.to_string().contains("swiglu gu"), "{e}");
}
