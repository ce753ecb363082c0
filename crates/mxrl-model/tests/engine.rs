//! The device engine (one model definition over a backend's op set) on the CPU backend against
//! the CPU model with every linear at `LinearPrecision::Bf16`: the same functions in the same
//! order, so the results are bitwise equal.

use mxrl_formats::Format;
use mxrl_model::engine::{cpu_engine, Engine};
use mxrl_model::{Arch, ForwardOptions, LinearPrecision, Model, ModelConfig, SeqInput, TensorRole};
use mxrl_tensor::device::CpuBackend;
use mxrl_tensor::gradcheck::test_values;
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
use mxrl_tensor::sample::{sample_rows, SampleParams};

mod common;
use common::small;

fn bf16_model(c: &ModelConfig, seed: u64) -> Model {
    let mut m = Model::random(c, seed).unwrap();
    {
        let mut ps = m.params_mut();
        for (i, p) in ps.iter_mut().enumerate() {
            if p.name.ends_with("bias") || p.name.contains("norm") {
                let r = test_values(p.data.len(), 500 + i as u64, 0.3);
                for (x, d) in p.data.iter_mut().zip(r) {
                    *x += d;
                }
            }
        }
    }
    m.set_precision_by(|_, _| LinearPrecision::Bf16).unwrap();
    m
}

/// The routed experts' weights of `m` (values).
fn expert_values(m: &Model) -> usize {
    m.params()
        .iter()
        .filter(|p| p.name.contains(".experts."))
        .map(|p| p.data.len())
        .sum()
}

/// Each sequence scored on its own tokens (targets = tokens).
fn scored(s: &[Vec<u32>]) -> Vec<SeqInput<'_>> {
    s.iter()
        .map(|q| SeqInput {
            tokens: q,
            targets: q,
        })
        .collect()
}

fn seqs() -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 9, 2, 14, 3, 33, 21, 8],
        vec![7, 0],
        vec![4, 4, 11, 39, 25],
        vec![12],
    ]
}

fn logprobs_bitwise(arch: Arch) {
    let c = small(arch);
    let m = bf16_model(&c, 7);
    let e = cpu_engine(&m, 64).unwrap();
    let s = seqs();
    let batch = scored(&s);
    for temperature in [1.0f32, 0.7] {
        let want = m
            .forward(
                &batch,
                &ForwardOptions {
                    temperature,
                    ..Default::default()
                },
            )
            .unwrap()
            .logprobs;
        let got = e.logprobs(&batch, temperature).unwrap();
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
            let wb: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
            assert_eq!(
                gb, wb,
                "{arch:?} τ={temperature} sequence {b}: {g:?} vs {w:?}"
            );
        }
    }
}

#[test]
fn engine_logprobs_equal_the_cpu_model_bitwise_qwen3() {
    logprobs_bitwise(Arch::Qwen3Moe);
}

#[test]
fn engine_logprobs_equal_the_cpu_model_bitwise_qwen2_without_shared_expert() {
    logprobs_bitwise(Arch::Qwen2Moe);
}

#[test]
fn engine_prefill_and_decode_are_deterministic_and_refuse_a_full_cache() {
    let c = small(Arch::Qwen3Moe);
    let m = bf16_model(&c, 9);
    let e = cpu_engine(&m, 64).unwrap();
    let s = seqs();
    let prompts: Vec<&[u32]> = s.iter().map(|q| q.as_slice()).collect();
    let (mut st, logits) = e.prefill(&prompts, 11).unwrap();
    assert_eq!(st.lens(), &[9, 2, 5, 1]);
    assert_eq!(logits.len(), 4 * c.vocab_size);
    assert!(logits.iter().all(|x| x.is_finite()));
    let (_, again) = e.prefill(&prompts, 11).unwrap();
    assert_eq!(
        logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        again.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let step = e.decode_step(&mut st, &[3, 4, 5, 6]).unwrap();
    assert_eq!(st.lens(), &[10, 3, 6, 2]);
    assert!(step.iter().all(|x| x.is_finite()));
    e.decode_step(&mut st, &[1, 1, 1, 1]).unwrap();
    // Sequence 0 now holds 11 tokens = max_len: the next step is refused, naming it.
    let err = e
        .decode_step(&mut st, &[1, 1, 1, 1])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("sequence 0 is full"), "{err}");
    let g1 = e.generate_greedy(&prompts, 4).unwrap();
    let g2 = e.generate_greedy(&prompts, 4).unwrap();
    assert_eq!(g1, g2);
    assert!(g1.iter().all(|g| g.len() == 4));
}

