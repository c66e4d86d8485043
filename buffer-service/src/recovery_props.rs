//! Property tests of recovery: whatever state `wal.log` is in (torn,
//! bit-flipped, random, or framed records with random contents), opening
//! the buffer never panics; it either refuses the file by name or replays
//! it, keeping every group whose records lie before the damage.

use std::{collections::HashSet, fs, path::Path, time::Duration};

use bapo_proto::{
    packed::{pack_f32, pack_u32},
    v1,
    wal::{self as walpb, record::Kind},
};
use proptest::prelude::*;

use crate::{
    Buffer, BufferConfig,
    config::FsyncPolicy,
    wal::{self, Wal},
};

const GROUP_SIZE: u32 = 2;

fn config(dir: &Path) -> BufferConfig {
    BufferConfig {
        group_size: GROUP_SIZE,
        min_group_size: 1,
        batch_groups: 64,
        max_staleness: 64,
        data_dir: Some(dir.to_path_buf()),
        fsync: FsyncPolicy::Never,
        ..Default::default()
    }
}

fn rollout(group: &str, i: u32) -> v1::Rollout {
    v1::Rollout {
        rollout_id: format!("{group}/{i}"),
        group_id: group.into(),
        prompt_tokens: pack_u32(&[1, 2, 3]),
        response_tokens: pack_u32(&[4, 5]),
        behavior_logprobs: pack_f32(&[-0.5, -0.25]),
        token_versions: pack_u32(&[0, 0]),
        reward: 1.0,
        ..Default::default()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a test runtime")
}

/// Writes a log of `groups` complete groups through a real buffer; returns
/// the byte offset at which each group's last frame ends.
fn write_log(dir: &Path, groups: usize) -> Vec<(String, u64)> {
    runtime().block_on(async {
        let b = Buffer::open(config(dir)).expect("open");
        b.sync().await.expect("compaction at open");
        let log = dir.join("wal.log");
        let mut ends = Vec::new();
        for g in 0..groups {
            let id = format!("g{g}");
            for i in 0..GROUP_SIZE {
                let r = crate::wire::rollout_from_wire(rollout(&id, i)).expect("valid");
                b.push(r, 100).await.expect("push");
            }
            b.sync().await.expect("sync");
            ends.push((id, fs::metadata(&log).expect("log").len()));
        }
        // Dropped without close(): as if killed (nothing is compacted).
        ends
    })
}

/// Opens the buffer on whatever is in `dir`; the ready group ids, or the
/// error's text.
fn reopen(dir: &Path) -> Result<HashSet<String>, String> {
    runtime().block_on(async {
        let b = Buffer::open(config(dir)).map_err(|e| format!("{e:#}"))?;
        let mut ids = HashSet::new();
        while let Ok(batch) = b.sample(8, Duration::ZERO, true).await {
            if batch.is_empty() {
                break;
            }
            for g in batch {
                assert_eq!(g.group.members.len(), GROUP_SIZE as usize);
                ids.insert(g.group.id.clone());
            }
        }
        b.close().await.map_err(|e| e.to_string())?;
        Ok(ids)
    })
}

/// Groups whose frames all end at or before `offset`.
fn intact(ends: &[(String, u64)], offset: u64) -> HashSet<String> {
    (ends.iter())
        .filter(|(_, end)| *end <= offset)
        .map(|(id, _)| id.clone())
        .collect()
}

fn record() -> impl Strategy<Value = walpb::Record> {
    let id = prop::sample::select(vec!["a", "b", "c"]).prop_map(String::from);
    let kind = prop_oneof![
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(v, r, s, lost, rb)| Kind::Meta(walpb::Meta {
                learner_version: v,
                retired_groups: r,
                next_sequence: s,
                groups_lost_to_rollback: lost,
                rebase_retired: rb,
                rebase_version: v,
                lineage: vec![v1::Incarnation {
                    id: s,
                    first_version: r,
                }],
                ..Default::default()
            })),
        (id.clone(), 0u32..4, any::<u32>(), any::<u64>()).prop_map(|(g, i, v, inc)| {
            let mut r = rollout(&g, i);
            r.token_versions = pack_u32(&[v, v]);
            r.learner_incarnation = inc;
            Kind::Rollout(r)
        }),
        (id.clone(), any::<u64>())
            .prop_map(|(group_id, sequence)| Kind::Ready(walpb::Ready { group_id, sequence })),
        (id.clone(), any::<u32>()).prop_map(|(group_id, use_count)| {
            Kind::Sampled(walpb::Sampled {
                uses: vec![walpb::GroupUse {
                    group_id,
                    use_count,
                }],
            })
        }),
        (
            id.clone(),
            prop::sample::select(vec!["stale", "capacity", "?"])
        )
            .prop_map(|(g, reason)| Kind::Evicted(walpb::Evicted {
                group_ids: vec![g],
                reason: reason.into(),
            })),
        (id, any::<u64>()).prop_map(|(group_id, v)| Kind::Tombstone(walpb::Tombstone {
            group_id,
            rollout_ids: vec![v.to_string()],
        })),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(version, lost, rb)| {
            Kind::Version(walpb::Version {
                version,
                groups_lost_to_rollback: lost,
                rebase_retired: rb,
                rebase_version: version / 2,
                ..Default::default()
            })
        }),
    ];
    kind.prop_map(|k| walpb::Record { kind: Some(k) })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn a_torn_log_keeps_every_group_before_the_tear(groups in 1usize..6, cut in 0.0f64..1.0) {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_log(dir.path(), groups);
        let log = dir.path().join("wal.log");
        let len = fs::metadata(&log).unwrap().len();
        let at = (len as f64 * cut) as u64;
        fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(at).unwrap();
        match reopen(dir.path()) {
            Ok(ids) => prop_assert!(ids.is_superset(&intact(&ends, at)), "{ids:?}"),
            Err(e) => {
                prop_assert!(at < 8, "only a cut magic is refused, at {at}: {e}");
                prop_assert!(e.contains("bad magic"), "{e}");
            }
        }
    }

    #[test]
    fn a_flipped_bit_keeps_every_group_before_it(groups in 1usize..6, pos in 0.0f64..1.0, bit in 0u8..8) {
        let dir = tempfile::tempdir().unwrap();
        let ends = write_log(dir.path(), groups);
        let log = dir.path().join("wal.log");
        let mut bytes = fs::read(&log).unwrap();
        let at = ((bytes.len() as f64 * pos) as usize).min(bytes.len() - 1);
        bytes[at] ^= 1 << bit;
        fs::write(&log, &bytes).unwrap();
        match reopen(dir.path()) {
            Ok(ids) => prop_assert!(ids.is_superset(&intact(&ends, at as u64)), "{ids:?}"),
            Err(e) => {
                prop_assert!(at < 8, "only a damaged magic is refused, at {at}: {e}");
                prop_assert!(e.contains("bad magic"), "{e}");
            }
        }
    }

    #[test]
    fn random_bytes_are_refused_or_cut(magic in any::<bool>(), tail in prop::collection::vec(any::<u8>(), 0..512)) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = if magic { b"BAPOWAL\x01".to_vec() } else { Vec::new() };
        bytes.extend_from_slice(&tail);
        fs::write(dir.path().join("wal.log"), &bytes).unwrap();
        match reopen(dir.path()) {
            Ok(_) => prop_assert!(magic),
            Err(e) => prop_assert!(e.contains("bad magic"), "{e}"),
        }
    }

    #[test]
    fn framed_records_with_random_contents_replay_without_panic(
        records in prop::collection::vec(record(), 0..24),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = b"BAPOWAL\x01".to_vec();
        for r in &records {
            bytes.extend_from_slice(&wal::frame(r));
        }
        fs::write(dir.path().join("wal.log"), &bytes).unwrap();
        let opened = runtime().block_on(async {
            let b = Buffer::open(config(dir.path()))?;
            let _ = b.stats();
            b.close().await?;
            anyhow::Ok(())
        });
        prop_assert!(opened.is_ok(), "{opened:?}");
        // And the log it compacted to opens again.
        let (_, rec) = Wal::open(dir.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
        prop_assert_eq!(rec.truncated_bytes, 0);
    }
}
