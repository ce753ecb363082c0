//! AdamW (with the BF16 copy), the global gradient norm and clipping on the GPU against
//! `mxrl_tensor::optim::{adamw_update, global_grad_norm, clip_grad_norm}`: AdamW and the scaling
//! bitwise (same f32 operations in the same order, IEEE `sqrt` and division), the norm within
//! the f64 reordering bound of `mxrl_tensor::tolerance`.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::optim::{AdamWParam, Optim};
use mxrl_tensor::optim::{adamw_update, clip_grad_norm, global_grad_norm, AdamWConfig};
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::tolerance::{two_order_sum_bound_f64, F64_UNIT_ROUNDOFF};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, scale)
}

const SIZES: &[usize] = &[0, 1, 257, 70_001, 3];

/// The device norm and the reference's, and the bound between them (sum of exact f64 squares
/// in two orders, then a correctly rounded sqrt on each side: `Δ√S ≤ ΔS/(2√S) + 2u·√S`).
fn norm_bound(grads: &[Vec<f32>]) -> f64 {
    let n: usize = grads.iter().map(|g| g.len()).sum();
    let s: f64 = grads
        .iter()
        .flatten()
        .map(|&x| (x as f64) * (x as f64))
        .sum();
    let ds = two_order_sum_bound_f64(n, s);
    let norm = s.sqrt();
    (if norm > 0.0 {
        ds / (2.0 * norm)
    } else {
        ds.sqrt()
    }) + 2.0 * F64_UNIT_ROUNDOFF * norm
}

#[test]
fn grad_norm_matches_global_grad_norm_and_clip_scale() {
    let g = gpu();
    let ops = Optim::new(&g).unwrap();
    for seed in [1u64, 2, 3] {
        let grads: Vec<Vec<f32>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| values(n, seed * 10 + i as u64, 0.5 + i as f32))
            .collect();
        let dev: Vec<_> = grads.iter().map(|x| g.upload(x).unwrap()).collect();
        let views: Vec<_> = dev.iter().map(|d| d.as_view()).collect();
        let want = global_grad_norm(&grads.iter().map(|x| x.as_slice()).collect::<Vec<_>>());
        let bound = norm_bound(&grads);
        for max_norm in [None, Some(1.0), Some(1e6)] {
            let r = ops.grad_norm(&views, SIZES, max_norm).unwrap();
            let got = g.download(&r.norm).unwrap()[0];
            assert!(
                (got - want).abs() <= bound,
                "seed {seed}: norm {got} vs reference {want}, bound {bound:e}"
            );
            let scale = g.download(&r.scale).unwrap()[0];
            assert_eq!(
                ops.grad_norm_host(&views, SIZES).unwrap().to_bits(),
                got.to_bits(),
                "the host entry returns the same norm"
            );
            // The reference's clipping of the same grads: same coefficient to within the
            // coefficient's sensitivity to the norm difference plus one f32 rounding.
            let mut cpu = grads.clone();
            let mut refs: Vec<&mut [f32]> = cpu.iter_mut().map(|x| x.as_mut_slice()).collect();
            clip_grad_norm(&mut refs, max_norm.unwrap_or(f64::INFINITY));
            let want_scale = match max_norm {
                Some(mn) if mn / (want + 1e-6) < 1.0 => (mn / (want + 1e-6)) as f32,
                _ => 1.0,
            };
            let dcoef = max_norm.map_or(0.0, |mn| mn * bound / (want * want)) * 1.01;
            let ulp = (want_scale.to_bits() + 1) as f64;
            let ulp = f32::from_bits(ulp as u32) as f64 - want_scale as f64;
            assert!(
                ((scale - want_scale) as f64).abs() <= dcoef + ulp,
                "seed {seed} max_norm {max_norm:?}: scale {scale} vs {want_scale}"
            );
            // Scaling on the device is bitwise x·scale; with the reference's own coefficient
            // it reproduces clip_grad_norm's output.
            for (i, x) in grads.iter().enumerate() {
                let mut d = g.upload(x).unwrap();
                ops.scale(&mut d.as_view_mut(), &r.scale.as_view(), x.len())
                    .unwrap();
                let got = g.download(&d).unwrap();
                for (j, (&a, &b)) in got.iter().zip(x).enumerate().take(x.len()) {
                    assert_eq!(a.to_bits(), (b * scale).to_bits(), "buffer {i} [{j}]");
                    if scale == want_scale {
                        assert_eq!(a.to_bits(), cpu[i][j].to_bits(), "buffer {i} [{j}]");
                    }
                }
            }
        }
    }
}

