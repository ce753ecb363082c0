//! The ablation report: `report.md` plus PNG plots, regenerated from the runs' `metrics.jsonl`
//! files and the ablation manifest alone.
//!
//! Text is rendered with DejaVu Sans, embedded in the binary (Bitstream Vera licence, see
//! `assets/DejaVuSans-LICENSE.txt`), so no system fonts are needed.

use crate::metrics::{median, read_jsonl, MetricsError, StepMetrics};
use mxrl_ckpt::{write_atomic, write_bytes_atomic};
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
    /// Hash of the recipe's resolved precision plan.
    #[serde(default)]
    pub plan_hash: String,
}

/// `ablation.json`: what was run, with which settings; written before the first run.
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
    /// Model directory as given.
    #[serde(default)]
    pub model_path: String,
    /// Digest of the model directory ([`crate::manifest::model_digest`]).
    #[serde(default)]
    pub model_digest: String,
    /// Where the linear GEMMs ran.
    #[serde(default)]
    pub device: String,
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
    /// Writing the report or a plot (the message names the file).
    #[error(transparent)]
    Write(#[from] mxrl_ckpt::CkptError),
}

/// Mean, median and how many values are non-zero (a mean resting on a few non-zero steps
/// with a median of 0 says something else than a mean of steady values).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stat {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// Values ≠ 0.
    pub nonzero: usize,
    /// Values.
    pub n: usize,
}

impl Stat {
    /// Of `v` (NaN mean and median when empty).
    pub fn of(v: &[f64]) -> Stat {
        Stat {
            mean: mean(v.iter().copied()),
            median: median(v).unwrap_or(f64::NAN),
            nonzero: v.iter().filter(|x| **x != 0.0).count(),
            n: v.len(),
        }
    }
}

/// Median with the interquartile range (linear interpolation between order statistics).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// 25th percentile.
    pub p25: f64,
    /// Median.
    pub median: f64,
    /// 75th percentile.
    pub p75: f64,
}

/// The `q`-quantile (0 ≤ q ≤ 1) of `v` by linear interpolation; NaN when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

impl Spread {
    /// Of `v`.
    pub fn of(v: &[f64]) -> Spread {
        Spread {
            p25: quantile(v, 0.25),
            median: quantile(v, 0.5),
            p75: quantile(v, 0.75),
        }
    }
}

/// Bootstrap resamples of a window mean.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// 95% percentile-bootstrap interval of the mean of `v` ([`BOOTSTRAP_RESAMPLES`] resamples with
/// replacement, fixed seed so the report is reproducible).
pub fn bootstrap_mean_ci(v: &[f64]) -> (f64, f64) {
    use rand::{Rng, SeedableRng};
    if v.len() < 2 {
        let m = mean(v.iter().copied());
        return (m, m);
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed_b007);
    let means: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            (0..v.len())
                .map(|_| v[rng.gen_range(0..v.len())])
                .sum::<f64>()
                / v.len() as f64
        })
        .collect();
    (quantile(&means, 0.025), quantile(&means, 0.975))
}

/// Steps in the first and final windows: 10% of the logged steps, at least one.
pub fn window_len(steps: usize) -> usize {
    (steps / 10).max(1).min(steps.max(1))
}

/// Summary of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Run name.
    pub name: String,
    /// Recipe.
    pub recipe: String,
    /// Seed.
    pub seed: u64,
    /// Steps logged.
    pub steps: usize,
    /// Steps in each window ([`window_len`]).
    pub window: usize,
    /// First and last step index of the first window.
    pub first_window: (u64, u64),
    /// First and last step index of the final window.
    pub final_window: (u64, u64),
    /// Mean reward over the first window.
    pub initial_reward: f64,
    /// Mean reward over the final window.
    pub final_reward: f64,
    /// 95% bootstrap interval of `final_reward` over the final window's steps.
    pub final_ci: (f64, f64),
    /// Mean reward over all steps.
    pub mean_reward: f64,
    /// Per-step `train_rollout_logprob_abs_diff`.
    pub abs_diff: Stat,
    /// Per-step K3 KL.
    pub k3: Stat,
    /// Max grad norm.
    pub max_grad_norm: f64,
    /// Steps flagged as spikes.
    pub spikes: usize,
    /// Rollout seconds per step.
    pub rollout_s: Spread,
    /// Train seconds per step.
    pub train_s: Spread,
    /// Sync seconds per step.
    pub sync_s: Spread,
    /// Whole step (rollout + train + sync) seconds.
    pub step_s: Spread,
    /// Median rollout tokens/s.
    pub tokens_per_s: f64,
    /// Total stored weight bytes.
    pub weight_bytes: u64,
    /// Median over steps of the train throughput, response tokens per second of training
    /// (`tokens / train_s`; steps without tokens or time left out; NaN when none is left).
    pub train_tokens_per_s: f64,
    /// Per decoder layer: the step statistics of `hidden_diff` (steps that recorded the
    /// layer); empty when the run recorded no probes.
    pub drift: Vec<Stat>,
    /// Per MoE layer: the median over steps of `decode_busiest_share` (the busiest expert's
    /// share of a decode step's routed rows); empty when the run recorded no routes.
    pub busiest: Vec<f64>,
    /// Medians over the steps that recorded `rollout_phases`: prefill s, decode s per decode
    /// step, decode steps, read-back s; `None` when no step did.
    pub phases: Option<[f64; 4]>,
    /// The MoE auxiliary loss of the steps that recorded it (runs with `aux_loss_coef` ≠ 0):
    /// its mean over the first and over the last window ([`window_len`] of those steps);
    /// `None` when no step did.
    pub aux_loss: Option<(f64, f64)>,
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
    let w = window_len(m.len());
    let first: Vec<f64> = m.iter().take(w).map(|x| x.reward_mean).collect();
    let last: Vec<f64> = m[m.len().saturating_sub(w)..]
        .iter()
        .map(|x| x.reward_mean)
        .collect();
    let span = |v: &[StepMetrics]| match (v.first(), v.last()) {
        (Some(a), Some(b)) => (a.step, b.step),
        _ => (0, 0),
    };
    let col = |f: fn(&StepMetrics) -> f64| m.iter().map(f).collect::<Vec<f64>>();
    RunSummary {
        name: e.name.clone(),
        recipe: e.recipe.clone(),
        seed: e.seed,
        steps: m.len(),
        window: w.min(m.len()),
        first_window: span(&m[..w.min(m.len())]),
        final_window: span(&m[m.len().saturating_sub(w)..]),
        initial_reward: mean(first.iter().copied()),
        final_reward: mean(last.iter().copied()),
        final_ci: bootstrap_mean_ci(&last),
        mean_reward: mean(m.iter().map(|x| x.reward_mean)),
        abs_diff: Stat::of(&col(|x| x.train_rollout_logprob_abs_diff)),
        k3: Stat::of(&col(|x| x.k3_kl)),
        max_grad_norm: m.iter().map(|x| x.grad_norm).fold(0.0, f64::max),
        spikes: m.iter().filter(|x| x.grad_spike).count(),
        rollout_s: Spread::of(&col(|x| x.rollout_s)),
        train_s: Spread::of(&col(|x| x.train_s)),
        sync_s: Spread::of(&col(|x| x.sync_s)),
        step_s: Spread::of(&col(|x| x.rollout_s + x.train_s + x.sync_s)),
        tokens_per_s: quantile(&col(|x| x.tokens_per_s), 0.5),
        weight_bytes: e.weight_bytes.values().sum(),
        train_tokens_per_s: quantile(&train_throughput(m), 0.5),
        drift: (0..m.iter().map(|x| x.hidden_diff.len()).max().unwrap_or(0))
            .map(|l| {
                Stat::of(
                    &m.iter()
                        .filter_map(|x| x.hidden_diff.get(l).copied())
                        .collect::<Vec<f64>>(),
                )
            })
            .collect(),
        phases: {
            let ph: Vec<_> = m.iter().filter_map(|x| x.rollout_phases).collect();
            let med = |f: fn(&crate::policy::GenTiming) -> f64| {
                quantile(&ph.iter().map(f).collect::<Vec<f64>>(), 0.5)
            };
            (!ph.is_empty()).then(|| {
                [
                    med(|p| p.prefill_s),
                    med(|p| p.decode_s / (p.decode_steps.max(1) as f64)),
                    med(|p| p.decode_steps as f64),
                    med(|p| p.readback_s),
                ]
            })
        },
        aux_loss: {
            let a: Vec<f64> = m.iter().filter_map(|x| x.aux_loss).collect();
            let w = window_len(a.len());
            (!a.is_empty()).then(|| {
                (
                    mean(a[..w].iter().copied()),
                    mean(a[a.len() - w..].iter().copied()),
                )
            })
        },
        busiest: (0..m
            .iter()
            .map(|x| x.decode_busiest_share.len())
            .max()
            .unwrap_or(0))
            .map(|l| {
                quantile(
                    &m.iter()
                        .filter_map(|x| x.decode_busiest_share.get(l).copied())
                        .collect::<Vec<f64>>(),
                    0.5,
                )
            })
            .collect(),
    }
}

