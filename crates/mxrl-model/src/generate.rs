//! Batched decode with per-sequence KV caches, and seeded sampling.

use crate::error::{ModelError, Result};
use crate::model::{HiddenStates, Keep, KvCache, Model, Pass, RoutingTrace};
use mxrl_tensor::routing::Routes;
use mxrl_tensor::SeqLayout;
use rand::{Rng, SeedableRng};

/// Sampling settings of [`Model::generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax, lowest id among ties).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability mass
    /// reaches `top_p` (`1.0` = off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (`0` = off).
    pub top_k: usize,
    /// Seed; prompt `i` of a call samples from ChaCha8 seeded with `seed + i`, so a sequence's
    /// samples do not depend on its batch-mates.
    pub seed: u64,
    /// Maximum number of new tokens per sequence.
    pub max_new_tokens: usize,
    /// Generation of a sequence ends after it samples one of these tokens.
    pub stop_tokens: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_new_tokens: 16,
            stop_tokens: Vec::new(),
        }
    }
}

/// Result of [`Model::prefill`].
#[derive(Clone, Debug)]
pub struct Prefilled {
    /// One filled cache per prompt.
    pub caches: Vec<KvCache>,
    /// Logits `[V]` at the last position of each prompt.
    pub last_logits: Vec<Vec<f32>>,
    /// Routing of each prompt's tokens.
    pub routing: Vec<RoutingTrace>,
}

/// Result of [`Model::decode_step`].
#[derive(Clone, Debug)]
pub struct DecodeStep {
    /// Logits `[V]` per row.
    pub logits: Vec<Vec<f32>>,
    /// Per layer, the routes of the new tokens (`[rows, k]`; `None` for dense layers).
    pub routes: Vec<Option<Routes>>,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled (it is included in `tokens`).
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

/// One generated sequence.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// `log softmax(logits / temperature)[token]` of each new token under the full (not top-k /
    /// top-p truncated) distribution at the sampling temperature (temperature 1 when greedy) —
    /// the quantity the trainer recomputes with [`crate::ForwardOptions::temperature`].
    pub logprobs: Vec<f32>,
    /// Routing of every token the model consumed: the prompt followed by all new tokens but
    /// the last, i.e. exactly the inputs of [`crate::SeqInput::next_token`] over
    /// `prompt ++ tokens`, so it can be replayed in the training forward.
    pub routing: RoutingTrace,
    /// Why generation stopped.
    pub finish: FinishReason,
    /// The residual stream after every decoder layer for the same tokens as `routing` (the
    /// prompt's from prefill, then one per decode step) — [`Model::generate_capturing`] only.
    pub hidden: Option<HiddenStates>,
}

/// Picks a token from one row of logits; returns `(token, logprob)` as documented on
/// [`Generation::logprobs`].
pub fn sample_token(logits: &[f32], sp: &SamplingParams, rng: &mut impl Rng) -> (u32, f32) {
    // Greedy draws nothing, so the generator stream is the same as before it.
    let u = if sp.temperature == 0.0 {
        0.0
    } else {
        rng.gen::<f64>()
    };
    mxrl_tensor::sample::sample_row(logits, sp.temperature, sp.top_p, sp.top_k, u)
}

fn append_routes(
    trace: &mut RoutingTrace,
    layer_routes: &[Option<Routes>],
    row0: usize,
    rows: usize,
) {
    for (d, s) in trace.layers.iter_mut().zip(layer_routes.iter().flatten()) {
        let k = s.top_k;
        d.ids.extend_from_slice(&s.ids[row0 * k..(row0 + rows) * k]);
        d.weights
            .extend_from_slice(&s.weights[row0 * k..(row0 + rows) * k]);
    }
}

impl Model {
    /// Runs the prompts through the model, filling one fresh [`KvCache`] per prompt.
    pub fn prefill(&self, prompts: &[&[u32]]) -> Result<Prefilled> {
        Ok(self.prefill_impl(prompts, false)?.0)
    }

