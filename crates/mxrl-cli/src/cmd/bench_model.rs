//! `mxrl bench model`: the device engine on a fixed configuration (by default the 2.63 B
//! Qwen3-MoE the team measured transformers on: vocab 32 000, hidden 2048, 8 layers, 16 q /
//! 4 kv heads of 128, 64 experts top-8, moe_intermediate 768, BF16, random weights): prefill of
//! one sequence (per-token logprobs), decode ms/step at several batch sizes after a prompt,
//! the decode roofline (weight bytes per step over the measured device copy bandwidth) and,
//! with `--hf-json`, the ratios to transformers' eager model timed by `scripts/bench_hf.py` in
//! the same device call.

use anyhow::{bail, Context, Result};
use mxrl_formats::Format;
use mxrl_model::engine::Engine;
use mxrl_model::{Arch, ModelConfig, SeqInput};
use mxrl_tensor::device::{Backend, CpuBackend};
use mxrl_tensor::qlinear::{BackwardMode, LinearSpec};
use mxrl_tensor::sample::SampleParams;
use std::path::PathBuf;
use std::time::Instant;

/// Untimed training steps before the timed ones.
const TRAIN_WARMUP: usize = 3;

/// Arguments of `mxrl bench model`.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// `cpu` or `cuda` (GPU 0; needs a binary built with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Layers of the benchmark configuration.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// A smaller configuration (hidden 256, 8 experts, vocab 1000) for a quick check.
    #[arg(long)]
    small: bool,
    /// Routed experts per layer instead of the configuration's (e.g. 128: Qwen3-30B-A3B's).
    #[arg(long)]
    experts: Option<usize>,
    /// Query heads of 128 instead of the configuration's (e.g. 32: Qwen3-30B-A3B's).
    #[arg(long)]
    q_heads: Option<usize>,
    /// Vocabulary size instead of the configuration's.
    #[arg(long)]
    vocab: Option<usize>,
    /// Prefill length (one sequence).
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 8, 32, 128])]
    batches: Vec<usize>,
    /// Prompt length before decoding.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Timed decode steps per batch size (after two warm-up steps).
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Whole generations timed per batch size (`--generate-batches`): this many new tokens
    /// from fresh prompts, as one rollout runs them (prefill, the recorded decode step,
    /// sampling with temperature 1, routes and 64 probes recorded and read back).
    #[arg(long, default_value_t = 32)]
    generate_tokens: usize,
    /// Batch sizes of the whole-generation figure (none by default).
    #[arg(long, value_delimiter = ',')]
    generate_batches: Vec<usize>,
    /// Samples per prompt in the whole generations: each batch holds batch ÷ N distinct
    /// prompts, each N times, as a GRPO rollout does (every distinct prompt is prefilled
    /// once); 1 = every prompt distinct.
    #[arg(long, default_value_t = 1)]
    generate_samples: usize,
    /// Timed prefill repetitions (after one warm-up).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Training step shape: sequences × tokens (forward + backward + AdamW); 0 skips it.
    #[arg(long, default_value_t = 8)]
    train_seqs: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 512)]
    train_len: usize,
    /// Timed training steps (after `TRAIN_WARMUP` warm-up steps: the first steps grow the
    /// device memory pool and run measurably slower).
    #[arg(long, default_value_t = 5)]
    train_steps: usize,
    /// Also measure prefill and decode with the routed experts in these block formats
    /// (`bf16`, `mxfp8`, `nvfp4`, `fp8-block`; comma separated), each against BF16 in the same
    /// run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![String::from("bf16")])]
    expert_formats: Vec<String>,
    /// Also time the training step under these precision recipes (presets such as `mxfp8`,
    /// `nvfp4-hp`, `fp8-block`, or TOML files; comma separated): the engine runs each plan's
    /// block-format linears on their stored bytes with the plan's backward mode, each against
    /// BF16 in the same run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![String::from("bf16")])]
    train_recipes: Vec<String>,
    /// Also measure prefill and decode under these precision recipes (presets or TOML files;
    /// comma separated): every linear the plan stores in a block format (attention, shared
    /// and routed experts) runs on its stored bytes, as a rollout under that recipe does,
    /// each against BF16 in the same run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![String::from("bf16")])]
    decode_recipes: Vec<String>,
    /// CUDA: average rows per expert from which the routed-expert GEMMs run one cuBLAS call
    /// per expert (0 = always; by default never: the one-launch grouped kernels).
    #[arg(long)]
    per_expert_rows: Option<usize>,
    /// JSON written by `scripts/bench_hf.py` in the same run: print the ratios to it.
    #[arg(long)]
    hf_json: Option<PathBuf>,
    /// Write the results as JSON (atomically: the file is replaced only once complete).
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Dense BF16 peak of the device in TFLOP/s for the MFU figure (H200: 989 by the
    /// datasheet).
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
}

