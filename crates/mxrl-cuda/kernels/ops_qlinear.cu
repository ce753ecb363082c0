// Operand kernels of the quantized linear layer (mxrl_cuda::ops::qlinear), compiled after the
// contract's quantizer source (kernels/quant.cu: e4m3_value, ue8m0_decode, nvfp4_dequant_at)
// and common.cuh (f32_to_bf16, split_bf16x3). References: mxrl_formats::QuantizedTensor::
// dequantize (the contract dequantization), then BF16 rounding or the three-part BF16 split.

// Column-wise MXFP8 (32×1 blocks along the rows) of x [rows, cols] with scales [rows/32, cols],
// dequantized into BF16 bit patterns out [rows, cols]: out = bf16(fl(ue8m0_decode(s) ·
// e4m3_value(q))). Exact in BF16 for scale bytes ≥ 3; below, rounded to nearest even.
// Grid-stride over i < rows·cols (rows a multiple of 32).
extern "C" __global__ void __launch_bounds__(256)
    qlinear_dequant_mxfp8_col_bf16(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                   u16* __restrict__ out, u64 n, u64 cols) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols, c = i - r * cols;
        const float v = __fmul_rn(ue8m0_decode(scales[(r / MXRL_MXFP8_BLOCK) * cols + c]), e4m3_value(codes[i]));
        out[i] = f32_to_bf16(v);
    }
}

// NVFP4 x [rows, cols] dequantized as the contract says and split into three BF16 parts,
// v = hi + mid + lo (exact for |v| ≥ 2⁻¹¹⁰, see split_bf16x3), written at parts[i],
// parts[n + i], parts[2n + i]. One amax per `rows_per_amax` rows: 1 for per-row (per-token)
// amax, the rows of one weight for a stack of weights with one amax each, all rows for one
// per-tensor amax. Grid-stride over i < n = rows·cols.
extern "C" __global__ void __launch_bounds__(256)
    qlinear_nvfp4_dequant_split3(const u8* __restrict__ data, const u8* __restrict__ scales,
                                 const u32* __restrict__ amax_bits, u16* __restrict__ parts, u64 n,
                                 u64 cols, u64 rows_per_amax) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u16 hi, mid, lo;
        const u32* a = amax_bits + (i / cols) / rows_per_amax;
        split_bf16x3(nvfp4_dequant_at(data, scales, a, i, cols, false), hi, mid, lo);
        parts[i] = hi;
        parts[n + i] = mid;
        parts[2 * n + i] = lo;
    }
}

// Column-wise MXFP8 of f32 x [rows, cols] in row segments of at most 32 rows (segment j starts
// at row seg[2j] and has seg[2j+1] rows): each segment is one 32×1 block per column, as the
// contract quantizes the tensor of those rows zero-padded to a whole block (a zero row never
// raises a block's amax, so it changes no byte; mxfp8_col's rule). Writes the BF16 of the
// contract dequantization of every element of the segments into out [rows, cols] (exact for
// scale bytes ≥ 3, as qlinear_dequant_mxfp8_col_bf16); rows outside every segment are not
// written. The segments of a group of rows start at the group's first row, so a block never
// spans two groups (experts). One thread per (segment, column): a warp reads adjacent columns.
extern "C" __global__ void __launch_bounds__(256)
    qlinear_mxfp8_col_segments_bf16(const float* __restrict__ x, const u32* __restrict__ seg,
                                    u16* __restrict__ out, u64 segs, u64 cols) {
    for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < segs * cols; t += (u64)gridDim.x * blockDim.x) {
        const u64 j = t / cols, c = t - j * cols;
        const u64 r0 = seg[2 * j];
        const u32 len = seg[2 * j + 1];
        // The block's 32 values in registers, all loads in flight at once; rows past the
        // segment read as 0 (the zero padding, which leaves the amax as it is).
        float v[MXRL_MXFP8_BLOCK];
#pragma unroll
        for (u32 i = 0; i < MXRL_MXFP8_BLOCK; ++i) v[i] = i < len ? x[(r0 + i) * cols + c] : 0.0f;
        float m = 0.0f;
#pragma unroll
        for (u32 i = 0; i < MXRL_MXFP8_BLOCK; ++i) m = nan_ignoring_max(m, fabsf(v[i]));
        const u32 s = ue8m0_round_up(__fmul_rn(m, MXRL_R448));
        const float inv = ue8m0_reciprocal(s), dec = ue8m0_decode(s);
#pragma unroll
        for (u32 i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
            if (i < len) out[(r0 + i) * cols + c] = f32_to_bf16(__fmul_rn(dec, e4m3_value(e4m3_encode(__fmul_rn(v[i], inv)))));
        }
    }
}

// out[g] = the largest of row_bits[g·rows_per_group .. (g+1)·rows_per_group): row amaxes as
// f32 bit patterns (≥ 0 and never NaN, so the unsigned order of the bits is the numeric
// order), giving the amax of each group of rows (a weight of a stack) as the per-tensor pass
// would. One CTA of 256 threads per group; no atomics.
extern "C" __global__ void __launch_bounds__(256)
    qlinear_amax_groups(const u32* __restrict__ row_bits, u32* __restrict__ out, u64 rows_per_group) {
    __shared__ u32 warp_max[8];
    const u64 g = blockIdx.x;
    u32 m = 0u;
    for (u64 r = threadIdx.x; r < rows_per_group; r += blockDim.x) m = max(m, row_bits[g * rows_per_group + r]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(FULL_MASK, m, off));
    if ((threadIdx.x & 31u) == 0u) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0u) {
        for (u32 w = 1; w < (blockDim.x >> 5); ++w) m = max(m, warp_max[w]);
        out[g] = m;
    }
}