/// Train throughput of one step: response tokens per second of training (forward, backward
/// and optimizer); `None` for a step without tokens or time.
fn step_train_tps(x: &StepMetrics) -> Option<f64> {
    (x.tokens > 0 && x.train_s > 0.0).then(|| x.tokens as f64 / x.train_s)
}

/// [`step_train_tps`] of every step that has one.
fn train_throughput(m: &[StepMetrics]) -> Vec<f64> {
    m.iter().filter_map(step_train_tps).collect()
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
/// The y axis of a panel.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Axis {
    /// Linear.
    Linear,
    /// Logarithmic: only positive values are drawn (zeros are counted in report.md).
    Log,
}
/// One panel: title, y label, y axis, line series, circled marks.
type Panel<'a> = (&'a str, &'a str, Axis, Series<'a>, Vec<(f64, f64)>);
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

/// Integer step range and y range of the drawable points (`y > 0` on a log axis).
fn bounds(series: &Series<'_>, axis: Axis) -> (i64, i64, f64, f64) {
    let drawable = |y: f64| y.is_finite() && (axis == Axis::Linear || y > 0.0);
    let (mut x0, mut x1) = (i64::MAX, i64::MIN);
    let (mut y0, mut y1) = (f64::MAX, f64::MIN);
    for &(x, y) in series.iter().flat_map(|s| s.1.iter()) {
        x0 = x0.min(x.floor() as i64);
        x1 = x1.max(x.ceil() as i64);
        if drawable(y) {
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        (x0, x1) = (0, 1);
    }
    if x1 <= x0 {
        x1 = x0 + 1;
    }
    if y0 > y1 {
        // Nothing drawable (all zero on a log axis, or no points).
        return match axis {
            Axis::Linear => (x0, x1, 0.0, 1.0),
            Axis::Log => (x0, x1, 1e-12, 1.0),
        };
    }
    match axis {
        Axis::Log => (x0, x1, y0 / 2.0, y1 * 2.0),
        Axis::Linear if y1 - y0 < 1e-12 => (
            x0,
            x1,
            y0 - 0.5 * y0.abs().max(1e-6),
            y1 + 0.5 * y1.abs().max(1e-6),
        ),
        Axis::Linear => {
            let pad = ((y1 - y0) * 0.08).max(1e-9);
            (x0, x1, y0 - pad, y1 + pad)
        }
    }
}

/// A y-axis label: three decimals without trailing zeros (`48`, `12.35`, `0.125`) between
/// 0.01 and 10⁴, else one significant digit in scientific notation.
fn y_label(v: &f64) -> String {
    if v.abs() >= 1e-2 && v.abs() < 1e4 || *v == 0.0 {
        let s = format!("{v:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" {
            "0".into()
        } else {
            s.into()
        }
    } else {
        format!("{v:.0e}")
    }
}

/// Draw one panel of line series on an integer step axis; `marks` are circled points
/// (spikes). On a log axis each series is drawn as its positive points only, and the caption
/// says that zero steps are left out.
#[allow(clippy::too_many_arguments)]
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x_desc: &str,
    title: &str,
    y_desc: &str,
    axis: Axis,
    series: &Series<'_>,
    marks: &[(f64, f64)],
) -> Result<(), String> {
    let (x0, x1, y0, y1) = bounds(series, axis);
    let x_labels = ((x1 - x0) as usize + 1).min(12);
    macro_rules! draw {
        ($chart:expr, $keep:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .x_labels(x_labels)
                .x_label_formatter(&|v: &i64| format!("{v}"))
                .label_style(("sans-serif", 13))
                .y_label_formatter(&y_label)
                .draw()
                .map_err(|e| e.to_string())?;
            for (i, (name, pts)) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                if axis == Axis::Log {
                    // Points only: a line through left-out zero steps would invent values.
                    let kept: Vec<(i64, f64)> = pts
                        .iter()
                        .filter(|p| $keep(p.1))
                        .map(|&(x, y)| (x.round() as i64, y))
                        .collect();
                    chart
                        .draw_series(kept.into_iter().map(|p| Circle::new(p, 3, c.filled())))
                        .map_err(|e| e.to_string())?
                        .label(*name)
                        .legend(move |(x, y)| Circle::new((x + 9, y), 4, c.filled()));
                    continue;
                }
                // Runs of consecutive drawable points become one line each.
                let mut segs: Vec<Vec<(i64, f64)>> = vec![Vec::new()];
                for &(x, y) in pts {
                    if $keep(y) {
                        segs.last_mut()
                            .expect("one segment")
                            .push((x.round() as i64, y));
                    } else if !segs.last().expect("one segment").is_empty() {
                        segs.push(Vec::new());
                    }
                }
                let mut first = true;
                for seg in segs.into_iter().filter(|s| !s.is_empty()) {
                    let a = chart
                        .draw_series(LineSeries::new(seg, c.stroke_width(2)))
                        .map_err(|e| e.to_string())?;
                    if first {
                        a.label(*name).legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                        });
                        first = false;
                    }
                }
            }
            if !marks.is_empty() {
                chart
                    .draw_series(
                        marks.iter().map(|&(x, y)| {
                            Circle::new((x.round() as i64, y), 6, RED.stroke_width(2))
                        }),
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
        }};
    }
    let mut b = ChartBuilder::on(area);
    b.caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(70);
    match axis {
        Axis::Linear => draw!(
            b.build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| e.to_string())?,
            |y: f64| y.is_finite()
        ),
        Axis::Log => draw!(
            b.build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                .map_err(|e| e.to_string())?,
            |y: f64| y.is_finite() && y > 0.0
        ),
    }
    Ok(())
}

