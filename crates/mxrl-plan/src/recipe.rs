//! Recipe files (TOML) and the built-in presets.
//!
//! ```toml
//! name = "nvfp4-experts"
//! backward = "high_precision"        # lowp | high_precision | dequantized (lowp: not nvfp4)
//! default = "bf16"                   # format of every weight no rule selects
//! nvfp4_activation_scale = "per_token"   # per_token | per_tensor
//!
//! [[rule]]                           # ordered; the first rule that matches decides
//! layers = "last 15%"
//! format = "bf16"
//! [[rule]]
//! role = "routed_expert"             # optionally proj = "gate" | "up" | "down"
//! format = "nvfp4"
//! fallback = "bf16"                  # used when a tensor cannot take `format`
//! ```
//!
//! Selectors of one rule must all hold: `layers`, `role`, `proj`, `name` (glob over
//! canonical mxrl names) and `hf` (glob over Hugging Face names); both globs are
//! dot-segment aware ([`crate::Glob`]). A rule with no selector matches every weight.

use crate::error::PlanError;
use crate::glob::Glob;
use crate::layers::LayerSpec;
use crate::role::{Proj, Role};
use mxrl_formats::Format;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

/// How the backward GEMMs of a quantized linear layer run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackwardMode {
    /// Backward GEMMs in the low-precision format (column-wise copies); MXFP8 / FP8-block only.
    Lowp,
    /// Backward GEMMs in BF16 on the original BF16 operands.
    HighPrecision,
    /// Backward GEMMs in BF16 on the dequantized forward operands.
    Dequantized,
}

impl BackwardMode {
    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            BackwardMode::Lowp => "lowp",
            BackwardMode::HighPrecision => "high_precision",
            BackwardMode::Dequantized => "dequantized",
        }
    }
}

impl fmt::Display for BackwardMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Scope of the FP32 second-level scale of NVFP4 **activations**.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivationScale {
    /// One amax per token (row), computed online: a token's quantization never depends
    /// on its batch-mates. The mxrl RL recipe.
    PerToken,
    /// One amax per tensor (batch-dependent; for comparison only).
    PerTensor,
}

impl ActivationScale {
    /// The recipe spelling.
    pub fn name(self) -> &'static str {
        match self {
            ActivationScale::PerToken => "per_token",
            ActivationScale::PerTensor => "per_tensor",
        }
    }
}

/// The recipe file as written (serde form). [`Recipe`] is its validated form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecipeFile {
    /// Recipe name.
    pub name: String,
    /// Backward mode of every quantized GEMM.
    pub backward: BackwardMode,
    /// Format of every GEMM weight no rule selects.
    #[serde(default = "default_bf16")]
    pub default: Format,
    /// NVFP4 activation scale scope.
    #[serde(default = "default_per_token")]
    pub nvfp4_activation_scale: ActivationScale,
    /// Ordered rules.
    #[serde(default, rename = "rule", skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<RuleFile>,
}

fn default_bf16() -> Format {
    Format::Bf16
}
fn default_per_token() -> ActivationScale {
    ActivationScale::PerToken
}

/// One `[[rule]]` as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleFile {
    /// Layer selection (`first N`, `last N`, `last X%`, `0-3,7`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<String>,
    /// Role selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Projection selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proj: Option<String>,
    /// Glob over canonical mxrl names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Glob over Hugging Face names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf: Option<String>,
    /// The format the rule gives.
    pub format: Format,
    /// Format used when a tensor cannot take `format`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Format>,
}

/// A validated rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Layer selection.
    pub layers: Option<LayerSpec>,
    /// Role selector.
    pub role: Option<Role>,
    /// Projection selector.
    pub proj: Option<Proj>,
    /// Glob over canonical mxrl names.
    pub name: Option<Glob>,
    /// Glob over Hugging Face names.
    pub hf: Option<Glob>,
    /// The format the rule gives.
    pub format: Format,
    /// Format used when a tensor cannot take `format`.
    pub fallback: Option<Format>,
}

