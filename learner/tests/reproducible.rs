//! The same seed gives the same run: initial weights from the seed, then
//! bit-identical losses, step after step, on the same batches. Alone in its
//! binary because the device's seed is process-wide: another test seeding
//! or drawing concurrently would interleave with this one's draws.

mod common;

use bapo_learner::{Trainer, config::Proximal};
use common::{config, group, tiny_policy};

/// Losses of 3 batches × 4 updates (decoupled PPO, recomputed proximal
/// policy, 2 epochs × 2 mini-batches), as bits.
fn run(seed: u64) -> Vec<u64> {
    let behaviour = tiny_policy(seed);
    let groups: Vec<_> = (0..2).map(|i| group(&behaviour, i, 0)).collect();
    let mut cfg = config("decoupled");
    cfg.proximal = Proximal::Recompute;
    cfg.epochs = 2;
    cfg.mini_batches = 2;
    let mut t = Trainer::new(cfg, tiny_policy(seed + 1), 0).unwrap();
    (0..3)
        .flat_map(|_| t.train_batch(&groups).unwrap())
        .map(|r| r.loss.to_bits())
        .collect()
}

#[test]
fn the_same_seed_gives_the_same_losses() {
    let a = run(50);
    assert_eq!(a.len(), 12);
    assert_eq!(a, run(50), "same seed, different losses");
    assert_ne!(a, run(60), "the seed does not reach the weights");
}
