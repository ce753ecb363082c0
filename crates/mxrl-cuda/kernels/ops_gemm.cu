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
// Reduction rows of one part before the next part's (the wgrad of stacked parts; Loader):
// the wgmma tile's stage depth, a multiple of every tile's BK.
#define PART_ROWS 64

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
//
// Parts (the wgrad of an operand given as P stacked parts, P > 1): the stages walk the
// reduction in PART_ROWS-row groups, each group once per part (part p's source is the
// operand's shifted by p·pstride), so a group of H = PART_ROWS / BK stages is issued P times
// before the walk moves on. With P = 1 (H = 1) every stage moves on: the plain walk.
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
    u64 pstride, poff;    // elements between two parts' sources; the next stage's part's offset
    u32 parts, halves;    // P and H (comment above)
    u32 part, half;       // the next stage's part and stage within its row group

    __device__ __forceinline__ void init(const Operand& op, u64 red_lo, u32 nparts = 1, u32 nhalves = 1,
                                         u64 part_stride = 0) {
        base = op.p;
        red_next = red_lo;
        red_end = op.red_end;
        step = MN ? (u64)BK * op.ld : (u64)BK;
        pstride = part_stride;
        poff = 0;
        parts = nparts;
        halves = nhalves;
        part = 0;
        half = 0;
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
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + dst[c]),
                         "l"(ok ? src[c] + poff : base), "r"(n)
                         : "memory");
        }
        // The next stage: the group's next one; else the group again for the next part; else
        // the next group.
        if (++half < halves) {
            advance(1);
            return;
        }
        half = 0;
        if (++part < parts) {
            poff += pstride;
            advance(-(long long)(halves - 1));
        } else {
            part = 0;
            poff = 0;
            advance(1);
        }
    }

    // Moves the stage walk by `by` stages along the reduction.
    __device__ __forceinline__ void advance(long long by) {
#pragma unroll
        for (int c = 0; c < PER; ++c)
            if (out_ok[c]) src[c] += by * (long long)step;
        red_next += by * BK;
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
//
// With parts > 1, B is given as that many parts (part p: B's source shifted by p·b_pstride
// elements) and acc = Σ_p Σ_r A(o_m, r)·B_p(o_n, r): the rows in groups of PART_ROWS in
// increasing order, each group's rows of part 0, 1, …, parts − 1 in turn (the Loader's walk;
// A's rows are read again for each part). The k16 groups and their order do not depend on BK,
// so every tile (and the wgmma one, whose stage is one group) adds the same products in the
// same k16 groups in the same order.
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
                                         float acc[Cfg<BM, BN, WNT, BK, ST>::MI][Cfg<BM, BN, WNT, BK, ST>::NJ][4],
                                         u32 parts = 1, u64 b_pstride = 0) {
    typedef Cfg<BM, BN, WNT, BK, ST> C;
    static_assert(PART_ROWS % BK == 0, "a part's row group is whole stages");
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
    // H stages per row group (one with a single part), P·H stages per group.
    const u32 halves = parts > 1 ? PART_ROWS / C::BK : 1;
    const u64 span = (u64)C::BK * halves;
    const u64 nk64 = red_end > red_lo ? (red_end - red_lo + span - 1) / span * parts * halves : 0;
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
    la.init(A, red_lo, parts, halves, 0);
    lb.init(B, red_lo, parts, halves, b_pstride);
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
// With parts > 1, x is [parts, R, K] (the parts of one operand, stacked) and the sum runs over
// every part's rows of the expert: Σ_p Σ_r dy[r, n]·x_p[r, k], in the order of mainloop's parts
// (row groups of PART_ROWS, each group's rows of part 0, 1, … in turn), added to dw once.
template <int BM, int BN, int WNT, int BK, int ST>
__device__ __forceinline__ void grouped_tn_body(const u16* __restrict__ dy, const u16* __restrict__ x,
                                                const u32* __restrict__ off, float* __restrict__ dw, u32 E, u32 R,
                                                u32 N, u32 K, bool overwrite, u32 parts) {
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
    mainloop<BM, BN, WNT, BK, ST, true, true>(A, B, lo, hi, acc, parts, (u64)R * K);
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
// The wgrad's entry points take `overwrite` (0: dw += Σ; otherwise dw = +0 + Σ, not read) and
// `parts` (≥ 1: x holds that many stacked [R, K] parts, all summed; grouped_tn_body).
#define TN_ENTRY(SUFFIX, BM, BN, WNT, BK, ST, LB)                                                \
    extern "C" __global__ void __launch_bounds__ LB                                       \
        grouped_tn_t##SUFFIX(GROUPED_ARGS, u32 overwrite, u32 parts) {                   \
        grouped_tn_body<BM, BN, WNT, BK, ST>(a, b, off, out, E, R, N, K, overwrite != 0, parts); \
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

// ---- Hopper warpgroup kernels (sm_90a: `wgmma`). Tile 128 × 256 outputs per block of two
// warpgroups (256 threads); warpgroup g owns output rows 64·g .. 64·g + 63 and all 256
// columns (m64n256k16, 128 f32 accumulators per thread). Operand tiles are staged 64 deep
// along the reduction, WG_ST stages of both operands in dynamic shared memory (1024-byte
// aligned), filled with 16-byte cp.async copies (zero-filled outside the valid range) in the
// 128-byte swizzled layouts the tensor cores read through matrix descriptors:
// - K-contiguous ("K-major") tile [ROWS][64]: row i is 128 bytes at i·128; its 16-byte chunk
//   c (reduction 8c .. 8c + 7) sits at chunk position c ^ (i & 7). Descriptor: stride between
//   8-row groups (SBO) 1024 bytes, leading offset unused (1); the k16 step s starts 32·s bytes
//   into the row.
// - MN-contiguous ("MN-major") tile: 64-wide output groups (atoms) of 64 reduction rows × 128
//   bytes, 8192 bytes apart (LBO); in atom a, reduction row j holds outputs 64a .. 64a + 63
//   with 16-byte chunk c at position c ^ (j & 7); 8-row groups 1024 bytes apart (SBO); the
//   k16 step s starts 2048·s bytes in.
// The descriptors' layouts are CUTLASS's canonical GMMA layouts (cute/atom/
// mma_traits_sm90_gmma.hpp, SW128, K-major and MN-major). The accumulator fragment of
// m64nNk16 is mma.m16n8's per warp (warp w of the group: rows 16w + g, 16w + g + 8; regs
// 4j .. 4j + 3 cover columns 8j + 2t, 8j + 2t + 1). Each instruction adds one k16 group of
// products to the accumulators, as an mma.sync m16n8k16 does, and the groups come in the
// mma.sync kernels' order (stages in increasing order, k16 steps in increasing order within
// a stage), so the sums are theirs bit for bit (deterministic, no atomics).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BM 128
#define WG_BN 256
#define WG_BK 64
#define WG_ST 4
#define WG_THREADS 256
#define WG_ATOM 8192u                                          // bytes of one MN-major atom
#define WG_A_BYTES (WG_BM * WG_BK * 2)                         // one stage of A (16 KB)
#define WG_B_BYTES (WG_BN * WG_BK * 2)                         // one stage of B (32 KB)
// Dynamic shared memory: WG_ST stages of both, plus 1024 bytes to align the first (the
// launcher's Tile::smem_bytes).

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units, 14 bits each), 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's completed cp.async writes to shared memory before the tensor cores'
// (async proxy) reads that follow the next barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d += A·B for one m64n256k16 step; TA / TB: the operand is MN-major (transposed).
template <int TA, int TB>
__device__ __forceinline__ void wgmma_256(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

// The cp.async copies of one operand tile, ROWS outputs × 64 reductions per stage, in the
// swizzled layouts above. Thread x copies chunks v = x + 256·c: K-major, row v / 8, chunk
// v % 8 (the same chunk and row & 7 for every c); MN-major, reduction row v / (ROWS / 8),
// output chunk v % (ROWS / 8) (the same for every c). So a thread keeps one source pointer,
// one destination offset and its bound, and a stage costs a compare and a copy per chunk.
template <bool MN, int ROWS>
struct WgLoader {
    static constexpr int PER = ROWS * WG_BK / 8 / WG_THREADS;       // chunks per thread
    static constexpr int CPR = MN ? ROWS / 8 : WG_BK / 8;          // chunks per tile row
    static constexpr int RSTEP = WG_THREADS / CPR;                 // tile rows between c and c + 1
    const u16* base;
    const u16* src;   // chunk 0's source at the next stage to issue
    u64 ld;           // elements between rows of the source
    u32 dst;          // chunk 0's byte offset in a stage's tile
    u32 out_room;     // K-major: valid rows from this thread's first row (0 if none)
    u32 red0;         // this thread's reduction offset in a stage (K-major: chunk·8; MN: its row)
    u64 red_next, red_end;
    u64 pstride, poff;  // parts (wg_mainloop's): elements between two parts; the next stage's offset
    u32 parts, part;    // the parts and the next stage's part

    __device__ __forceinline__ void init(const Operand& op, u64 red_lo, u32 nparts = 1, u64 part_stride = 0) {
        base = op.p;
        ld = op.ld;
        red_next = red_lo;
        red_end = op.red_end;
        parts = nparts;
        part = 0;
        pstride = part_stride;
        poff = 0;
        const u32 x = threadIdx.x;
        const u32 a = x / CPR, b = x % CPR;  // (tile row, chunk in row) of chunk 0
        if (MN) {
            // a: reduction row j; b: output chunk (atom b / 8, chunk b % 8 in the atom).
            dst = (b / 8) * WG_ATOM + a * 128 + (((b % 8) ^ (a & 7)) << 4);
            const u64 o = op.out0 + 8 * b;
            out_room = o < op.out_end ? 1u : 0u;
            red0 = a;
            src = out_room ? op.p + (red_lo + a) * op.ld + o : op.p;
        } else {
            // a: output row i; b: reduction chunk.
            dst = a * 128 + ((b ^ (a & 7)) << 4);
            const u64 o = op.out0 + a;
            out_room = o < op.out_end ? (u32)min(op.out_end - o, (u64)0xFFFFFFFFu) : 0u;
            red0 = 8 * b;
            src = out_room ? op.p + o * op.ld + red_lo + 8 * b : op.p;
        }
    }

    __device__ __forceinline__ void issue(u32 tile) {
#pragma unroll
        for (int c = 0; c < PER; ++c) {
            // MN-major: chunk c is reduction row red0 + c·RSTEP; K-major: output row c·RSTEP on.
            const bool ok = MN ? out_room != 0 && red_next + red0 + (u64)(c * RSTEP) < red_end
                               : (u32)(c * RSTEP) < out_room && red_next + red0 < red_end;
            const u16* s = src + poff + (u64)(c * RSTEP) * ld;
            const u32 n = ok ? 16u : 0u;  // src-size 0: nothing is read, the 16 bytes are zeroed
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tile + dst + (u32)(c * RSTEP * 128)),
                         "l"(ok ? s : base), "r"(n)
                         : "memory");
        }
        // The next stage: the same rows of the next part, else the next rows (of part 0).
        if (++part < parts) {
            poff += pstride;
            return;
        }
        part = 0;
        poff = 0;
        if (out_room) src += MN ? (u64)WG_BK * ld : (u64)WG_BK;
        red_next += WG_BK;
    }
};

