//! Elementwise ops and the embedding gather on the GPU against their CPU references (bitwise:
//! no reductions involved).
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::elementwise::Elementwise;
use mxrl_tensor::precision::round_bf16;

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, 3.0)
}

#[test]
fn to_bf16_matches_round_bf16_on_every_class() {
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let mut x = values(10_007, 1);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
        -3.4e38,
        1.0039062,
    ]);
    let n = x.len();
    let dx = g.upload(&x).unwrap();
    let mut out = g.zeros::<u16>(n).unwrap();
    ops.to_bf16(&dx.as_view(), &mut out.as_view_mut(), n)
        .unwrap();
    let got = g.download(&out).unwrap();
    for (i, (&b, &v)) in got.iter().zip(&x).enumerate() {
        let want = round_bf16(v);
        let gv = f32::from_bits((b as u32) << 16);
        assert!(
            gv.to_bits() == want.to_bits() || (gv.is_nan() && want.is_nan()),
            "[{i}] {v:e}: gpu {gv:e}, cpu {want:e}"
        );
    }
}

#[test]
fn add_and_gather_are_exact() {
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let (v, h, rows) = (50, 96, 37);
    let table = values(v * h, 2);
    let tokens: Vec<u32> = (0..rows).map(|r| ((r * 13 + 5) % v) as u32).collect();
    let (dt, dk) = (g.upload(&table).unwrap(), g.upload(&tokens).unwrap());
    let mut out = g.zeros::<f32>(rows * h).unwrap();
    ops.embed_gather(
        &dt.as_view(),
        v,
        &dk.as_view(),
        &mut out.as_view_mut(),
        rows,
        h,
    )
    .unwrap();
    let other = values(rows * h, 3);
    let dother = g.upload(&other).unwrap();
    ops.add_inplace(&mut out.as_view_mut(), &dother.as_view(), rows * h)
        .unwrap();
    let got = g.download(&out).unwrap();
    for r in 0..rows {
        for j in 0..h {
            let want = table[tokens[r] as usize * h + j] + other[r * h + j];
            assert_eq!(got[r * h + j].to_bits(), want.to_bits(), "row {r} col {j}");
        }
    }
}
