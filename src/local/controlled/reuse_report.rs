//! The reuse study's `results.md`: the gates with their evidence, the
//! warm starts as rows of their own, one row per arm (mean ± sd over warm
//! starts x seeds), the primary contrast, the secondary family with Holm's
//! adjustment, the non-inferiority test, the detectable effect, the curves.

use std::{fmt::Write as _, path::Path};

use super::{
    analysis::{ALPHA, GATE1_MISS},
    arms::Arm,
    episode::ArmRun,
    gate::GATE0_BAND,
    report::{write_charts, write_table},
    reuse_analysis::{Contrast, POWER, ReuseAnalysis},
    stats::Paired,
};

fn yn(b: Option<bool>) -> &'static str {
    match b {
        Some(true) => "passed",
        Some(false) => "failed",
        None => "not run",
    }
}

/// A paired comparison as the report prints it, or `none` without one.
fn paired(p: Option<&Paired>, none: &str) -> String {
    p.map_or(none.into(), |p| {
        format!("{:+.4} (n {}, p = {:.4})", p.diff, p.n, p.p)
    })
}

pub fn write(out: &Path, arms: &[Arm], runs: &[ArmRun], a: &ReuseAnalysis) -> anyhow::Result<()> {
    let mut md = format!(
        "# Sample-reuse study (E = {}): results\n\nWritten by `bapo study --reuse`; \
         the numbers are in `study.json.gz` beside it, the registration in README.md.\n\n",
        a.updates
    );
    write_gates(&mut md, a)?;
    md += "## Warm starts (where every arm starts)\n\n\
           | warm start | fresh-sample entropy | validation acc (greedy) | validation acc (sampled) | test acc | test pass@k |\n\
           |---|---|---|---|---|---|\n";
    for w in &a.warm_starts {
        writeln!(
            md,
            "| {} | {:.3} | {:.3} | {} | {:.3} | {} |",
            w.warm,
            w.entropy,
            w.val_accuracy,
            w.sampled_accuracy.map_or("-".into(), |p| format!("{p:.3}")),
            w.test_accuracy,
            w.test_pass_at_k.map_or("-".into(), |p| format!("{p:.3}"))
        )?;
    }
    md += "\n## Arms\n\n";
    write_table(&mut md, &a.arms)?;
    md += "\n## Contrasts (paired over warm start x seed)\n\n";
    md += "Primary (registered, alone at alpha 0.05):\n\n";
    contrast_line(&mut md, &a.primary)?;
    writeln!(
        md,
        "\nPrimary verdict: BAPO paper mode keeps more entropy than PPO at E = {}: **{}**\n",
        a.updates,
        match a.primary_holds {
            Some(true) => "holds",
            Some(false) => "does not hold",
            None => "not tested",
        }
    )?;
    write_reading(&mut md, a)?;
    md += "Secondary (Holm-adjusted as one family):\n\n";
    for c in &a.secondary {
        contrast_line(&mut md, c)?;
    }
    let ni = &a.non_inferiority;
    writeln!(
        md,
        "\nNon-inferiority, {}: mean {:+.4}, margin {:.2}, one-sided p = {}: **{}**\n",
        ni.name,
        ni.mean_diff,
        ni.margin,
        ni.p.map_or("-".into(), |p| format!("{p:.4}")),
        match ni.holds {
            Some(true) => "non-inferior",
            Some(false) => "not shown non-inferior",
            None => "not tested",
        }
    )?;
    if let Some(e) = a.detectable_effect {
        writeln!(
            md,
            "Power: with these pairs and the observed sd of the primary's differences, \
             a difference of {e:.4} nats in final entropy is detected with probability \
             {POWER} at alpha {ALPHA} (two-sided).\n"
        )?;
    }
    write_charts(&mut md, out, arms, runs)?;
    std::fs::write(out.join("results.md"), md)?;
    Ok(())
}

/// One contrast as a line: its test, adjusted p and whether it is
/// significant, or why there is none.
fn contrast_line(md: &mut String, c: &Contrast) -> std::fmt::Result {
    match &c.test {
        Some(t) => writeln!(
            md,
            "- {}: {:+.4} (sd {:.4}, n {}, t = {:.2}, p = {:.4}, adjusted p = {:.4}){}",
            c.name,
            t.diff,
            t.sd,
            t.n,
            t.t,
            t.p,
            c.p_adjusted.unwrap_or(f64::NAN),
            if c.significant() == Some(true) {
                ": **significant**"
            } else {
                ""
            }
        ),
        None => writeln!(
            md,
            "- {}: no test (arm not run, too few pairs or no variance)",
            c.name
        ),
    }
}

/// What the registration says the primary verdict means when a gate
/// fails in the study, and its sensitivity analysis without a warm start
/// whose search stayed idle.
fn write_reading(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    if a.gate2.passed == Some(false) {
        md.push_str(
            "Gate 2 failed in the study: reuse did not cost entropy here or on-policy \
             training did not learn, so the primary verdict does not test the claim.\n\n",
        );
    }
    if a.gate1_passed == Some(false) {
        md.push_str(
            "Gate 1 failed pooled: BAPO's bound search was not exercised enough to test \
             the claim.\n\n",
        );
    }
    if let Some((w, c)) = &a.primary_sensitivity {
        writeln!(
            md,
            "Sensitivity (registered; Gate 1 failed on warm start {w} alone, not a second \
             test):\n"
        )?;
        contrast_line(md, c)?;
        md.push('\n');
    }
    Ok(())
}

