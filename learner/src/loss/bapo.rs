//! BAPO: the PPO surrogate with asymmetric bounds `c_low < 1 < c_high`
//! chosen again at every optimiser step, so that positive-advantage tokens
//! keep a target share of the loss (Xi et al. 2025; spec §1).
//!
//! Two modes, because the paper and the official code differ:
//!
//! * **paper** (default): target fraction `ρ = P/(P+N) ≥ ρ0 = 0.4`, `c_high`
//!   moves first over `[1.2, 3.0]` in steps of 0.05, then `c_low` over
//!   `[0.6, 0.9]` in steps of 0.02, while `c_low` has room (Algorithm 1).
//!   Integer step counters: `1.2 + 36·0.05` accumulated in floats can pass 3.0.
//! * **code** (`compute_policy_loss_bapo`, commit 3b8389c): target ratio
//!   `P/(N + 1e−8) ≥ 1.0`, `c_low` moves first 0.6 → 0.8, then `c_high`
//!   1.2 → 2.0, both in steps of 0.05, accumulated in floats exactly as the
//!   code does (so its step counts are reproduced).
//!
//! `P` and `N` are the clipped surrogate values of positive and negative
//! tokens (`ClippedValue`); raising `c_low` can only lower `ρ`, so a batch
//! below target may end with the search exhausted (`target_met = 0`).
//! The search runs on global sums: [`search_with`] takes the evaluation as a
//! closure so data-parallel ranks can all-reduce `P` and `N` in it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::Metric;

use super::LossError;
pub use super::options::BapoMode;
use super::options::{Entry, LossOptions, TisOptions};
use super::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, ppo::clipped_loss};
use crate::advantage::Estimator;

/// What counts as a token's contribution to `P` or `N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContributionKind {
    /// `A·min(r, c_high)` and `|A|·max(r, c_low)`: the clipped surrogate
    /// values (paper eq. 8 and the official code).
    ClippedValue,
    /// `|A|·r` of unclipped tokens only (not what the paper does; offered
    /// because raising `c_low` then does raise `ρ`).
    GradientMass,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BapoConfig {
    pub mode: BapoMode,
    /// Paper: the fraction `ρ0`; code: the ratio `P/N`.
    pub target: f64,
    pub low_start: f64,
    pub low_max: f64,
    pub low_step: f64,
    pub high_start: f64,
    pub high_max: f64,
    pub high_step: f64,
    pub dual_clip: Option<f64>,
    pub contribution: ContributionKind,
    pub agg: Aggregation,
}

impl BapoConfig {
    /// The paper's hyperparameters (§5.1), used for all its main results.
    pub fn paper() -> Self {
        Self {
            mode: BapoMode::Paper,
            target: 0.4,
            low_start: 0.6,
            low_max: 0.9,
            low_step: 0.02,
            high_start: 1.2,
            high_max: 3.0,
            high_step: 0.05,
            dual_clip: None,
            contribution: ContributionKind::ClippedValue,
            agg: Aggregation::TokenMean,
        }
    }

    /// The official code's `bapo_trainer.yaml` defaults, with the dual clip
    /// at 3 its loss always applies (verl's `clip_ratio_c`).
    pub fn code() -> Self {
        Self {
            mode: BapoMode::Code,
            dual_clip: Some(3.0),
            target: 1.0,
            low_start: 0.6,
            low_max: 0.8,
            low_step: 0.05,
            high_start: 1.2,
            high_max: 2.0,
            high_step: 0.05,
            ..Self::paper()
        }
    }
}

impl BapoConfig {
    /// The official `run_bapo_example.sh`: `adv_ratio_target = 0.5`, which
    /// the code reads as `P/N ≥ 0.5` (a positive share of 1/3, whatever
    /// the variable's name says), `c_low` 0.8 → 0.95 by 0.05 and `c_high`
    /// 1.2 → 2.0 by 0.1.
    pub fn code_example() -> Self {
        Self {
            mode: BapoMode::CodeExample,
            target: 0.5,
            low_start: 0.8,
            low_max: 0.95,
            low_step: 0.05,
            high_start: 1.2,
            high_max: 2.0,
            high_step: 0.1,
            ..Self::code()
        }
    }

    /// The preset `mode` names.
    pub fn of_mode(mode: BapoMode) -> Self {
        match mode {
            BapoMode::Paper => Self::paper(),
            BapoMode::Code => Self::code(),
            BapoMode::CodeExample => Self::code_example(),
        }
    }
}

