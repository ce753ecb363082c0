// cuemu's runtime: fibers for CUDA threads, barriers, warp collectives, cp.async groups, and
// the PTX data movement and conversions declared in cuemu.h. x86-64 Linux.
#include "cuemu.h"

#include <sys/mman.h>

#include <string>

extern "C" void cuemu_switch(void** save_sp, void* to_sp);
asm(R"(
.text
.globl cuemu_switch
.type cuemu_switch,@function
cuemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size cuemu_switch, .-cuemu_switch
)");

namespace cuemu {

namespace {
constexpr size_t STACK = 256 * 1024;
constexpr size_t SMEM_MAX = 232448;  // sm_90's largest opt-in dynamic shared memory per block
// 256 KB aligned: the dynamic window's shared addresses are 2^31 + offset, so the 18-bit
// address of a wgmma matrix descriptor is the offset itself.
alignas(262144) unsigned char g_smem[SMEM_MAX];

struct Copy {
    void* dst;
    const void* src;
    unsigned cp, n;
};
}  // namespace

struct Thread {
    void* sp = nullptr;
    unsigned char* stack = nullptr;  // mapping base (a guard page below the stack)
    dim3 tid;
    unsigned linear = 0;
    bool done = false;
    const char* waiting = "";
    // While blocked: the generation counter it waits on and the value it saw (the scheduler
    // does not resume it until the counter moves).
    const unsigned long long* wait_on = nullptr;
    unsigned long long wait_gen = 0;
    std::vector<Copy> open;                 // issued, not yet committed
    std::vector<std::vector<Copy>> groups;  // committed, oldest first
};

Thread* g_cur = nullptr;
const uintptr_t g_shared_base = (uintptr_t)g_smem - (uintptr_t{1} << 31);

namespace {
void* g_sched_sp = nullptr;
dim3 g_block, g_grid, g_bdim;
unsigned g_smem_bytes = 0;
const std::function<void()>* g_body = nullptr;
std::vector<Thread> g_threads;
unsigned long long g_progress = 0;
unsigned g_live = 0;
// __syncthreads
unsigned g_bar_arrived = 0;
unsigned long long g_bar_gen = 0;
// warp collectives
struct Warp {
    unsigned arrived = 0, mask = 0;
    unsigned long long gen = 0;
    unsigned char ins[32][64];
    unsigned char outs[32][64];
};
std::vector<Warp> g_warps;
std::vector<unsigned> g_warp_live;  // lanes of each warp that have not exited

void yield_to_scheduler() { cuemu_switch(&g_cur->sp, g_sched_sp); }

void fiber_entry() {
    (*g_body)();
    Thread* t = g_cur;
    // Copies still in flight land at exit (nothing can wait for them any more).
    for (auto& g : t->groups)
        for (auto& c : g) {
            std::memset(c.dst, 0, c.cp);
            std::memcpy(c.dst, c.src, c.n);
        }
    t->done = true;
    --g_live;
    ++g_progress;
    g_warp_live[t->linear / 32] &= ~(1u << (t->linear % 32));
    // An exit can complete a barrier the others are waiting at.
    if (g_bar_arrived > 0 && g_bar_arrived == g_live) {
        g_bar_arrived = 0;
        ++g_bar_gen;
    }
    yield_to_scheduler();
    fail("a finished fiber was resumed");
}

void start_fiber(Thread& t) {
    if (!t.stack) {
        void* m = mmap(nullptr, STACK + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) fail("mmap of a fiber stack");
        mprotect(m, 4096, PROT_NONE);
        t.stack = (unsigned char*)m;
    }
    uintptr_t top = ((uintptr_t)t.stack + 4096 + STACK) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                      // fake return address of fiber_entry
    *--sp = (void*)&fiber_entry;          // popped by cuemu_switch's ret
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12..r15
    t.sp = sp;
    t.done = false;
    t.wait_on = nullptr;
    t.open.clear();
    t.groups.clear();
}
}  // namespace

[[noreturn]] void fail(const char* what) {
    if (g_cur)
        std::fprintf(stderr, "cuemu: %s (block %u,%u,%u thread %u,%u,%u)\n", what, g_block.x, g_block.y, g_block.z,
                     g_cur->tid.x, g_cur->tid.y, g_cur->tid.z);
    else
        std::fprintf(stderr, "cuemu: %s\n", what);
    std::abort();
}

const dim3& thread_idx() { return g_cur->tid; }
const dim3& block_idx() { return g_block; }
const dim3& block_dim() { return g_bdim; }
const dim3& grid_dim() { return g_grid; }
unsigned char* dyn_smem() { return g_smem; }
unsigned g_smem_bytes_now() { return g_smem_bytes; }
unsigned lane_id() { return g_cur->linear % 32; }

void syncthreads() {
    const unsigned long long gen = g_bar_gen;
    ++g_progress;
    if (++g_bar_arrived == g_live) {
        g_bar_arrived = 0;
        ++g_bar_gen;
        return;
    }
    g_cur->waiting = "__syncthreads";
    g_cur->wait_on = &g_bar_gen;
    g_cur->wait_gen = gen;
    while (g_bar_gen == gen) yield_to_scheduler();
    g_cur->wait_on = nullptr;
    g_cur->waiting = "";
}

void warp_collective(unsigned mask, const void* in, unsigned in_bytes, void* out, unsigned out_bytes,
                     void (*combine)(const unsigned char (*)[64], unsigned char (*)[64], unsigned)) {
    const unsigned w = g_cur->linear / 32, lane = g_cur->linear % 32;
    Warp& s = g_warps[w];
    if (!((mask >> lane) & 1u)) fail("warp collective called by a lane outside its mask");
    if ((mask & g_warp_live[w]) != mask) fail("warp collective whose mask names an exited lane");
    if (s.arrived == 0) s.mask = mask;
    else if (s.mask != mask) fail("lanes of one warp in collectives with different masks");
    std::memcpy(s.ins[lane], in, in_bytes);
    s.arrived |= 1u << lane;
    ++g_progress;
    if (s.arrived == mask) {
        combine(s.ins, s.outs, mask);
        s.arrived = 0;
        ++s.gen;
    } else {
        const unsigned long long gen = s.gen;
        g_cur->waiting = "warp collective";
        g_cur->wait_on = &s.gen;
        g_cur->wait_gen = gen;
        while (s.gen == gen) yield_to_scheduler();
        g_cur->wait_on = nullptr;
        g_cur->waiting = "";
    }
    std::memcpy(out, s.outs[lane], out_bytes);
}

void syncwarp(unsigned mask) {
    unsigned char in = 0;
    unsigned out;
    warp_collective(mask, &in, 1, &out, 4, ballot_combine);
}

void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size) {
    if (src_size > cp_size) fail("cp.async source size above the copy size");
    if ((uintptr_t)dst % cp_size) fail("cp.async shared destination misaligned");
    if (src_size && (uintptr_t)src % cp_size) fail("cp.async global source misaligned");
    if ((unsigned char*)dst >= g_smem && (unsigned char*)dst + cp_size > g_smem + g_smem_bytes)
        fail("cp.async past the dynamic shared memory of the launch");
    g_cur->open.push_back({dst, src, cp_size, src_size});
}
void cp_async_commit() {
    g_cur->groups.push_back(std::move(g_cur->open));
    g_cur->open.clear();
}
void cp_async_wait(unsigned n) {
    auto& g = g_cur->groups;
    while (g.size() > n) {
        for (auto& c : g.front()) {
            std::memset(c.dst, 0, c.cp);
            std::memcpy(c.dst, c.src, c.n);
        }
        g.erase(g.begin());
    }
}

