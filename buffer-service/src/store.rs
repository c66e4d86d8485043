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
//!
//! Lock order is `groups` shard → `ready` → `ledger`; `tombstones` is taken
//! alone. No lock is held across an `.await`.
//!
//! Write-ahead records are queued while the lock that orders the change is
//! held (a rollout under its group's shard, a ready or sampled record under
//! `ready`), so the log order is a valid history.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use bapo_proto::wal::{self as walpb, record::Kind};
use dashmap::{DashMap, mapref::entry::Entry};
use parking_lot::Mutex;
use rand::{SeedableRng, rngs::SmallRng};
use tokio::{sync::Notify, task::JoinHandle};

use crate::{
    admission::{Capacity, Hold, Ledger, StalenessBound},
    config::{BufferConfig, FullPolicy},
    eviction::{self, EvictReason},
    group::{PendingGroup, ReadyGroup, SampledGroup, Slot},
    metrics as m,
    rate_limit::RateLimiter,
    ready::ReadyStore,
    rollout::Rollout,
    sampler,
    validate::{self, Limits, RejectCode, Rejection},
    wal::{Wal, WalError},
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
    pub groups_retired: u64,
    pub group_samples: u64,
    pub evictions: HashMap<&'static str, u64>,
    pub admitted_groups: u64,
    pub admission_limit: u64,
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
    evictions: [AtomicU64; 3],
}

