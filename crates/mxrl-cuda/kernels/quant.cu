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


// e4m3_value for a code 0x00..0x7E (non-negative, not NaN) without the table (a per-thread
// table index serializes the constant cache): normal codes are the bit pattern shifted into
// place with the bias moved; subnormal codes m·2^(1−bias−man) are computed exactly as
// (1 + m·2^−man)·2^(1−bias) − 2^(1−bias).
__device__ __forceinline__ float e4m3_value_nonneg(u32 code) {
    const u32 shift = 23u - MXRL_E4M3_MAN;
    const u32 rebias = (u32)(127 - MXRL_E4M3_BIAS) << 23;
    if ((code >> MXRL_E4M3_MAN) != 0u) return __uint_as_float((code << shift) + rebias);
    const float lead = __uint_as_float(((1u << MXRL_E4M3_MAN) << shift) + rebias);
    return __fsub_rn(__uint_as_float(((code | (1u << MXRL_E4M3_MAN)) << shift) + rebias), lead);
}

// The value of an E4M3 code (the contract's table MXRL_E4M3_BITS): computed for every finite
// code (e4m3_value_nonneg and the sign), read from the table only for the NaN codes, so a warp
// whose lanes hold different codes does not serialize on the constant cache.
__device__ __forceinline__ float e4m3_value(u32 code) {
    code &= 0xFFu;
    const u32 mag = code & 0x7Fu;
    if (mag > MXRL_E4M3_MAX_CODE) return __uint_as_float(MXRL_E4M3_BITS[code]);
    const float v = e4m3_value_nonneg(mag);
    return (code & 0x80u) ? -v : v;
}

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

// The largest of a block's per-thread maxima m (NaN ignored: the same value in any order): a
// warp butterfly, then the THREADS / 32 warps' results in warp order; every thread returns it.
// warp_max_s holds THREADS / 32 floats; every thread of the block calls it (one barrier).
template <int THREADS>
__device__ __forceinline__ float block_nan_ignoring_max(float m, float* warp_max_s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, o));
    if ((threadIdx.x & 31u) == 0u) warp_max_s[threadIdx.x >> 5] = m;
    __syncthreads();
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) a = nan_ignoring_max(a, warp_max_s[w]);
    return a;
}

// ---- fast exact encoders (same bytes as the rules above; used by the quantizer kernels) ----

// Two f32 -> two E4M3 bytes (lo in bits 0..7, hi in bits 8..15). On sm_89+ the hardware
// conversion cvt.rn.satfinite.e4m3x2.f32 (TE's: RNE incl. subnormals, sign kept, overflow and
// Inf saturate to ±448), with NaN rewritten to the contract's code (the hardware's NaN byte is
// not specified); the NaN test is one add (NaN if either is NaN, or Inf − Inf, which only
// takes the exact branch). Elsewhere e4m3_encode twice.
__device__ __forceinline__ u32 e4m3x2_exact(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    u32 w = (u32)r;
    if (is_nan(__fadd_rn(lo, hi))) {
        if (is_nan(lo)) w = (w & 0xFF00u) | MXRL_E4M3_NAN;
        if (is_nan(hi)) w = (w & 0x00FFu) | (MXRL_E4M3_NAN << 8);
    }
    return w;
#else
    return e4m3_encode(lo) | (e4m3_encode(hi) << 8);
#endif
}

// f32 v >= 0, finite (an NVFP4 block's sdec) -> UE4M3 byte: ue4m3_encode's value.
__device__ __forceinline__ u32 ue4m3_finite(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return e4m3x2_exact(v, 0.0f) & 0xFFu;
#else
    return ue4m3_encode(v);
#endif
}


// f32 -> E2M1 nibble for every value but a negative NaN (which gives 0xF instead of the
// contract's 0x7; callers detect NaN and take e2m1_encode): the prelude's floating-point
// magnitude (min of the code-space lines, one rounding) and the sign bit.
__device__ __forceinline__ u32 e2m1_fast(float y) {
    return mxrl_e2m1_magnitude_fma(fabsf(y)) | ((__float_as_uint(y) >> 28) & 0x8u);
}

