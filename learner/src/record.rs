//! One line of `metrics.jsonl`, and the names of the values that anything
//! outside the learner reads (the progress line, the run report, the
//! studies). Writers and readers both name a value through [`Metric`], so
//! renaming one is a compile error everywhere, not a silently empty chart.

use std::{collections::BTreeMap, path::Path};

use serde::{Deserialize, Serialize};

use crate::StepReport;

/// The values read across crates, by their key in `metrics.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    Loss,
    TimeS,
    IdleS,
    StepS,
    TokensPerS,
    RewardMean,
    StalenessMean,
    StalenessMax,
    Entropy,
    GradNorm,
    CLow,
    CHigh,
    PosFraction,
    SearchSteps,
    TargetMet,
    ClipFracLow,
    ClipFracHigh,
    EvalAccuracy,
    GroupsDrawn,
}

impl Metric {
    pub const fn key(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::TimeS => "time_s",
            Metric::IdleS => "idle_s",
            Metric::StepS => "step_s",
            Metric::TokensPerS => "tokens_per_s",
            Metric::RewardMean => "reward_mean",
            Metric::StalenessMean => "staleness_mean",
            Metric::StalenessMax => "staleness_max",
            Metric::Entropy => "entropy",
            Metric::GradNorm => "grad_norm",
            Metric::CLow => "c_low",
            Metric::CHigh => "c_high",
            Metric::PosFraction => "pos_fraction",
            Metric::SearchSteps => "search_steps",
            Metric::TargetMet => "target_met",
            Metric::ClipFracLow => "clip_frac_low",
            Metric::ClipFracHigh => "clip_frac_high",
            Metric::EvalAccuracy => "eval_accuracy",
            Metric::GroupsDrawn => "groups_drawn",
        }
    }
}

/// The per-update values a batch of several updates also reports as means
/// over its updates (a reuse study reads the batch, not only its last
/// update).
pub const BATCH_MEANS: [Metric; 6] = [
    Metric::ClipFracLow,
    Metric::ClipFracHigh,
    Metric::PosFraction,
    Metric::SearchSteps,
    Metric::TargetMet,
    Metric::GradNorm,
];

/// `<key>_batch_mean` of each [`BATCH_MEANS`] value the updates of one
/// batch report, over those that report it; empty for a single update.
pub fn batch_means(updates: &[StepReport]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if updates.len() < 2 {
        return out;
    }
    for m in BATCH_MEANS {
        let xs: Vec<f64> = updates
            .iter()
            .filter_map(|r| r.metrics.get(m.key()).copied())
            .collect();
        if !xs.is_empty() {
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            out.insert(format!("{}_batch_mean", m.key()), mean);
        }
    }
    out
}

impl From<Metric> for String {
    fn from(m: Metric) -> String {
        m.key().to_string()
    }
}

/// A step's (or an evaluation's) line: its step and version, and every
/// value by key. A non-finite value is written as `null` and reads back as
/// absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    #[serde(default)]
    pub version: u64,
    #[serde(flatten)]
    pub values: BTreeMap<String, Option<f64>>,
}

impl StepRecord {
    pub fn get(&self, m: Metric) -> Option<f64> {
        self.values.get(m.key()).copied().flatten()
    }

    /// Sets `key` to `v`, `None` where it is not finite.
    pub fn set(&mut self, key: impl Into<String>, v: f64) {
        self.values.insert(key.into(), v.is_finite().then_some(v));
    }

    /// The line of one optimiser update; `extra` (evaluation results,
    /// `groups_drawn`) is added to it.
    pub fn of_step(
        r: &StepReport,
        elapsed_s: f64,
        idle_s: f64,
        extra: &BTreeMap<String, f64>,
    ) -> Self {
        let mut out = Self {
            step: r.step,
            version: r.version,
            values: BTreeMap::new(),
        };
        let fixed = [
            (Metric::TimeS.key(), elapsed_s),
            (Metric::IdleS.key(), idle_s),
            (Metric::Loss.key(), r.loss),
            ("lr", r.lr),
            ("sequences", r.sequences as f64),
            ("tokens", r.tokens as f64),
            (Metric::StepS.key(), r.seconds),
            (
                Metric::TokensPerS.key(),
                r.tokens as f64 / r.seconds.max(1e-9),
            ),
        ];
        for (k, v) in fixed {
            out.set(k, v);
        }
        for (k, v) in r.metrics.iter().chain(extra) {
            out.set(k.clone(), *v);
        }
        out
    }

