//! Configurations shared by the model's integration tests.

use mxrl_model::{Arch, ModelConfig};

/// Qwen3-MoE (untied, GQA, q/k norms) and Qwen2-MoE without a shared expert (q/k/v bias, tied
/// embeddings); both with a dense layer between MoE layers.
pub fn small(arch: Arch) -> ModelConfig {
    let mut c = ModelConfig::tiny();
    c.arch = arch;
    c.vocab_size = 40;
    c.hidden_size = 32;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 24;
    c.moe_intermediate_size = 16;
    c.num_experts = 6;
    c.num_experts_per_tok = 2;
    c.mlp_only_layers = vec![1];
    c.initializer_range = 0.3;
    if arch == Arch::Qwen2Moe {
        c.qkv_bias = true;
        c.tie_word_embeddings = true;
        c.norm_topk_prob = false;
    }
    c
}
