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
    rmsnorm_scale_row<F32, B16>(xr, w, rs, y + (F32 ? r * d : 0), yb + (B16 ? r * d : 0), d);
}

// The kernels below take the argument list of their one-warp-per-row twins (`rows`: the grid
// has one block per row), so that the launcher picks either with the same arguments.

// y = the f32 rows.
extern "C" __global__ void rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, float* __restrict__ rstd, u32 rows,
                                       u32 d, float eps) {
    (void)rows;
    rmsnorm_fwd_rows<true, false>(x, w, y, nullptr, rstd, d, eps);
}

// y = their bf16 bit patterns: rmsnorm_fwd followed by to_bf16 in one pass, bitwise.
extern "C" __global__ void rmsnorm_fwd_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                            u16* __restrict__ y, float* __restrict__ rstd, u32 rows,
                                            u32 d, float eps) {
    (void)rows;
    rmsnorm_fwd_rows<false, true>(x, w, nullptr, y, rstd, d, eps);
}

// Both in one pass: y (f32) and yb = bf16(y), bitwise.
extern "C" __global__ void rmsnorm_fwd_both(const float* __restrict__ x, const float* __restrict__ w,
                                            float* __restrict__ y, u16* __restrict__ yb,
                                            float* __restrict__ rstd, u32 rows, u32 d, float eps) {
    (void)rows;
    rmsnorm_fwd_rows<true, true>(x, w, y, yb, rstd, d, eps);
}

// Rows of d <= 256 columns, one warp per row (blockDim.x / 32 rows per block; the per-head q/k
// norms' rows of head_dim): the bits of the one-block-per-row kernels above, whose block of
// ceil32(d) threads holds at most one column per thread. Lane l holds columns 32g + l
// (g < nw = ceil(d / 32)), the block's warp g's columns; each group is summed with the same
// butterfly (warp_sum) and the nw group sums with block_sum's last stage (warp_sum over lanes
// holding them, zeros beyond), so every sum is the same expression in the same order.
#define RW_GROUPS 8

// The row sum of q[g] (lane's column 32g + l, 0 past d) as block_sum computes it.
__device__ __forceinline__ float row_sum_groups(const float (&q)[RW_GROUPS], u32 nw, u32 lane) {
    float t = 0.0f;
#pragma unroll
    for (u32 g = 0; g < RW_GROUPS; ++g) {
        if (g < nw) {
            const float s = warp_sum(q[g]);
            if (lane == g) t = s;
        }
    }
    return warp_sum(t);
}

template <bool F32, bool B16>
__device__ __forceinline__ void rmsnorm_fwd_warp_rows(const float* __restrict__ x, const float* __restrict__ w,
                                                      float* __restrict__ y, u16* __restrict__ yb,
                                                      float* __restrict__ rstd, u32 rows, u32 d, float eps) {
    const u32 lane = threadIdx.x & 31;
    const u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // the whole warp
    const u32 nw = (d + 31) >> 5;
    const float* xr = x + r * d;
    float v[RW_GROUPS], q[RW_GROUPS];
#pragma unroll
    for (u32 g = 0; g < RW_GROUPS; ++g) {
        const u32 j = (g << 5) + lane;
        v[g] = (g < nw && j < d) ? xr[j] : 0.0f;
        q[g] = (j < d) ? __fadd_rn(0.0f, __fmul_rn(v[g], v[g])) : 0.0f;
    }
    const float rs = rms_rstd_of_sum(row_sum_groups(q, nw, lane), d, eps);
    if (lane == 0) rstd[r] = rs;
#pragma unroll
    for (u32 g = 0; g < RW_GROUPS; ++g) {
        const u32 j = (g << 5) + lane;
        if (g < nw && j < d) {
            const float o = __fmul_rn(__fmul_rn(v[g], rs), w[j]);
            if (F32) y[r * d + j] = o;
            if (B16) yb[r * d + j] = f32_to_bf16(o);
        }
    }
}

