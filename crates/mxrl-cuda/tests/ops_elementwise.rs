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
    let dx = g.upload(&x).unwrap();
    // Whole buffers (eight elements per thread, 16-byte accesses) and views at offsets that
    // are not 16-byte aligned (element by element); lengths that leave a partial last group.
    // Outputs start as 0xFFFF so that a skipped element fails, and past the length must stay.
    for (x_off, out_off, n) in [
        (0, 0, x.len()),
        (0, 0, 8),
        (0, 0, 13),
        (3, 0, 1001),
        (0, 5, 1001),
        (8, 8, x.len() - 8),
    ] {
        let mut out = g.upload(&vec![0xFFFFu16; n + out_off + 3]).unwrap();
        ops.to_bf16(
            &dx.slice(x_off..x_off + n),
            &mut out.slice_mut(out_off..out_off + n),
            n,
        )
        .unwrap();
        let got = g.download(&out).unwrap();
        for (i, (&b, &v)) in got[out_off..out_off + n]
            .iter()
            .zip(&x[x_off..x_off + n])
            .enumerate()
        {
            let want = round_bf16(v);
            let gv = f32::from_bits((b as u32) << 16);
            assert!(
                gv.to_bits() == want.to_bits() || (gv.is_nan() && want.is_nan()),
                "offsets ({x_off}, {out_off}), n {n}: [{i}] {v:e}: gpu {gv:e}, cpu {want:e}"
            );
        }
        assert!(
            got[..out_off]
                .iter()
                .chain(&got[out_off + n..])
                .all(|&b| b == 0xFFFF),
            "offsets ({x_off}, {out_off}), n {n}: written outside the view"
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

/// `add_inplace` on views at offsets that are and are not 16-byte aligned (the four-wide and
/// the element kernels), lengths with partial groups: every sum exact, nothing outside the
/// view written.
#[test]
fn add_inplace_is_exact_at_any_offset_and_length() {
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let total = 4099;
    let base = values(total, 11);
    let other = values(total, 12);
    for (y_off, x_off, n) in [
        (0, 0, 4096),
        (0, 0, 4095),
        (0, 0, 3),
        (4, 8, 4001),
        (1, 0, 2050),
        (0, 3, 2051),
        (2, 2, 1),
    ] {
        let mut y = g.upload(&base).unwrap();
        let x = g.upload(&other).unwrap();
        ops.add_inplace(
            &mut y.slice_mut(y_off..y_off + n),
            &x.slice(x_off..x_off + n),
            n,
        )
        .unwrap();
        let got = g.download(&y).unwrap();
        for (i, &v) in got.iter().enumerate() {
            let want = if (y_off..y_off + n).contains(&i) {
                base[i] + other[i - y_off + x_off]
            } else {
                base[i]
            };
            assert_eq!(
                v.to_bits(),
                want.to_bits(),
                "offsets ({y_off}, {x_off}), n {n}: [{i}]"
            );
        }
    }
}

/// The weight-update ops: `round_bf16` equals `round_bf16` bitwise, `widen_bf16` is exact, and
/// the device checksum equals the CPU reference `checksum_bf16_bits` (several slots, a length
/// not a multiple of the block, accumulation onto a non-zero value) and changes when one
/// element changes or two are swapped.
#[test]
fn round_widen_and_checksum_match_the_cpu() {
    use mxrl_tensor::device::checksum_bf16_bits;
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let x = values(300_001, 7);
    let n = x.len();
    let dx = g.upload(&x).unwrap();
    let mut r = g.zeros::<f32>(n).unwrap();
    ops.round_bf16(&dx.as_view(), &mut r.as_view_mut(), n)
        .unwrap();
    let got = g.download(&r).unwrap();
    for (i, (&a, &v)) in got.iter().zip(&x).enumerate() {
        assert_eq!(a.to_bits(), round_bf16(v).to_bits(), "[{i}] {v:e}");
    }
    let bits: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let db = g.upload(&bits).unwrap();
    let mut w = g.zeros::<f32>(n).unwrap();
    ops.widen_bf16(&db.as_view(), &mut w.as_view_mut(), n)
        .unwrap();
    let wide = g.download(&w).unwrap();
    for (i, (&a, &b)) in wide.iter().zip(&bits).enumerate() {
        assert_eq!(a.to_bits(), (b as u32) << 16, "[{i}]");
    }
    let mut swapped = bits.clone();
    swapped.swap(10, 200_000);
    let mut one = bits.clone();
    one[123_456] ^= 1;
    let cases = [bits.clone(), swapped, one, bits[..777].to_vec()];
    // Slot 1 starts from a non-zero value: the kernel adds onto it.
    let mut init = vec![0u32; 2 * cases.len()];
    init[2] = 0xdead_beef;
    init[3] = 7;
    let mut sums = g.upload(&init).unwrap();
    for (slot, c) in cases.iter().enumerate() {
        let dc = g.upload(c).unwrap();
        ops.checksum_bf16(&dc.as_view(), c.len(), &mut sums.as_view_mut(), slot)
            .unwrap();
    }
    let got = g.download(&sums).unwrap();
    let want: Vec<u64> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let start = if i == 1 {
                (7u64 << 32) | 0xdead_beef
            } else {
                0
            };
            start.wrapping_add(checksum_bf16_bits(c.iter().copied()))
        })
        .collect();
    for (i, w) in want.iter().enumerate() {
        let g64 = u64::from(got[2 * i]) | (u64::from(got[2 * i + 1]) << 32);
        assert_eq!(g64, *w, "slot {i}");
    }
    let plain = checksum_bf16_bits(bits.iter().copied());
    assert_ne!(plain, checksum_bf16_bits(cases[1].iter().copied()));
    assert_ne!(plain, checksum_bf16_bits(cases[2].iter().copied()));
}

