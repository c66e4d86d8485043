//! `bapo eval`: held-out accuracy of a model, greedy and pass@k.

use std::path::PathBuf;

use bapo_policy::evaluate::{EvalResult, evaluate};
use clap::Args;

use super::common;
use crate::config_file::ConfigFile;

#[derive(Debug, Args, Default)]
pub struct EvalArgs {
    /// A HF model directory, a learner checkpoint, or a run directory.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// TOML config file (its `[task]` table).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Task name (overrides the config's).
    #[arg(long)]
    pub task: Option<String>,
    /// JSONL file of the `jsonl` task.
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[arg(long, default_value_t = 500)]
    pub problems: usize,
    /// Samples per problem for pass@k (1: greedy only).
    #[arg(long, default_value_t = 8)]
    pub k: usize,
    #[arg(long, default_value_t = 16)]
    pub max_new_tokens: usize,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let r = eval(&args)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

pub fn eval(args: &EvalArgs) -> anyhow::Result<EvalResult> {
    let mut cfg = ConfigFile::load_or_builtin(args.config.as_deref())?;
    if let Some(t) = &args.task {
        cfg.task.name = t.clone();
    }
    if let Some(d) = &args.data {
        cfg.task.path = Some(d.clone());
    }
    let device = common::device();
    let (policy, tokenizer) = common::load_model_dir(&args.checkpoint, &device)?;
    let task = common::task(&cfg.task, &tokenizer)?;
    let stop = common::stop_tokens(&tokenizer, &cfg.actor.stop)?;
    let problems = task.eval_problems(args.problems);
    Ok(evaluate(
        &policy,
        &tokenizer,
        &*task,
        &problems,
        args.max_new_tokens,
        &stop,
        args.k,
    ))
}
