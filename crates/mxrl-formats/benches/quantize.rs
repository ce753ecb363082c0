//! Throughput of the fast CPU quantizers on a 4096×4096 BF16 tensor (32 MiB of input),
//! single-threaded and on all cores, against a plain memory copy of the same bytes measured
//! in the same run. Throughput is in bytes of BF16 input per second.
//!
//! Two measurements of the same functions:
//! - `wall/...`: criterion's wall clock (what a user waits for on this machine, as loaded);
//! - `cpu/...`: on-CPU time of the whole process (sum of `/proc/self/task/*/schedstat`
//!   run times), so bytes per CPU-second = throughput **per core**, insensitive to other
//!   processes sharing the cores.
//!
//! Run: `cargo bench -p mxrl-formats --bench quantize`

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use mxrl_formats::{Padding, Scheme};
use std::hint::black_box;
use std::time::Duration;

const M: usize = 4096;
const K: usize = 4096;

fn input() -> Vec<bf16> {
    // Deterministic values in (−3.5, 3.5) with per-row magnitude changes (xorshift).
    let mut s = 0x9E37_79B9u32;
    (0..M * K)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let u = (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
            bf16::from_f32(u * (1 + (i / K) % 7) as f32)
        })
        .collect()
}

/// On-CPU nanoseconds of every thread of this process.
fn process_cpu_ns() -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
    {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

/// Criterion measurement: process CPU time in nanoseconds.
struct CpuTime;

struct NsFormatter;

impl ValueFormatter for NsFormatter {
    fn scale_values(&self, typical: f64, values: &mut [f64]) -> &'static str {
        let (div, unit) = if typical >= 1e9 {
            (1e9, "cpu-s")
        } else if typical >= 1e6 {
            (1e6, "cpu-ms")
        } else {
            (1e3, "cpu-us")
        };
        values.iter_mut().for_each(|v| *v /= div);
        unit
    }
    fn scale_throughputs(&self, _typical: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let Throughput::Bytes(b) = t else {
            return "elem/cpu-s";
        };
        // values are ns per iteration → bytes per CPU-second, in GB/s (10^9).
        values
            .iter_mut()
            .for_each(|v| *v = *b as f64 / (*v / 1e9) / 1e9);
        "GB/cpu-s"
    }
    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

impl Measurement for CpuTime {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        process_cpu_ns()
    }
    fn end(&self, i: u64) -> u64 {
        process_cpu_ns().saturating_sub(i)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &NsFormatter
    }
}

const SCHEMES: [(&str, Scheme); 5] = [
    ("mxfp8.row", Scheme::MXFP8_ROW),
    ("mxfp8.col", Scheme::MXFP8_COL),
    ("nvfp4.tensor", Scheme::NVFP4_TENSOR),
    ("nvfp4.row", Scheme::NVFP4_ROW),
    ("fp8_block.weight", Scheme::FP8_BLOCK_WEIGHT),
];

fn run<Mm: Measurement>(c: &mut Criterion<Mm>, label: &str) {
    let x = input();
    let bytes = (x.len() * 2) as u64;
    let all = rayon::current_num_threads();
    for threads in [1usize, all] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut g = c.benchmark_group(format!("{label}/bf16_4096x4096/threads{threads}"));
        g.throughput(Throughput::Bytes(bytes));
        g.sample_size(10);
        g.warm_up_time(Duration::from_millis(300));
        g.measurement_time(Duration::from_secs(2));
        // Baseline: copy the same 32 MiB into a fresh buffer (the quantizers also allocate
        // their outputs), split over the same threads.
        g.bench_function("memcpy_baseline", |b| {
            b.iter(|| {
                pool.install(|| {
                    use rayon::prelude::*;
                    let mut out = vec![bf16::ZERO; x.len()];
                    out.par_chunks_mut(1 << 16)
                        .zip(x.par_chunks(1 << 16))
                        .for_each(|(o, i)| o.copy_from_slice(i));
                    black_box(out)
                })
            })
        });
        // Baseline for the `into` variants: copy into an already-allocated buffer.
        let mut pre = vec![bf16::ZERO; x.len()];
        g.bench_function("memcpy_into_baseline", |b| {
            b.iter(|| {
                pool.install(|| {
                    use rayon::prelude::*;
                    pre.par_chunks_mut(1 << 16)
                        .zip(x.par_chunks(1 << 16))
                        .for_each(|(o, i)| o.copy_from_slice(i));
                    black_box(&pre);
                })
            })
        });
        for (name, scheme) in SCHEMES {
            let mut out = mxrl_formats::quantize(&x, &[M, K], scheme, Padding::Reject).unwrap();
            g.bench_with_input(BenchmarkId::new("fast_into", name), &scheme, |b, &s| {
                b.iter(|| {
                    pool.install(|| {
                        mxrl_formats::quantize_into(&x, &[M, K], s, Padding::Reject, &mut out)
                            .unwrap()
                    });
                    black_box(&out);
                })
            });
        }
        for (name, scheme) in SCHEMES {
            g.bench_with_input(BenchmarkId::new("fast", name), &scheme, |b, &s| {
                b.iter(|| {
                    pool.install(|| {
                        black_box(mxrl_formats::quantize(&x, &[M, K], s, Padding::Reject).unwrap())
                    })
                })
            });
        }
        g.finish();
    }
}

fn wall(c: &mut Criterion) {
    run(c, "wall");
}

fn cpu(c: &mut Criterion<CpuTime>) {
    run(c, "cpu");
}

criterion_group!(wall_clock, wall);
criterion_group! {
    name = cpu_time;
    config = Criterion::default().with_measurement(CpuTime);
    targets = cpu
}
criterion_main!(cpu_time, wall_clock);
