// Causal GQA attention of the engine: training forward (flash-style, online softmax, O(T) memory
// per head), training backward (delta, dq over key tiles, dk/dv over query tiles; no atomics),
// and decode over a BF16 KV cache (split over key chunks, fixed-order combine).
// References: mxrl_tensor::attention::{attention_forward, attention_backward, attention_decode}.
// Scores s_ij = fl(q_i . k_j) * scale with f32 accumulation; the softmax and the weighted sums
// run in f32 in a different (fixed) order than the reference: the bound is
// mxrl_tensor::tolerance::attention_*.
//
// Layout: q, out: [N, hq*D]; k, v: [N, hkv*D]; sequence b owns rows offsets[b]..offsets[b+1];
// query head h reads kv head h / (hq/hkv). D <= ATT_MAX_D, any value (the launchers require it
// even, as RoPE does). Shared-memory tiles: ATT_BC keys (or queries) per tile, rows zero-padded
// to d4 = D rounded up to 4 and read as float4; one lane per tile row for the dot products (row
// stride att_stride(D) = 4 * odd floats, so each quarter-warp's 16-byte reads hit 32 distinct
// banks), and one warp per query (or key) row for the weighted sums, lane owning the four
// columns 4*lane + 128*c. The zero padding adds exact zeros to the dots and is never written.

#define ATT_BC 32
#define ATT_WARPS 16
#define ATT_DEC_WARPS 4
#define ATT_MAX_D 256
#define ATT_CPL (ATT_MAX_D / 128)
#define ATT_DEC_CHUNK 64
#define ATT_DEC_G 8

__device__ __forceinline__ float att_neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float att_nan() { return __int_as_float(0x7fc00000); }

// D rounded up to a multiple of 4 (the padded row width), and the shared row stride: d4 when
// d4/4 is odd, else d4 + 4 (4 * odd floats: conflict-free float4 reads of 8 rows at a time).
__device__ __forceinline__ u32 att_d4(u32 D) { return (D + 3u) & ~3u; }
__device__ __forceinline__ u32 att_stride(u32 D) {
    const u32 d4 = att_d4(D);
    return ((d4 >> 2) & 1u) ? d4 : d4 + 4u;
}

