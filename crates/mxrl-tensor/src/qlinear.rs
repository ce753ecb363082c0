//! Quantized linear layer `y = x · Wᵀ` with the three backward modes of the mxrl recipes.
//!
//! Shapes: `x [M, K]` (M tokens), `W [N, K]`, `y [M, N]`, all row-major `f32` slices; every GEMM
//! accumulates in f32 ([`crate::gemm`]).
//!
//! # How the forward GEMM is emulated
//! Operands are quantized with the contract library (`mxrl-formats`), never by a second code
//! path here. The products are exact; only the f32 summation order differs from a hardware
//! block-scaled GEMM (see the architecture's "storage format ≠ GEMM path"):
//!
//! | format | GEMM operand (f32) | after the f32 sum |
//! |---|---|---|
//! | BF16 | `bf16(x)`, `bf16(W)` | — |
//! | MXFP8 | `e4m3 × 2^(s−127)` = the contract dequantization, exact (power-of-two scale) | — |
//! | NVFP4 | `e2m1 × e4m3(block scale)`, exact (≤ 6 significant bits, range 2⁻¹⁰..2688) | `y = fl(α · acc)` |
//! | FP8-block | see [`FP8_BLOCK_EMULATION`] | — |
//!
//! For NVFP4 the FP32 second-level scales are applied after the sum, as TransformerEngine's
//! cuBLAS path does: `α = fl(fl(amax_x · amax_W) · fl(1/(6·6·448·448)))` (TE
//! `compute_nvfp4_per_tensor_scale_kernel`: `alpha_in · amax_A · amax_B · factor_inv`, left to
//! right, with `alpha_in = 1`), one α per row for per-token activations. The product of two
//! operands `(e2m1·sf)` has ≤ 12 significant bits, so it is exact in f32 as long as it stays in
//! the normal range; the only roundings are the f32 accumulation, the α computation (3) and the
//! final scaling (1). Compared with "dequantize with the contract, then f32 GEMM" the result
//! differs by at most the bound derived in the tests (`nvfp4_forward_matches_dequantize_then_gemm`).
//!
//! # Backward modes (`architecture.md`)
//! | mode | dgrad `dx = dy · W` | wgrad `dW = dyᵀ · x` | kept for backward |
//! |---|---|---|---|
//! | [`BackwardMode::Lowp`] (MXFP8 only) | `q_row(dy) · q_col(W)` | `q_col(dy)ᵀ · q_col(x)` | column-wise MXFP8 copies of `x` and `W`, each quantized from the high-precision source |
//! | [`BackwardMode::HighPrecision`] | `bf16(dy) · bf16(W)` | `bf16(dy)ᵀ · bf16(x)` | `bf16(x)` (and `bf16(W)`) |
//! | [`BackwardMode::Dequantized`] | `bf16(dy) · deq(q(W))` | `bf16(dy)ᵀ · deq(q(x))` | the forward's quantized `x` (dequantized on demand) |
//!
//! "BF16 GEMM" is emulated as operands rounded to BF16 (round-to-nearest-even) and f32
//! accumulation. In `Dequantized` mode the dequantized operands are used in f32, exactly as the
//! contract dequantizer produces them from the forward's bytes (TE casts them to BF16 first:
//! exact for MXFP8 outside the deep-subnormal range, a ≤ 2⁻⁹ relative rounding for NVFP4; we
//! keep the exact values so the backward differentiates exactly the function the forward
//! computed). For MXFP8 those values are bit-identical to the forward's GEMM operands.
//!
//! # Quantize once per weight version
//! [`PreparedWeight`] holds a weight as the forward multiplies it (quantized once when it is
//! built), plus what its backward mode needs. It is built either from high-precision values
//! ([`PreparedWeight::quantize`], [`PreparedWeight::quantize_stacked`]) or from already-quantized
//! stored bytes ([`PreparedWeight::from_quantized`]: converted checkpoints, weight-sync
//! messages) without re-quantizing. A [`Saved`] context remembers the weight version it was
//! produced with; backward refuses a different one.
//!
//! # Memory accounting
//! [`Saved::kept_bytes`] and [`PreparedWeight::backward_bytes`] report what each mode keeps for
//! backward in device storage formats (BF16 = 2 bytes, FP8 = 1, FP4 = ½, plus scales); the
//! f32 GEMM operand buffers of this CPU emulation are reported separately
//! ([`PreparedWeight::emulation_bytes`]). [`memory_model`] replays the allocations of one
//! forward + backward of a device implementation for `mxrl bench memory`.

use crate::gemm;
use crate::host_gemm::{self, GemmOperand};
use crate::precision::round_bf16_vec;
use half::bf16;
use mxrl_formats::{
    e4m3_decode, nvfp4_block_product, AmaxScope, Format, FormatError, Fp8Blocks, Padding,
    QuantizedTensor, ScaleLayout, Scales, Scheme, FP8_BLOCK,
};
use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// How backward GEMM operands are chosen (the `architecture.md` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardMode {
    /// Backward GEMMs in MXFP8 (TransformerEngine's default): dgrad `q_row(dy) · q_col(W)`,
    /// wgrad `q_col(dy)ᵀ · q_col(x)`. MXFP8 only.
    Lowp,
    /// Backward GEMMs in BF16 on the original (unquantized) operands.
    HighPrecision,
    /// Backward GEMMs on exactly the dequantized operands of the forward pass.
    Dequantized,
}

impl BackwardMode {
    /// All modes, in a stable order.
    pub const ALL: [BackwardMode; 3] = [
        BackwardMode::Lowp,
        BackwardMode::HighPrecision,
        BackwardMode::Dequantized,
    ];

    /// Canonical name (as in recipes and TE's `NVTE_BACKWARD_OVERRIDE`, `lowp` for the default).
    pub fn name(self) -> &'static str {
        match self {
            BackwardMode::Lowp => "lowp",
            BackwardMode::HighPrecision => "high_precision",
            BackwardMode::Dequantized => "dequantized",
        }
    }
}

impl fmt::Display for BackwardMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackwardMode {
    type Err = QLinearError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lowp" | "default" => Ok(BackwardMode::Lowp),
            "high_precision" => Ok(BackwardMode::HighPrecision),
            "dequantized" => Ok(BackwardMode::Dequantized),
            other => Err(QLinearError::UnknownBackwardMode(other.to_string())),
        }
    }
}

/// Scope of the NVFP4 activation amax (the FP32 second-level scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ActScaling {
    /// One amax per token (row) of `x`, computed online (the mxrl NVFP4 recipe). A token's
    /// quantization never depends on its batch-mates.
    #[default]
    PerToken,
    /// One amax over the whole activation tensor (batch-dependent; for comparison only).
    PerTensor,
}

/// Numerics of one linear layer: storage/GEMM format, NVFP4 activation scaling, backward mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LinearSpec {
    format: Format,
    act_scaling: ActScaling,
    backward: BackwardMode,
}

impl LinearSpec {
    /// A BF16 linear (operands rounded to BF16, f32 accumulation; backward on BF16 operands).
    pub fn bf16() -> Self {
        LinearSpec {
            format: Format::Bf16,
            act_scaling: ActScaling::PerToken,
            backward: BackwardMode::HighPrecision,
        }
    }

    /// A linear in `format` with `backward`; NVFP4 activations default to per-token scaling.
    ///
    /// For BF16 every mode means the same (the operands are the originals), so the mode is
    /// recorded as [`BackwardMode::HighPrecision`].
    ///
    /// # Errors
    /// [`QLinearError::UnsupportedMode`] for `Lowp` with a format other than MXFP8.
    pub fn new(format: Format, backward: BackwardMode) -> Result<Self, QLinearError> {
        if format == Format::Bf16 {
            return Ok(Self::bf16());
        }
        if backward == BackwardMode::Lowp && format != Format::Mxfp8 {
            return Err(QLinearError::UnsupportedMode {
                format,
                mode: backward,
            });
        }
        Ok(LinearSpec {
            format,
            act_scaling: ActScaling::PerToken,
            backward,
        })
    }

    /// Choose the NVFP4 activation amax scope.
    ///
    /// # Errors
    /// [`QLinearError::ActScalingNotNvfp4`] when the format is not NVFP4.
    pub fn with_act_scaling(mut self, act_scaling: ActScaling) -> Result<Self, QLinearError> {
        if self.format != Format::Nvfp4 {
            return Err(QLinearError::ActScalingNotNvfp4(self.format));
        }
        self.act_scaling = act_scaling;
        Ok(self)
    }

