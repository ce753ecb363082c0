//! Model-level tests: full-model gradients, decode vs forward, batching, routing replay,
//! loading.

use mxrl_model::{
    Arch, ForwardOptions, KvCache, LinearPrecision, Model, ModelConfig, ReplayKind, SamplingParams,
    SeqInput, WeightValue,
};
use mxrl_tensor::gradcheck::{check_with_step, gamma, test_values, Eval};

/// A tiny config exercising every feature of `arch`: a dense layer (mlp_only_layers), MoE
/// layers, GQA; for Qwen2-MoE also q/k/v bias, the shared expert and tied embeddings.
fn small(arch: Arch) -> ModelConfig {
    let mut c = ModelConfig::tiny();
    c.arch = arch;
    c.vocab_size = 16;
    c.hidden_size = 16;
    c.num_layers = 3;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c.intermediate_size = 12;
    c.moe_intermediate_size = 8;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.mlp_only_layers = vec![1];
    c.initializer_range = 0.3;
    if arch == Arch::Qwen2Moe {
        c.qkv_bias = true;
        c.shared_expert_intermediate_size = 10;
        c.tie_word_embeddings = true;
        c.norm_topk_prob = false;
    }
    c
}

fn seqs() -> Vec<Vec<u32>> {
    vec![vec![1, 5, 9, 2, 14, 3], vec![7, 0], vec![4, 4, 11, 15]]
}

/// Randomizes biases and norm weights too (zero biases / unit norms would hide gradient bugs).
fn perturbed(c: &ModelConfig, seed: u64) -> Model {
    let mut m = Model::random(c, seed).unwrap();
    {
        let mut ps = m.params_mut();
        for (i, p) in ps.iter_mut().enumerate() {
            if p.name.ends_with("bias") || p.name.contains("norm") {
                let r = test_values(p.data.len(), 1000 + i as u64, 0.3);
                for (x, d) in p.data.iter_mut().zip(r) {
                    *x += d;
                }
            }
        }
    }
    m
}

/// ∂L/∂θ from `backward` against central differences for every parameter tensor (a few
/// coordinates each), with `L = Σ_t r_t·logprob_t + coef·aux`. The FD evaluations replay the
/// base forward's expert ids so that `L` is smooth in θ (the selection is piecewise constant).
fn full_model_gradient_check(arch: Arch) {
    let c = small(arch);
    let model = perturbed(&c, 7);
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|x| SeqInput::next_token(x)).collect();
    let opts = ForwardOptions {
        train: true,
        ..Default::default()
    };
    let out = model.forward(&batch, &opts).unwrap();
    let r: Vec<Vec<f32>> = out
        .logprobs
        .iter()
        .enumerate()
        .map(|(b, lp)| test_values(lp.len(), 50 + b as u64, 1.0))
        .collect();
    let coef = 0.5f32;
    let grads = model
        .backward(out.tape.as_ref().unwrap(), &r, coef)
        .unwrap();
    let routing = out.routing.clone();
    let eval = |m: &Model| {
        let o = m
            .forward(
                &batch,
                &ForwardOptions {
                    replay: Some((&routing, ReplayKind::Ids)),
                    ..Default::default()
                },
            )
            .unwrap();
        let mut value = coef as f64 * o.aux_loss.unwrap() as f64;
        let mut magnitude = value.abs();
        for (lp, rr) in o.logprobs.iter().zip(&r) {
            for (a, b) in lp.iter().zip(rr) {
                value += *a as f64 * *b as f64;
                magnitude += (*a as f64 * *b as f64).abs();
            }
        }
        Eval { value, magnitude }
    };
    // Rounding bound of one forward: the longest f32 dependency chain runs through every layer
    // (GEMM reductions of length ≤ max(H, 2F, Hq·D) = 16, attention over T ≤ 5 keys with
    // D = 8, norms over H = 16, the vocabulary softmax over V = 16): per layer < 80 roundings,
    // 3 layers plus the head < 300, so ε_L = γ_300 relative to the magnitude of L's terms.
    let eps = gamma(300);
    let mut failures = Vec::new();
    for (id, p) in model.params().iter().enumerate() {
        let n = p.data.len();
        let idx: Vec<usize> = [0, n / 3, n - 1].into_iter().collect();
        let g = grads.get(id);
        let gm: Vec<f64> = g.iter().map(|v| 64.0 * v.abs() as f64 + 1e-9).collect();
        let name = p.name.clone();
        let f = check_with_step(&p.data, g, &gm, eps, Some(&idx), 1.0 / 16.0, |x| {
            let mut m = model.clone();
            m.params_mut().set(&name, x).unwrap();
            eval(&m)
        });
        failures.extend(f.into_iter().map(|e| format!("{name}: {e}")));
    }
    assert!(failures.is_empty(), "{arch:?}: {failures:#?}");
    // The check must be able to fail: the router gradient is non-zero somewhere.
    let rid = model.params().id("model.layers.0.mlp.gate.weight").unwrap();
    assert!(grads.get(rid).iter().any(|&x| x != 0.0));
}

#[test]
fn qwen3_moe_full_model_gradients_match_finite_differences() {
    full_model_gradient_check(Arch::Qwen3Moe);
}

#[test]
fn qwen2_moe_full_model_gradients_match_finite_differences() {
    full_model_gradient_check(Arch::Qwen2Moe);
}

/// Tolerance for comparing two logprobs of the same model computed with the same operands but
/// different f32 summation orders (GEMM blocking for m = 1 vs m = N): each GEMM output is within
/// 2γ_K of the other relative to Σ|a·b|; through ~10 layers of unit-scale activations the
/// logprob difference is bounded by γ_{4096} in absolute value.
fn order_tol() -> f32 {
    gamma(4096) as f32
}

