//! Gate 0 of the reuse study (issue 31): the warm start's positive share of
//! a token-mean loss at ratio 1, on fresh samples. With GRPO advantages a
//! group's positive and negative advantages cancel, so the share is
//! `Σ_{A>0} A·L / Σ |A|·L` over responses of length `L`: below 0.5 exactly
//! when wrong responses are longer than right ones. BAPO's ρ0 = 0.4 binds
//! only if it sits below 0.4, and the search can reach it only if not far
//! below, hence the registered band [0.33, 0.42].

use bapo_learner::{
    advantage::{Estimator, group_advantages},
    rollouts::TrainGroup,
};
use bapo_policy::SamplingParams;
use serde::Serialize;

use super::episode::{Setup, mix};

/// The band Gate 0 requires the positive share to sit in.
pub const GATE0_BAND: (f64, f64) = (0.33, 0.42);

/// Stream key of the gate's prompts and seeds (never a training step's).
const GATE_STREAM: u64 = 0x6761_7465_305f_7331; // "gate0_s1"

/// What Gate 0 measured on one warm start.
#[derive(Debug, Clone, Serialize)]
pub struct Gate0 {
    pub warm: u64,
    pub groups: usize,
    /// Groups with both right and wrong responses (the others have no
    /// advantage and no share).
    pub informative_groups: usize,
    pub positive_share: f64,
    pub accuracy: f64,
    pub right_len_mean: f64,
    pub wrong_len_mean: f64,
    /// Responses cut off by the token cap (all wrong).
    pub truncated_share: f64,
}

impl Gate0 {
    pub fn passed(&self) -> bool {
        (GATE0_BAND.0..=GATE0_BAND.1).contains(&self.positive_share)
    }
}

/// Samples `groups` training prompts from warm start `warm` and measures
/// the share.
pub fn measure(setup: &Setup, warm: u64, groups: usize) -> anyhow::Result<Gate0> {
    let policy = setup.load(warm)?;
    let sampled: Vec<TrainGroup> = (0..groups as u64)
        .map(|i| {
            let problem = setup.task.train_problem(mix(&[GATE_STREAM, warm, i]) >> 1);
            let params = SamplingParams {
                seed: mix(&[GATE_STREAM, warm, i, 1]),
                ..setup.sampling.clone()
            };
            setup.group(&problem, params, &policy, 0, i)
        })
        .collect();
    Ok(summarise(
        warm,
        &sampled,
        setup.sampling.max_new_tokens,
        &setup.stop,
    ))
}

/// The share and the lengths of `groups`; a response is truncated when it
/// fills `cap` tokens without a stop token.
pub fn summarise(warm: u64, groups: &[TrainGroup], cap: usize, stop: &[u32]) -> Gate0 {
    let (mut pos, mut all) = (0.0, 0.0);
    let (mut right, mut wrong) = (Vec::new(), Vec::new());
    let (mut informative, mut truncated, mut n) = (0, 0, 0usize);
    for g in groups {
        let rewards: Vec<f64> = g.sequences.iter().map(|s| f64::from(s.reward)).collect();
        let adv = group_advantages(&rewards, Estimator::Grpo);
        informative += adv.iter().any(|a| *a != 0.0) as usize;
        for (s, a) in g.sequences.iter().zip(&adv) {
            let len = s.response.len() as f64;
            if *a > 0.0 {
                pos += a * len;
            }
            all += a.abs() * len;
            if s.reward > 0.0 {
                &mut right
            } else {
                &mut wrong
            }
            .push(len);
            let ended = s.response.last().is_some_and(|t| stop.contains(t));
            truncated += (s.response.len() >= cap && !ended) as usize;
            n += 1;
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Gate0 {
        warm,
        groups: groups.len(),
        informative_groups: informative,
        positive_share: if all > 0.0 { pos / all } else { f64::NAN },
        accuracy: right.len() as f64 / n.max(1) as f64,
        right_len_mean: mean(&right),
        wrong_len_mean: mean(&wrong),
        truncated_share: truncated as f64 / n.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use bapo_learner::rollouts::Sequence;

    use super::*;

    fn group(responses: &[(usize, f32)]) -> TrainGroup {
        TrainGroup {
            group_id: "g".into(),
            sequences: responses
                .iter()
                .map(|&(len, reward)| Sequence {
                    prompt: vec![1],
                    response: vec![7; len],
                    behavior_logprobs: vec![-1.0; len],
                    versions: vec![0; len],
                    reward,
                    ..Default::default()
                })
                .collect(),
            sequence_number: 0,
        }
    }

    /// One right response of 10 tokens and one wrong of 20: GRPO gives
    /// ±1/√2 (sd of [1, 0] is √½), so the share is 10 / (10 + 20) = 1/3.
    /// Equal lengths give one half; a group all wrong adds nothing.
    #[test]
    fn the_share_is_the_right_lengths_share_by_hand() {
        let g = summarise(0, &[group(&[(10, 1.0), (20, 0.0)])], 20, &[]);
        assert!((g.positive_share - 1.0 / 3.0).abs() < 1e-6, "{g:?}");
        assert_eq!((g.right_len_mean, g.wrong_len_mean), (10.0, 20.0));
        assert_eq!(g.truncated_share, 0.5, "the wrong one filled the cap");
        let equal = summarise(
            0,
            &[group(&[(8, 1.0), (8, 0.0)]), group(&[(5, 0.0), (9, 0.0)])],
            20,
            &[],
        );
        assert!((equal.positive_share - 0.5).abs() < 1e-6, "{equal:?}");
        assert_eq!(equal.informative_groups, 1);
        assert!(
            !equal.passed() && g.passed(),
            "1/3 is in the band, 1/2 is not"
        );
        let in_band = summarise(0, &[group(&[(10, 1.0), (16, 0.0)])], 20, &[]);
        assert!(in_band.passed(), "10/26 = 0.385: {in_band:?}");
    }
}
