//! The one linear-layer abstraction every projection of the model goes through.
//!
//! `y[m, n] = x[m, k] · W[n, k]ᵀ (+ b)`, with the GEMM operands chosen by the layer's
//! [`LinearPrecision`] and f32 accumulation. The quantized formats of the precision plan plug
//! in here, and nowhere else. Every GEMM runs on the CPU ([`mxrl_tensor::host_gemm`]); a GPU
//! runs the whole model on the device engine ([`crate::engine`]) instead.

use crate::params::{Grads, ParamId, ParamStore};
use mxrl_tensor::host_gemm::{linear_nn, linear_nt, linear_tn_into, GemmOperand};
use mxrl_tensor::precision::{round_bf16, round_bf16_vec};
use mxrl_tensor::qlinear::{LinearSpec, PreparedWeight, QLinearError, Saved};
use std::borrow::Cow;

/// GEMM operand precision of one linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPrecision {
    /// f32 operands (the reference; used for parity with f32 PyTorch and gradient checks).
    F32,
    /// BF16 operands (round-to-nearest-even of x, W and, in backward, dy), f32 accumulation:
    /// forward `bf16(x)·bf16(W)ᵀ`, dgrad `bf16(dy)·bf16(W)`, wgrad `bf16(dy)ᵀ·bf16(x)`.
    Bf16,
    /// A block format (MXFP8 / NVFP4 / FP8-block) with its backward mode, through
    /// [`mxrl_tensor::qlinear`]: the weight is quantized once per weight version with the
    /// contract library (a fused gate_up weight as one tensor, so NVFP4 gives it one amax),
    /// activations are quantized on every forward.
    Quantized(LinearSpec),
}

/// Adds `bias` (`[n]`) to every row of `y` (`[m, n]`).
fn add_bias(bias: Option<&[f32]>, n: usize, y: &mut [f32]) {
    if let Some(bias) = bias {
        for row in y.chunks_mut(n) {
            for (a, &c) in row.iter_mut().zip(bias) {
                *a += c;
            }
        }
    }
}

/// A linear layer: weight `[n, k]` and optional bias `[n]` living in the [`ParamStore`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    pub w: ParamId,
    pub b: Option<ParamId>,
    pub n: usize,
    pub k: usize,
}

/// The weight as the forward multiplies it (rebuilt whenever the master weights change).
#[derive(Clone, Debug)]
pub(crate) enum Prepared {
    /// Multiply the f32 master weight directly.
    Master,
    /// A BF16-rounded copy of the master weight (kept for this weight version).
    Bf16(GemmOperand),
    /// The quantized weight of a block-format linear.
    Quant(Box<PreparedWeight>),
    /// A tensor that is not a linear weight (norm, bias, untied embedding) read at its BF16
    /// value `f32(bf16(master))` ([`crate::Model::use_bf16_params`]; kept for this weight
    /// version).
    Bf16Value(Vec<f32>),
}

impl Prepared {
    /// Builds the GEMM weight of `name` (`[n, k]`) for `prec` at weight version `version`.
    pub(crate) fn build(
        prec: LinearPrecision,
        name: &str,
        master: &[f32],
        n: usize,
        k: usize,
        version: u64,
    ) -> Result<Prepared, QLinearError> {
        Ok(match prec {
            LinearPrecision::F32 => Prepared::Master,
            LinearPrecision::Bf16 => Prepared::Bf16(GemmOperand::new(round_bf16_vec(master))),
            LinearPrecision::Quantized(spec) => Prepared::Quant(Box::new(
                PreparedWeight::quantize(name, master, n, k, spec, version)?,
            )),
        })
    }
}

fn operand(prec: LinearPrecision, x: &[f32]) -> Cow<'_, [f32]> {
    match prec {
        LinearPrecision::Bf16 => Cow::Owned(x.iter().map(|&v| round_bf16(v)).collect()),
        _ => Cow::Borrowed(x),
    }
}

impl Linear {
    fn weight<'a>(&self, params: &'a ParamStore, prep: &'a Prepared) -> &'a [f32] {
        match prep {
            Prepared::Master => params.data(self.w),
            Prepared::Bf16(w) => w.values(),
            Prepared::Bf16Value(w) => w,
            Prepared::Quant(_) => unreachable!("quantized weights take the qlinear path"),
        }
    }

