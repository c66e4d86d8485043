//! Runs the buffer as a gRPC server: the two bapo services, standard health
//! checking and reflection, the maintenance task, and graceful shutdown.

use std::{future::Future, time::Duration};

use bapo_proto::{
    standard,
    tls::ServerSecurity,
    transport,
    v1::{batch_source_server::BatchSourceServer, rollout_sink_server::RolloutSinkServer},
};
use tokio::net::TcpListener;
use tonic::server::NamedService;

use crate::{
    Buffer,
    service::{BatchSourceService, RolloutSinkService},
};

/// How long in-flight streams get to finish after the shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `buffer` in plaintext on `listener` until `shutdown` resolves;
/// see [`serve_with`].
pub async fn serve(
    buffer: Buffer,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    serve_with(buffer, listener, ServerSecurity::Plaintext, shutdown).await
}

/// Serves `buffer` on `listener` with `security` (plaintext, or mutual TLS
/// with per-role authorization: see `bapo_proto::tls`) until `shutdown`
/// resolves, then stops accepting, releases held pushes with UNAVAILABLE,
/// lets in-flight calls finish (up to [`SHUTDOWN_GRACE`]) and flushes the
/// log.
pub async fn serve_with(
    buffer: Buffer,
    listener: TcpListener,
    security: ServerSecurity,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (health, health_service) = standard::health(&[
        <RolloutSinkServer<RolloutSinkService> as NamedService>::NAME,
        <BatchSourceServer<BatchSourceService> as NamedService>::NAME,
    ])
    .await;
    let reflection = standard::reflection()?;
    // Oversize rollouts are refused one by one by the core (naming the
    // rollout); the transport limit is only the backstop above that.
    let decode_limit = buffer
        .config()
        .max_rollout_bytes
        .saturating_mul(4)
        .max(4 << 20);
    let sink = RolloutSinkServer::new(RolloutSinkService::new(buffer.clone()))
        .max_decoding_message_size(decode_limit);
    let source = BatchSourceServer::new(BatchSourceService::new(buffer.clone()))
        .max_encoding_message_size(usize::MAX);
    let maintenance = buffer.spawn_maintenance();
    let addr = listener.local_addr()?;
    tracing::info!(%addr, tls = security.tls().is_some(), "buffer serving");

    // Shared limits: silent or garbage connections cannot crowd out the
    // actors and the learner (bapo_proto::transport says what each one
    // defends against).
    let incoming = transport::guarded_with(listener, transport::Guard::default(), &security);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = transport::secured_server(&security)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(sink)
        .add_service(source)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        res = &mut server => res?,
        () = shutdown => {
            tracing::info!("shutting down: no new streams, releasing held pushes");
            health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
            buffer.release_waiters();
            let _ = stop_tx.send(());
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut server).await {
                Ok(res) => res?,
                Err(_) => tracing::warn!("in-flight streams outlived the shutdown grace; closing anyway"),
            }
        }
    }
    drop(maintenance);
    buffer.close().await?;
    tracing::info!("buffer stopped; log flushed");
    Ok(())
}
