//! Conversion end to end on small real-layout checkpoints of Qwen3-MoE, Qwen2-MoE and
//! DeepSeek-V3 (BF16 and block-FP8 inputs), to every output format: convert, verify,
//! dequantize; and every bad input refused with its message and nothing finished-looking left.

use mxrl_ckpt::synth::{write_synthetic, Arch, Fp8Scales, SynthSpec};
use mxrl_ckpt::{
    convert, dequantize, partial_path, verify, Checkpoint, ConvertOptions, Dtype, NoProgress,
    Nvfp4Container, SafetensorsFile, HF_QUANT_CONFIG, MXRL_JSON,
};
use mxrl_formats::{e2m1_decode, e4m3_decode, QuantizedTensor, ScaleLayout, Scales, Scheme, R2688};
use mxrl_plan::Recipe;
use serde_json::Value;
use std::path::{Path, PathBuf};

const FP8_BLOCK_RECIPE: &str = r#"
name = "fp8-block"
backward = "high_precision"
default = "fp8_block"
nvfp4_activation_scale = "per_token"
[[rule]]
role = "router"
format = "bf16"
[[rule]]
role = "lm_head"
format = "bf16"
[[rule]]
role = "mla_kv_b"
format = "bf16"
[[rule]]
role = "shared_expert_gate"
format = "bf16"
"#;

struct Case {
    label: &'static str,
    recipe: Recipe,
    container: Nvfp4Container,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            label: "mxfp8",
            recipe: Recipe::preset("mxfp8").unwrap(),
            container: Nvfp4Container::ModelOpt,
        },
        Case {
            label: "nvfp4-hp",
            recipe: Recipe::preset("nvfp4-hp").unwrap(),
            container: Nvfp4Container::ModelOpt,
        },
        Case {
            label: "nvfp4-hp",
            recipe: Recipe::preset("nvfp4-hp").unwrap(),
            container: Nvfp4Container::CompressedTensors,
        },
        Case {
            label: "fp8-block",
            recipe: Recipe::from_toml_str(FP8_BLOCK_RECIPE, "test").unwrap(),
            container: Nvfp4Container::ModelOpt,
        },
    ]
}

fn specs() -> Vec<(String, SynthSpec)> {
    let mut v = vec![];
    for arch in Arch::ALL {
        v.push((format!("{arch:?}"), SynthSpec::tiny(arch)));
    }
    for s in [Fp8Scales::PowerOfTwo, Fp8Scales::Arbitrary] {
        v.push((
            format!("DeepseekV3-fp8-{s:?}"),
            SynthSpec {
                fp8: Some(s),
                ..SynthSpec::tiny(Arch::DeepseekV3)
            },
        ));
    }
    v
}

