//! Helpers shared by the end-to-end tests: real servers on loopback ports,
//! real clients, rollouts that look like an actor's.

#![allow(dead_code)]

use std::{net::SocketAddr, time::Duration};

use bapo_buffer::{Buffer, BufferConfig};
use bapo_proto::packed::{pack_f32, pack_u32};
use bapo_proto::v1::{
    self, batch_source_client::BatchSourceClient, rollout_sink_client::RolloutSinkClient,
};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

/// A buffer server on an ephemeral loopback port, stopped on drop.
pub struct TestBuffer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestBuffer {
    pub async fn start(cfg: BufferConfig) -> Self {
        Self::start_at(cfg, "127.0.0.1:0".parse().unwrap()).await
    }

    /// On a given address (a restarted buffer on its old port).
    pub async fn start_at(cfg: BufferConfig, addr: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let buffer = Buffer::open(cfg).unwrap();
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(bapo_buffer::server::serve(buffer, listener, async {
            let _ = rx.await;
        }));
        Self {
            addr,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }

    pub async fn sink(&self) -> RolloutSinkClient<Channel> {
        RolloutSinkClient::new(channel(self.addr).await)
    }

    pub async fn source(&self) -> BatchSourceClient<Channel> {
        BatchSourceClient::new(channel(self.addr).await)
    }
}

impl Drop for TestBuffer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

pub async fn channel(addr: SocketAddr) -> Channel {
    let endpoint = Channel::from_shared(format!("http://{addr}")).unwrap();
    for _ in 0..100 {
        if let Ok(c) = endpoint.connect().await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no server at {addr}");
}

pub fn rollout(group: &str, id: &str, n_tokens: usize, version: u32) -> v1::Rollout {
    v1::Rollout {
        rollout_id: id.into(),
        group_id: group.into(),
        prompt_tokens: pack_u32(&[11, 12, 13]),
        response_tokens: pack_u32(&(0..n_tokens as u32).collect::<Vec<_>>()),
        behavior_logprobs: pack_f32(&vec![-0.25; n_tokens]),
        token_versions: pack_u32(&vec![version; n_tokens]),
        reward: 1.0,
        finish_reason: v1::FinishReason::Stop as i32,
        actor_id: "test-actor".into(),
        task: "arith".into(),
        ..Default::default()
    }
}

pub fn group(name: &str, k: usize, version: u32) -> Vec<v1::Rollout> {
    (0..k)
        .map(|i| rollout(name, &format!("{name}/{i}"), 16, version))
        .collect()
}

pub async fn push(client: &mut RolloutSinkClient<Channel>, msgs: Vec<v1::Rollout>) -> v1::PushAck {
    client
        .push(tokio_stream::iter(msgs))
        .await
        .expect("push stream")
        .into_inner()
}

/// Takes exactly `n` groups (waiting up to a second) and returns their ids.
pub async fn sample_ids(client: &mut BatchSourceClient<Channel>, n: u32) -> Vec<String> {
    client
        .sample(v1::SampleRequest {
            num_groups: n,
            timeout_ms: 1000,
            allow_partial: false,
        })
        .await
        .expect("sample")
        .into_inner()
        .groups
        .into_iter()
        .map(|g| g.group_id)
        .collect()
}

/// An actor that makes groups of `k` quickly: one slot, six new tokens,
/// a short shutdown grace.
pub fn actor_config(k: usize) -> bapo_actor::ActorConfig {
    bapo_actor::ActorConfig {
        group_size: k,
        concurrency: 1,
        sampling: bapo_policy::SamplingParams {
            temperature: 1.0,
            max_new_tokens: 6,
            ..Default::default()
        },
        shutdown_grace_s: 1.0,
        ..Default::default()
    }
}

pub use bapo_policy::testing::tiny_policy as tiny;

/// A plaintext weight server for `hub` on a loopback port; stops when the
/// sender is dropped.
pub async fn weight_server(
    hub: bapo_learner::broadcast::WeightHub,
) -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(bapo_learner::server::serve(hub, listener, async {
        let _ = rx.await;
    }));
    (format!("http://{addr}"), tx)
}

/// A plaintext learner run of `cfg` on the tiny model (seed 1) against
/// the buffer at `buffer`, publishing to `hub`, writing into `out`.
pub fn spawn_learner(
    cfg: bapo_learner::LearnerConfig,
    hub: bapo_learner::broadcast::WeightHub,
    buffer: &str,
    out: &std::path::Path,
) -> JoinHandle<anyhow::Result<bapo_learner::run::RunSummary>> {
    let trainer = bapo_learner::Trainer::new(cfg, tiny(1), 0).unwrap();
    tokio::spawn(bapo_learner::run::run(
        trainer,
        hub,
        bapo_learner::run::RunOptions {
            buffer: buffer.to_string(),
            tls: None,
            out: out.to_path_buf(),
            provenance: Default::default(),
            eval: None,
            decode: None,
            params: serde_json::Value::Null,
            export_final: false,
        },
        std::future::pending(),
    ))
}

/// A plaintext actor of `cfg` on the default task (arith) with the
/// character tokenizer; stops (after its grace period) when the sender
/// fires or is dropped.
pub fn spawn_actor(
    cfg: bapo_actor::ActorConfig,
    opts: bapo_actor::ActorOptions,
) -> (
    JoinHandle<anyhow::Result<bapo_actor::ActorSummary>>,
    oneshot::Sender<()>,
) {
    let task = std::sync::Arc::from(bapo_tasks::build(&Default::default()).unwrap());
    let (stop, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(bapo_actor::run(
        cfg,
        task,
        std::sync::Arc::new(bapo_policy::tokenizer::TextTokenizer::char_level()),
        opts,
        async {
            let _ = rx.await;
        },
    ));
    (handle, stop)
}

/// Plaintext actor options: `buffer` and `learner` URLs, built-in rewards.
pub fn actor_options(buffer: &str, learner: &str, id: &str) -> bapo_actor::ActorOptions {
    bapo_actor::ActorOptions {
        buffer: buffer.to_string(),
        learner: learner.to_string(),
        actor_id: id.into(),
        device: bapo_policy::burn::prelude::Device::flex(),
        precision: Default::default(),
        tls: None,
        reward: Default::default(),
        model_dir: None,
        chat: None,
    }
}

/// The pieces every in-process loop test starts with: a buffer, a weight
/// hub served on a loopback port, a run directory, and the learner config
/// they share (tiny model, no evaluation, no periodic checkpoints).
pub struct Loop {
    pub buffer: TestBuffer,
    pub buffer_url: String,
    pub hub: bapo_learner::broadcast::WeightHub,
    pub learner_url: String,
    pub out: tempfile::TempDir,
    /// Stops the weight server when dropped.
    _weights: oneshot::Sender<()>,
}

impl Loop {
    pub async fn start(buffer: BufferConfig) -> Self {
        let buffer = TestBuffer::start(buffer).await;
        let buffer_url = format!("http://{}", buffer.addr);
        let hub = bapo_learner::broadcast::WeightHub::new();
        let (learner_url, weights) = weight_server(hub.clone()).await;
        Self {
            buffer,
            buffer_url,
            hub,
            learner_url,
            out: tempfile::tempdir().unwrap(),
            _weights: weights,
        }
    }

    /// A loop whose buffer has groups of `group_size`, batches of
    /// `batch_groups` and `max_staleness`, everything else default.
    pub async fn with(group_size: u32, batch_groups: u32, max_staleness: u64) -> Self {
        Self::start(BufferConfig {
            group_size,
            batch_groups,
            max_staleness,
            ..Default::default()
        })
        .await
    }

    /// `steps` steps of `batch_groups` groups at lr 1e-3, nothing else.
    pub fn learner_config(&self, batch_groups: u32, steps: u64) -> bapo_learner::LearnerConfig {
        bapo_learner::LearnerConfig {
            batch_groups,
            steps,
            lr: 1e-3,
            eval_every: 0,
            checkpoint_every: 0,
            ..Default::default()
        }
    }

    /// The learner of `cfg` against this loop's buffer and hub.
    pub fn spawn_learner(
        &self,
        cfg: bapo_learner::LearnerConfig,
    ) -> JoinHandle<anyhow::Result<bapo_learner::run::RunSummary>> {
        spawn_learner(cfg, self.hub.clone(), &self.buffer_url, self.out.path())
    }

    /// Actor options pointing at this loop.
    pub fn actor_options(&self, id: &str) -> bapo_actor::ActorOptions {
        actor_options(&self.buffer_url, &self.learner_url, id)
    }
}

/// A Python server of the project's own (`scripts/<script> serve --listen
/// <listen> <args>`, which builds its venv on first use), and the address
/// of its first stdout line, `listening on ADDR`. Killed on drop.
pub async fn script_server(
    script: &str,
    listen: &str,
    args: &[&str],
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(script);
    let mut child = tokio::process::Command::new("bash")
        .arg(path)
        .args(["serve", "--listen", listen])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("bash runs scripts/{script}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // The first start builds the venv (pip: 10-40 s here).
    let line = tokio::time::timeout(Duration::from_secs(900), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("scripts/{script} starts"))
        .unwrap()
        .unwrap_or_else(|| panic!("scripts/{script} prints its address"));
    let addr = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

/// Groups the buffer has admitted so far.
pub async fn groups_admitted(buffer: &TestBuffer) -> u64 {
    let mut source = buffer.source().await;
    let stats = source.get_stats(v1::StatsRequest {}).await.unwrap();
    stats.into_inner().groups_admitted
}

/// Polls `f` every 200 ms until it holds; panics naming `what` after `secs`.
pub async fn wait_until(what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A blocking HTTP/1.0 GET of a Prometheus exporter's page.
pub fn scrape(url: &str) -> Option<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/')?;
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// A JSON file a run writes, once it is there and whole.
pub fn read_json(path: &std::path::Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Follows the weight stream at `url` as actor `id` (plaintext, on the
/// CPU); the cell it fills, and the sender that stops it.
pub fn follow(
    url: String,
    id: &str,
) -> (
    bapo_actor::subscription::PolicyCell,
    tokio::sync::watch::Sender<bool>,
) {
    let (cell_tx, cell_rx) = tokio::sync::watch::channel(None);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(bapo_actor::subscription::follow(
        url,
        None,
        id.into(),
        bapo_actor::subscription::Target::model(
            bapo_policy::burn::prelude::Device::flex(),
            Default::default(),
        ),
        cell_tx,
        stop_rx,
    ));
    (cell_rx, stop_tx)
}

/// Waits (30 s at most) until `cell` holds version `v`, and returns it.
pub async fn version(
    cell: &mut bapo_actor::subscription::PolicyCell,
    v: u64,
) -> std::sync::Arc<bapo_actor::subscription::Versioned> {
    tokio::time::timeout(
        Duration::from_secs(30),
        cell.wait_for(|c| c.as_ref().is_some_and(|c| c.version == v)),
    )
    .await
    .unwrap_or_else(|_| panic!("version {v} reached the actor"))
    .unwrap()
    .clone()
    .unwrap()
}
