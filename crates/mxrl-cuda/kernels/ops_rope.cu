// Rotary position embedding (rotate-half form), in place. Reference:
// mxrl_tensor::rope::{rope_forward, rope_backward}: the same two products and one sum per output,
// so the result is bitwise the reference's for the same table values.

// x: [n, heads * 2 * half]; cos, sin: [max_pos, half]; pos: [n]. One thread per (row, head, i),
// i < half: with c = cos[pos, i], s = sign * sin[pos, i] (sign = +1 forward, -1 backward),
// x[i] <- x[i]*c - x[i+half]*s, x[i+half] <- x[i+half]*c + x[i]*s. A position >= max_pos has no
// table row: its outputs become NaN (never an out-of-bounds read).
extern "C" __global__ void rope_apply(float* __restrict__ x, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, const u32* __restrict__ pos,
                                      u64 n, u32 heads, u32 half, u32 max_pos, float sign) {
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 per_row = (u64)heads * half;
    if (idx >= n * per_row) return;
    const u64 t = idx / per_row;
    const u32 rem = (u32)(idx - t * per_row);
    const u32 h = rem / half, i = rem - h * half;
    float* v = x + (t * heads + h) * (2 * (u64)half);
    const u32 p = pos[t];
    if (p >= max_pos) {
        v[i] = __int_as_float(0x7fc00000);
        v[i + half] = __int_as_float(0x7fc00000);
        return;
    }
    rope_rotate(v[i], v[i + half], cos_t[(u64)p * half + i], sin_t[(u64)p * half + i], sign, v[i], v[i + half]);
}

// The decode preps' output of the rotated pair (lo, hi) = (x[i], x[i + half]): back to the row,
// and for an appended k row its BF16 to the cache row at o.
__device__ __forceinline__ void rope_store(float* __restrict__ x, u16* __restrict__ kc, u64 o, u32 i, u32 half,
                                           float lo, float hi, bool append) {
    x[i] = lo;
    x[i + half] = hi;
    if (append) {
        kc[o + i] = f32_to_bf16(lo);
        kc[o + i + half] = f32_to_bf16(hi);
    }
}

// A decode step's attention inputs in one pass (Backend::decode_attn_prep): block (r, h) of grid
// (rows, hq + hkv), blockDim = the RMSNorm kernels' row_threads(D) (so the row sum runs the same
// reduction tree as rmsnorm_fwd: bitwise its result). Head h < hq is q's head h, else k's head
// h - hq. With `norm`: x ← (x·rs)·w as rmsnorm_fwd (rs = 1/sqrt(Σx²/D + eps)); then rope_apply's
// rotation (sign +1) at pos[r], NaN past the table; the rotated row is written back to q / k,
// and for a k head, with len = lens[r] ∈ [1, max_len], bf16 of it and of v's head to the caches
// at [r, len - 1, h - hq] (kv_append's bytes). Shared memory: D floats.
extern "C" __global__ void decode_attn_prep(float* __restrict__ q, float* __restrict__ k,
                                            const float* __restrict__ v, const float* __restrict__ wq,
                                            const float* __restrict__ wk, int norm, float eps, u32 hq,
                                            u32 hkv, u32 d, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, const u32* __restrict__ pos,
                                            u32 max_pos, const u32* __restrict__ lens, u32 max_len,
                                            u16* __restrict__ kc, u16* __restrict__ vc) {
    extern __shared__ float rowbuf[];
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const u32 h = blockIdx.y;
    const bool is_q = h < hq;
    const u32 kh = h - hq;
    float* x = is_q ? q + (r * hq + h) * (u64)d : k + (r * hkv + kh) * (u64)d;
    if (norm) {
        const float* w = is_q ? wq : wk;
        const float rs = rms_row_rstd(x, d, eps, scratch);
        for (u32 j = threadIdx.x; j < d; j += blockDim.x) rowbuf[j] = __fmul_rn(__fmul_rn(x[j], rs), w[j]);
    } else {
        for (u32 j = threadIdx.x; j < d; j += blockDim.x) rowbuf[j] = x[j];
    }
    __syncthreads();
    const u32 half = d / 2, p = pos[r];
    const u32 len = lens[r];
    const bool append = !is_q && len != 0 && len <= max_len;
    const u64 kvw = (u64)hkv * d;
    const u64 o = ((u64)r * max_len + (len - 1)) * kvw + (u64)kh * d;
    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        float lo, hi;
        rope_pair(rowbuf[i], rowbuf[i + half], cos_t, sin_t, p, max_pos, half, i, lo, hi);
        rope_store(x, kc, o, i, half, lo, hi, append);
    }
    if (append) {
        const float* vr = v + (r * hkv + kh) * (u64)d;
        for (u32 j = threadIdx.x; j < d; j += blockDim.x) vc[o + j] = f32_to_bf16(vr[j]);
    }
}

