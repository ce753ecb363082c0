// MoE dispatch (token permutation grouped by expert), gather, combine and their backward.
// References (mxrl_tensor::moe): Dispatch::new (a stable counting sort: expert-major, increasing
// flat index t*k + s within an expert), gather, gather_backward, combine_forward,
// combine_backward.
//
// Dispatch is built on the device in three launches without atomics (integer counts, so every
// order gives the same result; positions come from prefix sums, never from atomic returns):
//   moe_hist    per block of MOE_THREADS flat entries, the count of every expert
//               (hist[x*G + b]);
//   moe_scan    one block: offsets[x] = Σ_{x'<x} total[x'], offsets[E] = Σ, and in place
//               hist[x*G + b] = offsets[x] + Σ_{b'<b} hist[x*G + b'] (the block's base);
//   moe_scatter per entry i: pos = base of its block + entries of its expert in earlier warps
//               of the block + lanes below it in its warp with the same expert
//               (__match_any_sync); perm[pos] = i, row_of[i] = pos.
// Ids >= E (a caller error) are dropped: row_of = MOE_INVALID, no packed row, no contribution.

#define MOE_THREADS 256
#define MOE_WARPS (MOE_THREADS / 32)
#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOP_K 256
#define MOE_INVALID 0xFFFFFFFFu

// The entry of thread (blockIdx.x, threadIdx.x): its expert (MOE_INVALID when past the end or
// out of range), the mask of lanes of its warp with the same expert, and its rank among them.
struct MoeEntry {
    u32 x, same, below;
};
__device__ __forceinline__ MoeEntry moe_entry(const u32* __restrict__ ids, u64 total, u32 e) {
    const u64 i = (u64)blockIdx.x * MOE_THREADS + threadIdx.x;
    u32 x = i < total ? ids[i] : MOE_INVALID;
    if (x >= e) x = MOE_INVALID;
    const u32 lane = threadIdx.x & 31;
    MoeEntry r;
    r.x = x;
    r.same = __match_any_sync(FULL_MASK, x);
    r.below = __popc(r.same & ((1u << lane) - 1u));
    return r;
}

// tab[w*e + x] = number of entries of warp w with expert x (shared, MOE_WARPS*e u32).
__device__ __forceinline__ void moe_warp_counts(const MoeEntry& en, u32 e, u32* tab) {
    for (u32 j = threadIdx.x; j < MOE_WARPS * e; j += MOE_THREADS) tab[j] = 0;
    __syncthreads();
    if (en.x != MOE_INVALID && en.below == 0) tab[(threadIdx.x >> 5) * e + en.x] = __popc(en.same);
    __syncthreads();
}

// hist[x*g + b] = entries of block b with expert x. Grid g blocks of MOE_THREADS; dynamic
// shared memory MOE_WARPS*e u32.
extern "C" __global__ void moe_hist(const u32* __restrict__ ids, u64 total, u32 e,
                                    u32* __restrict__ hist, u32 g) {
    extern __shared__ u32 tab[];
    const MoeEntry en = moe_entry(ids, total, e);
    moe_warp_counts(en, e, tab);
    for (u32 x = threadIdx.x; x < e; x += MOE_THREADS) {
        u32 s = 0;
        for (u32 w = 0; w < MOE_WARPS; ++w) s += tab[w * e + x];
        hist[(u64)x * g + blockIdx.x] = s;
    }
}

