// Grouped expert GEMMs of the engine (BF16 operands as u16 bit patterns, f32 accumulation and
// output) and the small-M ("decode") grouped GEMV.
//
// Layout: the activation is packed expert-major; rows of expert e are offsets[e]..offsets[e+1]
// of an [R, ·] matrix (offsets: u32 [E+1] in device memory, read by the kernels, never by the
// host). The expert weights are stacked row-major [E, N, K]. References (mxrl_tensor::gemm on
// the widened BF16 values, per expert): forward = matmul_nt, dgrad = matmul_nn, wgrad =
// matmul_tn added to the existing dW.
//
// Requirements (checked by the launchers): N and K multiples of 8; x, w, dy 16-byte aligned;
// outputs 8-byte aligned. Offsets are clamped to [0, R] and a decreasing offset gives an empty
// expert, so no access ever leaves the buffers; rows outside every expert's range are not
// written.
//
// Determinism: every output element is owned by exactly one thread of one block, and its sum
// runs in an order fixed by the shapes (tensor-core mma over k-tiles in increasing order, or a
// fixed per-lane order followed by a butterfly). No atomics.

// Block tiles: BM × BN outputs (64 × 64 with 4 warps; 128 × 128 or, for decode-sized experts,
// 32 × 128 with 8 warps), the warps arranged 2 × (BN / 32), each owning a (BM / 2) × 32 output
// tile.
#define K_LD(BK) ((BK) + 8)     // K-contiguous row stride in bf16 for stages BK deep (80 or 144
                                 // bytes for BK = 32 / 64: 16-byte multiples,
                                 // conflict-free ldmatrix rows)
#define NO_EXPERT 0xFFFFFFFFu


// Maps row tile t (blockIdx.y) to (expert, first row, end row): tiles are numbered expert by
// expert, ceil(rows_e / BM) per expert. Warp 0 scans the offsets 32 experts at a time
// (inclusive warp scan of the tile counts); job[0] = NO_EXPERT when t is a surplus tile.
template <int BM>
__device__ void locate_row_tile(const u32* __restrict__ off, u32 E, u32 R, u32 t, u32* job) {
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
        u32 carry = 0;
        bool found = false;
        for (u32 base = 0; base < E; base += 32) {
            const u32 e = base + lane;
            u32 lo = 0, hi = 0, nt = 0;
            if (e < E) {
                expert_rows(off, e, R, lo, hi);
                nt = (hi - lo + BM - 1) / BM;
            }
            u32 inc = nt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_up_sync(FULL_MASK, inc, o);
                if ((int)lane >= o) inc += v;
            }
            const u32 exc = inc - nt;
            const bool mine = nt > 0 && t >= carry + exc && t < carry + inc;
            if (mine) {
                job[0] = e;
                job[1] = lo + (t - carry - exc) * BM;
                job[2] = hi;
            }
            if (__ballot_sync(FULL_MASK, mine) != 0) {
                found = true;
                break;
            }
            carry += __shfl_sync(FULL_MASK, inc, 31);
        }
        if (!found && lane == 0) job[0] = NO_EXPERT;
    }
    __syncthreads();
}

// ---- Tensor-core main loop. A block computes a BM × BN output tile as Σ over reduction
// stages BK deep. Each operand tile lives in shared memory in the layout of its source:
// "K-contiguous" [rows][BK] (padded to K_LD(BK)) when the reduction index is the source's
// contiguous one, "MN-contiguous" [BK][rows] (padded to rows + 8) when the output index is.
// Tiles are filled with 16-byte cp.async copies (zero-filled outside the valid range), ST
// stages in dynamic shared memory (Cfg::STAGES), and fragments come from ldmatrix (.trans for
// MN-contiguous tiles).

#define MN_LD(ROWS) ((ROWS) + 8)  // row stride of an MN-contiguous tile (bf16; 144 bytes)

// An operand: element (o, r) (output index o, reduction index r) is p[o·ld + r] when K-
// contiguous, p[r·ld + o] when MN-contiguous; valid for o < out_end, r < red_end.
struct Operand {
    const u16* p;
    u64 ld, out0, out_end, red_end;
};

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's most recent cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix .x4 (.trans when TRANS) from the shared byte address `addr`.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr)
                     : "memory");
}

// d += a · b for one m16n8k16 tile (BF16 operands, f32 accumulator).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The cp.async copies of one operand, ROWS × BK per stage, with every per-thread quantity
// that does not change from stage to stage computed once (a thread's chunks, their shared-
// memory offsets and global addresses, the output-index bound): a stage then costs one
// compare, one pointer advance and one copy per chunk. Chunk v of a stage (v = threadIdx.x +
// c·THREADS, c < PER) is, K-contiguous, row i = v / VPR, reduction j = (v % VPR)·8 of the tile
// [ROWS][K_LD(BK)]; MN-contiguous, reduction row j = v / VPR, output i = (v % VPR)·8 of the
// tile [BK][ROWS + 8]. ld, out0, out_end (and red_end for MN-contiguous operands) are multiples of
// 8 and p is 16-byte aligned, so a 16-byte chunk is entirely valid or entirely outside;
// K-contiguous chunks run along r, where red_end is a multiple of 8 too, or, for the wgrad's
// row reduction, always MN-contiguous. Invalid chunks are zero-filled (nothing is read).
template <bool MN, int ROWS, int THREADS, int BK>
struct Loader {
    static constexpr int VPR = MN ? ROWS / 8 : BK / 8;  // 16-byte chunks per tile row
    static constexpr int CHUNKS = ROWS * BK / 8;
    static constexpr int PER = (CHUNKS + THREADS - 1) / THREADS;
    const u16* base;      // the operand's first element (the address of zero-filled chunks)
    const u16* src[PER];  // the chunk's source at the next stage to issue
    u32 dst[PER];         // byte offset of the chunk in a stage's tile
    u32 red[PER];         // reduction index of the chunk relative to the stage's first
    bool out_ok[PER];     // output index inside the operand (and the chunk exists)
    u64 step;             // elements between two stages' sources
    u64 red_next;         // first reduction index of the next stage to issue
    u64 red_end;

