//! Metrics and parameters to an MLflow tracking server over its REST API
//! (`/api/2.0/mlflow/...`), from a thread of its own behind a bounded
//! queue: the learner only ever `try_send`s, so a server that is down or
//! slow costs training nothing but the records dropped once the queue is
//! full (counted: `bapo_learner_tracking_dropped_total{sink="mlflow"}`).
//! Records waiting in the queue when the server comes back are sent.
//!
//! The run's id is kept in `<out>/mlflow_run.json`: a learner restarted
//! with the same flags logs into the same MLflow run, and `bapo run`
//! uploads its summary, report and (if asked) final weights there.

use std::{
    path::{Path, PathBuf},
    sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel},
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::metrics as names;

/// `[learner.mlflow]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlflowConfig {
    /// Tracking server, `http(s)://host:port`.
    pub uri: String,
    /// Experiment, created if absent.
    pub experiment: String,
    /// The MLflow run's name; empty: the run directory's name.
    pub run_name: String,
    /// Step records held while the server is slow or down; more are
    /// dropped and counted.
    pub queue: usize,
    /// Longest wait for one request.
    pub timeout_s: f64,
    /// Upload the final HF weights (or adapters) as artefacts too.
    pub log_model: bool,
}

impl Default for MlflowConfig {
    fn default() -> Self {
        Self {
            uri: String::new(),
            experiment: "bapo".into(),
            run_name: String::new(),
            queue: 10_000,
            timeout_s: 5.0,
            log_model: false,
        }
    }
}

impl MlflowConfig {
    pub fn check(&self) -> Result<(), String> {
        if !(self.uri.starts_with("http://") || self.uri.starts_with("https://")) {
            return Err(format!("uri {:?} must be http(s)://host:port", self.uri));
        }
        if self.experiment.is_empty() {
            return Err("experiment must not be empty".into());
        }
        if self.queue == 0 {
            return Err("queue must hold at least 1 record".into());
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return Err(format!(
                "timeout_s {} must be a positive number",
                self.timeout_s
            ));
        }
        Ok(())
    }
}

/// Where an MLflow run lives, as `mlflow_run.json` keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRef {
    pub uri: String,
    pub experiment_id: String,
    pub run_id: String,
}

impl RunRef {
    pub fn path(out: &Path) -> PathBuf {
        out.join("mlflow_run.json")
    }

