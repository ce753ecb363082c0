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
    const u32 hi = min(off[e + 1], R);
    const u32 lo = min(off[e], hi);
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
