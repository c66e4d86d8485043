//! Names of the learner's Prometheus metrics, in one place for
//! docs/metrics.md, the dashboard and the alert rules.

use metrics::{counter, gauge, histogram};

use crate::{StepReport, record::Metric};

pub const STEPS: &str = "bapo_learner_steps_total";
pub const POLICY_VERSION: &str = "bapo_learner_policy_version";
pub const LOSS: &str = "bapo_learner_loss";
pub const ENTROPY: &str = "bapo_learner_entropy";
pub const CLIP_LOW: &str = "bapo_learner_clip_low";
pub const CLIP_HIGH: &str = "bapo_learner_clip_high";
pub const POS_FRACTION: &str = "bapo_learner_pos_fraction";
pub const GRAD_NORM: &str = "bapo_learner_grad_norm";
pub const LR: &str = "bapo_learner_lr";
pub const REWARD_MEAN: &str = "bapo_learner_reward_mean";
pub const EVAL_ACCURACY: &str = "bapo_learner_eval_accuracy";
pub const TOKENS_PER_SECOND: &str = "bapo_learner_tokens_per_second";
pub const CLIP_FRACTION: &str = "bapo_learner_clip_fraction";
pub const BATCH_STALENESS: &str = "bapo_learner_batch_staleness";
pub const STEP_SECONDS: &str = "bapo_learner_step_seconds";
pub const IDLE_SECONDS: &str = "bapo_learner_idle_seconds_total";
/// Tracking sinks closed after a failure (`tracking`), by sink.
pub const TRACKING_FAILURES: &str = "bapo_learner_tracking_failures_total";
/// Step records a tracking server's queue had no room for, by sink.
pub const TRACKING_DROPPED: &str = "bapo_learner_tracking_dropped_total";
/// Step records waiting for a tracking server, by sink.
pub const TRACKING_QUEUED: &str = "bapo_learner_tracking_queued";
pub const WEIGHT_SUBSCRIBERS: &str = "bapo_learner_weight_subscribers";
pub const WEIGHT_PUBLISH_SECONDS: &str = "bapo_learner_weight_publish_seconds";
/// Bytes of the newest version whole, and as the delta from the one before.
pub const WEIGHT_PAYLOAD_BYTES: &str = "bapo_learner_weight_payload_bytes";
pub const WEIGHT_DELTA_BYTES: &str = "bapo_learner_weight_delta_bytes";
/// CRC32 of the newest version's payload: what every subscriber's
/// `bapo_actor_weight_crc` must read once it holds that version.
pub const WEIGHT_CRC: &str = "bapo_learner_weight_crc";
/// The version of the newest published weights.
pub const WEIGHT_VERSION: &str = "bapo_learner_weight_version";
/// Label `kind`: `snapshot` or `delta`.
pub const WEIGHT_SENDS: &str = "bapo_learner_weight_sends_total";
pub const WEIGHT_SENT_BYTES: &str = "bapo_learner_weight_sent_bytes_total";
/// Training/inference mismatch (`stats::mismatch_metrics`).
pub const MISMATCH_KL: &str = "bapo_learner_mismatch_kl";
pub const MISMATCH_ESS: &str = "bapo_learner_mismatch_ess";
pub const MISMATCH_OUTSIDE: &str = "bapo_learner_mismatch_outside_fraction";
pub const BAD_GROUPS: &str = "bapo_learner_bad_groups_total";
/// Label `reason`: `temperature` (sampled at another temperature).
pub const GROUPS_REFUSED: &str = "bapo_learner_groups_refused_total";
/// Updates skipped for a non-finite loss or gradient norm.
pub const NONFINITE_UPDATES: &str = "bapo_learner_nonfinite_updates_total";

pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(STEPS, "Optimiser steps taken");
    describe_counter!(
        NONFINITE_UPDATES,
        "Updates skipped for a non-finite loss or gradient norm (three in a row stop the learner)"
    );
    describe_gauge!(POLICY_VERSION, "Policy version after the latest step");
    describe_gauge!(LOSS, "Policy loss of the latest step");
    describe_gauge!(ENTROPY, "Mean token entropy of the latest batch");
    describe_gauge!(CLIP_LOW, "Lower clip bound c_low used by the latest step");
    describe_gauge!(CLIP_HIGH, "Upper clip bound c_high used by the latest step");
    describe_gauge!(
        POS_FRACTION,
        "Share of the loss from positive-advantage tokens (BAPO's target)"
    );
    describe_gauge!(GRAD_NORM, "Global gradient norm before clipping");
    describe_gauge!(LR, "Learning rate applied by the latest step");
    describe_gauge!(REWARD_MEAN, "Mean reward of the latest batch");
    describe_gauge!(
        EVAL_ACCURACY,
        "Held-out greedy accuracy at the latest evaluation"
    );
    describe_gauge!(
        TOKENS_PER_SECOND,
        Unit::CountPerSecond,
        "Trained tokens per second of step time"
    );
    describe_gauge!(
        CLIP_FRACTION,
        "Fraction of tokens clipped, by side (low, high, dual)"
    );
    describe_histogram!(
        BATCH_STALENESS,
        "Staleness of each trained sequence (versions)"
    );
    describe_histogram!(STEP_SECONDS, Unit::Seconds, "Duration of an optimiser step");
    describe_counter!(IDLE_SECONDS, Unit::Seconds, "Time spent waiting for data");
    describe_counter!(
        TRACKING_FAILURES,
        "Tracking sinks (TensorBoard, rollouts, MLflow) closed after a failure, by sink"
    );
    describe_counter!(
        TRACKING_DROPPED,
        "Step records dropped because a tracking server's queue was full, by sink"
    );
    describe_gauge!(
        TRACKING_QUEUED,
        "Step records waiting for a tracking server, by sink"
    );
    describe_gauge!(WEIGHT_SUBSCRIBERS, "Actors subscribed to the weight stream");
    describe_gauge!(
        WEIGHT_PAYLOAD_BYTES,
        Unit::Bytes,
        "The newest version's payload, whole"
    );
    describe_gauge!(
        WEIGHT_DELTA_BYTES,
        Unit::Bytes,
        "The newest version as the delta from the one before (0: none)"
    );
    describe_gauge!(WEIGHT_CRC, "CRC32 of the newest version's payload");
    describe_gauge!(WEIGHT_VERSION, "Version of the newest published weights");
    describe_counter!(
        WEIGHT_SENDS,
        "Versions sent to subscribers, by kind (snapshot, delta)"
    );
    describe_counter!(
        WEIGHT_SENT_BYTES,
        Unit::Bytes,
        "Payload bytes sent to subscribers, by kind (snapshot, delta)"
    );
    describe_histogram!(
        WEIGHT_PUBLISH_SECONDS,
        Unit::Seconds,
        "From publishing a version to its last chunk sent, per subscriber"
    );
    describe_gauge!(
        MISMATCH_KL,
        "k3 estimate of KL(behaviour || learner) over the latest update's tokens"
    );
    describe_gauge!(
        MISMATCH_ESS,
        "Normalised ESS of the token weights learner/behaviour, in (0, 1]"
    );
    describe_gauge!(
        MISMATCH_OUTSIDE,
        "Fraction of tokens whose weight learner/behaviour is outside [0.5, 2]"
    );
    describe_counter!(
        BAD_GROUPS,
        "Groups from the buffer that could not be trained on"
    );
    describe_counter!(
        GROUPS_REFUSED,
        "Groups from the buffer refused by the learner, by reason (temperature)"
    );
}

/// Records a step's report.
pub fn record_step(r: &StepReport, staleness: &[u64]) {
    let m = &r.metrics;
    let get = |k: &str| m.get(k).copied();
    counter!(STEPS).increment(1);
    gauge!(POLICY_VERSION).set(r.version as f64);
    gauge!(LOSS).set(r.loss);
    gauge!(LR).set(r.lr);
    histogram!(STEP_SECONDS).record(r.seconds);
    gauge!(TOKENS_PER_SECOND).set(r.tokens as f64 / r.seconds.max(1e-9));
    let pairs: [(&str, &str); 9] = [
        (ENTROPY, Metric::Entropy.key()),
        (CLIP_LOW, Metric::CLow.key()),
        (CLIP_HIGH, Metric::CHigh.key()),
        (POS_FRACTION, Metric::PosFraction.key()),
        (GRAD_NORM, Metric::GradNorm.key()),
        (REWARD_MEAN, Metric::RewardMean.key()),
        (MISMATCH_KL, "mismatch_kl_k3"),
        (MISMATCH_ESS, "mismatch_ess"),
        (MISMATCH_OUTSIDE, "mismatch_outside_frac"),
    ];
    for (name, key) in pairs {
        if let Some(v) = get(key) {
            gauge!(name).set(v);
        }
    }
    for (side, key) in [
        ("low", Metric::ClipFracLow.key()),
        ("high", Metric::ClipFracHigh.key()),
        ("dual", "dual_clip_frac"),
    ] {
        if let Some(v) = get(key) {
            gauge!(CLIP_FRACTION, "side" => side).set(v);
        }
    }
    for &s in staleness {
        histogram!(BATCH_STALENESS).record(s as f64);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The last value of every gauge set while `f` ran, by name.
    fn gauges(f: impl FnOnce()) -> BTreeMap<String, f64> {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let rec = DebuggingRecorder::new();
        let snapshotter = rec.snapshotter();
        metrics::with_local_recorder(&rec, f);
        let snapshot = snapshotter.snapshot().into_vec().into_iter();
        snapshot
            .filter_map(|(k, _, _, v)| match v {
                DebugValue::Gauge(g) => Some((k.key().name().to_string(), g.into_inner())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn mismatch_metrics_reach_prometheus_and_the_jsonl_record() {
        let report = StepReport {
            step: 3,
            version: 7,
            metrics: [
                ("mismatch_kl_k3", 0.25),
                ("mismatch_ess", 0.75),
                ("mismatch_outside_frac", 0.125),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            ..Default::default()
        };
        let got = gauges(|| record_step(&report, &[]));
        assert_eq!(got[MISMATCH_KL], 0.25);
        assert_eq!(got[MISMATCH_ESS], 0.75);
        assert_eq!(got[MISMATCH_OUTSIDE], 0.125);
        let line = crate::record::StepRecord::of_step(&report, 1.0, 0.0, &BTreeMap::new());
        assert_eq!(line.values["mismatch_kl_k3"], Some(0.25));
        assert_eq!(line.values["mismatch_outside_frac"], Some(0.125));
    }
}
