// On-device sampling of one token per row of logits [B, V], the semantics of
// mxrl_model::generate::sample_token (the reference):
// - temperature 0: greedy, the first index of the maximum; logprob at τ = 1;
// - else p_v = exp(z_v/τ − max) and the kept set is the first `keep` tokens of the order
//   (p descending, index ascending): keep = top_k (0 = V), then cut to the smallest prefix whose
//   mass reaches top_p·Σp (f64 sums; top_p ≥ 1 = off), at least 1; the token is drawn from the
//   kept set with probability p_v / Σ_kept p and its logprob is z_tok/τ − lse(z/τ) under the full
//   tempered distribution.
// The kept set is found by bisection over the bit patterns of p (monotone for p ≥ 0) with
// block-wide counts and f64 masses, ties at the threshold taken in index order. The uniform
// draw is counter-based: splitmix64 over (seed, step, row), so the same seed, step and row give
// the same token whatever the batch.

#define SAMPLE_THREADS 512
#define NEG_INF_F (-__int_as_float(0x7f800000))

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Uniform in [0, 1) with 53 random bits; mirrored on the host by
// mxrl_cuda::ops::sample::uniform.
__device__ __forceinline__ double sample_uniform(u64 seed, u64 step, u64 row) {
    u64 h = splitmix64(seed);
    h = splitmix64(h ^ step);
    h = splitmix64(h ^ row);
    return (double)(h >> 11) * 1.1102230246251565e-16;  // 2^-53
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < nw ? scratch[lane] : 0.0;
    return warp_sum_f64(t);
}

// (value, index) maximum, ties to the lower index. Every thread returns the winner's index.
__device__ __forceinline__ u32 block_argmax(float v, u32 i, float* sv, u32* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF_F;
    i = lane < nw ? si[lane] : 0xFFFFFFFFu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const u32 oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    return i;
}

// Block-wide count and f64 mass of {v : bits(p_v) ≥ th} (p ≥ 0, so bit order = value order).
__device__ void count_mass_ge(const float* p, u64 V, u32 th, double* red, double* count,
                              double* mass) {
    double c = 0.0, s = 0.0;
    row_for_each(p, V, [&](u64, float x) {
        if (__float_as_uint(x) >= th) { c += 1.0; s = __dadd_rn(s, (double)x); }
    });
    *count = block_sum_f64(c, red);
    *mass = block_sum_f64(s, red);
}

// Largest bit pattern th in [0, 0x7f800000] with count(p ≥ th) ≥ need_count (mode 0) or
// mass(p ≥ th) ≥ need_mass (mode 1); the predicate holds at th = 0 by the caller's choice.
__device__ u32 bisect(const float* p, u64 V, int mode, double need_count, double need_mass,
                      double* red) {
    u32 lo = 0, hi = 0x7f800000u;
    double c, s;
    count_mass_ge(p, V, hi, red, &c, &s);
    if (mode == 0 ? c >= need_count : s >= need_mass) return hi;
    while (hi - lo > 1) {
        const u32 mid = lo + (hi - lo) / 2;
        count_mass_ge(p, V, mid, red, &c, &s);
        if (mode == 0 ? c >= need_count : s >= need_mass) lo = mid; else hi = mid;
    }
    return lo;
}