/// The benchmark configuration.
pub fn bench_config(layers: usize, small: bool) -> ModelConfig {
    let mut c = ModelConfig::tiny();
    c.arch = Arch::Qwen3Moe;
    c.vocab_size = 32_000;
    c.hidden_size = 2048;
    c.num_layers = layers;
    c.num_heads = 16;
    c.num_kv_heads = 4;
    c.head_dim = 128;
    c.intermediate_size = 6144;
    c.moe_intermediate_size = 768;
    c.num_experts = 64;
    c.num_experts_per_tok = 8;
    c.mlp_only_layers = Vec::new();
    c.decoder_sparse_step = 1;
    c.norm_topk_prob = true;
    c.tie_word_embeddings = false;
    c.initializer_range = 0.02;
    if small {
        c.vocab_size = 1000;
        c.hidden_size = 256;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 64;
        c.moe_intermediate_size = 128;
        c.num_experts = 8;
        c.num_experts_per_tok = 2;
    }
    c
}

#[derive(serde::Serialize, Default, Debug)]
struct Results {
    device: String,
    parameters: usize,
    prefill_tokens: usize,
    prefill_ms: f64,
    prefill_tokens_per_s: f64,
    /// (batch, ms/step, roofline ms/step)
    decode: Vec<(usize, f64, Option<f64>)>,
    /// (batch, ms/step) with every op launched from the host (no recorded graph).
    decode_plain: Vec<(usize, f64)>,
    /// Prefill and decode with the routed experts in a block format.
    expert_formats: Vec<FormatResult>,
    /// Prefill and decode under a whole precision recipe (`--decode-recipes`).
    decode_recipes: Vec<FormatResult>,
    /// Whole generations in BF16 (`--generate-batches`).
    generate: Vec<GenResult>,
    copy_gbps: Option<f64>,
    peak_device_bytes: Option<usize>,
    train_tokens: usize,
    train_step_ms: Option<f64>,
    train_tokens_per_s: Option<f64>,
    /// Model FLOPs utilisation of the training step against `--peak-tflops`.
    train_mfu: Option<f64>,
    /// (recipe, training step ms, what ran) for `--train-recipes` other than BF16.
    train_recipes: Vec<(String, f64, String)>,
}

/// Prefill and decode with the routed experts in one block format.
#[derive(serde::Serialize, Default, Debug)]
struct FormatResult {
    format: String,
    /// Seconds to quantize every expert (host, contract library) and upload the bytes.
    quantize_s: f64,
    prefill_ms: f64,
    /// (batch, ms/step, roofline ms/step of the stored bytes)
    decode: Vec<(usize, f64, Option<f64>)>,
    /// Whole generations (`--generate-batches`).
    generate: Vec<GenResult>,
}

