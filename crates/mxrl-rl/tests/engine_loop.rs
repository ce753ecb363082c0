//! The RL loop on the device engine (`mxrl_rl::engine`), run here on the engine's CPU
//! reference backend: the same code drives the GPU with `mxrl-cuda`'s backend.
//!
//! The CPU engine performs every f32 operation in the CPU model's order, so under the BF16
//! recipe the engine trainer must reproduce the model trainer (`MoeTrainer`) bit for bit:
//! logprobs, and the weights after optimizer steps. In bitwise mode the engine rollout's
//! re-scoring equals the trainer's logprobs exactly; a resumed run continues with the same
//! bits as an uninterrupted one (weights and AdamW moments restored).

use mxrl_rl::optim::AdamW;
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{optimizer_step, sft, RlConfig, RlRun, SftConfig};
use mxrl_rl::session::{build, build_engine, demo_model};
use mxrl_rl::task::{ArithmeticTask, TaskSource};
use mxrl_rl::text::TextCodec;
use mxrl_rl::{RolloutPolicy, SamplingConfig, TrainPolicy, TrainSeq};
use mxrl_tensor::device::CpuBackend;

fn engine_build(
    model: &mxrl_model::Model,
    recipe: &str,
) -> Result<
    mxrl_rl::ablate::Built<
        mxrl_rl::engine::EngineTrainer<CpuBackend>,
        mxrl_rl::engine::EngineRollout<CpuBackend>,
    >,
    mxrl_rl::runner::RunError,
> {
    build_engine(model, recipe, 64, || Ok(CpuBackend))
}

fn cfg(steps: u64, bitwise: bool) -> RlConfig {
    RlConfig {
        steps,
        prompts_per_step: 4,
        samples: 4,
        sampling: SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 3,
        },
        micro_batch: 8,
        bitwise,
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

/// Runs the RL loop of `cfg` on the CPU engine under `recipe` from `model` in `dir` (a run
/// already there resumes); returns every step's metrics.
fn run_engine(
    model: &mxrl_model::Model,
    recipe: &str,
    cfg: RlConfig,
    dir: &std::path::Path,
) -> Vec<mxrl_rl::metrics::StepMetrics> {
    let codec = TextCodec::char_level();
    let bd = engine_build(model, recipe).unwrap();
    let mut run = RlRun::new(
        cfg,
        bd.trainer,
        bd.rollout,
        bd.reference,
        TaskSource::Arithmetic(ArithmeticTask::default()),
        &codec,
        dir,
        &bd.contract_hash,
    )
    .unwrap();
    let mut ms = Vec::new();
    run.run(&mut |m| ms.push(m.clone())).unwrap();
    ms
}

/// The demo model after a supervised warm-up on the engine trainer (so rewards vary within
/// groups and the policy gradient is not zero).
fn warmed(seed: u64) -> mxrl_model::Model {
    warm(demo_model(seed).unwrap().0, seed)
}

fn fp8_model(seed: u64) -> mxrl_model::Model {
    mxrl_model::Model::random(&mxrl_rl::session::fp8_block_demo_config(), seed).unwrap()
}

/// `model` after the supervised warm-up of [`warmed`].
fn warm(model: mxrl_model::Model, seed: u64) -> mxrl_model::Model {
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    let mut t = engine_build(&model, "bf16").unwrap().trainer;
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
        &mut |_, _| {},
    )
    .unwrap();
    t.master_model().unwrap()
}

fn batch_of(codec: &TextCodec, n: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    TaskSource::Arithmetic(ArithmeticTask::default())
        .batch(11, 0, n)
        .iter()
        .map(|p| {
            let mut r = codec.encode(p.completion.as_ref().unwrap()).unwrap();
            r.push(codec.eos);
            (codec.encode(&p.prompt).unwrap(), r)
        })
        .collect()
}

fn seqs(b: &[(Vec<u32>, Vec<u32>)]) -> Vec<TrainSeq<'_>> {
    b.iter()
        .map(|(p, r)| TrainSeq {
            prompt: p,
            response: r,
            replay: None,
        })
        .collect()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Forward logprobs, then backward of `−mean logprob` and one optimizer step.
