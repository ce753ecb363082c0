// FP8-block GEMM (mxrl_cuda::ops::fp8block): y = x · Wᵀ for E4M3 codes with f32 scale_inv
// blocks, activations 1×128 along K and weights 128×128, with the arithmetic of the CPU
// emulation (mxrl_tensor::qlinear::FP8_BLOCK_EMULATION): for every 128-wide K block b, in
// increasing order,
//     P_b = Σ_{k∈b} e4m3(x[r,k]) · e4m3(W[n,k])          (a fresh f32 accumulator per block)
//     y   = fl(y + fl(fl(sx[r,b] · sw[n/128,b]) · P_b))   (y starts at +0)
// Reference: mxrl_tensor::qlinear::PreparedWeight::forward_inference (the CPU backend's
// grouped_qlinear / qlinear).
//
// Operands: E4M3 values (≤ 4 significant bits, magnitudes 2⁻⁹ .. 448) are exact in BF16; they
// are decoded through a 256-entry BF16 table in shared memory (bf16 of the prelude's decode
// table; NaN codes stay NaN) and multiplied by mma.m16n8k16 (BF16 operands, f32
// accumulation): every product is exact in f32 (≤ 8 significant bits, magnitudes 2⁻¹⁸ ..
// 448²), only the order of the f32 sum of P_b differs from the CPU (bound
// mxrl_tensor::tolerance::fp8_block_sum_bound). The promotion to y runs on CUDA cores with the
// CPU's operations in the CPU's order.
//
// Tiles: a CTA of F8_THREADS (4 warps) owns F8_BN = 64 output columns (warp w: columns
// 16w .. 16w+16, two n8 tiles) of expert blockIdx.y and row passes of 16·MT rows (MT = 1, or
// 4 in the `_m64` kernels): pass p of the expert's rows is taken by the CTA with blockIdx.z ==
// p mod gridDim.z. Per K block the CTA decodes the 16·MT × 128 activation codes and 64 × 128
// weight codes into shared memory (row stride F8_LD: conflict-free 32-bit fragment loads),
// then each warp runs 8 k16 steps on each of its MT row tiles.
// Fragment layout of mma.m16n8k16.row.col (g = lane / 4, t = lane % 4): A a0 = (row g,
// k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..);
// B b0 = (k 2t..2t+1, column g), b1 = (k 2t+8.., column g); C c0,c1 = (row g, columns 2t,
// 2t+1), c2,c3 = (row g+8, columns 2t, 2t+1) — as the tensor-core kernels of ops_qgemm.cu.
// Each output element is owned by one thread and summed in a fixed order: deterministic,
// no atomics.
//
// Grouped layout as kernels/ops_gemm.cu: rows of expert e are offsets[e] .. offsets[e+1]
// (clamped to [0, R]; a decreasing offset gives an empty expert), weights stacked per expert
// ([E, N, K] codes, [E, N/128, K/128] scale_inv), N a multiple of 128 (whole scale tiles per
// CTA), K a multiple of 128. Activation codes [R, K], scale_inv [R, K/128].

#if MXRL_FP8_BLOCK != 128
#error "ops_fp8block stages one 128-wide K block as 8 chunks of 16 codes per row"
#endif

#define F8_BN 64
#define F8_THREADS 128
#define F8_LD (MXRL_FP8_BLOCK + 8)  // BF16 row stride of the shared tiles (272 bytes)

