//! Where a run's numbers go besides `metrics.jsonl`, for researchers:
//! TensorBoard event files, and training rollouts a person can read
//! (`rollouts.jsonl`, also in TensorBoard's text tab). A sink that fails
//! (a full disk) is logged, counted and closed: tracking never fails or
//! stalls training.

pub mod mlflow;
pub mod samples;
pub mod tensorboard;
pub mod tfevents;

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
};

use anyhow::Context;

use crate::{metrics as names, record::StepRecord, rollouts::TrainGroup};
use mlflow::Mlflow;
use samples::{DecodeFn, RolloutSample};
use tensorboard::TensorBoard;

/// What to track (from `[learner]`: `tensorboard`, `sample_rollouts`,
/// `[learner.mlflow]`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sinks<'a> {
    pub tensorboard: Option<&'a Path>,
    /// Rollouts kept per evaluation step, of each kind.
    pub sample_rollouts: usize,
    pub mlflow: Option<&'a mlflow::MlflowConfig>,
}

pub struct Tracking {
    tb: Option<TensorBoard>,
    mlflow: Option<Mlflow>,
    rollouts: Option<(BufWriter<File>, PathBuf)>,
    decode: Option<DecodeFn>,
    per_side: usize,
}

impl Tracking {
    /// The sinks `cfg` asks for, the rollouts file in `out`; `resumed_at`:
    /// the steps already done (see [`TensorBoard::create`]); `params`:
    /// the resolved configuration, logged to MLflow.
    pub fn open(
        cfg: &Sinks<'_>,
        out: &Path,
        decode: Option<DecodeFn>,
        resumed_at: u64,
        params: &serde_json::Value,
    ) -> anyhow::Result<Self> {
        let tb = match cfg.tensorboard {
            Some(dir) => Some(TensorBoard::create(dir, resumed_at)?),
            None => None,
        };
        let mlflow = match cfg.mlflow {
            Some(m) => {
                let mut flat = Vec::new();
                mlflow::params("", params, &mut flat);
                Some(Mlflow::start(m, out, flat).context("learner.mlflow")?)
            }
            None => None,
        };
        let rollouts = match (&decode, cfg.sample_rollouts) {
            (Some(_), 1..) => {
                let path = out.join("rollouts.jsonl");
                let f = File::options()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| format!("opening {}", path.display()))?;
                Some((BufWriter::new(f), path))
            }
            _ => None,
        };
        Ok(Self {
            tb,
            mlflow,
            rollouts,
            decode,
            per_side: cfg.sample_rollouts,
        })
    }

    /// An update's record: evaluation results under `eval/`, the rest
    /// under `train/`.
    pub fn step(&mut self, rec: &StepRecord, eval: &[(String, f64)]) {
        let is_eval = |k: &str| eval.iter().any(|(e, _)| e == k);
        let values = rec.values.iter().filter_map(|(k, v)| Some((k, (*v)?)));
        let (ev, train): (Vec<_>, Vec<_>) = values.partition(|(k, _)| is_eval(k));
        let step = rec.step;
        sink(&mut self.tb, "tensorboard", |tb| {
            tb.scalars(step, "train", train.iter().map(|(k, v)| (k.as_str(), *v)))?;
            tb.scalars(step, "eval", ev.iter().map(|(k, v)| (eval_tag(k), *v)))
        });
        if let Some(m) = &self.mlflow {
            let values = train.iter().map(|(k, v)| (format!("train/{k}"), *v));
            let evals = ev
                .iter()
                .map(|(k, v)| (format!("eval/{}", eval_tag(k)), *v));
            m.step(step, values.chain(evals).collect());
        }
    }

    /// Ends the tracked run (MLflow: `FINISHED`, or `FAILED` when
    /// training failed), giving a slow server a few seconds at most.
    pub fn finish(mut self, ok: bool) {
        if let Some(m) = self.mlflow.take() {
            let status = if ok { "FINISHED" } else { "FAILED" };
            m.finish(status, std::time::Duration::from_secs(10));
        }
    }

    /// An evaluation outside a step (the start of a run).
    pub fn eval(&mut self, step: u64, results: &[(String, f64)]) {
        sink(&mut self.tb, "tensorboard", |tb| {
            tb.scalars(step, "eval", results.iter().map(|(k, v)| (eval_tag(k), *v)))
        });
        if let Some(m) = &self.mlflow {
            let values = results.iter().filter(|(_, v)| v.is_finite());
            m.step(
                step,
                values
                    .map(|(k, v)| (format!("eval/{}", eval_tag(k)), *v))
                    .collect(),
            );
        }
    }

    /// Samples of `groups`, the batch trained at `step` (an evaluation
    /// step), drawn with the step as seed.
    pub fn rollouts(&mut self, step: u64, groups: &[TrainGroup]) {
        let Some(decode) = &self.decode else { return };
        let picked: Vec<RolloutSample> = samples::pick(groups, self.per_side, step)
            .into_iter()
            .map(|(g, s)| samples::sample(step, g, s, decode))
            .collect();
        if picked.is_empty() {
            return;
        }
        sink(&mut self.rollouts, "rollouts", |(out, path)| {
            for s in &picked {
                serde_json::to_writer(&mut *out, s)?;
                out.write_all(b"\n")?;
            }
            out.flush()
                .with_context(|| format!("writing {}", path.display()))
        });
        let rows = samples::table(&picked);
        sink(&mut self.tb, "tensorboard", |tb| {
            tb.table(step, "rollouts", &rows)
        });
    }
}

