//! The learner as a service: take batches from the buffer, step, report the
//! new version, publish the weights, log, evaluate and checkpoint.
//!
//! The version is reported to the buffer before the weights are published:
//! otherwise an actor could push tokens of version v+1 to a buffer that
//! still believes the learner is at v, and they would be refused as from
//! the future. Each report carries the learner's lineage (its incarnations,
//! this process's last) and the group draws its weights account for, so the
//! buffer can tell a resumed learner from the one that died; a buffer that
//! answers that a newer incarnation superseded this one stops the learner
//! ([`Superseded`]).

use std::{
    collections::BTreeMap,
    fs::File,
    future::Future,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_policy::Policy;
use bapo_proto::tls::AuthChannel;
use bapo_proto::v1::{Group, SampleRequest, VersionReport, batch_source_client::BatchSourceClient};
use metrics::counter;
use tonic::Code;

use crate::{
    StepReport, Trainer,
    broadcast::WeightHub,
    checkpoint::{self, Provenance},
    intake, metrics as names,
    record::{Metric, StepRecord},
    rollouts::TrainGroup,
    tracking::{Tracking, samples::DecodeFn},
    trainer::TrainError,
};

/// Scores a policy on held-out problems: `(metric name, value)` pairs, the
/// first being the headline accuracy.
pub type EvalFn = Arc<dyn Fn(&Policy) -> Vec<(String, f64)> + Send + Sync>;

pub struct RunOptions {
    /// Buffer service address, `http://host:port`.
    pub buffer: String,
    /// Mutual TLS to the buffer (the learner's certificate); `None`:
    /// plaintext.
    pub tls: Option<bapo_proto::tls::ClientTls>,
    /// Run directory: `checkpoints/`, `metrics.jsonl`, `final/`.
    pub out: PathBuf,
    /// What the trainer's weights descend from: the resumed checkpoint's
    /// (`CheckpointState::provenance`), or the default for a fresh start.
    pub provenance: Provenance,
    pub eval: Option<EvalFn>,
    /// The tokenizer's decoder, for rollouts a person can read
    /// (`rollouts.jsonl`); `None` keeps none.
    pub decode: Option<DecodeFn>,
    /// The resolved configuration, logged as the MLflow run's parameters
    /// (`Null`: the learner's own section).
    pub params: serde_json::Value,
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
    /// This process's incarnation id.
    pub incarnation: u64,
    /// Group draws the final weights account for.
    pub groups_trained: u64,
}

/// The buffer answered a version report with `FAILED_PRECONDITION`: a
/// newer learner incarnation has reported since, and this one is a zombie
/// (say, a process thought dead that came back). Training on would feed
/// the actors weights from a dead lineage, so the learner stops.
#[derive(Debug, thiserror::Error)]
#[error(
    "learner incarnation {incarnation:016x} was superseded by a newer one \
     (the buffer refused its report of version {version}: {message}); stopping"
)]
pub struct Superseded {
    pub incarnation: u64,
    pub version: u64,
    pub message: String,
}

const BACKOFF_MAX: Duration = Duration::from_secs(5);

type Shutdown<'a, F> = Pin<&'a mut F>;

