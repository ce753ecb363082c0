//! Low-byte decode benchmark on the 2.63 B benchmark config (Qwen3-MoE, hidden 2048,
//! moe_intermediate 768, 64 experts top-8): the routed experts' decode GEMMs — fused gate/up
//! `[64, 1536, 2048]` and down `[64, 2048, 768]` — at batch 1, 32 and 128 (batch·8 rows,
//! each token sent to 8 distinct uniformly random experts, fixed seed), on BF16 weights
//! (`Gemm::grouped_nt_small_m`) against MXFP8 and NVFP4 weights read as stored
//! (`QGemm::grouped_nt_small_m_{mxfp8,nvfp4}`, the tensor-core kernels with weights decoded in
//! shared memory `grouped_nt_tc_*` and straight into mma fragments `grouped_nt_frag_*`), plus
//! the activation quantizers that feed the low-byte kernels, all in one run.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_qgemm [-- --reps N] [--large]`
//! (`--large`: only the table of decode batches of 128–1024 sequences, see `large`;
//! `--large --batches 2048,4096 [--busy]`: other batch sizes, one busy expert; `--dense`: only
//! the attention's dense projections at 3–128 rows, cuBLAS against the fragment kernels;
//! `--frag [--batches 8,32]`: only the routed experts' fragment kernels, every split)
//!
//! Every figure is the median of `--reps` (20) calls timed one by one with CUDA events after
//! 3 warm-up calls; L2 is flushed (a 256 MiB memset, outside the timed interval) before each
//! call, so each call reads its weights from device memory as a decode step does (every layer's
//! experts are read once per step). Columns: µs per call; weight MB = bytes of the used
//! experts' weights the kernel must read (codes + scales (+ amax)); GB/s = weight MB / time;
//! `×BF16 small-M` = time ÷ the BF16 small-M kernel's time for the same step and projection,
//! `×BF16 tiled` ÷ the BF16 tensor-core tiled kernel's (byte ratios: MXFP8 0.52, NVFP4 0.28). `+act` rows add the activation quantizer of that format; the
//! `BF16 grouped_nt` row is what the engine's BF16 experts run (the launcher's path choice).
//! A second table times each lane split (`QLanes`) of the low-byte kernels; `*` marks the
//! launcher's pick.

#[cfg(feature = "cuda")]
#[path = "common/bench.rs"]
mod common;

#[cfg(feature = "cuda")]
mod bench {
    use super::common::*;
    use cudarc::driver::CudaSlice;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::gemm::{Gemm, Grouped};
    use mxrl_cuda::ops::qgemm::{
        frag_layout, frag_row_bytes, frag_rows, frag_split, FragLayout, FragRows, LowByte,
        Mxfp8Decode, QGemm, QLanes,
    };

    /// Stored weights of one projection in every format (random but valid values: BF16 in
    /// ±[0.25, 2), E4M3 codes without NaN, scale bytes of ordinary magnitude).
    struct Weights {
        bf16: CudaSlice<u16>,
        mx_codes: CudaSlice<u8>,
        mx_scales: CudaSlice<u8>,
        nv_codes: CudaSlice<u8>,
        nv_scales: CudaSlice<u8>,
        nv_amax: CudaSlice<f32>,
    }

    /// `len` random BF16 bit patterns with values in ±[0.25, 2).
    fn bf16_bits(len: usize, seed: u64) -> Vec<u16> {
        bytes(2 * len, seed, |b| b)
            .chunks(2)
            .map(|p| {
                let exp = if p[1] & 1 == 0 { 125u16 } else { 127 };
                (u16::from(p[1] >> 7) << 15) | (exp << 7) | u16::from(p[0] & 0x7F)
            })
            .collect()
    }

    fn weights(g: &Gpu, n: usize, k: usize, seed: u64) -> Weights {
        let len = EXPERTS * n * k;
        let bf16 = bf16_bits(len, seed);
        let up = |v: &[u8]| g.upload(v).expect("upload");
        Weights {
            bf16: g.upload(&bf16).expect("upload"),
            mx_codes: up(&bytes(len, seed + 1, |b| {
                if b & 0x7F == 0x7F {
                    b - 1
                } else {
                    b
                }
            })),
            mx_scales: up(&bytes(len / 32, seed + 2, |b| 112 + (b & 7))),
            nv_codes: up(&bytes(len / 2, seed + 3, |b| b)),
            nv_scales: up(&bytes(len / 16, seed + 4, |b| 0x30 + (b & 0x1F))),
            nv_amax: g.upload(&vec![1.0f32; EXPERTS]).expect("upload"),
        }
    }

