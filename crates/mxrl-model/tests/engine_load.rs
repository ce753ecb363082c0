//! `Engine::from_checkpoint` (the checkpoint streamed into the engine tensor by tensor) against
//! `Engine::from_model(Model::load_hf(dir))` (the whole model loaded on the host first), on the
//! CPU backend: the same values reach the same engine, so logits and every parameter are
//! bitwise equal, and a bad checkpoint gets the host loader's error, naming the tensor.

use mxrl_ckpt::{f32_bytes, f32_to_bf16_bytes, index_json, write_json, Dtype, TensorSpec};
use mxrl_model::engine::{cpu_engine, Engine};
use mxrl_model::hf::{save_hf, to_hf_tensors};
use mxrl_model::{Arch, Model, ModelConfig};
use mxrl_tensor::device::CpuBackend;
use std::collections::BTreeMap;
use std::path::Path;

mod common;
use common::small;

/// A random model whose norms and biases are not all 1 and 0 (so swapped or skipped ones
/// show in the logits).
fn model(c: &ModelConfig, seed: u64) -> Model {
    let mut m = Model::random(c, seed).unwrap();
    {
        let mut ps = m.params_mut();
        for (i, p) in ps.iter_mut().enumerate() {
            if p.name.ends_with("bias") || p.name.contains("norm") {
                let r = mxrl_tensor::gradcheck::test_values(p.data.len(), 900 + i as u64, 0.3);
                for (x, d) in p.data.iter_mut().zip(r) {
                    *x += d;
                }
            }
        }
    }
    m
}

const SEQS: [&[u32]; 3] = [&[1, 5, 9, 2, 14, 3, 33, 21, 8], &[7, 0], &[39, 4, 11, 25]];

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn logits_bits(e: &Engine<CpuBackend>) -> Vec<Vec<u32>> {
    SEQS.iter().map(|s| bits(&e.logits(s).unwrap())).collect()
}

/// Writes `config.json` and the HF tensors of `m` into `dir`, each tensor in the dtype
/// `dtype(name)` (BF16 / F16 rounded to nearest even, F32 exact), in `shards` files (one:
/// `model.safetensors`; more: round-robin in name order, so every gate/up pair straddles two
/// shards, with `model.safetensors.index.json`).
fn write_ckpt(m: &Model, dir: &Path, dtype: impl Fn(&str) -> Dtype, shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), m.config().to_json()).unwrap();
    let mut files: Vec<Vec<(TensorSpec, Vec<u8>)>> = vec![Vec::new(); shards];
    for (i, (name, shape, vals)) in to_hf_tensors(m).into_iter().enumerate() {
        let dt = dtype(&name);
        let bytes = match dt {
            Dtype::F32 => f32_bytes(&vals),
            Dtype::Bf16 => f32_to_bf16_bytes(&vals),
            Dtype::F16 => vals
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            other => panic!("write_ckpt: {other} is not a float dtype"),
        };
        files[i % shards].push((TensorSpec::new(name, dt, shape), bytes));
    }
    if shards == 1 {
        let st = dir.join("model.safetensors");
        mxrl_ckpt::write_safetensors(&st, &files[0], &Default::default()).unwrap();
        return;
    }
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (s, tensors) in files.iter().enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
        for (spec, bytes) in tensors {
            weight_map.insert(spec.name.clone(), file.clone());
            total += bytes.len() as u64;
        }
        mxrl_ckpt::write_safetensors(&dir.join(&file), tensors, &Default::default()).unwrap();
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &index_json(&weight_map, total),
    )
    .unwrap();
}

