//! SAPO (Qwen): a smooth gate instead of a hard clip,
//! `ℓ = −(4/τ)·σ(τ(r − 1))·A` with `τ = τ_pos` for `A > 0`, `τ_neg` otherwise.
//! At `r = 1` the gradient weight `4σ(1−σ)` is 1 (plain policy gradient);
//! far off-policy tokens fade smoothly instead of being cut.

use super::options::Entry;
use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct Sapo {
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub agg: Aggregation,
}

impl Default for Sapo {
    /// verl / swift defaults; verl aggregates SAPO as seq-mean-token-mean.
    fn default() -> Self {
        Self {
            tau_pos: 1.0,
            tau_neg: 1.05,
            agg: Aggregation::SeqMeanTokenMean,
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl PolicyLoss for Sapo {
    fn name(&self) -> &'static str {
        "sapo"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let mut gate_sum = 0.0;
        let ratios = batch.ratios();
        let terms = batch.masked_terms(|t| {
            let (r, a) = (ratios[t], batch.advantages[t]);
            let tau = if a > 0.0 { self.tau_pos } else { self.tau_neg };
            let s = sigmoid(tau * (r - 1.0));
            let gate = 4.0 * s * (1.0 - s);
            gate_sum += gate;
            TokenTerm {
                loss: -(4.0 / tau) * s * a,
                grad: -a * gate * r,
            }
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        out.per_token_metric("sapo_gate_mean", gate_sum, batch);
        out
    }
}

pub const ENTRY: Entry = Entry::new(
    "sapo",
    Estimator::Grpo,
    "SAPO (spec §2.6), verl",
    |o, _| {
        let d = Sapo::default();
        Ok(Box::new(Sapo {
            agg: o.agg(d.agg),
            ..d
        }))
    },
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    #[test]
    fn t3_sapo() {
        let b = t3();
        let sapo = Sapo {
            agg: Aggregation::TokenMean,
            ..Sapo::default()
        };
        let out = sapo.compute(&b, &Denominators::of(&b));
        close(out.loss, -0.126968);
        // grad_t = −A·gate·r/6 with the spec's gates.
        let gates = [0.940015, 0.997504, 0.058223, 0.975598, 0.999375, 0.997249];
        let r = b.ratios();
        for t in 0..6 {
            let want = -b.advantages[t] * gates[t] * r[t] / 6.0;
            assert!((out.grad[t] - want).abs() < 1e-6, "token {t}");
        }
    }

    #[test]
    fn on_policy_sapo_is_the_plain_policy_gradient() {
        let b = batch(&[1.0, -2.0], &[-0.5, -1.0], &[-0.5, -1.0]);
        let out = Sapo::default().compute(&b, &Denominators::of(&b));
        close_all(&out.grad, &[-0.5, 1.0]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&Sapo::default(), 31);
    }
}
