// The low-byte GEMM kernels of ops_qgemm (fragment split, staged, MXFP8 / NVFP4 / BF16 /
// FP8 block) run under cuemu on ragged expert groups, checked
//   - against a host reference: the exact products summed in f64, within K·2⁻²³·Σ|x·w| (any
//     f32 summation order is inside it; a misplaced row, column, chunk or scale is not);
//   - bit for bit against the same kernels of a base version (namespace v0, another checkout)
//     where both have them, and between kernels that claim the same sums (the staged layout
//     and one warp per block; the fast and general MXFP8 decoders; FP8-block stage counts and
//     the three-weight launch).
// Launch shapes mirror crates/mxrl-cuda/src/ops/qgemm.rs (frag_grid, staged_smem_bytes,
// fp8_staged_smem_bytes). A kernel missing from a version is skipped and said so.
#include "cuemu.h"
#include "prelude.h"

#include <cinttypes>
#include <random>
#include <string>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define MX_ARGS const u16*, const u8*, const u8*, const u32*, float*, u32, u32, u32, u32
#define NV_ARGS const u16*, const float*, const u8*, const u8*, const float*, const u32*, float*, u32, u32, u32, u32
#define F8_ARGS const u16*, const float*, const u8*, const float*, const u32*, float*, u32, u32, u32, u32
#define F83_ARGS                                                                                                  \
    const u16*, const float*, const u8*, const float*, float*, u32, const u8*, const float*, float*, u32, const u8*, \
        const float*, float*, u32, const u32*, u32, u32
#define W __attribute__((weak))
#define DECL4(pre, ARGS) \
    W void pre##_t1(ARGS); \
    W void pre##_t2(ARGS); \
    W void pre##_t4(ARGS); \
    W void pre##_t8(ARGS);
#define DECLS_LIST(X)                  \
    X(qgemm_frag_mxfp8)                \
    X(qgemm_frag_mxfp8f)               \
    X(qgemm_frag_nvfp4)                \
    X(qgemm_frag_bf16)                 \
    X(qgemm_fragsm_mxfp8)              \
    X(qgemm_fragsm_mxfp8f)             \
    X(qgemm_fragsm_nvfp4)              \
    X(qgemm_fragsm_bf16)               \
    X(qgemm_fragsm_fp8b)               \
    X(qgemm_fragsm_fp8b_s4)            \
    X(qgemm_fragsm_fp8b_s6)            \
    X(qgemm_fragsm_fp8b3_s3)           \
    X(qgemm_fragsm_fp8b3_s6)
#define DECLS                                       \
    DECL4(qgemm_frag_mxfp8, MX_ARGS)                \
    DECL4(qgemm_frag_mxfp8f, MX_ARGS)               \
    DECL4(qgemm_frag_nvfp4, NV_ARGS)                \
    DECL4(qgemm_frag_bf16, MX_ARGS)                 \
    DECL4(qgemm_fragsm_mxfp8, MX_ARGS)              \
    DECL4(qgemm_fragsm_mxfp8f, MX_ARGS)             \
    DECL4(qgemm_fragsm_nvfp4, NV_ARGS)              \
    DECL4(qgemm_fragsm_bf16, MX_ARGS)               \
    DECL4(qgemm_fragsm_fp8b, F8_ARGS)               \
    DECL4(qgemm_fragsm_fp8b_s4, F8_ARGS)            \
    DECL4(qgemm_fragsm_fp8b_s6, F8_ARGS)            \
    DECL4(qgemm_fragsm_fp8b3_s3, F83_ARGS)          \
    DECL4(qgemm_fragsm_fp8b3_s6, F83_ARGS)          \
    W void quant_act_nvfp4_f16(const float*, u16*, float*, unsigned long long); \
    W void quant_act_nvfp4(const float*, u16*, float*, unsigned long long);     \
    W void mxfp8_decode_table(u16*, u16*);                                      \
    W void mxfp8_fast_check(const u32*, unsigned long long, const u8*, unsigned long long, u32*);
namespace v0 {
DECLS
}
namespace v1 {
DECLS
}

// The kernels each version defines (nm of its object, written by scripts/cuemu.sh).
const char* const NAMES_V0[] = {
#include "names_v0.inc"
    nullptr};
const char* const NAMES_V1[] = {
#include "names_v1.inc"
    nullptr};