#[test]
fn engine_generate_samples_each_step_with_its_counter_and_stops_per_sequence() {
    let c = small(Arch::Qwen3Moe);
    let m = bf16_model(&c, 4);
    let e = cpu_engine(&m, 64).unwrap();
    let s = seqs();
    let prompts: Vec<&[u32]> = s.iter().map(|q| q.as_slice()).collect();
    let v = c.vocab_size;
    let p = SampleParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 12,
        seed: 21,
        step: 5,
    };
    let new = 6;
    let got = e.generate(&prompts, new, &p, &[]).unwrap();
    // The same by hand: host logits of every step, sampled with step counter p.step + t.
    let longest = prompts.iter().map(|q| q.len()).max().unwrap();
    let (mut st, mut logits) = e.prefill(&prompts, longest + new).unwrap();
    let mut want = vec![(Vec::new(), Vec::new()); prompts.len()];
    for t in 0..new {
        let sp = SampleParams {
            step: p.step + t as u64,
            ..p
        };
        let (ids, lps) = sample_rows(&logits, prompts.len(), v, &sp);
        for (w, (&i, &l)) in want.iter_mut().zip(ids.iter().zip(&lps)) {
            w.0.push(i);
            w.1.push(l.to_bits());
        }
        if t + 1 < new {
            logits = e.decode_step(&mut st, &ids).unwrap();
        }
    }
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.tokens, w.0);
        assert_eq!(
            g.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            w.1
        );
    }
    // A stop token ends its sequence (included), the others go on.
    let stop = got[1].tokens[2];
    let stopped = e.generate(&prompts, new, &p, &[stop]).unwrap();
    for (g, full) in stopped.iter().zip(&got) {
        let end = full
            .tokens
            .iter()
            .position(|&t| t == stop)
            .map_or(new, |i| i + 1);
        assert_eq!(g.tokens, full.tokens[..end]);
    }
    // Greedy generation is the argmax of the same logits.
    let greedy = e.generate_greedy(&prompts, 3).unwrap();
    let (mut st, logits) = e.prefill(&prompts, longest + 3).unwrap();
    let (first, _) = sample_rows(&logits, prompts.len(), v, &SampleParams::greedy());
    for (g, &f) in greedy.iter().zip(&first) {
        assert_eq!(g[0], f);
    }
    let next = e.decode_step(&mut st, &first).unwrap();
    let (second, _) = sample_rows(&next, prompts.len(), v, &SampleParams::greedy());
    for (g, &f) in greedy.iter().zip(&second) {
        assert_eq!(g[1], f);
    }
    // Bad parameters are refused by name.
    let bad = SampleParams {
        temperature: -1.0,
        ..p
    };
    let err = e.generate(&prompts, 2, &bad, &[]).unwrap_err().to_string();
    assert!(err.contains("temperature"), "{err}");
}

