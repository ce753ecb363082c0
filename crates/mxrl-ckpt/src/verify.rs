//! `verify`: re-derive a converted checkpoint from its source and compare every byte.
//!
//! Checks, each reported per item: the contract version and hash recorded in `mxrl.json`
//! equal this build's; the recorded recipe re-resolves against the source to the recorded
//! plan hash; every output shard has exactly the expected tensors (names, dtypes, shapes) and
//! every tensor's bytes equal a fresh conversion of the source; `config.json`,
//! `hf_quant_config.json`, `mxrl.json` and the index (weight map, `total_size`) equal what
//! conversion writes; the plan audit of `mxrl-plan` (stored forms detected by the serving
//! layouts' detector, from the headers) finds every tensor stored as planned; copied files equal
//! the source's.

use crate::convert::{
    mxrl_json, output_index, prepare, run, Job, Progress, Sink, HF_QUANT_CONFIG, MXRL_JSON,
};
use crate::error::{CkptError, Result};
use crate::reader::{Checkpoint, SafetensorsFile, CONFIG_FILE, INDEX_FILE};
use crate::record::MxrlRecord;
use crate::writer::TensorSpec;
use mxrl_formats::{contract_hash, CONTRACT_VERSION};
use mxrl_plan::Recipe;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One checked item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyItem {
    /// What was checked (tensor name, file name, `contract`, ...).
    pub item: String,
    /// Whether it matched.
    pub ok: bool,
    /// Format / method, or what differs.
    pub detail: String,
}

/// The outcome of [`verify`].
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Every check, in order.
    pub items: Vec<VerifyItem>,
}

impl VerifyReport {
    fn push(&mut self, item: impl Into<String>, ok: bool, detail: impl Into<String>) {
        self.items.push(VerifyItem {
            item: item.into(),
            ok,
            detail: detail.into(),
        });
    }

    /// Number of differences.
    pub fn differences(&self) -> usize {
        self.items.iter().filter(|i| !i.ok).count()
    }

    /// Whether everything matched.
    pub fn is_clean(&self) -> bool {
        self.differences() == 0
    }

    /// The per-item report (one line each), then a total line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for i in &self.items {
            s.push_str(&format!(
                "{} {}  {}\n",
                if i.ok { "ok  " } else { "DIFF" },
                i.item,
                i.detail
            ));
        }
        s.push_str(&format!(
            "{} checked, {} difference(s)\n",
            self.items.len(),
            self.differences()
        ));
        s
    }
}

struct CompareSink<'c> {
    dst: &'c Checkpoint,
    report: VerifyReport,
    files_seen: BTreeSet<String>,
    cur: Option<&'c SafetensorsFile>,
    expected: BTreeSet<String>,
}

impl Sink for CompareSink<'_> {
    fn begin_shard(&mut self, file: &str, specs: &[TensorSpec]) -> Result<()> {
        self.files_seen.insert(file.to_string());
        self.cur = self.dst.shards().iter().find(|s| s.file_name() == file);
        self.expected = specs.iter().map(|s| s.name.clone()).collect();
        match self.cur {
            None => self
                .report
                .push(file, false, "shard missing from the converted checkpoint"),
            Some(f) => {
                let have: BTreeSet<String> =
                    f.header().tensors.iter().map(|t| t.name.clone()).collect();
                let extra: Vec<_> = have.difference(&self.expected).cloned().collect();
                let missing: Vec<_> = self.expected.difference(&have).cloned().collect();
                if extra.is_empty() && missing.is_empty() {
                    self.report
                        .push(file, true, format!("{} tensors", have.len()));
                } else {
                    self.report.push(
                        file,
                        false,
                        format!("unexpected tensors {extra:?}, missing tensors {missing:?}"),
                    );
                }
            }
        }
        Ok(())
    }

    fn tensor(&mut self, job: &Job, spec: &TensorSpec, data: &[u8]) -> Result<()> {
        let what = format!("{} {}", job.format, job.method.name());
        let Some(f) = self.cur else {
            return Ok(());
        };
        let Some(t) = f.header().tensors.iter().find(|t| t.name == spec.name) else {
            return Ok(()); // reported as missing by begin_shard
        };
        if t.dtype != spec.dtype || t.shape != spec.shape {
            self.report.push(
                &spec.name,
                false,
                format!(
                    "{what}: stored {} {:?}, expected {} {:?}",
                    t.dtype, t.shape, spec.dtype, spec.shape
                ),
            );
        } else if f.data(t) != data {
            let stored = f.data(t);
            let n = stored.iter().zip(data).filter(|(a, b)| a != b).count();
            let first = stored
                .iter()
                .zip(data)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            self.report.push(
                &spec.name,
                false,
                format!(
                    "{what}: {n} of {} bytes differ (first at byte {first}: stored 0x{:02X}, expected 0x{:02X})",
                    data.len(),
                    stored[first],
                    data[first]
                ),
            );
        } else {
            self.report.push(&spec.name, true, what);
        }
        Ok(())
    }

    fn end_shard(&mut self) -> Result<()> {
        self.cur = None;
        Ok(())
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let b = std::fs::read(path).map_err(|e| CkptError::io(path, "read", e))?;
    serde_json::from_slice(&b)
        .map(Some)
        .map_err(|e| CkptError::Config {
            file: path.display().to_string(),
            field: "(file)".into(),
            msg: format!("not valid JSON: {e}"),
        })
}

