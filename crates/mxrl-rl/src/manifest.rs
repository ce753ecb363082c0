//! Run manifests: what a run directory (`run.json`) or an ablation directory (`ablation.json`)
//! was started with, so that resuming the same directory with another experiment is refused
//! with the list of differing fields instead of silently mixing two runs' metrics.
//!
//! Two manifests are compared as flattened JSON (`config.adam.lr`, `recipe`, ...). Fields that
//! do not change what a step computes may differ on resume: [`RESUMABLE_FIELDS`].

use crate::runner::{RlConfig, RunError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Version of the `run.json` layout.
pub const RUN_MANIFEST_VERSION: u32 = 1;

/// Fields that may change between a run and its resumption: the step budget (resuming with a
/// larger `--steps` extends the run), checkpoint cadence and the weight-sync byte check, and
/// the model's path (its digest is compared).
pub const RESUMABLE_FIELDS: [&str; 4] = [
    "config.steps",
    "config.checkpoint_every",
    "config.check_weight_sync",
    "model_path",
];

/// `run.json`: the full configuration of one RL run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunManifest {
    /// Layout version ([`RUN_MANIFEST_VERSION`]).
    pub version: u32,
    /// Recipe as given (preset name or TOML path).
    pub recipe: String,
    /// Hash of the resolved precision plan.
    pub plan_hash: String,
    /// Quantizer contract hash stamped on weight updates.
    pub contract_hash: String,
    /// Model directory as given.
    pub model_path: String,
    /// [`model_digest`] of the model directory.
    pub model_digest: String,
    /// Task description (built-in task and its settings, or the prompt file and its digest).
    pub task: String,
    /// Where the linear GEMMs run (`cpu`, `cuda:0 ...`).
    pub device: String,
    /// Every hyper-parameter, the seed included.
    pub config: RlConfig,
}

/// SHA-256 over a model directory's `config.json`, `tokenizer.json` and `*.safetensors` files (names sorted;
/// each file's name and bytes), hex. Two directories with the same weights and configuration
/// have the same digest wherever they are.
pub fn model_digest(dir: &Path) -> Result<String, RunError> {
    let io = |p: &Path, e: std::io::Error| RunError::Checkpoint {
        path: p.display().to_string(),
        msg: format!("reading the model for its digest: {e}"),
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n == "config.json"
                    || n == "tokenizer.json"
                    || (n.ends_with(".safetensors") && !n.starts_with('.'))
            })
        })
        .collect();
    files.sort();
    let mut h = Sha256::new();
    for p in &files {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        let mut f = std::fs::File::open(p).map_err(|e| io(p, e))?;
        let len = f.metadata().map_err(|e| io(p, e))?.len();
        h.update(len.to_le_bytes());
        std::io::copy(&mut f, &mut h).map_err(|e| io(p, e))?;
    }
    Ok(format!("{:x}", h.finalize()))
}

/// SHA-256 of one file, hex (prompt files in task descriptions).
pub fn file_digest(path: &Path) -> Result<String, RunError> {
    let mut f = std::fs::File::open(path).map_err(|e| RunError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("reading for its digest: {e}"),
    })?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|e| RunError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("reading for its digest: {e}"),
    })?;
    Ok(format!("{:x}", h.finalize()))
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, x, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// The fields where `there` (recorded) and `now` differ, as `field: THERE (recorded) ≠ NOW`,
/// leaving out `ignore`d field paths. Missing fields read as `(absent)`.
pub fn differing_fields(
    there: &serde_json::Value,
    now: &serde_json::Value,
    ignore: &[&str],
) -> Vec<String> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", there, &mut a);
    flatten("", now, &mut b);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| !ignore.contains(&k.as_str()))
        .filter_map(|k| {
            let (x, y) = (a.get(k), b.get(k));
            (x != y).then(|| {
                format!(
                    "{k}: {} (recorded) ≠ {} (now)",
                    x.map_or("(absent)", |s| s.as_str()),
                    y.map_or("(absent)", |s| s.as_str())
                )
            })
        })
        .collect()
}

/// `value` as JSON the way it reads back from its file (f32 fields keep their shortest
/// decimal form instead of widening to f64), for comparison with a recorded manifest.
pub fn as_written<S: Serialize>(value: &S) -> serde_json::Value {
    let text = serde_json::to_string(value).expect("manifests serialize");
    serde_json::from_str(&text).expect("serialized JSON parses")
}

/// Write `value` as pretty JSON to `path` atomically (`mxrl_ckpt::write_atomic`).
pub fn write_json_atomic<S: Serialize>(path: &Path, value: &S) -> Result<(), RunError> {
    let text = serde_json::to_string_pretty(value).expect("manifests serialize");
    Ok(mxrl_ckpt::write_bytes_atomic(path, text.as_bytes())?)
}

/// Files a run writes into its directory (what `restart` discards).
pub const RUN_FILES: [&str; 3] = ["run.json", "metrics.jsonl", "checkpoint.safetensors"];

