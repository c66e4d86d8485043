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

impl LocalRunSummary {
    /// What `bapo run` prints when it ends: a few lines a person reads at
    /// a glance (`--json` prints the whole summary instead).
    pub fn brief(&self) -> String {
        let minutes = |s: f64| s / 60.0;
        let mut lines = vec![format!(
            "{} steps of {}{} with {} actor{} in {:.1} min (warm start {:.1} min)",
            self.steps,
            self.algo,
            self.lora_rank
                .map_or(String::new(), |r| format!(" (LoRA r{r})")),
            self.actors,
            if self.actors == 1 { "" } else { "s" },
            minutes(self.total_seconds),
            minutes(self.sft_seconds),
        )];
        let pass = match (self.warm_start_pass_at_k, self.final_pass_at_k) {
            (Some(a), Some(b)) => format!(", pass@{} {a:.3} -> {b:.3}", self.pass_k),
            _ => String::new(),
        };
        lines.push(format!(
            "held-out greedy accuracy {:.3} -> {:.3}{pass} ({} problems)",
            self.warm_start_accuracy, self.final_accuracy, self.eval_problems
        ));
        let b = |k: &str| self.buffer.get(k).copied().unwrap_or(0);
        let evicted: u64 = self
            .buffer
            .iter()
            .filter(|(k, _)| k.starts_with("evicted_"))
            .map(|(_, v)| v)
            .sum();
        lines.push(format!(
            "buffer: {} groups admitted, {} trained on, {evicted} evicted, {} left; books {}",
            b("admitted_groups"),
            b("groups_consumed"),
            b("groups_ready") + b("groups_pending"),
            if self.reconciled {
                "reconcile"
            } else {
                "DO NOT reconcile"
            },
        ));
        lines.push(format!(
            "learner idle {:.0}% of the RL phase",
            100.0 * self.learner_idle_fraction
        ));
        lines.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brief_says_what_the_run_did_in_four_lines() {
        let s = LocalRunSummary {
            algo: "bapo".into(),
            lora_rank: None,
            max_staleness: 4,
            actors: 1,
            steps: 6,
            warm_start_accuracy: 0.34,
            warm_start_pass_at_k: Some(0.658),
            final_accuracy: 0.4,
            final_pass_at_k: Some(0.7),
            pass_k: 8,
            eval_problems: 500,
            sft_steps: Some(700),
            sft_seconds: 240.0,
            rl_seconds: 240.0,
            total_seconds: 504.0,
            learner_idle_fraction: 0.96,
            final_entropy: None,
            buffer: [
                ("admitted_groups".to_string(), 51),
                ("groups_consumed".into(), 48),
                ("groups_ready".into(), 2),
                ("evicted_stale".into(), 1),
            ]
            .into(),
            reconciled: true,
        };
        let brief = s.brief();
        assert_eq!(brief.lines().count(), 4, "{brief}");
        assert!(
            brief.contains("6 steps of bapo with 1 actor in 8.4 min"),
            "{brief}"
        );
        assert!(
            brief.contains("0.340 -> 0.400, pass@8 0.658 -> 0.700"),
            "{brief}"
        );
        assert!(
            brief.contains("51 groups admitted, 48 trained on, 1 evicted, 2 left; books reconcile"),
            "{brief}"
        );
    }
}