fn opts(c: Nvfp4Container) -> ConvertOptions {
    ConvertOptions {
        nvfp4: c,
        chunk_bytes: 64 << 10, // many chunks even on tiny models
        ..Default::default()
    }
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// One BF16 ulp at the magnitude of `a`.
fn bf16_ulp(a: f32) -> f32 {
    let b = half::bf16::from_f32(a.abs());
    (half::bf16::from_bits(b.to_bits() + 1).to_f32() - b.to_f32()).abs()
}

fn bf16_values(t: &mxrl_ckpt::TensorView<'_>) -> Vec<f32> {
    assert_eq!(t.dtype, Dtype::Bf16, "{}", t.name);
    mxrl_ckpt::to_f32(t).unwrap()
}

/// Checks the dequantized checkpoint against the contract's reference dequantizer, tensor by
/// tensor: MXFP8 and FP8-block byte-equal (the stored forms carry the contract's exact
/// scales); NVFP4 within one BF16 ulp (the containers store 1/S or S instead of amax, so the
/// f32 multiplier may differ from the contract's `fl(fl(sf × amax) × R2688)` by a couple of
/// f32 ulps, which moves a BF16 rounding by at most one ulp).
fn check_dequantized(conv: &Checkpoint, deq: &Checkpoint, rec: &Value) {
    for (name, e) in rec["tensors"].as_object().unwrap() {
        let format = e["format"].as_str().unwrap();
        let method = e["method"].as_str().unwrap();
        let d = deq.tensor(name).unwrap();
        if format == "bf16" && method == "copy" {
            assert_eq!(d.data, conv.tensor(name).unwrap().data, "{name}");
            continue;
        }
        let got = bf16_values(&d);
        let p = name.strip_suffix(".weight").unwrap();
        let (n, k) = (d.shape[0], d.shape[1]);
        let want: Vec<f32> = match format {
            "bf16" => continue, // dequantized block-FP8 source, checked in fp8_sources_*
            "mxfp8" => {
                let q = QuantizedTensor {
                    scheme: Scheme::MXFP8_ROW,
                    shape: vec![n, k],
                    padded_shape: vec![n, k],
                    data: conv.tensor(&format!("{p}.weight")).unwrap().data.to_vec(),
                    scales: Scales::Bytes(
                        conv.tensor(&format!("{p}.weight_scale_inv"))
                            .unwrap()
                            .data
                            .to_vec(),
                    ),
                    scale_layout: ScaleLayout::Compact,
                    amax: vec![],
                };
                q.dequantize().unwrap()
            }
            "fp8_block" => {
                let (np, kp) = (n.div_ceil(128) * 128, k.div_ceil(128) * 128);
                let w = conv.tensor(&format!("{p}.weight")).unwrap().data;
                let mut data = vec![0u8; np * kp];
                for i in 0..n {
                    data[i * kp..i * kp + k].copy_from_slice(&w[i * k..(i + 1) * k]);
                }
                let q = QuantizedTensor {
                    scheme: Scheme::FP8_BLOCK_WEIGHT,
                    shape: vec![n, k],
                    padded_shape: vec![np, kp],
                    data,
                    scales: Scales::F32(mxrl_ckpt::f32_from_bytes(
                        conv.tensor(&format!("{p}.weight_scale_inv")).unwrap().data,
                    )),
                    scale_layout: ScaleLayout::Compact,
                    amax: vec![],
                };
                q.dequantize().unwrap()
            }
            "nvfp4" => {
                let amax = e["amax"].as_f64().unwrap() as f32;
                let packed = conv
                    .get(&format!("{p}.weight"))
                    .filter(|t| t.dtype == Dtype::U8)
                    .or_else(|| conv.get(&format!("{p}.weight_packed")))
                    .unwrap()
                    .data;
                let sc = conv.tensor(&format!("{p}.weight_scale")).unwrap().data;
                (0..n * k)
                    .map(|idx| {
                        let (i, j) = (idx / k, idx % k);
                        let code = (packed[i * (k / 2) + j / 2] >> (4 * (j % 2))) & 0xF;
                        let mult = (e4m3_decode(sc[i * (k / 16) + j / 16]) * amax) * R2688;
                        e2m1_decode(code) * mult
                    })
                    .collect()
            }
            other => panic!("{name}: unknown format {other}"),
        };
        assert_eq!(got.len(), want.len(), "{name}");
        for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
            if format == "nvfp4" {
                let wb = half::bf16::from_f32(*w).to_f32();
                assert!(
                    (g - wb).abs() <= bf16_ulp(wb),
                    "{name}[{idx}]: {g} vs contract {w}"
                );
            } else {
                assert_eq!(bf16_bits(*g), bf16_bits(*w), "{name}[{idx}]: {g} vs {w}");
            }
        }
    }
}

