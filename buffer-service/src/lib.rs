//! The bapo buffer service: a staleness-tracking store of rollout groups
//! between actors and the learner, and the gRPC server around it.
//!
//! The core ([`Buffer`]) decides what gets in (validation, the staleness
//! admission bound, capacity, and leases: room reserved before a group is
//! generated), when a group is sampleable (complete, or timed
//! out with enough members), what is handed to the learner (FIFO or replay,
//! rate-limited) and what is evicted (stale, capacity, incomplete), with an
//! optional write-ahead log so a killed buffer loses nothing it acknowledged.
//! [`service`] translates gRPC to core calls and back; [`server`] runs it.

pub mod admission;
pub mod config;
pub mod eviction;
pub mod group;
pub mod lease;
pub mod ledger;
pub mod lineage;
pub mod metrics;
pub mod rate_limit;
pub mod ready;
pub mod rollout;
pub mod sampler;
pub mod server;
pub mod service;
pub mod store;
pub mod validate;
pub mod wal;
pub mod when_full;
pub mod wire;

#[cfg(test)]
mod recovery_props;

pub use config::BufferConfig;
pub use store::{Buffer, BufferError, LearnerReport, PushOutcome, ReportOutcome, Stats};
