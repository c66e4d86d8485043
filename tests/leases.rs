//! Generation-time admission (leases, docs/buffer.md "Leases") over real
//! sockets: a synchronous loop whose actors lease each group before
//! generating it throws away no group as stale, where push-time admission
//! alone throws many away; an actor's renewals keep its lease alive and a
//! lease it stops renewing expires; an actor SIGKILLed holding a lease
//! holds the loop up only until the lease expires; and an actor facing a
//! buffer without leases falls back to push-time admission.

mod common;

use std::{
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use bapo_actor::{
    lease::{Acquired, Admitted, Held, Leasing, Stop},
    stop::StopFlag,
    subscription::Versioned,
};
use bapo_buffer::BufferConfig;
use bapo_learner::LearnerConfig;
use bapo_proto::v1::{
    Stats, StatsRequest, batch_source_client::BatchSourceClient,
    rollout_sink_client::RolloutSinkClient,
};
use common::{Loop as LoopKit, TestBuffer, actor_config, spawn_actor};
use tokio::sync::watch;

/// Learner steps of the synchronous loops.
const STEPS: u64 = 12;
const GROUP: usize = 4;

/// Stale waste of a loop: rollouts refused as stale (whole groups
/// arriving too late) and groups evicted as stale, in groups.
fn stale_groups(s: &Stats) -> f64 {
    let refused = s.rejections.get("stale").copied().unwrap_or(0) as f64 / GROUP as f64;
    refused + s.evictions.get("stale").copied().unwrap_or(0) as f64
}

/// A max_staleness = 0 loop: a buffer, a learner of `STEPS` steps of two
/// groups, two actors (leasing or not); the buffer's books at the end.
async fn synchronous_loop(lease: bool) -> Stats {
    let lp = LoopKit::start(BufferConfig {
        group_size: GROUP as u32,
        min_group_size: 2,
        batch_groups: 2,
        max_staleness: 0,
        ..Default::default()
    })
    .await;
    let buffer = &lp.buffer;
    let cfg = LearnerConfig {
        lr: 1e-4,
        ..lp.learner_config(2, STEPS)
    };
    let learner = lp.spawn_learner(cfg);
    let mut actors = Vec::new();
    for id in ["a0", "a1"] {
        let mut c = actor_config(GROUP);
        c.lease = lease;
        actors.push(spawn_actor(c, lp.actor_options(id)));
    }
    let summary = tokio::time::timeout(Duration::from_secs(180), learner)
        .await
        .expect("the learner finishes its steps")
        .unwrap()
        .unwrap();
    assert_eq!(summary.steps, STEPS);
    let stats = buffer
        .source()
        .await
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    for (handle, stop) in actors {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(30), handle).await;
    }
    stats
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_leases_a_synchronous_loop_throws_no_group_away_as_stale() {
    let s = synchronous_loop(true).await;
    eprintln!("leases: {s:?}");
    assert!(
        s.leases_used >= STEPS * 2,
        "the actors leased their groups: {s:?}"
    );
    assert_eq!(
        stale_groups(&s),
        0.0,
        "a group generated under its lease is trained on at staleness 0: {s:?}"
    );
}

/// The control: the same loop with push-time admission only throws groups
/// away (about 40% of what is generated, measured), so the test above can
/// tell leases from their absence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_time_admission_alone_throws_groups_away_as_stale() {
    let s = synchronous_loop(false).await;
    eprintln!("no leases: {s:?}");
    assert_eq!(s.leases_granted, 0);
    assert!(
        stale_groups(&s) >= 2.0,
        "push-time admission at max_staleness 0 wastes groups: {s:?}"
    );
}

fn rollout_sink(url: &str) -> RolloutSinkClient<bapo_proto::tls::AuthChannel> {
    RolloutSinkClient::new(
        bapo_proto::tls::connector(url, None)
            .unwrap()
            .connect_lazy(),
    )
}

async fn stats_at(url: &str) -> Option<Stats> {
    let mut c = BatchSourceClient::connect(url.to_string()).await.ok()?;
    Some(c.get_stats(StatsRequest {}).await.ok()?.into_inner())
}