// Sixteen consecutive elements starting at i (i % 16 == 0): two load8.
template <typename T>
__device__ __forceinline__ void load16(const T* p, u64 i, float v[16]) {
    load8(p, i, v);
    load8(p, i + 8, v + 8);
}

// Global NVFP4 factors of an amax (contract section 3, steps 2-3).
__device__ __forceinline__ void nvfp4_global(float a, float& s_dec, float& mult) {
    float s_enc = __fdiv_rn(MXRL_NVFP4_NUMERATOR, a);
    s_enc = s_enc > MXRL_F32_MAX ? MXRL_F32_MAX : s_enc;
    if (a == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    s_dec = __fdiv_rn(1.0f, s_enc);
    mult = __fmul_rn(s_enc, MXRL_R6);
}

// max(acc, a) for a >= 0 that is NaN whenever either operand is (PTX max.NaN, sm_80+): a
// block's maximum that also says whether the block holds a NaN, in one operation per element.
__device__ __forceinline__ float max_nan(float acc, float a) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(acc), "f"(a));
    return r;
}

// max_nan over a 16-block's magnitudes (from 0): the block's amax, or NaN if it holds a NaN.
__device__ __forceinline__ float block16_max_nan(const float v[16]) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = max_nan(m, fabsf(v[j]));
    return m;
}

// A 16-block's amax with NaN ignored (nan_ignoring_max): max_nan's value when that is not
// NaN, else the maximum again (fmaxf(acc, |x|) equals nan_ignoring_max: acc is never NaN,
// |x| never −0) — only blocks that hold a NaN take the second loop.
__device__ __forceinline__ float block16_amax(const float v[16], float max_or_nan) {
    if (!is_nan(max_or_nan)) return max_or_nan;
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(v[j]));
    return m;
}

// One NVFP4 16-block (contract section 3, step 4) held by one thread: v -> 16 nibbles
// (element 2i low nibble of byte i) in lo (elements 0..7) and hi (8..15), and the scale byte.
// max_or_nan = block16_max_nan(v), computed by the caller (the per-token kernel has it from
// its amax pass). Without a NaN in v every y = v·enc is a number or ±Inf (enc is finite and
// > 0) and e2m1_fast is exact; a block with a NaN takes e2m1_encode for all 16.
// 1/p: __frcp_rn is the correctly rounded reciprocal, the value of __fdiv_rn(1, p).
__device__ __forceinline__ void nvfp4_block16_max(const float v[16], float max_or_nan, float s_dec, float mult, u32& lo, u32& hi, u32& scale) {
    const bool has_nan = is_nan(max_or_nan);
    const float bmax = block16_amax(v, max_or_nan);
    float sdec = __fmul_rn(bmax, mult);
    sdec = sdec > MXRL_F32_MAX ? MXRL_F32_MAX : sdec; // never NaN: bmax >= 0, mult finite > 0
    scale = ue4m3_finite(sdec);
    float enc = __frcp_rn(__fmul_rn(e4m3_value_nonneg(scale), s_dec));
    enc = enc > MXRL_F32_MAX ? MXRL_F32_MAX : enc;
    float y[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) y[j] = __fmul_rn(v[j], enc);
    u32 w0 = 0, w1 = 0;
    if (!has_nan) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            w0 |= e2m1_fast(y[j]) << (4 * j);
            w1 |= e2m1_fast(y[8 + j]) << (4 * j);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            w0 |= e2m1_encode(y[j]) << (4 * j);
            w1 |= e2m1_encode(y[8 + j]) << (4 * j);
        }
    }
    lo = w0;
    hi = w1;
}

// nvfp4_block16_max with the block's maximum computed here.
__device__ __forceinline__ void nvfp4_block16(const float v[16], float s_dec, float mult, u32& lo, u32& hi, u32& scale) {
    nvfp4_block16_max(v, block16_max_nan(v), s_dec, mult, lo, hi, scale);
}

// ---- MXFP8 (contract section 2) ----

