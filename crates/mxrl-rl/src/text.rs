//! Text ↔ token ids through a Hugging Face `tokenizer.json` (the `tokenizers` crate), the
//! char-level tokenizer of the demo, and a byte-level BPE tokenizer trained on a task's text
//! ([`train_bpe`]).
//!
//! Every tokenizer made here has the same four special tokens at ids 0..3 ([`SPECIALS`]):
//! `<pad>`, `<bos>`, `<eos>` (generation stops after it), `<unk>`.

use std::path::Path;

/// Errors of the tokenizer wrapper.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// `tokenizer.json` could not be loaded.
    #[error("loading tokenizer {path}: {msg}")]
    Load {
        /// The file.
        path: String,
        /// What went wrong.
        msg: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
    /// Training a tokenizer failed or was asked for something impossible.
    #[error("training a tokenizer: {0}")]
    Train(String),
    /// A required special token is not in the vocabulary.
    #[error("tokenizer {path}: no end-of-sequence token (looked for {looked_for})")]
    NoEos {
        /// The file.
        path: String,
        /// Token strings tried.
        looked_for: String,
    },
}

/// A tokenizer plus the ids the RL loop needs.
pub struct TextCodec {
    tok: tokenizers::Tokenizer,
    /// End-of-sequence id: generation stops after sampling it.
    pub eos: u32,
    /// Vocabulary size including added tokens.
    pub vocab_size: usize,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("eos", &self.eos)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

const EOS_CANDIDATES: [&str; 4] = ["<eos>", "<|im_end|>", "<|endoftext|>", "</s>"];

impl TextCodec {
    /// Load `tokenizer.json` bytes; `name` is used in errors.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<TextCodec, TextError> {
        let tok = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| TextError::Load {
            path: name.into(),
            msg: e.to_string(),
        })?;
        let eos = EOS_CANDIDATES
            .iter()
            .find_map(|t| tok.token_to_id(t))
            .ok_or_else(|| TextError::NoEos {
                path: name.into(),
                looked_for: EOS_CANDIDATES.join(", "),
            })?;
        let vocab_size = tok.get_vocab_size(true);
        Ok(TextCodec {
            tok,
            eos,
            vocab_size,
        })
    }

    /// Load `DIR/tokenizer.json`.
    pub fn from_model_dir(dir: &Path) -> Result<TextCodec, TextError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| TextError::Load {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// The demo's char-level tokenizer (see [`char_tokenizer_json`]).
    pub fn char_level() -> TextCodec {
        Self::from_bytes(char_tokenizer_json().as_bytes(), "<char-level>")
            .expect("the built-in char-level tokenizer.json loads")
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.tok
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Codec(e.to_string()))
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.tok
            .decode(ids, true)
            .map_err(|e| TextError::Codec(e.to_string()))
    }
}

/// The special tokens of mxrl's tokenizers, ids 0..3 in this order.
pub const SPECIALS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// Vocabulary size of the char-level tokenizer: 4 specials + 95 printable ASCII + newline,
/// padded with reserved tokens to 128.
pub const CHAR_VOCAB: usize = 128;

/// A Hugging Face `tokenizer.json` for a char-level vocabulary: ids 0..3 are `<pad>`, `<bos>`,
/// `<eos>`, `<unk>`; then `\n` and the printable ASCII characters; then reserved tokens up to
/// [`CHAR_VOCAB`]. A BPE model with no merges splits text into characters; the `Fuse` decoder
/// joins them back without spaces.
pub fn char_tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    let specials = ["<pad>", "<bos>", "<eos>", "<unk>"];
    for (i, s) in specials.iter().enumerate() {
        vocab.insert((*s).into(), i.into());
    }
    let mut id = specials.len();
    for c in std::iter::once('\n').chain((32u8..127).map(char::from)) {
        vocab.insert(c.to_string(), id.into());
        id += 1;
    }
    while id < CHAR_VOCAB {
        vocab.insert(format!("<reserved_{id}>"), id.into());
        id += 1;
    }
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": "<unk>",
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": []
        }
    })
    .to_string()
}

/// The smallest vocabulary [`train_bpe`] accepts: the [`SPECIALS`] and the 256 byte symbols.
pub const MIN_BPE_VOCAB: usize = SPECIALS.len() + 256;
/// The largest vocabulary [`train_bpe`] accepts.
pub const MAX_BPE_VOCAB: usize = 1 << 18;
/// How often a pair must occur in the corpus to be merged by [`train_bpe`].
pub const BPE_MIN_FREQUENCY: u64 = 2;