namespace {
int g_fail = 0, g_pass = 0, g_skip = 0;

bool defines(const char* const* names, const std::string& n) {
    for (; *names; ++names)
        if (n == *names) return true;
    return false;
}

void report(bool ok, const std::string& what, const std::string& detail = "") {
    if (ok) ++g_pass;
    else ++g_fail;
    std::printf("%s  %s%s%s\n", ok ? "ok  " : "FAIL", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
}
void skip(const std::string& what) {
    ++g_skip;
    std::printf("skip  %s (not in this version)\n", what.c_str());
}

float bf16_val(u16 b) { return __uint_as_float((u32)b << 16); }

struct Shape {
    u32 E, R, N, K;
    std::vector<u32> off;  // E + 1
};

// Ragged groups: an empty expert, one of a single row, and larger ones past several passes.
Shape ragged(u32 N, u32 K, std::vector<u32> rows) {
    Shape s{(u32)rows.size(), 0, N, K, {0}};
    for (u32 r : rows) s.off.push_back(s.off.back() + r);
    s.R = s.off.back();
    return s;
}

u32 rows_per_expert(const Shape& s) { return (s.R + s.E - 1) / s.E; }
// frag_row_blocks (staged layouts: up to 8 blocks of passes per expert)
u32 row_blocks(const Shape& s, u32 pass_rows) {
    if (rows_per_expert(s) < 9) return 1;
    u32 b = (s.R + pass_rows - 1) / pass_rows;
    return b < 1 ? 1 : (b > 8 ? 8 : b);
}

struct Err {
    double worst = 0;  // largest |y − ref| / bound
    size_t bad = 0, first = SIZE_MAX;
};
Err compare_ref(const std::vector<float>& y, const std::vector<double>& ref, const std::vector<double>& mag, u32 K) {
    Err e;
    for (size_t i = 0; i < y.size(); ++i) {
        const double bound = (double)K * std::ldexp(1.0, -23) * mag[i] + 1e-30;
        const double d = std::fabs((double)y[i] - ref[i]);
        const double r = d / bound;
        if (!(r <= 1.0)) {
            ++e.bad;
            if (e.first == SIZE_MAX) e.first = i;
        }
        if (r > e.worst || std::isnan(r)) e.worst = std::isnan(r) ? INFINITY : r;
    }
    return e;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b, size_t* at) {
    for (size_t i = 0; i < a.size(); ++i)
        if (__float_as_uint(a[i]) != __float_as_uint(b[i])) {
            *at = i;
            return false;
        }
    return true;
}

std::mt19937_64 rng(7);
u32 rnd(u32 n) { return (u32)(rng() % n); }

// ---- problem data per format ----
struct Problem {
    Shape s;
    std::vector<u16> x_bf16, x_f16;  // activation operand (equal values)
    std::vector<float> x_amax;       // NVFP4: per row; FP8 block: scale_inv [R, K/128]
    std::vector<u8> codes, scales;   // weights as stored
    std::vector<float> w_amax;       // NVFP4 per expert; FP8 block: scale_inv [E, N/128, K/128]
    std::vector<double> ref, mag;    // reference y and Σ|x·w| per output
};

u16 f16_of(float v) { return cuemu::f32_to_f16_rn(v); }

void finish_reference(Problem& p, const std::vector<double>& xv, const std::vector<double>& wv,
                      const std::function<double(u32 r, u32 e)>& row_factor) {
    const Shape& s = p.s;
    p.ref.assign((size_t)s.R * s.N, 0);
    p.mag.assign((size_t)s.R * s.N, 0);
    for (u32 e = 0; e < s.E; ++e)
        for (u32 r = s.off[e]; r < s.off[e + 1]; ++r)
            for (u32 n = 0; n < s.N; ++n) {
                double acc = 0, m = 0;
                const double* xr = &xv[(size_t)r * s.K];
                const double* wr = &wv[((size_t)e * s.N + n) * s.K];
                for (u32 k = 0; k < s.K; ++k) {
                    acc += xr[k] * wr[k];
                    m += std::fabs(xr[k] * wr[k]);
                }
                const double f = row_factor(r, e);
                p.ref[(size_t)r * s.N + n] = acc * f;
                p.mag[(size_t)r * s.N + n] = m * std::fabs(f);
            }
}

// MXFP8: E4M3 codes (no NaN), scale bytes around 127 (BF16-exact operands); x: MXFP8 values.
Problem mxfp8_problem(const Shape& s, bool fast_eligible) {
    Problem p{s};
    const size_t nw = (size_t)s.E * s.N * s.K;
    p.codes.resize(nw);
    p.scales.resize(nw / 32);
    std::vector<double> wv(nw), xv((size_t)s.R * s.K);
    for (auto& c : p.codes) {
        c = (u8)rnd(256);
        if ((c & 0x7F) == 0x7F) c ^= 1;
    }
    for (auto& b : p.scales) b = (u8)(fast_eligible ? 118 + rnd(17) : 118 + rnd(20));
    for (size_t i = 0; i < nw; ++i)
        wv[i] = (double)cuemu::e4m3_to_f32(p.codes[i]) * std::ldexp(1.0, (int)p.scales[i / 32] - 127);
    p.x_bf16.resize(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        u8 c = (u8)rnd(256);
        if ((c & 0x7F) == 0x7F) c ^= 1;
        const float v = std::ldexp(cuemu::e4m3_to_f32(c), (int)rnd(6) - 3);
        p.x_bf16[i] = cuemu::f32_to_bf16_rn(v);
        xv[i] = v;
    }
    finish_reference(p, xv, wv, [](u32, u32) { return 1.0; });
    return p;
}

// NVFP4: E2M1 nibbles, E4M3 block scales; x the exact pre values (e2m1 · e4m3), in BF16 and
// binary16; α = fl(fl(x_amax[r] · w_amax[e]) · MXRL_NVFP4_ALPHA_FACTOR_INV).
Problem nvfp4_problem(const Shape& s) {
    static const float E2M1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    Problem p{s};
    const size_t nw = (size_t)s.E * s.N * s.K;
    p.codes.resize(nw / 2);
    p.scales.resize(nw / 16);
    std::vector<double> wv(nw), xv((size_t)s.R * s.K);
    for (auto& c : p.codes) c = (u8)rnd(256);
    for (auto& b : p.scales) b = (u8)(0x20 + rnd(0x40));  // positive finite E4M3
    for (size_t i = 0; i < nw; ++i) {
        const u32 nib = (p.codes[i / 2] >> (4 * (i % 2))) & 0xF;
        const double v = E2M1[nib & 7] * (nib & 8 ? -1.0 : 1.0);
        wv[i] = v * cuemu::e4m3_to_f32(p.scales[i / 16]);
    }
    p.x_bf16.resize(xv.size());
    p.x_f16.resize(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        const float v = E2M1[rnd(8)] * (rnd(2) ? -1.0f : 1.0f) * cuemu::e4m3_to_f32((u8)(0x20 + rnd(0x40)));
        p.x_bf16[i] = cuemu::f32_to_bf16_rn(v);
        p.x_f16[i] = f16_of(v);
        xv[i] = v;
    }
    p.x_amax.resize(s.R);
    for (auto& a : p.x_amax) a = 0.5f + (float)rnd(1000) / 100.0f;
    p.w_amax.resize(s.E);
    for (auto& a : p.w_amax) a = 0.25f + (float)rnd(1000) / 200.0f;
    auto alpha = [&](u32 r, u32 e) {
        return (double)__fmul_rn(__fmul_rn(p.x_amax[r], p.w_amax[e]), MXRL_NVFP4_ALPHA_FACTOR_INV);
    };
    finish_reference(p, xv, wv, alpha);
    return p;
}

// BF16 weights and activations.
Problem bf16_problem(const Shape& s) {
    Problem p{s};
    const size_t nw = (size_t)s.E * s.N * s.K;
    std::vector<u16> w(nw);
    std::vector<double> wv(nw), xv((size_t)s.R * s.K);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < nw; ++i) {
        w[i] = cuemu::f32_to_bf16_rn(nd(rng));
        wv[i] = bf16_val(w[i]);
    }
    p.codes.resize(2 * nw);
    std::memcpy(p.codes.data(), w.data(), 2 * nw);
    p.x_bf16.resize(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        p.x_bf16[i] = cuemu::f32_to_bf16_rn(nd(rng));
        xv[i] = bf16_val(p.x_bf16[i]);
    }
    finish_reference(p, xv, wv, [](u32, u32) { return 1.0; });
    return p;
}

// FP8 block: E4M3 codes with f32 scale_inv per 128×128 weight tile and per 1×128 activation
// block; the operand x is each activation code's binary16 value. Per K block b the kernels
// sum P_b = Σ x·w exactly in f32 and promote y = fl(y + fl(fl(sx·sw)·P_b)) in b's order.
Problem fp8b_problem(const Shape& s, const Problem* x_from = nullptr) {
    Problem p{s};
    const u32 kb = s.K / 128;
    const size_t nw = (size_t)s.E * s.N * s.K;
    p.codes.resize(nw);
    for (auto& c : p.codes) {
        c = (u8)rnd(256);
        if ((c & 0x7F) == 0x7F) c ^= 1;
    }
    p.w_amax.resize((size_t)s.E * (s.N / 128) * kb);
    for (auto& a : p.w_amax) a = std::ldexp(1.0f + (float)rnd(64) / 64.0f, -(int)rnd(6));
    p.x_f16.resize((size_t)s.R * s.K);
    std::vector<double> xv(p.x_f16.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        u8 c = (u8)rnd(256);
        if ((c & 0x7F) == 0x7F) c ^= 1;
        xv[i] = cuemu::e4m3_to_f32(c);
        p.x_f16[i] = f16_of((float)xv[i]);
    }
    p.x_amax.resize((size_t)s.R * kb);
    for (auto& a : p.x_amax) a = std::ldexp(1.0f + (float)rnd(64) / 64.0f, -(int)rnd(6));
    if (x_from) {
        p.x_f16 = x_from->x_f16;
        p.x_amax = x_from->x_amax;
        for (size_t i = 0; i < xv.size(); ++i) xv[i] = cuemu::f16_to_f32(p.x_f16[i]);
    }
    p.ref.assign((size_t)s.R * s.N, 0);
    p.mag.assign((size_t)s.R * s.N, 0);
    for (u32 e = 0; e < s.E; ++e)
        for (u32 r = s.off[e]; r < s.off[e + 1]; ++r)
            for (u32 n = 0; n < s.N; ++n) {
                float y = 0;
                double m = 0;
                for (u32 b = 0; b < kb; ++b) {
                    double pb = 0;
                    for (u32 k = b * 128; k < (b + 1) * 128; ++k) {
                        const double w = cuemu::e4m3_to_f32(p.codes[((size_t)e * s.N + n) * s.K + k]);
                        pb += xv[(size_t)r * s.K + k] * w;
                        m += std::fabs(xv[(size_t)r * s.K + k] * w) * p.x_amax[(size_t)r * kb + b] *
                             p.w_amax[((size_t)e * (s.N / 128) + n / 128) * kb + b];
                    }
                    const float sc = __fmul_rn(p.x_amax[(size_t)r * kb + b],
                                               p.w_amax[((size_t)e * (s.N / 128) + n / 128) * kb + b]);
                    y = __fadd_rn(y, __fmul_rn(sc, (float)pb));
                }
                p.ref[(size_t)r * s.N + n] = y;
                p.mag[(size_t)r * s.N + n] = m;
            }
    return p;
}

// ---- launches ----
enum Fmt { MX, MXF, NV, BF, F8 };
const char* fmt_name(Fmt f) {
    static const char* n[] = {"mxfp8", "mxfp8f", "nvfp4", "bf16", "fp8b"};
    return n[f];
}
u32 staged_smem(Fmt f, u32 K, u32 rows, u32 stages = 3) {
    if (f == F8) {
        const u32 kbs = K / 128;
        return (4 * kbs + 15) / 16 * 16 + stages * 4 * 32 * 64 + stages * rows * (64 + 8) * 2 + rows * kbs * 4;
    }
    u32 scale_row = 0, elems = 32;
    if (f == MX || f == MXF) scale_row = K / 32, elems = 64;
    if (f == NV) scale_row = K / 16, elems = 128;
    return 32 * 4 * scale_row + 3 * 4 * 32 * 64 + 3 * rows * (elems + 8) * 2;
}

using MxFn = void (*)(MX_ARGS);
using NvFn = void (*)(NV_ARGS);
using F8Fn = void (*)(F8_ARGS);

// One launch of a fragment kernel: split = 0 for the staged layout, else warps per block.
std::vector<float> run(Fmt f, void* fn, const Problem& p, u32 tg, u32 split, bool f16_operand, u32 stages = 3) {
    const Shape& s = p.s;
    std::vector<float> y((size_t)s.R * s.N, __uint_as_float(0x7FC00001u));  // unwritten rows show
    const u32 rows = 8 * tg;
    dim3 grid, block;
    u32 smem;
    if (split == 0) {
        grid = {(s.N + 127) / 128, s.E, row_blocks(s, rows)};
        block = {128, 1, 1};
        smem = staged_smem(f, s.K, rows, stages);
    } else {
        grid = {s.N / 32, s.E, 1};
        block = {32 * split, 1, 1};
        smem = split > 1 ? split * 8 * (rows / 8) * 32 * 4 : 0;
    }
    const u16* x = f16_operand ? p.x_f16.data() : p.x_bf16.data();
    cuemu::launch(grid, block, smem, [&] {
        if (f == NV)
            ((NvFn)fn)(x, p.x_amax.data(), p.codes.data(), p.scales.data(), p.w_amax.data(), s.off.data(), y.data(), s.E,
                       s.R, s.N, s.K);
        else if (f == F8)
            ((F8Fn)fn)(x, p.x_amax.data(), p.codes.data(), p.w_amax.data(), s.off.data(), y.data(), s.E, s.R, s.N, s.K);
        else
            ((MxFn)fn)(x, p.codes.data(), p.scales.data(), s.off.data(), y.data(), s.E, s.R, s.N, s.K);
    });
    return y;
}

void* pick(void* t1, void* t2, void* t4, void* t8, u32 tg) {
    return tg == 1 ? t1 : tg == 2 ? t2 : tg == 4 ? t4 : t8;
}
#define KERNEL(ns, pre, tg) pick((void*)&ns::pre##_t1, (void*)&ns::pre##_t2, (void*)&ns::pre##_t4, (void*)&ns::pre##_t8, tg)

std::string cfg_name(const char* kern, u32 tg, u32 split, const char* shape) {
    return std::string(kern) + "_t" + std::to_string(tg) + (split ? " split " + std::to_string(split) : " staged") +
           " [" + shape + "]";
}

// y against the reference; the bits of `base` (when given) equal.
void check(const std::string& what, const Problem& p, const std::vector<float>& y, const std::vector<float>* base,
           const char* base_name) {
    const Err e = compare_ref(y, p.ref, p.mag, p.s.K);
    char buf[256];
    if (e.bad) {
        const size_t i = e.first;
        std::snprintf(buf, sizeof buf, "%zu of %zu outputs outside the bound; first row %zu col %zu: %.9g vs %.9g",
                      e.bad, y.size(), i / p.s.N, i % p.s.N, (double)y[i], p.ref[i]);
        report(false, what + " vs reference", buf);
    } else {
        std::snprintf(buf, sizeof buf, "worst %.3g of the bound", e.worst);
        report(true, what + " vs reference", buf);
    }
    if (base) {
        size_t at = 0;
        if (same_bits(y, *base, &at)) report(true, what + " == " + base_name + ", bit for bit");
        else {
            std::snprintf(buf, sizeof buf, "first differing output row %zu col %zu: %.9g vs %.9g", at / p.s.N,
                          at % p.s.N, (double)y[at], (double)(*base)[at]);
            report(false, what + " == " + base_name, buf);
        }
    }
}
}  // namespace

