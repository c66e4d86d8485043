//! When a held group must leave without being trained on, and the names the
//! evictions are counted under.
//!
//! Staleness of a group = learner version − the oldest token version in it:
//! the oldest token decides, because one token sampled by a policy too far
//! behind already makes the importance ratio of the whole sequence unusable.

/// Why a group left the buffer unused. The label is a metric label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    /// Older than `max_staleness` versions.
    Stale,
    /// Made room under `when_full = "drop-oldest"`.
    Capacity,
    /// Timed out with fewer than `min_group_size` members.
    Incomplete,
    /// Holds tokens outside the history of a new learner incarnation (a
    /// learner resumed from an older checkpoint): their staleness would mean
    /// nothing.
    RolledBack,
}

impl EvictReason {
    pub const ALL: [EvictReason; 4] = [
        EvictReason::Stale,
        EvictReason::Capacity,
        EvictReason::Incomplete,
        EvictReason::RolledBack,
    ];

    pub fn label(self) -> &'static str {
        match self {
            EvictReason::Stale => "stale",
            EvictReason::Capacity => "capacity",
            EvictReason::Incomplete => "incomplete",
            EvictReason::RolledBack => "rolled_back",
        }
    }

    pub fn from_label(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.label() == s)
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// `learner_version − oldest_version`, 0 when the group is newer.
pub fn staleness(learner_version: u64, oldest_version: u64) -> u64 {
    learner_version.saturating_sub(oldest_version)
}

/// The eviction rule for staleness.
pub fn is_stale(learner_version: u64, oldest_version: u64, max_staleness: u64) -> bool {
    staleness(learner_version, oldest_version) > max_staleness
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_token_decides() {
        assert_eq!(staleness(10, 7), 3);
        assert_eq!(staleness(3, 5), 0);
        assert!(!is_stale(10, 6, 4));
        assert!(is_stale(10, 5, 4));
        // max_staleness 0: only data from the current version is trainable.
        assert!(!is_stale(4, 4, 0));
        assert!(is_stale(4, 3, 0));
    }

    #[test]
    fn labels_round_trip() {
        for r in EvictReason::ALL {
            assert_eq!(EvictReason::from_label(r.label()), Some(r));
        }
    }
}