/// Make `dir` ready for the run described by `m`:
/// - `restart`: discard the run files there ([`RUN_FILES`]) and start over;
/// - `dir/run.json` exists: it must describe the same run (up to [`RESUMABLE_FIELDS`]),
///   otherwise [`RunError::OtherRun`] lists every differing field; the file is then updated;
/// - run files without `run.json` (an unknown run): refused;
/// - otherwise `run.json` is written.
///
/// Returns whether a run was there to resume.
pub fn prepare_run_dir(dir: &Path, m: &RunManifest, restart: bool) -> Result<bool, RunError> {
    std::fs::create_dir_all(dir).map_err(|e| RunError::Checkpoint {
        path: dir.display().to_string(),
        msg: format!("creating the run directory: {e}"),
    })?;
    if restart {
        for f in RUN_FILES {
            let p = dir.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| RunError::Checkpoint {
                    path: p.display().to_string(),
                    msg: format!("removing for --restart: {e}"),
                })?;
            }
        }
    }
    let path = dir.join("run.json");
    let now = as_written(m);
    let resumed = if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(|e| RunError::Checkpoint {
            path: path.display().to_string(),
            msg: format!("reading: {e}"),
        })?;
        let there: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| RunError::Checkpoint {
                path: path.display().to_string(),
                msg: format!("parsing: {e}"),
            })?;
        let diffs = differing_fields(&there, &now, &RESUMABLE_FIELDS);
        if !diffs.is_empty() {
            return Err(RunError::OtherRun {
                dir: dir.display().to_string(),
                diffs,
            });
        }
        dir.join("checkpoint.safetensors").exists()
    } else {
        let stray: Vec<&str> = RUN_FILES[1..]
            .iter()
            .copied()
            .filter(|f| dir.join(f).exists())
            .collect();
        if !stray.is_empty() {
            return Err(RunError::OtherRun {
                dir: dir.display().to_string(),
                diffs: vec![format!(
                    "{} present without run.json: a run of unknown configuration",
                    stray.join(" and ")
                )],
            });
        }
        false
    };
    write_json_atomic(&path, m)?;
    Ok(resumed)
}

/// Read `DIR/run.json`.
pub fn read_run_manifest(dir: &Path) -> Result<RunManifest, RunError> {
    let path = dir.join("run.json");
    let text = std::fs::read_to_string(&path).map_err(|e| RunError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("reading: {e}"),
    })?;
    serde_json::from_str(&text).map_err(|e| RunError::Checkpoint {
        path: path.display().to_string(),
        msg: format!("parsing: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> RunManifest {
        RunManifest {
            version: RUN_MANIFEST_VERSION,
            recipe: "bf16".into(),
            plan_hash: "p".into(),
            contract_hash: "c".into(),
            model_path: "runs/base".into(),
            model_digest: "d".into(),
            task: "arithmetic".into(),
            device: "cpu".into(),
            config: RlConfig::default(),
        }
    }

    #[test]
    fn resuming_with_another_recipe_lr_or_model_is_refused_with_every_field() {
        let d = tempfile::tempdir().unwrap();
        let m = manifest();
        assert!(!prepare_run_dir(d.path(), &m, false).unwrap());
        // The same run (more steps, another path to the same model) resumes.
        let mut more = m.clone();
        more.config.steps += 10;
        more.model_path = "elsewhere/base".into();
        prepare_run_dir(d.path(), &more, false).unwrap();
        let mut other = m.clone();
        other.recipe = "nvfp4-hp".into();
        other.config.adam.lr = 2e-3;
        other.model_digest = "e".into();
        let e = prepare_run_dir(d.path(), &other, false).unwrap_err();
        let RunError::OtherRun { diffs, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(diffs.len(), 3, "{diffs:?}");
        assert!(
            diffs[0].starts_with("config.adam.lr: 0.001 (recorded) ≠ 0.002 (now)"),
            "{diffs:?}"
        );
        assert!(diffs[1].starts_with("model_digest: \"d\" (recorded) ≠ \"e\""));
        assert!(diffs[2].starts_with("recipe: \"bf16\" (recorded) ≠ \"nvfp4-hp\""));
        let msg = e.to_string();
        assert!(msg.contains("--restart"), "{msg}");
        // Asked to, it starts over and records the new run.
        std::fs::write(d.path().join("metrics.jsonl"), "x").unwrap();
        assert!(!prepare_run_dir(d.path(), &other, true).unwrap());
        assert!(!d.path().join("metrics.jsonl").exists());
        assert_eq!(read_run_manifest(d.path()).unwrap(), other);
    }

    #[test]
    fn run_files_without_a_manifest_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("metrics.jsonl"), "").unwrap();
        let e = prepare_run_dir(d.path(), &manifest(), false).unwrap_err();
        assert!(e
            .to_string()
            .contains("metrics.jsonl present without run.json"));
    }

    #[test]
    fn model_digest_follows_bytes_not_location() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for d in [a.path(), b.path()] {
            std::fs::write(d.join("config.json"), "{}").unwrap();
            std::fs::write(d.join("model.safetensors"), [1u8, 2, 3]).unwrap();
            std::fs::write(d.join("README.md"), d.display().to_string()).unwrap();
        }
        assert_eq!(
            model_digest(a.path()).unwrap(),
            model_digest(b.path()).unwrap()
        );
        std::fs::write(b.path().join("model.safetensors"), [1u8, 2, 4]).unwrap();
        assert_ne!(
            model_digest(a.path()).unwrap(),
            model_digest(b.path()).unwrap()
        );
    }
}
