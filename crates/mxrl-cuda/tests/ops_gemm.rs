//! The GEMM family on the GPU against its CPU references (`mxrl_tensor::gemm::matmul_nt / nn /
//! tn` on the widened BF16 operands, per expert for the grouped kernels), within the derived
//! bounds of `mxrl_tensor::tolerance` (tensor cores: `tensor_core_sum_bound`; the small-M
//! kernel's IEEE f32 adds: `two_order_sum_bound`). Shapes are random from printed seeds and
//! include experts with 0 rows, 1 row, row counts off the 64-row tile, more than 32 experts (the
//! offset scan's second chunk), odd dense shapes and `k = 0`. Outputs are pre-filled with NaN so
//! an entry a kernel forgets to write fails the comparison.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::gemm::{
    Gemm, Grouped, GroupedPath, Tile, MAX_TN_PARTS, SMALL_M_ROWS_PER_EXPERT,
};
use mxrl_tensor::device::GradWrite;
use mxrl_tensor::gemm::{matmul_nn, matmul_nt, matmul_tn};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::tolerance::{
    gemm_nn_bounds_with, gemm_nt_bounds_with, gemm_tn_bounds_with, tensor_core_sum_bound,
    two_order_sum_bound, violations, SumBound,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "common/grouped.rs"]
mod grouped;
use grouped::{offsets_of, routed, Case};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

/// BF16 operand: the exact f32 values and their bit patterns.
struct Bf16 {
    f: Vec<f32>,
    bits: Vec<u16>,
}

fn bf16_values(n: usize, seed: u64) -> Bf16 {
    let f: Vec<f32> = mxrl_tensor::gradcheck::test_values(n, seed, 2.0)
        .into_iter()
        .map(round_bf16)
        .collect();
    let bits = f.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    Bf16 { f, bits }
}

fn assert_within(what: &str, seed: u64, got: &[f32], want: &[f32], bound: &[f64]) {
    let v = violations(got, want, |i| bound[i]);
    assert!(v.is_empty(), "{what} (seed {seed}): {v:?}");
}

/// The dense launchers' `(weight, width, output)` list for the weights `which` of `dws` (widths
/// `ns`, outputs `[m, ns[j]]` filled with NaN), handed to `launch`; the outputs downloaded.
#[allow(clippy::type_complexity)]
fn dense_outs(
    g: &Gpu,
    dws: &[CudaSlice<u16>],
    ns: &[usize],
    m: usize,
    which: &[usize],
    launch: impl FnOnce(&mut [(&CudaView<'_, u16>, usize, &mut CudaViewMut<'_, f32>)]),
) -> Vec<Vec<f32>> {
    let mut ys: Vec<_> = which
        .iter()
        .map(|&j| g.upload(&vec![f32::NAN; m * ns[j]]).unwrap())
        .collect();
    {
        let views: Vec<_> = which.iter().map(|&j| dws[j].as_view()).collect();
        let mut yv: Vec<_> = ys.iter_mut().map(|y| y.as_view_mut()).collect();
        let mut outs: Vec<_> = views
            .iter()
            .zip(yv.iter_mut())
            .zip(which)
            .map(|((w, y), &j)| (w, ns[j], y))
            .collect();
        launch(&mut outs);
    }
    ys.iter().map(|y| g.download(y).unwrap()).collect()
}

fn random_case(seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let e = [1usize, 3, 8, 33, 70][rng.gen_range(0..5)];
    let max_rows = if e > 8 { 24 } else { 150 };
    let counts = (0..e)
        .map(|_| {
            if rng.gen_bool(0.3) {
                0
            } else if rng.gen_bool(0.2) {
                1
            } else {
                rng.gen_range(1..=max_rows)
            }
        })
        .collect();
    Case {
        counts,
        n: 8 * rng.gen_range(1..=24),
        k: 8 * rng.gen_range(1..=40),
        extra: if rng.gen_bool(0.3) { 3 } else { 0 },
    }
}

/// Fixed cases: 0-row experts, 1 row, 63 / 64 / 65 / 130 rows around the 64-row tile, N and K
/// off the 64-column tile and the 32-deep stage; a single dense expert; decode-like routing
/// over 128 experts (1–3 rows each, mostly empty).
fn fixed_cases() -> Vec<Case> {
    let mut decode = vec![0usize; 128];
    for (i, c) in decode.iter_mut().enumerate() {
        *c = match i % 11 {
            0 => 1,
            4 => 3,
            7 => 2,
            _ => 0,
        };
    }
    vec![
        Case {
            counts: vec![0, 1, 63, 64, 65, 0, 130, 7],
            n: 72,
            k: 40,
            extra: 0,
        },
        Case {
            counts: vec![200],
            n: 136,
            k: 264,
            extra: 0,
        },
        Case {
            counts: vec![0, 0, 0, 5],
            n: 8,
            k: 8,
            extra: 2,
        },
        Case {
            counts: decode,
            n: 96,
            k: 256,
            extra: 0,
        },
    ]
}

fn all_cases() -> Vec<(u64, Case)> {
    let mut v: Vec<(u64, Case)> = fixed_cases()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (1000 + i as u64, c))
        .collect();
    v.extend((0..8).map(|s| (s, random_case(s))));
    v.push((2000, routed(512, 2000, 264, 520)));
    v
}

/// Per-expert reference of the forward plus its bound; rows of no expert stay NaN.
fn reference_nt(c: &Case, x: &Bf16, w: &Bf16, sum: SumBound) -> (Vec<f32>, Vec<f64>) {
    let (n, k) = (c.n, c.k);
    let mut y = vec![f32::NAN; c.rows() * n];
    let mut b = vec![0.0f64; c.rows() * n];
    let off = offsets_of(&c.counts);
    for (e, &rows) in c.counts.iter().enumerate() {
        let r0 = off[e] as usize;
        let xe = &x.f[r0 * k..(r0 + rows) * k];
        let we = &w.f[e * n * k..(e + 1) * n * k];
        y[r0 * n..(r0 + rows) * n].copy_from_slice(&matmul_nt(xe, we, rows, k, n));
        b[r0 * n..(r0 + rows) * n].copy_from_slice(&gemm_nt_bounds_with(xe, we, rows, k, n, sum));
    }
    (y, b)
}

/// The forward on `path` (`tile`: the tiled path's block tile, `None` = the launcher's pick).
fn run_nt(
    g: &Gpu,
    ops: &Gemm,
    c: &Case,
    x: &Bf16,
    w: &Bf16,
    path: GroupedPath,
    tile: Option<Tile>,
) -> Vec<f32> {
    let s = c.shape();
    let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
    let doff = g.upload(&offsets_of(&c.counts)).unwrap();
    let mut y = g.upload(&vec![f32::NAN; s.rows * s.n]).unwrap();
    let (xv, wv, ov) = (dx.as_view(), dw.as_view(), doff.as_view());
    let mut yv = y.as_view_mut();
    match path {
        GroupedPath::Tiled => match tile {
            Some(t) => ops.grouped_nt_tiled_with(t, &xv, &wv, &ov, &mut yv, s),
            None => ops.grouped_nt_tiled(&xv, &wv, &ov, &mut yv, s),
        },
        GroupedPath::SmallM => ops.grouped_nt_small_m(&xv, &wv, &ov, &mut yv, s),
    }
    .unwrap();
    let mut out = g.download(&y).unwrap();
    out.truncate(s.rows * s.n);
    out
}

/// NaN-filled entries (rows of no expert) must stay NaN; every other entry within the bound.
fn assert_grouped(what: &str, seed: u64, got: &[f32], want: &[f32], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what} (seed {seed}): length");
    let (mut g2, mut w2, mut b2) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..want.len() {
        if want[i].is_nan() {
            assert!(
                got[i].is_nan(),
                "{what} (seed {seed}): [{i}] belongs to no expert but was written ({})",
                got[i]
            );
        } else {
            g2.push(got[i]);
            w2.push(want[i]);
            b2.push(bound[i]);
        }
    }
    assert_within(what, seed, &g2, &w2, &b2);
}

#[test]
fn grouped_forward_tiled_and_small_m_match_reference() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    for (seed, c) in all_cases() {
        let s = c.shape();
        let x = bf16_values(s.rows * s.k, seed * 3 + 1);
        let w = bf16_values(s.experts * s.n * s.k, seed * 3 + 2);
        let (want, tc) = reference_nt(&c, &x, &w, tensor_core_sum_bound);
        let (_, ieee) = reference_nt(&c, &x, &w, two_order_sum_bound);
        for tile in ops.tiles() {
            let tiled = run_nt(&g, &ops, &c, &x, &w, GroupedPath::Tiled, Some(tile));
            assert_grouped(
                &format!("tiled {tile:?} nt {c:?}"),
                seed,
                &tiled,
                &want,
                &tc,
            );
        }
        let small = run_nt(&g, &ops, &c, &x, &w, GroupedPath::SmallM, None);
        assert_grouped(&format!("small-M nt {c:?}"), seed, &small, &want, &ieee);
        // Decode path against the tiled path directly: the tiled result is within 2·γ_{3k}·Σ
        // of the exact sum and the small-M one within γ_k·Σ, together `tensor_core_sum_bound`.
        let tiled = run_nt(&g, &ops, &c, &x, &w, GroupedPath::Tiled, Some(Tile::T64));
        assert_grouped(
            &format!("small-M vs tiled nt {c:?}"),
            seed,
            &small,
            &tiled,
            &tc,
        );
    }
}

