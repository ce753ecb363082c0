// Low-byte decode: grouped small-M GEMMs that read MXFP8 / NVFP4 expert weights as stored and
// dequantize them in registers, the activation quantizers that feed them, and plain weight
// dequantization for the large-M (tensor-core) path.
//
// Compiled after kernels/quant.cu (module source = prelude + common.cuh + quant.cu + this
// file), so the encoders here are the byte-tested contract functions of quant.cu
// (e4m3_encode, ue4m3_encode, e2m1_encode, ue8m0_round_up, ue8m0_reciprocal, ue8m0_decode,
// nan_ignoring_max, load8) with the same operation order as its mxfp8_row / nvfp4 kernels.
// Numerics: --fmad=false --ftz=false, every rounding spelled with an _rn intrinsic.
//
// Exactness (why BF16 operands and f32 sums reproduce the CPU emulation, mxrl_tensor::qlinear):
// - MXFP8 values e4m3 × 2^(s−127) have ≤ 4 significant bits. They are exact in BF16 when their
//   lowest bit is ≥ 2^−133 (BF16's smallest subnormal): always for scale bytes s ≥ 3, i.e. for
//   every block whose amax exceeds 448·2^−125 ≈ 1.05e−35. Below that the activation value is
//   rounded to nearest-even BF16 (f32_to_bf16), the only place this path differs from the
//   contract dequantization. Overflow (a block at f32's limit decoding to ±Inf) and NaN codes
//   give the same Inf / NaN as the CPU.
// - NVFP4 operands e2m1 × e4m3(block scale) have ≤ 6 significant bits and lie in [2^−10, 2688]:
//   always exact in BF16 and in binary16.
// - Products of two such operands are exact in f32 (MXFP8: ≤ 8 significant bits, exact while
//   |x·w| is 0 or in [2^−126, f32::MAX], i.e. the two blocks' scale bytes add up to at least
//   123 — block amax product above ~2^−113 — and the product does not overflow; NVFP4: ≤ 12
//   bits in [2^−20, 2688²], always). With exact products fma(x, w, acc) = fl(acc + x·w): the
//   kernels' fused multiply-adds give the values of a separate multiply and add, and only
//   the order of the f32 sum differs from the CPU (bound: two_order_sum_bound).
// - NVFP4's per-token × per-tensor factor is applied after the sum, as the CPU does:
//   y = fl(acc · α), α = fl(fl(amax_x[r] · amax_w[e]) · MXRL_NVFP4_ALPHA_FACTOR_INV).
//
// Decoders (need sm_89+): E4M3 through cvt.rn.f16x2.e4m3x2 (exact, NaN kept) and
// cvt.f32.f16, then one f32 multiply by the power-of-two scale; E2M1 through a byte-permute
// lookup of the binary16 high bytes (MXRL_E2M1_F16HI_*, generated from E2M1_VALUES), the sign
// bit moved in, and one binary16 multiply by the block scale (exact: see above). The same
// decoders produce the activation operands, so the activation tests check them on every code
// the quantizers emit, and the dequantization tests on all codes.
//
// Grouped layout as kernels/ops_gemm.cu: rows of expert e are offsets[e]..offsets[e+1]
// (clamped to [0, R]; a decreasing offset gives an empty expert), weights stacked per expert.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "ops_qgemm needs sm_89 or newer (cvt.rn.f16x2.e4m3x2)"
#endif

// ---- decoders ----

// Two E4M3 codes (low byte → low half) as binary16, exactly (NaN codes give NaN).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)(pair & 0xFFFFu)));
    return h;
}

__device__ __forceinline__ void f16x2_to_f32x2(u32 h, float& lo, float& hi) {
    asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(h));
}

__device__ __forceinline__ u32 hmul2_rn(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The value of one E4M3 byte (exact), without the constant-memory table (lanes index it
// divergently in the hot loops).
__device__ __forceinline__ float e4m3_value_cvt(u32 code) {
    float lo, hi;
    f16x2_to_f32x2(e4m3x2_to_f16x2(code & 0xFFu), lo, hi);
    return lo;
}

// The bits of ue8m0_decode(b) (b < 256) as selects, without branches: the decode runs per
// chunk and weight row in the fragment kernels' loops.
__device__ __forceinline__ u32 ue8m0_bits(u32 b) {
    u32 v = b << 23;
    v = b == 0u ? 0x00400000u : v;
    return b == 0xFFu ? 0x7FC00000u : v;
}

// Four E4M3 codes (element j in byte j of w) times sc = ue8m0_decode(s):
// v[j] = fl(sc · e4m3_value(code_j)), the contract's MXFP8 dequantization (exact in f32).
__device__ __forceinline__ void mxfp8_decode4(u32 w, float sc, float v[4]) {
    f16x2_to_f32x2(e4m3x2_to_f16x2(w), v[0], v[1]);
    f16x2_to_f32x2(e4m3x2_to_f16x2(w >> 16), v[2], v[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __fmul_rn(v[j], sc);
}

// Eight E4M3 codes (bytes of w0, then of w1), as mxfp8_decode4.
__device__ __forceinline__ void mxfp8_decode8(u32 w0, u32 w1, float sc, float v[8]) {
    mxfp8_decode4(w0, sc, v);
    mxfp8_decode4(w1, sc, v + 4);
}

// Four E2M1 codes (nibbles of the low 16 bits of w, element j in nibble j: the contract's
// packing read as a little-endian word) times the block scale sf2 (its binary16 value in both
// halves): v[j] = e2m1_value(code_j) · e4m3_value(scale), exact (the Operand::Nvfp4 `pre`
// values of mxrl_tensor::qlinear).
__device__ __forceinline__ void nvfp4_decode4(u32 w, u32 sf2, float v[4]) {
    // Binary16 high bytes of the four magnitudes (selector nibbles 0..7: no sign mode).
    u32 t = __byte_perm(MXRL_E2M1_F16HI_0123, MXRL_E2M1_F16HI_4567, w & 0x7777u);
    // Sign bits (nibble bit 3) into bit 7 of the matching byte: element 2i's from byte i of
    // w << 4, element 2i+1's from byte i of w.
    t |= __byte_perm(w << 4, w, 0x5140u) & 0x80808080u;
    // Bytes → high bytes of binary16 pairs (bytes 4..7 of the permute input are 0), times
    // the scale.
    f16x2_to_f32x2(hmul2_rn(__byte_perm(t, 0u, 0x1404u), sf2), v[0], v[1]);
    f16x2_to_f32x2(hmul2_rn(__byte_perm(t, 0u, 0x3424u), sf2), v[2], v[3]);
}

// Eight E2M1 codes (the eight nibbles of w), as nvfp4_decode4.
__device__ __forceinline__ void nvfp4_decode8(u32 w, u32 sf2, float v[8]) {
    nvfp4_decode4(w, sf2, v);
    nvfp4_decode4(w >> 16, sf2, v + 4);
}

// Binary16 splat of an E4M3 block-scale byte.
__device__ __forceinline__ u32 e4m3_f16_splat(u32 b) { return e4m3x2_to_f16x2((b & 0xFFu) * 0x101u); }

// ---- activation quantizers (reference: mxrl_formats::quantize, then the qlinear operand) ----

// MXFP8 row-wise (1×32 blocks along K) of x [rows, K] f32, written as the dequantized values
// in BF16: out = bf16(fl(ue8m0_decode(s) · e4m3_value(q))). Four threads per block, eight
// consecutive elements each (mxfp8_row's mapping and operation order); n_blocks = rows·K/32.
// One thread's eight consecutive values v of a 32-block whose four threads are consecutive
// lanes (4i .. 4i+3; every lane of the warp calls it, inactive ones with zeros): the block's
// UE8M0 scale from the four maxima, the E4M3 codes, and their BF16 dequantization stored at
// out when `active`.
__device__ __forceinline__ void mxfp8_act_encode8(const float (&v)[8], bool active, u16* out) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 1));
    m = nan_ignoring_max(m, __shfl_xor_sync(FULL_MASK, m, 2));
    const u32 s = ue8m0_round_up(__fmul_rn(m, MXRL_R448));
    const float inv = ue8m0_reciprocal(s);
    u32 w0 = 0, w1 = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        w0 |= e4m3_encode(__fmul_rn(v[j], inv)) << (8 * j);
        w1 |= e4m3_encode(__fmul_rn(v[4 + j], inv)) << (8 * j);
    }
    if (!active) return;
    float d[8];
    mxfp8_decode8(w0, w1, ue8m0_decode(s), d);
    *reinterpret_cast<uint4*>(out) = pack_bf16x8(d);
}

extern "C" __global__ void __launch_bounds__(256)
    quant_act_mxfp8(const float* __restrict__ x, u16* __restrict__ out, u64 n_blocks) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = (t >> 2) < n_blocks;
    float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (active) load8(x, t * 8, v);
    mxfp8_act_encode8(v, active, out + t * 8);
}

// Two f32 values as a binary16 pair (low half: lo), rounded to nearest even.
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Eight f32 values exact in binary16 (NVFP4 operand values) as eight binary16 bit patterns.
__device__ __forceinline__ uint4 pack_f16x8(const float v[8]) {
    uint4 o;
    o.x = f32x2_to_f16x2(v[0], v[1]);
    o.y = f32x2_to_f16x2(v[2], v[3]);
    o.z = f32x2_to_f16x2(v[4], v[5]);
    o.w = f32x2_to_f16x2(v[6], v[7]);
    return o;
}

// Where an activation quantizer reads the f32 values of its row `row` (chunk c = elements
// 8c .. 8c+8), so that the op that would have written them is fused into the quantizer:
// - ActPlain: x [rows, K] itself;
// - ActGather: routed row p is token row perm[p] / top_k of x [tokens, K] (moe_gather_f32's
//   mapping): the quantizer of the gathered rows, without the gathered copy;
// - ActSwiglu: SwiGLU of the fused gate/up row gu [rows, 2K] (gate in 0..K, up in K..2K), the
//   value swiglu_fwd writes: fl(silu(g) · u) with common.cuh's swiglu_silu.
// Each row is quantized alone (MXFP8 1×32 blocks, NVFP4's per-token amax), so the fused
// quantizers write the bytes the unfused ops followed by the plain quantizer write.
#define QAM_THREADS 256
struct ActPlain {
    const float* x;
    u64 k;
    __device__ __forceinline__ void load(u64 row, u64 c, float v[8]) const { load8(x + row * k, c * 8, v); }
};
struct ActGather {
    const float* x;
    const u32* perm;
    u32 top_k;
    u64 k;
    __device__ __forceinline__ void load(u64 row, u64 c, float v[8]) const {
        load8(x + (u64)(perm[row] / top_k) * k, c * 8, v);
    }
};
struct ActSwiglu {
    const float* gu;
    u64 k;
    __device__ __forceinline__ void load(u64 row, u64 c, float v[8]) const {
        const float* g = gu + row * 2 * k;
        float gv[8], uv[8];
        load8(g, c * 8, gv);
        load8(g + k, c * 8, uv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(swiglu_silu(gv[j]), uv[j]);
    }
};

// MXFP8 row-wise of row `row` (chunks c = t, t + blockDim.x, ... < K/8 of the block's threads;
// four threads per 32-block): quant_act_mxfp8's encoding per chunk, written to out[row, :].
template <class Src>
__device__ __forceinline__ void quant_act_mxfp8_row(const Src& src, u64 row, u16* __restrict__ out, u64 k) {
    const u64 chunks = k / 8;
    for (u64 base = 0; base < chunks; base += blockDim.x) {
        const u64 c = base + threadIdx.x;
        const bool active = c < chunks;  // chunks % 4 == 0: the four threads of a block agree
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (active) src.load(row, c, v);
        mxfp8_act_encode8(v, active, out + row * k + c * 8);
    }
}

// quant_act_mxfp8 of gathered rows (grid: one block per routed row p < tokens·top_k; rows past
// offsets[e] exist only for dropped ids and are left untouched, as moe_gather_f32 leaves them).
extern "C" __global__ void __launch_bounds__(QAM_THREADS)
    quant_act_mxfp8_gather(const float* __restrict__ x, const u32* __restrict__ perm,
                           const u32* __restrict__ offsets, u32 e, u32 top_k, u64 k, u16* __restrict__ out) {
    const u64 p = blockIdx.x;
    if (p >= offsets[e]) return;
    quant_act_mxfp8_row(ActGather{x, perm, top_k, k}, p, out, k);
}

// quant_act_mxfp8 of SwiGLU(gu) (grid: one block per row): swiglu_fwd then quant_act_mxfp8.
extern "C" __global__ void __launch_bounds__(QAM_THREADS)
    quant_act_mxfp8_swiglu(const float* __restrict__ gu, u64 k, u16* __restrict__ out) {
    quant_act_mxfp8_row(ActSwiglu{gu, k}, blockIdx.x, out, k);
}

// Column-wise MXFP8 of a 32 × 64 tile (32×1 blocks, one per column), dequantized by the
// contract: thread (r, c8) = (t / 8, t % 8) of the block's 256 gives its eight values w of row
// r, columns [8·c8, 8·c8 + 8) (zeros for rows past the data: the zero padding, which leaves a
// block's amax as it is) and gets back in d their values fl(ue8m0_decode(s) · e4m3_value(q)).
// The column amax is the largest magnitude of four partial maxima (NaN ignored: the same value
// in any order). Every thread of the block calls it (barriers).
__device__ __forceinline__ void mxfp8_col_tile32x64(float (&tile)[32][65], float (&part)[4][64],
                                                    const float (&w)[8], float (&d)[8]) {
    const u32 r = threadIdx.x >> 3, c8 = threadIdx.x & 7u;
#pragma unroll
    for (int j = 0; j < 8; ++j) tile[r][c8 * 8 + j] = w[j];
    __syncthreads();
    // Column c's block: thread (q, c) = (t / 64, t % 64) holds rows [8q, 8q + 8).
    const u32 c = threadIdx.x & 63u, q = threadIdx.x >> 6;
    float mx = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = nan_ignoring_max(mx, fabsf(tile[q * 8 + j][c]));
    part[q][c] = mx;
    __syncthreads();
    mx = nan_ignoring_max(nan_ignoring_max(part[0][c], part[1][c]), nan_ignoring_max(part[2][c], part[3][c]));
    const u32 sc = ue8m0_round_up(__fmul_rn(mx, MXRL_R448));
    const float inv = ue8m0_reciprocal(sc), dec = ue8m0_decode(sc);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float x = tile[q * 8 + j][c];
        tile[q * 8 + j][c] = __fmul_rn(dec, e4m3_value(e4m3_encode(__fmul_rn(x, inv))));
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] = tile[r][c8 * 8 + j];
}