    __device__ __forceinline__ void init(const Operand& op, u64 red_lo) {
        base = op.p;
        red_next = red_lo;
        red_end = op.red_end;
        step = MN ? (u64)BK * op.ld : (u64)BK;
#pragma unroll
        for (int c = 0; c < PER; ++c) {
            const int v = threadIdx.x + c * THREADS;
            const int a = v / VPR, b = (v % VPR) * 8;  // (row, column) of the chunk in the tile
            const int i = MN ? b : a, j = MN ? a : b;  // (output, reduction) index
            const u64 o = op.out0 + i;
            out_ok[c] = v < CHUNKS && o < op.out_end;
            red[c] = (u32)j;
            dst[c] = (u32)(MN ? (j * MN_LD(ROWS) + i) * 2 : (i * K_LD(BK) + j) * 2);
            src[c] = out_ok[c] ? (MN ? op.p + (red_lo + j) * op.ld + o : op.p + o * op.ld + red_lo + j) : op.p;
        }
    }

    // Issues the next stage into the tile at shared address `tile` and advances.
    __device__ __forceinline__ void issue(u32 tile) {
#pragma unroll
        for (int c = 0; c < PER; ++c) {
            if (CHUNKS % THREADS != 0 && threadIdx.x + c * THREADS >= CHUNKS) continue;
            const bool ok = out_ok[c] && red_next + red[c] < red_end;
            const u32 n = ok ? 16u : 0u;  // src-size 0: nothing is read, the 16 bytes are zeroed
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + dst[c]), "l"(ok ? src[c] : base),
                         "r"(n)
                         : "memory");
            if (out_ok[c]) src[c] += step;
        }
        red_next += BK;
    }
};

template <bool MN, int ROWS, int BK>
struct TileSize {
    static constexpr int elems = MN ? BK * MN_LD(ROWS) : ROWS * K_LD(BK);
};

// acc = Σ_{r in [red_lo, red_end)} A(o_m, r)·B(o_n, r) for the block's BM × BN tile, the
// reduction in stages of BK in increasing order (fixed: deterministic). Warp w owns output
// rows (w / WN_WARPS)·(BM/2) .. +BM/2 and columns (w % WN_WARPS)·WNT .. +WNT: MI × NJ mma
// tiles per k16 step (MI = BM / 32, NJ = WNT / 8).
template <int BM, int BN, int WNT, int BK_, int STAGES_>
struct Cfg {
    static constexpr int BK = BK_;  // reduction depth of one shared-memory stage
    static constexpr int WN_WARPS = BN / WNT;
    static constexpr int THREADS = 64 * WN_WARPS;
    static constexpr int NJ = WNT / 8;  // n8 tiles per warp
    static constexpr int WM = BM / 2;
    static constexpr int MI = WM / 16;
    // Stages in flight (dynamic shared memory, STAGES of each operand's tile: 80 KB for the
    // 128 × 128 forward at 4 × 32; the launchers size it with the same formula).
    static constexpr int STAGES = STAGES_;
};

