//! Multi-turn episodes end to end: `bapo run` (buffer, learner and two
//! actors, each its own process) on `arith-tool`, every episode played
//! against the Python reference environment server
//! (`examples/env-server`, `--env calculator`, started by the project's
//! own script). The model calls the calculator, reads its result and
//! answers; the run trains, its books reconcile, and the actors' metrics
//! show episodes of more than one turn and tool calls.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use std::io::{BufRead, BufReader, Read, Write};

/// The reference environment server on a free loopback port, and the
/// address it bound; killed on drop.
struct EnvServer {
    child: std::process::Child,
    addr: String,
}

impl Drop for EnvServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn env_server(args: &[&str]) -> EnvServer {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/env-server.sh");
    let mut child = Command::new("bash")
        .arg(script)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("bash runs scripts/env-server.sh");
    // The first start builds the venv (pip, about 10 s here).
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the environment server prints its address");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    EnvServer { child, addr }
}

fn config(endpoint: &str) -> String {
    format!(
        r#"
[run]
actors = 2
eval_problems = 50
pass_k = 1

[task]
name = "arith-tool"
difficulty = 2

[sft]
steps = 400
batch = 32
lr = 6e-3
warmup_steps = 20

[buffer]
max_staleness = 4

[learner]
batch_groups = 2
lr = 1e-4
steps = 6
eval_every = 3
eval_max_new_tokens = 24

[actor]
group_size = 4
concurrency = 1
shutdown_grace_s = 2.0

[actor.sampling]
temperature = 1.0
max_new_tokens = 24

[actor.env]
kind = "grpc"
endpoint = "grpc://{endpoint}"
max_turns = 3
max_episode_tokens = 96
max_observation_tokens = 32
step_timeout_ms = 5000
"#
    )
}

fn scrape(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/')?;
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// The value of an unlabelled sample `name` in an exposition.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

#[test]
fn bapo_run_trains_on_multi_turn_episodes_from_a_python_environment() {
    let server = env_server(&["--env", "calculator"]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bapo.toml");
    std::fs::write(&cfg, config(&server.addr)).unwrap();
    let out = dir.path().join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();

    // Each actor's episode metrics, the last seen while the run is up.
    let mut last = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        if let Some(services) = read_json(&out.join("services.json")) {
            for name in ["actor-0", "actor-1"] {
                if let Some(body) = services["metrics"][name].as_str().and_then(scrape) {
                    let turns = sample(&body, "bapo_actor_episode_turns_sum");
                    let episodes = sample(&body, "bapo_actor_episode_turns_count");
                    let calls = sample(&body, "bapo_actor_tool_calls_total");
                    if let (Some(t), Some(e)) = (turns, episodes) {
                        last.insert(name, (t, e, calls.unwrap_or(0.0)));
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "bapo run failed");
    let s = read_json(&out.join("summary.json")).expect("summary.json");
    assert_eq!(s["steps"], 6, "{s}");
    assert_eq!(s["reconciled"], true, "{s}");
    let (turns, episodes, calls): (f64, f64, f64) = last
        .values()
        .fold((0.0, 0.0, 0.0), |a, v| (a.0 + v.0, a.1 + v.1, a.2 + v.2));
    assert!(episodes >= 6.0 * 2.0 * 4.0, "episodes seen: {last:?}");
    assert!(
        calls >= 1.0,
        "no tool call in {episodes} episodes: {last:?}"
    );
    assert!(
        turns > episodes,
        "every episode had one turn ({turns} turns in {episodes}): {last:?}"
    );
}
