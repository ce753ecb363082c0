//! The quantized-tensor type: data + scales + amax + layout + usage.

use crate::element::{e4m3_decode, ue8m0_decode};
use crate::layout::{swizzle_128x4, swizzled_len, transpose_bytes, unswizzle_128x4};
use crate::scheme::{
    AmaxScope, Fp8Blocks, MxBlocks, Nvfp4Blocks, Padding, ScaleLayout, Scheme, Usage,
};
use crate::serving::Nvfp4SecondLevel;
use crate::{Format, FormatError};

/// `[E, M, K]` of a 2-D (`E = 1`) or 3-D input, before and after padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub e: usize,
    pub m: usize,
    pub k: usize,
    pub mp: usize,
    pub kp: usize,
    pub rank3: bool,
}

impl Geometry {
    /// Multiples `(M, K)` each blocked dimension must have under `scheme`.
    pub fn multiples(scheme: Scheme) -> (usize, usize) {
        match scheme {
            Scheme::Mxfp8(s) => match (s.blocks, s.usage) {
                (MxBlocks::Tile32x32, _) => (32, 32),
                (MxBlocks::Vector, Usage::RowWise) => (1, 32),
                (MxBlocks::Vector, Usage::ColumnWise) => (32, 1),
            },
            Scheme::Nvfp4(s) => match s.blocks {
                Nvfp4Blocks::Vector => (1, 16),
                Nvfp4Blocks::Tile16x16 => (16, 16),
            },
            Scheme::Fp8Block(s) => match s.blocks {
                Fp8Blocks::Weight128x128 => (128, 128),
                Fp8Blocks::Activation1x128 => (1, 128),
            },
        }
    }

    pub fn new(
        shape: &[usize],
        len: usize,
        scheme: Scheme,
        padding: Padding,
    ) -> Result<Self, FormatError> {
        let (e, m, k, rank3) = match *shape {
            [m, k] => (1, m, k, false),
            [e, m, k] => (e, m, k, true),
            _ => {
                return Err(FormatError::BadRank {
                    shape: shape.to_vec(),
                })
            }
        };
        let expected = e * m * k;
        if len != expected {
            return Err(FormatError::LengthMismatch {
                what: "input",
                shape: shape.to_vec(),
                expected,
                got: len,
            });
        }
        if scheme.format() == Format::Nvfp4 && scheme.usage() != Usage::RowWise {
            return Err(FormatError::Unsupported(format!(
                "{scheme}: only row-wise usage"
            )));
        }
        let (bm, bk) = Self::multiples(scheme);
        let (mp, kp) = (m.div_ceil(bm) * bm, k.div_ceil(bk) * bk);
        if padding == Padding::Reject {
            if k != kp {
                return Err(FormatError::NotMultiple {
                    scheme: scheme.name(),
                    dim: "K",
                    size: k,
                    block: bk,
                    shape: shape.to_vec(),
                });
            }
            if m != mp {
                return Err(FormatError::NotMultiple {
                    scheme: scheme.name(),
                    dim: "M",
                    size: m,
                    block: bm,
                    shape: shape.to_vec(),
                });
            }
        }
        Ok(Geometry {
            e,
            m,
            k,
            mp,
            kp,
            rank3,
        })
    }

    pub fn shape(&self) -> Vec<usize> {
        self.with_batch(&[self.m, self.k])
    }

    pub fn padded_shape(&self) -> Vec<usize> {
        self.with_batch(&[self.mp, self.kp])
    }

    pub fn with_batch(&self, tail: &[usize]) -> Vec<usize> {
        let mut v = Vec::with_capacity(3);
        if self.rank3 {
            v.push(self.e);
        }
        v.extend_from_slice(tail);
        v
    }

    /// Compact scale matrix of one batch (expert): `[rows, cols]`.
    pub fn scale_matrix(&self, scheme: Scheme) -> (usize, usize) {
        let (mp, kp) = (self.mp, self.kp);
        match scheme {
            Scheme::Mxfp8(s) => match s.usage {
                Usage::RowWise => (mp, kp / 32),
                Usage::ColumnWise => (mp / 32, kp),
            },
            Scheme::Nvfp4(_) => (mp, kp / 16),
            Scheme::Fp8Block(s) => match s.blocks {
                Fp8Blocks::Weight128x128 => (mp / 128, kp / 128),
                Fp8Blocks::Activation1x128 => (mp, kp / 128),
            },
        }
    }

    /// Number of amax values: E (per tensor) or E·Mp (per row) for NVFP4, else 0.
    pub fn amax_len(&self, scheme: Scheme) -> usize {
        match scheme {
            Scheme::Nvfp4(s) => match s.amax {
                AmaxScope::PerTensor => self.e,
                AmaxScope::PerRow => self.e * self.mp,
            },
            _ => 0,
        }
    }

