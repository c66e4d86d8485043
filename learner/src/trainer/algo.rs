//! What an algorithm adds to a batch besides its loss: ReMix mixes replayed
//! groups in and keeps frozen policies, SPEAR follows each epoch with a
//! replay pass. The trainer holds one [`BatchAlgo`], chosen by `algo`, and
//! calls its hooks; a new such algorithm is a new type here, not new
//! branches in the trainer.

use std::{borrow::Cow, collections::BTreeMap};

use bapo_policy::model::Transformer;
use serde::{Deserialize, Serialize};

use super::{Prepared, TrainError};
use crate::{
    config::LearnerConfig, loss::PolicyLoss, remix::RemixMemory, rollouts::TrainGroup,
    spear::SpearMemory,
};

pub(crate) type Metrics = BTreeMap<String, f64>;

/// A replay pass: its mini-batches, their loss and its coefficient.
pub(crate) type ReplayPass = (Vec<Prepared>, Box<dyn PolicyLoss>, f64);

/// The batch a hook is called for.
pub(crate) struct Batch<'a> {
    pub cfg: &'a LearnerConfig,
    /// Batches done before this one: the algorithms' clock.
    pub t: u64,
}

impl Batch<'_> {
    /// A seed for this batch and `salt`, from the learner's seed.
    pub fn seed(&self, salt: u64) -> u64 {
        self.cfg.seed ^ self.t.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt
    }
}

/// What a batch left, for [`BatchAlgo::end_batch`].
pub(crate) struct BatchEnd<'a> {
    pub fresh: &'a [TrainGroup],
    pub prepared: &'a [Prepared],
    /// The policy before the batch (when [`BatchAlgo::keeps_start`]).
    pub start: Option<Transformer>,
    /// The policy after it.
    pub current: &'a dyn Fn() -> Transformer,
}

pub(crate) trait BatchAlgo: Send + Sync {
    /// The groups the batch trains on.
    fn mix_in<'g>(
        &self,
        _: &Batch<'_>,
        fresh: &'g [TrainGroup],
        _: &mut Metrics,
    ) -> Cow<'g, [TrainGroup]> {
        Cow::Borrowed(fresh)
    }

    /// Whether [`BatchAlgo::end_batch`] wants the policy of the batch's
    /// start (a copy of the weights).
    fn keeps_start(&self) -> bool {
        false
    }

    /// A pass to follow each epoch's updates.
    fn replay(
        &mut self,
        _: &Batch<'_>,
        _: &[Prepared],
        _: &mut Metrics,
    ) -> Result<Option<ReplayPass>, TrainError> {
        Ok(None)
    }

    /// After the batch's updates.
    fn end_batch(&mut self, _: &Batch<'_>, _: BatchEnd<'_>, _: &mut Metrics) {}

    /// The entropy bonus's coefficient.
    fn entropy_coef(&self, cfg: &LearnerConfig) -> f64 {
        cfg.entropy_coef
    }

    /// KL penalties beyond `kl_coef`'s: (frozen policy, coefficient,
    /// metric name).
    fn kl_terms(&self, _: &Batch<'_>) -> Vec<(&Transformer, f64, &'static str)> {
        Vec::new()
    }

    /// Its memory, into a checkpoint's state.
    fn save(&self, _: &mut AlgoState) {}

    /// Continues from a checkpoint's state (another algorithm's memory is
    /// ignored).
    fn restore(&mut self, _: AlgoState) {}

    /// Frozen policies it keeps, by file stem.
    fn frozen(&self) -> Vec<(&'static str, Transformer)> {
        Vec::new()
    }

    /// The frozen policies a restored run expects.
    fn frozen_names(&self) -> &'static [&'static str] {
        &[]
    }

    /// Restores frozen policy `name`; false for one it does not keep.
    fn set_frozen(&mut self, _: &str, _: Transformer) -> bool {
        false
    }
}

/// What a checkpoint keeps of SPEAR and ReMix besides frozen weights.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AlgoState {
    pub batches: u64,
    pub spear: Option<SpearMemory>,
    pub remix: Option<RemixMemory>,
}

/// An algorithm that is its loss alone.
pub(crate) struct Plain;

impl BatchAlgo for Plain {}

impl super::Trainer {
    /// What a checkpoint must keep for SPEAR and ReMix to resume exactly.
    pub fn algo_state(&self) -> AlgoState {
        let mut s = AlgoState {
            batches: self.batches,
            ..AlgoState::default()
        };
        self.algo.save(&mut s);
        s
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
        // Another algorithm's memory is checked too: a checkpoint is
        // refused whole, not in parts.
        let check = |m: Result<(), String>| m.map_err(TrainError::ReplayState);
        check(s.spear.as_ref().map_or(Ok(()), |m| m.check(vocab, max_len)))?;
        check(s.remix.as_ref().map_or(Ok(()), |m| m.check(vocab, max_len)))?;
        self.batches = s.batches;
        self.algo.restore(s);
        Ok(())
    }

    /// The frozen policies this run keeps, by file stem: the KL reference
    /// and the algorithm's own. Under LoRA the reference is the base,
    /// which the checkpoint holds anyway.
    pub fn frozen(&self) -> Vec<(&'static str, Transformer)> {
        let mut v = Vec::new();
        if let Some(r) = self.reference.as_ref().filter(|_| self.cfg.lora.is_none()) {
            v.push(("reference", r.clone()));
        }
        v.extend(self.algo.frozen());
        v
    }

    /// The frozen policies a restored run expects (`remix-previous` only
    /// exists after a first batch).
    pub fn frozen_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.reference.is_some() && self.cfg.lora.is_none() {
            v.push("reference");
        }
        v.extend(self.algo.frozen_names());
        v
    }

    /// Restores frozen policy `name` from a checkpoint; false for a name
    /// this run does not keep.
    pub fn set_frozen(&mut self, name: &str, model: Transformer) -> bool {
        if name == "reference" && self.reference.is_some() {
            self.reference = Some(model);
            return true;
        }
        self.algo.set_frozen(name, model)
    }
}