fn compare_json(r: &mut VerifyReport, what: &str, got: Option<&Value>, want: Option<&Value>) {
    match (got, want) {
        (Some(g), Some(w)) if g == w => r.push(what, true, "as written by conversion"),
        (None, None) => {}
        (Some(g), Some(w)) => r.push(
            what,
            false,
            format!("differs from what conversion writes: stored {g}, expected {w}"),
        ),
        (None, Some(_)) => r.push(what, false, "missing"),
        (Some(_), None) => r.push(what, false, "present but conversion writes none"),
    }
}

/// Verifies the converted checkpoint `converted` against its source `src`. `Err` only when an
/// input cannot be read at all; every difference is an item of the report.
pub fn verify(src: &Path, converted: &Path, progress: &dyn Progress) -> Result<VerifyReport> {
    let mut r = VerifyReport::default();
    let rec_path = converted.join(MXRL_JSON);
    if !rec_path.is_file() {
        return Err(CkptError::Invalid(format!(
            "{}: missing; {} was not written by `mxrl convert`",
            rec_path.display(),
            converted.display()
        )));
    }
    let (typed, rec) = MxrlRecord::read_with_value(&rec_path)?;
    let (version, hash) = (typed.contract.version, typed.contract.hash.as_str());
    r.push(
        "contract",
        version == CONTRACT_VERSION && hash == contract_hash(),
        format!(
            "recorded v{version} {hash}, this build v{CONTRACT_VERSION} {}",
            contract_hash()
        ),
    );
    let label = typed.recipe.source.as_str();
    let recipe = Recipe::from_toml_str(
        &typed.recipe.toml,
        &format!("{} recipe.toml", rec_path.display()),
    )?;
    let container = typed.container(&rec_path)?;

    let ck = Checkpoint::open(src)?;
    let dst = Checkpoint::open(converted)?;
    let p = prepare(&ck, &recipe, label, container)?;
    let rec_plan = typed.plan_hash.as_str();
    r.push(
        "plan",
        rec_plan == p.plan.hash(),
        format!("recorded {rec_plan}, re-resolved {}", p.plan.hash()),
    );

    let total: u64 = p
        .shards
        .iter()
        .flat_map(|(_, j)| j)
        .map(|j| j.in_bytes)
        .sum();
    progress.start(total);
    let mut sink = CompareSink {
        dst: &dst,
        report: r,
        files_seen: BTreeSet::new(),
        cur: None,
        expected: BTreeSet::new(),
    };
    // Conversion refuses non-finite inputs unless asked; whatever was converted is compared.
    let amaxes = run(&p, &mut sink, true, 64 << 20, progress)?;
    let mut r = sink.report;
    for s in dst.shards() {
        if !sink.files_seen.contains(s.file_name()) {
            r.push(s.file_name(), false, "shard not produced by conversion");
        }
    }

    compare_json(&mut r, CONFIG_FILE, dst.config(), Some(&p.config));
    let hq = read_json(&converted.join(HF_QUANT_CONFIG))?;
    compare_json(
        &mut r,
        HF_QUANT_CONFIG,
        hq.as_ref(),
        p.hf_quant_config.as_ref(),
    );
    compare_json(&mut r, MXRL_JSON, Some(&rec), Some(&mxrl_json(&p, &amaxes)));
    let idx = read_json(&converted.join(INDEX_FILE))?;
    compare_json(&mut r, INDEX_FILE, idx.as_ref(), output_index(&p).as_ref());
    if let Some(i) = dst.index() {
        let sum = dst.total_data_bytes();
        r.push(
            "index total_size",
            i.total_size == Some(sum),
            format!("recorded {:?}, tensors hold {sum} bytes", i.total_size),
        );
    }

    match crate::scan::audit_dir(converted, &recipe) {
        Ok((_, audit)) => {
            let clean = audit.is_clean();
            r.push(
                "plan audit",
                clean,
                if clean {
                    format!("{} tensors stored as planned", audit.checked)
                } else {
                    audit.render()
                },
            );
        }
        Err(e) => r.push("plan audit", false, e.to_string()),
    }

    let mut copied = BTreeMap::new();
    collect_files(src, "", &mut copied)?;
    for rel in copied.keys() {
        if crate::convert::is_weight_or_record(rel) {
            continue;
        }
        let a =
            std::fs::read(src.join(rel)).map_err(|e| CkptError::io(src.join(rel), "read", e))?;
        match std::fs::read(converted.join(rel)) {
            Ok(b) if a == b => r.push(rel.as_str(), true, "copied unchanged"),
            Ok(_) => r.push(rel.as_str(), false, "differs from the source"),
            Err(_) => r.push(rel.as_str(), false, "missing from the converted checkpoint"),
        }
    }
    Ok(r)
}

fn collect_files(root: &Path, rel: &str, out: &mut BTreeMap<String, ()>) -> Result<()> {
    let dir = root.join(rel);
    for e in std::fs::read_dir(&dir).map_err(|e| CkptError::io(&dir, "read directory", e))? {
        let e = e.map_err(|e| CkptError::io(&dir, "read directory", e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let r = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        if e.path().is_dir() {
            collect_files(root, &r, out)?;
        } else {
            out.insert(r, ());
        }
    }
    Ok(())
}