    /// Forward for `m` rows: `x: [m, k]` → `y: [m, n]`, adding `bias` (the values of
    /// [`Linear::b`] as the model reads them) when the layer has one.
    pub(crate) fn forward(
        &self,
        params: &ParamStore,
        prep: &Prepared,
        prec: LinearPrecision,
        bias: Option<&[f32]>,
        x: &[f32],
        m: usize,
    ) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.k);
        if let Prepared::Quant(pw) = prep {
            // Shapes and the weight were validated when the weight was prepared; the
            // activation quantizer cannot fail on finite or non-finite f32 input.
            let mut y = pw
                .forward_inference(x, m)
                .unwrap_or_else(|e| panic!("quantized linear forward: {e}"));
            add_bias(bias, self.n, &mut y);
            return y;
        }
        let xo = operand(prec, x);
        let w = self.weight(params, prep);
        let mut y = linear_nt(&xo, w, m, self.k, self.n);
        add_bias(bias, self.n, &mut y);
        y
    }

    /// Training forward: as [`Linear::forward`] (bitwise the same `y`), and for a quantized
    /// linear also the context its backward needs ([`Saved`]: the forward's quantized `x`, its
    /// column-wise copy or its BF16 rounding, per the backward mode), so that backward needs
    /// neither the f32 input nor a second quantization. `None` for F32 / BF16 linears, whose
    /// backward reads the f32 input.
    pub(crate) fn forward_saving(
        &self,
        params: &ParamStore,
        prep: &Prepared,
        prec: LinearPrecision,
        bias: Option<&[f32]>,
        x: &[f32],
        m: usize,
    ) -> (Vec<f32>, Option<Saved>) {
        if let Prepared::Quant(pw) = prep {
            let (mut y, saved) = pw
                .forward(x, m)
                .unwrap_or_else(|e| panic!("quantized linear forward: {e}"));
            add_bias(bias, self.n, &mut y);
            return (y, Some(saved));
        }
        (self.forward(params, prep, prec, bias, x, m), None)
    }

    /// Backward for `m` rows: given `dy: [m, n]` and what the forward kept — for a quantized
    /// linear its [`Saved`] context from [`Linear::forward_saving`], else the forward input
    /// `x: [m, k]` — accumulates `dW += dyᵀ·x` (and `db += Σ_rows dy`) into `grads` and returns
    /// `dx = dy·W: [m, k]`.
    ///
    /// A quantized linear given `x` but no context re-runs the forward quantization of `x`
    /// (deterministic, so it rebuilds exactly the context the forward had): the reference the
    /// saved-context path is tested against.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        params: &ParamStore,
        prep: &Prepared,
        prec: LinearPrecision,
        x: &[f32],
        saved: Option<&Saved>,
        dy: &[f32],
        m: usize,
        grads: &mut Grads,
    ) -> Vec<f32> {
        debug_assert_eq!(dy.len(), m * self.n);
        if let Some(b) = self.b {
            let db = grads.get_mut(b);
            for row in dy.chunks(self.n) {
                for (a, &c) in db.iter_mut().zip(row) {
                    *a += c;
                }
            }
        }
        if let Prepared::Quant(pw) = prep {
            let recomputed;
            let saved = match saved {
                Some(s) => s,
                None => {
                    recomputed = pw
                        .forward(x, m)
                        .unwrap_or_else(|e| panic!("quantized linear forward: {e}"))
                        .1;
                    &recomputed
                }
            };
            return pw
                .backward_accumulate(saved, dy, grads.get_mut(self.w))
                .unwrap_or_else(|e| panic!("quantized linear backward: {e}"));
        }
        debug_assert!(saved.is_none(), "only quantized linears save a context");
        let dyo = operand(prec, dy);
        let xo = operand(prec, x);
        // dW[n, k] += dy[m, n]ᵀ · x[m, k].
        linear_tn_into(&dyo, &xo, grads.get_mut(self.w), self.n, m, self.k, true);
        linear_nn(&dyo, self.weight(params, prep), m, self.n, self.k)
    }
}
