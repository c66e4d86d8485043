//! The learner's gRPC face: the weight stream (`bapo.v1.WeightSource`),
//! health checking and reflection. Thin over [`WeightHub`].

use std::{future::Future, pin::Pin, time::Duration};

use bapo_proto::{
    FILE_DESCRIPTOR_SET,
    v1::{
        SubscribeRequest, WeightMessage, WeightUpdate,
        weight_message::Kind,
        weight_source_server::{WeightSource, WeightSourceServer},
    },
};
use metrics::{gauge, histogram};
use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status, transport::Server};

use crate::{broadcast::WeightHub, metrics as names};

/// Payload bytes per chunk message: well under tonic's 4 MiB default
/// message limit, large enough that framing costs nothing.
pub const CHUNK_BYTES: usize = 1 << 20;

pub struct WeightSourceService {
    hub: WeightHub,
}

impl WeightSourceService {
    pub fn new(hub: WeightHub) -> Self {
        Self { hub }
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

#[tonic::async_trait]
impl WeightSource for WeightSourceService {
    type SubscribeStream = WeightStream;

    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let req = request.into_inner();
        let mut have = (req.have_version > 0).then_some(req.have_version);
        let mut rx = self.hub.subscribe();
        let mut closed = self.hub.closed();
        if *closed.borrow() {
            return Err(Status::unavailable("the learner is shutting down"));
        }
        // A few messages of slack; beyond that the stream task waits for
        // this subscriber alone.
        let (tx, out) = mpsc::channel(4);
        let actor = req.actor_id;
        tokio::spawn(async move {
            let _counted = Subscribed::new();
            tracing::info!(%actor, ?have, "weight subscriber connected");
            loop {
                let newest = rx.borrow_and_update().clone();
                if let Some(p) = newest
                    && have.is_none_or(|h| p.version > h)
                {
                    let chunks: Vec<_> = (0..p.payload.len())
                        .step_by(CHUNK_BYTES)
                        .map(|s| p.payload.slice(s..(s + CHUNK_BYTES).min(p.payload.len())))
                        .collect();
                    let update = WeightMessage {
                        kind: Some(Kind::Update(WeightUpdate {
                            version: p.version,
                            header: p.header.clone(),
                            payload_len: p.payload.len() as u64,
                            chunks: chunks.len() as u32,
                            model_config_json: p.config_json.clone(),
                        })),
                    };
                    if tx.send(Ok(update)).await.is_err() {
                        break;
                    }
                    for c in chunks {
                        let m = WeightMessage {
                            kind: Some(Kind::Chunk(c)),
                        };
                        if tx.send(Ok(m)).await.is_err() {
                            tracing::info!(%actor, "weight subscriber left");
                            return;
                        }
                    }
                    histogram!(names::WEIGHT_PUBLISH_SECONDS).record(p.at.elapsed().as_secs_f64());
                    have = Some(p.version);
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

/// Serves the weight stream on `listener` until `shutdown` resolves.
pub async fn serve(
    hub: WeightHub,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<WeightSourceServer<WeightSourceService>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(WeightSourceServer::new(WeightSourceService::new(hub)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
