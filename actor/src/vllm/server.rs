//! A vLLM server the actor starts and keeps alive: one child process
//! (with its own engine and worker processes under it), restarted with
//! backoff when it dies or stops answering, a bounded number of times;
//! past that the actor exits non-zero, loudly, so the orchestrator sees
//! it. The child is told to die with the actor (`PR_SET_PDEATHSIG`), so a
//! killed actor restarted with the same flags finds its port free.

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
    pub port: u16,
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
    #[error("vLLM server: gave up after {restarts} restarts (last: {last}); its log is {log}")]
    GaveUp {
        restarts: u32,
        last: String,
        log: String,
    },
}

impl Launch {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn command(&self) -> Result<tokio::process::Command, std::io::Error> {
        std::fs::create_dir_all(&self.ext_dir)?;
        std::fs::write(self.ext_dir.join("bapo_vllm_ext.py"), EXTENSION)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let c = &self.cfg;
        let mut cmd = tokio::process::Command::new(&c.python);
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&self.model_dir)
            .args(["--served-model-name", &c.served_model_name])
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--dtype", &c.dtype, "--enable-scale-out"])
            .args(["--logprobs-mode", "processed_logprobs"])
            .args(["--worker-extension-cls", EXTENSION_CLASS])
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
            .process_group(0)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe and touches no memory of ours.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        Ok(cmd)
    }
}

/// Kills the server's whole process group (the API server and the
/// engine and worker processes it started, which outlive it otherwise).
/// By the group id taken at spawn: once the API server has exited and
/// been reaped, `child.id()` is gone but its children are not.
fn kill_group(group: Option<u32>, child: &mut Child) {
    if let Some(pgid) = group {
        // SAFETY: a plain signal to a process group we created.
        unsafe {
            libc::killpg(pgid as i32, libc::SIGKILL);
        }
    }
    let _ = child.start_kill();
}

/// Starts the server and keeps it up until `stop`; sets `up` to true while
/// it answers `/health` (false while it starts or restarts). Returns an
/// error only when it gave up.
pub async fn supervise(
    launch: Launch,
    up: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ServerError> {
    let api = Api::new(&launch.url(), &launch.cfg.served_model_name);
    let mut backoff = Backoff::new(Duration::from_secs(2), Duration::from_secs(60));
    let mut restarts = 0u32;
    loop {
        let mut cmd = launch.command().map_err(|source| ServerError::Spawn {
            python: launch.cfg.python.display().to_string(),
            source,
        })?;
        let mut child = cmd.spawn().map_err(|source| ServerError::Spawn {
            python: launch.cfg.python.display().to_string(),
            source,
        })?;
        // `process_group(0)`: the group id is the server's pid.
        let group = child.id();
        tracing::info!(url = %launch.url(), log = %launch.log.display(), "vLLM server starting");
        let started = Instant::now();
        let why = tokio::select! {
            why = watch_one(&api, &mut child, &launch.cfg, &up) => Some(why),
            _ = stop.wait_for(|s| *s) => None,
        };
        kill_group(group, &mut child);
        let _ = child.wait().await;
        let Some(why) = why else {
            return Ok(());
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
) -> String {
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.start_timeout_s);
    let mut misses = 0;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return format!("exited with {status}");
        }
        let healthy = api.healthy(Duration::from_secs(10)).await;
        let was_up = *up.borrow();
        match (healthy, was_up) {
            (true, false) => {
                tracing::info!("vLLM server ready at {}", api.base());
                let _ = up.send(true);
            }
            (false, false) if Instant::now() > deadline => {
                return format!("no answer to /health within {} s", cfg.start_timeout_s);
            }
            (false, true) => {
                misses += 1;
                if misses >= 3 {
                    return "stopped answering /health".into();
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
            tracing::info!(healthy, "vLLM server at {}", api.base());
            let _ = up.send(healthy);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// A free loopback port for a started server (port 0 in the config).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The extension module's directory inside `weights_dir`.
pub fn ext_dir(weights_dir: &Path) -> PathBuf {
    weights_dir.join("ext")
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
