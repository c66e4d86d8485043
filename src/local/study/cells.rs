//! The study's numbers: one row per run, and the cells (one loss at one
//! staleness bound) that average a row's seeds.

use std::path::PathBuf;

use serde::Serialize;

use crate::local::summary::LocalRunSummary;

/// One run of the study.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub algo: String,
    pub max_staleness: u64,
    pub seed: u64,
    pub summary: LocalRunSummary,
    /// Mean over the run's steps.
    pub mean_entropy: f64,
    pub mean_clip_frac_low: f64,
    pub mean_clip_frac_high: f64,
    /// Seconds of RL until held-out accuracy first reached the target.
    pub seconds_to_target: Option<f64>,
    pub dir: PathBuf,
}

/// One loss at one staleness bound, over its seeds: what the comparison is
/// read from, since one seed's final accuracy moves by a few points.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    pub algo: String,
    pub max_staleness: u64,
    pub seeds: usize,
    pub final_accuracy: MeanSd,
    pub final_pass_at_k: Option<f64>,
    /// Gain over each run's warm start.
    pub gain: MeanSd,
    pub mean_entropy: f64,
    pub mean_clip_frac_low: f64,
    pub mean_clip_frac_high: f64,
    pub rl_seconds: f64,
    pub learner_idle_fraction: f64,
    /// Runs that reached the target, and their mean seconds to it.
    pub reached_target: usize,
    pub seconds_to_target: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MeanSd {
    pub mean: f64,
    /// Sample standard deviation (n - 1); 0 for one seed.
    pub sd: f64,
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
pub fn summarise(rows: &[Row]) -> Vec<Cell> {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn row(algo: &str, s: u64, seed: u64, warm: f64, fin: f64, reached: Option<f64>) -> Row {
        Row {
            algo: algo.into(),
            max_staleness: s,
            seed,
            summary: LocalRunSummary {
                algo: algo.into(),
                lora_rank: None,
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
}
