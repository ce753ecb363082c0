//! RMSNorm forward/backward on the GPU against `mxrl_tensor::norm::{rmsnorm_forward,
//! rmsnorm_backward}` within the bounds derived in `mxrl_tensor::tolerance` (the kernels sum
//! the rows and `dw` in another fixed order; every other operation is the reference's), plus
//! determinism (same bits twice) and the launchers' length checks.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::norm::{backward_scratch_len, Norm};
use mxrl_tensor::gradcheck::{gamma, test_values};
use mxrl_tensor::norm::{rmsnorm_backward, rmsnorm_forward};
use mxrl_tensor::tolerance::{
    rmsnorm_dx_bounds, rmsnorm_rstd_rel, rmsnorm_y_rel, two_order_sum_bound, violations,
};
use rand::{Rng, SeedableRng};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

/// Fixed edge shapes (empty, one row, width 1, odd widths, the model's 2048 and 128, more rows
/// than one dw chunk) plus random ones from a fixed seed.
fn shapes() -> Vec<(usize, usize)> {
    let mut s = vec![
        (0, 16),
        (1, 1),
        (1, 128),
        (3, 2048),
        (65, 128),
        (7, 33),
        (130, 2050),
        (257, 96),
    ];
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0x6e6f726d);
    for _ in 0..6 {
        s.push((r.gen_range(1..300), r.gen_range(1..700)));
    }
    s
}

struct Run {
    y: Vec<f32>,
    rstd: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_gpu(
    g: &Gpu,
    ops: &Norm,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rstd_in: &[f32],
    dw0: &[f32],
    rows: usize,
    d: usize,
    eps: f32,
) -> Run {
    let (dx_, dw_, ddy) = (
        g.upload(x).unwrap(),
        g.upload(w).unwrap(),
        g.upload(dy).unwrap(),
    );
    let mut y = g.zeros::<f32>(rows * d).unwrap();
    let mut rstd = g.zeros::<f32>(rows).unwrap();
    ops.forward(
        &dx_.as_view(),
        &dw_.as_view(),
        &mut y.as_view_mut(),
        &mut rstd.as_view_mut(),
        rows,
        d,
        eps,
    )
    .unwrap();
    // The backward takes the reference's rstd so that both evaluate the same formula.
    let drs = g.upload(rstd_in).unwrap();
    let mut dx = g.zeros::<f32>(rows * d).unwrap();
    let mut dw = g.upload(dw0).unwrap();
    let mut scratch = g.zeros::<f32>(backward_scratch_len(rows, d)).unwrap();
    ops.backward(
        &ddy.as_view(),
        &dx_.as_view(),
        &dw_.as_view(),
        &drs.as_view(),
        &mut dx.as_view_mut(),
        &mut dw.as_view_mut(),
        &mut scratch.as_view_mut(),
        rows,
        d,
    )
    .unwrap();
    let mut dwv = g.download(&dw).unwrap();
    dwv.truncate(d);
    let trunc = |mut v: Vec<f32>, n: usize| {
        v.truncate(n);
        v
    };
    Run {
        y: trunc(g.download(&y).unwrap(), rows * d),
        rstd: trunc(g.download(&rstd).unwrap(), rows),
        dx: trunc(g.download(&dx).unwrap(), rows * d),
        dw: dwv,
    }
}

#[test]
fn rmsnorm_forward_and_backward_match_reference_within_derived_bounds() {
    let g = gpu();
    let ops = Norm::new(&g).unwrap();
    let eps = 1e-6f32;
    for (case, (rows, d)) in shapes().into_iter().enumerate() {
        let seed = 1000 + case as u64 * 10;
        let ctx = format!(
            "case {case}: rows {rows}, d {d}, seeds {seed}..{}",
            seed + 3
        );
        let x = test_values(rows * d, seed, 3.0);
        let w = test_values(d, seed + 1, 1.5);
        let dy = test_values(rows * d, seed + 2, 1.0);
        let dw0 = test_values(d, seed + 3, 0.5);
        let (mut y, mut rstd) = (vec![0.0; rows * d], vec![0.0; rows]);
        rmsnorm_forward(&x, &w, rows, d, eps, &mut y, &mut rstd);
        let (mut dx, mut dw) = (vec![0.0; rows * d], dw0.clone());
        rmsnorm_backward(&dy, &x, &w, &rstd, rows, d, &mut dx, &mut dw);
        let got = run_gpu(&g, &ops, &x, &w, &dy, &rstd, &dw0, rows, d, eps);

        let rel = rmsnorm_rstd_rel(d);
        let f = violations(&got.rstd, &rstd, |i| {
            rel * rstd[i].abs() as f64 * (1.0 + rel)
        });
        assert!(f.is_empty(), "{ctx}: rstd {f:#?}");
        let rel = rmsnorm_y_rel(d);
        let f = violations(&got.y, &y, |i| rel * y[i].abs() as f64 * (1.0 + rel));
        assert!(f.is_empty(), "{ctx}: y {f:#?}");
        let bdx = rmsnorm_dx_bounds(&dy, &x, &w, &rstd, rows, d);
        let f = violations(&got.dx, &dx, |i| bdx[i]);
        assert!(f.is_empty(), "{ctx}: dx {f:#?}");
        let bdw: Vec<f64> = (0..d)
            .map(|j| {
                let s: f64 = (0..rows)
                    .map(|r| (dy[r * d + j] as f64 * x[r * d + j] as f64 * rstd[r] as f64).abs())
                    .sum();
                two_order_sum_bound(rows + 1, dw0[j].abs() as f64 + s * (1.0 + gamma(2)))
            })
            .collect();
        let f = violations(&got.dw, &dw, |i| bdw[i]);
        assert!(f.is_empty(), "{ctx}: dw {f:#?}");

        let again = run_gpu(&g, &ops, &x, &w, &dy, &rstd, &dw0, rows, d, eps);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&again.y), bits(&got.y), "{ctx}: y not deterministic");
        assert_eq!(
            bits(&again.dx),
            bits(&got.dx),
            "{ctx}: dx not deterministic"
        );
        assert_eq!(
            bits(&again.dw),
            bits(&got.dw),
            "{ctx}: dw not deterministic"
        );
    }
}

