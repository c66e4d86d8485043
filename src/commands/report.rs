//! `bapo report`: a run's `report.html` written again from its files
//! (`summary.json`, `metrics.jsonl`, `rollouts.jsonl`), so that a run made
//! by an older bapo, or copied from elsewhere, gets this one's report.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The run's directory (`bapo run --out`).
    #[arg(long)]
    pub run: PathBuf,
}

pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    let path = args.run.join("summary.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let summary = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bapo run's summary", path.display()))?;
    crate::local::report::write(&args.run, &summary)?;
    eprintln!("wrote {}", args.run.join("report.html").display());
    Ok(())
}
