//! Fast CPU quantizers: rayon over row bands, branch-free element encoders, one pass per
//! band. Named reference: [`crate::reference`]; every function here must produce the same
//! bytes (tested on random shapes and seeds, the corner-case table and the vector files).
//!
//! The scalar scale rules are the shared ones of [`crate::rules`]; what differs from the
//! reference is iteration order, parallelism and the element encoders, which are branch-free
//! re-statements of [`crate::element`] tested equal to it on every f32 bit pattern.

use crate::input::{HighPrecision, TensorRef};
use crate::reference;
use crate::rules::{fp8_block_scale, mxfp8_scale, Nvfp4Global};
use crate::scheme::R448;
use crate::scheme::{
    AmaxScope, Fp8BlockScheme, MxBlocks, Mxfp8Scheme, Nvfp4Blocks, Nvfp4Scheme, Padding,
    ScaleLayout, Scheme, Usage,
};
use crate::tensor::{Geometry, QuantizedTensor, Scales};
use crate::FormatError;
use rayon::prelude::*;

/// Branch-free f32 → E4M3 (rule [`crate::ElementRule::E4m3SatfiniteRne`]); equal to
/// [`crate::e4m3_encode`] on every f32 bit pattern. Signed 32-bit lanes only, so it
/// vectorizes on baseline x86-64 (SSE2).
#[inline(always)]
pub(crate) fn e4m3_fast(x: f32) -> u8 {
    let bits = x.to_bits() as i32;
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range (|x| ≥ 2⁻⁶): round the mantissa to 3 bits (ties to even) in the bit pattern.
    let rounded = abs.wrapping_add(0x7_FFFF + ((abs >> 20) & 1)) >> 20;
    let normal = (rounded - (120 << 3)).min(0x7E);
    // Subnormal range: adding 2^14 (ulp 2⁻⁹) rounds |x| to the k·2⁻⁹ grid with ties to even.
    let sub = (f32::from_bits(abs as u32) + 16384.0).to_bits() as i32 - 0x4680_0000;
    let code = if abs < 0x3C80_0000 { sub } else { normal };
    let code = if abs > 0x7F80_0000 { 0x7F } else { code | sign };
    code as u8
}

/// Branch-free f32 → UE8M0 rounding up (rule [`crate::ElementRule::Ue8m0RoundUp`]); equal to
/// [`crate::ue8m0_round_up`] on every f32 bit pattern.
#[inline(always)]
pub(crate) fn ue8m0_fast(v: f32) -> u8 {
    let bits = v.to_bits() as i32;
    let e = (bits >> 23) & 0xFF;
    let m = bits & 0x7F_FFFF;
    let normal = (e + i32::from(m != 0)).min(0xFE);
    let sub = i32::from(m > 0x40_0000);
    let code = if e == 0 { sub } else { normal };
    let code = if bits < 0 { 0 } else { code };
    let code = if v.is_nan() { 0xFF } else { code };
    code as u8
}

/// Exact reciprocal of a UE8M0 scale that is not 0xFF (same as [`crate::ue8m0_reciprocal`]).
#[inline(always)]
fn ue8m0_recip_fast(s: u8) -> f32 {
    let bits = if s == 254 {
        0x0040_0000
    } else {
        (254 - s as u32) << 23
    };
    f32::from_bits(bits)
}

/// `max|x|` of one block (a multiple of 8 f32 values: 16 for NVFP4, 32 for MXFP8), NaN
/// ignored: eight independent lanes, then the lanes. The result is order-independent (the
/// maximum of non-NaN, non-negative values; `|x|` is never −0), so it equals the sequential
/// [`crate::amax_of`].
#[inline(always)]
fn amax_block(b: &[f32]) -> f32 {
    debug_assert_eq!(b.len() % 8, 0);
    let mut acc = [0.0f32; 8];
    for c in b.chunks_exact(8) {
        for l in 0..8 {
            let a = c[l].abs();
            acc[l] = if a > acc[l] { a } else { acc[l] };
        }
    }
    acc.iter().fold(0.0f32, |m, &a| if a > m { a } else { m })
}

