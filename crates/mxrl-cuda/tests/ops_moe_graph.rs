//! The decode-time MoE path — router, device dispatch, bf16 gather, combine — needs no host
//! round trip: captured once into a CUDA graph, it replays with new logits written into the
//! same input buffer and gives the reference's routes (`mxrl_tensor::routing::router_forward`
//! selection), dispatch (`mxrl_tensor::moe::Dispatch`), gathered rows and combined output
//! (`combine_forward`, bitwise). Its own test binary: it turns off cudarc's per-buffer event
//! tracking for its context (events recorded outside a capture cannot be waited on inside it).
#![cfg(feature = "cuda")]
#![allow(unsafe_code)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::moe::{dispatch_scratch_len, Moe};
use mxrl_cuda::ops::router::{DeviceRouteMode, Router};
use mxrl_tensor::moe::{combine_forward, gather, Dispatch};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::routing::{router_forward, RouteMode, Routes};

#[test]
fn moe_decode_path_replays_in_a_cuda_graph() {
    let g = Gpu::new(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"));
    // SAFETY: this process uses one stream only; buffers created from here on carry no events.
    unsafe { g.ctx().disable_event_tracking() };
    let (router, moe) = (Router::new(&g).unwrap(), Moe::new(&g).unwrap());
    let (n, e, k, h) = (32usize, 128usize, 8usize, 256usize);
    let t = n * k;
    let x: Vec<f32> = mxrl_tensor::gradcheck::test_values(n * h, 1, 2.0);
    let y: Vec<f32> = mxrl_tensor::gradcheck::test_values(t * h, 2, 2.0);
    let (dx, dy) = (g.upload(&x).unwrap(), g.upload(&y).unwrap());
    let mut logits = g.zeros::<f32>(n * e).unwrap();
    let mut probs = g.zeros::<f32>(n * e).unwrap();
    let mut ids = g.zeros::<u32>(t).unwrap();
    let mut w = g.zeros::<f32>(t).unwrap();
    let mut scratch = g.zeros::<u32>(dispatch_scratch_len(n, k, e)).unwrap();
    let mut offsets = g.zeros::<u32>(e + 1).unwrap();
    let mut perm = g.zeros::<u32>(t).unwrap();
    let mut row_of = g.zeros::<u32>(t).unwrap();
    let mut packed = g.zeros::<u16>(t * h).unwrap();
    let mut out = g.zeros::<f32>(n * h).unwrap();
    g.sync().unwrap();

    let s = g.stream();
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    router
        .forward(
            &logits.as_view(),
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
    moe.gather_bf16(
        &dx.as_view(),
        &perm.as_view(),
        &offsets.as_view(),
        &mut packed.as_view_mut(),
        n,
        h,
        e,
        k,
    )
    .unwrap();
    moe.combine(
        &dy.as_view(),
        &w.as_view(),
        &row_of.as_view(),
        &mut out.as_view_mut(),
        n,
        h,
        k,
    )
    .unwrap();
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");

    for round in 0..3u64 {
        let l = mxrl_tensor::gradcheck::test_values(n * e, 10 + round, 4.0);
        s.memcpy_htod(&l, &mut logits).unwrap();
        graph.launch().unwrap();
        let ctx = format!("replay {round}");
        let got_ids = g.download(&ids).unwrap();
        let got_w = g.download(&w).unwrap();
        let (want, _) = router_forward(&l, n, e, k, true, RouteMode::Compute);
        // the selection is checked against the reference (random logits: no near ties here,
        // mxrl-cuda's ops_router test bounds them in general); the downstream ops then run on
        // the device's own weights
        assert_eq!(got_ids, want.ids, "{ctx}: routes");
        let routes = Routes {
            top_k: k,
            ids: got_ids,
            weights: got_w,
        };
        let cpu = Dispatch::new(&routes, e);
        let off = g.download(&offsets).unwrap();
        let starts: Vec<usize> = off.iter().map(|&o| o as usize).collect();
        assert_eq!(starts, cpu.starts, "{ctx}: offsets");
        let got_p = g.download(&packed).unwrap();
        let mut i = 0;
        for ex in 0..e {
            for v in gather(&x, h, cpu.rows(ex)) {
                let b = f32::from_bits((got_p[i] as u32) << 16);
                assert_eq!(b.to_bits(), round_bf16(v).to_bits(), "{ctx}: packed [{i}]");
                i += 1;
            }
        }
        let mut want_out = vec![0.0f32; n * h];
        for ex in 0..e {
            let (a, b) = (cpu.starts[ex], cpu.starts[ex + 1]);
            combine_forward(&y[a * h..b * h], h, cpu.rows(ex), &routes, &mut want_out);
        }
        let got_out = g.download(&out).unwrap();
        let bad = got_out
            .iter()
            .zip(&want_out)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(bad, None, "{ctx}: combine");
    }
}
