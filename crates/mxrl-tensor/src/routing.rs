//! Top-k softmax router (Qwen2/Qwen3-MoE), routing replay and the auxiliary load-balancing loss.
//!
//! Forward for `N` tokens, `E` experts, `k` slots: `probs = softmax(logits)` (f32), the `k`
//! largest probabilities in descending order (ties: lower expert id first) are the selected
//! experts, and their combine weights are `probs[sel]`, divided by their sum when
//! `norm_topk_prob` (f32 sum over the slots in order).

use crate::activation::{softmax_backward, softmax_forward};

/// Routing decisions of one MoE layer for `N` tokens: for token `t`, slot `s < k`, expert
/// `ids[t·k + s]` with combine weight `weights[t·k + s]`, in slot order (descending router
/// probability when freshly computed).
#[derive(Clone, Debug, PartialEq)]
pub struct Routes {
    /// Slots per token `k`.
    pub top_k: usize,
    /// Expert ids `[N, k]`.
    pub ids: Vec<u32>,
    /// Combine weights `[N, k]`.
    pub weights: Vec<f32>,
}

impl Routes {
    /// Number of tokens.
    pub fn num_tokens(&self) -> usize {
        self.ids.len() / self.top_k.max(1)
    }
}

/// How a router forward picks its experts.
#[derive(Clone, Copy, Debug)]
pub enum RouteMode<'a> {
    /// Select the top-k experts from the current probabilities.
    Compute,
    /// Replay expert ids `[N, k]` (in slot order); combine weights are recomputed from the
    /// current probabilities over the replayed ids, so the router still receives gradients.
    ReplayIds(&'a [u32]),
    /// Replay ids and combine weights verbatim (`[N, k]` each); the router receives no gradient
    /// through the combine weights (only through the auxiliary loss, if any).
    ReplayFull(&'a [u32], &'a [f32]),
}

/// What [`router_forward`] keeps for backward.
#[derive(Clone, Debug)]
pub struct RouterState {
    /// Softmax probabilities `[N, E]`.
    pub probs: Vec<f32>,
    /// Whether the combine weights were replayed verbatim (no gradient to the router through them).
    pub weights_frozen: bool,
}

/// Router forward: `logits: [N, E]` → routes and the saved probabilities.
///
/// # Panics
/// If a replayed id is out of range or a replay table has the wrong length (a caller bug: the
/// model validates replay input before calling this).
pub fn router_forward(
    logits: &[f32],
    n: usize,
    e: usize,
    k: usize,
    norm_topk_prob: bool,
    mode: RouteMode<'_>,
) -> (Routes, RouterState) {
    assert!(k >= 1 && k <= e, "top_k {k} must be in 1..={e}");
    assert_eq!(logits.len(), n * e);
    let mut probs = vec![0.0f32; n * e];
    softmax_forward(logits, n, e, &mut probs);
    let mut ids = vec![0u32; n * k];
    match mode {
        RouteMode::Compute => {
            let mut order: Vec<u32> = Vec::with_capacity(e);
            for t in 0..n {
                let p = &probs[t * e..(t + 1) * e];
                order.clear();
                order.extend(0..e as u32);
                // stable sort by descending probability keeps lower ids first among ties
                order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
                ids[t * k..(t + 1) * k].copy_from_slice(&order[..k]);
            }
        }
        RouteMode::ReplayIds(r) | RouteMode::ReplayFull(r, _) => {
            assert_eq!(
                r.len(),
                n * k,
                "replayed ids: {} entries, expected {n}×{k}",
                r.len()
            );
            assert!(
                r.iter().all(|&i| (i as usize) < e),
                "replayed id out of range"
            );
            ids.copy_from_slice(r);
        }
    }
    let weights = match mode {
        RouteMode::ReplayFull(_, w) => {
            assert_eq!(w.len(), n * k);
            w.to_vec()
        }
        _ => {
            let mut w = vec![0.0f32; n * k];
            for t in 0..n {
                let sel = &ids[t * k..(t + 1) * k];
                let wt = &mut w[t * k..(t + 1) * k];
                for s in 0..k {
                    wt[s] = probs[t * e + sel[s] as usize];
                }
                if norm_topk_prob {
                    let mut sum = 0.0f32;
                    for &x in wt.iter() {
                        sum += x;
                    }
                    for x in wt.iter_mut() {
                        *x /= sum;
                    }
                }
            }
            w
        }
    };
    let frozen = matches!(mode, RouteMode::ReplayFull(..));
    (
        Routes {
            top_k: k,
            ids,
            weights,
        },
        RouterState {
            probs,
            weights_frozen: frozen,
        },
    )
}

