//! The MoE transformer written once over a device's op set ([`Backend`]): blocks with their
//! weights on the device, a device-resident forward (per-token logprobs) and batched decode
//! over a preallocated BF16 KV cache.
//!
//! ```text
//! x = embed(tokens)
//! for layer: x += attention(rmsnorm(x)); x += ffn(rmsnorm(x))     (ffn: MoeBlock | DenseMlp)
//! logprob = log_softmax(lm_head(rmsnorm(x)) / τ)[target]
//! ```
//!
//! Numerics: every linear multiplies BF16 operands with f32 accumulation (the products of
//! [`LinearPrecision::Bf16`](crate::LinearPrecision::Bf16)); the residual stream, norms, softmax,
//! router and loss are f32; the KV cache is BF16. On [`CpuBackend`] each op is the CPU model's
//! own function, so [`Engine`] on the CPU reproduces [`Model`] with every linear at
//! `LinearPrecision::Bf16` (bitwise for the forward; decode differs only by the BF16 KV cache).
//! A GPU backend runs the same definition; only summation orders differ.

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::model::{Model, SeqInput};
use mxrl_tensor::attention::AttnShape;
use mxrl_tensor::device::{Backend, CpuBackend, DeviceError, RouteBufs};
use mxrl_tensor::SeqLayout;

fn dev(e: DeviceError) -> ModelError {
    ModelError::Device(e.to_string())
}

/// Attention block weights: `q/k/v/o` BF16, optional biases and per-head q/k norms (f32).
struct Attention<B: Backend> {
    q: B::Bf16,
    k: B::Bf16,
    v: B::Bf16,
    o: B::Bf16,
    bias: Option<[B::F32; 3]>,
    qk_norm: Option<[B::F32; 2]>,
}

/// SwiGLU MLP of a dense layer: fused gate/up `[2F, H]` and down `[H, F]`, BF16.
struct DenseMlp<B: Backend> {
    gate_up: B::Bf16,
    down: B::Bf16,
    f: usize,
}

/// Routed experts of an MoE layer: router `[E, H]`, stacked gate/up `[E, 2F, H]` and down
/// `[E, H, F]`, BF16.
struct MoeBlock<B: Backend> {
    router: B::Bf16,
    gate_up: B::Bf16,
    down: B::Bf16,
    f: usize,
}

enum Ffn<B: Backend> {
    Dense(DenseMlp<B>),
    Moe(MoeBlock<B>),
}

struct Layer<B: Backend> {
    ln1: B::F32,
    attn: Attention<B>,
    ln2: B::F32,
    ffn: Ffn<B>,
}

/// Scratch buffers of one pass over `n` rows.
struct Act<B: Backend> {
    x: B::F32,
    h: B::F32,
    hb: B::Bf16,
    rstd: B::F32,
    q: B::F32,
    k: B::F32,
    v: B::F32,
    qn: B::F32,
    kn: B::F32,
    rstd_q: B::F32,
    rstd_k: B::F32,
    att: B::F32,
    lse: B::F32,
    o: B::F32,
    gu: B::F32,
    actb: B::Bf16,
    xg: B::Bf16,
    y: B::F32,
    logits: B::F32,
    route: RouteBufs<B>,
}

/// A Qwen3-MoE / Qwen2-MoE (without shared experts) model on one device.
pub struct Engine<B: Backend> {
    b: B,
    cfg: ModelConfig,
    embed: B::F32,
    head: B::Bf16,
    norm: B::F32,
    layers: Vec<Layer<B>>,
    rope: B::F32,
    max_pos: usize,
}

/// A batch being decoded: BF16 KV caches `[slots, max_len, Hkv·D]` per layer and the
/// current length of every sequence.
pub struct DecodeState<B: Backend> {
    k: Vec<B::Bf16>,
    v: Vec<B::Bf16>,
    lens: Vec<u32>,
    max_len: usize,
}

