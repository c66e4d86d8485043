//! What SPEAR and ReMix add to a batch: ReMix's replayed share and its
//! frozen policies, SPEAR's replay pass and admission, and the state both
//! keep across batches (saved with every checkpoint).

use std::{borrow::Cow, collections::BTreeMap};

use bapo_policy::{burn::module::Module, model::Transformer};
use serde::{Deserialize, Serialize};

use super::{Prepared, Row, TrainError, Trainer};
use crate::{
    loss::{Aggregation, Denominators, LossOutput, PolicyLoss, TokenBatch, registry},
    remix::{RemixConfig, RemixMemory},
    rollouts::TrainGroup,
    spear::{GroupStat, Replay, SpearMemory, Stored},
};

/// ReMix's state: the replay memory and the frozen policies of its
/// KL-Convex penalty.
pub(crate) struct RemixRun {
    pub(crate) memory: RemixMemory,
    /// `π_base`: the initial policy, `π_T` after reincarnation.
    pub(crate) base: Transformer,
    /// `π_{k−1}`: the policy at the start of the previous batch.
    pub(crate) previous: Option<Transformer>,
}

impl RemixRun {
    pub(crate) fn new(base: Transformer) -> Self {
        Self {
            memory: RemixMemory::default(),
            base,
            previous: None,
        }
    }

    /// `β λ(t) KL(π_θ‖π_base) + β (1 − λ(t)) KL(π_θ‖π_{k−1})`, the terms
    /// with a positive weight.
    pub(crate) fn kl_terms(
        &self,
        cfg: &RemixConfig,
        t: u64,
    ) -> Vec<(&Transformer, f64, &'static str)> {
        let lambda = cfg.lambda(t);
        let mut v = vec![(&self.base, cfg.kl_coef * lambda, "kl_base_k3")];
        if let Some(prev) = &self.previous {
            v.push((prev, cfg.kl_coef * (1.0 - lambda), "kl_prev_k3"));
        }
        v.retain(|(_, coef, _)| *coef > 0.0);
        v
    }
}

/// What a checkpoint keeps of SPEAR and ReMix besides frozen weights.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AlgoState {
    pub batches: u64,
    pub spear: Option<SpearMemory>,
    pub remix: Option<RemixMemory>,
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

/// SPEAR's replay: its mini-batches, their loss and its coefficient `c(t)`.
pub(super) type ReplayPass = (Vec<Prepared>, Box<dyn PolicyLoss>, f64);

/// A seed per batch and purpose, from the learner's seed.
fn seed(base: u64, t: u64, salt: u64) -> u64 {
    base ^ t.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt
}

