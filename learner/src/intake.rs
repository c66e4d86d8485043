//! What the learner accepts of a batch from the buffer: groups it can
//! decode, sampled at its own temperature. The rest is skipped, counted and
//! named in the log, because one bad group must not stop training.
//!
//! The temperature matters because behaviour log-probs are of the
//! temperature-scaled distribution and the learner computes its own at its
//! configured temperature: a group sampled at another one would give every
//! importance ratio against the wrong distribution. Rollouts that carry no
//! sampling settings (older actors) are taken on trust.

use bapo_proto::v1;
use metrics::counter;

use crate::{metrics as names, rollouts::TrainGroup};

/// Relative difference below which two temperatures are the same (they
/// travel as f32 and may pass through a config file's decimal text).
const TEMPERATURE_TOLERANCE: f32 = 1e-6;

/// A batch sorted into what will be trained on and what was skipped.
#[derive(Debug, Default)]
pub struct Intake {
    pub train: Vec<TrainGroup>,
    /// Groups that could not be decoded (named in the log).
    pub bad: usize,
    /// Groups sampled at a temperature other than the learner's.
    pub wrong_temperature: usize,
    /// The first such temperature, for the log.
    pub seen_temperature: Option<f32>,
}

/// Sorts `groups` for a learner sampling at `temperature`, counting and
/// logging what it skips (one warning per batch and reason).
pub fn admit(groups: &[v1::Group], temperature: f32) -> Intake {
    let mut intake = Intake::default();
    for g in groups {
        if let Some(t) = foreign_temperature(g, temperature) {
            intake.wrong_temperature += 1;
            intake.seen_temperature.get_or_insert(t);
            continue;
        }
        match TrainGroup::from_wire(g) {
            Ok(t) => intake.train.push(t),
            Err(e) => {
                intake.bad += 1;
                tracing::warn!("skipping a group the learner cannot train on: {e}");
            }
        }
    }
    record(&intake, groups.len(), temperature);
    intake
}

fn record(intake: &Intake, total: usize, temperature: f32) {
    counter!(names::BAD_GROUPS).increment(intake.bad as u64);
    if let Some(seen) = intake.seen_temperature {
        counter!(names::GROUPS_REFUSED, "reason" => "temperature")
            .increment(intake.wrong_temperature as u64);
        tracing::warn!(
            "refused {} of {total} groups sampled at another temperature than the \
             learner's {temperature} (the first at {seen}): their log-probs are of \
             another distribution; give the actors the learner's temperature",
            intake.wrong_temperature,
        );
    }
}

/// The temperature of the first rollout in `g` sampled at one other than
/// `want`, if any.
fn foreign_temperature(g: &v1::Group, want: f32) -> Option<f32> {
    g.rollouts
        .iter()
        .filter_map(|r| r.sampling.as_ref())
        .map(|s| s.temperature)
        .find(|&t| !same_temperature(t, want))
}

/// Equal within [`TEMPERATURE_TOLERANCE`], relative; NaN equals nothing.
fn same_temperature(a: f32, b: f32) -> bool {
    (a - b).abs() <= TEMPERATURE_TOLERANCE * a.abs().max(b.abs())
}

#[cfg(test)]
mod tests {
    use bapo_proto::packed;

    use super::*;

    fn rollout(id: &str, temperature: Option<f32>) -> v1::Rollout {
        v1::Rollout {
            rollout_id: id.into(),
            group_id: "g".into(),
            prompt_tokens: packed::pack_u32(&[1, 2]),
            response_tokens: packed::pack_u32(&[5, 6]),
            behavior_logprobs: packed::pack_f32(&[-0.1, -0.2]),
            token_versions: packed::pack_u32(&[0, 0]),
            reward: 1.0,
            sampling: temperature.map(|temperature| v1::SamplingParams {
                temperature,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn group(id: &str, temperatures: &[Option<f32>]) -> v1::Group {
        v1::Group {
            group_id: id.into(),
            rollouts: temperatures
                .iter()
                .enumerate()
                .map(|(i, &t)| rollout(&format!("{id}-{i}"), t))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn groups_at_another_temperature_are_refused_and_counted() {
        let groups = [
            group("same", &[Some(0.7), Some(0.7)]),
            group("hotter", &[Some(0.7), Some(1.0)]),
            group("unrecorded", &[None, None]),
            group("colder", &[Some(0.5), Some(0.5)]),
        ];
        let intake = admit(&groups, 0.7);
        let kept: Vec<_> = intake.train.iter().map(|g| g.group_id.as_str()).collect();
        assert_eq!(kept, ["same", "unrecorded"]);
        assert_eq!(intake.wrong_temperature, 2);
        assert_eq!(intake.seen_temperature, Some(1.0));
        assert_eq!(intake.bad, 0);
    }

    #[test]
    fn temperatures_equal_up_to_rounding_are_the_same() {
        let near = 0.7f32 * (1.0 + 2e-7);
        assert!(same_temperature(near, 0.7));
        assert!(same_temperature(1.0, 1.0));
        assert!(!same_temperature(0.7, 0.7001));
        assert!(!same_temperature(f32::NAN, 1.0));
        assert!(!same_temperature(0.0, 1.0));
    }

    #[test]
    fn undecodable_groups_are_counted_apart_from_refused_ones() {
        let mut broken = group("broken", &[Some(1.0)]);
        broken.rollouts[0].behavior_logprobs = packed::pack_f32(&[-0.1]);
        let intake = admit(&[broken, group("ok", &[Some(1.0)])], 1.0);
        assert_eq!((intake.train.len(), intake.bad), (1, 1));
        assert_eq!(intake.wrong_temperature, 0);
    }
}
