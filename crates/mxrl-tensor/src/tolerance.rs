//! Derived tolerances for comparing two evaluations of the same f32 computation that differ
//! only in summation order (a device against the CPU reference). One place for the bounds;
//! never tuned by eye (conventions.md §6).
//!
//! A sum of `n` terms `tᵢ` evaluated in f32 in any order is within `γ_{n−1}·Σ|tᵢ|` of the exact
//! sum (Higham §4.2), so two such evaluations differ by at most `2·γ_n·Σ|tᵢ|`. Products of
//! BF16-exact operands are exact in f32, so a BF16-operand GEMM entry obeys the same bound with
//! `Σ|tᵢ| = Σₖ |aₖ·bₖ|`.

use crate::gradcheck::gamma;

/// `2·γ_n·abs_sum`: the largest difference between two f32 evaluations (any orders) of a sum
/// of `n` terms whose absolute values add up to `abs_sum`.
pub fn two_order_sum_bound(n: usize, abs_sum: f64) -> f64 {
    2.0 * gamma(n.max(1)) * abs_sum
}

/// Per-entry bound of `C = A·Bᵀ` (`A: [m, k]`, `B: [n, k]`, f32 values) computed in two
/// summation orders: `2·γ_k·Σₖ|A[i,k]·B[j,k]|` for every `(i, j)`, row-major `[m, n]`.
pub fn gemm_nt_bounds(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    gemm_nt_bounds_with(a, b, m, k, n, two_order_sum_bound)
}

/// A bound between two evaluations of a sum of `n` terms with absolute sum `abs_sum`:
/// [`two_order_sum_bound`] (both IEEE f32) or [`tensor_core_sum_bound`] (one on tensor cores).
pub type SumBound = fn(usize, f64) -> f64;

/// `(γ_n + 2·γ_{3n})·abs_sum`: the largest difference between an IEEE f32 evaluation (any
/// order) of a sum of `n` exact products and a tensor-core evaluation of the same sum (BF16
/// `mma` or cuBLAS BF16 GEMM with f32 accumulation).
///
/// Derivation. Tensor cores add a group of `b ≥ 1` products to the f32 accumulator by aligning
/// every term to the largest exponent, truncating the bits below the f32 significand and
/// normalizing the result by truncation (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior
/// of NVIDIA tensor cores", PeerJ Comput. Sci. 2021): each of the `b + 1` terms loses less than
/// one ulp of the group's largest magnitude, `2u·max|t| ≤ 2u·Σ_group|t|`, and the normalization
/// less than one ulp of the result, so a group step errs by at most `(b + 2)·2u·Σ_group|t|`
/// (`Σ_group` including the accumulator, itself at most the absolute sum so far). Over the
/// `⌈n/b⌉` steps of the sum this is, to first order, `2u·(n + 2⌈n/b⌉)·Σ|t| ≤ 6u·n·Σ|t|` for any
/// `b ≥ 1`, which `2·γ_{3n}·Σ|t|` bounds. The IEEE reference is within `γ_n·Σ|t|` of the exact
/// sum (Higham §4.2); the two add up.
pub fn tensor_core_sum_bound(n: usize, abs_sum: f64) -> f64 {
    let n = n.max(1);
    (gamma(n) + 2.0 * gamma(3 * n)) * abs_sum
}

/// Bound between the CPU emulation of an FP8-block GEMM entry
/// ([`crate::qlinear::FP8_BLOCK_EMULATION`]: per 128-wide K block `b` an f32 sum `P_b` of
/// exact E4M3 products, then `y = fl(y + fl(s_b · P_b))` with `s_b = fl(sx·sw)`, blocks in
/// increasing order) and a device that sums each `P_b` on tensor cores and does the rest with
/// the same IEEE operations in the same order. `blocks` is the number of K blocks and
/// `scaled_abs_sum = Σ_b |s_b|·A_b`, `A_b = Σ_{k∈b} |e4m3(x_k)·e4m3(w_k)|`.
///
/// Derivation. Each evaluation's `P_b` is within `E_b ≤ ε·A_b` of the exact block sum, with
/// `ε = 2·γ_{3·128}` for the tensor cores (see [`tensor_core_sum_bound`]) and `γ_128` for the
/// CPU (both ≤ `ε`). Then `|fl(s_b·P_b) − s_b·P*_b| ≤ |s_b|·E_b + u·|s_b|·(A_b + E_b)`, and the
/// f32 sum of the `blocks` terms adds at most `γ_blocks·(1 + u)·Σ_b |s_b|·(A_b + E_b)`. The two
/// evaluations' distances to the exact value add up: the tensor-core part is
/// `tensor_core_sum_bound(128, W)` with `W = scaled_abs_sum`, and the rest at most
/// `2·(u + γ_blocks·(1 + u))·(1 + ε)·W`.
pub fn fp8_block_sum_bound(blocks: usize, scaled_abs_sum: f64) -> f64 {
    let block = mxrl_formats::FP8_BLOCK;
    let u = crate::F32_UNIT_ROUNDOFF;
    let eps = 2.0 * gamma(3 * block);
    tensor_core_sum_bound(block, scaled_abs_sum)
        + 2.0 * (u + gamma(blocks.max(1)) * (1.0 + u)) * (1.0 + eps) * scaled_abs_sum
}

/// [`gemm_nt_bounds`] with the sum bound `sum` (per entry `sum(k, Σₖ|A[i,k]·B[j,k]|)`).
pub fn gemm_nt_bounds_with(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        let ar = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let br = &b[j * k..(j + 1) * k];
            let s: f64 = ar
                .iter()
                .zip(br)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            out.push(sum(k, s));
        }
    }
    out
}

/// Per-entry bound of `C = A·B` (`A: [m, k]`, `B: [k, n]`, the shapes of
/// [`crate::gemm::matmul_nn`]): `sum(k, Σₖ|A[i,k]·B[k,j]|)`, row-major `[m, n]`.
pub fn gemm_nn_bounds_with(
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| (a[i * k + p] as f64 * b[p * n + j] as f64).abs())
                .sum();
            out.push(sum(k, s));
        }
    }
    out
}

/// Per-entry bound of `C = C₀ + Aᵀ·B` (`A: [k, m]`, `B: [k, n]`, the shapes of
/// [`crate::gemm::matmul_tn`]; `c0: [m, n]` the value accumulated into, if any):
/// `sum(k + 1, |C₀[i,j]| + Σₖ|A[k,i]·B[k,j]|)` with `C₀`, else `sum(k, Σₖ|A[k,i]·B[k,j]|)`.
pub fn gemm_tn_bounds_with(
    a: &[f32],
    b: &[f32],
    c0: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    sum: SumBound,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| (a[p * m + i] as f64 * b[p * n + j] as f64).abs())
                .sum();
            out.push(match c0 {
                Some(c) => sum(k + 1, s + (c[i * n + j] as f64).abs()),
                None => sum(k, s),
            });
        }
    }
    out
}

/// Compares `got` with `want` entrywise against `bound[i]` (NaN never passes; infinities must
/// match exactly). Returns the first few violations as text (empty: all within bounds).
pub fn violations(got: &[f32], want: &[f32], bound: impl Fn(usize) -> f64) -> Vec<String> {
    let mut out = Vec::new();
    if got.len() != want.len() {
        out.push(format!("length {} vs reference {}", got.len(), want.len()));
        return out;
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if g.is_nan() || w.is_nan() {
            false
        } else if g.is_infinite() || w.is_infinite() {
            g == w
        } else {
            ((g as f64) - (w as f64)).abs() <= bound(i)
        };
        if !ok {
            out.push(format!(
                "[{i}] got {g:e}, reference {w:e}, bound {:e}",
                bound(i)
            ));
            if out.len() >= 8 {
                break;
            }
        }
    }
    out
}

/// RMSNorm forward, relative bound on `rstd` between two evaluations whose sums of squares
/// (`d` nonnegative terms) run in different orders: the sums differ by `2γ_d` relative, the
/// mean `fl(ss/d) + ε` adds one division and one addition of a nonnegative term per side
/// (`2·2u`), the square root halves the relative difference and rounds once per side (`2u`),
/// the reciprocal rounds once per side (`2u`): `γ_d + 6u ≤ γ_d + γ_6`.
pub fn rmsnorm_rstd_rel(d: usize) -> f64 {
    gamma(d) + gamma(6)
}

/// RMSNorm forward, relative bound on `y = (x·rstd)·w`: [`rmsnorm_rstd_rel`] plus two
/// products rounded on each side (`γ_4`).
pub fn rmsnorm_y_rel(d: usize) -> f64 {
    rmsnorm_rstd_rel(d) + gamma(4)
}

