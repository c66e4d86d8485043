//! Losses by name: one table ([`ENTRIES`]) of the rows each loss's own
//! file declares, with what its paper trains it with (an algorithm
//! compared under its name must be that algorithm, not the loss on another
//! estimator) and how it is built from the options `bapo loss` and the
//! learner config expose. A new loss is a new file with its row, and that
//! row added here.

use crate::advantage::Estimator;

use super::{
    Aggregation, LossError, PolicyLoss, bapo,
    bapo::BapoMode,
    cispo, clip_cov, decoupled, gspo, ppo,
    rec::{self, RecWeight},
    reinforce, remix, sapo,
    tis::{self, IsCorrection, TisLevel},
    turn_ppo,
};

/// Every loss, in the order `bapo loss --help` and errors list them.
pub const ENTRIES: &[Entry] = &[
    bapo::ENTRY,
    ppo::PPO,
    ppo::GRPO,
    ppo::DR_GRPO,
    ppo::DAPO,
    gspo::ENTRY,
    sapo::ENTRY,
    cispo::ENTRY,
    reinforce::OPMD,
    reinforce::ASYMRE,
    decoupled::ENTRY,
    tis::ENTRY,
    rec::ONE_SIDED,
    rec::TWO_SIDED,
    rec::RING,
    clip_cov::SPEAR,
    remix::ENTRY,
    turn_ppo::ENTRY,
];

/// The names of [`ENTRIES`], in order.
pub fn names() -> Vec<&'static str> {
    ENTRIES.iter().map(|e| e.name).collect()
}

/// Builds a loss from the options (the common ones and TIS's).
pub type Build = fn(&LossOptions, &TisOptions) -> Result<Box<dyn PolicyLoss>, LossError>;

/// A loss's row: what it trains on unless the config says otherwise, what
/// it needs to mean anything, and how it is built.
#[derive(Clone, Copy)]
pub struct Entry {
    pub name: &'static str,
    /// The paper's advantage estimator.
    pub estimator: Estimator,
    /// The loss reads `π_old/π_behav` (decoupled, TIS): without behaviour
    /// log-probs distinct from the proximal ones its weight is 1.
    pub needs_behaviour: bool,
    /// The gradient depends on `r = π_θ/π_old` (clip, gate, weight or
    /// regulariser): with `lp_old` recomputed and one update per batch,
    /// `r ≡ 1` and the loss degenerates to plain policy gradient.
    pub uses_ratio: bool,
    /// The ratio is one per turn (the mean log-ratio of its tokens): a
    /// turn's `lp_old` must be one policy's, so under `proximal =
    /// "behavior"` a turn whose tokens carry several versions gets
    /// recomputed proximal log-probs.
    pub turn_ratio: bool,
    /// Where the defaults come from (spec section and source).
    pub source: &'static str,
    pub build: Build,
}

impl Entry {
    /// A row with the common flags: reads the ratio, needs no behaviour
    /// log-probs, one ratio per token.
    pub const fn new(
        name: &'static str,
        estimator: Estimator,
        source: &'static str,
        build: Build,
    ) -> Self {
        Self {
            name,
            estimator,
            needs_behaviour: false,
            uses_ratio: true,
            turn_ratio: false,
            source,
            build,
        }
    }

    pub const fn needs_behaviour(self) -> Self {
        Self {
            needs_behaviour: true,
            ..self
        }
    }

    pub const fn ratio_free(self) -> Self {
        Self {
            uses_ratio: false,
            ..self
        }
    }

    pub const fn turn_ratio(self) -> Self {
        Self {
            turn_ratio: true,
            ..self
        }
    }
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("estimator", &self.estimator)
            .finish_non_exhaustive()
    }
}

/// The registry entry of `name`, or an error naming `algo`.
pub fn entry_of(name: &str) -> Result<&'static Entry, LossError> {
    ENTRIES.iter().find(|e| e.name == name).ok_or_else(|| {
        LossError::new(
            "algo",
            format!("unknown algorithm {name:?}; known: {}", names().join(", ")),
        )
    })
}

