// Causal GQA attention of the engine: training forward (flash-style, online softmax, O(T) memory
// per head), training backward (delta, dq over key tiles, dk/dv over query tiles; no atomics),
// and decode over a BF16 KV cache (split over key chunks, fixed-order combine). The training
// kernels come twice: register-tiled on the CUDA cores (attn_fwd_*, attn_bwd_dq_*,
// attn_bwd_dkdv_*, below) and on BF16 tensor cores for D <= 128 (attn_*_tc_*, further down).
// References: mxrl_tensor::attention::{attention_forward, attention_backward, attention_decode}.
// Scores s_ij = fl(q_i . k_j) * scale with f32 accumulation; the softmax and the weighted sums
// run in f32 in a different (fixed) order than the reference: the bound is
// mxrl_tensor::tolerance::attention_*.
//
// Layout: q, out: [N, hq*D]; k, v: [N, hkv*D]; sequence b owns rows offsets[b]..offsets[b+1];
// query head h reads kv head h / (hq/hkv). D <= ATT_MAX_D, any value (the launchers require it
// even, as RoPE does).
//
// Training kernels (register-tiled): a block of ATT_THREADS = 16 x 16 threads, thread (tr, tc)
// = (tid / 16, tid % 16). Rows of a tile sit in shared memory zero-padded to d4 = D rounded up
// to 4 with row stride att_stride(D) = 4 * odd floats, read as float4. A score tile is computed
// by every thread for 4 rows tr*4 + a (a < 4; the 16 lanes of a half-warp read the same rows:
// broadcast) against the rows tc + 16*b (b < 2 or 4; 8 consecutive rows per quarter-warp, which
// the odd stride spreads over all 32 banks): one independent accumulator per score, each a dot
// product over d in index order (products rounded, no FMA), so a thread runs 8 or 16 dependent
// chains side by side. Weighted sums (P.V, dS.K, P^T.dO, dS^T.Q) go through a probability tile
// [key or query][ATT_PS] in shared memory: a thread owns 4 output rows and the float4 columns
// 4*tc + 64*c (c < NCH = ceil(d4 / 64), templated: 1, 2 or 4) and adds the terms in increasing
// order of the summed index, one chain per output element (products rounded, no FMA). Terms
// of masked (causal) pairs are skipped, never multiplied by zero, so non-finite values of
// future keys do not leak. The zero padding adds exact zeros to the dots and is never written.

#define ATT_WARPS 16
#define ATT_DEC_WARPS 4
#define ATT_MAX_D 256
#define ATT_DEC_CHUNK 64
#define ATT_DEC_G 8
// Training tile kernels: threads per block, query rows per forward/dq block (key rows per dk/dv
// block), keys per forward tile, keys per dq tile, row stride of the probability tiles.
#define ATT_THREADS 256
#define ATT_BR 64
#define ATT_BF 64
#define ATT_BK 32
#define ATT_PS 68
#if ATT_BF != ATT_BR || ATT_BR % ATT_BK != 0
#error "attn_fwd walks key tiles up to the block's first row; attn_bwd_dq's tiles must align"
#endif

__device__ __forceinline__ float att_neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float att_nan() { return __int_as_float(0x7fc00000); }

// D rounded up to a multiple of 4 (the padded row width), and the shared row stride: d4 when
// d4/4 is odd, else d4 + 4 (4 * odd floats: conflict-free float4 reads of 8 rows at a time).
__device__ __forceinline__ u32 att_d4(u32 D) { return (D + 3u) & ~3u; }
__device__ __forceinline__ u32 att_stride(u32 D) {
    const u32 d4 = att_d4(D);
    return ((d4 >> 2) & 1u) ? d4 : d4 + 4u;
}

// acc = acc + p * x, componentwise (one product and one sum each, rounded).
__device__ __forceinline__ float4 att_axpy(float4 acc, float p, float4 x) {
    acc.x = __fadd_rn(acc.x, __fmul_rn(p, x.x));
    acc.y = __fadd_rn(acc.y, __fmul_rn(p, x.y));
    acc.z = __fadd_rn(acc.z, __fmul_rn(p, x.z));
    acc.w = __fadd_rn(acc.w, __fmul_rn(p, x.w));
    return acc;
}
__device__ __forceinline__ float4 att_scale4(float4 a, float s) {
    return make_float4(__fmul_rn(a.x, s), __fmul_rn(a.y, s), __fmul_rn(a.z, s), __fmul_rn(a.w, s));
}
__device__ __forceinline__ float4 att_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void att_st4(float* p, float4 a) { *reinterpret_cast<float4*>(p) = a; }

// Stores the components d < D of the four columns col..col+3 of a row.
__device__ __forceinline__ void att_store4(float* row, u32 col, u32 D, float4 a) {
    if (col < D) row[col] = a.x;
    if (col + 1 < D) row[col + 1] = a.y;
    if (col + 2 < D) row[col + 2] = a.z;
    if (col + 3 < D) row[col + 3] = a.w;
}

// Butterfly max / sum over the 16 lanes of a half-warp (offsets 8, 4, 2, 1; every lane ends
// with the same value; fixed order). All 32 lanes must take part.
__device__ __forceinline__ float att_hmax16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float att_hsum16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Loads rows r0 .. r0+nrows-1 (those < r_end; the rest zero) of the head slice `head_off` of a
// [*, row_stride] matrix into a shared tile [nrows][sk], columns D..d4 zero. Warp w of the
// block takes rows w, w + 8, ...; its lanes the columns. All threads of the block take part.
__device__ __forceinline__ void att_load_rows(float* tile, u32 sk, u32 nrows, const float* __restrict__ src,
                                              u64 base_row, u32 r0, u32 r_end, u64 row_stride,
                                              u64 head_off, u32 D, u32 d4) {
    const u32 lane = threadIdx.x & 31, nw = blockDim.x >> 5;
#pragma unroll 4
    for (u32 rr = threadIdx.x >> 5; rr < nrows; rr += nw) {
        const u32 r = r0 + rr;
        float* t = tile + rr * sk;
        if (r < r_end) {
            const float* s = src + (base_row + r) * row_stride + head_off;
            for (u32 d = lane; d < d4; d += 32) t[d] = d < D ? s[d] : 0.0f;
        } else {
            for (u32 d = lane; d < d4; d += 32) t[d] = 0.0f;
        }
    }
}

// s[a][b] += A[a*sk + e] * B[16*b*sk + e] for e < d4 in increasing order, one accumulator per
// (a, b), products rounded (no FMA). A points at the thread's first row (tr*4) of one tile, B
// at row tc of the other.
template <int RA, int CB>
__device__ __forceinline__ void att_dots(float (&s)[RA][CB], const float* A, const float* B, u32 sk,
                                         u32 d4) {
#pragma unroll 2
    for (u32 e = 0; e < d4; e += 4) {
        float4 x[RA], y[CB];
#pragma unroll
        for (int a = 0; a < RA; ++a) x[a] = att_ld4(A + a * sk + e);
#pragma unroll
        for (int b = 0; b < CB; ++b) y[b] = att_ld4(B + 16 * b * sk + e);
#pragma unroll
        for (int a = 0; a < RA; ++a) {
#pragma unroll
            for (int b = 0; b < CB; ++b) {
                float t = s[a][b];
                t = __fadd_rn(t, __fmul_rn(x[a].x, y[b].x));
                t = __fadd_rn(t, __fmul_rn(x[a].y, y[b].y));
                t = __fadd_rn(t, __fmul_rn(x[a].z, y[b].z));
                t = __fadd_rn(t, __fmul_rn(x[a].w, y[b].w));
                s[a][b] = t;
            }
        }
    }
}

// acc[a][c] += P[j*ATT_PS + a] * X[j*sk + 64*c .. +3] for j = 0 .. jn-1 in increasing order
// (componentwise; products rounded, no FMA). P points at the thread's 4 rows (tr*4) of a
// probability tile [j][ATT_PS], X at column col0 = 4*tc of a tile [j][sk]; chunk c only where
// col0 + 64*c < d4. MODE 0 adds every term; MODE 1 only the terms with j <= lim + a (keys up to
// the query: forward, dq); MODE 2 only those with j >= lim + a (queries from the key on: dk/dv).
template <int NCH, int MODE>
__device__ __forceinline__ void att_wsum(float4 (&acc)[4][NCH], const float* P, const float* X, u32 sk,
                                         u32 col0, u32 d4, u32 jn, int lim) {
    for (u32 j = 0; j < jn; ++j) {
        const float4 p4 = att_ld4(P + j * ATT_PS);
        const float pa[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            if (col0 + 64u * c < d4) {
                const float4 x = att_ld4(X + j * sk + 64u * c);
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const bool on = MODE == 0 || (MODE == 1 ? (int)j <= lim + a : (int)j >= lim + a);
                    if (on) acc[a][c] = att_axpy(acc[a][c], pa[a], x);
                }
            }
        }
    }
}

// Training forward. Grid (B, hq, ceil(max_len / ATT_BR)), block ATT_THREADS; block (b, h, z)
// owns the query rows row0 .. row0+63 of sequence b, head h, row0 = (gridDim.z - 1 - z) * 64
// (the longest rows start first). Per key tile of ATT_BF keys kt <= row0: scores of the thread's
// 4 rows x 4 keys (keys tc + 16*b), masked to j <= i, then per row (16 lanes) the running max
// m, the rescale alpha = exp(m_old - m), p = exp(s - m), l = l*alpha + sum p, and
// o = o*alpha + sum_j p_j v_j over the tile's keys in increasing order. At the end
// out[i] = o / l and lse[i, h] = m + log(l).
// Dynamic shared memory (floats): ATT_BR*stride (q) + ATT_BF*max(stride, ATT_PS) (k, then the
// probability tile P^T [key][row]) + ATT_BF*stride (v).
template <int NCH>
__device__ __forceinline__ void attn_fwd_body(const float* __restrict__ q, const float* __restrict__ k,
                                              const float* __restrict__ v, const u32* __restrict__ offsets,
                                              float* __restrict__ out, float* __restrict__ lse, u32 hq,
                                              u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* qs = smem;
    float* ks = qs + ATT_BR * sk;  // also P^T [ATT_BF][ATT_PS]
    float* vs = ks + ATT_BF * max(sk, (u32)ATT_PS);
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = (gridDim.z - 1 - blockIdx.z) * ATT_BR;
    if (row0 >= T) return;  // block-uniform
    const u32 tid = threadIdx.x, tr = tid >> 4, tc = tid & 15, ra = tr * 4, col0 = tc * 4;
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    att_load_rows(qs, sk, ATT_BR, q, t0, row0, T, qstride, (u64)h * D, D, d4);
    float m[4], l[4];
    float4 o[4][NCH];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = att_neg_inf();
        l[a] = 0.0f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) o[a][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // Every tile holds key kt <= row0 <= i, kt < T, for every row i of the block (rows past T
    // included; they are never stored): each row's max is finite from the first tile on.
    for (u32 kt = 0; kt <= row0; kt += ATT_BF) {
        __syncthreads();  // the previous tile's weighted sum is done with P^T and v
        att_load_rows(ks, sk, ATT_BF, k, t0, kt, T, kstride, (u64)kh * D, D, d4);
        att_load_rows(vs, sk, ATT_BF, v, t0, kt, T, kstride, (u64)kh * D, D, d4);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int bb = 0; bb < 4; ++bb) s[a][bb] = 0.0f;
        att_dots<4, 4>(s, qs + ra * sk, ks + tc * sk, sk, d4);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const u32 i = row0 + ra + a;
            float mx = att_neg_inf();
#pragma unroll
            for (int bb = 0; bb < 4; ++bb) {
                const u32 j = kt + tc + 16u * bb;
                s[a][bb] = (j <= i && j < T) ? __fmul_rn(s[a][bb], scale) : att_neg_inf();
                mx = fmaxf(mx, s[a][bb]);
            }
            const float m_new = fmaxf(m[a], att_hmax16(mx));
            const float alpha = expf(__fsub_rn(m[a], m_new));  // 0 on the first tile
            float rs = 0.0f;
#pragma unroll
            for (int bb = 0; bb < 4; ++bb) {
                s[a][bb] = expf(__fsub_rn(s[a][bb], m_new));  // masked: exp(-inf) = 0
                rs = __fadd_rn(rs, s[a][bb]);
            }
            l[a] = __fadd_rn(__fmul_rn(l[a], alpha), att_hsum16(rs));
            m[a] = m_new;
#pragma unroll
            for (int c = 0; c < NCH; ++c) o[a][c] = att_scale4(o[a][c], alpha);
        }
        __syncthreads();  // every thread is done reading k
