//! The sampleable groups, in consumption order, with an index by age so that
//! finding the stale ones costs O(stale · log n) rather than a scan of the
//! whole backlog on every batch (a 45 000-group backlog made each scan cost
//! milliseconds of cache misses).

use std::{
    collections::{BTreeSet, VecDeque},
    sync::Arc,
};

use rand::rngs::SmallRng;

use crate::{eviction, group::ReadyGroup, sampler::Sampler};

pub struct ReadyStore {
    /// Oldest (lowest sequence) first, with use counts.
    groups: VecDeque<(Arc<ReadyGroup>, u32)>,
    /// `(oldest token version, sequence)` of every group in `groups`.
    by_age: BTreeSet<(u64, u64)>,
    /// Sequence number the next ready group gets.
    pub next_sequence: u64,
    sampler: Box<dyn Sampler>,
    rng: SmallRng,
}

impl ReadyStore {
    pub fn new(sampler: Box<dyn Sampler>, rng: SmallRng) -> Self {
        Self {
            groups: VecDeque::new(),
            by_age: BTreeSet::new(),
            next_sequence: 0,
            sampler,
            rng,
        }
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Appends a group; sequences must increase.
    pub fn push(&mut self, group: Arc<ReadyGroup>, uses: u32) {
        debug_assert!(
            self.groups
                .back()
                .is_none_or(|(g, _)| g.sequence < group.sequence),
            "ready groups are appended in sequence order"
        );
        self.by_age.insert((group.oldest_version, group.sequence));
        self.groups.push_back((group, uses));
    }

    pub fn pop_oldest(&mut self) -> Option<Arc<ReadyGroup>> {
        let (g, _) = self.groups.pop_front()?;
        self.by_age.remove(&(g.oldest_version, g.sequence));
        Some(g)
    }

    pub fn remove_at(&mut self, i: usize) -> Option<Arc<ReadyGroup>> {
        let (g, _) = self.groups.remove(i)?;
        self.by_age.remove(&(g.oldest_version, g.sequence));
        Some(g)
    }

    /// Removes and returns every group beyond `max_staleness` at `version`.
    pub fn take_stale(&mut self, version: u64, max_staleness: u64) -> Vec<Arc<ReadyGroup>> {
        let mut out = Vec::new();
        while let Some(&(oldest, seq)) = self.by_age.first()
            && eviction::is_stale(version, oldest, max_staleness)
        {
            self.by_age.pop_first();
            if let Ok(i) = self.groups.binary_search_by_key(&seq, |(g, _)| g.sequence)
                && let Some((g, _)) = self.groups.remove(i)
            {
                out.push(g);
            }
        }
        out
    }

    /// Removes and returns every group `pred` selects, in one pass (for
    /// rare whole-store decisions: a learner rollback).
    pub fn take_where(
        &mut self,
        mut pred: impl FnMut(&ReadyGroup) -> bool,
    ) -> Vec<Arc<ReadyGroup>> {
        let mut out = Vec::new();
        let by_age = &mut self.by_age;
        self.groups.retain(|(g, _)| {
            let keep = !pred(g);
            if !keep {
                by_age.remove(&(g.oldest_version, g.sequence));
                out.push(g.clone());
            }
            keep
        });
        out
    }

    /// Positions of `n` distinct groups chosen by the sampler.
    pub fn pick(&mut self, n: usize) -> Vec<usize> {
        self.sampler.pick(self.groups.len(), n, &mut self.rng)
    }

    /// Counts one more use of the group at `i`; returns it and its uses.
    pub fn use_at(&mut self, i: usize) -> (Arc<ReadyGroup>, u32) {
        let (g, uses) = &mut self.groups[i];
        *uses += 1;
        (g.clone(), *uses)
    }

    pub fn uses_at(&self, i: usize) -> u32 {
        self.groups[i].1
    }

    pub fn iter(&self) -> impl Iterator<Item = &(Arc<ReadyGroup>, u32)> {
        self.groups.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Fifo;
    use rand::SeedableRng;

    fn group(seq: u64, oldest: u64) -> Arc<ReadyGroup> {
        Arc::new(ReadyGroup {
            id: format!("g{seq}"),
            members: vec![],
            oldest_version: oldest,
            sequence: seq,
            bytes: 0,
        })
    }

    #[test]
    fn stale_groups_are_found_by_age_in_any_order() {
        let mut r = ReadyStore::new(Box::new(Fifo), SmallRng::seed_from_u64(0));
        for (seq, oldest) in [(0, 5), (1, 2), (2, 9), (3, 3), (4, 7)] {
            r.push(group(seq, oldest), 0);
        }
        // version 10, max 6: oldest < 4 is stale -> sequences 1 and 3.
        let mut stale: Vec<u64> = r.take_stale(10, 6).iter().map(|g| g.sequence).collect();
        stale.sort();
        assert_eq!(stale, [1, 3]);
        let left: Vec<u64> = r.iter().map(|(g, _)| g.sequence).collect();
        assert_eq!(left, [0, 2, 4]);
        assert_eq!(r.pop_oldest().unwrap().sequence, 0);
        assert_eq!(r.remove_at(1).unwrap().sequence, 4);
        r.push(group(5, 1), 0);
        assert!(
            r.take_where(|g| g.sequence == 5)
                .iter()
                .map(|g| g.sequence)
                .eq([5])
        );
        assert!(r.take_stale(100, 0).iter().map(|g| g.sequence).eq([2]));
        assert!(r.is_empty());
    }
}