fn sft_step<T: TrainPolicy>(
    t: &mut T,
    opt: &mut AdamW,
    b: &[(Vec<u32>, Vec<u32>)],
) -> Vec<Vec<f32>> {
    t.zero_grad();
    let fw = t.forward(&seqs(b), 1.0).unwrap();
    let n: usize = fw.iter().map(|f| f.logprobs.len()).sum();
    let d: Vec<Vec<f32>> = fw
        .iter()
        .map(|f| vec![-1.0 / n as f32; f.logprobs.len()])
        .collect();
    t.backward(&d).unwrap();
    optimizer_step(t, opt).unwrap();
    fw.into_iter().map(|f| f.logprobs).collect()
}

/// Under every recipe the engine trainer (CPU backend) and the model trainer agree bit for
/// bit through three optimizer steps (clipping active: max_grad_norm 0.1): logprobs, probes,
/// masters, and the exported weights (BF16 values and the stored bytes of block-format
/// linears, re-quantized after every step).
fn engine_trainer_equals_the_model_trainer(recipe: &str) {
    engine_trainer_equals_the_model_trainer_on(&demo_model(5).unwrap().0, recipe);
}

/// [`engine_trainer_equals_the_model_trainer`] from `model`.
fn engine_trainer_equals_the_model_trainer_on(model: &mxrl_model::Model, recipe: &str) {
    let codec = TextCodec::char_level();
    let b = batch_of(&codec, 6);
    let mut mt = build(model, recipe).unwrap().trainer;
    let mut et = engine_build(model, recipe).unwrap().trainer;
    let c = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.0,
        max_grad_norm: 0.1,
        ..AdamWConfig::default()
    };
    let (mut om, mut oe) = (AdamW::new(c), AdamW::new(c));
    // The entropy of the engine (from its head pass) and of the model trainer (from the full
    // logits): the same tempered log-softmax, summed in another order.
    let fm = mt.forward(&seqs(&b), 1.0).unwrap();
    let fe = et.forward(&seqs(&b), 1.0).unwrap();
    // The per-layer probes (residual stream at the response-predicting positions): bitwise.
    for (x, y) in fm.iter().zip(&fe) {
        let (px, py) = (x.probes.as_ref().unwrap(), y.probes.as_ref().unwrap());
        assert_eq!((px.layers, px.width), (py.layers, py.width));
        let bx: Vec<u32> = px.values.iter().map(|v| v.to_bits()).collect();
        let by: Vec<u32> = py.values.iter().map(|v| v.to_bits()).collect();
        assert_eq!(bx, by);
    }
    let mut worst = 0f32;
    for (x, y) in fm.iter().zip(&fe) {
        assert_eq!(x.entropy.len(), y.entropy.len());
        for (p, q) in x.entropy.iter().zip(&y.entropy) {
            assert!(p.is_finite() && *p > 0.0);
            worst = worst.max((p - q).abs() / p);
        }
    }
    // 128-way sums of f32 terms: a relative difference of a few f32 roundings per term.
    assert!(
        worst < 128.0 * f32::EPSILON,
        "entropy relative difference {worst:e}"
    );
    for step in 0..3 {
        let lm = sft_step(&mut mt, &mut om, &b);
        let le = sft_step(&mut et, &mut oe, &b);
        assert_eq!(bits(&lm), bits(&le), "{recipe} step {step}");
    }
    // The loop's optimizer took no step of its own for the engine: the engine holds the
    // moments.
    assert!(oe.state.is_empty() && oe.step == 3 && om.step == 3);
    mt.refresh_weights().unwrap();
    et.refresh_weights().unwrap();
    let after = et.master_model().unwrap();
    let mm = mt.master_model().unwrap();
    for (p, q) in mm.params().iter().zip(after.params().iter()) {
        assert_eq!(p.name, q.name);
        let pb: Vec<u32> = p.data.iter().map(|x| x.to_bits()).collect();
        let qb: Vec<u32> = q.data.iter().map(|x| x.to_bits()).collect();
        assert_eq!(pb, qb, "{recipe} master {}", p.name);
    }
    // The export: the block-format linears' stored tensors, quantized from the new masters,
    // are the model trainer's by name, format, shape and bytes.
    let stored = |x: Vec<mxrl_rl::WireTensor>| {
        x.into_iter()
            .filter(|t| t.format != mxrl_formats::Format::Bf16)
            .map(|t| (t.name.clone(), t))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (xm, xe) = (
        stored(mt.export_weights().unwrap()),
        stored(et.export_weights().unwrap()),
    );
    assert_eq!(
        xe.is_empty(),
        recipe == "bf16",
        "{recipe}: {} stored tensors",
        xe.len()
    );
    assert_eq!(
        xm.keys().collect::<Vec<_>>(),
        xe.keys().collect::<Vec<_>>(),
        "{recipe}"
    );
    for (n, t) in &xm {
        let u = &xe[n];
        assert!(
            (t.format, &t.shape, &t.data, &t.scales) == (u.format, &u.shape, &u.data, &u.scales)
                && t.amax
                    .iter()
                    .map(|a| a.to_bits())
                    .eq(u.amax.iter().map(|a| a.to_bits())),
            "{recipe}: stored tensor {n} differs"
        );
    }
}

