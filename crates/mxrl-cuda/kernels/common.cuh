// Device helpers shared by the engine's op kernels (placed after the generated prelude).
// Numerics: compiled with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true (no fast
// math). Reductions run in a fixed order (tree shapes depend only on the launch shape), never
// with atomics, so equal inputs and shapes give equal bits.
#ifndef MXRL_COMMON_CUH
#define MXRL_COMMON_CUH

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef FULL_MASK
#define FULL_MASK 0xFFFFFFFFu
#endif

// BF16 <-> f32. BF16 is carried as its 16-bit pattern (u16); widening is exact, narrowing is
// round-to-nearest-even with NaN kept quiet (the rule of mxrl_tensor::precision::round_bf16 /
// half::bf16::from_f32).
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x0040u);
    u32 r = u + 0x7FFFu + ((u >> 16) & 1u);
    return (u16)(r >> 16);
}
__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Splits an f32 value into three BF16 parts, x ≈ hi + mid + lo: hi = bf16(x), mid = bf16(x − hi),
// lo = bf16(x − hi − mid) (each difference is exact in f32). Exact (x = hi + mid + lo) for every
// f32 x with 2⁻¹¹⁰ ≤ |x| < 2¹²⁸·(1 − 2⁻⁹), whose last part stays in BF16's normal range; below,
// lo is rounded to nearest even (|x − (hi + mid + lo)| ≤ 2⁻¹³⁴); above, hi rounds to infinity.
__device__ __forceinline__ void split_bf16x3(float v, u16& hi, u16& mid, u16& lo) {
    hi = f32_to_bf16(v);
    const float r1 = __fsub_rn(v, bf16_to_f32(hi));
    mid = f32_to_bf16(r1);
    lo = f32_to_bf16(__fsub_rn(r1, bf16_to_f32(mid)));
}

// One AdamW element update in the operation order of mxrl_tensor::optim::adamw_update, f32:
//   g = g_raw·sc               (the clipping coefficient; 1 when not clipping)
//   p ← p·decay;  m ← β₁·m + (1−β₁)·g;  v ← β₂·v + ((1−β₂)·g)·g
//   p ← p − (step_size·m) / (√v / bc2_sqrt + ε)
// with decay = 1 − lr·wd, step_size = lr/(1−β₁ᵗ), bc2_sqrt = √(1−β₂ᵗ) computed on the host
// exactly as the reference does. Every AdamW kernel (ops_optim.cu's, and the one that also
// quantizes the new weights in ops_qgemm.cu) updates through this function.
__device__ __forceinline__ void adamw_elem(float g_raw, float sc, float& p, float& m, float& v, float beta1,
                                           float beta2, float one_m_beta1, float one_m_beta2, float eps,
                                           float step_size, float bc2_sqrt, float decay) {
    const float g = __fmul_rn(g_raw, sc);
    float pi = __fmul_rn(p, decay);
    m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(one_m_beta1, g));
    v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(one_m_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
    p = __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size, m), denom));
}

// Eight f32 values (BF16-exact, or rounded to nearest even) as eight BF16 bit patterns.
__device__ __forceinline__ uint4 pack_bf16x8(const float v[8]) {
    uint4 o;
    o.x = (u32)f32_to_bf16(v[0]) | ((u32)f32_to_bf16(v[1]) << 16);
    o.y = (u32)f32_to_bf16(v[2]) | ((u32)f32_to_bf16(v[3]) << 16);
    o.z = (u32)f32_to_bf16(v[4]) | ((u32)f32_to_bf16(v[5]) << 16);
    o.w = (u32)f32_to_bf16(v[6]) | ((u32)f32_to_bf16(v[7]) << 16);
    return o;
}