/// Overrides common to the losses; `None` keeps the loss's default.
#[derive(Debug, Clone, Default)]
pub struct LossOptions {
    pub bapo_mode: Option<BapoMode>,
    /// BAPO's target positive share `ρ0` (paper mode: the fraction; code
    /// mode: the ratio `ρ0 / (1 − ρ0)`); unset, the mode's default (0.4,
    /// and 0.5 as the code's ratio 1). Refused for any other loss.
    pub bapo_rho0: Option<f64>,
    /// BAPO's `c_low` and `c_high` searches, each `[start, max, step]`;
    /// unset, the mode's own. Refused for any other loss.
    pub bapo_low: Option<[f64; 3]>,
    pub bapo_high: Option<[f64; 3]>,
    /// REC's weight of in-range tokens; unset, none (NoIS).
    pub rec_weight: Option<RecWeight>,
    /// REC's ring bounds `[ε'_l, ε'_h]` (which TIS also truncates at);
    /// unset, Trinity's 0.6 and 2.0.
    pub rec_ring: Option<[f64; 2]>,
    /// ε_low (and ε_high unless given separately).
    pub clip_eps: Option<f64>,
    pub clip_eps_high: Option<f64>,
    /// Dual clip constant `c > 1` for negative advantages; `Some(0.0)`
    /// turns off a loss's default one (BAPO code mode's 3.0).
    pub dual_clip: Option<f64>,
    pub agg: Option<Aggregation>,
    /// Clip-Cov's candidate share and covariance interval (`spear`).
    pub clip_cov: Option<ClipCovOptions>,
}

/// Clip-Cov's detaching rule: `ratio` of the tokens, drawn among those
/// with covariance in `(lb, ub)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipCovOptions {
    pub ratio: f64,
    pub lb: f64,
    pub ub: f64,
}

impl ClipCovOptions {
    /// Refuses a rule that cannot detach anything meaningful, by name.
    pub fn check(&self, prefix: &str) -> Result<(), LossError> {
        if !(self.ratio.is_finite() && self.ratio > 0.0 && self.ratio <= 1.0) {
            return Err(LossError::new(
                format!("{prefix}clip_cov_ratio"),
                format!("{} must be in (0, 1]", self.ratio),
            ));
        }
        if self.lb.partial_cmp(&self.ub) != Some(std::cmp::Ordering::Less) {
            return Err(LossError::new(
                format!("{prefix}clip_cov_lb"),
                format!("{} must be below clip_cov_ub {}", self.lb, self.ub),
            ));
        }
        Ok(())
    }
}

/// TIS's options (a separate struct so `LossOptions` literals elsewhere
/// stay valid): correction, level, band floor and cap, `None` for the
/// mode's default. The default is truncation per token at 2.
#[derive(Debug, Clone, Copy)]
pub struct TisOptions {
    pub mode: IsCorrection,
    pub level: TisLevel,
    pub low: Option<f64>,
    pub high: Option<f64>,
}

impl Default for TisOptions {
    fn default() -> Self {
        Self {
            mode: IsCorrection::Truncate,
            level: TisLevel::Token,
            low: None,
            high: None,
        }
    }
}

impl LossOptions {
    /// ε_low and ε_high over a loss's defaults.
    pub(crate) fn eps(&self, low: f64, high: f64) -> (f64, f64) {
        let lo = self.clip_eps.unwrap_or(low);
        let hi = self.clip_eps_high.or(self.clip_eps).unwrap_or(high);
        (lo, hi)
    }

    /// The aggregation over a loss's default.
    pub(crate) fn agg(&self, default: Aggregation) -> Aggregation {
        self.agg.unwrap_or(default)
    }

    /// The dual clip over a loss's default: 0 disables it.
    pub(crate) fn dual(&self, default: Option<f64>) -> Option<f64> {
        match self.dual_clip {
            Some(0.0) => None,
            Some(c) => Some(c),
            None => default,
        }
    }

    /// A dual clip must be 0 (off) or above 1 (it caps `r` of negative
    /// tokens from above, past the trust region).
    fn check(&self) -> Result<(), LossError> {
        if let Some(c) = self.dual_clip
            && !(c == 0.0 || (c.is_finite() && c > 1.0))
        {
            return Err(LossError::new(
                "dual_clip",
                format!("{c} must be 0 (off) or a finite number above 1"),
            ));
        }
        if let Some(r) = self.bapo_rho0
            && !(r > 0.0 && r < 1.0)
        {
            return Err(LossError::new(
                "bapo_rho0",
                format!("{r} must be a share strictly between 0 and 1"),
            ));
        }
        if let Some([low, high]) = self.rec_ring
            && !(low > 0.0 && low <= 1.0 && high.is_finite() && high > 0.0)
        {
            return Err(LossError::new(
                "rec_ring",
                format!("[{low}, {high}] must be [ε'_l, ε'_h] with 0 < ε'_l <= 1 and ε'_h > 0"),
            ));
        }
        check_range("bapo_low", self.bapo_low, |start, max| {
            start > 0.0 && max < 1.0
        })?;
        check_range("bapo_high", self.bapo_high, |start, _| start > 1.0)
    }
}