#pragma unroll
        for (int bb = 0; bb < 4; ++bb)
            att_st4(ks + (tc + 16u * bb) * ATT_PS + ra, make_float4(s[0][bb], s[1][bb], s[2][bb], s[3][bb]));
        __syncthreads();
        const u32 jn = min((u32)ATT_BF, T - kt);
        if (kt == row0)  // diagonal tile: key kt + j for row row0 + ra + a only while j <= ra + a
            att_wsum<NCH, 1>(o, ks + ra, vs + col0, sk, col0, d4, jn, (int)ra);
        else
            att_wsum<NCH, 0>(o, ks + ra, vs + col0, sk, col0, d4, jn, 0);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 i = row0 + ra + a;
        if (i < T) {
            float* orow = out + (u64)(t0 + i) * qstride + (u64)h * D;
            const float la = l[a];
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
                const float4 x = o[a][c];
                att_store4(orow, col0 + 64u * c, D,
                           make_float4(__fdiv_rn(x.x, la), __fdiv_rn(x.y, la), __fdiv_rn(x.z, la),
                                       __fdiv_rn(x.w, la)));
            }
            if (tc == 0) lse[(u64)(t0 + i) * hq + h] = __fadd_rn(m[a], logf(la));
        }
    }
}

// dq. Grid (B, hq, ceil(max_len / ATT_BR)) and rows as attn_fwd. Per key tile of ATT_BK keys
// up to the block's last row: for key j <= i, p = exp(s_ij - lse_i) and
// ds = p * (dout_i . v_j - delta_i) (the thread's 4 rows x 2 keys tc, tc + 16);
// dq_i = scale * sum_j ds_j k_j (keys in increasing order).
// Dynamic shared memory (floats): 2*ATT_BR*stride (q, dout) + ATT_BK*stride (k) +
// ATT_BK*max(stride, ATT_PS) (v, then dS^T [key][row]).
template <int NCH>
__device__ __forceinline__ void attn_bwd_dq_body(const float* __restrict__ dout, const float* __restrict__ q,
                                                 const float* __restrict__ k, const float* __restrict__ v,
                                                 const float* __restrict__ lse,
                                                 const float* __restrict__ delta,
                                                 const u32* __restrict__ offsets, float* __restrict__ dq,
                                                 u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* qs = smem;
    float* dos = qs + ATT_BR * sk;
    float* ks = dos + ATT_BR * sk;
    float* vs = ks + ATT_BK * sk;  // also dS^T [ATT_BK][ATT_PS]
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = (gridDim.z - 1 - blockIdx.z) * ATT_BR;
    if (row0 >= T) return;  // block-uniform
    const u32 tid = threadIdx.x, tr = tid >> 4, tc = tid & 15, ra = tr * 4, col0 = tc * 4;
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    att_load_rows(qs, sk, ATT_BR, q, t0, row0, T, qstride, (u64)h * D, D, d4);
    att_load_rows(dos, sk, ATT_BR, dout, t0, row0, T, qstride, (u64)h * D, D, d4);
    float lse_r[4], del_r[4];
    float4 acc[4][NCH];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 i = row0 + ra + a;
        lse_r[a] = i < T ? lse[(u64)(t0 + i) * hq + h] : 0.0f;
        del_r[a] = i < T ? delta[(u64)(t0 + i) * hq + h] : 0.0f;
#pragma unroll
        for (int c = 0; c < NCH; ++c) acc[a][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const u32 last = min(T - 1, row0 + ATT_BR - 1);
    for (u32 kt = 0; kt <= last; kt += ATT_BK) {
        __syncthreads();  // the previous tile's weighted sum is done with k and dS^T
        att_load_rows(ks, sk, ATT_BK, k, t0, kt, T, kstride, (u64)kh * D, D, d4);
        att_load_rows(vs, sk, ATT_BK, v, t0, kt, T, kstride, (u64)kh * D, D, d4);
        __syncthreads();
        float s[4][2], dp[4][2];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                s[a][bb] = 0.0f;
                dp[a][bb] = 0.0f;
            }
        att_dots<4, 2>(s, qs + ra * sk, ks + tc * sk, sk, d4);
        att_dots<4, 2>(dp, dos + ra * sk, vs + tc * sk, sk, d4);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const u32 i = row0 + ra + a;
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const u32 j = kt + tc + 16u * bb;
                const float p = expf(__fsub_rn(__fmul_rn(s[a][bb], scale), lse_r[a]));
                s[a][bb] = (j <= i && j < T) ? __fmul_rn(p, __fsub_rn(dp[a][bb], del_r[a])) : 0.0f;
            }
        }
        __syncthreads();  // every thread is done reading v
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
            att_st4(vs + (tc + 16u * bb) * ATT_PS + ra, make_float4(s[0][bb], s[1][bb], s[2][bb], s[3][bb]));
        __syncthreads();
        const u32 jn = min((u32)ATT_BK, T - kt);
        if (kt >= row0)  // keys past some of the block's rows: key kt + j for row row0 + ra + a
                         // only while j <= row0 + ra - kt + a
            att_wsum<NCH, 1>(acc, vs + ra, ks + col0, sk, col0, d4, jn, (int)(row0 + ra) - (int)kt);
        else
            att_wsum<NCH, 0>(acc, vs + ra, ks + col0, sk, col0, d4, jn, 0);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 i = row0 + ra + a;
        if (i < T) {
            float* row = dq + (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
            for (int c = 0; c < NCH; ++c) att_store4(row, col0 + 64u * c, D, att_scale4(acc[a][c], scale));
        }
    }
}

