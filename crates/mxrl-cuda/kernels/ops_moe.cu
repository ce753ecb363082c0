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
// Decode-sized inputs (N*k <= 1024, E <= 256) take moe_dispatch_small instead: the same three
// passes in one block's shared memory, one launch.
// Ids >= E (a caller error) are dropped: row_of = MOE_INVALID, no packed row, no contribution.
//
// Row kernels use float4 accesses when H % 4 == 0 and the base pointers are 16-byte aligned
// (checked at run time, uniform per launch); otherwise the same per-element arithmetic on
// scalars. Either way every output element is computed by the same operations in the same
// order.

#define MOE_THREADS 256
#define MOE_WARPS (MOE_THREADS / 32)
#define MOE_MAX_EXPERTS 1024

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
    if (warp == 0) moe_expert_scan_warp(tot, e, off, offsets);
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

#define MOE_SMALL_MAX_EXPERTS 256

// The whole dispatch in one block of MOE_SMALL_THREADS threads for total <= MOE_SMALL_THREADS
// entries and e <= MOE_SMALL_MAX_EXPERTS (common.cuh's moe_dispatch_block): writes
// offsets[0..=e], perm, row_of as moe_scan + moe_scatter do.
extern "C" __global__ void __launch_bounds__(MOE_SMALL_THREADS)
    moe_dispatch_small(const u32* __restrict__ ids, u32 total, u32 e, u32* __restrict__ offsets,
                       u32* __restrict__ perm, u32* __restrict__ row_of) {
    __shared__ u32 tab[MOE_SMALL_WARPS * MOE_SMALL_MAX_EXPERTS];
    __shared__ u32 off[MOE_SMALL_MAX_EXPERTS];
    moe_dispatch_block(ids, total, e, offsets, perm, row_of, tab, off);
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

__device__ __forceinline__ bool moe_aligned16(const void* a, const void* b) {
    return ((((u64)a) | ((u64)b)) & 15) == 0;
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
    if ((h & 3) == 0 && moe_aligned16(src, dst)) {
        const float4* s4 = (const float4*)src;
        float4* d4 = (float4*)dst;
        for (u64 j = threadIdx.x; j < (h >> 2); j += blockDim.x) d4[j] = s4[j];
    } else {
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) dst[j] = src[j];
    }
}

// As moe_gather_f32, writing bf16(x) bit patterns (round to nearest even).
extern "C" __global__ void moe_gather_bf16(const float* __restrict__ x, const u32* __restrict__ perm,
                                           const u32* __restrict__ offsets, u32 e, u32 k, u64 h,
                                           u16* __restrict__ out) {
    const u32 p = blockIdx.x;
    if (p >= offsets[e]) return;
    const float* src = x + (u64)(perm[p] / k) * h;
    u16* dst = out + (u64)p * h;
    if ((h & 3) == 0 && ((((u64)src) & 15) | (((u64)dst) & 7)) == 0) {
        const float4* s4 = (const float4*)src;
        uint2* d2 = (uint2*)dst;
        for (u64 j = threadIdx.x; j < (h >> 2); j += blockDim.x) {
            const float4 v = s4[j];
            uint2 o;
            o.x = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
            o.y = (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
            d2[j] = o;
        }
    } else {
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) dst[j] = f32_to_bf16(src[j]);
    }
}

// As moe_gather_bf16 from rows already in bf16: out[p] = x[perm[p] / k] (u16 copies).
extern "C" __global__ void moe_gather_rows_u16(const u16* __restrict__ x, const u32* __restrict__ perm,
                                               const u32* __restrict__ offsets, u32 e, u32 k, u64 h,
                                               u16* __restrict__ out) {
    const u32 p = blockIdx.x;
    if (p >= offsets[e]) return;
    const u16* src = x + (u64)(perm[p] / k) * h;
    u16* dst = out + (u64)p * h;
    if ((h & 3) == 0 && ((((u64)src) & 7) | (((u64)dst) & 7)) == 0) {
        const uint2* s2 = (const uint2*)src;
        uint2* d2 = (uint2*)dst;
        for (u64 j = threadIdx.x; j < (h >> 2); j += blockDim.x) d2[j] = s2[j];
    } else {
        for (u64 j = threadIdx.x; j < h; j += blockDim.x) dst[j] = src[j];
    }
}

