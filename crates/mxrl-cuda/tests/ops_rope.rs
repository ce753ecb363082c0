//! RoPE forward/backward on the GPU against `mxrl_tensor::rope::{rope_forward, rope_backward}`:
//! bitwise (the same two products and one sum per output, the same table values), on random
//! positions, odd row counts and head widths 2..256; positions outside the table give NaN.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::rope::{Rope, RopeDeviceTable};
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::rope::{rope_backward, rope_forward, RopeTable};
use rand::{Rng, SeedableRng};

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn rope_forward_and_backward_are_bitwise_the_reference() {
    let g = gpu();
    let ops = Rope::new(&g).unwrap();
    // (rows, heads, head_dim, max_pos, theta)
    let cases = [
        (0usize, 2usize, 16usize, 8usize, 1e4f64),
        (1, 1, 2, 1, 1e4),
        (37, 4, 16, 64, 1e4),
        (129, 3, 64, 1000, 1e6),
        (257, 2, 128, 4096, 1e6),
        (5, 1, 256, 33, 1e4),
        (17, 5, 6, 20, 1e4),
    ];
    for (case, &(n, heads, d, max_pos, theta)) in cases.iter().enumerate() {
        let seed = 2000 + case as u64;
        let ctx =
            format!("case {case}: n {n}, heads {heads}, D {d}, max_pos {max_pos}, seed {seed}");
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut pos: Vec<u32> = (0..n).map(|_| r.gen_range(0..max_pos as u32)).collect();
        if n > 1 {
            pos[0] = 0;
            pos[n - 1] = max_pos as u32 - 1;
        }
        let table = RopeDeviceTable::new(&g, max_pos, d, theta).unwrap();
        let cpu_table = RopeTable::new(
            &pos.iter().map(|&p| p as usize).collect::<Vec<_>>(),
            d,
            theta,
        );
        let x = test_values(n * heads * d, seed, 2.0);
        let dpos = g.upload(&pos).unwrap();
        for backward in [false, true] {
            let mut want = x.clone();
            let mut dx = g.upload(&x).unwrap();
            if backward {
                rope_backward(&mut want, n, heads, &cpu_table);
                ops.backward(&mut dx.as_view_mut(), &dpos.as_view(), n, heads, &table)
                    .unwrap();
            } else {
                rope_forward(&mut want, n, heads, &cpu_table);
                ops.forward(&mut dx.as_view_mut(), &dpos.as_view(), n, heads, &table)
                    .unwrap();
            }
            let mut got = g.download(&dx).unwrap();
            got.truncate(n * heads * d);
            assert_eq!(bits(&got), bits(&want), "{ctx}, backward {backward}");
        }
    }
}

#[test]
fn rope_position_outside_the_table_gives_nan_and_short_buffers_are_refused() {
    let g = gpu();
    let ops = Rope::new(&g).unwrap();
    let (heads, d) = (2, 8);
    let table = RopeDeviceTable::new(&g, 4, d, 1e4).unwrap();
    let pos = g.upload(&[1u32, 4]).unwrap();
    let x = test_values(2 * heads * d, 7, 1.0);
    let mut dx = g.upload(&x).unwrap();
    ops.forward(&mut dx.as_view_mut(), &pos.as_view(), 2, heads, &table)
        .unwrap();
    let got = g.download(&dx).unwrap();
    assert!(got[..heads * d].iter().all(|v| v.is_finite()));
    assert!(got[heads * d..].iter().all(|v| v.is_nan()), "{got:?}");
    let e = ops
        .forward(&mut dx.as_view_mut(), &pos.as_view(), 3, heads, &table)
        .unwrap_err();
    assert!(e.to_string().contains("rope forward"), "{e}");
    assert!(RopeDeviceTable::new(&g, 4, 7, 1e4).is_err());
}