impl Rule {
    /// A one-line description, e.g. `layers = "last 15%", role = "shared_expert" → bf16`.
    pub fn describe(&self) -> String {
        let mut sel = Vec::new();
        if let Some(l) = &self.layers {
            sel.push(format!("layers = \"{l}\""));
        }
        if let Some(r) = self.role {
            sel.push(format!("role = \"{r}\""));
        }
        if let Some(p) = self.proj {
            sel.push(format!("proj = \"{p}\""));
        }
        if let Some(g) = &self.name {
            sel.push(format!("name = \"{g}\""));
        }
        if let Some(g) = &self.hf {
            sel.push(format!("hf = \"{g}\""));
        }
        if sel.is_empty() {
            sel.push("(every weight)".to_string());
        }
        let fb = self
            .fallback
            .map(|f| format!(" (fallback {f})"))
            .unwrap_or_default();
        format!("{} → {}{fb}", sel.join(", "), self.format)
    }
}

/// A validated recipe: ordered rules plus the recipe-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// Recipe name.
    pub name: String,
    /// Backward mode of every quantized GEMM.
    pub backward: BackwardMode,
    /// Format of every GEMM weight no rule selects.
    pub default: Format,
    /// NVFP4 activation scale scope.
    pub nvfp4_activation_scale: ActivationScale,
    /// Ordered rules; the first match decides.
    pub rules: Vec<Rule>,
    file: RecipeFile,
}

/// Names of the seed's six ablation configurations (the default recipes of `mxrl ablate`).
/// Every built-in preset is in [`ALL_PRESETS`].
pub const PRESETS: [&str; 6] = [
    "bf16", "mxfp8", "mxfp8-hp", "mxfp8-dq", "nvfp4-hp", "nvfp4-dq",
];

/// Built-in presets beyond the six of [`PRESETS`]: `fp8-block` (DeepSeek-V3 style E4M3 with
/// FP32 1×128 activation / 128×128 weight scales, backward `high_precision`).
pub const EXTRA_PRESETS: [&str; 1] = ["fp8-block"];

/// Every built-in preset: [`PRESETS`], then [`EXTRA_PRESETS`].
pub const ALL_PRESETS: [&str; 7] = [
    "bf16",
    "mxfp8",
    "mxfp8-hp",
    "mxfp8-dq",
    "nvfp4-hp",
    "nvfp4-dq",
    "fp8-block",
];

/// Settings every low-precision MXFP8 preset shares: the last 15% of layers, the MTP
/// module, shared experts (and their gate), MLA `kv_b`, router and lm_head stay BF16.
/// Embeddings and norms are never quantized by construction.
const MXFP8_RULES: &str = r#"
[[rule]]
layers = "last 15%"
format = "bf16"
[[rule]]
role = "mtp"
format = "bf16"
[[rule]]
role = "router"
format = "bf16"
[[rule]]
role = "lm_head"
format = "bf16"
[[rule]]
role = "shared_expert"
format = "bf16"
[[rule]]
role = "shared_expert_gate"
format = "bf16"
[[rule]]
role = "mla_kv_b"
format = "bf16"
"#;

/// After [`MXFP8_RULES`] in the `fp8-block` preset: every other GEMM weight takes FP8-block,
/// and one whose K is not a multiple of 128 (a small model's hidden size) stays BF16 (the
/// plan marks it `fell_back`). A K that is a multiple of 128 with an N that is not is left to
/// the quantizer, which refuses it by name (128×128 weight tiles are not padded).
const FP8_BLOCK_RULES: &str = r#"
[[rule]]
format = "fp8_block"
fallback = "bf16"
"#;

/// NVFP4 only on routed experts outside the last 15% of layers (and outside MTP);
/// everything else BF16 by default.
const NVFP4_RULES: &str = r#"
[[rule]]
layers = "last 15%"
format = "bf16"
[[rule]]
role = "mtp"
format = "bf16"
[[rule]]
role = "routed_expert"
format = "nvfp4"
"#;

/// The TOML text of a built-in preset, or `None` for an unknown name.
pub fn preset_toml(name: &str) -> Option<String> {
    let head = |backward: &str, default: &str| {
        format!(
            "name = \"{name}\"\nbackward = \"{backward}\"\ndefault = \"{default}\"\nnvfp4_activation_scale = \"per_token\"\n"
        )
    };
    Some(match name {
        "bf16" => head("high_precision", "bf16"),
        "mxfp8" => head("lowp", "mxfp8") + MXFP8_RULES,
        "mxfp8-hp" => head("high_precision", "mxfp8") + MXFP8_RULES,
        "mxfp8-dq" => head("dequantized", "mxfp8") + MXFP8_RULES,
        "nvfp4-hp" => head("high_precision", "bf16") + NVFP4_RULES,
        "nvfp4-dq" => head("dequantized", "bf16") + NVFP4_RULES,
        "fp8-block" => head("high_precision", "fp8_block") + MXFP8_RULES + FP8_BLOCK_RULES,
        _ => return None,
    })
}