__device__ __forceinline__ void f8_mma(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Sixteen E4M3 codes (byte j of the little-endian 16-byte chunk = element j) as BF16 through
// the table, stored at dst[0 .. 16) (16-byte aligned) as two 16-byte words: element 2i in the
// low half of word i.
__device__ __forceinline__ void f8_decode16(const uint4 w, const u16* lut, u16* dst) {
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    u32 out[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 lo = (words[i] >> (16 * h)) & 0xFFu, hi = (words[i] >> (16 * h + 8)) & 0xFFu;
            out[2 * i + h] = (u32)lut[lo] | ((u32)lut[hi] << 16);
        }
    }
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(out[0], out[1], out[2], out[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// The CTA's work for expert e with rows lo .. hi (lo < hi ≤ R): see the file comment. MT is
// the number of 16-row tiles per pass (a pass covers 16·MT rows): 1 for few rows per expert
// (decode), 4 for many (prefill, training), where the 64 × 128 weight tile decoded into shared
// memory then serves four times as many rows. Each output element's sum runs the same k16
// steps in the same order for every MT, so both give the same bits.
template <int MT>
__device__ __forceinline__ void f8_body(const u8* __restrict__ xc, const float* __restrict__ xs,
                                        const u8* __restrict__ wc, const float* __restrict__ ws,
                                        float* __restrict__ y, u32 e, u32 lo, u32 hi, u32 N, u32 K) {
    constexpr u32 BM = 16u * MT;
    __shared__ __align__(16) u16 As[BM * F8_LD];
    __shared__ __align__(16) u16 Bs[F8_BN * F8_LD];
    __shared__ u16 lut[256];
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, g = lane >> 2, t = lane & 3u;
    for (u32 i = tid; i < 256u; i += F8_THREADS) lut[i] = f32_to_bf16(__uint_as_float(MXRL_E4M3_BITS[i]));
    __syncthreads();
    const u32 kbs = K / MXRL_FP8_BLOCK;  // K blocks
    const u32 n0 = blockIdx.x * F8_BN;
    const u64 wrow0 = (u64)e * N + n0;  // the CTA's first weight row in the stack
    // The CTA's 64 columns lie in one 128-row scale tile of the weight: its scale row.
    const float* wsr = ws + ((u64)e * (N / MXRL_FP8_BLOCK) + n0 / MXRL_FP8_BLOCK) * kbs;
    const u32 passes = (hi - lo + BM - 1) / BM;
    for (u32 p = blockIdx.z; p < passes; p += gridDim.z) {
        const u32 rb = lo + p * BM;
        float yacc[MT][2][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) yacc[m][j][q] = 0.0f;
        for (u32 kb = 0; kb < kbs; ++kb) {
            const u64 k0 = (u64)kb * MXRL_FP8_BLOCK;
#pragma unroll
            for (u32 i = 0; i < (BM * 8) / F8_THREADS; ++i) {
                // Activation rows rb .. rb+BM (zeros past hi): chunk c = (row c / 8, 16 codes c % 8).
                const u32 c = tid + i * F8_THREADS;
                const u32 row = c >> 3, ch = c & 7u;
                const u32 r = rb + row;
                const uint4 w = r < hi ? *reinterpret_cast<const uint4*>(xc + (u64)r * K + k0 + 16u * ch)
                                       : make_uint4(0u, 0u, 0u, 0u);
                f8_decode16(w, lut, As + row * F8_LD + 16u * ch);
            }
#pragma unroll
            for (u32 i = 0; i < (F8_BN * 8) / F8_THREADS; ++i) {
                // Weight rows n0 .. n0+64 of expert e (all < N: N % 128 == 0).
                const u32 c = tid + i * F8_THREADS;
                const u32 row = c >> 3, ch = c & 7u;
                const uint4 w = *reinterpret_cast<const uint4*>(wc + (wrow0 + row) * K + k0 + 16u * ch);
                f8_decode16(w, lut, Bs + row * F8_LD + 16u * ch);
            }
            __syncthreads();
            float part[MT][2][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) part[m][j][q] = 0.0f;
#pragma unroll
            for (u32 kk = 0; kk < MXRL_FP8_BLOCK; kk += 16) {
                u32 b[2][2];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const u16* bp = Bs + (16u * warp + 8u * j + g) * F8_LD + kk + 2u * t;
                    b[j][0] = *reinterpret_cast<const u32*>(bp);
                    b[j][1] = *reinterpret_cast<const u32*>(bp + 8);
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const u16* ap = As + (16u * m + g) * F8_LD + kk + 2u * t;
                    u32 a[4];
                    a[0] = *reinterpret_cast<const u32*>(ap);
                    a[1] = *reinterpret_cast<const u32*>(ap + 8 * F8_LD);
                    a[2] = *reinterpret_cast<const u32*>(ap + 8);
                    a[3] = *reinterpret_cast<const u32*>(ap + 8 * F8_LD + 8);
#pragma unroll
                    for (int j = 0; j < 2; ++j) f8_mma(part[m][j], a, b[j][0], b[j][1]);
                }
            }
            __syncthreads();  // the next K block overwrites the tiles
            // Promotion: y = fl(y + fl(fl(sx · sw) · P)) for this thread's rows.
            const float sw = wsr[kb];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const u32 r = rb + 16u * m + g + 8u * hh;
                    const float sx = r < hi ? xs[(u64)r * kbs + kb] : 0.0f;
                    const float sc = __fmul_rn(sx, sw);
#pragma unroll
                    for (int j = 0; j < 2; ++j)
#pragma unroll
                        for (int q = 0; q < 2; ++q)
                            yacc[m][j][2 * hh + q] =
                                __fadd_rn(yacc[m][j][2 * hh + q], __fmul_rn(sc, part[m][j][2 * hh + q]));
                }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const u32 r = rb + 16u * m + g + 8u * hh;
                if (r >= hi) continue;
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const u32 col = n0 + 16u * warp + 8u * j + 2u * t;
                    *reinterpret_cast<float2*>(y + (u64)r * N + col) = make_float2(yacc[m][j][2 * hh], yacc[m][j][2 * hh + 1]);
                }
            }
    }
}

