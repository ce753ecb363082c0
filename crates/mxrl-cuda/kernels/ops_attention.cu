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
// even, as RoPE does). Shared-memory tiles: ATT_BC keys (or queries) per tile, one lane per
// tile row for the dot products (row stride D+1, odd, so the 32 lanes hit 32 banks), and one
// warp per query (or key) row for the weighted sums, lane owning columns lane + 32*c.

#define ATT_BC 32
#define ATT_WARPS 8
#define ATT_MAX_D 256
#define ATT_DPL (ATT_MAX_D / 32)
#define ATT_DEC_CHUNK 64

__device__ __forceinline__ float att_neg_inf() { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ float att_nan() { return __int_as_float(0x7fc00000); }

// dot(a, b) over n elements in index order (f32, products rounded, no FMA).
__device__ __forceinline__ float att_dot(const float* a, const float* b, u32 n) {
    float acc = 0.0f;
    for (u32 d = 0; d < n; ++d) acc = __fadd_rn(acc, __fmul_rn(a[d], b[d]));
    return acc;
}

// Loads rows r0 .. r0+ATT_BC-1 (those < r_end; the rest zero) of the head slice `head_off` of a
// [*, row_stride] matrix into a shared tile [ATT_BC][D+1]. All threads of the block take part.
__device__ __forceinline__ void att_load_tile(float* tile, const float* __restrict__ src, u64 base_row,
                                              u32 r0, u32 r_end, u64 row_stride, u64 head_off,
                                              u32 D) {
    const u32 sk = D + 1;
    for (u32 idx = threadIdx.x; idx < ATT_BC * D; idx += blockDim.x) {
        const u32 jj = idx / D, dd = idx - jj * D;
        const u32 r = r0 + jj;
        tile[jj * sk + dd] = r < r_end ? src[(base_row + r) * row_stride + head_off + dd] : 0.0f;
    }
}

// Training forward. Grid (ceil(max_len / ATT_WARPS), B, hq), block ATT_WARPS*32 threads; warp w
// of block x computes query row i = x*ATT_WARPS + w of sequence b, head h:
// out[i] = sum_{j<=i} softmax_j(s_ij) v_j (divided by the row sum at the end) and
// lse[i, h] = m + log(l) (running max m, running sum l of exp(s - m)).
// Dynamic shared memory: 2*ATT_BC*(D+1) + ATT_WARPS*D + ATT_WARPS*ATT_BC floats.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_fwd(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
         const u32* __restrict__ offsets, float* __restrict__ out, float* __restrict__ lse, u32 hq,
         u32 hkv, u32 D, float scale) {
    extern __shared__ float smem[];
    const u32 sk = D + 1;
    float* ks = smem;
    float* vs = ks + ATT_BC * sk;
    float* qs = vs + ATT_BC * sk;
    float* ps = qs + ATT_WARPS * D;
    const u32 b = blockIdx.y, h = blockIdx.z;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = blockIdx.x * ATT_WARPS;
    if (row0 >= T) return;  // block-uniform
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 i = row0 + w;
    const bool active = i < T;  // warp-uniform
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    float* qw = qs + w * D;
    float* pw = ps + w * ATT_BC;
    if (active)
        for (u32 d = lane; d < D; d += 32) qw[d] = q[(u64)(t0 + i) * qstride + (u64)h * D + d];
    const u32 last = min(T - 1, row0 + ATT_WARPS - 1);
    float m = att_neg_inf(), l = 0.0f;
    float o[ATT_DPL];
#pragma unroll
    for (int c = 0; c < ATT_DPL; ++c) o[c] = 0.0f;
    for (u32 kt = 0; kt <= last; kt += ATT_BC) {
        __syncthreads();
        att_load_tile(ks, k, t0, kt, last + 1, kstride, (u64)kh * D, D);
        att_load_tile(vs, v, t0, kt, last + 1, kstride, (u64)kh * D, D);
        __syncthreads();
        if (active && kt <= i) {
            const u32 j = kt + lane;
            float s = att_neg_inf();
            if (j <= i) s = __fmul_rn(att_dot(qw, ks + lane * sk, D), scale);
            const float m_new = fmaxf(m, warp_max(s));  // key kt <= i is valid: finite
            const float p = j <= i ? expf(__fsub_rn(s, m_new)) : 0.0f;
            const float alpha = expf(__fsub_rn(m, m_new));  // 0 on the first tile
            l = __fadd_rn(__fmul_rn(l, alpha), warp_sum(p));
            pw[lane] = p;
            __syncwarp();
            const u32 jn = min((u32)ATT_BC, i - kt + 1);
#pragma unroll
            for (int c = 0; c < ATT_DPL; ++c) {
                const u32 d = lane + 32 * c;
                if (d < D) {
                    float acc = __fmul_rn(o[c], alpha);
                    for (u32 jj = 0; jj < jn; ++jj) acc = __fadd_rn(acc, __fmul_rn(pw[jj], vs[jj * sk + d]));
                    o[c] = acc;
                }
            }
            __syncwarp();
            m = m_new;
        }
    }
    if (active) {
        const u64 ob = (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
        for (int c = 0; c < ATT_DPL; ++c) {
            const u32 d = lane + 32 * c;
            if (d < D) out[ob + d] = __fdiv_rn(o[c], l);
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
// Dynamic shared memory: 2*ATT_BC*(D+1) + 2*ATT_WARPS*D + ATT_WARPS*ATT_BC floats.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_bwd_dq(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
            const float* __restrict__ v, const float* __restrict__ lse,
            const float* __restrict__ delta, const u32* __restrict__ offsets,
            float* __restrict__ dq, u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float smem[];
    const u32 sk = D + 1;
    float* ks = smem;
    float* vs = ks + ATT_BC * sk;
    float* qs = vs + ATT_BC * sk;
    float* dos = qs + ATT_WARPS * D;
    float* ps = dos + ATT_WARPS * D;
    const u32 b = blockIdx.y, h = blockIdx.z;
    const u32 t0 = offsets[b], T = offsets[b + 1] - t0;
    const u32 row0 = blockIdx.x * ATT_WARPS;
    if (row0 >= T) return;
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 i = row0 + w;
    const bool active = i < T;
    const u32 kh = h / (hq / hkv);
    const u64 qstride = (u64)hq * D, kstride = (u64)hkv * D;
    float* qw = qs + w * D;
    float* dw = dos + w * D;
    float* pw = ps + w * ATT_BC;
    float lse_i = 0.0f, delta_i = 0.0f;
    if (active) {
        const u64 qb = (u64)(t0 + i) * qstride + (u64)h * D;
        for (u32 d = lane; d < D; d += 32) {
            qw[d] = q[qb + d];
            dw[d] = dout[qb + d];
        }
        lse_i = lse[(u64)(t0 + i) * hq + h];
        delta_i = delta[(u64)(t0 + i) * hq + h];
    }
    const u32 last = min(T - 1, row0 + ATT_WARPS - 1);
    float acc[ATT_DPL];
#pragma unroll
    for (int c = 0; c < ATT_DPL; ++c) acc[c] = 0.0f;
    for (u32 kt = 0; kt <= last; kt += ATT_BC) {
        __syncthreads();
        att_load_tile(ks, k, t0, kt, last + 1, kstride, (u64)kh * D, D);
        att_load_tile(vs, v, t0, kt, last + 1, kstride, (u64)kh * D, D);
        __syncthreads();
        if (active && kt <= i) {
            const u32 j = kt + lane;
            float ds = 0.0f;
            if (j <= i) {
                const float s = __fmul_rn(att_dot(qw, ks + lane * sk, D), scale);
                const float p = expf(__fsub_rn(s, lse_i));
                const float dp = att_dot(dw, vs + lane * sk, D);
                ds = __fmul_rn(p, __fsub_rn(dp, delta_i));
            }
            pw[lane] = ds;
            __syncwarp();
            const u32 jn = min((u32)ATT_BC, i - kt + 1);
#pragma unroll
            for (int c = 0; c < ATT_DPL; ++c) {
                const u32 d = lane + 32 * c;
                if (d < D) {
                    float a = acc[c];
                    for (u32 jj = 0; jj < jn; ++jj) a = __fadd_rn(a, __fmul_rn(pw[jj], ks[jj * sk + d]));
                    acc[c] = a;
                }
            }
            __syncwarp();
        }
    }
    if (active) {
        const u64 qb = (u64)(t0 + i) * qstride + (u64)h * D;
#pragma unroll
        for (int c = 0; c < ATT_DPL; ++c) {
            const u32 d = lane + 32 * c;
            if (d < D) dq[qb + d] = __fmul_rn(acc[c], scale);
        }
    }
}

// dk, dv. Grid (ceil(max_len / ATT_WARPS), B, hkv), block ATT_WARPS*32; warp w owns key row
// j = x*ATT_WARPS + w of kv head kh and sums, over the group's query heads in increasing order
// and then over queries i >= j in increasing order:
// dv_j = sum p_ij dout_i, dk_j = scale * sum ds_ij q_i (p, ds as in attn_bwd_dq).
// Dynamic shared memory: 2*ATT_BC*(D+1) + 2*ATT_WARPS*D + 2*ATT_WARPS*ATT_BC + 2*ATT_BC floats.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_bwd_dkdv(const float* __restrict__ dout, const float* __restrict__ q, const float* __restrict__ k,
              const float* __restrict__ v, const float* __restrict__ lse,
              const float* __restrict__ delta, const u32* __restrict__ offsets,
              float* __restrict__ dk, float* __restrict__ dv, u32 hq, u32 hkv, u32 D, float scale) {
    extern __shared__ float smem[];
    const u32 sk = D + 1;
    float* qt = smem;
    float* dot_ = qt + ATT_BC * sk;
    float* ks = dot_ + ATT_BC * sk;
    float* vs = ks + ATT_WARPS * D;
    float* ps = vs + ATT_WARPS * D;
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
    float* kw = ks + w * D;
    float* vw = vs + w * D;
    float* pw = ps + w * ATT_BC;
    float* dsw = dss + w * ATT_BC;
    if (active) {
        const u64 kb = (u64)(t0 + j) * kstride + (u64)kh * D;
        for (u32 d = lane; d < D; d += 32) {
            kw[d] = k[kb + d];
            vw[d] = v[kb + d];
        }
    }
    float adk[ATT_DPL], adv[ATT_DPL];
#pragma unroll
    for (int c = 0; c < ATT_DPL; ++c) {
        adk[c] = 0.0f;
        adv[c] = 0.0f;
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
                    const float s = __fmul_rn(att_dot(qt + lane * sk, kw, D), scale);
                    p = expf(__fsub_rn(s, lse_t[lane]));
                    const float dp = att_dot(dot_ + lane * sk, vw, D);
                    ds = __fmul_rn(p, __fsub_rn(dp, del_t[lane]));
                }
                pw[lane] = p;
                dsw[lane] = ds;
                __syncwarp();
                const u32 lo = j > it ? j - it : 0;
                const u32 hi = min((u32)ATT_BC, T - it);
#pragma unroll
                for (int c = 0; c < ATT_DPL; ++c) {
                    const u32 d = lane + 32 * c;
                    if (d < D) {
                        float a = adv[c], e = adk[c];
                        for (u32 ii = lo; ii < hi; ++ii) {
                            a = __fadd_rn(a, __fmul_rn(pw[ii], dot_[ii * sk + d]));
                            e = __fadd_rn(e, __fmul_rn(dsw[ii], qt[ii * sk + d]));
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
        for (int c = 0; c < ATT_DPL; ++c) {
            const u32 d = lane + 32 * c;
            if (d < D) {
                dk[kb + d] = __fmul_rn(adk[c], scale);
                dv[kb + d] = adv[c];
            }
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

// Decode, pass 1. Grid (B, hkv, ceil(max_len / ATT_DEC_CHUNK)), block ATT_WARPS*32. Block
// (b, kh, s) covers keys s*CHUNK .. min(len_b, (s+1)*CHUNK) of slot b; warp w takes the group's
// query heads w, w + ATT_WARPS, ... For each it writes the chunk's running max m, sum l of
// exp(s - m) and unnormalized o = sum exp(s - m) v to part_m, part_l: [B, hq, nsplit] and
// part_o: [B, hq, nsplit, D]. Blocks past the sequence's end write nothing.
// Dynamic shared memory: 2*ATT_BC*(D+1) + ATT_WARPS*D + ATT_WARPS*ATT_BC floats.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_decode_partial(const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                    const u32* __restrict__ lens, float* __restrict__ part_m,
                    float* __restrict__ part_l, float* __restrict__ part_o, u32 hq, u32 hkv, u32 D,
                    u32 max_len, float scale) {
    extern __shared__ float smem[];
    const u32 sk = D + 1;
    float* ks = smem;
    float* vs = ks + ATT_BC * sk;
    float* qs = vs + ATT_BC * sk;
    float* ps = qs + ATT_WARPS * D;
    const u32 b = blockIdx.x, kh = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const u32 len = lens[b];
    if (len > max_len) return;  // the combine writes NaN for this sequence
    const u32 k0 = split * ATT_DEC_CHUNK;
    if (k0 >= len) return;
    const u32 k1 = min(len, k0 + ATT_DEC_CHUNK);
    const u32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const u32 g = hq / hkv;
    const u64 row = (u64)hkv * D;
    const u16* kbase = kc + (u64)b * max_len * row + (u64)kh * D;
    const u16* vbase = vc + (u64)b * max_len * row + (u64)kh * D;
    float* qw = qs + w * D;
    float* pw = ps + w * ATT_BC;
    for (u32 hb = 0; hb < g; hb += ATT_WARPS) {
        const u32 hh = hb + w;
        const bool active = hh < g;  // warp-uniform
        const u32 h = kh * g + hh;
        __syncthreads();
        if (active)
            for (u32 d = lane; d < D; d += 32) qw[d] = q[(u64)b * hq * D + (u64)h * D + d];
        float m = att_neg_inf(), l = 0.0f;
        float o[ATT_DPL];
#pragma unroll
        for (int c = 0; c < ATT_DPL; ++c) o[c] = 0.0f;
        for (u32 kt = k0; kt < k1; kt += ATT_BC) {
            __syncthreads();
            for (u32 idx = threadIdx.x; idx < ATT_BC * D; idx += blockDim.x) {
                const u32 jj = idx / D, dd = idx - jj * D;
                const u32 r = kt + jj;
                const bool ok = r < k1;
                ks[jj * sk + dd] = ok ? bf16_to_f32(kbase[(u64)r * row + dd]) : 0.0f;
                vs[jj * sk + dd] = ok ? bf16_to_f32(vbase[(u64)r * row + dd]) : 0.0f;
            }
            __syncthreads();
            if (active) {
                const u32 jn = min((u32)ATT_BC, k1 - kt);
                float s = att_neg_inf();
                if (lane < jn) s = __fmul_rn(att_dot(qw, ks + lane * sk, D), scale);
                const float m_new = fmaxf(m, warp_max(s));
                const float p = lane < jn ? expf(__fsub_rn(s, m_new)) : 0.0f;
                const float alpha = expf(__fsub_rn(m, m_new));
                l = __fadd_rn(__fmul_rn(l, alpha), warp_sum(p));
                pw[lane] = p;
                __syncwarp();
#pragma unroll
                for (int c = 0; c < ATT_DPL; ++c) {
                    const u32 d = lane + 32 * c;
                    if (d < D) {
                        float acc = __fmul_rn(o[c], alpha);
                        for (u32 jj = 0; jj < jn; ++jj) acc = __fadd_rn(acc, __fmul_rn(pw[jj], vs[jj * sk + d]));
                        o[c] = acc;
                    }
                }
                __syncwarp();
                m = m_new;
            }
        }
        if (active) {
            const u64 pi = ((u64)b * hq + h) * nsplit + split;
#pragma unroll
            for (int c = 0; c < ATT_DPL; ++c) {
                const u32 d = lane + 32 * c;
                if (d < D) part_o[pi * D + d] = o[c];
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