#[test]
fn engine_trainer_equals_the_model_trainer_bitwise_under_bf16() {
    engine_trainer_equals_the_model_trainer("bf16");
}

#[test]
fn engine_trainer_equals_the_model_trainer_bitwise_under_mxfp8_modes() {
    for r in ["mxfp8", "mxfp8-hp", "mxfp8-dq"] {
        engine_trainer_equals_the_model_trainer(r);
    }
}

#[test]
fn engine_trainer_equals_the_model_trainer_bitwise_under_nvfp4_modes() {
    for r in ["nvfp4-hp", "nvfp4-dq"] {
        engine_trainer_equals_the_model_trainer(r);
    }
}

/// `fp8-block` on a model whose attention and expert linears have K and N multiples of 128:
/// those run in FP8-block (1×128 activation, 128×128 weight scales; backward
/// `high_precision`), the last layer, router and lm_head in BF16; bitwise the model trainer.
#[test]
fn engine_trainer_equals_the_model_trainer_bitwise_under_fp8_block() {
    let model = fp8_model(5);
    let plan = mxrl_rl::moe::plan_for(model.config(), "fp8-block").unwrap();
    let fp8 = plan
        .entries()
        .iter()
        .filter(|e| e.format == mxrl_formats::Format::Fp8Block)
        .count();
    // Layers 0-2 (the last of 4 stays BF16): q/k/v/o and 4 experts × gate/up/down.
    assert_eq!(fp8, 3 * (4 + 4 * 3));
    engine_trainer_equals_the_model_trainer_on(&model, "fp8-block");
}

/// On the demo model (hidden 64) every linear of `fp8-block` falls back to BF16: the recipe
/// resolves and runs, exporting no stored tensors.
#[test]
fn fp8_block_on_the_demo_model_falls_back_to_bf16() {
    let (model, _) = demo_model(5).unwrap();
    let plan = mxrl_rl::moe::plan_for(model.config(), "fp8-block").unwrap();
    assert!(plan
        .entries()
        .iter()
        .all(|e| e.format == mxrl_formats::Format::Bf16));
    assert!(plan.entries().iter().any(|e| e.fell_back));
    let et = engine_build(&model, "fp8-block").unwrap().trainer;
    assert!(et
        .export_weights()
        .unwrap()
        .iter()
        .all(|t| t.format == mxrl_formats::Format::Bf16));
}