fn draw_png(path: &Path, size: (u32, u32), panels: &[Panel<'_>]) -> Result<(), ReportError> {
    draw_png_x(path, size, &vec!["step"; panels.len()], panels)
}

/// [`draw_png`] with each panel's x axis named by `x_desc`.
fn draw_png_x(
    path: &Path,
    size: (u32, u32),
    x_desc: &[&str],
    panels: &[Panel<'_>],
) -> Result<(), ReportError> {
    let err = |msg: String| ReportError::Plot {
        file: path.display().to_string(),
        msg,
    };
    // Drawn in memory, encoded as PNG into the one atomic-write helper's temporary file.
    let (w, h) = size;
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let areas = root.split_evenly((panels.len(), 1));
        for ((a, (t, y, axis, s, m)), xd) in areas.iter().zip(panels).zip(x_desc) {
            panel(a, xd, t, y, *axis, s, m).map_err(err)?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    write_atomic(path, |tmp| {
        image::save_buffer_with_format(
            tmp,
            &rgb,
            w,
            h,
            image::ColorType::Rgb8,
            image::ImageFormat::Png,
        )
        .map_err(|e| err(e.to_string()))
    })
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

/// Read `DIR/ablation.json` and every run's metrics; or, for a single `mxrl rl` run
/// directory (`metrics.jsonl`, `run.json`, no `ablation.json`), that one run.
pub fn load(dir: &Path) -> Result<(Manifest, LoadedRuns), ReportError> {
    let mp = dir.join("ablation.json");
    if !mp.exists() && dir.join("metrics.jsonl").exists() {
        return load_single_run(dir);
    }
    let text = std::fs::read_to_string(&mp).map_err(|e| ReportError::Manifest {
        path: mp.display().to_string(),
        msg: format!(
            "reading: {e} (expected an ablation directory with ablation.json, or an `mxrl rl` \
             run directory with metrics.jsonl)"
        ),
    })?;
    let man: Manifest = serde_json::from_str(&text).map_err(|e| ReportError::Manifest {
        path: mp.display().to_string(),
        msg: format!("parsing: {e}"),
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

fn load_single_run(dir: &Path) -> Result<(Manifest, LoadedRuns), ReportError> {
    let metrics = read_jsonl(&dir.join("metrics.jsonl"))?;
    let rp = dir.join("run.json");
    let rm = if rp.exists() {
        Some(
            crate::manifest::read_run_manifest(dir).map_err(|e| ReportError::Manifest {
                path: rp.display().to_string(),
                msg: e.to_string(),
            })?,
        )
    } else {
        None
    };
    let recipe = rm.as_ref().map_or("run".to_string(), |m| m.recipe.clone());
    let entry = RunEntry {
        name: recipe.clone(),
        recipe,
        seed: rm.as_ref().map_or(0, |m| m.config.seed),
        dir: ".".into(),
        weight_bytes: BTreeMap::new(),
        plan_hash: rm.as_ref().map_or(String::new(), |m| m.plan_hash.clone()),
    };
    let man = Manifest {
        model: rm
            .as_ref()
            .map_or("(no run.json)".into(), |m| m.model_path.clone()),
        task: rm
            .as_ref()
            .map_or("(no run.json)".into(), |m| m.task.clone()),
        config: rm.as_ref().map_or(serde_json::Value::Null, |m| {
            serde_json::to_value(&m.config).expect("serializes")
        }),
        runs: vec![entry.clone()],
        model_path: rm.as_ref().map_or(String::new(), |m| m.model_path.clone()),
        model_digest: rm
            .as_ref()
            .map_or(String::new(), |m| m.model_digest.clone()),
        device: rm.as_ref().map_or(String::new(), |m| m.device.clone()),
    };
    Ok((man, vec![(entry, metrics)]))
}

/// Write `DIR/report.md` and the PNGs next to it; returns the report path. `DIR` is an
/// ablation directory or a single `mxrl rl` run directory.
pub fn write_report(dir: &Path) -> Result<PathBuf, ReportError> {
    register_font();
    let (man, runs) = load(dir)?;
    if runs.is_empty() {
        return Err(ReportError::Manifest {
            path: dir.display().to_string(),
            msg: "no run has a metrics.jsonl yet".into(),
        });
    }
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
            &format!("Reward vs step (centred moving average over {smooth_w} steps)"),
            "mean reward",
            Axis::Linear,
            reward,
            vec![],
        )],
    )?;
    draw_png(
        &dir.join("mismatch.png"),
        (1000, 900),
        &[
            (
                "Train-rollout mismatch: mean |logp_train − logp_rollout| (log scale, zero steps left out)",
                "abs diff",
                Axis::Log,
                series(&runs, |m| m.train_rollout_logprob_abs_diff),
                vec![],
            ),
            (
                "K3 KL(rollout ‖ trainer) (log scale, zero steps left out)",
                "K3 KL",
                Axis::Log,
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
            Axis::Linear,
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
                Axis::Linear,
                series(&runs, |m| m.rollout_s),
                vec![],
            ),
            (
                "Rollout throughput",
                "tokens / s",
                Axis::Linear,
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
            Axis::Linear,
            series(&runs, |m| m.sync_s),
            vec![],
        )],
    )?;

    draw_png(
        &dir.join("train.png"),
        (1000, 900),
        &[
            (
                "Train time per step (forward + backward + optimizer)",
                "seconds",
                Axis::Linear,
                series(&runs, |m| m.train_s),
                vec![],
            ),
            (
                "Train throughput: response tokens per second of training",
                "tokens / s",
                Axis::Linear,
                series(&runs, |m| step_train_tps(m).unwrap_or(f64::NAN)),
                vec![],
            ),
        ],
    )?;
    let sums: Vec<RunSummary> = runs.iter().map(|(e, m)| summarize(e, m)).collect();
    if sums.iter().any(|s| !s.drift.is_empty()) {
        draw_drift(&dir.join("drift.png"), &runs, &sums)?;
    }
    let (aux, busiest) = routing_plotted(&sums);
    let mut routing: Vec<Panel<'_>> = Vec::new();
    if aux {
        routing.push((
            "MoE auxiliary loss of the training forwards (runs that add it; even routing ≈ k)",
            "aux loss",
            Axis::Linear,
            series(&runs, |m| m.aux_loss.unwrap_or(f64::NAN)),
            vec![],
        ));
    }
    if busiest {
        routing.push((
            "Busiest expert's share of a decode step's routed rows (mean over the MoE layers)",
            "% of the rows",
            Axis::Linear,
            series(&runs, |m| {
                let v = &m.decode_busiest_share;
                if v.is_empty() {
                    f64::NAN
                } else {
                    100.0 * v.iter().sum::<f64>() / v.len() as f64
                }
            }),
            vec![],
        ));
    }
    if !routing.is_empty() {
        draw_png(
            &dir.join("routing.png"),
            (1000, 340 * routing.len() as u32 + 220),
            &routing,
        )?;
    }
    let md = render_markdown(&man, &sums);
    let path = dir.join("report.md");
    write_bytes_atomic(&path, md.as_bytes())?;
    Ok(path)
}

/// Which panels `routing.png` has: the aux loss (a run recorded it), the decode routing (a
/// run recorded routes); neither: no plot.
fn routing_plotted(sums: &[RunSummary]) -> (bool, bool) {
    (
        sums.iter().any(|s| s.aux_loss.is_some()),
        sums.iter().any(|s| !s.busiest.is_empty()),
    )
}

/// `drift.png`: the per-layer profile (median over steps of each layer's `hidden_diff`, x =
/// layer) and the last recorded layer's drift per step, both on a log axis (exact zeros, e.g.
/// in bitwise mode, are left out and counted in report.md).
fn draw_drift(path: &Path, runs: &LoadedRuns, sums: &[RunSummary]) -> Result<(), ReportError> {
    let profile: Series<'_> = sums
        .iter()
        .filter(|s| !s.drift.is_empty())
        .map(|s| {
            (
                s.name.as_str(),
                s.drift
                    .iter()
                    .enumerate()
                    .map(|(l, st)| (l as f64, st.median))
                    .collect(),
            )
        })
        .collect();
    let last: Series<'_> = runs
        .iter()
        .filter(|(_, m)| m.iter().any(|x| !x.hidden_diff.is_empty()))
        .map(|(e, m)| {
            (
                e.name.as_str(),
                m.iter()
                    .filter_map(|x| x.hidden_diff.last().map(|d| (x.step as f64, *d)))
                    .collect(),
            )
        })
        .collect();
    draw_png_x(
        path,
        (1000, 900),
        &["layer", "step"],
        &[
            (
                "Per-layer drift: median over steps of ‖h_train − h_rollout‖ / ‖h_rollout‖ after each layer (log scale)",
                "relative drift",
                Axis::Log,
                profile,
                vec![],
            ),
            (
                "Drift after the last layer per step (log scale, zero steps left out)",
                "relative drift",
                Axis::Log,
                last,
                vec![],
            ),
        ],
    )
}

/// The speedup table against the `bf16` run: rollout and train throughput ratios and the
/// whole-step time ratio, each with the seed-to-seed band of the identical BF16 runs (`bf16`
/// itself at 1 and every other BF16 seed against it); empty without a `bf16` run.
fn speedup_section(sums: &[RunSummary]) -> String {
    let mut s = String::new();
    let Some(bf) = sums.iter().find(|x| x.name == "bf16") else {
        return s;
    };
    let roll = |r: &RunSummary| r.tokens_per_s / bf.tokens_per_s;
    let train = |r: &RunSummary| r.train_tokens_per_s / bf.train_tokens_per_s;
    let step = |r: &RunSummary| bf.step_s.median / r.step_s.median;
    let seeds: Vec<&RunSummary> = sums.iter().filter(|x| x.recipe == "bf16").collect();
    let band = |f: &dyn Fn(&RunSummary) -> f64| {
        seeds
            .iter()
            .map(|r| f(r))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                (a.min(x), b.max(x))
            })
    };
    let bands = [band(&roll), band(&train), band(&step)];
    // Compared at the two decimals shown, so that a cell never reads "1.00× (below band)"
    // beside a band that reads 1.00–1.11×.
    let shown = |x: f64| (x * 100.0).round();
    let cell = |x: f64, (lo, hi): (f64, f64)| {
        let (x, lo, hi) = (shown(x) / 100.0, shown(lo) / 100.0, shown(hi) / 100.0);
        if !x.is_finite() {
            "–".to_string()
        } else if seeds.len() < 2 || !(lo.is_finite() && hi.is_finite()) {
            format!("{x:.2}×")
        } else if x > hi {
            format!("{x:.2}× (above band)")
        } else if x < lo {
            format!("{x:.2}× (below band)")
        } else {
            format!("{x:.2}× (in band)")
        }
    };
    let _ = writeln!(
        s,
        "
## Speedups vs BF16
"
    );
    let _ = writeln!(
        s,
        "Ratios to the `bf16` run: rollout and train throughput (median tokens/s over steps; train tokens/s = response tokens per second of forward + backward + optimizer), and whole-step speed (median step seconds of `bf16` ÷ the run's). Sync share = median weight-sync seconds ÷ median step seconds."
    );
    if seeds.len() < 2 {
        let _ = writeln!(
            s,
            "
No BF16 runs with other seeds: there is no seed-to-seed band, and ratios near 1 cannot be told from noise."
        );
    } else {
        let names: Vec<String> = seeds.iter().map(|r| format!("`{}`", r.name)).collect();
        let _ = writeln!(
            s,
            "
Seed-to-seed noise band (the same ratios for the identical BF16 runs {}): rollout {:.2}–{:.2}×, train {:.2}–{:.2}×, step {:.2}–{:.2}×. A ratio inside its band is not distinguishable from BF16 by this experiment.",
            names.join(", "),
            bands[0].0, bands[0].1, bands[1].0, bands[1].1, bands[2].0, bands[2].1
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| run | rollout tokens/s | rollout × BF16 | train tokens/s | train × BF16 | step s | step speed × BF16 | sync s | sync share |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for r in sums {
        let _ = writeln!(
            s,
            "| `{}` | {:.0} | {} | {} | {} | {:.3} | {} | {:.3} | {:.1}% |",
            r.name,
            r.tokens_per_s,
            cell(roll(r), bands[0]),
            if r.train_tokens_per_s.is_finite() {
                format!("{:.0}", r.train_tokens_per_s)
            } else {
                "–".into()
            },
            cell(train(r), bands[1]),
            r.step_s.median,
            cell(step(r), bands[2]),
            r.sync_s.median,
            100.0 * r.sync_s.median / r.step_s.median
        );
    }
    s
}

/// The per-layer drift table: per run and layer, the median over steps of `hidden_diff`
/// with the count of non-zero steps; empty when no run recorded probes.
fn drift_section(sums: &[RunSummary]) -> String {
    let mut s = String::new();
    let layers = sums.iter().map(|r| r.drift.len()).max().unwrap_or(0);
    if layers == 0 {
        return s;
    }
    let _ = writeln!(
        s,
        "
## Per-layer drift
"
    );
    let _ = writeln!(
        s,
        "Per decoder layer, ‖h_train − h_rollout‖₂ / ‖h_rollout‖₂ of the residual stream after the layer, averaged over a step's response tokens: median over steps (non-zero steps of all steps). Worst layer = the largest median."
    );
    let _ = writeln!(s);
    let head: Vec<String> = (0..layers).map(|l| format!("layer {l}")).collect();
    let _ = writeln!(s, "| run | {} | worst layer |", head.join(" | "));
    let _ = writeln!(s, "|---|{}---|", "---|".repeat(layers));
    for r in sums {
        let cells: Vec<String> = (0..layers)
            .map(|l| {
                r.drift.get(l).map_or("–".into(), |st| {
                    format!("{:.2e} ({}/{})", st.median, st.nonzero, st.n)
                })
            })
            .collect();
        let worst = r
            .drift
            .iter()
            .enumerate()
            .filter(|(_, st)| st.median.is_finite())
            .max_by(|a, b| a.1.median.total_cmp(&b.1.median))
            .map_or("–".into(), |(l, _)| l.to_string());
        let _ = writeln!(s, "| `{}` | {} | {worst} |", r.name, cells.join(" | "));
    }
    s
}

/// The rollout-phase table: per run, the medians of where its generations spent their time;
/// empty when no run recorded phases.
fn phases_section(sums: &[RunSummary]) -> String {
    let mut s = String::new();
    if sums.iter().all(|r| r.phases.is_none()) {
        return s;
    }
    let _ = writeln!(s, "\n## Rollout phases\n");
    let _ = writeln!(
        s,
        "Where each rollout's generation spent its time (the engine's own timing, each phase ending at a read-back it already does): medians over steps. Decode per step = a step's decode time ÷ its decode steps; read-back = the recorded routes and probes brought to the host."
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| run | prefill ms | decode ms per step | decode steps | read-back ms | rollout ms |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in sums {
        let Some([pre, per, steps, back]) = r.phases else {
            let _ = writeln!(
                s,
                "| `{}` | – | – | – | – | {:.1} |",
                r.name,
                1e3 * r.rollout_s.median
            );
            continue;
        };
        let _ = writeln!(
            s,
            "| `{}` | {:.1} | {:.3} | {:.0} | {:.1} | {:.1} |",
            r.name,
            1e3 * pre,
            1e3 * per,
            steps,
            1e3 * back,
            1e3 * r.rollout_s.median
        );
    }
    s
}

/// The decode-routing table: per run and MoE layer, the median over steps of the busiest
/// expert's share of a decode step's routed rows; empty when no run recorded routes.
fn routing_section(sums: &[RunSummary]) -> String {
    let mut s = String::new();
    let layers = sums.iter().map(|r| r.busiest.len()).max().unwrap_or(0);
    if layers == 0 {
        return s;
    }
    let _ = writeln!(s, "\n## Decode routing\n");
    let _ = writeln!(
        s,
        "Per MoE layer, the busiest expert's share of a decode step's routed rows (the rollout's routes; each sequence still decoding sends top-k rows), averaged over a step's decode steps: median over steps. Uniform routing over E experts gives about 1/E, one of every sequence's k routes on the same expert 1/k. The sequences of a decode step are at the same point of their responses and often route alike, so a step's share can be high while the routing over whole sequences is even (the training routing balance below, where recorded)."
    );
    let _ = writeln!(s);
    let head: Vec<String> = (0..layers).map(|l| format!("MoE layer {l}")).collect();
    let _ = writeln!(s, "| run | {} |", head.join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(layers));
    for r in sums {
        let cells: Vec<String> = (0..layers)
            .map(|l| {
                r.busiest
                    .get(l)
                    .filter(|x| x.is_finite())
                    .map_or("–".into(), |x| format!("{:.1} %", 100.0 * x))
            })
            .collect();
        let _ = writeln!(s, "| `{}` | {} |", r.name, cells.join(" | "));
    }
    s
}

/// The training side's routing balance: per run that added the MoE auxiliary loss, its mean
/// over the first and the last window of steps; empty when no run did.
fn aux_section(sums: &[RunSummary]) -> String {
    let mut s = String::new();
    if sums.iter().all(|r| r.aux_loss.is_none()) {
        return s;
    }
    let _ = writeln!(s, "\n## Training routing balance\n");
    let _ = writeln!(
        s,
        "The MoE auxiliary load-balancing loss of the training forwards (HF `load_balancing_loss_func` over the MoE layers, before its coefficient; the mean over a step's micro-batches), averaged over the first and the last window of steps. It is about k (the experts per token) when the routing is even and up to E (the expert count) when every token goes to the same k experts."
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "| run | aux loss first → final |");
    let _ = writeln!(s, "|---|---|");
    for r in sums {
        let cell = r
            .aux_loss
            .map_or("–".into(), |(a, b)| format!("{a:.3} → {b:.3}"));
        let _ = writeln!(s, "| `{}` | {cell} |", r.name);
    }
    s
}

fn fmt_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b < 1 << 10 {
        format!("{b} B")
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

/// `mean / median (k of n non-zero)` of a per-step statistic.
pub fn fmt_stat(s: &Stat) -> String {
    format!(
        "{:.2e} / {:.2e} ({} of {} non-zero)",
        s.mean, s.median, s.nonzero, s.n
    )
}

/// BF16 seeds needed for a seed band; with fewer the band is a bootstrap interval.
pub const MIN_BF16_SEEDS: usize = 3;

/// The reward noise band the verdicts are read against.
#[derive(Debug, Clone, PartialEq)]
pub enum NoiseBand {
    /// The range of final-window rewards over at least [`MIN_BF16_SEEDS`] BF16 seeds.
    Seeds {
        /// Seeds (run names).
        names: Vec<String>,
        /// Lowest and highest final reward.
        final_range: (f64, f64),
        /// Mean of the seeds' final rewards.
        final_mean: f64,
        /// Lowest and highest whole-run mean reward.
        mean_range: (f64, f64),
    },
    /// The 95% bootstrap interval of the BF16 run's final-window reward (fewer than
    /// [`MIN_BF16_SEEDS`] seeds; it measures step-to-step noise only).
    Bootstrap {
        /// The BF16 run.
        name: String,
        /// The interval.
        final_range: (f64, f64),
        /// The BF16 final reward.
        final_mean: f64,
    },
}

impl NoiseBand {
    /// From the summaries (`None` without a BF16 run).
    pub fn of(sums: &[RunSummary]) -> Option<NoiseBand> {
        let bf: Vec<&RunSummary> = sums.iter().filter(|s| s.recipe == "bf16").collect();
        if bf.len() >= MIN_BF16_SEEDS {
            Some(NoiseBand::Seeds {
                names: bf.iter().map(|s| s.name.clone()).collect(),
                final_range: span(&bf, |s| s.final_reward),
                final_mean: mean(bf.iter().map(|s| s.final_reward)),
                mean_range: span(&bf, |s| s.mean_reward),
            })
        } else {
            let b = bf.iter().find(|s| s.name == "bf16").or(bf.first())?;
            Some(NoiseBand::Bootstrap {
                name: b.name.clone(),
                final_range: b.final_ci,
                final_mean: b.final_reward,
            })
        }
    }

    fn final_range(&self) -> (f64, f64) {
        match self {
            NoiseBand::Seeds { final_range, .. } | NoiseBand::Bootstrap { final_range, .. } => {
                *final_range
            }
        }
    }

    fn centre(&self) -> f64 {
        match self {
            NoiseBand::Seeds { final_mean, .. } | NoiseBand::Bootstrap { final_mean, .. } => {
                *final_mean
            }
        }
    }
}

/// The smallest and largest `f` over `runs`.
fn span(runs: &[&RunSummary], f: fn(&RunSummary) -> f64) -> (f64, f64) {
    runs.iter()
        .map(|s| f(s))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
            (a.min(x), b.max(x))
        })
}

/// Where `x` lies relative to `[lo, hi]`, in words.
fn placement(x: f64, (lo, hi): (f64, f64)) -> String {
    if x < lo {
        format!("below it by {:.3}", lo - x)
    } else if x > hi {
        format!("above it by {:.3}", x - hi)
    } else {
        "inside it".into()
    }
}

/// The automatic reading of the summary: the noise band (BF16 seeds or a bootstrap interval),
/// each recipe's final reward against it, the one-sided pattern when every recipe lands on
/// the same side of BF16, the mismatch ordering with its medians and non-zero counts, the
/// timing ratios of median step times with their spread, and gradient spikes.
pub fn reading(sums: &[RunSummary]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(s) = sums.first() {
        out.push(format!(
            "Windows: \"first\" and \"final\" are the mean reward over the first and the last {} logged step(s) (10% of {} steps, at least one), e.g. steps {}–{} and {}–{} of `{}`.",
            s.window, s.steps, s.first_window.0, s.first_window.1, s.final_window.0, s.final_window.1, s.name
        ));
    }
    let Some(band) = NoiseBand::of(sums) else {
        out.push("No BF16 run: nothing to compare against; the final reward's 95% bootstrap interval is in the table.".into());
        push_mismatch_and_timing(sums, &mut out);
        return out;
    };
    match &band {
        NoiseBand::Seeds { names, final_range, final_mean, mean_range } => out.push(format!(
            "Noise band: {} BF16 seeds ({}) finish at final reward {:.3}–{:.3} (mean {:.3}); their whole-run mean rewards span {:.3}–{:.3}. A recipe inside this band is not distinguishable from BF16 by this experiment; {} seeds bound the noise only roughly.",
            names.len(), names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
            final_range.0, final_range.1, final_mean, mean_range.0, mean_range.1, names.len()
        )),
        NoiseBand::Bootstrap { name, final_range, final_mean } => out.push(format!(
            "Noise band: fewer than {MIN_BF16_SEEDS} BF16 seeds, so the band is the 95% bootstrap interval of `{name}`'s final-window reward over its steps, {:.3}–{:.3} (final {final_mean:.3}). It measures step-to-step noise within one run, not seed-to-seed noise, which is usually larger.",
            final_range.0, final_range.1
        )),
    }
    let low: Vec<&RunSummary> = sums.iter().filter(|s| s.recipe != "bf16").collect();
    if let NoiseBand::Bootstrap {
        name, final_range, ..
    } = &band
    {
        // Another BF16 seed, too few for a seed band, still shows seed-to-seed noise: say it.
        let bf: Vec<&RunSummary> = sums.iter().filter(|s| s.recipe == "bf16").collect();
        if bf.len() >= 2 {
            let others: Vec<String> = bf
                .iter()
                .filter(|s| &s.name != name)
                .map(|s| format!("`{}` {:.3}", s.name, s.final_reward))
                .collect();
            let (lo, hi) = span(&bf, |s| s.final_reward);
            let within = low
                .iter()
                .filter(|s| (lo..=hi).contains(&s.final_reward))
                .count();
            out.push(format!(
                "The other BF16 seed{} finish{} at {}: the BF16 runs' final rewards span {lo:.3}–{hi:.3}, {:.3} apart, against the bootstrap band's width of {:.3}{}. {within} of {} low-precision recipes finish inside that span.",
                if others.len() > 1 { "s" } else { "" },
                if others.len() > 1 { "" } else { "es" },
                others.join(", "),
                hi - lo,
                final_range.1 - final_range.0,
                if hi - lo > final_range.1 - final_range.0 {
                    ": seed-to-seed noise is larger than the band says"
                } else {
                    ""
                },
                low.len()
            ));
        }
    }
    let band_range = band.final_range();
    for s in &low {
        out.push(format!(
            "`{}`: final reward {:.3} (95% bootstrap {:.3}–{:.3}), mean {:.3} — against the BF16 band {:.3}–{:.3}: {}.",
            s.name, s.final_reward, s.final_ci.0, s.final_ci.1, s.mean_reward,
            band_range.0, band_range.1, placement(s.final_reward, band_range)
        ));
    }
    if low.len() >= 2 {
        let centre = band.centre();
        let below = low.iter().filter(|s| s.final_reward < centre).count();
        let inside = low
            .iter()
            .filter(|s| (band_range.0..=band_range.1).contains(&s.final_reward))
            .count();
        let k = low.len();
        let p = 0.5f64.powi(k as i32);
        if below == k || below == 0 {
            let side = if below == k { "below" } else { "above" };
            out.push(format!(
                "One-sided: all {k} low-precision recipes finish {side} the BF16 centre ({centre:.3}), {inside} of them inside the band. If each recipe were equally likely to land above or below, all {k} on one side would happen with probability 2·2^-{k} = {:.3}; the recipes share prompts and seeds, so they are not independent, but the pattern means this run does not show them matching BF16 — only that {inside} of {k} gaps are within the noise band.",
                2.0 * p
            ));
        } else {
            out.push(format!(
                "No one-sided pattern: {below} of {k} low-precision recipes finish below the BF16 centre ({centre:.3}), {} above; {inside} of {k} inside the band.",
                k - below
            ));
        }
    }
    push_mismatch_and_timing(sums, &mut out);
    out
}

fn push_mismatch_and_timing(sums: &[RunSummary], out: &mut Vec<String>) {
    let group = |prefix: &str| -> Option<(f64, f64, usize, usize)> {
        let v: Vec<&RunSummary> = sums
            .iter()
            .filter(|s| s.recipe.starts_with(prefix))
            .collect();
        (!v.is_empty()).then(|| {
            (
                mean(v.iter().map(|s| s.abs_diff.mean)),
                mean(v.iter().map(|s| s.abs_diff.median)),
                v.iter().map(|s| s.abs_diff.nonzero).sum(),
                v.iter().map(|s| s.abs_diff.n).sum(),
            )
        })
    };
    if let (Some(b), Some(m), Some(n)) = (group("bf16"), group("mxfp8"), group("nvfp4")) {
        let ord = if b.0 < m.0 && m.0 < n.0 {
            "observed"
        } else {
            "NOT observed"
        };
        out.push(format!(
            "Mismatch ordering BF16 < MXFP8 < NVFP4 by mean |Δlogprob| (per format family: {:.2e} / {:.2e} / {:.2e}): {ord}. Medians {:.2e} / {:.2e} / {:.2e}; non-zero steps {}/{}, {}/{}, {}/{} — a mean resting on few non-zero steps with a median of 0 is dominated by single steps.",
            b.0, m.0, n.0, b.1, m.1, n.1, b.2, b.3, m.2, m.3, n.2, n.3
        ));
    }
    if let Some(bf) = sums.iter().find(|s| s.name == "bf16") {
        let ratio = |s: &RunSummary| {
            (
                bf.rollout_s.median / s.rollout_s.median,
                bf.rollout_s.p25 / s.rollout_s.p75,
                bf.rollout_s.p75 / s.rollout_s.p25,
            )
        };
        let parts: Vec<String> = sums
            .iter()
            .filter(|s| s.name != "bf16")
            .map(|s| {
                let (r, lo, hi) = ratio(s);
                format!("`{}` {r:.2}× ({lo:.2}–{hi:.2})", s.name)
            })
            .collect();
        if !parts.is_empty() {
            let same: Vec<String> = sums
                .iter()
                .filter(|s| s.recipe == "bf16" && s.name != "bf16")
                .map(|s| format!("{:.2}×", ratio(s).0))
                .collect();
            out.push(format!(
                "Rollout speed vs BF16 (median rollout seconds per step of `bf16` ÷ the run's; in brackets the ratio of the interquartile ends, the step-to-step spread): {}.{}",
                parts.join(", "),
                if same.is_empty() {
                    String::new()
                } else {
                    format!(
                        " Identical BF16 recipes with other seeds come out at {}: differences of that size are this machine's noise, not the formats'.",
                        same.join(", ")
                    )
                }
            ));
        }
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
}

fn render_markdown(man: &Manifest, sums: &[RunSummary]) -> String {
    let mut s = String::new();
    let single = man.runs.len() == 1 && man.runs[0].dir == ".";
    let _ = writeln!(
        s,
        "# mxrl {} report\n",
        if single { "run" } else { "ablation" }
    );
    let _ = writeln!(s, "- model: {}", man.model);
    if !man.model_digest.is_empty() {
        let _ = writeln!(s, "- model digest (sha256): `{}`", man.model_digest);
    }
    if !man.device.is_empty() {
        let _ = writeln!(s, "- runs on: {}", man.device);
    }
    let _ = writeln!(s, "- task: {}", man.task);
    if !single {
        let _ = writeln!(
            s,
            "- runs: {} (identical prompts and hyper-parameters; only the precision recipe differs, plus BF16 runs with other seeds for run-to-run noise)",
            man.runs
                .iter()
                .map(|r| if sums.iter().any(|x| x.name == r.name) {
                    format!("`{}` (seed {})", r.name, r.seed)
                } else {
                    format!("`{}` (seed {}; not run yet: no metrics)", r.name, r.seed)
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(s, "- regenerate: `mxrl report <this directory>`\n");
    let _ = writeln!(s, "## Reading\n");
    for l in reading(sums) {
        let _ = writeln!(s, "- {l}");
    }
    let _ = writeln!(
        s,
        "- Timing note: rollout/train times are wall-clock of this machine; {}",
        if !man.device.is_empty() && !man.device.starts_with("cpu") {
            "on Hopper the block-format products run exactly on BF16 tensor cores (decode reads the stored bytes; the training backward multiplies the mode's exact BF16 operands, NVFP4's dequantized ones as three parts), so the time differences are this engine's, not the formats' on hardware with MXFP8/NVFP4 tensor cores."
        } else {
            "on CPU the block-format GEMMs are emulated (operands quantized by the contract quantizer and decoded exactly, f32 accumulation), so time differences between recipes are not format speedups."
        }
    );
    let _ = writeln!(s, "\n## Summary\n");
    let _ = writeln!(
        s,
        "Reward windows as defined above; the bracket is the 95% bootstrap interval of the final window. Mismatch columns: mean / median over steps (steps with a non-zero value). Times: median over steps [interquartile range]."
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| run | steps | reward first → final [95%] | mean reward | \\|Δlogp\\| mean / median (non-zero) | K3 KL mean / median (non-zero) | max grad norm | spikes | rollout s/step | train s/step | sync s/step | tokens/s (median) | weight bytes | rollout speed vs BF16 (median ratio) |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let bf_roll = sums.iter().find(|x| x.name == "bf16").map(|x| x.rollout_s);
    let sp = |x: &Spread| format!("{:.3} [{:.3}–{:.3}]", x.median, x.p25, x.p75);
    for r in sums {
        let speed = bf_roll.map_or("–".into(), |b| {
            format!(
                "{:.2}× ({:.2}–{:.2})",
                b.median / r.rollout_s.median,
                b.p25 / r.rollout_s.p75,
                b.p75 / r.rollout_s.p25
            )
        });
        let _ = writeln!(
            s,
            "| `{}` | {} | {:.3} → {:.3} [{:.3}–{:.3}] | {:.3} | {} | {} | {:.3} | {} | {} | {} | {} | {:.0} | {} | {} |",
            r.name,
            r.steps,
            r.initial_reward,
            r.final_reward,
            r.final_ci.0,
            r.final_ci.1,
            r.mean_reward,
            fmt_stat(&r.abs_diff),
            fmt_stat(&r.k3),
            r.max_grad_norm,
            r.spikes,
            sp(&r.rollout_s),
            sp(&r.train_s),
            sp(&r.sync_s),
            r.tokens_per_s,
            if r.weight_bytes > 0 { fmt_bytes(r.weight_bytes) } else { "–".into() },
            speed
        );
    }
    if man.runs.iter().any(|e| !e.weight_bytes.is_empty()) {
        // One column per format any run stores, in the contract's order.
        let formats: Vec<&str> = mxrl_formats::Format::ALL
            .iter()
            .map(|f| f.name())
            .filter(|f| man.runs.iter().any(|e| e.weight_bytes.contains_key(*f)))
            .collect();
        let _ = writeln!(s, "\nWeight bytes per format:\n");
        let _ = writeln!(s, "| run | {} |", formats.join(" | "));
        let _ = writeln!(s, "|---|{}", "---|".repeat(formats.len()));
        for e in &man.runs {
            let cells: Vec<String> = formats
                .iter()
                .map(|f| e.weight_bytes.get(*f).map_or("–".into(), |b| fmt_bytes(*b)))
                .collect();
            let _ = writeln!(s, "| `{}` | {} |", e.name, cells.join(" | "));
        }
    }
    s.push_str(&speedup_section(sums));
    s.push_str(&drift_section(sums));
    s.push_str(&phases_section(sums));
    s.push_str(&routing_section(sums));
    s.push_str(&aux_section(sums));
    let _ = writeln!(s, "\n## Plots\n");
    let drift = sums.iter().any(|r| !r.drift.is_empty());
    let routing = routing_plotted(sums) != (false, false);
    for (f, t) in [
        ("reward.png", "Reward vs step"),
        (
            "mismatch.png",
            "Train-rollout mismatch (log scale; steps with 0 left out, counted in the table)",
        ),
        ("grad_norm.png", "Gradient norm"),
        ("rollout.png", "Rollout time and throughput"),
        ("sync.png", "Weight-sync time"),
        ("train.png", "Train time and throughput"),
    ]
    .into_iter()
    .chain(drift.then_some((
        "drift.png",
        "Per-layer drift (log scale; steps with 0 left out, counted in the table)",
    )))
    .chain(routing.then_some((
        "routing.png",
        "Routing balance: the training aux loss and the decode step's busiest expert",
    ))) {
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

    /// Write an ablation directory with `runs` = (name, recipe, seed, per-step metrics).
    fn write_ablation(dir: &Path, runs: &[(&str, &str, u64, Vec<StepMetrics>)]) {
        let mut entries = Vec::new();
        for (name, recipe, seed, ms) in runs {
            std::fs::create_dir_all(dir.join(name)).unwrap();
            for m in ms {
                crate::metrics::append_jsonl(&dir.join(name).join("metrics.jsonl"), m).unwrap();
            }
            entries.push(RunEntry {
                name: name.to_string(),
                recipe: recipe.to_string(),
                seed: *seed,
                dir: name.to_string(),
                weight_bytes: if *recipe == "fp8-block" {
                    BTreeMap::from([("bf16".to_string(), 10u64), ("fp8_block".to_string(), 990)])
                } else {
                    BTreeMap::from([("bf16".to_string(), 1000u64)])
                },
                plan_hash: String::new(),
            });
        }
        let man = Manifest {
            model: "m".into(),
            task: "t".into(),
            config: serde_json::json!({}),
            runs: entries,
            model_path: String::new(),
            model_digest: String::new(),
            device: "cpu".into(),
        };
        std::fs::write(
            dir.join("ablation.json"),
            serde_json::to_string(&man).unwrap(),
        )
        .unwrap();
    }

    /// 20 steps of reward `base + step/20`; |Δlogp| `diff` on every third step, else 0.
    fn steps(base: f64, diff: f64, rollout_s: f64) -> Vec<StepMetrics> {
        (0..20u64)
            .map(|step| StepMetrics {
                step,
                reward_mean: base + step as f64 / 20.0,
                train_rollout_logprob_abs_diff: if step % 3 == 0 { diff } else { 0.0 },
                k3_kl: if step % 3 == 0 { diff * diff } else { 0.0 },
                grad_norm: 1.0,
                rollout_s,
                tokens_per_s: 100.0,
                ..Default::default()
            })
            .collect()
    }

    /// A run listed in `ablation.json` without metrics (an ablation run in parts) is named as
    /// not run yet, and the timing note follows the device line: the CPU reference's, or the
    /// device engine's on any GPU line.
    #[test]
    fn runs_without_metrics_are_named_and_the_timing_note_follows_the_device() {
        let d = tempfile::tempdir().unwrap();
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, steps(0.0, 0.0, 1.0)),
                ("nvfp4-dq", "nvfp4-dq", 1, Vec::new()),
            ],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        assert!(
            md.contains("`bf16` (seed 1), `nvfp4-dq` (seed 1; not run yet: no metrics)"),
            "{md}"
        );
        assert!(
            md.contains("on CPU the block-format GEMMs are emulated"),
            "{md}"
        );
        for device in [
            "cuda:0 (NVIDIA H100 80GB HBM3): the device engine",
            "GPU 0: the device engine",
        ] {
            let p = d.path().join("ablation.json");
            let mut man: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            man["device"] = device.into();
            std::fs::write(&p, man.to_string()).unwrap();
            let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
            assert!(
                md.contains("on Hopper the block-format products run exactly on BF16"),
                "{device}: {md}"
            );
        }
    }

    /// The per-format weight table has a column for every format some run stores, FP8-block
    /// included, and a dash where a run stores none of it.
    #[test]
    fn weight_bytes_table_has_a_column_per_stored_format() {
        let d = tempfile::tempdir().unwrap();
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, steps(0.0, 0.0, 1.0)),
                ("fp8-block", "fp8-block", 1, steps(0.0, 1e-3, 1.0)),
            ],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        assert!(
            md.contains("| run | bf16 | fp8_block |\n|---|---|---|\n"),
            "{md}"
        );
        assert!(md.contains("| `bf16` | 1000 B | – |"), "{md}");
        assert!(md.contains("| `fp8-block` | 10 B | 990 B |"), "{md}");
    }

    #[test]
    fn report_renders_pngs_and_reading_from_metrics() {
        let d = tempfile::tempdir().unwrap();
        let mut nv = steps(-0.005, 0.05, 2.0);
        nv[15].grad_norm = 50.0;
        nv[15].grad_spike = true;
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, steps(0.0, 1e-9, 1.0)),
                ("mxfp8", "mxfp8", 1, steps(-0.01, 0.01, 1.5)),
                ("nvfp4-hp", "nvfp4-hp", 1, nv),
                ("bf16-seed2", "bf16", 2, steps(0.02, 0.0, 1.0)),
                ("bf16-seed3", "bf16", 3, steps(-0.02, 0.0, 1.0)),
            ],
        );
        let p = write_report(d.path()).unwrap();
        let md = std::fs::read_to_string(p).unwrap();
        assert!(md.contains("| `nvfp4-hp` |"));
        // Windows are defined: 10% of 20 steps = steps 0–1 and 18–19.
        assert!(
            md.contains(
                "last 2 logged step(s) (10% of 20 steps, at least one), e.g. steps 0–1 and 18–19"
            ),
            "{md}"
        );
        // The band comes from the three BF16 seeds: final rewards 0.925 ± 0.02.
        assert!(md.contains("Noise band: 3 BF16 seeds (`bf16`, `bf16-seed2`, `bf16-seed3`) finish at final reward 0.905–0.945 (mean 0.925)"), "{md}");
        // mxfp8 (0.915) and nvfp4-hp (0.920) are inside, both below the centre.
        assert!(md.contains("`mxfp8`: final reward 0.915"), "{md}");
        assert!(md.contains("`nvfp4-hp`: final reward 0.920"), "{md}");
        assert!(
            md.contains("against the BF16 band 0.905–0.945: inside it."),
            "{md}"
        );
        assert!(
            md.contains(
                "One-sided: all 2 low-precision recipes finish below the BF16 centre (0.925)"
            ),
            "{md}"
        );
        // Mean and median with non-zero counts: 7 of 20 steps (0, 3, …, 18) are 0.05, so the
        // mean is 0.05 · 7 / 20 and the median 0.
        assert!(
            md.contains("| 1.75e-2 / 0.00e0 (7 of 20 non-zero) |"),
            "{md}"
        );
        assert!(md.contains("Mismatch ordering BF16 < MXFP8 < NVFP4 by mean |Δlogprob|"));
        assert!(md.contains("): observed."), "{md}");
        assert!(md.contains("non-zero steps 7/60, 7/20, 7/20"), "{md}");
        // Timing from median step times: BF16 1 s, nvfp4-hp 2 s.
        assert!(md.contains("`nvfp4-hp` 0.50× (0.50–0.50)"), "{md}");
        assert!(
            md.contains("Identical BF16 recipes with other seeds come out at 1.00×, 1.00×"),
            "{md}"
        );
        assert!(md.contains("Gradient-norm spikes: `nvfp4-hp` (1)"));
        assert!(!md.contains("tracks BF16"), "{md}");
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

    fn summary(name: &str, recipe: &str, final_reward: f64) -> RunSummary {
        let e = RunEntry {
            name: name.into(),
            recipe: recipe.into(),
            seed: 1,
            dir: name.into(),
            weight_bytes: BTreeMap::new(),
            plan_hash: String::new(),
        };
        let mut s = summarize(&e, &steps(0.0, 0.0, 1.0));
        s.final_reward = final_reward;
        s
    }

    /// Rollout phases: medians over the steps that recorded them (decode per step = decode
    /// time ÷ decode steps of each step), in milliseconds in the table; runs without phases
    /// get dashes, and no run with phases gives no section.
    #[test]
    fn rollout_phases_are_medians_over_the_steps_that_recorded_them() {
        let e = RunEntry {
            name: "gpu".into(),
            recipe: "bf16".into(),
            seed: 1,
            dir: "gpu".into(),
            weight_bytes: BTreeMap::new(),
            plan_hash: String::new(),
        };
        let mut m = steps(0.0, 0.0, 1.0);
        for (i, x) in m.iter_mut().enumerate().take(3) {
            x.rollout_phases = Some(crate::policy::GenTiming {
                prefill_s: 0.001 * (i + 1) as f64,
                decode_s: 0.010 * (i + 1) as f64,
                decode_steps: 10,
                readback_s: 0.004,
                prefill_tokens: 64,
            });
        }
        let with = summarize(&e, &m);
        let [pre, per, steps_med, back] = with.phases.expect("phases");
        assert!((pre - 0.002).abs() < 1e-12 && (per - 0.002).abs() < 1e-12);
        assert!((steps_med - 10.0).abs() < 1e-12 && (back - 0.004).abs() < 1e-12);
        let without = summary("cpu", "bf16", 0.5);
        assert!(without.phases.is_none());
        let t = phases_section(&[with, without.clone()]);
        assert!(t.contains("| `gpu` | 2.0 | 2.000 | 10 | 4.0 |"), "{t}");
        assert!(t.contains("| `cpu` | – | – | – | – |"), "{t}");
        assert!(phases_section(&[without]).is_empty());
    }

    #[test]
    fn y_labels_drop_trailing_zeros() {
        let l = |v: f64| y_label(&v);
        assert_eq!(
            [
                l(48.0),
                l(12.35),
                l(0.125),
                l(0.1),
                l(0.0),
                l(-0.0001),
                l(1e-4),
                l(2.5e5)
            ],
            ["48", "12.35", "0.125", "0.1", "0", "-1e-4", "1e-4", "2e5"]
        );
        assert_eq!(l(-0.0), "0");
    }

    /// The aux loss: the means of the first and last windows of the steps that recorded it
    /// (here 12 of 20: windows of one step), a dash for a run without it, no section when no
    /// run has it.
    #[test]
    fn aux_loss_windows_cover_the_steps_that_recorded_it() {
        let e = RunEntry {
            name: "aux".into(),
            recipe: "bf16".into(),
            seed: 1,
            dir: "aux".into(),
            weight_bytes: BTreeMap::new(),
            plan_hash: String::new(),
        };
        let mut m = steps(0.0, 0.0, 1.0);
        for (i, x) in m.iter_mut().enumerate().skip(4).take(12) {
            x.aux_loss = Some(10.0 - i as f64 / 2.0);
        }
        let with = summarize(&e, &m);
        assert_eq!(with.aux_loss, Some((8.0, 2.5)));
        let without = summary("plain", "bf16", 0.5);
        assert!(without.aux_loss.is_none());
        let t = aux_section(&[with, without.clone()]);
        assert!(t.contains("| `aux` | 8.000 → 2.500 |"), "{t}");
        assert!(t.contains("| `plain` | – |"), "{t}");
        assert!(aux_section(&[without]).is_empty());
    }

    #[test]
    fn every_recipe_below_bf16_is_called_one_sided_not_tracking() {
        let sums = vec![
            summary("bf16", "bf16", 0.52),
            summary("mxfp8", "mxfp8", 0.39),
            summary("nvfp4-hp", "nvfp4-hp", 0.41),
            summary("nvfp4-dq", "nvfp4-dq", 0.44),
            summary("bf16-seed2", "bf16", 0.38),
            summary("bf16-seed3", "bf16", 0.47),
        ];
        let r = reading(&sums).join("\n");
        assert!(r.contains("One-sided: all 3 low-precision recipes finish below the BF16 centre (0.457), 3 of them inside the band"), "{r}");
        assert!(r.contains("probability 2·2^-3 = 0.250"), "{r}");
        // Mixed sides: no pattern claimed.
        let mut mixed = sums.clone();
        mixed[3].final_reward = 0.50;
        let r = reading(&mixed).join("\n");
        assert!(
            r.contains("No one-sided pattern: 2 of 3 low-precision recipes finish below"),
            "{r}"
        );
        // Outside the band is said with the distance.
        let mut far = sums.clone();
        far[1].final_reward = 0.30;
        let r = reading(&far).join("\n");
        assert!(
            r.contains("`mxfp8`: final reward 0.300") && r.contains("below it by 0.080"),
            "{r}"
        );
    }

    #[test]
    fn fewer_than_three_bf16_seeds_fall_back_to_a_bootstrap_band() {
        let sums = vec![summary("bf16", "bf16", 0.5), summary("mxfp8", "mxfp8", 0.4)];
        let NoiseBand::Bootstrap { final_range, .. } = NoiseBand::of(&sums).unwrap() else {
            panic!("expected a bootstrap band")
        };
        assert_eq!(final_range, sums[0].final_ci);
        let r = reading(&sums).join("\n");
        assert!(
            r.contains("fewer than 3 BF16 seeds, so the band is the 95% bootstrap interval"),
            "{r}"
        );
    }

    /// With two BF16 seeds (too few for a seed band) the reading also gives the span of their
    /// final rewards and how many low-precision recipes finish inside it.
    #[test]
    fn a_second_bf16_seed_gives_the_seed_to_seed_span() {
        let mut sums = vec![
            summary("bf16", "bf16", 0.317),
            summary("mxfp8", "mxfp8", 0.304),
            summary("fp8-block", "fp8-block", 0.250),
            summary("bf16-seed2", "bf16", 0.272),
        ];
        sums[0].final_ci = (0.278, 0.353);
        let r = reading(&sums).join("\n");
        assert!(
            r.contains("The other BF16 seed finishes at `bf16-seed2` 0.272: the BF16 runs' final rewards span 0.272–0.317, 0.045 apart, against the bootstrap band's width of 0.075. 1 of 2 low-precision recipes finish inside that span."),
            "{r}"
        );
        // One BF16 run: no such line.
        sums.pop();
        assert!(!reading(&sums).join("\n").contains("The other BF16 seed"));
        // A span wider than the band is called out.
        sums.push(summary("bf16-seed2", "bf16", 0.2));
        let r = reading(&sums).join("\n");
        assert!(
            r.contains("0.117 apart, against the bootstrap band's width of 0.075: seed-to-seed noise is larger than the band says. 2 of 2"),
            "{r}"
        );
    }

    #[test]
    fn quantiles_stats_and_bootstrap_match_hand_values() {
        assert_eq!(quantile(&[4.0, 1.0, 3.0, 2.0], 0.5), 2.5);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.25), 2.0);
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0], 0.75), 3.25);
        let s = Stat::of(&[0.0, 0.0, 3.0, 0.0]);
        assert_eq!((s.mean, s.median, s.nonzero, s.n), (0.75, 0.0, 1, 4));
        // A constant window has a zero-width interval; a spread window a wider one that
        // contains its mean.
        assert_eq!(bootstrap_mean_ci(&[0.5; 8]), (0.5, 0.5));
        let (lo, hi) = bootstrap_mean_ci(&[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
        assert!(lo < 0.5 && hi > 0.5 && lo >= 0.0 && hi <= 1.0, "{lo} {hi}");
        assert_eq!(window_len(80), 8);
        assert_eq!(window_len(5), 1);
    }

    #[test]
    fn log_axis_bounds_leave_out_zero_steps_and_x_is_integer() {
        let s: Series<'_> = vec![("a", vec![(0.0, 0.0), (1.0, 1e-9), (2.0, 1e-6), (3.0, 0.0)])];
        let (x0, x1, y0, y1) = bounds(&s, Axis::Log);
        assert_eq!((x0, x1), (0, 3));
        assert_eq!((y0, y1), (0.5e-9, 2e-6));
        // All zero: still a valid (positive) log range.
        let z: Series<'_> = vec![("a", vec![(0.0, 0.0), (1.0, 0.0)])];
        let (_, _, y0, y1) = bounds(&z, Axis::Log);
        assert!(y0 > 0.0 && y1 > y0);
    }

    #[test]
    fn report_of_a_single_rl_run_directory() {
        let d = tempfile::tempdir().unwrap();
        for m in steps(0.1, 1e-8, 1.0) {
            crate::metrics::append_jsonl(&d.path().join("metrics.jsonl"), &m).unwrap();
        }
        let p = write_report(d.path()).unwrap();
        let md = std::fs::read_to_string(p).unwrap();
        assert!(md.starts_with("# mxrl run report"), "{md}");
        assert!(md.contains("| `run` | 20 |"), "{md}");
        assert!(d.path().join("mismatch.png").exists());
        // An empty directory names what it expected.
        let e = write_report(tempfile::tempdir().unwrap().path()).unwrap_err();
        assert!(e.to_string().contains("ablation.json"), "{e}");
    }

    /// 10 steps of a run whose training takes `train_s` per step for 100 response tokens,
    /// rollout `tps` tokens/s, and per-layer drift `drift[l]` (layer 1 exactly 0 on even
    /// steps, as bitwise steps would be).
    fn probed(train_s: f64, tps: f64, drift: &[f64]) -> Vec<StepMetrics> {
        (0..10u64)
            .map(|step| StepMetrics {
                step,
                reward_mean: 0.5,
                grad_norm: 1.0,
                rollout_s: 1.0,
                train_s,
                sync_s: 0.1,
                tokens: 100,
                tokens_per_s: tps,
                hidden_diff: drift
                    .iter()
                    .enumerate()
                    .map(|(l, d)| if l == 1 && step % 2 == 0 { 0.0 } else { *d })
                    .collect(),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn report_adds_drift_and_train_plots_and_a_speedup_table_with_the_seed_band() {
        let d = tempfile::tempdir().unwrap();
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, probed(0.5, 1000.0, &[1e-9, 2e-9, 3e-9])),
                (
                    "mxfp8",
                    "mxfp8",
                    1,
                    probed(0.25, 1500.0, &[1e-4, 2e-4, 4e-4]),
                ),
                (
                    "nvfp4-hp",
                    "nvfp4-hp",
                    1,
                    probed(0.5, 1050.0, &[1e-3, 5e-3, 2e-3]),
                ),
                (
                    "bf16-seed2",
                    "bf16",
                    2,
                    probed(0.4, 1100.0, &[1e-9, 2e-9, 3e-9]),
                ),
                (
                    "bf16-seed3",
                    "bf16",
                    3,
                    probed(0.5, 950.0, &[1e-9, 2e-9, 3e-9]),
                ),
            ],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        // Train tokens/s = 100 tokens / train_s: 200 for bf16, 400 for mxfp8, 250 for
        // bf16-seed2. Band over the BF16 seeds: rollout 0.95–1.10×, train 1.00–1.25×, step
        // (1.6 s / step s) 1.00–1.07× (1.6 / 1.5).
        assert!(
            md.contains("rollout 0.95–1.10×, train 1.00–1.25×, step 1.00–1.07×"),
            "{md}"
        );
        assert!(
            md.contains("| `mxfp8` | 1500 | 1.50× (above band) | 400 | 2.00× (above band) | 1.350 | 1.19× (above band) | 0.100 | 7.4% |"),
            "{md}"
        );
        assert!(
            md.contains("| `nvfp4-hp` | 1050 | 1.05× (in band) | 200 | 1.00× (in band) | 1.600 | 1.00× (in band) | 0.100 | 6.2% |"),
            "{md}"
        );
        // Per-layer medians with non-zero counts; layer 1 is 0 on 5 of 10 steps, so its
        // median is the mean of the middle pair (0 and the value).
        assert!(
            md.contains("| `mxfp8` | 1.00e-4 (10/10) | 1.00e-4 (5/10) | 4.00e-4 (10/10) | 2 |"),
            "{md}"
        );
        assert!(
            md.contains("| `nvfp4-hp` | 1.00e-3 (10/10) | 2.50e-3 (5/10) | 2.00e-3 (10/10) | 1 |"),
            "{md}"
        );
        for f in ["drift.png", "train.png"] {
            let b = std::fs::read(d.path().join(f)).unwrap();
            assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n", "{f}");
            assert!(
                b.len() > 10_000,
                "{f} has {} bytes: nothing drawn?",
                b.len()
            );
            assert!(md.contains(&format!("]({f})")), "{f} not linked");
        }
    }

    /// `routing.png` is drawn and linked when a run recorded the aux loss or decode routes
    /// (here one run each), and neither file nor link exists when none did.
    #[test]
    fn the_routing_plot_follows_what_the_runs_recorded() {
        let d = tempfile::tempdir().unwrap();
        let mut aux = steps(0.2, 1e-3, 1.0);
        for (i, x) in aux.iter_mut().enumerate() {
            x.aux_loss = Some(9.0 - i as f64 / 20.0);
        }
        let mut routed = steps(0.3, 1e-3, 1.0);
        for (i, x) in routed.iter_mut().enumerate() {
            x.decode_busiest_share = vec![0.1, 0.12 - i as f64 / 1000.0];
        }
        write_ablation(
            d.path(),
            &[("bf16", "bf16", 1, aux), ("mxfp8", "mxfp8", 1, routed)],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        let b = std::fs::read(d.path().join("routing.png")).unwrap();
        assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
        assert!(b.len() > 10_000, "{} bytes: nothing drawn?", b.len());
        assert!(md.contains("](routing.png)"), "{md}");
        let d = tempfile::tempdir().unwrap();
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, steps(0.2, 1e-3, 1.0)),
                ("mxfp8", "mxfp8", 1, steps(0.3, 1e-3, 1.0)),
            ],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        assert!(!d.path().join("routing.png").exists());
        assert!(!md.contains("routing.png"), "{md}");
    }

    #[test]
    fn runs_without_probes_or_noise_seeds_get_no_drift_plot_and_no_band() {
        let d = tempfile::tempdir().unwrap();
        write_ablation(
            d.path(),
            &[
                ("bf16", "bf16", 1, probed(0.5, 1000.0, &[])),
                ("mxfp8", "mxfp8", 1, probed(0.25, 1500.0, &[])),
            ],
        );
        let md = std::fs::read_to_string(write_report(d.path()).unwrap()).unwrap();
        assert!(!d.path().join("drift.png").exists());
        assert!(
            !md.contains("## Per-layer drift") && !md.contains("drift.png"),
            "{md}"
        );
        assert!(d.path().join("train.png").exists());
        assert!(
            md.contains("No BF16 runs with other seeds: there is no seed-to-seed band"),
            "{md}"
        );
        assert!(
            md.contains("| `mxfp8` | 1500 | 1.50× | 400 | 2.00× |"),
            "{md}"
        );
    }
}
