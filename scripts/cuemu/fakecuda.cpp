// cuemu as a CUDA installation: one shared library that answers for libcuda (the driver API
// calls cudarc makes), libnvrtc (a "compile" that names the module) and libcublas (GemmEx /
// Sgemm in f64 sums), so that the engine's own device tests run on the host with every
// kernel of every op module executed by cuemu's fibers. Device memory is host memory; a
// stream runs its work at once, except while it captures a graph, where the work is recorded
// and replayed by cuGraphLaunch. Timing (events) is host wall time.
//
// Built by scripts/cuemu/fake.sh with the generated kernel table (fake_kernels.inc: one entry
// per kernel, with its argument sizes and a trampoline into the module's namespace).
#include "cuemu.h"

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace {
struct Kernel {
    const char* module;
    const char* name;
    std::vector<unsigned> arg_sizes;
    void (*call)(void** args);
};
}  // namespace

#include "fake_kernels.inc"  // const Kernel KERNELS[]; const char* MODULE_HASHES[][2]

namespace {
typedef int CUresult;
constexpr CUresult OK = 0, ERR_INVALID_VALUE = 1, ERR_NOT_FOUND = 500, ERR_INVALID_IMAGE = 200;
std::recursive_mutex g_lock;

struct Stream {
    bool capturing = false;
    std::vector<std::function<void()>> recorded;
    std::vector<const char*> recorded_names;  // what each recorded op is (submit's `what`)
};
struct Graph {
    std::vector<std::function<void()>> ops;
};
struct Event {
    std::chrono::steady_clock::time_point t;
};
struct Module {
    std::string name;
};
Stream g_default_stream;
Stream* stream_of(void* s) { return s ? (Stream*)s : &g_default_stream; }
// Runs `op` now, or records it when the stream is capturing (`what` names it in the
// CUEMU_TRACE_GRAPHS listing).
void submit(void* s, std::function<void()> op, const char* what) {
    Stream* st = stream_of(s);
    if (st->capturing) {
        st->recorded.push_back(std::move(op));
        st->recorded_names.push_back(what);
    } else {
        op();
    }
}
std::map<uintptr_t, size_t> g_allocs;
size_t g_used = 0, g_high = 0;
constexpr size_t TOTAL = 64ull << 30;

void* dev_alloc(size_t n) {
    void* p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
    if (!p) return nullptr;
    std::memset(p, 0xFF, n);  // fresh device memory holds garbage (NaN as f32 and BF16)
    g_allocs[(uintptr_t)p] = n;
    g_used += n;
    if (g_used > g_high) g_high = g_used;
    return p;
}
void dev_free(void* p) {
    auto it = g_allocs.find((uintptr_t)p);
    if (it != g_allocs.end()) {
        g_used -= it->second;
        g_allocs.erase(it);
    }
    std::free(p);
}
}  // namespace

extern "C" {
// ---- driver: init, devices, contexts ----
CUresult cuInit(unsigned) { return OK; }
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return OK;
}
CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return OK;
}
CUresult cuDeviceGet(int* d, int ordinal) {
    if (ordinal != 0) return ERR_INVALID_VALUE;
    *d = 0;
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, int) {
    std::snprintf(name, len, "cuemu (host emulation of sm_90)");
    return OK;
}
CUresult cuDeviceGetUuid(void* uuid, int) {
    std::memset(uuid, 0, 16);
    return OK;
}
CUresult cuDeviceGetUuid_v2(void* uuid, int) { return cuDeviceGetUuid(uuid, 0); }
CUresult cuDeviceTotalMem_v2(size_t* b, int) {
    *b = TOTAL;
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
    switch (attr) {
        case 1: *v = 1024; break;      // MAX_THREADS_PER_BLOCK
        case 2: *v = 1024; break;      // MAX_BLOCK_DIM_X
        case 3: case 4: *v = 1024; break;
        case 5: *v = 2147483647; break;  // MAX_GRID_DIM_X
        case 6: case 7: *v = 65535; break;
        case 8: *v = 49152; break;     // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *v = 32; break;       // WARP_SIZE
        case 16: *v = 132; break;      // MULTIPROCESSOR_COUNT
        case 75: *v = 9; break;        // COMPUTE_CAPABILITY_MAJOR
        case 76: *v = 0; break;        // COMPUTE_CAPABILITY_MINOR
        case 81: *v = 233472; break;   // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        case 97: *v = 232448; break;   // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        case 115: *v = 1; break;       // MEMORY_POOLS_SUPPORTED
        default: *v = 1; break;
    }
    return OK;
}
static int g_ctx_dummy;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &g_ctx_dummy;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuDevicePrimaryCtxRelease(int) { return OK; }
CUresult cuCtxSetCurrent(void*) { return OK; }
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = &g_ctx_dummy;
    return OK;
}
CUresult cuCtxPushCurrent_v2(void*) { return OK; }
CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = &g_ctx_dummy;
    return OK;
}
CUresult cuCtxSynchronize() { return OK; }
CUresult cuCtxGetDevice(int* d) {
    *d = 0;
    return OK;
}
CUresult cuCtxSetFlags(unsigned) { return OK; }
CUresult cuCtxGetFlags(unsigned* f) {
    *f = 0;
    return OK;
}
CUresult cuCtxSetLimit(int, size_t) { return OK; }
CUresult cuCtxGetLimit(size_t* v, int) {
    *v = 0;
    return OK;
}
CUresult cuCtxGetStreamPriorityRange(int* lo, int* hi) {
    *lo = 0;
    *hi = 0;
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
    static const char* msg = "cuemu error";
    *s = e == OK ? "no error" : msg;
    return OK;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
    *s = e == OK ? "CUDA_SUCCESS" : "CUEMU_ERROR";
    return OK;
}

