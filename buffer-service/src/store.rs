//! The buffer core: groups assembling, groups ready, the admission ledger,
//! and the log behind them. It knows nothing of gRPC; the service translates.
//!
//! Locks, and why each is there:
//! * `groups` (a `DashMap`, sharded): touched by every pushed rollout. Only
//!   the shard of the rollout's group is locked, so pushers to different
//!   groups do not contend. This is the hot path.
//! * `ready` (one mutex): touched once per group when it becomes sampleable
//!   and once per learner batch. Sampling needs a consistent view of all
//!   ready groups (FIFO order, replay weights), which a shard cannot give.
//! * `ledger` (one mutex): the admission counters, touched once per group.
//!   Always the innermost lock: nothing is acquired while it is held.
//! * `learner` (a read-write lock): the lineage. Read once per push (and
//!   again where it lands only if a report changed it meanwhile, see
//!   `lineage_epoch`), written only by version reports.
//! * `leases` (one mutex): the lease table (`lease.rs`), touched once per
//!   lease request and once per new group; changed together with the
//!   ledger's `leased` count (`store/leasing.rs`).
//!
//! Lock order is `groups` shard → `learner` → `leases` → `ready` →
//! `ledger`; `tombstones` is taken alone. No lock is held across an
//! `.await`.
//!
//! Write-ahead records are queued while the lock that orders the change is
//! held (a rollout under its group's shard, a ready or sampled record under
//! `ready`), so the log order is a valid history. A group goes from pending
//! to ready under its shard lock *and* the `ready` lock, so the compaction
//! snapshot (`store/recovery.rs`: shards first, then `ready`) sees it on one side
//! or the other, never in between.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{
            AtomicBool, AtomicU64,
            Ordering::{Acquire, Relaxed, Release},
        },
    },
    time::{Duration, Instant},
};

use bapo_proto::{
    v1::Incarnation,
    wal::{self as walpb, record::Kind},
};
use dashmap::{
    DashMap,
    mapref::{
        entry::{Entry, VacantEntry},
        one::RefMut,
    },
};
use parking_lot::{Mutex, RwLock};
use rand::{SeedableRng, rngs::SmallRng};
use tokio::{sync::Notify, task::JoinHandle};

use crate::{
    admission::{Admission, Hold, StalenessBound, View},
    config::BufferConfig,
    eviction::{self, EvictReason},
    group::{GroupEntry, PendingGroup, ReadyGroup, SampledGroup},
    lease::LeaseTable,
    ledger::Ledger,
    lineage::{Lineage, ReportKind, classify},
    metrics as m,
    rate_limit::RateLimiter,
    ready::ReadyStore,
    rollout::Rollout,
    sampler,
    validate::{self, Limits, RejectCode, Rejection},
    wal::{Wal, WalError},
    when_full::{self, WhenFull},
    wire,
};

/// What happened to one pushed rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushOutcome {
    Accepted,
    /// Already stored; acknowledged, not stored again.
    Duplicate,
    Rejected(Rejection),
}

/// Why a push or sample could not be served at all.
#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error("the buffer is shutting down")]
    Closing,
    #[error("only {ready} of {wanted} groups were ready before the deadline")]
    NotEnough { ready: usize, wanted: usize },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A version report from a learner incarnation that a resumed learner
    /// has replaced (a zombie).
    #[error("{0}")]
    Superseded(String),
    /// A lease asked for a group that is already in the buffer.
    #[error("{0}")]
    AlreadyPushed(String),
    /// A renewal or release of a lease another identity holds.
    #[error("{0}")]
    NotHolder(String),
    #[error(transparent)]
    Wal(#[from] WalError),
}

