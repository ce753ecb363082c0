//! Text ↔ token ids through a Hugging Face `tokenizer.json` (the `tokenizers` crate), and the
//! char-level tokenizer of the demo.

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
}
