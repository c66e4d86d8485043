//! Turn-PPO (ST-PPO's turn-level importance sampling, spec §2.12): in a
//! multi-turn episode every turn of the policy gets one ratio, the
//! length-normalised `w_k = exp(mean_{t∈k}(lp_θ − lp_old))` over its own
//! tokens, clipped PPO-style at `1 ± 0.2` and aggregated token-mean. A
//! token-level ratio lets one unlikely token of a long tool call swing
//! the whole turn's update; a sequence-level one (GSPO) lets a good turn
//! pay for a bad one. The source trains a critic (GAE); bapo is
//! critic-free, so the group's outcome advantage is broadcast to every
//! token of the episode. Without turn ids every sequence is one turn.
//!
//! The gradient is the turn form's, exact for any aggregation: token `j`
//! of turn `k` gets `Σ_{t∈k} ω_t·∂ℓ_t/∂w_k · w_k / n_k` (`ω_t` the
//! aggregation weight, `n_k` the turn's trained tokens).

use std::collections::HashMap;

use super::options::Entry;
use super::{
    Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, log_ratio,
    ppo::clipped_term,
};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct TurnPpo {
    pub eps_low: f64,
    pub eps_high: f64,
    pub dual_clip: Option<f64>,
    pub agg: Aggregation,
}

impl Default for TurnPpo {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            agg: Aggregation::TokenMean,
        }
    }
}

/// A turn: its sequence and its turn id within the sequence.
pub type TurnKey = (u32, u32);

/// `(w_k, n_k)` of every turn with a trained token.
pub fn turn_ratios(batch: &TokenBatch) -> HashMap<TurnKey, (f64, f64)> {
    let mut sums: HashMap<TurnKey, (f64, f64)> = HashMap::new();
    for t in (0..batch.len()).filter(|&t| batch.mask[t]) {
        let e = sums.entry(batch.turn_of(t)).or_default();
        e.0 += log_ratio(batch.logp[t], batch.logp_old[t]);
        e.1 += 1.0;
    }
    sums.into_iter()
        .map(|(k, (sum, n))| (k, ((sum / n).exp(), n)))
        .collect()
}

impl PolicyLoss for TurnPpo {
    fn name(&self) -> &'static str {
        "turn-ppo"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let w = turn_ratios(batch);
        let mut clips = ClipCounts::default();
        let (lo, hi) = (1.0 - self.eps_low, 1.0 + self.eps_high);
        let terms = batch.masked_terms(|t| {
            let (ratio, _) = w[&batch.turn_of(t)];
            clipped_term(
                batch.advantages[t],
                ratio,
                lo,
                hi,
                self.dual_clip,
                &mut clips,
            )
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        // Each token's `ω_t·∂ℓ_t/∂w·w` summed over its turn, then shared
        // by the turn's tokens through `∂w/∂lp_j = w/n`.
        let mut per_turn: HashMap<TurnKey, f64> = HashMap::new();
        for t in (0..batch.len()).filter(|&t| batch.mask[t]) {
            *per_turn.entry(batch.turn_of(t)).or_default() += out.grad[t];
        }
        for t in (0..batch.len()).filter(|&t| batch.mask[t]) {
            let k = batch.turn_of(t);
            out.grad[t] = per_turn[&k] / w[&k].1;
        }
        clips.insert_into(batch.masked_count(), &mut out.metrics);
        let n = w.len().max(1) as f64;
        out.metrics.insert("turns".into(), w.len() as f64);
        out.metrics.insert(
            "turn_ratio_mean".into(),
            w.values().map(|(r, _)| r).sum::<f64>() / n,
        );
        out
    }
}

pub const ENTRY: Entry = Entry::new(
    "turn-ppo",
    Estimator::Grpo,
    "Turn-PPO (ST-PPO, spec §2.12): turn-level ratio; critic-free here, the group's outcome advantage broadcast",
    |o, _| {
        let d = TurnPpo::default();
        let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
        Ok(Box::new(TurnPpo {
            eps_low,
            eps_high,
            dual_clip: o.dual(d.dual_clip),
            agg: o.agg(d.agg),
        }))
    },
)
.turn_ratio();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    /// T4: one episode, two turns of the policy (ids 0 and 2) around an
    /// environment observation (masked, id 1), advantage +1; a second
    /// episode of one turn, advantage −1. By hand:
    /// turn (0,0): lp − old = [ln 2, 0] → w = √2 = 1.41421 > 1.2: clipped,
    ///   ℓ = −1.2 on both tokens, no gradient;
    /// turn (0,2): [ln 0.9, ln 1.1] → w = √0.99 = 0.994987 inside:
    ///   ℓ = −0.994987 on both tokens;
    /// turn (1,0): [ln 0.5, ln 0.5, 0] → w = 0.5^(2/3) = 0.629961 < 0.8,
    ///   A < 0: clipped, ℓ = +0.8 on all three, no gradient.
    /// Token-mean over 7 trained tokens: (−2.4 − 1.989975 + 2.4)/7
    /// = −0.284282. Turn (0,2)'s gradient: Σ ω·(−A·w) = 2·(−0.994987)/7,
    /// over n = 2 tokens: −0.142141 each.
    fn t4() -> TokenBatch {
        let ln = f64::ln;
        let old = [-1.0, -0.5, -2.0, -1.2, -0.7, -0.9, -1.1, -0.4];
        let delta = [ln(2.0), 0.0, 0.0, ln(0.9), ln(1.1), ln(0.5), ln(0.5), 0.0];
        let lp: Vec<f64> = old.iter().zip(delta).map(|(o, d)| o + d).collect();
        TokenBatch::new(
            vec![1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0],
            lp,
            old.to_vec(),
            None,
            Some(vec![true, true, false, true, true, true, true, true]),
            Some(vec![0, 0, 0, 0, 0, 1, 1, 1]),
        )
        .unwrap()
        .with_turns(vec![0, 0, 1, 2, 2, 0, 0, 0])
        .unwrap()
    }

