//! Reward shaping on top of a task's verifier: a bonus for well-formed
//! completions and DAPO's soft overlong punishment. Both are off by default,
//! so an unconfigured run trains on the verifier's reward alone.

use serde::{Deserialize, Serialize};

use super::TaskError;

/// What is added to a task's reward (`[shaping]` in a config file).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Shaping {
    /// Added when the completion is well-formed per the task's own check
    /// ([`super::Task::well_formed`]), right or wrong; 0 = off. Helps a
    /// cold model find the answer format before it finds right answers.
    pub format_bonus: f32,
    /// DAPO's soft overlong punishment; `None` = off.
    pub overlong: Option<Overlong>,
}

/// DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): no penalty up
/// to `max_tokens - buffer` tokens, then a penalty growing linearly to
/// `penalty` at `max_tokens`, and the full `penalty` beyond. A truncated
/// response is not necessarily wrong, so instead of a cliff at the length
/// limit the model is told gradually that it is getting long.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overlong {
    /// The length limit L_max, in response tokens.
    pub max_tokens: usize,
    /// The soft zone L_cache before the limit, in tokens (0 = a plain
    /// cliff: full penalty beyond `max_tokens`, none up to it).
    pub buffer: usize,
    /// The magnitude of the full penalty (subtracted; default 1, DAPO's).
    #[serde(default = "one")]
    pub penalty: f32,
}

fn one() -> f32 {
    1.0
}

impl Overlong {
    /// The (non-positive) length reward of a response of `n_tokens` tokens.
    pub fn reward(&self, n_tokens: usize) -> f32 {
        let soft_start = self.max_tokens.saturating_sub(self.buffer);
        if n_tokens <= soft_start {
            0.0
        } else if n_tokens <= self.max_tokens {
            // The zone is `buffer` long unless the buffer exceeds the limit.
            let zone = (self.max_tokens - soft_start) as f64;
            let into = (n_tokens - soft_start) as f64;
            -(f64::from(self.penalty) * into / zone) as f32
        } else {
            -self.penalty
        }
    }
}

impl Shaping {
    /// The shaped reward of a completion whose verifier reward is `base`.
    pub fn apply(&self, base: f32, well_formed: bool, n_tokens: usize) -> f32 {
        let bonus = if well_formed { self.format_bonus } else { 0.0 };
        let length = self.overlong.as_ref().map_or(0.0, |o| o.reward(n_tokens));
        base + bonus + length
    }

    /// The range of shaped rewards, given the task's `reward_range()`.
    pub fn range(&self, (lo, hi): (f32, f32)) -> (f32, f32) {
        let bonus = self.format_bonus;
        let penalty = self.overlong.as_ref().map_or(0.0, |o| o.penalty);
        (lo + bonus.min(0.0) - penalty, hi + bonus.max(0.0))
    }

    /// Rejects settings that would be silent mistakes: non-finite values, a
    /// negative penalty (which would reward length) and a zero limit.
    pub fn validate(&self) -> Result<(), TaskError> {
        if !self.format_bonus.is_finite() {
            return Err(TaskError::InvalidSpec {
                field: "format_bonus",
                reason: format!("{} is not finite", self.format_bonus),
            });
        }
        if let Some(o) = &self.overlong {
            if !(o.penalty.is_finite() && o.penalty >= 0.0) {
                return Err(TaskError::InvalidSpec {
                    field: "overlong.penalty",
                    reason: format!("{} must be finite and >= 0 (it is subtracted)", o.penalty),
                });
            }
            if o.max_tokens == 0 {
                return Err(TaskError::InvalidSpec {
                    field: "overlong.max_tokens",
                    reason: "must be positive".to_string(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dapo(max_tokens: usize, buffer: usize, penalty: f32) -> Overlong {
        Overlong {
            max_tokens,
            buffer,
            penalty,
        }
    }

    /// DAPO eq. 13, written out independently.
    fn reference(y: usize, l_max: usize, l_cache: usize) -> f64 {
        let (y, l_max, l_cache) = (y as f64, l_max as f64, l_cache as f64);
        if y <= l_max - l_cache {
            0.0
        } else if y <= l_max {
            ((l_max - l_cache) - y) / l_cache
        } else {
            -1.0
        }
    }

    #[test]
    fn overlong_follows_dapo_piecewise_formula() {
        let o = dapo(100, 20, 1.0);
        let cases = [
            (0, 0.0),
            (80, 0.0),
            (81, -0.05),
            (90, -0.5),
            (99, -0.95),
            (100, -1.0),
            (101, -1.0),
            (10_000, -1.0),
        ];
        for (n, want) in cases {
            assert!((o.reward(n) - want).abs() < 1e-6, "n={n}: {}", o.reward(n));
        }
        for n in 0..200 {
            let want = reference(n, 100, 20) as f32;
            assert!((o.reward(n) - want).abs() < 1e-6, "n={n}");
        }
    }

    #[test]
    fn penalty_scales_and_edges_hold() {
        assert!((dapo(100, 20, 0.5).reward(90) + 0.25).abs() < 1e-6);
        // No buffer: a cliff just past the limit.
        let cliff = dapo(10, 0, 1.0);
        assert_eq!(cliff.reward(10), 0.0);
        assert_eq!(cliff.reward(11), -1.0);
        // A buffer longer than the limit: the zone is the whole range.
        let wide = dapo(10, 50, 1.0);
        assert_eq!(wide.reward(0), 0.0);
        assert!((wide.reward(5) + 0.5).abs() < 1e-6);
        assert_eq!(wide.reward(10), -1.0);
        // Monotone non-increasing.
        let o = dapo(4096, 1024, 1.0);
        let mut prev = 0.0;
        for n in (0..6000).step_by(7) {
            let r = o.reward(n);
            assert!(r <= prev && r >= -1.0);
            prev = r;
        }
    }

    #[test]
    fn shaping_is_off_by_default_and_adds_up() {
        let off = Shaping::default();
        assert_eq!(off.apply(1.0, true, 1_000_000), 1.0);
        assert_eq!(off.apply(0.0, false, 0), 0.0);
        assert_eq!(off.range((0.0, 1.0)), (0.0, 1.0));

        let on = Shaping {
            format_bonus: 0.1,
            overlong: Some(dapo(100, 20, 1.0)),
        };
        assert!((on.apply(1.0, true, 50) - 1.1).abs() < 1e-6);
        assert!((on.apply(0.0, true, 90) - (0.1 - 0.5)).abs() < 1e-6);
        assert!((on.apply(0.0, false, 200) + 1.0).abs() < 1e-6);
        assert_eq!(on.range((0.0, 1.0)), (-1.0, 1.1));
        on.validate().unwrap();
    }

    #[test]
    fn reads_from_toml_and_validates() {
        let s: Shaping =
            toml::from_str("format_bonus = 0.1\n[overlong]\nmax_tokens = 64\nbuffer = 16\n")
                .unwrap();
        assert_eq!(s.overlong, Some(dapo(64, 16, 1.0)));
        assert!(toml::from_str::<Shaping>("bonus = 1.0").is_err());
        assert!(
            toml::from_str::<Shaping>("[overlong]\nmax_tokens = 1\nbuffer = 0\nx = 1\n").is_err()
        );

        let bad = Shaping {
            format_bonus: 0.0,
            overlong: Some(dapo(64, 16, -1.0)),
        };
        assert!(bad.validate().unwrap_err().to_string().contains("penalty"));
        let nan = Shaping {
            format_bonus: f32::NAN,
            overlong: None,
        };
        assert!(nan.validate().is_err());
    }
}
