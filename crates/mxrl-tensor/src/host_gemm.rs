//! The host model's linear-layer GEMMs, on the CPU.
//!
//! Every GEMM of a linear layer of the host model (`mxrl_model::Model`, the CPU reference) —
//! forward `y = x·Wᵀ` ([`linear_nt`]), dgrad `dx = dy·W` ([`linear_nn`]) and wgrad
//! `dW (+)= dyᵀ·x` ([`linear_tn_into`]) — runs here: `matrixmultiply` (multi-threaded,
//! packed), and up to [`gemm::SMALL_M`] rows of a forward GEMM independent dot products. The
//! operands are the f32 values the CPU emulation multiplies (BF16-rounded values, exact
//! contract dequantizations, NVFP4 `e2m1·sf` products), with f32 products and accumulation.
//! A GPU runs the whole model on the device engine (`mxrl_model::engine` over
//! [`crate::device::Backend`]), never these GEMMs.

use crate::gemm;
use std::fmt;
use std::sync::Arc;

/// Immutable f32 values of a GEMM operand that several holders share (a prepared weight):
/// cheap to clone.
#[derive(Clone)]
pub struct GemmOperand(Arc<Vec<f32>>);

impl GemmOperand {
    /// Shares `values`.
    pub fn new(values: Vec<f32>) -> Self {
        GemmOperand(Arc::new(values))
    }

    /// The values.
    pub fn values(&self) -> &[f32] {
        &self.0
    }
}

impl std::ops::Deref for GemmOperand {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl fmt::Debug for GemmOperand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GemmOperand")
            .field("len", &self.0.len())
            .finish()
    }
}

/// Check operand lengths (a broken caller invariant otherwise).
fn check(what: &str, got: usize, rows: usize, cols: usize) {
    assert_eq!(
        got,
        rows * cols,
        "{what}: {got} elements, expected {rows}×{cols}"
    );
}

/// Forward `y[m,n] = x[m,k] · w[n,k]ᵀ`: dot products up to [`gemm::SMALL_M`] rows, the packed
/// GEMM above (the same exact products in another order).
///
/// # Panics
/// Wrong operand lengths.
pub fn linear_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    check("linear_nt x", x.len(), m, k);
    check("linear_nt w", w.len(), n, k);
    if m <= gemm::SMALL_M {
        gemm::matmul_nt_dot(x, w, m, k, n)
    } else {
        gemm::matmul_nt(x, w, m, k, n)
    }
}

/// Dgrad `dx[m,n] = dy[m,k] · w[k,n]` (`w` is the weight `[N_out, K_in]` row-major with
/// `k = N_out`, `n = K_in`).
///
/// # Panics
/// Wrong operand lengths.
pub fn linear_nn(dy: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    check("linear_nn dy", dy.len(), m, k);
    check("linear_nn w", w.len(), k, n);
    gemm::matmul_nn(dy, w, m, k, n)
}

/// Wgrad `c[m,n] (+)= a[k,m]ᵀ · b[k,n]` (both row-major; `accumulate` adds into `c`).
///
/// # Panics
/// Wrong operand lengths.
#[allow(clippy::too_many_arguments)]
pub fn linear_tn_into(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    check("linear_tn a", a.len(), k, m);
    check("linear_tn b", b.len(), k, n);
    check("linear_tn c", c.len(), m, n);
    gemm::sgemm_into(
        a,
        (1, m as isize),
        b,
        (n as isize, 1),
        c,
        m,
        k,
        n,
        accumulate,
    );
}

/// Wgrad `c[m,n] = a[k,m]ᵀ · b[k,n]` (fresh output).
///
/// # Panics
/// As [`linear_tn_into`].
pub fn linear_tn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    linear_tn_into(a, b, &mut c, m, k, n, false);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wgrad accumulates into what `c` held, and a fresh one equals `matmul_tn`.
    #[test]
    fn wgrad_accumulates_and_fresh_equals_matmul_tn() {
        let (m, k, n) = (3, 4, 2);
        let a: Vec<f32> = (0..k * m).map(|i| i as f32 * 0.5 - 1.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| 2.0 - i as f32 * 0.25).collect();
        let fresh = linear_tn(&a, &b, m, k, n);
        let want = gemm::matmul_tn(&a, &b, m, k, n);
        assert_eq!(fresh, want);
        let mut c = vec![1.0f32; m * n];
        linear_tn_into(&a, &b, &mut c, m, k, n, true);
        let plus: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        assert_eq!(c, plus);
    }

    #[test]
    #[should_panic(expected = "linear_nt w: 5 elements, expected 2×3")]
    fn wrong_lengths_are_refused_with_the_shape() {
        linear_nt(&[0.0; 3], &[0.0; 5], 1, 3, 2);
    }
}
