//! Tasks and their verifiers: where the problems come from and how a
//! completion is rewarded.
//!
//! A task hands out an endless, seeded stream of training problems and a
//! fixed held-out evaluation set, and scores completions. Each task is one
//! file: `arith` (tiny arithmetic the built-in model can learn on a CPU),
//! `countdown` (reach a target with given numbers; checked by the exact
//! expression evaluator in `expr.rs`), `jsonl` (GSM8K-format
//! question/answer files; the final number is found by `numeric.rs`) and
//! `math` (MATH-style problems whose answer is the last `\boxed{}`,
//! normalised and compared by `latex.rs`); `countdown-trace` is countdown
//! answered after a short search trace, so that failures run long
//! (`trace.rs`). The two file tasks share their
//! reading, prompting and splitting in `dataset.rs`. `shaping.rs` adds the
//! optional format bonus and overlong penalty on top of a task's reward.
//!
//! A task is text in, reward out: this crate knows nothing of models or
//! tensors, so a verifier edit rebuilds no kernels, and anything that scores
//! text (a reward service, the buffer) can use it without Burn. That holds
//! for chat models too: [`TaskSpec`] records the prompt format and system
//! prompt, and the policy renders the chat template around a problem's
//! prompt (its user message).
//!
//! The held-out split of every task is a keyed hash of the problem itself,
//! never of the task seed: changing the seed reshuffles training but can
//! never move an evaluation problem into training.

pub mod arith;
pub mod countdown;
pub mod dataset;
pub mod expr;
mod generated;
pub mod jsonl;
pub mod latex;
pub mod math;
pub mod numeric;
pub mod shaping;
pub mod split;
pub mod tool;
pub mod trace;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use arith::Arith;
pub use countdown::Countdown;
pub use dataset::FileOptions;
pub use jsonl::Jsonl;
pub use math::Math;
pub use shaping::{Overlong, Shaping};
pub use split::Split;
pub use tool::ArithTool;
pub use trace::CountdownTrace;

/// One problem: the prompt text the model sees, the reference answer the
/// verifier checks, and a worked solution text that supervised warm-up
/// trains on (the completion, WITHOUT any end-of-sequence token).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    pub id: String,
    pub prompt: String,
    pub answer: String,
    pub solution: String,
}

/// A source of problems and the verifier of their completions. Shared by
/// the actors' generation threads, hence `Send + Sync` and `&self` only.
pub trait Task: Send + Sync {
    fn name(&self) -> &str;

    /// Training problem number `index`: deterministic given the task's seed;
    /// never one of the held-out problems.
    fn train_problem(&self, index: u64) -> Problem;

    /// The first `n` held-out evaluation problems (deterministic, disjoint
    /// from every train_problem). May return fewer if the split is smaller.
    fn eval_problems(&self, n: usize) -> Vec<Problem>;

    /// Reward of a completion (the decoded response text, stop token already
    /// removed). Never panics on any input. Within reward_range().
    fn score(&self, problem: &Problem, completion: &str) -> f32;

    fn reward_range(&self) -> (f32, f32);

    /// Whether a completion has the shape the task asks for, right or wrong
    /// (an integer for `arith`, a parsable expression for `countdown`, an
    /// explicitly stated final answer for `jsonl`, a non-empty `\boxed{}`
    /// for `math`). This is the check behind
    /// [`Shaping::format_bonus`]; the default grants no bonus.
    fn well_formed(&self, _problem: &Problem, _completion: &str) -> bool {
        false
    }

    /// Whether a response cut off by the token cap is wrong whatever its
    /// text (a task whose answers must conclude, such as
    /// `countdown-trace`). Default: the text alone decides.
    fn fails_when_truncated(&self) -> bool {
        false
    }

    /// [`Task::score`] of a response, `truncated` when the token cap
    /// rather than a stop token ended it: the one entry point of every
    /// scorer that knows how a response ended.
    fn score_response(&self, problem: &Problem, completion: &str, truncated: bool) -> f32 {
        if truncated && self.fails_when_truncated() {
            0.0
        } else {
            self.score(problem, completion)
        }
    }
}

