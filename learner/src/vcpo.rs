//! VCPO (variance-controlled policy optimisation), as learner options:
//!
//! * an **ESS-scaled learning rate**: with sequence weights
//!   `w_i = exp(Σ_t (lp_old − lp_behav))`, `ρ_ess = ESS/B` and
//!   `lr_eff = lr · sqrt(min(1, ρ_ess/ρ_base))` (or the linear rule): the
//!   staler the batch, the smaller the step;
//! * the **off-policy optimal baseline** (OPOB) per group,
//!   `b = Σ w_i² ‖g_i‖² R_i / Σ w_i² ‖g_i‖²`. It needs a backward pass per
//!   trajectory for `‖g_i‖`, which the trainer does not do: training does
//!   not use it (docs/losses.md says so), the function is the spec's
//!   formula, checked against T4, for when it does.

use serde::{Deserialize, Serialize};

use crate::stats::ess;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrRule {
    Sqrt,
    Linear,
}

/// `ρ_base` of the lr rule (spec §2.10, VCPO's default): the learning rate
/// shrinks as soon as the sequence ESS falls below the batch size.
pub const RHO_BASE: f64 = 1.0;

/// The factor the learning rate is multiplied by for one optimiser step.
pub fn lr_scale(seq_log_weights: &[f64], rho_base: f64, rule: LrRule) -> f64 {
    if seq_log_weights.is_empty() {
        return 1.0;
    }
    let w: Vec<f64> = seq_log_weights
        .iter()
        .map(|l| l.clamp(-20.0, 20.0).exp())
        .collect();
    let rho = ess(&w) / w.len() as f64;
    let x = (rho / rho_base).min(1.0);
    match rule {
        LrRule::Sqrt => x.sqrt(),
        LrRule::Linear => x,
    }
}

/// OPOB baseline of one group; the plain mean when all weights vanish.
pub fn opob_baseline(seq_log_weights: &[f64], grad_norms: &[f64], rewards: &[f64]) -> f64 {
    let mut num = 0.0;
    let mut den = 0.0;
    for ((l, g), r) in seq_log_weights.iter().zip(grad_norms).zip(rewards) {
        let k = (2.0 * l.clamp(-20.0, 20.0)).exp() * g * g;
        num += k * r;
        den += k;
    }
    if den > 0.0 {
        num / den
    } else {
        rewards.iter().sum::<f64>() / rewards.len().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::close;

    #[test]
    fn t4_vcpo() {
        let lw = [0.0, 0.5, -0.5, 2.0];
        let w: Vec<f64> = lw.iter().map(|l: &f64| l.exp()).collect();
        close(ess(&w), 1.930691);
        // ρ_base = 1 (spec): ρ_ess = 0.482673, sqrt → 0.694747. Under the
        // old 0.5 it would have been sqrt(0.965346) = 0.982520.
        close(lr_scale(&lw, RHO_BASE, LrRule::Sqrt), 0.694747);
        close(lr_scale(&lw, 0.5, LrRule::Sqrt), 0.982520);
        close(lr_scale(&lw, 1.0, LrRule::Linear), 0.482673);
        let b = opob_baseline(&lw, &[1.0, 2.0, 1.0, 0.5], &[1.0, 0.0, 1.0, 0.0]);
        close(b, 0.052833);
    }

    #[test]
    fn on_policy_batches_keep_the_learning_rate() {
        close(lr_scale(&[0.0; 8], 1.0, LrRule::Sqrt), 1.0);
        // Equal weights and norms: OPOB is the mean.
        close(
            opob_baseline(&[0.3; 4], &[1.0; 4], &[1.0, 0.0, 0.0, 0.0]),
            0.25,
        );
    }
}
