//! The `[actor]` table of the config file.

use bapo_policy::SamplingParams;
use bapo_tasks::Shaping;
use serde::{Deserialize, Serialize};

use crate::{
    env::{EnvConfig, EnvConfigError, episode::Members},
    vllm::{VllmConfig, VllmConfigError},
};

pub use crate::update_mode::UpdateMode;

/// What generates the responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// bapo's own Burn model, in the actor's process.
    #[default]
    Burn,
    /// A vLLM server (`[actor.vllm]`), started by the actor or running
    /// beside it.
    Vllm,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    /// What generates: `burn` (default) or `vllm`.
    pub engine: EngineKind,
    /// The vLLM server of `engine = "vllm"`.
    pub vllm: VllmConfig,
    /// Responses per prompt (K).
    pub group_size: usize,
    /// Groups generated at once (one thread each).
    pub concurrency: usize,
    pub mode: UpdateMode,
    pub sampling: SamplingParams,
    /// Stop-token strings looked up in the tokenizer (those it has).
    pub stop: Vec<String>,
    pub shaping: Shaping,
    /// After SIGTERM, how long in-flight groups may take to finish and be
    /// pushed; unfinished ones are aborted.
    pub shutdown_grace_s: f64,
    /// Stop after this many groups per actor (0: run until stopped).
    pub max_groups: u64,
    /// Seed each slot's sampling RNG from the OS instead of from the actor
    /// id, the slot and `sampling.seed`: runs then differ even with the
    /// same seed. Off, the same seed reproduces the same rollouts.
    pub os_entropy: bool,
    /// Ask the buffer for room (a lease) before generating each group, so
    /// that the staleness bound holds the actor back before it generates
    /// rather than after; off, or against a buffer without leases, groups
    /// are admitted when pushed.
    pub lease: bool,
    /// With a lease, how long to wait for weights at least as new as the
    /// learner version it was granted under before generating with older
    /// ones anyway (a learner that is down must not stop the actor).
    pub lease_weight_wait_s: f64,
    /// Multi-turn episodes against an environment (`[actor.env]`); off by
    /// default.
    pub env: EnvConfig,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            engine: EngineKind::Burn,
            vllm: VllmConfig::default(),
            group_size: 8,
            concurrency: 2,
            mode: UpdateMode::Partial,
            sampling: SamplingParams {
                temperature: 1.0,
                max_new_tokens: 16,
                ..Default::default()
            },
            stop: vec![
                "<eos>".into(),
                "<|endoftext|>".into(),
                "<|im_end|>".into(),
                "</s>".into(),
            ],
            shaping: Shaping::default(),
            shutdown_grace_s: 10.0,
            max_groups: 0,
            os_entropy: false,
            lease: true,
            lease_weight_wait_s: 60.0,
            env: EnvConfig::default(),
        }
    }
}

/// A setting that cannot mean what it says, named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("actor.group_size must be at least 1")]
    GroupSize,
    #[error("actor.concurrency must be at least 1")]
    Concurrency,
    #[error(
        "actor.sampling.temperature = {0}: a training actor must sample at a finite \
         temperature > 0 (greedy decoding gives every group one answer and no \
         behaviour distribution to weight by)"
    )]
    Temperature(f32),
    #[error("{0}")]
    Vllm(#[from] VllmConfigError),
    #[error("actor.lease_weight_wait_s = {0} must be a finite number of seconds >= 0")]
    LeaseWeightWait(f64),
    #[error(
        "actor.sampling.top_k = {0}: truncated sampling records the log-prob of the \
         untruncated distribution, which no learner reproduces; set 0 to train on \
         these rollouts"
    )]
    TopK(usize),
    #[error(
        "actor.sampling.top_p = {0}: truncated sampling records the log-prob of the \
         untruncated distribution, which no learner reproduces; set 1.0 to train on \
         these rollouts"
    )]
    TopP(f32),
    #[error("{0}")]
    Env(#[from] EnvConfigError),
    #[error(
        "actor.concurrency = {concurrency} slots with {per_slot} episode(s) open each \
         (group_size with actor.env.parallel_members, which engine = \"vllm\" sets by \
         default) would open more OpenEnv sessions \
         than actor.env.openenv.max_sessions = {sessions}"
    )]
    OpenEnvSessions {
        concurrency: usize,
        per_slot: usize,
        sessions: usize,
    },
}

impl ActorConfig {
    /// How a slot plays a group's episodes: `[actor.env] parallel_members`,
    /// or unset, at once where the engine batches concurrent requests.
    pub fn members(&self) -> Members {
        match (self.env.parallel_members, self.engine) {
            (Some(true), _) | (None, EngineKind::Vllm) => Members::AtOnce,
            (Some(false), _) | (None, EngineKind::Burn) => Members::InTurn,
        }
    }