impl Recipe {
    /// Parse and validate recipe TOML; `origin` names the file (or preset) in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Recipe, PlanError> {
        let file: RecipeFile = toml::from_str(text).map_err(|e| PlanError::RecipeSyntax {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        Recipe::from_file(file)
    }

    /// Read and validate a recipe file.
    pub fn from_path(path: &Path) -> Result<Recipe, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Recipe::from_toml_str(&text, &path.display().to_string())
    }

    /// A built-in preset by name (see [`ALL_PRESETS`]).
    pub fn preset(name: &str) -> Result<Recipe, PlanError> {
        let text = preset_toml(name).ok_or_else(|| PlanError::UnknownPreset {
            name: name.to_string(),
            known: ALL_PRESETS.join(", "),
        })?;
        Recipe::from_toml_str(&text, &format!("preset `{name}`"))
    }

    /// A recipe file if `file_or_preset` is an existing path, else a preset by that name.
    pub fn load(file_or_preset: &str) -> Result<Recipe, PlanError> {
        let p = Path::new(file_or_preset);
        if p.is_file() {
            Recipe::from_path(p)
        } else {
            Recipe::preset(file_or_preset)
        }
    }

    /// Validate a parsed file.
    pub fn from_file(file: RecipeFile) -> Result<Recipe, PlanError> {
        let invalid = |message: String| PlanError::RecipeInvalid {
            recipe: file.name.clone(),
            message,
        };
        let mut rules = Vec::with_capacity(file.rules.len());
        for (i, r) in file.rules.iter().enumerate() {
            let layers = r
                .layers
                .as_deref()
                .map(LayerSpec::parse)
                .transpose()
                .map_err(|e| invalid(format!("rule {i}: {e}")))?;
            let role = r
                .role
                .as_deref()
                .map(str::parse::<Role>)
                .transpose()
                .map_err(|e| invalid(format!("rule {i}: {e}")))?;
            let proj = r
                .proj
                .as_deref()
                .map(str::parse::<Proj>)
                .transpose()
                .map_err(|e| invalid(format!("rule {i}: {e}")))?;
            let name = r
                .name
                .as_deref()
                .map(Glob::new)
                .transpose()
                .map_err(|e| invalid(format!("rule {i}: name: {e}")))?;
            let hf =
                r.hf.as_deref()
                    .map(Glob::new)
                    .transpose()
                    .map_err(|e| invalid(format!("rule {i}: hf: {e}")))?;
            if let Some(role) = role {
                if role.never_quantized() && r.format != Format::Bf16 {
                    return Err(invalid(format!(
                        "rule {i}: role `{role}` is never a GEMM weight and is always BF16; it cannot be given {}",
                        r.format
                    )));
                }
            }
            if let Some(fb) = r.fallback {
                if fb != Format::Bf16 {
                    return Err(invalid(format!(
                        "rule {i}: fallback must be bf16 (the only format every tensor can take), got {fb}"
                    )));
                }
            }
            rules.push(Rule {
                layers,
                role,
                proj,
                name,
                hf,
                format: r.format,
                fallback: r.fallback,
            });
        }
        let uses_nvfp4 =
            file.default == Format::Nvfp4 || rules.iter().any(|r| r.format == Format::Nvfp4);
        if file.backward == BackwardMode::Lowp && uses_nvfp4 {
            return Err(invalid(
                "backward = \"lowp\" is only defined for mxfp8 / fp8_block; NVFP4 weights need \"high_precision\" or \"dequantized\"".to_string(),
            ));
        }
        Ok(Recipe {
            name: file.name.clone(),
            backward: file.backward,
            default: file.default,
            nvfp4_activation_scale: file.nvfp4_activation_scale,
            rules,
            file,
        })
    }

    /// The recipe as written (for JSON output and hashing).
    pub fn file(&self) -> &RecipeFile {
        &self.file
    }

