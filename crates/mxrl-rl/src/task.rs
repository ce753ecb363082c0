//! Tasks (prompt sources with verifiable labels) and reward functions.
//!
//! - [`answer_tag_reward`]: DAPO-style `Answer: X` reward, +1 when the text after the last
//!   `Answer:` equals the label (normalised), −1 otherwise (also when the tag is missing).
//! - [`boxed_reward`]: `\boxed{...}` reward, +1 when the last boxed expression equals the label
//!   after normalisation (numbers compared numerically), −1 otherwise.
//! - [`exact_reward`]: the response (up to end-of-sequence) as a whole equals the label; the
//!   synthetic arithmetic task uses it with rewards 1 / 0, so that mean reward = accuracy.
//! - [`ArithmeticTask`]: seeded multi-digit arithmetic problems of adjustable difficulty.
//! - [`load_jsonl`]: a DAPO-style prompt file (`prompt` + `label` per line).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The outcome of scoring one response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The scalar reward used by GRPO.
    pub reward: f32,
    /// Whether the response is counted as correct (for the accuracy metric).
    pub correct: bool,
}

/// Which reward function scores a task's responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardKind {
    /// DAPO `Answer: X`, ±1.
    AnswerTag,
    /// `\boxed{X}`, ±1.
    Boxed,
    /// The whole response equals the label: 1 correct, 0 otherwise.
    Exact,
}

impl RewardKind {
    /// Score `response` against `label`.
    pub fn score(self, response: &str, label: &str) -> Score {
        match self {
            RewardKind::AnswerTag => answer_tag_reward(response, label),
            RewardKind::Boxed => boxed_reward(response, label),
            RewardKind::Exact => exact_reward(response, label),
        }
    }
}

/// One prompt with its verifiable label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// The prompt text as the policy sees it (chat template already applied).
    pub prompt: String,
    /// The reference answer.
    pub label: String,
    /// A supervised completion for warm-up (SFT), when the task can produce one.
    pub completion: Option<String>,
}

/// Normalise an answer string for comparison: trim, drop surrounding `$`, spaces, a trailing
/// full stop, thousands separators inside numbers; numbers are compared by value (so `"3.0"`,
/// `"3"` and `"+3"` agree).
pub fn normalize_answer(s: &str) -> String {
    let mut t = s.trim().to_string();
    loop {
        let before = t.len();
        t = t.trim().trim_matches('$').to_string();
        if t.ends_with('.') && !t.ends_with("..") {
            t.pop();
        }
        if t.len() == before {
            break;
        }
    }
    let compact: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    let numeric: String = compact.chars().filter(|&c| c != ',').collect();
    if let Ok(v) = numeric.parse::<f64>() {
        if v.is_finite() {
            if v == v.trunc() && v.abs() < 1e15 {
                return format!("{}", v as i64);
            }
            return format!("{v}");
        }
    }
    compact
}

/// DAPO reward: the text after the **last** `Answer:` (up to the end of its line), normalised,
/// must equal the normalised label. +1 when it does, −1 otherwise (missing tag included).
pub fn answer_tag_reward(response: &str, label: &str) -> Score {
    let Some(pos) = response.rfind("Answer:") else {
        return Score {
            reward: -1.0,
            correct: false,
        };
    };
    let rest = &response[pos + "Answer:".len()..];
    let line = rest.lines().next().unwrap_or("");
    let ok = !line.trim().is_empty() && normalize_answer(line) == normalize_answer(label);
    Score {
        reward: if ok { 1.0 } else { -1.0 },
        correct: ok,
    }
}

/// The content of the last `\boxed{...}` in `s`, with nested braces balanced; `None` when there
/// is no complete boxed expression.
pub fn last_boxed(s: &str) -> Option<&str> {
    let start = s.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in s[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `\boxed{}` reward: +1 when the last boxed expression equals the label after
/// [`normalize_answer`] (a label itself written as `\boxed{..}` is unwrapped), −1 otherwise.
pub fn boxed_reward(response: &str, label: &str) -> Score {
    let label = last_boxed(label).unwrap_or(label);
    let ok = match last_boxed(response) {
        Some(b) => normalize_answer(b) == normalize_answer(label),
        None => false,
    };
    Score {
        reward: if ok { 1.0 } else { -1.0 },
        correct: ok,
    }
}

/// Exact reward: the whole response equals the label after [`normalize_answer`]; 1 or 0.
pub fn exact_reward(response: &str, label: &str) -> Score {
    let ok = !response.trim().is_empty() && normalize_answer(response) == normalize_answer(label);
    Score {
        reward: if ok { 1.0 } else { 0.0 },
        correct: ok,
    }
}

/// Seeded synthetic arithmetic: `a+b=` / `a-b=` / `a*b=` problems whose answer is the
/// decimal result. Difficulty = the number of digits of the operands (1..=6); `ops` selects
/// which operators appear.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArithmeticTask {
    /// Digits per operand.
    pub digits: u32,
    /// Operators to draw from (any of `+ - *`).
    pub ops: String,
}

impl Default for ArithmeticTask {
    fn default() -> Self {
        ArithmeticTask {
            digits: 1,
            ops: "+".into(),
        }
    }
}

impl ArithmeticTask {
    /// Problem number `index` of the stream seeded by `seed` (a pure function of both, so every
    /// recipe of an ablation sees the same prompts).
    pub fn problem(&self, seed: u64, index: u64) -> Problem {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let digits = self.digits.clamp(1, 6);
        let hi = 10i64.pow(digits);
        let a = rng.gen_range(0..hi);
        let b = rng.gen_range(0..hi);
        let ops: Vec<char> = self.ops.chars().filter(|c| "+-*".contains(*c)).collect();
        let op = if ops.is_empty() {
            '+'
        } else {
            ops[rng.gen_range(0..ops.len())]
        };
        let v = match op {
            '+' => a + b,
            '-' => a - b,
            _ => a * b,
        };
        Problem {
            prompt: format!("{a}{op}{b}="),
            label: v.to_string(),
            completion: Some(v.to_string()),
        }
    }
}

/// Errors of the task loaders.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The prompt file could not be read.
    #[error("reading prompt file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is not the expected JSON object.
    #[error("{path}:{line}: {msg}")]
    Parse {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        msg: String,
    },
    /// The chat template failed to render.
    #[error("chat template: {0}")]
    Template(String),
}

