//! What the file-backed tasks (`jsonl`, `math`) share: reading a JSONL file
//! of records whose field names are configurable, turning a question into a
//! prompt, and the held-out split by a hash of the question.
//!
//! A task only says how one record becomes a question, a reference answer
//! and a warm-up solution; everything else (line numbers in errors, the
//! split, the seeded training order, where the instruction goes) lives here
//! once, so the two tasks cannot drift apart.

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde_json::{Map, Value};

use super::{Problem, PromptFormat, StableHasher, TaskError};

/// The prompt of a raw-text model when the spec gives no template: the
/// model continues the text after `Answer:`.
pub const RAW_TEMPLATE: &str = "Question: {question}\nAnswer:";

/// The user message of a chat model when the spec gives no template: the
/// question alone, since the chat template supplies the roles.
pub const CHAT_TEMPLATE: &str = "{question}";

/// Where the question (and the instruction after it) goes in a template.
pub const QUESTION_SLOT: &str = "{question}";

/// Key of the held-out hash. It spells "jsonl_ho" because the jsonl task had
/// it first: changing it would reshuffle every existing split, and sharing
/// it holds the same questions out whichever task reads a file.
const HELD_OUT_KEY: u64 = 0x6a73_6f6e_6c5f_686f;
/// Key of the training order's seed (also the jsonl task's, for the same
/// reason).
const TRAIN_KEY: u64 = 0x6a73_6f6e_6c5f_7472;

/// How a file of records becomes problems. Each task has its own defaults
/// (`Jsonl::default_options`, `Math::default_options`); a [`super::TaskSpec`]
/// overrides them.
#[derive(Debug, Clone, PartialEq)]
pub struct FileOptions {
    /// Seed of the training order; the split never depends on it.
    pub seed: u64,
    /// The fraction of records held out for evaluation, in [0, 1).
    pub eval_fraction: f64,
    /// The prompt with [`QUESTION_SLOT`]; `None` = [`RAW_TEMPLATE`] or
    /// [`CHAT_TEMPLATE`] by `format`.
    pub template: Option<String>,
    /// Added on a line of its own after the question, inside the template,
    /// so it reaches the model whatever the template wraps around it.
    pub instruction: Option<String>,
    /// Raw text or a chat's user message (which changes the default
    /// template and how a solution joins its prompt).
    pub format: PromptFormat,
    /// The record field holding the question.
    pub question_field: String,
    /// The record field holding the reference answer.
    pub answer_field: String,
    /// The record field holding a worked solution, where the task reads one.
    pub solution_field: Option<String>,
}

impl FileOptions {
    /// Raw prompts from the default template, seed 0 and a tenth held out,
    /// reading the given fields.
    pub fn new(question_field: &str, answer_field: &str) -> Self {
        Self {
            seed: 0,
            eval_fraction: 0.1,
            template: None,
            instruction: None,
            format: PromptFormat::Raw,
            question_field: question_field.to_string(),
            answer_field: answer_field.to_string(),
            solution_field: None,
        }
    }

    /// The template in force: the spec's, else the format's default.
    pub fn template(&self) -> &str {
        self.template.as_deref().unwrap_or(match self.format {
            PromptFormat::Raw => RAW_TEMPLATE,
            PromptFormat::Chat => CHAT_TEMPLATE,
        })
    }

    /// Rejects options that would silently build wrong prompts or splits.
    fn validate(&self) -> Result<(), TaskError> {
        let eval_fraction = self.eval_fraction;
        if !(eval_fraction.is_finite() && (0.0..1.0).contains(&eval_fraction)) {
            return Err(TaskError::InvalidSpec {
                field: "eval_fraction",
                reason: format!("{eval_fraction} is outside [0, 1)"),
            });
        }
        let template = self.template();
        if !template.contains(QUESTION_SLOT) {
            return Err(TaskError::InvalidSpec {
                field: "template",
                reason: format!("{template:?} has no {QUESTION_SLOT}"),
            });
        }
        if self
            .instruction
            .as_deref()
            .is_some_and(|i| i.trim().is_empty())
        {
            return Err(TaskError::InvalidSpec {
                field: "instruction",
                reason: "is blank; leave it out instead".to_string(),
            });
        }
        Ok(())
    }

    /// The prompt of a question: the instruction joins the question, and
    /// both go into the template's `{question}` slot.
    fn prompt(&self, question: &str) -> String {
        let filled = match &self.instruction {
            Some(instruction) => format!("{question}\n{instruction}"),
            None => question.to_string(),
        };
        self.template().replace(QUESTION_SLOT, &filled)
    }

