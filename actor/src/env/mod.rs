//! Multi-turn episodes: an environment answers each model turn, and the
//! rollout holds every turn and every answer, the answers masked from the
//! loss.
//!
//! An environment is one trait, [`Environment`], with three sources chosen
//! by `[actor.env]` ([`config`]): the built-in calculator
//! ([`builtin`]), a user's `bapo.v1.EnvironmentService` over gRPC
//! ([`remote`]), and later an OpenEnv server. [`render`] turns what an
//! environment says into tokens without ever re-tokenizing what the model
//! said; [`episode`] runs the loop and packs the result.
//!
//! An observation or reward is never made up: a call that fails is retried
//! with backoff ([`with_retries`]), then the episode is dropped and counted
//! by reason.

pub mod builtin;
pub mod config;
pub mod episode;
pub mod evaluate;
pub mod openenv;
pub mod remote;
pub mod render;
pub mod slot;

use std::{collections::BTreeMap, time::Duration};

use bapo_tasks::Problem;
use metrics::counter;

pub use config::{EnvConfig, EnvConfigError, EnvKind};

use crate::{metrics as names, reward::BoxFuture};

/// One chat message of an observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What the model sees next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// Chat messages, rendered with the model's chat template (plain text
    /// without one).
    Messages(Vec<Message>),
    /// Text already in the model's format, appended as it is (the task's
    /// own prompt, rendered by the task).
    Text(String),
    /// Token ids of the model's vocabulary, appended as they are.
    Tokens(Vec<u32>),
}

/// What an environment promises (`Describe`).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvInfo {
    pub name: String,
    /// Most model turns per episode; 0: the actor's limit only.
    pub max_turns: u32,
    pub min_reward: f32,
    pub max_reward: f32,
}

/// The longest environment name accepted: it is recorded on every
/// rollout (`reward_source = env:<name>`), where the buffer bounds a
/// metadata value at 4096 bytes.
pub const MAX_ENV_NAME_BYTES: usize = 256;

impl EnvInfo {
    /// Refuses, by name, a description no rollout could carry.
    pub fn check(&self) -> Result<(), EnvError> {
        if self.name.is_empty() || self.name.len() > MAX_ENV_NAME_BYTES {
            return Err(EnvError::new(
                "garbage",
                format!(
                    "the environment's name is {} bytes (Describe): 1 to {MAX_ENV_NAME_BYTES}",
                    self.name.len()
                ),
                false,
            ));
        }
        Ok(())
    }
}

/// What an episode starts from.
#[derive(Debug, Clone, Copy)]
pub struct ResetInput<'a> {
    pub task: &'a str,
    pub problem: &'a Problem,
    pub seed: u64,
}

/// A started episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Started {
    pub episode_id: String,
    pub observation: Observation,
}

/// One model turn, as sent to the environment.
#[derive(Debug, Clone, Copy)]
pub struct Turn<'a> {
    /// Decoded, stop token removed.
    pub text: &'a str,
    /// As sampled, a final stop token included.
    pub tokens: &'a [u32],
    /// Cut off by the per-turn token cap.
    pub truncated: bool,
    /// From 0; a retry repeats it.
    pub index: u32,
}

/// The environment's answer to a turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutcome {
    pub observation: Option<Observation>,
    pub reward: f32,
    pub done: bool,
    pub truncated: bool,
    pub info: BTreeMap<String, String>,
}

/// Why a call gave no usable answer; `reason` labels the metrics.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("environment {reason}: {message}")]
pub struct EnvError {
    pub reason: &'static str,
    pub message: String,
    /// Worth another try (a timeout, an unavailable server); an answer
    /// that breaks the contract or an episode the server no longer knows
    /// is not.
    pub retryable: bool,
}

impl EnvError {
    pub fn new(reason: &'static str, message: impl Into<String>, retryable: bool) -> Self {
        Self {
            reason,
            message: message.into(),
            retryable,
        }
    }
}

/// A world the model acts in, one episode per group member.
pub trait Environment: Send + Sync {
    fn describe(&self) -> BoxFuture<'_, Result<EnvInfo, EnvError>>;
    fn reset<'a>(&'a self, input: ResetInput<'a>) -> BoxFuture<'a, Result<Started, EnvError>>;
    fn step<'a>(
        &'a self,
        episode_id: &'a str,
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<StepOutcome, EnvError>>;
    /// Frees the episode's state; failures are logged, not returned (the
    /// episode is over either way).
    fn close<'a>(&'a self, episode_id: &'a str) -> BoxFuture<'a, ()>;

