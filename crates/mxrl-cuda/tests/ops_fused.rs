//! The fused ops of the CUDA backend (RMSNorm → BF16, gather of BF16 rows, combine + residual)
//! give the same bits as the unfused ops they replace (each of which `ops_norm` / `ops_moe`
//! check against the CPU reference), and the CPU backend's gather of BF16 rows equals its
//! gather with rounding.
#![cfg(feature = "cuda")]

use mxrl_cuda::backend::CudaBackend;
use mxrl_tensor::device::{Backend, CpuBackend, RouteBufs};
use mxrl_tensor::gradcheck::test_values;

fn gpu() -> CudaBackend {
    CudaBackend::new(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}"))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn route<B: Backend>(b: &B, logits: &[f32], n: usize, e: usize, k: usize) -> RouteBufs<B> {
    let l = b.upload_f32(logits).unwrap();
    let mut r = RouteBufs {
        ids: b.zeros_u32(n * k).unwrap(),
        weights: b.zeros_f32(n * k).unwrap(),
        probs: b.zeros_f32(n * e).unwrap(),
        offsets: b.zeros_u32(e + 1).unwrap(),
        perm: b.zeros_u32(n * k).unwrap(),
        row_of: b.zeros_u32(n * k).unwrap(),
    };
    b.route(&l, n, e, k, true, None, &mut r).unwrap();
    r
}

/// `(n, h)` shapes: aligned and ragged widths, one row, many rows.
const SHAPES: [(usize, usize); 5] = [(1, 64), (7, 130), (33, 2048), (5, 3), (128, 256)];

#[test]
fn rmsnorm_bf16_is_rmsnorm_then_to_bf16_bitwise() {
    let g = gpu();
    for (i, &(n, d)) in SHAPES.iter().enumerate() {
        let x = test_values(n * d, 10 + i as u64, 2.0);
        let w = test_values(d, 20 + i as u64, 1.0);
        let (xd, wd) = (g.upload_f32(&x).unwrap(), g.upload_f32(&w).unwrap());
        let mut y = g.zeros_f32(n * d).unwrap();
        let mut r1 = g.zeros_f32(n).unwrap();
        g.rmsnorm(&xd, &wd, n, d, 1e-6, &mut y, &mut r1).unwrap();
        let mut yb = g.zeros_bf16(n * d).unwrap();
        g.to_bf16(&y, &mut yb, n * d).unwrap();
        let mut fused = g.empty_bf16(n * d).unwrap();
        let mut r2 = g.empty_f32(n).unwrap();
        g.rmsnorm_bf16(&xd, &wd, n, d, 1e-6, &mut fused, &mut r2)
            .unwrap();
        let gpu_bits = |v: &cudarc::driver::CudaSlice<u16>| g.gpu().download(v).unwrap();
        assert_eq!(
            gpu_bits(&fused)[..n * d],
            gpu_bits(&yb)[..n * d],
            "[{n}, {d}]"
        );
        assert_eq!(
            bits(&g.download_f32(&r2, n).unwrap()),
            bits(&g.download_f32(&r1, n).unwrap())
        );
    }
}