    struct Row {
        step: String,
        op: String,
        us: f64,
        bytes: f64,
        bf16_us: f64,
        tiled_us: f64,
    }

    /// One call of the fragment kernel for `fmt` ("BF16", "Mxfp8", "Mxfp8 fast" — the fast
    /// decode, these weights being eligible — or "Nvfp4") with `rows` per pass and `split`
    /// warps per block, on the activations `xq` (`xamax` for NVFP4).
    #[allow(clippy::too_many_arguments)]
    fn frag_call(
        q: &QGemm,
        fmt: &str,
        rows: FragRows,
        split: FragLayout,
        xq: &CudaSlice<u16>,
        xamax: &CudaSlice<f32>,
        w: &Weights,
        off: &CudaSlice<u32>,
        y: &mut CudaSlice<f32>,
        s: Grouped,
    ) {
        let (xv, ov) = (xq.as_view(), off.as_view());
        let mut yv = y.as_view_mut();
        match fmt {
            "BF16" => {
                q.grouped_nt_frag_bf16_with(rows, split, &xv, &w.bf16.as_view(), &ov, &mut yv, s)
            }
            "Mxfp8" | "Mxfp8 fast" => q.grouped_nt_frag_mxfp8_decode_with(
                if fmt == "Mxfp8" {
                    Mxfp8Decode::General
                } else {
                    Mxfp8Decode::Fast
                },
                rows,
                split,
                &xv,
                &w.mx_codes.as_view(),
                &w.mx_scales.as_view(),
                &ov,
                &mut yv,
                s,
            ),
            _ => q.grouped_nt_frag_nvfp4_with(
                rows,
                split,
                &xv,
                &xamax.as_view(),
                &w.nv_codes.as_view(),
                &w.nv_scales.as_view(),
                &w.nv_amax.as_view(),
                &ov,
                &mut yv,
                s,
            ),
        }
        .expect("fragments");
    }

    /// The block format of a weights label (`None`: BF16).
    fn low_byte(fmt: &str) -> Option<LowByte> {
        match fmt {
            "BF16" => None,
            "Mxfp8" | "Mxfp8 fast" => Some(LowByte::Mxfp8),
            _ => Some(LowByte::Nvfp4),
        }
    }

    /// The fragment kernels' layout for `fmt`'s weights at `rows` rows per pass.
    fn split_for(fmt: &str, s: Grouped, rows: FragRows) -> FragLayout {
        frag_layout(s, low_byte(fmt), rows)
    }

    /// The buffers the fragment kernels' tables share: activations for `max_rows` rows of up
    /// to the widest K, quantized as the NVFP4 kernels take them (binary16 operand values, and
    /// the rows' amax; the other formats read the same bits, and no kernel's time depends on
    /// the values), and an f32 output wide enough for either projection.
    struct FragBuffers {
        xq: CudaSlice<u16>,
        xamax: CudaSlice<f32>,
        y: CudaSlice<f32>,
    }

    fn frag_buffers(g: &Gpu, q: &QGemm, max_rows: usize) -> FragBuffers {
        let kmax = HIDDEN.max(MOE_INTER);
        let xf: Vec<f32> = mxrl_tensor::gradcheck::test_values(max_rows * kmax, 5, 3.0);
        let x = g.upload(&xf).expect("upload x");
        let mut xq = g.zeros::<u16>(max_rows * kmax).expect("alloc");
        let mut xamax = g.zeros::<f32>(max_rows).expect("alloc");
        q.quant_act_nvfp4_f16(
            &x.as_view(),
            max_rows,
            kmax,
            &mut xq.as_view_mut(),
            &mut xamax.as_view_mut(),
        )
        .expect("act NVFP4 (binary16)");
        let y = g
            .zeros::<f32>(max_rows * HIDDEN.max(2 * MOE_INTER))
            .expect("alloc");
        FragBuffers { xq, xamax, y }
    }