#[test]
fn grouped_forward_picks_small_m_for_decode_row_counts_and_matches_it_bitwise() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    for (seed, c) in all_cases() {
        let s = c.shape();
        let want_path = if s.rows <= SMALL_M_ROWS_PER_EXPERT * s.experts {
            GroupedPath::SmallM
        } else {
            GroupedPath::Tiled
        };
        assert_eq!(GroupedPath::for_shape(s), want_path);
        let x = bf16_values(s.rows * s.k, seed + 7);
        let w = bf16_values(s.experts * s.n * s.k, seed + 8);
        let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
        let doff = g.upload(&offsets_of(&c.counts)).unwrap();
        let mut y = g.upload(&vec![f32::NAN; s.rows * s.n]).unwrap();
        let path = ops
            .grouped_nt(
                &dx.as_view(),
                &dw.as_view(),
                &doff.as_view(),
                &mut y.as_view_mut(),
                s,
            )
            .unwrap();
        assert_eq!(path, want_path, "seed {seed}");
        let mut auto = g.download(&y).unwrap();
        auto.truncate(s.rows * s.n);
        let explicit = run_nt(&g, &ops, &c, &x, &w, path, None);
        let same = auto
            .iter()
            .zip(&explicit)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "seed {seed}: grouped_nt differs from its own {path:?} path"
        );
    }
}

#[test]
fn grouped_dgrad_matches_reference() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    for (seed, c) in all_cases() {
        let s = c.shape();
        let (n, k) = (s.n, s.k);
        let dy = bf16_values(s.rows * n, seed * 5 + 1);
        let w = bf16_values(s.experts * n * k, seed * 5 + 2);
        let off = offsets_of(&c.counts);
        let mut want = vec![f32::NAN; s.rows * k];
        let mut bound = vec![0.0f64; s.rows * k];
        for (e, &rows) in c.counts.iter().enumerate() {
            let r0 = off[e] as usize;
            let dye = &dy.f[r0 * n..(r0 + rows) * n];
            let we = &w.f[e * n * k..(e + 1) * n * k];
            want[r0 * k..(r0 + rows) * k].copy_from_slice(&matmul_nn(dye, we, rows, n, k));
            bound[r0 * k..(r0 + rows) * k].copy_from_slice(&gemm_nn_bounds_with(
                dye,
                we,
                rows,
                n,
                k,
                tensor_core_sum_bound,
            ));
        }
        let (ddy, dw) = (g.upload(&dy.bits).unwrap(), g.upload(&w.bits).unwrap());
        let doff = g.upload(&off).unwrap();
        for tile in ops.tiles() {
            let mut dx = g.upload(&vec![f32::NAN; s.rows * k]).unwrap();
            ops.grouped_nn_with(
                tile,
                &ddy.as_view(),
                &dw.as_view(),
                &doff.as_view(),
                &mut dx.as_view_mut(),
                s,
            )
            .unwrap();
            let mut got = g.download(&dx).unwrap();
            got.truncate(s.rows * k);
            assert_grouped(
                &format!("grouped nn {tile:?} {c:?}"),
                seed,
                &got,
                &want,
                &bound,
            );
        }
    }
}

/// The grouped wgrad with `tile` on (dy, x, offsets) into a dW uploaded from `dw0`, read back.
fn run_tn(
    g: &Gpu,
    ops: &Gemm,
    tile: Tile,
    (dy, x, off): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u32>),
    dw0: &[f32],
    s: Grouped,
    write: GradWrite,
) -> Vec<f32> {
    let mut dw = g.upload(dw0).unwrap();
    ops.grouped_tn_with(
        tile,
        &dy.as_view(),
        &x.as_view(),
        &off.as_view(),
        &mut dw.as_view_mut(),
        s,
        write,
    )
    .unwrap();
    g.download(&dw).unwrap()
}

#[test]
fn grouped_wgrad_accumulates_per_expert_and_leaves_empty_experts_untouched() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    for (seed, c) in all_cases() {
        let s = c.shape();
        let (n, k) = (s.n, s.k);
        let dy = bf16_values(s.rows * n, seed * 7 + 1);
        let x = bf16_values(s.rows * k, seed * 7 + 2);
        let old = mxrl_tensor::gradcheck::test_values(s.experts * n * k, seed * 7 + 3, 5.0);
        let off = offsets_of(&c.counts);
        let (ddy, dx) = (g.upload(&dy.bits).unwrap(), g.upload(&x.bits).unwrap());
        let doff = g.upload(&off).unwrap();
        for tile in ops.tiles() {
            let got = run_tn(
                &g,
                &ops,
                tile,
                (&ddy, &dx, &doff),
                &old,
                s,
                GradWrite::Accumulate,
            );
            for (e, &rows) in c.counts.iter().enumerate() {
                let r0 = off[e] as usize;
                let span = e * n * k..(e + 1) * n * k;
                let (got_e, old_e) = (&got[span.clone()], &old[span]);
                if rows == 0 {
                    let same = got_e
                        .iter()
                        .zip(old_e)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "seed {seed} {tile:?}: expert {e} has no rows but dW changed"
                    );
                    continue;
                }
                let dye = &dy.f[r0 * n..(r0 + rows) * n];
                let xe = &x.f[r0 * k..(r0 + rows) * k];
                let sum = matmul_tn(dye, xe, n, rows, k);
                let want: Vec<f32> = old_e.iter().zip(&sum).map(|(a, b)| a + b).collect();
                let bound =
                    gemm_tn_bounds_with(dye, xe, Some(old_e), n, rows, k, tensor_core_sum_bound);
                assert_within(
                    &format!("grouped tn {tile:?} expert {e} of {c:?}"),
                    seed,
                    got_e,
                    &want,
                    &bound,
                );
            }
        }
    }
}

/// `GradWrite::Overwrite` over a buffer of NaNs gives, bit for bit, what accumulating into a
/// zeroed buffer gives (zeros for experts without rows), without reading the buffer.
#[test]
fn grouped_wgrad_overwrite_equals_accumulating_into_zeros() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let mut cases = all_cases();
    // No rows at all: the launcher writes the zeros itself.
    cases.push((
        99,
        Case {
            counts: vec![0; 5],
            n: 24,
            k: 40,
            extra: 0,
        },
    ));
    for (seed, c) in cases {
        let s = c.shape();
        let (n, k) = (s.n, s.k);
        let dy = bf16_values(s.rows * n, seed * 11 + 1);
        let x = bf16_values(s.rows * k, seed * 11 + 2);
        let off = offsets_of(&c.counts);
        let (ddy, dx) = (g.upload(&dy.bits).unwrap(), g.upload(&x.bits).unwrap());
        let doff = g.upload(&off).unwrap();
        let len = s.experts * n * k;
        let ops_in = (&ddy, &dx, &doff);
        for tile in ops.tiles() {
            let run = |init: f32, write: GradWrite| {
                run_tn(&g, &ops, tile, ops_in, &vec![init; len], s, write)
            };
            let want = run(0.0, GradWrite::Accumulate);
            let got = run(f32::NAN, GradWrite::Overwrite);
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "seed {seed} {tile:?} {c:?}: overwrite differs from accumulating into zeros at {bad:?}"
            );
        }
    }
}

