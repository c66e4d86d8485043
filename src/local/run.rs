//! One local run, phase by phase: a supervised warm start, the held-out
//! evaluation of the starting model, the services as child processes
//! followed until the learner finishes, the final evaluation, and
//! `summary.json` with the report in the run directory.

use std::{
    path::{Path, PathBuf},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, bail};
use bapo_learner::tracking::mlflow::{Client, MlflowConfig, RunRef};
use bapo_policy::evaluate::EvalResult;

use super::{
    options::RunOptions,
    report,
    summary::LocalRunSummary,
    supervise::Children,
    tail::{self, Followed},
};
use crate::{config_file::ConfigFile, evaluation as eval, warm_start as sft};

/// Runs the whole loop and returns what `summary.json` holds.
pub async fn run(opts: &RunOptions) -> anyhow::Result<LocalRunSummary> {
    let t_start = Instant::now();
    let mut cfg = opts.resolve()?;
    // Refused here, by name, rather than after the warm start.
    cfg.model.burn_device()?;
    let (out, logs) = run_dir(&cfg)?;

    // 1. Warm start, and the model RL starts from.
    let t_sft = Instant::now();
    let sft_steps = warm_start(&mut cfg, opts, &out).await?;
    let sft_seconds = t_sft.elapsed().as_secs_f64();
    let model_dir = starting_model(&mut cfg, &out)?;
    // Researchers' view of the run: TensorBoard reads <run>/tensorboard.
    if cfg.learner.tensorboard.is_none() {
        cfg.learner.tensorboard = Some(out.join("tensorboard"));
    }
    let config_path = out.join("config.toml");
    std::fs::write(&config_path, cfg.to_toml()?)?;
    let warm = evaluate(&cfg, &config_path, model_dir).await?;
    let pass = warm
        .pass_at_k
        .map_or(String::new(), |p| format!(", pass@{} {p:.3}", warm.k));
    eprintln!(
        "warm-start held-out accuracy: greedy {:.3}{pass}",
        warm.greedy_accuracy
    );

    // 2. Services, followed until the learner finishes.
    let t_rl = Instant::now();
    let seen = services(&cfg, &config_path, &out, &logs, opts.quiet).await?;
    let rl_seconds = t_rl.elapsed().as_secs_f64();

    // 3. Final evaluation and report.
    let fin = evaluate(&cfg, &config_path, out.join("final")).await?;
    let timing = Timing {
        sft_steps,
        sft_seconds,
        rl_seconds,
        total_seconds: t_start.elapsed().as_secs_f64(),
    };
    let summary = summarise(&cfg, &warm, &fin, seen, timing);
    write_results(&cfg, &out, &summary).await?;
    Ok(summary)
}

/// The run directory (`runs/<unix time>` unless named) and its `logs/`,
/// where this process's own log lines go too: the terminal keeps the
/// progress and the summary.
fn run_dir(cfg: &ConfigFile) -> anyhow::Result<(PathBuf, PathBuf)> {
    let out = cfg.run.out.clone().unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        PathBuf::from(format!("runs/{t}"))
    });
    let logs = out.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    crate::telemetry::set_run_log(&logs.join("run.log"))
        .with_context(|| format!("opening {}", logs.join("run.log").display()))?;
    eprintln!("bapo run: {} (logs in {})", out.display(), logs.display());
    Ok((out, logs))
}

/// The buffer, learner and actors as child processes, followed until the
/// learner finishes, then stopped; the buffer's books read before.
async fn services(
    cfg: &ConfigFile,
    config_path: &Path,
    out: &Path,
    logs: &Path,
    quiet: bool,
) -> anyhow::Result<Followed> {
    let (services, mut children) = Children::start(config_path, out, logs, cfg.run.actors)?;
    std::fs::write(
        out.join("services.json"),
        serde_json::to_string_pretty(&services)?,
    )?;
    let metrics = out.join("metrics.jsonl");
    let mut seen =
        tail::follow(&mut children, &services, &metrics, cfg.learner.steps, quiet).await?;
    if let Some(s) = tail::buffer_books(&services).await {
        seen.buffer = Some(s);
    }
    children.stop().await;
    if seen.interrupted {
        bail!(
            "interrupted; the run directory {} holds what was done",
            out.display()
        );
    }
    Ok(seen)
}

/// `summary.json`, the report, and with `[learner.mlflow]` the files
/// uploaded to the learner's MLflow run.
async fn write_results(
    cfg: &ConfigFile,
    out: &Path,
    summary: &LocalRunSummary,
) -> anyhow::Result<()> {
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(summary)?,
    )?;
    report::write(out, summary).context("writing the report")?;
    eprintln!(
        "report: {} (every number: summary.json)",
        out.join("report.html").display()
    );
    if let Some(m) = cfg.learner.mlflow.clone() {
        let dir = out.to_path_buf();
        tokio::task::spawn_blocking(move || log_artefacts(&m, &dir))
            .await
            .context("uploading to MLflow panicked")?;
    }
    Ok(())
}

