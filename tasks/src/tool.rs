//! The calculator tool and `arith-tool`, the task that needs it.
//!
//! A model turn that contains `<call>EXPR</call>` asks the calculator; the
//! environment answers `<result>VALUE</result>` (exact, by [`crate::expr`])
//! and the model takes another turn. A turn without a call is the final
//! answer. The built-in environment (the actor's `calculator`) and the
//! Python reference server (examples/env-server) speak exactly this.
//!
//! `arith-tool` asks products too long for the tiny model to multiply in
//! its head (level L: an (L+1)-digit by an L-digit number). Its worked
//! solutions teach the format: [`TOOL_PERCENT`] of them call the
//! calculator and copy its result; the rest answer at once, as a model
//! that has not learnt to use its tool would. Reinforcement learning has
//! to find that the call pays.

use rand::{Rng, SeedableRng, rngs::SmallRng};

use super::{Problem, StableHasher, Task, TaskError, expr};

pub const CALL_OPEN: &str = "<call>";
pub const CALL_CLOSE: &str = "</call>";
pub const RESULT_OPEN: &str = "<result>";
pub const RESULT_CLOSE: &str = "</result>";

/// Share of worked solutions that use the calculator (by problem hash).
pub const TOOL_PERCENT: u64 = 30;

/// Highest level: both operands and the product fit an `i128` easily.
pub const MAX_LEVEL: u32 = 8;

/// The expression of a turn's first complete call, if it makes one.
pub fn tool_call(turn: &str) -> Option<&str> {
    let start = turn.find(CALL_OPEN)? + CALL_OPEN.len();
    let len = turn[start..].find(CALL_CLOSE)?;
    Some(&turn[start..start + len])
}

/// Tokens of the longest turn a level-`level` episode needs with the
/// built-in character tokenizer: a call of the whole product, its stop
/// token included (answers are shorter).
pub fn call_tokens(level: u32) -> usize {
    let expr = (level + 1) + 1 + level;
    (CALL_OPEN.len() + expr as usize + CALL_CLOSE.len()) + 1
}

/// What the calculator answers to `expr`: its exact value (`a/b` when not
/// an integer), or why it has none.
pub fn tool_result(expr_text: &str) -> String {
    let body = match expr::evaluate(expr_text) {
        Ok(e) if e.value.den == 1 => e.value.num.to_string(),
        Ok(e) => format!("{}/{}", e.value.num, e.value.den),
        Err(e) => format!("error: {e}"),
    };
    format!("{RESULT_OPEN}{body}{RESULT_CLOSE}")
}

const TRAIN_KEY: u64 = 0x746f_6f6c_5f74_7200; // "tool_tr"
const HELD_OUT_KEY: u64 = 0x746f_6f6c_5f68_6f00; // "tool_ho"
const TOOL_KEY: u64 = 0x746f_6f6c_5f75_7365; // "tool_use"
const EVAL_SEED: u64 = 0x746f_6f6c_5f65_7600; // "tool_ev"

/// `a*b` with an (L+1)-digit `a` and an L-digit `b`; a tenth of all
/// products (by hash) are held out for evaluation.
#[derive(Debug, Clone)]
pub struct ArithTool {
    seed: u64,
    level: u32,
}

impl ArithTool {
    pub fn new(seed: u64, level: u32) -> Result<Self, TaskError> {
        super::check_difficulty(level, MAX_LEVEL)?;
        Ok(Self { seed, level })
    }

    fn draw(&self, rng: &mut SmallRng) -> (u64, u64) {
        let mut digits = |d: u32| rng.random_range(10u64.pow(d - 1)..10u64.pow(d));
        let a = digits(self.level + 1);
        (a, digits(self.level))
    }

    fn held_out(a: u64, b: u64) -> bool {
        StableHasher::new(HELD_OUT_KEY)
            .word(a)
            .word(b)
            .finish()
            .is_multiple_of(10)
    }

    fn problem(a: u64, b: u64, id: String) -> Problem {
        let answer = (u128::from(a) * u128::from(b)).to_string();
        let uses_tool = StableHasher::new(TOOL_KEY).word(a).word(b).finish() % 100 < TOOL_PERCENT;
        let solution = if uses_tool {
            worked_call(&format!("{a}*{b}"), &answer)
        } else {
            answer.clone()
        };
        Problem {
            id,
            prompt: format!("{a}*{b}="),
            answer,
            solution,
        }
    }

