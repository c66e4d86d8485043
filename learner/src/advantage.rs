//! Group-relative advantages: every response of a prompt is scored against
//! its group. GRPO divides by the group's std (verl: unbiased, ε 1e−6);
//! Dr. GRPO does not (the std division biases towards easy and hard
//! questions). Groups whose rewards are all equal carry no signal; they are
//! counted and can be filtered (DAPO's dynamic sampling).

use serde::{Deserialize, Serialize};

pub const EPS_ADV: f64 = 1e-6;

/// How a group's rewards become advantages; `[learner] advantage` names
/// one, else the loss's registry entry chooses (`loss::registry::ENTRIES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Estimator {
    /// `(R − mean) / (std + ε)` with the unbiased (N − 1) std, as
    /// `torch.std` in verl.
    Grpo,
    /// `(R − mean) / (std + ε)` with the population (N) std, as numpy and
    /// VCPO's helper.
    GrpoPopulation,
    /// `R − mean`: Dr. GRPO, and Trinity's REINFORCE family (OPMD, AsymRE;
    /// AsymRE's lowered baseline lives in its loss, not here).
    DrGrpo,
}

impl Estimator {
    pub fn name(self) -> &'static str {
        match self {
            Estimator::Grpo => "grpo",
            Estimator::GrpoPopulation => "grpo-population",
            Estimator::DrGrpo => "dr-grpo",
        }
    }
}

/// Advantages of one group, in the order of `rewards`.
pub fn group_advantages(rewards: &[f64], est: Estimator) -> Vec<f64> {
    let n = rewards.len();
    if n == 0 {
        return Vec::new();
    }
    // verl: a group of one has mean 0 and std 1.
    let (mean, std_unbiased, std_pop) = if n == 1 {
        (0.0, 1.0, 1.0)
    } else {
        let mean = rewards.iter().sum::<f64>() / n as f64;
        let ss: f64 = rewards.iter().map(|r| (r - mean).powi(2)).sum();
        (mean, (ss / (n - 1) as f64).sqrt(), (ss / n as f64).sqrt())
    };
    rewards
        .iter()
        .map(|r| match est {
            Estimator::Grpo => (r - mean) / (std_unbiased + EPS_ADV),
            Estimator::GrpoPopulation => (r - mean) / (std_pop + EPS_ADV),
            Estimator::DrGrpo => r - mean,
        })
        .collect()
}

/// Whether a group's rewards are all equal (no learning signal).
pub fn zero_variance(rewards: &[f64]) -> bool {
    rewards.windows(2).all(|w| w[0] == w[1])
}

/// Advantages of many groups, with the zero-variance ones counted and,
/// when `filter` is set, dropped (`None` in their place).
pub struct BatchAdvantages {
    pub groups: Vec<Option<Vec<f64>>>,
    pub zero_variance_groups: usize,
}

pub fn batch_advantages(groups: &[Vec<f64>], est: Estimator, filter: bool) -> BatchAdvantages {
    let mut zero = 0;
    let groups = groups
        .iter()
        .map(|g| {
            let flat = zero_variance(g);
            zero += flat as usize;
            (!(flat && filter)).then(|| group_advantages(g, est))
        })
        .collect();
    BatchAdvantages {
        groups,
        zero_variance_groups: zero,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testing::{close, close_all};

    const R: [f64; 4] = [1.0, 0.0, 0.0, 1.0];

    #[test]
    fn t4_group_advantages() {
        let unbiased = Estimator::Grpo;
        let a = group_advantages(&R, unbiased);
        close_all(&a, &[0.866024, -0.866024, -0.866024, 0.866024]);
        let p = group_advantages(&R, Estimator::GrpoPopulation);
        close(p[0], 0.999998);
        close_all(
            &group_advantages(&R, Estimator::DrGrpo),
            &[0.5, -0.5, -0.5, 0.5],
        );
        close_all(&group_advantages(&[0.7; 3], unbiased), &[0.0; 3]);
    }

    #[test]
    fn advantages_are_shift_invariant_and_sum_to_zero() {
        let rs = [0.3, 1.7, -2.0, 0.9, 0.0];
        let shifted: Vec<f64> = rs.iter().map(|r| r + 5.0).collect();
        for est in [
            Estimator::Grpo,
            Estimator::GrpoPopulation,
            Estimator::DrGrpo,
        ] {
            let a = group_advantages(&rs, est);
            let b = group_advantages(&shifted, est);
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-9);
            }
            assert!(a.iter().sum::<f64>().abs() < 1e-9);
        }
        // Scaling the rewards does not change GRPO's advantages (up to ε).
        let scaled: Vec<f64> = rs.iter().map(|r| r * 10.0).collect();
        let u = Estimator::Grpo;
        for (x, y) in group_advantages(&rs, u)
            .iter()
            .zip(group_advantages(&scaled, u))
        {
            assert!((x - y).abs() < 1e-5);
        }
    }

    #[test]
    fn zero_variance_groups_are_counted_and_filtered() {
        let groups = vec![vec![1.0, 1.0], vec![0.0, 1.0], vec![0.0, 0.0]];
        let kept = batch_advantages(&groups, Estimator::DrGrpo, true);
        assert_eq!(kept.zero_variance_groups, 2);
        assert!(kept.groups[0].is_none() && kept.groups[2].is_none());
        assert_eq!(kept.groups[1].as_deref(), Some(&[-0.5, 0.5][..]));
        let all = batch_advantages(&groups, Estimator::DrGrpo, false);
        assert!(all.groups.iter().all(Option::is_some));
    }
}
