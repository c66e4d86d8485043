//! Held-out accuracy of a model, greedy and pass@k: what `bapo eval`
//! prints and `bapo run` reports at its end.

use std::path::PathBuf;

use bapo_policy::evaluate::{EvalResult, PassAtK};
use bapo_tasks::Split;
use clap::{Args, ValueEnum};

use crate::{common, config_file::ConfigFile};

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
    /// Temperature of pass@k's samples (default: the config's
    /// `[actor.sampling] temperature`, the one the policy trains at).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Which half of the held-out problems: `test` (reported once, at the
    /// end) or `validation` (for tuning and in-run evaluation).
    #[arg(long, value_enum, default_value_t = EvalSplit::Test)]
    pub split: EvalSplit,
    #[arg(long, default_value_t = 16)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

/// The held-out half `bapo eval` reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum EvalSplit {
    Validation,
    #[default]
    Test,
}

impl From<EvalSplit> for Split {
    fn from(s: EvalSplit) -> Self {
        match s {
            EvalSplit::Validation => Split::Validation,
            EvalSplit::Test => Split::Test,
        }
    }
}

pub fn eval(args: &EvalArgs) -> anyhow::Result<EvalResult> {
    let mut cfg = ConfigFile::load_or_builtin(args.config.as_deref())?;
    if let Some(t) = &args.task {
        cfg.task.name = t.clone();
    }
    if let Some(d) = &args.data {
        cfg.task.path = Some(d.clone());
    }
    let device = args.device.resolve(&mut cfg.model)?;
    let (mut policy, tokenizer) = common::load_model_dir(&args.checkpoint, &device)?;
    policy.model = bapo_policy::weights::for_inference(policy.model, cfg.model.precision);
    let task = common::task(&cfg.task, &tokenizer)?;
    let stop = tokenizer.stop_ids(&cfg.actor.stop)?;
    let problems = Split::from(args.split).problems(&*task, args.problems);
    let pass = (args.k > 1).then(|| PassAtK {
        k: args.k,
        temperature: args.temperature.unwrap_or(cfg.actor.sampling.temperature),
    });
    let scorer = common::Scorer::new(&cfg, task, &tokenizer, stop, args.max_new_tokens)?;
    Ok(scorer.evaluate(&policy, &problems, pass))
}
