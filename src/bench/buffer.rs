//! `bapo bench buffer`: the real buffer server over loopback gRPC, with P
//! concurrent pushers of 1024-token rollouts in groups of 8 and a learner
//! sampling batches at the same time; then the same payload through Redis
//! Streams (the queue a user would otherwise pick), side by side.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use bapo_buffer::{Buffer, BufferConfig};
use bapo_proto::v1::{
    SampleRequest, StatsRequest, VersionReport, batch_source_client::BatchSourceClient,
    rollout_sink_client::RolloutSinkClient,
};
use clap::Args;
use prost::Message;
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

use super::{
    latency::Latencies,
    redis_streams,
    workload::{Payload, Phase, Workload},
};

#[derive(Debug, Args)]
pub struct BufferBenchArgs {
    /// Concurrent pushers (one connection each).
    #[arg(long, default_value_t = 4)]
    pub pushers: usize,
    /// Seconds per measured phase.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Response tokens per rollout.
    #[arg(long, default_value_t = 1024)]
    pub tokens: usize,
    /// Rollouts per group.
    #[arg(long, default_value_t = 8)]
    pub group_size: u32,
    /// Groups per learner batch.
    #[arg(long, default_value_t = 8)]
    pub batch_groups: u32,
    /// Buffer capacity in groups. The default holds a whole phase, so the
    /// ingest rate is not capped by the learner (Redis Streams has no bound
    /// either); set it low to measure backpressure instead.
    #[arg(long, default_value_t = 1 << 20)]
    pub capacity_groups: u64,
    /// Skip the Redis Streams reference.
    #[arg(long)]
    pub no_redis: bool,
    /// The redis-server binary (Debian package `redis-server`; see
    /// scripts/install-bench-deps.sh).
    #[arg(long, default_value = "redis-server")]
    pub redis_server: PathBuf,
}

impl BufferBenchArgs {
    fn workload(&self) -> Workload {
        Workload {
            pushers: self.pushers,
            seconds: self.seconds,
            tokens: self.tokens,
            group_size: self.group_size,
            batch_groups: self.batch_groups,
        }
    }
}

/// One HTTP/2 connection with the windows bapo's clients use.
pub(super) async fn connect(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .initial_stream_window_size(bapo_proto::transport::STREAM_WINDOW)
        .initial_connection_window_size(bapo_proto::transport::CONNECTION_WINDOW)
        .connect()
        .await?)
}

/// What every pusher of one phase does.
#[derive(Clone)]
struct PushPlan {
    addr: SocketAddr,
    tokens: usize,
    k: u32,
    deadline: Instant,
    /// One group per `pace` when set; as fast as acks come back otherwise.
    pace: Option<Duration>,
    /// The learner's version, stamped on every token.
    version: Arc<AtomicU64>,
    phase: String,
}

