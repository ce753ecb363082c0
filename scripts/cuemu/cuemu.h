// cuemu: runs the engine's CUDA kernels on the host, one CUDA thread per fiber, so that a
// kernel's indexing, barriers, shared-memory staging and warp-level data movement can be
// checked on a machine without a GPU (scripts/cuemu.sh). A kernel source goes through
// rewrite.py first (inline PTX becomes calls into this header, __shared__ becomes static
// storage, extern "C" entries move into a namespace per source version).
//
// What it models exactly: integer and f32 arithmetic (SSE, round to nearest even, no FMA
// contraction, denormals kept: the kernels' --fmad=false --ftz=false), the binary16 / BF16 /
// E4M3 conversions the kernels spell in PTX, shuffles, ballots, ldmatrix, cp.async (copies are
// deferred until the cp.async.wait_group that covers them, with the source-size zero fill),
// __syncthreads (a barrier over the block's threads that have not exited), and wgmma with both
// BF16 operands in shared memory (CUTLASS's canonical 128-byte-swizzled layouts read through
// the matrix descriptors; each thread's accumulators computed when it issues the instruction,
// so a kernel that overwrites a stage before waiting for its wgmma group is not caught). What
// it does not: timing, occupancy, and the tensor cores' internal summation: mma.sync adds the
// exact products of a tile (and the accumulator) in f64 and rounds once, which is one valid
// order but not the hardware's, so two kernels agree bit for bit here exactly when they issue
// the same mma sequence on the same fragments (a wgmma k16 step adds each output's 16 products
// as one mma does). Misuse that the hardware would not report reliably is a hard error: a warp
// collective whose lanes do not all arrive (deadlock), an exited lane in a collective's mask.
#pragma once
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#define __CUDA_ARCH__ 900
#define __CUDA_ARCH_FEAT_SM90_ALL 1  // the op modules are compiled for compute_90a on sm_90
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
    unsigned x, y;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
    float x, y;
};
struct __attribute__((aligned(16))) int4 {
    int x, y, z, w;
};
struct __attribute__((aligned(8))) ushort4 {
    unsigned short x, y, z, w;
};
struct __attribute__((aligned(4))) ushort2 {
    unsigned short x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

namespace cuemu {
struct Thread;
extern Thread* g_cur;
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dyn_smem();
unsigned g_smem_bytes_now();  // the running launch's dynamic shared memory
void syncthreads();
void syncwarp(unsigned mask);
[[noreturn]] void fail(const char* what);
// A warp collective: every lane of `mask` deposits `in_bytes` and waits for the others; the
// last to arrive runs `combine(ins, outs)` over all 32 slots; each lane gets its slot of outs.
void warp_collective(unsigned mask, const void* in, unsigned in_bytes, void* out, unsigned out_bytes,
                     void (*combine)(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned mask));
unsigned lane_id();
void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size);
void cp_async_commit();
void cp_async_wait(unsigned n);

// One kernel launch: `body` runs once per thread of every block (blocks in order, the threads
// of a block as fibers); `smem` bytes of dynamic shared memory per block.
void launch(dim3 grid, dim3 block, unsigned smem, const std::function<void()>& body);
}  // namespace cuemu

#define threadIdx (cuemu::thread_idx())
#define blockIdx (cuemu::block_idx())
#define blockDim (cuemu::block_dim())
#define gridDim (cuemu::grid_dim())
#define warpSize 32

