//! The one linear-layer abstraction every projection of the model goes through.
//!
//! `y[m, n] = x[m, k] · W[n, k]ᵀ (+ b)`, with the GEMM operands chosen by the layer's
//! [`LinearPrecision`] and f32 accumulation ([`mxrl_tensor::gemm`]). The quantized formats of
//! the precision plan plug in here, and nowhere else.

use crate::params::{Grads, ParamId, ParamStore};
use mxrl_tensor::gemm::{matmul_nn, matmul_nt, matmul_nt_dot, sgemm_into};
use mxrl_tensor::precision::{round_bf16, round_bf16_vec};
use std::borrow::Cow;

/// GEMM operand precision of one linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearPrecision {
    /// f32 operands (the reference; used for parity with f32 PyTorch and gradient checks).
    F32,
    /// BF16 operands (round-to-nearest-even of x, W and, in backward, dy), f32 accumulation:
    /// forward `bf16(x)·bf16(W)ᵀ`, dgrad `bf16(dy)·bf16(W)`, wgrad `bf16(dy)ᵀ·bf16(x)`.
    Bf16,
}

/// Up to this many rows the forward GEMM runs as independent dot products
/// ([`matmul_nt_dot`], no operand packing: decode steps and sparsely used experts); above it,
/// the packed, cache-blocked GEMM. Both accumulate in f32; their summation orders differ.
pub(crate) const SMALL_M: usize = 8;

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
    /// A BF16-rounded copy of the master weight.
    Bf16(Vec<f32>),
}

impl Prepared {
    pub(crate) fn build(prec: LinearPrecision, master: &[f32]) -> Prepared {
        match prec {
            LinearPrecision::F32 => Prepared::Master,
            LinearPrecision::Bf16 => Prepared::Bf16(round_bf16_vec(master)),
        }
    }
}

fn operand(prec: LinearPrecision, x: &[f32]) -> Cow<'_, [f32]> {
    match prec {
        LinearPrecision::F32 => Cow::Borrowed(x),
        LinearPrecision::Bf16 => Cow::Owned(x.iter().map(|&v| round_bf16(v)).collect()),
    }
}

impl Linear {
    fn weight<'a>(&self, params: &'a ParamStore, prep: &'a Prepared) -> &'a [f32] {
        match prep {
            Prepared::Master => params.data(self.w),
            Prepared::Bf16(w) => w,
        }
    }

    /// Forward for `m` rows: `x: [m, k]` → `y: [m, n]`.
    pub(crate) fn forward(
        &self,
        params: &ParamStore,
        prep: &Prepared,
        prec: LinearPrecision,
        x: &[f32],
        m: usize,
    ) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.k);
        let xo = operand(prec, x);
        let w = self.weight(params, prep);
        let mut y = if m <= SMALL_M {
            matmul_nt_dot(&xo, w, m, self.k, self.n)
        } else {
            matmul_nt(&xo, w, m, self.k, self.n)
        };
        if let Some(b) = self.b {
            let bias = params.data(b);
            for row in y.chunks_mut(self.n) {
                for (a, &c) in row.iter_mut().zip(bias) {
                    *a += c;
                }
            }
        }
        y
    }

    /// Backward for `m` rows: given the forward input `x: [m, k]` (as passed to
    /// [`Linear::forward`]) and `dy: [m, n]`, accumulates `dW += dyᵀ·x` (and `db += Σ_rows dy`)
    /// into `grads` and returns `dx = dy·W: [m, k]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward(
        &self,
        params: &ParamStore,
        prep: &Prepared,
        prec: LinearPrecision,
        x: &[f32],
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
        let dyo = operand(prec, dy);
        let xo = operand(prec, x);
        // dW[n, k] += dy[m, n]ᵀ · x[m, k]: logical A = dyᵀ (strides (1, n)), B = x.
        sgemm_into(
            &dyo,
            (1, self.n as isize),
            &xo,
            (self.k as isize, 1),
            grads.get_mut(self.w),
            self.n,
            m,
            self.k,
            true,
        );
        matmul_nn(&dyo, self.weight(params, prep), m, self.n, self.k)
    }
}