void launch(dim3 grid, dim3 block, unsigned smem, const std::function<void()>& body) {
    if (smem > SMEM_MAX) fail("dynamic shared memory above 227 KB");
    const unsigned n = block.x * block.y * block.z;
    if (n == 0 || n > 1024) fail("block size outside 1..1024");
    if (g_threads.size() < n) g_threads.resize(n);
    g_warps.assign((n + 31) / 32, Warp{});
    g_grid = grid;
    g_bdim = block;
    g_smem_bytes = smem;
    g_body = &body;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                g_block = {bx, by, bz};
                // Shared memory starts as NaN bytes: a read before a write shows.
                std::memset(g_smem, 0xFF, smem);
                g_warp_live.assign((n + 31) / 32, 0);
                for (unsigned i = 0; i < n; ++i) {
                    Thread& t = g_threads[i];
                    t.linear = i;
                    t.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
                    start_fiber(t);
                    g_warp_live[i / 32] |= 1u << (i % 32);
                }
                g_live = n;
                g_bar_arrived = 0;
                while (g_live > 0) {
                    const unsigned long long before = g_progress;
                    for (unsigned i = 0; i < n; ++i) {
                        Thread& t = g_threads[i];
                        if (t.done || (t.wait_on && *t.wait_on == t.wait_gen)) continue;
                        g_cur = &t;
                        cuemu_switch(&g_sched_sp, t.sp);
                    }
                    if (g_progress == before && g_live > 0) {
                        for (unsigned i = 0; i < n; ++i)
                            if (!g_threads[i].done) {
                                g_cur = &g_threads[i];
                                std::string w = std::string("deadlock: waiting at ") + g_threads[i].waiting;
                                fail(w.c_str());
                            }
                    }
                }
                g_cur = nullptr;
            }
}

