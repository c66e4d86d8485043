//! Leases in the store: granting room for a group before it is generated,
//! turning a lease into the held group when the group's first rollout
//! arrives, and expiring leases whose actor went away. The table itself
//! and why leases exist are in `lease.rs`.
//!
//! Locks: a lease is granted, and redeemed by its group's first rollout,
//! under the shard lock of its group id, so a lease and a group of the same
//! id never both count against the bounds. Then `leases`, then `ledger`:
//! the table and the ledger's `leased` count change together.

use std::{
    sync::atomic::Ordering::Relaxed,
    time::{Duration, Instant},
};

use dashmap::mapref::entry::Entry;

use super::{Buffer, BufferError, Inner, PushOutcome};
use crate::{
    admission::{Hold, View},
    lease::{Grant, LeaseAnswer},
    rollout::Rollout,
    validate,
};

/// Why a lease was not granted now.
enum Refused {
    /// A bound says no; waiting may help.
    Held(Hold),
    /// The group is already in the buffer (pending, or sealed).
    Exists,
    /// Another identity holds the lease on this group id.
    NotHolder(String),
}

/// What the first rollout of a group found about a lease on it.
pub(super) enum NewGroup {
    /// It was leased: the group now exists, with this outcome.
    Created(PushOutcome),
    /// Another stream created the group meanwhile: join it.
    Exists,
    /// No lease: the push-time admission rules apply.
    Unleased,
}

impl Buffer {
    /// Grants `holder` (the caller's verified identity, if any) a lease on
    /// `group_id`, or renews the one it holds there; a lease another
    /// identity holds is refused. While no rule admits a new group, waits
    /// up to `wait` for room (backpressure), then answers
    /// [`LeaseAnswer::NotGranted`]: the caller asks again, and nothing is
    /// reserved meanwhile. A renewal is never held.
    pub async fn lease(
        &self,
        group_id: &str,
        holder: Option<&str>,
        wait: Duration,
    ) -> Result<LeaseAnswer, BufferError> {
        let inner = &*self.inner;
        validate::check_group_id(group_id).map_err(BufferError::InvalidRequest)?;
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if inner.closing.load(Relaxed) {
                return Err(BufferError::Closing);
            }
            let notified = inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let held_by = match inner.try_lease(group_id, holder, Instant::now()) {
                Ok(grant) => {
                    if !grant.renewed {
                        let waited = start.elapsed().as_secs_f64();
                        inner.metrics.lease_wait_granted.record(waited);
                    }
                    return Ok(LeaseAnswer::Granted(grant));
                }
                Err(Refused::Exists) => {
                    return Err(BufferError::AlreadyPushed(format!(
                        "group {group_id:?} is already in the buffer; a lease is for a group not yet pushed"
                    )));
                }
                Err(Refused::NotHolder(other)) => {
                    return Err(not_holder(group_id, &other, "renew"));
                }
                Err(Refused::Held(Hold::Full)) if inner.make_room() => continue,
                Err(Refused::Held(why)) => why,
            };
            if tokio::time::Instant::now() >= deadline {
                let waited = start.elapsed().as_secs_f64();
                inner.metrics.lease_wait_not_granted.record(waited);
                let (version, incarnation) = inner.learner_now();
                return Ok(LeaseAnswer::NotGranted {
                    version,
                    incarnation,
                    held_by,
                });
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }
}

impl Buffer {
    /// Gives back the lease on `group_id` because its actor (`holder`, the
    /// identity that took it) dropped the group: its room is free now, not
    /// `ttl` later. `false` when the id holds no lease (used, expired,
    /// released before, or lost to a restart): releasing is idempotent.
    pub fn give_back_lease(
        &self,
        group_id: &str,
        holder: Option<&str>,
    ) -> Result<bool, BufferError> {
        validate::check_group_id(group_id).map_err(BufferError::InvalidRequest)?;
        let inner = &*self.inner;
        if let Some(other) = inner.other_holder(group_id, holder) {
            return Err(not_holder(group_id, &other, "give back"));
        }
        if !inner.drop_lease(group_id) {
            return Ok(false);
        }
        inner.counters.leases_released.fetch_add(1, Relaxed);
        inner.metrics.leases_released.increment(1);
        Ok(true)
    }
}

/// The refusal of an act on a lease another identity holds.
fn not_holder(group_id: &str, holder: &str, act: &str) -> BufferError {
    BufferError::NotHolder(format!(
        "group {group_id:?} is leased by {holder:?}; only the identity that took a lease may {act} it"
    ))
}

impl Inner {
    /// Who holds the lease on `group_id`, when that is not `caller` (and
    /// the lease was taken authenticated).
    pub(super) fn other_holder(&self, group_id: &str, caller: Option<&str>) -> Option<String> {
        let leases = self.leases.lock();
        let l = leases.get(group_id)?;
        (!l.held_by(caller)).then(|| l.holder.clone().unwrap_or_default())
    }

