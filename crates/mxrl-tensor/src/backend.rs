//! Where the linear layers' f32 GEMMs run: a process-wide [`GemmBackend`].
//!
//! Every GEMM of a linear layer — forward `y = x·Wᵀ` ([`linear_nt`]), dgrad `dx = dy·W`
//! ([`linear_nn`]) and wgrad `dW (+)= dyᵀ·x` ([`linear_tn_into`]) — goes through the backend
//! selected with [`set_gemm_backend`] (default: [`CpuGemm`]). The rest of the model (norms,
//! attention, routing, quantizers) stays on the host, so a device backend changes exactly one
//! thing: where (and in which order) the f32 products are summed.
//!
//! # Reference
//! [`CpuGemm`] is the reference and the default: it makes exactly the calls the linear layers
//! made before the hook existed (dot-product path up to [`gemm::SMALL_M`] rows, the packed
//! GEMM above), so the default backend gives byte-identical results (tested).
//!
//! # Numerics of a device backend
//! A backend receives the f32 operand values the CPU emulation multiplies (BF16-rounded
//! values, exact contract dequantizations, NVFP4 `e2m1·sf` products) and must multiply exactly
//! those values with f32 products and f32 accumulation (no TF32, no reduced-precision inputs).
//! Only the summation order may differ, so each output element is within
//! `γ_k·Σ|a||b|` (`γ_k = k·u/(1−k·u)`, `u = 2⁻²⁴`) of the exact sum, for both backends. A
//! backend must also be deterministic: the same call with the same shapes and operands gives
//! the same bits, which is what bitwise mode (rollout logprobs = trainer logprobs) relies on.
//!
//! # Resident operands
//! Long-lived weight operands are [`GemmOperand::resident`]: each gets a process-unique
//! [`OperandKey`] (a fresh id from a counter, plus the weight version it was built from) and
//! its values never change afterwards, so a device may keep its uploaded copy under that key
//! and reuse it for every call. When the last clone of a resident operand is dropped, the
//! backend is told to [`GemmBackend::release`] the key. Activations and gradients are plain
//! slices, uploaded per call.

use crate::gemm;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Identity of a resident GEMM operand: `id` is unique in the process (never reused), and
/// `version` is the weight version the values were built from (informational: the values
/// under one key never change).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperandKey {
    /// Process-unique id.
    pub id: u64,
    /// Weight version of the values.
    pub version: u64,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

struct Inner {
    key: Option<OperandKey>,
    values: Vec<f32>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(k) = self.key {
            gemm_backend().release(k);
        }
    }
}

/// Immutable f32 values of a GEMM operand (cheap to clone: shared), resident (keyed, may be
/// cached on a device) or transient.
#[derive(Clone)]
pub struct GemmOperand(Arc<Inner>);

impl GemmOperand {
    /// A long-lived operand (a prepared weight) built at weight `version`: gets a fresh key.
    pub fn resident(values: Vec<f32>, version: u64) -> Self {
        GemmOperand(Arc::new(Inner {
            key: Some(OperandKey {
                id: next_id(),
                version,
            }),
            values,
        }))
    }

    /// A short-lived operand (an activation): no key, uploaded per call.
    pub fn transient(values: Vec<f32>) -> Self {
        GemmOperand(Arc::new(Inner { key: None, values }))
    }

    /// The key of a resident operand.
    pub fn key(&self) -> Option<OperandKey> {
        self.0.key
    }

    /// The values.
    pub fn values(&self) -> &[f32] {
        &self.0.values
    }

    /// A borrowed view for the GEMM calls.
    pub fn view(&self) -> WeightView<'_> {
        WeightView {
            values: &self.0.values,
            key: self.0.key,
        }
    }
}

impl std::ops::Deref for GemmOperand {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0.values
    }
}

impl fmt::Debug for GemmOperand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GemmOperand")
            .field("key", &self.0.key)
            .field("len", &self.0.values.len())
            .finish()
    }
}