// Column-wise MXFP8 of the rows `src` names in row segments of at most 32 rows (segment j:
// rows seg[2j] .. seg[2j] + seg[2j+1], never across a group, each one 32×1 block per column
// zero-padded: the contract's column-wise quantization of each group's rows as its own
// tensor), dequantized into BF16 col_out [rows, k]; with write_row != 0 also row_out =
// quant_act_mxfp8's values of those rows (mxfp8_act_encode8: the four threads of a 1×32
// block are adjacent lanes), from the same read. One block of 256 threads per tile of a
// segment × 64 columns (k % 64 == 0; tile (j, tc) = (blockIdx.x / (k/64), blockIdx.x %
// (k/64)), thread (r, c8) = (t / 8, t % 8) reading row seg[2j] + r's chunk 8·tc + c8). Rows
// outside every segment are not written.
template <class Src>
__device__ __forceinline__ void mxfp8_rowcol_segments(const Src& src, const u32* __restrict__ seg,
                                                      u16* __restrict__ col_out, u16* __restrict__ row_out,
                                                      int write_row, u64 k) {
    __shared__ float tile[32][65];
    __shared__ float part[4][64];
    const u64 tpr = k / 64, j = blockIdx.x / tpr, tc = blockIdx.x - j * tpr;
    const u64 r0 = seg[2 * j];
    const u32 len = seg[2 * j + 1];
    const u32 r = threadIdx.x >> 3, c8 = threadIdx.x & 7u;
    const bool live = r < len;
    const u64 at = (r0 + r) * k + tc * 64 + c8 * 8;
    float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (live) src.load(r0 + r, tc * 8 + c8, w);
    if (write_row) mxfp8_act_encode8(w, live, row_out + at);
    float d[8];
    mxfp8_col_tile32x64(tile, part, w, d);
    if (live) *reinterpret_cast<uint4*>(col_out + at) = pack_bf16x8(d);
}

// mxfp8_rowcol_segments of x [rows, k] itself.
extern "C" __global__ void __launch_bounds__(256)
    quant_act_mxfp8_rowcol(const float* __restrict__ x, const u32* __restrict__ seg, u16* __restrict__ col_out,
                           u16* __restrict__ row_out, int write_row, u64 k) {
    mxfp8_rowcol_segments(ActPlain{x, k}, seg, col_out, row_out, write_row, k);
}

// mxfp8_rowcol_segments of the gathered rows (row p: token row perm[p] / top_k of x).
extern "C" __global__ void __launch_bounds__(256)
    quant_act_mxfp8_rowcol_gather(const float* __restrict__ x, const u32* __restrict__ perm, u32 top_k,
                                  const u32* __restrict__ seg, u16* __restrict__ col_out,
                                  u16* __restrict__ row_out, int write_row, u64 k) {
    mxfp8_rowcol_segments(ActGather{x, perm, top_k, k}, seg, col_out, row_out, write_row, k);
}

// mxfp8_rowcol_segments of SwiGLU(gu) (gu [rows, 2k]).
extern "C" __global__ void __launch_bounds__(256)
    quant_act_mxfp8_rowcol_swiglu(const float* __restrict__ gu, const u32* __restrict__ seg,
                                  u16* __restrict__ col_out, u16* __restrict__ row_out, int write_row, u64 k) {
    mxfp8_rowcol_segments(ActSwiglu{gu, k}, seg, col_out, row_out, write_row, k);
}

// NVFP4 per token (one amax per row, AmaxScope::PerRow) of x [rows, K] f32: amax[row] = the
// row's max|x| (NaN ignored, from +0), pre = e2m1_value(code) · e4m3_value(scale) in BF16, or
// with F16 in binary16 (both exact: ≤ 6 significant bits in [2^-10, 2688]; the fragment
// kernels multiply binary16). One block of QA_THREADS per row: a pass for the amax, then the
// quantization pass (the operation order of quant.cu's NVFP4 block encoder nvfp4_block16;
// two threads per 16-element block). With CACHE > 0 a thread keeps the values of its first
// CACHE chunks in registers between the passes (sources that compute their values, SwiGLU,
// then compute each value once); later chunks are read again. With PARTS, also the three BF16
// parts of the contract dequantization of every element (nvfp4_dequant_at's value, through
// quant.cu's nvfp4_dequant_mult, for the codes, scale and amax just made, then common.cuh's
// split_bf16x3: hi + mid + lo, exact) at parts[row·k + i], parts[pstride + row·k + i], parts[2·pstride + row·k + i]: the
// `dequantized` wgrad's operand (qlinear_nvfp4_dequant_split3's values) from the same pass.
#define QA_THREADS 128
template <bool F16, int CACHE, bool PARTS = false, class Src>
__device__ __forceinline__ void quant_act_nvfp4_body(const Src& src, u64 row, u16* __restrict__ pre,
                                                     float* __restrict__ amax, u64 k,
                                                     u16* __restrict__ parts = nullptr, u64 pstride = 0) {
    __shared__ float warp_max_s[QA_THREADS / 32];
    const u64 chunks = k / 8;
    float cache[CACHE > 0 ? CACHE : 1][8];
    float m = 0.0f;
    {
        int i = 0;
        for (u64 c = threadIdx.x; c < chunks; c += QA_THREADS, ++i) {
            float v[8];
            src.load(row, c, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = nan_ignoring_max(m, fabsf(v[j]));
#pragma unroll
            for (int ci = 0; ci < CACHE; ++ci)
                if (i == ci) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) cache[ci][j] = v[j];
                }
        }
    }
    const float a = block_nan_ignoring_max<QA_THREADS>(m, warp_max_s);
    if (threadIdx.x == 0) amax[row] = a;
    float s_enc = __fdiv_rn(MXRL_NVFP4_NUMERATOR, a);
    s_enc = s_enc > MXRL_F32_MAX ? MXRL_F32_MAX : s_enc;
    if (a == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    const float s_dec = __fdiv_rn(1.0f, s_enc);
    const float mult = __fmul_rn(s_enc, MXRL_R6);
    int i = 0;
    for (u64 base = 0; base < chunks; base += QA_THREADS, ++i) {
        const u64 c = base + threadIdx.x;
        const bool active = c < chunks;  // chunks is even: both threads of a 16-block agree
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (active) {
            bool cached = false;
#pragma unroll
            for (int ci = 0; ci < CACHE; ++ci)
                if (i == ci) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[j] = cache[ci][j];
                    cached = true;
                }
            if (!cached) src.load(row, c, v);
        }
        float bmax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) bmax = nan_ignoring_max(bmax, fabsf(v[j]));
        bmax = nan_ignoring_max(bmax, __shfl_xor_sync(FULL_MASK, bmax, 1));
        float sdec = __fmul_rn(bmax, mult);
        sdec = sdec > MXRL_F32_MAX ? MXRL_F32_MAX : sdec;
        const u32 scale = ue4m3_encode(sdec);
        const u32 sf2 = e4m3_f16_splat(scale);
        float sf, sf_hi;
        f16x2_to_f32x2(sf2, sf, sf_hi);
        float enc = __fdiv_rn(1.0f, __fmul_rn(sf, s_dec));
        enc = enc > MXRL_F32_MAX ? MXRL_F32_MAX : enc;
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) word |= e2m1_encode(__fmul_rn(v[j], enc)) << (4 * j);
        if (!active) continue;
        float d[8];
        nvfp4_decode8(word, sf2, d);
        *reinterpret_cast<uint4*>(pre + row * k + c * 8) = F16 ? pack_f16x8(d) : pack_bf16x8(d);
        if (PARTS) {
            const float dq = nvfp4_dequant_mult(scale, a);
            u16 h[3][8];
#pragma unroll
            for (int j = 0; j < 8; ++j)
                split_bf16x3(__fmul_rn(e2m1_value((word >> (4 * j)) & 0xFu), dq), h[0][j], h[1][j], h[2][j]);
#pragma unroll
            for (int p = 0; p < 3; ++p)
                *reinterpret_cast<uint4*>(parts + p * pstride + row * k + c * 8) =
                    make_uint4(h[p][0] | ((u32)h[p][1] << 16), h[p][2] | ((u32)h[p][3] << 16),
                               h[p][4] | ((u32)h[p][5] << 16), h[p][6] | ((u32)h[p][7] << 16));
        }
    }
}
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4(const float* __restrict__ x, u16* __restrict__ pre, float* __restrict__ amax, u64 k) {
    quant_act_nvfp4_body<false, 0>(ActPlain{x, k}, blockIdx.x, pre, amax, k);
}
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4_f16(const float* __restrict__ x, u16* __restrict__ pre, float* __restrict__ amax, u64 k) {
    quant_act_nvfp4_body<true, 0>(ActPlain{x, k}, blockIdx.x, pre, amax, k);
}

// quant_act_nvfp4[_f16] of gathered rows (grid: one block per routed row p < tokens·top_k;
// rows past offsets[e] are left untouched, as moe_gather_f32 leaves them): the token rows'
// quantization followed by the gathers of their operands and amaxes, in one launch.
#define QA_GATHER(NAME, F16)                                                                              \
    extern "C" __global__ void __launch_bounds__(QA_THREADS)                                              \
        NAME(const float* __restrict__ x, const u32* __restrict__ perm, const u32* __restrict__ offsets, \
             u32 e, u32 top_k, u64 k, u16* __restrict__ pre, float* __restrict__ amax) {                  \
        const u64 p = blockIdx.x;                                                                         \
        if (p >= offsets[e]) return;                                                                      \
        quant_act_nvfp4_body<F16, 2>(ActGather{x, perm, top_k, k}, p, pre, amax, k);                      \
    }
QA_GATHER(quant_act_nvfp4_gather, false)
QA_GATHER(quant_act_nvfp4_f16_gather, true)

// quant_act_nvfp4[_f16]_gather that also writes the three BF16 parts of every element's
// contract dequantization (quant_act_nvfp4_body's PARTS; part planes of pstride elements):
// the `dequantized` backward's wgrad operand, kept by a taped forward.
#define QA_GATHER_PARTS(NAME, F16)                                                                        \
    extern "C" __global__ void __launch_bounds__(QA_THREADS)                                              \
        NAME(const float* __restrict__ x, const u32* __restrict__ perm, const u32* __restrict__ offsets, \
             u32 e, u32 top_k, u64 k, u16* __restrict__ pre, float* __restrict__ amax,                    \
             u16* __restrict__ parts, u64 pstride) {                                                      \
        const u64 p = blockIdx.x;                                                                         \
        if (p >= offsets[e]) return;                                                                      \
        quant_act_nvfp4_body<F16, 2, true>(ActGather{x, perm, top_k, k}, p, pre, amax, k, parts, pstride); \
    }
QA_GATHER_PARTS(quant_act_nvfp4_parts_gather, false)
QA_GATHER_PARTS(quant_act_nvfp4_f16_parts_gather, true)

// quant_act_nvfp4[_f16] of SwiGLU(gu) (grid: one block per row; each value computed once for
// K ≤ 2048): swiglu_fwd followed by the quantizer, in one launch.
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4_swiglu(const float* __restrict__ gu, u64 k, u16* __restrict__ pre, float* __restrict__ amax) {
    quant_act_nvfp4_body<false, 2>(ActSwiglu{gu, k}, blockIdx.x, pre, amax, k);
}
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4_f16_swiglu(const float* __restrict__ gu, u64 k, u16* __restrict__ pre,
                               float* __restrict__ amax) {
    quant_act_nvfp4_body<true, 2>(ActSwiglu{gu, k}, blockIdx.x, pre, amax, k);
}
// quant_act_nvfp4[_f16]_swiglu with the parts (as quant_act_nvfp4_parts_gather).
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4_parts_swiglu(const float* __restrict__ gu, u64 k, u16* __restrict__ pre,
                                 float* __restrict__ amax, u16* __restrict__ parts, u64 pstride) {
    quant_act_nvfp4_body<false, 2, true>(ActSwiglu{gu, k}, blockIdx.x, pre, amax, k, parts, pstride);
}
extern "C" __global__ void __launch_bounds__(QA_THREADS)
    quant_act_nvfp4_f16_parts_swiglu(const float* __restrict__ gu, u64 k, u16* __restrict__ pre,
                                     float* __restrict__ amax, u16* __restrict__ parts, u64 pstride) {
    quant_act_nvfp4_body<true, 2, true>(ActSwiglu{gu, k}, blockIdx.x, pre, amax, k, parts, pstride);
}

