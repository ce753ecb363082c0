//! Model configurations shared by the examples.

use mxrl_model::{Arch, ModelConfig};

/// `tiny` ([`ModelConfig::tiny`]) or `20m` (a ~20M-parameter Qwen3-MoE: hidden 256, 6 layers,
/// 16 experts top-2, vocab 4096).
pub fn config(name: &str) -> ModelConfig {
    match name {
        "tiny" => ModelConfig::tiny(),
        "20m" => {
            let mut c = ModelConfig::tiny();
            c.arch = Arch::Qwen3Moe;
            c.vocab_size = 4096;
            c.hidden_size = 256;
            c.num_layers = 6;
            c.num_heads = 8;
            c.num_kv_heads = 4;
            c.head_dim = 32;
            c.num_experts = 16;
            c.num_experts_per_tok = 2;
            c.moe_intermediate_size = 256;
            c
        }
        other => panic!("unknown config {other:?}: use tiny or 20m"),
    }
}