/// The wgrad of an activation given as three stacked BF16 parts in one launch
/// (`grouped_tn_parts`: NVFP4's `dequantized` backward, `x̂ = p0 + p1 + p2`), on ragged experts
/// (0 rows, 1 row, odd counts, experts past one 64-row group and past the 128-row wgmma tile
/// average; N and K past one block tile; rows of no expert), on every tile:
/// - within the derived bound of the reference: per expert `old + matmul_tn` of `dy` stacked
///   three times by the stacked parts, `tensor_core_sum_bound` over `3·rows` products plus
///   the old value (`gemm_tn_bounds_with` on the stacked rows);
/// - the three-pass result (`grouped_tn` once per part, each pass adding into `dW`) is within
///   that same bound of the reference (a tensor-core sum of `rows` products per part and three
///   f32 additions stay inside it), so the two differ by at most twice it;
/// - deterministic (a second run, the same bits), the same bits on every tile (the sum's order
///   depends on the rows only), experts without rows untouched, and `GradWrite::Overwrite` over
///   NaNs the bits of accumulating into zeros.
///
/// Planted faults, each failing here under cuemu: part 2 reading part 0's rows (the loaders'
/// part offset reset for the third part), the `wgmma` tile reading another row group's kept
/// `dy` tile, and the 32-deep tiles not rewinding to the group's first rows for the next part.
#[test]
fn grouped_wgrad_of_three_parts_is_one_sum_within_the_bound_of_three_passes() {
    const P: usize = 3;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let cases = [
        (
            3001,
            Case {
                counts: vec![0, 1, 7, 37, 0, 65, 130, 301],
                n: 136,
                k: 264,
                extra: 3,
            },
        ),
        // One expert of 263 rows and an empty one: 131 rows per expert on average, the
        // shape the plain launcher gives the wgmma tile.
        (
            3002,
            Case {
                counts: vec![263, 0],
                n: 40,
                k: 264,
                extra: 0,
            },
        ),
    ];
    for (seed, c) in cases {
        let s = c.shape();
        let (n, k, rows) = (s.n, s.k, s.rows);
        let dy = bf16_values(rows * n, seed * 17 + 1);
        let x = bf16_values(P * rows * k, seed * 17 + 2);
        let old = mxrl_tensor::gradcheck::test_values(s.experts * n * k, seed * 17 + 3, 5.0);
        let off = offsets_of(&c.counts);
        let (ddy, dx) = (g.upload(&dy.bits).unwrap(), g.upload(&x.bits).unwrap());
        let doff = g.upload(&off).unwrap();
        let len = s.experts * n * k;
        // Per expert: the reference on the stacked rows and its bound.
        let mut want = Vec::with_capacity(len);
        let mut bound = Vec::with_capacity(len);
        for (e, &m) in c.counts.iter().enumerate() {
            let r0 = off[e] as usize;
            let old_e = &old[e * n * k..(e + 1) * n * k];
            if m == 0 {
                want.extend_from_slice(old_e);
                bound.extend(std::iter::repeat_n(0.0, n * k));
                continue;
            }
            let dys: Vec<f32> = (0..P)
                .flat_map(|_| dy.f[r0 * n..(r0 + m) * n].iter().copied())
                .collect();
            let xs: Vec<f32> = (0..P)
                .flat_map(|p| {
                    x.f[(p * rows + r0) * k..(p * rows + r0 + m) * k]
                        .iter()
                        .copied()
                })
                .collect();
            let sum = matmul_tn(&dys, &xs, n, P * m, k);
            want.extend(old_e.iter().zip(&sum).map(|(a, b)| a + b));
            bound.extend(gemm_tn_bounds_with(
                &dys,
                &xs,
                Some(old_e),
                n,
                P * m,
                k,
                tensor_core_sum_bound,
            ));
        }
        let one = |tile: Tile, init: &[f32], write: GradWrite| {
            let mut dw = g.upload(init).unwrap();
            ops.grouped_tn_parts_with(
                tile,
                &ddy.as_view(),
                &dx.as_view(),
                &doff.as_view(),
                &mut dw.as_view_mut(),
                s,
                P,
                write,
            )
            .unwrap();
            g.download(&dw).unwrap()
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut first: Option<Vec<u32>> = None;
        for tile in ops.tiles() {
            let what = format!("seed {seed} {tile:?} {c:?}");
            let got = one(tile, &old, GradWrite::Accumulate);
            assert_eq!(
                bits(&got),
                bits(&one(tile, &old, GradWrite::Accumulate)),
                "{what}: two runs differ"
            );
            assert_within(
                &format!("3-part grouped tn {what}"),
                seed,
                &got,
                &want,
                &bound,
            );
            // The three passes: within the same bound of the reference, so within twice it of
            // the one launch.
            let mut dw = g.upload(&old).unwrap();
            for p in 0..P {
                ops.grouped_tn_with(
                    tile,
                    &ddy.as_view(),
                    &dx.slice(p * rows * k..(p + 1) * rows * k),
                    &doff.as_view(),
                    &mut dw.as_view_mut(),
                    s,
                    GradWrite::Accumulate,
                )
                .unwrap();
            }
            let three = g.download(&dw).unwrap();
            assert_within(&format!("3 passes {what}"), seed, &three, &want, &bound);
            let twice: Vec<f64> = bound.iter().map(|b| 2.0 * b).collect();
            assert_within(&format!("1 vs 3 passes {what}"), seed, &got, &three, &twice);
            // Experts without rows keep their old dW, bit for bit.
            for (e, &m) in c.counts.iter().enumerate() {
                let span = e * n * k..(e + 1) * n * k;
                if m == 0 {
                    assert_eq!(
                        bits(&got[span.clone()]),
                        bits(&old[span]),
                        "{what}: expert {e}"
                    );
                }
            }
            // Overwriting NaNs: the bits of accumulating into zeros.
            assert_eq!(
                bits(&one(tile, &vec![f32::NAN; len], GradWrite::Overwrite)),
                bits(&one(tile, &vec![0.0; len], GradWrite::Accumulate)),
                "{what}: overwrite differs from accumulating into zeros"
            );
            // Every tile: the same bits.
            match &first {
                None => first = Some(bits(&got)),
                Some(f) => assert!(*f == bits(&got), "{what}: differs from the first tile"),
            }
        }
    }
    // Parts out of range are refused by name.
    let x = g.zeros::<u16>(64 * 64).unwrap();
    let off = g.upload(&[0u32, 10, 20]).unwrap();
    let mut y = g.zeros::<f32>(2 * 8 * 64).unwrap();
    let s = Grouped {
        experts: 2,
        rows: 20,
        n: 8,
        k: 64,
    };
    for parts in [0, MAX_TN_PARTS + 1] {
        let e = ops
            .grouped_tn_parts(
                &x.as_view(),
                &x.as_view(),
                &off.as_view(),
                &mut y.as_view_mut(),
                s,
                parts,
                GradWrite::Accumulate,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("parts"), "{e}");
    }
    // An x of fewer than parts × R × K elements is refused.
    let e = ops
        .grouped_tn_parts(
            &x.as_view(),
            &x.slice(0..3 * 20 * 64 - 8),
            &off.as_view(),
            &mut y.as_view_mut(),
            s,
            3,
            GradWrite::Accumulate,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("weight/operand"), "{e}");
}

/// A grouped op of [`grouped_bits`].
#[derive(Debug, Clone, Copy)]
enum GroupedOp {
    /// The tiled forward.
    Forward,
    /// The small-M forward (the tile is not used).
    SmallM,
    Dgrad,
    Wgrad,
}

impl GroupedOp {
    const ALL: [GroupedOp; 4] = [
        GroupedOp::Forward,
        GroupedOp::SmallM,
        GroupedOp::Dgrad,
        GroupedOp::Wgrad,
    ];
}

/// The output bits of `op` on `tile` over the activation `a` (also the wgrad's `dy` and `x`),
/// the stacked weight `w` and the offsets, into a buffer filled with `init` (the wgrad with
/// `write`).
fn grouped_bits(
    g: &Gpu,
    ops: &Gemm,
    op: GroupedOp,
    tile: Tile,
    (a, w, off): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u32>),
    s: Grouped,
    (init, write): (f32, GradWrite),
) -> Vec<u32> {
    let len = match op {
        GroupedOp::Forward | GroupedOp::SmallM => s.rows * s.n,
        GroupedOp::Dgrad => s.rows * s.k,
        GroupedOp::Wgrad => s.experts * s.n * s.k,
    };
    let mut out = g.upload(&vec![init; len]).unwrap();
    let (av, wv, ov) = (a.as_view(), w.as_view(), off.as_view());
    let mut yv = out.as_view_mut();
    match op {
        GroupedOp::Forward => ops.grouped_nt_tiled_with(tile, &av, &wv, &ov, &mut yv, s),
        GroupedOp::SmallM => ops.grouped_nt_small_m(&av, &wv, &ov, &mut yv, s),
        GroupedOp::Dgrad => ops.grouped_nn_with(tile, &av, &wv, &ov, &mut yv, s),
        GroupedOp::Wgrad => ops.grouped_tn_with(tile, &av, &av, &ov, &mut yv, s, write),
    }
    .unwrap();
    g.download(&out)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Every tile sums each output in the same k16 groups in increasing order (mma.sync
/// m16n8k16 or wgmma m64n256k16, one k16 step per instruction), so all tiles give the same
/// bits: forward, dgrad and a fresh wgrad. This is what lets the device pick a tile by shape
/// (the `wgmma` tile on sm_90) without changing any result.
#[test]
fn grouped_tiles_give_the_same_bits() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let tiles = ops.tiles();
    assert_eq!(
        tiles.contains(&Tile::W128x256),
        g.has_wgmma(),
        "the wgmma tile is offered exactly on sm_90 devices"
    );
    for (seed, c) in all_cases() {
        let s = c.shape();
        let (n, k) = (s.n, s.k);
        let a = bf16_values(s.rows * k.max(n), seed * 13 + 1);
        let w = bf16_values(s.experts * n * k, seed * 13 + 2);
        let (da, dw) = (g.upload(&a.bits).unwrap(), g.upload(&w.bits).unwrap());
        let doff = g.upload(&offsets_of(&c.counts)).unwrap();
        let run = |op: GroupedOp, tile: Tile| {
            let nan = (f32::NAN, GradWrite::Overwrite);
            grouped_bits(&g, &ops, op, tile, (&da, &dw, &doff), s, nan)
        };
        for op in [GroupedOp::Forward, GroupedOp::Dgrad, GroupedOp::Wgrad] {
            let base = run(op, Tile::T128);
            for &tile in &tiles {
                let got = run(op, tile);
                let bad = got.iter().zip(&base).position(|(x, y)| x != y);
                assert!(
                    bad.is_none(),
                    "seed {seed} {op:?} {c:?}: {tile:?} differs from T128 at {bad:?}"
                );
            }
        }
    }
}

/// The shapes of the store-factor tests (seeds from `seed0`): ragged experts with an empty one
/// and rows of no expert, one large expert, and experts below the `wgmma` tile's 128 rows
/// (declined everywhere). `dgrad`: the output columns (`k`) are the wide side.
fn store_factor_cases(seed0: u64, dgrad: bool) -> [(u64, Case); 3] {
    let case = |counts: Vec<usize>, wide: usize, narrow: usize, extra: usize| {
        let (n, k) = if dgrad {
            (narrow, wide)
        } else {
            (wide, narrow)
        };
        Case {
            counts,
            n,
            k,
            extra,
        }
    };
    [
        (seed0, case(vec![300, 0, 260, 129], 264, 136, 5)),
        (seed0 + 1, case(vec![1000], 520, 64, 0)),
        (seed0 + 2, case(vec![100, 90], 64, 64, 0)),
    ]
}

/// NVFP4's per-row factor applied in the `wgmma` forward's stores gives the bits of the plain
/// forward followed by `nvfp4_scale_rows`; rows of no expert stay untouched. On devices
/// without `wgmma` (or shapes below its tile) the launcher declines and launches nothing.
#[test]
fn grouped_nt_alpha_equals_grouped_nt_then_nvfp4_scale_rows_bitwise() {
    use mxrl_cuda::ops::qgemm::QGemm;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let q = QGemm::new(&g).unwrap();
    for (seed, c) in store_factor_cases(3000, false) {
        let s = c.shape();
        let x = bf16_values(s.rows * s.k, seed * 3 + 1);
        let w = bf16_values(s.experts * s.n * s.k, seed * 3 + 2);
        let xa: Vec<f32> = mxrl_tensor::gradcheck::test_values(s.rows, seed * 3 + 3, 4.0)
            .iter()
            .map(|v| v.abs() + 0.01)
            .collect();
        let wa: Vec<f32> = mxrl_tensor::gradcheck::test_values(s.experts, seed * 3 + 4, 4.0)
            .iter()
            .map(|v| v.abs() + 0.01)
            .collect();
        let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
        let (dxa, dwa) = (g.upload(&xa).unwrap(), g.upload(&wa).unwrap());
        let doff = g.upload(&offsets_of(&c.counts)).unwrap();
        let mut two = g.upload(&vec![f32::NAN; s.rows * s.n]).unwrap();
        ops.grouped_nt(
            &dx.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut two.as_view_mut(),
            s,
        )
        .unwrap();
        q.nvfp4_scale_rows(
            &mut two.as_view_mut(),
            &dxa.as_view(),
            &dwa.as_view(),
            &doff.as_view(),
            s,
        )
        .unwrap();
        let mut one = g.upload(&vec![f32::NAN; s.rows * s.n]).unwrap();
        let took = ops
            .grouped_nt_alpha(
                &dx.as_view(),
                &dw.as_view(),
                &doff.as_view(),
                &mut one.as_view_mut(),
                s,
                &dxa.as_view(),
                &dwa.as_view(),
            )
            .unwrap();
        let wide = c.counts.iter().sum::<usize>() >= 128 * s.experts;
        assert_eq!(took, g.has_wgmma() && wide, "seed {seed}: launched");
        let bits = |y: &CudaSlice<f32>| -> Vec<u32> {
            g.download(y).unwrap()[..s.rows * s.n]
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        if took {
            let (a, b) = (bits(&one), bits(&two));
            let bad = a.iter().zip(&b).position(|(p, q)| p != q);
            assert!(bad.is_none(), "seed {seed} {c:?}: differs at {bad:?}");
        } else {
            assert!(
                bits(&one).iter().all(|&v| f32::from_bits(v).is_nan()),
                "seed {seed}: a declined call wrote y"
            );
        }
    }
}

/// NVFP4's per-tensor weight factor applied in the `wgmma` dgrad's stores gives the bits of
/// the plain dgrad followed by `nvfp4_weight_factor_rows`, and those are `fl(dx · fl(w_amax[e]
/// · R2688))` of the plain dgrad's values on the rows of expert `e` (rows of no expert stay
/// untouched). On devices without `wgmma` (or shapes below its tile) the launcher declines and
/// launches nothing.
#[test]
fn grouped_nn_wfactor_equals_grouped_nn_then_nvfp4_weight_factor_rows_bitwise() {
    use mxrl_cuda::ops::qgemm::QGemm;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let q = QGemm::new(&g).unwrap();
    for (seed, c) in store_factor_cases(3100, true) {
        let s = c.shape();
        let dy = bf16_values(s.rows * s.n, seed * 3 + 1);
        let w = bf16_values(s.experts * s.n * s.k, seed * 3 + 2);
        // Amax values over several binades, one of them zero (a zero weight).
        let mut wa: Vec<f32> = mxrl_tensor::gradcheck::test_values(s.experts, seed * 3 + 4, 4.0)
            .iter()
            .map(|v| v.abs() * 1000.0 + 0.01)
            .collect();
        if s.experts > 1 {
            wa[s.experts - 1] = 0.0;
        }
        let (ddy, dw) = (g.upload(&dy.bits).unwrap(), g.upload(&w.bits).unwrap());
        let dwa = g.upload(&wa).unwrap();
        let offsets = offsets_of(&c.counts);
        let doff = g.upload(&offsets).unwrap();
        let bits = |y: &CudaSlice<f32>| -> Vec<u32> {
            g.download(y).unwrap()[..s.rows * s.k]
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let mut two = g.upload(&vec![f32::NAN; s.rows * s.k]).unwrap();
        ops.grouped_nn(
            &ddy.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut two.as_view_mut(),
            s,
        )
        .unwrap();
        let plain = bits(&two);
        q.nvfp4_weight_factor_rows(&mut two.as_view_mut(), &dwa.as_view(), &doff.as_view(), {
            let mut t = s;
            (t.n, t.k) = (s.k, s.n);
            t
        })
        .unwrap();
        let scaled = bits(&two);
        for (e, r) in offsets.windows(2).enumerate() {
            let gf = wa[e] * mxrl_formats::R2688;
            for i in r[0] as usize * s.k..r[1] as usize * s.k {
                let want = (f32::from_bits(plain[i]) * gf).to_bits();
                assert_eq!(scaled[i], want, "seed {seed}: expert {e} element {i}");
            }
        }
        let owned = offsets[0] as usize * s.k..offsets[s.experts] as usize * s.k;
        for i in (0..s.rows * s.k).filter(|i| !owned.contains(i)) {
            assert!(
                f32::from_bits(scaled[i]).is_nan(),
                "seed {seed}: row of no expert written at {i}"
            );
        }
        let mut one = g.upload(&vec![f32::NAN; s.rows * s.k]).unwrap();
        let took = ops
            .grouped_nn_wfactor(
                &ddy.as_view(),
                &dw.as_view(),
                &doff.as_view(),
                &mut one.as_view_mut(),
                s,
                &dwa.as_view(),
            )
            .unwrap();
        let wide = c.counts.iter().sum::<usize>() >= 128 * s.experts;
        assert_eq!(took, g.has_wgmma() && wide, "seed {seed}: launched");
        if took {
            let a = bits(&one);
            let bad = a.iter().zip(&scaled).position(|(p, q)| p != q);
            assert!(bad.is_none(), "seed {seed} {c:?}: differs at {bad:?}");
        } else {
            assert!(
                bits(&one).iter().all(|&v| f32::from_bits(v).is_nan()),
                "seed {seed}: a declined call wrote dx"
            );
        }
    }
}

#[test]
fn grouped_kernels_are_deterministic() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let c = random_case(3);
    let s = c.shape();
    let a = bf16_values(s.rows * s.k.max(s.n), 11);
    let w = bf16_values(s.experts * s.n * s.k, 12);
    let (da, dw) = (g.upload(&a.bits).unwrap(), g.upload(&w.bits).unwrap());
    let doff = g.upload(&offsets_of(&c.counts)).unwrap();
    let run = |op: GroupedOp, tile: Tile| {
        let zeros = (0.0, GradWrite::Accumulate);
        grouped_bits(&g, &ops, op, tile, (&da, &dw, &doff), s, zeros)
    };
    for tile in ops.tiles() {
        for op in GroupedOp::ALL {
            assert_eq!(
                run(op, tile),
                run(op, tile),
                "{op:?} ({tile:?}): two runs differ"
            );
        }
    }
}

#[test]
fn grouped_launchers_reject_bad_shapes_with_clear_errors() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let x = g.zeros::<u16>(64 * 64).unwrap();
    let w = g.zeros::<u16>(2 * 64 * 64).unwrap();
    let off = g.upload(&[0u32, 10, 20]).unwrap();
    let mut y = g.zeros::<f32>(64 * 64).unwrap();
    let ok = Grouped {
        experts: 2,
        rows: 20,
        n: 64,
        k: 64,
    };
    let err = |r: Result<(), mxrl_cuda::DeviceError>| r.unwrap_err().to_string();
    // K not a multiple of 8.
    let e = err(ops.grouped_nt_tiled(
        &x.as_view(),
        &w.as_view(),
        &off.as_view(),
        &mut y.as_view_mut(),
        Grouped { k: 60, ..ok },
    ));
    assert!(e.contains("multiples of 8"), "{e}");
    // Weights too short for 3 experts (and offsets too short).
    let e = err(ops.grouped_nn(
        &x.as_view(),
        &w.as_view(),
        &off.as_view(),
        &mut y.as_view_mut(),
        Grouped { experts: 3, ..ok },
    ));
    assert!(e.contains("weight") && e.contains("needed"), "{e}");
    // An activation view starting one element in: not 16-byte aligned.
    let e = err(ops.grouped_nt_small_m(
        &x.slice(1..),
        &w.as_view(),
        &off.as_view(),
        &mut y.as_view_mut(),
        ok,
    ));
    assert!(e.contains("aligned"), "{e}");
    // The valid shape runs.
    ops.grouped_tn(
        &x.as_view(),
        &x.as_view(),
        &off.as_view(),
        &mut y.slice_mut(0..2048),
        Grouped { n: 8, k: 128, ..ok },
        GradWrite::Accumulate,
    )
    .unwrap();
}

#[test]
fn dense_cublas_gemms_match_reference_on_odd_shapes() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let shapes = [
        (1, 1, 1),
        (1, 8, 16),
        (3, 5, 7),
        (17, 33, 65),
        (64, 64, 64),
        (130, 72, 300),
        (0, 4, 4),
        (5, 0, 3),
        (4, 6, 0),
    ];
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        let seed = 500 + i as u64;
        let x = bf16_values(m * k, seed * 4 + 1); // [m, k]
        let w = bf16_values(n * k, seed * 4 + 2); // [n, k]
        let dy = bf16_values(m * n, seed * 4 + 3); // [m, n]
        let old = mxrl_tensor::gradcheck::test_values(n * k, seed * 4 + 4, 3.0);
        let (dx_, dw_, ddy) = (
            g.upload(&x.bits).unwrap(),
            g.upload(&w.bits).unwrap(),
            g.upload(&dy.bits).unwrap(),
        );
        // Forward.
        let mut y = g.upload(&vec![f32::NAN; m * n]).unwrap();
        ops.dense_nt(
            &dx_.as_view(),
            &dw_.as_view(),
            &mut y.as_view_mut(),
            m,
            n,
            k,
        )
        .unwrap();
        let mut got = g.download(&y).unwrap();
        got.truncate(m * n);
        let want = matmul_nt(&x.f, &w.f, m, k, n);
        let b = gemm_nt_bounds_with(&x.f, &w.f, m, k, n, tensor_core_sum_bound);
        assert_within(&format!("dense nt {m}x{n}x{k}"), seed, &got, &want, &b);
        // Same call, same bits.
        ops.dense_nt(
            &dx_.as_view(),
            &dw_.as_view(),
            &mut y.as_view_mut(),
            m,
            n,
            k,
        )
        .unwrap();
        let again = g.download(&y).unwrap();
        assert!(
            got.iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "dense nt {m}x{n}x{k}: two runs differ"
        );
        // Dgrad.
        let mut dx = g.upload(&vec![f32::NAN; m * k]).unwrap();
        ops.dense_nn(
            &ddy.as_view(),
            &dw_.as_view(),
            &mut dx.as_view_mut(),
            m,
            n,
            k,
        )
        .unwrap();
        let mut got = g.download(&dx).unwrap();
        got.truncate(m * k);
        let want = matmul_nn(&dy.f, &w.f, m, n, k);
        let b = gemm_nn_bounds_with(&dy.f, &w.f, m, n, k, tensor_core_sum_bound);
        assert_within(&format!("dense nn {m}x{n}x{k}"), seed, &got, &want, &b);
        // Wgrad, accumulated into the old dW.
        let mut dwg = g.upload(&old).unwrap();
        ops.dense_tn(
            &ddy.as_view(),
            &dx_.as_view(),
            &mut dwg.as_view_mut(),
            m,
            n,
            k,
        )
        .unwrap();
        let mut got = g.download(&dwg).unwrap();
        got.truncate(n * k);
        let sum = matmul_tn(&dy.f, &x.f, n, m, k);
        let want: Vec<f32> = old.iter().zip(&sum).map(|(a, b)| a + b).collect();
        let b = gemm_tn_bounds_with(&dy.f, &x.f, Some(&old), n, m, k, tensor_core_sum_bound);
        assert_within(&format!("dense tn {m}x{n}x{k}"), seed, &got, &want, &b);
    }
}

