//! Held-out evaluation: greedy accuracy (one response per problem) and,
//! optionally, pass@k from k samples. Shared by the learner's periodic
//! evaluation, `bapo eval` and the warm-start report.

use serde::Serialize;

use crate::{
    Generation, SamplingParams,
    policy::Policy,
    tasks::{Problem, Task},
    tokenizer::TextTokenizer,
};

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EvalResult {
    pub problems: usize,
    /// Share of problems whose greedy response earns the full reward.
    pub greedy_accuracy: f64,
    pub mean_reward: f64,
    /// Share of problems where any of k samples is right (k > 1 only).
    pub pass_at_k: Option<f64>,
    pub k: usize,
}

/// The text a response stands for: its tokens up to a stop token.
pub fn completion(tokenizer: &TextTokenizer, tokens: &[u32], stop: &[u32]) -> String {
    let end = tokens
        .iter()
        .position(|t| stop.contains(t))
        .unwrap_or(tokens.len());
    tokenizer.decode(&tokens[..end]).unwrap_or_default()
}

/// Evaluates `policy` on `problems`. `k > 1` adds pass@k at temperature 1.
pub fn evaluate(
    policy: &Policy,
    tokenizer: &TextTokenizer,
    task: &dyn Task,
    problems: &[Problem],
    max_new_tokens: usize,
    stop: &[u32],
    k: usize,
) -> EvalResult {
    let full = task.reward_range().1;
    let (mut correct, mut reward_sum, mut pass) = (0usize, 0.0f64, 0usize);
    for (i, p) in problems.iter().enumerate() {
        let prompt = match tokenizer.encode(&p.prompt) {
            Ok(t) if !t.is_empty() => t,
            _ => continue,
        };
        let greedy = SamplingParams {
            temperature: 0.0,
            max_new_tokens,
            stop_tokens: stop.to_vec(),
            ..Default::default()
        };
        let mut g = Generation::new(prompt.clone(), 1, greedy);
        g.run(policy, 0);
        let text = completion(tokenizer, &g.responses()[0].tokens, stop);
        let r = task.score(p, &text);
        reward_sum += r as f64;
        correct += (r >= full) as usize;
        if k > 1 {
            let sampled = SamplingParams {
                temperature: 1.0,
                max_new_tokens,
                stop_tokens: stop.to_vec(),
                seed: i as u64,
                ..Default::default()
            };
            let mut g = Generation::new(prompt, k, sampled);
            g.run(policy, 0);
            let any = g
                .responses()
                .iter()
                .any(|r| task.score(p, &completion(tokenizer, &r.tokens, stop)) >= full);
            pass += any as usize;
        }
    }
    let n = problems.len().max(1) as f64;
    EvalResult {
        problems: problems.len(),
        greedy_accuracy: correct as f64 / n,
        mean_reward: reward_sum / n,
        pass_at_k: (k > 1).then(|| pass as f64 / n),
        k,
    }
}