    /// The line of an evaluation outside a step (the start of a run).
    pub fn of_eval(step: u64, version: u64, time_s: f64, results: &[(String, f64)]) -> Self {
        let mut out = Self {
            step,
            version,
            values: BTreeMap::new(),
        };
        out.set(Metric::TimeS, time_s);
        for (k, v) in results {
            out.set(k.clone(), *v);
        }
        out
    }

    /// Every record of a `metrics.jsonl` (lines that are not records, such
    /// as a line cut short by a crash, are skipped).
    pub fn read_all(path: &Path) -> std::io::Result<Vec<StepRecord>> {
        Ok(std::fs::read_to_string(path)?
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }

    /// `(step, value)` of `m` over `records`, where present.
    pub fn series(records: &[StepRecord], m: Metric) -> Vec<(f64, f64)> {
        records
            .iter()
            .filter_map(|r| Some((r.step as f64, r.get(m)?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, metrics: &[(Metric, f64)]) -> StepReport {
        StepReport {
            step,
            version: step,
            loss: 0.0,
            lr: 1e-4,
            sequences: 8,
            tokens: 64,
            seconds: 1.0,
            metrics: metrics
                .iter()
                .map(|(m, v)| (m.key().to_string(), *v))
                .collect(),
        }
    }

    #[test]
    fn batch_means_average_each_value_over_the_updates_reporting_it() {
        let updates = [
            report(1, &[(Metric::ClipFracLow, 0.0), (Metric::PosFraction, 0.5)]),
            report(2, &[(Metric::ClipFracLow, 0.1), (Metric::PosFraction, 0.3)]),
            report(3, &[(Metric::ClipFracLow, 0.2), (Metric::GradNorm, 2.0)]),
        ];
        let m = batch_means(&updates);
        assert!((m["clip_frac_low_batch_mean"] - 0.1).abs() < 1e-12);
        assert!((m["pos_fraction_batch_mean"] - 0.4).abs() < 1e-12);
        assert_eq!(m["grad_norm_batch_mean"], 2.0);
        assert!(
            !m.contains_key("target_met_batch_mean"),
            "no update reported it"
        );
        assert!(
            batch_means(&updates[..1]).is_empty(),
            "one update: no means"
        );
    }

    #[test]
    fn a_record_round_trips_and_non_finite_values_read_back_absent() {
        let mut m = BTreeMap::new();
        m.insert(Metric::RewardMean.into(), 0.5);
        m.insert("c_low".to_string(), f64::NAN);
        let r = StepReport {
            step: 3,
            version: 4,
            loss: 0.25,
            lr: 1e-4,
            sequences: 8,
            tokens: 64,
            seconds: 2.0,
            metrics: m,
        };
        let extra = BTreeMap::from([(Metric::GroupsDrawn.into(), 12.0)]);
        let rec = StepRecord::of_step(&r, 10.0, 1.0, &extra);
        let line = serde_json::to_string(&rec).unwrap();
        assert!(line.contains("\"c_low\":null"), "{line}");
        let back: StepRecord = serde_json::from_str(&line).unwrap();
        assert_eq!(back, rec);
        assert_eq!((back.step, back.version), (3, 4));
        assert_eq!(back.get(Metric::RewardMean), Some(0.5));
        assert_eq!(back.get(Metric::TokensPerS), Some(32.0));
        assert_eq!(back.get(Metric::GroupsDrawn), Some(12.0));
        assert_eq!(back.get(Metric::CLow), None);
        assert_eq!(back.get(Metric::EvalAccuracy), None);
    }
}
