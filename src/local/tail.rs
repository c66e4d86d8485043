//! Following a local run while it trains: the learner's `metrics.jsonl`
//! read as it grows, a progress line from it, and the buffer's books read
//! while the buffer is still up.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Seek, SeekFrom},
    path::{Path, PathBuf},
    time::Duration,
};

use bapo_learner::record::{Metric, StepRecord};
use bapo_proto::v1::{Stats, StatsRequest, batch_source_client::BatchSourceClient};
use indicatif::{ProgressBar, ProgressStyle};

use super::supervise::{Children, Services};
use crate::telemetry;

/// Follows a JSONL log from where it was last read.
struct LogTail {
    path: PathBuf,
    pos: u64,
}

impl LogTail {
    fn read(&mut self) -> Vec<StepRecord> {
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

fn progress_message(v: &StepRecord, last_eval: Option<f64>) -> String {
    let f = |m: Metric| v.get(m);
    let mut s = String::new();
    let mut put = |label: &str, val: Option<f64>, prec: usize| {
        if let Some(x) = val {
            s.push_str(&format!("{label} {x:.prec$}  "));
        }
    };
    put("reward", f(Metric::RewardMean), 3);
    put("eval", last_eval, 3);
    put("entropy", f(Metric::Entropy), 3);
    put("c_low", f(Metric::CLow), 2);
    put("c_high", f(Metric::CHigh), 2);
    put("stale", f(Metric::StalenessMean), 1);
    put("tok/s", f(Metric::TokensPerS), 0);
    s
}

/// What following the run saw.
#[derive(Debug, Default)]
pub struct Followed {
    pub last_eval: Option<f64>,
    pub last_entropy: Option<f64>,
    /// The learner's idle seconds so far.
    pub idle_s: f64,
    /// The buffer's books, last read.
    pub buffer: Option<BTreeMap<String, u64>>,
    /// Groups the learner has drawn from the buffer (trained or refused),
    /// as its last step line says.
    pub groups_drawn: Option<u64>,
    /// Stopped by SIGTERM or Ctrl-C before the learner finished.
    pub interrupted: bool,
}

impl Followed {
    fn observe(&mut self, v: &StepRecord) {
        if let Some(a) = v.get(Metric::EvalAccuracy) {
            self.last_eval = Some(a);
        }
        if let Some(e) = v.get(Metric::Entropy) {
            self.last_entropy = Some(e);
        }
        if let Some(i) = v.get(Metric::IdleS) {
            self.idle_s = i;
        }
        if let Some(g) = v.get(Metric::GroupsDrawn) {
            self.groups_drawn = Some(g as u64);
        }
    }
}

/// Follows `metrics` (the learner's log of `steps` steps) until the learner
/// exits, a service fails (an error) or the run is interrupted.
pub async fn follow(
    children: &mut Children,
    services: &Services,
    metrics: &Path,
    steps: u64,
    quiet: bool,
) -> anyhow::Result<Followed> {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(steps)
    };
    bar.set_style(
        ProgressStyle::with_template("rl  {bar:30} {pos}/{len} [{elapsed}<{eta}] {wide_msg}")
            .expect("valid template"),
    );
    let mut tail = LogTail {
        path: metrics.to_path_buf(),
        pos: 0,
    };
    let mut seen = Followed::default();
    let mut shutdown = std::pin::pin!(telemetry::shutdown_signal());
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = &mut shutdown => { seen.interrupted = true; break; }
        }
        for v in tail.read() {
            seen.observe(&v);
            {
                let s = v.step;
                bar.set_position(s);
                let msg = progress_message(&v, seen.last_eval);
                if quiet && s % 25 == 0 {
                    eprintln!("step {s}: {msg}");
                }
                bar.set_message(msg);
                // Read the buffer's books while it is still up.
                if s + 1 >= steps || s % 20 == 0 {
                    seen.buffer = buffer_books(services).await.or(seen.buffer);
                }
            }
        }
        match children.learner_done() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                bar.abandon();
                return Err(e);
            }
        }
    }
    bar.finish_and_clear();
    Ok(seen)
}

/// The buffer's stats, read with the run's admin certificate; `None` when
/// the buffer does not answer.
pub async fn buffer_stats(services: &Services) -> Option<Stats> {
    let connector = bapo_proto::tls::connector(&services.buffer, services.admin.as_ref()).ok()?;
    let mut c = BatchSourceClient::new(connector.connect().await.ok()?);
    Some(c.get_stats(StatsRequest {}).await.ok()?.into_inner())
}

/// The buffer's stats as `summary.json`'s `buffer` map; `None` when the
/// buffer does not answer.
pub async fn buffer_books(services: &Services) -> Option<BTreeMap<String, u64>> {
    let s = buffer_stats(services).await?;
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
        ("leases_granted".into(), s.leases_granted),
        ("leases_expired".into(), s.leases_expired),
        ("leases_used".into(), s.leases_used),
        ("leases_released".into(), s.leases_released),
    ]);
    for (k, v) in s.evictions {
        m.insert(format!("evicted_{k}"), v);
    }
    for (k, v) in s.rejections {
        m.insert(format!("rejected_{k}"), v);
    }
    Some(m)
}