    /// The GEMM/storage format.
    pub fn format(&self) -> Format {
        self.format
    }
    /// The backward mode.
    pub fn backward(&self) -> BackwardMode {
        self.backward
    }
    /// Whether the backward multiplies the output gradient only as `bf16(dy)` (the
    /// `HighPrecision` and `Dequantized` modes), so a producer may hand it over rounded to
    /// BF16 already (the same operand); `Lowp` quantizes the f32 `dy` itself.
    pub fn rounds_dy_to_bf16(&self) -> bool {
        self.backward != BackwardMode::Lowp
    }
    /// Whether the backward multiplies the input only as `bf16(x)` (the `HighPrecision` mode,
    /// BF16 weights' one), so the forward may keep `x` rounded to BF16 (the same operand); the
    /// other modes quantize the f32 `x`.
    pub fn rounds_x_to_bf16(&self) -> bool {
        self.backward == BackwardMode::HighPrecision
    }
    /// The NVFP4 activation amax scope (meaningful for NVFP4 only).
    pub fn act_scaling(&self) -> ActScaling {
        self.act_scaling
    }
}

impl fmt::Display for LinearSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.format)?;
        if self.format == Format::Nvfp4 {
            let s = match self.act_scaling {
                ActScaling::PerToken => "per_token",
                ActScaling::PerTensor => "per_tensor",
            };
            write!(f, "({s})")?;
        }
        write!(f, "/{}", self.backward)
    }
}

/// Errors of the quantized linear layer; each names the weight and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum QLinearError {
    /// Unknown backward mode name.
    #[error("unknown backward mode `{0}` (expected one of: lowp, high_precision, dequantized)")]
    UnknownBackwardMode(String),
    /// A backward mode the format does not have.
    #[error("backward mode `{mode}` is not available for format `{format}` (lowp backward exists only for MXFP8)")]
    UnsupportedMode {
        /// The format.
        format: Format,
        /// The requested mode.
        mode: BackwardMode,
    },
    /// Activation scaling requested for a non-NVFP4 format.
    #[error("activation amax scaling applies to NVFP4 only, not `{0}`")]
    ActScalingNotNvfp4(Format),
    /// A buffer whose length does not match its shape.
    #[error("linear `{name}`: {what} has {got} elements, expected {expected} ({shape})")]
    Shape {
        /// Weight name.
        name: String,
        /// Which operand.
        what: &'static str,
        /// Actual element count.
        got: usize,
        /// Expected element count.
        expected: usize,
        /// The shape as text.
        shape: String,
    },
    /// Backward called with a context from a different weight version.
    #[error("linear `{name}`: backward with weight version {weight} but the forward used version {saved}")]
    StaleWeight {
        /// Weight name.
        name: String,
        /// Version of the weight passed to backward.
        weight: u64,
        /// Version recorded by the forward.
        saved: u64,
    },
    /// A weight built from stored bytes lacks what the backward mode needs.
    #[error("linear `{name}`: backward mode `{mode}` needs the high-precision weight, but it was built from stored quantized bytes only")]
    NeedsHighPrecisionWeight {
        /// Weight name.
        name: String,
        /// The mode.
        mode: BackwardMode,
    },
    /// Stored quantized weight that does not match the spec.
    #[error(
        "linear `{name}`: stored weight is {got}, but the linear is configured for {expected}"
    )]
    StoredMismatch {
        /// Weight name.
        name: String,
        /// What the stored tensor is.
        got: String,
        /// What the spec expects.
        expected: String,
    },
    /// Error from the quantizer library.
    #[error("linear `{name}`: {source}")]
    Formats {
        /// Weight name.
        name: String,
        /// The library error.
        #[source]
        source: FormatError,
    },
}

fn contract_err(name: &str) -> impl FnOnce(FormatError) -> QLinearError + '_ {
    move |source| QLinearError::Formats {
        name: name.to_string(),
        source,
    }
}

fn check_len(
    name: &str,
    what: &'static str,
    got: usize,
    rows: usize,
    cols: usize,
) -> Result<(), QLinearError> {
    if got != rows * cols {
        return Err(QLinearError::Shape {
            name: name.to_string(),
            what,
            got,
            expected: rows * cols,
            shape: format!("[{rows}, {cols}]"),
        });
    }
    Ok(())
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// NVFP4 `fl(1/(6·6·448·448))` as TE computes it (`constexpr float factor_inv = 1.0 / (6.0 *
/// 6.0 * 448.0 * 448.0)`: a double quotient rounded once to f32).
pub const NVFP4_ALPHA_FACTOR_INV: f32 = (1.0f64 / (6.0 * 6.0 * 448.0 * 448.0)) as f32;

/// NVFP4 GEMM output scale `α = fl(fl(amax_a · amax_b) · NVFP4_ALPHA_FACTOR_INV)` (TE order).
pub fn nvfp4_alpha(amax_a: f32, amax_b: f32) -> f32 {
    (amax_a * amax_b) * NVFP4_ALPHA_FACTOR_INV
}

/// How FP8-block GEMMs are emulated (DeepSeek-V3 / DeepGEMM "promotion"): for every K block
/// `b` of 128, `P_b = Σ_{k∈b} e4m3(x)·e4m3(W)` is an f32 GEMM of the raw element values (every
/// product exact: 4 × 4 significant bits), then `y += fl(fl(sx[i,b] · sw[j/128,b]) · P_b)`
/// in f32, blocks in increasing order. `sx`, `sw` are the stored FP32 `scale_inv` values.
pub const FP8_BLOCK_EMULATION: &str =
    "y = Σ_b fl(fl(sx[i,b]·sw[j/128,b]) · Σ_{k∈b} e4m3(x[i,k])·e4m3(W[j,k])), f32";

/// The f32 GEMM operand decoded from a quantized tensor (products exact, see module doc).
#[derive(Debug, Clone)]
enum Operand {
    /// Values multiplied as they are: BF16-rounded originals or exact MXFP8 dequantization.
    Plain(GemmOperand),
    /// NVFP4: `e2m1 × e4m3(block scale)` per element; FP32 amax per tensor (1) or per row.
    Nvfp4 { pre: GemmOperand, amax: Vec<f32> },
    /// FP8 block: raw E4M3 values and the compact f32 `scale_inv` matrix
    /// (`[rows/128, K/128]` for weights, `[rows, K/128]` for activations).
    Fp8Block {
        elems: Vec<f32>,
        scale_inv: Vec<f32>,
        tile_rows: usize,
    },
}

impl Operand {
    /// Decode `q`.
    fn from_quantized(q: &QuantizedTensor) -> Result<Self, FormatError> {
        let q = q.clone().with_scale_layout(ScaleLayout::Compact)?;
        let (rows, k) = (q.shape[0], q.shape[1]);
        match (q.scheme, &q.scales) {
            (Scheme::Mxfp8(_), _) => Ok(Operand::Plain(GemmOperand::new(q.dequantize()?))),
            (Scheme::Nvfp4(s), Scales::Bytes(scales)) => {
                let mut pre = Vec::with_capacity(rows * k);
                for i in 0..rows {
                    for j in 0..k {
                        let byte = q.data[i * (k / 2) + j / 2];
                        let code = (byte >> (4 * (j % 2))) & 0xF;
                        // Exact: ≤ 2 significant bits × ≤ 4 significant bits.
                        pre.push(nvfp4_block_product(code, scales[i * (k / 16) + j / 16]));
                    }
                }
                let amax = match s.amax {
                    AmaxScope::PerTensor => q.amax.clone(),
                    AmaxScope::PerRow => q.amax[..rows].to_vec(),
                };
                Ok(Operand::Nvfp4 {
                    pre: GemmOperand::new(pre),
                    amax,
                })
            }
            (Scheme::Fp8Block(s), Scales::F32(scale_inv)) => Ok(Operand::Fp8Block {
                elems: q.data.iter().map(|&c| e4m3_decode(c)).collect(),
                scale_inv: scale_inv.clone(),
                tile_rows: match s.blocks {
                    Fp8Blocks::Weight128x128 => FP8_BLOCK,
                    Fp8Blocks::Activation1x128 => 1,
                },
            }),
            _ => Err(FormatError::Unsupported(format!(
                "{}: scales of the wrong kind",
                q.scheme
            ))),
        }
    }

    fn len(&self) -> usize {
        match self {
            Operand::Plain(v) => v.len(),
            Operand::Nvfp4 { pre, amax } => pre.len() + amax.len(),
            Operand::Fp8Block {
                elems, scale_inv, ..
            } => elems.len() + scale_inv.len(),
        }
    }
}

/// Up to this many rows the forward GEMM runs as independent dot products
/// ([`gemm::matmul_nt_dot`]: decode steps, sparsely routed experts); above it, the
/// packed GEMM. Both accumulate the same exact products in f32, in different orders (the
/// module's bounds hold for any order). Same threshold as the model's BF16 linears.
pub const SMALL_M: usize = gemm::SMALL_M;

/// Forward GEMM `a[m,k] · b[n,k]ᵀ` (f32 accumulation, [`host_gemm::linear_nt`]).
fn gemm_nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    host_gemm::linear_nt(a, b, m, k, n)
}