// One block (SAMPLE_THREADS threads) per row b < B. logits [B, V] f32; p scratch [B, V] f32;
// out_tok [B], out_lp [B]. greedy != 0: temperature 0 (inv_t ignored).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ logits, u64 V, int greedy, float inv_t, u64 top_k,
            float top_p, u64 seed, u64 step, float* __restrict__ pbuf, u32* __restrict__ out_tok,
            float* __restrict__ out_lp) {
    __shared__ double red[32];
    __shared__ float fred[32];
    __shared__ u32 ired[32];
    __shared__ u32 ties[SAMPLE_THREADS + 1];
    __shared__ double kmass[SAMPLE_THREADS + 1];
    __shared__ u32 klast[SAMPLE_THREADS];
    __shared__ u32 chosen;
    const u64 b = blockIdx.x;
    const float* z = logits + b * V;
    float* p = pbuf + b * V;
    const int tid = threadIdx.x;

    if (greedy) {
        float bv = NEG_INF_F;
        u32 bi = 0xFFFFFFFFu;
        row_for_each(z, V, [&](u64 j, float x) {
            if (bi == 0xFFFFFFFFu || x > bv) { bv = x; bi = (u32)j; }
        });
        const u32 best = block_argmax(bv, bi, fred, ired);
        // The maximum is the winner's value: without NaN it is the row's fmaxf (a +0 / -0
        // difference gives the same exps, sum and logprob), with one the sum is NaN either way.
        const float mx = z[best];
        float s = 0.0f;
        row_for_each(z, V, [&](u64, float x) { s = __fadd_rn(s, expf(__fsub_rn(x, mx))); });
        s = block_sum(s, fred);
        if (tid == 0) {
            out_tok[b] = best;
            out_lp[b] = __fsub_rn(z[best], __fadd_rn(mx, logf(s)));
        }
        return;
    }

    // p_v = exp(z_v/τ − m), and the f32 Σp for the logprob's lse.
    float mx = NEG_INF_F;
    row_for_each(z, V, [&](u64, float x) { mx = fmaxf(mx, __fmul_rn(x, inv_t)); });
    mx = block_max(mx, fred);
    float s32 = 0.0f;
    row_for_each(z, V, [&](u64 j, float x) {
        const float e = expf(__fsub_rn(__fmul_rn(x, inv_t), mx));
        p[j] = e;
        s32 = __fadd_rn(s32, e);
    });
    s32 = block_sum(s32, fred);
    __syncthreads();

    // keep = top_k (or V), then the top-p cut.
    u64 keep = (top_k > 0 && top_k < V) ? top_k : V;
    if (top_p < 1.0f) {
        double c_all, total;
        count_mass_ge(p, V, 0u, red, &c_all, &total);
        const double target = (double)top_p * total;
        const u32 th = bisect(p, V, 1, 0.0, target, red);
        double c_gt = 0.0, m_gt = 0.0;
        if (th < 0x7f800000u) count_mass_ge(p, V, th + 1, red, &c_gt, &m_gt);
        if (tid == 0) {
            // Ties at the threshold join in index order until the mass reaches the target.
            const double pt = (double)__uint_as_float(th);
            double acc = m_gt;
            u64 n = (u64)c_gt;
            while (acc < target && n < V) { acc = __dadd_rn(acc, pt); ++n; }
            chosen = (u32)(n < keep ? n : keep);
        }
        __syncthreads();
        keep = chosen;
        __syncthreads();
    }
    if (keep < 1) keep = 1;

    // The kept set: p > th_k, plus the first `need` ties (p == th_k) in index order.
    // keep = V keeps everything (th = 0: every p > 0 and every p = 0 tie).
    const u32 thk = keep >= V ? 0u : bisect(p, V, 0, (double)keep, 0.0, red);
    double c_gt = 0.0, m_gt = 0.0;
    if (thk < 0x7f800000u) count_mass_ge(p, V, thk + 1, red, &c_gt, &m_gt);
    const u64 need = keep - (u64)c_gt;

    const u64 per = (V + blockDim.x - 1) / blockDim.x;
    const u64 j0 = (u64)tid * per < V ? (u64)tid * per : V;
    const u64 j1 = j0 + per < V ? j0 + per : V;
    u32 nt = 0;
    span_until(p, j0, j1, [&](u64, float x) {
        nt += (__float_as_uint(x) == thk);
        return false;
    });
    ties[tid] = nt;
    __syncthreads();
    if (tid == 0) {
        u32 acc = 0;
        for (int i = 0; i < (int)blockDim.x; ++i) { const u32 x = ties[i]; ties[i] = acc; acc += x; }
    }
    __syncthreads();
    double km = 0.0;
    u32 last = 0xFFFFFFFFu;
    {
        u32 rank = ties[tid];
        span_until(p, j0, j1, [&](u64 j, float x) {
            const u32 bits = __float_as_uint(x);
            bool kept = bits > thk;
            if (bits == thk) { kept = rank < need; ++rank; }
            if (kept) { km = __dadd_rn(km, (double)x); last = (u32)j; }
            return false;
        });
    }
    kmass[tid] = km;
    klast[tid] = last;
    __syncthreads();
    if (tid == 0) {
        double acc = 0.0;
        u32 lastk = 0;
        for (int i = 0; i < (int)blockDim.x; ++i) {
            const double x = kmass[i];
            kmass[i] = acc;
            acc = __dadd_rn(acc, x);
            if (klast[i] != 0xFFFFFFFFu) lastk = klast[i];
        }
        kmass[blockDim.x] = acc;
        chosen = lastk;  // fallback: the last kept token (as the reference's)
    }
    __syncthreads();
    const double u = __dmul_rn(sample_uniform(seed, step, b), kmass[blockDim.x]);
    if (kmass[tid] <= u && u < kmass[tid + 1]) {
        double acc = kmass[tid];
        u32 rank = ties[tid];
        u32 tok = last;
        span_until(p, j0, j1, [&](u64 j, float x) {
            const u32 bits = __float_as_uint(x);
            bool kept = bits > thk;
            if (bits == thk) { kept = rank < need; ++rank; }
            if (kept) {
                acc = __dadd_rn(acc, (double)x);
                if (u < acc) { tok = (u32)j; return true; }
            }
            return false;
        });
        chosen = tok;
    }
    __syncthreads();
    if (tid == 0) {
        const u32 tok = chosen;
        out_tok[b] = tok;
        const float lse = __fadd_rn(mx, logf(s32));
        out_lp[b] = __fsub_rn(__fmul_rn(z[tok], inv_t), lse);
    }
}
