//! Gate 0 of the reuse study (issue 31): the warm start's positive share of
//! a token-mean loss at ratio 1, on fresh samples. With GRPO advantages a
//! group's positive and negative advantages cancel, so the share is
//! `Σ_{A>0} A·L / Σ |A|·L` over responses of length `L`: below 0.5 exactly
//! when wrong responses are longer than right ones. BAPO's ρ0 = 0.4 binds
//! only if it sits below 0.4, and the search can reach it only if not far
//! below, hence the registered band [0.33, 0.42].
//!
//! The search runs per update, on one mini-batch of a few groups, so the
//! pooled share does not say how often it engages: a pooled 0.389 (probe
//! P5) put only 5% of 8-group mini-batches under ρ0 (G6). Gate 0 therefore
//! also reads the share mini-batch by mini-batch, the groups taken in the
//! order sampled (independent prompts, so consecutive groups are a random
//! mini-batch): the fraction under ρ0 is what Gate 1 sees at ratio 1.

use bapo_learner::loss::bapo::BapoConfig;
use bapo_learner::{
    advantage::{Estimator, group_advantages},
    rollouts::TrainGroup,
};
use bapo_policy::SamplingParams;
use serde::{Deserialize, Serialize};

use super::episode::{Setup, mix};

/// The band Gate 0 requires the positive share to sit in.
pub const GATE0_BAND: (f64, f64) = (0.33, 0.42);

/// Stream key of the gate's prompts and seeds (never a training step's).
const GATE_STREAM: u64 = 0x6761_7465_305f_7331; // "gate0_s1"

/// What Gate 0 measured on one warm start.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// Groups per mini-batch of the study's largest `E`.
    pub minibatch_groups: usize,
    /// The median share over mini-batches with any informative group.
    pub minibatch_share_median: f64,
    /// Mini-batches whose share is under the paper's ρ0, over all of them
    /// (one with no informative group has nothing to balance): where BAPO's
    /// start window misses ρ0 at ratio 1.
    pub minibatch_below_rho0: f64,
}

impl Gate0 {
    pub fn passed(&self) -> bool {
        (GATE0_BAND.0..=GATE0_BAND.1).contains(&self.positive_share)
    }
}

/// Samples `groups` training prompts from warm start `warm` and measures
/// the share.
pub fn measure(
    setup: &Setup,
    warm: u64,
    groups: usize,
    minibatch_groups: usize,
) -> anyhow::Result<Gate0> {
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
        minibatch_groups,
    ))
}