impl Trainer {
    /// The groups batch `t` trains on: `fresh`, plus ReMix's replayed
    /// share.
    pub(super) fn mix_in_replay<'a>(
        &self,
        t: u64,
        fresh: &'a [TrainGroup],
        metrics: &mut BTreeMap<String, f64>,
    ) -> Cow<'a, [TrainGroup]> {
        let Some(remix) = &self.remix else {
            return Cow::Borrowed(fresh);
        };
        let cfg = &self.cfg.remix;
        let mixed = remix.memory.mix(cfg, t, fresh, seed(self.cfg.seed, t, 1));
        metrics.insert("remix_lambda".into(), cfg.lambda(t));
        metrics.insert("remix_replayed_groups".into(), mixed.replayed as f64);
        metrics.insert(
            "remix_reincarnated".into(),
            cfg.reincarnated(t) as u8 as f64,
        );
        Cow::Owned(mixed.groups)
    }

    /// SPEAR's replay pass of batch `t`, when its memory is full: the
    /// replay set in mini-batches the size of the on-policy ones, and the
    /// replay loss (Clip-Cov with the replay rule, times `c(t)`).
    pub(super) fn spear_replay(
        &mut self,
        t: u64,
        prepared: &[Prepared],
        metrics: &mut BTreeMap<String, f64>,
    ) -> Result<Option<ReplayPass>, TrainError> {
        let Some(memory) = self.spear.as_mut() else {
            return Ok(None);
        };
        let batch_seqs = prepared.iter().map(|p| p.rows.len()).sum();
        let Some(items) = memory.take(&self.cfg.spear, batch_seqs, seed(self.cfg.seed, t, 2))
        else {
            return Ok(None);
        };
        metrics.insert("spear_replay_seqs".into(), items.len() as f64);
        let size = prepared.iter().map(|p| p.rows.len()).max().unwrap_or(1);
        let parts = items.chunks(size.max(1)).map(prepare_replay).collect();
        let options = self.cfg.spear.replay_options(&self.cfg.loss_options()?);
        let coef = self.cfg.spear.replay_coef(t);
        let loss = Scaled {
            inner: registry::build("spear", &options)?,
            coef,
        };
        Ok(Some((parts, Box::new(loss), coef)))
    }

    /// After batch `t`'s updates: SPEAR admits its winners and records the
    /// groups' reward statistics; ReMix remembers the fresh groups, keeps
    /// `start` as `π_{k−1}` and reincarnates after batch `T`.
    pub(super) fn end_batch(
        &mut self,
        t: u64,
        fresh: &[TrainGroup],
        prepared: &[Prepared],
        start: Option<Transformer>,
        metrics: &mut BTreeMap<String, f64>,
    ) {
        if let Some(memory) = self.spear.as_mut() {
            let stats: Vec<GroupStat> = fresh
                .iter()
                .map(|g| {
                    let r: Vec<f64> = g.sequences.iter().map(|s| s.reward as f64).collect();
                    GroupStat::of(&r)
                })
                .collect();
            let stored = prepared
                .iter()
                .flat_map(|p| p.rows.iter().map(move |row| stored(t, p, row)));
            memory.admit(&self.cfg.spear, &stats, stored);
            metrics.insert("spear_memory".into(), memory.len() as f64);
            metrics.insert(
                "spear_counted".into(),
                memory.counted(&self.cfg.spear) as f64,
            );
        }
        if let Some(remix) = self.remix.as_mut() {
            let cfg = &self.cfg.remix;
            remix.memory.remember(cfg, t, fresh);
            remix.previous = start;
            if cfg.reincarnated(t + 1) && !cfg.reincarnated(t) {
                remix.base = self.model.valid();
                tracing::info!(batch = t + 1, "ReMix: reincarnated, π_base is now π_T");
            }
        }
    }

    /// What a checkpoint must keep for SPEAR and ReMix to resume exactly.
    pub fn algo_state(&self) -> AlgoState {
        AlgoState {
            batches: self.batches,
            spear: self.spear.clone(),
            remix: self.remix.as_ref().map(|r| r.memory.clone()),
        }
    }

    /// Continues from a checkpoint's [`AlgoState`]; memories of another
    /// algorithm are ignored. A memory holding what a step could not
    /// train on is refused by name: read back from disk, it skipped the
    /// checks fresh batches get, and every resume would meet it again.
    pub fn restore_algo_state(&mut self, s: AlgoState) -> Result<(), TrainError> {
        let (vocab, max_len) = (
            self.model_config.vocab_size,
            self.model_config.max_position_embeddings,
        );
        let spear = s.spear.as_ref().map(|m| m.check(vocab, max_len));
        let remix = s.remix.as_ref().map(|m| m.check(vocab, max_len));
        for checked in [spear, remix].into_iter().flatten() {
            checked.map_err(TrainError::ReplayState)?;
        }
        self.batches = s.batches;
        if let (Some(m), Some(saved)) = (self.spear.as_mut(), s.spear) {
            *m = saved;
        }
        if let (Some(r), Some(saved)) = (self.remix.as_mut(), s.remix) {
            r.memory = saved;
        }
        Ok(())
    }

    /// The frozen policies this run keeps, by file stem: the KL reference,
    /// ReMix's `π_base` and `π_{k−1}`. Under LoRA the reference is the
    /// base, which the checkpoint holds anyway.
    pub fn frozen(&self) -> Vec<(&'static str, Transformer)> {
        let mut v = Vec::new();
        if let Some(r) = self.reference.as_ref().filter(|_| self.cfg.lora.is_none()) {
            v.push(("reference", r.clone()));
        }
        if let Some(remix) = &self.remix {
            v.push(("remix-base", remix.base.clone()));
            if let Some(p) = &remix.previous {
                v.push(("remix-previous", p.clone()));
            }
        }
        v
    }

    /// The frozen policies a restored run expects (`remix-previous` only
    /// exists after a first batch).
    pub fn frozen_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.reference.is_some() && self.cfg.lora.is_none() {
            v.push("reference");
        }
        if self.remix.is_some() {
            v.extend(["remix-base", "remix-previous"]);
        }
        v
    }

    /// Restores frozen policy `name` from a checkpoint; false for a name
    /// this run does not keep.
    pub fn set_frozen(&mut self, name: &str, model: Transformer) -> bool {
        match (name, self.remix.as_mut()) {
            ("reference", _) if self.reference.is_some() => self.reference = Some(model),
            ("remix-base", Some(r)) => r.base = model,
            ("remix-previous", Some(r)) => r.previous = Some(model),
            _ => return false,
        }
        true
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
