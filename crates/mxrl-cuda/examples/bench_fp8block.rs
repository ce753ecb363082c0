//! FP8-block decode benchmark on the 2.63 B benchmark config (Qwen3-MoE, hidden 2048,
//! moe_intermediate 768, 64 experts top-8): the routed experts' GEMMs — fused gate/up
//! `[64, 1536, 2048]` and down `[64, 2048, 768]` — at batch 1, 32, 128 and 512 (batch·8 rows,
//! each token sent to 8 distinct uniformly random experts, fixed seed), FP8-block weights
//! (E4M3 codes, 128×128 f32 `scale_inv` tiles) with the tiled kernels (`Fp8Block::gemm_nt`,
//! weights decoded to BF16 in shared memory) against the fragment kernels
//! (`Fp8Block::gemm_nt_frag`, codes streamed straight into mma fragments, both tensor-core
//! variants), beside BF16 weights on the BF16 fragment kernels (`QGemm::grouped_nt_frag_bf16`)
//! and on what the engine's BF16 experts run, all in one run.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_fp8block [-- --reps N]`
//!
//! Every figure is the median of `--reps` (20) calls timed one by one with CUDA events after
//! 3 warm-up calls; L2 is flushed (a 256 MiB memset, outside the timed interval) before each
//! call, so each call reads its weights from device memory as a decode step does. Columns: µs
//! per call; weight MB = bytes of the used experts' weights the kernel must read (FP8 block:
//! codes + f32 scales, 0.50 of BF16's); GB/s = weight MB / time; `×BF16 frag` = time ÷ the
//! BF16 fragment kernel's for the same step and projection, `×BF16 engine` ÷ the BF16 path
//! the engine runs at that batch (fragment kernels up to `QFRAG_ROWS_PER_EXPERT` rows per
//! expert, `Gemm::grouped_nt` above). `+act` rows add the FP8-block activation quantizer
//! (`Fp8Block::quantize_act`, as the engine's forward runs it). A second table times every
//! split of the fragment kernels' reduction (warps per 32-column block; `*` = the launcher's
//! pick); a third the rows per pass.
//!
//! `--staged [--batches 128,512,4096] [--busy]`: only the staged kernels
//! (`QGemm::grouped_nt_staged_fp8_block`, binary16 operands staged in shared memory by
//! `cp.async`, 128 columns per block) in passes of 16, 32 and 64 rows (`*` = the launcher's
//! pick) against the fragment and tiled kernels, each with its activation quantizer
//! (`--busy`: one of every token's 8 rows to expert 0, the routing of the RL runs); then the
//! layer's dense attention linears (q, k, v on one input; o) at 64, 512 and 4096 rows: tiled, staged
//! one launch per weight, and `QGemm::dense_nt_staged_fp8_block_multi_with` for every stage
//! count.

#[cfg(feature = "cuda")]
#[path = "common/bench.rs"]
mod common;

#[cfg(feature = "cuda")]
mod bench {
    use super::common::*;
    use cudarc::driver::CudaSlice;
    use mxrl_cuda::backend::QFRAG_ROWS_PER_EXPERT;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::fp8block::{fp8_frag_split, Fp8Block, Fp8FragMma, FRAG_ROWS_PER_EXPERT};
    use mxrl_cuda::ops::gemm::{Gemm, Grouped};
    use mxrl_cuda::ops::qgemm::{
        frag_rows, FragRows, QGemm, FP8_DENSE_STAGES_PICK, FP8_ROUTED_STAGES_PICK, FP8_STAGES,
    };

    const BATCHES: [usize; 4] = [1, 32, 128, 512];
    /// Rows of the dense linears' table: decode batches of 64 and 512, a prefill-sized call.
    const DENSE_ROWS: [usize; 3] = [64, 512, 4096];
    const SPLITS: [usize; 6] = [1, 2, 3, 4, 6, 8];