/// Branch-free f32 → E2M1 nibble (rule [`crate::ElementRule::E2m1SatfiniteRne`]); equal to
/// [`crate::e2m1_encode`] on every f32 bit pattern.
#[inline(always)]
pub(crate) fn e2m1_fast(x: f32) -> u8 {
    // E2M1 is a minifloat with bias 1 and one mantissa bit: the same bit-pattern rounding as
    // `e4m3_fast` (normal range |x| ≥ 1, subnormal step 0.5), saturating at code 7 (6.0).
    let bits = x.to_bits() as i32;
    let sign = (bits >> 28) & 0x8;
    let abs = bits & 0x7FFF_FFFF;
    let rounded = abs.wrapping_add(0x1F_FFFF + ((abs >> 22) & 1)) >> 22;
    let normal = (rounded - (126 << 1)).min(0x7);
    // Adding 2^22 (ulp 0.5) rounds |x| < 1 to the 0.5 grid with ties to even.
    let sub = (f32::from_bits(abs as u32) + 4_194_304.0).to_bits() as i32 - 0x4A80_0000;
    let code = if abs < 0x3F80_0000 { sub } else { normal };
    let code = if abs > 0x7F80_0000 { 0x7 } else { code | sign };
    code as u8
}

/// NVFP4 with 1×16 blocks: rows in parallel; per row an f32 copy, then block scales and
/// multipliers for the whole row, then the elements (same rule functions as the reference).
fn nvfp4_rows<T: HighPrecision>(
    x: &[T],
    m: usize,
    k: usize,
    scope: AmaxScope,
    amax: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
) {
    let nb = k / 16;
    let rows_per_task = (1 << 16) / k.max(1) + 1;
    data.par_chunks_mut(rows_per_task * k / 2)
        .zip(scales.par_chunks_mut(rows_per_task * nb))
        .zip(x.par_chunks(rows_per_task * k))
        .enumerate()
        .for_each_init(
            || (vec![0.0f32; k], vec![0.0f32; nb]),
            |(buf, enc), (t, ((d, sc), xs))| {
                for (r, ((drow, srow), xrow)) in d
                    .chunks_exact_mut(k / 2)
                    .zip(sc.chunks_exact_mut(nb))
                    .zip(xs.chunks_exact(k))
                    .enumerate()
                {
                    let row = t * rows_per_task + r;
                    let g = Nvfp4Global::from_amax(match scope {
                        AmaxScope::PerTensor => amax[row / m],
                        AmaxScope::PerRow => amax[row],
                    });
                    for (b, v) in buf.iter_mut().zip(xrow) {
                        *b = v.to_f32();
                    }
                    for ((s, e), blk) in srow
                        .iter_mut()
                        .zip(enc.iter_mut())
                        .zip(buf.chunks_exact(16))
                    {
                        let sdec = (amax_block(blk) * g.mult).min(f32::MAX);
                        // sdec is never NaN (bmax ignores NaN, mult is finite), so clamping
                        // negatives to +0 gives exactly ue4m3_encode.
                        let scale = e4m3_fast(if sdec > 0.0 { sdec } else { 0.0 });
                        let sf = crate::element::E4M3_VALUES[scale as usize];
                        *s = scale;
                        *e = (1.0 / (sf * g.s_dec)).min(f32::MAX);
                    }
                    for ((dblk, blk), &e) in drow
                        .chunks_exact_mut(8)
                        .zip(buf.chunks_exact(16))
                        .zip(enc.iter())
                    {
                        let mut codes = [0u8; 16];
                        for (c, &v) in codes.iter_mut().zip(blk) {
                            *c = e2m1_fast(v * e);
                        }
                        dblk.copy_from_slice(&pack16(&codes));
                    }
                }
            },
        );
}

/// Pack 16 nibble codes, low nibble first (same bytes as [`crate::pack_nibbles`]), with
/// 64-bit word arithmetic: byte 2i | byte 2i+1 << 4, then the even bytes compressed.
#[inline(always)]
fn pack16(codes: &[u8; 16]) -> [u8; 8] {
    let half = |w: u64| -> u32 {
        let w = (w | (w >> 4)) & 0x00FF_00FF_00FF_00FF;
        let w = (w | (w >> 8)) & 0x0000_FFFF_0000_FFFF;
        (w | (w >> 16)) as u32
    };
    let lo = u64::from_le_bytes(codes[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(codes[8..].try_into().expect("8 bytes"));
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&half(lo).to_le_bytes());
    out[4..].copy_from_slice(&half(hi).to_le_bytes());
    out
}

/// `max|x|` of a slice, NaN ignored (same as [`crate::amax_of`]): eight independent lanes so
/// the loop has no serial dependency (order-independent, see [`amax_block`]).
#[inline(always)]
fn amax_slice<T: HighPrecision>(x: &[T]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            let a = c[l].to_f32().abs();
            acc[l] = if a > acc[l] { a } else { acc[l] };
        }
    }
    for (l, v) in rest.iter().enumerate() {
        let a = v.to_f32().abs();
        acc[l] = if a > acc[l] { a } else { acc[l] };
    }
    acc.iter().fold(0.0f32, |m, &a| if a > m { a } else { m })
}

