//! A learner's weight stream served on loopback for the benchmarks that
//! publish into it.

use bapo_learner::broadcast::WeightHub;
use tokio::sync::watch;

/// A learner's weight stream served on loopback (plaintext).
pub struct Served {
    pub url: String,
    /// Ends the server, and whatever else was given its receivers.
    pub stop: watch::Sender<bool>,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Serves `hub` until [`Served::stop`] fires.
pub async fn serve(hub: &WeightHub) -> anyhow::Result<Served> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut server_stop = stop_rx.clone();
    let server = tokio::spawn(bapo_learner::server::serve(
        hub.clone(),
        listener,
        async move {
            let _ = server_stop.wait_for(|s| *s).await;
        },
    ));
    Ok(Served {
        url,
        stop: stop_tx,
        server,
    })
}