__device__ __forceinline__ u32 moe_warp_sum_u32(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ u32 moe_warp_incl_scan_u32(u32 v) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// One block (a multiple of 32 threads): offsets[0..=e] and, in place, the per-block bases.
extern "C" __global__ void moe_scan(u32* __restrict__ hist, u32 e, u32 g, u32* __restrict__ offsets) {
    __shared__ u32 tot[MOE_MAX_EXPERTS];
    __shared__ u32 off[MOE_MAX_EXPERTS];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 x = warp; x < e; x += nw) {
        u32 s = 0;
        for (u32 b = lane; b < g; b += 32) s += hist[(u64)x * g + b];
        s = moe_warp_sum_u32(s);
        if (lane == 0) tot[x] = s;
    }
    __syncthreads();
    if (warp == 0) {
        u32 carry = 0;
        for (u32 base = 0; base < e; base += 32) {
            const u32 x = base + lane;
            const u32 v = x < e ? tot[x] : 0;
            const u32 inc = moe_warp_incl_scan_u32(v);
            if (x < e) {
                off[x] = carry + inc - v;
                offsets[x] = carry + inc - v;
            }
            carry += __shfl_sync(FULL_MASK, inc, 31);
        }
        if (lane == 0) offsets[e] = carry;
    }
    __syncthreads();
    for (u32 x = warp; x < e; x += nw) {
        u32 carry = off[x];
        for (u32 b0 = 0; b0 < g; b0 += 32) {
            const u32 b = b0 + lane;
            const u32 v = b < g ? hist[(u64)x * g + b] : 0;
            const u32 inc = moe_warp_incl_scan_u32(v);
            if (b < g) hist[(u64)x * g + b] = carry + inc - v;
            carry += __shfl_sync(FULL_MASK, inc, 31);
        }
    }
}

// perm[pos] = i and row_of[i] = pos for every flat entry i = t*k + s (row_of = MOE_INVALID for
// a dropped id). Grid and shared memory as moe_hist; `bases` is moe_scan's output.
extern "C" __global__ void moe_scatter(const u32* __restrict__ ids, u64 total, u32 e,
                                       const u32* __restrict__ bases, u32 g,
                                       u32* __restrict__ perm, u32* __restrict__ row_of) {
    extern __shared__ u32 tab[];
    const MoeEntry en = moe_entry(ids, total, e);
    moe_warp_counts(en, e, tab);
    for (u32 x = threadIdx.x; x < e; x += MOE_THREADS) {
        u32 run = bases[(u64)x * g + blockIdx.x];
        for (u32 w = 0; w < MOE_WARPS; ++w) {
            const u32 c = tab[w * e + x];
            tab[w * e + x] = run;
            run += c;
        }
    }
    __syncthreads();
    const u64 i = (u64)blockIdx.x * MOE_THREADS + threadIdx.x;
    if (i < total) {
        if (en.x != MOE_INVALID) {
            const u32 pos = tab[(threadIdx.x >> 5) * e + en.x] + en.below;
            perm[pos] = (u32)i;
            row_of[i] = pos;
        } else {
            row_of[i] = MOE_INVALID;
        }
    }
}

// out[p, :] = x[perm[p] / k, :] for packed rows p < offsets[e] (grid: one block per possible
// row, N*k; rows past offsets[e] exist only for dropped ids and are left untouched).
extern "C" __global__ void moe_gather_f32(const float* __restrict__ x, const u32* __restrict__ perm,
                                          const u32* __restrict__ offsets, u32 e, u32 k, u64 h,
                                          float* __restrict__ out) {
    const u32 p = blockIdx.x;
    if (p >= offsets[e]) return;
    const float* src = x + (u64)(perm[p] / k) * h;
    float* dst = out + (u64)p * h;
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) dst[j] = src[j];
}

// As moe_gather_f32, writing bf16(x) bit patterns (round to nearest even).
extern "C" __global__ void moe_gather_bf16(const float* __restrict__ x, const u32* __restrict__ perm,
                                           const u32* __restrict__ offsets, u32 e, u32 k, u64 h,
                                           u16* __restrict__ out) {
    const u32 p = blockIdx.x;
    if (p >= offsets[e]) return;
    const float* src = x + (u64)(perm[p] / k) * h;
    u16* dst = out + (u64)p * h;
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) dst[j] = f32_to_bf16(src[j]);
}

