//! The fused ops of the CUDA backend (RMSNorm → BF16, RMSNorm → f32 and BF16, residual add →
//! RMSNorm, gather of BF16 rows, combine + residual)
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
fn rmsnorm_bf16_and_rmsnorm_both_are_rmsnorm_then_to_bf16_bitwise() {
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
        // Both outputs of one pass: the f32 rows and their rounding (fresh NaN-filled
        // buffers, so an element the kernel leaves unwritten fails).
        let mut both = g.upload_f32(&vec![f32::NAN; n * d]).unwrap();
        let mut both_b = g.empty_bf16(n * d).unwrap();
        g.to_bf16(&both, &mut both_b, n * d).unwrap();
        let mut r3 = g.upload_f32(&vec![f32::NAN; n]).unwrap();
        g.rmsnorm_both(&xd, &wd, n, d, 1e-6, &mut both, &mut both_b, &mut r3)
            .unwrap();
        assert_eq!(
            bits(&g.download_f32(&both, n * d).unwrap()),
            bits(&g.download_f32(&y, n * d).unwrap()),
            "rmsnorm_both f32 [{n}, {d}]"
        );
        assert_eq!(
            gpu_bits(&both_b)[..n * d],
            gpu_bits(&yb)[..n * d],
            "rmsnorm_both bf16 [{n}, {d}]"
        );
        assert_eq!(
            bits(&g.download_f32(&r3, n).unwrap()),
            bits(&g.download_f32(&r1, n).unwrap())
        );
    }
}

#[test]
fn add_rmsnorm_is_add_then_rmsnorm_bitwise() {
    let g = gpu();
    for (i, &(n, d)) in SHAPES.iter().enumerate() {
        let (o, res) = (
            test_values(n * d, 70 + i as u64, 2.0),
            test_values(n * d, 80 + i as u64, 1.5),
        );
        let w = test_values(d, 90 + i as u64, 1.0);
        let (resd, wd) = (g.upload_f32(&res).unwrap(), g.upload_f32(&w).unwrap());
        // Unfused: add, then the norm with both outputs (each checked against the single
        // ones above).
        let mut x1 = g.upload_f32(&o).unwrap();
        g.add(&mut x1, &resd, n * d).unwrap();
        let mut y1 = g.empty_f32(n * d).unwrap();
        let mut yb1 = g.empty_bf16(n * d).unwrap();
        let mut r1 = g.empty_f32(n).unwrap();
        g.rmsnorm_both(&x1, &wd, n, d, 1e-6, &mut y1, &mut yb1, &mut r1)
            .unwrap();
        let bf =
            |v: &cudarc::driver::CudaSlice<u16>| g.gpu().download(v).unwrap()[..n * d].to_vec();
        let f = |v: &cudarc::driver::CudaSlice<f32>, m: usize| bits(&g.download_f32(v, m).unwrap());
        for (want_f32, want_bf16) in [(true, true), (true, false), (false, true)] {
            let ctx = format!("[{n}, {d}], f32 {want_f32}, bf16 {want_bf16}");
            // Fresh NaN-filled outputs: an element left unwritten fails.
            let mut x2 = g.upload_f32(&o).unwrap();
            let mut y2 = g.upload_f32(&vec![f32::NAN; n * d]).unwrap();
            let mut yb2 = g.empty_bf16(n * d).unwrap();
            g.to_bf16(&y2, &mut yb2, n * d).unwrap();
            let mut r2 = g.upload_f32(&vec![f32::NAN; n]).unwrap();
            g.add_rmsnorm(
                &mut x2,
                &resd,
                &wd,
                n,
                d,
                1e-6,
                want_f32.then_some(&mut y2),
                want_bf16.then_some(&mut yb2),
                &mut r2,
            )
            .unwrap();
            assert_eq!(f(&x2, n * d), f(&x1, n * d), "{ctx}: the residual sum");
            assert_eq!(f(&r2, n), f(&r1, n), "{ctx}: rstd");
            if want_f32 {
                assert_eq!(f(&y2, n * d), f(&y1, n * d), "{ctx}: f32 rows");
            }
            if want_bf16 {
                assert_eq!(bf(&yb2), bf(&yb1), "{ctx}: BF16 rows");
            }
        }
        let mut x3 = g.upload_f32(&o).unwrap();
        let mut r3 = g.empty_f32(n).unwrap();
        let none = g.add_rmsnorm(&mut x3, &resd, &wd, n, d, 1e-6, None, None, &mut r3);
        assert!(none.is_err(), "[{n}, {d}]: no output must be refused");
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
