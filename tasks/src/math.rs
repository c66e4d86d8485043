//! `math`: competition problems in the MATH data set's style, one JSON
//! object a line: `{"problem": "...", "answer": "\\frac{1}{2}", "solution":
//! "... $\\boxed{\\frac{1}{2}}$."}` (MATH-500's layout; the field names are
//! configurable, see [`FileOptions`]).
//!
//! The model states its answer in a `\boxed{}`, and the verifier compares
//! the last one with the reference after normalising both
//! ([`latex::answers_match`]): `0.5` = `\frac12` = `1/2`, `x = 3` = `3`,
//! `5\text{ cm}` = `5`, `(1, 2)` = `(1,2)`. A file without an answer field
//! (the original MATH release) takes the reference from the solution's last
//! box.
//!
//! The warm-up solution is the line's solution when its last box states the
//! answer, else the solution with the box added, else `\boxed{answer}`
//! alone; every problem's own solution earns the full reward (checked when
//! loading), so warm-up never teaches a form the verifier refuses.

use std::path::Path;

use super::dataset::{FileOptions, Parsed, Record, Split};
use super::latex::{self, last_boxed};
use super::{Problem, Task, TaskError};

/// The record fields read when the spec names none.
pub const QUESTION_FIELD: &str = "problem";
pub const ANSWER_FIELD: &str = "answer";
pub const SOLUTION_FIELD: &str = "solution";

/// A file of problems, split into training and held-out problems when
/// loaded (by a hash of the problem text, as in [`super::Jsonl`]).
#[derive(Debug, Clone)]
pub struct Math {
    split: Split,
}

impl Math {
    /// MATH's fields and the raw default template.
    pub fn default_options() -> FileOptions {
        FileOptions {
            solution_field: Some(SOLUTION_FIELD.to_string()),
            ..FileOptions::new(QUESTION_FIELD, ANSWER_FIELD)
        }
    }

    /// Loads and splits a file as `options` say.
    pub fn open(path: &Path, options: &FileOptions) -> Result<Self, TaskError> {
        let split = Split::load(path, options, |r| parse_record(r, options))?;
        Ok(Self { split })
    }

    /// [`Math::open`] on text already read; `path` names it in errors and
    /// problem ids.
    pub fn from_text(text: &str, path: &Path, options: &FileOptions) -> Result<Self, TaskError> {
        let split = Split::parse(text, path, options, |r| parse_record(r, options))?;
        Ok(Self { split })
    }

    /// How many problems each side of the split holds.
    pub fn split_sizes(&self) -> (usize, usize) {
        self.split.sizes()
    }
}

fn parse_record(record: &Record, options: &FileOptions) -> Result<Parsed, String> {
    let question = record.required_text(&options.question_field)?;
    let solution = match &options.solution_field {
        Some(field) => record.text(field)?,
        None => None,
    };
    let answer = reference(record, &options.answer_field, solution.as_deref())?;
    let solution = warm_up_solution(solution, &answer)?;
    Ok(Parsed {
        question,
        answer,
        solution,
    })
}

/// The reference answer: the answer field (a number's text for a number,
/// the content of a `\boxed{}` in it), or else the last box of the
/// solution. It must say something once normalised, or no completion could
/// ever match it.
fn reference(record: &Record, field: &str, solution: Option<&str>) -> Result<String, String> {
    let raw = match record.text_or_number(field)? {
        Some(answer) => answer,
        None => solution
            .and_then(last_boxed)
            .map(str::to_string)
            .ok_or_else(|| {
                format!(
                    "missing field `{field}` (and no \\boxed{{}} in a solution to take it from)"
                )
            })?,
    };
    let answer = last_boxed(&raw).unwrap_or(&raw).trim().to_string();
    match latex::normalize(&answer) {
        Some(normal) if !normal.is_empty() => Ok(answer),
        Some(_) => Err(format!("`{field}` {raw:?} says nothing once normalised")),
        None => Err(format!(
            "`{field}` is longer than {} bytes",
            latex::MAX_ANSWER_LEN
        )),
    }
}

