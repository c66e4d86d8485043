//! A vLLM server the actor starts and keeps alive: one child process
//! (with its own engine and worker processes under it), restarted with
//! backoff when it dies or stops answering, a bounded number of times;
//! past that the actor exits non-zero, loudly, so the orchestrator sees
//! it.
//!
//! The server's processes die with the actor however it ends, so a killed
//! actor restarted with the same flags finds its port and memory free
//! (each engine and worker holds gigabytes): they run in a process group
//! of their own, killed whole when the actor stops it, restarts it, or
//! drops it; and a small `sh` leader in that group, told to take a
//! SIGTERM when the actor dies (`PR_SET_PDEATHSIG`, even by SIGKILL),
//! kills the group and every process below it, those that left the
//! group included (see [`GROUP_LEADER`]). The API server alone would take
//! its engine and worker processes with it only on a graceful exit.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use metrics::counter;
use tokio::{process::Child, sync::watch};

use super::{api::Api, config::VllmConfig};
use crate::{backoff::Backoff, metrics as names};

/// bapo's worker extension, shipped inside the binary and written next to
/// the weights, so a started server needs nothing from the source tree.
pub const EXTENSION: &str = include_str!("../../vllm/bapo_vllm_ext.py");
const EXTENSION_CLASS: &str = "bapo_vllm_ext.BapoWorker";

/// After this long healthy, earlier restarts are forgiven.
const HEALTHY_RESET: Duration = Duration::from_secs(3600);

/// How a started server is launched.
pub struct Launch {
    pub cfg: VllmConfig,
    pub model_dir: PathBuf,
    /// The Unix socket it serves on, in a directory only the actor can
    /// enter: its dev endpoints (pause, reload, adapters, collective
    /// RPCs) are then the actor's alone, and what answers there is the
    /// server the actor started (a stale socket is removed first).
    pub socket: PathBuf,
    /// Where the extension module is written (PYTHONPATH of the server).
    pub ext_dir: PathBuf,
    /// The server's stdout and stderr go here.
    pub log: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "vLLM server: could not start {python} ({source}); make its venv with scripts/vllm-env.sh or set actor.vllm.python"
    )]
    Spawn {
        python: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "vLLM server: gave up after {restarts} restarts (last: {last}); its log is {log}, \
         which ended:\n{tail}"
    )]
    GaveUp {
        restarts: u32,
        last: String,
        log: String,
        /// The log's last lines: a log in the actor's own temporary
        /// directory is gone once the actor has exited.
        tail: String,
    },
}

impl Launch {
    /// Where it serves, for people.
    pub fn url(&self) -> String {
        format!("unix:{}", self.socket.display())
    }

    fn api(&self) -> Api {
        Api::unix(&self.socket, &self.cfg.served_model_name)
    }