/// The share and the lengths of `groups`; a response is truncated when it
/// fills `cap` tokens without a stop token.
pub fn summarise(
    warm: u64,
    groups: &[TrainGroup],
    cap: usize,
    stop: &[u32],
    minibatch_groups: usize,
) -> Gate0 {
    let (mut right, mut wrong) = (Vec::new(), Vec::new());
    let (mut truncated, mut n) = (0, 0usize);
    let mut parts = Vec::with_capacity(groups.len());
    for g in groups {
        parts.push(contributions(g));
        for s in &g.sequences {
            let len = s.response.len() as f64;
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
    let (median, below) = per_minibatch(&parts, minibatch_groups);
    Gate0 {
        warm,
        groups: groups.len(),
        informative_groups: parts.iter().filter(|(_, all)| *all > 0.0).count(),
        positive_share: share(&parts).unwrap_or(f64::NAN),
        accuracy: right.len() as f64 / n.max(1) as f64,
        right_len_mean: mean(&right),
        wrong_len_mean: mean(&wrong),
        truncated_share: truncated as f64 / n.max(1) as f64,
        minibatch_groups,
        minibatch_share_median: median,
        minibatch_below_rho0: below,
    }
}

/// A group's positive and total advantage mass at ratio 1, `Σ_{A>0} A·L`
/// and `Σ |A|·L` (both 0 for a group whose rewards are all equal).
fn contributions(g: &TrainGroup) -> (f64, f64) {
    let rewards: Vec<f64> = g.sequences.iter().map(|s| f64::from(s.reward)).collect();
    let adv = group_advantages(&rewards, Estimator::Grpo);
    g.sequences
        .iter()
        .zip(&adv)
        .fold((0.0, 0.0), |(pos, all), (s, a)| {
            let len = s.response.len() as f64;
            (pos + a.max(0.0) * len, all + a.abs() * len)
        })
}

/// The share of some groups' summed contributions (`None`: no advantage).
fn share(parts: &[(f64, f64)]) -> Option<f64> {
    let (pos, all) = parts
        .iter()
        .fold((0.0, 0.0), |(p, a), (gp, ga)| (p + gp, a + ga));
    (all > 0.0).then(|| pos / all)
}

/// Over consecutive mini-batches of `size` groups (a last partial one
/// dropped): the median share of those with any advantage, and the
/// fraction of all of them under the paper's ρ0.
fn per_minibatch(parts: &[(f64, f64)], size: usize) -> (f64, f64) {
    let rho0 = BapoConfig::paper().target;
    let chunks: Vec<Option<f64>> = parts.chunks_exact(size.max(1)).map(share).collect();
    let mut shares: Vec<f64> = chunks.iter().flatten().copied().collect();
    shares.sort_by(f64::total_cmp);
    let median = match shares.len() {
        0 => f64::NAN,
        k if k % 2 == 1 => shares[k / 2],
        k => (shares[k / 2 - 1] + shares[k / 2]) / 2.0,
    };
    let below = shares.iter().filter(|&&s| s < rho0).count();
    (median, below as f64 / chunks.len().max(1) as f64)
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
        let g = summarise(0, &[group(&[(10, 1.0), (20, 0.0)])], 20, &[], 1);
        assert!((g.positive_share - 1.0 / 3.0).abs() < 1e-6, "{g:?}");
        assert_eq!((g.right_len_mean, g.wrong_len_mean), (10.0, 20.0));
        assert_eq!(g.truncated_share, 0.5, "the wrong one filled the cap");
        let equal = summarise(
            0,
            &[group(&[(8, 1.0), (8, 0.0)]), group(&[(5, 0.0), (9, 0.0)])],
            20,
            &[],
            1,
        );
        assert!((equal.positive_share - 0.5).abs() < 1e-6, "{equal:?}");
        assert_eq!(equal.informative_groups, 1);
        assert!(
            !equal.passed() && g.passed(),
            "1/3 is in the band, 1/2 is not"
        );
        let in_band = summarise(0, &[group(&[(10, 1.0), (16, 0.0)])], 20, &[], 1);
        assert!(in_band.passed(), "10/26 = 0.385: {in_band:?}");
    }

    /// Seven groups in mini-batches of two: shares 10/30 and 8/16, a third
    /// mini-batch with no informative group, and the seventh group left
    /// out (a partial mini-batch; pooled, it counts: 19/137). One
    /// mini-batch of three is under ρ0, and the median of the two with a
    /// share is (1/3 + 1/2)/2. The first four pooled are 18/46 = 0.391,
    /// under ρ0 as one mini-batch, though only one of its halves is.
    #[test]
    fn the_share_per_mini_batch_by_hand() {
        let groups = [
            group(&[(10, 1.0), (20, 0.0)]),
            group(&[(5, 0.0), (5, 0.0)]),
            group(&[(8, 1.0), (8, 0.0)]),
            group(&[(9, 1.0), (9, 1.0)]),
            group(&[(4, 0.0), (6, 0.0)]),
            group(&[(7, 0.0), (3, 0.0)]),
            group(&[(1, 1.0), (90, 0.0)]),
        ];
        let g = summarise(0, &groups, 100, &[], 2);
        assert!((g.positive_share - 19.0 / 137.0).abs() < 1e-9, "{g:?}");
        assert!((g.minibatch_share_median - (1.0 / 3.0 + 0.5) / 2.0).abs() < 1e-9);
        assert!((g.minibatch_below_rho0 - 1.0 / 3.0).abs() < 1e-9, "{g:?}");
        let pooled = summarise(0, &groups[..4], 100, &[], 4);
        assert!((pooled.positive_share - 18.0 / 46.0).abs() < 1e-9);
        assert_eq!(
            pooled.minibatch_below_rho0, 1.0,
            "one mini-batch of all four"
        );
    }
}
