//! Times the MoE op families of the engine (router, dispatch, gather, combine and their
//! backward, SwiGLU) on the GPU with CUDA events, at the decode and training shapes of the
//! engine's benchmark config (hidden 2048, 64/128 experts top-8, moe_intermediate 768), and
//! reports each against its floor: the fewest bytes it must move over the device copy
//! bandwidth measured in the same run.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_moe_ops [-- --quick]`

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run(std::env::args().any(|a| a == "--quick")) {
        eprintln!("bench_moe_ops: {e}");
        std::process::exit(1);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_moe_ops needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod bench {
    use cudarc::driver::sys::CUevent_flags;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::moe::{dispatch_scratch_len, Moe};
    use mxrl_cuda::ops::router::{DeviceRouteMode, Router};
    use mxrl_cuda::ops::swiglu::Swiglu;
    use mxrl_cuda::DeviceError;

    type R<T> = Result<T, DeviceError>;

    /// Mean milliseconds of `f` over `iters` calls after 3 warm-up calls, with CUDA events.
    fn time(g: &Gpu, iters: usize, mut f: impl FnMut() -> R<()>) -> R<f64> {
        for _ in 0..3 {
            f()?;
        }
        let ev = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = g.stream().record_event(ev).map_err(|e| g.err(e))?;
        for _ in 0..iters {
            f()?;
        }
        let stop = g.stream().record_event(ev).map_err(|e| g.err(e))?;
        stop.synchronize().map_err(|e| g.err(e))?;
        Ok(f64::from(start.elapsed_ms(&stop).map_err(|e| g.err(e))?) / iters as f64)
    }

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        mxrl_tensor::gradcheck::test_values(n, seed, scale)
    }

    struct Row {
        op: &'static str,
        shape: String,
        ms: f64,
        bytes: f64,
    }

    pub fn run(quick: bool) -> R<()> {
        let g = Gpu::shared(0)?;
        println!("device: {}", g.name());
        let (router, moe, swiglu) = (Router::new(&g)?, Moe::new(&g)?, Swiglu::new(&g)?);
        // copy ceiling: 1 GiB device-to-device, bytes read + written
        let n_copy = 1usize << 28;
        let src = g.upload(&values(n_copy, 1, 1.0))?;
        let mut dst = g.zeros::<f32>(n_copy)?;
        let copy_ms = time(&g, if quick { 3 } else { 10 }, || {
            g.stream().memcpy_dtod(&src, &mut dst).map_err(|e| g.err(e))
        })?;
        drop((src, dst));
        let copy_bw = 2.0 * 4.0 * n_copy as f64 / (copy_ms * 1e-3);
        println!(
            "device copy: {:.0} GB/s (bytes read + written)",
            copy_bw / 1e9
        );

        let (h, f, k) = (2048usize, 768usize, 8usize);
        let mut rows: Vec<Row> = Vec::new();
        let shapes: &[(usize, usize)] = if quick {
            &[(1, 128), (4096, 128)]
        } else {
            &[
                (1, 128),
                (8, 128),
                (32, 128),
                (128, 128),
                (4096, 64),
                (4096, 128),
            ]
        };
        for &(n, e) in shapes {
            let iters = if n >= 1024 { 20 } else { 200 };
            let t = n * k;
            let shape = format!("N={n} E={e}");
            let logits = g.upload(&values(n * e, 2, 3.0))?;
            let mut probs = g.zeros::<f32>(n * e)?;
            let mut ids = g.zeros::<u32>(t)?;
            let mut w = g.zeros::<f32>(t)?;
            let ms = time(&g, iters, || {
                router.forward(
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
            })?;
            rows.push(Row {
                op: "router fwd",
                shape: shape.clone(),
                ms,
                bytes: (8 * n * e + 8 * t) as f64,
            });
            let mut scratch = g.zeros::<u32>(dispatch_scratch_len(n, k, e))?;
            let mut offsets = g.zeros::<u32>(e + 1)?;
            let mut perm = g.zeros::<u32>(t)?;
            let mut row_of = g.zeros::<u32>(t)?;
            let ms = time(&g, iters, || {
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
            })?;
            rows.push(Row {
                op: "dispatch",
                shape: shape.clone(),
                ms,
                bytes: (12 * t + 4 * (e + 1)) as f64,
            });
            let x = g.upload(&values(n * h, 3, 1.0))?;
            let mut packed_b = g.zeros::<u16>(t * h)?;
            let ms = time(&g, iters, || {
                moe.gather_bf16(
                    &x.as_view(),
                    &perm.as_view(),
                    &offsets.as_view(),
                    &mut packed_b.as_view_mut(),
                    n,
                    h,
                    e,
                    k,
                )
            })?;
            rows.push(Row {
                op: "gather bf16",
                shape: shape.clone(),
                ms,
                bytes: (4 * n * h + 2 * t * h + 4 * t) as f64,
            });
            drop(packed_b);
            let mut packed = g.zeros::<f32>(t * h)?;
            let ms = time(&g, iters, || {
                moe.gather(
                    &x.as_view(),
                    &perm.as_view(),
                    &offsets.as_view(),
                    &mut packed.as_view_mut(),
                    n,
                    h,
                    e,
                    k,
                )
            })?;
            rows.push(Row {
                op: "gather f32",
                shape: shape.clone(),
                ms,
                bytes: (4 * n * h + 4 * t * h + 4 * t) as f64,
            });
            // the packed rows stand in for the experts' outputs
            let mut out = g.zeros::<f32>(n * h)?;
            let ms = time(&g, iters, || {
                moe.combine(
                    &packed.as_view(),
                    &w.as_view(),
                    &row_of.as_view(),
                    &mut out.as_view_mut(),
                    n,
                    h,
                    k,
                )
            })?;
            rows.push(Row {
                op: "combine",
                shape: shape.clone(),
                ms,
                bytes: (4 * t * h + 8 * t + 4 * n * h) as f64,
            });
            if n >= 1024 {
                let mut dy = g.zeros::<f32>(t * h)?;
                let mut dw = g.zeros::<f32>(t)?;
                let ms = time(&g, iters, || {
                    moe.combine_backward(
                        &out.as_view(),
                        &packed.as_view(),
                        &w.as_view(),
                        &row_of.as_view(),
                        &mut dy.as_view_mut(),
                        &mut dw.as_view_mut(),
                        n,
                        h,
                        k,
                    )
                })?;
                rows.push(Row {
                    op: "combine bwd",
                    shape: shape.clone(),
                    ms,
                    bytes: (4 * n * h + 8 * t * h + 12 * t) as f64,
                });
                let ms = time(&g, iters, || {
                    moe.gather_backward(
                        &dy.as_view(),
                        &row_of.as_view(),
                        &mut out.as_view_mut(),
                        n,
                        h,
                        k,
                    )
                })?;
                rows.push(Row {
                    op: "gather bwd",
                    shape: shape.clone(),
                    ms,
                    bytes: (4 * t * h + 4 * t + 4 * n * h) as f64,
                });
            }
            drop(packed);
            let gu = g.upload(&values(t * 2 * f, 4, 4.0))?;
            let mut act = g.zeros::<f32>(t * f)?;
            let mut act_b = g.zeros::<u16>(t * f)?;
            let ms = time(&g, iters, || {
                swiglu.forward(
                    &gu.as_view(),
                    &mut act.as_view_mut(),
                    Some(&mut act_b.as_view_mut()),
                    t,
                    f,
                )
            })?;
            rows.push(Row {
                op: "swiglu fwd+bf16",
                shape: format!("{shape} rows={t} F={f}"),
                ms,
                bytes: (8 * t * f + 6 * t * f) as f64,
            });
            if n >= 1024 {
                let mut dgu = g.zeros::<f32>(t * 2 * f)?;
                let ms = time(&g, iters, || {
                    swiglu.backward(&act.as_view(), &gu.as_view(), &mut dgu.as_view_mut(), t, f)
                })?;
                rows.push(Row {
                    op: "swiglu bwd",
                    shape: format!("{shape} rows={t} F={f}"),
                    ms,
                    bytes: (4 * t * f + 16 * t * f) as f64,
                });
            }
        }
        println!();
        println!(
            "{:<16} {:<28} {:>10} {:>10} {:>10} {:>8}",
            "op", "shape", "µs", "GB/s", "floor µs", "×floor"
        );
        for r in &rows {
            let floor_us = r.bytes / copy_bw * 1e6;
            println!(
                "{:<16} {:<28} {:>10.2} {:>10.0} {:>10.2} {:>8.1}",
                r.op,
                r.shape,
                r.ms * 1e3,
                r.bytes / (r.ms * 1e-3) / 1e9,
                floor_us,
                r.ms * 1e3 / floor_us
            );
        }
        Ok(())
    }
}
