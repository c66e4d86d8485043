//! The buffer's own rollout type: what the core stores, independent of the
//! wire.
//!
//! Per-token arrays are kept in their packed wire layout (`Bytes`, 4 bytes
//! per value, see `bapo_proto::packed`): handing a group to the learner then
//! clones reference counts instead of payload, in FIFO and replay modes
//! alike. Per-token versions are kept as runs, because a response has one
//! version per weight update it lived through, not one per token.

use std::collections::HashMap;

use bapo_proto::packed;
use bytes::Bytes;

/// Why a response stopped (mirrors `bapo.v1.FinishReason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FinishReason {
    #[default]
    Unspecified,
    Stop,
    Length,
    Aborted,
}

/// Per-token policy versions as runs: `(first token index, version)`, in
/// token order, each run's version differing from the previous one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VersionRuns {
    runs: Vec<(u32, u64)>,
    len: u32,
}

impl VersionRuns {
    pub fn from_tokens(versions: &[u64]) -> Self {
        Self::from_iter(versions.iter().copied())
    }

    /// From a packed u32 field (its length already checked).
    pub fn from_packed(b: &[u8]) -> Self {
        // Most responses have a single version: the array then equals
        // itself shifted by one value, which one memcmp tells.
        if b.len() >= 4 && b[4..] == b[..b.len() - 4] {
            let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            return Self {
                runs: vec![(0, u64::from(v))],
                len: (b.len() / 4) as u32,
            };
        }
        Self::from_iter(packed::u32s(b).map(u64::from))
    }

    fn from_iter(versions: impl Iterator<Item = u64>) -> Self {
        let mut runs: Vec<(u32, u64)> = Vec::with_capacity(2);
        let mut len = 0u32;
        for v in versions {
            if runs.last().is_none_or(|&(_, last)| last != v) {
                runs.push((len, v));
            }
            len += 1;
        }
        Self { runs, len }
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn oldest(&self) -> Option<u64> {
        self.runs.iter().map(|&(_, v)| v).min()
    }

    pub fn newest(&self) -> Option<u64> {
        self.runs.iter().map(|&(_, v)| v).max()
    }

    /// Number of distinct version segments (2+ means a partial rollout).
    pub fn segments(&self) -> usize {
        self.runs.len()
    }

    /// One version per token again, for the wire.
    pub fn expand(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        for (k, &(start, v)) in self.runs.iter().enumerate() {
            let end = self.runs.get(k + 1).map_or(self.len, |&(s, _)| s);
            out.extend(std::iter::repeat_n(v, (end - start) as usize));
        }
        out
    }

    /// Packed u32 LE, one value per token, for the wire. Versions beyond
    /// u32 never reach the store (validation bounds them by the learner's).
    pub fn to_packed(&self) -> Bytes {
        let mut out = vec![0u8; self.len() * 4];
        for (k, &(start, v)) in self.runs.iter().enumerate() {
            let end = self.runs.get(k + 1).map_or(self.len, |&(s, _)| s);
            let bytes = (v as u32).to_le_bytes();
            for chunk in out[start as usize * 4..end as usize * 4].chunks_exact_mut(4) {
                chunk.copy_from_slice(&bytes);
            }
        }
        out.into()
    }

    fn heap_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<(u32, u64)>()
    }
}

/// Sampling settings a rollout was generated with (`bapo.v1.SamplingParams`),
/// kept so the learner can refuse data sampled at another temperature.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
}

/// One scored response, as the buffer holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    pub id: String,
    pub group_id: String,
    /// u32 LE; shared between the members of a group with the same prompt.
    pub prompt_tokens: Bytes,
    /// u32 LE.
    pub response_tokens: Bytes,
    /// f32 LE.
    pub behavior_logprobs: Bytes,
    pub versions: VersionRuns,
    pub reward: f32,
    /// f32 LE, empty or one per response token.
    pub token_rewards: Bytes,
    /// One byte per response token, 1 the policy's and 0 an environment's
    /// (multi-turn); empty: every token is the policy's.
    pub loss_mask: Bytes,
    /// u32 LE, the turn of each response token; empty: one turn.
    pub turn_ids: Bytes,
    pub finish_reason: FinishReason,
    pub actor_id: String,
    pub task: String,
    pub metadata: HashMap<String, String>,
    /// The learner incarnation whose weights produced the tokens; 0 when not
    /// recorded (judged by version only).
    pub learner_incarnation: u64,
    pub sampling: Option<Sampling>,
}

impl Rollout {
    /// Heap bytes this rollout keeps alive, not counting a prompt it shares
    /// with an earlier member of its group.
    pub fn heap_bytes(&self, count_prompt: bool) -> usize {
        let prompt = if count_prompt {
            self.prompt_tokens.len()
        } else {
            0
        };
        let meta: usize = self
            .metadata
            .iter()
            .map(|(k, v)| k.capacity() + v.capacity() + 3 * std::mem::size_of::<usize>())
            .sum();
        std::mem::size_of::<Self>()
            + self.id.capacity()
            + self.group_id.capacity()
            + prompt
            + self.response_tokens.len()
            + self.behavior_logprobs.len()
            + self.versions.heap_bytes()
            + self.token_rewards.len()
            + self.loss_mask.len()
            + self.turn_ids.len()
            + self.actor_id.capacity()
            + self.task.capacity()
            + meta
    }

    pub fn oldest_version(&self) -> u64 {
        self.versions.oldest().unwrap_or(0)
    }

    pub fn newest_version(&self) -> u64 {
        self.versions.newest().unwrap_or(0)
    }

    /// Response length in tokens.
    pub fn len(&self) -> usize {
        self.response_tokens.len() / 4
    }

    pub fn is_empty(&self) -> bool {
        self.response_tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_runs_round_trip() {
        for v in [
            vec![],
            vec![3],
            vec![1, 1, 1],
            vec![1, 1, 2, 2, 2, 5],
            vec![4, 3, 3, 4],
        ] {
            let runs = VersionRuns::from_tokens(&v);
            assert_eq!(runs.expand(), v);
            let packed = runs.to_packed();
            assert_eq!(VersionRuns::from_packed(&packed), runs);
            assert_eq!(runs.len(), v.len());
            assert_eq!(runs.oldest(), v.iter().copied().min());
            assert_eq!(runs.newest(), v.iter().copied().max());
        }
        assert_eq!(VersionRuns::from_tokens(&[1, 1, 2, 2]).segments(), 2);
    }
}
