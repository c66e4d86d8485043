//! What an environment says, as tokens to append, and never a
//! re-tokenization of what the model said.
//!
//! The model's sampled ids are kept as they are; an observation is
//! rendered on its own and appended. With a chat template, the tokens to
//! append are what the template writes after an assistant turn: the
//! conversation `[system?, user, assistant = SENTINEL, observation...]`
//! is rendered with the generation prompt, and everything after the
//! sentinel (less the model's own end-of-turn token, which it sampled) is
//! the observation's text. Where the template is append-only, the ids
//! therefore equal a fresh render of the whole conversation
//! (`ids_equal_a_fresh_render_where_the_template_is_append_only`).
//! Templates that rewrite earlier turns (dropping past `<think>` blocks)
//! are not followed: the model keeps seeing its own earlier turns whole,
//! as it sampled them.

use std::sync::Arc;

use bapo_policy::{chat::ChatTemplate, tokenizer::TextTokenizer};

use super::{Message, Observation, config::TruncateSide};

/// Bytes of text kept per token of the cap before tokenizing: an
/// observation is cut to `max_tokens x` this on its kept side first, so a
/// megabyte of tool output costs what its cap does, not a tokenization of
/// the whole. A token of ordinary text is a few bytes, so the cut text
/// still holds more tokens than the cap, and the cap decides what is kept.
pub const PRECUT_BYTES_PER_TOKEN: usize = 64;

/// Stands in for the model's turn while a template is rendered; no model
/// writes it.
const SENTINEL: &str = "\u{2063}bapo-model-turn\u{2063}";

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RenderError {
    #[error("observation token id {id} is outside the model's vocabulary of {vocab}")]
    Vocab { id: u32, vocab: usize },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error("the chat template drops the model's turn, so an observation cannot follow it")]
    NotAppendOnly,
    #[error("an observation with nothing in it")]
    Empty,
}

/// Observations into tokens for one model.
pub struct Renderer {
    tokenizer: Arc<TextTokenizer>,
    template: Option<ChatTemplate>,
    system: Option<String>,
    max_tokens: usize,
    side: TruncateSide,
}

/// An observation's tokens and whether its content was cut to fit.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub tokens: Vec<u32>,
    pub truncated: bool,
}

impl Renderer {
    pub fn new(
        tokenizer: Arc<TextTokenizer>,
        template: Option<ChatTemplate>,
        system: Option<String>,
        max_tokens: usize,
        side: TruncateSide,
    ) -> Self {
        Self {
            tokenizer,
            template,
            system,
            max_tokens,
            side,
        }
    }

    /// The first observation, as the episode's prompt (uncapped: the
    /// model's positions bound it).
    pub fn prompt(&self, obs: &Observation) -> Result<Vec<u32>, RenderError> {
        let ids = match obs {
            Observation::Tokens(ids) => self.checked(ids.clone())?,
            Observation::Text(t) => self.encode(t)?,
            Observation::Messages(m) => match &self.template {
                None => self.encode(&plain(m))?,
                Some(t) => {
                    let mut msgs = self.system_message();
                    msgs.extend(m.iter().map(|m| (m.role.as_str(), m.content.as_str())));
                    let text = t
                        .render_messages(&msgs, true)
                        .map_err(|e| RenderError::Template(e.to_string()))?;
                    self.encode(&text)?
                }
            },
        };
        if ids.is_empty() {
            return Err(RenderError::Empty);
        }
        Ok(ids)
    }

    /// An observation after a model turn whose last token was `stop` (a
    /// stop token) or not (cut off by its cap), its content capped.
    pub fn after_turn(
        &self,
        obs: &Observation,
        stop: Option<u32>,
    ) -> Result<Rendered, RenderError> {
        match obs {
            Observation::Tokens(ids) => {
                let (ids, truncated) = self.cap(self.checked(ids.clone())?);
                Ok(Rendered {
                    tokens: ids,
                    truncated,
                })
            }
            Observation::Text(t) => {
                let (t, precut) = self.precut(t, self.max_tokens);
                let (ids, truncated) = self.cap(self.encode(t)?);
                Ok(Rendered {
                    tokens: ids,
                    truncated: truncated || precut,
                })
            }
            Observation::Messages(m) => self.messages_after_turn(m, stop),
        }
    }

