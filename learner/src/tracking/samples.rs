//! Training rollouts a person can read: at each evaluation step a few
//! rewarded and a few unrewarded responses of the batch just trained on,
//! decoded, with the policy versions of their tokens, whether they ran
//! out of budget, and for episodes who wrote each part. RL debugging
//! starts by reading these (reward hacking, truncation, format drift).

use rand::{SeedableRng, rngs::SmallRng, seq::SliceRandom};
use serde::{Deserialize, Serialize};

use crate::rollouts::{Sequence, TrainGroup};

/// Turns token ids into text (the run's tokenizer).
pub type DecodeFn = std::sync::Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// One part of a response: the policy's turn, or an environment's
/// observation between turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// `"policy"` or `"environment"`.
    pub by: String,
    pub text: String,
}

/// One sampled rollout, as `rollouts.jsonl` holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutSample {
    /// The learner's step when it was picked (the batch it trained on).
    pub step: u64,
    pub group: String,
    pub reward: f32,
    /// A positive reward (the verifiable-reward reading of "right").
    pub rewarded: bool,
    pub prompt: String,
    pub parts: Vec<Part>,
    /// Oldest and newest policy version of its tokens.
    pub versions: [u32; 2],
    pub truncated: bool,
}

impl RolloutSample {
    /// The whole response, parts joined.
    pub fn response(&self) -> String {
        self.parts.iter().map(|p| p.text.as_str()).collect()
    }
}

/// Up to `k` rewarded and `k` unrewarded sequences of `groups`, drawn with
/// a generator seeded by `step`: the same batch gives the same picks.
pub fn pick(groups: &[TrainGroup], k: usize, step: u64) -> Vec<(&str, &Sequence)> {
    let all: Vec<(&str, &Sequence)> = groups
        .iter()
        .flat_map(|g| g.sequences.iter().map(|s| (g.group_id.as_str(), s)))
        .collect();
    let mut rng = SmallRng::seed_from_u64(step);
    let mut out = Vec::new();
    for rewarded in [true, false] {
        let mut side: Vec<_> = all
            .iter()
            .filter(|(_, s)| (s.reward > 0.0) == rewarded)
            .copied()
            .collect();
        side.shuffle(&mut rng);
        out.extend(side.into_iter().take(k));
    }
    out
}

/// `s` decoded, cut into the policy's and the environment's parts.
pub fn sample(step: u64, group: &str, s: &Sequence, decode: &DecodeFn) -> RolloutSample {
    let mut parts: Vec<Part> = Vec::new();
    let mut start = 0;
    for j in 1..=s.response.len() {
        let end = j == s.response.len();
        if end || s.is_policy_token(j) != s.is_policy_token(start) {
            let by = if s.is_policy_token(start) {
                "policy"
            } else {
                "environment"
            };
            parts.push(Part {
                by: by.into(),
                text: decode(&s.response[start..j]),
            });
            start = j;
        }
    }
    let lo = s.versions.iter().copied().min().unwrap_or(0);
    let hi = s.versions.iter().copied().max().unwrap_or(0);
    RolloutSample {
        step,
        group: group.into(),
        reward: s.reward,
        rewarded: s.reward > 0.0,
        prompt: decode(&s.prompt),
        parts,
        versions: [lo, hi],
        truncated: s.truncated,
    }
}

/// A cell of a Markdown table: no line breaks, pipes or markup.
pub fn cell(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' => out.push_str(" ⏎ "),
            '|' | '*' | '_' | '`' | '<' | '>' | '[' | ']' | '#' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// The samples as a table for TensorBoard's text tab, header first.
pub fn table(samples: &[RolloutSample]) -> Vec<Vec<String>> {
    let header = ["reward", "versions", "truncated", "prompt", "response"];
    let mut rows = vec![header.iter().map(|h| format!("**{h}**")).collect()];
    for s in samples {
        let response: Vec<String> = s
            .parts
            .iter()
            .map(|p| match p.by.as_str() {
                "policy" => cell(&p.text),
                _ => format!("\\[env: {}\\]", cell(&p.text)),
            })
            .collect();
        rows.push(vec![
            format!("{}", s.reward),
            format!("{}-{}", s.versions[0], s.versions[1]),
            if s.truncated { "yes" } else { "no" }.into(),
            cell(&s.prompt),
            response.join(" "),
        ]);
    }
    rows
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn seq(reward: f32, response: Vec<u32>, mask: Vec<bool>) -> Sequence {
        let n = response.len();
        Sequence {
            prompt: vec![1, 2],
            versions: (0..n as u32).collect(),
            behavior_logprobs: vec![-1.0; n],
            response,
            reward,
            mask,
            ..Sequence::default()
        }
    }

    fn groups() -> Vec<TrainGroup> {
        (0..3)
            .map(|g| TrainGroup {
                group_id: format!("g{g}"),
                sequence_number: g,
                sequences: (0..4)
                    .map(|i| seq(f32::from(u8::from(i % 2 == 0)), vec![10 + i, 20], vec![]))
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn picks_are_balanced_and_reproducible() {
        let gs = groups();
        let a = pick(&gs, 2, 7);
        assert_eq!(a.len(), 4);
        let rewarded = a.iter().filter(|(_, s)| s.reward > 0.0).count();
        assert_eq!(rewarded, 2);
        let b = pick(&gs, 2, 7);
        let same = a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.0 == y.0 && std::ptr::eq(x.1, y.1));
        assert!(same, "the same step picks the same rollouts");
        // More asked than there are: all of each side.
        assert_eq!(pick(&gs, 100, 1).len(), 12);
    }

    #[test]
    fn an_episode_is_cut_into_its_writers_parts() {
        let decode: DecodeFn = Arc::new(|t: &[u32]| {
            t.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        });
        let s = seq(
            1.0,
            vec![5, 6, 7, 8, 9],
            vec![true, true, false, false, true],
        );
        let r = sample(3, "g", &s, &decode);
        let got: Vec<(&str, &str)> = r
            .parts
            .iter()
            .map(|p| (p.by.as_str(), p.text.as_str()))
            .collect();
        assert_eq!(
            got,
            [("policy", "5,6"), ("environment", "7,8"), ("policy", "9")]
        );
        assert_eq!(r.versions, [0, 4]);
        assert_eq!(r.prompt, "1,2");
        let t = table(&[r]);
        assert_eq!(t.len(), 2);
        assert_eq!(t[1][4], "5,6 \\[env: 7,8\\] 9");
    }

    #[test]
    fn cells_cannot_break_a_table() {
        assert_eq!(cell("a|b\n*c*"), "a\\|b ⏎ \\*c\\*");
    }
}