/// Numbers for the stats RPC and tests.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub learner_version: u64,
    pub max_staleness: u64,
    pub groups_pending: u64,
    pub groups_ready: u64,
    pub bytes_held: u64,
    pub rollouts_accepted: u64,
    pub rollouts_duplicate: u64,
    pub rollouts_rejected: u64,
    /// `rollouts_rejected` by the rejection's metric label.
    pub rejections: HashMap<&'static str, u64>,
    pub groups_consumed: u64,
    pub group_samples: u64,
    pub evictions: HashMap<&'static str, u64>,
    pub admitted_groups: u64,
    pub admission_limit: u64,
    /// Groups ever admitted: consumed + evicted + pending + ready, across
    /// restarts.
    pub groups_admitted: u64,
    /// The current learner incarnation; 0 before any lineage was reported.
    pub learner_incarnation: u64,
    pub groups_lost_to_rollback: u64,
    /// Leases held now, and granted, expired and used since the start.
    pub leases_outstanding: u64,
    pub leases_granted: u64,
    pub leases_expired: u64,
    pub leases_used: u64,
    pub leases_released: u64,
}

/// A learner's version report (`bapo.v1.VersionReport`).
#[derive(Debug, Clone, Default)]
pub struct LearnerReport {
    pub version: u64,
    /// Oldest first, the reporting incarnation last; empty: versions only.
    pub lineage: Vec<Incarnation>,
    /// Group draws the learner's current weights were trained on.
    pub groups_trained: u64,
    /// The learner's groups per batch; 0: not stated.
    pub batch_groups: u32,
}

/// What a version report evicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportOutcome {
    pub evicted_stale: u64,
    pub evicted_rolled_back: u64,
}

/// What the buffer knows of the learner's history, changed only by reports.
#[derive(Debug, Default)]
struct LearnerBooks {
    lineage: Lineage,
    /// Incarnations that were current here before the present one: their
    /// reports come from zombies.
    former: Vec<u64>,
    /// Group draws handed out that the current weights do not contain.
    lost_to_rollback: u64,
}

/// The staleness-tracking rollout store. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    duplicate: AtomicU64,
    /// Rejections by label, the only count of them (the total is the sum):
    /// the set is small and fixed, and the lock is never taken on the
    /// accept path.
    rejected: Mutex<HashMap<&'static str, u64>>,
    samples: AtomicU64,
    evictions: [AtomicU64; EvictReason::ALL.len()],
    leases_granted: AtomicU64,
    leases_expired: AtomicU64,
    leases_used: AtomicU64,
    leases_released: AtomicU64,
}

