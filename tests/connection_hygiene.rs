//! The gRPC servers keep serving real clients while hundreds of other
//! connections misbehave: silent ones (closed after the handshake timeout),
//! ones that send garbage (closed at once), and ones that open HTTP/2 and
//! then stall.

mod common;

use std::time::{Duration, Instant};

use bapo_buffer::BufferConfig;
use bapo_learner::{broadcast::WeightHub, server};
use bapo_proto::{
    transport::HANDSHAKE_TIMEOUT,
    v1::{SubscribeRequest, weight_source_client::WeightSourceClient},
};
use common::{TestBuffer, group, push, sample_ids};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const IDLE: usize = 300;
const GARBAGE: usize = 100;
const STALLED: usize = 50;

/// Misbehaving connections to `addr`: (silent, garbage, stalled).
async fn misbehave(addr: std::net::SocketAddr) -> (Vec<TcpStream>, Vec<TcpStream>, Vec<TcpStream>) {
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut garbage = Vec::new();
    for i in 0..GARBAGE {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let junk: Vec<u8> = (0..200u32).map(|b| (b * 31 + i as u32) as u8).collect();
        s.write_all(&junk).await.unwrap();
        garbage.push(s);
    }
    let mut stalled = Vec::new();
    for _ in 0..STALLED {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        stalled.push(s);
    }
    (idle, garbage, stalled)
}

/// Whether the server closes `s` within `limit` (EOF or reset).
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {} // a GOAWAY before the close
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_buffer_serves_through_idle_and_garbage_connections() {
    let buffer = TestBuffer::start(BufferConfig {
        group_size: 2,
        batch_groups: 1,
        ..Default::default()
    })
    .await;
    let (mut idle, mut garbage, _stalled) = misbehave(buffer.addr).await;

    let t = Instant::now();
    let mut sink = buffer.sink().await;
    let ack = push(&mut sink, group("g", 2, 0)).await;
    assert_eq!(ack.accepted, 2);
    let mut source = buffer.source().await;
    assert_eq!(sample_ids(&mut source, 1).await, vec!["g".to_string()]);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "a real client waited {:?} behind {} bad connections",
        t.elapsed(),
        IDLE + GARBAGE + STALLED
    );

    for s in &mut garbage {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "garbage kept open"
        );
    }
    let limit = HANDSHAKE_TIMEOUT + Duration::from_secs(5);
    for s in &mut idle {
        assert!(
            closed_within(s, limit).await,
            "a silent connection outlived the handshake timeout"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_weight_stream_serves_through_idle_and_garbage_connections() {
    let hub = WeightHub::new();
    let p = bapo_policy::testing::tiny_policy(4);
    hub.publish(&p.model, &p.config, 4).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server::serve(hub.clone(), listener, async {
        let _ = rx.await;
    }));
    let (_idle, mut garbage, _stalled) = misbehave(addr).await;

    let mut client = WeightSourceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let mut stream = client
        .subscribe(SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the subscriber is served promptly")
        .unwrap()
        .unwrap();
    assert!(first.kind.is_some());
    for s in &mut garbage {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "garbage kept open"
        );
    }
}
