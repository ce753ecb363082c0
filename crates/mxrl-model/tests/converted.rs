//! Loading `mxrl convert` outputs: the model runs the stored quantized bytes as they are.
//!
//! Each case converts a random tiny model with the real converter, loads the result with
//! [`Model::load_converted`], and compares against the original model (loaded from its HF
//! directory) under the same plan: the prepared weights hold exactly the bytes of the
//! safetensors files, and forward logprobs are bitwise equal.

use mxrl_ckpt::{ConvertOptions, NoProgress, Nvfp4Container};
use mxrl_formats::Scales;
use mxrl_model::{Arch, ForwardOptions, LinearPrecision, Model, ModelConfig, SeqInput};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Every linear takes MXFP8 and NVFP4 (K multiple of 32); a dense layer and MoE layers; for
/// Qwen2-MoE also q/k/v bias, the shared expert and tied embeddings.
fn config(arch: Arch) -> ModelConfig {
    let mut c = ModelConfig::tiny();
    c.arch = arch;
    c.vocab_size = 32;
    c.hidden_size = 64;
    c.num_layers = 4;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 32;
    c.intermediate_size = 64;
    c.moe_intermediate_size = 32;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.mlp_only_layers = vec![1];
    c.initializer_range = 0.2;
    if arch == Arch::Qwen2Moe {
        c.qkv_bias = true;
        c.shared_expert_intermediate_size = 32;
        c.tie_word_embeddings = true;
    }
    c
}

/// FP8 128×128 tiles need N and K multiples of 128 (the fused gate/up too: F = 128).
fn fp8_block_config() -> ModelConfig {
    let mut c = config(Arch::Qwen3Moe);
    c.hidden_size = 128;
    c.head_dim = 64;
    c.num_layers = 2;
    c.mlp_only_layers = vec![];
    c.moe_intermediate_size = 128;
    c.num_experts = 2;
    c
}

const FP8_BLOCK_EXPERTS: &str = r#"
name = "fp8-block-experts"
backward = "dequantized"
default = "bf16"
[[rule]]
role = "routed_expert"
format = "fp8_block"
"#;

struct Case {
    what: String,
    config: ModelConfig,
    recipe: mxrl_plan::Recipe,
    container: Nvfp4Container,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for arch in [Arch::Qwen3Moe, Arch::Qwen2Moe] {
        for (preset, container) in [
            ("mxfp8", Nvfp4Container::ModelOpt),
            ("nvfp4-dq", Nvfp4Container::ModelOpt),
            ("nvfp4-hp", Nvfp4Container::CompressedTensors),
        ] {
            out.push(Case {
                what: format!("{arch:?} {preset} {}", container.name()),
                config: config(arch),
                recipe: mxrl_plan::Recipe::load(preset).unwrap(),
                container,
            });
        }
    }
    out.push(Case {
        what: "Qwen3Moe fp8_block experts".into(),
        config: fp8_block_config(),
        recipe: mxrl_plan::Recipe::from_toml_str(FP8_BLOCK_EXPERTS, "test recipe").unwrap(),
        container: Nvfp4Container::ModelOpt,
    });
    out
}

/// Saves a random model of `c` as an HF checkpoint in `root/src`, converts it into
/// `root/out`, and returns the original (loaded back from `src`, the plan applied) and the
/// output directory.
fn convert_case(case: &Case, root: &Path, seed: u64) -> (Model, PathBuf) {
    let src = root.join("src");
    let dst = root.join("out");
    mxrl_model::hf::save_hf(&Model::random(&case.config, seed).unwrap(), &src).unwrap();
    mxrl_ckpt::convert(
        &src,
        &case.recipe,
        &case.what,
        &dst,
        &ConvertOptions {
            nvfp4: case.container,
            ..Default::default()
        },
        &NoProgress,
    )
    .unwrap();
    let mut orig = Model::load_hf(&src).unwrap();
    let inv = mxrl_ckpt::model_inventory(&src).unwrap();
    orig.apply_plan(&mxrl_plan::resolve(&inv, &case.recipe).unwrap())
        .unwrap();
    (orig, dst)
}

