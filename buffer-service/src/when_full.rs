//! What a full buffer does with a new group (`when_full`): a small type
//! chosen by configuration, as Reverb's remover is, so the admission path
//! asks it instead of branching on the setting.

use std::sync::Arc;

use crate::{config::FullPolicy, group::ReadyGroup, ready::ReadyStore};

pub trait WhenFull: Send + Sync {
    /// Takes a ready group out to make room (the caller evicts it as
    /// `capacity`), or `None`: the new group waits for room.
    fn make_room(&self, ready: &mut ReadyStore) -> Option<Arc<ReadyGroup>>;
}

/// Holds the pusher until the learner frees room: nothing accepted is lost.
pub struct Block;

impl WhenFull for Block {
    fn make_room(&self, _: &mut ReadyStore) -> Option<Arc<ReadyGroup>> {
        None
    }
}

/// Evicts the oldest ready group: fresh data wins over old.
pub struct DropOldest;

impl WhenFull for DropOldest {
    fn make_room(&self, ready: &mut ReadyStore) -> Option<Arc<ReadyGroup>> {
        ready.pop_oldest()
    }
}

pub fn from_config(policy: FullPolicy) -> Box<dyn WhenFull> {
    match policy {
        FullPolicy::Block => Box::new(Block),
        FullPolicy::DropOldest => Box::new(DropOldest),
    }
}
