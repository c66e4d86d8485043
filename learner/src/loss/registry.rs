//! Losses by name: one table ([`ENTRIES`]) of the rows each loss's own
//! file declares, with what its paper trains it with (an algorithm
//! compared under its name must be that algorithm, not the loss on another
//! estimator) and how it is built from the options `bapo loss` and the
//! learner config expose. A new loss is a new file with its row, and that
//! row added here.

pub use super::options::{
    BapoMode, Build, ClipCovOptions, Entry, IsCorrection, LossOptions, RecWeight, TisLevel,
    TisOptions,
};
use super::{
    LossError, PolicyLoss, bapo, cispo, clip_cov, decoupled, gspo, ppo, rec, reinforce, remix,
    sapo, tis, turn_ppo,
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

/// The registry entry of `name`, or an error naming `algo`.
pub fn entry_of(name: &str) -> Result<&'static Entry, LossError> {
    ENTRIES.iter().find(|e| e.name == name).ok_or_else(|| {
        LossError::new(
            "algo",
            format!("unknown algorithm {name:?}; known: {}", names().join(", ")),
        )
    })
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
        use crate::advantage::Estimator::*;
        use crate::loss::Aggregation::*;
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
