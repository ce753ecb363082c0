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

/// Sizes of the tensors of one step: multiples of 8 (8 192, 4 096) take the eight-element
/// AdamW kernel, the others the grid-stride one.
const SIZES: &[usize] = &[0, 1, 257, 70_001, 8_192, 3, 4_096];

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

/// A gradient norm whose buffers are handed in early — on the second stream, in any order,
/// some never (summed by the finishing call) — has `grad_norm`'s bits. Each handed-in buffer
/// was rewritten on the main stream just before (`scale` by 2, several times, the last queued
/// right before the hand-in): a second stream that did not wait for the main one would sum
/// older values, and a final sum that did not wait for the second stream would read partials
/// not yet written (zeros). Bad hand-ins are refused.
#[test]
fn grad_norm_handed_in_early_has_the_bits_of_grad_norm() {
    let g = gpu();
    let ops = Optim::new(&g).unwrap();
    // Past 2 048 blocks of 256 (the stage-1 cap) too, so a buffer spans many partial slots.
    let sizes: &[usize] = &[0, 1, 257, 70_001, 8_192, 3, 600_000, 4_096];
    let two = g.upload(&[2.0f32]).unwrap();
    let orders: [&[usize]; 3] = [&[6, 1, 3], &[0, 1, 2, 3, 4, 5, 6, 7], &[7, 5, 3, 6, 2]];
    for (case, order) in orders.into_iter().enumerate() {
        let mut dev: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| g.upload(&values(n, 40 + i as u64, 0.5)).unwrap())
            .collect();
        let mut parts = ops.grad_norm_begin(sizes).unwrap();
        for (k, &i) in order.iter().enumerate() {
            for _ in 0..3 {
                ops.scale(&mut dev[i].as_view_mut(), &two.as_view(), sizes[i])
                    .unwrap();
            }
            // On the second stream, every third on the main stream.
            let bufs = vec![(i, dev[i].as_view())];
            ops.grad_norm_add(&mut parts, &bufs, k % 3 != 2).unwrap();
        }
        let views: Vec<_> = dev.iter().map(|d| d.as_view()).collect();
        let early = ops
            .grad_norm_finish(parts, &views, sizes, Some(1.0))
            .unwrap();
        let plain = ops.grad_norm(&views, sizes, Some(1.0)).unwrap();
        let (e, p) = (
            g.download(&early.norm).unwrap()[0],
            g.download(&plain.norm).unwrap()[0],
        );
        assert_eq!(e.to_bits(), p.to_bits(), "case {case}: norm {e} vs {p}");
        assert_eq!(
            g.download(&early.scale).unwrap()[0].to_bits(),
            g.download(&plain.scale).unwrap()[0].to_bits(),
            "case {case}: clipping coefficient"
        );
        // And the norm of the values as rewritten (8 times the first ones where scaled).
        let host: Vec<Vec<f32>> = dev
            .iter()
            .zip(sizes)
            .map(|(d, &n)| g.download(d).unwrap()[..n].to_vec())
            .collect();
        let want = global_grad_norm(&host.iter().map(|x| x.as_slice()).collect::<Vec<_>>());
        let bound = norm_bound(&host);
        assert!(
            (e - want).abs() <= bound,
            "case {case}: norm {e} vs reference {want}, bound {bound:e}"
        );
    }
    // Refusals: an index past the list, a buffer twice, a short buffer, other lengths.
    let dev: Vec<_> = sizes
        .iter()
        .map(|&n| g.upload(&values(n, 7, 1.0)).unwrap())
        .collect();
    let mut parts = ops.grad_norm_begin(sizes).unwrap();
    let past = ops.grad_norm_add(&mut parts, &[(sizes.len(), dev[1].as_view())], true);
    assert!(past.is_err(), "an index past the list is refused");
    ops.grad_norm_add(&mut parts, &[(3, dev[3].as_view())], true)
        .unwrap();
    let twice = ops.grad_norm_add(&mut parts, &[(3, dev[3].as_view())], true);
    assert!(twice.is_err(), "a buffer handed in twice is refused");
    let pair = [(4, dev[4].as_view()), (4, dev[4].as_view())];
    let listed_twice = ops.grad_norm_add(&mut parts, &pair, true);
    assert!(
        listed_twice.is_err(),
        "a buffer listed twice in one call is refused"
    );
    let short = ops.grad_norm_add(&mut parts, &[(6, dev[2].as_view())], true);
    assert!(short.is_err(), "a short buffer is refused");
    let views: Vec<_> = dev.iter().map(|d| d.as_view()).collect();
    let other = ops.grad_norm_finish(parts, &views[1..], &sizes[1..], None);
    assert!(
        other.is_err(),
        "lengths other than the begun ones are refused"
    );
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
    let wds = [0.0f32, 0.1, 0.01, 0.05, 0.02, 0.0, 0.0];
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
            // The last two tensors have no BF16 copy (norm weights): their buffers stay zero.
            let with_copy = i + 2 < SIZES.len();
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

