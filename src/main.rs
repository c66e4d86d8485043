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
    /// Benchmarks of the hot paths, each beside a reference.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init_logging("info");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.command {
            Command::Buffer(args) => commands::buffer::run(args).await,
            Command::Bench(b) => bench::run(b).await,
        }
    })
}