// AdamW over the eight elements [i, i + 8) (adamw_elem; 16-byte aligned f32 buffers): the new
// weights are left in w (and stored, with m, v and, when write_bf16 != 0, their BF16 copy).
__device__ __forceinline__ void adamw8(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                                       float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16, float sc,
                                       u64 i, float w[8], float beta1, float beta2, float one_m_beta1,
                                       float one_m_beta2, float eps, float step_size, float bc2_sqrt,
                                       float decay) {
    float g[8], mm[8], vv[8];
    *reinterpret_cast<float4*>(w) = *reinterpret_cast<const float4*>(p + i);
    *reinterpret_cast<float4*>(w + 4) = *reinterpret_cast<const float4*>(p + i + 4);
    *reinterpret_cast<float4*>(g) = *reinterpret_cast<const float4*>(grad + i);
    *reinterpret_cast<float4*>(g + 4) = *reinterpret_cast<const float4*>(grad + i + 4);
    *reinterpret_cast<float4*>(mm) = *reinterpret_cast<const float4*>(m + i);
    *reinterpret_cast<float4*>(mm + 4) = *reinterpret_cast<const float4*>(m + i + 4);
    *reinterpret_cast<float4*>(vv) = *reinterpret_cast<const float4*>(v + i);
    *reinterpret_cast<float4*>(vv + 4) = *reinterpret_cast<const float4*>(v + i + 4);
#pragma unroll
    for (int j = 0; j < 8; ++j)
        adamw_elem(g[j], sc, w[j], mm[j], vv[j], beta1, beta2, one_m_beta1, one_m_beta2, eps, step_size,
                   bc2_sqrt, decay);
    *reinterpret_cast<float4*>(p + i) = *reinterpret_cast<const float4*>(w);
    *reinterpret_cast<float4*>(p + i + 4) = *reinterpret_cast<const float4*>(w + 4);
    *reinterpret_cast<float4*>(m + i) = *reinterpret_cast<const float4*>(mm);
    *reinterpret_cast<float4*>(m + i + 4) = *reinterpret_cast<const float4*>(mm + 4);
    *reinterpret_cast<float4*>(v + i) = *reinterpret_cast<const float4*>(vv);
    *reinterpret_cast<float4*>(v + i + 4) = *reinterpret_cast<const float4*>(vv + 4);
    if (write_bf16) *reinterpret_cast<uint4*>(p_bf16 + i) = pack_bf16x8(w);
}

// Warp reductions (butterfly: every lane ends with the same value, fixed order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// SwiGLU's exp, evaluated as (float)exp((double)x): within 1 ulp of the exact value (CUDA's
// f64 exp is within 1 ulp of f64, then one round-to-nearest conversion), as the CPU's libm
// expf (0.502 ulp).
__device__ __forceinline__ float swiglu_exp(float x) { return (float)exp((double)x); }

// silu(g) = g / (1 + exp(-g)) (PyTorch's formula, mxrl_tensor::activation::silu).
__device__ __forceinline__ float swiglu_silu(float g) {
    return __fdiv_rn(g, __fadd_rn(1.0f, swiglu_exp(-g)));
}

// Block reductions over blockDim.x threads (a multiple of 32, at most 1024); `scratch` holds 32
// floats of shared memory. Every thread returns the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(t);
}

// 1 / sqrt(ss / d + eps): RMSNorm's rstd from a row's sum of squares.
__device__ __forceinline__ float rms_rstd_of_sum(float ss, u32 d, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)d), eps)));
}

// The row loops of these kernels read a thread's elements j = threadIdx.x + i·blockDim.x in
// batches of ROW_BATCH (every load of a batch issued before the first is used), then use them
// in increasing j: the order of a one-element-at-a-time loop, so the same bits, with one memory
// latency per batch instead of one per element. row_batched(n, load, use): use(j, load(j)) for
// this thread's j < n in that order.
#define ROW_BATCH 8
template <class Load, class Use>
__device__ __forceinline__ void row_batched(u64 n, Load load, Use use) {
    using T = decltype(load(u64{0}));
    for (u64 j0 = threadIdx.x; j0 < n; j0 += ROW_BATCH * (u64)blockDim.x) {
        T v[ROW_BATCH];
#pragma unroll
        for (u32 i = 0; i < ROW_BATCH; ++i) {
            const u64 j = j0 + (u64)i * blockDim.x;
            v[i] = j < n ? load(j) : T{};
        }
#pragma unroll
        for (u32 i = 0; i < ROW_BATCH; ++i) {
            const u64 j = j0 + (u64)i * blockDim.x;
            if (j < n) use(j, v[i]);
        }
    }
}

// f(j, src[j]) for this thread's j < n, batched as row_batched.
template <class F>
__device__ __forceinline__ void row_for_each(const float* src, u64 n, F f) {
    row_batched(n, [&](u64 j) { return src[j]; }, f);
}

// f(j, src[j]) for j = j0, j0 + 1, … < j1 (one thread's contiguous span) in that order, the
// loads issued ROW_BATCH at a time before any is used; f returns true to stop (the rest of the
// span is not visited). The order of the one-element loop, so the same bits.
template <class F>
__device__ __forceinline__ void span_until(const float* src, u64 j0, u64 j1, F f) {
    for (u64 b = j0; b < j1; b += ROW_BATCH) {
        float v[ROW_BATCH];
#pragma unroll
        for (u32 i = 0; i < ROW_BATCH; ++i) v[i] = b + i < j1 ? src[b + i] : 0.0f;
#pragma unroll
        for (u32 i = 0; i < ROW_BATCH; ++i)
            if (b + i < j1 && f(b + i, v[i])) return;
    }
}

