//! Every name trains the algorithm it names: its paper's advantages, its
//! normaliser, several updates per batch with the ratio measured against
//! the proximal policy.

mod common;

use std::time::Instant;

use bapo_learner::{
    LearnerConfig, TrainGroup, Trainer,
    config::Proximal,
    loss::{TokenBatch, log_ratio},
    stats::mismatch_metrics,
    trainer::TrainError,
};
use bapo_policy::Policy;
use common::{config, group, logprobs, tiny_policy};

/// `(1 − 0.5) / (std + 1e−6)` for rewards `[1, 0, 1, 0]`, unbiased std
/// `sqrt(1/3)`.
const GRPO: f64 = 0.866024;
/// `1 − 0.5`: no std division.
const MEAN_ONLY: f64 = 0.5;

/// A configuration under which `algo` may run: the behaviour-weighted
/// losses need a recomputed proximal policy and more than one update.
fn runnable(algo: &str) -> LearnerConfig {
    let mut cfg = config(algo);
    if matches!(algo, "decoupled" | "tis" | "remix") {
        cfg.proximal = Proximal::Recompute;
        cfg.epochs = 2;
    }
    cfg
}

fn groups(behaviour: &Policy, n: u32) -> Vec<TrainGroup> {
    (0..n).map(|i| group(behaviour, i, 0)).collect()
}

fn copy(p: &Policy) -> Policy {
    Policy::with_model(p.config.clone(), p.model.clone(), &p.device())
}

/// The advantages the loss of `algo` computes on: every group has rewards
/// `[1, 0, 1, 0]` over 3-token responses.
fn check_advantages(algo: &str, a: f64) {
    let p = tiny_policy(40);
    let t = Trainer::new(runnable(algo), copy(&p), 0).unwrap();
    let back = t.gradients(&groups(&p, 2)).unwrap();
    let one: Vec<f64> = [a, -a, a, -a].iter().flat_map(|&x| [x; 3]).collect();
    let want = [one.clone(), one].concat();
    assert_eq!(back.batch.advantages.len(), want.len(), "{algo}");
    for (i, (g, w)) in back.batch.advantages.iter().zip(&want).enumerate() {
        assert!((g - w).abs() < 1e-6, "{algo} token {i}: {g} vs {w}");
    }
}

macro_rules! trains_on {
    ($($test:ident: $algo:literal => $a:expr;)*) => {$(
        #[test]
        fn $test() {
            check_advantages($algo, $a);
        }
    )*};
}

trains_on! {
    bapo_trains_on_grpo_advantages: "bapo" => GRPO;
    ppo_trains_on_grpo_advantages: "ppo" => GRPO;
    grpo_trains_on_std_normalised_advantages: "grpo" => GRPO;
    dr_grpo_trains_on_advantages_without_std: "dr-grpo" => MEAN_ONLY;
    dapo_trains_on_grpo_advantages: "dapo" => GRPO;
    gspo_trains_on_grpo_advantages: "gspo" => GRPO;
    sapo_trains_on_grpo_advantages: "sapo" => GRPO;
    cispo_trains_on_grpo_advantages: "cispo" => GRPO;
    opmd_trains_on_advantages_without_std: "opmd" => MEAN_ONLY;
    asymre_trains_on_advantages_without_std: "asymre" => MEAN_ONLY;
    decoupled_trains_on_grpo_advantages: "decoupled" => GRPO;
    tis_trains_on_grpo_advantages: "tis" => GRPO;
    rec_trains_on_advantages_without_std: "rec-ring" => MEAN_ONLY;
    spear_trains_on_advantages_without_std: "spear" => MEAN_ONLY;
    remix_trains_on_grpo_advantages: "remix" => GRPO;
    turn_ppo_trains_on_grpo_advantages: "turn-ppo" => GRPO;
}

