//! REC, the clipped forms of group-relative REINFORCE (Yao, Chen et al.,
//! "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm";
//! Trinity-RFT `rec_policy_loss.py`): plain REINFORCE `−A·lp_θ` on the
//! tokens whose ratio `ρ = sg(π_θ/π_old)` is in range, zero elsewhere.
//! Unlike PPO's clip, an out-of-range token gives no gradient whatever
//! the sign of its advantage. The in-range tokens' term is weighted as
//! Trinity's `weight` option says: not at all (NoIS, the default), by `ρ`
//! (IS: `−A·ρ·lp_θ`), or by `ρ` truncated to the ring's outer bounds
//! (TIS: `−A·clip(ρ, 1−ε'_l, 1+ε'_h)·lp_θ`), the weight held constant
//! (detached) as there. Its advantage-weighted form is not built.
//!
//! * **one-side**: `(A ≥ 0 ∧ ρ ≤ 1+ε_h) ∨ (A ≤ 0 ∧ ρ ≥ 1−ε_l)`;
//! * **two-side**: `1−ε_l ≤ ρ ≤ 1+ε_h`;
//! * **ring**: two-side, or far out on the side the update would move
//!   back from: `(A ≥ 0 ∧ ρ ≤ 1−ε'_l) ∨ (A ≤ 0 ∧ ρ ≥ 1+ε'_h)`.
//!
//! Defaults are Trinity's: ε 0.2/0.2, ε' 0.6/2.0, token-mean.

use super::LossError;
pub use super::options::RecWeight;
use super::options::{Entry, LossOptions};
use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm, log_ratio};
use crate::advantage::Estimator;

/// Which tokens a REC loss keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecRange {
    OneSide,
    TwoSide,
    Ring,
}

#[derive(Debug, Clone)]
pub struct Rec {
    pub range: RecRange,
    pub eps_low: f64,
    pub eps_high: f64,
    /// The ring's outer bounds `ε'_l`, `ε'_h`.
    pub ring_low: f64,
    pub ring_high: f64,
    pub weight: RecWeight,
    pub agg: Aggregation,
}

impl Rec {
    pub fn new(range: RecRange) -> Self {
        Self {
            range,
            eps_low: 0.2,
            eps_high: 0.2,
            ring_low: 0.6,
            ring_high: 2.0,
            weight: RecWeight::None,
            agg: Aggregation::TokenMean,
        }
    }

    /// The weight of an in-range token of ratio `rho`.
    pub fn weight_of(&self, rho: f64) -> f64 {
        match self.weight {
            RecWeight::None => 1.0,
            RecWeight::Is => rho,
            RecWeight::Tis => rho.clamp(1.0 - self.ring_low, 1.0 + self.ring_high),
        }
    }

    /// Whether a token of advantage `a` and ratio `rho` is in range.
    pub fn in_range(&self, a: f64, rho: f64) -> bool {
        let (lo, hi) = (1.0 - self.eps_low, 1.0 + self.eps_high);
        let two_side = (lo..=hi).contains(&rho);
        match self.range {
            RecRange::OneSide => (a >= 0.0 && rho <= hi) || (a <= 0.0 && rho >= lo),
            RecRange::TwoSide => two_side,
            RecRange::Ring => {
                two_side
                    || (a >= 0.0 && rho <= 1.0 - self.ring_low)
                    || (a <= 0.0 && rho >= 1.0 + self.ring_high)
            }
        }
    }
}

