//! What the expert-GEMM benchmarks share (`bench_gemm`, `bench_qgemm`, `bench_fp8block`): the
//! benchmark model's expert shapes, its routing and timing with events.

// Each benchmark uses part of it.
#![allow(dead_code)]

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use mxrl_cuda::gpu::Gpu;
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Hidden size of the benchmark model (`mxrl bench model`).
pub const HIDDEN: usize = 2048;
/// Its experts' intermediate size.
pub const MOE_INTER: usize = 768;
/// Its routed experts per layer.
pub const EXPERTS: usize = 64;
/// Experts per token.
pub const TOP_K: usize = 8;
/// The experts' projections: (name, N, K) of the fused gate/up and the down projection.
pub const PROJS: [(&str, usize, usize); 2] = [
    ("gate_up", 2 * MOE_INTER, HIDDEN),
    ("down", HIDDEN, MOE_INTER),
];
/// Bytes cleared before each timed call so that it reads its weights from device memory.
pub const FLUSH_BYTES: usize = 256 << 20;

/// Median microseconds of `f` over `reps` calls (each between its own pair of events, L2
/// flushed before each), after 3 warm-up calls.
pub fn median_us(g: &Gpu, flush: &mut CudaSlice<u8>, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    g.sync().expect("warm-up");
    let ev = || {
        g.ctx()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event")
    };
    let mut pairs = Vec::with_capacity(reps);
    for _ in 0..reps {
        g.stream().memset_zeros(flush).expect("L2 flush");
        let (a, b) = (ev(), ev());
        a.record(g.stream()).expect("record");
        f();
        b.record(g.stream()).expect("record");
        pairs.push((a, b));
    }
    g.sync().expect("timed calls");
    let mut t: Vec<f64> = pairs
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).expect("elapsed") as f64 * 1e3)
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

/// Per-expert row counts of `tokens` tokens each routed to [`TOP_K`] distinct uniformly random
/// experts of [`EXPERTS`].
pub fn route(tokens: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut counts = vec![0usize; EXPERTS];
    for _ in 0..tokens {
        for e in sample(&mut rng, EXPERTS, TOP_K) {
            counts[e] += 1;
        }
    }
    counts
}

/// As [`route`], with one of every token's `TOP_K` rows sent to expert 0 and the others to
/// distinct uniformly random experts among the rest: one busy expert holding 1/`TOP_K` of
/// the rows.
pub fn route_busy(tokens: usize, seed: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut counts = vec![0usize; EXPERTS];
    for _ in 0..tokens {
        counts[0] += 1;
        for e in sample(&mut rng, EXPERTS - 1, TOP_K - 1) {
            counts[e + 1] += 1;
        }
    }
    counts
}

/// Row offsets of the experts' groups (`counts.len() + 1` entries).
pub fn offsets(counts: &[usize]) -> Vec<u32> {
    let mut o = vec![0u32];
    for c in counts {
        o.push(o.last().unwrap() + *c as u32);
    }
    o
}

/// A deterministic byte stream (LCG) mapped by `map`.
pub fn bytes(len: usize, seed: u64, map: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            map((s >> 33) as u8)
        })
        .collect()
}

/// Prints the device copy bandwidth (1 GiB, bytes read + written), the ceiling the weight
/// streams are read against.
pub fn print_copy_bandwidth(g: &Gpu, flush: &mut CudaSlice<u8>, reps: usize) {
    let big = 1usize << 30;
    let src = g.zeros::<u8>(big).expect("alloc");
    let mut dst = g.zeros::<u8>(big).expect("alloc");
    let us = median_us(g, flush, reps, || {
        g.stream().memcpy_dtod(&src, &mut dst).expect("copy");
    });
    println!(
        "device copy of 1 GiB: {:.0} µs = {:.0} GB/s (bytes read + written)",
        us,
        2.0 * big as f64 / (us * 1e-6) / 1e9
    );
}
