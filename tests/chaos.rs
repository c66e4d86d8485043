//! Chaos: the whole loop as separate `bapo` processes (a durable buffer, a
//! resuming learner with a short checkpoint period, two actors), with each
//! kind of process killed with SIGKILL in turn and restarted with the same
//! flags. After every restart the learner must step again within a bounded
//! time; at the end the buffer's books must balance with nothing
//! acknowledged lost.
//!
//! The learner is killed more than `max_staleness + 1` versions past its
//! last checkpoint: the case that froze the whole system before learner
//! incarnations (docs/architecture.md, "Failure model").
//!
//! The same again with LoRA: the restarted learner resumes its adapters on
//! the base its checkpoint names (it refuses any other), and restarted
//! actors are sent the base again before adapters.
//!
//! And with the weights as bf16 deltas, one of them dropped on purpose:
//! after actors and the learner are killed and restarted, every actor
//! serves exactly the learner's bytes for its version (the CRC32 both
//! export).
//!
//! Every connection is mutual TLS with per-role certificates, as deployed:
//! restarted processes handshake again and reconnecting clients go through
//! the same authorization.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

mod common;

use bapo_proto::{
    tls::{self, ClientTls, TlsFiles, pki},
    v1::{Stats, StatsRequest, batch_source_client::BatchSourceClient},
};

const CHECKPOINT_EVERY: u64 = 10;
const MAX_STALENESS: u64 = 1;

/// What a test's cluster runs besides the defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Full,
    /// A `[learner.lora]` table.
    Lora,
    /// Weights broadcast in bf16 (as deltas, the default).
    Bf16,
}