#[test]
fn gather_rows_and_combine_add_equal_the_unfused_ops_bitwise() {
    let g = gpu();
    let c = CpuBackend;
    for (i, &(n, h)) in SHAPES.iter().enumerate() {
        let (e, k) = (6usize, 2usize);
        let logits = test_values(n * e, 30 + i as u64, 3.0);
        let x = test_values(n * h, 40 + i as u64, 2.0);
        let res = test_values(n * h, 50 + i as u64, 1.0);
        let y = test_values(n * k * h, 60 + i as u64, 1.5);
        let (rg, rc) = (route(&g, &logits, n, e, k), route(&c, &logits, n, e, k));
        // Gather: from f32 rows (rounding inside) vs from rows rounded before.
        let xd = g.upload_f32(&x).unwrap();
        let mut a = g.zeros_bf16(n * k * h).unwrap();
        g.gather_bf16(&xd, &rg, n, e, k, h, &mut a).unwrap();
        let mut xb = g.zeros_bf16(n * h).unwrap();
        g.to_bf16(&xd, &mut xb, n * h).unwrap();
        let mut b2 = g.empty_bf16(n * k * h).unwrap();
        g.gather_rows_bf16(&xb, &rg, n, e, k, h, &mut b2).unwrap();
        let dl = |v: &cudarc::driver::CudaSlice<u16>| g.gpu().download(v).unwrap();
        assert_eq!(
            dl(&a)[..n * k * h],
            dl(&b2)[..n * k * h],
            "gather [{n}, {h}]"
        );
        let mut cx = c.zeros_bf16(n * h).unwrap();
        c.to_bf16(&x, &mut cx, n * h).unwrap();
        let mut cg = c.zeros_bf16(n * k * h).unwrap();
        c.gather_rows_bf16(&cx, &rc, n, e, k, h, &mut cg).unwrap();
        let mut cg2 = c.zeros_bf16(n * k * h).unwrap();
        c.gather_bf16(&x, &rc, n, e, k, h, &mut cg2).unwrap();
        assert_eq!(bits(&cg), bits(&cg2));
        // Combine + residual.
        let (yd, rd) = (g.upload_f32(&y).unwrap(), g.upload_f32(&res).unwrap());
        let mut plain = g.zeros_f32(n * h).unwrap();
        g.combine(&yd, &rg, n, e, k, h, &mut plain).unwrap();
        g.add(&mut plain, &rd, n * h).unwrap();
        let mut fused = g.empty_f32(n * h).unwrap();
        g.combine_add(&yd, &rg, n, e, k, h, &rd, &mut fused)
            .unwrap();
        let got = g.download_f32(&fused, n * h).unwrap();
        assert_eq!(
            bits(&got),
            bits(&g.download_f32(&plain, n * h).unwrap()),
            "combine [{n}, {h}]"
        );
    }
}

/// `Backend::add_rmsnorm_bf16` on the CUDA backend (one launch: residual add, RMSNorm, BF16)
/// gives the bits of the ops it stands for run one by one on the same GPU
/// (`add_rmsnorm_bf16_ops`: `add`, then `rmsnorm_bf16`): the summed rows left in `x`, the
/// BF16 rows and the reciprocal RMS. The other backends' default is that composition itself.
#[test]
fn fused_add_rmsnorm_bf16_is_bitwise_the_ops_it_replaces() {
    use mxrl_tensor::device::add_rmsnorm_bf16_ops;
    let g = gpu();
    for (i, &(n, d)) in SHAPES.iter().enumerate() {
        let x = test_values(n * d, 70 + i as u64, 2.0);
        let res = test_values(n * d, 80 + i as u64, 2.0);
        let w = test_values(d, 90 + i as u64, 1.0);
        let (rd, wd) = (g.upload_f32(&res).unwrap(), g.upload_f32(&w).unwrap());
        let run = |fused: bool| {
            let mut xd = g.upload_f32(&x).unwrap();
            let mut out = g.empty_bf16(n * d).unwrap();
            let mut rstd = g.empty_f32(n).unwrap();
            let f = if fused {
                CudaBackend::add_rmsnorm_bf16
            } else {
                add_rmsnorm_bf16_ops::<CudaBackend>
            };
            f(&g, &mut xd, &rd, &wd, n, d, 1e-6, &mut out, &mut rstd).unwrap();
            (
                bits(&g.download_f32(&xd, n * d).unwrap()),
                g.download_bf16(&out, n * d).unwrap(),
                bits(&g.download_f32(&rstd, n).unwrap()),
            )
        };
        let (fused, ops) = (run(true), run(false));
        assert_eq!(fused.0, ops.0, "[{n}, {d}]: x + residual differs");
        assert_eq!(fused.1, ops.1, "[{n}, {d}]: BF16 rows differ");
        assert_eq!(fused.2, ops.2, "[{n}, {d}]: rstd differs");
    }
}