// 1 / sqrt(Σ_j x[j]² / d + eps) of one row, summed by the block (threads j, j + blockDim.x, …
// in order, then block_sum): the RMSNorm kernels' reduction, so every caller gets the same
// bits. Every thread of the block must call it (barriers inside); all get the result.
__device__ __forceinline__ float rms_row_rstd(const float* __restrict__ xr, u32 d, float eps, float* scratch) {
    float ss = 0.0f;
    row_for_each(xr, d, [&](u64, float v) { ss = __fadd_rn(ss, __fmul_rn(v, v)); });
    return rms_rstd_of_sum(block_sum(ss, scratch), d, eps);
}

// v[j] = (xr[j] · rs) · w[j] for j < d, written as f32 to yr (F32) and as bf16(v) to ybr (B16),
// the loads batched as row_batched's.
template <bool F32, bool B16>
__device__ __forceinline__ void rmsnorm_scale_row(const float* xr, const float* __restrict__ w, float rs,
                                                  float* __restrict__ yr, u16* __restrict__ ybr, u32 d) {
    row_batched(
        d, [&](u64 j) { return make_float2(xr[j], w[j]); },
        [&](u64 j, float2 xw) {
            const float v = __fmul_rn(__fmul_rn(xw.x, rs), xw.y);
            if (F32) yr[j] = v;
            if (B16) ybr[j] = f32_to_bf16(v);
        });
}

