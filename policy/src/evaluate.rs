//! Held-out evaluation: greedy accuracy (one response per problem) and,
//! optionally, pass@k from k samples. Shared by the learner's periodic
//! evaluation, `bapo eval` and the warm-start report.

use std::collections::BTreeMap;

use bapo_tasks::{Problem, Task};
use serde::Serialize;

use crate::{
    Generation, SamplingParams,
    generate::{Finish, Response},
    policy::Policy,
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
    /// The temperature the k samples were drawn at (k > 1 only).
    pub pass_temperature: Option<f32>,
}

/// pass@k's sampling: `k` samples per problem at `temperature`. Report it
/// at the training temperature: pass@k at another temperature measures a
/// policy nobody trains or deploys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassAtK {
    pub k: usize,
    pub temperature: f32,
}

/// The text a response stands for: its tokens up to a stop token.
pub fn completion(tokenizer: &TextTokenizer, tokens: &[u32], stop: &[u32]) -> String {
    let end = tokens
        .iter()
        .position(|t| stop.contains(t))
        .unwrap_or(tokens.len());
    tokenizer.decode(&tokens[..end]).unwrap_or_default()
}

/// Rows of one batched generation: enough to amortise a decode step's fixed
/// costs over many problems, few enough that the longest response of a
/// batch (the others wait for it) wastes little.
const BATCH_ROWS: usize = 64;

/// Evaluates `policy` on `problems`; `pass` with `k > 1` adds pass@k.
///
/// Problems whose prompts have the same number of tokens are decoded
/// together, [`BATCH_ROWS`] rows at a time: one problem per row for greedy,
/// `k` rows per problem for pass@k (seeded by the batch's first problem).
pub fn evaluate(
    policy: &Policy,
    tokenizer: &TextTokenizer,
    task: &dyn Task,
    problems: &[Problem],
    max_new_tokens: usize,
    stop: &[u32],
    pass: Option<PassAtK>,
) -> EvalResult {
    let (k, temperature) = pass.map_or((1, 1.0), |p| (p.k, p.temperature));
    let full = task.reward_range().1;
    let mut by_len: BTreeMap<usize, Vec<(usize, Vec<u32>)>> = BTreeMap::new();
    for (i, p) in problems.iter().enumerate() {
        if let Ok(t) = tokenizer.encode(&p.prompt)
            && !t.is_empty()
        {
            by_len.entry(t.len()).or_default().push((i, t));
        }
    }
    let score = |i: usize, r: &Response| {
        let text = completion(tokenizer, &r.tokens, stop);
        task.score_response(&problems[i], &text, r.finish == Some(Finish::Length))
    };
    let (mut correct, mut reward_sum, mut pass) = (0usize, 0.0f64, 0usize);
    for bucket in by_len.values() {
        for chunk in bucket.chunks(BATCH_ROWS) {
            let greedy = SamplingParams {
                temperature: 0.0,
                max_new_tokens,
                stop_tokens: stop.to_vec(),
                ..Default::default()
            };
            let mut g = Generation::batch(chunk.iter().map(|(_, t)| t.clone()).collect(), greedy);
            g.run(policy, 0);
            for ((i, _), response) in chunk.iter().zip(g.responses()) {
                let r = score(*i, response);
                reward_sum += r as f64;
                correct += (r >= full) as usize;
            }
        }
        if k < 2 {
            continue;
        }
        for chunk in bucket.chunks((BATCH_ROWS / k).max(1)) {
            let sampled = SamplingParams {
                temperature,
                max_new_tokens,
                stop_tokens: stop.to_vec(),
                seed: chunk[0].0 as u64,
                ..Default::default()
            };
            let prompts = chunk
                .iter()
                .flat_map(|(_, t)| std::iter::repeat_n(t.clone(), k))
                .collect();
            let mut g = Generation::batch(prompts, sampled);
            g.run(policy, 0);
            for ((i, _), samples) in chunk.iter().zip(g.responses().chunks(k)) {
                pass += samples.iter().any(|r| score(*i, r) >= full) as usize;
            }
        }
    }
    let n = problems.len().max(1) as f64;
    EvalResult {
        problems: problems.len(),
        greedy_accuracy: correct as f64 / n,
        mean_reward: reward_sum / n,
        pass_at_k: (k > 1).then(|| pass as f64 / n),
        k,
        pass_temperature: (k > 1).then_some(temperature),
    }
}