/// Weights of version 0 in a cell, as a subscription would hold them.
fn weights_cell() -> (
    watch::Sender<Option<Arc<Versioned>>>,
    bapo_actor::subscription::PolicyCell,
) {
    watch::channel(Some(Arc::new(Versioned::new(0, 0, common::tiny(1)))))
}

/// An actor's lease on `group_id` from the buffer at `url`, renewed in
/// the background until dropped or given back.
async fn lease_at(url: &str, group_id: &str) -> Held {
    let leasing = Leasing::new(rollout_sink(url), Duration::from_secs(5));
    let (_tx, cell) = weights_cell();
    let (_abort_tx, abort) = watch::channel(false);
    let stopping = StopFlag::new();
    let mut stop = Stop {
        abort,
        stopping: &stopping,
    };
    match leasing.admit(group_id, &cell, &mut stop).await {
        Admitted::Leased(h) => h,
        _ => panic!("not leased"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_renews_its_lease_and_one_it_drops_expires() {
    // Leases of 1 s, expired by the server's sweep (every 250 ms here).
    let buffer = TestBuffer::start(BufferConfig {
        lease_ttl_ms: 1000,
        group_timeout_ms: 1000,
        ..Default::default()
    })
    .await;
    let url = format!("http://{}", buffer.addr);
    let held = lease_at(&url, "g-renewed").await;
    assert_eq!(held.grant.ttl, Duration::from_secs(1));
    // Four TTLs of generation: renewed at half the TTL, never expired.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let s = stats_at(&url).await.unwrap();
    assert_eq!((s.leases_outstanding, s.leases_expired), (1, 0), "{s:?}");
    // An actor that stops renewing (it died) loses the lease.
    drop(held);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let s = stats_at(&url).await.unwrap();
    assert_eq!((s.leases_outstanding, s.leases_expired), (0, 1), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_given_back_frees_its_room_before_the_ttl() {
    let buffer = TestBuffer::start(BufferConfig {
        lease_ttl_ms: 60_000,
        ..Default::default()
    })
    .await;
    let url = format!("http://{}", buffer.addr);
    let held = lease_at(&url, "g-dropped").await;
    assert_eq!(stats_at(&url).await.unwrap().leases_outstanding, 1);
    // Its group was dropped (scoring failed): the room comes back at once,
    // not a minute later.
    held.give_back(&tokio::runtime::Handle::current());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = stats_at(&url).await.unwrap();
        if s.leases_outstanding == 0 {
            assert_eq!((s.leases_released, s.leases_expired), (1, 0), "{s:?}");
            assert_eq!(s.admitted_groups, 0, "{s:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not released: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_buffer_without_leases_the_actor_pushes_unleased() {
    // A server that knows no RolloutSink/Lease (health only): UNIMPLEMENTED.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let leasing = Leasing::new(rollout_sink(&format!("http://{addr}")), Duration::ZERO);
    let (_abort_tx, abort) = watch::channel(false);
    let stopping = StopFlag::new();
    let mut stop = Stop {
        abort,
        stopping: &stopping,
    };
    let first = tokio::time::timeout(Duration::from_secs(30), leasing.acquire("g", &mut stop))
        .await
        .expect("UNIMPLEMENTED is an answer, not an error to retry");
    assert_eq!(first, Acquired::Unsupported);
    // Remembered: the next group does not ask again.
    let (_tx, cell) = weights_cell();
    assert!(matches!(
        leasing.admit("h", &cell, &mut stop).await,
        Admitted::Unleased
    ));
}

// ---------------------------------------------------------------------------
// An actor process killed holding a lease.

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

const LEASE_TTL_MS: u64 = 3000;

fn kill_config() -> String {
    format!(
        r#"
[buffer]
group_size = 4
min_group_size = 2
group_timeout_ms = 5000
batch_groups = 2
max_staleness = 0
lease_ttl_ms = {LEASE_TTL_MS}

[learner]
batch_groups = 2
lr = 1e-4
steps = 0
checkpoint_every = 1000
eval_every = 0

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 1.0

[actor.sampling]
max_new_tokens = 8
"#
    )
}

/// A loop of `bapo` processes in plaintext on loopback.
struct Loop {
    dir: std::path::PathBuf,
    buffer_port: u16,
    learner_port: u16,
    children: Vec<(String, Child)>,
}

impl Loop {
    fn new(dir: &Path) -> Self {
        std::fs::write(dir.join("bapo.toml"), kill_config()).unwrap();
        Self {
            dir: dir.to_path_buf(),
            buffer_port: free_port(),
            learner_port: free_port(),
            children: Vec::new(),
        }
    }

    fn buffer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.buffer_port)
    }

    fn spawn(&mut self, name: &str, args: &[String]) {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let mut all = vec![
            args[0].clone(),
            "--config".into(),
            self.dir.join("bapo.toml").display().to_string(),
        ];
        all.extend(args[1..].iter().cloned());
        let child = Command::new(env!("CARGO_BIN_EXE_bapo"))
            .args(all)
            .env("RUST_LOG", "warn,bapo_buffer=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push((name.to_string(), child));
    }

    fn start(&mut self) {
        let listen = format!("127.0.0.1:{}", self.buffer_port);
        self.spawn("buffer", &["buffer".into(), "--listen".into(), listen]);
        let args = [
            "learner".into(),
            "--buffer".into(),
            self.buffer_url(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.learner_port),
            "--out".into(),
            self.dir.join("learner").display().to_string(),
        ];
        self.spawn("learner", &args);
    }

    fn start_actor(&mut self, name: &str) {
        let args = [
            "actor".into(),
            "--buffer".into(),
            self.buffer_url(),
            "--learner".into(),
            format!("http://127.0.0.1:{}", self.learner_port),
            "--actor-id".into(),
            name.into(),
        ];
        self.spawn(name, &args);
    }

    /// SIGKILL, and wait until the process is gone.
    fn kill9(&mut self, name: &str) {
        let i = self.children.iter().position(|(n, _)| n == name).unwrap();
        let (_, mut c) = self.children.remove(i);
        c.kill().unwrap();
        c.wait().unwrap();
    }

    async fn stats(&self) -> Stats {
        for _ in 0..100 {
            if let Some(s) = stats_at(&self.buffer_url()).await {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no buffer stats; logs in {}", self.dir.display());
    }

    async fn wait_for(&self, what: &str, ok: impl Fn(&Stats) -> bool) -> Stats {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let s = self.stats().await;
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within 120 s; last {s:?}; logs in {}",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_killed_holding_a_lease_holds_the_loop_up_only_until_it_expires() {
    let tmp = tempfile::tempdir().unwrap();
    let mut lp = Loop::new(tmp.path());
    lp.start();
    lp.start_actor("actor-0");
    lp.wait_for("first steps", |s| s.learner_version >= 2).await;
    // Kill actor-0 until it dies holding a lease (it may die between its
    // push and its next grant); with it gone, nothing changes the count.
    let mut tries = 0;
    let s = loop {
        lp.kill9("actor-0");
        let s = lp.stats().await;
        if s.leases_outstanding > 0 {
            break s;
        }
        tries += 1;
        assert!(tries < 20, "actor-0 never died holding a lease: {s:?}");
        lp.start_actor("actor-0");
        let v = s.learner_version;
        lp.wait_for("steps after a restart", |s| s.learner_version > v)
            .await;
    };
    assert_eq!(s.leases_expired, 0, "{s:?}");
    let (killed_at, expired_before) = (s.learner_version, s.leases_expired);
    // Another actor takes over; max_staleness 0 leaves room for one batch,
    // part of which is the dead actor's lease: the learner cannot step
    // until it expires.
    lp.start_actor("actor-1");
    let expiry = lp
        .wait_for("the dead actor's lease expires", |s| {
            assert!(
                s.leases_expired > expired_before || s.learner_version == killed_at,
                "the learner stepped past the dead lease before it expired: {s:?}"
            );
            s.leases_expired > expired_before
        })
        .await;
    let v = expiry.learner_version;
    let s = lp
        .wait_for("steps with the other actor", |s| s.learner_version >= v + 3)
        .await;
    assert!(s.leases_used > 0, "{s:?}");
}
