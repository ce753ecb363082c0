//! Model inventory: every tensor of a checkpoint with its Hugging Face name, canonical
//! mxrl name, role, layer, expert, projection, shape and dtype.
//!
//! Built from a bare `config.json` (shapes implied by the config) or from a Hugging Face
//! model directory (config + safetensors headers and index; no weight bytes are read).
//!
//! Canonical mxrl names (what `name = "..."` rule globs see):
//!
//! | tensor | mxrl name |
//! |---|---|
//! | embeddings / final norm / lm_head | `embed`, `final_norm`, `lm_head` |
//! | layer norms | `layers.{i}.attn_norm`, `layers.{i}.mlp_norm` |
//! | attention | `layers.{i}.attn.{q,k,v,o}` (+ `.bias`), `layers.{i}.attn.{q_norm,k_norm}` |
//! | MLA | `layers.{i}.attn.{q_a,q_a_norm,q_b,kv_a,kv_a_norm,kv_b,o}` |
//! | dense MLP | `layers.{i}.mlp.{gate,up,down}` |
//! | MoE | `layers.{i}.moe.router` (+ `.bias`), `layers.{i}.moe.experts.{e}.{gate,up,down}`, `layers.{i}.moe.shared.{gate,up,down}`, `layers.{i}.moe.shared_gate` |
//! | MTP module j | `mtp.{j}.{embed,enorm,hnorm,eh_proj,head_norm,head}` and `mtp.{j}.attn.*`, `mtp.{j}.moe.*`, `mtp.{j}.{attn_norm,mlp_norm}` |
//!
//! A linear weight's canonical name has no `.weight` suffix; norms and embeddings
//! likewise; biases end in `.bias`.

use crate::config::HfConfig;
use crate::error::PlanError;
use crate::role::{Proj, Role};
use crate::stored::StoredTensor;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Supported architectures (`model_type` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// `llama`: dense, optional attention / MLP biases.
    Llama,
    /// `qwen2`: dense, q/k/v biases.
    Qwen2,
    /// `qwen3`: dense, q/k RMSNorm.
    Qwen3,
    /// `qwen2_moe`: routed experts + one shared expert with a sigmoid gate, q/k/v biases.
    Qwen2Moe,
    /// `qwen3_moe`: routed experts, q/k RMSNorm.
    Qwen3Moe,
    /// `deepseek_v3`: MLA, shared experts, first-k dense layers, MTP modules.
    DeepseekV3,
}

impl Arch {
    /// The `model_type` spelling.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::DeepseekV3 => "deepseek_v3",
        }
    }

    pub(crate) const ALL: [Arch; 6] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
        Arch::DeepseekV3,
    ];
}

/// What kind of parameter a tensor is. Only [`TensorKind::Linear`] weights are ever
/// quantized; everything else is stored BF16 whatever the recipe says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A 2-D GEMM weight `[N, K]` (out features, in features; K is the contraction dim).
    Linear,
    /// A linear layer's bias.
    Bias,
    /// A norm weight.
    Norm,
    /// An embedding table (a gather, not a GEMM).
    Embedding,
    /// A router's score-correction bias (DeepSeek-V3 `e_score_correction_bias`).
    RouterBias,
}