int main(int argc, char** argv) {
    const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
    const bool f16_v0 = (void*)&v0::quant_act_nvfp4_f16 != nullptr;
    const bool f16_v1 = (void*)&v1::quant_act_nvfp4_f16 != nullptr;
    const bool have_v0 = (void*)&v0::qgemm_frag_mxfp8_t1 != nullptr;
    std::printf("base version (v0): %s; NVFP4 fragment operand binary16: v0 %s, v1 %s\n",
                have_v0 ? "linked" : "none", f16_v0 ? "yes" : "no", f16_v1 ? "yes" : "no");
    // A kernel a version defines but this checker did not link has another signature than the
    // one declared above: a failure (its checks would be skipped silently otherwise).
    {
        struct Ref {
            std::string name;
            void *p0, *p1;
        };
        std::vector<Ref> refs = {
            {"quant_act_nvfp4_f16", (void*)&v0::quant_act_nvfp4_f16, (void*)&v1::quant_act_nvfp4_f16},
            {"quant_act_nvfp4", (void*)&v0::quant_act_nvfp4, (void*)&v1::quant_act_nvfp4},
            {"mxfp8_decode_table", (void*)&v0::mxfp8_decode_table, (void*)&v1::mxfp8_decode_table},
            {"mxfp8_fast_check", (void*)&v0::mxfp8_fast_check, (void*)&v1::mxfp8_fast_check}};
#define REF1(n) refs.push_back({#n, (void*)&v0::n, (void*)&v1::n});
#define REF4(pre) REF1(pre##_t1) REF1(pre##_t2) REF1(pre##_t4) REF1(pre##_t8)
        DECLS_LIST(REF4)
        for (const Ref& r : refs) {
            if (!r.p0 && defines(NAMES_V0, r.name))
                report(false, "v0 " + r.name, "defined with another signature than qgemm_check.cpp declares");
            if (!r.p1 && defines(NAMES_V1, r.name))
                report(false, "v1 " + r.name, "defined with another signature than qgemm_check.cpp declares");
        }
    }
    const u32 N = 256, K = 512;
    struct S {
        const char* name;
        Shape s;
        bool staged;
    };
    std::vector<S> shapes = {
        {"decode: 3,0,1,7,5 rows", ragged(N, K, {3, 0, 1, 7, 5}), false},
        {"rollout: 37,0,70,1,20 rows", ragged(N, K, {37, 0, 70, 1, 20}), true},
    };
    const std::vector<u32> tgs = quick ? std::vector<u32>{1, 8} : std::vector<u32>{1, 2, 4, 8};
    for (const S& sh : shapes) {
        Problem pm = mxfp8_problem(sh.s, true), pn = nvfp4_problem(sh.s), pb = bf16_problem(sh.s);
        for (u32 tg : tgs) {
            std::vector<u32> splits = sh.staged ? std::vector<u32>{0, 1} : std::vector<u32>{1, 2, 4, 8};
            for (u32 split : splits) {
                struct K3 {
                    Fmt f;
                    const char* kern;
                    void *k0, *k1;
                    const Problem* p;
                };
                std::vector<K3> ks = {
                    {MX, split ? "qgemm_frag_mxfp8" : "qgemm_fragsm_mxfp8",
                     split ? KERNEL(v0, qgemm_frag_mxfp8, tg) : KERNEL(v0, qgemm_fragsm_mxfp8, tg),
                     split ? KERNEL(v1, qgemm_frag_mxfp8, tg) : KERNEL(v1, qgemm_fragsm_mxfp8, tg), &pm},
                    {NV, split ? "qgemm_frag_nvfp4" : "qgemm_fragsm_nvfp4",
                     split ? KERNEL(v0, qgemm_frag_nvfp4, tg) : KERNEL(v0, qgemm_fragsm_nvfp4, tg),
                     split ? KERNEL(v1, qgemm_frag_nvfp4, tg) : KERNEL(v1, qgemm_fragsm_nvfp4, tg), &pn},
                    {BF, split ? "qgemm_frag_bf16" : "qgemm_fragsm_bf16",
                     split ? KERNEL(v0, qgemm_frag_bf16, tg) : KERNEL(v0, qgemm_fragsm_bf16, tg),
                     split ? KERNEL(v1, qgemm_frag_bf16, tg) : KERNEL(v1, qgemm_fragsm_bf16, tg), &pb},
                };
                for (const K3& k : ks) {
                    const std::string what = cfg_name(k.kern, tg, split, sh.name);
                    if (!k.k1) {
                        skip(what);
                        continue;
                    }
                    const std::vector<float> y1 = run(k.f, k.k1, *k.p, tg, split, k.f == NV && f16_v1);
                    if (k.k0) {
                        const std::vector<float> y0 = run(k.f, k.k0, *k.p, tg, split, k.f == NV && f16_v0);
                        check(what, *k.p, y1, &y0, "v0");
                    } else {
                        check(what, *k.p, y1, nullptr, "");
                    }
                    if (k.f == MX) {
                        void* fast = split ? KERNEL(v1, qgemm_frag_mxfp8f, tg) : KERNEL(v1, qgemm_fragsm_mxfp8f, tg);
                        const std::string fw = cfg_name(split ? "qgemm_frag_mxfp8f" : "qgemm_fragsm_mxfp8f", tg, split, sh.name);
                        if (!fast) skip(fw);
                        else {
                            const std::vector<float> yf = run(MXF, fast, pm, tg, split, false);
                            check(fw, pm, yf, &y1, "the general decode");
                        }
                    }
                    if (split == 0) {
                        void* one = k.f == MX ? KERNEL(v1, qgemm_frag_mxfp8, tg)
                                    : k.f == NV ? KERNEL(v1, qgemm_frag_nvfp4, tg)
                                                : KERNEL(v1, qgemm_frag_bf16, tg);
                        if (one) {
                            const std::vector<float> ys = run(k.f, one, *k.p, tg, 1, k.f == NV && f16_v1);
                            check(what + " (as split 1)", *k.p, ys, &y1, "the staged layout");
                        }
                    }
                }
            }
        }
    }
    // FP8 block, staged only (N, K multiples of 128).
    {
        const Shape s = ragged(256, 512, {37, 0, 70, 1, 20});
        const Problem p = fp8b_problem(s);
        for (u32 tg : tgs) {
            void* k0 = KERNEL(v0, qgemm_fragsm_fp8b, tg);
            void* k1 = KERNEL(v1, qgemm_fragsm_fp8b, tg);
            const std::string what = cfg_name("qgemm_fragsm_fp8b", tg, 0, "rollout");
            if (!k1) {
                skip(what);
                continue;
            }
            const std::vector<float> y1 = run(F8, k1, p, tg, 0, true, 3);
            std::vector<float> y0;
            if (k0) y0 = run(F8, k0, p, tg, 0, true, 3);
            check(what, p, y1, k0 ? &y0 : nullptr, "v0");
            const void* s4 = KERNEL(v1, qgemm_fragsm_fp8b_s4, tg);
            const void* s6 = KERNEL(v1, qgemm_fragsm_fp8b_s6, tg);
            if (s4) check(cfg_name("qgemm_fragsm_fp8b_s4", tg, 0, "rollout"), p, run(F8, (void*)s4, p, tg, 0, true, 4), &y1, "three stages");
            else skip(cfg_name("qgemm_fragsm_fp8b_s4", tg, 0, "rollout"));
            if (s6) check(cfg_name("qgemm_fragsm_fp8b_s6", tg, 0, "rollout"), p, run(F8, (void*)s6, p, tg, 0, true, 6), &y1, "three stages");
            else skip(cfg_name("qgemm_fragsm_fp8b_s6", tg, 0, "rollout"));
        }
        // Three dense weights on one input in one launch, against three single launches.
        for (u32 tg : tgs) {
            for (u32 st : {3u, 6u}) {
                void* multi = st == 3 ? KERNEL(v1, qgemm_fragsm_fp8b3_s3, tg) : KERNEL(v1, qgemm_fragsm_fp8b3_s6, tg);
                void* single = st == 3 ? KERNEL(v1, qgemm_fragsm_fp8b, tg) : KERNEL(v1, qgemm_fragsm_fp8b_s6, tg);
                const std::string what = "qgemm_fragsm_fp8b3_s" + std::to_string(st) + "_t" + std::to_string(tg) +
                                         " [dense 77 rows, N 256 / 128 / 384]";
                if (!multi || !single) {
                    skip(what);
                    continue;
                }
                const u32 Ns[3] = {256, 128, 384};
                // One input for all three.
                Problem p0 = fp8b_problem(ragged(Ns[0], 512, {77}));
                Problem ps[3] = {p0, fp8b_problem(ragged(Ns[1], 512, {77}), &p0),
                                 fp8b_problem(ragged(Ns[2], 512, {77}), &p0)};
                std::vector<float> ys[3], ym[3];
                for (int i = 0; i < 3; ++i) {
                    ys[i] = run(F8, single, ps[i], tg, 0, true, st);
                    ym[i].assign((size_t)77 * Ns[i], __uint_as_float(0x7FC00001u));
                }
                const u32 rows = 8 * tg;
                const u32 rb = std::min<u32>(64, std::max<u32>(1, (77 + rows - 1) / rows));
                const dim3 grid{(Ns[0] + Ns[1] + Ns[2]) / 128, 1, rb};
                const u32 off[2] = {0, 77};
                cuemu::launch(grid, {128, 1, 1}, staged_smem(F8, 512, rows, st), [&] {
                    ((void (*)(F83_ARGS))multi)(ps[0].x_f16.data(), ps[0].x_amax.data(), ps[0].codes.data(),
                                                ps[0].w_amax.data(), ym[0].data(), Ns[0], ps[1].codes.data(),
                                                ps[1].w_amax.data(), ym[1].data(), Ns[1], ps[2].codes.data(),
                                                ps[2].w_amax.data(), ym[2].data(), Ns[2], off, 77, 512);
                });
                for (int i = 0; i < 3; ++i)
                    check(what + " weight " + std::to_string(i), ps[i], ym[i], &ys[i], "its single launch");
            }
        }
    }
    // The NVFP4 activation quantizer's binary16 operand: the BF16 entry's values and amax.
    if (!v1::quant_act_nvfp4_f16 || !v1::quant_act_nvfp4) skip("quant_act_nvfp4_f16 against quant_act_nvfp4");
    else {
        const u32 rows = 6, k = 1024;
        std::vector<float> x((size_t)rows * k);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (u32 r = 0; r < rows; ++r)
            for (u32 i = 0; i < k; ++i) {
                float v = nd(rng);
                if (r == 1) v = 0.0f;                        // all zeros
                if (r == 2) v *= 1e30f;                      // near the top of f32
                if (r == 3) v *= 1e-38f;                     // subnormal scales
                if (r == 4 && i % 16 == 3) v = 0.0f;         // blocks with zeros
                if (r == 5) v = (i % 97 == 0) ? 448.0f * 6 : v;  // outliers
                x[(size_t)r * k + i] = v;
            }
        std::vector<u16> pb(x.size()), pf(x.size());
        std::vector<float> ab(rows), af(rows);
        cuemu::launch({rows, 1, 1}, {128, 1, 1}, 0, [&] { v1::quant_act_nvfp4(x.data(), pb.data(), ab.data(), k); });
        cuemu::launch({rows, 1, 1}, {128, 1, 1}, 0, [&] { v1::quant_act_nvfp4_f16(x.data(), pf.data(), af.data(), k); });
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < x.size(); ++i) {
            const float b = bf16_val(pb[i]), f = cuemu::f16_to_f32(pf[i]);
            if (__float_as_uint(b) != __float_as_uint(f) && !bad++) first = i;
        }
        for (u32 r = 0; r < rows; ++r)
            if (__float_as_uint(ab[r]) != __float_as_uint(af[r])) ++bad;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%zu of %zu values or amaxes differ (first at %zu)", bad, x.size() + rows, first);
        report(bad == 0, "quant_act_nvfp4_f16 == quant_act_nvfp4 (values as binary16, amax bits)", bad ? buf : "");
    }
    // The fast MXFP8 decode: the general decode's BF16 bits for every code under every eligible
    // scale byte (0..=134).
    if (!v1::mxfp8_decode_table) skip("mxfp8_decode_table");
    else {
        std::vector<u16> general(135 * 256, 0xFFFF), fast(135 * 256, 0xFFFF);
        cuemu::launch({135, 1, 1}, {64, 1, 1}, 0, [&] { v1::mxfp8_decode_table(general.data(), fast.data()); });
        size_t bad = 0, bad_c = 0;
        for (u32 sb = 0; sb < 135; ++sb)
            for (u32 c = 0; c < 256; ++c) {
                const size_t i = sb * 256 + c;
                if ((c & 0x7F) == 0x7F) continue;  // NaN codes are not eligible
                if (general[i] != fast[i]) ++bad;
                // The general decode against the contract: bf16(e4m3(c) · 2^(s − 127)).
                const float want = (float)((double)cuemu::e4m3_to_f32((u8)c) * std::ldexp(1.0, (int)sb - 127));
                if (general[i] != cuemu::f32_to_bf16_rn(want)) ++bad_c;
            }
        report(bad == 0, "mxfp8 fast decode == general decode, 254 codes × scale bytes 0..134",
               bad ? std::to_string(bad) + " differ" : "");
        report(bad_c == 0, "mxfp8 general decode == bf16(e4m3 · 2^(s−127)), same table",
               bad_c ? std::to_string(bad_c) + " differ" : "");
    }
    // Fast-decode eligibility: clean weights pass; a NaN code or a scale byte above 134 fails.
    if (!v1::mxfp8_fast_check) skip("mxfp8_fast_check");
    else {
        auto check_ok = [&](std::vector<u8> codes, std::vector<u8> scales) {
            u32 ok = 1;
            const u32 blocks = std::max<u32>(1, std::min<u32>(1024, (u32)(codes.size() / 4 + 255) / 256));
            cuemu::launch({blocks, 1, 1}, {256, 1, 1}, 0, [&] {
                v1::mxfp8_fast_check((const u32*)codes.data(), codes.size(), scales.data(), scales.size(), &ok);
            });
            return ok;
        };
        std::vector<u8> codes(8192), scales(256);
        for (auto& c : codes) {
            c = (u8)rnd(256);
            if ((c & 0x7F) == 0x7F) c ^= 1;
        }
        for (auto& b : scales) b = (u8)rnd(135);
        scales[17] = 134;
        bool all = check_ok(codes, scales) == 1;
        for (u8 nan : {(u8)0x7F, (u8)0xFF})
            for (size_t at : {(size_t)0, (size_t)4095, (size_t)8191}) {
                auto c2 = codes;
                c2[at] = nan;
                all &= check_ok(c2, scales) == 0;
            }
        for (u8 big : {(u8)135, (u8)255}) {
            auto s2 = scales;
            s2[255] = big;
            all &= check_ok(codes, s2) == 0;
        }
        report(all, "mxfp8_fast_check: clean weights eligible; NaN codes (0x7F, 0xFF) and scale bytes 135, 255 not");
    }
    std::printf("\n%d passed, %d failed, %d skipped\n", g_pass, g_fail, g_skip);
    return g_fail ? 1 : 0;
}
