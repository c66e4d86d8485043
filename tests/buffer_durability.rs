//! The `bapo buffer` process with `--data-dir`: a kill -9 loses no
//! acknowledged group and repeats no consumption; SIGTERM exits 0; /metrics
//! is served.

mod common;

use std::{
    collections::HashSet,
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use bapo_proto::v1::{StatsRequest, VersionReport};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn spawn_buffer(addr: SocketAddr, metrics: SocketAddr, dir: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["buffer", "--listen", &addr.to_string()])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(["--data-dir", dir.to_str().unwrap()])
        .args([
            "--group-size",
            "2",
            "--batch-groups",
            "4",
            "--max-staleness",
            "100",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawning bapo buffer")
}

async fn scrape(addr: SocketAddr) -> String {
    for _ in 0..100 {
        if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).await.unwrap();
            return body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no metrics endpoint at {addr}");
}

#[tokio::test]
async fn kill_9_loses_no_acknowledged_group_and_repeats_no_consumption() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, metrics) = (free_addr(), free_addr());
    let mut child = spawn_buffer(addr, metrics, dir.path());
    let ch = channel(addr).await;
    let mut sink = bapo_proto::v1::rollout_sink_client::RolloutSinkClient::new(ch.clone());
    let mut source = bapo_proto::v1::batch_source_client::BatchSourceClient::new(ch);
    source
        .report_version(VersionReport {
            version: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    for g in 0..10 {
        let ack = push(&mut sink, group(&format!("g{g}"), 2, 5)).await;
        assert_eq!(ack.accepted, 2);
    }
    // Half a group: pending, must come back as pending.
    push(&mut sink, vec![rollout("half", "half/0", 16, 5)]).await;
    let consumed = sample_ids(&mut source, 3).await;
    assert_eq!(consumed, ["g0", "g1", "g2"]);
    let text = scrape(metrics).await;
    assert!(
        text.contains("bapo_buffer_rollouts_accepted_total 21"),
        "{text}"
    );
    assert!(text.contains("bapo_buffer_learner_version 5"), "{text}");

    child.kill().expect("kill -9");
    child.wait().unwrap();

    let mut child = spawn_buffer(addr, metrics, dir.path());
    let ch = channel(addr).await;
    let mut sink = bapo_proto::v1::rollout_sink_client::RolloutSinkClient::new(ch.clone());
    let mut source = bapo_proto::v1::batch_source_client::BatchSourceClient::new(ch);
    let stats = source
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.learner_version, 5);
    assert_eq!(
        (
            stats.groups_ready,
            stats.groups_pending,
            stats.groups_consumed
        ),
        (7, 1, 3)
    );
    // The actor re-sends a consumed group after losing its ack: duplicate.
    let again = push(&mut sink, group("g1", 2, 5)).await;
    assert_eq!((again.accepted, again.duplicates), (0, 2));
    push(&mut sink, vec![rollout("half", "half/1", 16, 5)]).await;
    let rest: HashSet<String> = sample_ids(&mut source, 8).await.into_iter().collect();
    let expected: HashSet<String> = (3..10)
        .map(|g| format!("g{g}"))
        .chain(["half".into()])
        .collect();
    assert_eq!(rest, expected);

    // SIGTERM: graceful, exit 0.
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Wait asynchronously: the open client connection must keep answering
    // the server's GOAWAY for the shutdown to be graceful.
    let code = wait_with_timeout(&mut child, Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "SIGTERM exits 0");
}

async fn wait_with_timeout(child: &mut Child, limit: Duration) -> Option<i32> {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("process did not exit within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
