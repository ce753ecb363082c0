//! The one Hugging Face `config.json` type: every architecture mxrl knows, as transformers
//! 4.x and 5.x write it, parsed with serde and validated once.
//!
//! Spellings accepted for the same value (a config that gives both with different values is
//! an error):
//!
//! | value | transformers 4.x | transformers 5.x |
//! |---|---|---|
//! | routed experts (Qwen MoE) | `num_experts` | `num_local_experts` (Qwen3-MoE) or `num_experts` |
//! | routed experts (DeepSeek-V3) | `n_routed_experts` | `n_routed_experts` or `num_local_experts` |
//! | RoPE base | `rope_theta` | `rope_parameters.rope_theta` |
//! | RoPE kind | `rope_scaling.type` / `.rope_type` | `rope_parameters.rope_type` |
//! | weight dtype | `torch_dtype` | `dtype` (may be `null`) |
//!
//! [`HfConfig::validate`] holds the rules every consumer relies on — the inventory, the
//! converter and verifier, the model — so they accept and reject the same files: positive
//! sizes within sane upper bounds ([`Limits`]), key/value heads dividing query heads, an even
//! head width, `decoder_sparse_step ≥ 1`, `mlp_only_layers` inside the model, top-k within
//! the expert count, and a parameter and tensor count computed with overflow checks and
//! bounded, so that no later step allocates or loops without bound on a hostile file.

// `x % n == 0` rather than `is_multiple_of` (stable only since 1.87; rust-version is 1.85).
#![allow(clippy::manual_is_multiple_of)]

use crate::error::PlanError;
use crate::inventory::Arch;
use serde::Deserialize;
use std::path::Path;

/// Largest `config.json` read (bytes); real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Upper bounds a valid configuration stays within (each well above every published model).
#[derive(Debug, Clone, Copy)]
pub struct Limits;

impl Limits {
    /// `vocab_size` ≤ 2²² (largest published vocabularies are ~2.6·10⁵).
    pub const VOCAB: usize = 1 << 22;
    /// `hidden_size`, intermediate sizes and MLA ranks ≤ 2¹⁸.
    pub const WIDTH: usize = 1 << 18;
    /// `num_hidden_layers` ≤ 1024.
    pub const LAYERS: usize = 1024;
    /// Attention heads (query or key/value) ≤ 1024.
    pub const HEADS: usize = 1024;
    /// Head width ≤ 4096.
    pub const HEAD_DIM: usize = 4096;
    /// Routed experts ≤ 4096.
    pub const EXPERTS: usize = 4096;
    /// MTP modules ≤ 16.
    pub const MTP: usize = 16;
    /// Total parameters ≤ 2⁴⁴ (~1.8·10¹³).
    pub const PARAMS: u64 = 1 << 44;
    /// Tensors in the checkpoint ≤ 2²⁰.
    pub const TENSORS: u64 = 1 << 20;
    /// `max_position_embeddings` ≤ 2²⁴ (largest published contexts are ~10⁷ tokens).
    pub const POSITIONS: usize = 1 << 24;
}

/// How a Qwen-style or DeepSeek-style model places its MoE layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoeLayers {
    /// Qwen2/3-MoE: layer `l` is MoE iff `l ∉ mlp_only_layers` and
    /// `(l + 1) % decoder_sparse_step == 0`.
    Qwen {
        /// `decoder_sparse_step` (≥ 1).
        decoder_sparse_step: usize,
        /// `mlp_only_layers` (each < `num_hidden_layers`).
        mlp_only_layers: Vec<usize>,
    },
    /// DeepSeek-V3: layer `l` is MoE iff `l ≥ first_k_dense_replace` and
    /// `l % moe_layer_freq == 0`.
    DeepSeek {
        /// `first_k_dense_replace`.
        first_k_dense_replace: usize,
        /// `moe_layer_freq` (≥ 1).
        moe_layer_freq: usize,
    },
}

