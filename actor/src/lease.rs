//! Leases, the actor's side: before generating a group, ask the buffer for
//! room for it (a lease on its group id), wait until the weights are at
//! least as new as the learner version the lease was granted under, and
//! keep the lease alive while the group is generated and scored.
//!
//! Checked only when a finished group is pushed, the staleness bound makes
//! an actor generate first and wait at the buffer's door after, while the
//! learner moves on: the group is stale when it gets in and is thrown away
//! (docs/buffer.md, "Leases"). With a lease the waiting comes first.
//!
//! A buffer that does not serve leases (an older one) is used as before,
//! push-time admission only, after one warning.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use bapo_proto::{
    tls::AuthChannel,
    v1::{LeaseReply, LeaseRequest, rollout_sink_client::RolloutSinkClient},
};
use metrics::{counter, histogram};
use tokio::{sync::watch, task::JoinHandle};
use tonic::{Code, Status};

use crate::{
    backoff::Backoff,
    metrics as names,
    stop::StopFlag,
    subscription::{PolicyCell, Versioned},
};

/// The longest a lease call may take: the buffer answers "not granted"
/// within it (it holds a request at most its `lease_wait_ms`, and never
/// beyond the caller's deadline).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A release is one map removal at the buffer.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a slot needs to lease its groups; shared by the slots of an actor.
pub struct Leasing {
    client: RolloutSinkClient<AuthChannel>,
    /// Set once the buffer turned out not to serve leases: every slot
    /// then pushes unleased, and the warning is logged once.
    unsupported: AtomicBool,
    weight_wait: Duration,
}

/// A lease as the buffer granted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub version: u64,
    pub incarnation: u64,
    pub ttl: Duration,
}

impl Grant {
    fn of(r: &LeaseReply) -> Self {
        Self {
            version: r.learner_version,
            incarnation: r.learner_incarnation,
            ttl: Duration::from_millis(r.expires_in_ms),
        }
    }
}

/// A lease held while its group is made; renewed in the background at
/// half its TTL until dropped (drop it before pushing: the group's first
/// rollout turns the lease into the group), or given back when the group
/// is dropped ([`Held::give_back`]).
pub struct Held {
    pub grant: Grant,
    renewal: JoinHandle<()>,
    /// Boxed: a client is large and most slots hold no lease.
    client: Box<RolloutSinkClient<AuthChannel>>,
    group_id: String,
}

impl Held {
    /// The group will not come (generation, scoring or an environment
    /// failed): stop renewing and tell the buffer, so the room goes to a
    /// waiting lease now rather than after the TTL. Best effort, in the
    /// background on `handle`: if the call fails the lease still lapses.
    pub fn give_back(self, handle: &tokio::runtime::Handle) {
        self.renewal.abort();
        let (mut client, group_id) = (*self.client.clone(), self.group_id.clone());
        handle.spawn(async move {
            let mut req = tonic::Request::new(LeaseRequest {
                group_id: group_id.clone(),
            });
            req.set_timeout(RELEASE_TIMEOUT);
            match client.release_lease(req).await {
                Ok(r) if r.get_ref().released => {
                    counter!(names::LEASES_RELEASED).increment(1);
                }
                Ok(_) => {}
                // An older buffer: the lease lapses at its TTL, as before.
                Err(s) if s.code() == Code::Unimplemented => {}
                Err(s) => {
                    tracing::debug!(group = %group_id, "lease release failed ({}: {}); it lapses at its TTL", s.code(), s.message());
                }
            }
        });
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

/// May the slot generate its group, and under which lease.
pub enum Admitted {
    Leased(Held),
    /// Leases are off or the buffer does not serve them: the push is
    /// admitted (or held) at the buffer's door, as before leases.
    Unleased,
    /// The actor is stopping; generate nothing.
    Stopped,
}

/// What stops a slot's waiting: the abort signal, or the actor stopping
/// (no new groups after SIGTERM).
pub struct Stop<'a> {
    pub abort: watch::Receiver<bool>,
    pub stopping: &'a StopFlag,
}

impl Stop<'_> {
    async fn wait(&mut self) {
        tokio::select! {
            _ = self.abort.wait_for(|a| *a) => {}
            () = self.stopping.wait() => {}
        }
    }
}

