//! Whether a *new group* may enter the buffer: a list of small [`Rule`]s,
//! composed by [`Admission::from_config`] and checked in order when a
//! group's first rollout arrives (later members of an admitted group always
//! get in, or a half-admitted group could block the buffer forever). As in
//! Reverb, each concern is a type chosen by configuration, so the store
//! calls one list instead of branching on settings:
//!
//! * the staleness bound, as in AReaL: every group the learner will train on
//!   (already consumed + held + leased, i.e. being generated) must fit into
//!   `(max_staleness + version + 1) * batch_groups`. Consumed groups count
//!   because the learner consumes one batch per version: with `r` groups
//!   consumed at version `v ≈ r / batch_groups`, the bound leaves room for
//!   `(max_staleness + 1)` batches ahead of the learner, so nothing admitted
//!   can be more than `max_staleness` versions old when it is trained on.
//!   Counting only held groups would let the bound grow with the version.
//!   (Re-based on a new learner incarnation, see [`Ledger::rebase_version`].)
//! * the capacity bound, in groups and bytes (what happens then is the
//!   `when_full` policy, `when_full.rs`);
//! * in the replay modes, the insert side of the rate limiter
//!   (`rate_limit.rs`).
//!
//! A group that fails one waits (backpressure); evicted groups leave the
//! ledger and free room, so actors regenerate fresh data instead.
//!
//! The same rules grant *leases* (`lease.rs`): room an actor reserves for a
//! group before generating it, so that it waits before generating rather
//! than after, when its group would go stale at the door. A lease counts
//! as a held group until its group arrives (then it is one, admitted
//! without a second check) or it expires.

use crate::{config::BufferConfig, ledger::Ledger, rate_limit::RateLimiter};

/// AReaL's admission bound on groups ahead of the learner.
#[derive(Debug, Clone, Copy)]
pub struct StalenessBound {
    pub max_staleness: u64,
    pub batch_groups: u64,
}

impl StalenessBound {
    pub fn from_config(cfg: &BufferConfig) -> Self {
        Self {
            max_staleness: cfg.max_staleness,
            batch_groups: cfg.batch_groups as u64,
        }
    }

    /// Most groups that may have been admitted (since the re-base) at this
    /// learner version: `(max_staleness + version − rebase_version + 1) ×
    /// batch_groups`. Without a re-base, `rebase_version` is 0.
    pub fn limit(&self, ledger: &Ledger, version: u64) -> u64 {
        self.max_staleness
            .saturating_add(version.saturating_sub(ledger.rebase_version))
            .saturating_add(1)
            .saturating_mul(self.batch_groups)
    }

    pub fn admits(&self, ledger: &Ledger, version: u64) -> bool {
        ledger.admitted() < self.limit(ledger, version)
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

/// What an admission rule sees: the ledger under its lock, the learner's
/// version and the bytes held.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub ledger: &'a Ledger,
    pub version: u64,
    pub bytes: u64,
}

/// One reason a new group may have to wait.
pub trait Rule: Send + Sync {
    fn check(&self, v: &View) -> Result<(), Hold>;
}

impl Rule for Capacity {
    fn check(&self, v: &View) -> Result<(), Hold> {
        match self.has_room(v.ledger.in_buffer(), v.bytes) {
            true => Ok(()),
            false => Err(Hold::Full),
        }
    }
}

impl Rule for StalenessBound {
    fn check(&self, v: &View) -> Result<(), Hold> {
        match self.admits(v.ledger, v.version) {
            true => Ok(()),
            false => Err(Hold::Staleness),
        }
    }
}

impl Rule for RateLimiter {
    fn check(&self, v: &View) -> Result<(), Hold> {
        match self.can_insert(v.ledger) {
            true => Ok(()),
            false => Err(Hold::RateLimited),
        }
    }
}

/// The admission rules of one buffer, in the order they are checked.
pub struct Admission {
    rules: Vec<Box<dyn Rule>>,
}

impl Admission {
    /// Capacity first, so a full buffer is reported as full (and the
    /// `when_full` policy gets to act) whatever the other bounds say.
    pub fn from_config(cfg: &BufferConfig) -> Self {
        let mut rules: Vec<Box<dyn Rule>> = vec![
            Box::new(Capacity {
                groups: cfg.capacity_groups,
                bytes: cfg.capacity_bytes,
            }),
            Box::new(StalenessBound::from_config(cfg)),
        ];
        if let Some(rl) = RateLimiter::from_config(cfg) {
            rules.push(Box::new(rl));
        }
        Self { rules }
    }

    /// The first rule that holds the group back, if any.
    pub fn check(&self, v: &View) -> Result<(), Hold> {
        self.rules.iter().try_for_each(|r| r.check(v))
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
        // The learner takes the batch: consumed groups still count.
        l.held -= 4;
        l.consumed += 4;
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
            consumed: 80,
            held: 23,
            ..Default::default()
        };
        // version 10: limit (2 + 10 + 1) * 8 = 104.
        assert_eq!(b.limit(&l, 10), 104);
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
        l.held -= 1; // evicted, not consumed
        assert!(b.admits(&l, 0));
    }

    #[test]
    fn a_rebase_counts_groups_and_versions_from_there() {
        let b = StalenessBound {
            max_staleness: 1,
            batch_groups: 2,
        };
        // Frozen: 144 groups consumed under version 70, learner back at 50.
        let mut l = Ledger {
            consumed: 144,
            ..Default::default()
        };
        assert!(!b.admits(&l, 50));
        l.rebase_consumed = 144;
        l.rebase_version = 50;
        assert_eq!(b.limit(&l, 50), 4);
        assert!(b.admits(&l, 50));
        l.held = 4;
        assert!(!b.admits(&l, 50));
        assert!(b.admits(&l, 51));
    }

    #[test]
    fn rules_are_checked_capacity_first() {
        let cfg = BufferConfig {
            capacity_groups: 2,
            batch_groups: 1,
            max_staleness: 0,
            ..Default::default()
        };
        let a = Admission::from_config(&cfg);
        let check = |held| {
            let ledger = Ledger {
                held,
                ..Default::default()
            };
            a.check(&View {
                ledger: &ledger,
                version: 0,
                bytes: 0,
            })
        };
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(1), Err(Hold::Staleness));
        assert_eq!(check(2), Err(Hold::Full));
        assert_eq!(a.rules.len(), 2, "no rate limiter in FIFO mode");
    }

    #[test]
    fn outstanding_leases_count_against_both_bounds() {
        let cfg = BufferConfig {
            capacity_groups: 3,
            batch_groups: 2,
            max_staleness: 0,
            ..Default::default()
        };
        let a = Admission::from_config(&cfg);
        let check = |ledger: &Ledger| {
            a.check(&View {
                ledger,
                version: 0,
                bytes: 0,
            })
        };
        let l = Ledger {
            held: 1,
            leased: 1,
            ..Default::default()
        };
        assert_eq!(
            check(&l),
            Err(Hold::Staleness),
            "one batch: 1 held + 1 leased"
        );
        assert_eq!(l.admitted(), 2);
        let l = Ledger {
            leased: 3,
            ..Default::default()
        };
        assert_eq!(check(&l), Err(Hold::Full), "leased groups take room");
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
