//! `arith`: one arithmetic operation, `37+45=` → `82`.
//!
//! Small enough for the built-in tiny model to learn on a CPU, and graded by
//! difficulty so a run can watch a curriculum work. Everything is printable
//! ASCII with no spaces or newlines, and the reference solution is just the
//! answer, so warm-up sequences stay a dozen tokens long.

use rand::Rng;
use rand::rngs::SmallRng;

use super::{Problem, StableHasher, Task, TaskError, check_difficulty, generated};

/// The highest level: its operands still fit a `u64` (19 digits).
pub const MAX_LEVEL: u32 = 18;

/// Keys of the stable hashes: one for the held-out split (never the seed, so
/// no seed can leak evaluation problems into training), one for the
/// training stream, one for the evaluation stream.
const HELD_OUT_KEY: u64 = 0x6172_6974_685f_686f; // "arith_ho"
const TRAIN_KEY: u64 = 0x6172_6974_685f_7472; // "arith_tr"
const EVAL_SEED: u64 = 0x6172_6974_685f_6576; // "arith_ev"

/// A problem is held out when its hash is 0 mod this: a tenth of them.
const HELD_OUT_MODULUS: u64 = 10;

/// The arithmetic task at one difficulty level:
///
/// - level 1: `a + b` and `a - b` with `a, b` in 0..=99 (results may be
///   negative, written `-8`);
/// - level L >= 2: `a + b`, `a - b` with operands of up to L+1 digits, and
///   `a * b` of a ceil((L+1)/2)-digit by a floor((L+1)/2)-digit number
///   (level 2: 2×1 digits, level 3: 2×2, level 4: 3×2, ...).
#[derive(Debug, Clone)]
pub struct Arith {
    seed: u64,
    level: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Add,
    Sub,
    Mul,
}

impl Op {
    fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
        }
    }
}

/// `a op b`, the identity of a problem (and the key of the split).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Question {
    a: u64,
    op: Op,
    b: u64,
}

impl Question {
    fn held_out(self) -> bool {
        StableHasher::new(HELD_OUT_KEY)
            .word(self.a)
            .word(self.op as u64)
            .word(self.b)
            .finish()
            .is_multiple_of(HELD_OUT_MODULUS)
    }

    fn answer(self) -> i128 {
        let (a, b) = (i128::from(self.a), i128::from(self.b));
        match self.op {
            Op::Add => a + b,
            Op::Sub => a - b,
            Op::Mul => a * b,
        }
    }

    fn problem(self, id: String) -> Problem {
        let answer = self.answer().to_string();
        Problem {
            id,
            prompt: format!("{}{}{}=", self.a, self.op.symbol(), self.b),
            solution: answer.clone(),
            answer,
        }
    }
}

impl Arith {
    pub fn new(seed: u64, difficulty: u32) -> Result<Self, TaskError> {
        check_difficulty(difficulty, MAX_LEVEL)?;
        Ok(Self {
            seed,
            level: difficulty,
        })
    }

    /// One question of this level, uniformly over operations and operands.
    fn draw(&self, rng: &mut SmallRng) -> Question {
        let ops: &[Op] = if self.level == 1 {
            &[Op::Add, Op::Sub]
        } else {
            &[Op::Add, Op::Sub, Op::Mul]
        };
        let op = ops[rng.random_range(0..ops.len())];
        let (a, b) = match op {
            Op::Add | Op::Sub => {
                let digits = if self.level == 1 { 2 } else { self.level + 1 };
                let end = 10u64.pow(digits);
                (rng.random_range(0..end), rng.random_range(0..end))
            }
            Op::Mul => {
                let total = self.level + 1;
                let long = exactly_digits(rng, total.div_ceil(2));
                let short = exactly_digits(rng, total / 2);
                // Either order, so `7*45` is learnt as well as `45*7`.
                if rng.random_bool(0.5) {
                    (long, short)
                } else {
                    (short, long)
                }
            }
        };
        Question { a, op, b }
    }
}

/// A number of exactly `digits` digits (0..=9 for one digit).
fn exactly_digits(rng: &mut SmallRng, digits: u32) -> u64 {
    let start = if digits <= 1 {
        0
    } else {
        10u64.pow(digits - 1)
    };
    rng.random_range(start..10u64.pow(digits))
}