/// Which task to build, as it appears in a config file (`[task]` in TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TaskSpec {
    /// One of [`NAMES`]: "arith" (default), "arith-tool", "countdown", "countdown-trace",
    /// "jsonl" or "math".
    pub name: String,
    /// Seed of the training stream (default 0). The held-out split does not
    /// depend on it.
    pub seed: u64,
    /// Level of the generated tasks, 1 and up (default 1).
    pub difficulty: u32,
    /// The JSONL file of the "jsonl" and "math" tasks (required there).
    pub path: Option<PathBuf>,
    /// jsonl/math: the fraction of lines held out for evaluation (default
    /// 0.1), chosen by hashing the question so that it survives reordering.
    pub eval_fraction: f64,
    /// jsonl/math: the prompt, with "{question}" where the question goes
    /// (default "Question: {question}\nAnswer:" raw, "{question}" chat).
    pub template: Option<String>,
    /// jsonl/math: text put on its own line after the question, such as
    /// "Put the final answer after ####." (default none).
    pub instruction: Option<String>,
    /// jsonl/math: the line's field holding the question (default
    /// "question" for jsonl, "problem" for math).
    pub question_field: Option<String>,
    /// jsonl/math: the line's field holding the answer (default "answer").
    pub answer_field: Option<String>,
    /// math: the line's field holding a worked solution for the warm start
    /// (default "solution"; a line without one gets `\boxed{answer}`).
    pub solution_field: Option<String>,
    /// Whether the prompt is the model's raw text or a chat's user message
    /// that the policy wraps in the model's chat template (default raw).
    pub prompt_format: PromptFormat,
    /// chat: the system message the policy puts before the user message
    /// (default none); refused with a raw prompt, which has nowhere for it.
    pub system_prompt: Option<String>,
}

impl Default for TaskSpec {
    fn default() -> Self {
        Self {
            name: "arith".to_string(),
            seed: 0,
            difficulty: 1,
            path: None,
            eval_fraction: 0.1,
            template: None,
            instruction: None,
            question_field: None,
            answer_field: None,
            solution_field: None,
            prompt_format: PromptFormat::Raw,
            system_prompt: None,
        }
    }
}

/// How the policy presents a problem's prompt to the model. The task only
/// records it (and picks its default template and warm-up solutions to
/// suit); rendering a chat template is the policy's job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptFormat {
    /// The prompt is the model's input text as it stands, and the
    /// completion continues it (base models, the built-in model).
    #[default]
    Raw,
    /// The prompt is the user message of a conversation, rendered with the
    /// model's chat template after `system_prompt` if there is one; the
    /// completion is the assistant's message.
    Chat,
}

impl TaskSpec {
    /// Rejects settings that would be silently ignored: a system prompt
    /// without a chat, and a file task's settings on a generated task.
    pub fn validate(&self) -> Result<(), TaskError> {
        if !NAMES.contains(&self.name.as_str()) {
            return Err(TaskError::UnknownTask {
                name: self.name.clone(),
            });
        }
        if self.system_prompt.is_some() && self.prompt_format == PromptFormat::Raw {
            return Err(TaskError::InvalidSpec {
                field: "system_prompt",
                reason: "needs prompt_format = \"chat\" (a raw prompt has no system message)"
                    .to_string(),
            });
        }
        let file_task = matches!(self.name.as_str(), "jsonl" | "math");
        let unread = [
            ("instruction", self.instruction.is_some() && !file_task),
            (
                "question_field",
                self.question_field.is_some() && !file_task,
            ),
            ("answer_field", self.answer_field.is_some() && !file_task),
            (
                "solution_field",
                self.solution_field.is_some() && self.name != "math",
            ),
        ];
        match unread.iter().find(|(_, unread)| *unread) {
            Some(&(field, _)) => Err(TaskError::InvalidSpec {
                field,
                reason: format!("the {} task does not read it", self.name),
            }),
            None => Ok(()),
        }
    }

