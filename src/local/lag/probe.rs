//! The primary endpoint: the token entropy of fresh on-policy samples at
//! the training temperature. The training batch's own entropy is measured
//! on stale samples (at lag K they come from a policy K updates old), so it
//! says less about the current policy than samples drawn from it.

use bapo_policy::{Generation, Policy, SamplingParams};

/// Fixed prompts, sampled `k` times each at every probe with the same
/// seeds, so two probes differ only in the policy.
pub struct EntropyProbe {
    pub prompts: Vec<Vec<u32>>,
    pub k: usize,
    pub params: SamplingParams,
}

impl EntropyProbe {
    /// Mean entropy (nats) over the response tokens of fresh samples, each
    /// position's distribution at the sampling temperature.
    pub fn measure(&self, policy: &Policy) -> f64 {
        let (mut sum, mut n) = (0.0, 0usize);
        for (i, prompt) in self.prompts.iter().enumerate() {
            let params = SamplingParams {
                seed: self.params.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ..self.params.clone()
            };
            let mut g = Generation::new(prompt.clone(), self.k, params);
            g.run(policy, 0);
            let responses: Vec<Vec<u32>> =
                g.into_responses().into_iter().map(|r| r.tokens).collect();
            let (s, c) = response_entropy(policy, prompt, &responses, self.params.temperature);
            sum += s;
            n += c;
        }
        if n == 0 { f64::NAN } else { sum / n as f64 }
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