/// Quantize `x` with `scheme` — the production path (fast, parallel). Same contract, same
/// bytes as [`reference::quantize`]; see it for the arguments.
pub fn quantize<T: HighPrecision>(
    x: &[T],
    shape: &[usize],
    scheme: Scheme,
    padding: Padding,
) -> Result<QuantizedTensor, FormatError> {
    let g = Geometry::new(shape, x.len(), scheme, padding)?;
    if g.m != g.mp || g.k != g.kp {
        let xp = widen_padded(x, &g);
        let gp = Geometry {
            m: g.mp,
            k: g.kp,
            ..g
        };
        let mut q = quantize_geom(&xp, &gp, scheme, None);
        q.shape = g.shape();
        return Ok(q);
    }
    Ok(quantize_geom(x, &g, scheme, None))
}

/// NVFP4 under a caller-supplied amax — fast path of [`reference::quantize_nvfp4_with_amax`].
pub fn quantize_nvfp4_with_amax<T: HighPrecision>(
    x: &[T],
    shape: &[usize],
    scheme: Nvfp4Scheme,
    padding: Padding,
    amax: &[f32],
) -> Result<QuantizedTensor, FormatError> {
    let g = Geometry::new(shape, x.len(), Scheme::Nvfp4(scheme), padding)?;
    let amax = reference::expand_row_amax(amax, &g, scheme)?;
    if g.m != g.mp || g.k != g.kp {
        let xp = widen_padded(x, &g);
        let gp = Geometry {
            m: g.mp,
            k: g.kp,
            ..g
        };
        let mut q = quantize_geom(&xp, &gp, Scheme::Nvfp4(scheme), Some(&amax));
        q.shape = g.shape();
        return Ok(q);
    }
    Ok(quantize_geom(x, &g, Scheme::Nvfp4(scheme), Some(&amax)))
}

