//! The one TOML file every `bapo` command reads: one table per service,
//! plus the model, the task and `bapo run`'s own settings.
//!
//! ```toml
//! [buffer]
//! max_staleness = 4
//! [learner]
//! algo = "bapo"
//! [actor]
//! group_size = 8
//! [model]
//! preset = "tiny"
//! [task]
//! name = "arith"
//! ```
//!
//! Flags given on the command line override the file. `bapo run` without
//! `--config` uses `configs/tiny-arith.toml`, built in.

use std::path::{Path, PathBuf};

use anyhow::Context;
use bapo_actor::{ActorConfig, reward::RewardConfig};
use bapo_buffer::BufferConfig;
use bapo_learner::{LearnerConfig, sft::SftConfig};
use bapo_policy::ModelSpec;
use bapo_tasks::TaskSpec;
use serde::{Deserialize, Serialize};

use crate::security::TlsConfig;

mod cross_table;

/// The built-in configuration of `bapo run`.
pub const TINY_ARITH: &str = include_str!("../configs/tiny-arith.toml");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Actor processes.
    pub actors: usize,
    /// Run directory; default `runs/<UTC time>`.
    pub out: Option<PathBuf>,
    /// Supervised warm start before RL (when no initial model is given).
    pub sft: bool,
    /// Held-out problems of the final evaluation.
    pub eval_problems: usize,
    /// k of the final pass@k.
    pub pass_k: usize,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            actors: 2,
            out: None,
            sft: true,
            eval_problems: 500,
            pass_k: 8,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigFile {
    pub buffer: BufferConfig,
    pub learner: LearnerConfig,
    pub actor: ActorConfig,
    /// Where the actors' rewards come from (the task's verifier, or a
    /// reward service).
    pub reward: RewardConfig,
    pub model: ModelSpec,
    pub task: TaskSpec,
    pub sft: SftConfig,
    pub run: RunConfig,
    /// Mutual TLS of the service commands (`crate::security`).
    pub tls: TlsConfig,
}

impl ConfigFile {
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("parsing config file {}", path.display()))
    }

    /// The file's tables, agreeing on the facts several of them state
    /// ([`cross_table`]).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut c: Self = toml::from_str(text)?;
        let table: toml::Table = toml::from_str(text)?;
        cross_table::settle(&mut c, &table)?;
        Ok(c)
    }

    /// The file, or `bapo run`'s built-in one.
    pub fn load_or_builtin(path: Option<&Path>) -> anyhow::Result<Self> {
        match path {
            Some(_) => Self::load(path),
            None => Self::parse(TINY_ARITH).context("the built-in configs/tiny-arith.toml"),
        }
    }

    pub fn to_toml(&self) -> anyhow::Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_config_parses_and_round_trips() {
        let c = ConfigFile::parse(TINY_ARITH).unwrap();
        let again = ConfigFile::parse(&c.to_toml().unwrap()).unwrap();
        assert_eq!(c, again);
        c.learner.validate().unwrap();
        c.buffer.validate().unwrap();
        c.actor.validate().unwrap();
    }

    #[test]
    fn unknown_keys_are_named() {
        let e = ConfigFile::parse("[learner]\nalgoo = \"bapo\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("algoo"), "{e:#}");
    }
}