// Grouped over experts: grid (N / 64, E, Z); passes of 16 rows (`_m64`: 64 rows).
template <int MT>
__device__ __forceinline__ void f8_grouped(const u8* __restrict__ xc, const float* __restrict__ xs,
                                           const u8* __restrict__ wc, const float* __restrict__ ws,
                                           const u32* __restrict__ off, float* __restrict__ y, u32 R, u32 N, u32 K) {
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    if (lo == hi) return;  // the whole CTA: no barrier is skipped by part of it
    f8_body<MT>(xc, xs, wc, ws, y, e, lo, hi, N, K);
}

extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_block_gemm_grouped(const u8* __restrict__ xc, const float* __restrict__ xs, const u8* __restrict__ wc,
                           const float* __restrict__ ws, const u32* __restrict__ off, float* __restrict__ y, u32 R,
                           u32 N, u32 K) {
    f8_grouped<1>(xc, xs, wc, ws, off, y, R, N, K);
}

extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_block_gemm_grouped_m64(const u8* __restrict__ xc, const float* __restrict__ xs, const u8* __restrict__ wc,
                               const float* __restrict__ ws, const u32* __restrict__ off, float* __restrict__ y, u32 R,
                               u32 N, u32 K) {
    f8_grouped<4>(xc, xs, wc, ws, off, y, R, N, K);
}

// One weight (a dense linear): rows 0 .. R; grid (N / 64, 1, Z).
extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_block_gemm_dense(const u8* __restrict__ xc, const float* __restrict__ xs, const u8* __restrict__ wc,
                         const float* __restrict__ ws, float* __restrict__ y, u32 R, u32 N, u32 K) {
    if (R == 0u) return;
    f8_body<1>(xc, xs, wc, ws, y, 0u, 0u, R, N, K);
}

extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_block_gemm_dense_m64(const u8* __restrict__ xc, const float* __restrict__ xs, const u8* __restrict__ wc,
                             const float* __restrict__ ws, float* __restrict__ y, u32 R, u32 N, u32 K) {
    if (R == 0u) return;
    f8_body<4>(xc, xs, wc, ws, y, 0u, 0u, R, N, K);
}