// FP8 block 1×128 along K (Scheme::FP8_BLOCK_ACT) of x [rows, K] f32 as the staged FP8-block
// kernels' operand: out = the binary16 value of each E4M3 code (exact: ≤ 4 significant bits
// in [2⁻⁹, 448], NaN codes NaN), scales = the blocks' f32 scale_inv [rows, K/128]. The codes
// and scale_inv are quant.cu's fp8_block_act (the same function, one warp per block, four
// elements per lane); n_blocks = rows·K/128, pow2 the scheme's power-of-two scale rule.
extern "C" __global__ void __launch_bounds__(256)
    quant_act_fp8_block_f16(const float* __restrict__ x, u16* __restrict__ out, float* __restrict__ scales,
                            u64 n_blocks, int pow2) {
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (b >= n_blocks) return;  // the whole warp (its lanes share b)
    const u32 lane = threadIdx.x & 31u;
    float inv;
    const u32 w = fp8_block_act_word(x, b, lane, pow2 != 0, inv);
    *reinterpret_cast<uint2*>(out + b * MXRL_FP8_BLOCK + 4u * lane) =
        make_uint2(e4m3x2_to_f16x2(w), e4m3x2_to_f16x2(w >> 16));
    if (lane == 0u) scales[b] = inv;
}

// ---- plain weight dequantization to BF16 (large-M path; eight elements per thread) ----

// MXFP8 row-wise [n, K/32]-scaled codes (n = E·N rows, K % 32 == 0): out = bf16 of the
// contract dequantization (exact for scale bytes ≥ 3, else rounded to nearest even).
extern "C" __global__ void __launch_bounds__(256)
    dequant_mxfp8_bf16(const u8* __restrict__ codes, const u8* __restrict__ scales, u16* __restrict__ out, u64 n8) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n8) return;
    const uint2 c = *reinterpret_cast<const uint2*>(codes + t * 8);
    float d[8];
    mxfp8_decode8(c.x, c.y, ue8m0_decode(scales[t / 4]), d);
    *reinterpret_cast<uint4*>(out + t * 8) = pack_bf16x8(d);
}

// NVFP4 codes [n, K/2] with E4M3 scales [n, K/16] (K % 16 == 0): out = the GEMM operand
// e2m1 · e4m3(scale) in BF16 (exact). The per-tensor factor is not applied: the GEMM's output
// takes α afterwards (nvfp4_scale_rows), as the CPU emulation does.
extern "C" __global__ void __launch_bounds__(256)
    dequant_nvfp4_bf16(const u8* __restrict__ codes, const u8* __restrict__ scales, u16* __restrict__ out, u64 n8) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n8) return;
    const u32 w = *reinterpret_cast<const u32*>(codes + t * 4);
    float d[8];
    nvfp4_decode8(w, e4m3_f16_splat(scales[t / 2]), d);
    *reinterpret_cast<uint4*>(out + t * 8) = pack_bf16x8(d);
}

// ---- grouped small-M GEMMs on the stored bytes ----

#define QM_WARPS 8
#define QM_NB 4  // output columns per lane group
#define QM_RB 8  // rows per pass
#define QM_MIN_BLOCKS 2  // resident blocks per SM the register budget is cut for (≤ 128 registers)


// Sum over the LPC lanes of a group (butterfly, fixed order; every lane of the group ends
// with the total).
template <int LPC>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = LPC / 2; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ void widen_bf16x4(uint2 v, float* f) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xFFFF0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xFFFF0000u);
}

// acc[r][q] += Σ_j x[r][j]·wv[q][j] over four elements (j increasing) of rows r < nr, row r's
// four elements at xp + r·K (8-byte aligned).
__device__ __forceinline__ void qm_rows4(const u16* __restrict__ xp, u32 nr, u32 K, const float wv[QM_NB][4],
                                         float acc[QM_RB][QM_NB]) {
#pragma unroll
    for (int r = 0; r < QM_RB; ++r) {
        if ((u32)r < nr) {
            float xv[4];
            widen_bf16x4(*reinterpret_cast<const uint2*>(xp + (u64)r * K), xv);
#pragma unroll
            for (int q = 0; q < QM_NB; ++q)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[r][q] = __fmaf_rn(xv[j], wv[q][j], acc[r][q]);
        }
    }
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The lane's place: lane group lane / LPC of its warp owns columns n0 .. n0+QM_NB of expert
// blockIdx.y (`active` when they exist); `sub` is the lane's index in its group. Returns false when the whole
// warp lies past N (it may exit: no shuffle partner is left behind).
template <int LPC>
__device__ __forceinline__ bool qm_place(u32 N, u32& n0, u32& sub, bool& active) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 warp_n0 = ((u64)blockIdx.x * QM_WARPS + warp) * (QM_NB * (32 / LPC));
    const u64 n = warp_n0 + (lane / LPC) * QM_NB;
    n0 = (u32)n;  // meaningful only when active
    sub = lane % LPC;
    active = n < N;  // N % QM_NB == 0, so n0 < N implies n0 + QM_NB <= N
    return warp_n0 < N;
}

// The two stored formats as seen by the small-M kernels: a 16-byte load of codes holds CHUNK
// elements (STEPS decode steps of four), `raw` is the chunk's scale byte(s) as loaded and
// `prep` what the decoder takes.
struct QmMxfp8 {
    static constexpr u32 CHUNK = 16, STEPS = 4;
    static constexpr bool ALPHA = false;
    __device__ static u32 row_bytes(u32 K) { return K; }
    __device__ static u32 scale_row(u32 K) { return K / 32; }
    // The chunk's UE8M0 byte (a chunk lies inside one 32-block).
    __device__ static u32 load_scale(const u8* ws, u32 c) { return ws[c / 2]; }
    __device__ static u32 prep(u32 raw) { return ue8m0_bits(raw); }
    __device__ static void decode4(const uint4& w, u32 prep, int h, float v[4]) {
        mxfp8_decode4(word_of(w, h), __uint_as_float(prep), v);
    }
};
struct QmNvfp4 {
    static constexpr u32 CHUNK = 32, STEPS = 8;
    static constexpr bool ALPHA = true;
    __device__ static u32 row_bytes(u32 K) { return K / 2; }
    __device__ static u32 scale_row(u32 K) { return K / 16; }
    // The chunk's two E4M3 block scales (one u16; scale rows have an even length).
    __device__ static u32 load_scale(const u8* ws, u32 c) { return *reinterpret_cast<const u16*>(ws + 2 * c); }
    // Both scales as binary16 (low half: the first 16-block).
    __device__ static u32 prep(u32 raw) { return e4m3x2_to_f16x2(raw); }
    __device__ static void decode4(const uint4& w, u32 prep, int h, float v[4]) {
        const u32 sf2 = __byte_perm(prep, 0u, h < 4 ? 0x1010u : 0x3232u);
        nvfp4_decode4(word_of(w, h >> 1) >> (16 * (h & 1)), sf2, v);
    }
};

// y[r, n] = Σ_k x[r, k]·w_e[n, k] for every row r of expert e (times α(r, e) for NVFP4, see
// below), w_e the stored codes [N, K·bytes/elem] and block scales of expert e. Grid
// (⌈N / (QM_WARPS·QM_NB·32/LPC)⌉, E), block QM_WARPS·32. Lane `sub` of a lane group reads
// chunks c = sub + LPC·i of its QM_NB weight rows (one 16-byte load of codes and the scale
// byte(s) per row, the next chunk's loads issued before the current one is decoded), decodes
// them in registers and sums k = CHUNK·c + 4h + j in increasing i, h, j (f32 fma of exact
// products), rows in passes of QM_RB; then a butterfly over the group. Each used expert's
// bytes are read once per pass.
//
// NVFP4 (F::ALPHA): y = fl(sum · α), α = fl(fl(x_amax[r] · wa) · MXRL_NVFP4_ALPHA_FACTOR_INV),
// wa = w_amax[e] (mxrl_tensor::qlinear::nvfp4_alpha's operation order).
template <class F, int LPC>
__device__ __forceinline__ void qgemm_body(const u16* __restrict__ x, const float* __restrict__ x_amax,
                                           const u8* __restrict__ codes, const u8* __restrict__ scales,
                                           const float* __restrict__ w_amax, const u32* __restrict__ off,
                                           float* __restrict__ y, u32 R, u32 N, u32 K) {
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    if (lo == hi) return;
    u32 n0, sub;
    bool active;
    if (!qm_place<LPC>(N, n0, sub, active)) return;
    const u32 chunks = K / F::CHUNK, rowb = F::row_bytes(K), sk = F::scale_row(K);
    const u32 mine = active ? chunks : 0;  // chunks this lane group reads
    const u8* wc = codes + ((u64)e * N + n0) * rowb;
    const u8* ws = scales + ((u64)e * N + n0) * sk;
    const float wa = F::ALPHA ? w_amax[e] : 0.0f;
    for (u32 rb = lo; rb < hi; rb += QM_RB) {
        const u32 nr = min((u32)QM_RB, hi - rb);
        const u16* xp = x + (u64)rb * K;
        float acc[QM_RB][QM_NB];
#pragma unroll
        for (int r = 0; r < QM_RB; ++r)
#pragma unroll
            for (int q = 0; q < QM_NB; ++q) acc[r][q] = 0.0f;
        uint4 wq[QM_NB];
        u32 sr[QM_NB];
#pragma unroll
        for (int q = 0; q < QM_NB; ++q) {
            wq[q] = make_uint4(0u, 0u, 0u, 0u);
            sr[q] = 0u;
            if (sub < mine) {
                wq[q] = *reinterpret_cast<const uint4*>(wc + q * (u64)rowb + (u64)sub * 16);
                sr[q] = F::load_scale(ws + q * sk, sub);
            }
        }
        for (u32 c = sub; c - sub < chunks; c += LPC) {
            // Prefetch the next chunk (zeros past the end; never used).
            uint4 nq[QM_NB];
            u32 ns[QM_NB];
            const u32 cn = c + LPC;
#pragma unroll
            for (int q = 0; q < QM_NB; ++q) {
                nq[q] = make_uint4(0u, 0u, 0u, 0u);
                ns[q] = 0u;
                if (cn < mine) {
                    nq[q] = *reinterpret_cast<const uint4*>(wc + q * (u64)rowb + (u64)cn * 16);
                    ns[q] = F::load_scale(ws + q * sk, cn);
                }
            }
            if (c < mine) {
                u32 sp[QM_NB];
#pragma unroll
                for (int q = 0; q < QM_NB; ++q) sp[q] = F::prep(sr[q]);
#pragma unroll
                for (int h = 0; h < (int)F::STEPS; ++h) {
                    float wv[QM_NB][4];
#pragma unroll
                    for (int q = 0; q < QM_NB; ++q) F::decode4(wq[q], sp[q], h, wv[q]);
                    qm_rows4(xp + (c * F::CHUNK + 4 * h), nr, K, wv, acc);
                }
            }
#pragma unroll
            for (int q = 0; q < QM_NB; ++q) {
                wq[q] = nq[q];
                sr[q] = ns[q];
            }
        }
#pragma unroll
        for (int r = 0; r < QM_RB; ++r) {
            if ((u32)r < nr) {
                const float alpha =
                    F::ALPHA ? __fmul_rn(__fmul_rn(x_amax[rb + r], wa), MXRL_NVFP4_ALPHA_FACTOR_INV) : 1.0f;
#pragma unroll
                for (int q = 0; q < QM_NB; ++q) {
                    const float s = group_sum<LPC>(acc[r][q]);
                    if (active && sub == q) y[(u64)(rb + r) * N + n0 + q] = F::ALPHA ? __fmul_rn(s, alpha) : s;
                }
            }
        }
    }
}

#define QGEMM_MXFP8_ARGS                                                                                   \
    const u16 *__restrict__ x, const u8 *__restrict__ codes, const u8 *__restrict__ scales,               \
        const u32 *__restrict__ off, float *__restrict__ y, u32 E, u32 R, u32 N, u32 K
#define QGEMM_NVFP4_ARGS                                                                                   \
    const u16 *__restrict__ x, const float *__restrict__ x_amax, const u8 *__restrict__ codes,            \
        const u8 *__restrict__ scales, const float *__restrict__ w_amax, const u32 *__restrict__ off,     \
        float *__restrict__ y, u32 E, u32 R, u32 N, u32 K