/// Streams `dir` into an engine and checks it against the engine of the host-loaded model:
/// every parameter's master values and the logits of every test sequence, bitwise. Returns
/// the streamed engine and its description.
fn streamed_equals_host_loaded(dir: &Path, what: &str) -> (Engine<CpuBackend>, String) {
    let host = cpu_engine(&Model::load_hf(dir).unwrap(), 64).unwrap();
    let (got, desc) =
        Engine::from_checkpoint(dir, CpuBackend, 64).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.param_names(), host.param_names(), "{what}");
    for name in host.param_names() {
        assert_eq!(
            bits(&got.param_values(name).unwrap()),
            bits(&host.param_values(name).unwrap()),
            "{what}: {name}"
        );
    }
    assert_eq!(logits_bits(&got), logits_bits(&host), "{what}");
    assert!(desc.contains("tensor by tensor"), "{what}: {desc}");
    (got, desc)
}

/// F32 (as `save_hf` writes), BF16 and a mixed BF16/F16/F32 sharded checkpoint: the streamed
/// engine is the host-loaded one, bit for bit. The F32 one is also the original model's engine
/// (f32 is stored exactly), and the BF16 ones differ from it (their rounded values were read).
#[test]
fn streamed_checkpoints_equal_the_host_loaded_model_bitwise() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        let m = model(&small(arch), 21);
        let orig = logits_bits(&cpu_engine(&m, 64).unwrap());
        let root = tempfile::tempdir().unwrap();

        let f32_dir = root.path().join("f32");
        save_hf(&m, &f32_dir).unwrap();
        let (e, desc) = streamed_equals_host_loaded(&f32_dir, &format!("{arch:?} f32"));
        assert_eq!(
            logits_bits(&e),
            orig,
            "{arch:?} f32: the original model's logits"
        );
        assert!(
            desc.contains("F32") && desc.contains("1 memory-mapped file"),
            "{desc}"
        );

        let bf16_dir = root.path().join("bf16");
        write_ckpt(&m, &bf16_dir, |_| Dtype::Bf16, 1);
        let (e, desc) = streamed_equals_host_loaded(&bf16_dir, &format!("{arch:?} bf16"));
        assert_ne!(
            logits_bits(&e),
            orig,
            "{arch:?} bf16: rounded weights were read"
        );
        assert!(desc.contains("BF16"), "{desc}");

        let mixed = root.path().join("sharded");
        write_ckpt(
            &m,
            &mixed,
            |n| {
                if n.contains("norm") {
                    Dtype::F32
                } else if n.contains("self_attn") {
                    Dtype::F16
                } else {
                    Dtype::Bf16
                }
            },
            3,
        );
        let (_, desc) = streamed_equals_host_loaded(&mixed, &format!("{arch:?} sharded"));
        assert!(desc.contains("3 memory-mapped files"), "{desc}");
    }
}

/// The error of a streamed load, which must be the host loader's error for the same directory.
fn load_error(dir: &Path) -> String {
    let streamed = Engine::from_checkpoint(dir, CpuBackend, 64)
        .err()
        .expect("a bad checkpoint is refused")
        .to_string();
    let host = Model::load_hf(dir).unwrap_err().to_string();
    assert_eq!(streamed, host);
    streamed
}

/// Rewrites the single-file checkpoint in `dir` with `edit` applied to its tensor list.
fn edit_ckpt(dir: &Path, edit: impl FnOnce(&mut Vec<(TensorSpec, Vec<u8>)>)) {
    let ck = mxrl_ckpt::Checkpoint::open(dir).unwrap();
    let mut tensors: Vec<(TensorSpec, Vec<u8>)> = ck
        .names()
        .iter()
        .map(|n| {
            let t = ck.tensor(n).unwrap();
            (
                TensorSpec::new(n.clone(), t.dtype, t.shape.to_vec()),
                t.data.to_vec(),
            )
        })
        .collect();
    drop(ck);
    edit(&mut tensors);
    let st = dir.join("model.safetensors");
    mxrl_ckpt::write_safetensors(&st, &tensors, &Default::default()).unwrap();
}