/// Up to `WARP_ROW_MAX_D` columns the forward and the backward's `dx` run one warp per row;
/// they give exactly the bits of one block per row (every width up to 256, rows around the
/// eight rows of a block, values of mixed signs and magnitudes), for all three forward outputs.
#[test]
fn rmsnorm_warp_rows_give_the_block_rows_bits() {
    use mxrl_cuda::ops::norm::WARP_ROW_MAX_D;
    let g = gpu();
    let ops = Norm::new(&g).unwrap();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0x77617270);
    let mut checked = 0;
    for d in (1..=WARP_ROW_MAX_D).filter(|d| d % 31 == 0 || d % 32 < 2 || *d < 6) {
        for rows in [1usize, 7, 8, 9, 23] {
            let x = test_values(rows * d, r.gen(), 3.0);
            let w: Vec<f32> = (0..d).map(|_| r.gen_range(-2.0..2.0)).collect();
            let dy = test_values(rows * d, r.gen(), 0.5);
            let rstd_in: Vec<f32> = (0..rows).map(|_| r.gen_range(0.1..3.0)).collect();
            let dw0 = vec![0.0f32; d];
            let mut both = Vec::new();
            for block in [false, true] {
                ops.set_block_rows(block);
                let run = run_gpu(&g, &ops, &x, &w, &dy, &rstd_in, &dw0, rows, d, 1e-6);
                let (dx_, dw_) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
                let mut yb = g.zeros::<u16>(rows * d).unwrap();
                let mut y2 = g.zeros::<f32>(rows * d).unwrap();
                let mut yb2 = g.zeros::<u16>(rows * d).unwrap();
                let mut rs = g.zeros::<f32>(rows).unwrap();
                ops.forward_bf16(
                    &dx_.as_view(),
                    &dw_.as_view(),
                    &mut yb.as_view_mut(),
                    &mut rs.as_view_mut(),
                    rows,
                    d,
                    1e-6,
                )
                .unwrap();
                ops.forward_both(
                    &dx_.as_view(),
                    &dw_.as_view(),
                    &mut y2.as_view_mut(),
                    &mut yb2.as_view_mut(),
                    &mut rs.as_view_mut(),
                    rows,
                    d,
                    1e-6,
                )
                .unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                both.push((
                    bits(&run.y),
                    bits(&run.rstd),
                    bits(&run.dx),
                    bits(&run.dw),
                    g.download(&yb).unwrap(),
                    bits(&g.download(&y2).unwrap()),
                    g.download(&yb2).unwrap(),
                ));
            }
            ops.set_block_rows(false);
            assert!(
                both[0] == both[1],
                "[{rows}, {d}]: warp rows and block rows differ"
            );
            checked += 1;
        }
    }
    assert!(checked > 40);
}

#[test]
fn rmsnorm_launchers_reject_short_buffers() {
    let g = gpu();
    let ops = Norm::new(&g).unwrap();
    let (rows, d) = (4, 8);
    let x = g.zeros::<f32>(rows * d).unwrap();
    let w = g.zeros::<f32>(d - 1).unwrap();
    let mut y = g.zeros::<f32>(rows * d).unwrap();
    let mut rstd = g.zeros::<f32>(rows).unwrap();
    let e = ops
        .forward(
            &x.as_view(),
            &w.as_view(),
            &mut y.as_view_mut(),
            &mut rstd.as_view_mut(),
            rows,
            d,
            1e-6,
        )
        .unwrap_err();
    assert!(e.to_string().contains("rmsnorm forward w"), "{e}");
    let w = g.zeros::<f32>(d).unwrap();
    let mut dx = g.zeros::<f32>(rows * d).unwrap();
    let mut dw = g.zeros::<f32>(d).unwrap();
    let mut scratch = g.zeros::<f32>(backward_scratch_len(rows, d) - 1).unwrap();
    let e = ops
        .backward(
            &x.as_view(),
            &x.as_view(),
            &w.as_view(),
            &rstd.as_view(),
            &mut dx.as_view_mut(),
            &mut dw.as_view_mut(),
            &mut scratch.as_view_mut(),
            rows,
            d,
        )
        .unwrap_err();
    assert!(e.to_string().contains("scratch"), "{e}");
}