/// One whole generation of `--generate-tokens` new tokens at one batch size.
#[derive(serde::Serialize, Default, Debug, Clone)]
struct GenResult {
    batch: usize,
    /// Wall time of the generation (median of two after one warm-up).
    ms: f64,
    /// New tokens per second.
    tokens_per_s: f64,
    prefill_ms: f64,
    decode_ms: f64,
    decode_steps: u64,
    readback_ms: f64,
    /// Prompt tokens the prefill ran (each distinct prompt once).
    prefill_tokens: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite timings"));
    v[v.len() / 2]
}

/// Run `mxrl bench model`.
pub fn run(a: ModelArgs) -> Result<()> {
    let mut cfg = bench_config(a.layers, a.small);
    cfg.num_experts = a.experts.unwrap_or(cfg.num_experts);
    cfg.num_heads = a.q_heads.unwrap_or(cfg.num_heads);
    cfg.vocab_size = a.vocab.unwrap_or(cfg.vocab_size);
    cfg.validate()?;
    let max_pos = a
        .prefill
        .max(a.prompt + a.steps.max(a.generate_tokens) + 4)
        .max(a.train_len);
    let r = match a.device.as_str() {
        "cpu" => {
            eprintln!("building the model on the CPU ...");
            let mut e = Engine::random(&cfg, CpuBackend, max_pos, 1)?;
            measure(&mut e, &a, None, |_| None)?
        }
        "cuda" | "cuda:0" => cuda(&cfg, &a, max_pos)?,
        other => bail!("--device {other}: expected cpu or cuda"),
    };
    print_results(&r, &a)
}

#[cfg(feature = "cuda")]
fn cuda(cfg: &ModelConfig, a: &ModelArgs, max_pos: usize) -> Result<Results> {
    let b = mxrl_cuda::backend::CudaBackend::new(0)
        .map_err(|e| anyhow::anyhow!("--device cuda: GPU 0 is not usable: {e}"))?;
    if let Some(r) = a.per_expert_rows {
        b.set_per_expert_rows(r);
    }
    let copy = b.copy_bandwidth_gbps(1 << 30)?;
    eprintln!(
        "{}: device copy {copy:.0} GB/s; building the model on the device ...",
        b.name()
    );
    let mut e = Engine::random(cfg, b, max_pos, 1)?;
    measure(&mut e, a, Some(copy), |e| e.backend().peak_bytes())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &ModelConfig, _: &ModelArgs, _: usize) -> Result<Results> {
    bail!(
        "--device cuda: this mxrl binary was built without CUDA support; rebuild it with \
         `cargo build --release -p mxrl-cli --features cuda`"
    )
}