impl Leasing {
    pub fn new(client: RolloutSinkClient<AuthChannel>, weight_wait: Duration) -> Arc<Self> {
        Arc::new(Self {
            client,
            unsupported: AtomicBool::new(false),
            weight_wait,
        })
    }

    /// Leases `group_id` (asking until granted), waits for weights at
    /// least as new as the grant's version, and starts renewing.
    pub async fn admit(&self, group_id: &str, cell: &PolicyCell, stop: &mut Stop<'_>) -> Admitted {
        let grant = match self.acquire(group_id, stop).await {
            Acquired::Granted(g) => g,
            Acquired::Unsupported => return Admitted::Unleased,
            Acquired::Stopped => return Admitted::Stopped,
        };
        if !self.wait_for_weights(cell, grant, stop).await {
            return Admitted::Stopped;
        }
        let renewal = tokio::spawn(renew(self.client.clone(), group_id.to_string(), grant.ttl));
        Admitted::Leased(Held {
            grant,
            renewal,
            client: Box::new(self.client.clone()),
            group_id: group_id.to_string(),
        })
    }

    /// Asks for the lease until the buffer grants it, retrying with
    /// backoff after errors and at once (with jitter) after a "not
    /// granted": the buffer already held the request for its wait.
    pub async fn acquire(&self, group_id: &str, stop: &mut Stop<'_>) -> Acquired {
        if self.unsupported.load(Relaxed) {
            return Acquired::Unsupported;
        }
        let started = Instant::now();
        let mut errors = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut refusals = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        loop {
            let reply = tokio::select! {
                r = ask(self.client.clone(), group_id, CALL_TIMEOUT) => r,
                () = stop.wait() => return Acquired::Stopped,
            };
            let delay = match reply {
                Ok(r) if r.granted => {
                    histogram!(names::LEASE_WAIT_SECONDS).record(started.elapsed().as_secs_f64());
                    return Acquired::Granted(Grant::of(&r));
                }
                Ok(r) => {
                    tracing::debug!(group = %group_id, held_by = %r.held_by, "lease not granted yet; asking again");
                    refusals.next_delay()
                }
                Err(s) if buffer_lacks_leases(&s) => {
                    if !self.unsupported.swap(true, Relaxed) {
                        tracing::warn!(
                            "the buffer does not serve leases ({}: {}); groups are admitted when pushed, \
                             as with actor.lease = false",
                            s.code(),
                            s.message()
                        );
                    }
                    return Acquired::Unsupported;
                }
                Err(s) => {
                    counter!(names::RECONNECTS, "peer" => "buffer").increment(1);
                    let d = errors.next_delay();
                    tracing::warn!(group = %group_id, "lease failed ({}: {}); retrying in {d:?}", s.code(), s.message());
                    d
                }
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = stop.wait() => return Acquired::Stopped,
            }
        }
    }

    /// Waits until `cell` holds weights the lease may be generated with,
    /// at most the configured time (then logs and goes on with what it
    /// has); false when stopped meanwhile.
    async fn wait_for_weights(&self, cell: &PolicyCell, grant: Grant, stop: &mut Stop<'_>) -> bool {
        let started = Instant::now();
        let mut cell = cell.clone();
        let held_at_start = cell.borrow().as_ref().map_or(0, |w| w.incarnation);
        let ready = |c: &Option<Arc<Versioned>>| {
            c.as_ref()
                .is_some_and(|w| weights_reached((w.version, w.incarnation), grant, held_at_start))
        };
        let reached = tokio::select! {
            r = tokio::time::timeout(self.weight_wait, cell.wait_for(ready)) => matches!(r, Ok(Ok(_))),
            () = stop.wait() => return false,
        };
        histogram!(names::LEASE_WEIGHT_WAIT_SECONDS).record(started.elapsed().as_secs_f64());
        if !reached {
            counter!(names::LEASE_WEIGHT_TIMEOUTS).increment(1);
            let have = cell.borrow().as_ref().map(|w| w.version);
            tracing::warn!(
                lease_version = grant.version,
                have = ?have,
                "no weights at the lease's learner version within {:?} (learner down?); \
                 generating with older ones",
                self.weight_wait
            );
        }
        true
    }
}

/// What asking for a lease came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    Granted(Grant),
    /// The buffer does not serve leases.
    Unsupported,
    Stopped,
}