    #[test]
    fn t4_turn_ratios_clip_whole_turns() {
        let b = t4();
        let w = turn_ratios(&b);
        close(w[&(0, 0)].0, 2f64.sqrt());
        close(w[&(0, 2)].0, 0.99f64.sqrt());
        close(w[&(1, 0)].0, 0.5f64.powf(2.0 / 3.0));
        assert!(!w.contains_key(&(0, 1)), "an observation is not a turn");
        let out = TurnPpo::default().compute(&b, &Denominators::of(&b));
        close(out.loss, -0.284282);
        let g = -0.142141;
        let want = [0.0, 0.0, 0.0, g, g, 0.0, 0.0, 0.0];
        for (got, want) in out.grad.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{:?}", out.grad);
        }
        close(out.metrics["turns"], 3.0);
        close(out.metrics["clip_frac_high"], 2.0 / 7.0);
        close(out.metrics["clip_frac_low"], 3.0 / 7.0);
    }

    #[test]
    fn one_turn_per_sequence_is_a_sequence_ratio() {
        // Without turn ids, turn-ppo is GSPO's sequence ratio at PPO's
        // bounds and token-mean.
        let b = t4();
        let mut single = b.clone();
        single.turn_ids.clear();
        let w = turn_ratios(&single);
        assert_eq!(w.len(), 2);
        let gspo = crate::loss::gspo::sequence_ratios(&single);
        close(w[&(0, 0)].0, gspo[&0]);
        close(w[&(1, 0)].0, gspo[&1]);
    }

    #[test]
    fn a_turn_ratio_depends_only_on_its_own_tokens() {
        // Moving a token of turn (0,0) changes nothing in turn (0,2).
        let b = t4();
        let mut moved = b.clone();
        moved.logp[1] -= 0.3;
        let (a, m) = (turn_ratios(&b), turn_ratios(&moved));
        assert_eq!(a[&(0, 2)], m[&(0, 2)]);
        assert_ne!(a[&(0, 0)], m[&(0, 0)]);
    }

    #[test]
    fn gradients_match_finite_differences_over_turns() {
        // Wide bounds keep most turns inside; three-token turns, and the
        // check runs under every aggregation (the turn form is exact).
        for agg in [
            Aggregation::TokenMean,
            Aggregation::SeqMeanTokenMean,
            Aggregation::SeqMeanTokenSumNorm,
        ] {
            let wide = TurnPpo {
                eps_low: 0.5,
                eps_high: 0.5,
                agg,
                ..TurnPpo::default()
            };
            check_gradient_with(&wide, 61, |b| {
                let turns = (0..b.len() as u32).map(|t| t / 3).collect();
                b.with_turns(turns).unwrap()
            });
        }
    }
}