// ---- conversions (bit-exact; tables where the domain is small) ----
namespace {
float f16_to_f32_slow(unsigned short h) {
    const unsigned sg = (h >> 15) & 1u, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? __uint_as_float(0x7FC00000u) : __uint_as_float(0x7F800000u);
    else v = std::ldexp((float)(m | 0x400u), (int)e - 25);
    return sg ? -v : v;
}
float e4m3_to_f32_slow(unsigned char c) {
    const unsigned sg = c >> 7, e = (c >> 3) & 0xFu, m = c & 7u;
    if ((c & 0x7F) == 0x7F) return __uint_as_float(0x7FC00000u);
    const float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(m | 8u), (int)e - 10);
    return sg ? -v : v;
}
struct Tables {
    std::vector<float> f16, e4m3;
    Tables() : f16(65536), e4m3(256) {
        for (unsigned i = 0; i < 65536; ++i) f16[i] = f16_to_f32_slow((unsigned short)i);
        for (unsigned i = 0; i < 256; ++i) e4m3[i] = e4m3_to_f32_slow((unsigned char)i);
    }
};
const Tables& tables() {
    static const Tables t;
    return t;
}
}  // namespace
float f16_to_f32(unsigned short h) { return tables().f16[h]; }
// Round to nearest even on the bits (normal: at mantissa bit 13; subnormal: a right shift of
// the full significand); NaN → 0x7FFF, beyond the largest finite (≥ 65520) → ±Inf.
unsigned short f32_to_f16_rn(float f) {
    const unsigned x = __float_as_uint(f), sg = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7FFF;
    if (a >= 0x477FF000u) return (unsigned short)(sg | 0x7C00u);
    if (a >= 0x38800000u) {
        const unsigned r = a + 0x0FFFu + ((a >> 13) & 1u);
        return (unsigned short)(sg | ((r - 0x38000000u) >> 13));
    }
    if (a < 0x33000000u) return (unsigned short)sg;  // below 2^-25 (and 2^-25 itself, a tie to 0)
    const unsigned e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
    unsigned r = m >> sh;
    const unsigned rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (unsigned short)(sg | r);
}
unsigned short f32_to_bf16_rn(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float e4m3_to_f32(unsigned char c) { return tables().e4m3[c]; }
unsigned char f32_to_e4m3_satfinite_rn(float f) {
    if (std::isnan(f)) return 0x7F;
    const unsigned char s = std::signbit(f) ? 0x80 : 0;
    const float a = std::fabs(f);
    if (a >= 464.0f) return s | 0x7E;  // beyond 448 + half a step: saturate (also Inf)
    int e;
    std::frexp(a, &e);
    int q = e - 4;
    if (q < -9) q = -9;
    const double v = std::ldexp(std::nearbyint(std::ldexp((double)a, -q)), q);
    for (unsigned c = 0; c < 0x7F; ++c)
        if ((double)e4m3_to_f32((unsigned char)c) == v) return s | (unsigned char)c;
    fail("e4m3 rounding found no code");
}

}  // namespace cuemu