/// Emulated forward GEMM `y[m,n] = a[m,k] · b[n,k]ᵀ` of two operands of the same format.
fn emulated_nt(a: &Operand, b: &Operand, m: usize, k: usize, n: usize) -> Vec<f32> {
    match (a, b) {
        (Operand::Plain(a), Operand::Plain(b)) => host_gemm::linear_nt(a, b, m, k, n),
        (Operand::Nvfp4 { pre: pa, amax: aa }, Operand::Nvfp4 { pre: pb, amax: ab }) => {
            let mut acc = host_gemm::linear_nt(pa, pb, m, k, n);
            debug_assert_eq!(ab.len(), 1, "NVFP4 weights carry one per-tensor amax");
            for i in 0..m {
                let alpha = nvfp4_alpha(if aa.len() == 1 { aa[0] } else { aa[i] }, ab[0]);
                for v in &mut acc[i * n..(i + 1) * n] {
                    *v *= alpha;
                }
            }
            acc
        }
        (
            Operand::Fp8Block {
                elems: ea,
                scale_inv: sa,
                tile_rows: ta,
            },
            Operand::Fp8Block {
                elems: eb,
                scale_inv: sb,
                tile_rows: tb,
            },
        ) => {
            let nb = k / FP8_BLOCK;
            let mut y = vec![0.0f32; m * n];
            let mut pa = vec![0.0f32; m * FP8_BLOCK];
            let mut pb = vec![0.0f32; n * FP8_BLOCK];
            for blk in 0..nb {
                for i in 0..m {
                    pa[i * FP8_BLOCK..(i + 1) * FP8_BLOCK]
                        .copy_from_slice(&ea[i * k + blk * FP8_BLOCK..][..FP8_BLOCK]);
                }
                for j in 0..n {
                    pb[j * FP8_BLOCK..(j + 1) * FP8_BLOCK]
                        .copy_from_slice(&eb[j * k + blk * FP8_BLOCK..][..FP8_BLOCK]);
                }
                let p = gemm_nt(&pa, &pb, m, FP8_BLOCK, n);
                for i in 0..m {
                    let s_a = sa[(i / ta) * nb + blk];
                    for j in 0..n {
                        let s = s_a * sb[(j / tb) * nb + blk];
                        y[i * n + j] += s * p[i * n + j];
                    }
                }
            }
            y
        }
        _ => unreachable!("operands of one linear always share a format"),
    }
}

impl LinearSpec {
    /// The contract scheme of the forward activation operand (`None` for BF16).
    pub fn activation_scheme(&self) -> Option<Scheme> {
        match self.format {
            Format::Bf16 => None,
            Format::Mxfp8 => Some(Scheme::MXFP8_ROW),
            Format::Nvfp4 => Some(match self.act_scaling {
                ActScaling::PerToken => Scheme::NVFP4_ROW,
                ActScaling::PerTensor => Scheme::NVFP4_TENSOR,
            }),
            Format::Fp8Block => Some(Scheme::FP8_BLOCK_ACT),
        }
    }

    /// The contract scheme of the forward weight operand (`None` for BF16).
    pub fn weight_scheme(&self) -> Option<Scheme> {
        match self.format {
            Format::Bf16 => None,
            Format::Mxfp8 => Some(Scheme::MXFP8_ROW),
            Format::Nvfp4 => Some(Scheme::NVFP4_TENSOR),
            Format::Fp8Block => Some(Scheme::FP8_BLOCK_WEIGHT),
        }
    }
}

/// What a weight keeps for its backward pass, besides the forward operand.
#[derive(Debug, Clone)]
enum WeightBackward {
    /// Nothing extra (BF16 format: the forward operand is the BF16 weight; `Dequantized`: the
    /// stored forward bytes are dequantized on demand).
    Nothing,
    /// `Lowp`: the column-wise MXFP8 copy, quantized from the high-precision weight.
    ColumnWise(QuantizedTensor),
    /// `HighPrecision`: the BF16 original.
    Original(Vec<bf16>),
    /// Built from stored bytes only, for a mode that needs the high-precision weight.
    Missing,
}

/// A weight `W [N, K]` prepared for one linear: quantized once per weight version and reused
/// by every forward (and, where the mode says so, backward) until the next version.
#[derive(Debug, Clone)]
pub struct PreparedWeight {
    name: String,
    spec: LinearSpec,
    n: usize,
    k: usize,
    version: u64,
    stored: Option<QuantizedTensor>,
    operand: Operand,
    backward: WeightBackward,
    /// The dgrad operand `[N, K]` of the backward mode, built on first use and kept
    /// for this weight version when it is not the forward operand itself.
    dgrad: OnceLock<GemmOperand>,
}

impl PreparedWeight {
    /// Quantize `w` (`[n, k]` row-major, high precision) for `spec`, tagging it with `version`.
    ///
    /// Forward operand: BF16-rounded (BF16) or the contract quantization with
    /// [`LinearSpec::weight_scheme`]. Kept for backward: the column-wise MXFP8 copy quantized
    /// from `w` itself (`Lowp`), the BF16-rounded `w` (`HighPrecision`), or nothing
    /// (`Dequantized`: the forward bytes are dequantized when backward needs them).
    ///
    /// # Errors
    /// Shape mismatch, K not a multiple of the format's block (N for FP8-block 128×128
    /// tiles), or a quantizer error, each naming `name`.
    pub fn quantize(
        name: &str,
        w: &[f32],
        n: usize,
        k: usize,
        spec: LinearSpec,
        version: u64,
    ) -> Result<Self, QLinearError> {
        check_len(name, "weight", w.len(), n, k)?;
        let stored = match spec.weight_scheme() {
            None => None,
            Some(scheme) => Some(
                mxrl_formats::quantize(w, &[n, k], scheme, Padding::Reject)
                    .map_err(contract_err(name))?,
            ),
        };
        Self::assemble(name, stored, Some(w), n, k, spec, version)
    }

    /// Quantize several weights that run as one fused GEMM (an expert's gate and up
    /// projections, each `[n_i, k]`) stacked along N into one `[Σ n_i, k]` weight. For NVFP4
    /// the parts share one per-tensor amax (`mxrl_formats::quantize_nvfp4_stacked`, equal to
    /// quantizing the stack), as serving engines require for a fused gate/up GEMM. The
    /// output columns follow the part order.
    ///
    /// # Errors
    /// As [`PreparedWeight::quantize`]; parts must share K.
    pub fn quantize_stacked(
        name: &str,
        parts: &[(&[f32], usize)],
        k: usize,
        spec: LinearSpec,
        version: u64,
    ) -> Result<Self, QLinearError> {
        let mut stacked = Vec::new();
        let mut n = 0;
        for (i, &(p, rows)) in parts.iter().enumerate() {
            check_len(
                name,
                if i == 0 {
                    "stacked part 0"
                } else {
                    "stacked part"
                },
                p.len(),
                rows,
                k,
            )?;
            stacked.extend_from_slice(p);
            n += rows;
        }
        // Quantizing the stack as one tensor is, by the library's definition, what
        // `quantize_nvfp4_stacked` does for NVFP4 (one shared per-tensor amax); MXFP8 and
        // FP8-block have no tensor-level scale to share.
        Self::quantize(name, &stacked, n, k, spec, version)
    }

    /// Build from already-quantized stored bytes (a converted checkpoint, a weight-sync
    /// message) without re-quantizing. `high_precision` is the original `[n, k]` weight if
    /// the caller has it; `Lowp` and `HighPrecision` backward need it (the column-wise copy
    /// must come from the high-precision source), forward and `Dequantized` backward do not.
    ///
    /// # Errors
    /// [`QLinearError::StoredMismatch`] if the stored scheme is not the spec's weight scheme
    /// (FP8-block accepts either FP32 scale rule), or a quantizer/shape error.
    pub fn from_quantized(
        name: &str,
        stored: QuantizedTensor,
        spec: LinearSpec,
        version: u64,
        high_precision: Option<&[f32]>,
    ) -> Result<Self, QLinearError> {
        let expected = spec.weight_scheme();
        let matches = match (expected, stored.scheme) {
            (Some(Scheme::Fp8Block(e)), Scheme::Fp8Block(g)) => e.blocks == g.blocks,
            (Some(e), g) => e == g,
            (None, _) => false,
        };
        if !matches || stored.shape.len() != 2 {
            return Err(QLinearError::StoredMismatch {
                name: name.to_string(),
                got: format!("{} {:?}", stored.scheme, stored.shape),
                expected: format!(
                    "{} [N, K]",
                    expected.map_or_else(|| "bf16 (not quantized)".to_string(), |s| s.name())
                ),
            });
        }
        stored.validate().map_err(contract_err(name))?;
        if stored.padded_shape != stored.shape {
            return Err(QLinearError::StoredMismatch {
                name: name.to_string(),
                got: format!("padded {:?}", stored.padded_shape),
                expected: format!("an unpadded {:?}", stored.shape),
            });
        }
        let (n, k) = (stored.shape[0], stored.shape[1]);
        if let Some(w) = high_precision {
            check_len(name, "high-precision weight", w.len(), n, k)?;
        }
        Self::assemble(name, Some(stored), high_precision, n, k, spec, version)
    }