    /// `--large`: decode batches of 128, 256, 512 and 1024 sequences (16, 32, 64 and 128 rows
    /// per expert on average): the fragment kernels in passes of 16, 32 and 64 rows, each with
    /// the reduction split ([`frag_split`]) and staged ([`FragLayout::Staged`]), the
    /// launchers' pick starred, against the path they replace above 32 rows per expert — the
    /// stored experts dequantized to BF16 (every expert, each step) and the tiled BF16 kernels.
    ///
    /// `batches` replaces the four batch sizes (`--batches 2048,4096`: prefill-sized groups);
    /// `busy` routes one of every token's 8 rows to expert 0 and the other 7 to distinct
    /// random experts among the rest (`--busy`: the pattern the RL runs' routing shows, one
    /// expert with 1/8 of the rows).
    fn large(
        g: &Gpu,
        gemm: &Gemm,
        q: &QGemm,
        flush: &mut CudaSlice<u8>,
        reps: usize,
        batches: &[usize],
        busy: bool,
    ) {
        let projs = PROJS;
        let max_rows = batches.iter().copied().max().unwrap_or(0) * TOP_K;
        let FragBuffers { xq, xamax, mut y } = frag_buffers(g, q, max_rows);
        let mut wb = g
            .zeros::<u16>(EXPERTS * 2 * MOE_INTER * HIDDEN)
            .expect("alloc");
        println!(
            "\n| step | weights | R16 split µs | R16 staged | R32 split | R32 staged | R64 split | R64 staged | dequantize + tiled µs | launchers' pick ÷ dequantized |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (pi, &(name, n, k)) in projs.iter().enumerate() {
            let w = weights(g, n, k, 10 * pi as u64 + 1);
            // The "Mxfp8 fast" rows time the decode the engine takes for such weights.
            let fast_ok = q
                .mxfp8_fast_check(&w.mx_codes.as_view(), &w.mx_scales.as_view())
                .expect("mxfp8_fast_check");
            assert!(
                fast_ok,
                "{name}: benchmark weights not eligible for the fast MXFP8 decode"
            );
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
                let step = format!("b={batch} ({r} rows, ≤ {most} per expert) {name}");
                for fmt in ["BF16", "Mxfp8", "Mxfp8 fast", "Nvfp4"] {
                    let f = low_byte(fmt);
                    let pick_rows = frag_rows(s, f);
                    let pick = (pick_rows, split_for(fmt, s, pick_rows));
                    let mut cells = Vec::new();
                    let mut pick_us = f64::NAN;
                    for rows in [FragRows::R16, FragRows::R32, FragRows::R64] {
                        let split = match split_for(fmt, s, rows) {
                            FragLayout::Staged => {
                                FragLayout::Split(frag_split(s, frag_row_bytes(f, k)))
                            }
                            l => l,
                        };
                        for layout in [split, FragLayout::Staged] {
                            let us = median_us(g, flush, reps, || {
                                frag_call(q, fmt, rows, layout, &xq, &xamax, &w, &off, &mut y, s)
                            });
                            let star = if (rows, layout) == pick {
                                pick_us = us;
                                "*"
                            } else {
                                ""
                            };
                            cells.push(format!("{us:.1}{star}"));
                        }
                    }
                    let deq = median_us(g, flush, reps, || {
                        let len = EXPERTS * n * k;
                        let mut out = wb.slice_mut(0..len);
                        match fmt {
                            "BF16" => Ok(()),
                            "Mxfp8" | "Mxfp8 fast" => q.dequant_weights_mxfp8(
                                &w.mx_codes.as_view(),
                                &w.mx_scales.as_view(),
                                &mut out,
                                EXPERTS,
                                n,
                                k,
                            ),
                            _ => q.dequant_weights_nvfp4(
                                &w.nv_codes.as_view(),
                                &w.nv_scales.as_view(),
                                &mut out,
                                EXPERTS,
                                n,
                                k,
                            ),
                        }
                        .expect("dequantize");
                        let wv = if fmt == "BF16" {
                            w.bf16.as_view()
                        } else {
                            wb.slice(0..len)
                        };
                        gemm.grouped_nt_tiled(
                            &xq.as_view(),
                            &wv,
                            &off.as_view(),
                            &mut y.as_view_mut(),
                            s,
                        )
                        .expect("tiled");
                    });
                    println!(
                        "| {step} | {fmt} | {} | {deq:.1} | {:.2} |",
                        cells.join(" | "),
                        pick_us / deq
                    );
                }
            }
        }
    }

    /// `--frag`: only the routed experts' fragment kernels at decode batches `batches` (8 and
    /// 32 unless `--batches`): BF16, MXFP8 (fast decode) and NVFP4 weights, every split of the
    /// reduction and the staged layout, the launchers' pick starred; GB/s of the used experts'
    /// weight bytes. Few launches, so it can run under a profiler.
    fn frag_only(g: &Gpu, q: &QGemm, flush: &mut CudaSlice<u8>, reps: usize, batches: &[usize]) {
        let max_rows = batches.iter().copied().max().unwrap_or(0) * TOP_K;
        let FragBuffers { xq, xamax, mut y } = frag_buffers(g, q, max_rows);
        println!(
            "\n| step | weights | split 1 µs | 2 | 4 | 8 | staged | pick GB/s |\n|---|---|---:|---:|---:|---:|---:|---:|"
        );
        for (pi, &(name, n, k)) in PROJS.iter().enumerate() {
            let w = weights(g, n, k, 10 * pi as u64 + 1);
            for &batch in batches {
                let counts = route(batch, 100 + batch as u64);
                let used = counts.iter().filter(|&&c| c > 0).count();
                let r = batch * TOP_K;
                let off = g.upload(&offsets(&counts)).expect("offsets");
                let s = Grouped {
                    experts: EXPERTS,
                    rows: r,
                    n,
                    k,
                };
                for fmt in ["BF16", "Mxfp8 fast", "Nvfp4"] {
                    let f = low_byte(fmt);
                    let rows = frag_rows(s, f);
                    let pick = split_for(fmt, s, rows);
                    let bytes = used
                        * match f {
                            None => 2 * n * k,
                            Some(f) => f.weight_bytes(n, k),
                        };
                    let mut cells = Vec::new();
                    let mut pick_us = f64::NAN;
                    let layouts = [1usize, 2, 4, 8]
                        .map(FragLayout::Split)
                        .into_iter()
                        .chain([FragLayout::Staged]);
                    for layout in layouts {
                        let us = median_us(g, flush, reps, || {
                            frag_call(q, fmt, rows, layout, &xq, &xamax, &w, &off, &mut y, s)
                        });
                        let star = if layout == pick {
                            pick_us = us;
                            "*"
                        } else {
                            ""
                        };
                        cells.push(format!("{us:.1}{star}"));
                    }
                    println!(
                        "| b={batch} ({r} rows, {used} experts) {name} | {fmt} ({rows:?}) | {} | {:.0} |",
                        cells.join(" | "),
                        bytes as f64 / pick_us / 1e3
                    );
                }
            }
        }
    }

    /// `--dense`: the dense projections of a decode step of the benchmark model (q, k, v
    /// `[2048 | 512 | 512, 2048]` on one input; o `[2048, 2048]`; the router `[64, 2048]`;
    /// the lm_head `[32000, 2048]`) at 3–128 rows:
    /// cuBLAS (`Gemm::dense_nt`, one GEMM per weight: the engine's path for them before)
    /// against the fragment kernels' dense launch (`QGemm::dense_nt_frag_bf16_multi`, q, k
    /// and v in one launch) at each split of the reduction, the launcher's pick starred, and
    /// a device copy of the weight bytes (read + write: the memory floor's upper side).
    fn dense(g: &Gpu, gemm: &Gemm, q: &QGemm, flush: &mut CudaSlice<u8>, reps: usize) {
        use mxrl_cuda::ops::qgemm::dense_frag_plan;
        const Q: usize = 2048;
        const KV: usize = 512;
        let k = HIDDEN;
        let bf = |n: usize, seed: u64| g.upload(&bf16_bits(n, seed)).expect("upload");
        const ROUTER: usize = EXPERTS;
        const VOCAB: usize = 32_000;
        let (wq, wk, wv, wo) = (bf(Q * k, 1), bf(KV * k, 2), bf(KV * k, 3), bf(Q * k, 4));
        let (wr, wh) = (bf(ROUTER * k, 6), bf(VOCAB * k, 7));
        let max_rows = 128;
        let x = bf(max_rows * k, 5);
        let whole = g.upload(&[0u32, u32::MAX]).expect("upload");
        let (mut yq, mut yk, mut yv, mut yh) = (
            g.zeros::<f32>(max_rows * Q).expect("alloc"),
            g.zeros::<f32>(max_rows * KV).expect("alloc"),
            g.zeros::<f32>(max_rows * KV).expect("alloc"),
            g.zeros::<f32>(max_rows * VOCAB).expect("alloc"),
        );
        println!(
            "\n| rows | projection | weight MB | copy µs | cuBLAS µs | split 1 | 2 | 4 | 8 | 16 | pick GB/s | pick ÷ cuBLAS |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for m in [3usize, 4, 8, 16, 32, 64, 128] {
            for proj in ["q, k, v", "o", "router", "lm_head"] {
                let (ws, ns): (Vec<&CudaSlice<u16>>, Vec<usize>) = match proj {
                    "o" => (vec![&wo], vec![Q]),
                    "router" => (vec![&wr], vec![ROUTER]),
                    "lm_head" => (vec![&wh], vec![VOCAB]),
                    _ => (vec![&wq, &wk, &wv], vec![Q, KV, KV]),
                };
                let total: usize = ns.iter().sum();
                let bytes = 2 * total * k;
                let src = g.zeros::<u8>(bytes).expect("alloc");
                let mut dst = g.zeros::<u8>(bytes).expect("alloc");
                let copy = median_us(g, flush, reps, || {
                    g.stream().memcpy_dtod(&src, &mut dst).expect("copy");
                });
                let xv = x.slice(0..m * k);
                let mut ys: Vec<&mut CudaSlice<f32>> = if ns.len() == 1 {
                    vec![&mut yh]
                } else {
                    vec![&mut yq, &mut yk, &mut yv]
                };
                let cublas = median_us(g, flush, reps, || {
                    for ((w, &n), y) in ws.iter().zip(&ns).zip(ys.iter_mut()) {
                        gemm.dense_nt(&xv, &w.as_view(), &mut y.slice_mut(0..m * n), m, n, k)
                            .expect("cuBLAS");
                    }
                });
                let (fr, pick) = dense_frag_plan(m, k);
                // The launch's argument list, built once: not inside the timed calls.
                let wvs: Vec<_> = ws.iter().map(|w| w.as_view()).collect();
                let mut yvs: Vec<_> = ys
                    .iter_mut()
                    .zip(&ns)
                    .map(|(y, &n)| y.slice_mut(0..m * n))
                    .collect();
                let mut outs: Vec<_> = wvs
                    .iter()
                    .zip(yvs.iter_mut())
                    .zip(&ns)
                    .map(|((w, y), &n)| (w, n, y))
                    .collect();
                let mut t = Vec::new();
                for split in [1usize, 2, 4, 8, 16] {
                    t.push(median_us(g, flush, reps, || {
                        q.dense_nt_frag_bf16_multi_with(
                            fr,
                            split,
                            &xv,
                            &whole.as_view(),
                            &mut outs,
                            m,
                            k,
                        )
                        .expect("fragments");
                    }));
                }
                let pick_us = t[pick.trailing_zeros() as usize];
                let cell = |i: usize| {
                    let star = if 1usize << i == pick { "*" } else { "" };
                    format!("{:.1}{star}", t[i])
                };
                println!(
                    "| {m} | {proj} | {:.1} | {copy:.1} | {cublas:.1} | {} | {} | {} | {} | {} | {:.0} | {:.2} |",
                    bytes as f64 / 1e6,
                    cell(0),
                    cell(1),
                    cell(2),
                    cell(3),
                    cell(4),
                    bytes as f64 / pick_us / 1e3,
                    pick_us / cublas
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
        let (gemm, q) = (
            Gemm::new(&g).expect("GEMM kernels"),
            QGemm::new(&g).expect("low-byte kernels"),
        );
        println!(
            "# bench_qgemm on {} — hidden {HIDDEN}, moe_intermediate {MOE_INTER}, {EXPERTS} experts top-{TOP_K}; median of {reps} calls after warm-up, L2 flushed before each",
            g.name()
        );
        let mut flush = g.zeros::<u8>(FLUSH_BYTES).expect("flush buffer");
        if args.iter().any(|a| a == "--dense") {
            dense(&g, &gemm, &q, &mut flush, reps);
            return;
        }
        let batches_or = |default: &[usize]| -> Vec<usize> {
            args.iter()
                .position(|a| a == "--batches")
                .map(|i| {
                    args[i + 1]
                        .split(',')
                        .map(|b| b.parse().expect("--batches N,N,…"))
                        .collect()
                })
                .unwrap_or_else(|| default.to_vec())
        };
        if args.iter().any(|a| a == "--frag") {
            frag_only(&g, &q, &mut flush, reps, &batches_or(&[8, 32]));
            return;
        }
        if args.iter().any(|a| a == "--large") {
            let batches = batches_or(&[128, 256, 512, 1024]);
            let busy = args.iter().any(|a| a == "--busy");
            large(&g, &gemm, &q, &mut flush, reps, &batches, busy);
            return;
        }
        print_copy_bandwidth(&g, &mut flush, reps);

        let projs = PROJS;
        let ws: Vec<Weights> = projs
            .iter()
            .enumerate()
            .map(|(i, &(_, n, k))| weights(&g, n, k, 10 * i as u64 + 1))
            .collect();
        let max_rows = 128 * TOP_K;
        let kmax = HIDDEN.max(MOE_INTER);
        let xf: Vec<f32> = mxrl_tensor::gradcheck::test_values(max_rows * kmax, 5, 3.0);
        let x = g.upload(&xf).expect("upload x");
        let mut xq = g.zeros::<u16>(max_rows * kmax).expect("alloc");
        let mut xamax = g.zeros::<f32>(max_rows).expect("alloc");
        let mut y = g
            .zeros::<f32>(max_rows * HIDDEN.max(2 * MOE_INTER))
            .expect("alloc");

        let mut rows = Vec::new();
        let mut lanes_rows = Vec::new();
        let mut split_rows = Vec::new();
        for batch in [1usize, 32, 128] {
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
                let bf16_us = median_us(&g, &mut flush, reps, || {
                    gemm.grouped_nt_small_m(
                        &xq.as_view(),
                        &w.bf16.as_view(),
                        &off.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("BF16 small-M");
                });
                // What the engine's BF16 experts run today (the launcher's pick: small-M for
                // decode-sized row counts, tensor-core tiles above).
                let path = mxrl_cuda::ops::gemm::GroupedPath::for_shape(s);
                let auto_us = median_us(&g, &mut flush, reps, || {
                    gemm.grouped_nt(
                        &xq.as_view(),
                        &w.bf16.as_view(),
                        &off.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("BF16 grouped_nt");
                });
                // The BF16 tensor-core tiles whatever the row count (the large-M path).
                let tiled_us = median_us(&g, &mut flush, reps, || {
                    gemm.grouped_nt_tiled(
                        &xq.as_view(),
                        &w.bf16.as_view(),
                        &off.as_view(),
                        &mut y.as_view_mut(),
                        s,
                    )
                    .expect("BF16 grouped_nt_tiled");
                });
                let act_mx = median_us(&g, &mut flush, reps, || {
                    q.quant_act_mxfp8(&x.as_view(), r, k, &mut xq.as_view_mut())
                        .expect("act MXFP8");
                });
                let act_nv = median_us(&g, &mut flush, reps, || {
                    q.quant_act_nvfp4(
                        &x.as_view(),
                        r,
                        k,
                        &mut xq.as_view_mut(),
                        &mut xamax.as_view_mut(),
                    )
                    .expect("act NVFP4");
                });
                // The tensor-core kernels on the stored bytes, where the shape fits their tiles.
                let mut tc_us = [None, None];
                if QGemm::tc_fits(n, k) {
                    for f in LowByte::ALL {
                        tc_us[f as usize] = Some(median_us(&g, &mut flush, reps, || {
                            let (xv, ov) = (xq.as_view(), off.as_view());
                            let mut yv = y.as_view_mut();
                            match f {
                                LowByte::Mxfp8 => q.grouped_nt_tc_mxfp8(
                                    &xv,
                                    &w.mx_codes.as_view(),
                                    &w.mx_scales.as_view(),
                                    &ov,
                                    &mut yv,
                                    s,
                                ),
                                LowByte::Nvfp4 => q.grouped_nt_tc_nvfp4(
                                    &xv,
                                    &xamax.as_view(),
                                    &w.nv_codes.as_view(),
                                    &w.nv_scales.as_view(),
                                    &w.nv_amax.as_view(),
                                    &ov,
                                    &mut yv,
                                    s,
                                ),
                            }
                            .expect("low-byte tensor-core");
                        }));
                    }
                }
                // The fragment kernels (stored bytes decoded straight into mma fragments), the
                // backend's pick up to QFRAG_ROWS_PER_EXPERT rows per expert; NVFP4's operand
                // in binary16 from here on, as they take it (the other kernels timed below
                // read the same buffer: their time does not depend on its values).
                q.quant_act_nvfp4_f16(
                    &x.as_view(),
                    r,
                    k,
                    &mut xq.as_view_mut(),
                    &mut xamax.as_view_mut(),
                )
                .expect("act NVFP4 (binary16)");
                let mut frag_us = [None, None];
                let frag_rows = FragRows::for_rows(r, EXPERTS, FragRows::R32);
                if QGemm::frag_fits(n, k) {
                    for f in LowByte::ALL {
                        frag_us[f as usize] = Some(median_us(&g, &mut flush, reps, || {
                            let (xv, ov) = (xq.as_view(), off.as_view());
                            let mut yv = y.as_view_mut();
                            match f {
                                LowByte::Mxfp8 => q.grouped_nt_frag_mxfp8(
                                    &xv,
                                    &w.mx_codes.as_view(),
                                    &w.mx_scales.as_view(),
                                    &ov,
                                    &mut yv,
                                    s,
                                ),
                                LowByte::Nvfp4 => q.grouped_nt_frag_nvfp4(
                                    &xv,
                                    &xamax.as_view(),
                                    &w.nv_codes.as_view(),
                                    &w.nv_scales.as_view(),
                                    &w.nv_amax.as_view(),
                                    &ov,
                                    &mut yv,
                                    s,
                                ),
                            }
                            .expect("low-byte fragment");
                        }));
                    }
                }
                // Every split of the fragment kernels' reduction (warps per 32-column block),
                // BF16 weights included; the launcher's pick is starred.
                if QGemm::frag_fits(n, k) {
                    for fmt in ["BF16", "Mxfp8", "Nvfp4"] {
                        let pick = split_for(fmt, s, frag_rows);
                        let mut times = Vec::new();
                        let layouts = [1usize, 2, 4, 8]
                            .map(FragLayout::Split)
                            .into_iter()
                            .chain([FragLayout::Staged]);
                        for split in layouts {
                            let t = median_us(&g, &mut flush, reps, || {
                                frag_call(
                                    &q, fmt, frag_rows, split, &xq, &xamax, w, &off, &mut y, s,
                                )
                            });
                            times.push((split, t));
                        }
                        if fmt == "BF16" {
                            let us = times.iter().find(|(k, _)| *k == pick).expect("pick").1;
                            rows.push(Row {
                                step: step.clone(),
                                op: format!("BF16 fragments ({frag_rows:?}, {pick:?})"),
                                us,
                                bytes: (used * n * k * 2) as f64,
                                bf16_us,
                                tiled_us,
                            });
                        }
                        split_rows.push((step.clone(), fmt, pick, times));
                    }
                }
                let mut run = |f: LowByte, lanes: QLanes| {
                    median_us(&g, &mut flush, reps, || {
                        let (xv, ov) = (xq.as_view(), off.as_view());
                        let mut yv = y.as_view_mut();
                        match f {
                            LowByte::Mxfp8 => q.grouped_nt_small_m_mxfp8_with(
                                lanes,
                                &xv,
                                &w.mx_codes.as_view(),
                                &w.mx_scales.as_view(),
                                &ov,
                                &mut yv,
                                s,
                            ),
                            LowByte::Nvfp4 => q.grouped_nt_small_m_nvfp4_with(
                                lanes,
                                &xv,
                                &xamax.as_view(),
                                &w.nv_codes.as_view(),
                                &w.nv_scales.as_view(),
                                &w.nv_amax.as_view(),
                                &ov,
                                &mut yv,
                                s,
                            ),
                        }
                        .expect("low-byte small-M");
                    })
                };
                let bf16_bytes = (used * n * k * 2) as f64;
                rows.push(Row {
                    step: step.clone(),
                    op: "BF16 grouped_nt_small_m".into(),
                    us: bf16_us,
                    bytes: bf16_bytes,
                    bf16_us,
                    tiled_us,
                });
                rows.push(Row {
                    step: step.clone(),
                    op: "BF16 grouped_nt_tiled".into(),
                    us: tiled_us,
                    bytes: bf16_bytes,
                    bf16_us,
                    tiled_us,
                });
                rows.push(Row {
                    step: step.clone(),
                    op: format!("BF16 grouped_nt ({path:?})"),
                    us: auto_us,
                    bytes: bf16_bytes,
                    bf16_us,
                    tiled_us,
                });
                for (f, act) in [(LowByte::Mxfp8, act_mx), (LowByte::Nvfp4, act_nv)] {
                    let pick = QLanes::for_shape(f, k);
                    let mut times = Vec::new();
                    for lanes in QLanes::ALL {
                        times.push((lanes, run(f, lanes)));
                    }
                    let us = times.iter().find(|(l, _)| *l == pick).expect("pick").1;
                    let wb = (used * f.weight_bytes(n, k)) as f64;
                    rows.push(Row {
                        step: step.clone(),
                        op: format!("{f:?} ({pick:?})"),
                        us,
                        bytes: wb,
                        bf16_us,
                        tiled_us,
                    });
                    rows.push(Row {
                        step: step.clone(),
                        op: format!("{f:?} +act"),
                        us: us + act,
                        bytes: wb,
                        bf16_us,
                        tiled_us,
                    });
                    lanes_rows.push((step.clone(), f, pick, times));
                    if let Some(tc) = tc_us[f as usize] {
                        rows.push(Row {
                            step: step.clone(),
                            op: format!("{f:?} tensor cores"),
                            us: tc,
                            bytes: wb,
                            bf16_us,
                            tiled_us,
                        });
                        rows.push(Row {
                            step: step.clone(),
                            op: format!("{f:?} tensor cores +act"),
                            us: tc + act,
                            bytes: wb,
                            bf16_us,
                            tiled_us,
                        });
                    }
                    if let Some(fr) = frag_us[f as usize] {
                        rows.push(Row {
                            step: step.clone(),
                            op: format!("{f:?} fragments ({frag_rows:?})"),
                            us: fr,
                            bytes: wb,
                            bf16_us,
                            tiled_us,
                        });
                        rows.push(Row {
                            step: step.clone(),
                            op: format!("{f:?} fragments +act"),
                            us: fr + act,
                            bytes: wb,
                            bf16_us,
                            tiled_us,
                        });
                    }
                }
            }
        }

        println!(
            "\n| step | kernel | µs | weight MB | GB/s | ×BF16 small-M | ×BF16 tiled |\n|---|---|---:|---:|---:|---:|---:|"
        );
        for r in &rows {
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {:.2} |",
                r.step,
                r.op,
                r.us,
                r.bytes / 1e6,
                r.bytes / (r.us * 1e-6) / 1e9,
                r.us / r.bf16_us,
                r.us / r.tiled_us
            );
        }
        println!(
            "\n| step | fragment weights | split 1 µs | 2 | 4 | 8 | staged |\n|---|---|---:|---:|---:|---:|---:|"
        );
        for (step, fmt, pick, times) in &split_rows {
            let cells: Vec<String> = times
                .iter()
                .map(|(k, t)| format!("{t:.1}{}", if k == pick { "*" } else { "" }))
                .collect();
            println!("| {step} | {fmt} | {} |", cells.join(" | "));
        }
        println!("\n| step | format | L32 µs | L16 µs | L8 µs |\n|---|---|---:|---:|---:|");
        for (step, f, pick, times) in &lanes_rows {
            let cell = |l: QLanes| {
                let t = times.iter().find(|(x, _)| *x == l).expect("lanes").1;
                format!("{t:.1}{}", if l == *pick { "*" } else { "" })
            };
            println!(
                "| {step} | {f:?} | {} | {} | {} |",
                cell(QLanes::L32),
                cell(QLanes::L16),
                cell(QLanes::L8)
            );
        }
    }
}

#[cfg(feature = "cuda")]
fn main() {
    bench::main();
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_qgemm needs --features cuda");
    std::process::exit(2);
}