// ---- grouped FP8-block GEMM with the stored codes streamed straight into mma fragments ----
//
// For few rows per expert (decode) the tiled kernels above spend their time decoding whole
// 64 × 128 weight tiles through shared memory for 16 rows. These kernels follow the fragment
// kernels of ops_qgemm.cu instead: the transposed product y_eᵀ = W_e · x_eᵀ with the stored
// weight codes as the mma A operand (16 output columns as the m16 rows) and the expert's
// activation codes as the B operand (8 rows as the n8 columns; rows past the expert's loaded as
// zeros and never stored), every operand loaded from global memory with 16-byte loads straight
// into registers, no shared-memory staging.
//
// A block of KS = blockDim / 32 warps (1 .. 8, the launcher's split) owns F8F_COLS = 32 output
// columns (two m16 tiles) of expert blockIdx.y, passes of 8·TG activation rows (TG = 1, 2, 4
// token groups), and splits K by whole 128-wide blocks: in round ρ warp w takes K block
// b = ρ·KS + w, as two chunks h = 0, 1 of 64 bytes per row; each chunk's codes are loaded while
// the previous one is multiplied (the next chunk: h = 1 of the same block, or h = 0 of the
// warp's next block). Lane (g = lane / 4, t = lane % 4) holds bytes 128b + 64h + 16t .. +16 of
// weight rows n0 + g + 8i (i < 4: tile i / 2, fragment row g or g+8) and of activation row
// 8·tg + g of the pass.
//
// P_b: a fresh f32 accumulator per K block, summed by the tensor cores from exact products, in
// one of two ways (template MMA):
// - F8F_E4M3: mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 on the codes as stored
//   (sm_89+). Fragment layout (PTX ISA, 8-bit m16n8k32): A register 0 = row g, k 4t..4t+3; 1 = row g+8,
//   k 4t..; 2 = row g, k 16+4t..; 3 = row g+8, k 16+4t..; B register 0 = k 4t..4t+3, column g;
//   1 = k 16+4t.., column g. Step (h, s) (h, s < 2) takes word 2s of the lane's chunk h as the
//   k indices 4t..4t+3 and word 2s+1 as 16+4t..16+4t+3, in A and B alike, so every product is
//   one x·w of the block's sum (the k order is permuted, the set of products is not).
// - F8F_F16: each code decoded to binary16 by cvt.rn.f16x2.e4m3x2 (exact: E4M3 values have ≤ 4
//   significant bits and lie in [2⁻⁹, 448], inside binary16's normal range; NaN codes give NaN)
//   and mma.sync.m16n8k16.row.col.f32.f16.f16.f32, the k order permuted as QfMxfp8 (step s of
//   chunk h takes elements 4s, 4s+1 as k 2t, 2t+1 and 4s+2, 4s+3 as k 2t+8, 2t+9).
// For sm_90, ptxas (CUDA 13) lowers the E4M3 mma to F2FP.F16.E4M3 conversions and
// HMMA.16816.F32 (binary16 operands, f32 accumulation): the instructions of F8F_F16 (Hopper's
// FP8 tensor-core path is wgmma); sm_89 and sm_100+ have native FP8 mma.sync.
// Either way every product e4m3 · e4m3 (≤ 8 significant bits, magnitudes 2⁻¹⁸ .. 448²) is exact
// in f32 and only the order of P_b's f32 sum differs from the CPU (bound
// mxrl_tensor::tolerance::fp8_block_sum_bound; a tensor core that summed with fewer bits than
// f32 would break it, and the GPU tests check sums that f32 holds exactly for equal bits).
//
// Promotion, the contract's operations in the contract's order: the warp that summed P_b forms
// the term fl(fl(sx[r, b] · sw[e, n/128, b]) · P_b) (the block's 32 columns lie in one 128-row
// scale tile: one sw per block and K block). y of the pass lives in dynamic shared memory
// ([8·TG][32] floats: lane entry × lane), entry i owned by thread i mod blockDim. With KS = 1
// the lane adds its terms to its own entries, y = fl(y + term), in increasing b. With KS > 1 the
// round's KS terms go to dynamic shared memory too ([KS][8·TG][32]) and the owner of entry i adds
// the terms of warps 0, 1, … (increasing b). y starts at +0. Every output is owned by one
// thread and summed in a fixed order: deterministic, no atomics, and the bits do not depend on
// the split or the rows per pass (every P_b is one warp's sum of the same mma steps, every y
// the same promotions in the same order).
//
// Grouped layout as the tiled kernels: expert e's rows offsets[e] .. offsets[e+1] clamped to
// [0, R]; weights [E, N, K] codes, [E, N/128, K/128] scale_inv; N and K multiples of 128.
#define F8F_COLS 32
#define F8F_E4M3 0
#define F8F_F16 1

__device__ __forceinline__ void f8f_mma_e4m3(float* d, const u32* a, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the launcher refuses devices below sm_89
#endif
}

__device__ __forceinline__ void f8f_mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two E4M3 codes (bits 0..7 → low half, 8..15 → high half) as binary16, exactly.
__device__ __forceinline__ u32 f8f_e4m3x2_to_f16x2(u32 pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)(pair & 0xFFFFu)));
    return h;
#else
    __trap();  // the launcher refuses devices below sm_89
    return 0u;
#endif
}