// acc = Σ_{r in [red_lo, red_end)} A(o_m, r)·B(o_n, r) for the block's 128 × 256 tile: stages
// of 64 in increasing order, each as four k16 steps in increasing order. Pipeline: WG_ST - 2
// stages of copies in flight ahead of the stage being multiplied; the copies of stage
// kt + WG_ST - 2 go to the buffer of stage kt - 2, whose multiplies every warpgroup has
// waited for (wgmma.wait_group 1 after issuing stage kt - 1) before the barrier of stage kt.
//
// With parts > 1 (B in parts as in mainloop; a stage is one PART_ROWS row group), stage kt
// multiplies rows group kt / parts of A by part kt % parts of B: the sum of mainloop's parts,
// in its order. A's tile of a group is copied once, with the group's first stage, into A
// buffer (kt / parts) % WG_ST, and kept for the group's other stages: the copy of group g
// (issued at iteration parts·g − 2) overwrites group g − WG_ST's buffer, whose last stage
// parts·g − parts·(WG_ST − 1) − 1 ≤ parts·g − 4 every warpgroup is done with by then, and
// groups g − 3 .. g − 1, still in use, have the other buffers.
template <bool A_MN, bool B_MN>
__device__ __forceinline__ void wg_mainloop(const Operand& A, const Operand& B, u64 red_lo, u64 red_end,
                                            float (&acc)[128], u32 parts = 1, u64 b_pstride = 0) {
    extern __shared__ __align__(128) u8 wg_smem[];
    const u32 s0 = (smem_addr(wg_smem) + 1023u) & ~1023u;
    const u32 As = s0, Bs = s0 + WG_ST * WG_A_BYTES;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    static_assert(WG_BK == PART_ROWS, "a stage is one part's row group");
    const u64 nk64 = red_end > red_lo ? (red_end - red_lo + WG_BK - 1) / WG_BK * parts : 0;
    if (nk64 == 0) return;
    const u32 nk = (u32)nk64;
    const u32 wg = threadIdx.x >> 7;
    WgLoader<A_MN, WG_BM> la;
    WgLoader<B_MN, WG_BN> lb;
    la.init(A, red_lo);
    lb.init(B, red_lo, parts, b_pstride);
#pragma unroll
    for (int st = 0; st < WG_ST - 2; ++st) {
        if ((u32)st < nk) {
            if ((u32)st % parts == 0) la.issue(As + ((u32)st / parts % WG_ST) * WG_A_BYTES);
            lb.issue(Bs + st * WG_B_BYTES);
        }
        cp_async_commit();
    }
    // This warpgroup's A rows: K-major, 64 rows = 8 row groups of 1024 bytes; MN-major, atom wg.
    const u32 a_off = A_MN ? wg * WG_ATOM : wg * 64u * 128u;
    constexpr u32 A_K16 = A_MN ? 2048u : 32u, B_K16 = B_MN ? 2048u : 32u;
    constexpr u32 A_LBO = A_MN ? WG_ATOM : 16u, B_LBO = B_MN ? WG_ATOM : 16u;
    for (u32 kt = 0; kt < nk; ++kt) {
        cp_async_wait<WG_ST - 3>();  // this thread's copies of stage kt have landed
        fence_proxy_async();
        __syncthreads();  // everyone's have; every warpgroup is done with stage kt - 2
        const u32 nxt = kt + WG_ST - 2;
        if (nxt < nk) {
            if (nxt % parts == 0) la.issue(As + (nxt / parts % WG_ST) * WG_A_BYTES);
            lb.issue(Bs + (nxt % WG_ST) * WG_B_BYTES);
        }
        cp_async_commit();
        const u32 cur = kt % WG_ST;
        const u32 a_st = As + (kt / parts % WG_ST) * WG_A_BYTES + a_off, b_st = Bs + cur * WG_B_BYTES;
        wg_fence();
#pragma unroll
        for (int s = 0; s < WG_BK / 16; ++s)
            wgmma_256<A_MN ? 1 : 0, B_MN ? 1 : 0>(acc, wg_desc(a_st + s * A_K16, A_LBO, 1024u),
                                                  wg_desc(b_st + s * B_K16, B_LBO, 1024u));
        wg_commit();
        wg_wait<1>();
    }
    wg_wait<0>();
}

