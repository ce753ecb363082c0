//! Causal scaled-dot-product attention with grouped-query heads (GQA).
//!
//! Shapes: `q: [N, Hq·D]`, `k, v: [N, Hkv·D]` (packed by a [`SeqLayout`]), query head `h` reads
//! key/value head `h / (Hq / Hkv)` (HF `repeat_kv`). Scores `s_ij = fl(q_i·k_j)·scale` for
//! `j ≤ i` inside one sequence, softmax over `j` (max-subtracted, f32 sum), output
//! `o_i = Σ_j p_ij·v_j`. All accumulation in f32; each row is computed by one function,
//! [`attend_row`], shared by prefill and decode so that both give the same bits for the same
//! inputs.

pub use crate::gemm::dot;
use crate::SeqLayout;

/// Head geometry of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads `Hq`.
    pub q_heads: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub kv_heads: usize,
    /// Head width `D`.
    pub head_dim: usize,
}

impl AttnShape {
    fn group(&self) -> usize {
        assert!(
            self.kv_heads > 0 && (self.q_heads / self.kv_heads) * self.kv_heads == self.q_heads,
            "GQA: {} query heads not a multiple of {} kv heads",
            self.q_heads,
            self.kv_heads
        );
        self.q_heads / self.kv_heads
    }
    /// `1/√D`, the HF default scaling.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Attention of one query row against `len` keys/values read with a row stride.
///
/// `q: [D]`; key `j` is `keys[j·stride .. j·stride + D]`, likewise values. Writes the softmax
/// probabilities to `probs[..len]` and the output to `out: [D]`.
#[allow(clippy::too_many_arguments)]
pub fn attend_row(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    len: usize,
    scale: f32,
    probs: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    let mut mx = f32::NEG_INFINITY;
    for j in 0..len {
        let kj = &keys[j * stride..j * stride + d];
        let s = dot(q, kj) * scale;
        probs[j] = s;
        mx = mx.max(s);
    }
    let mut sum = 0.0f32;
    for p in probs[..len].iter_mut() {
        *p = (*p - mx).exp();
        sum += *p;
    }
    let inv = 1.0 / sum;
    for p in probs[..len].iter_mut() {
        *p *= inv;
    }
    out.fill(0.0);
    for j in 0..len {
        let vj = &values[j * stride..j * stride + d];
        let p = probs[j];
        for (o, &x) in out.iter_mut().zip(vj) {
            *o += p * x;
        }
    }
}

/// Probabilities saved by [`attention_forward`] for the backward pass: for each sequence `b`
/// and query head `h`, a `[T_b, T_b]` row-major block (upper triangle zero).
#[derive(Clone, Debug, Default)]
pub struct AttnProbs {
    data: Vec<f32>,
    offsets: Vec<usize>,
}

impl AttnProbs {
    /// Bytes held (probabilities and block offsets).
    pub fn nbytes(&self) -> usize {
        4 * self.data.len() + std::mem::size_of::<usize>() * self.offsets.len()
    }
}

/// Causal GQA attention forward over a packed batch (prefill from position 0).
///
/// `q: [N, Hq·D]`, `k, v: [N, Hkv·D]` → `out: [N, Hq·D]`, plus the probabilities for backward.
/// Cost `O(Σ_b T_b²·Hq·D)`; f32 accumulation.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: &SeqLayout,
    shape: AttnShape,
    out: &mut [f32],
) -> AttnProbs {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group();
    let n = layout.num_tokens();
    assert_eq!(q.len(), n * hq * d);
    assert_eq!(k.len(), n * hkv * d);
    assert_eq!(v.len(), n * hkv * d);
    assert_eq!(out.len(), n * hq * d);
    let mut offsets = Vec::with_capacity(layout.num_seqs());
    let mut total = 0;
    for b in 0..layout.num_seqs() {
        offsets.push(total);
        total += hq * layout.len(b) * layout.len(b);
    }
    let mut probs = vec![0.0f32; total];
    let scale = shape.scale();
    let (qs, kvs) = (hq * d, hkv * d);
    for (b, &poff) in offsets.iter().enumerate() {
        let (t0, tl) = (layout.offset(b), layout.len(b));
        if tl == 0 {
            // An empty sequence has no rows; its offset may be the end of the batch.
            continue;
        }
        for h in 0..hq {
            let kh = h / g;
            let keys = &k[t0 * kvs + kh * d..];
            let vals = &v[t0 * kvs + kh * d..];
            for i in 0..tl {
                let row = poff + (h * tl + i) * tl;
                let o = (t0 + i) * qs + h * d;
                attend_row(
                    &q[o..o + d],
                    keys,
                    vals,
                    kvs,
                    i + 1,
                    scale,
                    &mut probs[row..row + tl],
                    &mut out[o..o + d],
                );
            }
        }
    }
    AttnProbs {
        data: probs,
        offsets,
    }
}

