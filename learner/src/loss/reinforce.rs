//! Group-relative REINFORCE as an off-policy algorithm (Trinity-RFT's
//! unified form, no clipping, no importance weight), with the two
//! regularisers that make it usable off-policy:
//!
//! * **OPMD** (Kimi): `ℓ = −A·lp_θ + τ·(lp_θ − lp_old)²`, `τ = 0.1`.
//! * **AsymRE** (Meta): `ℓ = −A·lp_θ − τ·lp_θ`, `τ = 0.1`, the same as
//!   lowering the baseline by τ.
//!
//! Values are REINFORCE surrogates (their level means nothing); gradients
//! are what matters. Token-mean aggregation.

use super::options::Entry;
use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm, log_ratio};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct Opmd {
    pub tau: f64,
    pub agg: Aggregation,
}

impl Default for Opmd {
    fn default() -> Self {
        Self {
            tau: 0.1,
            agg: Aggregation::TokenMean,
        }
    }
}

#[derive(Debug, Clone)]
pub struct AsymRe {
    pub tau: f64,
    pub agg: Aggregation,
}

impl Default for AsymRe {
    fn default() -> Self {
        Self {
            tau: 0.1,
            agg: Aggregation::TokenMean,
        }
    }
}

impl PolicyLoss for Opmd {
    fn name(&self) -> &'static str {
        "opmd"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let tau = self.tau;
        let mut reg = 0.0;
        let terms = batch.masked_terms(|t| {
            let (a, lp) = (batch.advantages[t], batch.logp[t]);
            let delta = log_ratio(lp, batch.logp_old[t]);
            reg += delta * delta;
            TokenTerm {
                loss: -a * lp + tau * delta * delta,
                grad: -a + 2.0 * tau * delta,
            }
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        out.per_token_metric("k2_regulariser", reg, batch);
        out
    }
}

impl PolicyLoss for AsymRe {
    fn name(&self) -> &'static str {
        "asymre"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let tau = self.tau;
        let terms = batch.masked_terms(|t| {
            let a = batch.advantages[t];
            TokenTerm {
                loss: -(a + tau) * batch.logp[t],
                grad: -(a + tau),
            }
        });
        LossOutput::aggregate(&terms, self.agg, batch, d)
    }
}

pub const OPMD: Entry = Entry::new(
    "opmd",
    Estimator::DrGrpo,
    "Trinity-RFT OPMD (spec §2.11): no std normalisation",
    |o, _| {
        let d = Opmd::default();
        Ok(Box::new(Opmd {
            agg: o.agg(d.agg),
            ..d
        }))
    },
);

/// The loss never reads `lp_old`: `−(A + τ)·lp_θ`.
pub const ASYMRE: Entry = Entry::new(
    "asymre",
    Estimator::DrGrpo,
    "Trinity-RFT AsymRE (spec §2.11): no std; the τ shift is in the loss",
    |o, _| {
        let d = AsymRe::default();
        Ok(Box::new(AsymRe {
            agg: o.agg(d.agg),
            ..d
        }))
    },
)
.ratio_free();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    #[test]
    fn asymre_is_reinforce_with_a_lowered_baseline() {
        let b = batch(&[0.5, -0.5], &[-1.0, -2.0], &[-1.0, -2.0]);
        let out = AsymRe::default().compute(&b, &Denominators::of(&b));
        close_all(&out.grad, &[-0.3, 0.2]);
        close(out.loss, (0.6 - 0.8) / 2.0);
    }

    #[test]
    fn opmd_pulls_back_towards_the_old_policy() {
        // No advantage: the regulariser alone pushes lp back to lp_old.
        let b = batch(&[0.0, 0.0], &[-1.0, -2.5], &[-1.5, -2.0]);
        let out = Opmd::default().compute(&b, &Denominators::of(&b));
        assert!(out.grad[0] > 0.0 && out.grad[1] < 0.0);
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&Opmd::default(), 61);
        check_gradient(&AsymRe::default(), 62);
    }
}