template <int BM, int BN, int WNT, int BK, int ST, bool A_MN, bool B_MN>
__device__ __forceinline__ void mainloop(const Operand& A, const Operand& B, u64 red_lo, u64 red_end,
                                         float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4]) {
    typedef Cfg<BM, BN, WNT, BK, ST> C;
    constexpr int S = C::STAGES;
    // S stages of A, then S of B (16-byte multiples each: cp.async destinations stay aligned).
    extern __shared__ __align__(128) u16 gt_smem[];
    constexpr int AE = TileSize<A_MN, BM, BK>::elems, BE = TileSize<B_MN, BN, BK>::elems;
    const u32 As = smem_addr(gt_smem), Bs = As + S * AE * 2;  // shared byte addresses
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, li = lane >> 3, lj = lane & 7;
    const int wm = (warp / C::WN_WARPS) * C::WM, wn = (warp % C::WN_WARPS) * WNT;
#pragma unroll
    for (int i = 0; i < C::MI; ++i)
#pragma unroll
        for (int j = 0; j < C::NJ; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
    const u64 nk64 = red_end > red_lo ? (red_end - red_lo + C::BK - 1) / C::BK : 0;
    if (nk64 == 0) return;
    const u32 nk = (u32)nk64;
    // This lane's ldmatrix byte offsets within a stage at kk = 0, and the byte step of kk += 16.
    // A fragment (16 output rows from m0, reduction kk .. kk+16) of the mma.m16n8k16 layout
    // (PTX ISA: g = lane / 4, t = lane % 4; regs (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
    // (g+8, 2t+8..)): ldmatrix matrix i ∈ 0..4 covers rows m0 + 8·(i & 1), reduction
    // kk + 8·(i >> 1); lane l supplies row l % 8 of matrix l / 8. B fragments of two n8 tiles
    // (columns n0 .. n0+16; regs (k 2t..2t+1, n g), (k 2t+8.., n g)): matrix i covers columns
    // n0 + 8·(i >> 1), reduction kk + 8·(i & 1), so r = {b0[0], b0[1], b1[0], b1[1]}.
    // MN-contiguous tiles are read with .trans.
    constexpr u32 A_KK = A_MN ? 16 * MN_LD(BM) * 2 : 16 * 2;
    constexpr u32 B_KK = B_MN ? 16 * MN_LD(BN) * 2 : 16 * 2;
    u32 a_off[C::MI], b_off[C::NJ / 2];
#pragma unroll
    for (int i = 0; i < C::MI; ++i) {
        const int m0 = wm + 16 * i;
        a_off[i] = (u32)(A_MN ? ((8 * (li >> 1) + lj) * MN_LD(BM) + m0 + 8 * (li & 1)) * 2
                              : ((m0 + 8 * (li & 1) + lj) * K_LD(C::BK) + 8 * (li >> 1)) * 2);
    }
#pragma unroll
    for (int p = 0; p < C::NJ / 2; ++p) {
        const int n0 = wn + 16 * p;
        b_off[p] = (u32)(B_MN ? ((8 * (li & 1) + lj) * MN_LD(BN) + n0 + 8 * (li >> 1)) * 2
                              : ((n0 + 8 * (li >> 1) + lj) * K_LD(C::BK) + 8 * (li & 1)) * 2);
    }
    Loader<A_MN, BM, C::THREADS, BK> la;
    Loader<B_MN, BN, C::THREADS, BK> lb;
    la.init(A, red_lo);
    lb.init(B, red_lo);
    // Prologue: stages 0 .. S-2, one commit group each (empty when past the end).
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if ((u32)st < nk) {
            la.issue(As + st * AE * 2);
            lb.issue(Bs + st * BE * 2);
        }
        cp_async_commit();
    }
    for (u32 kt = 0; kt < nk; ++kt) {
        // Refill the buffer computed in iteration kt - 1 (released by its trailing barrier)
        // with stage kt + S - 1. Group g holds stage g; after this commit groups 0 .. kt+S-1
        // exist, so "at most S - 1 pending" means groups 0 .. kt (stage kt) have landed.
        const u32 nxt = kt + S - 1;
        if (nxt < nk) {
            la.issue(As + (nxt % S) * AE * 2);
            lb.issue(Bs + (nxt % S) * BE * 2);
        }
        cp_async_commit();
        cp_async_wait<S - 1>();
        __syncthreads();
        const u32 cur = kt % S;
        const u32 a_st = As + cur * AE * 2, b_st = Bs + cur * BE * 2;
#pragma unroll
        for (int kk = 0; kk < C::BK / 16; ++kk) {
            u32 a[C::MI][4], b[C::NJ][2];
#pragma unroll
            for (int i = 0; i < C::MI; ++i) ldsm_x4<A_MN>(a[i], a_st + a_off[i] + kk * A_KK);
#pragma unroll
            for (int p = 0; p < C::NJ / 2; ++p) {
                u32 r[4];
                ldsm_x4<B_MN>(r, b_st + b_off[p] + kk * B_KK);
                b[2 * p][0] = r[0];
                b[2 * p][1] = r[1];
                b[2 * p + 1][0] = r[2];
                b[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < C::MI; ++i)
#pragma unroll
                for (int j = 0; j < C::NJ; ++j) mma_16816(acc[i][j], a[i], b[j]);
        }
        __syncthreads();  // the next iteration refills this stage's buffers
    }
}

// out[(row0 + m)·ld + col0 + c] (+)= acc for the block tile, rows < row_end, columns < col_end
// (col_end a multiple of 8, so a column pair is entirely inside or outside). C fragment: regs
// (g, 2t..2t+1), (g+8, 2t..2t+1). STORE_SET stores acc; STORE_ADD stores old + acc (one f32
// addition); STORE_ADD_ZERO stores +0 + acc, the bits STORE_ADD gives over a zeroed buffer,
// without reading it.
#define STORE_SET 0
#define STORE_ADD 1
#define STORE_ADD_ZERO 2
template <int BM, int BN, int WNT, int BK, int ST>
__device__ __forceinline__ void store_tile(float* __restrict__ out, u64 ld, u64 row0, u64 row_end, u64 col0,
                                           u64 col_end, const float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4], int mode) {
    typedef Cfg<BM, BN, WNT, BK, ST> C;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp / C::WN_WARPS) * C::WM, wn = (warp % C::WN_WARPS) * WNT;
#pragma unroll
    for (int i = 0; i < C::MI; ++i)
#pragma unroll
        for (int j = 0; j < C::NJ; ++j) {
            const u64 c = col0 + wn + j * 8 + 2 * t;
            if (c >= col_end) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u64 r = row0 + wm + i * 16 + g + h * 8;
                if (r >= row_end) continue;
                float2* p = reinterpret_cast<float2*>(out + r * ld + c);
                float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                if (mode != STORE_SET) {
                    const float2 o = mode == STORE_ADD ? *p : make_float2(0.0f, 0.0f);
                    v.x = __fadd_rn(o.x, v.x);
                    v.y = __fadd_rn(o.y, v.y);
                }
                *p = v;
            }
        }
}

// Forward: y[r, n] = Σ_k x[r, k]·w[e][n, k] for every row r of expert e.
// x [R, K] bf16, w [E, N, K] bf16, y [R, N] f32. Grid (ceil(N/BN), ceil(R/BM) + E); block
// y-index = row tile (expert-major), surplus tiles exit; x-index = column tile, so the blocks
// of one row tile are launched together and share its activation rows in L2.
template <int BM, int BN, int WNT, int BK, int ST>
__device__ __forceinline__ void grouped_nt_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                                const u32* __restrict__ off, float* __restrict__ y, u32 E, u32 R,
                                                u32 N, u32 K) {
    __shared__ u32 job[3];
    locate_row_tile<BM>(off, E, R, blockIdx.y, job);
    if (job[0] == NO_EXPERT) return;
    const u64 e = job[0], r0 = job[1], r1 = job[2];
    const u64 n0 = (u64)blockIdx.x * BN;
    const Operand A = {x, K, r0, r1, K};
    const Operand B = {w + e * (u64)N * K, K, n0, N, K};
    float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4];
    mainloop<BM, BN, WNT, BK, ST, false, false>(A, B, 0, K, acc);
    store_tile<BM, BN, WNT, BK, ST>(y, N, r0, r1, n0, N, acc, STORE_SET);
}

