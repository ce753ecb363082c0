//! The RL loop on the tiny MoE of `mxrl-model` under every recipe of the ablation.

use mxrl_rl::optim::AdamWConfig;
use mxrl_rl::runner::{sft, RlConfig, RlRun, SftConfig};
use mxrl_rl::session::{build, demo_model};
use mxrl_rl::task::{ArithmeticTask, TaskSource};
use mxrl_rl::text::TextCodec;
use mxrl_rl::SamplingConfig;

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
/// the exact mean of |Δ| over all response tokens, so 0.0 means every token matched).
/// Without it, decode (KV cache, few-row kernels) and the training forward differ in f32
/// summation order, which the mismatch metric sees.
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
            for m in &ms {
                if bitwise {
                    assert_eq!(m.train_rollout_logprob_abs_diff, 0.0, "{r}: {m:?}");
                    assert_eq!(m.k3_kl, 0.0, "{r}");
                } else {
                    assert!(m.train_rollout_logprob_abs_diff < 1e-2, "{r}: {m:?}");
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