// dk, dv. Grid (B, hkv, ceil(max_len / ATT_BR)); block (b, kh, z) owns the key rows
// j0 .. j0+63, j0 = z * 64 (the rows with the most queries start first), and sums over the
// group's query heads in increasing order and then over queries i >= j in increasing order:
// dv_j = sum p_ij dout_i, dk_j = scale * sum ds_ij q_i (p, ds as in attn_bwd_dq; scores of the
// thread's 4 keys x QPT queries tc + 16*b per query tile of 16*QPT queries).
// Dynamic shared memory (floats): 2*ATT_BR*stride (k, v) + 2*BQ*stride (q, dout) +
// 2*BQ*ATT_PS (P, dS [query][key]) + 2*BQ (lse, delta), BQ = 16*QPT.
template <int NCH, int QPT>
__device__ __forceinline__ void attn_bwd_dkdv_body(const float* __restrict__ dout, const float* __restrict__ q,
                                                   const float* __restrict__ k, const float* __restrict__ v,
                                                   const float* __restrict__ lse,
                                                   const float* __restrict__ delta,
                                                   const u32* __restrict__ offsets, float* __restrict__ dk,
                                                   float* __restrict__ dv, u32 hq, u32 hkv, u32 D,
                                                   float scale) {
    constexpr u32 BQ = 16 * QPT;
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* ks = smem;
    float* vs = ks + ATT_BR * sk;
    float* qs = vs + ATT_BR * sk;
    float* dos = qs + BQ * sk;
    float* pb = dos + BQ * sk;
    float* dsb = pb + BQ * ATT_PS;
    float* lse_t = dsb + BQ * ATT_PS;
    float* del_t = lse_t + BQ;
    const u32 b = blockIdx.x, kh = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 j0 = blockIdx.z * ATT_BR;
    if (j0 >= T) return;  // block-uniform
    const u32 tid = threadIdx.x, tr = tid >> 4, tc = tid & 15, ra = tr * 4, col0 = tc * 4;
    const u32 g = hq / hkv;
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    att_load_rows(ks, sk, ATT_BR, k, t0, j0, T, kstride, (u64)kh * D, D, d4);
    att_load_rows(vs, sk, ATT_BR, v, t0, j0, T, kstride, (u64)kh * D, D, d4);
    float4 adk[4][NCH], adv[4][NCH];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            adk[a][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            adv[a][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    for (u32 hh = 0; hh < g; ++hh) {
        const u32 h = kh * g + hh;
        for (u32 it = j0; it < T; it += BQ) {
            __syncthreads();  // the previous tile's weighted sums are done with q, dout, P, dS
            att_load_rows(qs, sk, BQ, q, t0, it, T, qstride, (u64)h * D, D, d4);
            att_load_rows(dos, sk, BQ, dout, t0, it, T, qstride, (u64)h * D, D, d4);
            if (tid < BQ) {
                const u32 r = it + tid;
                lse_t[tid] = r < T ? lse[(u64)(t0 + r) * hq + h] : 0.0f;
                del_t[tid] = r < T ? delta[(u64)(t0 + r) * hq + h] : 0.0f;
            }
            __syncthreads();
            float s[4][QPT], dp[4][QPT];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int bb = 0; bb < QPT; ++bb) {
                    s[a][bb] = 0.0f;
                    dp[a][bb] = 0.0f;
                }
            att_dots<4, QPT>(s, ks + ra * sk, qs + tc * sk, sk, d4);
            att_dots<4, QPT>(dp, vs + ra * sk, dos + tc * sk, sk, d4);
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const u32 j = j0 + ra + a;
#pragma unroll
                for (int bb = 0; bb < QPT; ++bb) {
                    const u32 ii = tc + 16u * bb, i = it + ii;
                    const bool ok = i < T && i >= j;
                    const float p = expf(__fsub_rn(__fmul_rn(s[a][bb], scale), lse_t[ii]));
                    const float ds = __fmul_rn(p, __fsub_rn(dp[a][bb], del_t[ii]));
                    s[a][bb] = ok ? p : 0.0f;
                    dp[a][bb] = ok ? ds : 0.0f;
                }
            }
#pragma unroll
            for (int bb = 0; bb < QPT; ++bb) {
                const u32 ii = tc + 16u * bb;
                att_st4(pb + ii * ATT_PS + ra, make_float4(s[0][bb], s[1][bb], s[2][bb], s[3][bb]));
                att_st4(dsb + ii * ATT_PS + ra, make_float4(dp[0][bb], dp[1][bb], dp[2][bb], dp[3][bb]));
            }
            __syncthreads();
            const u32 jn = min(BQ, T - it);
            if (it < j0 + ATT_BR) {  // queries before some of the block's keys: query it + i for
                                     // key j0 + ra + a only while i >= j0 + ra - it + a
                const int lim = (int)(j0 + ra) - (int)it;
                att_wsum<NCH, 2>(adv, pb + ra, dos + col0, sk, col0, d4, jn, lim);
                att_wsum<NCH, 2>(adk, dsb + ra, qs + col0, sk, col0, d4, jn, lim);
            } else {
                att_wsum<NCH, 0>(adv, pb + ra, dos + col0, sk, col0, d4, jn, 0);
                att_wsum<NCH, 0>(adk, dsb + ra, qs + col0, sk, col0, d4, jn, 0);
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 j = j0 + ra + a;
        if (j < T) {
            const u64 kb = (u64)(t0 + j) * kstride + (u64)kh * D;
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
                att_store4(dk + kb, col0 + 64u * c, D, att_scale4(adk[a][c], scale));
                att_store4(dv + kb, col0 + 64u * c, D, adv[a][c]);
            }
        }
    }
}

// The instantiations the launchers pick by D: suffix = the largest D of the class
// (NCH = 1, 2, 4 column chunks per thread); the second launch bound is the blocks per SM the
// shared memory of the class allows at its largest D (registers capped to match).
#define ATT_FWD_ARGS                                                                                 \
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,           \
        const u32 *__restrict__ offsets, float *__restrict__ out, float *__restrict__ lse, u32 hq, \
        u32 hkv, u32 D, float scale
#define ATT_DQ_ARGS                                                                                  \
    const float *__restrict__ dout, const float *__restrict__ q, const float *__restrict__ k,        \
        const float *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta, \
        const u32 *__restrict__ offsets, float *__restrict__ dq, u32 hq, u32 hkv, u32 D, float scale
#define ATT_DKDV_ARGS                                                                                \
    const float *__restrict__ dout, const float *__restrict__ q, const float *__restrict__ k,        \
        const float *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ delta, \
        const u32 *__restrict__ offsets, float *__restrict__ dk, float *__restrict__ dv, u32 hq,    \
        u32 hkv, u32 D, float scale

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_fwd_64(ATT_FWD_ARGS) {
    attn_fwd_body<1>(q, k, v, offsets, out, lse, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_fwd_128(ATT_FWD_ARGS) {
    attn_fwd_body<2>(q, k, v, offsets, out, lse, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attn_fwd_256(ATT_FWD_ARGS) {
    attn_fwd_body<4>(q, k, v, offsets, out, lse, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dq_64(ATT_DQ_ARGS) {
    attn_bwd_dq_body<1>(dout, q, k, v, lse, delta, offsets, dq, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dq_128(ATT_DQ_ARGS) {
    attn_bwd_dq_body<2>(dout, q, k, v, lse, delta, offsets, dq, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attn_bwd_dq_256(ATT_DQ_ARGS) {
    attn_bwd_dq_body<4>(dout, q, k, v, lse, delta, offsets, dq, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dkdv_64(ATT_DKDV_ARGS) {
    attn_bwd_dkdv_body<1, 4>(dout, q, k, v, lse, delta, offsets, dk, dv, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attn_bwd_dkdv_128(ATT_DKDV_ARGS) {
    attn_bwd_dkdv_body<2, 4>(dout, q, k, v, lse, delta, offsets, dk, dv, hq, hkv, D, scale);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attn_bwd_dkdv_256(ATT_DKDV_ARGS) {
    attn_bwd_dkdv_body<4, 2>(dout, q, k, v, lse, delta, offsets, dk, dv, hq, hkv, D, scale);
}

// ---- Tensor-core training kernels (D <= ATC_MAX_D) ----
//
// The same three computations as attn_fwd / attn_bwd_dq / attn_bwd_dkdv, with every dot product
// and weighted sum (S = Q K^T, dP = dO V^T, O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q)
// on BF16 tensor cores: each f32 operand is split into three BF16 parts, x = hi + mid + lo
// (common.cuh's split_bf16x3: exact for |x| >= 2^-110), and a product x.y is the f32
// accumulation (mma.m16n8k16, f32 accumulator) of the six part products with index sum <= 2,
// lo*hi, mid*mid, hi*lo, mid*hi, hi*mid, hi*hi in that order; each part product is exact in
// f32, the three dropped ones are below 3u|x.y| together. Nothing is rounded to BF16 that the
// reference keeps in f32: the operands, the scores and the probabilities enter the products
// with all their bits, so the op's definition (mxrl_tensor::attention) is unchanged; only the
// summation differs, bounded by mxrl_tensor::tolerance::AttnSums::Bf16x3Mma. The softmax
// statistics (max, exp, row sums, log), the masking and ds = p (dp - delta) run in IEEE f32
// on the CUDA cores in the fixed orders described below.
//
// Blocks of ATC_THREADS = 4 warps own ATC_BR = 64 rows (query rows in the forward and dq, key
// rows in dk/dv), 16 per warp: warp w computes the score tile of its 16 rows against the
// block's current tile of keys (or queries) in shared memory, applies the softmax step in
// registers (mma accumulator layout: lane = 4g + t holds rows g and g + 8, columns 2t, 2t + 1
// of every n8 tile), splits the probabilities into the three BF16 parts of an mma A fragment
// (the accumulator layout of two adjacent n8 tiles is the A layout of one k16 step) and adds
// its 16 rows x D of the output into registers. Every output element has one owner thread and
// its sums run in an order fixed by the shapes and offsets; no atomics, equal inputs give equal
// bits. Shared tiles hold the three BF16 planes [3][rows][ld] of a tile, ld = Dp + 8 with
// Dp = D rounded up to 16 (zero columns D..Dp add exact zeros; ld/8 odd: conflict-free
// ldmatrix); rows past the sequence are zero. Masked (causal) pairs get p = ds = 0, and k16
// steps whose pairs are all masked for the warp are skipped; inside a k16 step that straddles
// the diagonal a masked pair is multiplied as 0 times its value, so a non-finite key or value
// of a later row reaches the earlier rows of its 16-row diagonal step (the reference never
// reads it there: its own row is non-finite in both).
#define ATC_MAX_D 128
#define ATC_THREADS 128
#define ATC_BR 64

__device__ __forceinline__ u32 atc_saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void atc_ldsm4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(atc_saddr(p))
                 : "memory");
}
__device__ __forceinline__ void atc_ldsm4t(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(atc_saddr(p))
                 : "memory");
}
// Not volatile: the compiler may interleave independent tiles (each accumulator's products
// stay in program order through the data dependence).
__device__ __forceinline__ void atc_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d[base + n] += x.y for the 2 NP m16n8k16 tiles n (B registers of pair n / 2, half n % 2) from
// the parts: a[p] the A fragment of part p, b[n/2][p] the B registers of part p (b0, b1 of the
// pair's first tile, then of its second). Per tile the six products run smallest first (lo*hi,
// mid*mid, hi*lo, mid*hi, hi*mid, hi*hi); the loop over tiles is innermost, so consecutive
// mma are independent.
template <int NP, int N>
__device__ __forceinline__ void atc_mma6(float (&d)[N][4], int base, const u32 (&a)[3][4],
                                         const u32 (&b)[NP][3][4]) {
    constexpr int PA[6] = {2, 1, 0, 1, 0, 0}, PB[6] = {0, 1, 2, 0, 1, 0};
#pragma unroll
    for (int p = 0; p < 6; ++p)
#pragma unroll
        for (int n = 0; n < 2 * NP; ++n)
            atc_mma(d[base + n], a[PA[p]], b[n >> 1][PB[p]][2 * (n & 1)], b[n >> 1][PB[p]][2 * (n & 1) + 1]);
}

// bf16(lo) | bf16(hi) << 16, round to nearest even (cvt.rn.bf16x2.f32 puts its first source
// in the upper half): f32_to_bf16 of each for every non-NaN value (a NaN gives a NaN).
__device__ __forceinline__ u32 atc_cvt2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float atc_lo(u32 p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float atc_hi(u32 p) { return __uint_as_float(p & 0xFFFF0000u); }

// The three parts of two f32 values, packed as BF16 pairs (x in the low half): the parts of
// common.cuh's split_bf16x3 (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), each
// difference exact) for every non-NaN value.
__device__ __forceinline__ void atc_split2(float x, float y, u32& p0, u32& p1, u32& p2) {
    p0 = atc_cvt2(x, y);
    const float rx = __fsub_rn(x, atc_lo(p0)), ry = __fsub_rn(y, atc_hi(p0));
    p1 = atc_cvt2(rx, ry);
    p2 = atc_cvt2(__fsub_rn(rx, atc_lo(p1)), __fsub_rn(ry, atc_hi(p1)));
}

// A fragments (three parts) of the k16 step made of two accumulator tiles c0 (k 0..7) and c1
// (k 8..15) of a warp's 16-row score tile: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..).
__device__ __forceinline__ void atc_acc_to_a(u32 (&a)[3][4], const float (&c0)[4], const float (&c1)[4]) {
    atc_split2(c0[0], c0[1], a[0][0], a[1][0], a[2][0]);
    atc_split2(c0[2], c0[3], a[0][1], a[1][1], a[2][1]);
    atc_split2(c1[0], c1[1], a[0][2], a[1][2], a[2][2]);
    atc_split2(c1[2], c1[3], a[0][3], a[1][3], a[2][3]);
}

// Loads rows r0 .. r0+ROWS-1 (those < r_end; the rest zero) of the head slice `head_off` of a
// [*, row_stride] f32 matrix, split into the three planes of `tile` ([3][ROWS][ld] BF16),
// columns D..dp zero. Thread i of the block takes the column pairs i, i + ATC_THREADS, ... of
// a [ROWS][DMAX/2] pair grid (D even: a pair is entirely inside or outside the row; pairs at
// or past dp are not stored): every load is issued before the first split, so their latencies
// overlap. FULL: D == DMAX (no column guards).
template <int ROWS, int DMAX, bool FULL>
__device__ __forceinline__ void atc_load(u16* tile, u32 ld, const float* __restrict__ src, u64 base_row,
                                         u32 r0, u32 r_end, u64 row_stride, u64 head_off, u32 D, u32 dp) {
    constexpr u32 PAIRS = DMAX / 2, ITERS = ROWS * PAIRS / ATC_THREADS;
    static_assert((ROWS * PAIRS) % ATC_THREADS == 0, "the pair grid must fill the block");
    float x[ITERS], y[ITERS];
#pragma unroll
    for (u32 it = 0; it < ITERS; ++it) {
        const u32 idx = threadIdx.x + it * ATC_THREADS, rr = idx / PAIRS, c = 2u * (idx % PAIRS);
        const u32 r = r0 + rr;
        x[it] = 0.0f;
        y[it] = 0.0f;
        if (r < r_end && (FULL || c < D)) {
            const float* s = src + (base_row + r) * row_stride + head_off + c;
            x[it] = s[0];
            y[it] = s[1];
        }
    }
#pragma unroll
    for (u32 it = 0; it < ITERS; ++it) {
        const u32 idx = threadIdx.x + it * ATC_THREADS, rr = idx / PAIRS, c = 2u * (idx % PAIRS);
        if (FULL || c < dp) {
            u32 p0, p1, p2;
            atc_split2(x[it], y[it], p0, p1, p2);
            const u32 o = rr * ld + c;
            *reinterpret_cast<u32*>(tile + o) = p0;
            *reinterpret_cast<u32*>(tile + ROWS * ld + o) = p1;
            *reinterpret_cast<u32*>(tile + 2u * ROWS * ld + o) = p2;
        }
    }
}

// A fragments (three parts) of rows m0 .. m0+15, reduction kk .. kk+15 of a tile [3][nrows][ld]
// whose rows are the A rows (lane l supplies row m0 + l % 16 at kk + 8 (l / 16)).
__device__ __forceinline__ void atc_frag_a(u32 (&a)[3][4], const u16* tile, u32 nrows, u32 ld, u32 m0,
                                           u32 kk) {
    const u32 lane = threadIdx.x & 31;
    const u16* p = tile + (m0 + (lane & 15)) * ld + kk + 8u * (lane >> 4);
#pragma unroll
    for (int q = 0; q < 3; ++q) atc_ldsm4(a[q], p + q * nrows * ld);
}

// B registers (three parts) of two n8 tiles n0 .. n0+15, reduction kk .. kk+15: b[p] =
// {b0, b1 of tile n0, b0, b1 of tile n0 + 8}. NT: the tile's rows are the n index (reduction
// along the row, ldmatrix); TR: the rows are the reduction index (ldmatrix.trans).
__device__ __forceinline__ void atc_frag_b_nt(u32 (&b)[3][4], const u16* tile, u32 nrows, u32 ld, u32 n0,
                                              u32 kk) {
    const u32 lane = threadIdx.x & 31, i = lane >> 3, j = lane & 7;
    const u16* p = tile + (n0 + 8u * (i >> 1) + j) * ld + kk + 8u * (i & 1);
#pragma unroll
    for (int q = 0; q < 3; ++q) atc_ldsm4(b[q], p + q * nrows * ld);
}
__device__ __forceinline__ void atc_frag_b_tr(u32 (&b)[3][4], const u16* tile, u32 nrows, u32 ld, u32 n0,
                                              u32 kk) {
    const u32 lane = threadIdx.x & 31, i = lane >> 3, j = lane & 7;
    const u16* p = tile + (kk + 8u * (i & 1) + j) * ld + n0 + 8u * (i >> 1);
#pragma unroll
    for (int q = 0; q < 3; ++q) atc_ldsm4t(b[q], p + q * nrows * ld);
}

// c[nt] (n8 tiles nt < NT, columns n0 + 8 nt) = rows m0.. of A . rows of B^T over the
// reduction 0 .. dp (k16 steps < dp / 16), A and B both with the reduction along their rows.
// FULL: dp == DMAX (no guards: straight-line code the compiler can pipeline).
template <int NT, int DMAX, bool FULL>
__device__ __forceinline__ void atc_scores(float (&c)[NT][4], const u16* A, u32 arows, u32 m0, const u16* B,
                                           u32 brows, u32 ld, u32 dp) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DMAX / 16; ++ks) {
        if (FULL || 16u * ks < dp) {
            u32 a[3][4], b[NT / 2][3][4];
            atc_frag_a(a, A, arows, ld, m0, 16u * ks);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) atc_frag_b_nt(b[np], B, brows, ld, 16u * np, 16u * ks);
            atc_mma6<NT / 2>(c, 0, a, b);
        }
    }
}

// acc[nt] (columns 8 nt < dp) += P . X for the k16 step kk of a warp's probability tile (A
// parts a) and the tile X [3][xrows][ld] whose rows are the reduction index; four n8 tiles at a
// time (a pair at or past dp gets zero B registers: its tiles are never stored). FULL as in
// atc_scores.
template <int DMAX, bool FULL>
__device__ __forceinline__ void atc_wsum(float (&acc)[DMAX / 8][4], const u32 (&a)[3][4], const u16* X,
                                         u32 xrows, u32 ld, u32 kk, u32 dp) {
    static_assert(DMAX % 32 == 0, "four n8 tiles per step");
#pragma unroll
    for (int np = 0; np < DMAX / 16; np += 2) {
        if (FULL || 16u * np < dp) {
            u32 b[2][3][4];
            atc_frag_b_tr(b[0], X, xrows, ld, 16u * np, kk);
            if (FULL || 16u * (np + 1) < dp) {
                atc_frag_b_tr(b[1], X, xrows, ld, 16u * (np + 1), kk);
            } else {
#pragma unroll
                for (int q = 0; q < 3; ++q)
#pragma unroll
                    for (int e = 0; e < 4; ++e) b[1][q][e] = 0u;
            }
            atc_mma6<2>(acc, 2 * np, a, b);
        }
    }
}

// Max / sum over the 4 lanes of a quad (the lanes holding one accumulator row; xor 1 then 2).
__device__ __forceinline__ float atc_qmax(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
__device__ __forceinline__ float atc_qsum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

// Stores a warp's 16 x D accumulator rows (times `mul` unless mul == 1) to rows r0 + g and
// r0 + g + 8 (those < T) of `dst` (row stride `stride`, from `base`), columns < D.
template <int DMAX>
__device__ __forceinline__ void atc_store(float* __restrict__ dst, const float (&acc)[DMAX / 8][4], u64 base_row,
                                          u32 r0, u32 T, u64 stride, u64 head_off, u32 D, float mul,
                                          bool scaled) {
    const u32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const u32 r = r0 + g + 8u * hf;
        if (r < T) {
            float* row = dst + (base_row + r) * stride + head_off;
#pragma unroll
            for (int nt = 0; nt < DMAX / 8; ++nt) {
                const u32 c = 8u * nt + 2u * t;
                if (c < D) {
                    const float x = acc[nt][2 * hf], y = acc[nt][2 * hf + 1];
                    row[c] = scaled ? __fmul_rn(x, mul) : x;
                    row[c + 1] = scaled ? __fmul_rn(y, mul) : y;
                }
            }
        }
    }
}

// Training forward. Grid (B, hq, ceil(max_len / 64)), block ATC_THREADS; block (b, h, z) owns
// query rows row0 .. row0+63 (row0 = (gridDim.z - 1 - z) * 64: the longest rows first), warp w
// rows row0 + 16w ... Per key tile of BK keys kt < min(row0 + 64, T) (the warp skips tiles
// wholly after its rows): s = fl(q.k) * scale masked to j <= i, j < T (else -inf); per row the
// running max m (quad max), alpha = exp(m_old - m), p = exp(s - m), the thread's partial row
// sum l = l * alpha + (its p in column order), o = o * alpha + P V (k16 steps in key order).
// At the end l is the quad sum of the partials (xor 1 then 2), out = o / l, lse = m + log(l).
// Dynamic shared memory (BF16): 3 * ld * (64 + 2 * BK) (q, k, v planes).
template <int DMAX, int BK, bool FULL>
__device__ __forceinline__ void attn_fwd_tc_body(const float* __restrict__ q, const float* __restrict__ k,
                                                 const float* __restrict__ v, const u32* __restrict__ offsets,
                                                 float* __restrict__ out, float* __restrict__ lse, u32 hq,
                                                 u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    u16* sm = reinterpret_cast<u16*>(smem4);
    const u32 dp = (D + 15u) & ~15u, ld = dp + 8u;
    u16* qs = sm;
    u16* ks = qs + 3u * ATC_BR * ld;
    u16* vs = ks + 3u * BK * ld;
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = (gridDim.z - 1 - blockIdx.z) * ATC_BR;
    if (row0 >= T) return;  // block-uniform
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    atc_load<ATC_BR, DMAX, FULL>(qs, ld, q, t0, row0, T, qstride, (u64)h * D, D, dp);
    const u32 wr = row0 + 16u * w;  // the warp's first row
    const u32 ir[2] = {wr + g, wr + g + 8u};
    float o[DMAX / 8][4];
#pragma unroll
    for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] = 0.0f;
    float m[2] = {att_neg_inf(), att_neg_inf()}, l[2] = {0.0f, 0.0f};
    // Tile 0 holds key 0 <= i, 0 < T for every row of the block (rows past T included; they are
    // never stored): each row's max is finite from the first tile on.
    const u32 kend = min(row0 + ATC_BR, T);
    for (u32 kt = 0; kt < kend; kt += BK) {
        __syncthreads();  // the previous tile's products are done with k and v
        atc_load<BK, DMAX, FULL>(ks, ld, k, t0, kt, T, kstride, (u64)kh * D, D, dp);
        atc_load<BK, DMAX, FULL>(vs, ld, v, t0, kt, T, kstride, (u64)kh * D, D, dp);
        __syncthreads();
        if (kt > wr + 15u) continue;  // warp-uniform: every key after every row of the warp
        float s[BK / 8][4];
        atc_scores<BK / 8, DMAX, FULL>(s, qs, ATC_BR, 16u * w, ks, BK, ld, dp);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const u32 i = ir[hf];
            float mx = att_neg_inf();
#pragma unroll
            for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 j = kt + 8u * nt + 2u * t + e;
                    float& x = s[nt][2 * hf + e];
                    x = (j <= i && j < T) ? __fmul_rn(x, scale) : att_neg_inf();
                    mx = fmaxf(mx, x);
                }
            const float m_new = fmaxf(m[hf], atc_qmax(mx));
            const float alpha = expf(__fsub_rn(m[hf], m_new));  // 0 on the first tile
            float rs = 0.0f;
#pragma unroll
            for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[nt][2 * hf + e];
                    x = expf(__fsub_rn(x, m_new));  // masked: exp(-inf) = 0
                    rs = __fadd_rn(rs, x);
                }
            l[hf] = __fadd_rn(__fmul_rn(l[hf], alpha), rs);
            m[hf] = m_new;
#pragma unroll
            for (int nt = 0; nt < DMAX / 8; ++nt) {
                o[nt][2 * hf] = __fmul_rn(o[nt][2 * hf], alpha);
                o[nt][2 * hf + 1] = __fmul_rn(o[nt][2 * hf + 1], alpha);
            }
        }
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            if (kt + 16u * kk > wr + 15u) continue;  // every key after every row: p = 0
            u32 a[3][4];
            atc_acc_to_a(a, s[2 * kk], s[2 * kk + 1]);
            atc_wsum<DMAX, FULL>(o, a, vs, BK, ld, 16u * kk, dp);
        }
    }
    float lt[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) lt[hf] = atc_qsum(l[hf]);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const u32 i = ir[hf];
        if (i < T) {
            float* orow = out + (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
            for (int nt = 0; nt < DMAX / 8; ++nt) {
                const u32 c = 8u * nt + 2u * t;
                if (c < D) {
                    orow[c] = __fdiv_rn(o[nt][2 * hf], lt[hf]);
                    orow[c + 1] = __fdiv_rn(o[nt][2 * hf + 1], lt[hf]);
                }
            }
            if (t == 0) lse[(u64)(t0 + i) * hq + h] = __fadd_rn(m[hf], logf(lt[hf]));
        }
    }
}

// p = exp(s * scale - lse_i), ds = p * (dp - delta_i) for the pairs j <= i < T, both 0 for
// the others (s and dp replaced in place).
__device__ __forceinline__ void atc_pds(float& s, float& dp, bool ok, float scale, float lse_i, float del_i) {
    const float p = expf(__fsub_rn(__fmul_rn(s, scale), lse_i));
    const float ds = __fmul_rn(p, __fsub_rn(dp, del_i));
    s = ok ? p : 0.0f;
    dp = ok ? ds : 0.0f;
}

// Instantiations (suffix: the largest D; the tile of keys / queries per step second; a
// straight-line body when D is the largest, a guarded one below). The second launch bound is
// the blocks per SM the shared memory allows at the largest D.
#define ATC_FWD_CALL(DM, BK)                                                                       \
    if (D == DM)                                                                                  \
        attn_fwd_tc_body<DM, BK, true>(q, k, v, offsets, out, lse, hq, hkv, D, scale);             \
    else                                                                                          \
        attn_fwd_tc_body<DM, BK, false>(q, k, v, offsets, out, lse, hq, hkv, D, scale)
extern "C" __global__ void __launch_bounds__(ATC_THREADS, 2) attn_fwd_tc_64(ATT_FWD_ARGS) {
    ATC_FWD_CALL(64, 64);
}
extern "C" __global__ void __launch_bounds__(ATC_THREADS, 2) attn_fwd_tc_128(ATT_FWD_ARGS) {
    ATC_FWD_CALL(128, 32);
}
// ---- Tensor-core backward on BF16 planes ----
//
// The backward splits q, dout, k and v once per call (attn_split_planes) into BF16 planes
// [3][N][H][dp] (part, row, head, column; dp = D rounded up to 16, columns D..dp zero) in the
// launcher's scratch, and the dq / dk,dv kernels copy tiles of those planes into shared memory
// with cp.async (16-byte copies, rows past the sequence zero-filled), the streamed tiles double
// buffered: the next tile's copies are in flight while the current one is multiplied. The
// parts and the part products are those of the kernels above (atc_split2 is the split in both).
// Blocks of ATC_BWD_THREADS = 8 warps own 64 rows: warp w takes rows 16 (w % 4) .. + 15 of the
// block and the half hs = w / 4 of each streamed tile of ATC_BT = 32 keys (dq) or queries
// (dk/dv), i.e. its k16 step hs. Each output element is thus the sum of two partial sums (the
// steps of half 0 and those of half 1, each in increasing order), added once at the end
// through shared memory: partial(half 0) + partial(half 1) (f32 addition, commutative, so the
// bits do not depend on which warp adds). Fixed order, no atomics; the reduction length and
// the part products are unchanged, so AttnSums::Bf16x3Mma bounds the sums as before.
#define ATC_BWD_THREADS 256
#define ATC_BT 32

// planes[((p * rows + r) * H + h) * dp + c] = part p of x[r, h*D + c] (0 for c >= D), for
// r < rows, h < H, c < dp (p = 0, 1, 2: hi, mid, lo of atc_split2). One thread per column pair,
// grid-stride.
extern "C" __global__ void attn_split_planes(const float* __restrict__ x, u16* __restrict__ planes, u64 rows,
                                             u32 H, u32 D, u32 dp) {
    const u64 half = dp >> 1, total = rows * H * half, plane = rows * H * dp;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (u64)gridDim.x * blockDim.x) {
        const u64 rh = idx / half;
        const u32 c = 2u * (u32)(idx - rh * half);
        float x0 = 0.0f, x1 = 0.0f;
        if (c < D) {
            x0 = x[rh * D + c];
            x1 = x[rh * D + c + 1];
        }
        u32 p0, p1, p2;
        atc_split2(x0, x1, p0, p1, p2);
        u16* o = planes + rh * dp + c;
        *reinterpret_cast<u32*>(o) = p0;
        *reinterpret_cast<u32*>(o + plane) = p1;
        *reinterpret_cast<u32*>(o + 2u * plane) = p2;
    }
}

__device__ __forceinline__ void atc_cp16(u16* dst, const u16* src, bool ok) {
    const u32 n = ok ? 16u : 0u;  // src-size 0: nothing is read, the 16 bytes are zeroed
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(atc_saddr(dst)), "l"(src), "r"(n)
                 : "memory");
}
__device__ __forceinline__ void atc_cp4(float* dst, const float* src, bool ok) {
    const u32 n = ok ? 4u : 0u;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(atc_saddr(dst)), "l"(src), "r"(n)
                 : "memory");
}
__device__ __forceinline__ void atc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void atc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Issues the cp.async copies of rows r0 .. r0+ROWS-1 (those < r_end; the rest zero-filled) of
// head h of a plane set [3][rows][H][dp] (plane = rows * H * dp elements; row r of the
// sequence at base_row + r) into `tile` ([3][ROWS][ld]), columns 0 .. dp (FULL: dp == DMAX).
// Thread i of the block takes the 16-byte chunks i, i + ATC_BWD_THREADS, ... of a
// [3][ROWS][DMAX/8] grid.
template <int ROWS, int DMAX, bool FULL>
__device__ __forceinline__ void atc_cp_tile(u16* tile, u32 ld, const u16* __restrict__ planes, u64 plane,
                                            u64 base_row, u32 r0, u32 r_end, u32 H, u32 h, u32 dp) {
    constexpr u32 CPR = DMAX / 8, PER_PLANE = ROWS * CPR, ITERS = 3 * PER_PLANE / ATC_BWD_THREADS;
    static_assert((3 * PER_PLANE) % ATC_BWD_THREADS == 0, "the chunk grid must fill the block");
#pragma unroll
    for (u32 it = 0; it < ITERS; ++it) {
        const u32 idx = threadIdx.x + it * ATC_BWD_THREADS, p = idx / PER_PLANE, rem = idx % PER_PLANE;
        const u32 rr = rem / CPR, c = 8u * (rem % CPR), r = r0 + rr;
        if (FULL || c < dp) {
            const bool ok = r < r_end;
            const u16* src = ok ? planes + p * plane + ((base_row + r) * H + h) * dp + c : planes;
            atc_cp16(tile + (p * ROWS + rr) * ld + c, src, ok);
        }
    }
}

// Adds the two halves' partial sums of a warp pair (warps w and w + 4: same rows) and stores
// them: the warp of half hs writes its partial of the columns the other half stores
// (n8 tiles [lo, hi) of the other half) to `xbuf`, then, after the barrier, adds the partner's
// partial of its own columns: own + partner (commutative: the same bits in both warps' order).
// The caller has passed a __syncthreads() after the last use of the shared memory under xbuf.
template <int DMAX>
__device__ __forceinline__ void atc_pair_sum(float (&acc)[DMAX / 8][4], float* xbuf, u32 lo, u32 hi) {
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float* mine = xbuf + w * (DMAX * 8);  // [DMAX/16 n8 tiles * 4][32] per warp
    float* theirs = xbuf + (w ^ 4u) * (DMAX * 8);
    int slot = 0;
#pragma unroll
    for (int nt = 0; nt < DMAX / 8; ++nt)
        if (!(nt >= (int)lo && nt < (int)hi)) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(slot * 4 + e) * 32 + lane] = acc[nt][e];
            ++slot;
        }
    __syncthreads();
    slot = 0;
#pragma unroll
    for (int nt = 0; nt < DMAX / 8; ++nt)
        if (nt >= (int)lo && nt < (int)hi) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = __fadd_rn(acc[nt][e], theirs[(slot * 4 + e) * 32 + lane]);
            ++slot;
        }
}