    /// Bytes of data per padded row.
    pub fn data_row_bytes(&self, scheme: Scheme) -> usize {
        match scheme.format() {
            Format::Nvfp4 => self.kp / 2,
            _ => self.kp,
        }
    }
}

/// Block scales: bytes (UE8M0 for MXFP8, UE4M3 for NVFP4) or FP32 (FP8 block, the
/// `scale_inv` = dequantization multiplier).
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    /// One byte per block, in the tensor's [`ScaleLayout`].
    Bytes(Vec<u8>),
    /// One f32 per block (always compact row-major).
    F32(Vec<f32>),
}

impl Scales {
    /// The byte scales, if these are byte scales.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Scales::Bytes(b) => Some(b),
            Scales::F32(_) => None,
        }
    }

    /// The f32 scales, if these are f32 scales.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Scales::F32(v) => Some(v),
            Scales::Bytes(_) => None,
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        match self {
            Scales::Bytes(b) => b.len(),
            Scales::F32(v) => 4 * v.len(),
        }
    }
}

/// A block-scaled tensor: data + scales + amax + layout + usage.
///
/// Shapes (2-D input `[M, K]`; a 3-D input `[E, M, K]` prefixes every shape with E, one
/// independent matrix per expert; `Mp`, `Kp` are M, K after [`Padding::Zero`], else equal):
///
/// | scheme | `data` | compact `scales` | `amax` |
/// |---|---|---|---|
/// | MXFP8 row-wise | u8 E4M3 `[Mp, Kp]` | u8 UE8M0 `[Mp, Kp/32]` | — |
/// | MXFP8 column-wise | u8 E4M3 `[Mp, Kp]` (input's shape) | u8 UE8M0 `[Mp/32, Kp]` | — |
/// | NVFP4 | u8 packed E2M1 `[Mp, Kp/2]` (low nibble first) | u8 UE4M3 `[Mp, Kp/16]` | f32 `[1]` per tensor / `[Mp]` per row |
/// | FP8 block weight | u8 E4M3 `[Mp, Kp]` | f32 scale_inv `[Mp/128, Kp/128]` | — |
/// | FP8 block act | u8 E4M3 `[Mp, Kp]` | f32 scale_inv `[Mp, Kp/128]` | — |
///
/// The quantizers guarantee these invariants; [`QuantizedTensor::validate`] checks them for
/// tensors assembled by hand (e.g. read from a file).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    /// Format, blocks, scale rule and usage.
    pub scheme: Scheme,
    /// The logical (unpadded) shape, `[M, K]` or `[E, M, K]`.
    pub shape: Vec<usize>,
    /// The stored shape after padding (equal to `shape` unless [`Padding::Zero`] padded it).
    pub padded_shape: Vec<usize>,
    /// Element bytes (see the table above).
    pub data: Vec<u8>,
    /// Block scales.
    pub scales: Scales,
    /// Layout of byte scales (f32 scales are always [`ScaleLayout::Compact`]).
    pub scale_layout: ScaleLayout,
    /// NVFP4 FP32 amax values (per tensor/expert or per row); empty for other formats.
    pub amax: Vec<f32>,
}

impl QuantizedTensor {
    /// An empty tensor of `scheme` (no elements): the starting point for
    /// [`quantize_into`](crate::quantize_into) buffers.
    pub fn empty(scheme: Scheme) -> Self {
        QuantizedTensor {
            scheme,
            shape: Vec::new(),
            padded_shape: Vec::new(),
            data: Vec::new(),
            scales: Scales::Bytes(Vec::new()),
            scale_layout: ScaleLayout::Compact,
            amax: Vec::new(),
        }
    }

    pub(crate) fn geometry(&self) -> Result<Geometry, FormatError> {
        let n = self.padded_shape.iter().product();
        let g = Geometry::new(&self.padded_shape, n, self.scheme, Padding::Reject)?;
        let lg = Geometry::new(
            &self.shape,
            self.shape.iter().product(),
            self.scheme,
            Padding::Zero,
        )?;
        if lg.mp != g.mp || lg.kp != g.kp || lg.e != g.e || lg.rank3 != g.rank3 {
            return Err(FormatError::Unsupported(format!(
                "{}: padded shape {:?} is not shape {:?} rounded up to the block",
                self.scheme, self.padded_shape, self.shape
            )));
        }
        Ok(Geometry {
            m: lg.m,
            k: lg.k,
            ..g
        })
    }