    /// Stored weights of one projection: BF16 values in ±[0.25, 2), and FP8 block — E4M3 codes
    /// without NaN, `scale_inv` tiles of ordinary magnitude (2⁻⁸ · [1, 2)).
    struct Weights {
        bf16: CudaSlice<u16>,
        codes: CudaSlice<u8>,
        scales: CudaSlice<u8>,
    }

    fn weights(g: &Gpu, n: usize, k: usize, seed: u64) -> Weights {
        let len = EXPERTS * n * k;
        let b = bytes(2 * len, seed, |b| b);
        let bf16: Vec<u16> = b
            .chunks(2)
            .map(|p| {
                let exp = if p[1] & 1 == 0 { 125u16 } else { 127 };
                (u16::from(p[1] >> 7) << 15) | (exp << 7) | u16::from(p[0] & 0x7F)
            })
            .collect();
        let tiles = EXPERTS * (n / 128) * (k / 128);
        let scales: Vec<u8> = bytes(tiles, seed + 2, |b| b)
            .into_iter()
            .flat_map(|b| (2f32.powi(-8) * (1.0 + f32::from(b) / 256.0)).to_le_bytes())
            .collect();
        Weights {
            bf16: g.upload(&bf16).expect("upload"),
            codes: g
                .upload(&bytes(len, seed + 1, |b| {
                    if b & 0x7F == 0x7F {
                        b - 1
                    } else {
                        b
                    }
                }))
                .expect("upload"),
            scales: g.upload(&scales).expect("upload"),
        }
    }

    /// One dense FP8-block weight `[n, k]` (E = 1) as [`weights`] makes them.
    fn dense_weight(g: &Gpu, n: usize, k: usize, seed: u64) -> Weights {
        let len = n * k;
        let tiles = (n / 128) * (k / 128);
        let scales: Vec<u8> = bytes(tiles, seed + 2, |b| b)
            .into_iter()
            .flat_map(|b| (2f32.powi(-8) * (1.0 + f32::from(b) / 256.0)).to_le_bytes())
            .collect();
        Weights {
            bf16: g.zeros::<u16>(1).expect("alloc"),
            codes: g
                .upload(&bytes(len, seed + 1, |b| {
                    if b & 0x7F == 0x7F {
                        b - 1
                    } else {
                        b
                    }
                }))
                .expect("upload"),
            scales: g.upload(&scales).expect("upload"),
        }
    }

    struct Row {
        step: String,
        op: String,
        us: f64,
        bytes: f64,
        frag_us: f64,
        engine_us: f64,
    }

