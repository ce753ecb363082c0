//! Small synthetic checkpoints in the real Hugging Face layouts of Qwen3-MoE, Qwen2-MoE and
//! DeepSeek-V3, for tests and benchmarks.
//!
//! Tensor names, shapes, dtypes and `config.json` keys follow the published checkpoints of
//! each family (e.g. `model.layers.{i}.mlp.experts.{e}.gate_proj.weight`), only smaller.
//! DeepSeek-V3 has MLA attention (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, ...), the first
//! `first_k_dense_replace` layers dense, shared experts, a router with
//! `e_score_correction_bias` (F32), and optionally the original block-FP8 storage:
//! F8_E4M3 `weight` plus F32 `weight_scale_inv` of shape `[ceil(N/128), ceil(K/128)]`.
//!
//! Shards are cut so that at least one expert's `gate_proj` ends one shard and its `up_proj`
//! starts the next one: the converter must pair them across files.
//!
//! Values are deterministic (ChaCha8 seeded by the spec's seed and the tensor name): weights
//! uniform in ±s with a per-row scale s spanning several binades, so per-row and per-block
//! maxima differ; norms near 1.

use crate::container::Layout;
use crate::dtype::Dtype;
use crate::error::{CkptError, Result};
use crate::reader::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use crate::writer::{write_json, ShardWriter, TensorSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Model family of a synthetic checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `qwen3_moe`: GQA with q/k RMSNorm, routed experts only.
    Qwen3Moe,
    /// `qwen2_moe`: QKV biases, routed experts plus one shared expert with a sigmoid gate.
    Qwen2Moe,
    /// `deepseek_v3`: MLA, first-k dense layers, routed + shared experts.
    DeepseekV3,
}

impl Arch {
    /// All families.
    pub const ALL: [Arch; 3] = [Arch::Qwen3Moe, Arch::Qwen2Moe, Arch::DeepseekV3];

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::DeepseekV3 => "deepseek_v3",
        }
    }

    /// Parses `qwen3-moe` / `qwen3_moe`, `qwen2-moe`, `deepseek-v3`.
    pub fn parse(s: &str) -> Option<Arch> {
        match s.replace('-', "_").as_str() {
            "qwen3_moe" => Some(Arch::Qwen3Moe),
            "qwen2_moe" => Some(Arch::Qwen2Moe),
            "deepseek_v3" => Some(Arch::DeepseekV3),
            _ => None,
        }
    }
}

/// How the block-FP8 scales of a DeepSeek-V3 input are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Scales {
    /// Every `weight_scale_inv` is a power of two (lossless MXFP8 repack possible).
    PowerOfTwo,
    /// Arbitrary positive f32 scales (as DeepSeek-V3's own checkpoint has).
    Arbitrary,
}

/// Shape of a synthetic checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// Family.
    pub arch: Arch,
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Dense MLP intermediate size (DeepSeek-V3 dense layers).
    pub intermediate: usize,
    /// Routed expert intermediate size.
    pub moe_intermediate: usize,
    /// Shared expert intermediate size (Qwen2-MoE; DeepSeek-V3 uses `moe_intermediate`).
    pub shared_intermediate: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Attention heads.
    pub heads: usize,
    /// KV heads (Qwen).
    pub kv_heads: usize,
    /// Head dim (Qwen).
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Dense (MLP-only) layers at the start: DeepSeek-V3 `first_k_dense_replace`, Qwen
    /// `mlp_only_layers` = `[0, first_k_dense)`.
    pub first_k_dense: usize,
    /// DeepSeek-V3: q LoRA rank.
    pub q_lora_rank: usize,
    /// DeepSeek-V3: kv LoRA rank.
    pub kv_lora_rank: usize,
    /// DeepSeek-V3: non-rotary q/k head dim.
    pub qk_nope_head_dim: usize,
    /// DeepSeek-V3: rotary q/k head dim.
    pub qk_rope_head_dim: usize,
    /// DeepSeek-V3: value head dim.
    pub v_head_dim: usize,
    /// DeepSeek-V3: store linear weights as block FP8 with these scales (None: BF16).
    pub fp8: Option<Fp8Scales>,
    /// Number of shard files (1: a single `model.safetensors`).
    pub shards: usize,
    /// Seed of every value.
    pub seed: u64,
    /// Tensors to leave out (to build broken inputs).
    pub omit: BTreeSet<String>,
    /// Tensors whose first `n` values are replaced by NaN / +Inf / -Inf in turn.
    pub poison: BTreeMap<String, usize>,
}