/// Stacked NVFP4 (shared amax) — fast path of [`reference::quantize_nvfp4_stacked`].
pub fn quantize_nvfp4_stacked<T: HighPrecision>(
    parts: &[TensorRef<'_, T>],
    scheme: Nvfp4Scheme,
    padding: Padding,
) -> Result<Vec<QuantizedTensor>, FormatError> {
    let amax = reference::stacked_amax(parts, scheme, padding, |p, g| {
        let per = g.m * g.k;
        (0..g.e)
            .map(|b| par_amax(&p.data[b * per..(b + 1) * per]))
            .collect()
    })?;
    parts
        .iter()
        .map(|p| quantize_nvfp4_with_amax(p.data, p.shape, scheme, padding, &amax))
        .collect()
}

fn widen_padded<T: HighPrecision>(x: &[T], g: &Geometry) -> Vec<f32> {
    let mut out = vec![0.0f32; g.e * g.mp * g.kp];
    for b in 0..g.e {
        for i in 0..g.m {
            let src = &x[(b * g.m + i) * g.k..][..g.k];
            let dst = &mut out[(b * g.mp + i) * g.kp..][..g.k];
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
    out
}

fn par_amax<T: HighPrecision>(x: &[T]) -> f32 {
    x.par_chunks(1 << 14)
        .map(amax_slice)
        .reduce(|| 0.0f32, |a, b| if b > a { b } else { a })
}

/// Quantize an unpadded geometry (`m == mp`, `k == kp`) into `out`, reusing its buffers.
fn quantize_geom_into<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    scheme: Scheme,
    amax: Option<&[f32]>,
    out: &mut QuantizedTensor,
) {
    let (sr, sc) = g.scale_matrix(scheme);
    let nscales = g.e * sr * sc;
    let mut data = std::mem::take(&mut out.data);
    data.resize(g.e * g.mp * g.data_row_bytes(scheme), 0);
    let old_scales = std::mem::replace(&mut out.scales, Scales::Bytes(Vec::new()));
    let (mut bytes, mut floats) = match old_scales {
        Scales::Bytes(b) => (b, Vec::new()),
        Scales::F32(f) => (Vec::new(), f),
    };
    let mut out_amax = std::mem::take(&mut out.amax);
    out_amax.clear();
    let scales = match scheme {
        Scheme::Mxfp8(s) => {
            bytes.resize(nscales, 0);
            mxfp8(x, g, s, &mut data, &mut bytes);
            Scales::Bytes(bytes)
        }
        Scheme::Nvfp4(s) => {
            match amax {
                Some(a) => out_amax.extend_from_slice(a),
                None => match s.amax {
                    AmaxScope::PerTensor => {
                        let per = g.m * g.k;
                        out_amax.extend((0..g.e).map(|b| par_amax(&x[b * per..(b + 1) * per])));
                    }
                    AmaxScope::PerRow => {
                        out_amax.resize(g.e * g.m, 0.0);
                        out_amax
                            .par_iter_mut()
                            .zip(x.par_chunks(g.k))
                            .for_each(|(a, row)| *a = amax_slice(row));
                    }
                },
            }
            bytes.resize(nscales, 0);
            nvfp4(x, g, s, &out_amax, &mut data, &mut bytes);
            Scales::Bytes(bytes)
        }
        Scheme::Fp8Block(s) => {
            floats.resize(nscales, 0.0);
            fp8_block(x, g, s, &mut data, &mut floats);
            Scales::F32(floats)
        }
    };
    out.scheme = scheme;
    out.shape = g.shape();
    out.padded_shape = g.padded_shape();
    out.data = data;
    out.scales = scales;
    out.scale_layout = ScaleLayout::Compact;
    out.amax = out_amax;
}

fn quantize_geom<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    scheme: Scheme,
    amax: Option<&[f32]>,
) -> QuantizedTensor {
    let mut out = QuantizedTensor::empty(scheme);
    quantize_geom_into(x, g, scheme, amax, &mut out);
    out
}

/// Like [`quantize`], but writes into `out`, reusing its buffers (no allocation when `out`
/// already holds a tensor of the same scheme and shape — e.g. an activation quantized every
/// training step). On error `out` is left unchanged.
pub fn quantize_into<T: HighPrecision>(
    x: &[T],
    shape: &[usize],
    scheme: Scheme,
    padding: Padding,
    out: &mut QuantizedTensor,
) -> Result<(), FormatError> {
    let g = Geometry::new(shape, x.len(), scheme, padding)?;
    if g.m != g.mp || g.k != g.kp {
        let xp = widen_padded(x, &g);
        let gp = Geometry {
            m: g.mp,
            k: g.kp,
            ..g
        };
        quantize_geom_into(&xp, &gp, scheme, None, out);
        out.shape = g.shape();
    } else {
        quantize_geom_into(x, &g, scheme, None, out);
    }
    Ok(())
}

/// Per-column-group maxima of a band of `h` rows × `k` columns, groups of `w` columns.
fn band_group_amax<T: HighPrecision>(
    band: &[T],
    k: usize,
    w: usize,
    colmax: &mut [f32],
) -> Vec<f32> {
    colmax.fill(0.0);
    for row in band.chunks_exact(k) {
        for (m, v) in colmax.iter_mut().zip(row) {
            let a = v.to_f32().abs();
            *m = if a > *m { a } else { *m };
        }
    }
    colmax
        .chunks_exact(w)
        .map(|c| c.iter().fold(0.0f32, |a, &b| if b > a { b } else { a }))
        .collect()
}

fn mxfp8<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    s: Mxfp8Scheme,
    data: &mut [u8],
    scales: &mut [u8],
) {
    let k = g.k;
    match (s.blocks, s.usage) {
        (MxBlocks::Vector, Usage::RowWise) => {
            // Rows are independent: parallel over chunks of rows; per row three passes over
            // an f32 copy in L1: block maxima, scales, elements.
            let rows_per_task = (1 << 16) / k.max(1) + 1;
            let nb = k / 32;
            data.par_chunks_mut(rows_per_task * k)
                .zip(scales.par_chunks_mut(rows_per_task * nb))
                .zip(x.par_chunks(rows_per_task * k))
                .for_each_init(
                    || (vec![0.0f32; k], vec![0.0f32; nb]),
                    |(buf, inv), ((d, sc), xs)| {
                        for ((drow, srow), xrow) in d
                            .chunks_exact_mut(k)
                            .zip(sc.chunks_exact_mut(nb))
                            .zip(xs.chunks_exact(k))
                        {
                            for (b, v) in buf.iter_mut().zip(xrow) {
                                *b = v.to_f32();
                            }
                            for ((s, i), blk) in srow
                                .iter_mut()
                                .zip(inv.iter_mut())
                                .zip(buf.chunks_exact(32))
                            {
                                let scale = ue8m0_fast(amax_block(blk) * R448);
                                *s = scale;
                                *i = ue8m0_recip_fast(scale);
                            }
                            for ((dblk, blk), &i) in drow
                                .chunks_exact_mut(32)
                                .zip(buf.chunks_exact(32))
                                .zip(inv.iter())
                            {
                                for (o, &v) in dblk.iter_mut().zip(blk) {
                                    *o = e4m3_fast(v * i);
                                }
                            }
                        }
                    },
                );
        }
        (blocks, usage) => {
            // Bands of 32 rows; the amax group is one column (column-wise vectors) or 32
            // columns (tiles). Row-wise tiles write the tile scale on every row.
            let w = if blocks == MxBlocks::Tile32x32 { 32 } else { 1 };
            let scales_per_band = match usage {
                Usage::RowWise => 32 * (k / 32),
                Usage::ColumnWise => k,
            };
            data.par_chunks_mut(32 * k)
                .zip(scales.par_chunks_mut(scales_per_band))
                .zip(x.par_chunks(32 * k))
                .for_each_init(
                    || vec![0.0f32; k],
                    |colmax, ((d, sc), xs)| {
                        let gmax = band_group_amax(xs, k, w, colmax);
                        let (gs, ginv): (Vec<u8>, Vec<f32>) =
                            gmax.iter().map(|&a| mxfp8_scale(a)).unzip();
                        for (drow, xrow) in d.chunks_exact_mut(k).zip(xs.chunks_exact(k)) {
                            for (j, (o, v)) in drow.iter_mut().zip(xrow).enumerate() {
                                *o = e4m3_fast(v.to_f32() * ginv[j / w]);
                            }
                        }
                        match usage {
                            Usage::ColumnWise => {
                                for (j, o) in sc.iter_mut().enumerate() {
                                    *o = gs[j / w];
                                }
                            }
                            Usage::RowWise => {
                                for srow in sc.chunks_exact_mut(k / 32) {
                                    srow.copy_from_slice(&gs);
                                }
                            }
                        }
                    },
                );
        }
    }
}