// ---- ldmatrix and mma ----
namespace cuemu_ptx {
namespace {
struct LdIn {
    unsigned addr;
    unsigned trans;
};
void ldmatrix_combine(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned) {
    LdIn in[32];
    for (int l = 0; l < 32; ++l) std::memcpy(&in[l], ins[l], sizeof(LdIn));
    for (int l = 0; l < 32; ++l) {
        unsigned r[4];
        for (int i = 0; i < 4; ++i) {
            unsigned short lo, hi;
            if (!in[l].trans) {
                const unsigned char* row = (const unsigned char*)cuemu_shared_ptr(in[8 * i + l / 4].addr);
                std::memcpy(&lo, row + 4 * (l % 4), 2);
                std::memcpy(&hi, row + 4 * (l % 4) + 2, 2);
            } else {
                const unsigned char* r0 = (const unsigned char*)cuemu_shared_ptr(in[8 * i + 2 * (l % 4)].addr);
                const unsigned char* r1 = (const unsigned char*)cuemu_shared_ptr(in[8 * i + 2 * (l % 4) + 1].addr);
                std::memcpy(&lo, r0 + 2 * (l / 4), 2);
                std::memcpy(&hi, r1 + 2 * (l / 4), 2);
            }
            r[i] = lo | ((unsigned)hi << 16);
        }
        std::memcpy(outs[l], r, 16);
    }
}
struct MmaIn {
    int kind;
    unsigned a[4], b[2];
    float c[4];
};
double elem(int kind, unsigned word, int j) {
    if (kind == 2) return cuemu::e4m3_to_f32((word >> (8 * j)) & 0xFF);
    const unsigned short h = (word >> (16 * j)) & 0xFFFF;
    return kind == 0 ? (double)__uint_as_float((unsigned)h << 16) : (double)cuemu::f16_to_f32(h);
}
void mma_combine(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned) {
    MmaIn in[32];
    for (int l = 0; l < 32; ++l) std::memcpy(&in[l], ins[l], sizeof(MmaIn));
    const int kind = in[0].kind;
    for (int l = 1; l < 32; ++l)
        if (in[l].kind != kind) cuemu::fail("mma lanes disagree on the operand type");
    const int K = kind == 2 ? 32 : 16, per = kind == 2 ? 4 : 2;
    double A[16][32], B[32][8];
    float C[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int j = 0; j < per; ++j) {
            const int k0 = per * t + j, k1 = k0 + K / 2;
            A[g][k0] = elem(kind, in[l].a[0], j);
            A[g + 8][k0] = elem(kind, in[l].a[1], j);
            A[g][k1] = elem(kind, in[l].a[2], j);
            A[g + 8][k1] = elem(kind, in[l].a[3], j);
            B[k0][g] = elem(kind, in[l].b[0], j);
            B[k1][g] = elem(kind, in[l].b[1], j);
        }
        C[g][2 * t] = in[l].c[0];
        C[g][2 * t + 1] = in[l].c[1];
        C[g + 8][2 * t] = in[l].c[2];
        C[g + 8][2 * t + 1] = in[l].c[3];
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        float d[4];
        const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
        for (int q = 0; q < 4; ++q) {
            double s = C[rows[q]][cols[q]];
            for (int k = 0; k < K; ++k) s += A[rows[q]][k] * B[k][cols[q]];
            d[q] = (float)s;
        }
        std::memcpy(outs[l], d, 16);
    }
}
}  // namespace

