//! The PPO clipped surrogate with explicit ratio bounds, and the fixed-bound
//! losses built on it: PPO-clip, GRPO, Dr. GRPO and DAPO clip-higher differ
//! only in bounds and aggregation (their advantages differ, see
//! `crate::advantage`).

use crate::record::Metric;

use super::options::{Entry, LossOptions};
use super::{Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, TokenTerm};
use crate::advantage::Estimator;

/// `ℓ = −min(r A, clip(r, c_low, c_high) A)`, then for `A < 0` the dual clip
/// `ℓ ← min(ℓ, −c A)`. The gradient coefficient is `−A r` inside the trust
/// region and 0 where a clip is active (strict inequalities: a ratio exactly
/// on a bound still gets its gradient).
pub fn clipped_term(
    a: f64,
    r: f64,
    c_low: f64,
    c_high: f64,
    dual_clip: Option<f64>,
    clips: &mut ClipCounts,
) -> TokenTerm {
    if a > 0.0 && r > c_high {
        clips.high += 1;
        return TokenTerm {
            loss: -a * c_high,
            grad: 0.0,
        };
    }
    if a < 0.0 && r < c_low {
        clips.low += 1;
        return TokenTerm {
            loss: -a * c_low,
            grad: 0.0,
        };
    }
    if a < 0.0
        && let Some(c) = dual_clip
        && r > c
    {
        clips.dual += 1;
        return TokenTerm {
            loss: -a * c,
            grad: 0.0,
        };
    }
    TokenTerm {
        loss: -a * r,
        grad: -a * r,
    }
}

/// Computes a clipped surrogate over a batch with fixed bounds.
pub fn clipped_loss(
    batch: &TokenBatch,
    d: &Denominators,
    agg: Aggregation,
    c_low: f64,
    c_high: f64,
    dual_clip: Option<f64>,
) -> LossOutput {
    let mut clips = ClipCounts::default();
    let r = batch.ratios();
    let terms = batch.masked_terms(|t| {
        clipped_term(
            batch.advantages[t],
            r[t],
            c_low,
            c_high,
            dual_clip,
            &mut clips,
        )
    });
    let mut out = LossOutput::aggregate(&terms, agg, batch, d);
    clips.insert_into(batch.masked_count(), &mut out.metrics);
    out.metrics.insert(Metric::CLow.into(), c_low);
    out.metrics.insert(Metric::CHigh.into(), c_high);
    out
}

/// PPO-clip with `[1 − ε_low, 1 + ε_high]` and an optional dual clip.
#[derive(Debug, Clone)]
pub struct PpoClip {
    pub name: &'static str,
    pub eps_low: f64,
    pub eps_high: f64,
    pub dual_clip: Option<f64>,
    pub agg: Aggregation,
}

impl PpoClip {
    /// Schulman et al.: ε = 0.2, token-mean (verl's default aggregation).
    pub fn ppo() -> Self {
        Self {
            name: "ppo",
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            agg: Aggregation::TokenMean,
        }
    }

    /// GRPO: ε = 0.2, sequence-mean of token-means (the KL-to-reference term
    /// is a learner option, not part of the policy loss).
    pub fn grpo() -> Self {
        Self {
            name: "grpo",
            agg: Aggregation::SeqMeanTokenMean,
            ..Self::ppo()
        }
    }

    /// Dr. GRPO: a constant normaliser (`seq-mean-token-sum-norm`); its
    /// advantages skip the std division.
    pub fn dr_grpo() -> Self {
        Self {
            name: "dr-grpo",
            agg: Aggregation::SeqMeanTokenSumNorm,
            ..Self::ppo()
        }
    }

    /// DAPO clip-higher: ε_low 0.2, ε_high 0.28, token-mean.
    pub fn dapo() -> Self {
        Self {
            name: "dapo",
            eps_high: 0.28,
            ..Self::ppo()
        }
    }
}

impl PolicyLoss for PpoClip {
    fn name(&self) -> &'static str {
        self.name
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        clipped_loss(
            batch,
            d,
            self.agg,
            1.0 - self.eps_low,
            1.0 + self.eps_high,
            self.dual_clip,
        )
    }
}

/// The registry rows of the fixed-bound clip losses.
pub const PPO: Entry = Entry::new(
    "ppo",
    Estimator::Grpo,
    "Schulman et al.; critic-free here, so verl's GRPO advantage",
    |o, _| Ok(Box::new(PpoClip::ppo().with(o))),
);
pub const GRPO: Entry = Entry::new(
    "grpo",
    Estimator::Grpo,
    "DeepSeekMath (spec §2.2), verl norm_adv_by_std=True",
    |o, _| Ok(Box::new(PpoClip::grpo().with(o))),
);
pub const DR_GRPO: Entry = Entry::new(
    "dr-grpo",
    Estimator::DrGrpo,
    "Dr. GRPO (spec §2.3), verl recipe norm_adv_by_std_in_grpo=False",
    |o, _| Ok(Box::new(PpoClip::dr_grpo().with(o))),
);
pub const DAPO: Entry = Entry::new(
    "dapo",
    Estimator::Grpo,
    "DAPO (spec §2.4), verl recipe",
    |o, _| Ok(Box::new(PpoClip::dapo().with(o))),
);

impl PpoClip {
    /// The bounds, dual clip and aggregation of `o` over these.
    fn with(self, o: &LossOptions) -> Self {
        let (eps_low, eps_high) = o.eps(self.eps_low, self.eps_high);
        Self {
            eps_low,
            eps_high,
            dual_clip: o.dual(self.dual_clip),
            agg: o.agg(self.agg),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    #[test]
    fn t3_ppo_without_and_with_dual_clip() {
        let b = t3();
        let d = Denominators::of(&b);
        let out = PpoClip::ppo().compute(&b, &d);
        close(out.loss, 0.754167);
        close_all(&out.grad, &[0.0, -0.3, 1.25, 0.0, -0.0875, 0.091667]);
        close(out.metrics["pg_clipfrac"], 2.0 / 6.0);

        let dual = PpoClip {
            dual_clip: Some(3.0),
            ..PpoClip::ppo()
        };
        let out = dual.compute(&b, &d);
        close(out.loss, 0.254167);
        close_all(&out.grad, &[0.0, -0.3, 0.0, 0.0, -0.0875, 0.091667]);
        close(out.metrics["dual_clip_frac"], 1.0 / 6.0);
    }

    #[test]
    fn t3_dapo_clip_higher() {
        let b = t3();
        let out = PpoClip::dapo().compute(&b, &Denominators::of(&b));
        close(out.loss, 0.7275);
        close(out.metrics["pg_clipfrac"], 2.0 / 6.0);
    }

    #[test]
    fn gradients_match_finite_differences() {
        for loss in [
            PpoClip::ppo(),
            PpoClip::grpo(),
            PpoClip::dr_grpo(),
            PpoClip::dapo(),
        ] {
            check_gradient(&loss, 11);
        }
        check_gradient(
            &PpoClip {
                dual_clip: Some(2.0),
                ..PpoClip::ppo()
            },
            12,
        );
    }
}
