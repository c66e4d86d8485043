//! Unit tests of the core, without sockets.

use std::time::{Duration, Instant};

use super::*;
use crate::{
    config::{FsyncPolicy, FullPolicy, SamplingMode},
    rollout::{FinishReason, VersionRuns},
};
use bapo_proto::packed::{pack_f32, pack_u32};

pub(super) fn rollout(group: &str, id: &str, versions: &[u64]) -> Rollout {
    Rollout {
        id: id.into(),
        group_id: group.into(),
        prompt_tokens: pack_u32(&[1, 2, 3]),
        response_tokens: pack_u32(&vec![7; versions.len()]),
        behavior_logprobs: pack_f32(&vec![-0.5; versions.len()]),
        versions: VersionRuns::from_tokens(versions),
        reward: 1.0,
        token_rewards: Default::default(),
        loss_mask: Default::default(),
        turn_ids: Default::default(),
        finish_reason: FinishReason::Stop,
        actor_id: "a0".into(),
        task: "arith".into(),
        metadata: Default::default(),
        learner_incarnation: 0,
        sampling: None,
    }
}

pub(super) fn cfg(group_size: u32, batch_groups: u32, max_staleness: u64) -> BufferConfig {
    BufferConfig {
        group_size,
        min_group_size: 1,
        batch_groups,
        max_staleness,
        ..Default::default()
    }
}

pub(super) async fn push_group(b: &Buffer, group: &str, k: usize, version: u64) {
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
        (s.groups_pending, s.groups_ready, s.groups_consumed),
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
        (s.groups_ready, s.groups_consumed, s.group_samples),
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
        (s.groups_ready, s.groups_pending, s.groups_consumed),
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
        (s.groups_ready, s.groups_pending, s.groups_consumed),
        (0, 0, 3)
    );
    assert_eq!(
        b.push(rollout("ready", "ready-1", &[2]), 10).await.unwrap(),
        PushOutcome::Duplicate
    );
}

fn durable_cfg(dir: &std::path::Path, group_size: u32) -> BufferConfig {
    let mut c = cfg(group_size, 8, 8);
    c.data_dir = Some(dir.to_path_buf());
    c.fsync = FsyncPolicy::Never;
    c
}

/// Sets a hook that, the first time a group is sealed, asks the log for a
/// compaction and lets its snapshot run (or block) right there.
fn compact_on_first_seal(b: &Buffer) {
    use std::sync::{Mutex as StdMutex, atomic::AtomicBool, mpsc};
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let snapshot = recovery::snapshot_source(Arc::downgrade(&b.inner));
    let wal = b.inner.wal.as_ref().expect("a durable buffer");
    wal.set_snapshot(Box::new(move || {
        let _ = entered_tx.send(());
        let out = snapshot();
        let _ = done_tx.send(());
        out
    }));
    let weak = Arc::downgrade(&b.inner);
    let fired = AtomicBool::new(false);
    let rx = StdMutex::new((entered_rx, done_rx));
    *b.inner.on_seal.lock() = Some(Box::new(move || {
        if fired.swap(true, Relaxed) {
            return;
        }
        let Some(inner) = weak.upgrade() else { return };
        inner.wal.as_ref().expect("durable").compact();
        let rx = rx.lock().unwrap();
        rx.0.recv_timeout(Duration::from_secs(5))
            .expect("the compaction started");
        // Give the snapshot time to finish; it may not, if it must wait
        // for this seal to complete.
        let _ = rx.1.recv_timeout(Duration::from_millis(300));
    }));
}

#[tokio::test]
async fn a_snapshot_between_seal_and_ready_keeps_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let c = durable_cfg(dir.path(), 2);
    {
        let b = Buffer::open(c.clone()).unwrap();
        b.sync().await.unwrap(); // the compaction at open is done
        push_group(&b, "early", 2, 0).await;
        b.push(rollout("g", "g-0", &[0]), 10).await.unwrap();
        compact_on_first_seal(&b);
        b.push(rollout("g", "g-1", &[0]), 10).await.unwrap();
        b.sync().await.unwrap();
        b.close().await.unwrap();
    }
    let b = Buffer::open(c).unwrap();
    let s = b.stats();
    assert_eq!((s.groups_ready, s.groups_pending), (2, 0), "{s:?}");
    let batch = b.sample(2, NOW, false).await.unwrap();
    let got: Vec<_> = batch
        .iter()
        .map(|g| (g.group.id.as_str(), g.group.members.len()))
        .collect();
    assert_eq!(got, [("early", 2), ("g", 2)]);
}

