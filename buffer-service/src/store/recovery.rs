//! Recovery: rebuilding the buffer from its write-ahead log at start, and
//! the live state written back as a compacted log (the snapshot). Both are
//! the inverse of each other, so they live together; the live state machine
//! they read and write is in `store.rs`.

use std::{
    collections::HashMap,
    sync::{Arc, Weak, atomic::Ordering::Relaxed},
    time::Instant,
};

use bapo_proto::wal::{self as walpb, record::Kind};
use dashmap::mapref::entry::Entry;

use super::Inner;
use crate::{
    eviction::EvictReason,
    group::{GroupEntry, PendingGroup, ReadyGroup},
    ledger::Ledger,
    lineage::Lineage,
    wal::{Snapshot, SnapshotRefused},
    wire,
};
use bapo_proto::v1::Incarnation;

/// The snapshot function the log's compaction calls. It holds the buffer
/// weakly (the log must not keep a dropped buffer alive) and refuses once
/// the buffer is gone, so a late compaction cannot wipe the log.
pub(super) fn snapshot_source(inner: Weak<Inner>) -> Snapshot {
    Box::new(move || match inner.upgrade() {
        Some(i) => Ok(i.snapshot()),
        None => Err(SnapshotRefused(
            "the buffer was dropped, its live state is gone".into(),
        )),
    })
}

/// The learner's books as the log states them.
#[derive(Default)]
struct Learner {
    lineage: Vec<Incarnation>,
    lost: u64,
    rebase_consumed: u64,
    rebase_version: u64,
}

impl Learner {
    /// Installs the lineage and rollback count; returns the current
    /// incarnation (0: none).
    fn restore(self, inner: &Inner) -> u64 {
        let mut books = inner.learner.write();
        // The log holds only lineages a report passed with; one that no
        // longer checks (a hand-edited log) is dropped, loudly, rather than
        // trusted.
        let version = inner.version.load(Relaxed);
        books.lineage = Lineage::from_wire(&self.lineage, version).unwrap_or_else(|e| {
            tracing::error!("the log's learner lineage is not a history ({e}); ignoring it");
            Lineage::default()
        });
        books.lost_to_rollback = self.lost;
        let id = books.lineage.current_id();
        if id != 0 {
            inner.metrics.incarnation(id).set(1.0);
        }
        id
    }
}