/// Block-format routed experts: the engine's quantized experts (stored bytes kept by the
/// backend, activations quantized per forward) give bitwise the CPU model's logprobs with the
/// same experts' precision, for MXFP8 and NVFP4 (per-token activation scaling); so do
/// block-format attention linears, while a block-format router is refused by name.
#[test]
fn engine_block_format_experts_equal_the_cpu_model_bitwise() {
    let mut c = small(Arch::Qwen3Moe);
    c.moe_intermediate_size = 32; // MXFP8 blocks of 32 along K of the down projection
    let s = seqs();
    let batch = scored(&s);
    for format in [Format::Mxfp8, Format::Nvfp4] {
        let spec = LinearSpec::new(format, BackwardMode::HighPrecision).unwrap();
        let mut m = bf16_model(&c, 12);
        let mut e = cpu_engine(&m, 64).unwrap();
        let bf16_lp = e.logprobs(&batch, 1.0).unwrap();
        e.quantize_experts(spec).unwrap();
        m.set_precision_by(|_, role| match role {
            TensorRole::Expert => LinearPrecision::Quantized(spec),
            _ => LinearPrecision::Bf16,
        })
        .unwrap();
        let want = m
            .forward(&batch, &ForwardOptions::default())
            .unwrap()
            .logprobs;
        let got = e.logprobs(&batch, 1.0).unwrap();
        let mut moved = false;
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
            let wb: Vec<u32> = w.iter().map(|x| x.to_bits()).collect();
            assert_eq!(gb, wb, "{format:?} sequence {b}");
            moved |= g != &bf16_lp[b];
        }
        assert!(moved, "{format:?}: quantized experts changed no logprob");
        // The engine of the model as it runs: the model's own prepared expert bytes.
        let (as_run, what) = Engine::from_model_as_run(&m, CpuBackend, 64).unwrap();
        assert!(
            what.contains(&format!("in {format:?} (stored bytes)")),
            "{what}"
        );
        assert_eq!(as_run.logprobs(&batch, 1.0).unwrap(), want);
        // Full logits of one sequence: the model's, bitwise.
        let z = as_run.logits(&s[0]).unwrap();
        let mz = m
            .forward(
                &[SeqInput {
                    tokens: &s[0],
                    targets: &s[0],
                }],
                &ForwardOptions {
                    return_logits: true,
                    ..Default::default()
                },
            )
            .unwrap()
            .logits
            .unwrap()
            .remove(0);
        assert_eq!(z, mz);
        // Decoding runs on the quantized experts too (the KV cache is BF16 here, f32 in the
        // CPU model, so decode is compared with the engine's own prefill, not the model's).
        let prompts: Vec<&[u32]> = s.iter().map(|q| q.as_slice()).collect();
        let g = e.generate_greedy(&prompts, 3).unwrap();
        assert!(g.iter().all(|t| t.len() == 3));
        // Back to BF16 experts: the BF16 logprobs again.
        e.quantize_experts(LinearSpec::bf16()).unwrap();
        assert_eq!(e.logprobs(&batch, 1.0).unwrap(), bf16_lp);
        // Block-format attention linears run too, bitwise the model's.
        m.set_precision_by(|_, role| match role {
            TensorRole::Attention => LinearPrecision::Quantized(spec),
            _ => LinearPrecision::Bf16,
        })
        .unwrap();
        let want = m
            .forward(&batch, &ForwardOptions::default())
            .unwrap()
            .logprobs;
        let (as_run, _) = Engine::from_model_as_run(&m, CpuBackend, 64).unwrap();
        assert_eq!(as_run.logprobs(&batch, 1.0).unwrap(), want);
        assert_ne!(
            want, bf16_lp,
            "{format:?}: quantized attention changed no logprob"
        );
        // A block-format router is refused by name.
        m.set_precision_by(|_, role| match role {
            TensorRole::Router => LinearPrecision::Quantized(spec),
            _ => LinearPrecision::Bf16,
        })
        .unwrap();
        let err = Engine::from_model_as_run(&m, CpuBackend, 64)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("mlp.gate") && err.contains("router"), "{err}");
    }
}

