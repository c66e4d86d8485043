//! `bapo bench ...`: hot-path benchmarks that print numbers beside a
//! reference doing the same work. No thresholds: they inform, tests decide.
//! Built only with `--features bench` (Redis and HdrHistogram stay out of
//! the production binary): `cargo run --features bench -- bench ...`.
//!
//! Imports go one way: `buffer` uses `redis_streams`, both use `workload`
//! and `latency`; `soak` uses the local run's supervisor; `actors` uses
//! `buffer`'s connections, `workload`, `latency` and `soak`'s memory
//! readings.

pub mod actors;
pub mod broadcast;
pub mod buffer;
pub mod episodes;
mod hub;
mod latency;
pub mod learner;
pub mod model;
pub mod parity;
mod redis_streams;
pub mod soak;
pub mod vllm_publish;
pub mod weights;
mod workload;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Many simulated actors (leases, renewals, pushes) against one buffer
    /// process for minutes: ack latency beside one actor alone, the
    /// buffer's memory over time, and the books (nothing lost).
    Actors(actors::ActorsBenchArgs),
    /// The buffer service over loopback gRPC, beside Redis Streams.
    Buffer(buffer::BufferBenchArgs),
    /// One weight version from publish to every subscriber, over the
    /// real stream: whole f32, whole bf16 and bf16 deltas of real steps,
    /// 1, 4 and 16 subscribers.
    Broadcast(broadcast::BroadcastBenchArgs),
    /// Multi-turn episodes against the built-in calculator beside
    /// single-turn groups: generation tokens/s.
    Episodes(episodes::EpisodesBenchArgs),
    /// The learner's own optimiser step at a batch shape: tokens/s and
    /// peak memory.
    Learner(learner::LearnerBenchArgs),
    /// The policy's training step and cached generation, beside JAX and
    /// PyTorch.
    Model(model::ModelBenchArgs),
    /// Logits, log-probs and gradients beside a PyTorch reference file on
    /// the same weights (scripts/device/torch_parity.py).
    Parity(parity::ParityArgs),
    /// The whole loop at full speed for minutes, watching every process's
    /// memory (not in CI).
    Soak(soak::SoakArgs),
    /// One weight broadcast, f32 beside bf16: bytes per update, encode
    /// and decode time.
    Weights(weights::WeightsBenchArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Actors(args) => actors::run(args).await,
        BenchCommand::Broadcast(args) => broadcast::run(args).await,
        BenchCommand::Buffer(args) => buffer::run(args).await,
        BenchCommand::Episodes(args) => {
            tokio::task::spawn_blocking(move || episodes::run(args)).await?
        }
        // Compute-bound and synchronous: off the async workers.
        BenchCommand::Model(args) => tokio::task::spawn_blocking(move || model::run(args)).await?,
        BenchCommand::Learner(args) => {
            tokio::task::spawn_blocking(move || learner::run(args)).await?
        }
        BenchCommand::Parity(args) => {
            tokio::task::spawn_blocking(move || parity::run(args)).await?
        }
        BenchCommand::Soak(args) => soak::run(args).await,
        BenchCommand::Weights(args) => {
            tokio::task::spawn_blocking(move || weights::run(args)).await?
        }
    }
}

/// The median of timed repetitions (the mean of the middle two when
/// even), the number a benchmark shows.
pub(crate) fn median(v: Vec<f64>) -> f64 {
    bapo_learner::spear::median(v.into_iter()).unwrap_or(f64::NAN)
}

/// A model of a `--configs` list: a preset name, or the path of a HF
/// `config.json` (a real model's shape, e.g. SmolLM2's).
pub(crate) fn model_config(name: &str) -> anyhow::Result<bapo_policy::ModelConfig> {
    use anyhow::Context;
    let name = name.trim();
    let path = std::path::Path::new(name);
    if path.is_file() {
        Ok(bapo_policy::ModelConfig::from_hf_json(path)?)
    } else {
        bapo_policy::ModelConfig::preset(name).with_context(|| format!("--configs: {name:?}"))
    }
}