    fn messages_after_turn(
        &self,
        m: &[Message],
        stop: Option<u32>,
    ) -> Result<Rendered, RenderError> {
        let (m, truncated) = self.cap_messages(m)?;
        let Some(template) = &self.template else {
            return Ok(Rendered {
                tokens: self.encode(&plain(&m))?,
                truncated,
            });
        };
        let mut msgs = self.system_message();
        msgs.push(("user", "-"));
        msgs.push(("assistant", SENTINEL));
        msgs.extend(m.iter().map(|m| (m.role.as_str(), m.content.as_str())));
        let text = template
            .render_messages(&msgs, true)
            .map_err(|e| RenderError::Template(e.to_string()))?;
        let at = text.find(SENTINEL).ok_or(RenderError::NotAppendOnly)? + SENTINEL.len();
        let mut rest = &text[at..];
        if let Some(end) = stop.and_then(|id| self.tokenizer.token_text(id))
            && let Some(after) = rest.strip_prefix(end.as_str())
        {
            rest = after;
        }
        Ok(Rendered {
            tokens: self.encode(rest)?,
            truncated,
        })
    }

    fn system_message(&self) -> Vec<(&str, &str)> {
        self.system
            .as_deref()
            .map(|s| vec![("system", s)])
            .unwrap_or_default()
    }

    /// The messages with their contents cut to `max_tokens` in all.
    fn cap_messages(&self, m: &[Message]) -> Result<(Vec<Message>, bool), RenderError> {
        let mut left = self.max_tokens;
        let mut cut = false;
        let mut out = Vec::with_capacity(m.len());
        for msg in m {
            let (text, precut) = self.precut(&msg.content, left);
            let ids = self.encode(text)?;
            let content = if ids.len() <= left && !precut {
                left -= ids.len();
                msg.content.clone()
            } else {
                cut = true;
                let kept = self.side_of(&ids, left);
                left = 0;
                self.tokenizer
                    .decode(kept)
                    .map_err(|e| RenderError::Tokenize(e.to_string()))?
            };
            out.push(Message::new(&msg.role, content));
        }
        Ok((out, cut))
    }

    /// `text` cut on its kept side to what `tokens` tokens could hold at
    /// most ([`PRECUT_BYTES_PER_TOKEN`]), at a character boundary; whether
    /// anything was cut.
    fn precut<'t>(&self, text: &'t str, tokens: usize) -> (&'t str, bool) {
        let max = tokens.saturating_mul(PRECUT_BYTES_PER_TOKEN);
        if text.len() <= max {
            return (text, false);
        }
        let cut = match self.side {
            TruncateSide::Right => {
                let end = (0..=max).rev().find(|&i| text.is_char_boundary(i));
                &text[..end.unwrap_or(0)]
            }
            TruncateSide::Left => {
                let from = text.len() - max;
                let start = (from..=text.len()).find(|&i| text.is_char_boundary(i));
                &text[start.unwrap_or(text.len())..]
            }
        };
        (cut, true)
    }

    fn cap(&self, ids: Vec<u32>) -> (Vec<u32>, bool) {
        if ids.len() <= self.max_tokens {
            return (ids, false);
        }
        (self.side_of(&ids, self.max_tokens).to_vec(), true)
    }

    fn side_of<'a>(&self, ids: &'a [u32], n: usize) -> &'a [u32] {
        match self.side {
            TruncateSide::Right => &ids[..n.min(ids.len())],
            TruncateSide::Left => &ids[ids.len().saturating_sub(n)..],
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, RenderError> {
        self.tokenizer
            .encode(text)
            .map_err(|e| RenderError::Tokenize(e.to_string()))
    }

    fn checked(&self, ids: Vec<u32>) -> Result<Vec<u32>, RenderError> {
        let vocab = self.tokenizer.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(RenderError::Vocab { id, vocab }),
            None => Ok(ids),
        }
    }
}