/// Raw tensor bytes of a single-file checkpoint, read with the `safetensors` crate.
fn file_tensors(dir: &Path) -> HashMap<String, Vec<u8>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect()
}

fn scale_bytes(s: &Scales) -> Vec<u8> {
    match s {
        Scales::Bytes(b) => b.clone(),
        Scales::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn logprobs(m: &Model) -> Vec<Vec<f32>> {
    let seqs: [&[u32]; 2] = [&[1, 5, 9, 2, 14, 3, 30, 7, 7], &[20, 4, 11]];
    let batch: Vec<SeqInput> = seqs.iter().map(|s| SeqInput::next_token(s)).collect();
    m.forward(&batch, &ForwardOptions::default())
        .unwrap()
        .logprobs
}

/// (a) Every quantized linear of the loaded model runs bytes equal to the converted files'
/// (a fused gate_up: gate's rows then up's, element data and block scales), with the recorded
/// NVFP4 amax; (b) its forward logprobs are bitwise those of the original model under the same
/// plan (same bytes, same activation quantization).
#[test]
fn converted_checkpoints_load_with_their_stored_bytes() {
    for (i, case) in cases().iter().enumerate() {
        let what = &case.what;
        let root = tempfile::tempdir().unwrap();
        let (orig, dst) = convert_case(case, root.path(), 100 + i as u64);
        let loaded = Model::load_converted(&dst).unwrap_or_else(|e| panic!("{what}: {e}"));
        let files = file_tensors(&dst);
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dst.join("mxrl.json")).unwrap()).unwrap();
        let mut quantized = 0;
        for (name, prec) in loaded.linear_precisions() {
            let orig_prec = orig
                .linear_precisions()
                .into_iter()
                .find(|(n, _)| *n == name)
                .unwrap()
                .1;
            assert_eq!(prec, orig_prec, "{what} {name}");
            let LinearPrecision::Quantized(_) = prec else {
                assert!(loaded.prepared_weight(name).is_none());
                continue;
            };
            quantized += 1;
            assert!(loaded.runs_stored_bytes(name), "{what} {name}");
            let got = loaded.prepared_weight(name).unwrap().stored().unwrap();
            let mut data = Vec::new();
            let mut scales = Vec::new();
            for hf in mxrl_model::hf::hf_names(name) {
                let stored: Vec<String> = record["tensors"][&hf]["stored"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_string())
                    .collect();
                data.extend_from_slice(&files[&stored[0]]);
                scales.extend_from_slice(&files[&stored[1]]);
                if let Some(bits) = record["tensors"][&hf]["amax_bits"].as_str() {
                    let a = u32::from_str_radix(bits.trim_start_matches("0x"), 16).unwrap();
                    assert_eq!(got.amax.len(), 1);
                    assert_eq!(got.amax[0].to_bits(), a, "{what} {hf}");
                }
            }
            assert_eq!(got.data, data, "{what} {name}: element bytes");
            assert_eq!(scale_bytes(&got.scales), scales, "{what} {name}: scales");
            let want = orig.prepared_weight(name).unwrap().stored().unwrap();
            assert_eq!(
                (&got.data, &got.scales, &got.amax),
                (&want.data, &want.scales, &want.amax),
                "{what} {name}: the converter's bytes are the trainer's"
            );
        }
        assert!(quantized > 0, "{what}: nothing quantized");
        assert_eq!(logprobs(&loaded), logprobs(&orig), "{what}");
    }
}

/// Rewrites the raw bytes of tensor `name` in `dir/model.safetensors` (same length).
fn patch_tensor(dir: &Path, name: &str, new: &[u8]) {
    let path = dir.join("model.safetensors");
    let (a, b) = {
        let f = mxrl_ckpt::SafetensorsFile::open(&path).unwrap();
        let h = f.header();
        let t = h.tensors.iter().find(|t| t.name == name).unwrap();
        (h.data_start + t.begin, h.data_start + t.begin + t.nbytes())
    };
    assert_eq!(b - a, new.len());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[a..b].copy_from_slice(new);
    std::fs::write(&path, bytes).unwrap();
}

