//! Unit tests of the core, without sockets.

use std::time::{Duration, Instant};

use super::*;
use crate::{
    config::{FsyncPolicy, SamplingMode},
    rollout::{FinishReason, VersionRuns},
};
use bapo_proto::packed::{pack_f32, pack_u32};

fn rollout(group: &str, id: &str, versions: &[u64]) -> Rollout {
    Rollout {
        id: id.into(),
        group_id: group.into(),
        prompt_tokens: pack_u32(&[1, 2, 3]),
        response_tokens: pack_u32(&vec![7; versions.len()]),
        behavior_logprobs: pack_f32(&vec![-0.5; versions.len()]),
        versions: VersionRuns::from_tokens(versions),
        reward: 1.0,
        token_rewards: Default::default(),
        finish_reason: FinishReason::Stop,
        actor_id: "a0".into(),
        task: "arith".into(),
        metadata: Default::default(),
    }
}

fn cfg(group_size: u32, batch_groups: u32, max_staleness: u64) -> BufferConfig {
    BufferConfig {
        group_size,
        min_group_size: 1,
        batch_groups,
        max_staleness,
        ..Default::default()
    }
}

async fn push_group(b: &Buffer, group: &str, k: usize, version: u64) {
    for i in 0..k {
        let out = b
            .push(rollout(group, &format!("{group}-{i}"), &[version; 4]), 100)
            .await
            .unwrap();
        assert_eq!(out, PushOutcome::Accepted, "{group}-{i}");
    }
}

const NOW: Duration = Duration::ZERO;

#[tokio::test]
async fn group_is_sampleable_only_when_complete() {
    let b = Buffer::open(cfg(3, 1, 4)).unwrap();
    push_group(&b, "g", 2, 0).await;
    assert!(matches!(
        b.sample(1, NOW, false).await,
        Err(BufferError::NotEnough {
            ready: 0,
            wanted: 1
        })
    ));
    b.push(rollout("g", "g-2", &[0; 4]), 100).await.unwrap();
    let batch = b.sample(1, NOW, false).await.unwrap();
    assert_eq!(batch.len(), 1);
    assert_eq!(batch[0].group.members.len(), 3);
    assert_eq!(batch[0].group.members[2].id, "g-2");
    // FIFO consumes once.
    assert!(b.sample(1, NOW, false).await.is_err());
    let s = b.stats();
    assert_eq!(
        (s.groups_pending, s.groups_ready, s.groups_retired),
        (0, 0, 1)
    );
    assert_eq!(s.bytes_held, 0);
}

#[tokio::test]
async fn fifo_hands_out_in_completion_order() {
    let b = Buffer::open(cfg(2, 4, 4)).unwrap();
    b.push(rollout("a", "a0", &[0]), 10).await.unwrap();
    push_group(&b, "b", 2, 0).await;
    b.push(rollout("a", "a1", &[0]), 10).await.unwrap();
    let ids: Vec<_> = b
        .sample(2, NOW, false)
        .await
        .unwrap()
        .iter()
        .map(|g| (g.group.id.clone(), g.group.sequence))
        .collect();
    assert_eq!(ids, vec![("b".to_string(), 0), ("a".to_string(), 1)]);
}

#[tokio::test]
async fn duplicates_are_acknowledged_once_and_late_members_refused() {
    let b = Buffer::open(cfg(2, 4, 4)).unwrap();
    assert_eq!(
        b.push(rollout("g", "r0", &[0]), 10).await.unwrap(),
        PushOutcome::Accepted
    );
    assert_eq!(
        b.push(rollout("g", "r0", &[0]), 10).await.unwrap(),
        PushOutcome::Duplicate
    );
    assert_eq!(
        b.push(rollout("g", "r1", &[0]), 10).await.unwrap(),
        PushOutcome::Accepted
    );
    // Sealed now: a re-send is a duplicate, a third member is refused.
    assert_eq!(
        b.push(rollout("g", "r1", &[0]), 10).await.unwrap(),
        PushOutcome::Duplicate
    );
    match b.push(rollout("g", "r2", &[0]), 10).await.unwrap() {
        PushOutcome::Rejected(r) => {
            assert_eq!(r.label, "group_sealed");
            assert!(r.reason.contains("\"r2\""), "{}", r.reason);
        }
        other => panic!("{other:?}"),
    }
    let s = b.stats();
    assert_eq!(
        (
            s.rollouts_accepted,
            s.rollouts_duplicate,
            s.rollouts_rejected
        ),
        (2, 2, 1)
    );
    assert_eq!(s.rejections, HashMap::from([("group_sealed", 1)]));
    assert_eq!(
        b.sample(1, NOW, false).await.unwrap()[0]
            .group
            .members
            .len(),
        2
    );
}

