//! One group, from prompt to scored rollouts, with nothing of gRPC in it:
//! K responses generated together, new weights taken between any two
//! tokens (partial or restart mode), then decoded, scored by the task's
//! verifier and packed for the wire.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use bapo_policy::{Finish, Generation, Response, SamplingParams, tokenizer::TextTokenizer};
use bapo_proto::{packed, v1};
use bapo_tasks::{Problem, Shaping, Task};
use metrics::counter;

use crate::{
    config::UpdateMode,
    metrics as names,
    subscription::{PolicyCell, Versioned},
};

pub enum Outcome {
    /// Finished responses, every token made by weights of `incarnation`.
    Done {
        responses: Vec<Response>,
        incarnation: u64,
    },
    /// Stopped by the abort flag; nothing to push.
    Aborted,
}

/// Generates `k` responses to `prompt` with `start`, asking `updates`
/// before every token whether newer weights have arrived. Weights of
/// another learner incarnation restart the group whatever the mode: its
/// tokens would otherwise span two lineages, whose version numbers mean
/// different weights.
pub fn generate(
    start: Arc<Versioned>,
    updates: &mut dyn FnMut() -> Option<Arc<Versioned>>,
    prompt: &[u32],
    k: usize,
    params: &SamplingParams,
    mode: UpdateMode,
    abort: &AtomicBool,
) -> Outcome {
    let mut current = start;
    let mut g = Generation::new(prompt.to_vec(), k, params.clone());
    while !g.is_done() {
        if abort.load(Ordering::Relaxed) {
            counter!(names::ABORTED_GROUPS).increment(1);
            return Outcome::Aborted;
        }
        if let Some(next) = updates()
            && next.differs(&current)
        {
            let new_lineage = next.incarnation != current.incarnation;
            current = next;
            match mode {
                UpdateMode::Partial if !new_lineage => g.invalidate_cache(),
                _ => {
                    counter!(names::ABORTED_GROUPS).increment(1);
                    g = Generation::new(prompt.to_vec(), k, params.clone());
                }
            }
        }
        g.step(&current.policy, current.version as u32);
    }
    Outcome::Done {
        responses: g.into_responses(),
        incarnation: current.incarnation,
    }
}

/// The update source of a generation that follows a weight subscription.
pub fn follow_cell(cell: &mut PolicyCell) -> impl FnMut() -> Option<Arc<Versioned>> + '_ {
    move || {
        if cell.has_changed().unwrap_or(false) {
            cell.borrow_and_update().clone()
        } else {
            None
        }
    }
}

/// What scoring needs besides the responses.
pub struct Scoring<'a> {
    pub task: &'a Arc<dyn Task>,
    pub tokenizer: &'a TextTokenizer,
    pub shaping: &'a Shaping,
    pub stop_tokens: &'a [u32],
    /// How the responses were sampled, recorded on every rollout so the
    /// learner can refuse data sampled at another temperature.
    pub sampling: &'a SamplingParams,
}

/// Where a group's rollouts come from.
pub struct Origin<'a> {
    pub group_id: &'a str,
    pub actor_id: &'a str,
    /// The learner incarnation whose weights made every token.
    pub incarnation: u64,
}

/// Scores responses and builds the group's wire rollouts.
pub fn score(
    s: &Scoring<'_>,
    problem: &Problem,
    prompt: &[u32],
    responses: Vec<Response>,
    origin: &Origin<'_>,
) -> Vec<v1::Rollout> {
    let prompt_bytes = packed::pack_u32(prompt);
    let sampling = v1::SamplingParams {
        temperature: s.sampling.temperature,
        top_k: u32::try_from(s.sampling.top_k).unwrap_or(u32::MAX),
        top_p: s.sampling.top_p,
    };
    let Origin {
        group_id,
        actor_id,
        incarnation,
    } = *origin;
    responses
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let visible: &[u32] = match r.tokens.last() {
                Some(t) if s.stop_tokens.contains(t) => &r.tokens[..r.tokens.len() - 1],
                _ => &r.tokens,
            };
            // An undecodable completion scores as wrong, never panics.
            let text = s.tokenizer.decode(visible).unwrap_or_default();
            let base = s.task.score(problem, &text);
            let reward = s
                .shaping
                .apply(base, s.task.well_formed(problem, &text), r.tokens.len());
            let finish = match r.finish {
                Some(Finish::Stop) => v1::FinishReason::Stop,
                Some(Finish::Length) => v1::FinishReason::Length,
                None => v1::FinishReason::Aborted,
            };
            v1::Rollout {
                rollout_id: format!("{group_id}/{i}"),
                group_id: group_id.to_string(),
                prompt_tokens: prompt_bytes.clone(),
                response_tokens: packed::pack_u32(&r.tokens),
                behavior_logprobs: packed::pack_f32(&r.logprobs),
                token_versions: packed::pack_u32(&r.versions),
                reward,
                token_rewards: Default::default(),
                finish_reason: finish as i32,
                actor_id: actor_id.to_string(),
                task: s.task.name().to_string(),
                metadata: [("problem_id".to_string(), problem.id.clone())].into(),
                learner_incarnation: incarnation,
                sampling: Some(sampling),
            }
        })
        .collect()
}