#[tokio::test]
async fn single_member_groups_are_pruned_and_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = durable_cfg(dir.path(), 1);
    c.dedup_window_groups = 8;
    c.batch_groups = 10;
    c.max_staleness = 100;
    c.compact_bytes = 4096; // compactions during the workload
    let n = 200;
    let consumed = 120;
    {
        let b = Buffer::open(c.clone()).unwrap();
        for g in 0..n {
            push_group(&b, &format!("g{g:03}"), 1, 0).await;
            if g % 10 == 9 && g < consumed {
                assert_eq!(b.sample(10, NOW, false).await.unwrap().len(), 10);
            }
        }
        b.sweep(Instant::now());
        let held = b.stats().groups_ready;
        assert_eq!(held, (n - consumed) as u64);
        assert!(
            b.inner.groups.len() <= c.dedup_window_groups,
            "{} group slots kept for a window of {}",
            b.inner.groups.len(),
            c.dedup_window_groups
        );
        assert!(b.inner.tombstones.lock().len() <= c.dedup_window_groups);
        b.close().await.unwrap();
    }
    let b = Buffer::open(c).unwrap();
    let s = b.stats();
    assert_eq!(
        (s.groups_ready, s.groups_pending),
        ((n - consumed) as u64, 0)
    );
    let mut ids = Vec::new();
    while let Ok(batch) = b.sample(10, NOW, false).await {
        ids.extend(batch.into_iter().map(|g| g.group.id.clone()));
    }
    let want: Vec<String> = (consumed..n).map(|g| format!("g{g:03}")).collect();
    assert_eq!(ids, want);
}

#[tokio::test]
async fn a_snapshot_of_a_dropped_buffer_is_refused_and_keeps_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let b = Buffer::open(durable_cfg(dir.path(), 2)).unwrap();
    let source = recovery::snapshot_source(Arc::downgrade(&b.inner));
    b.close().await.unwrap();
    drop(b);
    // Another log, compacted with the dropped buffer's snapshot: it must
    // keep its records rather than be rewritten empty.
    let other = tempfile::tempdir().unwrap();
    let (wal, _) = Wal::open(other.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
    let version = |v| walpb::Record {
        kind: Some(Kind::Version(walpb::Version {
            version: v,
            ..Default::default()
        })),
    };
    wal.append_record(&version(7));
    wal.set_snapshot(source);
    wal.compact();
    wal.close().await.unwrap();
    let (_, rec) = Wal::open(other.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
    assert_eq!(rec.records, vec![version(7)]);
}

// Learner incarnations (docs/architecture.md, "Failure model").

const A: u64 = 0xA;
const B: u64 = 0xB;

fn inc(id: u64, first_version: u64) -> Incarnation {
    Incarnation { id, first_version }
}

fn from(incarnation: u64, group: &str, id: &str, versions: &[u64]) -> Rollout {
    Rollout {
        learner_incarnation: incarnation,
        ..rollout(group, id, versions)
    }
}

fn report(version: u64, lineage: &[Incarnation], groups_trained: u64) -> LearnerReport {
    LearnerReport {
        version,
        lineage: lineage.to_vec(),
        groups_trained,
        batch_groups: 0,
    }
}

fn label(out: PushOutcome) -> &'static str {
    match out {
        PushOutcome::Rejected(r) => r.label,
        PushOutcome::Accepted => "accepted",
        PushOutcome::Duplicate => "duplicate",
    }
}

/// Incarnation A at version 70 with admission at its limit (80 groups
/// consumed, 7 held, limit (16 + 70 + 1) × 1 = 87), then B resumes from A's
/// checkpoint at version 50 having trained on 60 group draws.
async fn freeze_then_resume(b: &Buffer) -> ReportOutcome {
    start_a_at_70(b);
    for g in 0..87 {
        let out = b.push(from(A, &format!("a{g}"), "r", &[70]), 10).await;
        assert_eq!(out.unwrap(), PushOutcome::Accepted);
    }
    for _ in 0..80 {
        b.sample(1, NOW, false).await.unwrap();
    }
    let s = b.stats();
    assert_eq!((s.admitted_groups, s.admission_limit), (87, 87));
    b.report(report(50, &[inc(A, 0), inc(B, 50)], 60)).unwrap()
}

/// A starts fresh (admission based at version 0) and trains to 70.
fn start_a_at_70(b: &Buffer) {
    b.report(report(0, &[inc(A, 0)], 0)).unwrap();
    b.report(report(70, &[inc(A, 0)], 0)).unwrap();
}

fn incarnation_cfg() -> BufferConfig {
    cfg(1, 1, 16)
}

