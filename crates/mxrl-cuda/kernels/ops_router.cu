// Top-k softmax router, routing replay, router backward and the auxiliary load-balancing loss.
// References (mxrl_tensor::routing): router_forward (RouteMode::{Compute, ReplayIds,
// ReplayFull}), router_backward, load_balancing_loss.
//
// One block per token for the row ops. The row's small reductions run in the reference's
// order (one thread, index order, f32): the softmax sum over E, the norm_topk_prob sum over
// the k slots, the backward's slot sums and its softmax-backward dot over E. With equal
// inputs the backward is therefore bitwise the reference's; the forward differs only where the
// two devices' exp differ (exp is (float)exp((double)x): within 1 ulp, like the CPU's libm).

#define ROUTER_MAX_TOP_K 256

__device__ __forceinline__ float router_exp(float x) { return (float)exp((double)x); }

// Key of f32::total_cmp: key(a) > key(b) exactly when a sorts after b
// (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
__device__ __forceinline__ u32 router_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Expert i's rank in the order (key descending, index ascending) among key[0..e): the number
// of experts before it; sel[rank] = i when the rank is below k (the top-k selection).
__device__ __forceinline__ void router_select(const u32* key, u32 e, u32 k, u32 i, u32* sel) {
    const u32 ki = key[i];
    u32 rank = 0;
    for (u32 j = 0; j < e; ++j) {
        const u32 kj = key[j];
        rank += (kj > ki || (kj == ki && j < i)) ? 1u : 0u;
    }
    if (rank < k) sel[rank] = i;
}

// p[0..e) (shared) = softmax(logits row), also written to probs_row:
// m = max (NaN ignored, as f32::max), p_j = exp(x_j − m), s = Σ_j p_j (index order, from 0),
// p_j /= s. Ends with a barrier.
__device__ void router_softmax_row(const float* __restrict__ x, float* __restrict__ probs_row, u32 e,
                                   float* p, float* scratch, float* sum_s) {
    float mx = -__int_as_float(0x7f800000);
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) {
        const float v = x[j];
        p[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = block_max(mx, scratch);
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) p[j] = router_exp(__fsub_rn(p[j], mx));
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (u32 j = 0; j < e; ++j) s = __fadd_rn(s, p[j]);
        *sum_s = s;
    }
    __syncthreads();
    const float s = *sum_s;
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) {
        const float q = __fdiv_rn(p[j], s);
        p[j] = q;
        probs_row[j] = q;
    }
    __syncthreads();
}

// ids_row / w_row from the selected experts sel[0..k) (shared) and the row's probabilities p:
// w_s = p[sel_s], divided by Σ_s w_s (slot order, from 0) when norm. An id >= e (replayed, a
// caller error) gets weight NaN and is otherwise ignored.
__device__ void router_weights(const float* p, const u32* sel, u32 e, u32 k, int norm,
                               u32* __restrict__ ids_row, float* __restrict__ w_row, float* sum_s) {
    if (threadIdx.x == 0 && norm) {
        float s = 0.0f;
        for (u32 q = 0; q < k; ++q) s = __fadd_rn(s, sel[q] < e ? p[sel[q]] : __int_as_float(0x7fffffff));
        *sum_s = s;
    }
    __syncthreads();
    for (u32 q = threadIdx.x; q < k; q += blockDim.x) {
        const u32 id = sel[q];
        float w = id < e ? p[id] : __int_as_float(0x7fffffff);
        if (norm) w = __fdiv_rn(w, *sum_s);
        ids_row[q] = id;
        w_row[q] = w;
    }
}

// Dynamic shared memory of the forward kernels: p[e] floats + key[e] u32.
// Compute mode: softmax, then the top k by (probability descending, id ascending) — the rank of
// expert i is the number of experts before it in that order; ranks < k are its slots.
extern "C" __global__ void router_fwd_topk(const float* __restrict__ logits, float* __restrict__ probs,
                                           u32* __restrict__ ids, float* __restrict__ weights,
                                           u32 e, u32 k, int norm) {
    extern __shared__ float router_smem[];
    __shared__ float scratch[32];
    __shared__ float sum_s;
    __shared__ u32 sel[ROUTER_MAX_TOP_K];
    float* p = router_smem;
    u32* key = (u32*)(router_smem + e);
    const u64 t = blockIdx.x;
    router_softmax_row(logits + t * e, probs + t * e, e, p, scratch, &sum_s);
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) key[j] = router_key(p[j]);
    __syncthreads();
    for (u32 i = threadIdx.x; i < e; i += blockDim.x) router_select(key, e, k, i, sel);
    __syncthreads();
    router_weights(p, sel, e, k, norm, ids + t * k, weights + t * k, &sum_s);
}

