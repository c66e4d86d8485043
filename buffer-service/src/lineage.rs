//! Learner incarnations and the history they define (docs/architecture.md,
//! "Failure model").
//!
//! A learner that resumes from a checkpoint `k` steps old reuses version
//! numbers for different weights, so a version means something only together
//! with the incarnation that produced it. The lineage lists the incarnations
//! the current weights descend from, oldest first, each with the version it
//! started at: version `t` of incarnation `i` is in the history iff
//! `first_version[i] <= t <= first_version[i + 1]` (or `t <=` the current
//! version for the last one).

use bapo_proto::v1::Incarnation;

/// The learner's history as last reported. Empty: a learner that does not
/// track incarnations (every rollout is judged by its versions alone).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lineage(Vec<Incarnation>);

/// What a version report means for the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportKind {
    /// No lineage in the report: versions only, as before incarnations.
    Legacy,
    /// From the incarnation already current.
    Same,
    /// From an incarnation not seen before: adopt, evict, re-base.
    NewIncarnation,
}

impl Lineage {
    pub fn new(entries: Vec<Incarnation>) -> Self {
        Self(entries)
    }

    pub fn entries(&self) -> &[Incarnation] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The current incarnation's id; `None` before any lineage.
    pub fn current(&self) -> Option<u64> {
        self.0.last().map(|i| i.id)
    }

    /// Whether tokens of versions `oldest..=newest`, produced by
    /// `incarnation`, are in this history at learner version `version`.
    /// Incarnation 0 (not recorded) is judged by version only; an empty
    /// lineage holds everything.
    pub fn contains(&self, incarnation: u64, oldest: u64, newest: u64, version: u64) -> bool {
        if self.0.is_empty() {
            return true;
        }
        if incarnation == 0 {
            return newest <= version;
        }
        // Ids are random 64-bit draws, but a lineage that names one twice
        // takes its latest place (its versions end latest).
        let Some(i) = self.0.iter().rposition(|e| e.id == incarnation) else {
            return false;
        };
        let upper = self.0.get(i + 1).map_or(version, |next| next.first_version);
        self.0[i].first_version <= oldest && newest <= upper
    }

    /// Classifies a report's lineage against this one. `Err` names a zombie:
    /// an incarnation this lineage has superseded (it appears, but not
    /// last), or one in `former` (ids that were current here before).
    pub fn classify(&self, report: &[Incarnation], former: &[u64]) -> Result<ReportKind, String> {
        let Some(reported) = report.last().map(|i| i.id) else {
            return Ok(ReportKind::Legacy);
        };
        let current = self.current();
        if current == Some(reported) {
            return Ok(ReportKind::Same);
        }
        let superseded = self.0.iter().any(|e| e.id == reported) || former.contains(&reported);
        if superseded {
            return Err(format!(
                "learner incarnation {reported:016x} was superseded by incarnation {:016x} \
                 (a learner resumed from a checkpoint); this learner's reports are refused",
                current.unwrap_or(0)
            ));
        }
        Ok(ReportKind::NewIncarnation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inc(id: u64, first_version: u64) -> Incarnation {
        Incarnation { id, first_version }
    }

    #[test]
    fn history_is_each_incarnation_up_to_the_next_ones_start() {
        // A ran 0..=70 and died; B resumed from A's checkpoint at 50.
        let l = Lineage::new(vec![inc(0xA, 0), inc(0xB, 50)]);
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

    #[test]
    fn reports_are_classified_and_zombies_named() {
        let l = Lineage::new(vec![inc(0xA, 0), inc(0xB, 50)]);
        assert_eq!(l.classify(&[], &[]), Ok(ReportKind::Legacy));
        assert_eq!(
            l.classify(&[inc(0xA, 0), inc(0xB, 50)], &[]),
            Ok(ReportKind::Same)
        );
        assert_eq!(
            l.classify(&[inc(0xA, 0), inc(0xC, 40)], &[]),
            Ok(ReportKind::NewIncarnation)
        );
        let zombie = l.classify(&[inc(0xA, 0)], &[]).unwrap_err();
        assert!(zombie.contains("000000000000000a"), "{zombie}");
        assert!(zombie.contains("superseded"), "{zombie}");
        assert!(l.classify(&[inc(0xD, 0)], &[0xD]).is_err());
        assert_eq!(
            Lineage::default().classify(&[inc(0xA, 0)], &[]),
            Ok(ReportKind::NewIncarnation)
        );
    }
}
