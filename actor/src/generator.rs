//! What makes a slot's responses: bapo's Burn model in the actor's own
//! process, or a vLLM server. One dispatch for a single-turn group
//! (`run.rs`) and an episode's turn (`env/slot.rs`), so both stop, follow
//! new weights and report an engine's failure alike.

use std::sync::{Arc, atomic::AtomicBool};

use bapo_policy::{Response, SamplingParams};
use tokio::{runtime::Handle, sync::watch};

use crate::{
    rollout::{Outcome, follow_cell, generate},
    subscription::{PolicyCell, Versioned},
    update_mode::UpdateMode,
    vllm,
};

/// The engine of a slot.
#[derive(Clone)]
pub enum Generator {
    /// bapo's model, on the slot's own thread.
    Burn,
    /// A vLLM server (started by the actor or beside it).
    Vllm(Arc<vllm::Client>),
}

/// What a generation needs of its slot: the weights it follows, how it
/// takes new ones, and how it is told to stop.
pub struct Slot<'a> {
    pub cell: &'a mut PolicyCell,
    pub mode: UpdateMode,
    pub abort: &'a Arc<AtomicBool>,
    pub abort_rx: &'a watch::Receiver<bool>,
    pub handle: &'a Handle,
}

/// How a generation ended.
pub enum Generated {
    /// `k` responses, every token made by weights of the incarnation.
    Done(Vec<Response>, u64),
    /// The slot was told to stop; nothing to keep.
    Stopped,
    /// The engine could not make them (vLLM down, or refused).
    Failed(vllm::GenerateError),
}

impl Generator {
    /// `k` responses to `prompt`, from `start` and newer weights as the
    /// mode allows. Blocks the slot's thread.
    pub fn generate(
        &self,
        slot: Slot<'_>,
        start: Arc<Versioned>,
        prompt: &[u32],
        k: usize,
        params: &SamplingParams,
    ) -> Generated {
        let engine = match self {
            Self::Burn => {
                let updates = &mut follow_cell(slot.cell);
                return done(generate(
                    start, updates, prompt, k, params, slot.mode, slot.abort,
                ));
            }
            Self::Vllm(engine) => engine,
        };
        let mut abort = slot.abort_rx.clone();
        let made = slot.handle.block_on(async {
            tokio::select! {
                r = engine.generate(prompt, k, params, slot.abort) => Some(r),
                _ = abort.wait_for(|a| *a) => None,
            }
        });
        match made {
            None => Generated::Stopped,
            Some(Ok(outcome)) => done(outcome),
            Some(Err(e)) => Generated::Failed(e),
        }
    }
}

fn done(outcome: Outcome) -> Generated {
    match outcome {
        Outcome::Done {
            responses,
            incarnation,
        } => Generated::Done(responses, incarnation),
        Outcome::Aborted => Generated::Stopped,
    }
}
