//! The run report: SVG charts of the learner's metrics log (plotters) and
//! one self-contained `report.html` a person reads: a headline sentence,
//! the key numbers rounded and with units, the buffer's books, what the run
//! did and did not show, and the charts in a grid.

use std::{fmt::Write as _, path::Path};

use anyhow::Context;
use bapo_learner::record::{Metric, StepRecord};
use plotters::prelude::*;

use super::html::escape as html_escape;
use super::summary::LocalRunSummary;

/// A named series of `(step, value)`.
pub type Series = (String, Vec<(f64, f64)>);

/// Reads `metrics.jsonl` into its records.
pub fn read_metrics(path: &Path) -> anyhow::Result<Vec<StepRecord>> {
    StepRecord::read_all(path).with_context(|| format!("reading {}", path.display()))
}

/// Tableau's ten: a study's ten arms each get a colour of their own.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Beyond this many series a legend inside the plot hides the lines it
/// names; it moves to a column of its own beside the plot.
const LEGEND_INSIDE_MAX: usize = 4;
/// Width of that column.
const LEGEND_WIDTH: u32 = 280;

/// One line chart as SVG text.
pub fn line_chart(title: &str, x_label: &str, series: &[Series]) -> anyhow::Result<String> {
    let beside = series.len() > LEGEND_INSIDE_MAX;
    let (w, h) = (640 + if beside { LEGEND_WIDTH } else { 0 }, 320);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (plot, legend) = root.split_horizontally(640);
        draw_plot(&plot, title, x_label, series, !beside)?;
        if beside {
            draw_legend(&legend, series)?;
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    // A viewBox lets the page scale the chart to its grid cell. plotters
    // writes one of its own after the size: a second one makes the file
    // invalid XML, which a browser refuses to show as an image.
    let view = format!(" viewBox=\"0 0 {w} {h}\"");
    let svg = svg.replacen(&view, "", 1);
    Ok(svg.replacen("<svg ", &format!("<svg{view} "), 1))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// The axes and lines, with the legend inside when `legend_inside`.
fn draw_plot(
    area: &Area,
    title: &str,
    x_label: &str,
    series: &[Series],
    legend_inside: bool,
) -> anyhow::Result<()> {
    let points = series.iter().flat_map(|(_, s)| s.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Steps are whole numbers: no `1000.0` on the axis, and no more
    // labels than whole steps (a 3-step run read "1 1 1 2 2 2 ...").
    let x_format = |x: &f64| format!("{x:.0}");
    let x_labels = ((x1 - x0).round() as usize + 1).clamp(2, 10);
    chart
        .configure_mesh()
        .x_desc(x_label)
        .x_labels(x_labels)
        .x_label_formatter(&x_format)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, (name, s)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    if legend_inside && series.len() > 1 {
        chart
            .configure_series_labels()
            .position(emptiest_corner(series, (x0, x1), (y0, y1)))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(())
}

/// The series' names in a column, each beside a stroke of its colour.
fn draw_legend(area: &Area, series: &[Series]) -> anyhow::Result<()> {
    let style = ("sans-serif", 13).into_font().color(&BLACK);
    for (i, (name, _)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = 40 + 20 * i as i32;
        area.draw(&PathElement::new(
            vec![(4, y), (24, y)],
            color.stroke_width(2),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        area.draw(&Text::new(name.as_str(), (30, y - 7), style.clone()))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(())
}

/// The corner of the plot the lines pass through least (sampled along
/// each segment), where the legend covers the least of them: the ends of
/// the lines, which a reader looks at first, are often in the upper right.
fn emptiest_corner(
    series: &[Series],
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> SeriesLabelPosition {
    let frac = |v: f64, lo: f64, hi: f64| if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
    let samples: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|(_, s)| s.windows(2))
        .flat_map(|w| {
            let ((ax, ay), (bx, by)) = (w[0], w[1]);
            (0..=10).map(move |k| {
                let t = f64::from(k) / 10.0;
                (ax + t * (bx - ax), ay + t * (by - ay))
            })
        })
        .map(|(x, y)| (frac(x, x0, x1), frac(y, y0, y1)))
        .collect();
    let corners = [
        (SeriesLabelPosition::UpperRight, true, true),
        (SeriesLabelPosition::UpperLeft, false, true),
        (SeriesLabelPosition::LowerRight, true, false),
        (SeriesLabelPosition::LowerLeft, false, false),
    ];
    let inside = |right: bool, upper: bool| {
        samples
            .iter()
            .filter(|&&(fx, fy)| (fx > 0.5) == right && if upper { fy > 0.55 } else { fy < 0.45 })
            .count()
    };
    corners
        .into_iter()
        .min_by_key(|&(_, right, upper)| inside(right, upper))
        .map_or(SeriesLabelPosition::UpperRight, |c| c.0)
}

/// The charts of one run: `(file stem, title, metrics)`.
const CHARTS: &[(&str, &str, &[Metric])] = &[
    ("reward", "Batch reward (mean)", &[Metric::RewardMean]),
    (
        "accuracy",
        "Validation greedy accuracy",
        &[Metric::EvalAccuracy],
    ),
    ("entropy", "Token entropy (nats)", &[Metric::Entropy]),
    ("clip_bounds", "Clip bounds", &[Metric::CLow, Metric::CHigh]),
    (
        "positive_share",
        "Positive-advantage share of the loss",
        &[Metric::PosFraction],
    ),
    (
        "staleness",
        "Batch staleness (versions)",
        &[Metric::StalenessMean, Metric::StalenessMax],
    ),
    (
        "clip_fractions",
        "Clipped token fractions",
        &[Metric::ClipFracLow, Metric::ClipFracHigh],
    ),
];

/// A trailing moving average over `window` points: per-step batch
/// statistics are noisy, the trend is what a reader wants.
pub fn smooth(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len());
    let mut sum = 0.0;
    for (i, &(x, y)) in points.iter().enumerate() {
        sum += y;
        if i >= window {
            sum -= points[i - window].1;
        }
        out.push((x, sum / (i + 1).min(window) as f64));
    }
    out
}

/// `0.3123` as `31.2%`.
fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// Seconds as `m:ss`, or `h:mm:ss` from an hour.
fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

/// Half-width of the 95% interval of the difference of two accuracies,
/// each measured on `n` problems (as independent proportions, which is
/// conservative for the same problems evaluated twice).
fn noise_95(before: f64, after: f64, n: usize) -> f64 {
    let n = n.max(1) as f64;
    1.96 * ((before * (1.0 - before) + after * (1.0 - after)) / n).sqrt()
}

/// The one sentence a reader takes away.
pub fn headline(s: &LocalRunSummary) -> String {
    let gain = s.final_accuracy - s.warm_start_accuracy;
    let books = if s.reconciled {
        "the buffer's books reconciled"
    } else {
        "the buffer's books did NOT reconcile"
    };
    format!(
        "Held-out accuracy {} \u{2192} {} ({:+.1} points, \u{b1}{:.1} at 95%) after {} RL steps \
         of {} in {} ({} in all); {books}.",
        pct(s.warm_start_accuracy),
        pct(s.final_accuracy),
        100.0 * gain,
        100.0 * noise_95(s.warm_start_accuracy, s.final_accuracy, s.eval_problems),
        s.steps,
        s.algo,
        clock(s.rl_seconds),
        clock(s.total_seconds),
    )
}

/// The key numbers, as (label, value) rows.
fn key_numbers(s: &LocalRunSummary) -> Vec<(String, String)> {
    let warm = match s.sft_steps {
        Some(n) => format!("{n} supervised steps in {}", clock(s.sft_seconds)),
        None => "none (started from given weights)".to_string(),
    };
    let pass = match (s.warm_start_pass_at_k, s.final_pass_at_k) {
        (Some(a), Some(b)) => format!("{} \u{2192} {}", pct(a), pct(b)),
        _ => "not measured".to_string(),
    };
    let rows = [
        ("Algorithm", s.algo.clone()),
        (
            "Trained weights",
            match s.lora_rank {
                Some(r) => format!("LoRA adapters, rank {r} (base frozen)"),
                None => "all".to_string(),
            },
        ),
        ("Max staleness", format!("{} versions", s.max_staleness)),
        ("Actors", s.actors.to_string()),
        ("RL steps", s.steps.to_string()),
        ("Warm start", warm),
        (
            "Held-out greedy accuracy",
            format!(
                "{} \u{2192} {}",
                pct(s.warm_start_accuracy),
                pct(s.final_accuracy)
            ),
        ),
        ("Held-out pass@k", format!("{pass} (k = {})", s.pass_k)),
        (
            "Evaluated on",
            format!("{} test-split problems", s.eval_problems),
        ),
        (
            "Wall-clock",
            format!(
                "{} in all: warm start {}, RL {}",
                clock(s.total_seconds),
                clock(s.sft_seconds),
                clock(s.rl_seconds)
            ),
        ),
        ("Learner idle", pct(s.learner_idle_fraction)),
        (
            "Final entropy",
            s.final_entropy
                .map_or("not measured".into(), |e| format!("{e:.3} nats")),
        ),
        (
            "Books",
            if s.reconciled {
                "reconciled"
            } else {
                "NOT reconciled"
            }
            .to_string(),
        ),
    ];
    rows.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// What the run did and did not show, read off its summary and log.
pub fn observations(s: &LocalRunSummary, records: &[StepRecord]) -> Vec<String> {
    let mut out = Vec::new();
    let gain = s.final_accuracy - s.warm_start_accuracy;
    let noise = noise_95(s.warm_start_accuracy, s.final_accuracy, s.eval_problems);
    out.push(if gain.abs() <= noise {
        format!(
            "The accuracy change ({:+.1} points) is within its 95% noise band (\u{b1}{:.1}): \
             this run does not show that RL changed accuracy.",
            100.0 * gain,
            100.0 * noise
        )
    } else {
        format!(
            "The accuracy change ({:+.1} points) is outside its 95% noise band (\u{b1}{:.1}).",
            100.0 * gain,
            100.0 * noise
        )
    });
    out.extend(bounds_observation(s, records));
    let mean = |m: Metric| {
        let v = StepRecord::series(records, m);
        (!v.is_empty()).then(|| v.iter().map(|p| p.1).sum::<f64>() / v.len() as f64)
    };
    if let (Some(lo), Some(hi)) = (mean(Metric::ClipFracLow), mean(Metric::ClipFracHigh)) {
        out.push(format!(
            "On average {} of the tokens were clipped ({} at the low bound, {} at the high).",
            pct(lo + hi),
            pct(lo),
            pct(hi)
        ));
    }
    if let Some(st) = mean(Metric::StalenessMean) {
        let max = StepRecord::series(records, Metric::StalenessMax)
            .iter()
            .fold(0.0f64, |m, p| m.max(p.1));
        out.push(format!(
            "Trained data was {st:.1} policy versions old on average, {max:.0} at most \
             (bound {}).",
            s.max_staleness
        ));
    }
    let entropy = StepRecord::series(records, Metric::Entropy);
    if entropy.len() >= 20 {
        let ends = |v: &[(f64, f64)]| v.iter().map(|p| p.1).sum::<f64>() / v.len() as f64;
        let k = entropy.len() / 10;
        out.push(format!(
            "Token entropy went from {:.3} to {:.3} nats (mean of the first and last tenth of \
             the steps).",
            ends(&entropy[..k]),
            ends(&entropy[entropy.len() - k..])
        ));
    }
    out.push(format!(
        "The learner waited for data {} of the time.",
        pct(s.learner_idle_fraction)
    ));
    out
}

/// Whether the clip bounds moved: for BAPO, whether its search ever did
/// anything.
fn bounds_observation(s: &LocalRunSummary, records: &[StepRecord]) -> Option<String> {
    let bounds: Vec<(f64, f64)> = records
        .iter()
        .filter_map(|r| Some((r.get(Metric::CLow)?, r.get(Metric::CHigh)?)))
        .collect();
    let &(lo0, hi0) = bounds.first()?;
    let moved = bounds
        .iter()
        .filter(|&&(lo, hi)| (lo - lo0).abs() > 1e-9 || (hi - hi0).abs() > 1e-9)
        .count();
    let max_hi = bounds.iter().fold(hi0, |m, b| m.max(b.1));
    let max_lo = bounds.iter().fold(lo0, |m, b| m.max(b.0));
    Some(match (s.algo.as_str(), moved) {
        ("bapo", 0) => format!(
            "BAPO's bounds never moved from [{lo0:.2}, {hi0:.2}]: the positive share met its \
             target at the first candidate on every step, so this run trained as PPO with \
             those bounds."
        ),
        ("bapo", n) => format!(
            "BAPO's bounds moved on {n} of {} steps (c_high up to {max_hi:.2}, c_low up to \
             {max_lo:.2}).",
            bounds.len()
        ),
        (_, 0) => format!("Fixed clip bounds [{lo0:.2}, {hi0:.2}]."),
        (_, n) => format!("The clip bounds changed on {n} of {} steps.", bounds.len()),
    })
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;max-width:1320px;margin:2em auto;\
    padding:0 1em;color:#222}\
    p.headline{font-size:1.3em;line-height:1.4}\
    .tables{display:flex;flex-wrap:wrap;gap:2em;align-items:flex-start}\
    table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}\
    td.n{text-align:right;font-variant-numeric:tabular-nums}\
    .charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}\
    .charts svg{width:100%;height:auto}\
    table.rollouts td{vertical-align:top}table.rollouts pre{white-space:pre-wrap;margin:0;\
    max-width:560px}tr.right td:first-child{background:#e6f4ea}\
    tr.wrong td:first-child{background:#fce8e6}span.env{color:#777}details{margin:.4em 0}div.between{margin-left:1.5em}";

/// The page, without the charts.
pub fn html_head(s: &LocalRunSummary, records: &[StepRecord]) -> anyhow::Result<String> {
    let mut html = String::new();
    write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>bapo run: {algo}</title>\
         <style>{STYLE}</style></head><body><h1>bapo run: {algo}, max staleness {st}</h1>\
         <p class=\"headline\">{headline}</p><div class=\"tables\"><div><h2>Key numbers</h2>\
         <table>",
        algo = html_escape(&s.algo),
        st = s.max_staleness,
        headline = html_escape(&headline(s)),
    )?;
    for (k, v) in key_numbers(s) {
        writeln!(
            html,
            "<tr><th>{}</th><td>{}</td></tr>",
            html_escape(&k),
            html_escape(&v)
        )?;
    }
    html.push_str("</table></div><div><h2>The buffer's books</h2><table>");
    for (k, v) in &s.buffer {
        writeln!(
            html,
            "<tr><th>{}</th><td class=\"n\">{v}</td></tr>",
            html_escape(&k.replace('_', " "))
        )?;
    }
    html.push_str("</table></div></div><h2>What this run shows</h2><ul>");
    for o in observations(s, records) {
        writeln!(html, "<li>{}</li>", html_escape(&o))?;
    }
    html.push_str("</ul>");
    Ok(html)
}

/// Writes `charts/*.svg` and `report.html` into the run directory.
pub fn write(out: &Path, summary: &LocalRunSummary) -> anyhow::Result<()> {
    let records = read_metrics(&out.join("metrics.jsonl"))?;
    let charts_dir = out.join("charts");
    std::fs::create_dir_all(&charts_dir)?;
    let mut html = html_head(summary, &records)?;
    html.push_str("<h2>Training</h2><div class=\"charts\">");
    for (stem, title, metrics) in CHARTS {
        // Evaluations are sparse and exact; per-step statistics are smoothed.
        let series: Vec<Series> = metrics
            .iter()
            .filter_map(|&m| {
                let s = StepRecord::series(&records, m);
                if s.is_empty() {
                    return None;
                }
                let k = m.key();
                Some(if m != Metric::EvalAccuracy && s.len() > 100 {
                    (format!("{k} (mean of 25)"), smooth(&s, 25))
                } else {
                    (k.to_string(), s)
                })
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let svg = line_chart(title, "step", &series)?;
        std::fs::write(charts_dir.join(format!("{stem}.svg")), &svg)?;
        write!(html, "<div>{svg}</div>")?;
    }
    html.push_str("</div>");
    // A run whose learner kept no samples has no file: the section says so.
    let samples = super::rollouts::read(out).unwrap_or_default();
    html.push_str(&super::rollouts::html_section(&samples));
    html.push_str("</body></html>\n");
    std::fs::write(out.join("report.html"), html)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn ten_series_get_ten_colours_and_a_legend_beside_the_plot() {
        let series: Vec<Series> = (0..10)
            .map(|i| {
                (
                    format!("arm {i}"),
                    vec![(0.0, 0.5), (200.0, 0.4 + 0.01 * i as f64)],
                )
            })
            .collect();
        let svg = line_chart("entropy", "step", &series).unwrap();
        assert!(
            svg.starts_with("<svg viewBox=\"0 0 920 320\""),
            "{}",
            &svg[..80]
        );
        for c in COLORS {
            let hex = format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
            assert!(svg.to_uppercase().contains(&hex), "{hex} unused");
        }
        // Four series keep the legend inside, at the usual size.
        let svg = line_chart("entropy", "step", &series[..4]).unwrap();
        assert!(svg.starts_with("<svg viewBox=\"0 0 640 320\""));
    }

    #[test]
    fn the_legend_goes_where_the_lines_are_not() {
        let rising: Series = ("up".into(), vec![(0.0, 0.0), (10.0, 1.0)]);
        let c = emptiest_corner(&[rising], (0.0, 10.0), (0.0, 1.0));
        assert!(
            matches!(
                c,
                SeriesLabelPosition::UpperLeft | SeriesLabelPosition::LowerRight
            ),
            "a rising line leaves the upper left and lower right empty"
        );
        let falling: Series = ("down".into(), vec![(0.0, 1.0), (10.0, 0.0)]);
        let c = emptiest_corner(&[falling], (0.0, 10.0), (0.0, 1.0));
        assert!(matches!(
            c,
            SeriesLabelPosition::UpperRight | SeriesLabelPosition::LowerLeft
        ));
    }

    #[test]
    fn metrics_become_series_and_charts_name_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":1,\"reward_mean\":0.5,\"loss\":null}\n{\"step\":2,\"reward_mean\":0.75}\nnot json\n",
        )
        .unwrap();
        let m = read_metrics(&path).unwrap();
        let reward = StepRecord::series(&m, Metric::RewardMean);
        assert_eq!(reward, vec![(1.0, 0.5), (2.0, 0.75)]);
        assert!(
            StepRecord::series(&m, Metric::Loss).is_empty(),
            "null is no point"
        );
        let svg = line_chart("Batch reward", "step", &[("reward".into(), reward)]).unwrap();
        assert!(
            svg.starts_with("<svg viewBox") && svg.contains("Batch reward"),
            "{}",
            &svg[..200]
        );
        let tag = &svg[..svg.find('>').unwrap()];
        assert_eq!(tag.matches("viewBox").count(), 1, "one viewBox: {tag}");
        assert_eq!(
            smooth(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)], 2),
            vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]
        );
    }

    fn summary() -> LocalRunSummary {
        LocalRunSummary {
            algo: "bapo".into(),
            lora_rank: None,
            max_staleness: 4,
            actors: 2,
            steps: 1000,
            warm_start_accuracy: 0.3484208583831787,
            warm_start_pass_at_k: Some(0.71),
            final_accuracy: 0.462,
            final_pass_at_k: Some(0.8),
            pass_k: 8,
            eval_problems: 500,
            sft_steps: Some(650),
            sft_seconds: 125.4,
            rl_seconds: 931.951598039,
            total_seconds: 1070.2,
            learner_idle_fraction: 0.12451327,
            final_entropy: Some(0.3450369834899902),
            buffer: BTreeMap::from([
                ("groups_consumed".into(), 8000),
                ("rollouts_rejected".into(), 0),
            ]),
            reconciled: true,
        }
    }

    fn records(bounds: &[(f64, f64)]) -> Vec<StepRecord> {
        bounds
            .iter()
            .enumerate()
            .map(|(i, &(lo, hi))| {
                let mut r = StepRecord {
                    step: i as u64 + 1,
                    ..Default::default()
                };
                r.set(Metric::CLow, lo);
                r.set(Metric::CHigh, hi);
                r.set(Metric::ClipFracLow, 0.01);
                r.set(Metric::ClipFracHigh, 0.02);
                r
            })
            .collect()
    }

    /// The headline's numbers are the summary's, rounded, with units; no
    /// raw floats or JSON quoting reach the page.
    #[test]
    fn the_page_leads_with_the_summary_rounded() {
        let s = summary();
        let h = headline(&s);
        assert_eq!(
            h,
            "Held-out accuracy 34.8% \u{2192} 46.2% (+11.4 points, \u{b1}6.0 at 95%) after 1000 \
             RL steps of bapo in 15:32 (17:50 in all); the buffer's books reconciled."
        );
        let html = html_head(&s, &records(&[(0.6, 1.2); 30])).unwrap();
        assert!(html.contains(&html_escape(&h)));
        for raw in [
            "0.3484208583831787",
            "931.951598039",
            "\"bapo\"",
            "{\"groups",
        ] {
            assert!(!html.contains(raw), "{raw} on the page");
        }
        assert!(html.contains("<th>groups consumed</th><td class=\"n\">8000</td>"));
        assert!(html.contains("0.345 nats") && html.contains("12.5%"));
        assert!(html.contains("never moved from [0.60, 1.20]"), "{html}");
        assert!(html.contains("3.0% of the tokens were clipped"));
    }

    #[test]
    fn moving_bounds_and_noise_are_said_as_they_are() {
        let mut s = summary();
        s.final_accuracy = 0.36;
        s.reconciled = false;
        assert!(headline(&s).contains("did NOT reconcile"));
        let mut b = vec![(0.6, 1.2); 8];
        b[3] = (0.6, 1.5);
        b[5] = (0.64, 1.2);
        let o = observations(&s, &records(&b)).join(" ");
        assert!(o.contains("within its 95% noise band"), "{o}");
        assert!(
            o.contains("moved on 2 of 8 steps (c_high up to 1.50, c_low up to 0.64)"),
            "{o}"
        );
        s.algo = "ppo".into();
        assert!(
            observations(&s, &records(&[(0.8, 1.2); 3]))
                .join(" ")
                .contains("Fixed clip bounds [0.80, 1.20]")
        );
        assert_eq!(clock(59.6), "1:00");
        assert_eq!(clock(3725.0), "1:02:05");
    }
}