// out[(row0 + m)·ld + col0 + c] (mode as store_tile) for the 128 × 256 tile. STORE_ADD reads
// the old values of 8 column groups (16 float2) before it writes any, so the loads overlap
// instead of waiting on each other's stores. With x_amax (STORE_SET only), each sum is stored
// as fl(sum · α), α = fl(fl(x_amax[r] · wa) · MXRL_NVFP4_ALPHA_FACTOR_INV): the bits of
// storing the sums and then running nvfp4_scale_rows (ops_qgemm) over the rows. With wfactor
// instead (STORE_SET only), every sum is stored as fl(sum · wa): the bits of storing the sums
// and then running nvfp4_scale_rows with per_row 0 (QGemm::nvfp4_weight_factor_rows), whose
// factor is wa = fl(w_amax[e] · R2688).
__device__ __forceinline__ void wg_store(float* __restrict__ out, u64 ld, u64 row0, u64 row_end, u64 col0,
                                         u64 col_end, const float (&acc)[128], int mode,
                                         const float* __restrict__ x_amax = nullptr, float wa = 0.0f,
                                         bool wfactor = false) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const u64 rbase = row0 + 64 * (warp >> 2) + 16 * (warp & 3) + g;
    float alpha[2] = {1.0f, 1.0f};
    const bool scaled = x_amax != nullptr || wfactor;
    if (x_amax != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (rbase + h * 8 < row_end)
                alpha[h] = __fmul_rn(__fmul_rn(x_amax[rbase + h * 8], wa), MXRL_NVFP4_ALPHA_FACTOR_INV);
    } else if (wfactor) {
        alpha[0] = wa;
        alpha[1] = wa;
    }
    constexpr int JB = 8;  // column groups per batch
