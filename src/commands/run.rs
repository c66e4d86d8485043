//! `bapo run`: the whole system on one machine. A supervised warm start,
//! then the buffer, the learner and N actors as separate processes talking
//! gRPC over loopback, a live progress line from the learner's metrics log,
//! a final held-out evaluation, and a report in the run directory.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Seek, SeekFrom},
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use bapo_policy::ModelSpec;
use bapo_proto::v1::{StatsRequest, batch_source_client::BatchSourceClient};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};

use super::{eval, sft};
use crate::{config_file::ConfigFile, report, telemetry};

#[derive(Debug, Args, Default, Clone)]
pub struct RunArgs {
    /// TOML config file with any of the tables (default: the built-in
    /// configs/tiny-arith.toml).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Actor processes.
    #[arg(long)]
    pub actors: Option<usize>,
    /// Learner optimiser steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Policy loss (bapo, grpo, dapo, ...).
    #[arg(long)]
    pub algo: Option<String>,
    /// Maximum policy-version lag of trained data; 0 is synchronous.
    #[arg(long)]
    pub max_staleness: Option<u64>,
    /// Run directory (default runs/<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Start RL from this HF model directory (skips the warm start).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Task name (arith, countdown, jsonl).
    #[arg(long)]
    pub task: Option<String>,
    /// JSONL file of the `jsonl` task (GSM8K format).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Supervised warm-start steps (0 skips it).
    #[arg(long)]
    pub sft_steps: Option<u64>,
    /// Seed of the model, task and sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// No progress bar: log lines only.
    #[arg(long)]
    pub quiet: bool,
}

/// Where each service of a run listens; written to `services.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Services {
    pub buffer: String,
    pub learner: String,
    /// Service name → its Prometheus endpoint.
    pub metrics: BTreeMap<String, String>,
}

/// `summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub algo: String,
    pub max_staleness: u64,
    pub actors: usize,
    pub steps: u64,
    pub warm_start_accuracy: f64,
    pub warm_start_pass_at_k: Option<f64>,
    pub final_accuracy: f64,
    pub final_pass_at_k: Option<f64>,
    pub pass_k: usize,
    pub eval_problems: usize,
    /// Supervised steps of the warm start this run made (none with `--init`
    /// or `sft = false`).
    #[serde(default)]
    pub sft_steps: Option<u64>,
    pub sft_seconds: f64,
    pub rl_seconds: f64,
    pub total_seconds: f64,
    pub learner_idle_fraction: f64,
    pub final_entropy: Option<f64>,
    pub buffer: BTreeMap<String, u64>,
    /// Groups the buffer handed out equal the groups the learner trained on.
    pub reconciled: bool,
}

impl RunArgs {
    fn resolve(&self) -> anyhow::Result<ConfigFile> {
        let mut c = ConfigFile::load_or_builtin(self.config.as_deref())?;
        if let Some(n) = self.actors {
            c.run.actors = n;
        }
        if let Some(s) = self.steps {
            c.learner.steps = s;
        }
        if let Some(a) = &self.algo {
            c.learner.algo = a.clone();
        }
        if let Some(s) = self.max_staleness {
            c.buffer.max_staleness = s;
        }
        if let Some(t) = &self.task {
            c.task.name = t.clone();
        }
        if let Some(d) = &self.data {
            c.task.path = Some(d.clone());
        }
        if let Some(s) = self.sft_steps {
            c.sft.steps = s;
            c.run.sft = s > 0;
        }
        if let Some(s) = self.seed {
            c.model.seed = s;
            c.learner.seed = s;
            c.actor.sampling.seed = s;
        }
        if let Some(o) = &self.out {
            c.run.out = Some(o.clone());
        }
        anyhow::ensure!(
            c.learner.steps > 0,
            "bapo run needs learner.steps > 0 (or --steps)"
        );
        anyhow::ensure!(c.run.actors > 0, "bapo run needs at least one actor");
        // One number each, wherever it is read.
        c.buffer.batch_groups = c.learner.batch_groups;
        c.buffer.group_size = c.actor.group_size as u32;
        c.learner.temperature = c.actor.sampling.temperature;
        c.learner.validate()?;
        c.buffer.validate()?;
        Ok(c)
    }
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

struct Proc {
    name: String,
    child: Child,
}

fn spawn(name: &str, args: &[String], logs: &Path) -> anyhow::Result<Proc> {
    let exe = std::env::current_exe().context("locating the bapo binary")?;
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let out = std::fs::File::create(logs.join(format!("{name}.out")))?;
    let child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(log)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        name: name.to_string(),
        child,
    })
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