/// The chosen bounds and how the search got there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub c_low: f64,
    pub c_high: f64,
    /// Positive and negative contributions at the chosen bounds.
    pub p: f64,
    pub n: f64,
    pub steps: u32,
    pub target_met: bool,
}

impl Bounds {
    /// `P/(P+N)`; 1 when there is nothing negative (and nothing at all).
    pub fn pos_fraction(&self) -> f64 {
        if self.p + self.n > 0.0 {
            self.p / (self.p + self.n)
        } else {
            1.0
        }
    }

    /// `P/(N + 1e−8)` as the official code computes it; ∞ when `N ≤ 0`.
    pub fn pos_neg_ratio(&self) -> f64 {
        if self.n <= 0.0 {
            f64::INFINITY
        } else {
            self.p / (self.n + 1e-8)
        }
    }
}

/// `(P, N)` of `(ratio, advantage)` pairs at the given bounds, in f64.
pub fn contributions(
    tokens: &[(f64, f64)],
    kind: ContributionKind,
    c_low: f64,
    c_high: f64,
) -> (f64, f64) {
    let (mut p, mut n) = (0.0, 0.0);
    for &(r, a) in tokens {
        match kind {
            ContributionKind::ClippedValue => {
                if a > 0.0 {
                    p += a * r.min(c_high);
                } else if a < 0.0 {
                    n += -a * r.max(c_low);
                }
            }
            ContributionKind::GradientMass => {
                if a > 0.0 && r < c_high {
                    p += a * r;
                } else if a < 0.0 && r > c_low {
                    n += -a * r;
                }
            }
        }
    }
    (p, n)
}

/// Runs the bound search with `eval(c_low, c_high) -> (P, N)`.
pub fn search_with(cfg: &BapoConfig, mut eval: impl FnMut(f64, f64) -> (f64, f64)) -> Bounds {
    let at = |c_low: f64, c_high: f64, steps: u32, eval: &mut dyn FnMut(f64, f64) -> (f64, f64)| {
        let (p, n) = eval(c_low, c_high);
        Bounds {
            c_low,
            c_high,
            p,
            n,
            steps,
            target_met: false,
        }
    };
    match cfg.mode {
        BapoMode::Paper => {
            let max_steps = |lo: f64, hi: f64, step: f64| {
                if step > 0.0 && hi > lo {
                    ((hi - lo) / step + 1e-9).floor() as u32
                } else {
                    0
                }
            };
            let kh_max = max_steps(cfg.high_start, cfg.high_max, cfg.high_step);
            let kl_max = max_steps(cfg.low_start, cfg.low_max, cfg.low_step);
            let (mut kh, mut kl, mut steps) = (0u32, 0u32, 0u32);
            loop {
                let c_low = cfg.low_start + kl as f64 * cfg.low_step;
                let c_high = cfg.high_start + kh as f64 * cfg.high_step;
                let mut b = at(c_low, c_high, steps, &mut eval);
                b.target_met = b.pos_fraction() >= cfg.target;
                // Algorithm 1's guard checks only that c_low has room.
                if b.target_met || kl + 1 > kl_max {
                    return b;
                }
                if kh < kh_max {
                    kh += 1;
                } else {
                    kl += 1;
                }
                steps += 1;
            }
        }
        BapoMode::Code | BapoMode::CodeExample => {
            let (mut c_low, mut c_high, mut steps) = (cfg.low_start, cfg.high_start, 0u32);
            let mut b = at(c_low, c_high, steps, &mut eval);
            let met = |b: &Bounds| b.pos_neg_ratio() >= cfg.target;
            while !met(&b) && c_low < cfg.low_max && cfg.low_step > 0.0 {
                c_low = (c_low + cfg.low_step).min(cfg.low_max);
                steps += 1;
                b = at(c_low, c_high, steps, &mut eval);
            }
            while !met(&b) && c_high < cfg.high_max && cfg.high_step > 0.0 {
                c_high = (c_high + cfg.high_step).min(cfg.high_max);
                steps += 1;
                b = at(c_low, c_high, steps, &mut eval);
            }
            b.target_met = met(&b);
            b
        }
    }
}

/// The search over one batch's masked tokens.
pub fn search(cfg: &BapoConfig, batch: &TokenBatch) -> Bounds {
    let tokens: Vec<(f64, f64)> = batch
        .ratios()
        .into_iter()
        .zip(&batch.advantages)
        .zip(&batch.mask)
        .filter(|&(_, &m)| m)
        .map(|((r, &a), _)| (r, a))
        .collect();
    search_with(cfg, |lo, hi| {
        contributions(&tokens, cfg.contribution, lo, hi)
    })
}