// dq. Grid (B, hq, ceil(max_len / 64)), block ATC_BWD_THREADS; block (b, h, z) owns query rows
// row0 .. row0+63 (row0 = (gridDim.z - 1 - z) * 64: the longest rows first), warp w rows
// row0 + 16 (w % 4) .., half hs = w / 4. Per key tile of ATC_BT keys kt < min(row0 + 64, T)
// the warp takes keys kt + 16 hs .. + 15 (skipped when all after its rows): S = Q K^T,
// dP = dO V^T, p and ds (atc_pds), dq += dS K (its k16 steps in key order); at the end
// dq = scale * (partial(half 0) + partial(half 1)). Planes of q, dout [3][N][hq][dp], of k, v
// [3][N][hkv][dp] (attn_split_planes). Dynamic shared memory (BF16): 3 * ld * (2 * 64 +
// 4 * ATC_BT) (q, dout planes, then two stages of k, v planes).
template <int DMAX, bool FULL>
__device__ __forceinline__ void attn_bwd_dq_tcp_body(const u16* __restrict__ qp, const u16* __restrict__ dop,
                                                     const u16* __restrict__ kp, const u16* __restrict__ vp,
                                                     const float* __restrict__ lse,
                                                     const float* __restrict__ delta,
                                                     const u32* __restrict__ offsets, float* __restrict__ dq,
                                                     u64 n, u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    u16* sm = reinterpret_cast<u16*>(smem4);
    const u32 dp = (D + 15u) & ~15u, ld = dp + 8u;
    u16* qs = sm;
    u16* dos = qs + 3u * ATC_BR * ld;
    u16* st = dos + 3u * ATC_BR * ld;  // stage s: k planes at st + s * 6 * BT * ld, v after
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = (gridDim.z - 1 - blockIdx.z) * ATC_BR;
    if (row0 >= T) return;  // block-uniform
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, wg = w & 3u, hs = w >> 2, t = lane & 3;
    const u32 g = lane >> 2;
    const u32 kh = h / (hq / hkv);
    const u64 qplane = n * hq * dp, kplane = n * hkv * dp;
    atc_cp_tile<ATC_BR, DMAX, FULL>(qs, ld, qp, qplane, t0, row0, T, hq, h, dp);
    atc_cp_tile<ATC_BR, DMAX, FULL>(dos, ld, dop, qplane, t0, row0, T, hq, h, dp);
    const u32 kend = min(row0 + ATC_BR, T), ntiles = (kend + ATC_BT - 1u) / ATC_BT;
    const u32 stage = 6u * ATC_BT * ld;
    auto issue = [&](u32 s) {
        u16* kd = st + (s & 1u) * stage;
        atc_cp_tile<ATC_BT, DMAX, FULL>(kd, ld, kp, kplane, t0, s * ATC_BT, T, hkv, kh, dp);
        atc_cp_tile<ATC_BT, DMAX, FULL>(kd + 3u * ATC_BT * ld, ld, vp, kplane, t0, s * ATC_BT, T, hkv, kh, dp);
    };
    issue(0);
    atc_cp_commit();  // q, dout and the first key tile
    const u32 wr = row0 + 16u * wg;
    const u32 ir[2] = {wr + g, wr + g + 8u};
    float lse_r[2], del_r[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        lse_r[hf] = ir[hf] < T ? lse[(u64)(t0 + ir[hf]) * hq + h] : 0.0f;
        del_r[hf] = ir[hf] < T ? delta[(u64)(t0 + ir[hf]) * hq + h] : 0.0f;
    }
    float acc[DMAX / 8][4];
#pragma unroll
    for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;
    for (u32 s = 0; s < ntiles; ++s) {
        if (s + 1u < ntiles) issue(s + 1u);
        atc_cp_commit();  // possibly empty: one group per step keeps the count uniform
        atc_cp_wait<1>();
        __syncthreads();  // tile s visible to every warp
        const u32 kt = s * ATC_BT + 16u * hs;  // the warp's first key
        if (kt <= wr + 15u) {  // warp-uniform: else every key after every row of the warp
            const u16* kst = st + (s & 1u) * stage;
            const u16* vst = kst + 3u * ATC_BT * ld;
            float sc[2][4], dpv[2][4];
            atc_scores<2, DMAX, FULL>(sc, qs, ATC_BR, 16u * wg, kst + 16u * hs * ld, ATC_BT, ld, dp);
            atc_scores<2, DMAX, FULL>(dpv, dos, ATC_BR, 16u * wg, vst + 16u * hs * ld, ATC_BT, ld, dp);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32 j = kt + 8u * nt + 2u * t + e, i = ir[hf];
                        atc_pds(sc[nt][2 * hf + e], dpv[nt][2 * hf + e], j <= i && i < T, scale, lse_r[hf],
                                del_r[hf]);
                    }
            u32 a[3][4];
            atc_acc_to_a(a, dpv[0], dpv[1]);
            atc_wsum<DMAX, FULL>(acc, a, kst, ATC_BT, ld, 16u * hs, dp);
        }
        __syncthreads();  // every warp is done with stage s & 1 before it is refilled
    }
    atc_cp_wait<0>();
    // The stages are free (barrier above): exchange the halves' partials there.
    atc_pair_sum<DMAX>(acc, reinterpret_cast<float*>(st), hs * (DMAX / 16), (hs + 1u) * (DMAX / 16));
    // Half hs stores the n8 tiles [hs * DMAX/16, (hs + 1) * DMAX/16).
    const u64 qstride = (u64)hq * D;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const u32 r = wr + g + 8u * hf;
        if (r < T) {
            float* row = dq + (u64)(t0 + r) * qstride + (u64)h * D;
#pragma unroll
            for (int nt = 0; nt < DMAX / 8; ++nt) {
                const u32 c = 8u * nt + 2u * t;
                if ((u32)nt / (DMAX / 16) == hs && c < D) {
                    row[c] = __fmul_rn(acc[nt][2 * hf], scale);
                    row[c + 1] = __fmul_rn(acc[nt][2 * hf + 1], scale);
                }
            }
        }
    }
}