// out[t, j] = Σ_s w[t, s]·y[row(t, s), j], summed from 0 in ascending row (expert) order,
// then + res[t, j] when res is not null (a residual added after the sum, as an add_inplace of
// the combined output would).
// Grid (n, ceil(h / (4·blockDim.x))): each thread owns 4 consecutive columns.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       const u32* __restrict__ row_of, float* __restrict__ out,
                                       u32 k, u64 h, const float* __restrict__ res) {
    __shared__ u32 rows_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    __shared__ u32 order_s[MOE_MAX_TOP_K];
    const u64 t = blockIdx.x;
    const u32 nv = moe_token_order(row_of, w, t, k, rows_s, w_s, order_s);
    const u64 j0 = ((u64)blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (j0 >= h) return;
    float* o = out + t * h;
    if ((h & 3) == 0 && moe_aligned16(y, out)) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (u32 q = 0; q < nv; ++q) {
            const u32 s = order_s[q];
            const float ws = w_s[s];
            const float4 v = *(const float4*)(y + (u64)rows_s[s] * h + j0);
            acc.x = __fadd_rn(acc.x, __fmul_rn(ws, v.x));
            acc.y = __fadd_rn(acc.y, __fmul_rn(ws, v.y));
            acc.z = __fadd_rn(acc.z, __fmul_rn(ws, v.z));
            acc.w = __fadd_rn(acc.w, __fmul_rn(ws, v.w));
        }
        if (res != nullptr && moe_aligned16(res, res)) {
            const float4 r = *(const float4*)(res + t * h + j0);
            acc.x = __fadd_rn(acc.x, r.x);
            acc.y = __fadd_rn(acc.y, r.y);
            acc.z = __fadd_rn(acc.z, r.z);
            acc.w = __fadd_rn(acc.w, r.w);
        } else if (res != nullptr) {
            acc.x = __fadd_rn(acc.x, res[t * h + j0]);
            acc.y = __fadd_rn(acc.y, res[t * h + j0 + 1]);
            acc.z = __fadd_rn(acc.z, res[t * h + j0 + 2]);
            acc.w = __fadd_rn(acc.w, res[t * h + j0 + 3]);
        }
        *(float4*)(o + j0) = acc;
    } else {
        for (u64 j = j0; j < j0 + 4 && j < h; ++j) {
            float acc = 0.0f;
            for (u32 q = 0; q < nv; ++q) {
                const u32 s = order_s[q];
                acc = __fadd_rn(acc, __fmul_rn(w_s[s], y[(u64)rows_s[s] * h + j]));
            }
            if (res != nullptr) acc = __fadd_rn(acc, res[t * h + j]);
            o[j] = acc;
        }
    }
}

// dx[t, j] = Σ_s dg[row(t, s), j], summed from 0 in ascending row (expert) order. Grid as
// moe_combine.
extern "C" __global__ void moe_gather_bwd(const float* __restrict__ dg, const u32* __restrict__ row_of,
                                          float* __restrict__ dx, u32 k, u64 h) {
    __shared__ u32 rows_s[MOE_MAX_TOP_K];
    __shared__ u32 order_s[MOE_MAX_TOP_K];
    const u64 t = blockIdx.x;
    const u32 nv = moe_token_order(row_of, (const float*)0, t, k, rows_s, (float*)0, order_s);
    const u64 j0 = ((u64)blockIdx.y * blockDim.x + threadIdx.x) * 4;
    if (j0 >= h) return;
    float* o = dx + t * h;
    if ((h & 3) == 0 && moe_aligned16(dg, dx)) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (u32 q = 0; q < nv; ++q) {
            const float4 v = *(const float4*)(dg + (u64)rows_s[order_s[q]] * h + j0);
            acc.x = __fadd_rn(acc.x, v.x);
            acc.y = __fadd_rn(acc.y, v.y);
            acc.z = __fadd_rn(acc.z, v.z);
            acc.w = __fadd_rn(acc.w, v.w);
        }
        *(float4*)(o + j0) = acc;
    } else {
        for (u64 j = j0; j < j0 + 4 && j < h; ++j) {
            float acc = 0.0f;
            for (u32 q = 0; q < nv; ++q) acc = __fadd_rn(acc, dg[(u64)rows_s[order_s[q]] * h + j]);
            o[j] = acc;
        }
    }
}

