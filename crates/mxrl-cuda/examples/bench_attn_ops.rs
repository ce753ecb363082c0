//! Times the attention-side op families (RMSNorm, RoPE, attention training forward/backward,
//! KV append + decode) on the shapes of the engine's benchmark model (decode: Qwen3-30B-A3B's
//! 32 query heads), with CUDA events after a
//! warm-up, and prints each time beside its floor: bytes over the device copy bandwidth
//! (4.3 TB/s on the H200) for the memory-bound ops, FLOPs over the f32 CUDA-core rate
//! (60 TFLOP/s counting a fused multiply-add as two; the kernels are compiled without FMA
//! contraction, so a multiply and an add are two instructions) for the CUDA-core attention
//! kernels, and six BF16 products per f32 product over the dense BF16 tensor-core rate
//! (989 TFLOP/s) for the tensor-core ones (three-part splits of both operands), both families
//! timed in the same run.
//!
//! `cargo run --release -p mxrl-cuda --features cuda --example bench_attn_ops`

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("bench_attn_ops: {e}");
        std::process::exit(1);
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_attn_ops needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod bench {
    use cudarc::driver::sys::CUevent_flags;
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::attention::{
        backward_scratch_len, decode_scratch_len, Attention, TrainingKernels,
    };
    use mxrl_cuda::ops::norm::{self, Norm};
    use mxrl_cuda::ops::rope::{Rope, RopeDeviceTable};
    use mxrl_cuda::DeviceError;
    use mxrl_tensor::attention::AttnShape;
    use mxrl_tensor::gradcheck::test_values;
    use mxrl_tensor::tolerance::AttnSums;

    const COPY_BW: f64 = 4.3e12;
    const F32_RATE: f64 = 60e12;
    /// Dense BF16 tensor-core rate of the H200 (mma with f32 accumulation).
    const BF16_RATE: f64 = 989e12;
    /// BF16 part products per f32 product in the tensor-core kernels.
    const PARTS: f64 = 6.0;
    const ITERS: usize = 20;

    /// Mean milliseconds of `f` over ITERS runs after 3 warm-up runs, by CUDA events.
    fn time(g: &Gpu, mut f: impl FnMut() -> Result<(), DeviceError>) -> Result<f64, DeviceError> {
        for _ in 0..3 {
            f()?;
        }
        g.sync()?;
        let ev = |g: &Gpu| {
            g.stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| g.err(format!("event: {e:?}")))
        };
        let start = ev(g)?;
        for _ in 0..ITERS {
            f()?;
        }
        let end = ev(g)?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| g.err(format!("elapsed: {e:?}")))?;
        Ok(ms as f64 / ITERS as f64)
    }

    /// A line of `line` followed by the achieved rate for `flops` (multiply and add counted
    /// separately, as the floor counts them).
    fn line_rate(name: &str, ms: f64, floor_ms: f64, what: &str, flops: f64) {
        line(name, ms, floor_ms, what);
        println!(
            "{:<48} {:>9.2} TFLOP/s of f32 (ceiling {:.0})",
            "",
            flops / (ms * 1e-3) / 1e12,
            F32_RATE / 1e12
        );
    }

    /// `line_rate` for the tensor-core kernels: the floor is `PARTS` BF16 products per f32
    /// product at the BF16 rate; the rate line gives the f32-equivalent FLOP/s.
    fn line_rate_tc(name: &str, ms: f64, what: &str, flops: f64) {
        line(name, ms, PARTS * flops / BF16_RATE * 1e3, what);
        println!(
            "{:<48} {:>9.2} TFLOP/s f32-equivalent ({:.0} TFLOP/s of BF16 mma, ceiling {:.0})",
            "",
            flops / (ms * 1e-3) / 1e12,
            PARTS * flops / (ms * 1e-3) / 1e12,
            BF16_RATE / 1e12
        );
    }

    fn line(name: &str, ms: f64, floor_ms: f64, what: &str) {
        println!(
            "{name:<48} {ms:>9.4} ms   floor {floor_ms:>8.4} ms ({what})   ratio {:>6.2}",
            ms / floor_ms
        );
    }

    pub fn run() -> Result<(), DeviceError> {
        let g = Gpu::shared(0)?;
        println!("device: {}", g.name());
        let nrm = Norm::new(&g)?;
        let rope = Rope::new(&g)?;
        let att = Attention::new(&g)?;
        let att_cc = Attention::new(&g)?.with_training_kernels(TrainingKernels::CudaCores);

        for (rows, d) in [(4096usize, 2048usize), (4096 * 16, 128), (4096 * 32, 128)] {
            let x = g.upload(&test_values(rows * d, 1, 2.0))?;
            let w = g.upload(&test_values(d, 2, 1.0))?;
            let dy = g.upload(&test_values(rows * d, 3, 1.0))?;
            let mut y = g.zeros::<f32>(rows * d)?;
            let mut rstd = g.zeros::<f32>(rows)?;
            let ms = time(&g, || {
                nrm.forward(
                    &x.as_view(),
                    &w.as_view(),
                    &mut y.as_view_mut(),
                    &mut rstd.as_view_mut(),
                    rows,
                    d,
                    1e-6,
                )
            })?;
            line(
                &format!("rmsnorm forward [{rows}, {d}]"),
                ms,
                (8 * rows * d) as f64 / COPY_BW * 1e3,
                "x in, y out",
            );
            let mut dx = g.zeros::<f32>(rows * d)?;
            let mut dw = g.zeros::<f32>(d)?;
            let mut scratch = g.zeros::<f32>(norm::backward_scratch_len(rows, d))?;
            let ms = time(&g, || {
                nrm.backward(
                    &dy.as_view(),
                    &x.as_view(),
                    &w.as_view(),
                    &rstd.as_view(),
                    &mut dx.as_view_mut(),
                    &mut dw.as_view_mut(),
                    &mut scratch.as_view_mut(),
                    rows,
                    d,
                )
            })?;
            line(
                &format!("rmsnorm backward [{rows}, {d}]"),
                ms,
                (12 * rows * d) as f64 / COPY_BW * 1e3,
                "dy, x in, dx out",
            );
        }

        let n = 4096;
        let table = RopeDeviceTable::new(&g, 4096, 128, 1e6)?;
        let pos: Vec<u32> = (0..n as u32).map(|t| t % 512).collect();
        let dpos = g.upload(&pos)?;
        for heads in [16usize, 32, 4] {
            let mut x = g.upload(&test_values(n * heads * 128, 4, 1.0))?;
            let ms = time(&g, || {
                rope.forward(&mut x.as_view_mut(), &dpos.as_view(), n, heads, &table)
            })?;
            line(
                &format!("rope forward [{n}, {heads}x128]"),
                ms,
                (8 * n * heads * 128) as f64 / COPY_BW * 1e3,
                "x in and out",
            );
        }

        for hq in [16usize, 32] {
            let s = AttnShape {
                q_heads: hq,
                kv_heads: 4,
                head_dim: 128,
            };
            let (b, t) = (8usize, 512usize);
            let n = b * t;
            let (qd, kd) = (n * hq * 128, n * 4 * 128);
            let q = g.upload(&test_values(qd, 5, 1.0))?;
            let k = g.upload(&test_values(kd, 6, 1.0))?;
            let v = g.upload(&test_values(kd, 7, 1.0))?;
            let dout = g.upload(&test_values(qd, 8, 1.0))?;
            let offsets: Vec<u32> = (0..=b as u32).map(|i| i * t as u32).collect();
            let doff = g.upload(&offsets)?;
            let mut out = g.zeros::<f32>(qd)?;
            let mut lse = g.zeros::<f32>(n * hq)?;
            // MACs of one causal product (QK^T or PV) per head: sum over rows of (i+1)·D.
            let macs = (b * hq * t * (t + 1) / 2 * 128) as f64;
            for (ops, fam) in [(&att_cc, "CUDA cores"), (&att, "tensor cores")] {
                let ms = time(&g, || {
                    ops.forward(
                        &q.as_view(),
                        &k.as_view(),
                        &v.as_view(),
                        &doff.as_view(),
                        b,
                        t,
                        n,
                        s,
                        &mut out.as_view_mut(),
                        &mut lse.as_view_mut(),
                    )
                })?;
                let name = format!("attention forward 8x512, Hq {hq}, Hkv 4, D 128, {fam}");
                if ops.training_sums(128) == AttnSums::F32 {
                    line_rate(
                        &name,
                        ms,
                        2.0 * 2.0 * macs / F32_RATE * 1e3,
                        "2 products",
                        2.0 * 2.0 * macs,
                    );
                } else {
                    line_rate_tc(&name, ms, "2 products", 2.0 * 2.0 * macs);
                }
                let mut delta = g.zeros::<f32>(backward_scratch_len(n, s))?;
                let mut dq = g.zeros::<f32>(qd)?;
                let mut dk = g.zeros::<f32>(kd)?;
                let mut dv = g.zeros::<f32>(kd)?;
                let ms = time(&g, || {
                    ops.backward(
                        &dout.as_view(),
                        &q.as_view(),
                        &k.as_view(),
                        &v.as_view(),
                        &out.as_view(),
                        &lse.as_view(),
                        &doff.as_view(),
                        b,
                        t,
                        n,
                        s,
                        &mut delta.as_view_mut(),
                        &mut dq.as_view_mut(),
                        &mut dk.as_view_mut(),
                        &mut dv.as_view_mut(),
                    )
                })?;
                let name = format!("attention backward 8x512, Hq {hq}, Hkv 4, D 128, {fam}");
                if ops.training_sums(128) == AttnSums::F32 {
                    line_rate(
                        &name,
                        ms,
                        5.0 * 2.0 * macs / F32_RATE * 1e3,
                        "5 products",
                        5.0 * 2.0 * macs,
                    );
                } else {
                    line_rate_tc(&name, ms, "5 products", 5.0 * 2.0 * macs);
                }
            }
        }

        // Qwen3-30B-A3B's attention (32 query heads over 4 kv heads of 128): a rollout's
        // short and long contexts, batch 1 to 512.
        let s = AttnShape {
            q_heads: 32,
            kv_heads: 4,
            head_dim: 128,
        };
        let (hq, row) = (s.q_heads, s.kv_heads * s.head_dim);
        for len in [60usize, 320] {
            for batch in [1usize, 32, 128, 512] {
                let max_len = 320;
                let kc = g.zeros::<u16>(batch * max_len * row)?;
                let vc = g.zeros::<u16>(batch * max_len * row)?;
                let lens = g.upload(&vec![len as u32; batch])?;
                let q = g.upload(&test_values(batch * hq * 128, 9, 1.0))?;
                let mut scratch = g.zeros::<f32>(decode_scratch_len(batch, max_len, s))?;
                let mut out = g.zeros::<f32>(batch * hq * 128)?;
                let ms = time(&g, || {
                    att.decode(
                        &q.as_view(),
                        &kc.as_view(),
                        &vc.as_view(),
                        &lens.as_view(),
                        batch,
                        batch,
                        max_len,
                        s,
                        &mut scratch.as_view_mut(),
                        &mut out.as_view_mut(),
                    )
                })?;
                let bytes = (batch * len * row * 2 * 2) as f64;
                line(
                    &format!("decode B {batch}, len {len}, Hq {hq}, Hkv 4, D 128"),
                    ms,
                    bytes / COPY_BW * 1e3,
                    "BF16 K and V read",
                );
            }
        }
        Ok(())
    }
}
