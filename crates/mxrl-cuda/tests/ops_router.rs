//! The router on the GPU against `mxrl_tensor::routing::{router_forward, router_backward,
//! load_balancing_loss}`: probabilities and weights within the derived bounds of
//! `mxrl_tensor::tolerance` (the devices' `exp` may differ by an ulp), the selection exact on
//! the device's probabilities and equal to the reference's wherever the probabilities leave no
//! doubt, exact ties broken by the lower id, replay modes, the backward bitwise, and the
//! auxiliary loss within `aux_loss_bound` with a bitwise gradient.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::moe::{dispatch_scratch_len, Moe};
use mxrl_cuda::ops::router::{DeviceRouteMode, ExtraDprobs, Router};
use mxrl_tensor::routing::{
    load_balancing_loss, router_backward, router_forward, RouteMode, RouterState, Routes,
};
use mxrl_tensor::tolerance::{
    aux_loss_bound, softmax_prob_bound, topk_norm_weight_bound, violations, EXP_ULPS_CPU,
    EXP_ULPS_DEVICE,
};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, scale)
}

struct Out {
    probs: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn gpu_forward(
    g: &Gpu,
    r: &Router,
    logits: &[f32],
    n: usize,
    e: usize,
    k: usize,
    norm: bool,
    replay: Option<(&[u32], Option<&[f32]>)>,
) -> Out {
    let dl = g.upload(logits).unwrap();
    let mut probs = g.zeros::<f32>(n * e).unwrap();
    let mut ids = g.zeros::<u32>(n * k).unwrap();
    let mut w = g.zeros::<f32>(n * k).unwrap();
    let ri = replay.map(|(i, _)| g.upload(i).unwrap());
    let rw = replay.and_then(|(_, w)| w.map(|w| g.upload(w).unwrap()));
    let (vi, vw) = (
        ri.as_ref().map(|x| x.as_view()),
        rw.as_ref().map(|x| x.as_view()),
    );
    let mode = match (&vi, &vw) {
        (None, _) => DeviceRouteMode::Compute,
        (Some(i), None) => DeviceRouteMode::ReplayIds(i),
        (Some(i), Some(w)) => DeviceRouteMode::ReplayFull(i, w),
    };
    r.forward(
        &dl.as_view(),
        mode,
        &mut probs.as_view_mut(),
        &mut ids.as_view_mut(),
        &mut w.as_view_mut(),
        n,
        e,
        k,
        norm,
    )
    .unwrap();
    Out {
        probs: g.download(&probs).unwrap()[..n * e].to_vec(),
        ids: g.download(&ids).unwrap()[..n * k].to_vec(),
        weights: g.download(&w).unwrap()[..n * k].to_vec(),
    }
}

fn prob_bound(p: f32, e: usize) -> f64 {
    softmax_prob_bound(p, e, EXP_ULPS_DEVICE, EXP_ULPS_CPU)
}

/// `a` sorts before `b` in the router's order: larger probability (f32::total_cmp), then
/// lower id.
fn before(p: &[f32], a: u32, b: u32) -> bool {
    match p[a as usize].total_cmp(&p[b as usize]) {
        std::cmp::Ordering::Greater => true,
        std::cmp::Ordering::Less => false,
        std::cmp::Ordering::Equal => a < b,
    }
}

/// The selection is exactly the top k of the device's own probabilities: slots in the
/// router's order, and every unselected expert after the last slot.
fn assert_topk_of(p: &[f32], ids: &[u32], e: usize, ctx: &str) {
    let k = ids.len();
    for s in 0..k.saturating_sub(1) {
        assert!(
            before(p, ids[s], ids[s + 1]),
            "{ctx}: slots {s}, {} out of order: {ids:?}",
            s + 1
        );
    }
    for j in 0..e as u32 {
        if !ids.contains(&j) {
            assert!(
                before(p, ids[k - 1], j),
                "{ctx}: unselected {j} beats slot {}: {ids:?}",
                k - 1
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_compute(
    g: &Gpu,
    r: &Router,
    logits: &[f32],
    n: usize,
    e: usize,
    k: usize,
    norm: bool,
    ctx: &str,
) {
    let got = gpu_forward(g, r, logits, n, e, k, norm, None);
    let (want, _) = router_forward(logits, n, e, k, norm, RouteMode::Compute);
    let (_, st) = router_forward(logits, n, e, k, norm, RouteMode::Compute);
    let v = violations(&got.probs, &st.probs, |i| prob_bound(st.probs[i], e));
    assert!(v.is_empty(), "{ctx}: probs {v:#?}");
    let mut ambiguous = 0;
    let mut bitwise = 0;
    for t in 0..n {
        let (gi, wi) = (&got.ids[t * k..(t + 1) * k], &want.ids[t * k..(t + 1) * k]);
        let pg = &got.probs[t * e..(t + 1) * e];
        let pc = &st.probs[t * e..(t + 1) * e];
        assert_topk_of(pg, gi, e, &format!("{ctx} token {t}"));
        if gi != wi {
            // allowed only where the reference's probabilities of the swapped experts are
            // within the two devices' bounds of each other (each device's value is within
            // its bound of the reference's, so a swap needs a gap below their sum)
            for s in 0..k {
                let (a, b) = (gi[s] as usize, wi[s] as usize);
                let gap = (pc[a] as f64 - pc[b] as f64).abs();
                let tol = prob_bound(pc[a], e) + prob_bound(pc[b], e);
                assert!(
                    gap <= tol,
                    "{ctx} token {t}: ids {gi:?} vs reference {wi:?}"
                );
            }
            ambiguous += 1;
            continue;
        }
        if pg.iter().zip(pc).all(|(a, b)| a.to_bits() == b.to_bits()) {
            bitwise += 1;
        }
        for s in 0..k {
            let i = t * k + s;
            let b = if norm {
                topk_norm_weight_bound(want.weights[i], k, e, EXP_ULPS_DEVICE, EXP_ULPS_CPU)
            } else {
                prob_bound(want.weights[i], e)
            };
            let d = (got.weights[i] as f64 - want.weights[i] as f64).abs();
            assert!(
                d <= b,
                "{ctx} token {t} slot {s}: weight {:e} vs {:e}, bound {b:e}",
                got.weights[i],
                want.weights[i]
            );
        }
    }
    println!("{ctx}: {bitwise}/{n} tokens with bitwise probs, {ambiguous} near-tie selections");
}

#[test]
fn router_forward_matches_reference_on_random_shapes() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    // (N, E, k, logit scale)
    let cases = [
        (1usize, 8usize, 2usize, 3.0f32),
        (5, 4, 4, 3.0),
        (3, 1, 1, 1.0),
        (64, 64, 8, 3.0),
        (300, 128, 8, 6.0),
        (17, 256, 16, 3.0),
        (9, 1000, 8, 30.0),
        (4096, 128, 8, 3.0),
    ];
    for (i, &(n, e, k, scale)) in cases.iter().enumerate() {
        let seed = 200 + i as u64;
        let logits = values(n * e, seed, scale);
        for norm in [false, true] {
            let ctx = format!("N={n} E={e} k={k} norm={norm} seed={seed}");
            check_compute(&g, &r, &logits, n, e, k, norm, &ctx);
        }
    }
    let out = gpu_forward(&g, &r, &[], 0, 8, 2, true, None);
    assert!(out.ids.is_empty());
}

/// Exact ties (equal logits give equal probabilities on both devices) go to the lower id;
/// masked experts (−∞ logits) get probability 0 and are chosen last.
#[test]
fn router_breaks_exact_ties_by_lower_id() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    let ninf = f32::NEG_INFINITY;
    let rows: [[f32; 5]; 4] = [
        [0.0, 2.0, 1.0, 2.0, -1.0],
        [0.5; 5],
        [ninf, 1.0, ninf, 1.0, 0.0],
        [ninf, ninf, ninf, ninf, 3.0],
    ];
    let logits: Vec<f32> = rows.iter().flatten().copied().collect();
    for norm in [false, true] {
        let got = gpu_forward(&g, &r, &logits, 4, 5, 3, norm, None);
        let (want, _) = router_forward(&logits, 4, 5, 3, norm, RouteMode::Compute);
        assert_eq!(got.ids, want.ids, "norm={norm}");
        assert_eq!(&got.ids[..3], &[1, 3, 2]);
        assert_eq!(&got.ids[3..6], &[0, 1, 2]);
        assert_eq!(&got.ids[9..12], &[4, 0, 1]);
    }
}

#[test]
fn router_replay_modes_match_reference() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    let (n, e, k) = (97usize, 64usize, 8usize);
    let logits = values(n * e, 301, 3.0);
    // ids from another set of logits, so they are not the current top k
    let other = values(n * e, 302, 3.0);
    for norm in [false, true] {
        let (src, _) = router_forward(&other, n, e, k, norm, RouteMode::Compute);
        let ctx = format!("norm={norm}");
        let got = gpu_forward(&g, &r, &logits, n, e, k, norm, Some((&src.ids, None)));
        let (want, st) = router_forward(&logits, n, e, k, norm, RouteMode::ReplayIds(&src.ids));
        assert_eq!(got.ids, src.ids, "{ctx}: replayed ids");
        let v = violations(&got.probs, &st.probs, |i| prob_bound(st.probs[i], e));
        assert!(v.is_empty(), "{ctx}: probs {v:#?}");
        let v = violations(&got.weights, &want.weights, |i| {
            if norm {
                topk_norm_weight_bound(want.weights[i], k, e, EXP_ULPS_DEVICE, EXP_ULPS_CPU)
            } else {
                prob_bound(want.weights[i], e)
            }
        });
        assert!(v.is_empty(), "{ctx}: replayed-id weights {v:#?}");
        let got = gpu_forward(
            &g,
            &r,
            &logits,
            n,
            e,
            k,
            norm,
            Some((&src.ids, Some(&src.weights))),
        );
        assert_eq!(got.ids, src.ids, "{ctx}: full replay ids");
        let same = got
            .weights
            .iter()
            .zip(&src.weights)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{ctx}: full replay copies the weights verbatim");
    }
}

#[allow(clippy::too_many_arguments)]
fn gpu_backward(
    g: &Gpu,
    r: &Router,
    st: &RouterState,
    routes: &Routes,
    dw: Option<&[f32]>,
    extra: Option<(&[f32], bool)>,
    n: usize,
    e: usize,
    norm: bool,
) -> Vec<f32> {
    let k = routes.top_k;
    let dp = g.upload(&st.probs).unwrap();
    let di = g.upload(&routes.ids).unwrap();
    let dwt = g.upload(&routes.weights).unwrap();
    let ddw = dw.map(|d| g.upload(d).unwrap());
    let dex = extra.map(|(x, _)| g.upload(x).unwrap());
    let vdw = ddw.as_ref().map(|x| x.as_view());
    let vex = dex.as_ref().map(|x| x.as_view());
    let ex = match (&vex, extra) {
        (Some(v), Some((_, true))) => ExtraDprobs::PerToken(v),
        (Some(v), Some((_, false))) => ExtraDprobs::Broadcast(v),
        _ => ExtraDprobs::None,
    };
    let mut out = g.zeros::<f32>(n * e).unwrap();
    r.backward(
        &dp.as_view(),
        &di.as_view(),
        &dwt.as_view(),
        vdw.as_ref(),
        ex,
        &mut out.as_view_mut(),
        n,
        e,
        k,
        norm,
    )
    .unwrap();
    g.download(&out).unwrap()[..n * e].to_vec()
}

#[test]
fn router_backward_is_bitwise_the_reference() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    for (ci, &(n, e, k)) in [
        (1usize, 8usize, 2usize),
        (5, 4, 4),
        (77, 64, 8),
        (33, 256, 16),
    ]
    .iter()
    .enumerate()
    {
        let seed = 400 + ci as u64;
        let logits = values(n * e, seed, 3.0);
        let dw = values(n * k, seed + 1, 1.0);
        let row = values(e, seed + 2, 0.1);
        let per_token = values(n * e, seed + 3, 0.1);
        let broadcast: Vec<f32> = (0..n).flat_map(|_| row.iter().copied()).collect();
        for norm in [false, true] {
            let (routes, st) = router_forward(&logits, n, e, k, norm, RouteMode::Compute);
            let frozen = RouterState {
                probs: st.probs.clone(),
                weights_frozen: true,
            };
            let (dws, rows, pts, bcs) = (
                dw.as_slice(),
                row.as_slice(),
                per_token.as_slice(),
                broadcast.as_slice(),
            );
            type Case<'a> = (
                &'a str,
                &'a RouterState,
                Option<&'a [f32]>,
                Option<(&'a [f32], bool)>,
                Option<&'a [f32]>,
            );
            let cases: [Case<'_>; 5] = [
                ("dweights", &st, Some(dws), None, None),
                (
                    "dweights+broadcast",
                    &st,
                    Some(dws),
                    Some((rows, false)),
                    Some(bcs),
                ),
                (
                    "dweights+per-token",
                    &st,
                    Some(dws),
                    Some((pts, true)),
                    Some(pts),
                ),
                (
                    "frozen+broadcast",
                    &frozen,
                    None,
                    Some((rows, false)),
                    Some(bcs),
                ),
                ("frozen", &frozen, None, None, None),
            ];
            for (name, state, gdw, gex, cex) in cases {
                let ctx = format!("N={n} E={e} k={k} norm={norm} seed={seed} {name}");
                let got = gpu_backward(&g, &r, state, &routes, gdw, gex, n, e, norm);
                let mut want = vec![0.0f32; n * e];
                router_backward(&dw, &routes, state, n, e, norm, cex, &mut want);
                let bad = got
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(bad, None, "{ctx}: first differing dlogit");
            }
        }
    }
}

#[test]
fn aux_loss_and_gradient_match_reference() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    let moe = Moe::new(&g).unwrap();
    let (e, k, coef) = (16usize, 4usize, 0.01f32);
    let layer_tokens = [5usize, 1, 40, 300];
    let mut psum = g.zeros::<f64>(e).unwrap();
    let mut counts = g.zeros::<f64>(e).unwrap();
    let mut host: Vec<(Vec<f32>, Vec<u32>)> = Vec::new();
    let mut losses = Vec::new();
    let mut grad = g.zeros::<f32>(e).unwrap();
    for run in 0..2 {
        r.aux_reset(&mut psum.as_view_mut(), &mut counts.as_view_mut(), e)
            .unwrap();
        for (l, &n) in layer_tokens.iter().enumerate() {
            let logits = values(n * e, 500 + l as u64, 2.0);
            let dl = g.upload(&logits).unwrap();
            let mut probs = g.zeros::<f32>(n * e).unwrap();
            let mut ids = g.zeros::<u32>(n * k).unwrap();
            let mut w = g.zeros::<f32>(n * k).unwrap();
            r.forward(
                &dl.as_view(),
                DeviceRouteMode::Compute,
                &mut probs.as_view_mut(),
                &mut ids.as_view_mut(),
                &mut w.as_view_mut(),
                n,
                e,
                k,
                true,
            )
            .unwrap();
            let mut scratch = g.zeros::<u32>(dispatch_scratch_len(n, k, e)).unwrap();
            let mut offsets = g.zeros::<u32>(e + 1).unwrap();
            let mut perm = g.zeros::<u32>(n * k).unwrap();
            let mut row_of = g.zeros::<u32>(n * k).unwrap();
            moe.dispatch(
                &ids.as_view(),
                n,
                e,
                k,
                &mut scratch.as_view_mut(),
                &mut offsets.as_view_mut(),
                &mut perm.as_view_mut(),
                &mut row_of.as_view_mut(),
            )
            .unwrap();
            r.aux_accumulate(
                &probs.as_view(),
                &offsets.as_view(),
                &mut psum.as_view_mut(),
                &mut counts.as_view_mut(),
                n,
                e,
            )
            .unwrap();
            if run == 0 {
                host.push((
                    g.download(&probs).unwrap()[..n * e].to_vec(),
                    g.download(&ids).unwrap()[..n * k].to_vec(),
                ));
            }
        }
        let m: usize = layer_tokens.iter().sum();
        let mut loss = g.zeros::<f32>(1).unwrap();
        r.aux_finish(
            &psum.as_view(),
            &counts.as_view(),
            m,
            e,
            coef,
            &mut loss.as_view_mut(),
            &mut grad.as_view_mut(),
        )
        .unwrap();
        losses.push(g.download(&loss).unwrap()[0]);
    }
    assert_eq!(
        losses[0].to_bits(),
        losses[1].to_bits(),
        "aux loss not deterministic"
    );
    // the reference on the device's own probabilities and ids: only the f64 order differs
    let pairs: Vec<(&[f32], &[u32])> = host
        .iter()
        .map(|(p, i)| (p.as_slice(), i.as_slice()))
        .collect();
    let (want, grads) = load_balancing_loss(&pairs, e);
    let m: usize = layer_tokens.iter().sum();
    let b = aux_loss_bound(want, m, e);
    assert!(
        (losses[0] as f64 - want as f64).abs() <= b,
        "aux loss {:e} vs {want:e}, bound {b:e}",
        losses[0]
    );
    let got = g.download(&grad).unwrap();
    for x in 0..e {
        assert_eq!(
            got[x].to_bits(),
            (grads[0][x] * coef).to_bits(),
            "aux grad[{x}]"
        );
    }
    // and through the router backward (the aux-only gradient on one layer's logits)
    let n = layer_tokens[0];
    let (probs, ids) = &host[0];
    let routes = Routes {
        top_k: k,
        ids: ids.clone(),
        weights: vec![0.0; n * k],
    };
    let st = RouterState {
        probs: probs.clone(),
        weights_frozen: true,
    };
    let g_row: Vec<f32> = got[..e].to_vec();
    let dl = gpu_backward(
        &g,
        &r,
        &st,
        &routes,
        None,
        Some((&g_row, false)),
        n,
        e,
        true,
    );
    let scaled: Vec<f32> = grads[0].iter().map(|x| x * coef).collect();
    let mut want_dl = vec![0.0f32; n * e];
    router_backward(
        &vec![0.0; n * k],
        &routes,
        &st,
        n,
        e,
        true,
        Some(&scaled),
        &mut want_dl,
    );
    assert!(
        dl.iter()
            .zip(&want_dl)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "aux gradient on the logits"
    );
}

