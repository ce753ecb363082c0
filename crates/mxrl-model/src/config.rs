//! Model configuration from a Hugging Face `config.json`.

use crate::error::{ModelError, Result};
use serde::Deserialize;
use std::path::Path;

/// Supported architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `Qwen3MoeForCausalLM` (`model_type = "qwen3_moe"`): q/k RMSNorm, no shared expert.
    Qwen3Moe,
    /// `Qwen2MoeForCausalLM` (`model_type = "qwen2_moe"`): q/k/v bias, shared expert with a
    /// sigmoid gate.
    Qwen2Moe,
}

/// The validated model configuration the engine runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Hidden size `H`.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads `Hq`.
    pub num_heads: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub num_kv_heads: usize,
    /// Head width `D`.
    pub head_dim: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// RMSNorm ε.
    pub rms_norm_eps: f32,
    /// Intermediate size of dense MLP layers.
    pub intermediate_size: usize,
    /// Intermediate size `F` of each routed expert.
    pub moe_intermediate_size: usize,
    /// Routed experts `E` (0: all layers dense).
    pub num_experts: usize,
    /// Experts per token `k`.
    pub num_experts_per_tok: usize,
    /// Renormalize the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (HF: `(i+1) % step == 0`).
    pub decoder_sparse_step: usize,
    /// Layers forced dense.
    pub mlp_only_layers: Vec<usize>,
    /// Intermediate size of the shared expert (Qwen2-MoE; 0 = none).
    pub shared_expert_intermediate_size: usize,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Std of the normal initializer.
    pub initializer_range: f32,
    /// Coefficient of the router auxiliary loss in HF (informational; the caller chooses).
    pub router_aux_loss_coef: f32,
}

#[derive(Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    rms_norm_eps: Option<f64>,
    intermediate_size: Option<usize>,
    moe_intermediate_size: Option<usize>,
    num_experts: Option<usize>,
    /// transformers ≥ 5 writes `num_experts` of Qwen3-MoE as `num_local_experts`.
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    qkv_bias: Option<bool>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
    initializer_range: Option<f64>,
    router_aux_loss_coef: Option<f64>,
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
}

fn need<T>(v: Option<T>, field: &'static str) -> Result<T> {
    v.ok_or(ModelError::Config {
        field,
        message: "missing".into(),
    })
}

