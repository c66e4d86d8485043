//! `summary.json`: what one local run did, in numbers. A leaf type: the
//! orchestrator fills it, the report and `bapo study` read it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The summary of one `bapo run` (not the learner's own `RunSummary`, which
/// covers the learner service alone).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalRunSummary {
    pub algo: String,
    /// The rank of the LoRA adapters trained on a frozen base; absent when
    /// every weight trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_rank: Option<usize>,
    pub max_staleness: u64,
    pub actors: usize,
    pub steps: u64,
    pub warm_start_accuracy: f64,
    pub warm_start_pass_at_k: Option<f64>,
    pub final_accuracy: f64,
    pub final_pass_at_k: Option<f64>,
    pub pass_k: usize,
    pub eval_problems: usize,
    /// Supervised steps of the warm start this run made (none with `--init`
    /// or `sft = false`).
    #[serde(default)]
    pub sft_steps: Option<u64>,
    pub sft_seconds: f64,
    pub rl_seconds: f64,
    pub total_seconds: f64,
    pub learner_idle_fraction: f64,
    pub final_entropy: Option<f64>,
    pub buffer: BTreeMap<String, u64>,
    /// Groups the buffer handed out equal the groups the learner trained on.
    pub reconciled: bool,
}
