//! Groups off the wire, decoded into what a training step needs. The buffer
//! validated them already; this still refuses anything it cannot train on
//! (naming the rollout), because a learner must not crash on one bad group.

use bapo_proto::{packed, v1};
use serde::{Deserialize, Serialize};

/// One response with its prompt, as trained on. A multi-turn episode's
/// response holds the policy's turns and the environment's observations
/// between them, told apart by `mask`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub prompt: Vec<u32>,
    pub response: Vec<u32>,
    /// `lp_behav` of each response token.
    pub behavior_logprobs: Vec<f32>,
    /// Policy version that produced each response token.
    pub versions: Vec<u32>,
    pub reward: f32,
    /// Whether each response token is the policy's (trained on) or an
    /// environment's (context only: no loss, no statistics); empty: every
    /// token is the policy's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mask: Vec<bool>,
    /// The turn of each response token; empty: one turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<u32>,
    /// The token budget ran out before a stop token.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

impl Sequence {
    /// Whether response token `j` is the policy's.
    pub fn is_policy_token(&self, j: usize) -> bool {
        self.mask.get(j).copied().unwrap_or(true)
    }

    /// What [`TrainGroup::from_wire`] checks, and the model's limits: for
    /// a sequence that did not come off the wire (a replay memory read
    /// back from a checkpoint), so that a bad one is refused by name
    /// instead of indexing out of bounds mid-step.
    pub fn check(&self, vocab: usize, max_len: usize) -> Result<(), String> {
        self.check_shape()?;
        let per_token = |len: usize| len == 0 || len == self.response.len();
        if !per_token(self.mask.len()) || !per_token(self.turns.len()) {
            return Err(format!(
                "{} response tokens but a mask or turn ids of another length",
                self.response.len()
            ));
        }
        if self.behavior_logprobs.iter().any(|x| !x.is_finite()) {
            return Err("a log-prob that is not finite".into());
        }
        check_tokens(&self.prompt, &self.response, vocab, max_len)
    }

    /// The rules every sequence meets, off the wire or not: a prompt and
    /// a response, a log-prob and a version per response token, a finite
    /// reward.
    fn check_shape(&self) -> Result<(), String> {
        let n = self.response.len();
        if self.prompt.is_empty() || n == 0 {
            return Err("empty prompt or response".into());
        }
        if self.behavior_logprobs.len() != n || self.versions.len() != n {
            return Err(format!(
                "{n} response tokens but {} log-probs and {} versions",
                self.behavior_logprobs.len(),
                self.versions.len()
            ));
        }
        if !self.reward.is_finite() {
            return Err(format!("reward {} is not finite", self.reward));
        }
        Ok(())
    }
}

/// Token ids inside the vocabulary, and no more than `max_len` of them.
pub fn check_tokens(
    prompt: &[u32],
    response: &[u32],
    vocab: usize,
    max_len: usize,
) -> Result<(), String> {
    if let Some(id) = prompt
        .iter()
        .chain(response)
        .find(|&&t| t as usize >= vocab)
    {
        return Err(format!("token id {id} is outside the vocabulary ({vocab})"));
    }
    let len = prompt.len() + response.len();
    if len > max_len {
        return Err(format!(
            "{len} tokens, more than the model's {max_len} positions"
        ));
    }
    Ok(())
}

/// The responses to one prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainGroup {
    pub group_id: String,
    pub sequences: Vec<Sequence>,
    /// The buffer's consumption-order position.
    pub sequence_number: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("group {group_id}, rollout {rollout_id}: {message}")]
pub struct RolloutError {
    pub group_id: String,
    pub rollout_id: String,
    pub message: String,
}

