//! Layer selections: `first N`, `last N`, `first X%`, `last X%`, or an explicit list
//! `0-3,7,10-11`.

use std::fmt;

/// A parsed layer selection. Resolve it against a model's layer count with
/// [`LayerSpec::resolve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerSpec {
    /// The first `n` layers.
    First(usize),
    /// The last `n` layers.
    Last(usize),
    /// The first `p` percent of layers; `p` in units of 1/10000 percent.
    FirstPercent(u64),
    /// The last `p` percent of layers; `p` in units of 1/10000 percent.
    LastPercent(u64),
    /// Explicit inclusive ranges.
    List(Vec<(usize, usize)>),
}

/// Error for a layer selection that cannot be parsed or does not fit the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("layer selection `{spec}`: {reason}")]
pub struct LayerSpecError {
    /// The selection as written.
    pub spec: String,
    /// What is wrong with it.
    pub reason: String,
}

const PERCENT_SCALE: u64 = 10_000;

impl LayerSpec {
    /// Parse `"first N" | "last N" | "first X%" | "last X%" | "0-3,7,10-11"`.
    /// Percentages take up to four decimals (`12.5%`).
    pub fn parse(text: &str) -> Result<LayerSpec, LayerSpecError> {
        let err = |reason: &str| LayerSpecError {
            spec: text.to_string(),
            reason: reason.to_string(),
        };
        let t = text.trim();
        let mut words = t.split_whitespace();
        let head = words.next().ok_or_else(|| err("empty"))?;
        if head == "first" || head == "last" {
            let arg = words
                .next()
                .ok_or_else(|| err("expected a count or percentage after first/last"))?;
            if words.next().is_some() {
                return Err(err("unexpected text after the count"));
            }
            let first = head == "first";
            if let Some(p) = arg.strip_suffix('%') {
                let units = parse_percent(p).ok_or_else(|| {
                    err("percentage must be a number in [0, 100] with at most 4 decimals")
                })?;
                return Ok(if first {
                    LayerSpec::FirstPercent(units)
                } else {
                    LayerSpec::LastPercent(units)
                });
            }
            let n: usize = arg
                .parse()
                .map_err(|_| err("count must be a non-negative integer or a percentage"))?;
            return Ok(if first {
                LayerSpec::First(n)
            } else {
                LayerSpec::Last(n)
            });
        }
        let mut ranges = Vec::new();
        for part in t.split(',') {
            let part = part.trim();
            let parse_idx = |s: &str| -> Result<usize, LayerSpecError> {
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| err(&format!("`{s}` is not a layer index")))
            };
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (parse_idx(a)?, parse_idx(b)?),
                None => {
                    let i = parse_idx(part)?;
                    (i, i)
                }
            };
            if a > b {
                return Err(err(&format!("range {a}-{b} runs backwards")));
            }
            ranges.push((a, b));
        }
        Ok(LayerSpec::List(ranges))
    }

    /// The selected layer indices (sorted, deduplicated) of a model with `num_layers`
    /// layers. Percentages round to the nearest layer count, halves up
    /// (15% of 48 = 7.2 → 7; 12.5% of 4 = 0.5 → 1). Counts above the layer count and
    /// explicit indices out of range are errors.
    pub fn resolve(&self, num_layers: usize) -> Result<Vec<usize>, LayerSpecError> {
        let err = |reason: String| LayerSpecError {
            spec: self.to_string(),
            reason,
        };
        let count = |n: usize| -> Result<usize, LayerSpecError> {
            if n > num_layers {
                Err(err(format!(
                    "asks for {n} layers but the model has {num_layers}"
                )))
            } else {
                Ok(n)
            }
        };
        Ok(match self {
            LayerSpec::First(n) => (0..count(*n)?).collect(),
            LayerSpec::Last(n) => (num_layers - count(*n)?..num_layers).collect(),
            LayerSpec::FirstPercent(p) => (0..percent_count(*p, num_layers)).collect(),
            LayerSpec::LastPercent(p) => {
                (num_layers - percent_count(*p, num_layers)..num_layers).collect()
            }
            LayerSpec::List(ranges) => {
                let mut v = Vec::new();
                for &(a, b) in ranges {
                    if b >= num_layers {
                        return Err(err(format!(
                            "layer {b} is out of range (the model has layers 0-{})",
                            num_layers.saturating_sub(1)
                        )));
                    }
                    v.extend(a..=b);
                }
                v.sort_unstable();
                v.dedup();
                v
            }
        })
    }
}

