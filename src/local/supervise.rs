//! The services of a local run as child processes of this binary: started
//! on free loopback ports with their logs in the run directory, watched
//! while the learner trains, and stopped in order.
//!
//! They talk mutual TLS, as in a cluster: each run makes an ephemeral CA
//! (its key never leaves this process) and a certificate per service in
//! `<run>/tls/`: `spiffe://bapo.local/buffer` (no role: it only serves),
//! `.../learner`, `.../actor/actor-<i>` and `.../admin` (this process's
//! stats reads).

use std::{
    collections::BTreeMap,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context, bail};
use bapo_proto::tls::{
    ClientTls, TlsFiles,
    pki::{self, Ca},
};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

/// Where each service of a run listens; written to `services.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Services {
    pub buffer: String,
    pub learner: String,
    /// Service name → its Prometheus endpoint.
    pub metrics: BTreeMap<String, String>,
    /// The admin certificate this process reads the buffer's stats with.
    #[serde(skip)]
    pub admin: Option<ClientTls>,
}

/// The trust domain of `bapo run`'s ephemeral CA.
pub const TRUST_DOMAIN: &str = "bapo.local";

/// Makes the run's CA and one certificate per service in `dir`.
struct RunPki {
    ca: Ca,
    dir: PathBuf,
}

impl RunPki {
    fn new(dir: PathBuf) -> anyhow::Result<Self> {
        Ok(Self {
            ca: Ca::new(TRUST_DOMAIN)?,
            dir,
        })
    }

    /// A certificate for `spiffe://bapo.local/<path>`, valid as a server
    /// on loopback too; written as `<name>.pem` and `<name>.key`.
    fn issue(&self, name: &str, path: &str) -> anyhow::Result<TlsFiles> {
        let opts = pki::Options {
            hosts: vec!["localhost".into(), "127.0.0.1".into()],
            valid: None,
        };
        let issued = self.ca.issue(path, &opts)?;
        Ok(self.ca.write(&self.dir, name, &issued)?)
    }
}

fn tls_args(files: &TlsFiles) -> Vec<String> {
    vec![
        "--tls-cert".into(),
        files.cert.display().to_string(),
        "--tls-key".into(),
        files.key.display().to_string(),
        "--tls-ca".into(),
        files.ca.display().to_string(),
    ]
}

struct Proc {
    name: String,
    child: Child,
}

/// The buffer, the learner and the actors, in that order; killed on drop.
pub struct Children {
    procs: Vec<Proc>,
    logs: PathBuf,
}

/// A free loopback address for a child service.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn spawn(name: &str, args: &[String], logs: &Path) -> anyhow::Result<Proc> {
    let exe = std::env::current_exe().context("locating the bapo binary")?;
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let out = std::fs::File::create(logs.join(format!("{name}.out")))?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(log)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .kill_on_drop(true);
    die_with_parent(&mut cmd);
    let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        name: name.to_string(),
        child,
    })
}