impl ModelConfig {
    /// Reads and validates `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Parses and validates config.json text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        let raw: Raw = serde_json::from_str(text).map_err(|source| ModelError::ConfigJson {
            origin: origin.to_string(),
            source,
        })?;
        let arch = match raw.model_type.as_deref() {
            Some("qwen3_moe") => Arch::Qwen3Moe,
            Some("qwen2_moe") => Arch::Qwen2Moe,
            other => {
                return Err(ModelError::Config {
                    field: "model_type",
                    message: format!("{other:?}: expected \"qwen3_moe\" or \"qwen2_moe\""),
                })
            }
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(ModelError::Config {
                    field: "hidden_act",
                    message: format!("{act:?}: only \"silu\" is supported"),
                });
            }
        }
        if raw.use_sliding_window == Some(true) {
            return Err(ModelError::Config {
                field: "use_sliding_window",
                message: "sliding-window attention is not supported".into(),
            });
        }
        for (field, rope) in [
            ("rope_scaling", &raw.rope_scaling),
            ("rope_parameters", &raw.rope_parameters),
        ] {
            if let Some(r) = rope {
                let t = r
                    .rope_type
                    .as_deref()
                    .or(r.kind.as_deref())
                    .unwrap_or("default");
                if t != "default" {
                    return Err(ModelError::Config {
                        field,
                        message: format!("rope type {t:?}: only \"default\" RoPE is supported"),
                    });
                }
            }
        }
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        let head_dim = raw.head_dim.unwrap_or(hidden_size / num_heads.max(1));
        let rope_theta = raw
            .rope_theta
            .or(raw.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10000.0);
        let num_experts = raw.num_experts.or(raw.num_local_experts).unwrap_or(0);
        let cfg = ModelConfig {
            arch,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            intermediate_size: raw.intermediate_size.unwrap_or(0),
            moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(0),
            num_experts,
            num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(0),
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(matches!(arch, Arch::Qwen3Moe)),
            decoder_sparse_step: raw.decoder_sparse_step.unwrap_or(1),
            mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
            shared_expert_intermediate_size: match arch {
                Arch::Qwen2Moe => raw.shared_expert_intermediate_size.unwrap_or(0),
                Arch::Qwen3Moe => 0,
            },
            qkv_bias: match arch {
                Arch::Qwen2Moe => raw.qkv_bias.unwrap_or(true),
                Arch::Qwen3Moe => raw.attention_bias.unwrap_or(false),
            },
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            initializer_range: raw.initializer_range.unwrap_or(0.02) as f32,
            router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001) as f32,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks internal consistency (sizes positive, heads divisible, top-k ≤ experts).
    pub fn validate(&self) -> Result<()> {
        let bad = |field, message: String| Err(ModelError::Config { field, message });
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_layers == 0 {
            return bad(
                "vocab_size/hidden_size/num_hidden_layers",
                "must be positive".into(),
            );
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0
        {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} must be positive and divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            );
        }
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return bad(
                "head_dim",
                format!("{} must be positive and even", self.head_dim),
            );
        }
        if self.decoder_sparse_step == 0 {
            return bad("decoder_sparse_step", "must be ≥ 1".into());
        }
        if let Some(&l) = self.mlp_only_layers.iter().find(|&&l| l >= self.num_layers) {
            return bad(
                "mlp_only_layers",
                format!("layer {l} ≥ num_hidden_layers {}", self.num_layers),
            );
        }
        let any_moe = (0..self.num_layers).any(|l| self.is_moe_layer(l));
        let any_dense = (0..self.num_layers).any(|l| !self.is_moe_layer(l));
        if any_moe {
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                return bad(
                    "num_experts_per_tok",
                    format!(
                        "{} must be in 1..={}",
                        self.num_experts_per_tok, self.num_experts
                    ),
                );
            }
            if self.moe_intermediate_size == 0 {
                return bad("moe_intermediate_size", "must be positive".into());
            }
        }
        if any_dense && self.intermediate_size == 0 {
            return bad(
                "intermediate_size",
                "must be positive (dense layers exist)".into(),
            );
        }
        Ok(())
    }

    /// Whether decoder layer `l` has a sparse MoE block (HF rule:
    /// `l ∉ mlp_only_layers && num_experts > 0 && (l+1) % decoder_sparse_step == 0`).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l)
            && self.num_experts > 0
            && (l + 1) % self.decoder_sparse_step == 0
    }

    /// A config.json text for this configuration (HF field names), e.g. for saving a random model.
    pub fn to_json(&self) -> String {
        let model_type = match self.arch {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen2Moe => "qwen2_moe",
        };
        let arch = match self.arch {
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
        };
        let mut v = serde_json::json!({
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps as f64,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": self.mlp_only_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range as f64,
            "router_aux_loss_coef": self.router_aux_loss_coef as f64,
            "hidden_act": "silu",
        });
        let o = v.as_object_mut().expect("object literal");
        match self.arch {
            Arch::Qwen2Moe => {
                o.insert("qkv_bias".into(), self.qkv_bias.into());
                o.insert(
                    "shared_expert_intermediate_size".into(),
                    self.shared_expert_intermediate_size.into(),
                );
            }
            Arch::Qwen3Moe => {
                o.insert("attention_bias".into(), self.qkv_bias.into());
            }
        }
        serde_json::to_string_pretty(&v).expect("json values serialize")
    }

    /// The tiny MoE used by tests and the CPU RL demo: vocab 32, hidden 64, 4 layers,
    /// 8 experts top-2 (F = 32), 4 query / 2 kv heads of width 16.
    pub fn tiny() -> Self {
        ModelConfig {
            arch: Arch::Qwen3Moe,
            vocab_size: 32,
            hidden_size: 64,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
            intermediate_size: 128,
            moe_intermediate_size: 32,
            num_experts: 8,
            num_experts_per_tok: 2,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            shared_expert_intermediate_size: 0,
            qkv_bias: false,
            tie_word_embeddings: false,
            initializer_range: 0.02,
            router_aux_loss_coef: 0.001,
        }
    }
}
