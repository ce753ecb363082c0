//! Dot-segment-aware globs over tensor names.
//!
//! A name is a sequence of segments separated by `.`; a pattern is matched against the
//! **whole** name, segment by segment. Never a substring: `mlp.gate` does not match
//! `mlp.gate_up_proj`, and `layers.4.*` does not match `layers.41.attn.q`.
//!
//! - `*` inside a segment matches any run of characters within that one segment
//!   (`*_proj` matches `gate_proj`, never crosses a `.`);
//! - `?` matches exactly one character within a segment;
//! - a segment that is exactly `**` matches zero or more whole segments.

use std::fmt;

/// A compiled dot-segment glob (see the module docs for the syntax).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    text: String,
    segments: Vec<Seg>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    /// `**`: any number of whole segments.
    AnySegments,
    /// A segment pattern with `*` / `?` wildcards confined to the segment.
    Pattern(Vec<u8>),
}

/// Error for a pattern that cannot be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid glob `{pattern}`: {reason}")]
pub struct GlobError {
    /// The pattern as written.
    pub pattern: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Glob {
    /// Compile a pattern. Empty patterns and empty segments (`a..b`, leading or trailing
    /// `.`) are rejected; `**` must be a whole segment.
    pub fn new(pattern: &str) -> Result<Glob, GlobError> {
        let err = |reason: &str| GlobError {
            pattern: pattern.to_string(),
            reason: reason.to_string(),
        };
        if pattern.is_empty() {
            return Err(err("empty pattern"));
        }
        let mut segments = Vec::new();
        for seg in pattern.split('.') {
            if seg.is_empty() {
                return Err(err(
                    "empty segment (two dots in a row, or a leading/trailing dot)",
                ));
            }
            if seg == "**" {
                segments.push(Seg::AnySegments);
            } else if seg.contains("**") {
                return Err(err("`**` must be a whole segment"));
            } else {
                segments.push(Seg::Pattern(seg.as_bytes().to_vec()));
            }
        }
        Ok(Glob {
            text: pattern.to_string(),
            segments,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether the whole `name` matches the pattern.
    pub fn matches(&self, name: &str) -> bool {
        let parts: Vec<&str> = name.split('.').collect();
        match_segments(&self.segments, &parts)
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn match_segments(pat: &[Seg], parts: &[&str]) -> bool {
    match pat.split_first() {
        None => parts.is_empty(),
        Some((Seg::AnySegments, rest)) => {
            (0..=parts.len()).any(|skip| match_segments(rest, &parts[skip..]))
        }
        Some((Seg::Pattern(p), rest)) => match parts.split_first() {
            Some((first, tail)) => {
                match_one_segment(p, first.as_bytes()) && match_segments(rest, tail)
            }
            None => false,
        },
    }
}

/// Wildcard match of one segment: `*` = any run, `?` = one byte. Patterns and names
/// are compared as bytes; `?` against a multi-byte UTF-8 character would match one of
/// its bytes, which tensor names (ASCII) never exercise.
pub(crate) fn match_one_segment(p: &[u8], s: &[u8]) -> bool {
    // Iterative matcher with single backtrack point (classic wildcard algorithm).
    let (mut pi, mut si) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, n: &str) -> bool {
        Glob::new(p).unwrap().matches(n)
    }

    #[test]
    fn exact_names_match_only_themselves() {
        assert!(m("layers.3.attn.kv_b", "layers.3.attn.kv_b"));
        assert!(!m("layers.3.attn.kv_b", "layers.3.attn.kv_b.bias"));
        assert!(!m("layers.3.attn.kv_b", "layers.3.attn"));
    }

    #[test]
    fn star_stays_inside_one_segment() {
        assert!(m("layers.*.attn.kv_b", "layers.17.attn.kv_b"));
        assert!(!m("layers.*.attn.kv_b", "mtp.0.layers.17.attn.kv_b"));
        assert!(!m("layers.*", "layers.1.attn.q"));
        assert!(m(
            "model.layers.*.mlp.*_proj.weight",
            "model.layers.0.mlp.up_proj.weight"
        ));
        assert!(!m(
            "model.layers.*.mlp.*_proj.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight"
        ));
    }

    #[test]
    fn layer_index_segments_are_not_prefixes() {
        assert!(!m("layers.4.**", "layers.41.attn.q"));
        assert!(m("layers.4.**", "layers.4.attn.q"));
        assert!(m("layers.4?.**", "layers.41.attn.q"));
    }

    #[test]
    fn double_star_spans_whole_segments() {
        assert!(m(
            "**.kv_b_proj.weight",
            "model.layers.60.self_attn.kv_b_proj.weight"
        ));
        assert!(m("**", "anything.at.all"));
        assert!(m("model.**.weight", "model.weight"));
        assert!(!m(
            "**.kv_b_proj.weight",
            "model.layers.60.self_attn.kv_b_proj.bias"
        ));
    }

    #[test]
    fn regression_mlp_gate_does_not_match_gate_up_proj() {
        // The substring rule `mlp.gate` that other stacks shipped also caught
        // `mlp.gate_up_proj`; as a dot-segment glob it cannot.
        for p in [
            "**.mlp.gate",
            "**.mlp.gate.weight",
            "model.layers.*.mlp.gate.weight",
        ] {
            assert!(!m(p, "model.layers.0.mlp.gate_up_proj.weight"), "{p}");
            assert!(!m(p, "model.layers.0.mlp.gate_proj.weight"), "{p}");
        }
        assert!(m("**.mlp.gate.weight", "model.layers.0.mlp.gate.weight"));
        assert!(m("**.mlp.gate", "model.layers.0.mlp.gate"));
    }

    #[test]
    fn bad_patterns_are_rejected() {
        assert!(Glob::new("").is_err());
        assert!(Glob::new("a..b").is_err());
        assert!(Glob::new(".a").is_err());
        assert!(Glob::new("a.b**").is_err());
    }

    #[test]
    fn question_mark_and_multiple_stars() {
        assert!(m("a.b?c", "a.bxc"));
        assert!(!m("a.b?c", "a.bc"));
        assert!(m("a.*x*y*", "a.1x2y3"));
        assert!(!m("a.*x*y", "a.1x2y3"));
    }
}
