//! Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs"),
//! the per-token loss SPEAR trains with in both its passes (spec §2b.1):
//! PPO's clipped surrogate, except that a random few of the tokens whose
//! covariance `cov_t = (A_t − mean A)·(lp_θ,t − mean sg(lp_θ))` lies in
//! `(lb, ub)` get no loss and no gradient. High-covariance tokens are the
//! ones whose updates drain entropy; detaching a sample of them keeps
//! exploration alive without a per-token clip.
//!
//! Candidates are unmasked tokens the PPO clip has not already clipped;
//! `max(⌊ratio·N⌋, 1)` of them (N = masked tokens of the batch given) are
//! drawn without replacement. The draw is seeded from `seed` and the batch
//! itself, so a batch always detaches the same tokens: a resumed run
//! equals one that never stopped.

use crate::record::Metric;
use rand::{SeedableRng, rngs::SmallRng, seq::index};

use super::LossError;
use super::options::{ClipCovOptions, Entry, LossOptions, TisOptions};
use super::{
    Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, ppo::clipped_term,
};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct ClipCov {
    pub eps_low: f64,
    pub eps_high: f64,
    /// Share of the batch's tokens detached (at least one when any is a
    /// candidate).
    pub ratio: f64,
    /// Open interval of covariances that are candidates.
    pub lb: f64,
    pub ub: f64,
    pub agg: Aggregation,
    pub seed: u64,
}

impl ClipCov {
    /// SPEAR's on-policy pass: Clip-Cov's code defaults (ratio 2e−4,
    /// (1, 5)) on the Dr.BoT settings of its scripts (ε 0.2/0.28,
    /// `seq-mean-token-sum-norm`).
    pub fn spear() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.28,
            ratio: 2e-4,
            lb: 1.0,
            ub: 5.0,
            agg: Aggregation::SeqMeanTokenSumNorm,
            seed: 0,
        }
    }

    /// The tokens to detach: positions of `batch`, sorted.
    fn detached(&self, batch: &TokenBatch, clipped: &[bool]) -> Vec<usize> {
        let n = batch.masked_count();
        if n == 0 {
            return Vec::new();
        }
        let mean = |v: &[f64]| {
            v.iter()
                .zip(&batch.mask)
                .filter(|(_, m)| **m)
                .map(|(x, _)| x)
                .sum::<f64>()
                / n as f64
        };
        let (mean_a, mean_lp) = (mean(&batch.advantages), mean(&batch.logp));
        let candidates: Vec<usize> = (0..batch.len())
            .filter(|&t| batch.mask[t] && !clipped[t])
            .filter(|&t| {
                let cov = (batch.advantages[t] - mean_a) * (batch.logp[t] - mean_lp);
                cov > self.lb && cov < self.ub
            })
            .collect();
        let k = ((self.ratio * n as f64).floor() as usize)
            .max(1)
            .min(candidates.len());
        let mut rng = SmallRng::seed_from_u64(self.seed ^ batch_hash(batch));
        let mut out: Vec<usize> = index::sample(&mut rng, candidates.len(), k)
            .into_iter()
            .map(|i| candidates[i])
            .collect();
        out.sort_unstable();
        out
    }
}

/// FNV-1a over the batch's anchor log-probs and advantages: a seed that
/// depends on the data, not on when it is trained.
fn batch_hash(batch: &TokenBatch) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in batch.logp_old.iter().chain(&batch.advantages) {
        for b in x.to_bits().to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl PolicyLoss for ClipCov {
    fn name(&self) -> &'static str {
        "spear"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let (c_low, c_high) = (1.0 - self.eps_low, 1.0 + self.eps_high);
        let r = batch.ratios();
        let mut clips = ClipCounts::default();
        let mut clipped = vec![false; batch.len()];
        let mut terms = batch.masked_terms(|t| {
            let before = clips.low + clips.high;
            let term = clipped_term(batch.advantages[t], r[t], c_low, c_high, None, &mut clips);
            clipped[t] = clips.low + clips.high > before;
            term
        });
        let detached = self.detached(batch, &clipped);
        for &t in &detached {
            terms[t] = Default::default();
        }
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        clips.insert_into(batch.masked_count(), &mut out.metrics);
        out.per_token_metric("clip_cov_frac", detached.len() as f64, batch);
        out.metrics.insert(Metric::CLow.into(), c_low);
        out.metrics.insert(Metric::CHigh.into(), c_high);
        out
    }
}

