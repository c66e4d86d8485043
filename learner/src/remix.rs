//! ReMix's schedule and replay (spec §2.13, survey notes §4; secondary
//! sources, values unverified against the paper): each batch mixes a share
//! `p` of groups replayed from the last `N` batches into the fresh ones,
//! the KL-Convex penalty `β[λ KL(π_θ‖π_base) + (1−λ) KL(π_θ‖π_{k−1})]`
//! follows `λ(t) = max(1 − 0.1·⌈max(t − 50, 0)/10⌉, 0.5)`, and at batch
//! `T` the policy is reincarnated: `π_base ← π_T`, replay stops.
//!
//! `t` counts batches (training iterations), not optimiser updates;
//! `π_{k−1}` is the policy at the start of the previous batch. The replay
//! memory is the learner's (the groups as trained, with their behaviour
//! log-probs and per-token versions) and is saved with every checkpoint.

use std::collections::VecDeque;

use rand::{SeedableRng, rngs::SmallRng, seq::SliceRandom, seq::index};
use serde::{Deserialize, Serialize};

use crate::{config_error::ConfigError, rollouts::TrainGroup};

/// `[learner.remix]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemixConfig {
    /// Share `p` of each batch's groups replayed from earlier batches.
    pub off_policy_fraction: f64,
    /// Replay from the last `N` batches.
    pub policies: u64,
    /// β of the KL-Convex penalty: the verl config in the authors'
    /// repository (`kl_loss_coef` 0.001, `low_var_kl`: k3), which holds no
    /// ReMix training code.
    pub kl_coef: f64,
    /// Entropy bonus (that config's `entropy_coeff` 0.001);
    /// `learner.entropy_coef` is refused with ReMix.
    pub entropy_coef: f64,
    /// `T`: batches before reincarnation; 0 never reincarnates.
    pub reincarnate_at: u64,
    /// λ stays 1 for this many batches...
    pub lambda_hold: u64,
    /// ...then falls by `lambda_step` every `lambda_every` batches...
    pub lambda_every: u64,
    pub lambda_step: f64,
    /// ...down to this floor.
    pub lambda_floor: f64,
}

impl Default for RemixConfig {
    fn default() -> Self {
        Self {
            off_policy_fraction: 0.4,
            policies: 2,
            kl_coef: 0.001,
            entropy_coef: 0.001,
            reincarnate_at: 50,
            lambda_hold: 50,
            lambda_every: 10,
            lambda_step: 0.1,
            lambda_floor: 0.5,
        }
    }
}

impl RemixConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |f: &str, m: String| Err(ConfigError::new(&format!("remix.{f}"), m));
        let p = self.off_policy_fraction;
        if !(0.0..1.0).contains(&p) {
            return bad("off_policy_fraction", format!("{p} must be in [0, 1)"));
        }
        if p > 0.0 && self.policies == 0 {
            return bad(
                "policies",
                "must be at least 1 when off_policy_fraction > 0".into(),
            );
        }
        if !(self.kl_coef.is_finite() && self.kl_coef >= 0.0) {
            return bad("kl_coef", format!("{} must be >= 0", self.kl_coef));
        }
        if !(self.entropy_coef.is_finite() && self.entropy_coef >= 0.0) {
            return bad(
                "entropy_coef",
                format!("{} must be >= 0", self.entropy_coef),
            );
        }
        if self.lambda_every == 0 {
            return bad("lambda_every", "must be at least 1".into());
        }
        let f = self.lambda_floor;
        if !(0.0..=1.0).contains(&f) {
            return bad("lambda_floor", format!("{f} must be in [0, 1]"));
        }
        Ok(())
    }

    /// `λ(t) = max(1 − step·⌈max(t − hold, 0)/every⌉, floor)`.
    pub fn lambda(&self, t: u64) -> f64 {
        let past = t.saturating_sub(self.lambda_hold);
        let k = past.div_ceil(self.lambda_every);
        (1.0 - self.lambda_step * k as f64).max(self.lambda_floor)
    }

    /// Batch `t` trains after reincarnation (no replay, `π_base = π_T`).
    pub fn reincarnated(&self, t: u64) -> bool {
        self.reincarnate_at > 0 && t >= self.reincarnate_at
    }

    /// Replayed groups to add to `fresh` fresh ones so that they are a
    /// share `p` of the batch.
    pub fn replay_count(&self, fresh: usize) -> usize {
        let p = self.off_policy_fraction;
        (p / (1.0 - p) * fresh as f64).round() as usize
    }
}

/// The groups of the last `N` batches, by batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RemixMemory {
    batches: VecDeque<(u64, Vec<TrainGroup>)>,
}