// Dgrad: dx[r, k] = Σ_n dy[r, n]·w[e][n, k] for every row r of expert e.
// dy [R, N] bf16, w [E, N, K] bf16, dx [R, K] f32. Grid (ceil(K/BN), ceil(R/BM) + E).
template <int BM, int BN, int WNT, int BK, int ST>
__device__ __forceinline__ void grouped_nn_body(const u16* __restrict__ dy, const u16* __restrict__ w,
                                                const u32* __restrict__ off, float* __restrict__ dx, u32 E, u32 R,
                                                u32 N, u32 K) {
    __shared__ u32 job[3];
    locate_row_tile<BM>(off, E, R, blockIdx.y, job);
    if (job[0] == NO_EXPERT) return;
    const u64 e = job[0], r0 = job[1], r1 = job[2];
    const u64 c0 = (u64)blockIdx.x * BN;  // first output column (index into K)
    const Operand A = {dy, N, r0, r1, N};
    const Operand B = {w + e * (u64)N * K, K, c0, K, N};  // element (k, n) at w[e][n·K + k]
    float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4];
    mainloop<BM, BN, WNT, BK, ST, false, true>(A, B, 0, N, acc);
    store_tile<BM, BN, WNT, BK, ST>(dx, K, r0, r1, c0, K, acc, STORE_SET);
}

// Wgrad: dw[e][n, k] += Σ_{r in expert e, increasing} dy[r, n]·x[r, k] (`overwrite`: dw[e][n, k]
// = +0 + Σ, dw not read).
// dy [R, N] bf16, x [R, K] bf16, dw [E, N, K] f32. Grid (ceil(N/BM), ceil(K/BN), E); a block
// of an expert with no rows exits without touching dw, or, overwriting, writes zeros over its
// tile. The reduction runs over the expert's rows lo .. hi (stages from lo; rows ≥ hi
// zero-filled).
template <int BM, int BN, int WNT, int BK, int ST>
__device__ __forceinline__ void grouped_tn_body(const u16* __restrict__ dy, const u16* __restrict__ x,
                                                const u32* __restrict__ off, float* __restrict__ dw, u32 E, u32 R,
                                                u32 N, u32 K, bool overwrite) {
    const u32 e = blockIdx.z;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    const u64 n0 = (u64)blockIdx.x * BM, k0 = (u64)blockIdx.y * BN;
    float* const dwe = dw + (u64)e * N * K;
    if (lo == hi) {
        if (overwrite) {
            // K is a multiple of 8, so a column pair is entirely inside or outside.
            for (u32 i = threadIdx.x; i < BM * BN / 2; i += Cfg<BM, BN, WNT, BK, ST>::THREADS) {
                const u64 r = n0 + i / (BN / 2), c = k0 + 2 * (i % (BN / 2));
                if (r < N && c < K) *reinterpret_cast<float2*>(dwe + r * K + c) = make_float2(0.0f, 0.0f);
            }
        }
        return;
    }
    const Operand A = {dy, N, n0, N, hi};  // element (n, r) at dy[r·N + n]
    const Operand B = {x, K, k0, K, hi};   // element (k, r) at x[r·K + k]
    float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4];
    mainloop<BM, BN, WNT, BK, ST, true, true>(A, B, lo, hi, acc);
    store_tile<BM, BN, WNT, BK, ST>(dwe, K, n0, N, k0, K, acc, overwrite ? STORE_ADD_ZERO : STORE_ADD);
}

#define GROUPED_ARGS                                                                                  \
    const u16 *__restrict__ a, const u16 *__restrict__ b, const u32 *__restrict__ off, float *__restrict__ out, \
        u32 E, u32 R, u32 N, u32 K
// Entry points: suffix 64 = 64 × 64 tiles, 128 threads; 128 = 128 × 128 tiles, 256 threads;
// 32x128 = 32 × 128 tiles, 256 threads; all with four stages 32 deep; 128k64 = 128 × 128
// tiles, 256 threads, three stages 64 deep (half the barriers per reduction step). Warp tiles
// (BM / 2) × 32.
#define GROUPED_ENTRY(OP, SUFFIX, BM, BN, WNT, BK, ST, LB)                                     \
    extern "C" __global__ void __launch_bounds__ LB                                   \
        grouped_##OP##_t##SUFFIX(GROUPED_ARGS) {                                     \
        grouped_##OP##_body<BM, BN, WNT, BK, ST>(a, b, off, out, E, R, N, K);                \
    }
// The wgrad's entry points take `overwrite` (0: dw += Σ; otherwise dw = +0 + Σ, not read).
#define TN_ENTRY(SUFFIX, BM, BN, WNT, BK, ST, LB)                                            \
    extern "C" __global__ void __launch_bounds__ LB                                   \
        grouped_tn_t##SUFFIX(GROUPED_ARGS, u32 overwrite) {                          \
        grouped_tn_body<BM, BN, WNT, BK, ST>(a, b, off, out, E, R, N, K, overwrite != 0);    \
    }