// dk, dv. Grid (B, hkv, ceil(max_len / 64)), block ATC_BWD_THREADS; block (b, kh, z) owns key
// rows j0 .. j0+63 (j0 = z * 64), warp w keys j0 + 16 (w % 4) .., half hs = w / 4. It walks
// the group's query heads in increasing order and, per head, query tiles of ATC_BT queries
// it = j0, j0 + ATC_BT, .. < T; the warp takes queries it + 16 hs .. + 15 (skipped when all
// before its keys or past T): S^T = K Q^T, dP^T = V dO^T, p and ds (atc_pds with lse and
// delta of the query), dv += P^T dO, dk += dS^T Q (its k16 steps in (head, query) order); at
// the end dv = partial(half 0) + partial(half 1) (half 1 stores it), dk = scale * (the same
// sum of the dk partials) (half 0 stores it). Dynamic shared memory: BF16 3 * ld * (2 * 64 +
// 4 * ATC_BT) (k, v planes, then two stages of q, dout planes), then f32 2 * 2 * ATC_BT (the
// stages' lse, delta).
template <int DMAX, bool FULL>
__device__ __forceinline__ void attn_bwd_dkdv_tcp_body(const u16* __restrict__ qp, const u16* __restrict__ dop,
                                                       const u16* __restrict__ kp, const u16* __restrict__ vp,
                                                       const float* __restrict__ lse,
                                                       const float* __restrict__ delta,
                                                       const u32* __restrict__ offsets, float* __restrict__ dk,
                                                       float* __restrict__ dv, u64 n, u32 hq, u32 hkv, u32 D,
                                                       float scale) {
    extern __shared__ float4 smem4[];
    u16* sm = reinterpret_cast<u16*>(smem4);
    const u32 dp = (D + 15u) & ~15u, ld = dp + 8u;
    u16* ks = sm;
    u16* vs = ks + 3u * ATC_BR * ld;
    u16* st = vs + 3u * ATC_BR * ld;  // stage s: q planes at st + s * 6 * BT * ld, dout after
    float* lsd = reinterpret_cast<float*>(st + 12u * ATC_BT * ld);  // [2][lse, delta][BT]
    const u32 b = blockIdx.x, kh = blockIdx.y;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 j0 = blockIdx.z * ATC_BR;
    if (j0 >= T) return;  // block-uniform
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5, wg = w & 3u, hs = w >> 2, t = lane & 3;
    const u32 g = lane >> 2;
    const u32 gq = hq / hkv;
    const u64 qplane = n * hq * dp, kplane = n * hkv * dp;
    atc_cp_tile<ATC_BR, DMAX, FULL>(ks, ld, kp, kplane, t0, j0, T, hkv, kh, dp);
    atc_cp_tile<ATC_BR, DMAX, FULL>(vs, ld, vp, kplane, t0, j0, T, hkv, kh, dp);
    const u32 ntiles = (T - j0 + ATC_BT - 1u) / ATC_BT, nsteps = gq * ntiles;
    const u32 stage = 6u * ATC_BT * ld;
    auto issue = [&](u32 s) {
        const u32 hh = s / ntiles, it = j0 + (s - hh * ntiles) * ATC_BT, h = kh * gq + hh;
        u16* qd = st + (s & 1u) * stage;
        atc_cp_tile<ATC_BT, DMAX, FULL>(qd, ld, qp, qplane, t0, it, T, hq, h, dp);
        atc_cp_tile<ATC_BT, DMAX, FULL>(qd + 3u * ATC_BT * ld, ld, dop, qplane, t0, it, T, hq, h, dp);
        if (threadIdx.x < 2u * ATC_BT) {
            const u32 r = it + (threadIdx.x % ATC_BT);
            const bool ok = r < T;
            const float* src = threadIdx.x < ATC_BT ? lse : delta;
            atc_cp4(lsd + (s & 1u) * 2u * ATC_BT + threadIdx.x, ok ? src + (u64)(t0 + r) * hq + h : src, ok);
        }
    };
    issue(0);
    atc_cp_commit();  // k, v and the first query tile
    const u32 wj = j0 + 16u * wg;  // the warp's first key
    const u32 jr[2] = {wj + g, wj + g + 8u};
    float adk[DMAX / 8][4], adv[DMAX / 8][4];
#pragma unroll
    for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            adk[nt][e] = 0.0f;
            adv[nt][e] = 0.0f;
        }
    for (u32 s = 0; s < nsteps; ++s) {
        if (s + 1u < nsteps) issue(s + 1u);
        atc_cp_commit();  // possibly empty: one group per step keeps the count uniform
        atc_cp_wait<1>();
        __syncthreads();  // tile s visible to every warp
        const u32 hh = s / ntiles, i0 = j0 + (s - hh * ntiles) * ATC_BT + 16u * hs;  // the warp's first query
        // Warp-uniform: else every query before every key of the warp, or past the sequence.
        if (i0 + 15u >= wj && i0 < T) {
            const u16* qst = st + (s & 1u) * stage;
            const u16* dost = qst + 3u * ATC_BT * ld;
            const float* ls = lsd + (s & 1u) * 2u * ATC_BT + 16u * hs;
            float sc[2][4], dpv[2][4];
            atc_scores<2, DMAX, FULL>(sc, ks, ATC_BR, 16u * wg, qst + 16u * hs * ld, ATC_BT, ld, dp);
            atc_scores<2, DMAX, FULL>(dpv, vs, ATC_BR, 16u * wg, dost + 16u * hs * ld, ATC_BT, ld, dp);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 ii = 8u * nt + 2u * t + e, i = i0 + ii;
                    const float li = ls[ii], di = ls[ATC_BT + ii];
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
                        atc_pds(sc[nt][2 * hf + e], dpv[nt][2 * hf + e], i >= jr[hf] && i < T, scale, li, di);
                }
            u32 a[3][4];
            atc_acc_to_a(a, sc[0], sc[1]);
            atc_wsum<DMAX, FULL>(adv, a, dost, ATC_BT, ld, 16u * hs, dp);
            atc_acc_to_a(a, dpv[0], dpv[1]);
            atc_wsum<DMAX, FULL>(adk, a, qst, ATC_BT, ld, 16u * hs, dp);
        }
        __syncthreads();  // every warp is done with stage s & 1 before it is refilled
    }
    atc_cp_wait<0>();
    // Exchange through the (now free) k, v planes: half 0 hands its dv partial to half 1,
    // half 1 its dk partial to half 0; each adds the partner's partial to its own.
    float* xbuf = reinterpret_cast<float*>(sm);
    float* mine = xbuf + w * (DMAX * 16);  // [DMAX/8 * 4][32] per warp
    const float* theirs = xbuf + (w ^ 4u) * (DMAX * 16);
    const u64 kstride = (u64)hkv * D;
    if (hs == 0) {
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 32 + lane] = adv[nt][e];
    } else {
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 32 + lane] = adk[nt][e];
    }
    __syncthreads();
    if (hs == 0) {
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) adk[nt][e] = __fadd_rn(adk[nt][e], theirs[(nt * 4 + e) * 32 + lane]);
        atc_store<DMAX>(dk, adk, t0, wj, T, kstride, (u64)kh * D, D, scale, true);
    } else {
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) adv[nt][e] = __fadd_rn(adv[nt][e], theirs[(nt * 4 + e) * 32 + lane]);
        atc_store<DMAX>(dv, adv, t0, wj, T, kstride, (u64)kh * D, D, 1.0f, false);
    }
}

