//! The device context of the CUDA engine: one GPU, one stream, NVRTC-compiled op modules.
//!
//! Every op family (`ops::*`) compiles its kernel source through [`Gpu::module`], which prepends
//! the generated contract prelude ([`crate::cuda_prelude`]) and the common device helpers
//! ([`COMMON_SOURCE`]), compiles with [`crate::NVRTC_OPTIONS`] plus the device's architecture,
//! logs the options once, and caches the module by `(ordinal, key of source and options)`.
//! Nothing else compiles or launches kernels; launchers live next to their kernels' Rust
//! wrappers and check shapes before the `unsafe` launch.
#![allow(unsafe_code)]

use crate::{module_cache_key, DeviceError, NVRTC_OPTIONS};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaViewMut,
    DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub use crate::{op_module_source, COMMON_SOURCE};

type ModuleCache = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;

fn modules() -> &'static ModuleCache {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Which edges of a recorded decode graph become programmatic dependencies (programmatic
/// dependent launch, sm_90): with one, the next kernel is launched while its predecessor still
/// runs and waits inside (`griddepcontrol.wait`) until the predecessor's writes are visible,
/// which hides most of a launch's latency between the many small kernels of a decode step.
/// The results are the same bits: every op kernel waits before its first memory access.
/// Chosen by `MXRL_GRAPH_PDL` (`off`, `ops`, `all`), read when a graph is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphPdl {
    /// Every edge as recorded (each kernel starts after its predecessor has finished).
    Off,
    /// Edges from one op kernel to another.
    Ops,
    /// Edges from any kernel (cuBLAS' too: without a trigger of its own, a predecessor counts
    /// as triggered when its blocks exit) into an op kernel.
    All,
}

/// [`set_graph_pdl`]'s choice, ahead of `MXRL_GRAPH_PDL`.
static GRAPH_PDL: Mutex<Option<GraphPdl>> = Mutex::new(None);
/// (op kernels entered by a programmatic edge, op kernels) of the graph recorded last in this
/// process; both 0 when it was recorded with [`GraphPdl::Off`] (nothing is counted then).
static LAST_GRAPH_EDGES: Mutex<(usize, usize)> = Mutex::new((0, 0));
/// The node census of the graph recorded last in this process.
static LAST_GRAPH_CENSUS: Mutex<NodeCensus> = Mutex::new(NodeCensus {
    kernels: 0,
    memsets: 0,
    copies: 0,
    allocs: 0,
    other: 0,
});

/// Sets the [`GraphPdl`] mode of graphs recorded from now on in this process (`None`: back to
/// `MXRL_GRAPH_PDL`).
pub fn set_graph_pdl(mode: Option<GraphPdl>) {
    *GRAPH_PDL.lock().expect("graph mode poisoned") = mode;
}

/// (op kernels entered by a programmatic edge, op kernels) of the graph this process recorded
/// last; both 0 when it was recorded with [`GraphPdl::Off`] (nothing is counted then).
pub fn last_graph_edges() -> (usize, usize) {
    *LAST_GRAPH_EDGES.lock().expect("graph edges poisoned")
}

/// The nodes by type of the graph this process recorded last (all zero where the driver lists
/// no nodes, as the host stand-in does).
pub fn last_graph_census() -> NodeCensus {
    *LAST_GRAPH_CENSUS.lock().expect("graph census poisoned")
}

impl GraphPdl {
    /// The mode [`set_graph_pdl`] set, else the one `MXRL_GRAPH_PDL` names (default
    /// [`GraphPdl::Off`]).
    ///
    /// # Errors
    /// A value other than `off`, `ops`, `all`.
    pub fn from_env() -> Result<GraphPdl, String> {
        if let Some(m) = *GRAPH_PDL.lock().expect("graph mode poisoned") {
            return Ok(m);
        }
        match std::env::var("MXRL_GRAPH_PDL").as_deref() {
            Err(_) | Ok("") | Ok("off") => Ok(GraphPdl::Off),
            Ok("ops") => Ok(GraphPdl::Ops),
            Ok("all") => Ok(GraphPdl::All),
            Ok(v) => Err(format!("MXRL_GRAPH_PDL={v}: expected off, ops or all")),
        }
    }
}

/// A recorded and instantiated CUDA graph ([`Gpu::end_capture`]).
pub struct DeviceGraph {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
    stream: Arc<CudaStream>,
    programmatic: usize,
    kernels: usize,
    census: NodeCensus,
}

/// The nodes of a recorded graph by type ([`DeviceGraph::census`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCensus {
    /// Kernels (the engine's and cuBLAS').
    pub kernels: usize,
    /// Memory sets.
    pub memsets: usize,
    /// Copies.
    pub copies: usize,
    /// Stream-ordered allocations and frees recorded into the graph.
    pub allocs: usize,
    /// Every other node (events, empty nodes, host functions, child graphs).
    pub other: usize,
}

impl std::fmt::Display for NodeCensus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernels, {} memsets, {} copies, {} allocations/frees, {} other",
            self.kernels, self.memsets, self.copies, self.allocs, self.other
        )
    }
}

/// The nodes of `g` by type (zeros where the driver cannot list them).
///
/// # Safety
/// `g` is a live graph.
unsafe fn census_of(g: cudarc::driver::sys::CUgraph) -> NodeCensus {
    use cudarc::driver::sys::{self, CUgraphNodeType as T};
    let mut c = NodeCensus::default();
    let mut n = 0usize;
    if sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) != sys::CUresult::CUDA_SUCCESS {
        return c;
    }
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    if n == 0 || sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) != sys::CUresult::CUDA_SUCCESS
    {
        return c;
    }
    for &node in &nodes[..n] {
        let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
        if sys::cuGraphNodeGetType(node, &mut t) != sys::CUresult::CUDA_SUCCESS {
            c.other += 1;
            continue;
        }
        match t {
            T::CU_GRAPH_NODE_TYPE_KERNEL => c.kernels += 1,
            T::CU_GRAPH_NODE_TYPE_MEMSET => c.memsets += 1,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => c.copies += 1,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC | T::CU_GRAPH_NODE_TYPE_MEM_FREE => c.allocs += 1,
            _ => c.other += 1,
        }
    }
    c
}