/// `Backend::attention_decode_bf16` on the CUDA backend (the combine pass also writes the
/// BF16 copy) gives the bits of `attention_decode` then `to_bf16` on the same GPU
/// (`attention_decode_bf16_ops`), for Qwen3's head layout and smaller ones, lengths of 0 (zero
/// rows), 1, several chunks and past the cache (NaN rows).
#[test]
fn fused_attention_decode_bf16_is_bitwise_the_ops_it_replaces() {
    use mxrl_tensor::attention::AttnShape;
    use mxrl_tensor::device::attention_decode_bf16_ops;
    let g = gpu();
    // (q heads, kv heads, head dim, max_len, lens)
    let cases: [(usize, usize, usize, usize, Vec<u32>); 3] = [
        (16, 4, 128, 200, vec![1, 0, 65, 200, 201]),
        (4, 2, 64, 64, vec![64, 3]),
        (3, 1, 6, 9, vec![9]),
    ];
    for (i, (hq, hkv, d, max_len, lens)) in cases.into_iter().enumerate() {
        let shape = AttnShape {
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
        };
        let batch = lens.len();
        let cache = batch * max_len * hkv * d;
        let to_bytes = |v: Vec<f32>| -> Vec<u8> {
            v.iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect()
        };
        let kc = g
            .upload_bf16_bytes(&to_bytes(test_values(cache, 100 + i as u64, 2.0)))
            .unwrap();
        let vc = g
            .upload_bf16_bytes(&to_bytes(test_values(cache, 110 + i as u64, 2.0)))
            .unwrap();
        let q = g
            .upload_f32(&test_values(batch * hq * d, 120 + i as u64, 2.0))
            .unwrap();
        let ld = g.upload_u32(&lens).unwrap();
        let m = batch * hq * d;
        let run = |fused: bool| {
            let mut out = g.empty_f32(m).unwrap();
            let mut outb = g.empty_bf16(m).unwrap();
            let f = if fused {
                CudaBackend::attention_decode_bf16
            } else {
                attention_decode_bf16_ops::<CudaBackend>
            };
            f(
                &g, &q, &kc, &vc, &ld, batch, max_len, shape, &mut out, &mut outb,
            )
            .unwrap();
            (
                bits(&g.download_f32(&out, m).unwrap()),
                g.download_bf16(&outb, m).unwrap(),
            )
        };
        let (fused, ops) = (run(true), run(false));
        assert_eq!(fused.0, ops.0, "case {i}: f32 output differs");
        assert_eq!(fused.1, ops.1, "case {i}: BF16 output differs");
    }
}

/// `Backend::route` on the CUDA backend at decode sizes (one launch: softmax, top-k, weights
/// and the expert-major dispatch) gives the bits of the two launchers it replaces on the same
/// GPU (`Router::forward` in Compute mode, then `Moe::dispatch`, each checked against the CPU
/// reference in `ops_router` / `ops_moe`): probabilities, ids, weights, offsets, perm and
/// row_of, with and without `norm_topk_prob`, at one token, the largest fused batch
/// (1024 entries), more than 256 experts and rows of tied logits; and again from a recorded
/// graph replayed three times (the ticket counter returns to 0 after every launch).
#[test]
fn fused_route_dispatch_is_bitwise_the_launches_it_replaces() {
    use mxrl_cuda::ops::moe::{dispatch_scratch_len, Moe};
    use mxrl_cuda::ops::router::{DeviceRouteMode, Router};
    let g = gpu();
    let router = Router::new(g.gpu()).unwrap();
    let moe = Moe::new(g.gpu()).unwrap();
    // (n, e, k)
    let cases = [
        (1usize, 64usize, 8usize),
        (7, 6, 2),
        (128, 64, 8),
        (33, 300, 4),
        (5, 128, 128),
        (64, 8, 1),
    ];
    let all = |b: &RouteBufs<CudaBackend>, n: usize, e: usize, k: usize| {
        let u = |x: &cudarc::driver::CudaSlice<u32>, m: usize| g.download_u32(x, m).unwrap();
        let f = |x: &cudarc::driver::CudaSlice<f32>, m: usize| bits(&g.download_f32(x, m).unwrap());
        [
            f(&b.probs, n * e),
            u(&b.ids, n * k),
            f(&b.weights, n * k),
            u(&b.offsets, e + 1),
            u(&b.perm, n * k),
            u(&b.row_of, n * k),
        ]
    };
    let names = ["probs", "ids", "weights", "offsets", "perm", "row_of"];
    for (i, &(n, e, k)) in cases.iter().enumerate() {
        for norm in [true, false] {
            let mut logits = test_values(n * e, 130 + i as u64, 3.0);
            // Ties: a row of equal logits, and a row with a tied pair at the top.
            if n > 2 {
                logits[..e].fill(0.25);
                logits[e] = 1.5;
                logits[e + 1] = 1.5;
            }
            let ld = g.upload_f32(&logits).unwrap();
            let bufs = || RouteBufs::<CudaBackend> {
                ids: g.zeros_u32(n * k).unwrap(),
                weights: g.zeros_f32(n * k).unwrap(),
                probs: g.zeros_f32(n * e).unwrap(),
                offsets: g.zeros_u32(e + 1).unwrap(),
                perm: g.zeros_u32(n * k).unwrap(),
                row_of: g.zeros_u32(n * k).unwrap(),
            };
            let mut want = bufs();
            router
                .forward(
                    &ld.as_view(),
                    DeviceRouteMode::Compute,
                    &mut want.probs.as_view_mut(),
                    &mut want.ids.as_view_mut(),
                    &mut want.weights.as_view_mut(),
                    n,
                    e,
                    k,
                    norm,
                )
                .unwrap();
            let mut scratch = g.zeros_u32(dispatch_scratch_len(n, k, e)).unwrap();
            moe.dispatch(
                &want.ids.as_view(),
                n,
                e,
                k,
                &mut scratch.as_view_mut(),
                &mut want.offsets.as_view_mut(),
                &mut want.perm.as_view_mut(),
                &mut want.row_of.as_view_mut(),
            )
            .unwrap();
            let want = all(&want, n, e, k);
            let ctx = format!("case {i} (n {n}, e {e}, k {k}, norm {norm})");
            // Twice in a row: the second launch finds the ticket back at 0.
            for rep in 0..2 {
                let mut got = bufs();
                g.route(&ld, n, e, k, norm, None, &mut got).unwrap();
                let got = all(&got, n, e, k);
                for (j, w) in names.iter().enumerate() {
                    assert_eq!(got[j], want[j], "{ctx}, call {rep}: {w} differs");
                }
            }
            let mut rec = bufs();
            g.synchronize().unwrap();
            assert!(
                g.begin_capture().unwrap(),
                "the CUDA backend records graphs"
            );
            g.route(&ld, n, e, k, norm, None, &mut rec).unwrap();
            let graph = g.end_capture().unwrap().expect("a recorded graph");
            for rep in 0..3 {
                g.launch_graph(&graph).unwrap();
                let got = all(&rec, n, e, k);
                for (j, w) in names.iter().enumerate() {
                    assert_eq!(got[j], want[j], "{ctx}, replay {rep}: {w} differs");
                }
            }
        }
    }
}

