//! The `[learner]` table of the config file: the loss and its options, the
//! optimiser, batching, and how often to broadcast, checkpoint and evaluate.

use serde::{Deserialize, Serialize};

use crate::{
    advantage::{Estimator, StdKind},
    loss::{
        Aggregation, LossError, PolicyLoss,
        bapo::BapoMode,
        registry::{self, LossOptions},
    },
    schedule::{Decay, LrSchedule},
};

/// Which log-probs play `lp_old`, the anchor of the ratio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Proximal {
    /// `lp_old := lp_behav`, the log-probs the actor recorded: the ratio is
    /// `π_θ / π_rollout`, as in the BAPO paper (its eq. 4 equates the old
    /// policy with the rollout policy). With one optimiser step per batch
    /// this is the only choice under which clipping sees the staleness, and
    /// it costs no extra forward pass.
    Behavior,
    /// `lp_old` recomputed by the learner before the update, `lp_behav`
    /// passed on separately (AReaL's decoupled objective, TIS).
    Recompute,
}

/// Over which tokens a loss's data-dependent choices are made (BAPO's
/// bound search, GSPO's sequence ratios, clip statistics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SearchScope {
    /// Once per optimiser step on the whole batch: the same bounds for
    /// every micro-batch, and data-parallel ranks agree.
    Step,
    /// Per micro-batch, as the official BAPO code does; the aggregation
    /// denominators stay those of the whole step.
    MicroBatch,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LearnerConfig {
    /// Loss by name (`bapo loss --help` lists them).
    pub algo: String,
    pub bapo_mode: BapoMode,
    pub clip_eps: Option<f64>,
    pub clip_eps_high: Option<f64>,
    pub dual_clip: Option<f64>,
    /// Overrides the loss's own aggregation.
    pub agg: Option<String>,
    pub proximal: Proximal,
    pub search_scope: SearchScope,
    pub advantage: Estimator,
    /// Drop groups whose rewards are all equal (DAPO's dynamic sampling).
    pub filter_zero_variance: bool,
    /// Groups per optimiser step; must equal the buffer's `batch_groups`,
    /// which its staleness bound counts in.
    pub batch_groups: u32,
    /// Sequences per forward/backward pass; gradients accumulate over the
    /// micro-batches of a step, with the step's global denominators.
    pub micro_batch_seqs: usize,
    /// Peak learning rate (see [`LrSchedule`]).
    pub lr: f64,
    pub warmup_steps: u64,
    pub decay: Decay,
    pub decay_steps: u64,
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    /// Global gradient-norm clipping; 0 disables.
    pub max_grad_norm: f64,
    /// The sampling temperature of the actors (log-probs are of the same
    /// temperature-scaled distribution).
    pub temperature: f32,
    /// Entropy bonus coefficient (off by default, as in BAPO).
    pub entropy_coef: f64,
    /// KL (k3) penalty to the initial policy (off by default).
    pub kl_coef: f64,
    /// Scale the learning rate by VCPO's ESS rule.
    pub vcpo: bool,
    /// Stop after this many optimiser steps; 0 runs until stopped.
    pub steps: u64,
    /// Publish weights every N steps.
    pub broadcast_every: u64,
    /// Checkpoint every N steps (and on shutdown); 0 only on shutdown.
    pub checkpoint_every: u64,
    /// Checkpoints kept on disk.
    pub keep_checkpoints: usize,
    /// Held-out greedy accuracy every N steps; 0 disables.
    pub eval_every: u64,
    pub eval_problems: usize,
    /// Longest response the evaluation generates.
    pub eval_max_new_tokens: usize,
    pub seed: u64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            algo: "bapo".into(),
            bapo_mode: BapoMode::Paper,
            clip_eps: None,
            clip_eps_high: None,
            dual_clip: None,
            agg: None,
            proximal: Proximal::Behavior,
            search_scope: SearchScope::Step,
            advantage: Estimator::Grpo {
                std: StdKind::Unbiased,
            },
            filter_zero_variance: false,
            batch_groups: 8,
            micro_batch_seqs: 64,
            lr: 1e-6,
            warmup_steps: 0,
            decay: Decay::Constant,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            max_grad_norm: 1.0,
            temperature: 1.0,
            entropy_coef: 0.0,
            kl_coef: 0.0,
            vcpo: false,
            steps: 0,
            broadcast_every: 1,
            checkpoint_every: 50,
            keep_checkpoints: 3,
            eval_every: 10,
            eval_problems: 200,
            eval_max_new_tokens: 16,
            seed: 0,
        }
    }
}

impl LearnerConfig {
    /// The learning-rate schedule. `decay_steps = 0` decays over the steps
    /// left after warm-up, so a run shortened with `--steps` (a study, a
    /// test) still ends at the floor.
    pub fn schedule(&self) -> LrSchedule {
        let decay_steps = match self.decay_steps {
            0 => self.steps.saturating_sub(self.warmup_steps),
            n => n,
        };
        LrSchedule {
            lr: self.lr,
            warmup_steps: self.warmup_steps,
            decay: self.decay,
            decay_steps,
            min_lr_ratio: self.min_lr_ratio,
        }
    }

    /// The configured loss, or an error naming the bad option.
    pub fn build_loss(&self) -> Result<Box<dyn PolicyLoss>, LossError> {
        let agg = match &self.agg {
            None => None,
            Some(s) => Some(Aggregation::parse(s).ok_or_else(|| {
                LossError::new("learner.agg", format!("unknown aggregation {s:?}"))
            })?),
        };
        registry::build(
            &self.algo,
            &LossOptions {
                bapo_mode: Some(self.bapo_mode),
                clip_eps: self.clip_eps,
                clip_eps_high: self.clip_eps_high,
                dual_clip: self.dual_clip,
                agg,
            },
        )
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), LossError> {
        self.build_loss()?;
        let bad = |field: &str, msg: &str| Err(LossError::new(format!("learner.{field}"), msg));
        if self.batch_groups == 0 {
            return bad("batch_groups", "must be at least 1");
        }
        if self.micro_batch_seqs == 0 {
            return bad("micro_batch_seqs", "must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "must be a positive number");
        }
        if self.temperature <= 0.0 {
            return bad(
                "temperature",
                "must be positive (greedy actors have no behaviour distribution)",
            );
        }
        if self.broadcast_every == 0 {
            return bad("broadcast_every", "must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_decay_steps_decay_over_the_rest_of_the_run() {
        let cfg = LearnerConfig {
            lr: 1e-4,
            warmup_steps: 50,
            decay: Decay::Cosine,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            steps: 500,
            ..Default::default()
        };
        let s = cfg.schedule();
        assert_eq!(s.decay_steps, 450);
        assert!((s.at(49) - 1e-4).abs() < 1e-15);
        assert!(s.at(274) < 0.6e-4 && s.at(274) > 0.5e-4);
        assert!((s.at(499) - 1e-5).abs() < 1e-8);
        let fixed = LearnerConfig {
            decay_steps: 100,
            ..cfg
        };
        assert_eq!(fixed.schedule().decay_steps, 100);
    }
}