// dot(a, b) over d4 elements (16-byte aligned, zero padded) in index order (f32, products
// rounded, no FMA).
__device__ __forceinline__ float att_dot(const float* a, const float* b, u32 d4) {
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float acc = 0.0f;
    for (u32 e = 0; e < (d4 >> 2); ++e) {
        const float4 x = a4[e], y = b4[e];
        acc = __fadd_rn(acc, __fmul_rn(x.x, y.x));
        acc = __fadd_rn(acc, __fmul_rn(x.y, y.y));
        acc = __fadd_rn(acc, __fmul_rn(x.z, y.z));
        acc = __fadd_rn(acc, __fmul_rn(x.w, y.w));
    }
    return acc;
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

// Stores the components d < D of the four columns col..col+3 of a row (`f` applied to each).
__device__ __forceinline__ void att_store4(float* row, u32 col, u32 D, float4 a) {
    if (col < D) row[col] = a.x;
    if (col + 1 < D) row[col + 1] = a.y;
    if (col + 2 < D) row[col + 2] = a.z;
    if (col + 3 < D) row[col + 3] = a.w;
}

// Loads rows r0 .. r0+ATT_BC-1 (those < r_end; the rest zero) of the head slice `head_off` of a
// [*, row_stride] matrix into a shared tile [ATT_BC][att_stride(D)], columns D..d4 zero. All
// threads of the block take part.
__device__ __forceinline__ void att_load_tile(float* tile, const float* __restrict__ src, u64 base_row,
                                              u32 r0, u32 r_end, u64 row_stride, u64 head_off,
                                              u32 D) {
    const u32 sk = att_stride(D), d4 = att_d4(D);
    for (u32 idx = threadIdx.x; idx < ATT_BC * d4; idx += blockDim.x) {
        const u32 jj = idx / d4, dd = idx - jj * d4;
        const u32 r = r0 + jj;
        tile[jj * sk + dd] =
            (r < r_end && dd < D) ? src[(base_row + r) * row_stride + head_off + dd] : 0.0f;
    }
}

// Loads one row (D elements, zero padded to d4) into shared memory by the 32 lanes of a warp.
__device__ __forceinline__ void att_load_row(float* dst, const float* __restrict__ src, u32 D, u32 lane) {
    const u32 d4 = att_d4(D);
    for (u32 d = lane; d < d4; d += 32) dst[d] = d < D ? src[d] : 0.0f;
}

// Training forward. Grid (ceil(max_len / ATT_WARPS), B, hq), block ATT_WARPS*32 threads; warp w
// of block x computes query row i = x*ATT_WARPS + w of sequence b, head h:
// out[i] = sum_{j<=i} softmax_j(s_ij) v_j (divided by the row sum at the end) and
// lse[i, h] = m + log(l) (running max m, running sum l of exp(s - m)).
// Dynamic shared memory (floats): 2*ATT_BC*stride + ATT_WARPS*d4 + ATT_WARPS*ATT_BC.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_fwd(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
         const u32* __restrict__ offsets, float* __restrict__ out, float* __restrict__ lse, u32 hq,
         u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* ks = smem;
    float* vs = ks + ATT_BC * sk;
    float* qs = vs + ATT_BC * sk;
    float* ps = qs + ATT_WARPS * d4;
    const u32 b = blockIdx.y, h = blockIdx.z;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = blockIdx.x * ATT_WARPS;
    if (row0 >= T) return;  // block-uniform
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 i = row0 + w;
    const bool active = i < T;  // warp-uniform
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    float* qw = qs + w * d4;
    float* pw = ps + w * ATT_BC;
    if (active) att_load_row(qw, q + (u64)(t0 + i) * qstride + (u64)h * D, D, lane);
    const u32 last = min(T - 1, row0 + ATT_WARPS - 1);
    float m = att_neg_inf(), l = 0.0f;
    float4 o[ATT_CPL];
#pragma unroll
    for (int c = 0; c < ATT_CPL; ++c) o[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (u32 kt = 0; kt <= last; kt += ATT_BC) {
        __syncthreads();
        att_load_tile(ks, k, t0, kt, last + 1, kstride, (u64)kh * D, D);
        att_load_tile(vs, v, t0, kt, last + 1, kstride, (u64)kh * D, D);
        __syncthreads();
        if (active && kt <= i) {
            const u32 j = kt + lane;
            float s = att_neg_inf();
            if (j <= i) s = __fmul_rn(att_dot(qw, ks + lane * sk, d4), scale);
            const float m_new = fmaxf(m, warp_max(s));  // key kt <= i is valid: finite
            const float p = j <= i ? expf(__fsub_rn(s, m_new)) : 0.0f;
            const float alpha = expf(__fsub_rn(m, m_new));  // 0 on the first tile
            l = __fadd_rn(__fmul_rn(l, alpha), warp_sum(p));
            pw[lane] = p;
            __syncwarp();
            const u32 jn = min((u32)ATT_BC, i - kt + 1);
#pragma unroll
            for (int c = 0; c < ATT_CPL; ++c) {
                const u32 col = 4 * lane + 128 * c;
                if (col < d4) {
                    float4 acc = att_scale4(o[c], alpha);
                    for (u32 jj = 0; jj < jn; ++jj) acc = att_axpy(acc, pw[jj], att_ld4(vs + jj * sk + col));
                    o[c] = acc;
                }
            }
            __syncwarp();
            m = m_new;
        }
    }
    if (active) {
        float* orow = out + (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
        for (int c = 0; c < ATT_CPL; ++c) {
            const u32 col = 4 * lane + 128 * c;
            const float4 a = o[c];
            att_store4(orow, col, D,
                       make_float4(__fdiv_rn(a.x, l), __fdiv_rn(a.y, l), __fdiv_rn(a.z, l), __fdiv_rn(a.w, l)));
        }
        if (lane == 0) lse[(u64)(t0 + i) * hq + h] = __fadd_rn(m, logf(l));
    }
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

// dq. Grid and warps as attn_fwd. For key j <= i: p = exp(s_ij - lse_i),
// ds = p * (dout_i . v_j - delta_i); dq_i = scale * sum_j ds_j k_j (keys in increasing order).
// Dynamic shared memory (floats): 2*ATT_BC*stride + 2*ATT_WARPS*d4 + ATT_WARPS*ATT_BC.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_bwd_dq(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
            const float* __restrict__ v, const float* __restrict__ lse,
            const float* __restrict__ delta, const u32* __restrict__ offsets,
            float* __restrict__ dq, u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* ks = smem;
    float* vs = ks + ATT_BC * sk;
    float* qs = vs + ATT_BC * sk;
    float* dos = qs + ATT_WARPS * d4;
    float* ps = dos + ATT_WARPS * d4;
    const u32 b = blockIdx.y, h = blockIdx.z;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = blockIdx.x * ATT_WARPS;
    if (row0 >= T) return;
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 i = row0 + w;
    const bool active = i < T;
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    float* qw = qs + w * d4;
    float* dw = dos + w * d4;
    float* pw = ps + w * ATT_BC;
    float lse_i = 0.0f, delta_i = 0.0f;
    if (active) {
        const u64 qb = (u64)(t0 + i) * qstride + (u64)h * D;
        att_load_row(qw, q + qb, D, lane);
        att_load_row(dw, dout + qb, D, lane);
        lse_i = lse[(u64)(t0 + i) * hq + h];
        delta_i = delta[(u64)(t0 + i) * hq + h];
    }
    const u32 last = min(T - 1, row0 + ATT_WARPS - 1);
    float4 acc[ATT_CPL];
#pragma unroll
    for (int c = 0; c < ATT_CPL; ++c) acc[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (u32 kt = 0; kt <= last; kt += ATT_BC) {
        __syncthreads();
        att_load_tile(ks, k, t0, kt, last + 1, kstride, (u64)kh * D, D);
        att_load_tile(vs, v, t0, kt, last + 1, kstride, (u64)kh * D, D);
        __syncthreads();
        if (active && kt <= i) {
            const u32 j = kt + lane;
            float ds = 0.0f;
            if (j <= i) {
                const float s = __fmul_rn(att_dot(qw, ks + lane * sk, d4), scale);
                const float p = expf(__fsub_rn(s, lse_i));
                const float dp = att_dot(dw, vs + lane * sk, d4);
                ds = __fmul_rn(p, __fsub_rn(dp, delta_i));
            }
            pw[lane] = ds;
            __syncwarp();
            const u32 jn = min((u32)ATT_BC, i - kt + 1);
#pragma unroll
            for (int c = 0; c < ATT_CPL; ++c) {
                const u32 col = 4 * lane + 128 * c;
                if (col < d4) {
                    float4 a = acc[c];
                    for (u32 jj = 0; jj < jn; ++jj) a = att_axpy(a, pw[jj], att_ld4(ks + jj * sk + col));
                    acc[c] = a;
                }
            }
            __syncwarp();
        }
    }
    if (active) {
        float* row = dq + (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
        for (int c = 0; c < ATT_CPL; ++c) att_store4(row, 4 * lane + 128 * c, D, att_scale4(acc[c], scale));
    }
}

// dk, dv. Grid (ceil(max_len / ATT_WARPS), B, hkv), block ATT_WARPS*32; warp w owns key row
// j = x*ATT_WARPS + w of kv head kh and sums, over the group's query heads in increasing order
// and then over queries i >= j in increasing order:
// dv_j = sum p_ij dout_i, dk_j = scale * sum ds_ij q_i (p, ds as in attn_bwd_dq).
// Dynamic shared memory (floats): 2*ATT_BC*stride + 2*ATT_WARPS*d4 + 2*ATT_WARPS*ATT_BC +
// 2*ATT_BC.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_bwd_dkdv(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
              const float* __restrict__ v, const float* __restrict__ lse,
              const float* __restrict__ delta, const u32* __restrict__ offsets,
              float* __restrict__ dk, float* __restrict__ dv, u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 sk = att_stride(D), d4 = att_d4(D);
    float* qt = smem;
    float* dot_ = qt + ATT_BC * sk;
    float* ks = dot_ + ATT_BC * sk;
    float* vs = ks + ATT_WARPS * d4;
    float* ps = vs + ATT_WARPS * d4;
    float* dss = ps + ATT_WARPS * ATT_BC;
    float* lse_t = dss + ATT_WARPS * ATT_BC;
    float* del_t = lse_t + ATT_BC;
    const u32 b = blockIdx.y, kh = blockIdx.z;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = blockIdx.x * ATT_WARPS;
    if (row0 >= T) return;
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 j = row0 + w;
    const bool active = j < T;
    const u32 g = hq / hkv;
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    float* kw = ks + w * d4;
    float* vw = vs + w * d4;
    float* pw = ps + w * ATT_BC;
    float* dsw = dss + w * ATT_BC;
    if (active) {
        const u64 kb = (u64)(t0 + j) * kstride + (u64)kh * D;
        att_load_row(kw, k + kb, D, lane);
        att_load_row(vw, v + kb, D, lane);
    }
    float4 adk[ATT_CPL], adv[ATT_CPL];
#pragma unroll
    for (int c = 0; c < ATT_CPL; ++c) {
        adk[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        adv[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (u32 hh = 0; hh < g; ++hh) {
        const u32 h = kh * g + hh;
        for (u32 it = row0; it < T; it += ATT_BC) {
            __syncthreads();
            att_load_tile(qt, q, t0, it, T, qstride, (u64)h * D, D);
            att_load_tile(dot_, dout, t0, it, T, qstride, (u64)h * D, D);
            if (threadIdx.x < ATT_BC) {
                const u32 r = it + threadIdx.x;
                lse_t[threadIdx.x] = r < T ? lse[(u64)(t0 + r) * hq + h] : 0.0f;
                del_t[threadIdx.x] = r < T ? delta[(u64)(t0 + r) * hq + h] : 0.0f;
            }
            __syncthreads();
            if (active && j < it + ATT_BC) {
                const u32 i = it + lane;
                float p = 0.0f, ds = 0.0f;
                if (i < T && i >= j) {
                    const float s = __fmul_rn(att_dot(qt + lane * sk, kw, d4), scale);
                    p = expf(__fsub_rn(s, lse_t[lane]));
                    const float dp = att_dot(dot_ + lane * sk, vw, d4);
                    ds = __fmul_rn(p, __fsub_rn(dp, del_t[lane]));
                }
                pw[lane] = p;
                dsw[lane] = ds;
                __syncwarp();
                const u32 lo = j > it ? j - it : 0;
                const u32 hi = min((u32)ATT_BC, T - it);
#pragma unroll
                for (int c = 0; c < ATT_CPL; ++c) {
                    const u32 col = 4 * lane + 128 * c;
                    if (col < d4) {
                        float4 a = adv[c], e = adk[c];
                        for (u32 ii = lo; ii < hi; ++ii) {
                            a = att_axpy(a, pw[ii], att_ld4(dot_ + ii * sk + col));
                            e = att_axpy(e, dsw[ii], att_ld4(qt + ii * sk + col));
                        }
                        adv[c] = a;
                        adk[c] = e;
                    }
                }
                __syncwarp();
            }
        }
    }
    if (active) {
        const u64 kb = (u64)(t0 + j) * kstride + (u64)kh * D;
#pragma unroll
        for (int c = 0; c < ATT_CPL; ++c) {
            const u32 col = 4 * lane + 128 * c;
            att_store4(dk + kb, col, D, att_scale4(adk[c], scale));
            att_store4(dv + kb, col, D, adv[c]);
        }
    }
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

// Decode, pass 1. Grid (B, Hkv, nsplit), ATT_DEC_WARPS warps. Block (b, kh, s) covers keys
// s*CHUNK .. min(len_b, (s+1)*CHUNK) of slot b for the query heads of kv head kh. The chunk's
// K and V rows are staged in shared memory as BF16 (4-byte loads, all independent), the query
// rows of up to ATT_DEC_G heads per pass as f32. Scores: warp w takes keys w, w + ATT_DEC_WARPS,
// ...; lane l forms the partial dot over elements d = l + 32i in i order, the warp adds the 32
// partials by a butterfly (fixed order); s = fl(dot)*scale. Softmax and weighted sums: warp w
// takes heads w, w + ATT_DEC_WARPS, ...; lane l owns the chunk's keys l and l + 32 for the max
// and the sum of exp(s - m), and columns l + 32i of the weighted sum over keys in index order.
// Writes the chunk's max m, sum l and unnormalized o = sum exp(s - m) v to part_m, part_l:
// [B, hq, nsplit] and part_o: [B, hq, nsplit, D]. Blocks past the sequence's end write nothing.
// Dynamic shared memory (bytes): 4*(ATT_DEC_G*d4 + ATT_DEC_G*ATT_DEC_CHUNK) + 2*2*ATT_DEC_CHUNK*D.
// Needs D even and the caches 4-byte aligned (the launcher checks).
#if ATT_DEC_CHUNK != 64
#error "attn_decode_partial gives each lane two keys of a chunk"
#endif
extern "C" __global__ void __launch_bounds__(ATT_DEC_WARPS * 32)
attn_decode_partial(const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                    const u32* __restrict__ lens, float* __restrict__ part_m,
                    float* __restrict__ part_l, float* __restrict__ part_o, u32 hq, u32 hkv, u32 D,
                    u32 max_len, float scale) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const u32 d4 = att_d4(D);
    float* qs = smem;
    float* ss = qs + ATT_DEC_G * d4;
    u16* ks = reinterpret_cast<u16*>(ss + ATT_DEC_G * ATT_DEC_CHUNK);
    u16* vs = ks + ATT_DEC_CHUNK * D;
    const u32 b = blockIdx.x, kh = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const u32 len = lens[b];
    if (len > max_len) return;  // the combine writes NaN for this sequence
    const u32 k0 = split * ATT_DEC_CHUNK;
    if (k0 >= len) return;
    const u32 jn = min(len - k0, (u32)ATT_DEC_CHUNK);
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 g = hq / hkv;
    const u64 row = (u64)hkv * D;
    const u64 base = ((u64)b * max_len + k0) * row + (u64)kh * D;  // even: D is even
    {
        const u32 half = D >> 1, words = jn * half;
        const u32* k32 = reinterpret_cast<const u32*>(kc + base);
        const u32* v32 = reinterpret_cast<const u32*>(vc + base);
        u32* ks32 = reinterpret_cast<u32*>(ks);
        u32* vs32 = reinterpret_cast<u32*>(vs);
        const u64 row32 = row >> 1;
        for (u32 idx = threadIdx.x; idx < words; idx += blockDim.x) {
            const u32 j = idx / half, c = idx - j * half;
            ks32[idx] = k32[(u64)j * row32 + c];
            vs32[idx] = v32[(u64)j * row32 + c];
        }
    }
    for (u32 hb = 0; hb < g; hb += ATT_DEC_G) {
        const u32 gn = min((u32)ATT_DEC_G, g - hb);
        const u32 h0 = kh * g + hb;
        __syncthreads();  // staging done; the previous pass is done with qs and ss
        for (u32 idx = threadIdx.x; idx < gn * D; idx += blockDim.x) {
            const u32 hh = idx / D, d = idx - hh * D;
            qs[hh * d4 + d] = q[((u64)b * hq + h0 + hh) * D + d];
        }
        __syncthreads();
        for (u32 j = w; j < jn; j += ATT_DEC_WARPS) {
            float kv[ATT_MAX_D / 32];
#pragma unroll
            for (u32 i = 0; i < ATT_MAX_D / 32; ++i) {
                const u32 d = lane + 32u * i;
                kv[i] = d < D ? bf16_to_f32(ks[j * D + d]) : 0.0f;
            }
            for (u32 hh = 0; hh < gn; ++hh) {
                float acc = 0.0f;
#pragma unroll
                for (u32 i = 0; i < ATT_MAX_D / 32; ++i) {
                    const u32 d = lane + 32u * i;
                    if (d < D) acc = __fadd_rn(acc, __fmul_rn(qs[hh * d4 + d], kv[i]));
                }
                acc = warp_sum(acc);
                if (lane == 0) ss[hh * ATT_DEC_CHUNK + j] = __fmul_rn(acc, scale);
            }
        }
        __syncthreads();
        for (u32 hh = w; hh < gn; hh += ATT_DEC_WARPS) {
            float* sh = ss + hh * ATT_DEC_CHUNK;
            const bool v0 = lane < jn, v1 = lane + 32u < jn;
            const float s0 = v0 ? sh[lane] : att_neg_inf();
            const float s1 = v1 ? sh[lane + 32] : att_neg_inf();
            const float m = warp_max(fmaxf(s0, s1));
            const float p0 = v0 ? expf(__fsub_rn(s0, m)) : 0.0f;
            const float p1 = v1 ? expf(__fsub_rn(s1, m)) : 0.0f;
            const float l = warp_sum(__fadd_rn(p0, p1));
            __syncwarp();
            if (v0) sh[lane] = p0;
            if (v1) sh[lane + 32] = p1;
            __syncwarp();
            float acc[ATT_MAX_D / 32];
#pragma unroll
            for (u32 i = 0; i < ATT_MAX_D / 32; ++i) acc[i] = 0.0f;
            for (u32 j = 0; j < jn; ++j) {
                const float p = sh[j];
#pragma unroll
                for (u32 i = 0; i < ATT_MAX_D / 32; ++i) {
                    const u32 d = lane + 32u * i;
                    if (d < D) acc[i] = __fadd_rn(acc[i], __fmul_rn(p, bf16_to_f32(vs[j * D + d])));
                }
            }
            const u64 pi = ((u64)b * hq + h0 + hh) * nsplit + split;
#pragma unroll
            for (u32 i = 0; i < ATT_MAX_D / 32; ++i) {
                const u32 d = lane + 32u * i;
                if (d < D) part_o[pi * D + d] = acc[i];
            }
            if (lane == 0) {
                part_m[pi] = m;
                part_l[pi] = l;
            }
        }
    }
}

// Decode, pass 2. Grid (B, hq), block 32*k threads over d < D. Combines the sequence's chunks
// 0 .. ceil(len/CHUNK) in increasing order: M = max m_s, L = sum l_s exp(m_s - M),
// out = (sum o_s exp(m_s - M)) / L. len == 0 gives zeros (no keys, as the reference);
// len > max_len gives NaN.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_m,
                                               const float* __restrict__ part_l,
                                               const float* __restrict__ part_o,
                                               const u32* __restrict__ lens, float* __restrict__ out,
                                               u32 hq, u32 D, u32 max_len, u32 nsplit) {
    const u32 b = blockIdx.x, h = blockIdx.y;
    const u32 len = lens[b];
    const u64 ob = (u64)b * hq * D + (u64)h * D;
    if (len == 0 || len > max_len) {
        const float f = len == 0 ? 0.0f : att_nan();
        for (u32 d = threadIdx.x; d < D; d += blockDim.x) out[ob + d] = f;
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
        out[ob + d] = __fdiv_rn(acc, L);
    }
}
