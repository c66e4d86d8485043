//! SPEAR's batch algorithm: its self-imitation memory admits each batch's
//! winners and, once full, adds a replay pass after each epoch's updates.

use std::collections::BTreeMap;

use super::{
    Prepared, Row, TrainError,
    algo::{AlgoState, Batch, BatchAlgo, BatchEnd, Metrics, ReplayPass},
};
use crate::{
    config::LearnerConfig,
    loss::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, registry},
    spear::{GroupStat, Replay, SpearMemory, Stored},
};

/// SPEAR's memory, across batches (saved with every checkpoint).
#[derive(Default)]
pub(crate) struct Spear {
    memory: SpearMemory,
}

impl BatchAlgo for Spear {
    /// The replay set in mini-batches the size of the on-policy ones, and
    /// the replay loss (Clip-Cov with the replay rule, times `c(t)`), when
    /// the memory is full.
    fn replay(
        &mut self,
        b: &Batch<'_>,
        prepared: &[Prepared],
        metrics: &mut Metrics,
    ) -> Result<Option<ReplayPass>, TrainError> {
        let cfg = b.cfg;
        let batch_seqs = prepared.iter().map(|p| p.rows.len()).sum();
        let Some(items) = self.memory.take(&cfg.spear, batch_seqs, b.seed(2)) else {
            return Ok(None);
        };
        metrics.insert("spear_replay_seqs".into(), items.len() as f64);
        let size = prepared.iter().map(|p| p.rows.len()).max().unwrap_or(1);
        let parts = items.chunks(size.max(1)).map(prepare_replay).collect();
        let options = cfg.spear.replay_options(&cfg.loss_options()?);
        let coef = cfg.spear.replay_coef(b.t);
        let loss = Scaled {
            inner: registry::build("spear", &options)?,
            coef,
        };
        Ok(Some((parts, Box::new(loss), coef)))
    }

    /// Admits the batch's winners and records the groups' reward
    /// statistics.
    fn end_batch(&mut self, b: &Batch<'_>, end: BatchEnd<'_>, metrics: &mut Metrics) {
        let cfg = &b.cfg.spear;
        let stats: Vec<GroupStat> = end
            .fresh
            .iter()
            .map(|g| {
                let r: Vec<f64> = g.sequences.iter().map(|s| s.reward as f64).collect();
                GroupStat::of(&r)
            })
            .collect();
        let t = b.t;
        let stored = end
            .prepared
            .iter()
            .flat_map(|p| p.rows.iter().map(move |row| stored(t, p, row)));
        self.memory.admit(cfg, &stats, stored);
        metrics.insert("spear_memory".into(), self.memory.len() as f64);
        metrics.insert("spear_counted".into(), self.memory.counted(cfg) as f64);
    }

    fn entropy_coef(&self, cfg: &LearnerConfig) -> f64 {
        cfg.spear.entropy_coef
    }

    fn save(&self, s: &mut AlgoState) {
        s.spear = Some(self.memory.clone());
    }

    fn restore(&mut self, s: AlgoState) {
        if let Some(m) = s.spear {
            self.memory = m;
        }
    }
}

/// A loss times a constant (SPEAR's replay coefficient).
struct Scaled {
    inner: Box<dyn PolicyLoss>,
    coef: f64,
}

impl PolicyLoss for Scaled {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn aggregation(&self) -> Aggregation {
        self.inner.aggregation()
    }

    fn compute(&self, batch: &TokenBatch, d: &Denominators) -> LossOutput {
        let mut out = self.inner.compute(batch, d);
        out.loss *= self.coef;
        out.grad.iter_mut().for_each(|g| *g *= self.coef);
        out.metrics.insert("spear_replay_coef".into(), self.coef);
        out
    }
}

/// A trained row as SPEAR stores it.
fn stored(t: u64, p: &Prepared, row: &Row) -> Stored {
    let split = row.start + 1;
    Stored {
        batch: t,
        reward: row.reward,
        advantage: p.skel.advantages[row.offset],
        prompt: row.tokens[..split].to_vec(),
        response: row.tokens[split..].to_vec(),
        logp_old: p.skel.logp_old[row.offset..row.offset + row.len]
            .iter()
            .map(|&x| x as f32)
            .collect(),
        mask: p.skel.mask[row.offset..row.offset + row.len].to_vec(),
    }
}

/// Replayed trajectories laid out like a prepared batch: their stored
/// `lp_old` anchors the ratio, their recalibrated advantage weighs it.
fn prepare_replay(items: &[Replay]) -> Prepared {
    let mut rows = Vec::new();
    let mut skel = TokenBatch::default();
    for (i, r) in items.iter().enumerate() {
        let s = &r.stored;
        rows.push(Row {
            tokens: s.prompt.iter().chain(&s.response).copied().collect(),
            reward: s.reward,
            start: s.prompt.len().saturating_sub(1),
            len: s.response.len(),
            offset: skel.advantages.len(),
        });
        for (j, &lp) in s.logp_old.iter().enumerate() {
            skel.advantages.push(r.advantage);
            skel.logp_old.push(lp as f64);
            skel.mask.push(s.mask.get(j).copied().unwrap_or(true));
            skel.seq_ids.push(i as u32);
        }
    }
    let n = items.len().max(1) as f64;
    let reward = items.iter().map(|r| r.stored.reward as f64).sum::<f64>() / n;
    let metrics = BTreeMap::from([("spear_replay_reward_mean".to_string(), reward)]);
    Prepared {
        rows,
        skel,
        metrics,
    }
}
