//! bapo actors: stateless workers that turn prompts into scored groups of
//! rollouts with the current policy and stream them to the buffer service.
//!
//! Generation lands with the actor issue; the crate fixes its place in the
//! dependency graph (it needs the wire types and the policy, nothing else).