struct Inner {
    cfg: BufferConfig,
    bound: StalenessBound,
    capacity: Capacity,
    limiter: Option<RateLimiter>,
    uses_per_group: u32,
    version: AtomicU64,
    groups: DashMap<String, Slot>,
    pending: AtomicU64,
    ready: Mutex<ReadyStore>,
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
        let limiter = cfg.sampling.replays().then(|| {
            RateLimiter::new(
                cfg.samples_per_insert,
                cfg.rate_limit_error_buffer,
                cfg.batch_groups as u64,
            )
        });
        let inner = Arc::new(Inner {
            bound: StalenessBound {
                max_staleness: cfg.max_staleness,
                batch_groups: cfg.batch_groups as u64,
            },
            capacity: Capacity {
                groups: cfg.capacity_groups,
                bytes: cfg.capacity_bytes,
            },
            limiter,
            uses_per_group: cfg.uses_per_group(),
            version: AtomicU64::new(0),
            groups: DashMap::new(),
            pending: AtomicU64::new(0),
            ready: Mutex::new(ReadyStore::new(
                sampler::from_config(&cfg),
                SmallRng::seed_from_u64(cfg.seed),
            )),
            ledger: Mutex::new(Ledger::default()),
            bytes: AtomicU64::new(0),
            tombstones: Mutex::new(VecDeque::new()),
            changed: Notify::new(),
            closing: AtomicBool::new(false),
            counters: Counters::default(),
            metrics: m::Handles::register(),
            wal,
            cfg,
        });
        let buffer = Buffer { inner };
        if let Some(rec) = recovered {
            buffer.inner.replay(rec.records);
            let weak = Arc::downgrade(&buffer.inner);
            if let Some(w) = &buffer.inner.wal {
                w.set_snapshot(Box::new(move || {
                    weak.upgrade().map(|i| i.snapshot()).unwrap_or_default()
                }));
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
        let limits = Limits {
            max_tokens: inner.cfg.max_tokens,
            max_rollout_bytes: inner.cfg.max_rollout_bytes,
            learner_version: inner.version.load(Relaxed),
        };
        if let Err(rej) = validate::check(&r, encoded_len, limits) {
            return Ok(inner.reject(rej));
        }
        if eviction::is_stale(
            limits.learner_version,
            r.oldest_version(),
            inner.cfg.max_staleness,
        ) {
            inner.evict_pending(&r.group_id, EvictReason::Stale);
            let reason = format!(
                "oldest token version {} is more than max_staleness = {} behind the learner's version {}",
                r.oldest_version(),
                inner.cfg.max_staleness,
                limits.learner_version
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
            if let Some(outcome) = inner.try_join_existing(&mut r) {
                return Ok(outcome);
            }
            // A new group: reserve its place first, without holding any lock.
            inner.admit_new_group().await?;
            let rollout = r.take().expect("rollout is only taken on success");
            match inner.groups.entry(rollout.group_id.clone()) {
                Entry::Vacant(v) => {
                    inner.log_rollout(&rollout);
                    let id = v.key().clone();
                    let group = PendingGroup::new(rollout, Instant::now());
                    inner.bytes.fetch_add(group.bytes, Relaxed);
                    if inner.cfg.group_size == 1 {
                        let ids = group.member_ids();
                        v.insert(Slot::Sealed(ids));
                        inner.make_ready(id, group);
                    } else {
                        v.insert(Slot::Pending(group));
                        inner.pending.fetch_add(1, Relaxed);
                    }
                    inner.accepted();
                    return Ok(PushOutcome::Accepted);
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

    /// Records the learner's version and evicts the ready groups it made too
    /// stale (pending ones go at the next [`Buffer::sweep`], within a
    /// second, or when their next member arrives: scanning every group id on
    /// each version would cost more than they hold).
    pub fn report_version(&self, version: u64) -> u64 {
        let inner = &*self.inner;
        let old = inner.version.swap(version, Relaxed);
        if version < old {
            tracing::warn!(
                old,
                new = version,
                "learner version went back (resumed from an older checkpoint?)"
            );
        }
        inner.log(Kind::Version(walpb::Version { version }));
        let evicted = {
            let mut ready = inner.ready.lock();
            inner.evict_stale_ready(&mut ready, version)
        };
        inner.publish_gauges();
        inner.changed.notify_waiters();
        evicted
    }

    /// Evicts stale pending groups, seals timed-out ones (ready with at
    /// least `min_group_size` members, evicted otherwise) and prunes old
    /// tombstones.
    pub fn sweep(&self, now: Instant) {
        let inner = &*self.inner;
        let timeout = inner.cfg.group_timeout();
        let version = inner.version.load(Relaxed);
        let mut stale = Vec::new();
        let mut expired = Vec::new();
        for e in inner.groups.iter() {
            if let Slot::Pending(p) = e.value() {
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
            let Some(mut slot) = inner.groups.get_mut(&id) else {
                continue;
            };
            let Slot::Pending(p) = &*slot else { continue };
            if p.members.len() >= inner.cfg.min_group_size as usize {
                let p = slot.seal().expect("matched as pending above");
                inner.pending.fetch_sub(1, Relaxed);
                drop(slot);
                inner.tombstone(id.clone());
                inner.make_ready(id, p);
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
            groups_retired: ledger.retired,
            group_samples: c.samples.load(Relaxed),
            evictions: EvictReason::ALL
                .iter()
                .map(|r| (r.label(), c.evictions[r.index()].load(Relaxed)))
                .collect(),
            admitted_groups: ledger.admitted(),
            admission_limit: inner.bound.limit(version),
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

    /// Adds the rollout to its existing group, if there is one. Leaves `r`
    /// in place (and returns `None`) when the group does not exist yet.
    fn try_join_existing(&self, r: &mut Option<Rollout>) -> Option<PushOutcome> {
        let rollout = r.as_ref().expect("caller passes a rollout");
        let mut slot = self.groups.get_mut(&rollout.group_id)?;
        match &mut *slot {
            Slot::Sealed(ids) => {
                if ids.contains(&rollout.id) {
                    Some(self.duplicate())
                } else {
                    let reason = format!(
                        "group is already sealed (complete, timed out, handed out or evicted) with {} members",
                        ids.len()
                    );
                    let rej = Rejection::new(
                        rollout,
                        RejectCode::FailedPrecondition,
                        "group_sealed",
                        reason,
                    );
                    drop(slot);
                    Some(self.reject(rej))
                }
            }
            Slot::Pending(p) => {
                if p.contains(&rollout.id) {
                    return Some(self.duplicate());
                }
                let k = self.cfg.group_size as usize;
                if p.members.len() >= k {
                    let reason = format!("group already has group_size = {k} members");
                    let rej =
                        Rejection::new(rollout, RejectCode::InvalidArgument, "group_full", reason);
                    drop(slot);
                    return Some(self.reject(rej));
                }
                let rollout = r.take().expect("checked above");
                self.log_rollout(&rollout);
                let added = p.add(rollout);
                self.bytes.fetch_add(added, Relaxed);
                if p.members.len() == k {
                    let id = slot.key().clone();
                    let p = slot.seal().expect("matched as pending above");
                    self.pending.fetch_sub(1, Relaxed);
                    drop(slot);
                    self.tombstone(id.clone());
                    self.make_ready(id, p);
                }
                self.accepted();
                Some(PushOutcome::Accepted)
            }
        }
    }

    /// Reserves a place for a new group, waiting while a bound says no.
    async fn admit_new_group(&self) -> Result<(), BufferError> {
        let mut held_since: Option<(Instant, Hold)> = None;
        loop {
            if self.closing.load(Relaxed) {
                return Err(BufferError::Closing);
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_admit() {
                Ok(()) => {
                    if let Some((since, why)) = held_since {
                        self.metrics.backpressure[why.index()]
                            .record(since.elapsed().as_secs_f64());
                    }
                    self.metrics.admitted.increment(1);
                    return Ok(());
                }
                Err(Hold::Full)
                    if self.cfg.when_full == FullPolicy::DropOldest && self.drop_oldest() =>
                {
                    continue;
                }
                Err(why) => {
                    held_since.get_or_insert((Instant::now(), why));
                }
            }
            notified.await;
        }
    }

    fn try_admit(&self) -> Result<(), Hold> {
        let version = self.version.load(Relaxed);
        let mut l = self.ledger.lock();
        if !self.capacity.has_room(l.held, self.bytes.load(Relaxed)) {
            return Err(Hold::Full);
        }
        if !self.bound.admits(&l, version) {
            return Err(Hold::Staleness);
        }
        if let Some(rl) = &self.limiter
            && !rl.can_insert(&l)
        {
            return Err(Hold::RateLimited);
        }
        l.held += 1;
        l.inserted += 1;
        Ok(())
    }

    fn release_admission(&self) {
        let mut l = self.ledger.lock();
        l.held -= 1;
        l.inserted -= 1;
        drop(l);
        self.changed.notify_waiters();
    }

    fn tombstone(&self, id: String) {
        self.tombstones.lock().push_back(id);
    }

    fn prune_tombstones(&self) {
        let excess: Vec<String> = {
            let mut t = self.tombstones.lock();
            let n = t.len().saturating_sub(self.cfg.dedup_window_groups);
            t.drain(..n).collect()
        };
        for id in excess {
            self.groups
                .remove_if(&id, |_, s| matches!(s, Slot::Sealed(_)));
        }
    }

    /// Moves a sealed pending group into the ready store.
    fn make_ready(&self, id: String, p: PendingGroup) {
        let mut ready = self.ready.lock();
        let sequence = ready.next_sequence;
        ready.next_sequence += 1;
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
    fn evict_pending(&self, id: &str, reason: EvictReason) -> bool {
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
    fn release_evicted(&self, groups: Vec<(String, u64)>, reason: EvictReason) {
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

    /// Evicts the oldest ready group to make room. False when none is ready.
    fn drop_oldest(&self) -> bool {
        let mut ready = self.ready.lock();
        let Some(g) = ready.pop_oldest() else {
            return false;
        };
        self.release_evicted(vec![(g.id.clone(), g.bytes)], EvictReason::Capacity);
        true
    }

    fn evict_stale_ready(&self, ready: &mut ReadyStore, version: u64) -> u64 {
        let stale = ready.take_stale(version, self.cfg.max_staleness);
        let n = stale.len() as u64;
        let evicted = stale.into_iter().map(|g| (g.id.clone(), g.bytes)).collect();
        self.release_evicted(evicted, EvictReason::Stale);
        n
    }

    /// Takes a batch if one may be taken now. `Err(ready)` when not enough
    /// groups are ready (or the rate limiter says wait).
    fn try_take(&self, n: usize, partial: bool) -> Result<Vec<SampledGroup>, usize> {
        let version = self.version.load(Relaxed);
        let mut ready = self.ready.lock();
        self.evict_stale_ready(&mut ready, version);
        let avail = ready.len();
        let k = if avail >= n {
            n
        } else if partial {
            avail
        } else {
            return Err(avail);
        };
        if k == 0 {
            return Ok(Vec::new());
        }
        let mut ledger = self.ledger.lock();
        if let Some(rl) = &self.limiter
            && !rl.can_sample(&ledger, k as u64)
        {
            return Err(avail);
        }
        let mut picks = ready.pick(k);
        let mut out = Vec::with_capacity(k);
        let mut uses = Vec::with_capacity(k);
        for &i in &picks {
            let (group, use_count) = ready.use_at(i);
            uses.push(walpb::GroupUse {
                group_id: group.id.clone(),
                use_count,
            });
            let staleness = eviction::staleness(version, group.oldest_version);
            self.metrics.staleness.record(staleness as f64);
            self.metrics.reuse.record(use_count as f64);
            out.push(SampledGroup {
                group,
                staleness,
                use_count,
            });
        }
        // Retire groups that reached their last use, highest index first so
        // the remaining indices stay valid.
        picks.sort_unstable_by(|a, b| b.cmp(a));
        let mut retired = 0u64;
        for i in picks {
            if ready.uses_at(i) >= self.uses_per_group {
                let g = ready.remove_at(i).expect("picked index is in range");
                self.bytes.fetch_sub(g.bytes, Relaxed);
                retired += 1;
            }
        }
        ledger.samples += k as u64;
        ledger.retired += retired;
        ledger.held -= retired;
        drop(ledger);
        self.log(Kind::Sampled(walpb::Sampled { uses }));
        drop(ready);
        self.counters.samples.fetch_add(k as u64, Relaxed);
        self.metrics.samples.increment(k as u64);
        self.metrics.retired.increment(retired);
        self.publish_gauges();
        Ok(out)
    }

    fn publish_gauges(&self) {
        let version = self.version.load(Relaxed);
        let ready = self.ready.lock().len();
        let h = &self.metrics;
        h.pending.set(self.pending.load(Relaxed) as f64);
        h.ready.set(ready as f64);
        h.bytes.set(self.bytes.load(Relaxed) as f64);
        h.version.set(version as f64);
        h.admission_limit.set(self.bound.limit(version) as f64);
    }

    /// Rebuilds the state from log records (see `wal.rs` on idempotence).
    fn replay(&self, records: Vec<walpb::Record>) {
        let mut ready: HashMap<String, (ReadyGroup, u32)> = HashMap::new();
        let mut retired = 0u64;
        let mut next_sequence = 0u64;
        let now = Instant::now();
        let n_records = records.len();
        for rec in records {
            match rec.kind {
                Some(Kind::Meta(meta)) => {
                    self.version.store(meta.learner_version, Relaxed);
                    retired = meta.retired_groups;
                    next_sequence = next_sequence.max(meta.next_sequence);
                }
                Some(Kind::Version(v)) => self.version.store(v.version, Relaxed),
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
                            v.insert(Slot::Pending(PendingGroup::new(r, now)));
                        }
                        Entry::Occupied(mut o) => {
                            if let Slot::Pending(p) = o.get_mut()
                                && !p.contains(&r.id)
                            {
                                p.add(r);
                            }
                        }
                    }
                }
                Some(Kind::Ready(rd)) => {
                    next_sequence = next_sequence.max(rd.sequence + 1);
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
                                retired += 1;
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
                        .or_insert_with(|| Slot::Sealed(t.rollout_ids));
                }
                None => {}
            }
        }
        // Groups whose last member landed but whose ready record did not.
        let complete: Vec<String> = self
            .groups
            .iter()
            .filter_map(|e| match e.value() {
                Slot::Pending(p) if p.members.len() >= self.cfg.group_size as usize => {
                    Some(e.key().clone())
                }
                _ => None,
            })
            .collect();
        let mut store = self.ready.lock();
        let mut ready: Vec<_> = ready.into_values().collect();
        ready.sort_by_key(|(g, _)| g.sequence);
        store.next_sequence = next_sequence;
        let mut bytes = 0;
        for (g, used) in ready {
            bytes += g.bytes;
            store.push(Arc::new(g), used);
        }
        for id in complete {
            if let Some(mut slot) = self.groups.get_mut(&id)
                && let Some(p) = slot.seal()
            {
                let sequence = store.next_sequence;
                store.next_sequence += 1;
                bytes += p.bytes;
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
                Slot::Pending(p) => {
                    pending += 1;
                    bytes += p.bytes;
                }
                Slot::Sealed(_) => tombstones.push_back(e.key().clone()),
            }
        }
        let held = pending + store.len() as u64;
        let samples: u64 = store.iter().map(|(_, u)| *u as u64).sum::<u64>()
            + retired * self.uses_per_group as u64;
        *self.ledger.lock() = Ledger {
            retired,
            held,
            inserted: retired + held,
            samples,
        };
        self.pending.store(pending, Relaxed);
        self.bytes.store(bytes, Relaxed);
        tracing::info!(
            records = n_records,
            ready = store.len(),
            pending,
            retired,
            version = self.version.load(Relaxed),
            "replayed write-ahead log"
        );
    }

    /// The live state as log records, for compaction. See the module docs of
    /// `wal.rs` for why records queued meanwhile may be replayed on top.
    fn snapshot(&self) -> Vec<walpb::Record> {
        let rec = |kind| walpb::Record { kind: Some(kind) };
        let mut pending_records = Vec::new();
        let mut sealed = Vec::new();
        for e in self.groups.iter() {
            match e.value() {
                Slot::Pending(p) => {
                    for m in &p.members {
                        pending_records.push(rec(Kind::Rollout(wire::rollout_to_wire(m))));
                    }
                }
                Slot::Sealed(ids) => sealed.push((e.key().clone(), ids.clone())),
            }
        }
        let ready = self.ready.lock();
        let meta = walpb::Meta {
            learner_version: self.version.load(Relaxed),
            retired_groups: self.ledger.lock().retired,
            next_sequence: ready.next_sequence,
        };
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

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
