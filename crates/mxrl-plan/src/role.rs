//! Typed tensor roles and MLP projections.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What a tensor does in the model. Recipes select tensors by role instead of by name
/// fragments, so a role can never match a tensor of another kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Token embedding table.
    Embedding,
    /// Output projection to the vocabulary.
    LmHead,
    /// Any RMSNorm / LayerNorm weight (layer norms, q/k norms, MLA latent norms, final norm).
    Norm,
    /// Attention query projection (and its bias).
    AttnQ,
    /// Attention key projection (and its bias).
    AttnK,
    /// Attention value projection (and its bias).
    AttnV,
    /// Attention output projection.
    AttnO,
    /// MLA query down-projection (`q_a_proj`).
    MlaQA,
    /// MLA query up-projection (`q_b_proj`).
    MlaQB,
    /// MLA joint KV down-projection (`kv_a_proj_with_mqa`).
    MlaKvA,
    /// MLA KV up-projection (`kv_b_proj`).
    MlaKvB,
    /// MoE router (gate) weight and its score-correction bias.
    Router,
    /// A routed expert's gate/up/down projection.
    RoutedExpert,
    /// A shared (always active) expert's gate/up/down projection.
    SharedExpert,
    /// The sigmoid gate of a shared expert (Qwen2-MoE).
    SharedExpertGate,
    /// A dense (non-MoE) MLP gate/up/down projection.
    DenseMlp,
    /// Any tensor of a multi-token-prediction module (DeepSeek-V3 MTP).
    Mtp,
}

impl Role {
    /// All roles, in a stable order.
    pub const ALL: [Role; 17] = [
        Role::Embedding,
        Role::LmHead,
        Role::Norm,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnO,
        Role::MlaQA,
        Role::MlaQB,
        Role::MlaKvA,
        Role::MlaKvB,
        Role::Router,
        Role::RoutedExpert,
        Role::SharedExpert,
        Role::SharedExpertGate,
        Role::DenseMlp,
        Role::Mtp,
    ];

    /// The recipe spelling of the role.
    pub fn name(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::LmHead => "lm_head",
            Role::Norm => "norm",
            Role::AttnQ => "attn_q",
            Role::AttnK => "attn_k",
            Role::AttnV => "attn_v",
            Role::AttnO => "attn_o",
            Role::MlaQA => "mla_q_a",
            Role::MlaQB => "mla_q_b",
            Role::MlaKvA => "mla_kv_a",
            Role::MlaKvB => "mla_kv_b",
            Role::Router => "router",
            Role::RoutedExpert => "routed_expert",
            Role::SharedExpert => "shared_expert",
            Role::SharedExpertGate => "shared_expert_gate",
            Role::DenseMlp => "dense_mlp",
            Role::Mtp => "mtp",
        }
    }

    /// Roles whose tensors are never GEMM weights (embedding tables, norms): they are
    /// always stored BF16 and a rule may not give them another format.
    pub fn never_quantized(self) -> bool {
        matches!(self, Role::Embedding | Role::Norm)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for an unknown role or projection name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{got}` (expected one of: {expected})")]
pub struct UnknownName {
    /// "role" or "proj".
    pub what: &'static str,
    /// The name given.
    pub got: String,
    /// Comma-separated accepted names.
    pub expected: String,
}

impl FromStr for Role {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownName {
                what: "role",
                got: s.to_string(),
                expected: Role::ALL.map(|r| r.name()).join(", "),
            })
    }
}

/// Which projection of a SwiGLU MLP a tensor is (routed, shared or dense MLPs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Proj {
    /// `gate_proj` (first half of the fused `linear_fc1`).
    Gate,
    /// `up_proj` (second half of the fused `linear_fc1`).
    Up,
    /// `down_proj` (`linear_fc2`).
    Down,
}

impl Proj {
    /// All projections.
    pub const ALL: [Proj; 3] = [Proj::Gate, Proj::Up, Proj::Down];

    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }
}

impl fmt::Display for Proj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Proj {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Proj::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownName {
                what: "proj",
                got: s.to_string(),
                expected: "gate, up, down".to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for r in Role::ALL {
            assert_eq!(r.name().parse::<Role>().unwrap(), r);
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.name())
            );
        }
        for p in Proj::ALL {
            assert_eq!(p.name().parse::<Proj>().unwrap(), p);
        }
        assert!("experts".parse::<Role>().is_err());
        assert!("gate_proj".parse::<Proj>().is_err());
    }
}