/// A block-format linear keeps the BF16 operand `bf16(master)` only under the
/// `high_precision` backward (the one mode that multiplies it): `lowp` and `dequantized`
/// experts free it, and running them in BF16 again makes it anew from the master, with the
/// BF16 logprobs and exported weights of before, bit for bit.
#[test]
fn block_format_linears_keep_a_bf16_operand_only_where_the_backward_multiplies_it() {
    let mut c = small(Arch::Qwen3Moe);
    c.moe_intermediate_size = 32;
    let s = seqs();
    let batch = scored(&s);
    let m = bf16_model(&c, 21);
    let experts = expert_values(&m);
    assert!(experts > 0);
    let mut e = cpu_engine(&m, 64).unwrap();
    // As an RL run prepares its engine: BF16 values, then the plan.
    e.use_bf16_params().unwrap();
    let all = e.bf16_operand_bytes();
    let lp = e.logprobs(&batch, 1.0).unwrap();
    let weights = e.weights_bf16().unwrap();
    for (format, mode, kept) in [
        (Format::Mxfp8, BackwardMode::Lowp, false),
        (Format::Mxfp8, BackwardMode::Dequantized, false),
        (Format::Mxfp8, BackwardMode::HighPrecision, true),
        (Format::Nvfp4, BackwardMode::Dequantized, false),
        (Format::Nvfp4, BackwardMode::HighPrecision, true),
    ] {
        let spec = LinearSpec::new(format, mode).unwrap();
        e.quantize_experts(spec).unwrap();
        let want = if kept { all } else { all - 2 * experts };
        assert_eq!(e.bf16_operand_bytes(), want, "{format:?} {mode:?}");
        // The export reads the master's rounding where no operand is kept: the same bits,
        // also after running every parameter at its BF16 value again (which adds no operand
        // and no BF16 value for a block-format linear).
        assert_eq!(e.weights_bf16().unwrap(), weights, "{format:?} {mode:?}");
        e.use_bf16_params().unwrap();
        assert_eq!(e.bf16_operand_bytes(), want, "{format:?} {mode:?}");
        assert_eq!(e.weights_bf16().unwrap(), weights, "{format:?} {mode:?}");
        e.quantize_experts(LinearSpec::bf16()).unwrap();
        assert_eq!(e.bf16_operand_bytes(), all, "{format:?} {mode:?}");
        assert_eq!(e.logprobs(&batch, 1.0).unwrap(), lp, "{format:?} {mode:?}");
    }
}

/// An engine that only samples and scores frees its f32 masters (and a block-format linear's
/// BF16 operand): its logprobs and samples keep their bits, a weight update gives it exactly
/// the logprobs of an engine that kept its masters and took the same update, and everything
/// that needs a master (training, re-quantizing, reading masters) is refused by name without
/// changing the engine. Also with a tied embedding, whose gather reads its BF16 value once
/// the engine runs BF16 parameters, so an engine that took an update computes exactly as the
/// one that sent it.
#[test]
fn an_engine_without_masters_scores_samples_and_takes_updates_as_one_with_them() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let mut c = small(arch);
        c.moe_intermediate_size = 32;
        let s = seqs();
        let batch = scored(&s);
        let prompts: Vec<&[u32]> = s.iter().map(|q| q.as_slice()).collect();
        let sp = SampleParams {
            temperature: 1.0,
            top_p: 0.9,
            top_k: 0,
            seed: 5,
            step: 0,
        };
        let (m, m2) = (bf16_model(&c, 21), bf16_model(&c, 22));
        let experts = expert_values(&m);
        for spec in [
            LinearSpec::bf16(),
            LinearSpec::new(Format::Mxfp8, BackwardMode::HighPrecision).unwrap(),
        ] {
            let tag = format!("{arch:?} {spec:?}");
            let prepared = |m: &Model| {
                let mut e = cpu_engine(m, 64).unwrap();
                e.use_bf16_params().unwrap();
                if spec.weight_scheme().is_some() {
                    e.quantize_experts(spec).unwrap();
                }
                e
            };
            let mut e = prepared(&m);
            let lp = e.logprobs(&batch, 1.0).unwrap();
            let gen = e.generate(&prompts, 6, &sp, &[]).unwrap();
            let ops = e.bf16_operand_bytes();
            let all = e.masters_held();
            assert!(all > 0, "{tag}");
            let freed = e.drop_masters().unwrap();
            assert_eq!(e.masters_held(), 0, "{tag}");
            let hp_ops = if spec.weight_scheme().is_some() {
                2 * experts
            } else {
                0
            };
            assert_eq!(e.bf16_operand_bytes(), ops - hp_ops, "{tag}");
            let params: usize = m.params().iter().map(|p| p.data.len()).sum();
            assert_eq!(freed, 4 * params + hp_ops, "{tag}");
            assert_eq!(e.logprobs(&batch, 1.0).unwrap(), lp, "{tag}");
            let again = e.generate(&prompts, 6, &sp, &[]).unwrap();
            for (a, b) in again.iter().zip(&gen) {
                assert_eq!(a.tokens, b.tokens, "{tag}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a.logprobs), bits(&b.logprobs), "{tag}");
            }
            assert_eq!(e.first_non_finite_param().unwrap(), None, "{tag}");
            // What needs a master is refused by name and changes nothing.
            for err in [
                e.enable_training().unwrap_err().to_string(),
                e.to_model().unwrap_err().to_string(),
                e.quantize_experts(LinearSpec::bf16())
                    .unwrap_err()
                    .to_string(),
                e.set_param_values("model.norm.weight", &vec![1.0; c.hidden_size])
                    .unwrap_err()
                    .to_string(),
            ] {
                assert!(err.contains("drop_masters"), "{tag}: {err}");
            }
            assert_eq!(e.logprobs(&batch, 1.0).unwrap(), lp, "{tag}");
            // A weight update: the same logprobs as an engine that kept its masters.
            let source = prepared(&m2);
            let mut full = prepared(&m);
            for target in [&mut e, &mut full] {
                let (bufs, sums) = source.export_device().unwrap();
                target.install_device(bufs, &sums).unwrap();
            }
            let want = source.logprobs(&batch, 1.0).unwrap();
            assert_ne!(want, lp, "{tag}: the update changes the model");
            assert_eq!(full.logprobs(&batch, 1.0).unwrap(), want, "{tag}");
            assert_eq!(e.logprobs(&batch, 1.0).unwrap(), want, "{tag}");
            let a = e.generate(&prompts, 6, &sp, &[]).unwrap();
            let b = full.generate(&prompts, 6, &sp, &[]).unwrap();
            for (a, b) in a.iter().zip(&b) {
                assert_eq!(a.tokens, b.tokens, "{tag}");
            }
        }
    }
}

