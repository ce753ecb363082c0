//! Tasks (prompt sources with verifiable labels) and reward functions.
//!
//! - [`answer_tag_reward`]: DAPO-style `Answer: X` reward, +1 when the text after the last
//!   `Answer:` equals the label (normalised), −1 otherwise (also when the tag is missing).
//! - [`boxed_reward`]: `\boxed{...}` reward, +1 when the last boxed expression equals the label
//!   after normalisation (numbers compared numerically), −1 otherwise.
//! - [`exact_reward`]: the response (up to end-of-sequence) as a whole equals the label; the
//!   synthetic arithmetic task uses it with rewards 1 / 0, so that mean reward = accuracy.
//! - [`worked_reward`]: a worked response (`5*3=15, 17+15=32, 32-8=24. #24`) is well formed
//!   and its answer after the `#` marker equals the label; 1 / 0 like [`exact_reward`].
//! - [`ArithmeticTask`]: seeded multi-digit arithmetic problems of adjustable difficulty.
//! - [`ChainTask`]: seeded chains of operations (`17+5*3-8=`), evaluated with standard
//!   precedence on integers; optionally with worked responses ([`ChainResponse::Worked`]).
//! - [`TaskSpec`]: a task as a command line names it, resolved to a [`TaskSource`].
//! - [`load_jsonl`]: a DAPO-style prompt file (`prompt` + `label` per line).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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
    /// A well-formed worked response whose answer after the marker equals the label
    /// ([`worked_reward`]): 1 correct, 0 otherwise.
    Worked,
}