#pragma unroll
    for (int j0 = 0; j0 < WG_BN / 8; j0 += JB) {
        float2 old[JB][2];
#pragma unroll
        for (int jj = 0; jj < JB; ++jj)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u64 c = col0 + (j0 + jj) * 8 + 2 * t, r = rbase + h * 8;
                old[jj][h] = make_float2(0.0f, 0.0f);
                if (mode == STORE_ADD && c < col_end && r < row_end)
                    old[jj][h] = *reinterpret_cast<const float2*>(out + r * ld + c);
            }
#pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
            const int j = j0 + jj;
            const u64 c = col0 + j * 8 + 2 * t;
            if (c >= col_end) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u64 r = rbase + h * 8;
                if (r >= row_end) continue;
                float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                if (mode != STORE_SET) {
                    v.x = __fadd_rn(old[jj][h].x, v.x);
                    v.y = __fadd_rn(old[jj][h].y, v.y);
                } else if (scaled) {
                    v.x = __fmul_rn(v.x, alpha[h]);
                    v.y = __fmul_rn(v.y, alpha[h]);
                }
                *reinterpret_cast<float2*>(out + r * ld + c) = v;
            }
        }
    }
}

// The three grouped GEMMs on the warpgroup tile (shapes, grids and outputs as the mma.sync
// entries above, with BM = 128, BN = 256). Forward (NN false) and dgrad (NN true) share a
// body: rows of expert e times its weight [N, K], the reduction over K (forward) or N (dgrad),
// the output columns N or K; the weight is K-contiguous for the forward, MN-contiguous for the
// dgrad. x_amax and w_amax: NVFP4's α per row (wg_store); w_amax alone (the dgrad): each
// expert's per-tensor weight factor fl(w_amax[e] · R2688).
template <bool NN>
__device__ __forceinline__ void wg_row_body(const u16* __restrict__ a, const u16* __restrict__ b,
                                            const u32* __restrict__ off, float* __restrict__ out, u32 E, u32 R,
                                            u32 N, u32 K, const float* __restrict__ x_amax,
                                            const float* __restrict__ w_amax) {
    __shared__ u32 job[3];
    locate_row_tile<WG_BM>(off, E, R, blockIdx.y, job);
    if (job[0] == NO_EXPERT) return;
    const u64 e = job[0], r0 = job[1], r1 = job[2];
    const u64 red = NN ? N : K, cols = NN ? K : N;
    const u64 c0 = (u64)blockIdx.x * WG_BN;
    const Operand A = {a, red, r0, r1, red};
    const Operand B = {b + e * (u64)N * K, K, c0, cols, red};
    float acc[128];
    wg_mainloop<false, NN>(A, B, 0, red, acc);
    const bool wfactor = x_amax == nullptr && w_amax != nullptr;
    const float wa = x_amax != nullptr ? w_amax[e] : (wfactor ? __fmul_rn(w_amax[e], MXRL_R2688) : 0.0f);
    wg_store(out, cols, r0, r1, c0, cols, acc, STORE_SET, x_amax, wa, wfactor);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) grouped_nt_tw128x256(GROUPED_ARGS) {
    wg_row_body<false>(a, b, off, out, E, R, N, K, nullptr, nullptr);
}
// The forward with NVFP4's α applied to each row as it is stored (wg_store): y = fl(Σ · α),
// x_amax [R] the rows' amax, w_amax [E] the experts'.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
    grouped_nt_tw128x256_alpha(GROUPED_ARGS, const float* __restrict__ x_amax, const float* __restrict__ w_amax) {
    wg_row_body<false>(a, b, off, out, E, R, N, K, x_amax, w_amax);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) grouped_nn_tw128x256(GROUPED_ARGS) {
    wg_row_body<true>(a, b, off, out, E, R, N, K, nullptr, nullptr);
}
// The dgrad of NVFP4 weights given as their e2m1 × e4m3 values, with each expert's per-tensor
// factor applied as the sums are stored (wg_store): dx = fl(Σ · fl(w_amax[e] · R2688)).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
    grouped_nn_tw128x256_wfactor(GROUPED_ARGS, const float* __restrict__ w_amax) {
    wg_row_body<true>(a, b, off, out, E, R, N, K, nullptr, w_amax);
}
// The wgrad (grouped_tn_body's, with its `parts`).
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
    grouped_tn_tw128x256(GROUPED_ARGS, u32 overwrite, u32 parts) {
    const u32 e = blockIdx.z;
    u32 lo, hi;
    expert_rows(off, e, R, lo, hi);
    const u64 n0 = (u64)blockIdx.x * WG_BM, k0 = (u64)blockIdx.y * WG_BN;
    float* const dwe = out + (u64)e * N * K;
    float acc[128];
    if (lo == hi) {
        if (overwrite) {
#pragma unroll
            for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
            wg_store(dwe, K, n0, N, k0, K, acc, STORE_SET);
        }
        return;
    }
    const Operand A = {a, N, n0, N, hi};  // element (n, r) at dy[r·N + n]
    const Operand B = {b, K, k0, K, hi};  // element (k, r) at x[r·K + k]
    wg_mainloop<true, true>(A, B, lo, hi, acc, parts, (u64)R * K);
    wg_store(dwe, K, n0, N, k0, K, acc, overwrite ? STORE_ADD_ZERO : STORE_ADD);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

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
