//! Learner incarnations: which process lifetimes a set of weights descends
//! from.
//!
//! A learner resumed from a checkpoint `k` steps old publishes `k` version
//! numbers it has already used, for different weights, so a version means
//! something only together with its lineage (docs/architecture.md,
//! "Failure model"). Every learner process draws a random incarnation id at
//! start; checkpoints keep the list of incarnations, each with the version
//! it started from.

use bapo_proto::v1;
use serde::{Deserialize, Serialize};

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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Lineage(Vec<Incarnation>);

impl Lineage {
    /// `entries` as a lineage, if they can describe a history ending at
    /// `version` (see [`Lineage::check`]).
    pub fn new(entries: Vec<Incarnation>, version: u64) -> Result<Self, LineageError> {
        let lineage = Self(entries);
        lineage.check(version)?;
        Ok(lineage)
    }

    pub fn entries(&self) -> &[Incarnation] {
        &self.0
    }

    /// The newest incarnation, if any.
    pub fn current(&self) -> Option<Incarnation> {
        self.0.last().copied()
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
    /// decreasing, and none after `version`. A lineage read from disk is
    /// outside input.
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
}

/// A random nonzero incarnation id, from the thread generator (seeded from
/// the OS): two learner processes must not draw the same one, and no seed
/// in a config file may make them.
pub fn draw_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
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
    fn drawn_ids_are_nonzero_and_differ() {
        let (a, b) = (draw_id(), draw_id());
        assert!(a != 0 && b != 0 && a != b);
    }
}