/// Train a byte-level BPE `tokenizer.json` of exactly `vocab_size` tokens on `texts`.
///
/// Layout (what `tokenizers` and `transformers`' `PreTrainedTokenizerFast(tokenizer_file=…)`
/// load): ids 0..3 the [`SPECIALS`] (added tokens, `special: true`); then the 256 byte symbols
/// of GPT-2's byte-to-unicode map (printable ASCII stands for itself, a space is `Ġ`, a newline
/// `Ċ`), so any text encodes without `<unk>`; then the merges learnt from `texts`, most
/// frequent first (pairs seen at least [`BPE_MIN_FREQUENCY`] times). When the corpus runs out
/// of such pairs before `vocab_size`, the rest are `<reserved_ID>` tokens that no text encodes
/// to, as in the char-level tokenizer. Pre-tokenizer: GPT-2's split (runs of digits, of
/// letters, of other symbols stay apart), no prefix space; decoder: byte-level; no
/// normalizer, no post-processor (nothing is added to an encoding).
///
/// # Errors
/// [`TextError::Train`]: `vocab_size` outside [`MIN_BPE_VOCAB`]..=[`MAX_BPE_VOCAB`], an empty
/// corpus, a failure inside the trainer.
pub fn train_bpe<I, S>(texts: I, vocab_size: usize) -> Result<String, TextError>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerBuilder,
    };
    let err = |e: &dyn std::fmt::Display| TextError::Train(e.to_string());
    if !(MIN_BPE_VOCAB..=MAX_BPE_VOCAB).contains(&vocab_size) {
        return Err(TextError::Train(format!(
            "vocab size {vocab_size}: a byte-level BPE needs {MIN_BPE_VOCAB}–{MAX_BPE_VOCAB} \
             tokens ({} specials + 256 byte symbols + merges)",
            SPECIALS.len()
        )));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(BPE_MIN_FREQUENCY)
        .show_progress(false)
        .special_tokens(
            SPECIALS
                .iter()
                .map(|t| AddedToken::from(*t, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
    .with_decoder(Some(ByteLevel::new(false, true, true).into()))
    .build()
    .map_err(|e| err(&e))?;
    let mut n = 0usize;
    tok.train(&mut trainer, texts.inspect(|_| n += 1))
        .map_err(|e| err(&e))?;
    if n == 0 {
        return Err(TextError::Train("the corpus is empty".into()));
    }
    let json = tok.to_string(false).map_err(|e| err(&e))?;
    let mut v: serde_json::Value = serde_json::from_str(&json).map_err(|e| err(&e))?;
    let vocab = v["model"]["vocab"]
        .as_object_mut()
        .ok_or_else(|| TextError::Train("the trained tokenizer has no model.vocab".into()))?;
    let mut by_id: Vec<(String, u64)> = vocab
        .iter()
        .map(|(k, id)| (k.clone(), id.as_u64().unwrap_or(u64::MAX)))
        .collect();
    by_id.sort_by_key(|e| e.1);
    let mut id = by_id.len();
    while id < vocab_size {
        by_id.push((format!("<reserved_{id}>"), id as u64));
        id += 1;
    }
    // The vocabulary is written in id order, one token a line (a JSON map of serde_json
    // sorts its keys): a placeholder that no serialized token can equal (it holds a NUL,
    // which the byte-level alphabet writes as `Ā`) is replaced by the ordered map.
    const SLOT: &str = "\u{0}vocab\u{0}";
    v["model"]["vocab"] = SLOT.into();
    let entries: Vec<String> = by_id
        .iter()
        .map(|(k, id)| format!("      {}: {id}", serde_json::Value::from(k.as_str())))
        .collect();
    let slot = serde_json::to_string(SLOT).expect("a string serializes");
    let out = serde_json::to_string_pretty(&v)
        .map_err(|e| err(&e))?
        .replacen(&slot, &format!("{{\n{}\n    }}", entries.join(",\n")), 1);
    let check = TextCodec::from_bytes(out.as_bytes(), "<trained tokenizer.json>")?;
    if check.vocab_size != vocab_size {
        return Err(TextError::Train(format!(
            "the trained tokenizer has {} tokens, {vocab_size} were asked for",
            check.vocab_size
        )));
    }
    Ok(out)
}

/// The text of `samples` problems of `task` (problem `i` of the stream seeded by `seed`; a
/// prompt list contributes each problem once, in order, up to `samples`), as separate
/// sequences — prompt, then the completion (or the label when there is none) — the way the
/// loop encodes them.
pub fn task_corpus(task: &crate::task::TaskSource, samples: usize, seed: u64) -> Vec<String> {
    use crate::task::TaskSource;
    let problems = match task {
        TaskSource::List(v) => v.iter().take(samples).cloned().collect(),
        _ => task.batch(seed, 0, samples),
    };
    problems
        .into_iter()
        .flat_map(|p| {
            let answer = match (p.completion, task.reward_kind()) {
                (Some(c), _) => c,
                (None, crate::task::RewardKind::AnswerTag) => format!("Answer: {}", p.label),
                (None, crate::task::RewardKind::Boxed) => format!("\\boxed{{{}}}", p.label),
                (None, crate::task::RewardKind::Exact) => p.label,
                (None, crate::task::RewardKind::Worked) => {
                    unreachable!("the worked chain task gives every problem its working")
                }
            };
            [p.prompt, answer]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_round_trips_and_knows_eos() {
        let t = TextCodec::char_level();
        assert_eq!(t.vocab_size, CHAR_VOCAB);
        assert_eq!(t.eos, 2);
        let ids = t.encode("12+34=46\nAnswer: x").unwrap();
        assert_eq!(ids.len(), 18);
        // '1' is ASCII 49 → id 4 (specials) + 1 (newline) + (49 − 32).
        assert_eq!(ids[0], 4 + 1 + 49 - 32);
        assert_eq!(t.decode(&ids).unwrap(), "12+34=46\nAnswer: x");
        let mut with_eos = ids.clone();
        with_eos.push(t.eos);
        assert_eq!(t.decode(&with_eos).unwrap(), "12+34=46\nAnswer: x");
    }

    fn chain_corpus() -> Vec<String> {
        let t = crate::task::TaskSource::Chain(crate::task::ChainTask::new(3, 2, "+-*").unwrap());
        task_corpus(&t, 2000, 0)
    }

    #[test]
    fn trained_bpe_loads_in_the_tokenizers_crate_and_round_trips_task_text() {
        let corpus = chain_corpus();
        assert_eq!(corpus.len(), 4000);
        let json = train_bpe(corpus.iter(), 384).unwrap();
        // The tokenizers crate's own loader, independent of TextCodec.
        let tok = json.parse::<tokenizers::Tokenizer>().unwrap();
        assert_eq!(tok.get_vocab_size(true), 384);
        for (i, s) in SPECIALS.iter().enumerate() {
            assert_eq!(tok.token_to_id(s), Some(i as u32), "{s}");
        }
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        // The file lists the vocabulary in id order, the specials first.
        let at = |t: &str| json.find(&format!("\"{t}\": ")).unwrap();
        assert!(at("<pad>") < at("<eos>") && at("<unk>") < at("!") && at("!") < at("~"));
        let added = v["added_tokens"].as_array().unwrap();
        assert_eq!(added.len(), 4);
        assert!(added.iter().all(|a| a["special"] == true));
        assert_eq!(v["model"]["type"], "BPE");
        assert_eq!(v["pre_tokenizer"]["type"], "ByteLevel");
        assert_eq!(v["decoder"]["type"], "ByteLevel");
        assert!(v["post_processor"].is_null());
        let codec = TextCodec::from_bytes(json.as_bytes(), "t").unwrap();
        assert_eq!((codec.eos, codec.vocab_size), (2, 384));
        let mut merged = 0;
        for text in corpus.iter().take(400) {
            let ids = codec.encode(text).unwrap();
            assert_eq!(&codec.decode(&ids).unwrap(), text);
            assert!(
                ids.iter().all(|&i| (4..384).contains(&i)),
                "{text}: {ids:?}"
            );
            merged += usize::from(ids.len() < text.len());
            // Decoding stops at nothing but skips the specials.
            let mut with_eos = ids.clone();
            with_eos.push(codec.eos);
            assert_eq!(&codec.decode(&with_eos).unwrap(), text);
        }
        // 2-digit operands recur, so merges shorten most texts.
        assert!(
            merged > 200,
            "only {merged} of 400 texts got shorter than their characters"
        );
        // Any text encodes (byte-level: no <unk>), including what the corpus never had.
        for text in ["Answer: 42\nnew line", "Grüße, 世界 ∑", "  spaced  "] {
            let ids = codec.encode(text).unwrap();
            assert!(!ids.contains(&3), "{text}");
            assert_eq!(codec.decode(&ids).unwrap(), text);
        }
        // Merges are readable: a learnt token of digits is the digits themselves.
        let vocab = tok.get_vocab(false);
        assert!(
            vocab
                .keys()
                .any(|k| k.len() == 2 && k.chars().all(|c| c.is_ascii_digit())),
            "no 2-digit token learnt"
        );
    }

    #[test]
    fn bpe_training_is_deterministic_and_pads_with_reserved_tokens() {
        let corpus = chain_corpus();
        let a = train_bpe(corpus.iter(), 1024).unwrap();
        let b = train_bpe(corpus.iter(), 1024).unwrap();
        assert_eq!(a, b);
        // The corpus runs out of pairs seen twice before 4096 tokens: the rest is reserved.
        let big = train_bpe(corpus.iter(), 4096).unwrap();
        let tok = big.parse::<tokenizers::Tokenizer>().unwrap();
        assert_eq!(tok.get_vocab_size(true), 4096);
        assert_eq!(tok.token_to_id("<reserved_4095>"), Some(4095));
        let v: serde_json::Value = serde_json::from_str(&big).unwrap();
        let merges = v["model"]["merges"].as_array().unwrap().len();
        let reserved = (0..4096)
            .filter(|i| tok.token_to_id(&format!("<reserved_{i}>")).is_some())
            .count();
        assert!(reserved > 0 && merges > 0);
        assert_eq!(4 + 256 + merges + reserved, 4096);
        // Reserved tokens are never produced from text.
        let c = TextCodec::from_bytes(big.as_bytes(), "big").unwrap();
        let ids = c.encode("<reserved_4095>").unwrap();
        assert!(
            ids.iter().all(|&i| (i as usize) < 4 + 256 + merges),
            "{ids:?}"
        );
    }

    #[test]
    fn bpe_training_refuses_impossible_settings() {
        let corpus = chain_corpus();
        let e = train_bpe(corpus.iter(), MIN_BPE_VOCAB - 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vocab size 259") && e.contains("260"), "{e}");
        let e = train_bpe(std::iter::empty::<&str>(), 512)
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn task_corpus_of_worked_chains_holds_the_working() {
        use crate::task::{ChainResponse, ChainTask, TaskSource};
        let answer = ChainTask::new(3, 1, "+-*").unwrap();
        let worked = TaskSource::Chain(answer.clone().with_response(ChainResponse::Worked));
        let c = task_corpus(&worked, 50, 4);
        let a = task_corpus(&TaskSource::Chain(answer), 50, 4);
        for (i, p) in worked.batch(4, 0, 50).iter().enumerate() {
            assert_eq!(c[2 * i], p.prompt);
            assert_eq!(&c[2 * i + 1], p.completion.as_ref().unwrap());
            // The same prompts; the answer text is the working ending in the label.
            assert_eq!(a[2 * i], p.prompt);
            assert_eq!(a[2 * i + 1], p.label);
            assert!(
                c[2 * i + 1].ends_with(&format!(". #{}", p.label)),
                "{}",
                c[2 * i + 1]
            );
            assert_eq!(c[2 * i + 1].matches('=').count(), 3);
        }
    }

    #[test]
    fn task_corpus_gives_prompts_and_answers() {
        use crate::task::{Problem, TaskSource};
        let t = TaskSource::Arithmetic(crate::task::ArithmeticTask::default());
        let c = task_corpus(&t, 3, 9);
        let p = t.batch(9, 0, 3);
        assert_eq!(
            c,
            vec![
                p[0].prompt.clone(),
                p[0].label.clone(),
                p[1].prompt.clone(),
                p[1].label.clone(),
                p[2].prompt.clone(),
                p[2].label.clone()
            ]
        );
        let list = TaskSource::List(vec![Problem {
            prompt: "What is 6*7?".into(),
            label: "42".into(),
            completion: None,
        }]);
        assert_eq!(
            task_corpus(&list, 10, 0),
            vec!["What is 6*7?", "Answer: 42"]
        );
    }
}
