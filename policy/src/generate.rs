//! Batched incremental decoding of K responses to one prompt (a group), or
//! of one response each to several prompts of one length (evaluation), with
//! a KV cache, pausable after any token: drop the cache with
//! [`Generation::invalidate_cache`], swap the weights, and the next step
//! rebuilds the cache from the prompt and the tokens so far with the new
//! weights. Every token records the behaviour log-prob and the policy
//! version that produced it.

use crate::{
    cache::KvCache,
    policy::Policy,
    sampling::{Sampler, SamplingParams},
};

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

/// One response being generated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Response {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u32>,
    pub finish: Option<Finish>,
}

/// The state of one group's generation: owned per request.
pub struct Generation {
    /// One prompt per row, all of one length (the model has no padding
    /// mask, so rows advance in lockstep from the same position).
    prompts: Vec<Vec<u32>>,
    responses: Vec<Response>,
    /// Tokens fed after the prompt, per row: the response so far, padded
    /// with its last token once finished (rows advance in lockstep).
    fed: Vec<Vec<u32>>,
    sampler: Sampler,
    cache: Option<KvCache>,
}

impl Generation {
    /// `n` responses to `prompt`: a group.
    pub fn new(prompt: Vec<u32>, n: usize, params: SamplingParams) -> Self {
        Self::batch(vec![prompt; n], params)
    }

    /// One response to each of `prompts`, which must all have the same,
    /// non-zero length; one sampler (and RNG) serves every row.
    pub fn batch(prompts: Vec<Vec<u32>>, params: SamplingParams) -> Self {
        let len = prompts.first().map_or(0, Vec::len);
        assert!(len > 0, "a prompt needs at least one token");
        assert!(
            prompts.iter().all(|p| p.len() == len),
            "batched prompts must have one length"
        );
        let n = prompts.len();
        Self {
            prompts,
            responses: vec![Response::default(); n],
            fed: vec![Vec::new(); n],
            sampler: Sampler::new(params),
            cache: None,
        }
    }

    pub fn responses(&self) -> &[Response] {
        &self.responses
    }

    pub fn into_responses(self) -> Vec<Response> {
        self.responses
    }

    pub fn is_done(&self) -> bool {
        self.responses.iter().all(|r| r.finish.is_some())
    }

    /// Forgets the cache; the next step recomputes it (new weights).
    pub fn invalidate_cache(&mut self) {
        self.cache = None;
    }

    /// Samples one more token for every unfinished response.
    pub fn step(&mut self, policy: &Policy, version: u32) {
        if self.is_done() {
            return;
        }
        let device = policy.device();
        let logits = match &mut self.cache {
            Some(cache) => {
                let last: Vec<Vec<u32>> = self
                    .fed
                    .iter()
                    .map(|f| vec![*f.last().expect("fed after prefill")])
                    .collect();
                policy
                    .model
                    .forward_last(Policy::tokens(&last, &device), &policy.rope, Some(cache))
            }
            None => {
                let rows: Vec<Vec<u32>> = self
                    .prompts
                    .iter()
                    .zip(&self.fed)
                    .map(|(p, f)| p.iter().chain(f).copied().collect())
                    .collect();
                let mut cache = KvCache::new(policy.config.num_hidden_layers);
                let logits = policy.model.forward_last(
                    Policy::tokens(&rows, &device),
                    &policy.rope,
                    Some(&mut cache),
                );
                self.cache = Some(cache);
                logits
            }
        };
        let v = logits.dims()[1];
        let last: Vec<f32> = logits
            .into_data()
            .try_into_vec::<f32>()
            .expect("logits are f32");
        let context = self.prompts[0].len() + self.fed[0].len() + 1;
        let max_new = self.sampler.params().max_new_tokens;
        for (i, row) in last.chunks_exact(v).enumerate() {
            let r = &mut self.responses[i];
            if r.finish.is_some() {
                let pad = *self.fed[i]
                    .last()
                    .or(self.prompts[i].last())
                    .expect("prompts are not empty");
                self.fed[i].push(pad);
                continue;
            }
            let (tok, lp) = self.sampler.sample(row);
            r.tokens.push(tok);
            r.logprobs.push(lp);
            r.versions.push(version);
            self.fed[i].push(tok);
            if self.sampler.params().stop_tokens.contains(&tok) {
                r.finish = Some(Finish::Stop);
            } else if r.tokens.len() >= max_new || context >= policy.config.max_position_embeddings
            {
                r.finish = Some(Finish::Length);
            }
        }
    }

    /// Steps until every response has finished.
    pub fn run(&mut self, policy: &Policy, version: u32) {
        while !self.is_done() {
            self.step(policy, version);
        }
    }
}
