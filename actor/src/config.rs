//! The `[actor]` table of the config file.

use bapo_policy::SamplingParams;
use bapo_tasks::Shaping;
use serde::{Deserialize, Serialize};

/// What to do with in-flight responses when new weights arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum UpdateMode {
    /// Keep generating with the new weights: later tokens carry the new
    /// version, the KV cache is rebuilt (partial rollouts).
    Partial,
    /// Throw the in-flight group away and start it again.
    Restart,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
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
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
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
        }
    }
}
