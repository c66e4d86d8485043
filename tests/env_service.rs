//! Multi-turn episodes end to end: `bapo run` (buffer, learner and two
//! actors, each its own process) on `arith-tool`, every episode played
//! against the Python reference environment server
//! (`examples/env-server`, `--env calculator`, started by the project's
//! own script), a group's four members at once (`parallel_members`;
//! tests/env_faults.rs plays them in turn against the same server). The
//! model calls the calculator, reads its result and answers; the run
//! trains, its books reconcile, and the actors' metrics show episodes of
//! more than one turn and tool calls. The server requires client
//! certificates (`--client-ca`): the actors present theirs
//! (`[actor.env] cert`, `key`), issued by the test's own CA.

mod common;

use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bapo_proto::tls::pki::{Ca, Options};

use common::{read_json, scrape};

fn config(endpoint: &str, tls: &Path) -> String {
    let f = |name: &str| tls.join(name).display().to_string();
    let (ca, cert, key) = (f("ca.pem"), f("actor.pem"), f("actor.key"));
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
endpoint = "grpcs://{endpoint}"
ca = "{ca}"
cert = "{cert}"
key = "{key}"
max_turns = 3
max_episode_tokens = 96
max_observation_tokens = 32
step_timeout_ms = 5000
parallel_members = true
"#
    )
}

/// The value of an unlabelled sample `name` in an exposition.
fn sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Without a client certificate the server answers nothing (the TLS
/// handshake fails); with one of the CA's it describes itself.
async fn only_a_certified_actor_is_served(addr: &str, tls: &Path) {
    use bapo_actor::env::{EnvConfig, EnvKind, Environment, remote::Remote};
    let mut cfg = EnvConfig {
        kind: EnvKind::Grpc,
        endpoint: format!("grpcs://{addr}"),
        ca: Some(tls.join("ca.pem")),
        ..Default::default()
    };
    let url = format!("https://{addr}");
    let anonymous = Remote::new(&cfg, &url, true).unwrap();
    let refused = anonymous.describe().await.unwrap_err();
    // The server drops the connection in the handshake; whether the call
    // sees that as a transport error or as its request cancelled is a
    // race (both seen under load), and neither is an answer.
    let m = &refused.message;
    assert!(
        m.contains("transport error") || m.contains("operation was canceled"),
        "{refused}"
    );
    cfg.cert = Some(tls.join("actor.pem"));
    cfg.key = Some(tls.join("actor.key"));
    let certified = Remote::new(&cfg, &url, true).unwrap();
    let info = certified.describe().await.unwrap();
    assert!(info.name.contains("calculator"), "{info:?}");
}

#[test]
fn bapo_run_trains_on_multi_turn_episodes_from_a_python_environment() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tls = dir.path().join("tls");
    let ca = Ca::new("env-test").unwrap();
    let hosts = Options {
        hosts: vec!["127.0.0.1".into()],
        valid: None,
    };
    let server = ca
        .write(&tls, "server", &ca.issue("env", &hosts).unwrap())
        .unwrap();
    ca.write(
        &tls,
        "actor",
        &ca.issue("actor/a", &Options::default()).unwrap(),
    )
    .unwrap();
    let path = |p: &Path| p.display().to_string();
    let args = [
        "--env".to_string(),
        "calculator".into(),
        "--tls-cert".into(),
        path(&server.cert),
        "--tls-key".into(),
        path(&server.key),
        "--client-ca".into(),
        path(&server.ca),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The server lives (and is killed on drop) with `_server`.
    let (_server, addr) = rt.block_on(common::script_server("env-server.sh", "127.0.0.1:0", &args));
    rt.block_on(only_a_certified_actor_is_served(&addr, &tls));
    let cfg = dir.path().join("bapo.toml");
    std::fs::write(&cfg, config(&addr, &tls)).unwrap();
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