#[derive(Debug, Clone)]
pub struct Bapo {
    pub cfg: BapoConfig,
}

impl Bapo {
    /// The loss with bounds chosen elsewhere (on the whole optimiser
    /// mini-batch, applied to each micro-batch).
    pub fn compute_with_bounds(
        &self,
        batch: &TokenBatch,
        d: &Denominators,
        b: &Bounds,
    ) -> LossOutput {
        let mut out = clipped_loss(
            batch,
            d,
            self.cfg.agg,
            b.c_low,
            b.c_high,
            self.cfg.dual_clip,
        );
        let m: &mut BTreeMap<String, f64> = &mut out.metrics;
        m.insert(Metric::PosFraction.into(), b.pos_fraction());
        m.insert("pos_neg_ratio".into(), b.pos_neg_ratio());
        m.insert(Metric::SearchSteps.into(), b.steps as f64);
        m.insert(
            Metric::TargetMet.into(),
            if b.target_met { 1.0 } else { 0.0 },
        );
        out
    }
}

impl PolicyLoss for Bapo {
    fn name(&self) -> &'static str {
        "bapo"
    }

    fn aggregation(&self) -> Aggregation {
        self.cfg.agg
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let bounds = search(&self.cfg, batch);
        self.compute_with_bounds(batch, d, &bounds)
    }
}

/// Its registry row: BAPO on GRPO's advantages.
pub const ENTRY: Entry = Entry::new(
    "bapo",
    Estimator::Grpo,
    "BAPO §5.1 (GRPO basis), official code adv_estimator=grpo, verl token-mean",
    build,
);

