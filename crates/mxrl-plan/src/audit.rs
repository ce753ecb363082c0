//! Audits: what a quantized checkpoint actually stores, compared with the plan.

use crate::plan::PrecisionPlan;
use crate::stored::{StoredFormat, StoredTensor};
use mxrl_formats::Format;
use std::collections::HashMap;
use std::fmt::Write;

/// One tensor whose stored form disagrees with the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditFinding {
    /// HF tensor name.
    pub hf: String,
    /// What the plan says (`None`: the plan has no such tensor).
    pub planned: Option<Format>,
    /// What the checkpoint stores (`None`: the tensor is missing).
    pub stored: Option<StoredFormat>,
    /// Extra detail (shape disagreement, unrecognized layout).
    pub note: String,
}

/// Result of an audit.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditReport {
    /// Plan hash the checkpoint was compared with.
    pub plan_hash: String,
    /// Number of logical tensors compared.
    pub checked: usize,
    /// Every disagreement, in checkpoint order.
    pub findings: Vec<AuditFinding>,
    /// Shard files whose recorded plan hash (metadata `mxrl.plan_hash`) differs from
    /// the plan: (file, recorded hash).
    pub hash_mismatches: Vec<(String, String)>,
}

impl AuditReport {
    /// No drift at all.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty() && self.hash_mismatches.is_empty()
    }

    /// A readable report listing every differing tensor.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "audit against plan {}: {} tensors checked, {} differ",
            &self.plan_hash[..16],
            self.checked,
            self.findings.len()
        );
        for (file, h) in &self.hash_mismatches {
            let _ = writeln!(
                s,
                "  {file}: records plan hash {h}, expected {}",
                self.plan_hash
            );
        }
        for f in &self.findings {
            let planned = f
                .planned
                .map(|p| p.to_string())
                .unwrap_or_else(|| "(not in plan)".into());
            let stored = f
                .stored
                .as_ref()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "(missing)".into());
            let _ = writeln!(s, "  {}: plan {planned}, stored {stored}{}", f.hf, f.note);
        }
        s
    }
}

/// Compare stored logical tensors with a plan. Every plan tensor must be stored in its
/// planned format (unquantized for BF16); stored tensors the plan lacks and plan tensors
/// the checkpoint lacks are findings too (a wholly absent MTP module is allowed).
pub fn audit(plan: &PrecisionPlan, stored: &[StoredTensor]) -> AuditReport {
    let by_name: HashMap<&str, &StoredTensor> =
        stored.iter().map(|s| (s.name.as_str(), s)).collect();
    let mtp_total = plan
        .entries()
        .iter()
        .filter(|e| e.tensor.mtp.is_some())
        .count();
    let mtp_missing = plan
        .entries()
        .iter()
        .filter(|e| e.tensor.mtp.is_some() && !by_name.contains_key(e.tensor.hf.as_str()))
        .count();
    let skip_mtp = mtp_total > 0 && mtp_missing == mtp_total;
    let mut findings = Vec::new();
    let mut order: Vec<((usize, usize), AuditFinding)> = Vec::new();
    let mut checked = 0;
    for e in plan.entries() {
        if skip_mtp && e.tensor.mtp.is_some() {
            continue;
        }
        checked += 1;
        match by_name.get(e.tensor.hf.as_str()) {
            None => findings.push(AuditFinding {
                hf: e.tensor.hf.clone(),
                planned: Some(e.format),
                stored: None,
                note: String::new(),
            }),
            Some(s) => {
                let mut note = String::new();
                if s.logical_shape != e.tensor.shape {
                    note = format!(
                        " (logical shape {:?}, plan expects {:?})",
                        s.logical_shape, e.tensor.shape
                    );
                }
                if s.format.format() != Some(e.format) || !note.is_empty() {
                    order.push((
                        s.order,
                        AuditFinding {
                            hf: e.tensor.hf.clone(),
                            planned: Some(e.format),
                            stored: Some(s.format.clone()),
                            note,
                        },
                    ));
                }
            }
        }
    }
    for s in stored {
        if plan.by_hf(&s.name).is_none() {
            order.push((
                s.order,
                AuditFinding {
                    hf: s.name.clone(),
                    planned: None,
                    stored: Some(s.format.clone()),
                    note: String::new(),
                },
            ));
        }
    }
    order.sort_by_key(|(o, _)| *o);
    let mut all: Vec<AuditFinding> = order.into_iter().map(|(_, f)| f).collect();
    all.extend(findings);
    AuditReport {
        plan_hash: plan.hash().to_string(),
        checked,
        findings: all,
        hash_mismatches: Vec::new(),
    }
}
