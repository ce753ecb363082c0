//! Top-k softmax router, routing replay, router backward and the auxiliary load-balancing loss
//! (kernels `kernels/ops_router.cu`).
//!
//! Shapes: `logits, probs, dlogits: [N, E]` f32, `ids: [N, k]` u32, `weights, dweights: [N, k]`
//! f32, `E ≤ 1024`, `1 ≤ k ≤ min(E, 256)`. One block per token; f32 arithmetic throughout,
//! f64 for the auxiliary loss's sums (as the reference).
//!
//! # Numerics against the reference (`mxrl_tensor::routing`)
//! - The small per-token reductions run in the reference's order (index order over `E`, slot
//!   order over `k`, from `0.0`), with f32 `+`/`·`/`÷` and no FMA contraction.
//! - `exp` is `(float)exp((double)x)`: within 1 ulp of the exact value (CUDA's f64 `exp` is
//!   within 1 ulp of f64, then one rounding), like the CPU reference's libm `expf` (0.502 ulp).
//!   So the probabilities usually agree bitwise and differ at most by
//!   `mxrl_tensor::tolerance::softmax_prob_bound`; normalized weights by
//!   `topk_norm_weight_bound`.
//! - The selection is exact on the device's probabilities: the `k` largest in descending
//!   order, ties by the lower expert id, compared as `f32::total_cmp` does (so it equals the
//!   reference's whenever the probabilities do; it can differ only between two experts whose
//!   probabilities are within the bound above).
//! - Non-finite logits: `−∞` (a masked expert) gives probability 0 on both devices; a NaN or
//!   `+∞` logit makes the row's probabilities NaN on both, but NaN sign bits are not portable
//!   (x86 propagates the input's, CUDA returns its canonical NaN), so the selection among NaNs
//!   may differ from the reference's.
//! - Backward, given equal inputs, is bitwise the reference's.
//! - Auxiliary loss: per-expert counts are exact; probability sums are f64 in a fixed order
//!   (deterministic), the loss within `mxrl_tensor::tolerance::aux_loss_bound`; its gradient
//!   is bitwise the reference's (times the coefficient in f32, as the model applies it).
#![allow(unsafe_code)]

use super::check_len;
use crate::gpu::Gpu;
use crate::DeviceError;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Kernel source of this family.
pub const SOURCE: &str = include_str!("../../kernels/ops_router.cu");

/// [`Router::forward_dispatch_small`]: at most this many experts (its per-warp shared rows)…
const ROUTE_SMALL_MAX_EXPERTS: usize = 128;
/// … and `N·k` entries (one per thread of its one block).
const ROUTE_SMALL_ENTRIES: usize = 1024;
/// Largest expert count the router kernels accept.
pub const MAX_EXPERTS: usize = 1024;
/// Largest `k` the router kernels accept (`ROUTER_MAX_TOP_K`).
pub const MAX_TOP_K: usize = 256;

/// How [`Router::forward`] picks its experts (the device form of
/// `mxrl_tensor::routing::RouteMode`).
#[derive(Clone, Copy)]
pub enum DeviceRouteMode<'v, 'a> {
    /// The top-k experts of the current probabilities.
    Compute,
    /// Replayed ids `[N, k]` (each `< E`, validated by the caller); weights from the current
    /// probabilities.
    ReplayIds(&'v CudaView<'a, u32>),
    /// Replayed ids and weights `[N, k]`, copied verbatim.
    ReplayFull(&'v CudaView<'a, u32>, &'v CudaView<'a, f32>),
}

/// The per-token gradient input of [`Router::backward`] beside `dweights`.
#[derive(Clone, Copy)]
pub enum ExtraDprobs<'v, 'a> {
    /// No extra gradient.
    None,
    /// One `[E]` row added to `∂L/∂probs` of every token (the auxiliary loss's gradient from
    /// [`Router::aux_finish`]).
    Broadcast(&'v CudaView<'a, f32>),
    /// A full `[N, E]` gradient.
    PerToken(&'v CudaView<'a, f32>),
}

/// The loaded kernels.
pub struct Router {
    gpu: Gpu,
    fwd_topk: CudaFunction,
    topk_dispatch_small: CudaFunction,
    fwd_replay_ids: CudaFunction,
    fwd_replay_full: CudaFunction,
    bwd: CudaFunction,
    aux_reset: CudaFunction,
    aux_accumulate: CudaFunction,
    aux_finish: CudaFunction,
}