struct Inner {
    cfg: BufferConfig,
    /// The rules a new group must pass, in order.
    admission: Admission,
    /// What a full buffer does with a new group.
    when_full: Box<dyn WhenFull>,
    /// The staleness rule again, for the limit in stats and gauges.
    bound: StalenessBound,
    /// The sample side of the replay rate limiter (its insert side is an
    /// admission rule).
    limiter: Option<RateLimiter>,
    uses_per_group: u32,
    version: AtomicU64,
    /// Lock order: after a `groups` shard, before `ready` and `ledger`.
    learner: RwLock<LearnerBooks>,
    /// Bumped (under the `learner` write lock) whenever the lineage changes,
    /// so a push checked against an older lineage is checked again where it
    /// lands, under its group's shard lock.
    lineage_epoch: AtomicU64,
    groups: DashMap<String, GroupEntry>,
    pending: AtomicU64,
    ready: Mutex<ReadyStore>,
    /// Room reserved for groups being generated; its size is the ledger's
    /// `leased`.
    leases: Mutex<LeaseTable>,
    ledger: Mutex<Ledger>,
    bytes: AtomicU64,
    /// Sealed group ids, oldest first; pruned to `dedup_window_groups`.
    tombstones: Mutex<VecDeque<String>>,
    /// Signalled on every change that may unblock a held push or a waiting
    /// sample: a group became ready, left, or the version moved.
    changed: Notify,
    closing: AtomicBool,
    counters: Counters,
    metrics: m::Handles,
    wal: Option<Wal>,
    /// Test hook run right after a group is sealed, to inject a snapshot
    /// at that moment.
    #[cfg(test)]
    on_seal: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

impl Buffer {
    /// Opens the buffer, replaying its log when `data_dir` is set.
    pub fn open(cfg: BufferConfig) -> anyhow::Result<Self> {
        cfg.validate()?;
        let wal = match &cfg.data_dir {
            Some(dir) => Some(Wal::open(
                dir,
                cfg.fsync,
                Duration::from_millis(cfg.fsync_interval_ms),
                cfg.compact_bytes,
            )?),
            None => None,
        };
        let (wal, recovered) = match wal {
            Some((w, r)) => (Some(w), Some(r)),
            None => (None, None),
        };
        let inner = Arc::new(Inner {
            admission: Admission::from_config(&cfg),
            when_full: when_full::from_config(cfg.when_full),
            bound: StalenessBound::from_config(&cfg),
            limiter: RateLimiter::from_config(&cfg),
            uses_per_group: cfg.uses_per_group(),
            version: AtomicU64::new(0),
            learner: RwLock::new(LearnerBooks::default()),
            lineage_epoch: AtomicU64::new(0),
            groups: DashMap::new(),
            pending: AtomicU64::new(0),
            ready: Mutex::new(ReadyStore::new(
                sampler::from_config(&cfg),
                SmallRng::seed_from_u64(cfg.seed),
            )),
            leases: Mutex::new(LeaseTable::new(cfg.lease_ttl())),
            ledger: Mutex::new(Ledger::default()),
            bytes: AtomicU64::new(0),
            tombstones: Mutex::new(VecDeque::new()),
            changed: Notify::new(),
            closing: AtomicBool::new(false),
            counters: Counters::default(),
            metrics: m::Handles::register(),
            wal,
            cfg,
            #[cfg(test)]
            on_seal: Mutex::new(None),
        });
        let buffer = Buffer { inner };
        if let Some(rec) = recovered {
            buffer.inner.replay(rec.records);
            if let Some(w) = &buffer.inner.wal {
                w.set_snapshot(recovery::snapshot_source(Arc::downgrade(&buffer.inner)));
                // Start from a compact log: replayed history is not needed.
                w.compact();
            }
        }
        buffer.inner.publish_gauges();
        Ok(buffer)
    }

    /// Counts a rollout refused before it reached [`Buffer::push`] (the
    /// service could not even read it).
    pub fn refuse(&self, rejection: Rejection) -> PushOutcome {
        self.inner.reject(rejection)
    }

    pub fn config(&self) -> &BufferConfig {
        &self.inner.cfg
    }

    pub fn learner_version(&self) -> u64 {
        self.inner.version.load(Relaxed)
    }

