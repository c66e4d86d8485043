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
    ready::ReadyStore,
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

/// What replaying the log has rebuilt so far, besides the groups
/// themselves (which go straight into the store's map).
struct Replayed {
    /// Ready groups by id, with their use counts.
    ready: HashMap<String, (ReadyGroup, u32)>,
    consumed: u64,
    next_sequence: u64,
    /// The learner's books as of the last Meta or Version record.
    learner: Learner,
    now: Instant,
}

impl Replayed {
    fn new() -> Self {
        Self {
            ready: HashMap::new(),
            consumed: 0,
            next_sequence: 0,
            learner: Learner::default(),
            now: Instant::now(),
        }
    }

    fn apply(&mut self, inner: &Inner, kind: Kind) {
        match kind {
            Kind::Meta(meta) => self.meta(inner, meta),
            Kind::Version(v) => {
                inner.version.store(v.version, Relaxed);
                self.learner = Learner {
                    lineage: v.lineage,
                    lost: v.groups_lost_to_rollback,
                    rebase_consumed: v.rebase_retired,
                    rebase_version: v.rebase_version,
                };
            }
            Kind::Rollout(w) => self.rollout(inner, w),
            Kind::Ready(rd) => self.ready(inner, rd),
            Kind::Sampled(s) => {
                for u in s.uses {
                    if let Some((_, used)) = self.ready.get_mut(&u.group_id) {
                        *used = (*used).max(u.use_count);
                        if *used >= inner.uses_per_group {
                            self.ready.remove(&u.group_id);
                            self.consumed = self.consumed.saturating_add(1);
                        }
                    }
                }
            }
            Kind::Evicted(e) => self.evicted(inner, e),
            Kind::Tombstone(t) => {
                inner
                    .groups
                    .entry(t.group_id)
                    .or_insert_with(|| GroupEntry::Sealed(t.rollout_ids));
            }
        }
    }

    /// A compaction snapshot's header: everything counted before it.
    fn meta(&mut self, inner: &Inner, meta: walpb::Meta) {
        inner.version.store(meta.learner_version, Relaxed);
        self.consumed = meta.retired_groups;
        self.next_sequence = self.next_sequence.max(meta.next_sequence);
        for (label, n) in &meta.evictions {
            if let Some(r) = EvictReason::from_label(label) {
                inner.counters.evictions[r.index()].store(*n, Relaxed);
            }
        }
        self.learner = Learner {
            lineage: meta.lineage,
            lost: meta.groups_lost_to_rollback,
            rebase_consumed: meta.rebase_retired,
            rebase_version: meta.rebase_version,
        };
    }

    fn rollout(&mut self, inner: &Inner, w: bapo_proto::v1::Rollout) {
        let r = match wire::rollout_from_wire(w) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("skipping unreadable logged rollout: {}", e.reason);
                return;
            }
        };
        match inner.groups.entry(r.group_id.clone()) {
            Entry::Vacant(v) => {
                v.insert(GroupEntry::Pending(PendingGroup::new(r, self.now)));
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

    fn ready(&mut self, inner: &Inner, rd: walpb::Ready) {
        self.next_sequence = self.next_sequence.max(rd.sequence.saturating_add(1));
        if let Some(mut slot) = inner.groups.get_mut(&rd.group_id)
            && let Some(p) = slot.seal()
        {
            let g = ReadyGroup {
                id: rd.group_id.clone(),
                members: p.members,
                oldest_version: p.oldest_version,
                sequence: rd.sequence,
                bytes: p.bytes,
            };
            self.ready.insert(rd.group_id, (g, 0));
        }
    }

    fn evicted(&mut self, inner: &Inner, e: walpb::Evicted) {
        let reason = EvictReason::from_label(&e.reason);
        for id in e.group_ids {
            let was_ready = self.ready.remove(&id).is_some();
            let was_pending = inner
                .groups
                .get_mut(&id)
                .is_some_and(|mut slot| slot.seal().is_some());
            if let Some(r) = reason
                && (was_ready || was_pending)
            {
                inner.counters.evictions[r.index()].fetch_add(1, Relaxed);
            }
        }
    }
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
            inner.metrics.set_incarnation(id);
        }
        id
    }
}

impl Inner {
    /// Rebuilds the state from log records (see `wal.rs` on idempotence).
    pub(super) fn replay(&self, records: Vec<walpb::Record>) {
        let n_records = records.len();
        let mut log = Replayed::new();
        for kind in records.into_iter().filter_map(|r| r.kind) {
            log.apply(self, kind);
        }
        let Replayed {
            ready,
            consumed,
            next_sequence,
            learner,
            ..
        } = log;
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
        let ready_bytes = self.install_ready(&mut store, ready, next_sequence, complete);
        let (pending, pending_bytes) = self.count_pending_and_tombstones();
        self.restore_ledger(&store, consumed, pending, &learner);
        let incarnation = learner.restore(self);
        self.pending.store(pending, Relaxed);
        self.bytes
            .store(ready_bytes.saturating_add(pending_bytes), Relaxed);
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

    /// Fills the ready store: the logged ready groups in sequence order,
    /// then `complete` pending groups sealed now. Returns their bytes.
    fn install_ready(
        &self,
        store: &mut ReadyStore,
        ready: HashMap<String, (ReadyGroup, u32)>,
        next_sequence: u64,
        complete: Vec<String>,
    ) -> u64 {
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
        bytes
    }

    /// Pending groups and their bytes; sealed ids become tombstones.
    fn count_pending_and_tombstones(&self) -> (u64, u64) {
        let (mut pending, mut bytes) = (0u64, 0u64);
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
        (pending, bytes)
    }

    /// The admission ledger implied by what was replayed: every admitted
    /// group is consumed, evicted or held. Saturating throughout: the
    /// counts come from the log, and a damaged one must not panic the
    /// buffer.
    fn restore_ledger(&self, store: &ReadyStore, consumed: u64, pending: u64, learner: &Learner) {
        let held = pending + store.len() as u64;
        let samples = store
            .iter()
            .fold(0u64, |n, (_, u)| n.saturating_add(u64::from(*u)))
            .saturating_add(consumed.saturating_mul(u64::from(self.uses_per_group)));
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
