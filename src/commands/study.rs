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

/// One loss at one staleness bound, over its seeds: what the comparison is
/// read from, since one seed's final accuracy moves by a few points.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct Cell {
    algo: String,
    max_staleness: u64,
    seeds: usize,
    final_accuracy: MeanSd,
    final_pass_at_k: Option<f64>,
    /// Gain over each run's warm start.
    gain: MeanSd,
    mean_entropy: f64,
    mean_clip_frac_low: f64,
    mean_clip_frac_high: f64,
    rl_seconds: f64,
    learner_idle_fraction: f64,
    /// Runs that reached the target, and their mean seconds to it.
    reached_target: usize,
    seconds_to_target: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
struct MeanSd {
    mean: f64,
    /// Sample standard deviation (n - 1); 0 for one seed.
    sd: f64,
}

impl MeanSd {
    fn of(xs: &[f64]) -> Self {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let sd = if xs.len() > 1 {
            (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        Self { mean, sd }
    }
}

/// Groups the runs by (loss, staleness) in the order they were run.
fn summarise(rows: &[Row]) -> Vec<Cell> {
    let mut keys: Vec<(&str, u64)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.algo.as_str(), r.max_staleness)) {
            keys.push((r.algo.as_str(), r.max_staleness));
        }
    }
    keys.into_iter()
        .map(|(algo, s)| {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| r.algo == algo && r.max_staleness == s)
                .collect();
            let of = |f: &dyn Fn(&Row) -> f64| rs.iter().map(|r| f(r)).collect::<Vec<f64>>();
            let avg = |f: &dyn Fn(&Row) -> f64| MeanSd::of(&of(f)).mean;
            let passes: Vec<f64> = rs
                .iter()
                .filter_map(|r| r.summary.final_pass_at_k)
                .collect();
            let reached: Vec<f64> = rs.iter().filter_map(|r| r.seconds_to_target).collect();
            Cell {
                algo: algo.to_string(),
                max_staleness: s,
                seeds: rs.len(),
                final_accuracy: MeanSd::of(&of(&|r| r.summary.final_accuracy)),
                final_pass_at_k: (!passes.is_empty()).then(|| MeanSd::of(&passes).mean),
                gain: MeanSd::of(&of(&|r| {
                    r.summary.final_accuracy - r.summary.warm_start_accuracy
                })),
                mean_entropy: avg(&|r| r.mean_entropy),
                mean_clip_frac_low: avg(&|r| r.mean_clip_frac_low),
                mean_clip_frac_high: avg(&|r| r.mean_clip_frac_high),
                rl_seconds: avg(&|r| r.summary.rl_seconds),
                learner_idle_fraction: avg(&|r| r.summary.learner_idle_fraction),
                reached_target: reached.len(),
                seconds_to_target: (!reached.is_empty()).then(|| MeanSd::of(&reached).mean),
            }
        })
        .collect()
}

fn write_summary_table(html: &mut String, cells: &[Cell]) -> anyhow::Result<()> {
    html.push_str(
        "<h2>Mean over seeds</h2><table><tr><th>algo</th><th>max staleness</th><th>seeds</th>\
         <th>final acc (mean &plusmn; sd)</th><th>gain over warm start</th><th>final pass@k</th>\
         <th>mean entropy</th><th>clip low</th><th>clip high</th><th>RL s</th>\
         <th>learner idle</th><th>reached target</th><th>s to target</th></tr>",
    );
    for c in cells {
        writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3} &plusmn; {:.3}</td>\
             <td>{:+.3} &plusmn; {:.3}</td><td>{}</td><td>{:.3}</td><td>{:.4}</td><td>{:.4}</td>\
             <td>{:.0}</td><td>{:.3}</td><td>{}/{}</td><td>{}</td></tr>",
            c.algo,
            c.max_staleness,
            c.seeds,
            c.final_accuracy.mean,
            c.final_accuracy.sd,
            c.gain.mean,
            c.gain.sd,
            c.final_pass_at_k.map_or("-".into(), |p| format!("{p:.3}")),
            c.mean_entropy,
            c.mean_clip_frac_low,
            c.mean_clip_frac_high,
            c.rl_seconds,
            c.learner_idle_fraction,
            c.reached_target,
            c.seeds,
            c.seconds_to_target
                .map_or("-".into(), |t| format!("{t:.0}")),
        )?;
    }
    html.push_str("</table>");
    Ok(())
}