/// One tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorInfo {
    /// Hugging Face checkpoint name, e.g. `model.layers.3.mlp.experts.7.up_proj.weight`.
    pub hf: String,
    /// Canonical mxrl name, e.g. `layers.3.moe.experts.7.up`.
    pub mxrl: String,
    /// Role.
    pub role: Role,
    /// Parameter kind.
    pub kind: TensorKind,
    /// Decoder layer index (`None` for embeddings, final norm, lm_head and MTP modules).
    pub layer: Option<usize>,
    /// MTP module index (DeepSeek-V3), `None` elsewhere.
    pub mtp: Option<usize>,
    /// Routed expert index.
    pub expert: Option<usize>,
    /// MLP projection (routed, shared and dense MLPs).
    pub proj: Option<Proj>,
    /// Logical shape (`[N, K]` for linear weights).
    pub shape: Vec<usize>,
    /// Logical dtype as safetensors spells it (`BF16`, `F32`, ...).
    pub dtype: String,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// `[N, K]` of a linear weight, `None` otherwise.
    pub fn linear_dims(&self) -> Option<(usize, usize)> {
        (self.kind == TensorKind::Linear && self.shape.len() == 2)
            .then(|| (self.shape[0], self.shape[1]))
    }

    /// The canonical name of the module this tensor belongs to with its last segment
    /// removed (`layers.3.moe.experts.7.up` → `layers.3.moe.experts.7`).
    pub fn mxrl_parent(&self) -> &str {
        self.mxrl.rsplit_once('.').map(|(p, _)| p).unwrap_or("")
    }
}

/// All tensors of a model, in checkpoint order.
#[derive(Debug, Clone)]
pub struct Inventory {
    arch: Arch,
    num_layers: usize,
    num_mtp: usize,
    tensors: Vec<TensorInfo>,
    by_hf: HashMap<String, usize>,
    by_mxrl: HashMap<String, usize>,
    source: String,
}

impl Inventory {
    /// Architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Number of decoder layers (`num_hidden_layers`; MTP modules not counted).
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Number of MTP modules present.
    pub fn num_mtp(&self) -> usize {
        self.num_mtp
    }

    /// Tensors in checkpoint order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Where the inventory came from (file or directory).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Look a tensor up by its Hugging Face name.
    pub fn by_hf(&self, name: &str) -> Option<&TensorInfo> {
        self.by_hf.get(name).map(|&i| &self.tensors[i])
    }

    /// Look a tensor up by its canonical mxrl name.
    pub fn by_mxrl(&self, name: &str) -> Option<&TensorInfo> {
        self.by_mxrl.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of a tensor (by HF name) in checkpoint order.
    pub fn index_of_hf(&self, name: &str) -> Option<usize> {
        self.by_hf.get(name).copied()
    }

    /// Inventory implied by a `config.json` file.
    pub fn from_config_path(path: &Path) -> Result<Inventory, PlanError> {
        let cfg = HfConfig::from_path(path)?;
        Ok(Inventory::from_config(&cfg, &path.display().to_string()))
    }

    /// Inventory implied by `config.json` text; `origin` names it in errors.
    pub fn from_config_json(text: &str, origin: &str) -> Result<Inventory, PlanError> {
        Ok(Inventory::from_config(
            &HfConfig::from_json(text, origin)?,
            origin,
        ))
    }

    /// Inventory implied by a parsed, validated configuration; `origin` names its source.
    pub fn from_config(cfg: &HfConfig, origin: &str) -> Inventory {
        let (tensors, num_layers, num_mtp) = build(cfg);
        Inventory::assemble(cfg.arch, num_layers, num_mtp, tensors, origin.to_string())
    }

    /// Match a config-derived inventory against the logical tensors of a checkpoint (read by
    /// `mxrl-ckpt`'s `Checkpoint::stored_tensors`; `mxrl_ckpt::model_inventory` does both) and
    /// return the inventory in checkpoint order with stored shapes and dtypes. Tensors the
    /// architecture does not have are an error listing all of them; so are missing ones (an
    /// absent MTP module as a whole is allowed). Quantized tensors (scale companions, packed
    /// NVFP4) are folded into their logical weight.
    pub fn reconcile(&self, dir: &Path, stored: &[StoredTensor]) -> Result<Inventory, PlanError> {
        let stored_names: HashMap<&str, &StoredTensor> =
            stored.iter().map(|s| (s.name.as_str(), s)).collect();
        let unknown: Vec<String> = stored
            .iter()
            .filter(|s| !self.by_hf.contains_key(&s.name))
            .map(|s| s.name.clone())
            .collect();
        if !unknown.is_empty() {
            return Err(PlanError::UnknownTensors {
                dir: dir.to_path_buf(),
                names: unknown,
            });
        }
        let missing: Vec<&TensorInfo> = self
            .tensors
            .iter()
            .filter(|t| !stored_names.contains_key(t.hf.as_str()))
            .collect();
        let mtp_missing = missing.iter().filter(|t| t.mtp.is_some()).count();
        let all_mtp_missing = mtp_missing > 0
            && mtp_missing == self.tensors.iter().filter(|t| t.mtp.is_some()).count();
        let real_missing: Vec<String> = missing
            .iter()
            .filter(|t| !(all_mtp_missing && t.mtp.is_some()))
            .map(|t| t.hf.clone())
            .collect();
        if !real_missing.is_empty() {
            return Err(PlanError::MissingTensors {
                dir: dir.to_path_buf(),
                names: real_missing,
            });
        }
        let mut out: Vec<(usize, usize, TensorInfo)> = Vec::new();
        for t in &self.tensors {
            let Some(s) = stored_names.get(t.hf.as_str()) else {
                continue; // a dropped MTP module
            };
            if s.logical_shape != t.shape {
                return Err(PlanError::ShapeMismatch {
                    tensor: t.hf.clone(),
                    expected: t.shape.clone(),
                    found: s.logical_shape.clone(),
                });
            }
            let mut t = t.clone();
            t.dtype = s.dtype.clone();
            out.push((s.order.0, s.order.1, t));
        }
        out.sort_by_key(|(f, o, _)| (*f, *o));
        let num_mtp = if all_mtp_missing { 0 } else { self.num_mtp };
        Ok(Inventory::assemble(
            self.arch,
            self.num_layers,
            num_mtp,
            out.into_iter().map(|(_, _, t)| t).collect(),
            dir.display().to_string(),
        ))
    }

    fn assemble(
        arch: Arch,
        num_layers: usize,
        num_mtp: usize,
        tensors: Vec<TensorInfo>,
        source: String,
    ) -> Inventory {
        let by_hf = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.hf.clone(), i))
            .collect();
        let by_mxrl = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.mxrl.clone(), i))
            .collect();
        Inventory {
            arch,
            num_layers,
            num_mtp,
            tensors,
            by_hf,
            by_mxrl,
            source,
        }
    }
}