// Entry points: suffix = lanes per column group (32: 4 columns per warp; 16: 8; 8: 16).
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_mxfp8_l32(QGEMM_MXFP8_ARGS) {
    qgemm_body<QmMxfp8, 32>(x, nullptr, codes, scales, nullptr, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_mxfp8_l16(QGEMM_MXFP8_ARGS) {
    qgemm_body<QmMxfp8, 16>(x, nullptr, codes, scales, nullptr, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_mxfp8_l8(QGEMM_MXFP8_ARGS) {
    qgemm_body<QmMxfp8, 8>(x, nullptr, codes, scales, nullptr, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_nvfp4_l32(QGEMM_NVFP4_ARGS) {
    qgemm_body<QmNvfp4, 32>(x, x_amax, codes, scales, w_amax, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_nvfp4_l16(QGEMM_NVFP4_ARGS) {
    qgemm_body<QmNvfp4, 16>(x, x_amax, codes, scales, w_amax, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_MIN_BLOCKS) qgemm_nvfp4_l8(QGEMM_NVFP4_ARGS) {
    qgemm_body<QmNvfp4, 8>(x, x_amax, codes, scales, w_amax, off, y, R, N, K);
}

// ---- NVFP4 output factor for the large-M path ----

#define NO_OWNER 0xFFFFFFFFu
// The expert that owns row r (the lowest-numbered one if an invalid table gives several), or
// NO_OWNER; every thread of the block gets it (one shared word, two barriers).
__device__ __forceinline__ u32 block_row_owner(const u32* __restrict__ off, u32 E, u32 R, u32 r) {
    __shared__ u32 owner;
    if (threadIdx.x == 0) owner = NO_OWNER;
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += blockDim.x) {
        u32 lo, hi;
        expert_rows(off, e, R, lo, hi);
        if (r >= lo && r < hi) atomicMin(&owner, e);
    }
    __syncthreads();
    return owner;
}

// y[r, :] = fl(y[r, :] · α(r, e)) for the expert e that owns row r; rows of no expert are
// untouched. One block per row; four columns per thread where the row starts 16-byte aligned
// and N % 4 == 0. per_row != 0: NVFP4's output factor α = fl(fl(x_amax[r] · w_amax[e]) ·
// (1 / factor)); per_row == 0: the weight's per-tensor factor of the contract's
// dequantization, α = fl(w_amax[e] · R2688), applied after a sum over e2m1 · e4m3 operands (the
// `dequantized` backward's dgrad; x_amax is not read).
extern "C" __global__ void __launch_bounds__(256)
    nvfp4_scale_rows(float* __restrict__ y, const float* __restrict__ x_amax, const float* __restrict__ w_amax,
                     const u32* __restrict__ off, u32 E, u32 R, u32 N, u32 per_row) {
    const u32 r = blockIdx.x;
    const u32 e = block_row_owner(off, E, R, r);
    if (e == NO_OWNER) return;
    const float alpha = per_row ? __fmul_rn(__fmul_rn(x_amax[r], w_amax[e]), MXRL_NVFP4_ALPHA_FACTOR_INV)
                                : __fmul_rn(w_amax[e], MXRL_R2688);
    float* yr = y + (u64)r * N;
    if ((N & 3u) == 0 && (reinterpret_cast<size_t>(yr) & 15u) == 0) {
        float4* y4 = reinterpret_cast<float4*>(yr);
        for (u32 n = threadIdx.x; n < N / 4; n += blockDim.x) {
            float4 v = y4[n];
            v.x = __fmul_rn(v.x, alpha);
            v.y = __fmul_rn(v.y, alpha);
            v.z = __fmul_rn(v.z, alpha);
            v.w = __fmul_rn(v.w, alpha);
            y4[n] = v;
        }
    } else {
        for (u32 n = threadIdx.x; n < N; n += blockDim.x) yr[n] = __fmul_rn(yr[n], alpha);
    }
}

// ---- grouped tensor-core GEMMs on the stored bytes (1–32 rows per expert) ----

// The block computes a 16-row × QT_BN-column tile of y for one expert (grid (N / QT_BN, E)):
// per reduction stage of QT_BK, each thread loads its share of the stored weight chunks (16-byte
// loads of codes and their scale bytes, two stages in flight ahead of the one multiplied) and
// of the activation operand, decodes the weights with the small-M kernels'
// decoders (the same exact values the BF16 dequantization writes), stores both as BF16 in
// shared memory, and the four warps multiply them with mma.m16n8k16 (BF16 operands, f32
// accumulation; warp w owns columns 16w .. 16w+16). Rows past 16 take further passes over the
// same weights. Products are exact; the f32 sums run in the tensor cores' order over k16 steps
// in increasing k (fixed: deterministic; bound as the tiled kernels'). NVFP4: y = fl(sum · α)
// as qgemm_body.
#define QT_BN 64
#define QT_BK 64
#define QT_THREADS 128
#define QT_LD (QT_BK + 8)  // bf16 row stride of the shared tiles: 144 bytes, conflict-free ldmatrix

__device__ __forceinline__ u32 qt_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void qt_ldsm_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(qt_smem(p))
                 : "memory");
}

__device__ __forceinline__ void qt_mma(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class F>
__device__ __forceinline__ void qgemm_tc_body(const u16* __restrict__ x, const float* __restrict__ x_amax,
                                              const u8* __restrict__ codes, const u8* __restrict__ scales,
                                              const float* __restrict__ w_amax, const u32* __restrict__ off,
                                              float* __restrict__ y, u32 R, u32 N, u32 K) {
    constexpr u32 CPR = QT_BK / F::CHUNK;          // weight chunks per row per stage
    constexpr u32 CPT = QT_BN * CPR / QT_THREADS;  // per thread (MXFP8 2, NVFP4 1)
    __shared__ __align__(128) u16 As[16 * QT_LD];
    __shared__ __align__(128) u16 Bs[QT_BN * QT_LD];
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    if (lo == hi) return;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 n0 = blockIdx.x * QT_BN;
    const u32 rowb = F::row_bytes(K), sk = F::scale_row(K), nk = K / QT_BK;
    const u8* wc = codes + ((u64)e * N + n0) * rowb;
    const u8* ws = scales + ((u64)e * N + n0) * sk;
    const float wa = F::ALPHA ? w_amax[e] : 0.0f;
    // This thread's weight chunks: row wrow[i], chunk wpart[i] of the stage.
    u32 wrow[CPT], wpart[CPT];
#pragma unroll
    for (u32 i = 0; i < CPT; ++i) {
        const u32 c = tid + i * QT_THREADS;
        wrow[i] = c / CPR;
        wpart[i] = c % CPR;
    }
    // Its activation chunk: row tid / 8, elements 8·(tid % 8) .. +8 of the stage.
    const u32 arow = tid >> 3, acol = (tid & 7) * 8;
    for (u32 rb = lo; rb < hi; rb += 16) {
        const u32 nr = min(16u, hi - rb);
        float acc[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
        // Two register sets, A for even and B for odd stages: stage kt + 2's loads are issued
        // into the set stage kt was just decoded from, so two stages are always in flight.
        uint4 wqa[CPT], wqb[CPT], xqa, xqb;
        u32 sra[CPT], srb[CPT];
        auto load = [&](u32 kt, uint4* wq, u32* sr, uint4& xq) {
#pragma unroll
            for (u32 i = 0; i < CPT; ++i) {
                const u32 c = kt * CPR + wpart[i];
                wq[i] = *reinterpret_cast<const uint4*>(wc + (u64)wrow[i] * rowb + (u64)c * 16);
                sr[i] = F::load_scale(ws + (u64)wrow[i] * sk, c);
            }
            xq = arow < nr ? *reinterpret_cast<const uint4*>(x + (u64)(rb + arow) * K + kt * QT_BK + acol)
                           : make_uint4(0u, 0u, 0u, 0u);
        };
        auto stage = [&](u32 kt, uint4* wq, u32* sr, uint4& xq) {
            // Decode this stage into shared memory.
#pragma unroll
            for (u32 i = 0; i < CPT; ++i) {
                const u32 sp = F::prep(sr[i]);
                u16* dst = Bs + wrow[i] * QT_LD + wpart[i] * F::CHUNK;
#pragma unroll
                for (int h = 0; h < (int)F::STEPS; h += 2) {
                    float v[8];
                    F::decode4(wq[i], sp, h, v);
                    F::decode4(wq[i], sp, h + 1, v + 4);
                    *reinterpret_cast<uint4*>(dst + 4 * h) = pack_bf16x8(v);
                }
            }
            *reinterpret_cast<uint4*>(As + arow * QT_LD + acol) = xq;
            __syncthreads();
            if (kt + 2 < nk) load(kt + 2, wq, sr, xq);
            const u32 li = lane >> 3, lj = lane & 7;
#pragma unroll
            for (int kk = 0; kk < QT_BK; kk += 16) {
                u32 a[4], b[4];
                // A (rows 0..15, k kk..kk+15): matrix li covers rows 8·(li & 1), k + 8·(li >> 1).
                qt_ldsm_x4(a, As + (8 * (li & 1) + lj) * QT_LD + kk + 8 * (li >> 1));
                // B (columns 16·warp .. +16): matrix li covers columns 8·(li >> 1), k + 8·(li & 1).
                qt_ldsm_x4(b, Bs + (16 * warp + 8 * (li >> 1) + lj) * QT_LD + kk + 8 * (li & 1));
                qt_mma(acc[0], a, b);
                qt_mma(acc[1], a, b + 2);
            }
            __syncthreads();  // the next stage overwrites the tiles
        };
        load(0, wqa, sra, xqa);
        if (nk > 1) load(1, wqb, srb, xqb);
        for (u32 kt = 0; kt < nk; kt += 2) {
            stage(kt, wqa, sra, xqa);
            if (kt + 1 < nk) stage(kt + 1, wqb, srb, xqb);
        }
        const u32 g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const u32 r = g + 8 * hh;
            if (r >= nr) continue;
            const float alpha =
                F::ALPHA ? __fmul_rn(__fmul_rn(x_amax[rb + r], wa), MXRL_NVFP4_ALPHA_FACTOR_INV) : 1.0f;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const u32 col = n0 + 16 * warp + 8 * j + 2 * t;
                float2 v = make_float2(acc[j][2 * hh], acc[j][2 * hh + 1]);
                if (F::ALPHA) {
                    v.x = __fmul_rn(v.x, alpha);
                    v.y = __fmul_rn(v.y, alpha);
                }
                *reinterpret_cast<float2*>(y + (u64)(rb + r) * N + col) = v;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(QT_THREADS) qgemm_tc_mxfp8(QGEMM_MXFP8_ARGS) {
    qgemm_tc_body<QmMxfp8>(x, nullptr, codes, scales, nullptr, off, y, R, N, K);
}
extern "C" __global__ void __launch_bounds__(QT_THREADS) qgemm_tc_nvfp4(QGEMM_NVFP4_ARGS) {
    qgemm_tc_body<QmNvfp4>(x, x_amax, codes, scales, w_amax, off, y, R, N, K);
}

// ---- grouped tensor-core GEMMs with weights decoded straight into mma fragments ----
//
// The transposed product y_eᵀ = W_e · x_eᵀ: the stored weights are the mma A operand (16 output
// columns as the m16 rows), the expert's activation rows the B operand (8 rows as the n8
// columns, rows past the expert's loaded as zeros and never stored). A block of KS = blockDim / 32
// warps (1, 2, 4 or 8: the launcher's split) owns QF_COLS = 32 output columns (two 16-column
// tiles) of expert blockIdx.y; its warps split the reduction: warp w takes the super-steps w,
// w + KS, … of 64 weight bytes per row (MXFP8: 64 elements, NVFP4: 128, BF16: 32), the next
// one's loads issued before the current one is decoded. Lane (g = lane / 4, t = lane % 4) loads
// bytes 16t .. 16t+16 of the super-step of weight rows n0 + g + 8i (i < 4: tile i / 2, fragment
// row g or g + 8) and the matching 16 (MXFP8), 32 (NVFP4) or 8 (BF16) activation elements of
// row 8·tg + g of the pass, and decodes its codes in registers to the exact operand values
// (MXFP8: BF16 of fl(e4m3 · 2^(s−127)), the values dequant_mxfp8_bf16 writes; NVFP4: e2m1 ·
// e4m3(scale) in binary16, exact, times the binary16 activation operand of quant_act_nvfp4_f16
// (the same values — module doc; BF16: the stored value). The k order is permuted alike in A and B (mma step
// s takes elements 4s .. 4s+3 of each lane's chunk as the k indices 2t, 2t+1, 2t+8, 2t+9), so
// every product is one x·w of the sum. Products exact, f32 accumulation in the tensor cores
// (bound: tensor_core_sum_bound); with KS > 1 the warps' partial sums are then added in dynamic
// shared memory (KS · 8·TG · 32 floats) in warp order (fixed; no atomics), with KS = 1 each lane
// stores its own sums. NVFP4: y = fl(sum · α) as qgemm_body. QF_TG = token groups of 8 rows per
// pass (1, 2, 4, 8); rows beyond take more passes. Few (expert, column block) pairs (batch 1) want
// a deep split for enough loads in flight; many (batch 32) want KS = 1, no reduction at all.
#define QF_MAX_WARPS 8
#define QF_COLS 32

__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ void qf_mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void qf_mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The formats as the fragment kernels see them (on top of QmMxfp8 / QmNvfp4): XV uint4 loads of
// activation per lane and super-step, uint4 v holding the elements of mma steps 2v and 2v + 1;
// `pairs` gives the two operand pairs of mma step s from a lane's weight chunk (lo: elements
// 4s, 4s+1; hi: 4s+2, 4s+3), `bpairs` the same from the activation uint4 of step s; `mma`
// multiplies in the operand type.
struct QfMxfp8 : QmMxfp8 {
    static constexpr int XV = 2;
    static constexpr bool BLOCKED = false;
    __device__ static void pairs(const uint4& w, u32 prep, int s, u32& lo, u32& hi) {
        float v[4];
        mxfp8_decode4(word_of(w, s), __uint_as_float(prep), v);
        lo = f32x2_to_bf16x2(v[0], v[1]);
        hi = f32x2_to_bf16x2(v[2], v[3]);
    }
    __device__ static void bpairs(const uint4& xv, int s, u32& b0, u32& b1) {
        b0 = word_of(xv, 2 * (s & 1));
        b1 = word_of(xv, 2 * (s & 1) + 1);
    }
    __device__ static void mma(float* d, const u32* a, u32 b0, u32 b1) { qf_mma_bf16(d, a, b0, b1); }
};
// MXFP8 weights decoded without leaving BF16, for weights whose every scale byte is at most
// MXFP8_FAST_MAX_SCALE and that hold no NaN code (mxfp8_fast_check; the host picks these
// kernels only then): the bytes of a code pair are spread into the two halves of a word with
// their signs replicated (prmt), shifted and masked to sign | exponent-and-mantissa << 4 — the
// BF16 pattern of e4m3_value(code) · 2^-120, exact for every code, subnormal E4M3 codes
// landing on BF16 subnormals and zeros on zeros — then multiplied by the BF16 factor
// 2^(s − 7) = 2^120 · 2^(s − 127) (s ≤ 134 keeps it finite): one rounding of the exact product
// e4m3_value(code) · 2^(s − 127), which is what QfMxfp8 computes in f32 and rounds to BF16
// (both round the same exact value to nearest even), so the operands, and the sums, are
// QfMxfp8's bit for bit. Four instructions per pair where QfMxfp8 takes six.
#define MXFP8_FAST_MAX_SCALE 134u
__device__ __forceinline__ u32 mxfp8_fast_pair(u32 q, u32 sel, u32 factor) {
    u32 t;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(t) : "r"(q), "r"(sel));
    t = (t << 4) & 0x87F087F0u;
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(t), "r"(factor), "r"(0x80008000u));
    return d;
}
struct QfMxfp8Fast : QfMxfp8 {
    // The chunk's BF16 factor 2^(s − 7) in both halves.
    __device__ static u32 prep(u32 raw) { return ((raw + 120u) << 7) * 0x10001u; }
    __device__ static void pairs(const uint4& w, u32 prep, int s, u32& lo, u32& hi) {
        const u32 q = word_of(w, s);
        lo = mxfp8_fast_pair(q, 0x9180u, prep);  // bytes 0, 1, each over its sign copies
        hi = mxfp8_fast_pair(q, 0xB3A2u, prep);  // bytes 2, 3
    }
};

// A code word holds a NaN byte (0x7F / 0xFF; masked with 0x7F7F7F7F, a byte of 0x7F carries
// into its top bit).
__device__ __forceinline__ bool mxfp8_nan_word(u32 w) {
    return (((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) != 0u;
}

// Eligibility for QfMxfp8Fast of stored MXFP8 weights: clears *ok when a code byte is NaN
// (0x7F / 0xFF) or a scale byte exceeds MXFP8_FAST_MAX_SCALE (*ok set to 1 by the caller; every
// writer writes 0, so the result does not depend on the order). Grid-stride over the codes'
// u32 words (nc a multiple of 4, 4-byte aligned) and the scale bytes.
extern "C" __global__ void mxfp8_fast_check(const u32* __restrict__ codes, u64 nc, const u8* __restrict__ scales,
                                            u64 ns, u32* __restrict__ ok) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    bool bad = false;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nc / 4; i += stride) {
        bad |= mxfp8_nan_word(codes[i]);
    }
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < ns; i += stride) bad |= scales[i] > MXFP8_FAST_MAX_SCALE;
    if (bad) *ok = 0u;
}

// One AdamW step of MXFP8-stored weights followed by their row-wise quantization, in one pass
// over the master: thread t < n8 takes elements [8t, 8t + 8) (a quarter of a 32-element
// block along K; K % 32 == 0, so every block lies in one row), updates p, m, v with
// adamw_elem (ops_optim.cu's adamw_step: the same bits), writes p_bf16 = bf16(p) when
// write_bf16 != 0, then quantizes the new values with mxfp8_quarter_encode (mxfp8_row_f32:
// the same codes and scale bytes) and, when write_deq != 0, writes deq = the BF16 of their
// contract dequantization (dequant_mxfp8_bf16's values, the large-M forward's operand).
// Sets *fast_bad when a code byte is NaN or a scale byte exceeds MXFP8_FAST_MAX_SCALE
// (mxfp8_fast_check's rule; *fast_bad zeroed by the caller, every writer writes 1). Every lane
// of a warp joins the block shuffles; lanes past n8 with zeros, writing nothing.
extern "C" __global__ void __launch_bounds__(256)
    adamw_mxfp8_row(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                    float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16,
                    const float* __restrict__ scale, u8* __restrict__ codes, u8* __restrict__ scales,
                    u16* __restrict__ deq, int write_deq, u32* __restrict__ fast_bad, u64 n8, float beta1,
                    float beta2, float one_m_beta1, float one_m_beta2, float eps, float step_size,
                    float bc2_sqrt, float decay) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = t < n8;
    float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (active) adamw8(p, grad, m, v, p_bf16, write_bf16, scale[0], t * 8, w, beta1, beta2, one_m_beta1,
                       one_m_beta2, eps, step_size, bc2_sqrt, decay);
    u32 w0, w1, s;
    mxfp8_quarter_encode(w, w0, w1, s);
    const bool bad = active && (mxfp8_nan_word(w0) || mxfp8_nan_word(w1) || s > MXFP8_FAST_MAX_SCALE);
    if (active) {
        *reinterpret_cast<uint2*>(codes + t * 8) = make_uint2(w0, w1);
        if ((t & 3u) == 0u) scales[t >> 2] = (u8)s;
        if (write_deq) {
            float d[8];
            mxfp8_decode8(w0, w1, ue8m0_decode(s), d);
            *reinterpret_cast<uint4*>(deq + t * 8) = pack_bf16x8(d);
        }
    }
    if (__any_sync(FULL_MASK, bad) && (threadIdx.x & 31u) == 0u) *fast_bad = 1u;
}

// adamw_mxfp8_row's pass over tiles of 32 rows × 64 columns (one block of 256 threads each:
// thread (r, c8) = (t / 8, t % 8) takes row r's columns [8·c8, 8·c8 + 8), so the four threads
// of a 32-element block along K are adjacent lanes; rows of k % 64 == 0, tile (tr, tc) =
// (blockIdx.x / (k/64), blockIdx.x % (k/64))) that also writes col = the BF16 of the contract
// dequantization of the new values' column-wise MXFP8 (32×1 blocks along the rows, one per
// column of a tile): qlinear_mxfp8_col_segments_bf16's values for whole 32-row segments (the
// lowp backward's dgrad operand of weights whose row count per weight is a multiple of 32).
// The column amax is the largest magnitude of four partial maxima (NaN ignored: the same value
// in any order).
extern "C" __global__ void __launch_bounds__(256)
    adamw_mxfp8_rowcol(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                       float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16,
                       const float* __restrict__ scale, u8* __restrict__ codes, u8* __restrict__ scales,
                       u16* __restrict__ deq, int write_deq, u16* __restrict__ col, u32* __restrict__ fast_bad,
                       u64 k, float beta1, float beta2, float one_m_beta1, float one_m_beta2, float eps,
                       float step_size, float bc2_sqrt, float decay) {
    __shared__ float tile[32][65];
    __shared__ float part[4][64];
    const u64 tpr = k / 64, tr = blockIdx.x / tpr, tc = blockIdx.x - tr * tpr;
    const u32 r = threadIdx.x >> 3, c8 = threadIdx.x & 7u;
    const u64 i = (tr * 32 + r) * k + tc * 64 + c8 * 8;
    float w[8];
    adamw8(p, grad, m, v, p_bf16, write_bf16, scale[0], i, w, beta1, beta2, one_m_beta1, one_m_beta2, eps,
           step_size, bc2_sqrt, decay);
    u32 w0, w1, s;
    mxfp8_quarter_encode(w, w0, w1, s);
    const bool bad = mxfp8_nan_word(w0) || mxfp8_nan_word(w1) || s > MXFP8_FAST_MAX_SCALE;
    *reinterpret_cast<uint2*>(codes + i) = make_uint2(w0, w1);
    if ((c8 & 3u) == 0u) scales[i / 32] = (u8)s;
    if (write_deq) {
        float d[8];
        mxfp8_decode8(w0, w1, ue8m0_decode(s), d);
        *reinterpret_cast<uint4*>(deq + i) = pack_bf16x8(d);
    }
    if (__any_sync(FULL_MASK, bad) && (threadIdx.x & 31u) == 0u) *fast_bad = 1u;
    float d[8];
    mxfp8_col_tile32x64(tile, part, w, d);
    *reinterpret_cast<uint4*>(col + i) = pack_bf16x8(d);
}

// One AdamW step of FP8-block-stored weights [rows, k] (rows = groups·N; N and k multiples of
// 128, so no tile crosses two weights) followed by their 128×128-tile quantization, in one pass
// over the master: one block of 256 threads per tile (tile t = the row-major index in
// [rows/128, k/128], as quant.cu's fp8_block_weight numbers them and its scale_inv is stored).
// Thread x takes the chunks c = x + 256·j (j < 8) of eight elements (row c / 16 of the tile,
// columns 8·(c % 16) ..: a warp reads two rows' 512 contiguous bytes), updates them with
// adamw8 (adamw_elem: ops_optim.cu's adamw_step bits; p_bf16 = bf16(p) when write_bf16 != 0)
// and keeps the new values; the tile's amax of them (NaN ignored: the same value in any order)
// gives fp8_block_scale's scale and scale_inv, and the codes are e4m3_encode(fl(w · scale)):
// fp8_block_weight_f32's bytes for the new master, without reading it again.
extern "C" __global__ void __launch_bounds__(256)
    adamw_fp8_block(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                    float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16,
                    const float* __restrict__ scale, u8* __restrict__ codes, float* __restrict__ scales, u64 k,
                    int pow2, float beta1, float beta2, float one_m_beta1, float one_m_beta2, float eps,
                    float step_size, float bc2_sqrt, float decay) {
    __shared__ float warp_max_s[8];
    const u64 tpr = k / MXRL_FP8_BLOCK, tr = blockIdx.x / tpr, tc = blockIdx.x - tr * tpr;
    const float sc = scale[0];
    float w[8][8];
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 c = threadIdx.x + 256u * (u32)j;
        const u64 i = (tr * MXRL_FP8_BLOCK + (c >> 4)) * k + tc * MXRL_FP8_BLOCK + (c & 15u) * 8u;
        adamw8(p, grad, m, v, p_bf16, write_bf16, sc, i, w[j], beta1, beta2, one_m_beta1, one_m_beta2, eps,
               step_size, bc2_sqrt, decay);
#pragma unroll
        for (int q = 0; q < 8; ++q) a = nan_ignoring_max(a, fabsf(w[j][q]));
    }
    const float am = block_nan_ignoring_max<256>(a, warp_max_s);
    float inv;
    const float s = fp8_block_scale(am, pow2 != 0, inv);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 c = threadIdx.x + 256u * (u32)j;
        const u64 i = (tr * MXRL_FP8_BLOCK + (c >> 4)) * k + tc * MXRL_FP8_BLOCK + (c & 15u) * 8u;
        u32 lo = 0u, hi = 0u;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            lo |= e4m3_encode(__fmul_rn(w[j][q], s)) << (8 * q);
            hi |= e4m3_encode(__fmul_rn(w[j][q + 4], s)) << (8 * q);
        }
        *reinterpret_cast<uint2*>(codes + i) = make_uint2(lo, hi);
    }
    if (threadIdx.x == 0u) scales[blockIdx.x] = inv;
}

// One AdamW step of a stack of NVFP4-stored weights (group_len elements each) with each
// weight's amax of the new values (for its per-tensor NVFP4 quantization) in the same pass:
// thread t < n8 updates elements [8t, 8t + 8) as adamw_mxfp8_row does (adamw_elem; p_bf16 when
// write_bf16 != 0), then raises amax_bits[weight] (zeroed by the caller) to the largest
// magnitude of its new values, NaN ignored (amax_kernel's rule: a value ≥ 0, never NaN, so the
// unsigned order of the bits is the numeric order and atomicMax gives the same bits in any
// order). A warp whose lanes all hold one weight's values takes one atomic. group_len % 8 == 0.
extern "C" __global__ void __launch_bounds__(256)
    adamw_amax_groups(float* __restrict__ p, const float* __restrict__ grad, float* __restrict__ m,
                      float* __restrict__ v, u16* __restrict__ p_bf16, int write_bf16,
                      const float* __restrict__ scale, u32* __restrict__ amax_bits, u64 group_len, u64 n8,
                      float beta1, float beta2, float one_m_beta1, float one_m_beta2, float eps,
                      float step_size, float bc2_sqrt, float decay) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = t < n8;
    float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (active) adamw8(p, grad, m, v, p_bf16, write_bf16, scale[0], t * 8, w, beta1, beta2, one_m_beta1,
                       one_m_beta2, eps, step_size, bc2_sqrt, decay);
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) a = nan_ignoring_max(a, fabsf(w[j]));
    const u64 none = ~0ull;
    const u64 grp = active ? (t * 8) / group_len : none;
    const u64 g0 = __shfl_sync(FULL_MASK, grp, 0), g31 = __shfl_sync(FULL_MASK, grp, 31);
    if (g0 == g31 && g0 != none) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a = nan_ignoring_max(a, __shfl_xor_sync(FULL_MASK, a, off));
        if ((threadIdx.x & 31u) == 0u) atomicMax(amax_bits + g0, __float_as_uint(a));
    } else if (active) {
        atomicMax(amax_bits + grp, __float_as_uint(a));
    }
}

