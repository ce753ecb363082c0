//! The RL loop on the tiny MoE of `mxrl-model` under every recipe of the ablation: trainer
//! and rollout run the model under the recipe's precision plan (quantized activations and
//! weights, the plan's backward modes) and the rollout multiplies exactly the trainer's bytes.
//!
//! Recipes covered: all six (`bf16`, `mxfp8`, `mxfp8-hp`, `mxfp8-dq`, `nvfp4-hp`, `nvfp4-dq`)
//! in the bitwise-mode, weight-sync and backward-mode tests; `bf16`, `mxfp8` and `nvfp4-hp`
//! (one per format, the `lowp` and `high_precision` backward modes) in the reward-rise test,
//! which is the slow one (about 10 s of CPU per recipe).

use mxrl_formats::{Format, Padding, TensorRef};
use mxrl_model::{LinearPrecision, Model};
use mxrl_rl::moe::{MoeRollout, MoeTrainer};
use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{sft, RlConfig, RlRun, SftConfig};
use mxrl_rl::session::{build, demo_model};
use mxrl_rl::sync::check_equal;
use mxrl_rl::task::{ArithmeticTask, TaskSource};
use mxrl_rl::text::TextCodec;
use mxrl_rl::wire::{from_quantized, wire_scheme};
use mxrl_rl::{RolloutPolicy, SamplingConfig, TrainPolicy, TrainSeq};

const RECIPES: [&str; 6] = [
    "bf16", "mxfp8", "mxfp8-hp", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq",
];

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
        check_weight_sync: true,
        checkpoint_every: 100,
        ..RlConfig::default()
    }
}

/// Bitwise mode: with the rollout re-scoring through the trainer's forward and micro-batch
/// shapes, rollout and trainer logprobs are bit-identical under every recipe (the metric is
/// the exact mean of |Δ| over all response tokens, so 0.0 means every token matched), and so
/// are the per-layer residual-stream probes (`hidden_diff` 0 in every layer).
/// Without it, decode (KV cache, few-row kernels) and the training forward differ in f32
/// summation order, which the mismatch and per-layer hidden-state metrics see.
#[test]
fn bitwise_mode_makes_rollout_and_trainer_logprobs_identical_for_every_recipe() {
    let codec = TextCodec::char_level();
    let (model, _) = demo_model(3).unwrap();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    for r in RECIPES {
        for bitwise in [true, false] {
            let b = build(&model, r).unwrap();
            let d = tempfile::tempdir().unwrap();
            let mut run = RlRun::new(
                cfg(2, bitwise),
                b.trainer,
                b.rollout,
                None,
                task.clone(),
                &codec,
                d.path(),
                &b.contract_hash,
            )
            .unwrap();
            let mut ms = Vec::new();
            run.run(&mut |m| ms.push(m.clone())).unwrap();
            let layers = model.config().num_layers;
            for m in &ms {
                assert_eq!(m.hidden_diff.len(), layers, "{r}: {m:?}");
                if bitwise {
                    assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{r}: {m:?}");
                    assert_eq!(m.k3_kl, 0.0, "{r}");
                    assert!(m.hidden_diff.iter().all(|&d| d == 0.0), "{r}: {m:?}");
                } else {
                    assert!(m.train_rollout_logprob_abs_diff < 1e-2, "{r}: {m:?}");
                    assert!(m.hidden_diff.iter().all(|d| d.is_finite()), "{r}");
                    if r != "bf16" {
                        // Decode and the training forward sum in different orders; the
                        // quantizers turn such differences into visible hidden-state drift.
                        assert!(m.hidden_diff.iter().any(|&d| d > 0.0), "{r}: {m:?}");
                    }
                }
                assert!(m.tokens > 0 && m.grad_norm.is_finite());
                assert!(
                    !m.routing_agreement.is_empty(),
                    "{r}: no routing agreement metric"
                );
            }
        }
    }
}

