//! The train and held-out streams of a generated task (arith, countdown):
//! the `index`-th training item comes from its own seeded stream and skips
//! held-out items, and the held-out set is drawn in one fixed order, so
//! both are the same on every machine and never overlap.

use std::{collections::HashSet, hash::Hash};

use rand::{SeedableRng, rngs::SmallRng};

use crate::StableHasher;

/// Draws in a row that may bring no new held-out item before the set is
/// taken as exhausted (small levels have few distinct items).
const EVAL_STALL: usize = 100_000;

/// The `index`-th training item of the stream `(train_key, seed)`: drawn
/// until one is not held out.
pub(crate) fn train_item<T>(
    train_key: u64,
    seed: u64,
    index: u64,
    mut draw: impl FnMut(&mut SmallRng) -> T,
    held_out: impl Fn(&T) -> bool,
) -> T {
    let key = StableHasher::new(train_key).word(seed).word(index).finish();
    let mut rng = SmallRng::seed_from_u64(key);
    loop {
        let item = draw(&mut rng);
        if !held_out(&item) {
            return item;
        }
    }
}

/// Up to `n` distinct held-out items (distinct by `key`), in the fixed
/// order of the stream `eval_seed`.
pub(crate) fn held_out_items<T, K: Eq + Hash>(
    eval_seed: u64,
    n: usize,
    mut draw: impl FnMut(&mut SmallRng) -> T,
    held_out: impl Fn(&T) -> bool,
    key: impl Fn(&T) -> K,
) -> Vec<T> {
    let mut rng = SmallRng::seed_from_u64(eval_seed);
    let mut seen = HashSet::new();
    let mut items = Vec::new();
    let mut stale = 0;
    while items.len() < n && stale < EVAL_STALL {
        let item = draw(&mut rng);
        if held_out(&item) && seen.insert(key(&item)) {
            items.push(item);
            stale = 0;
        } else {
            stale += 1;
        }
    }
    items
}
