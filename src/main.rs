//! `bapo`: one binary for every part of the system.

#[cfg(feature = "bench")]
mod bench;
mod commands;
mod common;
mod config_file;
mod evaluation;
mod fatal;
mod local;
mod security;
mod telemetry;
mod warm_start;

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
    /// The whole loop on this machine: warm start, buffer, learner and
    /// actors over loopback gRPC, then an evaluation and a report.
    Run(commands::run::RunArgs),
    /// Run the staleness-tracking rollout buffer service.
    Buffer(commands::buffer::BufferArgs),
    /// Run the learner: train from the buffer, broadcast weights.
    Learner(commands::learner::LearnerArgs),
    /// Run an actor: generate scored groups with the learner's weights.
    Actor(commands::actor::ActorArgs),
    /// Supervised warm start on a task's worked solutions.
    Sft(commands::sft::SftArgs),
    /// Compare losses across staleness bounds from one warm start.
    Study(commands::study::StudyArgs),
    /// Held-out accuracy of a model (greedy and pass@k).
    Eval(commands::eval::EvalArgs),
    /// One policy loss on a JSON batch: loss, gradient and metrics as JSON.
    Loss(commands::loss::LossArgs),
    /// The training rollouts a run kept, filtered, as text to read.
    Rollouts(commands::rollouts::RolloutsArgs),
    /// A run's report.html written again from its files.
    Report(commands::report::ReportArgs),
    /// Benchmarks of the hot paths, each beside a reference (built with
    /// `--features bench`).
    #[cfg(feature = "bench")]
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Without the `bench` feature: says how to build it.
    #[cfg(not(feature = "bench"))]
    #[command(hide = true, disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    // Before any worker thread exists, so all of them inherit it.
    bapo_policy::denormals::flush_denormals_to_zero();
    // ring as the one rustls provider, before anything touches TLS.
    bapo_proto::tls::install_default_provider();
    fatal::exit_on_gpu_backend_panic();
    match Cli::parse().command {
        // A pure computation: no runtime, and stdout holds only its JSON.
        Command::Loss(args) => commands::loss::run(args),
        Command::Rollouts(args) => commands::rollouts::run(args),
        Command::Report(args) => commands::report::run(args),
        Command::Buffer(args) => run_async(commands::buffer::run(args)),
        Command::Learner(args) => run_async(commands::learner::run(args)),
        Command::Actor(args) => run_async(commands::actor::run(args)),
        Command::Run(args) => {
            telemetry::init_run_logging();
            runtime()?.block_on(commands::run::run(args))
        }
        Command::Study(args) => run_async(commands::study::run(args)),
        Command::Sft(args) => {
            telemetry::init_logging("info");
            commands::sft::run(args)
        }
        Command::Eval(args) => {
            telemetry::init_logging("warn");
            commands::eval::run(args)
        }
        #[cfg(feature = "bench")]
        Command::Bench(b) => run_async(bench::run(b)),
        #[cfg(not(feature = "bench"))]
        Command::Bench { args } => anyhow::bail!(
            "this bapo was built without the benchmarks; run them with \
             `cargo run --features bench -- bench {}`",
            args.join(" ")
        ),
    }
}

/// Services and benchmarks: logging to stderr and a multi-threaded runtime.
fn run_async(job: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    telemetry::init_logging("info");
    runtime()?.block_on(job)
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}