/// BF16 experts through the fragment kernels (`QGemm::grouped_nt_frag_bf16`, the engine's
/// decode path for 1–64 rows per expert): every pass size and every split of the reduction
/// (1, 2, 4, 8 warps) against the per-expert reference within `tensor_core_sum_bound`, rows
/// of no expert left untouched, a second run the same bits; pass sizes give the launcher's
/// bits for its split (they change which rows share a weight fragment, not any sum); shapes
/// off the 32-column blocks refused by name. Cases: experts of 0, 1, 3, 16, 17, 33, 64, 70,
/// 130 and 300 rows (several blocks sharing a busy expert's passes), K = 32, batch-1 (K 2048) and batch-32 (K 768) routing of the benchmark model, random ones.
#[test]
fn bf16_fragment_kernels_match_reference() {
    use mxrl_cuda::ops::qgemm::{frag_layout, FragLayout, FragRows, QGemm};
    let g = gpu();
    let q = QGemm::new(&g).unwrap();
    let mut cases = vec![
        (
            71u64,
            Case {
                counts: vec![0, 1, 3, 16, 17, 0, 33, 2],
                n: 96,
                k: 192,
                extra: 3,
            },
        ),
        (
            72,
            Case {
                counts: vec![2, 0, 5],
                n: 32,
                k: 32,
                extra: 1,
            },
        ),
        (73, routed(1, 73, 64, 2048)),
        (74, routed(32, 74, 128, 768)),
        // 64 rows per pass and more, ragged last passes.
        (
            79,
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
            80,
            Case {
                counts: vec![300, 2, 0, 5],
                n: 64,
                k: 256,
                extra: 1,
            },
        ),
    ];
    for seed in 75..79u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
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
    let run = |c: &Case, x: &Bf16, w: &Bf16, plan: Option<(FragRows, FragLayout)>| {
        let s = c.shape();
        let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
        let doff = g.upload(&offsets_of(&c.counts)).unwrap();
        let mut y = g.upload(&vec![f32::NAN; s.rows * s.n]).unwrap();
        let (xv, wv, ov) = (dx.as_view(), dw.as_view(), doff.as_view());
        let mut yv = y.as_view_mut();
        match plan {
            Some((rows, layout)) => {
                q.grouped_nt_frag_bf16_with(rows, layout, &xv, &wv, &ov, &mut yv, s)
            }
            None => q.grouped_nt_frag_bf16(&xv, &wv, &ov, &mut yv, s),
        }
        .unwrap();
        let mut out = g.download(&y).unwrap();
        out.truncate(s.rows * s.n);
        out
    };
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for (seed, c) in &cases {
        let s = c.shape();
        assert!(QGemm::frag_fits(s.n, s.k));
        let x = bf16_values(s.rows * s.k, seed * 3 + 1);
        let w = bf16_values(s.experts * s.n * s.k, seed * 3 + 2);
        let (want, tc) = reference_nt(c, &x, &w, tensor_core_sum_bound);
        let auto = run(c, &x, &w, None);
        assert_grouped(&format!("fragment auto {c:?}"), *seed, &auto, &want, &tc);
        assert!(
            same(&auto, &run(c, &x, &w, None)),
            "seed {seed}: a second run differs"
        );
        let pick = FragRows::for_rows(s.rows, s.experts, FragRows::largest(None));
        let layout = frag_layout(s, None, pick);
        for rows in FragRows::ALL {
            let got = run(c, &x, &w, Some((rows, layout)));
            assert!(
                same(&got, &auto),
                "seed {seed}: {rows:?} differs from the launcher's pick"
            );
            // The staged layout: the bits of one warp per column block.
            let one = run(c, &x, &w, Some((rows, FragLayout::Split(1))));
            let staged = run(c, &x, &w, Some((rows, FragLayout::Staged)));
            assert!(
                same(&staged, &one),
                "seed {seed}: staged {rows:?} differs from one warp per column block"
            );
        }
        for split in [1usize, 2, 4, 8] {
            let got = run(c, &x, &w, Some((pick, FragLayout::Split(split))));
            let what = format!("fragment split {split} {c:?}");
            assert_grouped(&what, *seed, &got, &want, &tc);
            assert!(
                same(
                    &got,
                    &run(c, &x, &w, Some((pick, FragLayout::Split(split))))
                ),
                "{what}: not deterministic"
            );
        }
    }
    // Off the 32-column blocks, or a split that is no power of two up to 8: refused by name.
    let c = Case {
        counts: vec![2],
        n: 48,
        k: 64,
        extra: 0,
    };
    let s = c.shape();
    let (x, w) = (bf16_values(2 * 64, 1), bf16_values(48 * 64, 2));
    let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
    let doff = g.upload(&offsets_of(&c.counts)).unwrap();
    let mut y = g.upload(&vec![0f32; 2 * 48]).unwrap();
    let err = q
        .grouped_nt_frag_bf16(
            &dx.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut y.as_view_mut(),
            s,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("grouped_nt_frag_bf16") && err.contains("multiple of 32"),
        "{err}"
    );
    let s32 = Grouped { n: 32, ..s };
    let err = q
        .grouped_nt_frag_bf16_with(
            FragRows::R8,
            FragLayout::Split(3),
            &dx.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut y.as_view_mut(),
            s32,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("split 3"), "{err}");
}