/// A missing expert part, a tensor of the wrong shape and one of a non-float dtype are refused
/// with the host loader's messages, naming the tensor (and, for shape and dtype, its file).
#[test]
fn bad_checkpoints_are_refused_naming_the_tensor() {
    let c = small(Arch::Qwen3Moe);
    let m = model(&c, 3);
    let root = tempfile::tempdir().unwrap();

    let missing = "model.layers.2.mlp.experts.4.up_proj.weight";
    let dir = root.path().join("missing");
    save_hf(&m, &dir).unwrap();
    edit_ckpt(&dir, |t| t.retain(|(s, _)| s.name != missing));
    let err = load_error(&dir);
    assert!(err.contains(missing) && err.contains("not found"), "{err}");

    let reshaped = "model.layers.0.self_attn.k_proj.weight";
    let dir = root.path().join("shape");
    save_hf(&m, &dir).unwrap();
    edit_ckpt(&dir, |t| {
        let (s, _) = t.iter_mut().find(|(s, _)| s.name == reshaped).unwrap();
        assert_eq!(s.shape, [16, 32]);
        s.shape = vec![32, 16];
    });
    let err = load_error(&dir);
    assert!(
        err.contains(reshaped) && err.contains("[32, 16], expected [16, 32]"),
        "{err}"
    );
    assert!(err.contains("model.safetensors"), "{err}");

    let retyped = "model.norm.weight";
    let dir = root.path().join("dtype");
    save_hf(&m, &dir).unwrap();
    edit_ckpt(&dir, |t| {
        let (s, _) = t.iter_mut().find(|(s, _)| s.name == retyped).unwrap();
        s.dtype = Dtype::I32;
    });
    let err = load_error(&dir);
    assert!(
        err.contains(retyped) && err.contains("I32") && err.contains("model.safetensors"),
        "{err}"
    );
}

/// `mxrl convert` outputs (the `mxfp8` / `nvfp4-hp` presets: MXFP8 attention, dense MLP
/// and routed experts; NVFP4 routed experts): `from_checkpoint` streams the stored tensors into the engine
/// and gives bit for bit the engine `from_model_as_run` builds from `Model::load_converted` —
/// the same masters (the contract dequantization), the same stored bytes, the same logits.
#[test]
fn converted_checkpoint_streams_its_stored_bytes() {
    // K of every linear a multiple of the MXFP8 block (32).
    let mut c = small(Arch::Qwen3Moe);
    c.moe_intermediate_size = 32;
    c.intermediate_size = 32;
    for preset in ["mxfp8", "nvfp4-hp"] {
        let recipe = mxrl_plan::Recipe::preset(preset).unwrap();
        let root = tempfile::tempdir().unwrap();
        let (src, dst) = (root.path().join("src"), root.path().join("out"));
        save_hf(&model(&c, 5), &src).unwrap();
        mxrl_ckpt::convert(
            &src,
            &recipe,
            "test",
            &dst,
            &Default::default(),
            &mxrl_ckpt::NoProgress,
        )
        .unwrap();
        let (want, want_desc) =
            Engine::from_model_as_run(&Model::load_converted(&dst).unwrap(), CpuBackend, 64)
                .unwrap();
        assert!(want_desc.contains("stored bytes"), "{preset}: {want_desc}");
        let (got, desc) = Engine::from_checkpoint(&dst, CpuBackend, 64).unwrap();
        assert!(desc.starts_with(&want_desc), "{preset}: {desc}");
        assert!(
            desc.contains("converted checkpoint") && desc.contains("tensor by tensor"),
            "{desc}"
        );
        assert_eq!(logits_bits(&got), logits_bits(&want), "{preset}");
        let mut stored = 0;
        for n in want.param_names() {
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(got.param_values(n).unwrap()),
                bits(want.param_values(n).unwrap()),
                "{preset}: master {n}"
            );
            let (a, b) = (
                got.stored_weights(n).unwrap(),
                want.stored_weights(n).unwrap(),
            );
            stored += usize::from(a.is_some());
            assert_eq!(a, b, "{preset}: stored {n}");
        }
        assert!(stored > 0, "{preset}: no block-format weight");
        // The stored block-format weights run, not BF16 ones.
        let bf16 = cpu_engine(&Model::load_hf(&src).unwrap(), 64).unwrap();
        assert_ne!(logits_bits(&got), logits_bits(&bf16), "{preset}");
    }
}