/// Route capture on the GPU equals the CPU backend's (`mxrl_tensor::device`), with a sequence
/// map (prefill) and without (decode), and skips rows outside the tables.
#[test]
fn capture_routes_matches_the_cpu_backend() {
    use mxrl_tensor::device::{Backend, CpuBackend};
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let (rows, k, slots, max_len) = (37usize, 3usize, 5usize, 11usize);
    let ids: Vec<u32> = (0..rows * k).map(|i| (i * 7 % 64) as u32).collect();
    let w: Vec<f32> = values(rows * k, 9);
    let seq: Vec<u32> = (0..rows).map(|r| (r % 6) as u32).collect(); // 5 is out of range
    let pos: Vec<u32> = (0..rows).map(|r| (r * 3 % 13) as u32).collect(); // ≥ 11 skipped
    for with_seq in [true, false] {
        let rws = if with_seq { rows } else { slots };
        let mut ci = vec![0u32; slots * max_len * k];
        let mut cw = vec![0f32; slots * max_len * k];
        CpuBackend
            .capture_routes(
                &ids,
                &w,
                rws,
                k,
                with_seq.then_some(&seq),
                &pos,
                slots,
                max_len,
                &mut ci,
                &mut cw,
            )
            .unwrap();
        let (di, dw, ds, dp) = (
            g.upload(&ids).unwrap(),
            g.upload(&w).unwrap(),
            g.upload(&seq).unwrap(),
            g.upload(&pos).unwrap(),
        );
        let mut gi = g.zeros::<u32>(slots * max_len * k).unwrap();
        let mut gw = g.zeros::<f32>(slots * max_len * k).unwrap();
        let dsv = ds.as_view();
        ops.capture_routes(
            &di.as_view(),
            &dw.as_view(),
            rws,
            k,
            with_seq.then_some(&dsv),
            &dp.as_view(),
            slots,
            max_len,
            &mut gi.as_view_mut(),
            &mut gw.as_view_mut(),
        )
        .unwrap();
        assert_eq!(g.download(&gi).unwrap(), ci, "ids, seq map {with_seq}");
        let gwb: Vec<u32> = g
            .download(&gw)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let cwb: Vec<u32> = cw.iter().map(|x| x.to_bits()).collect();
        assert_eq!(gwb, cwb, "weights, seq map {with_seq}");
        assert!(ci.iter().any(|&x| x != 0));
    }
}

/// Row capture (generation probes) on the GPU equals the CPU backend's, bitwise: with a
/// sequence map (prefill: only each slot's rows from position `first[s]` on land) and without
/// (decode: row r is slot r); rows whose slot or index falls outside the table are skipped.
#[test]
fn capture_rows_matches_the_cpu_backend() {
    use mxrl_tensor::device::{Backend, CpuBackend};
    let g = gpu();
    let ops = Elementwise::new(&g).unwrap();
    let (rows, w, slots, len) = (41usize, 67usize, 5usize, 4usize);
    let x = values(rows * w, 13);
    let seq: Vec<u32> = (0..rows).map(|r| (r % 6) as u32).collect(); // 5 is out of range
    let pos: Vec<u32> = (0..rows).map(|r| (r * 5 % 17) as u32).collect();
    let first: Vec<u32> = vec![3, 0, 9, 2, 12];
    for with_seq in [true, false] {
        let rws = if with_seq { rows } else { slots };
        let mut c = vec![0f32; slots * len * w];
        CpuBackend
            .capture_rows(
                &x,
                rws,
                w,
                with_seq.then_some(&seq),
                &pos,
                &first,
                slots,
                len,
                &mut c,
            )
            .unwrap();
        let (dx, ds, dp, df) = (
            g.upload(&x).unwrap(),
            g.upload(&seq).unwrap(),
            g.upload(&pos).unwrap(),
            g.upload(&first).unwrap(),
        );
        let mut d = g.zeros::<f32>(slots * len * w).unwrap();
        let dsv = ds.as_view();
        ops.capture_rows(
            &dx.as_view(),
            rws,
            w,
            with_seq.then_some(&dsv),
            &dp.as_view(),
            &df.as_view(),
            slots,
            len,
            &mut d.as_view_mut(),
        )
        .unwrap();
        let gb: Vec<u32> = g
            .download(&d)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let cb: Vec<u32> = c.iter().map(|v| v.to_bits()).collect();
        assert_eq!(gb, cb, "seq map {with_seq}");
        assert!(
            c.iter().any(|&v| v != 0.0),
            "seq map {with_seq}: nothing captured"
        );
    }
}