// ---- streams, events ----
CUresult cuStreamCreate(void** s, unsigned) {
    *s = new Stream();
    return OK;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
CUresult cuStreamDestroy_v2(void* s) {
    delete (Stream*)s;
    return OK;
}
CUresult cuStreamSynchronize(void*) { return OK; }
CUresult cuStreamQuery(void*) { return OK; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return OK; }
CUresult cuStreamBeginCapture_v2(void* s, int) {
    Stream* st = stream_of(s);
    st->capturing = true;
    st->recorded.clear();
    st->recorded_names.clear();
    return OK;
}
CUresult cuStreamEndCapture(void* s, void** graph) {
    Stream* st = stream_of(s);
    Graph* g = new Graph();
    g->ops = std::move(st->recorded);
    st->recorded.clear();
    st->capturing = false;
    // CUEMU_TRACE_GRAPHS=1: every captured graph's nodes on stderr, in order, runs of one
    // name folded (`name xN`), then the node count.
    if (std::getenv("CUEMU_TRACE_GRAPHS")) {
        const auto& names = st->recorded_names;
        std::fprintf(stderr, "cuemu graph: %zu nodes:", names.size());
        for (size_t i = 0; i < names.size();) {
            size_t j = i;
            while (j < names.size() && std::strcmp(names[j], names[i]) == 0) ++j;
            if (j - i > 1) std::fprintf(stderr, " %s x%zu", names[i], j - i);
            else std::fprintf(stderr, " %s", names[i]);
            i = j;
        }
        std::fprintf(stderr, "\n");
    }
    st->recorded_names.clear();
    *graph = g;
    return OK;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capturing ? 1 : 0;
    return OK;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    Graph* g = new Graph(*(Graph*)graph);
    *exec = g;
    return OK;
}
CUresult cuGraphInstantiate_v2(void** exec, void* graph, void*, char*, size_t) {
    return cuGraphInstantiateWithFlags(exec, graph, 0);
}
CUresult cuGraphLaunch(void* exec, void* s) {
    for (auto& op : ((Graph*)exec)->ops) submit(s, op, "graph node");
    return OK;
}
CUresult cuGraphUpload(void*, void*) { return OK; }
// A capture here is a list of ops with no graph nodes to name: no current dependencies, so
// the engine's programmatic edges (gpu.rs, launch_op) are never made under cuemu, which runs
// a stream's ops one after another in any case.
CUresult cuStreamGetCaptureInfo_v3(void* s, int* status, unsigned long long* id, void** graph,
                                   const void** deps, const void** data, size_t* n) {
    if (status) *status = stream_of(s)->capturing ? 1 : 0;
    if (id) *id = 0;
    if (graph) *graph = nullptr;
    if (deps) *deps = nullptr;
    if (data) *data = nullptr;
    if (n) *n = 0;
    return OK;
}
// No node list (see cuStreamGetCaptureInfo_v3): a graph here counts as having no nodes.
CUresult cuGraphGetNodes(void*, void**, size_t* n) {
    *n = 0;
    return OK;
}
CUresult cuGraphDestroy(void* g) {
    delete (Graph*)g;
    return OK;
}
CUresult cuGraphExecDestroy(void* g) {
    delete (Graph*)g;
    return OK;
}
CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event();
    return OK;
}
// Recorded on a capturing stream, an event only marks a point for other streams to wait on
// (a branch forked from the recording) and becomes no graph node, as in CUDA; the event may
// be destroyed before the graph runs.
CUresult cuEventRecord(void* e, void* s) {
    if (stream_of(s)->capturing) return OK;
    Event* ev = (Event*)e;
    submit(s, [ev] { ev->t = std::chrono::steady_clock::now(); }, "event");
    return OK;
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(void*) { return OK; }
CUresult cuEventQuery(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = std::chrono::duration<float, std::milli>(((Event*)b)->t - ((Event*)a)->t).count();
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }
CUresult cuEventDestroy_v2(void* e) {
    delete (Event*)e;
    return OK;
}
CUresult cuLaunchHostFunc(void* s, void (*fn)(void*), void* data) {
    submit(s, [fn, data] { fn(data); }, "hostfn");
    return OK;
}

// ---- memory ----
CUresult cuMemAlloc_v2(unsigned long long* p, size_t n) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    void* q = dev_alloc(n);
    if (!q) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    *p = (uintptr_t)q;
    return OK;
}
CUresult cuMemAllocAsync(unsigned long long* p, size_t n, void*) { return cuMemAlloc_v2(p, n); }
CUresult cuMemFree_v2(unsigned long long p) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    dev_free((void*)p);
    return OK;
}
// Memory pools of their own (the engine's recordings allocate from one): a freed buffer goes
// back to its pool's free list, never to the host, and is handed out again for a request of
// the same size (refilled with garbage, as fresh device memory is here).
struct Pool {
    std::multimap<size_t, uintptr_t> free;
};
std::map<uintptr_t, std::pair<Pool*, size_t>> g_pool_of;
CUresult cuMemPoolCreate(void** pool, const void*) {
    *pool = new Pool();
    return OK;
}
CUresult cuMemPoolDestroy(void*) { return OK; }  // its buffers stay valid (leaked)
CUresult cuMemAllocFromPoolAsync(unsigned long long* p, size_t n, void* pool, void*) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    Pool* pl = (Pool*)pool;
    auto it = pl->free.find(n);
    uintptr_t q;
    if (it != pl->free.end()) {
        q = it->second;
        pl->free.erase(it);
        std::memset((void*)q, 0xFF, n);
    } else {
        void* v = dev_alloc(n);
        if (!v) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
        q = (uintptr_t)v;
        g_pool_of[q] = {pl, n};
    }
    *p = q;
    return OK;
}
CUresult cuMemFreeAsync(unsigned long long p, void* s) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    auto it = g_pool_of.find((uintptr_t)p);
    if (it != g_pool_of.end()) {
        it->second.first->free.emplace(it->second.second, (uintptr_t)p);
        return OK;
    }
    // A free captured into a graph would free at replay; the engine frees outside captures.
    if (stream_of(s)->capturing) return OK;
    return cuMemFree_v2(p);
}
CUresult cuMemAllocHost_v2(void** p, size_t n) {
    *p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
    return *p ? OK : 2;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned) { return cuMemAllocHost_v2(p, n); }