    /// The `n`-th problem of a stream keyed by `key` whose draws pass
    /// `keep`.
    fn nth(&self, key: u64, index: u64, keep: impl Fn(u64, u64) -> bool) -> (u64, u64) {
        let mut rng = SmallRng::seed_from_u64(StableHasher::new(key).word(index).finish());
        loop {
            let (a, b) = self.draw(&mut rng);
            if keep(a, b) {
                return (a, b);
            }
        }
    }
}

/// A worked tool use as one text: the call, the end of the model's turn
/// (`<eos>`, the built-in tokenizer's stop token), the calculator's
/// answer, then the answer copied.
pub fn worked_call(expr_text: &str, answer: &str) -> String {
    format!(
        "{CALL_OPEN}{expr_text}{CALL_CLOSE}<eos>{}{answer}",
        tool_result(expr_text)
    )
}

impl Task for ArithTool {
    fn name(&self) -> &str {
        "arith-tool"
    }

    fn train_problem(&self, index: u64) -> Problem {
        let key = TRAIN_KEY ^ self.seed.rotate_left(17);
        let (a, b) = self.nth(key, index, |a, b| !Self::held_out(a, b));
        Self::problem(a, b, format!("arith-tool-{}-train-{index}", self.level))
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        (0..n as u64)
            .map(|i| {
                let (a, b) = self.nth(EVAL_SEED, i, Self::held_out);
                Self::problem(a, b, format!("arith-tool-{}-eval-{i}", self.level))
            })
            .collect()
    }

    /// 1 for exactly the product (of the final turn, the one without a
    /// call), surrounding whitespace aside.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        f32::from(u8::from(completion.trim() == problem.answer))
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    fn well_formed(&self, _problem: &Problem, completion: &str) -> bool {
        let t = completion.trim();
        !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())
    }

    /// A final turn cut off by its cap did not conclude (as the reference
    /// server judges it too).
    fn fails_when_truncated(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_found_and_answered_exactly() {
        assert_eq!(tool_call("so <call>347*86</call> then"), Some("347*86"));
        assert_eq!(tool_call("<call>1+2"), None, "unclosed");
        assert_eq!(tool_call("29842"), None);
        // `<call>347*86</call><eos>`: 20 tokens at level 2.
        assert_eq!(call_tokens(2), "<call>347*86</call>".len() + 1);
        assert_eq!(tool_result("347*86"), "<result>29842</result>");
        assert_eq!(tool_result("7/2"), "<result>7/2</result>");
        assert!(tool_result("1/0").starts_with("<result>error: division by zero"));
        assert!(tool_result("rm -rf").contains("error"));
    }

    #[test]
    fn problems_split_and_a_share_of_solutions_call_the_tool() {
        let t = ArithTool::new(0, 3).unwrap();
        let eval = t.eval_problems(50);
        let train: Vec<Problem> = (0..1000).map(|i| t.train_problem(i)).collect();
        assert!(
            eval.iter()
                .all(|e| train.iter().all(|p| p.prompt != e.prompt))
        );
        let p = &train[0];
        let (a, b) = p.prompt.trim_end_matches('=').split_once('*').unwrap();
        assert_eq!((a.len(), b.len()), (4, 3));
        assert_eq!(
            p.answer,
            (a.parse::<u128>().unwrap() * b.parse::<u128>().unwrap()).to_string()
        );
        let calls = train
            .iter()
            .filter(|p| p.solution.starts_with(CALL_OPEN))
            .count();
        assert!((250..350).contains(&calls), "{calls} of 1000");
        let worked = train
            .iter()
            .find(|p| p.solution.starts_with(CALL_OPEN))
            .unwrap();
        assert!(
            worked
                .solution
                .ends_with(&format!("</result>{}", worked.answer))
        );
        assert_eq!(t.score(worked, &format!(" {}\n", worked.answer)), 1.0);
        assert_eq!(
            t.score(worked, &worked.solution),
            0.0,
            "the call is not an answer"
        );
    }
}
