//! The RL loop on the device engine on the GPU (`mxrl_rl::engine` over `CudaBackend`): the
//! same tests as `mxrl-rl/tests/engine_loop.rs` runs on the CPU backend, with what holds on any
//! backend: in bitwise mode (with routing replay: routes recorded during generation, in the
//! recorded decode step too) the rollout's re-scoring equals the trainer's logprobs exactly at
//! every step, weight sync is checked byte for byte, the run is deterministic (two runs give the
//! same bits), a resumed run continues with the same bits, and SFT on the GPU lowers the loss.
//! The GPU and CPU runs are compared (first-step loss and logprobs) and printed.
#![cfg(feature = "cuda")]

use mxrl_cuda::backend::CudaBackend;
use mxrl_rl::ablate::Built;
use mxrl_rl::engine::{EngineRollout, EngineTrainer};
use mxrl_rl::metrics::StepMetrics;
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{sft, RlConfig, RlRun, RunError, SftConfig};
use mxrl_rl::session::{build_engine, demo_model};
use mxrl_rl::task::{ArithmeticTask, TaskSource};
use mxrl_rl::text::TextCodec;
use mxrl_rl::SamplingConfig;
use mxrl_tensor::device::CpuBackend;

fn gpu() -> Result<CudaBackend, RunError> {
    Ok(CudaBackend::new(0)
        .unwrap_or_else(|e| panic!("the `cuda` feature is on but GPU 0 is not usable: {e}")))
}

type Gpu = Built<EngineTrainer<CudaBackend>, EngineRollout<CudaBackend>>;

fn gpu_build(model: &mxrl_model::Model) -> Gpu {
    build_engine(model, "bf16", 64, gpu).unwrap()
}

fn cfg(steps: u64) -> RlConfig {
    RlConfig {
        steps,
        prompts_per_step: 8,
        samples: 4,
        sampling: SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 3,
        },
        micro_batch: 16,
        bitwise: true,
        routing_replay: true,
        check_weight_sync: true,
        checkpoint_every: 1,
        adam: AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
        ..RlConfig::default()
    }
}

/// SFT on the GPU engine; returns the trained model and the first and last losses.
fn warmed(seed: u64) -> (mxrl_model::Model, f64, f64) {
    warmed_model(demo_model(seed).unwrap().0, seed)
}

/// [`warmed`] from `model`.
fn warmed_model(model: mxrl_model::Model, seed: u64) -> (mxrl_model::Model, f64, f64) {
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    let mut t = gpu_build(&model).trainer;
    let mut losses = Vec::new();
    sft(
        &mut t,
        &task,
        &codec,
        &SftConfig {
            steps: 40,
            batch: 64,
            seed: seed ^ 0x5f7,
            adam: AdamWConfig {
                lr: 3e-3,
                ..AdamWConfig::default()
            },
            aux_loss_coef: 0.0,
        },
        &mut |_, l| losses.push(l),
    )
    .unwrap();
    (
        t.master_model().unwrap(),
        losses[0],
        *losses.last().unwrap(),
    )
}

fn run_in<B: mxrl_tensor::device::Backend + 'static>(
    b: Built<EngineTrainer<B>, EngineRollout<B>>,
    dir: &std::path::Path,
    steps: u64,
) -> Vec<StepMetrics> {
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    let mut run = RlRun::new(
        cfg(steps),
        b.trainer,
        b.rollout,
        b.reference,
        task,
        &codec,
        dir,
        &b.contract_hash,
    )
    .unwrap();
    let mut ms = Vec::new();
    run.run(&mut |m| ms.push(m.clone())).unwrap();
    ms
}