// ---------------------------------------------------------------------------------------
// tensor lists per architecture

struct Builder {
    out: Vec<TensorInfo>,
    dtype: String,
}

/// Where a block of tensors lives: HF prefix, mxrl prefix, layer / MTP index.
#[derive(Clone)]
struct At {
    hf: String,
    mx: String,
    layer: Option<usize>,
    mtp: Option<usize>,
}

impl At {
    fn sub(&self, hf: &str, mx: &str) -> At {
        At {
            hf: format!("{}{hf}", self.hf),
            mx: format!("{}{mx}", self.mx),
            layer: self.layer,
            mtp: self.mtp,
        }
    }
}

impl Builder {
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        at: &At,
        hf: &str,
        mx: &str,
        role: Role,
        kind: TensorKind,
        shape: Vec<usize>,
        expert: Option<usize>,
        proj: Option<Proj>,
    ) {
        let role = if at.mtp.is_some() { Role::Mtp } else { role };
        let dtype = if kind == TensorKind::RouterBias {
            "F32".to_string()
        } else {
            self.dtype.clone()
        };
        self.out.push(TensorInfo {
            hf: format!("{}{hf}", at.hf),
            mxrl: format!("{}{mx}", at.mx),
            role,
            kind,
            layer: at.layer,
            mtp: at.mtp,
            expert,
            proj,
            shape,
            dtype,
        });
    }

    /// A linear layer `[n, k]` with an optional bias.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &mut self,
        at: &At,
        hf: &str,
        mx: &str,
        role: Role,
        n: usize,
        k: usize,
        bias: bool,
        expert: Option<usize>,
        proj: Option<Proj>,
    ) {
        self.push(
            at,
            &format!("{hf}.weight"),
            mx,
            role,
            TensorKind::Linear,
            vec![n, k],
            expert,
            proj,
        );
        if bias {
            self.push(
                at,
                &format!("{hf}.bias"),
                &format!("{mx}.bias"),
                role,
                TensorKind::Bias,
                vec![n],
                expert,
                proj,
            );
        }
    }

    /// `model.norm` and, unless tied to the embedding, `lm_head`.
    fn final_norm_and_head(&mut self, root: &At, tie: bool, vocab: usize, hidden: usize) {
        self.norm(root, "model.norm", "final_norm", hidden);
        if !tie {
            self.linear(
                root,
                "lm_head",
                "lm_head",
                Role::LmHead,
                vocab,
                hidden,
                false,
                None,
                None,
            );
        }
    }

    fn norm(&mut self, at: &At, hf: &str, mx: &str, dim: usize) {
        self.push(
            at,
            &format!("{hf}.weight"),
            mx,
            Role::Norm,
            TensorKind::Norm,
            vec![dim],
            None,
            None,
        );
    }

    /// SwiGLU MLP: gate_proj, up_proj, down_proj.
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &mut self,
        at: &At,
        role: Role,
        hidden: usize,
        inter: usize,
        bias: bool,
        expert: Option<usize>,
    ) {
        self.linear(
            at,
            "gate_proj",
            "gate",
            role,
            inter,
            hidden,
            bias,
            expert,
            Some(Proj::Gate),
        );
        self.linear(
            at,
            "up_proj",
            "up",
            role,
            inter,
            hidden,
            bias,
            expert,
            Some(Proj::Up),
        );
        self.linear(
            at,
            "down_proj",
            "down",
            role,
            hidden,
            inter,
            bias,
            expert,
            Some(Proj::Down),
        );
    }
}

