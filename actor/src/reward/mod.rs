//! Where a group's rewards come from: the task's built-in verifier, or a
//! user's `bapo.v1.RewardService` over gRPC ([`remote`]), behind one
//! trait, [`Verifier`], chosen by the `[reward]` table ([`config`]).
//!
//! A reward is never made up: a call that fails (an error status, a
//! timeout, an answer that breaks the contract: the wrong number of
//! scores, a NaN, a reward outside the range the server declared) is
//! retried with backoff ([`score_group`]), and after the last retry the
//! group is dropped and counted by reason. Shaping (`[shaping]`) is laid
//! on top by the caller, the same for every source.

pub mod config;
pub mod remote;

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use bapo_tasks::{Problem, Task};
use metrics::{counter, histogram};

pub use config::{RewardConfig, RewardConfigError, Source};

use crate::metrics as names;

/// One completion to score.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Decoded text, stop token removed.
    pub text: String,
    /// The response's token ids as the learner sees them (a final stop
    /// token included): per-token rewards align with these.
    pub tokens: Vec<u32>,
    /// Cut off by the token budget rather than ended by a stop token.
    pub truncated: bool,
}

/// A group to score: the K completions of one problem.
#[derive(Debug, Clone, Copy)]
pub struct Group<'a> {
    pub task: &'a str,
    pub problem: &'a Problem,
    pub completions: &'a [Completion],
}

/// The score of one completion, before shaping.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scored {
    pub reward: f32,
    /// Whether the task's own format check passes (built-in verifiers
    /// only; the format bonus needs it).
    pub well_formed: bool,
    /// Empty, or one per token of the completion.
    pub token_rewards: Vec<f32>,
    /// Named parts of the reward, for metrics and the rollout's metadata.
    pub sub_scores: BTreeMap<String, f32>,
}

/// Why a Score call gave no usable answer; `reason` labels the metrics.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("reward {reason}: {message}")]
pub struct RewardError {
    pub reason: &'static str,
    pub message: String,
}

impl RewardError {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A source of rewards.
pub trait Verifier: Send + Sync {
    /// Names the source on every rollout (`reward_source` metadata).
    fn name(&self) -> String;

    /// One score per completion of `group`, in order.
    fn score<'a>(&'a self, group: Group<'a>) -> BoxFuture<'a, Result<Vec<Scored>, RewardError>>;
}

/// The task's own verifier: in process, never fails.
pub struct Builtin {
    task: Arc<dyn Task>,
    name: String,
}

impl Builtin {
    pub fn new(task: Arc<dyn Task>) -> Self {
        let name = format!("builtin:{}", task.name());
        Self { task, name }
    }
}

impl Verifier for Builtin {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn score<'a>(&'a self, group: Group<'a>) -> BoxFuture<'a, Result<Vec<Scored>, RewardError>> {
        let scores = group
            .completions
            .iter()
            .map(|c| Scored {
                reward: self
                    .task
                    .score_response(group.problem, &c.text, c.truncated),
                well_formed: self.task.well_formed(group.problem, &c.text),
                ..Default::default()
            })
            .collect();
        Box::pin(std::future::ready(Ok(scores)))
    }
}

pub use crate::backoff::Retry;

impl From<&RewardConfig> for Retry {
    fn from(c: &RewardConfig) -> Self {
        Self {
            retries: c.retries,
            backoff: Duration::from_millis(c.backoff_ms),
        }
    }
}

/// Scores `group`, retrying a failed call `retry.retries` times with
/// backoff. The last error is returned (the caller drops the group); every
/// failed call and every dropped group is counted by reason.
pub async fn score_group(
    verifier: &dyn Verifier,
    group: Group<'_>,
    retry: Retry,
) -> Result<Vec<Scored>, RewardError> {
    let call = || async {
        let t0 = std::time::Instant::now();
        let result = verifier.score(group).await;
        histogram!(names::REWARD_SECONDS).record(t0.elapsed().as_secs_f64());
        result
    };
    let failed = |e: &RewardError| {
        counter!(names::REWARD_ERRORS, "reason" => e.reason).increment(1);
        tracing::debug!(problem = %group.problem.id, "{e}");
        true
    };
    match crate::backoff::retrying(retry, call, failed).await {
        Ok(scores) => {
            record_sub_scores(&scores);
            Ok(scores)
        }
        Err(e) => {
            counter!(names::REWARD_GROUPS_DROPPED, "reason" => e.reason).increment(1);
            tracing::warn!(
                problem = %group.problem.id,
                "{e}; group dropped after {} attempts",
                retry.retries + 1
            );
            Err(e)
        }
    }
}

/// Sub-score names exported as metric labels, at most: a server inventing
/// names must not grow the metrics without bound (later names still reach
/// the rollouts' metadata).
const MAX_SUB_SCORE_NAMES: usize = 32;

fn record_sub_scores(scores: &[Scored]) {
    static EXPORTED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut exported = EXPORTED.lock().unwrap_or_else(|p| p.into_inner());
    for s in scores {
        for (name, v) in &s.sub_scores {
            if !exported.contains(name) {
                if exported.len() >= MAX_SUB_SCORE_NAMES {
                    continue;
                }
                exported.insert(name.clone());
            }
            histogram!(names::REWARD_SUB_SCORE, "name" => name.clone()).record(f64::from(*v));
        }
    }
}

/// The verifier `cfg` names, for `task`.
pub fn build(
    cfg: &RewardConfig,
    task: Arc<dyn Task>,
    format_bonus: f32,
) -> anyhow::Result<Arc<dyn Verifier>> {
    Ok(match cfg.source(task.name(), format_bonus)? {
        Source::Builtin => Arc::new(Builtin::new(task)),
        Source::Remote { url, tls } => Arc::new(remote::Remote::new(cfg, &url, tls)?),
    })
}
