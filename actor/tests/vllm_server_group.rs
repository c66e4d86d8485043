//! A started vLLM server's processes end with the actor, however it ends.
//! The API server starts engine and worker processes of its own (each
//! holding gigabytes) that outlive it unless it exits gracefully; here a
//! fake `python` does the same with a background `sleep`, and the test
//! checks that both are gone after the supervisor is dropped (a test's
//! or an actor's runtime ending) and after the process running it is
//! killed with SIGKILL (the actor killed; run in a child process, this
//! test binary itself). Also: a `python` that cannot run, or a server
//! that keeps dying, ends supervision with an error that names it.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use bapo_actor::vllm::{
    VllmConfig,
    server::{self, Launch},
};
use tokio::sync::watch;

/// Stands in for `python -m vllm...`: an "engine" in the background, as
/// vLLM's API server starts, then waits; all pids written down. A third
/// process leaves the group and the session (`setsid`), as a
/// daemonizing helper would, and its parent exits: only the leader's
/// subreaper role and its walk of /proc can find it.
const FAKE_PYTHON: &str = r#"#!/bin/sh
sleep 300 &
echo $! > "$FAKE_DIR/engine.pid.tmp" && mv "$FAKE_DIR/engine.pid.tmp" "$FAKE_DIR/engine.pid"
sh -c 'setsid sh -c "echo \$\$ > \"$FAKE_DIR/escaped.pid.tmp\"; exec sleep 300" &'
until [ -s "$FAKE_DIR/escaped.pid.tmp" ]; do sleep 0.05; done
mv "$FAKE_DIR/escaped.pid.tmp" "$FAKE_DIR/escaped.pid"
echo $$ > "$FAKE_DIR/server.pid.tmp" && mv "$FAKE_DIR/server.pid.tmp" "$FAKE_DIR/server.pid"
wait
"#;

/// The env var that makes `child_actor_runs_a_server` run.
const CHILD_DIR: &str = "BAPO_TEST_FAKE_VLLM_DIR";

fn launch(dir: &Path, python: PathBuf) -> Launch {
    let cfg = VllmConfig {
        python,
        env: [("FAKE_DIR".to_string(), dir.display().to_string())].into(),
        start_timeout_s: 600.0,
        ..Default::default()
    };
    Launch {
        cfg,
        model_dir: dir.to_path_buf(),
        socket: dir.join("vllm.sock"),
        ext_dir: dir.join("ext"),
        log: dir.join("vllm.log"),
    }
}

fn fake_python(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("python");
    std::fs::write(&path, FAKE_PYTHON).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A process is alive while /proc has it and it is not a zombie.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z'))
}

fn wait_until(what: &str, secs: u64, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The fake server's, engine's and escaped helper's pids, once all are up.
fn pids(dir: &Path) -> [i32; 3] {
    let read = |name: &str| {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
    };
    wait_until("the fake server never started", 60, || {
        ["server.pid", "engine.pid", "escaped.pid"]
            .iter()
            .all(|f| read(f).is_some())
    });
    let pids = ["server.pid", "engine.pid", "escaped.pid"].map(|f| read(f).unwrap());
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?} not running");
    pids
}

fn all_gone(pids: [i32; 3], after: &str) {
    wait_until(
        &format!("server, engine or escaped {pids:?} still running after {after}"),
        30,
        || pids.iter().all(|&p| !alive(p)),
    );
}

#[test]
fn a_dropped_supervisor_takes_the_servers_processes_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (up, _) = watch::channel(false);
    let (_stop_tx, stop) = watch::channel(false);
    let task = rt.spawn(server::supervise(
        launch(dir.path(), fake_python(dir.path())),
        up,
        stop,
    ));
    let pids = pids(dir.path());
    task.abort();
    all_gone(pids, "the supervisor was dropped");
}

