//! Causal GQA attention on the GPU against `mxrl_tensor::attention::{attention_forward,
//! attention_backward, attention_decode}` within the bounds derived in
//! `mxrl_tensor::tolerance::{attention_row_bound, attention_forward_bounds,
//! attention_backward_bounds}` (online softmax and other summation orders), on ragged packed
//! batches (empty sequences, length 1, lengths around the 32-key dq tile, the 64-row
//! forward/backward blocks and the 64-key decode chunk, sequences shorter than a block) and
//! head widths 2..256 across the three kernel instantiations (D ≤ 64, ≤ 128, ≤ 256, each at its
//! smallest and largest D), including the training shape (512 tokens, 16/4 heads, D 128), with
//! both training kernel families (tensor cores: bounds of `AttnSums::Bf16x3Mma`; CUDA cores:
//! `AttnSums::F32`); the log-sum-exp against the exact f64 value; the KV-cache
//! append bitwise (BF16 round to nearest even, nothing else written); determinism and batch
//! invariance of decode.
#![cfg(feature = "cuda")]

use mxrl_cuda::gpu::Gpu;
use mxrl_cuda::ops::attention::{
    backward_scratch_len, decode_scratch_len, Attention, TrainingKernels,
};
use mxrl_tensor::attention::{attention_backward, attention_decode, attention_forward, AttnShape};
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::precision::round_bf16;
use mxrl_tensor::tolerance::{
    attention_backward_bounds, attention_forward_bounds, attention_row_bound, violations, AttnSums,
};
use mxrl_tensor::SeqLayout;
use rand::{Rng, SeedableRng};

/// The smallest key tile of the forward kernels (32: the tensor-core kernels for D > 64; the
/// others use 64): the levels of the online softmax in the bound (a tile of keys all after a
/// row rescales it by exactly 1).
const KEY_TILE: usize = 32;
/// Keys per level of the decode bound: one level per 32 keys, at least as many as the decode's
/// 64-key chunks combine.
const DECODE_TILE: usize = 32;

fn gpu() -> Gpu {
    Gpu::shared(0).unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is unusable: {e}"))
}