#[test]
fn router_launcher_rejects_bad_shapes() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    let l = g.zeros::<f32>(16).unwrap();
    let mut p = g.zeros::<f32>(16).unwrap();
    let mut i = g.zeros::<u32>(16).unwrap();
    let mut w = g.zeros::<f32>(16).unwrap();
    let err = r
        .forward(
            &l.as_view(),
            DeviceRouteMode::Compute,
            &mut p.as_view_mut(),
            &mut i.as_view_mut(),
            &mut w.as_view_mut(),
            2,
            8,
            9,
            true,
        )
        .unwrap_err();
    assert!(err.to_string().contains("top_k 9"), "{err}");
}

/// Decode's one-launch routing gives the bits of the router forward followed by the dispatch:
/// probabilities, ids, weights, offsets, perm and row_of, over token counts up to the block's
/// 1024 entries, expert counts up to 128, exact ties, NaN logits and both weight modes; a shape
/// past its limits is refused with a clear error.
#[test]
fn router_dispatch_small_equals_router_then_dispatch_bitwise() {
    let g = gpu();
    let r = Router::new(&g).unwrap();
    let moe = Moe::new(&g).unwrap();
    let cases = [
        (1usize, 64usize, 8usize, true),
        (3, 64, 8, false),
        (17, 8, 2, true),
        (128, 64, 8, true),
        (40, 128, 3, false),
        (1, 1, 1, true),
        (1024, 4, 1, true),
    ];
    for (ci, &(n, e, k, norm)) in cases.iter().enumerate() {
        let mut logits = values(n * e, 9300 + ci as u64, 3.0);
        // Exact ties and a NaN in the first rows.
        if e >= 4 {
            logits[1] = logits[2];
            logits[0] = f32::NAN;
        }
        if e >= 4 && n >= 2 {
            logits[e + 3] = logits[e];
        }
        let dl = g.upload(&logits).unwrap();
        let nan = |m: usize| g.upload(&vec![f32::NAN; m]).unwrap();
        let junk = |m: usize| g.upload(&vec![0xDEADu32; m]).unwrap();
        // Reference: the two launches.
        let (mut p1, mut i1, mut w1) = (nan(n * e), junk(n * k), nan(n * k));
        r.forward(
            &dl.as_view(),
            DeviceRouteMode::Compute,
            &mut p1.as_view_mut(),
            &mut i1.as_view_mut(),
            &mut w1.as_view_mut(),
            n,
            e,
            k,
            norm,
        )
        .unwrap();
        let mut scratch = g.zeros::<u32>(dispatch_scratch_len(n, k, e)).unwrap();
        let (mut o1, mut pm1, mut ro1) = (junk(e + 1), junk(n * k), junk(n * k));
        moe.dispatch(
            &i1.as_view(),
            n,
            e,
            k,
            &mut scratch.as_view_mut(),
            &mut o1.as_view_mut(),
            &mut pm1.as_view_mut(),
            &mut ro1.as_view_mut(),
        )
        .unwrap();
        // One launch.
        assert!(Router::dispatch_small_fits(n, e, k), "case {ci}");
        let (mut p2, mut i2, mut w2) = (nan(n * e), junk(n * k), nan(n * k));
        let (mut o2, mut pm2, mut ro2) = (junk(e + 1), junk(n * k), junk(n * k));
        r.forward_dispatch_small(
            &dl.as_view(),
            &mut p2.as_view_mut(),
            &mut i2.as_view_mut(),
            &mut w2.as_view_mut(),
            &mut o2.as_view_mut(),
            &mut pm2.as_view_mut(),
            &mut ro2.as_view_mut(),
            n,
            e,
            k,
            norm,
        )
        .unwrap();
        let bits = |b: &cudarc::driver::CudaSlice<f32>| -> Vec<u32> {
            g.download(b).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(&p2), bits(&p1), "case {ci}: probs");
        assert_eq!(bits(&w2), bits(&w1), "case {ci}: weights");
        for (what, a, b) in [
            ("ids", &i2, &i1),
            ("offsets", &o2, &o1),
            ("perm", &pm2, &pm1),
            ("row_of", &ro2, &ro1),
        ] {
            assert_eq!(
                g.download(a).unwrap(),
                g.download(b).unwrap(),
                "case {ci}: {what}"
            );
        }
        // And the selection is the top k of the probabilities (not only self-consistent).
        let p = g.download(&p2).unwrap();
        let ids = g.download(&i2).unwrap();
        for t in 0..n {
            assert_topk_of(
                &p[t * e..(t + 1) * e],
                &ids[t * k..(t + 1) * k],
                e,
                &format!("case {ci} token {t}"),
            );
        }
    }
    let err = |r: Result<(), mxrl_cuda::DeviceError>| r.unwrap_err().to_string();
    let (dl, mut a, mut b, mut c) = (
        g.zeros::<f32>(129 * 2).unwrap(),
        g.zeros::<f32>(129 * 2).unwrap(),
        g.zeros::<u32>(2).unwrap(),
        g.zeros::<f32>(2).unwrap(),
    );
    let (mut o, mut pm, mut ro) = (
        g.zeros::<u32>(130).unwrap(),
        g.zeros::<u32>(2).unwrap(),
        g.zeros::<u32>(2).unwrap(),
    );
    let e = err(r.forward_dispatch_small(
        &dl.as_view(),
        &mut a.as_view_mut(),
        &mut b.as_view_mut(),
        &mut c.as_view_mut(),
        &mut o.as_view_mut(),
        &mut pm.as_view_mut(),
        &mut ro.as_view_mut(),
        2,
        129,
        1,
        true,
    ));
    assert!(e.contains("one block"), "{e}");
}