/// RMSNorm backward, per-entry bound on `dx` (row-major `[n, d]`) between two evaluations that
/// get the same `rstd` and differ only in the order of the row dot `Σ_i (w_i·dy_i)·x_i`.
///
/// With `S = Σ_i |w_i·dy_i·x_i|·(1+γ_2)` (the rounded terms, identical on both sides), the dots
/// differ by `E = 2γ_d·S`; `c = (((dot·r)·r)·r)/d` (four roundings per side) differs by
/// `E·r³/d·(1+γ_4) + 2γ_4·C` with `|c| ≤ C = S·r³/d·(1+γ_5)`; `x_j·c` adds a rounding per side and
/// the final subtraction `A_j − x_j·c` (with `A_j = (r·w_j)·dy_j` identical) rounds once per side
/// on a result of magnitude at most `|A_j| + |x_j|·C`.
pub fn rmsnorm_dx_bounds(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    n: usize,
    d: usize,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(n * d);
    let u = crate::F32_UNIT_ROUNDOFF;
    for r in 0..n {
        let rs = rstd[r] as f64;
        let (dyr, xr) = (&dy[r * d..(r + 1) * d], &x[r * d..(r + 1) * d]);
        let s: f64 = (0..d)
            .map(|i| (w[i] as f64 * dyr[i] as f64 * xr[i] as f64).abs())
            .sum::<f64>()
            * (1.0 + gamma(2));
        let r3d = rs.abs().powi(3) / d as f64;
        let e = two_order_sum_bound(d, s);
        let c_max = s * r3d * (1.0 + gamma(5));
        let dc = e * r3d * (1.0 + gamma(4)) + 2.0 * gamma(4) * c_max;
        for j in 0..d {
            let xa = (xr[j] as f64).abs();
            let a = (rs * w[j] as f64 * dyr[j] as f64).abs() * (1.0 + gamma(2));
            let db = xa * dc * (1.0 + u) + 2.0 * u * xa * c_max * (1.0 + u);
            out.push(db + 2.0 * u * (a + xa * c_max + db) * (1.0 + u));
        }
    }
    out
}

/// How a device evaluates the dot products and weighted sums of attention (the scores
/// `q·k`, `P·V`, `dout·v`, `dS·K`, `dSᵀ·Q`, `Pᵀ·dout`); the softmax statistics (max, row
/// sums, `exp`, `log`) and `delta = rowsum(dout∘out)` are IEEE f32 in every variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnSums {
    /// IEEE f32 products and sums in any order: the CPU reference and the CUDA-core kernels
    /// (fused multiply-adds included, as in decode: one rounding where a product and a sum
    /// had two, within the same bound).
    F32,
    /// Both f32 operands split into three BF16 parts, `x = hi + mid + lo` (`hi = bf16(x)`,
    /// `mid = bf16(x − hi)`, `lo = bf16(x − hi − mid)`; exact for `2⁻¹¹⁰ ≤ |x| < 2¹²⁸·(1 − 2⁻⁹)`
    /// or `x = 0`; above, `hi` rounds to infinity),
    /// and the six part products whose indices add up to at most 2 (`hi·hi`, `hi·mid`,
    /// `mid·hi`, `hi·lo`, `mid·mid`, `lo·hi`; each exact in f32) summed on BF16 tensor cores
    /// (`mma.m16n8k16`, f32 accumulation): the tensor-core attention kernels.
    Bf16x3Mma,
}

impl AttnSums {
    /// Bound, in units of `Σ|xᵢ·yᵢ|`, on one evaluation's distance to the exact value of a sum
    /// of `n` products `xᵢ·yᵢ` (`n` also counting the further f32 roundings on a term's path,
    /// as the bounds below count them).
    ///
    /// - `F32`: `γ_n` (Higham §4.2).
    /// - `Bf16x3Mma`: the three dropped part products (`mid·lo`, `lo·mid`, `lo·lo`) are at most
    ///   `(2·2⁻⁸(1+2⁻⁸)·2⁻¹⁶ + 2⁻³²)·|x·y| ≤ 3u·|x·y|` (`|mid| ≤ 2⁻⁸(1+2⁻⁸)|x|`,
    ///   `|lo| ≤ 2⁻¹⁶|x|`); the `6n` kept products have absolute sum at most
    ///   `(1+2⁻⁶)²·Σ|x·y|` (`|hi| + |mid| + |lo| ≤ (1 + 2⁻⁷ + 2⁻¹⁵)|x|`), and their
    ///   tensor-core sum is within `2·γ_{3·6n}` of its exact value ([`tensor_core_sum_bound`]'s
    ///   derivation; the further f32 roundings are fewer than the slack of `γ_{18n}`):
    ///   `2·γ_{18n}·(1+2⁻⁶)² + 3u`. Operands below `2⁻¹¹⁰` in magnitude add at most
    ///   `2⁻¹³⁴·|other operand|` per product beyond this (not counted).
    pub fn rel(self, n: usize) -> f64 {
        match self {
            AttnSums::F32 => gamma(n),
            AttnSums::Bf16x3Mma => {
                let f = 1.0 + 1.0 / 64.0;
                2.0 * gamma(18 * n.max(1)) * f * f + 3.0 * crate::F32_UNIT_ROUNDOFF
            }
        }
    }
}

/// Bound of one attention row (`q` against keys `0..len`) between two f32 evaluations that
/// differ in summation order and in how the softmax is organised (one pass with the exact max
/// as in `attend_row`, or an online softmax over key tiles with rescaling and a combine of
/// chunks). Computed from the exact (f64) scores and probabilities.
#[derive(Clone, Debug)]
pub struct AttnRowBound {
    /// Per output column `d`: the bound on `|out_a − out_b|` (both evaluations).
    pub out: Vec<f64>,
    /// Per output column: the bound on one evaluation's distance to the exact output
    /// (half of `out`), used by the backward bounds.
    pub out_one: Vec<f64>,
    /// The exact output row.
    pub out_exact: Vec<f64>,
    /// The exact log-sum-exp of the scaled scores.
    pub lse_exact: f64,
    /// Bound on one evaluation's log-sum-exp against [`AttnRowBound::lse_exact`].
    pub lse: f64,
    /// The exact probabilities `p_j`.
    pub p: Vec<f64>,
    /// Bound on the relative error of one evaluation's probabilities (normalised weights).
    pub p_rel: f64,
}

/// Derives [`AttnRowBound`] for the query row `q: [D]` against key/value rows
/// `keys[j·stride..][..D]`, `values[j·stride..][..D]`, `j < len`, with the f32 `scale` and
/// `levels` rescaling levels (0 for the one-pass reference; for an online softmax over tiles of
/// `t` keys, `ceil(len/t)`, plus one per combine of chunks). `sums` is the less accurate of the
/// two evaluations' [`AttnSums`] (each step takes the larger error model; the result is
/// doubled).
///
/// Derivation (u = 2⁻²⁴, exact values `σ_j = scale·q·k_j`, `A_j = scale·Σ_d|q_d·k_jd|`,
/// `ρ_n = sums.rel(n)`):
/// - each computed score `fl(fl(q·k_j)·scale)` is within `δ_j = ρ_{D+1}·A_j` of `σ_j`; every
///   computed score is at most `S = max_j |σ_j| + δ_j` in magnitude;
/// - an unnormalised weight `exp(ŝ_j − m̂)` carries, per level (the first exp and each
///   rescale `exp(m_old − m_new)` with its product), the rounding of the exponent's argument
///   (`u·2S`), the exp itself (≤ 2 ulp ≤ `4u`; CUDA `expf` and the host's `expf` are within
///   2 ulp) and one product (`u`): relative factor within `e^{±a}`,
///   `a = (max_j δ_j + (levels + 1)·(2u·S + 6u))·(1 + 10⁻⁶)` (the last factor covers
///   `ln(1+x) ≤ x/(1−x)`);
/// - the row sum adds `γ_m` (`m = len + levels + 4` roundings on any term's path), so a
///   normalised probability is within relative `r = e^{2a}/(1 − γ_m) − 1` of `p_j`;
/// - the weighted sum of values rounds within `ρ_m` of `Σ|p̂_j·v_jd|`, so one evaluation is
///   within `E_d = Σ_j p_j|v_jd|·((1 + r)(1 + ρ_m) − 1)` of the exact output, and two are
///   within `2·E_d`;
/// - the log-sum-exp `m̂ + log(l̂)` is within `a + γ_m` (the sum, in log space) plus
///   `4u·(ln len + 2a + 1)` (log, ≤ 2 ulp) plus `2u·(|lse| + 1)` (the addition).
#[allow(clippy::too_many_arguments)]
pub fn attention_row_bound(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    len: usize,
    scale: f32,
    levels: usize,
    sums: AttnSums,
) -> AttnRowBound {
    let d = q.len();
    let u = crate::F32_UNIT_ROUNDOFF;
    let sc = scale as f64;
    let mut sig = Vec::with_capacity(len);
    let mut delta_max = 0.0f64;
    let mut smax = 0.0f64;
    for j in 0..len {
        let kj = &keys[j * stride..j * stride + d];
        let (mut s, mut a) = (0.0f64, 0.0f64);
        for (&x, &y) in q.iter().zip(kj) {
            s += x as f64 * y as f64;
            a += (x as f64 * y as f64).abs();
        }
        let (s, a) = (s * sc, a * sc.abs());
        let dj = sums.rel(d + 1) * a;
        delta_max = delta_max.max(dj);
        smax = smax.max(s.abs() + dj);
        sig.push(s);
    }
    let mu = sig.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = sig.iter().map(|s| (s - mu).exp()).collect();
    let l: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|x| x / l).collect();
    let lse_exact = if len == 0 {
        f64::NEG_INFINITY
    } else {
        mu + l.ln()
    };
    let a = (delta_max + (levels + 1) as f64 * (2.0 * u * smax + 6.0 * u)) * (1.0 + 1e-6);
    let m = len + levels + 4;
    let gm = gamma(m);
    let r = (2.0 * a).exp() / (1.0 - gm) - 1.0;
    let mut out_one = vec![0.0f64; d];
    let mut out_exact = vec![0.0f64; d];
    for j in 0..len {
        let vj = &values[j * stride..j * stride + d];
        for c in 0..d {
            out_one[c] += p[j] * (vj[c] as f64).abs();
            out_exact[c] += p[j] * vj[c] as f64;
        }
    }
    let rm = sums.rel(m);
    for e in out_one.iter_mut() {
        *e *= (1.0 + r) * (1.0 + rm) - 1.0;
    }
    let lse = a
        + gm
        + 4.0 * u * ((len.max(1) as f64).ln() + 2.0 * a + 1.0)
        + 2.0 * u * (lse_exact.abs() + 1.0);
    AttnRowBound {
        out: out_one.iter().map(|e| 2.0 * e).collect(),
        out_one,
        out_exact,
        lse_exact,
        lse,
        p,
        p_rel: r,
    }
}

