//! Names of the buffer's Prometheus metrics, in one place so docs/metrics.md,
//! dashboards and alert rules have a single source to agree with.
//!
//! The core records through the `metrics` facade; whoever runs the buffer
//! installs an exporter (the `bapo` binary serves `/metrics`).

pub const ROLLOUTS_ACCEPTED: &str = "bapo_buffer_rollouts_accepted_total";
pub const ROLLOUTS_DUPLICATE: &str = "bapo_buffer_rollouts_duplicate_total";
pub const REJECTIONS: &str = "bapo_buffer_rejections_total";
pub const GROUPS_ADMITTED: &str = "bapo_buffer_groups_admitted_total";
pub const EVICTIONS: &str = "bapo_buffer_evictions_total";
pub const GROUPS_CONSUMED: &str = "bapo_buffer_groups_consumed_total";
pub const GROUP_SAMPLES: &str = "bapo_buffer_group_samples_total";
pub const GROUPS: &str = "bapo_buffer_groups";
pub const BYTES: &str = "bapo_buffer_bytes";
pub const LEARNER_VERSION: &str = "bapo_buffer_learner_version";
pub const LEARNER_INCARNATION: &str = "bapo_buffer_learner_incarnation";
pub const LEARNER_INCARNATIONS: &str = "bapo_buffer_learner_incarnations_total";
pub const GROUPS_LOST_TO_ROLLBACK: &str = "bapo_buffer_groups_lost_to_rollback";
pub const ADMISSION_LIMIT: &str = "bapo_buffer_admission_limit";
pub const SAMPLED_STALENESS: &str = "bapo_buffer_sampled_staleness";
pub const GROUP_REUSE: &str = "bapo_buffer_group_reuse";
pub const BACKPRESSURE_SECONDS: &str = "bapo_buffer_backpressure_wait_seconds";
pub const PUSH_SECONDS: &str = "bapo_buffer_push_latency_seconds";
pub const SAMPLE_SECONDS: &str = "bapo_buffer_sample_latency_seconds";
pub const WAL_BYTES: &str = "bapo_buffer_wal_bytes";
pub const WAL_FSYNC_SECONDS: &str = "bapo_buffer_wal_fsync_seconds";
pub const LEASES_GRANTED: &str = "bapo_buffer_leases_granted_total";
pub const LEASES_RENEWED: &str = "bapo_buffer_leases_renewed_total";
pub const LEASES_EXPIRED: &str = "bapo_buffer_leases_expired_total";
pub const LEASES_USED: &str = "bapo_buffer_leases_used_total";
pub const LEASES_RELEASED: &str = "bapo_buffer_leases_released_total";
pub const LEASES: &str = "bapo_buffer_leases";
pub const LEASE_WAIT_SECONDS: &str = "bapo_buffer_lease_wait_seconds";

/// Registers help texts and units with the installed recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(ROLLOUTS_ACCEPTED, "Rollouts stored");
    describe_counter!(
        ROLLOUTS_DUPLICATE,
        "Re-sent rollouts acknowledged without storing them again"
    );
    describe_counter!(REJECTIONS, "Rollouts refused, by reason");
    describe_counter!(GROUPS_ADMITTED, "Groups admitted past the admission bounds");
    describe_counter!(
        EVICTIONS,
        "Groups dropped without being fully used, by reason"
    );
    describe_counter!(GROUPS_CONSUMED, "Groups handed out for the last time");
    describe_counter!(
        GROUP_SAMPLES,
        "Groups handed to the learner (replays included)"
    );
    describe_gauge!(
        GROUPS,
        Unit::Count,
        "Groups held, by state (pending = assembling, ready = sampleable)"
    );
    describe_gauge!(BYTES, Unit::Bytes, "Heap bytes held by stored rollouts");
    describe_gauge!(
        LEARNER_VERSION,
        "Latest policy version the learner reported"
    );
    describe_gauge!(
        LEARNER_INCARNATION,
        "The current learner incarnation id, its low 48 bits (exact as a float; the last 12 \
         hex digits of the id in the logs); 0 before any"
    );
    describe_counter!(
        LEARNER_INCARNATIONS,
        "Learner incarnations adopted (a learner started or resumed from a checkpoint)"
    );
    describe_gauge!(
        GROUPS_LOST_TO_ROLLBACK,
        Unit::Count,
        "Group draws handed out that the learner's current weights do not contain"
    );
    describe_gauge!(
        ADMISSION_LIMIT,
        "(max_staleness + version + 1) * batch_groups: groups admissible so far"
    );
    describe_histogram!(
        SAMPLED_STALENESS,
        "Learner version minus oldest token version of each group handed out"
    );
    describe_histogram!(GROUP_REUSE, "Use count of each group handed out");
    describe_histogram!(
        BACKPRESSURE_SECONDS,
        Unit::Seconds,
        "Time a new group was held by the admission bounds, by bound"
    );
    describe_histogram!(
        PUSH_SECONDS,
        Unit::Seconds,
        "Push stream duration, first message to durable ack"
    );
    describe_histogram!(
        SAMPLE_SECONDS,
        Unit::Seconds,
        "Sample request duration, including waiting for groups"
    );
    describe_gauge!(WAL_BYTES, Unit::Bytes, "Size of the write-ahead log");
    describe_histogram!(WAL_FSYNC_SECONDS, Unit::Seconds, "Duration of WAL fsyncs");
    describe_counter!(
        LEASES_GRANTED,
        "Leases granted: room reserved for a group before it is generated"
    );
    describe_counter!(LEASES_RENEWED, "Outstanding leases extended by their actor");
    describe_counter!(
        LEASES_EXPIRED,
        "Leases that ran out before their group arrived (a dead or stalled actor)"
    );
    describe_counter!(LEASES_USED, "Leases whose group arrived and was admitted");
    describe_gauge!(
        LEASES,
        Unit::Count,
        "Outstanding leases: groups being generated, counted by the admission bounds"
    );
    describe_histogram!(
        LEASE_WAIT_SECONDS,
        Unit::Seconds,
        "Time a new lease request was held before its answer, by outcome"
    );
}

