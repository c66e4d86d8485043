//! Text ↔ token ids through the `tokenizers` crate and a `tokenizer.json`
//! (what Hugging Face checkpoints ship).

use std::path::Path;

#[derive(Debug, thiserror::Error)]
#[error("tokenizer {path}: {message}")]
pub struct TokenizerError {
    pub path: String,
    pub message: String,
}

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self {
            inner,
            path: path.display().to_string(),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> TokenizerError {
        TokenizerError {
            path: self.path.clone(),
            message: e.to_string(),
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

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
