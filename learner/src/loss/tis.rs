//! Truncated importance sampling (TIS): the PPO loss of each token times the
//! detached behaviour weight `min(π_old/π_behav, C)`, per token or per
//! sequence (`min(Π_t ρ_t, C)` broadcast to the sequence's tokens). Corrects
//! for a rollout engine whose log-probs differ from the trainer's even at
//! the same weights. verl's default cap is C = 2.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{
    Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, decoupled::weighted_clipped,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TisLevel {
    Token,
    Sequence,
}

#[derive(Debug, Clone)]
pub struct Tis {
    pub eps_low: f64,
    pub eps_high: f64,
    pub dual_clip: Option<f64>,
    pub cap: f64,
    pub level: TisLevel,
    pub agg: Aggregation,
}

impl Default for Tis {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            cap: 2.0,
            level: TisLevel::Token,
            agg: Aggregation::TokenMean,
        }
    }
}

impl PolicyLoss for Tis {
    fn name(&self) -> &'static str {
        "tis"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let log_w = batch.behav_log_weights();
        let weights: Vec<Option<f64>> = match self.level {
            TisLevel::Token => log_w.iter().map(|l| Some(l.exp().min(self.cap))).collect(),
            TisLevel::Sequence => {
                let mut sums: HashMap<u32, f64> = HashMap::new();
                for ((l, &m), s) in log_w.iter().zip(&batch.mask).zip(&batch.seq_ids) {
                    if m {
                        *sums.entry(*s).or_default() += l;
                    }
                }
                batch
                    .seq_ids
                    .iter()
                    .map(|s| {
                        let l = sums.get(s).copied().unwrap_or(0.0).clamp(-20.0, 20.0);
                        Some(l.exp().min(self.cap))
                    })
                    .collect()
            }
        };
        let bounds = (1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip);
        weighted_clipped(batch, d, self.agg, bounds, &weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{ppo::PpoClip, testing::*};

    #[test]
    fn without_behaviour_log_probs_it_is_ppo() {
        let b = t3();
        let d = Denominators::of(&b);
        let tis = Tis::default().compute(&b, &d);
        let ppo = PpoClip::ppo().compute(&b, &d);
        close(tis.loss, ppo.loss);
        close_all(&tis.grad, &ppo.grad);
    }

    #[test]
    fn weights_are_truncated_at_the_cap() {
        let ln = f64::ln;
        let b = TokenBatch::new(
            vec![1.0, 1.0],
            vec![ln(0.4), ln(0.4)],
            vec![ln(0.4), ln(0.4)],
            Some(vec![ln(0.1), ln(0.5)]),
            None,
            None,
        )
        .unwrap();
        let out = Tis::default().compute(&b, &Denominators::of(&b));
        // w = [min(4, 2), 0.8], r = 1: ℓ = [−2, −0.8].
        close(out.loss, -1.4);
        let seq = Tis {
            level: TisLevel::Sequence,
            ..Tis::default()
        };
        let mut one_seq = b.clone();
        one_seq.seq_ids = vec![0, 0];
        // Π ρ = 4 · 0.8 = 3.2, capped at 2 for both tokens.
        close(
            seq.compute(&one_seq, &Denominators::of(&one_seq)).loss,
            -2.0,
        );
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&Tis::default(), 81);
    }
}
