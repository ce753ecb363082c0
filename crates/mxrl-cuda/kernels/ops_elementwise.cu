// Elementwise ops and the embedding gather of the engine. References (mxrl_tensor): BF16 rounding
// = mxrl_tensor::precision::round_bf16; the residual add is plain f32 `+`; the gather copies
// rows exactly.

// out[i] = bf16(x[i]) (round to nearest even), i < n.
extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}

// out[i] = f32(bf16(x[i])) (round to nearest even; a parameter's BF16 value kept as f32), i < n.
extern "C" __global__ void round_bf16_f32(const float* __restrict__ x, float* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = round_bf16(x[i]);
}

// y[i] += x[i], i < n.
extern "C" __global__ void add_inplace(float* __restrict__ y, const float* __restrict__ x, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(y[i], x[i]);
}

// out[r, :] = table[tokens[r], :], r < rows, row width h. One block per row.
extern "C" __global__ void embed_gather(const float* __restrict__ table, const u32* __restrict__ tokens,
                                        float* __restrict__ out, u64 h) {
    const u64 r = blockIdx.x;
    const u64 t = tokens[r];
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) out[r * h + j] = table[t * h + j];
}
