//! `countdown`: reach a target with given numbers, `Use 3 5 7 to make 22: `
//! → `3*5+7`.
//!
//! The verifier is an exact parser, not a pattern: `+ - * /` and
//! parentheses over non-negative integer literals, evaluated in exact
//! rational arithmetic with checked `i128` operations, every given number
//! used exactly once. Anything it cannot fully account for (overflow,
//! division by zero, a stray character, too long, too deep) earns 0, so a
//! policy cannot find reward in the verifier's corners.

use rand::Rng;
use rand::rngs::SmallRng;

use crate::expr::Op;
pub use crate::expr::{Evaluation, ExprError, MAX_DEPTH, MAX_LEN, Ratio, evaluate, evaluate_claim};
use crate::{Problem, StableHasher, Task, TaskError, check_difficulty, generated};

/// Level 1: three numbers in 1..=20; level 2 and up: four in 1..=100.
pub const MAX_LEVEL: u32 = u32::MAX;

const HELD_OUT_KEY: u64 = 0x636f_756e_745f_686f; // "count_ho"
const TRAIN_KEY: u64 = 0x636f_756e_745f_7472; // "count_tr"
const EVAL_SEED: u64 = 0x636f_756e_745f_6576; // "count_ev"
const HELD_OUT_MODULUS: u64 = 10;

/// The countdown task at one difficulty level.
#[derive(Debug, Clone)]
pub struct Countdown {
    seed: u64,
    level: u32,
}

impl Countdown {
    pub fn new(seed: u64, difficulty: u32) -> Result<Self, TaskError> {
        check_difficulty(difficulty, MAX_LEVEL)?;
        Ok(Self {
            seed,
            level: difficulty,
        })
    }

    fn shape(&self) -> (usize, u64) {
        if self.level == 1 { (3, 20) } else { (4, 100) }
    }

    /// A random puzzle: random numbers combined by a random expression tree,
    /// redrawn until the value is a positive integer.
    fn draw(&self, rng: &mut SmallRng) -> Puzzle {
        let (count, max) = self.shape();
        loop {
            let mut parts: Vec<(Tree, Ratio)> = (0..count)
                .map(|_| {
                    let n = rng.random_range(1..=max);
                    (Tree::Leaf(n), Ratio::int(i128::from(n)))
                })
                .collect();
            let mut ok = true;
            while parts.len() > 1 {
                let (l, lv) = parts.swap_remove(rng.random_range(0..parts.len()));
                let (r, rv) = parts.swap_remove(rng.random_range(0..parts.len()));
                let op = [Op::Add, Op::Sub, Op::Mul, Op::Div][rng.random_range(0..4)];
                match op.apply(lv, rv) {
                    Ok(v) => parts.push((Tree::Node(Box::new(l), op, Box::new(r)), v)),
                    Err(_) => {
                        ok = false;
                        break;
                    }
                }
            }
            let Some((tree, value)) = parts.pop() else {
                continue;
            };
            if !ok || value.den != 1 || value.num <= 0 {
                continue;
            }
            let Ok(target) = u64::try_from(value.num) else {
                continue;
            };
            let mut numbers = Vec::with_capacity(count);
            tree.leaves(&mut numbers);
            numbers.sort_unstable();
            let mut solution = String::new();
            tree.write(&mut solution);
            return Puzzle {
                numbers,
                target,
                solution,
            };
        }
    }
}

/// A problem's identity is its sorted numbers and target; the solution is
/// one of possibly many.
#[derive(Debug, Clone)]
pub(crate) struct Puzzle {
    numbers: Vec<u64>,
    target: u64,
    solution: String,
}

impl Puzzle {
    fn key(&self) -> (Vec<u64>, u64) {
        (self.numbers.clone(), self.target)
    }

    fn held_out(&self) -> bool {
        let mut h = StableHasher::new(HELD_OUT_KEY).word(self.numbers.len() as u64);
        for &n in &self.numbers {
            h = h.word(n);
        }
        h.word(self.target)
            .finish()
            .is_multiple_of(HELD_OUT_MODULUS)
    }

    fn problem(&self, id: String) -> Problem {
        let numbers: Vec<String> = self.numbers.iter().map(u64::to_string).collect();
        Problem {
            id,
            prompt: format!("Use {} to make {}: ", numbers.join(" "), self.target),
            answer: self.target.to_string(),
            solution: self.solution.clone(),
        }
    }
}

/// The numbers of a prompt this task wrote (`Use 3 5 7 to make 22: `).
pub fn parse_prompt(prompt: &str) -> Option<Vec<u64>> {
    let rest = prompt.strip_prefix("Use ")?;
    let (numbers, _) = rest.split_once(" to make ")?;
    numbers.split_whitespace().map(|n| n.parse().ok()).collect()
}