impl DeviceGraph {
    /// Runs the graph on the stream it was recorded from.
    ///
    /// # Errors
    /// The driver's error.
    pub fn launch(&self) -> Result<(), cudarc::driver::DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: `exec` is a live instantiated graph of this context.
        unsafe { cudarc::driver::sys::cuGraphLaunch(self.exec, self.stream.cu_stream()) }.result()
    }

    /// Op kernels entered by a programmatic edge, and all op kernels of the graph (both 0
    /// for a graph recorded with [`GraphPdl::Off`]: nothing is counted then).
    pub fn programmatic_edges(&self) -> (usize, usize) {
        (self.programmatic, self.kernels)
    }

    /// The graph's nodes by type.
    pub fn census(&self) -> NodeCensus {
        self.census
    }
}

impl Drop for DeviceGraph {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: both handles were made by the driver for this graph and are dropped once.
        unsafe {
            let _ = cudarc::driver::sys::cuGraphExecDestroy(self.exec);
            let _ = cudarc::driver::sys::cuGraphDestroy(self.graph);
        }
    }
}

/// The capture under way on this thread ([`Gpu::begin_capture`]): its stream, the mode, the
/// node of the op kernel launched last, and (edges made programmatic, op kernels launched).
struct Capture {
    stream: cudarc::driver::sys::CUstream,
    mode: GraphPdl,
    last_op: cudarc::driver::sys::CUgraphNode,
    counts: (usize, usize),
    arena: Option<Arena>,
}

/// Where buffers allocated while a graph is recorded come from ([`Gpu::empty`],
/// [`Gpu::zeros`]): a memory pool of the GPU's own, allocated from and freed to on a side
/// stream that is never recorded, so the graph holds no allocation or free nodes (a kernel
/// after one of those cannot be entered by a programmatic edge) and its buffers' addresses are
/// fixed when it is recorded.
///
/// Why reuse is safe: a capture records one stream, so the graph is a chain in recording order.
/// A buffer is freed (back to the pool, on the side stream) when its owner drops it, after
/// every kernel that uses it was recorded; a buffer that gets the same bytes later is only
/// used by kernels recorded later, which the chain runs later. Buffers still alive when the
/// recording ends stay allocated. Nothing but recordings allocates from the pool, so no buffer
/// outside a graph ever gets bytes a graph uses; graphs of one stream never run at once. The
/// pool keeps what it was given (release threshold at the maximum).
#[derive(Clone)]
struct Arena {
    side: Arc<CudaStream>,
    pool: PoolHandle,
}

/// A memory pool made by `cuMemPoolCreate` for one [`Gpu`]'s recordings.
#[derive(Clone, Copy)]
struct PoolHandle(cudarc::driver::sys::CUmemoryPool);
// SAFETY: a pool handle is a driver object usable from any thread of the process.
unsafe impl Send for PoolHandle {}
// SAFETY: as above; the driver synchronizes its own use of the pool.
unsafe impl Sync for PoolHandle {}

/// Whether recordings allocate from the [`Arena`] (`MXRL_GRAPH_ARENA`: `on`, the default, or
/// `off`, which records allocation and free nodes into the graph as the stream-ordered
/// allocator does).
fn arena_enabled() -> bool {
    !matches!(std::env::var("MXRL_GRAPH_ARENA").as_deref(), Ok("off"))
}

thread_local! {
    static CAPTURE: std::cell::RefCell<Option<Capture>> = const { std::cell::RefCell::new(None) };
}

/// The capture's current dependencies (`None` unless exactly one node).
///
/// # Safety
/// `stream` is capturing.
unsafe fn capture_tail(
    stream: cudarc::driver::sys::CUstream,
) -> Option<cudarc::driver::sys::CUgraphNode> {
    use cudarc::driver::sys;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut data: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n = 0usize;
    let r = sys::cuStreamGetCaptureInfo_v3(
        stream,
        &mut status,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut deps,
        &mut data,
        &mut n,
    );
    (r == sys::CUresult::CUDA_SUCCESS
        && status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
        && n == 1
        && !deps.is_null())
    .then(|| *deps)
}

/// Launches an op kernel (one of the op modules', all of which start with
/// `mxrl_grid_dependency()`). While this thread records a graph with a [`GraphPdl`] mode
/// other than `Off`, the edge from the node before it (an op kernel, or for `All` any kernel)
/// to this kernel is made programmatic first.
///
/// # Safety
/// As [`LaunchArgs::launch`]; the function is an op module's kernel.
pub(crate) unsafe fn launch_op(
    b: &mut cudarc::driver::LaunchArgs<'_>,
    cfg: cudarc::driver::LaunchConfig,
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let active = CAPTURE.with(|c| c.borrow().as_ref().map(|c| (c.stream, c.mode, c.last_op)));
    if let Some((stream, mode, last_op)) = active {
        if mode != GraphPdl::Off {
            if let Some(prev) = capture_tail(stream) {
                let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                let kernel = sys::cuGraphNodeGetType(prev, &mut t) == sys::CUresult::CUDA_SUCCESS
                    && t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL;
                if kernel && (mode == GraphPdl::All || prev == last_op) {
                    let mut node = prev;
                    let e = sys::CUgraphEdgeData {
                        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                        to_port: 0,
                        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
                            as u8,
                        reserved: [0; 5],
                    };
                    sys::cuStreamUpdateCaptureDependencies_v2(
                        stream,
                        &mut node,
                        &e,
                        1,
                        sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES
                            as u32,
                    )
                    .result()?;
                    CAPTURE.with(|c| {
                        if let Some(c) = c.borrow_mut().as_mut() {
                            c.counts.0 += 1;
                        }
                    });
                }
            }
        }
    }
    b.launch(cfg)?;
    if let Some((stream, GraphPdl::Ops | GraphPdl::All, _)) = active {
        let tail = capture_tail(stream);
        CAPTURE.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.last_op = tail.unwrap_or(std::ptr::null_mut());
                c.counts.1 += 1;
            }
        });
    }
    Ok(())
}