/// f32 bit patterns with every NaN as one value: a NaN's payload is the hardware's (the GPU
/// writes its canonical NaN where the CPU keeps an operand's), so NaN compares as NaN.
fn nan_as_one(x: &[f32]) -> Vec<u32> {
    x.iter()
        .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
        .collect()
}

/// BF16 bit patterns with every NaN as one value (see [`nan_as_one`]).
fn bf16_nan_as_one(x: &[u16]) -> Vec<u16> {
    x.iter()
        .map(|&b| if b & 0x7FFF > 0x7F80 { u16::MAX } else { b })
        .collect()
}

/// E4M3 codes with both NaN codes (0x7F, 0xFF: the sign of a NaN is the hardware's) as one.
fn e4m3_nan_as_one(x: &[u8]) -> Vec<u8> {
    x.iter()
        .map(|&c| if c & 0x7F == 0x7F { u8::MAX } else { c })
        .collect()
}

/// The AdamW settings of the optimizer-pass tests.
const PASS_CFG: AdamWConfig = AdamWConfig {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
};

/// One case of an optimizer pass that also quantizes: the host master, moments and gradient
/// (seeded as every pass test seeds them), their device copies and a BF16 copy buffer; the
/// reference step on the host and the bitwise checks of what the pass wrote.
struct PassCase {
    n: usize,
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<f32>,
}

impl PassCase {
    /// `n` values from `seed`: the master of magnitude `scale`, the moments, the gradient.
    fn new(n: usize, seed: u64, scale: f32) -> Self {
        PassCase {
            n,
            p: values(n, seed, scale),
            m: values(n, seed + 10, 0.01),
            v: values(n, seed + 20, 1e-3).iter().map(|x| x * x).collect(),
            grad: values(n, seed + 30, 0.5),
        }
    }