// Token t's packed rows (rows_s[s] = row_of[t*k + s]) and its valid slots in ascending packed
// row order (order_s[0..nvalid)): ascending row = ascending expert (then slot), the order in
// which the CPU reference visits a token's experts. Every thread of the block returns nvalid.
__device__ __forceinline__ u32 moe_token_order(const u32* __restrict__ row_of, u64 t, u32 k,
                                               u32* rows_s, u32* order_s) {
    for (u32 s = threadIdx.x; s < k; s += blockDim.x) rows_s[s] = row_of[t * k + s];
    __syncthreads();
    for (u32 s = threadIdx.x; s < k; s += blockDim.x) {
        const u32 r = rows_s[s];
        if (r == MOE_INVALID) continue;
        u32 rank = 0;
        for (u32 s2 = 0; s2 < k; ++s2) rank += rows_s[s2] < r ? 1u : 0u;
        order_s[rank] = s;
    }
    u32 nvalid = 0;
    for (u32 s2 = 0; s2 < k; ++s2) nvalid += rows_s[s2] != MOE_INVALID ? 1u : 0u;
    __syncthreads();
    return nvalid;
}

// out[t, j] = Σ_s w[t, s]·y[row(t, s), j], summed from 0 in ascending row (expert) order.
// Grid (n, ceil(h / blockDim.x)).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       const u32* __restrict__ row_of, float* __restrict__ out,
                                       u32 k, u64 h) {
    __shared__ u32 rows_s[MOE_MAX_TOP_K];
    __shared__ u32 order_s[MOE_MAX_TOP_K];
    const u64 t = blockIdx.x;
    const u32 nv = moe_token_order(row_of, t, k, rows_s, order_s);
    const u64 j = (u64)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= h) return;
    float acc = 0.0f;
    for (u32 q = 0; q < nv; ++q) {
        const u32 s = order_s[q];
        acc = __fadd_rn(acc, __fmul_rn(w[t * k + s], y[(u64)rows_s[s] * h + j]));
    }
    out[t * h + j] = acc;
}

// dx[t, j] = Σ_s dg[row(t, s), j], summed from 0 in ascending row (expert) order. Grid as
// moe_combine.
extern "C" __global__ void moe_gather_bwd(const float* __restrict__ dg, const u32* __restrict__ row_of,
                                          float* __restrict__ dx, u32 k, u64 h) {
    __shared__ u32 rows_s[MOE_MAX_TOP_K];
    __shared__ u32 order_s[MOE_MAX_TOP_K];
    const u64 t = blockIdx.x;
    const u32 nv = moe_token_order(row_of, t, k, rows_s, order_s);
    const u64 j = (u64)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= h) return;
    float acc = 0.0f;
    for (u32 q = 0; q < nv; ++q) acc = __fadd_rn(acc, dg[(u64)rows_s[order_s[q]] * h + j]);
    dx[t * h + j] = acc;
}

// One block per flat slot ts = t*k + s: dy[row, :] = w[ts]·dout[t, :] and
// dw[ts] = 0 + Σ_j dout[t, j]·y[row, j] (per-thread strided partial sums, then the fixed
// block_sum tree). A dropped slot gets dw = 0 and no dy row.
extern "C" __global__ void moe_combine_bwd(const float* __restrict__ dout, const float* __restrict__ y,
                                           const float* __restrict__ w, const u32* __restrict__ row_of,
                                           float* __restrict__ dy, float* __restrict__ dw, u32 k, u64 h) {
    __shared__ float scratch[32];
    const u64 ts = blockIdx.x, t = ts / k;
    const u32 r = row_of[ts];
    if (r == MOE_INVALID) {
        if (threadIdx.x == 0) dw[ts] = 0.0f;
        return;
    }
    const float wv = w[ts];
    const float* d = dout + t * h;
    const float* yr = y + (u64)r * h;
    float* dyr = dy + (u64)r * h;
    float part = 0.0f;
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) {
        const float dv = d[j];
        dyr[j] = __fmul_rn(wv, dv);
        part = __fadd_rn(part, __fmul_rn(dv, yr[j]));
    }
    const float tot = block_sum(part, scratch);
    if (threadIdx.x == 0) dw[ts] = __fadd_rn(0.0f, tot);
}
