//! The policy of bapo: a Llama/Qwen2-family transformer in Burn, its
//! tokenizer, sampling, and the tasks and verifiers that score its output.
//!
//! Actors sample from this model and the learner trains it, so both compute
//! log-probs of exactly the same distribution. The model lands with the
//! policy-model issue; until then the crate only fixes its place in the
//! dependency graph (proto <- policy <- actor, learner).