/// Whether weights `(version, incarnation)` may generate a group leased
/// under `grant`: at least the grant's version, within its incarnation.
/// Weights of another incarnation that arrived during the wait (not the
/// one held at its start) come from a learner that restarted since the
/// grant: their versions are not comparable with it, and they are the
/// newest there are.
pub fn weights_reached(have: (u64, u64), grant: Grant, held_at_start: u64) -> bool {
    let (version, incarnation) = have;
    if grant.incarnation == 0 || incarnation == grant.incarnation {
        return version >= grant.version;
    }
    incarnation != held_at_start
}

/// Whether `s` says the buffer has no `Lease` method: UNIMPLEMENTED, or
/// (over mutual TLS or tokens) an older buffer's authorization refusing a
/// method it does not know.
pub fn buffer_lacks_leases(s: &Status) -> bool {
    match s.code() {
        Code::Unimplemented => true,
        Code::PermissionDenied => s.message().contains("no role may"),
        _ => false,
    }
}

async fn ask(
    mut client: RolloutSinkClient<AuthChannel>,
    group_id: &str,
    timeout: Duration,
) -> Result<LeaseReply, Status> {
    let mut req = tonic::Request::new(LeaseRequest {
        group_id: group_id.to_string(),
    });
    req.set_timeout(timeout);
    Ok(client.lease(req).await?.into_inner())
}

/// Renews the lease on `group_id` at half its TTL until aborted. A lapsed
/// lease (the buffer restarted, or renewals failed for a whole TTL) is
/// asked for again the same way: if there is room, the group has its
/// place back.
async fn renew(client: RolloutSinkClient<AuthChannel>, group_id: String, ttl: Duration) {
    let mut period = half(ttl);
    loop {
        tokio::time::sleep(period).await;
        match ask(client.clone(), &group_id, period).await {
            Ok(r) if r.granted => period = half(Duration::from_millis(r.expires_in_ms)),
            Ok(r) => {
                tracing::debug!(group = %group_id, held_by = %r.held_by, "lease lapsed and not granted again");
            }
            // The group is in the buffer already, or its id is leased by
            // another actor: nothing of ours left to hold.
            Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::PermissionDenied) => {
                return;
            }
            Err(s) => {
                tracing::warn!(group = %group_id, "lease renewal failed ({}: {})", s.code(), s.message());
            }
        }
    }
}

/// Half a TTL, at least 10 ms: renewing that often cannot busy-loop.
fn half(ttl: Duration) -> Duration {
    (ttl / 2).max(Duration::from_millis(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_missing_method_turns_leases_off() {
        assert!(buffer_lacks_leases(&Status::unimplemented("")));
        assert!(buffer_lacks_leases(&Status::permission_denied(
            "role actor (spiffe://t/actor/a) may not call /bapo.v1.RolloutSink/Lease: no role may"
        )));
        // A blocked actor, or a buffer going away, is not an old buffer.
        assert!(!buffer_lacks_leases(&Status::permission_denied(
            "spiffe://t/actor/a (role actor) is blocked on this server"
        )));
        assert!(!buffer_lacks_leases(&Status::unavailable("closing")));
    }

    #[test]
    fn weights_must_reach_the_leased_version_of_its_incarnation() {
        let grant = Grant {
            version: 5,
            incarnation: 7,
            ttl: Duration::from_secs(1),
        };
        assert!(!weights_reached((4, 7), grant, 7));
        assert!(weights_reached((5, 7), grant, 7));
        assert!(weights_reached((6, 7), grant, 7));
        // Still the older incarnation held before the grant: wait.
        assert!(!weights_reached((9, 3), grant, 3));
        // A learner restarted after the grant (incarnation 8, lower
        // versions): its weights are the newest, go.
        assert!(weights_reached((2, 8), grant, 7));
        // A learner without incarnations: versions only.
        let plain = Grant {
            incarnation: 0,
            ..grant
        };
        assert!(!weights_reached((4, 0), plain, 0));
        assert!(weights_reached((5, 0), plain, 0));
    }

    #[test]
    fn renewals_come_at_half_the_ttl() {
        assert_eq!(half(Duration::from_secs(120)), Duration::from_secs(60));
        assert_eq!(half(Duration::ZERO), Duration::from_millis(10));
    }
}