    pub fn read(out: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(Self::path(out)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

/// A blocking client of one server.
pub struct Client {
    base: String,
    agent: ureq::Agent,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Client {
    pub fn new(uri: &str, timeout: Duration) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            base: uri.trim_end_matches('/').to_string(),
            agent,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        let mut resp = match body {
            Some(b) => self
                .agent
                .post(&url)
                .header("Content-Type", "application/json")
                .send(b.to_string().as_bytes()),
            None => self.agent.get(&url).call(),
        }
        .with_context(|| format!("{method} {url}"))?;
        let status = resp.status();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        if !status.is_success() {
            bail!("{method} {url}: {status}: {text}");
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The experiment's id, creating it if absent (a concurrent creator
    /// wins the race harmlessly).
    pub fn experiment(&self, name: &str) -> anyhow::Result<String> {
        let q = format!("experiments/get-by-name?experiment_name={}", encode(name));
        if let Ok(v) = self.call("GET", &q, None)
            && let Some(id) = v["experiment"]["experiment_id"].as_str()
        {
            return Ok(id.to_string());
        }
        match self.call("POST", "experiments/create", Some(&json!({ "name": name }))) {
            Ok(v) => v["experiment_id"]
                .as_str()
                .map(str::to_string)
                .context("experiments/create answered no experiment_id"),
            Err(_) => {
                let v = self.call("GET", &q, None)?;
                v["experiment"]["experiment_id"]
                    .as_str()
                    .map(str::to_string)
                    .context("experiment neither found nor created")
            }
        }
    }

    pub fn create_run(&self, experiment_id: &str, name: &str) -> anyhow::Result<String> {
        let v = self.call(
            "POST",
            "runs/create",
            Some(&json!({
                "experiment_id": experiment_id,
                "run_name": name,
                "start_time": now_ms(),
                "tags": [{"key": "mlflow.source.name", "value": "bapo"}],
            })),
        )?;
        v["run"]["info"]["run_id"]
            .as_str()
            .map(str::to_string)
            .context("runs/create answered no run_id")
    }

    /// Metrics (`(step, key, value)`) and params, at most 1000 metrics
    /// and 100 params a request (the server's limits).
    pub fn log_batch(
        &self,
        run_id: &str,
        metrics: &[(u64, String, f64)],
        params: &[(String, String)],
    ) -> anyhow::Result<()> {
        let ts = now_ms();
        for chunk in metrics.chunks(1000) {
            let m: Vec<Value> = chunk
                .iter()
                .map(|(step, k, v)| json!({"key": k, "value": v, "timestamp": ts, "step": step}))
                .collect();
            self.call(
                "POST",
                "runs/log-batch",
                Some(&json!({"run_id": run_id, "metrics": m})),
            )?;
        }
        for chunk in params.chunks(100) {
            let p: Vec<Value> = chunk
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            self.call(
                "POST",
                "runs/log-batch",
                Some(&json!({"run_id": run_id, "params": p})),
            )?;
        }
        Ok(())
    }

    /// Ends the run: `FINISHED`, `FAILED` or `KILLED`.
    pub fn finish(&self, run_id: &str, status: &str) -> anyhow::Result<()> {
        self.call(
            "POST",
            "runs/update",
            Some(&json!({"run_id": run_id, "status": status, "end_time": now_ms()})),
        )
        .map(drop)
    }

    /// Uploads `file` as the artefact `name` (a relative path) through the
    /// server's artefact proxy.
    pub fn upload(&self, run: &RunRef, file: &Path, name: &str) -> anyhow::Result<()> {
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{}/{}/artifacts/{}",
            self.base, run.experiment_id, run.run_id, name
        );
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let resp = self
            .agent
            .put(&url)
            .send(&bytes[..])
            .with_context(|| format!("PUT {url}"))?;
        if !resp.status().is_success() {
            bail!("PUT {url}: {}", resp.status());
        }
        Ok(())
    }
}

/// Query-string escaping of an experiment name.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The configuration as MLflow parameters: dotted keys, values as text
/// (cut to the server's 6000 characters).
pub fn params(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                params(&key, v, out);
            }
        }
        Value::Null => {}
        Value::String(s) => out.push((prefix.into(), s.chars().take(6000).collect())),
        other => out.push((
            prefix.into(),
            other.to_string().chars().take(6000).collect(),
        )),
    }
}

enum Msg {
    Metrics(u64, Vec<(String, f64)>),
    Finish(&'static str),
}

/// The learner's handle: a bounded queue to the sending thread.
pub struct Mlflow {
    tx: SyncSender<Msg>,
    worker: Option<JoinHandle<()>>,
}

/// What the sending thread needs to find or create its run.
struct Setup {
    cfg: MlflowConfig,
    out: PathBuf,
    params: Vec<(String, String)>,
}

impl Setup {
    /// The run `out` names (a restarted learner's), or a new one, its id
    /// kept in `out`; then the parameters.
    fn run(&self, client: &Client) -> anyhow::Result<String> {
        let resumed = RunRef::read(&self.out).filter(|r| r.uri == self.cfg.uri);
        let run = match resumed {
            Some(r) => r,
            None => {
                let experiment_id = client.experiment(&self.cfg.experiment)?;
                let name = match self.cfg.run_name.as_str() {
                    "" => self
                        .out
                        .file_name()
                        .map_or("bapo".into(), |n| n.to_string_lossy().into_owned()),
                    n => n.to_string(),
                };
                let run_id = client.create_run(&experiment_id, &name)?;
                let r = RunRef {
                    uri: self.cfg.uri.clone(),
                    experiment_id,
                    run_id,
                };
                let path = RunRef::path(&self.out);
                std::fs::write(&path, serde_json::to_string_pretty(&r)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                r
            }
        };
        if let Err(e) = client.log_batch(&run.run_id, &[], &self.params) {
            // A resumed run whose configuration changed: MLflow refuses
            // to change a parameter. The metrics still go there.
            tracing::warn!(
                error = format!("{e:#}"),
                "MLflow kept the run's earlier parameters"
            );
        }
        tracing::info!(
            run_id = run.run_id,
            uri = self.cfg.uri,
            "tracking in MLflow"
        );
        Ok(run.run_id)
    }
}

impl Mlflow {
    /// Starts the sending thread, which finds or creates the run (the one
    /// `out` names when the learner restarts) and logs `params`. A server
    /// that is down meanwhile is retried in the background: training
    /// starts either way, its records queued up to the bound.
    pub fn start(
        cfg: &MlflowConfig,
        out: &Path,
        params: Vec<(String, String)>,
    ) -> anyhow::Result<Self> {
        let client = Client::new(&cfg.uri, Duration::from_secs_f64(cfg.timeout_s));
        let setup = Setup {
            cfg: cfg.clone(),
            out: out.to_path_buf(),
            params,
        };
        let (tx, rx) = sync_channel(cfg.queue);
        let worker = std::thread::Builder::new()
            .name("mlflow".into())
            .spawn(move || {
                if let Some(run_id) = set_up(&client, &setup, &rx) {
                    send_loop(&client, &run_id, &rx);
                }
            })?;
        Ok(Self {
            tx,
            worker: Some(worker),
        })
    }