/// The NVRTC `--gpu-architecture` value for a compute capability (`None`: NVRTC's default).
pub fn arch_for(major: i32, minor: i32) -> Option<&'static str> {
    match (major, minor) {
        (7, 5) => Some("compute_75"),
        (8, 0) => Some("compute_80"),
        (8, 6) => Some("compute_86"),
        (8, 9) => Some("compute_89"),
        (9, 0) => Some("compute_90a"),
        (10, 0) => Some("compute_100"),
        (12, 0) => Some("compute_120"),
        _ => None,
    }
}

/// Compiles an op module's source with the engine's NVRTC options for `arch` (no GPU needed:
/// NVRTC runs on the host). Used by [`Gpu::module`] and by the host-side compile check.
///
/// # Errors
/// NVRTC not loadable, or a compile error with NVRTC's log.
pub fn compile_op_module(
    name: &str,
    source: &str,
    arch: Option<&'static str>,
) -> Result<Ptx, DeviceError> {
    compile_source(name, &op_module_source(source), arch)
}

/// Compiles the complete `source` of module `name` with the engine's NVRTC options for `arch`.
fn compile_source(
    name: &str,
    source: &str,
    arch: Option<&'static str>,
) -> Result<Ptx, DeviceError> {
    // SAFETY: only asks whether the NVRTC library can be found.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::Cuda {
            device: "nvrtc".into(),
            what: "the NVRTC library (libnvrtc) cannot be loaded".into(),
        });
    }
    let opts = CompileOptions {
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        use_fast_math: None,
        arch,
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    compile_ptx_with_opts(source, opts).map_err(|x| DeviceError::Cuda {
        device: "nvrtc".into(),
        what: format!("NVRTC compile of {name} failed: {x}"),
    })
}

/// Module `name` on `ctx`, from its complete `source` compiled with the engine's NVRTC options
/// for `arch` (`options` as listed in messages; `key` = [`crate::module_cache_key`] of both):
/// the PTX kept in the disk cache ([`crate::ptx_cache`]) when it is there and loads, else
/// compiled by NVRTC, loaded, and then kept there. `device` names the GPU in messages and
/// errors. Every module of the engine, the quantizers' included, is loaded this way.
///
/// # Errors
/// An NVRTC compile error (with its log) or a module load error.
pub(crate) fn load_module_cached(
    ctx: &Arc<CudaContext>,
    device: &str,
    name: &str,
    source: &str,
    key: &str,
    arch: Option<&'static str>,
    options: &[String],
) -> Result<Arc<CudaModule>, DeviceError> {
    let err = |what: String| DeviceError::Cuda {
        device: device.to_string(),
        what,
    };
    let cached = ptx_cache_path(name, key);
    let from_disk = cached.as_ref().and_then(|p| {
        let src = std::fs::read_to_string(p).ok()?;
        match ctx.load_module(Ptx::from_src(src)) {
            Ok(m) => Some(m),
            Err(x) => {
                // A damaged or foreign file: compile anew and replace it.
                eprintln!(
                    "mxrl-cuda: the cached {} did not load ({x:?}); compiling {name} anew",
                    p.display()
                );
                None
            }
        }
    });
    if let Some(m) = from_disk {
        return Ok(m);
    }
    eprintln!(
        "mxrl-cuda: compiling {name} for {device} (module key {key}) with NVRTC options \
         {options:?}{}",
        match &cached {
            Some(p) => format!("; kept in {}", p.display()),
            None => String::new(),
        }
    );
    let ptx = compile_source(name, source, arch).map_err(|e| match e {
        DeviceError::Cuda { what, .. } => err(what),
        other => other,
    })?;
    let src = cached.as_ref().map(|_| ptx.to_src());
    let m = ctx
        .load_module(ptx)
        .map_err(|x| err(format!("load module {name}: {x:?}")))?;
    // Kept only once it loaded here.
    if let (Some(p), Some(src)) = (&cached, src) {
        store_ptx(p, &src);
    }
    Ok(m)
}

/// NVRTC's version, where the library loads.
fn nvrtc_version() -> Option<(i32, i32)> {
    use cudarc::nvrtc::sys;
    // SAFETY: a library presence check, then a query writing two ints that outlive it.
    unsafe {
        if !sys::is_culib_present() {
            return None;
        }
        let (mut major, mut minor) = (0, 0);
        (sys::nvrtcVersion(&mut major, &mut minor) == sys::nvrtcResult::NVRTC_SUCCESS)
            .then_some((major, minor))
    }
}

/// Where the PTX of module `name` with key `key` is kept between processes: in
/// [`crate::ptx_cache::ptx_cache_dir`], named by the module, the key (which hashes the full
/// source and the NVRTC options, architecture included) and NVRTC's version, so PTX from
/// another NVRTC is never read. `None`: no cache folder, or NVRTC's version unknown.
fn ptx_cache_path(name: &str, key: &str) -> Option<std::path::PathBuf> {
    let (major, minor) = nvrtc_version()?;
    Some(crate::ptx_cache::ptx_cache_dir()?.join(format!("{name}-{key}-nvrtc{major}.{minor}.ptx")))
}