// Every code under every eligible scale byte through both MXFP8 decoders (for the tests):
// thread (s, c4) decodes codes 4·c4 .. 4·c4 + 3 under scale byte s as word 0 of a chunk;
// general / fast [s·256 + code] = the BF16 operand bits of QfMxfp8 / QfMxfp8Fast.
extern "C" __global__ void mxfp8_decode_table(u16* __restrict__ general, u16* __restrict__ fast) {
    const u32 s = blockIdx.x, c4 = threadIdx.x;  // grid MXFP8_FAST_MAX_SCALE + 1, block 64
    const u32 q = (4u * c4) | ((4u * c4 + 1u) << 8) | ((4u * c4 + 2u) << 16) | ((4u * c4 + 3u) << 24);
    const uint4 w = make_uint4(q, 0u, 0u, 0u);
    u32 lo, hi;
    QfMxfp8::pairs(w, QfMxfp8::prep(s), 0, lo, hi);
    u16* g = general + s * 256u + 4u * c4;
    g[0] = (u16)lo, g[1] = (u16)(lo >> 16), g[2] = (u16)hi, g[3] = (u16)(hi >> 16);
    QfMxfp8Fast::pairs(w, QfMxfp8Fast::prep(s), 0, lo, hi);
    u16* f = fast + s * 256u + 4u * c4;
    f[0] = (u16)lo, f[1] = (u16)(lo >> 16), f[2] = (u16)hi, f[3] = (u16)(hi >> 16);
}

