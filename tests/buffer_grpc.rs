//! The buffer service over real loopback sockets: concurrency, bad input,
//! health and reflection.

mod common;

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use bapo_buffer::BufferConfig;
use bapo_proto::packed::{pack_f32, pack_u32};
use bapo_proto::v1::{SampleRequest, StatsRequest, VersionReport};
use common::*;

fn cfg(group_size: u32) -> BufferConfig {
    BufferConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        group_size,
        min_group_size: 1,
        batch_groups: 4,
        max_staleness: 1_000,
        capacity_groups: 64,
        ..Default::default()
    }
}

/// P pushers (each re-sending some streams, as an actor does after a lost
/// ack) and one sampler at once: every rollout is handed out exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_pushers_and_a_sampler_reconcile_exactly() {
    const PUSHERS: usize = 6;
    const GROUPS: usize = 40;
    const K: usize = 4;
    let server = TestBuffer::start(cfg(K as u32)).await;
    let mut pushers = Vec::new();
    for p in 0..PUSHERS {
        let mut sink = server.sink().await;
        pushers.push(tokio::spawn(async move {
            let (mut accepted, mut dup) = (0, 0);
            for g in 0..GROUPS {
                let msgs = group(&format!("p{p}g{g}"), K, 0);
                // Split each group over two streams; re-send every 5th.
                let (a, b) = msgs.split_at(K / 2);
                for part in [a.to_vec(), b.to_vec()] {
                    let ack = push(&mut sink, part.clone()).await;
                    assert!(ack.rejected.is_empty(), "{:?}", ack.rejected);
                    accepted += ack.accepted;
                    dup += ack.duplicates;
                    if g % 5 == 0 {
                        let again = push(&mut sink, part).await;
                        assert_eq!(again.accepted, 0);
                        dup += again.duplicates;
                    }
                }
            }
            (accepted, dup)
        }));
    }
    let mut source = server.source().await;
    let sampler = tokio::spawn(async move {
        let mut seen: HashMap<String, u32> = HashMap::new();
        let mut version = 0;
        let mut last_seq = None;
        while seen.len() < PUSHERS * GROUPS * K {
            let batch = source
                .sample(SampleRequest {
                    num_groups: 4,
                    timeout_ms: 5_000,
                    allow_partial: true,
                })
                .await
                .unwrap()
                .into_inner();
            assert!(
                !batch.groups.is_empty(),
                "sampler starved with {} seen",
                seen.len()
            );
            for g in batch.groups {
                assert_eq!(g.rollouts.len(), K, "only complete groups are handed out");
                assert!(last_seq < Some(g.sequence), "FIFO order");
                last_seq = Some(g.sequence);
                for r in g.rollouts {
                    *seen.entry(r.rollout_id).or_default() += 1;
                }
            }
            version += 1;
            source
                .report_version(VersionReport {
                    version,
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        (seen, source)
    });
    let mut accepted = 0;
    let mut duplicates = 0;
    for p in pushers {
        let (a, d) = p.await.unwrap();
        accepted += a;
        duplicates += d;
    }
    let (seen, mut source) = tokio::time::timeout(Duration::from_secs(60), sampler)
        .await
        .expect("sampler finished")
        .unwrap();
    let expected: HashSet<String> = (0..PUSHERS)
        .flat_map(|p| (0..GROUPS).flat_map(move |g| (0..K).map(move |i| format!("p{p}g{g}/{i}"))))
        .collect();
    assert_eq!(
        seen.keys().cloned().collect::<HashSet<_>>(),
        expected,
        "nothing lost"
    );
    assert!(seen.values().all(|&n| n == 1), "nothing duplicated");
    assert_eq!(accepted as usize, expected.len());
    assert_eq!(duplicates as usize, PUSHERS * (GROUPS / 5) * K);
    let stats = source
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.rollouts_accepted as usize, expected.len());
    assert_eq!(stats.groups_consumed as usize, PUSHERS * GROUPS);
    assert_eq!(
        (stats.groups_ready, stats.groups_pending, stats.bytes_held),
        (0, 0, 0)
    );
    server.stop().await;
}

/// Every kind of bad input in one stream gets its own error naming the
/// rollout and field; the good rollouts around it land.
#[tokio::test]
async fn each_bad_input_is_refused_by_name_and_the_rest_lands() {
    let mut c = cfg(2);
    c.max_tokens = 64;
    c.max_rollout_bytes = 2048;
    let server = TestBuffer::start(c).await;
    let mut source = server.source().await;
    source
        .report_version(VersionReport {
            version: 3,
            ..Default::default()
        })
        .await
        .unwrap();

    let good = |i: usize| rollout(&format!("good{}", i / 2), &format!("good-{i}"), 8, 3);
    let mut bad = Vec::new();
    let mut expect = Vec::new();
    let mut case = |r: bapo_proto::v1::Rollout, code: i32, needle: &str| {
        expect.push((r.rollout_id.clone(), code, needle.to_string()));
        bad.push(r);
    };
    let mut r = rollout("b", "empty", 0, 3);
    r.response_tokens.clear();
    case(r, 3, "response_tokens is empty");
    let mut r = rollout("b", "mismatch", 8, 3);
    r.behavior_logprobs = pack_f32(&[-0.25; 7]);
    case(r, 3, "behavior_logprobs 7");
    let mut r = rollout("b", "versions-mismatch", 8, 3);
    r.token_versions = pack_u32(&[3; 9]);
    case(r, 3, "token_versions 9");
    let mut r = rollout("b", "ragged", 8, 3);
    r.response_tokens = r.response_tokens.slice(..30);
    case(r, 3, "response_tokens: 30 bytes is not a whole number");
    let mut lp = [-0.25f32; 8];
    lp[5] = f32::NAN;
    let mut r = rollout("b", "nan", 8, 3);
    r.behavior_logprobs = pack_f32(&lp);
    case(r, 3, "behavior_logprobs[5] = NaN");
    let mut r = rollout("b", "inf-reward", 8, 3);
    r.reward = f32::NEG_INFINITY;
    case(r, 3, "reward = -inf");
    let mut lp = [-0.25f32; 8];
    lp[2] = 0.5;
    let mut r = rollout("b", "positive", 8, 3);
    r.behavior_logprobs = pack_f32(&lp);
    case(r, 3, "behavior_logprobs[2] = 0.5");
    case(
        rollout("b", "future", 8, 4),
        9,
        "version 4, newer than the learner's version 3",
    );
    case(rollout("b", "too-many", 80, 3), 3, "exceed max_tokens = 64");
    let mut r = rollout("b", "too-big", 8, 3);
    r.metadata.insert("blob".into(), "x".repeat(4096));
    case(r, 3, "over the limit of 2048 bytes");

    // Interleave good and bad, then a duplicate and a group overflow.
    let mut msgs = Vec::new();
    for (i, b) in bad.into_iter().enumerate() {
        msgs.push(good(i));
        msgs.push(b);
    }
    msgs.push(good(0)); // duplicate of good-0
    msgs.push(rollout("good0", "intruder", 8, 3)); // good0 already has 2
    let ack = push(&mut server.sink().await, msgs).await;

    assert_eq!(ack.accepted, 10, "every good rollout landed: {ack:?}");
    assert_eq!(ack.duplicates, 1);
    let by_id: HashMap<_, _> = ack
        .rejected
        .iter()
        .map(|r| (r.rollout_id.clone(), r))
        .collect();
    for (id, code, needle) in expect {
        let r = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("{id} not rejected: {ack:?}"));
        assert_eq!(r.code, code, "{id}: {}", r.reason);
        assert!(
            r.reason.contains(needle.as_str()),
            "{id}: {:?} lacks {needle:?}",
            r.reason
        );
        assert!(
            r.reason.contains(&format!("{id:?}")),
            "names the rollout: {}",
            r.reason
        );
    }
    let intruder = by_id.get("intruder").expect("group overflow rejected");
    assert!(
        intruder.reason.contains("sealed") || intruder.reason.contains("group_size"),
        "{}",
        intruder.reason
    );
    assert_eq!(ack.rejected.len(), 11);

    let stats = source
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.rollouts_accepted, 10);
    assert_eq!(stats.rollouts_rejected, 11);
    server.stop().await;
}