/// Writes `ptx` to `path` through a temporary file renamed when complete (best effort: a
/// cache that cannot be written is only slower).
fn store_ptx(path: &std::path::Path, ptx: &str) {
    let Some(dir) = path.parent() else { return };
    let tmp = path.with_extension(format!("ptx.partial-{}", std::process::id()));
    let ok = std::fs::create_dir_all(dir).is_ok()
        && std::fs::write(&tmp, ptx).is_ok()
        && std::fs::rename(&tmp, path).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Keeps memory freed by stream-ordered frees in the device's pool instead of returning it to
/// the driver at every synchronization, so that the many short-lived buffers of a step are
/// recycled without driver calls (as framework caching allocators do). Best effort: a driver
/// without memory pools keeps its default.
fn keep_freed_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver queries on this context's device; `pool` is written by the driver
    // and is live when its threshold is set.
    unsafe {
        if ctx.bind_to_thread().is_err()
            || sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                != sys::CUresult::CUDA_SUCCESS
        {
            return;
        }
        keep_pool_memory(pool);
    }
}

/// Sets `pool`'s release threshold to the maximum: memory freed to it stays in it (best
/// effort; a refusal leaves the driver's default).
///
/// # Safety
/// `pool` is a live memory pool.
unsafe fn keep_pool_memory(pool: cudarc::driver::sys::CUmemoryPool) {
    use cudarc::driver::sys;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: `threshold` outlives the call that reads it; `pool` is live (caller).
    let _ = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
}

/// Bytes of each of the two page-locked host buffers that host → device copies of weight
/// updates are staged through ([`Gpu::write_staged`]).
pub const STAGING_BYTES: usize = 8 << 20;

/// Two page-locked (write-combined) host buffers and, for each, an event recorded on the
/// stream after the copy that last read it ([`Gpu::write_staged`]).
struct Staging {
    bufs: [PinnedHostSlice<u8>; 2],
    read: [CudaEvent; 2],
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The buffers are freed below: no copy may still be reading them. (With event tracking
        // off, cudarc's own events of the buffers are never recorded, so it would not wait.)
        for e in &self.read {
            let _ = e.synchronize();
        }
    }
}

/// One CUDA GPU as the engine uses it: context, the stream every op runs on, the module
/// cache, the page-locked staging buffers of host → device copies and the page-locked
/// read-back buffer of device → host copies. Cheap to clone (`Arc`s).
#[derive(Clone)]
pub struct Gpu {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Option<&'static str>,
    options: Vec<String>,
    /// Allocated on the first staged copy.
    staging: Arc<Mutex<Option<Staging>>>,
    /// Page-locked (not write-combined: the host reads it) host buffer of
    /// [`Gpu::download_with`]: allocated on its first call, replaced by a larger one when a
    /// read-back needs more bytes, kept otherwise.
    readback: Arc<Mutex<Option<PinnedHostSlice<u8>>>>,
    /// The [`Arena`] of this stream's recordings: made on the first recording, destroyed with
    /// the last clone.
    arena: Arc<ArenaSlot>,
}

/// Holds a stream's [`Arena`]; destroys its pool when dropped (the driver releases the pool's
/// memory once the buffers still allocated from it, e.g. by a graph's owner, are freed).
#[derive(Default)]
struct ArenaSlot(Mutex<Option<Arena>>);

impl Drop for ArenaSlot {
    fn drop(&mut self) {
        if let Some(a) = self.0.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = a.side.synchronize();
            // SAFETY: the pool was made by `cuMemPoolCreate` and is destroyed once; buffers
            // still allocated from it keep it alive inside the driver until they are freed.
            unsafe {
                let _ = cudarc::driver::sys::cuMemPoolDestroy(a.pool.0);
            }
        }
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.name)
    }
}

