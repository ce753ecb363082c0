//! Fast CPU quantizers: rayon over row bands, branch-free element encoders, one pass per
//! band. Named reference: [`crate::reference`]; every function here must produce the same
//! bytes (tested on random shapes and seeds, the corner-case table and the vector files).
//!
//! The scalar scale rules are the shared ones of [`crate::rules`]; what differs from the
//! reference is iteration order, parallelism and the element encoders, which are branch-free
//! re-statements of [`crate::element`] tested equal to it on every f32 bit pattern.

use crate::input::{HighPrecision, TensorRef};
use crate::layout::pack_nibbles;
use crate::reference;
use crate::rules::{fp8_block_scale, mxfp8_scale, Nvfp4Global};
use crate::scheme::{
    AmaxScope, Fp8BlockScheme, MxBlocks, Mxfp8Scheme, Nvfp4Blocks, Nvfp4Scheme, Padding,
    ScaleLayout, Scheme, Usage,
};
use crate::tensor::{Geometry, QuantizedTensor, Scales};
use crate::FormatError;
use rayon::prelude::*;

/// Branch-free f32 → E4M3 (rule [`crate::ElementRule::E4m3SatfiniteRne`]); equal to
/// [`crate::e4m3_encode`] on every f32 bit pattern.
#[inline(always)]
pub(crate) fn e4m3_fast(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range (|x| ≥ 2⁻⁶): round the mantissa to 3 bits (ties to even) in the bit pattern.
    let rounded = abs.wrapping_add(0x7_FFFF + ((abs >> 20) & 1)) >> 20;
    let normal = rounded.wrapping_sub(120 << 3).min(0x7E);
    // Subnormal range: adding 2^14 (ulp 2⁻⁹) rounds |x| to the k·2⁻⁹ grid with ties to even.
    let sub = (f32::from_bits(abs) + 16384.0)
        .to_bits()
        .wrapping_sub(0x4680_0000);
    let code = if abs < 0x3C80_0000 { sub } else { normal };
    let code = if abs > 0x7F80_0000 { 0x7F } else { code | sign };
    code as u8
}

/// Branch-free f32 → E2M1 nibble (rule [`crate::ElementRule::E2m1SatfiniteRne`]); equal to
/// [`crate::e2m1_encode`] on every f32 bit pattern.
#[inline(always)]
pub(crate) fn e2m1_fast(x: f32) -> u8 {
    let a = x.abs();
    let code = u8::from(a > 0.25)
        + u8::from(a >= 0.75)
        + u8::from(a > 1.25)
        + u8::from(a >= 1.75)
        + u8::from(a > 2.5)
        + u8::from(a >= 3.5)
        + u8::from(a > 5.0);
    let sign = ((x.to_bits() >> 28) & 0x8) as u8;
    if x.is_nan() {
        0x7
    } else {
        code | sign
    }
}

/// `max|x|` of a slice, NaN ignored (same as [`crate::amax_of`]).
#[inline(always)]
fn amax_slice<T: HighPrecision>(x: &[T]) -> f32 {
    let mut a = 0.0f32;
    for v in x {
        let m = v.to_f32().abs();
        a = if m > a { m } else { a };
    }
    a
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

/// Quantize an unpadded geometry (`m == mp`, `k == kp`).
fn quantize_geom<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    scheme: Scheme,
    amax: Option<&[f32]>,
) -> QuantizedTensor {
    let (sr, sc) = g.scale_matrix(scheme);
    let nscales = g.e * sr * sc;
    let (mut out_amax, data, scales) = match scheme {
        Scheme::Mxfp8(s) => {
            let (d, s) = mxfp8(x, g, s, nscales);
            (Vec::new(), d, Scales::Bytes(s))
        }
        Scheme::Nvfp4(s) => {
            let amax = match amax {
                Some(a) => a.to_vec(),
                None => match s.amax {
                    AmaxScope::PerTensor => {
                        let per = g.m * g.k;
                        (0..g.e)
                            .map(|b| par_amax(&x[b * per..(b + 1) * per]))
                            .collect()
                    }
                    AmaxScope::PerRow => x.par_chunks(g.k).map(amax_slice).collect(),
                },
            };
            let (d, sc) = nvfp4(x, g, s, &amax, nscales);
            (amax, d, Scales::Bytes(sc))
        }
        Scheme::Fp8Block(s) => {
            let (d, sc) = fp8_block(x, g, s, nscales);
            (Vec::new(), d, Scales::F32(sc))
        }
    };
    out_amax.shrink_to_fit();
    QuantizedTensor {
        scheme,
        shape: g.shape(),
        padded_shape: g.padded_shape(),
        data,
        scales,
        scale_layout: ScaleLayout::Compact,
        amax: out_amax,
    }
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
    nscales: usize,
) -> (Vec<u8>, Vec<u8>) {
    let k = g.k;
    let mut data = vec![0u8; x.len()];
    let mut scales = vec![0u8; nscales];
    match (s.blocks, s.usage) {
        (MxBlocks::Vector, Usage::RowWise) => {
            // Rows are independent: parallel over chunks of rows.
            let rows_per_task = (1 << 16) / k.max(1) + 1;
            data.par_chunks_mut(rows_per_task * k)
                .zip(scales.par_chunks_mut(rows_per_task * k / 32))
                .zip(x.par_chunks(rows_per_task * k))
                .for_each(|((d, sc), xs)| {
                    for ((db, s), xb) in d
                        .chunks_exact_mut(32)
                        .zip(sc.iter_mut())
                        .zip(xs.chunks_exact(32))
                    {
                        let (scale, inv) = mxfp8_scale(amax_slice(xb));
                        *s = scale;
                        for (o, v) in db.iter_mut().zip(xb) {
                            *o = e4m3_fast(v.to_f32() * inv);
                        }
                    }
                });
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
    (data, scales)
}

fn nvfp4<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    s: Nvfp4Scheme,
    amax: &[f32],
    nscales: usize,
) -> (Vec<u8>, Vec<u8>) {
    let (m, k) = (g.m, g.k);
    let mut data = vec![0u8; x.len() / 2];
    let mut scales = vec![0u8; nscales];
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
    debug_assert_eq!(pack_nibbles(&[1, 2]), vec![0x21]);
    (data, scales)
}

fn fp8_block<T: HighPrecision>(
    x: &[T],
    g: &Geometry,
    s: Fp8BlockScheme,
    nscales: usize,
) -> (Vec<u8>, Vec<f32>) {
    let k = g.k;
    let [h, w] = Scheme::Fp8Block(s).scale_block();
    let mut data = vec![0u8; x.len()];
    let mut scales = vec![0f32; nscales];
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
    (data, scales)
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
            }
        }
    }

    #[test]
    #[ignore = "exhaustive over 2^32 patterns (~10 s with 2 cores in release); run with --ignored"]
    fn fast_element_encoders_equal_reference_on_every_f32() {
        (0..=u16::MAX).into_par_iter().for_each(|hi| {
            for lo in 0..=u16::MAX as u32 {
                let bits = ((hi as u32) << 16) | lo;
                let x = f32::from_bits(bits);
                assert_eq!(e4m3_fast(x), crate::e4m3_encode(x), "e4m3 {bits:#010x}");
                assert_eq!(e2m1_fast(x), crate::e2m1_encode(x), "e2m1 {bits:#010x}");
            }
        });
    }
}