/// Arm f's search and ratio-1 share by quarter of its runs: whether the
/// long failures it answers to last.
fn write_quarters(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    let Some(q) = a
        .arms
        .iter()
        .find(|s| s.arm == "f" && s.seeds > 0)
        .and_then(|f| f.regimes.as_ref())
        .map(|r| &r.by_quarter)
    else {
        return Ok(());
    };
    let searched: Vec<String> = q
        .iter()
        .map(|q| format!("{:.0}%", q.searched * 100.0))
        .collect();
    let share: Vec<String> = q.iter().map(|q| format!("{:.3}", q.ratio1_share)).collect();
    writeln!(
        md,
        "  - by quarter of the runs: searched {}; median share at ratio 1 {}",
        searched.join(" / "),
        share.join(" / ")
    )?;
    Ok(())
}

fn write_gates(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    md.push_str("## Gates\n\n");
    write_gate0(md, a)?;
    write_gate1(md, a)?;
    write_quarters(md, a)?;
    write_gate2(md, a)
}

/// Gate 0: the warm start's positive share at ratio 1, per warm start.
fn write_gate0(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    writeln!(
        md,
        "- Gate 0 (the warm start's positive share at ratio 1 in [{}, {}]): {}",
        GATE0_BAND.0,
        GATE0_BAND.1,
        yn(a.gate0_passed)
    )?;
    for g in &a.gate0 {
        writeln!(
            md,
            "  - warm start {}: share {:.3} over {} groups ({} informative), accuracy {:.3}, \
             right {:.1} / wrong {:.1} tokens, {:.1}% truncated; per mini-batch of {} groups \
             median share {:.3}, {:.1}% under rho0 (what Gate 1 sees at ratio 1)",
            g.warm,
            g.positive_share,
            g.groups,
            g.informative_groups,
            g.accuracy,
            g.right_len_mean,
            g.wrong_len_mean,
            g.truncated_share * 100.0,
            g.minibatch_groups,
            g.minibatch_share_median,
            g.minibatch_below_rho0 * 100.0
        )?;
    }
    Ok(())
}

/// Gate 1: how often BAPO's start window misses rho0, per warm start.
fn write_gate1(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    writeln!(
        md,
        "- Gate 1 (BAPO's start window misses rho0 in >= {:.0}% of arm f's updates): {}{}",
        GATE1_MISS * 100.0,
        yn(a.gate1_passed),
        a.gate1_start_window_miss
            .map_or(String::new(), |m| format!(" (missed in {:.1}%)", m * 100.0))
    )?;
    for (w, m) in &a.gate1_by_warm_start {
        writeln!(md, "  - warm start {w}: missed in {:.1}%", m * 100.0)?;
    }
    Ok(())
}

/// Gate 2: PPO's entropy against its reuse dose, and what reuse costs
/// beyond its updates.
fn write_gate2(md: &mut String, a: &ReuseAnalysis) -> anyhow::Result<()> {
    let d = &a.gate2;
    let doses: Vec<String> = d
        .by_updates
        .iter()
        .map(|(e, c)| format!("E {e}: {c:+.4}"))
        .collect();
    writeln!(
        md,
        "- Gate 2 (PPO [0.8, 1.2] loses entropy faster as E grows, and E = 1 improves \
         validation accuracy, sampled at the training temperature where measured): {}\n  \
         - entropy change by E: {}\n  - slope per doubling of E: {}\n  - E = 1 validation \
         accuracy gain, greedy: {}\n  - E = 1 validation accuracy gain, sampled: {}\n",
        yn(d.passed),
        if doses.is_empty() {
            "-".into()
        } else {
            doses.join(", ")
        },
        paired(d.slope.as_ref(), "-"),
        paired(d.on_policy_gain.as_ref(), "-"),
        paired(d.on_policy_sampled_gain.as_ref(), "-"),
    )?;
    for (e, p) in &d.reuse_vs_fresh {
        writeln!(
            md,
            "- Reuse beyond its updates (entropy change, PPO at E {e} minus the same {e} \
             updates on fresh mini-batches): {}",
            paired(p.as_ref(), "- (fewer than 2 pairs)")
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::controlled::{arms::reuse, episode::synthetic_run, reuse_analysis::analyse};

    /// Three seeds of the dose arms and BAPO: entropy falling with E and
    /// the search engaged on half of f's updates, or neither.
    fn reading(gates_hold: bool) -> String {
        let mut runs = Vec::new();
        for s in 0..3 {
            let j = s as f64 * 0.01;
            let ends = if gates_hold {
                [0.95 + j / 2.0, 0.85 + 2.0 * j, 0.75 - j, 0.6 + j]
            } else {
                [0.6 + j, 0.7 + 2.0 * j, 0.8 - j, 0.9 + j]
            };
            for (arm, end) in ["a", "p2", "p4", "b"].into_iter().zip(ends) {
                runs.push(synthetic_run(arm, (0, s), end, (0.3, 0.4 + j), 0.5));
            }
            let mut f = synthetic_run("f", (0, s), 0.7, (0.3, 0.4), 0.5);
            if !gates_hold {
                f.steps
                    .iter_mut()
                    .for_each(|st| st.search_steps = Some(0.0));
            }
            runs.push(f);
        }
        let a = analyse(8, &reuse(8), &runs, &[], &[], 0.01);
        let mut md = String::new();
        write_reading(&mut md, &a).unwrap();
        md
    }

    #[test]
    fn a_failed_gate_says_the_verdict_does_not_test_the_claim() {
        let failed = reading(false);
        assert!(failed.contains("Gate 2 failed in the study"), "{failed}");
        assert!(failed.contains("Gate 1 failed pooled"), "{failed}");
        assert!(!failed.contains("Sensitivity"), "one warm start: {failed}");
        assert_eq!(reading(true), "", "both gates hold: nothing to qualify");
    }
}
