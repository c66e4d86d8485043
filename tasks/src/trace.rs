//! `countdown-trace`: countdown answered with a short search trace, so that
//! failures run long. `Use 3 5 7 to make 22: ` →
//! `3+5+7=15;7*3-5=16;3*5+7=22;#3*5+7`: a few attempts, each an
//! expression and its value, then `#` and the answer.
//!
//! Why a separate task: under GRPO's per-group centring, the positive share
//! of a token-mean loss at ratio 1 is `L_right / (L_right + L_wrong)`, so
//! BAPO's bound search only has work when wrong answers are longer than
//! right ones (issue 31). Here a policy that does not find the target keeps
//! trying until the token cap cuts it off, and a cut-off response is wrong
//! (see [`Task::fails_when_truncated`]).
//!
//! The puzzles, their split and the verifier of the answer are countdown's;
//! the worked solutions of the warm start come from a solver that tries a
//! few wrong expressions (chosen by a hash of the puzzle) before one that
//! reaches the target. On [`GIVE_UP_PERCENT`] of the puzzles the solver
//! gives up instead: wrong attempts past [`GIVE_UP_LEN`] characters and no
//! answer. Without those, a warm start learns to conclude after a few
//! attempts whether or not it found the target, and its wrong answers are
//! as short as its right ones (measured: positive share 0.491, right 42.5
//! and wrong 45.1 tokens, nothing truncated; docs/study/reuse).

use rand::{Rng, SeedableRng, rngs::SmallRng, seq::SliceRandom};

use crate::countdown::{self, Countdown, Tree};
use crate::expr::{Op, Ratio};
use crate::{Problem, StableHasher, Task, TaskError};

/// Separates the answer from the attempts.
pub const ANSWER_MARK: char = '#';

/// Ends each attempt.
pub const ATTEMPT_END: char = ';';

/// Key of the hash that picks a puzzle's wrong attempts ("trace_wr").
const ATTEMPTS_KEY: u64 = 0x7472_6163_655f_7772;

/// Key of the hash that picks the puzzles whose trace gives up ("trace_gu").
const GIVE_UP_KEY: u64 = 0x7472_6163_655f_6775;

/// Wrong attempts before the right one in a worked trace: 1 to this many.
pub const MAX_WRONG_ATTEMPTS: usize = 3;

/// Share of puzzles, in percent (by a hash of the puzzle), whose warm-start
/// trace gives up.
pub const GIVE_UP_PERCENT: u64 = 35;

/// A trace that gives up runs at least this many characters: past the
/// response cap of the study (112), so a policy imitating it is cut off.
pub const GIVE_UP_LEN: usize = 130;

/// Countdown puzzles with traced solutions.
#[derive(Debug, Clone)]
pub struct CountdownTrace {
    puzzles: Countdown,
}

impl CountdownTrace {
    pub fn new(seed: u64, difficulty: u32) -> Result<Self, TaskError> {
        Ok(Self {
            puzzles: Countdown::new(seed, difficulty)?,
        })
    }

    /// `problem` with its solution replaced by a trace.
    fn traced(problem: Problem) -> Problem {
        let numbers = countdown::parse_prompt(&problem.prompt).unwrap_or_default();
        let target = problem.answer.parse().unwrap_or(0);
        let solution = if gives_up(&numbers, target) {
            give_up_trace(&numbers, target)
        } else {
            trace(&numbers, target, &problem.solution)
        };
        Problem {
            id: problem.id.replacen("countdown", "countdown-trace", 1),
            solution,
            ..problem
        }
    }
}

/// The worked trace of a puzzle whose known solution is `solution`: 1 to
/// [`MAX_WRONG_ATTEMPTS`] distinct wrong expressions with integer values
/// (each with its value), then `solution` with the target, then the answer.
pub fn trace(numbers: &[u64], target: u64, solution: &str) -> String {
    let (wrong, mut rng) = wrong_attempts(numbers, target);
    let n = rng.random_range(1..=MAX_WRONG_ATTEMPTS).min(wrong.len());
    let mut out = String::new();
    for (e, v) in &wrong[..n] {
        out.push_str(&format!("{e}={v}{ATTEMPT_END}"));
    }
    out.push_str(&format!(
        "{solution}={target}{ATTEMPT_END}{ANSWER_MARK}{solution}"
    ));
    out
}

/// The trace of a solver that gives up: distinct wrong attempts (each with
/// its value) until the trace is [`GIVE_UP_LEN`] characters long (or the
/// attempts run out), and no answer.
pub fn give_up_trace(numbers: &[u64], target: u64) -> String {
    let (wrong, _) = wrong_attempts(numbers, target);
    let mut out = String::new();
    for (e, v) in &wrong {
        if out.len() >= GIVE_UP_LEN {
            break;
        }
        out.push_str(&format!("{e}={v}{ATTEMPT_END}"));
    }
    out
}