    fn assemble(
        name: &str,
        stored: Option<QuantizedTensor>,
        w: Option<&[f32]>,
        n: usize,
        k: usize,
        spec: LinearSpec,
        version: u64,
    ) -> Result<Self, QLinearError> {
        let operand = match &stored {
            None => Operand::Plain(GemmOperand::new(round_bf16_vec(
                w.expect("BF16 weights are built from values"),
            ))),
            Some(q) => Operand::from_quantized(q).map_err(contract_err(name))?,
        };
        let backward = match (spec.format, spec.backward, w) {
            (Format::Bf16, _, _) | (_, BackwardMode::Dequantized, _) => WeightBackward::Nothing,
            (_, _, None) => WeightBackward::Missing,
            (_, BackwardMode::HighPrecision, Some(w)) => WeightBackward::Original(to_bf16(w)),
            (_, BackwardMode::Lowp, Some(w)) => WeightBackward::ColumnWise(
                mxrl_formats::quantize(w, &[n, k], Scheme::MXFP8_COL, Padding::Zero)
                    .map_err(contract_err(name))?,
            ),
        };
        Ok(PreparedWeight {
            name: name.to_string(),
            spec,
            n,
            k,
            version,
            stored,
            operand,
            backward,
            dgrad: OnceLock::new(),
        })
    }

    /// Weight name (used in every error message).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The linear's numerics.
    pub fn spec(&self) -> LinearSpec {
        self.spec
    }
    /// Output features N.
    pub fn n(&self) -> usize {
        self.n
    }
    /// Input features K.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Weight version this was prepared from.
    pub fn version(&self) -> u64 {
        self.version
    }
    /// The forward (row-wise) quantized weight as stored, `None` for BF16 — what a converted
    /// checkpoint or a weight-sync message carries.
    pub fn stored(&self) -> Option<&QuantizedTensor> {
        self.stored.as_ref()
    }

    /// Device-format bytes of the forward operand: `2·N·K` for BF16, else the quantized
    /// tensor's data + scales + amax.
    pub fn forward_bytes(&self) -> usize {
        self.stored
            .as_ref()
            .map_or(2 * self.n * self.k, |q| q.nbytes())
    }

    /// Device-format bytes kept only for backward: the column-wise MXFP8 copy (`Lowp`), the
    /// BF16 original (`HighPrecision`; on a device this is the BF16 parameter itself), or 0.
    pub fn backward_bytes(&self) -> usize {
        match &self.backward {
            WeightBackward::ColumnWise(q) => q.nbytes(),
            WeightBackward::Original(v) => 2 * v.len(),
            WeightBackward::Nothing | WeightBackward::Missing => 0,
        }
    }

    /// Bytes of this CPU emulation's cached f32 GEMM operands (the forward operand, and the
    /// dgrad operand once a backward has built it; not a device-format cost).
    pub fn emulation_bytes(&self) -> usize {
        4 * (self.operand.len() + self.dgrad.get().map_or(0, |w| w.len()))
    }

    /// The values the forward GEMM multiplies W by, dequantized to f32 with the contract
    /// dequantizer (BF16: the BF16-rounded weight) — the `Dequantized` mode's dgrad operand.
    ///
    /// # Errors
    /// A quantizer error (invalid stored tensor).
    pub fn dequantized(&self) -> Result<Vec<f32>, QLinearError> {
        match (&self.stored, &self.operand) {
            (None, Operand::Plain(v)) => Ok(v.to_vec()),
            (Some(q), _) => q.dequantize().map_err(contract_err(&self.name)),
            (None, _) => unreachable!("BF16 weights have a plain operand"),
        }
    }
}

/// What the forward pass keeps for backward (one per forward call).
#[derive(Debug, Clone)]
enum Kept {
    /// BF16-rounded `x` (`HighPrecision`, and every BF16 linear).
    Original(Vec<bf16>),
    /// The forward's quantized `x` (`Dequantized`).
    Forward(QuantizedTensor),
    /// Column-wise MXFP8 `x`, quantized from the high-precision `x` (`Lowp`).
    ColumnWise(QuantizedTensor),
}

/// Context saved by [`PreparedWeight::forward`] for [`PreparedWeight::backward`].
#[derive(Debug, Clone)]
pub struct Saved {
    m: usize,
    version: u64,
    kept: Kept,
}

impl Saved {
    /// Tokens M of the forward call.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Device-format bytes kept for backward: `2·M·K` (BF16 `x`), or the quantized copy's
    /// data + scales + amax.
    pub fn kept_bytes(&self) -> usize {
        match &self.kept {
            Kept::Original(v) => 2 * v.len(),
            Kept::Forward(q) | Kept::ColumnWise(q) => q.nbytes(),
        }
    }

    /// The forward's quantized `x`, kept in `Dequantized` mode (`None` otherwise).
    pub fn forward_quantized(&self) -> Option<&QuantizedTensor> {
        match &self.kept {
            Kept::Forward(q) => Some(q),
            _ => None,
        }
    }
}

/// Gradients of one linear: `dx [M, K]` and `dW [N, K]`, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    /// Input gradient `dx = dy · W` (per the backward mode), `[M, K]`.
    pub dx: Vec<f32>,
    /// Weight gradient `dW = dyᵀ · x` (per the backward mode), `[N, K]`.
    pub dw: Vec<f32>,
}

impl PreparedWeight {
    fn quantize_x(&self, x: &[f32], m: usize) -> Result<Option<QuantizedTensor>, QLinearError> {
        check_len(&self.name, "input x", x.len(), m, self.k)?;
        match self.spec.activation_scheme() {
            None => Ok(None),
            Some(s) => mxrl_formats::quantize(x, &[m, self.k], s, Padding::Reject)
                .map(Some)
                .map_err(contract_err(&self.name)),
        }
    }

    fn forward_gemm(
        &self,
        x: &[f32],
        qx: Option<&QuantizedTensor>,
        m: usize,
    ) -> Result<Vec<f32>, QLinearError> {
        let xo = match qx {
            None => Operand::Plain(GemmOperand::new(round_bf16_vec(x))),
            Some(q) => Operand::from_quantized(q).map_err(contract_err(&self.name))?,
        };
        Ok(emulated_nt(&xo, &self.operand, m, self.k, self.n))
    }

    /// Forward without keeping anything for backward (rollout / inference):
    /// `y [M, N] = x [M, K] · Wᵀ`, emulated as described in the module doc.
    ///
    /// # Errors
    /// Shape mismatch or quantizer error, naming the weight.
    pub fn forward_inference(&self, x: &[f32], m: usize) -> Result<Vec<f32>, QLinearError> {
        let qx = self.quantize_x(x, m)?;
        self.forward_gemm(x, qx.as_ref(), m)
    }

    /// Training forward: `y [M, N] = x [M, K] · Wᵀ` (f32 accumulation), plus the context the
    /// backward mode needs ([`Saved`]).
    ///
    /// # Errors
    /// Shape mismatch or quantizer error, naming the weight.
    pub fn forward(&self, x: &[f32], m: usize) -> Result<(Vec<f32>, Saved), QLinearError> {
        let qx = self.quantize_x(x, m)?;
        let y = self.forward_gemm(x, qx.as_ref(), m)?;
        let kept = match (self.spec.format, self.spec.backward, qx) {
            (_, BackwardMode::Dequantized, Some(q)) => Kept::Forward(q),
            (Format::Mxfp8, BackwardMode::Lowp, _) => Kept::ColumnWise(
                mxrl_formats::quantize(x, &[m, self.k], Scheme::MXFP8_COL, Padding::Zero)
                    .map_err(contract_err(&self.name))?,
            ),
            _ => Kept::Original(to_bf16(x)),
        };
        Ok((
            y,
            Saved {
                m,
                version: self.version,
                kept,
            },
        ))
    }

