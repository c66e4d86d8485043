//! `bapo study`: the same budget under several losses and staleness bounds,
//! from one shared warm start, compared in one report. The question it
//! checks is the paper's: does fixed clipping lose entropy and accuracy as
//! staleness grows while BAPO keeps both? It also reports synchronous
//! (`max_staleness = 0`) against asynchronous runs: wall-clock to a target
//! accuracy and the learner's idle fraction.

mod cells;
mod report;

use std::path::{Path, PathBuf};

use anyhow::Context;

use self::cells::{Row, summarise};
use bapo_learner::record::{Metric, StepRecord};

use super::{options::RunOptions, report::read_metrics, run};
use crate::{config_file::ConfigFile, warm_start as sft};

/// What to compare, and where the results go.
#[derive(Debug, Clone)]
pub struct Study {
    /// The config file (default: the built-in one).
    pub config: Option<PathBuf>,
    pub algos: Vec<String>,
    pub staleness: Vec<u64>,
    pub seeds: Vec<u64>,
    /// RL steps per run (default: the config's).
    pub steps: Option<u64>,
    /// Where `study.json`, `report.html` and its charts go.
    pub out: PathBuf,
    /// Where the run directories and the shared warm start go; default
    /// `<out>/runs`.
    pub runs: Option<PathBuf>,
    /// Start every run from this HF directory instead of a fresh warm start.
    pub init: Option<PathBuf>,
    /// Accuracy gain over the warm start that counts as "reached".
    pub target_gain: f64,
}

fn mean(records: &[StepRecord], m: Metric) -> f64 {
    let v = StepRecord::series(records, m);
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().map(|p| p.1).sum::<f64>() / v.len() as f64
}

/// Runs every (seed, staleness bound, loss) and writes `study.json` and
/// the report.
pub async fn run(study: &Study) -> anyhow::Result<()> {
    std::fs::create_dir_all(&study.out)?;
    let runs = study.runs.clone().unwrap_or_else(|| study.out.join("runs"));
    let init = match &study.init {
        Some(d) => d.clone(),
        None => {
            let cfg = ConfigFile::load_or_builtin(study.config.as_deref())?;
            let dir = runs.join("warm-start");
            let d = dir.clone();
            let s =
                tokio::task::spawn_blocking(move || sft::warm_start(&cfg, &d, 0, false)).await??;
            eprintln!("shared warm start: {} steps in {:.0} s", s.steps, s.seconds);
            dir
        }
    };
    let mut rows = Vec::new();
    for &seed in &study.seeds {
        for &s in &study.staleness {
            for algo in &study.algos {
                eprintln!("study: {algo}, max staleness {s}, seed {seed}");
                rows.push(measure(study, &init, algo, s, seed, &runs).await?);
            }
        }
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let cells = summarise(&rows);
    let json = serde_json::json!({"commit": commit, "summary": cells, "rows": rows});
    std::fs::write(
        study.out.join("study.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    report::write_report(
        &study.out,
        &rows,
        &cells,
        commit.as_deref(),
        &study.staleness,
        &study.algos,
    )?;
    eprintln!("study report: {}", study.out.join("report.html").display());
    Ok(())
}

/// One run of the study (`algo` at max staleness `s`, seed `seed`, from the
/// warm start `init`, in a directory under `runs`) and what it is compared
/// by.
async fn measure(
    study: &Study,
    init: &Path,
    algo: &str,
    s: u64,
    seed: u64,
    runs: &Path,
) -> anyhow::Result<Row> {
    let dir = runs.join(format!("{algo}-s{s}-seed{seed}"));
    let summary = run::run(&RunOptions {
        config: study.config.clone(),
        steps: study.steps,
        algo: Some(algo.to_string()),
        max_staleness: Some(s),
        out: Some(dir.clone()),
        init: Some(init.to_path_buf()),
        seed: Some(seed),
        quiet: true,
        ..Default::default()
    })
    .await
    .with_context(|| format!("run {}", dir.display()))?;
    let m = read_metrics(&dir.join("metrics.jsonl"))?;
    let target = summary.warm_start_accuracy + study.target_gain;
    let acc = StepRecord::series(&m, Metric::EvalAccuracy);
    let times = StepRecord::series(&m, Metric::TimeS);
    let seconds_to_target = acc
        .iter()
        .find(|p| p.1 >= target)
        .and_then(|&(step, _)| times.iter().find(|t| t.0 >= step).map(|t| t.1));
    Ok(Row {
        algo: algo.to_string(),
        max_staleness: s,
        seed,
        mean_entropy: mean(&m, Metric::Entropy),
        mean_clip_frac_low: mean(&m, Metric::ClipFracLow),
        mean_clip_frac_high: mean(&m, Metric::ClipFracHigh),
        seconds_to_target,
        summary,
        dir,
    })
}