/// `round_half_up(p% × n)` in exact integer arithmetic (`units` = percent × 10⁴).
fn percent_count(units: u64, n: usize) -> usize {
    let denom = 100 * PERCENT_SCALE;
    let num = units as u128 * n as u128;
    ((num + denom as u128 / 2) / denom as u128) as usize
}

fn parse_percent(s: &str) -> Option<u64> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    if int.is_empty() || frac.len() > 4 || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let i: u64 = int.parse().ok()?;
    let mut f: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    for _ in frac.len()..4 {
        f *= 10;
    }
    let units = i.checked_mul(PERCENT_SCALE)?.checked_add(f)?;
    (units <= 100 * PERCENT_SCALE).then_some(units)
}

fn fmt_percent(units: u64) -> String {
    let int = units / PERCENT_SCALE;
    let frac = units % PERCENT_SCALE;
    if frac == 0 {
        format!("{int}%")
    } else {
        let f = format!("{frac:04}");
        format!("{int}.{}%", f.trim_end_matches('0'))
    }
}

impl fmt::Display for LayerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerSpec::First(n) => write!(f, "first {n}"),
            LayerSpec::Last(n) => write!(f, "last {n}"),
            LayerSpec::FirstPercent(p) => write!(f, "first {}", fmt_percent(*p)),
            LayerSpec::LastPercent(p) => write!(f, "last {}", fmt_percent(*p)),
            LayerSpec::List(r) => {
                let parts: Vec<String> = r
                    .iter()
                    .map(|&(a, b)| {
                        if a == b {
                            a.to_string()
                        } else {
                            format!("{a}-{b}")
                        }
                    })
                    .collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// Format a sorted list of layer indices compactly: `[0,1,2,5]` → `0-2,5`.
pub fn format_ranges(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let start = layers[i];
        let mut end = start;
        while i + 1 < layers.len() && layers[i + 1] == end + 1 {
            i += 1;
            end = layers[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str, n: usize) -> Vec<usize> {
        LayerSpec::parse(s).unwrap().resolve(n).unwrap()
    }

    #[test]
    fn percent_rounds_to_nearest_layer_count() {
        // 0.15 × 48 = 7.2 → 7 layers: 41..=47.
        assert_eq!(r("last 15%", 48), (41..48).collect::<Vec<_>>());
        // 0.15 × 61 = 9.15 → 9.
        assert_eq!(r("last 15%", 61).len(), 9);
        // 0.15 × 24 = 3.6 → 4.
        assert_eq!(r("last 15%", 24), vec![20, 21, 22, 23]);
        // 0.15 × 10 = 1.5 → 2 (half up).
        assert_eq!(r("last 15%", 10), vec![8, 9]);
        // 12.5% × 4 = 0.5 → 1.
        assert_eq!(r("first 12.5%", 4), vec![0]);
        assert_eq!(r("last 0%", 48), Vec::<usize>::new());
        assert_eq!(r("last 100%", 3), vec![0, 1, 2]);
    }

    #[test]
    fn counts_and_lists() {
        assert_eq!(r("first 2", 5), vec![0, 1]);
        assert_eq!(r("last 2", 5), vec![3, 4]);
        assert_eq!(r("0-3,7,10-11", 12), vec![0, 1, 2, 3, 7, 10, 11]);
        assert_eq!(r("3,1-2,2", 4), vec![1, 2, 3]);
    }

    #[test]
    fn out_of_range_and_malformed_are_errors() {
        assert!(LayerSpec::parse("last 6").unwrap().resolve(5).is_err());
        assert!(LayerSpec::parse("0-12").unwrap().resolve(12).is_err());
        for bad in [
            "",
            "last",
            "last x",
            "last 101%",
            "last 1.23456%",
            "3-1",
            "a-b",
            "last 2 3",
        ] {
            assert!(LayerSpec::parse(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["first 3", "last 15%", "last 12.5%", "0-3,7,10-11"] {
            assert_eq!(LayerSpec::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(format_ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