impl PolicyLoss for Rec {
    fn name(&self) -> &'static str {
        match self.range {
            RecRange::OneSide => "rec-onesided",
            RecRange::TwoSide => "rec-twosided",
            RecRange::Ring => "rec-ring",
        }
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let (mut kept, mut weights) = (0.0, 0.0);
        let terms = batch.masked_terms(|t| {
            let (a, lp) = (batch.advantages[t], batch.logp[t]);
            let rho = log_ratio(lp, batch.logp_old[t]).exp();
            if !self.in_range(a, rho) {
                return TokenTerm::default();
            }
            let w = self.weight_of(rho);
            kept += 1.0;
            weights += w;
            TokenTerm {
                loss: -a * w * lp,
                grad: -a * w,
            }
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        out.per_token_metric("rec_in_range_frac", kept, batch);
        out.metrics
            .insert("rec_weight_mean".into(), weights / f64::max(kept, 1.0));
        out
    }
}

pub const ONE_SIDED: Entry = Entry::new("rec-onesided", Estimator::DrGrpo, SOURCE, |o, _| {
    build(RecRange::OneSide, o)
});
pub const TWO_SIDED: Entry = Entry::new("rec-twosided", Estimator::DrGrpo, SOURCE, |o, _| {
    build(RecRange::TwoSide, o)
});
pub const RING: Entry = Entry::new("rec-ring", Estimator::DrGrpo, SOURCE, |o, _| {
    build(RecRange::Ring, o)
});

const SOURCE: &str =
    "REC (Trinity-RFT rec_policy_loss.py; NoIS unless learner.rec_weight): no std normalisation";

/// `range`'s REC with the bounds, ring and weight of `o`.
fn build(range: RecRange, o: &LossOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    let d = Rec::new(range);
    let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
    let [ring_low, ring_high] = o.rec_ring.unwrap_or([d.ring_low, d.ring_high]);
    Ok(Box::new(Rec {
        eps_low,
        eps_high,
        ring_low,
        ring_high,
        weight: o.rec_weight.unwrap_or_default(),
        agg: o.agg(d.agg),
        ..d
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    /// Vector V1 of the survey notes (shared/docs/seed-algorithms.md §11),
    /// from Trinity-RFT's code: 8 tokens, sequence 0 with A = +1, sequence
    /// 1 with A = −1, ratios r. Built field by field: the vector's
    /// `lp_θ[5] = −1.2 + ln 3.5 > 0` is no sampled token's log-prob, which
    /// `TokenBatch::new` rightly refuses, but the loss's arithmetic holds.
    fn v1() -> TokenBatch {
        let lp_old = vec![-1.0, -2.0, -0.5, -1.5, -0.8, -1.2, -0.3, -2.5];
        let r: [f64; 8] = [1.5, 0.6, 0.3, 1.1, 1.5, 3.5, 0.5, 0.95];
        let logp = lp_old.iter().zip(r).map(|(o, r)| o + r.ln()).collect();
        TokenBatch {
            advantages: vec![1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0],
            logp,
            logp_old: lp_old,
            logp_behav: None,
            mask: vec![true; 8],
            seq_ids: vec![0, 0, 0, 0, 1, 1, 1, 1],
            turn_ids: Vec::new(),
        }
    }

    fn check(range: RecRange, loss: f64, kept: [f64; 8]) {
        let b = v1();
        let rec = Rec::new(range);
        let out = rec.compute(&b, &Denominators::of(&b));
        let a = &b.advantages;
        let grad: Vec<f64> = kept.iter().zip(a).map(|(k, a)| -a * k / 8.0).collect();
        close(out.loss, loss);
        close_all(&out.grad, &grad);
    }

    #[test]
    fn the_three_ranges_match_trinitys_vectors() {
        check(
            RecRange::OneSide,
            0.340803,
            [0., 1., 1., 1., 1., 1., 0., 1.],
        );
        check(RecRange::Ring, 0.076267, [0., 0., 1., 1., 0., 1., 0., 1.]);
        check(
            RecRange::TwoSide,
            -0.143325,
            [0., 0., 0., 1., 0., 0., 0., 1.],
        );
    }

    #[test]
    fn ranges_nest_two_side_within_ring_within_one_side() {
        let (one, two, ring) = (
            Rec::new(RecRange::OneSide),
            Rec::new(RecRange::TwoSide),
            Rec::new(RecRange::Ring),
        );
        for a in [-1.0, 0.0, 1.0] {
            for i in 0..200 {
                let rho = i as f64 * 0.025;
                assert!(!two.in_range(a, rho) || ring.in_range(a, rho), "{a} {rho}");
                assert!(!ring.in_range(a, rho) || one.in_range(a, rho), "{a} {rho}");
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (i, range) in [RecRange::OneSide, RecRange::TwoSide, RecRange::Ring]
            .into_iter()
            .enumerate()
        {
            check_gradient(&Rec::new(range), 71 + i as u64);
        }
    }

    /// Trinity's IS and TIS weights on V1 (values from a port of
    /// `rec_policy_loss.py`): the weight is `ρ`, or `ρ` truncated to the
    /// ring's `[1 − ε'_l, 1 + ε'_h]`, on the in-range tokens only.
    #[test]
    fn importance_weights_match_trinitys_code_on_v1() {
        let b = v1();
        let cases = [
            (
                RecRange::OneSide,
                RecWeight::Is,
                (0.6, 2.0),
                0.091498,
                [0.0, -0.075, -0.0375, -0.1375, 0.1875, 0.4375, 0.0, 0.11875],
            ),
            (
                RecRange::OneSide,
                RecWeight::Tis,
                (0.6, 2.0),
                0.109500,
                [0.0, -0.075, -0.05, -0.1375, 0.1875, 0.375, 0.0, 0.11875],
            ),
            (
                RecRange::Ring,
                RecWeight::Is,
                (0.6, 2.0),
                -0.022838,
                [0.0, 0.0, -0.0375, -0.1375, 0.0, 0.4375, 0.0, 0.11875],
            ),
            (
                RecRange::Ring,
                RecWeight::Tis,
                (0.6, 2.0),
                -0.004836,
                [0.0, 0.0, -0.05, -0.1375, 0.0, 0.375, 0.0, 0.11875],
            ),
            (
                RecRange::Ring,
                RecWeight::Tis,
                (0.3, 0.4),
                0.199164,
                [0.0, -0.0875, -0.0875, -0.1375, 0.175, 0.175, 0.0, 0.11875],
            ),
        ];
        for (range, weight, (ring_low, ring_high), loss, grad) in cases {
            let rec = Rec {
                weight,
                ring_low,
                ring_high,
                ..Rec::new(range)
            };
            let out = rec.compute(&b, &Denominators::of(&b));
            close(out.loss, loss);
            close_all(&out.grad, &grad);
        }
    }
}