fn shape(q_heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        q_heads,
        kv_heads,
        head_dim,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn training_cases() -> Vec<(Vec<usize>, AttnShape)> {
    let mut c = vec![
        (vec![1], shape(1, 1, 2)),
        (vec![5, 1, 0, 37], shape(4, 2, 16)),
        (vec![64, 33, 100], shape(8, 2, 64)),
        (vec![130], shape(4, 4, 128)),
        (vec![40, 9], shape(2, 1, 256)),
        (vec![17, 3], shape(6, 3, 6)),
        (vec![96, 31], shape(16, 4, 128)),
        // Block and tile edges per instantiation: 63/64/65, 127/128/129, T < one tile.
        (vec![64, 65, 128, 129, 1], shape(4, 1, 64)),
        (vec![63, 130, 2], shape(2, 2, 66)),
        (vec![200, 3], shape(2, 1, 130)),
        (vec![97, 64, 1], shape(4, 2, 256)),
        // The training shape of one sequence.
        (vec![512], shape(16, 4, 128)),
    ];
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(0x61747466);
    let shapes = [
        shape(4, 1, 32),
        shape(8, 4, 16),
        shape(2, 2, 64),
        shape(3, 1, 10),
    ];
    for s in shapes {
        let b = r.gen_range(1..5);
        c.push(((0..b).map(|_| r.gen_range(0..120)).collect(), s));
    }
    c
}

struct Grads {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_training(
    g: &Gpu,
    ops: &Attention,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dout: &[f32],
    layout: &SeqLayout,
    s: AttnShape,
) -> Grads {
    let n = layout.num_tokens();
    let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
    let b = layout.num_seqs();
    let offsets: Vec<u32> = (0..=b)
        .map(|i| if i < b { layout.offset(i) } else { n } as u32)
        .collect();
    let max_len = (0..b).map(|i| layout.len(i)).max().unwrap_or(0);
    let (dq_, dk_, dv_, ddo) = (
        g.upload(q).unwrap(),
        g.upload(k).unwrap(),
        g.upload(v).unwrap(),
        g.upload(dout).unwrap(),
    );
    let doff = g.upload(&offsets).unwrap();
    let mut out = g.zeros::<f32>(n * hq * d).unwrap();
    let mut lse = g.zeros::<f32>(n * hq).unwrap();
    ops.forward(
        &dq_.as_view(),
        &dk_.as_view(),
        &dv_.as_view(),
        &doff.as_view(),
        b,
        max_len,
        n,
        s,
        &mut out.as_view_mut(),
        &mut lse.as_view_mut(),
    )
    .unwrap();
    let mut delta = g.zeros::<f32>(backward_scratch_len(n, s)).unwrap();
    let mut gq = g.zeros::<f32>(n * hq * d).unwrap();
    let mut gk = g.zeros::<f32>(n * hkv * d).unwrap();
    let mut gv = g.zeros::<f32>(n * hkv * d).unwrap();
    ops.backward(
        &ddo.as_view(),
        &dq_.as_view(),
        &dk_.as_view(),
        &dv_.as_view(),
        &out.as_view(),
        &lse.as_view(),
        &doff.as_view(),
        b,
        max_len,
        n,
        s,
        &mut delta.as_view_mut(),
        &mut gq.as_view_mut(),
        &mut gk.as_view_mut(),
        &mut gv.as_view_mut(),
    )
    .unwrap();
    let dl = |x: &cudarc::driver::CudaSlice<f32>, len: usize| {
        let mut v = g.download(x).unwrap();
        v.truncate(len);
        v
    };
    Grads {
        out: dl(&out, n * hq * d),
        lse: dl(&lse, n * hq),
        dq: dl(&gq, n * hq * d),
        dk: dl(&gk, n * hkv * d),
        dv: dl(&gv, n * hkv * d),
    }
}

#[test]
fn training_forward_and_backward_match_reference_within_derived_bounds() {
    training_case(TrainingKernels::TensorCores);
}

#[test]
fn training_cuda_core_kernels_match_reference_within_derived_bounds() {
    training_case(TrainingKernels::CudaCores);
}

#[test]
fn training_kernels_evaluate_sums_as_documented() {
    // Which error model each head width gets (the bounds of the two tests above use it).
    let g = gpu();
    let tc = Attention::new(&g).unwrap();
    let cc = Attention::new(&g)
        .unwrap()
        .with_training_kernels(TrainingKernels::CudaCores);
    for d in [2usize, 64, 66, 128] {
        assert_eq!(tc.training_sums(d), AttnSums::Bf16x3Mma, "D {d}");
        assert_eq!(cc.training_sums(d), AttnSums::F32, "D {d}");
    }
    for d in [130usize, 256] {
        assert_eq!(tc.training_sums(d), AttnSums::F32, "D {d}");
    }
}

fn training_case(kernels: TrainingKernels) {
    let g = gpu();
    let ops = Attention::new(&g).unwrap().with_training_kernels(kernels);
    for (case, (lens, s)) in training_cases().into_iter().enumerate() {
        let seed = 3000 + 10 * case as u64;
        let layout = SeqLayout::new(&lens);
        let n = layout.num_tokens();
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        let sums = ops.training_sums(d);
        let ctx = format!(
            "{kernels:?} case {case}: lens {lens:?}, {s:?}, {sums:?}, seeds {seed}..{}",
            seed + 3
        );
        let q = test_values(n * hq * d, seed, 1.5);
        let k = test_values(n * hkv * d, seed + 1, 1.5);
        let v = test_values(n * hkv * d, seed + 2, 1.0);
        let dout = test_values(n * hq * d, seed + 3, 1.0);
        let mut out = vec![0.0; n * hq * d];
        let probs = attention_forward(&q, &k, &v, &layout, s, &mut out);
        let (mut dq, mut dk, mut dv) = (
            vec![0.0; n * hq * d],
            vec![0.0; n * hkv * d],
            vec![0.0; n * hkv * d],
        );
        attention_backward(
            &dout, &q, &k, &v, &probs, &layout, s, &mut dq, &mut dk, &mut dv,
        );
        let got = run_training(&g, &ops, &q, &k, &v, &dout, &layout, s);

        let (bo, lse_exact, blse) =
            attention_forward_bounds(&q, &k, &v, &layout, s, KEY_TILE, sums);
        let f = violations(&got.out, &out, |i| bo[i]);
        assert!(f.is_empty(), "{ctx}: out {f:#?}");
        let lse_ref: Vec<f32> = lse_exact.iter().map(|&x| x as f32).collect();
        // The f32 rounding of the exact value adds at most u·|lse| to the comparison.
        let f = violations(&got.lse, &lse_ref, |i| {
            blse[i] + lse_exact[i].abs() * mxrl_tensor::F32_UNIT_ROUNDOFF
        });
        assert!(f.is_empty(), "{ctx}: lse {f:#?}");
        let (bq, bk, bv) = attention_backward_bounds(&dout, &q, &k, &v, &layout, s, KEY_TILE, sums);
        let f = violations(&got.dq, &dq, |i| bq[i]);
        assert!(f.is_empty(), "{ctx}: dq {f:#?}");
        let f = violations(&got.dk, &dk, |i| bk[i]);
        assert!(f.is_empty(), "{ctx}: dk {f:#?}");
        let f = violations(&got.dv, &dv, |i| bv[i]);
        assert!(f.is_empty(), "{ctx}: dv {f:#?}");

        let again = run_training(&g, &ops, &q, &k, &v, &dout, &layout, s);
        for (name, a, b) in [
            ("out", &again.out, &got.out),
            ("lse", &again.lse, &got.lse),
            ("dq", &again.dq, &got.dq),
            ("dk", &again.dk, &got.dk),
            ("dv", &again.dv, &got.dv),
        ] {
            assert_eq!(bits(a), bits(b), "{ctx}: {name} not deterministic");
        }
    }
}

fn to_bf16_bits(x: f32) -> u16 {
    (round_bf16(x).to_bits() >> 16) as u16
}

fn from_bf16_bits(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[test]
fn kv_append_and_decode_match_reference_within_derived_bounds() {
    let g = gpu();
    let ops = Attention::new(&g).unwrap();
    // (shape, max_len, lens): lengths 1, around the 32-key tile and 64-key chunk, max_len, 0.
    let cases = [
        (
            shape(4, 2, 16),
            200usize,
            vec![1usize, 64, 65, 200, 128, 33, 0],
        ),
        (shape(16, 4, 128), 160, vec![160, 1, 97]),
        (shape(8, 1, 64), 70, vec![70]),
        (shape(2, 2, 256), 40, vec![40, 2]),
        (shape(3, 3, 6), 9, vec![9, 5, 1, 3]),
        // Qwen3-30B-A3B's heads in a cache of one chunk (written without the combine).
        (shape(32, 4, 128), 60, vec![60, 0, 1, 33]),
    ];
    for (case, (s, max_len, lens)) in cases.into_iter().enumerate() {
        let seed = 4000 + 10 * case as u64;
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        let row = hkv * d;
        let batch = lens.len();
        let slots = batch + 1;
        let ctx = format!("case {case}: {s:?}, max_len {max_len}, lens {lens:?}, seeds {seed}..");
        let kc0: Vec<u16> = test_values(slots * max_len * row, seed, 1.5)
            .into_iter()
            .map(to_bf16_bits)
            .collect();
        let vc0: Vec<u16> = test_values(slots * max_len * row, seed + 1, 1.0)
            .into_iter()
            .map(to_bf16_bits)
            .collect();
        let k_new = test_values(batch * row, seed + 2, 1.5);
        let v_new = test_values(batch * row, seed + 3, 1.0);
        let q = test_values(batch * hq * d, seed + 4, 1.5);
        let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();

        let (mut kc, mut vc) = (g.upload(&kc0).unwrap(), g.upload(&vc0).unwrap());
        let (dk, dv, dl, dq) = (
            g.upload(&k_new).unwrap(),
            g.upload(&v_new).unwrap(),
            g.upload(&lens32).unwrap(),
            g.upload(&q).unwrap(),
        );
        ops.kv_append(
            &dk.as_view(),
            &dv.as_view(),
            &mut kc.as_view_mut(),
            &mut vc.as_view_mut(),
            &dl.as_view(),
            batch,
            slots,
            max_len,
            s,
        )
        .unwrap();
        let (mut kw, mut vw) = (kc0.clone(), vc0.clone());
        for (b, &l) in lens.iter().enumerate() {
            if l > 0 {
                for e in 0..row {
                    kw[(b * max_len + l - 1) * row + e] = to_bf16_bits(k_new[b * row + e]);
                    vw[(b * max_len + l - 1) * row + e] = to_bf16_bits(v_new[b * row + e]);
                }
            }
        }
        assert_eq!(g.download(&kc).unwrap(), kw, "{ctx}: k cache after append");
        assert_eq!(g.download(&vc).unwrap(), vw, "{ctx}: v cache after append");

        let decode = |batch: usize| {
            let mut scratch = g
                .zeros::<f32>(decode_scratch_len(batch, max_len, s))
                .unwrap();
            let mut out = g.zeros::<f32>(batch * hq * d).unwrap();
            ops.decode(
                &dq.as_view(),
                &kc.as_view(),
                &vc.as_view(),
                &dl.as_view(),
                batch,
                slots,
                max_len,
                s,
                &mut scratch.as_view_mut(),
                &mut out.as_view_mut(),
            )
            .unwrap();
            let mut o = g.download(&out).unwrap();
            o.truncate(batch * hq * d);
            o
        };
        let got = decode(batch);
        let scale = s.scale();
        for (b, &l) in lens.iter().enumerate() {
            let kf: Vec<f32> = kw[b * max_len * row..(b * max_len + l) * row]
                .iter()
                .map(|&x| from_bf16_bits(x))
                .collect();
            let vf: Vec<f32> = vw[b * max_len * row..(b * max_len + l) * row]
                .iter()
                .map(|&x| from_bf16_bits(x))
                .collect();
            let mut want = vec![0.0f32; hq * d];
            let mut scr = vec![0.0f32; l];
            attention_decode(
                &q[b * hq * d..(b + 1) * hq * d],
                &kf,
                &vf,
                l,
                s,
                &mut scr,
                &mut want,
            );
            let mut bound = Vec::with_capacity(hq * d);
            if l == 0 {
                // An empty sequence attends to nothing: the reference gives zeros, exactly.
                bound.resize(hq * d, 0.0);
            }
            for h in (0..hq).filter(|_| l > 0) {
                let kh = h / (hq / hkv);
                let rb = attention_row_bound(
                    &q[(b * hq + h) * d..(b * hq + h + 1) * d],
                    &kf[kh * d..],
                    &vf[kh * d..],
                    row,
                    l,
                    scale,
                    l.div_ceil(DECODE_TILE) + 1,
                    AttnSums::F32,
                );
                bound.extend(rb.out);
            }
            let f = violations(&got[b * hq * d..(b + 1) * hq * d], &want, |i| bound[i]);
            assert!(f.is_empty(), "{ctx}: sequence {b} (len {l}) {f:#?}");
        }
        assert_eq!(
            bits(&decode(batch)),
            bits(&got),
            "{ctx}: decode not deterministic"
        );
        assert_eq!(
            bits(&decode(1)),
            bits(&got[..hq * d]),
            "{ctx}: sequence 0 alone differs from sequence 0 in the batch"
        );
    }
}

/// Decode into a cache of one chunk (the partial kernel writes the output, no combine) gives the
/// bits of the two-pass decode of the same keys in a longer cache (one chunk used, combined):
/// rows 0 .. max_len of each slot copied into a cache of 2·max_len + 3 positions. Lengths 0 and
/// max_len + 1 give zeros and NaN in both.
#[test]
fn decode_of_one_chunk_gives_the_bits_of_the_combined_decode() {
    let g = gpu();
    let ops = Attention::new(&g).unwrap();
    for (case, (s, max_len, lens)) in [
        (shape(32, 4, 128), 64usize, vec![64usize, 1, 0, 37, 65]),
        (shape(4, 2, 16), 20, vec![20, 3, 21, 0]),
        (shape(3, 3, 6), 9, vec![9, 5]),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 5000 + 10 * case as u64;
        let (hq, d) = (s.q_heads, s.head_dim);
        let row = s.kv_heads * d;
        let batch = lens.len();
        let long = 2 * max_len + 3;
        let kc: Vec<u16> = test_values(batch * max_len * row, seed, 1.5)
            .into_iter()
            .map(to_bf16_bits)
            .collect();
        let vc: Vec<u16> = test_values(batch * max_len * row, seed + 1, 1.0)
            .into_iter()
            .map(to_bf16_bits)
            .collect();
        let mut kl = vec![0u16; batch * long * row];
        let mut vl = vec![0u16; batch * long * row];
        for b in 0..batch {
            let (src, dst) = (b * max_len * row, b * long * row);
            kl[dst..dst + max_len * row].copy_from_slice(&kc[src..src + max_len * row]);
            vl[dst..dst + max_len * row].copy_from_slice(&vc[src..src + max_len * row]);
        }
        let q = g
            .upload(&test_values(batch * hq * d, seed + 2, 1.5))
            .unwrap();
        let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        let dl = g.upload(&lens32).unwrap();
        // Scratch filled with NaN: a chunk the combine reads but no block wrote would show.
        let garbage = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
        let run = |k: &[u16], v: &[u16], cache_len: usize| {
            let (k, v) = (g.upload(k).unwrap(), g.upload(v).unwrap());
            let mut scratch = garbage(decode_scratch_len(batch, cache_len, s));
            let mut out = g.upload(&vec![7.0f32; batch * hq * d]).unwrap();
            ops.decode(
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &dl.as_view(),
                batch,
                batch,
                cache_len,
                s,
                &mut scratch.as_view_mut(),
                &mut out.as_view_mut(),
            )
            .unwrap();
            let out = g.download(&out).unwrap();
            // The BF16 output: the bits of the f32 output's rounding.
            let mut scratch = garbage(decode_scratch_len(batch, cache_len, s));
            let mut outb = g.upload(&vec![0x7FC1u16; batch * hq * d]).unwrap();
            ops.decode_bf16(
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &dl.as_view(),
                batch,
                batch,
                cache_len,
                s,
                &mut scratch.as_view_mut(),
                &mut outb.as_view_mut(),
            )
            .unwrap();
            let want: Vec<u16> = out.iter().map(|&x| to_bf16_bits(x)).collect();
            assert_eq!(
                g.download(&outb).unwrap(),
                want,
                "case {case}: BF16 decode output, cache of {cache_len}"
            );
            out
        };
        assert_eq!(decode_scratch_len(batch, max_len, s), 1);
        let one = run(&kc, &vc, max_len);
        // Past max_len the two caches differ: NaN in the short one, a real length in the long.
        let mut two = run(&kl, &vl, long);
        for (b, &l) in lens.iter().enumerate() {
            let o = &one[b * hq * d..(b + 1) * hq * d];
            if l > max_len {
                assert!(
                    o.iter().all(|x| x.is_nan()),
                    "case {case}: len {l} > {max_len}"
                );
                two[b * hq * d..(b + 1) * hq * d].copy_from_slice(o);
            } else if l == 0 {
                assert!(o.iter().all(|&x| x.to_bits() == 0), "case {case}: len 0");
            }
        }
        assert_eq!(
            bits(&one),
            bits(&two),
            "case {case}: {s:?}, max_len {max_len}, lens {lens:?}"
        );
    }
}

#[test]
fn attention_launchers_refuse_bad_geometry_and_short_buffers() {
    let g = gpu();
    let ops = Attention::new(&g).unwrap();
    let n = 4;
    let buf = g.zeros::<f32>(64 * n).unwrap();
    let off = g.upload(&[0u32, 4]).unwrap();
    let mut out = g.zeros::<f32>(64 * n).unwrap();
    let mut lse = g.zeros::<f32>(8 * n).unwrap();
    for (s, what) in [
        (shape(3, 2, 8), "multiple"),
        (shape(2, 1, 7), "even"),
        (shape(1, 1, 258), "even"),
    ] {
        let e = ops
            .forward(
                &buf.as_view(),
                &buf.as_view(),
                &buf.as_view(),
                &off.as_view(),
                1,
                4,
                n,
                s,
                &mut out.as_view_mut(),
                &mut lse.as_view_mut(),
            )
            .unwrap_err();
        assert!(e.to_string().contains(what), "{s:?}: {e}");
    }
    let mut small = g.zeros::<f32>(n).unwrap();
    let e = ops
        .forward(
            &buf.as_view(),
            &buf.as_view(),
            &buf.as_view(),
            &off.as_view(),
            1,
            4,
            n,
            shape(2, 1, 8),
            &mut out.as_view_mut(),
            &mut small.as_view_mut(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("lse"), "{e}");
    let cache = g.zeros::<u16>(2 * 8 * 8).unwrap();
    let lens = g.upload(&[1u32, 1, 1]).unwrap();
    let mut scratch = g.zeros::<f32>(1).unwrap();
    let e = ops
        .decode(
            &buf.as_view(),
            &cache.as_view(),
            &cache.as_view(),
            &lens.as_view(),
            3,
            2,
            8,
            shape(1, 1, 8),
            &mut scratch.as_view_mut(),
            &mut out.as_view_mut(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("slots"), "{e}");
    // The backward's BF16 planes are copied with 16-byte cp.async: a scratch one element off
    // a 16-byte boundary is refused.
    let s = shape(2, 1, 8);
    let len = backward_scratch_len(n, s);
    let mut wide = g.zeros::<f32>(len + 1).unwrap();
    let (mut gq, mut gk) = (
        g.zeros::<f32>(n * 2 * 8).unwrap(),
        g.zeros::<f32>(n * 8).unwrap(),
    );
    let mut gv = g.zeros::<f32>(n * 8).unwrap();
    let e = ops
        .backward(
            &buf.as_view(),
            &buf.as_view(),
            &buf.as_view(),
            &buf.as_view(),
            &buf.as_view(),
            &lse.as_view(),
            &off.as_view(),
            1,
            4,
            n,
            s,
            &mut wide.slice_mut(1..len + 1),
            &mut gq.as_view_mut(),
            &mut gk.as_view_mut(),
            &mut gv.as_view_mut(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("aligned"), "{e}");
}