    /// Backward of [`PreparedWeight::forward`]: `dy [M, N]` → `dx [M, K]`, `dW [N, K]`, f32
    /// accumulation, operands per the backward mode (module doc table). `dy` is rounded to
    /// BF16 (the activation-gradient dtype) except in `Lowp`, where it is quantized to MXFP8
    /// row-wise (blocks along N) and column-wise (blocks along M) from the f32 values.
    ///
    /// # Errors
    /// [`QLinearError::StaleWeight`] if `saved` came from another weight version,
    /// [`QLinearError::NeedsHighPrecisionWeight`] for a weight built from stored bytes only
    /// in a mode that needs the original, shape or quantizer errors.
    pub fn backward(&self, saved: &Saved, dy: &[f32]) -> Result<Grads, QLinearError> {
        let ops = self.backward_operands(saved, dy)?;
        let (m, k, n) = (saved.m, self.k, self.n);
        let dx = host_gemm::linear_nn(&ops.dy_dgrad, &ops.w, m, n, k);
        let dw = host_gemm::linear_tn(ops.dy_wgrad(), &ops.x, n, m, k);
        Ok(Grads { dx, dw })
    }

    /// [`PreparedWeight::backward`] in the model's convention: returns `dx [M, K]` and
    /// **accumulates** `dW` into `dw_acc [N, K]` (`dW += dyᵀ·x` inside the GEMM, operands exactly
    /// as in `backward`). With `dw_acc` all zeros the result equals `backward`'s `dw`.
    ///
    /// # Errors
    /// As [`PreparedWeight::backward`], and a wrong `dw_acc` length.
    pub fn backward_accumulate(
        &self,
        saved: &Saved,
        dy: &[f32],
        dw_acc: &mut [f32],
    ) -> Result<Vec<f32>, QLinearError> {
        check_len(
            &self.name,
            "weight gradient accumulator",
            dw_acc.len(),
            self.n,
            self.k,
        )?;
        let ops = self.backward_operands(saved, dy)?;
        let (m, k, n) = (saved.m, self.k, self.n);
        let dx = host_gemm::linear_nn(&ops.dy_dgrad, &ops.w, m, n, k);
        // dW[n, k] += dy[m, n]ᵀ · x[m, k].
        host_gemm::linear_tn_into(ops.dy_wgrad(), &ops.x, dw_acc, n, m, k, true);
        Ok(dx)
    }

    /// The dgrad weight operand built by `build` once per weight version; later calls reuse
    /// the same values.
    fn dgrad_operand(
        &self,
        build: impl FnOnce() -> Result<Vec<f32>, QLinearError>,
    ) -> Result<GemmOperand, QLinearError> {
        if let Some(w) = self.dgrad.get() {
            return Ok(w.clone());
        }
        let w = GemmOperand::new(build()?);
        Ok(self.dgrad.get_or_init(|| w).clone())
    }

    /// The backward GEMM operands of the mode (see the module doc table).
    fn backward_operands(
        &self,
        saved: &Saved,
        dy: &[f32],
    ) -> Result<BackwardOperands, QLinearError> {
        if saved.version != self.version {
            return Err(QLinearError::StaleWeight {
                name: self.name.clone(),
                weight: self.version,
                saved: saved.version,
            });
        }
        let (m, n) = (saved.m, self.n);
        check_len(&self.name, "output gradient dy", dy.len(), m, n)?;
        let err = || contract_err(&self.name);
        let needs_original = || QLinearError::NeedsHighPrecisionWeight {
            name: self.name.clone(),
            mode: self.spec.backward,
        };
        Ok(match &saved.kept {
            Kept::ColumnWise(x_col) => {
                let WeightBackward::ColumnWise(w_col) = &self.backward else {
                    return Err(needs_original());
                };
                let quant = |scheme| {
                    mxrl_formats::quantize(dy, &[m, n], scheme, Padding::Zero)
                        .and_then(|q| q.dequantize())
                        .map_err(err())
                };
                BackwardOperands {
                    dy_dgrad: quant(Scheme::MXFP8_ROW)?,
                    w: self.dgrad_operand(|| w_col.dequantize().map_err(err()))?,
                    dy_wgrad: Some(quant(Scheme::MXFP8_COL)?),
                    x: x_col.dequantize().map_err(err())?,
                }
            }
            Kept::Original(x) => {
                let w = match (&self.backward, &self.operand) {
                    (WeightBackward::Original(w), _) => self.dgrad_operand(|| Ok(widen(w)))?,
                    (WeightBackward::Nothing, Operand::Plain(w)) if self.stored.is_none() => {
                        w.clone()
                    }
                    _ => return Err(needs_original()),
                };
                BackwardOperands {
                    dy_dgrad: round_bf16_vec(dy),
                    w,
                    dy_wgrad: None,
                    x: widen(x),
                }
            }
            Kept::Forward(qx) => {
                let w = match &self.operand {
                    // MXFP8: the forward operand *is* the contract dequantization.
                    Operand::Plain(w) => w.clone(),
                    _ => self.dgrad_operand(|| self.dequantized())?,
                };
                BackwardOperands {
                    dy_dgrad: round_bf16_vec(dy),
                    w,
                    dy_wgrad: None,
                    x: qx.dequantize().map_err(err())?,
                }
            }
        })
    }
}

/// Operands of the two backward GEMMs: dgrad `dy_dgrad [M, N] · w [N, K]`, wgrad
/// `dy_wgradᵀ · x [M, K]` (`dy_wgrad` = `dy_dgrad` unless the mode quantizes dy twice).
struct BackwardOperands {
    dy_dgrad: Vec<f32>,
    w: GemmOperand,
    dy_wgrad: Option<Vec<f32>>,
    x: Vec<f32>,
}

impl BackwardOperands {
    fn dy_wgrad(&self) -> &[f32] {
        self.dy_wgrad.as_deref().unwrap_or(&self.dy_dgrad)
    }
}

/// One allocation of the device schedule replayed by [`memory_model`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// What the buffer holds.
    pub what: &'static str,
    /// Its size in bytes.
    pub bytes: usize,
    /// Kept from the forward until backward consumed it.
    pub kept_for_backward: bool,
}

/// Memory of one linear's forward + backward on a device, from the sizes of the device
/// storage formats (BF16 2 B, E4M3 1 B, E2M1 ½ B, UE8M0/UE4M3 1 B per block, FP32 scales and
/// amax 4 B).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryModel {
    /// The linear's numerics.
    pub spec: LinearSpec,
    /// Bytes held between forward and backward besides the output `y` (activation copies and
    /// weight copies made for backward; a BF16 `x` saved by `HighPrecision` is counted, the
    /// BF16 weight parameter is not, since it exists anyway).
    pub kept_for_backward: usize,
    /// Peak bytes allocated by the layer during the forward (the output `y` included).
    pub forward_peak: usize,
    /// Peak bytes allocated by the layer during forward + backward (the inputs `x`, `W`, `dy`
    /// excluded; `y`, `dx`, `dW` in BF16 included, `y` kept alive by the caller).
    pub peak: usize,
    /// Allocations in the order the schedule makes them.
    pub allocations: Vec<Allocation>,
}