// LB: the launch bounds (threads = Cfg::THREADS; the 64-deep tile also asks for two resident
// blocks, i.e. at most 128 registers per thread, which the 32-deep ones reach unasked).
#define GROUPED_TILES(OP)                             \
    OP(64, 64, 64, 32, 32, 4, (128))                  \
    OP(128, 128, 128, 32, 32, 4, (256))               \
    OP(32x128, 32, 128, 32, 32, 4, (256))             \
    OP(128k64, 128, 128, 32, 64, 3, (256, 2))
#define NT_ENTRY(SUFFIX, BM, BN, WNT, BK, ST, LB) GROUPED_ENTRY(nt, SUFFIX, BM, BN, WNT, BK, ST, LB)
#define NN_ENTRY(SUFFIX, BM, BN, WNT, BK, ST, LB) GROUPED_ENTRY(nn, SUFFIX, BM, BN, WNT, BK, ST, LB)
GROUPED_TILES(NT_ENTRY)
GROUPED_TILES(NN_ENTRY)
GROUPED_TILES(TN_ENTRY)

// ---- Small-M forwards (decode): the weight bytes are read once, with 16-byte loads, and
// applied to all rows (up to SM_RB rows per pass; more rows take more passes over the same,
// cache-resident, weight slice). One warp owns NB output columns; lane l sums k = 8l + 256i + h
// in increasing i, then h, then a butterfly over the lanes (warp_sum). The U weight chunks of
// consecutive i are loaded before any is used (U·NB 16-byte loads in flight per lane); that
// changes when bytes arrive, not the order of the sums. Each term is __fmaf_rn(x, w, acc):
// a product of two BF16 values has at most 16 significant bits, so it is exact in f32 unless
// it falls below f32's normal range (|x·w| < 2⁻¹²⁶), and the fused add gives the bits of the
// IEEE multiply-then-add wherever the product is exact (the bound two_order_sum_bound holds
// either way: an unrounded product is only closer).
#define SM_WARPS 8
#define SM_RB 8  // rows per pass

__device__ __forceinline__ void widen8(uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        f[2 * q] = __uint_as_float(w[q] << 16);
        f[2 * q + 1] = __uint_as_float(w[q] & 0xFFFF0000u);
    }
}

// acc[r][q] = Σ_k x_r[k]·w_q[k] for rows r < nr (xr[r]: row r's K elements) and columns q < NB
// (wr[q]: that column's K weights), in the lane order above; acc is this lane's partial (the
// caller reduces it with warp_sum). K is a multiple of 8; x and w rows 16-byte aligned.
template <int NB, int U>
__device__ __forceinline__ void small_m_dot(const u16* const (&xr)[SM_RB], u32 nr, const u16* const (&wr)[NB],
                                            u32 K, int lane, float (&acc)[SM_RB][NB]) {
#pragma unroll
    for (int r = 0; r < SM_RB; ++r)
#pragma unroll
        for (int q = 0; q < NB; ++q) acc[r][q] = 0.0f;
    for (u32 k0 = (u32)lane * 8; k0 < K; k0 += 256 * U) {
        uint4 raw[U][NB];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (k0 + 256 * u < K)
#pragma unroll
                for (int q = 0; q < NB; ++q) raw[u][q] = *reinterpret_cast<const uint4*>(wr[q] + k0 + 256 * u);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 k = k0 + 256 * u;
            if (k >= K) break;
            float wv[NB][8];
#pragma unroll
            for (int q = 0; q < NB; ++q) widen8(raw[u][q], wv[q]);
#pragma unroll
            for (int r = 0; r < SM_RB; ++r) {
                if ((u32)r < nr) {
                    float xv[8];
                    widen8(*reinterpret_cast<const uint4*>(xr[r] + k), xv);
#pragma unroll
                    for (int q = 0; q < NB; ++q)
#pragma unroll
                        for (int h = 0; h < 8; ++h) acc[r][q] = __fmaf_rn(xv[h], wv[q][h], acc[r][q]);
                }
            }
        }
    }
}

// One pass of up to SM_RB rows: small_m_dot, then the warp sums; lane q < NB stores row r's
// column q at yp[r·ldy + q] (yp: the pass's first row at the warp's first column).
template <int NB, int U>
__device__ __forceinline__ void small_m_pass(const u16* const (&xr)[SM_RB], u32 nr, const u16* const (&wr)[NB],
                                             u32 K, int lane, float* yp, u64 ldy) {
    float acc[SM_RB][NB];
    small_m_dot<NB, U>(xr, nr, wr, K, lane, acc);
#pragma unroll
    for (int r = 0; r < SM_RB; ++r) {
        if ((u32)r < nr) {
#pragma unroll
            for (int q = 0; q < NB; ++q) {
                const float s = warp_sum(acc[r][q]);
                if (lane == q) yp[r * ldy + q] = s;
            }
        }
    }
}

// Forward, small M: y[r, n] = Σ_k x[r, k]·w[e][n, k] (same operands and layout as
// grouped_nt_tiled). Grid (ceil(N / (SM_WARPS·SM_NB)), E), block SM_WARPS·32. Warp w of block
// (bx, e) owns columns (bx·SM_WARPS + w)·SM_NB .. +SM_NB of expert e.
#define SM_NB 4  // output columns per warp
#define SM_U 2   // chunks in flight
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
    grouped_nt_small_m(const u16* __restrict__ x, const u16* __restrict__ w, const u32* __restrict__ off,
                       float* __restrict__ y, u32 E, u32 R, u32 N, u32 K) {
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    if (lo == hi) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 n0 = ((u64)blockIdx.x * SM_WARPS + warp) * SM_NB;
    if (n0 >= N) return;  // N is a multiple of 8, so n0 < N implies n0 + SM_NB <= N
    const u16* we = w + (u64)e * N * K + n0 * K;
    const u16* wr[SM_NB];
#pragma unroll
    for (int q = 0; q < SM_NB; ++q) wr[q] = we + q * (u64)K;
    for (u64 rb = lo; rb < hi; rb += SM_RB) {
        const u32 nr = (u32)min((u64)SM_RB, hi - rb);
        const u16* xr[SM_RB];
#pragma unroll
        for (int r = 0; r < SM_RB; ++r) xr[r] = x + (rb + min((u32)r, nr - 1)) * K;
        small_m_pass<SM_NB, SM_U>(xr, nr, wr, K, lane, y + rb * N + n0, N);
    }
}