    /// Whether a step may be sent again after a failure (the turn number
    /// makes a repeat harmless). Not for OpenEnv: its steps act on every
    /// send, so a failed step drops the episode.
    fn steps_retryable(&self) -> bool {
        true
    }
}

pub use crate::backoff::Retry;

/// `call` until it succeeds, fails for good, or `retry.retries` further
/// attempts fail; each failure is counted by reason.
pub async fn with_retries<T, F>(
    retry: Retry,
    what: &'static str,
    call: impl FnMut() -> F,
) -> Result<T, EnvError>
where
    F: std::future::Future<Output = Result<T, EnvError>>,
{
    crate::backoff::retrying(retry, call, |e: &EnvError| {
        counter!(names::ENV_ERRORS, "call" => what, "reason" => e.reason).increment(1);
        if e.retryable {
            tracing::debug!("environment {what} failed ({e}); retrying");
        }
        e.retryable
    })
    .await
}

/// Everything a slot needs to run episodes, built once per actor.
pub struct EnvSetup {
    pub env: std::sync::Arc<dyn Environment>,
    /// As the environment described itself at start.
    pub info: EnvInfo,
    pub renderer: render::Renderer,
    pub limits: episode::Limits,
    pub retry: Retry,
}

impl EnvSetup {
    /// Episodes of this environment, decoded with `tokenizer` and ended at
    /// `stop_tokens`, its calls made on `handle`.
    pub fn runner<'a>(
        &'a self,
        tokenizer: &'a bapo_policy::tokenizer::TextTokenizer,
        stop_tokens: &'a [u32],
        handle: &'a tokio::runtime::Handle,
    ) -> episode::Runner<'a> {
        episode::Runner {
            env: &*self.env,
            info: &self.info,
            renderer: &self.renderer,
            tokenizer,
            stop_tokens,
            limits: self.limits,
            retry: self.retry,
            handle,
        }
    }
}

/// The environment `cfg` names, asked to describe itself (retried as a
/// call is): `None` when episodes are off.
pub async fn setup(
    cfg: &EnvConfig,
    turn_tokens: usize,
    task: std::sync::Arc<dyn bapo_tasks::Task>,
    tokenizer: std::sync::Arc<bapo_policy::tokenizer::TextTokenizer>,
    chat: Option<(bapo_policy::chat::ChatTemplate, Option<String>)>,
) -> anyhow::Result<Option<EnvSetup>> {
    let Some(url) = (match cfg.kind {
        EnvKind::None => return Ok(None),
        EnvKind::Builtin => None,
        EnvKind::Grpc | EnvKind::Openenv => cfg.validate()?,
    }) else {
        return finish(
            cfg,
            turn_tokens,
            std::sync::Arc::new(builtin::Calculator::new(task)),
            tokenizer,
            chat,
        )
        .await;
    };
    let env: std::sync::Arc<dyn Environment> = if cfg.kind == EnvKind::Openenv {
        let retry = Retry {
            retries: cfg.retries,
            backoff: Duration::from_millis(cfg.backoff_ms),
        };
        let timeout = Duration::from_millis(cfg.step_timeout_ms);
        let env = with_retries(retry, "connect", || {
            openenv::OpenEnv::connect(&url.0, &cfg.openenv, timeout)
        })
        .await
        .map_err(|e| anyhow::anyhow!("[actor.env] {:?}: {e}", cfg.endpoint))?;
        std::sync::Arc::new(env)
    } else {
        std::sync::Arc::new(remote::Remote::new(cfg, &url.0, url.1)?)
    };
    finish(cfg, turn_tokens, env, tokenizer, chat).await
}

