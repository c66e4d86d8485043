//! `bapo bench actors`: many simulated actors against one buffer process
//! for minutes, the load of a real deployment rather than a peak.
//!
//! The buffer is this binary started as `bapo buffer` on a loopback port, a
//! separate process, so its resident memory (`VmRSS`) is the buffer's
//! alone. Each simulated actor is a task with its own gRPC connection, as
//! each real actor is a process with one: it leases a group id, renews the
//! lease once or twice while it "generates" (as a slow actor does at half
//! the TTL), then pushes the group's rollouts in one stream and waits for
//! the ack; now and then it gives the lease back instead, as an actor whose
//! generation failed does. A simulated learner samples full batches and
//! reports one version per batch, so the staleness bound moves as it does
//! under the real learner.
//!
//! Measured: ack latency (push stream opened to `PushAck` received) and
//! lease latency (first ask to grant), first for one actor alone (the
//! reference), then for all of them; the buffer's RSS and `GetStats` every
//! few seconds; and at the end the books: every group a `PushAck` accepted
//! was handed to the learner, or is still held (drained and matched by id),
//! or was evicted by a documented rule.

use std::{
    collections::HashSet,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use bapo_proto::v1::{
    self, Incarnation, LeaseRequest, SampleRequest, Stats, StatsRequest, VersionReport,
    batch_source_client::BatchSourceClient, rollout_sink_client::RolloutSinkClient,
};
use clap::Args;
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tokio::process::{Child, Command};
use tonic::{Code, transport::Channel};

use crate::local::supervise::{die_with_parent, free_addr};

use super::{
    buffer::{batch_client, connect},
    latency::Latencies,
    soak::{figures, rss_mib},
    workload::Payload,
};

#[derive(Debug, Args)]
pub struct ActorsBenchArgs {
    /// Simulated actors, each a task with its own connection.
    #[arg(long, default_value_t = 256)]
    pub actors: usize,
    /// Minutes of the many-actor phase that are measured (after the
    /// warm-up).
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seconds of the many-actor phase before measuring (connections,
    /// allocator and the buffer's indexes fill).
    #[arg(long, default_value_t = 30.0)]
    pub warmup_s: f64,
    /// Seconds of the one-actor reference phase, at the same per-actor
    /// rate.
    #[arg(long, default_value_t = 30.0)]
    pub reference_s: f64,
    /// Seconds between samples of the buffer's memory and stats.
    #[arg(long, default_value_t = 10.0)]
    pub every_s: f64,
    /// Each actor starts one group per interval (lease, generate, push).
    #[arg(long, default_value_t = 1000)]
    pub group_interval_ms: u64,
    /// Simulated generation: how long a lease is held before the push; the
    /// renewals fall inside it.
    #[arg(long, default_value_t = 100)]
    pub generate_ms: u64,
    /// Rollouts per group.
    #[arg(long, default_value_t = 8)]
    pub group_size: u32,
    /// Response tokens per rollout (the prompt has 64).
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Groups per learner batch (the buffer's and the learner's).
    #[arg(long, default_value_t = 32)]
    pub batch_groups: u32,
    /// The buffer's staleness bound.
    #[arg(long, default_value_t = 4)]
    pub max_staleness: u64,
    /// Share of leases given back instead of pushed.
    #[arg(long, default_value_t = 0.05)]
    pub release_fraction: f64,
    /// Directory for samples.csv, the buffer's config and log; a kept
    /// temporary directory by default.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl ActorsBenchArgs {
    fn check(&self) -> anyhow::Result<()> {
        ensure!(
            self.actors > 0 && self.group_size > 0 && self.tokens > 0 && self.batch_groups > 0,
            "--actors, --group-size, --tokens and --batch-groups must be positive"
        );
        ensure!(
            self.minutes > 0.0 && self.warmup_s >= 0.0 && self.reference_s >= 0.0,
            "--minutes must be positive, --warmup-s and --reference-s not negative"
        );
        ensure!(
            self.every_s > 0.0 && self.group_interval_ms > 0,
            "--every-s and --group-interval-ms must be positive"
        );
        ensure!(
            (0.0..=1.0).contains(&self.release_fraction),
            "--release-fraction must be in [0, 1]"
        );
        Ok(())
    }

    /// Groups per second all actors start: the offered load.
    fn offered_groups_per_s(&self, actors: usize) -> f64 {
        actors as f64 * 1000.0 / self.group_interval_ms as f64
    }
}

/// The buffer's `[buffer]` table: the defaults of `bapo buffer` (in
/// memory, FIFO, `when_full = "block"`, the default dedup window and lease
/// TTL) with the bench's group and batch shape. Nothing in it drops an
/// acknowledged group except the staleness bound's eviction, which leases
/// should keep at zero; the books count it if not.
fn buffer_config(args: &ActorsBenchArgs) -> String {
    format!(
        "[buffer]\ngroup_size = {}\nbatch_groups = {}\nmax_staleness = {}\n\
         when_full = \"block\"\nsampling = \"fifo\"\n",
        args.group_size, args.batch_groups, args.max_staleness
    )
}

/// `bapo buffer` as a child process: a separate address space, so its RSS
/// is the buffer's alone.
struct BufferProcess {
    child: Child,
    pid: u32,
    addr: SocketAddr,
}

impl BufferProcess {
    /// Starts the buffer with `config` on a free loopback port (plaintext:
    /// loopback needs no TLS) and waits until it answers `GetStats`.
    async fn start(config: &Path, out: &Path) -> anyhow::Result<Self> {
        let addr = free_addr()?;
        let metrics = free_addr()?;
        let exe = std::env::current_exe().context("locating the bapo binary")?;
        let log = std::fs::File::create(out.join("buffer.log"))?;
        let mut cmd = Command::new(exe);
        cmd.arg("buffer")
            .arg("--config")
            .arg(config)
            .args(["--listen", &addr.to_string()])
            // Metrics on, as in a deployment: their cost is part of the
            // latency.
            .args(["--metrics-listen", &metrics.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .env("RUST_LOG", "warn")
            .kill_on_drop(true);
        // A killed bench leaves no buffer behind on its port.
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().context("starting `bapo buffer`")?;
        let pid = child.id().context("the buffer exited at once")?;
        wait_ready(&mut child, addr).await?;
        Ok(Self { child, pid, addr })
    }

    /// SIGTERM (the buffer stops gracefully), then SIGKILL after 30 s.
    /// Returns whether it exited successfully.
    async fn stop(mut self) -> bool {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGTERM);
        }
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(Ok(status)) => status.success(),
            _ => {
                let _ = self.child.kill().await;
                false
            }
        }
    }
}

/// Polls `GetStats` until the buffer answers (30 s at most), failing at
/// once if it exits.
async fn wait_ready(child: &mut Child, addr: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the buffer exited with {status} before serving (see buffer.log)");
        }
        if let Ok(mut c) = batch_client(addr).await
            && c.get_stats(StatsRequest {}).await.is_ok()
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the buffer did not answer on {addr} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counters the actors and the learner bump and the sampler reads.
#[derive(Default)]
struct Progress {
    /// Groups a `PushAck` accepted in full.
    acked: AtomicU64,
    /// Groups the learner received.
    sampled: AtomicU64,
    /// Which phase runs: see [`PHASES`].
    phase: AtomicU8,
}

/// Phase labels of the samples: before any load, the one-actor
/// reference, the many-actor warm-up and measured window, after.
const PHASES: [&str; 5] = ["idle", "reference", "warmup", "measure", "end"];

/// What every actor of one phase does.
struct ActorPlan {
    addr: SocketAddr,
    payload: Payload,
    k: u32,
    interval: Duration,
    generate: Duration,
    release_fraction: f64,
    start: tokio::time::Instant,
    /// Latencies before this instant are not recorded (the warm-up).
    measure_from: Instant,
    /// No group is started after it.
    deadline: Instant,
    /// Group ids are `<prefix><actor>-g<n>`: unique across phases.
    prefix: &'static str,
    actors: usize,
    progress: Arc<Progress>,
}

/// One actor's (then one phase's, merged) latencies and books.
struct ActorReport {
    ack: Latencies,
    lease: Latencies,
    renew: Latencies,
    /// Recorded (measured) acks, leases and renewals: the histograms'
    /// counts.
    acks_measured: u64,
    leases_measured: u64,
    renewals_measured: u64,
    /// "Not granted, ask again" answers (backpressure).
    lease_refusals: u64,
    /// Renewals answered "not granted" (the lease had lapsed).
    renewals_lapsed: u64,
    released: u64,
    /// Groups acknowledged as accepted in full, by id.
    acked: Vec<String>,
    /// Pushes that failed or were not accepted in full: id and reason.
    failed: Vec<(String, String)>,
}

impl ActorReport {
    fn new() -> Self {
        Self {
            ack: Latencies::new(),
            lease: Latencies::new(),
            renew: Latencies::new(),
            acks_measured: 0,
            leases_measured: 0,
            renewals_measured: 0,
            lease_refusals: 0,
            renewals_lapsed: 0,
            released: 0,
            acked: Vec::new(),
            failed: Vec::new(),
        }
    }

    fn merge(&mut self, o: ActorReport) {
        self.ack.merge(&o.ack);
        self.lease.merge(&o.lease);
        self.renew.merge(&o.renew);
        self.acks_measured += o.acks_measured;
        self.leases_measured += o.leases_measured;
        self.renewals_measured += o.renewals_measured;
        self.lease_refusals += o.lease_refusals;
        self.renewals_lapsed += o.renewals_lapsed;
        self.released += o.released;
        self.acked.extend(o.acked);
        self.failed.extend(o.failed);
    }
}

/// The longest a lease call may wait (the buffer answers "not granted"
/// within its `lease_wait_ms`, and within this deadline).
const LEASE_TIMEOUT: Duration = Duration::from_secs(30);

async fn ask_lease(
    client: &mut RolloutSinkClient<Channel>,
    group_id: &str,
) -> Result<v1::LeaseReply, tonic::Status> {
    let mut req = tonic::Request::new(LeaseRequest {
        group_id: group_id.to_string(),
    });
    req.set_timeout(LEASE_TIMEOUT);
    Ok(client.lease(req).await?.into_inner())
}

/// Asks until granted, as the real actor does; records the time from the
/// first ask to the grant.
async fn lease(
    client: &mut RolloutSinkClient<Channel>,
    group_id: &str,
    measured: bool,
    report: &mut ActorReport,
) -> anyhow::Result<v1::LeaseReply> {
    let t0 = Instant::now();
    loop {
        let reply = ask_lease(client, group_id)
            .await
            .with_context(|| format!("lease on {group_id}"))?;
        if reply.granted {
            if measured {
                report.lease.record(t0.elapsed());
                report.leases_measured += 1;
            }
            return Ok(reply);
        }
        report.lease_refusals += 1;
    }
}

/// Holds the lease for the generation time, renewing it `renewals` times
/// evenly inside it.
async fn generate(
    client: &mut RolloutSinkClient<Channel>,
    group_id: &str,
    plan: &ActorPlan,
    renewals: u32,
    measured: bool,
    report: &mut ActorReport,
) -> anyhow::Result<()> {
    let step = plan.generate / (renewals + 1);
    for _ in 0..renewals {
        tokio::time::sleep(step).await;
        let t0 = Instant::now();
        let reply = ask_lease(client, group_id)
            .await
            .with_context(|| format!("renewing the lease on {group_id}"))?;
        if measured {
            report.renew.record(t0.elapsed());
            report.renewals_measured += 1;
        }
        if !reply.granted {
            report.renewals_lapsed += 1;
        }
    }
    tokio::time::sleep(step).await;
    Ok(())
}

/// Pushes the group in one stream and checks the ack: all `k` accepted.
async fn push(
    client: &mut RolloutSinkClient<Channel>,
    group_id: &str,
    grant: &v1::LeaseReply,
    plan: &ActorPlan,
    measured: bool,
    report: &mut ActorReport,
) {
    let msgs = plan.payload.group(
        group_id,
        plan.k,
        grant.learner_version,
        grant.learner_incarnation,
    );
    let t0 = Instant::now();
    let ack = client.push(tokio_stream::iter(msgs)).await;
    let elapsed = t0.elapsed();
    match ack.map(|a| a.into_inner()) {
        Ok(a) if a.accepted == plan.k as u64 && a.rejected.is_empty() => {
            if measured {
                report.ack.record(elapsed);
                report.acks_measured += 1;
            }
            report.acked.push(group_id.to_string());
            plan.progress.acked.fetch_add(1, Relaxed);
        }
        Ok(a) => report.failed.push((
            group_id.to_string(),
            format!(
                "accepted {} of {}, {} duplicates, rejected {:?}",
                a.accepted, plan.k, a.duplicates, a.rejected
            ),
        )),
        Err(s) => report.failed.push((
            group_id.to_string(),
            format!("{}: {}", s.code(), s.message()),
        )),
    }
}

/// Gives the lease back, as an actor whose generation failed does.
async fn release(
    client: &mut RolloutSinkClient<Channel>,
    group_id: &str,
    report: &mut ActorReport,
) -> anyhow::Result<()> {
    let reply = client
        .release_lease(LeaseRequest {
            group_id: group_id.to_string(),
        })
        .await
        .with_context(|| format!("releasing the lease on {group_id}"))?
        .into_inner();
    ensure!(reply.released, "the lease on {group_id} was not held");
    report.released += 1;
    Ok(())
}

/// One actor: a group per interval (staggered across actors so they do
/// not all start together) until the deadline.
async fn actor(plan: Arc<ActorPlan>, id: usize) -> anyhow::Result<ActorReport> {
    let mut client = RolloutSinkClient::new(connect(plan.addr).await?);
    let mut rng = SmallRng::seed_from_u64(id as u64);
    let offset = plan.interval.mul_f64(id as f64 / plan.actors as f64);
    let mut ticker = tokio::time::interval_at(plan.start + offset, plan.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut report = ActorReport::new();
    for n in 0u64.. {
        ticker.tick().await;
        let now = Instant::now();
        if now >= plan.deadline {
            break;
        }
        let measured = now >= plan.measure_from;
        let group_id = format!("{}{id}-g{n}", plan.prefix);
        let grant = lease(&mut client, &group_id, measured, &mut report).await?;
        let renewals = rng.random_range(1..=2);
        generate(
            &mut client,
            &group_id,
            &plan,
            renewals,
            measured,
            &mut report,
        )
        .await?;
        if rng.random_bool(plan.release_fraction) {
            release(&mut client, &group_id, &mut report).await?;
        } else {
            push(&mut client, &group_id, &grant, &plan, measured, &mut report).await;
        }
    }
    Ok(report)
}

/// Runs `plan.actors` actors to the plan's deadline and merges their
/// reports.
async fn phase(plan: ActorPlan) -> anyhow::Result<ActorReport> {
    let plan = Arc::new(plan);
    let tasks: Vec<_> = (0..plan.actors)
        .map(|id| tokio::spawn(actor(plan.clone(), id)))
        .collect();
    let mut report = ActorReport::new();
    for t in tasks {
        report.merge(t.await??);
    }
    Ok(report)
}

/// What the simulated learner received.
struct LearnerReport {
    /// Group ids handed out, in order (a FIFO buffer hands each out once).
    sampled: Vec<String>,
    version: u64,
    evicted_stale: u64,
}

/// Samples full batches and reports one version per batch with a lineage
/// of one incarnation, as the real learner does (the staleness bound
/// counts one batch per version: reporting less often would close it),
/// until `stop`. A batch not full within a second is not handed out;
/// asking again costs nothing.
async fn learner(
    addr: SocketAddr,
    batch_groups: u32,
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
) -> anyhow::Result<LearnerReport> {
    let mut client = batch_client(addr).await?;
    let incarnation = Incarnation {
        id: rand::random::<u64>() | 1,
        first_version: 0,
    };
    let mut report = LearnerReport {
        sampled: Vec::new(),
        version: 0,
        evicted_stale: 0,
    };
    while !stop.load(Relaxed) {
        let batch = client
            .sample(SampleRequest {
                num_groups: batch_groups,
                timeout_ms: 1000,
                allow_partial: false,
            })
            .await;
        let batch = match batch {
            Ok(b) => b.into_inner(),
            Err(s) if s.code() == Code::DeadlineExceeded => continue,
            Err(s) => bail!("learner sample: {}: {}", s.code(), s.message()),
        };
        progress
            .sampled
            .fetch_add(batch.groups.len() as u64, Relaxed);
        report
            .sampled
            .extend(batch.groups.into_iter().map(|g| g.group_id));
        report.version += 1;
        let ack = client
            .report_version(VersionReport {
                version: report.version,
                lineage: vec![incarnation],
                groups_trained: report.sampled.len() as u64,
                batch_groups,
            })
            .await
            .context("learner version report")?
            .into_inner();
        report.evicted_stale += ack.evicted_stale;
    }
    Ok(report)
}

/// Takes every group still ready, by id, once the actors and the learner
/// have stopped: the "still held" side of the books, matched by id.
async fn drain(addr: SocketAddr, batch_groups: u32) -> anyhow::Result<Vec<String>> {
    let mut client = batch_client(addr).await?;
    let mut ids = Vec::new();
    loop {
        let batch = client
            .sample(SampleRequest {
                num_groups: batch_groups,
                timeout_ms: 0,
                allow_partial: true,
            })
            .await
            .context("draining the buffer")?
            .into_inner();
        if batch.groups.is_empty() {
            return Ok(ids);
        }
        ids.extend(batch.groups.into_iter().map(|g| g.group_id));
    }
}

/// One sample of the buffer process and the run's progress.
struct Sample {
    t: f64,
    phase: &'static str,
    rss_mib: Option<f64>,
    /// CPU of the buffer and of this process (the actors and the learner)
    /// since the previous sample, in cores.
    buffer_cpu: Option<f64>,
    bench_cpu: Option<f64>,
    acked: u64,
    sampled: u64,
    stats: Option<Stats>,
}

/// User + system CPU seconds of process `pid` so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), in ")".
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf reads a constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks > 0.0).then(|| (utime + stime) / ticks)
}

