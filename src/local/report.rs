//! The run report: SVG charts of the learner's metrics log (plotters) and
//! one self-contained `report.html` with them and the summary table.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::Context;
use plotters::prelude::*;

use super::summary::LocalRunSummary;

/// A named series of `(step, value)`.
pub type Series = (String, Vec<(f64, f64)>);

/// Reads `metrics.jsonl` into one series per numeric key.
pub fn read_metrics(path: &Path) -> anyhow::Result<BTreeMap<String, Vec<(f64, f64)>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(serde_json::Value::Object(o)) = serde_json::from_str(line) else {
            continue;
        };
        let Some(step) = o.get("step").and_then(|s| s.as_f64()) else {
            continue;
        };
        for (k, v) in &o {
            if let Some(x) = v.as_f64()
                && x.is_finite()
            {
                out.entry(k.clone()).or_default().push((step, x));
            }
        }
    }
    Ok(out)
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One line chart as SVG text.
pub fn line_chart(title: &str, x_label: &str, series: &[Series]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (640, 320)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
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
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
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
        if series.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK.mix(0.3))
                .draw()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(svg)
}

/// The charts of one run: `(file stem, title, keys)`.
const CHARTS: &[(&str, &str, &[&str])] = &[
    ("reward", "Batch reward (mean)", &["reward_mean"]),
    ("accuracy", "Held-out greedy accuracy", &["eval_accuracy"]),
    ("entropy", "Token entropy", &["entropy"]),
    ("clip_bounds", "Clip bounds", &["c_low", "c_high"]),
    (
        "positive_share",
        "Positive-advantage share of the loss",
        &["pos_fraction"],
    ),
    (
        "staleness",
        "Batch staleness (versions)",
        &["staleness_mean", "staleness_max"],
    ),
    (
        "clip_fractions",
        "Clipped token fractions",
        &["clip_frac_low", "clip_frac_high"],
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

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes `charts/*.svg` and `report.html` into the run directory.
pub fn write(out: &Path, summary: &LocalRunSummary) -> anyhow::Result<()> {
    let metrics = read_metrics(&out.join("metrics.jsonl"))?;
    let charts_dir = out.join("charts");
    std::fs::create_dir_all(&charts_dir)?;
    let mut html = String::new();
    write!(
        html,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>bapo run report</title>\
         <style>body{{font-family:sans-serif;max-width:1320px;margin:2em auto}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:left}}\
         .charts{{display:flex;flex-wrap:wrap;gap:8px}}</style></head><body>\
         <h1>bapo run: {} on max staleness {}</h1><h2>Summary</h2><table>",
        html_escape(&summary.algo),
        summary.max_staleness
    )?;
    let json = serde_json::to_value(summary)?;
    if let serde_json::Value::Object(o) = json {
        for (k, v) in o {
            writeln!(
                html,
                "<tr><th>{}</th><td>{}</td></tr>",
                html_escape(&k),
                html_escape(&v.to_string())
            )?;
        }
    }
    html.push_str("</table><h2>Training</h2><div class=\"charts\">");
    for (stem, title, keys) in CHARTS {
        // Evaluations are sparse and exact; per-step statistics are smoothed.
        let series: Vec<Series> = keys
            .iter()
            .filter_map(|k| {
                let s = metrics.get(*k)?;
                Some(if *k != "eval_accuracy" && s.len() > 100 {
                    (format!("{k} (mean of 25)"), smooth(s, 25))
                } else {
                    (k.to_string(), s.clone())
                })
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let svg = line_chart(title, "step", &series)?;
        std::fs::write(charts_dir.join(format!("{stem}.svg")), &svg)?;
        html.push_str(&svg);
    }
    html.push_str("</div></body></html>\n");
    std::fs::write(out.join("report.html"), html)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(m["reward_mean"], vec![(1.0, 0.5), (2.0, 0.75)]);
        assert!(!m.contains_key("loss"), "null is no point");
        let svg = line_chart(
            "Batch reward",
            "step",
            &[("reward".into(), m["reward_mean"].clone())],
        )
        .unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("Batch reward"),
            "{}",
            &svg[..200]
        );
        assert_eq!(
            smooth(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)], 2),
            vec![(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]
        );
    }
}
