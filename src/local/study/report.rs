//! The study's `report.html`: the table of cells, every run, and charts of
//! each loss's seed-mean curves per staleness bound.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use bapo_learner::record::{Metric, StepRecord};

use super::cells::{Cell, Row};
use crate::local::report::{self, Series};

/// Writes `report.html` and `charts/*.svg` into `out`.
pub fn write_report(
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
    write_charts(&mut html, out, rows, stale, algos)?;
    html.push_str("</div></body></html>\n");
    std::fs::write(out.join("report.html"), html)?;
    Ok(())
}

/// One chart per staleness bound and quantity, a line per loss (the mean
/// of its seeds), appended to `html` and written to `<out>/charts`.
fn write_charts(
    html: &mut String,
    out: &Path,
    rows: &[Row],
    stale: &[u64],
    algos: &[String],
) -> anyhow::Result<()> {
    let charts = out.join("charts");
    std::fs::create_dir_all(&charts)?;
    for &s in stale {
        for (key, title) in [
            (Metric::EvalAccuracy, "held-out accuracy"),
            (Metric::Entropy, "entropy"),
            (Metric::ClipFracLow, "clip fraction (low)"),
        ] {
            let series: Vec<Series> = algos
                .iter()
                .filter_map(|a| {
                    let runs: Vec<Vec<(f64, f64)>> = rows
                        .iter()
                        .filter(|r| &r.algo == a && r.max_staleness == s)
                        .filter_map(|r| {
                            let m = report::read_metrics(&r.dir.join("metrics.jsonl")).ok()?;
                            Some(StepRecord::series(&m, key)).filter(|s| !s.is_empty())
                        })
                        .collect();
                    let pts = mean_curve(&runs);
                    if pts.is_empty() {
                        return None;
                    }
                    let smoothed = key != Metric::EvalAccuracy && pts.len() > 100;
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
            std::fs::write(charts.join(format!("{}-s{s}.svg", key.key())), &svg)?;
            html.push_str(&svg);
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_curve_keeps_only_steps_every_run_has() {
        let a = vec![(0.0, 1.0), (100.0, 2.0), (200.0, 3.0)];
        let b = vec![(0.0, 3.0), (100.0, 4.0)];
        assert_eq!(mean_curve(&[a.clone(), b]), vec![(0.0, 2.0), (100.0, 3.0)]);
        assert_eq!(mean_curve(std::slice::from_ref(&a)), a);
        assert!(mean_curve(&[]).is_empty());
    }
}