#[test]
fn adamw_step_is_bitwise_adamw_update_with_bf16_copy() {
    let g = gpu();
    let ops = Optim::new(&g).unwrap();
    let cfg = AdamWConfig {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
    };
    let wds = [0.0f32, 0.1, 0.01, 0.05, 0.0];
    let mut p: Vec<Vec<f32>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| values(n, 40 + i as u64, 1.0))
        .collect();
    let mut m: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.0; n]).collect();
    let mut v: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.0; n]).collect();
    let mut dp: Vec<_> = p.iter().map(|x| g.upload(x).unwrap()).collect();
    let mut dm: Vec<_> = m.iter().map(|x| g.upload(x).unwrap()).collect();
    let mut dv: Vec<_> = v.iter().map(|x| g.upload(x).unwrap()).collect();
    let mut db: Vec<_> = SIZES.iter().map(|&n| g.zeros::<u16>(n).unwrap()).collect();
    for step in 1..=4u64 {
        let grads: Vec<Vec<f32>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| values(n, step * 100 + i as u64, 2.0))
            .collect();
        let dg: Vec<_> = grads.iter().map(|x| g.upload(x).unwrap()).collect();
        // Steps 3 and 4 clip (max norm 1 is below every gradient norm here).
        let views: Vec<_> = dg.iter().map(|d| d.as_view()).collect();
        let r = ops
            .grad_norm(&views, SIZES, (step >= 3).then_some(1.0))
            .unwrap();
        let scale = g.download(&r.scale).unwrap()[0];
        if step >= 3 {
            assert!(scale < 1.0, "step {step}: clipping expected");
        }
        for i in 0..SIZES.len() {
            let n = SIZES[i];
            // The last tensor has no BF16 copy (a norm weight): its buffer stays zero.
            let with_copy = i + 1 < SIZES.len();
            let mut bview = db[i].as_view_mut();
            let param = AdamWParam {
                param: &mut dp[i].as_view_mut(),
                grad: &dg[i].as_view(),
                m: &mut dm[i].as_view_mut(),
                v: &mut dv[i].as_view_mut(),
                param_bf16: with_copy.then_some(&mut bview),
                n,
                weight_decay: wds[i],
            };
            // Unclipped steps through the convenience entry (scale 1), clipped ones with the
            // device coefficient.
            if step <= 2 {
                ops.adamw(param, step, &cfg).unwrap();
            } else {
                ops.adamw_step(param, &r.scale.as_view(), step, &cfg)
                    .unwrap();
            }
            let gs: Vec<f32> = grads[i].iter().map(|&x| x * scale).collect();
            adamw_update(&mut p[i], &gs, &mut m[i], &mut v[i], step, &cfg, wds[i]);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let gp = g.download(&dp[i]).unwrap();
            let gm = g.download(&dm[i]).unwrap();
            let gv = g.download(&dv[i]).unwrap();
            let gb = g.download(&db[i]).unwrap();
            assert_eq!(bits(&gp[..n]), bits(&p[i]), "param {i} step {step}");
            assert_eq!(bits(&gm[..n]), bits(&m[i]), "m {i} step {step}");
            assert_eq!(bits(&gv[..n]), bits(&v[i]), "v {i} step {step}");
            let want_b: Vec<u16> = if with_copy {
                p[i].iter()
                    .map(|&x| (round_bf16(x).to_bits() >> 16) as u16)
                    .collect()
            } else {
                vec![0; n]
            };
            assert_eq!(&gb[..n], &want_b[..], "bf16 copy {i} step {step}");
        }
    }
}

#[test]
fn optim_rejects_step_zero_and_short_buffers() {
    let g = gpu();
    let ops = Optim::new(&g).unwrap();
    let mut a = g.zeros::<f32>(4).unwrap();
    let gr = g.zeros::<f32>(4).unwrap();
    let mut m = g.zeros::<f32>(4).unwrap();
    let mut v = g.zeros::<f32>(3).unwrap();
    let mut b = g.zeros::<u16>(4).unwrap();
    let one = g.upload(&[1.0f32]).unwrap();
    let mut run = |step: u64| {
        ops.adamw_step(
            AdamWParam {
                param: &mut a.as_view_mut(),
                grad: &gr.as_view(),
                m: &mut m.as_view_mut(),
                v: &mut v.as_view_mut(),
                param_bf16: Some(&mut b.as_view_mut()),
                n: 4,
                weight_decay: 0.0,
            },
            &one.as_view(),
            step,
            &AdamWConfig::default(),
        )
    };
    assert!(run(0).is_err());
    let e = run(1).unwrap_err().to_string();
    assert!(e.contains("adamw v"), "{e}");
}