/// Reads the buffer process and the run's progress into [`Sample`]s.
struct Sampler {
    client: BatchSourceClient<Channel>,
    pid: u32,
    start: Instant,
    /// When the previous sample was taken, and the CPU seconds then of the
    /// buffer and of this process.
    last: (Instant, Option<f64>, Option<f64>),
    progress: Arc<Progress>,
    samples: Vec<Sample>,
}

impl Sampler {
    async fn new(pid: u32, addr: SocketAddr, progress: Arc<Progress>) -> anyhow::Result<Self> {
        let start = Instant::now();
        Ok(Self {
            client: batch_client(addr).await?,
            pid,
            start,
            last: (start, cpu_seconds(pid), cpu_seconds(std::process::id())),
            progress,
            samples: Vec::new(),
        })
    }

    /// One sample now, with a progress line on stderr.
    async fn take(&mut self) {
        let now = Instant::now();
        let cpu = (cpu_seconds(self.pid), cpu_seconds(std::process::id()));
        let dt = now.duration_since(self.last.0).as_secs_f64().max(1e-9);
        let rate = |a: Option<f64>, b: Option<f64>| Some((a? - b?) / dt);
        let stats = self.client.get_stats(StatsRequest {}).await.ok();
        let s = Sample {
            t: self.start.elapsed().as_secs_f64(),
            phase: PHASES[self.progress.phase.load(Relaxed) as usize % PHASES.len()],
            rss_mib: rss_mib(self.pid),
            buffer_cpu: rate(cpu.0, self.last.1),
            bench_cpu: rate(cpu.1, self.last.2),
            acked: self.progress.acked.load(Relaxed),
            sampled: self.progress.sampled.load(Relaxed),
            stats: stats.map(|s| s.into_inner()),
        };
        self.last = (now, cpu.0, cpu.1);
        let st = s.stats.clone().unwrap_or_default();
        eprintln!(
            "{:>6.0} s  {:<9}  buffer rss {:>6.1} MiB  acked {:>7}  sampled {:>7}  held {:>4}  leases {:>4}",
            s.t,
            s.phase,
            s.rss_mib.unwrap_or(f64::NAN),
            s.acked,
            s.sampled,
            st.groups_pending + st.groups_ready,
            st.leases_outstanding,
        );
        self.samples.push(s);
    }

