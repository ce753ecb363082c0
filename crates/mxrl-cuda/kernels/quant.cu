// mxrl quantizer kernels (contract v1). Compiled by NVRTC after the generated prelude, with
// --fmad=false --ftz=false --prec-div=true --prec-sqrt=true and no fast math; every rounding
// step is additionally spelled with an _rn intrinsic so the arithmetic does not depend on
// compiler contraction. Reference for every kernel: mxrl_formats::reference::quantize /
// QuantizedTensor::dequantize (the named CPU references the tests compare bytes against).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xFFFFFFFFu

__device__ __forceinline__ bool is_nan(float v) { return (__float_as_uint(v) & 0x7FFFFFFFu) > 0x7F800000u; }

// ---- element rules (contract section 1) ----

__device__ __forceinline__ float load(const float* p, u64 i) { return p[i]; }
// BF16 is passed as its 16-bit pattern; widening to f32 is exact.
__device__ __forceinline__ float load(const u16* p, u64 i) { return __uint_as_float(((u32)p[i]) << 16); }

// Eight consecutive elements starting at i (i % 8 == 0): one 16-byte load for BF16, two for
// f32 (device allocations are 256-byte aligned, so these loads are aligned).
struct alignas(16) U4 { u32 x, y, z, w; };
__device__ __forceinline__ void load8(const float* p, u64 i, float v[8]) {
    const U4* q = reinterpret_cast<const U4*>(p + i);
    U4 a = q[0], b = q[1];
    v[0] = __uint_as_float(a.x); v[1] = __uint_as_float(a.y); v[2] = __uint_as_float(a.z); v[3] = __uint_as_float(a.w);
    v[4] = __uint_as_float(b.x); v[5] = __uint_as_float(b.y); v[6] = __uint_as_float(b.z); v[7] = __uint_as_float(b.w);
}
__device__ __forceinline__ void load8(const u16* p, u64 i, float v[8]) {
    U4 a = *reinterpret_cast<const U4*>(p + i);
    u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
}

__device__ __forceinline__ float e4m3_value(u32 code) { return __uint_as_float(MXRL_E4M3_BITS[code & 0xFFu]); }

// f32 -> E4M3 satfinite RNE (e4m3fn); same bit algorithm as mxrl_formats::e4m3_encode.
__device__ __forceinline__ u32 e4m3_encode(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    u32 a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return MXRL_E4M3_NAN;
    const int min_normal_exp = 1 - MXRL_E4M3_BIAS;
    int e = (int)(a >> 23) - 127;
    u32 code;
    if (e >= min_normal_exp) {
        const u32 shift = 23u - MXRL_E4M3_MAN;
        u32 r = a + ((1u << (shift - 1u)) - 1u) + ((a >> shift) & 1u);
        code = (r >> shift) - ((u32)(127 - MXRL_E4M3_BIAS) << MXRL_E4M3_MAN);
        code = code < MXRL_E4M3_MAX_CODE ? code : MXRL_E4M3_MAX_CODE;
    } else {
        // value = k * 2^(min_normal_exp - man): exact power-of-two scaling, one RNE to integer.
        float scale = __uint_as_float((u32)((int)MXRL_E4M3_MAN - min_normal_exp + 127) << 23);
        code = (u32)rintf(__fmul_rn(__uint_as_float(a), scale));
    }
    return sign | code;
}

// f32 v >= 0 -> UE4M3 block-scale byte (NaN -> NaN code, negative -> 0).
__device__ __forceinline__ u32 ue4m3_encode(float v) {
    if (is_nan(v)) return MXRL_E4M3_NAN;
    if (__float_as_uint(v) & 0x80000000u) return 0u;
    return e4m3_encode(v);
}

// f32 -> E2M1 nibble; thresholds generated in the prelude from E2M1_VALUES.
__device__ __forceinline__ u32 e2m1_encode(float x) {
    if (is_nan(x)) return MXRL_E2M1_NAN;
    u32 sign = (__float_as_uint(x) >> 28) & 0x8u;
    return sign | mxrl_e2m1_magnitude(fabsf(x));
}