/// SPEAR's registry row: its loss is Clip-Cov (the replay pass and
/// memory are the learner's, `crate::spear`).
pub const SPEAR: Entry = Entry::new(
    "spear",
    Estimator::DrGrpo,
    "SPEAR official code (spec §2b.1): Clip-Cov, Dr.BoT norm_adv_by_std=False; its self-imitation half (no tool-call curriculum)",
    build,
);

fn build(o: &LossOptions, _: &TisOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    let d = ClipCov::spear();
    let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
    let cc = o.clip_cov.unwrap_or(ClipCovOptions {
        ratio: d.ratio,
        lb: d.lb,
        ub: d.ub,
    });
    cc.check("spear.")?;
    Ok(Box::new(ClipCov {
        eps_low,
        eps_high,
        ratio: cc.ratio,
        lb: cc.lb,
        ub: cc.ub,
        agg: o.agg(d.agg),
        ..d
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    /// By hand: `A = [1, 1, −1, −1]`, `lp_old = −1`, `lp_θ = [−0.5, −2,
    /// −1, −3]`, so `r = [1.6487, 0.3679, 1, 0.1353]` against [0.8, 1.28]:
    /// tokens 0 and 3 are PPO-clipped. mean A = 0, mean lp = −1.625, so
    /// `cov = [1.125, −0.375, −0.625, 1.375]`; with `(lb, ub) = (−0.5, 5)`
    /// only token 1 is a candidate and `⌊0.25·4⌋ = 1` token is detached.
    /// Losses `[−1.28, 0, 1, 0.8]`, token-mean 0.13, gradient `[0, 0,
    /// 0.25, 0]`.
    #[test]
    fn hand_computed_detaches_the_one_candidate() {
        let b = batch(
            &[1.0, 1.0, -1.0, -1.0],
            &[-0.5, -2.0, -1.0, -3.0],
            &[-1.0; 4],
        );
        let loss = ClipCov {
            ratio: 0.25,
            lb: -0.5,
            ub: 5.0,
            agg: Aggregation::TokenMean,
            ..ClipCov::spear()
        };
        let out = loss.compute(&b, &Denominators::of(&b));
        close(out.loss, 0.13);
        close_all(&out.grad, &[0.0, 0.0, 0.25, 0.0]);
        close(out.metrics["clip_cov_frac"], 0.25);
        close(out.metrics["pg_clipfrac"], 0.5);
        // Without candidates (the spec's (1, 5)) it is PPO-clip: token 1
        // keeps its gradient −r/4.
        let ppo = ClipCov {
            agg: Aggregation::TokenMean,
            ..ClipCov::spear()
        };
        let out = ppo.compute(&b, &Denominators::of(&b));
        close(out.loss, (-1.28 - (-1.0f64).exp() + 1.0 + 0.8) / 4.0);
        close_all(&out.grad, &[0.0, -(-1.0f64).exp() / 4.0, 0.25, 0.0]);
        close(out.metrics["clip_cov_frac"], 0.0);
    }

    #[test]
    fn the_draw_takes_k_of_the_candidates_and_repeats_for_the_same_batch() {
        let loss = ClipCov {
            ratio: 0.1,
            lb: -10.0,
            ub: 10.0,
            eps_low: 10.0,
            eps_high: 10.0,
            agg: Aggregation::TokenMean,
            ..ClipCov::spear()
        };
        let b = random_batch(3);
        let d = Denominators::of(&b);
        let out = loss.compute(&b, &d);
        let zeroed = (0..b.len())
            .filter(|&t| b.mask[t] && out.grad[t] == 0.0)
            .count();
        let k = ((0.1 * b.masked_count() as f64).floor() as usize).max(1);
        assert_eq!(zeroed, k);
        assert_eq!(loss.compute(&b, &d), out);
        // Another seed, another draw (over several batches at least once).
        let other = ClipCov {
            seed: 99,
            ..loss.clone()
        };
        assert!((0..8).any(|s| {
            let b = random_batch(s);
            let d = Denominators::of(&b);
            other.compute(&b, &d).grad != loss.compute(&b, &d).grad
        }));
    }

    #[test]
    fn gradient_matches_finite_differences_where_nothing_is_detached() {
        // With no candidate interval the detached set is empty and stays
        // so under perturbation: the loss is PPO-clip's.
        let loss = ClipCov {
            lb: 1e9,
            ub: 2e9,
            ..ClipCov::spear()
        };
        check_gradient(&loss, 17);
    }
}