// ReplayIds: softmax, ids copied from ids_in, weights from the current probabilities.
extern "C" __global__ void router_fwd_replay_ids(const float* __restrict__ logits, float* __restrict__ probs,
                                                 const u32* __restrict__ ids_in, u32* __restrict__ ids,
                                                 float* __restrict__ weights, u32 e, u32 k, int norm) {
    extern __shared__ float router_smem[];
    __shared__ float scratch[32];
    __shared__ float sum_s;
    __shared__ u32 sel[ROUTER_MAX_TOP_K];
    float* p = router_smem;
    const u64 t = blockIdx.x;
    for (u32 q = threadIdx.x; q < k; q += blockDim.x) sel[q] = ids_in[t * k + q];
    router_softmax_row(logits + t * e, probs + t * e, e, p, scratch, &sum_s);
    router_weights(p, sel, e, k, norm, ids + t * k, weights + t * k, &sum_s);
}

// ReplayFull: softmax; ids and weights copied verbatim.
extern "C" __global__ void router_fwd_replay_full(const float* __restrict__ logits, float* __restrict__ probs,
                                                  const u32* __restrict__ ids_in, const float* __restrict__ w_in,
                                                  u32* __restrict__ ids, float* __restrict__ weights, u32 e, u32 k) {
    extern __shared__ float router_smem[];
    __shared__ float scratch[32];
    __shared__ float sum_s;
    float* p = router_smem;
    const u64 t = blockIdx.x;
    router_softmax_row(logits + t * e, probs + t * e, e, p, scratch, &sum_s);
    for (u32 q = threadIdx.x; q < k; q += blockDim.x) {
        ids[t * k + q] = ids_in[t * k + q];
        weights[t * k + q] = w_in[t * k + q];
    }
}

// Router backward for token t (one block; dynamic shared memory p[e] + dp[e] floats):
// dp = extra row (row stride extra_stride: 0 broadcasts one [E] row, e reads [N, E]) or 0;
// unless frozen (has_dw == 0): with S = Σ_s p[id_s], D = Σ_s dw_s·w_s (slot order),
// dp[id_s] += norm ? (dw_s − D)/S : dw_s (slot order); then
// dlogits = p ⊙ (dp − Σ_j p_j·dp_j) (index order). Ids >= e are skipped.
extern "C" __global__ void router_bwd(const float* __restrict__ probs, const u32* __restrict__ ids,
                                      const float* __restrict__ weights, const float* __restrict__ dweights,
                                      const float* __restrict__ extra, u64 extra_stride,
                                      float* __restrict__ dlogits, u32 e, u32 k, int norm, int has_dw,
                                      int has_extra) {
    extern __shared__ float router_smem[];
    __shared__ float dot_s;
    float* p = router_smem;
    float* dp = router_smem + e;
    const u64 t = blockIdx.x;
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) {
        p[j] = probs[t * e + j];
        dp[j] = has_extra ? extra[t * extra_stride + j] : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (has_dw) {
            const u32* sel = ids + t * k;
            const float* dw = dweights + t * k;
            const float* w = weights + t * k;
            if (norm) {
                float s = 0.0f, d = 0.0f;
                for (u32 q = 0; q < k; ++q) {
                    if (sel[q] < e) s = __fadd_rn(s, p[sel[q]]);
                    d = __fadd_rn(d, __fmul_rn(dw[q], w[q]));
                }
                for (u32 q = 0; q < k; ++q)
                    if (sel[q] < e) dp[sel[q]] = __fadd_rn(dp[sel[q]], __fdiv_rn(__fsub_rn(dw[q], d), s));
            } else {
                for (u32 q = 0; q < k; ++q)
                    if (sel[q] < e) dp[sel[q]] = __fadd_rn(dp[sel[q]], dw[q]);
            }
        }
        float d = 0.0f;
        for (u32 j = 0; j < e; ++j) d = __fadd_rn(d, __fmul_rn(p[j], dp[j]));
        dot_s = d;
    }
    __syncthreads();
    const float d = dot_s;
    for (u32 j = threadIdx.x; j < e; j += blockDim.x) dlogits[t * e + j] = __fmul_rn(p[j], __fsub_rn(dp[j], d));
}

// Auxiliary loss accumulators (f64 [e] each) set to zero.
extern "C" __global__ void router_aux_reset(double* __restrict__ psum, double* __restrict__ counts, u32 e) {
    for (u32 x = blockIdx.x * blockDim.x + threadIdx.x; x < e; x += gridDim.x * blockDim.x) {
        psum[x] = 0.0;
        counts[x] = 0.0;
    }
}

// One layer into the accumulators: psum[x] += Σ_t probs[t, x] (f64; per thread a strided
// sequential sum, then the 32 partials of the block column in index order) and
// counts[x] += offsets[x+1] − offsets[x] (the dispatch's row count of expert x).
// Block (32, 32): lane = expert within a group of 32, threadIdx.y strides over tokens.
extern "C" __global__ void router_aux_accumulate(const float* __restrict__ probs, const u32* __restrict__ offsets,
                                                 u64 n, u32 e, double* __restrict__ psum,
                                                 double* __restrict__ counts) {
    __shared__ double part[32][33];
    const u32 x = blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (x < e)
        for (u64 t = threadIdx.y; t < n; t += blockDim.y) acc += (double)probs[t * e + x];
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && x < e) {
        double s = 0.0;
        for (u32 r = 0; r < blockDim.y; ++r) s += part[r][threadIdx.x];
        psum[x] = psum[x] + s;
        counts[x] = counts[x] + (double)(offsets[x + 1] - offsets[x]);
    }
}