#[tokio::test]
async fn timed_out_groups_are_released_or_evicted() {
    let mut c = cfg(4, 4, 4);
    c.min_group_size = 2;
    c.group_timeout_ms = 50;
    let b = Buffer::open(c).unwrap();
    push_group(&b, "two", 2, 0).await;
    push_group(&b, "one", 1, 0).await;
    b.sweep(Instant::now());
    assert_eq!(b.stats().groups_pending, 2, "not yet timed out");
    b.sweep(Instant::now() + Duration::from_millis(60));
    let s = b.stats();
    assert_eq!((s.groups_pending, s.groups_ready), (0, 1));
    assert_eq!(s.evictions["incomplete"], 1);
    let batch = b.sample(1, NOW, false).await.unwrap();
    assert_eq!(batch[0].group.id, "two");
    assert_eq!(batch[0].group.members.len(), 2);
}

#[tokio::test]
async fn synchronous_admission_holds_the_second_batch_until_the_version_moves() {
    // max_staleness 0, batches of 2 groups of 1.
    let b = Buffer::open(cfg(1, 2, 0)).unwrap();
    push_group(&b, "g0", 1, 0).await;
    push_group(&b, "g1", 1, 0).await;
    let held = {
        let b = b.clone();
        tokio::spawn(async move { b.push(rollout("g2", "g2-0", &[0]), 10).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!held.is_finished(), "third group must wait for the learner");
    assert_eq!(b.sample(2, NOW, false).await.unwrap().len(), 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        !held.is_finished(),
        "consumed groups still count until the version moves"
    );
    b.report_version(1);
    let out = tokio::time::timeout(Duration::from_secs(1), held)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match out {
        PushOutcome::Accepted => {}
        other => panic!("admitted after the version moved, got {other:?}"),
    }
    // It was generated at version 0 while the learner moved to 1: with
    // max_staleness 0 it is evicted before the learner can see it.
    assert!(b.sample(1, NOW, false).await.is_err());
    assert_eq!(b.stats().evictions["stale"], 1);
}

#[tokio::test]
async fn stale_groups_are_evicted_and_stale_rollouts_refused() {
    let b = Buffer::open(cfg(2, 8, 2)).unwrap();
    b.report_version(5);
    push_group(&b, "ready", 2, 3).await;
    push_group(&b, "pending", 1, 4).await;
    match b.push(rollout("new", "n0", &[2, 5]), 10).await.unwrap() {
        PushOutcome::Rejected(r) => assert_eq!(r.label, "stale"),
        other => panic!("{other:?}"),
    }
    // Version 6: "ready" (oldest 3) is 3 behind > 2; "pending" (4) is fine.
    assert_eq!(b.report_version(6), 1);
    // Version 7 makes the pending one stale too: evicted by the sweep.
    assert_eq!(b.report_version(7), 0);
    assert_eq!(b.stats().groups_pending, 1);
    b.sweep(Instant::now());
    let s = b.stats();
    assert_eq!(s.evictions["stale"], 2);
    assert_eq!((s.groups_pending, s.groups_ready, s.bytes_held), (0, 0, 0));
    // Its late member is refused: the group is gone for good.
    match b.push(rollout("pending", "p9", &[7]), 10).await.unwrap() {
        PushOutcome::Rejected(r) => assert_eq!(r.label, "group_sealed"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn sampled_staleness_is_version_minus_oldest_token() {
    let b = Buffer::open(cfg(2, 8, 8)).unwrap();
    b.report_version(3);
    b.push(rollout("g", "a", &[3, 3]), 10).await.unwrap();
    b.push(rollout("g", "b", &[1, 2, 3]), 10).await.unwrap();
    b.report_version(4);
    let batch = b.sample(1, NOW, false).await.unwrap();
    assert_eq!(batch[0].staleness, 3);
}

#[tokio::test]
async fn replay_reuses_each_group_at_most_max_reuse_times() {
    let mut c = cfg(1, 2, 100);
    c.sampling = SamplingMode::Uniform;
    c.max_reuse = 3;
    c.samples_per_insert = 3.0;
    c.rate_limit_error_buffer = 1000.0;
    let b = Buffer::open(c).unwrap();
    for g in 0..4 {
        push_group(&b, &format!("g{g}"), 1, 0).await;
    }
    let mut uses = std::collections::HashMap::new();
    while let Ok(batch) = b.sample(2, NOW, true).await {
        if batch.is_empty() {
            break;
        }
        for s in batch {
            let n = uses.entry(s.group.id.clone()).or_insert(0u32);
            *n += 1;
            assert_eq!(s.use_count, *n);
        }
    }
    assert_eq!(uses.len(), 4);
    assert!(uses.values().all(|&n| n == 3), "{uses:?}");
    let s = b.stats();
    assert_eq!(
        (s.groups_ready, s.groups_retired, s.group_samples),
        (0, 4, 12)
    );
}

#[tokio::test]
async fn rate_limiter_stops_sampling_a_stale_buffer_and_holds_runaway_actors() {
    let mut c = cfg(1, 2, 1000);
    c.sampling = SamplingMode::Recency;
    c.max_reuse = 100;
    c.samples_per_insert = 2.0;
    c.rate_limit_error_buffer = 4.0;
    let b = Buffer::open(c).unwrap();
    // Inserts may run ahead by (4 + 2*2) / 2 = 4 groups.
    for g in 0..4 {
        push_group(&b, &format!("g{g}"), 1, 0).await;
    }
    let held = {
        let b = b.clone();
        tokio::spawn(async move { b.push(rollout("g4", "x", &[0]), 10).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!held.is_finished(), "actors may not run arbitrarily ahead");
    // 4 inserts allow 4*2 + 4 - 4 = 8 draws (two less than max_reuse allows).
    let mut drawn = 0;
    while let Ok(batch) = b.sample(2, NOW, false).await {
        drawn += batch.len();
    }
    assert_eq!(drawn, 8);
    tokio::time::timeout(Duration::from_secs(1), held)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn full_buffer_blocks_or_drops_oldest() {
    let mut c = cfg(1, 100, 100);
    c.capacity_groups = 2;
    let b = Buffer::open(c.clone()).unwrap();
    push_group(&b, "g0", 1, 0).await;
    push_group(&b, "g1", 1, 0).await;
    let held = {
        let b = b.clone();
        tokio::spawn(async move { b.push(rollout("g2", "x", &[0]), 10).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!held.is_finished(), "a full buffer holds the pusher");
    assert_eq!(b.sample(1, NOW, false).await.unwrap()[0].group.id, "g0");
    tokio::time::timeout(Duration::from_secs(1), held)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(b.stats().evictions["capacity"], 0);

    c.when_full = FullPolicy::DropOldest;
    let b = Buffer::open(c).unwrap();
    for g in 0..3 {
        push_group(&b, &format!("g{g}"), 1, 0).await;
    }
    assert_eq!(b.stats().evictions["capacity"], 1);
    let ids: Vec<_> = b
        .sample(2, NOW, false)
        .await
        .unwrap()
        .iter()
        .map(|g| g.group.id.clone())
        .collect();
    assert_eq!(ids, vec!["g1", "g2"]);
}

#[tokio::test]
async fn sample_waits_for_groups_and_can_take_a_partial_batch() {
    let b = Buffer::open(cfg(1, 4, 4)).unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.sample(2, Duration::from_secs(5), false).await })
    };
    push_group(&b, "g0", 1, 0).await;
    push_group(&b, "g1", 1, 0).await;
    let got = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got.len(), 2);
    push_group(&b, "g2", 1, 0).await;
    let got = b.sample(3, Duration::from_millis(10), true).await.unwrap();
    assert_eq!(got.len(), 1);
    assert!(matches!(
        b.sample(0, NOW, true).await,
        Err(BufferError::InvalidRequest(_))
    ));
}

#[tokio::test]
async fn log_restores_unconsumed_groups_and_not_consumed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(2, 8, 8);
    c.data_dir = Some(dir.path().to_path_buf());
    c.fsync = FsyncPolicy::Always;
    {
        let b = Buffer::open(c.clone()).unwrap();
        b.report_version(2);
        push_group(&b, "consumed", 2, 2).await;
        push_group(&b, "ready", 2, 2).await;
        push_group(&b, "pending", 1, 2).await;
        assert_eq!(
            b.sample(1, NOW, false).await.unwrap()[0].group.id,
            "consumed"
        );
        b.sync().await.unwrap();
        // Dropped without close(): as if killed.
    }
    let b = Buffer::open(c.clone()).unwrap();
    let s = b.stats();
    assert_eq!(s.learner_version, 2);
    assert_eq!(
        (s.groups_ready, s.groups_pending, s.groups_retired),
        (1, 1, 1)
    );
    // A re-sent member of the consumed group is a duplicate, not a new group.
    assert_eq!(
        b.push(rollout("consumed", "consumed-0", &[2]), 10)
            .await
            .unwrap(),
        PushOutcome::Duplicate
    );
    b.push(rollout("pending", "pending-1", &[2]), 10)
        .await
        .unwrap();
    let ids: Vec<_> = b
        .sample(2, NOW, false)
        .await
        .unwrap()
        .iter()
        .map(|g| (g.group.id.clone(), g.group.sequence))
        .collect();
    assert_eq!(
        ids,
        vec![("ready".to_string(), 1), ("pending".to_string(), 2)]
    );
    b.close().await.unwrap();

    // And once more after a clean close (and the compaction at open).
    let b = Buffer::open(c).unwrap();
    let s = b.stats();
    assert_eq!(
        (s.groups_ready, s.groups_pending, s.groups_retired),
        (0, 0, 3)
    );
    assert_eq!(
        b.push(rollout("ready", "ready-1", &[2]), 10).await.unwrap(),
        PushOutcome::Duplicate
    );
}
