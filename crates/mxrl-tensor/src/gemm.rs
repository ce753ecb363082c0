//! Single-precision GEMM with f32 accumulation (row-major operands).
//!
//! The three shapes a linear layer `y = x · Wᵀ` needs:
//! - forward  `y[m,n]  = x[m,k]  · W[n,k]ᵀ`  → [`matmul_nt`]
//! - dgrad    `dx[m,k] = dy[m,n] · W[n,k]`   → [`matmul_nn`]
//! - wgrad    `dW[n,k] = dy[m,n]ᵀ · x[m,k]`  → [`matmul_tn`]
//!
//! Reference: [`matmul_reference`], a plain triple loop with f32 accumulation. The fast path
//! (`matrixmultiply`, multi-threaded) sums in a different order, so the two agree within the
//! f32 accumulation bound of the reduction length, not bitwise.

/// Up to this many rows a linear layer's forward GEMM runs as independent dot products
/// ([`matmul_nt_dot`], no operand packing: decode steps, sparsely routed experts); above it,
/// the packed GEMM ([`matmul_nt`]). Both accumulate in f32, in different orders.
pub const SMALL_M: usize = 8;

/// `C[m,n] = A[m,k] · B[n,k]ᵀ` (B given row-major as `[n, k]`).
pub fn matmul_nt(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    sgemm_into(
        a,
        (k as isize, 1),
        b,
        (1, k as isize),
        &mut c,
        m,
        k,
        n,
        false,
    );
    c
}

/// `C[m,n] = A[m,k] · B[k,n]`.
pub fn matmul_nn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    sgemm_into(
        a,
        (k as isize, 1),
        b,
        (n as isize, 1),
        &mut c,
        m,
        k,
        n,
        false,
    );
    c
}

/// `C[m,n] = A[k,m]ᵀ · B[k,n]` (A given row-major as `[k, m]`).
pub fn matmul_tn(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    sgemm_into(
        a,
        (1, m as isize),
        b,
        (n as isize, 1),
        &mut c,
        m,
        k,
        n,
        false,
    );
    c
}