// Row-wise: four threads per 32-element block along K, eight consecutive elements each
// (blocks are contiguous in memory because K % 32 == 0). Scales [M, K/32] row-major = block
// index. Lanes past the end join the shuffles with zeros and write nothing.
// One thread's quarter of a block: v holds its eight elements (zeros when inactive); every
// lane of the warp calls it (shuffles). Gives the quarter's codes (w0: elements 0..3, w1:
// 4..7, one byte each) and the block's scale byte s.
__device__ __forceinline__ void mxfp8_quarter_encode(const float v[8], u32& w0, u32& w1, u32& s) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 1));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 2));
    s = ue8m0_round_up(__fmul_rn(m, MXRL_R448));
    float inv = ue8m0_reciprocal(s);
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(v[j], inv);
    w0 = e4m3x2_exact(y[0], y[1]) | (e4m3x2_exact(y[2], y[3]) << 16);
    w1 = e4m3x2_exact(y[4], y[5]) | (e4m3x2_exact(y[6], y[7]) << 16);
}

// mxfp8_quarter_encode, stored as quarter t of the row-wise layout when active.
__device__ __forceinline__ void mxfp8_row_quarter(const float v[8], bool active, u64 t, u8* data, u8* scales) {
    u32 w0, w1, s;
    mxfp8_quarter_encode(v, w0, w1, s);
    if (!active) return;
    *reinterpret_cast<uint2*>(data + t * 8) = make_uint2(w0, w1);
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

// Column-wise from registers: thread = (32-row strip, G = 8 / sizeof(T) adjacent columns:
// four BF16 or two f32), K % G == 0. The strip's 32 rows are loaded at once (one aligned
// 8-byte load per row; a warp reads 256 contiguous bytes of a row), kept in registers for the
// G column maxima and then quantized, so every input byte is read once. Per element the
// operations of mxfp8_col (nan_ignoring_max == fmaxf here), so the bytes are the same. Codes
// stored as one G-byte word per row, the G scales as one G-byte word.
__device__ __forceinline__ void unpack_cols(const float*, uint2 r, float v[2]) {
    v[0] = __uint_as_float(r.x); v[1] = __uint_as_float(r.y);
}
__device__ __forceinline__ void unpack_cols(const u16*, uint2 r, float v[4]) {
    v[0] = __uint_as_float(r.x << 16); v[1] = __uint_as_float(r.x & 0xFFFF0000u);
    v[2] = __uint_as_float(r.y << 16); v[3] = __uint_as_float(r.y & 0xFFFF0000u);
}
__device__ __forceinline__ void store_cols(u8* p, const float* y, const float*) {
    *reinterpret_cast<u16*>(p) = (u16)e4m3x2_exact(y[0], y[1]);
}
__device__ __forceinline__ void store_cols(u8* p, const float* y, const u16*) {
    *reinterpret_cast<u32*>(p) = e4m3x2_exact(y[0], y[1]) | (e4m3x2_exact(y[2], y[3]) << 16);
}
template <typename T>
__device__ void mxfp8_col_reg(const T* x, u8* data, u8* scales, u64 strips, u64 cols) {
    constexpr int G = 8 / (int)sizeof(T);
    const u64 groups = cols / G;
    const u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (gtid >= strips * groups) return;
    const u64 strip = gtid / groups, col = (gtid % groups) * G;
    const u64 base = strip * MXRL_MXFP8_BLOCK * cols + col;
    uint2 raw[MXRL_MXFP8_BLOCK];
#pragma unroll
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) raw[i] = *reinterpret_cast<const uint2*>(x + base + (u64)i * cols);
    float m[G];
#pragma unroll
    for (int c = 0; c < G; ++c) m[c] = 0.0f;
#pragma unroll
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
        float v[G];
        unpack_cols(x, raw[i], v);
#pragma unroll
        for (int c = 0; c < G; ++c) m[c] = fmaxf(m[c], fabsf(v[c]));
    }
    float inv[G];
    u32 sw = 0;
#pragma unroll
    for (int c = 0; c < G; ++c) {
        const u32 s = ue8m0_round_up(__fmul_rn(m[c], MXRL_R448));
        inv[c] = ue8m0_reciprocal(s);
        sw |= s << (8 * c);
    }
