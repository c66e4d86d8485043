//! The learning rate as a pure function of the optimiser step: linear
//! warm-up, then constant or cosine decay. Being a function of the step (and
//! not an object with state) it needs nothing in a checkpoint to resume.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decay {
    Constant,
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub lr: f64,
    pub warmup_steps: u64,
    pub decay: Decay,
    /// Steps over which cosine decays to `min_lr_ratio × lr`; after that the
    /// rate stays there.
    pub decay_steps: u64,
    pub min_lr_ratio: f64,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            warmup_steps: 0,
            decay: Decay::Constant,
            decay_steps: 0,
            min_lr_ratio: 0.1,
        }
    }
}

impl LrSchedule {
    /// The rate applied by optimiser step `step` (0-based).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.decay {
            Decay::Constant => self.lr,
            Decay::Cosine => {
                let span = self.decay_steps.max(1) as f64;
                let t = ((step - self.warmup_steps) as f64 / span).min(1.0);
                let floor = self.lr * self.min_lr_ratio;
                floor + (self.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_and_reaches_the_peak() {
        let s = LrSchedule {
            lr: 1e-3,
            warmup_steps: 4,
            ..Default::default()
        };
        let got: Vec<f64> = (0..6).map(|i| s.at(i)).collect();
        let want = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-15, "{got:?}");
        }
    }

    #[test]
    fn cosine_decays_from_peak_to_floor_and_stays() {
        let s = LrSchedule {
            lr: 1.0,
            warmup_steps: 2,
            decay: Decay::Cosine,
            decay_steps: 10,
            min_lr_ratio: 0.1,
        };
        assert_eq!(s.at(2), 1.0);
        assert!((s.at(7) - 0.55).abs() < 1e-12, "midpoint {}", s.at(7));
        assert!((s.at(12) - 0.1).abs() < 1e-12);
        assert!((s.at(1000) - 0.1).abs() < 1e-12);
        for i in 2..12 {
            assert!(s.at(i + 1) <= s.at(i), "monotone at {i}");
        }
    }
}