/// Point-wise mean of several runs' curves over the steps they share.
fn mean_curve(runs: &[Vec<(f64, f64)>]) -> Vec<(f64, f64)> {
    let mut by_step: BTreeMap<i64, (f64, usize)> = BTreeMap::new();
    for run in runs {
        for &(step, v) in run {
            let e = by_step.entry(step.round() as i64).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    by_step
        .into_iter()
        .filter(|(_, (_, n))| *n == runs.len())
        .map(|(step, (sum, n))| (step as f64, sum / n as f64))
        .collect()
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
    let cells = summarise(&rows);
    let json = serde_json::json!({"commit": commit, "summary": cells, "rows": rows});
    std::fs::write(
        args.out.join("study.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    write_report(&args.out, &rows, &cells, commit.as_deref(), &stale, &algos)?;
    eprintln!("study report: {}", args.out.join("report.html").display());
    Ok(())
}

fn write_report(
    out: &Path,
    rows: &[Row],
    cells: &[Cell],
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
    write_summary_table(&mut html, cells)?;
    html.push_str("<h2>Every run</h2>");
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
                    let runs: Vec<Vec<(f64, f64)>> = rows
                        .iter()
                        .filter(|r| &r.algo == a && r.max_staleness == s)
                        .filter_map(|r| {
                            let m = report::read_metrics(&r.dir.join("metrics.jsonl")).ok()?;
                            m.get(key).cloned()
                        })
                        .collect();
                    let pts = mean_curve(&runs);
                    if pts.is_empty() {
                        return None;
                    }
                    let smoothed = key != "eval_accuracy" && pts.len() > 100;
                    let mut notes = Vec::new();
                    if smoothed {
                        notes.push("mean of 25 steps".to_string());
                    }
                    if runs.len() > 1 {
                        notes.push(format!("mean of {} seeds", runs.len()));
                    }
                    let label = if notes.is_empty() {
                        a.clone()
                    } else {
                        format!("{a} ({})", notes.join(", "))
                    };
                    Some((
                        label,
                        if smoothed {
                            report::smooth(&pts, 25)
                        } else {
                            pts
                        },
                    ))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(algo: &str, s: u64, seed: u64, warm: f64, fin: f64, reached: Option<f64>) -> Row {
        Row {
            algo: algo.into(),
            max_staleness: s,
            seed,
            summary: RunSummary {
                algo: algo.into(),
                max_staleness: s,
                actors: 2,
                steps: 10,
                warm_start_accuracy: warm,
                warm_start_pass_at_k: None,
                final_accuracy: fin,
                final_pass_at_k: Some(fin + 0.2),
                pass_k: 8,
                eval_problems: 100,
                sft_steps: None,
                sft_seconds: 0.0,
                rl_seconds: 10.0 * (seed + 1) as f64,
                total_seconds: 0.0,
                learner_idle_fraction: 0.1,
                final_entropy: None,
                buffer: BTreeMap::new(),
                reconciled: true,
            },
            mean_entropy: 0.5,
            mean_clip_frac_low: 0.01,
            mean_clip_frac_high: 0.02,
            seconds_to_target: reached,
            dir: PathBuf::new(),
        }
    }

    #[test]
    fn cells_average_seeds_of_one_loss_and_bound_only() {
        let rows = [
            row("bapo", 4, 0, 0.5, 0.6, Some(30.0)),
            row("grpo", 4, 0, 0.5, 0.9, None),
            row("bapo", 4, 1, 0.4, 0.8, Some(50.0)),
            row("bapo", 0, 0, 0.5, 0.1, None),
        ];
        let cells = summarise(&rows);
        assert_eq!(cells.len(), 3, "{cells:?}");
        let c = &cells[0];
        assert_eq!((c.algo.as_str(), c.max_staleness, c.seeds), ("bapo", 4, 2));
        assert!((c.final_accuracy.mean - 0.7).abs() < 1e-12);
        // sd of {0.6, 0.8} with n - 1: sqrt(0.02) = 0.1414...
        assert!((c.final_accuracy.sd - 0.02f64.sqrt()).abs() < 1e-12);
        assert!((c.gain.mean - 0.25).abs() < 1e-12, "{:?}", c.gain);
        assert!((c.final_pass_at_k.unwrap() - 0.9).abs() < 1e-12);
        assert_eq!((c.reached_target, c.seconds_to_target), (2, Some(40.0)));
        assert!((c.rl_seconds - 15.0).abs() < 1e-12);
        assert_eq!((cells[1].algo.as_str(), cells[1].seeds), ("grpo", 1));
        assert_eq!(cells[1].final_accuracy.sd, 0.0);
        assert_eq!(
            (cells[1].reached_target, cells[1].seconds_to_target),
            (0, None)
        );
        assert_eq!(cells[2].max_staleness, 0);
    }

    #[test]
    fn mean_curve_keeps_only_steps_every_run_has() {
        let a = vec![(0.0, 1.0), (100.0, 2.0), (200.0, 3.0)];
        let b = vec![(0.0, 3.0), (100.0, 4.0)];
        assert_eq!(mean_curve(&[a.clone(), b]), vec![(0.0, 2.0), (100.0, 3.0)]);
        assert_eq!(mean_curve(std::slice::from_ref(&a)), a);
        assert!(mean_curve(&[]).is_empty());
    }
}