/// The fragment kernels' dense launch (`QGemm::dense_nt_frag_bf16_multi`, decode's q/k/v and
/// o projections at 3–128 rows): up to three weights of different widths in one launch, each
/// output within `tensor_core_sum_bound` of the reference and bit for bit the one-expert
/// `grouped_nt_frag_bf16_with` of its weight alone at the same rows per pass and split (the
/// launcher's plan and every other split); rows past one pass (several row blocks, a ragged
/// last pass); a second run the same bits; four weights, widths off the 32-column blocks and a
/// split of 3 refused by name.
#[test]
fn dense_fragment_launch_matches_reference_and_single_weights_bitwise() {
    use mxrl_cuda::ops::qgemm::{dense_frag_plan, FragLayout, FragRows, QGemm};
    let g = gpu();
    let q = QGemm::new(&g).unwrap();
    let whole = g.upload(&[0u32, u32::MAX]).unwrap();
    // (m, k, [n_i])
    let cases: [(usize, usize, &[usize]); 6] = [
        (3, 2048, &[256, 64, 64]),
        (8, 256, &[64, 32, 96]),
        (32, 512, &[128]),
        (37, 96, &[32, 64]),
        (128, 64, &[32, 32, 32]),
        (200, 128, &[64, 32]),
    ];
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for (ci, &(m, k, ns)) in cases.iter().enumerate() {
        let seed = 300 + ci as u64;
        let x = bf16_values(m * k, seed * 7 + 1);
        let ws: Vec<Bf16> = ns
            .iter()
            .enumerate()
            .map(|(i, &n)| bf16_values(n * k, seed * 7 + 2 + i as u64))
            .collect();
        let dx = g.upload(&x.bits).unwrap();
        let dws: Vec<_> = ws.iter().map(|w| g.upload(&w.bits).unwrap()).collect();
        // The multi launch of weights `which` at (rows per pass, split), or the plan's.
        let multi = |which: &[usize], plan: Option<(FragRows, usize)>| -> Vec<Vec<f32>> {
            dense_outs(&g, &dws, ns, m, which, |outs| {
                let (xv, ov) = (dx.as_view(), whole.as_view());
                match plan {
                    Some((fr, split)) => {
                        q.dense_nt_frag_bf16_multi_with(fr, split, &xv, &ov, outs, m, k)
                    }
                    None => q.dense_nt_frag_bf16_multi(&xv, &ov, outs, m, k),
                }
                .unwrap()
            })
        };
        // Weight i alone as a one-expert grouped launch (splits up to 8).
        let single = |i: usize, fr: FragRows, split: usize| -> Vec<f32> {
            let n = ns[i];
            let s = Grouped {
                experts: 1,
                rows: m,
                n,
                k,
            };
            let off = g.upload(&[0u32, m as u32]).unwrap();
            let mut y = g.upload(&vec![f32::NAN; m * n]).unwrap();
            q.grouped_nt_frag_bf16_with(
                fr,
                FragLayout::Split(split),
                &dx.as_view(),
                &dws[i].as_view(),
                &off.as_view(),
                &mut y.as_view_mut(),
                s,
            )
            .unwrap();
            g.download(&y).unwrap()
        };
        let all: Vec<usize> = (0..ns.len()).collect();
        let (fr, split) = dense_frag_plan(m, k);
        let auto = multi(&all, None);
        assert!(
            auto.iter().zip(multi(&all, None)).all(|(a, b)| same(a, &b)),
            "case {ci}: a second run differs"
        );
        for sp in [1usize, 2, 4, 8, 16] {
            let got = multi(&all, Some((fr, sp)));
            if sp == split {
                assert!(
                    got.iter().zip(&auto).all(|(a, b)| same(a, b)),
                    "case {ci}: the plan's split {split} differs from the launcher"
                );
            }
            for (i, y) in got.iter().enumerate() {
                let c = Case {
                    counts: vec![m],
                    n: ns[i],
                    k,
                    extra: 0,
                };
                let (want, bound) = reference_nt(&c, &x, &ws[i], tensor_core_sum_bound);
                let what = format!("dense fragment m {m} k {k} split {sp} weight {i} of {ns:?}");
                assert_grouped(&what, seed, y, &want, &bound);
                assert!(
                    same(y, &multi(&[i], Some((fr, sp)))[0]),
                    "{what}: differs from a launch of its weight alone"
                );
                if sp <= 8 {
                    assert!(
                        same(y, &single(i, fr, sp)),
                        "{what}: differs from its one-expert grouped launch"
                    );
                }
            }
        }
    }
    // Refusals by name: four weights, a width off the 32-column blocks, a split of 3.
    let (m, k) = (4usize, 64usize);
    let dx = g.upload(&bf16_values(m * k, 1).bits).unwrap();
    let dw = g.upload(&bf16_values(48 * k, 2).bits).unwrap();
    let mut ys: Vec<_> = (0..4).map(|_| g.zeros::<f32>(m * 48).unwrap()).collect();
    let wv = dw.as_view();
    let mut call = |n: usize, count: usize, split: Option<usize>| -> String {
        let mut yv: Vec<_> = ys.iter_mut().map(|y| y.as_view_mut()).collect();
        let mut outs: Vec<_> = yv.iter_mut().take(count).map(|y| (&wv, n, y)).collect();
        let (xv, ov) = (dx.as_view(), whole.as_view());
        match split {
            Some(sp) => {
                q.dense_nt_frag_bf16_multi_with(FragRows::R8, sp, &xv, &ov, &mut outs, m, k)
            }
            None => q.dense_nt_frag_bf16_multi(&xv, &ov, &mut outs, m, k),
        }
        .unwrap_err()
        .to_string()
    };
    let e = call(32, 4, None);
    assert!(
        e.contains("dense_nt_frag_bf16_multi") && e.contains("4 weights"),
        "{e}"
    );
    let e = call(48, 1, None);
    assert!(e.contains("n = 48") && e.contains("multiple of 32"), "{e}");
    let e = call(32, 1, Some(3));
    assert!(e.contains("split 3"), "{e}");
}

