//! `bapo bench broadcast`: the wall time of one weight update from the
//! learner's publish to every subscriber holding the new policy, over the
//! real weight stream (gRPC on loopback, plaintext) into real actor
//! subscriptions (verify, decode, load into a model). 1 and 4
//! subscribers, f32 beside bf16, measured in the same run on the same
//! weights. What `bapo bench weights` leaves out: the transfer, and
//! several actors decoding at once on the same cores.

use std::{sync::Arc, time::Instant};

use bapo_actor::subscription::{self, Versioned};
use bapo_learner::broadcast::WeightHub;
use bapo_policy::{Precision, burn::prelude::*, model::Transformer, weights::Encoding};
use clap::Args;
use tokio::sync::watch;

#[derive(Debug, Args)]
pub struct BroadcastBenchArgs {
    /// Models to measure: preset names or paths to an HF `config.json`.
    #[arg(long, default_value = "small")]
    pub configs: String,
    /// Subscriber counts.
    #[arg(long, default_value = "1,4")]
    pub subscribers: String,
    /// Timed updates per setting (the median is shown).
    #[arg(long, default_value_t = 3)]
    pub updates: u64,
}

type Cell = watch::Receiver<Option<Arc<Versioned>>>;

/// Waits until every cell holds `version`.
async fn all_at(cells: &mut [Cell], version: u64) -> anyhow::Result<()> {
    for c in cells {
        c.wait_for(|v| v.as_ref().is_some_and(|v| v.version >= version))
            .await?;
    }
    Ok(())
}

/// Seconds from publish to every subscriber loaded, per timed update, and
/// the encode share of it.
async fn measure(
    model: &Transformer,
    config: &bapo_policy::ModelConfig,
    subscribers: usize,
    encoding: Encoding,
    updates: u64,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, usize)> {
    let hub = WeightHub::new();
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
    let mut cells = Vec::new();
    for i in 0..subscribers {
        let (tx, rx) = watch::channel(None);
        cells.push(rx);
        tokio::spawn(subscription::follow(
            url.clone(),
            None,
            format!("bench-{i}"),
            Device::flex(),
            Precision::F32,
            tx,
            stop_rx.clone(),
        ));
    }
    // An untimed first update: connections up, buffers warm.
    hub.publish_as(model, config, 1, encoding)?;
    all_at(&mut cells, 1).await?;
    let (mut total, mut encode, mut bytes) = (Vec::new(), Vec::new(), 0);
    for v in 2..2 + updates {
        let t0 = Instant::now();
        let p = hub.publish_as(model, config, v, encoding)?;
        encode.push(t0.elapsed().as_secs_f64());
        bytes = p.payload.len();
        all_at(&mut cells, v).await?;
        total.push(t0.elapsed().as_secs_f64());
    }
    let _ = stop_tx.send(true);
    let _ = server.await;
    Ok((total, encode, bytes))
}

pub async fn run(a: BroadcastBenchArgs) -> anyhow::Result<()> {
    let counts: Vec<usize> = a
        .subscribers
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(a.updates > 0, "--updates must be at least 1");
    println!(
        "bapo bench broadcast: publish -> every subscriber loaded, loopback gRPC, {} threads",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    for name in a.configs.split(',') {
        let config = super::model_config(name)?;
        let model = Transformer::init(&config, &Device::flex());
        println!(
            "\n== {name}: {:.2} M parameters ==\n{:<8} {:>12} {:>14} {:>12} {:>14}",
            config.num_params() as f64 / 1e6,
            "dtype",
            "subscribers",
            "MB/update",
            "encode s",
            "to all s"
        );
        for encoding in [Encoding::F32, Encoding::Bf16] {
            for &n in &counts {
                let (total, encode, bytes) =
                    measure(&model, &config, n, encoding, a.updates).await?;
                println!(
                    "{:<8} {:>12} {:>14.1} {:>12.2} {:>14.2}",
                    encoding.name(),
                    n,
                    bytes as f64 / 1e6,
                    super::median(encode),
                    super::median(total)
                );
            }
        }
    }
    Ok(())
}