impl TrainGroup {
    pub fn from_wire(g: &v1::Group) -> Result<Self, RolloutError> {
        let sequences = g
            .rollouts
            .iter()
            .map(|r| {
                let err = |message: String| RolloutError {
                    group_id: g.group_id.clone(),
                    rollout_id: r.rollout_id.clone(),
                    message,
                };
                let prompt = packed::unpack_u32(&r.prompt_tokens)
                    .map_err(|e| err(format!("prompt_tokens: {e}")))?;
                let response = packed::unpack_u32(&r.response_tokens)
                    .map_err(|e| err(format!("response_tokens: {e}")))?;
                let behavior_logprobs = packed::unpack_f32(&r.behavior_logprobs)
                    .map_err(|e| err(format!("behavior_logprobs: {e}")))?;
                let versions = packed::unpack_u32(&r.token_versions)
                    .map_err(|e| err(format!("token_versions: {e}")))?;
                let s = Sequence {
                    prompt,
                    response,
                    behavior_logprobs,
                    versions,
                    reward: r.reward,
                    truncated: r.finish_reason() == v1::FinishReason::Length,
                    ..Default::default()
                };
                s.check_shape().map_err(err)?;
                let (mask, turns) = turns_of(r, s.response.len()).map_err(err)?;
                Ok(Sequence { mask, turns, ..s })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            group_id: g.group_id.clone(),
            sequences,
            sequence_number: g.sequence,
        })
    }

    /// `learner_version − oldest policy token's version` per sequence
    /// (observation tokens carry their turn's version anyway).
    pub fn staleness(&self, learner_version: u64) -> impl Iterator<Item = u64> + '_ {
        self.sequences.iter().map(move |s| {
            let oldest = s.versions.iter().copied().min().unwrap_or(0) as u64;
            learner_version.saturating_sub(oldest)
        })
    }
}

/// The loss mask and turn ids of a rollout of `n` response tokens: each
/// empty or one per token, the mask of 0s and 1s with at least one 1.
fn turns_of(r: &v1::Rollout, n: usize) -> Result<(Vec<bool>, Vec<u32>), String> {
    let m = &r.loss_mask;
    if !m.is_empty() && (m.len() != n || m.iter().any(|&b| b > 1) || !m.contains(&1)) {
        return Err(format!(
            "loss_mask must be empty or {n} bytes of 0 or 1 with at least one 1"
        ));
    }
    let turns = packed::unpack_u32(&r.turn_ids).map_err(|e| format!("turn_ids: {e}"))?;
    if !turns.is_empty() && turns.len() != n {
        return Err(format!("{n} response tokens but {} turn ids", turns.len()));
    }
    Ok((m.iter().map(|&b| b == 1).collect(), turns))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rollout(id: &str, resp: &[u32], lps: &[f32]) -> v1::Rollout {
        v1::Rollout {
            rollout_id: id.into(),
            group_id: "g".into(),
            prompt_tokens: packed::pack_u32(&[1, 2]),
            response_tokens: packed::pack_u32(resp),
            behavior_logprobs: packed::pack_f32(lps),
            token_versions: packed::pack_u32(&vec![3; resp.len()]),
            reward: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn decodes_and_measures_staleness() {
        let g = v1::Group {
            group_id: "g".into(),
            rollouts: vec![rollout("a", &[5, 6], &[-0.1, -0.2])],
            sequence: 9,
            ..Default::default()
        };
        let t = TrainGroup::from_wire(&g).unwrap();
        assert_eq!(t.sequences[0].response, vec![5, 6]);
        assert_eq!(t.staleness(7).collect::<Vec<_>>(), vec![4]);
    }

    #[test]
    fn an_episode_keeps_its_mask_and_turns() {
        let mut r = rollout("e", &[5, 6, 7], &[-0.1, 0.0, -0.2]);
        r.loss_mask = vec![1u8, 0, 1].into();
        r.turn_ids = packed::pack_u32(&[0, 0, 1]);
        let g = v1::Group {
            group_id: "g".into(),
            rollouts: vec![r.clone()],
            ..Default::default()
        };
        let s = &TrainGroup::from_wire(&g).unwrap().sequences[0];
        assert_eq!(s.mask, [true, false, true]);
        assert_eq!(s.turns, [0, 0, 1]);
        assert!(!s.is_policy_token(1) && s.is_policy_token(2));
        r.loss_mask = vec![1u8, 0].into();
        let g = v1::Group {
            rollouts: vec![r],
            ..g
        };
        let e = TrainGroup::from_wire(&g).unwrap_err().to_string();
        assert!(e.contains("loss_mask"), "{e}");
    }

    #[test]
    fn ragged_rollout_is_refused_by_name() {
        let g = v1::Group {
            group_id: "g".into(),
            rollouts: vec![rollout("bad", &[5, 6], &[-0.1])],
            ..Default::default()
        };
        let e = TrainGroup::from_wire(&g).unwrap_err().to_string();
        assert!(
            e.contains("rollout bad") && e.contains("2 response tokens"),
            "{e}"
        );
    }
}