#[test]
fn sft_and_bitwise_rl_on_the_gpu_engine() {
    let (model, first, last) = warmed(3);
    eprintln!("GPU SFT: loss {first:.4} → {last:.4}");
    assert!(
        last < 0.8 * first,
        "SFT did not lower the loss: {first} → {last}"
    );
    let d1 = tempfile::tempdir().unwrap();
    let a = run_in(gpu_build(&model), d1.path(), 4);
    for m in &a {
        eprintln!(
            "GPU step {}: reward {:.3} loss {:.5} grad norm {:.4} |Δlogp| {} sync {} B {:.1} ms",
            m.step,
            m.reward_mean,
            m.loss,
            m.grad_norm,
            m.train_rollout_logprob_abs_diff,
            m.sync_bytes,
            m.sync_s * 1e3
        );
        assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{m:?}");
        assert_eq!(m.k3_kl, 0.0, "{m:?}");
        // Probes gathered on the device: the re-scoring forward's equal the trainer's.
        assert_eq!(m.hidden_diff.len(), model.config().num_layers, "{m:?}");
        assert!(m.hidden_diff.iter().all(|&d| d == 0.0), "{m:?}");
        let moe = (0..model.config().num_layers)
            .filter(|&l| model.config().is_moe_layer(l))
            .count();
        assert_eq!(m.routing_agreement.len(), moe, "{m:?}");
        assert!(m.loss.is_finite() && m.grad_norm.is_finite(), "{m:?}");
    }
    // Deterministic: a second run from the same model gives the same bits.
    let d2 = tempfile::tempdir().unwrap();
    let b = run_in(gpu_build(&model), d2.path(), 4);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{x:?}\n{y:?}");
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
        assert_eq!(x.reward_mean.to_bits(), y.reward_mean.to_bits());
    }
    // Resumed after 2 steps (fresh engines): steps 3 and 4 have the same bits.
    let d3 = tempfile::tempdir().unwrap();
    assert_eq!(run_in(gpu_build(&model), d3.path(), 2).len(), 2);
    let r = run_in(gpu_build(&model), d3.path(), 4);
    assert_eq!(r.len(), 2);
    for (x, y) in a[2..].iter().zip(&r) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{x:?}\n{y:?}");
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
    }
    // The CPU engine on the same model: same prompts (same seed), different sampler stream
    // only through logits that differ in summation order; printed for the record.
    let d4 = tempfile::tempdir().unwrap();
    let c = run_in(
        build_engine(&model, "bf16", 64, || Ok(CpuBackend)).unwrap(),
        d4.path(),
        1,
    );
    eprintln!(
        "step 0: GPU reward {:.3} loss {:.5} | CPU reward {:.3} loss {:.5}",
        a[0].reward_mean, a[0].loss, c[0].reward_mean, c[0].loss
    );
}

/// Routes recorded on the GPU during generation (prefill, then decode steps replayed from the
/// recorded graph) are the routes the GPU engine's own forward takes over the same tokens:
/// replaying them changes the logprobs of a forward only by what the decode path's BF16 KV
/// cache changes (a near-tie flip at most), while misplaced routes would move them by whole
/// nats. Every recorded expert id is in range.
#[test]
fn routes_recorded_on_the_gpu_replay_the_engines_own_forward() {
    use mxrl_model::SeqInput;
    use mxrl_tensor::sample::SampleParams;
    let (model, _, _) = warmed(5);
    let e = mxrl_model::engine::Engine::from_model(&model, gpu().unwrap(), 64).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            (0..(3 + i) as u32)
                .map(|t| 40 + (t * 7 + i as u32) % 20)
                .collect()
        })
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let p = SampleParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        seed: 3,
        step: 0,
    };
    let gens = e.generate_capturing(&refs, 6, &p, &[]).unwrap();
    let c = model.config();
    let mut fulls = Vec::new();
    let mut traces = Vec::new();
    for (q, (s, t)) in prompts.iter().zip(gens) {
        let mut f = q.clone();
        f.extend_from_slice(&s.tokens);
        for r in &t.layers {
            assert_eq!(r.ids.len(), (f.len() - 1) * c.num_experts_per_tok);
            assert!(r.ids.iter().all(|&x| (x as usize) < c.num_experts));
        }
        fulls.push(f);
        traces.push(t);
    }
    let batch: Vec<SeqInput<'_>> = fulls
        .iter()
        .map(|f| SeqInput {
            tokens: &f[..f.len() - 1],
            targets: &f[1..],
        })
        .collect();
    let (free, _) = e.forward_train(&batch, 1.0).unwrap();
    let (replayed, _) = e.forward_train_replay(&batch, 1.0, Some(&traces)).unwrap();
    let worst = free
        .iter()
        .flatten()
        .zip(replayed.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("max |Δlogprob| replayed vs own routing: {worst:e}");
    assert!(worst < 0.05, "replayed routes move logprobs by {worst}");
}