inline void __syncthreads() { cuemu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { cuemu::syncwarp(mask); }
inline void __trap() { cuemu::fail("__trap"); }

// ---- bit casts and scalar intrinsics ----
template <class To, class From>
inline To cuemu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
    To r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
inline float __uint_as_float(unsigned u) { return cuemu_bits<float>(u); }
inline unsigned __float_as_uint(float f) { return cuemu_bits<unsigned>(f); }
inline float __int_as_float(int u) { return cuemu_bits<float>(u); }
inline int __float_as_int(float f) { return cuemu_bits<int>(f); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __double2float_rn(double a) { return (float)a; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline unsigned __brev(unsigned v) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}
// CUDA's __byte_perm: selector nibbles use their low three bits only.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}
template <class T>
inline T __ldg(const T* p) {
    return *p;
}
template <class A, class B>
inline typename std::common_type<A, B>::type min(A a, B b) {
    return a < b ? a : b;
}
template <class A, class B>
inline typename std::common_type<A, B>::type max(A a, B b) {
    return a < b ? b : a;
}
// CUDA's fmaxf / fminf (PTX max.f32 / min.f32): a NaN operand, quiet or signaling, gives
// the other operand; -0 < +0. (glibc's turn a signaling NaN into NaN.)
inline float cuemu_fmaxf(float a, float b) {
    if (a != a) return b;
    if (b != b) return a;
    if (a == b) return std::signbit(a) ? b : a;
    return a > b ? a : b;
}
inline float cuemu_fminf(float a, float b) {
    if (a != a) return b;
    if (b != b) return a;
    if (a == b) return std::signbit(a) ? a : b;
    return a < b ? a : b;
}
inline float max(float a, float b) { return cuemu_fmaxf(a, b); }
inline float min(float a, float b) { return cuemu_fminf(a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a < b ? b : a; }

// Shared-window addresses: offsets from a base 2 GiB below the launch's shared memory, so the
// static __shared__ arrays of the same binary (within ±2 GiB of it) get 32-bit addresses.
namespace cuemu {
extern const uintptr_t g_shared_base;
}
inline unsigned __cvta_generic_to_shared(const void* p) {
    const uintptr_t a = (uintptr_t)p - cuemu::g_shared_base;
    if (a >> 32) cuemu::fail("a shared-memory pointer outside the 4 GiB window of this binary");
    return (unsigned)a;
}
inline void* cuemu_shared_ptr(unsigned a) { return (void*)(cuemu::g_shared_base + a); }

// ---- warp intrinsics ----
namespace cuemu {
template <class T>
struct ShflArg {
    T v;
    int src;
};
template <class T, int Mode>
void shfl_combine(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned mask) {
    for (int l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        ShflArg<T> a;
        std::memcpy(&a, ins[l], sizeof a);
        int s = a.src;
        if (s < 0 || s > 31 || !((mask >> s) & 1u)) s = l;  // a lane outside the group keeps its own value
        ShflArg<T> b;
        std::memcpy(&b, ins[s], sizeof b);
        std::memcpy(outs[l], &b.v, sizeof(T));
    }
}
// width: segments of `width` lanes (a power of two ≤ 32), as CUDA's shfl.
template <class T, int Mode>
T shfl(unsigned mask, T v, int arg, int width) {
    const int lane = (int)lane_id();
    const int base = lane & ~(width - 1);
    int src;
    if (Mode == 0) src = base + (arg & (width - 1));                           // idx
    else if (Mode == 1) src = (lane - arg) >= base ? lane - arg : lane;       // up
    else if (Mode == 2) src = (lane + arg) < base + width ? lane + arg : lane;  // down
    else src = ((lane ^ arg) & ~(width - 1)) == base ? (lane ^ arg) : lane;     // xor
    ShflArg<T> a{v, src};
    T out;
    warp_collective(mask, &a, sizeof a, &out, sizeof out, shfl_combine<T, Mode>);
    return out;
}
inline void ballot_combine(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned mask) {
    unsigned r = 0;
    for (int l = 0; l < 32; ++l)
        if ((mask >> l) & 1u && ins[l][0]) r |= 1u << l;
    for (int l = 0; l < 32; ++l) std::memcpy(outs[l], &r, 4);
}
}  // namespace cuemu
template <class T>
inline T __shfl_sync(unsigned m, T v, int s, int w = 32) {
    return cuemu::shfl<T, 0>(m, v, s, w);
}
template <class T>
inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
    return cuemu::shfl<T, 1>(m, v, (int)d, w);
}
template <class T>
inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
    return cuemu::shfl<T, 2>(m, v, (int)d, w);
}
template <class T>
inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) {
    return cuemu::shfl<T, 3>(m, v, x, w);
}
inline unsigned __ballot_sync(unsigned m, int p) {
    unsigned char in = p != 0;
    unsigned out;
    cuemu::warp_collective(m, &in, 1, &out, 4, cuemu::ballot_combine);
    return out;
}
namespace cuemu {
template <class T>
void match_combine(const unsigned char (*ins)[64], unsigned char (*outs)[64], unsigned mask) {
    for (int l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        unsigned r = 0;
        for (int o = 0; o < 32; ++o)
            if ((mask >> o) & 1u && std::memcmp(ins[l], ins[o], sizeof(T)) == 0) r |= 1u << o;
        std::memcpy(outs[l], &r, 4);
    }
}
}  // namespace cuemu
template <class T>
inline unsigned __match_any_sync(unsigned m, T v) {
    unsigned out;
    cuemu::warp_collective(m, &v, sizeof v, &out, 4, cuemu::match_combine<T>);
    return out;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, p) == (m & __ballot_sync(m, 1)); }

