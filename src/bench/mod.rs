//! `bapo bench ...`: hot-path benchmarks that print numbers beside a
//! reference doing the same work. No thresholds: they inform, tests decide.

pub mod buffer;
mod latency;
mod redis_streams;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// The buffer service over loopback gRPC, beside Redis Streams.
    Buffer(buffer::BufferBenchArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Buffer(args) => buffer::run(args).await,
    }
}
