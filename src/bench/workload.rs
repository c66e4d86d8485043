//! What both sides of `bapo bench buffer` move and measure: the shape of a
//! phase, the synthetic rollout payload (and a group of it as wire
//! rollouts), and a phase's result. Imported by the bapo side (`buffer`,
//! `actors`) and the Redis side (`redis_streams`) alike.

use bapo_proto::{
    packed::{pack_f32, pack_u32},
    v1,
};
use bytes::Bytes;
use rand::{Rng, SeedableRng, rngs::SmallRng};

use super::latency::Latencies;

/// The shape of a measured phase, the same on both sides.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Concurrent producers, one connection each.
    pub pushers: usize,
    /// Seconds per measured phase.
    pub seconds: f64,
    /// Response tokens per rollout.
    pub tokens: usize,
    /// Rollouts per group.
    pub group_size: u32,
    /// Groups per learner batch.
    pub batch_groups: u32,
}

/// One synthetic rollout payload: what an actor would send.
#[derive(Clone)]
pub struct Payload {
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub(super) packed: [Bytes; 3],
}

impl Payload {
    /// Token ids over a Qwen2-sized vocabulary, log-probs of a sampled
    /// distribution (mostly near 0, some far below).
    pub fn new(tokens: usize, seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let prompt: Vec<u32> = (0..64).map(|_| rng.random_range(0..151_936)).collect();
        let tokens: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..151_936)).collect();
        let logprobs: Vec<f32> = (0..tokens.len())
            .map(|_| -(rng.random::<f32>().powi(4) * 12.0))
            .collect();
        let packed = [pack_u32(&prompt), pack_u32(&tokens), pack_f32(&logprobs)];
        Self {
            prompt,
            tokens,
            logprobs,
            packed,
        }
    }

    /// Token ids, log-probs and versions at 4 bytes each: the payload both
    /// sides move.
    /// `k` rollouts of group `group`, every token of learner `version`
    /// of `incarnation` (0: not recorded), rewards alternating 0 and 1.
    pub fn group(&self, group: &str, k: u32, version: u64, incarnation: u64) -> Vec<v1::Rollout> {
        let versions = pack_u32(&vec![version as u32; self.tokens.len()]);
        (0..k)
            .map(|i| v1::Rollout {
                rollout_id: format!("{group}-{i}"),
                group_id: group.to_string(),
                prompt_tokens: self.packed[0].clone(),
                response_tokens: self.packed[1].clone(),
                behavior_logprobs: self.packed[2].clone(),
                token_versions: versions.clone(),
                reward: (i % 2) as f32,
                finish_reason: v1::FinishReason::Stop as i32,
                actor_id: "bench".into(),
                task: "bench".into(),
                learner_incarnation: incarnation,
                ..Default::default()
            })
            .collect()
    }

    pub fn raw_bytes(&self) -> usize {
        self.tokens.len() * 12
    }
}

/// What one measured phase achieved.
pub struct Phase {
    pub rollouts: u64,
    pub seconds: f64,
    pub acks: Latencies,
    pub consumed_rollouts: u64,
}

impl Phase {
    pub fn rate(&self) -> f64 {
        self.rollouts as f64 / self.seconds
    }
}