    /// Stores one rollout, waiting while a new group would break the
    /// admission bounds. `encoded_len` is its size on the wire.
    pub async fn push(&self, r: Rollout, encoded_len: usize) -> Result<PushOutcome, BufferError> {
        let inner = &*self.inner;
        // Read before the lineage: if the lineage changes after this, the
        // check is repeated where the rollout lands.
        let epoch = inner.lineage_epoch.load(Acquire);
        let learner_version = inner.version.load(Relaxed);
        let checked = {
            let learner = inner.learner.read();
            let limits = Limits {
                max_tokens: inner.cfg.max_tokens,
                max_rollout_bytes: inner.cfg.max_rollout_bytes,
                learner_version,
                lineage: Some(&learner.lineage),
            };
            validate::check(&r, encoded_len, limits)
        };
        if let Err(rej) = checked {
            return Ok(inner.reject(rej));
        }
        // A lease exists only for a group not yet in the buffer (its first
        // rollout redeems it): rollouts joining a group do not take the
        // lease table's lock, which every push would otherwise serialise on;
        // the group itself remembers its holder (`try_join_existing`).
        let other = if inner.groups.contains_key(&r.group_id) {
            None
        } else {
            inner.other_holder(&r.group_id, Some(&r.actor_id))
        };
        if let Some(holder) = other {
            return Ok(inner.reject(push::leased_by_other(&r, &holder)));
        }
        if eviction::is_stale(learner_version, r.oldest_version(), inner.cfg.max_staleness) {
            inner.evict_pending(&r.group_id, EvictReason::Stale);
            inner.release_lease(&r.group_id);
            let reason = format!(
                "oldest token version {} is more than max_staleness = {} behind the learner's version {}",
                r.oldest_version(),
                inner.cfg.max_staleness,
                learner_version
            );
            return Ok(inner.reject(Rejection::new(
                &r,
                RejectCode::FailedPrecondition,
                "stale",
                reason,
            )));
        }
        let mut r = Some(r);
        loop {
            if let Some(outcome) = inner.try_join_existing(&mut r, epoch) {
                return Ok(outcome);
            }
            match inner.create_if_leased(&mut r, epoch) {
                NewGroup::Created(outcome) => return Ok(outcome),
                NewGroup::Exists => continue,
                NewGroup::Unleased => {}
            }
            // A new group: reserve its place first, without holding any lock.
            inner.admit_new_group().await?;
            let rollout = r.take().expect("rollout is only taken on success");
            match inner.groups.entry(rollout.group_id.clone()) {
                Entry::Vacant(v) => {
                    // A lease granted while this rollout waited for room
                    // is redundant: one place is enough.
                    inner.release_lease(v.key());
                    return Ok(inner.create_group(v, rollout, None, epoch));
                }
                Entry::Occupied(_) => {
                    // Another stream created it meanwhile: give the place
                    // back and join it instead.
                    inner.release_admission();
                    r = Some(rollout);
                }
            }
        }
    }

    /// Resolves when everything accepted so far is as durable as the fsync
    /// policy promises. Immediate without a data dir.
    pub async fn sync(&self) -> Result<(), BufferError> {
        match &self.inner.wal {
            Some(w) => Ok(w.barrier().await?),
            None => Ok(()),
        }
    }

