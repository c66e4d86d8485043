//! The policy of bapo: a Llama/Qwen2-family transformer in Burn, sampling
//! and batched KV-cache generation, the tokenizer, HF weight loading, tasks
//! and their verifiers, and held-out evaluation.
//!
//! Actors sample from this model and the learner trains it; both compute
//! log-probs of the same temperature-scaled distribution (`logprob.rs`).

pub mod cache;
pub mod config;
pub mod denormals;
pub mod evaluate;
pub mod generate;
pub mod hf;
pub mod kernels;
pub mod logprob;
pub mod model;
pub mod policy;
pub mod rope;
pub mod sampling;
pub mod spec;
pub mod tasks;
pub mod tokenizer;
pub mod weights;

pub use burn;
pub use config::ModelConfig;
pub use generate::{Finish, Generation, Response};
pub use policy::Policy;
pub use sampling::SamplingParams;
pub use spec::ModelSpec;