#[test]
fn a_killed_actor_takes_the_servers_processes_with_it() {
    let dir = tempfile::tempdir().unwrap();
    fake_python(dir.path());
    let mut actor = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_actor_runs_a_server", "--ignored"])
        .env(CHILD_DIR, dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pids = pids(dir.path());
    actor.kill().unwrap(); // SIGKILL: nothing of the actor runs after it
    actor.wait().unwrap();
    all_gone(pids, "the actor was killed");
}

/// Not a test of its own: the "actor" `a_killed_actor_...` starts and
/// kills (it does nothing without its env var).
#[test]
#[ignore = "a helper process of a_killed_actor_takes_the_servers_processes_with_it"]
fn child_actor_runs_a_server() {
    let Some(dir) = std::env::var_os(CHILD_DIR).map(PathBuf::from) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (up, _) = watch::channel(false);
    let (_stop_tx, stop) = watch::channel(false);
    let _ = rt.block_on(server::supervise(
        launch(&dir, dir.join("python")),
        up,
        stop,
    ));
}

#[tokio::test]
async fn a_python_that_cannot_run_is_named_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let (up, _) = watch::channel(false);
    let (_stop_tx, stop) = watch::channel(false);
    let missing = dir.path().join("no-venv/bin/python");
    let run = server::supervise(launch(dir.path(), missing), up, stop);
    let err = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("a missing python was retried")
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("no-venv/bin/python") && msg.contains("scripts/vllm-env.sh"),
        "{msg}"
    );
}

/// A server that keeps dying is given up after `max_restarts`, and the
/// error carries the end of its log: the log itself may be in a
/// directory that goes with the actor.
#[tokio::test]
async fn a_server_that_keeps_dying_is_given_up_with_its_last_words() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python");
    std::fs::write(
        &python,
        "#!/bin/sh\necho 'ValueError: no such model' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut l = launch(dir.path(), python);
    l.cfg.max_restarts = 1;
    let (up, _) = watch::channel(false);
    let (_stop_tx, stop) = watch::channel(false);
    let err = tokio::time::timeout(Duration::from_secs(60), server::supervise(l, up, stop))
        .await
        .expect("never given up")
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("gave up after 1 restarts"), "{msg}");
    assert!(msg.contains("ValueError: no such model"), "{msg}");
}

/// Stands in for a server on `--uds PATH`: answers `GET /health` with
/// 200 on that Unix socket, and nothing on any TCP port.
const FAKE_UDS_SERVER: &str = r#"#!/bin/sh
exec python3 - "$@" <<'PY'
import socket, sys
path = sys.argv[sys.argv.index("--uds") + 1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(8)
while True:
    c, _ = s.accept()
    c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    c.close()
PY
"#;

/// A started server is reached on a Unix socket in the actor's private
/// directory (0700), a stale socket file there is replaced, and the
/// server's dev endpoints are on no TCP port.
#[tokio::test]
async fn a_started_server_is_reached_on_the_actors_private_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python");
    std::fs::write(&python, FAKE_UDS_SERVER).unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = VllmConfig {
        python,
        start_timeout_s: 60.0,
        ..Default::default()
    };
    let (_w_tx, weights) = watch::channel(None);
    let (stop_tx, stop) = watch::channel(false);
    let started = bapo_actor::vllm::start(
        &cfg,
        bapo_actor::UpdateMode::Partial,
        Some(dir.path().to_path_buf()),
        weights,
        stop,
    )
    .unwrap();
    let socket = PathBuf::from(started.engine.url().strip_prefix("unix:").unwrap());
    let private = socket.parent().unwrap();
    let mode = std::fs::metadata(private).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{}", private.display());
    let t0 = Instant::now();
    while !is_socket(&socket) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no socket at {socket:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let api = bapo_actor::vllm::api::Api::unix(&socket, "bapo");
    let t0 = Instant::now();
    while !api.healthy(Duration::from_secs(2)).await {
        assert!(t0.elapsed() < Duration::from_secs(60), "never healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(true);
    let _ = started.background.await;
}

fn is_socket(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// A stale socket file where the server will listen (an actor killed
/// before it could remove it) does not stop the restarted server.
#[tokio::test]
async fn a_stale_socket_is_replaced() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let python = dir.path().join("python");
    std::fs::write(&python, FAKE_UDS_SERVER).unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let l = launch(dir.path(), python);
    let stale = std::os::unix::net::UnixListener::bind(&l.socket).unwrap();
    drop(stale); // the file stays, nobody listens
    let socket = l.socket.clone();
    let (up, mut up_rx) = watch::channel(false);
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(server::supervise(l, up, stop));
    tokio::time::timeout(Duration::from_secs(60), up_rx.wait_for(|u| *u))
        .await
        .expect("the server never came up on its socket")
        .unwrap();
    assert!(is_socket(&socket));
    let _ = stop_tx.send(true);
    let _ = task.await;
}
