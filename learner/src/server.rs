//! The learner's gRPC face: the weight stream (`bapo.v1.WeightSource`),
//! health checking and reflection. Thin over [`WeightHub`].
//!
//! What goes to a subscriber: the newest version, as the chain of deltas
//! from the version it holds when it takes deltas and holds one the chain
//! starts from (its payload's CRC32 must be the one the chain was made
//! from), and whole otherwise.

use std::{future::Future, pin::Pin, sync::Arc};

use bapo_proto::{
    standard,
    tls::{self, ServerSecurity},
    transport,
    v1::{
        SubscribeRequest, WeightMessage, WeightUpdate,
        weight_message::Kind,
        weight_source_server::{WeightSource, WeightSourceServer},
    },
};
use metrics::{counter, gauge, histogram};
use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status, server::NamedService};

use crate::{
    broadcast::{Published, WeightHub},
    delta_chain::{self, Link},
    metrics as names,
};

/// Payload bytes per chunk message: well under tonic's 4 MiB default
/// message limit, large enough that framing costs nothing.
pub const CHUNK_BYTES: usize = 1 << 20;

pub struct WeightSourceService {
    hub: WeightHub,
    faults: Faults,
}

impl WeightSourceService {
    pub fn new(hub: WeightHub, faults: Faults) -> Self {
        Self { hub, faults }
    }
}

/// Faults injected on purpose, for the tests that show a subscriber
/// never ends on wrong weights: `BAPO_FAULT_DROP_DELTAS=3,5` (read by
/// [`serve_with`]) never sends the delta that builds version 3 or 5 (the
/// links after it then name a base the subscriber does not hold). Unset
/// in production.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    drop_deltas: Vec<u64>,
}

impl Faults {
    pub const DROP_DELTAS: &str = "BAPO_FAULT_DROP_DELTAS";

    /// The faults `BAPO_FAULT_DROP_DELTAS` asks for (none when unset).
    pub fn from_env() -> Self {
        let drop_deltas = std::env::var(Self::DROP_DELTAS)
            .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_default();
        Self::drop_deltas(drop_deltas)
    }

    /// Never send the deltas that build `versions`.
    pub fn drop_deltas(versions: Vec<u64>) -> Self {
        Self {
            drop_deltas: versions,
        }
    }

    fn drops(&self, link: &Link) -> bool {
        self.drop_deltas.contains(&link.version)
    }
}

/// Counts a subscriber for as long as its stream task lives.
struct Subscribed;

impl Subscribed {
    fn new() -> Self {
        gauge!(names::WEIGHT_SUBSCRIBERS).increment(1.0);
        Self
    }
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        gauge!(names::WEIGHT_SUBSCRIBERS).decrement(1.0);
    }
}

type WeightStream = Pin<Box<dyn Stream<Item = Result<WeightMessage, Status>> + Send>>;
type Sink = mpsc::Sender<Result<WeightMessage, Status>>;

/// The weights a subscriber holds: a version of one incarnation, and the
/// CRC32 of its payload where the subscriber keeps it for deltas.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Held {
    version: u64,
    incarnation: u64,
    crc: u32,
}

impl Held {
    /// What the request says the subscriber holds; version 0 means none.
    fn from_request(req: &SubscribeRequest) -> Option<Self> {
        (req.have_version > 0).then_some(Self {
            version: req.have_version,
            incarnation: req.have_incarnation,
            crc: req.have_crc,
        })
    }

    fn of(p: &Published) -> Self {
        Self {
            version: p.version,
            incarnation: p.incarnation,
            crc: p.crc,
        }
    }
}

/// The delta links that bring a subscriber holding `held` to `p`, or
/// `None` when it is sent `p` whole: it does not take deltas, holds
/// nothing, holds weights of another incarnation, or bytes the chain was
/// not made from.
fn links_for(held: Option<Held>, takes_deltas: bool, p: &Published) -> Option<&[Arc<Link>]> {
    let h = held.filter(|h| takes_deltas && h.incarnation == p.incarnation && h.crc != 0)?;
    delta_chain::route(&p.links, h.version, h.crc)
}