/// Block-format recipes on the GPU engine: the trainer's stored tensors (MXFP8 quantized on
/// the device, NVFP4 by the library) are the CPU engine's bytes for the same masters; in
/// bitwise mode with routing replay the rollout multiplies the trainer's stored bytes (sent as
/// the wire export every step, checked byte for byte) and its re-scoring equals the trainer's
/// logprobs and probes exactly; two runs give the same bits.
#[test]
fn block_format_recipes_run_on_the_gpu_engine() {
    let (model, _, _) = warmed(3);
    for recipe in ["mxfp8", "mxfp8-dq", "nvfp4-hp"] {
        block_recipe_on_the_gpu_engine(&model, recipe);
    }
}

/// `fp8-block` on the GPU engine, on a model whose attention and expert linears have K and N
/// multiples of 128 (on the demo model every linear falls back to BF16): the FP8-block
/// weights are quantized on the device (the CPU engine's bytes: codes and f32 `scale_inv`
/// tiles), the forward runs the FP8-block GEMM kernel, the backward `high_precision`; the same
/// checks as the other block formats.
#[test]
fn fp8_block_recipe_runs_on_the_gpu_engine() {
    let wide = mxrl_rl::session::fp8_block_demo_config();
    let (model, first, last) = warmed_model(mxrl_model::Model::random(&wide, 3).unwrap(), 3);
    eprintln!("GPU SFT (hidden 128): loss {first:.4} → {last:.4}");
    let plan = mxrl_rl::moe::plan_for(model.config(), "fp8-block").unwrap();
    assert!(
        plan.entries()
            .iter()
            .any(|e| e.format == mxrl_formats::Format::Fp8Block),
        "the plan stores nothing in FP8 block"
    );
    block_recipe_on_the_gpu_engine(&model, "fp8-block");
}

/// The stored tensors of `recipe` on the GPU engine are the CPU engine's bytes; a bitwise RL
/// run has |Δlogprob| 0 and probe differences 0 at every step and is deterministic.
fn block_recipe_on_the_gpu_engine(model: &mxrl_model::Model, recipe: &str) {
    let g = build_engine(model, recipe, 64, gpu).unwrap();
    let c = build_engine(model, recipe, 64, || Ok(CpuBackend)).unwrap();
    use mxrl_rl::TrainPolicy;
    let stored = |x: Vec<mxrl_rl::WireTensor>| -> Vec<mxrl_rl::WireTensor> {
        x.into_iter()
            .filter(|t| t.format != mxrl_formats::Format::Bf16)
            .collect()
    };
    let (sg, sc) = (
        stored(g.trainer.export_weights().unwrap()),
        stored(c.trainer.export_weights().unwrap()),
    );
    assert!(!sg.is_empty(), "{recipe}: no block-format tensor");
    assert_eq!(sg.len(), sc.len(), "{recipe}");
    for (a, b) in sg.iter().zip(&sc) {
        assert!(
            a.name == b.name
                && a.format == b.format
                && a.data == b.data
                && a.scales == b.scales
                && a.amax
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(b.amax.iter().map(|v| v.to_bits())),
            "{recipe}: stored tensor {} differs from the CPU's",
            a.name
        );
    }
    let d1 = tempfile::tempdir().unwrap();
    let a = run_in(g, d1.path(), 3);
    for m in &a {
        eprintln!(
            "GPU {recipe} step {}: reward {:.3} loss {:.5} grad norm {:.4} |Δlogp| {} sync {} B {:.1} ms rollout {:.1} ms train {:.1} ms",
            m.step,
            m.reward_mean,
            m.loss,
            m.grad_norm,
            m.train_rollout_logprob_abs_diff,
            m.sync_bytes,
            m.sync_s * 1e3,
            m.rollout_s * 1e3,
            m.train_s * 1e3
        );
        assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{recipe}: {m:?}");
        assert!(m.hidden_diff.iter().all(|&d| d == 0.0), "{recipe}: {m:?}");
        assert!(
            m.loss.is_finite() && m.grad_norm.is_finite(),
            "{recipe}: {m:?}"
        );
    }
    assert!(a[0].grad_norm > 0.0, "{recipe}: {:?}", a[0]);
    let d2 = tempfile::tempdir().unwrap();
    let b = run_in(build_engine(model, recipe, 64, gpu).unwrap(), d2.path(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{recipe}: {x:?}\n{y:?}");
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "{recipe}");
    }
    let d3 = tempfile::tempdir().unwrap();
    let cm = run_in(c, d3.path(), 1);
    eprintln!(
        "{recipe} step 0: GPU reward {:.3} loss {:.5} | CPU reward {:.3} loss {:.5}",
        a[0].reward_mean, a[0].loss, cm[0].reward_mean, cm[0].loss
    );
}