    /// Takes up to `n` groups, waiting up to `timeout` for `n` to be ready.
    pub async fn sample(
        &self,
        n: usize,
        timeout: Duration,
        allow_partial: bool,
    ) -> Result<Vec<SampledGroup>, BufferError> {
        let inner = &*self.inner;
        if n == 0 {
            return Err(BufferError::InvalidRequest(
                "num_groups must be at least 1".into(),
            ));
        }
        if n as u64 > inner.cfg.capacity_groups {
            return Err(BufferError::InvalidRequest(format!(
                "num_groups = {n} exceeds capacity_groups = {}",
                inner.cfg.capacity_groups
            )));
        }
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let out = loop {
            if inner.closing.load(Relaxed) {
                return Err(BufferError::Closing);
            }
            let notified = inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let expired = tokio::time::Instant::now() >= deadline;
            match inner.try_take(n, expired && allow_partial) {
                Ok(batch) => break batch,
                Err(ready) if expired => return Err(BufferError::NotEnough { ready, wanted: n }),
                Err(_) => {}
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        };
        inner.changed.notify_waiters();
        self.sync().await?;
        inner
            .metrics
            .sample_seconds
            .record(start.elapsed().as_secs_f64());
        Ok(out)
    }

    /// Records a version without a lineage (a learner that does not track
    /// incarnations); returns the groups it made too stale. See
    /// [`Buffer::report`].
    pub fn report_version(&self, version: u64) -> u64 {
        let report = LearnerReport {
            version,
            ..Default::default()
        };
        // A report without a lineage is never refused.
        self.report(report).map_or(0, |o| o.evicted_stale)
    }

    /// Records the learner's version report. From a new incarnation it
    /// adopts the version (even a lower one), evicts held groups outside
    /// the new history, re-bases admission and counts the group draws lost
    /// to the rollback (docs/architecture.md, "Failure model"). Ready
    /// groups the version made too stale are evicted now; pending ones at
    /// the next [`Buffer::sweep`] (within a second) or when they become
    /// ready: scanning every group id on each version would cost more than
    /// they hold.
    pub fn report(&self, report: LearnerReport) -> Result<ReportOutcome, BufferError> {
        let inner = &*self.inner;
        let LearnerReport {
            version,
            lineage,
            groups_trained,
            batch_groups,
        } = report;
        // The staleness bound admits (max_staleness + version + 1) batches
        // of the buffer's size: a learner taking other batches would make
        // it mean another staleness.
        if batch_groups != 0 && batch_groups != inner.cfg.batch_groups {
            return Err(BufferError::InvalidRequest(format!(
                "version report: the learner's batch_groups is {batch_groups} but the \
                 buffer's is {} (they must agree: set learner.batch_groups and \
                 buffer.batch_groups to one value)",
                inner.cfg.batch_groups
            )));
        }
        // A lineage that cannot be a history (forged, or from a broken
        // learner) must not evict or re-base anything: refused by entry.
        let lineage = Lineage::from_wire(&lineage, version)
            .map_err(|e| BufferError::InvalidRequest(format!("version report: {e}")))?;
        let mut learner = inner.learner.write();
        let kind = classify(&learner.lineage, &lineage, &learner.former)
            .map_err(BufferError::Superseded)?;
        let old = inner.version.swap(version, Relaxed);
        if kind == ReportKind::NewIncarnation {
            inner.adopt_incarnation(&mut learner, lineage, groups_trained, old);
        } else if version < old {
            tracing::warn!(
                old,
                new = version,
                "learner version went back within one incarnation (a learner without lineage resumed?)"
            );
        }
        if inner.wal.is_some() {
            inner.log(Kind::Version(inner.version_record(&learner, version)));
        }
        // Only a new incarnation needs the history, to evict by it.
        let history = (kind == ReportKind::NewIncarnation).then(|| learner.lineage.clone());
        drop(learner);
        let evicted_rolled_back = history.map_or(0, |h| inner.evict_rolled_back(&h, version));
        let evicted_stale = {
            let mut ready = inner.ready.lock();
            inner.evict_stale_ready(&mut ready, version)
        };
        inner.publish_gauges();
        inner.changed.notify_waiters();
        Ok(ReportOutcome {
            evicted_stale,
            evicted_rolled_back,
        })
    }

    /// Evicts stale pending groups, seals timed-out ones (ready with at
    /// least `min_group_size` members, evicted otherwise), expires leases
    /// and prunes old tombstones.
    pub fn sweep(&self, now: Instant) {
        let inner = &*self.inner;
        inner.expire_leases(now);
        let timeout = inner.cfg.group_timeout();
        let version = inner.version.load(Relaxed);
        let mut stale = Vec::new();
        let mut expired = Vec::new();
        for e in inner.groups.iter() {
            if let GroupEntry::Pending(p) = e.value() {
                if eviction::is_stale(version, p.oldest_version, inner.cfg.max_staleness) {
                    stale.push(e.key().clone());
                } else if now.duration_since(p.created) >= timeout {
                    expired.push(e.key().clone());
                }
            }
        }
        for id in stale {
            inner.evict_pending(&id, EvictReason::Stale);
        }
        for id in expired {
            let Some(slot) = inner.groups.get_mut(&id) else {
                continue;
            };
            let GroupEntry::Pending(p) = &*slot else {
                continue;
            };
            if p.members.len() >= inner.cfg.min_group_size as usize {
                inner.seal_into_ready(slot);
            } else {
                drop(slot);
                inner.evict_pending(&id, EvictReason::Incomplete);
            }
        }
        inner.prune_tombstones();
        inner.publish_gauges();
    }

    /// Runs [`Buffer::sweep`] periodically until the guard is dropped.
    pub fn spawn_maintenance(&self) -> Maintenance {
        let this = self.clone();
        let period = (self.inner.cfg.group_timeout() / 4)
            .clamp(Duration::from_millis(20), Duration::from_secs(1));
        Maintenance(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                this.sweep(Instant::now());
            }
        }))
    }

    /// Stops admitting new groups and sampling: everyone waiting gets
    /// [`BufferError::Closing`] (UNAVAILABLE on the wire), so a graceful
    /// shutdown is not held up by a push waiting for room.
    pub fn release_waiters(&self) {
        self.inner.closing.store(true, Relaxed);
        self.inner.changed.notify_waiters();
    }

    /// Stops admitting and sampling, releases everyone waiting, and flushes
    /// the log. Accepted data stays in the log for the next start.
    pub async fn close(&self) -> Result<(), BufferError> {
        self.release_waiters();
        if let Some(w) = &self.inner.wal {
            w.close().await?;
        }
        Ok(())
    }

    pub fn stats(&self) -> Stats {
        let inner = &*self.inner;
        let learner = inner.learner.read();
        let ready = inner.ready.lock().len() as u64;
        let ledger = inner.ledger.lock().clone();
        let version = inner.version.load(Relaxed);
        let c = &inner.counters;
        let rejections = c.rejected.lock().clone();
        Stats {
            learner_version: version,
            max_staleness: inner.cfg.max_staleness,
            groups_pending: inner.pending.load(Relaxed),
            groups_ready: ready,
            bytes_held: inner.bytes.load(Relaxed),
            rollouts_accepted: c.accepted.load(Relaxed),
            rollouts_duplicate: c.duplicate.load(Relaxed),
            rollouts_rejected: rejections.values().sum(),
            rejections,
            groups_consumed: ledger.consumed,
            group_samples: c.samples.load(Relaxed),
            evictions: EvictReason::ALL
                .iter()
                .map(|r| (r.label(), c.evictions[r.index()].load(Relaxed)))
                .collect(),
            admitted_groups: ledger.admitted(),
            admission_limit: inner.bound.limit(&ledger, version),
            groups_admitted: ledger.inserted,
            learner_incarnation: learner.lineage.current_id(),
            groups_lost_to_rollback: learner.lost_to_rollback,
            leases_outstanding: ledger.leased,
            leases_granted: c.leases_granted.load(Relaxed),
            leases_expired: c.leases_expired.load(Relaxed),
            leases_used: c.leases_used.load(Relaxed),
            leases_released: c.leases_released.load(Relaxed),
        }
    }
}