struct Attn {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
}

fn std_attention(b: &mut Builder, at: &At, a: &Attn) {
    let at = at.sub("self_attn.", "attn.");
    let q = a.heads * a.head_dim;
    let kv = a.kv_heads * a.head_dim;
    b.linear(
        &at,
        "q_proj",
        "q",
        Role::AttnQ,
        q,
        a.hidden,
        a.qkv_bias,
        None,
        None,
    );
    b.linear(
        &at,
        "k_proj",
        "k",
        Role::AttnK,
        kv,
        a.hidden,
        a.qkv_bias,
        None,
        None,
    );
    b.linear(
        &at,
        "v_proj",
        "v",
        Role::AttnV,
        kv,
        a.hidden,
        a.qkv_bias,
        None,
        None,
    );
    b.linear(
        &at,
        "o_proj",
        "o",
        Role::AttnO,
        a.hidden,
        q,
        a.o_bias,
        None,
        None,
    );
    if a.qk_norm {
        b.norm(&at, "q_norm", "q_norm", a.head_dim);
        b.norm(&at, "k_norm", "k_norm", a.head_dim);
    }
}

struct Mla {
    hidden: usize,
    heads: usize,
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope: usize,
    qk_rope: usize,
    v_head: usize,
    bias: bool,
}

fn mla_attention(b: &mut Builder, at: &At, m: &Mla) {
    let at = at.sub("self_attn.", "attn.");
    let qk_head = m.qk_nope + m.qk_rope;
    match m.q_lora_rank {
        Some(r) => {
            b.linear(
                &at,
                "q_a_proj",
                "q_a",
                Role::MlaQA,
                r,
                m.hidden,
                m.bias,
                None,
                None,
            );
            b.norm(&at, "q_a_layernorm", "q_a_norm", r);
            b.linear(
                &at,
                "q_b_proj",
                "q_b",
                Role::MlaQB,
                m.heads * qk_head,
                r,
                false,
                None,
                None,
            );
        }
        None => {
            b.linear(
                &at,
                "q_proj",
                "q",
                Role::AttnQ,
                m.heads * qk_head,
                m.hidden,
                false,
                None,
                None,
            );
        }
    }
    b.linear(
        &at,
        "kv_a_proj_with_mqa",
        "kv_a",
        Role::MlaKvA,
        m.kv_lora_rank + m.qk_rope,
        m.hidden,
        m.bias,
        None,
        None,
    );
    b.norm(&at, "kv_a_layernorm", "kv_a_norm", m.kv_lora_rank);
    b.linear(
        &at,
        "kv_b_proj",
        "kv_b",
        Role::MlaKvB,
        m.heads * (m.qk_nope + m.v_head),
        m.kv_lora_rank,
        false,
        None,
        None,
    );
    b.linear(
        &at,
        "o_proj",
        "o",
        Role::AttnO,
        m.hidden,
        m.heads * m.v_head,
        m.bias,
        None,
        None,
    );
}

