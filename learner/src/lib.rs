//! The bapo learner: advantages, the BAPO loss and the baselines it is
//! compared with, the optimiser, checkpoints and weight broadcast.
//!
//! Training lands with the learner issue; the crate fixes its place in the
//! dependency graph (it needs the wire types and the policy, nothing else).