/// The gauge value of incarnation `id`: its low 48 bits, which an f64
/// holds exactly.
pub fn incarnation_value(id: u64) -> f64 {
    (id & 0xffff_ffff_ffff) as f64
}

/// Handles registered once, so the hot path increments an atomic instead of
/// looking a key up in the recorder's registry per rollout. Register after
/// the exporter is installed (handles made before record nothing).
pub struct Handles {
    pub accepted: metrics::Counter,
    pub duplicate: metrics::Counter,
    pub admitted: metrics::Counter,
    pub consumed: metrics::Counter,
    pub samples: metrics::Counter,
    pub pending: metrics::Gauge,
    pub ready: metrics::Gauge,
    pub bytes: metrics::Gauge,
    pub version: metrics::Gauge,
    pub admission_limit: metrics::Gauge,
    pub incarnations: metrics::Counter,
    pub lost_to_rollback: metrics::Gauge,
    pub staleness: metrics::Histogram,
    pub reuse: metrics::Histogram,
    pub sample_seconds: metrics::Histogram,
    /// By [`crate::eviction::EvictReason::index`].
    pub evictions: [metrics::Counter; crate::eviction::EvictReason::ALL.len()],
    /// By [`crate::admission::Hold::index`].
    pub backpressure: [metrics::Histogram; 3],
    pub leases_granted: metrics::Counter,
    pub leases_renewed: metrics::Counter,
    pub leases_expired: metrics::Counter,
    pub leases_used: metrics::Counter,
    pub leases_released: metrics::Counter,
    pub leases: metrics::Gauge,
    pub lease_wait_granted: metrics::Histogram,
    pub lease_wait_not_granted: metrics::Histogram,
}

impl Handles {
    /// Shows `id` as the current learner incarnation. One series, not one
    /// per incarnation: a label per id would add a series at every learner
    /// restart, forever.
    pub fn set_incarnation(&self, id: u64) {
        metrics::gauge!(LEARNER_INCARNATION).set(incarnation_value(id));
    }

    pub fn register() -> Self {
        use crate::{admission::Hold, eviction::EvictReason};
        use metrics::{counter, gauge, histogram};
        Self {
            accepted: counter!(ROLLOUTS_ACCEPTED),
            duplicate: counter!(ROLLOUTS_DUPLICATE),
            admitted: counter!(GROUPS_ADMITTED),
            consumed: counter!(GROUPS_CONSUMED),
            samples: counter!(GROUP_SAMPLES),
            pending: gauge!(GROUPS, "state" => "pending"),
            ready: gauge!(GROUPS, "state" => "ready"),
            bytes: gauge!(BYTES),
            version: gauge!(LEARNER_VERSION),
            admission_limit: gauge!(ADMISSION_LIMIT),
            incarnations: counter!(LEARNER_INCARNATIONS),
            lost_to_rollback: gauge!(GROUPS_LOST_TO_ROLLBACK),
            staleness: histogram!(SAMPLED_STALENESS),
            reuse: histogram!(GROUP_REUSE),
            sample_seconds: histogram!(SAMPLE_SECONDS),
            evictions: EvictReason::ALL.map(|r| counter!(EVICTIONS, "reason" => r.label())),
            backpressure: Hold::ALL.map(|h| histogram!(BACKPRESSURE_SECONDS, "bound" => h.label())),
            leases_granted: counter!(LEASES_GRANTED),
            leases_renewed: counter!(LEASES_RENEWED),
            leases_expired: counter!(LEASES_EXPIRED),
            leases_used: counter!(LEASES_USED),
            leases_released: counter!(LEASES_RELEASED),
            leases: gauge!(LEASES),
            lease_wait_granted: histogram!(LEASE_WAIT_SECONDS, "outcome" => "granted"),
            lease_wait_not_granted: histogram!(LEASE_WAIT_SECONDS, "outcome" => "not_granted"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Every gauge series recorded while `f` ran: name (with labels) → last value.
    fn gauges(f: impl FnOnce()) -> BTreeMap<String, f64> {
        let rec = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = rec.snapshotter();
        metrics::with_local_recorder(&rec, f);
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(k, _, _, v)| match v {
                metrics_util::debugging::DebugValue::Gauge(g) => {
                    let key = k.key();
                    let labels: Vec<String> = key.labels().map(|l| format!("{l:?}")).collect();
                    let name = if labels.is_empty() {
                        key.name().to_string()
                    } else {
                        format!("{}{labels:?}", key.name())
                    };
                    Some((name, g.into_inner()))
                }
                _ => None,
            })
            .collect()
    }

    /// Learner restarts must not grow the exposition: one series holds the
    /// current incarnation, whatever came before.
    #[test]
    fn every_incarnation_shares_one_series() {
        let got = gauges(|| {
            let h = Handles::register();
            for id in [0xA, 0xB, 0x0123_4567_89ab_cdef] {
                h.set_incarnation(id);
            }
        });
        let series: Vec<_> = got
            .iter()
            .filter(|(k, _)| k.starts_with(LEARNER_INCARNATION))
            .collect();
        assert_eq!(series.len(), 1, "{series:?}");
        assert_eq!(*series[0].1, 0x4567_89ab_cdef_u64 as f64);
        assert_eq!(incarnation_value(0x4567_89ab_cdef) as u64, 0x4567_89ab_cdef);
    }
}