/// Per-entry bounds of the attention forward over a packed batch between two evaluations,
/// `[N, Hq·D]` for the output, plus the exact log-sum-exp `[N, Hq]` and one evaluation's bound
/// on it. `key_tile` is the key tile of the online softmax (levels `ceil((i+1)/key_tile)` for
/// row `i`; see [`attention_row_bound`]); `sums` the less accurate evaluation's [`AttnSums`].
pub fn attention_forward_bounds(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: &crate::SeqLayout,
    shape: crate::attention::AttnShape,
    key_tile: usize,
    sums: AttnSums,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = attention_rows(q, k, v, layout, shape, key_tile, sums);
    let (hq, d) = (shape.q_heads, shape.head_dim);
    let n = layout.num_tokens();
    let (mut out, mut lse_exact, mut lse) =
        (vec![0.0; n * hq * d], vec![0.0; n * hq], vec![0.0; n * hq]);
    for (t, h, rb) in rows {
        out[(t * hq + h) * d..(t * hq + h + 1) * d].copy_from_slice(&rb.out);
        lse_exact[t * hq + h] = rb.lse_exact;
        lse[t * hq + h] = rb.lse;
    }
    (out, lse_exact, lse)
}

fn attention_rows(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: &crate::SeqLayout,
    shape: crate::attention::AttnShape,
    key_tile: usize,
    sums: AttnSums,
) -> Vec<(usize, usize, AttnRowBound)> {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = hq / hkv;
    let (qs, kvs) = (hq * d, hkv * d);
    let mut rows = Vec::new();
    for b in 0..layout.num_seqs() {
        let (t0, tl) = (layout.offset(b), layout.len(b));
        for i in 0..tl {
            for h in 0..hq {
                let kh = h / g;
                let qo = (t0 + i) * qs + h * d;
                let rb = attention_row_bound(
                    &q[qo..qo + d],
                    &k[t0 * kvs + kh * d..],
                    &v[t0 * kvs + kh * d..],
                    kvs,
                    i + 1,
                    shape.scale(),
                    (i + 1).div_ceil(key_tile.max(1)),
                    sums,
                );
                rows.push((t0 + i, h, rb));
            }
        }
    }
    rows
}

/// Per-entry bounds of the attention backward over a packed batch between two evaluations:
/// `(dq [N, Hq·D], dk [N, Hkv·D], dv [N, Hkv·D])`. One evaluation may recompute the
/// probabilities from its own log-sum-exp (`exp(ŝ − lse)`) and take `delta = rowsum(dout∘out)`
/// from its own forward output; the other may use stored probabilities and
/// `delta = Σ_j p_j·(dout·v_j)`. Each is bounded against the exact f64 values and the bound is
/// the sum of the two (taking the larger of the two error models at every step):
/// - probabilities: relative `r_P = max(r, e^{δ_ij + b_lse + 2u(|s|+|lse|) + 4u} − 1)` with `r`,
///   `b_lse` from [`attention_row_bound`];
/// - `dp_ij = dout_i·v_j`: `ε_ij = ρ_D·Σ|dout_i·v_j|` (`ρ_n = sums.rel(n)`, [`AttnSums`]: the
///   less accurate evaluation's dots and weighted sums; the scores' `δ_ij` likewise);
/// - `delta_i`: the larger of `Σ_j [r_P·p|dp| + (1+r_P)·p·ε] + γ_m·Σ_j (1+r_P)·p·(|dp|+ε)` and
///   `Σ_d |dout_d|·E_d + γ_D·Σ_d |dout_d|·(|o_d| + E_d)` (`E_d` the forward bound of one
///   evaluation);
/// - `ds_ij = p·(dp − delta)` (≤ 3 roundings, with the scale): `e_ds = r_P·p·|dp−Δ| +
///   (1+r_P)·p·(ε + e_Δ) + γ_3·(1+r_P)·p·(|dp−Δ| + ε + e_Δ)`;
/// - `dq_i = scale·Σ_j ds_ij·k_j`: `scale·Σ_j e_ds·|k_j| + ρ_{len+2}·scale·Σ_j (|ds|+e_ds)·|k_j|`;
///   `dk_j` likewise over the group's heads and the queries `i ≥ j` (`g·T + 2` terms);
///   `dv_j = Σ p_ij·dout_i`: `Σ r_P·p·|dout| + ρ_{gT+2}·Σ (1+r_P)·p·|dout|`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_bounds(
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: &crate::SeqLayout,
    shape: crate::attention::AttnShape,
    key_tile: usize,
    sums: AttnSums,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = hq / hkv;
    let (qs, kvs) = (hq * d, hkv * d);
    let n = layout.num_tokens();
    let u = crate::F32_UNIT_ROUNDOFF;
    let sc = shape.scale() as f64;
    let rows = attention_rows(q, k, v, layout, shape, key_tile, sums);
    let mut row_of = vec![None; n * hq];
    for (idx, (t, h, _)) in rows.iter().enumerate() {
        row_of[t * hq + h] = Some(idx);
    }
    // Accumulators of one evaluation's error bound (doubled at the end).
    let mut edq = vec![0.0f64; n * qs];
    let mut edk = vec![0.0f64; n * kvs];
    let mut edv = vec![0.0f64; n * kvs];
    // Magnitude sums for the summation-rounding terms, with their term counts.
    let mut mdq = vec![0.0f64; n * qs];
    let mut mdk = vec![0.0f64; n * kvs];
    let mut mdv = vec![0.0f64; n * kvs];
    for b in 0..layout.num_seqs() {
        let (t0, tl) = (layout.offset(b), layout.len(b));
        for h in 0..hq {
            let kh = h / g;
            for i in 0..tl {
                let (_, _, rb) = &rows[row_of[(t0 + i) * hq + h].expect("row bound")];
                let qo = (t0 + i) * qs + h * d;
                let (qi, doi) = (&q[qo..qo + d], &dout[qo..qo + d]);
                let len = i + 1;
                let mut dp = vec![0.0f64; len];
                let mut eps = vec![0.0f64; len];
                let mut r_p = rb.p_rel;
                for j in 0..len {
                    let vo = (t0 + j) * kvs + kh * d;
                    let ko = vo;
                    let (mut s, mut a, mut x, mut xa) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                    for c in 0..d {
                        let (qq, kk) = (qi[c] as f64, k[ko + c] as f64);
                        s += qq * kk;
                        a += (qq * kk).abs();
                        let (o, vv) = (doi[c] as f64, v[vo + c] as f64);
                        x += o * vv;
                        xa += (o * vv).abs();
                    }
                    dp[j] = x;
                    eps[j] = sums.rel(d) * xa;
                    let (s, a) = (s * sc, a * sc.abs());
                    let rs = sums.rel(d + 1);
                    let arg = rs * a
                        + rb.lse
                        + 2.0 * u * (s.abs() + a * rs + rb.lse_exact.abs() + rb.lse)
                        + 4.0 * u;
                    r_p = r_p.max(arg.exp() - 1.0);
                }
                let p = &rb.p;
                let m = len + 4;
                let delta: f64 = (0..len).map(|j| p[j] * dp[j]).sum();
                let e_cpu: f64 = (0..len)
                    .map(|j| r_p * p[j] * dp[j].abs() + (1.0 + r_p) * p[j] * eps[j])
                    .sum::<f64>()
                    + gamma(m)
                        * (0..len)
                            .map(|j| (1.0 + r_p) * p[j] * (dp[j].abs() + eps[j]))
                            .sum::<f64>();
                let e_gpu: f64 = (0..d)
                    .map(|c| {
                        let o = (doi[c] as f64).abs();
                        o * rb.out_one[c] + gamma(d) * o * (rb.out_exact[c].abs() + rb.out_one[c])
                    })
                    .sum();
                let e_delta = e_cpu.max(e_gpu);
                for j in 0..len {
                    let ko = (t0 + j) * kvs + kh * d;
                    let dd = (dp[j] - delta).abs();
                    let ds = p[j] * dd;
                    let e_ds = r_p * ds
                        + (1.0 + r_p) * p[j] * (eps[j] + e_delta)
                        + gamma(3) * (1.0 + r_p) * p[j] * (dd + eps[j] + e_delta);
                    for c in 0..d {
                        let (ka, qa, oa) = (
                            (k[ko + c] as f64).abs(),
                            (qi[c] as f64).abs(),
                            (doi[c] as f64).abs(),
                        );
                        edq[qo + c] += sc * e_ds * ka;
                        mdq[qo + c] += sc * (ds + e_ds) * ka;
                        edk[ko + c] += sc * e_ds * qa;
                        mdk[ko + c] += sc * (ds + e_ds) * qa;
                        edv[ko + c] += r_p * p[j] * oa;
                        mdv[ko + c] += (1.0 + r_p) * p[j] * oa;
                    }
                }
            }
        }
    }
    let max_t = (0..layout.num_seqs())
        .map(|b| layout.len(b))
        .max()
        .unwrap_or(0);
    let (gq, gk) = (sums.rel(max_t + 2), sums.rel(g * max_t + 2));
    let fin = |e: Vec<f64>, m: Vec<f64>, gg: f64| -> Vec<f64> {
        e.iter().zip(&m).map(|(e, m)| 2.0 * (e + gg * m)).collect()
    };
    (fin(edq, mdq, gq), fin(edk, mdk, gk), fin(edv, mdv, gk))
}

