//! Unit tests of leases in the core, without sockets: each rule of
//! docs/buffer.md's "Leases" once.

use std::time::{Duration, Instant};

use super::tests::{cfg, push_group, rollout};
use super::*;
use crate::lease::{Grant, LeaseAnswer};

const NO_WAIT: Duration = Duration::ZERO;
/// Long enough that nothing expires unless a test sweeps past it.
const TTL_MS: u64 = 60_000;

/// Synchronous (max_staleness 0) batches of `batch_groups` groups of 2.
fn sync_cfg(batch_groups: u32) -> BufferConfig {
    BufferConfig {
        lease_ttl_ms: TTL_MS,
        ..cfg(2, batch_groups, 0)
    }
}

async fn grant(b: &Buffer, id: &str) -> Grant {
    match b.lease(id, None, NO_WAIT).await.unwrap() {
        LeaseAnswer::Granted(g) => g,
        other => panic!("lease {id}: {other:?}"),
    }
}

async fn not_granted(b: &Buffer, id: &str, wait: Duration) -> Hold {
    match b.lease(id, None, wait).await.unwrap() {
        LeaseAnswer::NotGranted { held_by, .. } => held_by,
        other => panic!("lease {id} was granted: {other:?}"),
    }
}

/// Whether pushing the first member of `group` completes within `limit`
/// (false: admission holds it).
async fn push_gets_in(b: &Buffer, group: &str, limit: Duration) -> bool {
    let push = b.push(rollout(group, &format!("{group}-0"), &[0; 4]), 100);
    match tokio::time::timeout(limit, push).await {
        Ok(out) => {
            assert_eq!(out.unwrap(), PushOutcome::Accepted, "{group}");
            true
        }
        Err(_) => false,
    }
}

/// A lease request for `id` held for want of room (checked still held
/// after 50 ms).
async fn waiting_lease(
    b: &Buffer,
    id: &'static str,
) -> tokio::task::JoinHandle<Result<LeaseAnswer, BufferError>> {
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.lease(id, None, Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "{id} got room it should wait for");
    waiter
}

/// The answer of a held request once room frees, within 5 s.
async fn woken(waiter: tokio::task::JoinHandle<Result<LeaseAnswer, BufferError>>) -> LeaseAnswer {
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiting lease request is woken")
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn outstanding_leases_count_against_the_bound() {
    let b = Buffer::open(sync_cfg(2)).unwrap();
    let g = grant(&b, "a").await;
    assert_eq!((g.version, g.renewed), (0, false));
    assert_eq!(g.expires_in, Duration::from_millis(TTL_MS));
    grant(&b, "b").await;
    // One batch per version: two leases fill it.
    let held = not_granted(&b, "c", Duration::from_millis(50)).await;
    assert_eq!(held, Hold::Staleness);
    let s = b.stats();
    assert_eq!((s.leases_outstanding, s.admitted_groups), (2, 2));
    // An unleased group is held by the leases too (the old rule, with
    // leases counted).
    assert!(!push_gets_in(&b, "x", Duration::from_millis(100)).await);
}

#[tokio::test]
async fn a_held_lease_request_is_granted_when_room_frees() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    let waiter = waiting_lease(&b, "b").await;
    // Group a arrives and is trained on; the learner moves to version 1.
    tokio::time::timeout(Duration::from_secs(5), push_group(&b, "a", 2, 0))
        .await
        .expect("a leased group gets in");
    assert_eq!(b.sample(1, NO_WAIT, false).await.unwrap().len(), 1);
    b.report_version(1);
    let answer = woken(waiter).await;
    match answer {
        LeaseAnswer::Granted(g) => assert_eq!(g.version, 1, "granted under version 1"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_lease_expires_and_frees_room() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.lease("b", None, Duration::from_secs(30)).await })
    };
    // Not yet due: nothing changes.
    b.sweep(Instant::now());
    assert_eq!(b.stats().leases_expired, 0);
    assert!(!waiter.is_finished());
    // Past the TTL, its actor never having pushed: the room goes to b.
    b.sweep(Instant::now() + Duration::from_millis(TTL_MS + 1));
    let answer = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the expiry wakes the waiting request")
        .unwrap()
        .unwrap();
    assert!(matches!(answer, LeaseAnswer::Granted(_)), "{answer:?}");
    let s = b.stats();
    assert_eq!(
        (s.leases_expired, s.leases_outstanding, s.leases_granted),
        (1, 1, 2)
    );
}

