//! MLflow tracking against a real `mlflow server` (`scripts/mlflow.sh
//! serve`, built from PyPI on first use): a short `bapo run` logs its
//! resolved configuration, every step's values and its files; a server
//! that stops answering (SIGSTOP) and then dies (SIGKILL) mid-run costs
//! training nothing but the records its bounded queue drops, and says so
//! in the learner's metrics.

mod common;

use std::{
    io::{BufRead, BufReader},
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{read_json, scrape};
use serde_json::Value;

/// `mlflow.sh serve` as a process-group leader, so a signal reaches the
/// server processes below it.
struct Server {
    child: Child,
    uri: String,
}

impl Server {
    fn start(dir: &Path) -> Self {
        let log = std::fs::File::create(dir.join("mlflow.log")).unwrap();
        let mut child = Command::new("bash")
            .args(["scripts/mlflow.sh", "serve"])
            .arg(dir.join("store"))
            .process_group(0)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("mlflow.sh serve printed {line:?}; see {}", dir.display()));
        Self {
            uri: format!("http://{addr}"),
            child,
        }
    }

    fn signal(&self, sig: &str) {
        let group = format!("-{}", self.child.id());
        let ok = Command::new("kill")
            .args([sig, "--", &group])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {group}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

fn config(uri: &str, experiment: &str, queue: usize, steps: u64) -> String {
    format!(
        r#"
[run]
actors = 1
sft = false
eval_problems = 20

[buffer]
max_staleness = 2

[learner]
batch_groups = 2
lr = 1e-4
steps = {steps}
checkpoint_every = 50
eval_every = 6
eval_problems = 20
eval_max_new_tokens = 8

[learner.mlflow]
uri = "{uri}"
experiment = "{experiment}"
queue = {queue}
timeout_s = 1.0
log_model = true

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
max_new_tokens = 8
"#
    )
}

fn bapo_run(dir: &Path, config: &str) -> Child {
    let path = dir.join("bapo.toml");
    std::fs::write(&path, config).unwrap();
    Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--config"])
        .arg(&path)
        .arg("--out")
        .arg(dir.join("run"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// What the server holds for `experiment` (`scripts/mlflow.sh read`).
fn read_back(uri: &str, experiment: &str) -> Value {
    let out = Command::new("bash")
        .args(["scripts/mlflow.sh", "read", uri, experiment])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn steps_of(run: &Value, key: &str) -> Vec<u64> {
    run["metrics"][key]
        .as_array()
        .unwrap_or_else(|| panic!("no metric {key}: {}", run["metrics"]))
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect()
}

#[test]
fn a_run_logs_its_configuration_every_step_and_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut run = bapo_run(dir.path(), &config(&server.uri, "bapo-test", 10_000, 12));
    assert!(run.wait().unwrap().success(), "bapo run failed");

    let back = read_back(&server.uri, "bapo-test");
    let runs = back["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{back}");
    let r = &runs[0];
    assert_eq!(r["status"], "FINISHED");
    assert_eq!(r["run_name"], "run", "named for the run directory");
    let p = &r["params"];
    assert_eq!(p["learner.algo"], "bapo", "{p}");
    assert_eq!(p["learner.lr"], "0.0001");
    assert_eq!(p["learner.batch_groups"], "2");
    assert!(
        p["model.preset"].is_string(),
        "the whole configuration: {p}"
    );
    assert_eq!(steps_of(r, "train/loss"), (1..=12).collect::<Vec<u64>>());
    assert_eq!(steps_of(r, "train/reward_mean").len(), 12);
    assert_eq!(steps_of(r, "eval/accuracy"), [0, 6, 12]);
    let files: Vec<&str> = r["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    for f in [
        "summary.json",
        "report.html",
        "metrics.jsonl",
        "config.toml",
        "final/model.safetensors",
        "final/config.json",
    ] {
        assert!(files.contains(&f), "{f} not in {files:?}");
    }
    let id = read_json(&dir.path().join("run/mlflow_run.json")).unwrap();
    assert_eq!(id["run_id"], r["run_id"]);
}

/// The server stops answering after the run is created, then dies: the
/// run finishes every step, its steps keep coming while the server is
/// stopped, and what the tiny queue could not hold is counted as dropped.
#[test]
fn a_dead_server_never_holds_up_training() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let steps = 24;
    let mut run = bapo_run(dir.path(), &config(&server.uri, "dead", 2, steps));
    let out = dir.path().join("run");
    let count_steps = || {
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count())
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut waiting = |what: &str| {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        assert!(
            run_alive(&mut run),
            "bapo run ended while waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    while !out.join("mlflow_run.json").exists() {
        waiting("the MLflow run");
    }
    server.signal("-STOP");
    let stopped_at = count_steps();
    let mut dropped = 0.0f64;
    while count_steps() < stopped_at + 6 {
        dropped = dropped.max(learner_dropped(&out));
        waiting("steps with the server stopped");
    }
    server.signal("-KILL");
    while run_alive(&mut run) {
        dropped = dropped.max(learner_dropped(&out));
        assert!(Instant::now() < deadline, "bapo run did not finish");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(run.wait().unwrap().success(), "bapo run failed");
    assert_eq!(count_steps() as u64, steps, "every step trained and logged");
    assert!(
        dropped > 0.0,
        "a queue of 2 with the server stopped for 6 steps drops records"
    );
}

fn run_alive(run: &mut Child) -> bool {
    run.try_wait().unwrap().is_none()
}

/// `bapo_learner_tracking_dropped_total` from the learner's `/metrics`.
fn learner_dropped(out: &Path) -> f64 {
    let Some(services) = read_json(&out.join("services.json")) else {
        return 0.0;
    };
    let Some(url) = services["metrics"]["learner"].as_str() else {
        return 0.0;
    };
    scrape(url)
        .and_then(|body| {
            body.lines()
                .find(|l| l.starts_with("bapo_learner_tracking_dropped_total"))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        })
        .unwrap_or(0.0)
}

/// A learner that stops without finishing (killed, or restarted with the
/// same flags) and starts again logs into the same MLflow run, found
/// through `<out>/mlflow_run.json`: one run holds both incarnations'
/// steps; TensorBoard's own reader, given the two event files, keeps the
/// restarted incarnation's values for the steps it redid.
#[test]
fn a_restarted_learner_continues_its_run() {
    use bapo_learner::{
        record::StepRecord,
        tracking::{Sinks, Tracking, mlflow::MlflowConfig},
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let out = dir.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    let tb = out.join("tensorboard");
    let m = MlflowConfig {
        uri: server.uri.clone(),
        experiment: "restart".into(),
        ..MlflowConfig::default()
    };
    let sinks = Sinks {
        tensorboard: Some(&tb),
        sample_rollouts: 0,
        mlflow: Some(&m),
    };
    let params = serde_json::json!({"learner": {"lr": 1e-4}});
    let record = |step: u64, loss: f64| {
        let mut r = StepRecord {
            step,
            ..StepRecord::default()
        };
        r.set("loss", loss);
        r
    };
    // The first incarnation reaches step 5, then stops without finishing
    // its run; the second resumes from a checkpoint at step 3.
    let mut first = Tracking::open(&sinks, &out, None, 0, &params).unwrap();
    for step in 1..=5 {
        first.step(&record(step, 1.0), &[]);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !out.join("mlflow_run.json").exists() {
        assert!(
            Instant::now() < deadline,
            "the first incarnation made no run"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2)); // its queue drained
    drop(first);
    // Its thread marks the run FAILED and ends; then a later event file.
    std::thread::sleep(Duration::from_secs(1));
    let mut second = Tracking::open(&sinks, &out, None, 3, &params).unwrap();
    for step in 4..=6 {
        second.step(&record(step, 2.0), &[]);
    }
    second.finish(true);

    let back = read_back(&server.uri, "restart");
    let runs = back["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "one run for both incarnations: {back}");
    assert_eq!(runs[0]["status"], "FINISHED");
    let steps = steps_of(&runs[0], "train/loss");
    assert_eq!(steps.iter().max(), Some(&6));
    assert!(steps.contains(&1) && steps.contains(&5), "{steps:?}");

    let read = Command::new("bash")
        .args(["scripts/tensorboard.sh", "read"])
        .arg(&tb)
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let tb: Value = serde_json::from_slice(&read.stdout).unwrap();
    assert_eq!(tb["errors"], serde_json::json!([]));
    let loss = &tb["runs"]["."]["scalars"]["train/loss"];
    assert_eq!(
        loss["steps"],
        serde_json::json!([1, 2, 3, 4, 5, 6]),
        "{loss}"
    );
    assert_eq!(
        loss["values"],
        serde_json::json!([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]),
        "the restarted incarnation's values for the steps it redid"
    );
}