/// Largest error, in ulps of the exact result, of the f32 `exp` the CPU reference calls
/// (`f32::exp` → the platform libm's `expf`; glibc ≥ 2.27 and musl share the Arm optimized
/// routine whose documented error is 0.502 ulp). One ulp is used.
pub const EXP_ULPS_CPU: u32 = 1;

/// Largest error, in ulps of the exact result, of the engine's device `exp`: the kernels
/// evaluate `(float)exp((double)x)` (CUDA's double `exp` is within 1 ulp of f64, then one
/// round-to-nearest conversion: ≤ 0.5 ulp of f32 + 2⁻²⁹ ulp). One ulp is used. (CUDA's f32
/// `expf` without fast math is documented at 2 ulps; the kernels do not use it.)
pub const EXP_ULPS_DEVICE: u32 = 1;

/// Half the smallest f32 subnormal: the absolute rounding error of one f32 operation whose
/// result is subnormal (IEEE round to nearest; no flush to zero on either device).
const SUBNORMAL_HALF: f64 = 1.0 / (1u128 << 126) as f64 / (1u64 << 24) as f64;

/// Bound on `|p_a − p_b|` for one probability of an f32 row softmax over `c` columns
/// (`mxrl_tensor::activation::softmax_forward`'s formula: `e_i = exp(x_i − max)`, any summation
/// order, one division) evaluated on two devices whose `exp` is within `ulps_a` / `ulps_b`
/// ulps; `p_ref` is device b's value.
///
/// An exp within `m` ulps is `e·(1+θ_{2m})`; the sum of `c` positive terms adds `θ_{c−1}`, the
/// division one rounding, so `p̂ = p·(1+θ_{4m+c})` (Higham's θ/γ calculus). The difference is
/// at most `(γ_{4m_a+c} + γ_{4m_b+c})·p` with `p ≤ p_ref / (1 − γ_{4m_b+c})`, plus an absolute
/// term for results in the subnormal range (`c·(m_a+m_b+2)` half-subnormals: the max term is
/// `exp(0)`, so the sum is ≥ 1 and does not amplify them).
pub fn softmax_prob_bound(p_ref: f32, c: usize, ulps_a: u32, ulps_b: u32) -> f64 {
    let na = 4 * ulps_a as usize + c;
    let nb = 4 * ulps_b as usize + c;
    let p = (p_ref as f64).abs() / (1.0 - gamma(nb));
    (gamma(na) + gamma(nb)) * p + (c as f64) * (2 * (ulps_a + ulps_b) + 4) as f64 * SUBNORMAL_HALF
}

/// Bound on `|w_a − w_b|` for one `norm_topk_prob` combine weight `w_s = p_s / Σ_j p_j` over
/// `k` selected probabilities of one softmax row of `c` columns (sum in slot order, one
/// division), on two devices whose `exp` is within `ulps_a` / `ulps_b` ulps; `w_ref` is device
/// b's value.
///
/// The softmax denominator is one common factor of every `p_j` and cancels up to the per-entry
/// divisions: `ŵ_s = e_s(1+θ_{2m+1}) / (Σ_j e_j (1+θ_{2m+k}))·(1+δ) = w_s·(1+θ_{4m+k+2})`.
/// Plus the subnormal term of [`softmax_prob_bound`] amplified by at most `c` (the selected sum
/// holds the row's largest probability, ≥ 1/c).
pub fn topk_norm_weight_bound(w_ref: f32, k: usize, c: usize, ulps_a: u32, ulps_b: u32) -> f64 {
    let na = 4 * ulps_a as usize + k + 2;
    let nb = 4 * ulps_b as usize + k + 2;
    let w = (w_ref as f64).abs() / (1.0 - gamma(nb));
    (gamma(na) + gamma(nb)) * w
        + (c * c) as f64 * (2 * (ulps_a + ulps_b) + 6) as f64 * SUBNORMAL_HALF
}

/// Bound on the difference of two evaluations of the auxiliary load-balancing loss
/// (`mxrl_tensor::routing::load_balancing_loss`: f64 sums of `m` f32 probabilities per expert
/// in any order, exact integer counts, then `E·Σ_e (c_e/m)(P_e/m)` over `e` experts in f64,
/// rounded once to f32); `loss_ref` is one device's f32 value.
///
/// Each evaluation is `loss·(1+θ⁽⁶⁴⁾_{m+e+4})·(1+δ₃₂)` (positive terms only), so they differ by
/// at most `2·(γ⁽⁶⁴⁾_{m+e+4} + u₃₂ + γ⁽⁶⁴⁾·u₃₂)·loss`, `loss ≤ loss_ref/((1−γ⁽⁶⁴⁾)(1−u₃₂))`.
pub fn aux_loss_bound(loss_ref: f32, m: usize, e: usize) -> f64 {
    let g = gamma_f64(m + e + 4);
    let u = crate::F32_UNIT_ROUNDOFF;
    let loss = (loss_ref as f64).abs() / ((1.0 - g) * (1.0 - u));
    2.0 * (g + u + g * u) * loss
}

/// A value of an f32 computation tracked against its exact result: `value` is the exact
/// result (evaluated in f64 from the exact inputs) and `err` bounds `|computed − exact|` for
/// one device (running error analysis: every f32 operation adds `u·|result| + 2⁻¹⁵⁰`, errors
/// of operands propagate through first-order-exact formulas). Used to derive per-element
/// bounds of elementwise ops whose two evaluations follow the same operation sequence.
#[derive(Clone, Copy, Debug)]
pub struct Tracked {
    /// The exact value (in f64).
    pub value: f64,
    /// Bound on the distance of the device's f32 result from `value`.
    pub err: f64,
}

impl Tracked {
    /// An input, exact on every device.
    pub fn exact(x: f32) -> Self {
        Tracked {
            value: x as f64,
            err: 0.0,
        }
    }

    fn rounded(value: f64, prop: f64) -> Self {
        let err = prop + crate::F32_UNIT_ROUNDOFF * (value.abs() + prop) + SUBNORMAL_HALF;
        Tracked { value, err }
    }

    /// `exp(a)` by a function within `ulps` ulps of the exact result (an ulp is at most
    /// `2u·|x|`, or `2⁻¹⁴⁹` in the subnormal range). Infinite error where the result leaves
    /// f32's range (a device may return the largest finite value or infinity).
    pub fn exp(self, ulps: u32) -> Self {
        let value = self.value.exp();
        let prop = (self.value + self.err).exp() * self.err;
        if value + prop >= f32::MAX as f64 {
            return Tracked {
                value,
                err: f64::INFINITY,
            };
        }
        let err = prop
            + ulps as f64
                * (2.0 * crate::F32_UNIT_ROUNDOFF * (value + prop) + 2.0 * SUBNORMAL_HALF);
        Tracked { value, err }
    }
}

impl std::ops::Neg for Tracked {
    type Output = Tracked;
    /// `−a` (exact).
    fn neg(self) -> Tracked {
        Tracked {
            value: -self.value,
            err: self.err,
        }
    }
}

