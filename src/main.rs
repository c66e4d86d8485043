//! `bapo`: one binary for every part of the system.

mod bench;
mod commands;
mod config_file;
mod telemetry;

use clap::{Parser, Subcommand};

/// Every service moves many short-lived, KiB-sized buffers (decoded
/// messages, per-token arrays); glibc's allocator spent ~15% of the buffer
/// benchmark's CPU in malloc/free, mimalloc a fraction of that.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "bapo",
    version,
    about = "Off-policy RL for language models with BAPO"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the staleness-tracking rollout buffer service.
    Buffer(commands::buffer::BufferArgs),
    /// One policy loss on a JSON batch: loss, gradient and metrics as JSON.
    Loss(commands::loss::LossArgs),
    /// Benchmarks of the hot paths, each beside a reference.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        // A pure computation: no runtime, and stdout holds only its JSON.
        Command::Loss(args) => commands::loss::run(args),
        Command::Buffer(args) => run_async(commands::buffer::run(args)),
        Command::Bench(b) => run_async(bench::run(b)),
    }
}

/// Services and benchmarks: logging to stderr and a multi-threaded runtime.
fn run_async(job: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    telemetry::init_logging("info");
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(job)
}
