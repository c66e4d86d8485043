//! The held-out problems of a task, split in two: a **validation** half for
//! tuning and in-run evaluation, and a **test** half reported once at the
//! end. A number that chose a setting cannot then also be the number that
//! reports it.
//!
//! A problem's half is a keyed hash of its prompt, so it does not depend on
//! how many problems were asked for, on the task seed, or on the order the
//! task lists them in: asking for more never moves a problem across.

use crate::{Problem, Task};

/// Which half of the held-out problems.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Validation,
    Test,
}

/// Key of the split hash ("val_test"): unrelated to any task's own keys.
const SPLIT_KEY: u64 = 0x7661_6c5f_7465_7374;

impl Split {
    /// The half `problem` belongs to.
    pub fn of(problem: &Problem) -> Self {
        // FNV-1a over the key and the prompt: stable across Rust versions,
        // unlike `DefaultHasher`.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ SPLIT_KEY;
        for b in problem.prompt.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        if (h >> 32) & 1 == 0 {
            Self::Validation
        } else {
            Self::Test
        }
    }

    /// The first `n` held-out problems of `task` in this half (fewer if the
    /// held-out pool runs out), in the task's own order.
    pub fn problems(self, task: &dyn Task, n: usize) -> Vec<Problem> {
        let mut asked = n.saturating_mul(2).max(16);
        loop {
            let pool = task.eval_problems(asked);
            let exhausted = pool.len() < asked;
            let mine: Vec<Problem> = pool.into_iter().filter(|p| Self::of(p) == self).collect();
            if mine.len() >= n || exhausted {
                return mine.into_iter().take(n).collect();
            }
            asked = asked.saturating_mul(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arith, Countdown};
    use std::collections::HashSet;

    fn prompts(p: &[Problem]) -> HashSet<String> {
        p.iter().map(|p| p.prompt.clone()).collect()
    }

    #[test]
    fn halves_are_disjoint_and_each_is_about_half() {
        let task = Arith::new(0, 2).unwrap();
        let all = task.eval_problems(2000);
        let val = all
            .iter()
            .filter(|p| Split::of(p) == Split::Validation)
            .count();
        assert!((800..1200).contains(&val), "{val} of 2000 in validation");
        let v = prompts(&Split::Validation.problems(&task, 300));
        let t = prompts(&Split::Test.problems(&task, 300));
        assert_eq!((v.len(), t.len()), (300, 300));
        assert!(v.is_disjoint(&t));
    }

    #[test]
    fn asking_for_more_extends_without_moving_a_problem() {
        let task = Countdown::new(3, 1).unwrap();
        let few = Split::Test.problems(&task, 20);
        let more = Split::Test.problems(&task, 200);
        assert_eq!(few[..], more[..20]);
        assert!(more.iter().all(|p| Split::of(p) == Split::Test));
    }

    #[test]
    fn a_small_pool_gives_what_it_has() {
        // Level 1 holds out about 2,000 problems: half is about 1,000.
        let task = Arith::new(0, 1).unwrap();
        let v = Split::Validation.problems(&task, 100_000);
        assert!((800..1200).contains(&v.len()), "{}", v.len());
    }
}