impl SynthSpec {
    /// A small model of a family (one to a few MB), 3 shards.
    pub fn tiny(arch: Arch) -> Self {
        // Every GEMM K is a multiple of 128 (so every format, FP8 128x128 blocks included, can
        // take it), except DeepSeek's kv_b (K = kv_lora_rank = 32), which recipes keep BF16.
        let base = SynthSpec {
            arch,
            layers: 4,
            hidden: 128,
            intermediate: 256,
            moe_intermediate: 128,
            shared_intermediate: 128,
            experts: 4,
            top_k: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            vocab: 96,
            first_k_dense: 0,
            q_lora_rank: 0,
            kv_lora_rank: 0,
            qk_nope_head_dim: 0,
            qk_rope_head_dim: 0,
            v_head_dim: 0,
            fp8: None,
            shards: 3,
            seed: 0x6d78_726c,
            omit: BTreeSet::new(),
            poison: BTreeMap::new(),
        };
        match arch {
            Arch::Qwen3Moe | Arch::Qwen2Moe => base,
            // H = 256 so that FP8 128x128 blocks tile the expert weights 1 x 2 / 2 x 1.
            Arch::DeepseekV3 => SynthSpec {
                hidden: 256,
                heads: 2,
                kv_heads: 2,
                head_dim: 0,
                first_k_dense: 1,
                q_lora_rank: 128,
                kv_lora_rank: 32,
                qk_nope_head_dim: 32,
                qk_rope_head_dim: 16,
                v_head_dim: 64,
                ..base
            },
        }
    }