struct QfNvfp4 : QmNvfp4 {
    static constexpr int XV = 4;
    static constexpr bool BLOCKED = false;
    __device__ static void pairs(const uint4& w, u32 prep, int s, u32& lo, u32& hi) {
        // nvfp4_decode4 without the widening to f32: binary16 pairs of e2m1 · scale (exact).
        const u32 sf2 = __byte_perm(prep, 0u, s < 4 ? 0x1010u : 0x3232u);
        const u32 q = word_of(w, s >> 1) >> (16 * (s & 1));
        u32 t = __byte_perm(MXRL_E2M1_F16HI_0123, MXRL_E2M1_F16HI_4567, q & 0x7777u);
        t |= __byte_perm(q << 4, q, 0x5140u) & 0x80808080u;
        lo = hmul2_rn(__byte_perm(t, 0u, 0x1404u), sf2);
        hi = hmul2_rn(__byte_perm(t, 0u, 0x3424u), sf2);
    }
    // The activation operand is binary16 already (quant_act_nvfp4_f16).
    __device__ static void bpairs(const uint4& xv, int s, u32& b0, u32& b1) {
        b0 = word_of(xv, 2 * (s & 1));
        b1 = word_of(xv, 2 * (s & 1) + 1);
    }
    __device__ static void mma(float* d, const u32* a, u32 b0, u32 b1) { qf_mma_f16(d, a, b0, b1); }
};

// BF16 weights as stored (u16 [E, N, K]): 8 elements per lane and super-step, no scales.
struct QfBf16 {
    static constexpr u32 CHUNK = 8, STEPS = 2;
    static constexpr bool ALPHA = false, BLOCKED = false;
    static constexpr int XV = 1;
    __device__ static u32 row_bytes(u32 K) { return 2 * K; }
    __device__ static u32 scale_row(u32) { return 0; }
    __device__ static u32 load_scale(const u8*, u32) { return 0; }
    __device__ static u32 prep(u32) { return 0; }
    __device__ static void pairs(const uint4& w, u32, int s, u32& lo, u32& hi) {
        lo = word_of(w, 2 * s);
        hi = word_of(w, 2 * s + 1);
    }
    __device__ static void bpairs(const uint4& xv, int s, u32& b0, u32& b1) {
        b0 = word_of(xv, 2 * s);
        b1 = word_of(xv, 2 * s + 1);
    }
    __device__ static void mma(float* d, const u32* a, u32 b0, u32 b1) { qf_mma_bf16(d, a, b0, b1); }
};

// FP8-block weights (E4M3 codes [E, N, K], f32 scale_inv [E, N/128, K/128]) in the staged
// kernels only: 16 codes per lane and super-step decoded to binary16 (cvt.rn.f16x2.e4m3x2,
// exact), the k order of QfMxfp8; the activation operand is the binary16 value of each
// activation code (quant_act_fp8_block_f16), so both operands are the codes' exact values
// and every product is exact in f32. No per-chunk scales: BLOCKED kernels sum each 128-wide K
// block (two super-steps) into a fresh accumulator P_b and add fl(fl(sx·sw)·P_b) to y in
// increasing b (qs_pass), the FP8-block contract's order.
struct QfFp8b {
    static constexpr u32 CHUNK = 16, STEPS = 4;
    static constexpr bool ALPHA = false, BLOCKED = true;
    static constexpr int XV = 2;
    __device__ static u32 row_bytes(u32 K) { return K; }
    __device__ static u32 scale_row(u32) { return 0; }
    __device__ static u32 load_scale(const u8*, u32) { return 0; }
    __device__ static u32 prep(u32) { return 0; }
    __device__ static void pairs(const uint4& w, u32, int s, u32& lo, u32& hi) {
        const u32 q = word_of(w, s);
        lo = e4m3x2_to_f16x2(q);
        hi = e4m3x2_to_f16x2(q >> 16);
    }
    __device__ static void bpairs(const uint4& xv, int s, u32& b0, u32& b1) {
        b0 = word_of(xv, 2 * (s & 1));
        b1 = word_of(xv, 2 * (s & 1) + 1);
    }
    __device__ static void mma(float* d, const u32* a, u32 b0, u32 b1) { qf_mma_f16(d, a, b0, b1); }
};

// The mma steps s = 2·v0 .. 2·(v0 + VG) (below F::STEPS) of one super-step: the A fragments
// of both 16-column tiles decoded from the weight chunks wq with the prepared scales sp
// ({row g lo, row g+8 lo, row g hi, row g+8 hi}), multiplied by each token group's B
// fragments from the activation chunks xa (uint4 v0 .. v0 + VG of each group's row), in
// increasing s. Shared by the split (qgemm_frag_body) and staged (qgemm_fragsm_body) kernels,
// so both issue the same fragments in the same order.
template <class F, int TG, int VG>
__device__ __forceinline__ void qf_mma_steps(const uint4 (&wq)[4], const u32 (&sp)[4],
                                             const uint4 (&xa)[TG][VG], int v0, float (&acc)[2][TG][4]) {
#pragma unroll
    for (int s = 2 * v0; s < (int)F::STEPS && s < 2 * (v0 + VG); ++s) {
        u32 a[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            F::pairs(wq[2 * j], sp[2 * j], s, a[j][0], a[j][2]);
            F::pairs(wq[2 * j + 1], sp[2 * j + 1], s, a[j][1], a[j][3]);
        }
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            u32 b0, b1;
            F::bpairs(xa[tg][(s >> 1) - v0], s, b0, b1);
            F::mma(acc[0][tg], a[0], b0, b1);
            F::mma(acc[1][tg], a[1], b0, b1);
        }
    }
}

template <class F, int TG>
__device__ __forceinline__ void qgemm_frag_body(const u16* __restrict__ x, const float* __restrict__ x_amax,
                                                const u8* __restrict__ codes, const u8* __restrict__ scales,
                                                const float* __restrict__ w_amax, const u32* __restrict__ off,
                                                float* __restrict__ y, u32 R, u32 N, u32 K, u32 bx, u32 e) {
    constexpr int NACC = 2 * TG * 4;  // accumulators per lane: tile × token group × fragment
    extern __shared__ float red[];     // [KS][NACC][32] when KS > 1
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    // Passes z, z + Z, … of the expert's rows (Z = gridDim.z): a busy expert's passes are
    // spread over Z blocks. The whole block returns: no barrier is skipped by part of it.
    if (lo + blockIdx.z * 8 * TG >= hi) return;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const u32 KS = blockDim.x >> 5;
    const u32 n0 = bx * QF_COLS;
    const u32 rowb = F::row_bytes(K), sk = F::scale_row(K);
    const u32 steps = (rowb + 63) / 64;  // super-steps of 64 code bytes per row
    const u32 elems = F::CHUNK * 4;      // elements per super-step
    // This lane's chunk 0 (bytes 16t .. 16t+16) of weight row n0 + g and that row's scales;
    // row g + 8i at + i·w8 and + i·s8.
    const u64 row0 = (u64)e * N + n0 + g;
    const u8* const wc = codes + row0 * rowb + 16 * t;
    const u8* const ws = scales + row0 * sk;
    const u64 w8 = 8 * (u64)rowb, s8 = 8 * (u64)sk;
    const float wa = F::ALPHA ? w_amax[e] : 0.0f;
    for (u32 rb = lo + blockIdx.z * 8 * TG; rb < hi; rb += gridDim.z * 8 * TG) {
        float acc[2][TG][4];
        frag_acc_zero<TG>(acc);
        // Chunk c = 4·kt + t of each weight row: codes bytes 16c .. 16c+16 (zeros and scale 0,
        // which decode to zeros, past the row).
        auto load_w = [&](u32 kt, uint4* wq, u32* sr) {
            const u32 c = 4 * kt + t;
            const bool ok = kt < steps && 16 * c < rowb;
            const u8* pw = wc + 64 * (u64)kt;
            const u8* ps = ws;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                wq[i] = ok ? *reinterpret_cast<const uint4*>(pw) : make_uint4(0u, 0u, 0u, 0u);
                sr[i] = ok ? F::load_scale(ps, c) : 0u;
                pw += w8;
                ps += s8;
            }
        };
        // The pass's activation rows rb + 8·tg + g of this lane (bit tg: inside the expert's
        // rows), from its chunk t·CHUNK; row tg at + tg·x8.
        u32 rows_ok = 0;
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) rows_ok |= (rb + 8 * tg + g < hi ? 1u : 0u) << tg;
        const u16* const xb = x + (u64)(rb + g) * K + t * F::CHUNK;
        const u64 x8 = 8 * (u64)K;
        // Super-step kt on its weight chunks wq and scales sr.
        auto step = [&](u32 kt, const uint4 (&wq)[4], const u32 (&sr)[4]) {
            // Activation chunk of this super-step: elements kt·elems + t·CHUNK .. + CHUNK of row
            // rb + 8·tg + g (zeros past the expert's rows or past K).
            // Loaded VG uint4 per row at a time (all XV of them unless TG · XV > 16 registers'
            // worth: NVFP4 with 64 rows per pass), the mma steps in increasing s either way.
            const u32 k0 = kt * elems + t * F::CHUNK;
            const bool kok = k0 < K;
            u32 sp[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) sp[i] = F::prep(sr[i]);
            constexpr int VG = F::XV < 16 / TG ? F::XV : 16 / TG;
#pragma unroll
            for (int v0 = 0; v0 < F::XV; v0 += VG) {
                uint4 xa[TG][VG];
                const u16* xr = xb + kt * elems;
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) {
                    const bool ok = ((rows_ok >> tg) & 1u) && kok;
                    const uint4* src = reinterpret_cast<const uint4*>(xr) + v0;
#pragma unroll
                    for (int v = 0; v < VG; ++v) xa[tg][v] = ok ? src[v] : make_uint4(0u, 0u, 0u, 0u);
                    xr += x8;
                }
                qf_mma_steps<F, TG, VG>(wq, sp, xa, v0, acc);
            }
        };
        // The next super-step's loads are issued before the current one is decoded, into the
        // other of two register sets that take turns (nothing is copied between them).
        uint4 wq0[4], wq1[4];
        u32 sr0[4], sr1[4];
        load_w(warp, wq0, sr0);
        for (u32 kt = warp; kt < steps; kt += 2 * KS) {
            load_w(kt + KS, wq1, sr1);
            step(kt, wq0, sr0);
            if (kt + KS >= steps) break;
            load_w(kt + 2 * KS, wq0, sr0);
            step(kt + KS, wq1, sr1);
        }
        // Output of fragment entry q of tile j, token group tg held by lane l: column row g'
        // (+8 for q ≥ 2) of the tile, activation row 2t' (+1 for odd q) of the group.
        auto store = [&](u32 slot, u32 l, float sum) {
            const u32 q = slot % 4, tg = (slot / 4) % TG, j = slot / (4 * TG);
            const u32 r = rb + 8 * tg + 2 * (l & 3) + (q & 1);
            const u32 col = n0 + 16 * j + (l >> 2) + 8 * (q >> 1);
            if (r < hi) {
                if (F::ALPHA) {
                    const float alpha = __fmul_rn(__fmul_rn(x_amax[r], wa), MXRL_NVFP4_ALPHA_FACTOR_INV);
                    sum = __fmul_rn(sum, alpha);
                }
                y[(u64)r * N + col] = sum;
            }
        };
        if (KS == 1) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                    for (int q = 0; q < 4; ++q) store((j * TG + tg) * 4 + q, lane, acc[j][tg][q]);
            continue;
        }
        // Partial sums of the warps, added in warp order.
        __syncthreads();  // the previous pass's reads of red are done
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                for (int q = 0; q < 4; ++q) red[(warp * NACC + (j * TG + tg) * 4 + q) * 32 + lane] = acc[j][tg][q];
        __syncthreads();
        for (u32 i = tid; i < (u32)NACC * 32; i += blockDim.x) {
            const u32 slot = i / 32, l = i % 32;
            float sum = red[slot * 32 + l];
            for (u32 w = 1; w < KS; ++w) sum = __fadd_rn(sum, red[(w * NACC + slot) * 32 + l]);
            store(slot, l, sum);
        }
    }
}

// Entry points: suffix = token groups of 8 rows per pass; blocks of 32 · KS threads.
// F: QfMxfp8, or QfMxfp8Fast (suffix mxfp8f) for eligible weights.
// Block row y of the grid is expert y; a grid of fewer rows than experts (the launcher's
// choice when most experts are idle: fewer rows than half the experts) gives row y the y-th
// busy expert instead (nth_busy_expert), so a decode step's few busy experts do not wait
// behind the blocks of the idle ones. BUSY_NONE: no expert for this row.
__device__ __forceinline__ u32 qf_block_expert(const u32* __restrict__ off, u32 E, u32 R) {
    return gridDim.y < E ? nth_busy_expert(off, E, R, blockIdx.y) : blockIdx.y;
}
#define QF_ENTRY_MXFP8(name, F, TG, MINB)                                                                      \
    extern "C" __global__ void __launch_bounds__(QF_MAX_WARPS * 32, MINB) name(QGEMM_MXFP8_ARGS) {             \
        const u32 e = qf_block_expert(off, E, R);                                                              \
        if (e == BUSY_NONE) return;                                                                            \
        qgemm_frag_body<F, TG>(x, nullptr, codes, scales, nullptr, off, y, R, N, K, blockIdx.x, e);            \
    }
