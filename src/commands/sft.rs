//! `bapo sft`: the supervised warm start, as its own command (and the first
//! phase of `bapo run`, through [`crate::warm_start`]).

use std::path::PathBuf;

use clap::Args;

use crate::{common, config_file::ConfigFile, warm_start::warm_start};

#[derive(Debug, Args, Default)]
pub struct SftArgs {
    /// TOML config file (its `[sft]`, `[model]`, `[task]` tables).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Where the HF-format model goes.
    #[arg(long, default_value = "bapo-sft")]
    pub out: PathBuf,
    #[arg(long)]
    pub steps: Option<u64>,
    /// Held-out problems scored before and after.
    #[arg(long, default_value_t = 200)]
    pub eval_problems: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

pub fn run(args: SftArgs) -> anyhow::Result<()> {
    let mut cfg = ConfigFile::load_or_builtin(args.config.as_deref())?;
    if let Some(s) = args.steps {
        cfg.sft.steps = s;
    }
    args.device.apply(&mut cfg.model);
    let summary = warm_start(&cfg, &args.out, args.eval_problems, args.quiet)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}
