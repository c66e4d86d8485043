//! The primary endpoint: the token entropy of fresh on-policy samples at
//! the training temperature. The training batch's own entropy is measured
//! on stale samples (at lag K they come from a policy K updates old), so it
//! says less about the current policy than samples drawn from it. The
//! same samples, scored, give the validation accuracy at the training
//! temperature: the quantity RL raises, which greedy decoding of a small
//! model at its ceiling can hide.

use bapo_policy::{Generation, Policy, Response, SamplingParams};

/// Fixed prompts, sampled `k` times each at every probe with the same
/// seeds, so two probes differ only in the policy.
pub struct EntropyProbe {
    pub prompts: Vec<Vec<u32>>,
    pub k: usize,
    pub params: SamplingParams,
}

/// What one probe measured on its fresh samples.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// Mean entropy (nats) over the response tokens.
    pub entropy: f64,
    /// Share of the samples `correct` accepts.
    pub accuracy: f64,
}

impl EntropyProbe {
    /// Mean entropy (nats) over the response tokens of fresh samples, each
    /// position's distribution at the sampling temperature, and the share
    /// of them `correct(prompt index, response)` accepts.
    pub fn measure(&self, policy: &Policy, correct: impl Fn(usize, &Response) -> bool) -> Reading {
        let (mut sum, mut n, mut right, mut samples) = (0.0, 0usize, 0usize, 0usize);
        for (i, prompt) in self.prompts.iter().enumerate() {
            let params = SamplingParams {
                seed: self.params.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ..self.params.clone()
            };
            let mut g = Generation::new(prompt.clone(), self.k, params);
            g.run(policy, 0);
            let responses = g.into_responses();
            right += responses.iter().filter(|r| correct(i, r)).count();
            samples += responses.len();
            let tokens: Vec<Vec<u32>> = responses.into_iter().map(|r| r.tokens).collect();
            let (s, c) = response_entropy(policy, prompt, &tokens, self.params.temperature);
            sum += s;
            n += c;
        }
        let mean = |x: f64, n: usize| if n == 0 { f64::NAN } else { x / n as f64 };
        Reading {
            entropy: mean(sum, n),
            accuracy: mean(right as f64, samples),
        }
    }
}

/// Sum of the entropies at the positions that chose each response token,
/// and how many there are. Rows are right-padded to one length: the model
/// is causal, so padding after a position cannot change it.
fn response_entropy(
    policy: &Policy,
    prompt: &[u32],
    responses: &[Vec<u32>],
    temperature: f32,
) -> (f64, usize) {
    let longest = responses.iter().map(Vec::len).max().unwrap_or(0);
    if longest == 0 {
        return (0.0, 0);
    }
    let width = prompt.len() + longest;
    let rows: Vec<Vec<u32>> = responses
        .iter()
        .map(|r| {
            let mut row = prompt.to_vec();
            row.extend(r);
            row.resize(width, *row.last().unwrap_or(&0));
            row
        })
        .collect();
    let tokens = Policy::tokens(&rows, &policy.device());
    let (_, entropy) = policy.token_logprobs(tokens, temperature);
    let values: Vec<f32> = entropy.into_data().try_to_vec().unwrap_or_default();
    let per_row = width - 1;
    let (mut sum, mut n) = (0.0, 0);
    for (i, r) in responses.iter().enumerate() {
        // Shifted position p predicts token p + 1: the response's first
        // token is predicted at prompt.len() - 1.
        let start = i * per_row + prompt.len() - 1;
        for e in &values[start..start + r.len()] {
            sum += *e as f64;
            n += 1;
        }
    }
    (sum, n)
}
