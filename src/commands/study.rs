//! `bapo study`: the same budget under several losses and staleness bounds,
//! from one shared warm start, compared in one report. The question it
//! checks is the paper's: does fixed clipping lose entropy and accuracy as
//! staleness grows while BAPO keeps both? It also reports synchronous
//! (`max_staleness = 0`) against asynchronous runs: wall-clock to a target
//! accuracy and the learner's idle fraction.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use super::{
    run::{RunArgs, RunSummary, run_to_summary},
    sft,
};
use crate::{
    config_file::ConfigFile,
    report::{self, Series},
};

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

#[derive(Debug, Clone, Serialize)]
struct Row {
    algo: String,
    max_staleness: u64,
    seed: u64,
    summary: RunSummary,
    /// Mean over the run's steps.
    mean_entropy: f64,
    mean_clip_frac_low: f64,
    mean_clip_frac_high: f64,
    /// Seconds of RL until held-out accuracy first reached the target.
    seconds_to_target: Option<f64>,
    dir: PathBuf,
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

fn mean(m: &BTreeMap<String, Vec<(f64, f64)>>, k: &str) -> f64 {
    m.get(k).filter(|v| !v.is_empty()).map_or(f64::NAN, |v| {
        v.iter().map(|p| p.1).sum::<f64>() / v.len() as f64
    })
}

pub async fn run(args: StudyArgs) -> anyhow::Result<()> {
    let algos: Vec<String> = list(&args.algos, "--algos")?;
    let stale: Vec<u64> = list(&args.staleness, "--staleness")?;
    let seeds: Vec<u64> = list(&args.seeds, "--seeds")?;
    std::fs::create_dir_all(&args.out)?;
    let runs = args.runs.clone().unwrap_or_else(|| args.out.join("runs"));
    let init = match &args.init {
        Some(d) => d.clone(),
        None => {
            let cfg = ConfigFile::load_or_builtin(args.config.as_deref())?;
            let dir = runs.join("warm-start");
            let d = dir.clone();
            let s =
                tokio::task::spawn_blocking(move || sft::warm_start(&cfg, &d, 0, false)).await??;
            eprintln!("shared warm start: {} steps in {:.0} s", s.steps, s.seconds);
            dir
        }
    };
    let mut rows = Vec::new();
    for &seed in &seeds {
        for &s in &stale {
            for algo in &algos {
                let dir = runs.join(format!("{algo}-s{s}-seed{seed}"));
                eprintln!("study: {algo}, max staleness {s}, seed {seed}");
                let summary = run_to_summary(&RunArgs {
                    config: args.config.clone(),
                    steps: args.steps,
                    algo: Some(algo.clone()),
                    max_staleness: Some(s),
                    out: Some(dir.clone()),
                    init: Some(init.clone()),
                    seed: Some(seed),
                    quiet: true,
                    ..Default::default()
                })
                .await
                .with_context(|| format!("run {}", dir.display()))?;
                let m = report::read_metrics(&dir.join("metrics.jsonl"))?;
                let target = summary.warm_start_accuracy + args.target_gain;
                let seconds_to_target = m.get("eval_accuracy").and_then(|acc| {
                    let times = m.get("time_s")?;
                    let step = acc.iter().find(|p| p.1 >= target)?.0;
                    times.iter().find(|t| t.0 >= step).map(|t| t.1)
                });
                rows.push(Row {
                    algo: algo.clone(),
                    max_staleness: s,
                    seed,
                    mean_entropy: mean(&m, "entropy"),
                    mean_clip_frac_low: mean(&m, "clip_frac_low"),
                    mean_clip_frac_high: mean(&m, "clip_frac_high"),
                    seconds_to_target,
                    summary,
                    dir,
                });
            }
        }
    }
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let json = serde_json::json!({"commit": commit, "rows": rows});
    std::fs::write(
        args.out.join("study.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    write_report(&args.out, &rows, commit.as_deref(), &stale, &algos)?;
    eprintln!("study report: {}", args.out.join("report.html").display());
    Ok(())
}

fn write_report(
    out: &Path,
    rows: &[Row],
    commit: Option<&str>,
    stale: &[u64],
    algos: &[String],
) -> anyhow::Result<()> {
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>bapo study</title>\
         <style>body{font-family:sans-serif;max-width:1320px;margin:2em auto}\
         table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}\
         .charts{display:flex;flex-wrap:wrap;gap:8px}</style></head><body><h1>bapo study</h1>",
    );
    writeln!(
        html,
        "<p>Made with <code>bapo study</code> at commit <code>{}</code>.</p>",
        commit.unwrap_or("unknown")
    )?;
    html.push_str(
        "<table><tr><th>algo</th><th>max staleness</th><th>seed</th><th>warm start acc</th>\
         <th>final acc</th><th>final pass@k</th><th>mean entropy</th><th>final entropy</th>\
         <th>clip low</th><th>clip high</th><th>RL s</th><th>learner idle</th><th>s to target</th></tr>",
    );
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
    for r in rows {
        let s = &r.summary;
        writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{}</td><td>{:.3}</td>\
             <td>{}</td><td>{:.4}</td><td>{:.4}</td><td>{:.0}</td><td>{:.2}</td><td>{}</td></tr>",
            r.algo,
            r.max_staleness,
            r.seed,
            s.warm_start_accuracy,
            s.final_accuracy,
            f(s.final_pass_at_k),
            r.mean_entropy,
            f(s.final_entropy),
            r.mean_clip_frac_low,
            r.mean_clip_frac_high,
            s.rl_seconds,
            s.learner_idle_fraction,
            r.seconds_to_target
                .map_or("not reached".into(), |t| format!("{t:.0}")),
        )?;
    }
    html.push_str("</table><div class=\"charts\">");
    let charts = out.join("charts");
    std::fs::create_dir_all(&charts)?;
    for &s in stale {
        for (key, title) in [
            ("eval_accuracy", "held-out accuracy"),
            ("entropy", "entropy"),
            ("clip_frac_low", "clip fraction (low)"),
        ] {
            let series: Vec<Series> = algos
                .iter()
                .filter_map(|a| {
                    let r = rows.iter().find(|r| &r.algo == a && r.max_staleness == s)?;
                    let m = report::read_metrics(&r.dir.join("metrics.jsonl")).ok()?;
                    let pts = m.get(key)?;
                    Some(if key != "eval_accuracy" && pts.len() > 100 {
                        (format!("{a} (mean of 25)"), report::smooth(pts, 25))
                    } else {
                        (a.clone(), pts.clone())
                    })
                })
                .collect();
            if series.is_empty() {
                continue;
            }
            let svg = report::line_chart(&format!("{title}, max staleness {s}"), "step", &series)?;
            std::fs::write(charts.join(format!("{key}-s{s}.svg")), &svg)?;
            html.push_str(&svg);
        }
    }
    html.push_str("</div></body></html>\n");
    std::fs::write(out.join("report.html"), html)?;
    Ok(())
}