/// The dense small-M kernel (decode's q/k/v/o and router): every output within the IEEE
/// two-order bound of the reference, rows past 8 (several passes), widths off the 256-element
/// lane stride and `k = 8`; both launch shapes (1 and 2 columns per warp) give the same bits,
/// and three outputs in one launch give the bits of three launches.
#[test]
fn dense_small_m_matches_reference_and_fuses_outputs_bitwise() {
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    // (m, k, [n_i])
    let cases: [(usize, usize, &[usize]); 7] = [
        (1, 2048, &[256, 64, 64]),
        (1, 8, &[8]),
        (3, 264, &[72, 8]),
        (8, 520, &[136]),
        (9, 1032, &[16, 24, 40]),
        (20, 72, &[64]),
        (5, 4096, &[32, 32]),
    ];
    for (i, &(m, k, ns)) in cases.iter().enumerate() {
        let seed = 7000 + i as u64;
        let x = bf16_values(m * k, seed * 8);
        let ws: Vec<Bf16> = ns
            .iter()
            .enumerate()
            .map(|(j, &n)| bf16_values(n * k, seed * 8 + 1 + j as u64))
            .collect();
        let dx = g.upload(&x.bits).unwrap();
        let dws: Vec<_> = ws.iter().map(|w| g.upload(&w.bits).unwrap()).collect();
        let run = |nb: usize, which: &[usize]| -> Vec<Vec<f32>> {
            dense_outs(&g, &dws, ns, m, which, |outs| {
                ops.dense_nt_small_m_with(nb, &dx.as_view(), m, k, outs)
                    .unwrap()
            })
        };
        let all: Vec<usize> = (0..ns.len()).collect();
        let fused = run(2, &all);
        assert_eq!(fused, run(1, &all), "case {i}: nb 1 vs 2");
        for j in 0..ns.len() {
            assert_eq!(
                run(2, &[j])[0],
                fused[j],
                "case {i}: output {j} alone vs fused"
            );
            let n = ns[j];
            // The same column sums as the grouped small-M kernel over one expert, whose loop
            // loads each chunk set as it goes (the dense kernels load their first ahead).
            let grouped = run_nt(
                &g,
                &ops,
                &Case {
                    n,
                    k,
                    counts: vec![m],
                    extra: 0,
                },
                &x,
                &ws[j],
                GroupedPath::SmallM,
                None,
            );
            assert_eq!(grouped, fused[j], "case {i}: output {j} vs grouped small-M");
            let want = matmul_nt(&x.f, &ws[j].f, m, k, n);
            let bound = gemm_nt_bounds_with(&x.f, &ws[j].f, m, k, n, two_order_sum_bound);
            assert_within(
                &format!("dense small-M case {i} output {j}"),
                seed,
                &fused[j],
                &want,
                &bound,
            );
        }
    }
    // Bad shapes: a width off 8, four outputs, a misaligned input.
    let x = g.zeros::<u16>(64).unwrap();
    let w = g.zeros::<u16>(64 * 8).unwrap();
    let mut y = g.zeros::<f32>(64 * 8).unwrap();
    let err = |r: Result<(), mxrl_cuda::DeviceError>| r.unwrap_err().to_string();
    let e = err(ops.dense_nt_small_m(
        &x.as_view(),
        1,
        60,
        &mut [(&w.as_view(), 8, &mut y.as_view_mut())],
    ));
    assert!(e.contains("multiples of 8"), "{e}");
    let e = err(ops.dense_nt_small_m(
        &x.slice(1..),
        1,
        56,
        &mut [(&w.as_view(), 8, &mut y.as_view_mut())],
    ));
    assert!(e.contains("aligned"), "{e}");
    let (wv, mut y2, mut y3, mut y4) = (
        w.as_view(),
        g.zeros::<f32>(8).unwrap(),
        g.zeros::<f32>(8).unwrap(),
        g.zeros::<f32>(8).unwrap(),
    );
    let e = err(ops.dense_nt_small_m(
        &x.as_view(),
        1,
        8,
        &mut [
            (&wv, 8, &mut y.as_view_mut()),
            (&wv, 8, &mut y2.as_view_mut()),
            (&wv, 8, &mut y3.as_view_mut()),
            (&wv, 8, &mut y4.as_view_mut()),
        ],
    ));
    assert!(e.contains("outputs"), "{e}");
}