    /// A file task's options: `defaults` (the task's own) with what this
    /// spec sets on top.
    fn file_options(&self, defaults: FileOptions) -> FileOptions {
        FileOptions {
            seed: self.seed,
            eval_fraction: self.eval_fraction,
            template: self.template.clone(),
            instruction: self.instruction.clone(),
            format: self.prompt_format,
            question_field: self
                .question_field
                .clone()
                .unwrap_or(defaults.question_field),
            answer_field: self.answer_field.clone().unwrap_or(defaults.answer_field),
            solution_field: self.solution_field.clone().or(defaults.solution_field),
        }
    }

    /// The file of a file task.
    fn file_path(&self) -> Result<&std::path::Path, TaskError> {
        self.path.as_deref().ok_or_else(|| TaskError::InvalidSpec {
            field: "path",
            reason: format!("the {} task needs the path of its file", self.name),
        })
    }
}

/// Why a task could not be built. Every variant names what was wrong and
/// where: the spec field, or the file and line.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("unknown task {name:?} (known: {})", NAMES.join(", "))]
    UnknownTask { name: String },
    #[error("task spec field `{field}`: {reason}")]
    InvalidSpec { field: &'static str, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    BadLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    BadFile { path: PathBuf, message: String },
}

/// Names [`build`] accepts.
pub const NAMES: &[&str] = &[
    "arith",
    "arith-tool",
    "countdown",
    "countdown-trace",
    "jsonl",
    "math",
];

/// Builds the task a spec names, checking the spec first.
pub fn build(spec: &TaskSpec) -> Result<Box<dyn Task>, TaskError> {
    spec.validate()?;
    match spec.name.as_str() {
        "arith" => Ok(Box::new(Arith::new(spec.seed, spec.difficulty)?)),
        "arith-tool" => Ok(Box::new(ArithTool::new(spec.seed, spec.difficulty)?)),
        "countdown" => Ok(Box::new(Countdown::new(spec.seed, spec.difficulty)?)),
        "countdown-trace" => Ok(Box::new(CountdownTrace::new(spec.seed, spec.difficulty)?)),
        "jsonl" => {
            let options = spec.file_options(Jsonl::default_options());
            Ok(Box::new(Jsonl::open(spec.file_path()?, &options)?))
        }
        "math" => {
            let options = spec.file_options(Math::default_options());
            Ok(Box::new(Math::open(spec.file_path()?, &options)?))
        }
        other => Err(TaskError::UnknownTask {
            name: other.to_string(),
        }),
    }
}

/// A hash that is the same on every platform, Rust version and run (unlike
/// `std`'s `DefaultHasher`), so held-out splits and seeds never drift.
/// splitmix64's finaliser over each word, chained from a per-use key.
#[derive(Debug, Clone)]
pub(crate) struct StableHasher(u64);

impl StableHasher {
    pub(crate) fn new(key: u64) -> Self {
        Self(splitmix64(key))
    }

    pub(crate) fn word(mut self, x: u64) -> Self {
        self.0 = splitmix64(self.0 ^ x);
        self
    }

    pub(crate) fn bytes(mut self, bytes: &[u8]) -> Self {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self = self.word(u64::from_le_bytes(word));
        }
        // The length keeps "a\0" and "a" apart.
        self.word(bytes.len() as u64)
    }

    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Checks a generated task's level.
pub(crate) fn check_difficulty(difficulty: u32, max: u32) -> Result<(), TaskError> {
    if (1..=max).contains(&difficulty) {
        Ok(())
    } else {
        Err(TaskError::InvalidSpec {
            field: "difficulty",
            reason: format!("{difficulty} is outside 1..={max}"),
        })
    }
}