    /// The recipe as TOML text (re-parses to an equal recipe).
    pub fn to_toml(&self) -> String {
        toml::to_string(&self.file).expect("a RecipeFile always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_example_parses() {
        let r = Recipe::from_toml_str(
            r#"
name = "nvfp4-experts"
backward = "high_precision"
default = "bf16"
nvfp4_activation_scale = "per_token"

[[rule]]
layers = "last 15%"
format = "bf16"
[[rule]]
role = "shared_expert"
format = "bf16"
[[rule]]
role = "routed_expert"
format = "nvfp4"
[[rule]]
name = "layers.*.attn.kv_b"
format = "bf16"
"#,
            "test",
        )
        .unwrap();
        assert_eq!(r.rules.len(), 4);
        assert_eq!(r.rules[0].layers, Some(LayerSpec::LastPercent(150_000)));
        assert_eq!(r.rules[2].role, Some(Role::RoutedExpert));
        assert_eq!(
            r.rules[3].name.as_ref().unwrap().as_str(),
            "layers.*.attn.kv_b"
        );
        let again = Recipe::from_toml_str(&r.to_toml(), "round trip").unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn all_presets_parse_with_expected_modes() {
        assert_eq!(&ALL_PRESETS[..PRESETS.len()], &PRESETS[..]);
        assert_eq!(&ALL_PRESETS[PRESETS.len()..], &EXTRA_PRESETS[..]);
        for p in ALL_PRESETS {
            let r = Recipe::preset(p).unwrap();
            assert_eq!(r.name, p);
            assert_eq!(r.nvfp4_activation_scale, ActivationScale::PerToken);
        }
        assert_eq!(
            Recipe::preset("mxfp8").unwrap().backward,
            BackwardMode::Lowp
        );
        assert_eq!(
            Recipe::preset("mxfp8-hp").unwrap().backward,
            BackwardMode::HighPrecision
        );
        assert_eq!(
            Recipe::preset("mxfp8-dq").unwrap().backward,
            BackwardMode::Dequantized
        );
        assert_eq!(
            Recipe::preset("nvfp4-hp").unwrap().backward,
            BackwardMode::HighPrecision
        );
        assert_eq!(
            Recipe::preset("nvfp4-dq").unwrap().backward,
            BackwardMode::Dequantized
        );
        let fp8 = Recipe::preset("fp8-block").unwrap();
        assert_eq!(
            (fp8.backward, fp8.default),
            (BackwardMode::HighPrecision, Format::Fp8Block)
        );
        // The MXFP8 presets' exceptions, then FP8-block with a BF16 fallback for every other
        // GEMM weight.
        let mx = Recipe::preset("mxfp8").unwrap();
        assert_eq!(fp8.rules[..mx.rules.len()], mx.rules[..]);
        let last = fp8.rules.last().unwrap();
        assert_eq!(fp8.rules.len(), mx.rules.len() + 1);
        assert_eq!(
            (last.format, last.fallback, last.describe()),
            (
                Format::Fp8Block,
                Some(Format::Bf16),
                "(every weight) → fp8_block (fallback bf16)".to_string()
            )
        );
        assert!(Recipe::preset("bf16").unwrap().rules.is_empty());
        assert!(matches!(
            Recipe::preset("fp4"),
            Err(PlanError::UnknownPreset { .. })
        ));
        assert!(matches!(
            Recipe::load("no-such-recipe"),
            Err(PlanError::UnknownPreset { .. })
        ));
    }

    #[test]
    fn invalid_recipes_are_rejected_with_the_rule_named() {
        let bad = |body: &str| {
            let text = format!("name = \"t\"\nbackward = \"high_precision\"\n{body}");
            Recipe::from_toml_str(&text, "t").unwrap_err().to_string()
        };
        assert!(bad("[[rule]]\nrole = \"experts\"\nformat = \"nvfp4\"").contains("rule 0"));
        assert!(bad("[[rule]]\nlayers = \"last 101%\"\nformat = \"bf16\"").contains("rule 0"));
        assert!(bad("[[rule]]\nrole = \"norm\"\nformat = \"mxfp8\"").contains("never"));
        assert!(
            bad("[[rule]]\nrole = \"router\"\nformat = \"mxfp8\"\nfallback = \"nvfp4\"")
                .contains("fallback")
        );
        assert!(bad("[[rule]]\nhf = \"a..b\"\nformat = \"bf16\"").contains("hf"));
        // Unknown keys are syntax errors, not silently ignored.
        assert!(bad("[[rule]]\nroles = \"router\"\nformat = \"bf16\"").contains("roles"));
        assert!(bad("[[rule]]\nformat = \"fp4\"").contains("fp4"));
        let lowp = Recipe::from_toml_str(
            "name = \"x\"\nbackward = \"lowp\"\n[[rule]]\nrole = \"routed_expert\"\nformat = \"nvfp4\"",
            "x",
        );
        assert!(lowp.unwrap_err().to_string().contains("lowp"));
    }
}