/// Owns the maintenance task; dropping it stops the task.
pub struct Maintenance(JoinHandle<()>);

impl Drop for Maintenance {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Inner {
    /// Runs the test hook, if any; nothing outside tests.
    #[inline(always)]
    fn after_seal(&self) {
        #[cfg(test)]
        if let Some(f) = &*self.on_seal.lock() {
            f();
        }
    }

    fn reject(&self, rej: Rejection) -> PushOutcome {
        *self.counters.rejected.lock().entry(rej.label).or_default() += 1;
        metrics::counter!(m::REJECTIONS, "reason" => rej.label).increment(1);
        PushOutcome::Rejected(rej)
    }

    fn accepted(&self) {
        self.counters.accepted.fetch_add(1, Relaxed);
        self.metrics.accepted.increment(1);
    }

    fn duplicate(&self) -> PushOutcome {
        self.counters.duplicate.fetch_add(1, Relaxed);
        self.metrics.duplicate.increment(1);
        PushOutcome::Duplicate
    }

    fn log(&self, kind: Kind) {
        if let Some(w) = &self.wal {
            w.append_record(&walpb::Record { kind: Some(kind) });
        }
    }

    fn log_rollout(&self, r: &Rollout) {
        if self.wal.is_some() {
            self.log(Kind::Rollout(wire::rollout_to_wire(r)));
        }
    }
}

mod admit;
mod learner;
mod leasing;
mod push;
mod recovery;
mod seal;
mod take;
use leasing::NewGroup;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod lease_tests;