/// Replay the allocations of one forward + backward of a linear with `x [m, k]` (BF16),
/// `W [n, k]` (BF16 parameter) and `spec` on a device, the way TransformerEngine's `Linear`
/// schedules them, and report what is kept for backward and the peak. The schedule:
///
/// 1. forward: quantize `W` (row-wise, the per-version weight cache of [`PreparedWeight`],
///    kept in every mode; plus column-wise for `Lowp`), quantize `x` (row-wise; plus
///    column-wise for `Lowp`), allocate `y`, run the GEMM; free the row-wise `x` unless
///    `Dequantized` keeps it.
/// 2. backward: `Lowp` quantizes `dy` row- and column-wise; `Dequantized` dequantizes `W` to
///    BF16 for dgrad and `x` to BF16 for wgrad (each freed after its GEMM); allocate `dx`
///    (BF16) for dgrad and `dW` (BF16) for wgrad; free what the backward kept.
///
/// The byte counts of the kept items equal [`Saved::kept_bytes`] +
/// [`PreparedWeight::backward_bytes`] of the CPU implementation (tested), except that a
/// `HighPrecision` weight's BF16 original is the parameter itself here.
pub fn memory_model(spec: LinearSpec, m: usize, k: usize, n: usize) -> MemoryModel {
    let fmt = spec.format;
    let q = |rows: usize, cols: usize, scheme: Option<Scheme>| -> usize {
        match scheme {
            None => 2 * rows * cols,
            Some(Scheme::Mxfp8(s)) => match s.usage {
                mxrl_formats::Usage::RowWise => rows * cols + rows * cols.div_ceil(32),
                // Backward-only copies are zero-padded along M to whole 32-row blocks.
                mxrl_formats::Usage::ColumnWise => rows.div_ceil(32) * (32 * cols + cols),
            },
            Some(Scheme::Nvfp4(s)) => {
                let amax = match s.amax {
                    AmaxScope::PerTensor => 1,
                    AmaxScope::PerRow => rows,
                };
                rows * cols / 2 + rows * cols / 16 + 4 * amax
            }
            Some(Scheme::Fp8Block(s)) => {
                let tiles = match s.blocks {
                    Fp8Blocks::Weight128x128 => rows.div_ceil(128) * cols.div_ceil(128),
                    Fp8Blocks::Activation1x128 => rows * cols.div_ceil(128),
                };
                rows * cols + 4 * tiles
            }
        }
    };
    let mode = spec.backward;
    let quantized = fmt != Format::Bf16;
    let lowp = mode == BackwardMode::Lowp && quantized;
    let deq = mode == BackwardMode::Dequantized && quantized;
    let mut t = Tracker::default();
    // Forward.
    if quantized {
        t.alloc(
            "W row-wise (weight cache)",
            q(n, k, spec.weight_scheme()),
            false,
        );
        t.alloc(
            "x row-wise (forward operand)",
            q(m, k, spec.activation_scheme()),
            deq,
        );
    }
    if lowp {
        t.alloc(
            "W column-wise (dgrad operand)",
            q(n, k, Some(Scheme::MXFP8_COL)),
            true,
        );
        t.alloc(
            "x column-wise (wgrad operand)",
            q(m, k, Some(Scheme::MXFP8_COL)),
            true,
        );
    }
    t.alloc("y (BF16 output)", 2 * m * n, false);
    if !deq {
        t.free("x row-wise (forward operand)");
    }
    let forward_peak = t.peak;
    // x itself is the caller's buffer; HighPrecision (and BF16) keep it alive for wgrad.
    let x_kept = if !lowp && !deq { 2 * m * k } else { 0 };
    let kept_for_backward = t.live_kept() + x_kept;
    // Backward.
    if lowp {
        t.alloc(
            "dy row-wise (dgrad operand)",
            q(m, n, Some(Scheme::MXFP8_ROW)),
            false,
        );
        t.alloc(
            "dy column-wise (wgrad operand)",
            q(m, n, Some(Scheme::MXFP8_COL)),
            false,
        );
    }
    if deq {
        t.alloc("deq(W) BF16 (dgrad operand)", 2 * n * k, false);
    }
    t.alloc("dx (BF16)", 2 * m * k, false);
    if deq {
        t.free("deq(W) BF16 (dgrad operand)");
        t.alloc("deq(x) BF16 (wgrad operand)", 2 * m * k, false);
    }
    t.alloc("dW (BF16)", 2 * n * k, false);
    MemoryModel {
        spec,
        kept_for_backward,
        forward_peak,
        peak: t.peak,
        allocations: t.allocations.into_iter().map(|(a, _)| a).collect(),
    }
}

/// Allocation replay for [`memory_model`]: every allocation with a live flag, and the peak.
#[derive(Default)]
struct Tracker {
    allocations: Vec<(Allocation, bool)>,
    peak: usize,
}

impl Tracker {
    fn alloc(&mut self, what: &'static str, bytes: usize, kept_for_backward: bool) {
        self.allocations.push((
            Allocation {
                what,
                bytes,
                kept_for_backward,
            },
            true,
        ));
        let now: usize = self
            .allocations
            .iter()
            .filter(|(_, l)| *l)
            .map(|(a, _)| a.bytes)
            .sum();
        self.peak = self.peak.max(now);
    }

    fn free(&mut self, what: &str) {
        for (a, live) in &mut self.allocations {
            if a.what == what {
                *live = false;
            }
        }
    }