/// Runs until `cfg.steps` steps are done or `shutdown` resolves. The run
/// is a new incarnation, `hub`'s, continuing `opts.provenance.lineage`
/// from the trainer's version.
pub async fn run<F: Future<Output = ()>>(
    mut trainer: Trainer,
    hub: WeightHub,
    opts: RunOptions,
    shutdown: F,
) -> anyhow::Result<RunSummary> {
    names::describe();
    tokio::pin!(shutdown);
    let mut s = Session::open(&trainer, hub, &opts)?;
    s.start(&trainer, &mut shutdown).await?;
    let cfg = trainer.config().clone();
    loop {
        if s.stopped || (cfg.steps > 0 && trainer.steps_done() >= cfg.steps) {
            break;
        }
        let wait = Instant::now();
        let groups = tokio::select! {
            _ = &mut shutdown => break,
            g = sample(&mut s.client, cfg.batch_groups) => g,
        };
        s.add_idle(wait.elapsed());
        let Some(groups) = groups else { continue };
        let train = s.take(&groups, cfg.temperature);
        if train.is_empty() {
            continue;
        }
        let staleness: Vec<u64> = train
            .iter()
            .flat_map(|g| g.staleness(trainer.version()))
            .collect();
        // Shared with the training thread, not copied: the rollouts a
        // person reads are drawn from it afterwards, at evaluation steps.
        let train: Arc<[TrainGroup]> = train.into();
        let (t, result) = step_off_thread(trainer, train.clone()).await?;
        trainer = t;
        let mut reports = match result {
            Ok(r) if !r.is_empty() => r,
            Ok(_) => continue,
            // Stop before anything non-finite is published or checkpointed:
            // the weights are the last finite ones, already saved or not.
            Err(e @ TrainError::NonFinite { .. }) => {
                counter!(names::NONFINITE_UPDATES).increment(1);
                return Err(anyhow::anyhow!("learner stopped: {e}"));
            }
            Err(e) => {
                counter!(names::BAD_GROUPS).increment(groups.len() as u64);
                tracing::error!("training step refused its batch: {e}");
                continue;
            }
        };
        // A skipped update changed nothing: counted, logged, and neither
        // recorded as a step nor reported, published or checkpointed.
        reports.retain(|r| {
            let skipped = r.metrics.contains_key("nonfinite_skipped");
            if skipped {
                counter!(names::NONFINITE_UPDATES).increment(1);
                tracing::error!(
                    step = r.step,
                    "update skipped: non-finite loss {} or gradient norm {}",
                    r.loss,
                    r.metrics.get("grad_norm").copied().unwrap_or(f64::NAN)
                );
            }
            !skipped
        });
        if reports.is_empty() {
            continue;
        }
        for (i, report) in reports.iter().enumerate() {
            // The batch's staleness once, at its first update.
            names::record_step(report, if i == 0 { &staleness } else { &[] });
        }
        if s.after_step(&trainer, &reports, &train, &mut shutdown)
            .await?
        {
            trainer = s.save_off_thread(trainer).await?;
        }
    }
    s.finish(trainer).await
}

/// The updates of one batch on a blocking thread: the trainer travels
/// there and back.
async fn step_off_thread(
    mut trainer: Trainer,
    train: Arc<[TrainGroup]>,
) -> anyhow::Result<(Trainer, Result<Vec<StepReport>, TrainError>)> {
    tokio::task::spawn_blocking(move || {
        let r = trainer.train_batch(&train);
        (trainer, r)
    })
    .await
    .context("training step panicked")
}

/// Everything a run keeps but the trainer, which moves to a blocking
/// thread for every step.
struct Session<'o> {
    opts: &'o RunOptions,
    client: BatchSourceClient<AuthChannel>,
    hub: WeightHub,
    log: BufWriter<File>,
    ckpt_dir: PathBuf,
    /// What the current weights descend from, this incarnation included.
    provenance: Provenance,
    t_start: Instant,
    idle: f64,
    last_eval: Option<f64>,
    /// `shutdown` resolved (a signal) while a report was pending: the run
    /// finishes (final checkpoint) without polling it again.
    stopped: bool,
    /// Stated in every version report: the buffer refuses another size.
    batch_groups: u32,
    /// TensorBoard and the rollouts a person reads.
    tracking: Tracking,
}

impl<'o> Session<'o> {
    fn open(trainer: &Trainer, hub: WeightHub, opts: &'o RunOptions) -> anyhow::Result<Self> {
        let channel = bapo_proto::tls::connector(&opts.buffer, opts.tls.as_ref())
            .with_context(|| format!("buffer address {:?}", opts.buffer))?
            .connect_lazy();
        let client = BatchSourceClient::new(channel).max_decoding_message_size(usize::MAX);
        std::fs::create_dir_all(&opts.out)
            .with_context(|| format!("creating run directory {}", opts.out.display()))?;
        let log_path = opts.out.join("metrics.jsonl");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let mut provenance = opts.provenance.clone();
        provenance.lineage = provenance
            .lineage
            .continued(hub.incarnation(), trainer.version())
            .context("starting a new learner incarnation")?;
        tracing::info!(
            incarnation = format!("{:016x}", hub.incarnation()),
            version = trainer.version(),
            earlier = provenance.lineage.entries().len() - 1,
            "learner incarnation started"
        );
        // Without the whole configuration, the learner's own section.
        let params = match &opts.params {
            serde_json::Value::Null => serde_json::json!({ "learner": trainer.config() }),
            p => p.clone(),
        };
        let tracking = Tracking::open(
            &trainer.config().sinks(),
            &opts.out,
            opts.decode.clone(),
            trainer.steps_done(),
            &params,
        )?;
        Ok(Self {
            tracking,
            opts,
            client,
            hub,
            log: BufWriter::new(log),
            ckpt_dir: opts.out.join("checkpoints"),
            provenance,
            t_start: Instant::now(),
            idle: 0.0,
            last_eval: None,
            stopped: false,
            batch_groups: trainer.config().batch_groups,
        })
    }

