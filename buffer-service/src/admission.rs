//! Whether a *new group* may enter the buffer. Two rules, both checked when a
//! group's first rollout arrives (later members of an admitted group always
//! get in, or a half-admitted group could block the buffer forever):
//!
//! * the staleness bound, as in AReaL: every group the learner will train on
//!   (already retired + held + in flight) must fit into
//!   `(max_staleness + version + 1) * batch_groups`. Retired groups count
//!   because the learner consumes one batch per version: with `r` groups
//!   retired at version `v ≈ r / batch_groups`, the bound leaves room for
//!   `(max_staleness + 1)` batches ahead of the learner, so nothing admitted
//!   can be more than `max_staleness` versions old when it is trained on.
//!   Counting only held groups would let the bound grow with the version.
//! * the capacity bound, in groups and bytes.
//!
//! A group that fails either waits (backpressure); evicted groups leave the
//! ledger and free room, so actors regenerate fresh data instead.

/// Counts of groups, kept under one short lock touched once per group.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// Groups handed out for the last time (or, for FIFO, once).
    pub retired: u64,
    /// Groups held: pending (assembling) plus ready.
    pub held: u64,
    /// Groups ever admitted, for the replay rate limiter.
    pub inserted: u64,
    /// Group draws handed to the learner, for the replay rate limiter.
    pub samples: u64,
}

impl Ledger {
    /// Groups counted against the staleness bound.
    pub fn admitted(&self) -> u64 {
        self.retired + self.held
    }
}

/// AReaL's admission bound on groups ahead of the learner.
#[derive(Debug, Clone, Copy)]
pub struct StalenessBound {
    pub max_staleness: u64,
    pub batch_groups: u64,
}

impl StalenessBound {
    /// Most groups that may have been admitted at this learner version.
    pub fn limit(&self, version: u64) -> u64 {
        self.max_staleness
            .saturating_add(version)
            .saturating_add(1)
            .saturating_mul(self.batch_groups)
    }

    pub fn admits(&self, ledger: &Ledger, version: u64) -> bool {
        ledger.admitted() < self.limit(version)
    }
}

/// The buffer's size bound.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub groups: u64,
    pub bytes: u64,
}

impl Capacity {
    pub fn has_room(&self, held_groups: u64, held_bytes: u64) -> bool {
        held_groups < self.groups && held_bytes < self.bytes
    }
}

/// Why a new group has to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Admitting it would break the staleness bound.
    Staleness,
    /// The buffer is at capacity.
    Full,
    /// The replay rate limiter says actors are too far ahead of the learner.
    RateLimited,
}

impl Hold {
    pub const ALL: [Hold; 3] = [Hold::Staleness, Hold::Full, Hold::RateLimited];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            Hold::Staleness => "staleness",
            Hold::Full => "capacity",
            Hold::RateLimited => "rate_limit",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synchronous_bound_admits_one_batch_per_version() {
        let b = StalenessBound {
            max_staleness: 0,
            batch_groups: 4,
        };
        let mut l = Ledger::default();
        for _ in 0..4 {
            assert!(b.admits(&l, 0));
            l.held += 1;
        }
        assert!(!b.admits(&l, 0), "a second batch must wait for version 1");
        // The learner takes the batch: retired groups still count.
        l.held -= 4;
        l.retired += 4;
        assert!(!b.admits(&l, 0));
        assert!(b.admits(&l, 1));
    }

    #[test]
    fn bound_leaves_max_staleness_plus_one_batches_ahead() {
        let b = StalenessBound {
            max_staleness: 2,
            batch_groups: 8,
        };
        let l = Ledger {
            retired: 80,
            held: 23,
            ..Default::default()
        };
        // version 10: limit (2 + 10 + 1) * 8 = 104.
        assert_eq!(b.limit(10), 104);
        assert!(b.admits(&l, 10));
        let l = Ledger { held: 24, ..l };
        assert!(!b.admits(&l, 10));
    }

    #[test]
    fn eviction_frees_room() {
        let b = StalenessBound {
            max_staleness: 0,
            batch_groups: 2,
        };
        let mut l = Ledger {
            held: 2,
            ..Default::default()
        };
        assert!(!b.admits(&l, 0));
        l.held -= 1; // evicted, not retired
        assert!(b.admits(&l, 0));
    }

    #[test]
    fn capacity_counts_groups_and_bytes() {
        let c = Capacity {
            groups: 2,
            bytes: 100,
        };
        assert!(c.has_room(1, 99));
        assert!(!c.has_room(2, 0));
        assert!(!c.has_room(0, 100));
    }
}