    /// Queues a step's values; never blocks (a full queue drops them).
    pub fn step(&self, step: u64, values: Vec<(String, f64)>) {
        match self.tx.try_send(Msg::Metrics(step, values)) {
            Ok(()) => metrics::gauge!(names::TRACKING_QUEUED, "sink" => "mlflow").increment(1.0),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                metrics::counter!(names::TRACKING_DROPPED, "sink" => "mlflow").increment(1);
            }
        }
    }

    /// Ends the run with `status` once the queue is sent, waiting at most
    /// `grace` (a dead server does not hold up the learner's exit).
    pub fn finish(mut self, status: &'static str, grace: Duration) {
        let Some(w) = self.worker.take() else { return };
        let deadline = Instant::now() + grace;
        // The queue may be full of records for a server that is down.
        while self.tx.try_send(Msg::Finish(status)).is_err() {
            if w.is_finished() || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        while !w.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if w.is_finished() {
            let _ = w.join();
        } else {
            tracing::warn!("MLflow did not take the last records in time; left unsent");
        }
    }
}

/// The run's id, retrying with backoff until the server answers; `None`
/// when the learner finished first.
fn set_up(client: &Client, setup: &Setup, rx: &Receiver<Msg>) -> Option<String> {
    let mut backoff = Duration::from_millis(200);
    let mut said = false;
    loop {
        match setup.run(client) {
            Ok(id) => return Some(id),
            Err(e) if !said => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "MLflow unreachable; training goes on, records queue and are retried"
                );
                said = true;
            }
            Err(_) => {}
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_secs(5));
        // A learner that has finished (handle dropped) ends the retries.
        if matches!(
            rx.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Disconnected)
        ) {
            return None;
        }
    }
}