/// Pushes groups until the deadline, one push stream per group.
async fn pusher(plan: PushPlan, id: usize) -> anyhow::Result<(u64, Latencies)> {
    let PushPlan {
        addr,
        tokens,
        k,
        deadline,
        pace,
        version,
        phase,
    } = plan;
    let mut client =
        RolloutSinkClient::new(connect(addr).await?).max_encoding_message_size(usize::MAX);
    let payload = Payload::new(tokens, id as u64);
    let mut lat = Latencies::new();
    let mut sent = 0u64;
    let mut ticker = pace.map(|p| {
        let mut t = tokio::time::interval(p);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut g = 0u64;
    while Instant::now() < deadline {
        if let Some(t) = &mut ticker {
            t.tick().await;
        }
        let msgs = payload.group(&format!("{phase}-p{id}-g{g}"), k, version.load(Relaxed), 0);
        let t0 = Instant::now();
        let ack = client.push(tokio_stream::iter(msgs)).await?.into_inner();
        lat.record(t0.elapsed());
        if ack.accepted != k as u64 {
            bail!("push not fully accepted: {ack:?}");
        }
        sent += k as u64;
        g += 1;
    }
    Ok((sent, lat))
}

pub(super) async fn batch_client(addr: SocketAddr) -> anyhow::Result<BatchSourceClient<Channel>> {
    Ok(BatchSourceClient::new(connect(addr).await?).max_decoding_message_size(usize::MAX))
}

/// Takes up to `groups` ready groups (waiting up to `timeout_ms`); returns
/// the rollouts received.
async fn take_batch(
    client: &mut BatchSourceClient<Channel>,
    groups: u32,
    timeout_ms: u32,
) -> anyhow::Result<u64> {
    let batch = client
        .sample(SampleRequest {
            num_groups: groups,
            timeout_ms,
            allow_partial: true,
        })
        .await?
        .into_inner();
    Ok(batch.groups.iter().map(|g| g.rollouts.len() as u64).sum())
}

/// Samples batches and reports a new version after each, until the pushers
/// are done (a pusher held by backpressure at its deadline needs the learner
/// to make room).
async fn learner(
    addr: SocketAddr,
    batch_groups: u32,
    done: Arc<AtomicBool>,
    version: Arc<AtomicU64>,
) -> anyhow::Result<u64> {
    let mut client = batch_client(addr).await?;
    let mut rollouts = 0u64;
    while !done.load(Relaxed) {
        let taken = take_batch(&mut client, batch_groups, 50).await?;
        if taken == 0 {
            continue;
        }
        rollouts += taken;
        let v = version.load(Relaxed) + 1;
        // No lineage: a learner that does not track incarnations.
        client
            .report_version(VersionReport {
                version: v,
                ..Default::default()
            })
            .await?;
        version.store(v, Relaxed);
    }
    Ok(rollouts)
}

async fn bapo_phase(
    args: &BufferBenchArgs,
    addr: SocketAddr,
    pace: Option<Duration>,
    version: Arc<AtomicU64>,
    name: &str,
) -> anyhow::Result<Phase> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.seconds);
    let done = Arc::new(AtomicBool::new(false));
    let learner = tokio::spawn(learner(
        addr,
        args.batch_groups,
        done.clone(),
        version.clone(),
    ));
    let plan = PushPlan {
        addr,
        tokens: args.tokens,
        k: args.group_size,
        deadline,
        pace,
        version: version.clone(),
        phase: name.to_string(),
    };
    let tasks: Vec<_> = (0..args.pushers)
        .map(|id| tokio::spawn(pusher(plan.clone(), id)))
        .collect();
    let mut acks = Latencies::new();
    let mut rollouts = 0;
    for t in tasks {
        let (n, lat) = t.await??;
        rollouts += n;
        acks.merge(&lat);
    }
    let seconds = start.elapsed().as_secs_f64();
    done.store(true, Relaxed);
    let consumed_rollouts = learner.await??;
    Ok(Phase {
        rollouts,
        seconds,
        acks,
        consumed_rollouts,
    })
}