extern "C" __global__ void rmsnorm_fwd_w(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ y, float* __restrict__ rstd, u32 rows,
                                         u32 d, float eps) {
    rmsnorm_fwd_warp_rows<true, false>(x, w, y, nullptr, rstd, rows, d, eps);
}
extern "C" __global__ void rmsnorm_fwd_bf16_w(const float* __restrict__ x, const float* __restrict__ w,
                                              u16* __restrict__ y, float* __restrict__ rstd, u32 rows,
                                              u32 d, float eps) {
    rmsnorm_fwd_warp_rows<false, true>(x, w, nullptr, y, rstd, rows, d, eps);
}
extern "C" __global__ void rmsnorm_fwd_both_w(const float* __restrict__ x, const float* __restrict__ w,
                                              float* __restrict__ y, u16* __restrict__ yb,
                                              float* __restrict__ rstd, u32 rows, u32 d, float eps) {
    rmsnorm_fwd_warp_rows<true, true>(x, w, y, yb, rstd, rows, d, eps);
}

// rmsnorm_bwd_dx for rows of d <= 256, one warp per row (as rmsnorm_fwd_w; the same bits as
// rmsnorm_bwd_dx).
extern "C" __global__ void rmsnorm_bwd_dx_w(const float* __restrict__ dy, const float* __restrict__ x,
                                            const float* __restrict__ w, const float* __restrict__ rstd,
                                            float* __restrict__ dx, u32 rows, u32 d) {
    const u32 lane = threadIdx.x & 31;
    const u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // the whole warp
    const u32 nw = (d + 31) >> 5;
    const float* xr = x + r * d;
    const float* dyr = dy + r * d;
    const float rs = rstd[r];
    float xv[RW_GROUPS], dv[RW_GROUPS], wv[RW_GROUPS], q[RW_GROUPS];
#pragma unroll
    for (u32 g = 0; g < RW_GROUPS; ++g) {
        const u32 j = (g << 5) + lane;
        const bool in = g < nw && j < d;
        xv[g] = in ? xr[j] : 0.0f;
        dv[g] = in ? dyr[j] : 0.0f;
        wv[g] = in ? w[j] : 0.0f;
        q[g] = (j < d) ? __fadd_rn(0.0f, __fmul_rn(__fmul_rn(wv[g], dv[g]), xv[g])) : 0.0f;
    }
    const float dot = row_sum_groups(q, nw, lane);
    const float c = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(dot, rs), rs), rs), (float)d);
    float* dxr = dx + r * d;
#pragma unroll
    for (u32 g = 0; g < RW_GROUPS; ++g) {
        const u32 j = (g << 5) + lane;
        if (g < nw && j < d) dxr[j] = __fsub_rn(__fmul_rn(__fmul_rn(rs, wv[g]), dv[g]), __fmul_rn(xv[g], c));
    }
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
    row_batched(
        d, [&](u64 j) { return make_float2(xr[j], rr[j]); },
        [&](u64 j, float2 xres) {
            const float v = __fadd_rn(xres.x, xres.y);
            xr[j] = v;
            ss = __fadd_rn(ss, __fmul_rn(v, v));
        });
    const float rs = rms_rstd_of_sum(block_sum(ss, scratch), d, eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    if (y != nullptr && yb != nullptr) rmsnorm_scale_row<true, true>(xr, w, rs, y + r * d, yb + r * d, d);
    else if (y != nullptr) rmsnorm_scale_row<true, false>(xr, w, rs, y + r * d, nullptr, d);
    else if (yb != nullptr) rmsnorm_scale_row<false, true>(xr, w, rs, nullptr, yb + r * d, d);
}

// dx of the backward, one block per row r < rows:
// dot = sum_j (w[j] * dy[r,j]) * x[r,j]; c = ((dot * rs) * rs) * rs / d;
// dx[r,j] = (rs * w[j]) * dy[r,j] - x[r,j] * c (overwritten).
extern "C" __global__ void rmsnorm_bwd_dx(const float* __restrict__ dy, const float* __restrict__ x,
                                          const float* __restrict__ w, const float* __restrict__ rstd,
                                          float* __restrict__ dx, u32 rows, u32 d) {
    (void)rows;  // one block per row; the argument list of rmsnorm_bwd_dx_w
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
#pragma unroll 4
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
#pragma unroll 8
    for (u32 c = 0; c < chunks; ++c) acc = __fadd_rn(acc, partial[(u64)c * d + j]);
    dw[j] = __fadd_rn(dw[j], acc);
}