/// Sends what the queue holds, up to 1000 metrics a request, retrying a
/// failed request with backoff (records keep arriving meanwhile, up to
/// the queue's bound).
fn send_loop(client: &Client, run_id: &str, rx: &Receiver<Msg>) {
    let mut pending: Vec<(u64, String, f64)> = Vec::new();
    let mut finish: Option<&'static str> = None;
    let mut backoff = Duration::from_millis(100);
    loop {
        let wait = if pending.is_empty() {
            Duration::from_secs(1)
        } else {
            Duration::ZERO
        };
        match rx.recv_timeout(wait) {
            Ok(m) => take(m, &mut pending, &mut finish),
            Err(RecvTimeoutError::Timeout) => {}
            // Dropped without `finish`: the learner stopped on an error.
            Err(RecvTimeoutError::Disconnected) => finish = finish.or(Some("FAILED")),
        }
        while pending.len() < 1000 {
            match rx.try_recv() {
                Ok(m) => take(m, &mut pending, &mut finish),
                Err(_) => break,
            }
        }
        if !pending.is_empty() {
            match client.log_batch(run_id, &pending, &[]) {
                Ok(()) => {
                    pending.clear();
                    backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    tracing::debug!(error = format!("{e:#}"), "MLflow unreachable; retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        }
        if let Some(status) = finish
            && pending.is_empty()
        {
            let _ = client.finish(run_id, status);
            return;
        }
    }
}

fn take(m: Msg, pending: &mut Vec<(u64, String, f64)>, finish: &mut Option<&'static str>) {
    match m {
        Msg::Metrics(step, values) => {
            metrics::gauge!(names::TRACKING_QUEUED, "sink" => "mlflow").decrement(1.0);
            pending.extend(values.into_iter().map(|(k, v)| (step, k, v)));
        }
        Msg::Finish(s) => *finish = Some(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_becomes_dotted_params() {
        let mut out = Vec::new();
        params(
            "learner",
            &json!({"lr": 1e-4, "algo": "bapo", "spear": {"tolerate_steps": 5}, "lora": null}),
            &mut out,
        );
        out.sort();
        assert_eq!(
            out,
            [
                ("learner.algo".to_string(), "bapo".to_string()),
                ("learner.lr".to_string(), "0.0001".to_string()),
                ("learner.spear.tolerate_steps".to_string(), "5".to_string()),
            ]
        );
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let ok = MlflowConfig {
            uri: "http://127.0.0.1:5000".into(),
            ..MlflowConfig::default()
        };
        assert!(ok.check().is_ok());
        let no_scheme = MlflowConfig {
            uri: "127.0.0.1:5000".into(),
            ..ok.clone()
        };
        assert!(no_scheme.check().unwrap_err().contains("uri"));
        let no_queue = MlflowConfig { queue: 0, ..ok };
        assert!(no_queue.check().unwrap_err().contains("queue"));
        assert_eq!(encode("a b/c"), "a%20b%2Fc");
    }

    /// A server that is down when the learner starts: the start does not
    /// fail or wait, steps queue without blocking, and no run is named
    /// until one is made.
    #[test]
    fn a_server_down_at_start_does_not_stop_the_learner() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cfg = MlflowConfig {
            uri: format!("http://127.0.0.1:{port}"),
            timeout_s: 0.2,
            ..MlflowConfig::default()
        };
        let out = tempfile::tempdir().unwrap();
        let m = Mlflow::start(&cfg, out.path(), Vec::new()).unwrap();
        for step in 0..100 {
            m.step(step, vec![("loss".into(), 1.0)]);
        }
        m.finish("FINISHED", Duration::from_millis(100));
        assert!(!RunRef::path(out.path()).exists());
    }

    /// A server that accepts connections and never answers: the learner's
    /// side never blocks, the queue fills, and what does not fit is
    /// dropped (the test would hang if `step` waited on the server).
    #[test]
    fn a_silent_server_never_blocks_the_learner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let uri = format!("http://{}", listener.local_addr().unwrap());
        let client = Client::new(&uri, Duration::from_millis(200));
        let (tx, rx) = sync_channel(4);
        let worker = std::thread::spawn(move || send_loop(&client, "r", &rx));
        let m = Mlflow {
            tx,
            worker: Some(worker),
        };
        let t0 = Instant::now();
        for step in 0..1000 {
            m.step(step, vec![("loss".into(), 1.0)]);
        }
        // 1000 try_sends against a full queue take microseconds; the
        // bound is generous so that a loaded machine cannot fail it.
        assert!(t0.elapsed() < Duration::from_secs(5));
        m.finish("FINISHED", Duration::from_millis(100));
        drop(listener);
    }
}
