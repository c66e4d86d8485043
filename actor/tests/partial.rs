//! Partial rollouts: new weights mid-generation. One response's tokens
//! carry two versions, and each recorded log-prob is the one the weights
//! that produced the token assign (recomputed from scratch here).

use std::sync::{Arc, atomic::AtomicBool};

use bapo_actor::{
    UpdateMode,
    rollout::{Outcome, generate},
    subscription::Versioned,
};
use bapo_policy::{Policy, SamplingParams, burn::prelude::*};

/// Random weights of `seed`, made on the CPU and moved to `device`.
fn policy(seed: u64, device: &Device) -> Policy {
    let p = bapo_policy::testing::tiny_policy(seed);
    Policy::with_model(p.config, p.model.to_device(device), device)
}

/// Log-prob of every response token under `p`, in one full forward pass.
fn recomputed(p: &Policy, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let row: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let (lp, _) = p.token_logprobs(Policy::tokens(&[row], &p.device()), 1.0);
    let lp: Vec<f32> = lp.into_data().convert::<f32>().try_into_vec().unwrap();
    lp[prompt.len() - 1..].to_vec()
}

type Run = (
    Vec<bapo_policy::Response>,
    u64,
    Arc<Versioned>,
    Arc<Versioned>,
);

/// Generates from weights v1 (incarnation 10) and switches to v2 of
/// `v2_incarnation` after `switch_at` tokens.
fn run_with(mode: UpdateMode, switch_at: usize, v2_incarnation: u64) -> Run {
    run_on(mode, switch_at, v2_incarnation, &Device::flex())
}

fn run_on(mode: UpdateMode, switch_at: usize, v2_incarnation: u64, device: &Device) -> Run {
    let v1 = Arc::new(Versioned::new(1, 10, policy(1, device)));
    let v2 = Arc::new(Versioned::new(2, v2_incarnation, policy(2, device)));
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 10,
        seed: 7,
        ..Default::default()
    };
    let mut calls = 0;
    let next = v2.clone();
    let mut updates = move || {
        calls += 1;
        (calls == switch_at + 1).then(|| next.clone())
    };
    let out = generate(
        v1.clone(),
        &mut updates,
        &[5, 6, 7],
        3,
        &params,
        mode,
        &AtomicBool::new(false),
    );
    let Outcome::Done {
        responses,
        incarnation,
    } = out
    else {
        panic!("not aborted")
    };
    (responses, incarnation, v1, v2)
}

fn run(
    mode: UpdateMode,
    switch_at: usize,
) -> (Vec<bapo_policy::Response>, Arc<Versioned>, Arc<Versioned>) {
    let (responses, incarnation, v1, v2) = run_with(mode, switch_at, 10);
    assert_eq!(incarnation, 10);
    (responses, v1, v2)
}

#[test]
fn partial_mode_records_each_tokens_version_and_its_log_prob() {
    partial_mode_on(&Device::flex());
}

/// The same weight swap mid-generation on wgpu: the cache dropped and
/// rebuilt on the device, and each token's recorded log-prob read back
/// from it.
#[test]
fn partial_mode_swaps_weights_mid_generation_on_wgpu() {
    if let Some(device) = bapo_policy::device::wgpu_for_test("partial rollout on wgpu") {
        partial_mode_on(&device);
    }
}

fn partial_mode_on(device: &Device) {
    let switch_at = 4;
    let (responses, incarnation, v1, v2) = run_on(UpdateMode::Partial, switch_at, 10, device);
    assert_eq!(incarnation, 10);
    for r in &responses {
        assert_eq!(r.tokens.len(), 10);
        assert_eq!(&r.versions[..switch_at], &[1; 4]);
        assert!(
            r.versions[switch_at..].iter().all(|&v| v == 2),
            "{:?}",
            r.versions
        );
        let old = recomputed(v1.policy().unwrap(), &[5, 6, 7], &r.tokens);
        let new = recomputed(v2.policy().unwrap(), &[5, 6, 7], &r.tokens);
        for (t, &lp) in r.logprobs.iter().enumerate() {
            let want = if t < switch_at { old[t] } else { new[t] };
            assert!(
                (lp - want).abs() < 1e-4,
                "token {t} (v{}): recorded {lp}, weights that produced it say {want}",
                r.versions[t]
            );
        }
        // The two policies really differ on these tokens.
        assert!((old[switch_at] - new[switch_at]).abs() > 1e-3);
    }
}

#[test]
fn restart_mode_regenerates_with_the_new_weights_only() {
    let (responses, _, v2) = run(UpdateMode::Restart, 4);
    for r in &responses {
        assert!(r.versions.iter().all(|&v| v == 2), "{:?}", r.versions);
        let want = recomputed(v2.policy().unwrap(), &[5, 6, 7], &r.tokens);
        for (lp, w) in r.logprobs.iter().zip(&want) {
            assert!((lp - w).abs() < 1e-4);
        }
    }
}

/// A resumed learner reuses version numbers for other weights: a partial
/// rollout must not continue across incarnations, whatever the mode.
#[test]
fn weights_of_a_new_incarnation_restart_a_partial_rollout() {
    let (responses, incarnation, _, v2) = run_with(UpdateMode::Partial, 4, 11);
    assert_eq!(
        incarnation, 11,
        "the group is labelled with the new incarnation"
    );
    for r in &responses {
        assert!(r.versions.iter().all(|&v| v == 2), "{:?}", r.versions);
        let want = recomputed(v2.policy().unwrap(), &[5, 6, 7], &r.tokens);
        for (lp, w) in r.logprobs.iter().zip(&want) {
            assert!((lp - w).abs() < 1e-4);
        }
    }
}