// Zeroes a fragment kernel's accumulators: [2 column tiles][TG token groups][4 entries of the
// m16n8 fragment] (ops_qgemm's fragment kernels, ops_fp8block's).
template <int TG>
__device__ __forceinline__ void frag_acc_zero(float (&acc)[2][TG][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[j][tg][q] = 0.0f;
}

// Programmatic dependent launch (sm_90). Every op kernel's body starts with this call,
// placed by `op_module_source` (src/lib.rs): wait until the grids this one depends on have
// completed and their writes are visible, then allow the next grid to be launched. Launched
// normally (no programmatic dependency) both instructions return at once; in a decode graph
// whose edges into op kernels are programmatic (gpu.rs, `GraphPdl`, `launch_op`) the next kernel's
// launch and block scheduling overlap this kernel's run, while its memory accesses still
// begin only after this kernel has finished, so every result is what the ordered launches
// give.
__device__ __forceinline__ void mxrl_grid_dependency() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Rows [lo, hi) of expert e of a grouped layout (offsets off[0..=E]), clamped so that
// 0 <= lo <= hi <= R.
__device__ __forceinline__ void expert_rows(const u32* __restrict__ off, u32 e, u32 R, u32& lo, u32& hi) {
    hi = min(off[e + 1], R);
    lo = min(off[e], hi);
}

// The RoPE rotation of the pair (a, b) = (x[i], x[i + half]) by the table entries
// c = cos[p, i], sn = sin[p, i]: s = sign·sn, lo = a·c − b·s, hi = b·c + a·s (rope_apply's,
// sign +1 forward, −1 backward; the decode preps' with +1).
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float sn, float sign, float& lo, float& hi) {
    const float s = __fmul_rn(sign, sn);
    lo = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// rope_rotate at position p, reading the table (NaN past it), for the decode preps.
__device__ __forceinline__ void rope_pair(float a, float b, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, u32 p, u32 max_pos, u32 half, u32 i,
                                          float& lo, float& hi) {
    if (p >= max_pos) {
        lo = __int_as_float(0x7fc00000);
        hi = lo;
        return;
    }
    rope_rotate(a, b, cos_t[(u64)p * half + i], sin_t[(u64)p * half + i], 1.0f, lo, hi);
}

// One head of a decode step's q or k, by one warp, for D = 32·NW (NW even), in two steps so
// that a kernel can issue the loads early and use them later. decode_prep_load reads the head's
// row x (lane l: x[l + 32w], w < NW), the RMSNorm weights (w_norm not null), and the RoPE table
// entries of the lane's rotation pairs i = 32w + lane, i + D/2 (w < NW/2) at position p (none
// past the table). decode_prep_finish: with the norm, x <- (x·rs)·w as rmsnorm_fwd does at its
// blockDim = row_threads(D) = D (each "warp" w of that block summed by the same xor butterfly,
// side by side in registers, then the NW warp sums by one more butterfly over the lanes holding
// them, zeros beyond, as block_sum does: the same bits); then rope_pair's rotation (NaN past
// the table). lo[w] / hi[w] are the rotated pair.
template <int NW>
struct DecodePrepRow {
    float x[NW], w[NW], c[NW / 2], s[NW / 2];
    bool norm, rotate;
};
template <int NW>
__device__ __forceinline__ void decode_prep_load(const float* x, const float* __restrict__ w_norm, u32 d,
                                                 const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                 u32 p, u32 max_pos, DecodePrepRow<NW>& r) {
    const u32 lane = threadIdx.x & 31, half = d / 2;
    r.norm = w_norm != nullptr;
    r.rotate = p < max_pos;
#pragma unroll
    for (int w = 0; w < NW; ++w) r.x[w] = x[32 * w + lane];
    if (r.norm)
#pragma unroll
        for (int w = 0; w < NW; ++w) r.w[w] = w_norm[32 * w + lane];
    if (r.rotate)
#pragma unroll
        for (int w = 0; w < NW / 2; ++w) {
            r.c[w] = cos_t[(u64)p * half + 32 * w + lane];
            r.s[w] = sin_t[(u64)p * half + 32 * w + lane];
        }
}
template <int NW>
__device__ __forceinline__ void decode_prep_finish(const DecodePrepRow<NW>& r, float eps, u32 d, float (&lo)[NW / 2],
                                                   float (&hi)[NW / 2]) {
    const u32 lane = threadIdx.x & 31;
    float xv[NW];
#pragma unroll
    for (int w = 0; w < NW; ++w) xv[w] = r.x[w];
    if (r.norm) {
        float t = 0.0f;  // lane w < NW: warp w's sum, as block_sum's scratch[lane]
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float sw = warp_sum(__fadd_rn(0.0f, __fmul_rn(xv[w], xv[w])));
            t = lane == (u32)w ? sw : t;
        }
        const float rs = rms_rstd_of_sum(warp_sum(t), d, eps);
#pragma unroll
        for (int w = 0; w < NW; ++w) xv[w] = __fmul_rn(__fmul_rn(xv[w], rs), r.w[w]);
    }
    constexpr int HW = NW / 2;
#pragma unroll
    for (int w = 0; w < HW; ++w) {
        if (!r.rotate) {  // rope_pair past the table
            lo[w] = __int_as_float(0x7fc00000);
            hi[w] = lo[w];
            continue;
        }
        rope_rotate(xv[w], xv[w + HW], r.c[w], r.s[w], 1.0f, lo[w], hi[w]);
    }
}
template <int NW>
__device__ __forceinline__ void decode_prep_head(const float* x, const float* __restrict__ w_norm, float eps, u32 d,
                                                 const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                 u32 p, u32 max_pos, float (&lo)[NW / 2], float (&hi)[NW / 2]) {
    DecodePrepRow<NW> r;
    decode_prep_load<NW>(x, w_norm, d, cos_t, sin_t, p, max_pos, r);
    decode_prep_finish<NW>(r, eps, d, lo, hi);
}

#define BUSY_NONE 0xFFFFFFFFu
// The y-th expert (from 0, ascending) that has rows (expert_rows), or BUSY_NONE
// when fewer than y + 1 experts have any (ops_qgemm's fragment kernels on grids of fewer block
// rows than experts). Warp 0 scans the offsets 32 experts at a time; every thread of the block
// must call it (one barrier) and gets the result.
__device__ __forceinline__ u32 nth_busy_expert(const u32* __restrict__ off, u32 E, u32 R, u32 y) {
    __shared__ u32 found_s;
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
        u32 carry = 0, found = BUSY_NONE;
        for (u32 base = 0; base < E && found == BUSY_NONE; base += 32) {
            const u32 e = base + lane;
            u32 lo = 0, hi = 0;
            if (e < E) expert_rows(off, e, R, lo, hi);
            const u32 busy = __ballot_sync(FULL_MASK, lo < hi);
            const u32 before = carry + __popc(busy & ((1u << lane) - 1u));
            const u32 hit = __ballot_sync(FULL_MASK, lo < hi && before == y);
            if (hit != 0u) found = base + (u32)__ffs(hit) - 1u;
            carry += __popc(busy);
        }
        if (lane == 0) found_s = found;
    }
    __syncthreads();
    return found_s;
}