fn measure<B: Backend>(
    e: &mut Engine<B>,
    a: &ModelArgs,
    copy_gbps: Option<f64>,
    peak: impl Fn(&Engine<B>) -> Option<usize>,
) -> Result<Results> {
    let v = e.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..a.prefill as u32).map(|i| (i * 7919 + 13) % v).collect();
    let batch = [SeqInput {
        tokens: &tokens,
        targets: &tokens,
    }];
    let mut r = Results {
        device: a.device.clone(),
        parameters: e.num_parameters(),
        prefill_tokens: a.prefill,
        copy_gbps,
        ..Default::default()
    };
    r.prefill_ms = time_prefill(e, a, &batch)?;
    r.prefill_tokens_per_s = a.prefill as f64 / (r.prefill_ms / 1e3);
    eprintln!("prefill {} tokens: {:.2} ms", a.prefill, r.prefill_ms);
    for &bs in &a.batches {
        let (ms, plain_ms) = time_decode(e, a, bs, true)?;
        let roof = copy_gbps.map(|g| e.decode_weight_bytes(bs) as f64 / (g * 1e9) * 1e3);
        match plain_ms {
            Some(p) => {
                eprintln!("decode batch {bs}: {ms:.3} ms/step ({p:.3} op by op)");
                r.decode_plain.push((bs, p));
            }
            None => eprintln!("decode batch {bs}: {ms:.3} ms/step"),
        }
        r.decode.push((bs, ms, roof));
    }
    r.generate = time_generations(e, a, "BF16")?;
    // The routed experts in each block format (stored bytes on the device, activations
    // quantized per forward): prefill and decode again, then back to BF16 for training.
    for fmt in a.expert_formats.iter().filter(|f| f.as_str() != "bf16") {
        let spec = expert_spec(fmt)?;
        let t = Instant::now();
        e.quantize_experts(spec)?;
        let quantize_s = t.elapsed().as_secs_f64();
        eprintln!("{fmt} experts quantized in {quantize_s:.1} s");
        let label = format!("{fmt} experts");
        r.expert_formats.push(time_variant(
            e, a, &batch, copy_gbps, fmt, &label, quantize_s,
        )?);
    }
    e.quantize_experts(LinearSpec::bf16())?;
    // Whole recipes: every linear the plan stores in a block format, as a rollout runs them.
    for recipe in a.decode_recipes.iter().filter(|x| x.as_str() != "bf16") {
        let plan = mxrl_rl::moe::plan_for(e.config(), recipe)?;
        mxrl_rl::engine::check_engine_plan(&plan)?;
        let t = Instant::now();
        let what = e.apply_plan(&plan)?;
        let quantize_s = t.elapsed().as_secs_f64();
        eprintln!("recipe {recipe} (quantized in {quantize_s:.1} s): {what}");
        let label = format!("recipe {recipe}");
        r.decode_recipes.push(time_variant(
            e, a, &batch, copy_gbps, recipe, &label, quantize_s,
        )?);
    }
    if !r.decode_recipes.is_empty() {
        let plan = mxrl_rl::moe::plan_for(e.config(), "bf16")?;
        e.apply_plan(&plan)?;
    }
    if a.train_seqs > 0 && a.train_len > 1 {
        e.enable_training()?;
        let (ms, ntok) = time_training(e, a, "bf16")?;
        r.train_tokens = ntok;
        r.train_step_ms = Some(ms);
        let tps = ntok as f64 / (ms / 1e3);
        r.train_tokens_per_s = Some(tps);
        // 6 × active parameters per token (forward 2, backward 4) plus attention
        // (12 · layers · T · Hq·D per token for causal attention fwd+bwd, halved by causality).
        let c = e.config();
        let active = e.active_parameters() as f64;
        let attn =
            6.0 * c.num_layers as f64 * a.train_len as f64 * (c.num_heads * c.head_dim) as f64;
        let flops_per_token = 6.0 * active + attn;
        r.train_mfu = Some(flops_per_token * tps / (a.peak_tflops * 1e12));
        for recipe in a.train_recipes.iter().filter(|x| x.as_str() != "bf16") {
            let plan = mxrl_rl::moe::plan_for(e.config(), recipe)?;
            mxrl_rl::engine::check_engine_plan(&plan)?;
            let what = e.apply_plan(&plan)?;
            eprintln!("recipe {recipe}: {what}");
            let (ms, _) = time_training(e, a, recipe)?;
            r.train_recipes.push((recipe.clone(), ms, what));
        }
    }
    r.peak_device_bytes = peak(e);
    Ok(r)
}