#[tokio::test]
async fn a_new_incarnation_at_a_lower_version_is_admitted_data_again() {
    let b = Buffer::open(incarnation_cfg()).unwrap();
    start_a_at_70(&b);
    for g in 0..87 {
        push_group(&b, &format!("a{g}"), 1, 70).await;
    }
    // At the limit: the next group waits...
    let held = {
        let b = b.clone();
        tokio::spawn(async move { b.push(from(A, "late", "r", &[70]), 10).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!held.is_finished());
    for _ in 0..80 {
        b.sample(1, NOW, false).await.unwrap();
    }
    // ...and after B resumes at 50, without the re-base, would wait forever:
    // (16 + 50 + 1) × 1 = 67 < 87 groups counted.
    let out = b.report(report(50, &[inc(A, 0), inc(B, 50)], 60)).unwrap();
    assert_eq!(out.evicted_rolled_back, 7);
    assert_eq!(b.learner_version(), 50);
    // The held group of A's version 70 is outside the history now.
    let late = tokio::time::timeout(Duration::from_secs(1), held)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(label(late), "rolled_back");
    for g in 0..17 {
        let out = tokio::time::timeout(
            Duration::from_secs(1),
            b.push(from(B, &format!("b{g}"), "r", &[50]), 10),
        )
        .await
        .expect("admitted at once after the re-base")
        .unwrap();
        assert_eq!(out, PushOutcome::Accepted);
    }
    let s = b.stats();
    assert_eq!((s.admitted_groups, s.admission_limit), (17, 17));
}

#[tokio::test]
async fn a_new_incarnation_evicts_rolled_back_groups_and_counts_lost_draws() {
    let b = Buffer::open(cfg(2, 1, 32)).unwrap();
    b.report(report(70, &[inc(A, 0)], 0)).unwrap();
    // Ready: one in the new history (A at 50), one outside (A at 60).
    for (g, v) in [("keep", 50), ("gone", 60)] {
        for i in 0..2 {
            b.push(from(A, g, &format!("{g}{i}"), &[v]), 10)
                .await
                .unwrap();
        }
    }
    // Pending: outside (A at 51), unrecorded incarnation at 70 (judged by
    // version: beyond 50), and inside (A up to 50).
    for (g, inc, versions) in [
        ("p-gone", A, &[49, 51][..]),
        ("p-zero", 0, &[70]),
        ("p-keep", A, &[45, 50]),
    ] {
        let out = b.push(from(inc, g, "x", versions), 10).await.unwrap();
        assert_eq!(out, PushOutcome::Accepted, "{g}");
    }
    let before = b.stats().group_samples;
    assert_eq!(before, 0);
    let out = b.report(report(50, &[inc(A, 0), inc(B, 50)], 0)).unwrap();
    assert_eq!(out.evicted_rolled_back, 3);
    let s = b.stats();
    assert_eq!(s.evictions["rolled_back"], 3);
    assert_eq!((s.groups_ready, s.groups_pending), (1, 1));
    assert_eq!(s.learner_incarnation, B);
    assert_eq!(
        s.groups_admitted,
        s.groups_consumed + 3 + s.groups_ready + s.groups_pending
    );
    assert_eq!(b.sample(1, NOW, false).await.unwrap()[0].group.id, "keep");
}

#[tokio::test]
async fn rollouts_are_judged_by_the_history() {
    let b = Buffer::open(incarnation_cfg()).unwrap();
    let out = freeze_then_resume(&b).await;
    assert_eq!(out.evicted_rolled_back, 7);
    let push = |r| {
        let b = b.clone();
        async move { label(b.push(r, 10).await.unwrap()) }
    };
    // A's versions up to B's start are B's too.
    assert_eq!(push(from(A, "a-old", "r", &[45, 50])).await, "accepted");
    assert_eq!(push(from(A, "a-new", "r", &[50, 51])).await, "rolled_back");
    assert_eq!(push(from(0xC, "c", "r", &[1])).await, "rolled_back");
    assert_eq!(push(from(B, "b", "r", &[50])).await, "accepted");
    assert_eq!(
        push(from(B, "b-future", "r", &[51])).await,
        "future_version"
    );
    // Not recorded: by version only, as before incarnations.
    assert_eq!(push(from(0, "z", "r", &[50])).await, "accepted");
    assert_eq!(
        push(from(0, "z-future", "r", &[55])).await,
        "future_version"
    );
    let s = b.stats();
    assert_eq!(s.rejections["rolled_back"], 2);
    match b.push(from(0xC, "c2", "r", &[1]), 10).await.unwrap() {
        PushOutcome::Rejected(r) => {
            assert_eq!(r.code, RejectCode::FailedPrecondition);
            assert!(r.reason.contains("000000000000000c"), "{}", r.reason);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_zombie_learner_is_refused_by_name() {
    let b = Buffer::open(incarnation_cfg()).unwrap();
    freeze_then_resume(&b).await;
    let err = b.report(report(71, &[inc(A, 0)], 80)).unwrap_err();
    assert!(matches!(err, BufferError::Superseded(_)), "{err}");
    assert!(err.to_string().contains("000000000000000a"), "{err}");
    assert_eq!(b.learner_version(), 50, "a refused report changes nothing");
    // The current incarnation goes on; a legacy report is still taken.
    b.report(report(51, &[inc(A, 0), inc(B, 50)], 61)).unwrap();
    assert_eq!(b.report_version(52), 0);
    assert_eq!(b.stats().learner_incarnation, B);
}

#[tokio::test]
async fn lost_draws_are_those_handed_out_beyond_the_trained_ones() {
    let b = Buffer::open(incarnation_cfg()).unwrap();
    freeze_then_resume(&b).await;
    // 80 draws handed out, B's weights contain 60.
    assert_eq!(b.stats().groups_lost_to_rollback, 20);
    // A learner that trained on more than was handed out: none lost.
    b.report(report(50, &[inc(A, 0), inc(B, 50), inc(0xC, 50)], 500))
        .unwrap();
    assert_eq!(b.stats().groups_lost_to_rollback, 0);
}

#[tokio::test]
async fn lineage_and_rebase_survive_replay_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = incarnation_cfg();
    c.data_dir = Some(dir.path().to_path_buf());
    c.fsync = FsyncPolicy::Never;
    let before = {
        let b = Buffer::open(c.clone()).unwrap();
        freeze_then_resume(&b).await;
        push_group(&b, "b0", 1, 50).await;
        b.sync().await.unwrap();
        b.stats()
        // Dropped without close(): as if killed.
    };
    // The first open replays the raw log; the second the compacted one.
    for _ in 0..2 {
        let b = Buffer::open(c.clone()).unwrap();
        let s = b.stats();
        assert_eq!(s.learner_version, 50);
        assert_eq!(s.learner_incarnation, B);
        assert_eq!(s.groups_lost_to_rollback, 20);
        assert_eq!(
            (s.admitted_groups, s.admission_limit),
            (before.admitted_groups, before.admission_limit)
        );
        assert_eq!(s.evictions["rolled_back"], 7);
        assert_eq!(s.groups_admitted, before.groups_admitted);
        assert_eq!(
            label(b.push(from(A, "a-new", "r", &[51]), 10).await.unwrap()),
            "rolled_back"
        );
        assert!(b.report(report(71, &[inc(A, 0)], 0)).is_err());
        b.close().await.unwrap();
    }
}

/// A report whose lineage cannot be a history (forged, or from a broken
/// learner) is refused by entry before it changes anything: no eviction,
/// no re-base, no new version, the current incarnation kept.
#[tokio::test]
async fn a_forged_lineage_is_refused_and_changes_nothing() {
    let b = Buffer::open(incarnation_cfg()).unwrap();
    start_a_at_70(&b);
    for g in 0..5 {
        push_group(&b, &format!("a{g}"), 1, 70).await;
    }
    let before = b.stats();
    let forged = [
        // B claims to start after the version it reports.
        (
            vec![inc(A, 0), inc(B, 90)],
            "entry 1",
            "after the weights' version",
        ),
        // B names A's id again.
        (vec![inc(A, 0), inc(A, 10)], "entry 1", "repeats"),
        // Id 0 means "none".
        (vec![inc(0, 0)], "entry 0", "reserved"),
        // Starts go backwards.
        (
            vec![inc(A, 20), inc(B, 10)],
            "entry 1",
            "before its predecessor",
        ),
    ];
    for (lineage, entry, why) in forged {
        let e = b.report(report(50, &lineage, 0)).unwrap_err();
        assert!(matches!(e, BufferError::InvalidRequest(_)), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(entry) && msg.contains(why), "{msg}");
    }
    let after = b.stats();
    assert_eq!(b.learner_version(), 70);
    assert_eq!(after.learner_incarnation, A);
    assert_eq!(after.groups_ready, before.groups_ready, "nothing evicted");
    assert_eq!(after.admission_limit, before.admission_limit, "no re-base");
}

/// A learner stating another batch size is refused by name before its
/// report changes anything; one stating none (0, older learners) or the
/// buffer's own is taken.
#[tokio::test]
async fn a_learner_with_another_batch_size_is_refused_by_name() {
    let b = Buffer::open(cfg(4, 2, 2)).unwrap();
    let with = |batch_groups: u32, version: u64| LearnerReport {
        batch_groups,
        ..report(version, &[inc(A, 0)], 0)
    };
    let e = b.report(with(3, 5)).unwrap_err();
    assert!(matches!(e, BufferError::InvalidRequest(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("batch_groups is 3") && msg.contains("buffer's is 2"),
        "{msg}"
    );
    assert_eq!(b.learner_version(), 0, "nothing changed");
    b.report(with(2, 1)).unwrap();
    b.report(with(0, 2)).unwrap();
    assert_eq!(b.learner_version(), 2);
}