    /// The starting version: tell the buffer, then give actors the
    /// weights, and evaluate them on a fresh start.
    async fn start<F: Future<Output = ()>>(
        &mut self,
        trainer: &Trainer,
        shutdown: &mut Shutdown<'_, F>,
    ) -> anyhow::Result<()> {
        self.report(trainer.version(), shutdown).await?;
        publish(&self.hub, trainer).await?;
        if let (Some(eval), 0) = (&self.opts.eval, trainer.steps_done()) {
            let r = evaluate(eval, trainer).await?;
            write_line(
                &mut self.log,
                &StepRecord::of_eval(0, trainer.version(), 0.0, &r),
            )?;
            self.tracking.eval(0, &r);
            self.last_eval = r.first().map(|x| x.1);
        }
        Ok(())
    }

    fn add_idle(&mut self, waited: Duration) {
        self.idle += waited.as_secs_f64();
        counter!(names::IDLE_SECONDS).absolute(self.idle as u64);
    }

    /// The groups of a batch the learner will train on. Every draw counts
    /// as consumed, trained or refused: the buffer will not hand it out
    /// again.
    fn take(&mut self, groups: &[Group], temperature: f32) -> Vec<TrainGroup> {
        let p = &mut self.provenance;
        p.groups_trained += groups.len() as u64;
        let newest = groups.iter().map(|g| g.sequence).max().unwrap_or(0);
        p.data_cursor = p.data_cursor.max(newest);
        intake::admit(groups, temperature).train
    }

    /// Report, publish, evaluate and log after a batch's updates (one
    /// line of metrics.jsonl each); true when a checkpoint is due. Every-N
    /// actions happen once when any update of the batch reaches a multiple
    /// of N, on the weights after the batch (the ones actors and
    /// checkpoints can see).
    async fn after_step<F: Future<Output = ()>>(
        &mut self,
        trainer: &Trainer,
        reports: &[StepReport],
        trained: &[TrainGroup],
        shutdown: &mut Shutdown<'_, F>,
    ) -> anyhow::Result<bool> {
        let cfg = trainer.config();
        let Some(last) = reports.last() else {
            return Ok(false);
        };
        let reached = |every: u64, of: fn(&StepReport) -> u64| {
            every > 0 && reports.iter().any(|r| of(r).is_multiple_of(every))
        };
        self.report(last.version, shutdown).await?;
        if reached(cfg.broadcast_every, |r| r.version) {
            publish(&self.hub, trainer).await?;
        }
        let mut extra = crate::record::batch_means(reports);
        // What the buffer's books must match (bapo run reconciles on it):
        // replay updates and several updates per batch draw nothing.
        extra.insert(
            Metric::GroupsDrawn.into(),
            self.provenance.groups_trained as f64,
        );
        let eval_due = reached(cfg.eval_every, |r| r.step);
        let mut results = Vec::new();
        if let Some(eval) = &self.opts.eval
            && eval_due
        {
            results = evaluate(eval, trainer).await?;
            if let Some((_, acc)) = results.first() {
                metrics::gauge!(names::EVAL_ACCURACY).set(*acc);
                self.last_eval = Some(*acc);
            }
            extra.extend(results.iter().cloned());
        }
        if eval_due {
            self.tracking.rollouts(last.step, trained);
        }
        let elapsed = self.t_start.elapsed().as_secs_f64();
        for r in reports {
            let (extra, results) = if r.step == last.step {
                (&extra, results.as_slice())
            } else {
                (&BTreeMap::new(), &[][..])
            };
            let record = StepRecord::of_step(r, elapsed, self.idle, extra);
            write_line(&mut self.log, &record)?;
            self.tracking.step(&record, results);
            log_step(r);
        }
        Ok(reached(cfg.checkpoint_every, |r| r.step))
    }