/// A chat template (Jinja, as in Hugging Face `tokenizer_config.json`) applied to a single user
/// message with the generation prompt appended.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Read `chat_template`, `bos_token`, `eos_token` from a `tokenizer_config.json` in
    /// `model_dir`; `Ok(None)` when the file or the key is absent.
    pub fn from_model_dir(model_dir: &Path) -> Result<Option<ChatTemplate>, TaskError> {
        let path = model_dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|source| TaskError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| TaskError::Parse {
            path: path.display().to_string(),
            line: e.line(),
            msg: e.to_string(),
        })?;
        let tok = |k: &str| -> String {
            match &v[k] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or("")
                    .to_string(),
                _ => String::new(),
            }
        };
        Ok(v["chat_template"].as_str().map(|s| ChatTemplate {
            source: s.to_string(),
            bos_token: tok("bos_token"),
            eos_token: tok("eos_token"),
        }))
    }

    /// A template from its Jinja source.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        }
    }

    /// Render a conversation (role, content pairs) with the generation prompt.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String, TaskError> {
        let mut env = minijinja::Environment::new();
        env.add_template("chat", &self.source)
            .map_err(|e| TaskError::Template(e.to_string()))?;
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        env.get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => msgs,
                    add_generation_prompt => true,
                    bos_token => self.bos_token.clone(),
                    eos_token => self.eos_token.clone(),
                })
            })
            .map_err(|e| TaskError::Template(e.to_string()))
    }
}

