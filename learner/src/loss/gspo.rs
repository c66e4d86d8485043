//! GSPO (Qwen): one ratio per sequence, the length-normalised
//! `s_i = exp(mean_t(lp_θ − lp_old))`, clipped PPO-style with tiny bounds
//! (`ε_low = 3e−4`, `ε_high = 4e−4`). Implemented as GSPO-token
//! (`s_{i,t} = sg(s_i)·π_θ(y_t)/sg(π_θ(y_t))`): its value is `s_i` and each
//! token's gradient flows through its own log-prob, which equals the
//! sequence form's gradient when the advantage is per sequence. verl clamps
//! `log s ≤ 10` and aggregates seq-mean-token-mean.

use std::collections::HashMap;

use super::options::Entry;
use super::{
    Aggregation, ClipCounts, Denominators, LossOutput, PolicyLoss, TokenBatch, log_ratio,
    ppo::clipped_term,
};
use crate::advantage::Estimator;

#[derive(Debug, Clone)]
pub struct Gspo {
    pub eps_low: f64,
    pub eps_high: f64,
    pub agg: Aggregation,
}

impl Default for Gspo {
    fn default() -> Self {
        Self {
            eps_low: 3e-4,
            eps_high: 4e-4,
            agg: Aggregation::SeqMeanTokenMean,
        }
    }
}

/// `s_i` of every sequence, over its masked tokens.
pub fn sequence_ratios(batch: &TokenBatch) -> HashMap<u32, f64> {
    let mut sums: HashMap<u32, (f64, f64)> = HashMap::new();
    for t in 0..batch.len() {
        if batch.mask[t] {
            let e = sums.entry(batch.seq_ids[t]).or_default();
            e.0 += log_ratio(batch.logp[t], batch.logp_old[t]);
            e.1 += 1.0;
        }
    }
    sums.into_iter()
        .map(|(s, (sum, n))| (s, (sum / n).min(10.0).exp()))
        .collect()
}

impl PolicyLoss for Gspo {
    fn name(&self) -> &'static str {
        "gspo"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let s = sequence_ratios(batch);
        let mut clips = ClipCounts::default();
        let (lo, hi) = (1.0 - self.eps_low, 1.0 + self.eps_high);
        let terms = batch.masked_terms(|t| {
            let seq_ratio = s[&batch.seq_ids[t]];
            clipped_term(batch.advantages[t], seq_ratio, lo, hi, None, &mut clips)
        });
        let mut out = LossOutput::aggregate(&terms, self.agg, batch, d);
        clips.insert_into(batch.masked_count(), &mut out.metrics);
        let n = s.len().max(1) as f64;
        out.metrics
            .insert("seq_ratio_mean".into(), s.values().sum::<f64>() / n);
        out
    }
}

pub const ENTRY: Entry = Entry::new(
    "gspo",
    Estimator::Grpo,
    "GSPO (spec §2.5): group-normalised Â",
    |o, _| {
        let d = Gspo::default();
        let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
        Ok(Box::new(Gspo {
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
    fn the_sequence_ratio_is_the_geometric_mean_of_token_ratios() {
        let b = TokenBatch::new(
            vec![1.0; 3],
            vec![(0.2f64).ln(), (0.5f64).ln(), -1.0],
            vec![(0.1f64).ln(), (0.5f64).ln(), -1.0],
            None,
            Some(vec![true, true, false]),
            Some(vec![0, 0, 0]),
        )
        .unwrap();
        close(sequence_ratios(&b)[&0], (2.0f64).sqrt());
        // s = 1.414 > 1 + 4e-4: the whole sequence is clipped.
        let out = Gspo::default().compute(&b, &Denominators::of(&b));
        close(out.loss, -(1.0 + 4e-4));
        assert!(out.grad.iter().all(|&g| g == 0.0));
    }

    #[test]
    fn gradients_match_finite_differences() {
        // Wide bounds, so that most random sequences are inside them.
        let wide = Gspo {
            eps_low: 0.5,
            eps_high: 0.5,
            ..Gspo::default()
        };
        check_gradient(&wide, 51);
    }
}
