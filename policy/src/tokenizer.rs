//! Text ↔ token ids through the `tokenizers` crate and a `tokenizer.json`
//! (what Hugging Face checkpoints ship).

use std::path::Path;

use crate::chat::{ChatError, ChatTemplate};

#[derive(Debug, thiserror::Error)]
#[error("tokenizer {path}: {message}")]
pub struct TokenizerError {
    pub path: String,
    pub message: String,
}

/// Special tokens of the built-in character tokenizer, in id order.
pub const CHAR_SPECIALS: [&str; 3] = ["<pad>", "<eos>", "<unk>"];

/// The built-in tokenizer of the tiny task: one token per printable ASCII
/// character (digits stay single tokens, which arithmetic wants), plus
/// `<pad>`, `<eos>` and `<unk>`. 98 tokens. Built with the tokenizers crate
/// from its JSON form; `policy/assets/char-tokenizer.json` is the shipped
/// copy (a test keeps the two identical).
pub fn char_level_json() -> String {
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, t) in CHAR_SPECIALS.iter().enumerate() {
        vocab.insert(t.to_string(), id.into());
        added.push(serde_json::json!({
            "id": id, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    }
    for c in (32u8..127).map(char::from) {
        let id = vocab.len();
        vocab.insert(c.to_string(), id.into());
    }
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Split",
            // Any one character, newlines included, in a syntax both the
            // Rust regex engines and Oniguruma (Python's tokenizers, so
            // transformers and vLLM) read: `(?s).` is Rust's only.
            "pattern": {"Regex": "[\\s\\S]"},
            "behavior": "Isolated",
            "invert": false
        },
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
    /// The `tokenizer_config.json` found beside the file, kept verbatim
    /// so that a saved tokenizer carries its chat template along.
    config_json: Option<String>,
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config_json = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(TokenizerError {
                    path: config_path.display().to_string(),
                    message: e.to_string(),
                });
            }
        };
        Ok(Self {
            inner,
            path: path.display().to_string(),
            config_json,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> TokenizerError {
        TokenizerError {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// The built-in character tokenizer (see [`char_level_json`]).
    pub fn char_level() -> Self {
        let inner = tokenizers::Tokenizer::from_bytes(char_level_json().as_bytes())
            .expect("the built-in tokenizer JSON is valid");
        Self {
            inner,
            path: "<built-in char tokenizer>".into(),
            config_json: None,
        }
    }

    /// Writes the tokenizer as `tokenizer.json`, and the
    /// `tokenizer_config.json` it was loaded with (its chat template)
    /// beside it.
    pub fn save(&self, path: &Path) -> Result<(), TokenizerError> {
        self.inner.save(path, true).map_err(|e| self.err(e))?;
        if let Some(text) = &self.config_json {
            let config = path.with_file_name("tokenizer_config.json");
            std::fs::write(&config, text).map_err(|e| TokenizerError {
                path: config.display().to_string(),
                message: e.to_string(),
            })?;
        }
        Ok(())
    }

    /// The chat template of the `tokenizer_config.json` loaded with this
    /// tokenizer, if it has one.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>, ChatError> {
        match &self.config_json {
            Some(text) => ChatTemplate::from_config_json(text, &self.path),
            None => Ok(None),
        }
    }

    /// Token ids of `text`, without special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are skipped. Ids outside the
    /// vocabulary (a model can emit them if its head is larger) are dropped
    /// rather than failing, since verifiers read whatever came out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let v = self.vocab_size() as u32;
        let known: Vec<u32> = ids.iter().copied().filter(|&i| i < v).collect();
        self.inner.decode(&known, true).map_err(|e| self.err(e))
    }

    /// Where it was loaded from (for messages).
    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of token `id` as the vocabulary writes it (a special
    /// token's own name, which [`Self::decode`] skips).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The ids of the stop tokens in `names` this tokenizer has (the
    /// default list covers several model families; each has some); none
    /// at all is an error naming the list.
    pub fn stop_ids(&self, names: &[String]) -> Result<Vec<u32>, NoStopToken> {
        let ids: Vec<u32> = names.iter().filter_map(|s| self.token_id(s)).collect();
        if ids.is_empty() {
            return Err(NoStopToken(names.to_vec()));
        }
        Ok(ids)
    }
}

/// None of the configured stop tokens is in the tokenizer: generation
/// would never stop before its token limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("none of the stop tokens {0:?} is in the tokenizer")]
pub struct NoStopToken(pub Vec<String>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_tokenizer_round_trips_arithmetic_and_unknowns() {
        let t = TextTokenizer::char_level();
        assert_eq!(t.vocab_size(), 98);
        let text = "What is 123 * 45? Answer: 5535";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(t.token_id("<eos>"), Some(1));
        // Outside printable ASCII: <unk>, never a panic.
        assert_eq!(t.encode("é\n").unwrap(), vec![2, 2]);
    }

    #[test]
    fn a_saved_tokenizer_carries_its_chat_template_along() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("model");
        std::fs::create_dir_all(&src).unwrap();
        TextTokenizer::char_level()
            .save(&src.join("tokenizer.json"))
            .unwrap();
        let config = r#"{"chat_template": "[{{ messages[0].content }}]"}"#;
        std::fs::write(src.join("tokenizer_config.json"), config).unwrap();
        let loaded = TextTokenizer::from_file(&src.join("tokenizer.json")).unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(&run).unwrap();
        loaded.save(&run.join("tokenizer.json")).unwrap();
        let again = TextTokenizer::from_file(&run.join("tokenizer.json")).unwrap();
        let chat = again
            .chat_template()
            .unwrap()
            .expect("the template came along");
        assert_eq!(chat.render(None, "hi").unwrap(), "[hi]");
        assert!(
            TextTokenizer::char_level()
                .chat_template()
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_shipped_char_tokenizer_is_the_built_one() {
        let shipped = crate::crate_dir().join("assets/char-tokenizer.json");
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("t.json");
        TextTokenizer::char_level().save(&fresh).unwrap();
        let fresh = std::fs::read_to_string(fresh).unwrap();
        if std::env::var_os("BAPO_REGENERATE").is_some() {
            std::fs::write(&shipped, &fresh).unwrap();
        }
        let on_disk = std::fs::read_to_string(&shipped)
            .expect("assets/char-tokenizer.json (regenerate with BAPO_REGENERATE=1)");
        assert_eq!(
            on_disk, fresh,
            "regenerate with BAPO_REGENERATE=1 cargo test -p bapo-policy"
        );
        let loaded = TextTokenizer::from_file(&shipped).unwrap();
        assert_eq!(loaded.encode("1+1=2").unwrap(), vec![20, 14, 20, 32, 21]);
        assert_eq!(
            loaded.encode("1\n2").unwrap(),
            vec![20, 2, 21],
            "a newline is one <unk>"
        );
    }
}