    /// Usage (row-wise / column-wise).
    pub fn usage(&self) -> Usage {
        self.scheme.usage()
    }

    /// Storage format.
    pub fn format(&self) -> Format {
        self.scheme.format()
    }

    /// Shape of `data` (`[.., Mp, Kp/2]` for NVFP4, `[.., Mp, Kp]` otherwise).
    pub fn data_shape(&self) -> Vec<usize> {
        let mut s = self.padded_shape.clone();
        if self.format() == Format::Nvfp4 {
            *s.last_mut().expect("non-empty shape") /= 2;
        }
        s
    }

    /// Logical compact shape of the scale matrix (`[.., rows, cols]`), whatever the layout.
    pub fn scale_shape(&self) -> Vec<usize> {
        match self.geometry() {
            Ok(g) => {
                let (r, c) = g.scale_matrix(self.scheme);
                g.with_batch(&[r, c])
            }
            Err(_) => Vec::new(),
        }
    }

    /// Shape of `amax`: `[1]` / `[E]` per tensor, `[Mp]` / `[E, Mp]` per row, `[]` if none.
    pub fn amax_shape(&self) -> Vec<usize> {
        match (self.scheme, self.geometry()) {
            (Scheme::Nvfp4(s), Ok(g)) => match (s.amax, g.rank3) {
                (AmaxScope::PerTensor, false) => vec![1],
                (AmaxScope::PerTensor, true) => vec![g.e],
                (AmaxScope::PerRow, false) => vec![g.mp],
                (AmaxScope::PerRow, true) => vec![g.e, g.mp],
            },
            _ => Vec::new(),
        }
    }

    /// Stored bytes: data + scales + amax.
    pub fn nbytes(&self) -> usize {
        self.data.len() + self.scales.nbytes() + 4 * self.amax.len()
    }

    /// The lengths an unpadded tensor of `scheme` and `shape` has with compact scales —
    /// `(data bytes, scale elements, amax values)`, scale elements being bytes, or f32 values
    /// for FP8 block: exactly what [`QuantizedTensor::validate`] accepts for such a tensor, so
    /// stored bytes can be checked before they are gathered into one (e.g. copied straight
    /// into a device's buffers).
    ///
    /// # Errors
    /// A shape the scheme does not tile without padding.
    pub fn compact_lengths(
        scheme: Scheme,
        shape: &[usize],
    ) -> Result<(usize, usize, usize), FormatError> {
        let g = Geometry::new(shape, shape.iter().product(), scheme, Padding::Reject)?;
        let (r, c) = g.scale_matrix(scheme);
        Ok((
            g.e * g.mp * g.data_row_bytes(scheme),
            g.e * r * c,
            g.amax_len(scheme),
        ))
    }

    /// Check every buffer length against the shapes and layout.
    pub fn validate(&self) -> Result<(), FormatError> {
        let g = self.geometry()?;
        let data_len = g.e * g.mp * g.data_row_bytes(self.scheme);
        if self.data.len() != data_len {
            return Err(FormatError::LengthMismatch {
                what: "data",
                shape: self.data_shape(),
                expected: data_len,
                got: self.data.len(),
            });
        }
        let (r, c) = g.scale_matrix(self.scheme);
        let (sr, sc) = self.gemm_scale_view(r, c);
        let scale_len = match (&self.scales, self.scale_layout) {
            (Scales::Bytes(_), ScaleLayout::Compact) => g.e * r * c,
            (Scales::Bytes(_), ScaleLayout::Swizzled128x4) => g.e * swizzled_len(sr, sc),
            (Scales::F32(_), ScaleLayout::Compact) => g.e * r * c,
            (Scales::F32(_), ScaleLayout::Swizzled128x4) => {
                return Err(FormatError::Unsupported(
                    "f32 scales have no swizzled layout".into(),
                ))
            }
        };
        let f32_scales = matches!(self.scales, Scales::F32(_));
        if f32_scales != (self.format() == Format::Fp8Block) {
            return Err(FormatError::Unsupported(format!(
                "{}: scales must be {}",
                self.scheme,
                if self.format() == Format::Fp8Block {
                    "f32"
                } else {
                    "bytes"
                }
            )));
        }
        let got = match &self.scales {
            Scales::Bytes(b) => b.len(),
            Scales::F32(v) => v.len(),
        };
        if got != scale_len {
            return Err(FormatError::LengthMismatch {
                what: "scales",
                shape: self.scale_shape(),
                expected: scale_len,
                got,
            });
        }
        let amax_len = g.amax_len(self.scheme);
        if self.amax.len() != amax_len {
            return Err(FormatError::LengthMismatch {
                what: "amax",
                shape: self.amax_shape(),
                expected: amax_len,
                got: self.amax.len(),
            });
        }
        Ok(())
    }