    /// Samples every `every` (the first one period from now) until `stop`.
    async fn run(mut self, every: Duration, stop: Arc<AtomicBool>) -> Vec<Sample> {
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        while !stop.load(Relaxed) {
            ticker.tick().await;
            self.take().await;
        }
        self.samples
    }
}

fn write_csv(path: &Path, samples: &[Sample]) -> anyhow::Result<()> {
    let mut text = String::from(
        "t_s,phase,buffer_rss_mib,buffer_cpu_cores,bench_cpu_cores,acked_groups,sampled_groups,\
         groups_pending,groups_ready,bytes_held,leases_outstanding,leases_granted,leases_expired,\
         leases_used,leases_released,groups_admitted,groups_consumed,evicted,learner_version\n",
    );
    let opt = |v: Option<f64>, digits: usize| v.map_or(String::new(), |x| format!("{x:.digits$}"));
    for s in samples {
        let st = s.stats.clone().unwrap_or_default();
        let evicted: u64 = st.evictions.values().sum();
        text += &format!(
            "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            s.t,
            s.phase,
            opt(s.rss_mib, 1),
            opt(s.buffer_cpu, 3),
            opt(s.bench_cpu, 3),
            s.acked,
            s.sampled,
            st.groups_pending,
            st.groups_ready,
            st.bytes_held,
            st.leases_outstanding,
            st.leases_granted,
            st.leases_expired,
            st.leases_used,
            st.leases_released,
            st.groups_admitted,
            st.groups_consumed,
            evicted,
            st.learner_version,
        );
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The books at the end: every group a `PushAck` accepted, found again.
#[derive(Debug, PartialEq, Eq)]
struct Accounting {
    acked: u64,
    /// Acked groups the learner received while running.
    sampled: u64,
    /// Acked groups still held at the end (drained by id).
    held: u64,
    /// Groups the buffer evicted (by any reason; each documented).
    evicted: u64,
    /// Acked groups found nowhere, beyond those evictions could explain.
    missing: u64,
    /// Group ids handed out more than once (FIFO hands each out once).
    handed_twice: u64,
    /// Groups handed out that no ack accepted (a failed push that landed).
    unacked_handed: u64,
    /// Groups drained at the end, acked or not.
    drained: u64,
    /// The buffer's own held count at the end, before draining.
    stats_held: u64,
}

impl Accounting {
    /// Matches the acked ids against those the learner received and those
    /// drained at the end. `evicted` and `stats_held` come from the
    /// buffer's stats at the end, before draining.
    fn new(
        acked: &[String],
        sampled: &[String],
        drained: &[String],
        evicted: u64,
        stats_held: u64,
    ) -> Self {
        let acked_set: HashSet<&str> = acked.iter().map(String::as_str).collect();
        let mut handed = HashSet::new();
        let mut handed_twice = 0;
        for id in sampled.iter().chain(drained) {
            if !handed.insert(id.as_str()) {
                handed_twice += 1;
            }
        }
        let count_acked = |ids: &[String]| {
            ids.iter()
                .filter(|id| acked_set.contains(id.as_str()))
                .count() as u64
        };
        let found = acked_set.iter().filter(|id| handed.contains(*id)).count() as u64;
        let not_found = acked_set.len() as u64 - found;
        Self {
            acked: acked_set.len() as u64,
            sampled: count_acked(sampled),
            held: count_acked(drained),
            evicted,
            missing: not_found.saturating_sub(evicted),
            handed_twice,
            unacked_handed: handed.iter().filter(|id| !acked_set.contains(*id)).count() as u64,
            drained: drained.len() as u64,
            stats_held,
        }
    }

    /// Nothing lost: acked = sampled + held + evicted exactly, nothing
    /// handed out twice, and the buffer's held count is what was drained.
    fn nothing_lost(&self) -> bool {
        self.missing == 0
            && self.acked == self.sampled + self.held + self.evicted
            && self.handed_twice == 0
            && self.stats_held == self.drained
    }
}

/// The run's timeline: the reference phase, then the many-actor one.
struct Timeline {
    reference: Duration,
    warmup: Duration,
    measure: Duration,
}

/// Everything the run produced.
struct Outcome {
    reference: Option<ActorReport>,
    main: ActorReport,
    main_seconds: f64,
    /// Acked groups in the measured window, and its seconds.
    measured_acks: (u64, f64),
    learner: LearnerReport,
    samples: Vec<Sample>,
    end_stats: Stats,
    drained: Vec<String>,
    buffer_exit_ok: bool,
}

pub async fn run(args: ActorsBenchArgs) -> anyhow::Result<()> {
    args.check()?;
    let out = match &args.out {
        Some(d) => d.clone(),
        None => tempfile::Builder::new()
            .prefix("bapo-bench-actors-")
            .tempdir()?
            .keep(),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let config = out.join("buffer.toml");
    std::fs::write(&config, buffer_config(&args))?;
    print_header(&args, &out);
    let buffer = BufferProcess::start(&config, &out).await?;
    let outcome = drive(&args, &buffer).await;
    let exit_ok = buffer.stop().await;
    let outcome = Outcome {
        buffer_exit_ok: exit_ok,
        ..outcome?
    };
    write_csv(&out.join("samples.csv"), &outcome.samples)?;
    print_latencies(&args, &outcome);
    print_memory(&outcome.samples);
    let books = print_books(&outcome);
    println!("samples: {}", out.join("samples.csv").display());
    ensure!(books.nothing_lost(), "acknowledged groups were lost");
    Ok(())
}

fn print_header(args: &ActorsBenchArgs, out: &Path) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "bapo bench actors: {} actors, one connection each; a group of {} rollouts ({} response tokens) every {} ms per actor, \
         the lease held {} ms with 1-2 renewals, {:.0}% given back; offered {:.1} groups/s ({:.0} rollouts/s); \
         learner batches of {} groups, max_staleness {}; {:.0} s reference (1 actor), {:.0} s warm-up, {:.1} min measured; {} cores",
        args.actors,
        args.group_size,
        args.tokens,
        args.group_interval_ms,
        args.generate_ms,
        args.release_fraction * 100.0,
        args.offered_groups_per_s(args.actors),
        args.offered_groups_per_s(args.actors)
            * args.group_size as f64
            * (1.0 - args.release_fraction),
        args.batch_groups,
        args.max_staleness,
        args.reference_s,
        args.warmup_s,
        args.minutes,
        cores,
    );
    println!("out: {}", out.display());
}

/// Runs the phases against the started buffer, then stops the learner,
/// reads the end stats and drains what is held.
async fn drive(args: &ActorsBenchArgs, buffer: &BufferProcess) -> anyhow::Result<Outcome> {
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    // The idle sample first: the buffer before any load.
    let mut sampler = Sampler::new(buffer.pid, buffer.addr, progress.clone()).await?;
    sampler.take().await;
    let sampler = tokio::spawn(sampler.run(Duration::from_secs_f64(args.every_s), stop.clone()));
    let learner = tokio::spawn(learner(
        buffer.addr,
        args.batch_groups,
        stop.clone(),
        progress.clone(),
    ));
    let timeline = Timeline {
        reference: Duration::from_secs_f64(args.reference_s),
        warmup: Duration::from_secs_f64(args.warmup_s),
        measure: Duration::from_secs_f64(args.minutes * 60.0),
    };
    let phases = phases(args, buffer.addr, &timeline, &progress).await;
    progress.phase.store(4, Relaxed);
    stop.store(true, Relaxed);
    let learner = learner.await??;
    let samples = sampler.await?;
    let (reference, main, main_seconds, measured_acks) = phases?;
    let mut client = batch_client(buffer.addr).await?;
    let end_stats = client.get_stats(StatsRequest {}).await?.into_inner();
    let drained = drain(buffer.addr, args.batch_groups).await?;
    Ok(Outcome {
        reference,
        main,
        main_seconds,
        measured_acks,
        learner,
        samples,
        end_stats,
        drained,
        buffer_exit_ok: false,
    })
}

type Phases = (Option<ActorReport>, ActorReport, f64, (u64, f64));

/// The one-actor reference, then all actors: warm-up, then measured.
async fn phases(
    args: &ActorsBenchArgs,
    addr: SocketAddr,
    timeline: &Timeline,
    progress: &Arc<Progress>,
) -> anyhow::Result<Phases> {
    let payload = Payload::new(args.tokens, 1);
    let plan = |actors: usize, warmup: Duration, length: Duration, prefix| {
        let now = Instant::now();
        ActorPlan {
            addr,
            payload: payload.clone(),
            k: args.group_size,
            interval: Duration::from_millis(args.group_interval_ms),
            generate: Duration::from_millis(args.generate_ms),
            release_fraction: args.release_fraction,
            start: tokio::time::Instant::now(),
            measure_from: now + warmup,
            deadline: now + length,
            prefix,
            actors,
            progress: progress.clone(),
        }
    };
    let reference = if timeline.reference.is_zero() {
        None
    } else {
        progress.phase.store(1, Relaxed);
        Some(phase(plan(1, Duration::ZERO, timeline.reference, "r")).await?)
    };
    progress.phase.store(2, Relaxed);
    let start = Instant::now();
    let main_plan = plan(
        args.actors,
        timeline.warmup,
        timeline.warmup + timeline.measure,
        "a",
    );
    let window_start = main_plan.measure_from;
    let window_end = main_plan.deadline;
    let acks = progress.clone();
    // The phase label and the ack count at the window's start, for the
    // sampler and the throughput.
    let marker = tokio::spawn(async move {
        tokio::time::sleep_until(window_start.into()).await;
        acks.phase.store(3, Relaxed);
        acks.acked.load(Relaxed)
    });
    let main = phase(main_plan).await?;
    let at_start = marker.await?;
    let window = window_end.saturating_duration_since(window_start);
    let measured = progress.acked.load(Relaxed).saturating_sub(at_start);
    Ok((
        reference,
        main,
        start.elapsed().as_secs_f64(),
        (measured, window.as_secs_f64()),
    ))
}

fn latency_row(name: &str, l: &Latencies, n: u64) {
    println!(
        "{:<34} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
        name,
        n,
        l.ms(0.5),
        l.ms(0.9),
        l.ms(0.99),
        l.ms(1.0)
    );
}

fn print_latencies(args: &ActorsBenchArgs, o: &Outcome) {
    println!();
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "latency (ms)", "n", "p50", "p90", "p99", "max"
    );
    if let Some(r) = &o.reference {
        latency_row("ack, 1 actor (reference)", &r.ack, r.acks_measured);
        latency_row("lease, 1 actor (reference)", &r.lease, r.leases_measured);
        latency_row(
            "renewal, 1 actor (reference)",
            &r.renew,
            r.renewals_measured,
        );
    }
    let m = &o.main;
    let n = match args.actors {
        1 => "1 actor".to_string(),
        n => format!("{n} actors"),
    };
    latency_row(&format!("ack, {n}"), &m.ack, m.acks_measured);
    latency_row(&format!("lease, {n}"), &m.lease, m.leases_measured);
    latency_row(&format!("renewal, {n}"), &m.renew, m.renewals_measured);
    println!(
        "goal p99 ack < 10 ms with {n}: {} ({:.2} ms)",
        if m.ack.ms(0.99) < 10.0 {
            "met"
        } else {
            "MISSED"
        },
        m.ack.ms(0.99)
    );
    let (acks, seconds) = o.measured_acks;
    let rate = acks as f64 / seconds.max(1e-9);
    println!();
    println!(
        "throughput over the measured {:.0} s: {:.1} groups/s acknowledged ({:.0} rollouts/s), offered {:.1} groups/s leased",
        seconds,
        rate,
        rate * args.group_size as f64,
        args.offered_groups_per_s(args.actors)
    );
    println!(
        "{} phase: {:.0} s, {} leases not granted at first ask (backpressure), {} renewals found their lease lapsed, {} leases given back, {} pushes not accepted in full",
        n,
        o.main_seconds,
        m.lease_refusals,
        m.renewals_lapsed,
        m.released,
        m.failed.len()
    );
    for (id, why) in m.failed.iter().take(5) {
        println!("  push {id}: {why}");
    }
    println!(
        "learner: {} batches (versions), {} groups evicted as stale at its reports",
        o.learner.version, o.learner.evicted_stale
    );
}