    /// Reports `version`, the lineage and the draws trained until the
    /// buffer acknowledges them, backing off while it is unreachable. A
    /// stop (`shutdown`) meanwhile is no failure: the report is given up,
    /// logged, and the run finishes; a learner restarted with the same
    /// flags re-states its version from the checkpoint.
    async fn report<F: Future<Output = ()>>(
        &mut self,
        version: u64,
        shutdown: &mut Shutdown<'_, F>,
    ) -> anyhow::Result<()> {
        let req = VersionReport {
            version,
            lineage: self.provenance.lineage.to_wire(),
            groups_trained: self.provenance.groups_trained,
            batch_groups: self.batch_groups,
        };
        let mut backoff = Duration::from_millis(100);
        loop {
            let s = match self.client.report_version(req.clone()).await {
                Ok(_) => return Ok(()),
                Err(s) => s,
            };
            if s.code() == Code::FailedPrecondition {
                return Err(Superseded {
                    incarnation: self.hub.incarnation(),
                    version,
                    message: s.message().to_string(),
                }
                .into());
            }
            // Retrying cannot change the answer (batch sizes that differ,
            // a lineage that is not a history): stop, saying why.
            if s.code() == Code::InvalidArgument {
                anyhow::bail!("the buffer refused the version report: {}", s.message());
            }
            tracing::warn!(
                version,
                "reporting the version failed ({}); retrying",
                s.message()
            );
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.as_mut() => {
                    tracing::warn!(
                        version,
                        "stopped before the buffer took version {version}; a learner \
                         restarted with the same flags reports it again"
                    );
                    self.stopped = true;
                    return Ok(());
                }
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Writes a checkpoint on a blocking thread (the trainer travels there
    /// and back): at 7B it is tens of GB of encoding and fsync, which must
    /// not stall the runtime that answers health checks and streams
    /// weights to actors.
    async fn save_off_thread(&self, trainer: Trainer) -> anyhow::Result<Trainer> {
        let (dir, provenance) = (self.ckpt_dir.clone(), self.provenance.clone());
        let keep = trainer.config().keep_checkpoints;
        let (trainer, r) = tokio::task::spawn_blocking(move || {
            let r = save(&trainer, &dir, &provenance, keep);
            (trainer, r)
        })
        .await
        .context("writing a checkpoint panicked")?;
        r.map(|()| trainer)
    }

    /// The final checkpoint, the exported weights and the summary.
    async fn finish(mut self, trainer: Trainer) -> anyhow::Result<RunSummary> {
        let trainer = self.save_off_thread(trainer).await?;
        if self.opts.export_final {
            let dir = self.opts.out.join("final");
            let policy = trainer.policy();
            let fingerprint = trainer.base_fingerprint();
            tokio::task::spawn_blocking(move || {
                bapo_policy::hf::save(&policy, &dir)
                    .with_context(|| format!("exporting final weights to {}", dir.display()))?;
                // Under LoRA, the adapters alone too, in PEFT's format.
                if let Some(adapters) = &policy.model.lora {
                    let meta = bapo_policy::peft::AdapterMeta {
                        alpha: adapters.scale * adapters.rank() as f64,
                        base: fingerprint,
                    };
                    let to = dir.join("adapter");
                    bapo_policy::peft::write_dir(&to, adapters, meta, "base")
                        .with_context(|| format!("exporting the adapters to {}", to.display()))?;
                }
                anyhow::Ok(())
            })
            .await
            .context("exporting the final weights panicked")??;
        }
        self.log.flush()?;
        let tracking = self.tracking;
        tokio::task::spawn_blocking(move || tracking.finish(true))
            .await
            .context("closing the tracking sinks panicked")?;
        Ok(RunSummary {
            steps: trainer.steps_done(),
            version: trainer.version(),
            wall_s: self.t_start.elapsed().as_secs_f64(),
            idle_s: self.idle,
            last_eval: self.last_eval,
            incarnation: self.hub.incarnation(),
            groups_trained: self.provenance.groups_trained,
        })
    }
}

/// One batch, or `None` after a timeout or a transient failure (logged;
/// the caller simply asks again).
async fn sample(client: &mut BatchSourceClient<AuthChannel>, groups: u32) -> Option<Vec<Group>> {
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

/// Encodes the current weights and makes them the newest, on a blocking
/// thread: the runtime keeps serving while a large model is encoded.
async fn publish(hub: &WeightHub, t: &Trainer) -> anyhow::Result<()> {
    let policy = t.policy();
    let encoding = t.config().broadcast_encoding()?;
    let (hub, version, fingerprint) = (hub.clone(), t.version(), t.base_fingerprint());
    tokio::task::spawn_blocking(move || match &policy.model.lora {
        // LoRA: the base once, then adapters only.
        Some(_) => hub.publish_adapters(
            &policy.model,
            &policy.config,
            version,
            encoding,
            fingerprint,
        ),
        None => hub.publish_as(&policy.model, &policy.config, version, encoding),
    })
    .await
    .context("encoding weights for the broadcast panicked")?
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

fn log_step(report: &StepReport) {
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
}

fn save(t: &Trainer, dir: &Path, provenance: &Provenance, keep: usize) -> anyhow::Result<()> {
    let path = checkpoint::save(dir, t, provenance)?;
    checkpoint::prune(dir, keep)?;
    tracing::info!(path = %path.display(), "checkpoint written");
    Ok(())
}

fn write_line(log: &mut impl Write, record: &StepRecord) -> anyhow::Result<()> {
    serde_json::to_writer(&mut *log, record)?;
    writeln!(log)?;
    log.flush()?;
    Ok(())
}
