//! A pushed rollout joining its group: an existing one (or a sealed one,
//! refused), a new one, and the history check repeated where it lands.

use super::*;

impl Inner {
    /// Adds the rollout to its existing group, if there is one. Leaves `r`
    /// in place (and returns `None`) when the group does not exist yet.
    pub(super) fn try_join_existing(
        &self,
        r: &mut Option<Rollout>,
        epoch: u64,
    ) -> Option<PushOutcome> {
        let rollout = r.as_ref().expect("caller passes a rollout");
        let mut slot = self.groups.get_mut(&rollout.group_id)?;
        match &mut *slot {
            GroupEntry::Sealed(ids) => {
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
            GroupEntry::Pending(p) => {
                if p.contains(&rollout.id) {
                    return Some(self.duplicate());
                }
                if let Some(rej) = foreign_member(p, rollout) {
                    drop(slot);
                    return Some(self.reject(rej));
                }
                let k = self.cfg.group_size as usize;
                if p.members.len() >= k {
                    let reason = format!("group already has group_size = {k} members");
                    let rej =
                        Rejection::new(rollout, RejectCode::InvalidArgument, "group_full", reason);
                    drop(slot);
                    return Some(self.reject(rej));
                }
                if let Err(rej) = self.recheck_history(rollout, epoch) {
                    drop(slot);
                    return Some(self.reject(rej));
                }
                let rollout = r.take().expect("checked above");
                self.log_rollout(&rollout);
                let added = p.add(rollout);
                self.bytes.fetch_add(added, Relaxed);
                if p.members.len() == k {
                    self.seal_into_ready(slot);
                }
                self.accepted();
                Some(PushOutcome::Accepted)
            }
        }
    }

    /// Starts a new pending group with its first rollout. Its place in the
    /// ledger is already reserved (by admission or a lease), and given back
    /// if the history check fails. `holder`: the identity whose lease it
    /// redeemed, the only one that may add members.
    pub(super) fn create_group(
        &self,
        v: VacantEntry<'_, String, GroupEntry>,
        rollout: Rollout,
        holder: Option<String>,
        epoch: u64,
    ) -> PushOutcome {
        if let Err(rej) = self.recheck_history(&rollout, epoch) {
            drop(v);
            self.release_admission();
            return self.reject(rej);
        }
        self.log_rollout(&rollout);
        let mut group = PendingGroup::new(rollout, Instant::now());
        group.holder = holder;
        self.bytes.fetch_add(group.bytes, Relaxed);
        let slot = v.insert(GroupEntry::Pending(group));
        self.pending.fetch_add(1, Relaxed);
        if self.cfg.group_size == 1 {
            self.seal_into_ready(slot);
        }
        self.accepted();
        PushOutcome::Accepted
    }

    /// The history check once more, for a rollout checked against a lineage
    /// that a report has since replaced (`epoch` was read before that
    /// check). One atomic load when nothing changed.
    pub(super) fn recheck_history(&self, r: &Rollout, epoch: u64) -> Result<(), Rejection> {
        if self.lineage_epoch.load(Acquire) == epoch {
            return Ok(());
        }
        let learner = self.learner.read();
        validate::check_history(r, &learner.lineage, self.version.load(Relaxed))
    }
}

/// The refusal of a member pushed into a leased group by another identity
/// than the lease's: the lease reserved the group's room for its holder
/// until the group is complete, not only until its first rollout.
fn foreign_member(group: &PendingGroup, r: &Rollout) -> Option<Rejection> {
    let holder = group.holder.as_deref()?;
    (holder != r.actor_id).then(|| leased_by_other(r, holder))
}

/// A rollout refused because `holder`, another identity, leased its group.
pub(super) fn leased_by_other(r: &Rollout, holder: &str) -> Rejection {
    let reason = format!(
        "group is leased by {holder:?}; a leased group is pushed by the identity that took the lease"
    );
    Rejection::new(r, RejectCode::FailedPrecondition, "leased_by_other", reason)
}
