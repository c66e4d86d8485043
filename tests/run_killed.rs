//! `bapo run` killed with SIGKILL takes its services with it: each child
//! gets SIGTERM from the kernel when its parent dies (and stops as it
//! would on a Ctrl-C), instead of staying up orphaned on its ports.

use std::{
    net::TcpStream,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

const CONFIG: &str = r#"
[run]
actors = 1
sft = false
eval_problems = 10

[learner]
batch_groups = 2
steps = 100000
eval_every = 0
checkpoint_every = 0

[actor]
group_size = 2
concurrency = 1
shutdown_grace_s = 1.0
"#;

fn addresses(out: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(out.join("services.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let host = |url: &str| {
        url.split("://")
            .nth(1)
            .map(|h| h.trim_end_matches('/').to_string())
    };
    let mut all = vec![host(v["buffer"].as_str()?)?, host(v["learner"].as_str()?)?];
    for m in v["metrics"].as_object()?.values() {
        all.push(host(m.as_str()?)?.split('/').next()?.to_string());
    }
    Some(all)
}

fn listening(addr: &str) -> bool {
    addr.parse()
        .is_ok_and(|a| TcpStream::connect_timeout(&a, Duration::from_millis(200)).is_ok())
}

#[test]
fn a_killed_bapo_run_leaves_no_service_behind() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bapo.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let out = dir.path().join("run");
    let mut run = Command::new(env!("CARGO_BIN_EXE_bapo"))
        .args(["run", "--quiet", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(120);
    let addrs = loop {
        assert!(Instant::now() < deadline, "the services never came up");
        assert!(run.try_wait().unwrap().is_none(), "bapo run exited early");
        if let Some(a) = addresses(&out)
            && a.iter().all(|a| listening(a))
        {
            break a;
        }
        std::thread::sleep(Duration::from_millis(200));
    };

    run.kill().unwrap(); // SIGKILL: no handler, no cleanup of its own
    run.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while addrs.iter().any(|a| listening(a)) {
        assert!(
            Instant::now() < deadline,
            "services still listening 30 s after bapo run was killed: {:?}",
            addrs.iter().filter(|a| listening(a)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