/// Causal GQA attention backward. Overwrites `dq: [N, Hq·D]`, `dk, dv: [N, Hkv·D]`.
///
/// With `P` the saved probabilities: `dP_ij = dO_i·v_j`, `dS_ij = P_ij·(dP_ij − Σ_j' P_ij'·dP_ij')`,
/// `dq_i = scale·Σ_j dS_ij·k_j`, `dk_j = scale·Σ_i dS_ij·q_i`, `dv_j = Σ_i P_ij·dO_i` (query heads
/// of one group summed into their shared kv head). f32 accumulation.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &AttnProbs,
    layout: &SeqLayout,
    shape: AttnShape,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group();
    let scale = shape.scale();
    let (qs, kvs) = (hq * d, hkv * d);
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    let mut ds = Vec::new();
    for b in 0..layout.num_seqs() {
        let (t0, tl) = (layout.offset(b), layout.len(b));
        if tl == 0 {
            // An empty sequence has no rows; its offset may be the end of the batch.
            continue;
        }
        ds.resize(tl, 0.0f32);
        for h in 0..hq {
            let kh = h / g;
            for i in 0..tl {
                let p = &probs.data[probs.offsets[b] + (h * tl + i) * tl..][..i + 1];
                let qo = (t0 + i) * qs + h * d;
                let doi = &dout[qo..qo + d];
                let mut pdp = 0.0f32;
                for j in 0..=i {
                    let vo = (t0 + j) * kvs + kh * d;
                    let dp = dot(doi, &v[vo..vo + d]);
                    ds[j] = dp;
                    pdp += p[j] * dp;
                    // dv_j += P_ij · dO_i
                    let pj = p[j];
                    for (o, &x) in dv[vo..vo + d].iter_mut().zip(doi) {
                        *o += pj * x;
                    }
                }
                for j in 0..=i {
                    let s = p[j] * (ds[j] - pdp) * scale;
                    let ko = (t0 + j) * kvs + kh * d;
                    for (o, &x) in dq[qo..qo + d].iter_mut().zip(&k[ko..ko + d]) {
                        *o += s * x;
                    }
                    for (o, &x) in dk[ko..ko + d].iter_mut().zip(&q[qo..qo + d]) {
                        *o += s * x;
                    }
                }
            }
        }
    }
}

