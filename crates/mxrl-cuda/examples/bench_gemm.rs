//! GEMM family benchmark on the 2.63 B benchmark config (Qwen3-MoE, hidden 2048,
//! moe_intermediate 768, 64 experts top-8): the grouped expert GEMMs (fused gate/up projection
//! `[64, 1536, 2048]` and down projection `[64, 2048, 768]`) for a 4096-token training step
//! (forward, dgrad, wgrad; and the wgrad of an activation in three BF16 parts, NVFP4's
//! `dequantized` backward, as three passes and as one launch) and for decode steps at batch 1 / 8 / 32 / 128, routed like random
//! tokens (8 distinct uniformly random experts per token, fixed seed). Every figure is timed
//! with CUDA events after warm-up in the same run as its baselines: a cuBLAS dense BF16 GEMM
//! of the same total FLOPs, and a device-to-device copy of the bytes the grouped op must read
//! as weights (the memory floor of decode).
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_gemm [-- --reps N]`
//!
//! Columns: time per call (µs); TFLOP/s (2·rows·N·K); weight GB/s (bytes of the used experts'
//! BF16 weights per second); `copy×` = kernel time ÷ time of copying those weight bytes
//! (1.0 = at the copy floor, which also writes them); `cuBLAS×` = kernel time ÷ the cuBLAS
//! dense GEMM of the same FLOPs. Machine ceilings (H200): ~790 TFLOP/s dense BF16, ~4.3 TB/s
//! device copy (bytes read + written).

#[cfg(feature = "cuda")]
#[path = "common/bench.rs"]
mod common;

#[cfg(feature = "cuda")]
mod bench {
    use super::common::*;
    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::CudaSlice;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::gemm::{Gemm, Grouped, GroupedPath, Tile};
    use mxrl_tensor::device::GradWrite;

    const TRAIN_TOKENS: usize = 4096;

    /// Mean milliseconds per call of `f` over `reps` calls, after 3 warm-up calls.
    fn time(g: &Gpu, reps: usize, mut f: impl FnMut()) -> f64 {
        for _ in 0..3 {
            f();
        }
        g.sync().expect("warm-up");
        let ev = |_| {
            g.ctx()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event")
        };
        let (start, end) = (ev(0), ev(1));
        start.record(g.stream()).expect("record");
        for _ in 0..reps {
            f();
        }
        end.record(g.stream()).expect("record");
        start.elapsed_ms(&end).expect("elapsed") as f64 / reps as f64
    }

    /// Random-ish BF16 bit patterns (values in ±[0.25, 2)) without a host round trip per call.
    fn bf16_buf(g: &Gpu, len: usize, seed: u64) -> CudaSlice<u16> {
        let mut s = seed;
        let host: Vec<u16> = (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mant = ((s >> 33) & 0x7F) as u16;
                let exp = 125 + ((s >> 41) & 1) as u16 * 2; // 2^-2 or 2^0
                let sign = ((s >> 50) & 1) as u16;
                (sign << 15) | (exp << 7) | mant
            })
            .collect();
        g.upload(&host).expect("upload")
    }

    struct Row {
        case: String,
        op: String,
        ms: f64,
        flops: f64,
        weight_bytes: f64,
        copy_ms: f64,
        cublas_ms: Option<f64>,
    }

    fn print(rows: &[Row]) {
        println!(
            "| case | op | µs | TFLOP/s | weight GB/s | copy× | cuBLAS× |\n|---|---|---:|---:|---:|---:|---:|"
        );
        for r in rows {
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {} |",
                r.case,
                r.op,
                r.ms * 1e3,
                r.flops / (r.ms * 1e-3) / 1e12,
                r.weight_bytes / (r.ms * 1e-3) / 1e9,
                r.ms / r.copy_ms,
                r.cublas_ms
                    .map(|c| format!("{:.2}", r.ms / c))
                    .unwrap_or_else(|| "-".into()),
            );
        }
    }

    /// Keeps the first output's bits; for a later one prints how many differ from them.
    fn same_bits(first: &mut Option<Vec<u32>>, bits: Vec<u32>, what: &str) {
        match first {
            None => *first = Some(bits),
            Some(b) => println!(
                "bits {what}: {} of {} differ",
                b.iter().zip(&bits).filter(|(x, y)| x != y).count(),
                b.len()
            ),
        }
    }

    /// Time of copying `bytes` device to device (the floor of reading them once).
    fn copy_ms(g: &Gpu, reps: usize, bytes: usize) -> f64 {
        let src = g.zeros::<u8>(bytes).expect("alloc");
        let mut dst = g.zeros::<u8>(bytes).expect("alloc");
        time(g, reps, || {
            g.stream().memcpy_dtod(&src, &mut dst).expect("copy");
        })
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        let reps = args
            .iter()
            .position(|a| a == "--reps")
            .map(|i| args[i + 1].parse().expect("--reps N"))
            .unwrap_or(20usize);
        let g = Gpu::shared(0).expect("GPU 0");
        let ops = Gemm::new(&g).expect("load GEMM kernels");
        println!(
            "# bench_gemm on {} — hidden {HIDDEN}, moe_intermediate {MOE_INTER}, {EXPERTS} experts top-{TOP_K}, {reps} reps after warm-up",
            g.name()
        );
        // Copy bandwidth (bytes read + written) for the record.
        let big = 1usize << 30;
        let c = copy_ms(&g, reps, big);
        println!(
            "device copy of 1 GiB: {:.3} ms = {:.0} GB/s (read + write)",
            c,
            2.0 * big as f64 / (c * 1e-3) / 1e9
        );

        // Projections: (name, N, K) of the forward y = x · W[e]ᵀ.
        let projs = [
            ("gate_up", 2 * MOE_INTER, HIDDEN),
            ("down", HIDDEN, MOE_INTER),
        ];
        let max_w = EXPERTS * 2 * MOE_INTER * HIDDEN;
        let w = bf16_buf(&g, max_w, 1);
        let mut dw_max = g.zeros::<f32>(max_w).expect("alloc dW");
        let mut rows_out = Vec::new();

        // ---- Training step: 4096 tokens × top-8 rows.
        let counts = route(TRAIN_TOKENS, 7);
        let r = TRAIN_TOKENS * TOP_K;
        let off = g.upload(&offsets(&counts)).expect("offsets");
        let a = bf16_buf(&g, r * HIDDEN.max(2 * MOE_INTER), 2);
        let d = bf16_buf(&g, r * HIDDEN.max(2 * MOE_INTER), 3);
        // Three parts of x (NVFP4's `dequantized` wgrad operand).
        let x3 = bf16_buf(&g, 3 * r * HIDDEN.max(MOE_INTER), 4);
        let mut out = g
            .zeros::<f32>(r * HIDDEN.max(2 * MOE_INTER))
            .expect("alloc");
        for (name, n, k) in projs {
            let s = Grouped {
                experts: EXPERTS,
                rows: r,
                n,
                k,
            };
            let flops = 2.0 * (r * n * k) as f64;
            let wb = (EXPERTS * n * k * 2) as f64;
            let cp = copy_ms(&g, reps, EXPERTS * n * k * 2);
            let case = format!("train {TRAIN_TOKENS} tok, {name} N={n} K={k}");
            for op in ["fwd", "dgrad", "wgrad"] {
                let cb = time(&g, reps, || {
                    let (av, dv, wv) = (a.as_view(), d.as_view(), w.as_view());
                    match op {
                        "fwd" => ops.dense_nt(&av, &wv, &mut out.as_view_mut(), r, n, k),
                        "dgrad" => ops.dense_nn(&dv, &wv, &mut out.as_view_mut(), r, n, k),
                        _ => ops.dense_tn(&dv, &av, &mut dw_max.as_view_mut(), r, n, k),
                    }
                    .expect("cuBLAS");
                });
                let mut t128_bits: Option<Vec<u32>> = None;
                for tile in ops.tiles() {
                    let t = time(&g, reps, || {
                        let (av, dv, wv, ov) =
                            (a.as_view(), d.as_view(), w.as_view(), off.as_view());
                        match op {
                            "fwd" => ops.grouped_nt_tiled_with(
                                tile,
                                &av,
                                &wv,
                                &ov,
                                &mut out.as_view_mut(),
                                s,
                            ),
                            "dgrad" => {
                                ops.grouped_nn_with(tile, &dv, &wv, &ov, &mut out.as_view_mut(), s)
                            }
                            _ => ops.grouped_tn_with(
                                tile,
                                &dv,
                                &av,
                                &ov,
                                &mut dw_max.as_view_mut(),
                                s,
                                GradWrite::Accumulate,
                            ),
                        }
                        .expect("grouped");
                    });
                    if op != "wgrad" && matches!(tile, Tile::T128 | Tile::W128x256) {
                        // The same sums in the same k16 order: compare the bits of the two
                        // tiles' outputs (the forward / dgrad overwrite `out`).
                        let bits: Vec<u32> = g
                            .download(&out)
                            .expect("download")
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        same_bits(
                            &mut t128_bits,
                            bits,
                            &format!("{tile:?} vs T128, {case} {op}"),
                        );
                    }
                    rows_out.push(Row {
                        case: case.clone(),
                        op: format!("{op} grouped {tile:?}"),
                        ms: t,
                        flops,
                        weight_bytes: wb,
                        copy_ms: cp,
                        cublas_ms: Some(cb),
                    });
                }
                if op == "wgrad" {
                    // A fresh step's wgrad: dW overwritten (0 + Σ), not read.
                    let mut first: Option<Vec<u32>> = None;
                    for tile in ops.tiles() {
                        if !matches!(tile, Tile::T128 | Tile::W128x256) {
                            continue;
                        }
                        let t = time(&g, reps, || {
                            ops.grouped_tn_with(
                                tile,
                                &d.as_view(),
                                &a.as_view(),
                                &off.as_view(),
                                &mut dw_max.as_view_mut(),
                                s,
                                GradWrite::Overwrite,
                            )
                            .expect("grouped");
                        });
                        let bits: Vec<u32> = g
                            .download(&dw_max.slice(0..EXPERTS * n * k))
                            .expect("download")
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        same_bits(&mut first, bits, &format!("{tile:?} vs T128, {case} wgrad"));
                        rows_out.push(Row {
                            case: case.clone(),
                            op: format!("wgrad grouped {tile:?}, overwrite"),
                            ms: t,
                            flops,
                            weight_bytes: wb,
                            copy_ms: cp,
                            cublas_ms: Some(cb),
                        });
                    }
                    // NVFP4 `dequantized`: x in three stacked BF16 parts. Three passes (the
                    // first overwriting, two accumulating) against one launch over all parts.
                    let part = |p: usize| x3.slice(p * r * k..(p + 1) * r * k);
                    let mut first: Option<Vec<u32>> = None;
                    for tile in ops.tiles() {
                        if !matches!(tile, Tile::T128 | Tile::W128x256) {
                            continue;
                        }
                        let passes = time(&g, reps, || {
                            for p in 0..3 {
                                let write = if p == 0 {
                                    GradWrite::Overwrite
                                } else {
                                    GradWrite::Accumulate
                                };
                                ops.grouped_tn_with(
                                    tile,
                                    &d.as_view(),
                                    &part(p),
                                    &off.as_view(),
                                    &mut dw_max.as_view_mut(),
                                    s,
                                    write,
                                )
                                .expect("grouped");
                            }
                        });
                        let one = time(&g, reps, || {
                            ops.grouped_tn_parts_with(
                                tile,
                                &d.as_view(),
                                &x3.slice(0..3 * r * k),
                                &off.as_view(),
                                &mut dw_max.as_view_mut(),
                                s,
                                3,
                                GradWrite::Overwrite,
                            )
                            .expect("grouped");
                        });
                        let bits: Vec<u32> = g
                            .download(&dw_max.slice(0..EXPERTS * n * k))
                            .expect("download")
                            .iter()
                            .map(|v| v.to_bits())
                            .collect();
                        same_bits(
                            &mut first,
                            bits,
                            &format!("{tile:?} vs T128, {case} wgrad of 3 parts"),
                        );
                        for (what, ms) in [("3 passes", passes), ("one launch", one)] {
                            rows_out.push(Row {
                                case: case.clone(),
                                op: format!("wgrad of 3 parts grouped {tile:?}, {what}"),
                                ms,
                                flops: 3.0 * flops,
                                weight_bytes: wb,
                                copy_ms: cp,
                                cublas_ms: Some(3.0 * cb),
                            });
                        }
                    }
                }
                if op == "fwd" {
                    // The same grouped forward as one cublasGemmEx per expert (the host's copy
                    // of the offsets; host time included: the calls are queued one by one).
                    // cublasGemmGroupedBatchedEx answers NOT_SUPPORTED for BF16 in, f32 out.
                    let host_off = offsets(&counts);
                    let t = time(&g, reps, || {
                        for e in 0..EXPERTS {
                            let (lo, hi) = (host_off[e] as usize, host_off[e + 1] as usize);
                            if lo == hi {
                                continue;
                            }
                            ops.dense_nt(
                                &a.slice(lo * k..hi * k),
                                &w.slice(e * n * k..(e + 1) * n * k),
                                &mut out.slice_mut(lo * n..hi * n),
                                hi - lo,
                                n,
                                k,
                            )
                            .expect("cuBLAS per expert");
                        }
                    });
                    rows_out.push(Row {
                        case: case.clone(),
                        op: "fwd cuBLAS per expert".into(),
                        ms: t,
                        flops,
                        weight_bytes: wb,
                        copy_ms: cp,
                        cublas_ms: Some(cb),
                    });
                }
                rows_out.push(Row {
                    case: case.clone(),
                    op: format!("{op} cuBLAS dense"),
                    ms: cb,
                    flops,
                    weight_bytes: wb,
                    copy_ms: cp,
                    cublas_ms: None,
                });
            }
        }

        // ---- Decode steps: batch tokens × top-8 rows, random routing.
        for batch in [1usize, 8, 32, 128] {
            let counts = route(batch, 100 + batch as u64);
            let used = counts.iter().filter(|&&c| c > 0).count();
            let r = batch * TOP_K;
            let off = g.upload(&offsets(&counts)).expect("offsets");
            for (name, n, k) in projs {
                let s = Grouped {
                    experts: EXPERTS,
                    rows: r,
                    n,
                    k,
                };
                let flops = 2.0 * (r * n * k) as f64;
                let wb = (used * n * k * 2) as f64;
                let cp = copy_ms(&g, reps, used * n * k * 2);
                let case = format!(
                    "decode b={batch} ({used} experts, auto={:?}), {name} N={n} K={k}",
                    GroupedPath::for_shape(s)
                );
                let cb = time(&g, reps, || {
                    ops.dense_nt(&a.as_view(), &w.as_view(), &mut out.as_view_mut(), r, n, k)
                        .expect("dense nt");
                });
                let small = time(&g, reps, || {
                    ops.grouped_nt_small_m(
                        &a.as_view(),
                        &w.as_view(),
                        &off.as_view(),
                        &mut out.as_view_mut(),
                        s,
                    )
                    .expect("small-M");
                });
                rows_out.push(Row {
                    case: case.clone(),
                    op: "fwd grouped small-M".into(),
                    ms: small,
                    flops,
                    weight_bytes: wb,
                    copy_ms: cp,
                    cublas_ms: Some(cb),
                });
                for tile in ops.tiles() {
                    let tiled = time(&g, reps, || {
                        ops.grouped_nt_tiled_with(
                            tile,
                            &a.as_view(),
                            &w.as_view(),
                            &off.as_view(),
                            &mut out.as_view_mut(),
                            s,
                        )
                        .expect("tiled");
                    });
                    rows_out.push(Row {
                        case: case.clone(),
                        op: format!("fwd grouped {tile:?}"),
                        ms: tiled,
                        flops,
                        weight_bytes: wb,
                        copy_ms: cp,
                        cublas_ms: Some(cb),
                    });
                }
                rows_out.push(Row {
                    case,
                    op: "fwd cuBLAS dense (same FLOPs)".into(),
                    ms: cb,
                    flops,
                    weight_bytes: wb,
                    copy_ms: cp,
                    cublas_ms: None,
                });
            }
            // A dense decode linear (hidden → hidden, one weight): small-M kernel with one
            // "expert" against cuBLAS.
            let (n, k) = (HIDDEN, HIDDEN);
            let off1 = g.upload(&[0u32, batch as u32]).expect("offsets");
            let s = Grouped {
                experts: 1,
                rows: batch,
                n,
                k,
            };
            let flops = 2.0 * (batch * n * k) as f64;
            let wb = (n * k * 2) as f64;
            let cp = copy_ms(&g, reps, n * k * 2);
            let cb = time(&g, reps, || {
                ops.dense_nt(
                    &a.as_view(),
                    &w.as_view(),
                    &mut out.as_view_mut(),
                    batch,
                    n,
                    k,
                )
                .expect("dense nt");
            });
            let small = time(&g, reps, || {
                ops.grouped_nt_small_m(
                    &a.as_view(),
                    &w.as_view(),
                    &off1.as_view(),
                    &mut out.as_view_mut(),
                    s,
                )
                .expect("small-M dense");
            });
            let case = format!("decode b={batch}, dense linear N={n} K={k}");
            rows_out.push(Row {
                case: case.clone(),
                op: "small-M (E=1)".into(),
                ms: small,
                flops,
                weight_bytes: wb,
                copy_ms: cp,
                cublas_ms: Some(cb),
            });
            rows_out.push(Row {
                case,
                op: "cuBLAS dense".into(),
                ms: cb,
                flops,
                weight_bytes: wb,
                copy_ms: cp,
                cublas_ms: None,
            });
        }
        print(&rows_out);
    }
}

#[cfg(feature = "cuda")]
fn main() {
    bench::main();
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_gemm needs --features cuda");
    std::process::exit(2);
}