impl RewardKind {
    /// Score `response` against `label`.
    pub fn score(self, response: &str, label: &str) -> Score {
        match self {
            RewardKind::AnswerTag => answer_tag_reward(response, label),
            RewardKind::Boxed => boxed_reward(response, label),
            RewardKind::Exact => exact_reward(response, label),
            RewardKind::Worked => worked_reward(response, label),
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

/// What separates the steps of a worked response ([`ChainResponse::Worked`]).
pub const WORKED_STEP_SEPARATOR: &str = ", ";
/// What separates a worked response's steps from its answer: the answer follows the `#`.
pub const WORKED_ANSWER_MARKER: &str = ". #";

/// A decimal integer as the chain task writes one: an optional `-`, then digits.
fn is_integer(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
}

/// One step of a worked response: `LHS OP RHS=VALUE`, where LHS and VALUE are integers (a
/// running value may be negative), OP one of [`CHAIN_OPERATORS`], RHS digits (an operand or
/// a product of operands, never negative).
fn is_worked_step(s: &str) -> bool {
    let Some((expr, value)) = s.split_once('=') else {
        return false;
    };
    let sign = usize::from(expr.starts_with('-'));
    let Some(at) = expr[sign..].find(['+', '-', '*']).map(|i| i + sign) else {
        return false;
    };
    let rhs = &expr[at + 1..];
    is_integer(&expr[..at])
        && !rhs.is_empty()
        && rhs.bytes().all(|b| b.is_ascii_digit())
        && is_integer(value)
}

/// The answer of a well-formed worked response — one or more steps (`LHS OP RHS=VALUE`)
/// joined by [`WORKED_STEP_SEPARATOR`], then [`WORKED_ANSWER_MARKER`] and an integer, nothing
/// else but surrounding whitespace — or `None`. The steps' arithmetic is not checked.
pub fn worked_answer(response: &str) -> Option<&str> {
    let (working, answer) = response.trim().rsplit_once(WORKED_ANSWER_MARKER)?;
    (is_integer(answer) && working.split(WORKED_STEP_SEPARATOR).all(is_worked_step))
        .then_some(answer)
}

/// Worked reward: the response is a well-formed worked response ([`worked_answer`]) and its
/// answer equals the label after [`normalize_answer`]; 1 or 0, as [`exact_reward`]. A missing
/// marker, malformed steps or anything after the answer score 0 even when the right number
/// appears; the steps themselves are a format, not graded (only the final answer is).
pub fn worked_reward(response: &str, label: &str) -> Score {
    let ok =
        worked_answer(response).is_some_and(|a| normalize_answer(a) == normalize_answer(label));
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
        let digits = self.digits.clamp(1, ARITHMETIC_MAX_DIGITS);
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

/// The operators a [`ChainTask`] may draw from.
pub const CHAIN_OPERATORS: &str = "+-*";
/// Most operations per [`ChainTask`] problem.
pub const CHAIN_MAX_OPS: u32 = 16;
/// Most digits per [`ChainTask`] operand.
pub const CHAIN_MAX_DIGITS: u32 = 9;

/// Seeded chains of operations: `a₀ op₁ a₁ op₂ … opₙ aₙ =`, e.g. `17+5*3-8=`, whose label is
/// the decimal value of the expression.
///
/// Evaluation order: standard precedence — every `*` binds its two neighbours first, then the
/// `+` and `-` of the resulting terms are applied left to right (`17+5*3-8 = 17 + 15 − 8 = 24`).
/// Operands are drawn uniformly from `0..10^digits` (so "up to `digits` digits", as in
/// [`ArithmeticTask`]); each operator uniformly from `operators`. Results are exact integers
/// (i64; settings whose worst case could overflow are refused by [`ChainTask::new`]) and may
/// be negative. A problem is a pure function of (seed, index).
///
/// The reference response ([`Problem::completion`], the SFT target) is the label alone, or,
/// with [`ChainResponse::Worked`], every step of that evaluation and then the label
/// ([`ChainTask::worked_text`]); the prompts and labels are the same either way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainTask {
    ops: u32,
    digits: u32,
    operators: String,
    #[serde(default)]
    response: ChainResponse,
}

/// What a [`ChainTask`]'s reference response holds, and so how responses are scored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChainResponse {
    /// The result alone (`24`), scored by [`exact_reward`].
    #[default]
    Answer,
    /// The working: one step per operation in evaluation order, then the result
    /// (`5*3=15, 17+15=32, 32-8=24. #24`; [`ChainTask::worked_text`]), scored by
    /// [`worked_reward`].
    Worked,
}

/// One step of a chain's evaluation: `lhs op rhs = value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainStep {
    /// The left operand: an operand or product so far (`*`), the running value (`+`, `-`).
    pub lhs: i64,
    /// The operator, one of [`CHAIN_OPERATORS`].
    pub op: char,
    /// The right operand: the next operand (`*`), the next term's product (`+`, `-`).
    pub rhs: i64,
    /// `lhs op rhs`.
    pub value: i64,
}

/// The steps of evaluating `first op₁ x₁ op₂ x₂ …` with standard precedence, and its value.
///
/// Order: first every `*`, left to right, each multiplying the product so far of its run of
/// `*` by the next operand (`2*3*4`: `2*3=6`, `6*4=24`); then every `+` and `-` of the
/// resulting terms, left to right, on the running value (`1+6-20`: `1+6=7`, `7-20=-13`). One
/// step per operation. The caller bounds every value to an i64 ([`ChainTask::new`]).
pub fn chain_steps(first: i64, rest: &[(char, i64)]) -> (Vec<ChainStep>, i64) {
    let mut steps = Vec::with_capacity(rest.len());
    // Each term: its sign and its product so far.
    let mut terms: Vec<(char, i64)> = vec![('+', first)];
    for &(op, x) in rest {
        if op == '*' {
            let last = terms.last_mut().expect("the first operand opens a term");
            let value = last.1 * x;
            steps.push(ChainStep {
                lhs: last.1,
                op,
                rhs: x,
                value,
            });
            last.1 = value;
        } else {
            terms.push((op, x));
        }
    }
    let mut acc = terms[0].1;
    for &(op, t) in &terms[1..] {
        let value = if op == '+' { acc + t } else { acc - t };
        steps.push(ChainStep {
            lhs: acc,
            op,
            rhs: t,
            value,
        });
        acc = value;
    }
    (steps, acc)
}

impl ChainTask {
    /// A chain of `ops` operations (1..=[`CHAIN_MAX_OPS`]) on operands of up to `digits`
    /// digits (1..=[`CHAIN_MAX_DIGITS`]), operators drawn from `operators` (a non-empty set of
    /// [`CHAIN_OPERATORS`], each at most once).
    ///
    /// # Errors
    /// [`TaskError::Settings`] naming the field: a count out of range, an unknown or repeated
    /// operator, or settings whose largest possible value does not fit in an i64.
    pub fn new(ops: u32, digits: u32, operators: &str) -> Result<ChainTask, TaskError> {
        let bad = |field: &str, msg: String| TaskError::Settings {
            task: "chain".into(),
            field: field.into(),
            msg,
        };
        if !(1..=CHAIN_MAX_OPS).contains(&ops) {
            return Err(bad(
                "ops",
                format!("expected 1–{CHAIN_MAX_OPS} operations per problem, got {ops}"),
            ));
        }
        if !(1..=CHAIN_MAX_DIGITS).contains(&digits) {
            return Err(bad(
                "digits",
                format!("expected 1–{CHAIN_MAX_DIGITS} digits per operand, got {digits}"),
            ));
        }
        if operators.is_empty() {
            return Err(bad(
                "operators",
                format!("empty; expected some of `{CHAIN_OPERATORS}`"),
            ));
        }
        for (i, c) in operators.chars().enumerate() {
            if !CHAIN_OPERATORS.contains(c) {
                return Err(bad(
                    "operators",
                    format!("`{c}` in `{operators}` is not one of `{CHAIN_OPERATORS}`"),
                ));
            }
            if operators.chars().take(i).any(|d| d == c) {
                return Err(bad(
                    "operators",
                    format!("`{c}` appears twice in `{operators}`"),
                ));
            }
        }
        let t = ChainTask {
            ops,
            digits,
            operators: operators.into(),
            response: ChainResponse::Answer,
        };
        if t.max_abs().is_none() {
            return Err(bad(
                "ops",
                format!(
                    "{ops} operations on {digits}-digit operands with `*` can reach \
                     {}^{}, more than an i64 holds; use fewer operations or digits",
                    10u64.pow(digits) - 1,
                    ops + 1
                ),
            ));
        }
        Ok(t)
    }

