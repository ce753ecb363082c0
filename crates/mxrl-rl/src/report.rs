//! The ablation report: `report.md` plus PNG plots, regenerated from the runs' `metrics.jsonl`
//! files and the ablation manifest alone.
//!
//! Text is rendered with DejaVu Sans, embedded in the binary (Bitstream Vera licence, see
//! `assets/DejaVuSans-LICENSE.txt`), so no system fonts are needed.

use crate::metrics::{read_jsonl, MetricsError, StepMetrics};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// One run of an ablation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEntry {
    /// Display name (e.g. `bf16`, `bf16-seed2`).
    pub name: String,
    /// Recipe name.
    pub recipe: String,
    /// Seed.
    pub seed: u64,
    /// Directory relative to the ablation directory.
    pub dir: String,
    /// Stored weight bytes by format (`bf16`, `mxfp8`, `nvfp4`).
    pub weight_bytes: BTreeMap<String, u64>,
}

/// `ablation.json`: what was run, with which settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Model description.
    pub model: String,
    /// Task description.
    pub task: String,
    /// The RL configuration shared by all runs (JSON).
    pub config: serde_json::Value,
    /// Runs, BF16 first.
    pub runs: Vec<RunEntry>,
}

/// Errors of the report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading inputs.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// Manifest problems.
    #[error("{path}: {msg}")]
    Manifest {
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// Drawing failed.
    #[error("plot {file}: {msg}")]
    Plot {
        /// The PNG.
        file: String,
        /// The drawing error.
        msg: String,
    },
    /// Writing the report.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Summary of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Run name.
    pub name: String,
    /// Recipe.
    pub recipe: String,
    /// Steps logged.
    pub steps: usize,
    /// Initial reward (mean of the first 10% of steps, at least one).
    pub initial_reward: f64,
    /// Final reward (mean of the last 10% of steps, at least one).
    pub final_reward: f64,
    /// Standard error of `final_reward` (std of the per-step rewards in the window / √n).
    pub final_se: f64,
    /// Mean reward over all steps.
    pub mean_reward: f64,
    /// Mean `train_rollout_logprob_abs_diff`.
    pub mean_abs_diff: f64,
    /// Mean K3 KL.
    pub mean_k3: f64,
    /// Max grad norm.
    pub max_grad_norm: f64,
    /// Steps flagged as spikes.
    pub spikes: usize,
    /// Mean rollout seconds per step.
    pub rollout_s: f64,
    /// Mean train seconds per step.
    pub train_s: f64,
    /// Mean sync seconds per step.
    pub sync_s: f64,
    /// Mean tokens/s.
    pub tokens_per_s: f64,
    /// Total stored weight bytes.
    pub weight_bytes: u64,
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// Summarise a run's metrics.
pub fn summarize(e: &RunEntry, m: &[StepMetrics]) -> RunSummary {
    let w = (m.len() / 10).max(1).min(m.len().max(1));
    RunSummary {
        name: e.name.clone(),
        recipe: e.recipe.clone(),
        steps: m.len(),
        initial_reward: mean(m.iter().take(w).map(|x| x.reward_mean)),
        final_reward: mean(m.iter().rev().take(w).map(|x| x.reward_mean)),
        final_se: {
            let f = mean(m.iter().rev().take(w).map(|x| x.reward_mean));
            let n = m.len().min(w);
            if n > 1 {
                (m.iter()
                    .rev()
                    .take(w)
                    .map(|x| (x.reward_mean - f).powi(2))
                    .sum::<f64>()
                    / (n - 1) as f64)
                    .sqrt()
                    / (n as f64).sqrt()
            } else {
                0.0
            }
        },
        mean_reward: mean(m.iter().map(|x| x.reward_mean)),
        mean_abs_diff: mean(m.iter().map(|x| x.train_rollout_logprob_abs_diff)),
        mean_k3: mean(m.iter().map(|x| x.k3_kl)),
        max_grad_norm: m.iter().map(|x| x.grad_norm).fold(0.0, f64::max),
        spikes: m.iter().filter(|x| x.grad_spike).count(),
        rollout_s: mean(m.iter().map(|x| x.rollout_s)),
        train_s: mean(m.iter().map(|x| x.train_s)),
        sync_s: mean(m.iter().map(|x| x.sync_s)),
        tokens_per_s: mean(m.iter().map(|x| x.tokens_per_s)),
        weight_bytes: e.weight_bytes.values().sum(),
    }
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn register_font() {
    // Registering twice is harmless; the error type only reports an unparsable font, and the
    // embedded font is fixed.
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
}

type Series<'a> = Vec<(&'a str, Vec<(f64, f64)>)>;
/// One panel: title, y label, line series, circled marks.
type Panel<'a> = (&'a str, &'a str, Series<'a>, Vec<(f64, f64)>);
/// Runs with their metrics.
pub type LoadedRuns = Vec<(RunEntry, Vec<StepMetrics>)>;