/// Router backward. `dweights: [N, k]` is ∂L/∂(combine weights); `dprobs_extra: [N, E]`, when
/// given, is added to ∂L/∂probs (the auxiliary loss). Overwrites `dlogits: [N, E]`.
///
/// With `S = Σ_s p_sel(s)`: normalized weights give `∂L/∂p_sel(s) = (dw_s − Σ_s' dw_s'·w_s') / S`,
/// unnormalized ones `∂L/∂p_sel(s) = dw_s`; then the softmax backward. Frozen (replayed)
/// weights contribute nothing. f32 accumulation.
#[allow(clippy::too_many_arguments)]
pub fn router_backward(
    dweights: &[f32],
    routes: &Routes,
    state: &RouterState,
    n: usize,
    e: usize,
    norm_topk_prob: bool,
    dprobs_extra: Option<&[f32]>,
    dlogits: &mut [f32],
) {
    let k = routes.top_k;
    assert_eq!(dweights.len(), n * k);
    assert_eq!(dlogits.len(), n * e);
    let mut dp = match dprobs_extra {
        Some(x) => {
            assert_eq!(x.len(), n * e);
            x.to_vec()
        }
        None => vec![0.0f32; n * e],
    };
    if !state.weights_frozen {
        for t in 0..n {
            let sel = &routes.ids[t * k..(t + 1) * k];
            let dw = &dweights[t * k..(t + 1) * k];
            if norm_topk_prob {
                let w = &routes.weights[t * k..(t + 1) * k];
                let mut s = 0.0f32;
                let mut dot = 0.0f32;
                for j in 0..k {
                    s += state.probs[t * e + sel[j] as usize];
                    dot += dw[j] * w[j];
                }
                for j in 0..k {
                    dp[t * e + sel[j] as usize] += (dw[j] - dot) / s;
                }
            } else {
                for j in 0..k {
                    dp[t * e + sel[j] as usize] += dw[j];
                }
            }
        }
    }
    softmax_backward(&dp, &state.probs, n, e, dlogits);
}