/// Block copies (a shared prefill's cache rows, routes, logits and probes) on the GPU equal
/// the CPU backend's, bitwise, for 2- and 4-byte elements: every pair's destination block
/// takes its source block, pairs naming a block past either buffer are skipped, and blocks
/// no pair names keep their bytes.
#[test]
fn copy_blocks_match_the_cpu_backend() {
    use mxrl_cuda::ops::engine::EngineOps;
    use mxrl_tensor::device::{Backend, CpuBackend};
    let g = gpu();
    let ops = EngineOps::new(&g).unwrap();
    let (block, src_blocks, dst_blocks) = (37usize, 7usize, 9usize);
    // (source, destination): distinct destinations; one source and one destination out of
    // range; block 8 of dst is named by no pair.
    let pairs: [(u32, u32); 8] = [
        (3, 0),
        (3, 5),
        (0, 1),
        (6, 2),
        (7, 3),
        (1, 9),
        (2, 7),
        (5, 4),
    ];
    let map: Vec<u32> = pairs.iter().flat_map(|&(s, d)| [s, d]).collect();
    let src: Vec<u32> = (0..src_blocks * block)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761))
        .collect();
    let before: Vec<u32> = (0..dst_blocks * block).map(|i| !(i as u32)).collect();
    let mut want = before.clone();
    CpuBackend
        .copy_blocks_u32(&src, &mut want, &map, block, pairs.len())
        .unwrap();
    for (d, blk) in want.chunks(block).enumerate() {
        let from = pairs
            .iter()
            .find(|p| p.1 as usize == d && (p.0 as usize) < src_blocks);
        match from {
            Some(&(s, _)) => assert_eq!(blk, &src[s as usize * block..][..block], "block {d}"),
            None => assert_eq!(
                blk,
                &before[d * block..][..block],
                "block {d} must keep its bytes"
            ),
        }
    }
    let dmap = g.upload(&map).unwrap();
    // 4-byte elements, as u32 and as f32 bits.
    let (ds, mut dd) = (g.upload(&src).unwrap(), g.upload(&before).unwrap());
    ops.copy_blocks_u32(
        &ds.as_view(),
        &mut dd.as_view_mut(),
        &dmap.as_view(),
        block,
        pairs.len(),
    )
    .unwrap();
    assert_eq!(g.download(&dd).unwrap(), want, "u32");
    let srcf: Vec<f32> = src.iter().map(|&b| f32::from_bits(b)).collect();
    let beforef: Vec<f32> = before.iter().map(|&b| f32::from_bits(b)).collect();
    let (ds, mut dd) = (g.upload(&srcf).unwrap(), g.upload(&beforef).unwrap());
    ops.copy_blocks_u32(
        &ds.as_view(),
        &mut dd.as_view_mut(),
        &dmap.as_view(),
        block,
        pairs.len(),
    )
    .unwrap();
    let got: Vec<u32> = g
        .download(&dd)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(got, want, "f32 bits");
    // 2-byte elements: the low halves of the same values.
    let src16: Vec<u16> = src.iter().map(|&b| b as u16).collect();
    let before16: Vec<u16> = before.iter().map(|&b| b as u16).collect();
    let want16: Vec<u16> = want.iter().map(|&b| b as u16).collect();
    let (ds, mut dd) = (g.upload(&src16).unwrap(), g.upload(&before16).unwrap());
    ops.copy_blocks_u16(
        &ds.as_view(),
        &mut dd.as_view_mut(),
        &dmap.as_view(),
        block,
        pairs.len(),
    )
    .unwrap();
    assert_eq!(g.download(&dd).unwrap(), want16, "u16");
}