// ---- the PTX the kernels spell (rewrite.py maps each asm statement to one of these) ----
namespace cuemu {
float f16_to_f32(unsigned short h);
unsigned short f32_to_f16_rn(float f);
unsigned short f32_to_bf16_rn(float f);
float e4m3_to_f32(unsigned char c);
unsigned char f32_to_e4m3_satfinite_rn(float f);
}  // namespace cuemu

namespace cuemu_ptx {
inline void cvt_rn_satfinite_e4m3x2_f32(unsigned short& r, float hi, float lo) {
    r = (unsigned short)(cuemu::f32_to_e4m3_satfinite_rn(lo) | (cuemu::f32_to_e4m3_satfinite_rn(hi) << 8));
}
// max.NaN.f32: NaN (canonical) if either operand is NaN, else the larger (+0 over −0).
inline void max_nan_f32(float& d, float a, float b) {
    if (a != a || b != b) {
        d = __uint_as_float(0x7FFFFFFFu);
    } else if (a == b) {
        d = __uint_as_float(__float_as_uint(a) & __float_as_uint(b));
    } else {
        d = a > b ? a : b;
    }
}
inline void cvt_rn_f16x2_e4m3x2(unsigned& h, unsigned short pair) {
    const unsigned short lo = cuemu::f32_to_f16_rn(cuemu::e4m3_to_f32(pair & 0xFF));
    const unsigned short hi = cuemu::f32_to_f16_rn(cuemu::e4m3_to_f32(pair >> 8));
    h = lo | ((unsigned)hi << 16);
}
inline void f16x2_to_f32x2(float& lo, float& hi, unsigned h) {
    lo = cuemu::f16_to_f32(h & 0xFFFF);
    hi = cuemu::f16_to_f32(h >> 16);
}
inline void mul_rn_f16x2(unsigned& d, unsigned a, unsigned b) {
    // Products of binary16 values are exact in f32 (22 significant bits), so one rounding.
    const unsigned short lo = cuemu::f32_to_f16_rn(cuemu::f16_to_f32(a & 0xFFFF) * cuemu::f16_to_f32(b & 0xFFFF));
    const unsigned short hi = cuemu::f32_to_f16_rn(cuemu::f16_to_f32(a >> 16) * cuemu::f16_to_f32(b >> 16));
    d = lo | ((unsigned)hi << 16);
}
inline void fma_rn_bf16x2(unsigned& d, unsigned a, unsigned b, unsigned c) {
    unsigned r = 0;
    for (int h = 0; h < 2; ++h) {
        const double x = __uint_as_float(((a >> (16 * h)) & 0xFFFF) << 16);
        const double y = __uint_as_float(((b >> (16 * h)) & 0xFFFF) << 16);
        const double z = __uint_as_float(((c >> (16 * h)) & 0xFFFF) << 16);
        // x·y is exact in f64 (16 significant bits); + z exact unless the exponents are far
        // apart, where the f32 rounding below cannot change the BF16 result.
        const float v = (float)(x * y + z);
        r |= (unsigned)cuemu::f32_to_bf16_rn(v) << (16 * h);
    }
    d = r;
}
inline void cvt_rn_bf16x2_f32(unsigned& d, float hi, float lo) {
    d = cuemu::f32_to_bf16_rn(lo) | ((unsigned)cuemu::f32_to_bf16_rn(hi) << 16);
}
inline void cvt_rn_f16x2_f32(unsigned& d, float hi, float lo) {
    d = cuemu::f32_to_f16_rn(lo) | ((unsigned)cuemu::f32_to_f16_rn(hi) << 16);
}
// prmt.b32 d, a, b, c (default mode): selector nibble bit 3 replicates the chosen byte's sign.
inline void prmt_b32(unsigned& d, unsigned a, unsigned b, unsigned c) {
    const unsigned long long v = ((unsigned long long)b << 32) | a;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (c >> (4 * i)) & 0xFu;
        unsigned byte = (unsigned)(v >> (8 * (sel & 7u))) & 0xFFu;
        if (sel & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
        r |= byte << (8 * i);
    }
    d = r;
}
inline void cp_async_16(unsigned dst, const void* src, unsigned n) { cuemu::cp_async(cuemu_shared_ptr(dst), src, 16, n); }
inline void cp_async_4(unsigned dst, const void* src, unsigned n) { cuemu::cp_async(cuemu_shared_ptr(dst), src, 4, n); }
inline void cp_async_commit() { cuemu::cp_async_commit(); }
inline void cp_async_wait(unsigned n) { cuemu::cp_async_wait(n); }
// griddepcontrol.wait / launch_dependents: cuemu runs a stream's work in order, one grid at a
// time, so every grid a kernel depends on has finished before it starts.
inline void grid_dependency() {}
void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr, bool trans);
// wgmma.mma_async m64nNk16 f32 += bf16·bf16 with both operands from shared-memory descriptors
// (ta / tb: MN-major), computed for the calling thread's N / 2 accumulators when issued; the
// fences and the commit / wait of its groups have nothing left to order.
void wgmma_bf16(int n, unsigned long long da, unsigned long long db, unsigned scale_d, int ta, int tb, float* const* d);
template <class... F>
inline void wgmma_bf16_n(unsigned long long da, unsigned long long db, unsigned scale_d, int ta, int tb, F&... d) {
    float* const p[] = {&d...};
    wgmma_bf16((int)(2 * sizeof...(F)), da, db, scale_d, ta, tb, p);
}
inline void wgmma_nop() {}
// d = a·b + c for one m16n8k16 tile (kind 0: BF16, 1: binary16) or m16n8k32 (kind 2: E4M3).
void mma(int kind, float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
         unsigned b0, unsigned b1);
}  // namespace cuemu_ptx