/// Bitwise mode on the engine: the rollout re-scores with the trainer's forward, so the
/// mismatch is exactly 0 at every step; without it the rollout's decode logprobs differ only
/// in f32 summation order. The weight update stays on the device (checksummed there) and is
/// also checked byte for byte against the wire export every step.
#[test]
fn engine_rl_loop_bitwise_mismatch_is_zero() {
    let model = warmed(3);
    for bitwise in [true, false] {
        let d = tempfile::tempdir().unwrap();
        let ms = run_engine(&model, "bf16", cfg(3, bitwise), d.path());
        assert_eq!(ms.len(), 3);
        for m in &ms {
            assert!(
                m.loss.is_finite() && m.grad_norm > 0.0 && m.entropy > 0.0,
                "{m:?}"
            );
            // Routing replay is on: the trainer's own routing against the rollout's, per MoE
            // layer (the rollout's decode reads the BF16 KV cache, so not always 1).
            let moe = (0..model.config().num_layers)
                .filter(|&l| model.config().is_moe_layer(l))
                .count();
            assert_eq!(m.routing_agreement.len(), moe, "{m:?}");
            assert!(
                m.routing_agreement.iter().all(|&a| a > 0.8 && a <= 1.0),
                "{m:?}"
            );
            // The update stayed on the device: exactly the BF16 bytes, no wire framing.
            assert_eq!(m.sync_bytes, 2 * model.params().num_elements() as u64);
            assert!(m.tokens > 0, "{m:?}");
            // The engine's generation says where its time went: phases within the rollout's
            // wall time, one decode step per new token after the first (at most).
            let ph = m
                .rollout_phases
                .expect("the engine rollout times its phases");
            let sum = ph.prefill_s + ph.decode_s + ph.readback_s;
            assert!(
                ph.prefill_s > 0.0 && ph.decode_s >= 0.0 && ph.readback_s >= 0.0,
                "{ph:?}"
            );
            assert!(sum <= m.rollout_s, "{ph:?} against {m:?}");
            let most = cfg(3, bitwise).sampling.max_new_tokens as u64;
            assert!(ph.decode_steps < most, "{ph:?}");
            if m.response_len > 1.0 {
                assert!(
                    ph.decode_steps >= 1 && ph.decode_s > 0.0,
                    "{ph:?} against {m:?}"
                );
            }
            if bitwise {
                assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{m:?}");
                assert_eq!(m.k3_kl, 0.0, "{m:?}");
                // Probes from the re-scoring forward equal the trainer's in every layer.
                assert_eq!(m.hidden_diff.len(), model.config().num_layers, "{m:?}");
                assert!(m.hidden_diff.iter().all(|&d| d == 0.0), "{m:?}");
            } else {
                assert!(m.train_rollout_logprob_abs_diff < 1e-3, "{m:?}");
                // Probes recorded while generating (prefill and KV-cache decode) against the
                // trainer's forward: every layer reported; the decode path reads the BF16 KV
                // cache, so they differ, by about its rounding.
                let layers = model.config().num_layers;
                assert_eq!(m.hidden_diff.len(), layers, "{m:?}");
                assert!(m.hidden_diff.iter().any(|&d| d > 0.0), "{m:?}");
                assert!(
                    m.hidden_diff
                        .iter()
                        .all(|&d| d <= kv_rounding_bound(layers)),
                    "{m:?}"
                );
            }
        }
        // The reference is frozen: the KL to it is 0 at the first step and positive after
        // the policy moved.
        assert_eq!(ms[0].ref_kl, Some(0.0), "{:?}", ms[0]);
        assert!(ms[2].ref_kl.unwrap() > 0.0, "{:?}", ms[2]);
    }
}

/// A run stopped after 2 steps and resumed from its checkpoint (fresh engines) gives the same
/// third and fourth steps, bit for bit, as a run that never stopped: masters and the device's AdamW
/// moments and step count are saved and restored.
#[test]
fn a_resumed_engine_run_continues_with_the_same_bits() {
    let model = warmed(4);
    let run_to =
        |dir: &std::path::Path, steps: u64| run_engine(&model, "bf16", cfg(steps, true), dir);
    let a = tempfile::tempdir().unwrap();
    let straight = run_to(a.path(), 4);
    let b = tempfile::tempdir().unwrap();
    assert_eq!(run_to(b.path(), 2).len(), 2);
    let resumed = run_to(b.path(), 4);
    assert_eq!(resumed.len(), 2, "only steps 3 and 4 run after resuming");
    // Step 3 sees the restored masters; step 4 also the update made with restored moments.
    for (x, y) in straight[2..].iter().zip(&resumed) {
        assert_eq!(x.step, y.step);
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{x:?}\n{y:?}");
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "{x:?}\n{y:?}");
        assert_eq!(x.reward_mean.to_bits(), y.reward_mean.to_bits());
    }
}

