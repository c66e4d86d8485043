//! Training/inference mismatch correction: the PPO loss of each token times
//! a detached function of the behaviour weight `w = π_old/π_behav`, taken
//! per token or per sequence (`w_i = Π_t w_t`, broadcast to its tokens).
//! Rollout engines give `lp_behav ≠ lp_old` even at the same weights
//! (spec §2.14); three corrections:
//!
//! * **truncate** (TIS): `min(w, C)`, verl's default `C = 2`;
//! * **mask** (masked IS): `w` if `low ≤ w ≤ high`, else the token (or the
//!   whole sequence) is dropped; band `[0.5, 2]` by default;
//! * **icepop** (IcePop's two-sided masking, token level): the same with
//!   IcePop's band `[α, β] = [0.5, 5]`.
//!
//! Dropped tokens keep counting in the denominator (as AReaL's rejection),
//! so dropping never inflates the rest.

use std::collections::HashMap;

use super::options::{Entry, LossOptions, TisOptions};
pub use super::options::{IsCorrection, TisLevel};
use super::{
    Aggregation, Denominators, LossError, LossOutput, PolicyLoss, TokenBatch,
    decoupled::weighted_clipped,
};
use crate::advantage::Estimator;

/// The factor of a weight `w`; `None` drops the token.
fn apply(c: IsCorrection, w: f64, low: f64, high: f64) -> Option<f64> {
    match c {
        IsCorrection::Truncate => Some(w.min(high)),
        IsCorrection::Mask | IsCorrection::Icepop => (low..=high).contains(&w).then_some(w),
    }
}

#[derive(Debug, Clone)]
pub struct Tis {
    pub eps_low: f64,
    pub eps_high: f64,
    pub dual_clip: Option<f64>,
    pub correction: IsCorrection,
    /// Band floor (mask, icepop).
    pub low: f64,
    /// Cap `C` (truncate) or band ceiling.
    pub high: f64,
    pub level: TisLevel,
    pub agg: Aggregation,
}

impl Default for Tis {
    fn default() -> Self {
        Self::with(IsCorrection::Truncate, TisLevel::Token)
    }
}

impl Tis {
    /// The correction with its default band.
    pub fn with(correction: IsCorrection, level: TisLevel) -> Self {
        let (low, high) = correction.default_band();
        Self {
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            correction,
            low,
            high,
            level,
            agg: Aggregation::TokenMean,
        }
    }

    /// Refuses a band that cannot work, naming the option.
    pub fn check(&self) -> Result<(), LossError> {
        if !(self.high.is_finite() && self.high > 0.0) {
            return Err(LossError::new(
                "tis_high",
                format!("{} must be a positive number", self.high),
            ));
        }
        if !(self.low.is_finite() && self.low >= 0.0 && self.low < self.high) {
            return Err(LossError::new(
                "tis_low",
                format!(
                    "{} must be at least 0 and below tis_high ({})",
                    self.low, self.high
                ),
            ));
        }
        if self.correction == IsCorrection::Icepop && self.level == TisLevel::Sequence {
            return Err(LossError::new(
                "tis_level",
                "icepop masks tokens: use tis_level = \"token\" (or tis_mode = \"mask\" for sequences)",
            ));
        }
        Ok(())
    }

    /// `log w` per token, or its sequence's sum on every token of it.
    fn log_weights(&self, batch: &TokenBatch) -> Vec<f64> {
        let log_w = batch.behav_log_weights();
        if self.level == TisLevel::Token {
            return log_w;
        }
        let mut sums: HashMap<u32, f64> = HashMap::new();
        for ((l, &m), s) in log_w.iter().zip(&batch.mask).zip(&batch.seq_ids) {
            if m {
                *sums.entry(*s).or_default() += l;
            }
        }
        batch
            .seq_ids
            .iter()
            .map(|s| sums.get(s).copied().unwrap_or(0.0))
            .collect()
    }
}

impl PolicyLoss for Tis {
    fn name(&self) -> &'static str {
        "tis"
    }

    fn aggregation(&self) -> Aggregation {
        self.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let weights: Vec<Option<f64>> = self
            .log_weights(batch)
            .into_iter()
            .map(|l| {
                let w = l.clamp(-20.0, 20.0).exp();
                apply(self.correction, w, self.low, self.high)
            })
            .collect();
        let bounds = (1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip);
        weighted_clipped(batch, d, self.agg, bounds, &weights)
    }
}

pub const ENTRY: Entry = Entry::new(
    "tis",
    Estimator::Grpo,
    "verl rollout correction (spec §2.14) on GRPO",
    build,
)
.needs_behaviour();