__device__ __forceinline__ float e2m1_value(u32 code) { return __uint_as_float(MXRL_E2M1_BITS[code & 0xFu]); }

// f32 v >= 0 -> UE8M0, rounding up (cvt.rp.satfinite.ue8m0).
__device__ __forceinline__ u32 ue8m0_round_up(float v) {
    u32 bits = __float_as_uint(v);
    if (is_nan(v)) return MXRL_UE8M0_NAN;
    if (bits & 0x80000000u) return 0u;
    if (bits == 0x7F800000u) return 0xFEu;
    u32 e = bits >> 23, m = bits & 0x7FFFFFu;
    if (e == 0u) return m > 0x400000u ? 1u : 0u;
    if (m == 0u) return e;
    return e == 0xFEu ? 0xFEu : e + 1u;
}

__device__ __forceinline__ float ue8m0_decode(u32 b) {
    if (b == 0xFFu) return __uint_as_float(0x7FC00000u);
    if (b == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(b << 23);
}

__device__ __forceinline__ float ue8m0_reciprocal(u32 b) {
    if (b == 0xFFu) return __uint_as_float(0x7FC00000u);
    if (b == 254u) return __uint_as_float(0x00400000u);
    return __uint_as_float((254u - b) << 23);
}

// max(|x|) ignoring NaN: a NaN never wins a comparison.
__device__ __forceinline__ float nan_ignoring_max(float acc, float a) { return a > acc ? a : acc; }

// ---- MXFP8 (contract section 2) ----

// Row-wise: four threads per 32-element block along K, eight consecutive elements each
// (blocks are contiguous in memory because K % 32 == 0). Scales [M, K/32] row-major = block
// index. Lanes past the end join the shuffles with zeros and write nothing.
// One thread's quarter of a block: v holds its eight elements (zeros when inactive); every
// lane of the warp calls it (shuffles).
__device__ __forceinline__ void mxfp8_row_quarter(const float v[8], bool active, u64 t, u8* data, u8* scales) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 1));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 2));
    u32 s = ue8m0_round_up(__fmul_rn(m, MXRL_R448));
    float inv = ue8m0_reciprocal(s);
    u64 word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) word |= (u64)e4m3_encode(__fmul_rn(v[j], inv)) << (8 * j);
    if (!active) return;
    *reinterpret_cast<u64*>(data + t * 8) = word;
    if ((t & 3u) == 0u) scales[t >> 2] = (u8)s;
}

// Row-wise: four threads per 32-element block along K, eight consecutive elements each
// (blocks are contiguous in memory because K % 32 == 0). Scales [M, K/32] row-major = block
// index. Each thread takes two such quarters, t and t + half (half a multiple of 32, so both
// sit on the same lanes), loading both before computing. Lanes past the end join the
// shuffles with zeros and write nothing.
template <typename T>
__device__ void mxfp8_row(const T* x, u8* data, u8* scales, u64 n_blocks, u64 half) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 t2 = t + half;
    const bool a1 = t < half && (t >> 2) < n_blocks, a2 = t < half && (t2 >> 2) < n_blocks;
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (a1) load8(x, t * 8, v);
    if (a2) load8(x, t2 * 8, w);
    mxfp8_row_quarter(v, a1, t, data, scales);
    mxfp8_row_quarter(w, a2, t2, data, scales);
}

// Column-wise: one thread per (32-row strip, column); threads of a warp read adjacent columns.
// Data stays [M, K]; scales [M/32, K] row-major.
template <typename T>
__device__ void mxfp8_col(const T* x, u8* data, u8* scales, u64 strips, u64 cols) {
    u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (gtid >= strips * cols) return;
    u64 strip = gtid / cols, col = gtid % cols;
    u64 base = strip * MXRL_MXFP8_BLOCK * cols + col;
    float m = 0.0f;
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) m = nan_ignoring_max(m, fabsf(load(x, base + (u64)i * cols)));
    u32 s = ue8m0_round_up(__fmul_rn(m, MXRL_R448));
    float inv = ue8m0_reciprocal(s);
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
        u64 idx = base + (u64)i * cols;
        data[idx] = (u8)e4m3_encode(__fmul_rn(load(x, idx), inv));
    }
    scales[gtid] = (u8)s;
}