/// A recipe in a format the engine has no kernels for (NVFP4 with per-tensor activation
/// scaling) is refused by name, before anything runs.
#[test]
fn formats_without_engine_kernels_are_refused_with_the_reason() {
    let (model, _) = demo_model(6).unwrap();
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("nvfp4-tensor.toml");
    std::fs::write(
        &f,
        "name = \"nvfp4-tensor\"\nbackward = \"high_precision\"\ndefault = \"bf16\"\n\
         nvfp4_activation_scale = \"per_tensor\"\n[[rule]]\nrole = \"routed_expert\"\n\
         format = \"nvfp4\"\n",
    )
    .unwrap();
    let e = engine_build(&model, f.to_str().unwrap())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nvfp4-tensor") && e.contains("per-tensor") && e.contains("model.layers."),
        "{e}"
    );
}

/// Bitwise mode under block-format recipes: the rollout multiplies the trainer's stored
/// bytes (sent as the wire export after every step and checked byte for byte), and its
/// re-scoring is the trainer's forward, so the mismatch and every layer's probe difference
/// are exactly 0.
#[test]
fn engine_rl_loop_under_block_formats_is_bitwise() {
    rl_loop_is_bitwise(&warmed(3), &["mxfp8", "nvfp4-dq"], cfg(2, true));
}

/// [`engine_rl_loop_under_block_formats_is_bitwise`] under `fp8-block` (a 128-wide model).
#[test]
fn engine_rl_loop_under_fp8_block_is_bitwise() {
    // The wider model moves further per step: a smaller learning rate keeps the rewards of
    // the second step's groups varied (a non-zero policy gradient).
    let mut c = cfg(2, true);
    c.adam.lr = 1e-3;
    rl_loop_is_bitwise(&warm(fp8_model(3), 3), &["fp8-block"], c);
}

fn rl_loop_is_bitwise(model: &mxrl_model::Model, recipes: &[&str], cfg: RlConfig) {
    for &recipe in recipes {
        let d = tempfile::tempdir().unwrap();
        let ms = run_engine(model, recipe, cfg.clone(), d.path());
        assert_eq!(ms.len(), 2);
        for m in &ms {
            assert!(m.loss.is_finite() && m.grad_norm > 0.0, "{recipe}: {m:?}");
            assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{recipe}: {m:?}");
            assert_eq!(m.hidden_diff.len(), model.config().num_layers, "{m:?}");
            assert!(m.hidden_diff.iter().all(|&d| d == 0.0), "{recipe}: {m:?}");
            // Stored bytes travel: fewer than the BF16 bytes of every parameter.
            assert!(
                m.sync_bytes > 0 && m.sync_bytes < 2 * model.params().num_elements() as u64,
                "{recipe}: {m:?}"
            );
        }
    }
}

