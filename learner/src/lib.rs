//! The bapo learner: advantages, the BAPO loss and the baselines it is
//! compared with, SPEAR's and ReMix's replay memories ([`spear`],
//! [`remix`]), the training step over all weights or LoRA adapters,
//! checkpoints and the weight broadcast.
//!
//! Every policy loss is written once, in f64, as a function of the per-token
//! log-probs: it returns the loss and its exact gradient with respect to
//! each token's log-prob (`∂L/∂lp_θ`). Training backpropagates through the
//! model with the surrogate `Σ_t sg(grad_t) · lp_θ,t`, whose gradient is the
//! same, so the numerics tested here against the spec's vectors are the
//! numerics the model is trained with.

pub mod advantage;
pub mod broadcast;
pub mod checkpoint;
pub mod config;
mod config_error;
pub mod delta_chain;
pub mod flops;
pub mod grads;
pub mod intake;
pub mod lineage;
pub mod loss;
pub mod memory;
pub mod metrics;
pub mod record;
pub mod remix;
pub mod rollouts;
pub mod run;
pub mod schedule;
pub mod server;
pub mod sft;
pub mod spear;
pub mod stats;
pub mod tracking;
pub mod trainer;
pub mod vcpo;

pub use config::LearnerConfig;
pub use rollouts::TrainGroup;
pub use trainer::{StepReport, Trainer};