/// Prefill, decode at every `--batches` size and whole generations of the engine as it is now
/// (block-format experts or a recipe applied), as one [`FormatResult`] named `format`.
#[allow(clippy::too_many_arguments)]
fn time_variant<B: Backend>(
    e: &mut Engine<B>,
    a: &ModelArgs,
    batch: &[SeqInput<'_>],
    copy_gbps: Option<f64>,
    format: &str,
    label: &str,
    quantize_s: f64,
) -> Result<FormatResult> {
    let prefill_ms = time_prefill(e, a, batch)?;
    eprintln!("{label}: prefill {prefill_ms:.2} ms");
    let mut decode = Vec::new();
    for &bs in &a.batches {
        let (ms, _) = time_decode(e, a, bs, false)?;
        let roof = copy_gbps.map(|g| e.decode_weight_bytes(bs) as f64 / (g * 1e9) * 1e3);
        eprintln!("{label}: decode batch {bs}: {ms:.3} ms/step");
        decode.push((bs, ms, roof));
    }
    Ok(FormatResult {
        format: format.to_string(),
        quantize_s,
        prefill_ms,
        decode,
        generate: time_generations(e, a, label)?,
    })
}

/// Median training step (forward, backward, clipping and AdamW; block-format weights
/// re-quantized by the step) over `--train-steps` after the warm-up; returns it and the
/// tokens per step.
fn time_training<B: Backend>(
    e: &mut Engine<B>,
    a: &ModelArgs,
    label: &str,
) -> Result<(f64, usize)> {
    let v = e.config().vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..a.train_seqs)
        .map(|s| {
            (0..a.train_len as u32)
                .map(|i| (i * 131 + s as u32 * 977 + 5) % v)
                .collect()
        })
        .collect();
    let batch: Vec<SeqInput> = seqs.iter().map(|q| SeqInput::next_token(q)).collect();
    let ntok: usize = batch.iter().map(|b| b.tokens.len()).sum();
    let cfg = mxrl_tensor::optim::AdamWConfig {
        lr: 1e-5,
        ..Default::default()
    };
    let mut times = Vec::new();
    for step in 0..a.train_steps + TRAIN_WARMUP {
        let t = Instant::now();
        let (lp, tape) = e.forward_train(&batch, 1.0)?;
        let t_fwd = t.elapsed();
        // Loss = −mean logprob: dL/dlogprob = −1/N per token.
        let dl: Vec<Vec<f32>> = lp
            .iter()
            .map(|l| vec![-1.0 / ntok as f32; l.len()])
            .collect();
        e.zero_grads()?;
        // One micro-batch: its backward is the step's last (the gradient norm starts in it).
        e.backward_last(&tape, &dl)?;
        let t_bwd_queued = t.elapsed();
        e.backend().synchronize()?;
        let t_bwd = t.elapsed();
        drop(tape);
        e.optimizer_step(&cfg, 0.0, Some(1.0))?;
        e.backend().synchronize()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let f = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "{label} train step {step}: {ms:.1} ms (forward {:.1}, backward {:.1} of which {:.1} \
             queueing on the host, optimizer {:.1})",
            f(t_fwd),
            f(t_bwd - t_fwd),
            f(t_bwd_queued - t_fwd),
            ms - f(t_bwd)
        );
        if step >= TRAIN_WARMUP {
            times.push(ms);
        }
    }
    Ok((median(times), ntok))
}

/// The linear spec of `--expert-formats` entry `name` (forward only: the backward mode is not
/// used by inference).
fn expert_spec(name: &str) -> Result<LinearSpec> {
    let format = match name {
        "bf16" => return Ok(LinearSpec::bf16()),
        "mxfp8" => Format::Mxfp8,
        "nvfp4" => Format::Nvfp4,
        "fp8-block" | "fp8_block" => Format::Fp8Block,
        other => {
            bail!("--expert-formats: unknown format {other:?} (bf16, mxfp8, nvfp4, fp8-block)")
        }
    };
    Ok(LinearSpec::new(format, BackwardMode::HighPrecision)?)
}

