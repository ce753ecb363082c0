//! A full model forward + backward with the linear GEMMs on the GPU (`CudaGemm` as the
//! process-wide GEMM backend) against the CPU. Needs `--features cuda` and a GPU.
//!
//! One test function: it switches the process-wide backend, so nothing may run beside it.
//!
//! What is checked, per linear precision (f32, BF16, MXFP8 `lowp`, NVFP4 `high_precision`,
//! NVFP4 `dequantized`):
//! 1. **Every GEMM of the GPU run is within the derived bound of the CPU GEMM on the same
//!    operands.** A checking backend runs each call on both devices with identical inputs,
//!    asserts `|gpu − cpu| ≤ 2γ_k·Σ|a||b|` (+ the accumulation term for wgrad; derivation in
//!    `tests/gemm_gpu.rs`) element by element, and returns the GPU result.
//! 2. **The plain GPU run is exactly that run:** its logprobs and gradients are byte-equal to
//!    the checked run's (everything else is deterministic host code), so the GPU forward and
//!    backward are the CPU model with each GEMM replaced by one within its bound.
//! 3. **Determinism (bitwise mode):** repeating the forward, or rebuilding the prepared
//!    weights (new operand keys, new uploads), gives the same bytes.
//! 4. **Residency:** prepared weights are uploaded once and freed when the model is dropped.
//!
//! The end-to-end difference to the CPU model is printed, not asserted: through RMSNorm,
//! softmax and top-k routing it has no bound tighter than the per-GEMM one above.
#![cfg(feature = "cuda")]

use mxrl_cuda::CudaGemm;
use mxrl_formats::Format;
use mxrl_model::{ForwardOptions, LinearPrecision, Model, ModelConfig, SeqInput};
use mxrl_tensor::backend::{
    set_gemm_backend, CpuGemm, GemmBackend, GemmError, OperandKey, WeightView,
};
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

fn gamma(k: usize) -> f64 {
    let u = 2f64.powi(-24);
    k as f64 * u / (1.0 - k as f64 * u)
}

/// Bound between two f32 sums of k products in different orders (see `tests/gemm_gpu.rs`).
fn pair_bound(k: usize, mag: f64) -> f64 {
    2.0 * gamma(k) * mag + 2.0 * k as f64 * 2f64.powi(-150)
}

fn assert_within(what: &str, gpu: &[f32], cpu: &[f32], tol: impl Fn(usize) -> f64) {
    for (e, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let d = (*g as f64 - *c as f64).abs();
        assert!(
            d <= tol(e),
            "{what} element {e}: gpu {g} cpu {c} |Δ| {d:e} > {:e}",
            tol(e)
        );
    }
}

/// Runs every call on the GPU and the CPU, checks the bound, returns the GPU's result.
struct Checked {
    gpu: Arc<CudaGemm>,
    calls: [AtomicU64; 3],
}

impl GemmBackend for Checked {
    fn name(&self) -> String {
        format!("checked {}", self.gpu.name())
    }

    fn nt(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.calls[0].fetch_add(1, Ordering::Relaxed);
        let g = self.gpu.nt(a, w, m, k, n)?;
        let c = CpuGemm.nt(a, w, m, k, n)?;
        assert_within(&format!("nt {m}x{k}x{n}"), &g, &c, |e| {
            let (i, j) = (e / n, e % n);
            let mag = (0..k)
                .map(|p| (a[i * k + p] as f64 * w.values[j * k + p] as f64).abs())
                .sum();
            pair_bound(k, mag)
        });
        Ok(g)
    }

    fn nn(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.calls[1].fetch_add(1, Ordering::Relaxed);
        let g = self.gpu.nn(a, w, m, k, n)?;
        let c = CpuGemm.nn(a, w, m, k, n)?;
        assert_within(&format!("nn {m}x{k}x{n}"), &g, &c, |e| {
            let (i, j) = (e / n, e % n);
            let mag = (0..k)
                .map(|p| (a[i * k + p] as f64 * w.values[p * n + j] as f64).abs())
                .sum();
            pair_bound(k, mag)
        });
        Ok(g)
    }

