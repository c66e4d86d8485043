//! One module per `bapo` subcommand.

pub mod actor;
pub mod buffer;
pub mod eval;
pub mod learner;
pub mod loss;
pub mod report;
pub mod rollouts;
pub mod run;
pub mod sft;
pub mod study;