#[test]
fn engine_refuses_shared_experts_and_bad_input_with_named_errors() {
    let mut c = small(Arch::Qwen2Moe);
    c.shared_expert_intermediate_size = 10;
    let m = bf16_model(&c, 1);
    let err = cpu_engine(&m, 16)
        .err()
        .expect("shared experts refused")
        .to_string();
    assert!(err.contains("shared_expert_intermediate_size"), "{err}");
    let c = small(Arch::Qwen3Moe);
    let m = bf16_model(&c, 1);
    let e = cpu_engine(&m, 8).unwrap();
    let long: Vec<u32> = (0..9).collect();
    let err = e
        .logprobs(
            &[SeqInput {
                tokens: &long,
                targets: &long,
            }],
            1.0,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("max positions 8"), "{err}");
    let err = e.prefill(&[&[1, 99]], 4).err().unwrap().to_string();
    assert!(err.contains("token id 99"), "{err}");
}

/// The model's gradient (or value) of an engine parameter: routed experts stacked per layer.
fn model_tensor(m: &Model, g: &mxrl_model::Grads, name: &str, grads: bool) -> Vec<f32> {
    let get = |n: &str| -> Vec<f32> {
        let id = m.params().id(n).unwrap_or_else(|| panic!("{n} missing"));
        if grads {
            g.get(id).to_vec()
        } else {
            m.params().get(id).data.clone()
        }
    };
    if let Some((pre, post)) = name.split_once(".experts.*.") {
        let e = m.config().num_experts;
        (0..e)
            .flat_map(|x| get(&format!("{pre}.experts.{x}.{post}")))
            .collect()
    } else {
        get(name)
    }
}

/// The CPU model's training forward of `batch`, random `∂L/∂logprob` (seeds `seed + b` per
/// sequence) and its backward: (logprobs, dlogprobs, gradients).
/// The model's logprobs, the `dlogprobs` drawn for them, its gradients, and its forward's
/// auxiliary loss.
type ModelBackward = (Vec<Vec<f32>>, Vec<Vec<f32>>, mxrl_model::Grads, Option<f32>);

