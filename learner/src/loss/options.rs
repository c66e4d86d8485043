//! What a loss can be asked (`bapo loss`'s flags, `[learner]`'s keys) and
//! the registry row each loss file declares: the types every loss file and
//! the registry share, so that neither imports the other.

use serde::{Deserialize, Serialize};

use super::{Aggregation, LossError, PolicyLoss};
use crate::advantage::Estimator;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BapoMode {
    /// The paper's Algorithm 1 and hyperparameters (§5.1).
    Paper,
    /// The official code's search with its `bapo_trainer.yaml` ranges.
    Code,
    /// The official code's search with its `run_bapo_example.sh` setting.
    CodeExample,
}

/// How an in-range token's term is weighted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecWeight {
    /// `−A·lp_θ` (the "NoIS" variants).
    #[default]
    None,
    /// `−A·ρ·lp_θ`, `ρ = sg(π_θ/π_old)` (Trinity's `importance_sampling`).
    Is,
    /// `−A·clip(ρ, 1−ε'_l, 1+ε'_h)·lp_θ` (`truncated_importance_sampling`).
    Tis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TisLevel {
    Token,
    Sequence,
}

/// What is done with a behaviour weight (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IsCorrection {
    Truncate,
    Mask,
    Icepop,
}

impl IsCorrection {
    /// The mode's default `(low, high)`: truncation has no floor.
    pub fn default_band(self) -> (f64, f64) {
        match self {
            IsCorrection::Truncate => (0.0, 2.0),
            IsCorrection::Mask => (0.5, 2.0),
            IsCorrection::Icepop => (0.5, 5.0),
        }
    }
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
    pub(crate) fn check(&self) -> Result<(), LossError> {
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