impl<B: Backend> DecodeState<B> {
    /// Tokens held by every sequence.
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }
}

impl<B: Backend> Engine<B> {
    /// Uploads `model`'s weights to backend `b` (BF16 copies of the linear weights, f32
    /// embeddings and norms). `max_pos`: the longest sequence it will run (RoPE table size).
    ///
    /// # Errors
    /// A shared expert (not supported by the engine yet), or a device failure.
    pub fn from_model(model: &Model, b: B, max_pos: usize) -> Result<Self> {
        let ps = model.params();
        Self::build(model.config().clone(), b, max_pos, |name, _| {
            ps.by_name(name)
                .map(|p| p.data.clone())
                .ok_or_else(|| ModelError::BadTensor {
                    name: name.into(),
                    message: "missing from the model".into(),
                })
        })
    }

    /// Random weights generated tensor by tensor (HF init: linear and embedding weights
    /// `N(0, initializer_range²)`, norms 1, biases 0) from a counter-based generator, so
    /// no full f32 copy of the model exists on the host; same seed → same weights. Meant for
    /// benchmarks at real width.
    ///
    /// # Errors
    /// As [`Engine::build`].
    pub fn random(cfg: &ModelConfig, b: B, max_pos: usize, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let std = cfg.initializer_range;
        let mut counter = 0u64;
        Self::build(cfg.clone(), b, max_pos, |name, shape| {
            let n: usize = shape.iter().product();
            counter += 1;
            Ok(if name.contains("norm") {
                vec![1.0; n]
            } else if name.ends_with("bias") {
                vec![0.0; n]
            } else {
                normal_values(n, seed ^ counter.wrapping_mul(0x9E37_79B9_7F4A_7C15), std)
            })
        })
    }