fn model_backward(
    m: &Model,
    batch: &[SeqInput],
    temperature: f32,
    seed: u64,
    aux_loss_coef: f32,
) -> ModelBackward {
    let out = m
        .forward(
            batch,
            &ForwardOptions {
                temperature,
                train: true,
                ..Default::default()
            },
        )
        .unwrap();
    let dl: Vec<Vec<f32>> = out
        .logprobs
        .iter()
        .enumerate()
        .map(|(b, l)| test_values(l.len(), seed + b as u64, 1.0))
        .collect();
    let g = m
        .backward(out.tape.as_ref().unwrap(), &dl, aux_loss_coef)
        .unwrap();
    (out.logprobs, dl, g, out.aux_loss)
}

fn gradients_bitwise(arch: Arch, aux_loss_coef: f32) {
    let c = small(arch);
    let m = bf16_model(&c, 11);
    let mut e = cpu_engine(&m, 64).unwrap();
    e.enable_training().unwrap();
    e.set_aux_loss_coef(aux_loss_coef).unwrap();
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|q| SeqInput::next_token(q)).collect();
    let temperature = 0.9;
    let (logprobs, dl, g, aux) = model_backward(&m, &batch, temperature, 70, aux_loss_coef);
    if aux_loss_coef != 0.0 {
        // The auxiliary loss reaches the routers: their gradients differ from the policy
        // loss's alone (else the comparison below could not tell it was applied).
        let (_, _, g0, _) = model_backward(&m, &batch, temperature, 70, 0.0);
        let router = "model.layers.0.mlp.gate.weight";
        assert_ne!(
            model_tensor(&m, &g, router, true),
            model_tensor(&m, &g0, router, true),
            "the aux loss changes nothing"
        );
    }
    let (lp, tape) = e.forward_train(&batch, temperature).unwrap();
    assert_eq!(lp, logprobs);
    e.zero_grads().unwrap();
    // The step's last backward: it also begins the optimizer step's gradient norm, layer by
    // layer (every layer's parameters handed in once, checked by the backend); the gradients
    // and the norm are `backward`'s.
    e.backward_last(&tape, &dl).unwrap();
    // The loss itself, as the model's forward reports it (only where it was added).
    let aux_bits = |x: Option<f32>| x.map(f32::to_bits);
    assert_eq!(
        aux_bits(e.last_aux_loss().unwrap()),
        aux_bits(aux.filter(|_| aux_loss_coef != 0.0)),
        "{arch:?} aux loss"
    );
    if aux_loss_coef != 0.0 {
        assert!(aux.is_some_and(|a| a > 0.0), "{aux:?}");
    }
    let names: Vec<String> = e.param_names().iter().map(|s| s.to_string()).collect();
    assert!(names.len() > 10);
    for name in &names {
        let got = e.grad_values(name).unwrap();
        let want = model_tensor(&m, &g, name, true);
        assert!(
            want.iter().any(|&x| x != 0.0),
            "{name}: zero gradient tests nothing"
        );
        let gb: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        let wb: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
        assert_eq!(gb, wb, "{arch:?} gradient of {name}");
    }
    // One AdamW step equals the shared CPU clipping (PyTorch's rule, here at half the norm)
    // and AdamW on the model's masters, with weight decay on linear and embedding weights only.
    let cfg = mxrl_tensor::optim::AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let mut all: Vec<Vec<f32>> = names
        .iter()
        .map(|n| model_tensor(&m, &g, n, true))
        .collect();
    let want_norm = {
        let views: Vec<&[f32]> = all.iter().map(|v| v.as_slice()).collect();
        mxrl_tensor::optim::global_grad_norm(&views)
    };
    let norm = e.optimizer_step(&cfg, 0.1, Some(want_norm / 2.0)).unwrap();
    assert_eq!(norm, want_norm);
    {
        let mut views: Vec<&mut [f32]> = all.iter_mut().map(|v| v.as_mut_slice()).collect();
        mxrl_tensor::optim::clip_grad_norm(&mut views, want_norm / 2.0);
    }
    for (name, gr) in names.iter().zip(&all) {
        let mut p = model_tensor(&m, &g, name, false);
        let (mut mm, mut vv) = (vec![0.0; p.len()], vec![0.0; p.len()]);
        let wd = if name.contains("norm") || name.ends_with("bias") {
            0.0
        } else {
            0.1
        };
        mxrl_tensor::optim::adamw_update(&mut p, gr, &mut mm, &mut vv, 1, &cfg, wd);
        let got = e.param_values(name).unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            p.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{name} after one AdamW step"
        );
    }
    // The BF16 operands follow the new masters: the next forward equals a model holding them.
    let mut m2 = m.clone();
    {
        let mut ps = m2.params_mut();
        for name in &names {
            let vals = e.param_values(name).unwrap();
            if let Some((pre, post)) = name.split_once(".experts.*.") {
                let per = vals.len() / c.num_experts;
                for x in 0..c.num_experts {
                    ps.set(
                        &format!("{pre}.experts.{x}.{post}"),
                        &vals[x * per..(x + 1) * per],
                    )
                    .unwrap();
                }
            } else {
                ps.set(name, &vals).unwrap();
            }
        }
    }
    let want = m2
        .forward(&batch, &ForwardOptions::default())
        .unwrap()
        .logprobs;
    assert_eq!(e.logprobs(&batch, 1.0).unwrap(), want);
}

