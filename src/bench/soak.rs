//! `bapo bench soak`: the whole loop (a durable buffer, the learner, two
//! actors, as `bapo run` starts them) at full speed for a fixed time, with
//! every process's resident memory and the buffer's held bytes sampled
//! every few seconds. A leak shows as memory that keeps rising after the
//! warm-up; this prints each service's RSS at the start and end of the
//! measured window, its peak, and the slope over the second half.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_proto::v1::Stats;
use clap::Args;

use crate::local::{
    supervise::{Children, Services},
    tail::buffer_stats,
};

#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Minutes to run.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 5.0)]
    pub every_s: f64,
    /// Seconds after start that do not count (allocators and caches fill).
    #[arg(long, default_value_t = 60.0)]
    pub warmup_s: f64,
    #[arg(long, default_value_t = 2)]
    pub actors: usize,
    /// Run directory (samples.csv, logs, the buffer's log); a temporary
    /// one by default.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The loop at maximum rate: no warm start, no evaluation, short answers,
/// a durable buffer that compacts its log as it goes.
fn config(data_dir: &Path) -> String {
    format!(
        r#"
[buffer]
group_size = 8
batch_groups = 4
max_staleness = 4
data_dir = "{}"
compact_bytes = 8388608
# Remembered group ids (a bounded index, ~600 bytes a group): the default
# 65536 takes ~15 minutes to fill at this rate, so a 10-minute soak would
# see its growth and could not tell a bound from a leak. 16384 is full
# within the first half.
dedup_window_groups = 16384

[learner]
batch_groups = 4
lr = 1e-5
steps = 0
checkpoint_every = 200
keep_checkpoints = 2
eval_every = 0

[actor]
group_size = 8
concurrency = 1

[actor.sampling]
max_new_tokens = 8
"#,
        data_dir.display()
    )
}

/// One sample: seconds since start, RSS (MiB) per service, buffer stats.
struct Sample {
    t: f64,
    rss: Vec<Option<f64>>,
    stats: Option<Stats>,
}

pub(super) fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let out = args.out.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(out.join("logs"))?;
    let cfg_path = out.join("soak.toml");
    std::fs::write(&cfg_path, config(&out.join("wal")))?;
    let (services, mut children) = Children::start(
        &cfg_path,
        &out.join("learner"),
        &out.join("logs"),
        args.actors,
    )?;
    let names: Vec<String> = children.pids().into_iter().map(|(n, _)| n).collect();
    let samples = sample(&args, &mut children, &services).await;
    children.stop().await;
    let samples = samples?;
    write_csv(&out.join("samples.csv"), &names, &samples)?;
    report(&args, &names, &samples);
    if args.out.is_some() {
        println!("samples: {}", out.join("samples.csv").display());
    }
    Ok(())
}

async fn sample(
    args: &SoakArgs,
    children: &mut Children,
    services: &Services,
) -> anyhow::Result<Vec<Sample>> {
    let start = Instant::now();
    let end = Duration::from_secs_f64(args.minutes * 60.0);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(args.every_s));
    let mut samples = Vec::new();
    while start.elapsed() < end {
        ticker.tick().await;
        anyhow::ensure!(
            !children.learner_done()?,
            "the learner stopped during the soak"
        );
        let rss = children.pids().iter().map(|(_, p)| rss_mib(*p)).collect();
        samples.push(Sample {
            t: start.elapsed().as_secs_f64(),
            rss,
            stats: buffer_stats(services).await,
        });
        let last = samples.last().context("a sample")?;
        eprintln!(
            "{:>6.0} s  version {:>6}  rss {}",
            last.t,
            last.stats.as_ref().map_or(0, |s| s.learner_version),
            last.rss
                .iter()
                .map(|r| r.map_or("-".into(), |m| format!("{m:.0}")))
                .collect::<Vec<_>>()
                .join(" / ")
        );
    }
    Ok(samples)
}