    /// `sh` leading the server's process group (see the module's doc);
    /// it exits with the server's status.
    fn command(&self) -> Result<tokio::process::Command, std::io::Error> {
        std::fs::create_dir_all(&self.ext_dir)?;
        match std::fs::remove_file(&self.socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::write(self.ext_dir.join("bapo_vllm_ext.py"), EXTENSION)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let c = &self.cfg;
        let mut cmd = tokio::process::Command::new("sh");
        cmd.args(["-c", GROUP_LEADER, "sh"])
            .arg(&c.python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&self.model_dir)
            .args(["--served-model-name", &c.served_model_name])
            .arg("--uds")
            .arg(&self.socket)
            .args(["--dtype", &c.dtype, "--enable-scale-out"])
            .args(["--logprobs-mode", "processed_logprobs"])
            .args(["--worker-extension-cls", EXTENSION_CLASS])
            // bapo's weight-transfer engine (the extension registers it):
            // versions arrive as patches, in place.
            .args(transfer_args(c.weight_transfer))
            .args(lora_args(c.lora_rank))
            .args(&c.extra_args)
            .env("PYTHONPATH", &self.ext_dir)
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_CPU_KVCACHE_SPACE", c.cpu_kv_cache_gib.to_string())
            .env("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .envs((c.lora_rank > 0).then_some(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")))
            .envs(&c.env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Not `kill_on_drop`: a SIGKILL would stop the leader before
            // it kills what left its group ([`Running`] signals it).
            .process_group(0);
        // An actor that died between the fork and the prctl sends no
        // signal: the leader then finds itself adopted and does not start.
        // SAFETY: prctl and getppid are async-signal-safe and touch no
        // memory of ours.
        let actor = std::process::id() as libc::pid_t;
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
                if libc::getppid() != actor {
                    // No allocation after the fork: a raw OS error.
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        Ok(cmd)
    }
}

/// The server's `sh` leader runs the server in the background and waits
/// for it. It is a child subreaper (set before its exec), so a process
/// of the server's that left the group (`setsid`, a daemon's double fork)
/// is re-parented to it, not to init, once its own parent is gone. A
/// SIGTERM (the actor died), SIGHUP or SIGINT makes it kill every process
/// below it (found by parent links in /proc, so those outside the group
/// too), then the group, itself included; when the server exits on its
/// own, it kills what is left below it and exits with the server's
/// status.
const GROUP_LEADER: &str = r#"
below() {
  grep -H '^PPid:' /proc/[0-9]*/status 2>/dev/null | awk -F'[/:\t ]+' -v root=$$ '
    { kids[$NF] = kids[$NF] " " $3 }
    END { q = root; while (q != "") { n = split(q, a, " "); q = "";
      for (i = 1; i <= n; i++) { m = split(kids[a[i]], c, " ");
        for (j = 1; j <= m; j++) { print c[j]; q = q " " c[j] } } } }'
}
reap() { for _ in 1 2 3; do p=$(below); [ -n "$p" ] || break; kill -KILL $p 2>/dev/null; done; }
trap 'trap "" TERM HUP INT; reap; kill -KILL 0' TERM HUP INT
"$@" & wait $!; s=$?
trap '' TERM HUP INT; reap; exit $s"#;

/// `sh`'s status when the command could not be found or run.
const NOT_RUNNABLE: [i32; 2] = [126, 127];

/// A started server's process group, killed whole when dropped: the API
/// server and the engine and worker processes under it, which outlive it
/// otherwise. By the group id taken at spawn: once the leader has exited
/// and been reaped, `child.id()` is gone but the rest of its group is not.
struct Running {
    child: Child,
    group: u32,
}

/// How long the leader may take to kill what is below it.
const REAP_GRACE: Duration = Duration::from_secs(10);

impl Running {
    /// Asks the leader to kill everything below it, then its group; with
    /// the leader gone, kills the group directly (what left it was
    /// killed by the leader when the server exited).
    fn kill(&mut self) {
        let leader_up = matches!(self.child.try_wait(), Ok(None));
        // SAFETY: plain signals to the process and group we created.
        unsafe {
            if leader_up {
                libc::kill(self.group as i32, libc::SIGTERM);
            } else {
                libc::killpg(self.group as i32, libc::SIGKILL);
            }
        }
    }