impl std::ops::Add for Tracked {
    type Output = Tracked;
    /// `a + b` in f32.
    fn add(self, b: Tracked) -> Tracked {
        Tracked::rounded(self.value + b.value, self.err + b.err)
    }
}

impl std::ops::Sub for Tracked {
    type Output = Tracked;
    /// `a − b` in f32.
    fn sub(self, b: Tracked) -> Tracked {
        Tracked::rounded(self.value - b.value, self.err + b.err)
    }
}

impl std::ops::Mul for Tracked {
    type Output = Tracked;
    /// `a · b` in f32.
    fn mul(self, b: Tracked) -> Tracked {
        let prop = self.value.abs() * b.err + b.value.abs() * self.err + self.err * b.err;
        Tracked::rounded(self.value * b.value, prop)
    }
}

impl std::ops::Div for Tracked {
    type Output = Tracked;
    /// `a / b` in f32 (infinite error when `b`'s error reaches its magnitude).
    fn div(self, b: Tracked) -> Tracked {
        let bv = b.value.abs();
        if b.err >= bv {
            return Tracked {
                value: self.value / b.value,
                err: f64::INFINITY,
            };
        }
        let prop = (self.value.abs() * b.err + bv * self.err) / (bv * (bv - b.err));
        Tracked::rounded(self.value / b.value, prop)
    }
}

/// Bound on `|h_a − h_b|` for one element of `mxrl_tensor::activation::swiglu_forward`
/// (`h = (g / (1 + exp(−g)))·up`, the same operation sequence on both devices) whose `exp`
/// is within `ulps_a` / `ulps_b` ulps: the sum of both devices' tracked errors (`Tracked`),
/// with a `2⁻³⁰` relative margin for the f64 evaluation of the exact values.
pub fn swiglu_forward_bound(g: f32, up: f32, ulps_a: u32, ulps_b: u32) -> f64 {
    let one = |ulps: u32| {
        let gt = Tracked::exact(g);
        let d = Tracked::exact(1.0) + (-gt).exp(ulps);
        (gt / d * Tracked::exact(up)).err
    };
    (one(ulps_a) + one(ulps_b)) * (1.0 + 1.0 / (1u64 << 30) as f64)
}

/// Bounds `(dgate, dup)` on the two devices' difference for one element of
/// `mxrl_tensor::activation::swiglu_backward` (`s = 1/(1+exp(−g))`,
/// `dgate = (dh·up)·(s·(1 + g·(1 − s)))`, `dup = dh·(g·s)`), as [`swiglu_forward_bound`].
pub fn swiglu_backward_bounds(dh: f32, g: f32, up: f32, ulps_a: u32, ulps_b: u32) -> (f64, f64) {
    let one = |ulps: u32| {
        let (gt, one) = (Tracked::exact(g), Tracked::exact(1.0));
        let s = one / (one + (-gt).exp(ulps));
        let c = s * (one + gt * (one - s));
        let p = Tracked::exact(dh) * Tracked::exact(up);
        let dgate = (p * c).err;
        let dup = (Tracked::exact(dh) * (gt * s)).err;
        (dgate, dup)
    };
    let (a, b) = (one(ulps_a), one(ulps_b));
    let m = 1.0 + 1.0 / (1u64 << 30) as f64;
    ((a.0 + b.0) * m, (a.1 + b.1) * m)
}

/// Unit roundoff of f64 (`2⁻⁵³`).
pub const F64_UNIT_ROUNDOFF: f64 = 1.0 / 9_007_199_254_740_992.0;

/// `γ_n = n·u/(1 − n·u)` for f64's unit roundoff.
pub fn gamma_f64(n: usize) -> f64 {
    let nu = n.max(1) as f64 * F64_UNIT_ROUNDOFF;
    nu / (1.0 - nu)
}

/// `2·γ_n·abs_sum` in f64 arithmetic: two f64 evaluations (any orders) of a sum of `n` terms
/// (e.g. exact squares of f32 values) whose absolute values add up to `abs_sum`.
pub fn two_order_sum_bound_f64(n: usize, abs_sum: f64) -> f64 {
    2.0 * gamma_f64(n) * abs_sum
}

/// Relative difference between two f32 evaluations of one row's softmax normaliser
/// `s = Σ_v exp(y_v − m)` (`m = max y`, so `s ≥ 1`), one of which may combine `chunks`
/// partial sums by rescaling with `exp(m_c − m)` (online softmax). Per evaluation: each `exp`
/// is within 2 ulp (≤ 4u relative; CUDA's `expf` bound, libm's is 1 ulp), `y_v − m` is
/// rounded (a relative error of `u·|y_v − m|` in the term after `exp`, in total
/// `u·Σ e_v|y_v − m| = u·q`), the sum of `v + chunks` terms adds `γ`, and each rescale adds
/// an `exp` and a product (8u + 2u relative) plus the rounding of `m_c − m`, which costs at
/// most `u·|d|·e^{d}·s_c ≤ u·s_c/e` absolutely (`≤ u·v/2` over all chunks). With `q_over_s =
/// Σ e_v(m − y_v)/s` (≥ 0, from the reference), the two evaluations differ relatively by at
/// most twice the worst single one.
pub fn softmax_sum_rel_bound(v: usize, chunks: usize, q_over_s: f64) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rescale = if chunks > 1 {
        10.0 * u + u * v as f64 / 2.0
    } else {
        0.0
    };
    2.0 * (4.0 * u + gamma(v + chunks) + u * q_over_s + rescale)
}

/// Bound on the difference of `lse = m + ln s` between two f32 evaluations of a row of
/// `v` tempered logits whose inputs `y` differ by at most `delta_y` per entry: `lse` is
/// 1-Lipschitz in the max norm of `y` (`delta_y`), `s` differs relatively by `ρ`
/// ([`softmax_sum_rel_bound`]) so `ln s` by `ρ/(1−ρ)`, `ln` is within 1 ulp on either side
/// (`4u·|ln s|` together) and the final `m + ln s` rounds on either side (`2u·|lse|`).
pub fn lse_bound(v: usize, chunks: usize, delta_y: f64, q_over_s: f64, ln_s: f64, lse: f64) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rho = softmax_sum_rel_bound(v, chunks, q_over_s);
    delta_y + rho / (1.0 - rho) + 4.0 * u * ln_s.abs() + 2.0 * u * lse.abs() * (1.0 + 2.0 * u)
}

/// Bound on the difference of a softmax entropy `H = Σ p_v (lse − y_v) = ln s − q/s` between
/// two f32 evaluations (one as `ln s − q/s`, one as `−Σ exp(l_v)·l_v` with `l = y − lse` and an
/// f64 sum): `∂H/∂y_v = −p_v(l_v + H)`, so input and `lse` differences `d = delta_y +
/// lse_diff` move `H` by at most `2d·(1 + H)`; the relative error `ρ` of `s` (and of `q`,
/// which sums the same terms times `m − y_v`) moves `ln s` and `q/s` by `ρ·(1 + |ln s| +
/// 2q/s)`; rounding `l_v` (by `u·|l_v|`) moves `exp(l_v)·l_v` by `p_v·|1 + l_v|·u·|l_v|`,
/// at most `u·(m2 + H)` in total with `m2 = Σ p_v l_v²`; the remaining roundings (`exp`, the
/// product, `ln`, the quotient and the final difference, at most 8 units of `u` per quantity)
/// add `8u·(H + |ln s| + q/s)` and the f64 sum `γ_v·H`.
#[allow(clippy::too_many_arguments)]
pub fn entropy_bound(
    v: usize,
    chunks: usize,
    delta_y: f64,
    lse_diff: f64,
    q_over_s: f64,
    ln_s: f64,
    entropy: f64,
    m2: f64,
) -> f64 {
    let u = crate::F32_UNIT_ROUNDOFF;
    let rho = softmax_sum_rel_bound(v, chunks, q_over_s);
    let h = entropy.abs();
    2.0 * (delta_y + lse_diff) * (1.0 + h)
        + rho / (1.0 - rho) * (1.0 + ln_s.abs() + 2.0 * q_over_s)
        + u * (m2.abs() + h)
        + 8.0 * u * (h + ln_s.abs() + q_over_s)
        + gamma_f64(v) * h
}