/// Decode's fused routed gate/up + SwiGLU equals gathering the token rows, the grouped small-M
/// forward and the SwiGLU kernel's BF16 output, bit for bit, on routings with empty experts,
/// one token, and rows past 8 per expert; rows of no expert are left unwritten.
#[test]
fn fused_gate_up_swiglu_equals_gather_gemm_swiglu_bitwise() {
    use mxrl_cuda::ops::moe::Moe;
    use mxrl_cuda::ops::swiglu::Swiglu;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let moe = Moe::new(&g).unwrap();
    let sw = Swiglu::new(&g).unwrap();
    // (tokens, experts, top_k, F, K)
    let cases = [
        (1usize, 16usize, 8usize, 768usize, 2048usize),
        (5, 16, 4, 24, 264),
        (32, 8, 2, 40, 72),
        (3, 70, 3, 16, 8),
    ];
    for (ci, &(t, e, top_k, f, k)) in cases.iter().enumerate() {
        let seed = 9100 + ci as u64;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Routing: distinct experts per token; packed expert-major, tokens in order.
        let ids: Vec<Vec<usize>> = (0..t)
            .map(|_| rand::seq::index::sample(&mut rng, e, top_k).into_vec())
            .collect();
        let mut perm = Vec::new();
        let mut counts = vec![0usize; e];
        for (ex, c) in counts.iter_mut().enumerate() {
            for (tok, row) in ids.iter().enumerate() {
                if let Some(slot) = row.iter().position(|&x| x == ex) {
                    perm.push((tok * top_k + slot) as u32);
                    *c += 1;
                }
            }
        }
        let rows = t * top_k;
        let off = offsets_of(&counts);
        let x = bf16_values(t * k, seed * 3);
        let w = bf16_values(e * 2 * f * k, seed * 3 + 1);
        let (dx, dw) = (g.upload(&x.bits).unwrap(), g.upload(&w.bits).unwrap());
        let (dperm, doff) = (g.upload(&perm).unwrap(), g.upload(&off).unwrap());
        let s = Grouped {
            experts: e,
            rows,
            n: 2 * f,
            k,
        };
        // Reference chain.
        let mut xg = g.upload(&vec![0u16; rows * k]).unwrap();
        moe.gather_rows_bf16(
            &dx.as_view(),
            &dperm.as_view(),
            &doff.as_view(),
            &mut xg.as_view_mut(),
            t,
            k,
            e,
            top_k,
        )
        .unwrap();
        let mut gu = g.upload(&vec![f32::NAN; rows * 2 * f]).unwrap();
        ops.grouped_nt_small_m(
            &xg.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut gu.as_view_mut(),
            s,
        )
        .unwrap();
        let mut want = g.upload(&vec![0u16; rows * f]).unwrap();
        sw.forward_bf16(&gu.as_view(), &mut want.as_view_mut(), rows, f)
            .unwrap();
        let want = g.download(&want).unwrap();
        // Fused, over a sentinel fill.
        let mut act = g.upload(&vec![0xFFFFu16; rows * f + 5]).unwrap();
        ops.grouped_gate_up_swiglu_small_m(
            &dx.as_view(),
            t,
            &dperm.as_view(),
            top_k,
            &dw.as_view(),
            &doff.as_view(),
            &mut act.as_view_mut(),
            s,
        )
        .unwrap();
        let got = g.download(&act).unwrap();
        assert_eq!(&got[..rows * f], &want[..], "case {ci}");
        assert!(
            got[rows * f..].iter().all(|&b| b == 0xFFFF),
            "case {ci}: wrote past the rows"
        );
        // The gate/up sums themselves are the reference's within the bound (the chain is
        // checked against the CPU, not only against itself).
        let xgf: Vec<f32> = perm
            .iter()
            .flat_map(|&p| x.f[(p as usize / top_k) * k..(p as usize / top_k + 1) * k].to_vec())
            .collect();
        let c = Case {
            counts: counts.clone(),
            n: 2 * f,
            k,
            extra: 0,
        };
        let xgb = Bf16 {
            bits: xgf.iter().map(|v| (v.to_bits() >> 16) as u16).collect(),
            f: xgf,
        };
        let (ref_gu, bound) = reference_nt(&c, &xgb, &w, two_order_sum_bound);
        assert_within(
            &format!("fused case {ci} gate/up"),
            seed,
            &g.download(&gu).unwrap(),
            &ref_gu,
            &bound,
        );
    }
}

/// Decode's fused routed down projection: the small-M down GEMM, the combine in ascending
/// expert order and the residual add in one launch give the bits of the small-M kernel into
/// `y` followed by the combine kernel (with and without the residual), for one token of the
/// benchmark shape, several tokens sharing experts, a dropped slot (expert id out of range:
/// no row, no contribution), more slots than the kernel keeps in flight, and odd widths; bad
/// shapes are refused.
#[test]
fn fused_down_combine_equals_small_m_then_combine_bitwise() {
    use mxrl_cuda::ops::moe::Moe;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let moe = Moe::new(&g).unwrap();
    // (tokens, experts, top_k, H, F, drop one slot)
    let cases = [
        (1usize, 64usize, 8usize, 2048usize, 768usize, false),
        (4, 16, 4, 72, 264, false),
        (3, 6, 5, 40, 8, true),
        (2, 70, 11, 24, 1032, true),
    ];
    for (ci, &(t, e, top_k, h, f, drop)) in cases.iter().enumerate() {
        let seed = 9300 + ci as u64;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        // Routing: distinct experts per token (one slot of the last token out of range when
        // `drop`), dispatched expert-major with flat indices in order (the dispatch's sort).
        let mut ids: Vec<u32> = (0..t)
            .flat_map(|_| {
                rand::seq::index::sample(&mut rng, e, top_k)
                    .into_iter()
                    .map(|x| x as u32)
            })
            .collect();
        if drop {
            ids[t * top_k - 2] = e as u32;
        }
        let rows_total = t * top_k;
        let mut row_of = vec![u32::MAX; rows_total];
        let mut counts = vec![0usize; e];
        let mut pos = 0u32;
        for (ex, c) in counts.iter_mut().enumerate() {
            for (i, &x) in ids.iter().enumerate() {
                if x as usize == ex {
                    row_of[i] = pos;
                    pos += 1;
                    *c += 1;
                }
            }
        }
        let valid = pos as usize;
        let off = offsets_of(&counts);
        let weights: Vec<f32> = (0..rows_total)
            .map(|_| rng.gen_range(0.01f32..1.0))
            .collect();
        let act = bf16_values(rows_total * f, seed * 5);
        let w = bf16_values(e * h * f, seed * 5 + 1);
        let res: Vec<f32> = mxrl_tensor::gradcheck::test_values(t * h, seed * 5 + 2, 3.0);
        let (dact, dw) = (g.upload(&act.bits).unwrap(), g.upload(&w.bits).unwrap());
        let (dids, drow, doff) = (
            g.upload(&ids).unwrap(),
            g.upload(&row_of).unwrap(),
            g.upload(&off).unwrap(),
        );
        let (dweights, dres) = (g.upload(&weights).unwrap(), g.upload(&res).unwrap());
        // The packed rows the dispatch made: `valid` of them (the grouped kernel's R).
        let s = Grouped {
            experts: e,
            rows: valid,
            n: h,
            k: f,
        };
        let mut y = g.upload(&vec![f32::NAN; rows_total * h]).unwrap();
        ops.grouped_nt_small_m(
            &dact.as_view(),
            &dw.as_view(),
            &doff.as_view(),
            &mut y.as_view_mut(),
            s,
        )
        .unwrap();
        let fs = Grouped {
            rows: rows_total,
            ..s
        };
        for with_res in [true, false] {
            let mut want = g.upload(&vec![f32::NAN; t * h]).unwrap();
            if with_res {
                moe.combine_add(
                    &y.as_view(),
                    &dweights.as_view(),
                    &drow.as_view(),
                    &dres.as_view(),
                    &mut want.as_view_mut(),
                    t,
                    h,
                    top_k,
                )
                .unwrap();
            } else {
                moe.combine(
                    &y.as_view(),
                    &dweights.as_view(),
                    &drow.as_view(),
                    &mut want.as_view_mut(),
                    t,
                    h,
                    top_k,
                )
                .unwrap();
            }
            let want = g.download(&want).unwrap();
            let mut out = g.upload(&vec![f32::NAN; t * h + 3]).unwrap();
            let dres_view = dres.as_view();
            ops.grouped_down_combine_small_m(
                &dact.as_view(),
                &dids.as_view(),
                &drow.as_view(),
                &dweights.as_view(),
                top_k,
                &dw.as_view(),
                with_res.then_some(&dres_view),
                &mut out.as_view_mut(),
                t,
                fs,
            )
            .unwrap();
            let got = g.download(&out).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got[..t * h]),
                bits(&want),
                "case {ci} (residual {with_res})"
            );
            assert!(
                got[t * h..].iter().all(|v| v.is_nan()),
                "case {ci}: wrote past the output"
            );
        }
        assert_eq!(
            valid < rows_total,
            drop,
            "case {ci}: the dropped slot has no row"
        );
    }
    // Refusals: F not a multiple of 8, rows that are not tokens × top_k.
    let z16 = g.upload(&vec![0u16; 4096]).unwrap();
    let z32 = g.upload(&vec![0u32; 64]).unwrap();
    let zf = g.upload(&vec![0f32; 4096]).unwrap();
    let mut o = g.upload(&vec![0f32; 4096]).unwrap();
    for (tokens, s) in [
        (
            2,
            Grouped {
                experts: 2,
                rows: 4,
                n: 8,
                k: 12,
            },
        ),
        (
            3,
            Grouped {
                experts: 2,
                rows: 4,
                n: 8,
                k: 8,
            },
        ),
    ] {
        assert!(ops
            .grouped_down_combine_small_m(
                &z16.as_view(),
                &z32.as_view(),
                &z32.as_view(),
                &zf.as_view(),
                2,
                &z16.as_view(),
                None,
                &mut o.as_view_mut(),
                tokens,
                s,
            )
            .is_err());
    }
}