    /// The warm-up completion of a prompt. A raw prompt is continued as
    /// text, so a space separates `Answer:` from the first word; a chat
    /// answer is a message of its own and takes none.
    fn completion(&self, prompt: &str, solution: String) -> String {
        let joined = prompt.ends_with(char::is_whitespace)
            || solution.starts_with(char::is_whitespace)
            || self.format == PromptFormat::Chat;
        if joined {
            solution
        } else {
            format!(" {solution}")
        }
    }
}

/// One record as a task reads it.
pub(crate) struct Parsed {
    /// The question text, as hashed for the split and put in the prompt.
    pub question: String,
    /// The reference answer the verifier checks.
    pub answer: String,
    /// The warm-up solution, without the prompt's separating space.
    pub solution: String,
}

/// One line's JSON object, with field access that names the field in its
/// errors.
pub(crate) struct Record(Map<String, Value>);

impl Record {
    /// A string field; `None` when absent or null.
    pub(crate) fn text(&self, field: &str) -> Result<Option<String>, String> {
        match self.0.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!(
                "invalid type: `{field}` is {}, expected a string",
                kind(other)
            )),
        }
    }

    /// A string field that must be there.
    pub(crate) fn required_text(&self, field: &str) -> Result<String, String> {
        self.text(field)?
            .ok_or_else(|| format!("missing field `{field}`"))
    }

    /// A string or number field: data sets store numeric answers either
    /// way, and a number's JSON text is the answer's text.
    pub(crate) fn text_or_number(&self, field: &str) -> Result<Option<String>, String> {
        match self.0.get(field) {
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            _ => self.text(field),
        }
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Training and held-out problems of a file.
#[derive(Debug, Clone)]
pub(crate) struct Split {
    /// Training problems in the seed's shuffled order; `train_problem`
    /// walks it round and round. Never empty.
    train: Vec<Problem>,
    /// Held-out problems in file order.
    eval: Vec<Problem>,
}

impl Split {
    /// Reads and splits a file, each record parsed by `parse`.
    pub(crate) fn load(
        path: &Path,
        options: &FileOptions,
        parse: impl Fn(&Record) -> Result<Parsed, String>,
    ) -> Result<Self, TaskError> {
        let text = std::fs::read_to_string(path).map_err(|source| TaskError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path, options, parse)
    }

    /// [`Split::load`] on text already read; `path` names it in errors and
    /// problem ids. A record is held out when a hash of its question falls
    /// below `eval_fraction`, so the split depends neither on the seed nor
    /// on the order of lines (nor on the template or instruction), and a
    /// question that appears twice is never on both sides.
    pub(crate) fn parse(
        text: &str,
        path: &Path,
        options: &FileOptions,
        parse: impl Fn(&Record) -> Result<Parsed, String>,
    ) -> Result<Self, TaskError> {
        options.validate()?;
        let stem = path
            .file_stem()
            .map_or_else(|| "jsonl".into(), |s| s.to_string_lossy());
        let mut train = Vec::new();
        let mut eval = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            if raw.trim().is_empty() {
                continue;
            }
            let line_no = i + 1;
            let parsed =
                record(raw)
                    .and_then(|r| parse(&r))
                    .map_err(|message| TaskError::BadLine {
                        path: path.to_path_buf(),
                        line: line_no,
                        message,
                    })?;
            let prompt = options.prompt(&parsed.question);
            let problem = Problem {
                id: format!("{stem}:{line_no}"),
                solution: options.completion(&prompt, parsed.solution),
                prompt,
                answer: parsed.answer,
            };
            if held_out(&parsed.question, options.eval_fraction) {
                eval.push(problem);
            } else {
                train.push(problem);
            }
        }
        if train.is_empty() {
            return Err(TaskError::BadFile {
                path: path.to_path_buf(),
                message: if eval.is_empty() {
                    "no training problems: the file has no lines".to_string()
                } else {
                    format!(
                        "no training problems: all {} lines are held out",
                        eval.len()
                    )
                },
            });
        }
        let seed = StableHasher::new(TRAIN_KEY).word(options.seed).finish();
        train.shuffle(&mut SmallRng::seed_from_u64(seed));
        Ok(Self { train, eval })
    }

    /// Training problem `index`, wrapping around.
    pub(crate) fn train_problem(&self, index: u64) -> Problem {
        // `parse` guarantees a non-empty training side.
        let i = (index % self.train.len() as u64) as usize;
        self.train[i].clone()
    }

    pub(crate) fn eval_problems(&self, n: usize) -> Vec<Problem> {
        self.eval.iter().take(n).cloned().collect()
    }

    pub(crate) fn sizes(&self) -> (usize, usize) {
        (self.train.len(), self.eval.len())
    }
}

