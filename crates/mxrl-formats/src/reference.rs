//! Reference quantizers: the simplest loops that state contract §2–§3 and the FP8-block rule
//! directly. Every fast path in mxrl (the CPU fast paths of this crate, the CUDA kernels) is
//! tested byte-for-byte against these functions.

use crate::element::{e2m1_encode, e4m3_encode};
use crate::input::{HighPrecision, TensorRef};
use crate::layout::pack_nibbles;
use crate::rules::{amax_of, fp8_block_scale, mxfp8_scale, Nvfp4Global};
use crate::scheme::{
    AmaxScope, Fp8Blocks, MxBlocks, Nvfp4Blocks, Nvfp4Scheme, Padding, ScaleLayout, Scheme, Usage,
};
use crate::tensor::{Geometry, QuantizedTensor, Scales};
use crate::FormatError;

/// Zero-padded f32 copy `[E, Mp, Kp]` of the input.
fn widen_padded<T: HighPrecision>(x: &[T], g: &Geometry) -> Vec<f32> {
    let mut out = vec![0.0f32; g.e * g.mp * g.kp];
    for b in 0..g.e {
        for i in 0..g.m {
            for j in 0..g.k {
                out[(b * g.mp + i) * g.kp + j] = x[(b * g.m + i) * g.k + j].to_f32();
            }
        }
    }
    out
}

/// Quantize `x` (row-major, `shape` = `[M, K]` or `[E, M, K]`) with `scheme` — reference.
///
/// NVFP4 per-tensor amax is taken per expert for 3-D input. Blocked dimensions that are not
/// multiples of the block are refused unless `padding` is [`Padding::Zero`].
pub fn quantize<T: HighPrecision>(
    x: &[T],
    shape: &[usize],
    scheme: Scheme,
    padding: Padding,
) -> Result<QuantizedTensor, FormatError> {
    let g = Geometry::new(shape, x.len(), scheme, padding)?;
    let xp = widen_padded(x, &g);
    match scheme {
        Scheme::Mxfp8(_) => Ok(mxfp8(&xp, &g, scheme)),
        Scheme::Nvfp4(s) => {
            let amax = nvfp4_amax(&xp, &g, s);
            Ok(nvfp4(&xp, &g, s, &amax))
        }
        Scheme::Fp8Block(_) => Ok(fp8_block(&xp, &g, scheme)),
    }
}

/// Quantize with NVFP4 under a given FP32 amax instead of the tensor's own: `amax` has one
/// value per expert (length E, or 1 for 2-D input) for [`AmaxScope::PerTensor`], or one per
/// row (length E·M) for [`AmaxScope::PerRow`]. This is how several tensors share one amax
/// (see [`quantize_nvfp4_stacked`]). The stored `amax` is the given one.
pub fn quantize_nvfp4_with_amax<T: HighPrecision>(
    x: &[T],
    shape: &[usize],
    scheme: Nvfp4Scheme,
    padding: Padding,
    amax: &[f32],
) -> Result<QuantizedTensor, FormatError> {
    let g = Geometry::new(shape, x.len(), Scheme::Nvfp4(scheme), padding)?;
    let amax = expand_row_amax(amax, &g, scheme)?;
    let xp = widen_padded(x, &g);
    Ok(nvfp4(&xp, &g, scheme, &amax))
}

/// Check a caller-supplied amax and pad per-row values to `E·Mp` (padded rows get 0).
pub(crate) fn expand_row_amax(
    amax: &[f32],
    g: &Geometry,
    scheme: Nvfp4Scheme,
) -> Result<Vec<f32>, FormatError> {
    let (expected, shape) = match scheme.amax {
        AmaxScope::PerTensor => (g.e, vec![g.e]),
        AmaxScope::PerRow => (g.e * g.m, vec![g.e, g.m]),
    };
    if amax.len() != expected {
        return Err(FormatError::LengthMismatch {
            what: "amax",
            shape,
            expected,
            got: amax.len(),
        });
    }
    Ok(match scheme.amax {
        AmaxScope::PerTensor => amax.to_vec(),
        AmaxScope::PerRow => {
            let mut v = vec![0.0f32; g.e * g.mp];
            for b in 0..g.e {
                v[b * g.mp..b * g.mp + g.m].copy_from_slice(&amax[b * g.m..(b + 1) * g.m]);
            }
            v
        }
    })
}