/// Follows the learner's JSONL log from where it was last read.
struct LogTail {
    path: PathBuf,
    pos: u64,
}

impl LogTail {
    fn read(&mut self) -> Vec<serde_json::Value> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut reader = BufReader::new(f);
        let mut line = String::new();
        while let Ok(n) = reader.read_line(&mut line) {
            // Only whole lines: a line still being written is read next time.
            if n == 0 || !line.ends_with('\n') {
                break;
            }
            self.pos += n as u64;
            if let Ok(v) = serde_json::from_str(&line) {
                out.push(v);
            }
            line.clear();
        }
        out
    }
}

fn progress_message(v: &serde_json::Value, last_eval: Option<f64>) -> String {
    let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
    let mut s = String::new();
    let mut put = |label: &str, val: Option<f64>, prec: usize| {
        if let Some(x) = val {
            s.push_str(&format!("{label} {x:.prec$}  "));
        }
    };
    put("reward", f("reward_mean"), 3);
    put("eval", last_eval, 3);
    put("entropy", f("entropy"), 3);
    put("c_low", f("c_low"), 2);
    put("c_high", f("c_high"), 2);
    put("stale", f("staleness_mean"), 1);
    put("tok/s", f("tokens_per_s"), 0);
    s
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let summary = run_to_summary(&args).await?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

/// Runs the whole loop and returns what `summary.json` holds.
pub async fn run_to_summary(args: &RunArgs) -> anyhow::Result<RunSummary> {
    let t_start = Instant::now();
    let mut cfg = args.resolve()?;
    let out = cfg.run.out.clone().unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from(format!("runs/{t}"))
    });
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    eprintln!("bapo run: {} (logs in {})", out.display(), logs.display());

    // 1. Warm start.
    let t_sft = Instant::now();
    let mut sft_steps = None;
    if let Some(init) = &args.init {
        cfg.model = ModelSpec::from_dir(init.clone());
    } else if cfg.run.sft {
        let c = cfg.clone();
        let sft_dir = out.join("sft");
        let quiet = args.quiet;
        let d = sft_dir.clone();
        let s = tokio::task::spawn_blocking(move || sft::warm_start(&c, &d, 0, quiet))
            .await
            .context("warm start panicked")??;
        let acc = s
            .train_accuracy
            .map_or(String::new(), |a| format!(", train accuracy {a:.3}"));
        eprintln!(
            "warm start: {} steps, final nll {:.3}{acc}, {:.0} s",
            s.steps, s.final_nll, s.seconds
        );
        sft_steps = Some(s.steps);
        cfg.model = ModelSpec::from_dir(sft_dir);
    }
    let sft_seconds = t_sft.elapsed().as_secs_f64();
    let model_dir = match &cfg.model.hf_dir {
        Some(d) => d.clone(),
        None => {
            // RL from the preset's random weights: materialise them once so
            // every process starts from the same ones.
            let dir = out.join("init");
            let (p, tok) = cfg.model.load(&super::common::device())?;
            bapo_policy::hf::save(&p, &dir)?;
            tok.save(&dir.join("tokenizer.json"))?;
            cfg.model = ModelSpec::from_dir(dir.clone());
            dir
        }
    };
    let eval_args = |dir: PathBuf| eval::EvalArgs {
        checkpoint: dir,
        config: None,
        task: None,
        data: None,
        problems: cfg.run.eval_problems,
        k: cfg.run.pass_k,
        max_new_tokens: cfg.learner.eval_max_new_tokens,
    };
    let config_path = out.join("config.toml");
    std::fs::write(&config_path, cfg.to_toml()?)?;
    let warm = {
        let mut a = eval_args(model_dir.clone());
        a.config = Some(config_path.clone());
        tokio::task::spawn_blocking(move || eval::eval(&a)).await??
    };
    eprintln!(
        "warm-start held-out accuracy: greedy {:.3}, pass@{} {:.3}",
        warm.greedy_accuracy,
        warm.k,
        warm.pass_at_k.unwrap_or(f64::NAN)
    );

    // 2. Services.
    let buffer_addr = free_addr()?;
    let learner_addr = free_addr()?;
    let mut services = Services {
        buffer: format!("http://{buffer_addr}"),
        learner: format!("http://{learner_addr}"),
        metrics: BTreeMap::new(),
    };
    let cfg_arg = config_path.display().to_string();
    let mut procs = Vec::new();
    let m = free_addr()?;
    services
        .metrics
        .insert("buffer".into(), format!("http://{m}/metrics"));
    procs.push(spawn(
        "buffer",
        &[
            "buffer".into(),
            "--config".into(),
            cfg_arg.clone(),
            "--listen".into(),
            buffer_addr.to_string(),
            "--metrics-listen".into(),
            m.to_string(),
        ],
        &logs,
    )?);
    let m = free_addr()?;
    services
        .metrics
        .insert("learner".into(), format!("http://{m}/metrics"));
    procs.push(spawn(
        "learner",
        &[
            "learner".into(),
            "--config".into(),
            cfg_arg.clone(),
            "--buffer".into(),
            services.buffer.clone(),
            "--listen".into(),
            learner_addr.to_string(),
            "--metrics-listen".into(),
            m.to_string(),
            "--out".into(),
            out.display().to_string(),
            "--export-final".into(),
        ],
        &logs,
    )?);
    for i in 0..cfg.run.actors {
        let name = format!("actor-{i}");
        let m = free_addr()?;
        services
            .metrics
            .insert(name.clone(), format!("http://{m}/metrics"));
        procs.push(spawn(
            &name,
            &[
                "actor".into(),
                "--config".into(),
                cfg_arg.clone(),
                "--buffer".into(),
                services.buffer.clone(),
                "--learner".into(),
                services.learner.clone(),
                "--metrics-listen".into(),
                m.to_string(),
                "--actor-id".into(),
                name.clone(),
            ],
            &logs,
        )?);
    }
    std::fs::write(
        out.join("services.json"),
        serde_json::to_string_pretty(&services)?,
    )?;

    // 3. Follow the learner until it finishes.
    let t_rl = Instant::now();
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfg.learner.steps)
    };
    bar.set_style(
        ProgressStyle::with_template("rl  {bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
            .expect("valid template"),
    );
    let mut tail = LogTail {
        path: out.join("metrics.jsonl"),
        pos: 0,
    };
    let (mut last_eval, mut last_entropy, mut idle_s) = (None, None, 0.0);
    let mut shutdown = std::pin::pin!(telemetry::shutdown_signal());
    let mut interrupted = false;
    let mut stats = None;
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    'follow: loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = &mut shutdown => { interrupted = true; break 'follow; }
        }
        for v in tail.read() {
            if let Some(a) = v.get("eval_accuracy").and_then(|x| x.as_f64()) {
                last_eval = Some(a);
            }
            if let Some(e) = v.get("entropy").and_then(|x| x.as_f64()) {
                last_entropy = Some(e);
            }
            if let Some(i) = v.get("idle_s").and_then(|x| x.as_f64()) {
                idle_s = i;
            }
            if let Some(s) = v.get("step").and_then(|x| x.as_u64()) {
                bar.set_position(s);
                let msg = progress_message(&v, last_eval);
                if args.quiet && s % 25 == 0 {
                    eprintln!("step {s}: {msg}");
                }
                bar.set_message(msg);
                // Read the buffer's books while it is still up.
                if s + 1 >= cfg.learner.steps || s % 20 == 0 {
                    stats = buffer_stats(&services.buffer).await.or(stats);
                }
            }
        }
        let mut failed = None;
        for p in &mut procs {
            if let Some(status) = p.child.try_wait()? {
                if p.name == "learner" && status.success() {
                    break 'follow;
                }
                failed = Some((p.name.clone(), status));
                break;
            }
        }
        if let Some((name, status)) = failed {
            bar.abandon();
            for q in &mut procs {
                let _ = q.child.start_kill();
            }
            bail!(
                "{name} exited with {status}; see {}",
                logs.join(format!("{name}.log")).display()
            );
        }
    }
    bar.finish_and_clear();
    let rl_seconds = t_rl.elapsed().as_secs_f64();
    if let Some(s) = buffer_stats(&services.buffer).await {
        stats = Some(s);
    }
    // Actors first (they push to the buffer), then the learner (if it is
    // still up after an interrupt), then the buffer.
    let (services_procs, actor_procs) = procs.split_at_mut(2);
    terminate(actor_procs, Duration::from_secs(20)).await;
    services_procs.reverse();
    for p in services_procs.chunks_mut(1) {
        terminate(p, Duration::from_secs(20)).await;
    }
    if interrupted {
        bail!(
            "interrupted; the run directory {} holds what was done",
            out.display()
        );
    }

    // 4. Final evaluation and report.
    let fin = {
        let mut a = eval_args(out.join("final"));
        a.config = Some(config_path.clone());
        tokio::task::spawn_blocking(move || eval::eval(&a)).await??
    };
    let learner_groups = cfg.learner.steps * cfg.learner.batch_groups as u64;
    let buffer = stats.unwrap_or_default();
    let summary = RunSummary {
        algo: cfg.learner.algo.clone(),
        max_staleness: cfg.buffer.max_staleness,
        actors: cfg.run.actors,
        steps: cfg.learner.steps,
        warm_start_accuracy: warm.greedy_accuracy,
        warm_start_pass_at_k: warm.pass_at_k,
        final_accuracy: fin.greedy_accuracy,
        final_pass_at_k: fin.pass_at_k,
        pass_k: cfg.run.pass_k,
        eval_problems: fin.problems,
        sft_steps,
        sft_seconds,
        rl_seconds,
        total_seconds: t_start.elapsed().as_secs_f64(),
        learner_idle_fraction: idle_s / rl_seconds.max(1e-9),
        final_entropy: last_entropy,
        reconciled: buffer.get("group_samples") == Some(&learner_groups),
        buffer,
    };
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    report::write(&out, &summary).context("writing the report")?;
    eprintln!(
        "held-out greedy accuracy {:.3} -> {:.3}; report: {}",
        summary.warm_start_accuracy,
        summary.final_accuracy,
        out.join("report.html").display()
    );
    Ok(summary)
}

async fn buffer_stats(url: &str) -> Option<BTreeMap<String, u64>> {
    let mut c = BatchSourceClient::connect(url.to_string()).await.ok()?;
    let s = c.get_stats(StatsRequest {}).await.ok()?.into_inner();
    let mut m = BTreeMap::from([
        ("learner_version".to_string(), s.learner_version),
        ("groups_pending".into(), s.groups_pending),
        ("groups_ready".into(), s.groups_ready),
        ("rollouts_accepted".into(), s.rollouts_accepted),
        ("rollouts_duplicate".into(), s.rollouts_duplicate),
        ("rollouts_rejected".into(), s.rollouts_rejected),
        ("groups_consumed".into(), s.groups_consumed),
        ("group_samples".into(), s.group_samples),
        ("admitted_groups".into(), s.admitted_groups),
    ]);
    for (k, v) in s.evictions {
        m.insert(format!("evicted_{k}"), v);
    }
    for (k, v) in s.rejections {
        m.insert(format!("rejected_{k}"), v);
    }
    Some(m)
}