// Instantiations of the plane kernels (suffix: the largest D; a straight-line body when D is
// the largest, a guarded one below). The second launch bound is the blocks per SM the shared
// memory allows at the largest D.
#define ATC_PL_DQ_ARGS                                                                             \
    const u16 *__restrict__ qp, const u16 *__restrict__ dop, const u16 *__restrict__ kp,           \
        const u16 *__restrict__ vp, const float *__restrict__ lse, const float *__restrict__ delta, \
        const u32 *__restrict__ offsets, float *__restrict__ dq, u64 n, u32 hq, u32 hkv, u32 D,     \
        float scale
#define ATC_PL_DKDV_ARGS                                                                           \
    const u16 *__restrict__ qp, const u16 *__restrict__ dop, const u16 *__restrict__ kp,           \
        const u16 *__restrict__ vp, const float *__restrict__ lse, const float *__restrict__ delta, \
        const u32 *__restrict__ offsets, float *__restrict__ dk, float *__restrict__ dv, u64 n,     \
        u32 hq, u32 hkv, u32 D, float scale
#define ATC_PL_DQ_CALL(DM)                                                                         \
    if (D == DM)                                                                                  \
        attn_bwd_dq_tcp_body<DM, true>(qp, dop, kp, vp, lse, delta, offsets, dq, n, hq, hkv, D, scale); \
    else                                                                                          \
        attn_bwd_dq_tcp_body<DM, false>(qp, dop, kp, vp, lse, delta, offsets, dq, n, hq, hkv, D, scale)
#define ATC_PL_DKDV_CALL(DM)                                                                       \
    if (D == DM)                                                                                  \
        attn_bwd_dkdv_tcp_body<DM, true>(qp, dop, kp, vp, lse, delta, offsets, dk, dv, n, hq, hkv, D, \
                                         scale);                                                  \
    else                                                                                          \
        attn_bwd_dkdv_tcp_body<DM, false>(qp, dop, kp, vp, lse, delta, offsets, dk, dv, n, hq, hkv, D, \
                                          scale)
extern "C" __global__ void __launch_bounds__(ATC_BWD_THREADS, 2) attn_bwd_dq_tc_64(ATC_PL_DQ_ARGS) {
    ATC_PL_DQ_CALL(64);
}
extern "C" __global__ void __launch_bounds__(ATC_BWD_THREADS, 1) attn_bwd_dq_tc_128(ATC_PL_DQ_ARGS) {
    ATC_PL_DQ_CALL(128);
}
extern "C" __global__ void __launch_bounds__(ATC_BWD_THREADS, 2) attn_bwd_dkdv_tc_64(ATC_PL_DKDV_ARGS) {
    ATC_PL_DKDV_CALL(64);
}
extern "C" __global__ void __launch_bounds__(ATC_BWD_THREADS, 1) attn_bwd_dkdv_tc_128(ATC_PL_DKDV_ARGS) {
    ATC_PL_DKDV_CALL(128);
}