/// The mixture-of-experts part of a configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts `E` (0: every layer dense).
    pub num_experts: usize,
    /// Experts per token `k`.
    pub num_experts_per_tok: usize,
    /// Intermediate size of one routed expert.
    pub moe_intermediate_size: usize,
    /// Renormalize the top-k probabilities (`norm_topk_prob`; `None` when absent, each
    /// consumer applies its architecture's default).
    pub norm_topk_prob: Option<bool>,
    /// Which layers are MoE.
    pub layers: MoeLayers,
    /// Intermediate size of the shared expert(s) (Qwen2-MoE
    /// `shared_expert_intermediate_size`; DeepSeek `n_shared_experts × moe_intermediate_size`;
    /// 0 = none).
    pub shared_intermediate_size: usize,
}

/// DeepSeek-V3 multi-head latent attention sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaConfig {
    /// `q_lora_rank` (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
}

/// A parsed and validated Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// Architecture (`model_type`).
    pub arch: Arch,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers` (MTP modules not counted).
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (default: `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// `head_dim` (default: `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `intermediate_size` of dense MLP layers (0 when absent).
    pub intermediate_size: usize,
    /// Biases on q/k/v (Qwen2 / Qwen2-MoE: `qkv_bias`, default true; else `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (`attention_bias` except for Qwen2 / Qwen2-MoE, which have none).
    pub o_bias: bool,
    /// Biases on dense MLP projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// `tie_word_embeddings` (default false).
    pub tie_word_embeddings: bool,
    /// Weight dtype as safetensors spells it (`torch_dtype` / `dtype`; default `BF16`).
    pub dtype: String,
    /// RoPE base θ (default 10000).
    pub rope_theta: f64,
    /// RoPE kind (`default`, `yarn`, `llama3`, ...).
    pub rope_type: String,
    /// `max_position_embeddings`: the longest sequence (prompt + response) the model was
    /// built for (`None` when absent; each consumer applies its architecture's transformers
    /// default).
    pub max_position_embeddings: Option<usize>,
    /// `rms_norm_eps` (default 1e-6).
    pub rms_norm_eps: f64,
    /// `hidden_act` (default `silu`).
    pub hidden_act: String,
    /// `use_sliding_window` (default false).
    pub use_sliding_window: bool,
    /// `initializer_range` (default 0.02).
    pub initializer_range: f64,
    /// `router_aux_loss_coef` (default 0.001).
    pub router_aux_loss_coef: f64,
    /// The MoE part (`None` for dense architectures).
    pub moe: Option<MoeConfig>,
    /// MLA sizes (DeepSeek-V3).
    pub mla: Option<MlaConfig>,
    /// MTP modules (`num_nextn_predict_layers`, DeepSeek-V3).
    pub num_mtp: usize,
}

#[derive(Deserialize, Default)]
struct RawRope {
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

/// The fields of `config.json` mxrl reads, in the spellings of transformers 4.x and 5.x.
#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    attention_bias: Option<bool>,
    qkv_bias: Option<bool>,
    mlp_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    initializer_range: Option<f64>,
    router_aux_loss_coef: Option<f64>,
    // Qwen MoE
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    // DeepSeek-V3
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    num_nextn_predict_layers: Option<usize>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
}

struct Ctx<'a> {
    origin: &'a str,
}

impl Ctx<'_> {
    fn err(&self, field: &str, message: impl std::fmt::Display) -> PlanError {
        PlanError::Config {
            origin: self.origin.to_string(),
            message: format!("field `{field}`: {message}"),
        }
    }
    fn req(&self, v: Option<usize>, field: &str) -> Result<usize, PlanError> {
        v.ok_or_else(|| self.err(field, "missing (an integer is required)"))
    }
    /// One value under two spellings; both given with different values is an error.
    fn either<T: PartialEq + std::fmt::Debug + Clone>(
        &self,
        a: (&Option<T>, &str),
        b: (&Option<T>, &str),
    ) -> Result<Option<T>, PlanError> {
        match (a.0, b.0) {
            (Some(x), Some(y)) if x != y => Err(self.err(
                a.1,
                format!("{x:?} disagrees with `{}` = {y:?} (the same value)", b.1),
            )),
            (Some(x), _) => Ok(Some(x.clone())),
            (None, y) => Ok(y.clone()),
        }
    }
    fn bound(&self, field: &str, v: usize, lo: usize, hi: usize) -> Result<(), PlanError> {
        if v < lo || v > hi {
            return Err(self.err(field, format!("{v} is outside {lo}..={hi}")));
        }
        Ok(())
    }
}