// Fused MoE gate/up + SwiGLU, small M (decode): for packed row p of expert e (rows
// offsets[e]..offsets[e+1]), token t = min(perm[p] / top_k, T − 1) (perm: packed row →
// token·top_k + slot),
//   g = Σ_k x[t, k]·w[e][j, k],  u = Σ_k x[t, k]·w[e][F + j, k],
//   act[p, j] = bf16(silu(g)·u),
// each sum exactly as grouped_nt_small_m sums that column, so act has the bits of gathering the
// rows, grouped_nt_small_m over w [E, 2F, K], then swiglu_fwd_bf16_only. Warp w of block (bx, e)
// owns features j = (bx·SM_WARPS + w)·2 .. +2 (its NB = 4 columns: two gate, two up). Grid
// (ceil(F / (2·SM_WARPS)), E); F and K multiples of 8.
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
    grouped_gate_up_swiglu_small_m(const u16* __restrict__ x, const u32* __restrict__ perm, u32 top_k, u32 T,
                                   const u16* __restrict__ w, const u32* __restrict__ off,
                                   u16* __restrict__ act, u32 E, u32 R, u32 F, u32 K) {
    const u32 e = blockIdx.y;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    if (lo == hi || T == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 j0 = ((u64)blockIdx.x * SM_WARPS + warp) * 2;
    if (j0 >= F) return;  // F is even, so j0 < F implies j0 + 2 <= F
    const u16* we = w + (u64)e * 2 * F * K;
    const u16* const wr[4] = {we + j0 * K, we + (j0 + 1) * K, we + (F + j0) * K, we + (F + j0 + 1) * K};
    for (u64 rb = lo; rb < hi; rb += SM_RB) {
        const u32 nr = (u32)min((u64)SM_RB, hi - rb);
        const u16* xr[SM_RB];
#pragma unroll
        for (int r = 0; r < SM_RB; ++r) {
            const u32 t = min(perm[rb + min((u32)r, nr - 1)] / top_k, T - 1);
            xr[r] = x + (u64)t * K;
        }
        float acc[SM_RB][4];
        small_m_dot<4, SM_U>(xr, nr, wr, K, lane, acc);
#pragma unroll
        for (int r = 0; r < SM_RB; ++r) {
            if ((u32)r < nr) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const float g = warp_sum(acc[r][q]), u = warp_sum(acc[r][2 + q]);
                    if (lane == q) act[(rb + r) * F + j0 + q] = f32_to_bf16(__fmul_rn(swiglu_silu(g), u));
                }
            }
        }
    }
}

