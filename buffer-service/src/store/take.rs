//! Handing groups to the learner (the sampler's pick, replay uses, the
//! rate limiter) and the gauges that follow every change.

use super::*;

impl Inner {
    /// Takes a batch if one may be taken now. `Err(ready)` when not enough
    /// groups are ready (or the rate limiter says wait).
    pub(super) fn try_take(&self, n: usize, partial: bool) -> Result<Vec<SampledGroup>, usize> {
        let version = self.version.load(Relaxed);
        let mut ready = self.ready.lock();
        self.evict_stale_ready(&mut ready, version);
        let avail = ready.len();
        let k = if avail >= n {
            n
        } else if partial {
            avail
        } else {
            return Err(avail);
        };
        if k == 0 {
            return Ok(Vec::new());
        }
        let mut ledger = self.ledger.lock();
        if let Some(rl) = &self.limiter
            && !rl.can_sample(&ledger, k as u64)
        {
            return Err(avail);
        }
        let mut picks = ready.pick(k);
        let mut out = Vec::with_capacity(k);
        let mut uses = Vec::with_capacity(k);
        for &i in &picks {
            let (group, use_count) = ready.use_at(i);
            uses.push(walpb::GroupUse {
                group_id: group.id.clone(),
                use_count,
            });
            let staleness = eviction::staleness(version, group.oldest_version);
            self.metrics.staleness.record(staleness as f64);
            self.metrics.reuse.record(use_count as f64);
            out.push(SampledGroup {
                group,
                staleness,
                use_count,
            });
        }
        // Retire groups that reached their last use, highest index first so
        // the remaining indices stay valid.
        picks.sort_unstable_by(|a, b| b.cmp(a));
        let mut consumed = 0u64;
        for i in picks {
            if ready.uses_at(i) >= self.uses_per_group {
                let g = ready.remove_at(i).expect("picked index is in range");
                self.bytes.fetch_sub(g.bytes, Relaxed);
                consumed += 1;
            }
        }
        ledger.samples += k as u64;
        ledger.consumed += consumed;
        ledger.held -= consumed;
        drop(ledger);
        self.log(Kind::Sampled(walpb::Sampled { uses }));
        drop(ready);
        self.counters.samples.fetch_add(k as u64, Relaxed);
        self.metrics.samples.increment(k as u64);
        self.metrics.consumed.increment(consumed);
        self.publish_gauges();
        Ok(out)
    }

    pub(super) fn publish_gauges(&self) {
        let version = self.version.load(Relaxed);
        let ready = self.ready.lock().len();
        let limit = self.bound.limit(&self.ledger.lock(), version);
        let h = &self.metrics;
        h.pending.set(self.pending.load(Relaxed) as f64);
        h.ready.set(ready as f64);
        h.bytes.set(self.bytes.load(Relaxed) as f64);
        h.version.set(version as f64);
        h.admission_limit.set(limit as f64);
        h.lost_to_rollback
            .set(self.learner.read().lost_to_rollback as f64);
    }
}