#pragma unroll
    for (int i = 0; i < MXRL_MXFP8_BLOCK; ++i) {
        float v[G], y[G];
        unpack_cols(x, raw[i], v);
#pragma unroll
        for (int c = 0; c < G; ++c) y[c] = __fmul_rn(v[c], inv[c]);
        store_cols(data + base + (u64)i * cols, y, x);
    }
    if (G == 4) *reinterpret_cast<u32*>(scales + strip * cols + col) = sw;
    else *reinterpret_cast<u16*>(scales + strip * cols + col) = (u16)sw;
}
extern "C" __global__ void mxfp8_col_reg_f32(const float* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col_reg(x, d, s, st, c); }
extern "C" __global__ void mxfp8_col_reg_bf16(const u16* x, u8* d, u8* s, u64 st, u64 c) { mxfp8_col_reg(x, d, s, st, c); }

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

// Per-tensor amax in one read-only pass: grid-stride over 8-element chunks, four loads in
// flight per thread, the grid sized to the resident CTAs so the sweep runs front to back
// (the quantize pass then starts at the back, still in L2); block max, then atomicMax on the
// bit pattern (for floats >= 0 the unsigned order is the numeric order, and a max does not
// depend on the order, so the bytes are deterministic). NaN is ignored (fmaxf).
template <typename T>
__device__ void amax_tensor(const T* x, u32* out_bits, u64 chunks) {
    __shared__ float warp_max[32];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    float m = 0.0f;
    for (; i + 3 * stride < chunks; i += 4 * stride) {
        float v[4][8];
#pragma unroll
        for (int k = 0; k < 4; ++k) load8(x, (i + k * stride) * 8, v[k]);
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[k][j]));
    }
    for (; i < chunks; i += stride) {
        float v[8];
        load8(x, i * 8, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    if ((threadIdx.x & 31u) == 0u) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32u) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
        if (threadIdx.x == 0u) atomicMax(out_bits, __float_as_uint(m));
    }
}
extern "C" __global__ void amax_tensor_f32(const float* x, u32* o, u64 c) { amax_tensor(x, o, c); }
extern "C" __global__ void amax_tensor_bf16(const u16* x, u32* o, u64 c) { amax_tensor(x, o, c); }

// NVFP4 with a precomputed amax (1 per tensor, or 1 per row of blocks_per_row 16-blocks):
// one thread per 16-block (one scale per thread, no shuffles), CTAs mapped back to front so
// the first CTAs read the data the amax pass touched last.
template <typename T>
__device__ void nvfp4_blocks(const T* x, const u32* amax_bits, u8* data, u8* scales, u64 n_blocks, u64 blocks_per_row, bool per_row) {
    const u64 cta = (u64)(gridDim.x - 1u - blockIdx.x);
    const u64 b = cta * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    float s_dec, mult;
    nvfp4_global(__uint_as_float(amax_bits[per_row ? b / blocks_per_row : 0]), s_dec, mult);
    float v[16];
    load16(x, b * MXRL_NVFP4_BLOCK, v);
    u32 lo, hi, scale;
    nvfp4_block16(v, s_dec, mult, lo, hi, scale);
    *reinterpret_cast<uint2*>(data + b * (MXRL_NVFP4_BLOCK / 2)) = make_uint2(lo, hi);
    scales[b] = (u8)scale;
}
extern "C" __global__ void nvfp4_blocks_f32(const float* x, const u32* a, u8* d, u8* s, u64 n, u64 bpr, int per_row) { nvfp4_blocks(x, a, d, s, n, bpr, per_row != 0); }
extern "C" __global__ void nvfp4_blocks_bf16(const u16* x, const u32* a, u8* d, u8* s, u64 n, u64 bpr, int per_row) { nvfp4_blocks(x, a, d, s, n, bpr, per_row != 0); }

// A 16-block of a row as the per-token kernel holds it between its two passes: f32 input as
// its sixteen values, BF16 input as its eight packed words (half the registers, so more
// CTAs stay resident; unpacked again, exactly, for the quantization).
template <typename T> struct Held16;
template <> struct Held16<float> {
    float v[16];
    __device__ __forceinline__ void load(const float* p, u64 i) { load16(p, i, v); }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = 0.0f;
    }
    __device__ __forceinline__ void unpack(float out[16]) const {
#pragma unroll
        for (int j = 0; j < 16; ++j) out[j] = v[j];
    }
};
template <> struct Held16<u16> {
    u32 w[8];
    __device__ __forceinline__ void load(const u16* p, u64 i) {
        const U4* q = reinterpret_cast<const U4*>(p + i);
        U4 a = q[0], b = q[1];
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = 0u;
    }
    // load8's conversion: element 2j in the low half of word j.
    __device__ __forceinline__ void unpack(float out[16]) const {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            out[2 * j] = __uint_as_float(w[j] << 16);
            out[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
        }
    }
};