/// Makes the child end with this process. `kill_on_drop` covers an
/// orderly exit of this process, not a SIGKILL of it: then the kernel
/// sends the child SIGTERM (a graceful stop, the buffer flushing its log)
/// instead of leaving it orphaned on its port.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// SIGTERM to all of `procs` at once, then SIGKILL to those still running
/// after `grace`.
async fn terminate(procs: &mut [Proc], grace: Duration) {
    for p in procs.iter() {
        if let Some(pid) = p.child.id() {
            // SAFETY: sending a signal to our own child process.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
    }
    let deadline = tokio::time::Instant::now() + grace;
    for p in procs.iter_mut() {
        if tokio::time::timeout_at(deadline, p.child.wait())
            .await
            .is_err()
        {
            eprintln!("{} did not stop within {grace:?}; killing it", p.name);
            let _ = p.child.kill().await;
        }
    }
}

impl Children {
    /// Starts the buffer, the learner (writing into `out`) and `actors`
    /// actors, all reading the config file at `config` and talking mutual
    /// TLS with certificates in `tls/` beside `logs`; logs go to `logs`.
    pub fn start(
        config: &Path,
        out: &Path,
        logs: &Path,
        actors: usize,
    ) -> anyhow::Result<(Services, Self)> {
        let buffer_addr = free_addr()?;
        let learner_addr = free_addr()?;
        let pki = RunPki::new(logs.parent().unwrap_or(logs).join("tls"))?;
        let mut services = Services {
            buffer: format!("https://{buffer_addr}"),
            learner: format!("https://{learner_addr}"),
            metrics: BTreeMap::new(),
            admin: Some(ClientTls::mtls(pki.issue("admin", "admin")?)),
        };
        let mut children = Self {
            procs: Vec::new(),
            logs: logs.to_path_buf(),
        };
        let common = |cmd: &str| {
            vec![
                cmd.to_string(),
                "--config".into(),
                config.display().to_string(),
            ]
        };
        let mut buffer = common("buffer");
        buffer.extend(["--listen".into(), buffer_addr.to_string()]);
        buffer.extend(tls_args(&pki.issue("buffer", "buffer")?));
        children.add("buffer", buffer, &mut services)?;
        let mut learner = common("learner");
        learner.extend([
            "--buffer".into(),
            services.buffer.clone(),
            "--listen".into(),
            learner_addr.to_string(),
            "--out".into(),
            out.display().to_string(),
            "--export-final".into(),
        ]);
        learner.extend(tls_args(&pki.issue("learner", "learner")?));
        children.add("learner", learner, &mut services)?;
        for i in 0..actors {
            let name = format!("actor-{i}");
            let mut actor = common("actor");
            actor.extend([
                "--buffer".into(),
                services.buffer.clone(),
                "--learner".into(),
                services.learner.clone(),
                "--actor-id".into(),
                name.clone(),
            ]);
            actor.extend(tls_args(&pki.issue(&name, &format!("actor/{name}"))?));
            children.add(&name, actor, &mut services)?;
        }
        Ok((services, children))
    }

    /// Starts one service with its own metrics port, recorded in `services`.
    fn add(
        &mut self,
        name: &str,
        mut args: Vec<String>,
        services: &mut Services,
    ) -> anyhow::Result<()> {
        let m = free_addr()?;
        services
            .metrics
            .insert(name.to_string(), format!("http://{m}/metrics"));
        args.extend(["--metrics-listen".into(), m.to_string()]);
        self.procs.push(spawn(name, &args, &self.logs)?);
        Ok(())
    }

    /// `true` once the learner has exited successfully. Any other exit is
    /// an error naming the service and its log, and kills the rest.
    pub fn learner_done(&mut self) -> anyhow::Result<bool> {
        let mut failed = None;
        for p in &mut self.procs {
            if let Some(status) = p.child.try_wait()? {
                if p.name == "learner" && status.success() {
                    return Ok(true);
                }
                failed = Some((p.name.clone(), status));
                break;
            }
        }
        let Some((name, status)) = failed else {
            return Ok(false);
        };
        for q in &mut self.procs {
            let _ = q.child.start_kill();
        }
        bail!(
            "{name} exited with {status}; see {}",
            self.logs.join(format!("{name}.log")).display()
        )
    }

    /// Each running service's name and process id, in start order (the
    /// soak benchmark samples their memory).
    #[cfg(feature = "bench")]
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.procs
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.child.id()?)))
            .collect()
    }

    /// Actors first (they push to the buffer), then the learner (if it is
    /// still up after an interrupt), then the buffer.
    pub async fn stop(mut self) {
        let (services, actors) = self.procs.split_at_mut(2);
        terminate(actors, Duration::from_secs(20)).await;
        services.reverse();
        for p in services.chunks_mut(1) {
            terminate(p, Duration::from_secs(20)).await;
        }
    }
}
