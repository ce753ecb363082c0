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

/// Attention heads: `q_heads` query heads of width `head_dim` over `kv_heads` kv heads.
fn shape(q_heads: usize, kv_heads: usize, head_dim: usize) -> mxrl_tensor::attention::AttnShape {
    mxrl_tensor::attention::AttnShape {
        q_heads,
        kv_heads,
        head_dim,
    }
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

/// `Backend::decode_attn_prep` on the CUDA backend (one fused launch) gives the bits of the
/// ops it stands for run one by one on the same GPU (per-head RMSNorm of q and k, RoPE of
/// both, cache append), with and without the q/k norms, for Qwen3's head layout and smaller
/// ones (head widths 64, 128 and 256 take the one-warp-per-head kernel, 6 the block kernel;
/// item counts that leave the last block part-filled), rows whose length is 0 or past the cache (nothing appended) and positions past the
/// table (NaN rows). The other backends' default is that composition itself
/// (`decode_attn_prep_ops`).
#[test]
fn fused_decode_attention_prep_is_bitwise_the_ops_it_replaces() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::attention::AttnShape;
    use mxrl_tensor::device::{decode_attn_prep_ops, Backend};

    fn run<B: Backend>(b: &B, fused: bool, c: &Case, norms: bool) -> [Vec<u32>; 4] {
        let (rows, s) = (c.rows, c.shape);
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        let mut q = b
            .upload_f32(&test_values(rows * hq * d, c.seed, 2.0))
            .unwrap();
        let mut k = b
            .upload_f32(&test_values(rows * hkv * d, c.seed + 1, 2.0))
            .unwrap();
        let v = b
            .upload_f32(&test_values(rows * hkv * d, c.seed + 2, 2.0))
            .unwrap();
        let wq = b.upload_f32(&test_values(d, c.seed + 3, 1.0)).unwrap();
        let wk = b.upload_f32(&test_values(d, c.seed + 4, 1.0)).unwrap();
        let pos = b.upload_u32(&c.pos).unwrap();
        let lens = b.upload_u32(&c.lens).unwrap();
        let table = b.rope_table(c.max_pos, d, 1e6).unwrap();
        let cache = rows * c.max_len * hkv * d;
        let mut kc = b.zeros_bf16(cache).unwrap();
        let mut vc = b.zeros_bf16(cache).unwrap();
        let eps = 1e-6;
        let w = norms.then_some([&wq, &wk]);
        let prep = if fused {
            B::decode_attn_prep
        } else {
            decode_attn_prep_ops::<B>
        };
        prep(
            b, &mut q, &mut k, &v, w, eps, rows, s, &pos, &table, &lens, c.max_len, &mut kc,
            &mut vc,
        )
        .unwrap();
        let f = |x: &B::F32, n: usize| bits(&b.download_f32(x, n).unwrap());
        let h = |x: &B::Bf16| {
            b.download_bf16(x, cache)
                .unwrap()
                .into_iter()
                .map(u32::from)
                .collect()
        };
        [f(&q, rows * hq * d), f(&k, rows * hkv * d), h(&kc), h(&vc)]
    }

    struct Case {
        rows: usize,
        shape: AttnShape,
        max_pos: usize,
        max_len: usize,
        pos: Vec<u32>,
        lens: Vec<u32>,
        seed: u64,
    }
    let cases = [
        Case {
            rows: 5,
            shape: shape(16, 4, 128),
            max_pos: 64,
            max_len: 40,
            pos: vec![0, 7, 39, 63, 70],
            lens: vec![1, 8, 40, 0, 41],
            seed: 3100,
        },
        Case {
            rows: 3,
            shape: shape(4, 2, 64),
            max_pos: 16,
            max_len: 16,
            pos: vec![3, 15, 2],
            lens: vec![4, 16, 3],
            seed: 3200,
        },
        Case {
            rows: 3,
            shape: shape(2, 1, 256),
            max_pos: 12,
            max_len: 10,
            pos: vec![0, 9, 11],
            lens: vec![1, 10, 5],
            seed: 3250,
        },
        Case {
            rows: 2,
            shape: shape(3, 1, 6),
            max_pos: 8,
            max_len: 9,
            pos: vec![1, 5],
            lens: vec![2, 6],
            seed: 3300,
        },
    ];
    let gpu_b = CudaBackend::new(0).unwrap();
    for (i, c) in cases.iter().enumerate() {
        for norms in [true, false] {
            let what = ["q", "k", "k cache", "v cache"];
            let fused = run(&gpu_b, true, c, norms);
            let ops = run(&gpu_b, false, c, norms);
            for (j, w) in what.iter().enumerate() {
                assert_eq!(
                    fused[j], ops[j],
                    "case {i} (norms {norms}): GPU {w} differs"
                );
            }
        }
    }
}

