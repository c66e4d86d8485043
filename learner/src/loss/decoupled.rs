//! AReaL's decoupled PPO objective: three policies. The trust region is
//! taken against the proximal policy (`lp_old` here, recomputed one step
//! behind), and a detached weight `w = π_prox/π_behav` corrects for the
//! policy that actually sampled the token (stale weights, partial rollouts):
//!
//! `ℓ = w · max(−A·u, −A·clip(u, 1 − ε, 1 + ε_high))`, `u = π_θ/π_prox`.
//!
//! An optional cap on `w` either masks the token (`mask`, AReaL's rejection
//! sampling) or truncates `w` (`clamp`). Masked tokens keep counting in the
//! denominator: the loss is divided by the original number of tokens.

use serde::{Deserialize, Serialize};

use super::options::Entry;
use super::{
    Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm,
    ppo::clipped_term,
};
use crate::advantage::Estimator;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapMode {
    Mask,
    Clamp,
}

#[derive(Debug, Clone)]
pub struct Decoupled {
    pub eps_low: f64,
    pub eps_high: f64,
    pub dual_clip: Option<f64>,
    /// Cap on the behaviour weight `w` (> 1), and what exceeding it does.
    pub behav_cap: Option<(f64, CapMode)>,
    pub agg: Aggregation,
}

impl Default for Decoupled {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            behav_cap: None,
            agg: Aggregation::TokenMean,
        }
    }
}

/// The clipped surrogate at `[c_low, c_high]` with each token scaled by a
/// detached weight (`None`: the token is rejected).
pub fn weighted_clipped(
    batch: &TokenBatch,
    d: &Denominators,
    agg: Aggregation,
    (c_low, c_high, dual_clip): (f64, f64, Option<f64>),
    weights: &[Option<f64>],
) -> LossOutput {
    let mut clips = ClipCounts::default();
    let mut rejected = 0usize;
    let u = batch.ratios();
    let terms = batch.masked_terms(|t| {
        let Some(w) = weights[t] else {
            rejected += 1;
            return TokenTerm::default();
        };
        let term = clipped_term(
            batch.advantages[t],
            u[t],
            c_low,
            c_high,
            dual_clip,
            &mut clips,
        );
        TokenTerm {
            loss: w * term.loss,
            grad: w * term.grad,
        }
    });
    let mut out = LossOutput::aggregate(&terms, agg, batch, d);
    clips.insert_into(batch.masked_count(), &mut out.metrics);
    let kept: Vec<f64> = weights
        .iter()
        .zip(&batch.mask)
        .filter_map(|(w, &m)| if m { *w } else { None })
        .collect();
    out.metrics.insert(
        "behav_weight_mean".into(),
        kept.iter().sum::<f64>() / kept.len().max(1) as f64,
    );
    out.per_token_metric("behav_rejected_frac", rejected as f64, batch);
    out
}

impl PolicyLoss for Decoupled {
    fn name(&self) -> &'static str {
        "decoupled"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let weights: Vec<Option<f64>> = batch
            .behav_log_weights()
            .into_iter()
            .map(|l| {
                let w = l.exp();
                match self.behav_cap {
                    Some((cap, CapMode::Mask)) if w > cap => None,
                    Some((cap, CapMode::Clamp)) => Some(w.min(cap)),
                    _ => Some(w),
                }
            })
            .collect();
        let bounds = (1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip);
        weighted_clipped(batch, d, self.agg, bounds, &weights)
    }
}

pub const ENTRY: Entry = Entry::new(
    "decoupled",
    Estimator::Grpo,
    "AReaL (spec §2.15); estimator not stated there, GRPO kept",
    |o, _| {
        let d = Decoupled::default();
        let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
        Ok(Box::new(Decoupled {
            eps_low,
            eps_high,
            dual_clip: o.dual(d.dual_clip),
            agg: o.agg(d.agg),
            ..d
        }))
    },
)
.needs_behaviour();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    /// T4: token A is inside the trust region, token B clipped.
    #[test]
    fn t4_decoupled_ppo() {
        let ln = f64::ln;
        let b = TokenBatch::new(
            vec![1.0, -1.0],
            vec![ln(0.33), ln(0.2)],
            vec![ln(0.3), ln(0.3)],
            Some(vec![ln(0.2), ln(0.5)]),
            None,
            None,
        )
        .unwrap();
        // Summed per-token values: token-sum over one "sequence" each.
        let d = Denominators {
            tokens: 1.0,
            seqs: 1.0,
            l_const: 1.0,
        };
        let out = Decoupled::default().compute(&b, &d);
        close(out.loss, -1.65 + 0.48);
        close_all(&out.grad, &[-1.65, 0.0]);
        close(out.metrics["behav_weight_mean"], (1.5 + 0.6) / 2.0);
    }

    #[test]
    fn a_rejected_token_still_counts_in_the_denominator() {
        let ln = f64::ln;
        let b = TokenBatch::new(
            vec![1.0, 1.0],
            vec![ln(0.3), ln(0.3)],
            vec![ln(0.3), ln(0.3)],
            Some(vec![ln(0.3), ln(0.01)]),
            None,
            None,
        )
        .unwrap();
        let loss = Decoupled {
            behav_cap: Some((5.0, CapMode::Mask)),
            ..Decoupled::default()
        };
        let out = loss.compute(&b, &Denominators::of(&b));
        close(out.loss, -0.5);
        close(out.metrics["behav_rejected_frac"], 0.5);
        let clamp = Decoupled {
            behav_cap: Some((5.0, CapMode::Clamp)),
            ..Decoupled::default()
        };
        close(
            clamp.compute(&b, &Denominators::of(&b)).loss,
            -(1.0 + 5.0) / 2.0,
        );
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&Decoupled::default(), 71);
    }
}