/// The tensors of a validated configuration (sizes bounded by [`HfConfig::validate`]).
fn build(c: &HfConfig) -> (Vec<TensorInfo>, usize, usize) {
    let arch = c.arch;
    let hidden = c.hidden_size;
    let layers = c.num_hidden_layers;
    let vocab = c.vocab_size;
    let heads = c.num_attention_heads;
    let tie = c.tie_word_embeddings;
    let mut b = Builder {
        out: Vec::new(),
        dtype: c.dtype.clone(),
    };
    let root = At {
        hf: String::new(),
        mx: String::new(),
        layer: None,
        mtp: None,
    };
    b.push(
        &root,
        "model.embed_tokens.weight",
        "embed",
        Role::Embedding,
        TensorKind::Embedding,
        vec![vocab, hidden],
        None,
        None,
    );
    let layer_at = |i: usize| At {
        hf: format!("model.layers.{i}."),
        mx: format!("layers.{i}."),
        layer: Some(i),
        mtp: None,
    };
    let mut num_mtp = 0;
    match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe => {
            let attn = Attn {
                hidden,
                heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                qkv_bias: c.qkv_bias,
                o_bias: c.o_bias,
                qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            };
            let mlp_bias = c.mlp_bias;
            let inter = c.intermediate_size;
            let (experts, moe_inter, shared_inter) = match &c.moe {
                Some(m) => (
                    m.num_experts,
                    m.moe_intermediate_size,
                    m.shared_intermediate_size,
                ),
                None => (0, 0, 0),
            };
            for i in 0..layers {
                let at = layer_at(i);
                std_attention(&mut b, &at, &attn);
                if c.is_moe_layer(i) {
                    let m = at.sub("mlp.", "moe.");
                    b.linear(
                        &m,
                        "gate",
                        "router",
                        Role::Router,
                        experts,
                        hidden,
                        false,
                        None,
                        None,
                    );
                    for e in 0..experts {
                        let ea = m.sub(&format!("experts.{e}."), &format!("experts.{e}."));
                        b.mlp(&ea, Role::RoutedExpert, hidden, moe_inter, false, Some(e));
                    }
                    if shared_inter > 0 {
                        let sa = m.sub("shared_expert.", "shared.");
                        b.mlp(&sa, Role::SharedExpert, hidden, shared_inter, false, None);
                        b.linear(
                            &m,
                            "shared_expert_gate",
                            "shared_gate",
                            Role::SharedExpertGate,
                            1,
                            hidden,
                            false,
                            None,
                            None,
                        );
                    }
                } else {
                    let m = at.sub("mlp.", "mlp.");
                    b.mlp(&m, Role::DenseMlp, hidden, inter, mlp_bias, None);
                }
                b.norm(&at, "input_layernorm", "attn_norm", hidden);
                b.norm(&at, "post_attention_layernorm", "mlp_norm", hidden);
            }
        }
        Arch::DeepseekV3 => {
            let m = c
                .mla
                .as_ref()
                .expect("a validated DeepSeek-V3 config has MLA sizes");
            let mla = Mla {
                hidden,
                heads,
                q_lora_rank: m.q_lora_rank,
                kv_lora_rank: m.kv_lora_rank,
                qk_nope: m.qk_nope_head_dim,
                qk_rope: m.qk_rope_head_dim,
                v_head: m.v_head_dim,
                bias: c.o_bias,
            };
            let inter = c.intermediate_size;
            let moe = c
                .moe
                .as_ref()
                .expect("a validated DeepSeek-V3 config has MoE sizes");
            let moe_inter = moe.moe_intermediate_size;
            let routed = moe.num_experts;
            let shared_inter = moe.shared_intermediate_size;
            num_mtp = c.num_mtp;
            let ds_layer = |b: &mut Builder, at: &At, is_moe: bool| {
                mla_attention(b, at, &mla);
                if is_moe {
                    let m = at.sub("mlp.", "moe.");
                    for e in 0..routed {
                        let ea = m.sub(&format!("experts.{e}."), &format!("experts.{e}."));
                        b.mlp(&ea, Role::RoutedExpert, hidden, moe_inter, false, Some(e));
                    }
                    b.linear(
                        &m,
                        "gate",
                        "router",
                        Role::Router,
                        routed,
                        hidden,
                        false,
                        None,
                        None,
                    );
                    b.push(
                        &m,
                        "gate.e_score_correction_bias",
                        "router.bias",
                        Role::Router,
                        TensorKind::RouterBias,
                        vec![routed],
                        None,
                        None,
                    );
                    if shared_inter > 0 {
                        let sa = m.sub("shared_experts.", "shared.");
                        b.mlp(&sa, Role::SharedExpert, hidden, shared_inter, false, None);
                    }
                } else {
                    let m = at.sub("mlp.", "mlp.");
                    b.mlp(&m, Role::DenseMlp, hidden, inter, false, None);
                }
                b.norm(at, "input_layernorm", "attn_norm", hidden);
                b.norm(at, "post_attention_layernorm", "mlp_norm", hidden);
            };
            for i in 0..layers {
                ds_layer(&mut b, &layer_at(i), c.is_moe_layer(i));
            }
            // Norm and head come before the MTP modules (which follow the main layers).
            b.final_norm_and_head(&root, tie, vocab, hidden);
            for j in 0..num_mtp {
                let at = At {
                    hf: format!("model.layers.{}.", layers + j),
                    mx: format!("mtp.{j}."),
                    layer: None,
                    mtp: Some(j),
                };
                b.push(
                    &at,
                    "embed_tokens.weight",
                    "embed",
                    Role::Embedding,
                    TensorKind::Embedding,
                    vec![vocab, hidden],
                    None,
                    None,
                );
                b.norm(&at, "enorm", "enorm", hidden);
                b.norm(&at, "hnorm", "hnorm", hidden);
                b.linear(
                    &at,
                    "eh_proj",
                    "eh_proj",
                    Role::Mtp,
                    hidden,
                    2 * hidden,
                    false,
                    None,
                    None,
                );
                ds_layer(&mut b, &at, routed > 0);
                b.norm(&at, "shared_head.norm", "head_norm", hidden);
                b.linear(
                    &at,
                    "shared_head.head",
                    "head",
                    Role::LmHead,
                    vocab,
                    hidden,
                    false,
                    None,
                    None,
                );
            }
            return (b.out, layers, num_mtp);
        }
    }
    b.final_norm_and_head(&root, tie, vocab, hidden);
    (b.out, layers, num_mtp)
}

/// Count tensors per role (for summaries and tests).
pub fn count_by_role(tensors: &[TensorInfo]) -> BTreeMap<Role, usize> {
    let mut m = BTreeMap::new();
    for t in tensors {
        *m.entry(t.role).or_insert(0) += 1;
    }
    m
}

/// The `config.json` path of a model argument: a directory's `config.json`, or the
/// file itself.
pub fn config_path(model: &Path) -> PathBuf {
    if model.is_dir() {
        model.join("config.json")
    } else {
        model.to_path_buf()
    }
}
