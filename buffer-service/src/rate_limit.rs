//! Reverb's sample-to-insert ratio limiter, for the replay modes.
//!
//! With replay the learner could train on the same stale groups forever, or
//! actors could fill the buffer far ahead of the learner. The limiter keeps
//! `inserts * samples_per_insert − samples` inside a window of
//! `± error_buffer` around `samples_per_insert * min_size`: a sample that
//! would leave the window below waits for inserts, an insert that would leave
//! it above waits for samples.

use crate::{config::BufferConfig, ledger::Ledger};

#[derive(Debug, Clone, Copy)]
pub struct RateLimiter {
    samples_per_insert: f64,
    min_diff: f64,
    max_diff: f64,
}

impl RateLimiter {
    /// The limiter of the replay modes; `None` in FIFO, where each group is
    /// handed out once and the staleness bound alone paces the actors.
    pub fn from_config(cfg: &BufferConfig) -> Option<Self> {
        cfg.sampling.replays().then(|| {
            Self::new(
                cfg.samples_per_insert,
                cfg.rate_limit_error_buffer,
                cfg.batch_groups as u64,
            )
        })
    }

    /// `min_size`: groups that must have been inserted before the first
    /// sample (a batch).
    pub fn new(samples_per_insert: f64, error_buffer: f64, min_size: u64) -> Self {
        let centre = samples_per_insert * min_size as f64;
        Self {
            samples_per_insert,
            min_diff: centre - error_buffer,
            max_diff: centre + error_buffer,
        }
    }

    fn diff(&self, l: &Ledger) -> f64 {
        l.inserted as f64 * self.samples_per_insert - l.samples as f64
    }

    /// Outstanding leases count as inserts: their groups will be inserted
    /// without asking again.
    pub fn can_insert(&self, l: &Ledger) -> bool {
        let leased = l.leased as f64 * self.samples_per_insert;
        self.diff(l) + leased + self.samples_per_insert <= self.max_diff
    }

    pub fn can_sample(&self, l: &Ledger, n: u64) -> bool {
        self.diff(l) - n as f64 >= self.min_diff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_samples_per_insert_within_the_error_buffer() {
        // 2 samples per insert, batches of 4, slack 8.
        let rl = RateLimiter::new(2.0, 8.0, 4);
        let mut l = Ledger::default();
        // Inserts may run ahead until diff + 2 > 16.
        while rl.can_insert(&l) {
            l.inserted += 1;
        }
        assert_eq!(l.inserted, 8);
        // Now sampling drains: 16 − n ≥ 0 allows 16 draws in total.
        let mut drawn = 0;
        while rl.can_sample(&l, 4) {
            l.samples += 4;
            drawn += 4;
        }
        assert_eq!(drawn, 16);
        assert!(rl.can_insert(&l));
    }

    #[test]
    fn leases_count_as_inserts() {
        let rl = RateLimiter::new(1.0, 2.0, 4);
        let mut l = Ledger {
            inserted: 5,
            ..Default::default()
        };
        assert!(rl.can_insert(&l));
        l.leased = 1;
        assert!(!rl.can_insert(&l));
    }

    #[test]
    fn sampling_waits_for_the_first_inserts() {
        let rl = RateLimiter::new(1.0, 2.0, 4);
        let mut l = Ledger::default();
        assert!(!rl.can_sample(&l, 4));
        l.inserted = 6;
        assert!(rl.can_sample(&l, 4));
    }
}
