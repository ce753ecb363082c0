// Small engine ops with no family of their own. References (mxrl_tensor::device::CpuBackend):
// add_bias, bias_backward, kv_fill, copy_blocks_*. All bitwise with their references: elementwise f32,
// and bias_backward sums rows in row order exactly as the CPU loop does.

// y[r, j] += b[j], r < rows, j < n.
extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ b, u64 rows, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * n) y[i] = __fadd_rn(y[i], b[i % n]);
}

// db[j] += Σ_r dy[r, j] in row order (one thread per column: the CPU's summation order).
extern "C" __global__ void bias_backward(const float* __restrict__ dy, float* __restrict__ db, u64 rows, u64 n) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float acc = db[j];
    for (u64 r = 0; r < rows; ++r) acc = __fadd_rn(acc, dy[r * n + j]);
    db[j] = acc;
}

// Prefill cache fill: row r of packed sequence b (rows offsets[b]..offsets[b+1]) goes to slot b,
// position r - offsets[b], as bf16 (RNE). One block per packed row; w = kv width.
extern "C" __global__ void kv_fill(const float* __restrict__ k, const float* __restrict__ v,
                                   const u32* __restrict__ row_seq, const u32* __restrict__ offsets,
                                   u16* __restrict__ kc, u16* __restrict__ vc, u64 w, u64 max_len) {
    const u64 r = blockIdx.x;
    const u64 b = row_seq[r];
    const u64 p = r - offsets[b];
    const u64 dst = (b * max_len + p) * w;
    for (u64 j = threadIdx.x; j < w; j += blockDim.x) {
        kc[dst + j] = f32_to_bf16(k[r * w + j]);
        vc[dst + j] = f32_to_bf16(v[r * w + j]);
    }
}

// Block copies (copy_blocks_*): for pair j < count, dst block map[2j+1] = src block map[2j],
// blocks of `block` elements; pairs naming a block outside either buffer are skipped. One
// thread per element of the pairs' blocks.
#define COPY_BLOCKS(NAME, T)                                                                      \
    extern "C" __global__ void NAME(const T* __restrict__ src, T* __restrict__ dst,               \
                                    const u32* __restrict__ map, u64 block, u64 count,            \
                                    u64 src_blocks, u64 dst_blocks) {                             \
        const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= count * block) return;                                                           \
        const u64 j = i / block, e = i - j * block;                                               \
        const u64 s = map[2 * j], d = map[2 * j + 1];                                             \
        if (s < src_blocks && d < dst_blocks) dst[d * block + e] = src[s * block + e];           \
    }
COPY_BLOCKS(copy_blocks_u16, u16)
COPY_BLOCKS(copy_blocks_u32, u32)
