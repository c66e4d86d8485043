//! REC, the clipped forms of group-relative REINFORCE (Yao, Chen et al.,
//! "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm";
//! Trinity-RFT `rec_policy_loss.py`): plain REINFORCE `−A·lp_θ` on the
//! tokens whose ratio `ρ = sg(π_θ/π_old)` is in range, zero elsewhere.
//! Unlike PPO's clip, an out-of-range token gives no gradient whatever
//! the sign of its advantage, and no importance weight multiplies the
//! rest (the "NoIS" variants; Trinity's IS, TIS and advantage-weighted
//! forms are not built).
//!
//! * **one-side**: `(A ≥ 0 ∧ ρ ≤ 1+ε_h) ∨ (A ≤ 0 ∧ ρ ≥ 1−ε_l)`;
//! * **two-side**: `1−ε_l ≤ ρ ≤ 1+ε_h`;
//! * **ring**: two-side, or far out on the side the update would move
//!   back from: `(A ≥ 0 ∧ ρ ≤ 1−ε'_l) ∨ (A ≤ 0 ∧ ρ ≥ 1+ε'_h)`.
//!
//! Defaults are Trinity's: ε 0.2/0.2, ε' 0.6/2.0, token-mean.

use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm, log_ratio};

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
            agg: Aggregation::TokenMean,
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
        let mut kept = 0.0;
        let terms = batch.masked_terms(|t| {
            let (a, lp) = (batch.advantages[t], batch.logp[t]);
            let rho = log_ratio(lp, batch.logp_old[t]).exp();
            if !self.in_range(a, rho) {
                return TokenTerm::default();
            }
            kept += 1.0;
            TokenTerm {
                loss: -a * lp,
                grad: -a,
            }
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        out.per_token_metric("rec_in_range_frac", kept, batch);
        out
    }
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
}