#[test]
fn every_architecture_converts_to_every_format_verifies_and_dequantizes() {
    for (sname, spec) in specs() {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("src");
        let info = write_synthetic(&spec, &src).unwrap();
        assert!(!info.straddling.is_empty());
        for case in cases() {
            let what = format!("{sname} -> {} ({})", case.label, case.container.name());
            let dst = root
                .path()
                .join(format!("out-{}-{}", case.label, case.container.name()));
            let sum = convert(
                &src,
                &case.recipe,
                case.label,
                &dst,
                &opts(case.container),
                &NoProgress,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(!partial_path(&dst).exists());
            let conv = Checkpoint::open(&dst).unwrap();
            // One output shard per input shard, same names; index total_size consistent.
            let names: Vec<_> = conv
                .shards()
                .iter()
                .map(|s| s.file_name().to_string())
                .collect();
            assert_eq!(names, info.files, "{what}");
            assert_eq!(
                conv.index().unwrap().total_size,
                Some(conv.total_data_bytes()),
                "{what}"
            );
            // Contract recorded in every shard and in mxrl.json.
            for s in conv.shards() {
                assert_eq!(
                    s.header().metadata["mxrl.contract_hash"],
                    mxrl_formats::contract_hash(),
                    "{what}"
                );
            }
            let rec = read_json(&dst.join(MXRL_JSON));
            assert_eq!(rec["contract"]["hash"], mxrl_formats::contract_hash());
            assert_eq!(rec["plan_hash"].as_str().unwrap(), sum.plan_hash);
            // Tokenizer and other files copied unchanged.
            for f in [
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
            ] {
                assert_eq!(
                    std::fs::read(src.join(f)).unwrap(),
                    std::fs::read(dst.join(f)).unwrap()
                );
            }
            let cfg = read_json(&dst.join("config.json"));
            let q = &cfg["quantization_config"];
            let quantized = rec["tensors"]
                .as_object()
                .unwrap()
                .values()
                .filter(|e| e["format"] != "bf16")
                .count();
            assert!(quantized > 0, "{what}: nothing quantized");
            match (case.label, case.container) {
                ("mxfp8", _) => {
                    assert_eq!(q["quant_method"], "mxfp8");
                    assert_eq!(q["weight_block_size"], serde_json::json!([1, 32]));
                    assert_eq!(q["scale_fmt"], "ue8m0");
                }
                ("fp8-block", _) => {
                    assert_eq!(q["quant_method"], "fp8");
                    assert_eq!(q["weight_block_size"], serde_json::json!([128, 128]));
                }
                (_, Nvfp4Container::ModelOpt) => {
                    assert_eq!(q["quant_method"], "modelopt");
                    assert_eq!(q["quant_algo"], "NVFP4");
                    let h = read_json(&dst.join(HF_QUANT_CONFIG));
                    assert_eq!(h["quantization"]["exclude_modules"], q["ignore"]);
                }
                (_, Nvfp4Container::CompressedTensors) => {
                    assert_eq!(q["quant_method"], "compressed-tensors");
                    assert_eq!(q["format"], "nvfp4-pack-quantized");
                    assert!(!dst.join(HF_QUANT_CONFIG).exists());
                }
            }
            // The exclusion list names modules explicitly (every client's rule reads that
            // the same way, mxrl_plan::clients): no quantized module, every BF16 linear.
            let key = match (case.label, case.container) {
                ("mxfp8" | "fp8-block", _) => "modules_to_not_convert",
                _ => "ignore",
            };
            let list: Vec<&str> = q[key]
                .as_array()
                .unwrap_or_else(|| panic!("{what}: no {key}"))
                .iter()
                .map(|p| p.as_str().unwrap())
                .collect();
            if case.label == "fp8-block" {
                assert_eq!(q["ignored_layers"], q[key], "{what}");
            }
            let t = rec["tensors"].as_object().unwrap();
            for (name, e) in t {
                let Some(m) = name.strip_suffix(".weight") else {
                    continue;
                };
                if e["format"] != "bf16" {
                    assert!(!list.contains(&m), "{what}: quantized {m} excluded");
                } else if m.ends_with("_proj") || m.ends_with("mlp.gate") || m == "lm_head" {
                    assert!(list.contains(&m), "{what}: BF16 {m} not excluded: {list:?}");
                }
            }
            for m in &list {
                assert!(!m.contains('*') && !m.starts_with("re:"), "{what}: {m}");
                let fused = [
                    "qkv_proj",
                    "gate_up_proj",
                    "experts",
                    "fused_qkv_a_proj_with_mqa",
                ]
                .iter()
                .any(|f| m.ends_with(&format!(".{f}")));
                assert!(
                    t.contains_key(&format!("{m}.weight")) || fused,
                    "{what}: {m} names no module"
                );
            }
            // Gate/up share one amax, also across shards.
            if case.label.starts_with("nvfp4") {
                let t = rec["tensors"].as_object().unwrap();
                let mut straddled_nvfp4 = 0;
                for (g, u) in &info.straddling {
                    if t[g]["format"] != "nvfp4" {
                        continue;
                    }
                    straddled_nvfp4 += 1;
                    assert_eq!(t[g]["amax_bits"], t[u]["amax_bits"], "{what}: {g}");
                    assert_eq!(t[g]["amax_shared_with"], *u);
                    let sg = if case.container == Nvfp4Container::ModelOpt {
                        "weight_scale_2"
                    } else {
                        "weight_global_scale"
                    };
                    let pg = g.strip_suffix(".weight").unwrap();
                    let pu = u.strip_suffix(".weight").unwrap();
                    assert_eq!(
                        conv.tensor(&format!("{pg}.{sg}")).unwrap().data,
                        conv.tensor(&format!("{pu}.{sg}")).unwrap().data
                    );
                    assert_ne!(
                        conv.shard_of(&format!("{pg}.{sg}")),
                        conv.shard_of(&format!("{pu}.{sg}"))
                    );
                }
                assert!(
                    straddled_nvfp4 > 0,
                    "{what}: no NVFP4 pair straddles shards"
                );
            }
            let report = verify(&src, &dst, &NoProgress).unwrap();
            assert!(report.is_clean(), "{what}:\n{}", report.render());
            assert!(report.items.len() > conv.len() / 2);

            let deq = root
                .path()
                .join(format!("deq-{}-{}", case.label, case.container.name()));
            dequantize(&dst, &deq, false, &NoProgress).unwrap();
            let d = Checkpoint::open(&deq).unwrap();
            assert!(read_json(&deq.join("config.json"))
                .get("quantization_config")
                .is_none());
            assert!(!deq.join(MXRL_JSON).exists() && !deq.join(HF_QUANT_CONFIG).exists());
            // Exactly the logical tensors of the source, all scales gone.
            let mut want: Vec<String> = Checkpoint::open(&src)
                .unwrap()
                .names()
                .iter()
                .filter(|n| !n.ends_with("_scale_inv"))
                .cloned()
                .collect();
            let mut have = d.names().to_vec();
            want.sort();
            have.sort();
            assert_eq!(have, want, "{what}");
            check_dequantized(&conv, &d, &rec);
            std::fs::remove_dir_all(&dst).unwrap();
            std::fs::remove_dir_all(&deq).unwrap();
        }
    }
}

/// Block-FP8 inputs: BF16 outputs are the exact dequantization rounded to BF16; power-of-two
/// scales re-pack to MXFP8 keeping every E4M3 byte; arbitrary scales quantize.
#[test]
fn fp8_sources_dequantize_exactly_and_repack_losslessly() {
    for scales in [Fp8Scales::PowerOfTwo, Fp8Scales::Arbitrary] {
        let root = tempfile::tempdir().unwrap();
        let src = root.path().join("src");
        let spec = SynthSpec {
            fp8: Some(scales),
            ..SynthSpec::tiny(Arch::DeepseekV3)
        };
        write_synthetic(&spec, &src).unwrap();
        let s = Checkpoint::open(&src).unwrap();
        let dst = root.path().join("mx");
        convert(
            &src,
            &Recipe::preset("mxfp8").unwrap(),
            "mxfp8",
            &dst,
            &opts(Nvfp4Container::ModelOpt),
            &NoProgress,
        )
        .unwrap();
        let c = Checkpoint::open(&dst).unwrap();
        let rec = read_json(&dst.join(MXRL_JSON));
        let mut repacked = 0;
        for (name, e) in rec["tensors"].as_object().unwrap() {
            let st = s.tensor(name).unwrap();
            if st.dtype != Dtype::F8E4m3 {
                continue;
            }
            let sinv =
                mxrl_ckpt::f32_from_bytes(s.tensor(&format!("{name}_scale_inv")).unwrap().data);
            let k = st.shape[1];
            let exact: Vec<f32> = st
                .data
                .iter()
                .enumerate()
                .map(|(i, &q)| {
                    e4m3_decode(q) * sinv[(i / k / 128) * k.div_ceil(128) + (i % k) / 128]
                })
                .collect();
            match (e["format"].as_str().unwrap(), e["method"].as_str().unwrap()) {
                ("bf16", "dequantize") => {
                    let got = c.tensor(name).unwrap();
                    let want: Vec<u8> = exact
                        .iter()
                        .flat_map(|&x| bf16_bits(x).to_le_bytes())
                        .collect();
                    assert_eq!(got.data, &want[..], "{name}");
                }
                ("mxfp8", "repack") => {
                    assert_eq!(scales, Fp8Scales::PowerOfTwo);
                    repacked += 1;
                    let p = name.strip_suffix(".weight").unwrap();
                    assert_eq!(c.tensor(name).unwrap().data, st.data, "{name}: bytes kept");
                    let sc = c.tensor(&format!("{p}.weight_scale_inv")).unwrap().data;
                    // Lossless: the MXFP8 dequantization equals the FP8-block dequantization.
                    for (i, &q) in st.data.iter().enumerate() {
                        let v = mxrl_formats::ue8m0_decode(sc[i / 32]) * e4m3_decode(q);
                        assert_eq!(v.to_bits(), exact[i].to_bits(), "{name}[{i}]");
                    }
                }
                ("mxfp8", "quantize") => assert_eq!(scales, Fp8Scales::Arbitrary, "{name}"),
                other => panic!("{name}: unexpected {other:?}"),
            }
        }
        assert_eq!(repacked > 0, scales == Fp8Scales::PowerOfTwo);
        assert!(verify(&src, &dst, &NoProgress).unwrap().is_clean());
    }
}

// ---------------------------------------------------------------------------------------
// Bad inputs: each is refused with a message naming what is wrong, and leaves nothing that
// looks like a finished output (no DST, no DST.partial).

fn assert_nothing_left(dst: &Path) {
    assert!(!dst.exists(), "{} exists", dst.display());
    assert!(
        !partial_path(dst).exists(),
        "{} exists",
        partial_path(dst).display()
    );
}

fn convert_err(src: &Path, recipe: &str, want: &[&str]) -> PathBuf {
    let dst = src.parent().unwrap().join("out");
    let e = convert(
        src,
        &Recipe::load(recipe).unwrap(),
        recipe,
        &dst,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .expect_err("conversion must fail")
    .to_string();
    for w in want {
        assert!(e.contains(w), "`{e}` lacks `{w}`");
    }
    assert_nothing_left(&dst);
    dst
}

fn qwen_with(f: impl FnOnce(&mut SynthSpec)) -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("src");
    let mut spec = SynthSpec::tiny(Arch::Qwen3Moe);
    f(&mut spec);
    write_synthetic(&spec, &src).unwrap();
    (root, src)
}

#[test]
fn gate_without_up_is_an_error_naming_both() {
    let up = "model.layers.1.mlp.experts.2.up_proj.weight";
    let (_r, src) = qwen_with(|s| {
        s.omit.insert(up.into());
    });
    convert_err(
        &src,
        "nvfp4-hp",
        &[
            "model.layers.1.mlp.experts.2.gate_proj.weight",
            up,
            "missing",
        ],
    );
}

#[test]
fn nonfinite_weights_are_refused_with_count_unless_allowed() {
    let t = "model.layers.0.mlp.experts.1.down_proj.weight";
    let (_r, src) = qwen_with(|s| {
        s.poison.insert(t.into(), 5);
    });
    convert_err(
        &src,
        "nvfp4-hp",
        &[t, "5 of 16384 values are NaN or Inf", "--allow-nonfinite"],
    );
    let dst = src.parent().unwrap().join("ok");
    let o = ConvertOptions {
        allow_nonfinite: true,
        ..opts(Nvfp4Container::ModelOpt)
    };
    convert(
        &src,
        &Recipe::preset("nvfp4-hp").unwrap(),
        "nvfp4-hp",
        &dst,
        &o,
        &NoProgress,
    )
    .unwrap();
    assert!(verify(&src, &dst, &NoProgress).unwrap().is_clean());
}

#[test]
fn existing_output_is_kept_without_force_and_replaced_with_it() {
    let (_r, src) = qwen_with(|_| {});
    let dst = src.parent().unwrap().join("out");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("precious"), "x").unwrap();
    let r = Recipe::preset("mxfp8").unwrap();
    let e = convert(
        &src,
        &r,
        "mxfp8",
        &dst,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(std::fs::read(dst.join("precious")).unwrap(), b"x");
    assert!(!partial_path(&dst).exists());
    let o = ConvertOptions {
        force: true,
        ..opts(Nvfp4Container::ModelOpt)
    };
    convert(&src, &r, "mxfp8", &dst, &o, &NoProgress).unwrap();
    assert!(!dst.join("precious").exists());
    assert!(dst.join(MXRL_JSON).exists());
}

#[test]
fn output_inside_source_is_refused() {
    let (_r, src) = qwen_with(|_| {});
    let dst = src.join("converted");
    let e = convert(
        &src,
        &Recipe::preset("mxfp8").unwrap(),
        "mxfp8",
        &dst,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("must not be, contain or lie inside the source"),
        "{e}"
    );
    assert_nothing_left(&dst);
}

#[test]
fn truncated_shard_is_refused() {
    let (_r, src) = qwen_with(|_| {});
    let f = src.join("model-00002-of-00003.safetensors");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    convert_err(
        &src,
        "mxfp8",
        &["model-00002-of-00003.safetensors", "run past the end"],
    );
}

#[test]
fn missing_shard_and_index_entries_are_refused() {
    let (_r, src) = qwen_with(|_| {});
    std::fs::remove_file(src.join("model-00003-of-00003.safetensors")).unwrap();
    convert_err(
        &src,
        "mxfp8",
        &["model-00003-of-00003.safetensors", "is missing"],
    );
    let (_r, src) = qwen_with(|_| {});
    let p = src.join("model.safetensors.index.json");
    let mut idx = read_json(&p);
    idx["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("lm_head.weight");
    std::fs::write(&p, idx.to_string()).unwrap();
    convert_err(
        &src,
        "mxfp8",
        &["lm_head.weight", "has no entry in weight_map"],
    );
}

/// Rewrites one tensor's header entry in a shard (keeping the data), re-padding the header.
fn patch_entry(file: &Path, tensor: &str, f: impl FnOnce(&mut Value)) {
    let b = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    f(&mut h[tensor]);
    let mut text = serde_json::to_vec(&h).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(file, out).unwrap();
}

fn shard_of(src: &Path, tensor: &str) -> PathBuf {
    let idx = read_json(&src.join("model.safetensors.index.json"));
    src.join(idx["weight_map"][tensor].as_str().unwrap())
}

#[test]
fn unsupported_and_mismatched_dtypes_are_refused() {
    let t = "model.layers.0.self_attn.q_proj.weight";
    let (_r, src) = qwen_with(|_| {});
    patch_entry(&shard_of(&src, t), t, |e| e["dtype"] = "F4".into());
    convert_err(&src, "mxfp8", &[t, "unsupported dtype `F4`"]);

    let (_r, src) = qwen_with(|_| {});
    patch_entry(&shard_of(&src, t), t, |e| e["dtype"] = "F32".into());
    convert_err(
        &src,
        "mxfp8",
        &[t, "needs 65536 bytes", "mismatched dtype or shape"],
    );

    // A dtype the header allows but a quantized weight cannot come from.
    let (_r, src) = qwen_with(|_| {});
    patch_entry(&shard_of(&src, t), t, |e| e["dtype"] = "I16".into());
    convert_err(&src, "mxfp8", &[t, "unsupported dtype I16", "mxfp8"]);
}

#[test]
fn overlapping_offsets_are_refused() {
    let t = "model.layers.0.self_attn.k_proj.weight";
    let (_r, src) = qwen_with(|_| {});
    let f = shard_of(&src, t);
    let sf = SafetensorsFile::open(&f).unwrap();
    let e = sf
        .header()
        .tensors
        .iter()
        .find(|x| x.name == t)
        .unwrap()
        .clone();
    drop(sf);
    patch_entry(&f, t, |v| {
        v["data_offsets"] = serde_json::json!([e.begin - 8, e.end - 8]);
    });
    convert_err(&src, "mxfp8", &["overlap", t]);
}

#[test]
fn shape_a_format_cannot_take_is_refused() {
    // Expert down_proj K = moe_intermediate = 40: not a multiple of MXFP8's 32.
    let (_r, src) = qwen_with(|s| s.moe_intermediate = 40);
    convert_err(&src, "mxfp8", &["down_proj.weight", "K % 32"]);
}

#[test]
fn plans_mixing_two_quantized_formats_are_refused() {
    let (_r, src) = qwen_with(|_| {});
    let recipe = src.parent().unwrap().join("mixed.toml");
    std::fs::write(
        &recipe,
        "name = \"mixed\"\nbackward = \"high_precision\"\ndefault = \"mxfp8\"\nnvfp4_activation_scale = \"per_token\"\n[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"\n",
    )
    .unwrap();
    convert_err(
        &src,
        recipe.to_str().unwrap(),
        &["mxfp8 and nvfp4", "one quantized format"],
    );
}

#[test]
fn plans_no_serving_engine_can_load_are_refused() {
    // vLLM and SGLang load a layer's routed experts as one FusedMoE module: one BF16 expert
    // among NVFP4 ones cannot be expressed by any exclusion list, so nothing is written.
    let (_r, src) = qwen_with(|_| {});
    let recipe = src.parent().unwrap().join("one-expert.toml");
    std::fs::write(
        &recipe,
        "name = \"one-expert\"\nbackward = \"high_precision\"\ndefault = \"bf16\"\n[[rule]]\nname = \"layers.0.moe.experts.1.*\"\nformat = \"bf16\"\n[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"\n",
    )
    .unwrap();
    convert_err(
        &src,
        recipe.to_str().unwrap(),
        &[
            "cannot be served",
            "`model.layers.0.mlp.experts` as one fused module",
            "model.layers.0.mlp.experts.1.gate_proj bf16",
        ],
    );
}

#[test]
fn verify_reports_a_changed_byte_and_a_changed_config() {
    let (_r, src) = qwen_with(|_| {});
    let dst = src.parent().unwrap().join("out");
    convert(
        &src,
        &Recipe::preset("nvfp4-hp").unwrap(),
        "nvfp4-hp",
        &dst,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .unwrap();
    let t = "model.layers.0.mlp.experts.0.up_proj.weight_scale";
    let f = shard_of(&dst, t);
    let sf = SafetensorsFile::open(&f).unwrap();
    let e = sf
        .header()
        .tensors
        .iter()
        .find(|x| x.name == t)
        .unwrap()
        .clone();
    let off = sf.header().data_start + e.begin + 3;
    drop(sf);
    let mut b = std::fs::read(&f).unwrap();
    b[off] ^= 1;
    std::fs::write(&f, b).unwrap();
    let cfgp = dst.join("config.json");
    let mut cfg = read_json(&cfgp);
    cfg["quantization_config"]["ignore"] = serde_json::json!([]);
    std::fs::write(&cfgp, cfg.to_string()).unwrap();
    let r = verify(&src, &dst, &NoProgress).unwrap();
    let bad: Vec<_> = r
        .items
        .iter()
        .filter(|i| !i.ok)
        .map(|i| i.item.as_str())
        .collect();
    assert_eq!(bad, [t, "config.json"], "{}", r.render());
    assert!(
        r.render().contains("1 of 1024 bytes differ"),
        "{}",
        r.render()
    );
}

#[test]
fn verify_refuses_a_recorded_contract_or_plan_that_differs() {
    let (_r, src) = qwen_with(|_| {});
    let dst = src.parent().unwrap().join("out");
    convert(
        &src,
        &Recipe::preset("mxfp8").unwrap(),
        "mxfp8",
        &dst,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .unwrap();
    let p = dst.join(MXRL_JSON);
    let mut rec = read_json(&p);
    rec["contract"]["hash"] = "0000000000000000".into();
    rec["plan_hash"] = "feed".into();
    std::fs::write(&p, rec.to_string()).unwrap();
    let r = verify(&src, &dst, &NoProgress).unwrap();
    let bad: Vec<_> = r
        .items
        .iter()
        .filter(|i| !i.ok)
        .map(|i| i.item.as_str())
        .collect();
    assert_eq!(bad, ["contract", "plan", MXRL_JSON], "{}", r.render());
}

#[test]
fn dequantize_refuses_unrecognized_layouts_and_existing_outputs() {
    let (_r, src) = qwen_with(|_| {});
    let conv = src.parent().unwrap().join("conv");
    convert(
        &src,
        &Recipe::preset("nvfp4-hp").unwrap(),
        "nvfp4-hp",
        &conv,
        &opts(Nvfp4Container::ModelOpt),
        &NoProgress,
    )
    .unwrap();
    let deq = src.parent().unwrap().join("deq");
    std::fs::create_dir(&deq).unwrap();
    let e = dequantize(&conv, &deq, false, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--force"), "{e}");
    std::fs::remove_dir(&deq).unwrap();
    // A block scale of the wrong shape.
    let t = "model.layers.0.mlp.experts.0.gate_proj.weight_scale";
    patch_entry(&shard_of(&conv, t), t, |v| {
        let s = v["shape"].as_array().unwrap().clone();
        v["shape"] = serde_json::json!([s[1], s[0]]);
    });
    let e = dequantize(&conv, &deq, false, &NoProgress)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(t) && e.contains("NVFP4 block scale must be F8_E4M3 [128, 8]"),
        "{e}"
    );
    assert_nothing_left(&deq);
}