/// `Backend::decode_attention` on the CUDA backend (for D = 64, 128, 256 one launch with the
/// q/k norms and RoPE computed per block and the new k/v rows appended by the block of their
/// chunk, then the chunks' combine) gives the bits of the ops it stands for
/// (`decode_attention_ops`: `decode_attn_prep`, then the decode attention), in the caches and in
/// the f32 and BF16 outputs: caches of one chunk (written directly) and of several (lengths at
/// and past chunk boundaries), 1, 4 and 16 query heads per kv head (16: two passes of eight),
/// rows of length 0 or past the cache (zeros / NaN, nothing appended), positions past the
/// table (NaN rows), with and without q/k norms, and a head width the fused kernel does not
/// take (6: the ops themselves); two steps in a row on the same caches.
#[test]
fn fused_decode_attention_is_bitwise_the_ops_it_replaces() {
    use mxrl_cuda::backend::CudaBackend;
    use mxrl_tensor::attention::AttnShape;
    use mxrl_tensor::device::{decode_attention_ops, Backend, DecodeAttnOut};

    struct Case {
        rows: usize,
        shape: AttnShape,
        max_pos: usize,
        max_len: usize,
        lens: Vec<u32>,
        seed: u64,
    }
    /// Outputs of two steps (lengths `lens`, then `lens + 1` where below the cache): out, caches.
    fn run<B: Backend>(b: &B, fused: bool, c: &Case, norms: bool, bf16: bool) -> Vec<Vec<u32>> {
        let (rows, s) = (c.rows, c.shape);
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        let cache = rows * c.max_len * hkv * d;
        let fill = |seed| {
            let x = b.upload_f32(&test_values(cache, seed, 2.0)).unwrap();
            let mut y = b.zeros_bf16(cache).unwrap();
            b.to_bf16(&x, &mut y, cache).unwrap();
            y
        };
        let (mut kc, mut vc) = (fill(c.seed + 10), fill(c.seed + 11));
        let wq = b.upload_f32(&test_values(d, c.seed + 3, 1.0)).unwrap();
        let wk = b.upload_f32(&test_values(d, c.seed + 4, 1.0)).unwrap();
        let table = b.rope_table(c.max_pos, d, 1e6).unwrap();
        let mut got = Vec::new();
        for step in 0..2u32 {
            let lens: Vec<u32> = c
                .lens
                .iter()
                .map(|&l| {
                    if l == 0 || l as usize >= c.max_len {
                        l
                    } else {
                        l + step
                    }
                })
                .collect();
            let pos: Vec<u32> = lens.iter().map(|&l| l.saturating_sub(1)).collect();
            let seed = c.seed + 100 * u64::from(step);
            let mut q = b
                .upload_f32(&test_values(rows * hq * d, seed, 2.0))
                .unwrap();
            let mut k = b
                .upload_f32(&test_values(rows * hkv * d, seed + 1, 2.0))
                .unwrap();
            let v = b
                .upload_f32(&test_values(rows * hkv * d, seed + 2, 2.0))
                .unwrap();
            let (pos, lens) = (b.upload_u32(&pos).unwrap(), b.upload_u32(&lens).unwrap());
            let n = rows * hq * d;
            let mut o32 = b.zeros_f32(n).unwrap();
            let mut o16 = b.zeros_bf16(n).unwrap();
            let out = if bf16 {
                DecodeAttnOut::Bf16(&mut o16)
            } else {
                DecodeAttnOut::F32(&mut o32)
            };
            let w = norms.then_some([&wq, &wk]);
            let op = if fused {
                B::decode_attention
            } else {
                decode_attention_ops::<B>
            };
            op(
                b,
                &mut q,
                &mut k,
                &v,
                w,
                1e-6,
                rows,
                s,
                &pos,
                &table,
                &lens,
                c.max_len,
                (&mut kc, &mut vc),
                out,
            )
            .unwrap();
            let h = |x: &B::Bf16, n| -> Vec<u32> {
                b.download_bf16(x, n)
                    .unwrap()
                    .into_iter()
                    .map(u32::from)
                    .collect()
            };
            got.push(if bf16 {
                h(&o16, n)
            } else {
                bits(&b.download_f32(&o32, n).unwrap())
            });
            got.push(h(&kc, cache));
            got.push(h(&vc, cache));
        }
        got
    }
    let cases = [
        // Several chunks (max_len 200: four), Qwen3's layout; lengths 0 and past the cache,
        // a position past the table (row 6: len 200 → position 199 ≥ 150).
        Case {
            rows: 7,
            shape: shape(16, 4, 128),
            max_pos: 150,
            max_len: 200,
            lens: vec![1, 64, 65, 127, 0, 201, 200],
            seed: 4100,
        },
        // One chunk: the blocks write the output directly.
        Case {
            rows: 3,
            shape: shape(4, 2, 64),
            max_pos: 64,
            max_len: 60,
            lens: vec![1, 33, 59],
            seed: 4200,
        },
        // D = 256, one query head per kv head, three chunks.
        Case {
            rows: 2,
            shape: shape(2, 2, 256),
            max_pos: 160,
            max_len: 150,
            lens: vec![129, 70],
            seed: 4300,
        },
        // Sixteen query heads per kv head: two passes per block.
        Case {
            rows: 2,
            shape: shape(32, 2, 64),
            max_pos: 128,
            max_len: 100,
            lens: vec![99, 12],
            seed: 4400,
        },
        // A head width without a fused kernel: the ops.
        Case {
            rows: 2,
            shape: shape(3, 1, 6),
            max_pos: 80,
            max_len: 70,
            lens: vec![66, 3],
            seed: 4500,
        },
    ];
    let gpu_b = CudaBackend::new(0).unwrap();
    for (i, c) in cases.iter().enumerate() {
        for (norms, bf16) in [(true, true), (false, false), (true, false)] {
            let fused = run(&gpu_b, true, c, norms, bf16);
            let ops = run(&gpu_b, false, c, norms, bf16);
            let what = ["output", "k cache", "v cache"];
            for (j, (a, b)) in fused.iter().zip(&ops).enumerate() {
                assert_eq!(
                    a,
                    b,
                    "case {i} (norms {norms}, bf16 {bf16}), step {}: {} differs",
                    j / 3,
                    what[j % 3]
                );
            }
        }
    }
}