/// Single-token decode attention for one sequence: `q: [Hq·D]` of the newest token against a
/// KV cache `k_cache, v_cache: [len, Hkv·D]` that already holds the newest token's k/v.
/// Writes `out: [Hq·D]`; `scratch` must hold at least `len` floats. Same arithmetic as a row of
/// [`attention_forward`].
pub fn attention_decode(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    len: usize,
    shape: AttnShape,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let g = shape.group();
    let kvs = hkv * d;
    assert!(k_cache.len() >= len * kvs && v_cache.len() >= len * kvs);
    assert_eq!(q.len(), hq * d);
    for h in 0..hq {
        let kh = h / g;
        attend_row(
            &q[h * d..(h + 1) * d],
            &k_cache[kh * d..],
            &v_cache[kh * d..],
            kvs,
            len,
            shape.scale(),
            &mut scratch[..len],
            &mut out[h * d..(h + 1) * d],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_trailing_sequence_does_not_index_past_the_batch() {
        // A trailing empty sequence starts at row N; with two kv heads the head offset used to
        // slice beyond the keys.
        let shape = AttnShape {
            q_heads: 2,
            kv_heads: 2,
            head_dim: 4,
        };
        let layout = SeqLayout::new(&[3, 0]);
        let q = crate::gradcheck::test_values(3 * 8, 1, 1.0);
        let k = crate::gradcheck::test_values(3 * 8, 2, 1.0);
        let v = crate::gradcheck::test_values(3 * 8, 3, 1.0);
        let mut out = vec![0.0; 3 * 8];
        let probs = attention_forward(&q, &k, &v, &layout, shape, &mut out);
        let (mut dq, mut dk, mut dv) = (vec![0.0; 24], vec![0.0; 24], vec![0.0; 24]);
        attention_backward(
            &out, &q, &k, &v, &probs, &layout, shape, &mut dq, &mut dk, &mut dv,
        );
        let single = SeqLayout::new(&[3]);
        let mut out1 = vec![0.0; 3 * 8];
        attention_forward(&q, &k, &v, &single, shape, &mut out1);
        assert_eq!(out, out1);
    }
    use crate::gradcheck::{check, gamma, test_values, Eval};

    const SHAPE: AttnShape = AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 4,
    };

    fn run(q: &[f32], k: &[f32], v: &[f32], layout: &SeqLayout) -> Vec<f32> {
        let mut out = vec![0.0; q.len()];
        attention_forward(q, k, v, layout, SHAPE, &mut out);
        out
    }

    #[test]
    fn dot_matches_f64_reference_within_its_bound() {
        for n in [0usize, 1, 7, 8, 9, 16, 33, 128] {
            let a = test_values(n, 200 + n as u64, 2.0);
            let b = test_values(n, 300 + n as u64, 2.0);
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mag: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let got = dot(&a, &b) as f64;
            assert!(
                (got - exact).abs() <= gamma(n.div_ceil(8) + 3) * mag,
                "n = {n}"
            );
        }
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let layout = SeqLayout::new(&[3, 1, 4]);
        let n = layout.num_tokens();
        let (qd, kd) = (n * 16, n * 8);
        let q = test_values(qd, 21, 1.0);
        let k = test_values(kd, 22, 1.0);
        let v = test_values(kd, 23, 1.0);
        let r = test_values(qd, 24, 1.0);
        let mut out = vec![0.0; qd];
        let probs = attention_forward(&q, &k, &v, &layout, SHAPE, &mut out);
        let (mut dq, mut dk, mut dv) = (vec![0.0; qd], vec![0.0; kd], vec![0.0; kd]);
        attention_backward(
            &r, &q, &k, &v, &probs, &layout, SHAPE, &mut dq, &mut dk, &mut dv,
        );
        let eval = |o: Vec<f32>| Eval {
            value: o.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum(),
            magnitude: o
                .iter()
                .zip(&r)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum(),
        };
        // Longest chain: D-term dot, exp, T-term sum, divide, T-term weighted sum (T ≤ 4).
        let e = gamma(4 * (4 + 4 + 4));
        let mag = |g: &[f32]| {
            g.iter()
                .map(|x| 4.0 * x.abs() as f64 + 1e-6)
                .collect::<Vec<_>>()
        };
        let f = check(&q, &dq, &mag(&dq), e, None, |x| {
            eval(run(x, &k, &v, &layout))
        });
        assert!(f.is_empty(), "dq {f:#?}");
        let f = check(&k, &dk, &mag(&dk), e, None, |x| {
            eval(run(&q, x, &v, &layout))
        });
        assert!(f.is_empty(), "dk {f:#?}");
        let f = check(&v, &dv, &mag(&dv), e, None, |x| {
            eval(run(&q, &k, x, &layout))
        });
        assert!(f.is_empty(), "dv {f:#?}");
    }

    #[test]
    fn attention_is_causal_and_sequences_are_independent() {
        let layout = SeqLayout::new(&[3, 2]);
        let q = test_values(5 * 16, 31, 1.0);
        let k = test_values(5 * 8, 32, 1.0);
        let mut v = test_values(5 * 8, 33, 1.0);
        let a = run(&q, &k, &v, &layout);
        // change the last token of sequence 0 and the whole of sequence 1's value rows 4
        for c in 0..8 {
            v[2 * 8 + c] += 1.0;
        }
        let b = run(&q, &k, &v, &layout);
        assert_eq!(
            &a[..2 * 16],
            &b[..2 * 16],
            "earlier tokens saw a later value"
        );
        assert_ne!(&a[2 * 16..3 * 16], &b[2 * 16..3 * 16]);
        assert_eq!(&a[3 * 16..], &b[3 * 16..], "sequence 1 saw sequence 0");
    }

    #[test]
    fn decode_row_equals_prefill_row_bitwise() {
        let layout = SeqLayout::new(&[5]);
        let q = test_values(5 * 16, 41, 1.0);
        let k = test_values(5 * 8, 42, 1.0);
        let v = test_values(5 * 8, 43, 1.0);
        let full = run(&q, &k, &v, &layout);
        let mut scratch = vec![0.0; 5];
        for t in 0..5 {
            let mut out = vec![0.0; 16];
            attention_decode(
                &q[t * 16..(t + 1) * 16],
                &k[..(t + 1) * 8],
                &v[..(t + 1) * 8],
                t + 1,
                SHAPE,
                &mut scratch,
                &mut out,
            );
            assert_eq!(out, full[t * 16..(t + 1) * 16]);
        }
    }
}
