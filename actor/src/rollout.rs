//! One group, from prompt to rollouts: K responses generated together, new
//! weights taken between any two tokens (partial or restart mode), then
//! decoded for a verifier ([`completions`]) and, once scored (see
//! [`crate::reward`]), packed for the wire ([`pack`]).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bapo_policy::{Finish, Generation, Response, SamplingParams, tokenizer::TextTokenizer};
use bapo_proto::{packed, v1};
use bapo_tasks::{Problem, Shaping};
use metrics::counter;

use crate::{
    metrics as names,
    reward::{Completion, Scored},
    subscription::{PolicyCell, Versioned},
    update_mode::UpdateMode,
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
        // The Burn engine's subscription loads every version as a model.
        let Some(policy) = current.policy() else {
            tracing::error!("v{}: weights not loaded as a model", current.version);
            return Outcome::Aborted;
        };
        g.step(policy, current.version as u32);
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

/// The completions of `responses` as a verifier sees them: decoded text
/// without the stop token (an undecodable one decodes as empty and scores
/// as wrong, never panics), the tokens as the learner sees them.
pub fn completions(
    tokenizer: &TextTokenizer,
    stop_tokens: &[u32],
    responses: &[Response],
) -> Vec<Completion> {
    responses
        .iter()
        .map(|r| {
            let visible: &[u32] = match r.tokens.last() {
                Some(t) if stop_tokens.contains(t) => &r.tokens[..r.tokens.len() - 1],
                _ => &r.tokens,
            };
            Completion {
                text: tokenizer.decode(visible).unwrap_or_default(),
                tokens: r.tokens.clone(),
                truncated: r.finish == Some(Finish::Length),
            }
        })
        .collect()
}

/// What packing a scored group needs besides the responses.
pub struct Packing<'a> {
    pub task: &'a str,
    pub shaping: &'a Shaping,
    /// How the responses were sampled, recorded on every rollout so the
    /// learner can refuse data sampled at another temperature.
    pub sampling: &'a SamplingParams,
    /// The reward's source, recorded on every rollout.
    pub source: &'a str,
}

/// Where a group's rollouts come from.
pub struct Origin<'a> {
    pub group_id: &'a str,
    pub actor_id: &'a str,
    /// The learner incarnation whose weights made every token.
    pub incarnation: u64,
}

/// A rollout's metadata: the problem, the reward's source, and each
/// sub-score as `reward.<name>`.
fn metadata(problem: &Problem, source: &str, scored: &Scored) -> HashMap<String, String> {
    let mut m: HashMap<String, String> = [
        ("problem_id".to_string(), problem.id.clone()),
        ("reward_source".to_string(), source.to_string()),
    ]
    .into();
    for (k, v) in &scored.sub_scores {
        m.insert(format!("reward.{k}"), v.to_string());
    }
    m
}

/// Builds the group's wire rollouts from its responses and their scores,
/// shaping laid on top of each score.
pub fn pack(
    p: &Packing<'_>,
    problem: &Problem,
    prompt: &[u32],
    responses: Vec<Response>,
    scores: Vec<Scored>,
    origin: &Origin<'_>,
) -> Vec<v1::Rollout> {
    let prompt_bytes = packed::pack_u32(prompt);
    let sampling = v1::SamplingParams {
        temperature: p.sampling.temperature,
        top_k: u32::try_from(p.sampling.top_k).unwrap_or(u32::MAX),
        top_p: p.sampling.top_p,
    };
    responses
        .into_iter()
        .zip(scores)
        .enumerate()
        .map(|(i, (r, scored))| {
            let reward = p
                .shaping
                .apply(scored.reward, scored.well_formed, r.tokens.len());
            let finish = match r.finish {
                Some(Finish::Stop) => v1::FinishReason::Stop,
                Some(Finish::Length) => v1::FinishReason::Length,
                None => v1::FinishReason::Aborted,
            };
            v1::Rollout {
                rollout_id: format!("{}/{i}", origin.group_id),
                group_id: origin.group_id.to_string(),
                prompt_tokens: prompt_bytes.clone(),
                response_tokens: packed::pack_u32(&r.tokens),
                behavior_logprobs: packed::pack_f32(&r.logprobs),
                token_versions: packed::pack_u32(&r.versions),
                reward,
                token_rewards: packed::pack_f32(&scored.token_rewards),
                finish_reason: finish as i32,
                actor_id: origin.actor_id.to_string(),
                task: p.task.to_string(),
                metadata: metadata(problem, p.source, &scored),
                learner_incarnation: origin.incarnation,
                sampling: Some(sampling),
                ..Default::default()
            }
        })
        .collect()
}