pub async fn run(args: BufferBenchArgs) -> anyhow::Result<()> {
    if args.pushers == 0 || args.tokens == 0 || args.group_size == 0 {
        bail!("--pushers, --tokens and --group-size must be positive");
    }
    // Record metrics as `bapo buffer` does, so their cost is measured too.
    crate::telemetry::serve_metrics(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    bapo_buffer::metrics::describe();
    let (addr, stop_tx, server) = start_buffer(&args).await?;

    let sample = Payload::new(args.tokens, 0);
    let wire = sample.group("x", 1, 0, 0)[0].encoded_len();
    println!(
        "bapo bench buffer: {} pushers, {}-token rollouts ({:.1} KiB raw payload, {:.1} KiB on the wire), groups of {}, learner sampling {} groups per batch, {} s per phase, {} cores",
        args.pushers,
        args.tokens,
        sample.raw_bytes() as f64 / 1024.0,
        wire as f64 / 1024.0,
        args.group_size,
        args.batch_groups,
        args.seconds,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let version = Arc::new(AtomicU64::new(0));
    let peak = bapo_phase(&args, addr, None, version.clone(), "peak").await?;
    // Half of peak: each pusher sends one group per interval.
    let groups_per_s = peak.rate() / 2.0 / args.group_size as f64 / args.pushers as f64;
    let pace = Duration::from_secs_f64(1.0 / groups_per_s.max(1e-3));
    let half = bapo_phase(&args, addr, Some(pace), version.clone(), "half").await?;
    let drain = drain(addr, args.batch_groups).await?;
    let held = held_bytes_per_payload_byte(&args, addr, &sample).await?;
    let _ = stop_tx.send(());
    server.await??;

    let redis = redis_reference(&args).await?;
    print_results(
        &args,
        &Results {
            raw: sample.raw_bytes() as f64,
            wire: wire as f64,
            peak,
            half,
            redis,
            drain,
            held,
        },
    );
    Ok(())
}

/// The buffer server on a free loopback port: its address, the sender that
/// stops it, and its task.
async fn start_buffer(
    args: &BufferBenchArgs,
) -> anyhow::Result<(
    SocketAddr,
    oneshot::Sender<()>,
    JoinHandle<anyhow::Result<()>>,
)> {
    let cfg = BufferConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        group_size: args.group_size,
        min_group_size: 1,
        batch_groups: args.batch_groups,
        // The bench measures the data path, not the staleness bound.
        max_staleness: u32::MAX as u64,
        capacity_groups: args.capacity_groups,
        capacity_bytes: 16 << 30,
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let buffer = Buffer::open(cfg)?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(bapo_buffer::server::serve(buffer, listener, async {
        let _ = stop_rx.await;
    }));
    Ok((addr, stop_tx, server))
}

/// The Redis Streams peak phase, or `None` when skipped or not installed.
async fn redis_reference(args: &BufferBenchArgs) -> anyhow::Result<Option<Phase>> {
    if args.no_redis {
        return Ok(None);
    }
    match redis_streams::RedisServer::start(&args.redis_server).await? {
        Some(server) => Ok(Some(redis_streams::run(&server, &args.workload()).await?)),
        None => {
            println!(
                "redis-server not found at {:?}: Redis Streams reference skipped (install it with scripts/install-bench-deps.sh)",
                args.redis_server
            );
            Ok(None)
        }
    }
}

/// Everything the bench measured.
struct Results {
    /// Raw payload and wire bytes per rollout.
    raw: f64,
    wire: f64,
    peak: Phase,
    half: Phase,
    redis: Option<Phase>,
    /// Rollouts drained by the learner alone, and its seconds.
    drain: (u64, f64),
    held: f64,
}

fn print_results(args: &BufferBenchArgs, r: &Results) {
    let raw = r.raw;
    println!();
    println!(
        "{:<26} {:>11} {:>10} {:>11} {:>11} {:>12}",
        "", "rollouts/s", "MB/s raw", "p50 ack ms", "p99 ack ms", "consumed/s"
    );
    let row = |name: &str, p: &Phase| {
        println!(
            "{:<26} {:>11.0} {:>10.1} {:>11.2} {:>11.2} {:>12.0}",
            name,
            p.rate(),
            p.rate() * raw / 1e6,
            p.acks.ms(0.5),
            p.acks.ms(0.99),
            p.consumed_rollouts as f64 / p.seconds
        );
    };
    row("bapo buffer, peak", &r.peak);
    row("bapo buffer, 50% of peak", &r.half);
    if let Some(redis) = &r.redis {
        row("redis streams, peak", redis);
    }
    println!();
    if let Some(redis) = &r.redis {
        println!(
            "bapo / redis streams rollouts/s at {} producers: {:.2}x",
            args.pushers,
            r.peak.rate() / redis.rate()
        );
    }
    println!(
        "ingest: {:.2} GB/s raw payload ({:.2} GB/s on the wire)",
        r.peak.rate() * raw / 1e9,
        r.peak.rate() * r.wire / 1e9
    );
    let (drained, drain_s) = r.drain;
    if drained >= 1000 {
        println!(
            "learner sampling alone (the backlog of {} rollouts the phases left): {:.0} rollouts/s, {:.2} GB/s raw",
            drained,
            drained as f64 / drain_s,
            drained as f64 * raw / drain_s / 1e9
        );
    } else {
        println!(
            "the learner kept up with ingest: {} rollouts left to drain",
            drained
        );
    }
    println!("held bytes per raw payload byte: {:.3}", r.held);
}

/// Samples the backlog the phases left, alone: the learner side's capacity
/// when it does not share the CPU with the pushers. Also gives the held-bytes
/// probe an empty buffer.
async fn drain(addr: SocketAddr, batch_groups: u32) -> anyhow::Result<(u64, f64)> {
    let mut client = batch_client(addr).await?;
    let start = Instant::now();
    let mut rollouts = 0u64;
    loop {
        let taken = take_batch(&mut client, batch_groups, 0).await?;
        if taken == 0 {
            break;
        }
        rollouts += taken;
    }
    Ok((rollouts, start.elapsed().as_secs_f64()))
}

/// Pushes a known amount with the learner stopped and compares the buffer's
/// accounted heap bytes with the raw payload.
async fn held_bytes_per_payload_byte(
    args: &BufferBenchArgs,
    addr: SocketAddr,
    sample: &Payload,
) -> anyhow::Result<f64> {
    let mut stats = batch_client(addr).await?;
    let before = stats.get_stats(StatsRequest {}).await?.into_inner();
    let mut client =
        RolloutSinkClient::new(connect(addr).await?).max_encoding_message_size(usize::MAX);
    let groups = 32;
    let version = before.learner_version;
    for g in 0..groups {
        let msgs = sample.group(&format!("held-g{g}"), args.group_size, version, 0);
        client
            .push(tokio_stream::iter(msgs))
            .await
            .context("pushing the held-bytes probe")?;
    }
    let after = stats.get_stats(StatsRequest {}).await?.into_inner();
    let payload = (groups * args.group_size as usize * sample.raw_bytes()) as f64;
    Ok((after.bytes_held - before.bytes_held) as f64 / payload)
}