extern "C" __global__ void mxfp8_row_f32(const float* x, u8* d, u8* s, u64 n, u64 h) { mxfp8_row(x, d, s, n, h); }
extern "C" __global__ void mxfp8_row_bf16(const u16* x, u8* d, u8* s, u64 n, u64 h) { mxfp8_row(x, d, s, n, h); }
extern "C" __global__ void mxfp8_col_f32(const float* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col(x, d, s, st, c); }
extern "C" __global__ void mxfp8_col_bf16(const u16* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col(x, d, s, st, c); }

// Column-wise, four adjacent columns per thread (K % 4 == 0): one 8-byte (BF16) or 16-byte
// (f32) load per row, the four column maxima over the 32-row strip, then the strip read again
// (from cache) and quantized, four codes stored as one u32 per row and four scales as one u32.
// Per element the operations of mxfp8_col, so the bytes are the same.
__device__ __forceinline__ void load4(const float* p, u64 i, float v[4]) {
    const float4 a = *reinterpret_cast<const float4*>(p + i);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void load4(const u16* p, u64 i, float v[4]) {
    const uint2 a = *reinterpret_cast<const uint2*>(p + i);
    v[0] = __uint_as_float(a.x << 16); v[1] = __uint_as_float(a.x & 0xFFFF0000u);
    v[2] = __uint_as_float(a.y << 16); v[3] = __uint_as_float(a.y & 0xFFFF0000u);
}
template <typename T>
__device__ void mxfp8_col4(const T* x, u8* data, u8* scales, u64 strips, u64 cols) {
    const u64 quads = cols >> 2;
    const u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (gtid >= strips * quads) return;
    const u64 strip = gtid / quads, col = (gtid % quads) * 4;
    const u64 base = strip * MXRL_MXFP8_BLOCK * cols + col;
    float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
        float v[4];
        load4(x, base + (u64)i * cols, v);
#pragma unroll
        for (int c = 0; c < 4; ++c) m[c] = nan_ignoring_max(m[c], fabsf(v[c]));
    }
    u32 s[4];
    float inv[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        s[c] = ue8m0_round_up(__fmul_rn(m[c], MXRL_R448));
        inv[c] = ue8m0_reciprocal(s[c]);
    }
#pragma unroll 8
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
        const u64 idx = base + (u64)i * cols;
        float v[4];
        load4(x, idx, v);
        u32 word = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) word |= e4m3_encode(__fmul_rn(v[c], inv[c])) << (8 * c);
        *reinterpret_cast<u32*>(data + idx) = word;
    }
    *reinterpret_cast<u32*>(scales + strip * cols + col) = s[0] | (s[1] << 8) | (s[2] << 16) | (s[3] << 24);
}
extern "C" __global__ void mxfp8_col4_f32(const float* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col4(x, d, s, st, c); }
extern "C" __global__ void mxfp8_col4_bf16(const u16* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col4(x, d, s, st, c); }

// Dequantize a row-wise copy: x = fl(ue8m0_decode(scale) * e4m3_value(q)).
extern "C" __global__ void mxfp8_row_dequantize(const u8* data, const u8* scales, float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = __fmul_rn(ue8m0_decode(scales[i / MXRL_MXFP8_BLOCK]), e4m3_value(data[i]));
}

// ---- NVFP4 (contract section 3) ----

// amax over each row (one CUDA block per row) or over the whole tensor (grid-stride, then
// atomicMax on the bit pattern: for floats >= 0 the unsigned order is the numeric order).
// Eight elements per load: K % 16 == 0 (NVFP4), so rows and the tensor are multiples of 8.
template <typename T>
__device__ void amax_kernel(const T* x, u32* out_bits, u64 rows, u64 cols, bool per_row) {
    __shared__ float warp_max[32];
    float m = 0.0f;
    if (per_row) {
        u64 r = blockIdx.x;
        for (u64 c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
            float v[8];
            load8(x, r * cols + c, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
        }
    } else {
        u64 n = rows * cols;
        for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += (u64)gridDim.x * blockDim.x * 8) {
            float v[8];
            load8(x, i, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, off));
    if ((threadIdx.x & 31u) == 0u) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32u) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, off));
        if (threadIdx.x == 0u) {
            if (per_row) out_bits[blockIdx.x] = __float_as_uint(m);
            else atomicMax(out_bits, __float_as_uint(m));
        }
    }
}

