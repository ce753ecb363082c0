//! Model configuration from a Hugging Face `config.json`.

use crate::error::{ModelError, Result};
use mxrl_plan::{HfConfig, MoeConfig, MoeLayers};
use std::path::Path;

/// `max_position_embeddings` of a Qwen2-MoE or Qwen3-MoE config.json without the field: the
/// default of transformers' `Qwen2MoeConfig` and `Qwen3MoeConfig`.
pub const DEFAULT_MAX_POSITIONS: usize = 32768;

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
    /// Longest sequence (prompt + response, in tokens) the model was built for
    /// (`max_position_embeddings`; transformers' Qwen2-MoE/Qwen3-MoE default
    /// [`DEFAULT_MAX_POSITIONS`] when config.json has none).
    pub max_position_embeddings: usize,
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

impl ModelConfig {
    /// Reads and validates `DIR/config.json` (the shared Hugging Face config type,
    /// [`HfConfig`], then the engine's own limits).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let hf = HfConfig::from_path(&path)?;
        Self::from_hf(&hf, &path.display().to_string())
    }

    /// Parses and validates config.json text; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self> {
        Self::from_hf(&HfConfig::from_json(text, origin)?, origin)
    }

    /// The engine's configuration of a parsed, validated [`HfConfig`]; refuses what the
    /// engine does not run (other architectures, activations, sliding windows, RoPE scaling,
    /// an o_proj bias), naming `origin` and the field.
    pub fn from_hf(hf: &HfConfig, origin: &str) -> Result<Self> {
        let unsupported = |field: &'static str, message: String| ModelError::Unsupported {
            origin: origin.to_string(),
            field,
            message,
        };
        let arch = match hf.arch {
            mxrl_plan::Arch::Qwen3Moe => Arch::Qwen3Moe,
            mxrl_plan::Arch::Qwen2Moe => Arch::Qwen2Moe,
            other => {
                return Err(unsupported(
                    "model_type",
                    format!(
                        "{:?}: the engine runs \"qwen3_moe\" or \"qwen2_moe\"",
                        other.model_type()
                    ),
                ))
            }
        };
        if hf.hidden_act != "silu" {
            return Err(unsupported(
                "hidden_act",
                format!("{:?}: only \"silu\" is supported", hf.hidden_act),
            ));
        }
        if hf.use_sliding_window {
            return Err(unsupported(
                "use_sliding_window",
                "sliding-window attention is not supported".into(),
            ));
        }
        if hf.rope_type != "default" {
            return Err(unsupported(
                "rope_parameters",
                format!(
                    "rope type {:?}: only \"default\" RoPE is supported",
                    hf.rope_type
                ),
            ));
        }
        if hf.o_bias {
            return Err(unsupported(
                "attention_bias",
                "an o_proj bias is not supported".into(),
            ));
        }
        let moe = hf
            .moe
            .as_ref()
            .expect("a validated Qwen MoE config has an MoE part");
        let MoeLayers::Qwen {
            decoder_sparse_step,
            mlp_only_layers,
        } = &moe.layers
        else {
            unreachable!("Qwen MoE layers follow the Qwen rule")
        };
        Ok(ModelConfig {
            arch,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads,
            head_dim: hf.head_dim,
            rope_theta: hf.rope_theta,
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(DEFAULT_MAX_POSITIONS),
            rms_norm_eps: hf.rms_norm_eps as f32,
            intermediate_size: hf.intermediate_size,
            moe_intermediate_size: moe.moe_intermediate_size,
            num_experts: moe.num_experts,
            num_experts_per_tok: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob.unwrap_or(matches!(arch, Arch::Qwen3Moe)),
            decoder_sparse_step: *decoder_sparse_step,
            mlp_only_layers: mlp_only_layers.clone(),
            shared_expert_intermediate_size: moe.shared_intermediate_size,
            qkv_bias: hf.qkv_bias,
            tie_word_embeddings: hf.tie_word_embeddings,
            initializer_range: hf.initializer_range as f32,
            router_aux_loss_coef: hf.router_aux_loss_coef as f32,
        })
    }

    /// The shared Hugging Face config type of this configuration.
    pub fn to_hf(&self) -> HfConfig {
        HfConfig {
            arch: match self.arch {
                Arch::Qwen3Moe => mxrl_plan::Arch::Qwen3Moe,
                Arch::Qwen2Moe => mxrl_plan::Arch::Qwen2Moe,
            },
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_layers,
            num_attention_heads: self.num_heads,
            num_key_value_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate_size,
            qkv_bias: self.qkv_bias,
            o_bias: false,
            mlp_bias: false,
            tie_word_embeddings: self.tie_word_embeddings,
            dtype: "F32".into(),
            rope_theta: self.rope_theta,
            rope_type: "default".into(),
            max_position_embeddings: Some(self.max_position_embeddings),
            rms_norm_eps: self.rms_norm_eps as f64,
            hidden_act: "silu".into(),
            use_sliding_window: false,
            initializer_range: self.initializer_range as f64,
            router_aux_loss_coef: self.router_aux_loss_coef as f64,
            moe: Some(MoeConfig {
                num_experts: self.num_experts,
                num_experts_per_tok: self.num_experts_per_tok,
                moe_intermediate_size: self.moe_intermediate_size,
                norm_topk_prob: Some(self.norm_topk_prob),
                layers: MoeLayers::Qwen {
                    decoder_sparse_step: self.decoder_sparse_step,
                    mlp_only_layers: self.mlp_only_layers.clone(),
                },
                shared_intermediate_size: match self.arch {
                    Arch::Qwen2Moe => self.shared_expert_intermediate_size,
                    Arch::Qwen3Moe => 0,
                },
            }),
            mla: None,
            num_mtp: 0,
        }
    }

    /// Checks a configuration built in code with the same rules as a loaded one
    /// ([`HfConfig::validate`]: positive sizes within bounds, heads divisible, top-k ≤
    /// experts, MoE layer placement, overflow-checked totals).
    pub fn validate(&self) -> Result<()> {
        if self.arch == Arch::Qwen3Moe && self.shared_expert_intermediate_size != 0 {
            return Err(ModelError::Unsupported {
                origin: "<model config>".into(),
                field: "shared_expert_intermediate_size",
                message: "Qwen3-MoE has no shared expert".into(),
            });
        }
        self.to_hf().validate("<model config>")?;
        Ok(())
    }

    /// Whether decoder layer `l` has a sparse MoE block (HF rule:
    /// `l ∉ mlp_only_layers && num_experts > 0 && (l+1) % decoder_sparse_step == 0`).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l)
            && self.num_experts > 0
            && (l + 1).is_multiple_of(self.decoder_sparse_step)
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
            "max_position_embeddings": self.max_position_embeddings,
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
    /// 8 experts top-2 (F = 32), 4 query / 2 kv heads of width 16, 4096 positions.
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
            max_position_embeddings: 4096,
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
