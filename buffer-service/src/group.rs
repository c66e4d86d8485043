//! A group's life: pending while its K members arrive, ready once complete
//! (or timed out with enough members), and afterwards a tombstone that only
//! remembers member ids, so a re-sent rollout is recognised as a duplicate
//! and a late one is refused instead of starting a second group of that id.

use std::{sync::Arc, time::Instant};

#[cfg(test)]
use bapo_proto::packed::{pack_f32, pack_u32};

use crate::rollout::Rollout;

/// A group still collecting members.
#[derive(Debug)]
pub struct PendingGroup {
    pub members: Vec<Rollout>,
    pub created: Instant,
    pub bytes: u64,
    pub oldest_version: u64,
    /// The verified identity whose lease this group redeemed: only it may
    /// add members. None for a group pushed without a lease, leased
    /// unauthenticated, or replayed after a restart (leases are not
    /// logged).
    pub holder: Option<String>,
}

impl PendingGroup {
    pub fn new(first: Rollout, created: Instant) -> Self {
        let bytes = first.heap_bytes(true) as u64;
        let oldest_version = first.oldest_version();
        Self {
            members: vec![first],
            created,
            bytes,
            oldest_version,
            holder: None,
        }
    }

    pub fn contains(&self, rollout_id: &str) -> bool {
        self.members.iter().any(|m| m.id == rollout_id)
    }

    /// Adds a member and returns the bytes it added. Members usually carry
    /// the same prompt: they then share one copy.
    pub fn add(&mut self, mut r: Rollout) -> u64 {
        let shared = self
            .members
            .first()
            .is_some_and(|f| f.prompt_tokens == r.prompt_tokens);
        if shared {
            r.prompt_tokens = self.members[0].prompt_tokens.clone();
        }
        let bytes = r.heap_bytes(!shared) as u64;
        self.oldest_version = self.oldest_version.min(r.oldest_version());
        self.bytes += bytes;
        self.members.push(r);
        bytes
    }

    pub fn member_ids(&self) -> Vec<String> {
        self.members.iter().map(|m| m.id.clone()).collect()
    }
}

/// A sampleable group. Immutable once made; shared between the ready store
/// and batches in flight.
#[derive(Debug)]
pub struct ReadyGroup {
    pub id: String,
    pub members: Vec<Rollout>,
    pub oldest_version: u64,
    /// Place in the buffer's consumption order.
    pub sequence: u64,
    pub bytes: u64,
}

/// What the buffer remembers under a group id.
#[derive(Debug)]
pub enum GroupEntry {
    Pending(PendingGroup),
    /// Ready, handed out or evicted: only the member ids remain here.
    Sealed(Vec<String>),
}

impl GroupEntry {
    /// Turns a pending group into its tombstone and returns the group;
    /// `None` when already sealed.
    pub fn seal(&mut self) -> Option<PendingGroup> {
        let GroupEntry::Pending(p) = self else {
            return None;
        };
        let ids = p.member_ids();
        match std::mem::replace(self, GroupEntry::Sealed(ids)) {
            GroupEntry::Pending(p) => Some(p),
            GroupEntry::Sealed(_) => None,
        }
    }
}

/// A group handed to the learner.
#[derive(Debug, Clone)]
pub struct SampledGroup {
    pub group: Arc<ReadyGroup>,
    pub staleness: u64,
    /// Times handed out, this time included.
    pub use_count: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{FinishReason, VersionRuns};

    fn r(id: &str, prompt: Vec<u32>, versions: &[u64]) -> Rollout {
        Rollout {
            id: id.into(),
            group_id: "g".into(),
            prompt_tokens: pack_u32(&prompt),
            response_tokens: pack_u32(&vec![1; versions.len()]),
            behavior_logprobs: pack_f32(&vec![-1.0; versions.len()]),
            versions: VersionRuns::from_tokens(versions),
            reward: 0.0,
            token_rewards: Default::default(),
            loss_mask: Default::default(),
            turn_ids: Default::default(),
            finish_reason: FinishReason::Stop,
            actor_id: String::new(),
            task: String::new(),
            metadata: Default::default(),
            learner_incarnation: 0,
            sampling: None,
        }
    }

    #[test]
    fn members_share_an_equal_prompt_and_track_the_oldest_version() {
        let mut g = PendingGroup::new(r("a", vec![7; 100], &[5, 5]), Instant::now());
        let first = g.bytes;
        let added = g.add(r("b", vec![7; 100], &[3, 4]));
        let ptr = |g: &PendingGroup, i: usize| g.members[i].prompt_tokens.as_ptr();
        assert_eq!(ptr(&g, 0), ptr(&g, 1));
        assert_eq!(first - added, 400, "the shared prompt is counted once");
        g.add(r("c", vec![8; 100], &[6]));
        assert_ne!(ptr(&g, 0), ptr(&g, 2));
        assert_eq!(g.oldest_version, 3);
        assert!(g.contains("b") && !g.contains("z"));
    }
}