/// The warm-up completion for a reference answer (see the module doc),
/// refused when even `\boxed{answer}` would not verify (unbalanced braces).
fn warm_up_solution(solution: Option<String>, answer: &str) -> Result<String, String> {
    let states_answer =
        |text: &str| last_boxed(text).is_some_and(|b| latex::answers_match(b, answer));
    let boxed = format!("\\boxed{{{answer}}}");
    let text = match solution {
        Some(s) if states_answer(&s) => s,
        Some(s) if !s.trim().is_empty() => format!("{}\n{boxed}", s.trim_end()),
        _ => boxed,
    };
    if states_answer(&text) {
        Ok(text)
    } else {
        Err(format!(
            "the answer {answer:?} cannot be stated in a \\boxed{{}} (unbalanced braces?)"
        ))
    }
}

impl Task for Math {
    fn name(&self) -> &str {
        "math"
    }

    fn train_problem(&self, index: u64) -> Problem {
        self.split.train_problem(index)
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        self.split.eval_problems(n)
    }

    /// 1 when the last `\boxed{}` of the completion states the reference
    /// answer ([`latex::answers_match`]), else 0.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        match last_boxed(completion) {
            Some(got) if latex::answers_match(got, &problem.answer) => 1.0,
            _ => 0.0,
        }
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    /// Ends with a closed, non-empty `\boxed{}`, right or wrong. An empty box
    /// does not count: a format bonus for it would pay for boxing nothing.
    fn well_formed(&self, _problem: &Problem, completion: &str) -> bool {
        last_boxed(completion).is_some_and(|b| !b.trim().is_empty())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;

    use super::*;
    use crate::PromptFormat;

    const SAMPLE: &str = r#"{"problem": "What is $\\frac{2}{4}$ in lowest terms?", "answer": "\\frac{1}{2}", "solution": "Divide by 2: $\\boxed{\\frac12}$."}
{"problem": "Solve $x + 1 = 4$.", "answer": "3"}
{"problem": "How long is the side, in cm?", "answer": "5\\text{ cm}", "solution": "It is 5 cm."}

{"problem": "Give the pair.", "answer": "\\boxed{(1, 2)}", "solution": null, "level": "Level 1"}
{"problem": "Integer answer stored as a number.", "answer": 42}
{"problem": "MATH without an answer field.", "solution": "So it is $\\boxed{7}$."}
"#;

    fn options() -> FileOptions {
        FileOptions {
            eval_fraction: 0.0,
            ..Math::default_options()
        }
    }

    fn parse(text: &str, options: &FileOptions) -> Result<Math, TaskError> {
        Math::from_text(text, Path::new("/data/math.jsonl"), options)
    }

    fn problem(answer: &str) -> Problem {
        Problem {
            id: "t".into(),
            prompt: "Problem?".into(),
            answer: answer.into(),
            solution: String::new(),
        }
    }

    fn all(task: &Math) -> Vec<Problem> {
        let (train, _) = task.split_sizes();
        (0..train as u64).map(|i| task.train_problem(i)).collect()
    }

    #[test]
    fn loads_references_and_solutions() {
        let task = parse(SAMPLE, &options()).unwrap();
        assert_eq!(task.split_sizes(), (6, 0));
        let problems = all(&task);
        let by_answer = |a: &str| {
            problems
                .iter()
                .find(|p| p.answer == a)
                .unwrap_or_else(|| panic!("no answer {a:?} in {problems:#?}"))
        };
        let half = by_answer("\\frac{1}{2}");
        assert_eq!(half.solution, " Divide by 2: $\\boxed{\\frac12}$.");
        assert_eq!(
            half.prompt,
            "Question: What is $\\frac{2}{4}$ in lowest terms?\nAnswer:"
        );
        assert!(half.id.ends_with(":1"), "{}", half.id);
        assert_eq!(by_answer("3").solution, " \\boxed{3}");
        assert_eq!(
            by_answer("5\\text{ cm}").solution,
            " It is 5 cm.\n\\boxed{5\\text{ cm}}"
        );
        assert_eq!(by_answer("(1, 2)").solution, " \\boxed{(1, 2)}");
        assert_eq!(by_answer("42").solution, " \\boxed{42}");
        assert_eq!(by_answer("7").solution, " So it is $\\boxed{7}$.");
        for p in &problems {
            assert_eq!(task.score(p, &p.solution), 1.0, "{p:?}");
            assert!(task.well_formed(p, &p.solution), "{p:?}");
        }
    }

    #[test]
    fn fields_instruction_and_chat() {
        let text =
            "{\"q\": \"What is 1+1?\", \"final\": \"2\", \"worked\": \"1+1=\\\\boxed{2}\"}\n";
        let options = FileOptions {
            question_field: "q".into(),
            answer_field: "final".into(),
            solution_field: Some("worked".into()),
            instruction: Some("Put the final answer in \\boxed{}.".into()),
            format: PromptFormat::Chat,
            ..options()
        };
        let p = parse(text, &options).unwrap().train_problem(0);
        assert_eq!(p.prompt, "What is 1+1?\nPut the final answer in \\boxed{}.");
        assert_eq!(p.answer, "2");
        assert_eq!(
            p.solution, "1+1=\\boxed{2}",
            "no space before a chat answer"
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let cases = [
            ("{\"answer\": \"1\"}", "missing field `problem`"),
            ("{\"problem\": \"p\"}", "missing field `answer`"),
            (
                "{\"problem\": \"p\", \"solution\": \"no box\"}",
                "no \\boxed{} in a solution",
            ),
            ("{\"problem\": \"p\", \"answer\": \"$ $\"}", "says nothing"),
            (
                "{\"problem\": \"p\", \"answer\": \"\\\\boxed{}\"}",
                "says nothing",
            ),
            (
                "{\"problem\": \"p\", \"answer\": \"{1\"}",
                "unbalanced braces",
            ),
            (
                "{\"problem\": \"p\", \"answer\": [1]}",
                "`answer` is an array",
            ),
            (
                "{\"problem\": \"p\", \"answer\": \"1\", \"solution\": 3}",
                "`solution` is a number",
            ),
        ];
        for (line, needle) in cases {
            let err = parse(line, &options()).err().unwrap().to_string();
            assert!(err.starts_with("/data/math.jsonl:1: "), "{err}");
            assert!(err.contains(needle), "{err:?} should contain {needle:?}");
        }
        let long = format!(
            "{{\"problem\": \"p\", \"answer\": \"{}\"}}",
            "1".repeat(2000)
        );
        let err = parse(&long, &options()).err().unwrap().to_string();
        assert!(err.contains("longer than"), "{err}");
    }

    #[test]
    fn split_is_by_problem_and_disjoint() {
        let text: String = (0..2000)
            .map(|i| {
                format!(
                    "{{\"problem\": \"What is {i} plus one?\", \"answer\": \"{}\"}}\n",
                    i + 1
                )
            })
            .collect();
        let task = parse(
            &text,
            &FileOptions {
                eval_fraction: 0.1,
                ..options()
            },
        )
        .unwrap();
        let (train, eval) = task.split_sizes();
        assert_eq!(train + eval, 2000);
        assert!((140..260).contains(&eval), "{eval} held out");
        let held: HashSet<String> = task
            .eval_problems(usize::MAX)
            .into_iter()
            .map(|p| p.prompt)
            .collect();
        assert!(all(&task).iter().all(|p| !held.contains(&p.prompt)));
    }

    #[test]
    fn scores_the_last_box() {
        let task = parse(SAMPLE, &options()).unwrap();
        let cases = [
            ("\\frac{1}{2}", "so $\\boxed{0.5}$", 1.0),
            ("\\frac{1}{2}", "\\boxed{0.5} no wait \\boxed{0.4}", 0.0),
            ("\\frac{1}{2}", "\\boxed{0.4} no wait \\boxed{1/2}", 1.0),
            ("\\frac{1}{2}", "\\fbox{\\dfrac12}", 1.0),
            ("\\frac{1}{2}", "the answer is 1/2", 0.0),
            ("\\frac{1}{2}", "\\boxed{1/2", 0.0),
            ("3", "\\boxed{x = 3}", 1.0),
            ("3", "$\\boxed 3$", 1.0),
            ("3", "\\boxed{}", 0.0),
            ("", "\\boxed{}", 0.0),
            ("3", "", 0.0),
            ("3", &"\\boxed{".repeat(10_000), 0.0),
            ("3", &format!("\\boxed{{{}}}", "3".repeat(5000)), 0.0),
        ];
        for (answer, completion, want) in cases {
            let got = task.score(&problem(answer), completion);
            assert_eq!(got, want, "{answer:?} / {completion:?}");
        }
        assert!(task.well_formed(&problem("1"), "\\boxed{2}"));
        assert!(!task.well_formed(&problem("1"), "\\boxed{ }"));
        assert!(!task.well_formed(&problem("1"), "\\boxed{2"));
        assert!(!task.well_formed(&problem("1"), "2"));
    }

    /// Cases the properties below once found, kept as plain tests.
    #[test]
    fn found_by_proptest() {
        let task = parse(SAMPLE, &options()).unwrap();
        // Escaped braces are characters: the normal form must box and
        // unbox whole.
        for a in ["{\\frac{\\}}{\\{}}", "\\{1, 2\\}", "a\\\\"] {
            let normal = latex::normalize(a).unwrap();
            assert_eq!(
                latex::last_boxed(&format!("\\boxed{{{normal}}}")),
                Some(normal.as_str())
            );
            assert_eq!(
                task.score(&problem(a), &format!("\\boxed{{{normal}}}")),
                1.0
            );
        }
    }

    /// GSM8K rewritten in MATH's layout: every solution verifies, and the
    /// split is the jsonl task's own (the two share the held-out hash).
    #[test]
    fn real_gsm8k_as_math_if_present() {
        let path = crate::crate_dir().join("../../shared/data/gsm8k/test.jsonl");
        let Ok(text) = std::fs::read_to_string(&path) else {
            eprintln!("skipping: no GSM8K copy at {}", path.display());
            return;
        };
        let mut lines = String::new();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let (reasoning, number) = v["answer"].as_str().unwrap().rsplit_once("####").unwrap();
            let record = serde_json::json!({
                "problem": v["question"],
                "answer": number.trim(),
                "solution": format!("{reasoning}So the answer is $\\boxed{{{}}}$.", number.trim()),
            });
            lines.push_str(&format!("{record}\n"));
        }
        let options = FileOptions {
            eval_fraction: 0.1,
            ..Math::default_options()
        };
        let task = parse(&lines, &options).unwrap();
        let jsonl = crate::Jsonl::load(&path, 0, 0.1, crate::jsonl::DEFAULT_TEMPLATE).unwrap();
        assert_eq!(task.split_sizes(), jsonl.split_sizes());
        let prompts = |ps: Vec<Problem>| ps.into_iter().map(|p| p.prompt).collect::<Vec<_>>();
        assert_eq!(
            prompts(task.eval_problems(usize::MAX)),
            prompts(jsonl.eval_problems(usize::MAX))
        );
        let problems = all(&task).into_iter().chain(task.eval_problems(usize::MAX));
        for p in problems {
            assert_eq!(task.score(&p, &p.solution), 1.0, "{p:?}");
            let wrong = format!("\\boxed{{{}1}}", p.answer);
            assert_eq!(task.score(&p, &wrong), 0.0, "{p:?}");
        }
    }

    /// Pieces of LaTeX answers, none of them a box.
    const PIECES: &[&str] = &[
        "0",
        "1",
        "2",
        "7",
        "10",
        ".",
        ",",
        "-",
        "+",
        "=",
        "/",
        "^",
        "_",
        " ",
        "x",
        "a",
        "B",
        "\\pi",
        "\\sqrt",
        "\\frac",
        "\\dfrac",
        "\\left(",
        "\\right)",
        "\\left[",
        "\\right]",
        "\\,",
        "\\!",
        "\\ ",
        "$",
        "\\%",
        "%",
        "^\\circ",
        "\\infty",
        "\\in",
        "(",
        ")",
        "[",
        "]",
        "\\cdot",
        "\\text",
        "\\mbox",
        "{,}",
        "~",
        "日",
        "°",
        "\\",
        "\\{",
        "\\}",
        "\\theta",
        "{",
        "}",
        "\\left\\{",
        "\\right\\}",
        "\\textbf",
        "\\mathrm",
        "\\sqrt[3]",
        "\\binom",
        "\\tfrac",
        "^{\\circ}",
        "\\$",
        "x_1",
        "_{12}",
        "\\quad",
        "1,000",
        "\\\\",
        "\\le",
        "\\;",
    ];

    /// Answers with balanced braces, built from [`PIECES`].
    fn answer() -> impl Strategy<Value = String> {
        let leaf = prop::sample::select(PIECES).prop_map(str::to_string);
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.concat()),
                inner.clone().prop_map(|x| format!("{{{x}}}")),
                inner.clone().prop_map(|x| format!("\\text{{{x}}}")),
                (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("\\frac{{{a}}}{{{b}}}")),
                (inner.clone(), inner).prop_map(|(a, b)| format!("({a}, {b})")),
            ]
        })
    }

    /// Whether braces balance as the box extraction counts them (escaped
    /// ones are characters), with no backslash left to escape the box's own
    /// closing brace.
    fn balanced(s: &str) -> bool {
        let mut depth = 0i64;
        let mut bytes = s.bytes();
        while let Some(b) = bytes.next() {
            depth += match b {
                b'\\' if bytes.next().is_none() => return false,
                b'{' => 1,
                b'}' => -1,
                _ => 0,
            };
            if depth < 0 {
                return false;
            }
        }
        depth == 0
    }

    /// Cases per property (`PT_CASES` overrides, for a longer search).
    const CASES: u32 = 2000;

    fn cases() -> u32 {
        std::env::var("PT_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(CASES)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            max_global_rejects: cases(),
            ..ProptestConfig::with_cases(cases())
        })]

        #[test]
        fn verifier_never_panics(text in any::<String>(), reference in any::<String>()) {
            let task = parse(SAMPLE, &options()).unwrap();
            for (answer, completion) in [(&reference, &text), (&text, &reference)] {
                let r = task.score(&problem(answer), completion);
                prop_assert!(r == 0.0 || r == 1.0);
                let _ = task.well_formed(&problem(answer), completion);
                let boxed = format!("\\boxed{{{completion}}}");
                let _ = task.score(&problem(answer), &boxed);
            }
            let _ = latex::normalize(&text);
        }

        #[test]
        fn verifier_never_panics_on_latex(a in answer(), b in answer(), cut in 0usize..64) {
            let task = parse(SAMPLE, &options()).unwrap();
            let text = format!("{a} \\boxed{{{b}");
            let cut = text.char_indices().map(|(i, _)| i).nth(cut).unwrap_or(text.len());
            for completion in [&text[..cut], &text[cut..], &text] {
                let _ = task.score(&problem(&a), completion);
                let _ = task.well_formed(&problem(&b), completion);
            }
        }

        #[test]
        fn a_boxed_answer_matches_itself(
            a in answer(),
            prefix in any::<String>().prop_filter("no box", |p| !p.contains("box")),
        ) {
            prop_assume!(balanced(&a) && !a.contains("box"));
            let normal = latex::normalize(&a).unwrap();
            prop_assume!(!normal.is_empty());
            let task = parse(SAMPLE, &options()).unwrap();
            let reference = problem(&a);
            prop_assert_eq!(task.score(&reference, &format!("{prefix} \\boxed{{{a}}}")), 1.0);
            // Normalising is idempotent, so the normal form matches too.
            let again = latex::normalize(&normal);
            prop_assert_eq!(again.as_deref(), Some(normal.as_str()));
            prop_assert!(balanced(&normal), "{:?}", normal);
            prop_assert_eq!(task.score(&reference, &format!("\\boxed{{{normal}}}")), 1.0);
            prop_assert_eq!(task.score(&problem(&normal), &format!("\\boxed{{{a}}}")), 1.0);
        }
    }
}