#[test]
fn kv_cache_decode_matches_full_forward() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = small(arch);
        let model = perturbed(&c, 3);
        let seq: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
        let full = model
            .forward(
                &[SeqInput::next_token(&seq)],
                &ForwardOptions {
                    return_logits: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let logits = &full.logits.as_ref().unwrap()[0];
        let v = c.vocab_size;
        // prefill 3 tokens, then decode the rest one at a time
        let pre = model.prefill(&[&seq[..3]]).unwrap();
        let mut caches = pre.caches;
        let mut got = vec![pre.last_logits[0].clone()];
        for &tok in &seq[3..seq.len() - 1] {
            let step = model.decode_step(&[tok], &mut caches).unwrap();
            got.push(step.logits[0].clone());
        }
        assert_eq!(caches[0].len(), seq.len() - 1);
        for (i, row) in got.iter().enumerate() {
            let want = &logits[(i + 2) * v..(i + 3) * v];
            for (a, b) in row.iter().zip(want) {
                assert!(
                    (a - b).abs() <= order_tol(),
                    "{arch:?} pos {}: {a} vs {b}",
                    i + 2
                );
            }
        }
    }
}

#[test]
fn generation_logprobs_and_routing_match_the_training_forward() {
    let c = small(Arch::Qwen3Moe);
    let model = perturbed(&c, 5);
    let prompt = [2u32, 7, 7, 1];
    let sp = SamplingParams {
        temperature: 0.8,
        max_new_tokens: 6,
        seed: 11,
        ..Default::default()
    };
    let g = &model.generate(&[&prompt], &sp).unwrap()[0];
    let mut full = prompt.to_vec();
    full.extend_from_slice(&g.tokens);
    let fwd = model
        .forward(
            &[SeqInput::next_token(&full)],
            &ForwardOptions {
                temperature: 0.8,
                ..Default::default()
            },
        )
        .unwrap();
    let lp = &fwd.logprobs[0][prompt.len() - 1..];
    assert_eq!(lp.len(), g.logprobs.len());
    for (a, b) in lp.iter().zip(&g.logprobs) {
        assert!((a - b).abs() <= order_tol(), "{a} vs {b}");
    }
    let tr = &fwd.routing[0];
    assert_eq!(g.routing.num_tokens(), full.len() - 1);
    assert_eq!(tr.layers.len(), g.routing.layers.len(), "MoE layer counts");
    for (a, b) in tr.layers.iter().zip(&g.routing.layers) {
        assert_eq!(a.ids, b.ids);
        for (x, y) in a.weights.iter().zip(&b.weights) {
            assert!((x - y).abs() <= order_tol());
        }
    }
}

#[test]
fn batched_generation_equals_one_by_one() {
    let c = small(Arch::Qwen2Moe);
    let model = perturbed(&c, 9);
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![9], vec![4, 5, 6, 7, 8, 0]];
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let sp = SamplingParams {
        temperature: 1.0,
        top_k: 8,
        top_p: 0.9,
        seed: 100,
        max_new_tokens: 7,
        stop_tokens: vec![15],
    };
    let batched = model.generate(&refs, &sp).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let one = &model
            .generate(
                &[p],
                &SamplingParams {
                    seed: sp.seed + i as u64,
                    ..sp.clone()
                },
            )
            .unwrap()[0];
        assert_eq!(one.tokens, batched[i].tokens, "prompt {i}");
        assert_eq!(one.finish, batched[i].finish);
        for (a, b) in one.logprobs.iter().zip(&batched[i].logprobs) {
            assert!((a - b).abs() <= order_tol(), "{a} vs {b}");
        }
    }
}

#[test]
fn variable_length_batch_equals_separate_forwards() {
    let c = small(Arch::Qwen3Moe);
    let model = perturbed(&c, 13);
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|x| SeqInput::next_token(x)).collect();
    let all = model.forward(&batch, &ForwardOptions::default()).unwrap();
    for (b, x) in batch.iter().enumerate() {
        let one = model.forward(&[*x], &ForwardOptions::default()).unwrap();
        for (p, q) in one.logprobs[0].iter().zip(&all.logprobs[b]) {
            assert!((p - q).abs() <= order_tol(), "seq {b}: {p} vs {q}");
        }
    }
}

