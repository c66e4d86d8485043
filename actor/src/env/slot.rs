//! A slot's engine as the episode loop's [`Model`]: each turn starts from
//! the newest weights the slot has, and the Burn engine takes newer ones
//! mid-turn in partial mode, exactly as a single-turn group does.

use std::sync::{Arc, atomic::AtomicBool};

use bapo_policy::SamplingParams;
use tokio::{runtime::Handle, sync::watch};

use super::episode::{Model, TurnMade};
use crate::{
    generator::{Generated, Generator, Slot},
    subscription::PolicyCell,
    update_mode::UpdateMode,
};

/// One group member's turns.
pub struct SlotModel {
    pub engine: Generator,
    pub cell: PolicyCell,
    pub mode: UpdateMode,
    pub params: SamplingParams,
    /// Mixed into every turn's sampling seed, with the turn.
    pub member: u64,
    pub abort: Arc<AtomicBool>,
    pub abort_rx: watch::Receiver<bool>,
    pub handle: Handle,
}

impl SlotModel {
    fn params(&self, max_new: usize, turn: u32) -> SamplingParams {
        let mut p = self.params.clone();
        p.max_new_tokens = max_new;
        p.seed = crate::seed::fnv1a(&format!("{}-{}-{turn}", self.params.seed, self.member));
        p
    }
}

impl Model for SlotModel {
    fn turn(&mut self, context: &[u32], max_new: usize, turn: u32) -> TurnMade {
        let Some(start) = self.cell.borrow_and_update().clone() else {
            return TurnMade::Skip("no_weights");
        };
        let room = start
            .config()
            .max_position_embeddings
            .saturating_sub(context.len());
        if room == 0 {
            return TurnMade::Skip("context_too_long");
        }
        let params = self.params(max_new.min(room), turn);
        let slot = Slot {
            cell: &mut self.cell,
            mode: self.mode,
            abort: &self.abort,
            abort_rx: &self.abort_rx,
            handle: &self.handle,
        };
        match self.engine.generate(slot, start, context, 1, &params) {
            Generated::Done(mut responses, incarnation) => {
                TurnMade::Turn(responses.remove(0), incarnation)
            }
            Generated::Stopped => TurnMade::Stop,
            Generated::Failed(e) => {
                // As a single-turn group: counted by cause, and while the
                // server is down the slot waits before its next episode.
                let reason = e.settle();
                tracing::warn!("vLLM: {e}; episode dropped");
                TurnMade::Skip(reason)
            }
        }
    }
}