    /// `--staged`: the staged kernels against the fragment and tiled ones (module doc).
    #[allow(clippy::too_many_arguments)]
    fn staged(
        g: &Gpu,
        q: &QGemm,
        f8: &Fp8Block,
        flush: &mut CudaSlice<u8>,
        reps: usize,
        batches: &[usize],
        busy: bool,
    ) {
        let max_rows = batches.iter().copied().max().unwrap_or(0) * TOP_K;
        let kmax = HIDDEN.max(MOE_INTER);
        let xf: Vec<f32> = mxrl_tensor::gradcheck::test_values(max_rows * kmax, 5, 3.0);
        let x = g.upload(&xf).expect("upload x");
        let mut xh = g.zeros::<u16>(max_rows * kmax).expect("alloc");
        let mut xhs = g.zeros::<f32>(max_rows * kmax / 128).expect("alloc");
        let mut y = g
            .zeros::<f32>(max_rows * HIDDEN.max(2 * MOE_INTER))
            .expect("alloc");
        println!(
            "\n| step | R16 staged µs | R32 staged | R64 staged | R64, 4 stages | R64, 6 stages | fragments (F16, pick) | tiled | act u8 | act f16 | staged+act ÷ fragments+act | ÷ tiled+act |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (pi, &(name, n, k)) in PROJS.iter().enumerate() {
            let w = weights(g, n, k, 10 * pi as u64 + 1);
            let (wc, wsc) = (w.codes.as_view(), w.scales.as_view());
            for &batch in batches {
                let counts = match busy {
                    true => route_busy(batch, 100 + batch as u64),
                    false => route(batch, 100 + batch as u64),
                };
                let r = batch * TOP_K;
                let most = counts.iter().max().copied().unwrap_or(0);
                let off = g.upload(&offsets(&counts)).expect("offsets");
                let s = Grouped {
                    experts: EXPERTS,
                    rows: r,
                    n,
                    k,
                };
                let xv = x.slice(0..r * k);
                let act_u8 = median_us(g, flush, reps, || {
                    f8.quantize_act(&xv, r, k).expect("act FP8 block");
                });
                let act_f16 = median_us(g, flush, reps, || {
                    q.quant_act_fp8_block(
                        &xv,
                        r,
                        k,
                        false,
                        &mut xh.slice_mut(0..r * k),
                        &mut xhs.slice_mut(0..r * k / 128),
                    )
                    .expect("act FP8 block f16");
                });
                let qx = f8.quantize_act(&xv, r, k).expect("act FP8 block");
                let (xc, xs) = (qx.codes.as_view(), qx.scales.as_view());
                let pick = frag_rows(s, None);
                let mut cells = Vec::new();
                let mut pick_us = f64::NAN;
                for (rows, stages) in [
                    (FragRows::R16, 3),
                    (FragRows::R32, 3),
                    (FragRows::R64, 3),
                    (FragRows::R64, 4),
                    (FragRows::R64, 6),
                ] {
                    let us = median_us(g, flush, reps, || {
                        q.grouped_nt_staged_fp8_block_with(
                            rows,
                            stages,
                            &xh.slice(0..r * k),
                            &xhs.slice(0..r * k / 128),
                            &wc,
                            &wsc,
                            &off.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .expect("staged FP8 block");
                    });
                    let picked = rows == pick && stages == FP8_ROUTED_STAGES_PICK;
                    if picked {
                        pick_us = us;
                    }
                    cells.push(format!("{us:.1}{}", if picked { "*" } else { "" }));
                }
                let frag = median_us(g, flush, reps, || {
                    f8.gemm_nt_frag(&xc, &xs, &wc, &wsc, &off.as_view(), &mut y.as_view_mut(), s)
                        .expect("FP8-block fragments");
                });
                let tiled = median_us(g, flush, reps, || {
                    f8.gemm_nt(
                        &xc,
                        &xs,
                        &wc,
                        &wsc,
                        Some(&off.as_view()),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("FP8-block tiled");
                });
                println!(
                    "| b={batch} ({r} rows, ≤ {most} per expert) {name} | {} | {frag:.1} | {tiled:.1} | {act_u8:.1} | {act_f16:.1} | {:.2} | {:.2} |",
                    cells.join(" | "),
                    (pick_us + act_f16) / (frag + act_u8),
                    (pick_us + act_f16) / (tiled + act_u8)
                );
            }
        }
        // Dense attention linears of the benchmark layer (q [4096, 2048], k and v [512, 2048]
        // on one input; o [2048, 4096]): the tiled kernels per weight against the staged ones,
        // per weight (three stages) and in one launch for every stage count.
        println!(
            "\n| rows | weights | tiled µs | staged, one launch per weight | one launch, {} stages |\n|---|---|---:|---:|{}",
            FP8_STAGES.map(|s| s.to_string()).join(" / "),
            "---:|".repeat(FP8_STAGES.len())
        );
        let whole = g.upload(&[0u32, u32::MAX]).expect("upload");
        // Their own activations: up to the largest row count at k = 4096.
        let dmax = DENSE_ROWS[DENSE_ROWS.len() - 1] * 4096;
        let xd = g
            .upload(&mxrl_tensor::gradcheck::test_values(dmax, 6, 3.0))
            .expect("upload x");
        let mut xdh = g.zeros::<u16>(dmax).expect("alloc");
        let mut xdhs = g.zeros::<f32>(dmax / 128).expect("alloc");
        for (label, k, ns) in [
            ("q, k, v", HIDDEN, vec![4096usize, 512, 512]),
            ("o", 4096, vec![HIDDEN]),
        ] {
            let ws: Vec<Weights> = ns
                .iter()
                .enumerate()
                .map(|(i, &n)| dense_weight(g, n, k, 70 + i as u64))
                .collect();
            for &rows in &DENSE_ROWS {
                let xv = xd.slice(0..rows * k);
                let qx = f8.quantize_act(&xv, rows, k).expect("act FP8 block");
                q.quant_act_fp8_block(
                    &xv,
                    rows,
                    k,
                    false,
                    &mut xdh.slice_mut(0..rows * k),
                    &mut xdhs.slice_mut(0..rows * k / 128),
                )
                .expect("act FP8 block f16");
                let mut ys: Vec<CudaSlice<f32>> = ns
                    .iter()
                    .map(|&n| g.zeros::<f32>(rows * n).expect("alloc"))
                    .collect();
                let shape = |n: usize| Grouped {
                    experts: 1,
                    rows,
                    n,
                    k,
                };
                let tiled = median_us(g, flush, reps, || {
                    for (w, (y, &n)) in ws.iter().zip(ys.iter_mut().zip(&ns)) {
                        f8.gemm_nt(
                            &qx.codes.as_view(),
                            &qx.scales.as_view(),
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            None,
                            &mut y.as_view_mut(),
                            shape(n),
                        )
                        .expect("tiled");
                    }
                });
                let single = median_us(g, flush, reps, || {
                    for (w, (y, &n)) in ws.iter().zip(ys.iter_mut().zip(&ns)) {
                        q.grouped_nt_staged_fp8_block(
                            &xdh.slice(0..rows * k),
                            &xdhs.slice(0..rows * k / 128),
                            &w.codes.as_view(),
                            &w.scales.as_view(),
                            &whole.as_view(),
                            &mut y.as_view_mut(),
                            shape(n),
                        )
                        .expect("staged");
                    }
                });
                let mut cells = Vec::new();
                for st in FP8_STAGES {
                    let us = median_us(g, flush, reps, || {
                        let mut outs: Vec<_> = ws
                            .iter()
                            .zip(ys.iter_mut().zip(&ns))
                            .map(|(w, (y, &n))| {
                                (w.codes.as_view(), w.scales.as_view(), y.as_view_mut(), n)
                            })
                            .collect();
                        q.dense_nt_staged_fp8_block_multi_with(
                            st,
                            &xdh.slice(0..rows * k),
                            &xdhs.slice(0..rows * k / 128),
                            &whole.as_view(),
                            &mut outs,
                            rows,
                            k,
                        )
                        .expect("staged, one launch");
                    });
                    cells.push(format!(
                        "{us:.1}{}",
                        if st == FP8_DENSE_STAGES_PICK { "*" } else { "" }
                    ));
                }
                println!(
                    "| {rows} | {label} | {tiled:.1} | {single:.1} | {} |",
                    cells.join(" | ")
                );
            }
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        let reps = args
            .iter()
            .position(|a| a == "--reps")
            .map(|i| args[i + 1].parse().expect("--reps N"))
            .unwrap_or(20usize);
        let g = Gpu::shared(0).expect("GPU 0");
        let gemm = Gemm::new(&g).expect("GEMM kernels");
        let q = QGemm::new(&g).expect("low-byte kernels");
        let f8 = Fp8Block::new(&g).expect("FP8-block kernels");
        assert!(
            f8.frag_supported(),
            "the FP8-block fragment kernels need sm_89+"
        );
        println!(
            "# bench_fp8block on {} — hidden {HIDDEN}, moe_intermediate {MOE_INTER}, {EXPERTS} experts top-{TOP_K}; median of {reps} calls after warm-up, L2 flushed before each; the engine runs the fragment kernels up to {FRAG_ROWS_PER_EXPERT} rows per expert",
            g.name()
        );
        let mut flush = g.zeros::<u8>(FLUSH_BYTES).expect("flush buffer");
        if args.iter().any(|a| a == "--staged") {
            let batches: Vec<usize> = args
                .iter()
                .position(|a| a == "--batches")
                .map(|i| {
                    args[i + 1]
                        .split(',')
                        .map(|b| b.parse().expect("--batches B,B,..."))
                        .collect()
                })
                .unwrap_or_else(|| vec![128, 512, 4096]);
            let busy = args.iter().any(|a| a == "--busy");
            staged(&g, &q, &f8, &mut flush, reps, &batches, busy);
            return;
        }
        print_copy_bandwidth(&g, &mut flush, reps);

        let projs = PROJS;
        let ws: Vec<Weights> = projs
            .iter()
            .enumerate()
            .map(|(i, &(_, n, k))| weights(&g, n, k, 10 * i as u64 + 1))
            .collect();
        let max_rows = BATCHES[BATCHES.len() - 1] * TOP_K;
        let kmax = HIDDEN.max(MOE_INTER);
        let xf: Vec<f32> = mxrl_tensor::gradcheck::test_values(max_rows * kmax, 5, 3.0);
        let x = g.upload(&xf).expect("upload x");
        let xb = g.zeros::<u16>(max_rows * kmax).expect("alloc");
        let mut y = g
            .zeros::<f32>(max_rows * HIDDEN.max(2 * MOE_INTER))
            .expect("alloc");

        let mut rows = Vec::new();
        let mut split_rows = Vec::new();
        let mut pass_rows = Vec::new();
        for batch in BATCHES {
            let counts = route(batch, 100 + batch as u64);
            let used = counts.iter().filter(|&&c| c > 0).count();
            let r = batch * TOP_K;
            let off = g.upload(&offsets(&counts)).expect("offsets");
            for (pi, &(name, n, k)) in projs.iter().enumerate() {
                let w = &ws[pi];
                let s = Grouped {
                    experts: EXPERTS,
                    rows: r,
                    n,
                    k,
                };
                let step = format!("b={batch} ({r} rows, {used} experts) {name} N={n} K={k}");
                let frag_rows = FragRows::for_rows(r, EXPERTS, FragRows::R32);
                let bf16_bytes = (used * n * k * 2) as f64;
                let f8_bytes = (used * (n * k + 4 * (n / 128) * (k / 128))) as f64;
                // BF16 weights: the fragment kernels, and the engine's BF16 expert path.
                let bf16_frag = median_us(&g, &mut flush, reps, || {
                    q.grouped_nt_frag_bf16(
                        &xb.as_view(),
                        &w.bf16.as_view(),
                        &off.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("BF16 fragments");
                });
                let bf16_grouped = median_us(&g, &mut flush, reps, || {
                    gemm.grouped_nt(
                        &xb.as_view(),
                        &w.bf16.as_view(),
                        &off.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("BF16 grouped_nt");
                });
                let engine_frag = r <= QFRAG_ROWS_PER_EXPERT * EXPERTS;
                let engine_us = if engine_frag { bf16_frag } else { bf16_grouped };
                // FP8 block: the activation quantizer, then the kernels on its output.
                let xv = x.slice(0..r * k);
                let act = median_us(&g, &mut flush, reps, || {
                    f8.quantize_act(&xv, r, k).expect("act FP8 block");
                });
                let qx = f8.quantize_act(&xv, r, k).expect("act FP8 block");
                let (xc, xs) = (qx.codes.as_view(), qx.scales.as_view());
                let (wc, wsc) = (w.codes.as_view(), w.scales.as_view());
                let tiled = median_us(&g, &mut flush, reps, || {
                    f8.gemm_nt(
                        &xc,
                        &xs,
                        &wc,
                        &wsc,
                        Some(&off.as_view()),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("FP8-block tiled");
                });
                let pick = fp8_frag_split(s);
                let mut row = |op: String, us: f64, bytes: f64| {
                    rows.push(Row {
                        step: step.clone(),
                        op,
                        us,
                        bytes,
                        frag_us: bf16_frag,
                        engine_us,
                    })
                };
                row(
                    format!("BF16 fragments ({frag_rows:?})"),
                    bf16_frag,
                    bf16_bytes,
                );
                row("BF16 grouped_nt".into(), bf16_grouped, bf16_bytes);
                row("FP8-block tiled".into(), tiled, f8_bytes);
                row("FP8-block tiled +act".into(), tiled + act, f8_bytes);
                for mma in Fp8FragMma::ALL {
                    let frag = |split: usize, rows: FragRows, y: &mut CudaSlice<f32>| {
                        f8.gemm_nt_frag_with(
                            mma,
                            rows,
                            split,
                            &xc,
                            &xs,
                            &wc,
                            &wsc,
                            &off.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .expect("FP8-block fragments");
                    };
                    let mut times = Vec::new();
                    for split in SPLITS {
                        times.push((
                            split,
                            median_us(&g, &mut flush, reps, || frag(split, frag_rows, &mut y)),
                        ));
                    }
                    let us = times.iter().find(|(k, _)| *k == pick).expect("pick").1;
                    row(
                        format!("FP8-block fragments {mma:?} ({frag_rows:?}, split {pick})"),
                        us,
                        f8_bytes,
                    );
                    row(
                        format!("FP8-block fragments {mma:?} +act"),
                        us + act,
                        f8_bytes,
                    );
                    split_rows.push((step.clone(), mma, pick, times));
                    let passes: Vec<(FragRows, f64)> = mxrl_cuda::ops::fp8block::FRAG_PASSES
                        .iter()
                        .map(|&fr| {
                            (
                                fr,
                                median_us(&g, &mut flush, reps, || frag(pick, fr, &mut y)),
                            )
                        })
                        .collect();
                    pass_rows.push((step.clone(), mma, frag_rows, passes));
                }
            }
        }

        println!(
            "\n| step | kernel | µs | weight MB | GB/s | ×BF16 frag | ×BF16 engine |\n|---|---|---:|---:|---:|---:|---:|"
        );
        for r in &rows {
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {:.2} |",
                r.step,
                r.op,
                r.us,
                r.bytes / 1e6,
                r.bytes / (r.us * 1e-6) / 1e9,
                r.us / r.frag_us,
                r.us / r.engine_us
            );
        }
        let head: Vec<String> = SPLITS.iter().map(|s| format!("split {s} µs")).collect();
        println!(
            "\n| step | mma | {} |\n|---|---|{}",
            head.join(" | "),
            "---:|".repeat(SPLITS.len())
        );
        for (step, mma, pick, times) in &split_rows {
            let cells: Vec<String> = times
                .iter()
                .map(|(k, t)| format!("{t:.1}{}", if k == pick { "*" } else { "" }))
                .collect();
            println!("| {step} | {mma:?} | {} |", cells.join(" | "));
        }
        println!("\n| step | mma | R8 µs | R16 µs | R32 µs |\n|---|---|---:|---:|---:|");
        for (step, mma, pick, times) in &pass_rows {
            let cells: Vec<String> = times
                .iter()
                .map(|(fr, t)| format!("{t:.1}{}", if fr == pick { "*" } else { "" }))
                .collect();
            println!("| {step} | {mma:?} | {} |", cells.join(" | "));
        }
    }
}

#[cfg(feature = "cuda")]
fn main() {
    bench::main();
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_fp8block needs --features cuda");
    std::process::exit(2);
}