/// Moving average over a centred window of `w` points.
fn smooth(v: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    if w <= 1 {
        return v.to_vec();
    }
    (0..v.len())
        .map(|i| {
            let lo = i.saturating_sub(w / 2);
            let hi = (i + w / 2 + 1).min(v.len());
            let m = v[lo..hi].iter().map(|p| p.1).sum::<f64>() / (hi - lo) as f64;
            (v[i].0, m)
        })
        .collect()
}

fn bounds(series: &Series<'_>) -> (f64, f64, f64, f64) {
    let pts = series
        .iter()
        .flat_map(|s| s.1.iter())
        .filter(|p| p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.08).max(1e-9);
    if y1 - y0 < 1e-12 {
        (
            x0,
            x1,
            y0 - 0.5 * y0.abs().max(1e-6),
            y1 + 0.5 * y1.abs().max(1e-6),
        )
    } else {
        (x0, x1, y0 - pad, y1 + pad)
    }
}

/// Draw one panel of line series; `marks` are points drawn as circles (spikes).
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_label: &str,
    series: &Series<'_>,
    marks: &[(f64, f64)],
) -> Result<(), String> {
    let (x0, x1, y0, y1) = bounds(series);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_label)
        .label_style(("sans-serif", 13))
        .y_label_formatter(&|v| {
            if v.abs() >= 1e-2 || *v == 0.0 {
                format!("{v:.3}")
            } else {
                format!("{v:.1e}")
            }
        })
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    if !marks.is_empty() {
        chart
            .draw_series(
                marks
                    .iter()
                    .map(|&(x, y)| Circle::new((x, y), 6, RED.stroke_width(2))),
            )
            .map_err(|e| e.to_string())?
            .label("spike (> 5× running median)")
            .legend(|(x, y)| Circle::new((x + 9, y), 5, RED.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn draw_png(path: &Path, size: (u32, u32), panels: &[Panel<'_>]) -> Result<(), ReportError> {
    let err = |msg: String| ReportError::Plot {
        file: path.display().to_string(),
        msg,
    };
    // plotters picks the encoder from the extension, so the temporary file keeps `.png`.
    let tmp = path.with_extension("tmp.png");
    {
        let root = BitMapBackend::new(&tmp, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let areas = root.split_evenly((panels.len(), 1));
        for (a, (t, y, s, m)) in areas.iter().zip(panels) {
            panel(a, t, y, s, m).map_err(err)?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}

fn series<'a>(
    runs: &'a [(RunEntry, Vec<StepMetrics>)],
    f: impl Fn(&StepMetrics) -> f64,
) -> Series<'a> {
    runs.iter()
        .map(|(e, m)| {
            (
                e.name.as_str(),
                m.iter().map(|x| (x.step as f64, f(x))).collect(),
            )
        })
        .collect()
}

/// Read `DIR/ablation.json` and every run's metrics.
pub fn load(dir: &Path) -> Result<(Manifest, LoadedRuns), ReportError> {
    let mp = dir.join("ablation.json");
    let text = std::fs::read_to_string(&mp).map_err(|e| ReportError::Manifest {
        path: mp.display().to_string(),
        msg: e.to_string(),
    })?;
    let man: Manifest = serde_json::from_str(&text).map_err(|e| ReportError::Manifest {
        path: mp.display().to_string(),
        msg: e.to_string(),
    })?;
    let mut runs = Vec::new();
    for e in &man.runs {
        let p = dir.join(&e.dir).join("metrics.jsonl");
        if p.exists() {
            runs.push((e.clone(), read_jsonl(&p)?));
        }
    }
    Ok((man, runs))
}

/// Write `DIR/report.md` and the PNGs next to it; returns the report path.
pub fn write_report(dir: &Path) -> Result<PathBuf, ReportError> {
    register_font();
    let (man, runs) = load(dir)?;
    let win = runs.iter().map(|r| r.1.len()).max().unwrap_or(0) / 10;
    let smooth_w = win.clamp(1, 9) | 1;
    let reward: Series<'_> = series(&runs, |m| m.reward_mean)
        .into_iter()
        .map(|(n, v)| (n, smooth(&v, smooth_w)))
        .collect();
    draw_png(
        &dir.join("reward.png"),
        (1000, 560),
        &[(
            &format!("Reward vs step (moving average over {smooth_w} steps)"),
            "mean reward",
            reward,
            vec![],
        )],
    )?;
    draw_png(
        &dir.join("mismatch.png"),
        (1000, 900),
        &[
            (
                "Train-rollout mismatch: mean |logp_train − logp_rollout|",
                "abs diff",
                series(&runs, |m| m.train_rollout_logprob_abs_diff),
                vec![],
            ),
            (
                "K3 KL(rollout ‖ trainer)",
                "K3 KL",
                series(&runs, |m| m.k3_kl),
                vec![],
            ),
        ],
    )?;
    let spikes: Vec<(f64, f64)> = runs
        .iter()
        .flat_map(|(_, m)| {
            m.iter()
                .filter(|x| x.grad_spike)
                .map(|x| (x.step as f64, x.grad_norm))
        })
        .collect();
    draw_png(
        &dir.join("grad_norm.png"),
        (1000, 560),
        &[(
            "Gradient norm (before clipping); spikes circled",
            "grad norm",
            series(&runs, |m| m.grad_norm),
            spikes,
        )],
    )?;
    draw_png(
        &dir.join("rollout.png"),
        (1000, 900),
        &[
            (
                "Rollout time per step",
                "seconds",
                series(&runs, |m| m.rollout_s),
                vec![],
            ),
            (
                "Rollout throughput",
                "tokens / s",
                series(&runs, |m| m.tokens_per_s),
                vec![],
            ),
        ],
    )?;
    draw_png(
        &dir.join("sync.png"),
        (1000, 560),
        &[(
            "Weight-sync time per step (export + bucket + verify + apply)",
            "seconds",
            series(&runs, |m| m.sync_s),
            vec![],
        )],
    )?;

    let sums: Vec<RunSummary> = runs.iter().map(|(e, m)| summarize(e, m)).collect();
    let md = render_markdown(&man, &sums);
    let path = dir.join("report.md");
    let tmp = dir.join("report.md.tmp");
    std::fs::write(&tmp, md).map_err(|source| ReportError::Io {
        path: tmp.display().to_string(),
        source,
    })?;
    std::fs::rename(&tmp, &path).map_err(|source| ReportError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(path)
}

fn fmt_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

/// The automatic reading of the summary: which recipes track BF16 within the noise measured
/// by a second BF16 seed, and whether the mismatch ordering BF16 < MXFP8 < NVFP4 holds.
pub fn reading(sums: &[RunSummary]) -> Vec<String> {
    let mut out = Vec::new();
    let bf = sums.iter().find(|s| s.name == "bf16");
    let bf2 = sums.iter().find(|s| s.recipe == "bf16" && s.name != "bf16");
    let Some(bf) = bf else {
        out.push("No BF16 run: nothing to compare against.".into());
        return out;
    };
    let noise = bf2.map(|b| {
        (b.final_reward - bf.final_reward)
            .abs()
            .max((b.mean_reward - bf.mean_reward).abs())
            .max(2.0 * bf.final_se)
    });
    match (noise, bf2) {
        (Some(n), Some(b2)) => out.push(format!(
            "Run-to-run noise: {n:.3} in reward (the larger of `bf16` vs `{}` final/mean reward differences and 2× the standard error of BF16's final-window reward, {:.3}).",
            b2.name,
            2.0 * bf.final_se
        )),
        _ => out.push("No second BF16 seed: run-to-run noise is unknown.".into()),
    }
    for s in sums.iter().filter(|s| s.recipe != "bf16") {
        let d_final = s.final_reward - bf.final_reward;
        let d_mean = s.mean_reward - bf.mean_reward;
        let dev = d_final.abs().max(d_mean.abs());
        let verdict = match noise {
            Some(n) if dev <= n => "tracks BF16 within run-to-run noise".to_string(),
            Some(n) => format!("differs from BF16 by more than the noise ({dev:.3} > {n:.3})"),
            None => format!("differs from BF16 by {dev:.3}"),
        };
        out.push(format!(
            "`{}`: final reward {:.3} (BF16 {:.3}), mean {:.3} (BF16 {:.3}) — {verdict}; rollout {:.2}× BF16 speed.",
            s.name,
            s.final_reward,
            bf.final_reward,
            s.mean_reward,
            bf.mean_reward,
            bf.rollout_s / s.rollout_s
        ));
    }
    let group = |prefix: &str| -> Option<f64> {
        let v: Vec<f64> = sums
            .iter()
            .filter(|s| s.recipe.starts_with(prefix))
            .map(|s| s.mean_abs_diff)
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    if let (Some(b), Some(m), Some(n)) = (group("bf16"), group("mxfp8"), group("nvfp4")) {
        let ord = if b < m && m < n {
            "observed".to_string()
        } else {
            "NOT observed".to_string()
        };
        out.push(format!(
            "Mismatch ordering BF16 < MXFP8 < NVFP4 (mean |Δlogprob| averaged per format family: {b:.2e} / {m:.2e} / {n:.2e}): {ord}."
        ));
    }
    let spiky: Vec<String> = sums
        .iter()
        .filter(|s| s.spikes > 0)
        .map(|s| format!("`{}` ({})", s.name, s.spikes))
        .collect();
    out.push(if spiky.is_empty() {
        "No gradient-norm spikes (> 5× running median) in any run.".into()
    } else {
        format!("Gradient-norm spikes: {}.", spiky.join(", "))
    });
    out
}

fn render_markdown(man: &Manifest, sums: &[RunSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# mxrl ablation report\n");
    let _ = writeln!(s, "- model: {}", man.model);
    let _ = writeln!(s, "- task: {}", man.task);
    let _ = writeln!(
        s,
        "- runs: {} (identical seeds, prompts and hyper-parameters; only the precision recipe differs, plus a second BF16 seed for run-to-run noise)",
        man.runs.iter().map(|r| format!("`{}`", r.name)).collect::<Vec<_>>().join(", ")
    );
    let _ = writeln!(s, "- regenerate: `mxrl report <this directory>`\n");
    let _ = writeln!(s, "## Reading\n");
    for l in reading(sums) {
        let _ = writeln!(s, "- {l}");
    }
    let _ = writeln!(
        s,
        "- Timing note: rollout/train times are wall-clock of this machine; on CPU the block-format GEMMs are emulated (operands quantized by the contract quantizer and decoded exactly, f32 accumulation), so time differences between recipes are not format speedups."
    );
    let _ = writeln!(s, "\n## Summary\n");
    let _ = writeln!(
        s,
        "| run | steps | reward first→final | mean reward | mean \\|Δlogp\\| | mean K3 KL | max grad norm | spikes | rollout s/step | train s/step | sync s/step | tokens/s | weight bytes | rollout speedup vs BF16 |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let bf_roll = sums.iter().find(|x| x.name == "bf16").map(|x| x.rollout_s);
    for r in sums {
        let speed = bf_roll.map_or("–".into(), |b| format!("{:.2}×", b / r.rollout_s));
        let _ = writeln!(
            s,
            "| `{}` | {} | {:.3} → {:.3} | {:.3} | {:.2e} | {:.2e} | {:.3} | {} | {:.3} | {:.3} | {:.4} | {:.0} | {} | {} |",
            r.name, r.steps, r.initial_reward, r.final_reward, r.mean_reward, r.mean_abs_diff,
            r.mean_k3, r.max_grad_norm, r.spikes, r.rollout_s, r.train_s, r.sync_s,
            r.tokens_per_s, fmt_bytes(r.weight_bytes), speed
        );
    }
    let _ = writeln!(s, "\nWeight bytes per format:\n");
    let _ = writeln!(s, "| run | {} |", ["bf16", "mxfp8", "nvfp4"].join(" | "));
    let _ = writeln!(s, "|---|---|---|---|");
    for e in &man.runs {
        let cell = |f: &str| e.weight_bytes.get(f).map_or("–".into(), |b| fmt_bytes(*b));
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {} |",
            e.name,
            cell("bf16"),
            cell("mxfp8"),
            cell("nvfp4")
        );
    }
    let _ = writeln!(s, "\n## Plots\n");
    for (f, t) in [
        ("reward.png", "Reward vs step"),
        ("mismatch.png", "Train-rollout mismatch"),
        ("grad_norm.png", "Gradient norm"),
        ("rollout.png", "Rollout time and throughput"),
        ("sync.png", "Weight-sync time"),
    ] {
        let _ = writeln!(s, "### {t}\n\n![{t}]({f})\n");
    }
    let _ = writeln!(
        s,
        "## Configuration\n\n```json\n{}\n```",
        serde_json::to_string_pretty(&man.config).unwrap_or_default()
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_renders_pngs_and_reading_from_metrics() {
        let d = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        for (i, (name, recipe, diff)) in [
            ("bf16", "bf16", 0.0),
            ("mxfp8", "mxfp8", 0.01),
            ("nvfp4-hp", "nvfp4-hp", 0.05),
            ("bf16-seed2", "bf16", 0.0),
        ]
        .into_iter()
        .enumerate()
        {
            std::fs::create_dir_all(d.path().join(name)).unwrap();
            for step in 0..20u64 {
                let m = StepMetrics {
                    step,
                    reward_mean: step as f64 / 20.0 + i as f64 * 0.001,
                    train_rollout_logprob_abs_diff: diff,
                    grad_norm: if step == 15 && i == 2 { 50.0 } else { 1.0 },
                    grad_spike: step == 15 && i == 2,
                    rollout_s: 1.0 / (1.0 + diff * 10.0),
                    tokens_per_s: 100.0,
                    ..Default::default()
                };
                crate::metrics::append_jsonl(&d.path().join(name).join("metrics.jsonl"), &m)
                    .unwrap();
            }
            runs.push(RunEntry {
                name: name.into(),
                recipe: recipe.into(),
                seed: 1,
                dir: name.into(),
                weight_bytes: BTreeMap::from([("bf16".to_string(), 1000u64)]),
            });
        }
        let man = Manifest {
            model: "m".into(),
            task: "t".into(),
            config: serde_json::json!({}),
            runs,
        };
        std::fs::write(
            d.path().join("ablation.json"),
            serde_json::to_string(&man).unwrap(),
        )
        .unwrap();
        let p = write_report(d.path()).unwrap();
        let md = std::fs::read_to_string(p).unwrap();
        assert!(md.contains("| `nvfp4-hp` |"));
        assert!(md.contains("Mismatch ordering BF16 < MXFP8 < NVFP4"));
        assert!(md.contains("): observed."), "{md}");
        assert!(md.contains("Gradient-norm spikes: `nvfp4-hp` (1)"));
        for f in [
            "reward.png",
            "mismatch.png",
            "grad_norm.png",
            "rollout.png",
            "sync.png",
        ] {
            let b = std::fs::read(d.path().join(f)).unwrap();
            assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{f}");
            assert!(
                b.len() > 10_000,
                "{f} has {} bytes: nothing drawn?",
                b.len()
            );
        }
    }
}