/// `C[m,n] (+)= op(A) · op(B)` with explicit strides `(row_stride, col_stride)` of the logical
/// `A[m,k]` and `B[k,n]`; `accumulate` adds into `c` instead of overwriting it.
///
/// # Panics
/// If a buffer is too small for its shape and strides (a broken caller invariant).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_into(
    a: &[f32],
    a_strides: (isize, isize),
    b: &[f32],
    b_strides: (isize, isize),
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    assert_eq!(
        c.len(),
        m * n,
        "sgemm: C has {} elements, expected {m}×{n}",
        c.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    let extent = |(rs, cs): (isize, isize), rows: usize, cols: usize| {
        (rows as isize - 1) * rs + (cols as isize - 1) * cs + 1
    };
    assert!(a_strides.0 >= 0 && a_strides.1 >= 0 && b_strides.0 >= 0 && b_strides.1 >= 0);
    assert!(
        extent(a_strides, m, k) as usize <= a.len(),
        "sgemm: A too small for {m}×{k}"
    );
    assert!(
        extent(b_strides, k, n) as usize <= b.len(),
        "sgemm: B too small for {k}×{n}"
    );
    let beta = if accumulate { 1.0 } else { 0.0 };
    // The crate's raw-pointer interface is the one safe-to-wrap boundary: every extent was
    // checked above, and the three buffers are distinct borrows.
    #[allow(unsafe_code)]
    // SAFETY: `a` holds A[m,k] with strides `a_strides`, `b` holds B[k,n] with `b_strides`,
    // `c` holds C[m,n] row-major; all extents were bounds-checked above, `c` is exclusively
    // borrowed, so no aliasing with `a`/`b` is possible.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            a_strides.0,
            a_strides.1,
            b.as_ptr(),
            b_strides.0,
            b_strides.1,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Dot product in f32 with 8 interleaved partial sums (lane `c % 8` accumulates element `c`
/// in index order), combined as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`. A fixed order that
/// the compiler can vectorize; error bound `γ_{⌈n/8⌉+3}` relative to `Σ|a·b|`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut l = [0.0f32; 8];
    let chunks = n / 8;
    for i in 0..chunks {
        let (x, y) = (&a[i * 8..i * 8 + 8], &b[i * 8..i * 8 + 8]);
        for j in 0..8 {
            l[j] += x[j] * y[j];
        }
    }
    for c in chunks * 8..n {
        l[c % 8] += a[c] * b[c];
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// `C[m,n] = A[m,k] · B[n,k]ᵀ` as `m·n` independent [`dot`] products (no packing): the fast
/// path for few rows (decode), where packing the whole weight would dominate. Each element's
/// summation order depends only on `k`, so a row's result does not depend on `m`.
/// Reference: [`matmul_reference`].
pub fn matmul_nt_dot(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(
        a.len(),
        m * k,
        "matmul_nt_dot: A has {} elements, expected {m}×{k}",
        a.len()
    );
    assert_eq!(
        b.len(),
        n * k,
        "matmul_nt_dot: B has {} elements, expected {n}×{k}",
        b.len()
    );
    let mut c = vec![0.0f32; m * n];
    // weight rows outermost: each B row is read from memory once and reused for all m rows
    for j in 0..n {
        let bj = &b[j * k..(j + 1) * k];
        for i in 0..m {
            c[i * n + j] = dot(&a[i * k..(i + 1) * k], bj);
        }
    }
    c
}

/// Reference `C[m,n] = A[m,k] · B[n,k]ᵀ`: a triple loop, f32 accumulation in index order.
pub fn matmul_reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f32;
            for p in 0..k {
                s += a[i * k + p] * b[j * k + p];
            }
            c[i * n + j] = s;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect()
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

    /// Bound for two f32 dot products of length k in different orders: each is within
    /// γ_k·Σ|a·b| of the exact value, γ_k = k·u/(1−k·u), u = 2⁻²⁴.
    fn assert_close(got: &[f32], want: &[f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
        let u = f32::EPSILON as f64 / 2.0;
        let gamma = (k as f64 * u) / (1.0 - k as f64 * u);
        for i in 0..m {
            for j in 0..n {
                let abs: f64 = (0..k)
                    .map(|p| (a[i * k + p] * b[j * k + p]).abs() as f64)
                    .sum();
                let tol = 2.0 * gamma * abs;
                let d = (got[i * n + j] as f64 - want[i * n + j] as f64).abs();
                assert!(
                    d <= tol,
                    "({i},{j}): {} vs {} (tol {tol})",
                    got[i * n + j],
                    want[i * n + j]
                );
            }
        }
    }

    #[test]
    fn nt_nn_tn_agree_with_reference() {
        for &(m, k, n, seed) in &[
            (1, 1, 1, 1u64),
            (3, 17, 5, 2),
            (33, 64, 70, 3),
            (128, 96, 40, 4),
        ] {
            let a = rnd(m * k, seed);
            let b = rnd(n * k, seed + 100);
            let want = matmul_reference(&a, &b, m, k, n);
            assert_close(&matmul_nt(&a, &b, m, k, n), &want, &a, &b, m, k, n);
            let bt = transpose(&b, n, k); // [k, n]
            assert_close(&matmul_nn(&a, &bt, m, k, n), &want, &a, &b, m, k, n);
            let at = transpose(&a, m, k); // [k, m]
            assert_close(&matmul_tn(&at, &bt, m, k, n), &want, &a, &b, m, k, n);
        }
    }

    #[test]
    fn dot_path_agrees_with_reference_and_is_row_independent() {
        for &(m, k, n, seed) in &[(1, 1, 1, 5u64), (3, 17, 5, 6), (8, 64, 70, 7)] {
            let a = rnd(m * k, seed);
            let b = rnd(n * k, seed + 100);
            let want = matmul_reference(&a, &b, m, k, n);
            let got = matmul_nt_dot(&a, &b, m, k, n);
            assert_close(&got, &want, &a, &b, m, k, n);
            for i in 0..m {
                let row = matmul_nt_dot(&a[i * k..(i + 1) * k], &b, 1, k, n);
                assert_eq!(row, got[i * n..(i + 1) * n], "row {i} depends on m");
            }
        }
    }

    #[test]
    fn accumulate_adds_and_zero_k_clears() {
        let a = rnd(6, 9);
        let b = rnd(6, 10);
        let once = matmul_nt(&a, &b, 2, 3, 2);
        let mut c = once.clone();
        sgemm_into(&a, (3, 1), &b, (1, 3), &mut c, 2, 3, 2, true);
        for (x, y) in c.iter().zip(&once) {
            assert_eq!(*x, 2.0 * y);
        }
        let mut c = vec![5.0; 4];
        sgemm_into(&[], (0, 1), &[], (1, 0), &mut c, 2, 0, 2, false);
        assert_eq!(c, vec![0.0; 4]);
    }
}