/// A short CPU run of the exact tabular policy with its table stored in each recipe's weight
/// format (BF16, MXFP8, NVFP4): SFT warm-up, then GRPO; reward rises in every format.
#[test]
fn reward_rises_in_every_storage_format() {
    use mxrl_formats::Format;
    use mxrl_rl::tabular::{TabularShape, TabularTrainer};
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    for f in [Format::Bf16, Format::Mxfp8, Format::Nvfp4] {
        let mut tr = TabularTrainer::new(
            TabularShape {
                buckets: 512,
                max_len: 3,
                vocab: codec.vocab_size,
            },
            f,
        );
        sft(
            &mut tr,
            &task,
            &codec,
            &SftConfig {
                steps: 4,
                batch: 64,
                seed: 99,
                adam: AdamWConfig {
                    lr: 1.0,
                    ..AdamWConfig::default()
                },
                aux_loss_coef: 0.0,
            },
            &mut |_, _| {},
        )
        .unwrap();
        let d = tempfile::tempdir().unwrap();
        let mut c = cfg(30, false);
        c.prompts_per_step = 16;
        c.samples = 8;
        c.micro_batch = 32;
        c.adam.lr = 0.3;
        let ro = tr.rollout().unwrap();
        let mut run = RlRun::new(c, tr, ro, None, task.clone(), &codec, d.path(), "h").unwrap();
        let mut rw = Vec::new();
        run.run(&mut |m| rw.push(m.reward_mean)).unwrap();
        let first = rw[..5].iter().sum::<f64>() / 5.0;
        let last = rw[25..].iter().sum::<f64>() / 5.0;
        assert!(last > first + 0.1, "{f}: reward did not rise: {rw:?}");
    }
}

/// A short RL run of `recipe` from the demo model; returns the run (trainer and rollout after
/// `steps` weight updates).
fn short_run<'a>(
    recipe: &str,
    steps: u64,
    codec: &'a TextCodec,
    dir: &std::path::Path,
) -> RlRun<'a, MoeTrainer, MoeRollout> {
    let (model, _) = demo_model(5).unwrap();
    let b = build(&model, recipe).unwrap();
    let mut run = RlRun::new(
        cfg(steps, false),
        b.trainer,
        b.rollout,
        None,
        TaskSource::Arithmetic(ArithmeticTask::default()),
        codec,
        dir,
        &b.contract_hash,
    )
    .unwrap();
    run.run(&mut |_| {}).unwrap();
    run
}

/// After live updates, the rollout holds and multiplies exactly the trainer's bytes, and those
/// are the bytes the converter's quantizer makes from the trainer's f32 masters:
/// - export == rollout's held weights, byte for byte (what `--check-weight-sync` checks);
/// - every quantized linear of the rollout runs its stored bytes as sent
///   (`runs_stored_bytes`), equal to the trainer's own prepared bytes;
/// - each exported quantized tensor equals `mxrl_formats::quantize(master)` with the plan's
///   wire scheme, and for NVFP4 a fused gate_up equals the converter's gate and up quantized
///   with one shared amax (`quantize_nvfp4_stacked`); BF16 tensors are `bf16(master)`.
#[test]
fn rollout_runs_exactly_the_trainers_bytes_and_they_are_the_converters_bytes() {
    let codec = TextCodec::char_level();
    for r in RECIPES {
        let d = tempfile::tempdir().unwrap();
        let mut run = short_run(r, 2, &codec, d.path());
        assert_eq!(run.rollout.version, 3, "{r}");
        run.trainer.refresh_weights().unwrap();
        let ex = run.trainer.export_weights().unwrap();
        check_equal(&run.rollout.policy.weights(), &ex).unwrap();
        let master = run.trainer.master_model().unwrap();
        let (tm, rm) = (run.trainer.model(), run.rollout.policy.model());
        let mut quantized = 0;
        for ((w, p), f) in ex
            .iter()
            .zip(master.params().iter())
            .zip(run.trainer.formats())
        {
            assert_eq!((&w.name, w.format), (&p.name, *f), "{r}");
            let Some(scheme) = wire_scheme(*f) else {
                let want: Vec<u8> = p
                    .data
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect();
                assert_eq!(w.data, want, "{r} {}", p.name);
                continue;
            };
            quantized += 1;
            let (n, k) = (p.shape[0], p.shape[1]);
            let q = mxrl_formats::quantize(&p.data, &[n, k], scheme, Padding::Reject).unwrap();
            assert_eq!(*w, from_quantized(&p.name, &q).unwrap(), "{r} {}", p.name);
            let own = tm.prepared_weight(&p.name).unwrap().stored().unwrap();
            let held = rm.prepared_weight(&p.name).unwrap().stored().unwrap();
            assert_eq!(own, &q, "{r} {}", p.name);
            assert_eq!(held, &q, "{r} {}", p.name);
            assert!(rm.runs_stored_bytes(&p.name), "{r} {}", p.name);
            assert!(!tm.runs_stored_bytes(&p.name), "{r} {}", p.name);
            if *f == Format::Nvfp4 && p.name.ends_with("gate_up_proj.weight") {
                let mxrl_formats::Scheme::Nvfp4(s) = scheme else {
                    unreachable!("NVFP4 wire scheme")
                };
                let half = n / 2 * k;
                let shape = [n / 2, k];
                let parts = mxrl_formats::quantize_nvfp4_stacked(
                    &[
                        TensorRef::new(&p.data[..half], &shape),
                        TensorRef::new(&p.data[half..], &shape),
                    ],
                    s,
                    Padding::Reject,
                )
                .unwrap();
                assert_eq!(parts[0].amax, q.amax, "{r} {}", p.name);
                assert_eq!([&parts[0].data[..], &parts[1].data[..]].concat(), q.data);
            }
        }
        if r == "bf16" {
            assert_eq!(quantized, 0);
        } else {
            assert!(quantized > 0, "{r}: no quantized tensor");
        }
    }
}

