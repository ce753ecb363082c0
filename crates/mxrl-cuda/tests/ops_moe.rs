//! MoE dispatch, gather, combine and their backward on the GPU against
//! `mxrl_tensor::moe::{Dispatch, gather, gather_backward, combine_forward, combine_backward}`
//! (the CPU reference called per expert `0..E` into zeroed outputs, as the model does).
//! Dispatch, gather, combine, the dy rows and gather backward are bitwise; the combine
//! backward's dweights are within `two_order_sum_bound(H, Σ|fl(dout·y)|)` (the same rounded
//! products on both devices, summed in a fixed tree on the device, sequentially on the CPU). Shapes include 0-token experts, N = 1, k = E, N = 0
//! and several dispatch blocks; both dispatch paths (one launch for `N·k ≤ 1024, E ≤ 256`,
//! three otherwise) and both access paths of the row kernels (float4, scalar for unaligned
//! views or `H % 4 ≠ 0`).
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::moe::{dispatch_scratch_len, Moe, INVALID_ROW};
use mxrl_tensor::moe::{combine_backward, combine_forward, gather, gather_backward, Dispatch};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::routing::Routes;
use mxrl_tensor::tolerance::two_order_sum_bound;
use rand::{Rng, SeedableRng};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, 2.0)
}

/// `k` distinct experts per token drawn from the first `active` experts (so experts
/// `active..E` get 0 tokens), in random slot order.
fn random_routes(n: usize, k: usize, active: usize, seed: u64) -> Routes {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut ids = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut pool: Vec<u32> = (0..active as u32).collect();
        for _ in 0..k {
            let j = r.gen_range(0..pool.len());
            ids.push(pool.swap_remove(j));
        }
    }
    Routes {
        top_k: k,
        ids,
        weights: values(n * k, seed ^ 0x5555),
    }
}

/// Device dispatch of `ids`: (offsets, perm, row_of) on the host and the device buffers.
struct DevDispatch {
    offsets: cudarc::driver::CudaSlice<u32>,
    perm: cudarc::driver::CudaSlice<u32>,
    row_of: cudarc::driver::CudaSlice<u32>,
}

fn dispatch(g: &Gpu, ops: &Moe, ids: &[u32], n: usize, e: usize, k: usize) -> DevDispatch {
    let dids = g.upload(ids).unwrap();
    // Scratch of garbage: the dispatch must not rely on zeros there.
    let mut scratch = g
        .upload(&vec![0xA5A5_A5A5u32; dispatch_scratch_len(n, k, e)])
        .unwrap();
    let mut offsets = g.zeros::<u32>(e + 1).unwrap();
    let mut perm = g.zeros::<u32>(n * k).unwrap();
    let mut row_of = g.zeros::<u32>(n * k).unwrap();
    ops.dispatch(
        &dids.as_view(),
        n,
        e,
        k,
        &mut scratch.as_view_mut(),
        &mut offsets.as_view_mut(),
        &mut perm.as_view_mut(),
        &mut row_of.as_view_mut(),
    )
    .unwrap();
    DevDispatch {
        offsets,
        perm,
        row_of,
    }
}

