// Elementwise ops and the embedding gather of the engine. References (mxrl_tensor): BF16 rounding
// = mxrl_tensor::precision::round_bf16; the residual add is plain f32 `+`; the gather copies
// rows exactly.

// out[i] = bf16(x[i]) (round to nearest even), i < n.
extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}

// to_bf16 eight elements per thread: two 16-byte loads, one 16-byte store (x and out 16-byte
// aligned, checked by the launcher); the last partial group element by element. The same
// f32_to_bf16 per element, so the same bits as to_bf16.
extern "C" __global__ void to_bf16_x8(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    const u64 base = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (base + 8 <= n) {
        const float4 a = *reinterpret_cast<const float4*>(x + base);
        const float4 b = *reinterpret_cast<const float4*>(x + base + 4);
        uint4 o;
        o.x = (u32)f32_to_bf16(a.x) | ((u32)f32_to_bf16(a.y) << 16);
        o.y = (u32)f32_to_bf16(a.z) | ((u32)f32_to_bf16(a.w) << 16);
        o.z = (u32)f32_to_bf16(b.x) | ((u32)f32_to_bf16(b.y) << 16);
        o.w = (u32)f32_to_bf16(b.z) | ((u32)f32_to_bf16(b.w) << 16);
        *reinterpret_cast<uint4*>(out + base) = o;
    } else {
        for (u64 i = base; i < n; ++i) out[i] = f32_to_bf16(x[i]);
    }
}

// out[i] = f32(bf16(x[i])) (round to nearest even; a parameter's BF16 value kept as f32), i < n.
extern "C" __global__ void round_bf16_f32(const float* __restrict__ x, float* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = round_bf16(x[i]);
}

// out[i] = f32(x[i]) for BF16 bit patterns x (exact), i < n.
extern "C" __global__ void widen_bf16(const u16* __restrict__ x, float* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_to_f32(x[i]);
}

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// out[2·slot .. 2·slot+2] (a u64, zeroed by the caller) = Σ_i mix64((i << 16) | x[i]) mod 2^64:
// a position-dependent checksum of n BF16 bit patterns. Integer addition is associative, so
// the result does not depend on the order of the atomic adds. Grid-stride loop.
extern "C" __global__ void checksum_bf16(const u16* __restrict__ x, u64 n, u32* __restrict__ out,
                                         u64 slot) {
    u64 acc = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        acc += mix64((i << 16) | (u64)x[i]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd((u64*)(out + 2 * slot), acc);
}

// The same checksum over n bytes at positions base + i (stored quantized weights: codes, then
// scales, then amax bytes, each call continuing the positions of the previous one).
extern "C" __global__ void checksum_u8(const unsigned char* __restrict__ x, u64 n, u64 base,
                                       u32* __restrict__ out, u64 slot) {
    u64 acc = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        acc += mix64(((base + i) << 16) | (u64)x[i]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd((u64*)(out + 2 * slot), acc);
}

// Route capture: element i = r·k + j of ids/weights [rows, k] goes to the tables [max_len, S, k]
// at sequence s = (has_seq ? seq[r] : r), position p = pos[r] (table row p·S + s); rows
// outside the tables are skipped.
extern "C" __global__ void capture_routes(const u32* __restrict__ ids, const float* __restrict__ w,
                                          u64 rows, u32 k, const u32* __restrict__ seq, int has_seq,
                                          const u32* __restrict__ pos, u64 slots, u64 max_len,
                                          u32* __restrict__ dst_ids, float* __restrict__ dst_w) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * k) return;
    u64 r = i / k, j = i % k;
    u64 s = has_seq ? (u64)seq[r] : r;
    u64 p = pos[r];
    if (s >= slots || p >= max_len) return;
    u64 d = (p * slots + s) * k + j;
    dst_ids[d] = ids[i];
    dst_w[d] = w[i];
}

// Row capture (generation probes): element i = r·w + j of x [rows, w] goes to the table
// [slots, len, w] at slot s = (has_seq ? seq[r] : r), index pos[r] − first[s]; rows whose slot
// is ≥ slots or whose position is outside first[s] .. first[s] + len are skipped. A copy.
extern "C" __global__ void capture_rows(const float* __restrict__ x, u64 rows, u64 w,
                                        const u32* __restrict__ seq, int has_seq,
                                        const u32* __restrict__ pos, const u32* __restrict__ first,
                                        u64 slots, u64 len, float* __restrict__ dst) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * w) return;
    u64 r = i / w, j = i % w;
    u64 s = has_seq ? (u64)seq[r] : r;
    if (s >= slots) return;
    u64 p = pos[r], f = first[s];
    if (p < f || p - f >= len) return;
    dst[((p - f) * slots + s) * w + j] = x[i];
}

// y[i] += x[i], i < n.
extern "C" __global__ void add_inplace(float* __restrict__ y, const float* __restrict__ x, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(y[i], x[i]);
}

// add_inplace, four elements per thread with 16-byte accesses (both pointers 16-byte aligned):
// thread t adds y[4t .. 4t+4) (element by element past the last whole group of four).
extern "C" __global__ void add_inplace_x4(float* __restrict__ y, const float* __restrict__ x, u64 n) {
    const u64 base = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (base + 4 <= n) {
        float4 a = *reinterpret_cast<const float4*>(y + base);
        const float4 b = *reinterpret_cast<const float4*>(x + base);
        a.x = __fadd_rn(a.x, b.x);
        a.y = __fadd_rn(a.y, b.y);
        a.z = __fadd_rn(a.z, b.z);
        a.w = __fadd_rn(a.w, b.w);
        *reinterpret_cast<float4*>(y + base) = a;
    } else {
        for (u64 i = base; i < n; ++i) y[i] = __fadd_rn(y[i], x[i]);
    }
}

// out[r, :] = table[tokens[r], :], r < rows, row width h. One block per row.
extern "C" __global__ void embed_gather(const float* __restrict__ table, const u32* __restrict__ tokens,
                                        float* __restrict__ out, u64 h) {
    const u64 r = blockIdx.x;
    const u64 t = tokens[r];
    for (u64 j = threadIdx.x; j < h; j += blockDim.x) out[r * h + j] = table[t * h + j];
}
