//! Embedding backward on the GPU against `mxrl_tensor::embedding::embedding_backward` (the
//! model's scatter-add, rows in increasing order): bitwise, since the grouped kernel adds the
//! same values in the same order.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::embed_backward::{EmbedBackward, EmbedGrouping};
use mxrl_tensor::embedding::embedding_backward;

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    mxrl_tensor::gradcheck::test_values(n, seed, scale)
}

#[test]
fn embed_backward_is_bitwise_the_reference() {
    let g = gpu();
    let ops = EmbedBackward::new(&g).unwrap();
    // (vocab, rows, h, seed): repeated tokens, one row, no rows, odd widths, wide rows.
    for &(vocab, rows, h, seed) in &[
        (50usize, 37usize, 96usize, 1u64),
        (7, 1000, 3, 2),
        (1000, 1, 257, 3),
        (13, 0, 64, 4),
        (3, 300, 1030, 5),
    ] {
        let tokens: Vec<u32> = values(rows, seed, 1.0)
            .iter()
            .map(|u| ((((u + 1.0) * 0.5) * vocab as f32) as usize).min(vocab - 1) as u32)
            .collect();
        let dx = values(rows * h, seed + 10, 1.0);
        let table0 = values(vocab * h, seed + 20, 0.25);
        let mut want = table0.clone();
        embedding_backward(&mut want, &dx, &tokens, h);
        let grouping = EmbedGrouping::new(&tokens, vocab).unwrap();
        let dg = ops.upload(&grouping).unwrap();
        let ddx = g.upload(&dx).unwrap();
        let mut dt = g.upload(&table0).unwrap();
        ops.run(&mut dt.as_view_mut(), vocab, &ddx.as_view(), rows, h, &dg)
            .unwrap();
        let got = g.download(&dt).unwrap();
        for i in 0..vocab * h {
            assert_eq!(
                got[i].to_bits(),
                want[i].to_bits(),
                "vocab {vocab} rows {rows} h {h} seed {seed}: [{i}] {} vs {}",
                got[i],
                want[i]
            );
        }
    }
}

#[test]
fn grouping_is_stable_and_validates_ids() {
    let gr = EmbedGrouping::new(&[3, 1, 3, 0, 1], 4).unwrap();
    assert_eq!(gr.uniq, [0, 1, 3]);
    assert_eq!(gr.offsets, [0, 1, 3, 5]);
    assert_eq!(gr.rows, [3, 1, 4, 0, 2]);
    let e = EmbedGrouping::new(&[0, 9], 4).unwrap_err();
    assert!(e.contains("token 9 at row 1"), "{e}");
    let g = gpu();
    let ops = EmbedBackward::new(&g).unwrap();
    let bad = EmbedGrouping {
        uniq: vec![0, 0],
        offsets: vec![0, 1, 2],
        rows: vec![0, 1],
    };
    assert!(ops.upload(&bad).is_err());
    let dg = ops.upload(&gr).unwrap();
    let dx = g.zeros::<f32>(10).unwrap();
    let mut t = g.zeros::<f32>(8).unwrap();
    // vocabulary 3 does not hold token 3
    assert!(ops
        .run(&mut t.as_view_mut(), 3, &dx.as_view(), 5, 2, &dg)
        .is_err());
    // a grouping of 5 rows for 4 rows of dx
    assert!(ops
        .run(&mut t.as_view_mut(), 4, &dx.as_view(), 4, 2, &dg)
        .is_err());
}
