//! `results.md` and its charts: the gates, one row per arm (mean ± sd over
//! seeds), the verdict on each hypothesis with its tests, and the curves.

use std::{fmt::Write as _, path::Path};

use super::{
    analysis::{ALPHA, Analysis, ArmSummary, GATE1_MISS},
    arms::Arm,
    episode::ArmRun,
};
use crate::local::report::{Series, line_chart};

pub fn write(out: &Path, arms: &[Arm], runs: &[ArmRun], a: &Analysis) -> anyhow::Result<()> {
    let mut md = String::from("# Controlled-lag study: results\n\n");
    md += "Written by `bapo study --lag`; the numbers are in `study.json.gz` beside it, \
           the hypotheses in README.md.\n\n## Gates\n\n";
    let yn = |b: Option<bool>| match b {
        Some(true) => "passed",
        Some(false) => "failed",
        None => "not run",
    };
    writeln!(
        md,
        "- Gate 1 (BAPO's start window misses its target in >= {:.0}% of steps): {} \
         (missed in {})",
        GATE1_MISS * 100.0,
        yn(a.gate1_passed),
        a.gate1_start_window_miss.map_or("-".into(), |m| format!(
            "{:.1}% of arm f's steps",
            m * 100.0
        ))
    )?;
    writeln!(
        md,
        "- Gate 2 (H1, the positive control): {}\n",
        yn(a.gate2_passed)
    )?;
    write_table(&mut md, &a.arms)?;
    md += "\n## Hypotheses\n\n";
    for v in &a.verdicts {
        let verdict = match v.holds {
            Some(true) => "**holds**",
            Some(false) => "**does not hold**",
            None => "not tested",
        };
        writeln!(md, "- **{}** {}: {verdict}", v.name, v.statement)?;
        for (name, w) in &v.tests {
            match w {
                Some(w) => writeln!(
                    md,
                    "  - {name}: {:+.4} (t = {:.2}, df = {:.1}, p = {:.3})",
                    w.diff, w.t, w.df, w.p
                )?,
                None => writeln!(md, "  - {name}: no test (too few seeds or no variance)")?,
            }
        }
    }
    writeln!(md, "\nSignificance: two-sided Welch t-test, p < {ALPHA}.\n")?;
    write_charts(&mut md, out, arms, runs)?;
    std::fs::write(out.join("results.md"), md)?;
    Ok(())
}

pub(super) fn write_table(md: &mut String, arms: &[ArmSummary]) -> anyhow::Result<()> {
    md.push_str(
        "| arm | | seeds | entropy change | final entropy | test acc | test pass@k | clip low | clip high | grad spikes | BAPO regimes (start / moved / exhausted / empty) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in arms {
        let f = |name: &str, digits: usize| {
            s.mean_sd
                .iter()
                .find(|e| e.0 == name)
                .map_or("-".into(), |e| mean_pm_sd(e.1, e.2, digits))
        };
        let regimes = s.regimes.as_ref().map_or("-".into(), |r| {
            format!(
                "{:.2} / {:.2} / {:.2} / {:.2}",
                r.start, r.moved, r.exhausted, r.empty
            )
        });
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.arm,
            s.label,
            s.seeds,
            f("entropy_change", 3),
            f("final_entropy", 3),
            f("test_accuracy", 3),
            f("test_pass_at_k", 3),
            f("clip_frac_low", 4),
            f("clip_frac_high", 4),
            f("grad_spikes", 1),
            regimes
        )?;
    }
    Ok(())
}

/// Seed-mean curves of each arm: fresh-sample entropy and validation
/// accuracy at the probes, and the batch reward (mean of 25 batches; one
/// value per batch, since all its updates train on the same rewards).
pub(super) fn write_charts(
    md: &mut String,
    out: &Path,
    arms: &[Arm],
    runs: &[ArmRun],
) -> anyhow::Result<()> {
    let charts = out.join("charts");
    std::fs::create_dir_all(&charts)?;
    type Pick = fn(&ArmRun) -> Vec<(f64, f64)>;
    let list: [(&str, &str, Pick); 4] = [
        ("entropy", "fresh-sample entropy (nats)", |r| {
            r.probes
                .iter()
                .map(|p| (p.step as f64, p.entropy))
                .collect()
        }),
        ("val_accuracy", "validation accuracy (greedy)", |r| {
            r.probes
                .iter()
                .map(|p| (p.step as f64, p.val_accuracy))
                .collect()
        }),
        (
            "val_sampled",
            "validation accuracy (sampled at the training temperature)",
            |r| {
                r.probes
                    .iter()
                    .filter_map(|p| Some((p.step as f64, p.sampled_accuracy?)))
                    .collect()
            },
        ),
        ("reward", "batch reward (mean of 25 steps)", |r| {
            let pts: Vec<(f64, f64)> = r
                .steps
                .iter()
                .filter(|s| s.update == 0)
                .map(|s| (s.step as f64, s.reward))
                .collect();
            crate::local::report::smooth(&pts, 25)
        }),
    ];
    md.push_str("## Curves (mean over seeds)\n\n");
    for (key, title, pick) in list {
        let series: Vec<Series> = arms
            .iter()
            .filter_map(|arm| {
                let curves: Vec<Vec<(f64, f64)>> =
                    runs.iter().filter(|r| r.arm == arm.id).map(pick).collect();
                let mean = mean_curve(&curves);
                (!mean.is_empty()).then(|| (format!("{}: {}", arm.id, arm.label), mean))
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let svg = line_chart(title, "step", &series)?;
        std::fs::write(charts.join(format!("{key}.svg")), svg)?;
        writeln!(md, "![{title}](charts/{key}.svg)\n")?;
    }
    Ok(())
}

/// `mean ± sd`; the mean alone for one seed, `-` when nothing was measured
/// (pass@k when k is 1).
fn mean_pm_sd(mean: f64, sd: f64, digits: usize) -> String {
    match (mean.is_finite(), sd.is_finite()) {
        (false, _) => "-".into(),
        (true, false) => format!("{mean:.digits$}"),
        (true, true) => format!("{mean:.digits$} ± {sd:.digits$}"),
    }
}

/// Pointwise mean of curves sampled at the same x values.
fn mean_curve(curves: &[Vec<(f64, f64)>]) -> Vec<(f64, f64)> {
    let n = curves.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let ys: f64 = curves.iter().map(|c| c[i].1).sum();
            (curves[0][i].0, ys / curves.len() as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cell_shows_what_was_measured() {
        assert_eq!(mean_pm_sd(0.5, 0.01, 3), "0.500 ± 0.010");
        assert_eq!(mean_pm_sd(0.5, f64::NAN, 3), "0.500", "one seed");
        assert_eq!(mean_pm_sd(f64::NAN, f64::NAN, 3), "-", "not measured");
    }
}
