//! bapo actors: stateless workers that turn prompts into scored groups.
//!
//! An actor follows the learner's weight stream ([`subscription`]),
//! generates K responses per prompt on several threads ([`rollout`]),
//! scores them with the task's verifier or a reward service ([`reward`]),
//! and pushes each group to the
//! buffer ([`push`]), waiting whenever the buffer holds it back. Before
//! generating a group it leases room for it ([`lease`]), so the buffer's
//! staleness bound holds it back before it generates, not after. The
//! responses come from bapo's own Burn model or from a vLLM server
//! ([`vllm`]). With an environment ([`env`]) each rollout is a multi-turn
//! episode: the model's turns and the environment's answers, the answers
//! masked from the loss.

pub mod backoff;
pub mod config;
pub mod env;
pub mod generator;
pub mod grpc_endpoint;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod push;
pub mod reward;
pub mod rollout;
pub mod run;
pub mod seed;
pub mod stop;
pub mod subscription;
pub mod update_mode;
pub mod vllm;

pub use config::{ActorConfig, EngineKind, UpdateMode};
pub use run::{ActorOptions, ActorSummary, run};