__device__ __forceinline__ u32 f8f_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int MMA, int TG>
__device__ __forceinline__ void f8f_body(const u8* __restrict__ xc, const float* __restrict__ xs,
                                         const u8* __restrict__ wc, const float* __restrict__ ws,
                                         const u32* __restrict__ off, float* __restrict__ y, u32 R, u32 N,
                                         u32 K) {
    constexpr int NACC = 2 * TG * 4;  // accumulators per lane: tile × token group × fragment entry
    // Dynamic shared memory: y of the pass [NACC][32], then the round's terms [KS][NACC][32]
    // when KS > 1.
    extern __shared__ float f8f_smem[];
    float* f8f_y = f8f_smem;
    float* f8f_red = f8f_smem + NACC * 32;
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    // Passes z, z + Z, … of the expert's rows (Z = gridDim.z, qgemm::frag_row_blocks). The
    // whole block returns: no barrier is skipped by part of it.
    if (lo + blockIdx.z * 8u * TG >= hi) return;
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, g = lane >> 2, t = lane & 3u;
    const u32 KS = blockDim.x >> 5;
    const u32 kbs = K / MXRL_FP8_BLOCK;
    const u32 rounds = (kbs + KS - 1) / KS;
    const u32 n0 = blockIdx.x * F8F_COLS;
    const u8* wr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wr[i] = wc + ((u64)e * N + n0 + g + 8u * i) * K + 16u * t;
    // The block's 32 columns lie in one 128-row scale tile: its scale row.
    const float* wsr = ws + ((u64)e * (N / MXRL_FP8_BLOCK) + n0 / MXRL_FP8_BLOCK) * kbs;
    for (u32 rb = lo + blockIdx.z * 8u * TG; rb < hi; rb += gridDim.z * 8u * TG) {
        // Chunk h of K block kb (bytes 128·kb + 64h + 16t .. +16; zeros past K or past the
        // expert's rows): weights wq[i], activation rows xa[tg].
        auto load = [&](u32 kb, u32 h, uint4 (&wq)[4], uint4 (&xa)[TG]) {
            const bool ok = kb < kbs;
            const u64 k0 = (u64)kb * MXRL_FP8_BLOCK + 64u * h;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                wq[i] = ok ? *reinterpret_cast<const uint4*>(wr[i] + k0) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int tg = 0; tg < TG; ++tg) {
                const u32 r = rb + 8u * tg + g;
                xa[tg] = ok && r < hi ? *reinterpret_cast<const uint4*>(xc + (u64)r * K + k0 + 16u * t)
                                      : make_uint4(0u, 0u, 0u, 0u);
            }
        };
        // y of the pass: entry i owned (initialized, summed, stored) by thread i mod blockDim.
        for (u32 i = tid; i < (u32)NACC * 32u; i += blockDim.x) f8f_y[i] = 0.0f;
        // Chunks in flight: the one being multiplied and the next (same block's second chunk,
        // or the first chunk of the warp's next block).
        uint4 wq[4], xa[TG];
        load(warp, 0u, wq, xa);
        for (u32 rd = 0; rd < rounds; ++rd) {
            const u32 kb = rd * KS + warp;
            float acc[2][TG][4];
            frag_acc_zero<TG>(acc);
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                uint4 nq[4], nx[TG];
                load(h == 0 ? kb : kb + KS, h ^ 1u, nq, nx);
                if (kb < kbs) {  // warp-uniform
                    if (MMA == F8F_E4M3) {
#pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            u32 a[2][4];
#pragma unroll
                            for (int j = 0; j < 2; ++j) {
                                a[j][0] = f8f_word(wq[2 * j], 2 * s);
                                a[j][1] = f8f_word(wq[2 * j + 1], 2 * s);
                                a[j][2] = f8f_word(wq[2 * j], 2 * s + 1);
                                a[j][3] = f8f_word(wq[2 * j + 1], 2 * s + 1);
                            }
#pragma unroll
                            for (int tg = 0; tg < TG; ++tg) {
                                const u32 b0 = f8f_word(xa[tg], 2 * s), b1 = f8f_word(xa[tg], 2 * s + 1);
                                f8f_mma_e4m3(acc[0][tg], a[0], b0, b1);
                                f8f_mma_e4m3(acc[1][tg], a[1], b0, b1);
                            }
                        }
                    } else {
#pragma unroll
                        for (int s = 0; s < 4; ++s) {
                            u32 a[2][4];
#pragma unroll
                            for (int j = 0; j < 2; ++j) {
                                const u32 w0 = f8f_word(wq[2 * j], s), w1 = f8f_word(wq[2 * j + 1], s);
                                a[j][0] = f8f_e4m3x2_to_f16x2(w0);
                                a[j][1] = f8f_e4m3x2_to_f16x2(w1);
                                a[j][2] = f8f_e4m3x2_to_f16x2(w0 >> 16);
                                a[j][3] = f8f_e4m3x2_to_f16x2(w1 >> 16);
                            }
#pragma unroll
                            for (int tg = 0; tg < TG; ++tg) {
                                const u32 xw = f8f_word(xa[tg], s);
                                const u32 b0 = f8f_e4m3x2_to_f16x2(xw), b1 = f8f_e4m3x2_to_f16x2(xw >> 16);
                                f8f_mma_f16(acc[0][tg], a[0], b0, b1);
                                f8f_mma_f16(acc[1][tg], a[1], b0, b1);
                            }
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) wq[i] = nq[i];
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) xa[tg] = nx[tg];
            }
            if (kb < kbs) {
                // The block's terms fl(fl(sx · sw) · P_b); entry q of token group tg is activation
                // row 8·tg + 2t + (q & 1) of the pass (no term is kept for rows past hi).
                const float sw = wsr[kb];
#pragma unroll
                for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const u32 r = rb + 8u * tg + 2u * t + hh;
                        const float sc = r < hi ? __fmul_rn(xs[(u64)r * kbs + kb], sw) : 0.0f;
#pragma unroll
                        for (int j = 0; j < 2; ++j)
#pragma unroll
                            for (int q = hh; q < 4; q += 2) acc[j][tg][q] = __fmul_rn(sc, acc[j][tg][q]);
                    }
            }
            if (KS == 1) {
                // kb < kbs every round: y = fl(y + term) in increasing b.
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                        for (int q = 0; q < 4; ++q) {
                            float& v = f8f_y[((j * TG + tg) * 4 + q) * 32 + lane];
                            v = __fadd_rn(v, acc[j][tg][q]);
                        }
            } else {
                __syncthreads();  // the previous round's reads of the terms are done
                if (kb < kbs) {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
#pragma unroll
                        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                            for (int q = 0; q < 4; ++q)
                                f8f_red[(warp * NACC + (j * TG + tg) * 4 + q) * 32 + lane] = acc[j][tg][q];
                }
                __syncthreads();
                const u32 nw = min(KS, kbs - rd * KS);  // warps with a K block this round
                for (u32 i = tid; i < (u32)NACC * 32u; i += blockDim.x) {
                    float v = f8f_y[i];
                    for (u32 w = 0; w < nw; ++w) v = __fadd_rn(v, f8f_red[w * NACC * 32 + i]);
                    f8f_y[i] = v;
                }
            }
        }
        // Entry i = slot·32 + l: slot = (j·TG + tg)·4 + q of lane l's fragments, column
        // n0 + 16j + l/4 (+8 for q ≥ 2), activation row 8·tg + 2·(l % 4) (+1 for odd q) of the
        // pass; stored by the thread that summed it.
        for (u32 i = tid; i < (u32)NACC * 32u; i += blockDim.x) {
            const u32 slot = i / 32u, l = i % 32u;
            const u32 q = slot % 4, tg = (slot / 4) % TG, j = slot / (4 * TG);
            const u32 r = rb + 8u * tg + 2u * (l & 3u) + (q & 1u);
            const u32 col = n0 + 16u * j + (l >> 2) + 8u * (q >> 1);
            if (r < hi) y[(u64)r * N + col] = f8f_y[i];
        }
    }
}