    /// The `[rows, cols]` matrix the swizzle is applied to: the compact `[r, c]` for row-wise
    /// usage, its transpose `[c, r]` (= `[K, M/32]`) for column-wise MXFP8.
    fn gemm_scale_view(&self, r: usize, c: usize) -> (usize, usize) {
        match self.usage() {
            Usage::RowWise => (r, c),
            Usage::ColumnWise => (c, r),
        }
    }

    /// The same tensor with its byte scales in `layout` (both directions; per expert for
    /// 3-D tensors; column-wise MXFP8 scales are swizzled in their transposed `[K, M/32]`
    /// view). FP8-block f32 scales only have the compact layout.
    pub fn with_scale_layout(mut self, layout: ScaleLayout) -> Result<Self, FormatError> {
        self.validate()?;
        if layout == self.scale_layout {
            return Ok(self);
        }
        let g = self.geometry()?;
        let (r, c) = g.scale_matrix(self.scheme);
        let (vr, vc) = self.gemm_scale_view(r, c);
        let col = self.usage() == Usage::ColumnWise;
        let Scales::Bytes(bytes) = &self.scales else {
            return Err(FormatError::Unsupported(format!(
                "{}: f32 scales have no swizzled layout",
                self.scheme
            )));
        };
        let mut out = Vec::new();
        match layout {
            ScaleLayout::Swizzled128x4 => {
                for chunk in bytes.chunks(r * c) {
                    let view = if col {
                        transpose_bytes(chunk, r, c)
                    } else {
                        chunk.to_vec()
                    };
                    out.extend(swizzle_128x4(&view, vr, vc));
                }
            }
            ScaleLayout::Compact => {
                for chunk in bytes.chunks(swizzled_len(vr, vc)) {
                    let view = unswizzle_128x4(chunk, vr, vc);
                    out.extend(if col {
                        transpose_bytes(&view, vr, vc)
                    } else {
                        view
                    });
                }
            }
        }
        self.scales = Scales::Bytes(out);
        self.scale_layout = layout;
        Ok(self)
    }

    /// Dequantize to f32 in the logical shape (reference dequantizer, contract formulas):
    /// MXFP8 `fl(ue8m0_decode(scale) × e4m3_value(q))`; NVFP4
    /// `fl(e2m1_value(code) × fl(fl(sf × amax) × R2688))`; FP8 block
    /// `fl(e4m3_value(q) × scale_inv)`.
    pub fn dequantize(&self) -> Result<Vec<f32>, FormatError> {
        let compact = self.clone().with_scale_layout(ScaleLayout::Compact)?;
        let g = compact.geometry()?;
        let (sr, sc) = g.scale_matrix(self.scheme);
        let mut out = Vec::with_capacity(g.e * g.m * g.k);
        for b in 0..g.e {
            for i in 0..g.m {
                for j in 0..g.k {
                    let x = match (&compact.scales, self.scheme) {
                        (Scales::Bytes(s), Scheme::Mxfp8(m)) => {
                            let q = compact.data[(b * g.mp + i) * g.kp + j];
                            let si = match m.usage {
                                Usage::RowWise => i * sc + j / 32,
                                Usage::ColumnWise => (i / 32) * sc + j,
                            };
                            ue8m0_decode(s[b * sr * sc + si]) * e4m3_decode(q)
                        }
                        (Scales::Bytes(s), Scheme::Nvfp4(n)) => {
                            let byte = compact.data[(b * g.mp + i) * (g.kp / 2) + j / 2];
                            let code = (byte >> (4 * (j % 2))) & 0xF;
                            let scale = s[b * sr * sc + i * sc + j / 16];
                            let amax = match n.amax {
                                AmaxScope::PerTensor => compact.amax[b],
                                AmaxScope::PerRow => compact.amax[b * g.mp + i],
                            };
                            Nvfp4SecondLevel::Amax.dequantize(code, scale, amax)
                        }
                        (Scales::F32(s), Scheme::Fp8Block(f)) => {
                            let q = compact.data[(b * g.mp + i) * g.kp + j];
                            let si = match f.blocks {
                                Fp8Blocks::Weight128x128 => (i / 128) * sc + j / 128,
                                Fp8Blocks::Activation1x128 => i * sc + j / 128,
                            };
                            e4m3_decode(q) * s[b * sr * sc + si]
                        }
                        _ => unreachable!("validate() checked the scale kind"),
                    };
                    out.push(x);
                }
            }
        }
        Ok(out)
    }
}