/// Largest expected difference between the observed frequencies `k₁/n₁` and `k₂/n₂` of one
/// outcome of probability `p` in two independent samples of sizes `n₁`, `n₂`: `z` standard
/// deviations of the difference, `z·√(p(1−p)(1/n₁ + 1/n₂))`, plus one count of each sample's
/// granularity. `z = 6` keeps a false alarm below 2·10⁻⁹ per outcome (normal approximation).
pub fn binomial_two_sample_bound(p: f64, n1: usize, n2: usize, z: f64) -> f64 {
    let (a, b) = (n1.max(1) as f64, n2.max(1) as f64);
    z * (p * (1.0 - p) * (1.0 / a + 1.0 / b)).max(0.0).sqrt() + 1.0 / a + 1.0 / b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn violations_reject_nan_and_out_of_bound() {
        assert!(violations(&[1.0, 2.0], &[1.0, 2.0], |_| 0.0).is_empty());
        assert_eq!(violations(&[f32::NAN], &[f32::NAN], |_| 1.0).len(), 1);
        assert_eq!(violations(&[1.0 + 1e-3], &[1.0], |_| 1e-4).len(), 1);
        assert!(violations(&[1.0 + 1e-5], &[1.0], |_| 1e-4).is_empty());
    }

    /// The CPU emulation of an FP8-block forward lies within the bound of an evaluation whose
    /// block sums are exact (f64 sums of the exact products, the same f32 scale products and
    /// promotion): the bound covers one side's block-sum error with room, and a misapplied
    /// scale (another block's, or the transposed weight tile's) would exceed it.
    #[test]
    fn fp8_block_forward_is_within_the_bound_of_exact_block_sums() {
        use crate::qlinear::{BackwardMode, LinearSpec, PreparedWeight};
        use mxrl_formats::{e4m3_decode, Format, Padding, Scales, Scheme};
        let (m, n, k) = (5, 256, 384);
        let mut z = 0x9E37_79B9u32;
        let mut next = |scale: f32| {
            z ^= z << 13;
            z ^= z >> 17;
            z ^= z << 5;
            (z as f32 / u32::MAX as f32 - 0.5) * scale
        };
        // Blocks of different magnitudes, so each scale matters.
        let x: Vec<f32> = (0..m * k)
            .map(|i| next(2f32.powi((i % k / 128) as i32 * 3)))
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| next(2f32.powi((i / k / 128) as i32 - 2)))
            .collect();
        let spec = LinearSpec::new(Format::Fp8Block, BackwardMode::HighPrecision).unwrap();
        let pw = PreparedWeight::quantize("w", &w, n, k, spec, 0).unwrap();
        let y = pw.forward_inference(&x, m).unwrap();
        let qx =
            mxrl_formats::quantize(&x, &[m, k], Scheme::FP8_BLOCK_ACT, Padding::Reject).unwrap();
        let qw = pw.stored().unwrap();
        let (Scales::F32(sx), Scales::F32(sw)) = (&qx.scales, &qw.scales) else {
            panic!("FP8-block scales are f32")
        };
        let kb = k / 128;
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut abs) = (0f32, 0f64);
                for b in 0..kb {
                    let (mut p, mut a) = (0f64, 0f64);
                    for kk in b * 128..(b + 1) * 128 {
                        let t = e4m3_decode(qx.data[i * k + kk]) as f64
                            * e4m3_decode(qw.data[j * k + kk]) as f64;
                        p += t;
                        a += t.abs();
                    }
                    let s = sx[i * kb + b] * sw[(j / 128) * kb + b];
                    exact += s * p as f32;
                    abs += (s as f64).abs() * a;
                }
                let bound = fp8_block_sum_bound(kb, abs);
                let d = (y[i * n + j] as f64 - exact as f64).abs();
                assert!(
                    d <= bound,
                    "y[{i},{j}] = {} vs {exact}: {d:e} > {bound:e}",
                    y[i * n + j]
                );
            }
        }
    }

    #[test]
    fn tensor_core_bound_exceeds_the_ieee_bound() {
        for n in [1, 2, 16, 1000, 100_000] {
            let (ieee, tc) = (two_order_sum_bound(n, 1.0), tensor_core_sum_bound(n, 1.0));
            // Truncating additions (unit roundoff 2u) over at most 3n steps, plus the IEEE
            // side: at least 3.5× the IEEE-vs-IEEE bound, and linear in the absolute sum.
            assert!(tc >= 3.5 * ieee, "n = {n}: {tc:e} vs {ieee:e}");
            assert_eq!(tensor_core_sum_bound(n, 4.0), 4.0 * tc);
        }
    }

    #[test]
    fn nn_and_tn_bounds_are_nt_bounds_of_the_transposed_operands() {
        let (m, k, n) = (3, 5, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.25 - 1.0).collect(); // [m, k]
        let bt: Vec<f32> = (0..n * k).map(|i| 2.0 - i as f32 * 0.125).collect(); // [n, k]
        let t = |x: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..c * r).map(|i| x[(i % r) * c + i / r]).collect()
        };
        let b = t(&bt, n, k); // [k, n]
        let at = t(&a, m, k); // [k, m]
        let nt = gemm_nt_bounds(&a, &bt, m, k, n);
        assert_eq!(
            gemm_nn_bounds_with(&a, &b, m, k, n, two_order_sum_bound),
            nt
        );
        assert_eq!(
            gemm_tn_bounds_with(&at, &b, None, m, k, n, two_order_sum_bound),
            nt
        );
        // Accumulating into C₀ adds one term and |C₀| to the absolute sum.
        let c0 = vec![-3.0f32; m * n];
        let acc = gemm_tn_bounds_with(&at, &b, Some(&c0), m, k, n, two_order_sum_bound);
        let plain = gemm_nt_bounds_with(&a, &bt, m, k, n, |_, s| s);
        for (x, s) in acc.iter().zip(plain) {
            assert_eq!(*x, two_order_sum_bound(k + 1, s + 3.0));
        }
    }

    #[test]
    fn sum_bound_covers_reordering() {
        // Summing the same terms forwards and backwards stays within the bound.
        let t: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let f: f32 = t.iter().sum();
        let b: f32 = t.iter().rev().sum();
        let abs: f64 = t.iter().map(|x| x.abs() as f64).sum();
        assert!(((f - b) as f64).abs() <= two_order_sum_bound(t.len(), abs));
    }

    use crate::attention::{attention_backward, attention_forward, AttnShape};
    use crate::gradcheck::test_values;
    use crate::SeqLayout;

    /// One f32 evaluation in the device kernels' organisation: scores as sequential dots,
    /// online softmax over tiles of `tile` keys (running max, rescaled sum and output), the
    /// output divided at the end, lse = m + ln(l); backward recomputing p from lse with
    /// delta = rowsum(dout∘out), dk/dv summed over the group's heads. Used to check that the
    /// derived bounds cover such an evaluation against the reference. With `sums =
    /// Bf16x3Mma` every product of a dot or weighted sum is the f32 sum of the six leading
    /// part products of the operands' three-part BF16 splits ([`split3`]; each part product is
    /// exact in f32), as the tensor-core kernels form them (delta stays a plain f32 dot).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn online_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        layout: &SeqLayout,
        s: AttnShape,
        tile: usize,
        sums: AttnSums,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (hq, hkv, d) = (s.q_heads, s.kv_heads, s.head_dim);
        let g = hq / hkv;
        let (qs, kvs) = (hq * d, hkv * d);
        let n = layout.num_tokens();
        let sc = s.scale();
        // acc + x·y: one f32 product and sum, or the six part products added in the kernels'
        // order (lo·hi, mid·mid, hi·lo, mid·hi, hi·mid, hi·hi).
        let fma = |acc: f32, x: f32, y: f32| match sums {
            AttnSums::F32 => acc + x * y,
            AttnSums::Bf16x3Mma => {
                let (a, b) = (split3(x), split3(y));
                [(2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)]
                    .iter()
                    .fold(acc, |t, &(i, j)| t + a[i] * b[j])
            }
        };
        let dotf =
            |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f32, |acc, (x, y)| fma(acc, *x, *y));
        let dot32 = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0.0f32, |acc, (x, y)| acc + x * y);
        let mut out = vec![0.0f32; n * qs];
        let mut lse = vec![0.0f32; n * hq];
        for b in 0..layout.num_seqs() {
            let t0 = layout.offset(b);
            for h in 0..hq {
                let kh = h / g;
                for i in 0..layout.len(b) {
                    let qo = (t0 + i) * qs + h * d;
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                    let mut o = vec![0.0f32; d];
                    for kt in (0..=i).step_by(tile) {
                        let jn = tile.min(i + 1 - kt);
                        let sv: Vec<f32> = (0..jn)
                            .map(|jj| {
                                let ko = (t0 + kt + jj) * kvs + kh * d;
                                dotf(&q[qo..qo + d], &k[ko..ko + d]) * sc
                            })
                            .collect();
                        let mn = sv.iter().cloned().fold(m, f32::max);
                        let p: Vec<f32> = sv.iter().map(|x| (x - mn).exp()).collect();
                        let alpha = (m - mn).exp();
                        l = l * alpha + p.iter().rev().sum::<f32>();
                        for (c, oc) in o.iter_mut().enumerate() {
                            let mut a = *oc * alpha;
                            for (jj, pj) in p.iter().enumerate() {
                                a = fma(a, *pj, v[(t0 + kt + jj) * kvs + kh * d + c]);
                            }
                            *oc = a;
                        }
                        m = mn;
                    }
                    for c in 0..d {
                        out[qo + c] = o[c] / l;
                    }
                    lse[(t0 + i) * hq + h] = m + l.ln();
                }
            }
        }
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f32; n * qs],
            vec![0.0f32; n * kvs],
            vec![0.0f32; n * kvs],
        );
        for b in 0..layout.num_seqs() {
            let (t0, tl) = (layout.offset(b), layout.len(b));
            for kh in 0..hkv {
                for j in 0..tl {
                    let ko = (t0 + j) * kvs + kh * d;
                    let (mut ak, mut av) = (vec![0.0f32; d], vec![0.0f32; d]);
                    for h in kh * g..(kh + 1) * g {
                        for i in j..tl {
                            let qo = (t0 + i) * qs + h * d;
                            let r = (t0 + i) * hq + h;
                            let delta = dot32(&dout[qo..qo + d], &out[qo..qo + d]);
                            let sij = dotf(&q[qo..qo + d], &k[ko..ko + d]) * sc;
                            let p = (sij - lse[r]).exp();
                            let ds = p * (dotf(&dout[qo..qo + d], &v[ko..ko + d]) - delta);
                            for c in 0..d {
                                av[c] = fma(av[c], p, dout[qo + c]);
                                ak[c] = fma(ak[c], ds, q[qo + c]);
                                dq[qo + c] = fma(dq[qo + c], ds, k[ko + c]);
                            }
                        }
                    }
                    for c in 0..d {
                        dk[ko + c] = ak[c] * sc;
                        dv[ko + c] = av[c];
                    }
                }
            }
        }
        for x in dq.iter_mut() {
            *x *= sc;
        }
        (out, lse, dq, dk, dv)
    }

    /// `x = hi + mid + lo` with `hi = bf16(x)`, `mid = bf16(x − hi)`, `lo = bf16(x − hi − mid)`
    /// (common.cuh's `split_bf16x3`).
    fn split3(x: f32) -> [f32; 3] {
        let hi = crate::precision::round_bf16(x);
        let mid = crate::precision::round_bf16(x - hi);
        [hi, mid, crate::precision::round_bf16(x - hi - mid)]
    }

    #[test]
    fn bf16x3_split_is_exact_on_normal_values() {
        // Every exponent from 2^-110 to 2^126 and a spread of significands. (From
        // 2^128·(1 − 2⁻⁹) on, hi rounds to infinity: f32::MAX is not split.)
        let [hi, _, _] = split3(f32::MAX);
        assert_eq!(hi, f32::INFINITY);
        let mut r = 0x9e37_79b9u32;
        for e in -110i32..=126 {
            for _ in 0..64 {
                r ^= r << 13;
                r ^= r >> 17;
                r ^= r << 5;
                let m = 1.0 + (r >> 9) as f32 / (1u32 << 23) as f32;
                for x in [m * 2f32.powi(e), -m * 2f32.powi(e)] {
                    let [a, b, c] = split3(x);
                    assert_eq!(a as f64 + b as f64 + c as f64, x as f64, "x = {x:e}");
                }
            }
        }
    }

    #[test]
    fn attention_bounds_cover_a_bf16x3_split_evaluation() {
        // The tensor-core kernels' products (six part products) in the online organisation,
        // against the reference, within the Bf16x3Mma bounds.
        attention_bounds_case(AttnSums::Bf16x3Mma);
    }

    #[test]
    fn attention_bounds_cover_an_online_softmax_evaluation() {
        attention_bounds_case(AttnSums::F32);
    }

    fn attention_bounds_case(sums: AttnSums) {
        // The largest bound / largest value the bounds may reach and still catch an error of
        // the values' order: 1e-2 for f32; the Bf16x3Mma sums count six part products per term,
        // each step re-truncating the accumulator (2·γ_{18n} against γ_n), and with scores up
        // to 64 in magnitude (case 1) reach a fifth of the values: 1/4.
        let informative = match sums {
            AttnSums::F32 => 1e-2,
            AttnSums::Bf16x3Mma => 0.25,
        };
        let cases = [
            (
                vec![1usize, 40, 0, 70],
                AttnShape {
                    q_heads: 4,
                    kv_heads: 2,
                    head_dim: 16,
                },
            ),
            (
                vec![33, 5],
                AttnShape {
                    q_heads: 2,
                    kv_heads: 1,
                    head_dim: 64,
                },
            ),
        ];
        for (case, (lens, s)) in cases.into_iter().enumerate() {
            let layout = SeqLayout::new(&lens);
            let n = layout.num_tokens();
            let (qd, kd) = (n * s.q_heads * s.head_dim, n * s.kv_heads * s.head_dim);
            // Large scores (|q|, |k| up to 2.5) so that the exponent terms matter.
            let q = test_values(qd, 50 + case as u64, 2.5);
            let k = test_values(kd, 60 + case as u64, 2.5);
            let v = test_values(kd, 70 + case as u64, 1.0);
            let dout = test_values(qd, 80 + case as u64, 1.0);
            let mut out = vec![0.0; qd];
            let probs = attention_forward(&q, &k, &v, &layout, s, &mut out);
            let (mut dq, mut dk, mut dv) = (vec![0.0; qd], vec![0.0; kd], vec![0.0; kd]);
            attention_backward(
                &dout, &q, &k, &v, &probs, &layout, s, &mut dq, &mut dk, &mut dv,
            );
            let (o2, lse2, dq2, dk2, dv2) =
                online_attention(&q, &k, &v, &dout, &layout, s, 32, sums);
            let (bo, lse_exact, blse) = attention_forward_bounds(&q, &k, &v, &layout, s, 32, sums);
            let f = violations(&o2, &out, |i| bo[i]);
            assert!(f.is_empty(), "case {case} out {f:#?}");
            let le: Vec<f32> = lse_exact.iter().map(|&x| x as f32).collect();
            let f = violations(&lse2, &le, |i| {
                blse[i] + lse_exact[i].abs() * crate::F32_UNIT_ROUNDOFF
            });
            assert!(f.is_empty(), "case {case} lse {f:#?}");
            let (bq, bk, bv) = attention_backward_bounds(&dout, &q, &k, &v, &layout, s, 32, sums);
            for (name, got, want, b) in [
                ("dq", &dq2, &dq, &bq),
                ("dk", &dk2, &dk, &bk),
                ("dv", &dv2, &dv, &bv),
            ] {
                let f = violations(got, want, |i| b[i]);
                assert!(f.is_empty(), "case {case} {name} {f:#?}");
                // The bound is informative: far below the values' own scale (worst-case analysis
                // with scores up to 64 in magnitude: the bound sits ~10³ above the observed
                // difference, still two orders below the values, so an indexing or formula
                // error of the order of the values cannot pass).
                let scale: f64 = want.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
                let worst = b.iter().cloned().fold(0.0, f64::max);
                let diff = got
                    .iter()
                    .zip(want.iter())
                    .map(|(a, c)| (a - c).abs() as f64)
                    .fold(0.0, f64::max);
                eprintln!("case {case} {name}: max diff {diff:e}, max bound {worst:e}, max |value| {scale:e}");
                assert!(
                    worst < informative * scale,
                    "case {case} {name}: bound {worst:e} vs values {scale:e}"
                );
            }
            let worst = bo.iter().cloned().fold(0.0, f64::max);
            let scale: f64 = out.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
            let diff = o2
                .iter()
                .zip(&out)
                .map(|(a, c)| (a - c).abs() as f64)
                .fold(0.0, f64::max);
            eprintln!(
                "case {case} out: max diff {diff:e}, max bound {worst:e}, max |value| {scale:e}"
            );
            assert!(
                worst < informative * scale,
                "case {case}: forward bound {worst:e} vs values {scale:e}"
            );
        }
    }

    #[test]
    fn rmsnorm_bounds_cover_reversed_sums() {
        use crate::norm::{rmsnorm_backward, rmsnorm_forward};
        let (n, d, eps) = (5, 300, 1e-6f32);
        let x = test_values(n * d, 90, 3.0);
        let w = test_values(d, 91, 1.5);
        let dy = test_values(n * d, 92, 1.0);
        let (mut y, mut rs) = (vec![0.0; n * d], vec![0.0; n]);
        rmsnorm_forward(&x, &w, n, d, eps, &mut y, &mut rs);
        let (mut dx, mut dw) = (vec![0.0; n * d], vec![0.0; d]);
        rmsnorm_backward(&dy, &x, &w, &rs, n, d, &mut dx, &mut dw);
        let b = rmsnorm_dx_bounds(&dy, &x, &w, &rs, n, d);
        for r in 0..n {
            let xr = &x[r * d..(r + 1) * d];
            let ss: f32 = xr.iter().rev().fold(0.0, |a, v| a + v * v);
            let r2 = 1.0 / (ss / d as f32 + eps).sqrt();
            assert!(((r2 - rs[r]).abs() as f64) <= rmsnorm_rstd_rel(d) * rs[r] as f64 * 1.01);
            let dot: f32 = (0..d)
                .rev()
                .fold(0.0, |a, j| a + w[j] * dy[r * d + j] * xr[j]);
            let c = dot * rs[r] * rs[r] * rs[r] / d as f32;
            for j in 0..d {
                let got = rs[r] * w[j] * dy[r * d + j] - xr[j] * c;
                let want = dx[r * d + j];
                assert!(
                    ((got - want).abs() as f64) <= b[r * d + j],
                    "[{r}, {j}] {got} vs {want}"
                );
            }
        }
    }
    #[test]
    fn tracked_bound_covers_a_perturbed_exp() {
        // A device whose exp is off by one ulp stays within the swiglu bound of a correct one.
        for &(g, up) in &[
            (0.3f32, 1.5f32),
            (-1.278, 2.0),
            (5.0, -0.7),
            (-20.0, 3.0),
            (40.0, 1.0),
        ] {
            let e = (-g).exp();
            let e_bad = f32::from_bits(e.to_bits() + 1);
            let h = g / (1.0 + e) * up;
            let h_bad = g / (1.0 + e_bad) * up;
            let b = swiglu_forward_bound(g, up, 1, 1);
            assert!(
                ((h - h_bad) as f64).abs() <= b,
                "g={g}: {h} vs {h_bad}, bound {b:e}"
            );
            assert!(
                b <= 1e-5 * (h as f64).abs() + 1e-30,
                "g={g}: bound {b:e} is loose"
            );
        }
    }

    #[test]
    fn softmax_bound_covers_a_perturbed_exp() {
        let x = [0.5f32, -1.0, 2.0, 0.0, 1.25];
        let mx = 2.0f32;
        let e: Vec<f32> = x.iter().map(|v| (v - mx).exp()).collect();
        let mut e_bad = e.clone();
        e_bad[1] = f32::from_bits(e[1].to_bits() - 1);
        let s: f32 = e.iter().sum();
        let s_bad: f32 = e_bad.iter().rev().sum();
        for i in 0..x.len() {
            let (p, pb) = (e[i] / s, e_bad[i] / s_bad);
            let b = softmax_prob_bound(p, x.len(), 1, 1);
            assert!(
                ((p - pb) as f64).abs() <= b,
                "[{i}] {p} vs {pb}, bound {b:e}"
            );
        }
    }
    /// A device whose exp is one ulp off (either way) on every call stays within the SwiGLU
    /// forward and backward bounds of a correct one, over a sweep that includes the
    /// cancellation of `1 + g·(1 − s)` near `g ≈ −1.28`.
    #[test]
    fn swiglu_bounds_cover_an_exp_one_ulp_off() {
        let gs = crate::gradcheck::test_values(20_000, 11, 30.0);
        let ups = crate::gradcheck::test_values(20_000, 12, 3.0);
        let dhs = crate::gradcheck::test_values(20_000, 13, 2.0);
        let near = crate::gradcheck::test_values(2_000, 14, 0.01);
        let cases = gs
            .iter()
            .zip(&ups)
            .zip(&dhs)
            .map(|((&g, &u), &d)| (g, u, d))
            .chain(near.iter().map(|&x| (-1.278_464_5 + x, 1.5, -0.75)));
        for (g, up, dh) in cases {
            for bump in [-1i32, 1] {
                let exp_bad = |x: f32| f32::from_bits((x.exp().to_bits() as i32 + bump) as u32);
                let fwd = |e: f32| g / (1.0 + e) * up;
                let bwd = |e: f32| {
                    let s = 1.0 / (1.0 + e);
                    (dh * up * (s * (1.0 + g * (1.0 - s))), dh * (g * s))
                };
                let (e, eb) = ((-g).exp(), exp_bad(-g));
                let b = swiglu_forward_bound(g, up, 1, 1);
                let (h, hb) = (fwd(e), fwd(eb));
                assert!(
                    ((h - hb) as f64).abs() <= b,
                    "g={g} up={up}: {h:e} vs {hb:e}, {b:e}"
                );
                let (bg, bu) = swiglu_backward_bounds(dh, g, up, 1, 1);
                let ((dg, du), (dgb, dub)) = (bwd(e), bwd(eb));
                assert!(
                    ((dg - dgb) as f64).abs() <= bg,
                    "g={g}: dgate {dg:e} vs {dgb:e}, {bg:e}"
                );
                assert!(
                    ((du - dub) as f64).abs() <= bu,
                    "g={g}: dup {du:e} vs {dub:e}, {bu:e}"
                );
            }
        }
    }
    /// A softmax whose exps are each one ulp off (pseudo-random direction) and whose sums run
    /// in reverse order stays within the probability and normalized-weight bounds.
    #[test]
    fn softmax_and_topk_bounds_cover_perturbed_exps_and_order() {
        let (n, c, k) = (200, 64, 8);
        let x = crate::gradcheck::test_values(n * c, 21, 6.0);
        let dir = crate::gradcheck::test_values(n * c, 22, 1.0);
        for r in 0..n {
            let xr = &x[r * c..(r + 1) * c];
            let mx = xr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = xr.iter().map(|v| (v - mx).exp()).collect();
            let eb: Vec<f32> = e
                .iter()
                .zip(&dir[r * c..(r + 1) * c])
                .map(|(v, d)| {
                    f32::from_bits(if *d < 0.0 {
                        v.to_bits() - 1
                    } else {
                        v.to_bits() + 1
                    })
                })
                .collect();
            let s: f32 = e.iter().sum();
            let sb: f32 = eb.iter().rev().sum();
            let p: Vec<f32> = e.iter().map(|v| v / s).collect();
            let pb: Vec<f32> = eb.iter().map(|v| v / sb).collect();
            for j in 0..c {
                let b = softmax_prob_bound(p[j], c, 1, 1);
                assert!(((p[j] - pb[j]) as f64).abs() <= b, "row {r} [{j}]");
            }
            // the first k columns stand for the selected experts
            let sel: f32 = p[..k].iter().sum();
            let selb: f32 = pb[..k].iter().rev().sum();
            for j in 0..k {
                let (w, wb) = (p[j] / sel, pb[j] / selb);
                let b = topk_norm_weight_bound(w, k, c, 1, 1);
                assert!(
                    ((w - wb) as f64).abs() <= b,
                    "row {r} slot {j}: {w:e} vs {wb:e}"
                );
            }
        }
    }

    #[test]
    fn f64_sum_bound_covers_reordering_of_squares() {
        let t: Vec<f64> = (0..5000)
            .map(|i| {
                let x = ((i * 7919) % 5000) as f32 * 1.37e-3 - 3.1;
                (x as f64) * (x as f64)
            })
            .collect();
        let f: f64 = t.iter().sum();
        let b: f64 = t.iter().rev().sum();
        let pair: f64 = t.chunks(2).map(|c| c.iter().sum::<f64>()).sum();
        let abs: f64 = t.iter().sum();
        assert!((f - b).abs() <= two_order_sum_bound_f64(t.len(), abs));
        assert!((f - pair).abs() <= two_order_sum_bound_f64(t.len(), abs));
        assert!(two_order_sum_bound_f64(t.len(), abs) < 1e-9 * abs);
    }

    #[test]
    fn lse_bound_covers_chunked_and_plain_evaluations() {
        // A row summed plainly and by chunks with rescaling (online softmax) stays in bound.
        let y: Vec<f32> = (0..3001)
            .map(|i| ((i * 104_729) % 3001) as f32 * 0.01 - 15.0)
            .collect();
        let m = y.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let s: f32 = y.iter().map(|&x| (x - m).exp()).sum();
        let plain = m + s.ln();
        let (mut mm, mut ss) = (f32::NEG_INFINITY, 0.0f32);
        for c in y.chunks(256) {
            let mc = c.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let sc: f32 = c.iter().map(|&x| (x - mc).exp()).sum();
            let m1 = mm.max(mc);
            ss = if mm == f32::NEG_INFINITY {
                0.0
            } else {
                (mm - m1).exp() * ss
            } + (mc - m1).exp() * sc;
            mm = m1;
        }
        let chunked = mm + ss.ln();
        let q: f64 = y
            .iter()
            .map(|&x| ((x - m) as f64).exp() * (m - x) as f64)
            .sum::<f64>()
            / s as f64;
        let b = lse_bound(y.len(), 12, 0.0, q, (s as f64).ln(), plain as f64);
        assert!(
            ((plain - chunked) as f64).abs() <= b,
            "{plain} vs {chunked}, bound {b}"
        );
        assert!(
            b < 1e-3,
            "the bound is tight enough to catch a wrong term: {b}"
        );
        // A wrong normaliser (one term of exp(0) = 1 missing out of s) is caught.
        let wrong = m + (s - 1.0).ln();
        assert!(((plain - wrong) as f64).abs() > b);
    }

    #[test]
    fn binomial_bound_grows_with_variance_and_shrinks_with_samples() {
        let a = binomial_two_sample_bound(0.5, 1000, 1000, 6.0);
        let b = binomial_two_sample_bound(0.5, 100_000, 100_000, 6.0);
        assert!(a > b && b > 0.0);
        assert!(binomial_two_sample_bound(0.0, 1000, 1000, 6.0) < a);
    }
}