/// `eval_accuracy` as `eval/accuracy`, not `eval/eval_accuracy`.
fn eval_tag(key: &str) -> &str {
    key.strip_prefix("eval_").unwrap_or(key)
}

/// Runs `f` on the sink if it is open; on failure logs, counts and closes
/// it.
fn sink<T>(s: &mut Option<T>, name: &'static str, f: impl FnOnce(&mut T) -> anyhow::Result<()>) {
    let Some(open) = s.as_mut() else { return };
    if let Err(e) = f(open) {
        tracing::warn!(
            sink = name,
            error = format!("{e:#}"),
            "tracking sink failed; closed"
        );
        metrics::counter!(names::TRACKING_FAILURES, "sink" => name).increment(1);
        *s = None;
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::{tfevents::Event, *};

    /// The events of every file in `dir`, unframed (CRCs checked).
    fn events(dir: &Path) -> Vec<Event> {
        let mut out = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for f in files {
            let b = std::fs::read(f).unwrap();
            let mut at = 0;
            while at < b.len() {
                let len = u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
                let data = &b[at + 12..at + 12 + len];
                let crc = u32::from_le_bytes(b[at + 12 + len..at + 16 + len].try_into().unwrap());
                assert_eq!(crc, tfevents::masked_crc32c(data));
                out.push(Event::decode(data).unwrap());
                at += 16 + len;
            }
        }
        out
    }

    fn tags(e: &Event) -> Vec<String> {
        match &e.what {
            Some(tfevents::What::Summary(s)) => s.value.iter().map(|v| v.tag.clone()).collect(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn records_go_to_train_and_eval_tags_and_a_resume_restarts_the_session() {
        let dir = tempfile::tempdir().unwrap();
        let tb = dir.path().join("tb");
        let cfg = Sinks {
            tensorboard: Some(&tb),
            ..Sinks::default()
        };
        let mut t = Tracking::open(&cfg, dir.path(), None, 0, &serde_json::Value::Null).unwrap();
        let mut rec = StepRecord {
            step: 3,
            ..StepRecord::default()
        };
        rec.set("loss", 0.5);
        rec.set("eval_accuracy", 0.25);
        rec.set("kl", f64::NAN);
        t.step(&rec, &[("eval_accuracy".into(), 0.25)]);
        t.eval(0, &[("eval_accuracy".into(), 0.1)]);
        let ev = events(&dir.path().join("tb"));
        let all: Vec<Vec<String>> = ev.iter().map(tags).collect();
        assert_eq!(
            all,
            [
                vec![],
                vec!["train/loss".to_string()],
                vec!["eval/accuracy".to_string()],
                vec!["eval/accuracy".to_string()]
            ]
        );
        assert_eq!(ev[1].step, 3);
        // A learner resumed at step 3 opens a second file that restarts
        // the session at step 4.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let _again = Tracking::open(&cfg, dir.path(), None, 3, &serde_json::Value::Null).unwrap();
        let ev = events(&dir.path().join("tb"));
        let last = ev.last().unwrap();
        assert_eq!(last.step, 4);
        assert!(matches!(last.what, Some(tfevents::What::SessionLog(_))));
    }

    #[test]
    fn a_failing_sink_is_closed_not_fatal() {
        let mut s = Some(1);
        sink(&mut s, "test", |_| anyhow::bail!("disk full"));
        assert_eq!(s, None);
        sink(&mut s, "test", |_| panic!("a closed sink is not called"));
    }
}