#[test]
fn replayed_routing_equals_captured() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = small(arch);
        let model = perturbed(&c, 17);
        let s = seqs();
        let batch: Vec<SeqInput> = s.iter().map(|x| SeqInput::next_token(x)).collect();
        let cap = model.forward(&batch, &ForwardOptions::default()).unwrap();
        for kind in [ReplayKind::Ids, ReplayKind::Full] {
            let rep = model
                .forward(
                    &batch,
                    &ForwardOptions {
                        replay: Some((&cap.routing, kind)),
                        ..Default::default()
                    },
                )
                .unwrap();
            assert_eq!(rep.routing, cap.routing, "{arch:?} {kind:?}");
            assert_eq!(rep.logprobs, cap.logprobs, "{arch:?} {kind:?}");
        }
        // Replay forces a different choice when told to: swap the two slots' experts.
        let mut forced = cap.routing.clone();
        for r in forced[0].layers.iter_mut() {
            for pair in r.ids.chunks_mut(2) {
                pair.swap(0, 1);
            }
        }
        let rep = model
            .forward(
                &batch,
                &ForwardOptions {
                    replay: Some((&forced, ReplayKind::Ids)),
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            rep.routing[0].layers,
            forced[0]
                .layers
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    // weights follow the swapped ids
                    for pair in r.weights.chunks_mut(2) {
                        pair.swap(0, 1);
                    }
                    r
                })
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn replay_input_is_validated() {
    let model = Model::random(&small(Arch::Qwen3Moe), 1).unwrap();
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|x| SeqInput::next_token(x)).collect();
    let cap = model.forward(&batch, &ForwardOptions::default()).unwrap();
    let err = model
        .forward(
            &batch[..2],
            &ForwardOptions {
                replay: Some((&cap.routing, ReplayKind::Ids)),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("3 traces for 2 sequences"),
        "{err}"
    );
    let mut bad = cap.routing.clone();
    bad[1].layers[0].ids[0] = 99;
    let err = model
        .forward(
            &batch,
            &ForwardOptions {
                replay: Some((&bad, ReplayKind::Full)),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("expert id 99"), "{err}");
    let err = model
        .forward(
            &[SeqInput {
                tokens: &[1, 99],
                targets: &[2, 3],
            }],
            &ForwardOptions::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("token id 99"), "{err}");
}

#[test]
fn stale_tape_is_refused_after_a_weight_update() {
    let mut model = Model::random(&small(Arch::Qwen3Moe), 1).unwrap();
    let s = seqs();
    let out = model
        .forward(
            &[SeqInput::next_token(&s[0])],
            &ForwardOptions {
                train: true,
                ..Default::default()
            },
        )
        .unwrap();
    model.params_mut();
    let err = model
        .backward(out.tape.as_ref().unwrap(), &[vec![1.0; 5]], 0.0)
        .unwrap_err();
    assert!(err.to_string().contains("weight version"), "{err}");
}

#[test]
fn same_seed_same_bytes_and_hf_roundtrip() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = small(arch);
        let a = Model::random(&c, 42).unwrap();
        let b = Model::random(&c, 42).unwrap();
        let d = Model::random(&c, 43).unwrap();
        for ((p, q), r) in a
            .params()
            .iter()
            .zip(b.params().iter())
            .zip(d.params().iter())
        {
            assert_eq!(p.data, q.data, "{}", p.name);
            if p.role != mxrl_model::TensorRole::Norm && p.role != mxrl_model::TensorRole::Bias {
                assert_ne!(p.data, r.data, "{}", p.name);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        mxrl_model::hf::save_hf(&a, dir.path()).unwrap();
        let l = Model::load_hf(dir.path()).unwrap();
        assert_eq!(l.config(), a.config());
        for (p, q) in a.params().iter().zip(l.params().iter()) {
            assert_eq!(p.name, q.name);
            assert_eq!(p.data, q.data, "{}", p.name);
        }
    }
}

/// `save_hf` streams the parameters' own memory into the file; its bytes are those of the
/// copying writer (`to_hf_tensors`, each tensor's f32 values as little-endian bytes) for both
/// architectures, and the temporary file is gone.
#[test]
fn streamed_hf_save_writes_the_bytes_of_the_copying_writer() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let m = Model::random(&small(arch), 5).unwrap();
        let dir = tempfile::tempdir().unwrap();
        mxrl_model::hf::save_hf(&m, dir.path()).unwrap();
        let copied: Vec<(mxrl_ckpt::TensorSpec, Vec<u8>)> = mxrl_model::hf::to_hf_tensors(&m)
            .into_iter()
            .map(|(n, s, v)| {
                (
                    mxrl_ckpt::TensorSpec::new(n, mxrl_ckpt::Dtype::F32, s),
                    mxrl_ckpt::f32_bytes(&v),
                )
            })
            .collect();
        let want = dir.path().join("want.safetensors");
        mxrl_ckpt::write_safetensors(&want, &copied, &Default::default()).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("model.safetensors")).unwrap(),
            std::fs::read(&want).unwrap(),
            "{arch:?}"
        );
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["config.json", "model.safetensors", "want.safetensors"]
        );
    }
}

/// `max_position_embeddings` is written and read back; a config.json without it gets the
/// default of transformers' Qwen2-MoE/Qwen3-MoE configs.
#[test]
fn max_positions_round_trip_and_default_to_transformers() {
    let c = small(Arch::Qwen3Moe);
    let mut v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["max_position_embeddings"], c.max_position_embeddings);
    v["max_position_embeddings"] = 48.into();
    let read = ModelConfig::from_json(&v.to_string(), "cfg").unwrap();
    assert_eq!(read.max_position_embeddings, 48);
    v.as_object_mut().unwrap().remove("max_position_embeddings");
    let read = ModelConfig::from_json(&v.to_string(), "cfg").unwrap();
    assert_eq!(
        read.max_position_embeddings,
        mxrl_model::DEFAULT_MAX_POSITIONS
    );
    assert_eq!(mxrl_model::DEFAULT_MAX_POSITIONS, 32768);
}

#[test]
fn missing_tensor_is_named() {
    let c = small(Arch::Qwen3Moe);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), c.to_json()).unwrap();
    // No weight file at all: the error names the files it looked for.
    let err = Model::load_hf(dir.path()).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    // A weight file without one tensor: the error names the tensor.
    let m = Model::random(&c, 1).unwrap();
    mxrl_model::hf::save_hf(&m, dir.path()).unwrap();
    let ck = mxrl_ckpt::Checkpoint::open(dir.path()).unwrap();
    let keep: Vec<(mxrl_ckpt::TensorSpec, Vec<u8>)> = ck
        .names()
        .iter()
        .filter(|n| n.as_str() != "model.embed_tokens.weight")
        .map(|n| {
            let t = ck.tensor(n).unwrap();
            (
                mxrl_ckpt::TensorSpec::new(n.clone(), t.dtype, t.shape.to_vec()),
                t.data.to_vec(),
            )
        })
        .collect();
    drop(ck);
    let st = dir.path().join("model.safetensors");
    mxrl_ckpt::write_safetensors(&st, &keep, &Default::default()).unwrap();
    let err = Model::load_hf(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("model.embed_tokens.weight"),
        "{err}"
    );
}

#[test]
fn save_errors_say_writing_and_name_the_path() {
    let m = Model::random(&small(Arch::Qwen3Moe), 1).unwrap();
    // /proc refuses new directories even to root.
    let err = mxrl_model::hf::save_hf(&m, std::path::Path::new("/proc/mxrl-model-test"))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("writing /proc/mxrl-model-test: "), "{err}");
}