    /// Tensors of the checkpoint in storage order, with their dtype.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let (h, v) = (self.hidden, self.vocab);
        let mut t = Vec::new();
        let bf = |t: &mut Vec<TensorSpec>, n: String, s: Vec<usize>| {
            t.push(TensorSpec::new(n, Dtype::Bf16, s))
        };
        let fp8 = self.fp8.is_some() && self.arch == Arch::DeepseekV3;
        // A linear weight [n, k]: BF16, or F8_E4M3 + its F32 block scales.
        let lin = |t: &mut Vec<TensorSpec>, p: String, n: usize, k: usize| {
            if fp8 {
                t.extend(
                    Layout::Fp8Block
                        .specs(&format!("{p}.weight"), [n, k])
                        .expect("FP8-block takes any [N, K] weight"),
                );
            } else {
                t.push(TensorSpec::new(
                    format!("{p}.weight"),
                    Dtype::Bf16,
                    vec![n, k],
                ));
            }
        };
        bf(&mut t, "model.embed_tokens.weight".into(), vec![v, h]);
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            bf(&mut t, format!("{p}.input_layernorm.weight"), vec![h]);
            match self.arch {
                Arch::Qwen3Moe | Arch::Qwen2Moe => {
                    let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
                    for (name, n) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                        lin(&mut t, format!("{p}.self_attn.{name}"), n, h);
                        if self.arch == Arch::Qwen2Moe {
                            bf(&mut t, format!("{p}.self_attn.{name}.bias"), vec![n]);
                        }
                    }
                    lin(&mut t, format!("{p}.self_attn.o_proj"), h, q);
                    if self.arch == Arch::Qwen3Moe {
                        bf(
                            &mut t,
                            format!("{p}.self_attn.q_norm.weight"),
                            vec![self.head_dim],
                        );
                        bf(
                            &mut t,
                            format!("{p}.self_attn.k_norm.weight"),
                            vec![self.head_dim],
                        );
                    }
                }
                Arch::DeepseekV3 => {
                    let a = format!("{p}.self_attn");
                    let qk = self.qk_nope_head_dim + self.qk_rope_head_dim;
                    lin(&mut t, format!("{a}.q_a_proj"), self.q_lora_rank, h);
                    bf(
                        &mut t,
                        format!("{a}.q_a_layernorm.weight"),
                        vec![self.q_lora_rank],
                    );
                    lin(
                        &mut t,
                        format!("{a}.q_b_proj"),
                        self.heads * qk,
                        self.q_lora_rank,
                    );
                    lin(
                        &mut t,
                        format!("{a}.kv_a_proj_with_mqa"),
                        self.kv_lora_rank + self.qk_rope_head_dim,
                        h,
                    );
                    bf(
                        &mut t,
                        format!("{a}.kv_a_layernorm.weight"),
                        vec![self.kv_lora_rank],
                    );
                    lin(
                        &mut t,
                        format!("{a}.kv_b_proj"),
                        self.heads * (self.qk_nope_head_dim + self.v_head_dim),
                        self.kv_lora_rank,
                    );
                    lin(
                        &mut t,
                        format!("{a}.o_proj"),
                        h,
                        self.heads * self.v_head_dim,
                    );
                }
            }
            bf(
                &mut t,
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
            );
            let m = format!("{p}.mlp");
            if l < self.first_k_dense {
                lin(&mut t, format!("{m}.gate_proj"), self.intermediate, h);
                lin(&mut t, format!("{m}.up_proj"), self.intermediate, h);
                lin(&mut t, format!("{m}.down_proj"), h, self.intermediate);
                continue;
            }
            bf(&mut t, format!("{m}.gate.weight"), vec![self.experts, h]);
            if self.arch == Arch::DeepseekV3 {
                t.push(TensorSpec::new(
                    format!("{m}.gate.e_score_correction_bias"),
                    Dtype::F32,
                    vec![self.experts],
                ));
            }
            let mi = self.moe_intermediate;
            for e in 0..self.experts {
                lin(&mut t, format!("{m}.experts.{e}.gate_proj"), mi, h);
                lin(&mut t, format!("{m}.experts.{e}.up_proj"), mi, h);
                lin(&mut t, format!("{m}.experts.{e}.down_proj"), h, mi);
            }
            let (se, si) = match self.arch {
                Arch::Qwen3Moe => continue,
                Arch::Qwen2Moe => ("shared_expert", self.shared_intermediate),
                Arch::DeepseekV3 => ("shared_experts", self.shared_intermediate),
            };
            lin(&mut t, format!("{m}.{se}.gate_proj"), si, h);
            lin(&mut t, format!("{m}.{se}.up_proj"), si, h);
            lin(&mut t, format!("{m}.{se}.down_proj"), h, si);
            if self.arch == Arch::Qwen2Moe {
                bf(&mut t, format!("{m}.shared_expert_gate.weight"), vec![1, h]);
            }
        }
        bf(&mut t, "model.norm.weight".into(), vec![h]);
        bf(&mut t, "lm_head.weight".into(), vec![v, h]);
        t.retain(|s| !self.omit.contains(&s.name));
        t
    }

    /// The HF `config.json`.
    pub fn config(&self) -> Value {
        let mut c = json!({
            "model_type": self.arch.model_type(),
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "moe_intermediate_size": self.moe_intermediate,
            "num_experts_per_tok": self.top_k,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        });
        let o = c.as_object_mut().expect("object");
        match self.arch {
            Arch::Qwen3Moe => {
                o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
                o.insert("head_dim".into(), json!(self.head_dim));
                o.insert("num_experts".into(), json!(self.experts));
                o.insert("intermediate_size".into(), json!(self.intermediate));
                o.insert("decoder_sparse_step".into(), json!(1));
                o.insert(
                    "mlp_only_layers".into(),
                    json!((0..self.first_k_dense).collect::<Vec<_>>()),
                );
                o.insert("norm_topk_prob".into(), json!(true));
                o.insert("attention_bias".into(), json!(false));
            }
            Arch::Qwen2Moe => {
                o.insert("architectures".into(), json!(["Qwen2MoeForCausalLM"]));
                o.insert("num_experts".into(), json!(self.experts));
                o.insert("intermediate_size".into(), json!(self.intermediate));
                o.insert(
                    "shared_expert_intermediate_size".into(),
                    json!(self.shared_intermediate),
                );
                o.insert("decoder_sparse_step".into(), json!(1));
                o.insert(
                    "mlp_only_layers".into(),
                    json!((0..self.first_k_dense).collect::<Vec<_>>()),
                );
                o.insert("norm_topk_prob".into(), json!(false));
            }
            Arch::DeepseekV3 => {
                o.insert("architectures".into(), json!(["DeepseekV3ForCausalLM"]));
                o.insert("intermediate_size".into(), json!(self.intermediate));
                o.insert("n_routed_experts".into(), json!(self.experts));
                o.insert(
                    "n_shared_experts".into(),
                    json!(self.shared_intermediate / self.moe_intermediate.max(1)),
                );
                o.insert("first_k_dense_replace".into(), json!(self.first_k_dense));
                o.insert("moe_layer_freq".into(), json!(1));
                o.insert("q_lora_rank".into(), json!(self.q_lora_rank));
                o.insert("kv_lora_rank".into(), json!(self.kv_lora_rank));
                o.insert("qk_nope_head_dim".into(), json!(self.qk_nope_head_dim));
                o.insert("qk_rope_head_dim".into(), json!(self.qk_rope_head_dim));
                o.insert("v_head_dim".into(), json!(self.v_head_dim));
                o.insert("n_group".into(), json!(1));
                o.insert("topk_group".into(), json!(1));
                o.insert("routed_scaling_factor".into(), json!(2.5));
                o.insert("scoring_func".into(), json!("sigmoid"));
                o.insert("topk_method".into(), json!("noaux_tc"));
                o.insert("norm_topk_prob".into(), json!(true));
                if self.fp8.is_some() {
                    o.insert(
                        "quantization_config".into(),
                        json!({
                            "activation_scheme": "dynamic",
                            "fmt": "e4m3",
                            "quant_method": "fp8",
                            "weight_block_size": [128, 128]
                        }),
                    );
                }
            }
        }
        c
    }
}

