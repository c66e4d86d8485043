//! What a learner's version report does to the store: a new incarnation's
//! lineage adopted (admission re-based, lost draws counted), its log record,
//! and the groups a rollback left outside the history evicted.

use super::*;

impl Inner {
    /// Takes a new incarnation's lineage: re-bases admission on the current
    /// counts and counts the draws the learner's weights do not contain.
    /// Called under the `learner` write lock.
    pub(super) fn adopt_incarnation(
        &self,
        learner: &mut LearnerBooks,
        lineage: Lineage,
        groups_trained: u64,
        old_version: u64,
    ) {
        let version = self.version.load(Relaxed);
        if let Some(prev) = learner.lineage.current().map(|i| i.id) {
            learner.former.push(prev);
        }
        let id = lineage.current_id();
        learner.lineage = lineage;
        self.lineage_epoch.fetch_add(1, Release);
        let samples = {
            let mut l = self.ledger.lock();
            l.rebase_consumed = l.consumed;
            l.rebase_version = version;
            l.samples
        };
        learner.lost_to_rollback = samples.saturating_sub(groups_trained);
        self.metrics.incarnations.increment(1);
        self.metrics.set_incarnation(id);
        self.metrics
            .lost_to_rollback
            .set(learner.lost_to_rollback as f64);
        tracing::info!(
            incarnation = format!("{id:016x}"),
            version,
            old_version,
            groups_trained,
            group_samples = samples,
            groups_lost_to_rollback = learner.lost_to_rollback,
            "new learner incarnation: admission re-based"
        );
    }

    /// The log record of the learner's state after a report.
    pub(super) fn version_record(&self, learner: &LearnerBooks, version: u64) -> walpb::Version {
        let l = self.ledger.lock();
        walpb::Version {
            version,
            lineage: learner.lineage.to_wire(),
            groups_lost_to_rollback: learner.lost_to_rollback,
            rebase_retired: l.rebase_consumed,
            rebase_version: l.rebase_version,
        }
    }

    /// Evicts every held group with a token outside `history`. Pending
    /// groups first: one that becomes ready after its shard was scanned was
    /// judged there, and one that became ready before is in the ready store
    /// by the time it is scanned.
    pub(super) fn evict_rolled_back(&self, history: &Lineage, version: u64) -> u64 {
        let outside = |members: &[Rollout]| {
            members.iter().any(|m| {
                !history.contains(
                    m.learner_incarnation,
                    m.oldest_version(),
                    m.newest_version(),
                    version,
                )
            })
        };
        let pending: Vec<String> = self
            .groups
            .iter()
            .filter_map(|e| match e.value() {
                GroupEntry::Pending(p) if outside(&p.members) => Some(e.key().clone()),
                _ => None,
            })
            .collect();
        let mut n = 0;
        for id in pending {
            n += u64::from(self.evict_pending(&id, EvictReason::RolledBack));
        }
        let mut ready = self.ready.lock();
        let gone = ready.take_where(|g| outside(&g.members));
        n += gone.len() as u64;
        let gone = gone.into_iter().map(|g| (g.id.clone(), g.bytes)).collect();
        self.release_evicted(gone, EvictReason::RolledBack);
        n
    }
}