/// Routing replay on the engine. The rollout records the routes of every fed position while
/// it generates (prefill and KV-cache decode); on the CPU backend they are, position by
/// position, the experts the host model picks over the same tokens in one forward (weights
/// equal up to summation order). The
/// engine trainer replaying those routes gives bit for bit the model trainer's logprobs and
/// gradient step under the same replay.
#[test]
fn captured_routes_are_the_models_and_replay_matches_the_model_trainer() {
    use mxrl_model::{ForwardOptions, SeqInput};
    let model = warmed(8);
    let mut bd = engine_build(&model, "bf16").unwrap();
    let codec = TextCodec::char_level();
    let prompts: Vec<Vec<u32>> = batch_of(&codec, 3).into_iter().map(|(p, _)| p).collect();
    let samples = bd
        .rollout
        .generate(
            &prompts,
            2,
            &SamplingConfig {
                temperature: 1.0,
                top_p: 1.0,
                max_new_tokens: 4,
            },
            codec.eos,
            5,
        )
        .unwrap();
    let cfg = model.config();
    let moe_layers = (0..cfg.num_layers).filter(|&l| cfg.is_moe_layer(l)).count();
    // The model as the BF16 recipe runs it (the values the engine computes with).
    let mut mt = build(&model, "bf16").unwrap().trainer;
    for s in &samples {
        let r = s
            .routing
            .as_ref()
            .expect("the engine rollout records routes");
        let mut full = s.prompt.clone();
        full.extend_from_slice(&s.response);
        let fed = &full[..full.len() - 1];
        assert_eq!(r.num_tokens(), fed.len());
        assert_eq!(
            (r.layers.len(), r.top_k()),
            (moe_layers, cfg.num_experts_per_tok)
        );
        let k = r.top_k();
        let out = mt
            .model()
            .forward(
                &[SeqInput {
                    tokens: fed,
                    targets: &full[1..],
                }],
                &ForwardOptions {
                    temperature: 1.0,
                    return_logits: false,
                    train: false,
                    replay: None,
                },
            )
            .unwrap();
        let want = &out.routing[0];
        assert_eq!(want.layers.len(), moe_layers);
        for (li, (got, l)) in r.layers.iter().zip(&want.layers).enumerate() {
            for p in 0..fed.len() {
                let b = p * k;
                assert_eq!(
                    &got.ids[b..b + k],
                    &l.ids[p * k..(p + 1) * k],
                    "layer {li} position {p}"
                );
                // The prompt's positions come from the prefill (the forward's operations in
                // another summation order: a few f32 roundings of the router softmax apart);
                // the later ones from decode steps, whose attention reads the BF16 KV cache
                // (keys and values rounded to 8 bits of mantissa: ~2⁻⁸ relative).
                let tol = if p < s.prompt.len() {
                    64.0 * f32::EPSILON
                } else {
                    2f32.powi(-6)
                };
                for (x, y) in got.weights[b..b + k]
                    .iter()
                    .zip(&l.weights[p * k..(p + 1) * k])
                {
                    assert!(
                        (x - y).abs() <= tol * y.abs(),
                        "layer {li} position {p}: {x} vs {y}"
                    );
                }
            }
        }
    }
    // Replay: the engine trainer and the model trainer on the same traces.
    let seqs: Vec<TrainSeq<'_>> = samples
        .iter()
        .map(|s| TrainSeq {
            prompt: &s.prompt,
            response: &s.response,
            replay: s.routing.as_ref(),
        })
        .collect();
    let fe = bd.trainer.forward(&seqs, 1.0).unwrap();
    let fm = mt.forward(&seqs, 1.0).unwrap();
    let le: Vec<Vec<f32>> = fe.iter().map(|f| f.logprobs.clone()).collect();
    let lm: Vec<Vec<f32>> = fm.iter().map(|f| f.logprobs.clone()).collect();
    assert_eq!(bits(&le), bits(&lm));
    let d: Vec<Vec<f32>> = fe.iter().map(|f| vec![-0.1; f.logprobs.len()]).collect();
    bd.trainer.zero_grad();
    mt.zero_grad();
    bd.trainer.backward(&d).unwrap();
    mt.backward(&d).unwrap();
    let c = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let (mut oe, mut om) = (AdamW::new(c), AdamW::new(c));
    let ne = optimizer_step(&mut bd.trainer, &mut oe).unwrap();
    let nm = optimizer_step(&mut mt, &mut om).unwrap();
    assert_eq!(ne.to_bits(), nm.to_bits(), "gradient norms {ne} vs {nm}");
}

