//! SPEAR's replay pass and ReMix's mixed batches, schedule and
//! reincarnation on the real tiny model, and that a resumed learner does
//! exactly what one that never stopped does (memories and frozen policies
//! in the checkpoint).

mod common;

use bapo_learner::{
    LearnerConfig, StepReport, TrainGroup, Trainer,
    checkpoint::{self, Provenance},
    config::Proximal,
    remix::RemixConfig,
    spear::SpearConfig,
};
use bapo_policy::burn::prelude::*;
use common::{config, group, tiny_policy};

fn batches(n: u32) -> Vec<Vec<TrainGroup>> {
    let stale = tiny_policy(11);
    (0..n)
        .map(|b| (0..2).map(|i| group(&stale, b * 2 + i, 0)).collect())
        .collect()
}

/// Two winners per group (reward 1 of a group mean 0.5): four after the
/// first batch, more than 1.5 × 2, so the second batch replays.
fn spear() -> LearnerConfig {
    LearnerConfig {
        spear: SpearConfig {
            trajectory_buffer_size: Some(2),
            max_replay_loss_steps: 4,
            replay_clip_cov_lb: -100.0,
            replay_clip_cov_ub: 100.0,
            ..Default::default()
        },
        ..config("spear")
    }
}

fn remix() -> LearnerConfig {
    LearnerConfig {
        proximal: Proximal::Recompute,
        epochs: 2,
        remix: RemixConfig {
            off_policy_fraction: 0.5,
            policies: 1,
            kl_coef: 0.5,
            entropy_coef: 0.001,
            reincarnate_at: 3,
            lambda_hold: 1,
            lambda_every: 1,
            lambda_step: 0.25,
            lambda_floor: 0.5,
        },
        ..config("remix")
    }
}

fn metric(r: &StepReport, k: &str) -> Option<f64> {
    r.metrics.get(k).copied()
}

#[test]
fn spear_replays_its_winners_once_the_memory_is_full() {
    let b = batches(3);
    let mut t = Trainer::new(spear(), tiny_policy(12), 0).unwrap();
    let first = t.train_batch(&b[0]).unwrap();
    assert_eq!(first.len(), 1, "nothing to replay yet");
    assert_eq!(metric(&first[0], "spear_memory"), Some(4.0));
    let second = t.train_batch(&b[1]).unwrap();
    assert_eq!(second.len(), 2, "one on-policy update, one replay update");
    let replay = &second[1];
    assert_eq!(metric(replay, "spear_replay"), Some(1.0));
    // 4 kept at A = 1 − 0.5, the largest power of two ≤ 4 capped at 2.
    assert_eq!(metric(replay, "spear_replay_seqs"), Some(2.0));
    assert_eq!(replay.sequences, 2);
    assert_eq!(metric(replay, "spear_replay_reward_mean"), Some(1.0));
    // Batch 1 is verl's step 2: c(2) with T = 4 is (1 − cos(π/2))/2 = 0.5.
    assert!((metric(replay, "spear_replay_coef").unwrap() - 0.5).abs() < 1e-12);
    assert!(replay.loss != 0.0 && replay.metrics["grad_norm"] > 0.0);
    assert_eq!(replay.version, 3);
    // The replay emptied the memory; this batch's winners refill it.
    assert_eq!(metric(&second[0], "spear_memory"), Some(4.0));
}

/// At the defaults the replay fires: the buffer is one batch of sequences
/// (8 here), so the memory replays once it counts more than 12 winners,
/// 4 a batch, at the fifth batch. (With the former fixed 2048 it never
/// could: the memory holds a few hundred at bapo's batch sizes.)
#[test]
fn spear_replays_at_its_default_settings() {
    let b = batches(5);
    let mut t = Trainer::new(config("spear"), tiny_policy(12), 0).unwrap();
    let replayed: Vec<bool> = b
        .iter()
        .map(|g| {
            let r = t.train_batch(g).unwrap();
            r.iter().any(|r| metric(r, "spear_replay") == Some(1.0))
        })
        .collect();
    assert_eq!(replayed, [false, false, false, false, true]);
}

/// SPEAR's and ReMix's own entropy bonuses (their sources' 0.001) reach
/// the gradient: the same batch with the bonus at 0 moves the weights
/// differently.
#[test]
fn spear_and_remix_train_with_their_own_entropy_bonus() {
    let b = batches(1);
    for algo in ["spear", "remix"] {
        let grad_norm = |coef: f64| {
            let mut cfg = if algo == "spear" { spear() } else { remix() };
            cfg.spear.entropy_coef = if algo == "spear" { coef } else { 0.001 };
            cfg.remix.entropy_coef = if algo == "remix" { coef } else { 0.001 };
            let mut t = Trainer::new(cfg, tiny_policy(12), 0).unwrap();
            t.train_batch(&b[0]).unwrap()[0].metrics["grad_norm"]
        };
        let (with, without) = (grad_norm(0.001), grad_norm(0.0));
        assert!((with - without).abs() > 1e-9, "{algo}: {with} vs {without}");
    }
    let mut cfg = spear();
    cfg.entropy_coef = 0.01;
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("learner.spear.entropy_coef"), "{err}");
}

#[test]
fn a_resumed_spear_run_replays_what_an_uninterrupted_one_does() {
    same_after_resume(spear(), 3);
}

