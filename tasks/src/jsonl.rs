//! `jsonl`: question/answer files in GSM8K's format, one JSON object a line:
//! `{"question": "...", "answer": "...reasoning...\n#### 72"}` (the field
//! names are configurable, see [`FileOptions`]).
//!
//! The reference answer is the number after `####`; the warm-up solution is
//! the reasoning with `#### 72` spelled out as `The answer is 72.` (and
//! GSM8K's calculator annotations `<<48/2=24>>` removed), so a model learns
//! to state its answer the way [`numeric::extract_final_number`] looks for.
//! The verifier compares the model's final number with the reference
//! exactly, whatever its decoration (`$1,234.00` = `1234`), and takes it from
//! `\boxed{72}`, `#### 72` or "the answer is 72" alike, so a prompt may ask
//! a chat model for either format (`instruction`).

use std::path::Path;

use super::dataset::{FileOptions, Parsed, Record, Split};
use super::numeric::{self, canonical_number};
use super::{Problem, Task, TaskError};

/// The prompt when the spec gives none (raw prompts; a chat prompt's
/// default is [`dataset::CHAT_TEMPLATE`](super::dataset::CHAT_TEMPLATE)).
pub const DEFAULT_TEMPLATE: &str = super::dataset::RAW_TEMPLATE;

/// Where the question goes in a template.
pub const QUESTION_SLOT: &str = super::dataset::QUESTION_SLOT;

/// The record fields read when the spec names none.
pub const QUESTION_FIELD: &str = "question";
pub const ANSWER_FIELD: &str = "answer";

/// A file of questions, split into training and held-out problems when
/// loaded.
#[derive(Debug, Clone)]
pub struct Jsonl {
    split: Split,
}

impl Jsonl {
    /// GSM8K's fields and the raw default template.
    pub fn default_options() -> FileOptions {
        FileOptions::new(QUESTION_FIELD, ANSWER_FIELD)
    }

    /// Loads and splits a file with the default fields. A line is held out
    /// when a hash of its question falls below `eval_fraction`, so the split
    /// depends neither on the seed nor on the order of lines, and a question
    /// that appears twice is never on both sides.
    pub fn load(
        path: &Path,
        seed: u64,
        eval_fraction: f64,
        template: &str,
    ) -> Result<Self, TaskError> {
        Self::open(path, &Self::options(seed, eval_fraction, template))
    }

    /// [`Jsonl::load`] on text already read; `path` names it in errors and
    /// problem ids.
    pub fn parse(
        text: &str,
        path: &Path,
        seed: u64,
        eval_fraction: f64,
        template: &str,
    ) -> Result<Self, TaskError> {
        Self::from_text(text, path, &Self::options(seed, eval_fraction, template))
    }

    /// Loads and splits a file as `options` say.
    pub fn open(path: &Path, options: &FileOptions) -> Result<Self, TaskError> {
        let split = Split::load(path, options, |r| parse_record(r, options))?;
        Ok(Self { split })
    }

    /// [`Jsonl::open`] on text already read.
    pub fn from_text(text: &str, path: &Path, options: &FileOptions) -> Result<Self, TaskError> {
        let split = Split::parse(text, path, options, |r| parse_record(r, options))?;
        Ok(Self { split })
    }

    fn options(seed: u64, eval_fraction: f64, template: &str) -> FileOptions {
        FileOptions {
            seed,
            eval_fraction,
            template: Some(template.to_string()),
            ..Self::default_options()
        }
    }

    /// How many problems each side of the split holds.
    pub fn split_sizes(&self) -> (usize, usize) {
        self.split.sizes()
    }
}

/// A GSM8K record: the question, and the answer's reasoning and number.
fn parse_record(record: &Record, options: &FileOptions) -> Result<Parsed, String> {
    let question = record.required_text(&options.question_field)?;
    let answer = record.required_text(&options.answer_field)?;
    let (answer, solution) = split_answer(&answer, &options.answer_field)?;
    Ok(Parsed {
        question,
        answer,
        solution,
    })
}

/// The canonical reference number and the warm-up solution of a GSM8K
/// answer (`field` names it in errors).
fn split_answer(answer: &str, field: &str) -> Result<(String, String), String> {
    let (reasoning, number) = answer
        .rsplit_once("####")
        .ok_or_else(|| format!("`{field}` has no `#### <number>`"))?;
    let canonical = canonical_number(number)
        .ok_or_else(|| format!("`####` is followed by {:?}, not a number", number.trim()))?;
    let solution = format!(
        "{}The answer is {canonical}.",
        strip_calculator_annotations(reasoning)
    );
    Ok((canonical, solution))
}

