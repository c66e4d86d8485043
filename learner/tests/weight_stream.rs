//! The weight stream over a real loopback socket: a subscriber holding
//! weights of another learner incarnation is sent the current weights at
//! once, even when the version it holds is higher (a resumed learner reuses
//! version numbers); one holding the current incarnation's newest version
//! waits for the next.

mod common;

use std::time::Duration;

use bapo_learner::{broadcast::WeightHub, server};
use bapo_proto::v1::{
    SubscribeRequest, WeightMessage, WeightUpdate, weight_message::Kind,
    weight_source_client::WeightSourceClient,
};
use common::tiny_policy;
use tokio::sync::oneshot;
use tonic::Streaming;

const RESUMED: u64 = 0xa1;
const DEAD: u64 = 0xd3;

/// A weight server for `hub` on an ephemeral port; stops when the sender
/// is dropped.
async fn serve(hub: WeightHub) -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server::serve(hub, listener, async {
        let _ = rx.await;
    }));
    (format!("http://{addr}"), tx)
}

fn publish(hub: &WeightHub, version: u64) {
    let p = tiny_policy(21);
    hub.publish(&p.model, &p.config, version).unwrap();
}

async fn subscribe(
    url: &str,
    have_version: u64,
    have_incarnation: u64,
) -> Streaming<WeightMessage> {
    let mut client = WeightSourceClient::connect(url.to_string()).await.unwrap();
    client
        .subscribe(SubscribeRequest {
            actor_id: "test".into(),
            have_version,
            have_incarnation,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// The next update and its chunks, checked to add up; `None` if nothing
/// arrives within `wait`.
async fn next_update(s: &mut Streaming<WeightMessage>, wait: Duration) -> Option<WeightUpdate> {
    let first = tokio::time::timeout(wait, s.message()).await.ok()?;
    let Some(Kind::Update(u)) = first.unwrap().and_then(|m| m.kind) else {
        panic!("a weight stream starts each version with its update message");
    };
    let mut len = 0;
    for _ in 0..u.chunks {
        match s.message().await.unwrap().and_then(|m| m.kind) {
            Some(Kind::Chunk(c)) => len += c.len() as u64,
            other => panic!("expected a chunk, got {other:?}"),
        }
    }
    assert_eq!(len, u.payload_len);
    Some(u)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_of_another_incarnation_gets_the_weights_whatever_its_version() {
    let hub = WeightHub::with_incarnation(RESUMED);
    publish(&hub, 3);
    let (url, _stop) = serve(hub).await;
    // The actor holds version 7 of the learner that died; the resumed one
    // is at 3.
    let mut s = subscribe(&url, 7, DEAD).await;
    let u = next_update(&mut s, Duration::from_secs(10))
        .await
        .expect("the resumed learner's weights are sent at once");
    assert_eq!((u.version, u.incarnation), (3, RESUMED));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_of_this_incarnation_waits_for_a_newer_version() {
    let hub = WeightHub::with_incarnation(RESUMED);
    publish(&hub, 3);
    let (url, _stop) = serve(hub.clone()).await;
    let mut s = subscribe(&url, 3, RESUMED).await;
    assert!(
        next_update(&mut s, Duration::from_millis(300))
            .await
            .is_none(),
        "the subscriber already holds version 3"
    );
    publish(&hub, 4);
    let u = next_update(&mut s, Duration::from_secs(10))
        .await
        .expect("version 4 is sent");
    assert_eq!((u.version, u.incarnation), (4, RESUMED));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_without_an_incarnation_gets_the_current_weights() {
    // An actor that predates incarnations (have_incarnation 0) cannot tell
    // a resumed learner's version 5 from the dead one's, so it is sent it.
    let hub = WeightHub::with_incarnation(RESUMED);
    publish(&hub, 5);
    let (url, _stop) = serve(hub).await;
    let mut s = subscribe(&url, 5, 0).await;
    let u = next_update(&mut s, Duration::from_secs(10))
        .await
        .expect("sent at once");
    assert_eq!((u.version, u.incarnation), (5, RESUMED));
}