/// The run's files as artefacts of the learner's MLflow run: the summary,
/// the report, the metrics and rollouts, and with `log_model` the final
/// weights. A failed upload is said, not fatal: the run is done.
fn log_artefacts(m: &MlflowConfig, out: &Path) {
    let Some(run) = RunRef::read(out) else {
        eprintln!(
            "MLflow: no {} from the learner; nothing uploaded",
            RunRef::path(out).display()
        );
        return;
    };
    let client = Client::new(&m.uri, std::time::Duration::from_secs(60));
    let mut files = vec![
        "summary.json".to_string(),
        "report.html".into(),
        "metrics.jsonl".into(),
        "rollouts.jsonl".into(),
        "config.toml".into(),
    ];
    if m.log_model {
        files.extend(files_under(&out.join("final"), "final"));
    }
    let mut sent = 0;
    for f in &files {
        let path = out.join(f);
        if !path.is_file() {
            continue;
        }
        match client.upload(&run, &path, f) {
            Ok(()) => sent += 1,
            Err(e) => eprintln!("MLflow: {f} not uploaded: {e:#}"),
        }
    }
    eprintln!(
        "MLflow: {sent} artefacts in run {} at {}",
        run.run_id, m.uri
    );
}

/// Paths of the files under `dir`, relative to its parent, as `prefix/...`.
fn files_under(dir: &Path, prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = format!("{prefix}/{}", e.file_name().to_string_lossy());
        if e.path().is_dir() {
            out.extend(files_under(&e.path(), &name));
        } else {
            out.push(name);
        }
    }
    out.sort();
    out
}

/// The supervised warm start into `<out>/sft` (unless `--init` names the
/// model or the config turns it off); points `cfg.model` at the result and
/// returns the steps run.
async fn warm_start(
    cfg: &mut ConfigFile,
    opts: &RunOptions,
    out: &Path,
) -> anyhow::Result<Option<u64>> {
    if let Some(init) = &opts.init {
        cfg.model = cfg.model.at_dir(init.clone());
        return Ok(None);
    }
    if !cfg.run.sft {
        return Ok(None);
    }
    let c = cfg.clone();
    let sft_dir = out.join("sft");
    let quiet = opts.quiet;
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
    cfg.model = cfg.model.at_dir(sft_dir);
    Ok(Some(s.steps))
}

/// The HF directory RL starts from. Without one (RL from the preset's
/// random weights) they are materialised once in `<out>/init`, so every
/// process starts from the same ones.
fn starting_model(cfg: &mut ConfigFile, out: &Path) -> anyhow::Result<PathBuf> {
    if let Some(d) = &cfg.model.hf_dir {
        return Ok(d.clone());
    }
    let dir = out.join("init");
    // Made on the CPU: a seed gives the same weights whatever the backend.
    let (p, tok) = cfg
        .model
        .load(&bapo_policy::burn::prelude::Device::flex())?;
    bapo_policy::hf::save(&p, &dir)?;
    tok.save(&dir.join("tokenizer.json"))?;
    cfg.model = cfg.model.at_dir(dir.clone());
    Ok(dir)
}

/// Held-out accuracy of the model in `dir` on the run's task.
async fn evaluate(cfg: &ConfigFile, config: &Path, dir: PathBuf) -> anyhow::Result<EvalResult> {
    let a = eval::EvalArgs {
        checkpoint: dir,
        config: Some(config.to_path_buf()),
        task: None,
        data: None,
        problems: cfg.run.eval_problems,
        k: cfg.run.pass_k,
        temperature: None,
        split: eval::EvalSplit::Test,
        max_new_tokens: cfg.learner.eval_max_new_tokens,
        // The config file says where: `[model] device` and `precision`.
        device: Default::default(),
    };
    tokio::task::spawn_blocking(move || eval::eval(&a)).await?
}

/// The warm start's steps and how long each phase took.
struct Timing {
    sft_steps: Option<u64>,
    sft_seconds: f64,
    rl_seconds: f64,
    total_seconds: f64,
}

fn summarise(
    cfg: &ConfigFile,
    warm: &EvalResult,
    fin: &EvalResult,
    seen: Followed,
    t: Timing,
) -> LocalRunSummary {
    // The learner's own count; a learner that never wrote one (none of its
    // steps logged) drew a batch per update at most.
    let learner_groups = seen.groups_drawn.unwrap_or(
        cfg.learner.steps / cfg.learner.updates_per_batch() * cfg.learner.batch_groups as u64,
    );
    let buffer = seen.buffer.unwrap_or_default();
    LocalRunSummary {
        algo: cfg.learner.algo.clone(),
        lora_rank: cfg.learner.lora.as_ref().map(|l| l.rank),
        max_staleness: cfg.buffer.max_staleness,
        actors: cfg.run.actors,
        steps: cfg.learner.steps,
        warm_start_accuracy: warm.greedy_accuracy,
        warm_start_pass_at_k: warm.pass_at_k,
        final_accuracy: fin.greedy_accuracy,
        final_pass_at_k: fin.pass_at_k,
        pass_k: cfg.run.pass_k,
        eval_problems: fin.problems,
        sft_steps: t.sft_steps,
        sft_seconds: t.sft_seconds,
        rl_seconds: t.rl_seconds,
        total_seconds: t.total_seconds,
        learner_idle_fraction: seen.idle_s / t.rl_seconds.max(1e-9),
        final_entropy: seen.last_entropy,
        reconciled: buffer.get("group_samples") == Some(&learner_groups),
        buffer,
    }
}