#[test]
fn config_parses_hf_fields() {
    let text = r#"{"model_type":"qwen3_moe","vocab_size":100,"hidden_size":32,
      "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
      "rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"},"rms_norm_eps":1e-6,
      "intermediate_size":64,"moe_intermediate_size":16,"num_experts":8,"num_experts_per_tok":2,
      "norm_topk_prob":true,"decoder_sparse_step":2,"mlp_only_layers":[3],
      "tie_word_embeddings":false}"#;
    let c = ModelConfig::from_json(text, "test").unwrap();
    assert_eq!(c.rope_theta, 1e6);
    let moe: Vec<bool> = (0..4).map(|l| c.is_moe_layer(l)).collect();
    assert_eq!(moe, vec![false, true, false, false]);
    let bad = text.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
    let err = ModelConfig::from_json(&bad, "test").unwrap_err();
    assert!(err.to_string().contains("num_key_value_heads"), "{err}");
    let bad = text.replace("qwen3_moe", "llama");
    assert!(ModelConfig::from_json(&bad, "x")
        .unwrap_err()
        .to_string()
        .contains("model_type"));
}

#[test]
fn bf16_linears_change_logprobs_by_bf16_sized_amounts() {
    let c = small(Arch::Qwen3Moe);
    let f32m = perturbed(&c, 21);
    let mut b = f32m.clone();
    b.set_precision_by(|_, _| LinearPrecision::Bf16).unwrap();
    assert!(b
        .linear_precisions()
        .iter()
        .all(|(_, p)| *p == LinearPrecision::Bf16));
    let s = seqs();
    let batch: Vec<SeqInput> = s.iter().map(|x| SeqInput::next_token(x)).collect();
    let x = f32m.forward(&batch, &ForwardOptions::default()).unwrap();
    let y = b.forward(&batch, &ForwardOptions::default()).unwrap();
    let mut maxd = 0.0f32;
    for (p, q) in x.logprobs.iter().flatten().zip(y.logprobs.iter().flatten()) {
        maxd = maxd.max((p - q).abs());
    }
    // BF16 operands differ (2⁻⁹ relative rounding), so the outputs must differ, but by a
    // bounded amount: well below one nat on this tiny model.
    assert!(maxd > 0.0 && maxd < 0.5, "max |Δlogprob| = {maxd}");
}

#[test]
fn kv_cache_reports_length() {
    let k = KvCache::new(2);
    assert!(k.is_empty());
}

