//! The admission ledger: counts of groups consumed, held, leased, inserted
//! and sampled, kept under one short lock. Its own module because both the
//! admission rules and the replay rate limiter read it, and neither should
//! depend on the other.

/// Counts of groups, kept under one short lock touched once per group.
#[derive(Debug, Default, Clone)]
pub struct Ledger {
    /// Groups handed out for the last time (or, for FIFO, once).
    pub consumed: u64,
    /// Groups held: pending (assembling) plus ready.
    pub held: u64,
    /// Outstanding leases: groups admitted before they were generated,
    /// whose first rollout has not arrived yet.
    pub leased: u64,
    /// Groups ever admitted, for the replay rate limiter.
    pub inserted: u64,
    /// Group draws handed to the learner, for the replay rate limiter.
    pub samples: u64,
    /// `consumed` when admission was last re-based (a new learner
    /// incarnation): the bound counts only groups consumed since.
    pub rebase_consumed: u64,
    /// The learner version at that re-base: the bound counts versions since.
    pub rebase_version: u64,
}

impl Ledger {
    /// Groups counted against the staleness bound.
    pub fn admitted(&self) -> u64 {
        self.consumed.saturating_sub(self.rebase_consumed) + self.in_buffer()
    }

    /// Groups held plus those leased, which will be held without another
    /// check: what capacity is measured against.
    pub fn in_buffer(&self) -> u64 {
        self.held + self.leased
    }
}