extern "C" __global__ void amax_f32(const float* x, u32* o, u64 r, u64 c, int per_row) { amax_kernel(x, o, r, c, per_row != 0); }
extern "C" __global__ void amax_bf16(const u16* x, u32* o, u64 r, u64 c, int per_row) { amax_kernel(x, o, r, c, per_row != 0); }

// Two threads per 16-element block, eight consecutive elements each; the global scale is
// recomputed by every thread from the (row's or tensor's) amax with the contract's operation
// order. Lanes past the end join the shuffle with zeros and write nothing.
template <typename T>
__device__ void nvfp4_quantize(const T* x, const u32* amax_bits, u8* data, u8* scales, u64 n, u64 cols, bool per_row) {
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 base = t * 8;
    bool active = base < n;
    float a = __uint_as_float(active ? amax_bits[per_row ? base / cols : 0] : 0u);
    float s_enc = __fdiv_rn(MXRL_NVFP4_NUMERATOR, a);
    s_enc = s_enc > MXRL_F32_MAX ? MXRL_F32_MAX : s_enc;
    if (a == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    float s_dec = __fdiv_rn(1.0f, s_enc);
    float mult = __fmul_rn(s_enc, MXRL_R6);
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (active) load8(x, base, v);
    float bmax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) bmax = nan_ignoring_max(bmax, fabsf(v[j]));
    bmax = nan_ignoring_max(bmax, __shfl_xor_sync(FULL_MASK, bmax, 1));
    float sdec = __fmul_rn(bmax, mult);
    sdec = sdec > MXRL_F32_MAX ? MXRL_F32_MAX : sdec;
    u32 scale = ue4m3_encode(sdec);
    float sf = e4m3_value(scale);
    float enc = __fdiv_rn(1.0f, __fmul_rn(sf, s_dec));
    enc = enc > MXRL_F32_MAX ? MXRL_F32_MAX : enc;
    u32 word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) word |= e2m1_encode(__fmul_rn(v[j], enc)) << (4 * j);
    if (!active) return;
    *reinterpret_cast<u32*>(data + base / 2) = word;
    if ((t & 1u) == 0u) scales[base / MXRL_NVFP4_BLOCK] = (u8)scale;
}

extern "C" __global__ void nvfp4_f32(const float* x, const u32* a, u8* d, u8* s, u64 n, u64 c, int per_row) { nvfp4_quantize(x, a, d, s, n, c, per_row != 0); }
extern "C" __global__ void nvfp4_bf16(const u16* x, const u32* a, u8* d, u8* s, u64 n, u64 c, int per_row) { nvfp4_quantize(x, a, d, s, n, c, per_row != 0); }

