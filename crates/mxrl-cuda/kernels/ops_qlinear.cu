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

// NVFP4 x [rows, cols] (per-tensor or per-row amax) dequantized as the contract says and split
// into three BF16 parts, v = hi + mid + lo (exact for |v| ≥ 2⁻¹¹⁰, see split_bf16x3), written
// at parts[i], parts[n + i], parts[2n + i]. Grid-stride over i < n = rows·cols.
extern "C" __global__ void __launch_bounds__(256)
    qlinear_nvfp4_dequant_split3(const u8* __restrict__ data, const u8* __restrict__ scales,
                                 const u32* __restrict__ amax_bits, u16* __restrict__ parts, u64 n,
                                 u64 cols, int per_row) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u16 hi, mid, lo;
        split_bf16x3(nvfp4_dequant_at(data, scales, amax_bits, i, cols, per_row != 0), hi, mid, lo);
        parts[i] = hi;
        parts[n + i] = mid;
        parts[2 * n + i] = lo;
    }
}