#[tokio::test]
async fn sample_without_enough_groups_is_deadline_exceeded_and_consumes_nothing() {
    let server = TestBuffer::start(cfg(1)).await;
    push(&mut server.sink().await, group("only", 1, 0)).await;
    let mut source = server.source().await;
    let err = source
        .sample(SampleRequest {
            num_groups: 2,
            timeout_ms: 50,
            allow_partial: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    assert!(err.message().contains("only 1 of 2"), "{}", err.message());
    let mut stream = source
        .sample_stream(SampleRequest {
            num_groups: 1,
            timeout_ms: 0,
            allow_partial: false,
        })
        .await
        .unwrap()
        .into_inner();
    let g = stream.message().await.unwrap().unwrap();
    assert_eq!(g.group_id, "only");
    assert!(stream.message().await.unwrap().is_none());
    server.stop().await;
}

#[tokio::test]
async fn health_and_reflection_answer() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let server = TestBuffer::start(cfg(1)).await;
    let ch = channel(server.addr).await;
    let mut health = HealthClient::new(ch.clone());
    for service in ["", "bapo.v1.RolloutSink", "bapo.v1.BatchSource"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, 1, "{service:?} is SERVING");
    }
    let mut refl = ServerReflectionClient::new(ch);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut resp = refl
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) =
        resp.message().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list")
    };
    let names: HashSet<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains("bapo.v1.RolloutSink") && names.contains("bapo.v1.BatchSource"),
        "{names:?}"
    );
    server.stop().await;
}

/// An actor that dies mid-stream: what it sent before is kept, its restarted
/// self re-sends the group and only the missing member is stored.
#[tokio::test]
async fn a_pusher_dying_mid_stream_loses_nothing_it_sent() {
    let server = TestBuffer::start(cfg(2)).await;
    let mut source = server.source().await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut sink = server.sink().await;
    let call = tokio::spawn(async move {
        sink.push(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    tx.send(rollout("g", "g/0", 8, 0)).await.unwrap();
    for _ in 0..200 {
        let s = source
            .get_stats(StatsRequest {})
            .await
            .unwrap()
            .into_inner();
        if s.rollouts_accepted == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    call.abort();
    drop(tx);
    let ack = push(&mut server.sink().await, group("g", 2, 0)).await;
    assert_eq!((ack.accepted, ack.duplicates), (1, 1));
    let batch = source
        .sample(SampleRequest {
            num_groups: 1,
            timeout_ms: 1000,
            allow_partial: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(batch.groups[0].rollouts.len(), 2);
    server.stop().await;
}
