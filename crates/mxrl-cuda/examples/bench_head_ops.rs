//! Times the head, optim, embed_backward and sample op families on a GPU with CUDA events
//! after warm-up, each beside its floor (bytes over the measured device copy bandwidth, FLOPs
//! over the BF16 tensor-core / f32 rates given on the command line), at the benchmark model's
//! shapes (hidden 2048, vocab 32 000, 8×512 tokens; decode vocab 151 936).
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_head_ops [-- --quick]`
//! (`--bf16-tflops X`, `--f32-tflops Y`: the machine's rates, default the H200's 790 / 60).

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = run() {
        eprintln!("bench_head_ops: {e}");
        std::process::exit(1);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_head_ops needs the `cuda` feature");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn run() -> Result<(), Box<dyn std::error::Error>> {
    use cudarc::driver::sys::CUevent_flags;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::embed_backward::{EmbedBackward, EmbedGrouping};
    use mxrl_cuda::ops::head::{Head, HeadGradGemm, HeadOutputs, HeadShape};
    use mxrl_cuda::ops::optim::{AdamWParam, Optim};
    use mxrl_cuda::ops::sample::{SampleParams, Sampler};
    use mxrl_tensor::optim::AdamWConfig;

    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let num = |name: &str, d: f64| -> f64 {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (bf16_tf, f32_tf) = (num("--bf16-tflops", 790.0), num("--f32-tflops", 60.0));
    let g = Gpu::new(0)?;
    println!("device {}", g.name());
    let iters = if quick { 2 } else { 10 };
    let time = |f: &mut dyn FnMut() -> Result<(), mxrl_cuda::DeviceError>| -> Result<f64, Box<dyn std::error::Error>> {
        f()?;
        g.sync()?;
        let ev = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = g.stream().record_event(ev)?;
        for _ in 0..iters {
            f()?;
        }
        let stop = g.stream().record_event(ev)?;
        stop.synchronize()?;
        Ok(f64::from(start.elapsed_ms(&stop)?) / iters as f64)
    };

    // Device copy bandwidth (bytes read + written).
    let copy_n: usize = if quick { 1 << 22 } else { 1 << 28 };
    let src = g.zeros::<f32>(copy_n)?;
    let ms = time(&mut || {
        g.stream()
            .clone_dtod(&src)
            .map(drop)
            .map_err(|e| g.err(format!("{e:?}")))
    })?;
    let bw = 2.0 * 4.0 * copy_n as f64 / (ms * 1e-3);
    drop(src);
    println!("device copy: {:.1} GB/s (read + write)", bw / 1e9);
    let floor_bytes = |bytes: f64| bytes / bw * 1e3;

    // Head forward / backward at 8×512 tokens.
    let (t, h, v) = if quick {
        (256, 256, 4000)
    } else {
        (4096, 2048, 32000)
    };
    let hb = g.zeros::<u16>(t * h)?;
    let wb = g.upload(&vec![0x3c00u16; v * h])?; // 0.0078125: a non-degenerate softmax
    let tg = g.upload(&(0..t).map(|i| (i % v) as u32).collect::<Vec<_>>())?;
    let head = Head::new(&g)?;
    let mut lp = g.zeros::<f32>(t)?;
    let mut lse = g.zeros::<f32>(t)?;
    let mut ent = g.zeros::<f32>(t)?;
    let shape = HeadShape {
        t,
        h,
        v,
        chunk: 8192,
    };
    let ms = time(&mut || {
        head.forward(
            &hb.as_view(),
            &wb.as_view(),
            &tg.as_view(),
            1.0,
            shape,
            HeadOutputs {
                logprob: &mut lp.as_view_mut(),
                lse: &mut lse.as_view_mut(),
                entropy: &mut ent.as_view_mut(),
            },
        )
    })?;
    let flops = 2.0 * (t * v * h) as f64;
    let floor = flops / (bf16_tf * 1e12) * 1e3;
    println!("head forward T {t} H {h} V {v}: {ms:.3} ms, {:.0} TFLOP/s, {:.2}× the BF16 floor {floor:.3} ms", flops / (ms * 1e-3) / 1e12, ms / floor);
    let dl = g.upload(&vec![1.0f32; t])?;
    let mut dh = g.zeros::<f32>(t * h)?;
    let mut dw = g.zeros::<f32>(v * h)?;
    let head_f32 = Head::new(&g)?;
    let head_x3 = Head::new(&g)?.with_grad_gemm(HeadGradGemm::Bf16x3);
    for hd in [&head_f32, &head_x3] {
        let ms = time(&mut || {
            hd.backward(
                &hb.as_view(),
                &wb.as_view(),
                &tg.as_view(),
                &lse.as_view(),
                &dl.as_view(),
                1.0,
                shape,
                &mut dh.as_view_mut(),
                &mut dw.as_view_mut(),
            )
        })?;
        let floor = match hd.grad_gemm() {
            HeadGradGemm::F32 => {
                flops / (bf16_tf * 1e12) * 1e3 + 2.0 * flops / (f32_tf * 1e12) * 1e3
            }
            HeadGradGemm::Bf16x3 => 7.0 * flops / (bf16_tf * 1e12) * 1e3,
        };
        println!(
            "head backward ({:?} GEMMs): {ms:.3} ms, {:.2}× the floor {floor:.3} ms",
            hd.grad_gemm(),
            ms / floor
        );
    }
    drop((dh, dw, hb, wb, tg));

    // Decode: full logits + sampling.
    let vd = if quick { 5000 } else { 151_936 };
    let wd = g.upload(&vec![0x3c00u16; vd * h])?;
    let sampler = Sampler::new(&g)?;
    for b in [1usize, 8, 32, 128] {
        let hd = g.zeros::<u16>(b * h)?;
        let mut z = g.zeros::<f32>(b * vd)?;
        let ms = time(&mut || {
            head.logits(&hd.as_view(), &wd.as_view(), &mut z.as_view_mut(), b, h, vd)
        })?;
        let fl = floor_bytes((vd * h * 2 + b * vd * 4) as f64);
        println!(
            "logits B {b} V {vd}: {ms:.4} ms, {:.2}× the byte floor {fl:.4} ms",
            ms / fl
        );
        let mut tok = g.zeros::<u32>(b)?;
        let mut lpd = g.zeros::<f32>(b)?;
        for (name, p) in [
            (
                "greedy",
                SampleParams {
                    temperature: 0.0,
                    top_p: 1.0,
                    top_k: 0,
                    seed: 1,
                    step: 0,
                },
            ),
            (
                "τ=1",
                SampleParams {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: 0,
                    seed: 1,
                    step: 0,
                },
            ),
            (
                "top-p 0.9 top-k 50",
                SampleParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: 50,
                    seed: 1,
                    step: 0,
                },
            ),
        ] {
            let ms = time(&mut || {
                sampler.sample(
                    &z.as_view(),
                    b,
                    vd,
                    &p,
                    &mut tok.as_view_mut(),
                    &mut lpd.as_view_mut(),
                )
            })?;
            let fl = floor_bytes((b * vd * 4) as f64);
            println!(
                "  sample {name}: {ms:.4} ms, {:.1}× the byte floor {fl:.4} ms",
                ms / fl
            );
        }
    }
    drop(wd);

    // AdamW + grad norm over one 256 M-parameter buffer.
    let n: usize = if quick { 1 << 20 } else { 1 << 28 };
    let ops = Optim::new(&g)?;
    let mut p = g.zeros::<f32>(n)?;
    let gr = g.upload(&vec![1e-3f32; n])?;
    let mut m = g.zeros::<f32>(n)?;
    let mut vv = g.zeros::<f32>(n)?;
    let mut pb = g.zeros::<u16>(n)?;
    let one = g.upload(&[1.0f32])?;
    let cfg = AdamWConfig::default();
    let ms = time(&mut || {
        ops.adamw_step(
            AdamWParam {
                param: &mut p.as_view_mut(),
                grad: &gr.as_view(),
                m: &mut m.as_view_mut(),
                v: &mut vv.as_view_mut(),
                param_bf16: Some(&mut pb.as_view_mut()),
                n,
                weight_decay: 0.01,
            },
            &one.as_view(),
            1,
            &cfg,
        )
    })?;
    let fl = floor_bytes(30.0 * n as f64);
    println!(
        "adamw {n} params: {ms:.3} ms, {:.2}× the byte floor {fl:.3} ms (30 B/param)",
        ms / fl
    );
    let ms = time(&mut || ops.grad_norm(&[gr.as_view()], &[n], Some(1.0)).map(drop))?;
    let fl = floor_bytes(4.0 * n as f64);
    println!(
        "grad norm {n}: {ms:.3} ms, {:.2}× the byte floor {fl:.3} ms",
        ms / fl
    );
    drop((p, gr, m, vv, pb));

    // Embedding backward: 8×512 rows of width 2048 into a 32 000-row table.
    let tokens: Vec<u32> = (0..t).map(|i| ((i * 7919) % v) as u32).collect();
    let eb = EmbedBackward::new(&g)?;
    let grouping = eb.upload(&EmbedGrouping::new(&tokens, v).map_err(|e| g.err(e))?)?;
    let dx = g.zeros::<f32>(t * h)?;
    let mut table = g.zeros::<f32>(v * h)?;
    let ms = time(&mut || eb.run(&mut table.as_view_mut(), v, &dx.as_view(), t, h, &grouping))?;
    let fl = floor_bytes((t * h * 4 * 3) as f64);
    println!(
        "embed backward {t}×{h}: {ms:.4} ms, {:.2}× the byte floor {fl:.4} ms",
        ms / fl
    );
    Ok(())
}