/// The weight-side operand of a linear GEMM: values (row-major `[N, K]`) and, when resident,
/// the key a device may cache them under.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    /// Row-major values.
    pub values: &'a [f32],
    /// Key of a resident operand; `None`: upload per call.
    pub key: Option<OperandKey>,
}

impl<'a> WeightView<'a> {
    /// An unkeyed view (values that may change between calls, e.g. f32 master weights).
    pub fn transient(values: &'a [f32]) -> Self {
        WeightView { values, key: None }
    }
}

/// A failure of a GEMM backend (a device error), naming the backend and the call.
#[derive(Debug, thiserror::Error)]
#[error("GEMM backend {backend}: {what}")]
pub struct GemmError {
    /// The backend's name.
    pub backend: String,
    /// What failed.
    pub what: String,
}

/// Where the linear layers' f32 GEMMs run (row-major operands, f32 products and accumulation;
/// see the module doc for the numerical contract). Shapes follow [`crate::gemm`].
pub trait GemmBackend: Send + Sync {
    /// Human-readable name (device and library).
    fn name(&self) -> String;

    /// Forward `y[m,n] = a[m,k] · w[n,k]ᵀ`.
    ///
    /// # Errors
    /// A device failure.
    fn nt(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError>;

    /// Dgrad `c[m,n] = a[m,k] · w[k,n]` (`w` is the weight `[N_out, K_in]` row-major with
    /// `k = N_out`, `n = K_in`).
    ///
    /// # Errors
    /// A device failure.
    fn nn(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError>;

    /// Wgrad `c[m,n] (+)= a[k,m]ᵀ · b[k,n]` (both row-major; `accumulate` adds into `c`).
    ///
    /// # Errors
    /// A device failure.
    #[allow(clippy::too_many_arguments)]
    fn tn_into(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<(), GemmError>;

    /// A resident operand was dropped: its cached copy (if any) may be freed.
    fn release(&self, key: OperandKey) {
        let _ = key;
    }
}

/// The CPU reference backend: `matrixmultiply` (multi-threaded, packed) and, for up to
/// [`gemm::SMALL_M`] rows of a forward GEMM, independent dot products.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuGemm;

impl GemmBackend for CpuGemm {
    fn name(&self) -> String {
        "cpu (matrixmultiply, f32)".to_string()
    }

    fn nt(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        Ok(if m <= gemm::SMALL_M {
            gemm::matmul_nt_dot(a, w.values, m, k, n)
        } else {
            gemm::matmul_nt(a, w.values, m, k, n)
        })
    }

    fn nn(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        Ok(gemm::matmul_nn(a, w.values, m, k, n))
    }

    fn tn_into(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<(), GemmError> {
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
        Ok(())
    }
}

fn slot() -> &'static RwLock<Arc<dyn GemmBackend>> {
    static SLOT: std::sync::OnceLock<RwLock<Arc<dyn GemmBackend>>> = std::sync::OnceLock::new();
    SLOT.get_or_init(|| RwLock::new(Arc::new(CpuGemm)))
}

/// The backend the linear layers use now (default [`CpuGemm`]).
pub fn gemm_backend() -> Arc<dyn GemmBackend> {
    slot().read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Select the process-wide backend (once at start-up, before any model runs); returns the
/// previous one. Calls already running finish on the backend they started with.
pub fn set_gemm_backend(b: Arc<dyn GemmBackend>) -> Arc<dyn GemmBackend> {
    std::mem::replace(&mut *slot().write().unwrap_or_else(|e| e.into_inner()), b)
}

fn fail(e: GemmError) -> ! {
    // A device that fails mid-computation leaves no result to continue with.
    panic!("{e}")
}

/// Check operand lengths (a broken caller invariant otherwise).
fn check(what: &str, got: usize, rows: usize, cols: usize) {
    assert_eq!(
        got,
        rows * cols,
        "{what}: {got} elements, expected {rows}×{cols}"
    );
}

/// Forward `y[m,n] = x[m,k] · w[n,k]ᵀ` on the current backend.
///
/// # Panics
/// Wrong operand lengths, or a device failure (the backend's message).
pub fn linear_nt(x: &[f32], w: WeightView<'_>, m: usize, k: usize, n: usize) -> Vec<f32> {
    check("linear_nt x", x.len(), m, k);
    check("linear_nt w", w.values.len(), n, k);
    gemm_backend().nt(x, w, m, k, n).unwrap_or_else(|e| fail(e))
}

/// Dgrad `dx[m,n] = dy[m,k] · w[k,n]` on the current backend.
///
/// # Panics
/// Wrong operand lengths, or a device failure.
pub fn linear_nn(dy: &[f32], w: WeightView<'_>, m: usize, k: usize, n: usize) -> Vec<f32> {
    check("linear_nn dy", dy.len(), m, k);
    check("linear_nn w", w.values.len(), k, n);
    gemm_backend()
        .nn(dy, w, m, k, n)
        .unwrap_or_else(|e| fail(e))
}

/// Wgrad `c[m,n] (+)= a[k,m]ᵀ · b[k,n]` on the current backend.
///
/// # Panics
/// Wrong operand lengths, or a device failure.
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
    gemm_backend()
        .tn_into(a, b, c, m, k, n, accumulate)
        .unwrap_or_else(|e| fail(e))
}

/// Wgrad `c[m,n] = a[k,m]ᵀ · b[k,n]` (fresh output) on the current backend.
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
    use rand::{Rng, SeedableRng};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                if i % 13 == 0 {
                    -0.0
                } else {
                    r.gen_range(-2.0f32..2.0)
                }
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The default backend is the CPU one and makes exactly the calls the linear layers made
    /// before the hook: same bytes (signed zeros included) on both sides of `SMALL_M`.
    #[test]
    fn default_dispatch_is_byte_identical_to_the_direct_calls() {
        for &(m, k, n) in &[
            (1, 32, 7),
            (8, 64, 33),
            (9, 64, 33),
            (40, 96, 24),
            (3, 1, 5),
        ] {
            let (x, w) = (rnd(m * k, 1), rnd(n * k, 2));
            let op = GemmOperand::resident(w.clone(), 3);
            let want = if m <= gemm::SMALL_M {
                gemm::matmul_nt_dot(&x, &w, m, k, n)
            } else {
                gemm::matmul_nt(&x, &w, m, k, n)
            };
            assert_eq!(bits(&linear_nt(&x, op.view(), m, k, n)), bits(&want));
            // dgrad: dy[m, n] · W[n, k]
            let dy = rnd(m * n, 4);
            assert_eq!(
                bits(&linear_nn(&dy, op.view(), m, n, k)),
                bits(&gemm::matmul_nn(&dy, &w, m, n, k))
            );
            // wgrad: dW[n, k] += dy[m, n]ᵀ · x[m, k], as the layers called sgemm_into.
            let mut acc = rnd(n * k, 5);
            let mut want_acc = acc.clone();
            gemm::sgemm_into(
                &dy,
                (1, n as isize),
                &x,
                (k as isize, 1),
                &mut want_acc,
                n,
                m,
                k,
                true,
            );
            linear_tn_into(&dy, &x, &mut acc, n, m, k, true);
            assert_eq!(bits(&acc), bits(&want_acc));
            assert_eq!(
                bits(&linear_tn(&dy, &x, n, m, k)),
                bits(&gemm::matmul_tn(&dy, &x, n, m, k))
            );
        }
    }

    #[test]
    fn resident_keys_are_unique_and_clones_share_them() {
        let a = GemmOperand::resident(vec![1.0; 4], 7);
        let b = GemmOperand::resident(vec![1.0; 4], 7);
        assert_ne!(a.key(), b.key());
        assert_eq!(a.key().unwrap().version, 7);
        assert_eq!(a.clone().key(), a.key());
        assert_eq!(GemmOperand::transient(vec![0.0]).key(), None);
        assert_eq!(a.view().values, &[1.0; 4]);
    }

    #[test]
    #[should_panic(expected = "linear_nt w: 5 elements, expected 2×3")]
    fn wrong_lengths_are_refused_with_the_shape() {
        linear_nt(&[0.0; 3], WeightView::transient(&[0.0; 5]), 1, 3, 2);
    }
}