/// Turn-PPO under `proximal = "behavior"`: the turn ids reach the loss's
/// batch, and a turn sampled across a weight update (versions 0 then 1)
/// takes the current policy's log-probs as its `lp_old`, while turns of
/// one version keep the behaviour's.
#[test]
fn a_turn_sampled_across_an_update_gets_one_proximal_policy() {
    let behaviour = tiny_policy(46);
    let start = tiny_policy(47);
    let mut gs = groups(&behaviour, 1);
    for s in &mut gs[0].sequences {
        s.turns = vec![0, 0, 1];
    }
    gs[0].sequences[0].versions = vec![0, 1, 1];
    let t = Trainer::new(config("turn-ppo"), copy(&start), 1).unwrap();
    let p = t.prepare(&gs).unwrap();
    let (current, behav) = (flat_logprobs(&start, &gs), flat_logprobs(&behaviour, &gs));
    for (k, got) in p.logp_old().iter().enumerate() {
        let want = if k < 2 { current[k] } else { behav[k] };
        assert!((got - want).abs() < 1e-5, "token {k}: {got} vs {want}");
    }
    assert!((current[0] - behav[0]).abs() > 1e-3, "the policies differ");
    let back = t.backward(&p).unwrap();
    assert_eq!(back.batch.turn_ids, [0, 0, 1].repeat(4));
    assert_eq!(back.metrics["mixed_version_turn_tokens"], 2.0);
    assert_eq!(back.loss.metrics["turns"], 8.0);
}

#[test]
fn the_configured_estimator_overrides_the_algorithms() {
    let p = tiny_policy(41);
    let mut cfg = config("grpo");
    cfg.advantage = Some(bapo_learner::advantage::Estimator::DrGrpo);
    let t = Trainer::new(cfg, copy(&p), 0).unwrap();
    let back = t.gradients(&groups(&p, 1)).unwrap();
    assert!((back.batch.advantages[0] - MEAN_ONLY).abs() < 1e-12);
}

/// Dr. GRPO divides every token's term by the configured constant, not by
/// the batch's longest response: on fresh data (`r = 1`) each token's
/// gradient is `−A / L_const`.
#[test]
fn dr_grpo_normalises_by_the_configured_max_response_length() {
    let p = tiny_policy(42);
    for l_const in [8usize, 16] {
        let mut cfg = config("dr-grpo");
        cfg.max_response_tokens = l_const;
        let t = Trainer::new(cfg, copy(&p), 0).unwrap();
        let back = t.gradients(&groups(&p, 2)).unwrap();
        for (g, a) in back.loss.grad.iter().zip(&back.batch.advantages) {
            let want = -a / l_const as f64;
            assert!((g - want).abs() < 1e-5, "L {l_const}: {g} vs {want}");
        }
    }
    // Unset, the constant is the model's position count.
    let t = Trainer::new(config("dr-grpo"), copy(&p), 0).unwrap();
    let back = t.gradients(&groups(&p, 1)).unwrap();
    let l = p.config.max_position_embeddings as f64;
    assert!((back.loss.grad[0] + back.batch.advantages[0] / l).abs() < 1e-6);
}