CUresult cuMemFreeHost(void* p) {
    std::free(p);
    return OK;
}
CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total) {
    *total = TOTAL;
    *free_b = TOTAL - g_used;
    return OK;
}
CUresult cuMemcpyHtoD_v2(unsigned long long d, const void* h, size_t n) {
    std::memcpy((void*)d, h, n);
    return OK;
}
CUresult cuMemcpyDtoH_v2(void* h, unsigned long long d, size_t n) {
    std::memcpy(h, (const void*)d, n);
    return OK;
}
CUresult cuMemcpyDtoD_v2(unsigned long long d, unsigned long long s, size_t n) {
    std::memmove((void*)d, (const void*)s, n);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long d, const void* h, size_t n, void* s) {
    submit(s, [=] { std::memcpy((void*)d, h, n); }, "memcpyHtoD");
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void* h, unsigned long long d, size_t n, void* s) {
    submit(s, [=] { std::memcpy(h, (const void*)d, n); }, "memcpyDtoH");
    return OK;
}
CUresult cuMemcpyDtoDAsync_v2(unsigned long long d, unsigned long long src, size_t n, void* s) {
    submit(s, [=] { std::memmove((void*)d, (const void*)src, n); }, "memcpyDtoD");
    return OK;
}
CUresult cuMemsetD8_v2(unsigned long long d, unsigned char v, size_t n) {
    std::memset((void*)d, v, n);
    return OK;
}
CUresult cuMemsetD8Async(unsigned long long d, unsigned char v, size_t n, void* s) {
    submit(s, [=] { std::memset((void*)d, v, n); }, "memset");
    return OK;
}
CUresult cuMemsetD32Async(unsigned long long d, unsigned v, size_t n, void* s) {
    submit(s, [=] {
        for (size_t i = 0; i < n; ++i) std::memcpy((char*)d + 4 * i, &v, 4);
    }, "memset");
    return OK;
}
CUresult cuMemsetD32_v2(unsigned long long d, unsigned v, size_t n) { return cuMemsetD32Async(d, v, n, nullptr); }
static int g_pool_dummy;
CUresult cuDeviceGetDefaultMemPool(void** pool, int) {
    *pool = &g_pool_dummy;
    return OK;
}
CUresult cuDeviceGetMemPool(void** pool, int) { return cuDeviceGetDefaultMemPool(pool, 0); }
CUresult cuMemPoolSetAttribute(void*, int attr, void* v) {
    // USED_MEM_HIGH (a reset to 0) and the release threshold.
    if (attr == 8) g_high = g_used;
    (void)v;
    return OK;
}
CUresult cuMemPoolGetAttribute(void*, int attr, void* v) {
    // 5 RESERVED_MEM_CURRENT, 6 RESERVED_MEM_HIGH, 7 USED_MEM_CURRENT, 8 USED_MEM_HIGH
    unsigned long long x = attr == 8 || attr == 6 ? g_high : g_used;
    if (attr < 5) x = 0;
    std::memcpy(v, &x, 8);
    return OK;
}
CUresult cuMemPoolTrimTo(void*, size_t) { return OK; }
CUresult cuPointerGetAttribute(void* data, int, unsigned long long) {
    std::memset(data, 0, 8);
    return OK;
}

