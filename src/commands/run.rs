//! `bapo run`: the whole system on one machine. A supervised warm start,
//! then the buffer, the learner and N actors as separate processes talking
//! gRPC over loopback, a live progress line from the learner's metrics log,
//! a final held-out evaluation, and a report in the run directory (see
//! `crate::local`).

use std::path::PathBuf;

use clap::Args;

use crate::common;
use crate::local::{options::RunOptions, run};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// TOML config file with any of the tables (default: the built-in
    /// configs/tiny-arith.toml).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Actor processes.
    #[arg(long)]
    pub actors: Option<usize>,
    /// Learner optimiser steps.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Policy loss (bapo, grpo, dapo, ...).
    #[arg(long)]
    pub algo: Option<String>,
    /// Maximum policy-version lag of trained data; 0 is synchronous.
    #[arg(long)]
    pub max_staleness: Option<u64>,
    /// Run directory (default runs/<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Start RL from this HF model directory (skips the warm start).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Task name (arith, countdown, jsonl).
    #[arg(long)]
    pub task: Option<String>,
    /// JSONL file of the `jsonl` task (GSM8K format).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Supervised warm-start steps (0 skips it).
    #[arg(long)]
    pub sft_steps: Option<u64>,
    /// Seed of the model, task and sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// No progress bar: log lines only.
    #[arg(long)]
    pub quiet: bool,
    /// Print the whole summary as JSON at the end (what summary.json
    /// holds) instead of a few lines.
    #[arg(long)]
    pub json: bool,
    /// Train LoRA adapters on the frozen warm start instead of every
    /// weight: r 16, alpha 32 on all attention and MLP projections, at
    /// 10x learner.lr (as "LoRA Without Regret" advises). A
    /// [learner.lora] table in the config is used as it is instead.
    #[arg(long)]
    pub lora: bool,
    /// What generates the actors' rollouts: bapo's own model (burn) or a
    /// vLLM server each actor starts from `[actor.vllm]`'s venv (vllm;
    /// scripts/vllm-env.sh makes one).
    #[arg(long, value_enum)]
    pub engine: Option<bapo_actor::EngineKind>,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

impl RunArgs {
    fn options(self) -> RunOptions {
        RunOptions {
            config: self.config,
            actors: self.actors,
            steps: self.steps,
            algo: self.algo,
            max_staleness: self.max_staleness,
            out: self.out,
            init: self.init,
            task: self.task,
            data: self.data,
            sft_steps: self.sft_steps,
            seed: self.seed,
            quiet: self.quiet,
            lora: self.lora,
            engine: self.engine,
            device: self.device,
        }
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let json = args.json;
    let summary = run::run(&args.options()).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{}", summary.brief());
    }
    Ok(())
}