#[test]
fn engine_gradients_and_adamw_equal_the_cpu_model_bitwise_qwen3() {
    gradients_bitwise(Arch::Qwen3Moe, 0.0);
}

#[test]
fn engine_gradients_and_adamw_equal_the_cpu_model_bitwise_qwen2_bias_tied() {
    gradients_bitwise(Arch::Qwen2Moe, 0.0);
}

/// With the auxiliary load-balancing loss (`Model::backward`'s `aux_loss_coef`), both
/// architectures: the engine's gradients and AdamW step are still the CPU model's, bit for
/// bit.
#[test]
fn engine_gradients_with_the_aux_loss_equal_the_cpu_model_bitwise() {
    gradients_bitwise(Arch::Qwen3Moe, 0.05);
    gradients_bitwise(Arch::Qwen2Moe, 0.05);
}

#[path = "common/generation_probes.rs"]
mod generation_probes;

/// The probes a generation records on the CPU engine (prefill: the prompt's last position;
/// decode: the row each step feeds) are, bitwise, the residual stream after every layer at
/// the positions that predict the new tokens, for both architectures (sampled, so the
/// sequences diverge; prompts of different lengths, so the positions differ per sequence).
/// Training with block-format attention linears and experts (MXFP8, every backward mode):
/// the engine's gradients equal the CPU model's bitwise. q, k and v multiply one input, whose
/// backward operand the engine makes once for the three where they share a spec.
#[test]
fn engine_gradients_with_block_format_attention_equal_the_cpu_model_bitwise() {
    let mut c = small(Arch::Qwen3Moe);
    c.moe_intermediate_size = 32;
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|q| SeqInput::next_token(q)).collect();
    for mode in [
        BackwardMode::HighPrecision,
        BackwardMode::Lowp,
        BackwardMode::Dequantized,
    ] {
        let spec = LinearSpec::new(Format::Mxfp8, mode).unwrap();
        let mut m = bf16_model(&c, 41);
        m.set_precision_by(|_, role| match role {
            TensorRole::Attention | TensorRole::Expert => LinearPrecision::Quantized(spec),
            _ => LinearPrecision::Bf16,
        })
        .unwrap();
        let (mut e, what) = Engine::from_model_as_run(&m, CpuBackend, 64).unwrap();
        e.enable_training().unwrap();
        let (logprobs, dl, g, _) = model_backward(&m, &batch, 1.0, 80, 0.0);
        let (lp, tape) = e.forward_train(&batch, 1.0).unwrap();
        assert_eq!(lp, logprobs, "{mode:?} ({what})");
        e.zero_grads().unwrap();
        e.backward(&tape, &dl).unwrap();
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.embed_tokens.weight",
            "model.layers.2.mlp.experts.*.down_proj.weight",
        ] {
            let got = e.grad_values(name).unwrap();
            let want = model_tensor(&m, &g, name, true);
            assert!(
                want.iter().any(|&x| x != 0.0),
                "{name}: zero gradient tests nothing"
            );
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{mode:?}: gradient of {name}"
            );
        }
    }
}