/// Messages for a model without a chat template: their contents, as the
/// environment wrote them.
fn plain(m: &[Message]) -> String {
    m.iter().map(|m| m.content.as_str()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = r#"{"bos_token": "", "eos_token": "<|im_end|>", "chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"}"#;

    /// A word-level tokenizer with ChatML's special tokens, made in the
    /// test: each special token is one id, every other character one id.
    fn chatml_tokenizer() -> Arc<TextTokenizer> {
        let dir = tempfile::tempdir().unwrap();
        let mut json: serde_json::Value =
            serde_json::from_str(&bapo_policy::tokenizer::char_level_json()).unwrap();
        let added = json["added_tokens"].as_array_mut().unwrap();
        let next = 98; // after the 98 built-in tokens
        for (i, t) in ["<|im_start|>", "<|im_end|>"].iter().enumerate() {
            added.push(serde_json::json!({
                "id": next + i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        }
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), CHATML).unwrap();
        let t = TextTokenizer::from_file(&path).unwrap();
        std::mem::forget(dir);
        Arc::new(t)
    }

    fn renderer(tok: &Arc<TextTokenizer>, max: usize, side: TruncateSide) -> Renderer {
        let template = tok.chat_template().unwrap();
        Renderer::new(tok.clone(), template, None, max, side)
    }

    #[test]
    fn ids_equal_a_fresh_render_where_the_template_is_append_only() {
        let tok = chatml_tokenizer();
        let r = renderer(&tok, 64, TruncateSide::Right);
        let template = tok.chat_template().unwrap().unwrap();
        let question = vec![Message::new("user", "12*34=")];
        let prompt = r.prompt(&Observation::Messages(question)).unwrap();
        let end = tok.token_id("<|im_end|>").unwrap();
        let mut ids = prompt;
        // The model's turn as sampled: its text, then its stop token.
        ids.extend(tok.encode("<call>12*34</call>").unwrap());
        ids.push(end);
        let obs = Observation::Messages(vec![Message::new("tool", "<result>408</result>")]);
        let rendered = r.after_turn(&obs, Some(end)).unwrap();
        assert!(!rendered.truncated);
        ids.extend(rendered.tokens);
        let fresh = template
            .render_messages(
                &[
                    ("user", "12*34="),
                    ("assistant", "<call>12*34</call>"),
                    ("tool", "<result>408</result>"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(ids, tok.encode(&fresh).unwrap());
    }

    #[test]
    fn plain_text_without_a_template_and_contents_capped_at_either_end() {
        let tok = Arc::new(TextTokenizer::char_level());
        let r = Renderer::new(tok.clone(), None, None, 5, TruncateSide::Right);
        let obs = Observation::Messages(vec![Message::new("tool", "<result>408</result>")]);
        let right = r.after_turn(&obs, None).unwrap();
        assert!(right.truncated);
        assert_eq!(tok.decode(&right.tokens).unwrap(), "<resu");
        let r = Renderer::new(tok.clone(), None, None, 5, TruncateSide::Left);
        let left = r.after_turn(&obs, None).unwrap();
        assert_eq!(tok.decode(&left.tokens).unwrap(), "sult>");
        let r = Renderer::new(tok.clone(), None, None, 64, TruncateSide::Left);
        let whole = r.after_turn(&obs, None).unwrap();
        assert_eq!(tok.decode(&whole.tokens).unwrap(), "<result>408</result>");
    }

    #[test]
    fn a_huge_observation_is_cut_before_it_is_tokenized() {
        let tok = Arc::new(TextTokenizer::char_level());
        // 4 MiB of two-byte characters after a short head, and the reverse.
        let head = format!("head{}", "é".repeat(2 << 20));
        let tail = format!("{}tail", "é".repeat(2 << 20));
        for (side, text, kept) in [
            (TruncateSide::Right, &head, "head"),
            (TruncateSide::Left, &tail, "tail"),
        ] {
            let r = Renderer::new(tok.clone(), None, None, 4, side);
            let (cut, precut) = r.precut(text, 4);
            assert!(
                precut && cut.len() <= 4 * PRECUT_BYTES_PER_TOKEN,
                "{}",
                cut.len()
            );
            let out = r
                .after_turn(&Observation::Text(text.clone()), None)
                .unwrap();
            assert!(out.truncated);
            assert_eq!(tok.decode(&out.tokens).unwrap(), kept);
            let msgs = Observation::Messages(vec![Message::new("tool", text)]);
            let out = r.after_turn(&msgs, None).unwrap();
            assert_eq!(
                (tok.decode(&out.tokens).unwrap().as_str(), out.truncated),
                (kept, true)
            );
        }
        // Within the bound nothing is cut before the cap.
        let r = Renderer::new(tok.clone(), None, None, 4, TruncateSide::Right);
        assert_eq!(r.precut("short", 4), ("short", false));
    }

    #[test]
    fn token_observations_are_checked_against_the_vocabulary() {
        let tok = Arc::new(TextTokenizer::char_level());
        let r = Renderer::new(tok.clone(), None, None, 8, TruncateSide::Right);
        let bad = Observation::Tokens(vec![1, 1_000_000]);
        assert!(matches!(
            r.after_turn(&bad, None),
            Err(RenderError::Vocab { id: 1_000_000, .. })
        ));
        assert_eq!(
            r.prompt(&Observation::Text(String::new())),
            Err(RenderError::Empty)
        );
    }
}