    /// Kills and waits for the leader, SIGKILL to the group past
    /// [`REAP_GRACE`].
    async fn stop(&mut self) {
        self.kill();
        if tokio::time::timeout(REAP_GRACE, self.child.wait())
            .await
            .is_err()
        {
            // SAFETY: as in `kill`.
            unsafe {
                libc::killpg(self.group as i32, libc::SIGKILL);
            }
            let _ = self.child.wait().await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Why a server is no longer usable.
enum Down {
    /// It exited, never answered or stopped answering.
    Because(String),
    /// `python` could not be run at all: restarting cannot help.
    NotRunnable(i32),
}

/// Starts the server and keeps it up until `stop`; sets `up` to true while
/// it answers `/health` (false while it starts or restarts). Returns an
/// error only when it gave up.
pub async fn supervise(
    launch: Launch,
    up: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let api = launch.api();
    let mut backoff = Backoff::new(Duration::from_secs(2), Duration::from_secs(60));
    let mut restarts = 0u32;
    loop {
        let mut cmd = launch.command().map_err(|source| ServerError::Spawn {
            python: launch.cfg.python.display().to_string(),
            source,
        })?;
        let child = cmd.spawn().map_err(|source| ServerError::Spawn {
            python: launch.cfg.python.display().to_string(),
            source,
        })?;
        // `process_group(0)`: the group id is the leader's pid.
        // (`id()` is `None` only once tokio has reaped it: not yet.)
        let group = child.id().ok_or_else(|| ServerError::Spawn {
            python: launch.cfg.python.display().to_string(),
            source: std::io::Error::other("the leader was reaped before its pid was read"),
        })?;
        let mut server = Running { group, child };
        tracing::info!(url = %launch.url(), log = %launch.log.display(), "vLLM server starting");
        let started = Instant::now();
        let why = tokio::select! {
            why = watch_one(&api, &mut server.child, &launch.cfg, &up) => Some(why),
            _ = stop.wait_for(|s| *s) => None,
        };
        server.stop().await;
        let why = match why {
            None => return Ok(()),
            Some(Down::Because(why)) => why,
            Some(Down::NotRunnable(code)) => {
                return Err(ServerError::Spawn {
                    python: launch.cfg.python.display().to_string(),
                    source: std::io::Error::other(format!(
                        "sh could not run it: exit status {code}"
                    )),
                });
            }
        };
        let _ = up.send(false);
        if started.elapsed() > HEALTHY_RESET {
            restarts = 0;
        }
        restarts += 1;
        counter!(names::ENGINE_RESTARTS).increment(1);
        if restarts > launch.cfg.max_restarts {
            return Err(ServerError::GaveUp {
                restarts: restarts - 1,
                last: why,
                log: launch.log.display().to_string(),
                tail: log_tail(&launch.log),
            });
        }
        tracing::warn!("vLLM server down ({why}); restart {restarts}");
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = stop.wait_for(|s| *s) => return Ok(()),
        }
    }
}

/// Waits for one server process to come up, then watches it; returns why
/// it is no longer usable (exited, never answered, stopped answering).
async fn watch_one(
    api: &Api,
    child: &mut Child,
    cfg: &VllmConfig,
    up: &watch::Sender<bool>,
) -> Down {
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.start_timeout_s);
    let mut misses = 0;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return match status.code() {
                Some(code) if NOT_RUNNABLE.contains(&code) => Down::NotRunnable(code),
                _ => Down::Because(format!("exited with {status}")),
            };
        }
        let healthy = api.healthy(Duration::from_secs(10)).await;
        let was_up = *up.borrow();
        match (healthy, was_up) {
            (true, false) => {
                tracing::info!("vLLM server ready at {}", api.at());
                let _ = up.send(true);
            }
            (false, false) if Instant::now() > deadline => {
                return Down::Because(format!(
                    "no answer to /health within {} s",
                    cfg.start_timeout_s
                ));
            }
            (false, true) => {
                misses += 1;
                if misses >= 3 {
                    return Down::Because("stopped answering /health".into());
                }
            }
            _ => misses = 0,
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Follows an existing server's health (one the actor did not start, e.g.
/// a sidecar its orchestrator restarts) into `up`, until `stop`.
pub async fn follow_health(api: Api, up: watch::Sender<bool>, mut stop: watch::Receiver<bool>) {
    let mut misses = 0;
    loop {
        let healthy = api.healthy(Duration::from_secs(10)).await;
        misses = if healthy { 0 } else { misses + 1 };
        let was_up = *up.borrow();
        if healthy != was_up && (healthy || misses >= 2) {
            tracing::info!(healthy, "vLLM server at {}", api.at());
            let _ = up.send(healthy);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The last lines of a server's log (of its last 4 KiB at most).
fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    const BYTES: u64 = 4096;
    const LINES: usize = 12;
    let mut buf = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let len = f.metadata().map_or(0, |m| m.len());
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(BYTES)));
        let _ = f.read_to_end(&mut buf);
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LINES)..].join("\n")
}

/// The longest Unix socket path (`sun_path` holds 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The socket of a server started in `private_dir`, refused by name when
/// its path is too long for a Unix socket.
pub fn socket_in(private_dir: &Path) -> std::io::Result<PathBuf> {
    let path = private_dir.join("vllm.sock");
    if path.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(std::io::Error::other(format!(
            "the vLLM server's socket {} is over {MAX_SOCKET_PATH} bytes: set TMPDIR to a \
             shorter directory",
            path.display()
        )));
    }
    Ok(path)
}

/// The extension module's directory inside `weights_dir`.
pub fn ext_dir(weights_dir: &Path) -> PathBuf {
    weights_dir.join("ext")
}

/// The flag that sets up bapo's transfer engine, when it is wanted.
fn transfer_args(on: bool) -> Vec<&'static str> {
    match on {
        true => vec!["--weight-transfer-config", r#"{"backend": "bapo_shm"}"#],
        false => Vec::new(),
    }
}

/// Runtime LoRA loading for adapters of rank `r` (none for 0): two
/// adapters resident, the serving one and the one before it, so a request
/// that picked the older name just before a swap still finds it.
fn lora_args(r: usize) -> Vec<String> {
    match (r, super::config::vllm_max_lora_rank(r)) {
        (0, _) | (_, None) => Vec::new(),
        (_, Some(max)) => [
            "--enable-lora",
            "--max-lora-rank",
            &max.to_string(),
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "3",
        ]
        .map(String::from)
        .to_vec(),
    }
}