    fn live_kept(&self) -> usize {
        self.allocations
            .iter()
            .filter(|(a, l)| *l && a.kept_for_backward)
            .map(|(a, _)| a.bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    //! Tolerances. Lemma (Higham 3.4): if `ŷ = Σ t_k (1 + θ_k)` with every `|θ_k| ≤ γ_p`,
    //! `γ_p = p·u / (1 − p·u)`, `u = 2⁻²⁴`, then `|ŷ − Σ t_k| ≤ γ_p Σ |t_k|`. Each check below
    //! counts the roundings `p` every exact term `t_k` goes through on each path; the two
    //! paths then differ by at most `(γ_pa + γ_pb) Σ |t_k|`. Data stay in the f32 normal range
    //! (no underflow), where this model is exact.
    use super::*;
    use crate::gemm::matmul_reference;
    use mxrl_formats::reference;
    use rand::{Rng, SeedableRng};

    fn gamma(p: usize) -> f64 {
        let u = 2f64.powi(-24);
        p as f64 * u / (1.0 - p as f64 * u)
    }

    /// Rows with magnitudes spread over a few binades so per-row and per-block scales differ.
    fn data(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut v = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            let row_scale = 2f32.powi((i % 5) as i32 - 2);
            for _ in 0..cols {
                v.push(
                    r.gen_range(-1.0f32..1.0)
                        * row_scale
                        * if r.gen_bool(0.05) { 9.0 } else { 1.0 },
                );
            }
        }
        v
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = x[r * cols + c];
            }
        }
        t
    }

    fn deq(x: &[f32], shape: [usize; 2], scheme: Scheme) -> Vec<f32> {
        reference::quantize(x, &shape, scheme, Padding::Reject)
            .unwrap()
            .dequantize()
            .unwrap()
    }

    /// `|got − want| ≤ (γ_pa + γ_pb)/(1 − γ_q) · Σ_k |x̂_k ŵ_k|` per output element, where the
    /// magnitudes come from the reference's dequantized operands (within `q` roundings of the
    /// exact terms).
    #[allow(clippy::too_many_arguments)]
    fn assert_within(
        got: &[f32],
        want: &[f32],
        xd: &[f32],
        wd: &[f32],
        (m, k, n): (usize, usize, usize),
        (pa, pb, q): (usize, usize, usize),
        what: &str,
    ) {
        let rel = (gamma(pa) + gamma(pb)) / (1.0 - gamma(q));
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| (xd[i * k + p] as f64 * wd[j * k + p] as f64).abs())
                    .sum();
                let (g, w) = (got[i * n + j] as f64, want[i * n + j] as f64);
                assert!(
                    (g - w).abs() <= rel * s,
                    "{what} ({i},{j}): {g} vs {w}, |Δ| {} > tol {}",
                    (g - w).abs(),
                    rel * s
                );
            }
        }
    }

    fn spec(format: Format, mode: BackwardMode) -> LinearSpec {
        LinearSpec::new(format, mode).unwrap()
    }

    #[test]
    fn mxfp8_forward_matches_dequantize_then_gemm() {
        // Products of two MXFP8 dequantized values are exact (4 + 4 significant bits, power-of-
        // two scales), so both paths round only in the K − 1 additions: p = K − 1 each, q = 0.
        let (m, k, n) = (7, 96, 10);
        let x = data(m, k, 1);
        let w = data(n, k, 2);
        let pw = PreparedWeight::quantize(
            "t.mxfp8",
            &w,
            n,
            k,
            spec(Format::Mxfp8, BackwardMode::Lowp),
            0,
        )
        .unwrap();
        let y = pw.forward_inference(&x, m).unwrap();
        let xd = deq(&x, [m, k], Scheme::MXFP8_ROW);
        let wd = deq(&w, [n, k], Scheme::MXFP8_ROW);
        let want = matmul_reference(&xd, &wd, m, k, n);
        assert_within(&y, &want, &xd, &wd, (m, k, n), (k - 1, k - 1, 0), "mxfp8");
        // And the forward multiplies exactly those operands: same GEMM, same bits.
        assert_eq!(y, gemm_nt(&xd, &wd, m, k, n));
    }

    #[test]
    fn nvfp4_forward_matches_dequantize_then_gemm() {
        // Exact term t_k = c · a'_k · b'_k with a' = e2m1·sf (exact), c = amax_x·amax_W/2688².
        // Emulated: K − 1 additions, α = fl(fl(amax_x·amax_W)·fl(1/2688²)) (3), fl(α·acc) (1):
        // p = K + 3. Reference: x̂ = fl(e2m1 · fl(fl(sf·amax)·R2688)) has 4 roundings (R2688
        // itself, fl(sf·amax), ·R2688, ·e2m1), so x̂·ŵ has 4 + 4 + 1 and the sum K − 1 more:
        // p = K + 8. |x̂ŵ| (computed in f64) is within q = 8 roundings of |t_k|.
        let (m, k, n) = (6, 64, 9);
        for scaling in [ActScaling::PerToken, ActScaling::PerTensor] {
            let x = data(m, k, 3);
            let w = data(n, k, 4);
            let s = spec(Format::Nvfp4, BackwardMode::Dequantized)
                .with_act_scaling(scaling)
                .unwrap();
            let pw = PreparedWeight::quantize("t.nvfp4", &w, n, k, s, 0).unwrap();
            let y = pw.forward_inference(&x, m).unwrap();
            let xs = s.activation_scheme().unwrap();
            let xd = deq(&x, [m, k], xs);
            let wd = deq(&w, [n, k], Scheme::NVFP4_TENSOR);
            let want = matmul_reference(&xd, &wd, m, k, n);
            assert_within(&y, &want, &xd, &wd, (m, k, n), (k + 3, k + 8, 8), "nvfp4");
        }
    }

    #[test]
    fn fp8_block_forward_matches_dequantize_then_gemm() {
        // Exact term t_k = sx·sw·e_x·e_w. Emulated: 127 additions inside a 128-block,
        // fl(sx·sw) and fl(s·P_b) (2), nb − 1 block additions: p = 128 + nb. Reference:
        // x̂ = fl(e·sx), ŵ = fl(e·sw), product, K − 1 additions: p = K + 2; q = 2.
        let (m, k, n) = (5, 256, 130);
        let x = data(m, k, 5);
        let w = data(n, k, 6);
        // N = 130 is not a multiple of the 128×128 weight tile: refused, not padded silently.
        let err = PreparedWeight::quantize(
            "t.fp8",
            &w,
            n,
            k,
            spec(Format::Fp8Block, BackwardMode::HighPrecision),
            0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("t.fp8"), "{err}");
        let n = 128;
        let w = &w[..n * k];
        let pw = PreparedWeight::quantize(
            "t.fp8",
            w,
            n,
            k,
            spec(Format::Fp8Block, BackwardMode::HighPrecision),
            0,
        )
        .unwrap();
        let y = pw.forward_inference(&x, m).unwrap();
        let xd = deq(&x, [m, k], Scheme::FP8_BLOCK_ACT);
        let wd = deq(w, [n, k], Scheme::FP8_BLOCK_WEIGHT);
        let want = matmul_reference(&xd, &wd, m, k, n);
        let nb = k / 128;
        assert_within(
            &y,
            &want,
            &xd,
            &wd,
            (m, k, n),
            (128 + nb, k + 2, 2),
            "fp8_block",
        );
    }

    #[test]
    fn bf16_forward_is_the_gemm_of_bf16_operands() {
        let (m, k, n) = (3, 20, 4);
        let x = data(m, k, 7);
        let w = data(n, k, 8);
        let pw = PreparedWeight::quantize("t.bf16", &w, n, k, LinearSpec::bf16(), 0).unwrap();
        let y = pw.forward_inference(&x, m).unwrap();
        let xb: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let wb: Vec<f32> = w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(y, gemm_nt(&xb, &wb, m, k, n));
    }

    #[test]
    fn dequantized_backward_uses_exactly_the_forward_operands() {
        let (m, k, n) = (6, 128, 128);
        for format in [Format::Mxfp8, Format::Nvfp4, Format::Fp8Block] {
            let s = spec(format, BackwardMode::Dequantized);
            let x = data(m, k, 9);
            let w = data(n, k, 10);
            let dy = data(m, n, 11);
            let pw = PreparedWeight::quantize("t.deq", &w, n, k, s, 3).unwrap();
            let (_, saved) = pw.forward(&x, m).unwrap();
            // The kept bytes are the forward's quantization of x (reference quantizer).
            let qx =
                reference::quantize(&x, &[m, k], s.activation_scheme().unwrap(), Padding::Reject)
                    .unwrap();
            assert_eq!(saved.forward_quantized(), Some(&qx), "{format}");
            let g = pw.backward(&saved, &dy).unwrap();
            let dyb: Vec<f32> = dy.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let wd = deq(&w, [n, k], s.weight_scheme().unwrap());
            let xd = qx.dequantize().unwrap();
            assert_eq!(g.dx, gemm::matmul_nn(&dyb, &wd, m, n, k), "{format} dgrad");
            assert_eq!(g.dw, gemm::matmul_tn(&dyb, &xd, n, m, k), "{format} wgrad");
        }
    }

    #[test]
    fn high_precision_backward_equals_bf16_backward() {
        let (m, k, n) = (5, 128, 128);
        let x = data(m, k, 12);
        let w = data(n, k, 13);
        let dy = data(m, n, 14);
        let bf = PreparedWeight::quantize("t.bf16", &w, n, k, LinearSpec::bf16(), 0).unwrap();
        let (_, saved) = bf.forward(&x, m).unwrap();
        let want = bf.backward(&saved, &dy).unwrap();
        // The BF16 backward itself: BF16-rounded operands, f32 accumulation.
        let dyb: Vec<f32> = dy.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let wb: Vec<f32> = w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let xb: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(want.dx, gemm::matmul_nn(&dyb, &wb, m, n, k));
        assert_eq!(want.dw, gemm::matmul_tn(&dyb, &xb, n, m, k));
        for format in [Format::Mxfp8, Format::Nvfp4, Format::Fp8Block] {
            let pw = PreparedWeight::quantize(
                "t.hp",
                &w,
                n,
                k,
                spec(format, BackwardMode::HighPrecision),
                0,
            )
            .unwrap();
            let (y, saved) = pw.forward(&x, m).unwrap();
            assert_ne!(
                y,
                bf.forward_inference(&x, m).unwrap(),
                "{format}: the forward is quantized"
            );
            assert_eq!(pw.backward(&saved, &dy).unwrap(), want, "{format}");
        }
    }

    #[test]
    fn lowp_column_wise_copies_come_from_the_high_precision_source() {
        let (m, k, n) = (64, 64, 96);
        let x = data(m, k, 15);
        let w = data(n, k, 16);
        let dy = data(m, n, 17);
        let pw = PreparedWeight::quantize(
            "t.lowp",
            &w,
            n,
            k,
            spec(Format::Mxfp8, BackwardMode::Lowp),
            0,
        )
        .unwrap();
        let (_, saved) = pw.forward(&x, m).unwrap();
        let col = |v: &[f32], r: usize, c: usize| {
            reference::quantize(v, &[r, c], Scheme::MXFP8_COL, Padding::Reject).unwrap()
        };
        let Kept::ColumnWise(x_col) = &saved.kept else {
            panic!("lowp keeps x column-wise")
        };
        let WeightBackward::ColumnWise(w_col) = &pw.backward else {
            panic!("lowp keeps W column-wise")
        };
        assert_eq!(x_col, &col(&x, m, k));
        assert_eq!(w_col, &col(&w, n, k));
        // Quantizing the row-wise copy again would give other bytes (double rounding).
        assert_ne!(x_col, &col(&deq(&x, [m, k], Scheme::MXFP8_ROW), m, k));
        assert_ne!(w_col, &col(&deq(&w, [n, k], Scheme::MXFP8_ROW), n, k));
        // Backward GEMMs: dgrad q_row(dy)·q_col(W), wgrad q_col(dy)ᵀ·q_col(x).
        let g = pw.backward(&saved, &dy).unwrap();
        let dy_row = deq(&dy, [m, n], Scheme::MXFP8_ROW);
        let dy_col = col(&dy, m, n).dequantize().unwrap();
        assert_eq!(
            g.dx,
            gemm::matmul_nn(&dy_row, &w_col.dequantize().unwrap(), m, n, k)
        );
        assert_eq!(
            g.dw,
            gemm::matmul_tn(&dy_col, &x_col.dequantize().unwrap(), n, m, k)
        );
        // Sanity of the whole backward against the exact-arithmetic gradient (loose: it is a
        // quantized gradient, this only catches transposed or swapped operands).
        let dx_true = matmul_reference(&dy, &transpose(&w, n, k), m, n, k);
        let err: f32 = g.dx.iter().zip(&dx_true).map(|(a, b)| (a - b).abs()).sum();
        let mag: f32 = dx_true.iter().map(|v| v.abs()).sum();
        assert!(err < 0.1 * mag, "dgrad far from dy·W: {err} vs {mag}");
    }

    #[test]
    fn backward_accumulate_adds_the_same_weight_gradient() {
        let (m, k, n) = (9, 64, 32);
        let x = data(m, k, 30);
        let w = data(n, k, 31);
        let dy = data(m, n, 32);
        for mode in BackwardMode::ALL {
            let pw = PreparedWeight::quantize("t", &w, n, k, spec(Format::Mxfp8, mode), 0).unwrap();
            let (_, saved) = pw.forward(&x, m).unwrap();
            let want = pw.backward(&saved, &dy).unwrap();
            let mut acc = vec![0.0f32; n * k];
            let dx = pw.backward_accumulate(&saved, &dy, &mut acc).unwrap();
            assert_eq!(dx, want.dx, "{mode}");
            assert_eq!(acc, want.dw, "{mode}: zero accumulator");
            // Accumulating onto a non-zero gradient: one extra rounding per element.
            let init = data(n, k, 33);
            let mut acc = init.clone();
            pw.backward_accumulate(&saved, &dy, &mut acc).unwrap();
            for ((a, i), d) in acc.iter().zip(&init).zip(&want.dw) {
                let tol = 2.0 * f32::EPSILON * (i.abs() + d.abs());
                assert!((a - (i + d)).abs() <= tol, "{mode}: {a} vs {i} + {d}");
            }
        }
        let pw = PreparedWeight::quantize("t.acc", &w, n, k, LinearSpec::bf16(), 0).unwrap();
        let (_, saved) = pw.forward(&x, m).unwrap();
        let e = pw
            .backward_accumulate(&saved, &dy, &mut [0.0; 3])
            .unwrap_err();
        assert!(e.to_string().contains("t.acc"), "{e}");
    }

    #[test]
    fn lowp_is_mxfp8_only() {
        for f in [Format::Nvfp4, Format::Fp8Block] {
            let e = LinearSpec::new(f, BackwardMode::Lowp).unwrap_err();
            assert!(e.to_string().contains("lowp"), "{e}");
        }
        assert_eq!(
            "dequantized".parse::<BackwardMode>().unwrap(),
            BackwardMode::Dequantized
        );
        assert!("fp8".parse::<BackwardMode>().is_err());
    }

    #[test]
    fn stale_weight_version_is_refused() {
        let (m, k, n) = (2, 32, 4);
        let w = data(n, k, 18);
        let s = spec(Format::Mxfp8, BackwardMode::Dequantized);
        let v1 = PreparedWeight::quantize("layers.0.mlp", &w, n, k, s, 1).unwrap();
        let v2 = PreparedWeight::quantize("layers.0.mlp", &w, n, k, s, 2).unwrap();
        let (_, saved) = v1.forward(&data(m, k, 19), m).unwrap();
        let e = v2.backward(&saved, &data(m, n, 20)).unwrap_err();
        assert!(
            matches!(
                e,
                QLinearError::StaleWeight {
                    weight: 2,
                    saved: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("layers.0.mlp"));
    }

    #[test]
    fn weight_from_stored_bytes_is_used_as_stored() {
        let (m, k, n) = (4, 64, 32);
        let w = data(n, k, 21);
        let x = data(m, k, 22);
        let dy = data(m, n, 23);
        for mode in [BackwardMode::Dequantized, BackwardMode::HighPrecision] {
            for format in [Format::Mxfp8, Format::Nvfp4] {
                let s = spec(format, mode);
                let fresh = PreparedWeight::quantize("w", &w, n, k, s, 5).unwrap();
                let stored = fresh.stored().unwrap().clone();
                // Swizzled scales (the rollout layout) are accepted too.
                let swz = stored
                    .clone()
                    .with_scale_layout(ScaleLayout::Swizzled128x4)
                    .unwrap();
                let from = PreparedWeight::from_quantized("w", swz, s, 5, None).unwrap();
                assert_eq!(
                    from.forward_inference(&x, m).unwrap(),
                    fresh.forward_inference(&x, m).unwrap()
                );
                let (_, saved) = from.forward(&x, m).unwrap();
                match mode {
                    BackwardMode::Dequantized => {
                        let (_, s2) = fresh.forward(&x, m).unwrap();
                        assert_eq!(
                            from.backward(&saved, &dy).unwrap(),
                            fresh.backward(&s2, &dy).unwrap()
                        );
                    }
                    _ => {
                        let e = from.backward(&saved, &dy).unwrap_err();
                        assert!(
                            matches!(e, QLinearError::NeedsHighPrecisionWeight { .. }),
                            "{e}"
                        );
                        let with =
                            PreparedWeight::from_quantized("w", stored.clone(), s, 5, Some(&w))
                                .unwrap();
                        let (_, s3) = with.forward(&x, m).unwrap();
                        let (_, s4) = fresh.forward(&x, m).unwrap();
                        assert_eq!(
                            with.backward(&s3, &dy).unwrap(),
                            fresh.backward(&s4, &dy).unwrap()
                        );
                    }
                }
            }
        }
        // A stored tensor of another scheme is refused with the weight's name.
        let q = reference::quantize(&w, &[n, k], Scheme::MXFP8_ROW, Padding::Reject).unwrap();
        let e = PreparedWeight::from_quantized(
            "experts.3.up",
            q,
            spec(Format::Nvfp4, BackwardMode::Dequantized),
            0,
            None,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("experts.3.up") && e.to_string().contains("nvfp4.tensor"),
            "{e}"
        );
    }

    #[test]
    fn nvfp4_stacked_gate_up_share_one_amax() {
        let (k, i) = (32, 8);
        let gate = data(i, k, 24);
        let mut up = data(i, k, 25);
        up[5] = 40.0; // up's amax dominates
        let s = spec(Format::Nvfp4, BackwardMode::Dequantized);
        let pw =
            PreparedWeight::quantize_stacked("experts.0.gate_up", &[(&gate, i), (&up, i)], k, s, 0)
                .unwrap();
        let q = pw.stored().unwrap();
        assert_eq!(q.amax, vec![40.0]);
        let parts = reference::quantize_nvfp4_stacked(
            &[
                mxrl_formats::TensorRef::new(&gate, &[i, k]),
                mxrl_formats::TensorRef::new(&up, &[i, k]),
            ],
            mxrl_formats::Nvfp4Scheme {
                amax: AmaxScope::PerTensor,
                blocks: mxrl_formats::Nvfp4Blocks::Vector,
            },
            Padding::Reject,
        )
        .unwrap();
        let mut data_bytes = parts[0].data.clone();
        data_bytes.extend_from_slice(&parts[1].data);
        assert_eq!(q.data, data_bytes);
    }

    #[test]
    fn nvfp4_per_token_output_does_not_depend_on_batch_mates() {
        let (m, k, n) = (6, 64, 16);
        let mut x = data(m, k, 26);
        let w = data(n, k, 27);
        let pw = PreparedWeight::quantize(
            "t",
            &w,
            n,
            k,
            spec(Format::Nvfp4, BackwardMode::Dequantized),
            0,
        )
        .unwrap();
        let y = pw.forward_inference(&x, m).unwrap();
        x[5 * k] = 1000.0; // a loud batch-mate in the last row
        let y2 = pw.forward_inference(&x, m).unwrap();
        assert_eq!(y[..5 * n], y2[..5 * n]);
        let per_tensor = spec(Format::Nvfp4, BackwardMode::Dequantized)
            .with_act_scaling(ActScaling::PerTensor)
            .unwrap();
        let pt = PreparedWeight::quantize("t", &w, n, k, per_tensor, 0).unwrap();
        x[5 * k] = y[0]; // restore something ordinary
        let a = pt.forward_inference(&x, m).unwrap();
        x[5 * k] = 1000.0;
        let b = pt.forward_inference(&x, m).unwrap();
        assert_ne!(a[..5 * n], b[..5 * n], "per-tensor scaling couples tokens");
    }

    #[test]
    fn memory_model_matches_what_the_cpu_layer_keeps() {
        // M = 40 and N = 200 are not multiples of 32: lowp's column-wise copies are padded.
        for (m, k, n) in [(64, 128, 256), (40, 128, 200)] {
            memory_model_matches_at(m, k, n);
        }
    }

    fn memory_model_matches_at(m: usize, k: usize, n: usize) {
        let x = data(m, k, 28);
        let w = data(n, k, 29);
        for format in [Format::Bf16, Format::Mxfp8, Format::Nvfp4, Format::Fp8Block] {
            for mode in BackwardMode::ALL {
                let Ok(s) = LinearSpec::new(format, mode) else {
                    continue;
                };
                if format == Format::Fp8Block && !n.is_multiple_of(128) {
                    continue; // 128×128 weight tiles need N % 128 == 0
                }
                let pw = PreparedWeight::quantize("t", &w, n, k, s, 0).unwrap();
                let (_, saved) = pw.forward(&x, m).unwrap();
                let weight_extra = if s.backward == BackwardMode::HighPrecision {
                    0
                } else {
                    pw.backward_bytes()
                };
                let model = memory_model(s, m, k, n);
                assert_eq!(
                    model.kept_for_backward,
                    saved.kept_bytes() + weight_extra,
                    "{s}"
                );
                if let Some(q) = pw.stored() {
                    let cached = &model.allocations[0];
                    assert_eq!(cached.bytes, q.nbytes(), "{s}: {}", cached.what);
                }
            }
        }
    }
}