#define QF_ENTRY_NVFP4(name, TG, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(QF_MAX_WARPS * 32, MINB) name(QGEMM_NVFP4_ARGS) {             \
        const u32 e = qf_block_expert(off, E, R);                                                              \
        if (e == BUSY_NONE) return;                                                                            \
        qgemm_frag_body<QfNvfp4, TG>(x, x_amax, codes, scales, w_amax, off, y, R, N, K, blockIdx.x, e);        \
    }
// BF16 weights: the MXFP8 argument list with `codes` the BF16 bytes and `scales` unused.
#define QF_ENTRY_BF16(name, TG, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(QF_MAX_WARPS * 32, MINB) name(QGEMM_MXFP8_ARGS) {             \
        const u32 e = qf_block_expert(off, E, R);                                                              \
        if (e == BUSY_NONE) return;                                                                            \
        qgemm_frag_body<QfBf16, TG>(x, nullptr, codes, scales, nullptr, off, y, R, N, K, blockIdx.x, e);       \
    }
// BF16, up to three dense weights on one input in one launch (q, k and v; or one linear),
// blocks of up to QF_DENSE_MAX_WARPS warps splitting the reduction:
// block column bx of the grid runs weight i's column block bx − (the column blocks of weights
// < i) with weight i's values, output and N (a weight with N = 0 has no blocks); one group of
// rows (`off` = {0, ≥ R}), E = 1. Each weight's blocks are those of QF_ENTRY_BF16 on it alone,
// so the outputs are the single launches' bits.
// The multi-weight launches (up to three weights on one input, their column blocks of `cols`
// columns side by side in one grid): the weight grid column bx belongs to, with bx made
// relative to that weight's first column block. Weight i has N_i / cols blocks (none for
// N_i = 0).
__device__ __forceinline__ u32 qf_multi_weight(u32& bx, u32 N0, u32 N1, u32 cols) {
    const u32 b0 = N0 / cols, b1 = N1 / cols;
    if (bx >= b0 + b1) {
        bx -= b0 + b1;
        return 2;
    }
    if (bx >= b0) {
        bx -= b0;
        return 1;
    }
    return 0;
}
// Argument i (0, 1 or 2) of a multi-weight launch's three.
template <class T>
__device__ __forceinline__ T qf_of3(u32 i, T a, T b, T c) {
    return i == 0 ? a : i == 1 ? b : c;
}
#define QF_DENSE_MAX_WARPS 16  // a dense launch has few column blocks: up to 16 warps split K
#define QF_ENTRY_BF16X3(name, TG, MINB)                                                                        \
    extern "C" __global__ void __launch_bounds__(QF_DENSE_MAX_WARPS * 32, MINB)                                \
        name(const u16* __restrict__ x, const u16* __restrict__ w0, float* __restrict__ y0, u32 N0,            \
             const u16* __restrict__ w1, float* __restrict__ y1, u32 N1, const u16* __restrict__ w2,           \
             float* __restrict__ y2, u32 N2, const u32* __restrict__ off, u32 R, u32 K) {                      \
        u32 bx = blockIdx.x;                                                                                   \
        const u32 i = qf_multi_weight(bx, N0, N1, QF_COLS);                                                    \
        const u8* wb = reinterpret_cast<const u8*>(qf_of3(i, w0, w1, w2));                                     \
        qgemm_frag_body<QfBf16, TG>(x, nullptr, wb, wb, nullptr, off, qf_of3(i, y0, y1, y2), R,                \
                                    qf_of3(i, N0, N1, N2), K, bx, 0);                                          \
    }
QF_ENTRY_MXFP8(qgemm_frag_mxfp8_t1, QfMxfp8, 1, 2)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8_t2, QfMxfp8, 2, 2)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8_t4, QfMxfp8, 4, 1)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8_t8, QfMxfp8, 8, 1)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8f_t1, QfMxfp8Fast, 1, 2)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8f_t2, QfMxfp8Fast, 2, 2)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8f_t4, QfMxfp8Fast, 4, 1)
QF_ENTRY_MXFP8(qgemm_frag_mxfp8f_t8, QfMxfp8Fast, 8, 1)
QF_ENTRY_NVFP4(qgemm_frag_nvfp4_t1, 1, 2)
QF_ENTRY_NVFP4(qgemm_frag_nvfp4_t2, 2, 2)
QF_ENTRY_NVFP4(qgemm_frag_nvfp4_t4, 4, 1)
QF_ENTRY_NVFP4(qgemm_frag_nvfp4_t8, 8, 1)
QF_ENTRY_BF16(qgemm_frag_bf16_t1, 1, 2)
QF_ENTRY_BF16(qgemm_frag_bf16_t2, 2, 2)
QF_ENTRY_BF16(qgemm_frag_bf16_t4, 4, 1)
QF_ENTRY_BF16(qgemm_frag_bf16_t8, 8, 1)
QF_ENTRY_BF16X3(qgemm_frag_bf16x3_t1, 1, 2)
QF_ENTRY_BF16X3(qgemm_frag_bf16x3_t2, 2, 2)
QF_ENTRY_BF16X3(qgemm_frag_bf16x3_t4, 4, 1)
QF_ENTRY_BF16X3(qgemm_frag_bf16x3_t8, 8, 1)

// ---- the fragment kernels with the operands staged in shared memory ----
//
// The scheme of qgemm_frag_body with one warp per 32 output columns (no split of the
// reduction) and QS_WARPS warps per block on adjacent column blocks of one expert, so the
// expert's activation rows are loaded once per block instead of once per warp: every super-step's
// operands are copied into shared memory by cp.async QS_STAGES − 1 super-steps ahead — each
// lane copies the very weight chunks (and the block the activation chunks) it will read — and
// read from there. Lanes hold the same fragments, decode them with the same code and issue the
// same mma sequence as qgemm_frag_body with one warp, so the results are those bit for bit.
// Dynamic shared memory: the scale rows of the block's 32·QS_WARPS weight rows (whole K, copied
// first), then QS_STAGES stages of each warp's 32 × 64 weight bytes, then QS_STAGES stages of
// the pass's 8·TG activation rows × (elements per super-step + 8 padding, so that the 8 rows a
// uint4 load touches fall in different banks).
#define QS_WARPS 4
#define QS_STAGES 3

__device__ __forceinline__ u32 qs_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16 bytes from global `src` to shared `dst`, or 16 zero bytes when !valid (src not read).
__device__ __forceinline__ void qs_cp16(void* dst, const void* src, bool valid) {
    const u32 n = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(qs_smem(dst)), "l"(src), "r"(n) : "memory");
}
// 4 bytes from global `src` to shared `dst`, or 4 zero bytes when !valid (src not read).
__device__ __forceinline__ void qs_cp4(void* dst, const void* src, bool valid) {
    const u32 n = valid ? 4u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(qs_smem(dst)), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void qs_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void qs_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// What a staged pass reads of its block (set up once per block by qgemm_fragsm_body).
struct QsBlock {
    const u16* x;
    const float* x_amax;  // NVFP4: the rows' amax; FP8 block (BLOCKED): their scale_inv [R, K/128]
    const u8* codes;
    float* y;
    const u8* wc;  // this lane's first weight chunk (bytes 16t..16t+16) of row g; row g + 8i at + i·w8
    u64 w8;  // bytes of 8 weight rows
    const u8* s_scale;  // the block's weight scale rows (BLOCKED: its 128-row scale_inv row)
    const u8* s_wrow;  // this lane's weight scale row g of the warp's 32 columns (not BLOCKED)
    u8* w_lane;  // this lane's chunk of row g in stage 0 of the warp's weight stages
    u16* s_x;  // the activation stages (XROWS rows each)
    const u16* x_lane;  // this lane's activation chunk of row g in stage 0 (t·CHUNK)
    float* s_sx;  // BLOCKED: the pass's activation scale_inv rows [XROWS][kbs]
    u32 hi, N, K, tid, warp, g, t, n0, rowb, sk, steps, xrows, kbs;
    float wa;
    bool active;
};

// One pass of TGP token groups from row rb (TGP ≤ the kernel's TG; the stages are laid out
// for TG, i.e. c.xrows rows). Addresses are set up once per block and pass and advanced per
// super-step; the copies, fragments and mma order are those of qgemm_frag_body with one warp.
template <class F, int TGP, int ST = QS_STAGES>
__device__ __forceinline__ void qs_pass(const QsBlock& c, u32 rb) {
    constexpr u32 THREADS = QS_WARPS * 32;
    constexpr u32 ELEMS = F::CHUNK * 4;  // elements per super-step
    constexpr u32 XLD = ELEMS + 8;       // u16 per staged activation row
    constexpr u32 CPR = ELEMS / 8;       // 16-byte chunks per staged activation row
    constexpr u32 XCH = 8 * TGP * CPR;   // activation chunks per stage
    constexpr u32 NCP = (XCH + THREADS - 1) / THREADS;  // of them copied per thread
    constexpr u32 RSTEP = THREADS / CPR;  // rows between a thread's chunks
    static_assert(THREADS % CPR == 0, "a thread's activation chunks share one column");
    // This thread's activation chunks: column j of rows r0 + m·RSTEP (m < NCP), those inside
    // the pass (and the expert's rows) in bit m of xrow_ok.
    const u32 j = c.tid % CPR, r0 = c.tid / CPR;
    u32 xrow_ok = 0;
#pragma unroll
    for (u32 m = 0; m < NCP; ++m) {
        const u32 r = r0 + m * RSTEP;
        if (r < 8 * TGP && rb + r < c.hi) xrow_ok |= 1u << m;
    }
    const u16* xsrc = c.x + (u64)(rb + r0) * c.K + 8 * j;  // read only where its row is ok
    const u64 xstride = (u64)RSTEP * c.K;
    u16* const xdst = c.s_x + r0 * XLD + 8 * j;
    // Stage `slot` ← super-step kt: this lane's weight chunks (row g + 8i, bytes 16t..16t+16 of
    // the step; zeros past the row) and this thread's activation chunks (8 elements each;
    // zeros past the expert's rows or past K).
    auto issue = [&](u32 kt, u32 slot) {
        if (kt < c.steps) {
            const bool ok = c.active && 64 * kt + 16 * c.t < c.rowb;
            u8* wd = c.w_lane + slot * 2048;
            const u8* ws = c.wc + 64 * (u64)kt;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                qs_cp16(wd + 512 * i, ok ? ws : c.codes, ok);
                ws += c.w8;
            }
            const u32 k = kt * ELEMS + 8 * j;
            const u16* src = xsrc + kt * ELEMS;
            u16* dst = xdst + slot * c.xrows * XLD;
#pragma unroll
            for (u32 m = 0; m < NCP; ++m) {
                if (m + 1 < NCP || XCH % THREADS == 0 || r0 + m * RSTEP < 8 * TGP) {
                    const bool okx = ((xrow_ok >> m) & 1u) && k < c.K;
                    qs_cp16(dst + m * RSTEP * XLD, okx ? src : c.x, okx);
                }
                src += xstride;
            }
        }
        qs_commit();  // an empty group past the last step keeps the wait counts uniform
    };
    float acc[2][TGP][4];
    frag_acc_zero<TGP>(acc);
    float yb[2][TGP][4];  // BLOCKED: y of the pass, the promoted K blocks' sum
    if (F::BLOCKED) frag_acc_zero<TGP>(yb);
    __syncthreads();  // the previous pass's reads of the stages are done
    if (F::BLOCKED) {
        // The pass's activation scale_inv rows (zeros past the expert's rows), landing with
        // stage 0's copies (same commit group).
        for (u32 q = c.tid; q < 8 * TGP * c.kbs; q += THREADS) {
            const u32 row = rb + q / c.kbs;
            const bool ok = row < c.hi;
            qs_cp4(c.s_sx + q, ok ? c.x_amax + (u64)row * c.kbs + q % c.kbs : c.x_amax, ok);
        }
    }
#pragma unroll
    for (u32 st = 0; st < ST - 1; ++st) issue(st, st);
    u32 slot = 0, next = ST - 1;  // kt % ST and (kt + ST − 1) % ST
    for (u32 kt = 0; kt < c.steps; ++kt) {
        qs_wait<ST - 2>();  // this thread's copies of step kt (and the scales) landed
        __syncthreads();    // everyone's; and step kt − 1's slot is free again
        issue(kt + ST - 1, next);
        next = next + 1 == ST ? 0 : next + 1;
        const u32 cur = slot;
        slot = slot + 1 == ST ? 0 : slot + 1;
        if (!c.active) continue;
        uint4 wq[4];
        u32 sp[4];
        const u8* wsrc = c.w_lane + cur * 2048;
        // The chunk's scales (past the row: chunk 0's, loaded unconditionally, then dropped
        // for prep(0) — the codes there are zeros).
        const u32 ch = 4 * kt + c.t;
        const bool sok = 16 * ch < c.rowb;
        const u32 chs = sok ? ch : 0u;
        const u8* sr = c.s_wrow;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            wq[i] = *reinterpret_cast<const uint4*>(wsrc + 512 * i);
            const u32 raw = F::load_scale(sr, chs);
            sp[i] = F::prep(sok ? raw : 0u);
            sr += 8 * c.sk;
        }
        const u16* xs = c.x_lane + cur * c.xrows * XLD;
        constexpr int VG = F::XV < 16 / TGP ? F::XV : 16 / TGP;
#pragma unroll
        for (int v0 = 0; v0 < F::XV; v0 += VG) {
            uint4 xa[TGP][VG];
#pragma unroll
            for (int tg = 0; tg < TGP; ++tg) {
                const uint4* src = reinterpret_cast<const uint4*>(xs + 8 * tg * XLD) + v0;
#pragma unroll
                for (int v = 0; v < VG; ++v) xa[tg][v] = src[v];
            }
            qf_mma_steps<F, TGP, VG>(wq, sp, xa, v0, acc);
        }
        if (F::BLOCKED && (kt & 1u)) {
            // K block b = kt / 2 is summed: y = fl(y + fl(fl(sx[r, b] · sw[b]) · P_b)) for
            // entry q of token group tg (activation row 8·tg + 2t + (q & 1) of the pass; the
            // block's 128 columns lie in one scale tile), then a fresh P for the next block.
            const u32 b = kt >> 1;
            const float sw = reinterpret_cast<const float*>(c.s_scale)[b];
#pragma unroll
            for (int tg = 0; tg < TGP; ++tg)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float sc = __fmul_rn(c.s_sx[(8 * tg + 2 * c.t + hh) * c.kbs + b], sw);
#pragma unroll
                    for (int j2 = 0; j2 < 2; ++j2)
#pragma unroll
                        for (int q = hh; q < 4; q += 2) {
                            yb[j2][tg][q] = __fadd_rn(yb[j2][tg][q], __fmul_rn(sc, acc[j2][tg][q]));
                            acc[j2][tg][q] = 0.0f;
                        }
                }
        }
    }
    qs_wait<0>();
    if (!c.active) return;
