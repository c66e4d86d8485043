//! Chat templates: the prompt format an instruct model was trained on.
//!
//! A Hugging Face checkpoint ships its format as a Jinja template
//! (`chat_template` in `tokenizer_config.json`). It is rendered here with
//! minijinja, set up as `transformers` sets up Jinja2 (`trim_blocks`,
//! `lstrip_blocks`, Python's string methods, `raise_exception`,
//! `strftime_now`), with the conversation `[system?, user]`,
//! `add_generation_prompt = true` and the model's `bos_token`/`eos_token`.
//! The rendered text is then tokenized with special tokens parsed, so
//! `<|im_start|>` becomes its one token, as the model saw in training.
//!
//! [`ChatTask`] puts a task's prompts in that format, so generation,
//! evaluation, supervised warm-up and a reward service all see the same
//! text.

use std::{path::Path, sync::Arc};

use bapo_tasks::{Problem, Task};
use minijinja::{Environment, ErrorKind, context};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("chat template: {0}")]
    Render(String),
}

/// A parsed chat template and the special tokens it refers to.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, or an
/// object with its `content`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// The template text: a string, or (newer checkpoints) a list of named
/// templates of which `default` is the chat one.
fn template_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(str::to_string))
                .flatten()
        }),
        _ => None,
    }
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Today's date in the few `strftime` forms chat templates use (Llama
/// 3.x: `%d %b %Y`); other directives are kept as written.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs.div_euclid(86_400))
}

fn strftime(format: &str, days: i64) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, m, d) = civil_from_days(days);
    format
        .replace("%d", &format!("{d:02}"))
        .replace("%b", MONTHS[(m - 1) as usize])
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
}

impl ChatTemplate {
    /// The template of a `tokenizer_config.json`'s text; `None` when it
    /// has none.
    pub fn from_config_json(text: &str, path: &str) -> Result<Option<Self>, ChatError> {
        let bad = |message: String| ChatError::Config {
            path: path.to_string(),
            message,
        };
        let config: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let Some(source) = config.get("chat_template").and_then(template_text) else {
            return Ok(None);
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source)
            .map_err(|e| bad(format!("chat_template does not parse: {e}")))?;
        Ok(Some(Self {
            env: Arc::new(env),
            bos: token_text(config.get("bos_token")),
            eos: token_text(config.get("eos_token")),
        }))
    }

    /// The template of the `tokenizer_config.json` beside a
    /// `tokenizer.json`, if there is one and it has a template.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<Self>, ChatError> {
        let path = tokenizer_json.with_file_name("tokenizer_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_config_json(&text, &path.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ChatError::Config {
                path: path.display().to_string(),
                message: e.to_string(),
            }),
        }
    }

    /// The prompt of a conversation of an optional system message and one
    /// user message, ending where the assistant's answer begins.
    pub fn render(&self, system: Option<&str>, user: &str) -> Result<String, ChatError> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(("system", s));
        }
        messages.push(("user", user));
        self.render_messages(&messages, true)
    }

    /// A conversation of `(role, content)` messages, ending where the
    /// assistant's next turn begins when `add_generation_prompt`.
    pub fn render_messages(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| context! { role => role, content => content })
            .collect();
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| ChatError::Render(format!("{e:#}")))
    }
}

/// A task whose prompts are put in a model's chat format; everything else
/// is the inner task's.
pub struct ChatTask {
    inner: Arc<dyn Task>,
    template: ChatTemplate,
    system: Option<String>,
}

impl ChatTask {
    /// Checks that the template renders before any problem is handed out.
    pub fn new(
        inner: Arc<dyn Task>,
        template: ChatTemplate,
        system: Option<String>,
    ) -> Result<Self, ChatError> {
        template.render(system.as_deref(), "1 + 1 = ?")?;
        Ok(Self {
            inner,
            template,
            system,
        })
    }

    fn wrap(&self, mut p: Problem) -> Problem {
        // Checked in `new`; a template that renders one message and fails
        // on another (raise_exception on content) keeps the raw prompt,
        // which a model can still answer.
        match self.template.render(self.system.as_deref(), &p.prompt) {
            Ok(text) => p.prompt = text,
            Err(e) => tracing_free_warn(&p.id, &e),
        }
        p
    }
}

/// policy has no logging dependency; a template failing on one problem is
/// rare enough for stderr.
fn tracing_free_warn(id: &str, e: &ChatError) {
    eprintln!("warning: problem {id}: {e}; its raw prompt is used");
}

impl Task for ChatTask {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn train_problem(&self, index: u64) -> Problem {
        self.wrap(self.inner.train_problem(index))
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        self.inner
            .eval_problems(n)
            .into_iter()
            .map(|p| self.wrap(p))
            .collect()
    }

    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        self.inner.score(problem, completion)
    }

    fn reward_range(&self) -> (f32, f32) {
        self.inner.reward_range()
    }

    fn well_formed(&self, problem: &Problem, completion: &str) -> bool {
        self.inner.well_formed(problem, completion)
    }

    fn fails_when_truncated(&self) -> bool {
        self.inner.fails_when_truncated()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = r#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
      "chat_template": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"}"#;

    fn chatml() -> ChatTemplate {
        ChatTemplate::from_config_json(CHATML, "t")
            .unwrap()
            .unwrap()
    }

    #[test]
    fn chatml_renders_the_default_system_message_or_the_given_one() {
        let t = chatml();
        assert_eq!(
            t.render(None, "2+2?").unwrap(),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(Some("Be brief."), "2+2?").unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(t.eos, "<|im_end|>");
    }

    #[test]
    fn no_template_is_none_and_a_broken_one_is_named() {
        assert!(ChatTemplate::from_config_json("{}", "t").unwrap().is_none());
        let e = ChatTemplate::from_config_json(r#"{"chat_template": "{% for %}"}"#, "cfg.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cfg.json") && e.contains("does not parse"),
            "{e}"
        );
    }

    #[test]
    fn templates_may_raise_and_call_python_string_methods() {
        let t = ChatTemplate::from_config_json(
            r#"{"chat_template": "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}[{{ messages[0].content.strip().upper() }}]"}"#,
            "t",
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.render(None, "  hi ").unwrap(), "[HI]");
        let e = t.render(Some("x"), "hi").unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(strftime("%d %b %Y", 20_415), "23 Nov 2025");
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn a_chat_task_wraps_prompts_and_keeps_the_verifier() {
        let inner: Arc<dyn Task> = Arc::from(bapo_tasks::build(&Default::default()).unwrap());
        let task = ChatTask::new(inner.clone(), chatml(), None).unwrap();
        let (raw, wrapped) = (inner.train_problem(3), task.train_problem(3));
        assert!(wrapped.prompt.starts_with("<|im_start|>system\n"));
        assert!(wrapped.prompt.contains(&raw.prompt));
        assert_eq!(wrapped.answer, raw.answer);
        assert_eq!(
            task.score(&wrapped, &raw.answer),
            inner.score(&raw, &raw.answer)
        );
        assert_eq!(task.eval_problems(2).len(), 2);
    }
}