#[test]
fn a_response_longer_than_max_response_tokens_is_refused_by_name() {
    let p = tiny_policy(43);
    let mut cfg = config("dr-grpo");
    cfg.max_response_tokens = 2;
    let t = Trainer::new(cfg, copy(&p), 0).unwrap();
    let e = t.gradients(&groups(&p, 1)).err().unwrap();
    assert!(
        matches!(e, TrainError::ResponseTooLong { len: 3, max: 2, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("learner.max_response_tokens"), "{e}");
}

/// `lp` of every response token of `groups` under `policy`.
fn flat_logprobs(policy: &Policy, groups: &[TrainGroup]) -> Vec<f64> {
    groups
        .iter()
        .flat_map(|g| &g.sequences)
        .flat_map(|s| logprobs(policy, &s.prompt, &s.response))
        .map(|x| x as f64)
        .collect()
}

fn max_dev_from_one(b: &TokenBatch) -> f64 {
    b.ratios()
        .iter()
        .map(|r| (r - 1.0).abs())
        .fold(0.0, f64::max)
}

/// Two updates on one batch under decoupled PPO: the proximal log-probs
/// are those of the weights before the first update, the first update has
/// `u ≡ 1`, the second does not, and its gradient is AReaL's formula by
/// hand: 0 where `u` left `[0.8, 1.2]` on the clipped side, else
/// `−w·A·u / N` with `w = π_prox/π_behav`.
#[test]
fn the_second_update_clips_against_the_proximal_policy() {
    let behaviour = tiny_policy(44);
    let start = tiny_policy(45);
    let gs = groups(&behaviour, 2);
    let mut cfg = runnable("decoupled");
    cfg.lr = 0.02;
    let mut t = Trainer::new(cfg, copy(&start), 0).unwrap();
    let prox = flat_logprobs(&start, &gs);
    let behav = flat_logprobs(&behaviour, &gs);

    let p = t.prepare(&gs).unwrap();
    for (got, want) in p.logp_old().iter().zip(&prox) {
        assert!((got - want).abs() < 1e-5);
    }
    let first = t.backward(&p).unwrap();
    assert!(max_dev_from_one(&first.batch) < 1e-4);
    let r1 = t.apply(first, Instant::now()).unwrap();
    assert_eq!((r1.step, r1.version), (1, 1));

    let second = t.backward(&p).unwrap();
    let b = &second.batch;
    assert!(max_dev_from_one(b) > 0.2, "ratios barely moved");
    let n = b.len() as f64;
    let (mut clipped, mut free) = (0, 0);
    for k in 0..b.len() {
        assert!(
            (b.logp_old[k] - prox[k]).abs() < 1e-5,
            "lp_old is the proximal policy"
        );
        let lp_behav = b.logp_behav.as_ref().unwrap()[k];
        assert!((lp_behav - behav[k]).abs() < 1e-5);
        let a = b.advantages[k];
        let u = log_ratio(b.logp[k], prox[k]).exp();
        let w = log_ratio(prox[k], behav[k]).exp();
        let clip = (a > 0.0 && u > 1.2) || (a < 0.0 && u < 0.8);
        let want = if clip { 0.0 } else { -w * a * u / n };
        let got = second.loss.grad[k];
        assert!(
            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
            "token {k}: {got} vs {want}"
        );
        if clip {
            clipped += 1;
        } else {
            free += 1;
        }
    }
    assert!(clipped > 0 && free > 0, "{clipped} clipped, {free} not");
    let r2 = t.apply(second, Instant::now()).unwrap();
    assert_eq!(r2.version, 2);
}

/// `epochs × mini_batches` updates per batch, one version each; the first
/// update of the batch sees `r ≡ 1`, later ones do not.
#[test]
fn a_batch_makes_epochs_times_mini_batches_updates() {
    let p = tiny_policy(46);
    let mut cfg = config("ppo");
    cfg.proximal = Proximal::Recompute;
    cfg.epochs = 2;
    cfg.mini_batches = 2;
    cfg.lr = 0.02;
    let mut t = Trainer::new(cfg, copy(&p), 3).unwrap();
    let reports = t.train_batch(&groups(&p, 4)).unwrap();
    assert_eq!(reports.len(), 4);
    let versions: Vec<u64> = reports.iter().map(|r| r.version).collect();
    assert_eq!(versions, [4, 5, 6, 7]);
    let at = |i: usize, k: &str| reports[i].metrics[k];
    assert_eq!((at(2, "epoch"), at(2, "mini_batch")), (1.0, 0.0));
    assert!((at(0, "ratio_max") - 1.0).abs() < 1e-4 && (at(0, "ratio_min") - 1.0).abs() < 1e-4);
    assert!(
        at(2, "ratio_max") - at(2, "ratio_min") > 0.05,
        "{:?}",
        reports[2].metrics
    );
    assert_eq!(
        reports.iter().map(|r| r.tokens).sum::<usize>(),
        2 * 4 * 4 * 3
    );
}

/// The step reports the training/inference mismatch of its batch.
#[test]
fn steps_report_the_mismatch_between_learner_and_actor() {
    let behaviour = tiny_policy(47);
    let gs = groups(&behaviour, 2);
    let mut t = Trainer::new(config("bapo"), tiny_policy(48), 0).unwrap();
    let back = t.gradients(&gs).unwrap();
    let want = mismatch_metrics(&back.batch);
    let r = t.apply(back, Instant::now()).unwrap();
    for k in ["mismatch_kl_k3", "mismatch_ess", "mismatch_outside_frac"] {
        assert_eq!(r.metrics[k], want[k], "{k}");
    }
    assert!(r.metrics["mismatch_kl_k3"] > 0.0);
    assert!(r.metrics["mismatch_ess"] > 0.0 && r.metrics["mismatch_ess"] < 1.0);
    // A learner with the actor's own weights has no mismatch.
    let same = Trainer::new(config("bapo"), copy(&behaviour), 0).unwrap();
    let m = same.gradients(&gs).unwrap().metrics;
    assert!(m["mismatch_kl_k3"].abs() < 1e-6 && m["mismatch_outside_frac"] == 0.0);
}