// ---- atomics (the fibers of a launch share one host thread: a plain read-modify-write) ----
template <class T, class U>
inline T atomicAdd(T* p, U v) {
    const T o = *p;
    *p = o + (T)v;
    return o;
}
template <class T, class U>
inline T atomicMax(T* p, U v) {
    const T o = *p;
    if ((T)v > o) *p = (T)v;
    return o;
}
template <class T, class U>
inline T atomicMin(T* p, U v) {
    const T o = *p;
    if ((T)v < o) *p = (T)v;
    return o;
}
template <class T, class U>
inline T atomicOr(T* p, U v) {
    const T o = *p;
    *p = o | (T)v;
    return o;
}
template <class T, class U>
inline T atomicAnd(T* p, U v) {
    const T o = *p;
    *p = o & (T)v;
    return o;
}
template <class T, class U>
inline T atomicExch(T* p, U v) {
    const T o = *p;
    *p = (T)v;
    return o;
}
template <class T, class U, class V>
inline T atomicCAS(T* p, U cmp, V v) {
    const T o = *p;
    if (o == (T)cmp) *p = (T)v;
    return o;
}

// Kernel code (after this header) gets CUDA's NaN rules for fmaxf / fminf.
#define fmaxf cuemu_fmaxf
#define fminf cuemu_fminf