// delta[r, h] = sum_d dout[r, h*D + d] * out[r, h*D + d] for r < n, h < hq: one warp per (r, h).
// Grid ceil(n*hq / ATT_WARPS), block ATT_WARPS*32.
extern "C" __global__ void attn_bwd_delta(const float* __restrict__ dout, const float* __restrict__ out,
                                          float* __restrict__ delta, u64 n, u32 hq, u32 D) {
    const u64 idx = (u64)blockIdx.x * ATT_WARPS + (threadIdx.x >> 5);
    if (idx >= n * hq) return;  // warp-uniform
    const u32 lane = threadIdx.x & 31;
    const u64 base = idx * D;  // row r, head h at (r*hq + h)*D
    float acc = 0.0f;
    for (u32 d = lane; d < D; d += 32) acc = __fadd_rn(acc, __fmul_rn(dout[base + d], out[base + d]));
    acc = warp_sum(acc);
    if (lane == 0) delta[idx] = acc;
}


// KV-cache append: for b < B and e < hkv*D, with pos = lens[b] - 1:
// kc[b, pos, e] = bf16(k_new[b, e]), vc likewise (round to nearest even). Caches are
// [slots, max_len, hkv*D] BF16 bit patterns; slot b is sequence b. lens[b] == 0 or
// lens[b] > max_len writes nothing.
extern "C" __global__ void kv_append(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                     u16* __restrict__ kc, u16* __restrict__ vc,
                                     const u32* __restrict__ lens, u32 B, u32 row, u32 max_len) {
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)B * row) return;
    const u32 b = (u32)(idx / row), e = (u32)(idx - (u64)b * row);
    const u32 len = lens[b];
    if (len == 0 || len > max_len) return;
    const u64 o = ((u64)b * max_len + (len - 1)) * row + e;
    kc[o] = f32_to_bf16(k_new[idx]);
    vc[o] = f32_to_bf16(v_new[idx]);
}

// Decode, pass 1. Grid (B, Hkv, nsplit), ATT_DEC_WARPS warps (128 threads). Block (b, kh, s)
// covers keys s*CHUNK .. min(len_b, (s+1)*CHUNK) of slot b for the query heads of kv head kh,
// ATT_DEC_G heads per pass. The chunk's K rows are staged in shared memory as BF16 pairs with
// a row stride of D/2 + 1 words (32 lanes reading one word of 32 different keys hit 32 banks),
// its V rows unpadded (both read with 16-byte loads, several rows in flight, when D % 8 == 0
// and the rows are 16-byte aligned; else word loads), the pass's query rows as f32 pairs [D/2][ATT_DEC_G] (the pairs of 4
// heads in two 16-byte reads), the scores [CHUNK][ATT_DEC_G]. Scores: thread t takes key
// t % 64 and heads 4*(t / 64) .. +4 of the pass; each dot is one chain of fused multiply-adds
// over d in index order, s = fl(dot)*scale. Softmax: warp w takes heads w, w + ATT_DEC_WARPS,
// ...; lane l owns the chunk's keys l and l + 32 for the max m and the sum l of exp(s - m)
// (butterflies, fixed order). Weighted sums: thread t owns column pair t % (D/2) of a run of
// consecutive heads (the 128 / (D/2) groups of threads split the pass's heads), one chain of
// fused multiply-adds per column over the keys in index order. Writes the chunk's m, l and
// unnormalized o = sum exp(s - m) v to part_m, part_l: [B, hq, nsplit] and part_o:
// [B, hq, nsplit, D]. Blocks past the sequence's end write nothing. With nsplit == 1 (max_len
// <= CHUNK) no partial is written: the block writes out = o / l, the bits the combine of one
// chunk gives (zeros for len == 0, NaN for len > max_len), and the combine is not launched.
// Dynamic shared memory (bytes): 4*(ATT_DEC_G*D + ATT_DEC_G*CHUNK + CHUNK*(D/2 + 1) + CHUNK*D/2
// + 2*ATT_DEC_G).
// Needs D even and the caches 4-byte aligned (the launcher checks).
// The decode output: f32 into out, or (outb not null) its BF16 rounding alone into outb, the
// bits to_bf16 gives (a BF16 linear reads nothing else).
__device__ __forceinline__ void att_dec_store(float* out, u16* outb, u64 i, float v) {
    if (outb != nullptr) outb[i] = f32_to_bf16(v);
    else out[i] = v;
}
#if ATT_DEC_CHUNK != 64 || ATT_DEC_WARPS != 4 || ATT_DEC_G != 8 || ATT_MAX_D > 256
#error "attn_decode_partial: 128 threads = 64 keys x 2 groups of 4 heads; two keys per lane"
#endif
#define ATT_DEC_THREADS (ATT_DEC_WARPS * 32)
// Rows of K and of V a thread loads before storing them (16-byte loads).
#define ATT_DEC_LOADS 8
// The fused kernel's own inputs (attn_decode_fused); all null / 0 in attn_decode_partial.
struct AttDecPrep {
    const float* q_raw;  // [B, hq·D]: the q rows before their norm and rotation
    const float* k_raw;  // [B, hkv·D]: the new k rows, likewise
    const float* v_new;  // [B, hkv·D]: the new v rows
    const float* wq;     // q / k RMSNorm weights [D] (both null: no norm)
    const float* wk;
    float eps;
    const float* cos_t;  // RoPE table [max_pos, D/2]
    const float* sin_t;
    const u32* pos;      // [B]: the new row's position
    u32 max_pos;
    u16* kc;             // the caches, written at [b, len - 1, kh]
    u16* vc;
};

