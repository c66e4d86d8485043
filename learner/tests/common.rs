//! Small groups made with the real tiny model, shared by the learner tests.

#![allow(dead_code)]

use bapo_learner::{LearnerConfig, TrainGroup, rollouts::Sequence};
use bapo_policy::Policy;

#[allow(unused_imports)] // not every test binary uses it
pub use bapo_policy::testing::tiny_policy;

/// Log-probs of `response` after `prompt` under `policy`.
pub fn logprobs(policy: &Policy, prompt: &[u32], response: &[u32]) -> Vec<f32> {
    let row: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let (lp, _) = policy.token_logprobs(Policy::tokens(&[row], &policy.device()), 1.0);
    let lp: Vec<f32> = lp.into_data().convert::<f32>().try_into_vec().unwrap();
    lp[prompt.len() - 1..].to_vec()
}

/// A group of 4 responses to one prompt: the two containing token 10 are
/// rewarded. Behaviour log-probs come from `behaviour` (a stale policy).
pub fn group(behaviour: &Policy, id: u32, version: u32) -> TrainGroup {
    let prompt = vec![1, 2 + id % 5, 3];
    let responses: [(&[u32], f32); 4] = [
        (&[10, 10, 4], 1.0),
        (&[20, 21, 4], 0.0),
        (&[10, 22, 4], 1.0),
        (&[23, 20, 4], 0.0),
    ];
    TrainGroup {
        group_id: format!("g{id}"),
        sequence_number: id as u64,
        sequences: responses
            .iter()
            .map(|(r, reward)| Sequence {
                prompt: prompt.clone(),
                response: r.to_vec(),
                behavior_logprobs: logprobs(behaviour, &prompt, r),
                versions: vec![version; r.len()],
                reward: *reward,
                ..Default::default()
            })
            .collect(),
    }
}

pub fn config(algo: &str) -> LearnerConfig {
    LearnerConfig {
        algo: algo.into(),
        lr: 1e-3,
        batch_groups: 4,
        ..Default::default()
    }
}