void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr, bool trans) {
    if (addr % 16) cuemu::fail("ldmatrix row address not 16-byte aligned");
    LdIn in{addr, trans ? 1u : 0u};
    unsigned r[4];
    cuemu::warp_collective(0xFFFFFFFFu, &in, sizeof in, r, 16, ldmatrix_combine);
    r0 = r[0];
    r1 = r[1];
    r2 = r[2];
    r3 = r[3];
}

void mma(int kind, float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
         unsigned b0, unsigned b1) {
    MmaIn in{kind, {a0, a1, a2, a3}, {b0, b1}, {d0, d1, d2, d3}};
    float d[4];
    cuemu::warp_collective(0xFFFFFFFFu, &in, sizeof in, d, 16, mma_combine);
    d0 = d[0];
    d1 = d[1];
    d2 = d[2];
    d3 = d[3];
}

// ---- wgmma (m64nNk16, f32 += bf16 · bf16, both operands in shared memory) ----
// Each thread computes its own accumulators at issue time, straight from shared memory: the
// kernels may not write a stage's buffers before the wgmma.wait_group and barrier that follow
// its multiplies, so the values are those the tensor cores would read. Per k16 step the 16
// exact products and the accumulator are added in f64 and rounded once, as `mma` above.
namespace {
// The byte at element (mn, k) of a descriptor's matrix: CUTLASS's canonical SW128 layouts
// (K-major: 8-row groups SBO apart, rows 128 bytes; MN-major: 64-wide atoms LBO apart, 8-row
// groups of the reduction SBO apart, rows 128 bytes), then the 128-byte swizzle on the
// shared address (bits 4-6 ^= bits 7-9).
const unsigned char* wg_elem(unsigned long long desc, bool mn_major, int mn, int k) {
    if ((desc >> 62) != 1) cuemu::fail("wgmma: only the 128-byte swizzle is modelled");
    if ((desc >> 49) & 7) cuemu::fail("wgmma: a nonzero descriptor base offset is not modelled");
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4, sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    unsigned a = mn_major ? start + (mn / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (mn % 64) * 2
                          : start + (mn / 8) * sbo + (mn % 8) * 128 + k * 2;
    a ^= ((a >> 7) & 7u) << 4;
    if (a + 2 > cuemu::g_smem_bytes_now()) cuemu::fail("wgmma: a descriptor reads past the dynamic shared memory");
    return (const unsigned char*)cuemu_shared_ptr((1u << 31) + a);
}
double wg_bf16(const unsigned char* p) {
    unsigned short h;
    std::memcpy(&h, p, 2);
    return elem(0, h, 0);
}
}  // namespace

void wgmma_bf16(int n, unsigned long long da, unsigned long long db, unsigned scale_d, int ta, int tb, float* const* d) {
    const unsigned x = cuemu::thread_idx().x % 128, w = x / 32, lane = x % 32, g = lane / 4, t = lane % 4;
    for (int j = 0; j < n / 8; ++j)
        for (int q = 0; q < 4; ++q) {
            const int m = 16 * w + g + 8 * (q >> 1), c = 8 * j + 2 * t + (q & 1);
            double s = scale_d ? (double)*d[4 * j + q] : 0.0;
            for (int k = 0; k < 16; ++k) s += wg_bf16(wg_elem(da, ta != 0, m, k)) * wg_bf16(wg_elem(db, tb != 0, c, k));
            *d[4 * j + q] = (float)s;
        }
}
}  // namespace cuemu_ptx