fn nvfp4<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    s: Nvfp4Scheme,
    amax: &[f32],
    data: &mut [u8],
    scales: &mut [u8],
) {
    let (m, k) = (g.m, g.k);
    if s.blocks == Nvfp4Blocks::Vector {
        nvfp4_rows(x, m, k, s.amax, amax, data, scales);
        return;
    }
    let band = match s.blocks {
        Nvfp4Blocks::Vector => 1,
        Nvfp4Blocks::Tile16x16 => 16,
    };
    let rows_per_task = ((1 << 16) / k.max(1) / band + 1) * band;
    data.par_chunks_mut(rows_per_task * k / 2)
        .zip(scales.par_chunks_mut(rows_per_task * k / 16))
        .zip(x.par_chunks(rows_per_task * k))
        .enumerate()
        .for_each(|(t, ((d, sc), xs))| {
            let mut colmax = vec![0.0f32; k];
            let mut codes = [0u8; 16];
            for (bi, ((dband, sband), xband)) in d
                .chunks_mut(band * k / 2)
                .zip(sc.chunks_mut(band * k / 16))
                .zip(xs.chunks(band * k))
                .enumerate()
            {
                let tile_max = (band > 1).then(|| band_group_amax(xband, k, 16, &mut colmax));
                for (r, ((drow, srow), xrow)) in dband
                    .chunks_exact_mut(k / 2)
                    .zip(sband.chunks_exact_mut(k / 16))
                    .zip(xband.chunks_exact(k))
                    .enumerate()
                {
                    let row = t * rows_per_task + bi * band + r;
                    let global = Nvfp4Global::from_amax(match s.amax {
                        AmaxScope::PerTensor => amax[row / m],
                        AmaxScope::PerRow => amax[row],
                    });
                    for (jb, ((dblk, sblk), xblk)) in drow
                        .chunks_exact_mut(8)
                        .zip(srow.iter_mut())
                        .zip(xrow.chunks_exact(16))
                        .enumerate()
                    {
                        let bmax = match &tile_max {
                            Some(tm) => tm[jb],
                            None => amax_slice(xblk),
                        };
                        let (scale, enc) = global.block(bmax);
                        *sblk = scale;
                        for (c, v) in codes.iter_mut().zip(xblk) {
                            *c = e2m1_fast(v.to_f32() * enc);
                        }
                        for (i, o) in dblk.iter_mut().enumerate() {
                            *o = codes[2 * i] | (codes[2 * i + 1] << 4);
                        }
                    }
                }
            }
        });
}