impl generated::Generated for Arith {
    type Item = Question;
    type Key = Question;
    const NAME: &'static str = "arith";
    const TRAIN_KEY: u64 = TRAIN_KEY;
    const EVAL_SEED: u64 = EVAL_SEED;

    fn seed(&self) -> u64 {
        self.seed
    }

    fn level(&self) -> u32 {
        self.level
    }

    fn draw(&self, rng: &mut SmallRng) -> Question {
        Arith::draw(self, rng)
    }

    fn held_out(item: &Question) -> bool {
        item.held_out()
    }

    fn key(item: &Question) -> Question {
        *item
    }

    fn problem(item: &Question, id: String) -> Problem {
        item.problem(id)
    }
}

impl Task for Arith {
    fn name(&self) -> &str {
        "arith"
    }

    fn train_problem(&self, index: u64) -> Problem {
        generated::train_problem(self, index)
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        generated::eval_problems(self, n)
    }

    /// 1 for exactly the answer, surrounding whitespace aside: `+82`,
    /// `082`, `82.0` and `82 apples` are wrong, since the task is to learn
    /// the one canonical form.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        if completion.trim() == problem.answer {
            1.0
        } else {
            0.0
        }
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    /// A canonical integer, right or wrong: `-?(0|[1-9][0-9]*)`, no `-0`.
    fn well_formed(&self, _problem: &Problem, completion: &str) -> bool {
        let t = completion.trim();
        let digits = t.strip_prefix('-').unwrap_or(t);
        !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'))
            && t != "-0"
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn task(seed: u64, level: u32) -> Arith {
        Arith::new(seed, level).unwrap()
    }

    #[test]
    fn problems_look_right() {
        let t = task(0, 1);
        for i in 0..500 {
            let p = t.train_problem(i);
            assert!(p.prompt.ends_with('='), "{p:?}");
            assert!(p.prompt.bytes().all(|b| (32..127).contains(&b)));
            assert!(!p.prompt.contains(' '));
            assert_eq!(p.solution, p.answer);
            assert!(p.prompt.len() <= 6 && p.answer.len() <= 3, "{p:?}");
            assert_eq!(t.score(&p, &p.solution), 1.0);
            assert!(t.well_formed(&p, &p.solution));
        }
        let q = Question {
            a: 37,
            op: Op::Add,
            b: 45,
        };
        let p = q.problem("x".into());
        assert_eq!((p.prompt.as_str(), p.answer.as_str()), ("37+45=", "82"));
    }

    #[test]
    fn level_one_has_negative_answers_and_no_multiplication() {
        let t = task(3, 1);
        let problems: Vec<_> = (0..1000).map(|i| t.train_problem(i)).collect();
        assert!(problems.iter().any(|p| p.answer.starts_with('-')));
        assert!(problems.iter().all(|p| !p.prompt.contains('*')));
        assert!(
            task(3, 2)
                .eval_problems(300)
                .iter()
                .any(|p| p.prompt.contains('*'))
        );
    }

    #[test]
    fn same_seed_same_problems_other_seed_other_problems() {
        let a: Vec<_> = (0..200).map(|i| task(7, 2).train_problem(i)).collect();
        let b: Vec<_> = (0..200).map(|i| task(7, 2).train_problem(i)).collect();
        let c: Vec<_> = (0..200).map(|i| task(8, 2).train_problem(i)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Any index can be asked for directly, in any order.
        assert_eq!(task(7, 2).train_problem(150), a[150]);
        // Evaluation does not depend on the seed at all.
        assert_eq!(task(7, 2).eval_problems(100), task(8, 2).eval_problems(100));
    }

    #[test]
    fn train_and_eval_are_disjoint() {
        for level in [1, 2, 3] {
            for seed in [0, 1] {
                let t = task(seed, level);
                let eval: HashSet<String> = t
                    .eval_problems(1000)
                    .into_iter()
                    .map(|p| p.prompt)
                    .collect();
                assert_eq!(eval.len(), 1000, "level {level}");
                for i in 0..2000 {
                    let p = t.train_problem(i);
                    assert!(!eval.contains(&p.prompt), "level {level}: {p:?}");
                }
            }
        }
    }

    #[test]
    fn eval_is_a_deduplicated_prefix_and_stops_when_exhausted() {
        let t = task(0, 1);
        let few = t.eval_problems(50);
        let more = t.eval_problems(200);
        assert_eq!(few[..], more[..50]);
        // Level 1 has 20,000 questions, about 2,000 of them held out.
        let all = t.eval_problems(1_000_000);
        assert!((1500..2500).contains(&all.len()), "{}", all.len());
        let unique: HashSet<_> = all.iter().map(|p| &p.prompt).collect();
        assert_eq!(unique.len(), all.len());
    }

    #[test]
    fn difficulty_grows_digits() {
        let stats = |level: u32| {
            let t = task(0, level);
            let operand_digits: Vec<usize> = (0..2000)
                .flat_map(|i| {
                    let p = t.train_problem(i);
                    let body = p.prompt.trim_end_matches('=').to_string();
                    body.split(['+', '-', '*'])
                        .map(str::len)
                        .collect::<Vec<_>>()
                })
                .collect();
            let max = operand_digits.iter().copied().max().unwrap_or(0);
            let mean = operand_digits.iter().sum::<usize>() as f64 / operand_digits.len() as f64;
            (max, mean)
        };
        let mut prev = (0, 0.0);
        for level in 1..=6 {
            let (max, mean) = stats(level);
            assert!(
                max > prev.0 && mean > prev.1,
                "level {level}: {max} {mean} vs {prev:?}"
            );
            prev = (max, mean);
        }
        assert_eq!(stats(1).0, 2);
        assert_eq!(stats(3).0, 4);
        // The top level still works without overflow.
        let top = task(0, MAX_LEVEL);
        for i in 0..200 {
            let p = top.train_problem(i);
            assert_eq!(top.score(&p, &p.answer), 1.0);
        }
        assert!(Arith::new(0, MAX_LEVEL + 1).is_err());
    }

    #[test]
    fn multiplication_digits_by_level() {
        for (level, want) in [(2, (1, 2)), (3, (2, 2)), (4, (2, 3))] {
            let t = task(0, level);
            for p in t
                .eval_problems(300)
                .iter()
                .filter(|p| p.prompt.contains('*'))
            {
                let (a, b) = p.prompt.trim_end_matches('=').split_once('*').unwrap();
                let mut lens = [a.len(), b.len()];
                lens.sort();
                // "0".."9" may stand for the one-digit factor.
                assert_eq!((lens[0], lens[1]), want, "level {level}: {p:?}");
            }
        }
    }

    #[test]
    fn verifier_is_exact_and_never_panics() {
        let t = task(0, 1);
        let p = Problem {
            id: "t".into(),
            prompt: "37-45=".into(),
            answer: "-8".into(),
            solution: "-8".into(),
        };
        let cases = [
            ("-8", 1.0),
            ("  -8 \n", 1.0),
            ("\t-8", 1.0),
            ("8", 0.0),
            ("- 8", 0.0),
            ("-08", 0.0),
            ("-8.0", 0.0),
            ("-8abc", 0.0),
            ("-8 -8", 0.0),
            ("-8\n37-45=-8", 0.0),
            ("", 0.0),
            ("   ", 0.0),
            ("−8", 0.0),
            ("日本語🎉\u{0}", 0.0),
        ];
        for (completion, want) in cases {
            assert_eq!(t.score(&p, completion), want, "{completion:?}");
        }
        let q = Problem {
            answer: "82".into(),
            ..p.clone()
        };
        for (completion, want) in [("82", 1.0), ("+82", 0.0), ("082", 0.0), ("82.", 0.0)] {
            assert_eq!(t.score(&q, completion), want, "{completion:?}");
        }
        let huge = "9".repeat(1000);
        assert_eq!(t.score(&q, &huge), 0.0);
        assert!(t.well_formed(&q, &huge));
    }

    #[test]
    fn well_formed_is_a_canonical_integer() {
        let t = task(0, 1);
        let p = t.train_problem(0);
        for ok in ["0", "7", "-7", " 120 ", "-100"] {
            assert!(t.well_formed(&p, ok), "{ok:?}");
        }
        for bad in ["", "-", "-0", "007", "+7", "7.0", "7 7", "seven", "🎉"] {
            assert!(!t.well_formed(&p, bad), "{bad:?}");
        }
    }
}