fn shared_gpus() -> &'static Mutex<HashMap<usize, Gpu>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Gpu>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Gpu {
    /// Opens GPU `ordinal` (its primary context and a new stream).
    ///
    /// # Errors
    /// No driver, no such GPU: the driver's message.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        let dev = format!("cuda:{ordinal}");
        let e = |what: String| DeviceError::Cuda {
            device: dev.clone(),
            what,
        };
        // SAFETY: only asks whether the dynamically loaded driver library can be found.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(e(
                "the CUDA driver library (libcuda) cannot be loaded".into()
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|x| e(format!("cuInit/context: {x:?}")))?;
        let name = format!(
            "{dev} ({})",
            ctx.name().unwrap_or_else(|_| "unknown".into())
        );
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|x| e(format!("compute capability: {x:?}")))?;
        let arch = arch_for(major, minor);
        let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
        if let Some(a) = arch {
            options.push(format!("--gpu-architecture={a}"));
        }
        let stream = ctx
            .new_stream()
            .map_err(|x| e(format!("new stream: {x:?}")))?;
        // SAFETY: every buffer of the engine is created and used on this one stream (the one
        // exception, the gradient norm's partial sums on a second stream, orders itself with
        // explicit waits: `ops::optim::Optim::grad_norm_add`), so the per-buffer events cudarc
        // records to order work across streams are never needed (and events recorded outside
        // a CUDA-graph capture cannot be waited on inside it).
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx);
        Ok(Gpu {
            ordinal,
            name,
            ctx,
            stream,
            arch,
            options,
            staging: Arc::new(Mutex::new(None)),
            readback: Arc::new(Mutex::new(None)),
            arena: Arc::new(ArenaSlot::default()),
        })
    }

    /// This thread's shared handle of GPU `ordinal`: everything opened on one thread shares
    /// one stream (so work handed between its engines — a weight update device to device —
    /// is ordered by the stream), each thread has its own (so a decode step being recorded
    /// into a CUDA graph on one thread cannot capture another thread's work, as it would on
    /// a shared stream). The context is opened once per process.
    ///
    /// # Errors
    /// As [`Gpu::new`].
    pub fn shared(ordinal: usize) -> Result<Self, DeviceError> {
        thread_local! {
            static THREAD_GPUS: std::cell::RefCell<HashMap<usize, Gpu>> =
                std::cell::RefCell::new(HashMap::new());
        }
        if let Some(g) = THREAD_GPUS.with(|t| t.borrow().get(&ordinal).cloned()) {
            return Ok(g);
        }
        let base = {
            let mut cache = shared_gpus().lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(&ordinal) {
                Some(g) => g.clone(),
                None => {
                    let g = Gpu::new(ordinal)?;
                    cache.insert(ordinal, g.clone());
                    // The first thread takes the stream opened with the context.
                    THREAD_GPUS.with(|t| t.borrow_mut().insert(ordinal, g.clone()));
                    return Ok(g);
                }
            }
        };
        let stream = base
            .ctx
            .new_stream()
            .map_err(|x| base.err(format!("new stream: {x:?}")))?;
        let g = Gpu {
            stream,
            staging: Arc::new(Mutex::new(None)),
            readback: Arc::new(Mutex::new(None)),
            arena: Arc::new(ArenaSlot::default()),
            ..base
        };
        THREAD_GPUS.with(|t| t.borrow_mut().insert(ordinal, g.clone()));
        Ok(g)
    }

    /// Whether the op modules are compiled for Hopper's own instructions (`compute_90a`:
    /// `wgmma`), i.e. the device is an sm_90 GPU (H100, H200).
    pub fn has_wgmma(&self) -> bool {
        self.arch == Some("compute_90a")
    }

    /// `cuda:N (device name)`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The context.
    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op of this engine runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// NVRTC options (numerics) the op modules are compiled with.
    pub fn nvrtc_options(&self) -> &[String] {
        &self.options
    }

    /// Lets `func` (kernel `name`) launch with up to `bytes` of dynamic shared memory (past the
    /// 48 KiB a launch gets without asking).
    ///
    /// # Errors
    /// The driver's refusal (e.g. more than the device has), naming the kernel and the size.
    pub fn allow_dynamic_smem(
        &self,
        func: &CudaFunction,
        name: &str,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(bytes).unwrap_or(i32::MAX),
        )
        .map_err(|x| {
            self.err(format!(
                "{name}: allowing {bytes} B of shared memory: {x:?}"
            ))
        })
    }

    /// A device error naming this GPU.
    pub fn err(&self, what: impl std::fmt::Display) -> DeviceError {
        DeviceError::Cuda {
            device: self.name.clone(),
            what: what.to_string(),
        }
    }

    /// The compiled module of an op family (compiled on first use, then cached).
    ///
    /// # Errors
    /// An NVRTC compile error (with its log) or a module load error.
    pub fn module(&self, name: &str, source: &str) -> Result<Arc<CudaModule>, DeviceError> {
        let key = module_cache_key(&op_module_source(source), &self.options);
        let mut cache = modules().lock().expect("module cache poisoned");
        if let Some(m) = cache.get(&(self.ordinal, key.clone())) {
            return Ok(m.clone());
        }
        let m = load_module_cached(
            &self.ctx,
            &self.name,
            name,
            &op_module_source(source),
            &key,
            self.arch,
            &self.options,
        )?;
        cache.insert((self.ordinal, key), m.clone());
        Ok(m)
    }

    /// A zero-filled device buffer. While this stream records a graph, from the recording's
    /// arena (`Arena`) (the zeros are recorded as a memory set).
    ///
    /// # Errors
    /// Out of device memory (the driver's message).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, DeviceError> {
        if let Some(mut s) = self.arena_alloc::<T>(len)? {
            self.stream
                .memset_zeros(&mut s)
                .map_err(|x| self.err(format!("zeroing {len} elements: {x:?}")))?;
            return Ok(s);
        }
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|x| self.alloc_err::<T>(len, x))
    }

    /// A device buffer whose contents are unspecified (for outputs an op overwrites whole).
    /// While this stream records a graph, from the recording's arena (`Arena`).
    ///
    /// # Errors
    /// Out of device memory (the driver's message).
    pub fn empty<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, DeviceError> {
        if let Some(s) = self.arena_alloc::<T>(len)? {
            return Ok(s);
        }
        // SAFETY: `T: DeviceRepr` is plain data; callers only read elements an op has written.
        unsafe { self.stream.alloc::<T>(len.max(1)) }.map_err(|x| self.alloc_err::<T>(len, x))
    }

    /// The error of a failed allocation of `len` elements: its size in bytes and, when the
    /// device is out of memory, how much of it is free (the rest is held by this process's
    /// buffers and pools or by other processes).
    fn alloc_err<T>(&self, len: usize, x: cudarc::driver::DriverError) -> DeviceError {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
        if x.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let room = match self.ctx.mem_get_info() {
                Ok((free, total)) => {
                    format!(
                        " ({:.2} GiB of the device's {:.2} GiB free)",
                        gib(free),
                        gib(total)
                    )
                }
                Err(_) => String::new(),
            };
            return self.err(format!(
                "out of device memory allocating {len} elements, {:.3} GiB{room}",
                gib(bytes)
            ));
        }
        self.err(format!("allocating {len} elements ({bytes} bytes): {x:?}"))
    }

    /// `len` elements from the recording's [`Arena`] when this thread is recording this
    /// GPU's stream with one (`None` otherwise). The buffer belongs to the side stream: its
    /// drop frees it back to the pool there, outside the recording.
    fn arena_alloc<T: DeviceRepr>(&self, len: usize) -> Result<Option<CudaSlice<T>>, DeviceError> {
        let me = self.stream.cu_stream();
        let Some(arena) = CAPTURE.with(|c| {
            c.borrow()
                .as_ref()
                .filter(|c| c.stream == me)
                .and_then(|c| c.arena.clone())
        }) else {
            return Ok(None);
        };
        let n = len.max(1);
        let bytes = n * std::mem::size_of::<T>();
        let mut ptr: cudarc::driver::sys::CUdeviceptr = 0;
        // SAFETY: allocates `bytes` from the live pool on the live side stream; the driver
        // writes `ptr`.
        unsafe {
            cudarc::driver::sys::cuMemAllocFromPoolAsync(
                &mut ptr,
                bytes,
                arena.pool.0,
                arena.side.cu_stream(),
            )
        }
        .result()
        .map_err(|x| self.err(format!("allocating {len} elements while recording: {x:?}")))?;
        // SAFETY: `ptr` is a fresh allocation of `n` elements of plain data; the slice frees it
        // (stream-ordered, on the side stream, back to the pool) when dropped. Callers only
        // read elements an op has written, as for [`Gpu::empty`].
        Ok(Some(unsafe { arena.side.upgrade_device_ptr::<T>(ptr, n) }))
    }

    /// This stream's [`Arena`], made on first use.
    fn arena(&self) -> Result<Arena, DeviceError> {
        use cudarc::driver::sys;
        let mut slot = self.arena.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = slot.as_ref() {
            return Ok(a.clone());
        }
        let side = self
            .ctx
            .new_stream()
            .map_err(|x| self.err(format!("new stream for recordings' buffers: {x:?}")))?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal as i32,
            },
            // SAFETY: the remaining fields are plain data whose zero is "none".
            ..unsafe { std::mem::zeroed() }
        };
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        self.ctx
            .bind_to_thread()
            .map_err(|x| self.err(format!("{x:?}")))?;
        // SAFETY: creates a pool with the properties above; the driver writes `pool`, which is
        // live when its threshold is set.
        unsafe {
            sys::cuMemPoolCreate(&mut pool, &props)
                .result()
                .map_err(|x| self.err(format!("memory pool for recordings: {x:?}")))?;
            keep_pool_memory(pool);
        }
        let a = Arena {
            side,
            pool: PoolHandle(pool),
        };
        *slot = Some(a.clone());
        Ok(a)
    }

    /// Copies `host` into the first `host.len()` elements of `dst`.
    ///
    /// # Errors
    /// `dst` too short; a driver error.
    pub fn write<T: DeviceRepr>(
        &self,
        dst: &mut CudaSlice<T>,
        host: &[T],
    ) -> Result<(), DeviceError> {
        if host.len() > dst.len() {
            return Err(self.err(format!(
                "write of {} elements into a buffer of {}",
                host.len(),
                dst.len()
            )));
        }
        if host.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_htod(host, &mut dst.slice_mut(0..host.len()))
            .map_err(|x| self.err(format!("write of {} elements: {x:?}", host.len())))
    }

    /// Copies the concatenation of `parts` into the first bytes of `dst` (host → device, queued
    /// on the stream) through the two page-locked staging buffers of [`STAGING_BYTES`]: the
    /// host fills one buffer while the copy engine reads the other, and waits before it
    /// refills a buffer until the copy that read it has finished (its event). Returns when
    /// the last copy is queued; `parts` may be freed then (the bytes are in the staging
    /// buffers). Copies of ops queued later on the stream see the bytes.
    ///
    /// # Errors
    /// `dst` shorter than the parts; page-locked allocation or driver errors.
    pub fn write_staged(
        &self,
        dst: &mut CudaViewMut<'_, u8>,
        parts: &[&[u8]],
    ) -> Result<(), DeviceError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > dst.len() {
            return Err(self.err(format!(
                "staged write of {total} bytes into a buffer of {}",
                dst.len()
            )));
        }
        if total == 0 {
            return Ok(());
        }
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let pinned = || {
                // SAFETY: page-locked host memory; every byte copied from it is written first
                // (below, `fill` bytes per copy).
                unsafe { self.ctx.alloc_pinned::<u8>(STAGING_BYTES) }
                    .map_err(|x| self.err(format!("page-locked staging buffer: {x:?}")))
            };
            let event = || {
                self.ctx
                    .new_event(None)
                    .map_err(|x| self.err(format!("staging event: {x:?}")))
            };
            *guard = Some(Staging {
                bufs: [pinned()?, pinned()?],
                read: [event()?, event()?],
            });
        }
        let st = guard.as_mut().expect("allocated above");
        let (mut at, mut i) = (0usize, 0usize);
        let mut rest = parts.iter().copied().filter(|p| !p.is_empty());
        let mut part: &[u8] = rest.next().unwrap_or(&[]);
        while at < total {
            // Wait until the copy that last read buffer `i` is done, then fill it.
            st.read[i]
                .synchronize()
                .map_err(|x| self.err(format!("staging event: {x:?}")))?;
            let buf = st.bufs[i]
                .as_mut_slice()
                .map_err(|x| self.err(format!("staging buffer: {x:?}")))?;
            let mut fill = 0;
            while fill < buf.len() && !part.is_empty() {
                let n = part.len().min(buf.len() - fill);
                buf[fill..fill + n].copy_from_slice(&part[..n]);
                fill += n;
                part = &part[n..];
                if part.is_empty() {
                    part = rest.next().unwrap_or(&[]);
                }
            }
            // An asynchronous copy (the source is page-locked), then the event the next fill
            // of this buffer waits for.
            self.stream
                .memcpy_htod(&buf[..fill], &mut dst.slice_mut(at..at + fill))
                .map_err(|x| self.err(format!("staged copy of {fill} bytes: {x:?}")))?;
            st.read[i]
                .record(&self.stream)
                .map_err(|x| self.err(format!("staging event: {x:?}")))?;
            at += fill;
            i ^= 1;
        }
        Ok(())
    }

    /// A new buffer of `T` holding the concatenation of `parts` as it is (the bytes of each
    /// element in the host's order, little-endian as on the device), copied through the
    /// page-locked staging buffers ([`Gpu::write_staged`]).
    ///
    /// # Errors
    /// A byte count that is not a whole number of `T`; out of device memory; driver errors.
    pub fn upload_staged<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        parts: &[&[u8]],
    ) -> Result<CudaSlice<T>, DeviceError> {
        let bytes: usize = parts.iter().map(|p| p.len()).sum();
        let size = std::mem::size_of::<T>();
        if !bytes.is_multiple_of(size) {
            return Err(self.err(format!(
                "staged upload of {bytes} bytes is not a whole number of {size}-byte elements"
            )));
        }
        let mut buf = self.empty::<T>(bytes / size)?;
        // SAFETY: the buffer holds at least `bytes / size` elements, i.e. `bytes` bytes, and
        // `T: ValidAsZeroBits` is plain data for which every byte pattern written is a value.
        let mut view = unsafe { buf.transmute_mut::<u8>(bytes) }
            .ok_or_else(|| self.err(format!("staged upload of {bytes} bytes")))?;
        self.write_staged(&mut view, parts)?;
        Ok(buf)
    }

    /// Whether the stream is recording into a graph now ([`Gpu::begin_capture`]).
    ///
    /// # Errors
    /// The driver's error.
    pub fn capturing(&self) -> Result<bool, DeviceError> {
        let status = self
            .stream
            .capture_status()
            .map_err(|x| self.err(format!("capture status: {x:?}")))?;
        Ok(status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Starts recording the work queued on the stream into a graph instead of running it
    /// ([`Gpu::end_capture`] ends it). Relaxed mode: other threads may allocate meanwhile.
    ///
    /// # Errors
    /// The driver's error (e.g. a capture already under way).
    pub fn begin_capture(&self) -> Result<(), DeviceError> {
        let mode = GraphPdl::from_env().map_err(|e| self.err(e))?;
        let arena = if arena_enabled() {
            Some(self.arena()?)
        } else {
            None
        };
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|x| self.err(format!("begin graph capture: {x:?}")))?;
        CAPTURE.with(|c| {
            *c.borrow_mut() = Some(Capture {
                stream: self.stream.cu_stream(),
                mode,
                last_op: std::ptr::null_mut(),
                counts: (0, 0),
                arena,
            })
        });
        Ok(())
    }

    /// Ends the capture begun by [`Gpu::begin_capture`] and instantiates the graph (`None`
    /// when nothing was recorded). Nothing recorded has run yet: launch the graph to run it.
    ///
    /// # Errors
    /// The capture was invalidated (an operation that cannot be recorded was issued) or the
    /// graph cannot be instantiated.
    pub fn end_capture(&self) -> Result<Option<DeviceGraph>, DeviceError> {
        use cudarc::driver::sys;
        let capture = CAPTURE.with(|c| c.borrow_mut().take());
        self.ctx
            .bind_to_thread()
            .map_err(|x| self.err(format!("{x:?}")))?;
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture begun on this stream; the driver writes `g`.
        let r = unsafe { sys::cuStreamEndCapture(self.stream.cu_stream(), &mut g) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(self.err(format!("end graph capture: {r:?}")));
        }
        if let Some(a) = capture.as_ref().and_then(|c| c.arena.as_ref()) {
            // The recording's allocations and frees on the side stream are complete before
            // the graph can run.
            a.side
                .synchronize()
                .map_err(|x| self.err(format!("recordings' buffers: {x:?}")))?;
        }
        if g.is_null() {
            return Ok(None);
        }
        let (programmatic, kernels) = capture.as_ref().map_or((0, 0), |c| c.counts);
        // SAFETY: `g` is the live graph just recorded.
        let census = unsafe { census_of(g) };
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: instantiates the live graph `g`; the driver writes `exec`.
        let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, 0) };
        let inst = if r == sys::CUresult::CUDA_SUCCESS {
            Ok((programmatic, kernels))
        } else {
            Err(self.err(format!("instantiate graph: {r:?}")))
        };
        if inst.is_ok() {
            *LAST_GRAPH_CENSUS.lock().expect("graph census poisoned") = census;
        }
        if let (Ok((p, n)), Some(c)) = (&inst, &capture) {
            *LAST_GRAPH_EDGES.lock().expect("graph edges poisoned") = (*p, *n);
            if c.mode != GraphPdl::Off {
                eprintln!(
                    "mxrl-cuda: recorded graph ({census}), {p} of {n} op kernels entered by a \
                     programmatic edge ({:?})",
                    c.mode
                );
            }
        }
        match inst {
            Ok((programmatic, kernels)) => Ok(Some(DeviceGraph {
                graph: g,
                exec,
                stream: self.stream.clone(),
                programmatic,
                kernels,
                census,
            })),
            Err(e) => {
                // SAFETY: `g` is not used after this.
                unsafe { sys::cuGraphDestroy(g) };
                Err(e)
            }
        }
    }

    /// Copies host data to a new device buffer.
    ///
    /// # Errors
    /// Out of device memory or a driver error.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, DeviceError> {
        if host.is_empty() {
            // cudarc refuses zero-length allocations on some drivers; keep one element.
            // SAFETY: a one-element buffer nobody reads (its length is tracked by the caller).
            return unsafe { self.stream.alloc::<T>(1) }.map_err(|x| self.err(format!("{x:?}")));
        }
        self.stream
            .clone_htod(host)
            .map_err(|x| self.err(format!("upload of {} elements: {x:?}", host.len())))
    }

    /// Copies a device buffer (or view) back to the host (synchronizes the stream).
    ///
    /// # Errors
    /// A driver error (including one from an earlier asynchronous launch).
    pub fn download<T: DeviceRepr + Default + Clone, S: cudarc::driver::DevicePtr<T>>(
        &self,
        src: &S,
    ) -> Result<Vec<T>, DeviceError> {
        self.stream
            .clone_dtoh(src)
            .map_err(|x| self.err(format!("download: {x:?}")))
    }

    /// Copies a device buffer (or view) into the page-locked read-back buffer, waits for the
    /// copy (synchronizes the stream), and calls `f` with the elements there; returns what `f`
    /// returns. Unlike [`Gpu::download`], nothing is allocated once the buffer is large enough
    /// (it grows to the largest read-back asked for and is kept), and the copy runs at the
    /// full bandwidth of page-locked memory into pages that are already resident: for large
    /// tables of which the caller keeps parts. The buffer is held (a lock) until `f` returns,
    /// so `f` must not read back through this GPU (another clone of it included).
    ///
    /// # Errors
    /// Page-locked allocation or driver errors (including one from an earlier asynchronous
    /// launch).
    pub fn download_with<T, S, R>(
        &self,
        src: &S,
        f: impl FnOnce(&[T]) -> R,
    ) -> Result<R, DeviceError>
    where
        T: DeviceRepr + ValidAsZeroBits,
        S: cudarc::driver::DevicePtr<T>,
    {
        let n = src.len();
        if n == 0 {
            return Ok(f(&[]));
        }
        let bytes = n * std::mem::size_of::<T>();
        let mut guard = self.readback.lock().unwrap_or_else(|p| p.into_inner());
        if guard.as_ref().is_none_or(|b| b.len() < bytes) {
            // Free the smaller buffer first (no copy reads or writes it: every read-back
            // synchronizes the stream before it returns).
            *guard = None;
            // SAFETY: page-locked host memory, plain (flags 0, not write-combined: the host
            // reads it); it is zeroed below before any of it is read.
            let mut buf =
                unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(|x| {
                    self.err(format!(
                        "page-locked read-back buffer of {bytes} bytes: {x:?}"
                    ))
                })?;
            buf.as_mut_slice()
                .map_err(|x| self.err(format!("read-back buffer: {x:?}")))?
                .fill(0);
            *guard = Some(buf);
        }
        let buf = guard
            .as_mut()
            .expect("allocated above")
            .as_mut_slice()
            .map_err(|x| self.err(format!("read-back buffer: {x:?}")))?;
        if !buf.as_ptr().cast::<T>().is_aligned() {
            return Err(self.err(format!(
                "read-back buffer at {:p} is not aligned for {}-byte elements",
                buf.as_ptr(),
                std::mem::align_of::<T>()
            )));
        }
        // SAFETY: the buffer holds at least `bytes` = `n · size_of::<T>()` initialized bytes;
        // its start is page-aligned (page-locked allocations are whole pages), so aligned for
        // `T` (checked above all the same); `T: DeviceRepr + ValidAsZeroBits` is plain data,
        // for which the zero bytes the buffer starts with and the bytes of `T` values copied
        // from the device are values. The view borrows `buf` mutably: nothing else aliases it.
        let host: &mut [T] =
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<T>(), n) };
        // Asynchronous (the destination is page-locked); the synchronization below waits for
        // it and for everything queued before it.
        self.stream
            .memcpy_dtoh(src, host)
            .map_err(|x| self.err(format!("read-back of {n} elements: {x:?}")))?;
        self.sync()?;
        Ok(f(host))
    }

    /// Bytes of this GPU's default memory pool in use now and the most in use since the last
    /// [`Gpu::reset_pool_peak`] (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT` / `_HIGH`): what the
    /// stream-ordered allocator behind every buffer of the engine holds for the process.
    ///
    /// # Errors
    /// The driver's error (e.g. a driver without memory pools).
    pub fn pool_usage(&self) -> Result<(u64, u64), DeviceError> {
        use cudarc::driver::sys;
        let pool = self.default_pool()?;
        let mut cur: u64 = 0;
        let mut high: u64 = 0;
        // SAFETY: `pool` is the device's live default pool; each call writes one u64 through a
        // pointer to a local that outlives it (the attributes are cuuint64_t).
        let (a, b) = unsafe {
            (
                sys::cuMemPoolGetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                    (&mut cur as *mut u64).cast(),
                ),
                sys::cuMemPoolGetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut high as *mut u64).cast(),
                ),
            )
        };
        if a != sys::CUresult::CUDA_SUCCESS || b != sys::CUresult::CUDA_SUCCESS {
            return Err(self.err(format!("cuMemPoolGetAttribute: {a:?} / {b:?}")));
        }
        Ok((cur, high))
    }

    /// Resets the high-water mark of [`Gpu::pool_usage`] to the bytes in use now.
    ///
    /// # Errors
    /// The driver's error.
    pub fn reset_pool_peak(&self) -> Result<(), DeviceError> {
        use cudarc::driver::sys;
        let pool = self.default_pool()?;
        let mut zero: u64 = 0;
        // SAFETY: `pool` is the device's live default pool; setting USED_MEM_HIGH to 0 (the
        // only value the driver accepts for it) reads one u64 from a live local.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(self.err(format!("cuMemPoolSetAttribute(USED_MEM_HIGH): {r:?}")));
        }
        Ok(())
    }

    fn default_pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool, DeviceError> {
        use cudarc::driver::sys;
        if !self.ctx.has_async_alloc() {
            return Err(self.err(
                "the driver allocates without memory pools (no cuMemAllocAsync): pool usage \
                 is not measurable",
            ));
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err(format!("bind context: {e:?}")))?;
        // SAFETY: a plain driver query on this context's device; `pool` is written by it.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(self.err(format!("cuDeviceGetDefaultMemPool: {r:?}")));
        }
        Ok(pool)
    }

    /// Waits for every queued op; reports an asynchronous launch failure.
    ///
    /// # Errors
    /// The driver's error.
    pub fn sync(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(|x| self.err(format!("synchronize: {x:?}")))
    }
}