#define F8F_ARGS                                                                                          \
    const u8 *__restrict__ xc, const float *__restrict__ xs, const u8 *__restrict__ wc,                     \
        const float *__restrict__ ws, const u32 *__restrict__ off, float *__restrict__ y, u32 R, u32 N, u32 K
// Entry points: _e4m3 / _f16 = the mma, _tN = N token groups of 8 rows per pass; blocks of 32·KS
// threads (KS ≤ 8), grid (N / 32, E).
#define F8F_ENTRY(name, MMA, TG, MINB)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(F8F_ARGS) {                             \
        f8f_body<MMA, TG>(xc, xs, wc, ws, off, y, R, N, K);                                              \
    }
F8F_ENTRY(fp8_block_frag_e4m3_t1, F8F_E4M3, 1, 2)
F8F_ENTRY(fp8_block_frag_e4m3_t2, F8F_E4M3, 2, 2)
F8F_ENTRY(fp8_block_frag_e4m3_t4, F8F_E4M3, 4, 1)
F8F_ENTRY(fp8_block_frag_f16_t1, F8F_F16, 1, 2)
F8F_ENTRY(fp8_block_frag_f16_t2, F8F_F16, 2, 2)
F8F_ENTRY(fp8_block_frag_f16_t4, F8F_F16, 4, 1)