/// Whether the warm-start trace of this puzzle gives up.
pub fn gives_up(numbers: &[u64], target: u64) -> bool {
    puzzle_hash(GIVE_UP_KEY, numbers, target) % 100 < GIVE_UP_PERCENT
}

fn puzzle_hash(key: u64, numbers: &[u64], target: u64) -> u64 {
    let mut h = StableHasher::new(key);
    for &n in numbers {
        h = h.word(n);
    }
    h.word(target).finish()
}

/// The distinct wrong expressions with non-negative integer values, in an
/// order shuffled by the puzzle's hash, and the generator that shuffled.
fn wrong_attempts(numbers: &[u64], target: u64) -> (Vec<(String, i128)>, SmallRng) {
    let mut rng = SmallRng::seed_from_u64(puzzle_hash(ATTEMPTS_KEY, numbers, target));
    let mut wrong: Vec<(String, i128)> = expressions(numbers)
        .into_iter()
        .filter_map(|(e, v)| (v.den == 1 && v.num >= 0).then_some((e, v.num)))
        .filter(|&(_, v)| v != i128::from(target))
        .collect();
    wrong.sort();
    wrong.dedup_by(|a, b| a.0 == b.0);
    wrong.shuffle(&mut rng);
    (wrong, rng)
}

/// The answer of a completion: what follows its first [`ANSWER_MARK`]
/// (`None` without one: the trace never concluded).
pub fn answer(completion: &str) -> Option<&str> {
    completion.split_once(ANSWER_MARK).map(|(_, a)| a)
}

/// Every expression that uses each of `numbers` exactly once (all orders,
/// operators and shapes; duplicates possible), written as countdown
/// writes its solutions, with its exact value. Divisions by zero and
/// overflows are left out.
pub(crate) fn expressions(numbers: &[u64]) -> Vec<(String, Ratio)> {
    let parts: Vec<(Tree, Ratio)> = numbers
        .iter()
        .map(|&n| (Tree::Leaf(n), Ratio::int(i128::from(n))))
        .collect();
    let mut out = Vec::new();
    combine(parts, &mut out);
    out
}

/// Every way of joining two of `parts` by an operator, recursively down to
/// one tree.
fn combine(parts: Vec<(Tree, Ratio)>, out: &mut Vec<(String, Ratio)>) {
    if let [(tree, value)] = parts.as_slice() {
        out.push((tree.text(), *value));
        return;
    }
    for (i, (l, lv)) in parts.iter().enumerate() {
        for (j, (r, rv)) in parts.iter().enumerate() {
            for op in [Op::Add, Op::Sub, Op::Mul, Op::Div] {
                let Some(value) = (i != j).then(|| op.apply(*lv, *rv).ok()).flatten() else {
                    continue;
                };
                let mut rest: Vec<(Tree, Ratio)> = parts
                    .iter()
                    .enumerate()
                    .filter(|&(k, _)| k != i && k != j)
                    .map(|(_, p)| p.clone())
                    .collect();
                let joined = Tree::Node(Box::new(l.clone()), op, Box::new(r.clone()));
                rest.push((joined, value));
                combine(rest, out);
            }
        }
    }
}

impl Task for CountdownTrace {
    fn name(&self) -> &str {
        "countdown-trace"
    }

    fn train_problem(&self, index: u64) -> Problem {
        Self::traced(self.puzzles.train_problem(index))
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        self.puzzles
            .eval_problems(n)
            .into_iter()
            .map(Self::traced)
            .collect()
    }