/// Whether `completion` reaches `target` using each of `numbers` exactly
/// once. Surrounding whitespace and one trailing `= <target>` are
/// tolerated; a trailing `= <other number>` is a wrong claim and fails.
pub fn check(numbers: &[u64], target: u64, completion: &str) -> bool {
    let Ok(eval) = evaluate_claim(completion) else {
        return false;
    };
    if eval.value != Ratio::int(i128::from(target)) {
        return false;
    }
    let mut used = eval.literals;
    let mut given: Vec<i128> = numbers.iter().map(|&n| i128::from(n)).collect();
    used.sort_unstable();
    given.sort_unstable();
    used == given
}

/// A generated solution's expression tree.
#[derive(Debug, Clone)]
pub(crate) enum Tree {
    Leaf(u64),
    Node(Box<Tree>, Op, Box<Tree>),
}

impl Tree {
    fn precedence(&self) -> u8 {
        match self {
            Tree::Leaf(_) => 3,
            Tree::Node(_, op, _) => op.precedence(),
        }
    }

    fn leaves(&self, out: &mut Vec<u64>) {
        match self {
            Tree::Leaf(n) => out.push(*n),
            Tree::Node(l, _, r) => {
                l.leaves(out);
                r.leaves(out);
            }
        }
    }

    /// The expression as [`Tree::write`] writes it.
    pub(crate) fn text(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    /// Writes the expression with only the parentheses it needs: around a
    /// looser child, and around an equally tight right child of `-` or `/`.
    fn write(&self, out: &mut String) {
        match self {
            Tree::Leaf(n) => out.push_str(&n.to_string()),
            Tree::Node(l, op, r) => {
                let p = op.precedence();
                write_child(l, l.precedence() < p, out);
                out.push(op.symbol());
                let tight = matches!(op, Op::Sub | Op::Div);
                write_child(r, r.precedence() < p || (tight && r.precedence() == p), out);
            }
        }
    }
}

fn write_child(t: &Tree, parens: bool, out: &mut String) {
    if parens {
        out.push('(');
    }
    t.write(out);
    if parens {
        out.push(')');
    }
}

impl generated::Generated for Countdown {
    type Item = Puzzle;
    type Key = (Vec<u64>, u64);
    const NAME: &'static str = "countdown";
    const TRAIN_KEY: u64 = TRAIN_KEY;
    const EVAL_SEED: u64 = EVAL_SEED;

    fn seed(&self) -> u64 {
        self.seed
    }

    fn level(&self) -> u32 {
        self.level
    }

    fn draw(&self, rng: &mut SmallRng) -> Puzzle {
        Countdown::draw(self, rng)
    }

    fn held_out(item: &Puzzle) -> bool {
        item.held_out()
    }

    fn key(item: &Puzzle) -> (Vec<u64>, u64) {
        item.key()
    }

    fn problem(item: &Puzzle, id: String) -> Problem {
        item.problem(id)
    }
}

impl Task for Countdown {
    fn name(&self) -> &str {
        "countdown"
    }

    fn train_problem(&self, index: u64) -> Problem {
        generated::train_problem(self, index)
    }

    fn eval_problems(&self, n: usize) -> Vec<Problem> {
        generated::eval_problems(self, n)
    }

    /// 1 when the completion reaches the answer with the prompt's numbers.
    fn score(&self, problem: &Problem, completion: &str) -> f32 {
        let (Some(numbers), Ok(target)) = (parse_prompt(&problem.prompt), problem.answer.parse())
        else {
            return 0.0;
        };
        if check(&numbers, target, completion) {
            1.0
        } else {
            0.0
        }
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }

    /// An expression the parser accepts, whatever its value and numbers.
    fn well_formed(&self, _problem: &Problem, completion: &str) -> bool {
        evaluate_claim(completion).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn check_table() {
        let numbers = [3, 5, 7];
        let cases = [
            ("3*5+7", true),
            ("7+5*3", true),
            ("  3 * 5 + 7  ", true),
            ("\n3*5+7\n", true),
            ("3*5+7=22", true),
            ("3*5+7 = 22", true),
            ("(3*5)+7 =  22 ", true),
            ("3*5+7 = 23", false),
            ("3*5+7 = 22 = 22", false),
            ("3*5+7 = 22.", false),
            ("3*5+7 = ", false),
            ("= 22", false),
            ("22", false),
            ("3*5+7+0", false),
            ("3*5+7*1", false),
            ("3*7+1", false),
            ("3*5+5+2", false),
            ("5*3+7+3-3", false),
            ("3*5", false),
            ("3*5+7 abc", false),
            ("3*5+7.", false),
            ("3*5+7\n\nSo the answer is 22", false),
            ("", false),
            ("🎉", false),
            ("0/0", false),
        ];
        for (completion, want) in cases {
            assert_eq!(check(&numbers, 22, completion), want, "{completion:?}");
        }
        // Fractions on the way are fine; only the result must be exact.
        assert!(check(&[1, 3, 6], 2, "(1/3)*6"));
        assert!(check(&[4, 4, 8], 1, "4/(8-4)"));
        assert!(!check(&[4, 4, 8], 1, "4/(8-4-4+4)"));
        // A number given twice may (and must) be used twice.
        assert!(check(&[5, 5, 2], 12, "5+5+2"));
        assert!(!check(&[5, 5, 2], 7, "5+2"));
        let long = format!("3*5+7{}", " ".repeat(MAX_LEN));
        assert!(
            check(&numbers, 22, &long),
            "trailing whitespace is trimmed first"
        );
        let long = format!("3*5+7+{}0", "0*".repeat(MAX_LEN));
        assert!(!check(&numbers, 22, &long));
    }

    #[test]
    fn prompt_round_trips() {
        assert_eq!(parse_prompt("Use 3 5 7 to make 22: "), Some(vec![3, 5, 7]));
        assert_eq!(parse_prompt("Use 3 x 7 to make 22: "), None);
        assert_eq!(parse_prompt("37+45="), None);
        assert_eq!(parse_prompt(""), None);
        let t = Countdown::new(0, 1).unwrap();
        let weird = Problem {
            id: "w".into(),
            prompt: "garbage".into(),
            answer: "banana".into(),
            solution: String::new(),
        };
        assert_eq!(t.score(&weird, "3*5+7"), 0.0);
    }

    #[test]
    fn generated_solutions_verify() {
        for level in [1, 2, 3] {
            let t = Countdown::new(11, level).unwrap();
            let (count, max) = t.shape();
            let problems: Vec<_> = (0..500)
                .map(|i| t.train_problem(i))
                .chain(t.eval_problems(200))
                .collect();
            for p in &problems {
                assert_eq!(t.score(p, &p.solution), 1.0, "{p:?}");
                assert!(t.well_formed(p, &p.solution));
                assert!(p.prompt.bytes().all(|b| (32..127).contains(&b)), "{p:?}");
                let numbers = parse_prompt(&p.prompt).unwrap();
                assert_eq!(numbers.len(), count);
                assert!(numbers.iter().all(|&n| (1..=max).contains(&n)));
                assert!(numbers.is_sorted());
                assert!(p.answer.parse::<u64>().unwrap() > 0);
                assert_eq!(t.score(p, ""), 0.0);
            }
        }
        let p = Puzzle {
            numbers: vec![3, 5, 7],
            target: 22,
            solution: "3*5+7".into(),
        }
        .problem("x".into());
        assert_eq!(p.prompt, "Use 3 5 7 to make 22: ");
    }

    #[test]
    fn solutions_use_only_needed_parentheses() {
        use Tree::{Leaf, Node};
        let n = |l: Tree, op, r: Tree| Node(Box::new(l), op, Box::new(r));
        let cases = [
            (n(n(Leaf(3), Op::Mul, Leaf(5)), Op::Add, Leaf(7)), "3*5+7"),
            (n(Leaf(3), Op::Mul, n(Leaf(5), Op::Add, Leaf(7))), "3*(5+7)"),
            (n(Leaf(9), Op::Sub, n(Leaf(5), Op::Sub, Leaf(1))), "9-(5-1)"),
            (n(Leaf(9), Op::Add, n(Leaf(5), Op::Sub, Leaf(1))), "9+5-1"),
            (n(Leaf(8), Op::Div, n(Leaf(4), Op::Mul, Leaf(2))), "8/(4*2)"),
            (n(n(Leaf(8), Op::Div, Leaf(4)), Op::Div, Leaf(2)), "8/4/2"),
        ];
        for (tree, want) in cases {
            let mut s = String::new();
            tree.write(&mut s);
            assert_eq!(s, want);
        }
    }

    #[test]
    fn deterministic_disjoint_and_seed_independent_eval() {
        for level in [1, 2] {
            let a: Vec<_> = (0..100)
                .map(|i| Countdown::new(5, level).unwrap().train_problem(i))
                .collect();
            let b: Vec<_> = (0..100)
                .map(|i| Countdown::new(5, level).unwrap().train_problem(i))
                .collect();
            let c: Vec<_> = (0..100)
                .map(|i| Countdown::new(6, level).unwrap().train_problem(i))
                .collect();
            assert_eq!(a, b);
            assert_ne!(a, c);

            let t = Countdown::new(5, level).unwrap();
            let eval = t.eval_problems(500);
            assert_eq!(eval, Countdown::new(6, level).unwrap().eval_problems(500));
            assert_eq!(eval.len(), 500);
            let key = |p: &Problem| (p.prompt.clone(), p.answer.clone());
            let eval: HashSet<_> = eval.iter().map(key).collect();
            assert_eq!(eval.len(), 500);
            for i in 0..2000 {
                let p = t.train_problem(i);
                assert!(!eval.contains(&key(&p)), "{p:?}");
            }
        }
    }
}
