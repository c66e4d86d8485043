//! CISPO (MiniMax-M1): clip the importance weight, stop its gradient, keep
//! every token: `ℓ = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·lp_θ`.
//! The paper set no lower bound (`ε_low ≥ 1`, the default here); its
//! `ε_high` was not published, so the default is verl's shared 0.2
//! (ScaleRL reports performance flat for an upper bound of 4 to 8).

use super::options::Entry;
use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct Cispo {
    pub eps_low: f64,
    pub eps_high: f64,
    pub agg: Aggregation,
}

impl Default for Cispo {
    fn default() -> Self {
        Self {
            eps_low: 1.0,
            eps_high: 0.2,
            agg: Aggregation::TokenMean,
        }
    }
}

impl PolicyLoss for Cispo {
    fn name(&self) -> &'static str {
        "cispo"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let (lo, hi) = ((1.0 - self.eps_low).max(0.0), 1.0 + self.eps_high);
        let (mut low, mut high) = (0usize, 0usize);
        let r = batch.ratios();
        let terms = batch.masked_terms(|t| {
            let (r, a) = (r[t], batch.advantages[t]);
            low += (r < lo) as usize;
            high += (r > hi) as usize;
            let w = r.clamp(lo, hi);
            TokenTerm {
                loss: -w * a * batch.logp[t],
                grad: -w * a,
            }
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        out.per_token_metric("is_weight_clip_frac_low", low as f64, batch);
        out.per_token_metric("is_weight_clip_frac_high", high as f64, batch);
        out
    }
}

pub const ENTRY: Entry = Entry::new(
    "cispo",
    Estimator::Grpo,
    "MiniMax-M1 (spec §2.7), verl compute_policy_loss_cispo",
    |o, _| {
        let d = Cispo::default();
        let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
        Ok(Box::new(Cispo {
            eps_low,
            eps_high,
            agg: o.agg(d.agg),
        }))
    },
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    #[test]
    fn t3_cispo_keeps_every_token() {
        let b = t3();
        let out = Cispo::default().compute(&b, &Denominators::of(&b));
        close(out.loss, 0.353509);
        let w = [1.2, 0.9, 1.2, 0.7, 1.05, 1.1];
        let want: Vec<f64> = (0..6).map(|t| -w[t] * b.advantages[t] / 6.0).collect();
        close_all(&out.grad, &want);
        assert!(out.grad.iter().all(|&g| g != 0.0));
    }

    #[test]
    fn gradient_is_the_stopped_weight_times_advantage() {
        // Not a finite difference of the value: the weight is detached by
        // design. Check the value's derivative with the weight held fixed.
        let b = random_batch(41);
        let d = Denominators::of(&b);
        let c = Cispo::default();
        let out = c.compute(&b, &d);
        let w = crate::loss::agg::weights(c.agg, &b, &d);
        for (t, r) in b.ratios().iter().enumerate() {
            let want = if b.mask[t] {
                -r.clamp(0.0, 1.2) * b.advantages[t] * w[t]
            } else {
                0.0
            };
            assert!((out.grad[t] - want).abs() < 1e-12);
        }
    }
}