fn fp8_block<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    s: Fp8BlockScheme,
    data: &mut [u8],
    scales: &mut [f32],
) {
    let k = g.k;
    let [h, w] = Scheme::Fp8Block(s).scale_block();
    data.par_chunks_mut(h * k)
        .zip(scales.par_chunks_mut(k / w))
        .zip(x.par_chunks(h * k))
        .for_each_init(
            || vec![0.0f32; k],
            |colmax, ((d, sc), xs)| {
                let gmax = band_group_amax(xs, k, w, colmax);
                let mut mult = vec![0f32; gmax.len()];
                for ((o, m), &a) in sc.iter_mut().zip(mult.iter_mut()).zip(&gmax) {
                    let (scale, inv) = fp8_block_scale(a, s.scale_rule);
                    *o = inv;
                    *m = scale;
                }
                for (drow, xrow) in d.chunks_exact_mut(k).zip(xs.chunks_exact(k)) {
                    for ((dblk, xblk), &m) in drow
                        .chunks_exact_mut(w)
                        .zip(xrow.chunks_exact(w))
                        .zip(&mult)
                    {
                        for (o, v) in dblk.iter_mut().zip(xblk) {
                            *o = e4m3_fast(v.to_f32() * m);
                        }
                    }
                }
            },
        );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_element_encoders_equal_reference_on_sampled_bit_patterns() {
        // Every pattern of the top 16 bits (so every BF16 value, every exponent and the
        // mantissa bits around both rounding points) × low halves that exercise round-down,
        // ties and round-up. The ignored test below covers all 2^32 patterns.
        for hi in 0..=u16::MAX as u32 {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let bits = (hi << 16) | lo;
                let x = f32::from_bits(bits);
                assert_eq!(e4m3_fast(x), crate::e4m3_encode(x), "e4m3 {bits:#010x}");
                assert_eq!(e2m1_fast(x), crate::e2m1_encode(x), "e2m1 {bits:#010x}");
                assert_eq!(
                    ue8m0_fast(x),
                    crate::ue8m0_round_up(x),
                    "ue8m0 {bits:#010x}"
                );
            }
        }
    }

    #[test]
    fn pack16_equals_pack_nibbles() {
        for seed in 0..256u32 {
            let codes: [u8; 16] =
                std::array::from_fn(|i| ((seed.wrapping_mul(31) + i as u32 * 7) % 16) as u8);
            assert_eq!(
                pack16(&codes).to_vec(),
                crate::pack_nibbles(&codes),
                "seed {seed}"
            );
        }
    }

    #[test]
    #[ignore = "exhaustive over 2^32 patterns (~3 min on 2 busy cores in release); run with --ignored"]
    fn fast_element_encoders_equal_reference_on_every_f32() {
        (0..=u16::MAX).into_par_iter().for_each(|hi| {
            for lo in 0..=u16::MAX as u32 {
                let bits = ((hi as u32) << 16) | lo;
                let x = f32::from_bits(bits);
                assert_eq!(e4m3_fast(x), crate::e4m3_encode(x), "e4m3 {bits:#010x}");
                assert_eq!(e2m1_fast(x), crate::e2m1_encode(x), "e2m1 {bits:#010x}");
                assert_eq!(
                    ue8m0_fast(x),
                    crate::ue8m0_round_up(x),
                    "ue8m0 {bits:#010x}"
                );
            }
        });
    }
}