#[tokio::test]
async fn a_leased_push_is_admitted_without_a_second_check() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    // The bound is full (the lease is its one group), yet a's push gets in:
    // it was admitted when its lease was granted.
    assert!(push_gets_in(&b, "a", Duration::from_secs(5)).await);
    b.push(rollout("a", "a-1", &[0; 4]), 100).await.unwrap();
    let s = b.stats();
    assert_eq!((s.leases_used, s.leases_outstanding), (1, 0));
    assert_eq!(
        (s.groups_ready, s.admitted_groups, s.groups_admitted),
        (1, 1, 1)
    );
    // The lease is gone, so the group is counted once: nothing else fits.
    assert!(!push_gets_in(&b, "b", Duration::from_millis(100)).await);
    // A lease on a group already in the buffer is refused by name.
    match b.lease("a", None, NO_WAIT).await {
        Err(BufferError::AlreadyPushed(m)) => assert!(m.contains("\"a\""), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn renewing_extends_the_lease_and_keeps_its_version() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    let granted_by = Instant::now();
    b.report_version(1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let renewed_from = Instant::now();
    // The bound is full, but a renewal takes no new room: never held.
    let g = grant(&b, "a").await;
    assert!(g.renewed);
    assert_eq!(g.version, 0, "the version it was granted under");
    let ttl = Duration::from_millis(TTL_MS);
    // Past the first expiry (granted before `granted_by`), before the
    // renewed one (renewed after `renewed_from`).
    assert!(renewed_from > granted_by);
    b.sweep(renewed_from + ttl - Duration::from_millis(1));
    let s = b.stats();
    assert_eq!((s.leases_expired, s.leases_outstanding), (0, 1));
    b.sweep(Instant::now() + ttl);
    assert_eq!(b.stats().leases_expired, 1);
    assert_eq!(b.stats().leases_granted, 1, "a renewal is not a new lease");
}

#[tokio::test]
async fn an_unleased_push_follows_the_push_time_rule() {
    // An old actor that never asks for leases.
    let b = Buffer::open(sync_cfg(1)).unwrap();
    assert!(push_gets_in(&b, "a", Duration::from_secs(5)).await);
    assert!(!push_gets_in(&b, "b", Duration::from_millis(100)).await);
    let s = b.stats();
    assert_eq!(
        (s.leases_granted, s.leases_used, s.admitted_groups),
        (0, 0, 1)
    );
}

#[tokio::test]
async fn a_stale_leased_group_gives_its_lease_back() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    b.report_version(1);
    grant(&b, "x").await;
    assert_eq!(not_granted(&b, "b", NO_WAIT).await, Hold::Staleness);
    // Generated with version-0 weights after all: refused, and its room
    // is not held until the lease would expire.
    match b.push(rollout("a", "a-0", &[0; 4]), 100).await.unwrap() {
        PushOutcome::Rejected(r) => assert_eq!(r.label, "stale"),
        other => panic!("{other:?}"),
    }
    assert_eq!(b.stats().leases_outstanding, 1, "x's only");
    grant(&b, "b").await;
}

#[tokio::test]
async fn bad_ids_are_refused_and_closing_releases_waiters() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    for bad in [String::new(), "g".repeat(validate::MAX_ID_BYTES + 1)] {
        match b.lease(&bad, None, NO_WAIT).await {
            Err(BufferError::InvalidRequest(m)) => assert!(m.contains("group_id"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    grant(&b, "a").await;
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.lease("b", None, Duration::from_secs(30)).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.release_waiters();
    let out = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(out, Err(BufferError::Closing)), "{out:?}");
}

#[tokio::test]
async fn leases_are_not_logged_and_a_restart_forgets_them() {
    let dir = tempfile::tempdir().unwrap();
    let c = BufferConfig {
        data_dir: Some(dir.path().to_path_buf()),
        fsync: crate::config::FsyncPolicy::Never,
        ..sync_cfg(1)
    };
    let b = Buffer::open(c.clone()).unwrap();
    grant(&b, "a").await;
    b.close().await.unwrap();
    drop(b);
    let b = Buffer::open(c).unwrap();
    let s = b.stats();
    assert_eq!((s.leases_outstanding, s.admitted_groups), (0, 0));
    // The leased group's push is admitted like an unleased one.
    assert!(push_gets_in(&b, "a", Duration::from_secs(5)).await);
    assert_eq!(b.stats().leases_used, 0);
}

#[tokio::test]
async fn a_released_lease_frees_its_room_at_once() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    grant(&b, "a").await;
    let waiter = waiting_lease(&b, "b").await;
    // a's actor dropped its group: the room goes to b long before the TTL.
    assert!(b.give_back_lease("a", None).unwrap());
    let answer = woken(waiter).await;
    assert!(matches!(answer, LeaseAnswer::Granted(_)), "{answer:?}");
    let s = b.stats();
    assert_eq!(
        (s.leases_released, s.leases_expired, s.leases_outstanding),
        (1, 0, 1)
    );
    assert_eq!(s.admitted_groups, 1, "a no longer counts against the bound");
    // Idempotent, and nothing for an id with no lease.
    assert!(!b.give_back_lease("a", None).unwrap());
    assert!(!b.give_back_lease("never", None).unwrap());
    assert!(b.give_back_lease("", None).is_err(), "a bad id is refused");
    // A group whose lease was used is not released by a late call.
    push_group(&b, "b", 2, 0).await;
    assert!(!b.give_back_lease("b", None).unwrap());
    assert_eq!(b.stats().leases_released, 1);
}

#[tokio::test]
async fn a_lease_is_its_holders_alone() {
    let b = Buffer::open(sync_cfg(2)).unwrap();
    let mine = Some("actor/a0");
    assert!(matches!(
        b.lease("g", mine, NO_WAIT).await.unwrap(),
        LeaseAnswer::Granted(_)
    ));
    // Another actor can neither renew it, nor free its room...
    let renew = b.lease("g", Some("actor/a1"), NO_WAIT).await;
    assert!(
        matches!(&renew, Err(BufferError::NotHolder(m)) if m.contains("\"actor/a0\"")),
        "{renew:?}"
    );
    let give_back = b.give_back_lease("g", Some("actor/a1"));
    assert!(
        matches!(give_back, Err(BufferError::NotHolder(_))),
        "{give_back:?}"
    );
    assert!(
        b.give_back_lease("g", None).is_err(),
        "nor an unauthenticated caller"
    );
    // ...nor push into it: its rollout is refused by name.
    let mut theirs = rollout("g", "g-x", &[0; 4]);
    theirs.actor_id = "actor/a1".into();
    let PushOutcome::Rejected(r) = b.push(theirs, 100).await.unwrap() else {
        panic!("a push into another's lease was accepted")
    };
    assert_eq!(r.label, "leased_by_other", "{r:?}");
    assert_eq!(b.stats().leases_outstanding, 1, "the lease is untouched");
    // The holder renews, fills it, and the lease is used.
    assert!(b.lease("g", mine, NO_WAIT).await.is_ok());
    let mut own = rollout("g", "g-0", &[0; 4]);
    own.actor_id = "actor/a0".into();
    assert_eq!(b.push(own, 100).await.unwrap(), PushOutcome::Accepted);
    let s = b.stats();
    assert_eq!((s.leases_used, s.leases_outstanding), (1, 0));
}

#[tokio::test]
async fn a_redeemed_lease_keeps_its_group_its_holders() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    assert!(matches!(
        b.lease("g", Some("actor/a0"), NO_WAIT).await.unwrap(),
        LeaseAnswer::Granted(_)
    ));
    let member = |id: &str, actor: &str| {
        let mut r = rollout("g", id, &[0; 4]);
        r.actor_id = actor.into();
        r
    };
    // The holder's first rollout redeems the lease...
    let first = b.push(member("g-0", "actor/a0"), 100).await.unwrap();
    assert_eq!(first, PushOutcome::Accepted);
    assert_eq!(b.stats().leases_outstanding, 0);
    // ...and the group stays its alone: another's member is refused.
    let PushOutcome::Rejected(r) = b.push(member("g-x", "actor/a1"), 100).await.unwrap() else {
        panic!("another identity filled a leased group")
    };
    assert_eq!(r.label, "leased_by_other", "{r:?}");
    assert!(r.reason.contains("\"actor/a0\""), "{}", r.reason);
    // The holder completes it, and it is ready with the holder's members.
    let last = b.push(member("g-1", "actor/a0"), 100).await.unwrap();
    assert_eq!(last, PushOutcome::Accepted);
    assert_eq!(b.stats().groups_ready, 1);
}

#[tokio::test]
async fn an_unleased_group_is_joined_by_anyone() {
    let b = Buffer::open(sync_cfg(1)).unwrap();
    for (id, actor) in [("g-0", "actor/a0"), ("g-1", "actor/a1")] {
        let mut r = rollout("g", id, &[0; 4]);
        r.actor_id = actor.into();
        assert_eq!(b.push(r, 100).await.unwrap(), PushOutcome::Accepted);
    }
    assert_eq!(b.stats().groups_ready, 1);
}
