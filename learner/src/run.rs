//! The learner as a service: take batches from the buffer, step, report the
//! new version, publish the weights, log, evaluate and checkpoint.
//!
//! The version is reported to the buffer before the weights are published:
//! otherwise an actor could push tokens of version v+1 to a buffer that
//! still believes the learner is at v, and they would be refused as from
//! the future.

use std::{
    collections::BTreeMap,
    fs::File,
    future::Future,
    io::{BufWriter, Write},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_policy::Policy;
use bapo_proto::v1::{SampleRequest, VersionReport, batch_source_client::BatchSourceClient};
use metrics::counter;
use tonic::{Code, transport::Channel};

use crate::{Trainer, broadcast::WeightHub, checkpoint, metrics as names, rollouts::TrainGroup};

/// Scores a policy on held-out problems: `(metric name, value)` pairs, the
/// first being the headline accuracy.
pub type EvalFn = Arc<dyn Fn(&Policy) -> Vec<(String, f64)> + Send + Sync>;

pub struct RunOptions {
    /// Buffer service address, `http://host:port`.
    pub buffer: String,
    /// Run directory: `checkpoints/`, `metrics.jsonl`, `final/`.
    pub out: PathBuf,
    /// Buffer cursor the checkpoint being resumed was at.
    pub data_cursor: u64,
    pub eval: Option<EvalFn>,
    /// Write the final weights in HF format to `out/final`.
    pub export_final: bool,
}

/// What a finished run did.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    pub steps: u64,
    pub version: u64,
    pub wall_s: f64,
    pub idle_s: f64,
    pub last_eval: Option<f64>,
}

