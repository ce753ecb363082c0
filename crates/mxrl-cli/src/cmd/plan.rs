//! `mxrl plan`: resolve a recipe against a model into the per-tensor precision plan,
//! print it (table or JSON), export it to Miles / Megatron TE / ModelOpt-SGLang syntax,
//! or audit a quantized checkpoint against it.

use anyhow::{bail, Context, Result};
use mxrl_plan::{export, resolve, summary_table, ExportKind, Inventory, PrecisionPlan, Recipe};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `mxrl plan`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory (config.json + safetensors headers) or a bare config.json.
    #[arg(long, value_name = "DIR_OR_CONFIG", required_unless_present = "audit")]
    model: Option<PathBuf>,
    /// Recipe TOML file or built-in preset (bf16, mxfp8, mxfp8-hp, mxfp8-dq, nvfp4-hp, nvfp4-dq,
    /// fp8-block).
    #[arg(long, value_name = "FILE_OR_PRESET")]
    recipe: String,
    /// Print the plan as JSON (one entry per HF tensor, in checkpoint order).
    #[arg(long, conflicts_with = "export")]
    json: bool,
    /// Print the plan in a foreign syntax, checked by re-resolving it: miles, te-yaml, ignore.
    #[arg(long, value_name = "KIND")]
    export: Option<String>,
    /// Compare what a quantized checkpoint stores with the plan; exit 1 on any drift.
    #[arg(long, value_name = "CHECKPOINT_DIR", conflicts_with_all = ["model", "export"])]
    audit: Option<PathBuf>,
    /// Write the output to this file (atomically) instead of stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// A directory with safetensors weights is read through its headers; a directory with
/// only `config.json`, or a config file itself, gives the config-implied inventory.
fn load_inventory(model: &Path) -> Result<Inventory> {
    if model.is_dir() {
        let has_weights = model.join("model.safetensors.index.json").is_file()
            || std::fs::read_dir(model)
                .with_context(|| format!("listing {}", model.display()))?
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
        if has_weights {
            return Ok(mxrl_ckpt::model_inventory(model)?);
        }
        return Ok(Inventory::from_config_path(&model.join("config.json"))?);
    }
    Ok(Inventory::from_config_path(model)?)
}

/// Write `text` to `out` atomically (`mxrl_ckpt::write_atomic`), or to stdout.
fn emit(text: &str, out: Option<&Path>) -> Result<()> {
    match out {
        None => {
            std::io::stdout().write_all(text.as_bytes())?;
            Ok(())
        }
        Some(path) => Ok(mxrl_ckpt::write_bytes_atomic(path, text.as_bytes())?),
    }
}

fn json_text(plan: &PrecisionPlan) -> Result<String> {
    Ok(serde_json::to_string_pretty(&plan.to_json())? + "\n")
}

/// Run `mxrl plan`.
pub fn run(a: Args) -> Result<()> {
    let recipe = Recipe::load(&a.recipe)?;
    if let Some(dir) = &a.audit {
        let (plan, report) = mxrl_ckpt::audit_dir(dir, &recipe)
            .with_context(|| format!("auditing {} against `{}`", dir.display(), a.recipe))?;
        let text = if a.json {
            let findings: Vec<serde_json::Value> = report
                .findings
                .iter()
                .map(|f| {
                    serde_json::json!({
                        "hf": f.hf,
                        "planned": f.planned.map(|p| p.name()),
                        "stored": f.stored.as_ref().map(|s| s.to_string()),
                        "note": f.note,
                    })
                })
                .collect();
            serde_json::to_string_pretty(&serde_json::json!({
                "contract": plan.hash(),
                "checked": report.checked,
                "findings": findings,
            }))? + "\n"
        } else {
            report.render()
        };
        emit(&text, a.out.as_deref())?;
        if !report.is_clean() {
            eprintln!(
                "drift: {} tensor(s) of {} differ from plan {}",
                report.findings.len(),
                dir.display(),
                plan.short_hash()
            );
            std::process::exit(1);
        }
        return Ok(());
    }
    let model = a.model.as_deref().context("--model is required")?;
    let inv = load_inventory(model)?;
    let plan = resolve(&inv, &recipe)
        .with_context(|| format!("resolving `{}` against {}", a.recipe, model.display()))?;
    if let Some(kind) = &a.export {
        let kind: ExportKind = match kind.parse() {
            Ok(k) => k,
            Err(e) => bail!("--export: {e}"),
        };
        let ex = export(&plan, &inv, kind);
        emit(&ex.text, a.out.as_deref())?;
        eprint!("{}", ex.render_diffs());
        if !ex.is_exact() {
            std::process::exit(1);
        }
        return Ok(());
    }
    let text = if a.json {
        json_text(&plan)?
    } else {
        summary_table(&plan)
    };
    emit(&text, a.out.as_deref())
}