    /// [`Model::prefill`], plus (when `capture`) each prompt's per-layer residual stream.
    fn prefill_impl(
        &self,
        prompts: &[&[u32]],
        capture: bool,
    ) -> Result<(Prefilled, Option<Vec<HiddenStates>>)> {
        self.check_current()?;
        let c = self.config();
        let mut tokens = Vec::new();
        let mut lens = Vec::new();
        for (b, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(ModelError::Input(format!("prompt {b} is empty")));
            }
            self.check_tokens(p, &format!("prompt {b}"))?;
            tokens.extend_from_slice(p);
            lens.push(p.len());
        }
        let layout = SeqLayout::new(&lens);
        let mut caches = vec![KvCache::new(c.num_layers); prompts.len()];
        let trunk = self.trunk(
            &tokens,
            &layout.positions(),
            Pass::Prefill {
                layout: &layout,
                caches: Some(&mut caches),
            },
            None,
            Keep::Nothing,
            capture,
        );
        let h = c.hidden_size;
        let mut last_h = Vec::with_capacity(prompts.len() * h);
        for b in 0..prompts.len() {
            let r = layout.offset(b) + layout.len(b) - 1;
            last_h.extend_from_slice(&trunk.h_final[r * h..(r + 1) * h]);
        }
        let logits = self.lm_head(&last_h, prompts.len());
        let v = c.vocab_size;
        let rows = logits.chunks(v).map(|r| r.to_vec()).collect();
        let traces = (0..prompts.len())
            .map(|b| {
                let mut t = RoutingTrace::zeros(self.config(), 0);
                append_routes(&mut t, &trunk.routes, layout.offset(b), layout.len(b));
                t
            })
            .collect();
        let hidden = capture.then(|| {
            (0..prompts.len())
                .map(|b| {
                    HiddenStates::from_packed(&trunk.hidden, h, layout.offset(b), layout.len(b))
                })
                .collect()
        });
        Ok((
            Prefilled {
                caches,
                last_logits: rows,
                routing: traces,
            },
            hidden,
        ))
    }

    /// One decode step: token `tokens[r]` is appended to `caches[r]` (at position
    /// `caches[r].len()`).
    pub fn decode_step(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<DecodeStep> {
        Ok(self.decode_step_impl(tokens, caches, false)?.0)
    }

    /// [`Model::decode_step`], plus (when `capture`) the per-layer residual stream of the new
    /// rows (`[layer][rows·H]`).
    fn decode_step_impl(
        &self,
        tokens: &[u32],
        caches: &mut [KvCache],
        capture: bool,
    ) -> Result<(DecodeStep, Vec<Vec<f32>>)> {
        self.check_current()?;
        if tokens.len() != caches.len() {
            return Err(ModelError::Input(format!(
                "decode_step: {} tokens for {} caches",
                tokens.len(),
                caches.len()
            )));
        }
        self.check_tokens(tokens, "decode tokens")?;
        let positions: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let trunk = self.trunk(
            tokens,
            &positions,
            Pass::Decode { caches },
            None,
            Keep::Nothing,
            capture,
        );
        let logits = self.lm_head(&trunk.h_final, tokens.len());
        let v = self.config().vocab_size;
        Ok((
            DecodeStep {
                logits: logits.chunks(v).map(|r| r.to_vec()).collect(),
                routes: trunk.routes,
            },
            trunk.hidden,
        ))
    }

    /// Samples continuations of a batch of prompts with batched decode (all unfinished
    /// sequences advance together, each against its own KV cache).
    pub fn generate(&self, prompts: &[&[u32]], sp: &SamplingParams) -> Result<Vec<Generation>> {
        self.generate_impl(prompts, sp, false)
    }

    /// [`Model::generate`] that also returns each sequence's residual stream after every
    /// decoder layer ([`Generation::hidden`]): the prompt's from prefill, then one row per
    /// decode step, covering the same tokens as [`Generation::routing`]. Tokens and logprobs
    /// are those [`Model::generate`] gives.
    pub fn generate_capturing(
        &self,
        prompts: &[&[u32]],
        sp: &SamplingParams,
    ) -> Result<Vec<Generation>> {
        self.generate_impl(prompts, sp, true)
    }

    fn generate_impl(
        &self,
        prompts: &[&[u32]],
        sp: &SamplingParams,
        capture: bool,
    ) -> Result<Vec<Generation>> {
        if !(sp.temperature >= 0.0 && sp.temperature.is_finite()) {
            return Err(ModelError::Input(format!(
                "temperature {} must be ≥ 0",
                sp.temperature
            )));
        }
        if !(sp.top_p > 0.0 && sp.top_p <= 1.0) {
            return Err(ModelError::Input(format!(
                "top_p {} must be in (0, 1]",
                sp.top_p
            )));
        }
        let (
            Prefilled {
                mut caches,
                last_logits: mut logits,
                routing: mut traces,
            },
            mut hidden,
        ) = self.prefill_impl(prompts, capture)?;
        let b = prompts.len();
        let mut rngs: Vec<rand_chacha::ChaCha8Rng> = (0..b)
            .map(|i| rand_chacha::ChaCha8Rng::seed_from_u64(sp.seed.wrapping_add(i as u64)))
            .collect();
        let mut out: Vec<(Vec<u32>, Vec<f32>, Option<FinishReason>)> =
            vec![(Vec::new(), Vec::new(), None); b];
        let mut active: Vec<usize> = (0..b).collect();
        if sp.max_new_tokens == 0 {
            for o in out.iter_mut() {
                o.2 = Some(FinishReason::Length);
            }
            active.clear();
        }
        // logits[j] belongs to active[j]
        while !active.is_empty() {
            let mut next_active = Vec::new();
            let mut feed = Vec::new();
            for (j, &i) in active.iter().enumerate() {
                let (tok, lp) = sample_token(&logits[j], sp, &mut rngs[i]);
                out[i].0.push(tok);
                out[i].1.push(lp);
                if sp.stop_tokens.contains(&tok) {
                    out[i].2 = Some(FinishReason::Stop);
                } else if out[i].0.len() >= sp.max_new_tokens {
                    out[i].2 = Some(FinishReason::Length);
                } else {
                    next_active.push(i);
                    feed.push(tok);
                }
            }
            if next_active.is_empty() {
                break;
            }
            let mut step_caches: Vec<KvCache> = next_active
                .iter()
                .map(|&i| std::mem::replace(&mut caches[i], KvCache::new(0)))
                .collect();
            let (DecodeStep { logits: lg, routes }, step_hidden) =
                self.decode_step_impl(&feed, &mut step_caches, capture)?;
            for (j, (&i, c)) in next_active.iter().zip(step_caches).enumerate() {
                caches[i] = c;
                append_routes(&mut traces[i], &routes, j, 1);
                if let Some(hs) = hidden.as_mut() {
                    hs[i].append_packed(&step_hidden, j, 1);
                }
            }
            logits = lg;
            active = next_active;
        }
        let mut hidden = hidden.map(|h| h.into_iter().map(Some).collect::<Vec<_>>());
        Ok(out
            .into_iter()
            .zip(traces)
            .enumerate()
            .map(|(i, ((tokens, logprobs, fin), routing))| Generation {
                tokens,
                logprobs,
                routing,
                finish: fin.expect("every sequence finishes"),
                hidden: hidden.as_mut().and_then(|h| h[i].take()),
            })
            .collect())
    }
}