// Per-token NVFP4 in one pass over the data: block r owns row r (blockDim.x a multiple of 64,
// cols % 16 == 0). The row's amax as amax_kernel computes it (NaN ignored; a max, so the
// order does not matter), written to amax_bits[r], then the row read again (from cache) and
// quantized with nvfp4_quantize's operations: thread pairs (2k, 2k+1) share a 16-block.
template <typename T>
__device__ void nvfp4_row_fused(const T* x, u32* amax_bits, u8* data, u8* scales, u64 cols) {
    __shared__ float warp_max[32];
    const u64 r = blockIdx.x;
    const T* xr = x + r * cols;
    float m = 0.0f;
    for (u64 c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
        float v[8];
        load8(xr, c, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, off));
    if ((threadIdx.x & 31u) == 0u) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = (threadIdx.x & 31u) < (blockDim.x >> 5) ? warp_max[threadIdx.x & 31u] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, off));
    const float a = m;
    if (threadIdx.x == 0u) amax_bits[r] = __float_as_uint(a);
    float s_enc = __fdiv_rn(MXRL_NVFP4_NUMERATOR, a);
    s_enc = s_enc > MXRL_F32_MAX ? MXRL_F32_MAX : s_enc;
    if (a == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    const float s_dec = __fdiv_rn(1.0f, s_enc);
    const float mult = __fmul_rn(s_enc, MXRL_R6);
    const u64 step = (u64)blockDim.x * 8;
    const u64 iters = (cols + step - 1) / step;
    for (u64 it = 0; it < iters; ++it) {
        const u64 c = it * step + threadIdx.x * 8;
        const bool active = c < cols;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (active) load8(xr, c, v);
        float bmax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) bmax = nan_ignoring_max(bmax, fabsf(v[j]));
        bmax = nan_ignoring_max(bmax, __shfl_xor_sync(FULL_MASK, bmax, 1));
        float sdec = __fmul_rn(bmax, mult);
        sdec = sdec > MXRL_F32_MAX ? MXRL_F32_MAX : sdec;
        const u32 scale = ue4m3_encode(sdec);
        const float sf = e4m3_value(scale);
        float enc = __fdiv_rn(1.0f, __fmul_rn(sf, s_dec));
        enc = enc > MXRL_F32_MAX ? MXRL_F32_MAX : enc;
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) word |= e2m1_encode(__fmul_rn(v[j], enc)) << (4 * j);
        if (active) {
            const u64 e = r * cols + c;
            *reinterpret_cast<u32*>(data + e / 2) = word;
            if ((threadIdx.x & 1u) == 0u) scales[e / MXRL_NVFP4_BLOCK] = (u8)scale;
        }
    }
}
extern "C" __global__ void nvfp4_row_fused_f32(const float* x, u32* a, u8* d, u8* s, u64 c) { nvfp4_row_fused(x, a, d, s, c); }
extern "C" __global__ void nvfp4_row_fused_bf16(const u16* x, u32* a, u8* d, u8* s, u64 c) { nvfp4_row_fused(x, a, d, s, c); }

// x = fl(e2m1_value(code) * fl(fl(sf * amax) * R2688)).
extern "C" __global__ void nvfp4_dequantize(const u8* data, const u8* scales, const u32* amax_bits, float* out, u64 n, u64 cols, int per_row) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 code = (data[i >> 1] >> (4u * (u32)(i & 1u))) & 0xFu;
    float a = __uint_as_float(amax_bits[per_row ? i / cols : 0]);
    float mult = __fmul_rn(__fmul_rn(e4m3_value(scales[i / MXRL_NVFP4_BLOCK]), a), MXRL_R2688);
    out[i] = __fmul_rn(e2m1_value(code), mult);
}

// ---- NVFP4 GEMM emulation helpers (mxrl_tensor::qlinear's arithmetic) ----

// GEMM operand without the FP32 second-level scale: e2m1_value(code) * e4m3_value(block scale),
// exact in f32 (<= 2 x 4 significant bits).
extern "C" __global__ void nvfp4_prescaled(const u8* data, const u8* scales, float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 code = (data[i >> 1] >> (4u * (u32)(i & 1u))) & 0xFu;
    out[i] = __fmul_rn(e2m1_value(code), e4m3_value(scales[i / MXRL_NVFP4_BLOCK]));
}

// y[i, j] = fl(alpha_i * y[i, j]), alpha_i = fl(fl(amax_a[i or 0] * amax_b) * MXRL_NVFP4_ALPHA_FACTOR_INV)
// (TE's compute_nvfp4_per_tensor_scale order; one alpha per row for per-token activations).
extern "C" __global__ void nvfp4_apply_alpha(float* y, const u32* amax_a, const u32* amax_b, u64 m, u64 n, int per_row) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * n) return;
    float aa = __uint_as_float(amax_a[per_row ? i / n : 0]);
    float alpha = __fmul_rn(__fmul_rn(aa, __uint_as_float(amax_b[0])), MXRL_NVFP4_ALPHA_FACTOR_INV);
    y[i] = __fmul_rn(alpha, y[i]);
}