/// `Backend::combine_add_rmsnorm_bf16` on the CUDA backend (one launch, one block per token)
/// gives the bits of `combine_add` then `rmsnorm_bf16` on the same GPU
/// (`combine_add_rmsnorm_bf16_ops`): the residual stream, the BF16 rows and the reciprocal
/// RMS, on aligned and ragged widths, one token and many, and the decode shape (64 experts,
/// top 8, hidden 2048).
#[test]
fn fused_combine_add_rmsnorm_bf16_is_bitwise_the_ops_it_replaces() {
    use mxrl_tensor::device::combine_add_rmsnorm_bf16_ops;
    let g = gpu();
    let mut shapes: Vec<(usize, usize, usize, usize)> =
        SHAPES.iter().map(|&(n, h)| (n, h, 6, 2)).collect();
    shapes.push((1, 2048, 64, 8));
    shapes.push((32, 2048, 64, 8));
    for (i, &(n, h, e, k)) in shapes.iter().enumerate() {
        let logits = test_values(n * e, 140 + i as u64, 3.0);
        let res = test_values(n * h, 150 + i as u64, 1.0);
        let y = test_values(n * k * h, 160 + i as u64, 1.5);
        let w = test_values(h, 170 + i as u64, 1.0);
        let rg = route(&g, &logits, n, e, k);
        let (yd, rd, wd) = (
            g.upload_f32(&y).unwrap(),
            g.upload_f32(&res).unwrap(),
            g.upload_f32(&w).unwrap(),
        );
        let run = |fused: bool| {
            let mut out = g.empty_f32(n * h).unwrap();
            let mut outb = g.empty_bf16(n * h).unwrap();
            let mut rstd = g.empty_f32(n).unwrap();
            let f = if fused {
                CudaBackend::combine_add_rmsnorm_bf16
            } else {
                combine_add_rmsnorm_bf16_ops::<CudaBackend>
            };
            f(
                &g, &yd, &rg, n, e, k, h, &rd, &wd, 1e-6, &mut out, &mut outb, &mut rstd,
            )
            .unwrap();
            (
                bits(&g.download_f32(&out, n * h).unwrap()),
                g.download_bf16(&outb, n * h).unwrap(),
                bits(&g.download_f32(&rstd, n).unwrap()),
            )
        };
        let (fused, ops) = (run(true), run(false));
        let ctx = format!("[{n}, {h}], {e} experts, top {k}");
        assert_eq!(fused.0, ops.0, "{ctx}: combined rows differ");
        assert_eq!(fused.1, ops.1, "{ctx}: BF16 rows differ");
        assert_eq!(fused.2, ops.2, "{ctx}: rstd differs");
    }
}