/// The model takes every linear's format from the plan (fused gate_up from its HF gate/up
/// entries), and a quantized model still runs forward, backward and generation.
#[test]
fn precision_plan_decides_every_linear() {
    let c = ModelConfig::tiny();
    let base = Model::random(&c, 31).unwrap();
    let dir = tempfile::tempdir().unwrap();
    mxrl_model::hf::save_hf(&base, dir.path()).unwrap();
    let inv = mxrl_plan::Inventory::from_config_path(&dir.path().join("config.json")).unwrap();
    let seq: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8, 9];
    let f32_lp = base
        .forward(&[SeqInput::next_token(&seq)], &ForwardOptions::default())
        .unwrap()
        .logprobs;
    for preset in ["bf16", "mxfp8", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq"] {
        let plan = mxrl_plan::resolve(&inv, &mxrl_plan::Recipe::load(preset).unwrap()).unwrap();
        let mut m = base.clone();
        m.apply_plan(&plan).unwrap();
        let mut quantized = 0;
        for (name, prec) in m.linear_precisions() {
            let names = mxrl_model::hf::hf_names(name);
            for hf in names {
                let e = plan.by_hf(&hf).unwrap();
                match prec {
                    LinearPrecision::Bf16 => {
                        assert_eq!(e.format, mxrl_formats::Format::Bf16, "{hf}")
                    }
                    LinearPrecision::Quantized(spec) => {
                        quantized += 1;
                        assert_eq!(spec.format(), e.format, "{hf}");
                        assert_eq!(spec.backward().name(), e.backward.name(), "{hf}");
                    }
                    LinearPrecision::F32 => panic!("{preset}: {hf} left at f32"),
                }
            }
        }
        assert_eq!(quantized > 0, preset != "bf16", "{preset}");
        let out = m
            .forward(
                &[SeqInput::next_token(&seq)],
                &ForwardOptions {
                    train: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let g = m
            .backward(out.tape.as_ref().unwrap(), &[vec![1.0; 8]], 0.0)
            .unwrap();
        assert!(g.grads.iter().flatten().all(|x| x.is_finite()), "{preset}");
        let d: f32 = out.logprobs[0]
            .iter()
            .zip(&f32_lp[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        // a 0.02-std random model has near-uniform logits: low precision moves them slightly
        assert!(d.is_finite() && d < 0.1, "{preset}: max |Δlogprob| {d}");
        let gen = m
            .generate(
                &[&seq[..3]],
                &SamplingParams {
                    max_new_tokens: 4,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(gen[0].tokens.len(), 4);
    }
}

/// A tiny model under the `preset` plan (its HF inventory from a saved config).
fn planned(preset: &str, seed: u64) -> Model {
    let c = ModelConfig::tiny();
    let mut m = Model::random(&c, seed).unwrap();
    let dir = tempfile::tempdir().unwrap();
    mxrl_model::hf::save_hf(&m, dir.path()).unwrap();
    let inv = mxrl_plan::Inventory::from_config_path(&dir.path().join("config.json")).unwrap();
    let plan = mxrl_plan::resolve(&inv, &mxrl_plan::Recipe::load(preset).unwrap()).unwrap();
    m.apply_plan(&plan).unwrap();
    m
}

/// Everything a weight update would carry: stored bytes for quantized linears, values else.
fn as_update(m: &Model) -> Vec<(String, WeightValue)> {
    m.params()
        .iter()
        .map(|p| {
            let v = match m.prepared_weight(&p.name).and_then(|pw| pw.stored()) {
                Some(q) => WeightValue::Quantized(q.clone()),
                None => WeightValue::Values(p.data.clone()),
            };
            (p.name.clone(), v)
        })
        .collect()
}

fn logprobs_of(m: &Model) -> Vec<Vec<f32>> {
    let seq: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8, 9];
    m.forward(&[SeqInput::next_token(&seq)], &ForwardOptions::default())
        .unwrap()
        .logprobs
}

/// A model given another model's stored bytes computes bit-identical logprobs and keeps the
/// bytes as sent (never re-quantized), for every low-precision recipe.
#[test]
fn stored_bytes_are_used_as_sent() {
    for preset in ["mxfp8", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq"] {
        let src = planned(preset, 41);
        let mut dst = planned(preset, 42);
        assert_ne!(logprobs_of(&src), logprobs_of(&dst), "{preset}");
        let v0 = dst.version();
        dst.load_weights(as_update(&src)).unwrap();
        assert_eq!(dst.version(), v0 + 1);
        assert_eq!(logprobs_of(&src), logprobs_of(&dst), "{preset}");
        let mut n = 0;
        for (name, _) in src.linear_precisions() {
            if let Some(q) = src.prepared_weight(name).and_then(|pw| pw.stored()) {
                let got = dst.prepared_weight(name).unwrap().stored().unwrap();
                assert_eq!(got.data, q.data, "{preset} {name}");
                assert_eq!(got.scales, q.scales, "{preset} {name}");
                assert_eq!(got.amax, q.amax, "{preset} {name}");
                assert!(dst.runs_stored_bytes(name));
                n += 1;
            }
        }
        assert!(n > 0, "{preset}: nothing quantized");
    }
}

/// NVFP4 bytes quantized with a second-level scale from a larger amax (as a checkpoint whose
/// gate and up share one amax has): re-quantizing their dequantization would choose another
/// amax and other bytes; the model keeps the bytes it was given.
#[test]
fn nvfp4_bytes_with_a_foreign_amax_are_not_requantized() {
    let mut m = planned("nvfp4-hp", 43);
    let (name, n, k) = m
        .linear_precisions()
        .into_iter()
        .find(|(_, p)| matches!(p, LinearPrecision::Quantized(_)))
        .map(|(name, _)| {
            let p = m.params().by_name(name).unwrap();
            (name.to_string(), p.shape[0], p.shape[1])
        })
        .unwrap();
    let w = m.params().by_name(&name).unwrap().data.clone();
    let amax = 3.0 * w.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
    let mxrl_formats::Scheme::Nvfp4(per_tensor) = mxrl_formats::Scheme::NVFP4_TENSOR else {
        unreachable!("NVFP4_TENSOR is an NVFP4 scheme")
    };
    let q = mxrl_formats::quantize_nvfp4_with_amax(
        &w,
        &[n, k],
        per_tensor,
        mxrl_formats::Padding::Reject,
        &[amax],
    )
    .unwrap();
    let requant = mxrl_formats::quantize(
        &q.dequantize().unwrap(),
        &[n, k],
        mxrl_formats::Scheme::NVFP4_TENSOR,
        mxrl_formats::Padding::Reject,
    )
    .unwrap();
    assert_ne!(requant.amax, q.amax, "the test needs a foreign amax");
    m.load_weights(vec![(name.clone(), WeightValue::Quantized(q.clone()))])
        .unwrap();
    let got = m.prepared_weight(&name).unwrap().stored().unwrap();
    assert_eq!((&got.data, &got.amax), (&q.data, &q.amax));
    // Changing another linear's precision keeps the installed bytes.
    let other = m
        .linear_precisions()
        .into_iter()
        .map(|(n, _)| n.to_string())
        .find(|n| *n != name && n.contains("q_proj"))
        .unwrap();
    m.set_precision(&other, LinearPrecision::Bf16).unwrap();
    assert_eq!(
        m.prepared_weight(&name).unwrap().stored().unwrap().amax,
        q.amax
    );
    // Editing the parameters makes the master values authoritative again.
    drop(m.params_mut());
    assert!(!m.runs_stored_bytes(&name));
    assert_eq!(
        m.prepared_weight(&name).unwrap().stored().unwrap().amax,
        requant.amax
    );
}

/// A bad update names the tensor and changes nothing.
#[test]
fn bad_weight_update_changes_nothing() {
    let src = planned("mxfp8", 44);
    let mut dst = planned("nvfp4-hp", 45);
    let before = logprobs_of(&dst);
    let v0 = dst.version();
    // MXFP8 bytes for NVFP4 linears.
    let e = dst.load_weights(as_update(&src)).unwrap_err().to_string();
    assert!(e.contains("model.") && e.contains("mxfp8"), "{e}");
    // An unknown name after valid tensors.
    let mut u = as_update(&planned("nvfp4-hp", 46));
    u.push(("model.nope.weight".into(), WeightValue::Values(vec![0.0])));
    let e = dst.load_weights(u).unwrap_err().to_string();
    assert!(e.contains("model.nope.weight"), "{e}");
    // A wrong length.
    let e = dst
        .load_weights(vec![(
            "model.norm.weight".into(),
            WeightValue::Values(vec![1.0; 3]),
        )])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.norm.weight") && e.contains("3 values"),
        "{e}"
    );
    assert_eq!(dst.version(), v0);
    assert_eq!(logprobs_of(&dst), before);
}

/// Hidden-state capture changes nothing else (logprobs, logits and routing are bitwise those
/// of the plain forward), has one `[T, H]` state per layer and sequence, and the last layer's
/// state is the residual stream the logits came from: the final RMSNorm and lm_head over it
/// reproduce the forward's logits bitwise, and an independent f64 evaluation of those two ops
/// agrees within a derived bound. Checked for both architectures and a quantized plan.
#[test]
fn hidden_capture_is_the_residual_stream_the_logits_came_from() {
    let mut models: Vec<(String, Model)> = [Arch::Qwen3Moe, Arch::Qwen2Moe]
        .into_iter()
        .map(|a| (format!("{a:?}"), perturbed(&small(a), 61)))
        .collect();
    models.push(("mxfp8".into(), planned("mxfp8", 62)));
    models.push(("nvfp4-dq".into(), planned("nvfp4-dq", 63)));
    for (what, m) in &models {
        let c = m.config().clone();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let data: Vec<Vec<u32>> = seqs()
            .into_iter()
            .map(|s| s.into_iter().map(|t| t % v as u32).collect())
            .collect();
        let batch: Vec<SeqInput> = data.iter().map(|s| SeqInput::next_token(s)).collect();
        let opts = ForwardOptions {
            return_logits: true,
            ..Default::default()
        };
        let plain = m.forward(&batch, &opts).unwrap();
        let cap = m.forward_capturing(&batch, &opts).unwrap();
        assert!(plain.hidden.is_none());
        assert_eq!(plain.logprobs, cap.logprobs, "{what}");
        assert_eq!(plain.logits, cap.logits, "{what}");
        assert_eq!(plain.routing, cap.routing, "{what}");
        let hidden = cap.hidden.as_ref().unwrap();
        assert_eq!(hidden.len(), batch.len());
        for (hs, s) in hidden.iter().zip(&batch) {
            assert_eq!(hs.layers.len(), c.num_layers, "{what}");
            assert_eq!(hs.num_tokens(), s.tokens.len(), "{what}");
            assert!(hs.layers.iter().all(|l| l.len() == s.tokens.len() * h));
            // Layers differ from each other (each adds its residual).
            assert_ne!(hs.layers[0], hs.layers[c.num_layers - 1], "{what}");
        }
        // One sequence alone: the lm_head GEMM runs with the same shape as in the forward.
        let one = m.forward_capturing(&batch[..1], &opts).unwrap();
        let last = one.hidden.as_ref().unwrap()[0].layers[c.num_layers - 1].clone();
        let logits = m.logits_from_residual(&last).unwrap();
        assert_eq!(&logits, &one.logits.as_ref().unwrap()[0], "{what}");
        if what.starts_with("Qwen") {
            // f32 model: rstd and y = x·rstd·g carry ≤ γ_{H+4} relative error, the lm_head
            // dot product adds γ_H relative to Σ|y_j·w_j|: |Δlogit| ≤ γ_{2H+8}·Σ|y_j·w_j|.
            let g = m
                .params()
                .by_name("model.norm.weight")
                .unwrap()
                .data
                .clone();
            let head = if c.tie_word_embeddings {
                "model.embed_tokens.weight"
            } else {
                "lm_head.weight"
            };
            let w = &m.params().by_name(head).unwrap().data;
            let bound = mxrl_tensor::gradcheck::gamma(2 * h + 8);
            for (t, row) in last.chunks(h).enumerate() {
                let ms: f64 = row.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / h as f64;
                let rstd = 1.0 / (ms + c.rms_norm_eps as f64).sqrt();
                let y: Vec<f64> = row
                    .iter()
                    .zip(&g)
                    .map(|(&x, &g)| x as f64 * rstd * g as f64)
                    .collect();
                for o in 0..v {
                    let wr = &w[o * h..(o + 1) * h];
                    let exact: f64 = y.iter().zip(wr).map(|(a, &b)| a * b as f64).sum();
                    let mag: f64 = y.iter().zip(wr).map(|(a, &b)| (a * b as f64).abs()).sum();
                    let got = logits[t * v + o] as f64;
                    assert!(
                        (got - exact).abs() <= bound * mag,
                        "{what} pos {t} logit {o}: {got} vs {exact}"
                    );
                }
            }
        }
    }
    assert!(models[0].1.logits_from_residual(&[0.0; 5]).is_err());
}

/// Generation with capture samples the same tokens and logprobs as without, returns one
/// state per consumed token and layer, and the decode-time states (prefill for the prompt,
/// then one per KV-cache decode step) equal the full forward's over the same tokens within the
/// decode-vs-forward summation-order tolerance, scaled by the state's magnitude.
#[test]
fn decode_hidden_capture_matches_the_full_forward() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = small(arch);
        let model = perturbed(&c, 64);
        let prompts: [&[u32]; 2] = [&[2, 7, 7, 1], &[5, 3]];
        let sp = SamplingParams {
            temperature: 0.9,
            max_new_tokens: 5,
            seed: 13,
            ..Default::default()
        };
        let plain = model.generate(&prompts, &sp).unwrap();
        let cap = model.generate_capturing(&prompts, &sp).unwrap();
        for (b, (p, g)) in plain.iter().zip(&cap).enumerate() {
            assert!(p.hidden.is_none());
            assert_eq!(p.tokens, g.tokens);
            assert_eq!(p.logprobs, g.logprobs);
            let hs = g.hidden.as_ref().unwrap();
            assert_eq!(hs.num_tokens(), g.routing.num_tokens());
            let mut full = prompts[b].to_vec();
            full.extend_from_slice(&g.tokens);
            let fwd = model
                .forward_capturing(&[SeqInput::next_token(&full)], &ForwardOptions::default())
                .unwrap();
            let want = &fwd.hidden.as_ref().unwrap()[0];
            assert_eq!(want.num_tokens(), hs.num_tokens());
            for l in 0..c.num_layers {
                for t in 0..hs.num_tokens() {
                    let (a, w) = (hs.at(l, t), want.at(l, t));
                    let scale = w.iter().fold(1.0f32, |m, x| m.max(x.abs()));
                    for (x, y) in a.iter().zip(w) {
                        assert!(
                            (x - y).abs() <= order_tol() * scale,
                            "{arch:?} seq {b} layer {l} pos {t}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}

/// A config of `arch` whose every linear takes MXFP8 (K % 32 == 0) and NVFP4 (K % 16 == 0):
/// a dense layer, MoE layers, GQA; for Qwen2-MoE also q/k/v bias, the shared expert and its
/// gate, tied embeddings.
fn quant_small(arch: Arch) -> ModelConfig {
    let mut c = small(arch);
    c.hidden_size = 32;
    c.head_dim = 16;
    c.intermediate_size = 64;
    c.moe_intermediate_size = 32;
    if arch == Arch::Qwen2Moe {
        c.shared_expert_intermediate_size = 32;
    }
    c
}

/// `config` with random weights (biases and norms perturbed) under the `preset` plan.
fn planned_config(config: &ModelConfig, preset: &str, seed: u64) -> Model {
    let mut m = perturbed(config, seed);
    let inv = mxrl_plan::Inventory::from_config_json(&config.to_json(), "test config").unwrap();
    let plan = mxrl_plan::resolve(&inv, &mxrl_plan::Recipe::load(preset).unwrap()).unwrap();
    m.apply_plan(&plan).unwrap();
    m
}

/// The training tape keeps each quantized linear's saved context (quantized / column-wise /
/// BF16 input per backward mode) instead of its f32 input. Its gradients equal, bit for bit,
/// those of the reference tape that keeps the f32 inputs and re-quantizes them in backward
/// (the previous implementation), for every recipe, both architectures (dense layer, shared
/// expert and its gate, biases, tied head) and with the aux loss; and it holds fewer bytes
/// whenever some linear is quantized with the `high_precision` or `dequantized` backward.
#[test]
fn saved_context_tape_gives_the_recompute_reference_gradients_bitwise() {
    let data = seqs();
    let batch: Vec<SeqInput> = data.iter().map(|s| SeqInput::next_token(s)).collect();
    let dlp: Vec<Vec<f32>> = batch
        .iter()
        .enumerate()
        .map(|(b, s)| test_values(s.tokens.len(), 70 + b as u64, 1.0))
        .collect();
    let opts = ForwardOptions {
        train: true,
        ..Default::default()
    };
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = quant_small(arch);
        for preset in [
            "bf16", "mxfp8", "mxfp8-hp", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq",
        ] {
            let m = planned_config(&c, preset, 71);
            let quantized = m
                .linear_precisions()
                .iter()
                .filter(|(_, p)| matches!(p, LinearPrecision::Quantized(_)))
                .count();
            assert_eq!(quantized > 0, preset != "bf16", "{arch:?} {preset}");
            let fast = m.forward(&batch, &opts).unwrap();
            let reference = m.forward_recompute_reference(&batch, &opts).unwrap();
            assert_eq!(fast.logprobs, reference.logprobs, "{arch:?} {preset}");
            assert_eq!(fast.aux_loss, reference.aux_loss, "{arch:?} {preset}");
            let (tf, tr) = (fast.tape.unwrap(), reference.tape.unwrap());
            let gf = m.backward(&tf, &dlp, 0.01).unwrap();
            let gr = m.backward(&tr, &dlp, 0.01).unwrap();
            assert_eq!(gf.grads.len(), gr.grads.len());
            for (i, (a, b)) in gf.grads.iter().zip(&gr.grads).enumerate() {
                let name = &m.params().get(i).name;
                assert!(
                    a.iter()
                        .map(|x| x.to_bits())
                        .eq(b.iter().map(|x| x.to_bits())),
                    "{arch:?} {preset}: gradient of {name} differs"
                );
            }
            assert!(gf.grads.iter().flatten().any(|&x| x != 0.0));
            // MXFP8 `lowp` keeps column-wise copies whose 32-row blocks pad M up to a multiple
            // of 32, which for an expert with a few tokens can exceed its f32 input; the other
            // modes keep the BF16 or the forward's quantized input, always smaller.
            if quantized > 0 && preset != "mxfp8" {
                assert!(
                    tf.nbytes() < tr.nbytes(),
                    "{arch:?} {preset}: {} vs {}",
                    tf.nbytes(),
                    tr.nbytes()
                );
            } else if quantized == 0 {
                assert_eq!(tf.nbytes(), tr.nbytes(), "{arch:?} {preset}");
            }
        }
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Training forward logprobs, aux loss and gradients of `m` on `seqs()` (with the aux loss).
fn train_pass(m: &Model) -> (Vec<Vec<f32>>, Option<f32>, Vec<Vec<f32>>) {
    let data = seqs();
    let batch: Vec<SeqInput> = data.iter().map(|s| SeqInput::next_token(s)).collect();
    let dlp: Vec<Vec<f32>> = batch
        .iter()
        .enumerate()
        .map(|(b, s)| test_values(s.tokens.len(), 80 + b as u64, 1.0))
        .collect();
    let opts = ForwardOptions {
        train: true,
        ..Default::default()
    };
    let out = m.forward(&batch, &opts).unwrap();
    let g = m.backward(out.tape.as_ref().unwrap(), &dlp, 0.01).unwrap();
    (out.logprobs, out.aux_loss, g.grads)
}

/// `use_bf16_params` makes a model compute with the BF16 values of the tensors its plan does
/// not quantize while keeping the f32 masters: its training forward, gradients, prefill
/// logits and `param_bf16` equal bit for bit those of a model whose values of those tensors
/// were rounded to BF16 (norms, biases, tied and untied embeddings included), for both
/// architectures under a BF16 and two block-format recipes, and its masters are unchanged
/// (some of them not BF16-exact, so the rounding is really applied by the model).
#[test]
fn bf16_params_compute_with_bf16_values_and_keep_the_masters() {
    use mxrl_tensor::precision::round_bf16;
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let c = quant_small(arch);
        for preset in ["bf16", "mxfp8", "nvfp4-hp"] {
            let mut m = planned_config(&c, preset, 91);
            let masters: Vec<Vec<f32>> = m.params().iter().map(|p| p.data.clone()).collect();
            let mut rounded = m.clone();
            {
                let mut ps = rounded.params_mut();
                for p in ps.iter_mut() {
                    if m.stored_weight(&p.name).is_none() {
                        p.data.iter_mut().for_each(|x| *x = round_bf16(*x));
                    }
                }
            }
            m.use_bf16_params();
            let (lm, am, gm) = train_pass(&m);
            let (lr, ar, gr) = train_pass(&rounded);
            assert_eq!(bits(&lm), bits(&lr), "{arch:?} {preset}: logprobs");
            assert_eq!(
                am.map(f32::to_bits),
                ar.map(f32::to_bits),
                "{arch:?} {preset}"
            );
            assert_eq!(bits(&gm), bits(&gr), "{arch:?} {preset}: gradients");
            let prompts: Vec<&[u32]> = vec![&[1, 2, 3], &[9, 4]];
            let (pm, pr) = (
                m.prefill(&prompts).unwrap(),
                rounded.prefill(&prompts).unwrap(),
            );
            assert_eq!(
                bits(&pm.last_logits),
                bits(&pr.last_logits),
                "{arch:?} {preset}"
            );
            let now: Vec<Vec<f32>> = m.params().iter().map(|p| p.data.clone()).collect();
            assert_eq!(
                bits(&now),
                bits(&masters),
                "{arch:?} {preset}: masters changed"
            );
            let mut inexact = 0;
            for p in m.params().iter() {
                let want: Option<Vec<u16>> = m.stored_weight(&p.name).is_none().then(|| {
                    p.data
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_bits())
                        .collect()
                });
                assert_eq!(m.param_bf16(&p.name), want, "{arch:?} {preset} {}", p.name);
                assert_eq!(m.param_bf16(&p.name), rounded.param_bf16(&p.name));
                if want.is_some() && p.data.iter().any(|&x| round_bf16(x) != x) {
                    inexact += 1;
                }
            }
            assert!(
                inexact > 0,
                "{arch:?} {preset}: every master was BF16-exact"
            );
        }
    }
}

/// The training state a model owns: without `enable_training` gradients are refused; with it,
/// `backward_accumulate` adds each backward's gradients to the model's own in order (bitwise
/// `(0 + g1) + g2`) and `zero_grads` clears them; masters edited through `train_params_mut`
/// leave the model stale (forward and generation refused, naming `refresh_weights`) until
/// `refresh_weights` re-derives every working weight — then the model equals, bit for bit, one
/// edited through `params_mut` (logprobs, stored quantized bytes, BF16 values), one weight
/// version on. `master_model` is a copy of the masters without gradients or BF16 values.
#[test]
fn a_model_in_training_owns_its_gradients_and_rederives_weights_from_its_masters() {
    let c = quant_small(Arch::Qwen2Moe);
    let mut m = planned_config(&c, "mxfp8", 93);
    m.use_bf16_params();
    assert!(m.zero_grads().is_err() && m.train_params_mut().is_err() && m.grads().is_none());
    let data = seqs();
    let batch: Vec<SeqInput> = data.iter().map(|s| SeqInput::next_token(s)).collect();
    let opts = ForwardOptions {
        train: true,
        ..Default::default()
    };
    let t1 = m.forward(&batch[..2], &opts).unwrap().tape.unwrap();
    let t2 = m.forward(&batch[1..], &opts).unwrap().tape.unwrap();
    let d1: Vec<Vec<f32>> = batch[..2]
        .iter()
        .map(|s| vec![0.5; s.tokens.len()])
        .collect();
    let d2: Vec<Vec<f32>> = batch[1..]
        .iter()
        .map(|s| vec![-0.3; s.tokens.len()])
        .collect();
    let e = m.backward_accumulate(&t1, &d1, 0.0).unwrap_err();
    assert!(e.to_string().contains("training is not enabled"), "{e}");
    m.enable_training();
    let g1 = m.backward(&t1, &d1, 0.01).unwrap();
    let g2 = m.backward(&t2, &d2, 0.01).unwrap();
    m.backward_accumulate(&t1, &d1, 0.01).unwrap();
    m.backward_accumulate(&t2, &d2, 0.01).unwrap();
    let want: Vec<Vec<f32>> = g1
        .grads
        .iter()
        .zip(&g2.grads)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (0.0 + x) + y).collect())
        .collect();
    assert_eq!(bits(&m.grads().unwrap().grads), bits(&want));
    assert!(want.iter().flatten().any(|&x| x != 0.0));
    m.zero_grads().unwrap();
    assert!(m.grads().unwrap().grads.iter().flatten().all(|&x| x == 0.0));

    // Edit a quantized linear's master, a BF16 linear's and a norm's.
    let edit = |name: &str| {
        name == "model.layers.0.self_attn.q_proj.weight"
            || name == "lm_head.weight"
            || name == "model.norm.weight"
    };
    let mut by_guard = m.clone();
    {
        let mut ps = by_guard.params_mut();
        for p in ps.iter_mut().filter(|p| edit(&p.name)) {
            p.data.iter_mut().for_each(|x| *x += 0.013);
        }
    }
    let v0 = m.version();
    for p in m.train_params_mut().unwrap() {
        if edit(p.name) {
            p.value.iter_mut().for_each(|x| *x += 0.013);
        }
    }
    assert!(m.weights_stale());
    let e = m.forward(&batch, &opts).unwrap_err().to_string();
    assert!(e.contains("refresh_weights"), "{e}");
    assert!(m.prefill(&[&[1, 2]]).is_err());
    m.refresh_weights();
    assert!(!m.weights_stale());
    assert_eq!((m.version(), by_guard.version()), (v0 + 1, v0 + 1));
    assert_eq!(bits(&logprobs_of(&m)), bits(&logprobs_of(&by_guard)));
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert!(m.stored_weight(q).is_some());
    for p in m.params().iter() {
        assert_eq!(m.stored_weight(&p.name), by_guard.stored_weight(&p.name));
        assert_eq!(m.param_bf16(&p.name), by_guard.param_bf16(&p.name));
    }

    let mm = m.master_model();
    assert!(mm.grads().is_none() && !mm.weights_stale());
    for (a, b) in mm.params().iter().zip(m.params().iter()) {
        assert_eq!(a.name, b.name);
        assert!(a
            .data
            .iter()
            .map(|x| x.to_bits())
            .eq(b.data.iter().map(|x| x.to_bits())));
        assert_eq!(mm.stored_weight(&a.name), m.stored_weight(&a.name));
    }
}