/// The auxiliary loss as the engine calls it, through the backend: over three MoE layers the
/// GPU's `[E]` gradient equals the CPU backend's bit for bit (and the reference's
/// `load_balancing_loss` row times the coefficient), its loss is within `aux_loss_bound`; the
/// router backward with that gradient added equals the CPU backend's bit for bit on the same
/// routes (the CPU's, uploaded), and differs from the one without it.
#[test]
fn backend_aux_loss_and_the_router_backward_with_it_equal_the_cpu_backend() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::device::{Backend, CpuBackend, RouteBufs};
    let g = CudaBackend::new(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}"));
    let c = CpuBackend;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (n, e, k, layers, coef) = (37usize, 16usize, 4usize, 3usize, 0.01f32);
    let cpu_routes: Vec<RouteBufs<CpuBackend>> = (0..layers)
        .map(|l| {
            let mut r = RouteBufs {
                ids: vec![0; n * k],
                weights: vec![0.0; n * k],
                probs: vec![0.0; n * e],
                offsets: vec![0; e + 1],
                perm: vec![0; n * k],
                row_of: vec![0; n * k],
            };
            let logits = values(n * e, 40 + l as u64, 3.0);
            c.route(&logits, n, e, k, true, None, &mut r).unwrap();
            r
        })
        .collect();
    let gpu_routes: Vec<RouteBufs<CudaBackend>> = cpu_routes
        .iter()
        .map(|r| RouteBufs {
            ids: g.upload_u32(&r.ids).unwrap(),
            weights: g.upload_f32(&r.weights).unwrap(),
            probs: g.upload_f32(&r.probs).unwrap(),
            offsets: g.upload_u32(&r.offsets).unwrap(),
            perm: g.upload_u32(&r.perm).unwrap(),
            row_of: g.upload_u32(&r.row_of).unwrap(),
        })
        .collect();
    let (mut closs, mut cgrad) = (vec![0.0f32; 1], vec![0.0f32; e]);
    let cl: Vec<_> = cpu_routes.iter().collect();
    c.aux_loss_grad(&cl, n, e, k, coef, &mut closs, &mut cgrad)
        .unwrap();
    let (mut gloss, mut ggrad) = (g.zeros_f32(1).unwrap(), g.zeros_f32(e).unwrap());
    let gl: Vec<_> = gpu_routes.iter().collect();
    g.aux_loss_grad(&gl, n, e, k, coef, &mut gloss, &mut ggrad)
        .unwrap();
    let refl: Vec<(&[f32], &[u32])> = cpu_routes
        .iter()
        .map(|r| (r.probs.as_slice(), r.ids.as_slice()))
        .collect();
    let (want, rows) = load_balancing_loss(&refl, e);
    let want_grad: Vec<f32> = rows[0][..e].iter().map(|x| x * coef).collect();
    assert!(want_grad.iter().any(|&x| x != 0.0));
    assert_eq!(bits(&cgrad), bits(&want_grad), "CPU backend aux gradient");
    assert_eq!(closs[0].to_bits(), want.to_bits(), "CPU backend aux loss");
    assert_eq!(
        bits(&g.download_f32(&ggrad, e).unwrap()),
        bits(&want_grad),
        "GPU aux gradient"
    );
    let gls = g.download_f32(&gloss, 1).unwrap()[0];
    let b = aux_loss_bound(want, layers * n, e);
    assert!(
        (gls as f64 - want as f64).abs() <= b,
        "GPU aux loss {gls:e} vs {want:e}, bound {b:e}"
    );
    let dw = values(n * k, 60, 1.0);
    let gdw = g.upload_f32(&dw).unwrap();
    for l in 0..layers {
        let mut cd = vec![0.0f32; n * e];
        c.router_backward(&dw, &cpu_routes[l], Some(&cgrad), n, e, k, true, &mut cd)
            .unwrap();
        let mut cd0 = vec![0.0f32; n * e];
        c.router_backward(&dw, &cpu_routes[l], None, n, e, k, true, &mut cd0)
            .unwrap();
        assert_ne!(
            bits(&cd),
            bits(&cd0),
            "layer {l}: the aux gradient changes nothing"
        );
        let mut gd = g.zeros_f32(n * e).unwrap();
        g.router_backward(&gdw, &gpu_routes[l], Some(&ggrad), n, e, k, true, &mut gd)
            .unwrap();
        assert_eq!(
            bits(&g.download_f32(&gd, n * e).unwrap()),
            bits(&cd),
            "layer {l}: router backward with the aux gradient"
        );
    }
}