/// Load a DAPO-style JSONL prompt file: each line an object with `prompt` (a string, or a list
/// of `{role, content}` messages) and `label` (a string or number; DAPO's
/// `reward_model.ground_truth` is accepted too). The chat template, when given, is applied.
pub fn load_jsonl(path: &Path, template: Option<&ChatTemplate>) -> Result<Vec<Problem>, TaskError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TaskError::Io {
        path: p.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |msg: String| TaskError::Parse {
            path: p.clone(),
            line: i + 1,
            msg,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| err(format!("not JSON: {e}")))?;
        let messages: Vec<(String, String)> = match &v["prompt"] {
            serde_json::Value::String(s) => vec![("user".into(), s.clone())],
            serde_json::Value::Array(a) => a
                .iter()
                .map(|m| {
                    let role = m["role"].as_str().unwrap_or("user").to_string();
                    m["content"]
                        .as_str()
                        .map(|c| (role, c.to_string()))
                        .ok_or_else(|| err("a prompt message has no string `content`".into()))
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(err("expected `prompt` (string or list of messages)".into())),
        };
        let label_v = if v.get("label").is_some() {
            &v["label"]
        } else {
            &v["reward_model"]["ground_truth"]
        };
        let label = match label_v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            _ => return Err(err("expected `label` (string or number)".into())),
        };
        let prompt = match template {
            Some(t) => t.render(&messages)?,
            None => messages
                .iter()
                .map(|(_, c)| c.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        };
        out.push(Problem {
            prompt,
            label,
            completion: None,
        });
    }
    Ok(out)
}

/// A source of problems for the RL loop: the synthetic task or a loaded file.
#[derive(Debug, Clone)]
pub enum TaskSource {
    /// Seeded arithmetic.
    Arithmetic(ArithmeticTask),
    /// A fixed list (cycled through in a seeded order).
    List(Vec<Problem>),
}

impl TaskSource {
    /// The reward function this source is scored with.
    pub fn reward_kind(&self) -> RewardKind {
        match self {
            TaskSource::Arithmetic(_) => RewardKind::Exact,
            TaskSource::List(_) => RewardKind::AnswerTag,
        }
    }

    /// The `count` problems of optimizer step `step` (a pure function of seed and step).
    pub fn batch(&self, seed: u64, step: u64, count: usize) -> Vec<Problem> {
        match self {
            TaskSource::Arithmetic(t) => (0..count as u64)
                .map(|i| t.problem(seed, step * count as u64 + i))
                .collect(),
            TaskSource::List(v) => {
                if v.is_empty() {
                    return Vec::new();
                }
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ step.wrapping_mul(0xA24B_AED4));
                (0..count)
                    .map(|_| v[rng.gen_range(0..v.len())].clone())
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_tag_takes_the_last_tag_and_normalises() {
        assert_eq!(answer_tag_reward("Answer: 42", "42").reward, 1.0);
        assert_eq!(
            answer_tag_reward("Answer: 41\n... Answer: 42", "42").reward,
            1.0
        );
        assert_eq!(
            answer_tag_reward("Answer: 42\nAnswer: 41", "42").reward,
            -1.0
        );
        assert_eq!(answer_tag_reward("Answer:  $42$.", "42").reward, 1.0);
        assert_eq!(answer_tag_reward("Answer: 42.0", "42").reward, 1.0);
        assert_eq!(answer_tag_reward("Answer: 1,000", "1000").reward, 1.0);
        assert_eq!(answer_tag_reward("the answer is 42", "42").reward, -1.0);
        assert_eq!(answer_tag_reward("Answer:", "42").reward, -1.0);
        assert_eq!(answer_tag_reward("Answer: 420", "42").reward, -1.0);
        assert_eq!(answer_tag_reward("answer: 42", "42").reward, -1.0);
        assert_eq!(answer_tag_reward("Answer: -7", "-7").reward, 1.0);
        assert_eq!(answer_tag_reward("Answer: x+1", "x + 1").reward, 1.0);
        assert_eq!(answer_tag_reward("Answer: 42\nbecause", "42").reward, 1.0);
    }

    #[test]
    fn boxed_handles_nesting_and_takes_the_last() {
        assert_eq!(
            last_boxed(r"so \boxed{\frac{1}{2}} done"),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(last_boxed(r"\boxed{1} then \boxed{2}"), Some("2"));
        assert_eq!(last_boxed(r"\boxed{unclosed"), None);
        assert_eq!(boxed_reward(r"\boxed{ 3.50 }", "3.5").reward, 1.0);
        assert_eq!(boxed_reward(r"\boxed{1} \boxed{2}", "1").reward, -1.0);
        assert_eq!(
            boxed_reward(r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}").reward,
            1.0
        );
        assert_eq!(boxed_reward("42", "42").reward, -1.0);
        assert_eq!(boxed_reward(r"\boxed{}", "0").reward, -1.0);
    }

    #[test]
    fn exact_reward_is_one_or_zero() {
        assert_eq!(
            exact_reward("46", "46"),
            Score {
                reward: 1.0,
                correct: true
            }
        );
        assert_eq!(exact_reward(" 46 ", "46").reward, 1.0);
        assert_eq!(exact_reward("046", "46").reward, 1.0);
        assert_eq!(exact_reward("4 6", "46").reward, 1.0);
        assert_eq!(exact_reward("", "0").reward, 0.0);
        assert_eq!(exact_reward("47", "46").reward, 0.0);
    }

    #[test]
    fn arithmetic_is_seeded_and_correct() {
        let t = ArithmeticTask {
            digits: 3,
            ops: "+-*".into(),
        };
        for i in 0..50 {
            let p = t.problem(7, i);
            assert_eq!(p, t.problem(7, i));
            let body = p.prompt.trim_end_matches('=');
            let op_pos = body[1..].find(['+', '-', '*']).unwrap() + 1;
            let a: i64 = body[..op_pos].parse().unwrap();
            let b: i64 = body[op_pos + 1..].parse().unwrap();
            assert!((0..1000).contains(&a) && (0..1000).contains(&b));
            let v = match &body[op_pos..op_pos + 1] {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert_eq!(p.label, v.to_string());
        }
        assert_ne!(
            t.problem(7, 0).prompt + &t.problem(7, 1).prompt,
            t.problem(8, 0).prompt + &t.problem(8, 1).prompt
        );
    }

    #[test]
    fn jsonl_loader_reads_strings_messages_and_dapo_labels() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.jsonl");
        std::fs::write(
            &f,
            "{\"prompt\": \"1+1?\", \"label\": \"2\"}\n\n\
             {\"prompt\": [{\"role\": \"user\", \"content\": \"2+2?\"}], \"reward_model\": {\"ground_truth\": 4}}\n",
        )
        .unwrap();
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            "<s>",
            "</s>",
        );
        let v = load_jsonl(&f, Some(&t)).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].prompt, "<s><user>1+1?<assistant>");
        assert_eq!(v[1].label, "4");
        let plain = load_jsonl(&f, None).unwrap();
        assert_eq!(plain[1].prompt, "2+2?");
        std::fs::write(&f, "{\"prompt\": 3}\n").unwrap();
        let e = load_jsonl(&f, None).unwrap_err().to_string();
        assert!(e.contains("p.jsonl:1"), "{e}");
    }
}