    /// Operations per problem.
    pub fn ops(&self) -> u32 {
        self.ops
    }

    /// Digits per operand.
    pub fn digits(&self) -> u32 {
        self.digits
    }

    /// The operators drawn from.
    pub fn operators(&self) -> &str {
        &self.operators
    }

    /// This task with reference responses of kind `response` (the same prompts and labels).
    pub fn with_response(self, response: ChainResponse) -> ChainTask {
        ChainTask { response, ..self }
    }

    /// What the reference responses hold.
    pub fn response(&self) -> ChainResponse {
        self.response
    }

    /// The reward function of this task's responses.
    pub fn reward_kind(&self) -> RewardKind {
        match self.response {
            ChainResponse::Answer => RewardKind::Exact,
            ChainResponse::Worked => RewardKind::Worked,
        }
    }

    /// The worked response of a chain evaluated as `steps` to `value`: each step as
    /// `LHS OP RHS=VALUE`, joined by [`WORKED_STEP_SEPARATOR`], then
    /// [`WORKED_ANSWER_MARKER`] and the value — `5*3=15, 17+15=32, 32-8=24. #24`.
    pub fn worked_text(steps: &[ChainStep], value: i64) -> String {
        let steps: Vec<String> = steps
            .iter()
            .map(|s| format!("{}{}{}={}", s.lhs, s.op, s.rhs, s.value))
            .collect();
        format!(
            "{}{WORKED_ANSWER_MARKER}{value}",
            steps.join(WORKED_STEP_SEPARATOR)
        )
    }

    /// The largest |value| any problem can have: with `*` allowed and operands up to
    /// `m = 10^digits − 1 ≥ 2`, the product of all `ops + 1` operands (a product of numbers
    /// ≥ 2 is at least their sum); otherwise `(ops + 1)·m`. `None` when it exceeds i64.
    fn max_abs(&self) -> Option<i64> {
        let m = 10i64.checked_pow(self.digits)? - 1;
        let n = i64::from(self.ops) + 1;
        let sum = n.checked_mul(m)?;
        if !self.operators.contains('*') {
            return Some(sum);
        }
        let prod = (0..n).try_fold(1i64, |p, _| p.checked_mul(m))?;
        Some(prod.max(sum))
    }

    /// The longest label in characters (a minus sign and the digits of the largest |value|):
    /// a response limit of this many tokens can always hold the answer.
    pub fn max_label_chars(&self) -> usize {
        let v = self.max_abs().expect("checked by ChainTask::new");
        v.to_string().len() + usize::from(self.operators.contains('-'))
    }

    /// The longest reference response in characters: [`ChainTask::max_label_chars`] for
    /// answers; for worked ones a bound, with `L` that many characters: `ops` steps of at
    /// most `3L + 2` (every number of a step is a value of the chain or an operand, none
    /// longer than `L`), the separators, the marker and the answer. A response limit of this
    /// many tokens can always hold the reference response (every tokenizer here spends at
    /// most one token per character).
    pub fn max_response_chars(&self) -> usize {
        let l = self.max_label_chars();
        match self.response {
            ChainResponse::Answer => l,
            ChainResponse::Worked => {
                let n = self.ops as usize;
                n * (3 * l + 2)
                    + (n - 1) * WORKED_STEP_SEPARATOR.len()
                    + WORKED_ANSWER_MARKER.len()
                    + l
            }
        }
    }