impl RemixMemory {
    /// Refuses, naming the group and sequence, a memory read back from a
    /// checkpoint that a step could not lay out.
    pub fn check(&self, vocab: usize, max_len: usize) -> Result<(), String> {
        for g in self.batches.iter().flat_map(|(_, g)| g) {
            for (i, s) in g.sequences.iter().enumerate() {
                s.check(vocab, max_len).map_err(|m| {
                    format!("ReMix's memory, group {}, sequence {i}: {m}", g.group_id)
                })?;
            }
        }
        Ok(())
    }

    pub fn groups(&self) -> usize {
        self.batches.iter().map(|(_, g)| g.len()).sum()
    }

    /// Batch `t`'s groups: `fresh` with replayed ones mixed in (none
    /// after reincarnation), in a seeded random order so that every
    /// mini-batch gets its share.
    pub fn mix(&self, cfg: &RemixConfig, t: u64, fresh: &[TrainGroup], seed: u64) -> Mixed {
        let mut rng = SmallRng::seed_from_u64(seed);
        let pool: Vec<&TrainGroup> = self.batches.iter().flat_map(|(_, g)| g).collect();
        let n = if cfg.reincarnated(t) {
            0
        } else {
            cfg.replay_count(fresh.len()).min(pool.len())
        };
        let mut groups: Vec<TrainGroup> = fresh.to_vec();
        groups.extend(
            index::sample(&mut rng, pool.len(), n)
                .into_iter()
                .map(|i| pool[i].clone()),
        );
        groups.shuffle(&mut rng);
        Mixed {
            groups,
            replayed: n,
        }
    }

    /// Remembers batch `t`'s fresh groups and forgets batches older than
    /// the last `N`; after reincarnation nothing is kept.
    pub fn remember(&mut self, cfg: &RemixConfig, t: u64, fresh: &[TrainGroup]) {
        if cfg.reincarnated(t + 1) || cfg.policies == 0 {
            self.batches.clear();
            return;
        }
        self.batches.push_back((t, fresh.to_vec()));
        while self.batches.len() as u64 > cfg.policies {
            self.batches.pop_front();
        }
    }
}

/// A batch with its replayed share.
pub struct Mixed {
    pub groups: Vec<TrainGroup>,
    pub replayed: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollouts::Sequence;

    fn group(id: &str) -> TrainGroup {
        TrainGroup {
            group_id: id.into(),
            sequences: vec![Sequence {
                prompt: vec![1],
                response: vec![2],
                behavior_logprobs: vec![-0.1],
                versions: vec![0],
                reward: 1.0,
                ..Default::default()
            }],
            sequence_number: 0,
        }
    }

    /// Reviewer 4's quotation: λ = 1 up to t = 50, 0.9 for 51..=60, 0.8
    /// for 61..=70, ..., floored at 0.5 from t = 91.
    #[test]
    fn lambda_follows_the_quoted_schedule() {
        let c = RemixConfig::default();
        let got: Vec<f64> = [0, 50, 51, 60, 61, 70, 81, 90, 91, 500]
            .iter()
            .map(|&t| c.lambda(t))
            .collect();
        let want = [1.0, 1.0, 0.9, 0.9, 0.8, 0.8, 0.6, 0.6, 0.5, 0.5];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
    }

    #[test]
    fn a_batch_is_a_share_p_replayed_from_the_last_n_batches() {
        let cfg = RemixConfig {
            off_policy_fraction: 0.4,
            policies: 2,
            reincarnate_at: 10,
            ..Default::default()
        };
        let mut m = RemixMemory::default();
        let batch =
            |t: u64| -> Vec<TrainGroup> { (0..6).map(|i| group(&format!("b{t}-{i}"))).collect() };
        assert_eq!(m.mix(&cfg, 0, &batch(0), 1).replayed, 0, "nothing yet");
        for t in 0..3 {
            m.remember(&cfg, t, &batch(t));
        }
        assert_eq!(m.groups(), 12, "the last two batches");
        let mixed = m.mix(&cfg, 3, &batch(3), 1);
        // 0.4/0.6 × 6 = 4 replayed of 10.
        assert_eq!((mixed.replayed, mixed.groups.len()), (4, 10));
        let replayed: Vec<_> = mixed
            .groups
            .iter()
            .filter(|g| !g.group_id.starts_with("b3"))
            .collect();
        assert_eq!(replayed.len(), 4);
        assert!(replayed.iter().all(|g| !g.group_id.starts_with("b0")));
        // After reincarnation: nothing replayed, nothing kept.
        assert_eq!(m.mix(&cfg, 10, &batch(10), 1).replayed, 0);
        m.remember(&cfg, 9, &batch(9));
        assert_eq!(m.groups(), 0);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let c = RemixConfig {
            off_policy_fraction: 1.0,
            ..Default::default()
        };
        assert_eq!(
            c.validate().unwrap_err().field,
            "learner.remix.off_policy_fraction"
        );
        RemixConfig::default().validate().unwrap();
    }
}