// loss[0] = (float)(e · Σ_x (counts[x]/m)·(psum[x]/m)) (x order, f64), m routed token-layers;
// grad[x] = (float)(e·counts[x] / (m·m)) · coef (f32 product): ∂(coef·aux)/∂probs[t, x] for
// every token. m == 0 gives zeros. One block.
extern "C" __global__ void router_aux_finish(const double* __restrict__ psum, const double* __restrict__ counts,
                                             u32 e, double m, float coef, float* __restrict__ loss,
                                             float* __restrict__ grad) {
    if (threadIdx.x == 0) {
        double l = 0.0;
        if (m > 0.0) {
            for (u32 x = 0; x < e; ++x) l += (counts[x] / m) * (psum[x] / m);
            l *= (double)e;
        }
        loss[0] = (float)l;
    }
    for (u32 x = threadIdx.x; x < e; x += blockDim.x)
        grad[x] = m > 0.0 ? __fmul_rn((float)((double)e * counts[x] / (m * m)), coef) : 0.0f;
}

// ---- Decode routing in one launch: router_fwd_topk for every token, then the dispatch
// (moe_dispatch_small's), by one block of MOE_SMALL_THREADS threads, for N·k <=
// MOE_SMALL_THREADS and e <= ROUTE_SMALL_MAX_E. Warp w < ROUTE_SMALL_WARPS computes tokens
// w, w + ROUTE_SMALL_WARPS, …; a token's values are router_fwd_topk's bit for bit: the max is
// order-free (fmaxf ignores NaN, and either zero gives the same exp), the softmax sum and the
// norm_topk_prob sum run on one lane in index order as one thread does there, and the ranks
// are the same counts.
#define ROUTE_SMALL_MAX_E 128
#define ROUTE_SMALL_WARPS 16

__device__ __forceinline__ void router_topk_row_warp(const float* __restrict__ x, float* __restrict__ probs_row,
                                                     u32* __restrict__ ids_row, float* __restrict__ w_row, u32 e,
                                                     u32 k, int norm, float* p, u32* key, u32* sel) {
    const u32 lane = threadIdx.x & 31;
    float mx = -__int_as_float(0x7f800000);
    for (u32 j = lane; j < e; j += 32) {
        const float v = x[j];
        p[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    for (u32 j = lane; j < e; j += 32) p[j] = router_exp(__fsub_rn(p[j], mx));
    __syncwarp();
    float s = 0.0f;
    if (lane == 0)
        for (u32 j = 0; j < e; ++j) s = __fadd_rn(s, p[j]);
    s = __shfl_sync(FULL_MASK, s, 0);
    for (u32 j = lane; j < e; j += 32) {
        const float q = __fdiv_rn(p[j], s);
        p[j] = q;
        probs_row[j] = q;
        key[j] = router_key(q);
    }
    __syncwarp();
    for (u32 i = lane; i < e; i += 32) router_select(key, e, k, i, sel);
    __syncwarp();
    float sw = 0.0f;
    if (lane == 0 && norm)
        for (u32 q = 0; q < k; ++q) sw = __fadd_rn(sw, sel[q] < e ? p[sel[q]] : __int_as_float(0x7fffffff));
    sw = __shfl_sync(FULL_MASK, sw, 0);
    for (u32 q = lane; q < k; q += 32) {
        const u32 id = sel[q];
        float w = id < e ? p[id] : __int_as_float(0x7fffffff);
        if (norm) w = __fdiv_rn(w, sw);
        ids_row[q] = id;
        w_row[q] = w;
    }
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(MOE_SMALL_THREADS)
    router_topk_dispatch_small(const float* __restrict__ logits, float* __restrict__ probs, u32* ids,
                               float* __restrict__ weights, u32 n, u32 e, u32 k, int norm,
                               u32* __restrict__ offsets, u32* __restrict__ perm, u32* __restrict__ row_of) {
    __shared__ float wp[ROUTE_SMALL_WARPS][ROUTE_SMALL_MAX_E];
    __shared__ u32 wkey[ROUTE_SMALL_WARPS][ROUTE_SMALL_MAX_E];
    __shared__ u32 wsel[ROUTE_SMALL_WARPS][ROUTE_SMALL_MAX_E];
    __shared__ u32 tab[MOE_SMALL_WARPS * ROUTE_SMALL_MAX_E];
    __shared__ u32 off[ROUTE_SMALL_MAX_E];
    const u32 warp = threadIdx.x >> 5;
    if (warp < ROUTE_SMALL_WARPS)
        for (u32 t = warp; t < n; t += ROUTE_SMALL_WARPS)
            router_topk_row_warp(logits + (u64)t * e, probs + (u64)t * e, ids + (u64)t * k, weights + (u64)t * k, e,
                                 k, norm, wp[warp], wkey[warp], wsel[warp]);
    // The block's ids writes are visible to every thread after the barrier.
    __syncthreads();
    moe_dispatch_block(ids, n * k, e, offsets, perm, row_of, tab, off);
}
