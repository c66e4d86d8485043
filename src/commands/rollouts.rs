//! `bapo rollouts`: the training rollouts a run's learner kept
//! (`rollouts.jsonl`), filtered, as text a person reads in a terminal.

use std::path::PathBuf;

use clap::Args;

use crate::local::rollouts::{self, Filter};

#[derive(Debug, Args)]
pub struct RolloutsArgs {
    /// The run's directory (`bapo run --out`, or a learner's `--out`).
    #[arg(long)]
    pub run: PathBuf,
    /// Only those kept at this learner step.
    #[arg(long)]
    pub step: Option<u64>,
    /// Only rewarded ones.
    #[arg(long, conflicts_with = "unrewarded")]
    pub rewarded: bool,
    /// Only unrewarded ones.
    #[arg(long)]
    pub unrewarded: bool,
    /// Only those that ran out of tokens.
    #[arg(long)]
    pub truncated: bool,
    /// Only those whose prompt or response contains this text.
    #[arg(long)]
    pub contains: Option<String>,
    /// At most this many, the newest (0: all).
    #[arg(long, default_value_t = 8)]
    pub last: usize,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: RolloutsArgs) -> anyhow::Result<()> {
    let filter = Filter {
        step: args.step,
        rewarded: match (args.rewarded, args.unrewarded) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        },
        truncated_only: args.truncated,
        contains: args.contains,
    };
    let all = rollouts::read(&args.run)?;
    let kept: Vec<_> = all.iter().filter(|s| filter.keeps(s)).collect();
    let skip = match args.last {
        0 => 0,
        n => kept.len().saturating_sub(n),
    };
    for s in &kept[skip..] {
        if args.json {
            println!("{}", serde_json::to_string(s)?);
        } else {
            println!("{}", rollouts::to_text(s));
        }
    }
    eprintln!("{} of {} kept rollouts match", kept.len(), all.len());
    Ok(())
}
