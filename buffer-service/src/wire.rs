//! Translation between `bapo.v1` messages and the core's types. Vectors are
//! moved, not copied; the only per-token work is folding versions into runs
//! on the way in and unfolding them on the way out.

use bapo_proto::v1;

use crate::rollout::{FinishReason, Rollout, VersionRuns};

impl From<v1::FinishReason> for FinishReason {
    fn from(f: v1::FinishReason) -> Self {
        match f {
            v1::FinishReason::Unspecified => FinishReason::Unspecified,
            v1::FinishReason::Stop => FinishReason::Stop,
            v1::FinishReason::Length => FinishReason::Length,
            v1::FinishReason::Aborted => FinishReason::Aborted,
        }
    }
}

impl From<FinishReason> for v1::FinishReason {
    fn from(f: FinishReason) -> Self {
        match f {
            FinishReason::Unspecified => v1::FinishReason::Unspecified,
            FinishReason::Stop => v1::FinishReason::Stop,
            FinishReason::Length => v1::FinishReason::Length,
            FinishReason::Aborted => v1::FinishReason::Aborted,
        }
    }
}

/// Moves a decoded rollout into the core type. An unknown finish-reason
/// number (a newer client) becomes `Unspecified` rather than an error.
pub fn rollout_from_wire(r: v1::Rollout) -> Rollout {
    let finish_reason = v1::FinishReason::try_from(r.finish_reason)
        .unwrap_or(v1::FinishReason::Unspecified)
        .into();
    Rollout {
        versions: VersionRuns::from_tokens(&r.token_versions),
        id: r.rollout_id,
        group_id: r.group_id,
        prompt_tokens: r.prompt_tokens.into(),
        response_tokens: r.response_tokens,
        behavior_logprobs: r.behavior_logprobs,
        reward: r.reward,
        token_rewards: r.token_rewards,
        finish_reason,
        actor_id: r.actor_id,
        task: r.task,
        metadata: r.metadata,
    }
}

/// Moves a core rollout onto the wire.
pub fn rollout_to_wire(r: Rollout) -> v1::Rollout {
    v1::Rollout {
        token_versions: r.versions.expand(),
        rollout_id: r.id,
        group_id: r.group_id,
        prompt_tokens: r.prompt_tokens.to_vec(),
        response_tokens: r.response_tokens,
        behavior_logprobs: r.behavior_logprobs,
        reward: r.reward,
        token_rewards: r.token_rewards,
        finish_reason: v1::FinishReason::from(r.finish_reason) as i32,
        actor_id: r.actor_id,
        task: r.task,
        metadata: r.metadata,
    }
}

/// Copies a shared core rollout onto the wire (replay modes keep the group).
pub fn rollout_to_wire_ref(r: &Rollout) -> v1::Rollout {
    v1::Rollout {
        rollout_id: r.id.clone(),
        group_id: r.group_id.clone(),
        prompt_tokens: r.prompt_tokens.to_vec(),
        response_tokens: r.response_tokens.clone(),
        behavior_logprobs: r.behavior_logprobs.clone(),
        token_versions: r.versions.expand(),
        reward: r.reward,
        token_rewards: r.token_rewards.clone(),
        finish_reason: v1::FinishReason::from(r.finish_reason) as i32,
        actor_id: r.actor_id.clone(),
        task: r.task.clone(),
        metadata: r.metadata.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_every_field() {
        let w = v1::Rollout {
            rollout_id: "r".into(),
            group_id: "g".into(),
            prompt_tokens: vec![1, 2],
            response_tokens: vec![3, 4, 5],
            behavior_logprobs: vec![-0.1, -0.2, -0.3],
            token_versions: vec![1, 1, 2],
            reward: 0.5,
            token_rewards: vec![0.0, 0.0, 0.5],
            finish_reason: v1::FinishReason::Length as i32,
            actor_id: "a".into(),
            task: "t".into(),
            metadata: [("k".to_string(), "v".to_string())].into(),
        };
        let core = rollout_from_wire(w.clone());
        assert_eq!(core.finish_reason, FinishReason::Length);
        assert_eq!(rollout_to_wire_ref(&core), w);
        assert_eq!(rollout_to_wire(core), w);
    }
}