const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Runs until `cfg.steps` steps are done or `shutdown` resolves.
pub async fn run(
    trainer: Trainer,
    hub: WeightHub,
    opts: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<RunSummary> {
    names::describe();
    let channel = tonic::transport::Endpoint::from_shared(opts.buffer.clone())
        .with_context(|| format!("buffer address {:?}", opts.buffer))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy();
    let mut client = BatchSourceClient::new(channel).max_decoding_message_size(usize::MAX);
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating run directory {}", opts.out.display()))?;
    let log_path = opts.out.join("metrics.jsonl");
    let mut log = BufWriter::new(
        File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?,
    );
    let ckpt_dir = opts.out.join("checkpoints");
    let cfg = trainer.config().clone();
    let mut trainer = Some(trainer);
    let mut cursor = opts.data_cursor;
    let t_start = Instant::now();
    let mut idle = 0.0f64;
    let mut summary = RunSummary::default();
    tokio::pin!(shutdown);

    // The starting version: tell the buffer, then give actors the weights.
    let start_version = trainer.as_ref().map_or(0, Trainer::version);
    report_version(&mut client, start_version, &mut shutdown).await?;
    publish(&hub, trainer.as_ref().expect("present"))?;
    if let (Some(eval), 0) = (&opts.eval, trainer.as_ref().map_or(0, Trainer::steps_done)) {
        let r = evaluate(eval, trainer.as_ref().expect("present")).await?;
        write_line(&mut log, eval_record(0, start_version, 0.0, &r))?;
        summary.last_eval = r.first().map(|x| x.1);
    }

    loop {
        let t = trainer
            .as_ref()
            .expect("trainer is returned after each step");
        if cfg.steps > 0 && t.steps_done() >= cfg.steps {
            break;
        }
        // Wait for a batch.
        let wait = Instant::now();
        let groups = tokio::select! {
            _ = &mut shutdown => break,
            g = sample(&mut client, cfg.batch_groups) => g,
        };
        idle += wait.elapsed().as_secs_f64();
        counter!(names::IDLE_SECONDS).absolute(idle as u64);
        let Some(groups) = groups else { continue };
        let mut train = Vec::with_capacity(groups.len());
        for g in &groups {
            match TrainGroup::from_wire(g) {
                Ok(t) => train.push(t),
                Err(e) => {
                    counter!(names::BAD_GROUPS).increment(1);
                    tracing::warn!("skipping a group the learner cannot train on: {e}");
                }
            }
        }
        if train.is_empty() {
            continue;
        }
        cursor = cursor.max(train.iter().map(|g| g.sequence_number).max().unwrap_or(0));
        let version = trainer.as_ref().map_or(0, Trainer::version);
        let staleness: Vec<u64> = train.iter().flat_map(|g| g.staleness(version)).collect();

        // Step on a blocking thread; the trainer travels there and back.
        let mut t = trainer.take().expect("present");
        let (t, result) = tokio::task::spawn_blocking(move || {
            let r = t.step(&train);
            (t, r)
        })
        .await
        .context("training step panicked")?;
        trainer = Some(t);
        let report = match result {
            Ok(r) => r,
            Err(e) => {
                counter!(names::BAD_GROUPS).increment(groups.len() as u64);
                tracing::error!("training step refused its batch: {e}");
                continue;
            }
        };
        names::record_step(&report, &staleness);

        report_version(&mut client, report.version, &mut shutdown).await?;
        if report.version % cfg.broadcast_every == 0 {
            publish(&hub, trainer.as_ref().expect("present"))?;
        }

        let mut extra = BTreeMap::new();
        if let Some(eval) = &opts.eval
            && cfg.eval_every > 0
            && report.step % cfg.eval_every == 0
        {
            let r = evaluate(eval, trainer.as_ref().expect("present")).await?;
            if let Some((_, acc)) = r.first() {
                metrics::gauge!(names::EVAL_ACCURACY).set(*acc);
                summary.last_eval = Some(*acc);
            }
            extra.extend(r);
        }
        let elapsed = t_start.elapsed().as_secs_f64();
        write_line(&mut log, names::step_record(&report, elapsed, idle, &extra))?;
        tracing::info!(
            step = report.step,
            loss = report.loss,
            reward = report
                .metrics
                .get("reward_mean")
                .copied()
                .unwrap_or(f64::NAN),
            "step"
        );
        if cfg.checkpoint_every > 0 && report.step % cfg.checkpoint_every == 0 {
            save(
                trainer.as_ref().expect("present"),
                &ckpt_dir,
                cursor,
                cfg.keep_checkpoints,
            )?;
        }
    }

    let t = trainer.take().expect("present");
    save(&t, &ckpt_dir, cursor, cfg.keep_checkpoints)?;
    if opts.export_final {
        let dir = opts.out.join("final");
        bapo_policy::hf::save(&t.policy(), &dir)
            .with_context(|| format!("exporting final weights to {}", dir.display()))?;
    }
    log.flush()?;
    summary.steps = t.steps_done();
    summary.version = t.version();
    summary.wall_s = t_start.elapsed().as_secs_f64();
    summary.idle_s = idle;
    Ok(summary)
}

/// One batch, or `None` after a timeout or a transient failure (logged;
/// the caller simply asks again).
async fn sample(
    client: &mut BatchSourceClient<Channel>,
    groups: u32,
) -> Option<Vec<bapo_proto::v1::Group>> {
    let req = SampleRequest {
        num_groups: groups,
        timeout_ms: 2000,
        allow_partial: false,
    };
    match client.sample(req).await {
        Ok(b) => Some(b.into_inner().groups),
        Err(s) if s.code() == Code::DeadlineExceeded => None,
        Err(s) => {
            tracing::warn!(
                "sampling from the buffer failed ({}); retrying",
                s.message()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
    }
}

/// Reports `version` until the buffer acknowledges it, backing off while
/// it is unreachable.
async fn report_version(
    client: &mut BatchSourceClient<Channel>,
    version: u64,
    shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> anyhow::Result<()> {
    let mut backoff = Duration::from_millis(100);
    loop {
        match client.report_version(VersionReport { version }).await {
            Ok(_) => return Ok(()),
            Err(s) => {
                tracing::warn!(
                    version,
                    "reporting the version failed ({}); retrying",
                    s.message()
                );
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.as_mut() => anyhow::bail!("shut down before the buffer took version {version}"),
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

fn publish(hub: &WeightHub, t: &Trainer) -> anyhow::Result<()> {
    let policy = t.policy();
    hub.publish(&policy.model, &policy.config, t.version())
        .context("encoding weights for the broadcast")?;
    Ok(())
}

async fn evaluate(eval: &EvalFn, t: &Trainer) -> anyhow::Result<Vec<(String, f64)>> {
    let policy = t.policy();
    let eval = eval.clone();
    tokio::task::spawn_blocking(move || eval(&policy))
        .await
        .context("evaluation panicked")
}

fn eval_record(step: u64, version: u64, time_s: f64, r: &[(String, f64)]) -> serde_json::Value {
    let mut o = serde_json::json!({"step": step, "version": version, "time_s": time_s});
    for (k, v) in r {
        o[k] = serde_json::json!(v);
    }
    o
}

fn save(t: &Trainer, dir: &std::path::Path, cursor: u64, keep: usize) -> anyhow::Result<()> {
    let path = checkpoint::save(dir, t, cursor)?;
    checkpoint::prune(dir, keep)?;
    tracing::info!(path = %path.display(), "checkpoint written");
    Ok(())
}

fn write_line(log: &mut impl Write, v: serde_json::Value) -> anyhow::Result<()> {
    writeln!(log, "{v}")?;
    log.flush()?;
    Ok(())
}
