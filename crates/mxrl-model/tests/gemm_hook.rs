//! The GEMM backend hook (`mxrl_tensor::backend`) at model level: every linear GEMM of a
//! forward and backward goes through the process-wide backend, and the default CPU backend
//! gives exactly the bytes of the direct calls (a recording wrapper around `CpuGemm`, which
//! changes nothing, gives the same bytes as the default; a backend that perturbs its results
//! changes the model's output, so the calls really are routed through the hook).
//!
//! One test function: it switches the process-wide backend.

use mxrl_formats::Format;
use mxrl_model::{ForwardOptions, LinearPrecision, Model, ModelConfig, SeqInput};
use mxrl_tensor::backend::{
    gemm_backend, set_gemm_backend, CpuGemm, GemmBackend, GemmError, WeightView,
};
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `CpuGemm` with call counters (and, when `perturb`, forward outputs nudged by one ulp).
#[derive(Default)]
struct Recording {
    perturb: bool,
    nt: AtomicU64,
    nn: AtomicU64,
    tn: AtomicU64,
    keyed: AtomicU64,
}

impl GemmBackend for Recording {
    fn name(&self) -> String {
        "recording cpu".into()
    }
    fn nt(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.nt.fetch_add(1, Ordering::Relaxed);
        self.keyed
            .fetch_add(u64::from(w.key.is_some()), Ordering::Relaxed);
        let mut y = CpuGemm.nt(a, w, m, k, n)?;
        if self.perturb {
            for v in &mut y {
                *v = f32::from_bits(v.to_bits() ^ 1);
            }
        }
        Ok(y)
    }
    fn nn(
        &self,
        a: &[f32],
        w: WeightView<'_>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, GemmError> {
        self.nn.fetch_add(1, Ordering::Relaxed);
        CpuGemm.nn(a, w, m, k, n)
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
        self.tn.fetch_add(1, Ordering::Relaxed);
        CpuGemm.tn_into(a, b, c, m, k, n, accumulate)
    }
}

fn run(model: &Model) -> (Vec<u32>, Vec<u32>) {
    let seqs: Vec<Vec<u32>> = vec![vec![1, 5, 9, 2, 14, 3, 8, 8, 1, 0, 4], vec![7, 0, 3]];
    let batch: Vec<SeqInput<'_>> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    let out = model
        .forward(
            &batch,
            &ForwardOptions {
                train: true,
                ..ForwardOptions::default()
            },
        )
        .unwrap();
    let dlp: Vec<Vec<f32>> = out.logprobs.iter().map(|l| vec![0.3; l.len()]).collect();
    let g = model
        .backward(out.tape.as_ref().unwrap(), &dlp, 0.0)
        .unwrap();
    let lp = out.logprobs.iter().flatten().map(|f| f.to_bits()).collect();
    let gr = (0..model.params().len())
        .flat_map(|i| g.get(i).iter().map(|f| f.to_bits()).collect::<Vec<_>>())
        .collect();
    (lp, gr)
}

#[test]
fn every_linear_gemm_goes_through_the_backend_and_the_cpu_one_changes_nothing() {
    assert!(gemm_backend().name().starts_with("cpu"), "default backend");
    let config = ModelConfig {
        vocab_size: 16,
        ..ModelConfig::tiny()
    };
    for prec in [
        LinearPrecision::F32,
        LinearPrecision::Bf16,
        LinearPrecision::Quantized(LinearSpec::new(Format::Mxfp8, BackwardMode::Lowp).unwrap()),
        LinearPrecision::Quantized(
            LinearSpec::new(Format::Nvfp4, BackwardMode::Dequantized).unwrap(),
        ),
    ] {
        let mut model = Model::random(&config, 3).unwrap();
        model.set_precision_by(|_, _| prec).unwrap();
        let default = run(&model);

        let rec = Arc::new(Recording::default());
        set_gemm_backend(rec.clone());
        let recorded = run(&model);
        assert_eq!(
            recorded, default,
            "{prec:?}: recording CPU backend changed bytes"
        );
        let (nt, nn, tn) = (
            rec.nt.load(Ordering::Relaxed),
            rec.nn.load(Ordering::Relaxed),
            rec.tn.load(Ordering::Relaxed),
        );
        // At least 4 layers × (q, k, v, o, router, gate_up and down of ≥ 1 used expert) + lm_head.
        let min = 4 * (4 + 1 + 2) + 1;
        assert!(nt >= min, "{prec:?}: {nt} forward GEMMs");
        assert!(nn >= min && tn >= min, "{prec:?}: {nn} dgrad, {tn} wgrad");
        let keyed = rec.keyed.load(Ordering::Relaxed);
        if prec == LinearPrecision::F32 {
            assert_eq!(keyed, 0, "f32 masters change in place: never keyed");
        } else {
            assert_eq!(
                keyed, nt,
                "{prec:?}: prepared weights are resident operands"
            );
        }

        set_gemm_backend(Arc::new(Recording {
            perturb: true,
            ..Recording::default()
        }));
        assert_ne!(
            run(&model).0,
            default.0,
            "{prec:?}: output ignores the backend"
        );
        set_gemm_backend(Arc::new(CpuGemm));
    }
}
