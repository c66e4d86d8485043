//! Translation between `bapo.v1` messages and the core's types.
//!
//! Inbound, the packed per-token arrays are copied once, into one
//! right-sized allocation per rollout: a `Bytes` sliced from the receive
//! buffer would pin that whole buffer (other messages' bytes included) for
//! as long as the group stays in the store. Outbound, arrays are shared by
//! reference count; only per-token versions are unfolded from their runs.

use bapo_proto::{packed, v1};
use bytes::{BufMut, Bytes, BytesMut};

use crate::{
    rollout::{FinishReason, Rollout, Sampling, VersionRuns},
    validate::{RejectCode, Rejection},
};

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

/// Reads a decoded rollout into the core type. Fails, naming the field, when
/// a packed array is not a whole number of 4-byte values. An unknown
/// finish-reason number (a newer client) becomes `Unspecified`.
pub fn rollout_from_wire(r: v1::Rollout) -> Result<Rollout, Rejection> {
    let fields = [
        ("prompt_tokens", &r.prompt_tokens),
        ("response_tokens", &r.response_tokens),
        ("behavior_logprobs", &r.behavior_logprobs),
        ("token_versions", &r.token_versions),
        ("token_rewards", &r.token_rewards),
        ("turn_ids", &r.turn_ids),
    ];
    for (name, b) in fields {
        if let Err(e) = packed::count(b) {
            return Err(Rejection::for_ids(
                &r.rollout_id,
                &r.group_id,
                RejectCode::InvalidArgument,
                "malformed_array",
                format!("{name}: {e}"),
            ));
        }
    }
    let finish_reason = v1::FinishReason::try_from(r.finish_reason)
        .unwrap_or(v1::FinishReason::Unspecified)
        .into();
    let total = r.prompt_tokens.len()
        + r.response_tokens.len()
        + r.behavior_logprobs.len()
        + r.token_rewards.len()
        + r.loss_mask.len()
        + r.turn_ids.len();
    let mut buf = BytesMut::with_capacity(total);
    let mut take = |b: &Bytes| {
        buf.put_slice(b);
        buf.split().freeze()
    };
    Ok(Rollout {
        prompt_tokens: take(&r.prompt_tokens),
        response_tokens: take(&r.response_tokens),
        behavior_logprobs: take(&r.behavior_logprobs),
        token_rewards: take(&r.token_rewards),
        loss_mask: take(&r.loss_mask),
        turn_ids: take(&r.turn_ids),
        versions: VersionRuns::from_packed(&r.token_versions),
        id: r.rollout_id,
        group_id: r.group_id,
        reward: r.reward,
        finish_reason,
        actor_id: r.actor_id,
        task: r.task,
        metadata: r.metadata,
        learner_incarnation: r.learner_incarnation,
        sampling: r.sampling.map(|s| Sampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
        }),
    })
}

/// Puts a stored rollout on the wire; arrays are shared, not copied.
pub fn rollout_to_wire(r: &Rollout) -> v1::Rollout {
    v1::Rollout {
        rollout_id: r.id.clone(),
        group_id: r.group_id.clone(),
        prompt_tokens: r.prompt_tokens.clone(),
        response_tokens: r.response_tokens.clone(),
        behavior_logprobs: r.behavior_logprobs.clone(),
        token_versions: r.versions.to_packed(),
        reward: r.reward,
        token_rewards: r.token_rewards.clone(),
        loss_mask: r.loss_mask.clone(),
        turn_ids: r.turn_ids.clone(),
        finish_reason: v1::FinishReason::from(r.finish_reason) as i32,
        actor_id: r.actor_id.clone(),
        task: r.task.clone(),
        metadata: r.metadata.clone(),
        learner_incarnation: r.learner_incarnation,
        sampling: r.sampling.map(|s| v1::SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use packed::{pack_f32, pack_u32};

    #[test]
    fn round_trip_keeps_every_field() {
        let w = v1::Rollout {
            rollout_id: "r".into(),
            group_id: "g".into(),
            prompt_tokens: pack_u32(&[1, 2]),
            response_tokens: pack_u32(&[3, 4, 5]),
            behavior_logprobs: pack_f32(&[-0.1, -0.2, -0.3]),
            token_versions: pack_u32(&[1, 1, 2]),
            reward: 0.5,
            token_rewards: pack_f32(&[0.0, 0.0, 0.5]),
            loss_mask: vec![1u8, 0, 1].into(),
            turn_ids: pack_u32(&[0, 0, 1]),
            finish_reason: v1::FinishReason::Length as i32,
            actor_id: "a".into(),
            task: "t".into(),
            metadata: [("k".to_string(), "v".to_string())].into(),
            learner_incarnation: 0xfeed,
            sampling: Some(v1::SamplingParams {
                temperature: 0.7,
                top_k: 0,
                top_p: 1.0,
            }),
        };
        let core = rollout_from_wire(w.clone()).unwrap();
        assert_eq!(core.finish_reason, FinishReason::Length);
        assert_eq!(core.len(), 3);
        assert_eq!(core.versions.segments(), 2);
        assert_eq!(rollout_to_wire(&core), w);
    }

    #[test]
    fn ragged_arrays_are_named() {
        let w = v1::Rollout {
            rollout_id: "r".into(),
            group_id: "g".into(),
            response_tokens: Bytes::from_static(&[1, 2, 3, 4]),
            token_versions: Bytes::from_static(&[1, 2, 3]),
            ..Default::default()
        };
        let e = rollout_from_wire(w).unwrap_err();
        assert_eq!(e.label, "malformed_array");
        assert!(e.reason.contains("token_versions: 3 bytes"), "{}", e.reason);
    }
}
