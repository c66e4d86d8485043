//! `bapo study`: the same budget under several losses and staleness bounds,
//! from one shared warm start, compared in one report (see
//! `crate::local::study`).

use std::path::PathBuf;

use clap::Args;

use crate::local::study::{self, Study};

#[derive(Debug, Args)]
pub struct StudyArgs {
    /// TOML config file (default: the built-in one).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value = "bapo,grpo,dapo")]
    pub algos: String,
    #[arg(long, default_value = "0,4,16")]
    pub staleness: String,
    #[arg(long, default_value = "0")]
    pub seeds: String,
    /// RL steps per run.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Where `study.json`, `report.html` and its charts go.
    #[arg(long, default_value = "study")]
    pub out: PathBuf,
    /// Where the run directories and the shared warm start go (checkpoints
    /// and weights: large); default `<out>/runs`.
    #[arg(long)]
    pub runs: Option<PathBuf>,
    /// Start every run from this HF directory instead of a fresh warm start.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Accuracy gain over the warm start that counts as "reached".
    #[arg(long, default_value_t = 0.05)]
    pub target_gain: f64,
}

fn list<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("{what}: cannot parse {x:?}"))
        })
        .collect()
}

pub async fn run(args: StudyArgs) -> anyhow::Result<()> {
    let study = Study {
        config: args.config,
        algos: list(&args.algos, "--algos")?,
        staleness: list(&args.staleness, "--staleness")?,
        seeds: list(&args.seeds, "--seeds")?,
        steps: args.steps,
        out: args.out,
        runs: args.runs,
        init: args.init,
        target_gain: args.target_gain,
    };
    study::run(&study).await
}