    /// Builds the device weights from a source of f32 tensors by HF name and shape (routed
    /// experts are read per expert and stacked on the host one layer at a time).
    ///
    /// # Errors
    /// A shared expert (not supported by the engine yet), a source error, a device failure.
    pub fn build(
        cfg: ModelConfig,
        b: B,
        max_pos: usize,
        mut src: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        if cfg.shared_expert_intermediate_size > 0 {
            return Err(ModelError::Config {
                field: "shared_expert_intermediate_size",
                message: "the device engine does not run shared experts yet (Qwen2-MoE)".into(),
            });
        }
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let up_f = |v: &[f32]| b.upload_f32(v).map_err(dev);
        let up_bf16 = |v: &[f32]| -> Result<B::Bf16> {
            let f = b.upload_f32(v).map_err(dev)?;
            let mut o = b.zeros_bf16(v.len()).map_err(dev)?;
            b.to_bf16(&f, &mut o, v.len()).map_err(dev)?;
            Ok(o)
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let mut get = |name: String, shape: &[usize]| src(&name, shape);
            let bias = if cfg.qkv_bias {
                Some([
                    up_f(&get(format!("{a}.q_proj.bias"), &[qd])?)?,
                    up_f(&get(format!("{a}.k_proj.bias"), &[kvd])?)?,
                    up_f(&get(format!("{a}.v_proj.bias"), &[kvd])?)?,
                ])
            } else {
                None
            };
            let qk_norm = match cfg.arch {
                Arch::Qwen3Moe => Some([
                    up_f(&get(format!("{a}.q_norm.weight"), &[d])?)?,
                    up_f(&get(format!("{a}.k_norm.weight"), &[d])?)?,
                ]),
                Arch::Qwen2Moe => None,
            };
            let attn = Attention {
                q: up_bf16(&get(format!("{a}.q_proj.weight"), &[qd, h])?)?,
                k: up_bf16(&get(format!("{a}.k_proj.weight"), &[kvd, h])?)?,
                v: up_bf16(&get(format!("{a}.v_proj.weight"), &[kvd, h])?)?,
                o: up_bf16(&get(format!("{a}.o_proj.weight"), &[h, qd])?)?,
                bias,
                qk_norm,
            };
            let ffn = if cfg.is_moe_layer(l) {
                let (e, f) = (cfg.num_experts, cfg.moe_intermediate_size);
                let mut gu = Vec::with_capacity(e * 2 * f * h);
                let mut dn = Vec::with_capacity(e * h * f);
                for x in 0..e {
                    gu.extend_from_slice(&get(
                        format!("{p}.mlp.experts.{x}.gate_up_proj.weight"),
                        &[2 * f, h],
                    )?);
                    dn.extend_from_slice(&get(
                        format!("{p}.mlp.experts.{x}.down_proj.weight"),
                        &[h, f],
                    )?);
                }
                Ffn::Moe(MoeBlock {
                    router: up_bf16(&get(format!("{p}.mlp.gate.weight"), &[e, h])?)?,
                    gate_up: up_bf16(&gu)?,
                    down: up_bf16(&dn)?,
                    f,
                })
            } else {
                let f = cfg.intermediate_size;
                Ffn::Dense(DenseMlp {
                    gate_up: up_bf16(&get(format!("{p}.mlp.gate_up_proj.weight"), &[2 * f, h])?)?,
                    down: up_bf16(&get(format!("{p}.mlp.down_proj.weight"), &[h, f])?)?,
                    f,
                })
            };
            layers.push(Layer {
                ln1: up_f(&get(format!("{p}.input_layernorm.weight"), &[h])?)?,
                attn,
                ln2: up_f(&get(format!("{p}.post_attention_layernorm.weight"), &[h])?)?,
                ffn,
            });
        }
        let v = cfg.vocab_size;
        let embed_vals = src("model.embed_tokens.weight", &[v, h])?;
        let embed = up_f(&embed_vals)?;
        let head = if cfg.tie_word_embeddings {
            up_bf16(&embed_vals)?
        } else {
            up_bf16(&src("lm_head.weight", &[v, h])?)?
        };
        drop(embed_vals);
        let norm = up_f(&src("model.norm.weight", &[h])?)?;
        let rope = b
            .rope_table(max_pos.max(1), cfg.head_dim, cfg.rope_theta)
            .map_err(dev)?;
        Ok(Engine {
            embed,
            head,
            norm,
            layers,
            rope,
            max_pos,
            cfg,
            b,
        })
    }

    /// Parameters held (counted from the configuration; tied embeddings once).
    pub fn num_parameters(&self) -> usize {
        let c = &self.cfg;
        let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
        let mut n = v * h * if c.tie_word_embeddings { 1 } else { 2 } + h;
        for l in 0..c.num_layers {
            n += 2 * h + h * qd + 2 * h * kvd + qd * h;
            if c.qkv_bias {
                n += qd + 2 * kvd;
            }
            if c.arch == Arch::Qwen3Moe {
                n += 2 * d;
            }
            n += if c.is_moe_layer(l) {
                c.num_experts * (h + 3 * h * c.moe_intermediate_size)
            } else {
                3 * h * c.intermediate_size
            };
        }
        n
    }

