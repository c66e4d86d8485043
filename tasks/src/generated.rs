//! The train and held-out streams of a generated task (arith, countdown):
//! the `index`-th training item comes from its own seeded stream and skips
//! held-out items, and the held-out set is drawn in one fixed order, so
//! both are the same on every machine and never overlap. A task states how
//! it draws, tests and names an item ([`Generated`]); the streams are here.

use std::{collections::HashSet, hash::Hash};

use rand::{SeedableRng, rngs::SmallRng};

use crate::{Problem, StableHasher};

/// Draws in a row that may bring no new held-out item before the set is
/// taken as exhausted (small levels have few distinct items).
const EVAL_STALL: usize = 100_000;

/// What a generated task tells the streams.
pub(crate) trait Generated {
    type Item;
    type Key: Eq + Hash;
    /// Problem ids start with it (`arith`, `countdown`).
    const NAME: &'static str;
    /// Keys of the training stream and of the held-out stream.
    const TRAIN_KEY: u64;
    const EVAL_SEED: u64;
    fn seed(&self) -> u64;
    fn level(&self) -> u32;
    fn draw(&self, rng: &mut SmallRng) -> Self::Item;
    fn held_out(item: &Self::Item) -> bool;
    /// What makes two held-out items the same one.
    fn key(item: &Self::Item) -> Self::Key;
    fn problem(item: &Self::Item, id: String) -> Problem;
}

/// The `index`-th training problem: drawn from the stream
/// `(TRAIN_KEY, seed, index)` until one is not held out.
pub(crate) fn train_problem<G: Generated>(g: &G, index: u64) -> Problem {
    let key = StableHasher::new(G::TRAIN_KEY)
        .word(g.seed())
        .word(index)
        .finish();
    let mut rng = SmallRng::seed_from_u64(key);
    loop {
        let item = g.draw(&mut rng);
        if !G::held_out(&item) {
            let id = format!("{}{}-s{}-{index}", G::NAME, g.level(), g.seed());
            return G::problem(&item, id);
        }
    }
}

/// Up to `n` distinct held-out problems, in the fixed order of the stream
/// `EVAL_SEED`.
pub(crate) fn eval_problems<G: Generated>(g: &G, n: usize) -> Vec<Problem> {
    let mut rng = SmallRng::seed_from_u64(G::EVAL_SEED);
    let mut seen = HashSet::new();
    let mut problems = Vec::new();
    let mut stale = 0;
    while problems.len() < n && stale < EVAL_STALL {
        let item = g.draw(&mut rng);
        if G::held_out(&item) && seen.insert(G::key(&item)) {
            let id = format!("{}{}-eval-{}", G::NAME, g.level(), problems.len());
            problems.push(G::problem(&item, id));
            stale = 0;
        } else {
            stale += 1;
        }
    }
    problems
}