/// Auxiliary load-balancing loss over `L` MoE layers (HF `load_balancing_loss_func` without
/// padding mask): with `M = L·N` routed token-layers, `c_e` the number of slots that chose
/// expert `e` and `P_e = Σ probs[·, e] / M`,
/// `aux = E · Σ_e (c_e / M) · P_e`.
///
/// Returns the loss and, per layer, `∂aux/∂probs: [N, E]` (`= E·c_e / M²`, the same for every
/// token). `layers` holds `(probs [N, E], ids [N, k])` per layer.
pub fn load_balancing_loss(layers: &[(&[f32], &[u32])], e: usize) -> (f32, Vec<Vec<f32>>) {
    let mut counts = vec![0.0f64; e];
    let mut psum = vec![0.0f64; e];
    let mut m = 0usize;
    for (probs, ids) in layers {
        let n = probs.len() / e;
        m += n;
        for &i in ids.iter() {
            counts[i as usize] += 1.0;
        }
        for t in 0..n {
            for j in 0..e {
                psum[j] += probs[t * e + j] as f64;
            }
        }
    }
    if m == 0 {
        return (0.0, layers.iter().map(|_| Vec::new()).collect());
    }
    let mf = m as f64;
    let loss: f64 = (0..e)
        .map(|j| (counts[j] / mf) * (psum[j] / mf))
        .sum::<f64>()
        * e as f64;
    let g: Vec<f32> = (0..e)
        .map(|j| (e as f64 * counts[j] / (mf * mf)) as f32)
        .collect();
    let grads = layers
        .iter()
        .map(|(probs, _)| {
            let n = probs.len() / e;
            let mut d = Vec::with_capacity(n * e);
            for _ in 0..n {
                d.extend_from_slice(&g);
            }
            d
        })
        .collect();
    (loss as f32, grads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check, gamma, test_values, Eval};

    #[test]
    fn topk_picks_largest_in_descending_order_with_low_id_tie_break() {
        let logits = [0.0f32, 2.0, 1.0, 2.0, -1.0];
        let (r, _) = router_forward(&logits, 1, 5, 3, false, RouteMode::Compute);
        assert_eq!(r.ids, vec![1, 3, 2]);
        let (rn, _) = router_forward(&logits, 1, 5, 3, true, RouteMode::Compute);
        let s: f32 = rn.weights.iter().sum();
        assert!((s - 1.0).abs() <= gamma(6) as f32);
        assert_eq!(rn.weights[0], rn.weights[1]);
    }

    #[test]
    fn replayed_ids_reproduce_captured_routes_bitwise() {
        let (n, e, k) = (6, 8, 2);
        let logits = test_values(n * e, 71, 2.0);
        for norm in [false, true] {
            let (r, _) = router_forward(&logits, n, e, k, norm, RouteMode::Compute);
            let (r2, _) = router_forward(&logits, n, e, k, norm, RouteMode::ReplayIds(&r.ids));
            assert_eq!(r, r2);
            let (r3, _) = router_forward(
                &logits,
                n,
                e,
                k,
                norm,
                RouteMode::ReplayFull(&r.ids, &r.weights),
            );
            assert_eq!(r, r3);
        }
    }

    #[test]
    fn router_gradient_matches_finite_differences() {
        let (n, e, k) = (4, 6, 2);
        // well separated logits so that the selection does not flip under the FD step
        let mut logits = test_values(n * e, 81, 0.2);
        for t in 0..n {
            logits[t * e + (t % e)] += 3.0;
            logits[t * e + ((t + 2) % e)] += 1.5;
        }
        let rw = test_values(n * k, 82, 1.0);
        for norm in [false, true] {
            let (routes, st) = router_forward(&logits, n, e, k, norm, RouteMode::Compute);
            let mut dl = vec![0.0; n * e];
            router_backward(&rw, &routes, &st, n, e, norm, None, &mut dl);
            let gm: Vec<f64> = dl.iter().map(|v| 4.0 * v.abs() as f64 + 1e-7).collect();
            let f = check(&logits, &dl, &gm, gamma(4 * e), None, |x| {
                let (r2, _) = router_forward(x, n, e, k, norm, RouteMode::ReplayIds(&routes.ids));
                let value = r2
                    .weights
                    .iter()
                    .zip(&rw)
                    .map(|(a, b)| *a as f64 * *b as f64);
                let mag = r2
                    .weights
                    .iter()
                    .zip(&rw)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs());
                Eval {
                    value: value.sum(),
                    magnitude: mag.sum(),
                }
            });
            assert!(f.is_empty(), "norm={norm}: {f:#?}");
        }
    }

    #[test]
    fn aux_loss_value_and_gradient() {
        let (n, e, k) = (5, 4, 2);
        let l0 = test_values(n * e, 91, 2.0);
        let l1 = test_values(n * e, 92, 2.0);
        let (r0, s0) = router_forward(&l0, n, e, k, true, RouteMode::Compute);
        let (r1, s1) = router_forward(&l1, n, e, k, true, RouteMode::Compute);
        let (loss, grads) = load_balancing_loss(&[(&s0.probs, &r0.ids), (&s1.probs, &r1.ids)], e);
        // Independent evaluation of the definition: per-slot one-hot means (HF form).
        let m = 2.0 * n as f64;
        let mut want = 0.0;
        for j in 0..e {
            let mut frac = 0.0;
            let mut p = 0.0;
            for (s, r) in [(&s0, &r0), (&s1, &r1)] {
                frac += r.ids.iter().filter(|&&i| i as usize == j).count() as f64 / m;
                p += (0..n).map(|t| s.probs[t * e + j] as f64).sum::<f64>() / m;
            }
            want += frac * p;
        }
        want *= e as f64;
        assert!(
            (loss as f64 - want).abs() <= want * 1e-6,
            "{loss} vs {want}"
        );
        // gradient w.r.t. probs: perturb probs directly with the selection fixed
        let f = check(
            &s0.probs,
            &grads[0],
            &vec![1e-7; n * e],
            gamma(4 * n * e),
            None,
            |p| {
                let (l, _) = load_balancing_loss(&[(p, &r0.ids), (&s1.probs, &r1.ids)], e);
                Eval {
                    value: l as f64,
                    magnitude: l.abs() as f64,
                }
            },
        );
        assert!(f.is_empty(), "{f:#?}");
    }
}