/// Median ms of a prefill (per-token logprobs of one sequence) after one warm-up.
fn time_prefill<B: Backend>(e: &Engine<B>, a: &ModelArgs, batch: &[SeqInput<'_>]) -> Result<f64> {
    e.logprobs(batch, 1.0)?; // warm-up (module compilation, allocations)
    let mut times = Vec::new();
    for _ in 0..a.reps.max(1) {
        let t = Instant::now();
        let lp = e.logprobs(batch, 1.0)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if !lp[0].iter().all(|x| x.is_finite()) {
            bail!("non-finite logprobs in the prefill benchmark");
        }
    }
    Ok(median(times))
}

/// `bs` prompts of `len` tokens: token `i` of prompt `s` is `(i·m[0] + s·m[1] + m[2]) mod
/// vocab` (fixed, distinct per prompt).
fn bench_prompts(bs: usize, len: usize, vocab: usize, m: [u32; 3]) -> Vec<Vec<u32>> {
    let v = vocab as u32;
    (0..bs as u32)
        .map(|s| {
            (0..len as u32)
                .map(|i| (i * m[0] + s * m[1] + m[2]) % v)
                .collect()
        })
        .collect()
}

/// Greedy decode ms/step at batch `bs` with on-device sampling (only the ids come back),
/// replaying a recorded graph per step (the default), and with `plain` also op by op on the
/// same prompts (`None` where the device records no graphs).
fn time_decode<B: Backend>(
    e: &mut Engine<B>,
    a: &ModelArgs,
    bs: usize,
    plain: bool,
) -> Result<(f64, Option<f64>)> {
    let prompts = bench_prompts(bs, a.prompt, e.config().vocab_size, [31, 101, 7]);
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut timed = [f64::NAN; 2];
    let mut recorded = false;
    for (slot, graphs) in [(0usize, true), (1, false)] {
        if !graphs && (!recorded || !plain) {
            break; // no graphs on this device: the first pass already ran op by op
        }
        e.set_decode_graphs(graphs);
        let greedy = SampleParams::greedy();
        let (mut st, mut next, _) = e.prefill_sample(&refs, a.prompt + a.steps + 3, &greedy)?;
        let mut times = Vec::new();
        let mut first = Vec::new();
        for step in 0..a.steps + 2 {
            let t = Instant::now();
            let (ids, lps) = e.decode_sample(&mut st, &next, &greedy)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if step >= 2 {
                times.push(ms);
            } else {
                first.push(ms);
            }
            if !lps.iter().all(|x| x.is_finite()) {
                bail!("non-finite logprobs in the decode benchmark");
            }
            next = ids;
        }
        if graphs {
            eprintln!(
                "decode batch {bs}: first step {:.3} ms (op by op), second {:.3} ms (records \
                 the step where the device has graphs)",
                first[0], first[1]
            );
            recorded = st.graph_status().0;
            if let (false, Some(why)) = st.graph_status() {
                eprintln!("decode batch {bs}: graph recording failed ({why}); steps ran op by op");
            }
        }
        timed[slot] = median(times);
    }
    e.set_decode_graphs(true);
    Ok((timed[0], (recorded && plain).then_some(timed[1])))
}

/// Whole generations of `--generate-tokens` new tokens at each `--generate-batches` size from
/// fresh prompts of `--prompt` tokens, as a rollout runs them: sampled at temperature 1 (no
/// stop token, so every step runs), routes and the first 64 sequences' probes recorded and
/// read back. Median of two after one warm-up.
fn time_generations<B: Backend>(
    e: &Engine<B>,
    a: &ModelArgs,
    label: &str,
) -> Result<Vec<GenResult>> {
    let mut out = Vec::new();
    for &bs in &a.generate_batches {
        let n = a.generate_samples.max(1);
        if bs % n != 0 {
            bail!("--generate-batches {bs} is not a multiple of --generate-samples {n}");
        }
        let prompts = bench_prompts(bs / n, a.prompt, e.config().vocab_size, [17, 37, 3]);
        let refs: Vec<&[u32]> = prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.as_slice(), n))
            .collect();
        let rec = mxrl_model::engine::Record {
            routes: true,
            probes: 64,
        };
        let mut runs = Vec::new();
        for rep in 0..3u64 {
            let sp = SampleParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: rep,
                step: 0,
            };
            let t = Instant::now();
            let (_, tm) = e.generate_timed(&refs, a.generate_tokens, &sp, &[], rec)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if rep > 0 {
                runs.push(GenResult {
                    batch: bs,
                    ms,
                    tokens_per_s: (bs * a.generate_tokens) as f64 / (ms / 1e3),
                    prefill_ms: tm.prefill_s * 1e3,
                    decode_ms: tm.decode_s * 1e3,
                    decode_steps: tm.decode_steps,
                    readback_ms: tm.readback_s * 1e3,
                    prefill_tokens: tm.prefill_tokens,
                });
            }
        }
        runs.sort_by(|x, y| x.ms.total_cmp(&y.ms));
        let g = runs[runs.len() / 2].clone();
        eprintln!(
            "{label}: generate {} tokens at batch {bs}: {:.1} ms ({:.0} tokens/s; prefill \
             {:.1} ms of {} tokens, {} decode steps {:.1} ms, read-back {:.1} ms)",
            a.generate_tokens,
            g.ms,
            g.tokens_per_s,
            g.prefill_ms,
            g.prefill_tokens,
            g.decode_steps,
            g.decode_ms,
            g.readback_ms
        );
        out.push(g);
    }
    Ok(out)
}