    /// Problem number `index` of the stream seeded by `seed` (a pure function of both).
    pub fn problem(&self, seed: u64, index: u64) -> Problem {
        // A different stream than ArithmeticTask's for the same (seed, index).
        let mut rng = ChaCha8Rng::seed_from_u64(
            seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xC4A1_0000_0000_0000,
        );
        let hi = 10i64.pow(self.digits);
        let ops: Vec<char> = self.operators.chars().collect();
        let first = rng.gen_range(0..hi);
        let mut prompt = first.to_string();
        let mut rest = Vec::with_capacity(self.ops as usize);
        for _ in 0..self.ops {
            let op = ops[rng.gen_range(0..ops.len())];
            let x = rng.gen_range(0..hi);
            prompt.push(op);
            prompt.push_str(&x.to_string());
            rest.push((op, x));
        }
        prompt.push('=');
        let (steps, v) = chain_steps(first, &rest);
        let completion = match self.response {
            ChainResponse::Answer => v.to_string(),
            ChainResponse::Worked => Self::worked_text(&steps, v),
        };
        Problem {
            prompt,
            label: v.to_string(),
            completion: Some(completion),
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
    /// The prompt file holds no prompt.
    #[error("{path}: no prompts")]
    Empty {
        /// The file.
        path: String,
    },
    /// A task setting is out of range or inconsistent.
    #[error("task `{task}`, setting `{field}`: {msg}")]
    Settings {
        /// The task.
        task: String,
        /// The setting (as the command line names it).
        field: String,
        /// What was wrong and what was expected.
        msg: String,
    },
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
    /// Seeded chains of operations.
    Chain(ChainTask),
    /// A fixed list (cycled through in a seeded order).
    List(Vec<Problem>),
}

impl TaskSource {
    /// The reward function this source is scored with.
    pub fn reward_kind(&self) -> RewardKind {
        match self {
            TaskSource::Arithmetic(_) => RewardKind::Exact,
            TaskSource::Chain(t) => t.reward_kind(),
            TaskSource::List(_) => RewardKind::AnswerTag,
        }
    }

    /// The `count` problems of optimizer step `step` (a pure function of seed and step).
    pub fn batch(&self, seed: u64, step: u64, count: usize) -> Vec<Problem> {
        match self {
            TaskSource::Arithmetic(t) => (0..count as u64)
                .map(|i| t.problem(seed, step * count as u64 + i))
                .collect(),
            TaskSource::Chain(t) => (0..count as u64)
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

/// Most digits per [`ArithmeticTask`] operand (it draws at most this many).
pub const ARITHMETIC_MAX_DIGITS: u32 = 6;

/// Operations per problem of the chain task when the command line does not say.
pub const DEFAULT_CHAIN_OPS: u32 = 3;

/// A task as a command line names it: a built-in task (`arithmetic`, `chain`) with its
/// settings, or a JSONL prompt file (which wins over the built-in name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSpec {
    /// Built-in task name: `arithmetic` (the default) or `chain`.
    pub name: Option<String>,
    /// DAPO-style JSONL prompt file ([`load_jsonl`]).
    pub data: Option<PathBuf>,
    /// Digits per operand (arithmetic and chain).
    pub digits: u32,
    /// Operations per chain problem (chain only; default [`DEFAULT_CHAIN_OPS`]).
    pub ops: Option<u32>,
    /// Operators of the chain (chain only; default all of [`CHAIN_OPERATORS`]).
    pub operators: Option<String>,
    /// Worked responses (chain only; [`ChainResponse::Worked`]): the reference response
    /// shows every step, the reward checks the answer after the marker.
    pub worked: bool,
}

impl Default for TaskSpec {
    /// 1-digit addition, the demo's task.
    fn default() -> Self {
        TaskSpec {
            name: None,
            data: None,
            digits: 1,
            ops: None,
            operators: None,
            worked: false,
        }
    }
}

/// What a [`TaskSpec`] names, before anything is loaded.
enum Named<'a> {
    Arithmetic,
    Chain,
    Data(&'a Path),
}

impl TaskSpec {
    fn named(&self) -> Result<Named<'_>, TaskError> {
        let kind = match (&self.data, self.name.as_deref()) {
            (Some(f), _) => Named::Data(f),
            (None, Some("arithmetic") | None) => Named::Arithmetic,
            (None, Some("chain")) => Named::Chain,
            (None, Some(other)) => {
                return Err(TaskError::Settings {
                    task: other.into(),
                    field: "task".into(),
                    msg: "unknown task (expected `arithmetic` or `chain`, or --data FILE.jsonl)"
                        .into(),
                })
            }
        };
        if matches!(kind, Named::Arithmetic) && !(1..=ARITHMETIC_MAX_DIGITS).contains(&self.digits)
        {
            return Err(TaskError::Settings {
                task: "arithmetic".into(),
                field: "digits".into(),
                msg: format!(
                    "expected 1–{ARITHMETIC_MAX_DIGITS} digits per operand, got {}",
                    self.digits
                ),
            });
        }
        if !matches!(kind, Named::Chain) {
            let task = match kind {
                Named::Data(f) => f.display().to_string(),
                _ => "arithmetic".into(),
            };
            for (field, set) in [
                ("ops", self.ops.is_some()),
                ("operators", self.operators.is_some()),
                ("worked", self.worked),
            ] {
                if set {
                    return Err(TaskError::Settings {
                        task,
                        field: field.into(),
                        msg: "applies to the `chain` task only (--task chain)".into(),
                    });
                }
            }
        }
        Ok(kind)
    }

    /// The chain task of these settings (`None` for other tasks).
    ///
    /// # Errors
    /// As [`ChainTask::new`]; an unknown task name.
    pub fn chain(&self) -> Result<Option<ChainTask>, TaskError> {
        match self.named()? {
            Named::Chain => ChainTask::new(
                self.ops.unwrap_or(DEFAULT_CHAIN_OPS),
                self.digits,
                self.operators.as_deref().unwrap_or(CHAIN_OPERATORS),
            )
            .map(|t| {
                Some(t.with_response(if self.worked {
                    ChainResponse::Worked
                } else {
                    ChainResponse::Answer
                }))
            }),
            _ => Ok(None),
        }
    }

    /// Resolve to a problem source. A prompt file is rendered with the chat template of
    /// `model_dir`'s `tokenizer_config.json` when there is one.
    ///
    /// # Errors
    /// Bad settings (named), an unreadable or empty prompt file.
    pub fn source(&self, model_dir: Option<&Path>) -> Result<TaskSource, TaskError> {
        match self.named()? {
            Named::Data(f) => {
                let tpl = match model_dir {
                    Some(d) => ChatTemplate::from_model_dir(d)?,
                    None => None,
                };
                let v = load_jsonl(f, tpl.as_ref())?;
                if v.is_empty() {
                    return Err(TaskError::Empty {
                        path: f.display().to_string(),
                    });
                }
                Ok(TaskSource::List(v))
            }
            Named::Arithmetic => Ok(TaskSource::Arithmetic(ArithmeticTask {
                digits: self.digits,
                ops: "+".into(),
            })),
            Named::Chain => Ok(TaskSource::Chain(self.chain()?.expect("named chain"))),
        }
    }

    /// What the task is, for run manifests and reports: the built-in task with its settings,
    /// or the prompt file with its SHA-256.
    ///
    /// # Errors
    /// Bad settings; an unreadable prompt file.
    pub fn describe(&self) -> Result<String, crate::runner::RunError> {
        let cfg = |e: TaskError| crate::runner::RunError::Config(e.to_string());
        Ok(match self.named().map_err(cfg)? {
            Named::Data(f) => format!(
                "prompts from {} (sha256 {}), Answer: X reward",
                f.display(),
                crate::manifest::file_digest(f)?
            ),
            Named::Arithmetic => format!(
                "synthetic arithmetic, {}-digit addition (exact-match reward 1/0)",
                self.digits
            ),
            Named::Chain => {
                let c = self.chain().map_err(cfg)?.expect("named chain");
                let scored = match c.response() {
                    ChainResponse::Answer => "exact-match reward 1/0".to_string(),
                    ChainResponse::Worked => format!(
                        "worked responses: every step, then `{WORKED_ANSWER_MARKER}` and the \
                         result; reward 1/0 for a well-formed working whose final answer \
                         matches"
                    ),
                };
                format!(
                    "synthetic arithmetic chains, {} operations from `{}` on operands of up to {} digit(s), standard precedence, integer results ({scored})",
                    c.ops(),
                    c.operators(),
                    c.digits()
                )
            }
        })
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

    /// An evaluator written independently of [`ChainTask::problem`]: a recursive-descent
    /// parser (expr := term (('+'|'-') term)*, term := number ('*' number)*) over the prompt
    /// text, with checked i64 arithmetic.
    fn eval_chain(prompt: &str) -> i64 {
        let body = prompt.strip_suffix('=').expect("prompt ends with `=`");
        let b = body.as_bytes();
        let mut pos = 0usize;
        fn number(b: &[u8], pos: &mut usize) -> i64 {
            let start = *pos;
            while *pos < b.len() && b[*pos].is_ascii_digit() {
                *pos += 1;
            }
            assert!(*pos > start, "a number at {start}");
            std::str::from_utf8(&b[start..*pos])
                .unwrap()
                .parse()
                .unwrap()
        }
        fn term(b: &[u8], pos: &mut usize) -> i64 {
            let mut v = number(b, pos);
            while *pos < b.len() && b[*pos] == b'*' {
                *pos += 1;
                v = v.checked_mul(number(b, pos)).unwrap();
            }
            v
        }
        let mut v = term(b, &mut pos);
        while pos < b.len() {
            let op = b[pos];
            pos += 1;
            let t = term(b, &mut pos);
            v = match op {
                b'+' => v.checked_add(t).unwrap(),
                b'-' => v.checked_sub(t).unwrap(),
                other => panic!("unexpected `{}`", other as char),
            };
        }
        v
    }

    #[test]
    fn the_test_evaluator_applies_standard_precedence() {
        // Worked by hand: multiplication first, then left to right.
        assert_eq!(eval_chain("17+5*3-8="), 24);
        assert_eq!(eval_chain("2-3-4="), -5);
        assert_eq!(eval_chain("2*3*4-30="), -6);
        assert_eq!(eval_chain("0*9+1="), 1);
    }

    /// Operands and operators of a chain prompt, split at the operators.
    fn chain_parts(prompt: &str) -> (Vec<String>, Vec<char>) {
        let body = prompt.strip_suffix('=').unwrap();
        let ops: Vec<char> = body.chars().filter(|c| !c.is_ascii_digit()).collect();
        let nums = body.split(['+', '-', '*']).map(String::from).collect();
        (nums, ops)
    }

    /// Operations, digits per operand and operators of the chain-task settings the tests
    /// sweep.
    const CHAIN_SETTINGS: [(u32, u32, &str); 7] = [
        (1, 1, "+-*"),
        (3, 1, "+-*"),
        (3, 2, "*"),
        (5, 3, "+-"),
        (8, 2, "-*"),
        (16, 1, "+*-"),
        (3, 4, "+-*"),
    ];

    #[test]
    fn chain_labels_match_an_independent_evaluator_over_the_digit_and_op_ranges() {
        for (ops, digits, operators) in CHAIN_SETTINGS {
            let t = ChainTask::new(ops, digits, operators).unwrap();
            let mut seen_ops = std::collections::BTreeSet::new();
            let mut longest_operand = 0;
            for i in 0..300 {
                let p = t.problem(11, i);
                assert_eq!(p, t.problem(11, i), "not a pure function of (seed, index)");
                let (nums, used) = chain_parts(&p.prompt);
                assert_eq!(used.len(), ops as usize, "{}", p.prompt);
                assert_eq!(nums.len(), ops as usize + 1, "{}", p.prompt);
                for n in &nums {
                    let v: u64 = n.parse().unwrap();
                    assert!(v < 10u64.pow(digits), "{n} in {}", p.prompt);
                    assert_eq!(n, &v.to_string(), "no leading zeros: {}", p.prompt);
                    longest_operand = longest_operand.max(n.len());
                }
                seen_ops.extend(used.iter().copied());
                let want = eval_chain(&p.prompt);
                assert_eq!(p.label, want.to_string(), "{}", p.prompt);
                assert_eq!(p.completion.as_deref(), Some(p.label.as_str()));
                assert!(p.label.len() <= t.max_label_chars(), "{}", p.label);
                assert_eq!(exact_reward(&p.label, &p.label).reward, 1.0);
            }
            // Every allowed operator and the full operand width appear; nothing else does.
            assert_eq!(
                seen_ops,
                operators.chars().collect(),
                "ops {ops} digits {digits}"
            );
            assert_eq!(
                longest_operand, digits as usize,
                "ops {ops} digits {digits}"
            );
        }
    }

    /// The worked response of a chain prompt, written independently of [`chain_steps`] by
    /// rewriting the expression: while a `*` is left, the first one and its two neighbours
    /// become their product; then the first `+` or `-` and its two neighbours become their
    /// value; each rewrite is one step. Checked i64 arithmetic.
    fn worked_by_rewriting(prompt: &str) -> String {
        let (nums, ops) = chain_parts(prompt);
        let mut nums: Vec<i64> = nums.iter().map(|n| n.parse().unwrap()).collect();
        let mut ops = ops;
        let mut steps = Vec::new();
        while !ops.is_empty() {
            let i = ops.iter().position(|&o| o == '*').unwrap_or(0);
            let (a, o, b) = (nums[i], ops[i], nums[i + 1]);
            let v = match o {
                '*' => a.checked_mul(b),
                '+' => a.checked_add(b),
                _ => a.checked_sub(b),
            }
            .unwrap();
            steps.push(format!("{a}{o}{b}={v}"));
            nums.splice(i..=i + 1, [v]);
            ops.remove(i);
        }
        format!("{}. #{}", steps.join(", "), nums[0])
    }

    #[test]
    fn the_test_rewriter_works_hand_checked_chains() {
        // Worked by hand: every `*` first (left to right), then `+`/`-` left to right.
        assert_eq!(
            worked_by_rewriting("17+5*3-8="),
            "5*3=15, 17+15=32, 32-8=24. #24"
        );
        assert_eq!(worked_by_rewriting("2-3-4="), "2-3=-1, -1-4=-5. #-5");
        assert_eq!(
            worked_by_rewriting("2*3*4-30="),
            "2*3=6, 6*4=24, 24-30=-6. #-6"
        );
        assert_eq!(
            worked_by_rewriting("1+2*3+4*5="),
            "2*3=6, 4*5=20, 1+6=7, 7+20=27. #27"
        );
        assert_eq!(worked_by_rewriting("0*9="), "0*9=0. #0");
        // The generator's evaluation of the same chains gives the same text.
        let gen = |first: i64, rest: &[(char, i64)]| {
            let (steps, v) = chain_steps(first, rest);
            assert_eq!(steps.len(), rest.len(), "one step per operation");
            ChainTask::worked_text(&steps, v)
        };
        assert_eq!(
            gen(17, &[('+', 5), ('*', 3), ('-', 8)]),
            "5*3=15, 17+15=32, 32-8=24. #24"
        );
        assert_eq!(
            gen(1, &[('+', 2), ('*', 3), ('+', 4), ('*', 5)]),
            "2*3=6, 4*5=20, 1+6=7, 7+20=27. #27"
        );
    }

    #[test]
    fn worked_chain_responses_match_an_independent_rewriter_over_the_settings() {
        for (ops, digits, operators) in CHAIN_SETTINGS {
            let answer = ChainTask::new(ops, digits, operators).unwrap();
            let t = answer.clone().with_response(ChainResponse::Worked);
            assert_eq!(t.response(), ChainResponse::Worked);
            let mut longest = 0;
            for i in 0..300 {
                let p = t.problem(11, i);
                let a = answer.problem(11, i);
                // The same prompt and label as the answer-only task; only the response differs.
                assert_eq!((&p.prompt, &p.label), (&a.prompt, &a.label));
                let c = p.completion.clone().unwrap();
                assert_eq!(c, worked_by_rewriting(&p.prompt), "{}", p.prompt);
                assert_eq!(p.label, eval_chain(&p.prompt).to_string(), "{}", p.prompt);
                assert_eq!(c.matches(WORKED_STEP_SEPARATOR).count() + 1, ops as usize);
                assert_eq!(worked_answer(&c), Some(p.label.as_str()), "{c}");
                assert_eq!(worked_reward(&c, &p.label).reward, 1.0, "{c}");
                assert!(c.len() <= t.max_response_chars(), "{c}");
                longest = longest.max(c.len());
            }
            // The bound is a bound, not a wild one for these settings' typical responses.
            assert!(
                longest > t.max_response_chars() / 8,
                "ops {ops} digits {digits}: longest {longest}, bound {}",
                t.max_response_chars()
            );
        }
    }

    #[test]
    fn worked_reward_scores_the_answer_after_the_marker_of_a_well_formed_working() {
        let good = "5*3=15, 17+15=32, 32-8=24. #24";
        assert_eq!(
            worked_reward(good, "24"),
            Score {
                reward: 1.0,
                correct: true
            }
        );
        // Surrounding whitespace and a zero-padded answer read as the value, as exact_reward.
        assert_eq!(worked_reward(&format!("  {good}\n"), "24").reward, 1.0);
        assert_eq!(worked_reward("5*3=15. #015", "15").reward, 1.0);
        assert_eq!(worked_reward("2-3=-1, -1-4=-5. #-5", "-5").reward, 1.0);
        // The steps are a format, not graded: only the final answer is.
        assert_eq!(worked_reward("5*3=16. #24", "24").reward, 1.0);
        // Incorrect answers.
        for r in [
            "5*3=15, 17+15=32, 32-8=24. #25",
            "2-3=-1, -1-4=-5. #5",
            "5*3=15. #-15",
        ] {
            assert_eq!(
                worked_reward(r, "24")
                    .reward
                    .max(worked_reward(r, "-5").reward),
                0.0,
                "{r}"
            );
        }
        assert_eq!(
            worked_reward(good, "23"),
            Score {
                reward: 0.0,
                correct: false
            }
        );
        // Malformed: the right number is there, the format is not.
        for r in [
            "",
            "24",
            "#24",
            ". #24",
            " #24",
            "5*3=15, 17+15=32, 32-8=24 #24",
            "5*3=15, 17+15=32, 32-8=24. 24",
            "5*3=15, 17+15=32, 32-8=24. #24.",
            "5*3=15, 17+15=32, 32-8=24. #24 5*3",
            "5*3=15, 17+15=32, 32-8=24. # 24",
            "5*3=15 17+15=32, 32-8=24. #24",
            "5*3=15,, 32-8=24. #24",
            "5*3=15, , 32-8=24. #24",
            "5*3=, 32-8=24. #24",
            "5*3, 32-8=24. #24",
            "5/3=15, 32-8=24. #24",
            "5*-3=-15, 32-8=24. #24",
            "5*3=15, 17+15=32, 32-8=2",
            "Answer: 24",
            "\\boxed{24}",
        ] {
            assert_eq!(worked_reward(r, "24").reward, 0.0, "{r:?}");
            assert!(!worked_reward(r, "24").correct, "{r:?}");
        }
        // The reward kinds do not stand in for each other.
        assert_eq!(RewardKind::Worked.score(good, "24").reward, 1.0);
        assert_eq!(RewardKind::Exact.score(good, "24").reward, 0.0);
        assert_eq!(RewardKind::Worked.score("24", "24").reward, 0.0);
        let t = ChainTask::new(3, 1, "+-*").unwrap();
        assert_eq!(
            TaskSource::Chain(t.clone()).reward_kind(),
            RewardKind::Exact
        );
        let w = t.with_response(ChainResponse::Worked);
        assert_eq!(TaskSource::Chain(w).reward_kind(), RewardKind::Worked);
    }

    #[test]
    fn chain_problems_depend_on_seed_and_index_and_differ_from_arithmetic() {
        let t = ChainTask::new(3, 2, "+-*").unwrap();
        let a: Vec<String> = (0..20).map(|i| t.problem(1, i).prompt).collect();
        let b: Vec<String> = (0..20).map(|i| t.problem(2, i).prompt).collect();
        assert_ne!(a, b);
        let distinct: std::collections::BTreeSet<&String> = a.iter().collect();
        assert!(distinct.len() >= 19, "{a:?}");
        let src = TaskSource::Chain(t.clone());
        assert_eq!(src.reward_kind(), RewardKind::Exact);
        // Step s of a batch stream is problems s·count .. (s+1)·count.
        let batch = src.batch(5, 3, 4);
        assert_eq!(batch[1], t.problem(5, 13));
    }

    #[test]
    fn chain_settings_are_checked_and_named() {
        let err = |ops, digits, operators: &str| {
            ChainTask::new(ops, digits, operators)
                .unwrap_err()
                .to_string()
        };
        let e = err(0, 1, "+");
        assert!(e.contains("setting `ops`") && e.contains("got 0"), "{e}");
        let e = err(17, 1, "+");
        assert!(e.contains("setting `ops`") && e.contains("1–16"), "{e}");
        let e = err(2, 0, "+");
        assert!(e.contains("setting `digits`") && e.contains("got 0"), "{e}");
        let e = err(2, 10, "+");
        assert!(e.contains("setting `digits`"), "{e}");
        let e = err(2, 1, "+/");
        assert!(
            e.contains("setting `operators`") && e.contains("`/`"),
            "{e}"
        );
        let e = err(2, 1, "++");
        assert!(e.contains("appears twice"), "{e}");
        let e = err(2, 1, "");
        assert!(
            e.contains("setting `operators`") && e.contains("empty"),
            "{e}"
        );
        // 9999^5 > i64::MAX ≈ 9.2e18, 9999^4 < it; without `*` the same counts fit.
        let e = err(4, 4, "+*");
        assert!(e.contains("9999^5") && e.contains("i64"), "{e}");
        assert!(ChainTask::new(3, 4, "+*").is_ok());
        assert!(ChainTask::new(16, 9, "+-").is_ok());
        // Chain settings on another task are refused, not ignored.
        let spec = TaskSpec {
            ops: Some(3),
            ..TaskSpec::default()
        };
        let e = spec.source(None).unwrap_err().to_string();
        assert!(e.contains("`ops`") && e.contains("--task chain"), "{e}");
        let spec = TaskSpec {
            name: Some("chains".into()),
            ..TaskSpec::default()
        };
        let e = spec.source(None).unwrap_err().to_string();
        assert!(e.contains("chains") && e.contains("unknown task"), "{e}");
        // ArithmeticTask draws at most 6 digits: more is refused, not silently clamped.
        let spec = TaskSpec {
            digits: 7,
            ..TaskSpec::default()
        };
        let e = spec.describe().unwrap_err().to_string();
        assert!(
            e.contains("`digits`") && e.contains("1–6") && e.contains("got 7"),
            "{e}"
        );
        assert!(spec.source(None).is_err());
    }

    #[test]
    fn worked_is_a_chain_setting_refused_elsewhere_and_named_in_the_description() {
        let chain = TaskSpec {
            name: Some("chain".into()),
            ..TaskSpec::default()
        };
        let worked = TaskSpec {
            worked: true,
            ..chain.clone()
        };
        let TaskSource::Chain(t) = worked.source(None).unwrap() else {
            panic!("expected the chain task")
        };
        assert_eq!(t.response(), ChainResponse::Worked);
        let TaskSource::Chain(t) = chain.source(None).unwrap() else {
            panic!("expected the chain task")
        };
        assert_eq!(t.response(), ChainResponse::Answer);
        // The descriptions differ (a run of one is never resumed as the other); the
        // answer-only one is unchanged.
        let (a, w) = (chain.describe().unwrap(), worked.describe().unwrap());
        assert!(
            a.ends_with("integer results (exact-match reward 1/0)"),
            "{a}"
        );
        assert!(
            w.contains("3 operations from `+-*`") && w.contains("worked responses"),
            "{w}"
        );
        assert_ne!(a, w);
        // On the arithmetic task and on a prompt file it is refused by name, not ignored.
        for spec in [
            TaskSpec {
                worked: true,
                ..TaskSpec::default()
            },
            TaskSpec {
                name: Some("arithmetic".into()),
                worked: true,
                ..TaskSpec::default()
            },
            TaskSpec {
                data: Some("p.jsonl".into()),
                worked: true,
                ..chain.clone()
            },
        ] {
            let e = spec.source(None).unwrap_err().to_string();
            assert!(
                e.contains("setting `worked`") && e.contains("--task chain"),
                "{e}"
            );
            assert!(spec.describe().is_err());
        }
        // Bad chain settings are still named first with it.
        let e = TaskSpec {
            ops: Some(0),
            ..worked.clone()
        }
        .source(None)
        .unwrap_err()
        .to_string();
        assert!(e.contains("setting `ops`"), "{e}");
    }

    #[test]
    fn task_spec_resolves_built_ins_and_files() {
        // The default is the demo's 1-digit addition, described as before.
        let d = TaskSpec::default();
        assert!(matches!(
            d.source(None).unwrap(),
            TaskSource::Arithmetic(ArithmeticTask { digits: 1, .. })
        ));
        assert_eq!(
            d.describe().unwrap(),
            "synthetic arithmetic, 1-digit addition (exact-match reward 1/0)"
        );
        let c = TaskSpec {
            name: Some("chain".into()),
            digits: 2,
            operators: Some("+*".into()),
            ..TaskSpec::default()
        };
        let TaskSource::Chain(t) = c.source(None).unwrap() else {
            panic!("expected the chain task")
        };
        assert_eq!(
            (t.ops(), t.digits(), t.operators()),
            (DEFAULT_CHAIN_OPS, 2, "+*")
        );
        let text = c.describe().unwrap();
        assert!(
            text.contains("3 operations from `+*`") && text.contains("up to 2 digit"),
            "{text}"
        );
        // A prompt file wins over the built-in name; an empty one is refused by name.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.jsonl");
        std::fs::write(&f, "{\"prompt\": \"2*3+1=\", \"label\": 7}\n").unwrap();
        let fs = TaskSpec {
            name: Some("chain".into()),
            data: Some(f.clone()),
            ..TaskSpec::default()
        };
        let TaskSource::List(v) = fs.source(None).unwrap() else {
            panic!("expected the prompt list")
        };
        assert_eq!((v[0].prompt.as_str(), v[0].label.as_str()), ("2*3+1=", "7"));
        assert!(fs.describe().unwrap().contains("sha256"));
        std::fs::write(&f, "\n").unwrap();
        let e = fs.source(None).unwrap_err().to_string();
        assert!(e.contains("p.jsonl") && e.contains("no prompts"), "{e}");
    }
}