impl HfConfig {
    /// Reads and validates a `config.json` file (at most [`MAX_CONFIG_BYTES`]).
    pub fn from_path(path: &Path) -> Result<HfConfig, PlanError> {
        use std::io::Read;
        let io = |source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        let mut text = String::new();
        f.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(PlanError::Config {
                origin: path.display().to_string(),
                message: format!("larger than {MAX_CONFIG_BYTES} bytes"),
            });
        }
        HfConfig::from_json(&text, &path.display().to_string())
    }

    /// Parses and validates `config.json` text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<HfConfig, PlanError> {
        let c = Ctx { origin };
        let de = &mut serde_json::Deserializer::from_str(text);
        let raw: Raw = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() || path == "." {
                PlanError::Config {
                    origin: origin.to_string(),
                    message: format!("not valid JSON: {inner}"),
                }
            } else {
                c.err(&path, inner)
            }
        })?;
        let model_type = raw
            .model_type
            .as_deref()
            .ok_or_else(|| c.err("model_type", "missing (a string is required)"))?;
        let arch = Arch::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type)
            .ok_or_else(|| PlanError::UnsupportedArch {
                origin: origin.to_string(),
                model_type: model_type.to_string(),
                supported: Arch::ALL.map(|a| a.model_type()).join(", "),
            })?;
        let hidden_size = c.req(raw.hidden_size, "hidden_size")?;
        let num_hidden_layers = c.req(raw.num_hidden_layers, "num_hidden_layers")?;
        let vocab_size = c.req(raw.vocab_size, "vocab_size")?;
        let heads = c.req(raw.num_attention_heads, "num_attention_heads")?;
        c.bound("num_attention_heads", heads, 1, Limits::HEADS)?;
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if arch == Arch::DeepseekV3 => 0,
            None if hidden_size % heads == 0 => hidden_size / heads,
            None => {
                return Err(c.err(
                    "head_dim",
                    format!(
                        "not given and hidden_size {hidden_size} is not a multiple of num_attention_heads {heads}"
                    ),
                ))
            }
        };
        let dtype_name = c
            .either((&raw.torch_dtype, "torch_dtype"), (&raw.dtype, "dtype"))?
            .unwrap_or_else(|| "bfloat16".into());
        let dtype = match dtype_name.as_str() {
            "bfloat16" => "BF16",
            "float16" => "F16",
            "float32" => "F32",
            other => {
                return Err(c.err(
                    if raw.torch_dtype.is_some() {
                        "torch_dtype"
                    } else {
                        "dtype"
                    },
                    format!("unsupported `{other}` (bfloat16, float16 or float32)"),
                ))
            }
        }
        .to_string();
        let rope_params = raw.rope_parameters.as_ref();
        let rope_theta = c
            .either(
                (&raw.rope_theta, "rope_theta"),
                (
                    &rope_params.and_then(|r| r.rope_theta),
                    "rope_parameters.rope_theta",
                ),
            )?
            .unwrap_or(10000.0);
        let mut rope_type = "default".to_string();
        for r in [raw.rope_scaling.as_ref(), rope_params]
            .into_iter()
            .flatten()
        {
            if let Some(t) = r.rope_type.as_ref().or(r.kind.as_ref()) {
                rope_type = t.clone();
            }
        }
        let qwen2 = matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe);
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let moe = match arch {
            Arch::Qwen2Moe | Arch::Qwen3Moe => {
                let experts = c
                    .either(
                        (&raw.num_experts, "num_experts"),
                        (&raw.num_local_experts, "num_local_experts"),
                    )?
                    .ok_or_else(|| {
                        c.err(
                            "num_experts",
                            "missing (transformers 5 writes it as `num_local_experts`)",
                        )
                    })?;
                Some(MoeConfig {
                    num_experts: experts,
                    num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(0),
                    moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(0),
                    norm_topk_prob: raw.norm_topk_prob,
                    layers: MoeLayers::Qwen {
                        decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
                        mlp_only_layers: raw.mlp_only_layers.clone().unwrap_or_default(),
                    },
                    shared_intermediate_size: if arch == Arch::Qwen2Moe {
                        raw.shared_expert_intermediate_size.unwrap_or(0)
                    } else {
                        0
                    },
                })
            }
            Arch::DeepseekV3 => {
                let routed = c
                    .either(
                        (&raw.n_routed_experts, "n_routed_experts"),
                        (&raw.num_local_experts, "num_local_experts"),
                    )?
                    .ok_or_else(|| c.err("n_routed_experts", "missing"))?;
                let moe_inter = c.req(raw.moe_intermediate_size, "moe_intermediate_size")?;
                let shared = raw.n_shared_experts.unwrap_or(0);
                c.bound("n_shared_experts", shared, 0, Limits::EXPERTS)?;
                c.bound("moe_intermediate_size", moe_inter, 0, Limits::WIDTH)?;
                Some(MoeConfig {
                    num_experts: routed,
                    num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(0),
                    moe_intermediate_size: moe_inter,
                    norm_topk_prob: raw.norm_topk_prob,
                    layers: MoeLayers::DeepSeek {
                        first_k_dense_replace: raw.first_k_dense_replace.unwrap_or(0),
                        moe_layer_freq: raw.moe_layer_freq.unwrap_or(1),
                    },
                    shared_intermediate_size: shared * moe_inter,
                })
            }
            _ => None,
        };
        let mla = if arch == Arch::DeepseekV3 {
            Some(MlaConfig {
                q_lora_rank: raw.q_lora_rank,
                kv_lora_rank: c.req(raw.kv_lora_rank, "kv_lora_rank")?,
                qk_nope_head_dim: c.req(raw.qk_nope_head_dim, "qk_nope_head_dim")?,
                qk_rope_head_dim: c.req(raw.qk_rope_head_dim, "qk_rope_head_dim")?,
                v_head_dim: c.req(raw.v_head_dim, "v_head_dim")?,
            })
        } else {
            None
        };
        let intermediate_size = match arch {
            Arch::Qwen2Moe | Arch::Qwen3Moe => raw.intermediate_size.unwrap_or(0),
            _ => c.req(raw.intermediate_size, "intermediate_size")?,
        };
        let cfg = HfConfig {
            arch,
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(heads),
            head_dim,
            intermediate_size,
            qkv_bias: if qwen2 {
                raw.qkv_bias.unwrap_or(true)
            } else {
                attention_bias
            },
            o_bias: !qwen2 && attention_bias,
            mlp_bias: arch == Arch::Llama && raw.mlp_bias.unwrap_or(false),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            dtype,
            rope_theta,
            rope_type,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            hidden_act: raw.hidden_act.clone().unwrap_or_else(|| "silu".into()),
            use_sliding_window: raw.use_sliding_window.unwrap_or(false),
            initializer_range: raw.initializer_range.unwrap_or(0.02),
            router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001),
            moe,
            mla,
            num_mtp: if arch == Arch::DeepseekV3 {
                raw.num_nextn_predict_layers.unwrap_or(0)
            } else {
                0
            },
        };
        cfg.check(&c)?;
        Ok(cfg)
    }

    /// Re-checks the rules of a configuration built or edited in code; `origin` names it.
    pub fn validate(&self, origin: &str) -> Result<(), PlanError> {
        self.check(&Ctx { origin })
    }

    fn check(&self, c: &Ctx<'_>) -> Result<(), PlanError> {
        c.bound("vocab_size", self.vocab_size, 1, Limits::VOCAB)?;
        c.bound("hidden_size", self.hidden_size, 1, Limits::WIDTH)?;
        c.bound(
            "num_hidden_layers",
            self.num_hidden_layers,
            1,
            Limits::LAYERS,
        )?;
        c.bound(
            "num_attention_heads",
            self.num_attention_heads,
            1,
            Limits::HEADS,
        )?;
        c.bound(
            "intermediate_size",
            self.intermediate_size,
            0,
            Limits::WIDTH,
        )?;
        if let Some(p) = self.max_position_embeddings {
            c.bound("max_position_embeddings", p, 1, Limits::POSITIONS)?;
        }
        if let Some(m) = &self.mla {
            if let Some(r) = m.q_lora_rank {
                c.bound("q_lora_rank", r, 1, Limits::WIDTH)?;
            }
            c.bound("kv_lora_rank", m.kv_lora_rank, 1, Limits::WIDTH)?;
            c.bound("qk_nope_head_dim", m.qk_nope_head_dim, 0, Limits::HEAD_DIM)?;
            c.bound("qk_rope_head_dim", m.qk_rope_head_dim, 2, Limits::HEAD_DIM)?;
            if m.qk_rope_head_dim % 2 != 0 {
                return Err(c.err(
                    "qk_rope_head_dim",
                    format!("{} must be even", m.qk_rope_head_dim),
                ));
            }
            c.bound("v_head_dim", m.v_head_dim, 1, Limits::HEAD_DIM)?;
            c.bound("num_nextn_predict_layers", self.num_mtp, 0, Limits::MTP)?;
        } else {
            c.bound(
                "num_key_value_heads",
                self.num_key_value_heads,
                1,
                Limits::HEADS,
            )?;
            if self.num_attention_heads % self.num_key_value_heads != 0 {
                return Err(c.err(
                    "num_key_value_heads",
                    format!(
                        "{} must divide num_attention_heads {}",
                        self.num_key_value_heads, self.num_attention_heads
                    ),
                ));
            }
            c.bound("head_dim", self.head_dim, 2, Limits::HEAD_DIM)?;
            if self.head_dim % 2 != 0 {
                return Err(c.err(
                    "head_dim",
                    format!("{} must be even (RoPE rotates pairs)", self.head_dim),
                ));
            }
        }
        if let Some(m) = &self.moe {
            let experts_field = if self.arch == Arch::DeepseekV3 {
                "n_routed_experts"
            } else {
                "num_experts"
            };
            c.bound(experts_field, m.num_experts, 0, Limits::EXPERTS)?;
            c.bound(
                "moe_intermediate_size",
                m.moe_intermediate_size,
                0,
                Limits::WIDTH,
            )?;
            c.bound(
                "shared_expert_intermediate_size",
                m.shared_intermediate_size,
                0,
                Limits::WIDTH,
            )?;
            match &m.layers {
                MoeLayers::Qwen {
                    decoder_sparse_step,
                    mlp_only_layers,
                } => {
                    if *decoder_sparse_step == 0 {
                        return Err(c.err("decoder_sparse_step", "0 must be ≥ 1"));
                    }
                    if let Some(&l) = mlp_only_layers
                        .iter()
                        .find(|&&l| l >= self.num_hidden_layers)
                    {
                        return Err(c.err(
                            "mlp_only_layers",
                            format!("layer {l} ≥ num_hidden_layers {}", self.num_hidden_layers),
                        ));
                    }
                }
                MoeLayers::DeepSeek { moe_layer_freq, .. } => {
                    if *moe_layer_freq == 0 {
                        return Err(c.err("moe_layer_freq", "0 must be ≥ 1"));
                    }
                }
            }
        }
        let any_moe = (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l));
        let any_dense = (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l));
        if let (true, Some(m)) = (any_moe, &self.moe) {
            if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
                return Err(c.err(
                    "num_experts_per_tok",
                    format!("{} must be in 1..={}", m.num_experts_per_tok, m.num_experts),
                ));
            }
            if m.moe_intermediate_size == 0 {
                return Err(c.err(
                    "moe_intermediate_size",
                    "must be positive (MoE layers exist)",
                ));
            }
        }
        if any_dense && self.intermediate_size == 0 {
            return Err(c.err("intermediate_size", "must be positive (dense layers exist)"));
        }
        let (params, tensors) = self
            .counts()
            .ok_or_else(|| c.err("num_hidden_layers", "the parameter count overflows"))?;
        if params > Limits::PARAMS {
            return Err(c.err(
                "num_hidden_layers",
                format!(
                    "the sizes imply {params} parameters, more than the limit {}",
                    Limits::PARAMS
                ),
            ));
        }
        if tensors > Limits::TENSORS {
            return Err(c.err(
                "num_hidden_layers",
                format!(
                    "the sizes imply {tensors} tensors, more than the limit {}",
                    Limits::TENSORS
                ),
            ));
        }
        Ok(())
    }

    /// Whether decoder layer `l` has a sparse MoE block (the architecture's HF rule).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        let Some(m) = &self.moe else { return false };
        if m.num_experts == 0 {
            return false;
        }
        match &m.layers {
            MoeLayers::Qwen {
                decoder_sparse_step,
                mlp_only_layers,
            } => {
                *decoder_sparse_step > 0
                    && !mlp_only_layers.contains(&l)
                    && (l + 1) % decoder_sparse_step == 0
            }
            MoeLayers::DeepSeek {
                first_k_dense_replace,
                moe_layer_freq,
            } => *moe_layer_freq > 0 && l >= *first_k_dense_replace && l % moe_layer_freq == 0,
        }
    }

    /// `(parameters, tensors)` the configuration implies, `None` on overflow (an upper
    /// estimate: biases and norms included).
    pub fn counts(&self) -> Option<(u64, u64)> {
        let u = |x: usize| x as u64;
        let h = u(self.hidden_size);
        let mlp = |inter: u64| -> Option<u64> { h.checked_mul(inter)?.checked_mul(3) };
        let attn: u64 = match &self.mla {
            Some(m) => {
                let qk = u(m.qk_nope_head_dim) + u(m.qk_rope_head_dim);
                let heads = u(self.num_attention_heads);
                let q = match m.q_lora_rank {
                    Some(r) => u(r)
                        .checked_mul(h)?
                        .checked_add(u(r).checked_mul(heads.checked_mul(qk)?)?)?,
                    None => heads.checked_mul(qk)?.checked_mul(h)?,
                };
                let kv_a = (u(m.kv_lora_rank) + u(m.qk_rope_head_dim)).checked_mul(h)?;
                let kv_b = heads
                    .checked_mul(u(m.qk_nope_head_dim) + u(m.v_head_dim))?
                    .checked_mul(u(m.kv_lora_rank))?;
                let o = heads.checked_mul(u(m.v_head_dim))?.checked_mul(h)?;
                q.checked_add(kv_a)?.checked_add(kv_b)?.checked_add(o)?
            }
            None => {
                let q = u(self.num_attention_heads).checked_mul(u(self.head_dim))?;
                let kv = u(self.num_key_value_heads).checked_mul(u(self.head_dim))?;
                q.checked_mul(2)?
                    .checked_add(kv.checked_mul(2)?)?
                    .checked_mul(h)?
                    .checked_add(q.checked_add(kv.checked_mul(2)?)?)?
            }
        };
        let dense = mlp(u(self.intermediate_size))?;
        let (moe_params, moe_tensors) = match &self.moe {
            Some(m) => {
                let e = u(m.num_experts);
                let p = e
                    .checked_mul(mlp(u(m.moe_intermediate_size))?)?
                    .checked_add(e.checked_mul(h)?)?
                    .checked_add(mlp(u(m.shared_intermediate_size))?)?
                    .checked_add(h)?;
                (p, e.checked_mul(3)? + 8)
            }
            None => (0, 0),
        };
        let layers = u(self.num_hidden_layers) + u(self.num_mtp);
        let per_layer = attn
            .checked_add(dense.max(moe_params))?
            .checked_add(h.checked_mul(4)?)?;
        let embed = u(self.vocab_size).checked_mul(h)?;
        let params = layers
            .checked_mul(per_layer)?
            .checked_add(embed.checked_mul(2 + u(self.num_mtp))?)?;
        let tensors = layers.checked_mul(20 + moe_tensors)?.checked_add(4)?;
        Some((params, tensors))
    }
}