    /// The learner's version and current incarnation (0: none reported).
    fn learner_now(&self) -> (u64, u64) {
        let incarnation = self.learner.read().lineage.current_id();
        (self.version.load(Relaxed), incarnation)
    }

    /// One attempt at a lease: a renewal if `group_id` holds one, else a
    /// new one if every admission rule allows a new group.
    fn try_lease(
        &self,
        group_id: &str,
        holder: Option<&str>,
        now: Instant,
    ) -> Result<Grant, Refused> {
        let (version, incarnation) = self.learner_now();
        // Under the shard lock: the group's first rollout cannot slip in
        // between this check and the grant.
        let slot = match self.groups.entry(group_id.to_string()) {
            Entry::Occupied(_) => return Err(Refused::Exists),
            Entry::Vacant(v) => v,
        };
        let mut leases = self.leases.lock();
        if let Some(l) = leases.get(group_id).filter(|l| !l.held_by(holder)) {
            return Err(Refused::NotHolder(l.holder.clone().unwrap_or_default()));
        }
        if let Some(l) = leases.renew(group_id, now) {
            self.metrics.leases_renewed.increment(1);
            return Ok(Grant::of(&l, now, true));
        }
        let bytes = self.bytes.load(Relaxed);
        {
            let mut ledger = self.ledger.lock();
            let view = View {
                ledger: &ledger,
                version,
                bytes,
            };
            self.admission.check(&view).map_err(Refused::Held)?;
            ledger.leased += 1;
        }
        let l = leases.grant(group_id, holder, (version, incarnation), now);
        self.metrics.leases.set(leases.len() as f64);
        drop(leases);
        drop(slot);
        self.counters.leases_granted.fetch_add(1, Relaxed);
        self.metrics.leases_granted.increment(1);
        Ok(Grant::of(&l, now, false))
    }

    /// Creates the group of `r` if its id holds a lease: the group was
    /// admitted when the lease was granted and is not checked again.
    pub(super) fn create_if_leased(&self, r: &mut Option<Rollout>, epoch: u64) -> NewGroup {
        let Some(id) = r.as_ref().map(|r| r.group_id.clone()) else {
            return NewGroup::Unleased;
        };
        let v = match self.groups.entry(id) {
            Entry::Occupied(_) => return NewGroup::Exists,
            Entry::Vacant(v) => v,
        };
        let Some(holder) = self.redeem_lease(v.key()) else {
            return NewGroup::Unleased;
        };
        match r.take() {
            Some(rollout) => NewGroup::Created(self.create_group(v, rollout, holder, epoch)),
            None => NewGroup::Unleased,
        }
    }

    /// Turns the lease on `group_id`, if any, into a held group, and
    /// returns its holder (None inside when it was taken unauthenticated).
    /// Called under the group's shard lock.
    fn redeem_lease(&self, group_id: &str) -> Option<Option<String>> {
        let mut leases = self.leases.lock();
        let holder = leases.take(group_id)?.holder;
        {
            let mut l = self.ledger.lock();
            l.leased -= 1;
            l.held += 1;
            l.inserted += 1;
        }
        self.metrics.leases.set(leases.len() as f64);
        drop(leases);
        self.counters.leases_used.fetch_add(1, Relaxed);
        self.metrics.leases_used.increment(1);
        self.metrics.admitted.increment(1);
        Some(holder)
    }

    /// Gives back the lease on `group_id`, if any, when its group arrived
    /// without needing it: admitted on its own (a lease granted while its
    /// first rollout waited for room; one place is enough), or refused as
    /// too stale to train on.
    pub(super) fn release_lease(&self, group_id: &str) {
        if self.drop_lease(group_id) {
            self.counters.leases_used.fetch_add(1, Relaxed);
            self.metrics.leases_used.increment(1);
        }
    }

    /// Removes the lease on `group_id`, if any, and frees its room for
    /// whoever waits; the caller counts why. `false`: there was none.
    fn drop_lease(&self, group_id: &str) -> bool {
        let mut leases = self.leases.lock();
        if leases.take(group_id).is_none() {
            return false;
        }
        self.ledger.lock().leased -= 1;
        self.metrics.leases.set(leases.len() as f64);
        drop(leases);
        self.changed.notify_waiters();
        true
    }

    /// Removes the leases due at `now`: their room goes to whoever waits.
    pub(super) fn expire_leases(&self, now: Instant) {
        let mut leases = self.leases.lock();
        if leases.is_empty() {
            return;
        }
        let gone = leases.expire(now);
        if gone.is_empty() {
            return;
        }
        let n = gone.len() as u64;
        self.ledger.lock().leased -= n;
        self.metrics.leases.set(leases.len() as f64);
        drop(leases);
        self.counters.leases_expired.fetch_add(n, Relaxed);
        self.metrics.leases_expired.increment(n);
        tracing::info!(
            expired = n,
            first = %gone[0],
            "leases ran out before their groups arrived (actor gone?); their room is free again"
        );
        self.changed.notify_waiters();
    }
}