impl Inner {
    /// Rebuilds the state from log records (see `wal.rs` on idempotence).
    pub(super) fn replay(&self, records: Vec<walpb::Record>) {
        let mut ready: HashMap<String, (ReadyGroup, u32)> = HashMap::new();
        let mut consumed = 0u64;
        let mut next_sequence = 0u64;
        // The learner's books as of the last Meta or Version record.
        let mut learner = Learner::default();
        let now = Instant::now();
        let n_records = records.len();
        for rec in records {
            match rec.kind {
                Some(Kind::Meta(meta)) => {
                    self.version.store(meta.learner_version, Relaxed);
                    consumed = meta.retired_groups;
                    next_sequence = next_sequence.max(meta.next_sequence);
                    for (label, n) in &meta.evictions {
                        if let Some(r) = EvictReason::from_label(label) {
                            self.counters.evictions[r.index()].store(*n, Relaxed);
                        }
                    }
                    learner = Learner {
                        lineage: meta.lineage,
                        lost: meta.groups_lost_to_rollback,
                        rebase_consumed: meta.rebase_retired,
                        rebase_version: meta.rebase_version,
                    };
                }
                Some(Kind::Version(v)) => {
                    self.version.store(v.version, Relaxed);
                    learner = Learner {
                        lineage: v.lineage,
                        lost: v.groups_lost_to_rollback,
                        rebase_consumed: v.rebase_retired,
                        rebase_version: v.rebase_version,
                    };
                }
                Some(Kind::Rollout(w)) => {
                    let r = match wire::rollout_from_wire(w) {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::warn!("skipping unreadable logged rollout: {}", e.reason);
                            continue;
                        }
                    };
                    match self.groups.entry(r.group_id.clone()) {
                        Entry::Vacant(v) => {
                            v.insert(GroupEntry::Pending(PendingGroup::new(r, now)));
                        }
                        Entry::Occupied(mut o) => {
                            if let GroupEntry::Pending(p) = o.get_mut()
                                && !p.contains(&r.id)
                            {
                                p.add(r);
                            }
                        }
                    }
                }
                Some(Kind::Ready(rd)) => {
                    next_sequence = next_sequence.max(rd.sequence.saturating_add(1));
                    if let Some(mut slot) = self.groups.get_mut(&rd.group_id)
                        && let Some(p) = slot.seal()
                    {
                        let g = ReadyGroup {
                            id: rd.group_id.clone(),
                            members: p.members,
                            oldest_version: p.oldest_version,
                            sequence: rd.sequence,
                            bytes: p.bytes,
                        };
                        ready.insert(rd.group_id, (g, 0));
                    }
                }
                Some(Kind::Sampled(s)) => {
                    for u in s.uses {
                        if let Some((_, used)) = ready.get_mut(&u.group_id) {
                            *used = (*used).max(u.use_count);
                            if *used >= self.uses_per_group {
                                ready.remove(&u.group_id);
                                consumed = consumed.saturating_add(1);
                            }
                        }
                    }
                }
                Some(Kind::Evicted(e)) => {
                    let reason = EvictReason::from_label(&e.reason);
                    for id in e.group_ids {
                        let was_ready = ready.remove(&id).is_some();
                        let was_pending = self
                            .groups
                            .get_mut(&id)
                            .is_some_and(|mut slot| slot.seal().is_some());
                        if let Some(r) = reason
                            && (was_ready || was_pending)
                        {
                            self.counters.evictions[r.index()].fetch_add(1, Relaxed);
                        }
                    }
                }
                Some(Kind::Tombstone(t)) => {
                    self.groups
                        .entry(t.group_id)
                        .or_insert_with(|| GroupEntry::Sealed(t.rollout_ids));
                }
                None => {}
            }
        }
        // Groups whose last member landed but whose ready record did not.
        let complete: Vec<String> = self
            .groups
            .iter()
            .filter_map(|e| match e.value() {
                GroupEntry::Pending(p) if p.members.len() >= self.cfg.group_size as usize => {
                    Some(e.key().clone())
                }
                _ => None,
            })
            .collect();
        let mut store = self.ready.lock();
        let mut ready: Vec<_> = ready.into_values().collect();
        ready.sort_by_key(|(g, _)| g.sequence);
        store.next_sequence = next_sequence;
        let mut bytes = 0u64;
        let mut last: Option<u64> = None;
        for (mut g, used) in ready {
            // Sequences are unique in any log this buffer wrote; a damaged
            // one may repeat them, and the ready store needs them rising.
            if let Some(l) = last
                && g.sequence <= l
            {
                g.sequence = l.saturating_add(1);
            }
            last = Some(g.sequence);
            store.next_sequence = store.next_sequence.max(g.sequence.saturating_add(1));
            bytes = bytes.saturating_add(g.bytes);
            store.push(Arc::new(g), used);
        }
        for id in complete {
            if let Some(mut slot) = self.groups.get_mut(&id)
                && let Some(p) = slot.seal()
            {
                let sequence = store.next_sequence;
                store.next_sequence = sequence.saturating_add(1);
                bytes = bytes.saturating_add(p.bytes);
                store.push(
                    Arc::new(ReadyGroup {
                        id,
                        members: p.members,
                        oldest_version: p.oldest_version,
                        sequence,
                        bytes: p.bytes,
                    }),
                    0,
                );
            }
        }
        let mut pending = 0;
        let mut tombstones = self.tombstones.lock();
        for e in self.groups.iter() {
            match e.value() {
                GroupEntry::Pending(p) => {
                    pending += 1;
                    bytes = bytes.saturating_add(p.bytes);
                }
                GroupEntry::Sealed(_) => tombstones.push_back(e.key().clone()),
            }
        }
        let held = pending + store.len() as u64;
        // Saturating throughout: the counts come from the log, and a damaged
        // one must not panic the buffer.
        let samples = store
            .iter()
            .fold(0u64, |n, (_, u)| n.saturating_add(u64::from(*u)))
            .saturating_add(consumed.saturating_mul(u64::from(self.uses_per_group)));
        // Every admitted group is consumed, evicted or held.
        let evicted =
            (self.counters.evictions.iter()).fold(0u64, |n, e| n.saturating_add(e.load(Relaxed)));
        *self.ledger.lock() = Ledger {
            consumed,
            held,
            // Leases are not logged: a leased group's push after a restart
            // is admitted as an unleased one (docs/buffer.md).
            leased: 0,
            inserted: consumed.saturating_add(held).saturating_add(evicted),
            samples,
            rebase_consumed: learner.rebase_consumed,
            rebase_version: learner.rebase_version,
        };
        let incarnation = learner.restore(self);
        self.pending.store(pending, Relaxed);
        self.bytes.store(bytes, Relaxed);
        tracing::info!(
            records = n_records,
            ready = store.len(),
            pending,
            consumed,
            version = self.version.load(Relaxed),
            incarnation = format!("{incarnation:016x}"),
            "replayed write-ahead log"
        );
    }

    /// The live state as log records, for compaction. See the module docs of
    /// `wal.rs` for why records queued meanwhile may be replayed on top.
    pub(super) fn snapshot(&self) -> Vec<walpb::Record> {
        let rec = |kind| walpb::Record { kind: Some(kind) };
        let mut pending_records = Vec::new();
        let mut sealed = Vec::new();
        for e in self.groups.iter() {
            match e.value() {
                GroupEntry::Pending(p) => {
                    for m in &p.members {
                        pending_records.push(rec(Kind::Rollout(wire::rollout_to_wire(m))));
                    }
                }
                GroupEntry::Sealed(ids) => sealed.push((e.key().clone(), ids.clone())),
            }
        }
        let learner = self.learner.read();
        let ready = self.ready.lock();
        let ledger = self.ledger.lock().clone();
        let meta = walpb::Meta {
            learner_version: self.version.load(Relaxed),
            retired_groups: ledger.consumed,
            next_sequence: ready.next_sequence,
            lineage: learner.lineage.to_wire(),
            groups_lost_to_rollback: learner.lost_to_rollback,
            rebase_retired: ledger.rebase_consumed,
            rebase_version: ledger.rebase_version,
            admitted_groups: ledger.inserted,
            evictions: EvictReason::ALL
                .iter()
                .map(|r| {
                    let n = self.counters.evictions[r.index()].load(Relaxed);
                    (r.label().to_string(), n)
                })
                .collect(),
        };
        drop(learner);
        let live: Vec<(Arc<ReadyGroup>, u32)> = ready.iter().cloned().collect();
        drop(ready);
        let mut out = vec![rec(Kind::Meta(meta))];
        out.append(&mut pending_records);
        let mut live_ids = std::collections::HashSet::new();
        for (g, used) in live {
            live_ids.insert(g.id.clone());
            for m in &g.members {
                out.push(rec(Kind::Rollout(wire::rollout_to_wire(m))));
            }
            out.push(rec(Kind::Ready(walpb::Ready {
                group_id: g.id.clone(),
                sequence: g.sequence,
            })));
            if used > 0 {
                out.push(rec(Kind::Sampled(walpb::Sampled {
                    uses: vec![walpb::GroupUse {
                        group_id: g.id.clone(),
                        use_count: used,
                    }],
                })));
            }
        }
        for (id, ids) in sealed {
            if !live_ids.contains(&id) {
                out.push(rec(Kind::Tombstone(walpb::Tombstone {
                    group_id: id,
                    rollout_ids: ids,
                })));
            }
        }
        out
    }
}