/// Removes GSM8K's `<<48/2=24>>` annotations (they are for a calculator
/// tool, not prose); an unclosed `<<` is left alone.
fn strip_calculator_annotations(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find("<<") {
        let Some(close) = rest[open..].find(">>") else {
            break;
        };
        out.push_str(&rest[..open]);
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out
}

impl Task for Jsonl {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn train_problem(&self, index: u64) -> Problem {
        self.split.train_problem(index)
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        self.split.eval_problems(n)
    }

    /// 1 when the completion's final number ([`numeric::extract_final_number`])
    /// is the reference number.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        match (
            numeric::extract_final_number(completion),
            canonical_number(&problem.answer),
        ) {
            (Some(got), Some(want)) if got == want => 1.0,
            _ => 0.0,
        }
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    /// States its answer explicitly (`\boxed{}`, `####` or "the answer is").
    fn well_formed(&self, _problem: &Problem, completion: &str) -> bool {
        numeric::explicit_final_number(completion).is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::Write;
    use std::path::PathBuf;

    use super::*;

    /// Where the shared GSM8K copy lives, relative to this crate.
    fn shared_gsm8k() -> PathBuf {
        crate::crate_dir().join("../../shared/data/gsm8k/test.jsonl")
    }

    const SAMPLE: &str = r#"{"question": "Janet has 16 eggs and eats 3. How many are left?", "answer": "16 - 3 = <<16-3=13>>13\n#### 13"}
{"question": "A house costs $80,000. Repairs cost $50,000. Total?", "answer": "80,000+50,000=$<<80000+50000=130000>>130,000\n#### 130,000"}

{"question": "It is -5 degrees and drops 3. Temperature?", "answer": "-5-3=-8\n#### -8", "extra": "ignored"}
{"question": "Half of 5?", "answer": "5/2=2.5\n#### 2.50"}
"#;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new()
            .suffix(".jsonl")
            .tempfile()
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn load(text: &str, eval_fraction: f64) -> Result<Jsonl, TaskError> {
        let f = write(text);
        Jsonl::load(f.path(), 0, eval_fraction, DEFAULT_TEMPLATE)
    }

    #[test]
    fn loads_a_small_file() {
        let task = load(SAMPLE, 0.0).unwrap();
        assert_eq!(task.split_sizes(), (4, 0));
        let mut problems: Vec<_> = (0..4).map(|i| task.train_problem(i)).collect();
        assert_eq!(task.train_problem(4), problems[0], "indices wrap around");
        problems.sort_by(|a, b| a.prompt.cmp(&b.prompt));
        let houses = &problems[0];
        assert_eq!(
            houses.prompt,
            "Question: A house costs $80,000. Repairs cost $50,000. Total?\nAnswer:"
        );
        assert_eq!(houses.answer, "130000");
        assert_eq!(
            houses.solution,
            " 80,000+50,000=$130,000\nThe answer is 130000."
        );
        assert!(houses.id.ends_with(":2"), "{}", houses.id);
        let answers: HashSet<_> = problems.iter().map(|p| p.answer.as_str()).collect();
        assert_eq!(answers, HashSet::from(["13", "130000", "-8", "2.5"]));
        for p in &problems {
            assert_eq!(task.score(p, &p.solution), 1.0, "{p:?}");
            assert!(task.well_formed(p, &p.solution));
            assert!(!p.solution.contains("<<") && !p.solution.contains("####"));
        }
    }

    #[test]
    fn template_and_seed() {
        let f = write(SAMPLE);
        let t = Jsonl::load(f.path(), 0, 0.0, "Q: {question} A: ").unwrap();
        let p = t.train_problem(0);
        assert!(p.prompt.starts_with("Q: ") && p.prompt.ends_with(" A: "));
        assert!(!p.solution.starts_with(' '), "no doubled space");
        let order = |seed| {
            let t = Jsonl::load(f.path(), seed, 0.0, DEFAULT_TEMPLATE).unwrap();
            (0..4).map(|i| t.train_problem(i).id).collect::<Vec<_>>()
        };
        assert_eq!(order(1), order(1));
        assert!((0..20).any(|s| order(s) != order(0)), "the seed shuffles");

        let err = Jsonl::load(f.path(), 0, 0.0, "no question slot").unwrap_err();
        assert!(err.to_string().contains("template"), "{err}");
        for bad in [1.0, -0.1, f64::NAN] {
            let err = Jsonl::load(f.path(), 0, bad, DEFAULT_TEMPLATE).unwrap_err();
            assert!(err.to_string().contains("eval_fraction"), "{err}");
        }
    }

    #[test]
    fn bad_files_name_path_and_line() {
        let good = "{\"question\": \"q\", \"answer\": \"#### 1\"}";
        let cases = [
            (format!("{good}\n{{not json\n"), 2, "key must be a string"),
            (
                format!("{good}\n\n{{\"question\": \"q\"}}\n"),
                3,
                "missing field `answer`",
            ),
            (
                format!("{{\"answer\": \"#### 1\"}}\n{good}\n"),
                1,
                "missing field `question`",
            ),
            (
                format!("{good}\n{{\"question\": \"q\", \"answer\": \"no marker\"}}"),
                2,
                "####",
            ),
            (
                format!("{good}\n{{\"question\": \"q\", \"answer\": \"#### many\"}}"),
                2,
                "\"many\"",
            ),
            (
                format!("{good}\n{{\"question\": 3, \"answer\": \"#### 1\"}}"),
                2,
                "invalid type",
            ),
            (format!("{good}\n[1, 2]"), 2, "invalid type"),
        ];
        for (text, line, needle) in cases {
            let f = write(&text);
            let err = Jsonl::load(f.path(), 0, 0.0, DEFAULT_TEMPLATE).unwrap_err();
            let msg = err.to_string();
            let at = format!("{}:{line}: ", f.path().display());
            assert!(msg.starts_with(&at), "{msg:?} should start with {at:?}");
            assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
            assert!(!msg.contains("at line 1"), "{msg:?}");
        }

        let missing = Path::new("/nonexistent/gsm8k.jsonl");
        let err = Jsonl::load(missing, 0, 0.1, DEFAULT_TEMPLATE).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/gsm8k.jsonl"),
            "{err}"
        );

        let empty = write("\n  \n");
        let err = Jsonl::load(empty.path(), 0, 0.1, DEFAULT_TEMPLATE).unwrap_err();
        assert!(err.to_string().contains("no training problems"), "{err}");

        let not_utf8 = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(not_utf8.path(), [0xff, 0xfe, b'\n']).unwrap();
        assert!(Jsonl::load(not_utf8.path(), 0, 0.1, DEFAULT_TEMPLATE).is_err());
    }

    #[test]
    fn split_is_by_question_and_disjoint() {
        let lines: Vec<String> = (0..2000)
            .map(|i| {
                format!(
                    "{{\"question\": \"What is {i} plus one?\", \"answer\": \"#### {}\"}}",
                    i + 1
                )
            })
            .collect();
        let text = lines.join("\n");
        let f = write(&text);
        let task = Jsonl::load(f.path(), 3, 0.1, DEFAULT_TEMPLATE).unwrap();
        let (train, eval) = task.split_sizes();
        assert_eq!(train + eval, 2000);
        assert!((140..260).contains(&eval), "{eval} held out");

        let held: HashSet<String> = task
            .eval_problems(usize::MAX)
            .into_iter()
            .map(|p| p.prompt)
            .collect();
        assert_eq!(held.len(), eval);
        for i in 0..2000 {
            assert!(!held.contains(&task.train_problem(i).prompt));
        }
        assert_eq!(task.eval_problems(5).len(), 5);

        // Reordered lines and another seed hold out the same questions.
        let reversed: Vec<_> = lines.iter().rev().cloned().collect();
        let g = write(&reversed.join("\n"));
        let other = Jsonl::load(g.path(), 9, 0.1, DEFAULT_TEMPLATE).unwrap();
        let held_other: HashSet<String> = other
            .eval_problems(usize::MAX)
            .into_iter()
            .map(|p| p.prompt)
            .collect();
        assert_eq!(held, held_other);
    }

    #[test]
    fn scores_answers_however_they_are_written() {
        let task = load(SAMPLE, 0.0).unwrap();
        let p = |answer: &str| Problem {
            id: "t".into(),
            prompt: "Question: ?\nAnswer:".into(),
            answer: answer.into(),
            solution: String::new(),
        };
        let cases = [
            ("130000", "The answer is 130000.", 1.0),
            ("130000", "So the total is $130,000.", 1.0),
            ("130000", "\\boxed{130,000}", 1.0),
            ("130000", "#### 130000", 1.0),
            ("130000", "130000.00 dollars", 1.0),
            ("130000", "130,000 then 5", 0.0),
            ("130000", "The answer is 130000. Actually 5", 1.0),
            ("-8", "It is -8 degrees.", 1.0),
            ("-8", "It is 8 degrees.", 0.0),
            ("2.5", "2.50", 1.0),
            ("2.5", "5/2", 0.0),
            ("72", "", 0.0),
            ("72", "日本語 🎉", 0.0),
            ("72", "\\boxed{72", 1.0),
            ("72", "}}{{\\boxed{}}", 0.0),
            ("72", &"7".repeat(1000), 0.0),
            ("72", &"(".repeat(10_000), 0.0),
            ("banana", "banana", 0.0),
        ];
        for (answer, completion, want) in cases {
            assert_eq!(
                task.score(&p(answer), completion),
                want,
                "{answer} / {completion:?}"
            );
        }
        assert!(task.well_formed(&p("1"), "so the answer is 3"));
        assert!(!task.well_formed(&p("1"), "3"));
    }

    #[test]
    fn field_names_and_instruction_are_configurable() {
        let text = "{\"prompt\": \"Two plus two?\", \"target\": \"2+2=4\\n#### 4\"}\n";
        let options = FileOptions {
            eval_fraction: 0.0,
            question_field: "prompt".into(),
            answer_field: "target".into(),
            instruction: Some("Put the final answer after ####.".into()),
            ..Jsonl::default_options()
        };
        let task = Jsonl::from_text(text, Path::new("g.jsonl"), &options).unwrap();
        let p = task.train_problem(0);
        assert_eq!(
            p.prompt,
            "Question: Two plus two?\nPut the final answer after ####.\nAnswer:"
        );
        assert_eq!(
            (p.answer.as_str(), p.solution.as_str()),
            ("4", " 2+2=4\nThe answer is 4.")
        );
        for completion in ["#### 4", "\\boxed{4}", "so \\boxed{4}.\n#### 4"] {
            assert_eq!(task.score(&p, completion), 1.0, "{completion:?}");
            assert!(task.well_formed(&p, completion));
        }
        // The default fields are not read any more, and errors name the new ones.
        let err = Jsonl::from_text(
            "{\"question\": \"q\", \"answer\": \"#### 1\"}",
            Path::new("g.jsonl"),
            &options,
        )
        .unwrap_err();
        assert!(err.to_string().contains("missing field `prompt`"), "{err}");
        let err = Jsonl::from_text(
            "{\"prompt\": \"q\", \"target\": \"1\"}",
            Path::new("g.jsonl"),
            &options,
        )
        .unwrap_err();
        assert!(err.to_string().contains("`target` has no `####"), "{err}");
    }

    #[test]
    fn annotations_are_stripped() {
        assert_eq!(
            strip_calculator_annotations("a <<1+1=2>>2 b <<x>>"),
            "a 2 b "
        );
        assert_eq!(strip_calculator_annotations("a << b"), "a << b");
        assert_eq!(strip_calculator_annotations("<<>><<"), "<<");
        assert_eq!(strip_calculator_annotations("日<<本>>語"), "日語");
    }

    #[test]
    fn real_gsm8k_if_present() {
        let path = shared_gsm8k();
        if !path.exists() {
            eprintln!("skipping: no GSM8K copy at {}", path.display());
            return;
        }
        let task = Jsonl::load(&path, 0, 0.1, DEFAULT_TEMPLATE).unwrap();
        let (train, eval) = task.split_sizes();
        assert!(train + eval > 1000, "{train} + {eval}");
        assert!(eval > 0 && eval < (train + eval) / 5, "{eval} held out");
        let eval = task.eval_problems(usize::MAX);
        let train: Vec<_> = (0..train as u64).map(|i| task.train_problem(i)).collect();
        let held: HashSet<_> = eval.iter().map(|p| &p.prompt).collect();
        for p in train.iter().chain(&eval) {
            assert_eq!(task.score(p, &p.solution), 1.0, "{p:?}");
            assert!(task.well_formed(p, &p.solution));
            assert!(
                p.solution
                    .ends_with(&format!("The answer is {}.", p.answer))
            );
            assert!(!p.solution.contains("<<"), "{p:?}");
            assert!(canonical_number(&p.answer).as_deref() == Some(p.answer.as_str()));
        }
        assert!(train.iter().all(|p| !held.contains(&p.prompt)));
        let janet = train
            .iter()
            .chain(&eval)
            .find(|p| p.prompt.contains("Janet\u{2019}s ducks"))
            .expect("the first GSM8K test question");
        assert_eq!(janet.answer, "18");
    }
}
