//! ReMix's Mix-PPG loss (spec §2.13, survey notes §4, medium confidence):
//! PPO on the ratio to the policy that sampled the token,
//! `r = π_θ/π_behav`, clipped to a window centred on `w = π_k/π_behav`
//! with an *additive* half-width ε:
//!
//! `ℓ = −min(r A, clip(r, w − ε, w + ε) A)`.
//!
//! `π_k` is the proximal policy (`lp_old`, recomputed at the batch's
//! start). AReaL's decoupled loss clips the same ratio to the
//! multiplicative window `w(1 ± ε)`; the gradients differ (vector V4 and
//! `the_band_is_additive_not_decoupled_multiplicative`). Without
//! behaviour log-probs `w = 1` and this is PPO-clip.

use super::LossError;
use super::options::{Entry, LossOptions, TisOptions};
use super::{
    Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, log_ratio,
    ppo::clipped_term,
};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct MixPpg {
    pub eps: f64,
    pub agg: Aggregation,
}

impl Default for MixPpg {
    /// ε 0.2 (PPO's; the paper's value was not found), token-mean.
    fn default() -> Self {
        Self {
            eps: 0.2,
            agg: Aggregation::TokenMean,
        }
    }
}

impl PolicyLoss for MixPpg {
    fn name(&self) -> &'static str {
        "remix"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let behav = batch.logp_behav.as_ref().unwrap_or(&batch.logp_old);
        let mut clips = ClipCounts::default();
        let mut w_sum = 0.0;
        let terms = batch.masked_terms(|t| {
            let w = log_ratio(batch.logp_old[t], behav[t]).exp();
            let r = log_ratio(batch.logp[t], behav[t]).exp();
            w_sum += w;
            clipped_term(
                batch.advantages[t],
                r,
                w - self.eps,
                w + self.eps,
                None,
                &mut clips,
            )
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        clips.insert_into(batch.masked_count(), &mut out.metrics);
        out.per_token_metric("remix_w_mean", w_sum, batch);
        out
    }
}

pub const ENTRY: Entry = Entry::new(
    "remix",
    Estimator::Grpo,
    "ReMix-GRPO (spec §2.13, survey notes §4; secondary sources)",
    build,
)
.needs_behaviour();

/// The window's half-width is one ε: `clip_eps_high` has no meaning.
fn build(o: &LossOptions, _: &TisOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    if o.clip_eps_high.is_some() {
        return Err(LossError::new(
            "clip_eps_high",
            "ReMix's window w ± ε is symmetric: set clip_eps only",
        ));
    }
    let d = MixPpg::default();
    Ok(Box::new(MixPpg {
        eps: o.clip_eps.unwrap_or(d.eps),
        agg: o.agg(d.agg),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{TokenBatch, decoupled::Decoupled, testing::*};

    /// Survey notes vector V4: `lp_behav = −1`, `w = [1.3, 1.3, 1.3, 1]`,
    /// `r = [1.52, 1.08, 1.08, 1.25]`, `A = [1, −1, 1, 1]`, ε 0.2.
    fn v4() -> TokenBatch {
        let behav = vec![-1.0; 4];
        let lp = |ratios: [f64; 4]| -> Vec<f64> { ratios.iter().map(|r| -1.0 + r.ln()).collect() };
        TokenBatch::new(
            vec![1.0, -1.0, 1.0, 1.0],
            lp([1.52, 1.08, 1.08, 1.25]),
            lp([1.3, 1.3, 1.3, 1.0]),
            Some(behav),
            None,
            None,
        )
        .unwrap()
    }

    #[test]
    fn v4_mix_ppg() {
        let b = v4();
        let out = MixPpg::default().compute(&b, &Denominators::of(&b));
        close(out.loss, -0.67);
        close_all(&out.grad, &[0.0, 0.0, -0.27, 0.0]);
        close(out.metrics["pg_clipfrac"], 0.75);
        close(out.metrics["remix_w_mean"], (1.3 * 3.0 + 1.0) / 4.0);
    }

    #[test]
    fn the_band_is_additive_not_decoupled_multiplicative() {
        let b = v4();
        let d = Denominators::of(&b);
        let areal = Decoupled::default().compute(&b, &d);
        close(areal.loss, -0.68);
        close_all(&areal.grad, &[-0.38, 0.27, -0.27, 0.0]);
        assert_ne!(MixPpg::default().compute(&b, &d).grad, areal.grad);
    }

    #[test]
    fn without_behaviour_log_probs_it_is_ppo_clip() {
        let b = t3();
        let d = Denominators::of(&b);
        let ppo = crate::loss::ppo::PpoClip::ppo().compute(&b, &d);
        let mix = MixPpg::default().compute(&b, &d);
        close(mix.loss, ppo.loss);
        close_all(&mix.grad, &ppo.grad);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        check_gradient(&MixPpg::default(), 23);
    }
}
