//! Groups leaving the pending state: sealed into the ready store (and
//! remembered as tombstones for deduplication), or evicted, with their
//! admission room released.

use super::*;

impl Inner {
    pub(super) fn tombstone(&self, id: String) {
        self.tombstones.lock().push_back(id);
    }

    pub(super) fn prune_tombstones(&self) {
        let excess: Vec<String> = {
            let mut t = self.tombstones.lock();
            let n = t.len().saturating_sub(self.cfg.dedup_window_groups);
            t.drain(..n).collect()
        };
        for id in excess {
            self.groups
                .remove_if(&id, |_, s| matches!(s, GroupEntry::Sealed(_)));
        }
    }

    /// Seals a pending group and moves it into the ready store while its
    /// shard is still locked. A snapshot reads the shards before the ready
    /// store, so it must never find a group sealed (a tombstone) but not
    /// yet ready: it would write the tombstone alone, and the `Ready`
    /// record that follows would find no members to seal on replay.
    pub(super) fn seal_into_ready(&self, mut slot: RefMut<'_, String, GroupEntry>) {
        let Some(p) = slot.seal() else { return };
        self.pending.fetch_sub(1, Relaxed);
        let id = slot.key().clone();
        self.after_seal();
        self.make_ready(id.clone(), p);
        drop(slot);
        self.tombstone(id);
    }

    /// Moves a sealed pending group into the ready store. Called with the
    /// group's shard locked (lock order: shard, then `ready`).
    pub(super) fn make_ready(&self, id: String, p: PendingGroup) {
        let mut ready = self.ready.lock();
        let sequence = ready.next_sequence;
        ready.next_sequence = sequence.saturating_add(1);
        self.log(Kind::Ready(walpb::Ready {
            group_id: id.clone(),
            sequence,
        }));
        let group = ReadyGroup {
            id,
            members: p.members,
            oldest_version: p.oldest_version,
            sequence,
            bytes: p.bytes,
        };
        ready.push(Arc::new(group), 0);
        drop(ready);
        self.changed.notify_waiters();
    }

    /// Evicts a pending group, if the id names one.
    pub(super) fn evict_pending(&self, id: &str, reason: EvictReason) -> bool {
        let Some(mut slot) = self.groups.get_mut(id) else {
            return false;
        };
        let Some(p) = slot.seal() else {
            return false;
        };
        self.pending.fetch_sub(1, Relaxed);
        drop(slot);
        self.tombstone(id.to_string());
        self.release_evicted(vec![(id.to_string(), p.bytes)], reason);
        true
    }

    /// Books evicted groups out of the ledger and the log.
    pub(super) fn release_evicted(&self, groups: Vec<(String, u64)>, reason: EvictReason) {
        if groups.is_empty() {
            return;
        }
        let n = groups.len() as u64;
        let bytes: u64 = groups.iter().map(|(_, b)| b).sum();
        self.bytes.fetch_sub(bytes, Relaxed);
        self.ledger.lock().held -= n;
        self.counters.evictions[reason.index()].fetch_add(n, Relaxed);
        self.metrics.evictions[reason.index()].increment(n);
        self.log(Kind::Evicted(walpb::Evicted {
            group_ids: groups.into_iter().map(|(id, _)| id).collect(),
            reason: reason.label().to_string(),
        }));
        self.changed.notify_waiters();
    }

    /// Asks the `when_full` policy for room; true when it evicted a group.
    pub(super) fn make_room(&self) -> bool {
        let mut ready = self.ready.lock();
        let Some(g) = self.when_full.make_room(&mut ready) else {
            return false;
        };
        self.release_evicted(vec![(g.id.clone(), g.bytes)], EvictReason::Capacity);
        true
    }

    pub(super) fn evict_stale_ready(&self, ready: &mut ReadyStore, version: u64) -> u64 {
        let stale = ready.take_stale(version, self.cfg.max_staleness);
        let n = stale.len() as u64;
        let evicted = stale.into_iter().map(|g| (g.id.clone(), g.bytes)).collect();
        self.release_evicted(evicted, EvictReason::Stale);
        n
    }
}
