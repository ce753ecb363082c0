//! `mxrl bench`: measurements that reproduce the seed's experiments.
//!
//! `mxrl bench memory` — bytes a quantized linear keeps for backward in each backward mode, for
//! the seed's experiment (one linear, input 2048×2048 BF16, 8192 outputs, forward + backward),
//! printed beside the seed's TransformerEngine numbers with an explanation of the differences.

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use mxrl_formats::Format;
use mxrl_tensor::qlinear::{memory_model, BackwardMode, LinearSpec, MemoryModel, PreparedWeight};
use std::time::Instant;

/// Arguments of `mxrl bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process
enum What {
    /// Memory each backward mode keeps (seed experiment: x [2048, 2048] BF16, 8192 outputs).
    Memory(MemoryArgs),
    /// The device engine at real width (2.63 B Qwen3-MoE, random weights): prefill, decode
    /// ms/step per batch size, decode roofline; ratios to transformers with `--hf-json`.
    Model(super::bench_model::ModelArgs),
    /// GPU quantizers on CUDA device 0: byte equality with the CPU library and throughput
    /// against a device-to-device copy measured in the same run (feature `cuda`).
    #[cfg(feature = "cuda")]
    Quantize(QuantizeArgs),
}

#[cfg(feature = "cuda")]
#[derive(clap::Args, Debug)]
struct QuantizeArgs {
    /// Rows M of the input.
    #[arg(long, default_value_t = 8192)]
    rows: usize,
    /// Columns K of the input.
    #[arg(long, default_value_t = 8192)]
    cols: usize,
    /// Timed calls per measurement (after one warm-up).
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

#[derive(clap::Args, Debug)]
struct MemoryArgs {
    /// Tokens M of the input x [M, K].
    #[arg(long, default_value_t = 2048)]
    m: usize,
    /// Input features K.
    #[arg(long, default_value_t = 2048)]
    k: usize,
    /// Output features N.
    #[arg(long, default_value_t = 8192)]
    n: usize,
    /// Also run the CPU layer (quantize, forward, backward) at this shape and check that the
    /// bytes its saved context and prepared weight hold equal the model (a few minutes at the
    /// default shape on 2 cores).
    #[arg(long)]
    execute: bool,
    /// Print every allocation of the replayed schedule.
    #[arg(long)]
    verbose: bool,
    /// `cuda`: also run the device layer (`mxrl_cuda::ops::qlinear`) on GPU 0 in each format
    /// and mode and print the bytes the device's memory pool actually holds beside the model
    /// and the seed (needs a binary built with `--features cuda`).
    #[command(flatten)]
    device: super::device::DeviceArgs,
}

/// Run `mxrl bench`.
pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Memory(a) => memory(a),
        What::Model(a) => super::bench_model::run(a),
        #[cfg(feature = "cuda")]
        What::Quantize(a) => quantize_gpu(a),
    }
}