fn row_cfg(n: usize, e: usize, smem_words: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (if e <= 128 { 128 } else { 256 }, 1, 1),
        shared_mem_bytes: (smem_words * 4) as u32,
    }
}

impl Router {
    /// Loads (compiling on first use) the module on `gpu`.
    ///
    /// # Errors
    /// NVRTC or module-load errors.
    pub fn new(gpu: &Gpu) -> Result<Self, DeviceError> {
        let m = gpu.module("ops_router", SOURCE)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|x| gpu.err(format!("kernel {n}: {x:?}")))
        };
        Ok(Router {
            gpu: gpu.clone(),
            fwd_topk: f("router_fwd_topk")?,
            topk_dispatch_small: f("router_topk_dispatch_small")?,
            fwd_replay_ids: f("router_fwd_replay_ids")?,
            fwd_replay_full: f("router_fwd_replay_full")?,
            bwd: f("router_bwd")?,
            aux_reset: f("router_aux_reset")?,
            aux_accumulate: f("router_aux_accumulate")?,
            aux_finish: f("router_aux_finish")?,
        })
    }

    fn check_shape(&self, what: &str, n: usize, e: usize, k: usize) -> Result<(), DeviceError> {
        if e == 0 || e > MAX_EXPERTS {
            return Err(self
                .gpu
                .err(format!("{what}: {e} experts; 1..={MAX_EXPERTS} supported")));
        }
        if k == 0 || k > e.min(MAX_TOP_K) {
            return Err(self.gpu.err(format!(
                "{what}: top_k {k}; 1..={} supported for {e} experts",
                e.min(MAX_TOP_K)
            )));
        }
        if n > i32::MAX as usize {
            return Err(self.gpu.err(format!("{what}: {n} tokens exceed 2³¹ − 1")));
        }
        Ok(())
    }

    /// Router forward: `logits: [N, E]` → `probs: [N, E]` (row softmax, kept for backward and
    /// the auxiliary loss), `ids: [N, k]` and `weights: [N, k]` per `mode` (module doc for the
    /// order and tie rule), weights divided by their slot-order sum when `norm_topk_prob`.
    /// Reference: `mxrl_tensor::routing::router_forward`.
    ///
    /// # Errors
    /// `E` outside `1..=1024`, `k` outside `1..=min(E, 256)`, short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        logits: &CudaView<'_, f32>,
        mode: DeviceRouteMode<'_, '_>,
        probs: &mut CudaViewMut<'_, f32>,
        ids: &mut CudaViewMut<'_, u32>,
        weights: &mut CudaViewMut<'_, f32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
    ) -> Result<(), DeviceError> {
        self.check_shape("router forward", n, e, k)?;
        check_len(&self.gpu, "router logits", logits.len(), n * e)?;
        check_len(&self.gpu, "router probs", probs.len(), n * e)?;
        check_len(&self.gpu, "router ids", ids.len(), n * k)?;
        check_len(&self.gpu, "router weights", weights.len(), n * k)?;
        if n == 0 {
            return Ok(());
        }
        let (e32, k32, norm) = (e as u32, k as u32, norm_topk_prob as i32);
        match mode {
            DeviceRouteMode::Compute => {
                let mut b = self.gpu.stream().launch_builder(&self.fwd_topk);
                b.arg(logits)
                    .arg(probs)
                    .arg(ids)
                    .arg(weights)
                    .arg(&e32)
                    .arg(&k32)
                    .arg(&norm);
                // SAFETY: block t < N reads logits row t, writes probs row t (N·E checked) and
                // ids/weights row t (N·k checked); shared memory: 2·E words dynamic (≤ 8 KiB) +
                // sel[256] (k ≤ 256 checked); types (const float*, float*, u32*, float*, u32,
                // u32, int).
                unsafe { crate::gpu::launch_op(&mut b, row_cfg(n, e, 2 * e)) }
                    .map_err(|x| self.gpu.err(x))?;
            }
            DeviceRouteMode::ReplayIds(ids_in) => {
                check_len(&self.gpu, "router replayed ids", ids_in.len(), n * k)?;
                let mut b = self.gpu.stream().launch_builder(&self.fwd_replay_ids);
                b.arg(logits)
                    .arg(probs)
                    .arg(ids_in)
                    .arg(ids)
                    .arg(weights)
                    .arg(&e32)
                    .arg(&k32)
                    .arg(&norm);
                // SAFETY: as Compute, plus ids_in row t (N·k checked); an id ≥ E is never used
                // as an index (weight NaN); types (const float*, float*, const u32*, u32*,
                // float*, u32, u32, int).
                unsafe { crate::gpu::launch_op(&mut b, row_cfg(n, e, e)) }
                    .map_err(|x| self.gpu.err(x))?;
            }
            DeviceRouteMode::ReplayFull(ids_in, w_in) => {
                check_len(&self.gpu, "router replayed ids", ids_in.len(), n * k)?;
                check_len(&self.gpu, "router replayed weights", w_in.len(), n * k)?;
                let mut b = self.gpu.stream().launch_builder(&self.fwd_replay_full);
                b.arg(logits)
                    .arg(probs)
                    .arg(ids_in)
                    .arg(w_in)
                    .arg(ids)
                    .arg(weights)
                    .arg(&e32)
                    .arg(&k32);
                // SAFETY: as ReplayIds, plus w_in row t (N·k checked); types (const float*,
                // float*, const u32*, const float*, u32*, float*, u32, u32).
                unsafe { crate::gpu::launch_op(&mut b, row_cfg(n, e, e)) }
                    .map_err(|x| self.gpu.err(x))?;
            }
        }
        Ok(())
    }

    /// Whether [`Router::forward_dispatch_small`] takes `n` tokens, `e` experts, top `k`.
    pub fn dispatch_small_fits(n: usize, e: usize, k: usize) -> bool {
        n >= 1 && k >= 1 && k <= e && e <= ROUTE_SMALL_MAX_EXPERTS && n * k <= ROUTE_SMALL_ENTRIES
    }

    /// Decode routing in one launch: [`Router::forward`] in `Compute` mode followed by the MoE
    /// dispatch ([`crate::ops::moe::Moe::dispatch`]: `offsets [E+1]`, `perm [N·k]`, `row_of
    /// [N·k]`), with the bits of those two, for `N·k ≤ 1024` and `E ≤ 128`
    /// ([`Router::dispatch_small_fits`]); one block, so only for decode-sized batches.
    ///
    /// # Errors
    /// A shape [`Router::dispatch_small_fits`] refuses, short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_dispatch_small(
        &self,
        logits: &CudaView<'_, f32>,
        probs: &mut CudaViewMut<'_, f32>,
        ids: &mut CudaViewMut<'_, u32>,
        weights: &mut CudaViewMut<'_, f32>,
        offsets: &mut CudaViewMut<'_, u32>,
        perm: &mut CudaViewMut<'_, u32>,
        row_of: &mut CudaViewMut<'_, u32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
    ) -> Result<(), DeviceError> {
        let what = "router forward + dispatch";
        self.check_shape(what, n, e, k)?;
        if !Self::dispatch_small_fits(n, e, k) {
            return Err(self.gpu.err(format!(
                "{what}: {n} tokens × top {k} of {e} experts; one block takes N·k ≤ \
                 {ROUTE_SMALL_ENTRIES} and E ≤ {ROUTE_SMALL_MAX_EXPERTS}"
            )));
        }
        let g = &self.gpu;
        check_len(g, "router logits", logits.len(), n * e)?;
        check_len(g, "router probs", probs.len(), n * e)?;
        check_len(g, "router ids", ids.len(), n * k)?;
        check_len(g, "router weights", weights.len(), n * k)?;
        check_len(g, "dispatch offsets", offsets.len(), e + 1)?;
        check_len(g, "dispatch perm", perm.len(), n * k)?;
        check_len(g, "dispatch row_of", row_of.len(), n * k)?;
        let (n32, e32, k32, norm) = (n as u32, e as u32, k as u32, norm_topk_prob as i32);
        let mut b = g.stream().launch_builder(&self.topk_dispatch_small);
        b.arg(logits).arg(probs).arg(ids).arg(weights);
        b.arg(&n32).arg(&e32).arg(&k32).arg(&norm);
        b.arg(offsets).arg(perm).arg(row_of);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (ROUTE_SMALL_ENTRIES as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block of 1024 threads; warps < 16 read logits rows t < N and write probs
        // rows (N·E checked) and ids/weights rows (N·k checked), with per-warp static shared
        // rows of E ≤ 128 entries (checked); then thread i < N·k ≤ 1024 reads ids[i], writes
        // row_of[i] and perm[pos] with pos < offsets[E] ≤ N·k, offsets[0..=E] (E + 1 checked);
        // types (const float*, float*, u32*, float*, u32, u32, u32, int, u32*, u32*, u32*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| g.err(x))?;
        Ok(())
    }

    /// Router backward: overwrites `dlogits: [N, E]` with the gradient through the softmax of
    /// `∂L/∂probs = extra + (through the combine weights unless dweights is None)`:
    /// with `S = Σ_s probs[id_s]` and `D = Σ_s dweights_s·weights_s`, normalized weights give
    /// `(dw_s − D)/S` at `id_s`, unnormalized ones `dw_s`; then
    /// `dlogits = p ⊙ (dp − Σ_j p_j·dp_j)`. Pass `dweights = None` for replayed (frozen)
    /// weights. f32 accumulation in the reference's order: bitwise equal to
    /// `mxrl_tensor::routing::router_backward` given equal inputs (`Broadcast(g)` stands for
    /// the reference's `[N, E]` with `g` in every row).
    ///
    /// # Errors
    /// Shape limits as [`Router::forward`]; short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        probs: &CudaView<'_, f32>,
        ids: &CudaView<'_, u32>,
        weights: &CudaView<'_, f32>,
        dweights: Option<&CudaView<'_, f32>>,
        extra: ExtraDprobs<'_, '_>,
        dlogits: &mut CudaViewMut<'_, f32>,
        n: usize,
        e: usize,
        k: usize,
        norm_topk_prob: bool,
    ) -> Result<(), DeviceError> {
        self.check_shape("router backward", n, e, k)?;
        check_len(&self.gpu, "router backward probs", probs.len(), n * e)?;
        check_len(&self.gpu, "router backward ids", ids.len(), n * k)?;
        check_len(&self.gpu, "router backward weights", weights.len(), n * k)?;
        check_len(&self.gpu, "router backward dlogits", dlogits.len(), n * e)?;
        if let Some(dw) = dweights {
            check_len(&self.gpu, "router backward dweights", dw.len(), n * k)?;
        }
        let (extra_view, stride, has_extra) = match extra {
            ExtraDprobs::None => (probs, 0u64, 0i32),
            ExtraDprobs::Broadcast(g) => {
                check_len(&self.gpu, "router backward extra (broadcast)", g.len(), e)?;
                (g, 0, 1)
            }
            ExtraDprobs::PerToken(g) => {
                check_len(
                    &self.gpu,
                    "router backward extra (per token)",
                    g.len(),
                    n * e,
                )?;
                (g, e as u64, 1)
            }
        };
        if n == 0 {
            return Ok(());
        }
        // An absent dweights is never read (has_dw = 0); pass weights in its place.
        let (dw_view, has_dw) = match dweights {
            Some(d) => (d, 1i32),
            None => (weights, 0i32),
        };
        let (e32, k32, norm) = (e as u32, k as u32, norm_topk_prob as i32);
        let mut b = self.gpu.stream().launch_builder(&self.bwd);
        b.arg(probs)
            .arg(ids)
            .arg(weights)
            .arg(dw_view)
            .arg(extra_view)
            .arg(&stride)
            .arg(dlogits)
            .arg(&e32)
            .arg(&k32)
            .arg(&norm)
            .arg(&has_dw)
            .arg(&has_extra);
        // SAFETY: block t < N reads probs row t (N·E checked), ids/weights/dweights row t (N·k
        // checked; dweights only when present), extra row t·stride (stride 0: E checked, stride
        // E: N·E checked; read only when present) and writes dlogits row t (N·E checked); ids
        // ≥ E are skipped; dynamic shared memory 2·E floats; types (const float*, const u32*,
        // const float* ×3, u64, float*, u32, u32, int, int, int).
        unsafe { crate::gpu::launch_op(&mut b, row_cfg(n, e, 2 * e)) }
            .map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Sets the auxiliary-loss accumulators `psum, counts: [E]` f64 to zero (allocate them once;
    /// call before the first layer of a step).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    pub fn aux_reset(
        &self,
        psum: &mut CudaViewMut<'_, f64>,
        counts: &mut CudaViewMut<'_, f64>,
        e: usize,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "aux psum", psum.len(), e)?;
        check_len(&self.gpu, "aux counts", counts.len(), e)?;
        if e == 0 {
            return Ok(());
        }
        let e32 = e as u32;
        let cfg = LaunchConfig {
            grid_dim: (e.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.aux_reset);
        b.arg(psum).arg(counts).arg(&e32);
        // SAFETY: writes psum[x], counts[x] for x < E (both checked); types (double*, double*,
        // u32).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Adds one MoE layer to the auxiliary-loss accumulators: `psum[x] += Σ_t probs[t, x]`
    /// (f64; fixed order: deterministic) and `counts[x] += offsets[x+1] − offsets[x]`, the
    /// number of slots routed to expert `x` (`offsets: [E + 1]` from
    /// [`crate::ops::moe::Moe::dispatch`] of this layer's ids). `probs: [N, E]` from
    /// [`Router::forward`].
    ///
    /// # Errors
    /// Short buffers; `E` over 1024; launch errors.
    pub fn aux_accumulate(
        &self,
        probs: &CudaView<'_, f32>,
        offsets: &CudaView<'_, u32>,
        psum: &mut CudaViewMut<'_, f64>,
        counts: &mut CudaViewMut<'_, f64>,
        n: usize,
        e: usize,
    ) -> Result<(), DeviceError> {
        if e == 0 || e > MAX_EXPERTS {
            return Err(self.gpu.err(format!(
                "aux loss: {e} experts; 1..={MAX_EXPERTS} supported"
            )));
        }
        check_len(&self.gpu, "aux probs", probs.len(), n * e)?;
        check_len(&self.gpu, "aux offsets", offsets.len(), e + 1)?;
        check_len(&self.gpu, "aux psum", psum.len(), e)?;
        check_len(&self.gpu, "aux counts", counts.len(), e)?;
        let (n64, e32) = (n as u64, e as u32);
        let cfg = LaunchConfig {
            grid_dim: (e.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.aux_accumulate);
        b.arg(probs)
            .arg(offsets)
            .arg(&n64)
            .arg(&e32)
            .arg(psum)
            .arg(counts);
        // SAFETY: thread (x < E, y) reads probs[t·E + x] for t < N (N·E checked) and, for y = 0,
        // offsets[x], offsets[x+1] (E + 1 checked) and psum/counts[x] (E checked); types
        // (const float*, const u32*, u64, u32, double*, double*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }

    /// Finishes the auxiliary loss over `m` routed token-layers (`m = Σ` of the layers' `N`):
    /// `loss[0] = E · Σ_x (counts[x]/m)·(psum[x]/m)` (f64 in expert order, rounded to f32) and
    /// `grad[x] = f32(E·counts[x] / m²) · coef`, the gradient of `coef · aux` with respect to
    /// every token's `probs[t, x]` (pass it to [`Router::backward`] as
    /// [`ExtraDprobs::Broadcast`]). Reference: `mxrl_tensor::routing::load_balancing_loss`
    /// (its per-layer gradient rows, times the coefficient as the model applies it).
    ///
    /// # Errors
    /// Short buffers; launch errors.
    #[allow(clippy::too_many_arguments)]
    pub fn aux_finish(
        &self,
        psum: &CudaView<'_, f64>,
        counts: &CudaView<'_, f64>,
        m: usize,
        e: usize,
        coef: f32,
        loss: &mut CudaViewMut<'_, f32>,
        grad: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        check_len(&self.gpu, "aux psum", psum.len(), e)?;
        check_len(&self.gpu, "aux counts", counts.len(), e)?;
        check_len(&self.gpu, "aux loss", loss.len(), 1)?;
        check_len(&self.gpu, "aux grad", grad.len(), e)?;
        let (e32, mf) = (e as u32, m as f64);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.gpu.stream().launch_builder(&self.aux_finish);
        b.arg(psum)
            .arg(counts)
            .arg(&e32)
            .arg(&mf)
            .arg(&coef)
            .arg(loss)
            .arg(grad);
        // SAFETY: one block reads psum/counts[x], writes grad[x] for x < E (checked) and
        // loss[0] (checked); types (const double*, const double*, u32, double, float, float*,
        // float*).
        unsafe { crate::gpu::launch_op(&mut b, cfg) }.map_err(|x| self.gpu.err(x))?;
        Ok(())
    }
}
