// AdamW on f32 master weights with the BF16 copy written in the same pass, the global gradient
// norm (deterministic two-stage f64 reduction) and gradient scaling. References
// (mxrl_tensor::optim): adamw_update, global_grad_norm, clip_grad_norm.

// One AdamW step over i < n (common.cuh's adamw_elem, the operation order of
// mxrl_tensor::optim::adamw_update in f32) with p_bf16 = bf16(p) written when write_bf16 != 0.
// Grid-stride.
extern "C" __global__ void adamw_step(float* __restrict__ p, const float* __restrict__ grad,
                                      float* __restrict__ m, float* __restrict__ v,
                                      u16* __restrict__ p_bf16, int write_bf16,
                                      const float* __restrict__ scale,
                                      u64 n, float beta1, float beta2, float one_m_beta1,
                                      float one_m_beta2, float eps, float step_size,
                                      float bc2_sqrt, float decay) {
    const float sc = scale[0];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_elem(grad[i], sc, pi, mi, vi, beta1, beta2, one_m_beta1, one_m_beta2, eps, step_size,
                   bc2_sqrt, decay);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        if (write_bf16) p_bf16[i] = f32_to_bf16(pi);
    }
}

// adamw_step over n8 chunks of eight elements (float4 accesses; every buffer 16-byte aligned,
// n = 8·n8): the same update per element (adamw8 → adamw_elem), so the same bits.
extern "C" __global__ void __launch_bounds__(256)
    adamw_step8(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16,
                const float* __restrict__ scale, u64 n8, float beta1, float beta2, float one_m_beta1,
                float one_m_beta2, float eps, float step_size, float bc2_sqrt, float decay) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n8) return;
    float w[8];
    adamw8(p, grad, m, v, p_bf16, write_bf16, scale[0], t * 8, w, beta1, beta2, one_m_beta1, one_m_beta2,
           eps, step_size, bc2_sqrt, decay);
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block sum of doubles (blockDim.x a multiple of 32); every thread returns the total.
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < nw ? scratch[lane] : 0.0;
    return warp_sum_f64(t);
}

// Stage 1: block b of gridDim.x writes partial[b] = Σ x[i]² (f64, exact squares) over the
// grid-stride set i ≡ b·blockDim + thread (mod gridDim·blockDim), i < n. The grid size is a
// function of n alone (the launcher's), so the tree is fixed.
extern "C" __global__ void sumsq_partial(const float* __restrict__ x, u64 n,
                                         double* __restrict__ partial) {
    __shared__ double red[32];
    double acc = 0.0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    // Four loads in flight per thread; the squares are added in the same grid-stride order.
    for (; i + 3 * stride < n; i += 4 * stride) {
        const double d0 = (double)x[i], d1 = (double)x[i + stride];
        const double d2 = (double)x[i + 2 * stride], d3 = (double)x[i + 3 * stride];
        acc = __dadd_rn(acc, __dmul_rn(d0, d0));
        acc = __dadd_rn(acc, __dmul_rn(d1, d1));
        acc = __dadd_rn(acc, __dmul_rn(d2, d2));
        acc = __dadd_rn(acc, __dmul_rn(d3, d3));
    }
    for (; i < n; i += stride) {
        const double d = (double)x[i];
        acc = __dadd_rn(acc, __dmul_rn(d, d));
    }
    acc = block_sum_f64(acc, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Stage 2 (one block): total = Σ partial[0..np) in a fixed order; out_norm[0] = √total;
// out_scale[0] = f32(max_norm / (norm + 1e-6)) when that is < 1 (clip_grad_norm's
// coefficient), else 1. max_norm < 0 disables clipping (scale 1).
extern "C" __global__ void sumsq_final(const double* __restrict__ partial, u64 np,
                                       double max_norm, double* __restrict__ out_norm,
                                       float* __restrict__ out_scale) {
    __shared__ double red[32];
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < np; i += blockDim.x) acc = __dadd_rn(acc, partial[i]);
    acc = block_sum_f64(acc, red);
    if (threadIdx.x == 0) {
        const double norm = __dsqrt_rn(acc);
        out_norm[0] = norm;
        float sc = 1.0f;
        if (max_norm >= 0.0) {
            const double coef = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
            if (coef < 1.0) sc = __double2float_rn(coef);
        }
        out_scale[0] = sc;
    }
}

// x[i] ← x[i]·scale[0], i < n (clipping by the coefficient of sumsq_final). Grid-stride.
extern "C" __global__ void scale_inplace(float* __restrict__ x, const float* __restrict__ scale,
                                         u64 n) {
    const float sc = scale[0];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], sc);
}