fn edit_record(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("mxrl.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// (c) A corrupted or mismatched converted checkpoint is refused with a message naming the
/// file and tensor: an NVFP4 second-level scale that disagrees with the recorded amax; gate
/// and up quantized with different amax (both named); a recorded format the plan does not
/// decide; a stored tensor of the wrong dtype; a recorded tensor missing from the files; a
/// truncated shard.
#[test]
fn corrupted_converted_checkpoints_are_refused_naming_file_and_tensor() {
    let case = &cases()[1];
    assert!(case.what.contains("nvfp4-dq modelopt"));
    let root = tempfile::tempdir().unwrap();
    let (_, dst) = convert_case(case, root.path(), 7);
    let load_err = |dir: &Path| Model::load_converted(dir).unwrap_err().to_string();
    let up = "model.layers.0.mlp.experts.1.up_proj";
    let gate = "model.layers.0.mlp.experts.1.gate_proj";

    // The recorded amax no longer matches the stored weight_scale_2.
    let d = root.path().join("amax");
    copy_dir(&dst, &d);
    edit_record(&d, |v| {
        v["tensors"][format!("{up}.weight")]["amax_bits"] = "0x3F800000".into();
    });
    let e = load_err(&d);
    assert!(
        e.contains("model.safetensors") && e.contains(&format!("{up}.weight_scale_2")),
        "{e}"
    );

    // Gate and up each consistent, but quantized with different amax: not one fused tensor.
    let d = root.path().join("split_amax");
    copy_dir(&dst, &d);
    let g = mxrl_formats::Nvfp4Global::from_amax(1.0);
    patch_tensor(&d, &format!("{up}.weight_scale_2"), &g.s_dec.to_le_bytes());
    edit_record(&d, |v| {
        v["tensors"][format!("{up}.weight")]["amax_bits"] = "0x3F800000".into();
    });
    let e = load_err(&d);
    assert!(
        e.contains(&format!("{up}.weight")) && e.contains(&format!("{gate}.weight")),
        "{e}"
    );
    assert!(e.contains("amax"), "{e}");

    // A record whose format disagrees with the plan of the recorded recipe.
    let d = root.path().join("format");
    copy_dir(&dst, &d);
    edit_record(&d, |v| {
        v["tensors"][format!("{up}.weight")]["format"] = "mxfp8".into();
    });
    let e = load_err(&d);
    assert!(
        e.contains("mxrl.json") && e.contains(&format!("{up}.weight")),
        "{e}"
    );

    // A stored tensor of the wrong dtype: the E4M3 block scale where the packed data belongs.
    let d = root.path().join("dtype");
    copy_dir(&dst, &d);
    edit_record(&d, |v| {
        let s = &mut v["tensors"][format!("{up}.weight")]["stored"];
        let (a, b) = (s[0].clone(), s[1].clone());
        s[0] = b;
        s[1] = a;
    });
    let e = load_err(&d);
    assert!(
        e.contains("model.safetensors")
            && e.contains(&format!("{up}.weight_scale"))
            && e.contains("F8_E4M3"),
        "{e}"
    );

    // A recorded tensor missing from the files.
    let d = root.path().join("missing");
    copy_dir(&dst, &d);
    edit_record(&d, |v| {
        v["tensors"][format!("{gate}.weight")]["stored"][1] =
            format!("{gate}.weight_scale_x").into();
    });
    let e = load_err(&d);
    assert!(e.contains(&format!("{gate}.weight_scale_x")), "{e}");

    // A truncated shard.
    let d = root.path().join("truncated");
    copy_dir(&dst, &d);
    let f = d.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..(len as usize - 100)]).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // The untouched checkpoint still loads.
    Model::load_converted(&dst).unwrap();
}