/// Decode's fused attention input: RMSNorm then the small-M q/k/v projections in one launch
/// give the bits of the RMSNorm kernel's BF16 rows followed by the small-M kernel, over one and
/// two passes of rows, widths from 256 (the norm's full block) and an NaN-free zero row; a width
/// below 256 is refused.
#[test]
fn rmsnorm_dense_small_m_equals_norm_then_small_m_bitwise() {
    use mxrl_cuda::ops::norm::Norm;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let norm = Norm::new(&g).unwrap();
    // The last case is there to catch a changed reduction order: a different rstd only shows
    // where it moves a BF16 rounding of the normalized rows (about 2⁻¹⁶ of them per f32 ulp
    // of rstd), so it takes many rows × width for a few ulps to show (a reversed per-thread
    // order in the fused kernel passed the other cases and fails this one under cuemu).
    let cases: [(usize, usize, &[usize]); 6] = [
        (1, 2048, &[256, 64, 64]),
        (3, 256, &[8]),
        (8, 264, &[72, 16]),
        (12, 1032, &[40]),
        (2, 4096, &[32, 32, 16]),
        (64, 6144, &[32]),
    ];
    let eps = 1e-6f32;
    for (ci, &(m, k, ns)) in cases.iter().enumerate() {
        let seed = 9700 + ci as u64;
        let mut x = mxrl_tensor::gradcheck::test_values(m * k, seed, 3.0);
        if m > 2 {
            x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
        }
        let nw = mxrl_tensor::gradcheck::test_values(k, seed + 1, 1.5);
        let (dx, dnw) = (g.upload(&x).unwrap(), g.upload(&nw).unwrap());
        let ws: Vec<_> = ns
            .iter()
            .enumerate()
            .map(|(j, &n)| {
                g.upload(&bf16_values(n * k, seed * 4 + j as u64).bits)
                    .unwrap()
            })
            .collect();
        let run = |fused: bool| -> Vec<Vec<f32>> {
            let mut ys: Vec<_> = ns
                .iter()
                .map(|&n| g.upload(&vec![f32::NAN; m * n]).unwrap())
                .collect();
            let mut xb = g.zeros::<u16>(m * k).unwrap();
            let mut rstd = g.zeros::<f32>(m).unwrap();
            if !fused {
                norm.forward_bf16(
                    &dx.as_view(),
                    &dnw.as_view(),
                    &mut xb.as_view_mut(),
                    &mut rstd.as_view_mut(),
                    m,
                    k,
                    eps,
                )
                .unwrap();
            }
            {
                let views: Vec<_> = ws.iter().map(|w| w.as_view()).collect();
                let mut yv: Vec<_> = ys.iter_mut().map(|y| y.as_view_mut()).collect();
                let mut outs: Vec<_> = views
                    .iter()
                    .zip(yv.iter_mut())
                    .zip(ns)
                    .map(|((w, y), &n)| (w, n, y))
                    .collect();
                if fused {
                    ops.rmsnorm_dense_nt_small_m(
                        &dx.as_view(),
                        &dnw.as_view(),
                        eps,
                        m,
                        k,
                        &mut outs,
                    )
                    .unwrap();
                } else {
                    ops.dense_nt_small_m(&xb.as_view(), m, k, &mut outs)
                        .unwrap();
                }
            }
            ys.iter().map(|y| g.download(y).unwrap()).collect()
        };
        let (a, b) = (run(true), run(false));
        for j in 0..ns.len() {
            let (ab, bb): (Vec<u32>, Vec<u32>) = (
                a[j].iter().map(|v| v.to_bits()).collect(),
                b[j].iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(ab, bb, "case {ci} output {j}");
            assert!(
                a[j].iter().all(|v| v.is_finite()),
                "case {ci} output {j}: unwritten"
            );
        }
    }
    let x = g.zeros::<f32>(128).unwrap();
    let w = g.zeros::<u16>(128 * 8).unwrap();
    let mut y = g.zeros::<f32>(8).unwrap();
    let e = ops
        .rmsnorm_dense_nt_small_m(
            &x.as_view(),
            &x.as_view(),
            eps,
            1,
            128,
            &mut [(&w.as_view(), 8, &mut y.as_view_mut())],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("256"), "{e}");
}

/// Decode's residual add, norm and router in one launch against the two launches it replaces
/// (`Norm::forward_add` on a copy of the projection, then `dense_nt_small_m` of its BF16
/// rows), bit for bit on every output: the sum, rstd, the BF16 and f32 rows and the router's
/// logits; with and without the f32 rows, a zero row, 1 to 8 rows. The projection is only read.
#[test]
fn add_rmsnorm_dense_small_m_equals_add_norm_then_small_m_bitwise() {
    use mxrl_cuda::ops::norm::Norm;
    let g = gpu();
    let ops = Gemm::new(&g).unwrap();
    let norm = Norm::new(&g).unwrap();
    // (rows, k, n, f32 rows too); the last is wide enough to show a changed reduction order
    // (see rmsnorm_dense_small_m_equals_norm_then_small_m_bitwise).
    let cases: [(usize, usize, usize, bool); 6] = [
        (1, 2048, 64, true),
        (2, 2048, 64, false),
        (3, 256, 8, true),
        (8, 1032, 40, false),
        (5, 264, 16, true),
        (4, 4096, 128, true),
    ];
    let eps = 1e-6f32;
    for (ci, &(m, k, n, with_y)) in cases.iter().enumerate() {
        let seed = 9800 + ci as u64;
        let mut o = mxrl_tensor::gradcheck::test_values(m * k, seed, 3.0);
        let res = mxrl_tensor::gradcheck::test_values(m * k, seed + 2, 2.0);
        if m > 2 {
            // A row whose sum is zero: o = -res.
            for j in k..2 * k {
                o[j] = -res[j];
            }
        }
        let nw = mxrl_tensor::gradcheck::test_values(k, seed + 1, 1.5);
        let w = g.upload(&bf16_values(n * k, seed * 4).bits).unwrap();
        let (d_o, d_res, d_nw) = (
            g.upload(&o).unwrap(),
            g.upload(&res).unwrap(),
            g.upload(&nw).unwrap(),
        );
        let run = |fused: bool| -> Vec<Vec<u32>> {
            let nan = |len: usize| g.upload(&vec![f32::NAN; len]).unwrap();
            let (mut x, mut y, mut rstd, mut out) = (nan(m * k), nan(m * k), nan(m), nan(m * n));
            let mut yb = g.upload(&vec![0xFFFFu16; m * k]).unwrap();
            if fused {
                let mut yv = y.as_view_mut();
                ops.add_rmsnorm_dense_nt_small_m(
                    (&d_o.as_view(), &d_res.as_view()),
                    &d_nw.as_view(),
                    eps,
                    m,
                    k,
                    (
                        &mut x.as_view_mut(),
                        with_y.then_some(&mut yv),
                        &mut yb.as_view_mut(),
                        &mut rstd.as_view_mut(),
                    ),
                    (&w.as_view(), n, &mut out.as_view_mut()),
                )
                .unwrap();
            } else {
                x = g.upload(&o).unwrap();
                let mut yv = y.as_view_mut();
                norm.forward_add(
                    &mut x.as_view_mut(),
                    &d_res.as_view(),
                    &d_nw.as_view(),
                    with_y.then_some(&mut yv),
                    Some(&mut yb.as_view_mut()),
                    &mut rstd.as_view_mut(),
                    m,
                    k,
                    eps,
                )
                .unwrap();
                ops.dense_nt_small_m(
                    &yb.as_view(),
                    m,
                    k,
                    &mut [(&w.as_view(), n, &mut out.as_view_mut())],
                )
                .unwrap();
            }
            let f = |v: &CudaSlice<f32>| -> Vec<u32> {
                g.download(v).unwrap().iter().map(|x| x.to_bits()).collect()
            };
            let yb_bits = g
                .download(&yb)
                .unwrap()
                .iter()
                .map(|&b| u32::from(b))
                .collect();
            let mut all = vec![f(&x), f(&rstd), yb_bits, f(&out)];
            if with_y {
                all.push(f(&y));
            }
            all
        };
        let (a, b) = (run(true), run(false));
        let what = ["sum", "rstd", "BF16 rows", "router output", "f32 rows"];
        for (j, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a, b, "case {ci} ({m} × {k} → {n}): {} differs", what[j]);
        }
        let out = f32::from_bits(a[3][0]);
        assert!(out.is_finite(), "case {ci}: router output unwritten");
        assert_eq!(
            g.download(&d_o).unwrap(),
            o,
            "case {ci}: the projection was written"
        );
    }
    // Refusals: more than one pass of rows; a norm too narrow for the 256-thread reduction.
    let z = |len: usize| g.zeros::<f32>(len).unwrap();
    let w = g.zeros::<u16>(2048 * 8).unwrap();
    for (m, k, want) in [(9, 256, "8"), (1, 128, "256")] {
        let (o, mut x, mut rstd, mut out) = (z(m * k), z(m * k), z(m), z(m * 8));
        let mut yb = g.zeros::<u16>(m * k).unwrap();
        let e = ops
            .add_rmsnorm_dense_nt_small_m(
                (&o.as_view(), &o.as_view()),
                &o.as_view(),
                eps,
                m,
                k,
                (
                    &mut x.as_view_mut(),
                    None,
                    &mut yb.as_view_mut(),
                    &mut rstd.as_view_mut(),
                ),
                (&w.slice(..8 * k), 8, &mut out.as_view_mut()),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{m} × {k}: {e}");
    }
}