// decode_attn_prep with one warp per (row, head) and DPW_HEADS of them per block, for D = 64,
// 128 or 256 (NW = D/32 elements per lane; every head width of the supported models): the
// head's norm and rotation are decode_prep_head's (common.cuh), bitwise decode_attn_prep's.
// Item it = blockIdx.x·DPW_HEADS + warp is (r, h) = (it / (hq + hkv), it % (hq + hkv)).
#define DPW_HEADS 8
template <int NW>
__device__ __forceinline__ void dpw_body(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ wq, const float* __restrict__ wk, int norm, float eps,
                          u32 hq, u32 hkv, u32 d, const float* __restrict__ cos_t,
                          const float* __restrict__ sin_t, const u32* __restrict__ pos, u32 max_pos,
                          const u32* __restrict__ lens, u32 max_len, u16* __restrict__ kc,
                          u16* __restrict__ vc, u64 items) {
    const u32 lane = threadIdx.x & 31;
    const u64 it = (u64)blockIdx.x * DPW_HEADS + (threadIdx.x >> 5);
    if (it >= items) return;  // whole warps: no shuffle below misses a lane
    const u32 heads = hq + hkv;
    const u64 r = it / heads;
    const u32 h = (u32)(it - r * heads);
    const bool is_q = h < hq;
    const u32 kh = h - hq;
    float* x = is_q ? q + (r * hq + h) * (u64)d : k + (r * hkv + kh) * (u64)d;
    constexpr int HW = NW / 2;
    float lo[HW], hi[HW];
    decode_prep_head<NW>(x, norm ? (is_q ? wq : wk) : nullptr, eps, d, cos_t, sin_t, pos[r], max_pos, lo, hi);
    const u32 half = d / 2;
    const u32 len = lens[r];
    const bool append = !is_q && len != 0 && len <= max_len;
    const u64 o = ((u64)r * max_len + (len - 1)) * ((u64)hkv * d) + (u64)kh * d;
#pragma unroll
    for (int w = 0; w < HW; ++w) rope_store(x, kc, o, 32 * w + lane, half, lo[w], hi[w], append);
    if (append) {
        const float* vr = v + (r * hkv + kh) * (u64)d;
        for (u32 j = lane; j < d; j += 32) vc[o + j] = f32_to_bf16(vr[j]);
    }
}
#define DPW_ARGS                                                                                       \
    float *__restrict__ q, float *__restrict__ k, const float *__restrict__ v, const float *__restrict__ wq, \
        const float *__restrict__ wk, int norm, float eps, u32 hq, u32 hkv, u32 d,                     \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t, const u32 *__restrict__ pos,  \
        u32 max_pos, const u32 *__restrict__ lens, u32 max_len, u16 *__restrict__ kc,                   \
        u16 *__restrict__ vc, u64 items
#define DPW_ENTRY(name, NW)                                                                              \
    extern "C" __global__ void __launch_bounds__(DPW_HEADS * 32) name(DPW_ARGS) {                        \
        dpw_body<NW>(q, k, v, wq, wk, norm, eps, hq, hkv, d, cos_t, sin_t, pos, max_pos, lens, max_len, kc, \
                     vc, items);                                                                        \
    }
// Entries by D / 32: D = 64, 128, 256.
DPW_ENTRY(decode_attn_prep_w2, 2)
DPW_ENTRY(decode_attn_prep_w4, 4)
DPW_ENTRY(decode_attn_prep_w8, 8)