    /// Weight bytes one decode step reads at batch `batch` if each token touches `top_k`
    /// distinct experts (all `min(E, batch·k)` experts at most), BF16: the roofline numerator.
    pub fn decode_weight_bytes(&self, batch: usize) -> usize {
        let c = &self.cfg;
        let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);
        let mut n = v * h;
        for l in 0..c.num_layers {
            n += h * qd + 2 * h * kvd + qd * h;
            n += if c.is_moe_layer(l) {
                let used = (batch * c.num_experts_per_tok).min(c.num_experts);
                c.num_experts * h + used * 3 * h * c.moe_intermediate_size
            } else {
                3 * h * c.intermediate_size
            };
        }
        2 * n
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.b
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            q_heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
        let v = self.cfg.vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
            return Err(ModelError::Input(format!(
                "{what}: token id {t} ≥ vocab_size {v}"
            )));
        }
        Ok(())
    }

    fn act(&self, n: usize) -> Result<Act<B>> {
        let c = &self.cfg;
        let b = &self.b;
        let (h, qd, kvd) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let k = c.num_experts_per_tok.max(1);
        let f = c.moe_intermediate_size.max(c.intermediate_size);
        let rows = n * k;
        let z = |m: usize| b.zeros_f32(m).map_err(dev);
        let zb = |m: usize| b.zeros_bf16(m).map_err(dev);
        let zu = |m: usize| b.upload_u32(&vec![0u32; m.max(1)]).map_err(dev);
        let ffn_rows = rows.max(n);
        Ok(Act {
            x: z(n * h)?,
            h: z(n * h)?,
            hb: zb(n * h.max(qd))?,
            rstd: z(n)?,
            q: z(n * qd)?,
            k: z(n * kvd)?,
            v: z(n * kvd)?,
            qn: z(n * qd)?,
            kn: z(n * kvd)?,
            rstd_q: z(n * c.num_heads)?,
            rstd_k: z(n * c.num_kv_heads)?,
            att: z(n * qd)?,
            lse: z(n * c.num_heads)?,
            o: z(n * h)?,
            gu: z(ffn_rows * 2 * f)?,
            actb: zb(ffn_rows * f)?,
            xg: zb(rows * h)?,
            y: z(ffn_rows * h)?,
            logits: z(n * c.num_experts.max(1))?,
            route: RouteBufs {
                ids: zu(rows)?,
                weights: z(rows)?,
                probs: z(n * c.num_experts.max(1))?,
                offsets: zu(c.num_experts + 1)?,
                perm: zu(rows)?,
            },
        })
    }

    /// One decoder layer over the `n` rows of `a.x` (in place). `kv`: prefill (layout and
    /// optional caches to fill) or decode (caches, lengths including the new token).
    fn layer(&self, li: usize, n: usize, a: &mut Act<B>, pass: &mut Pass<'_, B>) -> Result<()> {
        let c = &self.cfg;
        let b = &self.b;
        let l = &self.layers[li];
        let (hd, hq, hkv, d) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        let (qd, kvd) = (hq * d, hkv * d);
        let eps = c.rms_norm_eps;
        // x += attention(rmsnorm(x))
        b.rmsnorm(&a.x, &l.ln1, n, hd, eps, &mut a.h, &mut a.rstd)
            .map_err(dev)?;
        b.to_bf16(&a.h, &mut a.hb, n * hd).map_err(dev)?;
        b.linear(&a.hb, &l.attn.q, n, hd, qd, &mut a.q)
            .map_err(dev)?;
        b.linear(&a.hb, &l.attn.k, n, hd, kvd, &mut a.k)
            .map_err(dev)?;
        b.linear(&a.hb, &l.attn.v, n, hd, kvd, &mut a.v)
            .map_err(dev)?;
        if let Some([bq, bk, bv]) = &l.attn.bias {
            b.add_bias(&mut a.q, bq, n, qd).map_err(dev)?;
            b.add_bias(&mut a.k, bk, n, kvd).map_err(dev)?;
            b.add_bias(&mut a.v, bv, n, kvd).map_err(dev)?;
        }
        if let Some([nq, nk]) = &l.attn.qk_norm {
            b.rmsnorm(&a.q, nq, n * hq, d, eps, &mut a.qn, &mut a.rstd_q)
                .map_err(dev)?;
            b.rmsnorm(&a.k, nk, n * hkv, d, eps, &mut a.kn, &mut a.rstd_k)
                .map_err(dev)?;
            std::mem::swap(&mut a.q, &mut a.qn);
            std::mem::swap(&mut a.k, &mut a.kn);
        }
        let shape = self.shape();
        match pass {
            Pass::Prefill {
                layout,
                offsets,
                pos,
                cache,
            } => {
                b.rope(&mut a.q, n, hq, d, pos, &self.rope).map_err(dev)?;
                b.rope(&mut a.k, n, hkv, d, pos, &self.rope).map_err(dev)?;
                if let Some(st) = cache {
                    b.kv_fill(
                        &a.k,
                        &a.v,
                        layout,
                        kvd,
                        st.max_len,
                        &mut st.k[li],
                        &mut st.v[li],
                    )
                    .map_err(dev)?;
                }
                b.attention(
                    &a.q, &a.k, &a.v, layout, offsets, shape, &mut a.att, &mut a.lse,
                )
                .map_err(dev)?;
            }
            Pass::Decode { st, lens, pos } => {
                b.rope(&mut a.q, n, hq, d, pos, &self.rope).map_err(dev)?;
                b.rope(&mut a.k, n, hkv, d, pos, &self.rope).map_err(dev)?;
                b.kv_append(
                    &a.k,
                    &a.v,
                    lens,
                    n,
                    kvd,
                    st.max_len,
                    &mut st.k[li],
                    &mut st.v[li],
                )
                .map_err(dev)?;
                let host: Vec<u32> = st.lens.iter().map(|&x| x + 1).collect();
                b.attention_decode(
                    &a.q, &st.k[li], &st.v[li], lens, &host, st.max_len, shape, &mut a.att,
                )
                .map_err(dev)?;
            }
        }
        b.to_bf16(&a.att, &mut a.hb, n * qd).map_err(dev)?;
        b.linear(&a.hb, &l.attn.o, n, qd, hd, &mut a.o)
            .map_err(dev)?;
        b.add(&mut a.x, &a.o, n * hd).map_err(dev)?;
        // x += ffn(rmsnorm(x))
        b.rmsnorm(&a.x, &l.ln2, n, hd, eps, &mut a.h, &mut a.rstd)
            .map_err(dev)?;
        b.to_bf16(&a.h, &mut a.hb, n * hd).map_err(dev)?;
        match &l.ffn {
            Ffn::Dense(m) => {
                b.linear(&a.hb, &m.gate_up, n, hd, 2 * m.f, &mut a.gu)
                    .map_err(dev)?;
                b.swiglu_bf16(&a.gu, n, m.f, &mut a.actb).map_err(dev)?;
                b.linear(&a.actb, &m.down, n, m.f, hd, &mut a.y)
                    .map_err(dev)?;
                b.add(&mut a.x, &a.y, n * hd).map_err(dev)?;
            }
            Ffn::Moe(m) => {
                let (e, k) = (c.num_experts, c.num_experts_per_tok);
                let rows = n * k;
                b.linear(&a.hb, &m.router, n, hd, e, &mut a.logits)
                    .map_err(dev)?;
                b.route(&a.logits, n, e, k, c.norm_topk_prob, &mut a.route)
                    .map_err(dev)?;
                b.gather_bf16(&a.h, &a.route.perm, rows, k, hd, &mut a.xg)
                    .map_err(dev)?;
                b.grouped_linear(
                    &a.xg,
                    &m.gate_up,
                    &a.route.offsets,
                    e,
                    rows,
                    hd,
                    2 * m.f,
                    &mut a.gu,
                )
                .map_err(dev)?;
                b.swiglu_bf16(&a.gu, rows, m.f, &mut a.actb).map_err(dev)?;
                b.grouped_linear(
                    &a.actb,
                    &m.down,
                    &a.route.offsets,
                    e,
                    rows,
                    m.f,
                    hd,
                    &mut a.y,
                )
                .map_err(dev)?;
                // The combine accumulates into zeros, then the residual adds it (the CPU
                // model's order: out = Σ experts; x += out).
                let mut out = b.zeros_f32(n * hd).map_err(dev)?;
                b.combine(&a.y, &a.route, n, e, k, hd, &mut out)
                    .map_err(dev)?;
                b.add(&mut a.x, &out, n * hd).map_err(dev)?;
            }
        }
        Ok(())
    }

    /// Per-token logprobs of every sequence's targets (`softmax(logits / temperature)`),
    /// computed on the device; only token ids go up and logprobs come back.
    ///
    /// # Errors
    /// Token ids out of range, sequences longer than the engine's `max_pos`, device failures.
    pub fn logprobs(&self, batch: &[SeqInput<'_>], temperature: f32) -> Result<Vec<Vec<f32>>> {
        let lens: Vec<usize> = batch.iter().map(|s| s.tokens.len()).collect();
        let layout = SeqLayout::new(&lens);
        let n = layout.num_tokens();
        if n == 0 {
            return Ok(batch.iter().map(|_| Vec::new()).collect());
        }
        let mut tokens = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut pos = Vec::with_capacity(n);
        for s in batch {
            if s.targets.len() != s.tokens.len() {
                return Err(ModelError::Input(format!(
                    "{} tokens but {} targets",
                    s.tokens.len(),
                    s.targets.len()
                )));
            }
            if s.tokens.len() > self.max_pos {
                return Err(ModelError::Input(format!(
                    "sequence of {} tokens exceeds the engine's max positions {}",
                    s.tokens.len(),
                    self.max_pos
                )));
            }
            tokens.extend_from_slice(s.tokens);
            targets.extend_from_slice(s.targets);
            pos.extend(0..s.tokens.len() as u32);
        }
        self.check_tokens(&tokens, "input")?;
        self.check_tokens(&targets, "target")?;
        let hf = self.prefill_hidden(&tokens, &pos, &layout, None)?;
        let b = &self.b;
        let mut hb = b.zeros_bf16(n * self.cfg.hidden_size).map_err(dev)?;
        b.to_bf16(&hf, &mut hb, n * self.cfg.hidden_size)
            .map_err(dev)?;
        let tg = b.upload_u32(&targets).map_err(dev)?;
        let mut lp = b.zeros_f32(n).map_err(dev)?;
        let mut lse = b.zeros_f32(n).map_err(dev)?;
        b.head_logprobs(
            &hb,
            &self.head,
            &tg,
            n,
            self.cfg.hidden_size,
            self.cfg.vocab_size,
            temperature,
            &mut lp,
            &mut lse,
        )
        .map_err(dev)?;
        let all = b.download_f32(&lp, n).map_err(dev)?;
        Ok((0..layout.num_seqs())
            .map(|s| all[layout.offset(s)..layout.offset(s) + layout.len(s)].to_vec())
            .collect())
    }

    /// Embeds and runs every layer over packed sequences; returns the final-norm hidden
    /// states `[n, H]` f32 (filling `cache` when given).
    fn prefill_hidden(
        &self,
        tokens: &[u32],
        pos: &[u32],
        layout: &SeqLayout,
        cache: Option<&mut DecodeState<B>>,
    ) -> Result<B::F32> {
        let b = &self.b;
        let n = tokens.len();
        let hd = self.cfg.hidden_size;
        let mut a = self.act(n)?;
        let tk = b.upload_u32(tokens).map_err(dev)?;
        let ps = b.upload_u32(pos).map_err(dev)?;
        let offs: Vec<u32> = (0..=layout.num_seqs())
            .map(|i| {
                if i == layout.num_seqs() {
                    n as u32
                } else {
                    layout.offset(i) as u32
                }
            })
            .collect();
        let offsets = b.upload_u32(&offs).map_err(dev)?;
        b.embed(&self.embed, self.cfg.vocab_size, &tk, n, hd, &mut a.x)
            .map_err(dev)?;
        let mut pass = Pass::Prefill {
            layout,
            offsets: &offsets,
            pos: &ps,
            cache,
        };
        for li in 0..self.layers.len() {
            self.layer(li, n, &mut a, &mut pass)?;
        }
        let mut hf = b.zeros_f32(n * hd).map_err(dev)?;
        b.rmsnorm(
            &a.x,
            &self.norm,
            n,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut a.rstd,
        )
        .map_err(dev)?;
        Ok(hf)
    }

    /// Logits `[rows, V]` (f32, on the host) of final hidden states `hf: [rows, H]`.
    fn logits_of(&self, hf: &B::F32, rows: usize) -> Result<Vec<f32>> {
        let b = &self.b;
        let (hd, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let mut hb = b.zeros_bf16(rows * hd).map_err(dev)?;
        b.to_bf16(hf, &mut hb, rows * hd).map_err(dev)?;
        let mut z = b.zeros_f32(rows * v).map_err(dev)?;
        b.linear(&hb, &self.head, rows, hd, v, &mut z)
            .map_err(dev)?;
        b.download_f32(&z, rows * v).map_err(dev)
    }

    /// Prefills `prompts` into a new decode state with room for `max_len` tokens per
    /// sequence; returns it and the logits `[B, V]` of every prompt's last position.
    ///
    /// # Errors
    /// Empty prompts, prompts longer than `max_len` or the engine's `max_pos`, bad token
    /// ids, device failures (out of memory for the cache).
    pub fn prefill(
        &self,
        prompts: &[&[u32]],
        max_len: usize,
    ) -> Result<(DecodeState<B>, Vec<f32>)> {
        let b = &self.b;
        if max_len > self.max_pos {
            return Err(ModelError::Input(format!(
                "max_len {max_len} exceeds the engine's max positions {}",
                self.max_pos
            )));
        }
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        if let Some(i) = lens.iter().position(|&l| l == 0 || l > max_len) {
            return Err(ModelError::Input(format!(
                "prompt {i} has {} tokens (1..={max_len} allowed)",
                lens[i]
            )));
        }
        let layout = SeqLayout::new(&lens);
        let tokens: Vec<u32> = prompts.iter().flat_map(|p| p.iter().copied()).collect();
        self.check_tokens(&tokens, "prompt")?;
        let pos: Vec<u32> = lens.iter().flat_map(|&l| 0..l as u32).collect();
        let kvd = self.cfg.num_kv_heads * self.cfg.head_dim;
        let slots = prompts.len();
        let mut st = DecodeState {
            k: (0..self.layers.len())
                .map(|_| b.zeros_bf16(slots * max_len * kvd).map_err(dev))
                .collect::<Result<_>>()?,
            v: (0..self.layers.len())
                .map(|_| b.zeros_bf16(slots * max_len * kvd).map_err(dev))
                .collect::<Result<_>>()?,
            lens: lens.iter().map(|&l| l as u32).collect(),
            max_len,
        };
        let hf = self.prefill_hidden(&tokens, &pos, &layout, Some(&mut st))?;
        // Last position of every prompt.
        let hd = self.cfg.hidden_size;
        let all = b.download_f32(&hf, tokens.len() * hd).map_err(dev)?;
        let mut last = Vec::with_capacity(slots * hd);
        for s in 0..slots {
            let r = layout.offset(s) + layout.len(s) - 1;
            last.extend_from_slice(&all[r * hd..(r + 1) * hd]);
        }
        let last = b.upload_f32(&last).map_err(dev)?;
        let logits = self.logits_of(&last, slots)?;
        Ok((st, logits))
    }

    /// One decode step: appends `tokens[b]` to sequence `b` and returns the logits `[B, V]`
    /// of the next position.
    ///
    /// # Errors
    /// A full cache, bad token ids, device failures.
    pub fn decode_step(&self, st: &mut DecodeState<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        let b = &self.b;
        let n = tokens.len();
        if n != st.lens.len() {
            return Err(ModelError::Input(format!(
                "{n} tokens for {} sequences",
                st.lens.len()
            )));
        }
        if let Some(i) = st.lens.iter().position(|&l| l as usize >= st.max_len) {
            return Err(ModelError::Input(format!(
                "sequence {i} is full ({} tokens)",
                st.max_len
            )));
        }
        self.check_tokens(tokens, "decode")?;
        let hd = self.cfg.hidden_size;
        let mut a = self.act(n)?;
        let tk = b.upload_u32(tokens).map_err(dev)?;
        let pos = b.upload_u32(&st.lens).map_err(dev)?;
        let new_lens: Vec<u32> = st.lens.iter().map(|&l| l + 1).collect();
        let lens = b.upload_u32(&new_lens).map_err(dev)?;
        b.embed(&self.embed, self.cfg.vocab_size, &tk, n, hd, &mut a.x)
            .map_err(dev)?;
        {
            let mut pass = Pass::Decode {
                st: &mut *st,
                lens: &lens,
                pos: &pos,
            };
            for li in 0..self.layers.len() {
                self.layer(li, n, &mut a, &mut pass)?;
            }
        }
        st.lens = new_lens;
        let mut hf = b.zeros_f32(n * hd).map_err(dev)?;
        b.rmsnorm(
            &a.x,
            &self.norm,
            n,
            hd,
            self.cfg.rms_norm_eps,
            &mut hf,
            &mut a.rstd,
        )
        .map_err(dev)?;
        self.logits_of(&hf, n)
    }

    /// Greedy decoding of `new_tokens` tokens after each prompt (ties to the lowest id):
    /// the generated ids per prompt.
    ///
    /// # Errors
    /// As [`Engine::prefill`] and [`Engine::decode_step`].
    pub fn generate_greedy(&self, prompts: &[&[u32]], new_tokens: usize) -> Result<Vec<Vec<u32>>> {
        let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let (mut st, mut logits) = self.prefill(prompts, longest + new_tokens)?;
        let v = self.cfg.vocab_size;
        let mut out = vec![Vec::with_capacity(new_tokens); prompts.len()];
        for step in 0..new_tokens {
            let next: Vec<u32> = logits
                .chunks(v)
                .map(|row| {
                    let mut best = 0;
                    for (i, &x) in row.iter().enumerate() {
                        if x > row[best] {
                            best = i;
                        }
                    }
                    best as u32
                })
                .collect();
            for (o, &t) in out.iter_mut().zip(&next) {
                o.push(t);
            }
            if step + 1 < new_tokens {
                logits = self.decode_step(&mut st, &next)?;
            }
        }
        Ok(out)
    }
}

/// `n` values `N(0, std²)` from a counter-based generator (SplitMix64 of `seed + i`, Box–Muller
/// per pair), in parallel and deterministic.
fn normal_values(n: usize, seed: u64, std: f32) -> Vec<f32> {
    use rayon::prelude::*;
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(2).enumerate().for_each(|(i, pair)| {
        let a = mix(seed.wrapping_add(2 * i as u64));
        let b = mix(seed.wrapping_add(2 * i as u64 + 1));
        let u1 = ((a >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        pair[0] = (r * t.cos()) as f32 * std;
        if pair.len() > 1 {
            pair[1] = (r * t.sin()) as f32 * std;
        }
    });
    out
}

enum Pass<'a, B: Backend> {
    Prefill {
        layout: &'a SeqLayout,
        offsets: &'a B::U32,
        pos: &'a B::U32,
        cache: Option<&'a mut DecodeState<B>>,
    },
    Decode {
        st: &'a mut DecodeState<B>,
        lens: &'a B::U32,
        pos: &'a B::U32,
    },
}

/// The CPU engine of a model (the reference of every device engine).
///
/// # Errors
/// As [`Engine::from_model`].
pub fn cpu_engine(model: &Model, max_pos: usize) -> Result<Engine<CpuBackend>> {
    Engine::from_model(model, CpuBackend, max_pos)
}