fn print_results(r: &Results, a: &ModelArgs) -> Result<()> {
    let hf: Option<serde_json::Value> = match &a.hf_json {
        Some(p) => Some(
            serde_json::from_str(
                &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            )
            .with_context(|| format!("{}: not JSON", p.display()))?,
        ),
        None => None,
    };
    // scripts/bench_hf.py: {"figures": [{"figure": "train_step" | "prefill" | "decode", ...}]}.
    let figure = |kind: &str, batch: Option<usize>, key: &str| -> Option<f64> {
        hf.as_ref()?
            .get("figures")?
            .as_array()?
            .iter()
            .find(|f| {
                f.get("figure").and_then(|x| x.as_str()) == Some(kind)
                    && batch
                        .is_none_or(|b| f.get("batch").and_then(|x| x.as_u64()) == Some(b as u64))
            })?
            .get(key)?
            .as_f64()
    };
    println!(
        "mxrl bench model: {} parameters, device {}",
        r.parameters, r.device
    );
    if let Some(g) = r.copy_gbps {
        println!("device copy bandwidth (read + write): {g:.0} GB/s");
    }
    let ratio = |ours: f64, theirs: Option<f64>| {
        theirs.map_or(String::from("-"), |t| format!("{:.2}×", t / ours))
    };
    println!(
        "| figure | mxrl | transformers | speedup vs transformers | roofline | mxrl / roofline |"
    );
    println!("|---|---|---|---|---|---|");
    let hf_prefill = figure("prefill", None, "ms");
    println!(
        "| prefill {} tokens | {:.2} ms | {} | {} | | |",
        r.prefill_tokens,
        r.prefill_ms,
        hf_prefill.map_or("-".into(), |x| format!("{x:.2} ms")),
        ratio(r.prefill_ms, hf_prefill)
    );
    for &(bs, ms, roof) in &r.decode {
        let theirs = figure("decode", Some(bs), "ms_per_step");
        println!(
            "| decode batch {bs} | {ms:.3} ms/step | {} | {} | {} | {} |",
            theirs.map_or("-".into(), |x| format!("{x:.3} ms")),
            ratio(ms, theirs),
            roof.map_or("-".into(), |x| format!("{x:.3} ms")),
            roof.map_or("-".into(), |x| format!("{:.2}×", ms / x)),
        );
    }
    let rows = r
        .expert_formats
        .iter()
        .map(|f| (f, format!("{} experts", f.format)))
        .chain(
            r.decode_recipes
                .iter()
                .map(|f| (f, format!("recipe {}", f.format))),
        );
    for (f, label) in rows {
        let ratio_bf16 = |ours: f64, bf16: f64| format!("{:.2}× BF16's time", ours / bf16);
        println!(
            "| prefill {} tokens, {label} | {:.2} ms | | {} | | |",
            r.prefill_tokens,
            f.prefill_ms,
            ratio_bf16(f.prefill_ms, r.prefill_ms)
        );
        for &(bs, ms, roof) in &f.decode {
            let bf16 = r.decode.iter().find(|d| d.0 == bs).map(|d| d.1);
            println!(
                "| decode batch {bs}, {label} | {ms:.3} ms/step | | {} | {} | {} |",
                bf16.map_or("-".into(), |b| ratio_bf16(ms, b)),
                roof.map_or("-".into(), |x| format!("{x:.3} ms")),
                roof.map_or("-".into(), |x| format!("{:.2}×", ms / x)),
            );
        }
    }
    if !r.generate.is_empty() {
        println!();
        println!(
            "| whole generation ({} new tokens, {} per prompt) | batch | ms | tokens/s | vs BF16 \
             | prefill | decode steps | read-back |",
            a.generate_tokens,
            a.generate_samples.max(1)
        );
        println!("|---|---|---|---|---|---|---|---|");
        let rows = std::iter::once(("BF16".to_string(), &r.generate))
            .chain(
                r.expert_formats
                    .iter()
                    .map(|f| (format!("{} experts", f.format), &f.generate)),
            )
            .chain(
                r.decode_recipes
                    .iter()
                    .map(|f| (format!("recipe {}", f.format), &f.generate)),
            );
        for (label, gens) in rows {
            for g in gens {
                let base = r.generate.iter().find(|b| b.batch == g.batch);
                println!(
                    "| {label} | {} | {:.1} | {:.0} | {} | {:.1} ms | {} in {:.1} ms | {:.1} ms |",
                    g.batch,
                    g.ms,
                    g.tokens_per_s,
                    base.map_or("-".into(), |b| format!(
                        "{:.2}× tokens/s",
                        g.tokens_per_s / b.tokens_per_s
                    )),
                    g.prefill_ms,
                    g.decode_steps,
                    g.decode_ms,
                    g.readback_ms
                );
            }
        }
        println!();
    }
    for &(bs, ms) in &r.decode_plain {
        let graph = r.decode.iter().find(|d| d.0 == bs).map(|d| d.1);
        println!(
            "| decode batch {bs}, op by op (no graph) | {ms:.3} ms/step | | {} | | |",
            graph.map_or("-".into(), |g| format!("graph {:.2}× faster", ms / g))
        );
    }
    if let Some(p) = r.peak_device_bytes {
        println!(
            "peak device memory: {:.2} GiB",
            p as f64 / (1u64 << 30) as f64
        );
    }
    if let Some(ms) = r.train_step_ms {
        let theirs = figure("train_step", None, "tokens_per_s");
        let tps = r.train_tokens_per_s.unwrap_or(0.0);
        println!(
            "| training step {} tokens (fwd+bwd+AdamW) | {ms:.1} ms, {tps:.0} tok/s, MFU {:.1}% | {} | {} | | |",
            r.train_tokens,
            100.0 * r.train_mfu.unwrap_or(0.0),
            theirs.map_or("-".into(), |x| format!("{x:.0} tok/s")),
            theirs.map_or("-".into(), |t| format!("{:.2}×", tps / t)),
        );
    }
    if !r.train_recipes.is_empty() {
        if let Some(base) = r.train_step_ms {
            println!();
            println!("| recipe | training step | tokens/s | vs BF16 | what ran |");
            println!("|---|---|---|---|---|");
            println!(
                "| bf16 | {base:.1} ms | {:.0} | 1.00× | BF16 linears |",
                r.train_tokens as f64 / (base / 1e3)
            );
            for (name, ms, what) in &r.train_recipes {
                println!(
                    "| {name} | {ms:.1} ms | {:.0} | {:.2}× | {what} |",
                    r.train_tokens as f64 / (ms / 1e3),
                    ms / base
                );
            }
        }
    }
    if let Some(p) = &a.json_out {
        // Through the one atomic-write helper: an interrupted run leaves the previous file
        // (or none), never a truncated one.
        let json = serde_json::to_string_pretty(r)?;
        mxrl_ckpt::write_bytes_atomic(p, json.as_bytes())
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