#[cfg(feature = "cuda")]
fn quantize_gpu(a: QuantizeArgs) -> Result<()> {
    use mxrl_cuda::{CpuDevice, CudaDevice, Input, QuantDevice};
    use mxrl_formats::Scheme;
    let dev = CudaDevice::shared(0)?;
    println!(
        "{}: NVRTC options {:?}, module key {}",
        dev.name(),
        dev.nvrtc_options(),
        dev.module_key()
    );
    let (rows, cols) = (a.rows, a.cols);
    let x: Vec<f32> = fill(rows * cols, 7)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi((i / cols % 9) as i32 * 4 - 16))
        .collect();
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    // One table row: the timing, whether the bytes equal the CPU library's, the ratio.
    let print_row = |name: &str, t: &mxrl_cuda::QuantizeTiming, same: bool| {
        println!(
            "{:<13} {:<5} {:>6} {:>11.3} {:>9.0} {:>10.3} {:>9.0} {:>6.2}",
            name,
            t.dtype,
            if same { "equal" } else { "DIFFER" },
            t.quantize_ms,
            t.quantize_gbps(),
            t.memcpy_ms,
            t.memcpy_gbps(),
            t.quantize_gbps() / t.memcpy_gbps()
        );
    };
    let schemes = [
        Scheme::MXFP8_ROW,
        Scheme::MXFP8_COL,
        Scheme::NVFP4_TENSOR,
        Scheme::NVFP4_ROW,
    ];
    println!(
        "{:<13} {:<5} {:>6} {:>11} {:>9} {:>10} {:>9} {:>6}",
        "scheme", "dtype", "bytes", "quant ms", "GB/s", "memcpy ms", "GB/s", "ratio"
    );
    for scheme in schemes {
        for input in [Input::Bf16(&xb), Input::F32(&x)] {
            let gpu = dev.quantize(input, [rows, cols], scheme)?;
            let cpu = CpuDevice.quantize(input, [rows, cols], scheme)?;
            let same = gpu == cpu;
            let t = dev.time_quantize(input, [rows, cols], scheme, a.iters)?;
            print_row(&t.scheme, &t, same);
            if !same {
                bail!(
                    "{scheme} {}: GPU bytes differ from the CPU library",
                    t.dtype
                );
            }
        }
    }
    // The per-row NVFP4 kernel's compiled variants (16-blocks per thread kept in registers
    // between the row's amax and its quantization), each checked against the CPU library.
    println!(
        "per-row NVFP4 variants (blocks per thread; default f32 {}, bf16 {}):",
        mxrl_cuda::NVFP4_ROW_CHUNKS_DEFAULT.0,
        mxrl_cuda::NVFP4_ROW_CHUNKS_DEFAULT.1
    );
    for &chunks in &mxrl_cuda::NVFP4_ROW_CHUNKS {
        dev.set_nvfp4_row_chunks(Some(chunks))?;
        for input in [Input::Bf16(&xb), Input::F32(&x)] {
            let gpu = dev.quantize(input, [rows, cols], Scheme::NVFP4_ROW)?;
            let cpu = CpuDevice.quantize(input, [rows, cols], Scheme::NVFP4_ROW)?;
            let t = dev.time_quantize(input, [rows, cols], Scheme::NVFP4_ROW, a.iters)?;
            let name = format!("nvfp4.row/{chunks}");
            print_row(&name, &t, gpu == cpu);
            if gpu != cpu {
                dev.set_nvfp4_row_chunks(None)?;
                bail!("{name} {}: GPU bytes differ from the CPU library", t.dtype);
            }
        }
    }
    dev.set_nvfp4_row_chunks(None)?;
    println!(
        "GB/s count input read + data/scales/amax written (quantize) and read + write (memcpy)"
    );
    Ok(())
}

/// The seed's table (TransformerEngine#2644, `torch.cuda` allocated MB, BF16, input
/// (2048, 2048), out_features 8192): (format, mode, MB).
const SEED: [(Format, BackwardMode, f64); 6] = [
    (Format::Mxfp8, BackwardMode::Lowp, 94.1),
    (Format::Mxfp8, BackwardMode::HighPrecision, 53.1),
    (Format::Mxfp8, BackwardMode::Dequantized, 84.6),
    (Format::Nvfp4, BackwardMode::Lowp, 150.3),
    (Format::Nvfp4, BackwardMode::HighPrecision, 44.5),
    (Format::Nvfp4, BackwardMode::Dequantized, 75.3),
];

fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Deterministic, non-trivial data (no RNG state to carry): a scrambled ramp in [-1, 1).
fn fill(len: usize, salt: u64) -> Vec<f32> {
    (0..len as u64)
        .map(|i| {
            let h = (i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (h % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn memory(a: MemoryArgs) -> Result<()> {
    let on_cuda = a.device.device == super::device::Device::Cuda;
    if on_cuda {
        super::device::cuda_built()?;
    }
    let (m, k, n) = (a.m, a.k, a.n);
    let seed_shape = (m, k, n) == (2048, 2048, 8192);
    println!("mxrl bench memory: one linear y = x·Wᵀ, x [{m}, {k}] BF16, W [{n}, {k}] BF16, forward + backward");
    println!("MiB = 2^20 bytes (the seed's MB are torch.cuda.memory_allocated()/1024**2)");
    println!("kept = held from forward to backward besides y (x copies, backward-only W copies)");
    println!("fwd peak / peak = allocation replay of a device schedule (mxrl_tensor::qlinear::memory_model)");
    println!();
    println!(
        "{:<7} {:<15} {:>9} {:>9} {:>9} {:>10}",
        "format", "backward", "kept", "fwd peak", "peak", "seed (TE)"
    );
    let mut models: Vec<MemoryModel> = Vec::new();
    for (format, mode, seed_mb) in SEED {
        let seed = if seed_shape {
            format!("{seed_mb:.1}")
        } else {
            "-".into()
        };
        match LinearSpec::new(format, mode) {
            Ok(spec) => {
                let mm = memory_model(spec, m, k, n);
                println!(
                    "{:<7} {:<15} {:>9.2} {:>9.2} {:>9.2} {:>10}",
                    format.name(),
                    mode.name(),
                    mib(mm.kept_for_backward),
                    mib(mm.forward_peak),
                    mib(mm.peak),
                    seed
                );
                models.push(mm);
            }
            Err(e) => println!(
                "{:<7} {:<15} {:>9} {:>9} {:>9} {:>10}   ({e})",
                format.name(),
                mode.name(),
                "n/a",
                "n/a",
                "n/a",
                seed
            ),
        }
    }
    if a.verbose {
        for mm in &models {
            println!("\n{} allocations (MiB, * = kept for backward):", mm.spec);
            for al in &mm.allocations {
                let star = if al.kept_for_backward { "*" } else { " " };
                println!("  {:>8.3}{star} {}", mib(al.bytes), al.what);
            }
        }
    }
    println!("{}", explanation(&models, seed_shape));
    if a.execute {
        execute(m, k, n, &models)?;
    }
    if on_cuda {
        #[cfg(feature = "cuda")]
        memory_cuda(m, k, n, &models, seed_shape)?;
    }
    Ok(())
}

/// `--device cuda`: the device layer at the same shape, measured with the memory pool's
/// used-bytes counters around prepare + forward and backward.
#[cfg(feature = "cuda")]
fn memory_cuda(
    m: usize,
    k: usize,
    n: usize,
    models: &[MemoryModel],
    seed_shape: bool,
) -> Result<()> {
    use mxrl_cuda::gpu::Gpu;
    use mxrl_cuda::ops::qlinear::QLinear;
    use mxrl_cuda::DeviceInput;
    use std::sync::Arc;
    let gpu = Gpu::shared(0)?;
    let ql = QLinear::new(&gpu)?;
    let bf16_bits = |v: Vec<f32>| -> Vec<u16> {
        v.into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect()
    };
    // The caller's BF16 tensors, allocated before any measurement (not counted, as in the
    // model and the seed).
    let x = Arc::new(DeviceInput::Bf16(gpu.upload(&bf16_bits(fill(m * k, 1)))?));
    let w = Arc::new(DeviceInput::Bf16(gpu.upload(&bf16_bits(fill(n * k, 2)))?));
    let dy = DeviceInput::Bf16(gpu.upload(&bf16_bits(fill(m * n, 3)))?);
    struct Measured {
        held: u64,
        fwd_peak: u64,
        peak: u64,
        kept: usize,
    }
    let run = |spec: LinearSpec| -> Result<Measured> {
        gpu.sync()?;
        let (base, _) = gpu.pool_usage()?;
        gpu.reset_pool_peak()?;
        let qw = ql.prepare("bench.linear", &w, n, k, spec, 0)?;
        let (y, saved) = ql.forward(&qw, &x, m)?;
        gpu.sync()?;
        let (cur, fwd_high) = gpu.pool_usage()?;
        let kept = saved.kept_bytes() + qw.backward_bytes();
        let grads = ql.backward(&qw, saved, &dy)?;
        gpu.sync()?;
        let (_, high) = gpu.pool_usage()?;
        drop((grads, y, qw));
        gpu.sync()?;
        Ok(Measured {
            held: cur.saturating_sub(base),
            fwd_peak: fwd_high.saturating_sub(base),
            peak: high.saturating_sub(base),
            kept,
        })
    };
    let mibu = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "\n--device cuda: {} (mxrl_cuda::ops::qlinear, x, W, dy BF16 on the device; bytes of \
         the default memory pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT / _HIGH, above what was in \
         use before prepare)",
        gpu.name()
    );
    println!(
        "{:<7} {:<15} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>9}",
        "format",
        "backward",
        "kept",
        "fwd held",
        "fwd peak",
        "peak",
        "m:kept",
        "m:fwdpk",
        "m:peak",
        "seed (TE)"
    );
    for mm in models {
        // Warm-up (module loads, cuBLAS handles and workspaces, pool growth), then measured.
        run(mm.spec)?;
        let d = run(mm.spec)?;
        let seed = SEED
            .iter()
            .find(|(f, mode, _)| *f == mm.spec.format() && *mode == mm.spec.backward())
            .filter(|_| seed_shape)
            .map_or_else(|| "-".to_string(), |(_, _, mb)| format!("{mb:.1}"));
        println!(
            "{:<7} {:<15} {:>9.2} {:>9.2} {:>9.2} {:>9.2} | {:>9.2} {:>9.2} {:>9.2} | {:>9}",
            mm.spec.format().name(),
            mm.spec.backward().name(),
            mib(d.kept),
            mibu(d.held),
            mibu(d.fwd_peak),
            mibu(d.peak),
            mib(mm.kept_for_backward),
            mib(mm.forward_peak),
            mib(mm.peak),
            seed
        );
    }
    println!(
        "
kept = device bytes the saved context and the weight hold only for backward (a BF16 x or W is
  the caller's buffer, kept without a copy: 0); fwd held = pool bytes in use when forward has
  returned (weight cache + kept + y); fwd peak / peak = pool high-water marks of prepare +
  forward and of prepare + forward + backward. m:kept / m:fwdpk / m:peak = the CPU model's
  replay (mxrl_tensor::qlinear::memory_model; its kept counts the BF16 x of high_precision,
  which here is the caller's buffer).
Known differences from the model, by construction of this device path (Hopper, no native
block-scaled GEMM): y, dx and dW are f32 (4 B/elem; the model counts BF16), and every quantized
GEMM operand is dequantized to a transient BF16 copy right before its GEMM (x and W in the
forward; dy, W and x in the backward; NVFP4 dequantized backward splits each operand into three
BF16 parts), freed after it. The kept bytes are the model's."
    );
    Ok(())
}

/// What the columns mean and how they relate to the seed's numbers (values from `models`).
fn explanation(models: &[MemoryModel], seed_shape: bool) -> String {
    let get = |f: Format, mode: BackwardMode| {
        models
            .iter()
            .find(|mm| mm.spec.format() == f && mm.spec.backward() == mode)
    };
    let mut s = String::from(
        "
What is counted:
- kept: MXFP8 lowp keeps the column-wise x and W (32x1 blocks, each quantized from the BF16
  source); high_precision keeps the BF16 x (W is the parameter itself); dequantized keeps only
  the forward's quantized x (MXFP8 1.03 B/elem, NVFP4 0.5625 B/elem + one f32 amax per token).
  The modes that skip the column-wise copies keep less, which is the seed's point.
- fwd peak / peak: W row-wise is the per-version weight cache (counted); y, dx, dW are BF16;
  lowp quantizes dy row- and column-wise; dequantized materializes BF16 deq(W) for dgrad and
  deq(x) for wgrad; x, W and dy belong to the caller and are not counted.
- The CPU emulation also caches each weight's f32 GEMM operand (4 B/elem) for speed; that is
  an emulation cost, not a device one (PreparedWeight::emulation_bytes).
",
    );
    if !seed_shape {
        return s;
    }
    let (Some(mh), Some(md), Some(ml), Some(nh), Some(nd)) = (
        get(Format::Mxfp8, BackwardMode::HighPrecision),
        get(Format::Mxfp8, BackwardMode::Dequantized),
        get(Format::Mxfp8, BackwardMode::Lowp),
        get(Format::Nvfp4, BackwardMode::HighPrecision),
        get(Format::Nvfp4, BackwardMode::Dequantized),
    ) else {
        return s;
    };
    s.push_str(&format!(
        "
Against the seed (TransformerEngine's Linear, PyTorch allocator peaks; which buffers its
harness allocated, and when, is not published with the numbers, so these are readings, not
proofs):
- high_precision: seed 53.1 / 44.5 MiB vs our forward peak {:.1} / {:.1} MiB (W row-wise +
  x row-wise + y) — within {:.1} / {:.1} MiB, consistent with the seed's peak being the
  forward. Our full peak ({:.1} / {:.1}) adds BF16 dx and dW, which the seed's figure does not
  seem to include (e.g. wgrad accumulated into a preallocated main_grad).
- dequantized: the seed is 31.5 / 30.8 MiB above high_precision, about one BF16 [8192, 2048]
  dequantized W (32 MiB) materialized for dgrad; our replay has the same transient but frees
  it before dW, so our peak is {:.1} / {:.1} MiB above high_precision, and what dequantized
  keeps between forward and backward ({:.2} / {:.2} MiB) is less than high_precision's.
- lowp: the seed is 41.0 MiB above high_precision; our kept column-wise copies are {:.1} MiB
  and the two quantized dy copies another {:.1} MiB; our peak also counts dx and dW.
- NVFP4 lowp (seed 150.3) is TE's FP4 backward with random Hadamard transforms and stochastic
  rounding; the mxrl NVFP4 recipe has no low-precision backward (n/a).
",
        mib(mh.forward_peak),
        mib(nh.forward_peak),
        (53.1 - mib(mh.forward_peak)).abs(),
        (44.5 - mib(nh.forward_peak)).abs(),
        mib(mh.peak),
        mib(nh.peak),
        mib(md.peak) - mib(mh.peak),
        mib(nd.peak) - mib(nh.peak),
        mib(md.kept_for_backward),
        mib(nd.kept_for_backward),
        mib(ml.kept_for_backward),
        mib(ml
            .allocations
            .iter()
            .filter(|a| a.what.starts_with("dy "))
            .map(|a| a.bytes)
            .sum()),
    ));
    s
}

fn execute(m: usize, k: usize, n: usize, models: &[MemoryModel]) -> Result<()> {
    println!("\n--execute: CPU layer at [{m}, {k}] x [{n}, {k}] (quantize, forward, backward)");
    let x = fill(m * k, 1);
    let w = fill(n * k, 2);
    let dy = fill(m * n, 3);
    let pb = ProgressBar::new(models.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .expect("static progress template"),
    );
    let mut rows = Vec::new();
    for mm in models {
        pb.set_message(mm.spec.to_string());
        let t = Instant::now();
        let pw = PreparedWeight::quantize("bench.linear", &w, n, k, mm.spec, 0)?;
        let (_, saved) = pw.forward(&x, m)?;
        let grads = pw.backward(&saved, &dy)?;
        let secs = t.elapsed().as_secs_f64();
        // The weight's BF16 original kept by HighPrecision is the parameter itself on a device.
        let weight_extra = if mm.spec.backward() == BackwardMode::HighPrecision {
            0
        } else {
            pw.backward_bytes()
        };
        let measured = saved.kept_bytes() + weight_extra;
        if measured != mm.kept_for_backward {
            bail!(
                "{}: the layer keeps {measured} B but the model says {} B",
                mm.spec,
                mm.kept_for_backward
            );
        }
        if !grads.dw.iter().chain(&grads.dx).all(|v| v.is_finite()) {
            bail!("{}: non-finite gradient", mm.spec);
        }
        rows.push((mm.spec, measured, pw.emulation_bytes(), secs));
        pb.inc(1);
    }
    pb.finish_and_clear();
    println!(
        "{:<28} {:>14} {:>18} {:>8}",
        "spec", "kept (MiB)", "f32 operand (MiB)", "secs"
    );
    for (spec, kept, emu, secs) in rows {
        println!(
            "{:<28} {:>14.2} {:>18.2} {:>8.1}",
            spec.to_string(),
            mib(kept),
            mib(emu),
            secs
        );
    }
    println!("measured kept bytes equal the model for every mode");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_shape_bytes_follow_the_storage_layouts() {
        // Expected sizes from the layout table of `quant-contract.md`, not from the model:
        // MXFP8 1 B/elem + 1 B per 32; NVFP4 ½ B/elem + 1 B per 16 + 4 B amax; BF16 2 B/elem.
        let (m, k, n) = (2048, 2048, 8192);
        let mx = |r: usize, c: usize| r * c + r * c / 32;
        let spec = |f, mode| LinearSpec::new(f, mode).unwrap();
        let lowp = memory_model(spec(Format::Mxfp8, BackwardMode::Lowp), m, k, n);
        assert_eq!(lowp.kept_for_backward, mx(m, k) + mx(n, k));
        let hp = memory_model(spec(Format::Mxfp8, BackwardMode::HighPrecision), m, k, n);
        assert_eq!(hp.kept_for_backward, 2 * m * k);
        assert_eq!(hp.forward_peak, mx(n, k) + mx(m, k) + 2 * m * n);
        assert_eq!(hp.peak, mx(n, k) + 2 * m * n + 2 * m * k + 2 * n * k);
        let nv = memory_model(spec(Format::Nvfp4, BackwardMode::Dequantized), m, k, n);
        assert_eq!(nv.kept_for_backward, m * k / 2 + m * k / 16 + 4 * m);
        assert!(LinearSpec::new(Format::Nvfp4, BackwardMode::Lowp).is_err());
    }
}