    /// 1 when the answer after `#` reaches the target with the prompt's
    /// numbers (countdown's verifier); the attempts before it are not
    /// graded.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        match answer(completion) {
            Some(a) => self.puzzles.score(problem, a),
            None => 0.0,
        }
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    /// Concludes with an answer the expression parser accepts.
    fn well_formed(&self, problem: &Problem, completion: &str) -> bool {
        answer(completion).is_some_and(|a| self.puzzles.well_formed(problem, a))
    }

    /// A response cut off by the token cap never concluded: wrong, even if
    /// its text happens to end on a right answer.
    fn fails_when_truncated(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expr::evaluate;

    #[test]
    fn expressions_cover_every_shape_with_exact_values() {
        let all = expressions(&[3, 5, 7]);
        let find = |t: &str| all.iter().find(|(e, _)| e == t).map(|(_, v)| *v);
        assert_eq!(find("3*5+7"), Some(Ratio::int(22)));
        assert_eq!(find("7-(3+5)"), Some(Ratio::int(-1)));
        assert_eq!(find("3/(7-5)"), Some(Ratio { num: 3, den: 2 }));
        // 3 ordered pairs x 2 x 4 ops, then 2 orders x 4 ops.
        assert_eq!(all.len(), 6 * 4 * 2 * 4);
        for (e, v) in &all {
            assert_eq!(evaluate(e).unwrap().value, *v, "{e}");
        }
        assert!(expressions(&[1, 0]).iter().all(|(e, _)| e != "1/0"));
    }

    #[test]
    fn a_trace_tries_wrong_expressions_then_states_the_answer() {
        let t = trace(&[3, 5, 7], 22, "3*5+7");
        assert!(t.ends_with(";3*5+7=22;#3*5+7"), "{t}");
        let attempts: Vec<&str> = t.split(ATTEMPT_END).collect();
        let wrong = &attempts[..attempts.len() - 2];
        assert!((1..=MAX_WRONG_ATTEMPTS).contains(&wrong.len()), "{t}");
        for a in wrong {
            let (e, v) = a.split_once('=').unwrap();
            let value = evaluate(e).unwrap().value;
            assert_eq!(value, Ratio::int(v.parse().unwrap()), "{a}: its value");
            assert_ne!(v, "22", "{a}: a wrong attempt misses the target");
        }
        assert_eq!(t, trace(&[3, 5, 7], 22, "3*5+7"), "deterministic");
    }

    #[test]
    fn scores_the_answer_after_the_mark_only() {
        let task = CountdownTrace::new(0, 1).unwrap();
        let p = Problem {
            id: "x".into(),
            prompt: "Use 3 5 7 to make 22: ".into(),
            answer: "22".into(),
            solution: String::new(),
        };
        let cases = [
            ("3+5+7=15;3*5+7=22;#3*5+7", 1.0),
            ("#7+3*5", 1.0),
            ("3*5+7=22;", 0.0),          // never concluded
            ("3*5+7=22;#3*5+7=22", 1.0), // a true claim is tolerated, as in countdown
            ("3*5+7=22;#3*5+7=23", 0.0),
            ("3+5+7=15;#3+5+7", 0.0),
            ("#3*5+7;#3*5+7", 0.0), // the answer is all that follows the first mark
            ("", 0.0),
        ];
        for (c, want) in cases {
            assert_eq!(task.score(&p, c), want, "{c:?}");
        }
        assert!(task.well_formed(&p, "#3+5+7"));
        assert!(!task.well_formed(&p, "3+5+7=15;"));
        assert!(task.fails_when_truncated());
        assert_eq!(task.score_response(&p, "#3*5+7", false), 1.0);
        assert_eq!(task.score_response(&p, "#3*5+7", true), 0.0, "cut off");
        let plain = Countdown::new(0, 1).unwrap();
        assert_eq!(plain.score_response(&p, "3*5+7", true), 1.0, "text decides");
    }

    /// Issue 31 asks for right answers of 25-70 tokens (one character is
    /// one token for the built-in tokenizer) at level 1; about a third of the
    /// traces give up past the cap instead.
    #[test]
    fn worked_traces_are_25_to_70_characters_at_level_1() {
        let task = CountdownTrace::new(0, 1).unwrap();
        let (mut lengths, mut gave_up) = (Vec::new(), 0);
        for i in 0..1000 {
            let p = task.train_problem(i);
            if p.solution.contains(ANSWER_MARK) {
                assert_eq!(task.score(&p, &p.solution), 1.0, "{p:?}");
                lengths.push(p.solution.len());
            } else {
                assert!(p.solution.len() >= GIVE_UP_LEN, "{p:?}");
                assert_eq!(task.score(&p, &p.solution), 0.0);
                gave_up += 1;
            }
        }
        assert!((280..=420).contains(&gave_up), "{gave_up} of 1000 gave up");
        lengths.sort_unstable();
        let n = lengths.len();
        let (lo, median, hi) = (lengths[n / 40], lengths[n / 2], lengths[n - n / 40]);
        assert!(
            lo >= 20 && hi <= 70 && (30..=55).contains(&median),
            "{lo} {median} {hi}"
        );
    }

    #[test]
    fn shares_countdowns_split() {
        let task = CountdownTrace::new(0, 1).unwrap();
        let plain = Countdown::new(0, 1).unwrap();
        let (a, b) = (task.eval_problems(5), plain.eval_problems(5));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!((&x.prompt, &x.answer), (&y.prompt, &y.answer));
            assert!(x.id.starts_with("countdown-trace"), "{}", x.id);
        }
    }
}