// Per-token NVFP4 in one read of each row: CTA r owns row r, thread t its 16-blocks t,
// t + blockDim, ...; the first CHUNKS of them stay in registers (Held16) between the row's
// amax (NaN ignored; each kept block's max_nan is kept for its quantization) and the
// quantization, blocks beyond (rows longer than 16·CHUNKS·blockDim) are read again.
// amax_bits[r] gets the row's amax. CHUNKS trades registers per thread (resident CTAs)
// against threads per row; the launcher picks it per input type (NVFP4_ROW_CHUNKS_* in
// src/cuda.rs), every CHUNKS gives the same bytes.
template <typename T, int CHUNKS>
__device__ void nvfp4_row_reg(const T* x, u32* amax_bits, u8* data, u8* scales, u64 cols) {
    __shared__ float warp_max[32];
    const u64 r = blockIdx.x;
    const u64 nb = cols / MXRL_NVFP4_BLOCK;
    const T* xr = x + r * cols;
    Held16<T> h[CHUNKS];
    // Each kept block's max_nan, reused by the quantization (one max per element in all).
    float bm[CHUNKS];
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const u64 b = threadIdx.x + (u64)k * blockDim.x;
        if (b < nb) {
            h[k].load(xr, b * MXRL_NVFP4_BLOCK);
        } else {
            h[k].zero();
        }
    }
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        float v[16];
        h[k].unpack(v);
        bm[k] = block16_max_nan(v);
        m = fmaxf(m, block16_amax(v, bm[k]));
    }
    for (u64 b = threadIdx.x + (u64)CHUNKS * blockDim.x; b < nb; b += blockDim.x) {
        float w[16];
        load16(xr, b * MXRL_NVFP4_BLOCK, w);
#pragma unroll
        for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(w[j]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    if ((threadIdx.x & 31u) == 0u) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = (threadIdx.x & 31u) < (blockDim.x >> 5) ? warp_max[threadIdx.x & 31u] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
    if (threadIdx.x == 0u) amax_bits[r] = __float_as_uint(m);
    float s_dec, mult;
    nvfp4_global(m, s_dec, mult);
    u8* dr = data + r * (cols / 2);
    u8* sr = scales + r * nb;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const u64 b = threadIdx.x + (u64)k * blockDim.x;
        if (b < nb) {
            float v[16];
            h[k].unpack(v);
            u32 lo, hi, scale;
            nvfp4_block16_max(v, bm[k], s_dec, mult, lo, hi, scale);
            *reinterpret_cast<uint2*>(dr + b * (MXRL_NVFP4_BLOCK / 2)) = make_uint2(lo, hi);
            sr[b] = (u8)scale;
        }
    }
    for (u64 b = threadIdx.x + (u64)CHUNKS * blockDim.x; b < nb; b += blockDim.x) {
        float w[16];
        load16(xr, b * MXRL_NVFP4_BLOCK, w);
        u32 lo, hi, scale;
        nvfp4_block16(w, s_dec, mult, lo, hi, scale);
        *reinterpret_cast<uint2*>(dr + b * (MXRL_NVFP4_BLOCK / 2)) = make_uint2(lo, hi);
        sr[b] = (u8)scale;
    }
}
// Entry points: nvfp4_row_reg{CHUNKS}_{f32,bf16}.
#define NVFP4_ROW_ENTRY(C)                                                                                   \
    extern "C" __global__ void nvfp4_row_reg##C##_f32(const float* x, u32* a, u8* d, u8* s, u64 c) {         \
        nvfp4_row_reg<float, C>(x, a, d, s, c);                                                              \
    }                                                                                                        \
    extern "C" __global__ void nvfp4_row_reg##C##_bf16(const u16* x, u32* a, u8* d, u8* s, u64 c) {          \
        nvfp4_row_reg<u16, C>(x, a, d, s, c);                                                                \
    }