#pragma unroll
    for (int j2 = 0; j2 < 2; ++j2)
#pragma unroll
        for (int tg = 0; tg < TGP; ++tg)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 r = rb + 8 * tg + 2 * c.t + (q & 1);
                const u32 col = c.n0 + 16 * j2 + c.g + 8 * (q >> 1);
                if (r < c.hi) {
                    float sum = F::BLOCKED ? yb[j2][tg][q] : acc[j2][tg][q];
                    if (F::ALPHA) {
                        const float alpha = __fmul_rn(__fmul_rn(c.x_amax[r], c.wa), MXRL_NVFP4_ALPHA_FACTOR_INV);
                        sum = __fmul_rn(sum, alpha);
                    }
                    c.y[(u64)r * c.N + col] = sum;
                }
            }
}

template <class F, int TG, int ST = QS_STAGES>
__device__ __forceinline__ void qgemm_fragsm_body(const u16* __restrict__ x, const float* __restrict__ x_amax,
                                                  const u8* __restrict__ codes, const u8* __restrict__ scales,
                                                  const float* __restrict__ w_amax, const u32* __restrict__ off,
                                                  float* __restrict__ y, u32 R, u32 N, u32 K, u32 bx) {
    extern __shared__ __align__(16) u8 qs_mem[];
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    constexpr u32 XROWS = 8 * TG;
    // Passes z, z + Z, … of the expert's rows (Z = gridDim.z), as qgemm_frag_body. The whole
    // block returns: no barrier is skipped by part of it.
    if (lo + blockIdx.z * XROWS >= hi) return;
    QsBlock c;
    c.x = x;
    c.x_amax = x_amax;
    c.codes = codes;
    c.y = y;
    c.hi = hi;
    c.N = N;
    c.K = K;
    c.tid = threadIdx.x;
    const u32 lane = c.tid & 31;
    c.warp = c.tid >> 5;
    c.g = lane >> 2;
    c.t = lane & 3;
    const u32 nb = bx * (QF_COLS * QS_WARPS);                  // the block's first column
    const u32 wrows = min((u32)(QF_COLS * QS_WARPS), N - nb);  // its weight rows (N % 32 == 0)
    c.n0 = nb + QF_COLS * c.warp;
    c.active = c.n0 < N;  // a warp past N only helps with the copies and barriers
    c.rowb = F::row_bytes(K);
    c.sk = F::scale_row(K);
    c.steps = (c.rowb + 63) / 64;
    constexpr u32 XLD = F::CHUNK * 4 + 8;  // u16 per staged activation row (qs_pass)
    c.xrows = XROWS;
    c.kbs = K / 128;  // BLOCKED: 128-wide K blocks
    // Shared memory layout (all parts 16-byte multiples: sk·32 rows, or BLOCKED the scale
    // row's kbs floats rounded up; 2 KB; 16·XLD bytes), then BLOCKED the pass's XROWS·kbs
    // activation scales.
    u8* s_scale = qs_mem;
    u8* s_w = s_scale + (F::BLOCKED ? (4 * c.kbs + 15) / 16 * 16 : (u64)QF_COLS * QS_WARPS * c.sk);
    c.s_scale = s_scale;
    c.s_x = reinterpret_cast<u16*>(s_w + ST * QS_WARPS * 2048);
    c.s_sx = reinterpret_cast<float*>(c.s_x + (u64)ST * XROWS * XLD);
    if (F::BLOCKED) {
        // The block's 128 columns are one 128-row scale tile of expert e ([E, N/128, kbs]
        // floats): its kbs scale_inv values, copied once.
        const float* src = reinterpret_cast<const float*>(scales) + ((u64)e * (N / 128) + nb / 128) * c.kbs;
        for (u32 q = c.tid; q < c.kbs; q += blockDim.x) qs_cp4(s_scale + 4 * q, src + q, true);
    } else {
        // The block's scale rows are contiguous in `scales` ([E, N, sk]): copied once.
        const u8* src = scales + ((u64)e * N + nb) * c.sk;
        const u32 chunks = wrows * c.sk / 16;
        for (u32 q = c.tid; q < chunks; q += blockDim.x) qs_cp16(s_scale + 16 * q, src + 16 * q, true);
    }
    c.wc = codes + ((u64)e * N + c.n0 + c.g) * c.rowb + 16 * c.t;
    c.w8 = 8 * (u64)c.rowb;
    c.w_lane = s_w + (u64)c.warp * ST * 2048 + 64 * c.g + 16 * c.t;
    c.s_wrow = s_scale + (u64)(QF_COLS * c.warp + c.g) * c.sk;
    c.x_lane = c.s_x + c.g * XLD + c.t * F::CHUNK;
    c.wa = F::ALPHA ? w_amax[e] : 0.0f;
    for (u32 rb = lo + blockIdx.z * XROWS; rb < hi; rb += gridDim.z * XROWS) {
        // A pass whose rows fill at most half of it runs half the token groups (the mma steps
        // of the empty half would multiply zeros into sums nobody stores): the same fragments,
        // in the same order, for every row it holds. Uniform over the block.
        if (TG > 1 && hi - rb <= 4 * TG) {
            qs_pass<F, (TG > 1 ? TG / 2 : 1), ST>(c, rb);
        } else {
            qs_pass<F, TG, ST>(c, rb);
        }
    }
}

// Resident blocks per SM the register budget of a TG-group MXFP8 / NVFP4 / BF16 staged kernel
// is cut for: four up to 32 rows per pass (MXFP8's and BF16's shared memory fits four), three
// for the 64-row passes' fragments.
#define QS_MINB(TG) ((TG) >= 8 ? 3 : 4)
// FP8 block: four up to 32 rows per pass; the 64-row passes, and the dense three-weight
// entries (QS_ENTRY_FP8B3: their arguments; one block's bound, or ptxas caps them at 128
// registers and spills), keep their registers.
#define QS_MINB_FP8B(TG) ((TG) >= 8 ? 1 : 4)
// F: QfMxfp8, or QfMxfp8Fast (suffix mxfp8f) for eligible weights.
#define QS_ENTRY_MXFP8(name, F, TG)                                                                            \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32, QS_MINB(TG)) name(QGEMM_MXFP8_ARGS) {          \
        qgemm_fragsm_body<F, TG>(x, nullptr, codes, scales, nullptr, off, y, R, N, K, blockIdx.x);          \
    }
#define QS_ENTRY_NVFP4(name, TG)                                                                               \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32, QS_MINB(TG)) name(QGEMM_NVFP4_ARGS) {          \
        qgemm_fragsm_body<QfNvfp4, TG>(x, x_amax, codes, scales, w_amax, off, y, R, N, K, blockIdx.x);      \
    }
#define QS_ENTRY_BF16(name, TG)                                                                                \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32, QS_MINB(TG)) name(QGEMM_MXFP8_ARGS) {          \
        qgemm_fragsm_body<QfBf16, TG>(x, nullptr, codes, scales, nullptr, off, y, R, N, K, blockIdx.x);     \
    }
// FP8 block: x the binary16 activation operand [R, K] (quant_act_fp8_block_f16), xs its
// scale_inv [R, K/128], codes the E4M3 weights [E, N, K], ws their scale_inv [E, N/128, K/128];
// N a multiple of 128 (each block's columns one scale tile), K of 128.
// ST: stages (suffix _sN; none for three).
#define QS_ENTRY_FP8B(name, TG, ST)                                                                            \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32, QS_MINB_FP8B(TG))                             \
        name(const u16* __restrict__ x, const float* __restrict__ xs, const u8* __restrict__ codes,             \
             const float* __restrict__ ws, const u32* __restrict__ off, float* __restrict__ y, u32 E, u32 R,     \
             u32 N, u32 K) {                                                                                   \
        qgemm_fragsm_body<QfFp8b, TG, ST>(x, xs, codes, reinterpret_cast<const u8*>(ws), nullptr, off, y, R, N, \
                                          K, blockIdx.x);                                                      \
    }
// FP8 block, up to three dense weights on one input in one launch (q, k and v): block column
// bx of the grid runs weight i's column block bx − (the column blocks of weights < i) with
// weight i's codes, scales, output and N (a weight with N = 0 has no blocks); one group of
// rows (`off` = {0, ≥ R}), E = 1. Each weight's blocks are those of QS_ENTRY_FP8B on it alone,
// so the outputs are the single launches' bits.
#define QS_ENTRY_FP8B3(name, TG, ST)                                                                           \
    extern "C" __global__ void __launch_bounds__(QS_WARPS * 32, 1)                                             \
        name(const u16* __restrict__ x, const float* __restrict__ xs, const u8* __restrict__ c0,                \
             const float* __restrict__ s0, float* __restrict__ y0, u32 N0, const u8* __restrict__ c1,           \
             const float* __restrict__ s1, float* __restrict__ y1, u32 N1, const u8* __restrict__ c2,           \
             const float* __restrict__ s2, float* __restrict__ y2, u32 N2, const u32* __restrict__ off, u32 R,  \
             u32 K) {                                                                                          \
        u32 bx = blockIdx.x;                                                                                   \
        const u32 i = qf_multi_weight(bx, N0, N1, 128);                                                        \
        qgemm_fragsm_body<QfFp8b, TG, ST>(x, xs, qf_of3(i, c0, c1, c2),                                        \
                                          reinterpret_cast<const u8*>(qf_of3(i, s0, s1, s2)), nullptr, off,    \
                                          qf_of3(i, y0, y1, y2), R, qf_of3(i, N0, N1, N2), K, bx);             \
    }
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8_t1, QfMxfp8, 1)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8_t2, QfMxfp8, 2)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8_t4, QfMxfp8, 4)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8_t8, QfMxfp8, 8)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8f_t1, QfMxfp8Fast, 1)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8f_t2, QfMxfp8Fast, 2)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8f_t4, QfMxfp8Fast, 4)
QS_ENTRY_MXFP8(qgemm_fragsm_mxfp8f_t8, QfMxfp8Fast, 8)
QS_ENTRY_NVFP4(qgemm_fragsm_nvfp4_t1, 1)
QS_ENTRY_NVFP4(qgemm_fragsm_nvfp4_t2, 2)
QS_ENTRY_NVFP4(qgemm_fragsm_nvfp4_t4, 4)
QS_ENTRY_NVFP4(qgemm_fragsm_nvfp4_t8, 8)
QS_ENTRY_BF16(qgemm_fragsm_bf16_t1, 1)
QS_ENTRY_BF16(qgemm_fragsm_bf16_t2, 2)
QS_ENTRY_BF16(qgemm_fragsm_bf16_t4, 4)
QS_ENTRY_BF16(qgemm_fragsm_bf16_t8, 8)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_t1, 1, 3)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_t2, 2, 3)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_t4, 4, 3)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_t8, 8, 3)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s4_t1, 1, 4)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s4_t2, 2, 4)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s4_t4, 4, 4)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s4_t8, 8, 4)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s6_t1, 1, 6)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s6_t2, 2, 6)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s6_t4, 4, 6)
QS_ENTRY_FP8B(qgemm_fragsm_fp8b_s6_t8, 8, 6)
// Suffix _sN: N stages (N − 1 super-steps in flight per block), for dense launches whose few
// blocks are bound by one block's latency.
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s3_t1, 1, 3)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s3_t2, 2, 3)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s3_t4, 4, 3)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s3_t8, 8, 3)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s4_t1, 1, 4)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s4_t2, 2, 4)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s4_t4, 4, 4)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s4_t8, 8, 4)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s6_t1, 1, 6)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s6_t2, 2, 6)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s6_t4, 4, 6)
QS_ENTRY_FP8B3(qgemm_fragsm_fp8b3_s6_t8, 8, 6)
