//! Parse-time validation of numeric options: each parser names what it expects, so
//! `--lr nan`, `--steps 0` or `--mis 2,0.5` stop before any work with clap's usage message.

/// An integer ≥ 1 (`--steps`, `--batch`, `--prompts-per-step`, ...).
pub fn count(s: &str) -> Result<u64, String> {
    let v: u64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number"))?;
    if v == 0 {
        return Err("must be at least 1".into());
    }
    Ok(v)
}

/// [`count`] as a `usize`.
pub fn count_usize(s: &str) -> Result<usize, String> {
    count(s).map(|v| v as usize)
}

/// The GRPO group size: at least 2 (with one sample per prompt every advantage is 0).
pub fn group_size(s: &str) -> Result<usize, String> {
    let v = count_usize(s)?;
    if v < 2 {
        return Err(
            "must be at least 2: GRPO compares the samples of one prompt, so with one sample \
             every advantage is 0 and nothing is learned"
                .into(),
        );
    }
    Ok(v)
}

fn real(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() {
        return Err(format!("`{s}` is not finite"));
    }
    Ok(v)
}

/// A finite number > 0 (`--lr`, `--temperature`, `--tis-cap`).
pub fn positive(s: &str) -> Result<f32, String> {
    let v = real(s)?;
    if v <= 0.0 {
        return Err(format!("{v} must be > 0"));
    }
    Ok(v)
}

/// A finite number ≥ 0 (`--kl-coef`).
pub fn non_negative(s: &str) -> Result<f32, String> {
    let v = real(s)?;
    if v < 0.0 {
        return Err(format!("{v} must be ≥ 0"));
    }
    Ok(v)
}

/// A finite number ≤ 0 turns the feature off (`--max-grad-norm`).
pub fn finite(s: &str) -> Result<f32, String> {
    real(s)
}

/// A probability mass in (0, 1] (`--top-p`).
pub fn unit_mass(s: &str) -> Result<f32, String> {
    let v = real(s)?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("{v} must be in (0, 1]"));
    }
    Ok(v)
}

/// The masked-importance-sampling bounds `LO,HI`: finite, 0 ≤ LO < HI.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MisBounds {
    /// Lower bound of the kept ratio.
    pub low: f32,
    /// Upper bound of the kept ratio.
    pub high: f32,
}

/// Parse `LO,HI` ([`MisBounds`]).
pub fn mis_bounds(s: &str) -> Result<MisBounds, String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("`{s}`: expected LO,HI (two numbers, comma-separated)"))?;
    let (low, high) = (non_negative(a.trim())?, positive(b.trim())?);
    if low >= high {
        return Err(format!("LO {low} must be below HI {high}"));
    }
    Ok(MisBounds { low, high })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_numbers_are_refused_with_what_was_expected() {
        assert_eq!(count("0").unwrap_err(), "must be at least 1");
        assert!(count("-1").unwrap_err().contains("not a whole number"));
        assert_eq!(count("3"), Ok(3));
        assert!(group_size("1")
            .unwrap_err()
            .contains("every advantage is 0"));
        assert_eq!(group_size("2"), Ok(2));
        assert!(positive("nan").unwrap_err().contains("not finite"));
        assert!(positive("inf").unwrap_err().contains("not finite"));
        assert!(positive("-1").unwrap_err().contains("must be > 0"));
        assert!(positive("0").unwrap_err().contains("must be > 0"));
        assert_eq!(positive("1e-3"), Ok(1e-3));
        assert!(non_negative("-1").unwrap_err().contains("≥ 0"));
        assert_eq!(non_negative("0"), Ok(0.0));
        assert!(unit_mass("1.5").unwrap_err().contains("(0, 1]"));
        assert!(unit_mass("0").unwrap_err().contains("(0, 1]"));
        assert_eq!(unit_mass("1"), Ok(1.0));
        assert!(finite("nan").is_err());
        assert_eq!(finite("0"), Ok(0.0));
    }

    #[test]
    fn mis_takes_lo_comma_hi_in_order() {
        assert_eq!(
            mis_bounds("0.5,2"),
            Ok(MisBounds {
                low: 0.5,
                high: 2.0
            })
        );
        assert!(mis_bounds("2,0.5")
            .unwrap_err()
            .contains("must be below HI"));
        assert!(mis_bounds("2").unwrap_err().contains("expected LO,HI"));
        assert!(mis_bounds("nan,2").unwrap_err().contains("not finite"));
    }
}