/// The mode's preset with the options laid over it.
fn build(o: &LossOptions, _: &TisOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    let mut cfg = BapoConfig::of_mode(o.bapo_mode.unwrap_or(BapoMode::Paper));
    cfg.dual_clip = o.dual(cfg.dual_clip);
    cfg.agg = o.agg(cfg.agg);
    if let Some(rho0) = o.bapo_rho0 {
        cfg.target = match cfg.mode {
            BapoMode::Paper => rho0,
            BapoMode::Code | BapoMode::CodeExample => rho0 / (1.0 - rho0),
        };
    }
    if let Some([start, max, step]) = o.bapo_low {
        (cfg.low_start, cfg.low_max, cfg.low_step) = (start, max, step);
    }
    if let Some([start, max, step]) = o.bapo_high {
        (cfg.high_start, cfg.high_max, cfg.high_step) = (start, max, step);
    }
    Ok(Box::new(Bapo { cfg }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::*;

    fn run(cfg: BapoConfig, b: &TokenBatch) -> LossOutput {
        Bapo { cfg }.compute(b, &Denominators::of(b))
    }

    #[test]
    fn t1_paper_mode_meets_the_target_at_1_30() {
        let out = run(BapoConfig::paper(), &t1());
        close(out.metrics["c_low"], 0.6);
        close(out.metrics["c_high"], 1.3);
        close(out.metrics["pos_fraction"], 2.3 / 5.7);
        close(out.metrics["search_steps"], 2.0);
        close(out.metrics["target_met"], 1.0);
        close(out.loss, 0.183333);
        close_all(
            &out.grad,
            &[0.0, -0.166667, 0.0, 0.183333, 0.116667, 0.166667],
        );
        close(out.metrics["pg_clipfrac"], 2.0 / 6.0);
        close(out.metrics["clip_frac_high"], 1.0 / 6.0);
        close(out.metrics["clip_frac_low"], 1.0 / 6.0);
        // The dual clip at 3 is inactive on T1.
        let dual = run(
            BapoConfig {
                dual_clip: Some(3.0),
                ..BapoConfig::paper()
            },
            &t1(),
        );
        close(dual.loss, 0.183333);
    }

    #[test]
    fn e1_the_official_example_meets_p_over_n_one_half_after_5_steps() {
        let out = run(BapoConfig::code_example(), &e1());
        close(out.metrics["c_low"], 0.95);
        close(out.metrics["c_high"], 1.4);
        close(out.metrics["search_steps"], 5.0);
        close(out.metrics["target_met"], 1.0);
        close(out.metrics["pos_neg_ratio"], 3.3 / 6.4);
        close(out.metrics["pos_fraction"], 3.3 / 9.7);
        close(out.loss, 2.6 / 6.0);
        close_all(&out.grad, &[0.0, -1.0 / 12.0, 1.0 / 6.0, 0.0, 0.0, 0.0]);
        close(out.metrics["dual_clip_frac"], 1.0 / 6.0);
        // The yaml's ranges and target 1 never meet it on E1.
        let yaml = run(BapoConfig::code(), &e1());
        close(yaml.metrics["c_low"], 0.8);
        close(yaml.metrics["c_high"], 2.0);
        close(yaml.metrics["search_steps"], 20.0);
        close(yaml.metrics["target_met"], 0.0);
        close(yaml.loss, 0.2);
        // The script's ranges with 0.5 misread as a share (P/N ≥ 1).
        let misread = run(
            BapoConfig {
                target: 1.0,
                ..BapoConfig::code_example()
            },
            &e1(),
        );
        close(misread.metrics["c_high"], 2.0);
        close(misread.metrics["search_steps"], 11.0);
        close(misread.metrics["target_met"], 0.0);
        close(misread.loss, 0.233333);
    }

    #[test]
    fn t1_code_mode_exhausts_both_loops() {
        let out = run(BapoConfig::code(), &t1());
        close(out.metrics["c_low"], 0.8);
        close(out.metrics["c_high"], 2.0);
        close(out.metrics["pos_neg_ratio"], 0.675676);
        close(out.metrics["target_met"], 0.0);
        close(out.metrics["search_steps"], 20.0);
        close(out.loss, 0.2);
        close_all(&out.grad, &[-0.25, -0.166667, 0.0, 0.183333, 0.0, 0.166667]);
        close(out.metrics["pg_clipfrac"], 2.0 / 6.0);
    }

    #[test]
    fn t1_code_mode_with_the_papers_numbers_takes_52_steps() {
        let cfg = BapoConfig {
            target: 0.4 / 0.6,
            low_max: 0.9,
            low_step: 0.02,
            high_max: 3.0,
            ..BapoConfig::code()
        };
        let out = run(cfg, &t1());
        close(out.metrics["c_low"], 0.9);
        close(out.metrics["c_high"], 3.0);
        close(out.metrics["search_steps"], 52.0);
        close(out.metrics["pos_neg_ratio"], 2.5 / 3.9);
        close(out.metrics["target_met"], 0.0);
    }

    #[test]
    fn t2_paper_mode_stops_cleanly_after_51_iterations() {
        let out = run(BapoConfig::paper(), &t2());
        close(out.metrics["c_low"], 0.9);
        close(out.metrics["c_high"], 3.0);
        close(out.metrics["search_steps"], 51.0);
        close(out.metrics["pos_fraction"], 1.0 / 3.0);
        close(out.metrics["target_met"], 0.0);
        close(out.loss, 1.0 / 3.0);
        close_all(&out.grad, &[0.0, -0.083333, 0.0, 0.166667, 0.2, 0.0]);
        close(out.metrics["pg_clipfrac"], 0.5);
    }

    #[test]
    fn raising_c_low_never_raises_the_positive_fraction() {
        let b = t2();
        let tokens: Vec<_> = b.ratios().into_iter().zip(b.advantages.clone()).collect();
        let mut last = f64::INFINITY;
        for k in 0..=15 {
            let c_low = 0.6 + k as f64 * 0.02;
            let (p, n) = contributions(&tokens, ContributionKind::ClippedValue, c_low, 3.0);
            let rho = p / (p + n);
            assert!(rho <= last + 1e-12);
            last = rho;
        }
    }

    #[test]
    fn degenerate_batches_do_not_loop_or_divide_by_zero() {
        // All advantages zero: P = N = 0, the fraction is 1, target met.
        let b = batch(&[0.0, 0.0], &[-1.0, -2.0], &[-1.0, -2.0]);
        let out = run(BapoConfig::paper(), &b);
        assert_eq!(out.metrics["search_steps"], 0.0);
        assert_eq!(out.loss, 0.0);
        // Only negatives: the search runs to its end and stops.
        let b = batch(&[-1.0], &[-1.0], &[-1.2]);
        let out = run(BapoConfig::paper(), &b);
        assert_eq!(out.metrics["target_met"], 0.0);
        assert_eq!(out.metrics["search_steps"], 51.0);
        let out = run(BapoConfig::code(), &b);
        assert_eq!(out.metrics["target_met"], 0.0);
    }

    #[test]
    fn gradients_match_finite_differences_at_the_chosen_bounds() {
        check_gradient(
            &Bapo {
                cfg: BapoConfig::paper(),
            },
            21,
        );
        check_gradient(
            &Bapo {
                cfg: BapoConfig::code(),
            },
            22,
        );
    }
}