/// A bad update (another recipe's formats) is refused with the tensor named and changes
/// nothing: the rollout keeps serving its bytes.
#[test]
fn rollout_refuses_an_update_in_other_formats_and_keeps_its_weights() {
    let (model, _) = demo_model(6).unwrap();
    let mut nv = build(&model, "nvfp4-hp").unwrap();
    let mx = build(&model, "mxfp8").unwrap();
    let before = nv.rollout.weights();
    let e = nv
        .rollout
        .load_weights(&mx.trainer.export_weights().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.layers.") && e.contains("mxfp8"), "{e}");
    // Right formats, one corrupt tensor at the end: still nothing changes.
    let other = build(&demo_model(7).unwrap().0, "nvfp4-hp").unwrap();
    let mut ex = other.trainer.export_weights().unwrap();
    let last = ex.iter().rposition(|w| w.format == Format::Nvfp4).unwrap();
    ex[last].scales.pop();
    let e = nv.rollout.load_weights(&ex).unwrap_err().to_string();
    assert!(e.contains(&ex[last].name), "{e}");
    check_equal(&nv.rollout.weights(), &before).unwrap();
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

/// Response logprobs per sequence and gradients per parameter.
type LogprobsGrads = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// Forward logprobs and gradients of one batch (loss `−mean logprob`).
fn logprobs_and_grads(t: &mut MoeTrainer, b: &[(Vec<u32>, Vec<u32>)]) -> LogprobsGrads {
    let seqs: Vec<TrainSeq<'_>> = b
        .iter()
        .map(|(p, r)| TrainSeq {
            prompt: p,
            response: r,
            replay: None,
        })
        .collect();
    t.zero_grad();
    let fw = t.forward(&seqs, 1.0).unwrap();
    let n: usize = fw.iter().map(|f| f.logprobs.len()).sum();
    let d: Vec<Vec<f32>> = fw
        .iter()
        .map(|f| vec![-1.0 / n as f32; f.logprobs.len()])
        .collect();
    t.backward(&d).unwrap();
    let g = t.params().iter().map(|p| p.grad.to_vec()).collect();
    (fw.into_iter().map(|f| f.logprobs).collect(), g)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// The plan's backward mode reaches RL training: recipes of one format share the forward
/// (bit-identical logprobs) but `lowp`, `high_precision` and `dequantized` give different
/// gradients for the same batch. The difference sits exactly where a quantized linear's
/// backward runs: the gradients of `lm_head` and of the BF16 last layer (no quantized backward
/// GEMM above them) are bit-identical across modes, those of the quantized layers below differ.
#[test]
fn backward_modes_change_gradients_but_not_the_forward() {
    let codec = TextCodec::char_level();
    let (model, _) = demo_model(8).unwrap();
    let b = batch_of(&codec, 6);
    for family in [
        &["mxfp8", "mxfp8-hp", "mxfp8-dq"][..],
        &["nvfp4-hp", "nvfp4-dq"],
    ] {
        let runs: Vec<LogprobsGrads> = family
            .iter()
            .map(|r| logprobs_and_grads(&mut build(&model, r).unwrap().trainer, &b))
            .collect();
        let t = build(&model, family[0]).unwrap().trainer;
        let names: Vec<&str> = t.model().params().iter().map(|p| p.name.as_str()).collect();
        let last = model.config().num_layers - 1;
        let last_prefix = format!("model.layers.{last}.");
        for (i, a) in runs.iter().enumerate() {
            for (j, c) in runs.iter().enumerate().skip(i + 1) {
                let (ri, rj) = (family[i], family[j]);
                assert_eq!(bits(&a.0), bits(&c.0), "{ri} vs {rj}: forward differs");
                let mut differ = 0;
                for (k, name) in names.iter().enumerate() {
                    assert!(a.1[k].iter().chain(&c.1[k]).all(|g| g.is_finite()));
                    let same = bits(&a.1[k..k + 1]) == bits(&c.1[k..k + 1]);
                    let above = *name == "lm_head.weight"
                        || *name == "model.norm.weight"
                        || name.starts_with(&last_prefix);
                    if above {
                        assert!(
                            same,
                            "{ri} vs {rj}: {name} has no quantized backward above it"
                        );
                    } else if !same {
                        differ += 1;
                    }
                }
                let q_proj = "model.layers.0.self_attn.q_proj.weight";
                let k = names.iter().position(|n| *n == q_proj).unwrap();
                assert_ne!(
                    bits(&a.1[k..k + 1]),
                    bits(&c.1[k..k + 1]),
                    "{ri} vs {rj}: {q_proj}"
                );
                assert!(differ > 0);
            }
        }
    }
    // The last layer really is BF16 in these plans (otherwise the check above proves nothing).
    let t = build(&model, "nvfp4-hp").unwrap().trainer;
    let last = model.config().num_layers - 1;
    for (name, p) in t.model().linear_precisions() {
        if name.starts_with(&format!("model.layers.{last}.")) {
            assert_eq!(p, LinearPrecision::Bf16, "{name}");
        }
    }
}

/// Activations are quantized in RL: the trainer's logprobs under `mxfp8` / `nvfp4-hp` differ
/// from those of a model that multiplies the same dequantized weights with unquantized f32
/// activations (the old weight-only emulation).
#[test]
fn activations_are_quantized_not_only_weights() {
    let codec = TextCodec::char_level();
    let (model, _) = demo_model(9).unwrap();
    let b = batch_of(&codec, 4);
    for r in ["mxfp8", "nvfp4-hp"] {
        let mut t = build(&model, r).unwrap().trainer;
        let (lp, _) = logprobs_and_grads(&mut t, &b);
        t.refresh_weights().unwrap();
        // Weight-only: every linear F32 on the values the quantized model computes with (the
        // model keeps f32 masters; a tensor the plan stores BF16 runs at its BF16 value).
        let held: Vec<Vec<f32>> = t
            .model()
            .params()
            .iter()
            .map(|p| match t.model().prepared_weight(&p.name) {
                Some(pw) => pw.stored().unwrap().dequantize().unwrap(),
                None => t
                    .model()
                    .param_bf16(&p.name)
                    .unwrap()
                    .into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect(),
            })
            .collect();
        let mut w: Model = t.model().clone();
        w.set_precision_by(|_, _| LinearPrecision::F32).unwrap();
        {
            let mut ps = w.params_mut();
            let names: Vec<String> = ps.iter().map(|p| p.name.clone()).collect();
            for (n, v) in names.iter().zip(&held) {
                ps.set(n, v).unwrap();
            }
        }
        let full: Vec<(Vec<u32>, Vec<u32>)> = b
            .iter()
            .map(|(p, r)| {
                let mut s = p.clone();
                s.extend_from_slice(r);
                (s[..s.len() - 1].to_vec(), s[1..].to_vec())
            })
            .collect();
        let inputs: Vec<mxrl_model::SeqInput<'_>> = full
            .iter()
            .map(|(x, y)| mxrl_model::SeqInput {
                tokens: x,
                targets: y,
            })
            .collect();
        let out = w
            .forward(&inputs, &mxrl_model::ForwardOptions::default())
            .unwrap();
        let weight_only: Vec<Vec<f32>> = out
            .logprobs
            .iter()
            .zip(&b)
            .map(|(l, (_, resp))| l[l.len() - resp.len()..].to_vec())
            .collect();
        let max_diff = lp
            .iter()
            .flatten()
            .zip(weight_only.iter().flatten())
            .map(|(a, c)| (a - c).abs())
            .fold(0.0f32, f32::max);
        assert!(max_diff > 0.0, "{r}: activations were not quantized");
    }
}

/// Mean and standard error of the mean of per-step rewards.
fn mean_se(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

/// Reward rises on the MoE itself: the demo MoE warmed up by SFT (BF16, as `mxrl demo`),
/// then 40 GRPO steps of 32 prompts × 8 samples (lr 1e-3, fixed seeds) per recipe; `bf16`,
/// `mxfp8` (lowp backward) and `nvfp4-hp` (the six-recipe version of this test takes about a
/// minute more; the other tests here cover all six).
///
/// Statistics: each step's mean reward is over 256 samples of 32 fresh prompts. The first and
/// last 8 steps form two windows; the rise `mean(last) − mean(first)` must exceed 3 standard
/// errors of that difference (estimated from the step-to-step spread inside the windows, which
/// also absorbs any trend, so it is conservative) and 0.05 in absolute reward.
#[test]
fn reward_rises_on_the_moe_for_bf16_and_low_precision_recipes() {
    let codec = TextCodec::char_level();
    let task = TaskSource::Arithmetic(ArithmeticTask::default());
    let (model, _) = demo_model(7).unwrap();
    let mut t = build(&model, "bf16").unwrap().trainer;
    sft(
        &mut t,
        &task,
        &codec,
        &SftConfig {
            steps: 50,
            batch: 64,
            seed: 7 ^ 0x5f7,
            adam: AdamWConfig {
                lr: 3e-3,
                ..AdamWConfig::default()
            },
            aux_loss_coef: 0.0,
        },
        &mut |_, _| {},
    )
    .unwrap();
    let base = t.master_model().unwrap();
    for r in ["bf16", "mxfp8", "nvfp4-hp"] {
        let b = build(&base, r).unwrap();
        let d = tempfile::tempdir().unwrap();
        let c = RlConfig {
            steps: 40,
            prompts_per_step: 32,
            samples: 8,
            sampling: SamplingConfig {
                temperature: 1.0,
                top_p: 1.0,
                max_new_tokens: 4,
            },
            micro_batch: 32,
            adam: AdamWConfig {
                lr: 1e-3,
                ..AdamWConfig::default()
            },
            checkpoint_every: 1000,
            ..RlConfig::default()
        };
        let mut run = RlRun::new(
            c,
            b.trainer,
            b.rollout,
            None,
            task.clone(),
            &codec,
            d.path(),
            &b.contract_hash,
        )
        .unwrap();
        let mut rw = Vec::new();
        run.run(&mut |m| rw.push(m.reward_mean)).unwrap();
        let (m0, s0) = mean_se(&rw[..8]);
        let (m1, s1) = mean_se(&rw[32..]);
        let se = (s0 * s0 + s1 * s1).sqrt();
        assert!(
            m1 - m0 > 3.0 * se && m1 - m0 > 0.05,
            "{r}: reward did not rise: first {m0:.3}±{s0:.3}, last {m1:.3}±{s1:.3}, all {rw:?}"
        );
        eprintln!("{r}: reward {m0:.3}±{s0:.3} → {m1:.3}±{s1:.3}");
    }
}

/// Probe layout: `[layer][j][width]` where row `j` is the residual stream at position
/// `prompt_len − 1 + j` (the position whose logits predict `response[j]`), as the model's own
/// capture of the same batch has it; the rollout's generation probes have the same shape.
#[test]
fn probes_are_the_residual_stream_at_the_response_predicting_positions() {
    let codec = TextCodec::char_level();
    let (model, _) = demo_model(10).unwrap();
    let mut b = build(&model, "nvfp4-hp").unwrap();
    let batch = batch_of(&codec, 3);
    let seqs: Vec<TrainSeq<'_>> = batch
        .iter()
        .map(|(p, r)| TrainSeq {
            prompt: p,
            response: r,
            replay: None,
        })
        .collect();
    let fw = b.trainer.forward(&seqs, 1.0).unwrap();
    let h = model.config().hidden_size;
    // The same batch through the model's capturing forward (same shapes, so same kernels).
    let full: Vec<Vec<u32>> = batch
        .iter()
        .map(|(p, r)| [&p[..], &r[..]].concat())
        .collect();
    let inputs: Vec<mxrl_model::SeqInput<'_>> = full
        .iter()
        .map(|s| mxrl_model::SeqInput::next_token(s))
        .collect();
    let out = b
        .trainer
        .model()
        .forward_capturing(&inputs, &mxrl_model::ForwardOptions::default())
        .unwrap();
    let hidden = out.hidden.unwrap();
    for (((p, r), f), hs) in batch.iter().zip(&fw).zip(&hidden) {
        let pr = f.probes.as_ref().unwrap();
        assert_eq!((pr.layers, pr.width), (model.config().num_layers, h));
        let want: Vec<f32> = hs
            .layers
            .iter()
            .flat_map(|l| {
                l[(p.len() - 1) * h..(p.len() - 1 + r.len()) * h]
                    .iter()
                    .copied()
            })
            .collect();
        assert_eq!(pr.values, want);
    }
    let prompts: Vec<Vec<u32>> = batch.iter().map(|(p, _)| p.clone()).collect();
    let samples = b
        .rollout
        .generate(&prompts, 2, &SamplingConfig::default(), codec.eos, 3)
        .unwrap();
    for s in &samples {
        let pr = s.probes.as_ref().unwrap();
        assert_eq!(pr.values.len(), pr.layers * s.response.len() * h);
    }
}
