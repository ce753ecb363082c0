//! `mxrl synth` (hidden): write a synthetic checkpoint in a real Hugging Face MoE layout, for
//! tests, benchmarks and trying the converter without downloading a model.

use anyhow::{bail, Result};
use mxrl_ckpt::synth::{write_synthetic, Arch, Fp8Scales, SynthSpec};
use std::path::PathBuf;

/// Arguments of `mxrl synth`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// qwen3-moe, qwen2-moe or deepseek-v3.
    #[arg(long, default_value = "qwen3-moe")]
    arch: String,
    /// Output directory (must not exist).
    #[arg(long)]
    out: PathBuf,
    /// Decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Hidden size.
    #[arg(long)]
    hidden: Option<usize>,
    /// Routed experts per layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Expert intermediate size.
    #[arg(long)]
    moe_intermediate: Option<usize>,
    /// Attention heads (Qwen: head_dim = hidden / heads).
    #[arg(long)]
    heads: Option<usize>,
    /// Shard files.
    #[arg(long)]
    shards: Option<usize>,
    /// DeepSeek-V3 only: store linear weights as block FP8 with `pow2` or `arbitrary` scales.
    #[arg(long)]
    fp8: Option<String>,
    /// Dense (MLP-only) layers at the start (DeepSeek-V3 `first_k_dense_replace`, Qwen
    /// `mlp_only_layers`); may be all layers.
    #[arg(long)]
    dense_layers: Option<usize>,
}

/// Run `mxrl synth`.
pub fn run(a: Args) -> Result<()> {
    let Some(arch) = Arch::parse(&a.arch) else {
        bail!(
            "--arch `{}`: expected qwen3-moe, qwen2-moe or deepseek-v3",
            a.arch
        );
    };
    if a.out.exists() {
        bail!("{}: exists already", a.out.display());
    }
    let mut s = SynthSpec::tiny(arch);
    if let Some(v) = a.layers {
        s.layers = v;
    }
    if let Some(v) = a.hidden {
        s.hidden = v;
        s.intermediate = 2 * v;
    }
    if let Some(v) = a.experts {
        s.experts = v;
    }
    if let Some(v) = a.moe_intermediate {
        s.moe_intermediate = v;
        s.shared_intermediate = v;
    }
    if let Some(v) = a.heads {
        s.heads = v;
        if arch != Arch::DeepseekV3 {
            s.head_dim = s.hidden / v;
            s.kv_heads = (v / 4).max(1);
        }
    }
    if let Some(v) = a.shards {
        s.shards = v;
    }
    if let Some(v) = a.dense_layers {
        if v > s.layers {
            bail!("--dense-layers {v}: the model has {} layers", s.layers);
        }
        s.first_k_dense = v;
    }
    s.fp8 = match a.fp8.as_deref() {
        None => None,
        Some("pow2") => Some(Fp8Scales::PowerOfTwo),
        Some("arbitrary") => Some(Fp8Scales::Arbitrary),
        Some(o) => bail!("--fp8 `{o}`: expected pow2 or arbitrary"),
    };
    let info = write_synthetic(&s, &a.out)?;
    println!(
        "wrote {} ({} shard(s), {:.3} GB of tensors, {} gate/up pair(s) straddling shards)",
        a.out.display(),
        info.files.len(),
        info.data_bytes as f64 / 1e9,
        info.straddling.len()
    );
    Ok(())
}