    /// Refuses, by name, a configuration whose rollouts the learner could
    /// not train on correctly.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.sampling;
        if self.group_size == 0 {
            return Err(ConfigError::GroupSize);
        }
        if self.concurrency == 0 {
            return Err(ConfigError::Concurrency);
        }
        if !(s.temperature.is_finite() && s.temperature > 0.0) {
            return Err(ConfigError::Temperature(s.temperature));
        }
        if s.top_k != 0 {
            return Err(ConfigError::TopK(s.top_k));
        }
        if s.top_p < 1.0 {
            return Err(ConfigError::TopP(s.top_p));
        }
        if !(self.lease_weight_wait_s.is_finite() && self.lease_weight_wait_s >= 0.0) {
            return Err(ConfigError::LeaseWeightWait(self.lease_weight_wait_s));
        }
        if self.engine == EngineKind::Vllm {
            self.vllm.validate()?;
        }
        self.env.validate()?;
        let sessions = self.env.openenv.max_sessions;
        let per_slot = match self.members() {
            Members::AtOnce => self.group_size,
            Members::InTurn => 1,
        };
        let open = self.concurrency.saturating_mul(per_slot);
        if self.env.kind == crate::env::EnvKind::Openenv && open > sessions {
            return Err(ConfigError::OpenEnvSessions {
                concurrency: self.concurrency,
                per_slot,
                sessions,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut ActorConfig)) -> Result<(), ConfigError> {
        let mut c = ActorConfig::default();
        f(&mut c);
        c.validate()
    }

    #[test]
    fn the_default_is_valid() {
        assert_eq!(with(|_| {}), Ok(()));
    }

    #[test]
    fn settings_a_learner_cannot_train_on_are_refused_by_name() {
        assert_eq!(
            with(|c| c.sampling.temperature = 0.0),
            Err(ConfigError::Temperature(0.0))
        );
        assert!(matches!(
            with(|c| c.sampling.temperature = f32::NAN),
            Err(ConfigError::Temperature(_))
        ));
        assert_eq!(with(|c| c.sampling.top_k = 40), Err(ConfigError::TopK(40)));
        assert_eq!(
            with(|c| c.sampling.top_p = 0.9),
            Err(ConfigError::TopP(0.9))
        );
        assert_eq!(with(|c| c.group_size = 0), Err(ConfigError::GroupSize));
        assert_eq!(with(|c| c.concurrency = 0), Err(ConfigError::Concurrency));
        assert_eq!(
            with(|c| c.lease_weight_wait_s = -1.0),
            Err(ConfigError::LeaseWeightWait(-1.0))
        );
        let msg = with(|c| c.sampling.top_p = 0.9).unwrap_err().to_string();
        assert!(msg.contains("actor.sampling.top_p"), "{msg}");
    }

    /// Each slot holds one OpenEnv session, or a group's worth with
    /// parallel members: fewer sessions than that is refused by name.
    #[test]
    fn openenv_sessions_cover_every_episode_open_at_once() {
        let openenv = |concurrency, parallel, sessions| {
            with(|c| {
                c.concurrency = concurrency;
                c.group_size = 4;
                c.env.kind = crate::env::EnvKind::Openenv;
                c.env.endpoint = "http://127.0.0.1:8000".into();
                c.env.parallel_members = Some(parallel);
                c.env.openenv.max_sessions = sessions;
            })
        };
        assert_eq!(openenv(2, false, 2), Ok(()));
        assert_eq!(openenv(2, true, 8), Ok(()));
        let err = openenv(2, true, 4).unwrap_err();
        assert_eq!(
            err,
            ConfigError::OpenEnvSessions {
                concurrency: 2,
                per_slot: 4,
                sessions: 4
            }
        );
        assert!(err.to_string().contains("parallel_members"), "{err}");
        assert!(openenv(3, false, 2).is_err());
    }

    /// Unset, members play at once where the engine batches concurrent
    /// requests (vLLM) and in turn on Burn; set, as set. The OpenEnv
    /// check counts the members the engine's default opens.
    #[test]
    fn members_play_at_once_by_default_only_on_vllm() {
        let of = |engine, parallel| {
            let mut c = ActorConfig {
                engine,
                ..Default::default()
            };
            c.env.parallel_members = parallel;
            c.members()
        };
        assert_eq!(of(EngineKind::Burn, None), Members::InTurn);
        assert_eq!(of(EngineKind::Vllm, None), Members::AtOnce);
        assert_eq!(of(EngineKind::Vllm, Some(false)), Members::InTurn);
        assert_eq!(of(EngineKind::Burn, Some(true)), Members::AtOnce);
        let vllm_openenv = |sessions| {
            let mut c = ActorConfig {
                engine: EngineKind::Vllm,
                group_size: 4,
                ..Default::default()
            };
            c.env.kind = crate::env::EnvKind::Openenv;
            c.env.endpoint = "http://127.0.0.1:8000".into();
            c.env.openenv.max_sessions = sessions;
            c.validate()
        };
        let err = vllm_openenv(1).unwrap_err();
        assert!(err.to_string().contains("engine = \"vllm\""), "{err}");
        assert_eq!(vllm_openenv(8), Ok(()), "2 slots x 4 members");
    }
}
