//! ReMix's batch algorithm: replayed groups mixed into each batch, the
//! frozen policies of its KL-Convex penalty, and reincarnation.

use std::borrow::Cow;

use bapo_policy::model::Transformer;

use super::algo::{AlgoState, Batch, BatchAlgo, BatchEnd, Metrics};
use crate::{config::LearnerConfig, remix::RemixMemory, rollouts::TrainGroup};

/// ReMix's state: the replay memory and the frozen policies.
pub(crate) struct RemixRun {
    memory: RemixMemory,
    /// `π_base`: the initial policy, `π_T` after reincarnation.
    base: Transformer,
    /// `π_{k−1}`: the policy at the start of the previous batch.
    previous: Option<Transformer>,
}

impl RemixRun {
    pub(crate) fn new(base: Transformer) -> Self {
        Self {
            memory: RemixMemory::default(),
            base,
            previous: None,
        }
    }
}

impl BatchAlgo for RemixRun {
    /// `fresh` plus the replayed share.
    fn mix_in<'g>(
        &self,
        b: &Batch<'_>,
        fresh: &'g [TrainGroup],
        metrics: &mut Metrics,
    ) -> Cow<'g, [TrainGroup]> {
        let (cfg, t) = (&b.cfg.remix, b.t);
        let mixed = self.memory.mix(cfg, t, fresh, b.seed(1));
        metrics.insert("remix_lambda".into(), cfg.lambda(t));
        metrics.insert("remix_replayed_groups".into(), mixed.replayed as f64);
        metrics.insert(
            "remix_reincarnated".into(),
            cfg.reincarnated(t) as u8 as f64,
        );
        Cow::Owned(mixed.groups)
    }

    fn keeps_start(&self) -> bool {
        true
    }

    /// Remembers the fresh groups, keeps the batch's start as `π_{k−1}`
    /// and reincarnates after batch `T`.
    fn end_batch(&mut self, b: &Batch<'_>, end: BatchEnd<'_>, _: &mut Metrics) {
        let (cfg, t) = (&b.cfg.remix, b.t);
        self.memory.remember(cfg, t, end.fresh);
        self.previous = end.start;
        if cfg.reincarnated(t + 1) && !cfg.reincarnated(t) {
            self.base = (end.current)();
            tracing::info!(batch = t + 1, "ReMix: reincarnated, π_base is now π_T");
        }
    }

    fn entropy_coef(&self, cfg: &LearnerConfig) -> f64 {
        cfg.remix.entropy_coef
    }

    /// `β λ(t) KL(π_θ‖π_base) + β (1 − λ(t)) KL(π_θ‖π_{k−1})`, the terms
    /// with a positive weight.
    fn kl_terms(&self, b: &Batch<'_>) -> Vec<(&Transformer, f64, &'static str)> {
        let cfg = &b.cfg.remix;
        let lambda = cfg.lambda(b.t);
        let mut v = vec![(&self.base, cfg.kl_coef * lambda, "kl_base_k3")];
        if let Some(prev) = &self.previous {
            v.push((prev, cfg.kl_coef * (1.0 - lambda), "kl_prev_k3"));
        }
        v.retain(|(_, coef, _)| *coef > 0.0);
        v
    }

    fn save(&self, s: &mut AlgoState) {
        s.remix = Some(self.memory.clone());
    }

    fn restore(&mut self, s: AlgoState) {
        if let Some(m) = s.remix {
            self.memory = m;
        }
    }

    fn frozen(&self) -> Vec<(&'static str, Transformer)> {
        let mut v = vec![("remix-base", self.base.clone())];
        if let Some(p) = &self.previous {
            v.push(("remix-previous", p.clone()));
        }
        v
    }

    fn frozen_names(&self) -> &'static [&'static str] {
        &["remix-base", "remix-previous"]
    }

    fn set_frozen(&mut self, name: &str, model: Transformer) -> bool {
        match name {
            "remix-base" => self.base = model,
            "remix-previous" => self.previous = Some(model),
            _ => return false,
        }
        true
    }
}