template <int NW>
__device__ __forceinline__ void attn_decode_body(const float* __restrict__ q, const u16* kc, const u16* vc,
                                                 const u32* __restrict__ lens, float* __restrict__ part_m,
                                                 float* __restrict__ part_l, float* __restrict__ part_o,
                                                 float* __restrict__ out, u16* __restrict__ outb, u32 hq, u32 hkv,
                                                 u32 D, u32 max_len, float scale, const AttDecPrep& pr) {
    constexpr bool FUSED = NW > 0;
    extern __shared__ float4 smem4[];
    const u32 half = D >> 1, kst = half + 1;
    float* qs = reinterpret_cast<float*>(smem4);       // [D/2][ATT_DEC_G] pairs
    float* ss = qs + ATT_DEC_G * D;                     // [CHUNK][ATT_DEC_G]
    u32* ks = reinterpret_cast<u32*>(ss + ATT_DEC_G * ATT_DEC_CHUNK);  // [CHUNK][kst]
    u32* vs = ks + ATT_DEC_CHUNK * kst;                 // [CHUNK][half]
    float* sl = reinterpret_cast<float*>(vs + ATT_DEC_CHUNK * half);  // [2][ATT_DEC_G]: l, m
    const u32 b = blockIdx.x, kh = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const u32 len = lens[b];
    const u32 tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const u32 g = hq / hkv;
    // One chunk (nsplit == 1): this block writes the output itself, as the combine would.
    const bool direct = nsplit == 1;
    if (direct && (len == 0 || len > max_len)) {
        const float f = len == 0 ? 0.0f : att_nan();
        for (u32 i = tid; i < g * D; i += ATT_DEC_THREADS) att_dec_store(out, outb, ((u64)b * hq + (u64)kh * g) * D + i, f);
        return;
    }
    if (len > max_len) return;  // the combine writes NaN for this sequence
    const u32 k0 = split * ATT_DEC_CHUNK;
    if (k0 >= len) return;
    const u32 jn = min(len - k0, (u32)ATT_DEC_CHUNK);
    // Fused: the loads of the first pass's query heads (warp w: head w) and, in the chunk
    // holding the new position (len - 1), of the new k row (the last warp) are issued before
    // the chunk is staged; their norm and rotation (decode_prep_finish: decode_attn_prep's
    // bits) come after.
    constexpr int PW = NW > 0 ? NW : 2;
    constexpr int HW = PW / 2;
    constexpr u32 K_WARP = ATT_DEC_WARPS - 1;
    const bool appends = FUSED && len - 1 - k0 < (u32)ATT_DEC_CHUNK;
    DecodePrepRow<PW> qpre, kpre;
    if constexpr (FUSED) {
        const u32 p = pr.pos[b];
        if (w < min(g, (u32)ATT_DEC_G))
            decode_prep_load<PW>(pr.q_raw + ((u64)b * hq + (u64)kh * g + w) * D, pr.wq, D, pr.cos_t, pr.sin_t, p,
                                 pr.max_pos, qpre);
        if (appends && w == K_WARP)
            decode_prep_load<PW>(pr.k_raw + ((u64)b * hkv + kh) * D, pr.wk, D, pr.cos_t, pr.sin_t, p, pr.max_pos,
                                 kpre);
    }
    const u64 row32 = ((u64)hkv * D) >> 1;  // words per cache position (D even)
    // Weighted sums: this thread's column pair and group of heads (half <= 128).
    const u32 ngrp = ATT_DEC_THREADS / half, vcol = tid % half, vgrp = tid / half;
    {
        const u64 base = ((u64)b * max_len + k0) * row32 + (u64)kh * half;
        const u32* k32 = reinterpret_cast<const u32*>(kc) + base;
        const u32* v32 = reinterpret_cast<const u32*>(vc) + base;
        if ((half & 3u) == 0 && ((reinterpret_cast<u64>(k32) | reinterpret_cast<u64>(v32)) & 15u) == 0) {
            // 16-byte loads (row32 is then a multiple of 4 words too), up to ATT_DEC_LOADS rows
            // of K and of V in flight per thread before any is stored.
            const u32 q4 = half >> 2, rgrp = ATT_DEC_THREADS / q4, c4 = tid % q4, r0 = tid / q4;
            for (u32 jb = r0; jb < jn; jb += ATT_DEC_LOADS * rgrp) {
                uint4 kv4[ATT_DEC_LOADS], vv4[ATT_DEC_LOADS];
#pragma unroll
                for (u32 i = 0; i < ATT_DEC_LOADS; ++i) {
                    const u32 j = jb + i * rgrp;
                    if (j < jn) {
                        kv4[i] = reinterpret_cast<const uint4*>(k32 + (u64)j * row32)[c4];
                        vv4[i] = reinterpret_cast<const uint4*>(v32 + (u64)j * row32)[c4];
                    }
                }
#pragma unroll
                for (u32 i = 0; i < ATT_DEC_LOADS; ++i) {
                    const u32 j = jb + i * rgrp;
                    if (j < jn) {
                        u32* kd = ks + j * kst + 4 * c4;  // padded rows: four word stores
                        kd[0] = kv4[i].x;
                        kd[1] = kv4[i].y;
                        kd[2] = kv4[i].z;
                        kd[3] = kv4[i].w;
                        reinterpret_cast<uint4*>(vs + j * half)[c4] = vv4[i];
                    }
                }
            }
        } else if (vgrp < ngrp) {
#pragma unroll 4
            for (u32 j = vgrp; j < jn; j += ngrp) {
                ks[j * kst + vcol] = k32[(u64)j * row32 + vcol];
                vs[j * half + vcol] = v32[(u64)j * row32 + vcol];
            }
        }
    }
    if constexpr (FUSED) {
        // The new row into the cache (kv_append's bytes) and over its staged copy (what was
        // read from the cache before it was written).
        if (appends) {
            __syncthreads();  // staging done: nothing rewrites the row after this
            const u32 jl = len - 1 - k0;
            const u64 o = ((u64)b * max_len + (len - 1)) * ((u64)hkv * D) + (u64)kh * D;
            u16* krow = reinterpret_cast<u16*>(ks + jl * kst);
            u16* vrow = reinterpret_cast<u16*>(vs + jl * half);
            if (w == K_WARP) {
                float klo[HW], khi[HW];
                decode_prep_finish<PW>(kpre, pr.eps, D, klo, khi);
#pragma unroll
                for (int i = 0; i < HW; ++i) {
                    const u32 d = 32 * i + lane;
                    const u16 lo = f32_to_bf16(klo[i]), hi = f32_to_bf16(khi[i]);
                    pr.kc[o + d] = lo;
                    pr.kc[o + d + half] = hi;
                    krow[d] = lo;
                    krow[d + half] = hi;
                }
            }
            const float* vr = pr.v_new + ((u64)b * hkv + kh) * D;
            for (u32 d = tid; d < D; d += ATT_DEC_THREADS) {
                const u16 x = f32_to_bf16(vr[d]);
                pr.vc[o + d] = x;
                vrow[d] = x;
            }
        }
    }
    const u32 kj = tid & (ATT_DEC_CHUNK - 1), hq4 = 4 * (tid >> 6);  // scores: key, first head
    for (u32 hb = 0; hb < g; hb += ATT_DEC_G) {
        const u32 gn = min((u32)ATT_DEC_G, g - hb);
        const u32 h0 = kh * g + hb;
        __syncthreads();  // staging done; the previous pass is done with qs and ss
        if constexpr (FUSED) {
            // Warp w normalizes and rotates the pass's heads w, w + ATT_DEC_WARPS, … (the
            // values decode_attn_prep writes back to q).
            for (u32 hh = w; hh < gn; hh += ATT_DEC_WARPS) {
                float lo[HW], hi[HW];
                if (hb == 0 && hh == w) {
                    decode_prep_finish<PW>(qpre, pr.eps, D, lo, hi);
                } else {
                    DecodePrepRow<PW> r;
                    decode_prep_load<PW>(pr.q_raw + ((u64)b * hq + h0 + hh) * D, pr.wq, D, pr.cos_t, pr.sin_t,
                                         pr.pos[b], pr.max_pos, r);
                    decode_prep_finish<PW>(r, pr.eps, D, lo, hi);
                }
#pragma unroll
                for (int i = 0; i < HW; ++i) {
                    const u32 d = 32 * i + lane, e = d + half;
                    qs[(d >> 1) * (2 * ATT_DEC_G) + 2 * hh + (d & 1)] = lo[i];
                    qs[(e >> 1) * (2 * ATT_DEC_G) + 2 * hh + (e & 1)] = hi[i];
                }
            }
        } else {
            for (u32 idx = tid; idx < gn * D; idx += ATT_DEC_THREADS) {
                const u32 hh = idx / D, d = idx - hh * D;
                qs[(d >> 1) * (2 * ATT_DEC_G) + 2 * hh + (d & 1)] = q[((u64)b * hq + h0) * D + idx];
            }
        }
        __syncthreads();
        if (kj < jn && hq4 < gn) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const u32* kr = ks + kj * kst;
            // Heads past gn read stale pairs and are never stored.
            const float4* q4 = reinterpret_cast<const float4*>(qs + 2 * hq4);
            for (u32 c = 0; c < half; ++c) {
                const u32 kw = kr[c];
                const float ka = __uint_as_float(kw << 16), kb = __uint_as_float(kw & 0xffff0000u);
                const float4 qa = q4[c * (ATT_DEC_G / 2)], qb = q4[c * (ATT_DEC_G / 2) + 1];
                acc[0] = __fmaf_rn(qa.y, kb, __fmaf_rn(qa.x, ka, acc[0]));
                acc[1] = __fmaf_rn(qa.w, kb, __fmaf_rn(qa.z, ka, acc[1]));
                acc[2] = __fmaf_rn(qb.y, kb, __fmaf_rn(qb.x, ka, acc[2]));
                acc[3] = __fmaf_rn(qb.w, kb, __fmaf_rn(qb.z, ka, acc[3]));
            }
#pragma unroll
            for (u32 hh = 0; hh < 4; ++hh)
                if (hq4 + hh < gn) ss[kj * ATT_DEC_G + hq4 + hh] = __fmul_rn(acc[hh], scale);
        }
        __syncthreads();
        for (u32 hh = w; hh < gn; hh += ATT_DEC_WARPS) {
            const bool v0 = lane < jn, v1 = lane + 32u < jn;
            float* s0p = ss + lane * ATT_DEC_G + hh;
            float* s1p = ss + (lane + 32u) * ATT_DEC_G + hh;
            const float s0 = v0 ? *s0p : att_neg_inf();
            const float s1 = v1 ? *s1p : att_neg_inf();
            const float m = warp_max(fmaxf(s0, s1));
            const float p0 = v0 ? expf(__fsub_rn(s0, m)) : 0.0f;
            const float p1 = v1 ? expf(__fsub_rn(s1, m)) : 0.0f;
            const float l = warp_sum(__fadd_rn(p0, p1));
            if (v0) *s0p = p0;
            if (v1) *s1p = p1;
            if (lane == 0) {
                const u64 pi = ((u64)b * hq + h0 + hh) * nsplit + split;
                if (!direct) {
                    part_m[pi] = m;
                    part_l[pi] = l;
                }
                sl[hh] = l;
                sl[ATT_DEC_G + hh] = m;
            }
        }
        __syncthreads();
        const u32 hpt = (gn + ngrp - 1) / ngrp;  // heads per group of threads (<= ATT_DEC_G)
        const u32 hfirst = vgrp * hpt, hn = vgrp < ngrp ? min(hfirst + hpt, gn) - min(hfirst, gn) : 0;
        float2 acc[ATT_DEC_G];
#pragma unroll
        for (u32 i = 0; i < ATT_DEC_G; ++i) acc[i] = make_float2(0.0f, 0.0f);
        if (hn > 0) {
            const float* pr = ss + hfirst;
            for (u32 j = 0; j < jn; ++j) {
                const u32 vw = vs[j * half + vcol];
                const float va = __uint_as_float(vw << 16), vb = __uint_as_float(vw & 0xffff0000u);
#pragma unroll
                for (u32 i = 0; i < ATT_DEC_G; ++i) {
                    if (i < hn) {
                        const float p = pr[j * ATT_DEC_G + i];
                        acc[i].x = __fmaf_rn(p, va, acc[i].x);
                        acc[i].y = __fmaf_rn(p, vb, acc[i].y);
                    }
                }
            }
        }
#pragma unroll
        for (u32 i = 0; i < ATT_DEC_G; ++i) {
            if (i < hn) {
                const u64 pi = ((u64)b * hq + h0 + hfirst + i) * nsplit + split;
                if (direct) {
                    // attn_decode_combine's arithmetic for one chunk (M = m), so the same bits.
                    const float e = expf(__fsub_rn(sl[ATT_DEC_G + hfirst + i], sl[ATT_DEC_G + hfirst + i]));
                    const float L = __fadd_rn(0.0f, __fmul_rn(sl[hfirst + i], e));
                    const u64 o = pi * D + 2u * vcol;
                    att_dec_store(out, outb, o, __fdiv_rn(__fadd_rn(0.0f, __fmul_rn(acc[i].x, e)), L));
                    att_dec_store(out, outb, o + 1, __fdiv_rn(__fadd_rn(0.0f, __fmul_rn(acc[i].y, e)), L));
                } else {
                    reinterpret_cast<float2*>(part_o + pi * D)[vcol] = acc[i];
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS)
attn_decode_partial(const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                    const u32* __restrict__ lens, float* __restrict__ part_m,
                    float* __restrict__ part_l, float* __restrict__ part_o, float* __restrict__ out,
                    u16* __restrict__ outb, u32 hq, u32 hkv, u32 D, u32 max_len, float scale) {
    const AttDecPrep none{};
    attn_decode_body<0>(q, kc, vc, lens, part_m, part_l, part_o, out, outb, hq, hkv, D, max_len, scale, none);
}

// decode_attn_prep and the decode attention's first pass in one launch
// (Backend::decode_attention), for D = 32·NW: block (b, kh, s) computes its query heads' rows
// itself (decode_prep_load / _finish: the values decode_attn_prep leaves in q; the first pass's
// loads issued before the chunk is staged), and the chunk holding the new position also the new
// k row, which it writes with v's to the caches at [b, len - 1, kh] (kv_append's bytes) and over
// its staged copy; then attn_decode_partial's work (attn_decode_combine follows for caches of
// several chunks). q_raw and k_raw are only read. 1 <= len <= max_len appends; other lengths
// write the combine's zeros / NaN (one chunk) or nothing (the combine writes them) and append
// nothing, as the unfused ops do.
#define ATT_DEC_FUSED_ARGS                                                                                  \
    const float *__restrict__ q_raw, const float *__restrict__ k_raw, const float *__restrict__ v_new,       \
        const float *__restrict__ wq, const float *__restrict__ wk, float eps, const float *__restrict__ cos_t, \
        const float *__restrict__ sin_t, const u32 *__restrict__ pos, u32 max_pos, u16 *kc, u16 *vc,          \
        const u32 *__restrict__ lens, float *__restrict__ part_m,                                             \
        float *__restrict__ part_l, float *__restrict__ part_o, float *__restrict__ out, u16 *__restrict__ outb, \
        u32 hq, u32 hkv, u32 D, u32 max_len, float scale
#define ATT_DEC_FUSED_ENTRY(name, NW)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS) name(ATT_DEC_FUSED_ARGS) {                  \
        const AttDecPrep pr{q_raw, k_raw, v_new, wq, wk, eps, cos_t, sin_t, pos, max_pos, kc, vc};            \
        attn_decode_body<NW>(nullptr, kc, vc, lens, part_m, part_l, part_o, out, outb, hq, hkv, D, max_len, scale, \
                             pr);                                                                              \
    }
ATT_DEC_FUSED_ENTRY(attn_decode_fused_w2, 2)
ATT_DEC_FUSED_ENTRY(attn_decode_fused_w4, 4)
ATT_DEC_FUSED_ENTRY(attn_decode_fused_w8, 8)

// Decode, pass 2. Grid (B, hq), block 32*k threads over d < D. Combines the sequence's chunks
// 0 .. ceil(len/CHUNK) in increasing order: M = max m_s, L = sum l_s exp(m_s - M),
// out = (sum o_s exp(m_s - M)) / L. len == 0 gives zeros (no keys, as the reference);
// len > max_len gives NaN.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_m,
                                               const float* __restrict__ part_l,
                                               const float* __restrict__ part_o,
                                               const u32* __restrict__ lens, float* __restrict__ out,
                                               u16* __restrict__ outb, u32 hq, u32 D, u32 max_len,
                                               u32 nsplit) {
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 len = lens[b];
    const u64 ob = (u64)b * hq * D + (u64)h * D;
    if (len == 0 || len > max_len) {
        const float f = len == 0 ? 0.0f : att_nan();
        for (u32 d = threadIdx.x; d < D; d += blockDim.x) att_dec_store(out, outb, ob + d, f);
        return;
    }
    const u32 ns = (len + ATT_DEC_CHUNK - 1) / ATT_DEC_CHUNK;
    const u64 pb = ((u64)b * hq + h) * nsplit;
    float M = att_neg_inf();
    for (u32 s = 0; s < ns; ++s) M = fmaxf(M, part_m[pb + s]);
    float L = 0.0f;
    for (u32 s = 0; s < ns; ++s) L = __fadd_rn(L, __fmul_rn(part_l[pb + s], expf(__fsub_rn(part_m[pb + s], M))));
    for (u32 d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 s = 0; s < ns; ++s)
            acc = __fadd_rn(acc, __fmul_rn(part_o[(pb + s) * D + d], expf(__fsub_rn(part_m[pb + s], M))));
        att_dec_store(out, outb, ob + d, __fdiv_rn(acc, L));
    }
}