// ---- modules and launches ----
CUresult cuModuleLoadData(void** m, const void* image) {
    const char* s = (const char*)image;
    const char* tag = "// cuemu module ";
    if (std::strncmp(s, tag, std::strlen(tag)) != 0) return ERR_INVALID_IMAGE;
    Module* mod = new Module();
    const char* n = s + std::strlen(tag);
    mod->name.assign(n, std::strcspn(n, "\n"));
    *m = mod;
    return OK;
}
CUresult cuModuleLoadDataEx(void** m, const void* image, unsigned, void*, void*) { return cuModuleLoadData(m, image); }
CUresult cuModuleUnload(void* m) {
    delete (Module*)m;
    return OK;
}
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
    const std::string& mod = ((Module*)m)->name;
    for (const Kernel& k : KERNELS)
        if (mod == k.module && std::strcmp(name, k.name) == 0) {
            *f = (void*)&k;
            return OK;
        }
    std::fprintf(stderr, "cuemu: no kernel %s in module %s\n", name, mod.c_str());
    return ERR_NOT_FOUND;
}
CUresult cuFuncSetAttribute(void*, int, int) { return OK; }
CUresult cuFuncGetAttribute(int* v, int attr, void*) {
    *v = attr == 0 ? 1024 : 0;  // MAX_THREADS_PER_BLOCK
    return OK;
}
CUresult cuFuncSetCacheConfig(void*, int) { return OK; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void* s, void** params, void** extra) {
    if (extra) return ERR_INVALID_VALUE;
    const Kernel* k = (const Kernel*)f;
    // The argument values are copied now (a captured launch replays them later).
    auto bytes = std::make_shared<std::vector<std::vector<unsigned char>>>();
    for (size_t i = 0; i < k->arg_sizes.size(); ++i) {
        const unsigned char* p = (const unsigned char*)params[i];
        bytes->emplace_back(p, p + k->arg_sizes[i]);
    }
    submit(s, [=] {
        std::lock_guard<std::recursive_mutex> l(g_lock);
        std::vector<void*> args;
        for (auto& b : *bytes) args.push_back(b.data());
        const dim3 grid{gx, gy, gz}, block{bx, by, bz};
        void** a = args.data();
        cuemu::launch(grid, block, smem, [&] { k->call(a); });
    }, k->name);
    return OK;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, void*, int, size_t, unsigned) {
    *n = 1;
    return OK;
}
CUresult cuProfilerStart() { return OK; }
CUresult cuProfilerStop() { return OK; }

// ---- NVRTC: a "compile" that checks the source is the one this library was built from ----
struct Program {
    std::string src, name;
};
int nvrtcVersion(int* major, int* minor) {
    *major = 13;
    *minor = 0;
    return 0;
}
int nvrtcCreateProgram(void** prog, const char* src, const char* name, int, const char* const*, const char* const*) {
    *prog = new Program{src, name ? name : ""};
    return 0;
}
static unsigned long long fnv(const std::string& s) {
    unsigned long long h = 1469598103934665603ull;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}