// ---- MoE dispatch of up to MOE_SMALL_THREADS flat entries in one block (ops_moe's
// moe_dispatch_small and ops_router's fused router + dispatch share it).
#define MOE_INVALID 0xFFFFFFFFu
#define MOE_SMALL_THREADS 1024
#define MOE_SMALL_WARPS (MOE_SMALL_THREADS / 32)

__device__ __forceinline__ u32 moe_warp_incl_scan_u32(u32 v) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u32 t = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// The exclusive scan over experts by one warp (every lane calls it): off[x] = offsets[x] =
// Σ_{x' < x} counts[x'] for x < e, offsets[e] = Σ_x counts[x], 32 experts per step with the
// carry between steps. counts may be off itself (each lane reads its entry before writing it).
__device__ __forceinline__ void moe_expert_scan_warp(const u32* counts, u32 e, u32* off, u32* __restrict__ offsets) {
    const u32 lane = threadIdx.x & 31;
    u32 carry = 0;
    for (u32 base = 0; base < e; base += 32) {
        const u32 x = base + lane;
        const u32 v = x < e ? counts[x] : 0;
        const u32 inc = moe_warp_incl_scan_u32(v);
        if (x < e) {
            off[x] = carry + inc - v;
            offsets[x] = carry + inc - v;
        }
        carry += __shfl_sync(FULL_MASK, inc, 31);
    }
    if (lane == 0) offsets[e] = carry;
}

// Dispatch of the flat entries ids[0..total) (total <= MOE_SMALL_THREADS; an id >= e is dropped)
// by one block of MOE_SMALL_THREADS threads: entry i = threadIdx.x; per-warp counts, per-expert
// prefix over warps, exclusive scan over experts, then pos = offsets[x] + earlier warps + lanes
// below. offsets[0..=e], perm[pos] = i and row_of[i] = pos (MOE_INVALID for a dropped id): the
// stable counting sort of mxrl_tensor::moe::Dispatch (integer counts: no order dependence).
// Shared: tab[MOE_SMALL_WARPS·e], off[e]. Every thread of the block must call it (barriers);
// ids may have been written by this block before a __syncthreads().
__device__ __forceinline__ void moe_dispatch_block(const u32* ids, u32 total, u32 e, u32* __restrict__ offsets,
                                                   u32* __restrict__ perm, u32* __restrict__ row_of, u32* tab,
                                                   u32* off) {
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u32 x = tid < total ? ids[tid] : MOE_INVALID;
    if (x >= e) x = MOE_INVALID;
    const u32 same = __match_any_sync(FULL_MASK, x);
    const u32 below = __popc(same & ((1u << lane) - 1u));
    for (u32 j = tid; j < MOE_SMALL_WARPS * e; j += MOE_SMALL_THREADS) tab[j] = 0;
    __syncthreads();
    if (x != MOE_INVALID && below == 0) tab[warp * e + x] = __popc(same);
    __syncthreads();
    for (u32 xx = tid; xx < e; xx += MOE_SMALL_THREADS) {
        u32 run = 0;
        for (u32 w = 0; w < MOE_SMALL_WARPS; ++w) {
            const u32 c = tab[w * e + xx];
            tab[w * e + xx] = run;
            run += c;
        }
        off[xx] = run;
    }
    __syncthreads();
    if (warp == 0) moe_expert_scan_warp(off, e, off, offsets);
    __syncthreads();
    if (tid < total) {
        if (x != MOE_INVALID) {
            const u32 pos = off[x] + tab[warp * e + x] + below;
            perm[pos] = tid;
            row_of[tid] = pos;
        } else {
            row_of[tid] = MOE_INVALID;
        }
    }
}

// The most experts per token the MoE kernels take (their per-token shared tables).
#define MOE_MAX_TOP_K 256

// Token t's packed rows (rows_s[s] = row_of[t*k + s]), weights (w_s[s] = w[t*k + s] when w is
// given) and its valid slots in ascending packed row order (order_s[0..nvalid)): ascending row
// = ascending expert (then slot), the order in which the CPU reference visits a token's
// experts. Every thread of the block returns nvalid.
__device__ __forceinline__ u32 moe_token_order(const u32* __restrict__ row_of, const float* __restrict__ w,
                                               u64 t, u32 k, u32* rows_s, float* w_s, u32* order_s) {
    for (u32 s = threadIdx.x; s < k; s += blockDim.x) {
        rows_s[s] = row_of[t * k + s];
        if (w) w_s[s] = w[t * k + s];
    }
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

#endif