/// The correction and level of `tis`, its band over the mode's own.
fn build(o: &LossOptions, tis: &TisOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    let d = Tis::with(tis.mode, tis.level);
    let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
    let t = Tis {
        eps_low,
        eps_high,
        dual_clip: o.dual(d.dual_clip),
        low: tis.low.unwrap_or(d.low),
        high: tis.high.unwrap_or(d.high),
        agg: o.agg(d.agg),
        ..d
    };
    t.check()?;
    Ok(Box::new(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{ppo::PpoClip, testing::*};

    #[test]
    fn without_behaviour_log_probs_it_is_ppo() {
        let b = t3();
        let d = Denominators::of(&b);
        let tis = Tis::default().compute(&b, &d);
        let ppo = PpoClip::ppo().compute(&b, &d);
        close(tis.loss, ppo.loss);
        close_all(&tis.grad, &ppo.grad);
    }

    #[test]
    fn weights_are_truncated_at_the_cap() {
        let ln = f64::ln;
        let b = TokenBatch::new(
            vec![1.0, 1.0],
            vec![ln(0.4), ln(0.4)],
            vec![ln(0.4), ln(0.4)],
            Some(vec![ln(0.1), ln(0.5)]),
            None,
            None,
        )
        .unwrap();
        let out = Tis::default().compute(&b, &Denominators::of(&b));
        // w = [min(4, 2), 0.8], r = 1: ℓ = [−2, −0.8].
        close(out.loss, -1.4);
        let seq = Tis::with(IsCorrection::Truncate, TisLevel::Sequence);
        let mut one_seq = b.clone();
        one_seq.seq_ids = vec![0, 0];
        // Π ρ = 4 · 0.8 = 3.2, capped at 2 for both tokens.
        close(
            seq.compute(&one_seq, &Denominators::of(&one_seq)).loss,
            -2.0,
        );
    }

    /// `w = [4, 0.8, 0.3, 1.5]` (`p_old/p_behav` = 0.4/0.1, 0.4/0.5,
    /// 0.15/0.5, 0.6/0.4), `r = 1`, `A = 1`: each kept token's loss is
    /// `−factor`, its gradient `−factor/4`, and every token counts in /4.
    fn mismatched() -> TokenBatch {
        let ln = |v: &[f64]| v.iter().map(|p| p.ln()).collect::<Vec<_>>();
        let old = ln(&[0.4, 0.4, 0.15, 0.6]);
        TokenBatch::new(
            vec![1.0; 4],
            old.clone(),
            old,
            Some(ln(&[0.1, 0.5, 0.5, 0.4])),
            None,
            Some(vec![0, 0, 1, 2]),
        )
        .unwrap()
    }

    #[test]
    fn masked_is_and_icepop_drop_tokens_outside_their_band() {
        let b = mismatched();
        let d = Denominators::of(&b);
        let run = |c, level| Tis::with(c, level).compute(&b, &d);
        // Truncate at 2: [2, 0.8, 0.3, 1.5].
        let t = run(IsCorrection::Truncate, TisLevel::Token);
        close(t.loss, -4.6 / 4.0);
        // Mask [0.5, 2]: 4 and 0.3 dropped, [·, 0.8, ·, 1.5].
        let m = run(IsCorrection::Mask, TisLevel::Token);
        close(m.loss, -2.3 / 4.0);
        close_all(&m.grad, &[0.0, -0.2, 0.0, -0.375]);
        close(m.metrics["behav_rejected_frac"], 0.5);
        // IcePop [0.5, 5]: only 0.3 dropped.
        let i = run(IsCorrection::Icepop, TisLevel::Token);
        close(i.loss, -6.3 / 4.0);
        close_all(&i.grad, &[-1.0, -0.2, 0.0, -0.375]);
        close(i.metrics["behav_rejected_frac"], 0.25);
        // Sequences {0, 1}, {2}, {3}: w = 3.2, 0.3, 1.5; only the last
        // is inside [0.5, 2].
        let s = run(IsCorrection::Mask, TisLevel::Sequence);
        close(s.loss, -1.5 / 4.0);
        close_all(&s.grad, &[0.0, 0.0, 0.0, -0.375]);
        close(s.metrics["behav_rejected_frac"], 0.75);
    }

    #[test]
    fn impossible_bands_are_refused_by_name() {
        let bad = |t: Tis| t.check().err().unwrap().field;
        let base = Tis::with(IsCorrection::Mask, TisLevel::Token);
        assert_eq!(
            bad(Tis {
                low: 2.0,
                ..base.clone()
            }),
            "tis_low"
        );
        assert_eq!(
            bad(Tis {
                high: 0.0,
                ..base.clone()
            }),
            "tis_high"
        );
        assert_eq!(
            bad(Tis::with(IsCorrection::Icepop, TisLevel::Sequence)),
            "tis_level"
        );
        base.check().unwrap();
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradient(&Tis::default(), 81);
        check_gradient(&Tis::with(IsCorrection::Mask, TisLevel::Token), 82);
        check_gradient(&Tis::with(IsCorrection::Icepop, TisLevel::Token), 83);
    }
}