NVFP4_ROW_ENTRY(1)
NVFP4_ROW_ENTRY(2)
NVFP4_ROW_ENTRY(4)
NVFP4_ROW_ENTRY(8)

// The contract's dequantization multiplier of an NVFP4 block with scale byte `scale` and
// amax `amax`: fl(fl(e4m3_value(scale) * amax) * R2688); an element is fl(e2m1_value(code) *
// multiplier).
__device__ __forceinline__ float nvfp4_dequant_mult(u32 scale, float amax) {
    return __fmul_rn(__fmul_rn(e4m3_value(scale), amax), MXRL_R2688);
}

// Element i of an NVFP4 tensor with rows of `cols` elements, dequantized as the contract says:
// fl(e2m1_value(code) * fl(fl(e4m3_value(scale) * amax) * R2688)), amax per row or amax[0].
__device__ __forceinline__ float nvfp4_dequant_at(const u8* data, const u8* scales, const u32* amax_bits, u64 i, u64 cols, bool per_row) {
    u32 code = (data[i >> 1] >> (4u * (u32)(i & 1u))) & 0xFu;
    float a = __uint_as_float(amax_bits[per_row ? i / cols : 0]);
    return __fmul_rn(e2m1_value(code), nvfp4_dequant_mult(scales[i / MXRL_NVFP4_BLOCK], a));
}

extern "C" __global__ void nvfp4_dequantize(const u8* data, const u8* scales, const u32* amax_bits, float* out, u64 n, u64 cols, int per_row) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = nvfp4_dequant_at(data, scales, amax_bits, i, cols, per_row != 0);
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

// ---- FP8 block (ScaleRule::F32Exact / F32PowerOfTwo; reference mxrl_formats::reference's
// fp8_block and mxrl_formats::rules::fp8_block_scale) ----

__device__ __forceinline__ bool is_inf(float v) { return (__float_as_uint(v) & 0x7FFFFFFFu) == 0x7F800000u; }

// The block's scale from its amax (>= 0, never NaN): 1 for amax 0 or Inf, else
// fl(E4M3_MAX / amax) with an Inf quotient replaced by f32::MAX; the power-of-two rule then
// keeps the sign and exponent bits only. scale_inv = fl(1 / scale) is what is stored.
__device__ __forceinline__ float fp8_block_scale(float amax, bool pow2, float& scale_inv) {
    float scale = 1.0f;
    if (amax != 0.0f && !is_inf(amax)) {
        scale = __fdiv_rn(MXRL_E4M3_MAX_F, amax);
        if (is_inf(scale)) scale = MXRL_F32_MAX;
    }
    if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    scale_inv = __fdiv_rn(1.0f, scale);
    return scale;
}

// 1×128 blocks along K (Fp8Blocks::Activation1x128) of x [M, K], K % 128 == 0: one warp per
// block (blocks are contiguous: block b = elements 128·b .. 128·b + 128, its scale_inv at
// scales[b], row-major [M, K/128]); lane l takes the four consecutive elements 4l .. 4l + 4.
// The block's amax (NaN ignored) is reduced over the warp; the lane's four codes are stored
// as one aligned 4-byte word. A warp past the last block returns as a whole (its lanes share
// b), so every shuffle has all 32 lanes.
#if MXRL_FP8_BLOCK != 128
#error "fp8_block_act maps one 128-element block to one warp of four elements per lane"
#endif
//
// fp8_block_act_word: the lane's four codes of block b (element 4·lane + j in byte j) and the
// block's scale_inv, for every lane of the warp (the whole warp calls it with the same b).
template <typename T>
__device__ __forceinline__ u32 fp8_block_act_word(const T* x, u64 b, u32 lane, bool pow2, float& inv) {
    const u64 base = b * MXRL_FP8_BLOCK + 4u * lane;
    float v[4];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = load(x, base + j);
        m = nan_ignoring_max(m, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, off));
    const float scale = fp8_block_scale(m, pow2, inv);
    u32 w = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) w |= e4m3_encode(__fmul_rn(v[j], scale)) << (8 * j);
    return w;
}
template <typename T>
__device__ void fp8_block_act(const T* x, u8* data, float* scales, u64 n_blocks, bool pow2) {
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (b >= n_blocks) return;
    const u32 lane = threadIdx.x & 31u;
    float inv;
    const u32 w = fp8_block_act_word(x, b, lane, pow2, inv);
    *reinterpret_cast<u32*>(data + b * MXRL_FP8_BLOCK + 4u * lane) = w;
    if (lane == 0u) scales[b] = inv;
}
extern "C" __global__ void fp8_block_act_f32(const float* x, u8* d, float* s, u64 n, int pow2) { fp8_block_act(x, d, s, n, pow2 != 0); }
extern "C" __global__ void fp8_block_act_bf16(const u16* x, u8* d, float* s, u64 n, int pow2) { fp8_block_act(x, d, s, n, pow2 != 0); }