/// Whether `p` goes to a subscriber holding `held`: one that holds
/// nothing, an older version, or weights of another incarnation. A
/// resumed learner reuses version numbers for different weights, so a
/// higher version of another incarnation says nothing about these.
fn wanted(held: Option<Held>, p: &Published) -> bool {
    held.is_none_or(|h| h.incarnation != p.incarnation || p.version > h.version)
}

#[tonic::async_trait]
impl WeightSource for WeightSourceService {
    type SubscribeStream = WeightStream;

    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        // The certificate's identity when there is one, not the declared id.
        let verified = tls::peer(&request).map(|p| p.id.clone());
        let req = request.into_inner();
        let mut held = Held::from_request(&req);
        let mut held_base = req.have_base;
        let takes_deltas = req.takes_deltas;
        let faults = self.faults.clone();
        let mut rx = self.hub.subscribe();
        let mut closed = self.hub.closed();
        if *closed.borrow() {
            return Err(Status::unavailable("the learner is shutting down"));
        }
        // A few messages of slack; beyond that the stream task waits for
        // this subscriber alone.
        let (tx, out) = mpsc::channel(4);
        let actor = verified.unwrap_or(req.actor_id);
        tokio::spawn(async move {
            let _counted = Subscribed::new();
            tracing::info!(%actor, ?held, "weight subscriber connected");
            loop {
                let newest = rx.borrow_and_update().clone();
                if let Some(p) = newest
                    && wanted(held, &p)
                {
                    if let Some(base) = p.base.as_ref().filter(|b| b.fingerprint != held_base) {
                        if !send(&tx, base, p.version).await {
                            break;
                        }
                        held_base = base.fingerprint;
                    }
                    let links = links_for(held, takes_deltas, &p);
                    let sent = match links {
                        Some(links) => send_links(&tx, links, &p, &faults).await,
                        None => send(&tx, &p, p.version).await,
                    };
                    if !sent {
                        break;
                    }
                    histogram!(names::WEIGHT_PUBLISH_SECONDS).record(p.at.elapsed().as_secs_f64());
                    held = Some(Held::of(&p));
                }
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { break },
                    _ = tx.closed() => break,
                    _ = closed.wait_for(|c| *c) => break,
                }
            }
            tracing::info!(%actor, "weight subscriber left");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}

/// Sends `p` whole as one update message and its chunks, as `version` (a
/// base goes out under the version of the adapters that follow it); false
/// once the subscriber has gone.
async fn send(tx: &Sink, p: &Published, version: u64) -> bool {
    let update = WeightUpdate {
        version,
        header: p.header.clone(),
        model_config_json: p.config_json.clone(),
        incarnation: p.incarnation,
        base: p.is_base(),
        base_fingerprint: p.fingerprint,
        ..Default::default()
    };
    sent("snapshot", p.payload.len());
    send_payload(tx, update, &p.payload).await
}

/// Sends each of `links` as a delta update, the last one building `p`.
async fn send_links(tx: &Sink, links: &[Arc<Link>], p: &Published, faults: &Faults) -> bool {
    for (i, link) in links.iter().enumerate() {
        if faults.drops(link) {
            tracing::warn!(version = link.version, "fault injected: delta not sent");
            continue;
        }
        let update = WeightUpdate {
            version: link.version,
            header: link.header.clone(),
            model_config_json: p.config_json.clone(),
            incarnation: p.incarnation,
            delta: true,
            delta_from: link.from_version,
            deltas_after: (links.len() - 1 - i) as u32,
            ..Default::default()
        };
        sent("delta", link.delta.len());
        if !send_payload(tx, update, &link.delta).await {
            return false;
        }
    }
    true
}

fn sent(kind: &'static str, bytes: usize) {
    counter!(names::WEIGHT_SENDS, "kind" => kind).increment(1);
    counter!(names::WEIGHT_SENT_BYTES, "kind" => kind).increment(bytes as u64);
}

/// Sends `update` with `payload` in chunks after it; false once the
/// subscriber has gone.
async fn send_payload(tx: &Sink, mut update: WeightUpdate, payload: &bytes::Bytes) -> bool {
    let chunks: Vec<_> = (0..payload.len())
        .step_by(CHUNK_BYTES)
        .map(|s| payload.slice(s..(s + CHUNK_BYTES).min(payload.len())))
        .collect();
    update.payload_len = payload.len() as u64;
    update.chunks = chunks.len() as u32;
    let messages = std::iter::once(Kind::Update(update)).chain(chunks.into_iter().map(Kind::Chunk));
    for kind in messages {
        let m = WeightMessage { kind: Some(kind) };
        if tx.send(Ok(m)).await.is_err() {
            return false;
        }
    }
    true
}

/// Serves the weight stream in plaintext on `listener` until `shutdown`
/// resolves.
pub async fn serve(
    hub: WeightHub,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    serve_with(hub, listener, ServerSecurity::Plaintext, shutdown).await
}

/// Serves the weight stream on `listener` with `security` (plaintext, or
/// mutual TLS where only actors may subscribe: see `bapo_proto::tls`)
/// until `shutdown` resolves; with the faults the environment asks for
/// ([`Faults::from_env`]).
pub async fn serve_with(
    hub: WeightHub,
    listener: TcpListener,
    security: ServerSecurity,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    serve_faulty(hub, listener, security, Faults::from_env(), shutdown).await
}

/// [`serve_with`] injecting `faults`.
pub async fn serve_faulty(
    hub: WeightHub,
    listener: TcpListener,
    security: ServerSecurity,
    faults: Faults,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (_health, health_service) =
        standard::health(&[<WeightSourceServer<WeightSourceService> as NamedService>::NAME]).await;
    let reflection = standard::reflection()?;
    // Shared limits: silent or garbage connections cannot crowd out the
    // actors (bapo_proto::transport says what each one defends against).
    let incoming = transport::guarded_with(listener, transport::Guard::default(), &security);
    transport::secured_server(&security)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(WeightSourceServer::new(WeightSourceService::new(
            hub, faults,
        )))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use bytes::Bytes;

    use super::*;

    fn published(version: u64, incarnation: u64) -> Published {
        Published {
            version,
            incarnation,
            header: Bytes::new(),
            payload: Bytes::new(),
            config_json: String::new(),
            at: Instant::now(),
            base: None,
            fingerprint: 0,
            encoding: bapo_policy::weights::Encoding::F32,
            crc: 0,
            links: Arc::new([]),
        }
    }

    #[test]
    fn deltas_go_only_to_subscribers_holding_the_bytes_the_chain_starts_from() {
        let link = |from: u64| {
            Arc::new(Link {
                from_version: from,
                from_crc: 100 + from as u32,
                version: from + 1,
                header: Bytes::new(),
                delta: Bytes::from_static(b"d"),
            })
        };
        let p = Published {
            links: vec![link(1), link(2)].into(),
            ..published(3, 7)
        };
        let held = |version, incarnation, crc| {
            Some(Held {
                version,
                incarnation,
                crc,
            })
        };
        let route = |h, takes| links_for(h, takes, &p).map(<[_]>::len);
        assert_eq!(route(held(1, 7, 101), true), Some(2));
        assert_eq!(route(held(2, 7, 102), true), Some(1));
        // Whole: no deltas taken, other bytes, another incarnation, none held.
        assert_eq!(route(held(2, 7, 102), false), None);
        assert_eq!(route(held(2, 7, 999), true), None);
        assert_eq!(route(held(2, 8, 102), true), None);
        assert_eq!(route(held(2, 7, 0), true), None);
        assert_eq!(route(None, true), None);
    }

    #[test]
    fn the_fault_hook_names_versions() {
        let f = Faults::drop_deltas(vec![3, 5]);
        let l = |version| Link {
            from_version: version - 1,
            from_crc: 0,
            version,
            header: Bytes::new(),
            delta: Bytes::new(),
        };
        assert!(f.drops(&l(3)) && f.drops(&l(5)) && !f.drops(&l(4)));
        assert!(!Faults::default().drops(&l(3)));
    }

    #[test]
    fn weights_go_to_holders_of_nothing_older_or_another_incarnation() {
        let p = published(3, 7);
        let held = |version, incarnation| {
            Some(Held {
                version,
                incarnation,
                crc: 0,
            })
        };
        assert!(wanted(None, &p));
        assert!(wanted(held(2, 7), &p));
        assert!(!wanted(held(3, 7), &p));
        assert!(!wanted(held(5, 7), &p));
        // A resumed learner: its version 3 is not the 5 the actor holds.
        assert!(wanted(held(5, 9), &p));
        assert!(wanted(held(3, 0), &p));
    }
}
