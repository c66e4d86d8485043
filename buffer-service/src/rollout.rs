//! The buffer's own rollout type: what the core stores, independent of the
//! wire. The service moves decoded vectors in (no copy), and per-token
//! versions are kept as runs because a response has one version per weight
//! update it lived through, not one per token.

use std::{collections::HashMap, sync::Arc};

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
        let mut runs: Vec<(u32, u64)> = Vec::with_capacity(2);
        for (i, &v) in versions.iter().enumerate() {
            if runs.last().is_none_or(|&(_, last)| last != v) {
                runs.push((i as u32, v));
            }
        }
        Self {
            runs,
            len: versions.len() as u32,
        }
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

    fn heap_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<(u32, u64)>()
    }
}

/// One scored response, as the buffer holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    pub id: String,
    pub group_id: String,
    /// Shared between the members of a group when they carry the same prompt.
    pub prompt_tokens: Arc<[u32]>,
    pub response_tokens: Vec<u32>,
    pub behavior_logprobs: Vec<f32>,
    pub versions: VersionRuns,
    pub reward: f32,
    pub token_rewards: Vec<f32>,
    pub finish_reason: FinishReason,
    pub actor_id: String,
    pub task: String,
    pub metadata: HashMap<String, String>,
}

impl Rollout {
    /// Heap bytes this rollout keeps alive, not counting a prompt it shares
    /// with an earlier member of its group.
    pub fn heap_bytes(&self, count_prompt: bool) -> usize {
        let prompt = if count_prompt {
            self.prompt_tokens.len() * 4
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
            + self.response_tokens.capacity() * 4
            + self.behavior_logprobs.capacity() * 4
            + self.versions.heap_bytes()
            + self.token_rewards.capacity() * 4
            + self.actor_id.capacity()
            + self.task.capacity()
            + meta
    }

    pub fn oldest_version(&self) -> u64 {
        self.versions.oldest().unwrap_or(0)
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
            assert_eq!(runs.len(), v.len());
            assert_eq!(runs.oldest(), v.iter().copied().min());
            assert_eq!(runs.newest(), v.iter().copied().max());
        }
        assert_eq!(VersionRuns::from_tokens(&[1, 1, 2, 2]).segments(), 2);
    }
}