    fn tn_into(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<(), GemmError> {
        self.calls[2].fetch_add(1, Ordering::Relaxed);
        let mut cc = c.to_vec();
        self.gpu.tn_into(a, b, c, m, k, n, accumulate)?;
        CpuGemm.tn_into(a, b, &mut cc, m, k, n, accumulate)?;
        let u = 2f64.powi(-24);
        assert_within(&format!("tn {m}x{k}x{n}"), c, &cc, |e| {
            let (i, j) = (e / n, e % n);
            let mag = (0..k)
                .map(|p| (a[p * m + i] as f64 * b[p * n + j] as f64).abs())
                .sum();
            // Accumulation: |fl(c+p_g) − fl(c+p_c)| ≤ |p_g − p_c| + u(|r_g| + |r_c|)/(1 − u).
            let acc = if accumulate {
                u * (c[e].abs() as f64 + cc[e].abs() as f64) / (1.0 - u)
            } else {
                0.0
            };
            pair_bound(k, mag) + acc
        });
        Ok(())
    }

    fn release(&self, key: OperandKey) {
        self.gpu.release(key)
    }
}

fn config() -> ModelConfig {
    // Qwen3-MoE layout, every contraction dim a multiple of 32 (MXFP8 and NVFP4 blocks).
    ModelConfig {
        vocab_size: 96,
        ..ModelConfig::tiny()
    }
}

struct Run {
    logprobs: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
}

fn run(model: &Model, seqs: &[Vec<u32>]) -> Run {
    let batch: Vec<SeqInput<'_>> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    let out = model
        .forward(
            &batch,
            &ForwardOptions {
                train: true,
                ..ForwardOptions::default()
            },
        )
        .expect("forward");
    // d/dlogprob of Σ logprob·weight with fixed, varied weights.
    let dlp: Vec<Vec<f32>> = out
        .logprobs
        .iter()
        .enumerate()
        .map(|(s, lp)| {
            (0..lp.len())
                .map(|t| 0.1 + 0.05 * ((s + t) % 5) as f32)
                .collect()
        })
        .collect();
    let g = model
        .backward(out.tape.as_ref().expect("tape"), &dlp, 0.0)
        .expect("backward");
    let grads = (0..model.params().len())
        .map(|i| g.get(i).to_vec())
        .collect();
    Run {
        logprobs: out.logprobs,
        grads,
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
}

#[test]
fn model_forward_and_backward_on_the_gpu() {
    let gpu = Arc::new(CudaGemm::new(0).expect("CUDA device 0"));
    let checked = Arc::new(Checked {
        gpu: gpu.clone(),
        calls: Default::default(),
    });
    let seqs: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..(5 + 3 * s)).map(|t| (7 * s + 3 * t + 1) % 96).collect())
        .collect();
    let precisions = [
        ("f32", LinearPrecision::F32),
        ("bf16", LinearPrecision::Bf16),
        (
            "mxfp8-lowp",
            LinearPrecision::Quantized(LinearSpec::new(Format::Mxfp8, BackwardMode::Lowp).unwrap()),
        ),
        (
            "nvfp4-hp",
            LinearPrecision::Quantized(
                LinearSpec::new(Format::Nvfp4, BackwardMode::HighPrecision).unwrap(),
            ),
        ),
        (
            "nvfp4-dq",
            LinearPrecision::Quantized(
                LinearSpec::new(Format::Nvfp4, BackwardMode::Dequantized).unwrap(),
            ),
        ),
    ];
    for (name, prec) in precisions {
        let resident_before = gpu.stats().resident;
        let mut model = Model::random(&config(), 5).unwrap();
        model.set_precision_by(|_, _| prec).unwrap();

        set_gemm_backend(Arc::new(CpuGemm));
        let cpu = run(&model, &seqs);

        set_gemm_backend(gpu.clone());
        let s0 = gpu.stats();
        let g1 = run(&model, &seqs);
        let s1 = gpu.stats();
        let g2 = run(&model, &seqs);
        let s2 = gpu.stats();
        assert_eq!(
            bits(&g1.logprobs),
            bits(&g2.logprobs),
            "{name}: repeat forward"
        );
        assert_eq!(bits(&g1.grads), bits(&g2.grads), "{name}: repeat backward");
        if prec != LinearPrecision::F32 {
            // Resident weights: uploaded during the first run only.
            assert!(s1.weight_uploads > s0.weight_uploads, "{name}: no upload");
            assert_eq!(s2.weight_uploads, s1.weight_uploads, "{name}: re-uploaded");
            assert!(s2.weight_hits > s1.weight_hits, "{name}: cache unused");
        }
        // New prepared weights (new keys): same bytes.
        let mut rebuilt = model.clone();
        rebuilt.set_precision_by(|_, _| prec).unwrap();
        let g3 = run(&rebuilt, &seqs);
        assert_eq!(
            bits(&g1.logprobs),
            bits(&g3.logprobs),
            "{name}: rebuilt weights"
        );
        drop(rebuilt);

        set_gemm_backend(checked.clone());
        let before: Vec<u64> = checked
            .calls
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let chk = run(&model, &seqs);
        let calls: Vec<u64> = checked
            .calls
            .iter()
            .zip(&before)
            .map(|(c, b)| c.load(Ordering::Relaxed) - b)
            .collect();
        assert!(
            calls.iter().all(|&c| c > 0),
            "{name}: calls nt/nn/tn {calls:?}"
        );
        assert_eq!(
            bits(&chk.logprobs),
            bits(&g1.logprobs),
            "{name}: checked forward"
        );
        assert_eq!(
            bits(&chk.grads),
            bits(&g1.grads),
            "{name}: checked backward"
        );

        set_gemm_backend(gpu.clone());
        drop(model);
        assert_eq!(
            gpu.stats().resident,
            resident_before,
            "{name}: weights not freed"
        );
        eprintln!(
            "{name}: GEMM calls nt/nn/tn {calls:?} each within bound; GPU vs CPU model: \
             max |Δ logprob| {:.3e}, max |Δ grad| {:.3e}",
            max_abs_diff(&g1.logprobs, &cpu.logprobs),
            max_abs_diff(&g1.grads, &cpu.grads)
        );
    }
    set_gemm_backend(Arc::new(CpuGemm));
}