async fn finish(
    cfg: &EnvConfig,
    turn_tokens: usize,
    env: std::sync::Arc<dyn Environment>,
    tokenizer: std::sync::Arc<bapo_policy::tokenizer::TextTokenizer>,
    chat: Option<(bapo_policy::chat::ChatTemplate, Option<String>)>,
) -> anyhow::Result<Option<EnvSetup>> {
    let retry = Retry {
        retries: cfg.retries,
        backoff: Duration::from_millis(cfg.backoff_ms),
    };
    let call_timeout = Duration::from_millis(cfg.step_timeout_ms);
    let info = with_retries(retry, "describe", || async {
        tokio::time::timeout(call_timeout, env.describe())
            .await
            .unwrap_or_else(|_| Err(EnvError::new("timeout", "Describe", true)))
    })
    .await
    .and_then(|info| info.check().map(|()| info))
    .map_err(|e| anyhow::anyhow!("[actor.env] {:?}: {e}", cfg.endpoint))?;
    tracing::info!(
        "environment {:?}: up to {} turns, rewards in [{}, {}]",
        info.name,
        info.max_turns,
        info.min_reward,
        info.max_reward
    );
    let (template, system) = chat.map_or((None, None), |(t, s)| (Some(t), s));
    let renderer = render::Renderer::new(
        tokenizer,
        template,
        system,
        cfg.max_observation_tokens,
        cfg.truncate,
    );
    Ok(Some(EnvSetup {
        env,
        info,
        renderer,
        limits: episode::Limits {
            max_turns: cfg.max_turns,
            max_tokens: cfg.max_episode_tokens,
            turn_tokens,
            call_timeout,
            deadline: Duration::from_secs_f64(cfg.episode_timeout_s),
        },
        retry,
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Describes itself with a name of `n` bytes; plays nothing.
    struct Named(usize);

    impl Environment for Named {
        fn describe(&self) -> BoxFuture<'_, Result<EnvInfo, EnvError>> {
            let name = "n".repeat(self.0);
            Box::pin(async move {
                Ok(EnvInfo {
                    name,
                    max_turns: 1,
                    min_reward: 0.0,
                    max_reward: 1.0,
                })
            })
        }
        fn reset<'a>(&'a self, _: ResetInput<'a>) -> BoxFuture<'a, Result<Started, EnvError>> {
            Box::pin(async { Err(EnvError::new("error", "unused", false)) })
        }
        fn step<'a>(
            &'a self,
            _: &'a str,
            _: Turn<'a>,
        ) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
            Box::pin(async { Err(EnvError::new("error", "unused", false)) })
        }
        fn close<'a>(&'a self, _: &'a str) -> BoxFuture<'a, ()> {
            Box::pin(async {})
        }
    }

    #[tokio::test]
    async fn a_name_no_rollout_could_carry_is_refused_at_start() {
        let cfg = EnvConfig {
            kind: EnvKind::Grpc,
            ..Default::default()
        };
        let tok = std::sync::Arc::new(bapo_policy::tokenizer::TextTokenizer::char_level());
        let setup = |n| finish(&cfg, 16, std::sync::Arc::new(Named(n)), tok.clone(), None);
        assert!(setup(MAX_ENV_NAME_BYTES).await.is_ok());
        let e = setup(5000).await.err().unwrap().to_string();
        assert!(e.contains("name is 5000 bytes"), "{e}");
    }

    #[tokio::test]
    async fn retries_stop_at_success_at_the_limit_or_at_a_final_error() {
        let retry = Retry {
            retries: 2,
            backoff: Duration::from_millis(1),
        };
        let calls = AtomicU32::new(0);
        let flaky = || async {
            let n = calls.fetch_add(1, Ordering::Relaxed);
            if n < 2 {
                Err(EnvError::new("unavailable", "down", true))
            } else {
                Ok(n)
            }
        };
        assert_eq!(with_retries(retry, "step", flaky).await, Ok(2));
        calls.store(0, Ordering::Relaxed);
        let down = || async {
            calls.fetch_add(1, Ordering::Relaxed);
            Err::<(), _>(EnvError::new("timeout", "slow", true))
        };
        assert!(with_retries(retry, "step", down).await.is_err());
        assert_eq!(calls.load(Ordering::Relaxed), 3, "one call and two retries");
        calls.store(0, Ordering::Relaxed);
        let gone = || async {
            calls.fetch_add(1, Ordering::Relaxed);
            Err::<(), _>(EnvError::new("not_found", "restarted", false))
        };
        assert_eq!(
            with_retries(retry, "step", gone).await.unwrap_err().reason,
            "not_found"
        );
        assert_eq!(calls.load(Ordering::Relaxed), 1, "not retried");
    }
}