/// The cluster's config for `variant`.
fn config(variant: Variant) -> String {
    let lora = match variant {
        Variant::Lora => "\n[learner.lora]\nrank = 4\n",
        _ => "",
    };
    let bf16 = match variant {
        Variant::Bf16 => "broadcast_dtype = \"bf16\"",
        _ => "",
    };
    format!(
        r#"
[buffer]
group_size = 4
min_group_size = 2
group_timeout_ms = 3000
batch_groups = 2
max_staleness = {MAX_STALENESS}

[learner]
batch_groups = 2
lr = 1e-4
steps = 0
checkpoint_every = {CHECKPOINT_EVERY}
keep_checkpoints = 2
eval_every = 0
{bf16}

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 1.0

[actor.sampling]
max_new_tokens = 8
{lora}"#
    )
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The processes of one loop and the flags each is (re)started with.
struct Cluster {
    dir: PathBuf,
    /// Certificates by process name (`buffer`, `learner`, `actor-0`...,
    /// `admin`), of one per-test CA.
    certs: std::collections::BTreeMap<String, TlsFiles>,
    buffer_port: u16,
    learner_port: u16,
    /// Prometheus `/metrics` ports of the learner and each actor.
    learner_metrics: u16,
    actor_metrics: Vec<u16>,
    /// Extra environment of the learner (fault hooks).
    learner_env: Vec<(String, String)>,
    buffer: Option<Child>,
    learner: Option<Child>,
    actors: Vec<Option<Child>>,
}

impl Cluster {
    fn new(dir: &Path, variant: Variant) -> Self {
        std::fs::write(dir.join("bapo.toml"), config(variant)).unwrap();
        tls::install_default_provider();
        let ca = pki::Ca::new("chaos.test").unwrap();
        let opts = pki::Options {
            hosts: vec!["localhost".into(), "127.0.0.1".into()],
            valid: None,
        };
        let mut certs = std::collections::BTreeMap::new();
        for (name, id) in [
            ("buffer", "buffer"),
            ("learner", "learner"),
            ("actor-0", "actor/actor-0"),
            ("actor-1", "actor/actor-1"),
            ("admin", "admin"),
        ] {
            let issued = ca.issue(id, &opts).unwrap();
            let files = ca.write(&dir.join("tls"), name, &issued).unwrap();
            certs.insert(name.to_string(), files);
        }
        Self {
            dir: dir.to_path_buf(),
            certs,
            buffer_port: free_port(),
            learner_port: free_port(),
            learner_metrics: free_port(),
            actor_metrics: vec![free_port(), free_port()],
            learner_env: vec![],
            buffer: None,
            learner: None,
            actors: vec![None, None],
        }
    }

    fn spawn(&self, name: &str, args: &[String]) -> Child {
        self.spawn_with(name, args, &[])
    }

    fn spawn_with(&self, name: &str, args: &[String], env: &[(String, String)]) -> Child {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .unwrap();
        Command::new(env!("CARGO_BIN_EXE_bapo"))
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    /// The config file and the TLS flags of process `name`.
    fn common_args(&self, name: &str) -> Vec<String> {
        let f = &self.certs[name];
        [
            ("--config", self.dir.join("bapo.toml")),
            ("--tls-cert", f.cert.clone()),
            ("--tls-key", f.key.clone()),
            ("--tls-ca", f.ca.clone()),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
        .collect()
    }

    fn start_buffer(&mut self) {
        let mut args = vec!["buffer".to_string()];
        args.extend(self.common_args("buffer"));
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{}", self.buffer_port),
            "--data-dir".into(),
            self.dir.join("wal").display().to_string(),
        ]);
        self.buffer = Some(self.spawn("buffer", &args));
    }

    fn start_learner(&mut self) {
        let mut args = vec!["learner".to_string()];
        args.extend(self.common_args("learner"));
        args.extend([
            "--buffer".into(),
            format!("https://127.0.0.1:{}", self.buffer_port),
            "--listen".into(),
            format!("127.0.0.1:{}", self.learner_port),
            "--out".into(),
            self.dir.join("learner").display().to_string(),
            "--resume".into(),
            "--metrics-listen".into(),
            format!("127.0.0.1:{}", self.learner_metrics),
        ]);
        self.learner = Some(self.spawn_with("learner", &args, &self.learner_env));
    }

    fn start_actor(&mut self, i: usize) {
        let mut args = vec!["actor".to_string()];
        args.extend(self.common_args(&format!("actor-{i}")));
        args.extend([
            "--buffer".into(),
            format!("https://127.0.0.1:{}", self.buffer_port),
            "--learner".into(),
            format!("https://127.0.0.1:{}", self.learner_port),
            "--actor-id".into(),
            format!("actor-{i}"),
            "--metrics-listen".into(),
            format!("127.0.0.1:{}", self.actor_metrics[i]),
        ]);
        self.actors[i] = Some(self.spawn(&format!("actor-{i}"), &args));
    }

    /// Panics (with the logs) if a process exited on its own.
    fn check_alive(&mut self) {
        let mut all: Vec<(&str, &mut Option<Child>)> =
            vec![("buffer", &mut self.buffer), ("learner", &mut self.learner)];
        for a in &mut self.actors {
            all.push(("actor", a));
        }
        for (name, child) in all {
            if let Some(c) = child
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!(
                    "{name} exited on its own with {status}; logs in {}",
                    self.dir.display()
                );
            }
        }
    }

    fn stop_all(&mut self) {
        let mut all: Vec<&mut Option<Child>> = vec![&mut self.learner, &mut self.buffer];
        all.extend(self.actors.iter_mut());
        for c in all.into_iter().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// SIGKILL, and wait for the process to be gone.
fn kill9(child: &mut Option<Child>) {
    let mut c = child.take().expect("a running process");
    c.kill().unwrap();
    c.wait().unwrap();
}

/// The buffer's stats, read with the admin certificate.
async fn stats(c: &Cluster) -> Option<Stats> {
    let admin = ClientTls::mtls(c.certs["admin"].clone());
    let url = format!("https://127.0.0.1:{}", c.buffer_port);
    let channel = tls::connector(&url, Some(&admin))
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut client = BatchSourceClient::new(channel);
    let s = client.get_stats(StatsRequest {}).await.ok()?;
    Some(s.into_inner())
}

/// Waits until the buffer reports a learner version satisfying `ok`.
async fn wait_for(
    c: &mut Cluster,
    what: &str,
    limit: Duration,
    ok: impl Fn(&Stats) -> bool,
) -> Stats {
    let deadline = Instant::now() + limit;
    let mut last = None;
    while Instant::now() < deadline {
        c.check_alive();
        if let Some(s) = stats(c).await {
            if ok(&s) {
                return s;
            }
            last = Some(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "{what}: not within {limit:?}; last stats {last:?}; logs in {}",
        c.dir.display()
    );
}

/// The learner's last version before its kill and the version it resumed
/// from, read off its metrics.jsonl (one line per step, appended by both
/// incarnations).
fn rollback(metrics: &Path) -> (u64, u64) {
    let text = std::fs::read_to_string(metrics).unwrap();
    let versions: Vec<u64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .filter_map(|v| v["version"].as_u64())
        .collect();
    let drop = versions
        .windows(2)
        .find(|w| w[1] <= w[0])
        .expect("the versions go back after the restart");
    (drop[0], drop[1] - 1)
}

/// Within this, every restart must lead to learner steps again. Generous
/// for a loaded 2-core CI machine: a tiny-model step takes milliseconds.
const PROGRESS: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_survives_kill_9_of_each_process() {
    survives_kill_9_of_each_process(Variant::Full).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_loop_survives_kill_9_of_each_process() {
    survives_kill_9_of_each_process(Variant::Lora).await;
}

async fn survives_kill_9_of_each_process(variant: Variant) {
    let lora = variant == Variant::Lora;
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::new(tmp.path(), variant);
    c.start_buffer();
    c.start_learner();
    c.start_actor(0);
    c.start_actor(1);

    // Run until the learner is more than max_staleness + 1 versions past a
    // checkpoint, then kill it.
    let far = MAX_STALENESS + 2;
    let s = wait_for(&mut c, "first steps", PROGRESS, |s| {
        s.learner_version > CHECKPOINT_EVERY && s.learner_version % CHECKPOINT_EVERY >= far
    })
    .await;
    kill9(&mut c.learner);
    let killed_at = s.learner_version;
    let incarnation = s.learner_incarnation;
    c.start_learner();
    let s = wait_for(&mut c, "steps after the learner restart", PROGRESS, |s| {
        s.learner_incarnation != incarnation && s.learner_version > killed_at + 3
    })
    .await;
    assert!(
        s.learner_incarnation != 0,
        "the learner reports an incarnation"
    );
    if lora {
        let ckpts = c.dir.join("learner").join("checkpoints");
        let latest = bapo_learner::checkpoint::latest(&ckpts).unwrap().unwrap();
        let state = bapo_learner::checkpoint::read_state(&latest).unwrap();
        assert!(
            state.lora.is_some(),
            "the resumed learner writes LoRA checkpoints"
        );
    }
    let (logged_at, resumed_at) = rollback(&c.dir.join("learner").join("metrics.jsonl"));
    // The learner reports a version to the buffer before it logs the step,
    // so a kill in between leaves the log one version behind the buffer.
    let died_at = logged_at.max(killed_at);
    assert!(
        died_at > resumed_at + MAX_STALENESS + 1,
        "the learner resumed at version {resumed_at} after dying at {died_at}: \
         not the case this test is for (more than max_staleness + 1 behind)"
    );

    kill9(&mut c.actors[0]);
    c.start_actor(0);
    let v = s.learner_version;
    let s = wait_for(&mut c, "steps after an actor restart", PROGRESS, |s| {
        s.learner_version > v + 3
    })
    .await;

    // Every group the buffer acknowledged a rollout of is in its log
    // (rollouts_accepted is a process counter; the group books are durable).
    let admitted_before = s.groups_admitted;
    kill9(&mut c.buffer);
    c.start_buffer();
    let v = s.learner_version;
    let s = wait_for(&mut c, "steps after the buffer restart", PROGRESS, |s| {
        s.learner_version > v + 3
    })
    .await;
    assert!(
        s.groups_admitted >= admitted_before,
        "acknowledged groups lost: {} admitted before the buffer's kill, {} after",
        admitted_before,
        s.groups_admitted
    );

    // Quiesce: stop generation, then the learner, and read the books.
    for a in &mut c.actors {
        kill9(a);
    }
    kill9(&mut c.learner);
    let s = stats(&c).await.expect("buffer stats");
    let evicted: u64 = s.evictions.values().sum();
    assert_eq!(
        s.groups_admitted,
        s.groups_consumed + evicted + s.groups_pending + s.groups_ready,
        "books do not balance: {s:?}"
    );
    assert!(
        s.groups_lost_to_rollback > 0 || s.evictions.contains_key("rolled_back"),
        "the learner's kill past its checkpoint left no trace in the books: {s:?}"
    );
}

/// The value of the sample `series` (a metric name with its labels, as
/// exposed) on a Prometheus page.
fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// (weights version, CRC32) a process exports, read twice with nothing
/// changing in between; `None` while it is changing or not up.
fn weights_of(port: u16, role: &str) -> Option<(f64, f64)> {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let read = || {
        let page = common::scrape(&url)?;
        let version = sample(&page, &format!("bapo_{role}_weight_version"))?;
        Some((version, sample(&page, &format!("bapo_{role}_weight_crc"))?))
    };
    let first = read()?;
    (read()? == first).then_some(first)
}

/// Waits until actor `i` and the learner export the same version, read
/// consistently, and returns both CRC32s.
async fn same_version(c: &mut Cluster, i: usize) -> (f64, f64) {
    let deadline = Instant::now() + PROGRESS;
    while Instant::now() < deadline {
        c.check_alive();
        let learner = weights_of(c.learner_metrics, "learner");
        let actor = weights_of(c.actor_metrics[i], "actor");
        let again = weights_of(c.learner_metrics, "learner");
        if let (Some(l), Some(a)) = (learner, actor)
            && learner == again
            && l.0 == a.0
        {
            return (l.1, a.1);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "actor-{i} never held the learner's version; logs in {}",
        c.dir.display()
    );
}

/// The counter `series` of actor `i`, 0 when not exported yet.
fn actor_counter(c: &Cluster, i: usize, series: &str) -> f64 {
    let url = format!("http://127.0.0.1:{}/metrics", c.actor_metrics[i]);
    common::scrape(&url)
        .and_then(|p| sample(&p, series))
        .unwrap_or(0.0)
}

/// The version whose delta the learner never sends.
const DROPPED: u64 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_weights_end_every_actor_on_the_learners_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = Cluster::new(tmp.path(), Variant::Bf16);
    c.learner_env = vec![(
        bapo_learner::server::Faults::DROP_DELTAS.into(),
        DROPPED.to_string(),
    )];
    c.start_buffer();
    c.start_learner();
    c.start_actor(0);
    c.start_actor(1);
    let s = wait_for(&mut c, "steps past the dropped delta", PROGRESS, |s| {
        s.learner_version > DROPPED + 3
    })
    .await;
    // Actor 1 followed from the start: v5's delta never came, so v6's
    // named bytes it did not hold, and it was sent the newest whole.
    let refused = actor_counter(
        &c,
        1,
        r#"bapo_actor_weight_deltas_refused_total{reason="base"}"#,
    );
    assert!(refused >= 1.0, "the dropped delta went unnoticed");
    let (learner, actor) = same_version(&mut c, 1).await;
    assert_eq!(
        learner, actor,
        "actor-1 serves other bytes than the learner's"
    );

    // An actor killed (mid-delta or not: a tiny model's deltas are
    // small and frequent) joins again and is sent a snapshot.
    kill9(&mut c.actors[0]);
    c.start_actor(0);
    let v = s.learner_version;
    let s = wait_for(&mut c, "steps after an actor restart", PROGRESS, |s| {
        s.learner_version > v + 3
    })
    .await;

    // A learner killed between versions comes back as a new incarnation:
    // every actor is sent its weights whole, then deltas again.
    kill9(&mut c.learner);
    c.learner_env.clear();
    c.start_learner();
    let incarnation = s.learner_incarnation;
    wait_for(&mut c, "steps after the learner restart", PROGRESS, |s| {
        s.learner_incarnation != incarnation && s.learner_version > v + 3
    })
    .await;
    for i in 0..2 {
        let deltas_before =
            actor_counter(&c, i, r#"bapo_actor_weight_updates_total{kind="delta"}"#);
        let v = stats(&c).await.expect("buffer stats").learner_version;
        wait_for(&mut c, "more steps", PROGRESS, |s| {
            s.learner_version > v + 2
        })
        .await;
        let (learner, actor) = same_version(&mut c, i).await;
        assert_eq!(
            learner, actor,
            "actor-{i} serves other bytes than the learner's"
        );
        let deltas = actor_counter(&c, i, r#"bapo_actor_weight_updates_total{kind="delta"}"#);
        assert!(
            deltas > deltas_before,
            "actor-{i} took no delta after the restarts ({deltas_before} -> {deltas})"
        );
        eprintln!(
            "actor-{i}: CRC {:08x} as the learner's; {deltas} deltas applied, {refused} refused",
            actor as u32
        );
    }
}