/// The `fp8-block` weight update round-trips: after an optimizer step the trainer exports
/// one stored tensor per routed expert (`….experts.{e}.gate_up_proj.weight`) and per
/// attention linear, with E4M3 codes and the f32 128×128 `scale_inv` grid as little-endian
/// bytes; a rollout made from the *original* weights loads them, then holds exactly those
/// bytes and scores exactly the trainer's logprobs.
#[test]
fn fp8_block_weight_update_round_trips_through_the_wire_form() {
    use mxrl_formats::{Format, Scales};
    use mxrl_model::engine::Engine;
    let codec = TextCodec::char_level();
    let model = fp8_model(7);
    let b = batch_of(&codec, 4);
    let mut bd = engine_build(&model, "fp8-block").unwrap();
    let mut opt = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    });
    sft_step(&mut bd.trainer, &mut opt, &b);
    let wire = bd.trainer.export_weights().unwrap();
    let stored: Vec<_> = wire.iter().filter(|t| t.format != Format::Bf16).collect();
    assert!(stored.iter().all(|t| t.format == Format::Fp8Block));
    let names: Vec<&str> = stored.iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"model.layers.0.mlp.experts.3.gate_up_proj.weight"));
    assert!(names.contains(&"model.layers.2.self_attn.o_proj.weight"));
    assert!(!names.iter().any(|n| n.contains(".layers.3.")), "{names:?}");
    let gate_up = stored
        .iter()
        .find(|t| t.name == "model.layers.1.mlp.experts.2.gate_up_proj.weight")
        .unwrap();
    // [2F, H] = [256, 128]: 2 × 1 tiles of f32 scales.
    assert_eq!(gate_up.shape, [256, 128]);
    assert_eq!(
        (gate_up.data.len(), gate_up.scales.len()),
        (256 * 128, 2 * 4)
    );
    // A rollout still on the original weights takes the update.
    let mut fresh = engine_build(&model, "fp8-block").unwrap().rollout;
    fresh.load_weights(&wire).unwrap();
    let e = fresh.engine();
    let mut checked = 0;
    for param in e.param_names() {
        let Some((spec, groups, _, _)) = e.stored_layout(param).unwrap() else {
            continue;
        };
        assert_eq!(spec.format(), Format::Fp8Block);
        for (g, held) in e.stored_weights(param).unwrap().unwrap().iter().enumerate() {
            let name = Engine::<CpuBackend>::stored_name(param, g, groups);
            let t = stored.iter().find(|t| t.name == name).unwrap();
            let Scales::F32(s) = &held.scales else {
                panic!("{name}: FP8-block scales are f32")
            };
            let sb: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert!(
                held.data == t.data && sb == t.scales,
                "{name}: held bytes differ from the update"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, stored.len());
    let ours = bd.trainer.forward(&seqs(&b), 1.0).unwrap();
    let theirs = fresh.score(&seqs(&b), 1.0).unwrap();
    let lt: Vec<Vec<f32>> = ours.into_iter().map(|f| f.logprobs).collect();
    assert_eq!(bits(&lt), bits(&theirs));
}

/// Bound on the relative distance between the residual stream of KV-cache decode and of the
/// training forward over the same tokens (the `hidden_diff` metric), when the cache is the
/// only difference: it holds keys and values rounded to BF16 (relative error ≤ u = 2⁻⁹ each),
/// which perturbs a layer's attention output by at most about 2u relative (u through the
/// values, u through the scores' softmax), and the perturbations of `layers` layers add up.
fn kv_rounding_bound(layers: usize) -> f64 {
    layers as f64 * 2.0 * 2f64.powi(-9)
}

/// The engine rollout records per-layer probes only when asked ([`RolloutPolicy::set_probes`])
/// and routes only when asked ([`RolloutPolicy::set_routes`], on by default); neither changes
/// what is sampled. The probes are `[layer][response position][hidden]`, within the BF16
/// KV-cache rounding ([`kv_rounding_bound`]) of the trainer's probes over the same tokens
/// (the prefill's differ from the forward's only in f32 summation order; that they are
/// bitwise the residual stream of generation is `mxrl-model`'s
/// `generation_probes_are_the_residual_stream_after_every_layer`). A probe of another
/// position or layer is O(1) away.
#[test]
fn engine_rollout_records_probes_and_routes_only_when_asked() {
    let model = warmed(6);
    let mut bd = engine_build(&model, "bf16").unwrap();
    let codec = TextCodec::char_level();
    let prompts: Vec<Vec<u32>> = batch_of(&codec, 3).into_iter().map(|(p, _)| p).collect();
    let sc = SamplingConfig {
        temperature: 1.0,
        top_p: 1.0,
        max_new_tokens: 4,
    };
    let plain = bd.rollout.generate(&prompts, 2, &sc, codec.eos, 5).unwrap();
    assert!(plain
        .iter()
        .all(|s| s.probes.is_none() && s.routing.is_some()));
    bd.rollout.set_probes(usize::MAX);
    bd.rollout.set_routes(false);
    let probed = bd.rollout.generate(&prompts, 2, &sc, codec.eos, 5).unwrap();
    let c = model.config();
    let (layers, h) = (c.num_layers, c.hidden_size);
    for (a, b) in plain.iter().zip(&probed) {
        assert_eq!((&a.response, &a.logprobs), (&b.response, &b.logprobs));
        assert!(b.routing.is_none());
        let p = b.probes.as_ref().unwrap();
        assert_eq!((p.layers, p.width), (layers, h));
        assert_eq!(p.values.len(), layers * b.response.len() * h);
    }
    // The trainer's probes of the same sequences (no replay).
    let seqs: Vec<TrainSeq<'_>> = probed
        .iter()
        .map(|s| TrainSeq {
            prompt: &s.prompt,
            response: &s.response,
            replay: None,
        })
        .collect();
    bd.trainer.set_probes(true);
    let fw = bd.trainer.forward(&seqs, 1.0).unwrap();
    let bound = kv_rounding_bound(layers);
    for (s, f) in probed.iter().zip(&fw) {
        let (a, b) = (s.probes.as_ref().unwrap(), f.probes.as_ref().unwrap());
        assert_eq!(a.values.len(), b.values.len());
        let r = s.response.len();
        for l in 0..layers {
            for t in 0..r {
                let at = (l * r + t) * h;
                let (x, y) = (&a.values[at..at + h], &b.values[at..at + h]);
                let d: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                let n: f64 = y.iter().map(|&q| (q as f64).powi(2)).sum();
                let rel = (d / n).sqrt();
                assert!(rel <= bound, "layer {l} position {t}: {rel:e} > {bound:e}");
            }
        }
    }
}

/// `probes: false` turns the `hidden_diff` metric off on the engine (nothing recorded).
#[test]
fn engine_rl_loop_without_probes_reports_no_hidden_diff() {
    let model = warmed(3);
    let d = tempfile::tempdir().unwrap();
    let ms = run_engine(
        &model,
        "bf16",
        RlConfig {
            probes: false,
            ..cfg(1, false)
        },
        d.path(),
    );
    assert!(ms.iter().all(|m| m.hidden_diff.is_empty()), "{ms:?}");
}

/// The MoE auxiliary loss through both trainers: with a coefficient, the engine trainer (CPU
/// backend) and the model trainer report the same loss bits after every backward and keep the
/// same logprobs step after step (the loss reaches their gradients alike); without one,
/// neither reports a loss. Through the RL loop, every step's metrics carry it only when the
/// run adds it.
#[test]
fn both_trainers_report_the_same_aux_loss_and_the_loop_records_it() {
    let model = demo_model(5).unwrap().0;
    let codec = TextCodec::char_level();
    let b = batch_of(&codec, 6);
    let mut mt = build(&model, "bf16").unwrap().trainer;
    let mut et = engine_build(&model, "bf16").unwrap().trainer;
    let c = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let (mut om, mut oe) = (AdamW::new(c), AdamW::new(c));
    sft_step(&mut mt, &mut om, &b);
    sft_step(&mut et, &mut oe, &b);
    assert_eq!(mt.last_aux_loss().unwrap(), None);
    assert_eq!(et.last_aux_loss().unwrap(), None);
    mt.set_aux_loss_coef(0.5).unwrap();
    et.set_aux_loss_coef(0.5).unwrap();
    let mut seen = Vec::new();
    for step in 0..3 {
        let lm = sft_step(&mut mt, &mut om, &b);
        let le = sft_step(&mut et, &mut oe, &b);
        assert_eq!(bits(&lm), bits(&le), "step {step}");
        let (am, ae) = (mt.last_aux_loss().unwrap(), et.last_aux_loss().unwrap());
        let am = am.expect("the model trainer's aux loss");
        assert!(am.is_finite() && am > 0.0, "{am}");
        assert_eq!(Some(am.to_bits()), ae.map(f64::to_bits), "step {step}");
        seen.push(am);
    }
    // Each step's loss is of that step's forward, not a value kept from the first.
    assert!(seen[0] != seen[2], "{seen:?}");
    let d = tempfile::tempdir().unwrap();
    let with = RlConfig {
        aux_loss_coef: 0.01,
        ..cfg(2, false)
    };
    for m in run_engine(&model, "bf16", with, &d.path().join("aux")) {
        let a = m.aux_loss.expect("a step of a run with the aux loss");
        assert!(a.is_finite() && a > 0.0, "step {}: {a}", m.step);
    }
    for m in run_engine(&model, "bf16", cfg(2, false), &d.path().join("plain")) {
        assert_eq!(m.aux_loss, None, "step {}", m.step);
    }
}
