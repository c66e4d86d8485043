//! Losses by name, with the options `bapo loss` and the learner config
//! expose laid over each loss's own defaults.

use super::{
    Aggregation, LossError, PolicyLoss,
    bapo::{Bapo, BapoConfig, BapoMode},
    cispo::Cispo,
    decoupled::Decoupled,
    gspo::Gspo,
    ppo::PpoClip,
    reinforce::{AsymRe, Opmd},
    sapo::Sapo,
    tis::Tis,
};

pub const NAMES: &[&str] = &[
    "bapo",
    "ppo",
    "grpo",
    "dr-grpo",
    "dapo",
    "gspo",
    "sapo",
    "cispo",
    "opmd",
    "asymre",
    "decoupled",
    "tis",
];

/// Overrides common to the losses; `None` keeps the loss's default.
#[derive(Debug, Clone, Default)]
pub struct LossOptions {
    pub bapo_mode: Option<BapoMode>,
    /// ε_low (and ε_high unless given separately).
    pub clip_eps: Option<f64>,
    pub clip_eps_high: Option<f64>,
    pub dual_clip: Option<f64>,
    pub agg: Option<Aggregation>,
}

impl LossOptions {
    fn eps(&self, low: f64, high: f64) -> (f64, f64) {
        let lo = self.clip_eps.unwrap_or(low);
        let hi = self.clip_eps_high.or(self.clip_eps).unwrap_or(high);
        (lo, hi)
    }
}

/// Builds the named loss.
pub fn build(name: &str, o: &LossOptions) -> Result<Box<dyn PolicyLoss>, LossError> {
    let agg = |default: Aggregation| o.agg.unwrap_or(default);
    let ppo_like = |base: PpoClip| {
        let (eps_low, eps_high) = o.eps(base.eps_low, base.eps_high);
        PpoClip {
            eps_low,
            eps_high,
            dual_clip: o.dual_clip.or(base.dual_clip),
            agg: agg(base.agg),
            ..base
        }
    };
    let loss: Box<dyn PolicyLoss> = match name {
        "bapo" => {
            let mut cfg = match o.bapo_mode.unwrap_or(BapoMode::Paper) {
                BapoMode::Paper => BapoConfig::paper(),
                BapoMode::Code => BapoConfig::code(),
            };
            cfg.dual_clip = o.dual_clip;
            cfg.agg = agg(cfg.agg);
            Box::new(Bapo { cfg })
        }
        "ppo" => Box::new(ppo_like(PpoClip::ppo())),
        "grpo" => Box::new(ppo_like(PpoClip::grpo())),
        "dr-grpo" => Box::new(ppo_like(PpoClip::dr_grpo())),
        "dapo" => Box::new(ppo_like(PpoClip::dapo())),
        "gspo" => {
            let d = Gspo::default();
            let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
            Box::new(Gspo {
                eps_low,
                eps_high,
                agg: agg(d.agg),
            })
        }
        "sapo" => {
            let d = Sapo::default();
            Box::new(Sapo {
                agg: agg(d.agg),
                ..d
            })
        }
        "cispo" => {
            let d = Cispo::default();
            let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
            Box::new(Cispo {
                eps_low,
                eps_high,
                agg: agg(d.agg),
            })
        }
        "opmd" => {
            let d = Opmd::default();
            Box::new(Opmd {
                agg: agg(d.agg),
                ..d
            })
        }
        "asymre" => {
            let d = AsymRe::default();
            Box::new(AsymRe {
                agg: agg(d.agg),
                ..d
            })
        }
        "decoupled" => {
            let d = Decoupled::default();
            let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
            Box::new(Decoupled {
                eps_low,
                eps_high,
                dual_clip: o.dual_clip,
                agg: agg(d.agg),
                ..d
            })
        }
        "tis" => {
            let d = Tis::default();
            let (eps_low, eps_high) = o.eps(d.eps_low, d.eps_high);
            Box::new(Tis {
                eps_low,
                eps_high,
                dual_clip: o.dual_clip,
                agg: agg(d.agg),
                ..d
            })
        }
        other => {
            return Err(LossError::new(
                "algo",
                format!("unknown algorithm {other:?}; known: {}", NAMES.join(", ")),
            ));
        }
    };
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{Denominators, testing::*};

    #[test]
    fn every_name_builds_and_is_invariant_to_masked_tokens() {
        for name in NAMES {
            let loss = build(name, &LossOptions::default()).unwrap();
            assert_eq!(loss.name(), *name);
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
        for name in ["bapo", "ppo", "dapo", "cispo", "opmd", "asymre", "tis"] {
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