#[path = "../../mxrl-model/tests/common/generation_probes.rs"]
mod generation_probes;

/// The per-layer probes the GPU engine records while it generates (prefill, then decode steps
/// replayed from the recorded graph) are, bitwise, the residual stream after every layer at
/// the response-predicting positions: the check `mxrl-model` runs on the CPU engine
/// (`generation_probes_are_the_residual_stream_after_every_layer`), here on the GPU — each
/// layer's probes through the final norm and head give exactly the logits of the model cut
/// after that layer, fed the same tokens on the GPU.
#[test]
fn generation_probes_on_the_gpu_are_the_residual_stream_after_every_layer() {
    use mxrl_tensor::sample::SampleParams;
    let (model, _, _) = warmed(5);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|i| {
            (0..(3 + i) as u32)
                .map(|t| 40 + (t * 7 + i as u32) % 20)
                .collect()
        })
        .collect();
    let p = SampleParams {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        seed: 3,
        step: 0,
    };
    let got =
        generation_probes::check_generation_probes(&model, || gpu().unwrap(), &prompts, 6, &p);
    assert!(got
        .iter()
        .all(|g| g.probes.as_ref().unwrap().iter().all(|x| x.is_finite())));
}

/// Without bitwise mode the GPU rollout records probes while it generates, so the RL loop
/// reports `hidden_diff` for every layer: non-zero (decode reads the BF16 KV cache), and
/// within twice the KV-cache rounding bound of `mxrl-rl`'s CPU test (`L · 2u`, u = 2⁻⁹): on the
/// GPU the two paths also sum in other orders (other GEMM shapes), which can flip the BF16
/// rounding of a GEMM operand by one unit u. A misplaced probe would be O(1) away.
#[test]
fn gpu_rl_loop_reports_hidden_diff_from_generation() {
    let (model, _, _) = warmed(3);
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    let b = gpu_build(&model);
    let d = tempfile::tempdir().unwrap();
    let mut run = RlRun::new(
        RlConfig {
            bitwise: false,
            ..cfg(2)
        },
        b.trainer,
        b.rollout,
        b.reference,
        task,
        &codec,
        d.path(),
        &b.contract_hash,
    )
    .unwrap();
    let mut ms = Vec::new();
    run.run(&mut |m| ms.push(m.clone())).unwrap();
    let layers = model.config().num_layers;
    let bound = 2.0 * layers as f64 * 2.0 * 2f64.powi(-9);
    for m in &ms {
        eprintln!("GPU step {}: hidden_diff {:?}", m.step, m.hidden_diff);
        assert_eq!(m.hidden_diff.len(), layers, "{m:?}");
        assert!(m.hidden_diff.iter().any(|&x| x > 0.0), "{m:?}");
        assert!(m.hidden_diff.iter().all(|&x| x <= bound), "{m:?}");
    }
}