/// Quantize several tensors (e.g. an expert's gate and up projections) with NVFP4 under one
/// shared per-tensor amax: the max of the parts' amax values (per expert for 3-D parts), so
/// the result equals quantizing the parts stacked along M as one tensor. Parts must have the
/// same rank, the same K and (3-D) the same E; the scheme must use
/// [`AmaxScope::PerTensor`]. Every returned tensor stores the shared amax.
pub fn quantize_nvfp4_stacked<T: HighPrecision>(
    parts: &[TensorRef<'_, T>],
    scheme: Nvfp4Scheme,
    padding: Padding,
) -> Result<Vec<QuantizedTensor>, FormatError> {
    let amax = stacked_amax(parts, scheme, padding, |p, g| {
        let xp = widen_padded(p.data, g);
        nvfp4_amax(&xp, g, scheme)
    })?;
    parts
        .iter()
        .map(|p| quantize_nvfp4_with_amax(p.data, p.shape, scheme, padding, &amax))
        .collect()
}

/// Shared per-expert amax of stacked parts (checks shapes), using `part_amax` per part.
pub(crate) fn stacked_amax<T: HighPrecision>(
    parts: &[TensorRef<'_, T>],
    scheme: Nvfp4Scheme,
    padding: Padding,
    part_amax: impl Fn(&TensorRef<'_, T>, &Geometry) -> Vec<f32>,
) -> Result<Vec<f32>, FormatError> {
    if scheme.amax != AmaxScope::PerTensor {
        return Err(FormatError::Unsupported(
            "stacked NVFP4 quantization shares one per-tensor amax; per-row amax has \
             nothing to share"
                .into(),
        ));
    }
    let Some(first) = parts.first() else {
        return Err(FormatError::Unsupported(
            "stacked quantization of zero parts".into(),
        ));
    };
    let g0 = Geometry::new(
        first.shape,
        first.data.len(),
        Scheme::Nvfp4(scheme),
        padding,
    )?;
    let mut shared = vec![0.0f32; g0.e];
    for (index, p) in parts.iter().enumerate() {
        let g = Geometry::new(p.shape, p.data.len(), Scheme::Nvfp4(scheme), padding)?;
        if g.rank3 != g0.rank3 || g.e != g0.e || g.k != g0.k {
            return Err(FormatError::StackMismatch {
                index,
                shape: p.shape.to_vec(),
                expected: format!("same rank, E and K as part 0 {:?}", first.shape),
            });
        }
        for (s, a) in shared.iter_mut().zip(part_amax(p, &g)) {
            if a > *s {
                *s = a;
            }
        }
    }
    Ok(shared)
}

fn mxfp8(xp: &[f32], g: &Geometry, scheme: Scheme) -> QuantizedTensor {
    let Scheme::Mxfp8(s) = scheme else {
        unreachable!("mxfp8() called with {scheme}")
    };
    let (mp, kp) = (g.mp, g.kp);
    let (sr, sc) = g.scale_matrix(scheme);
    let mut data = vec![0u8; g.e * mp * kp];
    let mut scales = vec![0u8; g.e * sr * sc];
    let at = |b: usize, i: usize, j: usize| xp[(b * mp + i) * kp + j];
    for b in 0..g.e {
        for i in 0..mp {
            for j in 0..kp {
                // The block (or tile) containing (i, j): rows [r0, r1), cols [c0, c1).
                let (r0, r1, c0, c1) = match (s.blocks, s.usage) {
                    (MxBlocks::Vector, Usage::RowWise) => (i, i + 1, j / 32 * 32, j / 32 * 32 + 32),
                    (MxBlocks::Vector, Usage::ColumnWise) => {
                        (i / 32 * 32, i / 32 * 32 + 32, j, j + 1)
                    }
                    (MxBlocks::Tile32x32, _) => {
                        (i / 32 * 32, i / 32 * 32 + 32, j / 32 * 32, j / 32 * 32 + 32)
                    }
                };
                let amax = amax_of((r0..r1).flat_map(|r| (c0..c1).map(move |c| at(b, r, c))));
                let (scale, inv) = mxfp8_scale(amax);
                data[(b * mp + i) * kp + j] = e4m3_encode(at(b, i, j) * inv);
                let si = match s.usage {
                    Usage::RowWise => i * sc + j / 32,
                    Usage::ColumnWise => (i / 32) * sc + j,
                };
                scales[b * sr * sc + si] = scale;
            }
        }
    }
    QuantizedTensor {
        scheme,
        shape: g.shape(),
        padded_shape: g.padded_shape(),
        data,
        scales: Scales::Bytes(scales),
        scale_layout: ScaleLayout::Compact,
        amax: Vec::new(),
    }
}

/// NVFP4 amax values of a padded tensor: per expert or per padded row.
pub(crate) fn nvfp4_amax(xp: &[f32], g: &Geometry, s: Nvfp4Scheme) -> Vec<f32> {
    let per = g.mp * g.kp;
    match s.amax {
        AmaxScope::PerTensor => (0..g.e)
            .map(|b| amax_of(xp[b * per..(b + 1) * per].iter().copied()))
            .collect(),
        AmaxScope::PerRow => xp
            .chunks(g.kp)
            .map(|row| amax_of(row.iter().copied()))
            .collect(),
    }
}

fn nvfp4(xp: &[f32], g: &Geometry, s: Nvfp4Scheme, amax: &[f32]) -> QuantizedTensor {
    let scheme = Scheme::Nvfp4(s);
    let (mp, kp) = (g.mp, g.kp);
    let (sr, sc) = g.scale_matrix(scheme);
    let mut codes = vec![0u8; g.e * mp * kp];
    let mut scales = vec![0u8; g.e * sr * sc];
    let at = |b: usize, i: usize, j: usize| xp[(b * mp + i) * kp + j];
    for b in 0..g.e {
        for i in 0..mp {
            let global = Nvfp4Global::from_amax(match s.amax {
                AmaxScope::PerTensor => amax[b],
                AmaxScope::PerRow => amax[b * mp + i],
            });
            for jb in 0..kp / 16 {
                let (r0, r1) = match s.blocks {
                    Nvfp4Blocks::Vector => (i, i + 1),
                    Nvfp4Blocks::Tile16x16 => (i / 16 * 16, i / 16 * 16 + 16),
                };
                let bmax = amax_of(
                    (r0..r1).flat_map(|r| (jb * 16..jb * 16 + 16).map(move |c| at(b, r, c))),
                );
                let (scale, enc) = global.block(bmax);
                scales[b * sr * sc + i * sc + jb] = scale;
                for j in jb * 16..jb * 16 + 16 {
                    codes[(b * mp + i) * kp + j] = e2m1_encode(at(b, i, j) * enc);
                }
            }
        }
    }
    QuantizedTensor {
        scheme,
        shape: g.shape(),
        padded_shape: g.padded_shape(),
        data: pack_nibbles(&codes),
        scales: Scales::Bytes(scales),
        scale_layout: ScaleLayout::Compact,
        amax: amax.to_vec(),
    }
}

fn fp8_block(xp: &[f32], g: &Geometry, scheme: Scheme) -> QuantizedTensor {
    let Scheme::Fp8Block(s) = scheme else {
        unreachable!("fp8_block() called with {scheme}")
    };
    let (mp, kp) = (g.mp, g.kp);
    let (sr, sc) = g.scale_matrix(scheme);
    let [bm, bk] = scheme.scale_block();
    let mut data = vec![0u8; g.e * mp * kp];
    let mut scales = vec![0f32; g.e * sr * sc];
    let at = |b: usize, i: usize, j: usize| xp[(b * mp + i) * kp + j];
    for b in 0..g.e {
        for bi in 0..sr {
            for bj in 0..sc {
                let (rows, cols) = (bi * bm..bi * bm + bm, bj * bk..bj * bk + bk);
                let amax = amax_of(
                    rows.clone()
                        .flat_map(|r| cols.clone().map(move |c| at(b, r, c))),
                );
                let (scale, scale_inv) = fp8_block_scale(amax, s.scale_rule);
                scales[b * sr * sc + bi * sc + bj] = scale_inv;
                for r in rows.clone() {
                    for c in cols.clone() {
                        data[(b * mp + r) * kp + c] = e4m3_encode(at(b, r, c) * scale);
                    }
                }
            }
        }
    }
    debug_assert!(matches!(
        s.blocks,
        Fp8Blocks::Weight128x128 | Fp8Blocks::Activation1x128
    ));
    QuantizedTensor {
        scheme,
        shape: g.shape(),
        padded_shape: g.padded_shape(),
        data,
        scales: Scales::F32(scales),
        scale_layout: ScaleLayout::Compact,
        amax: Vec::new(),
    }
}