fn print_memory(samples: &[Sample]) {
    let window: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.phase == "measure")
        .filter_map(|s| Some((s.t, s.rss_mib?)))
        .collect();
    let idle = samples.first().and_then(|s| s.rss_mib);
    println!();
    match figures(&window) {
        Some((start, end, peak, (slope, se))) => {
            println!(
                "buffer RSS: {} idle (before any load), {start:.1} MiB at the start of the measured window, {end:.1} at its end, peak {peak:.1}; second-half slope {slope:.3} MiB/min (se {se:.3})",
                idle.map_or("-".into(), |b| format!("{b:.1} MiB")),
            );
            println!(
                "goal memory flat: {}",
                memory_verdict(&window, peak, slope, se)
            );
        }
        None => println!(
            "buffer RSS: no samples in the measured window (raise --minutes or lower --every-s)"
        ),
    }
    let busy: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.phase == "measure")
        .filter_map(|s| Some((s.buffer_cpu?, s.bench_cpu?)))
        .collect();
    if !busy.is_empty() {
        let n = busy.len() as f64;
        let (b, c) = busy
            .iter()
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
        println!("CPU in the measured window: buffer {b:.2} cores, actors + learner {c:.2} cores");
    }
}

/// `bapo bench soak`'s rule: rising when, even two standard errors below
/// its estimate, the second half's slope would add more than 1% of the
/// peak (or 1 MiB) over the window's length. Allocator noise of a few MiB
/// is not a trend.
fn memory_verdict(window: &[(f64, f64)], peak: f64, slope: f64, se: f64) -> &'static str {
    let minutes = match (window.first(), window.last()) {
        (Some(a), Some(b)) => (b.0 - a.0) / 60.0,
        _ => 0.0,
    };
    let budget = (0.01 * peak).max(1.0) / minutes.max(1.0);
    if slope - 2.0 * se > budget {
        "RISING"
    } else {
        "flat"
    }
}