// 128×128 tiles (Fp8Blocks::Weight128x128) of x [M, K], M and K multiples of 128: one CTA of
// FP8W_THREADS threads per tile (tile t = row-major index in [M/128, K/128], its scale_inv at
// scales[t]); thread i takes the tile's elements i, i + FP8W_THREADS, ... in row-major order
// (a warp reads 32 consecutive elements of one row): the tile's amax (NaN ignored, reduced
// over the CTA), then every element again, encoded. No thread returns early (one barrier).
#define FP8W_THREADS 256
template <typename T>
__device__ void fp8_block_weight(const T* x, u8* data, float* scales, u64 tiles_per_row, u64 cols, bool pow2) {
    __shared__ float warp_max_s[FP8W_THREADS / 32];
    const u64 tile = blockIdx.x;
    const u64 r0 = (tile / tiles_per_row) * MXRL_FP8_BLOCK;
    const u64 c0 = (tile % tiles_per_row) * MXRL_FP8_BLOCK;
    const u32 tile_elems = MXRL_FP8_BLOCK * MXRL_FP8_BLOCK;
    float m = 0.0f;
    for (u32 i = threadIdx.x; i < tile_elems; i += FP8W_THREADS) {
        const u64 idx = (r0 + i / MXRL_FP8_BLOCK) * cols + c0 + i % MXRL_FP8_BLOCK;
        m = nan_ignoring_max(m, fabsf(load(x, idx)));
    }
    const float a = block_nan_ignoring_max<FP8W_THREADS>(m, warp_max_s);
    float inv;
    const float scale = fp8_block_scale(a, pow2, inv);
    for (u32 i = threadIdx.x; i < tile_elems; i += FP8W_THREADS) {
        const u64 idx = (r0 + i / MXRL_FP8_BLOCK) * cols + c0 + i % MXRL_FP8_BLOCK;
        data[idx] = (u8)e4m3_encode(__fmul_rn(load(x, idx), scale));
    }
    if (threadIdx.x == 0u) scales[tile] = inv;
}
extern "C" __global__ void __launch_bounds__(FP8W_THREADS)
    fp8_block_weight_f32(const float* x, u8* d, float* s, u64 tpr, u64 cols, int pow2) { fp8_block_weight(x, d, s, tpr, cols, pow2 != 0); }
extern "C" __global__ void __launch_bounds__(FP8W_THREADS)
    fp8_block_weight_bf16(const u16* x, u8* d, float* s, u64 tpr, u64 cols, int pow2) { fp8_block_weight(x, d, s, tpr, cols, pow2 != 0); }

// Dequantize FP8 block: x = fl(e4m3_value(code) · scale_inv[block]) with blocks of tile_rows
// rows (128 for weights, 1 for activations) × 128 columns; one thread per element.
extern "C" __global__ void fp8_block_dequantize(const u8* data, const float* scales, float* out, u64 n, u64 cols, u64 tile_rows) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u64 r = i / cols, c = i % cols;
    const float s = scales[(r / tile_rows) * (cols / MXRL_FP8_BLOCK) + c / MXRL_FP8_BLOCK];
    out[i] = __fmul_rn(e4m3_value(data[i]), s);
}