static std::string module_of(const Program* p) {
    const std::string h = std::to_string(fnv(p->src));
    for (const auto& m : MODULE_HASHES)
        if (h == m[1]) return m[0];
    return "";
}
int nvrtcCompileProgram(void* prog, int, const char* const*) {
    return module_of((Program*)prog).empty() ? 6 : 0;  // NVRTC_ERROR_COMPILATION
}
int nvrtcGetPTXSize(void* prog, size_t* n) {
    *n = std::strlen("// cuemu module \n") + module_of((Program*)prog).size() + 1;
    return 0;
}
int nvrtcGetPTX(void* prog, char* out) {
    std::string s = "// cuemu module " + module_of((Program*)prog) + "\n";
    std::memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}
int nvrtcGetProgramLogSize(void* prog, size_t* n) {
    *n = 200 + ((Program*)prog)->name.size();
    return 0;
}
int nvrtcGetProgramLog(void* prog, char* out) {
    const Program* p = (Program*)prog;
    std::snprintf(out, 200 + p->name.size(), "%s",
                  module_of(p).empty() ? ("cuemu: " + p->name + " is not a kernel source this library was built from (rebuild it)").c_str() : "");
    return 0;
}
int nvrtcDestroyProgram(void** prog) {
    delete (Program*)*prog;
    *prog = nullptr;
    return 0;
}
const char* nvrtcGetErrorString(int r) { return r ? "cuemu: unknown kernel source" : "NVRTC_SUCCESS"; }

// ---- cuBLAS: column-major GEMMs with f64 sums, rounded once ----
struct Blas {
    void* stream = nullptr;  // the handle's stream (each handle its own, as cuBLAS's)
};
int cublasCreate_v2(void** h) {
    *h = new Blas();
    return 0;
}
int cublasDestroy_v2(void* h) {
    delete (Blas*)h;
    return 0;
}
int cublasSetStream_v2(void* h, void* s) {
    ((Blas*)h)->stream = s;
    return 0;
}
int cublasSetMathMode(void*, int) { return 0; }
int cublasSetAtomicsMode(void*, int) { return 0; }
int cublasSetWorkspace_v2(void*, void*, size_t) { return 0; }
int cublasSetPointerMode_v2(void*, int) { return 0; }
static double load_elem(const void* p, int type, size_t i) {
    if (type == 0) return ((const float*)p)[i];                                             // CUDA_R_32F
    if (type == 14) return __uint_as_float((unsigned)((const unsigned short*)p)[i] << 16);  // CUDA_R_16BF
    if (type == 2) return cuemu::f16_to_f32(((const unsigned short*)p)[i]);                // CUDA_R_16F
    cuemu::fail("cublasGemmEx: unsupported data type");
}
static void store_elem(void* p, int type, size_t i, double v) {
    if (type == 0) ((float*)p)[i] = (float)v;
    else if (type == 14) ((unsigned short*)p)[i] = cuemu::f32_to_bf16_rn((float)v);
    else if (type == 2) ((unsigned short*)p)[i] = cuemu::f32_to_f16_rn((float)v);
    else cuemu::fail("cublasGemmEx: unsupported output type");
}
// C = alpha·op(A)·op(B) + beta·C, column-major (op 0: N, 1: T).
static void gemm(int ta, int tb, int m, int n, int k, float alpha, const void* A, int at, int lda, const void* B,
                 int bt, int ldb, float beta, void* C, int ct, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double s = 0;
            for (int l = 0; l < k; ++l) {
                const double a = load_elem(A, at, ta ? (size_t)i * lda + l : (size_t)l * lda + i);
                const double b = load_elem(B, bt, tb ? (size_t)l * ldb + j : (size_t)j * ldb + l);
                s += a * b;
            }
            const size_t ci = (size_t)j * ldc + i;
            const double c = beta == 0.0f ? 0.0 : (double)beta * load_elem(C, ct, ci);
            store_elem(C, ct, ci, (double)(float)((double)alpha * (float)s) + c);
        }
}
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int, int) {
    const float al = *(const float*)alpha, be = *(const float*)beta;
    submit(((Blas*)h)->stream, [=] { gemm(ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ct, ldc); }, "cublasGemmEx");
    return 0;
}
int cublasSgemm_v2(void* h, int ta, int tb, int m, int n, int k, const float* alpha, const float* A, int lda,
                   const float* B, int ldb, const float* beta, float* C, int ldc) {
    const float al = *alpha, be = *beta;
    submit(((Blas*)h)->stream, [=] { gemm(ta, tb, m, n, k, al, A, 0, lda, B, 0, ldb, be, C, 0, ldc); }, "cublasSgemm");
    return 0;
}
}  // extern "C"
