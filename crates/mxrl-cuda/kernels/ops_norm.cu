// RMSNorm forward and backward. Reference: mxrl_tensor::norm::{rmsnorm_forward, rmsnorm_backward}.
// Every per-element operation is the reference's, in the same order; only the row sums (sum of
// squares, the backward's dot) and the dw sum over rows are summed in a different fixed order.

// One block per row r < rows (blockDim.x a multiple of 32). x: [rows, d]; w: [d]; rstd: [rows].
// rstd[r] = 1 / sqrt(sum_j x[r,j]^2 / d + eps); v[r,j] = (x[r,j] * rstd[r]) * w[j], written as
// f32 to y (F32) and as bf16(v) bit patterns (round to nearest even) to yb (B16).
template <bool F32, bool B16>
__device__ __forceinline__ void rmsnorm_fwd_rows(const float* __restrict__ x, const float* __restrict__ w,
                                                 float* __restrict__ y, u16* __restrict__ yb,
                                                 float* __restrict__ rstd, u32 d, float eps) {
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const float* xr = x + r * d;
    const float rs = rms_row_rstd(xr, d, eps, scratch);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = __fmul_rn(__fmul_rn(xr[j], rs), w[j]);
        if (F32) y[r * d + j] = v;
        if (B16) yb[r * d + j] = f32_to_bf16(v);
    }
}

// y = the f32 rows.
extern "C" __global__ void rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, float* __restrict__ rstd, u32 d,
                                       float eps) {
    rmsnorm_fwd_rows<true, false>(x, w, y, nullptr, rstd, d, eps);
}

// y = their bf16 bit patterns: rmsnorm_fwd followed by to_bf16 in one pass, bitwise.
extern "C" __global__ void rmsnorm_fwd_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                            u16* __restrict__ y, float* __restrict__ rstd, u32 d,
                                            float eps) {
    rmsnorm_fwd_rows<false, true>(x, w, nullptr, y, rstd, d, eps);
}

// Both in one pass: y (f32) and yb = bf16(y), bitwise.
extern "C" __global__ void rmsnorm_fwd_both(const float* __restrict__ x, const float* __restrict__ w,
                                            float* __restrict__ y, u16* __restrict__ yb,
                                            float* __restrict__ rstd, u32 d, float eps) {
    rmsnorm_fwd_rows<true, true>(x, w, y, yb, rstd, d, eps);
}

// The residual sum and the norm of its rows in one pass, one block per row r < rows:
// x[r,j] = x[r,j] + res[r,j] (written back: add_inplace's sum), then rmsnorm_fwd_rows of the
// new x into y (f32, when not null) and yb (BF16 bits, when not null) — the bits of add_inplace
// followed by rmsnorm_fwd / _bf16 / _both. Each thread sums its squares over the columns
// rms_row_rstd gives it, in the same order, and reads back only the sums it wrote itself.
extern "C" __global__ void add_rmsnorm_fwd(float* x, const float* __restrict__ res,
                                           const float* __restrict__ w, float* __restrict__ y,
                                           u16* __restrict__ yb, float* __restrict__ rstd, u32 d,
                                           float eps) {
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    float* xr = x + r * d;
    const float* rr = res + r * d;
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = __fadd_rn(xr[j], rr[j]);
        xr[j] = v;
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    const float rs = rms_rstd_of_sum(block_sum(ss, scratch), d, eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = __fmul_rn(__fmul_rn(xr[j], rs), w[j]);
        if (y != nullptr) y[r * d + j] = v;
        if (yb != nullptr) yb[r * d + j] = f32_to_bf16(v);
    }
}

// dx of the backward, one block per row r < rows:
// dot = sum_j (w[j] * dy[r,j]) * x[r,j]; c = ((dot * rs) * rs) * rs / d;
// dx[r,j] = (rs * w[j]) * dy[r,j] - x[r,j] * c (overwritten).
extern "C" __global__ void rmsnorm_bwd_dx(const float* __restrict__ dy, const float* __restrict__ x,
                                          const float* __restrict__ w, const float* __restrict__ rstd,
                                          float* __restrict__ dx, u32 d) {
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const float rs = rstd[r];
    float dot = 0.0f;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x)
        dot = __fadd_rn(dot, __fmul_rn(__fmul_rn(w[j], dyr[j]), xr[j]));
    dot = block_sum(dot, scratch);
    const float c = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(dot, rs), rs), rs), (float)d);
    float* dxr = dx + r * d;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x)
        dxr[j] = __fsub_rn(__fmul_rn(__fmul_rn(rs, w[j]), dyr[j]), __fmul_rn(xr[j], c));
}

// dw partial sums: block (blockIdx.x, chunk = blockIdx.y); thread column j < d sums the rows
// chunk*rows_per_chunk .. min(rows, (chunk+1)*rows_per_chunk) in increasing order:
// partial[chunk, j] = sum_r (dy[r,j] * x[r,j]) * rstd[r].
extern "C" __global__ void rmsnorm_bwd_dw_partial(const float* __restrict__ dy,
                                                  const float* __restrict__ x,
                                                  const float* __restrict__ rstd,
                                                  float* __restrict__ partial, u32 rows, u32 d,
                                                  u32 rows_per_chunk) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    const u32 chunk = blockIdx.y;
    const u32 r0 = chunk * rows_per_chunk;
    const u32 r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    for (u32 r = r0; r < r1; ++r) {
        const u64 o = (u64)r * d + j;
        acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(dy[o], x[o]), rstd[r]));
    }
    partial[(u64)chunk * d + j] = acc;
}

// dw[j] += sum_{c < chunks} partial[c, j], chunks summed in increasing order, j < d.
extern "C" __global__ void rmsnorm_bwd_dw_reduce(const float* __restrict__ partial,
                                                 float* __restrict__ dw, u32 chunks, u32 d) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float acc = 0.0f;
    for (u32 c = 0; c < chunks; ++c) acc = __fadd_rn(acc, partial[(u64)c * d + j]);
    dw[j] = __fadd_rn(dw[j], acc);
}