/// This crate's directory, for tests that read files beside it. Taken at run
/// time (cargo sets it for tests): the compile-time value goes stale when a
/// shared target dir built the same sources in another checkout.
#[cfg(test)]
pub(crate) fn crate_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        std::path::PathBuf::from,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_spec_builds_arith_level_one() {
        let spec = TaskSpec::default();
        assert_eq!(spec.name, "arith");
        assert_eq!(spec.difficulty, 1);
        assert_eq!(spec.eval_fraction, 0.1);
        let task = build(&spec).expect("default builds");
        assert_eq!(task.name(), "arith");
    }

    #[test]
    fn spec_reads_from_toml_and_rejects_unknown_fields() {
        let spec: TaskSpec = toml::from_str("name = \"countdown\"\ndifficulty = 2\n").unwrap();
        assert_eq!(spec.name, "countdown");
        assert_eq!(spec.difficulty, 2);
        assert_eq!(spec.seed, 0);
        assert!(toml::from_str::<TaskSpec>("nmae = \"arith\"").is_err());
    }

    #[test]
    fn every_name_builds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.jsonl");
        std::fs::write(
            &path,
            // Both tasks' question fields, so jsonl and math read one file.
            "{\"question\": \"1+1?\", \"problem\": \"1+1?\", \"answer\": \"1+1=2\\n#### 2\"}\n",
        )
        .unwrap();
        for name in NAMES {
            let spec = TaskSpec {
                name: name.to_string(),
                path: Some(path.clone()),
                eval_fraction: 0.0,
                ..TaskSpec::default()
            };
            let task = build(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(task.name(), *name);
        }
    }

    #[test]
    fn bad_specs_are_named() {
        let err = build(&TaskSpec {
            name: "chess".into(),
            ..TaskSpec::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("chess"), "{err}");

        let err = build(&TaskSpec {
            name: "jsonl".into(),
            ..TaskSpec::default()
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("path"), "{err}");

        for name in ["arith", "countdown"] {
            let err = build(&TaskSpec {
                name: name.into(),
                difficulty: 0,
                ..TaskSpec::default()
            })
            .err()
            .unwrap();
            assert!(err.to_string().contains("difficulty"), "{err}");
        }
    }

    /// Random text made of the pieces verifiers look at: no verifier may
    /// panic or leave its reward range on any of it.
    #[test]
    fn verifiers_never_panic_on_random_text() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};

        const PIECES: &[&str] = &[
            "0",
            "1",
            "7",
            "9",
            "00",
            "+",
            "-",
            "*",
            "/",
            "(",
            ")",
            "{",
            "}",
            "=",
            " ",
            "\n",
            ".",
            ",",
            "$",
            "%",
            "\\boxed{",
            "####",
            "answer is",
            "Answer:",
            "\u{2212}",
            "日",
            "🎉",
            "\u{0}",
            "x",
            "e",
            "\\fbox{",
            "\\boxed ",
            "\\frac",
            "\\sqrt",
            "\\text{",
            "\\left(",
            "^\\circ",
            "\\{",
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"question\": \"q\", \"problem\": \"q\", \"answer\": \"#### 1\"}\n",
        )
        .unwrap();
        let tasks: Vec<Box<dyn Task>> = NAMES
            .iter()
            .map(|name| {
                build(&TaskSpec {
                    name: name.to_string(),
                    path: Some(path.clone()),
                    eval_fraction: 0.0,
                    ..TaskSpec::default()
                })
                .unwrap()
            })
            .collect();
        let problems: Vec<Problem> = tasks.iter().map(|t| t.train_problem(0)).collect();
        let mut rng = SmallRng::seed_from_u64(0);
        for _ in 0..20_000 {
            let len = rng.random_range(0..40);
            let text: String = (0..len)
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect();
            let _ = numeric::extract_final_number(&text);
            let _ = numeric::canonical_number(&text);
            for (task, problem) in tasks.iter().zip(&problems) {
                let (lo, hi) = task.reward_range();
                let r = task.score(problem, &text);
                assert!((lo..=hi).contains(&r), "{}: {text:?} -> {r}", task.name());
                let _ = task.well_formed(problem, &text);
            }
        }
    }

    #[test]
    fn prompt_fields_read_from_toml() {
        let spec: TaskSpec = toml::from_str(
            "name = \"math\"\npath = \"m.jsonl\"\nprompt_format = \"chat\"\n\
             system_prompt = \"You are careful.\"\ninstruction = \"Box it.\"\n\
             question_field = \"q\"\nanswer_field = \"a\"\nsolution_field = \"s\"\n",
        )
        .unwrap();
        assert_eq!(spec.prompt_format, PromptFormat::Chat);
        assert_eq!(spec.system_prompt.as_deref(), Some("You are careful."));
        assert_eq!(spec.instruction.as_deref(), Some("Box it."));
        spec.validate().unwrap();
        let options = spec.file_options(Math::default_options());
        assert_eq!(
            (
                options.question_field.as_str(),
                options.answer_field.as_str(),
                options.solution_field.as_deref()
            ),
            ("q", "a", Some("s"))
        );
        assert_eq!(TaskSpec::default().prompt_format, PromptFormat::Raw);
        assert!(toml::from_str::<TaskSpec>("prompt_format = \"html\"").is_err());
        let defaults = TaskSpec {
            name: "math".into(),
            ..TaskSpec::default()
        }
        .file_options(Math::default_options());
        assert_eq!(defaults.question_field, "problem");
        assert_eq!(defaults.solution_field.as_deref(), Some("solution"));
        assert_eq!(defaults.template(), jsonl::DEFAULT_TEMPLATE);
    }

    #[test]
    fn settings_nothing_reads_are_refused_by_name() {
        let refused = |spec: TaskSpec, field: &str| {
            let err = build(&spec).err().expect("refused").to_string();
            assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
        };
        refused(
            TaskSpec {
                system_prompt: Some("Be brief.".into()),
                ..TaskSpec::default()
            },
            "system_prompt",
        );
        for name in ["arith", "countdown"] {
            let spec = || TaskSpec {
                name: name.into(),
                ..TaskSpec::default()
            };
            let instruction = Some("Think.".to_string());
            let field = Some("q".to_string());
            refused(
                TaskSpec {
                    instruction,
                    ..spec()
                },
                "instruction",
            );
            refused(
                TaskSpec {
                    question_field: field.clone(),
                    ..spec()
                },
                "question_field",
            );
            refused(
                TaskSpec {
                    answer_field: field.clone(),
                    ..spec()
                },
                "answer_field",
            );
            refused(
                TaskSpec {
                    solution_field: field,
                    ..spec()
                },
                "solution_field",
            );
        }
        refused(
            TaskSpec {
                name: "jsonl".into(),
                solution_field: Some("s".into()),
                ..TaskSpec::default()
            },
            "solution_field",
        );
        refused(
            TaskSpec {
                name: "math".into(),
                ..TaskSpec::default()
            },
            "path",
        );
        // A chat with a system prompt is fine, on any task.
        let chat = TaskSpec {
            prompt_format: PromptFormat::Chat,
            system_prompt: Some("Be brief.".into()),
            ..TaskSpec::default()
        };
        assert_eq!(build(&chat).unwrap().name(), "arith");
    }

    #[test]
    fn gsm8k_in_chat_form() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.jsonl");
        std::fs::write(
            &path,
            "{\"q\": \"Janet has 3 eggs and buys 2. How many?\", \"a\": \"3+2=5\\n#### 5\"}\n",
        )
        .unwrap();
        let task = build(&TaskSpec {
            name: "jsonl".into(),
            path: Some(path),
            eval_fraction: 0.0,
            question_field: Some("q".into()),
            answer_field: Some("a".into()),
            instruction: Some("Put the final answer in \\boxed{}.".into()),
            prompt_format: PromptFormat::Chat,
            system_prompt: Some("You are a careful solver.".into()),
            ..TaskSpec::default()
        })
        .unwrap();
        let p = task.train_problem(0);
        assert_eq!(
            p.prompt,
            "Janet has 3 eggs and buys 2. How many?\nPut the final answer in \\boxed{}."
        );
        assert_eq!(p.solution, "3+2=5\nThe answer is 5.");
        for (completion, reward) in [
            ("3 + 2 = 5, so \\boxed{5}", 1.0),
            ("3 + 2 = 5\n#### 5", 1.0),
            ("\\boxed{5.00}", 1.0),
            ("\\boxed{6}", 0.0),
        ] {
            assert_eq!(task.score(&p, completion), reward, "{completion:?}");
        }
    }

    #[test]
    fn stable_hash_is_pinned() {
        // A change here silently reshuffles every held-out split.
        let h = StableHasher::new(1).word(2).bytes(b"three").finish();
        assert_eq!(h, StableHasher::new(1).word(2).bytes(b"three").finish());
        assert_ne!(h, StableHasher::new(1).word(2).bytes(b"three\0").finish());
        assert_ne!(h, StableHasher::new(2).word(2).bytes(b"three").finish());
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }
}