fn bits_eq(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

/// One full case: dispatch, gather (f32, bf16), combine, combine backward, gather backward.
#[allow(clippy::too_many_arguments)]
fn check_case(
    g: &Gpu,
    ops: &Moe,
    n: usize,
    e: usize,
    k: usize,
    h: usize,
    active: usize,
    seed: u64,
) {
    let ctx = format!("N={n} E={e} k={k} H={h} active={active} seed={seed}");
    let routes = random_routes(n, k, active, seed);
    let cpu = Dispatch::new(&routes, e);
    let t = n * k;
    let dd = dispatch(g, ops, &routes.ids, n, e, k);
    let offsets = g.download(&dd.offsets).unwrap();
    let perm = g.download(&dd.perm).unwrap();
    let row_of = g.download(&dd.row_of).unwrap();
    let starts: Vec<usize> = offsets[..=e].iter().map(|&o| o as usize).collect();
    assert_eq!(starts, cpu.starts, "{ctx}: offsets");
    let entries: Vec<(u32, u32)> = perm[..t]
        .iter()
        .map(|&p| (p / k as u32, p % k as u32))
        .collect();
    assert_eq!(entries, cpu.entries, "{ctx}: permutation");
    for (p, &i) in perm[..t].iter().enumerate() {
        assert_eq!(row_of[i as usize] as usize, p, "{ctx}: row_of[{i}]");
    }

    // gather: packed rows == the reference's per-expert gathers, concatenated
    let x = values(n * h, seed + 1);
    let dx_in = g.upload(&x).unwrap();
    let mut want = Vec::with_capacity(t * h);
    for ex in 0..e {
        want.extend(gather(&x, h, cpu.rows(ex)));
    }
    let mut packed = g.zeros::<f32>(t * h).unwrap();
    let mut packed_b = g.zeros::<u16>(t * h).unwrap();
    ops.gather(
        &dx_in.as_view(),
        &dd.perm.as_view(),
        &dd.offsets.as_view(),
        &mut packed.as_view_mut(),
        n,
        h,
        e,
        k,
    )
    .unwrap();
    ops.gather_bf16(
        &dx_in.as_view(),
        &dd.perm.as_view(),
        &dd.offsets.as_view(),
        &mut packed_b.as_view_mut(),
        n,
        h,
        e,
        k,
    )
    .unwrap();
    let got = g.download(&packed).unwrap();
    assert_eq!(bits_eq(&got[..t * h], &want), None, "{ctx}: gather f32");
    let got_b = g.download(&packed_b).unwrap();
    for (i, (&b, &v)) in got_b[..t * h].iter().zip(&want).enumerate() {
        assert_eq!(
            f32::from_bits((b as u32) << 16).to_bits(),
            round_bf16(v).to_bits(),
            "{ctx}: gather bf16 [{i}]"
        );
    }

    // combine forward: y packed [N·k, H]
    let y = values(t * h, seed + 2);
    let mut want_out = vec![0.0f32; n * h];
    for ex in 0..e {
        let (a, b) = (cpu.starts[ex], cpu.starts[ex + 1]);
        combine_forward(&y[a * h..b * h], h, cpu.rows(ex), &routes, &mut want_out);
    }
    let dy_in = g.upload(&y).unwrap();
    let dw_in = g.upload(&routes.weights).unwrap();
    let mut out = g.zeros::<f32>(n * h).unwrap();
    ops.combine(
        &dy_in.as_view(),
        &dw_in.as_view(),
        &dd.row_of.as_view(),
        &mut out.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    assert_eq!(bits_eq(&got[..n * h], &want_out), None, "{ctx}: combine");

    // combine backward
    let dout = values(n * h, seed + 3);
    let mut want_dw = vec![0.0f32; t];
    let mut want_dy = Vec::with_capacity(t * h);
    for ex in 0..e {
        let (a, b) = (cpu.starts[ex], cpu.starts[ex + 1]);
        want_dy.extend(combine_backward(
            &dout,
            &y[a * h..b * h],
            h,
            cpu.rows(ex),
            &routes,
            &mut want_dw,
        ));
    }
    let ddout = g.upload(&dout).unwrap();
    let mut ddy = g.zeros::<f32>(t * h).unwrap();
    let mut ddw = g.zeros::<f32>(t).unwrap();
    let mut dw_runs = Vec::new();
    for _ in 0..2 {
        ops.combine_backward(
            &ddout.as_view(),
            &dy_in.as_view(),
            &dw_in.as_view(),
            &dd.row_of.as_view(),
            &mut ddy.as_view_mut(),
            &mut ddw.as_view_mut(),
            n,
            h,
            k,
        )
        .unwrap();
        dw_runs.push(g.download(&ddw).unwrap());
    }
    assert_eq!(
        bits_eq(&dw_runs[0], &dw_runs[1]),
        None,
        "{ctx}: dweights not deterministic"
    );
    let got = g.download(&ddy).unwrap();
    assert_eq!(
        bits_eq(&got[..t * h], &want_dy),
        None,
        "{ctx}: combine backward dy"
    );
    // The BF16 variant: dy's bits are the f32 dy's BF16 rounding, dweights the same bits.
    let mut dyb = g.zeros::<u16>(t * h).unwrap();
    let mut ddw_b = g.zeros::<f32>(t).unwrap();
    ops.combine_backward_bf16(
        &ddout.as_view(),
        &dy_in.as_view(),
        &dw_in.as_view(),
        &dd.row_of.as_view(),
        &mut dyb.as_view_mut(),
        &mut ddw_b.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let gotb = g.download(&dyb).unwrap();
    for (i, (&b16, &f)) in gotb[..t * h].iter().zip(&got[..t * h]).enumerate() {
        let (gb, wb) = (f32::from_bits((b16 as u32) << 16), round_bf16(f));
        assert!(
            gb.to_bits() == wb.to_bits() || (gb.is_nan() && wb.is_nan()),
            "{ctx}: combine backward bf16 dy[{i}] {gb:e} vs round_bf16 {wb:e}"
        );
    }
    assert_eq!(
        bits_eq(&g.download(&ddw_b).unwrap()[..t], &dw_runs[0][..t]),
        None,
        "{ctx}: combine backward bf16 dweights"
    );
    let got_dw = &dw_runs[0][..t];
    let v = mxrl_tensor::tolerance::violations(got_dw, &want_dw, |i| {
        let tok = i / k;
        let p = row_of[i] as usize;
        let abs: f64 = (0..h)
            .map(|c| (dout[tok * h + c] * y[p * h + c]).abs() as f64)
            .sum();
        two_order_sum_bound(h, abs)
    });
    assert!(v.is_empty(), "{ctx}: combine backward dweights: {v:#?}");

    // gather backward
    let dgr = values(t * h, seed + 4);
    let mut want_dx = vec![0.0f32; n * h];
    for ex in 0..e {
        let (a, b) = (cpu.starts[ex], cpu.starts[ex + 1]);
        gather_backward(&dgr[a * h..b * h], h, cpu.rows(ex), &mut want_dx);
    }
    let ddg = g.upload(&dgr).unwrap();
    let mut ddx = g.zeros::<f32>(n * h).unwrap();
    ops.gather_backward(
        &ddg.as_view(),
        &dd.row_of.as_view(),
        &mut ddx.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let got = g.download(&ddx).unwrap();
    assert_eq!(
        bits_eq(&got[..n * h], &want_dx),
        None,
        "{ctx}: gather backward"
    );
}

#[test]
fn moe_ops_match_reference_on_ragged_shapes() {
    let g = gpu();
    let ops = Moe::new(&g).unwrap();
    // (N, E, k, H, active experts)
    let cases = [
        (1usize, 8usize, 2usize, 64usize, 8usize),
        (1, 4, 4, 33, 4),
        (7, 16, 3, 5, 16),
        (33, 64, 8, 129, 12),
        (300, 8, 8, 17, 8),
        (128, 128, 8, 2048, 128),
        (129, 64, 8, 40, 64),
        (100, 512, 8, 12, 300),
        (1000, 64, 8, 96, 40),
        (513, 1024, 16, 3, 1024),
        (4096, 128, 8, 64, 128),
    ];
    for (i, &(n, e, k, h, active)) in cases.iter().enumerate() {
        check_case(&g, &ops, n, e, k, h, active, 10 + i as u64);
    }
}

#[test]
fn moe_ops_accept_zero_tokens() {
    let g = gpu();
    let ops = Moe::new(&g).unwrap();
    let dd = dispatch(&g, &ops, &[], 0, 8, 2);
    let offsets = g.download(&dd.offsets).unwrap();
    assert_eq!(&offsets[..9], &[0u32; 9]);
    let x = g.zeros::<f32>(1).unwrap();
    let mut out = g.zeros::<f32>(1).unwrap();
    ops.gather(
        &x.as_view(),
        &dd.perm.as_view(),
        &dd.offsets.as_view(),
        &mut out.as_view_mut(),
        0,
        16,
        8,
        2,
    )
    .unwrap();
    ops.combine(
        &x.as_view(),
        &x.as_view(),
        &dd.row_of.as_view(),
        &mut out.as_view_mut(),
        0,
        16,
        2,
    )
    .unwrap();
    g.sync().unwrap();
}

/// Ids `≥ E` (a caller error) are dropped without touching memory out of bounds: they get no
/// packed row and `row_of = u32::MAX`, contribute nothing to combine and get a zero dweight;
/// the valid entries keep the reference's order.
#[test]
fn out_of_range_ids_are_dropped() {
    let g = gpu();
    let ops = Moe::new(&g).unwrap();
    let (n, e, k, h) = (4usize, 3usize, 2usize, 8usize);
    let ids = vec![2u32, 0, 7, 1, 0, 2, 1, 99];
    let dd = dispatch(&g, &ops, &ids, n, e, k);
    let offsets = g.download(&dd.offsets).unwrap();
    let perm = g.download(&dd.perm).unwrap();
    let row_of = g.download(&dd.row_of).unwrap();
    assert_eq!(&offsets[..=e], &[0, 2, 4, 6]);
    assert_eq!(&perm[..6], &[1, 4, 3, 6, 0, 5]);
    assert_eq!(row_of[2], INVALID_ROW);
    assert_eq!(row_of[7], INVALID_ROW);
    let y = values(n * k * h, 5);
    let w = values(n * k, 6);
    let (dy, dw) = (g.upload(&y).unwrap(), g.upload(&w).unwrap());
    let mut out = g.zeros::<f32>(n * h).unwrap();
    ops.combine(
        &dy.as_view(),
        &dw.as_view(),
        &dd.row_of.as_view(),
        &mut out.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    // token 1: only slot 1 (expert 1, packed row 2) is valid
    for c in 0..h {
        let want = 0.0f32 + w[3] * y[2 * h + c];
        assert_eq!(got[h + c].to_bits(), want.to_bits(), "token 1 col {c}");
    }
}

#[test]
fn launchers_reject_bad_shapes_and_short_buffers() {
    let g = gpu();
    let ops = Moe::new(&g).unwrap();
    let ids = g.upload(&[0u32; 8]).unwrap();
    let mut s = g.zeros::<u32>(64).unwrap();
    let mut o = g.zeros::<u32>(2048).unwrap();
    let mut p = g.zeros::<u32>(8).unwrap();
    let mut r = g.zeros::<u32>(8).unwrap();
    let err = ops
        .dispatch(
            &ids.as_view(),
            4,
            2000,
            2,
            &mut s.as_view_mut(),
            &mut o.as_view_mut(),
            &mut p.as_view_mut(),
            &mut r.as_view_mut(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("2000 experts"), "{err}");
    let err = ops
        .dispatch(
            &ids.as_view(),
            5,
            4,
            2,
            &mut s.as_view_mut(),
            &mut o.as_view_mut(),
            &mut p.as_view_mut(),
            &mut r.as_view_mut(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("moe dispatch ids"), "{err}");
}

/// Views that start one element into their buffers are not 16-byte aligned: the row kernels
/// take their scalar path and must give the same bits as the float4 path.
#[test]
fn unaligned_views_give_the_same_bits() {
    let g = gpu();
    let ops = Moe::new(&g).unwrap();
    let (n, e, k, h) = (9usize, 8usize, 3usize, 64usize);
    let routes = random_routes(n, k, e, 77);
    let dd = dispatch(&g, &ops, &routes.ids, n, e, k);
    let y = values(n * k * h, 78);
    let dout = values(n * h, 79);
    let shifted = |v: &[f32]| {
        let mut s = vec![0.5f32];
        s.extend_from_slice(v);
        s
    };
    let (ya, ys) = (g.upload(&y).unwrap(), g.upload(&shifted(&y)).unwrap());
    let (da, ds) = (g.upload(&dout).unwrap(), g.upload(&shifted(&dout)).unwrap());
    let w = g.upload(&routes.weights).unwrap();
    let mut oa = g.zeros::<f32>(n * h).unwrap();
    let mut os = g.zeros::<f32>(n * h + 1).unwrap();
    ops.combine(
        &ya.as_view(),
        &w.as_view(),
        &dd.row_of.as_view(),
        &mut oa.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    ops.combine(
        &ys.slice(1..),
        &w.as_view(),
        &dd.row_of.as_view(),
        &mut os.slice_mut(1..),
        n,
        h,
        k,
    )
    .unwrap();
    let (a, b) = (g.download(&oa).unwrap(), g.download(&os).unwrap());
    assert_eq!(bits_eq(&a[..n * h], &b[1..]), None, "combine");
    ops.gather_backward(
        &ya.as_view(),
        &dd.row_of.as_view(),
        &mut oa.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    ops.gather_backward(
        &ys.slice(1..),
        &dd.row_of.as_view(),
        &mut os.slice_mut(1..),
        n,
        h,
        k,
    )
    .unwrap();
    let (a, b) = (g.download(&oa).unwrap(), g.download(&os).unwrap());
    assert_eq!(bits_eq(&a[..n * h], &b[1..]), None, "gather backward");
    let mut dya = g.zeros::<f32>(n * k * h).unwrap();
    let mut dys = g.zeros::<f32>(n * k * h + 1).unwrap();
    let mut dwa = g.zeros::<f32>(n * k).unwrap();
    let mut dws = g.zeros::<f32>(n * k).unwrap();
    ops.combine_backward(
        &da.as_view(),
        &ya.as_view(),
        &w.as_view(),
        &dd.row_of.as_view(),
        &mut dya.as_view_mut(),
        &mut dwa.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    ops.combine_backward(
        &ds.slice(1..),
        &ys.slice(1..),
        &w.as_view(),
        &dd.row_of.as_view(),
        &mut dys.slice_mut(1..),
        &mut dws.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let (a, b) = (g.download(&dya).unwrap(), g.download(&dys).unwrap());
    assert_eq!(
        bits_eq(&a[..n * k * h], &b[1..]),
        None,
        "combine backward dy"
    );
    // dweights: the same bound as against the reference (the partial-sum tree differs)
    let (a, b) = (g.download(&dwa).unwrap(), g.download(&dws).unwrap());
    let row_of = g.download(&dd.row_of).unwrap();
    let v = mxrl_tensor::tolerance::violations(&b[..n * k], &a[..n * k], |i| {
        let p = row_of[i] as usize;
        let abs: f64 = (0..h)
            .map(|c| (dout[(i / k) * h + c] * y[p * h + c]).abs() as f64)
            .sum();
        two_order_sum_bound(h, abs)
    });
    assert!(v.is_empty(), "combine backward dweights {v:#?}");
    let x = values(n * h, 80);
    let (xa, xs) = (g.upload(&x).unwrap(), g.upload(&shifted(&x)).unwrap());
    let mut pa = g.zeros::<u16>(n * k * h).unwrap();
    let mut ps = g.zeros::<u16>(n * k * h + 1).unwrap();
    ops.gather_bf16(
        &xa.as_view(),
        &dd.perm.as_view(),
        &dd.offsets.as_view(),
        &mut pa.as_view_mut(),
        n,
        h,
        e,
        k,
    )
    .unwrap();
    ops.gather_bf16(
        &xs.slice(1..),
        &dd.perm.as_view(),
        &dd.offsets.as_view(),
        &mut ps.slice_mut(1..),
        n,
        h,
        e,
        k,
    )
    .unwrap();
    let (a, b) = (g.download(&pa).unwrap(), g.download(&ps).unwrap());
    assert_eq!(&a[..n * k * h], &b[1..], "gather bf16");
}