/// What [`write_synthetic`] wrote.
#[derive(Debug, Clone)]
pub struct SynthInfo {
    /// Shard file names in order.
    pub files: Vec<String>,
    /// Expert (gate_proj, up_proj) weight pairs whose halves sit in different shards.
    pub straddling: Vec<(String, String)>,
    /// Total tensor data bytes.
    pub data_bytes: u64,
}

fn rng_for(seed: u64, name: &str) -> ChaCha8Rng {
    let d = Sha256::new()
        .chain_update(seed.to_le_bytes())
        .chain_update(name.as_bytes())
        .finalize();
    ChaCha8Rng::from_seed(d.into())
}

/// Deterministic values of one tensor, as bytes of its dtype.
fn tensor_bytes(spec: &SynthSpec, t: &TensorSpec) -> Vec<u8> {
    let mut rng = rng_for(spec.seed, &t.name);
    let numel: usize = t.shape.iter().product();
    let cols = *t.shape.last().unwrap_or(&1);
    let is_norm = t.name.ends_with("norm.weight") || t.name.ends_with("layernorm.weight");
    let mut out = Vec::with_capacity(t.nbytes());
    match t.dtype {
        Dtype::Bf16 => {
            let mut s = 0.0f32;
            for i in 0..numel {
                if cols > 0 && i % cols == 0 {
                    // Per-row scale 2^[-9, -3], so rows span several binades.
                    s = (-rng.gen_range(3i32..10) as f32).exp2();
                }
                let u: f32 = rng.gen::<f32>() * 2.0 - 1.0;
                let x = if is_norm { 1.0 + 0.125 * u } else { u * s };
                out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        Dtype::F32 if t.name.ends_with("weight_scale_inv") => {
            let pow2 = spec.fp8 == Some(Fp8Scales::PowerOfTwo);
            for _ in 0..numel {
                let e = -rng.gen_range(8i32..13) as f32;
                let m = if pow2 { 1.0 } else { 1.0 + rng.gen::<f32>() };
                out.extend_from_slice(&(e.exp2() * m).to_le_bytes());
            }
        }
        Dtype::F32 => {
            for _ in 0..numel {
                let x = (rng.gen::<f32>() * 2.0 - 1.0) * 0.01;
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Dtype::F8E4m3 => {
            for _ in 0..numel {
                let b: u8 = rng.gen();
                // Any finite e4m3fn code: replace the two NaN codes by ±448.
                out.push(if b & 0x7F == 0x7F { b - 1 } else { b });
            }
        }
        other => unreachable!("synthetic tensors are BF16, F32 or F8_E4M3, not {other}"),
    }
    if let Some(&n) = spec.poison.get(&t.name) {
        let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        for i in 0..n.min(numel) {
            let x = bad[i % 3];
            match t.dtype {
                Dtype::Bf16 => out[2 * i..2 * i + 2]
                    .copy_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
                Dtype::F32 => out[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
                Dtype::F8E4m3 => out[i] = 0x7F,
                _ => {}
            }
        }
    }
    out
}

fn is_expert_gate(name: &str) -> bool {
    name.contains(".mlp.experts.") && name.ends_with(".gate_proj.weight")
}

/// Writes a synthetic checkpoint into `dir` (created if needed): `config.json`, tokenizer and
/// generation files, and the weights (sharded with an index when `spec.shards > 1`).
pub fn write_synthetic(spec: &SynthSpec, dir: &Path) -> Result<SynthInfo> {
    std::fs::create_dir_all(dir).map_err(|e| CkptError::io(dir, "create", e))?;
    let tensors = spec.tensors();
    let n = spec.shards.max(1);
    // Cut points: after roughly 1/n of the bytes, at the next expert gate_proj (and its
    // scale), so that its up_proj starts the next shard.
    let total: usize = tensors.iter().map(|t| t.nbytes()).sum();
    let mut cuts = Vec::new();
    let mut acc = 0usize;
    let mut j = 1;
    let mut i = 0;
    while i < tensors.len() && j < n {
        acc += tensors[i].nbytes();
        if acc * n >= total * j && is_expert_gate(&tensors[i].name) {
            let mut c = i + 1;
            if c < tensors.len() && tensors[c].name.ends_with("weight_scale_inv") {
                c += 1;
            }
            if c < tensors.len() && !cuts.contains(&c) {
                cuts.push(c);
                j += 1;
            }
        }
        i += 1;
    }
    while cuts.len() < n - 1 {
        // Not enough experts late in the model: cut before the final tensors.
        let c = tensors.len() - (n - 1 - cuts.len());
        cuts.push(c.max(cuts.last().copied().unwrap_or(0) + 1));
    }
    let mut bounds = vec![0];
    bounds.extend(cuts);
    bounds.push(tensors.len());

    let files: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n)
            .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = BTreeMap::new();
    let mut shard_of = BTreeMap::new();
    for (k, f) in files.iter().enumerate() {
        let part = &tensors[bounds[k]..bounds[k + 1]];
        let mut w = ShardWriter::create(dir.join(f), part.to_vec(), &meta)?;
        for t in part {
            w.write_tensor(&t.name, &tensor_bytes(spec, t))?;
            weight_map.insert(t.name.clone(), f.clone());
            shard_of.insert(t.name.clone(), k);
        }
        w.finish()?;
    }
    if n > 1 {
        write_json(
            &dir.join(INDEX_FILE),
            &crate::header::index_json(&weight_map, total as u64),
        )?;
    }
    write_json(&dir.join(CONFIG_FILE), &spec.config())?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": true, "temperature": 0.6}),
    )?;
    let vocab: serde_json::Map<String, Value> = (0..spec.vocab)
        .map(|i| (format!("t{i}"), json!(i)))
        .collect();
    write_json(
        &dir.join("tokenizer.json"),
        &json!({"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"model_max_length": 4096, "bos_token": "t1", "eos_token": "t2"}),
    )?;
    let straddling = shard_of
        .iter()
        .filter(|(name, _)| is_expert_gate(name))
        .filter_map(|(g, &sg)| {
            let u = g.replace(".gate_proj.weight", ".up_proj.weight");
            match shard_of.get(&u) {
                Some(&su) if su != sg => Some((g.clone(), u)),
                _ => None,
            }
        })
        .collect();
    Ok(SynthInfo {
        files,
        straddling,
        data_bytes: total as u64,
    })
}