/// Prints the books and returns them.
fn print_books(o: &Outcome) -> Accounting {
    let mut acked = o.main.acked.clone();
    if let Some(r) = &o.reference {
        acked.extend(r.acked.iter().cloned());
    }
    let st = &o.end_stats;
    let evicted: u64 = st.evictions.values().sum();
    let books = Accounting::new(
        &acked,
        &o.learner.sampled,
        &o.drained,
        evicted,
        st.groups_pending + st.groups_ready,
    );
    println!();
    println!(
        "books: acknowledged {} = sampled by the learner {} + still held {} + evicted {} ({:?}) {}",
        books.acked,
        books.sampled,
        books.held,
        books.evicted,
        st.evictions,
        if books.acked == books.sampled + books.held + books.evicted {
            "(holds)"
        } else {
            "(DOES NOT HOLD)"
        }
    );
    println!(
        "  missing {}, handed out twice {}, handed out but never acknowledged {}, held per the buffer's stats {} (drained {})",
        books.missing, books.handed_twice, books.unacked_handed, books.stats_held, books.drained
    );
    println!(
        "  buffer's own books: admitted {} = consumed {} + evicted {} + pending {} + ready {}; leases granted {}, used {}, released {}, expired {}, outstanding {}",
        st.groups_admitted,
        st.groups_consumed,
        evicted,
        st.groups_pending,
        st.groups_ready,
        st.leases_granted,
        st.leases_used,
        st.leases_released,
        st.leases_expired,
        st.leases_outstanding
    );
    println!(
        "  buffer stopped {}",
        if o.buffer_exit_ok {
            "cleanly (exit 0)"
        } else {
            "NOT cleanly"
        }
    );
    println!(
        "nothing lost: {}",
        if books.nothing_lost() { "yes" } else { "no" }
    );
    books
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_acked_group_found_balances() {
        let acked = ids(&["a", "b", "c", "d"]);
        let b = Accounting::new(&acked, &ids(&["a", "b"]), &ids(&["c", "d"]), 0, 2);
        assert_eq!((b.acked, b.sampled, b.held, b.missing), (4, 2, 2, 0));
        assert!(b.nothing_lost(), "{b:?}");
    }

    #[test]
    fn a_group_found_nowhere_is_lost_unless_evicted() {
        let acked = ids(&["a", "b", "c"]);
        let lost = Accounting::new(&acked, &ids(&["a"]), &ids(&["b"]), 0, 1);
        assert_eq!(lost.missing, 1);
        assert!(!lost.nothing_lost(), "{lost:?}");
        let evicted = Accounting::new(&acked, &ids(&["a"]), &ids(&["b"]), 1, 1);
        assert!(evicted.nothing_lost(), "{evicted:?}");
    }

    #[test]
    fn handing_a_group_out_twice_or_a_held_count_off_is_caught() {
        let acked = ids(&["a", "b"]);
        let twice = Accounting::new(&acked, &ids(&["a", "b"]), &ids(&["a"]), 0, 1);
        assert_eq!(twice.handed_twice, 1);
        assert!(!twice.nothing_lost(), "{twice:?}");
        // The buffer says it holds 3 but only 1 could be drained.
        let hidden = Accounting::new(&acked, &ids(&["a"]), &ids(&["b"]), 0, 3);
        assert_eq!(hidden.drained, 1);
        assert!(!hidden.nothing_lost(), "{hidden:?}");
    }

    #[test]
    fn a_failed_push_that_landed_is_counted_not_lost() {
        // "x" was pushed but its ack was lost: handed out, not acked.
        let b = Accounting::new(&ids(&["a"]), &ids(&["a", "x"]), &[], 0, 0);
        assert_eq!(b.unacked_handed, 1);
        assert!(b.nothing_lost(), "{b:?}");
    }

    #[test]
    fn memory_rising_beyond_noise_is_named() {
        let flat: Vec<(f64, f64)> = (0..60).map(|i| (i as f64 * 10.0, 40.0)).collect();
        assert_eq!(memory_verdict(&flat, 40.0, 0.0, 0.0), "flat");
        assert_eq!(memory_verdict(&flat, 40.0, 2.0, 0.1), "RISING");
        assert_eq!(memory_verdict(&flat, 40.0, 2.0, 1.0), "flat");
    }

    #[test]
    fn the_config_parses_and_blocks_when_full() {
        let args = ActorsBenchArgs {
            actors: 8,
            minutes: 0.1,
            warmup_s: 1.0,
            reference_s: 1.0,
            every_s: 1.0,
            group_interval_ms: 1000,
            generate_ms: 100,
            group_size: 8,
            tokens: 64,
            batch_groups: 32,
            max_staleness: 4,
            release_fraction: 0.05,
            out: None,
        };
        args.check().unwrap();
        let c = crate::config_file::ConfigFile::parse(&buffer_config(&args)).unwrap();
        c.buffer.validate().unwrap();
        assert_eq!(c.buffer.when_full, bapo_buffer::config::FullPolicy::Block);
        assert_eq!(c.buffer.batch_groups, 32);
        assert!((args.offered_groups_per_s(256) - 256.0).abs() < 1e-9);
    }
}
