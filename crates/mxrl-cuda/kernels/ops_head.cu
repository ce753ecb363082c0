// The lm_head's fused log-softmax / per-token logprob / entropy over vocabulary chunks, and the
// logits gradient of a chunk. References (mxrl_tensor::loss): logprobs_forward (lse, logprob),
// logprobs_backward (dz); entropy = mxrl_rl::sampling::entropy of the tempered log-softmax.
//
// Running state of a row t over the chunks seen so far (f32, [4, T] row-major):
//   st[t]      = m  : max of y = z·(1/τ)
//   st[T + t]  = s  : Σ exp(y − m)
//   st[2T + t] = q  : Σ exp(y − m)·(y − m)
//   st[3T + t] = y_target (NaN until the chunk holding the target is seen)
// so that lse = m + ln s, logprob = y_target − lse and entropy = ln s − q/s.

#define NEG_INF (-__int_as_float(0x7f800000))

// st ← (−∞, 0, 0, NaN) for every row t < T.
extern "C" __global__ void head_init(float* __restrict__ st, u64 T) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        st[t] = NEG_INF;
        st[T + t] = 0.0f;
        st[2 * T + t] = 0.0f;
        st[3 * T + t] = __int_as_float(0x7fc00000);
    }
}

// One block per row t < T (gridDim.x = T): folds the chunk z[t, 0..cols) (vocabulary columns
// c0..c0+cols) into the row's running state. blockDim.x is a multiple of 32.
extern "C" __global__ void head_chunk_fwd(const float* __restrict__ z, u64 cols, u64 c0,
                                          const u32* __restrict__ targets, float inv_t,
                                          float* __restrict__ st, u64 T) {
    __shared__ float red[32];
    const u64 t = blockIdx.x;
    const float* zr = z + t * cols;
    float mx = NEG_INF;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, __fmul_rn(zr[j], inv_t));
    mx = block_max(mx, red);
    float s = 0.0f, q = 0.0f;
    if (mx != NEG_INF) {
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {
            const float d = __fsub_rn(__fmul_rn(zr[j], inv_t), mx);
            const float e = expf(d);
            s = __fadd_rn(s, e);
            q = __fadd_rn(q, __fmul_rn(e, d));
        }
    }
    s = block_sum(s, red);
    q = block_sum(q, red);
    if (threadIdx.x == 0) {
        const u64 tg = targets[t];
        if (tg >= c0 && tg < c0 + cols) st[3 * T + t] = __fmul_rn(zr[tg - c0], inv_t);
        const float m0 = st[t], s0 = st[T + t], q0 = st[2 * T + t];
        const float m1 = fmaxf(m0, mx);
        float s1 = 0.0f, q1 = 0.0f;
        if (m0 != NEG_INF) {
            const float d0 = __fsub_rn(m0, m1);
            const float a0 = expf(d0);
            s1 = __fmul_rn(a0, s0);
            q1 = __fmul_rn(a0, __fadd_rn(q0, __fmul_rn(d0, s0)));
        }
        if (mx != NEG_INF) {
            const float d1 = __fsub_rn(mx, m1);
            const float a1 = expf(d1);
            s1 = __fadd_rn(s1, __fmul_rn(a1, s));
            q1 = __fadd_rn(q1, __fmul_rn(a1, __fadd_rn(q, __fmul_rn(d1, s))));
        }
        st[t] = m1;
        st[T + t] = s1;
        st[2 * T + t] = q1;
    }
}

// Row t < T: lse = m + ln s, logprob = y_target − lse, entropy = ln s − q/s.
extern "C" __global__ void head_finish(const float* __restrict__ st, float* __restrict__ logprob,
                                       float* __restrict__ lse, float* __restrict__ entropy,
                                       u64 T) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < T) {
        const float m = st[t], s = st[T + t], q = st[2 * T + t], yt = st[3 * T + t];
        const float ls = logf(s);
        const float l = __fadd_rn(m, ls);
        lse[t] = l;
        logprob[t] = __fsub_rn(yt, l);
        entropy[t] = __fsub_rn(ls, __fdiv_rn(q, s));
    }
}

// In place over the chunk z[T, cols] (vocabulary columns c0..c0+cols):
// dz[t, j] = −g·exp(z·(1/τ) − lse[t]) (+ g at the target), g = dlogprob[t]·(1/τ). Grid-stride.
extern "C" __global__ void head_chunk_bwd(float* __restrict__ z, u64 cols, u64 c0,
                                          const u32* __restrict__ targets,
                                          const float* __restrict__ lse,
                                          const float* __restrict__ dlogprob, float inv_t, u64 T) {
    const u64 n = T * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / cols, j = i - t * cols;
        const float g = __fmul_rn(dlogprob[t], inv_t);
        const float e = expf(__fsub_rn(__fmul_rn(z[i], inv_t), lse[t]));
        float d = __fmul_rn(-g, e);
        if ((u64)targets[t] == c0 + j) d = __fadd_rn(d, g);
        z[i] = d;
    }
}

// out[i] = f32(x[i]) for bf16 bit patterns x, i < n. Grid-stride.
extern "C" __global__ void head_bf16_to_f32(const u16* __restrict__ x, float* __restrict__ out,
                                            u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(x[i]);
}

// Splits f32 values into three BF16 parts, x ≈ hi + mid + lo: hi = bf16(x), mid = bf16(x − hi),
// lo = bf16(x − hi − mid) (common.cuh's split_bf16x3; each difference is exact in f32), so |x − (hi + mid + lo)| ≤
// 2⁻²⁴·|x| for normal values and the three BF16 GEMMs of the parts reproduce the f32 operand's
// products exactly. Grid-stride over i < n.
extern "C" __global__ void head_split_bf16x3(const float* __restrict__ x, u16* __restrict__ hi,
                                             u16* __restrict__ mid, u16* __restrict__ lo,
                                             u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u16 a, b, c;
        split_bf16x3(x[i], a, b, c);
        hi[i] = a;
        mid[i] = b;
        lo[i] = c;
    }
}
