//! The lease table: room reserved for groups that actors are generating.
//!
//! AReaL's controller gates *generation* on the staleness bound. Checked
//! only when a finished group arrives, the bound makes an actor generate a
//! group and then wait at the door while the learner moves on, so that the
//! group is stale by the time it gets in (with `max_staleness = 0`, about
//! 40% of generated rollouts were thrown away). An actor therefore asks for
//! a lease on the group id it will push before generating; the admission
//! rules (`admission.rs`) grant it counting outstanding leases as groups,
//! and the group's first rollout turns the lease into a held group without
//! a second check.
//!
//! A lease expires `ttl` after it was granted or last renewed, so a dead
//! actor gives its room back; a live one renews by asking again for the
//! same group id. The table is plain data: the store keeps it beside the
//! ledger's `leased` count and decides what expiry means. It is not
//! logged: after a restart every lease is gone, and a leased group's push
//! is admitted as an unleased one.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::admission::Hold;

/// One outstanding lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The verified identity that took it (`None` on a server that
    /// verifies none): only it may renew, give back or fill the lease, so
    /// one actor cannot free or take over the room another is generating
    /// into.
    pub holder: Option<String>,
    /// The learner version when it was granted: the actor generates with
    /// weights at least this new.
    pub version: u64,
    /// The learner incarnation that version belongs to (0: none reported).
    pub incarnation: u64,
    /// When it runs out unless its group arrives or it is renewed.
    pub expires: Instant,
}

impl Lease {
    /// Time left at `now` (zero once due).
    pub fn remaining(&self, now: Instant) -> Duration {
        self.expires.saturating_duration_since(now)
    }

    /// Whether `caller` may act on this lease: its holder, or anyone when
    /// it was taken unauthenticated.
    pub fn held_by(&self, caller: Option<&str>) -> bool {
        self.holder.is_none() || self.holder.as_deref() == caller
    }
}

/// What a lease request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAnswer {
    /// Room is reserved until `expires_in` from now.
    Granted(Grant),
    /// No room within the wait: ask again. Nothing is reserved.
    NotGranted {
        /// The current learner version and incarnation.
        version: u64,
        incarnation: u64,
        held_by: Hold,
    },
}

/// A granted (or renewed) lease, as its holder sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The learner version and incarnation when it was first granted.
    pub version: u64,
    pub incarnation: u64,
    pub expires_in: Duration,
    /// An existing lease was extended.
    pub renewed: bool,
}

impl Grant {
    pub fn of(lease: &Lease, now: Instant, renewed: bool) -> Self {
        Self {
            version: lease.version,
            incarnation: lease.incarnation,
            expires_in: lease.remaining(now),
            renewed,
        }
    }
}

/// Outstanding leases by group id. Bounded by the admission rules: a new
/// entry needs room, a renewal adds none, so a linear expiry scan costs
/// at most the admission limit.
#[derive(Debug)]
pub struct LeaseTable {
    ttl: Duration,
    leases: HashMap<String, Lease>,
}

impl LeaseTable {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            leases: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Extends the lease on `group_id`, if there is one, to `ttl` from
    /// `now`. It keeps the version it was granted at: that is what its
    /// group was admitted under.
    pub fn renew(&mut self, group_id: &str, now: Instant) -> Option<Lease> {
        let l = self.leases.get_mut(group_id)?;
        l.expires = now + self.ttl;
        Some(l.clone())
    }

    /// The lease on `group_id`, if any.
    pub fn get(&self, group_id: &str) -> Option<&Lease> {
        self.leases.get(group_id)
    }

    /// Records a new lease for `holder`, granted at `now` under `version`.
    pub fn grant(
        &mut self,
        group_id: &str,
        holder: Option<&str>,
        (version, incarnation): (u64, u64),
        now: Instant,
    ) -> Lease {
        let lease = Lease {
            holder: holder.map(str::to_string),
            version,
            incarnation,
            expires: now + self.ttl,
        };
        self.leases.insert(group_id.to_string(), lease.clone());
        lease
    }

    /// Removes the lease on `group_id` (its group arrived).
    pub fn take(&mut self, group_id: &str) -> Option<Lease> {
        self.leases.remove(group_id)
    }

    /// Removes the leases due at `now` and returns their group ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let due: Vec<String> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &due {
            self.leases.remove(id);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn a_lease_expires_ttl_after_its_grant() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(TTL);
        let l = t.grant("g", None, (3, 7), t0);
        assert_eq!((l.version, l.incarnation), (3, 7));
        assert_eq!(l.remaining(t0), TTL);
        assert!(t.expire(t0 + TTL - Duration::from_millis(1)).is_empty());
        assert_eq!(t.expire(t0 + TTL), vec!["g".to_string()]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_renewal_extends_and_keeps_the_granted_version() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(TTL);
        t.grant("g", None, (3, 0), t0);
        let later = t0 + Duration::from_secs(8);
        let l = t.renew("g", later).unwrap();
        assert_eq!(l.version, 3);
        assert_eq!(l.expires, later + TTL);
        assert!(
            t.expire(t0 + TTL).is_empty(),
            "renewed past its first expiry"
        );
        assert!(t.renew("other", later).is_none(), "nothing to renew");
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn only_its_holder_acts_on_an_authenticated_lease() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(TTL);
        let mine = t.grant("g", Some("actor/a-1"), (0, 0), t0);
        assert!(mine.held_by(Some("actor/a-1")));
        assert!(!mine.held_by(Some("actor/a-2")));
        assert!(!mine.held_by(None), "an unauthenticated caller is nobody");
        let open = t.grant("h", None, (0, 0), t0);
        assert!(open.held_by(None) && open.held_by(Some("actor/a-2")));
        assert_eq!(t.get("g"), Some(&mine));
    }

    #[test]
    fn a_taken_lease_does_not_expire() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(TTL);
        t.grant("g", None, (0, 0), t0);
        t.grant("h", None, (0, 0), t0);
        assert_eq!(t.take("g").map(|l| l.version), Some(0));
        assert_eq!(t.take("g"), None);
        assert_eq!(t.expire(t0 + TTL), vec!["h".to_string()]);
    }
}
