//! The policy of bapo: a Llama/Qwen2-family transformer in Burn, sampling
//! and batched KV-cache generation, the tokenizer and chat templates, HF
//! weight loading, and held-out evaluation of a policy on a task (`bapo-tasks`).
//!
//! Actors sample from this model and the learner trains it; both compute
//! log-probs of the same temperature-scaled distribution (`logprob.rs`).

pub mod adapters;
pub mod cache;
pub mod chat;
pub mod config;
pub mod delta;
pub mod denormals;
pub mod device;
pub mod evaluate;
pub mod generate;
pub mod hf;
pub mod hf_layout;
pub mod hf_patch;
pub mod kernels;
pub mod logprob;
pub mod lora;
pub mod model;
pub mod packing;
pub mod peft;
pub mod policy;
pub mod rope;
pub mod sampling;
pub mod spec;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use burn;
pub use config::ModelConfig;
pub use device::{ComputeDevice, Precision};
pub use generate::{Finish, Generation, Response};
pub use policy::Policy;
pub use sampling::SamplingParams;
pub use spec::ModelSpec;

/// This crate's directory, for tests that read its files. Taken at run time
/// (cargo sets it for tests): the compile-time value goes stale when a
/// shared target dir built the same sources in another checkout, since
/// cargo does not rebuild a test because its workspace moved.
#[cfg(test)]
pub(crate) fn crate_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        std::path::PathBuf::from,
    )
}