/// A BAPO bound's search `[start, max, step]`: finite, `start ≤ max`,
/// `step ≥ 0`, and on its side of 1 (`side`).
fn check_range(
    field: &str,
    range: Option<[f64; 3]>,
    side: impl Fn(f64, f64) -> bool,
) -> Result<(), LossError> {
    let Some([start, max, step]) = range else {
        return Ok(());
    };
    let ok = [start, max, step].iter().all(|x| x.is_finite())
        && start <= max
        && step >= 0.0
        && side(start, max);
    if ok {
        return Ok(());
    }
    Err(LossError::new(
        field,
        format!(
            "[{start}, {max}, {step}] must be [start, max, step] with start <= max, step >= 0, \
             c_low's range inside (0, 1) and c_high's above 1"
        ),
    ))
}

/// Builds the named loss.
pub fn build(name: &str, o: &LossOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    build_with(name, o, &TisOptions::default())
}

/// Builds the named loss, with TIS's options.
pub fn build_with(
    name: &str,
    o: &LossOptions,
    tis: &TisOptions,
) -> Result<Box<dyn PolicyLoss>, LossError> {
    o.check()?;
    for (field, set) in [
        ("bapo_rho0", o.bapo_rho0.is_some()),
        ("bapo_low", o.bapo_low.is_some()),
        ("bapo_high", o.bapo_high.is_some()),
    ] {
        if set && name != "bapo" {
            return Err(LossError::new(
                field,
                format!("BAPO's search setting does nothing for {name:?}"),
            ));
        }
    }
    for (field, set) in [
        ("rec_weight", o.rec_weight.is_some()),
        ("rec_ring", o.rec_ring.is_some()),
    ] {
        if set && !name.starts_with("rec-") {
            return Err(LossError::new(
                field,
                format!("REC's setting does nothing for {name:?}"),
            ));
        }
    }
    (entry_of(name)?.build)(o, tis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{Denominators, testing::*};

    #[test]
    fn every_name_builds_and_is_invariant_to_masked_tokens() {
        for name in names() {
            let loss = build(name, &LossOptions::default()).unwrap();
            assert_eq!(loss.name(), name);
            let b = random_batch(7);
            let d = Denominators::of(&b);
            let out = loss.compute(&b, &d);
            assert!(out.loss.is_finite(), "{name}");
            // Change everything about masked-out tokens: nothing moves.
            let mut noisy = b.clone();
            for t in 0..b.len() {
                if !b.mask[t] {
                    noisy.logp[t] = -0.001;
                    noisy.logp_old[t] = -15.0;
                    noisy.advantages[t] = 100.0;
                }
            }
            let again = loss.compute(&noisy, &d);
            assert_eq!(again.loss, out.loss, "{name}");
            assert_eq!(again.grad, out.grad, "{name}");
        }
    }

    #[test]
    fn token_mean_losses_are_invariant_to_token_order() {
        for name in [
            "bapo", "ppo", "dapo", "cispo", "opmd", "asymre", "tis", "rec-ring",
        ] {
            let loss = build(name, &LossOptions::default()).unwrap();
            let b = random_batch(9);
            let mut rev = b.clone();
            rev.advantages.reverse();
            rev.logp.reverse();
            rev.logp_old.reverse();
            rev.mask.reverse();
            rev.seq_ids.reverse();
            if let Some(x) = rev.logp_behav.as_mut() {
                x.reverse();
            }
            let a = loss.compute(&b, &Denominators::of(&b)).loss;
            let r = loss.compute(&rev, &Denominators::of(&rev)).loss;
            assert!((a - r).abs() < 1e-12, "{name}: {a} vs {r}");
        }
    }

    #[test]
    fn every_name_is_unique_and_finds_its_row() {
        let all = names();
        let mut unique = all.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), all.len(), "{all:?}");
        for name in all {
            assert_eq!(entry_of(name).unwrap().name, name);
        }
    }

    /// Each loss's estimator and aggregation, as the spec's tables give
    /// them (§0.3, §1.5, §2).
    #[test]
    fn defaults_are_the_papers() {
        use Aggregation::*;
        use Estimator::*;
        let want = [
            ("bapo", Grpo, TokenMean),
            ("ppo", Grpo, TokenMean),
            ("grpo", Grpo, SeqMeanTokenMean),
            ("dr-grpo", DrGrpo, SeqMeanTokenSumNorm),
            ("dapo", Grpo, TokenMean),
            ("gspo", Grpo, SeqMeanTokenMean),
            ("sapo", Grpo, SeqMeanTokenMean),
            ("cispo", Grpo, TokenMean),
            ("opmd", DrGrpo, TokenMean),
            ("asymre", DrGrpo, TokenMean),
            ("decoupled", Grpo, TokenMean),
            ("tis", Grpo, TokenMean),
            ("rec-onesided", DrGrpo, TokenMean),
            ("rec-twosided", DrGrpo, TokenMean),
            ("rec-ring", DrGrpo, TokenMean),
            ("spear", DrGrpo, SeqMeanTokenSumNorm),
            ("remix", Grpo, TokenMean),
            ("turn-ppo", Grpo, TokenMean),
        ];
        assert_eq!(want.len(), names().len());
        for (name, est, agg) in want {
            assert_eq!(entry_of(name).unwrap().estimator, est, "{name}");
            let loss = build(name, &LossOptions::default()).unwrap();
            assert_eq!(loss.aggregation(), agg, "{name}");
        }
        let e = entry_of("asymre").unwrap();
        assert!(!e.uses_ratio && !e.needs_behaviour);
        assert!(entry_of("tis").unwrap().needs_behaviour);
        assert!(entry_of("decoupled").unwrap().needs_behaviour);
        assert!(entry_of("remix").unwrap().needs_behaviour);
    }

    /// BAPO code mode applies the official dual clip at 3 unless told
    /// otherwise. T3 by hand: the code search ends at (0.8, 2.0); per-token
    /// losses `[−3, −1.8, 4.5 (dual: 1.5·3), 1.2, −0.525, 0.55]`, sum
    /// 0.925; without the dual clip t3 is 1.5·5 = 7.5, sum 3.925; with
    /// `c = 4` it is 6, sum 2.425.
    #[test]
    fn bapo_code_mode_dual_clips_at_3_by_default() {
        let b = t3();
        let d = Denominators::of(&b);
        let code = |dual_clip| LossOptions {
            bapo_mode: Some(BapoMode::Code),
            dual_clip,
            ..Default::default()
        };
        let out = build("bapo", &code(None)).unwrap().compute(&b, &d);
        close(out.metrics["c_low"], 0.8);
        close(out.metrics["c_high"], 2.0);
        close(out.loss, 0.925 / 6.0);
        close_all(&out.grad, &[-0.5, -0.3, 0.0, 0.0, -0.0875, 0.091667]);
        close(out.metrics["dual_clip_frac"], 1.0 / 6.0);
        let off = build("bapo", &code(Some(0.0))).unwrap().compute(&b, &d);
        close(off.loss, 3.925 / 6.0);
        close(off.grad[2], 7.5 / 6.0);
        let four = build("bapo", &code(Some(4.0))).unwrap().compute(&b, &d);
        close(four.loss, 2.425 / 6.0);
        // Paper mode has none unless asked.
        let paper = build("bapo", &LossOptions::default()).unwrap();
        assert_eq!(paper.compute(&b, &d).metrics["dual_clip_frac"], 0.0);
    }

    #[test]
    fn a_dual_clip_at_or_below_1_is_refused_by_name() {
        for c in [0.5, 1.0, -3.0, f64::NAN] {
            let o = LossOptions {
                dual_clip: Some(c),
                ..Default::default()
            };
            assert_eq!(build("ppo", &o).err().unwrap().field, "dual_clip", "{c}");
        }
    }

    /// t3 exhausts paper mode's search below ρ0 = 0.4 (its share reaches
    /// 0.362 at [0.9, 3.0]); asking for 0.35 lets the search stop earlier,
    /// target met.
    #[test]
    fn bapo_ranges_are_set_checked_and_refused_for_other_losses() {
        use crate::loss::testing::e1;
        let b = e1();
        let example = LossOptions {
            bapo_mode: Some(BapoMode::CodeExample),
            ..Default::default()
        };
        // The example's ranges given by hand to code mode, its target as
        // the share 1/3 (P/N = 0.5): the preset's bounds.
        let by_hand = LossOptions {
            bapo_mode: Some(BapoMode::Code),
            bapo_rho0: Some(1.0 / 3.0),
            bapo_low: Some([0.8, 0.95, 0.05]),
            bapo_high: Some([1.2, 2.0, 0.1]),
            ..Default::default()
        };
        let m = |o: &LossOptions| {
            build("bapo", o)
                .unwrap()
                .compute(&b, &Denominators::of(&b))
                .metrics
        };
        let (a, h) = (m(&example), m(&by_hand));
        assert_eq!((a["c_low"], a["c_high"]), (h["c_low"], h["c_high"]));
        for (field, o) in [
            (
                "bapo_low",
                LossOptions {
                    bapo_low: Some([0.9, 0.8, 0.05]),
                    ..Default::default()
                },
            ),
            (
                "bapo_low",
                LossOptions {
                    bapo_low: Some([0.8, 1.1, 0.05]),
                    ..Default::default()
                },
            ),
            (
                "bapo_high",
                LossOptions {
                    bapo_high: Some([0.9, 2.0, 0.1]),
                    ..Default::default()
                },
            ),
            (
                "bapo_high",
                LossOptions {
                    bapo_high: Some([1.2, 2.0, -0.1]),
                    ..Default::default()
                },
            ),
        ] {
            assert_eq!(build("bapo", &o).err().unwrap().field, field, "{o:?}");
        }
        let ppo = LossOptions {
            bapo_high: Some([1.2, 2.0, 0.1]),
            ..Default::default()
        };
        assert_eq!(build("ppo", &ppo).err().unwrap().field, "bapo_high");
    }

    #[test]
    fn bapo_rho0_sets_the_target_in_both_modes() {
        let b = t3();
        let d = Denominators::of(&b);
        let with = |mode, rho0| LossOptions {
            bapo_mode: Some(mode),
            bapo_rho0: rho0,
            ..Default::default()
        };
        let metrics = |o: &LossOptions| build("bapo", o).unwrap().compute(&b, &d).metrics;
        let default = metrics(&with(BapoMode::Paper, None));
        let same = metrics(&with(BapoMode::Paper, Some(0.4)));
        assert_eq!(default["c_high"], same["c_high"]);
        assert_eq!(default["c_low"], same["c_low"]);
        assert_eq!(default["target_met"], 0.0);
        let lower = metrics(&with(BapoMode::Paper, Some(0.35)));
        assert_eq!(lower["target_met"], 1.0, "{lower:?}");
        assert!(lower["pos_fraction"] >= 0.35, "{lower:?}");
        assert!(
            lower["search_steps"] < default["search_steps"],
            "{lower:?} vs {default:?}"
        );
        // Code mode's default ratio 1 is rho0 0.5.
        let code = metrics(&with(BapoMode::Code, None));
        let code_half = metrics(&with(BapoMode::Code, Some(0.5)));
        assert_eq!(code["c_high"], code_half["c_high"]);
        let ppo = LossOptions {
            bapo_rho0: Some(0.5),
            ..Default::default()
        };
        assert_eq!(build("ppo", &ppo).err().unwrap().field, "bapo_rho0");
        for bad in [0.0, 1.0, -0.1, f64::NAN] {
            let err = build("bapo", &with(BapoMode::Paper, Some(bad)))
                .err()
                .unwrap();
            assert_eq!(err.field, "bapo_rho0", "{bad}");
        }
    }

    #[test]
    fn unknown_algorithm_is_named() {
        let err = build("grpo2", &LossOptions::default()).err().unwrap();
        assert_eq!(err.field, "algo");
        assert!(err.message.contains("grpo2") && err.message.contains("bapo"));
    }

    #[test]
    fn options_override_defaults() {
        let b = t3();
        let d = Denominators::of(&b);
        let o = LossOptions {
            clip_eps: Some(0.2),
            clip_eps_high: Some(0.28),
            ..Default::default()
        };
        close(build("ppo", &o).unwrap().compute(&b, &d).loss, 0.7275);
        let dual = LossOptions {
            dual_clip: Some(3.0),
            ..Default::default()
        };
        close(build("ppo", &dual).unwrap().compute(&b, &d).loss, 0.254167);
    }
}