#[test]
fn remix_mixes_replayed_groups_and_follows_its_schedule() {
    let b = batches(5);
    let mut t = Trainer::new(remix(), tiny_policy(12), 0).unwrap();
    let per_batch: Vec<Vec<StepReport>> = b.iter().map(|g| t.train_batch(g).unwrap()).collect();
    let at = |batch: usize, k: &str| metric(&per_batch[batch][0], k);
    // p = 0.5: as many replayed groups as fresh ones, from the last batch.
    let replayed: Vec<_> = (0..5).map(|i| at(i, "remix_replayed_groups")).collect();
    assert_eq!(
        replayed,
        [0.0, 2.0, 2.0, 0.0, 0.0].map(Some),
        "none before a first batch, none after reincarnation at 3"
    );
    assert_eq!(per_batch[1][0].sequences, 16, "4 groups of 4");
    let lambdas: Vec<_> = (0..5).map(|i| at(i, "remix_lambda")).collect();
    assert_eq!(lambdas, [1.0, 1.0, 0.75, 0.5, 0.5].map(Some));
    assert_eq!(at(3, "remix_reincarnated"), Some(1.0));
    // λ = 1: only the base term; from batch 2 the previous policy's too.
    assert!(at(1, "kl_prev_k3").is_none());
    assert!(metric(&per_batch[2][1], "kl_prev_k3").unwrap() > 0.0);
    // Right after reincarnation π_base is the current policy.
    assert!(at(3, "kl_base_k3").unwrap() < 1e-6);
    assert!(metric(&per_batch[2][1], "kl_base_k3").unwrap() > 1e-6);
}

#[test]
fn a_resumed_remix_run_mixes_and_penalises_as_an_uninterrupted_one() {
    same_after_resume(remix(), 4);
}

/// The KL reference is the initial policy, also after a resume.
#[test]
fn a_resumed_kl_penalty_still_measures_from_the_initial_policy() {
    let cfg = LearnerConfig {
        kl_coef: 0.5,
        ..config("ppo")
    };
    same_after_resume(cfg, 3);
}

/// Trains `n` batches straight, and again from a checkpoint after the
/// first; every report after the resume must match.
fn same_after_resume(cfg: LearnerConfig, n: u32) {
    let b = batches(n);
    let dir = tempfile::tempdir().unwrap();
    let mut straight = Trainer::new(cfg.clone(), tiny_policy(12), 0).unwrap();
    straight.train_batch(&b[0]).unwrap();
    let saved = checkpoint::save(dir.path(), &straight, &Provenance::default()).unwrap();
    let want: Vec<Vec<StepReport>> = b[1..]
        .iter()
        .map(|g| straight.train_batch(g).unwrap())
        .collect();
    let (mut resumed, _) = checkpoint::load(&saved, cfg, &Device::flex()).unwrap();
    for (g, want) in b[1..].iter().zip(want) {
        let got = resumed.train_batch(g).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((g.version, g.sequences), (w.version, w.sequences));
            assert!(
                (g.loss - w.loss).abs() < 1e-6 * w.loss.abs().max(1.0),
                "step {}: resumed {} vs uninterrupted {}",
                w.step,
                g.loss,
                w.loss
            );
            for (k, v) in &w.metrics {
                if k.starts_with("kl_") || k.starts_with("spear_") || k.starts_with("remix_") {
                    let got = g.metrics.get(k).copied().unwrap_or(f64::NAN);
                    assert!(
                        (got - v).abs() <= 1e-5 * v.abs().max(1e-3),
                        "step {} {k}: resumed {got} vs uninterrupted {v}",
                        w.step
                    );
                }
            }
        }
    }
}

/// `state` with `edit` applied to its JSON form (what a damaged or
/// hand-edited memory reads back as).
fn edited(
    state: &bapo_learner::trainer::AlgoState,
    edit: impl Fn(&mut serde_json::Value),
) -> bapo_learner::trainer::AlgoState {
    let mut v = serde_json::to_value(state).unwrap();
    edit(&mut v);
    serde_json::from_value(v).unwrap()
}

/// A SPEAR or ReMix memory read back with an entry a step could not lay
/// out (log-probs shorter than the response, a token outside the
/// vocabulary) is refused by name at restore, not met mid-training; a
/// sound one restores.
#[test]
fn a_restored_replay_memory_is_checked_like_a_fresh_batch() {
    let b = batches(2);
    let mut s = Trainer::new(spear(), tiny_policy(12), 0).unwrap();
    s.train_batch(&b[0]).unwrap();
    let state = s.algo_state();
    let mut fresh = Trainer::new(spear(), tiny_policy(12), 0).unwrap();
    fresh.restore_algo_state(state.clone()).unwrap();
    let short = edited(&state, |v| {
        v["spear"]["entries"][1]["logp_old"]
            .as_array_mut()
            .unwrap()
            .pop();
    });
    let e = fresh.restore_algo_state(short).unwrap_err().to_string();
    assert!(
        e.contains("SPEAR's memory, entry 1") && e.contains("log-probs"),
        "{e}"
    );

    let mut r = Trainer::new(remix(), tiny_policy(13), 0).unwrap();
    r.train_batch(&b[0]).unwrap();
    let state = r.algo_state();
    let bad_token = edited(&state, |v| {
        v["remix"]["batches"][0][1][0]["sequences"][2]["response"][0] = 4096.into();
    });
    let mut fresh = Trainer::new(remix(), tiny_policy(13), 0).unwrap();
    let e = fresh.restore_algo_state(bad_token).unwrap_err().to_string();
    assert!(
        e.contains("ReMix's memory, group g0, sequence 2") && e.contains("4096"),
        "{e}"
    );
    fresh.restore_algo_state(state).unwrap();
}
