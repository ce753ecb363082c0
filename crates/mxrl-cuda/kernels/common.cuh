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

#endif

// Pass slots of the grouped fragment kernels (ops_qgemm, ops_fp8block): the passes of X rows
// over every expert's rows [min(off[e], R), min(off[e + 1], R)), in expert order (expert e has ⌈rows_e / X⌉ of them, none without rows), one block per slot and column
// block, so a busy expert's passes run side by side instead of one after another. Finds slot
// `slot`'s expert and rows [lo, hi) (at most X); false past the last slot. Each warp scans the
// experts 32 at a time (lane i: expert base + i; an inclusive prefix of the pass counts by
// shuffles), so every lane of the block gets the same answer.
__device__ __forceinline__ bool expert_pass_slot(const u32* __restrict__ off, u32 E, u32 R, u32 X, u32 slot,
                                             u32& e_out, u32& lo, u32& hi) {
    const u32 lane = threadIdx.x & 31;
    u32 rem = slot;
    for (u32 base = 0; base < E; base += 32) {
        const u32 e = base + lane;
        u32 np = 0;
        if (e < E) {
            const u32 h = min(off[e + 1], R);
            np = (h - min(off[e], h) + X - 1) / X;
        }
        u32 inc = np;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 v = __shfl_up_sync(FULL_MASK, inc, o);
            if (lane >= (u32)o) inc += v;
        }
        const u32 total = __shfl_sync(FULL_MASK, inc, 31);
        if (rem < total) {
            const u32 src = __ffs(__ballot_sync(FULL_MASK, inc > rem)) - 1;
            const u32 before = __shfl_sync(FULL_MASK, inc - np, src);
            e_out = base + src;
            const u32 h = min(off[e_out + 1], R);
            lo = min(off[e_out], h) + (rem - before) * X;
            hi = min(lo + X, h);
            return true;
        }
        rem -= total;
    }
    return false;
}
