//! Human-readable plan summary: rules with their resolved layers, a table grouped by
//! layer range and role, and totals per format.

use crate::layers::format_ranges;
use crate::plan::PrecisionPlan;
use crate::role::Role;
use mxrl_formats::Format;
use std::fmt::Write;

/// Bytes in binary units (`1.50 GiB`).
pub(crate) fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// One row: (role, format) → (count, bytes), in first-appearance order.
type Sig = Vec<(Role, Format, usize, usize)>;

fn add(sig: &mut Sig, role: Role, format: Format, bytes: usize) {
    match sig.iter_mut().find(|r| r.0 == role && r.1 == format) {
        Some(r) => {
            r.2 += 1;
            r.3 += bytes;
        }
        None => sig.push((role, format, 1, bytes)),
    }
}

/// The plan as a readable report: header, rules (each with its resolved layers and the
/// number of tensors it decided), a table grouped by layer range and role (consecutive
/// layers with identical decisions share a row group), and totals per format with the
/// compression against an all-BF16 model.
pub fn summary_table(plan: &PrecisionPlan) -> String {
    let mut s = String::new();
    let r = plan.recipe();
    let n = plan.num_layers();
    let _ = writeln!(
        s,
        "plan {}  recipe `{}`  arch {}  {} layers  backward {}  nvfp4 activations {}",
        plan.short_hash(),
        r.name,
        plan.arch().model_type(),
        n,
        r.backward,
        r.nvfp4_activation_scale.name()
    );
    let _ = writeln!(s, "rules (first match decides; default {}):", r.default);
    for rs in plan.rule_summaries() {
        let layers = rs
            .layers
            .as_ref()
            .map(|l| format!("  [layers {} = {} of {n}]", format_ranges(l), l.len()))
            .unwrap_or_default();
        let _ = writeln!(
            s,
            "  {:>2}  {}{}  decided {} tensors",
            rs.index, rs.description, layers, rs.decided
        );
    }
    // Group entries: per decoder layer, and per non-layer scope ("model", "mtp.j").
    let mut layer_sigs: Vec<Sig> = vec![Vec::new(); n];
    let mut other: Vec<(String, Sig)> = Vec::new();
    for e in plan.entries() {
        let t = &e.tensor;
        match t.layer {
            Some(l) => add(&mut layer_sigs[l], t.role, e.format, e.bytes),
            None => {
                let scope = t
                    .mtp
                    .map(|j| format!("mtp {j}"))
                    .unwrap_or_else(|| "model".into());
                let idx = match other.iter().position(|(k, _)| *k == scope) {
                    Some(i) => i,
                    None => {
                        other.push((scope, Vec::new()));
                        other.len() - 1
                    }
                };
                add(&mut other[idx].1, t.role, e.format, e.bytes);
            }
        }
    }
    let _ = writeln!(
        s,
        "{:<12} {:<20} {:>8} {:<10} {:>12}",
        "layers", "role", "tensors", "format", "bytes"
    );
    let rows = |label: &str, sig: &Sig, times: usize, s: &mut String| {
        let mut sig = sig.clone();
        sig.sort_by_key(|r| (r.0, r.1));
        for (role, fmt, count, bytes) in &sig {
            let _ = writeln!(
                s,
                "{:<12} {:<20} {:>8} {:<10} {:>12}",
                label,
                role.name(),
                count * times,
                fmt.name(),
                human_bytes(bytes * times)
            );
        }
    };
    if let Some((scope, sig)) = other.iter().find(|(k, _)| k == "model") {
        rows(scope, sig, 1, &mut s);
    }
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && layer_sigs[j + 1] == layer_sigs[i] {
            j += 1;
        }
        let label = if i == j {
            format!("{i}")
        } else {
            format!("{i}-{j}")
        };
        rows(&label, &layer_sigs[i], j - i + 1, &mut s);
        i = j + 1;
    }
    for (scope, sig) in other.iter().filter(|(k, _)| k != "model") {
        rows(scope, sig, 1, &mut s);
    }
    let tot = plan.totals();
    let _ = writeln!(s, "totals:");
    for (f, b) in &tot.bytes {
        let _ = writeln!(
            s,
            "  {:<10} {:>8} tensors {:>12}",
            f.name(),
            tot.count[f],
            human_bytes(*b)
        );
    }
    let _ = writeln!(
        s,
        "  plan {} vs all-BF16 {}: {:.3}x smaller",
        human_bytes(tot.plan_bytes),
        human_bytes(tot.bf16_bytes),
        tot.compression()
    );
    let groups = plan.nvfp4_amax_groups();
    if !groups.is_empty() {
        let _ = writeln!(
            s,
            "  {} NVFP4 gate/up pairs share one FP32 amax each",
            groups.len()
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