#[test]
fn generation_probes_are_the_residual_stream_after_every_layer() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let m = bf16_model(&small(arch), 12);
        let p = SampleParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 9,
            step: 0,
        };
        let got = generation_probes::check_generation_probes(&m, || CpuBackend, &seqs(), 5, &p);
        assert!(got
            .iter()
            .all(|g| g.probes.as_ref().unwrap().iter().any(|&x| x != 0.0)));
    }
}

/// `zero_grads` leaves the routed experts' gradients pending: before any backward they read as
/// zeros; the first backward writes them (0 + Σ) and the second accumulates, so two identical
/// backwards give exactly twice the model's gradient (each element of an expert weight gets one
/// addition per backward, and x + x is exact).
#[test]
fn pending_expert_gradients_read_zero_then_accumulate_over_two_backwards() {
    let c = small(Arch::Qwen3Moe);
    let m = bf16_model(&c, 11);
    let mut e = cpu_engine(&m, 64).unwrap();
    e.enable_training().unwrap();
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|q| SeqInput::next_token(q)).collect();
    let (_, dl, g, _) = model_backward(&m, &batch, 1.0, 90, 0.0);
    let (_, tape) = e.forward_train(&batch, 1.0).unwrap();
    let names: Vec<String> = e.param_names().iter().map(|s| s.to_string()).collect();
    // A backward, then zero_grads: every gradient reads as zero again, experts included.
    e.zero_grads().unwrap();
    e.backward(&tape, &dl).unwrap();
    e.zero_grads().unwrap();
    for name in &names {
        let z = e.grad_values(name).unwrap();
        assert!(
            z.iter().all(|&x| x == 0.0),
            "{name}: not zero after zero_grads"
        );
    }
    e.backward(&tape, &dl).unwrap();
    e.backward(&tape, &dl).unwrap();
    let mut experts = 0;
    for name in names.iter().filter(|n| n.contains(".experts.")) {
        experts += 1;
        let got = e.grad_values(name).unwrap();
        let want: Vec<u32> = model_tensor(&m, &g, name, true)
            .iter()
            .map(|&x| (x + x).to_bits())
            .collect();
        let gb: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        assert_eq!(gb, want, "twice the gradient of {name}");
    }
    assert!(experts >= 2, "no routed-expert parameter among {names:?}");
}

/// A source whose values do not fill a tensor's shape is refused naming the tensor, and an
/// engine built on zeros holds zeros of the model's layout.
#[test]
fn a_short_source_tensor_is_refused_by_name_and_zeroed_engines_hold_zeros() {
    let c = small(Arch::Qwen3Moe);
    let e = Engine::build(c.clone(), CpuBackend, 16, |name, shape| {
        let n: usize = shape.iter().product();
        let n = if name == "model.norm.weight" {
            n - 1
        } else {
            n
        };
        Ok(std::borrow::Cow::Owned(vec![0.5; n]))
    })
    .err()
    .expect("a short tensor is refused")
    .to_string();
    assert!(
        e.contains("model.norm.weight") && e.contains("expected"),
        "{e}"
    );
    let z = Engine::zeroed(&c, CpuBackend, 16).unwrap();
    let m = Model::random(&c, 3).unwrap();
    let full = Engine::from_model(&m, CpuBackend, 16).unwrap();
    assert_eq!(z.param_names(), full.param_names());
    for name in z.param_names() {
        let v = z.param_values(name).unwrap();
        assert_eq!(v.len(), full.param_values(name).unwrap().len(), "{name}");
        assert!(v.iter().all(|&x| x.to_bits() == 0), "{name}");
    }
}

#[path = "common/shared_prefill.rs"]
mod shared_prefill;

/// A prompt that several slots decode (a group's samples) is prefilled once, and its cache
/// rows, logits, routes and first probe are copied to those slots (the check in
/// `common/shared_prefill.rs`): groups of three, two and one slots, interleaved.
#[test]
fn shared_prefill_copies_each_distinct_prompts_prefill_to_its_slots() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let m = bf16_model(&small(arch), 12);
        let s = seqs();
        let prompts = [0, 1, 0, 2, 0, 2, 3].map(|i| s[i].clone());
        shared_prefill::check_shared_prefill(&m, || CpuBackend, &prompts);
    }
}
