//! Learner incarnations and the history they define: the one lineage type
//! the learner (which writes it into checkpoints and reports) and the
//! buffer (which judges rollouts and evicts by it) share, so both check a
//! lineage by the same rules.
//!
//! A learner resumed from a checkpoint `k` steps old publishes `k` version
//! numbers it has already used, for different weights, so a version means
//! something only together with its lineage (docs/architecture.md,
//! "Failure model"). Every learner process draws a random incarnation id
//! at start; the lineage lists the incarnations the current weights descend
//! from, oldest first, each with the version it started at.

use serde::{Deserialize, Serialize};

use crate::v1;

/// One learner process lifetime: its random id and the version it started
/// from (0 for a fresh start, the checkpoint's version for a resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incarnation {
    pub id: u64,
    pub first_version: u64,
}

impl Incarnation {
    pub fn to_wire(self) -> v1::Incarnation {
        v1::Incarnation {
            id: self.id,
            first_version: self.first_version,
        }
    }

    pub fn from_wire(w: &v1::Incarnation) -> Self {
        Self {
            id: w.id,
            first_version: w.first_version,
        }
    }
}

/// A lineage that cannot describe a history, naming the entry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("lineage entry {index}: {message}")]
pub struct LineageError {
    pub index: usize,
    pub message: String,
}

/// The incarnations a set of weights descends from, oldest first, the
/// current one last. Empty for weights made before incarnations existed.
/// Every constructor checks it ([`Lineage::check`]): a lineage comes from
/// a checkpoint on disk or a report over the network, outside input both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Lineage(Vec<Incarnation>);

impl Lineage {
    /// `entries` as a lineage, if they can describe a history ending at
    /// `version`.
    pub fn new(entries: Vec<Incarnation>, version: u64) -> Result<Self, LineageError> {
        let lineage = Self(entries);
        lineage.check(version)?;
        Ok(lineage)
    }

    /// A lineage off the wire, checked as [`Lineage::new`] does.
    pub fn from_wire(entries: &[v1::Incarnation], version: u64) -> Result<Self, LineageError> {
        Self::new(
            entries.iter().map(Incarnation::from_wire).collect(),
            version,
        )
    }

    pub fn entries(&self) -> &[Incarnation] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The newest incarnation, if any.
    pub fn current(&self) -> Option<Incarnation> {
        self.0.last().copied()
    }

    /// The current incarnation's id; 0 (reserved for "none") without one.
    pub fn current_id(&self) -> u64 {
        self.0.last().map_or(0, |i| i.id)
    }

    /// This history continued by incarnation `id`, starting at `version`
    /// (the version of the weights it was handed).
    pub fn continued(&self, id: u64, version: u64) -> Result<Self, LineageError> {
        let mut entries = self.0.clone();
        entries.push(Incarnation {
            id,
            first_version: version,
        });
        Self::new(entries, version)
    }

    /// Checks that the lineage can describe a history whose newest version
    /// is `version`: every id nonzero and used once, first versions never
    /// decreasing, and none after `version`.
    pub fn check(&self, version: u64) -> Result<(), LineageError> {
        let bad = |index: usize, message: String| Err(LineageError { index, message });
        for (i, inc) in self.0.iter().enumerate() {
            if inc.id == 0 {
                return bad(i, "incarnation id 0 is reserved for 'none'".into());
            }
            if let Some(j) = self.0[..i].iter().position(|p| p.id == inc.id) {
                return bad(i, format!("id {:016x} repeats entry {j}", inc.id));
            }
            if let Some(prev) = i.checked_sub(1).map(|j| self.0[j])
                && inc.first_version < prev.first_version
            {
                return bad(
                    i,
                    format!(
                        "starts at version {}, before its predecessor's {}",
                        inc.first_version, prev.first_version
                    ),
                );
            }
            if inc.first_version > version {
                return bad(
                    i,
                    format!(
                        "starts at version {}, after the weights' version {version}",
                        inc.first_version
                    ),
                );
            }
        }
        Ok(())
    }

    pub fn to_wire(&self) -> Vec<v1::Incarnation> {
        self.0.iter().map(|i| i.to_wire()).collect()
    }

    /// Whether tokens of versions `oldest..=newest`, produced by
    /// `incarnation`, are in this history at version `version`: version
    /// `t` of incarnation `i` is in it iff `first_version[i] <= t <=
    /// first_version[i + 1]` (or `t <= version` for the last one).
    /// Incarnation 0 (not recorded) is judged by version only; an empty
    /// lineage holds everything.
    pub fn contains(&self, incarnation: u64, oldest: u64, newest: u64, version: u64) -> bool {
        if self.0.is_empty() {
            return true;
        }
        if incarnation == 0 {
            return newest <= version;
        }
        let Some(i) = self.0.iter().position(|e| e.id == incarnation) else {
            return false;
        };
        let upper = self.0.get(i + 1).map_or(version, |next| next.first_version);
        self.0[i].first_version <= oldest && newest <= upper
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inc(id: u64, first_version: u64) -> Incarnation {
        Incarnation { id, first_version }
    }

    #[test]
    fn continuing_appends_the_new_incarnation() {
        let l = Lineage::default().continued(7, 0).unwrap();
        let l = l.continued(9, 4).unwrap();
        assert_eq!(l.entries(), &[inc(7, 0), inc(9, 4)]);
        assert_eq!(l.current(), Some(inc(9, 4)));
        assert_eq!(l.to_wire()[1].first_version, 4);
        assert_eq!(Lineage::from_wire(&l.to_wire(), 4).unwrap(), l);
    }

    #[test]
    fn impossible_histories_are_refused_by_entry() {
        let cases = [
            (vec![inc(0, 0)], 3, "entry 0", "reserved"),
            (vec![inc(1, 0), inc(1, 2)], 3, "entry 1", "repeats"),
            (vec![inc(1, 2), inc(2, 1)], 3, "entry 1", "before"),
            (vec![inc(1, 0), inc(2, 5)], 3, "entry 1", "after"),
        ];
        for (entries, version, entry, why) in cases {
            let e = Lineage::new(entries, version).unwrap_err().to_string();
            assert!(e.contains(entry) && e.contains(why), "{e}");
        }
    }

    #[test]
    fn history_is_each_incarnation_up_to_the_next_ones_start() {
        // A ran 0..=70 and died; B resumed from A's checkpoint at 50.
        let l = Lineage::new(vec![inc(0xA, 0), inc(0xB, 50)], 60).unwrap();
        assert!(l.contains(0xA, 0, 50, 60), "A up to B's start");
        assert!(!l.contains(0xA, 45, 51, 60), "A after B's start is gone");
        assert!(l.contains(0xB, 50, 60, 60));
        assert!(!l.contains(0xB, 50, 61, 60), "beyond the current version");
        assert!(!l.contains(0xB, 49, 50, 60), "before B started");
        assert!(!l.contains(0xC, 1, 1, 60), "unknown incarnation");
        assert!(l.contains(0, 3, 60, 60), "0: by version only");
        assert!(!l.contains(0, 3, 61, 60));
        assert!(Lineage::default().contains(0xC, 1, 99, 0), "no lineage");
    }
}