/// A line as a JSON object.
fn record(raw: &str) -> Result<Record, String> {
    match serde_json::from_str(raw).map_err(|e| json_message(&e))? {
        Value::Object(map) => Ok(Record(map)),
        other => Err(format!(
            "invalid type: {}, expected a JSON object",
            kind(&other)
        )),
    }
}

fn held_out(question: &str, eval_fraction: f64) -> bool {
    let h = StableHasher::new(HELD_OUT_KEY)
        .bytes(question.as_bytes())
        .finish();
    // The top 53 bits as a uniform number in [0, 1).
    ((h >> 11) as f64 / (1u64 << 53) as f64) < eval_fraction
}

/// serde_json's message without its own "at line 1 column N" (every line is
/// parsed alone, so its line would always be 1), with the column kept.
fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full);
    format!("{message} (column {})", e.column())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo(r: &Record) -> Result<Parsed, String> {
        Ok(Parsed {
            question: r.required_text("q")?,
            answer: r.text_or_number("a")?.unwrap_or_default(),
            solution: "sol".to_string(),
        })
    }

    fn split(text: &str, options: &FileOptions) -> Result<Split, TaskError> {
        Split::parse(text, Path::new("/data/x.jsonl"), options, echo)
    }

    #[test]
    fn instruction_and_format_shape_prompts_and_solutions() {
        let line = "{\"q\": \"What is 2+2?\", \"a\": 4}";
        let mut options = FileOptions::new("q", "a");
        options.eval_fraction = 0.0;
        let p = split(line, &options).unwrap().train_problem(0);
        assert_eq!(p.prompt, "Question: What is 2+2?\nAnswer:");
        assert_eq!(p.solution, " sol");
        assert_eq!(p.answer, "4", "numbers are read as their text");
        assert_eq!(p.id, "x:1");

        options.instruction = Some("Put the final answer after ####.".into());
        let p = split(line, &options).unwrap().train_problem(0);
        assert_eq!(
            p.prompt,
            "Question: What is 2+2?\nPut the final answer after ####.\nAnswer:"
        );

        options.format = PromptFormat::Chat;
        let p = split(line, &options).unwrap().train_problem(0);
        assert_eq!(p.prompt, "What is 2+2?\nPut the final answer after ####.");
        assert_eq!(p.solution, "sol", "a chat answer is its own message");

        options.template = Some("Solve: {question}".into());
        let p = split(line, &options).unwrap().train_problem(0);
        assert_eq!(
            p.prompt,
            "Solve: What is 2+2?\nPut the final answer after ####."
        );
    }

    #[test]
    fn split_ignores_template_and_instruction() {
        let text: String = (0..500)
            .map(|i| format!("{{\"q\": \"question {i}\", \"a\": \"{i}\"}}\n"))
            .collect();
        let held = |options: &FileOptions| -> Vec<String> {
            let s = split(&text, options).unwrap();
            s.eval_problems(usize::MAX)
                .into_iter()
                .map(|p| p.answer)
                .collect()
        };
        let plain = FileOptions::new("q", "a");
        let mut dressed = plain.clone();
        dressed.instruction = Some("Think.".into());
        dressed.format = PromptFormat::Chat;
        dressed.seed = 7;
        assert!(!held(&plain).is_empty());
        assert_eq!(held(&plain), held(&dressed));
    }

    #[test]
    fn bad_records_and_options_are_named() {
        let options = FileOptions::new("q", "a");
        let cases = [
            ("[1]", "invalid type: an array, expected a JSON object"),
            ("{\"a\": 1}", "missing field `q`"),
            (
                "{\"q\": 1}",
                "invalid type: `q` is a number, expected a string",
            ),
            ("{\"q\": \"x\", \"a\": true}", "`a` is a boolean"),
            ("{nope", "key must be a string"),
        ];
        for (line, needle) in cases {
            let err = split(line, &options).err().unwrap().to_string();
            assert!(err.starts_with("/data/x.jsonl:1: "), "{err}");
            assert!(err.contains(needle), "{err:?} should contain {needle:?}");
        }
        let mut blank = options.clone();
        blank.instruction = Some("  ".into());
        let err = split("{\"q\": \"x\"}", &blank).err().unwrap();
        assert!(err.to_string().contains("instruction"), "{err}");
        let mut chat = options;
        chat.format = PromptFormat::Chat;
        chat.template = Some("no question slot".into());
        let err = split("{\"q\": \"x\"}", &chat).err().unwrap();
        assert!(err.to_string().contains("template"), "{err}");
    }
}
