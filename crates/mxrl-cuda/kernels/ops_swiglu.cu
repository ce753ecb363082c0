// SwiGLU forward and backward on a fused gate/up activation gu [rows, 2F] (gate in columns
// 0..F, up in F..2F). Reference: mxrl_tensor::activation::{swiglu_forward, swiglu_backward}
// (the same f32 operation sequence, no FMA contraction); exp and silu are common.cuh's
// swiglu_exp / swiglu_silu (shared with the fused small-M gate/up kernel of ops_gemm.cu); the
// bound is mxrl_tensor::tolerance::swiglu_{forward,backward}_bound(s) with one ulp per device.

// Rows r = blockIdx.x, blockIdx.x + gridDim.x, ... (grid-stride); columns j = threadIdx.x,
// threadIdx.x + blockDim.x, ... < f: no index division, coalesced rows.

// h[r, j] = silu(gu[r, j]) * gu[r, F + j].
extern "C" __global__ void swiglu_fwd(const float* __restrict__ gu, float* __restrict__ h,
                                      u64 rows, u64 f) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2 * f;
        for (u64 j = threadIdx.x; j < f; j += blockDim.x) h[r * f + j] = __fmul_rn(swiglu_silu(g[j]), g[f + j]);
    }
}

// As swiglu_fwd, also writing hb[r, j] = bf16(h[r, j]) (bit patterns, round to nearest even).
extern "C" __global__ void swiglu_fwd_bf16(const float* __restrict__ gu, float* __restrict__ h,
                                           u16* __restrict__ hb, u64 rows, u64 f) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2 * f;
        for (u64 j = threadIdx.x; j < f; j += blockDim.x) {
            const float v = __fmul_rn(swiglu_silu(g[j]), g[f + j]);
            h[r * f + j] = v;
            hb[r * f + j] = f32_to_bf16(v);
        }
    }
}

// hb[r, j] = bf16(silu(gu[r, j]) * gu[r, F + j]) only: swiglu_fwd_bf16's hb without its h.
extern "C" __global__ void swiglu_fwd_bf16_only(const float* __restrict__ gu, u16* __restrict__ hb, u64 rows,
                                                u64 f) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2 * f;
        for (u64 j = threadIdx.x; j < f; j += blockDim.x)
            hb[r * f + j] = f32_to_bf16(__fmul_rn(swiglu_silu(g[j]), g[f + j]));
    }
}

// dgu[r, j]     = (dh·up)·(s·(1 + g·(1 − s))),  s = 1/(1 + exp(−g))
// dgu[r, F + j] = dh·(g·s)
// T: float (the f32 values) or u16 (their BF16 bit patterns only, round to nearest even).
__device__ __forceinline__ void swiglu_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void swiglu_store(u16* p, float v) { *p = f32_to_bf16(v); }

template <typename T>
__device__ __forceinline__ void swiglu_bwd_rows(const float* __restrict__ dh, const float* __restrict__ gu,
                                                T* __restrict__ dgu, u64 rows, u64 f) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* gr = gu + r * 2 * f;
        T* dr = dgu + r * 2 * f;
        for (u64 j = threadIdx.x; j < f; j += blockDim.x) {
            const float g = gr[j], u = gr[f + j];
            const float d = dh[r * f + j];
            const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, swiglu_exp(-g)));
            const float c = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
            swiglu_store(dr + j, __fmul_rn(__fmul_rn(d, u), c));
            swiglu_store(dr + f + j, __fmul_rn(d, __fmul_rn(g, s)));
        }
    }
}

extern "C" __global__ void swiglu_bwd(const float* __restrict__ dh, const float* __restrict__ gu,
                                      float* __restrict__ dgu, u64 rows, u64 f) {
    swiglu_bwd_rows<float>(dh, gu, dgu, rows, f);
}

// swiglu_bwd writing bf16(dgu) only: the bits of swiglu_bwd followed by to_bf16.
extern "C" __global__ void swiglu_bwd_bf16(const float* __restrict__ dh, const float* __restrict__ gu,
                                           u16* __restrict__ dgu, u64 rows, u64 f) {
    swiglu_bwd_rows<u16>(dh, gu, dgu, rows, f);
}