    /// Uploads the state, runs `pass` on it (with the BF16 copy when `copy`), then steps the
    /// host state with `adamw_update` on the gradient times `grad_scale` and checks the
    /// device's master, moments (bitwise, NaN as NaN) and BF16 copy (`round_bf16` of the new
    /// master; zeros when not asked). Returns what `pass` returned.
    #[allow(clippy::too_many_arguments)]
    fn run<R>(
        &mut self,
        g: &Gpu,
        what: &str,
        copy: bool,
        grad_scale: f32,
        step: u64,
        cfg: &AdamWConfig,
        wd: f32,
        pass: impl FnOnce(AdamWParam<'_, '_>, &cudarc::driver::CudaView<'_, f32>) -> R,
    ) -> R {
        let n = self.n;
        let (mut dp, dg) = (g.upload(&self.p).unwrap(), g.upload(&self.grad).unwrap());
        let (mut dm, mut dv) = (g.upload(&self.m).unwrap(), g.upload(&self.v).unwrap());
        let mut db = g.zeros::<u16>(n.max(1)).unwrap();
        let sc = g.upload(&[grad_scale]).unwrap();
        let out = {
            let mut bview = db.as_view_mut();
            pass(
                AdamWParam {
                    param: &mut dp.as_view_mut(),
                    grad: &dg.as_view(),
                    m: &mut dm.as_view_mut(),
                    v: &mut dv.as_view_mut(),
                    param_bf16: copy.then_some(&mut bview),
                    n,
                    weight_decay: wd,
                },
                &sc.as_view(),
            )
        };
        let gs: Vec<f32> = self.grad.iter().map(|&x| x * grad_scale).collect();
        adamw_update(&mut self.p, &gs, &mut self.m, &mut self.v, step, cfg, wd);
        let bits = nan_as_one;
        assert_eq!(
            bits(&g.download(&dp).unwrap()[..n]),
            bits(&self.p),
            "{what}: master"
        );
        assert_eq!(
            bits(&g.download(&dm).unwrap()[..n]),
            bits(&self.m),
            "{what}: m"
        );
        assert_eq!(
            bits(&g.download(&dv).unwrap()[..n]),
            bits(&self.v),
            "{what}: v"
        );
        let want_copy: Vec<u16> = if copy {
            self.p
                .iter()
                .map(|&x| (round_bf16(x).to_bits() >> 16) as u16)
                .collect()
        } else {
            vec![0; n]
        };
        assert_eq!(
            bf16_nan_as_one(&g.download(&db).unwrap()[..n]),
            bf16_nan_as_one(&want_copy),
            "{what}: BF16 copy"
        );
        out
    }
}

/// The MXFP8 weights' optimizer step in one pass (`QGemm::adamw_mxfp8`) against its
/// references step by step (NaN compared as NaN): `adamw_update` (master, moments:
/// bitwise), `round_bf16` (the copy), the contract's row-wise MXFP8 quantizer (codes and
/// scale bytes: byte-equal), the contract dequantization rounded to BF16 (the forward
/// operand) and the fast-decode rule (no NaN code, no scale byte above 134). The weights mix
/// ordinary rows with blocks of zeros, huge values (scale bytes above 134), tiny ones (subnormal E4M3 codes and scale
/// bytes below 3, whose BF16 operand is rounded) and a NaN gradient (NaN codes). Where asked,
/// the same pass writes the column-wise operand: the contract's column-wise MXFP8 of the new
/// master, dequantized and rounded to BF16.
#[test]
fn adamw_mxfp8_is_adamw_update_then_the_contract_quantizer() {
    use mxrl_cuda::ops::qgemm::QGemm;
    use mxrl_formats::{reference, Padding, Scheme};
    let g = gpu();
    let q = QGemm::new(&g).unwrap();
    let cfg = PASS_CFG;
    let bf = |x: f32| (round_bf16(x).to_bits() >> 16) as u16;
    // (rows, k, special values, a BF16 copy, the column-wise operand): rows of 64 and 2048
    // columns, the launch's last warp part-filled (rows·k/8 not a multiple of 32), an empty
    // stack, and whole 32 × 64 tiles with the column-wise operand.
    for (case, &(rows, k, special, copy, with_col)) in [
        (3usize, 64usize, true, true, false),
        (37, 2048, true, false, false),
        (5, 96, false, true, false),
        (0, 32, false, true, false),
        (64, 128, true, true, true),
        (96, 2048, false, false, true),
    ]
    .iter()
    .enumerate()
    {
        let n = rows * k;
        let mut c = PassCase::new(n, 500 + case as u64, 1.0);
        if special {
            // Block 0 of row 0 zero (master, moments and gradient: stays 0 without decay);
            // block 1 huge; block 0 of the last row tiny; one NaN gradient in row 1.
            for i in 0..32 {
                c.p[i] = 0.0;
                c.m[i] = 0.0;
                c.v[i] = 0.0;
                c.grad[i] = 0.0;
                c.p[32 + i] = 3.0e37 * (1.0 + i as f32 / 64.0);
                let t = (rows - 1) * k + i;
                c.p[t] = 1.0e-39 * (i as f32 - 16.0);
                c.m[t] = 0.0;
                c.grad[t] = 0.0;
            }
            c.grad[k + 7] = f32::NAN;
        }
        let wd = if special { 0.0 } else { 0.1 };
        let mut codes = g.zeros::<u8>(n.max(8)).unwrap();
        let mut scales = g.zeros::<u8>((n / 32).max(1)).unwrap();
        let mut deq = g.zeros::<u16>(n.max(1)).unwrap();
        let mut col = g.zeros::<u16>(n.max(1)).unwrap();
        let mut cview = col.as_view_mut();
        let step = 3;
        let what = format!("case {case} ({rows}×{k})");
        let flag = c.run(&g, &what, copy, 0.75, step, &cfg, wd, |p, scale| {
            q.adamw_mxfp8(
                p,
                scale,
                step,
                &cfg,
                k,
                &mut codes.as_view_mut(),
                &mut scales.as_view_mut(),
                Some(&mut deq.as_view_mut()),
                with_col.then_some(&mut cview),
            )
            .unwrap()
        });
        let p = &c.p;
        let (want_codes, want_scales, want_deq) = if n == 0 {
            (vec![], vec![], vec![])
        } else {
            let t = reference::quantize(p, &[rows, k], Scheme::MXFP8_ROW, Padding::Reject).unwrap();
            let d: Vec<u16> = t.dequantize().unwrap().iter().map(|&x| bf(x)).collect();
            (t.data.clone(), t.scales.as_bytes().unwrap().to_vec(), d)
        };
        assert_eq!(
            e4m3_nan_as_one(&g.download(&codes).unwrap()[..n]),
            e4m3_nan_as_one(&want_codes),
            "{what}: codes"
        );
        assert_eq!(
            &g.download(&scales).unwrap()[..n / 32],
            &want_scales[..],
            "{what}: scale bytes"
        );
        assert_eq!(
            bf16_nan_as_one(&g.download(&deq).unwrap()[..n]),
            bf16_nan_as_one(&want_deq),
            "{what}: operand"
        );
        if with_col {
            let t = reference::quantize(p, &[rows, k], Scheme::MXFP8_COL, Padding::Reject).unwrap();
            let want: Vec<u16> = t.dequantize().unwrap().iter().map(|&x| bf(x)).collect();
            assert_eq!(
                bf16_nan_as_one(&g.download(&col).unwrap()[..n]),
                bf16_nan_as_one(&want),
                "{what}: column-wise operand"
            );
        }
        let fast =
            !want_codes.iter().any(|&c| c & 0x7F == 0x7F) && want_scales.iter().all(|&s| s <= 134);
        if special {
            assert!(!fast, "{what}: the special values rule the fast decode out");
            assert!(
                want_codes.iter().any(|&c| c & 0x7F == 0x7F),
                "{what}: a NaN code"
            );
        }
        assert_eq!(
            g.download(&flag).unwrap()[0] == 0,
            fast,
            "{what}: fast-decode flag"
        );
    }
}

/// The NVFP4 weights' optimizer step (`QGemm::adamw_amax_groups`) against `adamw_update`
/// (bitwise; NaN as NaN) and each weight's amax of its new values (NaN ignored, the
/// contract's rule) as f32 bits: weights whose boundaries fall inside a warp's span (group
/// lengths of 48 and 136 elements) and weights of whole warps (one atomic per warp), an
/// all-zero weight (amax 0), a NaN gradient (ignored by the amax unless every value is NaN)
/// and an infinite one.
#[test]
fn adamw_amax_groups_is_adamw_update_then_each_weights_amax() {
    use mxrl_cuda::ops::qgemm::QGemm;
    let g = gpu();
    let q = QGemm::new(&g).unwrap();
    let cfg = PASS_CFG;
    for (case, &(groups, len)) in [(7usize, 48usize), (3, 136), (2, 4096), (16, 256), (0, 16)]
        .iter()
        .enumerate()
    {
        let n = groups * len;
        let mut c = PassCase::new(n, 600 + case as u64, 2.0);
        // Each weight's largest value in an odd lane's eight of its warp (a warp's lanes
        // hold 256 consecutive values), so a reduction that skips lanes is seen.
        for w in 0..groups {
            let lane = 2 * (w % 16) + 1;
            c.p[w * len + (8 * lane + 3) % len] = 10.0 + w as f32;
        }
        if groups >= 2 {
            for i in 0..len {
                c.p[i] = 0.0;
                c.m[i] = 0.0;
                c.v[i] = 0.0;
                c.grad[i] = 0.0;
            }
            c.grad[len + 5] = f32::NAN;
            c.grad[n - 1] = f32::INFINITY;
        }
        let step = 2;
        let what = format!("case {case} ({groups} × {len})");
        let amax = c.run(&g, &what, true, 1.0, step, &cfg, 0.0, |p, scale| {
            q.adamw_amax_groups(p, scale, step, &cfg, len).unwrap()
        });
        let p = &c.p;
        let want: Vec<u32> = p
            .chunks(len)
            .map(|w| {
                w.iter()
                    .fold(0.0f32, |a, &x| if x.abs() > a { x.abs() } else { a })
                    .to_bits()
            })
            .collect();
        if groups >= 2 {
            assert_eq!(want[0], 0, "{what}: the zero weight");
            assert!(p[len + 5].is_nan(), "{what}: a NaN value");
        }
        assert_eq!(
            &g.download(&amax).unwrap()[..groups],
            &want[..],
            "{what}: amax"
        );
    }
}

/// The FP8-block weights' optimizer step in one pass (`QGemm::adamw_fp8_block`) against its
/// references step by step (NaN compared as NaN): `adamw_update` (master, moments: bitwise),
/// `round_bf16` (the copy) and the contract's 128×128-tile quantizer of the new master
/// (`Scheme::FP8_BLOCK_WEIGHT`: codes byte-equal, `scale_inv` bit-equal). One tile, several
/// tiles over rows and columns, and an empty stack; the special case holds a tile whose
/// values are all zero (scale 1), one of huge values, one of values below E4M3's subnormals
/// and a NaN gradient (a NaN code, ignored by its tile's amax). Row counts or K that are not
/// multiples of 128 are refused.
#[test]
fn adamw_fp8_block_is_adamw_update_then_the_contract_quantizer() {
    use mxrl_cuda::ops::qgemm::QGemm;
    use mxrl_formats::{reference, Padding, Scales, Scheme};
    let g = gpu();
    let q = QGemm::new(&g).unwrap();
    let cfg = PASS_CFG;
    for (case, &(rows, k, special, copy)) in [
        (128usize, 128usize, false, true),
        (256, 384, true, false),
        (384, 256, true, true),
        (0, 128, false, true),
    ]
    .iter()
    .enumerate()
    {
        let n = rows * k;
        let mut c = PassCase::new(n, 700 + case as u64, 1.0);
        if special {
            // Tile (0, 0) all zero (master, moments and gradient: stays 0 without decay); tile
            // (0, 1) huge; tile (1, 0) tiny; one NaN gradient in tile (1, 1).
            for r in 0..128 {
                for col in 0..128 {
                    let z = r * k + col;
                    c.p[z] = 0.0;
                    c.m[z] = 0.0;
                    c.v[z] = 0.0;
                    c.grad[z] = 0.0;
                    c.p[r * k + 128 + col] = 3.0e37 * (1.0 + col as f32 / 256.0);
                    let t = (128 + r) * k + col;
                    c.p[t] = 1.0e-39 * (col as f32 - 64.0);
                    c.m[t] = 0.0;
                    c.grad[t] = 0.0;
                }
            }
            c.grad[130 * k + 131] = f32::NAN;
        }
        let wd = if special { 0.0 } else { 0.1 };
        let mut codes = g.zeros::<u8>(n.max(8)).unwrap();
        let tiles = rows / 128 * (k / 128);
        let mut scales = g.zeros::<u8>((4 * tiles).max(4)).unwrap();
        let step = 4;
        let what = format!("case {case} ({rows}×{k})");
        c.run(&g, &what, copy, 0.75, step, &cfg, wd, |p, scale| {
            q.adamw_fp8_block(
                p,
                scale,
                step,
                &cfg,
                k,
                &mut codes.as_view_mut(),
                &mut scales.as_view_mut(),
            )
            .unwrap()
        });
        let p = &c.p;
        if n == 0 {
            continue;
        }
        let t =
            reference::quantize(p, &[rows, k], Scheme::FP8_BLOCK_WEIGHT, Padding::Reject).unwrap();
        assert_eq!(
            e4m3_nan_as_one(&g.download(&codes).unwrap()[..n]),
            e4m3_nan_as_one(&t.data),
            "{what}: codes"
        );
        let Scales::F32(want_scales) = &t.scales else {
            panic!("FP8-block scales are f32")
        };
        let got: Vec<u32> = g.download(&scales).unwrap()[..4 * tiles]
            .chunks(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want: Vec<u32> = want_scales.iter().map(|s| s.to_bits()).collect();
        assert_eq!(got, want, "{what}: scale_inv");
        if special {
            assert!(
                t.data.iter().any(|&c| c & 0x7F == 0x7F),
                "{what}: a NaN code"
            );
            assert_eq!(want_scales[0], 1.0, "{what}: the zero tile's scale_inv");
        }
    }
    // Shapes off the tiles are refused.
    for (rows, k) in [(64usize, 128usize), (128, 96)] {
        let n = rows * k;
        let (mut dp, dg) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
        let (mut dm, mut dv) = (g.zeros::<f32>(n).unwrap(), g.zeros::<f32>(n).unwrap());
        let mut codes = g.zeros::<u8>(n).unwrap();
        let mut scales = g.zeros::<u8>(64).unwrap();
        let scale = g.upload(&[1.0f32]).unwrap();
        let e = q
            .adamw_fp8_block(
                AdamWParam {
                    param: &mut dp.as_view_mut(),
                    grad: &dg.as_view(),
                    m: &mut dm.as_view_mut(),
                    v: &mut dv.as_view_mut(),
                    param_bf16: None,
                    n,
                    weight_decay: 0.0,
                },
                &scale.as_view(),
                1,
                &cfg,
                k,
                &mut codes.as_view_mut(),
                &mut scales.as_view_mut(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("adamw_fp8_block"), "[{rows}, {k}]: {e}");
    }
}