// One warp per flat slot ts = t*k + s < total (blockDim.x / 32 slots per block):
// dy[row, :] = w[ts]·dout[t, :] and dw[ts] = 0 + Σ_j dout[t, j]·y[row, j] (per-lane strided
// partial sums — over float4 chunks when dout and y are aligned — then the fixed warp_sum
// butterfly). A
// dropped slot gets dw = 0 and no dy row. Every exit is uniform across its warp.
// B16: dy is written as BF16 bit patterns only (the bits of the f32 kernel then to_bf16).
template <bool B16>
__device__ __forceinline__ void moe_combine_bwd_slots(const float* __restrict__ dout, const float* __restrict__ y,
                                                      const float* __restrict__ w, const u32* __restrict__ row_of,
                                                      float* __restrict__ dy, u16* __restrict__ dyb,
                                                      float* __restrict__ dw, u64 total, u32 k, u64 h) {
    const u32 lane = threadIdx.x & 31;
    const u64 ts = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (ts >= total) return;
    const u64 t = ts / k;
    const u32 r = row_of[ts];
    if (r == MOE_INVALID) {
        if (lane == 0) dw[ts] = 0.0f;
        return;
    }
    const float wv = w[ts];
    const float* d = dout + t * h;
    const float* yr = y + (u64)r * h;
    float* dyr = B16 ? nullptr : dy + (u64)r * h;
    u16* dybr = B16 ? dyb + (u64)r * h : nullptr;
    // The sum's order depends on the inputs' alignment only; the stores are 8 / 16 bytes wide
    // where the output row allows it, element by element otherwise.
    const bool out_aligned = B16 ? (((u64)dybr) & 7) == 0 : moe_aligned16(dyr, dyr);
    float part = 0.0f;
    if ((h & 3) == 0 && moe_aligned16(d, yr)) {
        const float4* d4 = (const float4*)d;
        const float4* y4 = (const float4*)yr;
        for (u64 j = lane; j < (h >> 2); j += 32) {
            const float4 dv = d4[j], yv = y4[j];
            const float4 o = make_float4(__fmul_rn(wv, dv.x), __fmul_rn(wv, dv.y), __fmul_rn(wv, dv.z),
                                         __fmul_rn(wv, dv.w));
            if (B16 && out_aligned) {
                uint2 pk;
                pk.x = (u32)f32_to_bf16(o.x) | ((u32)f32_to_bf16(o.y) << 16);
                pk.y = (u32)f32_to_bf16(o.z) | ((u32)f32_to_bf16(o.w) << 16);
                ((uint2*)dybr)[j] = pk;
            } else if (B16) {
                dybr[4 * j] = f32_to_bf16(o.x);
                dybr[4 * j + 1] = f32_to_bf16(o.y);
                dybr[4 * j + 2] = f32_to_bf16(o.z);
                dybr[4 * j + 3] = f32_to_bf16(o.w);
            } else if (out_aligned) {
                ((float4*)dyr)[j] = o;
            } else {
                dyr[4 * j] = o.x;
                dyr[4 * j + 1] = o.y;
                dyr[4 * j + 2] = o.z;
                dyr[4 * j + 3] = o.w;
            }
            part = __fadd_rn(part, __fmul_rn(dv.x, yv.x));
            part = __fadd_rn(part, __fmul_rn(dv.y, yv.y));
            part = __fadd_rn(part, __fmul_rn(dv.z, yv.z));
            part = __fadd_rn(part, __fmul_rn(dv.w, yv.w));
        }
    } else {
        for (u64 j = lane; j < h; j += 32) {
            const float dv = d[j];
            const float o = __fmul_rn(wv, dv);
            if (B16) dybr[j] = f32_to_bf16(o);
            else dyr[j] = o;
            part = __fadd_rn(part, __fmul_rn(dv, yr[j]));
        }
    }
    const float tot = warp_sum(part);
    if (lane == 0) dw[ts] = __fadd_rn(0.0f, tot);
}

extern "C" __global__ void moe_combine_bwd(const float* __restrict__ dout, const float* __restrict__ y,
                                           const float* __restrict__ w, const u32* __restrict__ row_of,
                                           float* __restrict__ dy, float* __restrict__ dw, u64 total,
                                           u32 k, u64 h) {
    moe_combine_bwd_slots<false>(dout, y, w, row_of, dy, nullptr, dw, total, k, h);
}

extern "C" __global__ void moe_combine_bwd_bf16(const float* __restrict__ dout, const float* __restrict__ y,
                                                const float* __restrict__ w, const u32* __restrict__ row_of,
                                                u16* __restrict__ dy, float* __restrict__ dw, u64 total,
                                                u32 k, u64 h) {
    moe_combine_bwd_slots<true>(dout, y, w, row_of, nullptr, dy, dw, total, k, h);
}