fn write_csv(path: &Path, names: &[String], samples: &[Sample]) -> anyhow::Result<()> {
    let mut text = format!(
        "t_s,{},buffer_bytes_held,groups_held,learner_version\n",
        names
            .iter()
            .map(|n| format!("{n}_rss_mib"))
            .collect::<Vec<_>>()
            .join(",")
    );
    for s in samples {
        let rss: Vec<String> = s
            .rss
            .iter()
            .map(|r| r.map_or(String::new(), |m| format!("{m:.1}")))
            .collect();
        let (bytes, held, version) = s.stats.as_ref().map_or((0, 0, 0), |st| {
            (
                st.bytes_held,
                st.groups_pending + st.groups_ready,
                st.learner_version,
            )
        });
        text += &format!("{:.1},{},{bytes},{held},{version}\n", s.t, rss.join(","));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Least-squares slope of `(t, y)` and its standard error, in units of y
/// per minute (`t` in seconds).
fn slope_per_min(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    if n < 3.0 {
        return (0.0, 0.0);
    }
    let (mt, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (t, y)| (a + t / n, b + y / n));
    let cov: f64 = points.iter().map(|(t, y)| (t - mt) * (y - my)).sum();
    let var: f64 = points.iter().map(|(t, _)| (t - mt).powi(2)).sum();
    if var == 0.0 {
        return (0.0, 0.0);
    }
    let slope = cov / var;
    let resid: f64 = points
        .iter()
        .map(|(t, y)| (y - my - slope * (t - mt)).powi(2))
        .sum();
    let se = (resid / (n - 2.0) / var).sqrt();
    (slope * 60.0, se * 60.0)
}

/// A series' figures over the measured window: start, end, peak, and the
/// slope of its second half with its standard error.
pub(super) fn figures(points: &[(f64, f64)]) -> Option<(f64, f64, f64, (f64, f64))> {
    let first = points.first()?.1;
    let last = points.last()?.1;
    let peak = points.iter().map(|p| p.1).fold(f64::MIN, f64::max);
    let half = &points[points.len() / 2..];
    Some((first, last, peak, slope_per_min(half)))
}

fn report(args: &SoakArgs, names: &[String], samples: &[Sample]) {
    let window: Vec<&Sample> = samples.iter().filter(|s| s.t >= args.warmup_s).collect();
    println!(
        "soak: {:.1} min, {} samples after a {:.0} s warm-up",
        args.minutes,
        window.len(),
        args.warmup_s
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>22}  verdict",
        "service", "start MiB", "end MiB", "peak MiB", "2nd half MiB/min (se)"
    );
    let mut series: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let pts = window
                .iter()
                .filter_map(|s| Some((s.t, s.rss[i]?)))
                .collect();
            (n.clone(), pts)
        })
        .collect();
    let held = window
        .iter()
        .filter_map(|s| Some((s.t, s.stats.as_ref()?.bytes_held as f64 / (1 << 20) as f64)))
        .collect();
    series.push(("held".into(), held));
    for (name, pts) in &series {
        let Some((start, end, peak, (slope, se))) = figures(pts) else {
            println!("{name:<10} no samples");
            continue;
        };
        // Rising: even two standard errors below its estimate, the second
        // half's slope would add more than 1% of the peak (or 1 MiB) over
        // the run's length. Allocator noise of a few MiB is not a trend.
        let budget = (0.01 * peak).max(1.0) / args.minutes.max(1.0);
        let verdict = if slope - 2.0 * se > budget {
            "RISING"
        } else {
            "flat"
        };
        println!(
            "{name:<10} {start:>10.1} {end:>10.1} {peak:>10.1} {slope:>13.3} ({se:>6.3})  {verdict}"
        );
    }
    let versions = |s: Option<&&Sample>| {
        s.and_then(|s| s.stats.as_ref())
            .map_or(0, |s| s.learner_version)
    };
    println!(
        "learner versions {} -> {} in the window",
        versions(window.first()),
        versions(window.last())
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_is_per_minute_and_zero_for_flat_series() {
        let rising: Vec<(f64, f64)> = (0..10)
            .map(|i| (i as f64 * 6.0, 100.0 + i as f64))
            .collect();
        let (slope, se) = slope_per_min(&rising);
        assert!((slope - 10.0).abs() < 1e-9 && se < 1e-9, "{slope} {se}");
        let flat: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 7.0)).collect();
        let (slope, se) = slope_per_min(&flat);
        assert!(slope == 0.0 && se < 1e-9, "{slope} {se}");
        assert_eq!(slope_per_min(&[(1.0, 2.0)]), (0.0, 0.0));
        // Noise around a level: a slope near zero with a standard error
        // that covers it.
        let noisy: Vec<(f64, f64)> = (0..40)
            .map(|i| (i as f64 * 5.0, 80.0 + if i % 2 == 0 { 3.0 } else { -3.0 }))
            .collect();
        let (slope, se) = slope_per_min(&noisy);
        assert!(slope.abs() < 2.0 * se + 0.1, "{slope} {se}");
    }

    #[test]
    fn the_config_parses() {
        let c = crate::config_file::ConfigFile::parse(&config(Path::new("/tmp/x"))).unwrap();
        c.buffer.validate().unwrap();
        c.learner.validate().unwrap();
    }
}