// Fused MoE down projection, combine and residual, small M (decode, BF16 experts): for token t,
// its valid slots s in ascending packed row order (moe_token_order: the combine's order), row
// p = row_of[t·top_k + s] of expert e = ids[t·top_k + s], and column j < H,
//   y_s = Σ_k act[p, k]·w[e][j, k]   (summed exactly as grouped_nt_small_m sums column j),
//   out[t, j] = (((0 + rw_s0·y_s0) + rw_s1·y_s1) + …) + res[t, j]   (res may be null),
// which are the bits of grouped_nt_small_m over w [E, H, F] into y [R, H], then moe_combine
// with the residual, without the f32 y. Warp w of block (bx, t) owns column bx·SM_WARPS + w;
// it loads the weight chunks of DC_G experts, DC_U chunks deep, before using any (DC_G·DC_U
// 16-byte loads in flight per lane), and each expert's sum keeps the lane order of
// small_m_dot. Grid (ceil(H / SM_WARPS), T); F a multiple of 8; act and w 16-byte aligned.
#define DC_G 4  // experts in flight
#define DC_U 3  // chunks per expert in flight
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
    grouped_down_combine_small_m(const u16* __restrict__ act, const u32* __restrict__ ids,
                                 const u32* __restrict__ row_of, const float* __restrict__ rw, u32 top_k,
                                 const u16* __restrict__ w, const float* __restrict__ res,
                                 float* __restrict__ out, u32 E, u32 H, u32 F) {
    __shared__ u32 rows_s[MOE_MAX_TOP_K];
    __shared__ float w_s[MOE_MAX_TOP_K];
    __shared__ u32 order_s[MOE_MAX_TOP_K];
    __shared__ u32 e_s[MOE_MAX_TOP_K];
    const u64 t = blockIdx.y;
    for (u32 s = threadIdx.x; s < top_k; s += blockDim.x) e_s[s] = min(ids[t * top_k + s], E - 1);
    const u32 nv = moe_token_order(row_of, rw, t, top_k, rows_s, w_s, order_s);  // barriers inside
    const int lane = threadIdx.x & 31;
    const u64 j = (u64)blockIdx.x * SM_WARPS + (threadIdx.x >> 5);
    if (j >= H) return;
    float o = 0.0f;
    for (u32 q0 = 0; q0 < nv; q0 += DC_G) {
        const u32 g = min((u32)DC_G, nv - q0);
        const u16* wr[DC_G];
        const u16* xr[DC_G];
#pragma unroll
        for (int q = 0; q < DC_G; ++q) {
            const u32 s = order_s[q0 + min((u32)q, g - 1)];
            wr[q] = w + ((u64)e_s[s] * H + j) * F;
            xr[q] = act + (u64)rows_s[s] * F;
        }
        float acc[DC_G];
#pragma unroll
        for (int q = 0; q < DC_G; ++q) acc[q] = 0.0f;
        for (u32 k0 = (u32)lane * 8; k0 < F; k0 += 256 * DC_U) {
            uint4 raw[DC_U][DC_G];
#pragma unroll
            for (int u = 0; u < DC_U; ++u)
                if (k0 + 256 * u < F)
#pragma unroll
                    for (int q = 0; q < DC_G; ++q)
                        if ((u32)q < g) raw[u][q] = *reinterpret_cast<const uint4*>(wr[q] + k0 + 256 * u);
#pragma unroll
            for (int u = 0; u < DC_U; ++u) {
                const u32 k = k0 + 256 * u;
                if (k >= F) break;
#pragma unroll
                for (int q = 0; q < DC_G; ++q) {
                    if ((u32)q < g) {
                        float wv[8], xv[8];
                        widen8(raw[u][q], wv);
                        widen8(*reinterpret_cast<const uint4*>(xr[q] + k), xv);
#pragma unroll
                        for (int h = 0; h < 8; ++h) acc[q] = __fmaf_rn(xv[h], wv[h], acc[q]);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < DC_G; ++q) {
            if ((u32)q < g) {
                const float y = warp_sum(acc[q]);
                o = __fadd_rn(o, __fmul_rn(w_s[order_s[q0 + q]], y));
            }
        }
    }
    if (lane == 0) out[t * H + j] = res != nullptr ? __fadd_rn(o, res[t * H + j]) : o;
}

// Dense forward, small M, of up to three weights sharing one input (a layer's q, k and v
// projections; or one linear): y_i[r, n] = Σ_k x[r, k]·w_i[n, k] for r < M, n < N_i, summed as
// grouped_nt_small_m sums. Warp w of block bx owns DS_NB columns; the blocks run over w_0's
// column groups, then w_1's, then w_2's (N_i = 0: no blocks). Grid Σ_i ceil(N_i / (SM_WARPS·
// DS_NB)); every N_i and K multiples of 8. Two entry points: DS_NB = 2 (wide outputs) and 1
// (narrow ones such as a router, so more warps share the bytes).
// The output of block blockIdx.x among the up to three (blocks run over w_0's column groups,
// then w_1's, then w_2's) and the first of this warp's NB columns in it.
struct SmallMSlot {
    const u16* w;
    float* y;
    u32 n;
    u64 c0;
};
template <int NB>
__device__ __forceinline__ SmallMSlot small_m_slot(const u16* w0, float* y0, u32 n0, const u16* w1, float* y1, u32 n1,
                                                   const u16* w2, float* y2, u32 n2) {
    constexpr u32 COLS = SM_WARPS * NB;
    const u32 b0 = (n0 + COLS - 1) / COLS, b1 = (n1 + COLS - 1) / COLS;
    u32 bx = blockIdx.x;
    SmallMSlot o;
    if (bx < b0) {
        o.w = w0, o.y = y0, o.n = n0;
    } else if (bx < b0 + b1) {
        o.w = w1, o.y = y1, o.n = n1, bx -= b0;
    } else {
        o.w = w2, o.y = y2, o.n = n2, bx -= b0 + b1;
    }
    o.c0 = ((u64)bx * SM_WARPS + (threadIdx.x >> 5)) * NB;
    return o;
}

template <int NB>
__device__ __forceinline__ void dense_small_m_body(const u16* __restrict__ x, u32 M, u32 K, const u16* w0, float* y0,
                                                   u32 n0, const u16* w1, float* y1, u32 n1, const u16* w2,
                                                   float* y2, u32 n2) {
    const SmallMSlot o = small_m_slot<NB>(w0, y0, n0, w1, y1, n1, w2, y2, n2);
    const u16* const w = o.w;
    float* const y = o.y;
    const u32 N = o.n;
    const int lane = threadIdx.x & 31;
    const u64 c0 = o.c0;
    if (c0 >= N) return;  // N is a multiple of 8, so c0 < N implies c0 + NB <= N
    const u16* wr[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) wr[q] = w + (c0 + q) * K;
    for (u64 rb = 0; rb < M; rb += SM_RB) {
        const u32 nr = (u32)min((u64)SM_RB, M - rb);
        const u16* xr[SM_RB];
#pragma unroll
        for (int r = 0; r < SM_RB; ++r) xr[r] = x + (rb + min((u32)r, nr - 1)) * K;
        small_m_pass<NB, 8 / NB>(xr, nr, wr, K, lane, y + rb * N + c0, N);
    }
}
#define DENSE_SMALL_M_ARGS                                                                                  \
    const u16 *__restrict__ x, u32 M, u32 K, const u16 *w0, float *y0, u32 n0, const u16 *w1, float *y1, u32 n1, \
        const u16 *w2, float *y2, u32 n2
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32) dense_nt_small_m_nb2(DENSE_SMALL_M_ARGS) {
    dense_small_m_body<2>(x, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2);
}
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32) dense_nt_small_m_nb1(DENSE_SMALL_M_ARGS) {
    dense_small_m_body<1>(x, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2);
}

// RMSNorm of the rows, then dense_nt_small_m of their BF16 rounding (decode's attention input
// and its q, k and v projections): per pass of up to SM_RB rows, the block (SM_WARPS·32 = 256
// threads) normalizes each row into shared memory as rmsnorm_fwd_bf16 does with its 256-thread
// block (rms_row_rstd over the same threads, then bf16((x·rstd)·w)), so for K >= 256 the
// operands are that kernel's bits; the warps then sum from shared memory exactly as
// dense_small_m_body sums from global memory. Dynamic shared memory: min(M, SM_RB)·K BF16.
//
// ADD (decode's residual add, norm and router; M <= SM_RB, one pass): the rows are x = o + res,
// formed, squared and summed as add_rmsnorm_fwd does with its 256-thread block (each thread
// its columns in row_batched order) and kept in shared memory (after the BF16 rows:
// M·K f32 more); block 0 also writes add_rmsnorm_fwd's outputs — the sums to an.x, rstd,
// the normalized rows to an.y (f32, when not null) and an.yb (BF16) — so every output has the
// bits of add_rmsnorm_fwd followed by dense_nt_small_m.
struct AddNormOut {
    const float* res;
    float* x;
    float* y;
    u16* yb;
    float* rstd;
};
template <int NB, bool ADD>
__device__ __forceinline__ void rmsnorm_dense_small_m_body(const float* __restrict__ x, const float* __restrict__ nw,
                                                           float eps, u32 M, u32 K, const u16* w0, float* y0, u32 n0,
                                                           const u16* w1, float* y1, u32 n1, const u16* w2,
                                                           float* y2, u32 n2, AddNormOut an) {
    extern __shared__ __align__(16) u16 gemm_xs[];
    __shared__ float scratch[32];
    const SmallMSlot o = small_m_slot<NB>(w0, y0, n0, w1, y1, n1, w2, y2, n2);
    const u16* const w = o.w;
    float* const y = o.y;
    const u32 N = o.n;
    const int lane = threadIdx.x & 31;
    const u64 c0 = o.c0;
    const u16* wr[NB];
#pragma unroll
    for (int q = 0; q < NB; ++q) wr[q] = w + (c0 + q) * K;
    for (u64 rb = 0; rb < M; rb += SM_RB) {
        const u32 nr = (u32)min((u64)SM_RB, M - rb);
        for (u32 r = 0; r < nr; ++r) {
            const u64 row = (rb + r) * K;
            const float* xr = x + row;
            float rs;
            if (ADD) {
                float* sr = reinterpret_cast<float*>(gemm_xs + (u64)M * K) + (u64)r * K;
                const bool first = blockIdx.x == 0;
                float ss = 0.0f;
                row_batched(
                    K, [&](u64 j) { return make_float2(xr[j], an.res[row + j]); },
                    [&](u64 j, float2 xres) {
                        const float v = __fadd_rn(xres.x, xres.y);
                        sr[j] = v;
                        if (first) an.x[row + j] = v;
                        ss = __fadd_rn(ss, __fmul_rn(v, v));
                    });
                rs = rms_rstd_of_sum(block_sum(ss, scratch), K, eps);
                xr = sr;  // each thread reads back only the sums it wrote itself
                if (first) {
                    if (threadIdx.x == 0) an.rstd[rb + r] = rs;
                    if (an.y != nullptr) rmsnorm_scale_row<true, true>(xr, nw, rs, an.y + row, an.yb + row, K);
                    else rmsnorm_scale_row<false, true>(xr, nw, rs, nullptr, an.yb + row, K);
                }
            } else {
                rs = rms_row_rstd(xr, K, eps, scratch);
            }
            rmsnorm_scale_row<false, true>(xr, nw, rs, nullptr, gemm_xs + r * K, K);
        }
        __syncthreads();
        if (c0 < N) {  // N is a multiple of 8, so c0 < N implies c0 + NB <= N
            const u16* xr[SM_RB];
#pragma unroll
            for (int r = 0; r < SM_RB; ++r) xr[r] = gemm_xs + min((u32)r, nr - 1) * K;
            small_m_pass<NB, 8 / NB>(xr, nr, wr, K, lane, y + rb * N + c0, N);
        }
        __syncthreads();  // the next pass overwrites the rows
    }
}
#define RMSNORM_DENSE_SMALL_M_ARGS                                                                         \
    const float *__restrict__ x, const float *__restrict__ nw, float eps, u32 M, u32 K, const u16 *w0, float *y0, \
        u32 n0, const u16 *w1, float *y1, u32 n1, const u16 *w2, float *y2, u32 n2
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32) rmsnorm_dense_small_m_nb2(RMSNORM_DENSE_SMALL_M_ARGS) {
    rmsnorm_dense_small_m_body<2, false>(x, nw, eps, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2, AddNormOut{});
}
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32) rmsnorm_dense_small_m_nb1(RMSNORM_DENSE_SMALL_M_ARGS) {
    rmsnorm_dense_small_m_body<1, false>(x, nw, eps, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2, AddNormOut{});
}
// x = the attention's projection o; an.res the residual (see ADD above).
#define ADD_RMSNORM_DENSE_SMALL_M_ARGS                                                                     \
    RMSNORM_DENSE_SMALL_M_ARGS, const float *__restrict__ res, float *x_out, float *y_out, u16 *yb_out, float *rstd
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
    add_rmsnorm_dense_small_m_nb2(ADD_RMSNORM_DENSE_SMALL_M_ARGS) {
    rmsnorm_dense_small_m_body<2, true>(x, nw, eps, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2,
                                        AddNormOut{res, x_out, y_out, yb_out, rstd});
}
extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
    add_rmsnorm_dense_small_m_nb1(ADD_RMSNORM_DENSE_SMALL_M_ARGS) {
    rmsnorm_dense_small_m_body<1, true>(x, nw, eps, M, K, w0, y0, n0, w1, y1, n1, w2, y2, n2,
                                        AddNormOut{res, x_out, y_out, yb_out, rstd});
}
